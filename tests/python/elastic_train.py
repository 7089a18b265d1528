"""One rank of the elastic-restart test (test_elastic.py), started by torchrun: a small DDP model
trained with compress_hook, each rank checkpointing model, optimizer and CompressionState after
every step. With --kill-at S, rank 1 of the first attempt dies (SIGKILL) once step S is
checkpointed; torchrun then restarts both ranks, which resume from their checkpoints."""

import argparse
import datetime
import os
import signal

import torch
import torch.distributed as dist

import ddp_scenarios as sc
import gradzip
from gradzip.ddp import CompressionState, compress_hook


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--codec", required=True)
    ap.add_argument("--optimizer", default=None)  # None: torch SGD; adamw / sgd: gradzip.optim
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-at", type=int, default=-1)
    args = ap.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    torch.set_num_threads(1)
    gradzip.set_num_threads(1)
    # A rendezvous file per attempt: with torchrun's agent store, a restarted Gloo group can read
    # the dead attempt's peer addresses (connectFullMesh then fails with "Connection refused").
    dist.init_process_group("gloo", init_method=f"file://{args.out}/rendezvous.{attempt}",
                            rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))
    open(os.path.join(args.out, f"attempt{attempt}.rank{rank}"), "w").close()

    model = sc.make_model()
    ddp = sc.make_ddp(model, {})
    opt = sc.make_optimizer(args.optimizer, model.parameters())
    state = CompressionState(args.codec, min_compress_numel=32,
                             warmup_steps=sc.warmup_for(args.optimizer),
                             optimizer=None if args.optimizer is None else opt)
    ddp.register_comm_hook(state, compress_hook)
    ckpt = os.path.join(args.out, f"ckpt.rank{rank}.pt")
    start = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["gradzip"])
        start = saved["step"]
    for step in range(start, args.steps):
        opt.zero_grad()
        sc.loss_fn(ddp, *sc.batch(step, rank)).backward()
        opt.step()
        saved = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                 "gradzip": state.state_dict(), "step": step + 1}
        torch.save(saved, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)  # a rank killed while saving leaves the last checkpoint
        dist.barrier()  # every rank's checkpoint of this step is on disk
        if step + 1 == args.kill_at and rank == 1 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()],
                   os.path.join(args.out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
