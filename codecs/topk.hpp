// Exact top-k by magnitude on the CPU: radix select over topk_key with element.hpp's 11/11/10-bit
// digits, no sort. Ties at the threshold go to the lowest indices, so indices come out strictly
// increasing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "detail.hpp"

namespace gradzip::detail {

// Writes k indices to idx and k values (f32, or fp16 when fp16_values) to values, and updates
// the residual (when a.residual is set). cand: topk_workspace_bytes(n) bytes, 4-byte aligned.
void encode_topk(const CpuLoops& loops, EncodeArgs a, size_t n, uint64_t k, uint32_t* idx,
                 void* values, bool fp16_values, uint32_t* cand);

// Tests: how many encodes so far took the full radix select instead of the sampled path.
uint64_t topk_radix_runs();

}  // namespace gradzip::detail
