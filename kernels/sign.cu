// 1-bit sign (mean |x|) encoder with fused error feedback. One warp per codec block, one pass over
// memory: the warp computes c, reduces the block's mean |c| with the fixed 32-lane tree of
// gradzip/codec/sign.hpp, writes the sign words and, with error feedback, the residual from the
// values it kept in registers (the first 1024 elements of a block, the default block size).
#include "blockwise.cuh"

namespace gradzip::kernels {
namespace {

// Lane j owns elements j, j+32, ... of its block (the fixed tree of codec/sign.hpp).
// Loads come in batches of steps issued before any step is processed (a step may store sign
// words, and the compiler cannot move a load above a store that might alias it), so a lane has a
// batch of independent loads in flight. With error feedback the first batch is the register
// cache the residual update reuses (1024 elements, the default block); without it nothing is
// kept, and the batch is small.
constexpr int kCachedSign = 32;  // steps of 32 elements kept with error feedback
constexpr int kBatchSign = 8;    // steps per batch without error feedback

template <bool Ef>
__global__ void __launch_bounds__(kThreads)
    sign_encode_kernel(Source src, size_t n, uint32_t block, uint64_t section1, uint8_t* out,
                       HeaderWords header, uint32_t pad_begin, uint32_t pad_end) {
  constexpr int kFirst = Ef ? kCachedSign : kBatchSign;  // steps of the first batch
  write_header(out, header, pad_begin, pad_end);
  BlockGeom g;
  if (!warp_block(n, block, g)) return;
  const uint32_t steps = (g.m + 31) / 32;
  uint32_t* words = reinterpret_cast<uint32_t*>(out + kHeaderBytes + section1) + g.start / 32;

  // Loads steps [first, first + B) of this lane (0 past the block's end).
  auto load_batch = [&](uint32_t first, auto& c, auto& r) {
    constexpr int B = sizeof(c) / sizeof(c[0]);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const uint32_t off = (first + b) * 32 + g.lane;
      float c1[1], r1[1];
      src.load<1, false>(g.start + off, off < g.m ? 1 : 0, c1, r1);
      c[b] = c1[0];
      r[b] = r1[0];
    }
  };
  float sum = 0.0f;     // this lane's partial sum of |c|, in element order
  uint32_t word = 0;    // lane l keeps the sign word of step (32t + l)
  // One step: 32 consecutive elements, one per lane.
  auto step = [&](uint32_t s, float c) {
    const uint32_t off = s * 32 + g.lane;
    const bool valid = off < g.m;
    if (valid) sum = sum + el::bits_float(el::abs_bits(c));
    const uint32_t w = __ballot_sync(kFullMask, valid && el::sign_bit(c));
    if (g.lane == s % 32) word = w;
    if (s % 32 == 31 || s + 1 == steps) {  // flush the words of the last up to 32 steps
      const uint32_t first = s - s % 32;
      if (g.lane <= s % 32) words[first + g.lane] = word;
    }
  };
  auto run_batch = [&](uint32_t first, const auto& c) {
    constexpr int B = sizeof(c) / sizeof(c[0]);
#pragma unroll
    for (int b = 0; b < B; ++b)
      if (first + b < steps) step(first + b, c[b]);
  };

  float cc[kFirst], rc[kFirst];
  load_batch(0, cc, rc);
  run_batch(0, cc);
  for (uint32_t first = kFirst; first < steps; first += kBatchSign) {
    float c[kBatchSign], r[kBatchSign];
    load_batch(first, c, r);
    run_batch(first, c);
  }

#pragma unroll
  for (int o = el::kSignLanes / 2; o >= 1; o /= 2) sum = sum + __shfl_down_sync(kFullMask, sum, o);
  const float mean = __shfl_sync(kFullMask, sum, 0) / static_cast<float>(g.m);
  if (g.lane == 0) reinterpret_cast<float*>(out + kHeaderBytes)[g.blk] = mean;
  if constexpr (Ef) {
    auto update = [&](uint32_t s, float c, float r) {
      const uint32_t off = s * 32 + g.lane;
      if (off >= g.m) return;
      src.residual[g.start + off] = el::ef_residual(c, el::sign_decode(el::sign_bit(c), mean), r);
    };
#pragma unroll
    for (int s = 0; s < kCachedSign; ++s)
      if (s < static_cast<int>(steps)) update(s, cc[s], rc[s]);
    for (uint32_t s = kCachedSign; s < steps; ++s) {
      float c[1], r[1];
      const uint32_t off = s * 32 + g.lane;
      src.load<1, false>(g.start + off, off < g.m ? 1 : 0, c, r);
      update(s, c[0], r[0]);
    }
  }
}

}  // namespace

void launch_encode(SignCodec, const EncodeLaunch& a) {
  launch_blockwise(a.residual ? sign_encode_kernel<true> : sign_encode_kernel<false>, a);
}

}  // namespace gradzip::kernels
