// The CUDA batches against the host: gradzip::cuda::encode_batch writes the bytes and residuals of
// the host's encode_batch, decode_batch / decode_add_batch give its floats, and a corrupt message
// in the middle of a batch fails alone (its status word set, its output untouched), reported by
// check_decode_batch. Part of gradzip_gpu_tests (main() in test_gpu_codecs.cpp exits 77 without a
// GPU).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "batch_bucket.hpp"  // tests/cpu: the bucket of messages the host batch tests use
#include "cuda_buffer.hpp"
#include "gradzip/cuda.hpp"

namespace {

using gztest::Bucket;
using gztest::Bytes;
using gztest::DeviceBuffer;

constexpr float kPrescale = 1.0f / 3.0f;
constexpr size_t kStatus = gradzip::cuda::kDecodeWorkspaceBytes;

TEST(GpuBatch, EncodeAndDecodeMatchTheHost) {
  const Bucket& b = gztest::bucket();
  const std::vector<float> in = gztest::batch_input(b.n, 11);
  const std::vector<float> residual(b.n, 0.25f);

  // The host batch, the reference.
  Bytes wire(b.wire_bytes);
  std::vector<float> res = residual;
  auto items = b.encode_items(in.data(), res.data(), wire.data());
  const size_t ws_bytes = gradzip::batch_workspace_bytes(items.data(), items.size());
  std::vector<std::byte> ws(ws_bytes);
  gradzip::encode_batch(items.data(), items.size(), kPrescale, ws.data(), ws.size());
  std::vector<float> decoded(b.n, 1.0f);
  gradzip::decode_add_batch(b.decode_items(wire.data(), decoded.data()).data(), b.count());

  DeviceBuffer d_in(4 * b.n), d_res(4 * b.n), d_wire(b.wire_bytes), d_ws(ws_bytes),
      d_out(4 * b.n), d_status(kStatus * b.count());
  d_in.upload(in);
  d_res.upload(residual);
  d_wire.fill(0);
  d_out.upload(std::vector<float>(b.n, 1.0f));
  d_status.fill(0xff);
  const auto d_items =
      b.encode_items(d_in.as<float>(), d_res.as<float>(), d_wire.as<std::byte>());
  gradzip::cuda::encode_batch(d_items.data(), d_items.size(), nullptr, kPrescale, d_ws.get(),
                              ws_bytes);
  const auto d_decode = b.decode_items(d_wire.as<std::byte>(), d_out.as<float>());
  gradzip::cuda::decode_add_batch(d_decode.data(), d_decode.size(), nullptr, d_status.get(),
                                  d_status.bytes());
  gradzip::cuda::check_decode_batch(d_status.get(), b.count(), nullptr);

  EXPECT_TRUE(d_wire.download<std::byte>(b.wire_bytes) == wire);
  EXPECT_EQ(std::memcmp(d_res.download<float>(b.n).data(), res.data(), 4 * b.n), 0);
  EXPECT_EQ(std::memcmp(d_out.download<float>(b.n).data(), decoded.data(), 4 * b.n), 0);
}

TEST(GpuBatch, OneCorruptMessageFailsAlone) {
  const Bucket& b = gztest::bucket();
  const std::vector<float> in = gztest::batch_input(b.n, 12);
  Bytes wire(b.wire_bytes);
  auto items = b.encode_items(in.data(), nullptr, wire.data());
  std::vector<std::byte> ws(gradzip::batch_workspace_bytes(items.data(), items.size()));
  gradzip::encode_batch(items.data(), items.size(), kPrescale, ws.data(), ws.size());
  std::vector<float> want(b.n);
  gradzip::decode_batch(b.decode_items(wire.data(), want.data()).data(), b.count());

  wire[b.slots[3]] ^= std::byte{1};  // the magic
  constexpr float kPoison = -12345.0f;
  DeviceBuffer d_wire(b.wire_bytes), d_out(4 * b.n), d_status(kStatus * b.count());
  d_wire.upload(wire);
  d_out.upload(std::vector<float>(b.n, kPoison));
  const auto d_decode = b.decode_items(d_wire.as<std::byte>(), d_out.as<float>());
  gradzip::cuda::decode_batch(d_decode.data(), d_decode.size(), nullptr, d_status.get(),
                              d_status.bytes());
  try {
    gradzip::cuda::check_decode_batch(d_status.get(), b.count(), nullptr);
    FAIL() << "no error";
  } catch (const gradzip::Error& e) {
    EXPECT_EQ(e.status(), gradzip::Status::corrupt_payload);
    EXPECT_NE(std::string(e.what()).find("(message 3 of 10)"), std::string::npos) << e.what();
  }
  const auto words = d_status.download<uint64_t>(2 * b.count());
  const auto out = d_out.download<float>(b.n);
  for (size_t i = 0; i < b.count(); ++i) {
    EXPECT_EQ(words[2 * i] != 0, i == 3) << "message " << i;
    for (size_t j = b.offsets[i]; j < b.offsets[i] + b.sizes[i]; ++j)
      ASSERT_TRUE(gztest::same_bits(out[j], i == 3 ? kPoison : want[j])) << i << " " << j;
  }
}

TEST(GpuBatch, HostMemoryAndShortStatusAreRejected) {
  const Bucket& b = gztest::bucket();
  Bytes wire(b.wire_bytes);
  DeviceBuffer d_status(kStatus * b.count()), d_out(4 * b.n);
  const auto host_items = b.decode_items(wire.data(), d_out.as<float>());
  EXPECT_THROW(gradzip::cuda::decode_batch(host_items.data(), host_items.size(), nullptr,
                                           d_status.get(), d_status.bytes()),
               gradzip::Error);
  DeviceBuffer d_wire(b.wire_bytes);
  const auto items = b.decode_items(d_wire.as<std::byte>(), d_out.as<float>());
  EXPECT_THROW(gradzip::cuda::decode_batch(items.data(), items.size(), nullptr, d_status.get(),
                                           d_status.bytes() - kStatus),
               gradzip::Error);
}

}  // namespace
