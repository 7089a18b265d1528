"""How the DDP hook's state (:class:`gradzip.ddp.CompressionState`) finds its per-bucket state again
in a new bucket layout or a new process: parameters numbered in the order the hook first sees them
(:class:`ParameterKeys`), a resumed run's first bucket reduced as the checkpoint's buckets
(:func:`reduce_as_saved`), and a checkpoint of another world size continued from zero residuals
(:func:`drop_state_of_another_world`).
"""

import os
import warnings

import torch

from .bucket_state import StateStore, param_offsets


class ParameterKeys:
    """Numbers parameters in the order the hook first sees them (the same in every process that
    builds the same model and DDP configuration). The numbering is rebuilt in each new process (an
    unpickled state sees the model again from DDP's first iteration)."""

    def __init__(self):
        self._pid, self._keys = os.getpid(), {}

    def layout(self, bucket, n: int):
        """The bucket_state layout of DDP's ``bucket`` of ``n`` elements."""
        if self._pid != os.getpid():
            self._pid, self._keys = os.getpid(), {}
        params = bucket.parameters() if hasattr(bucket, "parameters") else []
        keys = [self._keys.setdefault(id(p), len(self._keys)) for p in params]
        return (n, tuple((k, tuple(p.shape)) for k, p in zip(keys, params)))


def reduce_as_saved(buf: torch.Tensor, layout, cover, reduce):
    """Reduces ``buf`` (of ``layout``) as the stored buckets ``cover`` ((index, layout) pairs,
    StateStore.covering) that hold its parameters (a
    resumed run's first iteration, whose one bucket the uninterrupted run reduced as several), each
    on a gathered float32 copy by ``reduce(index, part, saved_layout)`` (a Future), and scatters
    the averages back. Returns the Future of ``buf``."""
    x = buf.float() if buf.dtype != torch.float32 else buf
    where = param_offsets(layout)
    parts, futs = [], []
    for i, saved in cover:
        index = torch.cat([torch.arange(where[k][0], where[k][0] + where[k][1]) for k, _ in saved[1]])
        index = index.to(buf.device)
        part = x.index_select(0, index)
        futs.append(reduce(i, part, saved))
        parts.append((index, part))

    def scatter(_):
        for index, part in parts:
            x.index_copy_(0, index, part)
        if x is not buf:
            buf.copy_(x)
        return [buf]

    return torch.futures.collect_all(futs).then(scatter)


def drop_state_of_another_world(store: StateStore, config, saved: int, world: int,
                                step: int) -> bool:
    """A checkpoint saved at world size ``saved`` and resumed on ``world`` ranks (an elastic restart
    with fewer or more ranks) continues from zero residuals: they are per rank (this rank's share
    of the average, its shard of a bucket), and with another number of ranks they have no
    counterpart. Optimizer moments computed from the average (FrozenVarianceAdamW's) are the same
    on every rank and are kept (a frozen variance dropped past the warm-up would stay zero), as
    are lowrank's Q factors (the warm start, identical on every rank); per-rank moments
    (CompressedSGD's velocity) go with the residuals. The step count is kept. Returns whether the
    state was dropped (the world sizes differ)."""
    if saved is None or saved == world:
        return False
    direction = config.direction
    shared = direction is not None and direction.moments_shared
    if store.buckets:
        kept = [name for name, keeps in (("the optimizer moments", shared),
                                         ("the Q factors", config.plan.lowrank_rank))
                if keeps]
        what = ("its residuals are dropped (they are per rank; "
                f"{' and '.join(kept)}, the same on every rank, are kept)" if kept else
                "its residuals and optimizer moments are dropped (they are per rank)")
        warnings.warn(f"gradzip: the CompressionState checkpoint was saved with world size "
                      f"{saved}, this process group has {world} ranks: {what}; "
                      f"training continues from zero residuals at step {step}", stacklevel=3)
    store.drop_rank_state(keep_moments=shared)
    return True
