// Fuzz target: gradzip::decode on arbitrary bytes, every codec (the codec is a header byte).
// Properties, beyond "no crash, no sanitizer report, no hang":
//   * only gradzip::Error escapes, with a status that fits (corrupt payload or size mismatch);
//   * on error the output is untouched (the API validates before writing);
//   * on success the wire passes the independent validator and read_header agrees with it;
//   * a wire that is not 4-byte aligned is refused (invalid_argument) without touching the
//     output; at any 4-byte aligned address the result is the same;
//   * the result does not depend on the CPU's instruction set.
// GRADZIP_FUZZ_WIRE_SHIFT=k (default 1) sets the shift tried; 0 skips that check.
#include <cstdlib>
#include <cstring>

#include "fuzz_support.hpp"

using namespace gzfuzz;

namespace {

const size_t kShift = [] {
  const char* env = std::getenv("GRADZIP_FUZZ_WIRE_SHIFT");
  return env ? static_cast<size_t>(std::strtoul(env, nullptr, 10)) : size_t{1};
}();

struct Decoded {
  Outcome outcome;
  std::unique_ptr<float[]> out;
};

Decoded decode(const uint8_t* wire, size_t size, uint64_t n) {
  Decoded d{{}, exact<float>(n)};
  for (uint64_t i = 0; i < n; ++i) d.out[i] = pattern(i);
  d.outcome = call([&] { gradzip::decode(wire, size, d.out.get(), n); });
  return d;
}

void check_same(const Decoded& a, const Decoded& b, uint64_t n) {
  GZ_FUZZ_CHECK(a.outcome == b.outcome);
  for (uint64_t i = 0; i < n; ++i) GZ_FUZZ_CHECK(same_bits(a.out[i], b.out[i]));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const uint64_t n = output_count(data, size);
  const Decoded d = decode(data, size, n);
  if (!d.outcome.ok) {
    GZ_FUZZ_CHECK(d.outcome.status == gradzip::Status::corrupt_payload ||
                  d.outcome.status == gradzip::Status::size_mismatch);
    for (uint64_t i = 0; i < n; ++i) GZ_FUZZ_CHECK(same_bits(d.out[i], pattern(i)));
  } else {
    const auto ref = reference_validate(data, size);
    GZ_FUZZ_CHECK(ref.has_value());
    GZ_FUZZ_CHECK(ref->count == n);
    gradzip::WireHeader h{};
    GZ_FUZZ_CHECK(call([&] { h = gradzip::read_header(data, size); }).ok);
    GZ_FUZZ_CHECK(std::memcmp(&h, &*ref, sizeof h) == 0);
  }

  // Same bytes at a shifted address: refused when misaligned, else same outcome, same bits.
  if (kShift) {
    auto shifted = exact<uint8_t>(size + kShift);
    if (size) std::memcpy(shifted.get() + kShift, data, size);
    const Decoded s = decode(shifted.get() + kShift, size, n);
    if (kShift % 4 == 0) {
      check_same(d, s, n);
    } else {
      GZ_FUZZ_CHECK(!s.outcome.ok && s.outcome.status == gradzip::Status::invalid_argument);
      for (uint64_t i = 0; i < n; ++i) GZ_FUZZ_CHECK(same_bits(s.out[i], pattern(i)));
    }
  }
  // Same bytes, other CPU loop tables: same outcome, same bits.
  for_each_other_isa([&] { check_same(d, decode(data, size, n), n); });
  return 0;
}
