// The batched entry points (encode_batch, decode_batch, decode_add_batch) against a loop of the
// single-message calls: the same bytes, residuals and outputs; and per-message statuses, where one
// corrupt message among good ones fails alone.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "batch_bucket.hpp"
#include "test_util.hpp"

using gradzip::Codec;
using gradzip::DecodeItem;
using gradzip::EncodeItem;
using gradzip::Error;
using gradzip::Status;
using namespace gztest;

namespace {

constexpr float kPrescale = 1.0f / 3.0f;
constexpr float kPoison = -12345.0f;

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
}

struct EncodeRun {
  Bytes wire;
  std::vector<float> residual;
};

// The reference: one single-message call per message.
EncodeRun encode_singly(const Bucket& b, const std::vector<float>& in, bool feedback) {
  EncodeRun r{Bytes(b.wire_bytes), std::vector<float>(b.n, 0.25f)};
  std::vector<std::byte> ws(64);
  for (size_t i = 0; i < b.count(); ++i) {
    ws.resize(std::max(ws.size(), b.codecs[i].workspace_bytes(b.sizes[i])));
    std::byte* out = r.wire.data() + b.slots[i];
    const float* x = in.data() + b.offsets[i];
    if (feedback)
      b.codecs[i].encode_with_feedback(x, r.residual.data() + b.offsets[i], b.sizes[i], out,
                                       b.bytes(i), kPrescale, ws.data(), ws.size());
    else
      b.codecs[i].encode(x, b.sizes[i], out, b.bytes(i), kPrescale, ws.data(), ws.size());
  }
  return r;
}

EncodeRun encode_batched(const Bucket& b, const std::vector<float>& in, bool feedback) {
  EncodeRun r{Bytes(b.wire_bytes), std::vector<float>(b.n, 0.25f)};
  const auto items = b.encode_items(in.data(), feedback ? r.residual.data() : nullptr, r.wire.data());
  std::vector<std::byte> ws(gradzip::batch_workspace_bytes(items.data(), items.size()));
  gradzip::encode_batch(items.data(), items.size(), kPrescale, ws.data(), ws.size());
  return r;
}

TEST(Batch, WorkspaceIsTheLargestItemNeed) {
  const Bucket& b = bucket();
  const auto items = b.encode_items(nullptr, nullptr, nullptr);
  size_t want = 0;
  for (size_t i = 0; i < b.count(); ++i)
    want = std::max(want, b.codecs[i].workspace_bytes(b.sizes[i]));
  EXPECT_GT(want, 0u);  // top-k needs some
  EXPECT_EQ(gradzip::batch_workspace_bytes(items.data(), items.size()), want);
}

TEST(Batch, EncodeEqualsSingleCalls) {
  const Bucket& b = bucket();
  for (const bool feedback : {false, true}) {
    const std::vector<float> in = batch_input(b.n, feedback ? 2 : 1);
    const EncodeRun single = encode_singly(b, in, feedback);
    const EncodeRun batch = encode_batched(b, in, feedback);
    EXPECT_EQ(batch.wire, single.wire) << "feedback " << feedback;
    EXPECT_TRUE(same_floats(batch.residual, single.residual)) << "feedback " << feedback;
  }
}

TEST(Batch, DecodeAndDecodeAddEqualSingleCalls) {
  const Bucket& b = bucket();
  const Bytes wire = encode_singly(b, batch_input(b.n, 3), true).wire;
  for (const bool add : {false, true}) {
    std::vector<float> single = batch_input(b.n, 4), batch = single;
    for (size_t i = 0; i < b.count(); ++i) {
      float* out = single.data() + b.offsets[i];
      const std::byte* w = wire.data() + b.slots[i];
      if (add)
        gradzip::decode_add(w, b.bytes(i), out, b.sizes[i]);
      else
        gradzip::decode(w, b.bytes(i), out, b.sizes[i]);
    }
    const auto items = b.decode_items(wire.data(), batch.data());
    std::vector<Status> status(items.size(), Status::cuda_error);
    const size_t failed = add ? gradzip::decode_add_batch(items.data(), items.size(), status.data())
                              : gradzip::decode_batch(items.data(), items.size(), status.data());
    EXPECT_EQ(failed, 0u);
    for (const Status s : status) EXPECT_EQ(s, Status::ok);
    EXPECT_TRUE(same_floats(batch, single)) << "add " << add;
  }
}

// Message 3 of the batch is corrupt and message 6 is meant for another size: each fails alone,
// leaves its output untouched, and every other message decodes as it would alone.
TEST(Batch, OneBadMessageFailsAlone) {
  const Bucket& b = bucket();
  Bytes wire = encode_singly(b, batch_input(b.n, 5), true).wire;
  std::vector<float> want(b.n);
  gradzip::decode_batch(b.decode_items(wire.data(), want.data()).data(), b.count());

  wire[b.slots[3]] ^= std::byte{1};  // the magic
  auto items = b.decode_items(wire.data(), nullptr);
  std::vector<float> out(b.n + 1, kPoison);
  for (size_t i = 0; i < b.count(); ++i) items[i].out = out.data() + b.offsets[i];
  items[6].n += 1;  // the output is one float longer than the payload
  std::vector<Status> status(b.count(), Status::cuda_error);
  EXPECT_EQ(gradzip::decode_batch(items.data(), items.size(), status.data()), 2u);
  for (size_t i = 0; i < b.count(); ++i) {
    const Status expect = i == 3 ? Status::corrupt_payload : i == 6 ? Status::size_mismatch
                                                                    : Status::ok;
    EXPECT_EQ(status[i], expect) << "message " << i;
    for (size_t j = 0; j < b.sizes[i]; ++j) {
      const float got = out[b.offsets[i] + j];
      if (i == 3 || i == 6)
        ASSERT_EQ(got, kPoison) << "message " << i << " element " << j;
      else
        ASSERT_TRUE(same_bits(got, want[b.offsets[i] + j])) << "message " << i << " element " << j;
    }
  }
}

// Without a status array the first failure throws, naming its message; the ones before it are
// decoded.
TEST(Batch, WithoutStatusTheFirstFailureThrows) {
  const Bucket& b = bucket();
  Bytes wire = encode_singly(b, batch_input(b.n, 6), false).wire;
  std::vector<float> want(b.n);
  gradzip::decode_batch(b.decode_items(wire.data(), want.data()).data(), b.count());
  wire[b.slots[5] + 8] ^= std::byte{0xff};  // the element count
  std::vector<float> out(b.n, kPoison);
  const auto items = b.decode_items(wire.data(), out.data());
  try {
    gradzip::decode_add_batch(items.data(), items.size());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::corrupt_payload);
    EXPECT_NE(std::string(e.what()).find("(message 5 of 10)"), std::string::npos) << e.what();
  }
  for (size_t j = 0; j < b.offsets[5]; ++j) ASSERT_TRUE(same_bits(out[j], kPoison + want[j])) << j;
  for (size_t j = b.offsets[5]; j < b.n; ++j) ASSERT_EQ(out[j], kPoison) << j;
}

// A bad item anywhere rejects the batch before anything is written.
TEST(Batch, EncodeChecksEveryItemFirst) {
  const Bucket& b = bucket();
  const std::vector<float> in = batch_input(b.n, 7);
  Bytes wire(b.wire_bytes);
  std::vector<float> residual(b.n, 0.5f);
  auto items = b.encode_items(in.data(), residual.data(), wire.data());
  std::vector<std::byte> ws(gradzip::batch_workspace_bytes(items.data(), items.size()));
  items.back().out_bytes -= 1;
  try {
    gradzip::encode_batch(items.data(), items.size(), kPrescale, ws.data(), ws.size());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("(message 9 of 10)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(wire, Bytes(b.wire_bytes));
  for (const float r : residual) ASSERT_EQ(r, 0.5f);

  items.back().out_bytes += 1;
  items[2].codec = nullptr;
  EXPECT_THROW(gradzip::encode_batch(items.data(), items.size(), kPrescale, ws.data(), ws.size()),
               Error);
  items[2].codec = &b.codecs[2];
  EXPECT_THROW(gradzip::encode_batch(items.data(), items.size(), kPrescale, ws.data(), 16), Error);
}

TEST(Batch, EmptyAndNullBatches) {
  EXPECT_NO_THROW(gradzip::encode_batch(nullptr, 0));
  EXPECT_EQ(gradzip::decode_batch(nullptr, 0), 0u);
  EXPECT_EQ(gradzip::batch_workspace_bytes(nullptr, 0), 0u);
  EXPECT_THROW(gradzip::encode_batch(nullptr, 1), Error);
  EXPECT_THROW(gradzip::decode_add_batch(nullptr, 2), Error);
}

}  // namespace
