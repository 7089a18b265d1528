// Exact top-k on the CPU, two ways to the same bytes (the selection is unique: largest keys, ties
// to the lowest indices).
//
// Sampled (k up to about n / 4; two passes over the input): a fixed sample of keys gives a bound lo
// that lies below the k-th largest key with overwhelming probability; one read-only pass keeps
// every element with key >= lo as an (index, c) pair, the exact threshold is selected among those
// pairs (a few percent of n, in cache), the pairs give the output, and with error feedback one
// streaming pass rewrites the residual. If the bound was too high (fewer than k pairs) or a chunk
// has more pairs than its workspace holds, the full radix select below runs instead.
//
// Full radix select (passes over the input, each a kernel call per chunk, chunks fixed by n):
//   1. histogram of the first digit of every key;
//   2. compaction of the indices whose first digit is the threshold's (the "candidates"), with a
//      count per chunk of the keys above it;
//   3. digits 2 and 3 refine the threshold over the candidates only (usually a few percent);
//   4. emit: keys above the threshold, plus the first `quota` ties of each chunk (lowest indices
//      first across chunks), written at a per-chunk offset; the residual is updated in the same
//      pass.
#include "topk.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>

#include "cpu_table.hpp"
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
  size_t pairs = 0;       // sampled path: (index, c) pairs stored
  size_t candidates = 0;  // keys equal to the threshold (so far, while it is refined)
  uint64_t above = 0;     // keys above the threshold
  uint64_t quota = 0;     // ties this chunk keeps
  uint64_t offset = 0;    // first output slot
};

struct Plan {
  const CpuLoops& loops;
  EncodeArgs a;
  size_t n;
  uint64_t k;
  uint32_t* idx;
  void* values;
  TopkValues value_type;
  uint32_t* int8_amax;  // int8 values, sampled path: per index chunk, the max kept key
  uint32_t* cand;
  std::array<Chunk, kTopkMaxChunks> chunks{};
  size_t nch = 0;
  int threads = 1;

  // Ties go to the lowest indices: each chunk keeps its ties while `ties` lasts, in chunk order;
  // its output starts after everything the chunks before it keep.
  void assign_offsets(uint64_t ties) {
    uint64_t offset = 0;
    for (size_t c = 0; c < nch; ++c) {
      Chunk& ch = chunks[c];
      ch.quota = ch.candidates < ties ? ch.candidates : ties;
      ties -= ch.quota;
      ch.offset = offset;
      offset += ch.above + ch.quota;
    }
    if (offset != k || ties != 0)
      throw Error(Status::invalid_argument, "gradzip: top-k selection inconsistent");
  }
};

// A histogram over every chunk: count(c, local) adds chunk c's counts to its thread's local
// histogram; the locals are merged (integer sums, so the order does not matter).
template <class F>
Hist chunk_histogram(const Plan& p, int threads, F&& count) {
  Hist hist{};
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const IeeeFloatMode ieee;
    alignas(64) uint32_t local[el::kTopkRadix] = {};
#pragma omp for schedule(static)
    for (long long c = 0; c < static_cast<long long>(p.nch); ++c)
      count(static_cast<size_t>(c), local);
#pragma omp critical(gradzip_topk_hist)
    for (int d = 0; d < el::kTopkRadix; ++d) hist[d] += local[d];
  }
  return hist;
}

// ---- sampled path -----------------------------------------------------------------------------
constexpr size_t kSampleSize = 4096;  // on the stack: nothing allocates on the hot path

// A key that is at most the k-th largest unless the sample is far off: the sample's key of rank
// (expected count above the threshold) + 4 standard deviations + 8. False when that rank is past a
// quarter of the sample: for k that large a fraction of n the full radix select is faster
// (measured on 16M elements: the sampled path wins at 10 %, loses at 30 %).
bool sample_bound(const Plan& p, uint32_t& lo) {
  const size_t s = p.n < kSampleSize ? p.n : kSampleSize;
  const double expected = static_cast<double>(p.k) * static_cast<double>(s) / static_cast<double>(p.n);
  const size_t rank = static_cast<size_t>(expected + 4.0 * std::sqrt(expected) + 8.0);
  if (4 * rank > s) return false;
  std::array<uint32_t, kSampleSize> keys;
  for (size_t j = 0; j < s; ++j) keys[j] = el::topk_key(encode_input(p.a, j * p.n / s));
  std::nth_element(keys.begin(), keys.begin() + static_cast<long>(rank - 1),
                   keys.begin() + static_cast<long>(s), std::greater<>());
  // Exact zeros are common (sparse gradients) and would make every element a pair.
  lo = keys[rank - 1] > 0 ? keys[rank - 1] : 1;
  return true;
}

// A chunk's pairs live in its own workspace range: indices in the first half, bits of c in the
// second.
size_t pair_cap(const Chunk& ch) { return ch.len / 2; }
uint32_t* pair_idx(const Plan& p, const Chunk& ch) { return p.cand + ch.begin; }
uint32_t* pair_bits(const Plan& p, const Chunk& ch) { return p.cand + ch.begin + pair_cap(ch); }

// Calls f(output slot, index, bits of c) for each pair of chunk ch that the selection keeps (keys
// above the threshold, and the chunk's quota of keys equal to it), in index order.
template <class F>
void each_kept(const Plan& p, const Chunk& ch, uint32_t threshold, F&& f) {
  const uint32_t* pidx = pair_idx(p, ch);
  const uint32_t* bits = pair_bits(p, ch);
  uint64_t ties = ch.quota, o = ch.offset;
  for (size_t j = 0; j < ch.pairs; ++j) {
    const uint32_t key = bits[j] & el::kAbsMask;
    if (key < threshold) continue;
    if (key == threshold) {
      if (ties == 0) continue;
      --ties;
    }
    f(o++, pidx[j], bits[j]);
  }
}

// *at = max(*at, v) among threads (an index chunk can span two of the selection's chunks).
void atomic_max(uint32_t* at, uint32_t v) {
  uint32_t seen = __atomic_load_n(at, __ATOMIC_RELAXED);
  while (seen < v &&
         !__atomic_compare_exchange_n(at, &seen, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

bool sampled_topk(Plan& p) {
  uint32_t lo = 0;
  if (!sample_bound(p, lo)) return false;
  std::atomic<bool> fits{true};
  parallel_items(p.nch, p.threads, [&](size_t c) {
    Chunk& ch = p.chunks[c];
    ch.pairs = p.loops.topk.gather(p.a.at(ch.begin), ch.len, static_cast<uint32_t>(ch.begin), lo,
                                   pair_cap(ch), pair_idx(p, ch), pair_bits(p, ch));
    if (ch.pairs > pair_cap(ch)) fits.store(false, std::memory_order_relaxed);
  });
  size_t total = 0;
  for (size_t c = 0; c < p.nch; ++c) total += p.chunks[c].pairs;
  if (!fits.load() || total < p.k) return false;

  // The threshold among the pairs: every key above it is a pair, so ranks there are global.
  const int threads = total < kMinElementsPerThread * 8 ? 1 : p.threads;
  uint64_t rank = p.k;
  uint32_t prefix = 0, prefix_mask = 0;
  for (int level = 0; level < 3; ++level) {
    const int shift = el::kTopkDigitShift[level];
    const uint32_t mask = el::kTopkDigitMask[level];
    const Hist hist = chunk_histogram(p, threads, [&](size_t c, uint32_t* local) {
      const Chunk& ch = p.chunks[c];
      const uint32_t* bits = pair_bits(p, ch);
      for (size_t j = 0; j < ch.pairs; ++j) {
        const uint32_t key = bits[j] & el::kAbsMask;
        if ((key & prefix_mask) == prefix) ++local[(key >> shift) & mask];
      }
    });
    prefix |= select_digit(hist, mask + 1, rank) << shift;
    prefix_mask |= mask << shift;
  }
  const uint32_t threshold = prefix;

  parallel_items(p.nch, threads, [&](size_t c) {
    Chunk& ch = p.chunks[c];
    const uint32_t* bits = pair_bits(p, ch);
    uint64_t above = 0, ties = 0;
    for (size_t j = 0; j < ch.pairs; ++j) {
      const uint32_t key = bits[j] & el::kAbsMask;
      above += key > threshold;
      ties += key == threshold;
    }
    ch.above = above;
    ch.candidates = ties;
  });
  p.assign_offsets(rank);

  // Output from the pairs (in index order), then (error feedback) the residual pass. int8
  // values: the first pass takes each index chunk's max kept key, a second one the levels.
  const bool int8 = p.value_type == TopkValues::int8;
  if (int8) std::memset(p.int8_amax, 0, 4 * topk_index_chunks(p.n));
  parallel_items(p.nch, threads, [&](size_t c) {
    uint64_t chunk = 0;
    uint32_t amax = 0;
    each_kept(p, p.chunks[c], threshold, [&](uint64_t o, uint32_t index, uint32_t bits) {
      p.idx[o] = index;
      if (!int8) {
        el::topk_put_value(p.values, o, el::bits_float(bits), p.value_type);
      } else {
        if (index / kTopkIndexChunk != chunk) {
          atomic_max(p.int8_amax + chunk, amax);
          chunk = index / kTopkIndexChunk;
          amax = 0;
        }
        const uint32_t key = bits & el::kAbsMask;
        amax = key > amax ? key : amax;
      }
    });
    if (int8) atomic_max(p.int8_amax + chunk, amax);
  });
  if (int8)
    parallel_items(p.nch, threads, [&](size_t c) {
      each_kept(p, p.chunks[c], threshold, [&](uint64_t o, uint32_t index, uint32_t bits) {
        static_cast<int8_t*>(p.values)[o] = static_cast<int8_t>(
            el::topk_int8_level(el::bits_float(bits), p.int8_amax[index / kTopkIndexChunk]));
      });
    });
  if (p.a.residual)
    parallel_items(p.nch, p.threads, [&](size_t c) {
      const Chunk& ch = p.chunks[c];
      p.loops.topk.residual(p.a.at(ch.begin), ch.len, static_cast<uint32_t>(ch.begin),
                            p.idx + ch.offset, ch.above + ch.quota, p.value_type, p.int8_amax);
    });
  return true;
}

// ---- full radix select ------------------------------------------------------------------------
std::atomic<uint64_t> radix_runs{0};

void radix_topk(Plan& p) {
  radix_runs.fetch_add(1, std::memory_order_relaxed);
  // 1. first-digit histogram
  const Hist hist0 = chunk_histogram(p, p.threads, [&](size_t c, uint32_t* local) {
    p.loops.topk.hist0(p.a.at(p.chunks[c].begin), p.chunks[c].len, local);
  });
  uint64_t rank = p.k;
  const uint32_t d0 = select_digit(hist0, el::kTopkDigitMask[0] + 1, rank);

  // 2. candidates of the threshold bucket
  parallel_items(p.nch, p.threads, [&](size_t c) {
    Chunk& ch = p.chunks[c];
    ch.candidates = p.loops.topk.collect(p.a.at(ch.begin), ch.len, static_cast<uint32_t>(ch.begin),
                                         d0, p.cand + ch.begin, &ch.above);
  });

  // 3. remaining digits over the candidates (serial when few: a parallel region costs more)
  size_t total = 0;
  for (size_t c = 0; c < p.nch; ++c) total += p.chunks[c].candidates;
  const int cand_threads = total < kMinElementsPerThread * 8 ? 1 : p.threads;
  uint32_t threshold = d0 << el::kTopkDigitShift[0];
  for (int level = 1; level < 3; ++level) {
    const int shift = el::kTopkDigitShift[level];
    const uint32_t mask = el::kTopkDigitMask[level];
    auto digit = [&](uint32_t i) { return (el::topk_key(encode_input(p.a, i)) >> shift) & mask; };
    const Hist hist = chunk_histogram(p, cand_threads, [&](size_t c, uint32_t* local) {
      const uint32_t* cc = p.cand + p.chunks[c].begin;
      for (size_t j = 0; j < p.chunks[c].candidates; ++j) ++local[digit(cc[j])];
    });
    const uint32_t dl = select_digit(hist, mask + 1, rank);
    threshold |= dl << shift;
    parallel_items(p.nch, cand_threads, [&](size_t c) {
      Chunk& ch = p.chunks[c];
      uint32_t* cc = p.cand + ch.begin;
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

  // 4. quotas and output offsets, then emit
  p.assign_offsets(rank);
  const uint64_t value_size = topk_value_bytes(p.value_type);
  std::atomic<bool> consistent{true};
  parallel_items(p.nch, p.threads, [&](size_t c) {
    const Chunk& ch = p.chunks[c];
    const size_t kept = p.loops.topk.emit(
        p.a.at(ch.begin), ch.len, static_cast<uint32_t>(ch.begin), threshold, ch.quota,
        p.idx + ch.offset, static_cast<char*>(p.values) + ch.offset * value_size, p.value_type);
    if (kept != ch.above + ch.quota) consistent.store(false, std::memory_order_relaxed);
  });
  if (!consistent.load())
    throw Error(Status::invalid_argument, "gradzip: top-k emit inconsistent (input modified "
                                          "during encode?)");
}

// The wire's index sections from the k kept indices (strictly increasing): each chunk's end (the
// kept indices below the next chunk's first), then every index's offset in its chunk; padding zero.
void write_indices(const uint32_t* idx, uint64_t k, size_t n, const PayloadLayout& l,
                   char* payload) {
  const uint64_t chunks = topk_index_chunks(n);
  auto* ends = reinterpret_cast<uint32_t*>(payload + l.section0);
  const uint32_t* from = idx;
  for (uint64_t c = 0; c < chunks; ++c) {
    const uint64_t next = (c + 1) * kTopkIndexChunk;
    from = next > UINT32_MAX ? idx + k
                             : std::lower_bound(from, idx + k, static_cast<uint32_t>(next));
    ends[c] = static_cast<uint32_t>(from - idx);
  }
  std::memset(payload + 4 * chunks, 0, l.section1 - 4 * chunks);
  auto* offsets = reinterpret_cast<uint16_t*>(payload + l.section1);
  parallel_ranges(k, 16, [&](size_t b, size_t e) {
    for (size_t j = b; j < e; ++j) offsets[j] = static_cast<uint16_t>(idx[j] % kTopkIndexChunk);
  });
  std::memset(payload + l.section1 + 2 * k, 0, l.section2 - l.section1 - 2 * k);
}

// int8 values after the full radix select, which left the kept elements' residuals untouched:
// per index chunk, its kept values c (computed again, as the selection did, into `scratch`: the
// candidates' workspace, free now) give the chunk's scale, then their int8s and residuals. (The
// sampled path quantizes from its pairs instead.)
void quantize_int8_values(const EncodeArgs& a, const uint32_t* idx, uint64_t k, size_t n,
                          const PayloadLayout& l, char* payload, float* scratch) {
  const auto* ends = reinterpret_cast<const uint32_t*>(payload + l.section0);
  auto* q = reinterpret_cast<int8_t*>(payload + l.section2);
  auto* scales = reinterpret_cast<float*>(payload + l.section3);
  parallel_items(topk_index_chunks(n), threads_for(k), [&](size_t c) {
    const uint64_t begin = c == 0 ? 0 : ends[c - 1], count = ends[c] - begin;
    const uint32_t* at = idx + begin;
    float* kept = scratch + begin;
    // Scattered reads: ask for the lines a few elements ahead.
    constexpr uint64_t kAhead = 16;
    for (uint64_t j = 0; j < count; ++j) {
      if (j + kAhead < count) {
        __builtin_prefetch(a.grad + at[j + kAhead]);
        if (a.residual) __builtin_prefetch(a.residual + at[j + kAhead]);
      }
      kept[j] = encode_input(a, at[j]);
    }
    scales[c] = el::topk_quantize_chunk(
        count, [&](uint64_t j) { return kept[j]; },
        [&](uint64_t j, float cj, int8_t level, float decoded) {
          q[begin + j] = level;
          if (a.residual) a.residual[at[j]] = el::ef_residual(cj, decoded, a.residual[at[j]]);
        });
  });
}

}  // namespace

void encode_cpu(TopkCodec, const CpuEncode& job) {
  const uint64_t k = job.param;
  if (k == 0) return;
  const size_t n = job.n;
  Plan p{job.loops,
         job.a,
         n,
         k,
         topk_kept_indices(job.workspace, n),
         job.payload + job.layout.section2,
         job.spec.values,
         reinterpret_cast<uint32_t*>(job.payload + job.layout.section3),
         static_cast<uint32_t*>(job.workspace)};
  const size_t clen = topk_chunk_len(n);
  p.nch = topk_num_chunks(n);
  for (size_t c = 0; c < p.nch; ++c) {
    p.chunks[c].begin = c * clen;
    p.chunks[c].len = (c + 1) * clen < n ? clen : n - c * clen;
  }
  p.threads = threads_for(n) < static_cast<int>(p.nch) ? threads_for(n) : static_cast<int>(p.nch);
  const bool sampled = sampled_topk(p);
  if (!sampled) {
    for (size_t c = 0; c < p.nch; ++c) p.chunks[c] = Chunk{p.chunks[c].begin, p.chunks[c].len};
    radix_topk(p);
  }
  write_indices(p.idx, k, n, job.layout, job.payload);
  if (p.value_type != TopkValues::int8) return;
  std::memset(job.payload + job.layout.section2 + k, 0,
              job.layout.section3 - job.layout.section2 - k);
  if (sampled) {  // the levels are written: the scales from the chunks' max keys
    auto* scales = reinterpret_cast<float*>(p.int8_amax);
    for (uint64_t c = 0; c < topk_index_chunks(n); ++c) scales[c] = el::int8_scale(p.int8_amax[c]);
  } else {
    quantize_int8_values(job.a, p.idx, k, n, job.layout, job.payload,
                         reinterpret_cast<float*>(p.cand));
  }
}

void decode_cpu(TopkCodec, const CpuDecode& job) {
  float* out = job.out;
  const bool add = job.add;
  if (!add)
    parallel_ranges(job.n, 16, [&](size_t b, size_t e) {
      std::memset(out + b, 0, (e - b) * sizeof(float));
    });
  const auto* payload = reinterpret_cast<const uint8_t*>(job.payload);
  const auto* ends = reinterpret_cast<const uint32_t*>(job.payload + job.layout.section0);
  const auto* offsets = reinterpret_cast<const uint16_t*>(job.payload + job.layout.section1);
  const size_t kk = job.header.param;
  const TopkValues v = topk_values(job.header.flags);
  const auto* f32 = reinterpret_cast<const float*>(job.payload + job.layout.section2);
  const auto* f16 = reinterpret_cast<const uint16_t*>(job.payload + job.layout.section2);
  const auto* q = reinterpret_cast<const int8_t*>(job.payload + job.layout.section2);
  const auto* scales = reinterpret_cast<const float*>(job.payload + job.layout.section3);
  // Indices are strictly increasing (validated), so ranges of them write disjoint outputs.
  // fp16 values are widened 256 at a time by the vectorised decoder first: converted inside
  // the scatter loop they made it four times slower.
  parallel_ranges(kk, 16, [&](size_t b, size_t e) {
    alignas(64) float widened[256];
    uint64_t chunk = kk == 0 ? 0 : topk_position(job.header, payload, b).chunk;
    for (size_t s = b; s < e; s += 256) {
      const size_t m = e - s < 256 ? e - s : 256;
      const float* val = f32 + s;
      if (v == TopkValues::fp16) {
        job.loops.fp16.decode(f16 + s, m, widened, false);
        val = widened;
      }
      for (size_t j = 0; j < m; ++j) {
        while (ends[chunk] <= s + j) ++chunk;
        const float x = v == TopkValues::int8 ? el::int8_dequantize(q[s + j], scales[chunk])
                                              : val[j];
        float& o = out[chunk * kTopkIndexChunk + offsets[s + j]];
        o = add ? o + x : x;
      }
    }
  });
}

uint64_t topk_radix_runs() { return radix_runs.load(); }

}  // namespace gradzip::detail
