// Host-side checks of what the CUDA path relies on, with no GPU (they run in CI):
//  * decode.cu checks the top-k indices in parallel and keeps the smallest fault (atomicMin on
//    check_index's detail); gradzip/wire.hpp's check_message, which every host decode runs, stops
//    at the first fault in index order. The shared check_index makes the two the same fault;
//  * the radix digits of the shared top-k key (codec/topk.hpp), which the CPU select and
//    kernels/topk.cu both use, cover the key exactly once;
//  * Codec::workspace_bytes covers the workspace layout kernels/topk.cu carves (topk_workspace.hpp,
//    one size query for both backends).
// The GPU's verdicts and bytes are compared with the CPU's on a device, in test_gpu_codecs.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "corruptions.hpp"
#include "gradzip/element.hpp"
#include "gradzip/gradzip.hpp"
#include "gradzip/wire.hpp"
#include "test_util.hpp"  // tests/cpu
#include "topk_workspace.hpp"  // kernels/

namespace {

namespace el = gradzip::element;
using gztest::Bytes;
using gradzip::WireCheck;
using gradzip::WireStatus;

const char* const kSpecs[] = {"fp32", "fp16", "bf16", "int8", "int8:block=32", "sign",
                              "sign:block=4096", "topk:0.01", "topk:0.1:values=fp16", "topk:0.1:values=int8",
                              "topk:1"};

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
          const WireCheck r = gradzip::check_index(h, payload, j);
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
// kernels/topk.cu carves its workspace with topk_workspace(n): the selection state, three radix
// histograms, a u64 count and a u64 prefix per kTopkTile-element tile, a u32 candidate per element.
// Each region must hold what the kernels put there, none may overlap the next, and the size query
// every caller allocates by (Codec::workspace_bytes) must cover the last: a smaller one would let
// the GPU encoder write past the caller's buffer.
TEST(Emulation, WorkspaceBytesCoverTheCudaEncoders) {
  namespace k = gradzip::kernels;
  for (const char* spec : kSpecs) {
    const auto codec = gradzip::Codec::parse(spec);
    const bool topk = codec.kind() == gradzip::CodecKind::topk;
    for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{4096}, size_t{4097}, size_t{1} << 20,
                     size_t{100000007}}) {
      if (!topk) {
        EXPECT_EQ(codec.workspace_bytes(n), 0u) << spec << " n=" << n;  // the other encoders use none
        continue;
      }
      const k::TopkWorkspace w = k::topk_workspace(n);
      const size_t tiles_needed = std::max<size_t>(1, (n + k::kTopkTile - 1) / k::kTopkTile);
      EXPECT_GE(w.tiles, tiles_needed) << spec << " n=" << n;
      EXPECT_GE(w.histograms, k::kTopkStateBytes) << spec << " n=" << n;
      EXPECT_GE(w.counts - w.histograms, 3 * sizeof(uint32_t) * el::kTopkRadix) << " n=" << n;
      EXPECT_GE(w.prefixes - w.counts, sizeof(uint64_t) * tiles_needed) << " n=" << n;
      EXPECT_GE(w.candidates - w.prefixes, sizeof(uint64_t) * tiles_needed) << " n=" << n;
      EXPECT_GE(w.bytes - w.candidates, sizeof(uint32_t) * n) << " n=" << n;
      for (size_t offset : {w.histograms, w.counts, w.prefixes, w.candidates})
        EXPECT_EQ(offset % 8, 0u) << "a region the kernels read as u32/u64 is misaligned, n=" << n;
      EXPECT_GE(codec.workspace_bytes(n), w.bytes) << spec << " n=" << n;
    }
  }
}

}  // namespace
