// The host API's memory promise: after a warm-up call, encode, encode_with_feedback, decode,
// decode_add and the batch calls allocate nothing (every buffer is the caller's), for every codec
// and at 1 and 2 threads. This binary replaces the global operator new with one that counts the
// calls made, on any thread, while a window is open.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "batch_bucket.hpp"
#include "test_util.hpp"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<long> g_news{0};

void* counted_new(std::size_t size, std::size_t align) {
  if (g_counting.load(std::memory_order_relaxed)) g_news.fetch_add(1, std::memory_order_relaxed);
  if (size == 0) size = 1;
  void* p = align > alignof(std::max_align_t)
                ? std::aligned_alloc(align, (size + align - 1) / align * align)
                : std::malloc(size);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t n) { return counted_new(n, 0); }
void* operator new[](std::size_t n) { return counted_new(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_new(n, std::size_t(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_new(n, std::size_t(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try { return counted_new(n, 0); } catch (...) { return nullptr; }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try { return counted_new(n, 0); } catch (...) { return nullptr; }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

using gradzip::Codec;

// Counts operator new calls made while f runs.
template <class F>
long news_during(F&& f) {
  g_news.store(0);
  g_counting.store(true);
  f();
  g_counting.store(false);
  return g_news.load();
}

const char* const kSpecs[] = {"fp32",      "fp16",       "bf16",          "int8",
                              "int8:block=32", "sign",   "sign:block=64", "topk:0.01",
                              "topk:0.3:values=fp16"};

class NoAllocation : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    before_ = gradzip::num_threads();
    gradzip::set_num_threads(GetParam());
  }
  void TearDown() override { gradzip::set_num_threads(before_); }
  int before_ = 0;
};

TEST_P(NoAllocation, SingleMessageCalls) {
  const size_t n = 1000003;  // odd, and large enough for 2 threads
  const std::vector<float> grad = gztest::random_grad(n, 11);
  for (const char* spec : kSpecs) {
    SCOPED_TRACE(spec);
    const Codec codec = Codec::parse(spec);
    std::vector<float> residual(n, 0.0f), out(n, 0.0f);
    gztest::Bytes wire(codec.encoded_bytes(n));
    std::vector<uint32_t> ws(codec.workspace_bytes(n) / 4 + 1);
    const size_t ws_bytes = ws.size() * 4;
    auto hot_path = [&] {
      codec.encode_with_feedback(grad.data(), residual.data(), n, wire.data(), wire.size(), 0.5f,
                                 ws.data(), ws_bytes);
      codec.encode(grad.data(), n, wire.data(), wire.size(), 1.0f, ws.data(), ws_bytes);
      gradzip::decode(wire.data(), wire.size(), out.data(), n);
      gradzip::decode_add(wire.data(), wire.size(), out.data(), n);
    };
    hot_path();  // warm-up: the thread pool and the ISA table are set up once per process
    EXPECT_EQ(news_during(hot_path), 0);
  }
}

TEST_P(NoAllocation, BatchCalls) {
  const gztest::Bucket bucket({{"int8", 70001}, {"sign", 333}, {"fp16", 1025}, {"topk:0.05", 90007},
                               {"bf16", 65}, {"fp32", 3}, {"sign:block=32", 400003}});
  const std::vector<float> grad = gztest::random_grad(bucket.n, 12);
  std::vector<float> residual(bucket.n, 0.0f), out(bucket.n, 0.0f);
  std::vector<std::byte> wire(bucket.wire_bytes);
  const auto enc = bucket.encode_items(grad.data(), residual.data(), wire.data());
  const auto dec = bucket.decode_items(wire.data(), out.data());
  std::vector<uint32_t> ws(gradzip::batch_workspace_bytes(enc.data(), enc.size()) / 4 + 1);
  std::vector<gradzip::Status> status(dec.size());
  auto hot_path = [&] {
    gradzip::encode_batch(enc.data(), enc.size(), 0.25f, ws.data(), ws.size() * 4);
    EXPECT_EQ(gradzip::decode_batch(dec.data(), dec.size(), status.data()), 0u);
    gradzip::decode_add_batch(dec.data(), dec.size());
  };
  hot_path();
  EXPECT_EQ(news_during(hot_path), 0);
}

// The counter sees what it should: a refused call builds its error message on the heap.
TEST_P(NoAllocation, CounterSeesAnAllocation) {
  const Codec codec = Codec::parse("int8");
  std::vector<float> in(1000);
  gztest::Bytes wire(8);
  EXPECT_GT(news_during([&] {
              EXPECT_THROW(codec.encode(in.data(), in.size(), wire.data(), wire.size()),
                           gradzip::Error);
            }),
            0);
}

INSTANTIATE_TEST_SUITE_P(Threads, NoAllocation, ::testing::Values(1, 2),
                         [](const auto& info) { return std::to_string(info.param) + "threads"; });

}  // namespace
