// Radix select for top-k. Passes over the input (each a kernel call per chunk, chunks fixed by n):
//   1. histogram of the first digit of every key;
//   2. compaction of the indices whose first digit is the threshold's (the "candidates"), with a
//      count per chunk of the keys above it;
//   3. digits 2 and 3 refine the threshold over the candidates only (usually a few percent);
//   4. emit: keys above the threshold, plus the first `quota` ties of each chunk (lowest indices
//      first across chunks), written at a per-chunk offset; the residual is updated in the same
//      pass.
#include "topk.hpp"

#include <array>
#include <atomic>
#include <cstring>

#include "gradzip/gradzip.hpp"
#include "parallel.hpp"
#include "topk_plan.hpp"

namespace gradzip::detail {
namespace {

namespace el = gradzip::element;
using Hist = std::array<uint64_t, el::kTopkRadix>;

// Finds the digit holding the k-th largest key (k >= 1, counted from the top) and turns k into
// the rank inside that digit's bucket.
uint32_t select_digit(const Hist& hist, uint32_t digits, uint64_t& k) {
  for (uint32_t d = digits; d-- > 0;) {
    if (hist[d] >= k) return d;
    k -= hist[d];
  }
  throw Error(Status::invalid_argument, "gradzip: top-k histogram inconsistent (input modified "
                                        "during encode?)");
}

struct Chunk {
  size_t begin = 0, len = 0;
  size_t candidates = 0;  // indices in cand[begin, begin + candidates)
  uint64_t above = 0;     // keys above the threshold found so far
  uint64_t quota = 0;     // ties this chunk keeps
  uint64_t offset = 0;    // first output slot
};

}  // namespace

void encode_topk(const CpuLoops& loops, EncodeArgs a, size_t n, uint64_t k, uint32_t* idx,
                 void* values, bool fp16_values, uint32_t* cand) {
  if (k == 0) return;
  const size_t clen = topk_chunk_len(n);
  const size_t nch = topk_num_chunks(n);
  std::array<Chunk, kTopkMaxChunks> chunks{};
  for (size_t c = 0; c < nch; ++c) {
    chunks[c].begin = c * clen;
    chunks[c].len = (c + 1) * clen < n ? clen : n - c * clen;
  }
  auto args_at = [&](size_t begin) {
    EncodeArgs x = a;
    x.grad += begin;
    if (x.residual) x.residual += begin;
    return x;
  };
  const int threads = threads_for(n) < static_cast<int>(nch) ? threads_for(n) : static_cast<int>(nch);

  // 1. first-digit histogram (per-thread counts merged: integer sums, order-independent)
  Hist hist{};
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const IeeeFloatMode ieee;
    alignas(64) uint32_t local[el::kTopkRadix] = {};
#pragma omp for schedule(static)
    for (long long c = 0; c < static_cast<long long>(nch); ++c)
      loops.topk_hist0(args_at(chunks[c].begin), chunks[c].len, local);
#pragma omp critical(gradzip_topk_hist)
    for (int d = 0; d < el::kTopkRadix; ++d) hist[d] += local[d];
  }
  uint64_t rank = k;
  const uint32_t d0 = select_digit(hist, el::kTopkDigitMask[0] + 1, rank);

  // 2. candidates of the threshold bucket
  parallel_items(nch, threads, [&](size_t c) {
    Chunk& ch = chunks[c];
    ch.candidates = loops.topk_collect(args_at(ch.begin), ch.len, static_cast<uint32_t>(ch.begin),
                                         d0, cand + ch.begin, &ch.above);
  });

  // 3. remaining digits over the candidates (serial when few: a parallel region costs more)
  size_t total = 0;
  for (size_t c = 0; c < nch; ++c) total += chunks[c].candidates;
  const int cand_threads = total < kMinElementsPerThread * 8 ? 1 : threads;
  uint32_t threshold = d0 << el::kTopkDigitShift[0];
  for (int level = 1; level < 3; ++level) {
    const int shift = el::kTopkDigitShift[level];
    const uint32_t mask = el::kTopkDigitMask[level];
    auto digit = [&](uint32_t i) { return (el::topk_key(encode_input(a, i)) >> shift) & mask; };
    hist.fill(0);
#pragma omp parallel num_threads(cand_threads) if (cand_threads > 1)
    {
      const IeeeFloatMode ieee;
      alignas(64) uint32_t local[el::kTopkRadix] = {};
#pragma omp for schedule(static)
      for (long long c = 0; c < static_cast<long long>(nch); ++c) {
        const uint32_t* cc = cand + chunks[c].begin;
        for (size_t j = 0; j < chunks[c].candidates; ++j) ++local[digit(cc[j])];
      }
#pragma omp critical(gradzip_topk_hist)
      for (uint32_t d = 0; d <= mask; ++d) hist[d] += local[d];
    }
    const uint32_t dl = select_digit(hist, mask + 1, rank);
    threshold |= dl << shift;
    parallel_items(nch, cand_threads, [&](size_t c) {
      Chunk& ch = chunks[c];
      uint32_t* cc = cand + ch.begin;
      size_t kept = 0;
      uint64_t above = 0;
      for (size_t j = 0; j < ch.candidates; ++j) {
        const uint32_t d = digit(cc[j]);
        above += d > dl;
        cc[kept] = cc[j];
        kept += d == dl;
      }
      ch.above += above;
      ch.candidates = kept;  // now exactly the keys equal to the threshold so far
    });
  }

  // 4. quotas (lowest indices first) and output offsets, then emit
  uint64_t ties_left = rank, offset = 0;
  for (size_t c = 0; c < nch; ++c) {
    Chunk& ch = chunks[c];
    ch.quota = ch.candidates < ties_left ? ch.candidates : ties_left;
    ties_left -= ch.quota;
    ch.offset = offset;
    offset += ch.above + ch.quota;
  }
  if (offset != k || ties_left != 0)
    throw Error(Status::invalid_argument, "gradzip: top-k selection inconsistent");
  const size_t value_size = fp16_values ? 2 : 4;
  std::atomic<bool> consistent{true};
  parallel_items(nch, threads, [&](size_t c) {
    const Chunk& ch = chunks[c];
    const size_t kept = loops.topk_emit(
        args_at(ch.begin), ch.len, static_cast<uint32_t>(ch.begin), threshold, ch.quota,
        idx + ch.offset, static_cast<char*>(values) + ch.offset * value_size, fp16_values);
    if (kept != ch.above + ch.quota) consistent.store(false, std::memory_order_relaxed);
  });
  if (!consistent.load())
    throw Error(Status::invalid_argument, "gradzip: top-k emit inconsistent (input modified "
                                          "during encode?)");
}

}  // namespace gradzip::detail
