// 1-bit sign CPU loops: per block, the fixed 32-lane mean |x| tree (c into L1), then the bits,
// then the residual.
#pragma once
#ifndef GZ_ISA_NS
#error "included by isa_loops.hpp only: compiled once per instruction set"
#endif

#include "common.hpp"

namespace gradzip::detail {
namespace {
namespace el = gradzip::element;

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

template <bool EF>
inline void sign_emit(const float* __restrict c, float* __restrict r, size_t len, float scale,
                      uint32_t* __restrict words) {
  size_t i = 0;
  for (; i + 32 <= len; i += 32) words[i / 32] = sign_word(c + i);
  if (i < len) words[i / 32] = sign_tail_word(c + i, len - i);
  // The residual in its own loop: fused with the bit packing, GCC leaves it scalar.
  if constexpr (EF)
    for (i = 0; i < len; ++i)
      r[i] = el::ef_residual(c[i], el::sign_decode(el::sign_bit(c[i]), scale), r[i]);
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

template <bool EF>
void sign_encode_loop(const float* __restrict g, float* __restrict r, float p, size_t n,
                      uint32_t block, float* __restrict scales, uint32_t* __restrict words) {
  alignas(64) float c[kCacheFloats];
  for (size_t s = 0, b = 0; s < n; s += block, ++b) {
    const size_t len = min_sz(block, n - s);
    const float* gb = g + s;
    float* rb = EF ? r + s : nullptr;
    const bool cached = len <= kCacheFloats;
    float scale;
    if (cached) {
      fill_c<EF>(gb, rb, p, len, c);
      scale = sign_block_mean(c, len);
    } else {  // the lanes' partial sums carried over the block's pieces
      alignas(64) float lanes[el::kSignLanes];
      for (int j = 0; j < el::kSignLanes; ++j) lanes[j] = 0.0f;
      size_t i = 0;
      for (; i + el::kSignLanes <= len; i += el::kSignLanes)
        for (int j = 0; j < el::kSignLanes; ++j)
          lanes[j] = lanes[j] + abs_f(cin<EF>(gb, rb, p, i + j));
      for (size_t j = 0; i + j < len; ++j) lanes[j] = lanes[j] + abs_f(cin<EF>(gb, rb, p, i + j));
      scale = el::sign_lane_tree(lanes) / static_cast<float>(len);
    }
    scales[b] = scale;
    // Pieces are multiples of 32 elements, so each starts on a word.
    for_each_piece<EF>(gb, rb, p, len, cached, c, [&](size_t t, size_t l) {
      sign_emit<EF>(c, EF ? rb + t : nullptr, l, scale, words + (s + t) / 32);
    });
  }
}
void encode_sign(EncodeArgs a, size_t n, uint32_t block, float* scales, uint32_t* words) {
  with_ef(a, [&](auto ef) {
    sign_encode_loop<ef.value>(a.grad, a.residual, a.prescale, n, block, scales, words);
  });
}

template <bool ADD>
void sign_decode_loop(const float* __restrict scales, const uint32_t* __restrict words, size_t n,
                      uint32_t block, float* __restrict out) {
  for (size_t s = 0, b = 0; s < n; s += block, ++b) {
    const size_t len = min_sz(block, n - s);
    const float scale = scales[b];
    for (size_t i = 0; i < len; i += 32) {
      const uint32_t w = words[(s + i) / 32];
      float* o = out + s + i;
      if (i + 32 <= len) {
        for (uint32_t j = 0; j < 32; ++j) store<ADD>(o, j, el::sign_decode((w >> j) & 1u, scale));
      } else {
        for (size_t j = 0; i + j < len; ++j)
          store<ADD>(o, j, el::sign_decode((w >> j) & 1u, scale));
      }
    }
  }
}
void decode_sign(const float* scales, const uint32_t* words, size_t n, uint32_t block, float* out,
                 bool add) {
  with_add(add, [&](auto a) { sign_decode_loop<a.value>(scales, words, n, block, out); });
}

}  // namespace
}  // namespace gradzip::detail
