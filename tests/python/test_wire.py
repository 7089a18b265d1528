"""Every definition of the wire format's sizes agrees: the extension (include/gradzip/wire.hpp
through gradzip::Codec), the pure-Python copy the cost model uses without the extension
(gradzip.wire), the cost model's codecs, and the bytes a real encode writes; on every codec and a
spread of sizes. So do gradzip.wire's spec grammar and codec facts and the extension's."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradzip
from gradzip import _ops, plan, wire
from gradzip import costmodel as cm

SPECS = ["fp32", "fp16", "bf16", "int8", "int8:block=32", "int8:block=65536", "sign",
         "sign:block=32", "sign:block=4096", "topk:0.01", "topk:0.3:values=fp16", "topk:1",
         "topk:1e-9", "topk:0.5:values=fp32", "topk:0.02:values=int8", "topk:0.7:values=int8"]
# 0, 1, odd sizes, both sides of the block and sign-word boundaries, large, and the limits.
SIZES = [0, 1, 2, 3, 31, 32, 33, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097, 65535, 65536,
         65537, 1_000_003, 2**31 + 1, 2**32 - 1, 2**32, 2**40 + 7, 2**48, 2**48 + 1]
ENCODE_UP_TO = 70_000  # sizes at which a real message is encoded too


def pure(spec: str, n: int) -> int:
    """gradzip.wire's size of a message, from the spec's parts as the cost model parses them."""
    c = cm.Codec.parse(spec)
    return wire.encoded_bytes(c.kind, n, c.block, c.ratio, c.values)


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
                                                wire.TOPK_VALUE_FLAGS[c.values]), (spec, n)
        assert payload_bytes == wire.payload_bytes(c.kind, n, param, c.values), (spec, n)
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
                                  "topk:0.3:values=fp16", "topk:0.3:values=int8"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_message_slots_agree_with_the_all_reduce(spec, world):
    """The all-reduce's bytes (C++ BucketLayout) follow from gradzip.wire's message slots: every
    message starts on a 16-byte boundary, the shards are plan.shard_bounds, and an int8/sign shard
    of fewer than 64 elements travels as fp32. (fp16 with its two-phase fp32 sum; its default one
    all-reduce: test_cast_allreduce.py. Top-k both ways: all-gathered, and two-phase.)"""
    short_exact = spec.split(":")[0] in ("int8", "sign")
    for n in [s for s in SIZES if world <= s <= 1_000_003]:
        def slot(m):
            as_spec = "fp32" if short_exact and m < 64 else spec
            return wire.message_slot_bytes(gradzip.encoded_bytes(m, as_spec))

        for rank in range(world):
            if spec.startswith("topk"):  # its all-gather (cast_sum "wire")
                sent, received = torch.classes.gradzip.BucketReduction(
                    spec, world, rank, [n], torch.zeros(1), "wire").traffic()
                assert sent == received == (world - 1) * slot(n), (spec, n)
            # the two-phase exchange (top-k too, with cast_sum "fp32")
            sent, received = torch.classes.gradzip.BucketReduction(
                spec, world, rank, [n], torch.zeros(1), "fp32").traffic()
            b = plan.shard_bounds(n, world)
            shard = [slot(b[j + 1] - b[j]) for j in range(world)]
            biggest = max(shard)
            assert sent == sum(shard) - shard[rank] + (world - 1) * biggest, (spec, n, rank)
            assert received == (world - 1) * (shard[rank] + biggest), (spec, n, rank)


# Specs on both sides of every rule of the grammar: the number formats std::from_chars takes and
# Python's int() / float() would also take (signs, spaces, underscores, non-ASCII digits), options
# repeated, misplaced or empty, and the limits.
VALID_SPECS = [
    "fp32", "fp16", "bf16", "int8", "int8:block=32", "int8:block=0064", "int8:block=65536",
    "sign", "sign:block=4096", "topk:0.01", "topk:1", "topk:1.", "topk:.5", "topk:1e-3",
    "topk:1E-3", "topk:0.5e+0", "topk:00.25", "topk:1e-9:values=fp32", "topk:0.3:values=fp16",
    "topk:0.3:values=int8",
    "topk:1e-310", "lowrank:1", "lowrank:04", "lowrank:123456789"]
INVALID_SPECS = [
    "", ":", "zstd", "FP32", " fp32", "fp32 ", "fp32:", "fp32:block=64", "fp16:1", "int8:",
    "int8::block=64", "int8:64", "int8:block=", "int8:block=+64", "int8:block=-64",
    "int8:block= 64", "int8:block=0x40", "int8:block=64.0", "int8:block=6_4",
    "int8:block=\uff16\uff14", "int8:block=64:block=64", "int8:block=64=1", "int8:block=33",
    "int8:block=65568", "int8:block=99999999999999999999999", "int8:values=fp16", "sign:block=16",
    "sign:foo=1", "topk", "topk:", "topk:0", "topk:0.0", "topk:-0", "topk:-0.1", "topk:+0.1",
    "topk: 0.1", "topk:0.1 ", "topk:1_0", "topk:1.5", "topk:1.0000001", "topk:inf", "topk:nan",
    "topk:1e", "topk:0x0.1", "topk:1e-400", "topk:2e-324", "topk:1e400", "topk:\u0663",
    "topk:0.1:", "topk:0.1:values", "topk:0.1:values=bf16", "topk:0.1:block=64",
    "topk:0.1:values=fp16:values=fp32", "lowrank", "lowrank:", "lowrank:0", "lowrank:-1",
    "lowrank:+1", "lowrank:1.0", "lowrank:\u0663", "lowrank:1234567890", "lowrankx",
    "lowrank:4:x"]
CORPUS = sorted(Path(__file__).parents[1].glob("fuzz/corpus/spec*/*"))


def extension_parse(spec: str):
    """The extension's parse (plan.CodecPlan.parse: parse_lowrank, then gradzip::Codec::parse),
    as a canonical spec, or ValueError."""
    return sizes_or_error(lambda: plan.CodecPlan.parse(spec).spec)


def test_the_spec_lists_hold_what_they_say():
    assert all(extension_parse(s) is not ValueError for s in VALID_SPECS)
    assert all(extension_parse(s) is ValueError for s in INVALID_SPECS)
    assert len(CORPUS) >= 10


@pytest.mark.parametrize("spec", VALID_SPECS + INVALID_SPECS + [
    p.read_bytes().decode("utf-8", "replace") for p in CORPUS])
def test_the_python_grammar_is_the_extensions(spec):
    """gradzip.wire.parse_spec accepts exactly the specs the extension accepts, with the same
    parts: those of the extension's canonical spec."""
    canonical = extension_parse(spec)
    if canonical is ValueError:
        with pytest.raises(ValueError, match="bad codec spec"):
            wire.parse_spec(spec)
        return
    assert wire.parse_spec(spec) == wire.parse_spec(canonical), (spec, canonical)


@pytest.mark.parametrize("kind", wire.KINDS)
@pytest.mark.parametrize("cast_sum", wire.CAST_SUMS)
def test_the_codec_facts_are_the_extensions(kind, cast_sum):
    """gradzip.wire's facts of each codec (its traits' summable, all_gathered and block_scaled)
    give the collective and the cut of the extension's BucketLayout."""
    spec = "topk:0.01" if kind == "topk" else kind
    r = torch.classes.gradzip.BucketReduction(spec, 2, 0, [300, 300], torch.zeros(1), cast_sum)
    ext = "cast_allreduce" if r.wire_sum() else "two_phase" if r.two_phase() else "allgather"
    assert wire.allreduce_collective(kind, cast_sum) == ext
    assert plan.CodecPlan.parse(spec, cast_sum).collective == ext
    # Block-scaled codecs cut a shard at the tensors, so a tensor sent exact changes the bytes.
    exact = torch.classes.gradzip.BucketReduction(spec, 2, 0, [300, 300], torch.zeros(1), "fp32",
                                                  [True, False]).traffic()
    whole = torch.classes.gradzip.BucketReduction(spec, 2, 0, [300, 300], torch.zeros(1),
                                                  "fp32").traffic()
    assert (exact != whole) == (kind in wire.BLOCK_SCALED_KINDS)


def test_the_constants_are_the_extensions():
    """Every constant gradzip.wire restates (it must work without the extension) equals its one
    definition in C++, and names every constant the extension lists."""
    ext = dict(torch.ops.gradzip.wire_constants())
    python = {"header_bytes": wire.HEADER_BYTES, "max_count": wire.MAX_COUNT,
              "topk_max_count": wire.TOPK_MAX_COUNT, "topk_index_chunk": wire.TOPK_INDEX_CHUNK,
              "min_block": wire.MIN_BLOCK,
              "max_block": wire.MAX_BLOCK, "default_int8_block": wire.DEFAULT_INT8_BLOCK,
              "default_sign_block": wire.DEFAULT_SIGN_BLOCK, "min_piece": wire.MIN_PIECE,
              "chunk": wire.CHUNK}
    assert python == ext


def test_the_codec_tables_are_the_extensions():
    """gradzip.wire's tables of kinds hold what the codecs' traits state (a new codec kind fails
    here until every Python table knows it): the kinds in wire-id order, each fact's kinds, the
    lossless kinds by round trip, and the cost model's per-kind memory traffic."""
    facts = {k: list(v) for k, v in torch.ops.gradzip.codec_facts().items()}
    assert tuple(facts) == wire.KINDS
    for fact, kinds in (("block_scaled", wire.BLOCK_SCALED_KINDS),
                        ("summable", wire.SUMMABLE_KINDS),
                        ("all_gathered", wire.ALL_GATHERED_KINDS)):
        assert tuple(k for k in wire.KINDS if fact in facts[k]) == kinds, fact
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0)) * 1e3
    for kind in wire.KINDS:
        spec = "topk:0.5" if kind == "topk" else kind
        lossless = torch.equal(gradzip.decode(gradzip.encode(x, spec)), x)
        assert lossless == (kind in wire.LOSSLESS_KINDS), kind
    assert set(wire.KINDS) <= set(cm.ENCODE_EF_BYTES) and set(wire.KINDS) <= set(
        cm.DECODE_ADD_BYTES)


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
