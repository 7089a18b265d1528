// Element-level math shared by the CPU codecs (codecs/) and the CUDA kernels (kernels/).
//
// Everything here is written once and compiled for both sides, so a payload encoded on the CPU
// decodes on the GPU bit for bit and the other way round. Rules that keep it that way:
//   * no fast-math; host code is built with -ffp-contract=off and nvcc with --fmad=false, so
//     `a * b + c` rounds twice on both sides;
//   * scales come from integer maxima of float bits (order-independent, NaN defined);
//   * the one sum (sign's mean |x|) uses the fixed 32-lane reduction tree documented below.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GZ_HD __host__ __device__ __forceinline__
#else
#define GZ_HD inline
#endif

namespace gradzip::element {

// ---- bit access -----------------------------------------------------------------------------
GZ_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

GZ_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;

// |x| as bits. Orders like |x| for non-NaN values; every NaN sorts above +Inf.
GZ_HD uint32_t abs_bits(float x) { return float_bits(x) & kAbsMask; }
GZ_HD bool is_finite(float x) { return abs_bits(x) < kInfBits; }

// ---- bf16: round to nearest even, NaN quieted (x86's VCVTNEPS2BF16 flushes denormals: not used)
GZ_HD uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & kAbsMask) > kInfBits) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
GZ_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// ---- fp16 (IEEE binary16): round to nearest even, overflow to Inf, NaN -> sign | 0x7E00 --------
// Branch-free (selects only) so that compilers vectorise it.
GZ_HD uint16_t float_to_fp16(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & kAbsMask;
  // normal half (|x| >= 2^-14): rebias the exponent 127 -> 15, round the 13 dropped bits RNE
  const uint32_t r = a - 0x38000000u;
  const uint32_t normal = (r + 0x0FFFu + ((r >> 13) & 1u)) >> 13;
  // subnormal half (|x| < 2^-14): x = m * 2^(e-150), in units of 2^-24 that is m >> (126 - e),
  // rounded to nearest even (a carry into 1024 is the smallest normal's bit pattern). The shift
  // is clamped to [1, 25]: at 25 every float below 2^-25 rounds to 0; normals are selected away.
  // Integer-only on purpose: mixing float arithmetic on the same value defeats GCC's vectoriser.
  const uint32_t e = a >> 23;
  uint32_t shift = e < 126u ? 126u - e : 1u;
  shift = shift > 25u ? 25u : shift;
  const uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
  const uint32_t subnormal = (m + ((1u << (shift - 1u)) - 1u) + ((m >> shift) & 1u)) >> shift;
  uint32_t h = a >= 0x38800000u ? normal : subnormal;
  h = a >= 0x477FF000u ? 0x7C00u : h;  // >= 65520 rounds to Inf
  h = a > kInfBits ? 0x7E00u : h;      // NaN
  return static_cast<uint16_t>(sign | h);
}

GZ_HD float fp16_to_float(uint16_t h) {  // branch-free, as float_to_fp16
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x03FFu;
  const uint32_t inf_nan = kInfBits | (m << 13);
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);
  // zero or subnormal: m * 2^-24 is exact in float
  const uint32_t subnormal =
      float_bits(static_cast<float>(static_cast<int32_t>(m)) * 5.9604644775390625e-08f);
  const uint32_t a = e == 0x1Fu ? inf_nan : (e != 0u ? normal : subnormal);
  return bits_float(sign | a);
}

// ---- blockwise int8 (absmax) ------------------------------------------------------------------
// scale = absmax / 127, q = clamp(rint(x * (127 / absmax)), -127, 127), decode = q * scale.
// absmax is the integer max of abs_bits over the block, so a NaN in the block makes the scale NaN
// and an Inf makes it Inf: every element of that block then decodes to NaN (0 * Inf, 0 * NaN),
// which keeps the non-finite value visible. Blocks with absmax below 2^-100 encode as zeros
// (127 / absmax would overflow); error feedback carries them.
constexpr uint32_t kInt8TinyBits = 0x0D800000u;  // 2^-100

GZ_HD float int8_scale(uint32_t absmax_bits) {
  if (absmax_bits < kInt8TinyBits) return 0.0f;
  const float scale = bits_float(absmax_bits) / 127.0f;
  // Near FLT_MAX the quotient rounds up and 127 * scale overflows: step one ulp down so that every
  // finite block decodes to finite values (found by the round-trip fuzzer).
  const bool overflows = absmax_bits < kInfBits && !is_finite(scale * 127.0f);
  return overflows ? bits_float(float_bits(scale) - 1u) : scale;
}
GZ_HD float int8_inv_scale(uint32_t absmax_bits) {
  if (absmax_bits < kInt8TinyBits || absmax_bits >= kInfBits) return 0.0f;
  return 127.0f / bits_float(absmax_bits);
}
GZ_HD int8_t int8_quantize(float x, float inv_scale) {
  float y = rintf(x * inv_scale);  // default rounding mode: nearest even
  y = y > 127.0f ? 127.0f : y;
  y = y < -127.0f ? -127.0f : y;
  y = (y == y) ? y : 0.0f;  // NaN (x non-finite, inv 0) -> 0; the block's scale carries the NaN
  return static_cast<int8_t>(y);
}
GZ_HD float int8_dequantize(int8_t q, float scale) { return static_cast<float>(q) * scale; }

// ---- 1-bit sign with per-block mean |x| ---------------------------------------------------------
// Bit order: word w, bit j holds element 32w + j (as __ballot_sync and AVX-512 compare masks).
// Bit = the float's sign bit (1 = negative, so -0.0 decodes to -scale).
// Block mean |x| uses one fixed reduction tree on both sides: 32 lanes; lane j sums |x| of block
// elements j, j+32, j+64, ... in increasing order (elements past the end count as +0.0); then
// for s = 16, 8, 4, 2, 1: lane[j] += lane[j + s] for j < s (= a warp's __shfl_down_sync tree);
// mean = lane[0] / (number of real elements in the block).
constexpr int kSignLanes = 32;

GZ_HD uint32_t sign_bit(float x) { return float_bits(x) >> 31; }
GZ_HD float sign_decode(uint32_t bit, float scale) { return bit ? -scale : scale; }

// Reduces 32 lane partial sums in place with the tree above; returns lane[0].
GZ_HD float sign_lane_tree(float* lanes) {
  for (int s = kSignLanes / 2; s >= 1; s /= 2)
    for (int j = 0; j < s; ++j) lanes[j] = lanes[j] + lanes[j + s];
  return lanes[0];
}

// ---- top-k by magnitude -----------------------------------------------------------------------
// Key = abs_bits(x): orders like |x|, NaN above Inf, so non-finite values are always picked first.
// Selection is exact: the k largest keys; ties at the threshold key go to the lowest indices, so
// indices come out strictly increasing and every implementation picks the same set.
// Radix select digits over the 31-bit key, most significant first: 11, 11, then 10 bits.
GZ_HD uint32_t topk_key(float x) { return abs_bits(x); }
constexpr int kTopkDigitShift[3] = {21, 10, 0};
constexpr uint32_t kTopkDigitMask[3] = {0x7FFu, 0x7FFu, 0x3FFu};
constexpr int kTopkRadix = 2048;  // histogram size of the widest digit

// ---- error feedback -------------------------------------------------------------------------
// c = grad * prescale + residual (two roundings, no fma); after encoding, the new residual is
// c - decode(payload) where that is finite, and the old residual where it is not: a non-finite
// gradient reaches the decoded output (so AMP's GradScaler sees it) but never poisons the residual.
// NaNs are made canonical (0x7FFFFFFF, what CUDA arithmetic returns) because x86 arithmetic keeps
// an operand's NaN payload instead: without this the wire bytes of a NaN input would differ
// between the CPU and the GPU.
constexpr uint32_t kCanonicalNaN = 0x7FFFFFFFu;
GZ_HD float canonical_nan(float x) { return x == x ? x : bits_float(kCanonicalNaN); }

// Encoder input without error feedback: c = grad * prescale.
GZ_HD float scaled_input(float grad, float prescale) { return canonical_nan(grad * prescale); }
// Encoder input with error feedback: c = grad * prescale + residual.
GZ_HD float ef_input(float grad, float prescale, float residual) {
  const float scaled = grad * prescale;
  return canonical_nan(scaled + residual);
}
GZ_HD float ef_residual(float c, float decoded, float old_residual) {
  const float r = c - decoded;
  return is_finite(r) ? r : old_residual;
}

}  // namespace gradzip::element
