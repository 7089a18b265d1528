// gradzip::cuda: argument checks, header construction and dispatch to the kernels of kernels/,
// for one message and for batches (whose checks ask the driver once per batch, not per message).
// Host code only (compiled by the C++ compiler); the kernels are behind kernels/launch.hpp.
#include "gradzip/cuda.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "../../kernels/launch.hpp"
#include "../batch.hpp"
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

[[noreturn]] void bad_arg(const std::string& why) {
  throw Error(Status::invalid_argument, "gradzip::cuda: " + why);
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

void require_non_null(const void* p, const char* what) {
  if (p == nullptr) bad_arg(std::string(what) + " is null");
}

void require_aligned(const void* p, const char* what) {
  if (!aligned(p, 4)) bad_arg(std::string(what) + " must be 4-byte aligned on the GPU");
}

// The current device, asked once per call: every pointer of the call is checked against it.
class CurrentDevice {
 public:
  CurrentDevice() { check_cuda(cudaGetDevice(&id_), "cudaGetDevice"); }

  // p must be device (or managed) memory of this device.
  void require_memory(const void* p, const char* what) const {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      cudaGetLastError();  // clear the error of an unregistered host pointer
      attr.type = cudaMemoryTypeUnregistered;
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
      bad_arg(std::string(what) +
              " is host memory: pass device memory, or use the host API (gradzip::Codec::encode / "
              "gradzip::decode)");
    if (attr.type == cudaMemoryTypeDevice && attr.device != id_)
      bad_arg(std::string(what) + " is on device " + std::to_string(attr.device) +
              " but the current device is " + std::to_string(id_));
  }

  int sm_count() const {
    int v = 0;
    check_cuda(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, id_),
               "cudaDeviceGetAttribute");
    return v;
  }

 private:
  int id_ = 0;
};

// p must be device (or managed) memory of the current device, 4-byte aligned. Null is allowed
// only when nothing is read or written through it.
void require_device_pointer(const CurrentDevice& dev, const void* p, const char* what,
                            bool may_be_null = false) {
  if (p == nullptr && may_be_null) return;
  require_non_null(p, what);
  dev.require_memory(p, what);
  require_aligned(p, what);
}

void require_workspace(const CurrentDevice& dev, const void* workspace) {
  require_device_pointer(dev, workspace, "workspace");
  if (!aligned(workspace, 16)) bad_arg("workspace must be 16-byte aligned");
}

// The addresses one argument of a batch touches, checked at both ends (one query each) rather
// than per message.
class Span {
 public:
  void add(const void* p, size_t bytes) {
    if (p == nullptr || bytes == 0) return;
    const uintptr_t b = reinterpret_cast<uintptr_t>(p);
    lo_ = std::min(lo_, b);
    hi_ = std::max(hi_, b + bytes);
  }
  void require(const CurrentDevice& dev, const char* what) const {
    if (hi_ == 0) return;  // nothing touched
    dev.require_memory(reinterpret_cast<const void*>(lo_), what);
    dev.require_memory(reinterpret_cast<const void*>(hi_ - 1), what);
  }

 private:
  uintptr_t lo_ = UINTPTR_MAX, hi_ = 0;
};

// Launches the encoder of one message whose arguments were checked.
void launch_encode_message(const Codec& codec, const float* grad, float* residual, size_t n,
                           void* out, float prescale, void* workspace, int sm_count,
                           cudaStream_t stream) {
  const CodecSpec& spec = codec.spec();
  const WireHeader h = codec.wire_header(n);
  kernels::EncodeLaunch a{};
  a.grad = grad;
  a.residual = residual;
  a.prescale = prescale;
  a.n = n;
  a.out = static_cast<uint8_t*>(out);
  std::memcpy(a.header.w, &h, sizeof h);
  a.param = h.param;
  a.topk_values = spec.values;
  a.layout = payload_layout(spec.kind, n, h.param, h.flags);
  a.workspace = workspace;
  a.vec = aligned(grad, 16) && aligned(residual, 16) && aligned(out, 16);
  a.sm_count = sm_count;
  a.stream = stream;
  visit(spec.kind, [&](auto c) { kernels::launch_encode(c, a); });
}

void encode_impl(const Codec& codec, const float* grad, float* residual, size_t n, void* out,
                 size_t out_bytes, cudaStream_t stream, float prescale, void* workspace,
                 size_t workspace_bytes) {
  const size_t ws_need = detail::cuda_workspace_bytes(codec.spec(), n);
  detail::check_encode_args("gradzip::cuda", codec, grad, n, out, out_bytes, workspace,
                            workspace_bytes, ws_need);
  const CurrentDevice dev;
  require_device_pointer(dev, grad, "input", n == 0);
  if (residual != nullptr) require_device_pointer(dev, residual, "residual");
  require_device_pointer(dev, out, "output");
  if (ws_need > 0) require_workspace(dev, workspace);
  launch_encode_message(codec, grad, residual, n, out, prescale, workspace, dev.sm_count(), stream);
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

// The one check of the wire bytes the host can make: the header fits.
void require_header_bytes(size_t bytes) {
  if (bytes < kHeaderBytes)
    throw Error(Status::corrupt_payload, "gradzip::cuda: corrupt payload: " + std::to_string(bytes) +
                                             " bytes is shorter than the 32-byte header");
}

// The status words of `count` decodes: status_bytes of 16-byte aligned device memory.
void require_status_words(const CurrentDevice& dev, const void* status, size_t status_bytes,
                          size_t count, const char* what) {
  if (status_bytes < count * kDecodeWorkspaceBytes || !aligned(status, 16))
    bad_arg(std::string("the decode ") + what + " needs " + std::to_string(count * kDecodeWorkspaceBytes) +
            " bytes, 16-byte aligned");
  require_device_pointer(dev, status, what);
}

// Validation and decode of one message whose pointers were checked, its status word at `status`.
void launch_decode_message(const void* wire, size_t bytes, float* out, size_t n, bool add,
                           kernels::DecodeStatus* status, int sm_count, cudaStream_t stream) {
  kernels::DecodeLaunch a{};
  a.wire = static_cast<const uint8_t*>(wire);
  a.bytes = bytes;
  a.out = out;
  a.n = n;
  a.add = add;
  a.status = status;
  a.sm_count = sm_count;
  a.stream = stream;
  kernels::launch_decode(a);
}

std::mutex& sync_decode_mutex() {
  static std::mutex m;
  return m;
}

void decode_impl(const void* wire, size_t bytes, float* out, size_t n, cudaStream_t stream,
                 void* workspace, size_t workspace_bytes, bool add) {
  const CurrentDevice dev;
  require_device_pointer(dev, wire, "wire");
  require_device_pointer(dev, out, "output", n == 0);
  require_header_bytes(bytes);
  const int sms = dev.sm_count();
  if (workspace != nullptr) {
    require_status_words(dev, workspace, workspace_bytes, 1, "workspace");
    launch_decode_message(wire, bytes, out, n, add, static_cast<kernels::DecodeStatus*>(workspace),
                          sms, stream);
    check_cuda(cudaGetLastError(), "kernel launch");
    return;
  }
  std::lock_guard<std::mutex> lock(sync_decode_mutex());
  kernels::DecodeStatus* status = kernels::sync_status_word();
  if (status == nullptr) check_cuda(cudaGetLastError(), "cudaGetSymbolAddress");
  launch_decode_message(wire, bytes, out, n, add, status, sms, stream);
  check_cuda(cudaGetLastError(), "kernel launch");
  kernels::DecodeStatus st{};
  check_cuda(cudaMemcpyAsync(&st, status, sizeof st, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  throw_if_rejected(st);
}

// Waits for `stream` and copies `count` status words from the device.
std::vector<kernels::DecodeStatus> read_status_words(const void* status, size_t count,
                                                     cudaStream_t stream, const char* what) {
  require_device_pointer(CurrentDevice(), status, what);
  std::vector<kernels::DecodeStatus> words(count);
  check_cuda(cudaMemcpyAsync(words.data(), status, count * sizeof(kernels::DecodeStatus),
                             cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return words;
}

void decode_batch_impl(const DecodeItem* items, size_t count, cudaStream_t stream, void* status,
                       size_t status_bytes, bool add) {
  detail::require_items("gradzip::cuda", items, count);
  if (count == 0) return;
  Span wire, out;
  for (size_t i = 0; i < count; ++i) {
    const DecodeItem& it = items[i];
    detail::for_item(i, count, [&] {
      require_non_null(it.wire, "wire");
      require_aligned(it.wire, "wire");
      if (it.n > 0) {
        require_non_null(it.out, "output");
        require_aligned(it.out, "output");
      }
      require_header_bytes(it.bytes);
    });
    wire.add(it.wire, it.bytes);
    out.add(it.out, it.n * sizeof(float));
  }
  const CurrentDevice dev;
  wire.require(dev, "wire");
  out.require(dev, "output");
  require_status_words(dev, status, status_bytes, count, "status");
  const int sms = dev.sm_count();
  auto* words = static_cast<kernels::DecodeStatus*>(status);
  for (size_t i = 0; i < count; ++i) {
    const DecodeItem& it = items[i];
    launch_decode_message(it.wire, it.bytes, it.out, it.n, add, words + i, sms, stream);
  }
  check_cuda(cudaGetLastError(), "kernel launch");
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
  throw_if_rejected(read_status_words(workspace, 1, stream, "workspace")[0]);
}

void encode_batch(const EncodeItem* items, size_t count, cudaStream_t stream, float prescale,
                  void* workspace, size_t workspace_bytes) {
  detail::require_items("gradzip::cuda", items, count);
  if (count == 0) return;
  Span in, residual, out;
  size_t ws_need = 0;
  for (size_t i = 0; i < count; ++i) {
    const EncodeItem& it = items[i];
    detail::for_item(i, count, [&] {
      const Codec& codec = detail::item_codec("gradzip::cuda", it);
      const size_t need = detail::cuda_workspace_bytes(codec.spec(), it.n);
      detail::check_encode_args("gradzip::cuda", codec, it.in, it.n, it.out, it.out_bytes,
                                workspace, workspace_bytes, need);
      if (it.n > 0) require_aligned(it.in, "input");
      if (it.residual != nullptr) require_aligned(it.residual, "residual");
      require_aligned(it.out, "output");
      ws_need = std::max(ws_need, need);
      in.add(it.in, it.n * sizeof(float));
      if (it.residual != nullptr) residual.add(it.residual, it.n * sizeof(float));
      out.add(it.out, codec.encoded_bytes(it.n));
    });
  }
  const CurrentDevice dev;
  in.require(dev, "input");
  residual.require(dev, "residual");
  out.require(dev, "output");
  if (ws_need > 0) require_workspace(dev, workspace);
  const int sms = dev.sm_count();
  for (size_t i = 0; i < count; ++i) {
    const EncodeItem& it = items[i];
    launch_encode_message(*it.codec, it.in, it.residual, it.n, it.out, prescale, workspace, sms,
                          stream);
  }
  check_cuda(cudaGetLastError(), "kernel launch");
}

void decode_batch(const DecodeItem* items, size_t count, cudaStream_t stream, void* status,
                  size_t status_bytes) {
  decode_batch_impl(items, count, stream, status, status_bytes, false);
}

void decode_add_batch(const DecodeItem* items, size_t count, cudaStream_t stream, void* status,
                      size_t status_bytes) {
  decode_batch_impl(items, count, stream, status, status_bytes, true);
}

void check_decode_batch(const void* status, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  const auto words = read_status_words(status, count, stream, "status");
  for (size_t i = 0; i < count; ++i)
    detail::for_item(i, count, [&] { throw_if_rejected(words[i]); });
}

}  // namespace cuda
}  // namespace gradzip
