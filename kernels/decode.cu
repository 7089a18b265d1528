// Decoders of every codec, gated by a device-side validation of the wire bytes.
//
// The wire lives in device memory, so it is validated there, with the host's rules
// (gradzip/wire.hpp): validate_header (one thread) runs check_header and check_payload against the
// caller's (bytes, n) and writes the status word; for a sparse payload (top-k), validate_indices
// runs check_index on every index in parallel, keeping the smallest fault (the one the host's
// sequential loop finds first). The decode kernels that follow on the stream read the status word
// first and write nothing unless it is ok, so a corrupt payload never causes an out-of-bounds
// access.
#include <algorithm>

#include "common.cuh"

namespace gradzip::kernels {
namespace {

constexpr int kV = 4;
constexpr uint64_t kNoFault = ~uint64_t{0};
__device__ DecodeStatus g_sync_status;  // the synchronous decode's status word (one per device)

__global__ void validate_header_kernel(const uint8_t* wire, uint64_t bytes, size_t n, DecodeStatus* st) {
  const WireHeader h = load_header(wire);
  WireCheck r = check_header(h, bytes);
  if (r.status == WireStatus::ok) r = check_payload(h, wire + kHeaderBytes);
  const bool ok = r.status == WireStatus::ok;
  st->code = static_cast<uint32_t>(r.status);
  st->count_mismatch = ok && h.count != n ? 1u : 0u;
  // Index failures are merged with atomicMin on (2 * position + kind): start from the top.
  st->detail = ok ? kNoFault : r.detail;
}

__global__ void __launch_bounds__(kThreads) validate_indices_kernel(const uint8_t* wire, DecodeStatus* st) {
  // Runs only after a valid header; other blocks of this kernel may already have set bad_index.
  const uint32_t code = st->code;
  if (code != 0 && code != static_cast<uint32_t>(WireStatus::bad_index)) return;
  const WireHeader h = load_header(wire);
  if (!sparse_payload(static_cast<CodecKind>(h.codec))) return;
  const uint32_t k = h.param;
  const uint8_t* payload = wire + kHeaderBytes;
  for (uint64_t j = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; j < k;
       j += static_cast<uint64_t>(gridDim.x) * kThreads) {
    const WireCheck r = check_index(h, payload, j);
    if (r.status != WireStatus::ok) {
      atomicMin(reinterpret_cast<unsigned long long*>(&st->detail), static_cast<unsigned long long>(r.detail));
      atomicExch(&st->code, static_cast<uint32_t>(r.status));
    }
  }
}

// Every codec, 4 elements per thread; a sparse payload (top-k) only zero-fills here (decode) and
// scatters below.
template <bool Add>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(const uint8_t* wire, float* out, size_t n, const DecodeStatus* st, bool vec_out) {
  if (!decode_allowed(st)) return;
  const size_t i = (static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x) * kV;
  if (i >= n) return;
  const WireHeader h = load_header(wire);
  const CodecKind kind = static_cast<CodecKind>(h.codec);
  if (Add && sparse_payload(kind)) return;  // its elements decode to 0: nothing to add
  const int valid = n - i < kV ? static_cast<int>(n - i) : kV;
  // Blocks are multiples of 32 elements (validated) and i is a multiple of kV = 4, so a thread's
  // elements share one codec block and one sign word: one element decoder per thread.
  float v[kV];
  visit(kind, [&](auto c) {
    const auto decoder = c.element_decoder(h, wire + kHeaderBytes, i);
#pragma unroll
    for (int j = 0; j < kV; ++j) v[j] = j < valid ? decoder(i + j) : 0.0f;
  });
  if (vec_out && valid == kV) {
    float4* o = reinterpret_cast<float4*>(out + i);
    if (Add) {
      const float4 p = *o;
      *o = make_float4(p.x + v[0], p.y + v[1], p.z + v[2], p.w + v[3]);
    } else {
      *o = make_float4(v[0], v[1], v[2], v[3]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kV; ++j)
    if (j < valid) out[i + j] = Add ? out[i + j] + v[j] : v[j];
}

template <bool Add>
__global__ void __launch_bounds__(kThreads)
    topk_scatter_kernel(const uint8_t* wire, float* out, const DecodeStatus* st) {
  if (!decode_allowed(st)) return;
  const WireHeader h = load_header(wire);
  if (!sparse_payload(static_cast<CodecKind>(h.codec))) return;
  const uint32_t k = h.param;
  const uint8_t* payload = wire + kHeaderBytes;
  const TopkValues values = topk_values(h.flags);
  const PayloadLayout l = payload_layout(h);
  for (uint64_t j = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; j < k;
       j += static_cast<uint64_t>(gridDim.x) * kThreads) {
    const TopkPosition p = topk_position(h, payload, j);
    const float v = el::topk_get_value(payload, l, values, j, p.chunk);
    float& o = out[p.index];
    o = Add ? o + v : v;
  }
}

}  // namespace

DecodeStatus* sync_status_word() {
  void* p = nullptr;
  if (cudaGetSymbolAddress(&p, g_sync_status) != cudaSuccess) return nullptr;
  return static_cast<DecodeStatus*>(p);
}

void launch_decode(const DecodeLaunch& a) {
  // Top-k holds at most (bytes - header) / 3 entries (u16 offset + int8 value) and at most n.
  const uint64_t kmax = std::min<uint64_t>(a.n, (a.bytes - kHeaderBytes) / 3);
  const unsigned k_grid = std::min<unsigned>(grid_for(kmax, kThreads), static_cast<unsigned>(a.sm_count) * 8);
  const unsigned grid = grid_for(a.n, uint64_t{kThreads} * kV);
  const bool vec_out = reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  validate_header_kernel<<<1, 1, 0, a.stream>>>(a.wire, a.bytes, a.n, a.status);
  validate_indices_kernel<<<k_grid, kThreads, 0, a.stream>>>(a.wire, a.status);
  auto* decode = a.add ? decode_kernel<true> : decode_kernel<false>;
  auto* scatter = a.add ? topk_scatter_kernel<true> : topk_scatter_kernel<false>;
  decode<<<grid, kThreads, 0, a.stream>>>(a.wire, a.out, a.n, a.status, vec_out);
  scatter<<<k_grid, kThreads, 0, a.stream>>>(a.wire, a.out, a.status);
}

}  // namespace gradzip::kernels
