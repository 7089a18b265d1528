// The compressed all-reduce (and FSDP's reduce-scatter) from C++ alone, as docs/cpp.md shows it: 2 processes, a
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

#include "bucket_reduction.hpp"
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

// BucketLayout::chunks over random buckets (tensor sizes, exact flags, W, codecs, block sizes and
// chunk sizes): the chunks tile every shard in order, each cut is where the whole bucket's
// messages could be cut without moving a block (a piece's start, inside an exact piece, a multiple
// of the block from a compressed piece's start), and every chunk piece keeps its piece's codec.
void check_chunk_layouts() {
  using gradzip::torch_ext::BucketLayout;
  using gradzip::torch_ext::CastSum;
  using gradzip::torch_ext::Piece;
  std::mt19937 rng(7);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const char* specs[] = {"int8", "int8:block=32", "sign", "sign:block=4096", "bf16"};
  int64_t cut = 0, cut_in_exact = 0, fell_back = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::string spec = specs[trial % 5];
    const gradzip::Codec codec = gradzip::Codec::parse(spec);
    const int64_t world = uniform(2, 5);
    std::vector<int64_t> numels;
    std::vector<bool> exact;
    for (int64_t t = uniform(1, 6); t > 0; --t) {
      numels.push_back(uniform(1, 3) == 1 ? uniform(1, 100) : uniform(100, 20000));
      exact.push_back(uniform(1, 4) == 1);
    }
    int64_t n = 0;
    for (const int64_t m : numels) n += m;
    if (n < world) continue;
    const CastSum cast_sum = spec == "bf16" ? CastSum::fp32 : CastSum::wire;
    const BucketLayout whole(codec, world, numels, gradzip::torch_ext::Collective::allreduce,
                             cast_sum, exact);
    const int64_t elements = uniform(1, 3) == 1 ? uniform(1, 64) : uniform(65, 3 * n + 65);
    const std::vector<BucketLayout> chunks = whole.chunks(codec, elements);
    const int64_t block = spec == "bf16" ? 1 : codec.spec().block;
    const bool wanted_more = (n + elements - 1) / elements > 1;
    if (chunks.size() == 1) {
      fell_back += wanted_more;
      expect(chunks[0] == whole, spec + ": one chunk is the whole bucket");
      continue;
    }
    for (int64_t j = 0; j < world; ++j) {
      int64_t at = 0;
      for (const BucketLayout& c : chunks) {
        const std::string where = spec + ", W " + std::to_string(world) + ", shard " +
                                  std::to_string(j) + ", cut " + std::to_string(at);
        expect(c.offsets[j] == at && c.window(j) > 0, where + ": the chunks tile the shard");
        // The whole bucket's piece holding the cut, and the chunk's pieces against it.
        int64_t start = 0;
        for (const Piece& p : whole.pieces[j]) {
          if (at >= start && at < start + p.len && at > 0) {
            const bool ok = at == start || p.exact || (at - start) % block == 0;
            expect(ok, where + ": a cut moves no block");
            cut += 1;
            cut_in_exact += p.exact && at > start;
          }
          start += p.len;
        }
        int64_t pos = at;
        for (const Piece& q : c.pieces[j]) {
          int64_t s0 = 0;
          for (const Piece& p : whole.pieces[j]) {
            if (pos >= s0 && pos < s0 + p.len)
              expect(q.exact == p.exact && pos + q.len <= s0 + p.len,
                     where + ": a chunk piece lies in one piece and keeps its codec");
            s0 += p.len;
          }
          pos += q.len;
        }
        at += c.window(j);
      }
      expect(at == whole.shard_size(j), spec + ": the chunks cover the shard");
    }
  }
  expect(cut > 100 && cut_in_exact > 10 && fell_back > 10,
         "the random buckets cut often, inside exact pieces too, and fell back to fewer chunks "
         "(cuts " + std::to_string(cut) + ", in exact " + std::to_string(cut_in_exact) +
             ", fell back " + std::to_string(fell_back) + ")");
}

// A bucket reduced in chunks (a few hundred elements, each chunk's phases overlapping the next
// chunk's collectives) gives the bits of the bucket reduced in one piece: the average, the residual
// and the owner's residual, over two steps of error feedback, for every codec that is chunked, on
// buckets of tensors of odd sizes with an exact one (cut inside it in the second bucket), with the
// all-gathers on a second group and in call order on the first; a block of 4096 leaves fewer chunks
// than the seven asked for.
void check_chunked(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                   const c10::intrusive_ptr<c10d::ProcessGroup>& gather) {
  using gradzip::torch_ext::BucketLayout;
  using gradzip::torch_ext::CastSum;
  constexpr int64_t kChunk = 1500;
  bool threw = false;
  try {
    CompressedAllreduce tiny(group, "int8", {}, CastSum::wire, {}, 100);
  } catch (const c10::ValueError&) {
    threw = true;
  }
  expect(threw, "a chunk of fewer than 1024 elements is a ValueError");
  const std::vector<int64_t> starts = gradzip::torch_ext::shard_starts(kN, kWorld);
  const int64_t shard = starts[my_rank + 1] - starts[my_rank];
  const std::vector<std::pair<std::vector<int64_t>, std::vector<bool>>> buckets{
      {{3001, 50, 5000, kN - 8051}, {false, true, false, false}},
      {{3001, 4000, kN - 7001}, {false, true, false}}};
  for (const auto& [numels, exact] : buckets) {
    for (const auto& [codec, cast_sum] :
         {std::pair{"int8", CastSum::wire}, std::pair{"sign:block=256", CastSum::wire},
          std::pair{"sign:block=4096", CastSum::wire}, std::pair{"bf16", CastSum::fp32},
          std::pair{"bf16", CastSum::wire}, std::pair{"fp32", CastSum::wire}}) {
      const std::string name = std::string(codec) + (cast_sum == CastSum::fp32 ? " (fp32 sum)" : "") +
                               ", " + std::to_string(numels.size()) + " tensors";
      const gradzip::Codec parsed = gradzip::Codec::parse(codec);
      const BucketLayout whole(parsed, kWorld, numels, gradzip::torch_ext::Collective::allreduce,
                               cast_sum, exact);
      const std::vector<BucketLayout> chunks = whole.chunks(parsed, kChunk);
      int64_t carried = 0;
      for (const BucketLayout& c : chunks) carried += c.count;
      // A block of 4096 leaves two chunks of the first bucket, and none of the second: each shard
      // of it ends in a compressed piece of a single block, which no cut may enter.
      const size_t expected = std::string(codec) != "sign:block=4096" ? 7 : numels.size() == 4 ? 2 : 1;
      expect(chunks.size() == expected && carried == kN,
             name + ": cut into " + std::to_string(chunks.size()) + " chunks that carry every "
             "element once");
      const bool two_phase = whole.two_phase;
      CompressedAllreduce one_piece(group, codec, {}, cast_sum, {}, int64_t{1} << 40);
      CompressedAllreduce chunked(group, codec, {}, cast_sum, gather, kChunk);
      CompressedAllreduce in_call_order(group, codec, {}, cast_sum, {}, kChunk);
      std::vector<at::Tensor> res, own;
      for (int way = 0; way < 3; ++way) {
        res.push_back(at::zeros({kN}));
        own.push_back(two_phase ? at::zeros({shard}) : at::Tensor());
      }
      for (int step = 0; step < 2; ++step) {
        const at::Tensor g = to_tensor(gradient(my_rank, 20 + step));
        std::vector<at::Tensor> out;
        CompressedAllreduce* ways[] = {&one_piece, &chunked, &in_call_order};
        for (int way = 0; way < 3; ++way) {
          out.push_back(g.clone());
          ways[way]->reduce(0, out[way], out[way], numels, res[way], own[way], true, exact)
              ->wait();
        }
        for (int way = 1; way < 3; ++way)
          expect(values(out[0]) == values(out[way]) && values(res[0]) == values(res[way]) &&
                     (!two_phase || values(own[0]) == values(own[way])),
                 name + ", step " + std::to_string(step) +
                     (way == 1 ? ", all-gathers on a second group" : ", in call order") +
                     ": the chunked bucket gives the bits of the bucket in one piece");
      }
    }
  }
}

// lowrank:R through the same reduce(), given each tensor's rows and the bucket's Q factors: both
// ranks hold the same rank-1 matrix and a 1-D tensor, so the rank-1 average is the matrix itself
// (to float rounding), the 1-D tensor travels whole, and the two fp32 all-reduces are the bytes.
void check_lowrank(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  constexpr int64_t rows = 50, cols = 40, bias = 30;
  at::manual_seed(7);  // the same on both ranks
  const at::Tensor matrix = at::outer(at::randn({rows}), at::randn({cols}));
  const at::Tensor g = at::cat({matrix.reshape(-1), at::randn({bias})});
  CompressedAllreduce reducer(group, "lowrank:1");
  at::Tensor x = g.clone(), residual = at::zeros_like(g), q = at::randn({cols});
  reducer.reduce(0, x, x, {rows * cols, bias}, residual, {}, true, {}, {rows, bias}, q)->wait();
  expect(at::allclose(x, g, 1e-4, 1e-5), "lowrank:1 of a rank-1 matrix is the matrix");
  expect(residual.abs().max().item<float>() < 1e-5, "lowrank:1 of a rank-1 matrix leaves none");
  const int64_t bytes = gradzip::torch_ext::fp32_traffic(rows + bias, kWorld) +
                        gradzip::torch_ext::fp32_traffic(cols, kWorld);
  expect(reducer.traffic(0) == std::pair{bytes, bytes}, "lowrank: two fp32 all-reduces' bytes");
  bool threw = false;
  try {
    reducer.reduce_scatter(1, at::empty({g.numel() / kWorld}), g.clone(), {g.numel()}, {}, 1.0);
  } catch (const c10::ValueError&) {
    threw = true;
  }
  expect(threw, "lowrank has no reduce-scatter (a ValueError)");
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

  if (rank == 0) check_chunk_layouts();  // no collectives: one rank is enough
  check_casts_and_fallback(group);
  check_int8_and_sign(group);
  check_topk(group);
  check_reduce_scatter(group);
  check_traffic(group);
  check_lowrank(group);
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
