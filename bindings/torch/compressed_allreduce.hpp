// The compressed average of DDP buckets, and the compressed reduce-scatter of FSDP's gradients, over
// a c10d::ProcessGroup (Gloo, NCCL, any backend with all-to-all, all-gather and a float16/bfloat16
// all-reduce), usable from C++ without Python:
//
//   auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, options);
//   gradzip::torch_ext::CompressedAllreduce reduce(group, "sign");
//   at::Tensor residual = at::zeros_like(grad);
//   reduce.reduce(0, grad, grad, {grad.numel()}, residual, {}, true)->wait();  // grad averaged
//
// One object per model (per process group) and codec. It runs the steps of a bucket's reduction in
// their order (Reduction::steps, reduction.hpp: the codec's exchange or lowrank's factors, made
// once per bucket layout from the codec), each collective as the group's; the W ranks of the
// simulation run the same steps in memory (in_memory_exchange.hpp). reduce() returns at
// once with a Future of the bucket (a one-tensor list, as c10d's collectives); the bucket holds
// the average when it completes.
//   * CPU tensors: two threads of their own form a pipeline. The issuing thread encodes a bucket
//     and starts its first collective without waiting for it, bucket after bucket in call order,
//     so that every rank issues its collectives in the same order (the backend matches them by
//     order); the finishing thread waits for it, does the rest (a two-phase bucket's owner sum and
//     all-gather, on `gather_group`) and decodes. So bucket k+1 is encoded while bucket k travels,
//     as PyTorch's hooks cast a bucket while the previous one is all-reduced, and the caller
//     (DDP's backward pass) is never blocked by communication. Without a gather group a
//     two-phase bucket's all-gather stays on the issuing thread (its order on `group` must not
//     depend on timing).
//   * CUDA tensors: everything is enqueued on the caller's current stream at once; a collective's
//     wait() makes the stream wait for it (NCCL), the host does not. So a bucket's collectives
//     also hold back the kernels the caller enqueues after it (DDP's backward pass): a
//     communication stream of its own, synchronised by events, is not built. Decode errors leave
//     a device-side status word: the bucket is filled with NaN on the device (GradScaler and the
//     non-finite guard see it at once) and check_errors() raises the decoder's error once the
//     stream has passed that point, without waiting for it.
// A CPU bucket of more than `chunk` elements is reduced as consecutive chunks (BucketLayout::chunks:
// the same bits as in one piece but for the order of a backend's wire-dtype sum), each chunk's
// phases overlapping the other chunks' collectives within the bucket as well: chunk k+1 is encoded
// while chunk k's first collective travels, chunk k's owner sum runs while chunk k+1's all-to-all
// travels, and chunk k is decoded while chunk k+1's all-gather travels. CUDA buckets are reduced
// in one piece until a GPU has run the chunks (their phases on the caller's stream could overlap
// the other chunks' collectives on NCCL's; the driver runs the chunks of any device alike, so
// that is bucket_reductions' choice alone).
// Per-bucket buffers (a Reduction) are allocated at a bucket's first call and reused while its
// tensor sizes stay the same.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/custom_class.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "nonfinite_guard.hpp"
#include "reduction.hpp"
#include "timeline.hpp"

namespace gradzip::torch_ext {

class CompressedAllreduce : public torch::CustomClassHolder {
 public:
  // guard: saves the residuals and Q factors a reduction is about to update (on the thread or
  // stream that updates them, just before) and records every reduced bucket's finiteness (see
  // NonfiniteGuard), or null. cast_sum: how
  // reduce() sums fp16/bf16 buckets (bucket_reduction.hpp): one all-reduce in the wire dtype, or
  // the two-phase fp32 sum. gather_group: the same ranks as `group` in a group of their own, for
  // the two-phase all-gathers of CPU buckets (so that they overlap the next bucket's all-to-all),
  // or null. chunk: the elements of a CPU bucket's chunk (above).
  CompressedAllreduce(c10::intrusive_ptr<c10d::ProcessGroup> group, const std::string& codec,
                      c10::intrusive_ptr<NonfiniteGuard> guard = {},
                      CastSum cast_sum = CastSum::wire,
                      c10::intrusive_ptr<c10d::ProcessGroup> gather_group = {},
                      int64_t chunk = kChunk);
  ~CompressedAllreduce() override;

  // Averages `bucket` (a float tensor of any float dtype) over the group. `x`: the float32 values
  // to reduce (the bucket itself, or its float32 copy / optimizer direction; with compress = false
  // any float dtype, e.g. the bf16 bucket itself), overwritten with the average, which is then
  // copied into `bucket` if they differ. `numels`: the sizes of the tensors the bucket holds, in
  // order. `residual` (numel of x): error feedback, or undefined. compress = false: an fp32
  // all-reduce of x / W (warm-up steps, small buckets). What the codec's reduction reads besides:
  // `owner_residual` (this rank's shard of a two-phase bucket, or undefined) and `exact` (per
  // tensor, whether it travels uncompressed, fp32, see bucket_reduction.hpp; empty for none);
  // lowrank's: `rows` (each tensor's first dimension, its numel for a 1-D tensor) and `q` (the
  // bucket's Q factors, the warm start, identical on every rank; left holding the new ones).
  c10::intrusive_ptr<c10::ivalue::Future> reduce(int64_t index, const at::Tensor& bucket,
                                                 const at::Tensor& x,
                                                 const std::vector<int64_t>& numels,
                                                 const at::Tensor& residual,
                                                 const at::Tensor& owner_residual, bool compress,
                                                 const std::vector<bool>& exact = {},
                                                 const std::vector<int64_t>& rows = {},
                                                 const at::Tensor& q = {});

  // FSDP's gradient reduce-scatter: `x` (float32, world * output.numel(), shard j for rank j at
  // [j * S, (j + 1) * S)) is encoded as x * prescale with error feedback into `residual` (numel of x,
  // or undefined); `output` (S elements, any float dtype) receives this rank's shard of the sum,
  // decoded in rank order in fp32. `numels`: the sizes of the tensor pieces x holds, in order
  // (block-scaled codecs restart their blocks at each), `exact` which of them travel in fp32 (as in
  // reduce()). Same threads, Future and errors as reduce().
  c10::intrusive_ptr<c10::ivalue::Future> reduce_scatter(int64_t index, const at::Tensor& output,
                                                         const at::Tensor& x,
                                                         const std::vector<int64_t>& numels,
                                                         const at::Tensor& residual,
                                                         double prescale,
                                                         const std::vector<bool>& exact = {});

  // Raises the first decode error found since the last call (CUDA: among the decodes the stream
  // has completed; later ones are checked at a later call). CPU errors reach the Future instead.
  void check_errors();

  // The timeline of the reductions started from now on (on: a new, empty one; off: none), and its
  // events so far, taken (a ValueError when off). For benchmarks: see timeline.hpp.
  void set_timeline(bool on);
  std::vector<Timeline::Event> take_timeline();

  // Bytes (sent, received) this rank moves in the last reduction of bucket `index` started by
  // reduce or reduce_scatter (known once that call returns): those of the reduction it runs
  // (Reduction::traffic), or of an fp32 ring all-reduce for an uncompressed bucket
  // (fp32_traffic). A ValueError for an index never reduced.
  std::pair<int64_t, int64_t> traffic(int64_t index) const;

  // A bucket's reduction, or the consecutive chunks it is sent in (see bucket_reductions).
  using Parts = std::vector<std::shared_ptr<Reduction>>;
  // Elements per chunk of a CPU bucket, by default: small enough that the encode of the next chunk
  // and the decode of the previous one hide behind a chunk's collectives, large enough that a
  // chunk's collective costs little more than its bytes (measured: bench/torch/bench_phases.py).
  static constexpr int64_t kChunk = int64_t{1} << 21;
  static constexpr int64_t kMinChunk = 1024;  // the smallest `chunk` accepted

  int64_t world() const { return group_->getSize(); }
  int64_t rank() const { return group_->getRank(); }

 private:
  // The rest of a reduction once its first collective is started (waits, decodes), or empty.
  using Finish = std::function<void()>;
  // A job queue served in order by a detached thread of its own (started by the first job), shared
  // with that thread: a finished job may still be releasing a Python callback of its Future (which
  // takes the GIL) while the object is destroyed from Python (which holds it), so the threads are
  // never joined. A stopped queue finishes its queued jobs, then stops `next`, the pipeline's
  // following stage, which therefore receives every job posted to it before it stops.
  struct Queue {
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<std::function<void()>> jobs;
    bool started = false, stopping = false;
    std::shared_ptr<Queue> next;
  };
  static void post(const std::shared_ptr<Queue>& queue, std::function<void()> job);
  static void stop(const std::shared_ptr<Queue>& queue);
  static void serve(const std::shared_ptr<Queue>& queue);

  struct Cached {
    std::vector<int64_t> numels, rows;
    std::vector<bool> exact;
    Collective collective = Collective::allreduce;
    c10::Device device = c10::kCPU;
    ReductionParts reduction;
  };
  // A bucket's reductions, built at its first call and reused while its layout stays: one, or the
  // chunks of a CPU bucket (BucketLayout::chunks).
  const ReductionParts& bucket_reductions(int64_t index, const std::vector<int64_t>& numels,
                                          const std::vector<int64_t>& rows,
                                          const std::vector<bool>& exact, const at::Tensor& x,
                                          Collective collective);
  // Runs `body` (a reduction that starts its collectives and returns what remains to leave its
  // value in `result`; neither captures `this`) on the issuing thread and its Finish on the
  // finishing thread, or both at once on the CUDA stream (then watches the decodes of `watched`,
  // the bucket's parts); returns the Future of `result`.
  c10::intrusive_ptr<c10::ivalue::Future> launch(int64_t index, const at::Tensor& result,
                                                 const Parts& watched, std::function<Finish()> body);
  // CUDA: NaN-fills `result` on the device if a decode of `r`'s last step failed, and queues the
  // host-side check of its status words for check_errors().
  void watch_decodes(const Reduction& r, const at::Tensor& result, int64_t index);

  c10::intrusive_ptr<c10d::ProcessGroup> group_, gather_group_;
  ReductionSpec spec_;
  c10::intrusive_ptr<NonfiniteGuard> guard_;
  CastSum cast_sum_;
  int64_t chunk_;
  std::shared_ptr<Timeline> timeline_;  // touched by the caller's thread; null when off
  std::unordered_map<int64_t, Cached> buckets_;  // touched by the caller's thread only
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> traffic_;  // likewise, per bucket index
  // CUDA: one per reduced bucket, true once its decode status words were read (throws if bad).
  std::vector<std::function<bool()>> pending_checks_;
  std::mutex checks_mutex_;

  // The CPU pipeline: the issuing thread's queue, whose `next` is the finishing thread's.
  std::shared_ptr<Queue> issue_ = std::make_shared<Queue>();
};

}  // namespace gradzip::torch_ext
