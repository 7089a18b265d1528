// Writes the checked-in seed corpus: fuzz_corpus_gen OUT_DIR (normally tests/fuzz/corpus).
// Seeds are small valid inputs of every kind, so that the fuzzers start past the header checks:
//   decode, decode_add, read_header: one wire per codec (odd sizes, a partial last block, top-k
//                                    over several index chunks, one wire holding NaN, Inf, a
//                                    denormal and -0.0);
//   roundtrip:                       spec byte + flags byte + values, covering every spec and flag;
//   spec:                            valid and almost-valid spec strings.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gradzip/gradzip.hpp"

namespace fs = std::filesystem;

namespace {

void write(const fs::path& dir, const std::string& name, const void* data, size_t size) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary).write(static_cast<const char*>(data), size);
}

std::string file_name(std::string spec) {
  for (char& ch : spec)
    if (ch == ':' || ch == '=') ch = '_';
  return spec;
}

std::vector<float> values(size_t n, bool specials) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(0.7f * static_cast<float>(i) + 0.3f) * 0.01f;
  if (specials && n > 4) {
    v[1] = NAN;
    v[2] = -INFINITY;
    v[3] = 1e-40f;
    v[4] = -0.0f;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const fs::path out = argv[1];
  gradzip::set_num_threads(1);

  struct Seed {
    const char* spec;
    size_t n;
    bool specials;
  };
  const Seed seeds[] = {
      {"fp32", 13, true},       {"fp32", 0, false},         {"fp16", 29, false},
      {"bf16", 29, true},       {"int8:block=32", 70, false}, {"int8", 40, true},
      {"sign:block=32", 100, false}, {"sign", 37, true},     {"topk:0.1", 100, false},
      {"topk:0.2:values=fp16", 50, true}, {"topk:1", 3, false},
      {"topk:0.01", 65536 + 77, false},  // two index chunks, the second one partial
      {"topk:0.02:values=int8", 65536 + 300, true},  // a scale per chunk
  };
  for (const Seed& s : seeds) {
    const gradzip::Codec codec = gradzip::Codec::parse(s.spec);
    const std::vector<float> v = values(s.n, s.specials);
    std::vector<std::byte> wire(codec.encoded_bytes(s.n));
    std::vector<std::byte> ws(codec.workspace_bytes(s.n));
    codec.encode(v.data(), s.n, wire.data(), wire.size(), 1.0f, ws.data(), ws.size());
    const std::string name = file_name(codec.name()) + "_n" + std::to_string(s.n) +
                             (s.specials ? "_special" : "");
    for (const char* target : {"decode", "decode_add", "read_header"})
      write(out / target, name, wire.data(), wire.size());
    if (s.n == 100)  // a truncated wire, for the header checks
      write(out / "read_header", name + "_truncated", wire.data(), wire.size() - 3);
  }

  // Round trip: byte 0 = spec index, byte 1 = flags, then values (see fuzz_roundtrip.cpp).
  for (int spec = 0; spec < 18; ++spec) {  // one per entry of fuzz_roundtrip.cpp's kSpecs
    const uint8_t flags = static_cast<uint8_t>((spec * 5) & 31);
    std::vector<uint8_t> in = {static_cast<uint8_t>(spec), flags};
    if (flags & 2) {  // one byte per value from the table of edge cases
      for (int i = 0; i < 48; ++i) in.push_back(static_cast<uint8_t>(i * 7 + spec));
    } else {
      const std::vector<float> v = values(24, spec % 2 == 0);
      const auto* b = reinterpret_cast<const uint8_t*>(v.data());
      in.insert(in.end(), b, b + 4 * v.size());
    }
    write(out / "roundtrip", "spec" + std::to_string(spec) + "_flags" + std::to_string(flags),
          in.data(), in.size());
  }

  const char* specs[] = {"fp32", "fp16", "bf16", "int8", "int8:block=4096", "sign",
                         "sign:block=32", "topk:0.01", "topk:0.5:values=fp16", "topk:1:values=fp32",
                         "topk:1e-3", "int8:block=33", "topk:0", "sign:block=65568",
                         "topk:0.05:values=int8", "topk:0.1:values=fp8"};
  for (const char* s : specs) write(out / "spec", file_name(s), s, std::string(s).size());
  return 0;
}
