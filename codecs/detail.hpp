// Internal interfaces of the CPU path: the per-ISA table of CPU loops and the helpers shared by
// the orchestration code (encode.cpp, decode.cpp, topk.cpp) and the loops (cpu_loops.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradzip/element.hpp"

namespace gradzip::detail {

// The encoders' input: c[i] = grad[i] * prescale (+ residual[i] when residual is non-null).
// Pointers are already offset to the range a kernel works on.
struct EncodeArgs {
  const float* grad;
  float* residual;  // null: plain encode, no residual read or written
  float prescale;
};

// c of one element, exactly as the fused encoders compute it (element.hpp's rule).
inline float encode_input(const EncodeArgs& a, size_t i) {
  return a.residual ? element::ef_input(a.grad[i], a.prescale, a.residual[i])
                    : element::scaled_input(a.grad[i], a.prescale);
}

// One table per instruction set; the same source (cpu_loops.hpp) compiled with different
// -m flags. Every function works on one contiguous range; threads are the caller's business.
struct CpuLoops {
  const char* isa;
  // Casts: n values.
  void (*encode_fp32)(EncodeArgs a, size_t n, float* out);
  void (*encode_fp16)(EncodeArgs a, size_t n, uint16_t* out);
  void (*encode_bf16)(EncodeArgs a, size_t n, uint16_t* out);
  // Blockwise codecs: the range starts on a block boundary; scales gets ceil(n / block) values.
  void (*encode_int8)(EncodeArgs a, size_t n, uint32_t block, float* scales, int8_t* q);
  void (*encode_sign)(EncodeArgs a, size_t n, uint32_t block, float* scales, uint32_t* words);
  // Decoders: out = decoded (add == false) or out += decoded (add == true).
  void (*decode_fp32)(const float* in, size_t n, float* out, bool add);
  void (*decode_fp16)(const uint16_t* in, size_t n, float* out, bool add);
  void (*decode_bf16)(const uint16_t* in, size_t n, float* out, bool add);
  void (*decode_int8)(const float* scales, const int8_t* q, size_t n, uint32_t block, float* out,
                      bool add);
  void (*decode_sign)(const float* scales, const uint32_t* words, size_t n, uint32_t block,
                      float* out, bool add);
  // Top-k pass 1: hist[topk_key(c) >> 21] += 1 for the n elements (hist has kTopkRadix entries).
  void (*topk_hist0)(EncodeArgs a, size_t n, uint32_t* hist);
  // Top-k pass 2: writes base + i for every element whose first digit equals d0 to cand (in
  // index order) and returns their number; *above gets the count of first digits above d0.
  size_t (*topk_collect)(EncodeArgs a, size_t n, uint32_t base, uint32_t d0, uint32_t* cand,
                         uint64_t* above);
  // Top-k final pass: keeps keys > threshold and the first `ties` keys == threshold, writing
  // their indices (base + i) and values; updates the residual of every element. Returns the
  // number kept.
  size_t (*topk_emit)(EncodeArgs a, size_t n, uint32_t base, uint32_t threshold, uint64_t ties,
                      uint32_t* idx, void* values, bool fp16_values);
  // Sampled top-k pass 1: stores base + i and the bits of c[i] for the first `cap` elements whose
  // key is >= lo (index order); returns how many such elements there are.
  size_t (*topk_gather)(EncodeArgs a, size_t n, uint32_t base, uint32_t lo, size_t cap,
                        uint32_t* idx, uint32_t* bits);
  // Sampled top-k, error feedback: the residual of every element, given the sorted global
  // indices of the kept ones (their value is c, or fp16(c) when fp16_values).
  void (*topk_residual)(EncodeArgs a, size_t n, uint32_t base, const uint32_t* kept,
                        size_t kept_count, bool fp16_values);
};

const CpuLoops& cpu_loops_portable();
const CpuLoops& cpu_loops_avx2();
const CpuLoops& cpu_loops_avx512();

// The table picked for this CPU (GRADZIP_CPU_ISA=portable|avx2|avx512 can force a lower one).
const CpuLoops& cpu_loops();
// Tests: switch the table; returns false when the CPU lacks the instruction set.
bool force_isa(const char* name);

}  // namespace gradzip::detail
