"""Which backend and device a world runs on, decided in one small function.

NCCL is the fast path on GPUs, but it needs CUDA tensors and one GPU per rank; gloo runs on CPU
everywhere and can also move CUDA tensors, so it is the fallback when GPUs are too few.
"""

from __future__ import annotations

import os

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")


class DeviceChoiceError(ValueError):
    """The asked-for backend and device cannot work on this machine; the message says why."""


def choose_backend(
    world_size: int,
    gpu_count: int,
    backend: str | None = None,
    device: str | None = None,
    nccl_available: bool = True,
) -> tuple[str, str]:
    """``(backend, device)`` for ``world_size`` ranks on a machine with ``gpu_count`` GPUs.

    ``world_size`` is the number of ranks on this machine (the local world size). By default:
    NCCL on CUDA when every rank can have a GPU of its own, else gloo on CPU. ``backend`` and
    ``device`` force a choice; a combination that cannot work raises ``DeviceChoiceError``.
    """
    if backend is not None and backend not in BACKENDS:
        raise DeviceChoiceError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if device is not None and device not in DEVICES:
        raise DeviceChoiceError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    enough_gpus = gpu_count >= world_size >= 1
    if device is None and backend == "nccl":
        device = "cuda" if gpu_count else "cpu"
    elif device is None:
        device = "cuda" if enough_gpus and backend is None else "cpu"
    if device == "cuda" and gpu_count == 0:
        raise DeviceChoiceError("--device cuda, but torch sees no GPU here: use --device cpu")
    if backend is None:
        backend = "nccl" if device == "cuda" and enough_gpus and nccl_available else "gloo"
    if backend == "nccl":
        if device == "cpu":
            raise DeviceChoiceError(
                "NCCL moves only CUDA tensors, and this world runs on the CPU: use --backend gloo"
            )
        if not nccl_available:
            raise DeviceChoiceError("this torch build has no NCCL: use --backend gloo")
        if not enough_gpus:
            raise DeviceChoiceError(
                f"NCCL needs one GPU per rank: {world_size} ranks, {gpu_count} GPU(s). Use fewer "
                "ranks, or --backend gloo, which can share a GPU between ranks"
            )
    return backend, device


def choose_for_this_machine(
    world_size: int, backend: str | None = None, device: str | None = None
) -> tuple[str, str]:
    """``choose_backend`` with this machine's GPU count and NCCL support."""
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return choose_backend(
        world_size, gpus, backend, device, nccl_available=dist.is_nccl_available()
    )


def rank_device():
    """Inside a rank: ``cuda:LOCAL_RANK`` when its world runs on CUDA, else the CPU.

    With fewer GPUs than ranks (gloo can share a GPU; NCCL cannot) ranks share GPUs round-robin.

    The launcher and the test harness say which through ``DOJO_DEVICE`` (``cuda`` or ``cpu``).
    """
    import torch

    if os.environ.get("DOJO_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", gpu_of(int(os.environ.get("LOCAL_RANK", "0"))))
    return torch.device("cpu")


def gpu_of(local_rank: int) -> int:
    """The GPU a local rank uses: its own with one GPU per rank; shared round-robin (gloo only)
    when there are fewer GPUs than ranks."""
    import torch

    return local_rank % max(1, torch.cuda.device_count())
