// Device helpers of the blockwise encoders (int8.cu, sign.cu): one warp per codec block, and the
// grid and header padding of such a launch. Included only by those two files.
#pragma once

#include "common.cuh"

namespace gradzip::kernels {

constexpr int kWarps = kThreads / 32;

struct BlockGeom {
  uint64_t blk;    // codec block of this warp
  size_t start;    // its first element
  uint32_t m;      // its number of real elements
  unsigned lane;
};

__device__ __forceinline__ bool warp_block(size_t n, uint32_t block, BlockGeom& g) {
  g.blk = static_cast<uint64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  g.lane = threadIdx.x & 31;
  if (g.blk >= ceil_div(n, block)) return false;
  g.start = g.blk * block;
  const uint64_t left = n - g.start;
  g.m = left < block ? static_cast<uint32_t>(left) : block;
  return true;
}

// A launch of one warp per codec block; block 0 zeroes the padding after the scales.
struct Blockwise {
  uint32_t pad_begin, pad_end;
  unsigned grid;
};
inline Blockwise geometry(size_t n, uint32_t block, uint64_t section1) {
  const uint64_t nb = ceil_div(n, block);
  return {static_cast<uint32_t>(4 * nb), static_cast<uint32_t>(section1), grid_for(nb, kWarps)};
}

}  // namespace gradzip::kernels
