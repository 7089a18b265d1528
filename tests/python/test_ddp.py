"""The DDP hook on real multi-process Gloo (CPU), world sizes 2 and 3, pinning the hook's
invariants: bitwise-identical replicas, the hook equals SimulatedWorkers (the single-process
reference of the same algorithm) bit for bit, agreement with PyTorch's fp16_compress_hook, AMP
overflow steps, checkpoint/resume, mismatched configurations, unused parameters with
gradient_as_bucket_view, and the bucket rebuild (iterations 1-3, static_graph on and off)."""

import os

import pytest
import torch

import ddp_scenarios as sc
from dist_util import run_ranks
from gradzip.simulation import SimulatedWorkers

CODECS = ["fp32", "fp16", "bf16", "int8", "sign:block=64", "topk:0.1", "topk:0.05:values=fp16",
          "topk:0.05:values=int8"]


def load(outdir, name, world):
    return [torch.load(os.path.join(outdir, f"{name}_{r}.pt"), weights_only=False) for r in range(world)]


def check_replicas_and_reference(runs, codec, world, min_numel=32, warmup=0, optimizer=None,
                                 cast_sum=None, uncompressed_numel=0,
                                 residual_dtype=torch.float32):
    """Replicas bitwise identical; every bucket's reduced value equals SimulatedWorkers fed with
    the ranks' local bucket gradients (and, with a gradzip.optim ``optimizer``, computing the same
    updates). Uncompressed steps are the backend's fp32 all-reduce, whose summation order for
    W >= 3 is not the simulation's: they agree to rounding, and FrozenVarianceAdamW's one state,
    updated from those averages, carries the last-bit difference on, so with it the compressed
    steps are compared bit for bit at W = 2 only (where a sum of two is the same either way), and
    above that on 99 % of the elements (the rest sit on a rounding boundary of the codec).
    fp32/fp16/bf16 summed on the wire by Gloo: to the wire dtype's rounding of the W-term sum
    (test_cast_allreduce.py has the 16-bit casts' float64 reference)."""
    for r in range(1, world):
        for a, b in zip(runs[0]["params"], runs[r]["params"]):
            assert torch.equal(a, b), f"{codec}: replica {r} differs from replica 0"
    # records arrive in completion order, which differs between ranks: order by (step, bucket)
    recs = [sorted(run["records"], key=lambda rec: rec[0][:2]) for run in runs]
    assert len(recs[0]) > 0 and all(len(x) == len(recs[0]) for x in recs)
    opt = None if optimizer is None else sc.make_optimizer(optimizer, [torch.nn.Parameter(torch.zeros(1))])
    sim = SimulatedWorkers(codec, world, min_compress_numel=min_numel, warmup_steps=warmup,
                           optimizer=opt, cast_sum=cast_sum, uncompressed_numel=uncompressed_numel,
                           residual_dtype=residual_dtype)
    state_from_averages = opt is not None and opt.direction.needs_warmup and world > 2
    layouts = set()
    for k, (key, _, out0, params) in enumerate(recs[0]):
        step, index, layout = key
        layouts.add((index, layout))
        for r in range(1, world):
            assert recs[r][k][0] == key
            assert torch.equal(recs[r][k][2], out0), f"{codec}: rank {r} bucket {index} differs"
        sim.step = step  # warm-up policy follows the hook's step count
        expected = sim.reduce([recs[r][k][1] for r in range(world)], bucket_index=(index, layout),
                              shapes=list(layout) or None, keys=params or None)
        if step < warmup or out0.numel() < max(min_numel, world):
            # plain fp32 all-reduce: the backend's summation order, equal to fp32 rounding (an
            # Adam update divides it by sqrt(v), which magnifies it where v is small)
            tol = (1e-4, 1e-6) if opt is not None and opt.direction.needs_warmup else (1e-6, 1e-7)
            if not state_from_averages or step == 0:
                torch.testing.assert_close(out0, expected, rtol=tol[0], atol=tol[1])
        elif state_from_averages:
            # the one state carries the warm-up's last-bit difference: the codec's rounding can
            # differ where a value sits on a decision boundary (a sign, an int8 step), and only there
            near = (out0 - expected).abs() <= 1e-4 * float(expected.abs().max())
            assert float(near.float().mean()) >= 0.99, f"{codec}: step {step} bucket {index}"
        elif sim.config.plan.wire_sum:
            # |payload| <= (1 + u) |g| / W; each sum, Gloo's and the simulation's, within (W-1) u
            u = {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}[codec]
            mag = sum(recs[r][k][1].double().abs() for r in range(world)) / world
            err = (out0.double() - expected.double()).abs()
            assert (err <= 2.1 * (world - 1) * u * mag + world * 2.0 ** -24).all(), codec
        else:
            assert torch.equal(out0, expected), f"{codec}: step {step} bucket {index}: hook != simulation"
        # and it is an average of the local gradients, within the codec's error
        mean = torch.stack([recs[r][k][1] for r in range(world)]).double().mean(0)
        assert torch.isfinite(out0).all()
        if codec in ("fp32",):
            torch.testing.assert_close(out0.double(), mean, rtol=1e-5, atol=1e-7)
    return layouts


TRAIN = [(f"{codec.replace(':', '_')}_{int(static)}", {"codec": codec, "static_graph": static, "steps": 4})
         for codec in CODECS for static in (False, True)]
TRAIN.append(("warmup", {"codec": "int8", "warmup": 2, "steps": 4}))  # then compression starts
TRAIN += [(f"{codec.split(':')[0]}_fp32sum", {"codec": codec, "cast_sum": "fp32", "steps": 4})
          for codec in ("fp32", "fp16", "bf16", "topk:0.1")]  # the two-phase sum (top-k: the
# owner's top-k of it, with its owner residual): equal to the simulation bit for bit
# biases and the 40x7 weight in fp32 beside compressed weights
TRAIN += [(f"{codec.split(':')[0]}_uncompressed", {"codec": codec, "uncompressed_numel": 300,
                                                    "steps": 4})
          for codec in ("int8", "sign:block=64")]
# the compact residual (bfloat16): the worker's, and top-k's owner residual in its two-phase sum
TRAIN += [(f"{codec.split(':')[0]}_compact", {"codec": codec, "residual_dtype": torch.bfloat16,
                                               "steps": 4, **extra})
          for codec, extra in (("int8", {}), ("sign:block=64", {}),
                               ("topk:0.1", {"cast_sum": "fp32"}))]
DIRECTION = [("adamw_sign", {"codec": "sign:block=64", "optimizer": "adamw", "steps": 4}),
             ("sgd_topk", {"codec": "topk:0.1", "optimizer": "sgd", "steps": 4}),
             ("dgc_topk", {"codec": "topk:0.1:values=fp16", "optimizer": "dgc", "steps": 4}),
             ("adamw_int8_warmup", {"codec": "int8", "optimizer": "adamw", "warmup": 2, "steps": 4})]
UNUSED = [(f"unused_{c.split(':')[0]}", {"codec": c, "unused_branch": True, "find_unused": True,
                                          "bucket_view": True, "steps": 3})
          for c in ("int8", "topk:0.1", "bf16")]
OVERFLOW = ["int8", "topk:0.1"]
CKPT = ["int8", "topk:0.1", "sign"]
PICKLE = [(codec, opt) for codec in ("int8", "sign", "topk:0.01") for opt in (None, "adamw", "sgd")]
MISMATCH = {2: ["int8", "topk:0.01"], 3: ["sign", "sign", "sign:block=512"]}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def session(request, tmp_path_factory):
    """One set of W spawned Gloo ranks runs every scenario (spawning costs seconds per rank); the
    tests below check what they recorded."""
    world = request.param
    outdir = tmp_path_factory.mktemp(f"ddp{world}")
    plan = [("train", (TRAIN + UNUSED + DIRECTION,)), ("fp16_vs_pytorch", ()), ("overflow", (OVERFLOW,)),
            ("overflow_compact", (OVERFLOW,)),
            ("checkpoint_resume", (CKPT,)), ("pickle_resume", (PICKLE,)),
            ("mismatched", (MISMATCH[world],))]  # last: it leaves a DDP mid-backward
    run_ranks(sc.session, world, str(outdir), plan, timeout=240)
    return world, outdir


@pytest.mark.parametrize("name,cfg", TRAIN, ids=[n for n, _ in TRAIN])
def test_replicas_identical_and_equal_to_simulation_across_rebuild(session, name, cfg):
    world, outdir = session
    runs = load(outdir, name, world)
    layouts = check_replicas_and_reference(runs, cfg["codec"], world, warmup=cfg.get("warmup", 0),
                                           cast_sum=cfg.get("cast_sum"),
                                           uncompressed_numel=cfg.get("uncompressed_numel", 0),
                                           residual_dtype=cfg.get("residual_dtype", torch.float32))
    if "residual_dtype" in cfg:
        kept = [v["residual"] for run in runs for v in run["residuals"].values()]
        assert kept and all(t.dtype == cfg["residual_dtype"] for t in kept), name
    # iterations 1-3 crossed DDP's bucket rebuild: one bucket first, several afterwards
    assert len({index for index, _ in layouts}) > 1, name
    stats = [run["stats"] for run in runs]
    last = stats[0][-1]
    assert last["step"] == cfg["steps"] - 1 and last["bytes_sent"] > 0
    if cfg["codec"] != "fp32" and "warmup" not in cfg:
        assert last["compression_ratio"] > 1.5, (name, last)
    if "warmup" in cfg:
        assert stats[0][0]["compressed_buckets"] == 0 and stats[0][3]["compressed_buckets"] > 0


def test_uncompressed_tensors_are_counted(session):
    """The hook's stats count the fp32 tensors: more bytes than the same steps all in int8 (the
    bytes themselves: test_simulated.py's buffers, the same C++ layout)."""
    world, outdir = session
    fp32_beside = load(outdir, "int8_uncompressed", world)[0]["stats"][-1]
    all_int8 = load(outdir, "int8_0", world)[0]["stats"][-1]
    assert fp32_beside["raw_bytes"] == all_int8["raw_bytes"]
    assert fp32_beside["bytes_sent"] > all_int8["bytes_sent"]


@pytest.mark.parametrize("name,cfg", DIRECTION, ids=[n for n, _ in DIRECTION])
def test_optimizer_direction_equals_simulation(session, name, cfg):
    """With a gradzip.optim optimizer the hook compresses each rank's direction; replicas stay
    identical and every bucket equals SimulatedWorkers given the same optimizer kind."""
    world, outdir = session
    runs = load(outdir, name, world)
    check_replicas_and_reference(runs, cfg["codec"], world, warmup=sc.config_warmup(cfg),
                                 optimizer=cfg["optimizer"])
    assert all(torch.isfinite(p).all() for p in runs[0]["params"])


@pytest.mark.parametrize("name,cfg", UNUSED, ids=[n for n, _ in UNUSED])
def test_unused_parameters_with_gradient_as_bucket_view(session, name, cfg):
    world, outdir = session
    runs = load(outdir, name, world)
    check_replicas_and_reference(runs, cfg["codec"], world)
    names = [n for n, _ in sc.make_model(unused_branch=True).named_parameters()]
    for r in range(world):
        for n, g in zip(names, runs[r]["grads"]):
            if n.startswith("body"):
                assert g is not None and torch.isfinite(g).all()
                assert torch.equal(g, runs[0]["grads"][names.index(n)])


def test_fp16_agrees_with_pytorch_fp16_compress_hook(session):
    world, outdir = session
    runs = load(outdir, "fp16", world)
    for ours, theirs in zip(runs[0]["gradzip"], runs[0]["torch"]):
        scale = theirs.abs().max().item()
        # both all-reduce fp16 shares in fp16 (ours: fl32(g * fl32(1 / W)) rounded to fp16,
        # theirs: fp16(g) / W in fp16)
        torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3 * scale)
    for r in range(1, world):
        for a, b in zip(runs[0]["gradzip"], runs[r]["gradzip"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("compact", [False, True], ids=["fp32_residual", "compact"])
@pytest.mark.parametrize("codec", OVERFLOW)
def test_inf_gradient_reaches_gradscaler_and_residuals_survive(session, codec, compact):
    world, outdir = session
    runs = load(outdir, f"overflow{'_compact' if compact else ''}_{codec}", world)
    for r in range(world):
        log = runs[r]["log"]
        bad = log[2]
        assert not bad["finite"], "the Inf must reach the gradients on every rank"
        assert bad["params_unchanged"] and bad["scale_after"] < bad["scale_before"]
        assert bad["residuals_unchanged"], "an overflow step must not touch the residuals"
        for k in (0, 1, 3, 4):
            assert log[k]["finite"] and not log[k]["params_unchanged"], (r, k, log[k])
            assert log[k]["residuals_finite"]
        assert all(torch.isfinite(p).all() for p in runs[r]["params"])
        for a, b in zip(runs[0]["params"], runs[r]["params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("codec", CKPT)
def test_checkpoint_resume_reproduces_exactly(session, codec):
    world, outdir = session
    runs = load(outdir, f"ckpt_{codec}", world)
    for r in range(world):
        run = runs[r]
        for a, b in zip(run["uninterrupted"], run["resumed"]):
            assert torch.equal(a, b), "resume from the checkpoint diverged"
        assert run["unpickled_group_is_none"] and run["unpickled_step"] == 2
        assert run["saved_residuals"] and any(v.abs().sum() > 0 for v in run["saved_residuals"].values())
        for i, v in run["saved_residuals"].items():
            assert torch.equal(run["unpickled_residuals"][i], v)


@pytest.mark.parametrize("codec,optimizer", PICKLE, ids=[f"{c}-{o}" for c, o in PICKLE])
def test_pickled_state_resumes_exactly(session, codec, optimizer):
    """The hook's state object, saved and loaded (torch.save/pickle) and registered on a fresh DDP
    model, continues exactly as the uninterrupted run."""
    world, outdir = session
    for run in load(outdir, f"pickle_{codec}_{optimizer}", world):
        assert run["group_is_none"]
        for a, b in zip(run["uninterrupted"], run["resumed"]):
            assert torch.equal(a, b), f"{codec} {optimizer}: the unpickled state's run diverged"


def test_mismatched_codecs_fail_at_first_step(session):
    world, outdir = session
    codecs = MISMATCH[world]
    for r in range(world):
        with open(outdir / f"mismatch_{r}.txt") as f:
            msg = f.read()
        assert "configured differently" in msg, msg
        assert codecs[0].split(":")[0] in msg and "rank 1" in msg
