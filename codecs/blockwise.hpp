// Blockwise int8 and sign on the CPU: the loops each instruction set provides
// (loops/blockwise.hpp over loops/int8.hpp and loops/sign.hpp) and the encode and decode over
// threads (blockwise.cpp).
#pragma once

#include "detail.hpp"

namespace gradzip::detail {

template <class C>  // Int8Codec, SignCodec
struct BlockwiseLoops {
  // The range starts on a block boundary; scales gets ceil(n / block) values.
  void (*encode)(EncodeArgs a, size_t n, uint32_t block, float* scales, typename C::Word* words);
  // out = decoded (add == false) or out += decoded (add == true).
  void (*decode)(const float* scales, const typename C::Word* words, size_t n, uint32_t block,
                 float* out, bool add);
};

void encode_cpu(Int8Codec, const CpuEncode& job);
void encode_cpu(SignCodec, const CpuEncode& job);
void decode_cpu(Int8Codec, const CpuDecode& job);
void decode_cpu(SignCodec, const CpuDecode& job);

}  // namespace gradzip::detail
