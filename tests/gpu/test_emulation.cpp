// Host-side checks of the CUDA path that need no GPU (they run in CI):
//  * the CUDA path's sequence of checks (cuda.cpp's length check, decode.cu's check_header +
//    check_payload, check_index on every index, the element count last; gradzip/wire.hpp,
//    compiled here for the host) gives the host decode's verdict on every corruption of every codec;
//  * Codec::workspace_bytes covers the workspace layout of kernels/topk.cu (one size query for
//    both backends).
// The GPU encoders' bytes are compared with the CPU's on a device, in test_gpu_codecs.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "corruptions.hpp"
#include "gradzip/element.hpp"
#include "gradzip/gradzip.hpp"
#include "gradzip/wire.hpp"
#include "test_util.hpp"  // tests/cpu

namespace {

namespace el = gradzip::element;
using gztest::Bytes;
using gradzip::Status;

const char* const kSpecs[] = {"fp32", "fp16", "bf16", "int8", "int8:block=32", "sign",
                              "sign:block=4096", "topk:0.01", "topk:0.1:values=fp16", "topk:1"};

// The verdict sequence of cuda.cpp + decode.cu: host length check, header and payload, every
// index (in any order: the device keeps the smallest fault), the element count last.
Status emulated_device_verdict(const Bytes& w, size_t n) {
  using gradzip::WireStatus;
  if (w.size() < gradzip::kHeaderBytes) return Status::corrupt_payload;
  gradzip::WireHeader h;
  std::memcpy(&h, w.data(), sizeof h);
  const auto* payload = reinterpret_cast<const uint8_t*>(w.data()) + gradzip::kHeaderBytes;
  gradzip::WireCheck r = gradzip::check_header(h, w.size());
  if (r.status == WireStatus::ok) r = gradzip::check_payload(h, payload);
  if (r.status != WireStatus::ok) return Status::corrupt_payload;
  if (h.codec == static_cast<uint8_t>(gradzip::CodecKind::topk)) {
    for (uint64_t j = h.param; j-- > 0;)
      if (gradzip::check_index(payload, j, h.count).status != WireStatus::ok)
        return Status::corrupt_payload;
  }
  return h.count == n ? Status::ok : Status::size_mismatch;
}

Status host_verdict(const Bytes& w, size_t n) {
  std::vector<float> out(n);
  try {
    gradzip::decode(w.data(), w.size(), out.data(), n);
  } catch (const gradzip::Error& e) {
    return e.status();
  }
  return Status::ok;
}

TEST(Emulation, DeviceValidationMatchesReadHeader) {
  for (const char* spec : kSpecs) {
    const auto codec = gradzip::Codec::parse(spec);
    for (size_t n : {size_t{0}, size_t{1}, size_t{1003}}) {
      const Bytes good = gztest::encode(codec, gztest::random_grad(n, 7 + n));
      for (const auto& [what, w] : gztest::corruptions(codec, n, good)) {
        for (size_t out_n : {n, n + 1}) {
          EXPECT_EQ(gradzip::status_name(emulated_device_verdict(w, out_n)),
                    std::string(gradzip::status_name(host_verdict(w, out_n))))
              << spec << ": " << what << " decoded into " << out_n;
        }
      }
    }
  }
}

// ---- top-k workspace --------------------------------------------------------------------------
constexpr size_t kTile = 4096;  // kernels/topk.cu kTile

// What kernels/topk.cu carves out of the workspace, from its documented layout: the selection
// state (64 B), the three radix histograms, a count and a prefix word (8 B each) per 4096-element
// tile (one tile at n = 0) and a 4-byte candidate slot per element. A smaller Codec::workspace_bytes
// would let the GPU encoder write past the caller's buffer.
size_t cuda_topk_need(size_t n) {
  const size_t tiles = n == 0 ? 1 : (n + kTile - 1) / kTile;
  return 64 + 3 * 4 * size_t{el::kTopkRadix} + 2 * 8 * tiles + 4 * n;
}

TEST(Emulation, WorkspaceBytesCoverTheCudaEncoders) {
  for (const char* spec : kSpecs) {
    const auto codec = gradzip::Codec::parse(spec);
    const bool topk = codec.kind() == gradzip::CodecKind::topk;
    for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{4096}, size_t{4097}, size_t{1} << 20,
                     size_t{100000007}}) {
      if (topk)
        EXPECT_GE(codec.workspace_bytes(n), cuda_topk_need(n)) << spec << " n=" << n;
      else
        EXPECT_EQ(codec.workspace_bytes(n), 0u) << spec << " n=" << n;  // the other encoders use none
    }
  }
}

}  // namespace
