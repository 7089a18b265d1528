"""Fault tolerance of the DDP hook on 2 Gloo ranks: a rank killed mid-training under
`torchrun --max-restarts=1` is restarted, the job resumes from each rank's checkpoint (model,
optimizer, CompressionState; DDP's first iteration after the restart has its initial bucket
layout, not the checkpoint's) and ends with exactly the parameters of an uninterrupted run; a rank
that dies without restart makes the other fail with an error, not hang; a restart at another world
size continues, with a warning, from zero residuals."""

import math
import os
import subprocess
import sys
import time

import pytest
import torch

import ddp_scenarios as sc
from dist_util import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(out, codec, optimizer, kill_at):
    os.makedirs(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2",
           os.path.join(HERE, "elastic_train.py"), "--out", str(out), "--codec", codec,
           "--kill-at", str(kill_at)] + ([] if optimizer is None else ["--optimizer", optimizer])
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(os.path.join(out, "final.pt"))


@pytest.mark.parametrize("codec,optimizer", [("int8", None), ("sign", "adamw"), ("topk:0.1", "sgd")])
def test_killed_rank_restarts_and_resumes_exactly(tmp_path, codec, optimizer):
    uninterrupted = torchrun(tmp_path / "plain", codec, optimizer, kill_at=-1)
    resumed = torchrun(tmp_path / "killed", codec, optimizer, kill_at=3)
    assert (tmp_path / "killed" / "attempt1.rank1").exists(), "the job was not restarted"
    assert not (tmp_path / "plain" / "attempt1.rank0").exists()
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b), f"{codec}: the resumed run's parameters differ"


def _moment_by_parameter(residuals: dict, which: int) -> dict:
    """key -> that parameter's slice of moment ``which`` (0: m, 1: v), from a state's buckets."""
    out = {}
    for bucket in residuals.values():
        off = 0
        for key, shape in bucket["layout"][1]:
            n = math.prod(shape)
            out[key] = bucket["moments"][which][off:off + n]
            off += n
    return out


@pytest.mark.parametrize("codec,optimizer", [("int8", None), ("sign", "adamw"),
                                             ("lowrank:2", None)])
@pytest.mark.parametrize("before,after", [(2, 3), (3, 2)])
def test_restart_at_another_world_size_warns_and_drops_the_per_rank_state(tmp_path, codec, optimizer,
                                                                         before, after):
    """Checkpoints of `before` ranks loaded by `after` ranks: every rank warns naming both sizes and
    trains on from zero residuals (none has a wrong shape), the replicas identical. Without an
    optimizer direction that is exactly a fresh CompressionState at the saved step; FrozenVarianceAdamW's
    moments, the same on every rank, are kept: the variance, frozen past the warm-up, is still the
    checkpoint's after two more steps (a fresh state would have frozen it at zero); so are
    lowrank's Q factors (a fresh state would start from the initial Q)."""
    run_ranks(sc.world_change, before, str(tmp_path), codec, optimizer, "save", timeout=240)
    run_ranks(sc.world_change, after, str(tmp_path), codec, optimizer, "load", timeout=240)
    for r in range(after):
        run = torch.load(tmp_path / f"world_{r}.pt", weights_only=False)
        assert len(run["loaded_warnings"]) == 1 and not run["fresh_warnings"], run["loaded_warnings"]
        assert f"world size {before}" in run["loaded_warnings"][0]
        assert f"has {after} ranks" in run["loaded_warnings"][0]
        assert run["loaded_residuals"] and all(
            v["residual"].numel() == v["layout"][0] for v in run["loaded_residuals"].values())
        same = all(torch.equal(a, b) for a, b in zip(run["loaded"], run["fresh"]))
        other = torch.load(tmp_path / f"world_{(r + 1) % after}.pt", weights_only=False)
        assert all(torch.equal(a, b) for a, b in zip(run["loaded"], other["loaded"]))
        if codec.startswith("lowrank"):
            # the warm start continues from the checkpoint's Q, where a fresh state draws it anew
            assert not same and "the Q factors, the same on every rank, are kept" in \
                run["loaded_warnings"][0]
            continue
        if optimizer is None:
            assert same
            continue
        assert not same and "moments, the same on every rank, are kept" in run["loaded_warnings"][0]
        saved = torch.load(tmp_path / f"world_ckpt_{r % before}.pt", weights_only=False)
        assert saved["gradzip"]["step"] > sc.warmup_for(optimizer)  # the variance is frozen
        v_saved = _moment_by_parameter(saved["gradzip"]["residuals"], 1)
        v_loaded = _moment_by_parameter(run["loaded_residuals"], 1)
        assert v_saved.keys() == v_loaded.keys()
        assert all(torch.equal(v_saved[k], v_loaded[k]) for k in v_saved)
        assert all(float(v.max()) > 0 for v in v_saved.values())


def test_dead_rank_fails_the_others_with_an_error(tmp_path):
    t0 = time.monotonic()
    run_ranks(sc.dead_peer, 2, str(tmp_path), timeout=120)
    with open(tmp_path / "dead_0.txt") as f:
        _, message = f.read().split("\n", 1)
    assert message.startswith("RuntimeError"), message
    assert time.monotonic() - t0 < 100  # within the process group's timeout (60 s), no hang


def test_stuck_rank_fails_the_others_within_the_group_timeout(tmp_path):
    run_ranks(sc.stuck_peer, 2, str(tmp_path), timeout=120)
    with open(tmp_path / "stuck_0.txt") as f:
        waited, message = f.read().split("\n", 1)
    assert message.startswith("RuntimeError"), message
    assert 4 < float(waited) < 20, waited  # the group's 5 s, with this machine's slack
