// The per-ISA table of CPU loops: one member per codec (its loops, declared in codecs/cast.hpp,
// blockwise.hpp and topk.hpp), filled by isa_loops.hpp, which is compiled once per instruction set.
#pragma once

#include "blockwise.hpp"
#include "cast.hpp"
#include "topk.hpp"

namespace gradzip::detail {

struct CpuLoops {
  const char* isa;
  CastLoops<Fp32Codec> fp32;
  CastLoops<Fp16Codec> fp16;
  CastLoops<Bf16Codec> bf16;
  BlockwiseLoops<Int8Codec> int8;
  BlockwiseLoops<SignCodec> sign;
  TopkLoops topk;

  // The loops of codec C.
  const CastLoops<Fp32Codec>& of(Fp32Codec) const { return fp32; }
  const CastLoops<Fp16Codec>& of(Fp16Codec) const { return fp16; }
  const CastLoops<Bf16Codec>& of(Bf16Codec) const { return bf16; }
  const BlockwiseLoops<Int8Codec>& of(Int8Codec) const { return int8; }
  const BlockwiseLoops<SignCodec>& of(SignCodec) const { return sign; }
  const TopkLoops& of(TopkCodec) const { return topk; }
};

const CpuLoops& cpu_loops_portable();
const CpuLoops& cpu_loops_avx2();
const CpuLoops& cpu_loops_avx512();

}  // namespace gradzip::detail
