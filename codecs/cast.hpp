// fp32 / fp16 / bf16 on the CPU: the loops each instruction set provides (loops/cast.hpp) and the
// encode and decode over threads (cast.cpp).
#pragma once

#include "detail.hpp"

namespace gradzip::detail {

template <class C>  // Fp32Codec, Fp16Codec, Bf16Codec
struct CastLoops {
  // n values.
  void (*encode)(EncodeArgs a, size_t n, typename C::Wire* out);
  // out = decoded (add == false) or out += decoded (add == true).
  void (*decode)(const typename C::Wire* in, size_t n, float* out, bool add);
};

void encode_cpu(Fp32Codec, const CpuEncode& job);
void encode_cpu(Fp16Codec, const CpuEncode& job);
void encode_cpu(Bf16Codec, const CpuEncode& job);
void decode_cpu(Fp32Codec, const CpuDecode& job);
void decode_cpu(Fp16Codec, const CpuDecode& job);
void decode_cpu(Bf16Codec, const CpuDecode& job);

}  // namespace gradzip::detail
