"""The recommended recipes inside the loops people write (gradient clipping, grad-norm logging,
fp16 GradScaler, an LR scheduler, a step without a reduction), in the simulation: each trains like
its no-hook twin or fails at the first step with an error that names the cause. The same loops on
real Gloo ranks: tests/python/test_training_loops_ddp.py."""
import math

import pytest
import torch

import ef_problem as ep
from gradzip.local_clip import LocalGradClip
from gradzip.optim import CompressedSGD, FrozenVarianceAdamW, compresses_direction
from gradzip.simulation import SimulatedWorkers

# Every codec and optimizer whose recipe is a gradzip.optim optimizer (p.grad holds its update).
DIRECTION_RECIPES = [(c, o) for c in ["fp16", "bf16", "int8", "sign", "topk:0.01"]
                     for o in ["sgd", "adamw"] if compresses_direction(c, o)]
CLIP = 0.5  # below the averaged gradient's norm on ef_problem at every step: clipping is active


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _one_step(codec, optimizer, edit=None, max_grad_norm=None, steps=1):
    """``steps`` steps of ef_problem's loop with the recipe and an LR scheduler (halving), with
    ``edit(params)`` between the reduction and step(). Returns the optimizer and the
    simulation."""
    x, y = ep.data(0)
    net = ep.model(0)
    params = list(net.parameters())
    opt = ep.make_optimizer(optimizer, params, compressed=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    sim = SimulatedWorkers(codec, ep.WORKERS, min_compress_numel=0, warmup_steps=1, optimizer=opt,
                           max_grad_norm=max_grad_norm)
    for step in range(steps):
        grads = []
        for w in range(ep.WORKERS):
            part = slice(8 * (step * ep.WORKERS + w), 8 * (step * ep.WORKERS + w + 1))
            g = torch.autograd.grad(torch.nn.functional.cross_entropy(net(x[part]), y[part]),
                                    params)
            grads.append(torch.cat([t.reshape(-1) for t in g]))
        avg = sim.reduce(grads, numels=[p.numel() for p in params])
        off = 0
        for p in params:
            p.grad = avg[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        if edit is not None:
            edit(params)
        opt.step()
        sched.step()
    return opt, sim


def _clip(params):  # below the norm of every step's gradient here: it always clips
    torch.nn.utils.clip_grad_norm_(params, 0.1)


def _unscale(params):  # what GradScaler.unscale_ does to the gradients
    for p in params:
        p.grad.mul_(1.0 / 65536.0)


def _log_norm(params):  # reads only
    torch.nn.utils.get_total_norm([p.grad for p in params])


@pytest.mark.parametrize("codec,optimizer", DIRECTION_RECIPES)
@pytest.mark.parametrize("edit", [_clip, _unscale], ids=["clip_grad_norm_", "gradscaler_unscale"])
def test_an_edit_of_the_update_fails_at_the_first_step(codec, optimizer, edit):
    with pytest.raises(RuntimeError, match="max_grad_norm=C"):
        _one_step(codec, optimizer, edit)


@pytest.mark.parametrize("codec,optimizer", DIRECTION_RECIPES)
def test_reading_the_gradients_and_a_scheduler_pass(codec, optimizer):
    def edit(params):
        _log_norm(params)
    opt, _ = _one_step(codec, optimizer, edit, steps=3)
    assert opt.param_groups[0]["lr"] == ep.LR[optimizer] * 0.5 ** 3


def test_a_step_without_a_reduction_fails():
    opt, sim = _one_step("sign", "adamw")
    with pytest.raises(RuntimeError, match="no compression hook reduced"):
        opt.step()  # the gradients of the last step again (a backward under no_sync, say)


def test_max_grad_norm_needs_an_optimizer_direction_and_a_positive_value():
    with pytest.raises(ValueError, match="clip_grad_norm_ clips it as usual"):
        SimulatedWorkers("int8", 2, max_grad_norm=1.0)
    p = torch.nn.Parameter(torch.ones(4))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
            SimulatedWorkers("sign", 2, warmup_steps=1, optimizer=FrozenVarianceAdamW([p]),
                             max_grad_norm=bad)


def test_grad_norm_is_each_workers_gradient_norm_before_clipping():
    _, sim = _one_step("sign", "adamw", max_grad_norm=CLIP, steps=1)
    x, y = ep.data(0)
    net = ep.model(0)  # rank 0's gradient at step 0, recomputed in float64
    net.double()
    g = torch.autograd.grad(torch.nn.functional.cross_entropy(net(x[:8].double()), y[:8]),
                            list(net.parameters()))
    want = math.sqrt(sum(float(t.square().sum()) for t in g))
    assert float(sim.grad_norm) == pytest.approx(want, rel=1e-5)
    assert want > CLIP  # the step above was clipped


def _reference_clip(buckets, last, max_norm, total):
    """float64: each bucket scaled to its share of max_norm (the previous step's squared norms
    ``last``, one per bucket or None, mixed 95/5 with the element count's share)."""
    out = []
    last_total = None if last is None else sum(last)
    for i, b in enumerate(buckets):
        b = b.double()
        size = b.numel() / total
        share = size if last is None else 0.95 * last[i] / last_total + 0.05 * size
        norm = float(b.norm())
        out.append(b * min(1.0, max_norm * math.sqrt(share) / norm))
    return out


def test_local_clip_against_a_float64_reference():
    gen = torch.Generator().manual_seed(3)
    sizes = [1001, 37, 4099, 5]
    layouts = [(n, ((i, (n,)),)) for i, n in enumerate(sizes)]
    total = sum(sizes)
    clip = LocalGradClip(2.0, total)
    last = None
    for step in range(4):
        scale = [0.1, 3.0, 1.0, 10.0] if step % 2 else [2.0, 0.01, 0.5, 1.0]
        buckets = [torch.randn(n, generator=gen) * s for n, s in zip(sizes, scale)]
        want = _reference_clip(buckets, last, 2.0, total)
        got = [b.clone() for b in buckets]
        for b, layout in zip(got, layouts):
            clip.clip_(b, layout)
        clip.end_step()
        for g, w in zip(got, want):
            assert torch.allclose(g.double(), w, rtol=1e-5, atol=0)
        # the shares add up to one: the rank's whole gradient stays within the norm
        assert math.sqrt(sum(float(g.double().square().sum()) for g in got)) <= 2.0 * (1 + 1e-5)
        last = [float(b.double().square().sum()) for b in buckets]
        assert float(clip.grad_norm) == pytest.approx(math.sqrt(sum(last)), rel=1e-5)


def test_local_clip_is_clip_grad_norm_where_the_shares_hold():
    gen = torch.Generator().manual_seed(4)
    sizes = [300, 700]
    layouts = [(n, ((i, (n,)),)) for i, n in enumerate(sizes)]
    base = [torch.randn(n, generator=gen) for n in sizes]
    clip = LocalGradClip(1.0, sum(sizes))
    for scale in (1.0, 5.0):  # the same direction twice, the second step 5x larger
        got = [b * scale for b in base]
        for b, layout in zip(got, layouts):
            clip.clip_(b, layout)
        clip.end_step()
    norm = math.sqrt(sum(float(b.double().square().sum()) for b in base)) * 5.0
    coef = 1.0 / norm
    expect = [b.double() * 5.0 * coef for b in base]
    # 95 % of each share is the norm's part: within 2 % of clip_grad_norm_'s coefficient
    for g, e in zip(got, expect):
        assert torch.allclose(g.double(), e, rtol=0.02)


def test_a_nonfinite_step_keeps_the_shares():
    layouts = [(4, ((0, (4,)),)), (4, ((1, (4,)),))]
    clip = LocalGradClip(1.0, 8)
    for b, layout in zip([torch.ones(4), 3 * torch.ones(4)], layouts):
        clip.clip_(b, layout)
    clip.end_step()
    shares = dict(clip.state_dict()["last"])
    for b, layout in zip([torch.full((4,), float("nan")), torch.ones(4)], layouts):
        clip.clip_(b, layout)
    clip.end_step()
    assert math.isnan(float(clip.grad_norm))
    after = clip.state_dict()["last"]
    assert all(torch.equal(after[k], v) for k, v in shares.items())


@pytest.mark.training
@pytest.mark.parametrize("codec,optimizer", DIRECTION_RECIPES)
def test_max_grad_norm_trains_like_the_clipped_twin(codec, optimizer):
    """With clipping active at every step, the recipe with max_grad_norm ends within the
    tolerance of test_error_feedback (1.15x) of fp32 with clip_grad_norm_ in the loop, on 3
    seeds; and so does it without clipping (the same tolerance, clipped or not)."""
    for seed in range(3):
        twin, _ = ep.train("fp32", optimizer, error_feedback=False, direction=False, seed=seed,
                           max_grad_norm=CLIP)
        clipped, _ = ep.train(codec, optimizer, error_feedback=True, direction=True, seed=seed,
                              max_grad_norm=CLIP)
        assert clipped <= 1.15 * twin, f"seed {seed}: {clipped:.4f} vs clipped fp32 {twin:.4f}"


def test_compressed_sgd_too_refuses_an_edited_update():
    p = torch.nn.Parameter(torch.ones(64))
    opt = CompressedSGD([p], lr=0.1)
    sim = SimulatedWorkers("topk:0.1", 2, min_compress_numel=0, optimizer=opt)
    p.grad = sim.reduce([torch.randn(64), torch.randn(64)]).clone()
    p.grad.mul_(0.5)
    with pytest.raises(RuntimeError, match="p.grad was changed"):
        opt.step()


def test_a_pickled_state_attaches_a_new_optimizer_of_its_kind_only():
    from gradzip.ddp import CompressionState

    p = torch.nn.Parameter(torch.ones(8))
    state = CompressionState("sign", warmup_steps=1, optimizer=FrozenVarianceAdamW([p]))
    with pytest.raises(ValueError, match="kind and settings"):
        state.attach(CompressedSGD([p]))
    with pytest.raises(ValueError, match="kind and settings"):
        state.attach(FrozenVarianceAdamW([p], betas=(0.8, 0.999)))
    fresh = FrozenVarianceAdamW([p], lr=0.5)  # the learning rate is the optimizer's own
    state.attach(fresh)
    assert fresh.attached and state.config.direction is fresh.direction
