"""FSDP2's parameter all-gather with each rank's shard sent in a 16-bit or int8 codec (the idea of
ZeRO++'s quantised weights), installed by ``gradzip.fsdp.compress(..., param_codec=...)``.

FSDP2 gathers every parameter group's unsharded parameters before its forward (and again before
its backward when it reshards after forward); in fp32 these all-gathers carry as many bytes as the
gradient's reduce-scatter, which no gradient codec touches. Here each rank encodes its shard, the
encodings are all-gathered as bytes and every rank decodes all of them, its own included, so the
unsharded parameters are the same on every rank. No error feedback: these are parameters, not
gradients; the sharded parameters the optimizer updates stay exact, and only the forward and
backward see the rounded copy. Block-scaled codecs (int8) encode each parameter's chunk as its own
message, so no block mixes two parameters (a LayerNorm weight near 1 would set the scale of a
block of 0.02-sized weights). Shards FSDP already gathers in 16 bits (``MixedPrecisionPolicy``'s
``param_dtype``) or in several dtypes go through FSDP's own all-gather unchanged.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

import gradzip

from .wire import message_slot_bytes

__all__ = ["CompressedAllGather", "PARAM_CODECS"]

# Codecs that keep every element: sign and top-k drop most of a parameter and rely on error
# feedback, which parameters do not have.
PARAM_CODECS = ("bf16", "fp16", "int8")


def param_codec(spec: str) -> str:
    """``spec`` in canonical form if parameters may travel in it, else ValueError."""
    canonical = gradzip.canonical_spec(spec)
    if canonical.split(":", 1)[0] not in PARAM_CODECS:
        raise ValueError(f"gradzip.fsdp: param_codec must be one of {', '.join(PARAM_CODECS)} "
                         f"(with its options), got {spec!r}: parameters have no error feedback, "
                         "so every element must arrive")
    return canonical


class CompressedAllGather(AllGather):
    """The ``AllGather`` installed on one FSDP parameter group
    (``FSDPModule.set_custom_all_gather``). ``chunks(world)``: the elements of each parameter's
    shard in FSDP's all-gather input over ``world`` ranks, in order; ``traffic``: a dict whose ``bytes_sent`` and ``raw_bytes``
    this adds to (``raw_bytes``: what FSDP's own all-gather of the same input sends)."""

    def __init__(self, codec: str, chunks: Callable[[int], List[int]], traffic: dict,
                 check=None):
        self.codec = param_codec(codec)
        self._chunks, self._traffic = chunks, traffic
        # called with (group, device) before every compressed all-gather; the state it belongs to
        # runs its configuration check once (FSDPCompressionState._check_config)
        self._check = check
        self._world, self._messages = 0, []

    def _layout(self, world: int) -> list:
        """(elements, message bytes, slot bytes) of each chunk's message; slots start 16-byte
        aligned, as the decoders require."""
        if world != self._world:
            sizes = [(c, gradzip.encoded_bytes(c, self.codec)) for c in self._chunks(world) if c]
            self._world, self._messages = world, [(c, m, message_slot_bytes(m)) for c, m in sizes]
        return self._messages

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> Optional[dist.Work]:
        world = group.size()
        item = input_tensor.element_size()
        self._traffic["raw_bytes"] += (world - 1) * input_tensor.numel() * item
        if input_tensor.dtype != torch.float32 or world == 1:  # 16 bits already: exact as it is
            self._traffic["bytes_sent"] += (world - 1) * input_tensor.numel() * item
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)
        n, messages = input_tensor.numel(), self._layout(world)
        elements = sum(c for c, _, _ in messages)
        if n != elements or output_tensor.numel() != world * n:
            raise ValueError(f"gradzip.fsdp: parameter all-gather of {n} -> "
                             f"{output_tensor.numel()} elements; this group's parameters make "
                             f"{elements} per rank (parameters changed after compress()?)")
        if self._check is not None:
            self._check(group, input_tensor.device)
        slot = sum(s for _, _, s in messages)
        mine = torch.zeros(slot, dtype=torch.uint8, device=input_tensor.device)
        x = input_tensor.reshape(-1)
        at = off = 0
        for c, m, s in messages:
            gradzip.encode(x[off:off + c], self.codec, out=mine[at:at + m])
            at, off = at + s, off + c
        gathered = torch.empty(world * slot, dtype=torch.uint8, device=input_tensor.device)
        dist.all_gather_into_tensor(gathered, mine, group=group)
        self._traffic["bytes_sent"] += (world - 1) * slot
        out = output_tensor.reshape(-1)
        for j in range(world):
            at, off = j * slot, j * n
            for c, m, s in messages:
                gradzip.decode(gathered[at:at + m], out=out[off:off + c])
                at, off = at + s, off + c
        if not async_op:
            return None
        done = torch.futures.Future()
        done.set_result([output_tensor])
        return torch._C._distributed_c10d._create_work_from_future(done)
