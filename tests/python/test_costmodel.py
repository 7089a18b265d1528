"""gradzip.costmodel: collective formulas, wire sizes, DDP bucket layout, break-even, CLI."""

import math
import subprocess
import sys

import pytest

from gradzip import costmodel as cm

LINK = cm.Link(gbps=8.0, latency_s=1e-4, efficiency=1.0)  # 1e9 bytes/s: easy hand arithmetic


def test_link_goodput():
    assert LINK.bytes_per_s == pytest.approx(1e9)
    assert cm.Link(1.0, efficiency=0.5).bytes_per_s == pytest.approx(62.5e6)


@pytest.mark.parametrize("p", [2, 3, 8])
def test_collectives_by_hand(p):
    s = 12e6
    ar = cm.ring_allreduce(s, p, LINK)
    assert ar.messages == 2 * (p - 1)
    assert ar.sent_bytes == pytest.approx(2 * (p - 1) / p * s)
    assert ar.seconds == pytest.approx(2 * (p - 1) * 1e-4 + 2 * (p - 1) / p * s / 1e9)
    ag = cm.ring_allgather(s, p, LINK)
    assert ag.seconds == pytest.approx((p - 1) * (1e-4 + s / 1e9))
    a2a = cm.alltoall(s, p, LINK)
    assert a2a.sent_bytes == pytest.approx((p - 1) * s)
    assert cm.ring_allreduce(s, 1, LINK).seconds == 0.0


def test_two_phase_sends_about_twice_the_payload_whatever_p():
    codec = cm.Codec.parse("int8")
    n = 1_000_003
    for p in (2, 16, 256):
        sent = cm.two_phase(codec, n, p, LINK).sent_bytes
        shard = codec.encoded_bytes(math.ceil(n / p))
        assert sent == pytest.approx(2 * (p - 1) * shard)
        assert 2 * (p - 1) / p * n < sent < 2 * n * 1.05 + 2 * p * 64


@pytest.mark.parametrize("n", [0, 1, 7, 255, 257, 1_000_003])
def test_encoded_bytes_by_formula(n):
    assert cm.Codec.parse("fp16").encoded_bytes(n) == 32 + 2 * n
    assert cm.Codec.parse("int8").encoded_bytes(n) == 32 + 16 * math.ceil(math.ceil(n / 256) / 4) + n
    sign = cm.Codec.parse("sign:block=64").encoded_bytes(n)
    assert sign == 32 + 16 * math.ceil(math.ceil(n / 64) / 4) + 4 * math.ceil(n / 32)
    k = 0 if n == 0 else max(1, math.ceil(0.01 * n))
    # top-k: a u32 end per 65536-element chunk, a u16 offset per kept element, each section
    # padded to 16 bytes; then the values
    indices = 16 * math.ceil(math.ceil(n / 65536) / 4) + 16 * math.ceil(2 * k / 16)
    assert cm.Codec.parse("topk:0.01").encoded_bytes(n) == 32 + indices + 4 * k
    assert cm.Codec.parse("topk:0.01:values=fp16").encoded_bytes(n) == 32 + indices + 2 * k
    # int8: k bytes padded to 16, then a f32 scale per chunk
    scales = 4 * math.ceil(n / 65536)
    assert cm.Codec.parse("topk:0.01:values=int8").encoded_bytes(n) == (
        32 + indices + 16 * math.ceil(k / 16) + scales)


@pytest.mark.parametrize("spec", ["bf16", "int8", "sign", "int8:block=64", "topk:0.01",
                                  "topk:0.3:values=fp16", "topk:0.3:values=int8"])
@pytest.mark.parametrize("n", [1, 7, 1025, 100_003])
def test_encoded_bytes_match_gradzip(spec, n):
    import torch

    import gradzip

    payload = gradzip.encode(torch.randn(n), spec)
    assert payload.numel() == cm.Codec.parse(spec).encoded_bytes(n) == gradzip.encoded_bytes(n, spec)


@pytest.mark.parametrize("bad", ["zstd", "topk", "topk:0", "topk:1.5", "topk:x", "int8:block=0",
                                 "int8:block=33", "sign:foo=1", "powersgd:0", "fp16:1"])
def test_bad_codec_names_are_clear_errors(bad):
    with pytest.raises(ValueError, match="codec|unknown"):
        cm.Codec.parse(bad)


def test_aliases():
    assert cm.Codec.parse("none").kind == "fp32"
    assert cm.Codec.parse("torch-bf16").kind == "bf16"
    assert cm.Codec.parse("powersgd:2").rank == 2


def test_ddp_buckets_match_pytorch():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    shapes = [(1000, 1000), (10,), (3000, 3000), (5, 5), (2000, 2000), (7,), (640, 3, 14, 14),
              (1,), (4096, 1024), (4096,), (1024, 4096), (1024,)]
    cap, first = 25 * 2**20, dist._DEFAULT_FIRST_BUCKET_BYTES
    ours = cm.ddp_buckets(shapes, cap_bytes=cap, first_cap_bytes=first)
    rev = [torch.empty(s, device="meta") for s in reversed(shapes)]
    theirs, _ = dist._compute_bucket_assignment_by_size(rev, [first, cap], [False] * len(rev))
    assert [[tuple(rev[i].shape) for i in b] for b in theirs] == ours


def test_powersgd_plan():
    # 1000x1000 compresses at rank 2; a 5x5 does not ((5+5)*2*2 >= 25); vectors never.
    plain, p, q = cm.powersgd_plan([(1000, 1000), (5, 5), (7,), (64, 3, 4, 4)], rank=2)
    assert (p, q) == (1000 * 2 + 64 * 2, 1000 * 2 + 48 * 2)
    assert plain == 25 + 7


def test_step_cost_orders_codecs_at_low_bandwidth():
    buckets = cm.ddp_buckets([(4096, 4096)] * 8)
    link = cm.Link(1.0)
    t = {c: cm.step_cost(c, buckets, 2, link).seconds for c in cm.BENCH_HOOKS}
    assert t["none"] > t["torch-bf16"] > t["int8"] > t["sign"]
    assert t["none"] > 10 * t["topk:0.01"]
    # gradzip's bf16 is one 16-bit ring all-reduce of the payload, as PyTorch's hook; its
    # two-phase fp32 sum moves those bytes plus shard headers
    assert t["torch-bf16"] == pytest.approx(t["bf16"], rel=1e-12)
    two_phase = cm.step_cost(cm.Codec.parse("bf16", "fp32"), buckets, 2, link).seconds
    assert two_phase == pytest.approx(t["bf16"], rel=1e-4) and two_phase > t["bf16"]
    assert cm.Codec.parse("bf16").collective == "cast_allreduce"
    assert cm.Codec.parse("bf16", cast_sum="fp32").collective == "two_phase"
    assert cm.Codec.parse("torch-bf16").collective == "allreduce"
    # two ranks, fp32: every rank sends the whole model once
    sent = cm.step_cost("none", buckets, 2, link).sent_bytes
    assert sent == pytest.approx(8 * 4096 * 4096 * 4)


def test_codec_compute_counts():
    speed = cm.CodecSpeed(encode_ef=1e9, decode_add=1e9)
    # PyTorch's bf16 hook and gradzip's: cast down and back; gradzip's two-phase bf16 as int8 below
    assert cm.codec_compute_s(cm.Codec.parse("torch-bf16"), 10**6, 8, speed) == pytest.approx(2e-3)
    assert cm.codec_compute_s(cm.Codec.parse("bf16"), 10**6, 8, speed) == pytest.approx(2e-3)
    assert cm.codec_compute_s(cm.Codec.parse("bf16", "fp32"), 8 * 10**6, 8,
                              speed) == pytest.approx(25e-3)
    # int8 at p=4: encode n + n/4, decode 4 * n/4 + n
    assert cm.codec_compute_s(cm.Codec.parse("int8"), 4 * 10**6, 4, speed) == pytest.approx(13e-3)
    assert cm.codec_compute_s(cm.Codec.parse("none"), 10**6, 8, speed) == 0.0
    assert cm.codec_compute_s(cm.Codec.parse("powersgd:2"), 10**6, 8, speed) == 0.0
    mem = cm.CodecSpeed.from_memory_bandwidth(cm.Codec.parse("int8"), 13.0)
    assert mem.encode_ef == pytest.approx(1e9)


@pytest.mark.parametrize("codec", ["int8", "sign", "topk:0.01", "torch-bf16"])
@pytest.mark.parametrize("p", [2, 8, 64])
def test_break_even_is_where_times_cross(codec, p):
    buckets = cm.ddp_buckets([(2048, 2048)] * 12 + [(2048,)] * 12)
    link = cm.Link(1.0, latency_s=30e-6, efficiency=0.9)
    speed = cm.CodecSpeed(2e9, 4e9)
    be = cm.break_even(codec, "none", buckets, p, link, speed)

    def diff(g):
        lk = cm.Link(g, link.latency_s, link.efficiency)
        return (cm.step_cost(codec, buckets, p, lk, speed).seconds
                - cm.step_cost("none", buckets, p, lk).seconds)

    if math.isinf(be.gbps) or be.gbps == 0:
        sign = -1 if be.gbps else 1  # always faster / never faster
        assert all(sign * diff(g) >= 0 for g in (0.1, 10, 1e3, 1e5))
        return
    assert diff(be.gbps) == pytest.approx(0.0, abs=1e-9)
    lo, hi = diff(be.gbps / 2), diff(be.gbps * 2)
    assert (lo < 0 < hi) if be.pays_below else (hi < 0 < lo)


def test_small_buckets_go_uncompressed():
    link = cm.Link(1.0)
    small = [[(1000,)]]
    assert cm.step_cost("topk:0.01", small, 4, link).seconds == \
        pytest.approx(cm.step_cost("none", small, 4, link).seconds)


def test_measured_codec_speed_is_positive():
    sp = cm.codec_speeds(["int8", "torch-bf16", "none", "powersgd:2"], measure=True)
    assert sp["none"] is None and sp["powersgd:2"] is None
    for name in ("int8", "torch-bf16"):
        assert 1e6 < sp[name].encode_ef < 1e12 and 1e6 < sp[name].decode_add < 1e12


def test_break_even_formatting():
    assert str(cm.BreakEven(math.inf)) == "always"
    assert str(cm.BreakEven(0.0)) == "never"
    assert str(cm.BreakEven(123.4)) == "<123"
    assert str(cm.BreakEven(50, pays_below=False)) == ">50"


def test_cli_prints_tables():
    out = subprocess.run([sys.executable, "-m", "gradzip.costmodel", "--params", "5e7",
                          "--workers", "8,64", "--gbps", "10,100"],
                         capture_output=True, text=True, check=True).stdout
    assert "Predicted communication time per step" in out
    assert "Break-even link rate" in out
    assert "Bytes each rank sends per step" in out
    rows = [line for line in out.splitlines() if line.startswith("| 8 |")]
    # two link rates of the time table, then the bytes table's row
    assert len(rows) == 3 and len(rows[0].split("|")) == 2 + 2 + len(cm.BENCH_HOOKS)
    assert len(rows[2].split("|")) == 2 + 1 + len(cm.BENCH_HOOKS)
    assert "(1.0x)" in rows[2].split("|")[2]  # fp32's own column: ratio 1


def test_cli_rejects_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "gradzip.costmodel", "--params", "1e6",
                        "--codecs", "zstd"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown codec" in r.stderr


def test_uncompressed_tensors_cost_fp32_bytes():
    """int8/sign with uncompressed_numel: the flagged tensors' elements travel as an fp32 message
    per shard next to the compressed one; other codecs are unchanged."""
    shapes = [(1000, 100), (100,), (7, 5)]
    p = 4
    for spec in ("int8", "sign"):
        codec = cm.Codec.parse(spec, uncompressed_numel=50)
        assert codec.uncompressed_elements(shapes) == 135
        shard = codec.encoded_bytes(25_000) + 32 + 4 * 34
        assert cm.bucket_cost(codec, shapes, p, LINK).sent_bytes == pytest.approx(2 * (p - 1) * shard)
        assert cm.bucket_cost(cm.Codec.parse(spec), shapes, p, LINK).sent_bytes < 2 * (p - 1) * shard
    # without the option only the tensor shorter than a piece (64 elements) travels in fp32
    assert cm.Codec.parse("sign").uncompressed_elements(shapes) == 35
    topk = cm.Codec.parse("topk:0.01", uncompressed_numel=50)
    assert cm.bucket_cost(topk, shapes, p, LINK) == cm.bucket_cost(cm.Codec.parse("topk:0.01"),
                                                                   shapes, p, LINK)


def test_nodes_share_their_link_in_the_all_to_all_not_in_the_ring():
    """R ranks per node: each ring step crosses a node's link once (a ring's bytes per node do not
    grow with R), the all-to-all's R (W - R) remote messages all leave through it."""
    w, r, s = 16, 4, 1e6
    a2a = cm.alltoall(s, w, LINK, per_node=r)
    assert a2a.sent_bytes == pytest.approx(r * (w - r) * s)
    assert a2a.seconds == pytest.approx((w - 1) * 1e-4 + r * (w - r) * s / 1e9)
    codec = cm.Codec.parse("int8")
    n = 4_000_037
    flat = cm.step_cost(codec, [[(n,)]], w, LINK, per_node=r)
    shard = codec.encoded_bytes(math.ceil(n / w))
    assert flat.sent_bytes == pytest.approx(r * (w - r) * shard + (w - 1) * shard)
    none = cm.step_cost("none", [[(n,)]], w, LINK, per_node=r)
    assert none.sent_bytes == pytest.approx(2 * (w - 1) / w * 4 * n)


def test_two_level_by_hand():
    """gradzip.two_level on N nodes of R: a ring all-reduce of the fp32 bucket inside the node,
    and each rank's shard of n / R elements reduced between the nodes in two phases, the R shards'
    reductions sharing the node's link (what leaves the node: R of them)."""
    nodes, r, n = 4, 8, 8_000_001
    intra = cm.Link(400.0, latency_s=1e-5)
    codec = cm.Codec.parse("sign")
    got = cm.step_cost(codec, [[(n,)]], nodes * r, LINK, per_node=r, intra=intra)
    shard = math.ceil(n / r)
    piece = codec.encoded_bytes(math.ceil(shard / nodes))  # what a rank sends each node peer
    inter_bytes = 2 * (nodes - 1) * piece  # all-to-all, then all-gather, per rank
    assert got.sent_bytes == pytest.approx(r * inter_bytes)
    inside = 2 * (r - 1) * (1e-5 + 4 * n / r / intra.bytes_per_s)
    between = 2 * (nodes - 1) * 1e-4 + inter_bytes / (LINK.bytes_per_s / r)
    assert got.seconds == pytest.approx(inside + between)
    with pytest.raises(ValueError, match="do not divide"):
        cm.step_cost(codec, [[(n,)]], 30, LINK, per_node=8)


def test_cli_projects_nodes_with_two_level_columns():
    out = subprocess.run([sys.executable, "-m", "gradzip.costmodel", "--params", "5e7",
                          "--workers", "8,64", "--gbps", "100", "--ranks-per-node", "8",
                          "--codecs", "int8,sign"], capture_output=True, text=True,
                         check=True).stdout
    assert "two-level:int8" in out and "two-level:sign" in out and "Bytes each node" in out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert not any(line.startswith("| 8 |") for line in rows)  # one node: nothing crosses
    assert any(line.startswith("| 64 | 100 |") for line in rows)
