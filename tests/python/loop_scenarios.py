"""What each spawned rank runs in test_training_loops_ddp.py: the recipe's hook inside the loops
people write. Each scenario writes its observations with torch.save into `outdir`."""
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_scenarios as sc
from gradzip.ddp import CompressionState, compress_hook
from gradzip.optim import FrozenVarianceAdamW

MICRO = 4  # micro-steps of an accumulated step


def _ddp(codec=None, warmup=1, max_grad_norm=None):
    """The sign recipe (FrozenVarianceAdamW) on sc.Net, or plain DDP with torch's AdamW (codec
    None): the model, the optimizer, the hook's state (or None)."""
    ddp = sc.make_ddp(sc.make_model(), {})
    if codec is None:
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01), None
    opt = FrozenVarianceAdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    state = CompressionState(codec, warmup_steps=warmup, optimizer=opt, min_compress_numel=0,
                             max_grad_norm=max_grad_norm)
    ddp.register_comm_hook(state, compress_hook)
    return ddp, opt, state


def _first_error(step_fn, steps=3):
    """The (step, message) of the first RuntimeError of ``step_fn(step)``, or None."""
    for step in range(steps):
        try:
            step_fn(step)
        except RuntimeError as e:
            return step, str(e)
    return None


def edits(rank, world, outdir):
    """clip_grad_norm_ and fp16 GradScaler in their usual places in the loop."""
    out = {}
    ddp, opt, _ = _ddp("sign")

    def clipped(step):
        opt.zero_grad()
        sc.loss_fn(ddp, *sc.batch(step, rank)).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()

    out["clip"] = _first_error(clipped)
    ddp, opt, _ = _ddp("sign")
    scaler = torch.amp.GradScaler("cpu")

    def scaled(step):
        opt.zero_grad()
        scaler.scale(sc.loss_fn(ddp, *sc.batch(step, rank))).backward()
        scaler.step(opt)
        scaler.update()

    out["gradscaler"] = _first_error(scaled)
    torch.save(out, os.path.join(outdir, f"edits_{rank}.pt"))


def _accumulated_steps(ddp, opt, rank, steps, autocast=False):
    for step in range(steps):
        opt.zero_grad()
        for micro in range(MICRO):
            x, y = sc.batch(MICRO * step + micro, rank)
            sync = micro == MICRO - 1
            with (torch.enable_grad() if sync else ddp.no_sync()):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = sc.loss_fn(ddp, x, y) / MICRO
                loss.backward()
        opt.step()


def accumulation(rank, world, outdir, warmup, steps):
    """Gradient accumulation with no_sync (MICRO micro-steps), the recipe's hook against plain
    DDP with AdamW; and the same under bf16 autocast."""
    out = {}
    for name, codec, autocast in [("twin", None, False), ("hook", "sign", False),
                                  ("hook_bf16", "sign", True)]:
        ddp, opt, _ = _ddp(codec, warmup=warmup)
        _accumulated_steps(ddp, opt, rank, steps, autocast)
        out[name] = [p.detach().clone() for p in ddp.parameters()]
    torch.save(out, os.path.join(outdir, f"accumulation_{rank}.pt"))


def clipping(rank, world, outdir, max_norm, steps):
    """max_grad_norm: every rank's grad_norm against its own gradient recomputed without DDP;
    the replicas after ``steps`` steps."""
    ddp, opt, state = _ddp("sign", warmup=2, max_grad_norm=max_norm)
    plain = sc.make_model().double()
    norms, want = [], []
    for step in range(steps):
        with torch.no_grad():
            for q, p in zip(plain.parameters(), ddp.parameters()):
                q.copy_(p)
        x, y = sc.batch(step, rank)
        g = torch.autograd.grad(sc.loss_fn(plain, x.double(), y.double()), list(plain.parameters()))
        want.append(float(torch.stack([t.norm() for t in g]).norm()))
        opt.zero_grad()
        sc.loss_fn(ddp, x, y).backward()
        opt.step()
        norms.append(float(state.grad_norm))
    torch.save({"norms": norms, "want": want,
                "params": [p.detach().clone() for p in ddp.parameters()]},
               os.path.join(outdir, f"clipping_{rank}.pt"))


def compiled(rank, world, outdir, steps):
    """The recipe on torch.compile(ddp) against the same loop uncompiled (DDP's default buckets:
    dynamo's DDPOptimizer wants the first bucket no larger than the others)."""
    out = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(1234)
        ddp = DDP(sc.Net())
        opt = FrozenVarianceAdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
        state = CompressionState("sign", warmup_steps=2, optimizer=opt, min_compress_numel=0)
        ddp.register_comm_hook(state, compress_hook)
        forward = torch.compile(ddp) if name == "compiled" else ddp
        for step in range(steps):
            opt.zero_grad()
            sc.loss_fn(forward, *sc.batch(step, rank)).backward()
            opt.step()
        out[name] = [p.detach().clone() for p in ddp.parameters()]
        with torch.no_grad():  # held out: batches no step saw
            out[name + "_loss"] = sum(float(sc.loss_fn(ddp.module, *sc.batch(10_000 + i, 0)))
                                      for i in range(8)) / 8
    torch.save(out, os.path.join(outdir, f"compiled_{rank}.pt"))
