#include "lowrank_reduction.hpp"

#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_qr.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <limits>

#include "bucket_reduction.hpp"

namespace gradzip::torch_ext {
namespace {

// As PyTorch's PowerSGD: Gram-Schmidt for one or two columns (cheaper), Householder QR above
// (more stable as columns multiply).
constexpr int64_t kGramSchmidtMaxRank = 2;

// Orthonormalises the columns of `m` (rows x r) in place. A zero column stays zero (its norm is
// clamped) rather than turning the bucket into NaN: a frozen or unused parameter has such a
// gradient.
void orthonormalise(const at::Tensor& m) {
  const int64_t r = m.size(1);
  if (r > kGramSchmidtMaxRank) {
    m.copy_(std::get<0>(at::linalg_qr(m)));
    return;
  }
  for (int64_t i = 0; i < r; ++i) {
    const at::Tensor col = m.narrow(1, i, 1);
    col.div_(at::linalg_vector_norm(col).clamp_min(std::numeric_limits<float>::min()));
    if (i + 1 < r) {
      const at::Tensor rest = m.narrow(1, i + 1, r - i - 1);
      rest.sub_(at::mm(col, at::mm(col.t(), rest)));
    }
  }
}

}  // namespace

std::optional<int64_t> parse_lowrank(const std::string& spec) {
  const std::string name = "lowrank";
  if (spec.compare(0, name.size(), name) != 0) return std::nullopt;
  const std::string rest = spec.substr(name.size());
  TORCH_CHECK_VALUE(!rest.empty() && rest[0] == ':', "gradzip: codec spec '", spec,
                    "': lowrank needs its rank, e.g. lowrank:4");
  const std::string r = rest.substr(1);
  const bool digits =
      !r.empty() && r.size() <= 9 && std::all_of(r.begin(), r.end(), [](unsigned char c) {
        return std::isdigit(c) != 0;
      });
  TORCH_CHECK_VALUE(digits && std::stoll(r) >= 1, "gradzip: codec spec '", spec, "': rank '", r,
                    "' is not an integer >= 1");
  return std::stoll(r);
}

int64_t lowrank_rank(int64_t rows, int64_t cols, int64_t rank) {
  const int64_t r = std::min({rows, cols, rank});
  // As PyTorch's min_compression_rate = 2: compress where the factors hold under half the elements.
  return 2 * r * (rows + cols) < rows * cols ? r : 0;
}

std::pair<int64_t, int64_t> lowrank_sizes(int64_t rank, const std::vector<int64_t>& numels,
                                          const std::vector<int64_t>& rows) {
  TORCH_CHECK_VALUE(rank >= 1 && numels.size() == rows.size(),
                    "gradzip: lowrank needs rank >= 1 and one row count per tensor");
  int64_t p = 0, q = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    TORCH_CHECK_VALUE(rows[i] >= 1 && numels[i] >= 0 && numels[i] % rows[i] == 0,
                      "gradzip: lowrank: tensor ", i, " of ", numels[i],
                      " elements has no matrix of ", rows[i], " rows");
    const int64_t cols = numels[i] / rows[i];
    const int64_t r = lowrank_rank(rows[i], cols, rank);
    p += r ? rows[i] * r : numels[i];
    q += cols * r;
  }
  return {p, q};
}

LowRankReduction::LowRankReduction(int64_t lowrank, int64_t world, int64_t rank,
                                   const std::vector<int64_t>& numels,
                                   const std::vector<int64_t>& rows,
                                   const at::TensorOptions& options)
    : Reduction(world, rank), lowrank_(lowrank) {
  const auto [p_numel, q_numel] = lowrank_sizes(lowrank, numels, rows);
  q_numel_ = q_numel;
  int64_t p_factors = 0;
  for (size_t i = 0; i < numels.size(); ++i)
    p_factors += rows[i] * lowrank_rank(rows[i], numels[i] / rows[i], lowrank);
  int64_t p_off = 0, tail_off = p_factors, q_off = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t cols = numels[i] / rows[i];
    const int64_t r = lowrank_rank(rows[i], cols, lowrank);
    int64_t& at_p = r ? p_off : tail_off;
    pieces_.push_back({n_, rows[i], cols, r, at_p, q_off});
    at_p += r ? rows[i] * r : numels[i];
    q_off += cols * r;
    n_ += numels[i];
  }
  p = at::empty({p_numel}, options.dtype(at::kFloat));
}

const std::vector<Step>& LowRankReduction::steps() const {
  using enum Step;
  static const std::vector<Step> order{compute_p, allreduce_p, compute_q, allreduce_q, approximate};
  return order;
}

void LowRankReduction::compute(Step step, const Operands& operands) {
  const auto& [x, residual, owner_residual, out, q, prescale] = operands;
  switch (step) {
    case Step::compute_p:
      if (!out.is_same(x)) {
        check(x, residual, q);
        out.copy_(x);
      }
      compute_p(out, residual, q);
      return;
    case Step::compute_q:
      compute_q(out, q);
      return;
    case Step::approximate:
      approximate(out, residual, q);
      return;
    default:
      break;
  }
  TORCH_CHECK(false, "gradzip: ", step_name(step), " is no phase of a ", name(), " reduction");
}

bool LowRankReduction::same_layout(const Reduction& other) const {
  const auto* peer = dynamic_cast<const LowRankReduction*>(&other);
  return peer != nullptr && peer->world() == world() && peer->n_ == n_ &&
         peer->q_numel_ == q_numel_ && peer->pieces_ == pieces_;
}

std::pair<int64_t, int64_t> LowRankReduction::traffic() const {
  int64_t bytes = 0;
  for (const Step step : steps())
    if (is_allreduce(step))
      bytes += fp32_traffic(step == Step::allreduce_p ? p.numel() : q_numel_, world());
  return {bytes, bytes};
}

at::Tensor LowRankReduction::summed(Step step, const Operands& operands) const {
  TORCH_CHECK(step == Step::allreduce_p || step == Step::allreduce_q, "gradzip: ",
              step_name(step), " sums no buffer of a ", name(), " reduction");
  return step == Step::allreduce_p ? p : operands.q;
}

at::Tensor LowRankReduction::matrix(const at::Tensor& x, const Piece& piece) const {
  return x.narrow(0, piece.offset, piece.rows * piece.cols).view({piece.rows, piece.cols});
}

at::Tensor LowRankReduction::p_factor(const Piece& piece) const {
  return p.narrow(0, piece.p_offset, piece.rows * piece.rank).view({piece.rows, piece.rank});
}

at::Tensor LowRankReduction::q_factor(const at::Tensor& q, const Piece& piece) {
  return q.narrow(0, piece.q_offset, piece.cols * piece.rank).view({piece.cols, piece.rank});
}

void LowRankReduction::check(const at::Tensor& x, const at::Tensor& residual,
                             const at::Tensor& q) const {
  const auto fits = [&](const at::Tensor& t, int64_t n) {
    return t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n &&
           t.device() == p.device();
  };
  TORCH_CHECK_VALUE(fits(x, n_) && (!residual.defined() || fits(residual, n_)) && q.defined() &&
                        fits(q, q_numel_),
                    "gradzip: lowrank: the bucket (", n_, " elements), its residual and its Q (",
                    q_numel_, " elements) must be contiguous float32 tensors on ", p.device());
}

void LowRankReduction::compute_p(const at::Tensor& x, const at::Tensor& residual,
                                 const at::Tensor& q) {
  check(x, residual, q);
  x.div_(static_cast<double>(world()));  // as the other codecs: sum of x / W, no overflow
  if (residual.defined()) x.add_(residual);
  for (const Piece& piece : pieces_) {
    if (piece.rank == 0) {
      const int64_t m = piece.rows * piece.cols;
      p.narrow(0, piece.p_offset, m).copy_(x.narrow(0, piece.offset, m));
      continue;
    }
    // Orthonormal Q (as PyTorch's hook): the span of M Q is the same, but its columns, which
    // Q = M^T P scaled by the singular values last step, no longer differ by orders of magnitude.
    const at::Tensor qf = q_factor(q, piece);
    orthonormalise(qf);
    at::Tensor pf = p_factor(piece);
    at::mm_out(pf, matrix(x, piece), qf);
  }
}

void LowRankReduction::compute_q(const at::Tensor& x, const at::Tensor& q) {
  check(x, at::Tensor(), q);
  for (const Piece& piece : pieces_) {
    if (piece.rank == 0) continue;
    const at::Tensor pf = p_factor(piece);
    orthonormalise(pf);
    at::Tensor qf = q_factor(q, piece);
    at::mm_out(qf, matrix(x, piece).t(), pf);
  }
}

void LowRankReduction::approximate(const at::Tensor& x, const at::Tensor& residual,
                                   const at::Tensor& q) {
  check(x, residual, q);
  for (const Piece& piece : pieces_) {
    at::Tensor m = matrix(x, piece);
    if (piece.rank == 0) {
      m.view(-1).copy_(p.narrow(0, piece.p_offset, piece.rows * piece.cols));
      continue;
    }
    at::Tensor e = residual.defined() ? matrix(residual, piece) : at::Tensor();
    if (e.defined()) e.copy_(m);
    at::mm_out(m, p_factor(piece), q_factor(q, piece).t());
    // This rank's share of what the approximation left out: the W residuals sum to the sum's
    // M - P Q^T. Subtracting all of P Q^T on every rank would feed back (1 - W) times the
    // approximated part (it oscillates at W = 2 and grows without bound above).
    if (e.defined()) e.sub_(m, 1.0 / static_cast<double>(world()));
  }
}

}  // namespace gradzip::torch_ext
