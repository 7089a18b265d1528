#include "nonfinite_guard.hpp"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>

#include <unordered_set>

namespace gradzip::torch_ext {

void NonfiniteGuard::save(const std::vector<at::Tensor>& tensors) {
  const std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    const auto* key = t.unsafeGetTensorImpl();
    bool seen = false;
    for (const auto& [u, _] : saved_) seen = seen || u.unsafeGetTensorImpl() == key;
    if (seen) continue;
    auto& backup = backups_[key];
    if (!backup.defined() || !backup.is_same_size(t) || backup.device() != t.device())
      backup = at::empty_like(t);
    backup.copy_(t);
    saved_.emplace_back(t, backup);
  }
}

namespace {

// Whether every value is finite, in one read pass without a temporary: v * 0 is 0 for a finite v
// and NaN for Inf or NaN, so the sums stay exactly 0 unless one is not. Sixteen independent sums
// let the compiler vectorise without reordering any of them.
bool all_finite(const float* v, int64_t n) {
  constexpr int64_t kLanes = 16;
  float sums[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) sums[j] += v[i + j] * 0.0f;
  for (; i < n; ++i) sums[0] += v[i] * 0.0f;
  float total = 0.0f;
  for (const float s : sums) total += s;
  return total == 0.0f;
}

}  // namespace

void NonfiniteGuard::flag(const at::Tensor& reduced) {
  at::Tensor ok = reduced.is_cpu() && reduced.scalar_type() == at::kFloat && reduced.is_contiguous()
                      ? at::scalar_tensor(all_finite(reduced.const_data_ptr<float>(),
                                                     reduced.numel()),
                                          at::kBool)
                      : at::isfinite(reduced).all();
  const std::lock_guard<std::mutex> lock(mutex_);
  flags_.push_back(std::move(ok));
}

void NonfiniteGuard::commit() {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (!saved_.empty() && !flags_.empty()) {
    std::vector<at::Tensor> flags;
    for (const auto& f : flags_) flags.push_back(f.to(flags_[0].device()));
    const at::Tensor ok = flags.size() == 1 ? flags[0] : at::stack(flags).all();
    if (ok.is_cpu()) {
      // Read on the host at no cost: restore only on an overflow step, instead of a select pass
      // over every state tensor at every step.
      if (!ok.item<bool>())
        for (auto& [t, old] : saved_) t.copy_(old);
    } else {
      for (auto& [t, old] : saved_) at::where_out(t, ok.to(t.device()), t, old);
    }
  }
  flags_.clear();
  // Keep only the backups of tensors saved this step (a rebuilt bucket's old state is gone).
  if (saved_.empty()) return;
  std::unordered_set<const c10::TensorImpl*> live;
  for (const auto& [t, _] : saved_) live.insert(t.unsafeGetTensorImpl());
  for (auto it = backups_.begin(); it != backups_.end();)
    it = live.count(it->first) ? std::next(it) : backups_.erase(it);
  saved_.clear();
}

}  // namespace gradzip::torch_ext
