// Shared helpers of the libFuzzer targets: calling the API and classifying its outcome, exact-size
// buffers (so AddressSanitizer sees any access one past the end), an independent wire validator,
// and a check that aborts with a message (libFuzzer then saves the input as a crash artifact).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>

#include "detail.hpp"  // codecs/: force_isa, the tests' switch of the CPU loop table
#include "gradzip/gradzip.hpp"

namespace gzfuzz {

// Largest output a target allocates. A top-k header may claim 2^64 elements with a tiny payload;
// such an input is decoded into a smaller buffer instead (and must then fail with size_mismatch).
constexpr uint64_t kMaxElements = uint64_t{1} << 17;  // still reaches the threaded paths

[[noreturn]] inline void fail(const char* what, const char* file, int line) {
  std::fprintf(stderr, "\n==FUZZ CHECK FAILED== %s:%d: %s\n", file, line, what);
  std::fflush(stderr);
  std::abort();
}
#define GZ_FUZZ_CHECK(cond)                                          \
  do {                                                               \
    if (!(cond)) ::gzfuzz::fail(#cond, __FILE__, __LINE__);          \
  } while (0)

// Calls f() under every other instruction set this CPU has (the CPU loop tables are one source
// compiled three times and must give the same bytes), then restores the default table.
template <class F>
void for_each_other_isa(F&& f) {
  const char* const def = gradzip::cpu_isa();
  for (const char* isa : {"portable", "avx2", "avx512"})
    if (std::strcmp(isa, def) != 0 && gradzip::detail::force_isa(isa)) f();
  gradzip::detail::force_isa(def);
}

// Outcome of one API call: success, or the Status of the gradzip::Error it threw. Any other
// exception escapes, and libFuzzer reports it as a crash: the API promises gradzip::Error only.
struct Outcome {
  bool ok = true;
  gradzip::Status status = gradzip::Status::ok;
  bool operator==(const Outcome&) const = default;
};

template <class F>
Outcome call(F&& f) {
  try {
    f();
    return {};
  } catch (const gradzip::Error& e) {
    GZ_FUZZ_CHECK(e.status() != gradzip::Status::ok);
    GZ_FUZZ_CHECK(e.what() != nullptr && e.what()[0] != '\0');  // errors carry a reason
    return {false, e.status()};
  }
}

// Heap buffer of exactly n elements (n == 0 gives a zero-byte allocation, not nullptr): any read
// or write past the end is an ASan report.
template <class T>
std::unique_ptr<T[]> exact(size_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

inline uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline bool same_bits(float a, float b) { return bits(a) == bits(b); }
// Equal as numbers, or both NaN (-0.0 == +0.0: adding a zero may flip a zero's sign).
inline bool same_value(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Element count a target decodes into for this wire: the header's count when it is small enough
// to allocate, else a small count that must then be rejected.
inline uint64_t output_count(const uint8_t* data, size_t size) {
  if (size < 16) return size;
  const uint64_t count = load<uint64_t>(data + 8);
  return count <= kMaxElements ? count : count % 61;
}

// The same test pattern every target starts an output buffer with: small values, zeros of both
// signs, so that decode_add and failure paths are visible.
inline float pattern(uint64_t i) {
  if (i % 11 == 3) return -0.0f;
  return static_cast<float>(static_cast<int64_t>(i % 7) - 3) * 0.25f;
}

// Independent validator, written from the documentation in gradzip/wire.hpp (not from the
// implementation): returns the header when the wire is well formed, nullopt otherwise.
// Overflow-safe: a count that makes the payload size wrap around 2^64 is rejected.
__extension__ typedef unsigned __int128 u128;  // wide enough that no size computation wraps

inline std::optional<gradzip::WireHeader> reference_validate(const uint8_t* data, size_t size) {
  using gradzip::CodecKind;
  if (size < gradzip::kHeaderBytes) return std::nullopt;
  gradzip::WireHeader h;
  std::memcpy(&h, data, sizeof h);
  if (h.magic != gradzip::kWireMagic || h.version != gradzip::kWireVersion) return std::nullopt;
  if (h.codec > static_cast<uint8_t>(CodecKind::topk)) return std::nullopt;
  if (h.dtype != static_cast<uint8_t>(gradzip::DType::f32)) return std::nullopt;
  if (h.payload_bytes != size - gradzip::kHeaderBytes) return std::nullopt;
  const auto kind = static_cast<CodecKind>(h.codec);
  const u128 n = h.count;
  u128 expect = 0;
  switch (kind) {
    case CodecKind::fp32: expect = 4 * n; break;
    case CodecKind::fp16:
    case CodecKind::bf16: expect = 2 * n; break;
    case CodecKind::int8:
    case CodecKind::sign: {
      if (h.param == 0) return std::nullopt;
      const u128 nb = (n + h.param - 1) / h.param;
      const u128 scales = (4 * nb + 15) / 16 * 16;
      expect = scales + (kind == CodecKind::int8 ? n : 4 * ((n + 31) / 32));
      break;
    }
    case CodecKind::topk: {
      // flags: 0 f32 values, 1 fp16, 2 int8 (then padding and an f32 scale per chunk)
      if (h.flags > 2) return std::nullopt;
      if (h.param > h.count) return std::nullopt;
      const u128 k = h.param, chunks = (n + 65535) / 65536;
      expect = (4 * chunks + 15) / 16 * 16 + (2 * k + 15) / 16 * 16;
      if (h.flags == 2) expect += (k + 15) / 16 * 16 + 4 * chunks;
      else expect += (h.flags == 1 ? 2 : 4) * k;
      break;
    }
  }
  if (kind != CodecKind::topk && h.flags != 0) return std::nullopt;
  if (expect != h.payload_bytes) return std::nullopt;
  if (kind == CodecKind::topk) {
    // chunk ends (kept elements up to the end of each 65536-element chunk) and zero padding, then
    // indices chunk * 65536 + offset, strictly increasing and < count
    const uint8_t* p = data + gradzip::kHeaderBytes;
    const uint64_t chunks = (h.count + 65535) / 65536;
    const uint64_t offsets = (4 * chunks + 15) / 16 * 16;
    const uint64_t values = offsets + (2 * uint64_t{h.param} + 15) / 16 * 16;
    for (uint64_t b = 4 * chunks; b < offsets; ++b) if (p[b] != 0) return std::nullopt;
    for (uint64_t b = offsets + 2 * uint64_t{h.param}; b < values; ++b)
      if (p[b] != 0) return std::nullopt;
    if (h.flags == 2)  // the int8 values' padding
      for (uint64_t b = values + h.param; b < values + (uint64_t{h.param} + 15) / 16 * 16; ++b)
        if (p[b] != 0) return std::nullopt;
    uint64_t j = 0, previous = 0;
    for (uint64_t c = 0; c < chunks; ++c) {
      const uint64_t end = load<uint32_t>(p + 4 * c);
      if (end < j || end > h.param || (c + 1 == chunks && end != h.param)) return std::nullopt;
      for (; j < end; ++j) {
        const uint64_t v = c * 65536 + load<uint16_t>(p + offsets + 2 * j);
        if (v >= h.count || (j > 0 && v <= previous)) return std::nullopt;
        previous = v;
      }
    }
  }
  return h;
}

}  // namespace gzfuzz
