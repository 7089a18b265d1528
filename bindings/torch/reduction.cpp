#include "reduction.hpp"

#include <c10/util/Exception.h>

#include "bucket_reduction.hpp"
#include "device_codec.hpp"
#include "lowrank_reduction.hpp"

namespace gradzip::torch_ext {

bool is_allreduce(Step step) {
  return step == Step::allreduce_payload || step == Step::allreduce_p ||
         step == Step::allreduce_q;
}

bool is_collective(Step step) {
  return is_allreduce(step) || step == Step::alltoall || step == Step::allgather;
}

const char* step_name(Step step) {
  switch (step) {
    case Step::encode: return "encode";
    case Step::allreduce_payload: return "all-reduce";
    case Step::alltoall: return "all-to-all";
    case Step::reduce_owner: return "owner sum + re-encode";
    case Step::allgather: return "all-gather";
    case Step::decode: return "decode";
    case Step::sum_shard: return "sum shard";
    case Step::compute_p: return "P = M Q";
    case Step::allreduce_p: return "all-reduce P";
    case Step::compute_q: return "Q = M^T P";
    case Step::allreduce_q: return "all-reduce Q";
    case Step::approximate: return "P Q^T";
  }
  return "?";
}

Reduction::Reduction(int64_t world, int64_t rank) : world_(world), rank_(rank) {
  TORCH_CHECK_VALUE(world >= 1, "gradzip: world size must be >= 1, got ", world);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, "gradzip: rank ", rank, " outside [0, ", world,
                    ")");
}

ReductionSpec::ReductionSpec(const std::string& spec)
    : lowrank_(parse_lowrank(spec)),
      codec_(lowrank_ ? std::nullopt : std::optional<Codec>(guarded("compressed_allreduce", [&] {
        return Codec::parse(spec);
      }))) {
  name_ = codec_ ? codec_->name() : "lowrank:" + std::to_string(*lowrank_);
}

const Codec& ReductionSpec::codec() const {
  TORCH_CHECK_VALUE(codec_, "gradzip: ", name_, " reduces low-rank factors, it has no codec");
  return *codec_;
}

ReductionParts ReductionSpec::make(int64_t world, int64_t rank, const std::vector<int64_t>& numels,
                                   const std::vector<int64_t>& rows, const std::vector<bool>& exact,
                                   const at::TensorOptions& options, Collective collective,
                                   CastSum cast_sum, int64_t chunk) const {
  ReductionParts out;
  if (lowrank_) {
    TORCH_CHECK_VALUE(collective == Collective::allreduce, "gradzip: ", name_,
                      " has no reduce-scatter: its factors need every row of a tensor");
    auto r = std::make_shared<LowRankReduction>(*lowrank_, world, rank, numels, rows, options);
    out.traffic = r->traffic();
    out.parts.push_back(std::move(r));
    return out;
  }
  const BucketLayout whole(*codec_, world, numels, collective, cast_sum, exact);
  out.traffic = whole.traffic(rank);
  for (const BucketLayout& layout :
       chunk > 0 ? whole.chunks(*codec_, chunk) : std::vector<BucketLayout>{whole})
    out.parts.push_back(std::make_shared<BucketReduction>(*codec_, layout, rank, options));
  return out;
}

}  // namespace gradzip::torch_ext
