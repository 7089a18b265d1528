// Top-k by magnitude: the k largest |x| as k u32 indices, then k values (f32, or fp16 when the
// header's flag kTopkFlagFp16Values is set). The header's param is k.
#pragma once

#include "gradzip/codec/cast.hpp"
#include "gradzip/element.hpp"
#include "gradzip/wire_types.hpp"

namespace gradzip {
namespace element {

// ---- top-k by magnitude -----------------------------------------------------------------------
// Key = abs_bits(x): orders like |x|, NaN above Inf, so non-finite values are always picked first.
// Selection is exact: the k largest keys; ties at the threshold key go to the lowest indices, so
// indices come out strictly increasing and every implementation picks the same set.
// Radix select digits over the 31-bit key, most significant first: 11, 11, then 10 bits.
GZ_HD uint32_t topk_key(float x) { return abs_bits(x); }
constexpr int kTopkDigitShift[3] = {21, 10, 0};
constexpr uint32_t kTopkDigitMask[3] = {0x7FFu, 0x7FFu, 0x3FFu};
constexpr int kTopkRadix = 2048;  // histogram size of the widest digit
// Values on the wire: the kept c as f32, or (values=fp16) as Fp16Codec rounds it. topk_put_value
// writes slot j and returns what it decodes to (error feedback keeps c minus that).
GZ_HD float topk_put_value(void* values, uint64_t j, float c, bool fp16) {
  if (fp16) {
    const Fp16Codec::Wire h = Fp16Codec::encode(c);
    static_cast<Fp16Codec::Wire*>(values)[j] = h;
    return Fp16Codec::decode(h);
  }
  static_cast<float*>(values)[j] = c;
  return c;
}
GZ_HD float topk_value_decoded(float c, bool fp16) {
  return fp16 ? Fp16Codec::decode(Fp16Codec::encode(c)) : c;
}
GZ_HD float topk_get_value(const void* values, uint64_t j, bool fp16) {
  return fp16 ? Fp16Codec::decode(static_cast<const Fp16Codec::Wire*>(values)[j])
              : static_cast<const float*>(values)[j];
}

}  // namespace element

struct TopkCodec {
  static constexpr CodecKind kind = CodecKind::topk;
  static constexpr const char* spec_name = "topk";
  // Facts (see visit.hpp): index/value pairs. Summed at a shard's owner and re-encoded, W ranks'
  // selections would be selected again (and the union lost), so an all-reduce all-gathers every
  // rank's message of the whole bucket instead.
  static constexpr bool block_scaled = false;
  static constexpr bool summable = false;
  static constexpr bool sparse = true;
  static constexpr bool all_gathered = true;
  // Payload: k u32 indices, then k values.
  static GZ_HD constexpr PayloadLayout layout(uint64_t /*n*/, uint32_t k, bool fp16_values) {
    PayloadLayout l{};
    l.section1 = 4ull * k;
    l.bytes = l.section1 + (fp16_values ? 2ull : 4ull) * k;
    return l;
  }
  static GZ_HD constexpr WireCheck check_params(const WireHeader& h) {
    if (h.count > kTopkMaxCount) return {WireStatus::bad_count, h.count};
    if (h.count == 0 ? h.param != 0 : (h.param == 0 || h.param > h.count))
      return {WireStatus::bad_k, h.param};
    if ((h.flags & ~kTopkFlagFp16Values) != 0) return {WireStatus::bad_flags, h.flags};
    return {WireStatus::ok, 0};
  }
  // No padding; the indices are checked one by one (check_index).
  static GZ_HD constexpr WireCheck check_padding(const WireHeader&, const uint8_t*) {
    return {WireStatus::ok, 0};
  }

  // Element by element, every value decodes to 0: the kept values are scattered afterwards.
  struct ElementDecoder {
    GZ_HD float operator()(uint64_t /*e*/) const { return 0.0f; }
  };
  static GZ_HD ElementDecoder element_decoder(const WireHeader&, const uint8_t*, uint64_t) {
    return {};
  }
};

// Top-k index j of a message of `count` elements: below count and above index j - 1.
// `indices` is the payload's first section. Independent per j, so the device checks in parallel.
GZ_HD WireCheck check_index(const uint8_t* indices, uint64_t j, uint64_t count) {
  const uint32_t v = load_u32(indices + 4 * j);
  if (v >= count) return {WireStatus::bad_index, 2 * j};
  if (j > 0 && v <= load_u32(indices + 4 * (j - 1))) return {WireStatus::bad_index, 2 * j + 1};
  return {WireStatus::ok, 0};
}

}  // namespace gradzip
