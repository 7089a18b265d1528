// fp32 / fp16 / bf16 encoders with the 1/world pre-scale and fused error feedback: one pass,
// 4 elements per thread, 16-byte loads when every pointer is 16-byte aligned.
#include "common.cuh"

namespace gradzip::kernels {
namespace {

constexpr int kV = 4;  // elements per thread

template <class P, bool Vec>
__global__ void __launch_bounds__(kThreads) cast_encode_kernel(Source src, size_t n, uint8_t* out,
                                                               HeaderWords header) {
  write_header(out, header, 0, 0);
  const size_t i = (static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x) * kV;
  if (i >= n) return;
  const int valid = n - i < kV ? static_cast<int>(n - i) : kV;
  float c[kV], r[kV], nr[kV];
  typename P::Wire p[kV];
  src.load<kV, Vec>(i, valid, c, r);
#pragma unroll
  for (int j = 0; j < kV; ++j) {
    p[j] = P::encode(c[j]);
    nr[j] = el::ef_residual(c[j], P::decode(p[j]), r[j]);
  }
  typename P::Wire* payload = reinterpret_cast<typename P::Wire*>(out + kHeaderBytes);
  if (Vec && valid == kV) {
    if constexpr (sizeof(typename P::Wire) == 4) {
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
  auto* kernel = a.vec ? cast_encode_kernel<P, true> : cast_encode_kernel<P, false>;
  kernel<<<grid, kThreads, 0, a.stream>>>(src, a.n, a.out, a.header);
}

}  // namespace

void launch_encode(Fp32Codec, const EncodeLaunch& a) { launch<Fp32Codec>(a); }
void launch_encode(Fp16Codec, const EncodeLaunch& a) { launch<Fp16Codec>(a); }
void launch_encode(Bf16Codec, const EncodeLaunch& a) { launch<Bf16Codec>(a); }

}  // namespace gradzip::kernels
