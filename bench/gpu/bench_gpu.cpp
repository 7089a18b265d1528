// Google Benchmark of every CUDA kernel of gradzip, timed with CUDA events (manual time), next to
// a device-to-device cudaMemcpyAsync baseline in the same binary.
//
// bytes_per_second counts the bytes an op must move at least (the fused floor), so it compares
// directly with the copy's: encode = 4 B read + payload written per element; encode_ef = 4 + 4 B
// read (grad, residual) + 4 B residual written + payload; decode = payload + 4 B written;
// decode_add = payload + 8 B. copy/N moves 2 x 4N bytes (read + write).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cuda_buffer.hpp"
#include "gradzip/cuda.hpp"
#include "test_util.hpp"

namespace {

using gztest::cuda_check;
using gztest::DeviceBuffer;

const char* const kSpecs[] = {"fp32", "fp16", "bf16", "int8", "sign", "topk:0.01", "topk:0.001",
                              "topk:0.01:values=fp16", "topk:0.01:values=int8"};
const size_t kSizes[] = {size_t{1} << 20, size_t{1} << 24, size_t{1} << 26, size_t{1} << 27};

// One set of device buffers for the largest size, shared by every benchmark.
struct Buffers {
  size_t n = 0;
  DeviceBuffer grad, residual, out, decoded, ws, decode_ws;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
};
Buffers& buffers() {
  static Buffers b;
  return b;
}

void setup(size_t n_max) {
  Buffers& b = buffers();
  b.n = n_max;
  b.grad = DeviceBuffer(4 * n_max);
  b.residual = DeviceBuffer(4 * n_max);
  b.out = DeviceBuffer(4 * n_max + 4096);
  b.decoded = DeviceBuffer(4 * n_max);
  size_t ws = 16;
  for (const char* s : kSpecs) ws = std::max(ws, gradzip::Codec::parse(s).workspace_bytes(n_max));
  b.ws = DeviceBuffer(ws);
  b.decode_ws = DeviceBuffer(gradzip::cuda::kDecodeWorkspaceBytes);
  b.grad.upload(gztest::random_grad(n_max, 1));
  b.residual.upload(gztest::random_grad(n_max, 2, 0.01f));
  cuda_check(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_check(cudaEventCreate(&b.start), "cudaEventCreate");
  cuda_check(cudaEventCreate(&b.stop), "cudaEventCreate");
}

// Times fn() on the stream with events; one benchmark iteration = one call.
template <class Fn>
void time_loop(benchmark::State& state, Fn&& fn) {
  Buffers& b = buffers();
  fn();  // warm-up (and first-touch of the lazily loaded kernels)
  cuda_check(cudaStreamSynchronize(b.stream), "warm-up");
  for (auto _ : state) {
    cudaEventRecord(b.start, b.stream);
    fn();
    cudaEventRecord(b.stop, b.stream);
    cudaEventSynchronize(b.stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, b.start, b.stop);
    state.SetIterationTime(ms * 1e-3);
  }
  cuda_check(cudaGetLastError(), "benchmark");
}

enum class Op { encode, encode_ef, decode, decode_add };
const char* op_name(Op op) {
  switch (op) {
    case Op::encode: return "encode";
    case Op::encode_ef: return "encode_ef";
    case Op::decode: return "decode";
    default: return "decode_add";
  }
}

void bench_codec_impl(benchmark::State& state, const std::string& spec, Op op, size_t n) {
  Buffers& b = buffers();
  const auto codec = gradzip::Codec::parse(spec);
  const size_t bytes = codec.encoded_bytes(n);
  const size_t payload = bytes - gradzip::kHeaderBytes;
  const size_t ws = codec.workspace_bytes(n);
  const float prescale = 0.125f;
  size_t moved = 0;
  switch (op) {
    case Op::encode:
      moved = 4 * n + payload;
      time_loop(state, [&] {
        gradzip::cuda::encode(codec, b.grad.as<float>(), n, b.out.get(), bytes, b.stream, prescale,
                              b.ws.get(), ws);
      });
      break;
    case Op::encode_ef:
      moved = 12 * n + payload;
      time_loop(state, [&] {
        gradzip::cuda::encode_with_feedback(codec, b.grad.as<float>(), b.residual.as<float>(), n,
                                            b.out.get(), bytes, b.stream, prescale, b.ws.get(), ws);
      });
      break;
    case Op::decode:
    case Op::decode_add: {
      gradzip::cuda::encode(codec, b.grad.as<float>(), n, b.out.get(), bytes, b.stream, prescale,
                            b.ws.get(), ws);
      const bool add = op == Op::decode_add;
      moved = payload + (add ? 8 : 4) * n;
      // The asynchronous form (workspace status word): what a training step uses.
      time_loop(state, [&] {
        if (add)
          gradzip::cuda::decode_add(b.out.get(), bytes, b.decoded.as<float>(), n, b.stream,
                                    b.decode_ws.get(), b.decode_ws.bytes());
        else
          gradzip::cuda::decode(b.out.get(), bytes, b.decoded.as<float>(), n, b.stream,
                                b.decode_ws.get(), b.decode_ws.bytes());
      });
      gradzip::cuda::check_decode(b.decode_ws.get(), b.stream);
      break;
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(moved) * state.iterations());
  state.counters["elements"] = static_cast<double>(n);
  state.counters["bytes_per_element"] = static_cast<double>(moved) / static_cast<double>(n);
}

// A failing call (e.g. a workspace size query that does not cover the CUDA path) marks the
// benchmark as errored in the JSON instead of aborting the whole run.
void bench_codec(benchmark::State& state, const std::string& spec, Op op, size_t n) {
  try {
    bench_codec_impl(state, spec, op, n);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void bench_copy(benchmark::State& state, size_t n) {
  Buffers& b = buffers();
  time_loop(state, [&] {
    cudaMemcpyAsync(b.decoded.get(), b.grad.get(), 4 * n, cudaMemcpyDeviceToDevice, b.stream);
  });
  state.SetBytesProcessed(static_cast<int64_t>(8 * n) * state.iterations());
  state.counters["elements"] = static_cast<double>(n);
  state.counters["bytes_per_element"] = 8.0;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (!gradzip::cuda::available()) {
    std::printf("gradzip GPU benchmark: no CUDA device, skipping\n");
    return gztest::kSkipExitCode;
  }
  setup(kSizes[std::size(kSizes) - 1]);
  for (size_t n : kSizes) {
    benchmark::RegisterBenchmark(("copy/" + std::to_string(n)).c_str(), bench_copy, n)
        ->UseManualTime()->Unit(benchmark::kMicrosecond);
    for (const char* spec : kSpecs)
      for (Op op : {Op::encode, Op::encode_ef, Op::decode, Op::decode_add})
        benchmark::RegisterBenchmark((std::string(spec) + "/" + op_name(op) + "/" + std::to_string(n)).c_str(),
                                     bench_codec, std::string(spec), op, n)
            ->UseManualTime()->Unit(benchmark::kMicrosecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
