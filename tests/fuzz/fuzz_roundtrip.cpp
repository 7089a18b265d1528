// Fuzz target: encode / encode_with_feedback -> decode on hostile floats, every codec.
//
// Input: byte 0 picks a spec from kSpecs; byte 1 holds flags (below); the rest are the values:
// raw little-endian floats (every bit pattern: NaN, Inf, denormals, -0.0, FLT_MAX), or, with
// kSpecialValues, one byte per value picking an edge case. Inputs stay below the size where the
// encoders use threads (2^16 elements): that independence is a GTest property
// (SameBytesForAnyThreadCount), here it would cost most of the executions.
//
// Properties, checked against float64 references written from the documentation (gradzip.hpp,
// wire.hpp, element.hpp), not from the implementation:
//   * encoding never fails, fills exactly encoded_bytes(n) with a wire that passes the
//     independent validator, and decodes;
//   * where the encoded value c is finite, the decoded value meets the codec's error bound:
//     fp32 exact; bf16/fp16 half an ulp (or +-Inf past the format's range); int8 absmax/254 of its
//     block; sign: the block's mean |c| with c's sign; top-k: exactly the k largest |c| (ties to
//     the lowest index) kept, everything else 0;
//   * a non-finite c stays visible: it decodes to a non-finite value (top-k: when selected, and
//     non-finite values are always selected first);
//   * error feedback: the wire equals encode(c), the new residual is c - decode where that is
//     finite and the old residual where it is not, so it stays finite;
//   * the bytes and the residual do not depend on the instruction set.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "fuzz_support.hpp"

using namespace gzfuzz;
using gradzip::Codec;
using gradzip::CodecKind;

namespace {

constexpr const char* kSpecs[] = {
    "fp32",         "fp16",        "bf16",           "int8",          "int8:block=32",
    "int8:block=96", "sign",       "sign:block=32",  "sign:block=64", "topk:0.01",
    "topk:0.1",     "topk:0.5",    "topk:1",         "topk:0.25:values=fp16",
    "topk:0.001:values=fp16",      "topk:0.3:values=fp32", "topk:0.2:values=int8",
    "topk:0.002:values=int8",
};
constexpr size_t kNumSpecs = sizeof kSpecs / sizeof kSpecs[0];

// Flags (byte 1).
constexpr uint8_t kFeedback = 1;       // encode_with_feedback instead of encode
constexpr uint8_t kSpecialValues = 2;  // one byte per value, from kSpecial
constexpr uint8_t kPrescaleMask = 12;  // bits 2-3 pick kPrescale
constexpr uint8_t kResidual = 16;      // feedback starts from a non-zero residual

constexpr float kPrescale[4] = {1.0f, 0.125f, 1.0f / 3.0f, 4.0f};

// Edge cases (a byte's low 5 bits pick one, bit 5 negates it).
const float kSpecial[32] = {
    0.0f, FLT_TRUE_MIN, 1e-40f, FLT_MIN, 1e-30f, 7.888609e-31f /* ~2^-100 */, 5.9604645e-08f,
    1.0f, 1.0f / 3.0f, 3.0f, 0.1f, 127.0f, 65504.0f, 65520.0f, 1e20f, 1e30f, 3.3895314e38f,
    3.3961776e38f /* bf16 overflow threshold */, FLT_MAX, INFINITY, NAN, 2.5f, 1e-20f, 0.5f,
    1.0f, 1.0f, 2.0f, 0.75f, 1e-3f, 1e-5f, 1e-38f, 100.0f};

float special(uint8_t b) {
  const float v = kSpecial[b & 31];
  return (b & 32) ? -v : v;
}

bool finite(float x) { return std::isfinite(x); }

// Half-ulp rounding bound of a float format with `mant` stored mantissa bits, smallest normal
// exponent `emin`, overflow threshold `overflow` (values at or above round to Inf).
void check_cast(float c, float d, int mant, int emin, double overflow) {
  if (!finite(c)) {
    GZ_FUZZ_CHECK(std::isnan(c) ? std::isnan(d) : same_bits(d, c));
    return;
  }
  if (std::fabs(static_cast<double>(c)) >= overflow) {
    GZ_FUZZ_CHECK(std::isinf(d) && std::signbit(d) == std::signbit(c));
    return;
  }
  GZ_FUZZ_CHECK(finite(d));
  GZ_FUZZ_CHECK(std::signbit(d) == std::signbit(c));  // round to nearest keeps the sign
  const double err = std::fabs(static_cast<double>(d) - static_cast<double>(c));
  const double bound = std::max(std::ldexp(std::fabs(static_cast<double>(c)), -(mant + 1)),
                                std::ldexp(1.0, emin - mant - 1));
  GZ_FUZZ_CHECK(err <= bound);
}
void check_fp16(float c, float d) { check_cast(c, d, 10, -14, 65520.0); }
void check_bf16(float c, float d) {
  check_cast(c, d, 7, -126, std::ldexp(1.0, 128) * (1.0 - std::ldexp(1.0, -9)));
}

void check_int8(const float* c, const float* d, size_t n, uint32_t block) {
  for (size_t b0 = 0; b0 < n; b0 += block) {
    const size_t b1 = std::min<size_t>(n, b0 + block);
    bool nonfinite = false;
    double absmax = 0;
    for (size_t i = b0; i < b1; ++i) {
      nonfinite |= !finite(c[i]);
      absmax = std::max(absmax, std::fabs(static_cast<double>(c[i])));
    }
    for (size_t i = b0; i < b1; ++i) {
      if (nonfinite) {  // documented: the whole block decodes to NaN
        GZ_FUZZ_CHECK(std::isnan(d[i]));
      } else if (absmax < std::ldexp(1.0, -100)) {  // documented: tiny blocks encode as zeros
        GZ_FUZZ_CHECK(d[i] == 0.0f);
      } else {
        const double err = std::fabs(static_cast<double>(d[i]) - c[i]);
        if (!(err <= absmax * (1.0 / 254.0 + std::ldexp(1.0, -20))))
          std::fprintf(stderr, "int8: element %zu c=%a decoded=%a block absmax=%a\n", i,
                       static_cast<double>(c[i]), static_cast<double>(d[i]), absmax);
        GZ_FUZZ_CHECK(err <= absmax * (1.0 / 254.0 + std::ldexp(1.0, -20)));
      }
    }
  }
}

void check_sign(const float* c, const float* d, size_t n, uint32_t block) {
  for (size_t b0 = 0; b0 < n; b0 += block) {
    const size_t b1 = std::min<size_t>(n, b0 + block);
    bool nonfinite = false;
    double sum = 0;
    for (size_t i = b0; i < b1; ++i) {
      nonfinite |= !finite(c[i]);
      sum += std::fabs(static_cast<double>(c[i]));
    }
    const size_t len = b1 - b0;
    for (size_t i = b0; i < b1; ++i) {
      if (nonfinite) {  // the mean |c| is Inf or NaN: every element of the block shows it
        GZ_FUZZ_CHECK(!finite(d[i]));
        continue;
      }
      if (!std::isnan(d[i])) GZ_FUZZ_CHECK(std::signbit(d[i]) == std::signbit(c[i]));
      GZ_FUZZ_CHECK(std::fabs(d[i]) == std::fabs(d[b0]));  // one magnitude per block
      // Float partial sums can overflow only when the exact sum is near FLT_MAX: known limit.
      if (sum >= 0.5 * FLT_MAX) continue;
      const double mean = sum / static_cast<double>(len);
      // Fixed 32-lane tree: each lane adds len/32 terms, then 5 tree levels, then the division.
      const double rel = (static_cast<double>(len) / 32 + 8) * std::ldexp(1.0, -24);
      GZ_FUZZ_CHECK(std::fabs(std::fabs(static_cast<double>(d[i])) - mean) <=
                    rel * mean + std::ldexp(1.0, -149));
    }
  }
}

void check_topk(const float* c, const float* d, size_t n, uint64_t k, gradzip::TopkValues values) {
  // Reference selection: largest |c| first (NaN above Inf, as abs-bits order), ties to the lower
  // index; the first k are kept. The encoder makes every NaN canonical (0x7FFFFFFF) first, so all
  // NaNs have one key and tie.
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  auto key = [&](uint32_t i) { return std::isnan(c[i]) ? 0x7FFFFFFFu : bits(c[i]) & 0x7FFFFFFFu; };
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return key(a) > key(b); });
  std::vector<bool> kept(n, false);
  for (uint64_t j = 0; j < k; ++j) kept[order[j]] = true;
  if (values == gradzip::TopkValues::int8) {
    // int8 with one scale per 65536-element chunk from the kept values' absmax: as int8's blocks
    // (non-finite: the chunk's kept values decode to NaN; tiny: to zero), the others stay zero.
    for (size_t b0 = 0; b0 < n; b0 += 65536) {
      const size_t b1 = std::min<size_t>(n, b0 + 65536);
      bool nonfinite = false;
      double absmax = 0;
      for (size_t i = b0; i < b1; ++i)
        if (kept[i]) {
          nonfinite |= !finite(c[i]);
          absmax = std::max(absmax, std::fabs(static_cast<double>(c[i])));
        }
      for (size_t i = b0; i < b1; ++i) {
        if (!kept[i]) GZ_FUZZ_CHECK(d[i] == 0.0f);
        else if (nonfinite) GZ_FUZZ_CHECK(std::isnan(d[i]));
        else if (absmax < std::ldexp(1.0, -100)) GZ_FUZZ_CHECK(d[i] == 0.0f);
        else
          GZ_FUZZ_CHECK(std::fabs(static_cast<double>(d[i]) - c[i]) <=
                        absmax * (1.0 / 254.0 + std::ldexp(1.0, -20)));
      }
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    if (!kept[i]) {
      GZ_FUZZ_CHECK(d[i] == 0.0f);
    } else if (values == gradzip::TopkValues::fp16) {
      check_fp16(c[i], d[i]);
    } else {
      GZ_FUZZ_CHECK(std::isnan(c[i]) ? std::isnan(d[i]) : same_bits(d[i], c[i]));
    }
  }
}

struct Encoded {
  std::unique_ptr<uint8_t[]> wire;
  size_t bytes = 0;
};

// Encodes with the API exactly as a caller must: buffers of the queried sizes, no more.
Encoded encode(const Codec& codec, const float* in, float* residual, size_t n, float prescale) {
  Encoded e{exact<uint8_t>(codec.encoded_bytes(n)), codec.encoded_bytes(n)};
  const size_t ws_bytes = codec.workspace_bytes(n);
  auto ws = exact<uint8_t>(ws_bytes);
  const Outcome r = call([&] {
    if (residual)
      codec.encode_with_feedback(in, residual, n, e.wire.get(), e.bytes, prescale, ws.get(), ws_bytes);
    else
      codec.encode(in, n, e.wire.get(), e.bytes, prescale, ws.get(), ws_bytes);
  });
  GZ_FUZZ_CHECK(r.ok);
  return e;
}

bool same_wire(const Encoded& a, const Encoded& b) {
  return a.bytes == b.bytes && std::memcmp(a.wire.get(), b.wire.get(), a.bytes) == 0;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gradzip::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const Codec codec = Codec::parse(kSpecs[data[0] % kNumSpecs]);
  const uint8_t flags = data[1];
  data += 2;
  size -= 2;
  const bool special_values = flags & kSpecialValues;
  const size_t n = special_values ? size : size / 4;
  auto grad = exact<float>(n);
  for (size_t i = 0; i < n; ++i)
    grad[i] = special_values ? special(data[i]) : load<float>(data + 4 * i);
  const float prescale = kPrescale[(flags & kPrescaleMask) >> 2];
  const bool feedback = flags & kFeedback;

  // The values the codec encodes, computed as documented, and the residual before encoding.
  std::vector<float> c(n), old_residual(n, 0.0f);
  for (size_t i = 0; i < n; ++i) {
    if (feedback && (flags & kResidual)) {
      const float r = grad[n - 1 - i] * 0.5f;
      old_residual[i] = finite(r) ? r : 0.0f;
    }
    c[i] = feedback ? gradzip::element::ef_input(grad[i], prescale, old_residual[i])
                    : grad[i] * prescale;
  }
  auto residual = exact<float>(n);
  std::copy(old_residual.begin(), old_residual.end(), residual.get());

  const Encoded e = encode(codec, grad.get(), feedback ? residual.get() : nullptr, n, prescale);
  const auto h = reference_validate(e.wire.get(), e.bytes);
  GZ_FUZZ_CHECK(h.has_value());
  GZ_FUZZ_CHECK(h->count == n && h->codec == static_cast<uint8_t>(codec.kind()));
  GZ_FUZZ_CHECK(h->param == codec.wire_param(n));

  auto d = exact<float>(n);
  GZ_FUZZ_CHECK(call([&] { gradzip::decode(e.wire.get(), e.bytes, d.get(), n); }).ok);

  const gradzip::CodecSpec& s = codec.spec();
  switch (s.kind) {
    case CodecKind::fp32:
      for (size_t i = 0; i < n; ++i)
        GZ_FUZZ_CHECK(std::isnan(c[i]) ? std::isnan(d[i]) : same_bits(d[i], c[i]));
      break;
    case CodecKind::fp16: for (size_t i = 0; i < n; ++i) check_fp16(c[i], d[i]); break;
    case CodecKind::bf16: for (size_t i = 0; i < n; ++i) check_bf16(c[i], d[i]); break;
    case CodecKind::int8: check_int8(c.data(), d.get(), n, s.block); break;
    case CodecKind::sign: check_sign(c.data(), d.get(), n, s.block); break;
    case CodecKind::topk: check_topk(c.data(), d.get(), n, codec.topk_k(n), s.values); break;
  }

  if (feedback) {
    // Fused path == plain encode of c; residual = c - decode where finite, else unchanged.
    GZ_FUZZ_CHECK(same_wire(e, encode(codec, c.data(), nullptr, n, 1.0f)));
    for (size_t i = 0; i < n; ++i) {
      GZ_FUZZ_CHECK(same_bits(residual[i], gradzip::element::ef_residual(c[i], d[i], old_residual[i])));
      GZ_FUZZ_CHECK(finite(residual[i]));
    }
  }

  // Other CPU loop tables: the same bytes and residual.
  for_each_other_isa([&] {
    std::vector<float> residual2(old_residual);
    const Encoded e2 = encode(codec, grad.get(), feedback ? residual2.data() : nullptr, n, prescale);
    GZ_FUZZ_CHECK(same_wire(e, e2));
    if (feedback)
      for (size_t i = 0; i < n; ++i) GZ_FUZZ_CHECK(same_bits(residual2[i], residual[i]));
  });
  return 0;
}
