"""The ops as PyTorch's tooling sees them: torch.library.opcheck (schema, fake implementation,
AOT dispatch) on every tensor op, and torch.compile(fullgraph=True) giving the eager bytes."""

import pytest
import torch

import gradzip

ops = torch.ops.gradzip

SPECS = ["fp32", "fp16", "bf16", "int8", "sign", "topk:0.01"]
SIZES = [1000, 4097]


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spec", SPECS)
def test_opcheck_encode_and_decode(spec, n):
    x = data(n, 1)
    r = data(n, 2) * 0.01
    torch.library.opcheck(ops.encode, (x, spec, 0.5))
    torch.library.opcheck(ops.encode_with_feedback, (x, r.clone(), spec, 0.5))
    out = torch.empty(gradzip.encoded_bytes(n, spec), dtype=torch.uint8)
    torch.library.opcheck(ops.encode_into, (x, out, spec, 0.5))
    torch.library.opcheck(ops.encode_with_feedback_into, (x, r.clone(), out, spec, 0.5))

    p = gradzip.encode(x, spec)
    torch.library.opcheck(ops.decode, (p, n))
    # n = -1: the fake returns a data-dependent size (ctx.new_dynamic_size)
    torch.library.opcheck(ops.decode, (p, -1))
    torch.library.opcheck(ops.decode_into, (p, torch.empty(n)))
    torch.library.opcheck(ops.decode_add, (p, torch.ones(n)))


@pytest.mark.parametrize("spec", SPECS)
def test_opcheck_header(spec):
    p = gradzip.encode(data(1000, 3), spec)
    # header returns the payload's fields, which are data: it has no fake implementation, so the
    # fake-tensor and AOT-dispatch checks cannot apply (they need one); schema and autograd do.
    torch.library.opcheck(ops.header, (p,),
                          test_utils=("test_schema", "test_autograd_registration"))


def test_fake_shapes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.zeros(4097))
        for spec in SPECS:
            p = ops.encode(x, spec)
            assert p.dtype == torch.uint8 and p.shape == (gradzip.encoded_bytes(4097, spec),)
        y = ops.decode(ops.encode(x, "int8"), 4097)
        assert y.dtype == torch.float32 and y.shape == (4097,)
        z = ops.decode(ops.encode(x, "int8"))
        assert isinstance(z.shape[0], torch.SymInt)  # data-dependent: read from the header


def test_compiled_encode_decode_equal_eager():
    def step(x, residuals):
        out = []
        for spec, r in zip(SPECS, residuals):
            p = gradzip.encode(x, spec, prescale=0.5)
            q = gradzip.encode_with_feedback(x, r, spec, prescale=0.5)
            out.append((p, q, gradzip.decode(p, n=x.numel()), gradzip.decode(q, n=x.numel())))
        return out

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    n = 4097
    x = data(n, 4)
    r_eager = [data(n, 5 + i) * 0.01 for i in range(len(SPECS))]
    r_compiled = [r.clone() for r in r_eager]
    want = step(x, r_eager)
    got = compiled(x, r_compiled)
    for spec, w, g, re, rc in zip(SPECS, want, got, r_eager, r_compiled):
        for a, b in zip(w, g):
            assert a.dtype == b.dtype and torch.equal(a, b), spec
        assert torch.equal(re, rc), spec  # the residual, updated in place


def test_compiled_decode_without_n_has_a_data_dependent_size():
    # decode(payload) reads the count from the header: under torch.compile its size is an unbacked
    # symbol, and so is the size of a payload encoded from it
    def roundtrip(p):
        y = gradzip.decode(p)
        return y * 2, gradzip.encode(y, "topk:0.01"), gradzip.encode_with_feedback(
            y, torch.zeros_like(y), "int8")

    torch._dynamo.reset()
    compiled = torch.compile(roundtrip, fullgraph=True)
    p = gradzip.encode(data(4097, 6), "int8")
    for w, g in zip(roundtrip(p), compiled(p)):
        assert torch.equal(w, g)
