"""What each spawned rank runs in test_two_level.py: DDP with gradzip.two_level's state on W = N x R
Gloo ranks. Each writes its observations with torch.save into `outdir`; the test process checks
them."""

import io
import os
import pickle

import torch

from ddp_scenarios import (batch, loss_fn, make_ddp, make_model, overflow_one, recording_hook,
                           restored_model, train_steps)
from gradzip.ddp import compress_hook
from gradzip.two_level import TwoLevelState


def session(rank, world, outdir, plan):
    for fn, args in plan:
        globals()[fn](rank, world, outdir, *args)


def train(rank, world, outdir, configs):
    """For each config: DDP + compress_hook over a TwoLevelState (recorded) for a few SGD steps,
    step 0 uncompressed (so that no residual exists before DDP rebuilds its buckets); saves the
    records, the parameters and the residual of every shard piece (key -> values)."""
    for name, cfg in configs:
        model = make_model()
        ddp = make_ddp(model, cfg)
        state = TwoLevelState(cfg["codec"], ranks_per_node=cfg["ranks_per_node"],
                              min_compress_numel=32, warmup_steps=1,
                              uncompressed_numel=cfg.get("uncompressed_numel", 0))
        records = []
        ddp.register_comm_hook(state, recording_hook(records))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(cfg["steps"]):
            opt.zero_grad()
            loss_fn(ddp, *batch(step, rank)).backward()
            opt.step()
        state._commit()
        pieces = {}
        for st in state._ef.buckets.values():
            off = 0
            for key, shape in st.layout[1]:
                m = torch.Size(shape).numel()
                if st.residual is not None:
                    pieces[key] = st.residual[off:off + m].clone()
                off += m
        torch.save({"records": records, "params": [p.detach().clone() for p in model.parameters()],
                    "pieces": pieces, "stats": state.stats,
                    "param_of_key": {state._keys._keys[id(p)]: i
                                     for i, p in enumerate(model.parameters())}},
                   os.path.join(outdir, f"{name}_{rank}.pt"))
        del ddp


def checkpoint_resume(rank, world, outdir, configs):
    """Uninterrupted 5 steps vs 2 steps, a checkpoint (model, optimizer, the state's state_dict and
    its pickle), a fresh DDP (its first iteration one bucket again: reduced as the saved buckets),
    3 steps; saves the three runs' parameters."""
    for name, cfg in configs:
        def make_state():
            return TwoLevelState(cfg["codec"], ranks_per_node=cfg["ranks_per_node"],
                                 min_compress_numel=0)

        def run(ddp, opt, steps):
            train_steps(ddp, opt, steps, rank)

        model = make_model()
        ddp = make_ddp(model, cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = make_state()
        ddp.register_comm_hook(state, compress_hook)
        run(ddp, opt, range(2))
        ckpt = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "hook": state.state_dict()}, ckpt)
        pickled = pickle.dumps(state)
        run(ddp, opt, range(2, 5))
        out = {"uninterrupted": [p.detach().clone() for p in model.parameters()]}
        del ddp
        for how in ("state_dict", "pickle"):
            ckpt.seek(0)
            saved = torch.load(ckpt, weights_only=False)
            model2 = restored_model(saved["model"])
            ddp2 = make_ddp(model2, cfg)
            opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
            opt2.load_state_dict(saved["opt"])
            if how == "pickle":
                state2 = pickle.loads(pickled)
            else:
                state2 = make_state()
                state2.load_state_dict(saved["hook"])
            ddp2.register_comm_hook(state2, compress_hook)
            run(ddp2, opt2, range(2, 5))
            out[how] = [p.detach().clone() for p in model2.parameters()]
            del ddp2
        torch.save(out, os.path.join(outdir, f"resume_{name}_{rank}.pt"))


def overflow(rank, world, outdir, codecs, ranks_per_node):
    for codec in codecs:
        overflow_one(rank, world, outdir, codec, TwoLevelState, "_two_level",
                     ranks_per_node=ranks_per_node)


def bad_layout(rank, world, outdir, ranks_per_node):
    """A node layout that does not fit the world: every rank must raise ValueError at the first
    hook call (a message, not a hang)."""
    model = make_model()
    ddp = make_ddp(model, {})
    ddp.register_comm_hook(TwoLevelState("int8", ranks_per_node=ranks_per_node), compress_hook)
    try:
        loss_fn(ddp, *batch(0, rank)).backward()
        err = None
    except ValueError as e:
        err = str(e)
    torch.save(err, os.path.join(outdir, f"bad_layout_{rank}.pt"))
