"""Worlds on CUDA, for the specs' tests marked ``cuda`` (skipped, saying why, without GPUs).

on_cuda(world_size, backend)   ``run_world``'s options for a world on CUDA; skips without GPUs enough
rank_gpu()                     inside a rank: its GPU, made the current device
"""

from __future__ import annotations

from dojo.spec.testing import require_gpus


def on_cuda(world_size: int, backend: str, deadline: float = 60) -> dict:
    """``run_world(fn, world_size, ..., **on_cuda(world_size, backend))``: every rank on a GPU
    (``DOJO_DEVICE=cuda``). Skips the test unless there are GPUs enough: one per rank for NCCL,
    one in all for gloo, whose ranks can share it."""
    require_gpus(world_size if backend == "nccl" else 1)
    return {"backend": backend, "env": {"DOJO_DEVICE": "cuda"}, "deadline": deadline}


def rank_gpu():
    """Inside a rank of a world on CUDA: its GPU (``dojo.devices.rank_device``), made the
    current device, as a real program does before any CUDA work. With fewer GPUs than ranks,
    gloo's ranks share them round-robin."""
    import torch

    from dojo.devices import rank_device

    device = rank_device()
    torch.cuda.set_device(device)
    return device
