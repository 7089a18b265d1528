// Exact top-k by magnitude on the CPU: radix select over topk_key with codec/topk.hpp's
// 11/11/10-bit digits, no sort. Ties at the threshold go to the lowest indices, so indices come
// out strictly increasing. The passes each instruction set provides (loops/topk.hpp) and the
// selection over threads and chunks (topk.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "detail.hpp"

namespace gradzip::detail {

struct TopkLoops {
  // Pass 1: hist[topk_key(c) >> 21] += 1 for the n elements (hist has kTopkRadix entries).
  void (*hist0)(EncodeArgs a, size_t n, uint32_t* hist);
  // Pass 2: writes base + i for every element whose first digit equals d0 to cand (in index
  // order) and returns their number; *above gets the count of first digits above d0.
  size_t (*collect)(EncodeArgs a, size_t n, uint32_t base, uint32_t d0, uint32_t* cand,
                    uint64_t* above);
  // Final pass: keeps keys > threshold and the first `ties` keys == threshold, writing their
  // indices (base + i) and values (element::topk_put_value); updates the residual of every
  // element. Returns the number kept.
  size_t (*emit)(EncodeArgs a, size_t n, uint32_t base, uint32_t threshold, uint64_t ties,
                 uint32_t* idx, void* values, TopkValues v);
  // Sampled top-k pass 1: stores base + i and the bits of c[i] for the first `cap` elements
  // whose key is >= lo (index order); returns how many such elements there are.
  size_t (*gather)(EncodeArgs a, size_t n, uint32_t base, uint32_t lo, size_t cap, uint32_t* idx,
                   uint32_t* bits);
  // Sampled top-k, error feedback: the residual of every element, given the sorted global
  // indices of the kept ones (c minus element::topk_value_decoded; int8 values: int8_amax holds
  // each index chunk's max kept key).
  void (*residual)(EncodeArgs a, size_t n, uint32_t base, const uint32_t* kept, size_t kept_count,
                   TopkValues v, const uint32_t* int8_amax);
};

// Writes the k indices and values and updates the residual (when job.a.residual is set); the
// workspace holds encode_workspace_bytes(TopkCodec{}, n, k) bytes (topk_plan.hpp).
void encode_cpu(TopkCodec, const CpuEncode& job);
// Zeroes the output (decode) or keeps it (decode_add), then scatters the kept values.
void decode_cpu(TopkCodec, const CpuDecode& job);

// Tests: how many encodes so far took the full radix select instead of the sampled path.
uint64_t topk_radix_runs();

}  // namespace gradzip::detail
