// Helpers of the CPU loops of every codec (loops/<codec>.hpp): the encoders' input c and the
// error-feedback and decode_add switches. Every loop header includes this one first, so the
// guard and the namespace alias below stand here once. Internal linkage, like every loop: see
// isa_loops.hpp.
#pragma once
#ifndef GZ_ISA_NS
#error "included by isa_loops.hpp only: compiled once per instruction set"
#endif

#include <type_traits>

#include "../detail.hpp"

namespace gradzip::detail {
namespace {
namespace el = gradzip::element;

// c[i] of the encoders; EF selects the fused error-feedback input.
template <bool EF>
inline float cin(const float* __restrict g, const float* __restrict r, float p, size_t i) {
  if constexpr (EF) return el::ef_input(g[i], p, r[i]);
  else return el::scaled_input(g[i], p);
}

template <class F>
inline void with_ef(const EncodeArgs& a, F&& f) {
  if (a.residual) f(std::true_type{});
  else f(std::false_type{});
}

inline size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }
inline float abs_f(float x) { return el::bits_float(el::abs_bits(x)); }

// Selects the decode_add variant: f(true_type) adds to the output, f(false_type) overwrites it.
template <class F>
inline void with_add(bool add, F&& f) {
  if (add) f(std::true_type{});
  else f(std::false_type{});
}
template <bool ADD>
inline void store(float* __restrict out, size_t i, float v) {
  if constexpr (ADD) out[i] = out[i] + v;
  else out[i] = v;
}

}  // namespace
}  // namespace gradzip::detail
