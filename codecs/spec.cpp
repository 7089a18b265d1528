// Codec spec parsing, canonical names and size queries.
#include <charconv>
#include <cmath>
#include <string>
#include <vector>

#include "gradzip/gradzip.hpp"
#include "detail.hpp"
#include "topk_plan.hpp"

#ifdef GRADZIP_HAS_CUDA
#include "cuda/workspace.hpp"
#endif

namespace gradzip {

const char* status_name(Status s) {
  switch (s) {
    case Status::ok: return "ok";
    case Status::invalid_spec: return "invalid_spec";
    case Status::invalid_argument: return "invalid_argument";
    case Status::corrupt_payload: return "corrupt_payload";
    case Status::size_mismatch: return "size_mismatch";
    case Status::cuda_error: return "cuda_error";
  }
  return "unknown";
}

namespace {

[[noreturn]] void bad_spec(std::string_view spec, const std::string& why) {
  throw Error(Status::invalid_spec,
              "gradzip: bad codec spec '" + std::string(spec) + "': " + why);
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  for (;;) {
    const size_t pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string_view::npos ? pos : pos - start));
    if (pos == std::string_view::npos) return parts;
    start = pos + 1;
  }
}

uint32_t parse_block(std::string_view spec, std::string_view value) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || ec != std::errc() || end != value.data() + value.size())
    bad_spec(spec, "block='" + std::string(value) + "' is not an unsigned integer");
  if (!valid_block(v))
    bad_spec(spec, "block=" + std::string(value) + " must be a multiple of 32 in [32, 65536]");
  return static_cast<uint32_t>(v);
}

// ---- the spec rules of each codec family ------------------------------------------------------
// A spec is the codec's name, then its leading parts (top-k's ratio), then key=value options; a
// family takes at most one option. rules_for(codec) picks the family's rules and visit(kind, f)
// the codec, so the list of codecs is visit's alone. Each family reads its parts and its option
// (defaults first), checks its parameters, writes its canonical name and gives the header's param.

// fp32 / fp16 / bf16: no parameters.
struct CastRules {
  static constexpr std::string_view option{};
  static size_t read_leading(std::string_view, const std::vector<std::string_view>&, CodecSpec&) {
    return 1;
  }
  static void read_option(std::string_view, std::string_view, CodecSpec&) {}
  static void check(std::string_view spec, const CodecSpec& s) {
    if (s.block != 0 || s.ratio != 0.0 || s.values != TopkValues::f32) bad_spec(spec, "casts take no parameters");
  }
  template <class C>
  static std::string name(C, const CodecSpec&) { return C::spec_name; }
  static uint32_t param(const Codec&, uint64_t) { return 0; }
};

// int8 / sign: block=N, with the codec's default.
template <class C>
struct BlockwiseRules {
  static constexpr std::string_view option = "block";
  static size_t read_leading(std::string_view, const std::vector<std::string_view>&, CodecSpec& s) {
    s.block = C::default_block;
    return 1;
  }
  static void read_option(std::string_view spec, std::string_view value, CodecSpec& s) {
    s.block = parse_block(spec, value);
  }
  static void check(std::string_view spec, const CodecSpec& s) {
    if (!valid_block(s.block))
      bad_spec(spec, "block=" + std::to_string(s.block) + " must be a multiple of 32 in [32, 65536]");
    if (s.ratio != 0.0 || s.values != TopkValues::f32) bad_spec(spec, "only block= applies to int8/sign");
  }
  static std::string name(C, const CodecSpec& s) {
    return std::string(C::spec_name) + ":block=" + std::to_string(s.block);
  }
  static uint32_t param(const Codec& c, uint64_t) { return c.spec().block; }
};

// topk:RATIO, then values=fp32|fp16|int8.
struct TopkRules {
  static constexpr std::string_view option = "values";
  static size_t read_leading(std::string_view spec, const std::vector<std::string_view>& parts,
                             CodecSpec& s) {
    if (parts.size() < 2 || parts[1].empty()) bad_spec(spec, "topk needs a ratio, e.g. topk:0.01");
    const std::string_view r = parts[1];
    const auto [end, ec] = std::from_chars(r.data(), r.data() + r.size(), s.ratio);
    if (ec != std::errc() || end != r.data() + r.size())
      bad_spec(spec, "ratio '" + std::string(r) + "' is not a number");
    if (!(s.ratio > 0.0 && s.ratio <= 1.0))
      bad_spec(spec, "ratio " + std::string(r) + " must be in (0, 1]");
    return 2;
  }
  static void read_option(std::string_view spec, std::string_view value, CodecSpec& s) {
    if (value == "fp16") s.values = TopkValues::fp16;
    else if (value == "int8") s.values = TopkValues::int8;
    else if (value == "fp32") s.values = TopkValues::f32;
    else bad_spec(spec, "values='" + std::string(value) + "' must be fp32, fp16 or int8");
  }
  static void check(std::string_view spec, const CodecSpec& s) {
    if (!(s.ratio > 0.0 && s.ratio <= 1.0))
      bad_spec(spec, "top-k ratio " + std::to_string(s.ratio) + " must be in (0, 1]");
    if (s.block != 0) bad_spec(spec, "top-k takes no block");
    if (s.values != TopkValues::f32 && s.values != TopkValues::fp16 && s.values != TopkValues::int8)
      bad_spec(spec, "unknown top-k value type " + std::to_string(static_cast<int>(s.values)));
  }
  static std::string name(TopkCodec, const CodecSpec& s) {
    char buf[64];
    const auto res = std::to_chars(buf, buf + sizeof buf, s.ratio);  // shortest round-trip
    std::string out = std::string(TopkCodec::spec_name) + ":" + std::string(buf, res.ptr);
    if (s.values == TopkValues::fp16) out += ":values=fp16";
    if (s.values == TopkValues::int8) out += ":values=int8";
    return out;
  }
  static uint32_t param(const Codec& c, uint64_t n) {
    if (n > kTopkMaxCount)
      throw Error(Status::invalid_argument,
                  "gradzip: top-k supports at most 2^32 - 1 elements (32-bit indices), got " +
                      std::to_string(n));
    return static_cast<uint32_t>(c.topk_k(n));
  }
};

template <class Self, CodecKind Kind, class Wire, DType D>
CastRules rules_for(CastCodec<Self, Kind, Wire, D>) { return {}; }
BlockwiseRules<Int8Codec> rules_for(Int8Codec) { return {}; }
BlockwiseRules<SignCodec> rules_for(SignCodec) { return {}; }
TopkRules rules_for(TopkCodec) { return {}; }

// f(codec, its family's rules) for a known kind.
template <class F>
decltype(auto) with_rules(CodecKind kind, F&& f) {
  return visit(kind, [&](auto c) -> decltype(auto) { return f(c, rules_for(c)); });
}

const char* spec_name(CodecKind kind) {
  return visit(kind, [](auto c) { return decltype(c)::spec_name; });
}

// Every codec's name in enum order; the kinds are numbered from 0 up to the last known one.
std::vector<std::string_view> spec_names() {
  std::vector<std::string_view> names;
  for (uint8_t k = 0; known_codec(static_cast<CodecKind>(k)); ++k)
    names.push_back(spec_name(static_cast<CodecKind>(k)));
  return names;
}

// The kind whose spec name is `name`; throws with the list of names when there is none.
CodecKind kind_named(std::string_view spec, std::string_view name) {
  const std::vector<std::string_view> names = spec_names();
  std::string expected;  // "fp32, fp16, ... or topk"
  for (size_t k = 0; k < names.size(); ++k) {
    if (names[k] == name) return static_cast<CodecKind>(k);
    expected += k == 0 ? "" : k + 1 < names.size() ? ", " : " or ";
    expected += names[k];
  }
  bad_spec(spec, "unknown codec '" + std::string(name) + "' (expected " + expected + ")");
}

void validate(std::string_view spec, const CodecSpec& s) {
  if (!known_codec(s.kind))
    bad_spec(spec, "unknown codec kind " + std::to_string(static_cast<int>(s.kind)));
  with_rules(s.kind, [&](auto, auto rules) { rules.check(spec, s); });
}

}  // namespace

Codec::Codec(const CodecSpec& spec) : spec_(spec) { validate("<CodecSpec>", spec_); }

Codec Codec::parse(std::string_view spec) {
  const std::vector<std::string_view> parts = split(spec, ':');
  const std::string_view name = parts[0];
  CodecSpec s;
  s.kind = kind_named(spec, name);
  const size_t first_option = with_rules(s.kind, [&](auto, auto rules) {
    return rules.read_leading(spec, parts, s);
  });
  const std::string_view option = with_rules(s.kind, [](auto, auto rules) { return rules.option; });
  bool seen_option = false;
  for (size_t i = first_option; i < parts.size(); ++i) {
    const std::string_view opt = parts[i];
    const size_t eq = opt.find('=');
    if (opt.empty()) bad_spec(spec, "empty option (stray ':')");
    if (eq == std::string_view::npos)
      bad_spec(spec, "option '" + std::string(opt) + "' is not key=value");
    const std::string_view key = opt.substr(0, eq), value = opt.substr(eq + 1);
    if (option.empty() || key != option)
      bad_spec(spec, "unknown option '" + std::string(key) + "' for " + std::string(name));
    if (seen_option) bad_spec(spec, "duplicate option '" + std::string(key) + "'");
    seen_option = true;
    with_rules(s.kind, [&](auto, auto rules) { rules.read_option(spec, value, s); });
  }
  return Codec(s);
}

std::string Codec::name() const {
  return with_rules(spec_.kind, [&](auto c, auto rules) { return rules.name(c, spec_); });
}

bool Codec::operator==(const Codec& o) const noexcept {
  return spec_.kind == o.spec_.kind && spec_.block == o.spec_.block &&
         spec_.ratio == o.spec_.ratio && spec_.values == o.spec_.values;
}

uint64_t Codec::topk_k(uint64_t n) const {
  if (n == 0) return 0;
  const double want = std::ceil(spec_.ratio * static_cast<double>(n));
  const uint64_t k = want < 1.0 ? 1 : static_cast<uint64_t>(want);
  return k < n ? k : n;
}

WireHeader Codec::wire_header(uint64_t n) const {
  WireHeader h{};
  h.magic = kWireMagic;
  h.version = kWireVersion;
  h.codec = static_cast<uint8_t>(spec_.kind);
  h.dtype = static_cast<uint8_t>(DType::f32);
  h.count = n;
  h.param = wire_param(n);
  h.flags = wire_flags();
  h.payload_bytes = payload_layout(h).bytes;
  return h;
}

uint32_t Codec::wire_param(uint64_t n) const {
  return with_rules(spec_.kind, [&](auto, auto rules) { return rules.param(*this, n); });
}

uint32_t Codec::wire_flags() const noexcept {
  return topk_flags(spec_.values);  // only top-k's rules accept values other than f32
}

size_t Codec::encoded_bytes(size_t n) const {
  if (n > kMaxCount)
    throw Error(Status::invalid_argument, "gradzip: element count " + std::to_string(n) + " too large");
  return message_bytes(spec_.kind, n, wire_param(n), wire_flags());
}

size_t Codec::workspace_bytes(size_t n) const {
  const uint32_t param = wire_param(n);  // range-checks n
  size_t bytes =
      visit(spec_.kind, [&](auto c) { return detail::encode_workspace_bytes(c, n, param); });
#ifdef GRADZIP_HAS_CUDA
  // one number for both backends: the caller may hand the same buffer size to either
  const size_t cuda = detail::cuda_workspace_bytes(spec_, n);
  if (cuda > bytes) bytes = cuda;
#endif
  return bytes;
}

}  // namespace gradzip
