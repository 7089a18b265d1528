"""What each Gloo rank runs for test_fsdp_adam.py: FrozenVarianceAdamW under FSDP2
(``gradzip.fsdp.compress(..., optimizer=opt)``) on fsdp_scenarios' model (odd sizes that FSDP
pads); every scenario saves what it saw to outdir/<name>_<rank>.pt."""

import copy
import io

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import gradzip.fsdp
from fsdp_scenarios import _save, full_params, local_params, loss_of, make_model
from gradzip.optim import CompressedSGD, FrozenVarianceAdamW

LR, WD, WARMUP = 1e-2, 0.01, 3
# reductions(): (codec, with FrozenVarianceAdamW, uncompressed_numel)
REDUCTIONS = [("sign", True, 0), ("sign", True, 1), ("sign", False, 0)]


def build(codec, denominator_dtype="bf16", warmup=WARMUP, policy=None, **kw):
    model = make_model(policy)
    opt = FrozenVarianceAdamW(model.parameters(), lr=LR, weight_decay=WD)
    state = gradzip.fsdp.compress(model, codec, warmup_steps=warmup, min_compress_numel=0,
                                  optimizer=opt, denominator_dtype=denominator_dtype, **kw)
    return model, opt, state


def run(model, opt, rank, first, last):
    for step in range(first, last):
        loss_of(model, step, rank).backward()
        opt.step()
        opt.zero_grad()


def adam_state(state):
    """Per group: this rank's m, v (its shard), the whole group's denominator, the counts."""
    return {i: d["adam"] for i, d in state.state_dict()["groups"].items()}


def trajectory(rank, world, outdir, configs, steps=6):
    """Per (codec, denominator dtype): the full parameters after each step and the Adam state
    at the end, for the float64 reference and the one-state checks."""
    out = {}
    for codec, dtype in configs:
        model, opt, state = build(codec, dtype)
        params = [full_params(model)]
        for step in range(steps):
            run(model, opt, rank, step, step + 1)
            params.append(full_params(model))
        out[(codec, dtype)] = {"params": params, "adam": adam_state(state),
                               "local": local_params(model)}
    _save(outdir, "trajectory", rank, out)


def resume(rank, world, outdir, codecs, steps=6, stops=(2, 4)):
    """Training stopped after each of ``stops`` steps (before and after the freeze): the model's
    shards, the optimizer's and the gradzip state's state_dict (the latter through a pickle of it)
    loaded into fresh objects; the shards at the end against the uninterrupted run's."""
    out = {}
    for codec in codecs:
        model, opt, state = build(codec)
        run(model, opt, rank, 0, steps)
        uninterrupted = local_params(model)
        for at in stops:
            model, opt, state = build(codec)
            run(model, opt, rank, 0, at)
            saved = {"params": local_params(model), "opt": copy.deepcopy(opt.state_dict())}
            buf = io.BytesIO()
            torch.save(state, buf)  # the state pickles, its optimizer's direction with it
            buf.seek(0)
            model, opt, state = build(codec)
            with torch.no_grad():
                for p, v in zip(model.parameters(), saved["params"]):
                    p.to_local().copy_(v)
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(torch.load(buf, weights_only=False).state_dict())
            run(model, opt, rank, at, steps)
            out[(codec, at)] = {"uninterrupted": uninterrupted, "resumed": local_params(model)}
    _save(outdir, "resume", rank, out)


def nonfinite(rank, world, outdir, codec, bad_steps=(1, 4), steps=6):
    """Rank 0's gradient is NaN at ``bad_steps`` (one in the warm-up, one after the freeze): the
    sharded gradients (the update) show it on every rank, m, v and the residual keep their values
    of before the step, which the loop skips (as GradScaler would)."""
    model, opt, state = build(codec)
    log = []
    for step in range(steps):
        before = state.state_dict()["groups"]
        scale = float("nan") if step in bad_steps and rank == 0 else 1.0
        loss_of(model, step, rank, scale).backward()
        finite = all(torch.isfinite(p.grad.to_local()).all().item() for p in model.parameters())
        after = state.state_dict()["groups"]  # commits the step: restores a non-finite one
        kept = all(torch.equal(before[i][k], after[i][k]) if k == "residual" else
                   torch.equal(before[i]["adam"][k], after[i]["adam"][k])
                   for i in before for k in ("residual", "m", "v")) if before else False
        log.append({"finite": finite, "kept": kept})
        if finite:
            opt.step()
        opt.zero_grad()
    _save(outdir, "nonfinite", rank, {"log": log, "params": local_params(model)})


def memory(rank, world, outdir, rows, cols):
    """Bytes of the state this rank keeps after the freeze, per tensor kind, with one
    rows x cols matrix (rows a multiple of W: no padding) and sign."""
    torch.manual_seed(0)
    model = torch.nn.Linear(cols, rows, bias=False)
    fully_shard(model)
    opt = FrozenVarianceAdamW(model.parameters())
    state = gradzip.fsdp.compress(model, "sign", warmup_steps=1, optimizer=opt)
    for step in range(2):
        model(torch.randn(4, cols)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    (group,) = state.state_dict()["groups"].values()
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    _save(outdir, "memory", rank, {"residual": size(group["residual"]),
                                   "owner_residual": size(group["owner_residual"]),
                                   **{k: size(group["adam"][k])
                                      for k in ("m", "v", "denominator", "m_over_den")}})


def refused(rank, world, outdir):
    """The messages of configurations compress(..., optimizer=...) refuses."""
    out = {}

    def attempt(name, make):
        try:
            make()
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    def with_optimizer(make_opt, codec="sign", policy=None, backward=False):
        model = make_model(policy)
        gradzip.fsdp.compress(model, codec, warmup_steps=1, min_compress_numel=0,
                              optimizer=make_opt(model))
        if backward:
            loss_of(model, 0, rank).backward()

    attempt("torch_adamw", lambda: with_optimizer(
        lambda m: torch.optim.AdamW(m.parameters())))
    attempt("compressed_sgd", lambda: with_optimizer(lambda m: CompressedSGD(m.parameters())))
    attempt("refresh", lambda: with_optimizer(
        lambda m: FrozenVarianceAdamW(m.parameters(), refresh_until=100)))
    attempt("lowrank", lambda: with_optimizer(
        lambda m: FrozenVarianceAdamW(m.parameters()), codec="lowrank:2"))
    attempt("other_params", lambda: with_optimizer(
        lambda m: FrozenVarianceAdamW(list(m.parameters())[:2])))
    attempt("fp16_reduce", lambda: with_optimizer(
        lambda m: FrozenVarianceAdamW(m.parameters()), backward=True,
        policy=MixedPrecisionPolicy(reduce_dtype=torch.float16)))
    _save(outdir, "refused", rank, out)


# dim 0 of 129 rows: FSDP pads the last rank's shard for W = 2 and 3, and the biases' chunks (43
# to 65 elements) include compressed pieces with padding next to the 7-row layer's exact ones
WIDE_ODD = 129


def reductions(rank, world, outdir, configs, steps=6):
    """Every call of the compressed reduce-scatter, per (codec, with optimizer, uncompressed_numel):
    the step count and op it saw, its input before and after (the gradient FSDP gives, then what
    the rank sends), the group's residuals (worker and owner), m and m over the denominator before
    and after, the frozen denominator and the
    output (the sharded update or gradient); per step the sharded gradients and the parameters
    before and after opt.step(). The test recomputes each call from these, independently."""
    out = {}
    for codec, with_opt, uncompressed in configs:
        model = make_model(hidden=WIDE_ODD)
        opt = (FrozenVarianceAdamW if with_opt else torch.optim.SGD)(model.parameters(), lr=LR,
                                                                       weight_decay=WD)
        state = gradzip.fsdp.compress(model, codec, warmup_steps=WARMUP, min_compress_numel=0,
                                      optimizer=opt if with_opt else None,
                                      uncompressed_numel=uncompressed)
        calls, reduce, now = [], state._reduce_scatter, [0]
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731

        def spy(index, output, input, group, op, async_op, divide_factor, calls=calls,
                reduce=reduce, state=state, now=now):
            st = state._groups.get(index)
            adam = None if st is None else st.adam
            call = {"train_step": now[0], "step": state.step, "index": index, "op": str(op),
                    "divide": divide_factor, "async": async_op, "input": clone(input),
                    "residual": None if st is None else clone(st.residual),
                    "owner": None if st is None else clone(st.owner_residual),
                    "m": None if adam is None else clone(adam.m),
                    "m_over_den": None if adam is None else clone(adam.m_over_den)}
            result = reduce(index, output, input, group, op, async_op, divide_factor)
            if result is not None:
                result.wait()
            st = state._groups[index]
            call.update(sent=clone(input), output=clone(output), residual_after=clone(st.residual),
                        owner_after=clone(st.owner_residual),
                        m_after=None if st.adam is None else clone(st.adam.m),
                        m_over_den_after=None if st.adam is None else clone(st.adam.m_over_den),
                        denominator=None if st.adam is None else clone(st.adam.denominator),
                        sizes=[p.size for p in state._params[index]])
            calls.append(call)
            return result

        state._reduce_scatter = spy
        per_step = []
        for step in range(steps):
            now[0] = step
            loss_of(model, step, rank).backward()
            before = local_params(model)
            grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            per_step.append({"grads": grads, "before": before, "after": local_params(model)})
        out[(codec, with_opt, uncompressed)] = {"calls": calls, "steps": per_step,
                                                "groups": len(state._params)}
    _save(outdir, "reductions", rank, out)
