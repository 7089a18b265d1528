// Codec::encode and Codec::encode_with_feedback: argument checks, the header, and the split of
// the payload into per-thread ranges for the kernels.
#include <cstdint>
#include <cstring>
#include <string>

#include "detail.hpp"
#include "encode_check.hpp"
#include "gradzip/gradzip.hpp"
#include "parallel.hpp"
#include "pointer_check.hpp"
#include "topk.hpp"

namespace gradzip {
namespace {

[[noreturn]] void bad_arg(const std::string& why) {
  throw Error(Status::invalid_argument, "gradzip: " + why);
}

void encode_impl(const Codec& codec, detail::EncodeArgs a, size_t n, void* out, size_t out_bytes,
                 void* workspace, size_t workspace_bytes) {
  const detail::IeeeFloatMode ieee;  // the caller's thread; workers set their own
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

  const CodecSpec& s = codec.spec();
  const WireHeader h = codec.wire_header(n);
  const uint32_t param = h.param;
  const PayloadLayout l = payload_layout(s.kind, n, param, s.fp16_values);
  std::memcpy(out, &h, sizeof h);
  char* payload = static_cast<char*>(out) + kHeaderBytes;

  const detail::CpuLoops& k = detail::cpu_loops();
  auto at = [&](size_t begin) {
    detail::EncodeArgs x = a;
    x.grad += begin;
    if (x.residual) x.residual += begin;
    return x;
  };
  switch (s.kind) {
    case CodecKind::fp32:
      detail::parallel_ranges(n, 16, [&](size_t b, size_t e) {
        k.encode_fp32(at(b), e - b, reinterpret_cast<float*>(payload) + b);
      });
      break;
    case CodecKind::fp16:
    case CodecKind::bf16: {
      auto fn = s.kind == CodecKind::fp16 ? k.encode_fp16 : k.encode_bf16;
      detail::parallel_ranges(n, 32, [&](size_t b, size_t e) {
        fn(at(b), e - b, reinterpret_cast<uint16_t*>(payload) + b);
      });
      break;
    }
    case CodecKind::int8:
    case CodecKind::sign: {
      const size_t nb = ceil_div(n, s.block);
      std::memset(payload + 4 * nb, 0, l.section1 - 4 * nb);  // padding after the scales
      auto* scales = reinterpret_cast<float*>(payload + l.section0);
      detail::parallel_ranges(n, s.block, [&](size_t b, size_t e) {
        if (s.kind == CodecKind::int8)
          k.encode_int8(at(b), e - b, s.block, scales + b / s.block,
                        reinterpret_cast<int8_t*>(payload + l.section1) + b);
        else
          k.encode_sign(at(b), e - b, s.block, scales + b / s.block,
                        reinterpret_cast<uint32_t*>(payload + l.section1) + b / 32);
      });
      break;
    }
    case CodecKind::topk:
      detail::encode_topk(k, a, n, param, reinterpret_cast<uint32_t*>(payload + l.section0),
                          payload + l.section1, s.fp16_values, static_cast<uint32_t*>(workspace));
      break;
  }
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
  const std::string for_n = ", " + codec.name() + " needs ";
  if (out_bytes < need)
    fail("output buffer too small: " + std::to_string(out_bytes) + " bytes" + for_n +
         std::to_string(need) + " for n=" + std::to_string(n));
  if (ws_need > 0 && (workspace == nullptr || workspace_bytes < ws_need))
    fail("workspace too small: " + std::to_string(workspace == nullptr ? 0 : workspace_bytes) +
         " bytes" + for_n + std::to_string(ws_need) + " for n=" + std::to_string(n) +
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

}  // namespace gradzip
