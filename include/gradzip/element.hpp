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
// The NaN test is a float compare: as an integer compare on the bits, GCC narrows both arms to
// 16 bits before selecting and the vectorised loop runs at half the speed.
GZ_HD uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(x != x ? ((u >> 16) | 0x0040u) : rounded);
}
GZ_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// ---- fp16 (IEEE binary16): round to nearest even, overflow to Inf, NaN -> sign | 0x7E00 --------
// The rounding is one float addition (the method of Marat Dukhan's FP16 library): |x| * 4 plus a
// power of two whose ulp is the half's ulp at |x|'s exponent (never finer than the subnormal
// ulp 2^-24) rounds in hardware, and the sum's exponent and top mantissa bits, added, are the
// half's bits (a rounding carry moves into the exponent by itself). Scaling by 2^112 first turns
// every |x| >= 2^16 into Inf. Exact for every input under round-to-nearest without flush-to-zero
// (the CPU entry points make sure of both, CUDA's default); as fast as integer-only rounding is
// not (variable shifts for the subnormals), and GCC vectorises it. Tested against F16C on all
// 2^32 inputs.
GZ_HD uint16_t float_to_fp16(float x) {
  const uint32_t u = float_bits(x);
  const float scaled = (bits_float(u & kAbsMask) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t exp2 = u + u;  // exponent in the top 8 bits, sign dropped
  uint32_t bias = exp2 & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;  // half's smallest normal exponent
  const uint32_t sum = float_bits(bits_float((bias >> 1) + 0x07800000u) + scaled);
  // The half is put together in the top 16 bits and shifted down once: put together in the low
  // 16, GCC narrows every term to 16 bits before combining them (four packs instead of one).
  const uint32_t h = ((sum << 3) & 0x7C000000u) + ((sum << 16) & 0x0FFF0000u);
  return static_cast<uint16_t>(((u & 0x80000000u) | (x != x ? 0x7E000000u : h)) >> 16);
}

// Normal halves: the bits shifted into a float's place (exponent rebias by one multiply by
// 2^-112, exact); subnormals: 0.5 + m * 2^-24 built from bits, minus 0.5 (exact); Inf and NaN:
// the payload kept, by a select (a multiply would quiet a signalling NaN). Exact on all 65536
// inputs (tested), and about a third faster vectorised than integer selects on the exponent.
GZ_HD float fp16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t two_w = w + w;  // exponent and mantissa at the top, sign dropped
  const float normal = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t inf_nan = kInfBits | ((two_w >> 4) & 0x007FFFFFu);
  uint32_t a = two_w < (1u << 27) ? float_bits(subnormal) : float_bits(normal);
  a = two_w >= 0xF8000000u ? inf_nan : a;
  return bits_float((w & 0x80000000u) | a);
}

// ---- the three casts as one shape: a wire type, its rounding and its widening ----------------
// (the CPU loops and the CUDA kernel of fp32 / fp16 / bf16 are each one template over these)
struct Fp32Cast {
  using Wire = float;
  static GZ_HD Wire encode(float c) { return c; }
  static GZ_HD float decode(Wire v) { return v; }
};
struct Fp16Cast {
  using Wire = uint16_t;
  static GZ_HD Wire encode(float c) { return float_to_fp16(c); }
  static GZ_HD float decode(Wire v) { return fp16_to_float(v); }
};
struct Bf16Cast {
  using Wire = uint16_t;
  static GZ_HD Wire encode(float c) { return float_to_bf16(c); }
  static GZ_HD float decode(Wire v) { return bf16_to_float(v); }
};

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
// The quantisation level of x as a float (an integer in [-127, 127]): the int8 on the wire, and
// what an encoder multiplies by the scale for the residual without converting the int8 back.
constexpr uint32_t kInt8LevelMaxBits = 0x42FE0000u;  // 127.0f
GZ_HD float int8_level(float x, float inv_scale) {
  const float y = rintf(x * inv_scale);  // default rounding mode: nearest even
  // Clamped to [-127, 127] on the bits (|y| by an unsigned min, sign kept; +-Inf -> +-127); NaN
  // (x non-finite, inv 0) and -0 cleared to +0 by a mask (the int8 0 decodes to +0, and the
  // residual c - 0 * scale must have the bits of c - (+0)); the block's scale carries the NaN.
  // Written as float selects, GCC moves them past the int8 conversion and narrows every mask
  // (2-3x slower).
  const uint32_t a = abs_bits(y);
  const uint32_t mag = a < kInt8LevelMaxBits ? a : kInt8LevelMaxBits;
  const uint32_t keep = (y == y) & (a != 0u) ? 0xFFFFFFFFu : 0u;
  return bits_float(((float_bits(y) & ~kAbsMask) | mag) & keep);
}
GZ_HD int8_t int8_quantize(float x, float inv_scale) {
  return static_cast<int8_t>(int8_level(x, inv_scale));
}
GZ_HD float int8_level_value(float level, float scale) { return level * scale; }
GZ_HD float int8_dequantize(int8_t q, float scale) {
  return int8_level_value(static_cast<float>(q), scale);
}

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
// Written out stride by stride: with constant trip counts GCC keeps the tree in registers (as a
// loop over s it goes through the stack, slower than the rest of a 32-element block's encode).
GZ_HD float sign_lane_tree(float* lanes) {
  static_assert(kSignLanes == 32, "the tree below has 5 levels");
  for (int j = 0; j < 16; ++j) lanes[j] = lanes[j] + lanes[j + 16];
  for (int j = 0; j < 8; ++j) lanes[j] = lanes[j] + lanes[j + 8];
  for (int j = 0; j < 4; ++j) lanes[j] = lanes[j] + lanes[j + 4];
  for (int j = 0; j < 2; ++j) lanes[j] = lanes[j] + lanes[j + 2];
  return lanes[0] + lanes[1];
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
// Values on the wire: the kept c as f32, or (values=fp16) as Fp16Cast rounds it. topk_put_value
// writes slot j and returns what it decodes to (error feedback keeps c minus that).
GZ_HD float topk_put_value(void* values, uint64_t j, float c, bool fp16) {
  if (fp16) {
    const Fp16Cast::Wire h = Fp16Cast::encode(c);
    static_cast<Fp16Cast::Wire*>(values)[j] = h;
    return Fp16Cast::decode(h);
  }
  static_cast<float*>(values)[j] = c;
  return c;
}
GZ_HD float topk_value_decoded(float c, bool fp16) {
  return fp16 ? Fp16Cast::decode(Fp16Cast::encode(c)) : c;
}
GZ_HD float topk_get_value(const void* values, uint64_t j, bool fp16) {
  return fp16 ? Fp16Cast::decode(static_cast<const Fp16Cast::Wire*>(values)[j])
              : static_cast<const float*>(values)[j];
}

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
