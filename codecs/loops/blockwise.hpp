// The block loop int8 and sign share on the CPU. Per block: a first pass measures the block's
// scale, the scale goes on the wire, then the codec's payload words (and the residual) are
// emitted. The codec's part is a type of static steps (Int8Block in loops/int8.hpp, SignBlock in
// loops/sign.hpp):
//   Codec                             Int8Codec or SignCodec (its Word and kElementsPerWord)
//   Scale                             what emit needs of the block's scale; .value goes on the wire
//   measure<EF>(g, r, p, len, c)      the scale of a block that fits the L1 buffer; leaves c there
//   measure_streamed<EF>(g, r, p, len)  the same for a larger block, c not kept
//   emit<EF>(c, r, len, scale, words) the words of len elements from c, and their residual
//   decode<ADD>(scale, words, len, out) one block's elements
#pragma once

#include "common.hpp"

namespace gradzip::detail {
namespace {

// ---- blocks held in L1 ----------------------------------------------------------------------
// Both codecs read each block twice (its scale first, then the payload): the first pass keeps c
// in an L1 buffer so the second neither reads grad and residual again nor recomputes c. A block
// larger than the buffer is emitted in buffer-sized pieces, c recomputed for each piece.
constexpr size_t kCacheFloats = 4096;  // 16 KB; a multiple of 32, so pieces start on a sign word

template <bool EF>
inline void fill_c(const float* __restrict g, const float* __restrict r, float p, size_t len,
                   float* __restrict c) {
  for (size_t i = 0; i < len; ++i) c[i] = cin<EF>(g, r, p, i);
}

// Calls emit(offset, length) for the block's pieces, c filled; `cached` says whether the first
// pass has left the whole block in c already.
template <bool EF, class Emit>
inline void for_each_piece(const float* g, const float* r, float p, size_t len, bool cached,
                           float* c, Emit&& emit) {
  for (size_t t = 0; t < len; t += kCacheFloats) {
    const size_t l = min_sz(kCacheFloats, len - t);
    if (!cached) fill_c<EF>(g + t, EF ? r + t : nullptr, p, l, c);
    emit(t, l);
  }
}

template <class Block, bool EF>
void blockwise_encode_loop(const float* __restrict g, float* __restrict r, float p, size_t n,
                           uint32_t block, float* __restrict scales,
                           typename Block::Codec::Word* __restrict words) {
  constexpr size_t kPerWord = Block::Codec::kElementsPerWord;
  alignas(64) float c[kCacheFloats];
  for (size_t s = 0, b = 0; s < n; s += block, ++b) {
    const size_t len = min_sz(block, n - s);
    const float* gb = g + s;
    float* rb = EF ? r + s : nullptr;
    const bool cached = len <= kCacheFloats;
    const typename Block::Scale scale = cached
                                            ? Block::template measure<EF>(gb, rb, p, len, c)
                                            : Block::template measure_streamed<EF>(gb, rb, p, len);
    scales[b] = scale.value;
    for_each_piece<EF>(gb, rb, p, len, cached, c, [&](size_t t, size_t l) {
      Block::template emit<EF>(c, EF ? rb + t : nullptr, l, scale, words + (s + t) / kPerWord);
    });
  }
}
template <class Block>
void encode_blockwise(EncodeArgs a, size_t n, uint32_t block, float* scales,
                      typename Block::Codec::Word* words) {
  with_ef(a, [&](auto ef) {
    blockwise_encode_loop<Block, ef.value>(a.grad, a.residual, a.prescale, n, block, scales, words);
  });
}

template <class Block, bool ADD>
void blockwise_decode_loop(const float* __restrict scales,
                           const typename Block::Codec::Word* __restrict words, size_t n,
                           uint32_t block, float* __restrict out) {
  constexpr size_t kPerWord = Block::Codec::kElementsPerWord;
  for (size_t s = 0, b = 0; s < n; s += block, ++b)
    Block::template decode<ADD>(scales[b], words + s / kPerWord, min_sz(block, n - s), out + s);
}
template <class Block>
void decode_blockwise(const float* scales, const typename Block::Codec::Word* words, size_t n,
                      uint32_t block, float* out, bool add) {
  with_add(add, [&](auto a) { blockwise_decode_loop<Block, a.value>(scales, words, n, block, out); });
}

}  // namespace
}  // namespace gradzip::detail
