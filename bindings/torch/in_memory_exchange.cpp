#include "in_memory_exchange.hpp"

#include <ATen/ops/zeros_like.h>

namespace gradzip::torch_ext {
namespace {

// The bytes [at, at + len) of a uint8 buffer.
at::Tensor bytes(const at::Tensor& buffer, int64_t at, int64_t len) {
  return buffer.narrow(0, at, len);
}

void alltoall(const std::vector<BucketReduction*>& ranks) {
  const size_t world = ranks.size();
  std::vector<int64_t> sent(world, 0);  // per sender, the offset of its bytes for the next rank
  for (BucketReduction* to : ranks) {
    int64_t received = 0;
    for (size_t i = 0; i < world; ++i) {
      const int64_t len = ranks[i]->send_splits[to->rank()];
      bytes(to->recv, received, len).copy_(bytes(ranks[i]->send, sent[i], len));
      sent[i] += len;
      received += len;
    }
  }
}

void allgather(const std::vector<BucketReduction*>& ranks) {
  for (BucketReduction* to : ranks) {
    int64_t at = 0;
    for (BucketReduction* from : ranks) {
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

void allreduce_payload(const std::vector<BucketReduction*>& ranks) {
  std::vector<at::Tensor> payloads;
  for (BucketReduction* r : ranks) payloads.push_back(r->payload);
  sum_in_place(payloads);
}

void check_world(size_t ranks, size_t operands) {
  TORCH_CHECK_VALUE(ranks >= 1, "gradzip: an in-memory reduction needs at least one rank");
  TORCH_CHECK_VALUE(operands == ranks, "gradzip: ", operands, " ranks' tensors for ", ranks,
                    " reductions");
}

void check_ranks(const std::vector<BucketReduction*>& ranks,
                 const std::vector<Operands>& operands) {
  check_world(ranks.size(), operands.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    TORCH_CHECK_VALUE(ranks[r] != nullptr && ranks[r]->rank() == static_cast<int64_t>(r) &&
                          ranks[r]->layout().world == static_cast<int64_t>(ranks.size()),
                      "gradzip: the reductions must be those of ranks 0..", ranks.size() - 1,
                      " of a world of ", ranks.size(), ", in rank order");
    TORCH_CHECK_VALUE(ranks[r]->codec() == ranks[0]->codec() &&
                          ranks[r]->layout() == ranks[0]->layout(),
                      "gradzip: the reductions of one bucket must share its codec and layout");
  }
}

}  // namespace

void reduce_in_memory(const std::vector<BucketReduction*>& ranks,
                      const std::vector<Operands>& operands) {
  check_ranks(ranks, operands);
  for (const Step step : ranks[0]->layout().steps) {
    switch (step) {
      case Step::allreduce_payload:
        allreduce_payload(ranks);
        break;
      case Step::alltoall:
        alltoall(ranks);
        break;
      case Step::allgather:
        allgather(ranks);
        break;
      default:
        for (size_t r = 0; r < ranks.size(); ++r) ranks[r]->compute(step, operands[r]);
    }
  }
}

void reduce_in_memory(const std::vector<LowRankReduction*>& ranks,
                      const std::vector<LowRankOperands>& operands) {
  check_world(ranks.size(), operands.size());
  for (const LowRankReduction* r : ranks)
    TORCH_CHECK_VALUE(r != nullptr && r->world() == static_cast<int64_t>(ranks.size()) &&
                          r->same_layout(*ranks[0]),
                      "gradzip: the lowrank reductions must be of one bucket's tensors over a "
                      "world of ", ranks.size());
  for (const LowRankStep step : LowRankReduction::steps()) {
    if (is_allreduce(step)) {
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
