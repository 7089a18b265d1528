// The CPU loops, written once and compiled once per instruction set: isa_<name>.cpp defines
// GZ_ISA_NS and includes this file, and CMake builds it with that ISA's -m flags. The loops are
// plain calls of the element.hpp functions, shaped (fixed-width inner loops, no early exits,
// separate max/sum and emit passes per block) so that GCC vectorises them; the element math is
// never re-implemented here. Everything below has internal linkage except the table accessor,
// so no out-of-line copy compiled for one ISA can be picked by the linker for another.
#ifndef GZ_ISA_NS
#error "define GZ_ISA_NS before including cpu_loops.hpp"
#endif

#include <type_traits>

#include "detail.hpp"

#define GZ_CAT2(a, b) a##b
#define GZ_CAT(a, b) GZ_CAT2(a, b)

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

// ---- casts (P: element.hpp's Fp32Cast / Fp16Cast / Bf16Cast) ---------------------------------
template <class P, bool EF>
void cast_encode_loop(const float* __restrict g, float* __restrict r, float p, size_t n,
                      typename P::Wire* __restrict out) {
  for (size_t i = 0; i < n; ++i) {
    const float c = cin<EF>(g, r, p, i);
    const typename P::Wire w = P::encode(c);
    out[i] = w;
    if constexpr (EF) r[i] = el::ef_residual(c, P::decode(w), r[i]);
  }
}
template <class P>
void encode_cast(EncodeArgs a, size_t n, typename P::Wire* out) {
  with_ef(a, [&](auto ef) { cast_encode_loop<P, ef.value>(a.grad, a.residual, a.prescale, n, out); });
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

// ---- int8: per block, max pass (c into L1), then one quantise + residual pass -----------------
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

// ---- sign: per block, the fixed 32-lane mean |x| tree (c into L1), then bits, then residual ----
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

// ---- decoders ---------------------------------------------------------------------------------
template <bool ADD>
inline void store(float* __restrict out, size_t i, float v) {
  if constexpr (ADD) out[i] = out[i] + v;
  else out[i] = v;
}

template <class P, bool ADD>
void cast_decode_loop(const typename P::Wire* __restrict in, size_t n, float* __restrict out) {
  for (size_t i = 0; i < n; ++i) store<ADD>(out, i, P::decode(in[i]));
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

#define GZ_ADD_DISPATCH(fn, ...) \
  do {                           \
    if (add) fn<true>(__VA_ARGS__); \
    else fn<false>(__VA_ARGS__);    \
  } while (0)

template <class P>
void decode_cast(const typename P::Wire* in, size_t n, float* out, bool add) {
  if (add) cast_decode_loop<P, true>(in, n, out);
  else cast_decode_loop<P, false>(in, n, out);
}
void decode_int8(const float* scales, const int8_t* q, size_t n, uint32_t block, float* out,
                 bool add) {
  GZ_ADD_DISPATCH(int8_decode_loop, scales, q, n, block, out);
}
void decode_sign(const float* scales, const uint32_t* words, size_t n, uint32_t block, float* out,
                 bool add) {
  GZ_ADD_DISPATCH(sign_decode_loop, scales, words, n, block, out);
}
#undef GZ_ADD_DISPATCH

// ---- top-k ------------------------------------------------------------------------------------
constexpr int kShift0 = el::kTopkDigitShift[0];
constexpr size_t kSub = 256;  // sub-block: vectorised pass into an L1 buffer, then a scalar pass

template <bool EF>
void topk_hist0_loop(const float* __restrict g, const float* __restrict r, float p, size_t n,
                     uint32_t* __restrict hist) {
  // Four sub-histograms: runs of equal digits (common: gradients share exponents) would
  // otherwise serialise on one counter.
  alignas(64) uint32_t sub[4][el::kTopkRadix] = {};
  alignas(64) uint32_t d[kSub];
  for (size_t s = 0; s < n; s += kSub) {
    const size_t m = min_sz(kSub, n - s);
    for (size_t i = 0; i < m; ++i) d[i] = el::topk_key(cin<EF>(g, r, p, s + i)) >> kShift0;
    size_t i = 0;
    for (; i + 4 <= m; i += 4) {
      ++sub[0][d[i]];
      ++sub[1][d[i + 1]];
      ++sub[2][d[i + 2]];
      ++sub[3][d[i + 3]];
    }
    for (; i < m; ++i) ++sub[0][d[i]];
  }
  for (int k = 0; k < el::kTopkRadix; ++k) hist[k] += sub[0][k] + sub[1][k] + sub[2][k] + sub[3][k];
}
void topk_hist0(EncodeArgs a, size_t n, uint32_t* hist) {
  with_ef(a, [&](auto ef) { topk_hist0_loop<ef.value>(a.grad, a.residual, a.prescale, n, hist); });
}

// Flag scans: a sub-block's flags (0/1 bytes) are read 8 at a time; kept elements are rare.

template <class F>
inline void for_each_flag(const uint8_t* flags, size_t m, F&& f) {
  size_t i = 0;
  for (; i + 8 <= m; i += 8) {
    uint64_t w;
    __builtin_memcpy(&w, flags + i, 8);
    while (w) {
      const int bit = __builtin_ctzll(w);
      f(i + static_cast<size_t>(bit >> 3));
      w &= w - 1;
    }
  }
  for (; i < m; ++i)
    if (flags[i]) f(i);
}

template <bool EF>
size_t topk_collect_loop(const float* __restrict g, const float* __restrict r, float p, size_t n,
                         uint32_t base, uint32_t d0, uint32_t* __restrict cand, uint64_t* above) {
  size_t count = 0;
  uint32_t up = 0;
  alignas(64) uint8_t eq[kSub];
  for (size_t s = 0; s < n; s += kSub) {
    const size_t m = min_sz(kSub, n - s);
    uint32_t up_sub = 0, any = 0;
    for (size_t i = 0; i < m; ++i) {  // vectorised: digits, flags, count above
      const uint32_t d = el::topk_key(cin<EF>(g, r, p, s + i)) >> kShift0;
      eq[i] = d == d0;
      any |= d == d0;
      up_sub += d > d0;
    }
    up += up_sub;
    if (any)
      for_each_flag(eq, m, [&](size_t i) { cand[count++] = base + static_cast<uint32_t>(s + i); });
  }
  *above = up;
  return count;
}
size_t topk_collect(EncodeArgs a, size_t n, uint32_t base, uint32_t d0, uint32_t* cand,
                    uint64_t* above) {
  size_t count = 0;
  with_ef(a, [&](auto ef) {
    count = topk_collect_loop<ef.value>(a.grad, a.residual, a.prescale, n, base, d0, cand, above);
  });
  return count;
}

template <bool EF>
size_t topk_emit_loop(const float* __restrict g, float* __restrict r, float p, size_t n,
                      uint32_t base, uint32_t threshold, uint64_t ties, uint32_t* __restrict idx,
                      void* values, bool fp16_values) {
  size_t kept = 0;
  alignas(64) float c[kSub], old[kSub];
  alignas(64) uint8_t hit[kSub];
  for (size_t s = 0; s < n; s += kSub) {
    const size_t m = min_sz(kSub, n - s);
    // Vectorised: every element as if not kept. (No "any hit" reduction here: next to the
    // residual stores it keeps GCC from vectorising the loop; the flag scan below is cheap.)
    for (size_t i = 0; i < m; ++i) {
      const float ci = cin<EF>(g, r, p, s + i);
      c[i] = ci;
      hit[i] = el::topk_key(ci) >= threshold;
      if constexpr (EF) {
        const float o = r[s + i];
        old[i] = o;
        r[s + i] = el::ef_residual(ci, 0.0f, o);
      }
    }
    for_each_flag(hit, m, [&](size_t i) {  // rare: keys at or above the threshold
      const uint32_t key = el::topk_key(c[i]);
      if (key == threshold) {
        if (ties == 0) return;
        --ties;
      }
      idx[kept] = base + static_cast<uint32_t>(s + i);
      const float decoded = el::topk_put_value(values, kept, c[i], fp16_values);
      if constexpr (EF) r[s + i] = el::ef_residual(c[i], decoded, old[i]);
      ++kept;
    });
  }
  return kept;
}
size_t topk_emit(EncodeArgs a, size_t n, uint32_t base, uint32_t threshold, uint64_t ties,
                 uint32_t* idx, void* values, bool fp16_values) {
  size_t kept = 0;
  with_ef(a, [&](auto ef) {
    kept = topk_emit_loop<ef.value>(a.grad, a.residual, a.prescale, n, base, threshold, ties, idx,
                                    values, fp16_values);
  });
  return kept;
}

// Sampled top-k, pass 1 (read only): every element whose key is at least lo, as its index
// (base + i) and the bits of its c, in index order. Stores the first `cap`; returns how many there
// are (more than cap: the caller falls back to the full radix select).
template <bool EF>
size_t topk_gather_loop(const float* __restrict g, const float* __restrict r, float p, size_t n,
                        uint32_t base, uint32_t lo, size_t cap, uint32_t* __restrict idx,
                        uint32_t* __restrict bits) {
  size_t count = 0;
  alignas(64) float c[kSub];
  alignas(64) uint8_t hit[kSub];
  for (size_t s = 0; s < n; s += kSub) {
    const size_t m = min_sz(kSub, n - s);
    uint32_t any = 0;
    for (size_t i = 0; i < m; ++i) {  // vectorised: c and the flags
      const float ci = cin<EF>(g, r, p, s + i);
      c[i] = ci;
      hit[i] = el::topk_key(ci) >= lo;
      any |= el::topk_key(ci) >= lo;
    }
    if (any)
      for_each_flag(hit, m, [&](size_t i) {
        if (count < cap) {
          idx[count] = base + static_cast<uint32_t>(s + i);
          bits[count] = el::float_bits(c[i]);
        }
        ++count;
      });
  }
  return count;
}
size_t topk_gather(EncodeArgs a, size_t n, uint32_t base, uint32_t lo, size_t cap, uint32_t* idx,
                   uint32_t* bits) {
  size_t count = 0;
  with_ef(a, [&](auto ef) {
    count = topk_gather_loop<ef.value>(a.grad, a.residual, a.prescale, n, base, lo, cap, idx, bits);
  });
  return count;
}

// Sampled top-k, residual pass: every element as if not kept (one vectorised streaming pass),
// then the kept ones (sorted global indices) patched while their sub-block is in L1.
void topk_residual(EncodeArgs a, size_t n, uint32_t base, const uint32_t* __restrict kept,
                   size_t kept_count, bool fp16_values) {
  const float* __restrict g = a.grad;
  float* __restrict r = a.residual;
  const float p = a.prescale;
  alignas(64) float old[kSub];
  size_t j = 0;
  for (size_t s = 0; s < n; s += kSub) {
    const size_t m = min_sz(kSub, n - s);
    for (size_t i = 0; i < m; ++i) {
      const float o = r[s + i];
      old[i] = o;
      r[s + i] = el::ef_residual(el::ef_input(g[s + i], p, o), 0.0f, o);
    }
    for (; j < kept_count && kept[j] - base < s + m; ++j) {
      const size_t i = kept[j] - base - s;
      const float c = el::ef_input(g[s + i], p, old[i]);
      const float decoded = el::topk_value_decoded(c, fp16_values);
      r[s + i] = el::ef_residual(c, decoded, old[i]);
    }
  }
}

constexpr CpuLoops kTable{
    GZ_ISA_NAME,
    encode_cast<el::Fp32Cast>,
    encode_cast<el::Fp16Cast>,
    encode_cast<el::Bf16Cast>,
    encode_int8,
    encode_sign,
    decode_cast<el::Fp32Cast>,
    decode_cast<el::Fp16Cast>,
    decode_cast<el::Bf16Cast>,
    decode_int8,
    decode_sign,
    topk_hist0,
    topk_collect,
    topk_emit,
    topk_gather,
    topk_residual,
};

}  // namespace

const CpuLoops& GZ_CAT(cpu_loops_, GZ_ISA_NS)() { return kTable; }

}  // namespace gradzip::detail
