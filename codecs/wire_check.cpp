// read_header: validates a wire message completely (header, every length, padding, top-k
// indices) before any decoder touches its output.
#include <cstring>
#include <string>

#include "detail.hpp"
#include "gradzip/gradzip.hpp"
#include "pointer_check.hpp"

namespace gradzip {
namespace {

[[noreturn]] void corrupt(const std::string& why) {
  throw Error(Status::corrupt_payload, "gradzip: corrupt payload: " + why);
}

bool valid_block(uint32_t b) { return b >= kMinBlock && b <= kMaxBlock && b % 32 == 0; }

}  // namespace

WireHeader read_header(const void* wire, size_t bytes) {
  detail::require_host_pointer(wire, "wire");
  if (wire == nullptr) throw Error(Status::invalid_argument, "gradzip: wire is null");
  if (bytes < kHeaderBytes)
    corrupt("truncated: " + std::to_string(bytes) + " bytes, the header alone needs 32");
  WireHeader h;
  std::memcpy(&h, wire, sizeof h);
  if (h.magic != kWireMagic) corrupt("bad magic (not a gradzip message)");
  if (h.version != kWireVersion)
    corrupt("wire version " + std::to_string(h.version) + ", this library reads version " +
            std::to_string(kWireVersion));
  if (h.codec > static_cast<uint8_t>(CodecKind::topk))
    corrupt("unknown codec id " + std::to_string(h.codec));
  if (h.dtype != static_cast<uint8_t>(DType::f32))
    corrupt("dtype " + std::to_string(h.dtype) + " is not supported (version 1 holds f32)");
  if (h.count > detail::kMaxCount) corrupt("element count " + std::to_string(h.count) + " too large");
  const auto kind = static_cast<CodecKind>(h.codec);
  switch (kind) {
    case CodecKind::fp32:
    case CodecKind::fp16:
    case CodecKind::bf16:
      if (h.param != 0) corrupt("param must be 0 for a cast, got " + std::to_string(h.param));
      if (h.flags != 0) corrupt("flags must be 0 for a cast");
      break;
    case CodecKind::int8:
    case CodecKind::sign:
      if (!valid_block(h.param))
        corrupt("block " + std::to_string(h.param) + " is not a multiple of 32 in [32, 65536]");
      if (h.flags != 0) corrupt("flags must be 0 for int8/sign");
      break;
    case CodecKind::topk:
      if (h.count > detail::kTopkMaxCount) corrupt("top-k count exceeds 32-bit indices");
      if (h.count == 0 ? h.param != 0 : (h.param == 0 || h.param > h.count))
        corrupt("top-k k=" + std::to_string(h.param) + " out of range for n=" +
                std::to_string(h.count));
      if ((h.flags & ~kTopkFlagFp16Values) != 0) corrupt("unknown top-k flags");
      break;
  }
  const bool fp16_values = kind == CodecKind::topk && (h.flags & kTopkFlagFp16Values) != 0;
  const PayloadLayout l = payload_layout(kind, h.count, h.param, fp16_values);
  if (h.payload_bytes != l.bytes)
    corrupt("payload_bytes " + std::to_string(h.payload_bytes) + " but the layout needs " +
            std::to_string(l.bytes));
  if (bytes != kHeaderBytes + l.bytes)
    corrupt(std::string(bytes < kHeaderBytes + l.bytes ? "truncated" : "trailing bytes") + ": " +
            std::to_string(bytes) + " bytes, the message is " + std::to_string(kHeaderBytes + l.bytes));

  const auto* payload = static_cast<const unsigned char*>(wire) + kHeaderBytes;
  if (kind == CodecKind::int8 || kind == CodecKind::sign) {
    for (uint64_t i = 4 * ceil_div(h.count, h.param); i < l.section1; ++i)
      if (payload[i] != 0) corrupt("nonzero padding after the scales");
  }
  if (kind == CodecKind::sign && h.count % 32 != 0) {
    uint32_t last;
    std::memcpy(&last, payload + l.bytes - 4, 4);
    if ((last >> (h.count % 32)) != 0) corrupt("sign bits set past the element count");
  }
  if (kind == CodecKind::topk) {
    uint64_t prev = 0;
    for (uint64_t j = 0; j < h.param; ++j) {
      uint32_t idx;
      std::memcpy(&idx, payload + l.section0 + 4 * j, 4);
      if (idx >= h.count)
        corrupt("top-k index " + std::to_string(idx) + " at position " + std::to_string(j) +
                " is out of range (n=" + std::to_string(h.count) + ")");
      if (j > 0 && idx <= prev)
        corrupt("top-k indices not strictly increasing at position " + std::to_string(j) + " (" +
                std::to_string(prev) + " then " + std::to_string(idx) + ")");
      prev = idx;
    }
  }
  return h;
}

}  // namespace gradzip
