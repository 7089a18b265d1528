"""What a codec sends: the parsed codec plan (its spec and the collective its all-reduce uses),
and the traffic counters of a step.

The algorithms are C++, written once (bindings/torch/bucket_reduction.hpp: the phases, the shard
and piece layout, the wire slots; compressed_allreduce.hpp: the driver over a c10d ProcessGroup,
used by the DDP hook, FSDP's reduce-scatter and C++ callers); the bytes counted here are those the
reductions report of what they laid out (their ``traffic()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Tuple


from . import _ops, wire


# ---- codec plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CodecPlan:
    """A parsed codec spec and the collective its all-reduce uses."""

    spec: str  # canonical spec string
    kind: str  # fp32 | fp16 | bf16 | int8 | sign | topk | lowrank
    cast_sum: str = "wire"  # wire | fp32 (see wire.allreduce_collective)

    @staticmethod
    def parse(spec: str, cast_sum: str = "wire") -> "CodecPlan":
        if not isinstance(spec, str):
            raise TypeError(f"gradzip: codec spec must be a str, got {type(spec).__name__}")
        rank = _ops.lowrank_rank_of(spec)  # a ValueError naming the bad part of a lowrank spec
        canonical = f"lowrank:{rank}" if rank else _ops.canonical_spec(spec)
        return CodecPlan(canonical, canonical.split(":", 1)[0], cast_sum)

    def __post_init__(self):
        self.collective  # a ValueError for an unknown cast_sum

    @property
    def collective(self) -> str:
        """How the all-reduce sends a bucket: cast_allreduce | two_phase | allgather | lowrank
        (wire.allreduce_collective)."""
        return wire.allreduce_collective(self.kind, self.cast_sum)

    @property
    def wire_sum(self) -> bool:
        """One all-reduce (SUM) of the payload in the wire dtype: fp32/fp16/bf16 with cast_sum
        "wire"."""
        return self.collective == "cast_allreduce"

    @property
    def two_phase(self) -> bool:
        """All-to-all + all-gather with an fp32 sum (int8, sign, and the casts with cast_sum
        "fp32"; top-k all-gathers)."""
        return self.collective == "two_phase"

    @property
    def lowrank_rank(self) -> int:
        """R of lowrank:R (two all-reduces of low-rank factors, see lowrank_reduction.hpp); 0 for
        the other codecs."""
        return int(self.spec.split(":", 1)[1]) if self.kind == "lowrank" else 0


@lru_cache(maxsize=1024)
def shard_bounds(n: int, world: int) -> Tuple[int, ...]:
    """Start offsets of the W shards of a two-phase bucket, plus n."""
    return tuple(_ops.shard_starts(n, world))


class TrafficStats:
    """Bytes sent/received by this rank in the last completed step, and the compression ratio
    against the uncompressed collective of the same tensors (for the all-reduce: an fp32 ring
    all-reduce)."""

    def __init__(self):
        self.last = {"step": -1, "bytes_sent": 0, "bytes_received": 0, "raw_bytes": 0,
                     "compression_ratio": 1.0, "buckets": 0, "compressed_buckets": 0}
        self._acc = self._zero()

    @staticmethod
    def _zero():
        return {"bytes_sent": 0, "bytes_received": 0, "raw_bytes": 0, "buckets": 0,
                "compressed_buckets": 0}

    def add(self, sent: int, received: int, raw: int, compressed: bool):
        """One reduced bucket: the bytes this rank sent and received (as its reduction reports
        them), ``raw`` those of the uncompressed collective, ``compressed`` whether a codec carried
        it."""
        a = self._acc
        a["bytes_sent"] += sent
        a["bytes_received"] += received
        a["raw_bytes"] += raw
        a["buckets"] += 1
        a["compressed_buckets"] += int(compressed)

    def end_step(self, step):
        a = self._acc
        ratio = a["raw_bytes"] / a["bytes_sent"] if a["bytes_sent"] else 1.0
        self.last = dict(a, step=step, compression_ratio=ratio)
        self._acc = self._zero()
