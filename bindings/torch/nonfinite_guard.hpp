// Error-feedback state updates of one training step, kept revocable: an AMP overflow step (a
// reduced bucket holding Inf/NaN, which GradScaler skips) must leave every residual and moment as it
// was before the step. `save` copies state tensors before they are updated, `flag` records whether a
// reduced bucket is finite, `commit` (once every bucket of the step is reduced) restores all saved
// tensors if any bucket was not. On a GPU device-side only (torch.where on a device flag): no host
// synchronisation; on the CPU the flag is read and only an overflow step restores. The flags come from the reduced results, identical on all ranks, so every rank
// keeps or drops its updates together.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace gradzip::torch_ext {

class NonfiniteGuard : public torch::CustomClassHolder {
 public:
  // Undefined tensors are skipped; a tensor saved twice in one step keeps its first backup.
  void save(const std::vector<at::Tensor>& tensors);
  void flag(const at::Tensor& reduced);
  void commit();

 private:
  std::mutex mutex_;  // save runs on the hook's or the reducing thread, flag on the reducing one
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_;  // (state tensor, its backup)
  std::vector<at::Tensor> flags_;
  // Backups persist from step to step: a fresh multi-MB CPU buffer per step pays its page faults.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> backups_;
};

}  // namespace gradzip::torch_ext
