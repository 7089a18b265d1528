// Host-side checks of what the CUDA path relies on, with no GPU (they run in CI):
//  * decode.cu checks the top-k indices in parallel and keeps the smallest fault (atomicMin on
//    check_index's detail); gradzip/wire.hpp's check_message, which every host decode runs, stops
//    at the first fault in index order. The shared check_index makes the two the same fault;
//  * the radix digits of the shared top-k key (codec/topk.hpp), which the CPU select and
//    kernels/topk.cu both use, cover the key exactly once;
//  * Codec::workspace_bytes covers the workspace layout of kernels/topk.cu (one size query for
//    both backends).
// The GPU's verdicts and bytes are compared with the CPU's on a device, in test_gpu_codecs.cpp.
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
using gradzip::WireCheck;
using gradzip::WireStatus;

const char* const kSpecs[] = {"fp32", "fp16", "bf16", "int8", "int8:block=32", "sign",
                              "sign:block=4096", "topk:0.01", "topk:0.1:values=fp16", "topk:1"};

TEST(Emulation, SmallestIndexFaultIsTheFirstInIndexOrder) {
  size_t faulty = 0;  // messages with a bad index: the comparison below must have run
  for (const char* spec : {"topk:0.01", "topk:0.1:values=fp16", "topk:1"}) {
    const auto codec = gradzip::Codec::parse(spec);
    for (size_t n : {size_t{2}, size_t{1003}}) {
      const Bytes good = gztest::encode(codec, gztest::random_grad(n, 7 + n));
      for (const auto& [what, w] : gztest::corruptions(codec, n, good)) {
        if (w.size() < gradzip::kHeaderBytes) continue;
        gradzip::WireHeader h;
        std::memcpy(&h, w.data(), sizeof h);
        const auto* payload = reinterpret_cast<const uint8_t*>(w.data()) + gradzip::kHeaderBytes;
        // decode.cu checks the indices only after the header and the payload passed
        if (gradzip::check_header(h, w.size()).status != WireStatus::ok ||
            gradzip::check_payload(h, payload).status != WireStatus::ok)
          continue;
        WireCheck smallest{WireStatus::ok, ~uint64_t{0}};
        for (uint64_t j = h.param; j-- > 0;) {  // any order: the minimum does not depend on it
          const WireCheck r = gradzip::check_index(payload, j, h.count);
          if (r.status != WireStatus::ok && r.detail <= smallest.detail) smallest = r;
        }
        const WireCheck first = gradzip::check_message(h, w.size(), payload);
        EXPECT_EQ(static_cast<int>(smallest.status), static_cast<int>(first.status))
            << spec << ": " << what;
        if (first.status == WireStatus::ok) continue;
        ++faulty;
        EXPECT_EQ(smallest.detail, first.detail) << spec << ": " << what;
      }
    }
  }
  EXPECT_GT(faulty, 0u);
}

// The select picks digit 0, then 1, then 2 of topk_key: each key bit must sit in exactly one
// digit, and each digit must index a histogram of kTopkRadix bins.
TEST(Emulation, TopkDigitsCoverTheKeyOnce) {
  uint32_t covered = 0;
  for (int d = 0; d < 3; ++d) {
    const uint64_t bits = uint64_t{el::kTopkDigitMask[d]} << el::kTopkDigitShift[d];
    EXPECT_EQ(covered & bits, 0u) << "digit " << d << " overlaps a more significant one";
    covered |= static_cast<uint32_t>(bits);
    EXPECT_LE(uint64_t{el::kTopkDigitMask[d]} + 1, uint64_t{el::kTopkRadix}) << "digit " << d;
    if (d > 0) {  // most significant first
      EXPECT_LT(el::kTopkDigitShift[d], el::kTopkDigitShift[d - 1]);
    }
  }
  const uint32_t key_bits = el::topk_key(el::bits_float(0xFFFFFFFFu));  // every bit a key can have
  EXPECT_EQ(key_bits & ~covered, 0u) << "key bits in no digit";
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
