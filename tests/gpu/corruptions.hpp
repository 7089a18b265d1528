// Corrupted variants of a valid wire message: every header field, the buffer length, padding,
// sign tail bits, top-k indices, and random bit flips. Shared by the GPU test (device vs host
// verdicts) and the host emulation test (parallel vs sequential top-k index checks).
#pragma once

#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gradzip/gradzip.hpp"

namespace gztest {

using WireBytes = std::vector<std::byte>;

template <class T>
void poke(WireBytes& w, size_t off, T v) {
  std::memcpy(w.data() + off, &v, sizeof v);
}
template <class T>
T peek(const WireBytes& w, size_t off) {
  T v;
  std::memcpy(&v, w.data() + off, sizeof v);
  return v;
}

// `good` is codec's valid encoding of n elements. Names of the random flips start with "random".
inline std::vector<std::pair<std::string, WireBytes>> corruptions(const gradzip::Codec& codec, size_t n,
                                                                  const WireBytes& good) {
  std::vector<std::pair<std::string, WireBytes>> cases;
  auto add = [&](const std::string& what, auto&& mutate) {
    WireBytes w = good;
    mutate(w);
    cases.emplace_back(what + " n=" + std::to_string(n), std::move(w));
  };
  add("valid", [](WireBytes&) {});
  add("magic", [](WireBytes& w) { w[0] ^= std::byte{1}; });
  add("version", [](WireBytes& w) { poke<uint16_t>(w, 4, gradzip::kWireVersion + 1); });
  for (uint8_t c = 0; c <= 6; ++c)
    add("codec " + std::to_string(c), [c](WireBytes& w) { w[6] = std::byte{c}; });
  add("dtype", [](WireBytes& w) { w[7] = std::byte{1}; });
  add("count+1", [](WireBytes& w) { poke<uint64_t>(w, 8, peek<uint64_t>(w, 8) + 1); });
  add("count huge", [](WireBytes& w) { poke<uint64_t>(w, 8, uint64_t{1} << 50); });
  add("count 2^32", [](WireBytes& w) { poke<uint64_t>(w, 8, uint64_t{1} << 32); });
  for (uint32_t p : {0u, 1u, 33u, 64u, 65568u, 0xFFFFFFFFu})
    add("param " + std::to_string(p), [p](WireBytes& w) { poke<uint32_t>(w, 16, p); });
  add("param+1", [](WireBytes& w) { poke<uint32_t>(w, 16, peek<uint32_t>(w, 16) + 1); });
  for (uint32_t f : {1u, 2u, 0x80000000u})
    add("flags " + std::to_string(f), [f](WireBytes& w) { poke<uint32_t>(w, 20, f); });
  add("payload_bytes+1", [](WireBytes& w) { poke<uint64_t>(w, 24, peek<uint64_t>(w, 24) + 1); });
  add("payload_bytes-1", [](WireBytes& w) { poke<uint64_t>(w, 24, peek<uint64_t>(w, 24) - 1); });
  add("truncated", [](WireBytes& w) { w.pop_back(); });
  add("trailing byte", [](WireBytes& w) { w.push_back(std::byte{0}); });
  add("header only", [](WireBytes& w) { w.resize(32); });
  add("short header", [](WireBytes& w) { w.resize(31); });

  const auto h = peek<gradzip::WireHeader>(good, 0);
  const auto kind = codec.kind();
  const auto l = gradzip::payload_layout(kind, n, h.param, h.flags);
  if ((kind == gradzip::CodecKind::int8 || kind == gradzip::CodecKind::sign) && n > 0) {
    const size_t nb = (n + h.param - 1) / h.param;
    if (4 * nb < l.section1)
      add("padding", [&](WireBytes& w) { w[32 + l.section1 - 1] = std::byte{1}; });
    if (kind == gradzip::CodecKind::sign && n % 32 != 0)
      add("sign tail bit", [&](WireBytes& w) { w[32 + l.bytes - 1] |= std::byte{0x80}; });
  }
  if (kind == gradzip::CodecKind::topk && h.param >= 2) {
    // n < 65536 here: one chunk end, then the u16 offsets (padded to 16 bytes), then the values
    const size_t k = h.param;
    const size_t at = 32 + l.section1;  // the first offset
    const auto nn = static_cast<uint16_t>(n);
    add("offset[0]=n", [=](WireBytes& w) { poke<uint16_t>(w, at, nn); });
    add("offset[k-1]=n", [=](WireBytes& w) { poke<uint16_t>(w, at + 2 * (k - 1), nn); });
    add("offset[k-1]=~0", [=](WireBytes& w) { poke<uint16_t>(w, at + 2 * (k - 1), 0xFFFFu); });
    add("duplicate", [=](WireBytes& w) { poke<uint16_t>(w, at + 2, peek<uint16_t>(w, at)); });
    add("swapped", [=](WireBytes& w) {
      const auto a = peek<uint16_t>(w, at), b = peek<uint16_t>(w, at + 2);
      poke<uint16_t>(w, at, b);
      poke<uint16_t>(w, at + 2, a);
    });
    add("chunk end k-1", [=](WireBytes& w) { poke<uint32_t>(w, 32, static_cast<uint32_t>(k - 1)); });
    add("end padding", [](WireBytes& w) { w[36] = std::byte{1}; });
  }
  std::mt19937_64 rng(42 + n);
  for (int t = 0; t < 150; ++t) {
    add("random flip " + std::to_string(t), [&](WireBytes& w) {
      const size_t pos = (t % 2 == 0 || w.size() <= 32) ? rng() % 32 : 32 + rng() % (w.size() - 32);
      w[pos] ^= std::byte{static_cast<uint8_t>(1u << (rng() % 8))};
    });
  }
  return cases;
}

}  // namespace gztest
