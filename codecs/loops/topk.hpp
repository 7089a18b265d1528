// Top-k CPU passes (the selection that drives them is topk.cpp): first-digit histogram,
// candidate collection, emit, and the sampled path's gather and residual passes.
#pragma once

#include "common.hpp"

namespace gradzip::detail {
namespace {

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
                      void* values, TopkValues v) {
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
      const float decoded = el::topk_put_value(values, kept, c[i], v);
      if constexpr (EF) r[s + i] = el::ef_residual(c[i], decoded, old[i]);
      ++kept;
    });
  }
  return kept;
}
size_t topk_emit(EncodeArgs a, size_t n, uint32_t base, uint32_t threshold, uint64_t ties,
                 uint32_t* idx, void* values, TopkValues v) {
  size_t kept = 0;
  with_ef(a, [&](auto ef) {
    kept = topk_emit_loop<ef.value>(a.grad, a.residual, a.prescale, n, base, threshold, ties, idx,
                                    values, v);
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
                   size_t kept_count, TopkValues v, const uint32_t* int8_amax) {
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
      const float decoded = el::topk_value_decoded(
          c, v, v == TopkValues::int8 ? int8_amax[kept[j] / kTopkIndexChunk] : 0u);
      r[s + i] = el::ef_residual(c, decoded, old[i]);
    }
  }
}

}  // namespace
}  // namespace gradzip::detail
