"""What each Gloo rank runs for test_fsdp.py: FSDP2 (``fully_shard``) models with and without
gradzip's compressed reduce-scatter; every scenario saves what it saw to outdir/<name>_<rank>.pt."""

import copy
import io
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

import gradzip.fsdp
import lowrank_scenarios as lr

# dim 0 of 65 and 7 rows: FSDP pads the last rank's shard for W = 2 and 3
IN, HIDDEN, OUT = 33, 65, 7
# A hidden width whose biases keep >= 64 elements on each of 3 ranks: compressed unless
# uncompressed_numel says otherwise (a rank's part of a tensor shorter than that travels in fp32).
WIDE = 200


def plain_model(hidden=HIDDEN):
    """The scenarios' model before fully_shard (its initial parameters, for references)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, OUT))


def make_model(policy=None, divide_factor=None, hidden=HIDDEN):
    model = plain_model(hidden)
    kw = {} if policy is None else {"mp_policy": policy}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if divide_factor is not None:
        for layer in model.modules():  # the factor is each FSDP module's own
            if isinstance(layer, FSDPModule):
                layer.set_gradient_divide_factor(divide_factor)
    return model


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, IN, generator=g)
    return x, torch.randn(16, OUT, generator=g)


def loss_of(model, step, rank, scale=1.0):
    x, y = batch(step, rank)
    return (model(x) - y).pow(2).mean() * scale


def local_grads(model):
    return [p.grad.to_local().detach().clone() for p in model.parameters()]


def local_params(model):
    return [p.detach().to_local().clone() for p in model.parameters()]


def full_params(model):
    return [p.detach().full_tensor().clone() for p in model.parameters()]


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def compress(model, codec):
    """gradzip.fsdp.compress for a scenario's codec name: "SPEC[+compact][+nodes]": +compact keeps
    the residuals in bfloat16 (residual_dtype), +nodes reduces in two levels over nodes of 2
    ranks (ranks_per_node=2)."""
    spec, *options = codec.split("+")
    return gradzip.fsdp.compress(model, spec, min_compress_numel=0,
                                 residual_dtype=torch.bfloat16 if "compact" in options
                                 else torch.float32,
                                 ranks_per_node=2 if "nodes" in options else 1)


def _save(outdir, name, rank, obj):
    torch.save(obj, os.path.join(outdir, f"{name}_{rank}.pt"))


def step0(rank, world, outdir, codecs):
    """Step-0 sharded gradients of each codec next to uncompressed FSDP2's, under FSDP's default
    policy (an AVG reduce-scatter), bf16 and fp16 reduce dtypes (fp16: FSDP divides before and
    after a SUM) and a gradient divide factor of 1 (a PREMUL_SUM op, which Gloo lacks: there the
    reference is W x the default's)."""
    policies = {"default": (None, None),
                "reduce_bf16": (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), None),
                "reduce_fp16": (MixedPrecisionPolicy(reduce_dtype=torch.float16), None),
                "divide_1": (None, 1.0)}
    out = {}
    for pname, (policy, factor) in policies.items():
        if factor is None:
            model = make_model(policy)
            loss_of(model, 0, rank).backward()
            out[(pname, None)] = local_grads(model)
        else:
            out[(pname, None)] = [g * world / factor for g in out[("default", None)]]
        for codec in codecs:
            model = make_model(policy, factor)
            state = compress(model, codec)
            loss_of(model, 0, rank).backward()
            out[(pname, codec)] = local_grads(model)
            out[(pname, codec, "stats")] = state.stats
    _save(outdir, "step0", rank, out)


def uncompressed(rank, world, outdir, codecs):
    """Step-0 sharded gradients with the biases sent in fp32 (uncompressed_numel=1: the 1-D
    tensors), all compressed, and uncompressed FSDP2's."""
    model = make_model(hidden=WIDE)
    loss_of(model, 0, rank).backward()
    out = {None: local_grads(model)}
    for codec in codecs:
        for u in (0, 1):
            model = make_model(hidden=WIDE)
            state = gradzip.fsdp.compress(model, codec, min_compress_numel=0, uncompressed_numel=u)
            loss_of(model, 0, rank).backward()
            out[(codec, u)] = local_grads(model)
            out[(codec, u, "stats")] = state.stats
    _save(outdir, "uncompressed", rank, out)


def train(rank, world, outdir, codecs, steps=4):
    """A few optimizer steps per codec and optimizer; the full parameters of every rank."""
    out = {}
    for codec in codecs:
        for opt_name in ("sgd", "adamw"):
            model = make_model()
            if codec is not None:
                compress(model, codec)
            opt = make_optimizer(opt_name, model.parameters())
            losses = []
            for step in range(steps):
                loss = loss_of(model, step, rank)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out[(codec, opt_name)] = {"params": full_params(model), "losses": losses}
    _save(outdir, "train", rank, out)


def nonfinite(rank, world, outdir, codecs):
    """Rank 0's gradient is Inf/NaN at step 1: every rank's sharded gradient must show it, and the
    residuals must be those of before the step (GradScaler skips such a step)."""
    out = {}
    for codec in codecs:
        model = make_model()
        state = compress(model, codec)
        log = []
        for step in range(3):
            scale = float("inf") if (step == 1 and rank == 0) else 1.0
            # lowrank's Q factors are state too: restored with the residuals
            before = {(i, k): t.clone() for i, g in state._groups.items()
                      for k, t in (("residual", g.residual), ("q", g.q)) if t is not None}
            loss_of(model, step, rank, scale).backward()
            grads = local_grads(model)
            saved = state.state_dict()["groups"]  # commits the step
            after = {(i, k): d[k] for i, d in saved.items() for k in ("residual", "q")
                     if d.get(k) is not None}
            log.append({"grads_finite": all(torch.isfinite(g).all().item() for g in grads),
                        "residuals_restored": bool(before) and before.keys() == after.keys() and all(
                            torch.equal(before[k], after[k]) for k in before),
                        "residuals_finite": all(torch.isfinite(r).all().item() for r in after.values())})
            for p in model.parameters():
                p.grad = None
        out[codec] = log
    _save(outdir, "nonfinite", rank, out)


def resume(rank, world, outdir, codecs, steps=4, at=2):
    """Training interrupted after `at` steps (model shards, optimizer and gradzip state saved and
    loaded into fresh objects, the gradzip state also through pickle) against the uninterrupted run."""
    out = {}
    for codec in codecs:
        def build():
            model = make_model()
            state = compress(model, codec)
            return model, state, make_optimizer("adamw", model.parameters())

        def run(model, opt, first, last):
            for step in range(first, last):
                loss_of(model, step, rank).backward()
                opt.step()
                opt.zero_grad()

        model, state, opt = build()
        run(model, opt, 0, steps)
        uninterrupted = local_params(model)

        model, state, opt = build()
        run(model, opt, 0, at)
        saved = {"params": local_params(model), "opt": copy.deepcopy(opt.state_dict()),
                 "gradzip": state.state_dict()}
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        unpickled = torch.load(buf, weights_only=False)
        model, state, opt = build()
        with torch.no_grad():
            for p, v in zip(model.parameters(), saved["params"]):
                p.to_local().copy_(v)
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(unpickled.state_dict())
        run(model, opt, at, steps)
        out[codec] = {"uninterrupted": uninterrupted, "resumed": local_params(model),
                      "saved_step": saved["gradzip"]["step"],
                      "residual_norm": sum(float(d["residual"].norm())
                                           for d in saved["gradzip"]["groups"].values())}
    _save(outdir, "resume", rank, out)


def recorded(rank, world, outdir, codecs, steps=4):
    """SGD steps per codec, every reduce-scatter's input (fp32) and output recorded, then the
    residual of each parameter group: what an error-feedback invariant is checked against."""
    out = {}
    for codec in codecs:
        model = make_model()
        state = compress(model, codec)
        calls, reduce_scatter = [], state._reduce_scatter

        def recording(index, output, input, *args, reduce_scatter=reduce_scatter, calls=calls):
            step, x = state.step, input.detach().float().clone()
            work = reduce_scatter(index, output, input, *args)
            if work is not None:
                work.wait()
            calls.append((step, index, x, output.detach().float().clone()))
            return None

        state._reduce_scatter = recording
        opt = make_optimizer("sgd", model.parameters())
        for step in range(steps):
            loss_of(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
        groups = state.state_dict()["groups"]
        out[codec] = {"calls": calls, "residuals": {i: d["residual"] for i, d in groups.items()},
                      "shards": {i: g.layout.shard for i, g in state._groups.items()}}
    _save(outdir, "recorded", rank, out)


def async_call(rank, world, outdir, codecs):
    """The installed ReduceScatter called with async_op=True returns a Work whose wait() leaves the
    decoded shard in the output (padding included: it starts as NaN); equal to the synchronous
    call of a second, identical state."""
    out = {}
    for codec in codecs:
        results = []
        for async_op in (True, False):
            model = make_model()
            gradzip.fsdp.compress(model, codec, min_compress_numel=0)
            group = model[0]._get_fsdp_state()._fsdp_param_group
            comm = group._reduce_scatter_comm
            shard = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(world * shard, generator=g)
            y = torch.full((shard,), float("nan"))
            work = comm(y, x, dist.group.WORLD, dist.ReduceOp.AVG, async_op=async_op)
            if async_op:
                assert work is not None
                work.wait()
            results.append(y)
        out[codec] = {"async": results[0], "sync": results[1]}
    _save(outdir, "async", rank, out)


def mismatched(rank, world, outdir, codecs):
    model = make_model()
    gradzip.fsdp.compress(model, codecs[rank % len(codecs)], min_compress_numel=0)
    try:
        loss_of(model, 0, rank).backward()
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    with open(os.path.join(outdir, f"mismatch_{rank}.txt"), "w") as f:
        f.write(msg)


def param_gather(rank, world, outdir, codecs):
    """For each parameter codec (None: FSDP's own all-gather): the unsharded parameters each
    Linear sees in its first forward, the exact ones (the shards, gathered uncompressed), the
    all-gather traffic, and the full parameters after 3 AdamW steps. "bf16_params": the same with
    FSDP gathering bf16 parameters (MixedPrecisionPolicy), int8 asked for."""
    out = {}
    runs = [(c, c) for c in codecs] + [("bf16_params", "int8:block=64"), ("bf16_params", None)]
    for key, codec in runs:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if key == "bf16_params" else None
        model = make_model(policy)
        seen = []

        def capture(module, args):  # after FSDP's own pre-forward hook: unsharded parameters
            seen.append([module.weight.detach().float().clone(), module.bias.detach().float().clone()])

        handles = [m.register_forward_pre_hook(capture) for m in model if isinstance(m, nn.Linear)]
        exact = full_params(model)
        state = gradzip.fsdp.compress(model, "int8", param_codec=codec)
        opt = make_optimizer("adamw", model.parameters())
        for step in range(3):
            opt.zero_grad()
            loss_of(model, step, rank).backward()
            opt.step()
            if step == 0:
                for h in handles:
                    h.remove()
        out[(key, codec)] = {"seen": [t for layer in seen[:3] for t in layer], "exact": exact,
                             "traffic": state.all_gather_traffic, "final": full_params(model)}
    try:
        gradzip.fsdp.compress(make_model(), "int8", param_codec="sign")
    except ValueError as e:
        out["refused"] = str(e)
    _save(outdir, "param_gather", rank, out)


# lowrank: test_lowrank's odd shapes in three FSDP groups (compressed matrices, tensors sent
# uncompressed; dim 0 padded at W = 2 and 3, (1, 40) all padding on rank 1), gradients set to
# lowrank_scenarios.grads (loss sum(p * c))
LOWRANK_GROUPS = [lr.SHAPES[:3], lr.SHAPES[3:7], lr.SHAPES[7:]]


class Given(nn.Module):
    """One lowrank_scenarios.Linear per FSDP group."""

    def __init__(self, groups):
        super().__init__()
        self.blocks = nn.ModuleList([lr.Linear(shapes) for shapes in groups])

    def forward(self, cs):
        out, i = 0, 0
        for block in self.blocks:
            out = out + block(cs[i:i + len(block.ps)])
            i += len(block.ps)
        return out


def make_given(**kw):
    model = Given(LOWRANK_GROUPS)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model)
    return model


def lowrank(rank, world, outdir, steps=3, seed=0):
    """lowrank:2 over ``steps`` steps of lowrank_scenarios.grads: each step's sharded gradients,
    residuals and Q factors, the parameters' names (their Q's seeds) and the traffic; then the
    messages of refused configurations."""
    model = make_given()
    state = gradzip.fsdp.compress(model, f"lowrank:{lr.RANK}", min_compress_numel=0)
    out = {"names": [n for n, _ in model.named_parameters()], "grads": [], "state": []}
    for step in range(steps):
        model(lr.grads(lr.SHAPES, step, rank, seed)).backward()
        out["grads"].append(local_grads(model))
        out["state"].append(state.state_dict()["groups"])
        model.zero_grad(set_to_none=True)
    out["stats"] = state.stats
    try:  # one parameter sharded on dim 1
        placement = lambda p: Shard(1) if p.shape == (40, 30) else None  # noqa: E731
        gradzip.fsdp.compress(make_given(shard_placement_fn=placement), f"lowrank:{lr.RANK}")
    except ValueError as e:
        out["refused"] = str(e)
    _save(outdir, "lowrank", rank, out)


def session(rank, world, outdir, plan):
    """Runs several scenarios in one set of processes (spawning ranks costs seconds each): each
    a name of this module's or a function of another scenarios module, with its arguments."""
    for scenario, args in plan:
        fn = scenario if callable(scenario) else globals()[scenario]
        fn(rank, world, outdir, *args)
        dist.barrier()


def load(outdir, name, world):
    """What every rank's scenario ``name`` saved (_save), in rank order."""
    return [torch.load(os.path.join(outdir, f"{name}_{r}.pt"), weights_only=False)
            for r in range(world)]
