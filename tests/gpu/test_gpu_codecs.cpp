// CPU-vs-GPU equality of every codec: the CUDA encoders write the same wire bytes and the same
// residuals as the host encoders, every output byte is written (poisoned buffers) and nothing
// past the end; the CUDA decoders give the host's floats; corrupt payloads are rejected with the
// host's status and leave the output untouched. Runs only with a GPU (main() exits 77 otherwise).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "corruptions.hpp"
#include "cuda_buffer.hpp"
#include "gradzip/cuda.hpp"
#include "gradzip/gradzip.hpp"
#include "test_util.hpp"  // tests/cpu: random_grad, tie_grad, host encode helpers

namespace {

using gztest::Bytes;
using gztest::DeviceBuffer;

const char* const kSpecs[] = {"fp32",          "fp16",           "bf16",
                              "int8",          "int8:block=32",  "int8:block=4096",
                              "int8:block=96", "sign",           "sign:block=32",
                              "sign:block=4096", "sign:block=96",
                              "topk:0.01",     "topk:0.1:values=fp16", "topk:0.1:values=int8", "topk:1",
                              "topk:0.0001"};
constexpr float kPrescale = 1.0f / 3.0f;  // not a power of two: exercises the two roundings
constexpr size_t kGuard = 64;             // bytes after each output that must stay untouched
constexpr uint8_t kHostPoison = 0x5A, kDevicePoison = 0xA5;

// Inputs are expensive at 10^8: generate each (size, kind) once.
// GRADZIP_GPU_TEST_MAX_N caps the sizes (bench/gpu/check.sh's compute-sanitizer stage runs the
// suite at small sizes: the sanitizers slow kernels down by orders of magnitude).
bool size_enabled(size_t n) {
  static const size_t cap = [] {
    const char* v = std::getenv("GRADZIP_GPU_TEST_MAX_N");
    return v && *v ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : SIZE_MAX;
  }();
  return n <= cap;
}

const std::vector<float>& input(size_t n, int kind) {
  static std::map<std::pair<size_t, int>, std::vector<float>> cache;
  auto& v = cache[{n, kind}];
  if (v.size() != n) {
    if (kind == 0) v = gztest::random_grad(n, 1000 + n);           // gradient
    else if (kind == 1) v = gztest::random_grad(n, 2000 + n, 0.01f);  // residual
    else v = gztest::tie_grad(n, 3000 + n);                           // many equal magnitudes
  }
  return v;
}

bool same_floats(const std::vector<float>& a, const std::vector<float>& b, bool nan_aware) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (gztest::same_bits(a[i], b[i])) continue;
    if (nan_aware && std::isnan(a[i]) && std::isnan(b[i])) continue;
    return false;
  }
  return true;
}

size_t first_byte_diff(const Bytes& a, const std::vector<uint8_t>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (static_cast<uint8_t>(a[i]) != b[i]) return i;
  return a.size();
}

// One encode on both sides; checks wire bytes, residual bytes, guard bytes.
void check_encode(const gradzip::Codec& codec, const std::vector<float>& grad,
                  const std::vector<float>* residual, size_t misalign) {
  const size_t n = grad.size();
  const size_t bytes = codec.encoded_bytes(n);
  const size_t ws_bytes = codec.workspace_bytes(n);
  SCOPED_TRACE(codec.name() + " n=" + std::to_string(n) + (residual ? " EF" : " plain") +
               " misalign=" + std::to_string(misalign));

  Bytes cpu_wire(bytes, std::byte{kHostPoison});
  std::vector<float> cpu_res = residual ? *residual : std::vector<float>{};
  {
    std::vector<std::byte> ws(ws_bytes + 16);
    if (residual)
      codec.encode_with_feedback(grad.data(), cpu_res.data(), n, cpu_wire.data(), bytes, kPrescale,
                                 ws.data(), ws.size());
    else
      codec.encode(grad.data(), n, cpu_wire.data(), bytes, kPrescale, ws.data(), ws.size());
  }

  // misalign: grad/residual start 1 float late, the wire 4 bytes late (scalar paths).
  DeviceBuffer d_grad(4 * (n + 1)), d_res(4 * (n + 1)), d_out(bytes + kGuard + 16),
      d_ws(std::max<size_t>(ws_bytes, 16));
  const size_t fo = misalign ? 4 : 0;
  d_grad.upload(grad, fo);
  if (residual) d_res.upload(*residual, fo);
  d_out.fill(kDevicePoison);
  d_ws.fill(kDevicePoison);  // the encoders must not rely on a zeroed workspace
  const float* g = reinterpret_cast<const float*>(d_grad.as<char>() + fo);
  float* r = reinterpret_cast<float*>(d_res.as<char>() + fo);
  void* out = d_out.as<char>() + fo;
  if (residual)
    gradzip::cuda::encode_with_feedback(codec, g, r, n, out, bytes, nullptr, kPrescale, d_ws.get(),
                                        ws_bytes);
  else
    gradzip::cuda::encode(codec, g, n, out, bytes, nullptr, kPrescale, d_ws.get(), ws_bytes);
  gztest::cuda_check(cudaDeviceSynchronize(), "encode");

  const auto gpu = d_out.download<uint8_t>(bytes + kGuard, fo);
  const size_t diff = first_byte_diff(cpu_wire, gpu);
  EXPECT_EQ(diff, bytes) << "first differing wire byte " << diff << " of " << bytes;
  for (size_t i = bytes; i < bytes + kGuard; ++i)
    ASSERT_EQ(gpu[i], kDevicePoison) << "GPU wrote past the end, byte " << i;
  if (residual) {
    const auto gpu_res = d_res.download<float>(n, fo);
    EXPECT_TRUE(same_floats(cpu_res, gpu_res, false)) << "residuals differ";
  }
}

// GPU decode / decode_add of a host-encoded wire, sync and async forms.
void check_decode(const gradzip::Codec& codec, const std::vector<float>& grad) {
  const size_t n = grad.size();
  SCOPED_TRACE(codec.name() + " decode n=" + std::to_string(n));
  const Bytes wire = gztest::encode(codec, grad, kPrescale);
  std::vector<float> cpu_dec(n, 7.0f), cpu_add = grad;
  gradzip::decode(wire.data(), wire.size(), cpu_dec.data(), n);
  gradzip::decode_add(wire.data(), wire.size(), cpu_add.data(), n);

  DeviceBuffer d_wire(wire.size()), d_out(4 * n + 4), d_ws(gradzip::cuda::kDecodeWorkspaceBytes);
  d_wire.upload(wire);
  d_out.fill(0xFF);
  gradzip::cuda::decode(d_wire.get(), wire.size(), d_out.as<float>(), n, nullptr);
  EXPECT_TRUE(same_floats(cpu_dec, d_out.download<float>(n), false)) << "decode differs";

  d_out.upload(grad);
  gradzip::cuda::decode_add(d_wire.get(), wire.size(), d_out.as<float>(), n, nullptr, d_ws.get(),
                            d_ws.bytes());
  gradzip::cuda::check_decode(d_ws.get(), nullptr);
  EXPECT_TRUE(same_floats(cpu_add, d_out.download<float>(n), false)) << "decode_add differs";
}

class GpuCodec : public ::testing::TestWithParam<const char*> {};

TEST_P(GpuCodec, EncodeMatchesCpuOnOddSizes) {
  const auto codec = gradzip::Codec::parse(GetParam());
  for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{33}, size_t{4099}, size_t{1000003}}) {
    if (!size_enabled(n)) continue;
    const auto& g = input(n, 0);
    const auto& r = input(n, 1);
    check_encode(codec, g, nullptr, 0);
    check_encode(codec, g, &r, 0);
    if (n == 4099 || n == 33) {
      check_encode(codec, g, &r, 1);
      check_encode(codec, input(n, 2), &r, 0);  // ties in magnitude
    }
  }
}

TEST_P(GpuCodec, DecodeMatchesCpu) {
  const auto codec = gradzip::Codec::parse(GetParam());
  for (size_t n : {size_t{0}, size_t{1}, size_t{33}, size_t{4099}, size_t{1000003}})
    if (size_enabled(n)) check_decode(codec, input(n, 0));
}

TEST_P(GpuCodec, LargeOddSize) {
  const size_t n = 100000007;  // 10^8 + 7
  if (!size_enabled(n)) GTEST_SKIP() << "above GRADZIP_GPU_TEST_MAX_N";
  const auto codec = gradzip::Codec::parse(GetParam());
  check_encode(codec, input(n, 0), &input(n, 1), 0);
  check_decode(codec, input(n, 0));
}

// Non-finite inputs: encoders make NaN canonical (element::canonical_nan), so the wires are equal
// byte for byte; decoded values are compared NaN-aware (x86 and CUDA differ in the NaN that
// 0 * Inf makes), the residuals bit for bit.
TEST_P(GpuCodec, NonFiniteInputsStayVisible) {
  const auto codec = gradzip::Codec::parse(GetParam());
  const size_t n = 4099;
  std::vector<float> g = input(n, 0);
  g[5] = std::numeric_limits<float>::quiet_NaN();
  g[700] = std::numeric_limits<float>::infinity();
  g[2049] = -std::numeric_limits<float>::infinity();
  std::vector<float> cpu_res = input(n, 1);
  const auto cpu = gztest::encode_ef(codec, g, cpu_res, kPrescale);
  std::vector<float> cpu_dec(n);
  gradzip::decode(cpu.wire.data(), cpu.wire.size(), cpu_dec.data(), n);

  const size_t bytes = codec.encoded_bytes(n), ws_bytes = codec.workspace_bytes(n);
  DeviceBuffer d_g(4 * n), d_r(4 * n), d_out(bytes), d_ws(std::max<size_t>(ws_bytes, 16)), d_dec(4 * n);
  d_g.upload(g);
  d_r.upload(input(n, 1));
  gradzip::cuda::encode_with_feedback(codec, d_g.as<float>(), d_r.as<float>(), n, d_out.get(), bytes,
                                      nullptr, kPrescale, d_ws.get(), ws_bytes);
  EXPECT_TRUE(first_byte_diff(cpu.wire, d_out.download<uint8_t>(bytes)) == bytes) << "wire differs";
  gradzip::cuda::decode(d_out.get(), bytes, d_dec.as<float>(), n, nullptr);
  EXPECT_TRUE(same_floats(cpu_dec, d_dec.download<float>(n), true));
  EXPECT_TRUE(same_floats(cpu.residual, d_r.download<float>(n), false));
}

// ---- corrupt payloads ------------------------------------------------------------------------
struct Outcome {
  gradzip::Status status = gradzip::Status::ok;
  std::vector<float> out;
};

Outcome host_decode(const Bytes& wire, size_t n) {
  Outcome o;
  o.out.assign(n, 3.0f);
  try {
    gradzip::decode(wire.data(), wire.size(), o.out.data(), n);
  } catch (const gradzip::Error& e) {
    o.status = e.status();
  }
  return o;
}

// async: the workspace form + check_decode; else the synchronous form.
Outcome device_decode(const Bytes& wire, size_t n, bool async) {
  Outcome o;
  DeviceBuffer d_wire(wire.size() + 4), d_out(4 * n + 4), d_ws(gradzip::cuda::kDecodeWorkspaceBytes);
  d_wire.upload(wire);
  d_out.fill(0xFF);
  try {
    if (async) {
      gradzip::cuda::decode(d_wire.get(), wire.size(), d_out.as<float>(), n, nullptr, d_ws.get(), d_ws.bytes());
      gradzip::cuda::check_decode(d_ws.get(), nullptr);
    } else {
      gradzip::cuda::decode(d_wire.get(), wire.size(), d_out.as<float>(), n, nullptr);
    }
  } catch (const gradzip::Error& e) {
    o.status = e.status();
  }
  o.out = d_out.download<float>(n);
  return o;
}

void expect_same_verdict(const Bytes& wire, size_t n, const std::string& what, bool async) {
  SCOPED_TRACE(what + (async ? " (async)" : " (sync)"));
  const Outcome h = host_decode(wire, n);
  const Outcome d = device_decode(wire, n, async);
  ASSERT_EQ(static_cast<int>(d.status), static_cast<int>(h.status))
      << "host: " << gradzip::status_name(h.status) << ", GPU: " << gradzip::status_name(d.status);
  if (h.status == gradzip::Status::ok) {
    EXPECT_TRUE(same_floats(h.out, d.out, true));
  } else {
    for (float v : d.out) ASSERT_EQ(gztest::bits(v), 0xFFFFFFFFu) << "rejected payload wrote output";
  }
}

TEST_P(GpuCodec, CorruptPayloadsRejectedLikeCpu) {
  const auto codec = gradzip::Codec::parse(GetParam());
  for (size_t n : {size_t{0}, size_t{1003}}) {
    const Bytes good = gztest::encode(codec, input(n, 0), kPrescale);
    for (const auto& [what, w] : gztest::corruptions(codec, n, good)) {
      expect_same_verdict(w, n, what, false);
      if (what.rfind("random", 0) != 0) expect_same_verdict(w, n, what, true);
    }
    // The element count of the output differs from the payload's: size_mismatch on both sides.
    expect_same_verdict(good, n + 1, "n+1", false);
    expect_same_verdict(good, n + 1, "n+1", true);
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, GpuCodec, ::testing::ValuesIn(kSpecs),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

// Everything runs on the caller's stream: a non-blocking stream gives the default stream's bytes.
TEST(GpuStreams, NonBlockingStreamGivesTheSameBytes) {
  cudaStream_t stream = nullptr;
  gztest::cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const size_t n = 300007;
  for (const char* spec : kSpecs) {
    SCOPED_TRACE(spec);
    const auto codec = gradzip::Codec::parse(spec);
    const size_t bytes = codec.encoded_bytes(n), ws_bytes = codec.workspace_bytes(n);
    DeviceBuffer d_g(4 * n), d_r1(4 * n), d_r2(4 * n), d_o1(bytes), d_o2(bytes),
        d_ws(std::max<size_t>(ws_bytes, 16)), d_dec(4 * n), d_st(gradzip::cuda::kDecodeWorkspaceBytes);
    d_g.upload(input(n, 0));
    d_r1.upload(input(n, 1));
    d_r2.upload(input(n, 1));
    gradzip::cuda::encode_with_feedback(codec, d_g.as<float>(), d_r1.as<float>(), n, d_o1.get(), bytes,
                                        nullptr, kPrescale, d_ws.get(), ws_bytes);
    gztest::cuda_check(cudaDeviceSynchronize(), "default stream");
    gradzip::cuda::encode_with_feedback(codec, d_g.as<float>(), d_r2.as<float>(), n, d_o2.get(), bytes,
                                        stream, kPrescale, d_ws.get(), ws_bytes);
    gradzip::cuda::decode(d_o2.get(), bytes, d_dec.as<float>(), n, stream, d_st.get(), d_st.bytes());
    gradzip::cuda::check_decode(d_st.get(), stream);  // synchronises `stream`
    EXPECT_TRUE(d_o1.download<uint8_t>(bytes) == d_o2.download<uint8_t>(bytes));
    EXPECT_TRUE(d_r1.download<uint8_t>(4 * n) == d_r2.download<uint8_t>(4 * n));
    std::vector<float> host_dec(n);
    const auto wire = d_o1.download<std::byte>(bytes);
    gradzip::decode(wire.data(), bytes, host_dec.data(), n);
    EXPECT_TRUE(same_floats(host_dec, d_dec.download<float>(n), false));
  }
  cudaStreamDestroy(stream);
}

// ---- pointer checks --------------------------------------------------------------------------
TEST(GpuPointers, HostPointerToCudaEntryPointIsRejected) {
  const auto codec = gradzip::Codec::parse("bf16");
  std::vector<float> host(16, 1.0f);
  DeviceBuffer d_out(codec.encoded_bytes(16));
  try {
    gradzip::cuda::encode(codec, host.data(), 16, d_out.get(), d_out.bytes(), nullptr);
    FAIL() << "host input accepted";
  } catch (const gradzip::Error& e) {
    EXPECT_EQ(e.status(), gradzip::Status::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("input"), std::string::npos) << e.what();
  }
}

TEST(GpuPointers, DevicePointerToHostEntryPointIsRejected) {
  const auto codec = gradzip::Codec::parse("bf16");
  DeviceBuffer d_in(64);
  Bytes out(codec.encoded_bytes(16));
  try {
    codec.encode(d_in.as<float>(), 16, out.data(), out.size());
    FAIL() << "device input accepted by the host API";
  } catch (const gradzip::Error& e) {
    EXPECT_EQ(e.status(), gradzip::Status::invalid_argument);
  }
}

TEST(GpuPointers, TooSmallWorkspaceAndOutputAreRejected) {
  const auto codec = gradzip::Codec::parse("topk:0.01");
  const size_t n = 100000;
  DeviceBuffer d_in(4 * n), d_out(codec.encoded_bytes(n)), d_ws(16);
  EXPECT_THROW(gradzip::cuda::encode(codec, d_in.as<float>(), n, d_out.get(), d_out.bytes(), nullptr,
                                     1.0f, d_ws.get(), 16),
               gradzip::Error);
  EXPECT_THROW(gradzip::cuda::encode(codec, d_in.as<float>(), n, d_out.get(), d_out.bytes() - 1, nullptr),
               gradzip::Error);
}

}  // namespace

int main(int argc, char** argv) {
  if (!gradzip::cuda::available()) {
    std::printf("gradzip GPU tests: no CUDA device, skipping (exit %d)\n", gztest::kSkipExitCode);
    return gztest::kSkipExitCode;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
