// Device helpers shared by every kernel family: the encoders' input c, vector loads, the header
// write and the decode status gate. Included only by the .cu files of kernels/.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradzip/element.hpp"
#include "gradzip/wire.hpp"
#include "launch.hpp"

namespace gradzip::kernels {

namespace el = gradzip::element;

constexpr int kThreads = 256;  // threads per block of every grid-sized kernel
constexpr unsigned kFullMask = 0xFFFFFFFFu;

inline unsigned grid_for(uint64_t items, uint64_t per_block) {
  const uint64_t g = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(g == 0 ? 1 : g);
}

// The encoders' input, exactly as the CPU computes it (codecs/detail.hpp encode_input):
// c = grad * prescale, or element::ef_input(grad, prescale, residual) with error feedback.
struct Source {
  const float* grad;
  float* residual;  // null: plain encode
  float prescale;

  // Loads V consecutive elements starting at i; only the first `valid` (<= V) are read, the rest
  // are set to 0. Vec: grad and residual are 16-byte aligned and i is a multiple of 4.
  template <int V, bool Vec>
  __device__ __forceinline__ void load(size_t i, int valid, float (&c)[V], float (&r)[V]) const {
    if constexpr (Vec && V % 4 == 0) {
      if (valid == V) {
#pragma unroll
        for (int q = 0; q < V; q += 4) {
          const float4 g4 = *reinterpret_cast<const float4*>(grad + i + q);
          float4 r4 = make_float4(0.f, 0.f, 0.f, 0.f);
          if (residual) r4 = *reinterpret_cast<const float4*>(residual + i + q);
          const float gs[4] = {g4.x, g4.y, g4.z, g4.w};
          const float rs[4] = {r4.x, r4.y, r4.z, r4.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            r[q + j] = rs[j];
            c[q + j] = residual ? el::ef_input(gs[j], prescale, rs[j]) : el::scaled_input(gs[j], prescale);
          }
        }
        return;
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      c[j] = 0.0f;
      r[j] = 0.0f;
      if (j < valid) {
        const float g = grad[i + j];
        if (residual) {
          r[j] = residual[i + j];
          c[j] = el::ef_input(g, prescale, r[j]);
        } else {
          c[j] = el::scaled_input(g, prescale);
        }
      }
    }
  }

  // Writes the new residual of V consecutive elements (first `valid`); no-op for plain encode.
  template <int V, bool Vec>
  __device__ __forceinline__ void store_residual(size_t i, int valid, const float (&nr)[V]) const {
    if (!residual) return;
    if constexpr (Vec && V % 4 == 0) {
      if (valid == V) {
#pragma unroll
        for (int q = 0; q < V; q += 4)
          *reinterpret_cast<float4*>(residual + i + q) =
              make_float4(nr[q], nr[q + 1], nr[q + 2], nr[q + 3]);
        return;
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (j < valid) residual[i + j] = nr[j];
  }
};

// Block 0 writes the 32-byte header (out is 4-byte aligned) and zeroes the payload bytes
// [pad_begin, pad_end) (the alignment padding between sections), so every byte is written.
__device__ __forceinline__ void write_header(uint8_t* out, const HeaderWords& h, uint32_t pad_begin,
                                             uint32_t pad_end) {
  if (blockIdx.x != 0) return;
  if (threadIdx.x < 8) reinterpret_cast<uint32_t*>(out)[threadIdx.x] = h.w[threadIdx.x];
  for (uint32_t b = pad_begin + threadIdx.x; b < pad_end; b += blockDim.x)
    out[kHeaderBytes + b] = 0;
}

// Decoders run only when the validation kernels left the status word at ok (code and
// count_mismatch both 0). Earlier kernels of the stream wrote it: plain loads see their writes.
__device__ __forceinline__ bool decode_allowed(const DecodeStatus* st) {
  return st->code == 0 && st->count_mismatch == 0;
}

// Reads the (validated) header from device memory; wire is 4-byte aligned.
__device__ __forceinline__ WireHeader load_header(const uint8_t* wire) {
  WireHeader h;
  uint32_t* w = reinterpret_cast<uint32_t*>(&h);
#pragma unroll
  for (int j = 0; j < 8; ++j) w[j] = reinterpret_cast<const uint32_t*>(wire)[j];
  return h;
}

}  // namespace gradzip::kernels
