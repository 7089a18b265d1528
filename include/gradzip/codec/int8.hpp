// Blockwise int8 (absmax): per block of `block` elements one f32 scale, then one int8 per element.
#pragma once

#include "gradzip/codec/blockwise.hpp"
#include "gradzip/element.hpp"
#include "gradzip/wire_types.hpp"

namespace gradzip {
namespace element {

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
  const uint32_t keep = ((y == y) & (a != 0u)) ? 0xFFFFFFFFu : 0u;
  return bits_float(((float_bits(y) & ~kAbsMask) | mag) & keep);
}
GZ_HD int8_t int8_quantize(float x, float inv_scale) {
  return static_cast<int8_t>(int8_level(x, inv_scale));
}
GZ_HD float int8_level_value(float level, float scale) { return level * scale; }
GZ_HD float int8_dequantize(int8_t q, float scale) {
  return int8_level_value(static_cast<float>(q), scale);
}

}  // namespace element

// Payload: ceil(n / block) f32 scales, padding to 16 bytes, then n int8.
struct Int8Codec : BlockwiseWire<int8_t, 1> {
  static constexpr CodecKind kind = CodecKind::int8;
  static constexpr const char* spec_name = "int8";
  static constexpr uint32_t default_block = 256;
  static GZ_HD WireCheck check_padding(const WireHeader& h, const uint8_t* payload) {
    return check_scale_padding(h, payload);
  }

  // Decodes single elements of a validated payload, all in the block of element `first`.
  struct ElementDecoder {
    const int8_t* q;
    float scale;
    GZ_HD float operator()(uint64_t e) const { return element::int8_dequantize(q[e], scale); }
  };
  static GZ_HD ElementDecoder element_decoder(const WireHeader& h, const uint8_t* payload,
                                              uint64_t first) {
    return {words(payload, h.count, h.param), scales(payload)[block_of(first, h.param)]};
  }
};

}  // namespace gradzip
