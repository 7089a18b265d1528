// Internal interfaces of the CPU path: the encoders' input, the jobs that encode.cpp and
// decode.cpp hand to each codec (codecs/<codec>.cpp), and the choice of the per-ISA loop table
// (cpu_table.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradzip/gradzip.hpp"

namespace gradzip::detail {

// The encoders' input: c[i] = grad[i] * prescale (+ residual[i] when residual is non-null).
// Pointers are already offset to the range a kernel works on.
struct EncodeArgs {
  const float* grad;
  float* residual;  // null: plain encode, no residual read or written
  float prescale;

  // The same input from element `begin` on.
  EncodeArgs at(size_t begin) const {
    EncodeArgs x = *this;
    x.grad += begin;
    if (x.residual) x.residual += begin;
    return x;
  }
};

// c of one element, exactly as the fused encoders compute it (element.hpp's rule).
inline float encode_input(const EncodeArgs& a, size_t i) {
  return a.residual ? element::ef_input(a.grad[i], a.prescale, a.residual[i])
                    : element::scaled_input(a.grad[i], a.prescale);
}

struct CpuLoops;  // cpu_table.hpp

// One encode, checked, its header written: what a codec's encode_cpu fills in.
struct CpuEncode {
  const CpuLoops& loops;
  const CodecSpec& spec;
  EncodeArgs a;
  size_t n;
  uint32_t param;      // the header's param (block or k)
  PayloadLayout layout;
  char* payload;       // after the header, 4-byte aligned
  void* workspace;     // Codec::workspace_bytes(n) bytes, 4-byte aligned
};

// One decode of a validated message holding exactly n elements.
struct CpuDecode {
  const CpuLoops& loops;
  const WireHeader& header;
  PayloadLayout layout;
  const char* payload;  // after the header, 4-byte aligned
  float* out;
  size_t n;
  bool add;  // out += decoded instead of out = decoded
};

// The table picked for this CPU (GRADZIP_CPU_ISA=portable|avx2|avx512 can force a lower one).
const CpuLoops& cpu_loops();
// Tests: switch the table; returns false when the CPU lacks the instruction set.
bool force_isa(const char* name);

}  // namespace gradzip::detail
