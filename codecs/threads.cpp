// The thread count of every host entry point.
#include <atomic>
#include <string>
#include <thread>

#include "gradzip/gradzip.hpp"
#include "parallel.hpp"

namespace gradzip {
namespace {

int hardware_threads() {
  const unsigned h = std::thread::hardware_concurrency();
  return h == 0 ? 1 : static_cast<int>(h);
}
std::atomic<int> g_threads{0};  // 0: not set, use the hardware count

}  // namespace

void set_num_threads(int n) {
  if (n < 0) throw Error(Status::invalid_argument, "gradzip: thread count must be >= 0 (0 = all cores), got " + std::to_string(n));
  g_threads.store(n, std::memory_order_relaxed);
}

int num_threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : hardware_threads();
}

int detail::threads_for(size_t n) {
  const size_t useful = n / kMinElementsPerThread;
  const int t = num_threads();
  if (useful < 2) return 1;
  return useful < static_cast<size_t>(t) ? static_cast<int>(useful) : t;
}

}  // namespace gradzip
