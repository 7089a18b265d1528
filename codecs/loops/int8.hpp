// Blockwise int8's steps of the block loop (loops/blockwise.hpp): the block's absmax (c into L1
// on the way), then one quantise + residual pass.
#pragma once

#include "blockwise.hpp"

namespace gradzip::detail {
namespace {

struct Int8Block {
  using Codec = Int8Codec;
  // Both come from the absmax bits: the scale goes on the wire, inv quantises.
  struct Scale {
    float value, inv;
  };

  // The integer max of |c| bits over the block; Keep: c also stored into c.
  template <bool EF, bool Keep>
  static uint32_t absmax(const float* __restrict g, const float* __restrict r, float p,
                         size_t len, float* __restrict c) {
    uint32_t m = 0;
    for (size_t i = 0; i < len; ++i) {
      const float ci = cin<EF>(g, r, p, i);
      if constexpr (Keep) c[i] = ci;
      const uint32_t k = el::abs_bits(ci);
      m = k > m ? k : m;
    }
    return m;
  }
  static Scale scale_of(uint32_t absmax_bits) {
    return {el::int8_scale(absmax_bits), el::int8_inv_scale(absmax_bits)};
  }
  template <bool EF>
  static Scale measure(const float* g, const float* r, float p, size_t len, float* c) {
    return scale_of(absmax<EF, true>(g, r, p, len, c));
  }
  template <bool EF>
  static Scale measure_streamed(const float* g, const float* r, float p, size_t len) {
    return scale_of(absmax<EF, false>(g, r, p, len, nullptr));
  }

  template <bool EF>
  static void emit(const float* __restrict c, float* __restrict r, size_t len, Scale s,
                   int8_t* __restrict q) {
    for (size_t i = 0; i < len; ++i) {
      const float level = el::int8_level(c[i], s.inv);
      q[i] = static_cast<int8_t>(level);
      if constexpr (EF) r[i] = el::ef_residual(c[i], el::int8_level_value(level, s.value), r[i]);
    }
  }

  template <bool ADD>
  static void decode(float scale, const int8_t* __restrict q, size_t len, float* __restrict out) {
    for (size_t i = 0; i < len; ++i) store<ADD>(out, i, el::int8_dequantize(q[i], scale));
  }
};

}  // namespace
}  // namespace gradzip::detail
