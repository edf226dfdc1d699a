"""k15's mistakes catalogue: real mistakes in saving, loading and resuming under data
parallelism (the classic hang among them), and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import io
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.harness import impl


def _k15():
    """The reference module, with this entry swapped in (what every test and rank sees). In a
    rank of the kata's own program that is the program's module (``__mp_main__``), whose
    ``Interrupted`` the program catches, not a second copy imported under its package name."""
    for name in ("__mp_main__", "__main__"):
        module = sys.modules.get(name)
        if module is not None and impl.kata_name_of(module) == "k15_checkpoints":
            return module
    return impl.load_kata("k15_checkpoints")


def _inner(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def _state(model, optimizer, step) -> dict:
    return {"model": _inner(model).state_dict(), "optimizer": optimizer.state_dict(), "step": step}


# --------------------------------------------------------------------------- save_checkpoint


def every_rank_writes(path, model, optimizer, step):
    torch.save(_state(model, optimizer, step), path)  # "the replicas are equal anyway"
    dist.barrier()


def local_rank_0_writes(path, model, optimizer, step):
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # the GPU index, once per node
        torch.save(_state(model, optimizer, step), path)
    dist.barrier()


def barrier_inside_if_rank_0(path, model, optimizer, step):
    if dist.get_rank() == 0:
        torch.save(_state(model, optimizer, step), path)
        dist.barrier()  # indented one level too far: the classic hang


def no_barrier(path, model, optimizer, step):
    if dist.get_rank() == 0:  # the others go on at once, maybe to read a file not written yet
        torch.save(_state(model, optimizer, step), path)


def barrier_before_saving(path, model, optimizer, step):
    dist.barrier()  # "everyone is here, now save": the others leave before the write
    if dist.get_rank() == 0:
        torch.save(_state(model, optimizer, step), path)


def wrapper_state_dict(path, model, optimizer, step):
    if dist.get_rank() == 0:  # DDP's own state_dict: every key starts with "module."
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path
        )
    dist.barrier()


def named_parameters_saved(path, model, optimizer, step):
    if dist.get_rank() == 0:  # "the weights are the parameters": a tied one once, no buffer
        weights = {name: p.detach() for name, p in _inner(model).named_parameters()}
        torch.save({"model": weights, "optimizer": optimizer.state_dict(), "step": step}, path)
    dist.barrier()


def model_only(path, model, optimizer, step):
    if dist.get_rank() == 0:  # "the weights are what matters"
        torch.save({"model": _inner(model).state_dict(), "step": step}, path)
    dist.barrier()


# Right answers written differently.


def through_a_buffer(path, model, optimizer, step):
    """Serialise into memory, then write the bytes: any rank-0-only write works."""
    if dist.get_rank(group=dist.group.WORLD) == 0:
        buffer = io.BytesIO()
        torch.save(_state(getattr(model, "module", model), optimizer, step), buffer)
        with open(path, "wb") as file:
            file.write(buffer.getvalue())
    dist.barrier()


# --------------------------------------------------------------------------- load_checkpoint


def _checked(checkpoint: dict, path) -> dict:
    missing = [key for key in ("model", "optimizer", "step") if key not in checkpoint]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    return checkpoint


def no_map_location(path, model, optimizer):
    checkpoint = _checked(torch.load(path), path)  # onto the device each tensor was saved from
    _inner(model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return int(checkpoint["step"])


def loaded_on_rank_0_only(path, model, optimizer):
    checkpoint = _checked(torch.load(path, map_location="cpu"), path)
    if dist.get_rank() == 0:  # "rank 0 loads, DDP keeps the others in step"
        _inner(model).load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    return int(checkpoint["step"])


def loaded_into_the_wrapper(path, model, optimizer):
    checkpoint = _checked(torch.load(path, map_location="cpu"), path)
    model.load_state_dict(checkpoint["model"])  # DDP expects "module." keys
    optimizer.load_state_dict(checkpoint["optimizer"])
    return int(checkpoint["step"])


def optimizer_not_loaded(path, model, optimizer):
    checkpoint = _checked(torch.load(path, map_location="cpu"), path)
    _inner(model).load_state_dict(checkpoint["model"])  # momentum starts again from zero
    return int(checkpoint["step"])


def keys_unchecked(path, model, optimizer):
    checkpoint = torch.load(path, map_location="cpu")  # a KeyError for whatever is missing first
    _inner(model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return int(checkpoint["step"])


def returns_the_next_step(path, model, optimizer):
    checkpoint = _checked(torch.load(path, map_location="cpu"), path)
    _inner(model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return int(checkpoint["step"]) + 1  # "the step to train next"


# Right answers written differently.


def loaded_to_the_cpu(path, model, optimizer):
    """Load to the CPU: load_state_dict copies into the model's own tensors wherever they are."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    absent = sorted({"model", "optimizer", "step"} - set(checkpoint))
    if absent:
        raise ValueError(f"not a k15 checkpoint: no {', '.join(absent)} in {path}")
    getattr(model, "module", model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint["step"]


# --------------------------------------------------------------------------- train


def _setup(rank, world_size, model_name, seed, interrupt_at):
    k15 = _k15()
    model = k15.make_model(model_name, seed).to(k15.rank_device())
    ddp = k15.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=k15.LR, momentum=k15.MOMENTUM)
    return k15, ddp, optimizer, k15.Run(rank, world_size, model_name, interrupt_at)


def _loop(
    rank, world_size, checkpoint, steps, save_every, model_name, seed, interrupt_at,
    only_rank_0=False, resume=True, from_zero=False, after_the_saved=False, save_index=False,
):  # fmt: skip
    k15, ddp, optimizer, run = _setup(rank, world_size, model_name, seed, interrupt_at)
    start = 0
    if resume and os.path.exists(checkpoint):
        start = k15.load_checkpoint(checkpoint, ddp, optimizer) + (1 if after_the_saved else 0)
    for step in range(0 if from_zero else start, steps):
        run.step(ddp, optimizer, step)
        if (step + 1) % save_every == 0 and (rank == 0 or not only_rank_0):
            k15.save_checkpoint(checkpoint, ddp, optimizer, step if save_index else step + 1)
    return run.result(ddp, optimizer, start)


def saved_on_rank_0_only(
    rank, world_size, checkpoint, steps, save_every, model_name="buffer", seed=0, interrupt_at=None
):
    # "only rank 0 saves", so the call goes under `if rank == 0:`: its barrier waits for ever
    return _loop(**locals(), only_rank_0=True)


def never_resumes(
    rank, world_size, checkpoint, steps, save_every, model_name="buffer", seed=0, interrupt_at=None
):
    # saves faithfully, never looks for the file: every restart starts from scratch
    return _loop(**locals(), resume=False)


def restarts_from_zero(
    rank, world_size, checkpoint, steps, save_every, model_name="buffer", seed=0, interrupt_at=None
):
    # loads the checkpoint, then runs the whole loop again on top of it
    return _loop(**locals(), from_zero=True)


def skips_the_saved_step(
    rank, world_size, checkpoint, steps, save_every, model_name="buffer", seed=0, interrupt_at=None
):
    # "the checkpoint's step is done, so start after it": the step after it is lost
    return _loop(**locals(), after_the_saved=True)


def saves_the_index(
    rank, world_size, checkpoint, steps, save_every, model_name="buffer", seed=0, interrupt_at=None
):
    # save_checkpoint(..., step): the index of the last step, one less than the steps done
    return _loop(**locals(), save_index=True)


# Right answers written differently.


def while_loop(
    rank, world_size, checkpoint, steps, save_every, model_name="buffer", seed=0, interrupt_at=None
):
    """A while loop over the count of steps done."""
    k15, ddp, optimizer, run = _setup(rank, world_size, model_name, seed, interrupt_at)
    done = start = (
        k15.load_checkpoint(checkpoint, ddp, optimizer) if os.path.isfile(checkpoint) else 0
    )
    while done < steps:
        run.step(ddp, optimizer, done)
        done += 1
        if done % save_every == 0:
            k15.save_checkpoint(checkpoint, ddp, optimizer, done)
    return run.result(ddp, optimizer, start)


# --------------------------------------------------------------------------- the catalogue

_ONLY_RANK_0 = "test_only_global_rank_0_writes_the_checkpoint"
_HOLDS = "test_the_checkpoint_holds_the_unwrapped_model_the_optimizer_and_the_step"
_WAITS = "test_every_rank_waits_until_the_checkpoint_is_complete"
_LOADS = "test_every_rank_loads_the_checkpoint_into_its_model_and_optimizer"
_DEVICE = "test_every_rank_loads_onto_its_own_device"
_REFUSED = "test_a_file_that_is_not_a_checkpoint_is_refused"
_RESUMED = "test_a_resumed_run_ends_exactly_like_an_uninterrupted_one"
_SAVES = "test_every_rank_saves_every_save_every_steps"

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "every_rank_writes",
        replaces="save_checkpoint",
        fails=[_ONLY_RANK_0],
        says=["ranks 0, 1, 2 and 3 wrote the checkpoint", "only global rank 0 may"],
    ),
    Mistake(
        "local_rank_0_writes",
        replaces="save_checkpoint",
        fails=[_ONLY_RANK_0],
        says=["ranks 0 and 2 both wrote", "LOCAL_RANK 0", "dist.get_rank() == 0"],
    ),
    Mistake(
        "barrier_inside_if_rank_0",
        replaces="save_checkpoint",
        fails=[_ONLY_RANK_0, _HOLDS, _WAITS],
        says=[
            "save_checkpoint hung",
            "the classic hang",
            "`if rank == 0:`",
            "rank 0 waits in barrier",
            "Call dist.barrier() on every rank",
        ],
    ),
    Mistake(
        "no_barrier",
        replaces="save_checkpoint",
        fails=[_WAITS],
        says=["made no collective call", "dist.barrier()"],
    ),
    Mistake(
        "barrier_before_saving",
        replaces="save_checkpoint",
        fails=[_WAITS],
        says=["before rank 0 had finished writing", "before its torch.save", "after the write"],
    ),
    Mistake(
        "wrapper_state_dict",
        replaces="save_checkpoint",
        fails=[_HOLDS],
        says=["start with 'module.'", "model.module.state_dict()"],
    ),
    Mistake(
        "named_parameters_saved",
        replaces="save_checkpoint",
        fails=[f"{_RESUMED}[tied]"],
        says=["the checkpoint lacks ['output.weight']", "named_parameters() lists a shared"],
    ),
    Mistake(
        "model_only",
        replaces="save_checkpoint",
        fails=[_HOLDS],
        says=["holds the model but not the optimizer", "optimizer.state_dict()"],
    ),
    Mistake(
        "no_map_location",
        replaces="load_checkpoint",
        fails=[_DEVICE],
        says=["without map_location", "GPU 0"],
    ),
    Mistake(
        "loaded_on_rank_0_only",
        replaces="load_checkpoint",
        fails=[_LOADS],
        says=["rank 1's weights are not the checkpoint's", "(rank 0 did)", "not rank 0 alone"],
    ),
    Mistake(
        "loaded_into_the_wrapper",
        replaces="load_checkpoint",
        fails=[_LOADS, _DEVICE],
        says=["into the DDP wrapper", "(model.module)"],
    ),
    Mistake(
        "optimizer_not_loaded",
        replaces="load_checkpoint",
        fails=[_LOADS],
        says=["optimizer holds no momentum", "optimizer.load_state_dict"],
    ),
    Mistake(
        "keys_unchecked",
        replaces="load_checkpoint",
        fails=[_REFUSED],
        says=["raised KeyError", "Raise ValueError naming the keys it lacks"],
    ),
    Mistake(
        "returns_the_next_step",
        replaces="load_checkpoint",
        fails=[_LOADS],
        says=["returned 6, but the checkpoint says step 5", "return its 'step' as it is"],
    ),
    Mistake(
        "saved_on_rank_0_only",
        replaces="train",
        fails=[_RESUMED, _SAVES],
        says=[
            "rank 0 called save_checkpoint (after 3 steps), rank 1 never did",
            "the classic hang",
            "Never call it under `if rank == 0:`",
            "The harness's report",
        ],
    ),
    Mistake(
        "never_resumes",
        replaces="train",
        fails=[_RESUMED],
        says=["never called load_checkpoint", "Start from the checkpoint"],
    ),
    Mistake(
        "restarts_from_zero",
        replaces="train",
        fails=[_RESUMED],
        says=["then trained from step 1", "Go on from the step load_checkpoint returns"],
    ),
    Mistake(
        "skips_the_saved_step",
        replaces="train",
        fails=[_RESUMED],
        says=["it skipped [3]", "the next index is that count"],
    ),
    Mistake(
        "saves_the_index",
        replaces="train",
        fails=[_RESUMED, _SAVES],
        says=["after 3 steps with step=2", "(step + 1)"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("through_a_buffer", replaces="save_checkpoint"),
    RightAnswer("loaded_to_the_cpu", replaces="load_checkpoint"),
    RightAnswer("while_loop", replaces="train"),
]
