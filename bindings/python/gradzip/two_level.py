"""A two-level reduction for jobs on several nodes: exact inside a node, compressed between nodes.

    from gradzip.ddp import compress_hook
    from gradzip.two_level import TwoLevelState
    ddp_model.register_comm_hook(TwoLevelState("int8", ranks_per_node=8), compress_hook)

Why: a node's ranks share a fast link (NVLink, shared memory) and the nodes a slow one. The flat
hook has every rank exchange compressed shards with every other rank, so the slow link carries
what the fast one could have summed, and every rank pays the codec's passes for the whole bucket.
Here each bucket goes through three phases, as CGX and ZeRO++'s qgZ do:

1. inside the node, an exact fp32 reduce-scatter (torch.distributed's, on the node's ranks): local
   rank l receives the node's average of the bucket's l-th contiguous shard (the last one padded
   with zeros to the same size);
2. between the nodes, the shard is averaged by the flat hook's C++ reduction (codec, error
   feedback, warm-up, guard, as :class:`gradzip.ddp.CompressionState`) over the group of the ranks
   that hold the same shard on every node: N nodes take part, not N x R ranks, and each rank
   encodes 1/R of the bucket;
3. inside the node, an fp32 all-gather of the shards into the bucket.

Every rank ends with the same bits: each shard's average is the one the compressed reduction gives
all its ranks, and the all-gather copies it. The error-feedback residual is the shard's (1/R of
the bucket per rank): the compression error of the node's average, kept by the rank that sends it.

Ranks are numbered node by node, as torchrun numbers them (rank = node * R + local rank);
``ranks_per_node`` defaults to torchrun's ``LOCAL_WORLD_SIZE``. The byte counts in ``stats`` are
the inter-node reduction's, against the fp32 all-reduce of the same shards between the nodes.
Not supported (a ``ValueError`` at construction): the ``gradzip.optim`` optimizers (their one
state is the whole bucket's), ``lowrank:R`` (a shard cuts its matrices) and a ``process_group``
(the node layout's groups span the default group). The residual of DDP's first iteration, whose
one bucket is rebuilt into several, starts the rebuilt buckets' shards from zero (the shards'
boundaries move); a checkpoint resumes exactly, as the flat hook's.

Phase 1 runs in the hook and waits for its reduce-scatter before phase 2 can encode the shard:
with Gloo on the CPU that blocks DDP's hook thread for the node's exchange (on the GPU it waits on
the stream, not the host), so the intra-node time adds to the step instead of overlapping the
backward pass; measured in bench/RESULTS.md section 4 (two nodes of two ranks).
"""

import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from .bucket_state import covering, param_offsets, tuplify
from ._groups import require_same_config
from .plan import CodecPlan
from .ddp import CompressionState

__all__ = ["TwoLevelState", "NodeGroups", "shard_layout", "check_two_level",
           "checked_ranks_per_node"]


class NodeGroups:
    """The process groups of a node layout over the default group's W = N x R ranks: this rank's
    node (``node``; ``node_gather`` the same ranks again, for the all-gathers issued from the C++
    reduction's finishing thread while the hook issues the next bucket's reduce-scatter on
    ``node``), and ``across``: the N ranks of this rank's local rank, one per node."""

    def __init__(self, ranks_per_node: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        r = int(ranks_per_node)
        if r < 1 or world % r:
            raise ValueError(f"gradzip.two_level: ranks_per_node={ranks_per_node} does not divide "
                             f"the world size {world}")
        local = os.environ.get("LOCAL_RANK")
        if local is not None and int(local) != rank % r:
            raise ValueError(f"gradzip.two_level: rank {rank} has LOCAL_RANK {local}, not rank % "
                             f"ranks_per_node = {rank % r}: ranks must be numbered node by node")
        self.ranks_per_node, self.nodes = r, world // r
        self.node_index, self.local_rank = divmod(rank, r)
        # torch.distributed's rule: every rank creates every group, in the same order
        for n in range(self.nodes):
            ranks = list(range(n * r, (n + 1) * r))
            node, gather = dist.new_group(ranks), dist.new_group(ranks)
            if n == self.node_index:
                self.node, self.node_gather = node, gather
        for local_rank in range(r):
            across = dist.new_group(list(range(local_rank, world, r)))
            if local_rank == self.local_rank:
                self.across = across


def shard_layout(layout, local_rank: int, shard: int):
    """The bucket_state layout of local rank ``local_rank``'s ``shard`` elements of a bucket of
    ``layout`` (the contiguous elements [local_rank * shard, (local_rank + 1) * shard), past the
    bucket's end padding): one piece per parameter it cuts, keyed (parameter key, first element
    in the parameter), so that the residual follows the piece across a checkpoint; a piece keeps
    its parameter's shape when whole, else it is flat (a weight's piece 1 x m, so that the
    codecs' rule for 1-D tensors, uncompressed_numel, still tells weights from biases)."""
    n = layout[0]
    lo, hi = local_rank * shard, (local_rank + 1) * shard
    offsets = param_offsets(layout)
    if not offsets:
        return (shard, ())
    pieces = []
    for key, (off, m, shape) in offsets.items():
        a, b = max(off, lo), min(off + m, hi)
        if b <= a:
            continue
        whole = (a, b) == (off, off + m)
        pieces.append(((key, a - off), shape if whole else (b - a,) if len(shape) <= 1
                       else (1, b - a)))
    if hi > n:
        pieces.append((("padding", max(lo, n)), (hi - max(lo, n),)))
    return (shard, tuple(pieces))


def check_two_level(codec: str, optimizer) -> None:
    """Refuses (ValueError) the settings a shard's reduction cannot run: a gradzip.optim
    ``optimizer`` (its state is the whole bucket's) and lowrank (it factors whole matrices)."""
    if optimizer is not None:
        raise ValueError("gradzip.two_level: the gradzip.optim optimizers keep one state of the "
                         "whole bucket, which a shard's reduction does not form: use torch's "
                         "optimizers (or the flat CompressionState)")
    if CodecPlan.parse(codec).lowrank_rank:
        raise ValueError(f"gradzip.two_level: {codec} factors whole matrices, which a "
                         "node's shard cuts: use the flat CompressionState")


def checked_ranks_per_node(ranks_per_node: Optional[int]) -> int:
    """``ranks_per_node`` as an int >= 1 (ValueError otherwise); None: torchrun's
    LOCAL_WORLD_SIZE."""
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError("gradzip.two_level: pass ranks_per_node (or run under torchrun, "
                             "which sets LOCAL_WORLD_SIZE)")
        ranks_per_node = int(env)
    if int(ranks_per_node) < 1:
        raise ValueError(f"gradzip.two_level: ranks_per_node must be >= 1, got {ranks_per_node}")
    return int(ranks_per_node)


class TwoLevelState(CompressionState):
    """State of :func:`gradzip.ddp.compress_hook` for the two-level reduction (module docstring).
    ``codec`` and the keyword arguments are :class:`gradzip.ddp.CompressionState`'s, but for
    ``process_group`` and ``optimizer``."""

    def __init__(self, codec: str, ranks_per_node: Optional[int] = None, **kwargs):
        if "process_group" in kwargs:
            raise TypeError("gradzip.two_level: the node layout's groups span the default group; "
                            "process_group is not an argument")
        check_two_level(codec, kwargs.get("optimizer"))
        super().__init__(codec, **kwargs)
        self.ranks_per_node = checked_ranks_per_node(ranks_per_node)
        self._nodes: Optional[NodeGroups] = None
        self._buffers: dict = {}  # bucket index -> (padded bucket, shard), fp32, reused
        self._layouts: dict = {}  # bucket index -> the bucket's layout (resume's covering)

    def _group(self):
        return self._nodes.across

    def _setup(self, device):
        if self._nodes is None:
            # every rank must lay the nodes out alike before the groups are made (else they hang)
            require_same_config(f"ranks_per_node={self.ranks_per_node} "
                                f"{self.config.describe(dist.get_world_size())}", dist.group.WORLD,
                                device, "gradzip.two_level")
            self._nodes = NodeGroups(self.ranks_per_node)
        return super()._setup(device)

    def _covering(self, layout):
        return covering(self._layouts, layout)

    def _reduce(self, index, bucket_view, x, layout):
        n, r = layout[0], self.ranks_per_node
        self._layouts[index] = layout
        shard_numel = -(-n // r)
        padded, shard = self._buffers_of(index, r * shard_numel, x.device)
        padded[:n].copy_(x.reshape(-1))
        padded[n:].zero_()
        dist.reduce_scatter_tensor(shard, padded, group=self._nodes.node)
        shard.div_(r)
        fut = super()._reduce(index, shard, shard,
                              shard_layout(layout, self._nodes.local_rank, shard_numel))
        guard, node_gather = self._guard, self._nodes.node_gather

        def gather(f):
            f.value()  # raises the inter-node reduction's error, if any
            dist.all_gather_into_tensor(padded, shard, group=node_gather)
            if guard is not None:  # the whole bucket: every rank of the node decides alike
                guard.flag(padded[:n])
            bucket_view.copy_(padded[:n].view_as(bucket_view))
            return [bucket_view]

        return fut.then(gather)

    def _buffers_of(self, index, numel, device):
        bufs = self._buffers.get(index)
        if bufs is None or bufs[0].numel() != numel or bufs[0].device != torch.device(device):
            padded = torch.empty(numel, dtype=torch.float32, device=device)
            bufs = self._buffers[index] = (padded, torch.empty(numel // self.ranks_per_node,
                                                               dtype=torch.float32,
                                                               device=device))
        return bufs

    def _end_step(self) -> None:
        super()._end_step()
        # A rebuilt bucket's shards cut its parameters elsewhere: the replaced buckets' pieces
        # have no successor (they were read, where they match, when the new ones were made).
        self._ef.drop_retired()

    def state_dict(self) -> dict:
        d = super().state_dict()
        d["ranks_per_node"] = self.ranks_per_node
        d["layouts"] = dict(self._layouts)
        return d

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._layouts = {int(i): tuplify(v) for i, v in state.get("layouts", {}).items()}
        saved = state.get("ranks_per_node")
        if saved != self.ranks_per_node:
            warnings.warn(f"gradzip.two_level: the checkpoint was saved with ranks_per_node="
                          f"{saved}, this state has {self.ranks_per_node}: the shards differ, "
                          "the residuals are dropped", stacklevel=2)
            self._ef.drop_rank_state(keep_moments=False)
            self._saved_world = None

    def __getstate__(self):
        d = super().__getstate__()
        d["_nodes"], d["_buffers"] = None, {}
        return d
