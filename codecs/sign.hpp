// 1-bit sign on the CPU: the loops each instruction set provides (loops/sign.hpp) and the encode
// and decode over threads (sign.cpp).
#pragma once

#include "detail.hpp"

namespace gradzip::detail {

struct SignLoops {
  // The range starts on a block boundary; scales gets ceil(n / block) values.
  void (*encode)(EncodeArgs a, size_t n, uint32_t block, float* scales, uint32_t* words);
  // out = decoded (add == false) or out += decoded (add == true).
  void (*decode)(const float* scales, const uint32_t* words, size_t n, uint32_t block,
                 float* out, bool add);
};

void encode_cpu(SignCodec, const CpuEncode& job);
void decode_cpu(SignCodec, const CpuDecode& job);

}  // namespace gradzip::detail
