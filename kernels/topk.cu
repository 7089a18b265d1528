// Exact top-k by magnitude: a radix select over element::topk_key with the 11/11/10-bit digits of
// element.hpp, then a deterministic, index-ordered emit. Everything stays on the device; the
// selection state lives in the caller's workspace, so the sequence is a fixed list of launches
// with no host synchronisation. Three passes over the n elements (AIR top-k's scheme):
//   1. hist0:   histogram of digit 0 (key bits 21..30) -> select<0> picks the bucket b0 that holds
//               the k-th largest key;
//   2. collect: per 4096-element tile, counts the keys whose digit 0 is above b0 (all kept), appends
//               the indices of the keys in bucket b0 (the candidates, a few % of n) to a list and
//               builds their digit-1 histogram -> select<1>; then, over the candidates only,
//               the digit-2 histogram -> select<2> gives the threshold key T and the number `need`
//               of keys == T to keep, and the per-tile counts of candidates > T and == T;
//               scan_tiles turns the per-tile counts into exclusive prefixes;
//   3. write:   each tile emits its kept elements at prefix + in-tile rank (indices strictly
//               increasing; ties at T go to the lowest indices, as on the CPU) and updates every
//               residual; the tile that starts a 65536-element chunk writes the previous chunk's
//               end (its own prefix).
// The candidate list is filled with atomics, so its order varies from run to run; it only feeds
// histograms and counts, so the output does not.
#include <algorithm>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/functional>

#include "common.cuh"
#include "topk_workspace.hpp"

namespace gradzip::kernels {
namespace {

constexpr int kV = 4;
constexpr uint32_t kTile = kTopkTile;
constexpr uint32_t kTileSteps = kTile / (kThreads * kV);
constexpr int kSelectThreads = 1024;
constexpr int kScanThreads = 256;  // tile-prefix scan: small, and u64 scans spill at 1024 threads
constexpr int kScanItems = 4;

struct TopkState {
  uint32_t prefix;     // digits chosen so far, in place
  uint32_t mask;       // bits of those digits
  uint32_t remaining;  // elements still to pick inside the current prefix
  uint32_t threshold;  // after digit 2: the k-th largest key T
  uint32_t need;       // after digit 2: how many keys == T are kept (the lowest indices)
  uint32_t candidates; // length of the candidate list (keys whose digit 0 is b0)
  uint32_t pad[2];
};

static_assert(sizeof(TopkState) <= kTopkStateBytes, "the selection state outgrew its slot");
constexpr int kDigit1Shift = el::kTopkDigitShift[1];
constexpr uint32_t kDigit1Mask = el::kTopkDigitMask[1];
constexpr uint32_t kDigit2Mask = el::kTopkDigitMask[2];

__device__ __forceinline__ void flush_histogram(const uint32_t* sh, uint32_t* hist) {
  __syncthreads();
  for (int b = threadIdx.x; b < el::kTopkRadix; b += kThreads)
    if (sh[b] != 0) atomicAdd(&hist[b], sh[b]);
}
__device__ __forceinline__ void zero_histogram(uint32_t* sh) {
  for (int b = threadIdx.x; b < el::kTopkRadix; b += kThreads) sh[b] = 0;
  __syncthreads();
}

// Pass 1: histogram of digit 0 over all elements.
template <bool Vec>
__global__ void __launch_bounds__(kThreads) topk_hist0_kernel(Source src, size_t n, uint32_t* hist) {
  __shared__ uint32_t sh[el::kTopkRadix];
  zero_histogram(sh);
  constexpr int kShift = el::kTopkDigitShift[0];
  constexpr uint32_t kMask = el::kTopkDigitMask[0];
  // Plain shared-memory atomics, as RAFT's AIR top-k does: the keys of a gradient crowd into a
  // few exponent bins, which the hardware's shared atomics absorb.
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads * kV;
  for (size_t i = (static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x) * kV; i < n; i += stride) {
    const int valid = n - i < kV ? static_cast<int>(n - i) : kV;
    float c[kV], r[kV];
    src.load<kV, Vec>(i, valid, c, r);
#pragma unroll
    for (int j = 0; j < kV; ++j)
      if (j < valid) atomicAdd(&sh[(el::topk_key(c[j]) >> kShift) & kMask], 1u);
  }
  flush_histogram(sh, hist);
}

// One block: finds the bin of digit D that holds the remaining-th largest key (suffix sums over
// the bins from the top) and narrows the prefix to it.
template <int D>
__global__ void __launch_bounds__(kSelectThreads)
    topk_select_kernel(TopkState* st, const uint32_t* hist, uint32_t k) {
  using Scan = cub::BlockScan<uint32_t, kSelectThreads>;
  __shared__ typename Scan::TempStorage temp;
  constexpr int kItems = el::kTopkRadix / kSelectThreads;
  const uint32_t remaining = D == 0 ? k : st->remaining;
  const uint32_t prefix = D == 0 ? 0u : st->prefix;
  const uint32_t mask = D == 0 ? 0u : st->mask;
  uint32_t items[kItems], incl[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) items[i] = hist[el::kTopkRadix - 1 - (threadIdx.x * kItems + i)];
  Scan(temp).InclusiveSum(items, incl);  // incl = count of keys in this bin and every bin above
  __syncthreads();                        // every thread has read st before it is rewritten
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const uint32_t above = incl[i] - items[i];
    if (above < remaining && incl[i] >= remaining) {
      const uint32_t bin = el::kTopkRadix - 1 - (threadIdx.x * kItems + i);
      constexpr int kShift = el::kTopkDigitShift[D];
      st->prefix = prefix | (bin << kShift);
      constexpr uint32_t kDigitMask = el::kTopkDigitMask[D];
      st->mask = mask | (kDigitMask << kShift);
      st->remaining = remaining - above;
      if (D == 2) {
        st->threshold = prefix | (bin << kShift);
        st->need = remaining - above;
      }
    }
  }
}

// Pass 2, one block per tile: tile_counts = (#digit 0 above b0) << 32; candidates (digit 0 == b0)
// appended to `cand` (warp-aggregated atomics) and counted in the digit-1 histogram.
template <bool Vec>
__global__ void __launch_bounds__(kThreads)
    topk_collect_kernel(Source src, size_t n, TopkState* st, uint32_t* hist1, uint32_t* cand,
                        uint64_t* tile_counts) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ uint32_t sh[el::kTopkRadix];
  zero_histogram(sh);
  const uint32_t prefix = st->prefix, mask = st->mask;  // digit 0 = b0
  const unsigned lane = threadIdx.x & 31;
  const size_t base = static_cast<size_t>(blockIdx.x) * kTile;
  uint32_t above = 0;
#pragma unroll
  for (uint32_t s = 0; s < kTileSteps; ++s) {  // every lane runs every step: ballots are safe
    const size_t i = base + (s * kThreads + threadIdx.x) * kV;
    const int valid = i >= n ? 0 : (n - i < kV ? static_cast<int>(n - i) : kV);
    float c[kV], r[kV];
    src.load<kV, Vec>(i, valid, c, r);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const uint32_t key = el::topk_key(c[j]);
      const uint32_t top = key & mask;
      const bool in = j < valid && top == prefix;
      if (j < valid && top > prefix) ++above;
      if (in) atomicAdd(&sh[(key >> kDigit1Shift) & kDigit1Mask], 1u);
      const unsigned ballot = __ballot_sync(kFullMask, in);
      if (ballot != 0) {
        uint32_t slot = 0;
        if (lane == 0) slot = atomicAdd(&st->candidates, static_cast<uint32_t>(__popc(ballot)));
        slot = __shfl_sync(kFullMask, slot, 0);
        if (in) cand[slot + __popc(ballot & ((1u << lane) - 1u))] = static_cast<uint32_t>(i + j);
      }
    }
  }
  const uint32_t total = Reduce(temp).Sum(above);
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = uint64_t{total} << 32;
  flush_histogram(sh, hist1);
}

// The key of candidate element idx (recomputed from the input: the list holds indices only).
__device__ __forceinline__ uint32_t candidate_key(const Source& src, uint32_t idx) {
  float c[1], r[1];
  src.load<1, false>(idx, 1, c, r);
  return el::topk_key(c[0]);
}

// Digit-2 histogram of the candidates inside the digits chosen so far.
__global__ void __launch_bounds__(kThreads)
    topk_candidate_hist_kernel(Source src, const TopkState* st, const uint32_t* cand, uint32_t* hist2) {
  __shared__ uint32_t sh[el::kTopkRadix];
  zero_histogram(sh);
  const uint32_t prefix = st->prefix, mask = st->mask, count = st->candidates;
  for (uint64_t j = uint64_t{blockIdx.x} * kThreads + threadIdx.x; j < count; j += uint64_t{gridDim.x} * kThreads) {
    const uint32_t key = candidate_key(src, cand[j]);
    if ((key & mask) == prefix) atomicAdd(&sh[key & kDigit2Mask], 1u);
  }
  flush_histogram(sh, hist2);
}

// Adds the candidates above T (high half) and equal to T (low half) to their tile's counts.
__global__ void __launch_bounds__(kThreads)
    topk_candidate_count_kernel(Source src, const TopkState* st, const uint32_t* cand, uint64_t* tile_counts) {
  const uint32_t t = st->threshold, count = st->candidates;
  for (uint64_t j = uint64_t{blockIdx.x} * kThreads + threadIdx.x; j < count; j += uint64_t{gridDim.x} * kThreads) {
    const uint32_t idx = cand[j];
    const uint32_t key = candidate_key(src, idx);
    if (key >= t)
      atomicAdd(reinterpret_cast<unsigned long long*>(&tile_counts[idx / kTile]),
                key > t ? (1ull << 32) : 1ull);
  }
}

// One block: exclusive prefix sums of the packed tile counts (both halves stay below 2^32).
__global__ void __launch_bounds__(kScanThreads)
    topk_scan_tiles_kernel(const uint64_t* tile_counts, size_t tiles, uint64_t* tile_prefix) {
  using Scan = cub::BlockScan<uint64_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  uint64_t carry = 0;
  for (size_t base = 0; base < tiles; base += size_t{kScanThreads} * kScanItems) {
    uint64_t items[kScanItems], excl[kScanItems];
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      const size_t t = base + threadIdx.x * kScanItems + i;
      items[i] = t < tiles ? tile_counts[t] : 0;
    }
    uint64_t total;
    Scan(temp).ExclusiveSum(items, excl, total);
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      const size_t t = base + threadIdx.x * kScanItems + i;
      if (t < tiles) tile_prefix[t] = carry + excl[i];
    }
    carry += total;
    __syncthreads();  // temp is reused by the next chunk
  }
}

// Emits the kept elements of one tile in index order and updates every residual of the tile.
template <bool Vec>
__global__ void __launch_bounds__(kThreads)
    topk_write_kernel(Source src, size_t n, const TopkState* st, const uint64_t* tile_prefix,
                      uint8_t* out, HeaderWords header, uint32_t k, TopkValues v) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  write_header(out, header, 0, 0);
  const uint32_t t = st->threshold;
  const uint32_t need = st->need;
  uint8_t* payload = out + kHeaderBytes;
  const PayloadLayout l = TopkCodec::layout(n, k, topk_flags(v));
  uint16_t* offsets = reinterpret_cast<uint16_t*>(payload + l.section1);
  uint8_t* values = payload + l.section2;
  const size_t base = static_cast<size_t>(blockIdx.x) * kTile;
  uint32_t gt_before = static_cast<uint32_t>(tile_prefix[blockIdx.x] >> 32);
  uint32_t eq_before = static_cast<uint32_t>(tile_prefix[blockIdx.x]);
  // A chunk's end is the count kept before the next chunk's first tile; the last chunk's is k.
  // The zero padding after the ends and the offsets is written once, by block 0.
  constexpr uint32_t kTilesPerChunk = static_cast<uint32_t>(kTopkIndexChunk / kTile);
  auto* ends = reinterpret_cast<uint32_t*>(payload + l.section0);
  const uint64_t chunks = topk_index_chunks(n);
  if (threadIdx.x == 0) {
    if (blockIdx.x % kTilesPerChunk == 0 && blockIdx.x > 0)
      ends[blockIdx.x / kTilesPerChunk - 1] = gt_before + (eq_before < need ? eq_before : need);
    if (blockIdx.x == 0 && chunks > 0) ends[chunks - 1] = k;
  }
  if (blockIdx.x == 0) {
    for (uint64_t b = 4 * chunks + threadIdx.x; b < l.section1; b += kThreads) payload[b] = 0;
    for (uint64_t b = l.section1 + 2ull * k + threadIdx.x; b < l.section2; b += kThreads)
      payload[b] = 0;
  }
#pragma unroll 1
  for (uint32_t s = 0; s < kTileSteps; ++s) {
    const size_t i = base + (s * kThreads + threadIdx.x) * kV;
    const int valid = i >= n ? 0 : (n - i < kV ? static_cast<int>(n - i) : kV);
    float c[kV], r[kV], nr[kV];
    uint32_t key[kV];
    src.load<kV, Vec>(i, valid, c, r);
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      key[j] = el::topk_key(c[j]);
      if (j < valid) packed += (key[j] > t ? 0x10000u : 0u) + (key[j] == t ? 1u : 0u);
    }
    uint32_t excl, total;
    Scan(temp).ExclusiveSum(packed, excl, total);
    uint32_t g = gt_before + (excl >> 16);  // keys > T before this element (all kept)
    uint32_t e = eq_before + (excl & 0xFFFFu);  // keys == T before it (the first `need` kept)
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      float decoded = 0.0f;
      if (j < valid) {
        bool keep = false;
        uint32_t pos = 0;
        if (key[j] > t) {
          keep = true;
          pos = g + (e < need ? e : need);
          ++g;
        } else if (key[j] == t) {
          keep = e < need;
          pos = g + e;
          ++e;
        }
        if (keep && pos < k) {  // pos < k always holds; the guard keeps a racing input in bounds
          offsets[pos] = static_cast<uint16_t>((i + j) % kTopkIndexChunk);
          decoded = el::topk_put_value(values, pos, c[j], v);
        }
      }
      nr[j] = el::ef_residual(c[j], decoded, r[j]);
    }
    src.store_residual<kV, Vec>(i, valid, nr);
    gt_before += total >> 16;
    eq_before += total & 0xFFFFu;
    __syncthreads();  // temp is reused by the next step
  }
}

// int8 values, after the write kernel (which left the kept elements' residuals untouched): one
// block per 65536-element index chunk computes its kept values c again, their maximum key gives
// the chunk's scale (element::topk_quantize_chunk's math, spread over the block), then each int8
// and residual. Block 0 also zeroes the padding after the values.
__global__ void __launch_bounds__(kThreads)
    topk_quantize_kernel(Source src, uint8_t* out, PayloadLayout l, uint32_t k) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ uint32_t amax;
  uint8_t* payload = out + kHeaderBytes;
  const auto* ends = reinterpret_cast<const uint32_t*>(payload + l.section0);
  const auto* offsets = reinterpret_cast<const uint16_t*>(payload + l.section1);
  auto* q = reinterpret_cast<int8_t*>(payload + l.section2);
  const uint64_t chunk = blockIdx.x;
  const uint32_t begin = chunk == 0 ? 0 : ends[chunk - 1], end = ends[chunk];
  if (chunk == 0)
    for (uint64_t b = l.section2 + k + threadIdx.x; b < l.section3; b += kThreads) payload[b] = 0;
  auto value = [&](uint32_t j, float& r) {
    float c[1], old[1];
    src.load<1, false>(chunk * kTopkIndexChunk + offsets[j], 1, c, old);
    r = old[0];
    return c[0];
  };
  uint32_t local = 0;
  for (uint32_t j = begin + threadIdx.x; j < end; j += kThreads) {
    float r;
    const uint32_t key = el::topk_key(value(j, r));
    local = key > local ? key : local;
  }
  const uint32_t m = Reduce(temp).Reduce(local, cuda::maximum<>{});
  if (threadIdx.x == 0) amax = m;
  __syncthreads();
  const float scale = el::int8_scale(amax), inv = el::int8_inv_scale(amax);
  if (threadIdx.x == 0) reinterpret_cast<float*>(payload + l.section3)[chunk] = scale;
  for (uint32_t j = begin + threadIdx.x; j < end; j += kThreads) {
    float r;
    const float c = value(j, r);
    const float level = el::int8_level(c, inv);
    q[j] = static_cast<int8_t>(level);
    if (src.residual) {
      float nr[1] = {el::ef_residual(c, el::int8_level_value(level, scale), r)};
      src.store_residual<1, false>(chunk * kTopkIndexChunk + offsets[j], 1, nr);
    }
  }
}

template <bool Vec>
void launch_all(const EncodeLaunch& a, uint32_t k, uint8_t* ws) {
  const Source src{a.grad, a.residual, a.prescale};
  const TopkWorkspace w = topk_workspace(a.n);  // topk_workspace.hpp
  auto* st = reinterpret_cast<TopkState*>(ws);
  auto* hist = reinterpret_cast<uint32_t*>(ws + w.histograms);
  auto* counts = reinterpret_cast<uint64_t*>(ws + w.counts);
  auto* prefix = reinterpret_cast<uint64_t*>(ws + w.prefixes);
  auto* cand = reinterpret_cast<uint32_t*>(ws + w.candidates);
  const size_t tiles = w.tiles;
  const unsigned tile_grid = static_cast<unsigned>(tiles);
  cudaMemsetAsync(ws, 0, w.counts, a.stream);  // the state and the histograms
  if (a.n > 0) {
    const unsigned wide = static_cast<unsigned>(a.sm_count) * 8;
    const unsigned hist_grid = std::min<unsigned>(grid_for(a.n, uint64_t{kThreads} * kV), wide);
    const unsigned cand_grid = std::min<unsigned>(grid_for(a.n, kThreads), wide);
    uint32_t* hist1 = hist + el::kTopkRadix;
    uint32_t* hist2 = hist + 2 * el::kTopkRadix;
    topk_hist0_kernel<Vec><<<hist_grid, kThreads, 0, a.stream>>>(src, a.n, hist);
    topk_select_kernel<0><<<1, kSelectThreads, 0, a.stream>>>(st, hist, k);
    topk_collect_kernel<Vec><<<tile_grid, kThreads, 0, a.stream>>>(src, a.n, st, hist1, cand, counts);
    topk_select_kernel<1><<<1, kSelectThreads, 0, a.stream>>>(st, hist1, k);
    topk_candidate_hist_kernel<<<cand_grid, kThreads, 0, a.stream>>>(src, st, cand, hist2);
    topk_select_kernel<2><<<1, kSelectThreads, 0, a.stream>>>(st, hist2, k);
    topk_candidate_count_kernel<<<cand_grid, kThreads, 0, a.stream>>>(src, st, cand, counts);
    topk_scan_tiles_kernel<<<1, kScanThreads, 0, a.stream>>>(counts, tiles, prefix);
  } else {
    // No element, no scan: the write kernel still reads the (one) tile's prefix.
    cudaMemsetAsync(prefix, 0, sizeof(uint64_t) * tiles, a.stream);
  }
  topk_write_kernel<Vec><<<tile_grid, kThreads, 0, a.stream>>>(src, a.n, st, prefix, a.out, a.header,
                                                               k, a.topk_values);
  if (a.topk_values == TopkValues::int8 && a.n > 0)
    topk_quantize_kernel<<<static_cast<unsigned>(topk_index_chunks(a.n)), kThreads, 0, a.stream>>>(
        src, a.out, a.layout, k);
}

}  // namespace

size_t encode_workspace_bytes(TopkCodec, size_t n) { return topk_workspace(n).bytes; }

void launch_encode(TopkCodec, const EncodeLaunch& a) {
  const uint32_t k = a.param;
  auto* ws = static_cast<uint8_t*>(a.workspace);
  if (a.vec)
    launch_all<true>(a, k, ws);
  else
    launch_all<false>(a, k, ws);
}

}  // namespace gradzip::kernels
