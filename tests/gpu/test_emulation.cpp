// Host-side checks of the CUDA path's logic that need no GPU (they run in CI):
//  * the CUDA path's sequence of checks (cuda.cpp's length check, decode.cu's check_header +
//    check_payload, check_index on every index, the element count last; gradzip/wire.hpp,
//    compiled here for the host) gives the host decode's verdict on every corruption of every codec;
//  * the top-k design of kernels/topk.cu (11/11/10-bit radix select, digit 0 over everything,
//    digits 1-2 over the candidate list, per-tile counts from the collect pass plus the
//    candidates, suffix-sum bin choice, exclusive tile prefixes, emit position
//    gt_before + min(eq_before, need)), replayed sequentially, gives the CPU's bytes and residuals;
//  * Codec::workspace_bytes covers what the CUDA encoders need (one size query for both backends).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "corruptions.hpp"
#include "cuda/workspace.hpp"  // codecs/
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

// ---- top-k: kernels/topk.cu replayed one element at a time ------------------------------------
constexpr size_t kTile = 4096;  // kernels/topk.cu kTile

struct Emulated {
  Bytes payload;
  std::vector<float> residual;
};

Emulated emulate_topk(const gradzip::Codec& codec, const std::vector<float>& grad,
                      const std::vector<float>* residual, float prescale) {
  const size_t n = grad.size();
  const auto k = static_cast<uint32_t>(codec.topk_k(n));
  const bool fp16 = codec.spec().fp16_values;
  std::vector<float> c(n);
  for (size_t i = 0; i < n; ++i)
    c[i] = residual ? el::ef_input(grad[i], prescale, (*residual)[i]) : grad[i] * prescale;

  // select<d>: the bin holding the remaining-th largest key, by suffix sums from the top.
  uint32_t prefix = 0, mask = 0, remaining = k;
  auto select = [&](int d, const std::vector<uint32_t>& hist) {
    uint32_t incl = 0;
    for (int b = el::kTopkRadix - 1; b >= 0; --b) {
      const uint32_t above = incl;
      incl += hist[b];
      if (above < remaining && incl >= remaining) {
        prefix |= static_cast<uint32_t>(b) << el::kTopkDigitShift[d];
        mask |= el::kTopkDigitMask[d] << el::kTopkDigitShift[d];
        remaining -= above;
        return;
      }
    }
    ADD_FAILURE() << "no bin holds the remaining-th key";
  };
  auto digit = [](uint32_t key, int d) { return (key >> el::kTopkDigitShift[d]) & el::kTopkDigitMask[d]; };

  // pass 1: hist0 over everything
  std::vector<uint32_t> hist0(el::kTopkRadix, 0);
  for (float x : c) ++hist0[digit(el::topk_key(x), 0)];
  select(0, hist0);

  // pass 2: collect: per tile the count of digit 0 above b0; candidates (digit 0 == b0) + hist1
  const size_t tiles = (n + kTile - 1) / kTile;
  std::vector<uint64_t> counts(tiles, 0);  // (#key > T) << 32 | #key == T, as the kernels pack it
  std::vector<uint32_t> cand, hist1(el::kTopkRadix, 0), hist2(el::kTopkRadix, 0);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = el::topk_key(c[i]);
    if ((key & mask) > prefix) counts[i / kTile] += uint64_t{1} << 32;
    if ((key & mask) == prefix) {
      cand.push_back(static_cast<uint32_t>(i));
      ++hist1[digit(key, 1)];
    }
  }
  select(1, hist1);
  for (uint32_t i : cand)  // candidate_hist
    if ((el::topk_key(c[i]) & mask) == prefix) ++hist2[digit(el::topk_key(c[i]), 2)];
  select(2, hist2);
  const uint32_t t = prefix, need = remaining;
  for (uint32_t i : cand) {  // candidate_count
    const uint32_t key = el::topk_key(c[i]);
    if (key >= t) counts[i / kTile] += key > t ? (uint64_t{1} << 32) : 1;
  }
  // scan_tiles
  std::vector<uint32_t> gt_prefix(tiles + 1, 0), eq_prefix(tiles + 1, 0);
  for (size_t tile = 0; tile < tiles; ++tile) {
    gt_prefix[tile + 1] = gt_prefix[tile] + static_cast<uint32_t>(counts[tile] >> 32);
    eq_prefix[tile + 1] = eq_prefix[tile] + static_cast<uint32_t>(counts[tile]);
  }

  // write
  Emulated e;
  e.payload.assign(gradzip::payload_layout(gradzip::CodecKind::topk, n, k, fp16).bytes, std::byte{0xEE});
  e.residual = residual ? *residual : std::vector<float>{};
  auto* idx = reinterpret_cast<uint32_t*>(e.payload.data());
  std::byte* values = e.payload.data() + 4 * size_t{k};
  size_t kept = 0;
  for (size_t tile = 0; tile < tiles; ++tile) {
    uint32_t g = gt_prefix[tile], q = eq_prefix[tile];
    for (size_t i = tile * kTile; i < std::min(n, (tile + 1) * kTile); ++i) {
      const uint32_t key = el::topk_key(c[i]);
      bool keep = false;
      uint32_t pos = 0;
      if (key > t) {
        keep = true;
        pos = g + std::min(q, need);
        ++g;
      } else if (key == t) {
        keep = q < need;
        pos = g + q;
        ++q;
      }
      float decoded = 0.0f;
      if (keep) {
        ++kept;
        idx[pos] = static_cast<uint32_t>(i);
        if (fp16) {
          const uint16_t h = el::float_to_fp16(c[i]);
          std::memcpy(values + 2 * size_t{pos}, &h, 2);
          decoded = el::fp16_to_float(h);
        } else {
          std::memcpy(values + 4 * size_t{pos}, &c[i], 4);
          decoded = c[i];
        }
      }
      if (residual) e.residual[i] = el::ef_residual(c[i], decoded, (*residual)[i]);
    }
  }
  EXPECT_EQ(kept, k) << "every payload slot is written exactly once";
  return e;
}

TEST(Emulation, TopkRadixSelectAndTileEmitMatchCpu) {
  const float prescale = 1.0f / 3.0f;
  for (const char* spec : {"topk:0.01", "topk:0.1:values=fp16", "topk:1", "topk:0.0001", "topk:0.5"}) {
    const auto codec = gradzip::Codec::parse(spec);
    for (size_t n : {size_t{1}, size_t{3}, size_t{4097}, size_t{12289}, size_t{300007}}) {
      for (int data = 0; data < 3; ++data) {
        SCOPED_TRACE(std::string(spec) + " n=" + std::to_string(n) + " data=" + std::to_string(data));
        std::vector<float> g = data == 1 ? gztest::tie_grad(n, n) : gztest::random_grad(n, n);
        if (data == 2)  // mostly zeros: the threshold is 0 and ties are cut by index
          for (size_t i = 0; i < n; ++i)
            if (i % 7 != 0) g[i] = 0.0f;
        // data 1 and 2 keep the residual at zero so that c has exact ties in magnitude
        const std::vector<float> r = data == 0 ? gztest::random_grad(n, n + 1, 0.01f) : std::vector<float>(n, 0.0f);
        const auto cpu = gztest::encode_ef(codec, g, r, prescale);
        const Emulated emu = emulate_topk(codec, g, &r, prescale);
        const Bytes cpu_payload(cpu.wire.begin() + gradzip::kHeaderBytes, cpu.wire.end());
        EXPECT_TRUE(cpu_payload == emu.payload) << "payload differs";
        EXPECT_EQ(0, std::memcmp(cpu.residual.data(), emu.residual.data(), 4 * n)) << "residual differs";
        const Bytes plain = gztest::encode(codec, g, prescale);
        const Emulated emu_plain = emulate_topk(codec, g, nullptr, prescale);
        EXPECT_TRUE(Bytes(plain.begin() + gradzip::kHeaderBytes, plain.end()) == emu_plain.payload);
      }
    }
  }
}

TEST(Emulation, WorkspaceBytesCoverTheCudaEncoders) {
  for (const char* spec : kSpecs) {
    const auto codec = gradzip::Codec::parse(spec);
    for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{4097}, size_t{1} << 20, size_t{100000007}})
      EXPECT_GE(codec.workspace_bytes(n), gradzip::detail::cuda_workspace_bytes(codec.spec(), n))
          << spec << " n=" << n;
  }
}

}  // namespace
