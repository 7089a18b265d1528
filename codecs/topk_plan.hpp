// How the CPU top-k splits its input and uses the caller's workspace. The split depends on n only
// (never on the thread count), so the selection is the same for any number of threads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradzip/codec/topk.hpp"

namespace gradzip::detail {

constexpr size_t kTopkMaxChunks = 64;
constexpr size_t kTopkMinChunk = 65536;

inline size_t topk_chunk_len(size_t n) {
  const size_t even = (n + kTopkMaxChunks - 1) / kTopkMaxChunks;
  const size_t len = even < kTopkMinChunk ? kTopkMinChunk : even;
  return (len + 63) & ~size_t{63};
}
inline size_t topk_num_chunks(size_t n) {
  return n == 0 ? 0 : (n + topk_chunk_len(n) - 1) / topk_chunk_len(n);
}

// Scratch the CPU encoder of a codec needs for n elements and its header's param: none, but for
// top-k's below.
template <class C>
size_t encode_workspace_bytes(C, size_t, uint32_t) { return 0; }
// Candidate indices (u32) of the threshold bucket, at most one per element; then the k kept
// indices as u32, from which the wire's chunk ends and in-chunk offsets are written.
inline size_t encode_workspace_bytes(TopkCodec, size_t n, uint32_t k) { return 4 * n + 4ull * k; }
inline uint32_t* topk_kept_indices(void* workspace, size_t n) {
  return static_cast<uint32_t*>(workspace) + n;
}

}  // namespace gradzip::detail
