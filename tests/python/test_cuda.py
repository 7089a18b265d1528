"""The ops and the reduction algorithm on CUDA tensors: the same bytes and values as on the CPU
(a payload encoded on one decodes identically on the other). Skipped unless gradzip was built with CUDA and a device is present."""

import pytest
import torch

import gradzip
import functools

from gradzip import simulation

SimulatedWorkers = functools.partial(simulation.SimulatedWorkers, min_compress_numel=0)

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and gradzip.cuda_available()),
                                reason="needs a GPU and a CUDA build of gradzip")

SPECS = ["fp32", "fp16", "bf16", "int8", "int8:block=32", "sign", "sign:block=64", "topk:0.01",
         "topk:0.1:values=fp16", "topk:0.1:values=int8"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [1, 1000, 100003])
def test_cuda_bytes_and_values_equal_cpu(spec, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    r = torch.randn(n, generator=g) * 0.01
    p_cpu = gradzip.encode(x, spec, prescale=0.5)
    p_gpu = gradzip.encode(x.cuda(), spec, prescale=0.5)
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(gradzip.decode(p_cpu.cuda(), n=n).cpu(), gradzip.decode(p_cpu))
    acc = torch.ones(n)
    acc_gpu = acc.cuda()
    gradzip.decode_add(p_cpu, acc)
    gradzip.decode_add(p_gpu, acc_gpu)
    assert torch.equal(acc_gpu.cpu(), acc)
    r_gpu = r.cuda()
    q_cpu = gradzip.encode_with_feedback(x, r, spec)
    q_gpu = gradzip.encode_with_feedback(x.cuda(), r_gpu, spec)
    assert torch.equal(q_gpu.cpu(), q_cpu) and torch.equal(r_gpu.cpu(), r)


@pytest.mark.parametrize("codec", ["bf16", "int8", "sign", "topk:0.05"])
def test_simulated_reduction_on_cuda_equals_cpu(codec):
    world, n = 3, 50001
    g = torch.Generator().manual_seed(1)
    cpu, gpu = SimulatedWorkers(codec, world), SimulatedWorkers(codec, world)
    for _ in range(3):
        grads = [torch.randn(n, generator=g) for _ in range(world)]
        a = cpu.reduce(grads)
        b = gpu.reduce([t.cuda() for t in grads])
        assert torch.equal(b.cpu(), a)


def test_cuda_bad_input():
    x = torch.randn(100, device="cuda")
    p = gradzip.encode(x, "int8")
    with pytest.raises(ValueError, match="device"):
        gradzip.decode_add(p, torch.zeros(100))  # payload on the GPU, output on the CPU
    with pytest.raises(ValueError, match="device"):
        gradzip.encode_with_feedback(x, torch.zeros(100), "int8")
    bad = p.clone()
    bad[0] ^= 0xFF
    with pytest.raises(ValueError, match="gradzip"):
        gradzip.decode(bad)
    with pytest.raises(TypeError):
        gradzip.encode(x.double(), "int8")
