// The wire format's one definition (gradzip/wire.hpp) against the size queries of the CPU API:
// for every codec and a spread of sizes, Codec::encoded_bytes / wire_header give what the shared
// layout says, the header passes the shared check, and a real encode has exactly that length.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "gradzip/gradzip.hpp"
#include "test_util.hpp"

namespace {

using gradzip::CodecKind;
using gradzip::WireStatus;

// The rules are constexpr: the size of a message and the verdict on a header are known at
// compile time.
static_assert(gradzip::message_bytes(CodecKind::int8, 257, 256, 0) == 32 + 16 + 257);
static_assert(gradzip::message_bytes(CodecKind::sign, 33, 32, 0) == 32 + 16 + 8);
// top-k: one chunk end (4 bytes, padded to 16), 3 u16 offsets (padded to 16), 3 fp16 values
static_assert(gradzip::message_bytes(CodecKind::topk, 100, 3, gradzip::kTopkFlagFp16Values) ==
              32 + 16 + 16 + 6);
static_assert(gradzip::message_bytes(CodecKind::topk, 65537, 9, 0) == 32 + 16 + 32 + 36);
// int8 values: 9 bytes padded to 16, then two chunks' f32 scales
static_assert(gradzip::message_bytes(CodecKind::topk, 65537, 9, gradzip::kTopkFlagInt8Values) ==
              32 + 16 + 32 + 16 + 8);
constexpr uint16_t kVersion = gradzip::kWireVersion;
static_assert(gradzip::message_slot_bytes(33) == 48 && gradzip::message_slot_bytes(48) == 48);
static_assert(gradzip::check_header(gradzip::WireHeader{gradzip::kWireMagic, kVersion, 3, 0, 257, 256, 0, 16 + 257},
                                    32 + 16 + 257)
                  .status == WireStatus::ok);
static_assert(gradzip::check_header(gradzip::WireHeader{gradzip::kWireMagic, kVersion, 3, 0, 257, 48, 0, 16 + 257},
                                    32 + 16 + 257)
                  .status == WireStatus::bad_param);

const char* const kSpecs[] = {"fp32",          "fp16",   "bf16",          "int8",
                              "int8:block=32", "int8:block=65536", "sign", "sign:block=32",
                              "sign:block=4096", "topk:0.01", "topk:0.1:values=fp16", "topk:0.1:values=int8", "topk:1",
                              "topk:1e-9"};

const uint64_t kSizes[] = {0,     1,     2,     31,    32,      33,          255,
                           256,   257,   1023,  1024,  1025,    4095,        4096,
                           4097,  65535, 65536, 65537, 1000003, 0xFFFFFFFFull, uint64_t{1} << 32,
                           uint64_t{1} << 40, gradzip::kMaxCount};

TEST(Wire, SizeQueriesAgreeWithTheSharedLayout) {
  for (const char* spec : kSpecs) {
    const auto codec = gradzip::Codec::parse(spec);
    for (const uint64_t n : kSizes) {
      const std::string at = std::string(spec) + " n=" + std::to_string(n);
      if (codec.kind() == CodecKind::topk && n > gradzip::kTopkMaxCount) {
        EXPECT_THROW(codec.encoded_bytes(n), gradzip::Error) << at;
        continue;
      }
      const uint32_t param = codec.wire_param(n);
      const uint64_t bytes = gradzip::message_bytes(codec.kind(), n, param, codec.wire_flags());
      EXPECT_EQ(codec.encoded_bytes(n), bytes) << at;
      const gradzip::WireHeader h = codec.wire_header(n);
      EXPECT_EQ(gradzip::kHeaderBytes + h.payload_bytes, bytes) << at;
      EXPECT_EQ(gradzip::kHeaderBytes + gradzip::payload_layout(h).bytes, bytes) << at;
      EXPECT_EQ(gradzip::check_header(h, bytes).status, WireStatus::ok) << at;
      EXPECT_EQ(gradzip::check_header(h, bytes + 1).status, WireStatus::wrong_length) << at;
      EXPECT_EQ(gradzip::message_slot_bytes(bytes) % 16, 0u) << at;
      EXPECT_LT(gradzip::message_slot_bytes(bytes) - bytes, 16u) << at;
    }
  }
}

TEST(Wire, EncodedMessagesHaveTheSharedSizeAndPassTheSharedCheck) {
  for (const char* spec : kSpecs) {
    const auto codec = gradzip::Codec::parse(spec);
    for (const uint64_t n : kSizes) {
      if (n > 65537) continue;
      const gztest::Bytes wire = gztest::encode(codec, gztest::random_grad(n, n + 1));
      gradzip::WireHeader h;
      std::memcpy(&h, wire.data(), sizeof h);
      const auto* payload = reinterpret_cast<const uint8_t*>(wire.data()) + gradzip::kHeaderBytes;
      EXPECT_EQ(wire.size(), codec.encoded_bytes(n)) << spec << " n=" << n;
      const gradzip::WireHeader want = codec.wire_header(n);
      EXPECT_EQ(0, std::memcmp(&h, &want, sizeof h)) << spec << " n=" << n;
      EXPECT_EQ(gradzip::check_message(h, wire.size(), payload).status, WireStatus::ok)
          << spec << " n=" << n;
    }
  }
}

TEST(Wire, CountLimits) {
  for (const char* spec : kSpecs)
    EXPECT_THROW(gradzip::Codec::parse(spec).encoded_bytes(gradzip::kMaxCount + 1), gradzip::Error)
        << spec;
  gradzip::WireHeader h = gradzip::Codec::parse("int8").wire_header(1000);
  h.count = gradzip::kMaxCount + 1;
  EXPECT_EQ(gradzip::check_header(h, 0).status, WireStatus::bad_count);
  h = gradzip::Codec::parse("topk:1").wire_header(1000);
  h.count = gradzip::kTopkMaxCount + 1;
  EXPECT_EQ(gradzip::check_header(h, 0).status, WireStatus::bad_count);
}

TEST(Wire, EveryStatusHasText) {
  for (uint32_t s = 0; s <= static_cast<uint32_t>(WireStatus::bad_chunk_ends); ++s)
    EXPECT_STRNE(gradzip::wire_status_text(static_cast<WireStatus>(s)), "unknown status") << s;
}

}  // namespace
