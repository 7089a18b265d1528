// The CPU path's results must not depend on the calling thread's floating-point mode: a thread
// with flush-to-zero / denormals-are-zero set (torch.set_flush_denormal(True), -ffast-math startup
// code) would otherwise get other bytes wherever a value is subnormal (residuals of tiny
// gradients, fp16 near its subnormal range, block scales), and OpenMP's worker threads keep the
// mode of whichever thread created them. A rounding mode other than round-to-nearest (fesetround)
// would change int8's rint and fp16's rounding addition. IeeeFloatMode clears FTZ, DAZ and the
// rounding-control bits for a scope and restores the thread's mode after it. x86 only (MXCSR);
// elsewhere it does nothing.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace gradzip::detail {

class IeeeFloatMode {
 public:
  IeeeFloatMode() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    if (saved_ & kNonIeee) _mm_setcsr(saved_ & ~kNonIeee);
#endif
  }
  ~IeeeFloatMode() {
#if defined(__x86_64__) || defined(__i386__)
    if (saved_ & kNonIeee) _mm_setcsr(saved_);
#endif
  }
  IeeeFloatMode(const IeeeFloatMode&) = delete;
  IeeeFloatMode& operator=(const IeeeFloatMode&) = delete;

 private:
  static constexpr unsigned kNonIeee = (1u << 15) | (1u << 6) | (3u << 13);  // FTZ, DAZ, RC
  unsigned saved_ = 0;
};

}  // namespace gradzip::detail
