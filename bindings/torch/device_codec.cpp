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

void encode_on(const c10::Device& device, const Codec& codec, const float* in, float* residual,
               size_t n, void* out, size_t out_bytes, float prescale, void* workspace,
               size_t workspace_bytes) {
#if defined(GRADZIP_TORCH_CUDA)
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t s = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    if (residual)
      gradzip::cuda::encode_with_feedback(codec, in, residual, n, out, out_bytes, s, prescale,
                                          workspace, workspace_bytes);
    else
      gradzip::cuda::encode(codec, in, n, out, out_bytes, s, prescale, workspace, workspace_bytes);
    return;
  }
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), "gradzip: tensors on ", device,
                    " are not supported by this build (CPU", cuda_compiled() ? " and CUDA" : "",
                    " only)");
  if (residual)
    codec.encode_with_feedback(in, residual, n, out, out_bytes, prescale, workspace,
                               workspace_bytes);
  else
    codec.encode(in, n, out, out_bytes, prescale, workspace, workspace_bytes);
}

void decode_on(const c10::Device& device, const void* wire, size_t bytes, float* out, size_t n,
               bool add, [[maybe_unused]] void* status) {
#if defined(GRADZIP_TORCH_CUDA)
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t s = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    const size_t status_bytes = status ? gradzip::cuda::kDecodeWorkspaceBytes : 0;
    if (add)
      gradzip::cuda::decode_add(wire, bytes, out, n, s, status, status_bytes);
    else
      gradzip::cuda::decode(wire, bytes, out, n, s, status, status_bytes);
    return;
  }
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), "gradzip: tensors on ", device,
                    " are not supported by this build");
  if (add)
    gradzip::decode_add(wire, bytes, out, n);
  else
    gradzip::decode(wire, bytes, out, n);
}

}  // namespace gradzip::torch_ext
