// fp32 / fp16 / bf16 encoders with the 1/world pre-scale and fused error feedback: one pass,
// 4 elements per thread, 16-byte loads when every pointer is 16-byte aligned.
#include "common.cuh"

namespace gradzip::kernels {
namespace {

struct F32 {
  using T = float;
  __device__ static T enc(float c) { return c; }
  __device__ static float dec(T v) { return v; }
};
struct F16 {
  using T = uint16_t;
  __device__ static T enc(float c) { return el::float_to_fp16(c); }
  __device__ static float dec(T v) { return el::fp16_to_float(v); }
};
struct BF16 {
  using T = uint16_t;
  __device__ static T enc(float c) { return el::float_to_bf16(c); }
  __device__ static float dec(T v) { return el::bf16_to_float(v); }
};

constexpr int kV = 4;  // elements per thread

template <class P, bool Vec>
__global__ void __launch_bounds__(kThreads) cast_encode_kernel(Source src, size_t n, uint8_t* out,
                                                               HeaderWords header) {
  write_header(out, header, 0, 0);
  const size_t i = (static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x) * kV;
  if (i >= n) return;
  const int valid = n - i < kV ? static_cast<int>(n - i) : kV;
  float c[kV], r[kV], nr[kV];
  typename P::T p[kV];
  src.load<kV, Vec>(i, valid, c, r);
#pragma unroll
  for (int j = 0; j < kV; ++j) {
    p[j] = P::enc(c[j]);
    nr[j] = el::ef_residual(c[j], P::dec(p[j]), r[j]);
  }
  typename P::T* payload = reinterpret_cast<typename P::T*>(out + kHeaderBytes);
  if (Vec && valid == kV) {
    if constexpr (sizeof(typename P::T) == 4) {
      *reinterpret_cast<float4*>(payload + i) = make_float4(p[0], p[1], p[2], p[3]);
    } else {
      *reinterpret_cast<uint2*>(payload + i) =
          make_uint2(p[0] | (uint32_t{p[1]} << 16), p[2] | (uint32_t{p[3]} << 16));
    }
  } else {
#pragma unroll
    for (int j = 0; j < kV; ++j)
      if (j < valid) payload[i + j] = p[j];
  }
  src.store_residual<kV, Vec>(i, valid, nr);
}

template <class P>
void launch(const EncodeLaunch& a) {
  const Source src{a.grad, a.residual, a.prescale};
  const unsigned grid = grid_for(a.n, uint64_t{kThreads} * kV);
  if (a.vec)
    cast_encode_kernel<P, true><<<grid, kThreads, 0, a.stream>>>(src, a.n, a.out, a.header);
  else
    cast_encode_kernel<P, false><<<grid, kThreads, 0, a.stream>>>(src, a.n, a.out, a.header);
}

}  // namespace

void launch_cast_encode(CodecKind kind, const EncodeLaunch& a) {
  switch (kind) {
    case CodecKind::fp32: launch<F32>(a); break;
    case CodecKind::fp16: launch<F16>(a); break;
    default: launch<BF16>(a); break;
  }
}

}  // namespace gradzip::kernels
