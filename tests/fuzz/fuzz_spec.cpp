// Fuzz target: the codec spec parser, Codec::parse on arbitrary strings, and the Codec(CodecSpec)
// constructor on arbitrary field values (the same bytes read as kind, block, ratio, fp16 flag).
// Properties, beyond "no crash, no sanitizer report, no hang":
//   * a rejected spec throws gradzip::Error(invalid_spec);
//   * an accepted one has in-range parameters (grammar in gradzip.hpp), and its canonical name
//     round-trips: parse(name()) == codec and parse(name()).name() == name();
//   * the size queries agree with wire.hpp's payload_layout and top-k's k is in [1, n].
#include <cmath>
#include <string>
#include <string_view>

#include "fuzz_support.hpp"

using namespace gzfuzz;
using gradzip::Codec;
using gradzip::CodecKind;

namespace {

void check_valid(const Codec& c) {
  const gradzip::CodecSpec& s = c.spec();
  switch (s.kind) {
    case CodecKind::fp32:
    case CodecKind::fp16:
    case CodecKind::bf16: break;
    case CodecKind::int8:
    case CodecKind::sign:
      GZ_FUZZ_CHECK(s.block % 32 == 0 && s.block >= gradzip::kMinBlock &&
                    s.block <= gradzip::kMaxBlock);
      break;
    case CodecKind::topk: GZ_FUZZ_CHECK(std::isfinite(s.ratio) && s.ratio > 0 && s.ratio <= 1); break;
    default: GZ_FUZZ_CHECK(!"accepted codec kind out of range");
  }

  const std::string name = c.name();
  GZ_FUZZ_CHECK(!name.empty());
  Codec again = c;
  GZ_FUZZ_CHECK(call([&] { again = Codec::parse(name); }).ok);
  GZ_FUZZ_CHECK(again == c);
  GZ_FUZZ_CHECK(again.name() == name);
  GZ_FUZZ_CHECK(call([&] { again = Codec(c.spec()); }).ok);
  GZ_FUZZ_CHECK(again == c);

  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{31}, uint64_t{1000}, uint64_t{1} << 20}) {
    const uint32_t param = c.wire_param(n);
    if (s.kind == CodecKind::topk) {
      const uint64_t k = c.topk_k(n);
      GZ_FUZZ_CHECK(param == k);
      if (n == 0) {
        GZ_FUZZ_CHECK(k == 0);
      } else {
        // min(n, max(1, ceil(ratio * n))), allowing one step for how the product is rounded.
        const double want = std::ceil(s.ratio * static_cast<double>(n));
        GZ_FUZZ_CHECK(k >= 1 && k <= n);
        GZ_FUZZ_CHECK(static_cast<double>(k) >= std::min<double>(n, std::max(1.0, want - 1)));
        GZ_FUZZ_CHECK(static_cast<double>(k) <= std::max(1.0, want + 1));
      }
    } else if (s.kind == CodecKind::int8 || s.kind == CodecKind::sign) {
      GZ_FUZZ_CHECK(param == s.block);
    }
    const auto layout = gradzip::payload_layout(s.kind, n, param, c.wire_flags());
    GZ_FUZZ_CHECK(c.encoded_bytes(n) == gradzip::kHeaderBytes + layout.bytes);
  }
}

void check_outcome(const Outcome& r) {
  if (!r.ok) GZ_FUZZ_CHECK(r.status == gradzip::Status::invalid_spec);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::optional<Codec> parsed;
  const Outcome r = call([&] { parsed.emplace(Codec::parse(text)); });
  check_outcome(r);
  if (r.ok) check_valid(*parsed);

  // The same bytes as raw spec fields: kind, block, ratio, fp16 flag.
  if (size >= 14) {
    gradzip::CodecSpec s;
    s.kind = static_cast<CodecKind>(data[0]);
    s.block = load<uint32_t>(data + 1);
    s.ratio = load<double>(data + 5);
    s.values = static_cast<gradzip::TopkValues>(data[13] & 3);  // 3: not a value type
    std::optional<Codec> built;
    const Outcome rb = call([&] { built.emplace(s); });
    check_outcome(rb);
    if (rb.ok) check_valid(*built);
  }
  return 0;
}
