// Fuzz target: gradzip::decode_add on arbitrary bytes, every codec.
// Properties, beyond "no crash, no sanitizer report, no hang":
//   * decode_add accepts exactly the wires decode accepts, with the same error status;
//   * on error the sum is untouched (a half-added bucket would corrupt a gradient silently);
//   * on success sum[i] == old[i] + decode(wire)[i] for every i (a zero may change sign);
//   * the sum does not depend on the CPU's instruction set.
#include "fuzz_support.hpp"

using namespace gzfuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const uint64_t n = output_count(data, size);
  auto decoded = exact<float>(n);
  const Outcome rd = call([&] { gradzip::decode(data, size, decoded.get(), n); });

  auto sum = exact<float>(n);
  for (uint64_t i = 0; i < n; ++i) sum[i] = pattern(i);
  const Outcome ra = call([&] { gradzip::decode_add(data, size, sum.get(), n); });
  GZ_FUZZ_CHECK(ra == rd);
  for_each_other_isa([&] {
    auto again = exact<float>(n);
    for (uint64_t i = 0; i < n; ++i) again[i] = pattern(i);
    GZ_FUZZ_CHECK(call([&] { gradzip::decode_add(data, size, again.get(), n); }) == ra);
    for (uint64_t i = 0; i < n; ++i) GZ_FUZZ_CHECK(same_bits(again[i], sum[i]));
  });
  for (uint64_t i = 0; i < n; ++i) {
    if (ra.ok)
      GZ_FUZZ_CHECK(same_value(sum[i], pattern(i) + decoded[i]));
    else
      GZ_FUZZ_CHECK(same_bits(sum[i], pattern(i)));
  }
  return 0;
}
