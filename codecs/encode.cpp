// Codec::encode, Codec::encode_with_feedback and encode_batch: argument checks and the header;
// the codec's encode_cpu (codecs/<codec>.cpp) writes the payload.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>

#include "cpu_table.hpp"
#include "encode_check.hpp"
#include "batch.hpp"
#include "float_mode.hpp"
#include "gradzip/gradzip.hpp"
#include "pointer_check.hpp"

namespace gradzip {
namespace {

[[noreturn]] void bad_arg(const std::string& why) {
  throw Error(Status::invalid_argument, "gradzip: " + why);
}

// Every check of one message, before anything is written.
void check_encode(const Codec& codec, detail::EncodeArgs a, size_t n, void* out, size_t out_bytes,
                  void* workspace, size_t workspace_bytes) {
  detail::require_host_pointer(a.grad, "grad");
  detail::require_host_pointer(a.residual, "residual");
  detail::require_host_pointer(out, "out");
  detail::require_host_pointer(workspace, "workspace");
  const size_t ws_need = codec.workspace_bytes(n);
  detail::check_encode_args("gradzip", codec, a.grad, n, out, out_bytes, workspace, workspace_bytes,
                            ws_need);
  if (reinterpret_cast<uintptr_t>(out) % 4 != 0) bad_arg("out must be 4-byte aligned");
  if (ws_need > 0 && reinterpret_cast<uintptr_t>(workspace) % 4 != 0)
    bad_arg("workspace must be 4-byte aligned");
}

// The header, then the codec's payload; the arguments were checked (check_encode).
void run_encode(const Codec& codec, detail::EncodeArgs a, size_t n, void* out, void* workspace) {
  const CodecSpec& s = codec.spec();
  const WireHeader h = codec.wire_header(n);
  std::memcpy(out, &h, sizeof h);
  const detail::CpuEncode job{detail::cpu_loops(), s, a, n, h.param,
                              payload_layout(s.kind, n, h.param, h.flags),
                              static_cast<char*>(out) + kHeaderBytes, workspace};
  visit(s.kind, [&](auto c) { detail::encode_cpu(c, job); });
}

void encode_impl(const Codec& codec, detail::EncodeArgs a, size_t n, void* out, size_t out_bytes,
                 void* workspace, size_t workspace_bytes) {
  const detail::IeeeFloatMode ieee;  // the caller's thread; workers set their own
  check_encode(codec, a, n, out, out_bytes, workspace, workspace_bytes);
  run_encode(codec, a, n, out, workspace);
}

}  // namespace

void detail::check_encode_args(const char* api, const Codec& codec, const float* in, size_t n,
                               const void* out, size_t out_bytes, const void* workspace,
                               size_t workspace_bytes, size_t ws_need) {
  auto fail = [&](const std::string& why) {
    throw Error(Status::invalid_argument, std::string(api) + ": " + why);
  };
  const size_t need = codec.encoded_bytes(n);  // also range-checks n
  if (n > 0 && in == nullptr) fail("input is null");
  if (out == nullptr) fail("output is null");
  // Built only on failure: a call that passes its checks allocates nothing.
  auto for_n = [&] { return ", " + codec.name() + " needs "; };
  if (out_bytes < need)
    fail("output buffer too small: " + std::to_string(out_bytes) + " bytes" + for_n() +
         std::to_string(need) + " for n=" + std::to_string(n));
  if (ws_need > 0 && (workspace == nullptr || workspace_bytes < ws_need))
    fail("workspace too small: " + std::to_string(workspace == nullptr ? 0 : workspace_bytes) +
         " bytes" + for_n() + std::to_string(ws_need) + " for n=" + std::to_string(n) +
         " (Codec::workspace_bytes)");
}

void Codec::encode(const float* in, size_t n, void* out, size_t out_bytes, float prescale,
                   void* workspace, size_t workspace_bytes) const {
  encode_impl(*this, {in, nullptr, prescale}, n, out, out_bytes, workspace, workspace_bytes);
}

void Codec::encode_with_feedback(const float* grad, float* residual, size_t n, void* out,
                                 size_t out_bytes, float prescale, void* workspace,
                                 size_t workspace_bytes) const {
  encode_impl(*this, {grad, residual, prescale}, n, out, out_bytes, workspace, workspace_bytes);
}

size_t batch_workspace_bytes(const EncodeItem* items, size_t count) {
  detail::require_items("gradzip", items, count);
  size_t bytes = 0;
  for (size_t i = 0; i < count; ++i)
    detail::for_item(i, count, [&] {
      bytes = std::max(bytes, detail::item_codec("gradzip", items[i]).workspace_bytes(items[i].n));
    });
  return bytes;
}

void encode_batch(const EncodeItem* items, size_t count, float prescale, void* workspace,
                  size_t workspace_bytes) {
  const detail::IeeeFloatMode ieee;
  detail::require_items("gradzip", items, count);
  for (size_t i = 0; i < count; ++i) {
    const EncodeItem& it = items[i];
    detail::for_item(i, count, [&] {
      check_encode(detail::item_codec("gradzip", it), {it.in, it.residual, prescale}, it.n,
                   it.out, it.out_bytes, workspace, workspace_bytes);
    });
  }
  for (size_t i = 0; i < count; ++i) {
    const EncodeItem& it = items[i];
    run_encode(*it.codec, {it.in, it.residual, prescale}, it.n, it.out, workspace);
  }
}

}  // namespace gradzip
