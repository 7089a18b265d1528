"""CompressedSGD's Deep Gradient Compression options against a float64 reference written here:
momentum correction (each rank's velocity is what top-k selects from, with error feedback),
momentum factor masking (a coordinate this rank sent restarts its velocity at zero) and local
gradient clipping (each rank's bucket gradient clipped to ``C / sqrt(world)`` before it enters the
velocity), on compressed steps only."""
import math

import pytest
import torch

from gradzip.optim import CompressedSGD
from gradzip.simulation import SimulatedWorkers

WORLD, N, DENSITY, MOMENTUM = 3, 1001, 0.1, 0.9


def rank_grads(steps, scale=1.0):
    g = torch.Generator().manual_seed(7)
    return [[torch.randn(N, generator=g) * scale for _ in range(WORLD)] for _ in range(steps)]


def reference(grads, masking, clip, warmup=0):
    """Per rank: u = m u + clip(g); acc = residual + u / W; the k largest |acc| are sent, the rest
    stays as residual; masking zeroes u where sent. Returns the averaged directions per step."""
    k = math.ceil(DENSITY * N)
    u = [torch.zeros(N, dtype=torch.float64) for _ in range(WORLD)]
    res = [torch.zeros(N, dtype=torch.float64) for _ in range(WORLD)]
    out = []
    for step, gs in enumerate(grads):
        compressed = step >= warmup
        total = torch.zeros(N, dtype=torch.float64)
        for r, g in enumerate(gs):
            g = g.double()
            if compressed and clip is not None:
                bound = clip / math.sqrt(WORLD)
                g = g * min(1.0, bound / float(g.norm()))
            u[r] = MOMENTUM * u[r] + g
            if not compressed:
                total += u[r] / WORLD
                continue
            acc = res[r] + u[r] / WORLD
            idx = acc.abs().topk(k).indices
            sent = torch.zeros(N, dtype=torch.float64)
            sent[idx] = acc[idx]
            res[r] = acc - sent
            if masking:
                u[r][idx] = 0.0
            total += sent
        out.append(total)
    return out


def simulated(grads, masking, clip, codec="topk:0.1", warmup=0):
    opt = CompressedSGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=MOMENTUM,
                        momentum_masking=masking, local_clip_norm=clip)
    sim = SimulatedWorkers(codec, WORLD, min_compress_numel=0, optimizer=opt, warmup_steps=warmup)
    return [sim.reduce(gs) for gs in grads], sim


@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("clip", [None, 20.0])
def test_momentum_correction_masking_and_clipping_match_the_reference(masking, clip):
    grads = rank_grads(6)
    if clip is not None:  # the bound binds on every rank: |g| ~ sqrt(N) ~ 32 > 20 / sqrt(3)
        assert all(float(g.norm()) > clip / math.sqrt(WORLD) for gs in grads for g in gs)
    got, _ = simulated(grads, masking, clip, warmup=1)
    for step, (a, b) in enumerate(zip(got, reference(grads, masking, clip, warmup=1))):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"step {step}: {m}")


def test_masking_changes_the_result():
    grads = rank_grads(4)
    plain, _ = simulated(grads, masking=False, clip=None)
    masked, _ = simulated(grads, masking=True, clip=None)
    assert torch.equal(plain[0], masked[0])  # the first step has no velocity to mask yet
    assert not torch.equal(plain[-1], masked[-1])


def test_masking_finds_what_fp16_values_sent():
    """With fp16 values the residual of a sent coordinate is its rounding, not zero: the velocity
    is still zeroed exactly where the reference's top-k sent."""
    grads = rank_grads(3)
    _, sim = simulated(grads, masking=True, clip=None, codec="topk:0.1:values=fp16")
    k = math.ceil(DENSITY * N)
    acc = [g.double() * 0 for g in grads[0]]
    u = [g.double() * 0 for g in grads[0]]
    for gs in grads:  # the reference's selection, per rank
        for r, g in enumerate(gs):
            u[r] = MOMENTUM * u[r] + g.double()
            acc[r] = acc[r] + u[r] / WORLD
            idx = acc[r].abs().topk(k).indices
            acc[r][idx] = 0.0  # (the fp16 rounding it keeps is far below the next selection)
            u[r][idx] = 0.0
    for r in range(WORLD):
        (state,) = sim._ef[r].buckets.values()
        velocity = state.moments[0]
        assert torch.equal(velocity == 0, u[r] == 0), f"rank {r}"


def test_tensors_sent_exact_keep_their_velocity():
    """Tensors below ``uncompressed_numel`` travel in fp32 every step: masking them would turn the
    momentum off there."""
    opt = CompressedSGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=MOMENTUM,
                        momentum_masking=True)
    sim = SimulatedWorkers("topk:0.1", WORLD, min_compress_numel=0, optimizer=opt,
                           uncompressed_numel=100)
    shapes = [(30, 30), (101,)]  # the 1-D tensor travels exact
    for gs in rank_grads(3):
        sim.reduce(gs, shapes=shapes)
    (state,) = sim._ef[0].buckets.values()
    assert bool((state.moments[0][900:] != 0).all())
    assert bool((state.moments[0][:900] == 0).any())


def test_bad_options_are_refused():
    p = [torch.nn.Parameter(torch.zeros(1))]
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="local_clip_norm"):
            CompressedSGD(p, local_clip_norm=bad)
