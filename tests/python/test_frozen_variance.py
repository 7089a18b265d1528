"""gradzip.optim.FrozenVarianceAdamW: one Adam state, the same on every rank; AdamW on the exact
average during the compression's warm-up, then each rank's candidate momentum compressed with error
feedback and the variance frozen. Checked against a float64 Adam written here, on simulated
workers and on 2 and 3 real Gloo ranks beside a no-hook DDP twin running torch's AdamW."""
import os

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from gradzip.ddp import CompressionState, compress_hook
from gradzip.simulation import SimulatedWorkers
from gradzip.optim import FrozenVarianceAdamW


def make_sim(codec, world, warmup, betas=(0.9, 0.999), eps=1e-8, **kw):
    opt = FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(1))], betas=betas, eps=eps)
    return SimulatedWorkers(codec, world, warmup_steps=warmup, min_compress_numel=0,
                            optimizer=opt, **kw)


class Float64FrozenVarianceAdam:
    """The reference, in float64, for 2 workers and a lossless codec: on an exact step AdamW of the
    mean gradient (v's bias correction counting the exact steps only); on the others each worker's
    b1 m + (1 - b1) g over the denominator sqrt(v_hat) + eps of the last exact step, clipped to
    Adam's largest step (1 - b1) / sqrt(1 - b2), averaged into m (times the denominator)."""

    def __init__(self, n, b1, b2, eps):
        self.b1, self.b2, self.eps = b1, b2, eps
        self.bound = (1 - b1) / (1 - b2) ** 0.5
        self.m = torch.zeros(n, dtype=torch.float64)
        self.v = torch.zeros(n, dtype=torch.float64)
        self.t = self.updates = self.clipped = 0

    def step(self, grads, exact: bool) -> torch.Tensor:
        b1, b2, eps = self.b1, self.b2, self.eps
        self.t += 1
        if exact:
            self.updates += 1
            mean = (grads[0].double() + grads[1].double()) / 2
            self.m = b1 * self.m + (1 - b1) * mean
            self.v = b2 * self.v + (1 - b2) * mean ** 2
            v_hat = self.v / (1 - b2 ** self.updates)
            return (self.m / (1 - b1 ** self.t)) / (v_hat.sqrt() + eps)
        denom = (self.v / (1 - b2 ** self.updates)).sqrt() + eps
        sent = [((b1 * self.m + (1 - b1) * x.double()) / denom) for x in grads]
        self.clipped += sum(int((s.abs() > self.bound).sum()) for s in sent)
        u = sum(s.clamp(-self.bound, self.bound) for s in sent) / 2
        self.m = u * denom
        return u / (1 - b1 ** self.t)


def test_against_a_float64_frozen_variance_adam():
    """Lossless codec, 2 workers: AdamW of the mean gradient for the warm-up steps; then the
    momentum over the denominator frozen at the end of the warm-up (Float64FrozenVarianceAdam).
    Gradient scales span 1e-3..1e2, so some coordinates are clipped."""
    b1, b2, eps, n, warmup = 0.8, 0.95, 1e-6, 1001, 3
    sim = make_sim("fp32", 2, warmup, betas=(b1, b2), eps=eps)
    ref = Float64FrozenVarianceAdam(n, b1, b2, eps)
    g = torch.Generator().manual_seed(5)
    for t in range(1, 9):
        grads = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g)
                 for _ in range(2)]
        want = ref.step(grads, exact=t <= warmup)
        got = sim.reduce(grads)
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-6)
    assert ref.clipped > 0  # the clip is exercised


def test_variance_refreshes_against_a_float64_adam():
    """0/1 Adam's schedule (refresh_until, refreshes_per_doubling): after a 2-step warm-up, steps
    2, 3 (gap 1), 4, 6 (gap 2), 8, 12 (gap 4) average the gradient exactly and update m and v (v's
    bias correction counts its own updates), the others compress the momentum over the latest
    denominator; from refresh_until on, v stays frozen. Float64FrozenVarianceAdam, with the
    schedule spelled out."""
    b1, b2, eps, n, warmup = 0.8, 0.95, 1e-6, 777, 2
    exact = {0, 1, 2, 3, 4, 6, 8, 12}
    opt = FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(1))], betas=(b1, b2), eps=eps,
                              refresh_until=14, refreshes_per_doubling=2)
    assert opt.direction.refresh_steps(warmup) == exact - {0, 1}
    sim = SimulatedWorkers("fp32", 2, warmup_steps=warmup, min_compress_numel=0, optimizer=opt)
    ref = Float64FrozenVarianceAdam(n, b1, b2, eps)
    g = torch.Generator().manual_seed(6)
    for step in range(18):
        grads = [torch.randn(n, generator=g) * (1 + step % 3) for _ in range(2)]
        want = ref.step(grads, exact=step in exact)
        assert sim.config.compresses(step, n, 2) == (step not in exact)
        torch.testing.assert_close(sim.reduce(grads).double(), want, rtol=2e-5, atol=1e-6)


def test_a_coordinate_silent_through_the_warmup_steps_at_most_adams_bound():
    """v = 0 for a coordinate whose gradient was zero through the warm-up (a dead ReLU unit): its
    first gradient after the freeze moves it by at most (1 - b1) / sqrt(1 - b2) (over the
    momentum's bias correction), Adam's largest step, not by gradient / eps."""
    warmup, steps = 40, 42
    sim = make_sim("fp32", 2, warmup=warmup)
    for step in range(steps):
        g = torch.full((64,), 0.01)
        g[7] = 5.0 if step >= warmup else 0.0
        out = sim.reduce([g, g])
    bound = 0.1 / 0.001 ** 0.5 / (1 - 0.9 ** steps)
    assert bound / 2 < float(out[7]) <= bound * (1 + 1e-6)
    assert float(out[0]) == pytest.approx(1.0, rel=0.05)  # a steady coordinate: Adam's unit step


@pytest.mark.parametrize("codec", ["sign", "topk:0.05", "int8"])
def test_every_worker_holds_the_same_optimizer_state(codec):
    world, n = 3, 3001
    sim = make_sim(codec, world, warmup=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        out = sim.reduce([torch.randn(n, generator=g) for _ in range(world)], numels=[1000, 2001])
        assert torch.isfinite(out).all()
    workers = sim.state_dict()["workers"]
    for w in workers[1:]:
        for a, b in zip(workers[0][0]["moments"], w[0]["moments"]):
            assert torch.equal(a, b)
    # the worker residuals are each rank's own, and error feedback is on
    assert not torch.equal(workers[0][0]["residual"], workers[1][0]["residual"])


def test_lowrank_momentum_keeps_one_state():
    """lowrank:R compresses the candidate momentum as it compresses a gradient (power iteration with
    error feedback): the moments stay identical on every worker, the residuals are each one's."""
    world, shapes = 3, [(40, 25), (64,), (30, 100)]
    sim = make_sim("lowrank:2", world, warmup=2)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        out = sim.reduce([torch.randn(4064, generator=g) for _ in range(world)], shapes=shapes)
        assert torch.isfinite(out).all()
    assert sim.stats["compression_ratio"] > 3
    workers = sim.state_dict()["workers"]
    for w in workers[1:]:
        for a, b in zip(workers[0][0]["moments"], w[0]["moments"]):
            assert torch.equal(a, b)
    assert not torch.equal(workers[0][0]["residual"], workers[1][0]["residual"])


def test_resume_from_state_dict_is_exact():
    def run(split):
        sim = make_sim("sign", 2, warmup=2)
        g = torch.Generator().manual_seed(2)
        outs = []
        for step in range(7):
            if step == split:
                saved = sim.state_dict()
                sim = make_sim("sign", 2, warmup=2)
                sim.load_state_dict(saved)
            outs.append(sim.reduce([torch.randn(999, generator=g) for _ in range(2)]))
        return outs

    for a, b in zip(run(None), run(4)):
        assert torch.equal(a, b)


def test_needs_a_warmup():
    opt = FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="warmup_steps"):
        SimulatedWorkers("sign", 2, optimizer=opt)
    with pytest.raises(ValueError, match="warmup_steps"):
        CompressionState("sign", optimizer=FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(1))]))


# ---- DDP on real Gloo ranks -------------------------------------------------------------------
WARMUP, STEPS = 3, 7


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 40, generator=g), torch.randn(16, 8, generator=g)


def _train_ranks(rank, world, outdir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    result = {}
    for name in ("gradzip", "bf16_warmup", "lowrank", "int8_refresh", "twin"):
        model = _model()
        ddp = DDP(model, bucket_cap_mb=0.004)
        if name != "twin":
            # int8_refresh: 0/1 Adam's schedule, variance refreshes at steps 1, 2, 3 (gaps 1, 1)
            # and 5 (gap 2) after a 1-step warm-up, all in two-phase int8
            refresh = {"refresh_until": 6, "refreshes_per_doubling": 2} \
                if name == "int8_refresh" else {}
            opt = FrozenVarianceAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, **refresh)
            codec = "lowrank:2" if name == "lowrank" else "sign"
            warmup_codec = {"bf16_warmup": "bf16", "int8_refresh": "int8"}.get(name)
            state = CompressionState(codec, warmup_steps=1 if refresh else WARMUP,
                                     min_compress_numel=32, optimizer=opt,
                                     warmup_codec=warmup_codec)
            ddp.register_comm_hook(state, compress_hook)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        params = []
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(step, rank)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            params.append([p.detach().clone() for p in model.parameters()])
            if name != "twin":
                result.setdefault(f"{name}_stats", []).append(state.stats)
        result[name] = params
        if name != "twin":
            result[f"{name}_state"] = state.state_dict()
        del ddp
    dist.barrier()
    torch.save(result, os.path.join(outdir, f"fva_{rank}.pt"))


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_replicas_and_states_identical_and_warmup_is_adamw(world, tmp_path):
    """With the warm-up in fp32 and in bf16 (warmup_codec: the backend's bf16 sum gives every
    rank the same average, so the one state stays identical), with lowrank:2 carrying the
    momentum (two all-reduces of its factors), and with 0/1 Adam's variance refreshes in int8
    (exact steps between compressed ones; the two-phase int8 average is the same on every
    rank)."""
    run_ranks(_train_ranks, world, str(tmp_path), timeout=240)
    runs = [torch.load(tmp_path / f"fva_{r}.pt", weights_only=False) for r in range(world)]
    for name in ("gradzip", "bf16_warmup", "lowrank", "int8_refresh"):
        for r in range(1, world):
            for a, b in zip(runs[0][name][-1], runs[r][name][-1]):
                assert torch.equal(a, b), f"{name}: replica {r} differs"
            for i, bucket in runs[0][f"{name}_state"]["residuals"].items():
                other = runs[r][f"{name}_state"]["residuals"][i]
                assert all(torch.equal(a, b) for a, b in zip(bucket["moments"], other["moments"]))
        # then the momentum is compressed (sign: ~30x fewer bytes than fp32; lowrank:2 of these
        # small matrices, with the 1-D tensors in fp32: ~4x) and training goes on
        assert runs[0][f"{name}_stats"][-1]["compression_ratio"] > (3 if name == "lowrank" else 10)
        assert all(torch.isfinite(p).all() for p in runs[0][name][-1])
    # the warm-up steps are AdamW on the averaged gradient: to fp32 rounding of the sums; in bf16,
    # to its rounding of the gradients, except where the average nearly cancels (Adam's first
    # steps move every coordinate by about lr, whatever its size: a sign flipped by rounding
    # costs up to 2 lr per step, on a few coordinates)
    lr = 1e-2
    flat = {k: torch.cat([p.reshape(-1) for p in runs[0][k][WARMUP - 1]])
            for k in ("gradzip", "bf16_warmup", "twin")}
    torch.testing.assert_close(flat["gradzip"], flat["twin"], rtol=1e-4, atol=1e-5)
    off = (flat["bf16_warmup"] - flat["twin"]).abs()
    assert 0 < float(off.max()) <= 2 * lr * WARMUP
    assert float((off > 0.05 * lr).float().mean()) < 0.02
    assert runs[0]["gradzip_stats"][WARMUP - 1]["compression_ratio"] == 1.0
    assert 1.9 < runs[0]["bf16_warmup_stats"][WARMUP - 1]["compression_ratio"] <= 2.0
    # the warm-up and the refreshes (steps 0-3, 5) travel in int8 (~3.5x), the others in sign
    ratios = [st["compression_ratio"] for st in runs[0]["int8_refresh_stats"]]
    assert [r < 5 for r in ratios] == [True, True, True, True, False, True, False], ratios
