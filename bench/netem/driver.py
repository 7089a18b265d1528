"""Python side of bench/netem/run.sh: one DDP (or FSDP2) rank, the no-communication baseline, the
report.

  driver.py rank   --rank R --addr A --port P --ifname IF --hook H --json OUT ...   (in a netns)
  driver.py single --json OUT ...                                  the step with no communication
  driver.py report --dir DIR --rate 1gbit [--delay 1ms]          results.csv / results.md

Every rank trains the same gradzip_converge model (ViT/14 + DPT head) on procedural RGB-D scenes
with SILog and AdamW for --warmup + --steps steps and records the wall time of each step (forward,
backward including DDP's communication, optimizer) and the bytes its interface sent during the
timed steps (the kernel's counter: real bytes on the wire, TCP/IP and Ethernet headers included).
Scenes are rendered before the first step, as a data loader would have them ready.

``--model lm-s`` (any of the harness's byte-level language models) trains it on windows of the
harness's text (cpu-lm's data, the same batches as its workers') with cross-entropy instead.
Hooks named ``local:CODEC:H`` train without DDP: each rank its own replica, synced every H steps
by gradzip.local_steps.LocalSteps with CODEC carrying the outer gradient; their step time is the
mean over the timed steps (a sync every H of them), not the median.

Hooks named ``two-level:CODEC`` register gradzip.two_level's TwoLevelState (exact inside a
"node", CODEC between nodes); run.sh's ``--ranks-per-node R`` puts R ranks in each of its two
network namespaces (the nodes: their ranks talk over the namespace's own loopback, unshaped, and
to the other node over the shaped link), 2R ranks in all.

Hooks named ``fsdp-*`` train the model under FSDP2 instead (``fully_shard`` on every encoder block
and the root): ``fsdp-none`` is FSDP's own fp32 reduce-scatter, ``fsdp-torch-bf16`` FSDP with a
bf16 reduce dtype (PyTorch's bar), ``fsdp-CODEC`` gradzip.fsdp's compressed reduce-scatter
(``fsdp-CODEC+params=PCODEC``: and its compressed parameter all-gather, gradzip.fsdp's
``param_codec``). Their rows compare against ``fsdp-none`` and ``fsdp-torch-bf16``; the cost model predicts the DDP rows
only.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch


def parse_rate_gbit(rate: str) -> float:
    """tc rate syntax (1gbit, 500mbit, 100kbit, 2Gbit) -> Gbit/s."""
    r = rate.strip().lower()
    for suffix, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6), ("bit", 1e-9)):
        if r.endswith(suffix):
            return float(r[: -len(suffix)]) * scale
    raise ValueError(f"rate {rate!r}: expected a number followed by gbit, mbit or kbit")


def parse_delay_s(delay: str) -> float:
    """tc time syntax (1ms, 500us, 0.1s; '' = none) -> seconds."""
    d = delay.strip().lower()
    for suffix, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if d.endswith(suffix):
            return float(d[: -len(suffix)]) * scale
    if d:
        raise ValueError(f"delay {delay!r}: expected a number followed by us, ms or s")
    return 0.0


# --- training ---------------------------------------------------------------------------------------


def make_batches(args, rank: int, world: int, count: int):
    """``count`` batches of this rank, each a function of the model that returns its loss."""
    from gradzip_converge.char_lm import LM_CONFIGS

    if args.model in LM_CONFIGS:
        return lm_batches(args, rank, world, count)
    from gradzip_converge.losses import silog_loss
    from gradzip_converge.scenes import SceneConfig, render_scene

    cfg = SceneConfig(height=args.size, width=args.size)
    batches = []
    for step in range(count):
        scenes = [render_scene(args.seed, (step * world + rank) * args.batch + i, cfg)
                  for i in range(args.batch)]
        rgb = torch.stack([torch.from_numpy(s["rgb"]).permute(2, 0, 1) for s in scenes])
        depth = torch.stack([torch.from_numpy(s["depth"])[None] for s in scenes])
        batches.append(lambda model, rgb=rgb, depth=depth: silog_loss(model(rgb), depth))
    return batches


def lm_batches(args, rank: int, world: int, count: int):
    """The language model's batches: the harness's text (cpu-lm's), the harness's windows."""
    from gradzip_converge.tasks import task_of
    from gradzip_converge.text import STDLIB_DOCSTRINGS
    from gradzip_converge.training import RunConfig, batch_indices, load_data

    cfg = RunConfig(model=args.model, data=STDLIB_DOCSTRINGS, workers=world,
                    batch_per_worker=args.batch, seed=args.seed)
    task = task_of(args.model)
    train_data, _ = load_data(cfg)
    n = task.train_size(cfg, train_data)
    b = args.batch
    return [lambda model, idx=batch_indices(args.seed, step, n, world * b)[rank * b:(rank + 1) * b]:
            task.shard_loss(model, cfg, train_data, idx, torch.device("cpu"))
            for step in range(count)]


def build(args):
    from gradzip_converge.zoo import build as build_model

    torch.manual_seed(args.seed)
    return build_model(args.model)


LOCAL_PREFIX = "local:"


def local_steps_of(hook: str) -> tuple[str, int] | None:
    """(codec, H) of a ``local:CODEC:H`` hook, else None."""
    if not hook.startswith(LOCAL_PREFIX):
        return None
    codec, _, h = hook[len(LOCAL_PREFIX):].rpartition(":")
    if not codec or not h.isdigit() or int(h) < 1:
        raise ValueError(f"hook {hook!r}: expected local:CODEC:H with H >= 1 (e.g. local:int8:10)")
    return codec, int(h)


TWO_LEVEL_PREFIX = "two-level:"


def register_hook(ddp, hook: str, guard_nonfinite: bool = False, ranks_per_node: int = 1):
    """Registers the named hook on a DDP model; returns its state (or None). gradzip's
    guard_nonfinite (residual copies that let AMP's GradScaler skip an overflow step) is off by
    default here: this benchmark trains in fp32 without a GradScaler, where it only costs time."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "none":
        return None
    if hook == "nocomm":
        ddp.register_comm_hook(None, local_hook)
        return None
    if hook == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if hook == "torch-bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return None
    if hook.startswith("powersgd"):
        rank = int(hook.split(":")[1]) if ":" in hook else 1
        # start_powerSGD_iter must be > 1 with error feedback; the warm-up steps cover it.
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=2, random_seed=0)
        ddp.register_comm_hook(state, serialized(powerSGD_hook.powerSGD_hook))
        return state
    from gradzip import costmodel as cm
    from gradzip.ddp import CompressionState, compress_hook

    if hook.startswith(TWO_LEVEL_PREFIX):
        from gradzip.two_level import TwoLevelState

        spec, cast_sum = cm.split_cast_sum(hook[len(TWO_LEVEL_PREFIX):])
        state = TwoLevelState(spec, ranks_per_node=ranks_per_node, guard_nonfinite=guard_nonfinite,
                              cast_sum=cast_sum)
        ddp.register_comm_hook(state, compress_hook)
        return state
    spec, cast_sum = cm.split_cast_sum(hook)  # SPEC@fp32: cast_sum="fp32"
    state = CompressionState(spec, guard_nonfinite=guard_nonfinite, cast_sum=cast_sum)
    ddp.register_comm_hook(state, compress_hook)
    return state


def local_hook(state, bucket):  # no annotations: DDP checks them against the real classes
    """Communicates nothing: each rank keeps its own gradient. Measures the floor any hook can
    reach with two ranks on this machine (both ranks' compute sharing its cores, DDP's own work)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def serialized(hook):
    """The hook, finished before it returns. PowerSGD issues its P and Q all-reduces from the
    callbacks of earlier futures, i.e. from Gloo's threads, while DDP issues the next bucket's
    all-reduce from the autograd thread: the two ranks can issue them in different orders, and
    Gloo then fails ("Received data size doesn't match expected size") or hangs. Reproduced with
    torch 2.11 on a 16-layer MLP with 1 MB buckets. Waiting here fixes the order (and costs the
    overlap of this hook's communication with the rest of the backward pass)."""

    def hook_serialized(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut

    return hook_serialized


def tx_bytes(ifname: str | None) -> int:
    if not ifname:
        return 0
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def train(model, opt, batches, outer=None) -> tuple[list[float], list[float]]:
    """One optimizer step per batch (and the local-steps outer loop's step, where given);
    returns each step's wall time and loss."""
    times, losses = [], []
    for loss_of in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model)
        loss.backward()
        opt.step()
        if outer is not None:
            outer.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return times, losses


FSDP_PREFIX = "fsdp-"


def fsdp_codecs(hook: str) -> tuple[str, str | None]:
    """(reduce-scatter codec, parameter all-gather codec or None) of an ``fsdp-*`` hook:
    ``fsdp-CODEC`` or ``fsdp-CODEC+params=PCODEC`` (gradzip.fsdp's ``param_codec``)."""
    codec, _, params = hook[len(FSDP_PREFIX):].partition("+params=")
    return codec, params or None


def build_fsdp(args, hook: str, guard_nonfinite: bool):
    """The model under FSDP2 for an ``fsdp-*`` hook (see the module's docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(args)
    codec, param_codec = fsdp_codecs(hook)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if codec == "torch-bf16" else \
        MixedPrecisionPolicy()
    for block in model.encoder.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if codec not in ("none", "torch-bf16"):
        import gradzip.fsdp

        gradzip.fsdp.compress(model, codec, guard_nonfinite=guard_nonfinite,
                              param_codec=param_codec)
    return model


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def cmd_rank(args) -> int:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(args.threads)
    if not args.hook.startswith(("none", "torch-", "powersgd", "fsdp-none", "fsdp-torch-")):
        import gradzip

        gradzip.set_num_threads(args.threads)  # the codecs get the rank's share of the cores too
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    # torchrun's node layout variables (gradzip.two_level reads them)
    os.environ["LOCAL_RANK"] = str(args.rank % args.ranks_per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(args.ranks_per_node)
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout))
    batches = make_batches(args, args.rank, args.world, args.warmup + args.steps)
    outer = None
    if args.hook.startswith(FSDP_PREFIX):
        ddp = build_fsdp(args, args.hook, args.guard_nonfinite)
    elif (local := local_steps_of(args.hook)) is not None:
        from gradzip.local_steps import LocalSteps

        ddp = build(args)  # each rank's own replica
        outer = LocalSteps(ddp.parameters(), local[0], sync_every=local[1],
                           guard_nonfinite=args.guard_nonfinite)
    else:
        ddp = DDP(build(args))  # DDP's defaults: 25 MB buckets, every parameter used
        register_hook(ddp, args.hook, args.guard_nonfinite, args.ranks_per_node)
    opt = optimizer(ddp)
    _, warm_losses = train(ddp, opt, batches[: args.warmup], outer)
    # The timed window: the bytes sent from the end of the warm-up to the end of the last step.
    dist.barrier()
    tx0 = tx_bytes(args.ifname)
    times, losses = train(ddp, opt, batches[args.warmup:], outer)
    tx1 = tx_bytes(args.ifname)
    dist.barrier()
    dist.destroy_process_group()
    module = getattr(ddp, "module", ddp)
    shapes = [list(p.shape) for p in module.parameters() if p.requires_grad]
    write_json(args.json, dict(hook=args.hook, rank=args.rank, step_times=times,
                               tx_bytes_per_step=(tx1 - tx0) / max(1, len(times)),
                               loss_first=warm_losses[0], loss_last=losses[-1], shapes=shapes,
                               model=args.model, size=args.size, batch=args.batch,
                               threads=args.threads, guard_nonfinite=args.guard_nonfinite,
                               world=args.world, ranks_per_node=args.ranks_per_node))
    return 0


def cmd_single(args) -> int:
    torch.set_num_threads(args.threads)
    batches = make_batches(args, 0, 1, args.warmup + args.steps)
    model = build(args)
    opt = optimizer(model)
    _, warm_losses = train(model, opt, batches[: args.warmup])
    times, losses = train(model, opt, batches[args.warmup:])
    write_json(args.json, dict(hook="no-comm", step_times=times, tx_bytes_per_step=0,
                               loss_first=warm_losses[0], loss_last=losses[-1],
                               threads=args.threads))
    return 0


def write_json(path: str, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


# --- report -----------------------------------------------------------------------------------------


def measured_speeds(hooks, threads: int):
    """gradzip's codec throughput measured here with the ranks' thread count, where its ops are
    importable; else none (the model then charges no codec compute, and the report says so)."""
    from gradzip import costmodel as cm

    try:
        import gradzip

        gradzip.set_num_threads(threads)
        return cm.codec_speeds(hooks, measure=True), \
            f"codec speed measured via gradzip ops ({threads} thread(s))"
    except Exception as e:  # noqa: BLE001 - any failure means: no measurement available
        return {h: None for h in hooks}, f"codec compute not modelled ({type(e).__name__}: {e})"


def cmd_report(args) -> int:
    from gradzip import costmodel as cm

    out = Path(args.dir)
    raw = out / "raw"
    hooks = [h for h in args.hooks.split(",") if h]
    single = _load(raw / "single.json")
    nocomm = statistics.median(single["step_times"]) if single else math.nan
    rows = []
    for h in hooks:
        ranks = [_load(raw / f"{_safe(h)}.rank{r}.json") for r in range(args.world)]
        if not all(ranks):
            rows.append(dict(hook=h, ok=False))
            continue
        # a local-steps hook syncs once every H steps: its step time is the mean
        med = (statistics.mean if local_steps_of(h) else statistics.median)(ranks[0]["step_times"])
        tx = statistics.mean(r["tx_bytes_per_step"] for r in ranks)
        rows.append(dict(hook=h, ok=True, median=med, bytes=tx, shapes=ranks[0]["shapes"],
                         loss=ranks[0]["loss_last"], threads=ranks[0]["threads"]))
    base = {r["hook"]: r for r in rows if r["ok"]}
    t_none = base["none"]["median"] if "none" in base else math.nan
    t_bf16 = base["torch-bf16"]["median"] if "torch-bf16" in base else math.nan
    # FSDP rows against FSDP's own reduce-scatter, fp32 and bf16
    f_none = base["fsdp-none"]["median"] if "fsdp-none" in base else math.nan
    f_bf16 = base["fsdp-torch-bf16"]["median"] if "fsdp-torch-bf16" in base else math.nan

    rate = parse_rate_gbit(args.rate)
    link = cm.Link(rate, latency_s=args.alpha_us * 1e-6 + parse_delay_s(args.delay),
                   efficiency=args.efficiency)
    okrows = [r for r in rows if r["ok"]]
    per_node = args.world // 2  # two namespaces, the nodes
    intra = cm.Link(args.intra_gbps, latency_s=args.alpha_us * 1e-6, efficiency=args.efficiency)
    modelled = [h for h in hooks if h != "nocomm" and not h.startswith(FSDP_PREFIX)]
    # a local:CODEC:H hook runs its codec's reduction, two-level:CODEC its codec's between the
    # nodes: each codec measured once
    codec_of = {h: (local_steps_of(h) or (h.removeprefix(TWO_LEVEL_PREFIX),))[0] for h in modelled}
    by_codec, speed_note = measured_speeds(sorted(set(codec_of.values())),
                                           okrows[0]["threads"] if okrows else 1)
    speeds = {h: by_codec.get(codec) for h, codec in codec_of.items()}
    for r in okrows:
        fsdp = r["hook"].startswith(FSDP_PREFIX)
        hook = r["hook"]
        if fsdp:
            pred = cm.Cost(seconds=math.nan, sent_bytes=math.nan)
        elif hook == "nocomm":
            pred = cm.Cost()
        else:
            buckets = cm.ddp_buckets([tuple(s) for s in r["shapes"]])
            local = local_steps_of(hook)
            two_level = hook.startswith(TWO_LEVEL_PREFIX)
            pred = cm.step_cost(codec_of[hook], buckets, args.world, link, speeds.get(hook),
                                per_node=per_node, intra=intra if two_level else None)
            if local is not None:  # one sync every H steps
                pred = cm.Cost(seconds=pred.seconds / local[1], sent_bytes=pred.sent_bytes / local[1])
        r.update(pred_comm=pred.seconds, pred_bytes=pred.sent_bytes,
                 pred_step=nocomm + pred.seconds, overhead=r["median"] - nocomm,
                 speedup=(f_none if fsdp else t_none) / r["median"],
                 vs_bf16=(f_bf16 if fsdp else t_bf16) / r["median"])

    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["hook", "step_time_s_median", "bytes_per_step", "speedup_vs_allreduce"])
        for r in rows:
            if r["ok"]:
                w.writerow([r["hook"], f"{r['median']:.6f}", f"{r['bytes']:.0f}",
                            f"{r['speedup']:.4f}"])
            else:
                w.writerow([r["hook"], "nan", "nan", "nan"])
    with open(out / "costmodel.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["hook", "measured_step_s", "nocomm_step_s", "measured_overhead_s",
                    "predicted_comm_s", "predicted_step_s", "measured_bytes_per_step",
                    "predicted_bytes_per_step"])
        for r in okrows:
            w.writerow([r["hook"], f"{r['median']:.6f}", f"{nocomm:.6f}", f"{r['overhead']:.6f}",
                        f"{r['pred_comm']:.6f}", f"{r['pred_step']:.6f}", f"{r['bytes']:.0f}",
                        f"{r['pred_bytes']:.0f}"])

    cfg = _load(raw / f"{_safe(okrows[0]['hook'])}.rank0.json") if okrows else {}
    md = [f"# Bandwidth benchmark: {args.world} ranks (Gloo, {per_node} per network namespace), "
          f"link {args.rate}" + (f" + {args.delay} delay" if args.delay else ""),
          "",
          f"Model {cfg.get('model')}, input {cfg.get('size')}x{cfg.get('size')}, batch "
          f"{cfg.get('batch')} per rank, {cfg.get('threads')} thread(s) per rank, gradzip "
          f"guard_nonfinite={cfg.get('guard_nonfinite')}; "
          f"{len(okrows[0]['shapes']) if okrows else 0} parameter tensors. "
          f"Step with no communication (single process, same threads): **{nocomm:.3f} s**.",
          f"Cost model: alpha {link.latency_s * 1e6:.0f} us, efficiency {link.efficiency:g}, "
          f"{speed_note}; predicted step = no-comm step + predicted communication (no overlap). "
          "Bytes: measured = the interface's tx counter (headers included) over the timed steps. "
          "fsdp-* rows (FSDP2, reduce-scatter + all-gather): 'vs all-reduce' is against fsdp-none "
          "(FSDP's own fp32 reduce-scatter), 'vs torch bf16' against fsdp-torch-bf16 (FSDP's bf16 "
          "reduce dtype); the cost model predicts the DDP rows only"
          + (f" (each namespace a node of {per_node} ranks sharing the link, their traffic "
             f"inside it charged at {args.intra_gbps:g} Gbit/s to the two-level rows only; the "
             "bytes are each namespace's, all of its ranks together)." if per_node > 1 else "."),
          "",
          "| hook | step s (median) | bytes/step sent per rank | vs all-reduce | vs torch bf16 "
          "| predicted comm s | measured overhead s | predicted step s | predicted bytes/step |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["ok"]:
            md.append(f"| {r['hook']} | failed | | | | | | | |")
            continue
        md.append(f"| {r['hook']} | {r['median']:.3f} | {r['bytes'] / 1e6:.2f} MB | "
                  f"{r['speedup']:.2f}x | {r['vs_bf16']:.2f}x | {r['pred_comm']:.3f} | "
                  f"{r['overhead']:.3f} | {r['pred_step']:.3f} | {r['pred_bytes'] / 1e6:.2f} MB |")
    md += ["", "## Targets", ""] + [f"- {t}" for t in targets(base, t_none, t_bf16, hooks)]
    if per_node > 1:
        md += [f"- {t}" for t in two_level_targets(base, t_bf16, hooks)]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print((out / "results.md").read_text())
    return 0 if all(r["ok"] for r in rows) else 1


def targets(base, t_none, t_bf16, hooks) -> list[str]:
    """The DDP hooks' targets at 1 Gbit/s, each stated as met or not from the measured medians
    (``hooks``: those this run was asked for)."""
    lines = []

    def check(hook, min_vs_none, min_vs_bf16, strict_bf16=False):
        if hook not in base:
            lines.append(f"{hook}: not measured ({'run failed' if hook in hooks else 'not in --hooks'})")
            return
        a, b = t_none / base[hook]["median"], t_bf16 / base[hook]["median"]
        ok = a >= min_vs_none and (b > min_vs_bf16 if strict_bf16 else b >= min_vs_bf16)
        want = f"{'>' if strict_bf16 else '>='} {min_vs_bf16:g}x"
        lines.append(f"{hook}: {a:.2f}x all-reduce (target >= {min_vs_none:g}x), {b:.2f}x torch "
                     f"bf16 hook (target {want}): **{'met' if ok else 'NOT met'}**")

    check("topk:0.01", 3.0, 1.5)
    check("sign", 3.0, 1.5)
    check("int8", 2.0, 1.0, strict_bf16=True)
    return lines


def two_level_targets(base, t_bf16, hooks) -> list[str]:
    """The two-level reduction's targets on 2 nodes: two-level int8 at least 1.5x the flat int8
    step and 1.3x PyTorch's bf16 hook."""
    flat, two = base.get("int8"), base.get(TWO_LEVEL_PREFIX + "int8")
    if flat is None or two is None:
        return [f"{TWO_LEVEL_PREFIX}int8 vs int8: not measured (both must be in --hooks and run)"]
    a, b = flat["median"] / two["median"], t_bf16 / two["median"]
    ok = a >= 1.5 and b >= 1.3
    return [f"{TWO_LEVEL_PREFIX}int8: {a:.2f}x the flat int8 step (target >= 1.5x), {b:.2f}x torch "
            f"bf16 hook (target >= 1.3x): **{'met' if ok else 'NOT met'}**"]


def _safe(hook: str) -> str:
    return hook.replace(":", "_")


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_hooks(hooks: str) -> int:
    from gradzip import costmodel as cm

    names = [h for h in hooks.split(",") if h]
    if not names:
        print("netem: --hooks is empty", file=sys.stderr)
        return 2
    for h in names:
        if h == "nocomm":
            continue
        try:
            local = local_steps_of(h)
        except ValueError as e:
            print(f"netem: {e}", file=sys.stderr)
            return 2
        if local is not None:
            h = local[0]
        elif h.startswith(TWO_LEVEL_PREFIX):
            h = h[len(TWO_LEVEL_PREFIX):]
        elif h.startswith(FSDP_PREFIX):
            codec, param_codec = fsdp_codecs(h)
            if codec in ("none", "torch-bf16"):
                if param_codec is None:
                    continue
                print(f"netem: hook {h!r}: +params= needs a gradzip codec for the reduce-scatter "
                      "(fsdp-CODEC+params=PCODEC)", file=sys.stderr)
                return 2
            if param_codec is not None:
                from gradzip.param_gather import param_codec as check_param_codec

                try:
                    check_param_codec(param_codec)
                except ValueError as e:
                    print(f"netem: hook {h!r}: {e}", file=sys.stderr)
                    return 2
            h = codec
        try:
            cm.Codec.parse(h)
        except ValueError as e:
            print(f"netem: hook {h!r}: {e} (known: {', '.join(cm.BENCH_HOOKS)}, nocomm, any "
                  "gradzip codec spec, fsdp-none, fsdp-torch-bf16 or fsdp-CODEC)", file=sys.stderr)
            return 2
    return 0


# --- CLI --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("rank", "single"):
        p = sub.add_parser(name)
        p.add_argument("--json", required=True)
        p.add_argument("--model", default="vit-s14")
        p.add_argument("--size", type=int, default=56)
        p.add_argument("--batch", type=int, default=1)
        p.add_argument("--steps", type=int, default=6)
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--seed", type=int, default=0)
        if name == "rank":
            p.add_argument("--rank", type=int, required=True)
            p.add_argument("--world", type=int, default=2)
            p.add_argument("--ranks-per-node", type=int, default=1,
                           help="ranks in each network namespace (the node layout)")
            p.add_argument("--addr", required=True)
            p.add_argument("--port", type=int, required=True)
            p.add_argument("--ifname", required=True)
            p.add_argument("--hook", required=True)
            p.add_argument("--timeout", type=float, default=300)
            p.add_argument("--guard-nonfinite", action="store_true",
                           help="gradzip hooks: keep CompressionState's non-finite guard on")
    p = sub.add_parser("report")
    p.add_argument("--dir", required=True)
    p.add_argument("--rate", required=True)
    p.add_argument("--delay", default="", help="tc netem delay, e.g. 1ms (added to alpha)")
    p.add_argument("--hooks", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--intra-gbps", type=float, default=20.0,
                   help="the cost model's link between the ranks of a namespace (its loopback)")
    p.add_argument("--alpha-us", type=float, default=100.0,
                   help="per-message latency of Gloo over TCP on a veth, besides --delay-ms")
    p.add_argument("--efficiency", type=float, default=0.95)
    p = sub.add_parser("check-hooks", help="exit 2 naming the first hook name that is not known")
    p.add_argument("hooks")
    args = ap.parse_args(argv)
    if args.cmd == "check-hooks":
        return check_hooks(args.hooks)
    if args.cmd in ("rank", "single") and (args.size % 14 or args.size <= 0 or args.steps < 1
                                           or args.warmup < 2 or args.batch < 1):
        ap.error("--size must be a positive multiple of 14, --steps >= 1, --warmup >= 2 "
                 "(DDP rebuilds its buckets after step 1; PowerSGD starts at step 2)")
    return {"rank": cmd_rank, "single": cmd_single, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
