// fp16 and bf16 rounding on all 2^32 float bit patterns, through the library's own encoder (the
// vectorised kernel of every instruction set this CPU has), against independent references:
// F16C's hardware conversion for fp16, a compare-the-dropped-bits rounding for bf16.
#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "detail.hpp"  // force_isa
#include "test_util.hpp"

using namespace gztest;

namespace {

constexpr size_t kChunk = size_t{1} << 22;
constexpr size_t kChunks = (size_t{1} << 32) / kChunk;

// The encoders make every NaN canonical (element::canonical_nan: 0x7FFFFFFF) before rounding, so
// any NaN input encodes as the canonical NaN's half-word.
constexpr uint16_t kBf16CanonicalNaN = 0x7FFF, kFp16CanonicalNaN = 0x7E00;

// Reference half-words for a whole array (vectorised where the CPU allows, so that 2^32 inputs
// take seconds).
void ref_bf16_array(const float* in, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; ++i) out[i] = std::isnan(in[i]) ? kBf16CanonicalNaN : ref_bf16(in[i]);
}
// GCC 12's _mm512_cvtps_ph trips -Wmaybe-uninitialized inside its own header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f"))) void ref_fp16_array_avx512(const float* in, size_t n,
                                                               uint16_t* out) {
  for (size_t i = 0; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(in + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (size_t i = 0; i < n; ++i)  // F16C keeps NaN payload bits; the encoder's NaN is canonical
    if (std::isnan(in[i])) out[i] = kFp16CanonicalNaN;
}
#pragma GCC diagnostic pop
void ref_fp16_array(const float* in, size_t n, uint16_t* out) {
  if (__builtin_cpu_supports("avx512f") && n % 16 == 0) return ref_fp16_array_avx512(in, n, out);
  for (size_t i = 0; i < n; ++i) out[i] = std::isnan(in[i]) ? kFp16CanonicalNaN : ref_fp16(in[i]);
}

// Encodes every float bit pattern with `spec` and compares each payload half-word with the
// reference.
// stride > 1 tests every stride-th chunk of 2^22 patterns plus the chunks holding zero,
// subnormals, the largest finite values, Inf and NaN of both signs.
void exhaustive(const char* spec, void (*ref)(const float*, size_t, uint16_t*), size_t stride) {
  const gradzip::Codec codec = gradzip::Codec::parse(spec);
  std::atomic<uint64_t> mismatches{0};
  std::atomic<uint64_t> first_bad{~uint64_t{0}};
#pragma omp parallel
  {
    std::vector<float> in(kChunk);
    std::vector<uint16_t> want(kChunk);
    Bytes wire(codec.encoded_bytes(kChunk));
#pragma omp for schedule(dynamic)
    for (long long c = 0; c < static_cast<long long>(kChunks); ++c) {
      const size_t half = kChunks / 2, within = static_cast<size_t>(c) % half;
      const bool edge = within == 0 || within >= half - 3;  // +-0 and subnormals; max, Inf, NaN
      if (static_cast<size_t>(c) % stride != 0 && !edge) continue;
      const uint32_t base = static_cast<uint32_t>(c * kChunk);
      for (size_t i = 0; i < kChunk; ++i) in[i] = gradzip::element::bits_float(base + uint32_t(i));
      codec.encode(in.data(), kChunk, wire.data(), wire.size());
      ref(in.data(), kChunk, want.data());
      const auto* h = reinterpret_cast<const uint16_t*>(wire.data() + gradzip::kHeaderBytes);
      if (std::memcmp(h, want.data(), 2 * kChunk) == 0) continue;
      for (size_t i = 0; i < kChunk; ++i) {
        if (h[i] != want[i]) {
          mismatches.fetch_add(1);
          uint64_t bad = base + i, cur = first_bad.load();
          while (bad < cur && !first_bad.compare_exchange_weak(cur, bad)) {}
        }
      }
    }
  }
  EXPECT_EQ(mismatches.load(), 0u) << spec << " on " << gradzip::cpu_isa()
                                   << ": first bad input bits 0x" << std::hex << first_bad.load();
}

// The instruction set the library picks runs all 2^32 inputs; the others (also covered by the
// cross-ISA byte-equality tests) every 16th chunk plus the special ranges, to keep the suite fast.
class Exhaustive : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    start_ = gradzip::cpu_isa();
    stride_ = std::string(start_) == GetParam() ? 1 : 16;
    if (!gradzip::detail::force_isa(GetParam())) GTEST_SKIP() << GetParam() << " not supported";
  }
  void TearDown() override { gradzip::detail::force_isa(start_); }
  const char* start_ = nullptr;
  size_t stride_ = 1;
};

TEST_P(Exhaustive, Bf16AllFloats) { exhaustive("bf16", ref_bf16_array, stride_); }

TEST_P(Exhaustive, Fp16AllFloats) {
  if (!cpu_has_f16c()) GTEST_SKIP() << "no F16C for the reference";
  exhaustive("fp16", ref_fp16_array, stride_);
}

INSTANTIATE_TEST_SUITE_P(Isa, Exhaustive, ::testing::Values("portable", "avx2", "avx512"),
                         [](const auto& info) { return std::string(info.param); });

// Every half-word decodes exactly (decode path of the current ISA).
TEST(Exhaustive, DecodeAllHalfWords) {
  for (const char* spec : {"fp16", "bf16"}) {
    const gradzip::Codec codec = gradzip::Codec::parse(spec);
    const size_t n = 65536;
    Bytes wire(codec.encoded_bytes(n));
    std::vector<float> zeros(n, 0.0f);
    codec.encode(zeros.data(), n, wire.data(), wire.size());  // a valid header for n
    auto* h = reinterpret_cast<uint16_t*>(wire.data() + gradzip::kHeaderBytes);
    for (size_t i = 0; i < n; ++i) h[i] = static_cast<uint16_t>(i);
    const auto out = decode(wire, n);
    for (size_t i = 0; i < n; ++i) {
      float want;
      if (spec[0] == 'b') want = gradzip::element::bits_float(uint32_t(i) << 16);
      else if (cpu_has_f16c()) want = ref_fp16_to_float(static_cast<uint16_t>(i));
      else continue;
      if ((i & 0x7C00u) == 0x7C00u && (i & 0x3FFu) != 0 && spec[0] == 'f') {
        // NaN: F16C quiets signalling NaNs, element.hpp keeps the payload; sign and NaN-ness agree
        ASSERT_TRUE(std::isnan(out[i]) && std::signbit(out[i]) == bool(i & 0x8000u)) << std::hex << i;
        continue;
      }
      ASSERT_TRUE(same_bits(out[i], want)) << spec << " 0x" << std::hex << i;
    }
  }
}

}  // namespace
