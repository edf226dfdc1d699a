"""Which backend and device a world gets, for given GPU counts (runs on any machine)."""

import pytest

from dojo.devices import DeviceChoiceError, choose_backend


@pytest.mark.parametrize(
    "ranks, gpus, backend, device, expected",
    [
        (4, 0, None, None, ("gloo", "cpu")),  # a laptop
        (4, 4, None, None, ("nccl", "cuda")),  # one GPU per rank
        (4, 8, None, None, ("nccl", "cuda")),
        (1, 1, None, None, ("nccl", "cuda")),  # NCCL with a world of 1
        (4, 2, None, None, ("gloo", "cpu")),  # too few GPUs for NCCL: the safe default is the CPU
        (4, 1, "gloo", "cuda", ("gloo", "cuda")),  # gloo can share one GPU between ranks
        (4, 4, "gloo", None, ("gloo", "cpu")),
        (2, 2, None, "cpu", ("gloo", "cpu")),
        (2, 2, None, "cuda", ("nccl", "cuda")),
        (4, 2, None, "cuda", ("gloo", "cuda")),
    ],
)
def test_choice(ranks, gpus, backend, device, expected):
    assert choose_backend(ranks, gpus, backend, device) == expected


@pytest.mark.parametrize(
    "ranks, gpus, backend, device, nccl, says",
    [
        (2, 2, "nccl", "cpu", True, "CUDA tensors"),  # CPU tensors handed to NCCL
        (4, 2, "nccl", None, True, "one GPU per rank"),
        (2, 0, None, "cuda", True, "no GPU"),
        (2, 2, "nccl", None, False, "no NCCL"),
        (2, 2, "mpi", None, True, "unknown backend"),
        (2, 2, None, "tpu", True, "unknown device"),
    ],
)
def test_impossible_choices_say_what_to_do(ranks, gpus, backend, device, nccl, says):
    with pytest.raises(DeviceChoiceError, match=says):
        choose_backend(ranks, gpus, backend, device, nccl_available=nccl)


def test_without_nccl_gpus_still_run_gloo():
    assert choose_backend(2, 2, nccl_available=False) == ("gloo", "cuda")
