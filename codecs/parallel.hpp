// The thread pool of the CPU path is OpenMP's; this header splits a range into contiguous chunks
// (one per thread, each a multiple of `unit` elements) and runs them in parallel. Kernels work
// per block, so the results do not depend on the split.
#pragma once

#include <cstddef>

#include "float_mode.hpp"
#include "gradzip/gradzip.hpp"

namespace gradzip::detail {

// Below this many elements per thread, extra threads cost more than they bring.
constexpr size_t kMinElementsPerThread = 1u << 15;

// Threads for a pass over n elements.
int threads_for(size_t n);

// Calls f(begin, end) on disjoint chunks covering [0, n); each chunk starts at a multiple of unit.
// Every thread runs in IEEE mode (see float_mode.hpp), whatever its own.
template <class F>
void parallel_ranges(size_t n, size_t unit, F&& f) {
  const int t = threads_for(n);
  if (t <= 1) {
    if (n) f(size_t{0}, n);
    return;
  }
  const size_t units = (n + unit - 1) / unit;
  const size_t per = (units + t - 1) / t;
#pragma omp parallel for num_threads(t) schedule(static, 1)
  for (int c = 0; c < t; ++c) {
    const size_t begin = static_cast<size_t>(c) * per * unit;
    const size_t end = begin + per * unit < n ? begin + per * unit : n;
    const IeeeFloatMode ieee;
    if (begin < end) f(begin, end);
  }
}

// Calls f(i) for i in [0, count) on up to `threads` threads (static schedule).
template <class F>
void parallel_items(size_t count, int threads, F&& f) {
  if (threads <= 1 || count <= 1) {
    for (size_t i = 0; i < count; ++i) f(i);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const IeeeFloatMode ieee;
#pragma omp for schedule(static)
    for (long long i = 0; i < static_cast<long long>(count); ++i) f(static_cast<size_t>(i));
  }
}

}  // namespace gradzip::detail
