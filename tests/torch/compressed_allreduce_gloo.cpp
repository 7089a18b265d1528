// The compressed all-reduce (and FSDP's reduce-scatter) from C++ alone, as the README's C++ section shows it: 2 processes, a
// ProcessGroupGloo over a FileStore, error feedback on libtorch tensors. Every result is checked
// against a float64 reference computed here from both ranks' gradients (each process can draw
// both: they come from seeded generators).
#include <ATen/ATen.h>
#include <sys/wait.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "compressed_allreduce.hpp"

namespace {

constexpr int kWorld = 2;
constexpr int64_t kN = 10007;  // odd: the two shards differ in size

using gradzip::torch_ext::CompressedAllreduce;
using Values = std::vector<double>;

int failures = 0;
int my_rank = -1;

void expect(bool ok, const std::string& what) {
  if (ok) return;
  std::fprintf(stderr, "rank %d: FAILED: %s\n", my_rank, what.c_str());
  ++failures;
}

// Rank r's gradient at step s (float32 values).
Values gradient(int rank, int step) {
  std::mt19937 rng(static_cast<unsigned>(1000 * rank + step + 1));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Values g(kN);
  for (auto& v : g) v = normal(rng);
  return g;
}

at::Tensor to_tensor(const Values& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kFloat);
  auto* p = t.data_ptr<float>();
  for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<float>(v[i]);
  return t;
}

Values values(const at::Tensor& t) {
  const auto* p = t.const_data_ptr<float>();
  return Values(p, p + t.numel());
}

// bf16 of a float32, round to nearest even (finite inputs).
double bf16(double x) {
  const auto f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

double max_abs(const Values& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// One reduction of both ranks' step-0 gradients; returns (average, residual) of this rank.
std::pair<Values, Values> reduce_once(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                      const std::string& codec, bool compress,
                                      gradzip::torch_ext::CastSum cast_sum =
                                          gradzip::torch_ext::CastSum::wire) {
  CompressedAllreduce reducer(group, codec, {}, cast_sum);
  at::Tensor grad = to_tensor(gradient(my_rank, 0));
  at::Tensor residual = at::zeros_like(grad);
  reducer.reduce(0, grad, grad, {kN}, residual, {}, compress)->wait();
  return {values(grad), values(residual)};
}

void check_casts_and_fallback(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  const Values g0 = gradient(0, 0), g1 = gradient(1, 0), mine = gradient(my_rank, 0);
  Values mean(kN);
  for (int64_t i = 0; i < kN; ++i) mean[i] = (g0[i] + g1[i]) / 2;

  for (const bool compress : {false, true}) {  // a plain all-reduce, and fp32's one of its payload
    const auto [out, residual] = reduce_once(group, "fp32", compress);
    double err = 0;
    for (int64_t i = 0; i < kN; ++i) err = std::max(err, std::abs(out[i] - mean[i]));
    expect(err <= 1e-6, "fp32 average (compress=" + std::to_string(compress) +
                            ") off by " + std::to_string(err));
    expect(max_abs(residual) == 0, "fp32 leaves a zero residual");
  }

  // bf16: each rank sends bf16(g / 2) and keeps the rest; the backend adds the two in bf16
  // (CastSum::wire) or the owner sums them in fp32 and re-rounds (CastSum::fp32): one rounding.
  using gradzip::torch_ext::CastSum;
  for (const CastSum cast_sum : {CastSum::wire, CastSum::fp32}) {
    const auto [out, residual] = reduce_once(group, "bf16", true, cast_sum);
    int64_t wrong_residual = 0, out_of_bound = 0;
    for (int64_t i = 0; i < kN; ++i) {
      const double c = static_cast<float>(mine[i] * 0.5);
      if (residual[i] != c - bf16(c)) ++wrong_residual;
      const double bound = std::ldexp(std::abs(g0[i]) + std::abs(g1[i]), -9) +
                           std::ldexp(std::abs(mean[i]), -8) + 1e-7;
      if (std::abs(out[i] - mean[i]) > bound) ++out_of_bound;
    }
    expect(wrong_residual == 0, "bf16 residual = c - bf16(c) at every element (" +
                                    std::to_string(wrong_residual) + " differ)");
    expect(out_of_bound == 0, "bf16 average within its rounding bound (" +
                                  std::to_string(out_of_bound) + " outside)");
  }
}

void check_int8_and_sign(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  const Values g0 = gradient(0, 0), g1 = gradient(1, 0), mine = gradient(my_rank, 0);
  Values mean(kN);
  for (int64_t i = 0; i < kN; ++i) mean[i] = (g0[i] + g1[i]) / 2;
  // int8 blockwise: an element is off by at most half a step of its block's scale (<= max|c| /
  // 127), once when sent and once when the owner re-encodes the sum.
  const auto [out, residual] = reduce_once(group, "int8", true);
  const double step_sent = (max_abs(g0) + max_abs(g1)) / 2 / 127, step_sum = max_abs(mean) / 127;
  double err = 0;
  for (int64_t i = 0; i < kN; ++i) err = std::max(err, std::abs(out[i] - mean[i]));
  expect(err <= step_sent + step_sum / 2 + 1e-6, "int8 average within its bound, off by " +
                                                      std::to_string(err));
  expect(max_abs(residual) <= max_abs(mine) / 2 / 127 / 2 * (1 + 1e-5) + 1e-7 &&
             max_abs(residual) > 0,
         "int8 residual is the rounding error of what was sent");

  // A C++ caller flags tensors that travel uncompressed: the last 100 elements, a tensor of their
  // own, are the fp32 sum of g * 0.5 in rank order, their residual zero.
  {
    CompressedAllreduce reducer(group, "int8");
    at::Tensor grad = to_tensor(mine), res = at::zeros({kN});
    reducer.reduce(0, grad, grad, {kN - 100, 100}, res, {}, true, {false, true})->wait();
    const Values o = values(grad), r = values(res);
    bool exact = true, zero = true;
    for (int64_t i = kN - 100; i < kN; ++i) {
      exact = exact && o[i] == static_cast<double>(static_cast<float>(g0[i]) * 0.5f +
                                                    static_cast<float>(g1[i]) * 0.5f);
      zero = zero && r[i] == 0;
    }
    expect(exact && zero, "an uncompressed tensor is the exact fp32 average, its residual zero");
  }

  // sign with error feedback over 2 steps: the average points the way of the mean gradient.
  CompressedAllreduce reducer(group, "sign");
  at::Tensor res = at::zeros({kN});
  for (int step = 0; step < 2; ++step) {
    at::Tensor grad = to_tensor(gradient(my_rank, step));
    reducer.reduce(0, grad, grad, {kN}, res, {}, true)->wait();
    const Values a = gradient(0, step), b = gradient(1, step), o = values(grad);
    double dot = 0, no = 0, nm = 0;
    for (int64_t i = 0; i < kN; ++i) {
      const double m = (a[i] + b[i]) / 2;
      dot += o[i] * m, no += o[i] * o[i], nm += m * m;
    }
    expect(std::isfinite(dot) && dot / std::sqrt(no * nm) > 0.5,
           "sign average correlates with the mean gradient");
  }
}

void check_topk(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  // top-k: each rank sends its k largest |g / 2| exactly and keeps the rest; the all-gathered
  // payloads are summed. The test finds each rank's selection from its own residual (selected =
  // zeroed) and recomputes the other rank's with the same k by sorting.
  const auto [out, residual] = reduce_once(group, "topk:0.05", true);
  const Values mine = gradient(my_rank, 0);
  std::vector<char> selected_mine(kN);
  int64_t k = 0;
  double smallest_selected = INFINITY, largest_kept = 0;
  for (int64_t i = 0; i < kN; ++i) {
    const double c = static_cast<float>(mine[i] * 0.5);
    selected_mine[i] = residual[i] == 0 && c != 0;
    k += selected_mine[i];
    if (selected_mine[i]) smallest_selected = std::min(smallest_selected, std::abs(c));
    else {
      largest_kept = std::max(largest_kept, std::abs(c));
      expect(residual[i] == c, "top-k keeps an unselected element whole");
    }
  }
  expect(k >= kN / 25 && k <= kN / 15, "top-k 5 % selects about 5 % (" + std::to_string(k) + ")");
  expect(smallest_selected >= largest_kept, "top-k selects the largest magnitudes");
  Values expected(kN, 0.0);
  for (int r = 0; r < kWorld; ++r) {
    const Values g = gradient(r, 0);
    std::vector<int64_t> order(kN);
    for (int64_t i = 0; i < kN; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return std::abs(g[a]) > std::abs(g[b]); });
    for (int64_t j = 0; j < k; ++j) expected[order[j]] += static_cast<float>(g[order[j]] * 0.5);
  }
  double err = 0;
  for (int64_t i = 0; i < kN; ++i) err = std::max(err, std::abs(out[i] - expected[i]));
  expect(err <= 1e-6, "top-k average = sum of both ranks' selections, off by " + std::to_string(err));
}

// The bytes a reduction reports: its layout's (a chunked CPU cast bucket: the whole bucket's), an
// fp32 ring all-reduce's when uncompressed, the reduce-scatter's own; a bucket never reduced has
// none.
void check_traffic(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  using gradzip::torch_ext::BucketLayout;
  using gradzip::torch_ext::CastSum;
  using gradzip::torch_ext::Collective;
  const int64_t big = CompressedAllreduce::kChunk + 3;  // two chunks
  for (const auto& [codec, n] : {std::pair{"int8", kN}, std::pair{"bf16", big}}) {
    CompressedAllreduce reducer(group, codec);
    bool threw = false;
    try {
      reducer.traffic(0);
    } catch (const c10::ValueError&) {
      threw = true;
    }
    expect(threw, std::string(codec) + ": the traffic of a bucket never reduced is a ValueError");
    at::Tensor grad = at::randn({n});
    reducer.reduce(0, grad, grad, {n}, {}, {}, true)->wait();
    const gradzip::Codec parsed = gradzip::Codec::parse(codec);
    expect(reducer.traffic(0) == BucketLayout(parsed, kWorld, {n}).traffic(my_rank),
           std::string(codec) + ": reports its layout's bytes");
    reducer.reduce(0, grad, grad, {n}, {}, {}, false)->wait();
    const int64_t fp32 = gradzip::torch_ext::fp32_traffic(n, kWorld);
    expect(reducer.traffic(0) == std::pair{fp32, fp32},
           std::string(codec) + ": an uncompressed bucket reports an fp32 ring all-reduce");
    at::Tensor out = at::empty({n / kWorld});
    at::Tensor x = at::randn({kWorld * (n / kWorld)});
    reducer.reduce_scatter(1, out, x, {x.numel()}, {}, 1.0)->wait();
    expect(reducer.traffic(1) == BucketLayout(parsed, kWorld, {x.numel()},
                                              Collective::reduce_scatter, CastSum::fp32)
                                     .traffic(my_rank),
           std::string(codec) + ": the reduce-scatter reports its layout's bytes");
  }
}

// FSDP's reduce-scatter: rank r's output is its shard of the sum of prescale * g, summed in fp32.
void check_reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  constexpr int64_t shard = kN / kWorld;  // the input is W whole shards
  const Values g0 = gradient(0, 0), g1 = gradient(1, 0), mine = gradient(my_rank, 0);
  const int64_t lo = my_rank * shard;
  for (const auto& [codec, prescale] : {std::pair{"fp32", 1.0}, std::pair{"bf16", 0.5}}) {
    CompressedAllreduce reducer(group, codec);
    at::Tensor x = to_tensor(Values(mine.begin(), mine.begin() + kWorld * shard));
    at::Tensor residual = at::zeros_like(x);
    at::Tensor out = at::full({shard}, NAN, at::kFloat);
    reducer.reduce_scatter(0, out, x, {kWorld * shard}, residual, prescale)->wait();
    const Values got = values(out), res = values(residual);
    int64_t wrong = 0, wrong_residual = 0;
    for (int64_t i = 0; i < shard; ++i) {
      const double a = static_cast<float>(g0[lo + i] * prescale),
                   b = static_cast<float>(g1[lo + i] * prescale);
      const double want = std::string(codec) == "fp32" ? static_cast<float>(a + b)
                                                       : static_cast<float>(bf16(a) + bf16(b));
      if (got[i] != want) ++wrong;
    }
    for (int64_t i = 0; i < kWorld * shard; ++i) {
      const double c = static_cast<float>(mine[i] * prescale);
      if (res[i] != (std::string(codec) == "fp32" ? 0.0 : c - bf16(c))) ++wrong_residual;
    }
    expect(wrong == 0, std::string(codec) + " reduce-scatter: the shard of the sum (" +
                           std::to_string(wrong) + " elements differ)");
    expect(wrong_residual == 0, std::string(codec) + " reduce-scatter residual (" +
                                    std::to_string(wrong_residual) + " elements differ)");
  }
}

// Buckets in flight together: three int8 buckets (two-phase) reduced at once, their all-gathers on
// a second group while the next bucket's all-to-all runs on the first, give what the same buckets
// give reduced one at a time with no second group, bit for bit.
void check_pipelined(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     const c10::intrusive_ptr<c10d::ProcessGroup>& gather) {
  constexpr int kBuckets = 3;
  auto bucket = [](int b) { return to_tensor(gradient(my_rank, 10 + b)); };
  std::vector<Values> one_at_a_time;
  {
    CompressedAllreduce reducer(group, "int8");
    for (int b = 0; b < kBuckets; ++b) {
      at::Tensor g = bucket(b), res = at::zeros({kN});
      reducer.reduce(b, g, g, {kN}, res, {}, true)->wait();
      one_at_a_time.push_back(values(g));
    }
  }
  CompressedAllreduce reducer(group, "int8", {}, gradzip::torch_ext::CastSum::wire, gather);
  std::vector<at::Tensor> grads, residuals;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  for (int b = 0; b < kBuckets; ++b) {
    grads.push_back(bucket(b));
    residuals.push_back(at::zeros({kN}));
    futures.push_back(reducer.reduce(b, grads[b], grads[b], {kN}, residuals[b], {}, true));
  }
  for (int b = 0; b < kBuckets; ++b) {
    futures[b]->wait();
    expect(values(grads[b]) == one_at_a_time[b],
           "pipelined int8 bucket " + std::to_string(b) + " equals the one-at-a-time reduction");
  }
}

// A bucket reduced in chunks (a few hundred elements, their all-gathers on a second group, each
// chunk's phases overlapping the next chunk's collectives) gives the bits of the bucket reduced in
// one piece: the average, the residual and the owner's residual, over two steps of error feedback,
// for a bucket of four tensors of odd sizes, one of them exact, and every codec that is chunked.
void check_chunked(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                   const c10::intrusive_ptr<c10d::ProcessGroup>& gather) {
  using gradzip::torch_ext::BucketLayout;
  using gradzip::torch_ext::CastSum;
  const std::vector<int64_t> numels{3001, 50, 5000, kN - 8051};
  const std::vector<bool> exact{false, true, false, false};
  constexpr int64_t kChunk = 1500;
  const std::vector<int64_t> starts = gradzip::torch_ext::shard_starts(kN, kWorld);
  const int64_t shard = starts[my_rank + 1] - starts[my_rank];
  for (const auto& [codec, cast_sum] :
       {std::pair{"int8", CastSum::wire}, std::pair{"sign:block=256", CastSum::wire},
        std::pair{"bf16", CastSum::fp32}, std::pair{"bf16", CastSum::wire}}) {
    const std::string name = std::string(codec) + (cast_sum == CastSum::fp32 ? " (fp32 sum)" : "");
    const gradzip::Codec parsed = gradzip::Codec::parse(codec);
    const BucketLayout whole(parsed, kWorld, numels, gradzip::torch_ext::Collective::allreduce,
                             cast_sum, exact);
    const std::vector<BucketLayout> chunks = whole.chunks(parsed, kChunk);
    int64_t carried = 0;
    for (const BucketLayout& c : chunks) carried += c.count;
    expect(chunks.size() > 1 && carried == kN,
           name + ": cut into chunks that carry every element once");
    const bool two_phase = whole.two_phase;
    CompressedAllreduce one_piece(group, codec, {}, cast_sum, {}, int64_t{1} << 40);
    CompressedAllreduce chunked(group, codec, {}, cast_sum, gather, kChunk);
    at::Tensor res1 = at::zeros({kN}), res2 = at::zeros({kN});
    at::Tensor own1 = two_phase ? at::zeros({shard}) : at::Tensor();
    at::Tensor own2 = two_phase ? at::zeros({shard}) : at::Tensor();
    for (int step = 0; step < 2; ++step) {
      at::Tensor g1 = to_tensor(gradient(my_rank, 20 + step)), g2 = g1.clone();
      one_piece.reduce(0, g1, g1, numels, res1, own1, true, exact)->wait();
      chunked.reduce(0, g2, g2, numels, res2, own2, true, exact)->wait();
      expect(values(g1) == values(g2) && values(res1) == values(res2) &&
                 (!two_phase || values(own1) == values(own2)),
             name + ", step " + std::to_string(step) +
                 ": the chunked bucket gives the bits of the bucket in one piece");
    }
    expect(chunked.traffic(0) == one_piece.traffic(0),
           name + ": the chunks report the whole bucket's bytes");
  }
}

int run_rank(int rank, const std::string& store_path) {
  my_rank = rank;
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, kWorld);
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, kWorld, options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, kWorld);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);

  check_casts_and_fallback(group);
  check_int8_and_sign(group);
  check_topk(group);
  check_reduce_scatter(group);
  check_traffic(group);
  // The second group's Gloo pairs on keys of their own in the same store.
  auto gather_store = c10::make_intrusive<c10d::PrefixStore>("gather", store);
  auto gather_gloo =
      c10::make_intrusive<c10d::ProcessGroupGloo>(gather_store, rank, kWorld, options);
  auto gather = c10::make_intrusive<c10d::ProcessGroup>(gather_store, rank, kWorld);
  gather->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gather_gloo);
  gather->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  check_pipelined(group, gather);
  check_chunked(group, gather);
  group->barrier()->wait();  // finish together: a peer may still read the last collective
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  char dir[] = "/tmp/gradzip_gloo_XXXXXX";
  if (!mkdtemp(dir)) return 2;
  const std::string store_path = std::string(dir) + "/store";
  std::vector<pid_t> children;
  for (int rank = 0; rank < kWorld; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(100);  // a hang fails instead of blocking CTest
      int rc = 1;
      try {
        rc = run_rank(rank, store_path);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      }
      std::fflush(stderr);
      _exit(rc);
    }
    children.push_back(pid);
  }
  int failed = 0;
  for (const pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::remove(store_path.c_str());
  rmdir(dir);
  std::printf("%s\n", failed ? "FAILED" : "compressed all-reduce over ProcessGroupGloo: all checks passed");
  return failed ? 1 : 0;
}
