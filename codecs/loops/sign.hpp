// 1-bit sign's steps of the block loop (loops/blockwise.hpp): the fixed 32-lane mean |x| tree
// (c into L1 on the way), then the bits, then the residual.
#pragma once

#include "blockwise.hpp"

namespace gradzip::detail {
namespace {

// Bits of one full word from c[0..32) (tail words: sign_tail_word, bits past n stay 0).
inline uint32_t sign_word(const float* __restrict c) {
  uint32_t w = 0;
  for (uint32_t j = 0; j < 32; ++j) w |= el::sign_bit(c[j]) << j;
  return w;
}
inline uint32_t sign_tail_word(const float* __restrict c, size_t m) {
  uint32_t w = 0;
  for (size_t j = 0; j < m; ++j) w |= el::sign_bit(c[j]) << j;
  return w;
}

// The block's mean |c| by element.hpp's fixed tree. Lane j starts at element j (0 + |x| is |x|
// bit for bit), so a full block needs no zeroing, which GCC turns into rep stos; the loop keeps the
// 32 lanes in 4 vector registers.
inline float sign_block_mean(const float* __restrict c, size_t len) {
  alignas(64) float lanes[el::kSignLanes];
  size_t i = 0;
  if (len >= el::kSignLanes) {
    for (int j = 0; j < el::kSignLanes; ++j) lanes[j] = abs_f(c[j]);
    for (i = el::kSignLanes; i + el::kSignLanes <= len; i += el::kSignLanes)
      for (int j = 0; j < el::kSignLanes; ++j) lanes[j] = lanes[j] + abs_f(c[i + j]);
  } else {
    for (int j = 0; j < el::kSignLanes; ++j) lanes[j] = 0.0f;
  }
  for (size_t j = 0; i + j < len; ++j) lanes[j] = lanes[j] + abs_f(c[i + j]);
  return el::sign_lane_tree(lanes) / static_cast<float>(len);
}

struct SignBlock {
  using Codec = SignCodec;
  struct Scale {
    float value;  // the block's mean |c|
  };

  template <bool EF>
  static Scale measure(const float* g, const float* r, float p, size_t len, float* c) {
    fill_c<EF>(g, r, p, len, c);
    return {sign_block_mean(c, len)};
  }
  // The same tree, the lanes' partial sums carried over the block's pieces.
  template <bool EF>
  static Scale measure_streamed(const float* __restrict g, const float* __restrict r, float p,
                                size_t len) {
    alignas(64) float lanes[el::kSignLanes];
    for (int j = 0; j < el::kSignLanes; ++j) lanes[j] = 0.0f;
    size_t i = 0;
    for (; i + el::kSignLanes <= len; i += el::kSignLanes)
      for (int j = 0; j < el::kSignLanes; ++j) lanes[j] = lanes[j] + abs_f(cin<EF>(g, r, p, i + j));
    for (size_t j = 0; i + j < len; ++j) lanes[j] = lanes[j] + abs_f(cin<EF>(g, r, p, i + j));
    return {el::sign_lane_tree(lanes) / static_cast<float>(len)};
  }

  template <bool EF>
  static void emit(const float* __restrict c, float* __restrict r, size_t len, Scale s,
                   uint32_t* __restrict words) {
    size_t i = 0;
    for (; i + 32 <= len; i += 32) words[i / 32] = sign_word(c + i);
    if (i < len) words[i / 32] = sign_tail_word(c + i, len - i);
    // The residual in its own loop: fused with the bit packing, GCC leaves it scalar.
    if constexpr (EF)
      for (i = 0; i < len; ++i)
        r[i] = el::ef_residual(c[i], el::sign_decode(el::sign_bit(c[i]), s.value), r[i]);
  }

  template <bool ADD>
  static void decode(float scale, const uint32_t* __restrict words, size_t len,
                     float* __restrict out) {
    for (size_t i = 0; i < len; i += 32) {
      const uint32_t w = words[i / 32];
      float* o = out + i;
      if (i + 32 <= len) {
        for (uint32_t j = 0; j < 32; ++j) store<ADD>(o, j, el::sign_decode((w >> j) & 1u, scale));
      } else {
        for (size_t j = 0; i + j < len; ++j)
          store<ADD>(o, j, el::sign_decode((w >> j) & 1u, scale));
      }
    }
  }
};

}  // namespace
}  // namespace gradzip::detail
