"""What each spawned rank runs in test_ddp.py and test_cast_allreduce.py. Module-level functions
(the children import them). Each writes its observations with torch.save into `outdir`; the test
process compares them."""

import datetime
import io
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradzip.ddp import CompressionState, compress_hook
from gradzip.optim import CompressedSGD, FrozenVarianceAdamW

IN, OUT = 20, 7


class Net(nn.Module):
    """Three layers (several DDP buckets with a small bucket cap) and an optional branch, unused
    unless ``use_branch`` is set;
    ``extra``: "zero" adds a layer of zero outputs (zero-size parameters, concatenated to the
    output), "sparse" an nn.Embedding with sparse gradients (indices taken from the input)."""

    def __init__(self, unused_branch=False, extra=None):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(),
                                  nn.Linear(40, OUT))
        self.unused = nn.Linear(IN, 16) if unused_branch else None
        self.extra = extra
        if extra == "zero":
            self.empty = nn.Linear(IN, 0)
        elif extra == "sparse":
            self.emb = nn.Embedding(30, OUT, sparse=True)

    def forward(self, x):
        y = self.body(x)
        if self.unused is not None and getattr(self, "use_branch", False):
            y = y + self.unused(x)[:, :OUT]
        if self.extra == "zero":
            return torch.cat([y, self.empty(x)], dim=1)
        if self.extra == "sparse":
            return y + self.emb((x[:, :3].abs() * 10).long() % 30).mean(1)
        return y


def make_model(unused_branch=False, extra=None):
    torch.manual_seed(1234)  # identical initial replicas
    return Net(unused_branch, extra)


def batch(step, rank, poison=False):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, IN, generator=g)
    y = torch.randn(8, OUT, generator=g)
    if poison:
        x[0, 0] = float("inf")
    return x, y


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def train_steps(ddp, opt, steps, rank):
    """The plain loop of the resume scenarios: zero_grad, backward of ``steps``' batches, step."""
    for step in steps:
        opt.zero_grad()
        loss_fn(ddp, *batch(step, rank)).backward()
        opt.step()


def recording_hook(records):
    """compress_hook, also recording (step, bucket index, shapes, local input, reduced output,
    parameter keys)."""

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        inp = bucket.buffer().clone()
        key = (state.step, bucket.index(), tuple(tuple(p.shape) for p in bucket.parameters()))
        # the hook's parameter numbering (its state follows each parameter across buckets)
        params = tuple(k for k, _ in state._keys.layout(bucket, inp.numel())[1])

        def rec(fut):
            out = fut.value()
            records.append((key, inp, out.clone(), params))
            return out

        return compress_hook(state, bucket).then(rec)

    return hook


def make_optimizer(name, params):
    """None: torch's SGD on the averaged gradient; "adamw"/"sgd": gradzip.optim's, whose
    update the hook computes; "dgc": CompressedSGD with momentum masking and local clipping."""
    if name is None:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return FrozenVarianceAdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "dgc":
        return CompressedSGD(params, lr=0.05, momentum=0.9, momentum_masking=True,
                             local_clip_norm=0.5)
    return CompressedSGD(params, lr=0.05, momentum=0.9)


def warmup_for(name):
    """FrozenVarianceAdamW measures its variance on uncompressed steps first: 2 of them, so that
    a few-step scenario runs both phases."""
    return 2 if name == "adamw" else 0


def config_warmup(cfg):
    """A train scenario's warm-up: its "warmup", else its optimizer's need."""
    return cfg.get("warmup", warmup_for(cfg.get("optimizer")))


def restored_model(saved: dict):
    """A fresh model whose weights come from ``saved`` only (offset first, so that the seed's
    initial weights cannot pass for a restored checkpoint)."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(saved)
    return model


def make_ddp(model, cfg):
    return DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb", 0.004),
               static_graph=cfg.get("static_graph", False),
               find_unused_parameters=cfg.get("find_unused", False),
               gradient_as_bucket_view=cfg.get("bucket_view", False))


def train(rank, world, outdir, configs):
    """For each config: DDP + compress_hook (recorded) for a few SGD steps."""
    for name, cfg in configs:
        model = make_model(cfg.get("unused_branch", False), cfg.get("extra"))
        ddp = make_ddp(model, cfg)
        opt = make_optimizer(cfg.get("optimizer"), model.parameters())
        state = CompressionState(cfg["codec"], min_compress_numel=cfg.get("min_numel", 32),
                                 warmup_steps=config_warmup(cfg),
                                 optimizer=None if cfg.get("optimizer") is None else opt,
                                 cast_sum=cfg.get("cast_sum"),
                                 uncompressed_numel=cfg.get("uncompressed_numel", 0),
                                 residual_dtype=cfg.get("residual_dtype", torch.float32))
        records = []
        ddp.register_comm_hook(state, recording_hook(records))
        stats = []
        for step in range(cfg.get("steps", 4)):
            opt.zero_grad()
            loss_fn(ddp, *batch(step, rank)).backward()
            opt.step()
            stats.append(state.stats)
        torch.save({"records": records, "stats": stats,
                    "residuals": state.state_dict()["residuals"],
                    "params": [p.detach().clone() for p in model.parameters()],
                    "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()]},
                   os.path.join(outdir, f"{name}_{rank}.pt"))
        del ddp


def twin(rank, world, outdir, configs):
    """For each config: the same training with compress_hook and without a hook (plain DDP),
    recording the gradients of the first step and the parameters after each step."""
    for name, cfg in configs:
        out = {}
        for hooked in (True, False):
            model = make_model(cfg.get("unused_branch", False), cfg.get("extra"))
            ddp = make_ddp(model, cfg)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            state = None
            if hooked:
                state = CompressionState(cfg["codec"], min_compress_numel=0)
                ddp.register_comm_hook(state, compress_hook)
            grads, params = [], []
            for step in range(cfg.get("steps", 3)):
                model.use_branch = step in cfg.get("branch_steps", ())
                opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
                loss_fn(ddp, *batch(step, rank)).backward()
                grads.append([None if p.grad is None else p.grad.detach().to_dense().clone()
                              for p in model.parameters()])
                opt.step()
                params.append([p.detach().clone() for p in model.parameters()])
            out["hook" if hooked else "plain"] = {
                "grads": grads, "params": params,
                "residuals": None if state is None else state.state_dict()["residuals"]}
            del ddp
        torch.save(out, os.path.join(outdir, f"twin_{name}_{rank}.pt"))


def sum_16_bit(rank, world, outdir):
    """Gloo's SUM all-reduce of bfloat16 and float16 CPU tensors of rank + 1."""
    sums = {}
    for dtype in (torch.bfloat16, torch.float16):
        t = torch.full((5,), float(rank + 1), dtype=dtype)
        dist.all_reduce(t)
        sums[str(dtype)] = t
    torch.save(sums, os.path.join(outdir, f"sums_{rank}.pt"))


def cast_sums(rank, world, outdir, configs):
    """For each (name, codec, cast_sum, (inputs, outputs)): one layer of that shape (one bucket, so
    the test's reference needs no bucket layout) trained 5 steps with the hook, recording every
    reduction and this rank's residual after each step; then steps 3-4 again from a checkpoint of
    the state after step 2 (model, optimizer, CompressionState.state_dict), in a fresh DDP and
    state."""
    def run(steps, saved=None):
        torch.manual_seed(4321)  # identical initial replicas
        model = nn.Linear(*shape, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = CompressionState(codec, min_compress_numel=0, cast_sum=cast_sum)
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(saved["gradzip"])
        ddp = DDP(model)
        records, residuals, ckpt = [], [], None
        ddp.register_comm_hook(state, recording_hook(records))
        for step in steps:
            if step == 3:
                ckpt = pickle.loads(pickle.dumps({"model": model.state_dict(), "opt": opt.state_dict(),
                                                  "gradzip": state.state_dict()}))
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, shape[0], generator=g), torch.randn(8, shape[1], generator=g)
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
            residuals.append(state.state_dict()["residuals"][0]["residual"])
        return records, residuals, model.weight.detach().clone(), ckpt

    for name, codec, cast_sum, shape in configs:
        records, residuals, params, ckpt = run(range(5))
        *_, resumed, _ = run(range(3, 5), ckpt)
        torch.save({"records": records, "residuals": residuals, "params": params,
                    "resumed": resumed}, os.path.join(outdir, f"{name}_{rank}.pt"))


def fp16_vs_pytorch(rank, world, outdir):
    """One backward with our fp16 codec (no EF) and one with PyTorch's fp16_compress_hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    grads = {}
    for name in ("gradzip", "torch"):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.004)
        if name == "gradzip":
            ddp.register_comm_hook(CompressionState("fp16", error_feedback=False, min_compress_numel=0),
                                   compress_hook)
        else:
            ddp.register_comm_hook(None, fp16_compress_hook)
        loss_fn(ddp, *batch(0, rank)).backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        del ddp
    torch.save(grads, os.path.join(outdir, f"fp16_{rank}.pt"))


def overflow(rank, world, outdir, codecs):
    for codec in codecs:
        overflow_one(rank, world, outdir, codec)


def overflow_compact(rank, world, outdir, codecs):
    """overflow with the compact residual (bfloat16; the guard's backup is bfloat16 too)."""
    for codec in codecs:
        overflow_one(rank, world, outdir, codec, tag="_compact", residual_dtype=torch.bfloat16)


def checkpoint_resume(rank, world, outdir, codecs):
    for codec in codecs:
        checkpoint_resume_one(rank, world, outdir, codec)


def overflow_one(rank, world, outdir, codec, state_cls=CompressionState, tag="", **state_args):
    """Step 2 has an Inf input on rank 0: GradScaler must skip it on every rank, the residuals must
    stay as they were, and the later steps must train normally. ``state_cls(codec, **state_args)``:
    the hook's state (test_two_level.py's is TwoLevelState), saved under ``tag``."""
    model = make_model()
    ddp = make_ddp(model, {})
    state = state_cls(codec, min_compress_numel=0, **state_args)
    ddp.register_comm_hook(state, compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    log = []
    for step in range(5):
        before_params = [p.detach().clone() for p in model.parameters()]
        before = state.state_dict()["residuals"]  # settles the previous step
        scale = scaler.get_scale()
        opt.zero_grad()
        x, y = batch(step, rank, poison=(step == 2 and rank == 0))
        scaler.scale(loss_fn(ddp, x, y)).backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        after = state.state_dict()["residuals"]
        log.append({
            "finite": finite,
            "params_unchanged": all(torch.equal(a, p) for a, p in zip(before_params, model.parameters())),
            "scale_before": scale, "scale_after": scaler.get_scale(),
            "residuals_unchanged": bool(before) and before.keys() == after.keys() and all(
                torch.equal(before[i]["residual"], after[i]["residual"]) for i in before),
            "residuals_finite": all(bool(torch.isfinite(v["residual"]).all()) for v in after.values()),
        })
    torch.save({"log": log, "params": [p.detach().clone() for p in model.parameters()]},
               os.path.join(outdir, f"overflow{tag}_{codec}_{rank}.pt"))


def checkpoint_resume_one(rank, world, outdir, codec):
    """Uninterrupted 5 steps vs 2 steps, checkpoint (model, optimizer, hook state), fresh DDP,
    3 steps. find_unused_parameters=True: DDP never rebuilds its buckets, so the resumed run has the
    saved bucket layout (docs/guide.md, "What the hook guarantees": residuals are keyed by bucket index and layout)."""
    cfg = {"find_unused": True}

    def setup(model):
        ddp = make_ddp(model, cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return ddp, opt

    def run(ddp, opt, steps):
        train_steps(ddp, opt, steps, rank)

    model = make_model()
    ddp, opt = setup(model)
    state = CompressionState(codec, min_compress_numel=0)
    ddp.register_comm_hook(state, compress_hook)
    run(ddp, opt, range(2))
    ckpt = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, ckpt)
    pickled = pickle.dumps(state)
    run(ddp, opt, range(2, 5))
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    del ddp

    ckpt.seek(0)
    saved = torch.load(ckpt, weights_only=False)
    model2 = restored_model(saved["model"])
    ddp2, opt2 = setup(model2)
    opt2.load_state_dict(saved["opt"])
    state2 = CompressionState(codec, min_compress_numel=0)
    state2.load_state_dict(saved["hook"])
    ddp2.register_comm_hook(state2, compress_hook)
    run(ddp2, opt2, range(2, 5))
    resumed = [p.detach().clone() for p in model2.parameters()]
    del ddp2

    unpickled = pickle.loads(pickled)
    torch.save({"uninterrupted": uninterrupted, "resumed": resumed,
                "unpickled_group_is_none": unpickled.process_group is None,
                "unpickled_step": unpickled.step,
                "unpickled_residuals": {i: ef.residual for i, ef in unpickled._ef.buckets.items()},
                "saved_residuals": {i: v["residual"] for i, v in saved["hook"]["residuals"].items()}},
               os.path.join(outdir, f"ckpt_{codec}_{rank}.pt"))


def pickle_resume(rank, world, outdir, configs):
    for codec, optimizer in configs:
        pickle_resume_one(rank, world, outdir, codec, optimizer)


def pickle_resume_one(rank, world, outdir, codec, optimizer):
    """As PyTorch's _test_hook_pickling: 3 steps, the hook's state object itself saved (torch.save)
    with the model and optimizer, loaded and registered on a fresh DDP model, 3 more steps; against
    6 uninterrupted steps. find_unused_parameters=True: the fresh DDP's first iteration reduces one
    bucket where the saved state holds several."""
    cfg = {"find_unused": True}

    def setup(model):
        opt = make_optimizer(optimizer, model.parameters())
        return make_ddp(model, cfg), opt

    def run(ddp, opt, steps):
        train_steps(ddp, opt, steps, rank)

    model = make_model()
    ddp, opt = setup(model)
    state = CompressionState(codec, min_compress_numel=0, warmup_steps=warmup_for(optimizer),
                             optimizer=None if optimizer is None else opt)
    ddp.register_comm_hook(state, compress_hook)
    run(ddp, opt, range(3))
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state}, blob)
    run(ddp, opt, range(3, 6))
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    del ddp

    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    model2 = restored_model(saved["model"])
    ddp2, opt2 = setup(model2)
    opt2.load_state_dict(saved["opt"])
    state2 = saved["hook"]
    if optimizer is not None:
        state2.attach(opt2)  # the loaded state computes this optimizer's direction
    ddp2.register_comm_hook(state2, compress_hook)
    run(ddp2, opt2, range(3, 6))
    torch.save({"uninterrupted": uninterrupted, "resumed": [p.detach().clone() for p in model2.parameters()],
                "group_is_none": state2.process_group is None},
               os.path.join(outdir, f"pickle_{codec}_{optimizer}_{rank}.pt"))
    del ddp2


def world_change(rank, world, outdir, codec, optimizer, phase):
    """An elastic restart at another world size. "save": 3 steps, each rank saves its checkpoint.
    "load": every rank loads the checkpoint of rank ``rank % saved ranks`` and trains 2 steps, and
    beside it a twin starts from the same weights with a fresh CompressionState at step 3; records
    the warnings and both runs' parameters."""
    import warnings

    def setup(model):
        opt = make_optimizer(optimizer, model.parameters())
        state = CompressionState(codec, min_compress_numel=0, warmup_steps=warmup_for(optimizer),
                                 optimizer=None if optimizer is None else opt)
        ddp = make_ddp(model, {})
        ddp.register_comm_hook(state, compress_hook)
        return ddp, opt, state

    def run(ddp, opt, steps):
        train_steps(ddp, opt, steps, rank)

    if phase == "save":
        model = make_model()
        ddp, opt, state = setup(model)
        run(ddp, opt, range(3))
        torch.save({"model": model.state_dict(), "gradzip": state.state_dict(), "world": world},
                   os.path.join(outdir, f"world_ckpt_{rank}.pt"))
        return
    saved_ranks = len([f for f in os.listdir(outdir) if f.startswith("world_ckpt_")])
    saved = torch.load(os.path.join(outdir, f"world_ckpt_{rank % saved_ranks}.pt"), weights_only=False)
    params = {}
    for name in ("loaded", "fresh"):
        model = make_model()
        model.load_state_dict(saved["model"])
        ddp, opt, state = setup(model)
        if name == "loaded":
            state.load_state_dict(saved["gradzip"])
        else:
            state.step = saved["gradzip"]["step"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(ddp, opt, range(3, 5))
        params[name] = [p.detach().clone() for p in model.parameters()]
        params[name + "_warnings"] = [str(w.message) for w in caught if "gradzip" in str(w.message)]
        params[name + "_residuals"] = state.state_dict()["residuals"]
        del ddp
    torch.save(params, os.path.join(outdir, f"world_{rank}.pt"))


def mismatched(rank, world, outdir, codecs):
    """Ranks configured with different codecs: every rank must raise at the first step."""
    model = make_model()
    ddp = make_ddp(model, {})
    ddp.register_comm_hook(CompressionState(codecs[rank], min_compress_numel=0), compress_hook)
    err = None
    try:
        loss_fn(ddp, *batch(0, rank)).backward()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        err = f"{type(e).__name__}: {e}"
    with open(os.path.join(outdir, f"mismatch_{rank}.txt"), "w") as f:
        f.write(err or "NO ERROR")


def session(rank, world, outdir, plan):
    """Runs several scenarios in one set of processes (spawning ranks costs seconds each)."""
    for name, args in plan:
        globals()[name](rank, world, outdir, *args)
        dist.barrier()


def dead_peer(rank, world, outdir):
    """The last rank exits before step 2's backward; the others must get an error from it."""
    _lose_last_rank(rank, world, os.path.join(outdir, f"dead_{rank}.txt"), None, stall_s=0)


def stuck_peer(rank, world, outdir):
    """The last rank stops answering (alive, asleep) at step 2; the others must fail within the
    timeout of the hook's process group (5 s), not wait for Gloo's default of 30 minutes."""
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    _lose_last_rank(rank, world, os.path.join(outdir, f"stuck_{rank}.txt"), group, stall_s=30)


def _lose_last_rank(rank, world, path, group, stall_s):
    """Trains with compress_hook on `group`; the last rank sleeps stall_s and exits at step 2. Each
    other rank writes to `path` how long its failing backward waited and the error it got."""
    import time

    model = make_model()
    ddp = make_ddp(model, {})
    ddp.register_comm_hook(CompressionState("int8", process_group=group, min_compress_numel=32),
                           compress_hook)
    message, waited = "NO ERROR", 0.0
    for step in range(4):
        if rank == world - 1 and step == 2:
            time.sleep(stall_s)
            os._exit(0)
        t0 = time.monotonic()
        try:
            loss_fn(ddp, *batch(step, rank)).backward()
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            message, waited = f"{type(e).__name__}: {e}", time.monotonic() - t0
            break
    with open(path, "w") as f:
        f.write(f"{waited:.1f}\n{message}")
    os._exit(0)  # the group has lost a member: no barrier, no teardown
