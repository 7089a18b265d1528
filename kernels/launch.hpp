// Host-side interface of the CUDA kernels: plain C++ (no CUDA language), so codecs/cuda/ can be
// compiled by the host compiler. Every launcher is asynchronous on the given stream, allocates
// nothing and assumes the arguments were checked by codecs/cuda/cuda.cpp (pointers on the device,
// 4-byte aligned, buffers large enough).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "gradzip/wire.hpp"

namespace gradzip::kernels {

// The 32-byte wire header as eight words, passed by value to the kernel that writes it.
struct HeaderWords {
  uint32_t w[8];
};

// Outcome of the device-side validation of a payload (16 bytes at the start of the decode
// workspace, or in a library-owned device word for the synchronous decode). Decoders write only
// when code == 0 and count_mismatch == 0; the element count is compared last, as on the host (a
// corrupt payload is reported as corrupt, not as a mismatch).
struct DecodeStatus {
  uint32_t code;            // WireStatus (gradzip/wire.hpp)
  uint32_t count_mismatch;  // 1: valid payload, but its element count differs from n
  uint64_t detail;          // WireCheck::detail
};
static_assert(sizeof(DecodeStatus) == 16, "status word is 16 bytes");

struct EncodeLaunch {
  const float* grad;
  float* residual;  // null: plain encode
  float prescale;
  size_t n;
  uint8_t* out;     // wire start (header), 4-byte aligned
  HeaderWords header;
  uint32_t param;         // the header's param: block (int8/sign) or k (top-k)
  TopkValues topk_values;  // top-k: how the values travel
  PayloadLayout layout;   // of this message's payload
  void* workspace;        // encode_workspace_bytes(codec, n) bytes, 16-byte aligned
  bool vec;         // grad, residual and out are 16-byte aligned: use 16-byte accesses
  int sm_count;
  cudaStream_t stream;
};

// The encoder of each codec, one overload per codec (kernels/<codec>.cu), picked by visit.
// Casts: n >= 0 (n == 0 writes the header only).
void launch_encode(Fp32Codec, const EncodeLaunch& a);  // cast.cu
void launch_encode(Fp16Codec, const EncodeLaunch& a);  // cast.cu
void launch_encode(Bf16Codec, const EncodeLaunch& a);  // cast.cu
void launch_encode(Int8Codec, const EncodeLaunch& a);  // int8.cu
void launch_encode(SignCodec, const EncodeLaunch& a);  // sign.cu
// Top-k: k >= 1 and k <= n < 2^32.
void launch_encode(TopkCodec, const EncodeLaunch& a);  // topk.cu

// Device scratch the encoder of a codec needs for n elements: none, but for top-k's.
template <class C>
size_t encode_workspace_bytes(C, size_t) { return 0; }
size_t encode_workspace_bytes(TopkCodec, size_t n);  // topk.cu

struct DecodeLaunch {
  const uint8_t* wire;  // 4-byte aligned
  uint64_t bytes;       // >= kHeaderBytes
  float* out;           // 4-byte aligned
  size_t n;
  bool add;             // out += decoded
  DecodeStatus* status;  // device memory, 16-byte aligned
  int sm_count;
  cudaStream_t stream;
};
// Validates the header against (bytes, n) and, for top-k, every index; writes *status; then
// decodes when (and only when) the status is ok. Kernels only: nothing is synchronised.
void launch_decode(const DecodeLaunch& a);

// The library-owned status word of the current device (synchronous decode without workspace).
DecodeStatus* sync_status_word();

}  // namespace gradzip::kernels
