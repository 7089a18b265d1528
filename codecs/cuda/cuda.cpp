// gradzip::cuda: argument checks, header construction and dispatch to the kernels of kernels/.
// Host code only (compiled by the C++ compiler); the kernels are behind kernels/launch.hpp.
#include "gradzip/cuda.hpp"

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "../../kernels/launch.hpp"
#include "../encode_check.hpp"
#include "workspace.hpp"

namespace gradzip {
namespace detail {

size_t cuda_workspace_bytes(const CodecSpec& spec, size_t n) {
  return visit(spec.kind, [&](auto c) { return kernels::encode_workspace_bytes(c, n); });
}

}  // namespace detail

namespace cuda {
namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(Status::cuda_error, std::string("gradzip: ") + what + ": " + cudaGetErrorString(e));
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// p must be device (or managed) memory of the current device, 4-byte aligned. Null is allowed
// only when nothing is read or written through it.
void require_device_pointer(const void* p, const char* what, bool may_be_null = false) {
  if (p == nullptr) {
    if (may_be_null) return;
    throw Error(Status::invalid_argument, std::string("gradzip::cuda: ") + what + " is null");
  }
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // clear the error of an unregistered host pointer
    attr.type = cudaMemoryTypeUnregistered;
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    throw Error(Status::invalid_argument, std::string("gradzip::cuda: ") + what +
                                              " is host memory: pass device memory, or use the "
                                              "host API (gradzip::Codec::encode / gradzip::decode)");
  if (attr.type == cudaMemoryTypeDevice) {
    int dev = 0;
    check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
    if (attr.device != dev)
      throw Error(Status::invalid_argument,
                  std::string("gradzip::cuda: ") + what + " is on device " +
                      std::to_string(attr.device) + " but the current device is " + std::to_string(dev));
  }
  if (!aligned(p, 4))
    throw Error(Status::invalid_argument,
                std::string("gradzip::cuda: ") + what + " must be 4-byte aligned on the GPU");
}

int sm_count() {
  int dev = 0, v = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  return v;
}

void encode_impl(const Codec& codec, const float* grad, float* residual, size_t n, void* out,
                 size_t out_bytes, cudaStream_t stream, float prescale, void* workspace,
                 size_t workspace_bytes) {
  const CodecSpec& spec = codec.spec();
  const size_t ws_need = detail::cuda_workspace_bytes(spec, n);
  detail::check_encode_args("gradzip::cuda", codec, grad, n, out, out_bytes, workspace,
                            workspace_bytes, ws_need);
  require_device_pointer(grad, "input", n == 0);
  if (residual != nullptr) require_device_pointer(residual, "residual");
  require_device_pointer(out, "output");
  if (ws_need > 0) {
    require_device_pointer(workspace, "workspace");
    if (!aligned(workspace, 16))
      throw Error(Status::invalid_argument, "gradzip::cuda: workspace must be 16-byte aligned");
  }

  const WireHeader h = codec.wire_header(n);

  kernels::EncodeLaunch a{};
  a.grad = grad;
  a.residual = residual;
  a.prescale = prescale;
  a.n = n;
  a.out = static_cast<uint8_t*>(out);
  std::memcpy(a.header.w, &h, sizeof h);
  a.param = h.param;
  a.fp16_values = spec.fp16_values;
  a.layout = payload_layout(spec.kind, n, h.param, spec.fp16_values);
  a.workspace = workspace;
  a.vec = aligned(grad, 16) && aligned(residual, 16) && aligned(out, 16);
  a.sm_count = sm_count();
  a.stream = stream;
  visit(spec.kind, [&](auto c) { kernels::launch_encode(c, a); });
  check_cuda(cudaGetLastError(), "kernel launch");
}

// Turns a status word into the Error the host decode would throw.
void throw_if_rejected(const kernels::DecodeStatus& st) {
  const auto status = static_cast<WireStatus>(st.code);
  if (status == WireStatus::ok) {
    if (st.count_mismatch != 0)
      throw Error(Status::size_mismatch,
                  "gradzip::cuda: the payload's element count differs from the output's");
    return;
  }
  const std::string where =
      status == WireStatus::bad_index
          ? " at position " + std::to_string(st.detail / 2) +
                ((st.detail & 1) ? " (not above the previous one)" : " (out of range)")
          : " (" + std::to_string(st.detail) + ")";
  throw Error(Status::corrupt_payload,
              std::string("gradzip::cuda: corrupt payload: ") + wire_status_text(status) + where);
}

std::mutex& sync_decode_mutex() {
  static std::mutex m;
  return m;
}

void decode_impl(const void* wire, size_t bytes, float* out, size_t n, cudaStream_t stream,
                 void* workspace, size_t workspace_bytes, bool add) {
  require_device_pointer(wire, "wire");
  require_device_pointer(out, "output", n == 0);
  if (bytes < kHeaderBytes)
    throw Error(Status::corrupt_payload, "gradzip::cuda: corrupt payload: " + std::to_string(bytes) +
                                             " bytes is shorter than the 32-byte header");
  kernels::DecodeLaunch a{};
  a.wire = static_cast<const uint8_t*>(wire);
  a.bytes = bytes;
  a.out = out;
  a.n = n;
  a.add = add;
  a.sm_count = sm_count();
  a.stream = stream;
  if (workspace != nullptr) {
    if (workspace_bytes < kDecodeWorkspaceBytes || !aligned(workspace, 16))
      throw Error(Status::invalid_argument, "gradzip::cuda: the decode workspace needs " +
                                                std::to_string(kDecodeWorkspaceBytes) +
                                                " bytes, 16-byte aligned");
    require_device_pointer(workspace, "workspace");
    a.status = static_cast<kernels::DecodeStatus*>(workspace);
    kernels::launch_decode(a);
    check_cuda(cudaGetLastError(), "kernel launch");
    return;
  }
  std::lock_guard<std::mutex> lock(sync_decode_mutex());
  a.status = kernels::sync_status_word();
  if (a.status == nullptr) check_cuda(cudaGetLastError(), "cudaGetSymbolAddress");
  kernels::launch_decode(a);
  check_cuda(cudaGetLastError(), "kernel launch");
  kernels::DecodeStatus st{};
  check_cuda(cudaMemcpyAsync(&st, a.status, sizeof st, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  throw_if_rejected(st);
}

}  // namespace

bool available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

void encode(const Codec& codec, const float* in, size_t n, void* out, size_t out_bytes,
            cudaStream_t stream, float prescale, void* workspace, size_t workspace_bytes) {
  encode_impl(codec, in, nullptr, n, out, out_bytes, stream, prescale, workspace, workspace_bytes);
}

void encode_with_feedback(const Codec& codec, const float* grad, float* residual, size_t n,
                          void* out, size_t out_bytes, cudaStream_t stream, float prescale,
                          void* workspace, size_t workspace_bytes) {
  if (residual == nullptr && n != 0)
    throw Error(Status::invalid_argument, "gradzip::cuda: residual is null");
  encode_impl(codec, grad, residual, n, out, out_bytes, stream, prescale, workspace, workspace_bytes);
}

void decode(const void* wire, size_t bytes, float* out, size_t n, cudaStream_t stream,
            void* workspace, size_t workspace_bytes) {
  decode_impl(wire, bytes, out, n, stream, workspace, workspace_bytes, false);
}

void decode_add(const void* wire, size_t bytes, float* out, size_t n, cudaStream_t stream,
                void* workspace, size_t workspace_bytes) {
  decode_impl(wire, bytes, out, n, stream, workspace, workspace_bytes, true);
}

void check_decode(const void* workspace, cudaStream_t stream) {
  require_device_pointer(workspace, "workspace");
  kernels::DecodeStatus st{};
  check_cuda(cudaMemcpyAsync(&st, workspace, sizeof st, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  throw_if_rejected(st);
}

}  // namespace cuda
}  // namespace gradzip
