"""Every definition of the wire format's sizes agrees: the extension (include/gradzip/wire.hpp
through gradzip::Codec), the pure-Python copy the cost model uses without the extension
(gradzip.wire), the cost model's codecs, and the bytes a real encode writes; on every codec and a
spread of sizes."""

import subprocess
import sys

import pytest
import torch

import gradzip
from gradzip import _ops, plan, wire
from gradzip import costmodel as cm

SPECS = ["fp32", "fp16", "bf16", "int8", "int8:block=32", "int8:block=65536", "sign",
         "sign:block=32", "sign:block=4096", "topk:0.01", "topk:0.3:values=fp16", "topk:1",
         "topk:1e-9", "topk:0.5:values=fp32"]
# 0, 1, odd sizes, both sides of the block and sign-word boundaries, large, and the limits.
SIZES = [0, 1, 2, 3, 31, 32, 33, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097, 65535, 65536,
         65537, 1_000_003, 2**31 + 1, 2**32 - 1, 2**32, 2**40 + 7, 2**48, 2**48 + 1]
ENCODE_UP_TO = 70_000  # sizes at which a real message is encoded too


def pure(spec: str, n: int) -> int:
    """gradzip.wire's size of a message, from the spec's parts as the cost model parses them."""
    c = cm.Codec.parse(spec)
    return wire.encoded_bytes(c.kind, n, c.block, c.ratio, c.fp16_values)


def sizes_or_error(fn):
    try:
        return fn()
    except ValueError:
        return ValueError


@pytest.mark.parametrize("spec", SPECS)
def test_encoded_bytes_agree(spec):
    for n in SIZES:
        ext = sizes_or_error(lambda: gradzip.encoded_bytes(n, spec))
        assert sizes_or_error(lambda: pure(spec, n)) == ext, (spec, n)
        assert sizes_or_error(lambda: cm.Codec.parse(spec).encoded_bytes(n)) == ext, (spec, n)


@pytest.mark.parametrize("spec", SPECS)
def test_a_real_message_has_the_size_and_header_of_every_definition(spec):
    c = cm.Codec.parse(spec)
    for n in [s for s in SIZES if s <= ENCODE_UP_TO]:
        payload = gradzip.encode(torch.randn(n), spec)
        _, _, codec, _, count, param, flags, payload_bytes = _ops.header(payload)
        want_param = wire.topk_k(c.ratio, n) if c.kind == "topk" else c.block
        assert (codec, count, param, flags) == (wire.KINDS.index(c.kind), n, want_param,
                                                int(c.fp16_values)), (spec, n)
        assert payload_bytes == wire.payload_bytes(c.kind, n, param, c.fp16_values), (spec, n)
        assert payload.numel() == wire.HEADER_BYTES + payload_bytes == pure(spec, n), (spec, n)
        assert c.topk_k(n) == (param if c.kind == "topk" else wire.topk_k(c.ratio, n))


@pytest.mark.parametrize("block", [0, 16, 31, 32, 33, 64, 96, 1000, 1024, 65504, 65536, 65568])
def test_block_rule_agrees(block):
    for kind in ("int8", "sign"):
        try:
            _ops.canonical_spec(f"{kind}:block={block}")
            ext = True
        except ValueError:
            ext = False
        assert wire.valid_block(block) == ext, (kind, block)
        try:
            cm.Codec.parse(f"{kind}:block={block}")
            model = True
        except ValueError:
            model = False
        assert model == ext, (kind, block)


@pytest.mark.parametrize("spec", ["fp16", "int8", "int8:block=32", "sign", "topk:0.01",
                                  "topk:0.3:values=fp16"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_message_slots_agree_with_the_all_reduce(spec, world):
    """The all-reduce's bytes (C++ BucketLayout) follow from gradzip.wire's message slots: every
    message starts on a 16-byte boundary, the shards are plan.shard_bounds. (fp16 with its
    two-phase fp32 sum; its default one all-reduce: test_cast_allreduce.py.)"""
    for n in [s for s in SIZES if world <= s <= 1_000_003]:
        slot = lambda m: wire.message_slot_bytes(gradzip.encoded_bytes(m, spec))  # noqa: E731
        for rank in range(world):
            sent, received = _ops.bucket_traffic(spec, world, rank, [n], "fp32")
            if spec.startswith("topk"):
                assert sent == received == (world - 1) * slot(n), (spec, n)
                continue
            b = plan.shard_bounds(n, world)
            shard = [slot(b[j + 1] - b[j]) for j in range(world)]
            biggest = max(shard)
            assert sent == sum(shard) - shard[rank] + (world - 1) * biggest, (spec, n, rank)
            assert received == (world - 1) * (shard[rank] + biggest), (spec, n, rank)


def test_cost_model_runs_without_the_extension():
    """The cost model's CLI with the compiled ops hidden: its sizes are gradzip.wire's, equal to
    the extension's."""
    code = (
        "import glob, sys\n"
        "real = glob.glob\n"
        "glob.glob = lambda p, *a, **k: [] if '_gradzip_ops' in p else real(p, *a, **k)\n"
        "import gradzip\n"
        "from gradzip import costmodel as cm\n"
        "assert isinstance(gradzip._ops, gradzip._MissingOps)\n"
        f"print([cm.Codec.parse(s).encoded_bytes(n) for s in {SPECS[:10]!r} for n in (0, 1, 1025, 1_000_003)])\n"
        "sys.argv = ['costmodel', '--params', '1e7', '--workers', '8', '--gbps', '10']\n"
        "import runpy\n"
        "runpy.run_module('gradzip.costmodel', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    sizes = out.splitlines()[0]
    assert sizes == str([gradzip.encoded_bytes(n, s) for s in SPECS[:10] for n in (0, 1, 1025, 1_000_003)])
    assert "Break-even link rate" in out
