// Wire validation of the CUDA decoders, written for host and device (GZ_HD) so the host tests can
// check it against the CPU's read_header (codecs/wire_check.cpp) on the same corrupt bytes
// without a GPU. Same rules, same order; top-k indices are checked in parallel by decode.cu.
#pragma once

#include <cstdint>

#include "gradzip/wire.hpp"
#include "launch.hpp"

namespace gradzip::kernels {

struct HeaderCheck {
  DecodeReason reason;
  uint64_t detail;
};

// The header of a message of `bytes` bytes (>= kHeaderBytes), and the payload bytes that need no
// parallel pass: the zero padding after int8/sign scales and the unused bits of the last sign
// word. `payload` points at the first byte after the header.
GZ_HD HeaderCheck check_message(const WireHeader& h, uint64_t bytes, const uint8_t* payload) {
  constexpr uint64_t kMaxCount = uint64_t{1} << 48;  // as the CPU path (codecs/detail.hpp)
  if (h.magic != kWireMagic) return {DecodeReason::bad_magic, h.magic};
  if (h.version != kWireVersion) return {DecodeReason::bad_version, h.version};
  if (h.codec > static_cast<uint8_t>(CodecKind::topk)) return {DecodeReason::bad_codec, h.codec};
  if (h.dtype != static_cast<uint8_t>(DType::f32)) return {DecodeReason::bad_dtype, h.dtype};
  if (h.count > kMaxCount) return {DecodeReason::bad_count, h.count};
  const CodecKind kind = static_cast<CodecKind>(h.codec);
  bool fp16_values = false;
  switch (kind) {
    case CodecKind::int8:
    case CodecKind::sign:
      if (h.param < 32 || h.param > 65536 || h.param % 32 != 0)
        return {DecodeReason::bad_param, h.param};
      if (h.flags != 0) return {DecodeReason::bad_flags, h.flags};
      break;
    case CodecKind::topk:
      if (h.count > 0xFFFFFFFFull) return {DecodeReason::bad_count, h.count};
      if (h.count == 0 ? h.param != 0 : (h.param == 0 || h.param > h.count))
        return {DecodeReason::bad_k, h.param};
      if ((h.flags & ~kTopkFlagFp16Values) != 0) return {DecodeReason::bad_flags, h.flags};
      fp16_values = (h.flags & kTopkFlagFp16Values) != 0;
      break;
    default:
      if (h.param != 0) return {DecodeReason::bad_param, h.param};
      if (h.flags != 0) return {DecodeReason::bad_flags, h.flags};
      break;
  }
  const PayloadLayout l = payload_layout(kind, h.count, h.param, fp16_values);
  if (h.payload_bytes != l.bytes) return {DecodeReason::bad_payload_bytes, h.payload_bytes};
  if (bytes - kHeaderBytes != l.bytes) return {DecodeReason::wrong_length, bytes};
  if (kind == CodecKind::int8 || kind == CodecKind::sign) {
    for (uint64_t i = 4 * ceil_div(h.count, h.param); i < l.section1; ++i)
      if (payload[i] != 0) return {DecodeReason::bad_padding, i};
  }
  if (kind == CodecKind::sign && h.count % 32 != 0) {
    const uint8_t* p = payload + l.bytes - 4;  // 4-byte aligned on the device
    const uint32_t last = uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) |
                          (uint32_t{p[3]} << 24);
    if ((last >> (h.count % 32)) != 0) return {DecodeReason::bad_padding, l.bytes - 4};
  }
  return {DecodeReason::ok, 0};
}

constexpr uint64_t kNoFault = ~uint64_t{0};

// Top-k index j of a message with `count` elements: kNoFault, or 2 * j when it is out of range,
// 2 * j + 1 when it does not exceed index j - 1 (the CPU's rule; the smallest fault is reported).
GZ_HD uint64_t index_fault(const uint32_t* idx, uint64_t j, uint64_t count) {
  const uint32_t v = idx[j];
  if (v >= count) return 2 * j;
  if (j > 0 && v <= idx[j - 1]) return 2 * j + 1;
  return kNoFault;
}

}  // namespace gradzip::kernels
