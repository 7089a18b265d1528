"""SimulatedWorkers (the single-process reference of the hook's algorithm): exact arithmetic for the
lossless codec, error bounds and error-feedback behaviour for the lossy ones, traffic accounting,
warm-up/small buckets, the non-finite guard and state_dict round trips."""

import functools
import math
import pickle

import pytest
import torch

import gradzip
from gradzip.plan import shard_bounds, CodecPlan
from gradzip import simulation, wire
from gradzip.ddp import CompressionState

# every bucket compressed, however small (the default leaves buckets under 4096 elements alone)
SimulatedWorkers = functools.partial(simulation.SimulatedWorkers, min_compress_numel=0)

LOSSY = ["fp16", "bf16", "int8", "sign", "topk:0.1"]


def grads(world, n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * scale for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [5, 97, 4099])
def test_fp32_is_the_rank_order_sum_of_prescaled_gradients(world, n):
    gs = grads(world, n, seed=n)
    out = SimulatedWorkers("fp32", world).reduce(gs)
    ps = torch.tensor(1.0 / world, dtype=torch.float32)
    expected = torch.zeros(n)
    for g in gs:
        expected = expected + g * ps
    assert torch.equal(out, expected) if world > 1 else torch.equal(out, gs[0])


@pytest.mark.parametrize("world", [2, 3])
def test_fp32_keeps_no_residual_and_averages_as_without_feedback(world):
    """fp32 is lossless, so error feedback keeps nothing for it (a residual would stay zero): no
    state, and the same bits as without error feedback; a lossy codec keeps its residual."""
    with_ef, without = SimulatedWorkers("fp32", world), SimulatedWorkers(
        "fp32", world, error_feedback=False)
    for s in range(3):
        gs = grads(world, 4099, seed=s)
        assert torch.equal(with_ef.reduce(gs), without.reduce(gs))
    assert all(worker == {} for worker in with_ef.state_dict()["workers"])
    bf16 = SimulatedWorkers("bf16", world)
    bf16.reduce(grads(world, 4099))
    assert bf16.state_dict()["workers"][0][0]["residual"].abs().sum() > 0


def test_shards_cover_the_bucket():
    for n in (3, 4, 10, 11):
        for w in (1, 2, 3, 4):
            b = shard_bounds(n, w)
            sizes = [b[j + 1] - b[j] for j in range(w)]
            assert b[0] == 0 and b[-1] == n and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("codec", LOSSY)
def test_error_feedback_telescopes(codec):
    """Over T steps, sum(outputs) = T * mean - (sum of the final residuals) where the sum is not
    rounded again (top-k's all-gather): nothing is lost, the compression error does not accumulate
    (without EF it grows like T)."""
    world, n, steps = 3, 2001, 20
    sim = SimulatedWorkers(codec, world)
    gs = grads(world, n, seed=1)
    mean = torch.stack(gs).double().mean(0)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):  # the same gradients every step
        total += sim.reduce(gs).double()
    held = sum(worker[0]["residual"].double() for worker in sim.state_dict()["workers"])
    err = total - steps * mean
    if CodecPlan.parse(codec).kind == "topk":  # decoded sums are exact
        torch.testing.assert_close(err, -held, rtol=0, atol=1e-4 * steps)
    # two-phase: the owner's re-encode of the sum has no residual, nor has the casts' rounding of
    # the sum to the wire dtype (one all-reduce); what the workers sent still
    # telescopes, so the error stays far below the drift without error feedback, except for sign,
    # whose 1-bit re-encode of a constant sum errs the same way every step (with training
    # gradients it does not: tests/python/test_error_feedback.py)
    if codec == "sign":
        return
    no_ef = SimulatedWorkers(codec, world, error_feedback=False)
    drift = sum(no_ef.reduce(gs).double() for _ in range(steps)) - steps * mean
    assert err.abs().mean() < 0.5 * drift.abs().mean()


@pytest.mark.parametrize("codec", LOSSY)
def test_reduce_is_deterministic_and_state_dict_resumes_exactly(codec):
    world, n = 2, 1500
    a = SimulatedWorkers(codec, world)
    for s in range(3):
        a.reduce(grads(world, n, seed=s))
    snap = pickle.loads(pickle.dumps(a.state_dict()))
    b = SimulatedWorkers(codec, world)
    b.load_state_dict(snap)
    for s in range(3, 6):
        assert torch.equal(a.reduce(grads(world, n, seed=s)), b.reduce(grads(world, n, seed=s)))
    with pytest.raises(ValueError):
        SimulatedWorkers("int8", world + 1).load_state_dict(snap)


def test_warmup_and_small_buckets_are_plain_averages():
    world = 3
    sim = SimulatedWorkers("topk:0.01", world, warmup_steps=2, min_compress_numel=100)
    gs = grads(world, 500)
    plain = sum(g / world for g in gs)
    assert torch.equal(sim.reduce(gs), plain) and sim.stats["compressed_buckets"] == 0
    assert torch.equal(sim.reduce(gs), plain)
    assert not torch.equal(sim.reduce(gs), plain) and sim.stats["compressed_buckets"] == 1
    small = grads(world, 99)
    assert torch.equal(sim.reduce(small, bucket_index=1), sum(g / world for g in small))


@pytest.mark.parametrize("world", [2, 3])
def test_a_warmup_codec_carries_the_warmup_without_feedback(world):
    """bf16 warm-up steps: the float64 average of the gradients to bf16's rounding (each rank's
    g / W rounded once, their sum rounded once), no residual, a 16-bit all-reduce's bytes; the
    codec's steps after it are those of an fp32 warm-up bit for bit (no state carries over)."""
    n, warm = 4099, 2
    sim = SimulatedWorkers("sign", world, warmup_steps=warm, warmup_codec="bf16")
    plain = SimulatedWorkers("sign", world, warmup_steps=warm)
    for step in range(warm + 2):
        gs = grads(world, n, seed=step)
        got, want = sim.reduce(gs), plain.reduce(gs)
        if step < warm:
            exact = sum(g.double() for g in gs) / world
            bound = 2 * 2.0 ** -8 * sum(g.double().abs() for g in gs) / world
            assert ((got.double() - exact).abs() <= bound).all()
            assert not torch.equal(got, want)  # it is not the fp32 average
            assert all(float(r.abs().max()) == 0 for r in sim.residuals())
            bf16 = torch.classes.gradzip.BucketReduction("bf16", world, 0, [n], gs[0])
            assert sim.stats["bytes_sent"] == bf16.traffic()[0]
            assert sim.stats["bytes_sent"] < 0.6 * plain.stats["bytes_sent"]
        else:
            assert torch.equal(got, want) and sim.stats == plain.stats


def test_a_warmup_codec_needs_a_warmup_and_a_valid_spec():
    with pytest.raises(ValueError, match="warmup_steps"):
        SimulatedWorkers("sign", 2, warmup_codec="bf16")
    with pytest.raises(ValueError, match="zstd"):
        SimulatedWorkers("sign", 2, warmup_steps=1, warmup_codec="zstd")


def test_stats_count_the_wire_bytes():
    world, n = 4, 10000
    sim = SimulatedWorkers("int8", world)
    sim.reduce(grads(world, n))
    st = sim.stats
    # every payload travels in a 16-byte aligned slot (the CUDA decoders need aligned payloads)
    e = lambda n, spec: wire.message_slot_bytes(gradzip.encoded_bytes(n, spec))  # noqa: E731
    shard = n // world
    assert st["bytes_sent"] == 3 * e(shard, "int8") + 3 * e(shard, "int8")
    assert st["raw_bytes"] == 2 * 3 * 4 * n // 4
    assert 3.5 < st["compression_ratio"] < 4.0
    topk = torch.classes.gradzip.BucketReduction("topk:0.01", world, 0, [n], torch.zeros(1))
    assert topk.traffic() == (3 * e(n, "topk:0.01"),) * 2


def test_nonfinite_step_keeps_residuals():
    world, n = 2, 300
    sim = SimulatedWorkers("int8:block=32", world)
    sim.reduce(grads(world, n, seed=1))
    before = sim.state_dict()["workers"]
    bad = grads(world, n, seed=2)
    bad[1][17] = float("inf")
    out = sim.reduce(bad)
    assert not torch.isfinite(out).all()
    after = sim.state_dict()["workers"]
    for wb, wa in zip(before, after):
        for i in wb:
            assert torch.equal(wb[i]["residual"], wa[i]["residual"])
    assert torch.isfinite(sim.reduce(grads(world, n, seed=3))).all()


def test_residuals_reset_when_the_bucket_changes_size():
    sim = SimulatedWorkers("sign", 2)
    sim.reduce(grads(2, 1000))
    sim.reduce(grads(2, 800))  # DDP rebuilt its buckets: bucket 0 now has another size
    assert sim.state_dict()["workers"][0][0]["residual"].numel() == 800


def test_compression_state_validates_and_pickles_without_group():
    with pytest.raises(ValueError, match="spec"):
        CompressionState("int7")
    with pytest.raises(TypeError):
        CompressionState(8)
    st = CompressionState("topk:0.01", process_group=object(), warmup_steps=3)
    st2 = pickle.loads(pickle.dumps(st))
    assert st2.process_group is None and st2.codec == st.codec and st2.config.warmup_steps == 3
    with pytest.raises(ValueError, match="codec"):
        CompressionState("int8").load_state_dict(st.state_dict())


def test_bad_gradient_lists():
    sim = SimulatedWorkers("int8", 2)
    with pytest.raises(ValueError):
        sim.reduce(grads(3, 10))
    with pytest.raises(ValueError):
        sim.reduce([torch.zeros(10), torch.zeros(11)])
    with pytest.raises(ValueError):
        SimulatedWorkers("int8", 0)


def test_a_step_spans_buckets_and_an_overflow_anywhere_voids_all_residual_updates():
    world = 2
    sim = SimulatedWorkers("int8:block=32", world)
    sim.reduce(grads(world, 200, seed=1), bucket_index=0, is_last=False)
    sim.reduce(grads(world, 100, seed=2), bucket_index=1, is_last=True)
    assert sim.step == 1 and sim.stats["buckets"] == 2
    before = sim.state_dict()["workers"]
    sim.reduce(grads(world, 200, seed=3), bucket_index=0, is_last=False)  # finite
    bad = grads(world, 100, seed=4)
    bad[0][3] = float("nan")
    sim.reduce(bad, bucket_index=1, is_last=True)
    after = sim.state_dict()["workers"]
    assert sim.step == 2
    for wb, wa in zip(before, after):
        for i in (0, 1):
            assert torch.equal(wb[i]["residual"], wa[i]["residual"]), "bucket 0 must be undone too"


def test_sign_blocks_restart_at_tensor_boundaries():
    """Two workers with the same gradient, no error feedback: each shard's tensor pieces are
    scaled on their own, so a small tensor next to a large one keeps its own scale. Reference:
    float64, written here (shards split at n/2, blocks of 1024 from each piece's start)."""
    numels = [1500, 96, 700, 2000]  # a 96-element tensor 1000x smaller than its neighbours
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(m, generator=g) * (1e-3 if m == 96 else 1.0) for m in numels]
    x = torch.cat(parts)
    n = x.numel()
    out = SimulatedWorkers("sign", 2, error_feedback=False).reduce([x, x], numels=numels)
    tensor_starts = [0, 1500, 1596, 2296]
    want = torch.empty(n, dtype=torch.float64)
    half = (n + 1) // 2
    for lo, hi in ((0, half), (half, n)):
        cuts = sorted({lo, hi, *(t for t in tensor_starts if lo < t < hi)})
        for a, b in zip(cuts[:-1], cuts[1:]):
            for s in range(a, b, 1024):
                e = min(s + 1024, b)
                block = x[s:e].double()
                scale = block.abs().mean()
                want[s:e] = torch.where(block < 0, -scale, scale)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=0)
    small = out[1500:1596].abs()
    assert small.max() < 1e-2  # with blocks across the boundary it took the big tensor's scale


@pytest.mark.parametrize("codec", ["int8", "sign", "topk:0.1"])
def test_keys_make_the_state_follow_parameters_across_a_rebucketing(codec):
    """A bucket of parameters a and b, then (as after DDP's rebuild) b and a in another order:
    given parameter keys, the second step starts from each parameter's residual of the first,
    as a simulation loaded with those residuals moved by hand; keyed by bucket (the default), the
    residuals start over and the result differs."""
    na, nb, world = 600, 300, 2
    first, second = grads(world, na + nb, seed=1), grads(world, na + nb, seed=2)
    keyed = SimulatedWorkers(codec, world)
    keyed.reduce(first, numels=[na, nb], keys=["a", "b"])
    saved = keyed.state_dict()
    out = keyed.reduce(second, numels=[nb, na], keys=["b", "a"])

    by_hand = SimulatedWorkers(codec, world)
    for store in saved["workers"]:
        res = store[0]["residual"]
        store[0].update(layout=(na + nb, (("b", (nb,)), ("a", (na,)))),
                        residual=torch.cat([res[na:], res[:na]]))
    by_hand.load_state_dict(saved)
    assert torch.equal(out, by_hand.reduce(second, numels=[nb, na], keys=["b", "a"]))

    by_bucket = SimulatedWorkers(codec, world)
    by_bucket.reduce(first, numels=[na, nb])
    assert not torch.equal(out, by_bucket.reduce(second, numels=[nb, na]))


def test_zero_size_tensors_carry_nothing():
    """Zero-size tensors in a bucket (nn.Linear(n, 0)) change nothing: the same result and state
    as the bucket without them."""
    gs = grads(2, 500, seed=3)
    with_zeros, without = SimulatedWorkers("int8", 2), SimulatedWorkers("int8", 2)
    for _ in range(2):
        a = with_zeros.reduce(gs, numels=[0, 200, 0, 300, 0])
        assert torch.equal(a, without.reduce(gs, numels=[200, 300]))
    assert torch.equal(with_zeros.residuals()[0], without.residuals()[0])


# ---- tensors sent uncompressed (uncompressed_numel) ---------------------------------------------
# A 35-element weight (shorter than a piece: fp32 whatever the option) beside a 70-element bias
# (compressed without the option), two weights of 150 and 80, a 12-element weight (fp32, shorter
# than a piece), a 4-element bias. With uncompressed_numel 10: the biases travel in fp32 too.
SHAPES = [(5, 7), (70,), (3, 50), (2, 40), (3, 4), (4,)]


def padded(message):
    return torch.cat([message, torch.zeros(wire.message_slot_bytes(message.numel()) - message.numel(),
                                           dtype=torch.uint8)])


@pytest.mark.parametrize("spec", ["int8:block=32", "sign:block=64"])
def test_uncompressed_tensors_are_fp32_messages_of_their_own(spec):
    """One rank's send buffer (W = 1: one shard, prescale 1): every compressed tensor encoded alone
    as a bucket of only that tensor would be, its blocks restarting at its start; the biases and
    the tensors shorter than a piece as fp32 messages, neighbours in one; one 16-byte aligned slot
    each."""
    numels = [math.prod(s) for s in SHAPES]
    x = torch.randn(sum(numels), generator=torch.Generator().manual_seed(3))
    exact = [False, True, False, False, False, True]
    red = torch.classes.gradzip.BucketReduction(spec, 1, 0, numels, x, "wire", exact)
    red.encode(x, None)
    a, b, c, d, e, f = x.split(numels)
    want = [gradzip.encode(torch.cat([a, b]), "fp32"), gradzip.encode(c, spec),
            gradzip.encode(d, spec), gradzip.encode(torch.cat([e, f]), "fp32")]
    assert torch.equal(red.send(), torch.cat([padded(m) for m in want]))


@pytest.mark.parametrize("world", [2, 3])
def test_stats_count_the_uncompressed_tensors(world):
    """The bytes stats report are the buffers the exchange moves: rank 0's all-to-all send buffer
    less its own shard, and W - 1 all-gather slots; the fp32 tensors cost more than int8."""
    numels = [math.prod(s) for s in SHAPES]
    gs = grads(world, sum(numels))
    sent = {}
    for u in (0, 10):
        sim = SimulatedWorkers("int8", world, uncompressed_numel=u)
        sim.reduce(gs, shapes=SHAPES)
        [rank0, *_] = next(iter(sim._reductions.values()))
        splits = rank0.send_splits()
        slot = rank0.gather_in().numel()
        assert sim.stats["bytes_sent"] == sum(splits) - splits[0] + (world - 1) * slot
        assert sim.stats["bytes_received"] == (world - 1) * (splits[0] + slot)
        sent[u] = sim.stats["bytes_sent"]
    assert sent[10] > sent[0]


def test_uncompressed_numel_is_off_by_default_and_ignored_elsewhere():
    """0 sends everything compressed; tensors given by numels count as 1-D; other codecs are not
    affected (fp32 and the casts carry every element already, top-k selects over the bucket)."""
    world, numels = 2, [math.prod(s) for s in SHAPES]
    gs = grads(world, sum(numels))
    plain = SimulatedWorkers("int8", world).reduce(gs, shapes=SHAPES)
    assert torch.equal(plain, SimulatedWorkers("int8", world).reduce(gs, numels=numels))
    as_1d = SimulatedWorkers("int8", world, uncompressed_numel=1).reduce(gs, numels=numels)
    assert torch.equal(as_1d, SimulatedWorkers("fp32", world).reduce(gs))
    for spec in ("fp16", "topk:0.1"):
        assert torch.equal(SimulatedWorkers(spec, world).reduce(gs, shapes=SHAPES),
                           SimulatedWorkers(spec, world, uncompressed_numel=10)
                           .reduce(gs, shapes=SHAPES))
    with pytest.raises(ValueError, match="uncompressed_numel"):
        SimulatedWorkers("int8", world, uncompressed_numel=-1)


def test_the_in_memory_exchange_takes_the_ranks_of_one_bucket_in_rank_order():
    """The W reductions the simulation hands to the in-memory exchange: ranks 0..W-1 in order, of
    one codec and layout (lowrank's too), one tensor of each kind per rank; anything else is a
    ValueError before a byte moves."""
    x = torch.randn(300)
    ranks = [torch.classes.gradzip.BucketReduction("int8", 2, r, [300], x) for r in range(2)]
    outs = [torch.empty(300) for _ in range(2)]
    none = [None] * 2
    reduce = torch.ops.gradzip.reduce_in_memory
    with pytest.raises(ValueError, match="rank order"):
        reduce(ranks[::-1], [x, x], none, none, none, outs)
    other = torch.classes.gradzip.BucketReduction("sign", 2, 1, [300], x)
    with pytest.raises(ValueError, match="codec and layout"):
        reduce([ranks[0], other], [x, x], none, none, none, outs)
    with pytest.raises(ValueError, match="per rank"):
        reduce(ranks, [x], none, none, none, outs)
    lowrank = [torch.classes.gradzip.BucketReduction("lowrank:2", 2, r, numels, x, rows=[10])
               for r, numels in enumerate(([300], [290]))]
    with pytest.raises(ValueError, match="codec and layout"):
        reduce(lowrank, [x, x], none, none, [torch.zeros(60)] * 2, outs)
    with pytest.raises(ValueError, match="codec and layout"):
        reduce([ranks[0], lowrank[1]], [x, x], none, none, none, outs)
