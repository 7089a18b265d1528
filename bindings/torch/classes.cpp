// The compressed all-reduce as TorchScript classes (torch.classes.gradzip.*), for the Python hook
// (gradzip.ddp) and its in-process simulation:
//   CompressedAllreduce(group_name, codec, guard?, cast_sum="wire", gather_group_name="",
//                       chunk=2**21)                 over the registered process group of that
//                                                    name (and that one for the two-phase
//                                                    all-gathers), CPU buckets in chunks of
//                                                    `chunk` elements
//   BucketReduction(codec, world, rank, numels, like, cast_sum="wire", exact=[], rows=[])
//                                                    one rank's phases and buffers (a codec's,
//                                                    or lowrank:R's: reduction.hpp); W of them
//                                                    reduced by
//   gradzip::reduce_in_memory(ranks, xs, residuals, owner_residuals, qs, outs)   the collectives
//                                                    done in memory (in_memory_exchange.hpp)
//   NonfiniteGuard()
// and the layout's sizes as ops (gradzip::fp32_traffic, shard_starts, lowrank_sizes;
// lowrank_rank_of parses a lowrank spec: its R, or 0 for another codec; wire_constants and
// codec_facts: the constants and the codecs' facts gradzip/wire.py restates). Each reduction
// reports the bytes of what it lays out: traffic() -> (sent, received), of a bucket index's last
// reduction for CompressedAllreduce, of its rank for BucketReduction.
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "compressed_allreduce.hpp"
#include "device_codec.hpp"
#include "bucket_reduction.hpp"
#include "in_memory_exchange.hpp"
#include "lowrank_reduction.hpp"

namespace gradzip::torch_ext {
namespace {

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t.value_or(at::Tensor()); }

// TorchScript's bool[] (c10::List<bool>; its binder takes no std::vector<bool>).
std::vector<bool> flags(const c10::List<bool>& list) { return {list.begin(), list.end()}; }

// One rank's reduction, whichever the codec; its buffers are readable for tests of the bytes.
class PyBucketReduction : public torch::CustomClassHolder {
 public:
  PyBucketReduction(const std::string& spec, int64_t world, int64_t rank,
                    const std::vector<int64_t>& numels, const at::Tensor& like,
                    const std::string& cast_sum, const c10::List<bool>& exact,
                    const std::vector<int64_t>& rows)
      : r(ReductionSpec(spec)
              .make(world, rank, numels, rows, flags(exact), like.options(), Collective::allreduce,
                    parse_cast_sum(cast_sum))
              .parts[0]) {}
  // The codec's reduction (a ValueError for lowrank's), for its phases and layout.
  BucketReduction& codec_reduction() const {
    auto* b = dynamic_cast<BucketReduction*>(r.get());
    TORCH_CHECK_VALUE(b, "gradzip: a ", r->name(), " reduction has no codec phases");
    return *b;
  }
  std::shared_ptr<Reduction> r;
};

void reduce_in_memory_op(const c10::List<c10::intrusive_ptr<PyBucketReduction>>& ranks,
                         const std::vector<at::Tensor>& xs,
                         const c10::List<std::optional<at::Tensor>>& residuals,
                         const c10::List<std::optional<at::Tensor>>& owner_residuals,
                         const c10::List<std::optional<at::Tensor>>& qs,
                         const std::vector<at::Tensor>& outs) {
  const size_t world = ranks.size();
  TORCH_CHECK_VALUE(xs.size() == world && residuals.size() == world &&
                        owner_residuals.size() == world && qs.size() == world &&
                        outs.size() == world,
                    "gradzip: reduce_in_memory needs one x, residual, owner residual, q and output "
                    "per rank, for ", world, " ranks got ", xs.size(), ", ", residuals.size(), ", ",
                    owner_residuals.size(), ", ", qs.size(), " and ", outs.size());
  std::vector<Reduction*> reductions;
  std::vector<Operands> operands;
  for (size_t r = 0; r < world; ++r) {
    reductions.push_back(ranks.get(r)->r.get());
    operands.push_back({xs[r], or_undefined(residuals.get(r)), or_undefined(owner_residuals.get(r)),
                        outs[r], or_undefined(qs.get(r)), std::nullopt});
  }
  const at::NoGradGuard no_grad;
  reduce_in_memory(reductions, operands);
}

std::vector<int64_t> lowrank_sizes_op(int64_t rank, const std::vector<int64_t>& numels,
                                      const std::vector<int64_t>& rows) {
  const auto [p, q] = lowrank_sizes(rank, numels, rows);
  return {p, q};
}

int64_t lowrank_rank_of(const std::string& spec) { return parse_lowrank(spec).value_or(0); }

// TorchScript returns a tuple, not a pair.
std::tuple<int64_t, int64_t> sent_received(const std::pair<int64_t, int64_t>& traffic) {
  return {traffic.first, traffic.second};
}

// The constants Python restates (gradzip/wire.py, which must work without the extension), for the
// test that ties each to its one definition here.
c10::Dict<std::string, int64_t> wire_constants() {
  c10::Dict<std::string, int64_t> d;
  d.insert("header_bytes", static_cast<int64_t>(kHeaderBytes));
  d.insert("max_count", static_cast<int64_t>(kMaxCount));
  d.insert("topk_max_count", static_cast<int64_t>(kTopkMaxCount));
  d.insert("topk_index_chunk", static_cast<int64_t>(kTopkIndexChunk));
  d.insert("min_block", kMinBlock);
  d.insert("max_block", kMaxBlock);
  d.insert("default_int8_block", kDefaultInt8Block);
  d.insert("default_sign_block", kDefaultSignBlock);
  d.insert("min_piece", kMinPiece);
  d.insert("chunk", CompressedAllreduce::kChunk);
  return d;
}

// Every codec kind, in wire-id order, with the facts its traits state (gradzip/codec/visit.hpp):
// for the test that ties gradzip/wire.py's tables of kinds to them.
c10::Dict<std::string, c10::List<std::string>> codec_facts() {
  c10::Dict<std::string, c10::List<std::string>> d;
  for (uint8_t id = 0; known_codec(static_cast<CodecKind>(id)); ++id) {
    visit(static_cast<CodecKind>(id), [&](auto c) {
      c10::List<std::string> facts;
      if (c.block_scaled) facts.push_back("block_scaled");
      if (c.summable) facts.push_back("summable");
      if (c.sparse) facts.push_back("sparse");
      if (c.all_gathered) facts.push_back("all_gathered");
      d.insert(c.spec_name, facts);
    });
  }
  return d;
}

}  // namespace
}  // namespace gradzip::torch_ext

TORCH_LIBRARY_FRAGMENT(gradzip, m) {
  using namespace gradzip::torch_ext;
  m.class_<NonfiniteGuard>("NonfiniteGuard")
      .def(torch::init<>())
      .def("save", &NonfiniteGuard::save)
      .def("flag", &NonfiniteGuard::flag)
      .def("commit", &NonfiniteGuard::commit);

  m.class_<CompressedAllreduce>("CompressedAllreduce")
      .def(torch::init([](const std::string& group_name, const std::string& codec,
                          const std::optional<c10::intrusive_ptr<NonfiniteGuard>>& guard,
                          const std::string& cast_sum, const std::string& gather_group_name,
                          int64_t chunk) {
             return c10::make_intrusive<CompressedAllreduce>(
                 c10d::resolve_process_group(group_name), codec, guard.value_or(nullptr),
                 parse_cast_sum(cast_sum),
                 gather_group_name.empty() ? nullptr
                                           : c10d::resolve_process_group(gather_group_name),
                 chunk);
           }),
           "", {torch::arg("group_name"), torch::arg("codec"), torch::arg("guard"),
                torch::arg("cast_sum") = "wire", torch::arg("gather_group_name") = "",
                torch::arg("chunk") = CompressedAllreduce::kChunk})
      .def("reduce",
           [](const c10::intrusive_ptr<CompressedAllreduce>& self, int64_t index,
              const at::Tensor& bucket, const at::Tensor& x, const std::vector<int64_t>& numels,
              const std::optional<at::Tensor>& residual,
              const std::optional<at::Tensor>& owner_residual, bool compress,
              const c10::List<bool>& exact, const std::vector<int64_t>& rows,
              const std::optional<at::Tensor>& q) -> c10::IValue {
             return self->reduce(index, bucket, x, numels, or_undefined(residual),
                                 or_undefined(owner_residual), compress, flags(exact), rows,
                                 or_undefined(q));
           },
           "", {torch::arg("index"), torch::arg("bucket"), torch::arg("x"), torch::arg("numels"),
                torch::arg("residual"), torch::arg("owner_residual"), torch::arg("compress"),
                torch::arg("exact") = c10::List<bool>(),
                torch::arg("rows") = std::vector<int64_t>(), torch::arg("q") = std::nullopt})
      .def("reduce_scatter",
           [](const c10::intrusive_ptr<CompressedAllreduce>& self, int64_t index,
              const at::Tensor& output, const at::Tensor& x, const std::vector<int64_t>& numels,
              const std::optional<at::Tensor>& residual, double prescale,
              const c10::List<bool>& exact) -> c10::IValue {
             return self->reduce_scatter(index, output, x, numels, or_undefined(residual), prescale,
                                         flags(exact));
           })
      .def("check_errors", &CompressedAllreduce::check_errors)
      .def("set_timeline", &CompressedAllreduce::set_timeline)
      // [(bucket, part, step, thread, start_ms, end_ms)], in the order the events ended
      .def("take_timeline",
           [](const c10::intrusive_ptr<CompressedAllreduce>& self) {
             std::vector<std::tuple<int64_t, int64_t, std::string, std::string, double, double>>
                 out;
             for (const Timeline::Event& e : self->take_timeline())
               out.emplace_back(e.bucket, e.part, step_name(e.step), e.thread, e.start_ms,
                                e.end_ms);
             return out;
           })
      .def("traffic", [](const c10::intrusive_ptr<CompressedAllreduce>& self, int64_t index) {
        return sent_received(self->traffic(index));
      });

  m.class_<PyBucketReduction>("BucketReduction")
      .def(torch::init<std::string, int64_t, int64_t, std::vector<int64_t>, at::Tensor, std::string,
                       c10::List<bool>, std::vector<int64_t>>(),
           "", {torch::arg("spec"), torch::arg("world"), torch::arg("rank"), torch::arg("numels"),
                torch::arg("like"), torch::arg("cast_sum") = "wire",
                torch::arg("exact") = c10::List<bool>(), torch::arg("rows") = std::vector<int64_t>()})
      .def("two_phase", [](const c10::intrusive_ptr<PyBucketReduction>& s) {
        return s->codec_reduction().two_phase();
      })
      .def("wire_sum", [](const c10::intrusive_ptr<PyBucketReduction>& s) {
        return s->codec_reduction().wire_sum();
      })
      .def("encode",
           [](const c10::intrusive_ptr<PyBucketReduction>& s, const at::Tensor& x,
              const std::optional<at::Tensor>& residual) {
             s->codec_reduction().encode(x, or_undefined(residual));
           })
      .def("send", [](const c10::intrusive_ptr<PyBucketReduction>& s) { return s->r->send; })
      .def("send_splits", [](const c10::intrusive_ptr<PyBucketReduction>& s) { return s->r->send_splits; })
      .def("gather_in", [](const c10::intrusive_ptr<PyBucketReduction>& s) { return s->r->gather_in; })
      .def("traffic", [](const c10::intrusive_ptr<PyBucketReduction>& s) {
        return sent_received(s->r->traffic());
      });

  m.def("reduce_in_memory(__torch__.torch.classes.gradzip.BucketReduction[] ranks, Tensor[] xs, "
        "Tensor(a!)?[] residuals, Tensor(b!)?[] owner_residuals, Tensor(c!)?[] qs, "
        "Tensor(d!)[] outs) -> ()",
        &reduce_in_memory_op);
  m.def("fp32_traffic(int n, int world) -> int", &fp32_traffic);
  m.def("shard_starts(int n, int world) -> int[]", &shard_starts);
  m.def("lowrank_sizes(int rank, int[] numels, int[] rows) -> int[]", &lowrank_sizes_op);
  m.def("lowrank_rank_of(str spec) -> int", &lowrank_rank_of);
  m.def("wire_constants() -> Dict(str, int)", &wire_constants);
  m.def("codec_facts() -> Dict(str, str[])", &codec_facts);
}
