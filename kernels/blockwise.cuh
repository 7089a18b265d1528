// What the blockwise encoders (int8.cu, sign.cu) share: one warp per codec block, and the launch
// of such a kernel with its grid and header padding. Included only by those two files.
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

// The encode kernel of a blockwise codec: (src, n, block, section1, out, header, pad_begin,
// pad_end), where the payload's words start at section1 and [pad_begin, pad_end) is the padding
// after the scales, which block 0 zeroes.
using BlockwiseKernel = void(Source, size_t, uint32_t, uint64_t, uint8_t*, HeaderWords, uint32_t,
                             uint32_t);

// Launches kernel with one warp per codec block of the message that a describes.
inline void launch_blockwise(BlockwiseKernel* kernel, const EncodeLaunch& a) {
  const Source src{a.grad, a.residual, a.prescale};
  const uint32_t block = a.param;
  const uint64_t section1 = a.layout.section1;
  const uint64_t blocks = ceil_div(a.n, block);
  const auto pad_begin = static_cast<uint32_t>(4 * blocks);
  kernel<<<grid_for(blocks, kWarps), kThreads, 0, a.stream>>>(
      src, a.n, block, section1, a.out, a.header, pad_begin, static_cast<uint32_t>(section1));
}

}  // namespace gradzip::kernels
