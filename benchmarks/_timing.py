"""How every benchmark here times one call or step: the slowest rank's, between two barriers."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dojo.devices import rank_device


def synchronize(device: torch.device) -> None:
    """CUDA work is asynchronous: wait for it before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest_rank(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a step is as slow as its slowest rank)."""
    # on the rank's device: NCCL reduces CUDA tensors only
    timing = torch.tensor([seconds], dtype=torch.float64, device=rank_device())
    dist.all_reduce(timing, op=dist.ReduceOp.MAX)
    return float(timing.item())


def timed(work: Callable[..., object], *args: object) -> float:
    """Seconds ``work(*args)`` took on the slowest rank, every rank starting together."""
    device = rank_device()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    work(*args)
    synchronize(device)
    return slowest_rank(time.perf_counter() - start)
