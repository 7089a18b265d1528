"""The torch ops: round trips against a float64 reference on odd sizes, the error-feedback identity,
and rejection of bad input with TypeError/ValueError naming the reason."""

import math

import pytest
import torch

import gradzip

SIZES = [1, 31, 1000, 4097]


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64) * 3.0


def block_absmax(x, block):
    n = x.numel()
    pad = (-n) % block
    xb = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, block)
    return xb.max(1).values.repeat_interleave(block)[:n]


@pytest.mark.parametrize("n", SIZES)
def test_casts_round_trip_exactly_like_torch(n):
    x64 = data(n)
    x = x64.float()
    assert torch.equal(gradzip.decode(gradzip.encode(x, "fp32")), x)
    # PyTorch's casts round to nearest even too: the decoded values must be exactly theirs
    assert torch.equal(gradzip.decode(gradzip.encode(x, "fp16")), x.half().float())
    assert torch.equal(gradzip.decode(gradzip.encode(x, "bf16")), x.bfloat16().float())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [32, 256])
def test_int8_error_within_half_a_step(n, block):
    x64 = data(n, seed=n)
    y = gradzip.decode(gradzip.encode(x64.float(), f"int8:block={block}")).double()
    step = block_absmax(x64.float().double(), block) / 127
    assert ((y - x64).abs() <= 0.5 * step * (1 + 1e-5) + 1e-6).all()


@pytest.mark.parametrize("n", SIZES)
def test_sign_decodes_sign_times_block_mean(n):
    block = 64
    x = data(n, seed=7).float()
    y = gradzip.decode(gradzip.encode(x, f"sign:block={block}"))
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    for b in range(math.ceil(n / block)):
        xs = x[b * block:(b + 1) * block].double()
        assert torch.allclose(y[b * block:(b + 1) * block].abs().double(),
                              xs.abs().mean().expand(xs.numel()), rtol=1e-5)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ratio", [0.01, 0.1, 1.0])
def test_topk_keeps_the_k_largest(n, ratio):
    x = data(n, seed=3).float()
    x[1::2] = x[0::2][:x[1::2].numel()]  # every magnitude twice: ties at the threshold...
    x[1::4] = -x[1::4]  # ...of both signs
    y = gradzip.decode(gradzip.encode(x, f"topk:{ratio}"))
    k = min(n, max(1, math.ceil(ratio * n)))
    # the reference: the k largest |x| in float64, ties to the lowest index
    order = sorted(range(n), key=lambda i: (-abs(float(x[i])), i))[:k]
    want = torch.zeros(n, dtype=torch.bool)
    want[order] = True
    assert torch.equal(y[want], x[want])
    assert not y[~want].any()
    assert gradzip.header(gradzip.encode(x, f"topk:{ratio}"))["param"] == k


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "sign:block=32", "topk:0.05"])
def test_encode_with_feedback_identity(spec):
    n = 3001
    g = data(n, seed=11).float()
    r = data(n, seed=12).float() * 0.01
    r_old = r.clone()
    p = gradzip.encode_with_feedback(g, r, spec, prescale=0.5)
    c = g * 0.5 + r_old  # element.hpp: two roundings, same order
    assert torch.equal(r, c - gradzip.decode(p))
    # the same bytes as a plain encode of c
    assert torch.equal(p, gradzip.encode(c, spec))


def test_decode_add_and_out_variants():
    x = data(777).float()
    p = gradzip.encode(x, "int8")
    acc = torch.ones(777)
    gradzip.decode_add(p, acc)
    assert torch.equal(acc, torch.ones(777) + gradzip.decode(p))
    out = torch.empty(777)
    assert gradzip.decode(p, out=out) is out and torch.equal(out, gradzip.decode(p))
    buf = torch.empty(gradzip.encoded_bytes(777, "int8"), dtype=torch.uint8)
    assert torch.equal(gradzip.encode(x, "int8", out=buf), p)
    assert gradzip.encoded_bytes(777, "int8") == p.numel()


def test_half_inputs_are_upcast():
    x = data(100).float()
    assert torch.equal(gradzip.encode(x.bfloat16(), "bf16"), gradzip.encode(x.bfloat16().float(), "bf16"))
    assert torch.equal(gradzip.encode(x.half(), "int8"), gradzip.encode(x.half().float(), "int8"))


def test_nonfinite_stays_visible_and_residual_unpoisoned():
    g = data(512).float()
    g[5] = float("inf")
    g[300] = float("nan")
    for spec in ("fp16", "int8:block=32", "sign:block=32", "topk:0.01"):
        r = torch.zeros(512)
        y = gradzip.decode(gradzip.encode_with_feedback(g, r, spec))
        assert not torch.isfinite(y).all(), spec
        assert torch.isfinite(r).all(), spec


def guarded_update(*reduced) -> torch.Tensor:
    """A state tensor saved, updated (+1) and committed after the guard flagged `reduced`."""
    state = torch.arange(5.0)
    guard = torch.classes.gradzip.NonfiniteGuard()
    guard.save([state])
    state.add_(1.0)
    for t in reduced:
        guard.flag(t)
    guard.commit()
    return state


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_guard_restores_after_any_nonfinite_value(bad):
    """The non-finite guard's flag of a reduced bucket: one bad value anywhere (in a full group of
    the CPU check's lanes, in its tail, in a non-contiguous or another dtype's tensor) voids the
    step's updates; finite extremes (the largest float, subnormals, -0.0) do not."""
    fine = torch.ones(37)
    fine[:4] = torch.tensor([3.4028235e38, -3.4028235e38, 1e-45, -0.0])
    assert torch.equal(guarded_update(fine), torch.arange(5.0) + 1.0)
    for where in (0, 15, 16, 36):
        for make in (lambda t: t, lambda t: t.repeat_interleave(2)[::2], lambda t: t.double()):
            broken = fine.clone()
            broken[where] = bad
            assert torch.equal(guarded_update(make(fine), make(broken)), torch.arange(5.0)), where


def test_canonical_spec():
    assert gradzip.canonical_spec("int8") == gradzip.canonical_spec(gradzip.canonical_spec("int8"))


# ---- hostile input -----------------------------------------------------------------------------
def test_wrong_dtypes_raise_type_error():
    with pytest.raises(TypeError, match="float32"):
        gradzip.encode(torch.zeros(10, dtype=torch.float64), "int8")
    with pytest.raises(TypeError, match="float32"):
        gradzip.encode(torch.zeros(10, dtype=torch.int32), "int8")
    with pytest.raises(TypeError, match="residual must be float32"):
        gradzip.encode_with_feedback(torch.zeros(10), torch.zeros(10, dtype=torch.float64), "int8")
    p = gradzip.encode(torch.zeros(10), "int8")
    with pytest.raises(TypeError, match="uint8"):
        gradzip.decode(p.to(torch.int8))
    with pytest.raises(TypeError, match="float32"):
        gradzip.decode_add(p, torch.zeros(10, dtype=torch.float16))
    with pytest.raises(TypeError):
        gradzip.encode([1.0, 2.0], "int8")
    with pytest.raises(TypeError):
        gradzip.encode(torch.zeros(4), 8)


def test_non_contiguous_raises_value_error():
    x = torch.zeros(10, 10)
    with pytest.raises(ValueError, match="contiguous"):
        gradzip.encode(x.t(), "int8")
    with pytest.raises(ValueError, match="contiguous"):
        gradzip.encode_with_feedback(torch.zeros(50), torch.zeros(100)[::2], "int8")
    p = gradzip.encode(torch.zeros(10), "fp32")
    with pytest.raises(ValueError, match="contiguous"):
        gradzip.decode(torch.cat([p, p]).view(2, -1).t().reshape(-1)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        gradzip.decode_add(p, torch.zeros(20)[::2])


SPARSE = {"torch.sparse_coo": torch.Tensor.to_sparse, "torch.sparse_csr": torch.Tensor.to_sparse_csr}


def _sparse_calls(make):
    """Every op and its out=/_into form, each with one argument made sparse by ``make``."""
    x, res, n = torch.randn(4, 8), torch.zeros(4, 8), 32
    p = gradzip.encode(x, "int8")
    sp = lambda t: make(t.reshape(1, -1) if t.dim() == 1 else t)  # noqa: E731 (CSR needs 2-D)
    out = torch.empty(gradzip.encoded_bytes(n, "int8"), dtype=torch.uint8)
    return {
        "encode input": lambda: gradzip.encode(sp(x), "int8"),
        "encode_into input": lambda: gradzip.encode(sp(x), "int8", out=out),
        "encode_into out": lambda: gradzip.encode(x, "int8", out=sp(out)),
        "encode_with_feedback grad": lambda: gradzip.encode_with_feedback(sp(x), res, "int8"),
        "encode_with_feedback residual": lambda: gradzip.encode_with_feedback(x, sp(res), "int8"),
        "encode_with_feedback_into out":
            lambda: gradzip.encode_with_feedback(x, res, "int8", out=sp(out)),
        "decode payload": lambda: gradzip.decode(sp(p)),
        "decode payload n": lambda: gradzip.decode(sp(p), n=n),
        "decode_into out": lambda: gradzip.decode(p, out=sp(torch.zeros(n))),
        "decode_add payload": lambda: gradzip.decode_add(sp(p), torch.zeros(n)),
        "decode_add out": lambda: gradzip.decode_add(p, sp(torch.zeros(n))),
        "header payload": lambda: gradzip.header(sp(p)),
        "encode input, torch.ops": lambda: torch.ops.gradzip.encode(sp(x), "int8"),
        "decode_add out, torch.ops": lambda: torch.ops.gradzip.decode_add(p, sp(torch.zeros(n))),
    }


@pytest.mark.parametrize("layout", SPARSE)
def test_sparse_tensors_raise_value_error_naming_the_layout(layout):
    for what, call in _sparse_calls(SPARSE[layout]).items():
        with pytest.raises(ValueError, match=f"layout {layout}.*to_dense") as err:
            call()
        assert what.split()[0] in str(err.value), (what, err.value)


def test_wrongly_placed_tensors_raise_value_error():
    with pytest.raises(ValueError, match="device"):
        gradzip.encode(torch.zeros(10, device="meta"), "int8")
    p = gradzip.encode(torch.zeros(10), "int8")
    with pytest.raises(ValueError, match="device"):
        gradzip.decode_add(p, torch.zeros(10, device="meta"))


def test_aliasing_and_sizes_raise_value_error():
    g = torch.zeros(64)
    with pytest.raises(ValueError, match="share memory"):
        gradzip.encode_with_feedback(g, g, "int8")
    with pytest.raises(ValueError, match="elements"):
        gradzip.encode_with_feedback(torch.zeros(64), torch.zeros(63), "int8")
    with pytest.raises(ValueError, match="bytes"):
        gradzip.encode(torch.zeros(64), "int8", out=torch.empty(10, dtype=torch.uint8))
    p = gradzip.encode(torch.zeros(64), "int8")
    with pytest.raises(ValueError):
        gradzip.decode_add(p, torch.zeros(65))  # size mismatch
    with pytest.raises(ValueError):
        gradzip.encoded_bytes(-1, "int8")


@pytest.mark.parametrize("spec", ["", " ", "int9", "int8:block=33", "topk", "topk:0", "topk:1.5",
                                  "sign:block=0", "fp16:extra"])
def test_bad_specs_raise_value_error(spec):
    with pytest.raises(ValueError, match="spec"):
        gradzip.encode(torch.zeros(8), spec)
    with pytest.raises(ValueError):
        gradzip.encoded_bytes(8, spec)


@pytest.mark.parametrize("spec", ["fp16", "int8:block=32", "sign:block=32", "topk:0.1"])
def test_corrupt_payloads_raise_value_error(spec):
    x = data(200).float()
    p = gradzip.encode(x, spec)
    cases = {
        "empty": p[:0],
        "truncated header": p[:20],
        "truncated payload": p[:-1],
        "extra byte": torch.cat([p, p[:1]]),
    }
    bad_magic = p.clone()
    bad_magic[0] ^= 0xFF
    cases["magic"] = bad_magic
    bad_version = p.clone()
    bad_version[4] = 99
    cases["version"] = bad_version
    bad_codec = p.clone()
    bad_codec[6] = 77
    cases["codec"] = bad_codec
    big_count = p.clone()
    big_count[8:16] = torch.tensor([0xFF] * 8, dtype=torch.uint8)
    cases["count"] = big_count
    for name, q in cases.items():
        with pytest.raises(ValueError, match="gradzip"):
            gradzip.decode(q)
        with pytest.raises(ValueError):
            gradzip.decode_add(q, torch.zeros(200))
    # top-k: indices out of range / not increasing
    if spec.startswith("topk"):
        k = gradzip.header(p)["param"]
        idx = p[32:32 + 4 * k].view(torch.int32)
        for bad in (200, -1):
            q = p.clone()
            q[32:32 + 4 * k].view(torch.int32)[k // 2] = bad
            with pytest.raises(ValueError, match="gradzip"):
                gradzip.decode(q)
        q = p.clone()
        q[32:32 + 4 * k].view(torch.int32)[1] = idx[0]
        with pytest.raises(ValueError, match="gradzip"):
            gradzip.decode(q)


def test_random_bytes_never_crash():
    g = torch.Generator().manual_seed(5)
    good = gradzip.encode(data(300).float(), "int8")
    for i in range(300):
        q = good.clone()
        pos = torch.randint(0, q.numel(), (3,), generator=g)
        q[pos] = torch.randint(0, 256, (3,), generator=g, dtype=torch.uint8)
        try:
            y = gradzip.decode(q)
            assert y.numel() == 300
        except ValueError:
            pass


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "sign:block=64", "topk:0.01"])
def test_flush_denormal_mode_of_the_caller_does_not_change_the_bytes(spec):
    """torch.set_flush_denormal(True) sets FTZ/DAZ on the calling thread; the codecs run in IEEE
    mode regardless (subnormal gradients, residuals and scales come out the same)."""
    g = torch.randn(100003, generator=torch.Generator().manual_seed(3)) * 1e-39
    expected_residual = torch.zeros_like(g)
    expected = gradzip.encode_with_feedback(g, expected_residual, spec)
    residual = torch.zeros_like(g)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        payload = gradzip.encode_with_feedback(g, residual, spec)
        decoded = gradzip.decode(payload)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(payload, expected)
    assert torch.equal(residual.view(torch.int32), expected_residual.view(torch.int32))
    assert torch.equal(decoded.view(torch.int32), gradzip.decode(expected).view(torch.int32))
    r = expected_residual
    assert ((r != 0) & (r.abs() < torch.finfo(torch.float32).tiny)).any()  # subnormals exercised
