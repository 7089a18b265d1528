#include "in_memory_exchange.hpp"

#include <ATen/ops/zeros_like.h>

namespace gradzip::torch_ext {
namespace {

// The bytes [at, at + len) of a uint8 buffer.
at::Tensor bytes(const at::Tensor& buffer, int64_t at, int64_t len) {
  return buffer.narrow(0, at, len);
}

void alltoall(const std::vector<Reduction*>& ranks) {
  const size_t world = ranks.size();
  std::vector<int64_t> sent(world, 0);  // per sender, the offset of its bytes for the next rank
  for (Reduction* to : ranks) {
    int64_t received = 0;
    for (size_t i = 0; i < world; ++i) {
      const int64_t len = ranks[i]->send_splits[to->rank()];
      bytes(to->recv, received, len).copy_(bytes(ranks[i]->send, sent[i], len));
      sent[i] += len;
      received += len;
    }
  }
}

void allgather(const std::vector<Reduction*>& ranks) {
  for (Reduction* to : ranks) {
    int64_t at = 0;
    for (Reduction* from : ranks) {
      const int64_t len = from->gather_in.numel();
      bytes(to->gathered, at, len).copy_(from->gather_in);
      at += len;
    }
  }
}

// The all-reduce (SUM) of the W buffers: summed in fp32 in rank order, rounded once to their dtype.
void sum_in_place(const std::vector<at::Tensor>& buffers) {
  const at::Tensor total = at::zeros_like(buffers[0], buffers[0].options().dtype(at::kFloat));
  for (const at::Tensor& b : buffers) total.add_(b);
  for (const at::Tensor& b : buffers) b.copy_(total);
}

void check_ranks(const std::vector<Reduction*>& ranks, const std::vector<Operands>& operands) {
  TORCH_CHECK_VALUE(!ranks.empty(), "gradzip: an in-memory reduction needs at least one rank");
  TORCH_CHECK_VALUE(operands.size() == ranks.size(), "gradzip: ", operands.size(),
                    " ranks' tensors for ", ranks.size(), " reductions");
  for (size_t r = 0; r < ranks.size(); ++r) {
    TORCH_CHECK_VALUE(ranks[r] != nullptr && ranks[r]->rank() == static_cast<int64_t>(r) &&
                          ranks[r]->world() == static_cast<int64_t>(ranks.size()),
                      "gradzip: the reductions must be those of ranks 0..", ranks.size() - 1,
                      " of a world of ", ranks.size(), ", in rank order");
    TORCH_CHECK_VALUE(ranks[r]->same_layout(*ranks[0]),
                      "gradzip: the reductions of one bucket must share its codec and layout");
  }
}

}  // namespace

void reduce_in_memory(const std::vector<Reduction*>& ranks, const std::vector<Operands>& operands) {
  check_ranks(ranks, operands);
  for (const Step step : ranks[0]->steps()) {
    if (step == Step::alltoall) {
      alltoall(ranks);
    } else if (step == Step::allgather) {
      allgather(ranks);
    } else if (is_allreduce(step)) {
      std::vector<at::Tensor> summed;
      for (size_t r = 0; r < ranks.size(); ++r)
        summed.push_back(ranks[r]->summed(step, operands[r]));
      sum_in_place(summed);
    } else {
      for (size_t r = 0; r < ranks.size(); ++r) ranks[r]->compute(step, operands[r]);
    }
  }
}

}  // namespace gradzip::torch_ext
