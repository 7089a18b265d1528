// Blockwise int8 CPU loops: per block, a max pass (c into L1), then one quantise + residual pass.
#pragma once
#ifndef GZ_ISA_NS
#error "included by isa_loops.hpp only: compiled once per instruction set"
#endif

#include "common.hpp"

namespace gradzip::detail {
namespace {
namespace el = gradzip::element;

template <bool EF>
inline void int8_emit(const float* __restrict c, float* __restrict r, size_t len, float inv,
                      float scale, int8_t* __restrict q) {
  for (size_t i = 0; i < len; ++i) {
    const float level = el::int8_level(c[i], inv);
    q[i] = static_cast<int8_t>(level);
    if constexpr (EF) r[i] = el::ef_residual(c[i], el::int8_level_value(level, scale), r[i]);
  }
}

template <bool EF>
void int8_encode_loop(const float* __restrict g, float* __restrict r, float p, size_t n,
                      uint32_t block, float* __restrict scales, int8_t* __restrict q) {
  alignas(64) float c[kCacheFloats];
  for (size_t s = 0, b = 0; s < n; s += block, ++b) {
    const size_t len = min_sz(block, n - s);
    const float* gb = g + s;
    float* rb = EF ? r + s : nullptr;
    const bool cached = len <= kCacheFloats;
    uint32_t m = 0;
    if (cached) {
      for (size_t i = 0; i < len; ++i) {
        const float ci = cin<EF>(gb, rb, p, i);
        c[i] = ci;
        const uint32_t k = el::abs_bits(ci);
        m = k > m ? k : m;
      }
    } else {
      for (size_t i = 0; i < len; ++i) {
        const uint32_t k = el::abs_bits(cin<EF>(gb, rb, p, i));
        m = k > m ? k : m;
      }
    }
    const float scale = el::int8_scale(m);
    const float inv = el::int8_inv_scale(m);
    scales[b] = scale;
    for_each_piece<EF>(gb, rb, p, len, cached, c, [&](size_t t, size_t l) {
      int8_emit<EF>(c, EF ? rb + t : nullptr, l, inv, scale, q + s + t);
    });
  }
}
void encode_int8(EncodeArgs a, size_t n, uint32_t block, float* scales, int8_t* q) {
  with_ef(a, [&](auto ef) {
    int8_encode_loop<ef.value>(a.grad, a.residual, a.prescale, n, block, scales, q);
  });
}

template <bool ADD>
void int8_decode_loop(const float* __restrict scales, const int8_t* __restrict q, size_t n,
                      uint32_t block, float* __restrict out) {
  for (size_t s = 0, b = 0; s < n; s += block, ++b) {
    const size_t len = min_sz(block, n - s);
    const float scale = scales[b];
    for (size_t i = 0; i < len; ++i)
      store<ADD>(out + s, i, el::int8_dequantize(q[s + i], scale));
  }
}
void decode_int8(const float* scales, const int8_t* q, size_t n, uint32_t block, float* out,
                 bool add) {
  with_add(add, [&](auto a) { int8_decode_loop<a.value>(scales, q, n, block, out); });
}

}  // namespace
}  // namespace gradzip::detail
