// fp32 / fp16 / bf16: every value rounded to a float type, n values on the wire. The three share
// their wire rules (CastCodec) and differ in the wire type (its storage and its DType) and its
// rounding and widening.
#pragma once

#include "gradzip/element.hpp"
#include "gradzip/wire_types.hpp"

namespace gradzip {

// Self: the cast itself, which defines encode(float) -> Wire and decode(Wire) -> float.
template <class Self, CodecKind Kind, class WireType, DType WireDType>
struct CastCodec {
  static constexpr CodecKind kind = Kind;
  using Wire = WireType;

  // Facts (see visit.hpp): the payload is the values themselves, in wire_dtype, which a backend's
  // all-reduce can sum in place.
  static constexpr bool block_scaled = false;
  static constexpr bool summable = true;
  static constexpr DType wire_dtype = WireDType;
  static constexpr bool sparse = false;
  static constexpr bool all_gathered = false;

  // Payload: n values of Wire, one section.
  static GZ_HD constexpr PayloadLayout layout(uint64_t n, uint32_t /*param*/, uint32_t /*flags*/) {
    PayloadLayout l{};
    l.bytes = sizeof(Wire) * n;
    return l;
  }
  // Casts take no parameter and no flags.
  static GZ_HD constexpr WireCheck check_params(const WireHeader& h) {
    if (h.param != 0) return {WireStatus::bad_param, h.param};
    if (h.flags != 0) return {WireStatus::bad_flags, h.flags};
    return {WireStatus::ok, 0};
  }
  // Every payload byte is a value: nothing beyond the header to check.
  static GZ_HD constexpr WireCheck check_padding(const WireHeader&, const uint8_t*) {
    return {WireStatus::ok, 0};
  }

  // Decodes single elements of a validated payload (the CUDA decoder's per-thread elements).
  struct ElementDecoder {
    const Wire* values;
    GZ_HD float operator()(uint64_t e) const { return Self::decode(values[e]); }
  };
  static GZ_HD ElementDecoder element_decoder(const WireHeader&, const uint8_t* payload,
                                              uint64_t /*first*/) {
    return {reinterpret_cast<const Wire*>(payload)};
  }
};

struct Fp32Codec : CastCodec<Fp32Codec, CodecKind::fp32, float, DType::f32> {
  static constexpr const char* spec_name = "fp32";
  static GZ_HD Wire encode(float c) { return c; }
  static GZ_HD float decode(Wire v) { return v; }
};
struct Fp16Codec : CastCodec<Fp16Codec, CodecKind::fp16, uint16_t, DType::f16> {
  static constexpr const char* spec_name = "fp16";
  static GZ_HD Wire encode(float c) { return element::float_to_fp16(c); }
  static GZ_HD float decode(Wire v) { return element::fp16_to_float(v); }
};
struct Bf16Codec : CastCodec<Bf16Codec, CodecKind::bf16, uint16_t, DType::bf16> {
  static constexpr const char* spec_name = "bf16";
  static GZ_HD Wire encode(float c) { return element::float_to_bf16(c); }
  static GZ_HD float decode(Wire v) { return element::bf16_to_float(v); }
};

}  // namespace gradzip
