// decode, decode_add and their batches: validate the whole message (read_header); the codec's
// decode_cpu (codecs/<codec>.cpp) writes the output.
#include <cstdint>
#include <cstring>
#include <string>

#include "batch.hpp"
#include "cpu_table.hpp"
#include "float_mode.hpp"
#include "gradzip/gradzip.hpp"
#include "pointer_check.hpp"

namespace gradzip {
namespace {

// The caller's thread runs in IEEE float mode (detail::IeeeFloatMode); workers set their own.
void decode_message(const void* wire, size_t bytes, float* out, size_t n, bool add) {
  detail::require_host_pointer(out, "out");
  // The payload is read as floats and words in place: as on the GPU, it must be 4-byte aligned
  // (a message inside a concatenated buffer: start each one at a multiple of 4 or 16).
  if (reinterpret_cast<uintptr_t>(wire) % 4 != 0)
    throw Error(Status::invalid_argument, "gradzip: wire must be 4-byte aligned");
  const WireHeader h = read_header(wire, bytes);
  if (h.count != n)
    throw Error(Status::size_mismatch, "gradzip: payload holds " + std::to_string(h.count) +
                                           " elements, the output has " + std::to_string(n));
  if (n > 0 && out == nullptr) throw Error(Status::invalid_argument, "gradzip: out is null");
  const detail::CpuDecode job{detail::cpu_loops(), h, payload_layout(h),
                              static_cast<const char*>(wire) + kHeaderBytes, out, n, add};
  visit(static_cast<CodecKind>(h.codec), [&](auto c) { detail::decode_cpu(c, job); });
}

void decode_impl(const void* wire, size_t bytes, float* out, size_t n, bool add) {
  const detail::IeeeFloatMode ieee;
  decode_message(wire, bytes, out, n, add);
}

size_t decode_batch_impl(const DecodeItem* items, size_t count, Status* status, bool add) {
  const detail::IeeeFloatMode ieee;
  detail::require_items("gradzip", items, count);
  size_t failed = 0;
  for (size_t i = 0; i < count; ++i) {
    const DecodeItem& it = items[i];
    auto decode_item = [&] { decode_message(it.wire, it.bytes, it.out, it.n, add); };
    if (status == nullptr) {
      detail::for_item(i, count, decode_item);
      continue;
    }
    try {
      decode_item();
      status[i] = Status::ok;
    } catch (const Error& e) {
      status[i] = e.status();
      ++failed;
    }
  }
  return failed;
}

}  // namespace

void decode(const void* wire, size_t bytes, float* out, size_t n) {
  decode_impl(wire, bytes, out, n, false);
}
void decode_add(const void* wire, size_t bytes, float* out, size_t n) {
  decode_impl(wire, bytes, out, n, true);
}

size_t decode_batch(const DecodeItem* items, size_t count, Status* status) {
  return decode_batch_impl(items, count, status, false);
}
size_t decode_add_batch(const DecodeItem* items, size_t count, Status* status) {
  return decode_batch_impl(items, count, status, true);
}

}  // namespace gradzip
