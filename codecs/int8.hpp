// Blockwise int8 on the CPU: the loops each instruction set provides (loops/int8.hpp) and the
// encode and decode over threads (int8.cpp).
#pragma once

#include "detail.hpp"

namespace gradzip::detail {

struct Int8Loops {
  // The range starts on a block boundary; scales gets ceil(n / block) values.
  void (*encode)(EncodeArgs a, size_t n, uint32_t block, float* scales, int8_t* q);
  // out = decoded (add == false) or out += decoded (add == true).
  void (*decode)(const float* scales, const int8_t* q, size_t n, uint32_t block, float* out,
                 bool add);
};

void encode_cpu(Int8Codec, const CpuEncode& job);
void decode_cpu(Int8Codec, const CpuDecode& job);

}  // namespace gradzip::detail
