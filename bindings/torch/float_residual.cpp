#include "float_residual.hpp"

#include <ATen/ATen.h>

#include <algorithm>

namespace gradzip::torch_ext {
namespace {

// The CPU's scratch of this thread, grown to the largest span it has carried.
at::Tensor cpu_scratch(int64_t numel) {
  thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < numel)
    scratch = at::empty({numel}, at::TensorOptions().dtype(at::kFloat));
  return scratch;
}

}  // namespace

bool residual_dtype_ok(const at::Tensor& residual) {
  return residual.scalar_type() == at::kFloat || residual.scalar_type() == at::kBFloat16;
}

FloatResidual::FloatResidual(const at::Tensor& residual, int64_t offset, ResidualSpans spans)
    : residual_(residual), offset_(offset), spans_(std::move(spans)) {
  if (!residual_.defined()) return;
  if (residual_.scalar_type() == at::kFloat) {
    base_ = residual_.data_ptr<float>() + offset_;
    return;
  }
  if (spans_.empty()) return;
  lo_ = spans_.front().first;
  int64_t hi = lo_;
  for (const auto& [at, n] : spans_) {
    lo_ = std::min(lo_, at);
    hi = std::max(hi, at + n);
  }
  scratch_ = residual_.is_cpu() ? cpu_scratch(hi - lo_)
                                : at::empty({hi - lo_}, residual_.options().dtype(at::kFloat));
  for (const auto& [at, n] : spans_)
    scratch_.narrow(0, at - lo_, n).copy_(residual_.narrow(0, offset_ + at, n));
  base_ = scratch_.data_ptr<float>() - lo_;
}

void FloatResidual::store() {
  if (!scratch_.defined()) return;
  for (const auto& [at, n] : spans_)
    residual_.narrow(0, offset_ + at, n).copy_(scratch_.narrow(0, at - lo_, n));
}

}  // namespace gradzip::torch_ext
