// Blockwise int8 (absmax) and 1-bit sign (mean |x|) encoders with fused error feedback.
// One warp per codec block, one pass over memory: the warp computes c, reduces the block's scale
// (integer max of |c| bits for int8, element.hpp's fixed 32-lane tree for sign's mean |x|), then
// quantises from the values it kept in registers (the first 256 / 1024 elements of a block; larger
// blocks re-read their tail, which is then in L1/L2) and writes payload and residual.
#include "common.cuh"

namespace gradzip::kernels {
namespace {

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

// ---- int8: lane handles 4 consecutive elements per step of 128 -------------------------------
constexpr int kV8 = 4;
constexpr int kStep8 = 32 * kV8;
constexpr int kCached8 = 2;  // steps kept in registers: 256 elements (the default block)

template <bool Vec>
__global__ void __launch_bounds__(kThreads)
    int8_encode_kernel(Source src, size_t n, uint32_t block, uint64_t section1, uint8_t* out,
                       HeaderWords header, uint32_t pad_begin, uint32_t pad_end) {
  write_header(out, header, pad_begin, pad_end);
  BlockGeom g;
  if (!warp_block(n, block, g)) return;
  auto valid_at = [&](uint32_t off) { return off < g.m ? min(kV8, static_cast<int>(g.m - off)) : 0; };

  float cc[kCached8][kV8], rc[kCached8][kV8];
  uint32_t amax = 0;
#pragma unroll
  for (int s = 0; s < kCached8; ++s) {
    const uint32_t off = s * kStep8 + g.lane * kV8;
    const int valid = valid_at(off);
    src.load<kV8, Vec>(g.start + off, valid, cc[s], rc[s]);
#pragma unroll
    for (int j = 0; j < kV8; ++j)
      if (j < valid) amax = max(amax, el::abs_bits(cc[s][j]));
  }
  for (uint32_t base = kCached8 * kStep8; base < g.m; base += kStep8) {
    const uint32_t off = base + g.lane * kV8;
    const int valid = valid_at(off);
    float c[kV8], r[kV8];
    src.load<kV8, Vec>(g.start + off, valid, c, r);
#pragma unroll
    for (int j = 0; j < kV8; ++j)
      if (j < valid) amax = max(amax, el::abs_bits(c[j]));
  }
  amax = __reduce_max_sync(kFullMask, amax);

  const float scale = el::int8_scale(amax);
  const float inv = el::int8_inv_scale(amax);
  uint8_t* payload = out + kHeaderBytes;
  if (g.lane == 0) reinterpret_cast<float*>(payload)[g.blk] = scale;
  int8_t* q = reinterpret_cast<int8_t*>(payload + section1) + g.start;

  auto emit = [&](uint32_t off, int valid, const float(&c)[kV8], const float(&r)[kV8]) {
    int8_t qq[kV8];
    float nr[kV8];
#pragma unroll
    for (int j = 0; j < kV8; ++j) {
      qq[j] = el::int8_quantize(c[j], inv);
      nr[j] = el::ef_residual(c[j], el::int8_dequantize(qq[j], scale), r[j]);
    }
    if (Vec && valid == kV8) {
      *reinterpret_cast<uint32_t*>(q + off) =
          uint32_t{static_cast<uint8_t>(qq[0])} | (uint32_t{static_cast<uint8_t>(qq[1])} << 8) |
          (uint32_t{static_cast<uint8_t>(qq[2])} << 16) | (uint32_t{static_cast<uint8_t>(qq[3])} << 24);
    } else {
#pragma unroll
      for (int j = 0; j < kV8; ++j)
        if (j < valid) q[off + j] = qq[j];
    }
    src.store_residual<kV8, Vec>(g.start + off, valid, nr);
  };
#pragma unroll
  for (int s = 0; s < kCached8; ++s) {
    const uint32_t off = s * kStep8 + g.lane * kV8;
    emit(off, valid_at(off), cc[s], rc[s]);
  }
  for (uint32_t base = kCached8 * kStep8; base < g.m; base += kStep8) {
    const uint32_t off = base + g.lane * kV8;
    const int valid = valid_at(off);
    float c[kV8], r[kV8];
    src.load<kV8, Vec>(g.start + off, valid, c, r);
    emit(off, valid, c, r);
  }
}

// ---- sign: lane j owns elements j, j+32, ... of its block (the fixed tree of element.hpp) ------
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

struct Blockwise {
  uint32_t pad_begin, pad_end;
  unsigned grid;
};
Blockwise geometry(size_t n, uint32_t block, uint64_t section1) {
  const uint64_t nb = ceil_div(n, block);
  return {static_cast<uint32_t>(4 * nb), static_cast<uint32_t>(section1), grid_for(nb, kWarps)};
}

}  // namespace

void launch_int8_encode(const EncodeLaunch& a, uint32_t block, uint64_t section1) {
  const Source src{a.grad, a.residual, a.prescale};
  const Blockwise b = geometry(a.n, block, section1);
  auto* kernel = a.vec ? int8_encode_kernel<true> : int8_encode_kernel<false>;
  kernel<<<b.grid, kThreads, 0, a.stream>>>(src, a.n, block, section1, a.out, a.header, b.pad_begin,
                                            b.pad_end);
}

void launch_sign_encode(const EncodeLaunch& a, uint32_t block, uint64_t section1) {
  const Source src{a.grad, a.residual, a.prescale};
  const Blockwise b = geometry(a.n, block, section1);
  auto* kernel = a.residual ? sign_encode_kernel<true> : sign_encode_kernel<false>;
  kernel<<<b.grid, kThreads, 0, a.stream>>>(src, a.n, block, section1, a.out, a.header, b.pad_begin,
                                            b.pad_end);
}

}  // namespace gradzip::kernels
