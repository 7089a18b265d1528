// The codec entry points on the memory of a CPU or CUDA tensor: the one place that picks the host
// API (gradzip.hpp) or the CUDA one (gradzip/cuda.hpp, on the current stream of the device). The
// ops (ops.cpp) call it per message, the compressed all-reduce (bucket_reduction.cpp) per batch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <vector>

#include "gradzip/gradzip.hpp"

namespace gradzip::torch_ext {

// Runs f, translating gradzip::Error into the Python exception its status stands for
// (cuda_error -> RuntimeError, anything else -> ValueError), prefixed with "gradzip.<what>: ".
template <class F>
auto guarded(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const gradzip::Error& e) {
    if (e.status() == gradzip::Status::cuda_error) TORCH_CHECK(false, "gradzip.", what, ": ", e.what());
    TORCH_CHECK_VALUE(false, "gradzip.", what, ": ", e.what());
  }
}

// True when this build can run the codecs on CUDA tensors.
bool cuda_compiled();

// encode (residual == nullptr) or encode_with_feedback of n floats at `in`, on `device`.
void encode_on(const c10::Device& device, const Codec& codec, const float* in, float* residual,
               size_t n, void* out, size_t out_bytes, float prescale, void* workspace,
               size_t workspace_bytes);

// decode (add = false) or decode_add into n floats at `out`, on `device`; errors throw.
void decode_on(const c10::Device& device, const void* wire, size_t bytes, float* out, size_t n,
               bool add);

// encode_batch of `items` (memory on `device`), the workspace shared by the items.
void encode_batch_on(const c10::Device& device, const std::vector<EncodeItem>& items,
                     float prescale, void* workspace, size_t workspace_bytes);

// decode_batch (add = false) or decode_add_batch of `items` (memory on `device`). On CUDA,
// `status` (16 device bytes per item) receives the status words of the asynchronous batch, which
// a later check reads (gradzip::cuda::decode_batch); on the CPU it must be null and the first
// failing item throws.
void decode_batch_on(const c10::Device& device, const std::vector<DecodeItem>& items, bool add,
                     void* status);

}  // namespace gradzip::torch_ext
