// The bytes do not depend on the calling thread's floating-point mode: with flush-to-zero and
// denormals-are-zero set (as torch.set_flush_denormal(True) does), or another rounding direction
// (fesetround), on the caller and on OpenMP's worker threads, every codec encodes, feeds back and
// decodes exactly as in IEEE mode, and the caller gets its own mode back.
#include <gtest/gtest.h>
#include <immintrin.h>
#include <omp.h>

#include <cfloat>
#include <cstring>
#include <string>
#include <vector>

#include "gradzip/gradzip.hpp"
#include "test_util.hpp"

namespace {

constexpr unsigned kNonIeee = (1u << 15) | (1u << 6);  // MXCSR's FTZ and DAZ
constexpr unsigned kRoundBits = 3u << 13;               // MXCSR's rounding control
constexpr unsigned kRoundUp = 2u << 13, kRoundToZero = 3u << 13;

// Sets the mode on this thread and on every OpenMP worker (they keep their own MXCSR).
void set_mode_everywhere(unsigned csr_bits, bool on) {
  auto apply = [&] { _mm_setcsr(on ? (_mm_getcsr() | csr_bits) : (_mm_getcsr() & ~csr_bits)); };
  apply();
#pragma omp parallel num_threads(4)
  apply();
}

struct Result {
  std::vector<std::byte> wire;
  std::vector<float> residual, decoded;
};

// No float arithmetic here: it would run in the mode under test.
Result run(const std::string& spec, const std::vector<float>& grad, const std::vector<float>& residual) {
  const auto codec = gradzip::Codec::parse(spec);
  const size_t n = grad.size();
  Result r{std::vector<std::byte>(codec.encoded_bytes(n)), residual, std::vector<float>(n)};
  std::vector<std::byte> ws(codec.workspace_bytes(n));
  codec.encode_with_feedback(grad.data(), r.residual.data(), n, r.wire.data(), r.wire.size(), 0.5f,
                             ws.data(), ws.size());
  gradzip::decode(r.wire.data(), r.wire.size(), r.decoded.data(), n);
  return r;
}

// Gradients around the subnormal range of float (and of fp16, at 2^-24 .. 2^-14).
std::vector<float> tiny_grad(size_t n) {
  std::vector<float> g = gztest::random_grad(n, 7);
  for (size_t i = 0; i < n; ++i) {
    const size_t block = i / 1024;  // whole blocks of one magnitude, and every 4th one mixed
    const size_t k = block % 4 == 3 ? i % 3 : block % 3;
    g[i] *= k == 0 ? 1e-38f : k == 1 ? 1e-6f : 1e-41f;
  }
  return g;
}

class FloatMode : public ::testing::TestWithParam<std::string> {
  void SetUp() override { gradzip::set_num_threads(2); }
  void TearDown() override {
    set_mode_everywhere(kNonIeee | kRoundBits, false);
    gradzip::set_num_threads(0);
  }
};

TEST_P(FloatMode, FlushToZeroOnCallerAndWorkersGivesTheSameBytes) {
  set_mode_everywhere(kNonIeee, false);
  const std::vector<float> grad = tiny_grad(200003);  // several threads' worth
  std::vector<float> residual(grad.size());
  for (size_t i = 0; i < grad.size(); ++i) residual[i] = grad[i] * -0.25f;
  const Result ieee = run(GetParam(), grad, residual);
  set_mode_everywhere(kNonIeee, true);
  const Result flushed = run(GetParam(), grad, residual);
  EXPECT_EQ((_mm_getcsr() & kNonIeee), kNonIeee) << "the caller's mode was not restored";
  set_mode_everywhere(kNonIeee, false);
  ASSERT_EQ(ieee.wire.size(), flushed.wire.size());
  EXPECT_EQ(std::memcmp(ieee.wire.data(), flushed.wire.data(), ieee.wire.size()), 0) << "wire";
  EXPECT_EQ(std::memcmp(ieee.residual.data(), flushed.residual.data(), 4 * grad.size()), 0)
      << "residual";
  EXPECT_EQ(std::memcmp(ieee.decoded.data(), flushed.decoded.data(), 4 * grad.size()), 0)
      << "decoded";
  // The data does exercise subnormals: in IEEE mode some residual or decoded value is one.
  bool subnormal = false;
  for (const auto* v : {&ieee.residual, &ieee.decoded})
    for (float x : *v) subnormal |= x != 0.0f && std::abs(x) < FLT_MIN;
  EXPECT_TRUE(subnormal);
}

TEST_P(FloatMode, OtherRoundingDirectionsGiveTheSameBytes) {
  set_mode_everywhere(kNonIeee | kRoundBits, false);
  std::vector<float> grad = gztest::random_grad(200003, 9);
  for (size_t i = 0; i < grad.size(); i += 7) grad[i] *= 1e-6f;  // fp16 subnormals too
  std::vector<float> residual(grad.size());
  for (size_t i = 0; i < grad.size(); ++i) residual[i] = grad[(i * 31) % grad.size()] * 0.125f;
  const Result nearest = run(GetParam(), grad, residual);
  for (unsigned mode : {kRoundUp, kRoundToZero}) {
    SCOPED_TRACE(mode);
    set_mode_everywhere(mode, true);
    const Result other = run(GetParam(), grad, residual);
    EXPECT_EQ(_mm_getcsr() & kRoundBits, mode) << "the caller's mode was not restored";
    set_mode_everywhere(kRoundBits, false);
    EXPECT_EQ(std::memcmp(nearest.wire.data(), other.wire.data(), nearest.wire.size()), 0) << "wire";
    EXPECT_EQ(std::memcmp(nearest.residual.data(), other.residual.data(), 4 * grad.size()), 0)
        << "residual";
    EXPECT_EQ(std::memcmp(nearest.decoded.data(), other.decoded.data(), 4 * grad.size()), 0)
        << "decoded";
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, FloatMode,
                         ::testing::Values("fp32", "fp16", "bf16", "int8", "sign", "topk:0.01",
                                           "topk:0.05:values=fp16", "topk:0.05:values=int8"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (c == ':' || c == '.' || c == '=') c = '_';
                           return s;
                         });

}  // namespace
