// Consumer of the installed gradzip package: error-feedback encode with int8, decode_add into a sum,
// and checks the error-feedback identity decode(payload) + residual == grad (residual started at 0).
#include <gradzip/gradzip.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const size_t n = 100003;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  std::vector<float> grad(n), residual(n, 0.0f), sum(n, 0.0f);
  for (float& g : grad) g = dist(rng);

  const gradzip::Codec codec = gradzip::Codec::parse("int8:block=256");
  std::vector<std::byte> wire(codec.encoded_bytes(n));
  std::vector<std::byte> workspace(codec.workspace_bytes(n));
  codec.encode_with_feedback(grad.data(), residual.data(), n, wire.data(), wire.size(), 1.0f,
                             workspace.data(), workspace.size());
  gradzip::decode_add(wire.data(), wire.size(), sum.data(), n);

  double worst = 0;
  for (size_t i = 0; i < n; ++i)
    worst = std::fmax(worst, std::fabs(double(sum[i]) + residual[i] - grad[i]));
  std::printf("consumer: %s, %zu elements -> %zu bytes (%.2fx), EF identity error %.3g\n",
              codec.name().c_str(), n, wire.size(), 4.0 * n / wire.size(), worst);
  if (worst > 1e-6) {
    std::printf("consumer: FAILED, error feedback identity violated\n");
    return 1;
  }
  try {
    (void)gradzip::Codec::parse("topk:1.5");
    std::printf("consumer: FAILED, bad spec accepted\n");
    return 1;
  } catch (const gradzip::Error& e) {
    std::printf("consumer: bad spec rejected: %s\n", e.what());
  }
  return 0;
}
