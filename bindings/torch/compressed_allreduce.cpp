#include "compressed_allreduce.hpp"

#include <ATen/ops/empty.h>
#include <c10/util/irange.h>

#include <limits>

#include "device_codec.hpp"

#if defined(GRADZIP_TORCH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gradzip::torch_ext {

CompressedAllreduce::CompressedAllreduce(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                         const std::string& codec,
                                         c10::intrusive_ptr<NonfiniteGuard> guard,
                                         CastSum cast_sum)
    : group_(std::move(group)),
      lowrank_(parse_lowrank(codec)),
      codec_(lowrank_ ? std::nullopt : std::optional<Codec>(guarded("compressed_allreduce", [&] {
        return Codec::parse(codec);
      }))),
      guard_(std::move(guard)),
      cast_sum_(cast_sum) {
  TORCH_CHECK_VALUE(group_, "gradzip: compressed_allreduce needs a process group");
}

CompressedAllreduce::~CompressedAllreduce() {
  {
    const std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->stopping = true;
  }
  queue_->wake.notify_all();
  if (thread_.joinable()) thread_.detach();  // it finishes the queued jobs, then exits
}

void CompressedAllreduce::submit(std::function<void()> job) {
  {
    const std::lock_guard<std::mutex> lock(queue_->mutex);
    if (!thread_.joinable()) thread_ = std::thread([queue = queue_] { serve(queue); });
    queue_->jobs.push_back(std::move(job));
  }
  queue_->wake.notify_one();
}

void CompressedAllreduce::serve(const std::shared_ptr<Queue>& queue) {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(queue->mutex);
      queue->wake.wait(lock, [&] { return queue->stopping || !queue->jobs.empty(); });
      if (queue->jobs.empty()) return;  // stopping, nothing left
      job = std::move(queue->jobs.front());
      queue->jobs.pop_front();
    }
    job();
  }
}

const Codec& CompressedAllreduce::codec() const {
  TORCH_CHECK_VALUE(codec_, "gradzip: a lowrank:", lowrank_.value_or(0),
                    " reduction compresses with reduce_lowrank, not reduce / reduce_scatter");
  return *codec_;
}

std::shared_ptr<BucketReduction> CompressedAllreduce::bucket_reduction(
    int64_t index, const std::vector<int64_t>& numels, const std::vector<bool>& exact,
    const at::Tensor& x, Collective collective) {
  auto& cached = buckets_[index];
  if (!cached.reduction || cached.numels != numels || cached.exact != exact ||
      cached.reduction->layout().collective != collective ||
      cached.reduction->gathered.device() != x.device())
    cached = {numels, exact,
              std::make_shared<BucketReduction>(codec(), world(), rank(), numels, x.options(),
                                                collective, cast_sum_, exact)};
  return cached.reduction;
}

namespace {

void allreduce_average(c10d::ProcessGroup& group, const at::Tensor& x) {
  // As PyTorch's allreduce_hook: divide first (no overflow), then sum.
  x.div_(static_cast<double>(group.getSize()));
  std::vector<at::Tensor> tensors{x};
  group.allreduce(tensors)->wait();
}

void run(c10d::ProcessGroup& group, BucketReduction& r, const at::Tensor& x,
         const at::Tensor& residual, const at::Tensor& owner_residual) {
  r.encode(x, residual);
  if (r.wire_sum()) {
    // SUM in the wire dtype, in place: the backend gives every rank the same result.
    std::vector<at::Tensor> payload{r.payload};
    group.allreduce(payload)->wait();
  } else {
    if (r.two_phase()) {
      group.alltoall_base(r.recv, r.send, r.recv_splits, r.send_splits)->wait();
      r.reduce_owner(owner_residual);
    }
    group._allgather_base(r.gathered, r.gather_in)->wait();
  }
  r.decode(x);
}

}  // namespace

c10::intrusive_ptr<c10::ivalue::Future> CompressedAllreduce::reduce(
    int64_t index, const at::Tensor& bucket, const at::Tensor& x,
    const std::vector<int64_t>& numels, const at::Tensor& residual,
    const at::Tensor& owner_residual, bool compress, const std::vector<bool>& exact) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || !compress,
                   "gradzip: the values to compress must be float32");
  TORCH_CHECK_VALUE(x.is_contiguous() && bucket.numel() == x.numel() &&
                        bucket.device() == x.device(),
                    "gradzip: the bucket and its float32 values must match in size and device");
  compress = compress && world() > 1;
  std::shared_ptr<BucketReduction> r =
      compress ? bucket_reduction(index, numels, exact, x, Collective::allreduce) : nullptr;
  TORCH_CHECK_VALUE(!owner_residual.defined() || !r || !r->wire_sum(),
                    "gradzip: an owner residual needs the two-phase sum; ", codec().name(),
                    " buckets are summed by one all-reduce in the wire dtype (cast_sum 'fp32' "
                    "keeps the two-phase sum)");
  const bool copy_back = !bucket.is_same(x);
  return launch(index, bucket, r, [group = group_, guard = guard_, r, bucket, x, residual,
                                   owner_residual, copy_back] {
    if (r)
      run(*group, *r, x, residual, owner_residual);
    else
      allreduce_average(*group, x);
    if (guard) guard->flag(x);
    if (copy_back) bucket.copy_(x);
  });
}

c10::intrusive_ptr<c10::ivalue::Future> CompressedAllreduce::reduce_lowrank(
    int64_t index, const at::Tensor& bucket, const at::Tensor& x, const std::vector<int64_t>& numels,
    const std::vector<int64_t>& rows, const at::Tensor& residual, const at::Tensor& q) {
  TORCH_CHECK_VALUE(lowrank_, "gradzip: reduce_lowrank needs a lowrank:R reduction, this one is ",
                    codec().name());
  TORCH_CHECK_VALUE(bucket.numel() == x.numel() && bucket.device() == x.device(),
                    "gradzip: the bucket and its float32 values must match in size and device");
  auto& cached = lowrank_buckets_[index];
  if (!cached.reduction || cached.numels != numels || cached.rows != rows ||
      cached.reduction->p.device() != x.device())
    cached = {numels, rows,
              std::make_shared<LowRankReduction>(*lowrank_, world(), numels, rows, x.options())};
  const bool copy_back = !bucket.is_same(x);
  return launch(index, bucket, nullptr, [group = group_, guard = guard_, r = cached.reduction,
                                         bucket, x, residual, q, copy_back] {
    r->compute_p(x, residual, q);
    std::vector<at::Tensor> p{r->p};
    group->allreduce(p)->wait();
    r->compute_q(x, q);
    std::vector<at::Tensor> qs{q};
    group->allreduce(qs)->wait();
    r->finish(x, residual, q);
    if (guard) guard->flag(x);
    if (copy_back) bucket.copy_(x);
  });
}

c10::intrusive_ptr<c10::ivalue::Future> CompressedAllreduce::reduce_scatter(
    int64_t index, const at::Tensor& output, const at::Tensor& x, const std::vector<int64_t>& numels,
    const at::Tensor& residual, double prescale, const std::vector<bool>& exact) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "gradzip: the values to compress must be float32");
  TORCH_CHECK_VALUE(x.is_contiguous() && output.is_contiguous() &&
                        x.numel() == world() * output.numel() && output.device() == x.device(),
                    "gradzip: reduce_scatter needs a contiguous input of world size (", world(),
                    ") times the output's ", output.numel(), " elements on its device, got ",
                    x.numel(), " elements");
  std::shared_ptr<BucketReduction> r =
      bucket_reduction(index, numels, exact, x, Collective::reduce_scatter);
  // The sum is fp32; an output of another dtype receives it rounded once.
  const at::Tensor sum = output.scalar_type() == at::kFloat ? output : output.to(at::kFloat);
  return launch(index, output, r, [group = group_, guard = guard_, r, output, sum, x, residual,
                                   prescale] {
    r->encode(x, residual, static_cast<float>(prescale));
    group->alltoall_base(r->recv, r->send, r->recv_splits, r->send_splits)->wait();
    r->sum_shard(sum);
    if (guard) guard->flag(sum);
    if (!sum.is_same(output)) output.copy_(sum);
  });
}

c10::intrusive_ptr<c10::ivalue::Future> CompressedAllreduce::launch(
    int64_t index, const at::Tensor& result, const std::shared_ptr<BucketReduction>& r,
    std::function<void()> body) {
  std::vector<c10::Device> devices;
  if (result.is_cuda()) devices.push_back(result.device());
  auto future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), devices);
  // Captures no `this`: on the CPU path it may run after this object is gone.
  auto work = [body = std::move(body), result, future] {
    try {
      const at::NoGradGuard no_grad;
      body();
      future->markCompleted(c10::IValue(c10::List<at::Tensor>({result})));
    } catch (...) {
      future->setError(std::current_exception());
    }
  };
  if (!result.is_cuda()) {
    submit(std::move(work));
    return future;
  }
  work();
  if (r && !future->hasError()) watch_decodes(*r, result, index);
  return future;
}

void CompressedAllreduce::watch_decodes(const BucketReduction& r, const at::Tensor& result,
                                        int64_t index) {
#if defined(GRADZIP_TORCH_CUDA)
  if (!r.decode_status.defined()) return;
  // Device side: a rejected message leaves the result untouched, i.e. wrong; make it NaN.
  const at::Tensor words = r.decode_status.view(at::kLong).view({-1, 2}).select(1, 0);
  const at::Tensor bad = words.ne(0).any();
  result.masked_fill_(bad, std::numeric_limits<float>::quiet_NaN());
  // Host side: copy the status words out asynchronously; check_errors reads them once done.
  at::Tensor host = at::empty(r.decode_status.sizes(),
                              r.decode_status.options().device(at::kCPU).pinned_memory(true));
  host.copy_(r.decode_status, /*non_blocking=*/true);
  auto event = std::make_shared<at::cuda::CUDAEvent>();
  event->record(c10::cuda::getCurrentCUDAStream(result.device().index()));
  const std::lock_guard<std::mutex> lock(checks_mutex_);
  pending_checks_.push_back([host, event, index] {
    if (!event->query()) return false;
    const auto* w = host.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < host.numel() / 8; i += 2)
      TORCH_CHECK_VALUE(w[i] == 0, "gradzip: bucket ", index,
                        ": a received message failed validation on the device (corrupt payload "
                        "or size mismatch, status word ",
                        w[i], "); its gradient was set to NaN");
    return true;
  });
#else
  (void)r, (void)result, (void)index;
#endif
}

void CompressedAllreduce::check_errors() {
  const std::lock_guard<std::mutex> lock(checks_mutex_);
  auto& pending = pending_checks_;
  for (size_t i = 0; i < pending.size();) {
    bool done = false;
    try {
      done = pending[i]();
    } catch (...) {
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
      throw;
    }
    if (done)
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    else
      ++i;
  }
}

}  // namespace gradzip::torch_ext
