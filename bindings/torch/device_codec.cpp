#include "device_codec.hpp"

#if defined(GRADZIP_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "gradzip/cuda.hpp"
#endif

namespace gradzip::torch_ext {

bool cuda_compiled() {
#if defined(GRADZIP_TORCH_CUDA)
  return true;
#else
  return false;
#endif
}

namespace {

// Reached for a tensor that is not on the CUDA branch: CPU, or a device this build cannot run.
void require_cpu(const c10::Device& device) {
  TORCH_CHECK_VALUE(device.is_cpu(), "gradzip: tensors on ", device,
                    " are not supported by this build (CPU", cuda_compiled() ? " and CUDA" : "",
                    " only)");
}

#if defined(GRADZIP_TORCH_CUDA)
cudaStream_t current_stream(const c10::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}
#endif

}  // namespace

void encode_on(const c10::Device& device, const Codec& codec, const float* in, float* residual,
               size_t n, void* out, size_t out_bytes, float prescale, void* workspace,
               size_t workspace_bytes) {
#if defined(GRADZIP_TORCH_CUDA)
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t s = current_stream(device);
    if (residual)
      gradzip::cuda::encode_with_feedback(codec, in, residual, n, out, out_bytes, s, prescale,
                                          workspace, workspace_bytes);
    else
      gradzip::cuda::encode(codec, in, n, out, out_bytes, s, prescale, workspace, workspace_bytes);
    return;
  }
#endif
  require_cpu(device);
  if (residual)
    codec.encode_with_feedback(in, residual, n, out, out_bytes, prescale, workspace,
                               workspace_bytes);
  else
    codec.encode(in, n, out, out_bytes, prescale, workspace, workspace_bytes);
}

void decode_on(const c10::Device& device, const void* wire, size_t bytes, float* out, size_t n,
               bool add) {
#if defined(GRADZIP_TORCH_CUDA)
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t s = current_stream(device);
    if (add)
      gradzip::cuda::decode_add(wire, bytes, out, n, s);
    else
      gradzip::cuda::decode(wire, bytes, out, n, s);
    return;
  }
#endif
  require_cpu(device);
  if (add)
    gradzip::decode_add(wire, bytes, out, n);
  else
    gradzip::decode(wire, bytes, out, n);
}

void encode_batch_on(const c10::Device& device, const std::vector<EncodeItem>& items,
                     float prescale, void* workspace, size_t workspace_bytes) {
#if defined(GRADZIP_TORCH_CUDA)
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    gradzip::cuda::encode_batch(items.data(), items.size(), current_stream(device), prescale,
                                workspace, workspace_bytes);
    return;
  }
#endif
  require_cpu(device);
  gradzip::encode_batch(items.data(), items.size(), prescale, workspace, workspace_bytes);
}

void decode_batch_on(const c10::Device& device, const std::vector<DecodeItem>& items, bool add,
                     [[maybe_unused]] void* status) {
#if defined(GRADZIP_TORCH_CUDA)
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t s = current_stream(device);
    const size_t status_bytes = items.size() * gradzip::cuda::kDecodeWorkspaceBytes;
    if (add)
      gradzip::cuda::decode_add_batch(items.data(), items.size(), s, status, status_bytes);
    else
      gradzip::cuda::decode_batch(items.data(), items.size(), s, status, status_bytes);
    return;
  }
#endif
  require_cpu(device);
  TORCH_CHECK(status == nullptr, "gradzip: device status words are for CUDA tensors");
  if (add)
    gradzip::decode_add_batch(items.data(), items.size());
  else
    gradzip::decode_batch(items.data(), items.size());
}

}  // namespace gradzip::torch_ext
