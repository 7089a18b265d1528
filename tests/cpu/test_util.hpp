// Shared helpers of the CPU tests: random gradients, encode/decode wrappers over std::vector,
// and the float64 / independent references the properties are checked against.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradzip/gradzip.hpp"

namespace gztest {

using Bytes = std::vector<std::byte>;

// Gaussian values whose magnitude changes every 97 elements (so blocks have different scales),
// with a sprinkling of exact zeros.
inline std::vector<float> random_grad(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-6.0f, 2.0f);
  std::vector<float> v(n);
  float m = scale;
  for (size_t i = 0; i < n; ++i) {
    if (i % 97 == 0) m = scale * std::exp2(mag(rng));
    v[i] = (rng() % 53 == 0) ? 0.0f : normal(rng) * m;
  }
  return v;
}

// Values from a small set: many exact ties in magnitude (and opposite signs).
inline std::vector<float> tie_grad(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const float choices[] = {0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f, -0.0f};
  std::vector<float> v(n);
  for (auto& x : v) x = choices[rng() % 7];
  return v;
}

struct Encoded {
  Bytes wire;
  std::vector<float> residual;  // after the fused encode (empty for a plain encode)
};

inline Bytes encode(const gradzip::Codec& c, const std::vector<float>& in, float prescale = 1.0f) {
  Bytes wire(c.encoded_bytes(in.size()));
  std::vector<std::byte> ws(c.workspace_bytes(in.size()) + 4);
  c.encode(in.data(), in.size(), wire.data(), wire.size(), prescale, ws.data(), ws.size());
  return wire;
}

inline Encoded encode_ef(const gradzip::Codec& c, const std::vector<float>& grad,
                         std::vector<float> residual, float prescale = 1.0f) {
  Encoded e;
  e.wire.resize(c.encoded_bytes(grad.size()));
  std::vector<uint32_t> ws(c.workspace_bytes(grad.size()) / 4 + 1);
  c.encode_with_feedback(grad.data(), residual.data(), grad.size(), e.wire.data(), e.wire.size(),
                         prescale, ws.data(), ws.size() * 4);
  e.residual = std::move(residual);
  return e;
}

inline std::vector<float> decode(const Bytes& wire, size_t n) {
  std::vector<float> out(n, 12345.0f);
  gradzip::decode(wire.data(), wire.size(), out.data(), n);
  return out;
}

inline uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline bool same_bits(float a, float b) { return bits(a) == bits(b); }

// ---- independent references -------------------------------------------------------------------
// bf16 RNE by comparing the dropped half-word against one half (a different formulation from
// element.hpp's add-and-shift); NaN -> quiet NaN with the top payload bits kept.
inline uint16_t ref_bf16(float x) {
  const uint32_t u = bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  uint32_t t = u >> 16;
  const uint32_t rem = u & 0xFFFFu;
  if (rem > 0x8000u || (rem == 0x8000u && (t & 1u))) ++t;
  return static_cast<uint16_t>(t);
}

// fp16 RNE via the hardware (F16C): independent of element.hpp. NaN mapped to sign | 0x7E00, the
// rule element.hpp documents (F16C keeps payload bits).
__attribute__((target("f16c"))) inline uint16_t ref_fp16(float x) {
  if (std::isnan(x)) return static_cast<uint16_t>(((bits(x) >> 16) & 0x8000u) | 0x7E00u);
  return static_cast<uint16_t>(_cvtss_sh(x, 0));  // 0: round to nearest even
}
__attribute__((target("f16c"))) inline float ref_fp16_to_float(uint16_t h) { return _cvtsh_ss(h); }

inline bool cpu_has_f16c() { return __builtin_cpu_supports("f16c"); }

// Top-k's wire as docs/wire-format.md describes it (read here independently of the library):
// after the header, ceil(n / 65536) u32 chunk ends, padded to 16 bytes; k u16 offsets inside the
// chunk, padded to 16; k values.
struct TopkSections {
  size_t chunks, offsets, values;  // chunk count; byte offsets of the two later sections
};
inline TopkSections topk_sections(uint64_t n, uint64_t k) {
  const size_t chunks = (n + 65535) / 65536;
  const size_t offsets = (4 * chunks + 15) / 16 * 16;
  return {chunks, offsets, offsets + (2 * k + 15) / 16 * 16};
}
// The kept indices of a top-k message: chunk * 65536 + offset, position by position.
inline std::vector<uint32_t> topk_indices(const std::vector<std::byte>& wire) {
  gradzip::WireHeader h;
  std::memcpy(&h, wire.data(), sizeof h);
  const TopkSections s = topk_sections(h.count, h.param);
  const std::byte* payload = wire.data() + gradzip::kHeaderBytes;
  std::vector<uint32_t> idx(h.param);
  size_t chunk = 0;
  for (size_t j = 0; j < idx.size(); ++j) {
    uint32_t end;
    for (;; ++chunk) {
      std::memcpy(&end, payload + 4 * chunk, 4);
      if (end > j) break;
    }
    uint16_t offset;
    std::memcpy(&offset, payload + s.offsets + 2 * j, 2);
    idx[j] = static_cast<uint32_t>(chunk * 65536 + offset);
  }
  return idx;
}

}  // namespace gztest
