// Every codec through the same properties on random data of odd sizes: error bounds against a
// float64 reference, the error-feedback identity, determinism across thread counts and ISAs,
// decode_add, and non-finite handling.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <tuple>

#include "detail.hpp"  // force_isa
#include "topk.hpp"    // topk_radix_runs
#include "test_util.hpp"

using gradzip::Codec;
using gradzip::CodecKind;
using namespace gztest;

namespace {

// int8:block=8192 and sign:block=65536 are larger than the encoders' L1 block buffer (4096).
const char* const kSpecs[] = {"fp32",      "fp16",          "bf16",           "int8",
                              "int8:block=64", "int8:block=8192", "sign",       "sign:block=32",
                              "sign:block=65536", "topk:0.01",  "topk:0.3",     "topk:0.01:values=fp16",
                              "topk:0.02:values=int8", "topk:0.3:values=int8"};

// Sizes 0, 1, 7, block - 1, block + 1, 1000003 (block: the codec's, 256 for the others).
std::vector<size_t> sizes_for(const Codec& c) {
  const size_t block = c.spec().block ? c.spec().block : 256;
  return {0, 1, 7, block - 1, block + 1, 1000003};
}

// c = grad * prescale (+ residual), as the codec sees it.
std::vector<float> codec_input(const std::vector<float>& g, const std::vector<float>* r, float p) {
  std::vector<float> c(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    const float s = g[i] * p;
    c[i] = r ? s + (*r)[i] : s;
  }
  return c;
}

// Checks decoded against the codec's definition applied to c, with float64 references.
void check_against_reference(const Codec& codec, const std::vector<float>& c,
                             const std::vector<float>& dec) {
  const size_t n = c.size();
  ASSERT_EQ(dec.size(), n);
  switch (codec.kind()) {
    case CodecKind::fp32:
      for (size_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(dec[i], c[i])) << i;
      break;
    case CodecKind::fp16:
      if (!cpu_has_f16c()) GTEST_SKIP() << "no F16C for the reference";
      for (size_t i = 0; i < n; ++i)
        ASSERT_TRUE(same_bits(dec[i], ref_fp16_to_float(ref_fp16(c[i])))) << i << " " << c[i];
      break;
    case CodecKind::bf16:
      for (size_t i = 0; i < n; ++i) {
        const float want = gradzip::element::bits_float(uint32_t{ref_bf16(c[i])} << 16);
        ASSERT_TRUE(same_bits(dec[i], want)) << i << " " << c[i];
      }
      break;
    case CodecKind::int8: {
      const size_t block = codec.spec().block;
      for (size_t s = 0; s < n; s += block) {
        const size_t e = std::min(n, s + block);
        double absmax = 0;
        for (size_t i = s; i < e; ++i) absmax = std::max(absmax, std::fabs(double(c[i])));
        const double step = absmax / 127.0;
        // half a quantisation step, plus slack for the fp32 scale and its reciprocal
        const double tol = 0.5 * step + 4e-7 * absmax;
        for (size_t i = s; i < e; ++i) {
          if (absmax < std::ldexp(1.0, -100)) {
            ASSERT_EQ(dec[i], 0.0f) << i;
            continue;
          }
          ASSERT_LE(std::fabs(double(dec[i]) - c[i]), tol) << "element " << i << " block " << s / block;
        }
      }
      break;
    }
    case CodecKind::sign: {
      const size_t block = codec.spec().block;
      for (size_t s = 0; s < n; s += block) {
        const size_t e = std::min(n, s + block);
        double sum = 0;
        for (size_t i = s; i < e; ++i) sum += std::fabs(double(c[i]));
        const double mean = sum / double(e - s);
        const float scale = std::fabs(dec[s]);
        ASSERT_NEAR(scale, mean, 1e-5 * mean + 1e-30) << "block " << s / block;
        for (size_t i = s; i < e; ++i) {
          const float want = std::signbit(c[i]) ? -scale : scale;
          ASSERT_TRUE(same_bits(dec[i], want)) << i;
        }
      }
      break;
    }
    case CodecKind::topk: {
      const size_t k = codec.topk_k(n);
      std::vector<uint32_t> order(n);
      std::iota(order.begin(), order.end(), 0u);
      // reference: largest |c| first (NaN above Inf via the key), lowest index on ties
      std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
        return gradzip::element::topk_key(c[a]) > gradzip::element::topk_key(c[b]);
      });
      std::vector<char> keep(n, 0);
      for (size_t j = 0; j < k; ++j) keep[order[j]] = 1;
      if (codec.spec().values == gradzip::TopkValues::int8) {
        // int8 with one absmax scale per 65536-element chunk, over the values kept in it
        const size_t chunk = 65536;
        for (size_t s = 0; s < n; s += chunk) {
          const size_t e = std::min(n, s + chunk);
          double absmax = 0;
          for (size_t i = s; i < e; ++i)
            if (keep[i]) absmax = std::max(absmax, std::fabs(double(c[i])));
          const double tol = 0.5 * absmax / 127.0 + 4e-7 * absmax;
          for (size_t i = s; i < e; ++i) {
            if (!keep[i] || absmax < std::ldexp(1.0, -100)) {
              ASSERT_EQ(dec[i], 0.0f) << i;
              continue;
            }
            ASSERT_LE(std::fabs(double(dec[i]) - c[i]), tol) << "element " << i;
          }
        }
        break;
      }
      for (size_t i = 0; i < n; ++i) {
        float want = 0.0f;
        if (keep[i]) {
          want = c[i];
          if (codec.spec().values == gradzip::TopkValues::fp16) {
            if (!cpu_has_f16c()) GTEST_SKIP();
            want = ref_fp16_to_float(ref_fp16(c[i]));
          }
        }
        // a kept value may itself be +0.0 or -0.0; compare by value there
        if (want == 0.0f) ASSERT_EQ(dec[i], 0.0f) << i;
        else ASSERT_TRUE(same_bits(dec[i], want)) << i << " kept=" << int(keep[i]);
      }
      break;
    }
  }
}

class CodecProps : public ::testing::TestWithParam<const char*> {
 protected:
  Codec codec = Codec::parse(GetParam());
  void TearDown() override { gradzip::set_num_threads(0); }
};

TEST_P(CodecProps, EncodeMatchesReference) {
  for (size_t n : sizes_for(codec)) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const auto g = random_grad(n, 1 + n);
    const float p = 0.25f;
    const auto wire = encode(codec, g, p);
    ASSERT_EQ(wire.size(), codec.encoded_bytes(n));
    EXPECT_NO_THROW(gradzip::read_header(wire.data(), wire.size()));
    check_against_reference(codec, codec_input(g, nullptr, p), decode(wire, n));
  }
}

TEST_P(CodecProps, FeedbackMatchesReferenceAndIdentity) {
  for (size_t n : sizes_for(codec)) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const auto g = random_grad(n, 7 + n);
    const auto r0 = random_grad(n, 99 + n, 0.01f);
    const float p = 0.5f;
    const auto c = codec_input(g, &r0, p);
    const Encoded e = encode_ef(codec, g, r0, p);
    const auto dec = decode(e.wire, n);
    check_against_reference(codec, c, dec);
    // decode(payload) + residual_new == grad * p + residual_old, to fp32 rounding
    for (size_t i = 0; i < n; ++i) {
      const double sum = double(dec[i]) + double(e.residual[i]);
      const double mag = std::max(std::fabs(double(c[i])), std::fabs(double(dec[i])));
      ASSERT_LE(std::fabs(sum - c[i]), std::ldexp(mag, -24)) << i;
      ASSERT_TRUE(same_bits(e.residual[i], c[i] - dec[i])) << i;  // element.hpp's rule
    }
  }
}

class TopkTies : public CodecProps {};

TEST_P(TopkTies, ExactSetLowestIndexFirst) {
  for (size_t n : {size_t{7}, size_t{1000}, size_t{300001}}) {
    const auto g = tie_grad(n, n);
    const auto wire = encode(codec, g);
    const auto idx = topk_indices(wire);
    // reference picks
    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return std::fabs(double(g[a])) > std::fabs(double(g[b]));
    });
    order.resize(codec.topk_k(n));
    std::sort(order.begin(), order.end());
    ASSERT_EQ(idx, order) << "n=" << n;
    check_against_reference(codec, g, decode(wire, n));
  }
}

// Top-k's int8 values bit for bit against their definition, spelled out here in float: per
// 65536-element chunk, scale = absmax / 127 over the kept |c| (absmax 0: scale 0, levels 0) and
// levels rint(c * (127 / absmax)). `kept`: the kept indices, increasing.
void expect_int8_values_bits(const Bytes& wire, const std::vector<float>& c,
                             const std::vector<uint32_t>& kept) {
  const auto h = gradzip::read_header(wire.data(), wire.size());
  const auto l = gradzip::payload_layout(h);
  const std::byte* payload = wire.data() + gradzip::kHeaderBytes;
  const size_t chunks = (c.size() + 65535) / 65536;
  size_t j = 0;
  for (size_t ch = 0; ch < chunks; ++ch) {
    const size_t begin = j;
    float absmax = 0.0f;
    for (; j < kept.size() && kept[j] / 65536 == ch; ++j) absmax = std::max(absmax, std::fabs(c[kept[j]]));
    float scale_on_wire;
    std::memcpy(&scale_on_wire, payload + l.section3 + 4 * ch, 4);
    ASSERT_TRUE(same_bits(scale_on_wire, absmax / 127.0f)) << "chunk " << ch;
    for (size_t m = begin; m < j; ++m) {
      const float level = absmax > 0.0f ? std::nearbyint(c[kept[m]] * (127.0f / absmax)) : 0.0f;
      ASSERT_EQ(int(int8_t(payload[l.section2 + m])), int(level)) << "position " << m;
    }
  }
}

// Inputs shaped to defeat the sampled selection (too few candidates above its bound: sparse; a
// chunk with more candidates than its workspace share: packed), next to ones it handles: every
// result exact, and both paths taken.
TEST(TopkShapes, ExactOnBothPaths) {
  const size_t n = (size_t{1} << 20) + 13;
  struct Shape {
    const char* name;
    const char* spec;
    std::vector<float> grad;
    int radix;  // 1: must take the full radix select, 0: the sampled path, -1: either
    float residual = 1e-4f;  // scale of the random residual
  };
  std::vector<Shape> shapes;
  {
    auto g = random_grad(n, 3, 1e-3f);  // large values on a regular grid only
    for (size_t i = 0; i < n; i += 256) g[i] = 1.0f + float(i % 977);
    shapes.push_back({"grid", "topk:0.01", g, -1});
  }
  {
    auto g = random_grad(n, 4, 1e-3f);  // large values packed into the first chunk
    for (size_t i = 0; i < 40000; ++i) g[i] = 1.0f + float(i % 389);
    shapes.push_back({"packed", "topk:0.05", g, 1});
  }
  {
    std::vector<float> g(n, 0.0f);  // sparse: fewer non-zeros than k, ties among the zeros
    for (size_t i = 5; i < n; i += 211) g[i] = float(i % 7) - 3.0f;
    shapes.push_back({"sparse", "topk:0.01:values=fp16", g, 1, 0.0f});
  }
  {
    auto g = random_grad(n, 5);  // plain random: the sampled path
    for (size_t i = 0; i < n; i += 3) g[i] = 0.0f;
    shapes.push_back({"random", "topk:0.02", g, 0});
    shapes.push_back({"random int8", "topk:0.02:values=int8", g, 0});
  }
  {
    auto g = random_grad(n, 6, 1e-3f);  // packed, with int8 values: the radix path
    for (size_t i = 0; i < 40000; ++i) g[i] = 1.0f + float(i % 389);
    shapes.push_back({"packed int8", "topk:0.05:values=int8", g, 1});
  }
  for (const Shape& s : shapes) {
    SCOPED_TRACE(s.name);
    const Codec codec = Codec::parse(s.spec);
    const auto r0 = random_grad(n, 11, s.residual);
    const auto c = codec_input(s.grad, &r0, 0.5f);
    const uint64_t before = gradzip::detail::topk_radix_runs();
    const Encoded e = encode_ef(codec, s.grad, r0, 0.5f);
    if (s.radix >= 0) {
      EXPECT_EQ(gradzip::detail::topk_radix_runs() - before, uint64_t(s.radix));
    }
    std::vector<uint32_t> order(n);  // reference: largest |c| first, lowest index on ties
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return std::fabs(double(c[a])) > std::fabs(double(c[b]));
    });
    order.resize(codec.topk_k(n));
    std::sort(order.begin(), order.end());
    ASSERT_EQ(topk_indices(e.wire), order);
    const auto dec = decode(e.wire, n);
    check_against_reference(codec, c, dec);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(e.residual[i], c[i] - dec[i])) << i;
    if (codec.spec().values == gradzip::TopkValues::int8) expect_int8_values_bits(e.wire, c, order);
  }
}

TEST_P(CodecProps, SameBytesForAnyThreadCount) {
  const size_t n = 1000003;
  const auto g = random_grad(n, 5);
  const auto r0 = random_grad(n, 6, 0.01f);
  gradzip::set_num_threads(1);
  const Encoded ref = encode_ef(codec, g, r0, 0.5f);
  for (int t : {2, 3}) {
    gradzip::set_num_threads(t);
    const Encoded e = encode_ef(codec, g, r0, 0.5f);
    ASSERT_EQ(e.wire, ref.wire) << t << " threads";
    ASSERT_EQ(0, std::memcmp(e.residual.data(), ref.residual.data(), 4 * n)) << t << " threads";
    gradzip::set_num_threads(1);
    const auto d1 = decode(e.wire, n);
    gradzip::set_num_threads(t);
    ASSERT_EQ(0, std::memcmp(decode(e.wire, n).data(), d1.data(), 4 * n));
  }
}

TEST_P(CodecProps, SameBytesOnEveryIsa) {
  const size_t n = 100003;
  auto g = random_grad(n, 11);
  // special values the vector paths must treat like element.hpp: subnormals, huge, signed zeros
  for (size_t i = 0; i < 64; ++i) g[i * 131] = std::ldexp(float(i) - 32.0f, -140 + int(i));
  g[5] = -0.0f;
  g[6] = 7e4f;
  const auto r0 = random_grad(n, 12, 0.01f);
  const char* start = gradzip::cpu_isa();
  std::vector<const char*> vector_isas;  // the ones this CPU runs
  for (const char* isa : {"avx2", "avx512"})
    if (gradzip::detail::force_isa(isa)) vector_isas.push_back(isa);
  if (vector_isas.empty()) {
    gradzip::detail::force_isa(start);
    GTEST_SKIP() << "only the portable loops run on this CPU: nothing to compare them with";
  }
  ASSERT_TRUE(gradzip::detail::force_isa("portable"));
  const Encoded ref = encode_ef(codec, g, r0, 0.5f);
  const auto dref = decode(ref.wire, n);
  for (const char* isa : vector_isas) {
    ASSERT_TRUE(gradzip::detail::force_isa(isa));
    const Encoded e = encode_ef(codec, g, r0, 0.5f);
    EXPECT_EQ(e.wire, ref.wire) << isa;
    EXPECT_EQ(0, std::memcmp(e.residual.data(), ref.residual.data(), 4 * n)) << isa;
    EXPECT_EQ(0, std::memcmp(decode(e.wire, n).data(), dref.data(), 4 * n)) << isa;
  }
  gradzip::detail::force_isa(start);
}

TEST_P(CodecProps, DecodeAddEqualsDecodePlusAdd) {
  for (size_t n : sizes_for(codec)) {
    const auto wire = encode(codec, random_grad(n, 3 + n));
    const auto base = random_grad(n, 4 + n);
    const auto dec = decode(wire, n);
    auto acc = base;
    gradzip::decode_add(wire.data(), wire.size(), acc.data(), n);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(acc[i], base[i] + dec[i])) << i;
  }
}

TEST_P(CodecProps, NonFiniteVisibleResidualFinite) {
  const size_t n = 5000;
  auto g = random_grad(n, 21);
  const size_t nan_at = 1234, inf_at = 3001;
  g[nan_at] = std::nanf("");
  g[inf_at] = -INFINITY;
  const auto r0 = random_grad(n, 22, 0.01f);
  const Encoded e = encode_ef(codec, g, r0);
  const auto dec = decode(e.wire, n);
  EXPECT_FALSE(std::isfinite(dec[nan_at]));
  EXPECT_FALSE(std::isfinite(dec[inf_at]));
  for (size_t i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(e.residual[i])) << i;
  // where c - decoded is not finite the residual keeps its old value
  EXPECT_TRUE(same_bits(e.residual[nan_at], r0[nan_at]));
  EXPECT_TRUE(same_bits(e.residual[inf_at], r0[inf_at]));
}

TEST_P(CodecProps, BufferTooSmall) {
  const size_t n = 1000;
  const auto g = random_grad(n, 1);
  Bytes wire(codec.encoded_bytes(n) - 1);
  std::vector<uint32_t> ws(codec.workspace_bytes(n) / 4 + 1);
  try {
    codec.encode(g.data(), n, wire.data(), wire.size(), 1.0f, ws.data(), ws.size() * 4);
    FAIL() << "accepted a short output buffer";
  } catch (const gradzip::Error& e) {
    EXPECT_EQ(e.status(), gradzip::Status::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("too small"), std::string::npos);
  }
  if (codec.workspace_bytes(n) > 0) {
    wire.resize(codec.encoded_bytes(n));
    try {
      codec.encode(g.data(), n, wire.data(), wire.size(), 1.0f, ws.data(), codec.workspace_bytes(n) - 4);
      FAIL() << "accepted a short workspace";
    } catch (const gradzip::Error& e) {
      EXPECT_EQ(e.status(), gradzip::Status::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllCodecs, CodecProps, ::testing::ValuesIn(kSpecs),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& ch : s) if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

INSTANTIATE_TEST_SUITE_P(Topk, TopkTies,
                         ::testing::Values("topk:0.01", "topk:0.3", "topk:0.01:values=fp16",
                                           "topk:0.3:values=int8", "topk:1"));

// The blockwise wires bit for bit against their definitions, spelled out here in float: int8's
// scale absmax / 127 and levels rint(c * (127 / absmax)); sign's mean |c| summed by 32 lanes
// (lane j: elements j, j + 32, ... from +0.0), then lanes j + 16, 8, 4, 2, 1 folded in, divided by
// the block's length. Blocks below, at and above the encoders' 4096-float L1 buffer; tails.
TEST(Blockwise, WireBitsMatchDefinition) {
  for (const char* spec : {"int8:block=32", "int8", "int8:block=4096", "int8:block=8192",
                           "sign:block=32", "sign", "sign:block=4096", "sign:block=65536"}) {
    const Codec codec = Codec::parse(spec);
    const size_t block = codec.spec().block;
    for (size_t n : {block - 1, 3 * block + 33}) {
      SCOPED_TRACE(std::string(spec) + " n=" + std::to_string(n));
      auto g = random_grad(n, 31 + n);
      auto r0 = random_grad(n, 37 + n, 0.01f);
      for (size_t i = 0; i < n; i += 97) g[i] = r0[i] = -0.0f;  // c = -0: quantised to 0
      const auto c = codec_input(g, &r0, 0.5f);
      const Encoded e = encode_ef(codec, g, r0, 0.5f);
      const auto l = gradzip::payload_layout(codec.kind(), n, uint32_t(block), false);
      const std::byte* payload = e.wire.data() + gradzip::kHeaderBytes;
      for (size_t s = 0, b = 0; s < n; s += block, ++b) {
        const size_t len = std::min(block, n - s);
        float scale_on_wire;
        std::memcpy(&scale_on_wire, payload + l.section0 + 4 * b, 4);
        if (codec.kind() == CodecKind::int8) {
          float absmax = 0.0f;
          for (size_t i = s; i < s + len; ++i) absmax = std::max(absmax, std::fabs(c[i]));
          ASSERT_TRUE(same_bits(scale_on_wire, absmax / 127.0f)) << "block " << b;
          const float inv = 127.0f / absmax;
          for (size_t i = s; i < s + len; ++i) {
            const float level = std::nearbyint(c[i] * inv);
            const int8_t q = int8_t(payload[l.section1 + i]);
            ASSERT_EQ(int(q), int(level)) << i;
            // c minus what the wire decodes to (the int8, so a level of -0 decodes to +0)
            ASSERT_TRUE(same_bits(e.residual[i], c[i] - float(q) * scale_on_wire)) << i;
          }
        } else {
          float lanes[32] = {};
          for (size_t i = 0; i < len; ++i) lanes[i % 32] += std::fabs(c[s + i]);
          for (size_t w = 16; w >= 1; w /= 2)
            for (size_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
          ASSERT_TRUE(same_bits(scale_on_wire, lanes[0] / float(len))) << "block " << b;
          for (size_t i = s; i < s + len; ++i) {
            uint32_t word;
            std::memcpy(&word, payload + l.section1 + 4 * (i / 32), 4);
            ASSERT_EQ((word >> (i % 32)) & 1u, uint32_t(std::signbit(c[i]))) << i;
            const float decoded = std::signbit(c[i]) ? -scale_on_wire : scale_on_wire;
            ASSERT_TRUE(same_bits(e.residual[i], c[i] - decoded)) << i;
          }
        }
      }
    }
  }
}

TEST(Codec, Int8BlockOfNaNOrHuge) {
  const Codec c = Codec::parse("int8:block=32");
  std::vector<float> g(64, 1.0f);
  g[3] = 3e38f;  // finite huge: scale finite, other elements of the block quantise to 0
  const auto dec = decode(encode(c, g), 64);
  EXPECT_NEAR(dec[3], 3e38f, 3e38f / 254);
  EXPECT_EQ(dec[4], 0.0f);
  EXPECT_EQ(dec[40], 1.0f);
}

// A block whose absmax is FLT_MAX: FLT_MAX / 127 rounds up, so the scale steps one ulp down and
// every element decodes finite (found by the round-trip fuzzer).
TEST(Codec, Int8AbsmaxFltMaxStaysFinite) {
  const Codec c = Codec::parse("int8:block=96");
  std::vector<float> g(96, 1.0f);
  g[0] = 3.0f;
  g[2] = -std::numeric_limits<float>::max();
  const auto dec = decode(encode(c, g), 96);
  for (float v : dec) EXPECT_TRUE(std::isfinite(v));
  EXPECT_NEAR(dec[2], -std::numeric_limits<float>::max(), std::numeric_limits<float>::max() / 254);
}

// Any NaN input (sign, payload) encodes as the canonical NaN, so the CPU and GPU wires agree.
TEST(Codec, NaNIsCanonicalOnTheWire) {
  const float neg_nan = gradzip::element::bits_float(0xFFC12345u);
  const float canon = gradzip::element::bits_float(gradzip::element::kCanonicalNaN);
  for (const char* spec : {"fp32", "fp16", "bf16", "int8:block=32", "sign:block=32", "topk:1"}) {
    const Codec c = Codec::parse(spec);
    std::vector<float> a(37, 0.5f), b(37, 0.5f), r(37, 0.25f);
    a[5] = neg_nan;
    b[5] = canon;
    EXPECT_EQ(encode(c, a), encode(c, b)) << spec;
    EXPECT_EQ(encode_ef(c, a, r).wire, encode_ef(c, b, r).wire) << spec;
  }
}

// Payloads are read and written as floats/words in place: a misaligned wire or output buffer is
// refused with invalid_argument (as on the GPU), never read through a misaligned pointer.
TEST(Codec, MisalignedBuffersAreRefused) {
  const Codec c = Codec::parse("int8:block=32");
  std::vector<float> g(33, 0.5f), out(33, 7.0f);
  const Bytes wire = encode(c, g);
  Bytes shifted(wire.size() + 4);
  std::copy(wire.begin(), wire.end(), shifted.begin() + 1);
  try {
    gradzip::decode(shifted.data() + 1, wire.size(), out.data(), out.size());
    ADD_FAILURE() << "misaligned wire accepted";
  } catch (const gradzip::Error& e) {
    EXPECT_EQ(e.status(), gradzip::Status::invalid_argument);
  }
  EXPECT_EQ(out, std::vector<float>(33, 7.0f));
  EXPECT_THROW(c.encode(g.data(), g.size(), shifted.data() + 1, wire.size()), gradzip::Error);
}

// Codec::wire_header is exactly the header an encode writes and read_header returns.
TEST(Codec, WireHeaderMatchesEncodedMessage) {
  for (const char* spec : {"fp32", "fp16", "int8:block=64", "sign", "topk:0.3:values=fp16"}) {
    const Codec c = Codec::parse(spec);
    for (size_t n : {size_t{0}, size_t{1}, size_t{1001}}) {
      const Bytes wire = encode(c, std::vector<float>(n, 0.25f));
      const gradzip::WireHeader want = c.wire_header(n), got = gradzip::read_header(wire.data(), wire.size());
      EXPECT_EQ(std::memcmp(&want, &got, sizeof want), 0) << spec << " n=" << n;
      EXPECT_EQ(gradzip::kHeaderBytes + want.payload_bytes, c.encoded_bytes(n)) << spec;
    }
  }
}

TEST(Codec, ThreadCountSetting) {
  gradzip::set_num_threads(3);
  EXPECT_EQ(gradzip::num_threads(), 3);
  gradzip::set_num_threads(0);
  EXPECT_GE(gradzip::num_threads(), 1);
  EXPECT_THROW(gradzip::set_num_threads(-1), gradzip::Error);
}

TEST(Codec, IsaNamed) {
  const std::string isa = gradzip::cpu_isa();
  EXPECT_TRUE(isa == "avx512" || isa == "avx2" || isa == "portable") << isa;
}

}  // namespace
