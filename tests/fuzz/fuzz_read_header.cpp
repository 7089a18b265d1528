// Fuzz target: gradzip::read_header on arbitrary bytes.
// Properties, beyond "no crash, no sanitizer report, no hang":
//   * it accepts only wires the independent validator (fuzz_support.hpp, written from wire.hpp)
//     accepts, returns exactly their header, and rejects with corrupt_payload otherwise;
//   * it agrees with decode: a header it accepts decodes (when the count is allocatable), a
//     header it rejects does not decode into any buffer.
#include <cstring>

#include "fuzz_support.hpp"

using namespace gzfuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gradzip::WireHeader h{};
  const Outcome r = call([&] { h = gradzip::read_header(data, size); });
  const uint64_t n = output_count(data, size);
  auto out = exact<float>(n);
  const Outcome rd = call([&] { gradzip::decode(data, size, out.get(), n); });
  if (r.ok) {
    const auto ref = reference_validate(data, size);
    GZ_FUZZ_CHECK(ref.has_value());
    GZ_FUZZ_CHECK(std::memcmp(&h, &*ref, sizeof h) == 0);
    GZ_FUZZ_CHECK(rd.ok == (h.count == n));
    if (!rd.ok) GZ_FUZZ_CHECK(rd.status == gradzip::Status::size_mismatch);
  } else {
    GZ_FUZZ_CHECK(r.status == gradzip::Status::corrupt_payload);
    GZ_FUZZ_CHECK(!rd.ok);
  }
  return 0;
}
