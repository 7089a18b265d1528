// CPU throughput of every codec: encode, fused error-feedback encode and decode_add at 1M, 16M and
// 64M elements, each reporting the bytes its pass must read and write (SetBytesProcessed), next
// to a memcpy that moves the same number of bytes with the same threads. The counter
// `floor_ratio` = memcpy time / codec time (1.0 = at the memory-bandwidth floor); top-k's
// decode_add also reports `line_floor_ratio`, against the cache lines its scatter must move.
// report.py turns the JSON of a run into a table.
//
//   gradzip_bench_cpu [--benchmark_filter=encode_ef] [--benchmark_repetitions=5]
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradzip/gradzip.hpp"

namespace {

const char* const kSpecs[] = {"fp32", "fp16", "bf16", "int8", "int8:block=64", "sign",
                              "sign:block=32", "topk:0.01", "topk:0.3", "topk:0.01:values=fp16",
                              "topk:0.01:values=int8"};
const size_t kSizes[] = {size_t{1} << 20, size_t{1} << 24, size_t{1} << 26};

// Buffers without value-initialisation: first touched by the threads that use them.
template <class T>
struct Buf {
  std::unique_ptr<T[]> p;
  size_t n = 0;
  void resize(size_t m) {
    if (m <= n) return;
    p.reset(new T[m]);
    n = m;
    T* d = p.get();
#pragma omp parallel for schedule(static)
    for (long long i = 0; i < static_cast<long long>(m); ++i) d[i] = T{};
  }
  T* data() { return p.get(); }
};

struct Data {
  Buf<float> grad, residual, out;
  Buf<std::byte> wire, ws, copy_src, copy_dst;
};

Data& data_for(size_t n) {
  static std::map<size_t, std::unique_ptr<Data>> cache;
  auto& d = cache[n];
  if (!d) {
    d = std::make_unique<Data>();
    d->grad.resize(n);
    d->residual.resize(n);
    d->out.resize(n);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1e-3f);
    for (size_t i = 0; i < n; ++i) d->grad.data()[i] = normal(rng);
  }
  return *d;
}

// memcpy of `bytes` total traffic (bytes / 2 read, bytes / 2 written) on the library's threads.
void parallel_copy(std::byte* dst, const std::byte* src, size_t half) {
  const int t = gradzip::num_threads();
  const size_t per = (half + t - 1) / t;
#pragma omp parallel for num_threads(t) schedule(static, 1)
  for (int c = 0; c < t; ++c) {
    const size_t b = c * per, e = b + per < half ? b + per : half;
    if (b < e) std::memcpy(dst + b, src + b, e - b);
  }
}

// Best-of-5 seconds for a memcpy moving `bytes` in total.
double memcpy_seconds(Data& d, size_t bytes) {
  d.copy_src.resize(bytes / 2 + 64);
  d.copy_dst.resize(bytes / 2 + 64);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    parallel_copy(d.copy_dst.data(), d.copy_src.data(), bytes / 2);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

enum class Mode { encode, encode_ef, decode_add };
const char* mode_name(Mode m) {
  return m == Mode::encode ? "encode" : m == Mode::encode_ef ? "encode_ef" : "decode_add";
}

// Bytes the pass must read and write at least (the payload once, each fp32 array once; top-k's
// decode_add touches only its k outputs).
size_t floor_bytes(Mode m, const gradzip::Codec& codec, size_t n) {
  const size_t payload = codec.encoded_bytes(n);
  switch (m) {
    case Mode::encode: return 4 * n + payload;      // read grad, write payload
    case Mode::encode_ef: return 12 * n + payload;  // read grad + residual, write both
    case Mode::decode_add: {                        // read payload + out, write out
      const size_t touched = codec.kind() == gradzip::CodecKind::topk ? codec.topk_k(n) : n;
      return payload + 8 * touched;
    }
  }
  return 0;
}

void bench_codec(benchmark::State& state, std::string spec, Mode mode, size_t n) {
  const gradzip::Codec codec = gradzip::Codec::parse(spec);
  Data& d = data_for(n);
  const size_t wire_bytes = codec.encoded_bytes(n);
  d.wire.resize(wire_bytes);
  d.ws.resize(codec.workspace_bytes(n) + 16);
  const size_t ws_bytes = codec.workspace_bytes(n);
  std::fill_n(d.residual.data(), n, 0.0f);
  codec.encode(d.grad.data(), n, d.wire.data(), wire_bytes, 1.0f, d.ws.data(), ws_bytes);
  const size_t bytes = floor_bytes(mode, codec, n);
  const double floor_s = memcpy_seconds(d, bytes);

  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    switch (mode) {
      case Mode::encode:
        codec.encode(d.grad.data(), n, d.wire.data(), wire_bytes, 1.0f, d.ws.data(), ws_bytes);
        break;
      case Mode::encode_ef:
        codec.encode_with_feedback(d.grad.data(), d.residual.data(), n, d.wire.data(), wire_bytes,
                                   1.0f, d.ws.data(), ws_bytes);
        break;
      case Mode::decode_add: gradzip::decode_add(d.wire.data(), wire_bytes, d.out.data(), n); break;
    }
    benchmark::ClobberMemory();
  }
  const double per_iter =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["floor_ratio"] = floor_s / per_iter;
  if (mode == Mode::decode_add && codec.kind() == gradzip::CodecKind::topk) {
    // A scattered add moves whole cache lines: each 64-byte line of `out` holding a kept index
    // is read and written back. The same memcpy, sized by those lines, is the floor it can reach.
    const size_t k = codec.topk_k(n);
    const gradzip::WireHeader h = codec.wire_header(n);
    const auto* payload = reinterpret_cast<const uint8_t*>(d.wire.data()) + gradzip::kHeaderBytes;
    size_t lines = 0;
    uint64_t previous = 0;
    for (size_t j = 0; j < k; ++j) {
      const uint64_t idx = gradzip::topk_position(h, payload, j).index;
      lines += j == 0 || idx / 16 != previous / 16;
      previous = idx;
    }
    state.counters["line_floor_ratio"] = memcpy_seconds(d, wire_bytes + 2 * 64 * lines) / per_iter;
  }
  state.counters["floor_bytes"] = static_cast<double>(bytes);
  state.counters["threads"] = gradzip::num_threads();
  state.SetLabel(gradzip::cpu_isa());
}

// The memcpy baseline as its own benchmark, for every byte count a codec benchmark uses.
void bench_memcpy(benchmark::State& state, size_t bytes) {
  Data& d = data_for(kSizes[0]);
  d.copy_src.resize(bytes / 2 + 64);
  d.copy_dst.resize(bytes / 2 + 64);
  for (auto _ : state) {
    parallel_copy(d.copy_dst.data(), d.copy_src.data(), bytes / 2);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["floor_bytes"] = static_cast<double>(bytes);
}

std::string size_name(size_t n) { return std::to_string(n >> 20) + "M"; }

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  std::map<size_t, bool> copies;
  for (Mode mode : {Mode::encode, Mode::encode_ef, Mode::decode_add})
    for (const char* spec : kSpecs)
      for (size_t n : kSizes) {
        const gradzip::Codec codec = gradzip::Codec::parse(spec);
        const size_t bytes = floor_bytes(mode, codec, n);
        copies[bytes] = true;
        const std::string name = std::string(mode_name(mode)) + "/" + spec + "/" + size_name(n);
        benchmark::RegisterBenchmark(name.c_str(), bench_codec, std::string(spec), mode, n)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
  for (const auto& [bytes, _] : copies)
    benchmark::RegisterBenchmark(("memcpy/" + std::to_string(bytes)).c_str(), bench_memcpy, bytes)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
