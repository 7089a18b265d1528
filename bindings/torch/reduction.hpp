// One rank's part of the reduction of one flat float32 bucket, whatever the codec: a codec's
// encode, exchange and decode (BucketReduction, bucket_reduction.hpp) or lowrank:R's two
// all-reduces of factors (LowRankReduction, lowrank_reduction.hpp). Either is a list of steps
// (phases a rank computes alone, collectives between them) over buffers of its own, reporting the
// bytes those collectives move; its drivers, a process group (compressed_allreduce.hpp) and W ranks
// simulated in one process (in_memory_exchange.hpp), interpret that list without asking which
// reduction it is. Which one a bucket gets is decided once, where it is made (ReductionSpec::make).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gradzip/gradzip.hpp"

namespace gradzip::torch_ext {

// What the collective leaves on each rank: the average of the whole bucket, or its shard of the sum.
enum class Collective { allreduce, reduce_scatter };

// Where the casts' (fp32, fp16, bf16) all-reduce sums: in the wire dtype, by the backend's one
// all-reduce, or in fp32 in rank order by the two-phase exchange; top-k's: every rank sums the W
// all-gathered messages (wire), or the two-phase exchange with the owner's top-k of the sum (fp32).
// int8 and sign always take the two-phase exchange; the reduce-scatter always sums in fp32.
enum class CastSum { wire, fp32 };
// "wire" or "fp32"; anything else is a ValueError.
CastSum parse_cast_sum(const std::string& name);

// The steps of one rank's reduction: the phases it computes alone and the collectives between
// them, which exchange the reduction's buffers:
//   codecs (bucket_reduction.hpp)  encode, reduce_owner, decode, sum_shard; allreduce_payload
//                                  (payload summed in place: SUM, the wire dtype), alltoall (send
//                                  -> recv, send_splits / recv_splits bytes per rank), allgather
//                                  (gather_in -> gathered, the W slots in rank order);
//   lowrank (lowrank_reduction.hpp)  compute_p, compute_q, approximate; allreduce_p, allreduce_q
//                                  (the P and Q factors summed in place: SUM, fp32).
enum class Step {
  encode, allreduce_payload, alltoall, reduce_owner, allgather, decode, sum_shard,
  compute_p, allreduce_p, compute_q, allreduce_q, approximate
};
bool is_collective(Step step);
// The name of a step, as the timeline and error messages show it.
const char* step_name(Step step);
// The all-reduces (SUM, in place, of Reduction::summed); the other collectives are the all-to-all
// and the all-gather.
bool is_allreduce(Step step);

// What one rank's phases read and write: `x` (n floats: the bucket, or W shards for the
// reduce-scatter), `residual` (n floats, or undefined: no error feedback), `owner_residual` (this
// rank's shard of a two-phase bucket, or undefined), `out` (the average's n floats, may be x; the
// reduce-scatter's shard), `q` (lowrank's Q factors, the warm start, identical on every rank; left
// holding the new ones), and encode's prescale (unset: 1 / W, the average).
struct Operands {
  at::Tensor x, residual, owner_residual, out, q;
  std::optional<float> prescale;
};

class Reduction {
 public:
  Reduction(int64_t world, int64_t rank);
  virtual ~Reduction() = default;
  Reduction(const Reduction&) = delete;
  Reduction& operator=(const Reduction&) = delete;

  int64_t world() const { return world_; }
  int64_t rank() const { return rank_; }
  // The spec of the codec it reduces with, for messages.
  virtual std::string name() const = 0;
  // The order of the reduction, from the Step list.
  virtual const std::vector<Step>& steps() const = 0;
  // Runs one phase (a step that is no collective) on `operands`.
  virtual void compute(Step step, const Operands& operands) = 0;
  // The buffer an all-reduce step sums in place: the reduction's own or one of `operands`.
  virtual at::Tensor summed(Step step, const Operands& operands) const = 0;
  // Bytes (sent, received) of this rank for the bucket: those of its collectives, an all-reduce
  // counted as a ring all-reduce (ring_allreduce_traffic), an all-to-all and an all-gather by their
  // splits and slots.
  virtual std::pair<int64_t, int64_t> traffic() const = 0;
  // Whether `other` is a peer's reduction of the same bucket: the same codec and layout.
  virtual bool same_layout(const Reduction& other) const = 0;

  // The all-to-all's and the all-gather's buffers (uint8), empty for a reduction without them.
  at::Tensor send, recv, gather_in, gathered;
  std::vector<int64_t> send_splits, recv_splits;
  // CUDA: one 16-byte status word per decoded message of the last step (gradzip::cuda::decode_batch's
  // status words); undefined on the CPU, where a corrupt message throws at once, and where nothing
  // is decoded.
  at::Tensor decode_status;

 private:
  int64_t world_, rank_;
};

// A bucket's reduction: its one piece, or the consecutive chunks it is sent in (BucketLayout::chunks),
// and the bytes of the whole: its chunks count as the reduction they are cut from, so that the
// bytes do not depend on the device or the chunk size. Not counted: what the cuts add (a header and
// its alignment per cut piece; each chunk's all-gather slot sized for its largest shard, whose cuts
// may sit up to a block further on than the others': at the default chunk a few kB per 26 MB int8
// bucket).
struct ReductionParts {
  std::vector<std::shared_ptr<Reduction>> parts;
  std::pair<int64_t, int64_t> traffic;
};

// A codec spec, parsed once: which reduction its buckets get.
class ReductionSpec {
 public:
  explicit ReductionSpec(const std::string& spec);

  const std::string& name() const { return name_; }
  // R of "lowrank:R", or nullopt.
  const std::optional<int64_t>& lowrank() const { return lowrank_; }
  // The codec of any other spec (a ValueError for lowrank, which has none).
  const Codec& codec() const;

  // Rank `rank`'s reduction of a bucket of tensors of `numels` elements: `rows` (each tensor's
  // first dimension, its numel for a 1-D tensor) lays out lowrank's matrices, `exact`
  // (bucket_reduction.hpp) the codecs' fp32 tensors; each ignores the other's. `chunk` > 0 cuts a
  // codec's bucket into chunks of about that many elements (BucketLayout::chunks); lowrank's is
  // one piece, and has no reduce-scatter (its factors need every row of a tensor).
  ReductionParts make(int64_t world, int64_t rank, const std::vector<int64_t>& numels,
                      const std::vector<int64_t>& rows, const std::vector<bool>& exact,
                      const at::TensorOptions& options, Collective collective = Collective::allreduce,
                      CastSum cast_sum = CastSum::wire, int64_t chunk = 0) const;

 private:
  std::string name_;
  std::optional<int64_t> lowrank_;
  std::optional<Codec> codec_;
};

}  // namespace gradzip::torch_ext
