// Error-feedback residuals kept in bfloat16 (the compact state option, residual_dtype=bfloat16 in
// Python): half the bytes of a float32 residual. The encoders update a float32 residual in place,
// so a bfloat16 one is widened (exactly) into a float32 scratch for the messages of one encode and
// rounded back to bfloat16 (to nearest even) after it: the arithmetic of a float32 residual that is
// rounded to bfloat16 after every update, on every backend alike. The scratch spans one call's
// messages (at most a bucket, whatever the model's size): on the CPU one per thread, kept between
// calls (it grows once, no allocation per step after that); on a GPU the caching allocator's, on
// the current stream, which the encoders and the copies run on.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace gradzip::torch_ext {

// Elements [at, at + n) of a residual, relative to an offset into it.
using ResidualSpans = std::vector<std::pair<int64_t, int64_t>>;

class FloatResidual {
 public:
  // residual: undefined (no error feedback), float32 (used in place) or bfloat16 (its `spans`,
  // from element `offset` on, widened into the scratch).
  FloatResidual(const at::Tensor& residual, int64_t offset, ResidualSpans spans);
  // What the encoders take: data() + at is the float32 residual of the span starting at `at`;
  // nullptr without a residual.
  float* data() const { return base_; }
  // Rounds the updated spans back into a bfloat16 residual (nothing to do for float32).
  void store();

 private:
  at::Tensor residual_, scratch_;
  int64_t offset_ = 0, lo_ = 0;
  ResidualSpans spans_;
  float* base_ = nullptr;
};

// The dtypes a residual may have: float32, or bfloat16 (compact).
bool residual_dtype_ok(const at::Tensor& residual);

}  // namespace gradzip::torch_ext
