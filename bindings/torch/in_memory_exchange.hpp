// The reduction of one bucket for W ranks simulated in one process (gradzip.simulation's
// SimulatedWorkers): the steps of its reduction (Reduction::steps, reduction.hpp: a codec's or
// lowrank's) run for every rank in lock-step, in rank order, and each collective done in memory on
// the ranks' buffers:
//   alltoall    rank i's bytes for rank j copied into rank j's recv, in rank order;
//   allgather   the W gather_in slots concatenated in rank order into every gathered;
//   all-reduce  the fp32 sum of the W summed buffers in rank order, rounded once to their dtype
//               (a cast's payload in the wire dtype, lowrank's factors in fp32).
// The all-to-all and the all-gather move the bytes a process group moves, so the result equals
// compressed_allreduce.hpp's bit for bit. The casts' one all-reduce is summed by a backend in the
// wire dtype in an order of its own (Gloo and NCCL differ, and so do the elements of one bucket):
// there the result equals it only to the wire dtype's rounding of a W-term sum; the residuals,
// which each rank forms from its own payload, are equal bit for bit. lowrank:R's two fp32
// all-reduces are summed the same way, in rank order: at W = 2 what every backend computes (a + b
// commutes), above it equal to fp32 rounding (the backend's summation order is its own).
#pragma once

#include <vector>

#include "reduction.hpp"

namespace gradzip::torch_ext {

// ranks[r]: rank r's reduction of a world of W = ranks.size(), every one of the same codec and
// layout; operands[r]: its tensors (prescale unset: the average's 1 / W; out receives the average).
void reduce_in_memory(const std::vector<Reduction*>& ranks, const std::vector<Operands>& operands);

}  // namespace gradzip::torch_ext
