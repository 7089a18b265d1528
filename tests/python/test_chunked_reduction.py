"""A bucket reduced in chunks (CompressedAllreduce's `chunk`) on 3 real Gloo ranks, over two steps
of error feedback, a bucket of tensors of odd sizes (one exact): for the two-phase codecs the
average, the residual and the owner's residual equal the bucket reduced in one piece bit for bit;
for the casts summed on the wire the residual does, and the average differs by no more than two
16-bit sums of the same W values in different orders may (Gloo's ring sums each chunk in an order
of its own); top-k's two-phase exchange, which selects over whole shards, is not cut. The
timeline (set_timeline / take_timeline) holds every step of every chunk, each chunk's steps in
their order, on the pipeline thread that runs or waits for them."""

import os

import pytest
import torch
import torch.distributed as dist

import gradzip  # noqa: F401  (registers torch.classes.gradzip)
from dist_util import run_ranks
from gradzip.plan import CodecPlan, shard_bounds

WORLD = 3
NUMELS = [2999, 40, 4001, 3003]  # one exact tensor of 40; shards of 3348 or 3347 elements
EXACT = [False, True, False, False]
CHUNK = 1200
CASES = [("int8", "wire"), ("sign:block=128", "wire"), ("bf16", "fp32"), ("bf16", "wire"),
         ("fp16", "wire"), ("topk:0.1", "fp32")]  # top-k selects over a whole shard: not cut
TWO_PHASE_STEPS = ["encode", "all-to-all", "owner sum + re-encode", "all-gather", "decode"]


def two_phase(codec, cast_sum):
    """The extension's rule (gradzip.plan, tied to BucketLayout by test_wire.py)."""
    return CodecPlan.parse(codec, cast_sum).two_phase


def reduce_both_ways(rank, world, outdir):
    n = sum(NUMELS)
    bounds = shard_bounds(n, world)
    shard = bounds[rank + 1] - bounds[rank]
    groups = [dist.new_group(list(range(world)), use_local_synchronization=True)
              for _ in range(3)]
    out = {}
    for codec, cast_sum in CASES:
        sharded = two_phase(codec, cast_sum)
        one_piece = torch.classes.gradzip.CompressedAllreduce(
            groups[0].group_name, codec, None, cast_sum, "", 2**40)
        chunked = torch.classes.gradzip.CompressedAllreduce(
            groups[1].group_name, codec, None, cast_sum, groups[2].group_name if sharded else "",
            CHUNK)
        chunked.set_timeline(True)
        states = {way: (torch.zeros(n), torch.zeros(shard) if sharded else None)
                  for way in ("one", "chunked")}
        runs = []
        for step in range(2):
            g = torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + step))
            got = {"sent": (g / world + states["one"][0]).abs()}  # |c|, before this step
            for way, red in (("one", one_piece), ("chunked", chunked)):
                x = g.clone()
                residual, owner = states[way]
                red.reduce(0, x, x, NUMELS, residual, owner, True, EXACT).wait()
                got[way] = (x, residual.clone(), None if owner is None else owner.clone())
            runs.append(got)
        out[f"{codec} {cast_sum}"] = {"runs": runs, "timeline": chunked.take_timeline(),
                                      "traffic": (one_piece.traffic(0), chunked.traffic(0))}
    torch.save(out, os.path.join(outdir, f"chunked_{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("chunked")
    run_ranks(reduce_both_ways, WORLD, str(outdir), timeout=240)
    return [torch.load(os.path.join(outdir, f"chunked_{r}.pt"), weights_only=False)
            for r in range(WORLD)]


UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}  # unit roundoff of the wire dtype


@pytest.mark.parametrize("case", [f"{c} {s}" for c, s in CASES])
def test_chunks_give_the_bits_of_one_piece(results, case):
    codec, cast_sum = case.split()
    wire_sum = CodecPlan.parse(codec, cast_sum).wire_sum
    for rank in range(WORLD):
        got = results[rank][case]
        for step, run in enumerate(got["runs"]):
            one, chunked = run["one"], run["chunked"]
            for what, a, b in zip(("average", "residual", "owner residual"), one, chunked):
                if a is None:
                    assert b is None
                    continue
                if what == "average" and wire_sum:
                    # Each is the sum of the same W wire values t (|t| <= |c| (1 + u)) within
                    # (W - 1) u sum|t| of the exact sum, whatever the order.
                    sent = sum(results[r][case]["runs"][step]["sent"] for r in range(WORLD))
                    bound = 2 * (WORLD - 1) * UNIT[codec] * (1 + UNIT[codec]) * sent + 2.0 ** -24
                    off = (a.double() - b.double()).abs()
                    assert (off <= bound.double()).all(), f"rank {rank}, step {step}: {off.max()}"
                    continue
                assert torch.equal(a, b), f"rank {rank}, step {step}: the {what} differs"
            assert one[0].isfinite().all() and one[0].abs().sum() > 0
        assert got["traffic"][0] == got["traffic"][1], "the chunks report the whole bucket's bytes"
    # Every rank holds the same average (replicas stay identical).
    for rank in range(1, WORLD):
        assert torch.equal(results[rank][case]["runs"][1]["chunked"][0],
                           results[0][case]["runs"][1]["chunked"][0])


@pytest.mark.parametrize("case", [f"{c} {s}" for c, s in CASES])
def test_timeline_holds_every_step_of_every_chunk_in_order(results, case):
    events = results[0][case]["timeline"]  # two reductions of bucket 0
    parts = sorted({e[1] for e in events})
    selects = CodecPlan.parse(case.split()[0]).kind == "topk"
    assert (len(parts) == 1) == selects, "the bucket was cut into chunks, but not top-k's"
    assert parts == list(range(len(parts)))
    steps = TWO_PHASE_STEPS if two_phase(*case.split()) else ["encode", "all-reduce", "decode"]
    for part in parts:
        mine = sorted((e for e in events if e[1] == part), key=lambda e: e[4])
        assert [e[2] for e in mine] == steps * 2, f"chunk {part}: {[e[2] for e in mine]}"
        for e in mine:
            # The encode on the issuing thread, which starts the first collective; the finishing
            # thread waits for that and runs (or waits for) every later step.
            assert e[0] == 0 and e[4] <= e[5]
            assert e[3] == ("issue" if e[2] == "encode" else "finish"), e
        for a, b in zip(mine, mine[1:]):
            assert a[5] <= b[4] + 1e-3 or a[2] != "encode", f"chunk {part}: {a} then {b}"
