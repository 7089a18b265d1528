#include "bucket_reduction.hpp"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <numeric>
#include <tuple>

#include "device_codec.hpp"
#include "float_residual.hpp"

namespace gradzip::torch_ext {
namespace {

// The torch dtype of a summable codec's payload (its traits' wire_dtype).
at::ScalarType payload_dtype(const Codec& codec) {
  const DType d = visit(codec.kind(), [](auto c) {
    if constexpr (decltype(c)::summable) return decltype(c)::wire_dtype;
    else return DType::f32;  // never asked: no one sums this payload
  });
  return d == DType::f16 ? at::kHalf : d == DType::bf16 ? at::kBFloat16 : at::kFloat;
}

// Bytes of a message's payload (the header stays home).
int64_t payload_bytes(const Codec& codec, int64_t n) {
  return static_cast<int64_t>(codec.encoded_bytes(static_cast<size_t>(n)) - kHeaderBytes);
}

// The codec of the exact pieces: fp32 decodes to the very floats it was given.
const Codec& fp32_codec() {
  static const Codec codec = Codec::parse("fp32");
  return codec;
}

// The codec of a piece of a bucket encoded with `codec`.
const Codec& piece_codec(const Codec& codec, bool exact) { return exact ? fp32_codec() : codec; }

// The pieces of shard [lo, hi) of a bucket whose tensor i ends at ends[i] and is exact[i]: one
// compressed piece per tensor (no block scale spans two tensors), consecutive exact tensors in one
// fp32 piece. With `short_exact`, a tensor's part shorter than kMinPiece travels exact too.
std::vector<Piece> shard_pieces(int64_t lo, int64_t hi, const std::vector<int64_t>& ends,
                                const std::vector<bool>& exact, bool short_exact) {
  std::vector<Piece> out;
  int64_t start = lo;
  for (size_t i = 0; i < ends.size() && start < hi; ++i) {
    const int64_t end = std::min(ends[i], hi);
    if (end <= start) continue;  // a tensor before the shard
    const int64_t len = end - start;
    const bool is_exact = exact[i] || (short_exact && len < kMinPiece);
    if (is_exact && !out.empty() && out.back().exact) {
      out.back().len += len;
    } else {
      out.push_back({len, is_exact});
    }
    start = end;
  }
  return out;
}

int64_t slot_bytes(const Codec& codec, int64_t n) {
  return static_cast<int64_t>(message_slot_bytes(codec.encoded_bytes(static_cast<size_t>(n))));
}

int64_t slot_bytes(const Codec& codec, const Piece& p) {
  return slot_bytes(piece_codec(codec, p.exact), p.len);
}

// The offsets at which a shard of `size` elements whose messages are `pieces` is cut into `parts`
// chunks (0 and size included): for each k, the first offset at or after k * size / parts where
// the shard may be cut without moving a block (a piece's start, anywhere inside an exact piece, a
// multiple of `block` from a compressed piece's start; block 1: anywhere). Empty if two cuts
// meet (a chunk would be empty). One walk over the pieces.
std::vector<int64_t> shard_cuts(const std::vector<Piece>& pieces, int64_t size, int64_t parts,
                                int64_t block) {
  std::vector<int64_t> cuts{0};
  size_t i = 0;
  int64_t start = 0;  // of pieces[i]
  for (int64_t k = 1; k < parts; ++k) {
    const int64_t t = k * size / parts;
    while (i < pieces.size() && t >= start + pieces[i].len) start += pieces[i++].len;
    int64_t at = start;
    if (t > start) {
      const Piece& p = pieces[i];
      at = p.exact ? t : std::min(start + (t - start + block - 1) / block * block, start + p.len);
    }
    if (at <= cuts.back() || at >= size) return {};
    cuts.push_back(at);
  }
  cuts.push_back(size);
  return cuts;
}

// The pieces of [a, b) of a shard whose messages are `pieces`, each keeping its codec.
std::vector<Piece> pieces_within(const std::vector<Piece>& pieces, int64_t a, int64_t b) {
  std::vector<Piece> out;
  int64_t start = 0;
  for (const Piece& p : pieces) {
    const int64_t lo = std::max(a, start), hi = std::min(b, start + p.len);
    if (lo < hi) out.push_back({hi - lo, p.exact});
    start += p.len;
  }
  return out;
}

}  // namespace

CastSum parse_cast_sum(const std::string& name) {
  if (name == "wire") return CastSum::wire;
  TORCH_CHECK_VALUE(name == "fp32", "gradzip: cast_sum must be 'wire' or 'fp32', got '", name, "'");
  return CastSum::fp32;
}

BucketLayout::BucketLayout(const Codec& codec, int64_t world_, const std::vector<int64_t>& numels,
                           Collective collective_, CastSum cast_sum,
                           const std::vector<bool>& exact)
    : world(world_), collective(collective_) {
  TORCH_CHECK_VALUE(world >= 1, "gradzip: world size must be >= 1, got ", world);
  TORCH_CHECK_VALUE(!numels.empty(), "gradzip: a bucket holds at least one tensor");
  TORCH_CHECK_VALUE(exact.empty() || exact.size() == numels.size(), "gradzip: ", exact.size(),
                    " exact flags for a bucket of ", numels.size(), " tensors");
  std::vector<int64_t> ends;
  for (const int64_t m : numels) {
    TORCH_CHECK_VALUE(m >= 1, "gradzip: tensor sizes of a bucket must be >= 1, got ", m);
    n += m;
    ends.push_back(n);
  }
  const auto [summable, all_gathered, block_scaled, sparse] = visit(codec.kind(), [](auto c) {
    return std::tuple{c.summable, c.all_gathered, c.block_scaled, c.sparse};
  });
  selects = sparse;
  wire_sum = collective == Collective::allreduce && cast_sum == CastSum::wire && summable;
  two_phase = !wire_sum && (collective == Collective::reduce_scatter || !all_gathered ||
                            cast_sum == CastSum::fp32);
  using enum Step;
  if (collective == Collective::reduce_scatter)
    steps = {encode, alltoall, sum_shard};
  else if (wire_sum)
    steps = {encode, allreduce_payload, decode};
  else if (two_phase)
    steps = {encode, alltoall, reduce_owner, allgather, decode};
  else
    steps = {encode, allgather, decode};
  count = n;
  if (!two_phase) {
    offsets = {0};
    size_messages(codec);
    return;
  }
  TORCH_CHECK_VALUE(n >= world, "gradzip: a bucket of ", n, " elements cannot be sharded over ",
                    world, " ranks");
  std::vector<bool> flags = exact;
  if (flags.empty()) flags.assign(numels.size(), false);
  if (!block_scaled) {  // one message per shard
    ends = {n};
    flags = {false};
  }
  starts = shard_starts(n, world);
  offsets.assign(static_cast<size_t>(world), 0);
  for (int64_t j = 0; j < world; ++j)
    pieces.push_back(shard_pieces(starts[j], starts[j + 1], ends, flags, block_scaled));
  size_messages(codec);
}

void BucketLayout::size_messages(const Codec& codec) {
  if (!two_phase) {
    slot = slot_bytes(codec, count);
    if (wire_sum) summed_bytes = payload_bytes(codec, count);
    return;
  }
  shard_bytes.clear();
  for (const std::vector<Piece>& shard : pieces) {
    int64_t bytes = 0;
    for (const Piece& p : shard) bytes += slot_bytes(codec, p);
    shard_bytes.push_back(bytes);
  }
  if (collective == Collective::allreduce)
    slot = *std::max_element(shard_bytes.begin(), shard_bytes.end());
}

int64_t BucketLayout::window(int64_t rank) const {
  int64_t len = 0;
  for (const Piece& p : pieces.at(static_cast<size_t>(rank))) len += p.len;
  return len;
}

std::vector<BucketLayout> BucketLayout::chunks(const Codec& codec, int64_t elements) const {
  TORCH_CHECK_VALUE(elements >= 1, "gradzip: chunks of ", elements, " elements");
  TORCH_CHECK(count == n, "gradzip: a chunk is not cut again");
  const int64_t wanted = n / elements + (n % elements != 0);
  // Top-k selects over a whole message (the bucket, or a two-phase shard): a cut would change what
  // it keeps.
  if (wanted <= 1 || collective == Collective::reduce_scatter || (!two_phase && !wire_sum) ||
      selects)
    return {*this};
  std::vector<BucketLayout> out;
  if (wire_sum) {
    for (int64_t lo = 0; lo < n; lo += elements) {
      BucketLayout& c = out.emplace_back(*this);
      c.offsets = {lo};
      c.count = std::min(elements, n - lo);
      c.size_messages(codec);
    }
    return out;
  }
  const int64_t block = visit(codec.kind(), [](auto c) { return c.block_scaled; })
                            ? static_cast<int64_t>(codec.spec().block)
                            : 1;
  // Chunk k of shard j is [cuts[j][k], cuts[j][k + 1]). Where a shard's cuts, moved to the next
  // place that keeps the blocks, would leave a chunk empty, fewer chunks: at most as many as the
  // places to start one (a block of a compressed piece, an element of an exact one), then half as
  // many at a time.
  int64_t most = wanted;
  for (int64_t j = 0; j < world; ++j) {
    int64_t places = 0;
    for (const Piece& p : pieces[j]) places += p.exact ? p.len : (p.len + block - 1) / block;
    most = std::min(most, places);
  }
  for (int64_t parts = most; parts > 1; parts /= 2) {
    std::vector<std::vector<int64_t>> cuts;
    for (int64_t j = 0; j < world; ++j) {
      cuts.push_back(shard_cuts(pieces[j], shard_size(j), parts, block));
      if (cuts.back().empty()) break;
    }
    if (cuts.back().empty()) continue;
    for (int64_t k = 0; k < parts; ++k) {
      BucketLayout& c = out.emplace_back(*this);
      c.count = 0;
      for (int64_t j = 0; j < world; ++j) {
        c.offsets[j] = cuts[j][k];
        c.pieces[j] = pieces_within(pieces[j], cuts[j][k], cuts[j][k + 1]);
        c.count += cuts[j][k + 1] - cuts[j][k];
      }
      c.size_messages(codec);
    }
    return out;
  }
  return {*this};
}

std::pair<int64_t, int64_t> BucketLayout::traffic(Step step, int64_t rank) const {
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, "gradzip: rank ", rank, " outside [0, ", world, ")");
  switch (step) {
    case Step::allreduce_payload: {
      const int64_t bytes = ring_allreduce_traffic(summed_bytes, world);
      return {bytes, bytes};
    }
    case Step::alltoall: {  // every shard but its own out, W encodings of its own in
      const int64_t all = std::accumulate(shard_bytes.begin(), shard_bytes.end(), int64_t{0});
      return {all - shard_bytes[rank], (world - 1) * shard_bytes[rank]};
    }
    case Step::allgather:
      return {(world - 1) * slot, (world - 1) * slot};
    default:
      break;
  }
  return {0, 0};  // a phase: computed at home
}

std::pair<int64_t, int64_t> BucketLayout::traffic(int64_t rank) const {
  std::pair<int64_t, int64_t> sum{0, 0};
  for (const Step step : steps) {
    const auto [sent, received] = traffic(step, rank);
    sum.first += sent;
    sum.second += received;
  }
  return sum;
}

std::vector<int64_t> shard_starts(int64_t n, int64_t world) {
  TORCH_CHECK_VALUE(world >= 1 && n >= 0, "gradzip: cannot shard ", n, " elements over ", world,
                    " ranks");
  const int64_t base = n / world, extra = n % world;
  std::vector<int64_t> starts{0};
  for (int64_t j = 0; j < world; ++j) starts.push_back(starts.back() + base + (j < extra ? 1 : 0));
  return starts;
}

int64_t ring_allreduce_traffic(int64_t bytes, int64_t world) {
  return 2 * (world - 1) * bytes / world;
}

int64_t fp32_traffic(int64_t n, int64_t world) { return ring_allreduce_traffic(4 * n, world); }

BucketReduction::BucketReduction(const Codec& codec, int64_t world, int64_t rank,
                                 const std::vector<int64_t>& numels,
                                 const at::TensorOptions& device, Collective collective,
                                 CastSum cast_sum, const std::vector<bool>& exact)
    : BucketReduction(codec, BucketLayout(codec, world, numels, collective, cast_sum, exact), rank,
                      device) {}

BucketReduction::BucketReduction(const Codec& codec, BucketLayout layout, int64_t rank,
                                 const at::TensorOptions& device)
    : Reduction(layout.world, rank),
      codec_(codec),
      layout_(std::move(layout)),
      device_(device.device()) {
  const int64_t w = layout_.world;
  const auto bytes = device.dtype(at::kByte);
  const bool allreduce = layout_.collective == Collective::allreduce;
  if (layout_.two_phase) {
    for (int64_t j = 0, sent = 0; j < w; sent += layout_.shard_bytes[j], ++j) {
      const int64_t at = layout_.starts[j] + layout_.offsets[j];
      append(encode_, layout_.pieces[j], at, sent);
      if (allreduce) append(decode_, layout_.pieces[j], at, j * layout_.slot);
    }
    for (int64_t i = 0; i < w; ++i)
      append(sum_, layout_.pieces[rank], 0, i * layout_.shard_bytes[rank]);
    if (allreduce) append(owner_, layout_.pieces[rank], 0, 0);
  } else {
    const std::vector<Piece> one{Piece{layout_.count}};
    append(encode_, one, layout_.offsets[0], 0);
    if (layout_.wire_sum) {
      append(decode_, one, layout_.offsets[0], 0);
    } else {
      for (int64_t j = 0; j < w; ++j) append(decode_, one, layout_.offsets[0], j * layout_.slot);
    }
  }

  // Zeros: the padding between messages and of the all-gather slots is sent but never written.
  if (layout_.two_phase) {
    send = at::zeros({std::accumulate(layout_.shard_bytes.begin(), layout_.shard_bytes.end(),
                                      int64_t{0})},
                     bytes);
    send_splits = layout_.shard_bytes;
    recv_splits.assign(static_cast<size_t>(w), layout_.shard_bytes[rank]);
    recv = at::empty({w * layout_.shard_bytes[rank]}, bytes);
    if (allreduce) accumulator_ = at::empty({layout_.window(rank)}, device.dtype(at::kFloat));
  }
  gather_in = at::zeros({layout_.slot}, bytes);
  gathered = at::empty({layout_.wire_sum ? 0 : w * layout_.slot}, bytes);
  if (layout_.wire_sum)  // a cast message: the header, then the n values in the wire dtype
    payload = gather_in.narrow(0, static_cast<int64_t>(kHeaderBytes), layout_.summed_bytes)
                  .view(payload_dtype(codec));
  // Every encode's messages are among encode_'s (reduce_owner's are this rank's shard).
  size_t ws = 0;
  for (const Message& m : encode_)
    ws = std::max(ws, codec_of(m.exact).workspace_bytes(static_cast<size_t>(m.n)));
  workspace_ = at::empty({static_cast<int64_t>(ws)}, bytes);
  if (device_.is_cuda())
    decode_status = at::zeros({static_cast<int64_t>(16 * (sum_.size() + decode_.size()))}, bytes);
}

void BucketReduction::check_float(const char* name, const at::Tensor& t, int64_t numel) const {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "gradzip: ", name, " must be float32, got ",
                   t.scalar_type());
  check_placement(name, t, numel);
}

void BucketReduction::check_placement(const char* name, const at::Tensor& t,
                                      int64_t numel) const {
  TORCH_CHECK_VALUE(t.is_contiguous() && t.numel() == numel && t.device() == device_, "gradzip: ",
                    name, " must be a contiguous tensor of ", numel, " elements on ", device_,
                    ", got ", t.numel(), " on ", t.device());
}

void BucketReduction::check_residual(const char* name, const at::Tensor& t, int64_t numel) const {
  TORCH_CHECK_TYPE(residual_dtype_ok(t), "gradzip: ", name,
                   " must be float32 or bfloat16 (compact), got ", t.scalar_type());
  check_placement(name, t, numel);
}

const Codec& BucketReduction::codec_of(bool exact) const { return piece_codec(codec_, exact); }

void BucketReduction::append(Messages& out, const std::vector<Piece>& pieces, int64_t at,
                             int64_t wire) const {
  for (const Piece& p : pieces) {
    const size_t e = codec_of(p.exact).encoded_bytes(static_cast<size_t>(p.len));
    out.push_back({p.exact, at, p.len, wire, static_cast<int64_t>(e)});
    at += p.len;
    wire += static_cast<int64_t>(message_slot_bytes(e));
  }
}

void BucketReduction::encode_all(const Messages& m, const float* in, const at::Tensor& residual,
                                 int64_t residual_offset, uint8_t* wire, float prescale) {
  ResidualSpans spans;  // what a bfloat16 residual widens; a float32 one is used in place
  if (residual.defined() && residual.scalar_type() != at::kFloat) {
    spans.reserve(m.size());
    for (const Message& x : m) spans.emplace_back(x.at, x.n);
  }
  FloatResidual r(residual, residual_offset, std::move(spans));
  std::vector<EncodeItem> items;
  items.reserve(m.size());
  for (const Message& x : m)
    items.push_back({&codec_of(x.exact), in + x.at, r.data() ? r.data() + x.at : nullptr,
                     static_cast<size_t>(x.n), wire + x.wire, static_cast<size_t>(x.bytes)});
  guarded("compressed_allreduce", [&] {
    encode_batch_on(device_, items, prescale, workspace_.data_ptr(),
                    static_cast<size_t>(workspace_.numel()));
  });
  r.store();
}

void BucketReduction::decode_all(const Messages& m, const uint8_t* wire, float* out, bool add,
                                 int64_t status_index) {
  std::vector<DecodeItem> items;
  items.reserve(m.size());
  for (const Message& x : m)
    items.push_back({wire + x.wire, static_cast<size_t>(x.bytes), out + x.at,
                     static_cast<size_t>(x.n)});
  void* status = decode_status.defined()
                     ? static_cast<uint8_t*>(decode_status.data_ptr()) + 16 * status_index
                     : nullptr;
  guarded("compressed_allreduce", [&] { decode_batch_on(device_, items, add, status); });
}

void BucketReduction::compute(Step step, const Operands& operands) {
  switch (step) {
    case Step::encode:
      // Top-k's owner keeps only the top-k of the summed shard: with error feedback the rest must
      // go to its owner residual, or it would be lost while every rank counts it as sent.
      TORCH_CHECK_VALUE(!(operands.residual.defined() && layout_.two_phase &&
                          layout_.collective == Collective::allreduce && layout_.selects) ||
                            operands.owner_residual.defined(),
                        "gradzip: top-k's two-phase exchange with error feedback needs an owner "
                        "residual (this rank's shard of the bucket): the owner keeps the top-k of "
                        "the sum and what it drops goes there");
      if (operands.prescale)
        encode(operands.x, operands.residual, *operands.prescale);
      else
        encode(operands.x, operands.residual);
      return;
    case Step::reduce_owner:
      reduce_owner(operands.owner_residual);
      return;
    case Step::decode:
      decode(operands.out);
      return;
    case Step::sum_shard:
      sum_shard(operands.out);
      return;
    default:
      break;
  }
  TORCH_CHECK(false, "gradzip: ", step_name(step), " is no phase of a ", codec_.name(),
              " reduction");
}

at::Tensor BucketReduction::summed(Step step, const Operands&) const {
  TORCH_CHECK(step == Step::allreduce_payload && payload.defined(), "gradzip: ", step_name(step),
              " sums no buffer of a ", codec_.name(), " reduction");
  return payload;
}

bool BucketReduction::same_layout(const Reduction& other) const {
  const auto* peer = dynamic_cast<const BucketReduction*>(&other);
  return peer != nullptr && peer->codec_ == codec_ && peer->layout_ == layout_;
}

void BucketReduction::encode(const at::Tensor& x, const at::Tensor& residual) {
  encode(x, residual, 1.0f / static_cast<float>(layout_.world));
}

void BucketReduction::encode(const at::Tensor& x, const at::Tensor& residual, float prescale) {
  const int64_t n = layout_.n;
  check_float("bucket", x, n);
  if (residual.defined()) check_residual("residual", residual, n);
  encode_all(encode_, x.const_data_ptr<float>(), residual, 0,
             (layout_.two_phase ? send : gather_in).data_ptr<uint8_t>(), prescale);
}

void BucketReduction::sum_received(const at::Tensor& window) {
  window.zero_();
  decode_all(sum_, recv.const_data_ptr<uint8_t>(), window.data_ptr<float>(), /*add=*/true, 0);
}

void BucketReduction::sum_shard(const at::Tensor& out) {
  TORCH_CHECK(layout_.two_phase, "gradzip: sum_shard is a phase of the sharded collectives");
  check_float("shard output", out, layout_.shard_size(rank()));
  sum_received(out.narrow(0, layout_.offsets[rank()], layout_.window(rank())));
}

void BucketReduction::reduce_owner(const at::Tensor& owner_residual) {
  TORCH_CHECK(layout_.two_phase && layout_.collective == Collective::allreduce,
              "gradzip: reduce_owner is a phase of the two-phase all-reduce");
  if (owner_residual.defined())
    check_residual("owner residual", owner_residual, layout_.shard_size(rank()));
  sum_received(accumulator_);
  encode_all(owner_, accumulator_.const_data_ptr<float>(), owner_residual,
             layout_.offsets[rank()], gather_in.data_ptr<uint8_t>(), 1.0f);
}

void BucketReduction::decode(const at::Tensor& out) {
  TORCH_CHECK(layout_.collective == Collective::allreduce,
              "gradzip: decode is the last phase of the all-reduce");
  check_float("output", out, layout_.n);
  // Top-k's all-gathered whole-bucket messages are summed into zeros; the others each write
  // their own elements.
  const bool add = !layout_.two_phase && !layout_.wire_sum;
  if (add) out.zero_();
  // After sum_shard's status words, so that every status word of the step is kept.
  decode_all(decode_, (layout_.wire_sum ? gather_in : gathered).const_data_ptr<uint8_t>(),
             out.data_ptr<float>(), add, static_cast<int64_t>(sum_.size()));
}

}  // namespace gradzip::torch_ext
