"""Process-group plumbing shared by the DDP hook (:mod:`gradzip.ddp`) and the FSDP reduce-scatter
(:mod:`gradzip.fsdp`): the configuration check every rank runs before its first compressed
collective, and the private group the CPU path reduces on."""

import torch
import torch.distributed as dist

_FINGERPRINT_BYTES = 256


def require_same_config(description: str, group, device, who: str) -> None:
    """All-gathers a fixed-size ``description`` of this rank's configuration (once, synchronously)
    and raises ``ValueError`` on every rank if they differ, instead of hanging later in mismatched
    collectives."""
    world = group.size()
    text = description.encode()[:_FINGERPRINT_BYTES]
    mine = torch.zeros(_FINGERPRINT_BYTES, dtype=torch.uint8)
    mine[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    mine = mine.to(device)
    rows = torch.empty((world, _FINGERPRINT_BYTES), dtype=torch.uint8, device=device)
    dist.all_gather(list(rows.unbind(0)), mine, group=group)
    descs = [bytes(r.tolist()).rstrip(b"\0").decode(errors="replace") for r in rows.cpu()]
    if len(set(descs)) != 1:
        listing = "; ".join(f"rank {i}: {d}" for i, d in enumerate(descs))
        raise ValueError(f"{who}: ranks are configured differently, refusing to reduce "
                         f"(every rank must use the same settings): {listing}")


def reducing_group(group, device):
    """The group the C++ reduction runs on. CPU reductions run on C++ threads of their own while
    the caller's thread issues collectives of its own on ``group`` (DDP's unused-parameter bitmap
    and buffer broadcasts, FSDP's all-gathers): a group of their own (same ranks, backend and
    timeout) keeps every group's calls in one order on all ranks. CUDA reductions are enqueued in
    call order on the caller's stream and use ``group`` itself."""
    if torch.device(device).type != "cpu" or group.size() == 1:
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                          timeout=_timeout(group), use_local_synchronization=True)


def gather_group_name(group, device, plan) -> str:
    """The name of a second group for the all-gathers of a two-phase plan's CPU buckets, or "":
    the C++ reduction's finishing thread issues them while its issuing thread starts the next
    bucket's all-to-all, and a group of their own keeps both orders the same on every rank."""
    if not plan.two_phase:
        return ""
    gather = reducing_group(group, device)
    return "" if gather is group else gather.group_name


def _timeout(group):
    """The group's timeout (a dead or stuck peer fails a collective after it), None if unknown
    (torch's default then)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None
