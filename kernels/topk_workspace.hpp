// Where kernels/topk.cu's encoder keeps its selection state in the caller's workspace. One layout,
// plain C++ (no CUDA): the launcher carves the workspace with it, the size query
// (encode_workspace_bytes, behind Codec::workspace_bytes) returns its total, and the host tests
// check it without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradzip/element.hpp"
#include "gradzip/wire_types.hpp"

namespace gradzip::kernels {

constexpr uint32_t kTopkTile = 4096;  // elements per tile of the count and write passes
// A wire chunk (kTopkIndexChunk) is a whole number of tiles: its first tile writes its end.
static_assert(kTopkIndexChunk % kTopkTile == 0, "a wire chunk must be whole tiles");
constexpr size_t kTopkStateBytes = 64;  // the selection state (TopkState in topk.cu)

// Byte offsets into the workspace for n elements, in order:
// [state][3 radix histograms of u32][a u64 count per tile][a u64 prefix per tile][a u32
// candidate per element]. A tile of its own at n = 0 (the write pass reads its prefix).
struct TopkWorkspace {
  size_t tiles = 0;
  size_t histograms = 0, counts = 0, prefixes = 0, candidates = 0;
  size_t bytes = 0;  // the total
};

constexpr TopkWorkspace topk_workspace(size_t n) {
  TopkWorkspace w;
  w.tiles = n == 0 ? 1 : (n + kTopkTile - 1) / kTopkTile;
  w.histograms = kTopkStateBytes;
  w.counts = w.histograms + 3 * sizeof(uint32_t) * element::kTopkRadix;
  w.prefixes = w.counts + sizeof(uint64_t) * w.tiles;
  w.candidates = w.prefixes + sizeof(uint64_t) * w.tiles;
  w.bytes = w.candidates + sizeof(uint32_t) * n;
  return w;
}

}  // namespace gradzip::kernels
