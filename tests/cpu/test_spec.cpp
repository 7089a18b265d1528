// Codec spec parsing: accepted forms, canonical names, and errors that name the bad part.
#include <gtest/gtest.h>

#include "gradzip/gradzip.hpp"

using gradzip::Codec;
using gradzip::CodecKind;
using gradzip::Error;
using gradzip::Status;

TEST(Spec, ParsesEveryForm) {
  EXPECT_EQ(Codec::parse("fp32").kind(), CodecKind::fp32);
  EXPECT_EQ(Codec::parse("fp16").kind(), CodecKind::fp16);
  EXPECT_EQ(Codec::parse("bf16").kind(), CodecKind::bf16);
  EXPECT_EQ(Codec::parse("int8").spec().block, gradzip::kDefaultInt8Block);
  EXPECT_EQ(Codec::parse("int8:block=64").spec().block, 64u);
  EXPECT_EQ(Codec::parse("sign").spec().block, gradzip::kDefaultSignBlock);
  EXPECT_EQ(Codec::parse("sign:block=65536").spec().block, 65536u);
  const Codec t = Codec::parse("topk:0.01");
  EXPECT_EQ(t.kind(), CodecKind::topk);
  EXPECT_DOUBLE_EQ(t.spec().ratio, 0.01);
  EXPECT_EQ(t.spec().values, gradzip::TopkValues::f32);
  EXPECT_EQ(Codec::parse("topk:0.5:values=fp16").spec().values, gradzip::TopkValues::fp16);
  EXPECT_EQ(Codec::parse("topk:0.5:values=int8").spec().values, gradzip::TopkValues::int8);
  EXPECT_EQ(Codec::parse("topk:1:values=fp32").spec().values, gradzip::TopkValues::f32);
}

TEST(Spec, NameRoundTrips) {
  for (const char* s : {"fp32", "fp16", "bf16", "int8", "int8:block=64", "sign", "sign:block=32",
                        "topk:0.01", "topk:0.3", "topk:0.01:values=fp16", "topk:1",
                        "topk:0.02:values=int8",
                        "topk:0.123456789012345"}) {
    const Codec c = Codec::parse(s);
    EXPECT_EQ(Codec::parse(c.name()), c) << s << " -> " << c.name();
  }
  EXPECT_EQ(Codec::parse("topk:0.01").name(), "topk:0.01");
  EXPECT_EQ(Codec::parse("int8").name(), "int8:block=256");
}

// Each bad spec must fail with invalid_spec and a message containing `part`.
struct BadSpec {
  const char* spec;
  const char* part;
};

class SpecErrors : public ::testing::TestWithParam<BadSpec> {};

TEST_P(SpecErrors, NamesTheBadPart) {
  const BadSpec b = GetParam();
  try {
    Codec::parse(b.spec);
    FAIL() << "accepted '" << b.spec << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::invalid_spec);
    EXPECT_NE(std::string(e.what()).find(b.part), std::string::npos)
        << "message '" << e.what() << "' does not name '" << b.part << "'";
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, SpecErrors,
    ::testing::Values(BadSpec{"topk:0", "ratio 0"}, BadSpec{"topk:1.5", "ratio 1.5"},
                      BadSpec{"topk:-0.1", "ratio -0.1"}, BadSpec{"topk:nan", "ratio nan"},
                      BadSpec{"topk", "needs a ratio"}, BadSpec{"topk:abc", "'abc'"},
                      BadSpec{"topk:0.1x", "'0.1x'"}, BadSpec{"int8:block=0", "block=0"},
                      BadSpec{"int8:block=33", "block=33"}, BadSpec{"int8:block=16", "block=16"},
                      BadSpec{"int8:block=65568", "block=65568"},
                      BadSpec{"sign:block=-32", "'-32'"}, BadSpec{"int8:block=", "block=''"},
                      BadSpec{"zstd", "'zstd'"}, BadSpec{"", "unknown codec ''"},
                      BadSpec{"FP16", "'FP16'"}, BadSpec{"fp16 ", "'fp16 '"},
                      BadSpec{"int8:block=64:block=128", "duplicate option 'block'"},
                      BadSpec{"topk:0.1:values=fp16:values=fp32", "duplicate option 'values'"},
                      BadSpec{"topk:0.1:values=int4", "values='int4'"},
                      BadSpec{"int8:block=64:", "stray ':'"}, BadSpec{"int8:64", "'64'"},
                      BadSpec{"fp16:block=64", "unknown option 'block'"},
                      BadSpec{"int8:values=fp16", "unknown option 'values'"},
                      BadSpec{"sign:block=64garbage", "'64garbage'"}));

TEST(Spec, ConstructorValidates) {
  gradzip::CodecSpec s;
  s.kind = CodecKind::int8;
  s.block = 48;
  EXPECT_THROW(Codec{s}, Error);
  s.block = 64;
  EXPECT_NO_THROW(Codec{s});
}

TEST(Spec, TopkK) {
  const Codec c = Codec::parse("topk:0.01");
  EXPECT_EQ(c.topk_k(0), 0u);
  EXPECT_EQ(c.topk_k(1), 1u);
  EXPECT_EQ(c.topk_k(7), 1u);
  EXPECT_EQ(c.topk_k(1000), 10u);
  EXPECT_EQ(c.topk_k(1001), 11u);
  EXPECT_EQ(Codec::parse("topk:1").topk_k(5), 5u);
}

TEST(Spec, SizesMatchTheLayout) {
  for (const char* s : {"fp32", "fp16", "bf16", "int8", "sign:block=32", "topk:0.3:values=fp16",
                        "topk:0.3:values=int8"}) {
    const Codec c = Codec::parse(s);
    for (size_t n : {0, 1, 7, 1000, 1000003}) {
      const auto l = gradzip::payload_layout(c.kind(), n, c.wire_param(n), c.wire_flags());
      EXPECT_EQ(c.encoded_bytes(n), gradzip::kHeaderBytes + l.bytes) << s << " n=" << n;
    }
  }
  EXPECT_EQ(Codec::parse("int8").workspace_bytes(1000), 0u);
  EXPECT_GE(Codec::parse("topk:0.01").workspace_bytes(1000), 4000u);
}

TEST(Spec, StatusNames) {
  EXPECT_STREQ(gradzip::status_name(Status::corrupt_payload), "corrupt_payload");
  EXPECT_STREQ(gradzip::status_name(Status::invalid_spec), "invalid_spec");
}
