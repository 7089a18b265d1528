// The wire format: a 32-byte little-endian header followed by the codec's payload.
// It is an API: a change of layout bumps kWireVersion. Documented in README.md ("Wire format").
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

#include "gradzip/element.hpp"

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

}  // namespace gradzip
