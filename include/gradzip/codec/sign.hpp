// 1-bit sign: per block of `block` elements one f32 scale (mean |x|), then one bit per element.
#pragma once

#include "gradzip/codec/blockwise.hpp"
#include "gradzip/element.hpp"
#include "gradzip/wire_types.hpp"

namespace gradzip {
namespace element {

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

}  // namespace element

// Payload: ceil(n / block) f32 scales, padding to 16 bytes, then ceil(n / 32) u32 sign words.
struct SignCodec : BlockwiseWire<uint32_t, 32> {
  static constexpr CodecKind kind = CodecKind::sign;
  static constexpr const char* spec_name = "sign";
  static constexpr uint32_t default_block = 1024;
  // The scales' padding is zero, and so are the bits of the last word past the count.
  static GZ_HD WireCheck check_padding(const WireHeader& h, const uint8_t* payload) {
    const WireCheck r = check_scale_padding(h, payload);
    if (r.status != WireStatus::ok) return r;
    const uint64_t bytes = layout(h.count, h.param, 0).bytes;
    if (h.count % 32 != 0 && (load_u32(payload + bytes - 4) >> (h.count % 32)) != 0)
      return {WireStatus::bad_padding, bytes - 4};
    return {WireStatus::ok, 0};
  }

  // Decodes single elements of a validated payload, all in the block and the sign word of
  // element `first`.
  struct ElementDecoder {
    uint32_t word;
    float scale;
    GZ_HD float operator()(uint64_t e) const {
      return element::sign_decode((word >> (e % 32)) & 1u, scale);
    }
  };
  static GZ_HD ElementDecoder element_decoder(const WireHeader& h, const uint8_t* payload,
                                              uint64_t first) {
    return {words(payload, h.count, h.param)[first / 32], scales(payload)[block_of(first, h.param)]};
  }
};

}  // namespace gradzip
