// One rank's part of the low-rank (PowerSGD) average of one flat float32 bucket, "lowrank:R", cut
// into the phases between its two all-reduces, so that a process group (compressed_allreduce.hpp)
// and W ranks simulated in one process (in_memory_exchange.hpp, behind
// gradzip.simulation.SimulatedWorkers) run the same arithmetic.
//
// Each tensor of the bucket is a matrix M (rows = its first dimension, cols = the rest), with
// M = x / W + residual (error feedback in the units of the average), formed in `out` (x itself, or
// a copy of x where out is another tensor). Per step:
//   compute_p    Q (cols x r, kept between steps: the warm start) is orthonormalised, P = M Q into
//                p; tensors where low rank saves nothing go into p's tail as M itself;
//   allreduce_p  SUM of p (the tail sums to the uncompressed average);
//   compute_q    P's columns are orthonormalised, Q = M^T P, written over the caller's q;
//   allreduce_q  SUM of q;
//   approximate  out = P Q^T (the average's rank-r approximation), residual = M - P Q^T / W (the
//                residuals of the W ranks sum to sum(M) - P Q^T, what the approximation left out);
//                the uncompressed tensors take the tail of p.
// One bucket is exactly two all-reduces, whatever its tensors. P and Q of each tensor are views of
// the flat buffers written by at::mm_out: tensors of one shape are never stacked into a copy.
// That order is written once, as data (LowRankReduction::steps), which each driver interprets as it
// interprets a codec's (a Reduction, reduction.hpp): a process group (compressed_allreduce.hpp) and
// W ranks in one process (in_memory_exchange.hpp); it gives the bytes the reduction reports
// (LowRankReduction::traffic).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reduction.hpp"

namespace gradzip::torch_ext {

// R of a "lowrank:R" spec; nullopt for any other codec's spec. A malformed lowrank spec is a
// ValueError naming the bad part.
std::optional<int64_t> parse_lowrank(const std::string& spec);

// The rank a rows x cols matrix is approximated with at rank R (min(rows, cols, R)), or 0 where
// the two factors would hold half of its elements or more: such tensors are sent uncompressed.
int64_t lowrank_rank(int64_t rows, int64_t cols, int64_t rank);

// Elements of the two all-reduced buffers of a bucket: {p (P factors, then the uncompressed
// tensors), q (Q factors)}. `rows`: each tensor's first dimension (its numel for a 1-D tensor).
std::pair<int64_t, int64_t> lowrank_sizes(int64_t rank, const std::vector<int64_t>& numels,
                                          const std::vector<int64_t>& rows);

class LowRankReduction : public Reduction {
 public:
  // `lowrank`: R. `rank`: this rank's, of `world`.
  LowRankReduction(int64_t lowrank, int64_t world, int64_t rank, const std::vector<int64_t>& numels,
                   const std::vector<int64_t>& rows, const at::TensorOptions& options);

  std::string name() const override { return "lowrank:" + std::to_string(lowrank_); }
  const std::vector<Step>& steps() const override;
  void compute(Step step, const Operands& operands) override;
  // p, or the caller's q.
  at::Tensor summed(Step step, const Operands& operands) const override;
  // Each all-reduce counted as a float32 ring all-reduce (fp32_traffic).
  std::pair<int64_t, int64_t> traffic() const override;
  bool same_layout(const Reduction& other) const override;

  at::Tensor p;  // the first all-reduced buffer; q, the second, is the caller's state

 private:
  // m: the bucket's float32 values (left holding M after compute_p, the average after
  // approximate); residual: numel of m, or undefined (no error feedback); q: this bucket's Q
  // factors (lowrank_sizes().second elements), identical on every rank.
  void compute_p(const at::Tensor& m, const at::Tensor& residual, const at::Tensor& q);
  void compute_q(const at::Tensor& m, const at::Tensor& q);
  void approximate(const at::Tensor& m, const at::Tensor& residual, const at::Tensor& q);

  struct Piece {
    int64_t offset, rows, cols, rank;  // rank 0: sent uncompressed in p's tail at p_offset
    int64_t p_offset, q_offset;

    bool operator==(const Piece&) const = default;
  };
  at::Tensor matrix(const at::Tensor& x, const Piece& piece) const;
  at::Tensor p_factor(const Piece& piece) const;
  static at::Tensor q_factor(const at::Tensor& q, const Piece& piece);
  void check(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& q) const;

  int64_t lowrank_, n_ = 0, q_numel_ = 0;
  std::vector<Piece> pieces_;
};

}  // namespace gradzip::torch_ext
