// The wire format, defined once: the header's layout, the sizes of every section and message, and
// the validation rules. Header-only and written for host and device (GZ_HD): the CPU decoder
// (codecs/wire_check.cpp), the CUDA decoder (kernels/decode.cu), the size queries (codecs/spec.cpp)
// and the torch bindings all call these functions, so they cannot drift apart. The Python cost
// model's copy (bindings/python/gradzip/wire.py) is checked against them by tests/python.
//
// A 32-byte little-endian header followed by the codec's payload. It is an API: a change of
// layout bumps kWireVersion. Documented in README.md ("Wire format").
//
//   offset size field
//        0    4 magic          'G','Z','I','P' (0x50495A47 little-endian)
//        4    2 version        kWireVersion
//        6    1 codec          CodecKind
//        7    1 dtype          element type of the decoded values (DType; v1: f32 only)
//        8    8 count          number of elements n
//       16    4 param          int8/sign: block size; topk: k (number of kept elements); else 0
//       20    4 flags          topk: bit 0 = values stored as fp16; else 0
//       24    8 payload_bytes  bytes following the header (exactly)
//
// Payloads (sections start 16-byte aligned relative to the payload start; padding is zero):
//   fp32       n x f32
//   fp16/bf16  n x u16
//   int8       nb = ceil(n/block) x f32 scales, pad to 16; then n x i8
//   sign       nb x f32 scales (mean |x|), pad to 16; then ceil(n/32) x u32 sign words
//   topk       k x u32 indices (strictly increasing, < n); then k x f32 (or fp16) values
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "gradzip/element.hpp"  // GZ_HD

namespace gradzip {

constexpr uint32_t kWireMagic = 0x50495A47u;  // "GZIP" in memory order
constexpr uint16_t kWireVersion = 1;
constexpr size_t kHeaderBytes = 32;

enum class CodecKind : uint8_t { fp32 = 0, fp16 = 1, bf16 = 2, int8 = 3, sign = 4, topk = 5 };
enum class DType : uint8_t { f32 = 0, f16 = 1, bf16 = 2 };

constexpr uint32_t kTopkFlagFp16Values = 1u;

struct WireHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t codec;
  uint8_t dtype;
  uint64_t count;
  uint32_t param;
  uint32_t flags;
  uint64_t payload_bytes;
};
static_assert(sizeof(WireHeader) == kHeaderBytes, "wire header must be 32 bytes");

// ---- limits ---------------------------------------------------------------------------------
// Largest element count any codec accepts: keeps every byte computation below far from 64-bit
// overflow (4 * 2^48 bytes).
constexpr uint64_t kMaxCount = uint64_t{1} << 48;
// Top-k indices are u32 on the wire.
constexpr uint64_t kTopkMaxCount = 0xFFFFFFFFull;
// int8/sign block sizes: multiples of 32 (a sign word's bits never straddle two blocks).
constexpr uint32_t kMinBlock = 32;
constexpr uint32_t kMaxBlock = 65536;

GZ_HD constexpr bool valid_block(uint64_t block) {
  return block >= kMinBlock && block <= kMaxBlock && block % 32 == 0;
}

// ---- sizes ----------------------------------------------------------------------------------
GZ_HD constexpr uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
GZ_HD constexpr uint64_t align16(uint64_t a) { return (a + 15) & ~uint64_t{15}; }

// Byte offsets inside the payload (after the header) of each section. One definition, used by
// the encoders, the decoders and the validators on both sides.
struct PayloadLayout {
  uint64_t section0 = 0;  // int8/sign: scales; topk: indices; casts: values
  uint64_t section1 = 0;  // int8: q bytes; sign: words; topk: values
  uint64_t bytes = 0;     // total payload bytes
};

// param: block (int8/sign) or k (topk); fp16_values: topk flag.
GZ_HD constexpr PayloadLayout payload_layout(CodecKind codec, uint64_t n, uint32_t param,
                                             bool fp16_values) {
  PayloadLayout l{};
  switch (codec) {
    case CodecKind::fp32: l.bytes = 4 * n; break;
    case CodecKind::fp16:
    case CodecKind::bf16: l.bytes = 2 * n; break;
    case CodecKind::int8:
      l.section1 = align16(4 * ceil_div(n, param));
      l.bytes = l.section1 + n;
      break;
    case CodecKind::sign:
      l.section1 = align16(4 * ceil_div(n, param));
      l.bytes = l.section1 + 4 * ceil_div(n, 32);
      break;
    case CodecKind::topk:
      l.section1 = 4ull * param;
      l.bytes = l.section1 + (fp16_values ? 2ull : 4ull) * param;
      break;
  }
  return l;
}

// The layout a header describes (its codec field must be a known CodecKind).
GZ_HD constexpr PayloadLayout payload_layout(const WireHeader& h) {
  const auto kind = static_cast<CodecKind>(h.codec);
  return payload_layout(kind, h.count, h.param,
                        kind == CodecKind::topk && (h.flags & kTopkFlagFp16Values) != 0);
}

// Header + payload: the exact size of one message.
GZ_HD constexpr uint64_t message_bytes(CodecKind codec, uint64_t n, uint32_t param,
                                       bool fp16_values) {
  return kHeaderBytes + payload_layout(codec, n, param, fp16_values).bytes;
}

// Messages placed one after another in a buffer (the all-reduce's shards and all-gather slots)
// each start on a 16-byte boundary: a message then keeps its buffer's alignment, which the CUDA
// codecs need (4 bytes) and use for vector accesses (16 bytes).
GZ_HD constexpr uint64_t message_slot_bytes(uint64_t message_bytes) { return align16(message_bytes); }

// ---- validation -----------------------------------------------------------------------------
// Why a message is rejected. The numbers are those of the CUDA decoders' status word.
enum class WireStatus : uint32_t {
  ok = 0,
  bad_magic,
  bad_version,
  bad_codec,
  bad_dtype,
  bad_count,          // beyond kMaxCount; top-k: beyond kTopkMaxCount
  bad_param,          // block not valid_block, or param set for a cast
  bad_k,              // top-k k == 0 with n > 0, k > n, or k != 0 with n == 0
  bad_flags,
  bad_payload_bytes,  // payload_bytes differs from the codec's layout
  wrong_length,       // the buffer is not exactly header + payload_bytes long
  bad_padding,        // nonzero padding after the scales, or sign bits set past the count
  bad_index,          // top-k index out of range or not strictly increasing
};

// detail: the header field involved; wrong_length: the buffer's length; bad_padding: the payload
// byte offset; bad_index: 2 * position + (1 if not above the previous index, 0 if out of range),
// so that the smallest detail is the first fault in index order.
struct WireCheck {
  WireStatus status;
  uint64_t detail;
};

// A reason in words, for messages that have no header values at hand.
GZ_HD constexpr const char* wire_status_text(WireStatus s) {
  switch (s) {
    case WireStatus::ok: return "ok";
    case WireStatus::bad_magic: return "bad magic (not a gradzip message)";
    case WireStatus::bad_version: return "unsupported wire version";
    case WireStatus::bad_codec: return "unknown codec id";
    case WireStatus::bad_dtype: return "unsupported dtype";
    case WireStatus::bad_count: return "element count out of range";
    case WireStatus::bad_param: return "bad codec parameter";
    case WireStatus::bad_k: return "top-k k out of range for the element count";
    case WireStatus::bad_flags: return "bad flags";
    case WireStatus::bad_payload_bytes: return "payload_bytes does not match the codec's layout";
    case WireStatus::wrong_length: return "wire is not header + payload_bytes long";
    case WireStatus::bad_padding: return "nonzero padding or unused sign bits";
    case WireStatus::bad_index: return "top-k index out of range or not increasing";
  }
  return "unknown status";
}

// The header of a message of `bytes` bytes (read from a buffer of at least kHeaderBytes): every
// field, then payload_bytes against the layout, then the length. Reads no payload byte.
GZ_HD constexpr WireCheck check_header(const WireHeader& h, uint64_t bytes) {
  if (h.magic != kWireMagic) return {WireStatus::bad_magic, h.magic};
  if (h.version != kWireVersion) return {WireStatus::bad_version, h.version};
  if (h.codec > static_cast<uint8_t>(CodecKind::topk)) return {WireStatus::bad_codec, h.codec};
  if (h.dtype != static_cast<uint8_t>(DType::f32)) return {WireStatus::bad_dtype, h.dtype};
  if (h.count > kMaxCount) return {WireStatus::bad_count, h.count};
  switch (static_cast<CodecKind>(h.codec)) {
    case CodecKind::fp32:
    case CodecKind::fp16:
    case CodecKind::bf16:
      if (h.param != 0) return {WireStatus::bad_param, h.param};
      if (h.flags != 0) return {WireStatus::bad_flags, h.flags};
      break;
    case CodecKind::int8:
    case CodecKind::sign:
      if (!valid_block(h.param)) return {WireStatus::bad_param, h.param};
      if (h.flags != 0) return {WireStatus::bad_flags, h.flags};
      break;
    case CodecKind::topk:
      if (h.count > kTopkMaxCount) return {WireStatus::bad_count, h.count};
      if (h.count == 0 ? h.param != 0 : (h.param == 0 || h.param > h.count))
        return {WireStatus::bad_k, h.param};
      if ((h.flags & ~kTopkFlagFp16Values) != 0) return {WireStatus::bad_flags, h.flags};
      break;
  }
  const uint64_t payload = payload_layout(h).bytes;
  if (h.payload_bytes != payload) return {WireStatus::bad_payload_bytes, h.payload_bytes};
  if (bytes != kHeaderBytes + payload) return {WireStatus::wrong_length, bytes};
  return {WireStatus::ok, 0};
}

// A little-endian u32 of the payload. Device payloads are 4-byte aligned; host ones may not be.
GZ_HD uint32_t load_u32(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

// The payload bytes a valid header does not pin down, except top-k indices: the zero padding
// after int8/sign scales and the unused bits of the last sign word. `payload` follows the header,
// which check_header accepted.
GZ_HD WireCheck check_payload(const WireHeader& h, const uint8_t* payload) {
  const auto kind = static_cast<CodecKind>(h.codec);
  if (kind != CodecKind::int8 && kind != CodecKind::sign) return {WireStatus::ok, 0};
  const PayloadLayout l = payload_layout(h);
  for (uint64_t i = 4 * ceil_div(h.count, h.param); i < l.section1; ++i)
    if (payload[i] != 0) return {WireStatus::bad_padding, i};
  if (kind == CodecKind::sign && h.count % 32 != 0 &&
      (load_u32(payload + l.bytes - 4) >> (h.count % 32)) != 0)
    return {WireStatus::bad_padding, l.bytes - 4};
  return {WireStatus::ok, 0};
}

// Top-k index j of a message of `count` elements: below count and above index j - 1.
// `indices` is the payload's first section. Independent per j, so the device checks in parallel.
GZ_HD WireCheck check_index(const uint8_t* indices, uint64_t j, uint64_t count) {
  const uint32_t v = load_u32(indices + 4 * j);
  if (v >= count) return {WireStatus::bad_index, 2 * j};
  if (j > 0 && v <= load_u32(indices + 4 * (j - 1))) return {WireStatus::bad_index, 2 * j + 1};
  return {WireStatus::ok, 0};
}

// The whole message, in the order every decoder reports: header, payload, then the top-k
// indices in index order (a parallel check that keeps the smallest detail reports the same).
GZ_HD WireCheck check_message(const WireHeader& h, uint64_t bytes, const uint8_t* payload) {
  WireCheck r = check_header(h, bytes);
  if (r.status != WireStatus::ok) return r;
  r = check_payload(h, payload);
  if (r.status != WireStatus::ok || h.codec != static_cast<uint8_t>(CodecKind::topk)) return r;
  for (uint64_t j = 0; j < h.param; ++j) {
    r = check_index(payload, j, h.count);
    if (r.status != WireStatus::ok) return r;
  }
  return r;
}

}  // namespace gradzip
