// read_header: the host's wrapper of the wire format's validation (gradzip/wire.hpp,
// check_message), which turns a rejection into Error(corrupt_payload) with a message that names
// the header values involved.
#include <cstring>
#include <string>

#include "gradzip/gradzip.hpp"
#include "pointer_check.hpp"

namespace gradzip {
namespace {

// Whether the header's param is a block size (its codec's traits: block_scaled). Asked only of
// headers whose codec is known: check_params rejects params and flags after the codec check.
bool block_param(const WireHeader& h) {
  return visit(static_cast<CodecKind>(h.codec), [](auto c) { return c.block_scaled; });
}

std::string why(const WireCheck& r, const WireHeader& h, size_t bytes, const uint8_t* payload) {
  using std::to_string;
  switch (r.status) {
    case WireStatus::ok: break;
    case WireStatus::bad_magic: return "bad magic (not a gradzip message)";
    case WireStatus::bad_version:
      return "wire version " + to_string(h.version) + ", this library reads version " +
             to_string(kWireVersion);
    case WireStatus::bad_codec: return "unknown codec id " + to_string(h.codec);
    case WireStatus::bad_dtype:
      return "dtype " + to_string(h.dtype) + " is not supported (version 1 holds f32)";
    case WireStatus::bad_count:
      if (h.count > kMaxCount) return "element count " + to_string(h.count) + " too large";
      return "top-k count exceeds 32-bit indices";
    case WireStatus::bad_param:  // a cast's or a block's; top-k's k is bad_k
      if (!block_param(h)) return "param must be 0 for a cast, got " + to_string(h.param);
      return "block " + to_string(h.param) + " is not a multiple of 32 in [32, 65536]";
    case WireStatus::bad_k:
      return "top-k k=" + to_string(h.param) + " out of range for n=" + to_string(h.count);
    case WireStatus::bad_flags:
      if (block_param(h)) return "flags must be 0 for int8/sign";
      if (sparse_payload(static_cast<CodecKind>(h.codec))) return "unknown top-k flags";
      return "flags must be 0 for a cast";
    case WireStatus::bad_payload_bytes:
      return "payload_bytes " + to_string(h.payload_bytes) + " but the layout needs " +
             to_string(payload_layout(h).bytes);
    case WireStatus::wrong_length: {
      const uint64_t want = kHeaderBytes + payload_layout(h).bytes;
      return std::string(bytes < want ? "truncated" : "trailing bytes") + ": " + to_string(bytes) +
             " bytes, the message is " + to_string(want);
    }
    case WireStatus::bad_padding:
      if (sparse_payload(static_cast<CodecKind>(h.codec)))
        return "nonzero padding at payload byte " + to_string(r.detail);
      if (r.detail < payload_layout(h).section1) return "nonzero padding after the scales";
      return "sign bits set past the element count";
    case WireStatus::bad_index: {
      const uint64_t j = r.detail / 2;
      const uint64_t idx = topk_position(h, payload, j).index;
      if (r.detail % 2 == 0)
        return "top-k index " + to_string(idx) + " at position " + to_string(j) +
               " is out of range (n=" + to_string(h.count) + ")";
      return "top-k indices not strictly increasing at position " + to_string(j) + " (" +
             to_string(topk_position(h, payload, j - 1).index) + " then " + to_string(idx) + ")";
    }
    case WireStatus::bad_chunk_ends: {
      const uint64_t c = r.detail;
      return "top-k chunk " + to_string(c) + " ends at " + to_string(load_u32(payload + 4 * c)) +
             (c > 0 ? " after " + to_string(load_u32(payload + 4 * (c - 1))) : std::string()) +
             " (ends never decrease, a chunk keeps at most its length, the last ends at k=" +
             to_string(h.param) + ")";
    }
  }
  return "unknown status " + to_string(static_cast<uint32_t>(r.status));
}

}  // namespace

WireHeader read_header(const void* wire, size_t bytes) {
  detail::require_host_pointer(wire, "wire");
  if (wire == nullptr) throw Error(Status::invalid_argument, "gradzip: wire is null");
  if (bytes < kHeaderBytes)
    throw Error(Status::corrupt_payload, "gradzip: corrupt payload: truncated: " +
                                             std::to_string(bytes) +
                                             " bytes, the header alone needs 32");
  WireHeader h;
  std::memcpy(&h, wire, sizeof h);
  const auto* payload = static_cast<const uint8_t*>(wire) + kHeaderBytes;
  const WireCheck r = check_message(h, bytes, payload);
  if (r.status != WireStatus::ok)
    throw Error(Status::corrupt_payload, "gradzip: corrupt payload: " + why(r, h, bytes, payload));
  return h;
}

}  // namespace gradzip
