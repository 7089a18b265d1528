// gradzip_demo: every codec on one random gradient — wire bytes, compression ratio, error against
// the input, the error-feedback identity, and encode speed.
//
//   gradzip_demo [n_elements] [threads]        (default 4194304, all cores)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gradzip/gradzip.hpp"

namespace {

// Best-of-3 seconds of f().
template <class F>
double best_seconds(F&& f) {
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : size_t{1} << 22;
  if (argc > 2) gradzip::set_num_threads(std::atoi(argv[2]));

  // A gradient-like vector: Gaussian with a magnitude that drifts across "layers".
  std::vector<float> grad(n);
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) grad[i] = normal(rng) * 1e-3f * (1.0f + float(i % 65536) / 65536.0f);
  double norm2 = 0;
  for (float g : grad) norm2 += double(g) * g;

  std::printf("gradzip demo: n = %zu fp32 elements (%.1f MiB), %d threads, CPU path %s\n\n", n,
              4.0 * n / (1 << 20), gradzip::num_threads(), gradzip::cpu_isa());
  std::printf("| %-22s | %12s | %7s | %10s | %9s | %11s | %13s |\n", "codec", "wire bytes", "ratio",
              "max |err|", "rel err", "EF ok", "EF enc GB/s");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|\n", std::string(24, '-').c_str(), std::string(14, '-').c_str(),
              std::string(9, '-').c_str(), std::string(12, '-').c_str(), std::string(11, '-').c_str(),
              std::string(13, '-').c_str(), std::string(15, '-').c_str());
  for (const char* spec : {"fp32", "fp16", "bf16", "int8", "int8:block=64", "sign", "sign:block=32",
                           "topk:0.01", "topk:0.1", "topk:0.01:values=fp16"}) {
    const gradzip::Codec codec = gradzip::Codec::parse(spec);
    std::vector<std::byte> wire(codec.encoded_bytes(n)), ws(codec.workspace_bytes(n));
    std::vector<float> residual(n, 0.0f), decoded(n);

    // error of one encode/decode of the gradient
    codec.encode(grad.data(), n, wire.data(), wire.size(), 1.0f, ws.data(), ws.size());
    gradzip::decode(wire.data(), wire.size(), decoded.data(), n);
    double max_err = 0, err2 = 0;
    for (size_t i = 0; i < n; ++i) {
      const double e = double(decoded[i]) - grad[i];
      max_err = std::max(max_err, std::fabs(e));
      err2 += e * e;
    }

    // error feedback: decoded + new residual must give back the gradient (residual started at 0)
    codec.encode_with_feedback(grad.data(), residual.data(), n, wire.data(), wire.size(), 1.0f,
                               ws.data(), ws.size());
    gradzip::decode(wire.data(), wire.size(), decoded.data(), n);
    bool ef_ok = true;
    for (size_t i = 0; i < n && ef_ok; ++i)
      ef_ok = std::fabs(double(decoded[i]) + residual[i] - grad[i]) <=  // fp32 rounding of c - dec
              std::ldexp(std::max(std::fabs(double(grad[i])), std::fabs(double(decoded[i]))), -23);

    const double secs = best_seconds([&] {
      codec.encode_with_feedback(grad.data(), residual.data(), n, wire.data(), wire.size(), 1.0f,
                                 ws.data(), ws.size());
    });
    std::printf("| %-22s | %12zu | %6.1fx | %10.3g | %9.3g | %11s | %13.2f |\n", spec, wire.size(),
                4.0 * n / wire.size(), max_err, std::sqrt(err2 / norm2), ef_ok ? "yes" : "NO",
                4.0 * n / secs / 1e9);
  }
  std::printf("\nratio: fp32 bytes / wire bytes. rel err: ||decode(encode(g)) - g|| / ||g||.\n"
              "EF ok: decode(payload) + residual == grad (to fp32 rounding) for the fused error-feedback encode.\n"
              "EF enc GB/s: fp32 gradient bytes encoded per second by the fused EF encode.\n");
  return 0;
}
