"""`python -m gradzip.costmodel`: project each hook's communication time to many workers and links.

Prints, for a model's DDP bucket layout: the predicted communication time per step on a grid of
world sizes x link bandwidths, and for each codec the bandwidth below which it beats the fp32
all-reduce and the bf16 all-reduce (above it, the codec no longer pays for itself).

  python -m gradzip.costmodel                          # vit-l14, 8..1024 workers, 10..400 Gbit/s
  python -m gradzip.costmodel --model vit-s14 --measure   # codec speed timed via gradzip's ops
  python -m gradzip.costmodel --params 1e9             # a flat model of 1e9 parameters
  python -m gradzip.costmodel --ranks-per-node 8       # nodes of 8 GPUs: the link is a node's,
                                                       # and two-level:CODEC columns beside
"""

from __future__ import annotations

import argparse
import sys

from gradzip import costmodel as cm


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """Parameter shapes of a model of the convergence harness, built on the meta device (no
    memory). The harness is a distribution of its own (gradzip-converge, bench/harness)."""
    import torch
    try:
        from gradzip_converge.zoo import build
    except ModuleNotFoundError as e:
        if e.name != "gradzip_converge":
            raise
        raise ImportError("the models come with the convergence harness: pip install "
                          "./bench/harness in a gradzip checkout") from None

    with torch.device("meta"):
        model = build(name)
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def flat_shapes(params: int, width: int = 4096) -> list[tuple[int, ...]]:
    """A stand-in model: square-ish matrices of width x width, then a remainder vector."""
    shapes = [(width, width)] * (params // (width * width))
    rest = params - sum(a * b for a, b in shapes)
    return shapes + ([(rest,)] if rest else [])


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m gradzip.costmodel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit-l14", help="a convergence-harness model (default vit-l14)")
    ap.add_argument("--params", type=float, help="instead of --model: a flat model of N params")
    ap.add_argument("--workers", default="8,64,256,1024", help="world sizes, comma-separated")
    ap.add_argument("--gbps", default="10,25,100,400", help="link rates in Gbit/s")
    ap.add_argument("--latency-us", type=float, default=20.0, help="alpha per message (us)")
    ap.add_argument("--efficiency", type=float, default=0.95, help="goodput / line rate")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    ap.add_argument("--uncompressed-numel", type=int, default=0, metavar="N",
                    help="int8/sign send 1-D tensors and those under N elements in fp32 (as "
                         "CompressionState(uncompressed_numel=N)); 0: none")
    ap.add_argument("--mem-gbps", type=float, default=3800.0,
                    help="memory bandwidth the codec passes run at, GB/s (default: ~80%% of an "
                         "H200's HBM); ignored with --measure")
    ap.add_argument("--measure", action="store_true",
                    help="time gradzip's ops on this machine for the codec speed")
    ap.add_argument("--ranks-per-node", type=int, default=1, metavar="R",
                    help="ranks per node sharing each node's link (--gbps); with R > 1 the "
                         "two-level reduction (gradzip.two_level) of each codec is projected too")
    ap.add_argument("--intra-gbps", type=float, default=3600.0,
                    help="the link between the ranks of a node, Gbit/s each way (default: "
                         "NVLink 4's 450 GB/s)")
    ap.add_argument("--codecs", default=",".join(cm.BENCH_HOOKS[1:]),
                    help="codecs/hooks to compare against the fp32 all-reduce; SPEC@fp32: the "
                         "codec with cast_sum='fp32' (top-k's two-phase exchange)")
    args = ap.parse_args(argv)
    try:
        args.workers = [int(w) for w in _floats(args.workers)]
        args.gbps = _floats(args.gbps)
        args.codecs = [c for c in args.codecs.split(",") if c]
        for c in args.codecs:
            cm.Codec.parse(c)
    except ValueError as e:
        ap.error(str(e))
    if not args.workers or min(args.workers) < 2 or not args.gbps or min(args.gbps) <= 0:
        ap.error("--workers must be >= 2 and --gbps > 0")
    if args.ranks_per_node < 1 or any(w % args.ranks_per_node for w in args.workers) \
            or args.intra_gbps <= 0:
        ap.error("--ranks-per-node must divide every --workers value, --intra-gbps be > 0")
    # one node sends nothing over the link between nodes: the layouts of two nodes and more
    args.workers = [w for w in args.workers if w >= 2 * args.ranks_per_node]
    if not args.workers:
        ap.error("--workers: no value makes two nodes or more of --ranks-per-node ranks")
    return args


TWO_LEVEL = "two-level:"


def two_level_codecs(codecs: list[str]) -> list[str]:
    """The codecs gradzip.two_level carries (a shard cuts lowrank's matrices; PyTorch's hooks
    have no two-level form), named two-level:CODEC."""
    return [TWO_LEVEL + c for c in codecs
            if c != "none" and not c.startswith(("torch-", "powersgd", "lowrank"))]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.params:
        shapes, label = flat_shapes(int(args.params)), f"flat {args.params:.3g} params"
    else:
        try:
            shapes, label = model_shapes(args.model), args.model
        except (ImportError, ValueError) as e:
            print(f"error: cannot build model {args.model!r}: {e} (use --params N)", file=sys.stderr)
            return 2
    buckets = cm.ddp_buckets(shapes, cap_bytes=int(args.bucket_mb * 2**20))
    n = sum(cm.numel(s) for s in shapes)
    flat = ["none"] + [c for c in args.codecs if c != "none"]
    r = args.ranks_per_node
    codecs = flat + (two_level_codecs(flat) if r > 1 else [])
    sp = cm.codec_speeds(flat, args.measure, args.mem_gbps)
    sp.update({c: sp[c[len(TWO_LEVEL):]] for c in codecs if c.startswith(TWO_LEVEL)})
    parsed = {c: cm.Codec.parse(c.removeprefix(TWO_LEVEL), uncompressed_numel=args.uncompressed_numel)
              for c in codecs + ["torch-bf16"]}
    intra = cm.Link(args.intra_gbps, args.latency_us * 1e-6, args.efficiency)

    def cost(c: str, p: int, link: cm.Link) -> cm.Cost:
        return cm.step_cost(parsed[c], buckets, p, link, sp[c], per_node=r,
                            intra=intra if c.startswith(TWO_LEVEL) else None)

    speed_note = "measured here via gradzip ops" if args.measure else \
        f"memory-bound at {args.mem_gbps:g} GB/s"
    print(f"# gradzip cost model: {label}, {n / 1e6:.1f}M parameters in {len(buckets)} buckets; "
          f"alpha {args.latency_us:g} us, efficiency {args.efficiency:g}; codec speed {speed_note}"
          + (f"; {r} ranks per node sharing its link (--gbps), {args.intra_gbps:g} Gbit/s inside "
             "it (charged to the two-level rows only)" if r > 1 else ""))
    print()
    print("## Predicted communication time per step (ms), no overlap with backward")
    print()
    print("| workers | Gbit/s | " + " | ".join(codecs) + " |")
    print("|---:|---:|" + "---:|" * len(codecs))
    for p in args.workers:
        for g in args.gbps:
            link = cm.Link(g, args.latency_us * 1e-6, args.efficiency)
            cells = [f"{cost(c, p, link).seconds * 1e3:.1f}" for c in codecs]
            print(f"| {p} | {g:g} | " + " | ".join(cells) + " |")
    link = cm.Link(1.0, args.latency_us * 1e-6, args.efficiency)  # the bytes do not depend on it
    print()
    print(f"## Bytes each {'node' if r > 1 else 'rank'} sends per step (MB); fp32's ring "
          "all-reduce divided by them in ()")
    print()
    print("| workers | " + " | ".join(codecs) + " |")
    print("|---:|" + "---:|" * len(codecs))
    for p in args.workers:
        sent = {c: cost(c, p, link).sent_bytes for c in codecs}
        cells = [f"{sent[c] / 1e6:.2f} ({sent['none'] / sent[c]:.1f}x)" for c in codecs]
        print(f"| {p} | " + " | ".join(cells) + " |")
    if r > 1:  # break-even rates need the flat model's one link per rank
        return 0
    for base in ("none", "torch-bf16"):
        print()
        print(f"## Break-even link rate (Gbit/s) against {base}: the codec is faster below "
              "'<X', faster above '>X'")
        print()
        others = [c for c in codecs if c != base]
        print("| codec | " + " | ".join(f"{p} workers" for p in args.workers) + " |")
        print("|---|" + "---:|" * len(args.workers))
        base_speed = sp.get(base) or cm.codec_speeds([base], args.measure, args.mem_gbps)[base]
        for c in others:
            cells = [str(cm.break_even(parsed[c], parsed[base], buckets, p, link, sp[c], base_speed))
                     for p in args.workers]
            print(f"| {c} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
