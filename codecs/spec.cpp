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

void validate(std::string_view spec, const CodecSpec& s) {
  switch (s.kind) {
    case CodecKind::fp32:
    case CodecKind::fp16:
    case CodecKind::bf16:
      if (s.block != 0 || s.ratio != 0.0 || s.fp16_values) bad_spec(spec, "casts take no parameters");
      return;
    case CodecKind::int8:
    case CodecKind::sign:
      if (!valid_block(s.block))
        bad_spec(spec, "block=" + std::to_string(s.block) + " must be a multiple of 32 in [32, 65536]");
      if (s.ratio != 0.0 || s.fp16_values) bad_spec(spec, "only block= applies to int8/sign");
      return;
    case CodecKind::topk:
      if (!(s.ratio > 0.0 && s.ratio <= 1.0))
        bad_spec(spec, "top-k ratio " + std::to_string(s.ratio) + " must be in (0, 1]");
      if (s.block != 0) bad_spec(spec, "top-k takes no block");
      return;
  }
  bad_spec(spec, "unknown codec kind " + std::to_string(static_cast<int>(s.kind)));
}

}  // namespace

Codec::Codec(const CodecSpec& spec) : spec_(spec) { validate("<CodecSpec>", spec_); }

Codec Codec::parse(std::string_view spec) {
  const std::vector<std::string_view> parts = split(spec, ':');
  const std::string_view name = parts[0];
  CodecSpec s;
  size_t first_option = 1;
  if (name == "fp32") s.kind = CodecKind::fp32;
  else if (name == "fp16") s.kind = CodecKind::fp16;
  else if (name == "bf16") s.kind = CodecKind::bf16;
  else if (name == "int8") { s.kind = CodecKind::int8; s.block = kDefaultInt8Block; }
  else if (name == "sign") { s.kind = CodecKind::sign; s.block = kDefaultSignBlock; }
  else if (name == "topk") {
    s.kind = CodecKind::topk;
    if (parts.size() < 2 || parts[1].empty()) bad_spec(spec, "topk needs a ratio, e.g. topk:0.01");
    const std::string_view r = parts[1];
    const auto [end, ec] = std::from_chars(r.data(), r.data() + r.size(), s.ratio);
    if (ec != std::errc() || end != r.data() + r.size())
      bad_spec(spec, "ratio '" + std::string(r) + "' is not a number");
    if (!(s.ratio > 0.0 && s.ratio <= 1.0))
      bad_spec(spec, "ratio " + std::string(r) + " must be in (0, 1]");
    first_option = 2;
  } else {
    bad_spec(spec, "unknown codec '" + std::string(name) +
                       "' (expected fp32, fp16, bf16, int8, sign or topk)");
  }
  bool seen_block = false, seen_values = false;
  for (size_t i = first_option; i < parts.size(); ++i) {
    const std::string_view opt = parts[i];
    const size_t eq = opt.find('=');
    if (opt.empty()) bad_spec(spec, "empty option (stray ':')");
    if (eq == std::string_view::npos)
      bad_spec(spec, "option '" + std::string(opt) + "' is not key=value");
    const std::string_view key = opt.substr(0, eq), value = opt.substr(eq + 1);
    if (key == "block" && (s.kind == CodecKind::int8 || s.kind == CodecKind::sign)) {
      if (seen_block) bad_spec(spec, "duplicate option 'block'");
      seen_block = true;
      s.block = parse_block(spec, value);
    } else if (key == "values" && s.kind == CodecKind::topk) {
      if (seen_values) bad_spec(spec, "duplicate option 'values'");
      seen_values = true;
      if (value == "fp16") s.fp16_values = true;
      else if (value == "fp32") s.fp16_values = false;
      else bad_spec(spec, "values='" + std::string(value) + "' must be fp32 or fp16");
    } else {
      bad_spec(spec, "unknown option '" + std::string(key) + "' for " + std::string(name));
    }
  }
  return Codec(s);
}

std::string Codec::name() const {
  switch (spec_.kind) {
    case CodecKind::fp32: return "fp32";
    case CodecKind::fp16: return "fp16";
    case CodecKind::bf16: return "bf16";
    case CodecKind::int8: return "int8:block=" + std::to_string(spec_.block);
    case CodecKind::sign: return "sign:block=" + std::to_string(spec_.block);
    case CodecKind::topk: {
      char buf[64];
      const auto res = std::to_chars(buf, buf + sizeof buf, spec_.ratio);  // shortest round-trip
      std::string out = "topk:" + std::string(buf, res.ptr);
      if (spec_.fp16_values) out += ":values=fp16";
      return out;
    }
  }
  return "?";
}

bool Codec::operator==(const Codec& o) const noexcept {
  return spec_.kind == o.spec_.kind && spec_.block == o.spec_.block &&
         spec_.ratio == o.spec_.ratio && spec_.fp16_values == o.spec_.fp16_values;
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
  h.flags = spec_.kind == CodecKind::topk && spec_.fp16_values ? kTopkFlagFp16Values : 0u;
  h.payload_bytes = payload_layout(h).bytes;
  return h;
}

uint32_t Codec::wire_param(uint64_t n) const {
  switch (spec_.kind) {
    case CodecKind::int8:
    case CodecKind::sign: return spec_.block;
    case CodecKind::topk: {
      if (n > kTopkMaxCount)
        throw Error(Status::invalid_argument,
                    "gradzip: top-k supports at most 2^32 - 1 elements (32-bit indices), got " +
                        std::to_string(n));
      return static_cast<uint32_t>(topk_k(n));
    }
    default: return 0;
  }
}

size_t Codec::encoded_bytes(size_t n) const {
  if (n > kMaxCount)
    throw Error(Status::invalid_argument, "gradzip: element count " + std::to_string(n) + " too large");
  return message_bytes(spec_.kind, n, wire_param(n), spec_.fp16_values);
}

size_t Codec::workspace_bytes(size_t n) const {
  if (spec_.kind != CodecKind::topk) return 0;
  wire_param(n);  // range check
  size_t bytes = detail::topk_workspace_bytes(n);
#ifdef GRADZIP_HAS_CUDA
  // one number for both backends: the caller may hand the same buffer size to either
  const size_t cuda = detail::cuda_workspace_bytes(spec_, n);
  if (cuda > bytes) bytes = cuda;
#endif
  return bytes;
}

}  // namespace gradzip
