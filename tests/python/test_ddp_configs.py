"""DDP configurations users run, on 2 and 3 Gloo ranks, each beside a no-hook DDP twin or the
simulation: zero-size parameters (nn.Linear(n, 0)), sparse gradients (nn.Embedding(sparse=True)),
and a parameter no rank uses (find_unused_parameters=True with gradient_as_bucket_view=True)."""

import os

import pytest
import torch

import ddp_scenarios as sc
from dist_util import run_ranks
from test_ddp import check_replicas_and_reference, load

ZERO = [(f"zero_{c.split(':')[0]}", {"codec": c, "extra": "zero", "steps": 3})
        for c in ("int8", "sign:block=64", "topk:0.1", "bf16")]
TWIN = [("zero_fp32", {"codec": "fp32", "extra": "zero"}),
        ("sparse_int8", {"codec": "int8", "extra": "sparse"}),
        ("sparse_fp32", {"codec": "fp32", "extra": "sparse", "bucket_view": True})]
# a branch every rank uses at step 0 only, its gradient then set to None (zero_grad's default) or
# to zeros
TWIN += [(f"unused_{what}", {"codec": "sign:block=64", "unused_branch": True, "find_unused": True,
                             "bucket_view": True, "set_to_none": what == "none",
                             "branch_steps": (0,)})
         for what in ("none", "zeros")]
NAMES = {extra: [n for n, _ in sc.make_model(extra=extra).named_parameters()] for extra in ("zero", "sparse")}
UNUSED = [i for i, (n, _) in enumerate(sc.make_model(unused_branch=True).named_parameters())
          if n.startswith("unused")]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def session(request, tmp_path_factory):
    world = request.param
    outdir = tmp_path_factory.mktemp(f"configs{world}")
    run_ranks(sc.session, world, str(outdir), [("train", (ZERO,)), ("twin", (TWIN,))], timeout=240)
    return world, outdir


@pytest.mark.parametrize("name,cfg", ZERO, ids=[n for n, _ in ZERO])
def test_zero_size_parameters_carry_nothing(session, name, cfg):
    """Every bucket, zero-size parameters included, equals the simulation given the bucket's tensor
    sizes (zeros among them); the zero-size parameters stay empty."""
    world, outdir = session
    runs = load(outdir, name, world)
    check_replicas_and_reference(runs, cfg["codec"], world)
    shapes = [tuple(p.shape) for p in runs[0]["params"]]
    assert (0, sc.IN) in shapes and (0,) in shapes


def test_zero_size_parameters_train_as_plain_ddp(session):
    """fp32 through the hook: the plain DDP twin's gradients and parameters, to fp32 rounding (the
    hook sums in rank order, the backend in its own)."""
    world, outdir = session
    for r in range(world):
        run = torch.load(os.path.join(outdir, f"twin_zero_fp32_{r}.pt"), weights_only=False)
        for ours, theirs in zip(run["hook"]["grads"] + run["hook"]["params"],
                                run["plain"]["grads"] + run["plain"]["params"]):
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sparse_int8", "sparse_fp32"])
def test_sparse_gradients_are_averaged_as_plain_ddp(session, name):
    """The embedding's sparse gradient is averaged by the backend's sparse all-reduce as without a
    hook: at the first step it equals the twin's bit for bit; the dense layers are compressed
    (int8: within the codec's error of the twin); replicas stay identical."""
    world, outdir = session
    runs = [torch.load(os.path.join(outdir, f"twin_{name}_{r}.pt"), weights_only=False)
            for r in range(world)]
    emb = NAMES["sparse"].index("emb.weight")
    for run in runs:
        hook, plain = run["hook"], run["plain"]
        assert torch.equal(hook["grads"][0][emb], plain["grads"][0][emb])
        assert hook["grads"][0][emb].abs().sum() > 0
        for i, (a, b) in enumerate(zip(hook["grads"][0], plain["grads"][0])):
            tol = 1e-6 if name.endswith("fp32") else 0.05 * b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=0, atol=tol + 1e-7)
        for a, b in zip(hook["params"][-1], runs[0]["hook"]["params"][-1]):
            assert torch.equal(a, b), "replicas differ"


def _twin(outdir, name, world):
    return [torch.load(os.path.join(outdir, f"twin_{name}_{r}.pt"), weights_only=False)
            for r in range(world)]


def test_unused_parameter_with_grads_set_to_none_stays_as_plain_ddp(session):
    """zero_grad(set_to_none=True): DDP leaves the gradient of a parameter no rank used None; the
    optimizer skips it, as in the twin: it keeps its value of step 0."""
    world, outdir = session
    for run in _twin(outdir, "unused_none", world):
        for side in ("hook", "plain"):
            for i in UNUSED:
                assert all(g[i] is None for g in run[side]["grads"][1:])
                assert torch.equal(run[side]["params"][-1][i], run[side]["params"][0][i])


def test_unused_parameter_with_zeroed_grads_moves_limitation(session):
    """The documented limitation: with zeroed gradients (set_to_none=False) the bucket view is the
    gradient, and the hook, which cannot know that no rank used the parameter (DDP learns it after
    the last bucket's hook), writes the decoded residual of its zero slice there: the optimizer
    moves it where plain DDP leaves it."""
    world, outdir = session
    for run in _twin(outdir, "unused_zeros", world):
        plain, hook = run["plain"], run["hook"]
        for i in UNUSED:
            assert torch.equal(plain["params"][-1][i], plain["params"][0][i])
            assert all(torch.equal(g[i], torch.zeros_like(g[i])) for g in plain["grads"][1:])
        assert any(not torch.equal(hook["params"][-1][i], hook["params"][0][i]) for i in UNUSED)
