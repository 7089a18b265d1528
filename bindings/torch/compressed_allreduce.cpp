#include "compressed_allreduce.hpp"

#include <ATen/ops/empty.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "bucket_reduction.hpp"
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
                                         c10::intrusive_ptr<c10d::ProcessGroup> gather_group,
                                         int64_t chunk)
    : group_(std::move(group)),
      gather_group_(std::move(gather_group)),
      spec_(codec),
      guard_(std::move(guard)),
      cast_sum_(cast_sum),
      chunk_(chunk) {
  TORCH_CHECK_VALUE(group_, "gradzip: compressed_allreduce needs a process group");
  TORCH_CHECK_VALUE(chunk_ >= kMinChunk, "gradzip: a chunk holds at least ", kMinChunk,
                    " elements (a smaller one costs a collective for a few kB), got ", chunk_);
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

const ReductionParts& CompressedAllreduce::bucket_reductions(int64_t index,
                                                            const std::vector<int64_t>& numels,
                                                            const std::vector<int64_t>& rows,
                                                            const std::vector<bool>& exact,
                                                            const at::Tensor& x,
                                                            Collective collective) {
  auto& cached = buckets_[index];
  if (!cached.reduction.parts.empty() && cached.numels == numels && cached.rows == rows &&
      cached.exact == exact && cached.collective == collective && cached.device == x.device())
    return cached.reduction;
  // CUDA: one piece (compressed_allreduce.hpp).
  cached = {numels, rows, exact, collective, x.device(),
            spec_.make(world(), rank(), numels, rows, exact, x.options(), collective, cast_sum_,
                       x.is_cuda() ? 0 : chunk_)};
  return cached.reduction;
}

namespace {

using Finish = std::function<void()>;

Finish allreduce_average(c10d::ProcessGroup& group, const at::Tensor& x) {
  // As PyTorch's allreduce_hook: divide first (no overflow), then sum.
  x.div_(static_cast<double>(group.getSize()));
  std::vector<at::Tensor> tensors{x};
  return [work = group.allreduce(tensors)] { work->wait(); };
}

// One chunk of a bucket's reduction with its tensors, and where it stands on the timeline.
struct Part {
  std::shared_ptr<Reduction> reduction;
  Operands operands;
  int64_t bucket = 0, index = 0;
};

// A collective of a part, started at `started_ms` (on the timeline's clock).
struct Started {
  c10::intrusive_ptr<c10d::Work> work;
  Step step = Step::alltoall;
  double started_ms = 0;
};

// Starts collective `step` of `part` on `group` (the Step list in bucket_reduction.hpp).
Started begin(c10d::ProcessGroup& group, Step step, const Part& part, Timeline* timeline) {
  TORCH_CHECK(is_collective(step), "gradzip: a phase is no collective to issue");
  const double t = timeline ? timeline->now_ms() : 0;
  Reduction& r = *part.reduction;
  if (step == Step::alltoall)
    return {group.alltoall_base(r.recv, r.send, r.recv_splits, r.send_splits), step, t};
  if (step == Step::allgather) return {group._allgather_base(r.gathered, r.gather_in), step, t};
  std::vector<at::Tensor> summed{r.summed(step, part.operands)};  // SUM in its dtype, in place
  return {group.allreduce(summed), step, t};
}

// Waits for a started collective of `part`, on `thread`.
void complete(const Started& c, const Part& part, Timeline* timeline, const char* thread) {
  c.work->wait();
  if (timeline)
    timeline->add({part.bucket, part.index, c.step, thread, c.started_ms, timeline->now_ms()});
}

// Runs phase `step` of `part`, on `thread`.
void compute(Step step, const Part& part, Timeline* timeline, const char* thread) {
  const double t = timeline ? timeline->now_ms() : 0;
  part.reduction->compute(step, part.operands);
  if (timeline) timeline->add({part.bucket, part.index, step, thread, t, timeline->now_ms()});
}

// Runs the reduction's steps (the same for every part) on this rank: each part's phases up to and
// including the start of its first collective, part after part, so that a chunk is encoded while
// the previous one travels; the returned Finish waits for those and runs the rest of each part in
// the same order, one part behind: part i's phases up to the start of its next collective, then
// the rest of part i - 1 (so that part i's owner sum runs while part i + 1's all-to-all travels,
// and part i - 1 is decoded while part i's all-gather travels). The first collective goes on
// `group`, a later all-gather on `gather_group` when there is one (so that it overlaps the next
// bucket's first collective); a later collective left on `group` must be issued in call order,
// so then the rest runs here up to the start of the last part's last collective (lowrank's second
// all-reduce), and the Finish waits for that and runs what follows it. Every rank issues the same
// collectives in the same order: the order depends on the number of parts only. `timeline`: where
// to record every step, or null.
Finish start(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
             const c10::intrusive_ptr<c10d::ProcessGroup>& gather_group,
             const std::vector<Part>& parts, const std::shared_ptr<Timeline>& timeline) {
  const std::vector<Step>& steps = parts[0].reduction->steps();
  const auto first = std::find_if(steps.begin(), steps.end(), is_collective);
  TORCH_CHECK(first != steps.end(), "gradzip: a reduction without a collective");
  std::vector<Started> firsts;
  for (const Part& part : parts) {
    for (auto step = steps.begin(); step != first; ++step)
      compute(*step, part, timeline.get(), "issue");
    firsts.push_back(begin(*group, *first, part, timeline.get()));
  }
  const std::vector<Step> rest(first + 1, steps.end());
  auto later_group = [group, gather_group](Step step) {
    return step == Step::allgather && gather_group ? gather_group : group;
  };
  const bool in_call_order = std::any_of(rest.begin(), rest.end(), [&](Step step) {
    return is_collective(step) && later_group(step) == group;
  });
  // Runs the rest on `thread`; with `hold`, returns the wait for the last part's last collective
  // and the phases after it, left for the finishing thread.
  auto run = [parts, firsts, rest, later_group, timeline](const char* thread, bool hold) -> Finish {
    Timeline* const t = timeline.get();
    // A part between two of its steps: rest[next] is the next to run, once `started` completes.
    struct Pending {
      size_t part = 0, next = 0;
      Started started;
    };
    // Runs part p's steps from rest[next] on up to the start of its next collective (returned) or
    // to its end (nullopt); with `all`, waits for every later collective and runs to the end.
    auto advance = [&](size_t p, size_t next, bool all) -> std::optional<Pending> {
      for (; next < rest.size(); ++next) {
        const Step step = rest[next];
        if (!is_collective(step)) {
          compute(step, parts[p], t, thread);
          continue;
        }
        const Started started = begin(*later_group(step), step, parts[p], t);
        if (!all) return Pending{p, next + 1, started};
        complete(started, parts[p], t, thread);
      }
      return std::nullopt;
    };
    auto catch_up = [&](const Pending& behind) {
      complete(behind.started, parts[behind.part], t, thread);
      advance(behind.part, behind.next, true);
    };
    std::optional<Pending> behind;
    for (size_t i = 0; i < parts.size(); ++i) {
      complete(firsts[i], parts[i], t, thread);
      const std::optional<Pending> now = advance(i, 0, false);
      if (behind) catch_up(*behind);
      behind = now;
    }
    if (!behind) return {};
    const std::vector<Step> tail(rest.begin() + static_cast<std::ptrdiff_t>(behind->next),
                                 rest.end());
    if (!hold || std::any_of(tail.begin(), tail.end(), is_collective)) {
      catch_up(*behind);
      return {};
    }
    return [part = parts[behind->part], started = behind->started, tail, timeline] {
      complete(started, part, timeline.get(), "finish");
      for (const Step step : tail) compute(step, part, timeline.get(), "finish");
    };
  };
  if (in_call_order) return run("issue", true);
  return [run] { run("finish", false); };
}

}  // namespace

c10::intrusive_ptr<c10::ivalue::Future> CompressedAllreduce::reduce(
    int64_t index, const at::Tensor& bucket, const at::Tensor& x,
    const std::vector<int64_t>& numels, const at::Tensor& residual,
    const at::Tensor& owner_residual, bool compress, const std::vector<bool>& exact,
    const std::vector<int64_t>& rows, const at::Tensor& q) {
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
  const ReductionParts* reduction =
      compress ? &bucket_reductions(index, numels, rows, exact, x, Collective::allreduce) : nullptr;
  const Parts parts = reduction ? reduction->parts : Parts{};
  if (owner_residual.defined() && !parts.empty()) {
    const std::vector<Step>& steps = parts[0]->steps();
    TORCH_CHECK_VALUE(std::find(steps.begin(), steps.end(), Step::reduce_owner) != steps.end(),
                      "gradzip: an owner residual needs the two-phase sum; ", spec_.name(),
                      " buckets are summed without it (cast_sum 'fp32' keeps the two-phase sum)");
  }
  // Every chunk reads and writes its own elements of the same tensors.
  std::vector<Part> chunks;
  for (const auto& part : parts)
    chunks.push_back({part, {x, residual, owner_residual, x, q, std::nullopt}, index,
                      static_cast<int64_t>(chunks.size())});
  // Uncompressed: counted as the fp32 ring all-reduce whatever x's dtype, as the reference is.
  const int64_t fp32 = fp32_traffic(x.numel(), world());
  traffic_[index] = reduction ? reduction->traffic : std::pair{fp32, fp32};
  const bool copy_back = !bucket.is_same(x);
  // The gather group is used on the CPU only: on CUDA everything is enqueued in call order.
  auto gather = x.is_cuda() ? c10::intrusive_ptr<c10d::ProcessGroup>() : gather_group_;
  return launch(index, bucket, parts, [group = group_, gather, guard = guard_, chunks, bucket, x,
                                   residual, owner_residual, q, copy_back,
                                   timeline = timeline_]() -> Finish {
    if (guard && !chunks.empty()) guard->save({residual, owner_residual, q});
    Finish rest = !chunks.empty() ? start(group, gather, chunks, timeline)
                                  : allreduce_average(*group, x);
    return [rest, guard, bucket, x, copy_back] {
      if (rest) rest();
      if (guard) guard->flag(x);
      if (copy_back) bucket.copy_(x);
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
  const ReductionParts& reduction =
      bucket_reductions(index, numels, {}, exact, x, Collective::reduce_scatter);
  traffic_[index] = reduction.traffic;
  // The sum is fp32; an output of another dtype receives it rounded once.
  const at::Tensor sum = output.scalar_type() == at::kFloat ? output : output.to(at::kFloat);
  const std::vector<Part> parts{
      {reduction.parts[0], {x, residual, {}, sum, {}, static_cast<float>(prescale)}, index}};
  return launch(index, output, reduction.parts, [group = group_, guard = guard_, parts, output, sum,
                                              residual, timeline = timeline_]() -> Finish {
    if (guard) guard->save({residual});
    return [rest = start(group, {}, parts, timeline), guard, output, sum] {
      if (rest) rest();
      if (guard) guard->flag(sum);
      if (!sum.is_same(output)) output.copy_(sum);
    };
  });
}

c10::intrusive_ptr<c10::ivalue::Future> CompressedAllreduce::launch(
    int64_t index, const at::Tensor& result, const Parts& watched, std::function<Finish()> body) {
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
  if (!future->hasError())
    for (const auto& r : watched) watch_decodes(*r, result, index);
  return future;
}

void CompressedAllreduce::watch_decodes(const Reduction& r, const at::Tensor& result,
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

void CompressedAllreduce::set_timeline(bool on) {
  timeline_ = on ? std::make_shared<Timeline>() : nullptr;
}

std::vector<Timeline::Event> CompressedAllreduce::take_timeline() {
  TORCH_CHECK_VALUE(timeline_, "gradzip: no timeline: set_timeline(true) starts one");
  return timeline_->take();
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
