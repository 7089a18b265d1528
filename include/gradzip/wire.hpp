// The wire format, defined once: the header's layout, the sizes of every section and message, and
// the validation rules (each codec's part in gradzip/codec/<codec>.hpp, reached through visit). Header-only and written for host and device (GZ_HD): the CPU decoder
// (codecs/wire_check.cpp), the CUDA decoder (kernels/decode.cu), the size queries (codecs/spec.cpp)
// and the torch bindings all call these functions, so they cannot drift apart. The Python cost
// model's copy (bindings/python/gradzip/wire.py) is checked against them by tests/python.
//
// A 32-byte little-endian header followed by the codec's payload. It is an API: a change of
// layout bumps kWireVersion. Documented in docs/wire-format.md.
//
//   offset size field
//        0    4 magic          'G','Z','I','P' (0x50495A47 little-endian)
//        4    2 version        kWireVersion
//        6    1 codec          CodecKind
//        7    1 dtype          element type of the decoded values (DType; v1: f32 only)
//        8    8 count          number of elements n
//       16    4 param          int8/sign: block size; topk: k (number of kept elements); else 0
//       20    4 flags          topk: bit 0 = values stored as fp16, bit 1 = as int8; else 0
//       24    8 payload_bytes  bytes following the header (exactly)
//
// Payloads (sections start 16-byte aligned relative to the payload start; padding is zero):
//   fp32       n x f32
//   fp16/bf16  n x u16
//   int8       nb = ceil(n/block) x f32 scales, pad to 16; then n x i8
//   sign       nb x f32 scales (mean |x|), pad to 16; then ceil(n/32) x u32 sign words
//   topk       ceil(n/65536) x u32 chunk ends (kept elements in this 65536-element chunk and those
//              before it), pad to 16; k x u16 offsets in the chunk (strictly increasing inside
//              it, index = chunk * 65536 + offset < n), pad to 16; k x f32 (or fp16) values;
//              int8 values: k x i8, pad to 16, then one f32 scale per 65536-element chunk
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradzip/codec/visit.hpp"
#include "gradzip/wire_types.hpp"

namespace gradzip {

// Byte offsets of the payload's sections (after the header) and its size: one definition, used by
// the encoders, the decoders and the validators on both sides. param: block (int8/sign) or k
// (topk); flags: the header's (topk: how the values travel). An unknown codec has an empty layout.
GZ_HD constexpr PayloadLayout payload_layout(CodecKind codec, uint64_t n, uint32_t param,
                                             uint32_t flags) {
  if (!known_codec(codec)) return PayloadLayout{};
  return visit(codec, [&](auto c) { return c.layout(n, param, flags); });
}

// The layout a header describes (its codec field must be a known CodecKind).
GZ_HD constexpr PayloadLayout payload_layout(const WireHeader& h) {
  return payload_layout(static_cast<CodecKind>(h.codec), h.count, h.param, h.flags);
}

// Header + payload: the exact size of one message.
GZ_HD constexpr uint64_t message_bytes(CodecKind codec, uint64_t n, uint32_t param,
                                       uint32_t flags) {
  return kHeaderBytes + payload_layout(codec, n, param, flags).bytes;
}

// Messages placed one after another in a buffer (the all-reduce's shards and all-gather slots)
// each start on a 16-byte boundary: a message then keeps its buffer's alignment, which the CUDA
// codecs need (4 bytes) and use for vector accesses (16 bytes).
GZ_HD constexpr uint64_t message_slot_bytes(uint64_t message_bytes) { return align16(message_bytes); }

// Whether a known codec's payload is indices and values (its traits' `sparse`: top-k), whose
// indices are checked one by one (check_index) and whose values a decoder scatters.
GZ_HD constexpr bool sparse_payload(CodecKind codec) {
  return visit(codec, [](auto c) { return c.sparse; });
}

// ---- validation -----------------------------------------------------------------------------
// The header of a message of `bytes` bytes (read from a buffer of at least kHeaderBytes): every
// field, then payload_bytes against the layout, then the length. Reads no payload byte.
GZ_HD constexpr WireCheck check_header(const WireHeader& h, uint64_t bytes) {
  if (h.magic != kWireMagic) return {WireStatus::bad_magic, h.magic};
  if (h.version != kWireVersion) return {WireStatus::bad_version, h.version};
  if (!known_codec(static_cast<CodecKind>(h.codec))) return {WireStatus::bad_codec, h.codec};
  if (h.dtype != static_cast<uint8_t>(DType::f32)) return {WireStatus::bad_dtype, h.dtype};
  if (h.count > kMaxCount) return {WireStatus::bad_count, h.count};
  const WireCheck params =
      visit(static_cast<CodecKind>(h.codec), [&](auto c) { return c.check_params(h); });
  if (params.status != WireStatus::ok) return params;
  const uint64_t payload = payload_layout(h).bytes;
  if (h.payload_bytes != payload) return {WireStatus::bad_payload_bytes, h.payload_bytes};
  if (bytes != kHeaderBytes + payload) return {WireStatus::wrong_length, bytes};
  return {WireStatus::ok, 0};
}

// The payload bytes a valid header does not pin down, except top-k offsets: the zero padding
// after int8/sign scales and top-k's sections, the unused bits of the last sign word and top-k's
// chunk ends. `payload` follows the header,
// which check_header accepted.
GZ_HD WireCheck check_payload(const WireHeader& h, const uint8_t* payload) {
  return visit(static_cast<CodecKind>(h.codec), [&](auto c) { return c.check_padding(h, payload); });
}

// The whole message, in the order every decoder reports: header, payload, then a sparse payload's
// indices in index order (a parallel check that keeps the smallest detail reports the same).
GZ_HD WireCheck check_message(const WireHeader& h, uint64_t bytes, const uint8_t* payload) {
  WireCheck r = check_header(h, bytes);
  if (r.status != WireStatus::ok) return r;
  r = check_payload(h, payload);
  if (r.status != WireStatus::ok || !sparse_payload(static_cast<CodecKind>(h.codec))) return r;
  for (uint64_t j = 0; j < h.param; ++j) {
    r = check_index(h, payload, j);
    if (r.status != WireStatus::ok) return r;
  }
  return r;
}

}  // namespace gradzip
