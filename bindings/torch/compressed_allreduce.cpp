#include "compressed_allreduce.hpp"

#include <ATen/ops/empty.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "device_codec.hpp"

#if defined(GRADZIP_TORCH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gradzip::torch_ext {

CompressedAllreduce::CompressedAllreduce(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                         const std::string& codec,
                                         c10::intrusive_ptr<NonfiniteGuard> guard,
                                         CastSum cast_sum,
                                         c10::intrusive_ptr<c10d::ProcessGroup> gather_group)
    : group_(std::move(group)),
      gather_group_(std::move(gather_group)),
      lowrank_(parse_lowrank(codec)),
      codec_(lowrank_ ? std::nullopt : std::optional<Codec>(guarded("compressed_allreduce", [&] {
        return Codec::parse(codec);
      }))),
      guard_(std::move(guard)),
      cast_sum_(cast_sum) {
  TORCH_CHECK_VALUE(group_, "gradzip: compressed_allreduce needs a process group");
  TORCH_CHECK_VALUE(!gather_group_ || (gather_group_->getSize() == group_->getSize() &&
                                       gather_group_->getRank() == group_->getRank()),
                    "gradzip: the gather group must hold the same ranks as the group");
  issue_->next = std::make_shared<Queue>();
}

CompressedAllreduce::~CompressedAllreduce() { stop(issue_); }

void CompressedAllreduce::post(const std::shared_ptr<Queue>& queue, std::function<void()> job) {
  {
    const std::lock_guard<std::mutex> lock(queue->mutex);
    if (!queue->started) {
      std::thread([queue] { serve(queue); }).detach();
      queue->started = true;
    }
    queue->jobs.push_back(std::move(job));
  }
  queue->wake.notify_one();
}

void CompressedAllreduce::stop(const std::shared_ptr<Queue>& queue) {
  bool served = false;
  {
    const std::lock_guard<std::mutex> lock(queue->mutex);
    queue->stopping = true;
    served = queue->started;
  }
  queue->wake.notify_all();
  if (!served && queue->next) stop(queue->next);  // no thread to pass the stop on
}

void CompressedAllreduce::serve(const std::shared_ptr<Queue>& queue) {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(queue->mutex);
      queue->wake.wait(lock, [&] { return queue->stopping || !queue->jobs.empty(); });
      if (queue->jobs.empty()) break;  // stopping, nothing left
      job = std::move(queue->jobs.front());
      queue->jobs.pop_front();
    }
    job();
  }
  if (queue->next) stop(queue->next);
}

const Codec& CompressedAllreduce::codec() const {
  TORCH_CHECK_VALUE(codec_, "gradzip: a lowrank:", lowrank_.value_or(0),
                    " reduction compresses with reduce_lowrank, not reduce / reduce_scatter");
  return *codec_;
}

const CompressedAllreduce::Cached& CompressedAllreduce::bucket_reductions(
    int64_t index, const std::vector<int64_t>& numels, const std::vector<bool>& exact,
    const at::Tensor& x, Collective collective) {
  auto& cached = buckets_[index];
  if (!cached.parts.empty() && cached.numels == numels && cached.exact == exact &&
      cached.parts[0]->layout().collective == collective &&
      cached.parts[0]->gathered.device() == x.device())
    return cached;
  const BucketLayout whole(codec(), world(), numels, collective, cast_sum_, exact);
  Parts parts;
  if (whole.wire_sum && !x.is_cuda()) {
    // Casts are element-wise: chunks encode to the same values, and the backend sums each alone.
    for (int64_t lo = 0; lo < whole.n; lo += kCastChunk)
      parts.push_back(std::make_shared<BucketReduction>(
          codec(), world(), rank(), std::vector<int64_t>{std::min(kCastChunk, whole.n - lo)},
          x.options(), collective, cast_sum_));
  } else {
    parts.push_back(std::make_shared<BucketReduction>(codec(), world(), rank(), numels,
                                                      x.options(), collective, cast_sum_, exact));
  }
  cached = {numels, exact, std::move(parts), whole.traffic(rank())};
  return cached;
}

namespace {

using Finish = std::function<void()>;

Finish allreduce_average(c10d::ProcessGroup& group, const at::Tensor& x) {
  // As PyTorch's allreduce_hook: divide first (no overflow), then sum.
  x.div_(static_cast<double>(group.getSize()));
  std::vector<at::Tensor> tensors{x};
  return [work = group.allreduce(tensors)] { work->wait(); };
}

// One chunk of a bucket's reduction with its tensors.
struct Part {
  std::shared_ptr<BucketReduction> reduction;
  Operands operands;
};

// Starts one collective of `r` on `group` (the Step list in bucket_reduction.hpp).
c10::intrusive_ptr<c10d::Work> issue(c10d::ProcessGroup& group, Step step, BucketReduction& r) {
  TORCH_CHECK(is_collective(step), "gradzip: a phase is no collective to issue");
  if (step == Step::allreduce_payload) {
    std::vector<at::Tensor> payload{r.payload};  // SUM in the wire dtype, in place
    return group.allreduce(payload);
  }
  if (step == Step::alltoall)
    return group.alltoall_base(r.recv, r.send, r.recv_splits, r.send_splits);
  return group._allgather_base(r.gathered, r.gather_in);
}

// Runs the layout's steps (the same for every part) on this rank: each part's phases up to and
// including the start of its first collective, part after part, so that a chunk is encoded while
// the previous one travels; the returned Finish waits for those and runs the rest of each part in
// the same order. The first collective goes on `group`, a later all-gather on `gather_group` when
// there is one (so that it overlaps the next bucket's first collective); a later collective left
// on `group` must be issued in call order, so then the rest runs here at once (empty Finish).
Finish start(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
             const c10::intrusive_ptr<c10d::ProcessGroup>& gather_group,
             const std::vector<Part>& parts) {
  const std::vector<Step>& steps = parts[0].reduction->layout().steps;
  const auto first = std::find_if(steps.begin(), steps.end(), is_collective);
  TORCH_CHECK(first != steps.end(), "gradzip: a reduction without a collective");
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const Part& part : parts) {
    for (auto step = steps.begin(); step != first; ++step)
      part.reduction->compute(*step, part.operands);
    works.push_back(issue(*group, *first, *part.reduction));
  }
  const std::vector<Step> rest(first + 1, steps.end());
  auto later_group = [group, gather_group](Step step) {
    return step == Step::allgather && gather_group ? gather_group : group;
  };
  Finish finish = [parts, works, rest, later_group] {
    for (size_t i = 0; i < parts.size(); ++i) {
      works[i]->wait();
      BucketReduction& r = *parts[i].reduction;
      for (const Step step : rest) {
        if (is_collective(step))
          issue(*later_group(step), step, r)->wait();
        else
          r.compute(step, parts[i].operands);
      }
    }
  };
  const bool in_call_order = std::any_of(rest.begin(), rest.end(), [&](Step step) {
    return is_collective(step) && later_group(step) == group;
  });
  if (!in_call_order) return finish;
  finish();
  return {};
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
  TORCH_CHECK_VALUE(!compress || std::accumulate(numels.begin(), numels.end(), int64_t{0}) ==
                                     x.numel(),
                    "gradzip: the sizes of the bucket's tensors do not add up to its ", x.numel(),
                    " elements");
  const Cached* cached =
      compress ? &bucket_reductions(index, numels, exact, x, Collective::allreduce) : nullptr;
  const Parts parts = cached ? cached->parts : Parts{};
  const std::shared_ptr<BucketReduction> r = compress ? parts[0] : nullptr;
  TORCH_CHECK_VALUE(!owner_residual.defined() || !r || !r->wire_sum(),
                    "gradzip: an owner residual needs the two-phase sum; ", codec().name(),
                    " buckets are summed by one all-reduce in the wire dtype (cast_sum 'fp32' "
                    "keeps the two-phase sum)");
  // Casts are element-wise: the chunks of a CPU cast bucket encode to the same values, and the
  // backend sums each alone.
  std::vector<Part> chunks;
  for (int64_t lo = 0; const auto& part : parts) {
    const int64_t n = part->layout().n;
    auto slice = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, lo, n) : t; };
    chunks.push_back({part, {slice(x), slice(residual), owner_residual, slice(x), std::nullopt}});
    lo += n;
  }
  // Uncompressed: counted as the fp32 ring all-reduce whatever x's dtype, as the reference is.
  const int64_t fp32 = fp32_traffic(x.numel(), world());
  traffic_[index] = cached ? cached->traffic : std::pair{fp32, fp32};
  const bool copy_back = !bucket.is_same(x);
  // The gather group is used on the CPU only: on CUDA everything is enqueued in call order.
  auto gather = x.is_cuda() ? c10::intrusive_ptr<c10d::ProcessGroup>() : gather_group_;
  return launch(index, bucket, r, [group = group_, gather, guard = guard_, chunks, bucket, x,
                                   residual, owner_residual, copy_back]() -> Finish {
    if (guard && !chunks.empty()) guard->save({residual, owner_residual});
    Finish rest = !chunks.empty() ? start(group, gather, chunks) : allreduce_average(*group, x);
    return [rest, guard, bucket, x, copy_back] {
      if (rest) rest();
      if (guard) guard->flag(x);
      if (copy_back) bucket.copy_(x);
    };
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
  traffic_[index] = cached.reduction->traffic();
  const bool copy_back = !bucket.is_same(x);
  const LowRankOperands operands{x, residual, q};
  return launch(index, bucket, nullptr, [group = group_, guard = guard_, r = cached.reduction,
                                         bucket, operands, copy_back]() -> Finish {
    if (guard) guard->save({operands.residual, operands.q});
    auto allreduce = [&](LowRankStep step) {
      std::vector<at::Tensor> summed{r->summed(step, operands)};
      return group->allreduce(summed);
    };
    // Every step up to the start of the last all-reduce here (an all-reduce before it waited for:
    // the next one is issued on the same group, in call order), the rest once that completes.
    const std::vector<LowRankStep>& steps = LowRankReduction::steps();
    const auto last = std::find_if(steps.rbegin(), steps.rend(), is_allreduce).base() - 1;
    for (auto step = steps.begin(); step != last; ++step) {
      if (is_allreduce(*step))
        allreduce(*step)->wait();
      else
        r->compute(*step, operands);
    }
    return [work = allreduce(*last), rest = std::vector<LowRankStep>(last + 1, steps.end()), guard,
            r, bucket, operands, copy_back] {
      work->wait();
      for (const LowRankStep step : rest) r->compute(step, operands);
      if (guard) guard->flag(operands.x);
      if (copy_back) bucket.copy_(operands.x);
    };
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
  const Cached& cached = bucket_reductions(index, numels, exact, x, Collective::reduce_scatter);
  const std::shared_ptr<BucketReduction> r = cached.parts[0];
  traffic_[index] = cached.traffic;
  // The sum is fp32; an output of another dtype receives it rounded once.
  const at::Tensor sum = output.scalar_type() == at::kFloat ? output : output.to(at::kFloat);
  const std::vector<Part> parts{{r, {x, residual, {}, sum, static_cast<float>(prescale)}}};
  return launch(index, output, r, [group = group_, guard = guard_, parts, output, sum,
                                   residual]() -> Finish {
    if (guard) guard->save({residual});
    return [rest = start(group, {}, parts), guard, output, sum] {
      if (rest) rest();
      if (guard) guard->flag(sum);
      if (!sum.is_same(output)) output.copy_(sum);
    };
  });
}

c10::intrusive_ptr<c10::ivalue::Future> CompressedAllreduce::launch(
    int64_t index, const at::Tensor& result, const std::shared_ptr<BucketReduction>& r,
    std::function<Finish()> body) {
  std::vector<c10::Device> devices;
  if (result.is_cuda()) devices.push_back(result.device());
  auto future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), devices);
  // Runs a step; false (the Future holding the error) if it threw.
  auto attempt = [future](const std::function<void()>& step) {
    try {
      const at::NoGradGuard no_grad;
      step();
      return true;
    } catch (...) {
      future->setError(std::current_exception());
      return false;
    }
  };
  auto finish = [attempt, result, future](const Finish& rest) {
    if (attempt([&] {
          if (rest) rest();
        }))
      future->markCompleted(c10::IValue(c10::List<at::Tensor>({result})));
  };
  if (!result.is_cuda()) {
    // Captures no `this`: on the CPU path it may run after this object is gone.
    post(issue_, [body = std::move(body), attempt, finish, next = issue_->next] {
      Finish rest;
      if (attempt([&] { rest = body(); })) post(next, [finish, rest] { finish(rest); });
    });
    return future;
  }
  Finish rest;
  if (attempt([&] { rest = body(); })) finish(rest);
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

std::pair<int64_t, int64_t> CompressedAllreduce::traffic(int64_t index) const {
  const auto it = traffic_.find(index);
  TORCH_CHECK_VALUE(it != traffic_.end(), "gradzip: bucket ", index,
                    " was never reduced by this CompressedAllreduce: no traffic to report");
  return it->second;
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
