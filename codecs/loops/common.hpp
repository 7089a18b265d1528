// Helpers of the CPU loops of every codec (loops/<codec>.hpp): the encoders' input c, the
// error-feedback and decode_add switches, and the L1 block cache of the blockwise codecs.
// Internal linkage, like every loop: see isa_loops.hpp.
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

// ---- blocks held in L1 ----------------------------------------------------------------------
// int8 and sign read each block twice (its scale first, then the payload): the first pass keeps c
// in an L1 buffer so the second neither reads grad and residual again nor recomputes c. A block
// larger than the buffer is emitted in buffer-sized pieces, c recomputed for each piece.
constexpr size_t kCacheFloats = 4096;  // 16 KB

template <bool EF>
inline void fill_c(const float* __restrict g, const float* __restrict r, float p, size_t len,
                   float* __restrict c) {
  for (size_t i = 0; i < len; ++i) c[i] = cin<EF>(g, r, p, i);
}

// Calls emit(c, offset, length) for the block's pieces, c filled; `cached` says whether the
// first pass has left the whole block in c already.
template <bool EF, class Emit>
inline void for_each_piece(const float* g, const float* r, float p, size_t len, bool cached,
                           float* c, Emit&& emit) {
  for (size_t t = 0; t < len; t += kCacheFloats) {
    const size_t l = min_sz(kCacheFloats, len - t);
    if (!cached) fill_c<EF>(g + t, EF ? r + t : nullptr, p, l, c);
    emit(t, l);
  }
}

}  // namespace
}  // namespace gradzip::detail
