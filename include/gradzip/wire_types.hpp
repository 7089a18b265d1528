// The wire format's vocabulary: the header struct, the codec ids, the limits, the payload layout
// type and the validation statuses. The rules that use them are in gradzip/wire.hpp (the whole
// message) and gradzip/codec/<codec>.hpp (each codec's part); see wire.hpp for the layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "gradzip/element.hpp"  // GZ_HD

namespace gradzip {

constexpr uint32_t kWireMagic = 0x50495A47u;  // "GZIP" in memory order
constexpr uint16_t kWireVersion = 2;
constexpr size_t kHeaderBytes = 32;

enum class CodecKind : uint8_t { fp32 = 0, fp16 = 1, bf16 = 2, int8 = 3, sign = 4, topk = 5 };
enum class DType : uint8_t { f32 = 0, f16 = 1, bf16 = 2 };

// Top-k's flags say how its values travel: f32 (no flag), fp16, or int8 with one f32 scale per
// 65536-element index chunk. At most one of the two bits is set.
constexpr uint32_t kTopkFlagFp16Values = 1u;
constexpr uint32_t kTopkFlagInt8Values = 2u;
enum class TopkValues : uint8_t { f32 = 0, fp16 = 1, int8 = 2 };

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
// Top-k indices: an element's index is its chunk of kTopkIndexChunk elements (implied by the
// payload's chunk ends) and a u16 offset inside it, so indices stay below 2^32.
constexpr uint64_t kTopkMaxCount = 0xFFFFFFFFull;
constexpr uint64_t kTopkIndexChunk = 65536;
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
  uint64_t section0 = 0;  // int8/sign: scales; topk: chunk ends; casts: values
  uint64_t section1 = 0;  // int8: q bytes; sign: words; topk: in-chunk offsets
  uint64_t section2 = 0;  // topk: values
  uint64_t section3 = 0;  // topk with int8 values: the per-chunk scales
  uint64_t bytes = 0;     // total payload bytes
};

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
  bad_padding,        // nonzero padding after a section, or sign bits set past the count
  bad_index,          // top-k index out of range or not strictly increasing
  bad_chunk_ends,     // top-k chunk ends decreasing, above a chunk's length, or not ending at k
};

// detail: the header field involved; wrong_length: the buffer's length; bad_padding: the payload
// byte offset; bad_index: 2 * position + (1 if not above the previous index, 0 if out of range),
// so that the smallest detail is the first fault in index order; bad_chunk_ends: the chunk.
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
    case WireStatus::bad_chunk_ends: return "top-k chunk ends inconsistent";
  }
  return "unknown status";
}

// A little-endian word of the payload (u32: sign words, top-k chunk ends; u16: top-k offsets).
// Device payloads are aligned to their words; host ones may not be.
template <class Word>
GZ_HD Word load_word(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const Word*>(p);
#else
  Word v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}
GZ_HD uint32_t load_u32(const uint8_t* p) { return load_word<uint32_t>(p); }
GZ_HD uint16_t load_u16(const uint8_t* p) { return load_word<uint16_t>(p); }

}  // namespace gradzip
