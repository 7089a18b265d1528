// The per-ISA table of CPU loops: one member per codec (its loops, declared in codecs/<codec>.hpp),
// filled by isa_loops.hpp, which is compiled once per instruction set.
#pragma once

#include "cast.hpp"
#include "int8.hpp"
#include "sign.hpp"
#include "topk.hpp"

namespace gradzip::detail {

struct CpuLoops {
  const char* isa;
  CastLoops<Fp32Codec> fp32;
  CastLoops<Fp16Codec> fp16;
  CastLoops<Bf16Codec> bf16;
  Int8Loops int8;
  SignLoops sign;
  TopkLoops topk;

  // The loops of codec C.
  const CastLoops<Fp32Codec>& of(Fp32Codec) const { return fp32; }
  const CastLoops<Fp16Codec>& of(Fp16Codec) const { return fp16; }
  const CastLoops<Bf16Codec>& of(Bf16Codec) const { return bf16; }
  const Int8Loops& of(Int8Codec) const { return int8; }
  const SignLoops& of(SignCodec) const { return sign; }
  const TopkLoops& of(TopkCodec) const { return topk; }
};

const CpuLoops& cpu_loops_portable();
const CpuLoops& cpu_loops_avx2();
const CpuLoops& cpu_loops_avx512();

}  // namespace gradzip::detail
