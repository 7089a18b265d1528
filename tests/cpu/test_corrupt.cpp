// Corrupt and mismatched messages: every case is a gradzip::Error with the right Status, and the
// output is not touched.
#include <gtest/gtest.h>

#include <functional>

#include "test_util.hpp"

using gradzip::Codec;
using gradzip::Status;
using namespace gztest;

namespace {

constexpr size_t kN = 1000;

Bytes valid(const char* spec) { return encode(Codec::parse(spec), random_grad(kN, 42)); }

gradzip::WireHeader header_of(const Bytes& w) {
  gradzip::WireHeader h;
  std::memcpy(&h, w.data(), sizeof h);
  return h;
}
void set_header(Bytes& w, const gradzip::WireHeader& h) { std::memcpy(w.data(), &h, sizeof h); }

// Top-k's sections of a kN-element message (test_util.hpp reads the layout from the docs).
uint32_t* topk_ends(Bytes& w) {
  return reinterpret_cast<uint32_t*>(w.data() + gradzip::kHeaderBytes);
}
uint16_t* topk_offsets(Bytes& w) {
  const auto s = topk_sections(kN, header_of(w).param);
  return reinterpret_cast<uint16_t*>(w.data() + gradzip::kHeaderBytes + s.offsets);
}
std::byte& topk_offset_padding(Bytes& w) {  // 1% of kN: 10 offsets, 20 bytes, 12 of padding
  const auto s = topk_sections(kN, header_of(w).param);
  return w[gradzip::kHeaderBytes + s.values - 1];
}

// Decoding `wire` into kN floats must throw `want` for decode and decode_add and leave the output
// exactly as it was.
void expect_rejected(const Bytes& wire, Status want, const std::string& what) {
  for (bool add : {false, true}) {
    std::vector<float> out(kN, 3.0f);
    try {
      if (add) gradzip::decode_add(wire.data(), wire.size(), out.data(), kN);
      else gradzip::decode(wire.data(), wire.size(), out.data(), kN);
      ADD_FAILURE() << what << ": accepted";
    } catch (const gradzip::Error& e) {
      EXPECT_EQ(e.status(), want) << what << ": " << e.what();
    }
    for (float v : out) ASSERT_EQ(v, 3.0f) << what << ": output touched";
  }
}

struct Case {
  const char* name;
  const char* spec;
  Status status;
  std::function<void(Bytes&)> corrupt;
};

class Corrupt : public ::testing::TestWithParam<Case> {};

TEST_P(Corrupt, Rejected) {
  const Case& c = GetParam();
  Bytes w = valid(c.spec);
  c.corrupt(w);
  expect_rejected(w, c.status, c.name);
}

auto edit(std::function<void(gradzip::WireHeader&)> f) {
  return [f](Bytes& w) {
    auto h = header_of(w);
    f(h);
    set_header(w, h);
  };
}

const Case kCases[] = {
    {"empty", "int8", Status::corrupt_payload, [](Bytes& w) { w.clear(); }},
    {"header_truncated", "int8", Status::corrupt_payload, [](Bytes& w) { w.resize(31); }},
    {"payload_truncated", "int8", Status::corrupt_payload, [](Bytes& w) { w.pop_back(); }},
    {"extra_bytes", "bf16", Status::corrupt_payload, [](Bytes& w) { w.push_back(std::byte{0}); }},
    {"wrong_magic", "fp32", Status::corrupt_payload, edit([](auto& h) { h.magic ^= 1; })},
    {"wrong_version", "fp16", Status::corrupt_payload,
     edit([](auto& h) { h.version = gradzip::kWireVersion + 1; })},
    {"unknown_codec", "fp32", Status::corrupt_payload, edit([](auto& h) { h.codec = 6; })},
    {"unknown_dtype", "fp32", Status::corrupt_payload, edit([](auto& h) { h.dtype = 1; })},
    {"count_mismatch", "fp32", Status::size_mismatch, [](Bytes& w) {
       // a well-formed message for a different element count
       w = encode(Codec::parse("fp32"), random_grad(kN + 1, 1));
     }},
    {"count_lies", "bf16", Status::corrupt_payload, edit([](auto& h) { h.count = kN + 1; })},
    {"count_huge", "fp32", Status::corrupt_payload, edit([](auto& h) { h.count = ~uint64_t{0}; })},
    {"bad_block", "int8", Status::corrupt_payload, edit([](auto& h) { h.param = 33; })},
    {"zero_block", "sign", Status::corrupt_payload, edit([](auto& h) { h.param = 0; })},
    {"cast_param", "fp16", Status::corrupt_payload, edit([](auto& h) { h.param = 1; })},
    {"cast_flags", "fp16", Status::corrupt_payload, edit([](auto& h) { h.flags = 1; })},
    {"topk_k_zero", "topk:0.01", Status::corrupt_payload, edit([](auto& h) { h.param = 0; })},
    {"topk_k_too_big", "topk:1", Status::corrupt_payload, edit([](auto& h) { h.param = kN + 1; })},
    {"topk_bad_flags", "topk:0.01", Status::corrupt_payload, edit([](auto& h) { h.flags = 4; })},
    {"topk_fp16_and_int8", "topk:0.01:values=int8", Status::corrupt_payload,
     edit([](auto& h) { h.flags = 3; })},
    {"payload_bytes_wrong", "int8", Status::corrupt_payload,
     edit([](auto& h) { h.payload_bytes += 1; })},
    {"sign_tail_bits", "sign:block=32", Status::corrupt_payload,
     [](Bytes& w) { w.back() = std::byte{0x80}; }},
    {"topk_index_out_of_range", "topk:0.01", Status::corrupt_payload,
     [](Bytes& w) { topk_offsets(w)[9] = kN; }},
    {"topk_index_huge", "topk:0.01", Status::corrupt_payload,
     [](Bytes& w) { topk_offsets(w)[9] = 0xFFFFu; }},
    {"topk_out_of_order", "topk:0.01", Status::corrupt_payload,
     [](Bytes& w) { std::swap(topk_offsets(w)[3], topk_offsets(w)[4]); }},
    {"topk_duplicate", "topk:0.01", Status::corrupt_payload,
     [](Bytes& w) { topk_offsets(w)[4] = topk_offsets(w)[3]; }},
    {"topk_chunk_end_short", "topk:0.01", Status::corrupt_payload,
     [](Bytes& w) { topk_ends(w)[0] -= 1; }},
    {"topk_chunk_end_long", "topk:0.01", Status::corrupt_payload,
     [](Bytes& w) { topk_ends(w)[0] += 1; }},
    {"topk_chunk_end_padding", "topk:0.01", Status::corrupt_payload,
     [](Bytes& w) { topk_ends(w)[1] = 1; }},
    {"topk_offset_padding", "topk:0.01", Status::corrupt_payload,
     [](Bytes& w) { topk_offset_padding(w) = std::byte{1}; }},
    {"topk_int8_value_padding", "topk:0.01:values=int8", Status::corrupt_payload,  // 10 of 16 bytes
     [](Bytes& w) { w[gradzip::kHeaderBytes + topk_sections(kN, 10).values + 10] = std::byte{1}; }},
};

INSTANTIATE_TEST_SUITE_P(All, Corrupt, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(CorruptPadding, NonzeroPaddingRejected) {
  // 3 scales (n = 700, block = 256): 12 bytes, 4 bytes of padding
  const size_t n = 700;
  Bytes w = encode(Codec::parse("int8"), random_grad(n, 1));
  w[gradzip::kHeaderBytes + 13] = std::byte{1};
  std::vector<float> out(n);
  try {
    gradzip::decode(w.data(), w.size(), out.data(), n);
    FAIL();
  } catch (const gradzip::Error& e) {
    EXPECT_EQ(e.status(), Status::corrupt_payload);
  }
}

// Chunk ends of a message of several 65536-element chunks: a decreasing end, a chunk that holds
// more than its length, and an offset past the end of the last (partial) chunk.
TEST(CorruptTopkChunks, EveryChunkEndAndTheLastChunkChecked) {
  const size_t n = 3 * 65536 + 5;
  const Bytes good = encode(Codec::parse("topk:0.5"), random_grad(n, 2));
  const auto s = topk_sections(n, header_of(good).param);
  auto ends = [&](Bytes& w) {
    return reinterpret_cast<uint32_t*>(w.data() + gradzip::kHeaderBytes);
  };
  auto offsets = [&](Bytes& w) {
    return reinterpret_cast<uint16_t*>(w.data() + gradzip::kHeaderBytes + s.offsets);
  };
  const std::vector<std::function<void(Bytes&)>> edits = {
      [&](Bytes& w) { ends(w)[2] = ends(w)[1] - 1; },
      [&](Bytes& w) { ends(w)[1] = ends(w)[0] + 65537; },
      [&](Bytes& w) { offsets(w)[header_of(w).param - 1] = 5; },
  };
  std::vector<float> out(n);
  for (size_t e = 0; e < edits.size(); ++e) {
    Bytes w = good;
    edits[e](w);
    try {
      gradzip::decode(w.data(), w.size(), out.data(), n);
      ADD_FAILURE() << "edit " << e << " accepted";
    } catch (const gradzip::Error& err) {
      EXPECT_EQ(err.status(), Status::corrupt_payload) << e;
    }
  }
  gradzip::decode(good.data(), good.size(), out.data(), n);  // the unedited message decodes
}

TEST(CorruptArgs, NullWire) {
  std::vector<float> out(4);
  EXPECT_THROW(gradzip::decode(nullptr, 0, out.data(), 4), gradzip::Error);
}

TEST(CorruptArgs, EveryValidMessageReadsBack) {
  for (const char* s : {"fp32", "fp16", "bf16", "int8", "sign", "topk:0.01", "topk:0.01:values=fp16",
                        "topk:0.01:values=int8"}) {
    const Bytes w = valid(s);
    const auto h = gradzip::read_header(w.data(), w.size());
    EXPECT_EQ(h.count, kN) << s;
  }
}

}  // namespace
