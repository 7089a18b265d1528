"""A small fixed training problem for error-feedback tests: a 3-layer MLP with LayerNorm on a
Gaussian-mixture classification task, W simulated workers, each step's global batch split among
them. Its tensors differ in gradient scale by orders of magnitude and most are smaller than a
sign block, as in a real network, which is where error feedback goes wrong first.

    python tests/python/ef_problem.py   # prints the final loss and residual ratio of every case
"""
from __future__ import annotations

import math

import torch

from gradzip.simulation import SimulatedWorkers
from gradzip.optim import CompressedSGD, FrozenVarianceAdamW

WORKERS = 4
STEPS = 300
FEATURES, CLASSES, SAMPLES, BATCH = 24, 6, 2048, 8


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 0.4
    y = torch.randint(CLASSES, (SAMPLES,), generator=g)
    x = centres[y] + torch.randn(SAMPLES, FEATURES, generator=g)
    flip = torch.rand(SAMPLES, generator=g) < 0.2  # label noise: the loss stays well above zero
    y = torch.where(flip, torch.randint(CLASSES, (SAMPLES,), generator=g), y)
    return x, y


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 96), torch.nn.LayerNorm(96), torch.nn.GELU(),
                               torch.nn.Linear(96, 96), torch.nn.GELU(),
                               torch.nn.Linear(96, CLASSES))


LR = {"sgd": 0.1, "adamw": 3e-3}  # train this problem well uncompressed
# FrozenVarianceAdamW measures its variance on uncompressed steps first: a tenth of the run, as the
# convergence harness's learning-rate warm-up.
FROZEN_VARIANCE_WARMUP = STEPS // 10


def make_optimizer(name: str, params, compressed: bool, lr: float | None = None):
    """The optimizers people use; ``compressed``: gradzip.optim's, whose direction is compressed."""
    lr = LR[name] if lr is None else lr
    if name == "sgd":
        return (CompressedSGD(params, lr=lr, momentum=0.9) if compressed
                else torch.optim.SGD(params, lr=lr, momentum=0.9))
    return (FrozenVarianceAdamW(params, lr=lr, weight_decay=0.01) if compressed
            else torch.optim.AdamW(params, lr=lr, weight_decay=0.01))


def train(codec: str, optimizer: str, error_feedback: bool, direction: bool, seed: int = 0,
          steps: int = STEPS, lr: float | None = None, warmup_steps: int | None = None,
          max_grad_norm: float | None = None):
    """Trains with ``codec``; ``direction``: gradzip.optim's optimizer computes what is compressed,
    else the gradient is (compress_hook's default). ``warmup_steps``: the uncompressed first steps
    (None: FROZEN_VARIANCE_WARMUP for FrozenVarianceAdamW, else none). ``max_grad_norm``: clipping
    where the loop can clip (``clip_grad_norm_`` on the averaged gradient before step(); with
    ``direction``, each worker's gradient in the reduction). Returns (final loss on all data,
    largest ratio of a worker's residual norm to the averaged gradient's norm, over the steps)."""
    x, y = data(seed)
    net = model(seed)
    params = list(net.parameters())
    opt = make_optimizer(optimizer, params, direction, lr)
    if warmup_steps is None:
        warmup_steps = FROZEN_VARIANCE_WARMUP if isinstance(opt, FrozenVarianceAdamW) else 0
    sim = SimulatedWorkers(codec, WORKERS, error_feedback=error_feedback, min_compress_numel=0,
                           warmup_steps=warmup_steps, optimizer=opt if direction else None,
                           max_grad_norm=max_grad_norm if direction else None)
    numels = [p.numel() for p in params]
    loss_fn = torch.nn.functional.cross_entropy
    gen = torch.Generator().manual_seed(seed + 1)
    worst = 0.0
    for step in range(steps):
        idx = torch.randint(SAMPLES, (WORKERS * BATCH,), generator=gen)
        grads = []
        for w in range(WORKERS):
            part = idx[w * BATCH:(w + 1) * BATCH]
            g = torch.autograd.grad(loss_fn(net(x[part]), y[part]), params)
            grads.append(torch.cat([t.reshape(-1) for t in g]))
        mean_norm = float(torch.stack(grads).mean(0).norm())
        avg = sim.reduce(grads, numels=numels)
        # the residual is in the units of what a worker sends, g / W (or its direction / W)
        ref = float(avg.norm()) if direction else mean_norm
        if error_feedback and ref > 0:
            worst = max(worst, WORKERS * max(float(r.norm()) for r in sim.residuals(0)) / ref)
        off = 0
        for p in params:
            p.grad = avg[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        if max_grad_norm is not None and not direction:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
    with torch.no_grad():
        loss = float(loss_fn(net(x), y))
    return (loss if math.isfinite(loss) else math.inf), worst


if __name__ == "__main__":
    torch.set_num_threads(1)
    for opt_name in ("sgd", "adamw"):
        base, _ = train("fp32", opt_name, False, False)
        print(f"{opt_name} fp32 loss {base:.4f}")
        for codec in ("fp16", "bf16", "int8", "sign", "topk:0.01"):
            for direction in (False, True):
                ef, ratio = train(codec, opt_name, True, direction)
                no, _ = train(codec, opt_name, False, direction)
                print(f"{opt_name:5} {codec:9} direction={int(direction)}  EF {ef:.4f}  no EF {no:.4f}"
                      f"  residual/grad {ratio:.1f}")
