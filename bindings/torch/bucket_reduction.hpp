// One rank's part of the compressed average of one flat float32 bucket, cut into the phases
// between its collectives, so that a process group (compressed_allreduce.hpp) and W ranks simulated
// in one process (in_memory_exchange.hpp, behind gradzip.simulation.SimulatedWorkers) run exactly
// the same arithmetic on the same bytes. The order of the phases and collectives, the sequences
// below, is written once, as data (BucketLayout::steps, a list of Step), which each of those two
// drivers interprets (a Reduction, reduction.hpp): the phases through BucketReduction::compute, the
// collectives its own way.
// The bytes a rank moves are that list's too (BucketLayout::traffic, per collective step), which the
// reductions report (CompressedAllreduce::traffic, BucketReduction's torch class) for the traffic
// counters.
//
// The casts (fp32, fp16, bf16) by default (CastSum::wire):
//   encode        the whole bucket is encoded as one message (prescale 1/W, error feedback into
//                 `residual`) into gather_in;
//   all-reduce    the message's values (`payload`, a float32/float16/bfloat16 view of gather_in
//                 after the header) are summed in place by the backend: one collective, the
//                 bytes of a ring all-reduce in the wire dtype (2 (W-1)/W of 4n or 2n bytes per
//                 rank each way; fp32's are plain DDP's);
//   decode        every rank decodes the summed message.
// Every rank gets the backend's result, so replicas stay identical; but the sum is rounded to the
// wire dtype in the backend's order (which differs between backends and may lose precision or
// overflow as W grows), and no rank sees an fp32 sum, so there is no owner residual.
//
// Two-phase codecs (int8, sign, and the casts with CastSum::fp32):
//   encode        the bucket is cut into W shards; every shard is encoded (prescale 1/W, error
//                 feedback into `residual`) into send, shard j for rank j;
//   all-to-all    send -> recv: rank r receives the W encodings of its shard, in rank order;
//   reduce_owner  decodes them in rank order, summing in fp32, and re-encodes the sum (its own
//                 residual only where an optimizer direction is compressed) into gather_in;
//   all-gather    gather_in -> gathered (W fixed-size slots);
//   decode        every rank decodes every shard.
// For the casts this buys fp32 accumulation in a fixed order: the sum neither loses precision nor
// overflows as W grows (fp16/bf16), is bitwise identical on every backend, and equals an
// in-process simulation (gradzip.simulation.SimulatedWorkers) bit for bit.
// Top-k (CastSum::wire): encode the whole bucket (prescale 1/W, error feedback) into gather_in;
// all-gather; decode-add the W payloads in rank order into zeros. A rank receives (W - 1) k
// (index, value) pairs, so the bytes grow with W (more than fp32's ring all-reduce past W ~ 130 at
// 1 %), and the average holds up to W k nonzeros.
// Top-k with CastSum::fp32: the two-phase exchange above, each shard its own top-k (k = ceil(ratio
// * shard size)); the owner decode-adds the W of them and re-encodes the top-k of the sum, keeping
// the rest in its owner residual (error feedback at both levels: without it, what the owner drops
// would be lost while every rank counts it as sent). A rank moves about 2 k pairs whatever W, and
// the average's k nonzeros are the same coordinates on every rank.
//
// Reduce-scatter (Collective::reduce_scatter, FSDP's gradient step, which keeps the result
// sharded): the two-phase encode and all-to-all for every codec, then sum_shard decodes the W
// encodings of this rank's shard in rank order into its fp32 output. Top-k selects per
// destination shard (k = ceil(ratio * shard size) of each), so no second phase is needed.
//
// Block-scaled codecs (int8, sign) encode a shard as one message per tensor piece (the shard cut
// at the bucket's tensor boundaries): no block mixes two tensors, whose gradient scales can differ
// by orders of magnitude (a small tensor sharing a block with a large one gets steps of the large
// one's scale, every step, which error feedback turns into an oscillation: a depth net's 1x1 output
// layer did so under SGD and diverged). Pieces shorter than kMinPiece travel exact (fp32): there a
// 32-byte header and the block's error cost more than the fp32 bytes saved. Messages follow each
// other in 16-byte aligned slots (the CUDA decoders' alignment). Each phase's messages are one batch
// of the library (gradzip::encode_batch / decode_batch and their CUDA twins), listed once, at
// construction, as offsets into the phase's buffers.
// Tensors marked `exact` (biases, norms: small, with gradient statistics of their own, where a
// block's header is paid for few elements and the error is large) travel as fp32 messages in the
// same exchange: every rank's fp32 share summed in rank order and re-encoded as fp32, so their
// average is the exact fp32 sum and their residuals stay zero. An exact piece never merges with a
// compressed one. Other codecs ignore the marks (fp32 and the casts carry every element already;
// top-k selects over the whole bucket).
//
// Chunks (BucketLayout::chunks): a bucket may be reduced as consecutive chunks, each a layout of its
// own over the same buffers, so that a driver overlaps one chunk's phases with another's
// collectives (compressed_allreduce.hpp). A cast chunk is a range of the bucket; a two-phase chunk
// is a range of every shard, cut only where the whole bucket's messages could be cut without moving
// a block (a piece's boundary, a multiple of the block from a compressed piece's start, anywhere in
// an exact piece or a cast's message): every block of a chunk is a block of the whole bucket, and
// a piece keeps its codec (a compressed piece's last part may be shorter than kMinPiece and still
// travel compressed, as it did inside the piece), so the chunks encode to the same bits as the
// bucket in one piece, and a two-phase bucket's chunks sum and decode to them too. A bucket summed
// on the wire (fp32, fp16, bf16 by default) is summed in the backend's own order, which may depend
// on the sizes it is given: with W > 2 ranks the chunks' sums may round differently, as they may
// between backends. Each cut adds bytes: a header (32 bytes) and its alignment per cut piece, and
// per chunk an all-gather slot sized for its largest shard. Top-k (it selects over the whole
// bucket, or the whole shard in the two-phase exchange) and the reduce-scatter are not chunked.
//
// Workspaces are allocated once, at construction; a bucket whose layout changes needs a new object.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gradzip/gradzip.hpp"
#include "reduction.hpp"

namespace gradzip::torch_ext {

constexpr int64_t kMinPiece = 64;

// One message of a shard: `len` elements, encoded with the bucket's codec or (exact) as fp32.
struct Piece {
  int64_t len = 0;
  bool exact = false;

  bool operator==(const Piece&) const = default;
};

// Where the bytes go: a pure function of the codec, W, n, the tensor sizes and which of them
// travel exact (`exact`: one flag per tensor, or empty for none).
struct BucketLayout {
  BucketLayout(const Codec& codec, int64_t world, const std::vector<int64_t>& numels,
               Collective collective = Collective::allreduce, CastSum cast_sum = CastSum::wire,
               const std::vector<bool>& exact = {});

  int64_t world = 1;
  int64_t n = 0;
  Collective collective = Collective::allreduce;
  bool wire_sum = false;                     // one all-reduce of the payload (the casts)
  bool two_phase = true;                     // shards exchanged by all-to-all (else wire_sum or
                                             // top-k's all-gather, with CastSum::wire)
  bool selects = false;                      // the codec keeps some elements only (top-k): it
                                             // selects over a whole message
  std::vector<int64_t> starts;               // W + 1 shard offsets (two-phase)
  std::vector<std::vector<Piece>> pieces;    // per shard, its messages, consecutive from offsets[j]
  // Where this layout's elements begin (all zero but in a chunk): per shard, from the shard's start
  // (two-phase); or one entry, the bucket offset of its one message.
  std::vector<int64_t> offsets;
  int64_t count = 0;                         // elements it carries (n but in a chunk)
  std::vector<int64_t> shard_bytes;          // per shard, its messages' bytes
  int64_t slot = 0;                          // bytes of one all-gather contribution (all-reduce),
                                             // or of the one message (wire_sum)
  int64_t summed_bytes = 0;                  // wire_sum: the payload's, all-reduced (no header)
  std::vector<Step> steps;                   // the order of the reduction (reduction.hpp's Step)

  bool operator==(const BucketLayout&) const = default;

  int64_t shard_size(int64_t rank) const { return starts[rank + 1] - starts[rank]; }
  // Elements of shard `rank` this layout carries (shard_size(rank) but in a chunk).
  int64_t window(int64_t rank) const;
  // The bucket cut into consecutive chunks of about `elements` elements each (see above), or
  // {*this} where it is not cut: at most `elements` already, top-k, the reduce-scatter.
  std::vector<BucketLayout> chunks(const Codec& codec, int64_t elements) const;
  // Bytes (sent, received) of one rank in collective `step` of `steps` ((0, 0) for a phase): an
  // all-reduce counted as a ring all-reduce, an all-to-all and an all-gather by their splits and
  // slots (the padding of the slots included: it travels).
  std::pair<int64_t, int64_t> traffic(Step step, int64_t rank) const;
  // Bytes (sent, received) of one rank for this bucket: the sum over `steps` (an uncompressed
  // bucket: see fp32_traffic).
  std::pair<int64_t, int64_t> traffic(int64_t rank) const;

 private:
  // shard_bytes and slot from `pieces` (two-phase), or slot and summed_bytes from `count`.
  void size_messages(const Codec& codec);
};

// Shard j of a two-phase bucket is [starts[j], starts[j + 1]): n // W + 1 elements for the first
// n % W shards, n // W for the others (W + 1 offsets).
std::vector<int64_t> shard_starts(int64_t n, int64_t world);

// Bytes each way per rank of a ring all-reduce of `bytes` over W ranks: 2 (W-1)/W of them.
int64_t ring_allreduce_traffic(int64_t bytes, int64_t world);
// Bytes each way of a ring all-reduce of n floats over W ranks, the uncompressed reference.
int64_t fp32_traffic(int64_t n, int64_t world);

class BucketReduction : public Reduction {
 public:
  BucketReduction(const Codec& codec, int64_t world, int64_t rank,
                  const std::vector<int64_t>& numels, const at::TensorOptions& device,
                  Collective collective = Collective::allreduce, CastSum cast_sum = CastSum::wire,
                  const std::vector<bool>& exact = {});
  // One rank's reduction of `layout` (a whole bucket's, or one of its chunks), laid out for `codec`.
  BucketReduction(const Codec& codec, BucketLayout layout, int64_t rank,
                  const at::TensorOptions& device);

  const BucketLayout& layout() const { return layout_; }
  bool two_phase() const { return layout_.two_phase; }
  bool wire_sum() const { return layout_.wire_sum; }
  const Codec& codec() const { return codec_; }

  std::string name() const override { return codec_.name(); }
  const std::vector<Step>& steps() const override { return layout_.steps; }
  void compute(Step step, const Operands& operands) override;
  // payload, the one all-reduced buffer.
  at::Tensor summed(Step step, const Operands& operands) const override;
  std::pair<int64_t, int64_t> traffic() const override { return layout_.traffic(rank()); }
  bool same_layout(const Reduction& other) const override;

  // x: this rank's float32 bucket (n, contiguous). residual: n float32 or bfloat16 elements
  // (float_residual.hpp), or undefined (no error feedback). Encodes x * prescale (the all-reduce
  // averages: 1 / W); the residual is in those units.
  void encode(const at::Tensor& x, const at::Tensor& residual);
  void encode(const at::Tensor& x, const at::Tensor& residual, float prescale);
  // out: shard_size(rank) floats, its window (this layout's elements of the shard) set to the sum
  // of the W received encodings of them, decoded in rank order.
  void sum_shard(const at::Tensor& out);
  // owner_residual: shard_size(rank) float32 or bfloat16 elements, or undefined.
  void reduce_owner(const at::Tensor& owner_residual);
  // out: n floats (may be x). All-reduce only.
  void decode(const at::Tensor& out);

  // The exchanged buffers (Reduction's). Two-phase: all-to-all send -> recv, then all-gather
  // gather_in -> gathered. Top-k: only the all-gather. Reduce-scatter: only the all-to-all.
  // wire_sum: the in-place all-reduce (SUM) of payload, the float16/bfloat16 values of gather_in.
  // decode_status: sum_shard's status words, then decode's.
  at::Tensor payload;

 private:
  // One message of a phase, as offsets into the phase's buffers (which, but for the workspaces,
  // are the caller's and change per call): its elements [at, at + n) of the floats, its bytes
  // [wire, wire + bytes) of the wire buffer.
  struct Message {
    bool exact = false;
    int64_t at = 0, n = 0;
    int64_t wire = 0, bytes = 0;
  };
  using Messages = std::vector<Message>;

  const Codec& codec_of(bool exact) const;
  // Appends `pieces` as consecutive messages from element `at` and wire byte `wire` on.
  void append(Messages& out, const std::vector<Piece>& pieces, int64_t at, int64_t wire) const;
  // residual: undefined, float32 or bfloat16 (float_residual.hpp); message x's residual is its
  // elements [residual_offset + x.at, + x.n).
  void encode_all(const Messages& m, const float* in, const at::Tensor& residual,
                  int64_t residual_offset, uint8_t* wire, float prescale);
  void decode_all(const Messages& m, const uint8_t* wire, float* out, bool add,
                  int64_t status_index);
  void check_float(const char* name, const at::Tensor& t, int64_t numel) const;
  // float32 or bfloat16 (a compact residual), contiguous, numel elements on this device.
  void check_residual(const char* name, const at::Tensor& t, int64_t numel) const;
  void check_placement(const char* name, const at::Tensor& t, int64_t numel) const;
  // window: this rank's window of its shard, set to the sum of the W received encodings.
  void sum_received(const at::Tensor& window);

  Codec codec_;
  BucketLayout layout_;
  c10::Device device_;
  // encode: x into send (two-phase) or gather_in; sum_: recv into this rank's window (W per piece
  // of it); owner_: the window's sum into gather_in; decode: gathered (gather_in for wire_sum) into
  // the output. Offsets: of the bucket (encode_, decode_), of the window (sum_, owner_).
  Messages encode_, sum_, owner_, decode_;
  at::Tensor workspace_, accumulator_;
};

}  // namespace gradzip::torch_ext
