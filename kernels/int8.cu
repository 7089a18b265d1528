// Blockwise int8 (absmax) encoder with fused error feedback. One warp per codec block, one pass
// over memory: the warp computes c, reduces the block's scale (integer max of |c| bits), then
// quantises from the values it kept in registers (the first 256 elements of a block; larger
// blocks re-read their tail, which is then in L1/L2) and writes payload and residual.
#include "blockwise.cuh"

namespace gradzip::kernels {
namespace {

// A lane handles 4 consecutive elements per step of 128.
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

}  // namespace

void launch_encode(Int8Codec, const EncodeLaunch& a) {
  launch_blockwise(a.vec ? int8_encode_kernel<true> : int8_encode_kernel<false>, a);
}

}  // namespace gradzip::kernels
