"""k15 · Checkpoints: save once, wait together, load everywhere, resume exactly.

THE IDEA
    A long run will be interrupted (a preempted node, a crash, a time limit), so it saves its
    state now and then and a new run picks up from the last save. Under data parallelism the
    replicas are identical (k05), so one copy is enough: global rank 0 writes it, and every
    rank reads it back when the job restarts.

        step       1   2   3   4   5   6  x crash          (steps 5 and 6 are lost)
        saved              ^ step 4
        restart                    load step 4 -> 5   6   7   8   9  10  11  12
                                   == the run that was never interrupted, bit for bit

    What a checkpoint holds, and why each part:

    - the model's state_dict, taken from the model inside the wrapper: torch's
      ``DistributedDataParallel`` keeps it in ``.module``, and its own state_dict prefixes every
      key with ``module.``, which a plain model (evaluation, a later run) cannot load;
    - the optimizer's state_dict: SGD's momentum (Adam's moments) is state too, and a run that
      resumes without it steps differently from the one it replaces;
    - the step: how many optimizer steps the state holds, so the loop goes on from there.

    Saving, on every rank (it is a collective):

        rank 0   torch.save(checkpoint, path) --+
                                                +-- dist.barrier() --> every rank goes on,
        rank 1   -------------------------------+                      the file complete

    Only global rank 0 writes (``dist.get_rank()``: ``LOCAL_RANK`` is 0 once per node, and on
    a shared file system every node would write the same file). The barrier keeps every rank
    from going on (and reading the file, or exiting) before rank 0 has finished writing.

    Loading, on every rank: ``torch.load(path, map_location=...)``. ``torch.save`` remembers
    the device of every tensor (rank 0's ``cuda:0``); without ``map_location`` every rank
    loads onto rank 0's GPU, which ends in a GPU holding N copies or "invalid device ordinal"
    on a machine with fewer GPUs. Map onto this rank's device (or ``"cpu"``:
    ``load_state_dict`` copies into the model's own tensors wherever they live). Then load the
    model's part into the model inside the wrapper, and the optimizer's into the optimizer.

    THE CLASSIC HANG. A collective inside ``if rank == 0:`` waits for ever: rank 0 calls it,
    the others never do. Here it hides in two places: the barrier indented under the save, and
    a training loop that calls the saving function only on rank 0 ("only rank 0 saves"). What
    the harness reports then (``python -m katas.k15_checkpoints --show-the-hang`` runs that
    loop with your save_checkpoint; this is the reference's, your line numbers differ):

        deadlock: rank(s) 0, 1 made no progress for 5 s (no rank returned, none computed).
        rank 0 waits in barrier (solutions/k15_checkpoints.py:130, save_checkpoint); rank 1
        waits in _distributed_broadcast_coalesced (solutions/k15_checkpoints.py:230, step):
        the ranks called different collectives (_distributed_broadcast_coalesced, barrier)

        rank 0 is waiting here (most recent call last):
          File "solutions/k15_checkpoints.py", line 268, in train_with_the_classic_hang
            save_checkpoint(checkpoint, ddp, optimizer, step + 1)
          File "solutions/k15_checkpoints.py", line 130, in save_checkpoint
            dist.barrier()  # every rank, outside the if: ...

    Rank 0 waits in the barrier; rank 1 has gone on to the next step and waits in the broadcast
    that DDP's forward makes (of the model's buffers). The cure: call the saving function on
    every rank and let it decide, inside, that only rank 0 writes; only the write goes under
    the ``if``.

    Exactness: the resumed run equals the uninterrupted one bit for bit on 2 ranks (a + b is
    b + a in floating point). With 3 or more ranks, the first step of a freshly made DDP
    (which builds its gradient buckets, then rebuilds them) rounds differently from its later
    steps: a resumed run's first step is such a step, and ends about 1e-8 away (measured; the
    same happens to a run that merely wraps its model anew halfway, while a per-parameter
    all-reduce by hand, k04's, stays exact). The tests use 2 ranks and demand equality.

STEPS
    1. ``save_checkpoint``: from global rank 0 alone, ``torch.save`` a dict with the keys of
       ``CHECKPOINT_KEYS``: the unwrapped model's state_dict, the optimizer's, the step; then
       every rank waits until the file is complete.
    2. ``load_checkpoint``: on every rank, load the file onto this rank's device, into the
       unwrapped model and the optimizer; return the step. A file without those keys is a
       ``ValueError`` that names what it lacks.
    3. ``train``: resume from the checkpoint when there is one, train the remaining steps
       (``run.step``), save every ``save_every`` steps, return ``run.result(...)``.

WHAT THE TESTS CHECK
    On 4 ranks laid out as 2 nodes x 2, a save is written by global rank 0 alone (each rank's
    ``torch.save`` calls are recorded), holds the unwrapped state_dict, the momentum and the
    step, and every rank returns only after rank 0's (slowed) write has finished; a barrier
    inside ``if rank == 0:`` ends as the harness's deadlock report, named. Every rank loads
    the checkpoint (replicas built apart end equal to it, momentum included; each
    ``torch.load`` is recorded with its ``map_location``), and a file that is not a
    checkpoint is refused. Training that is interrupted and restarted ends with exactly the
    parameters and momentum of an uninterrupted run, on every rank, for three models; the loop
    saves on every rank (a save called under ``if rank == 0:`` is caught and named); the
    program shows it all.

RUN IT
    .venv/bin/python -m katas.k15_checkpoints                     (2 ranks: uninterrupted, crashed, resumed)
    .venv/bin/python -m katas.k15_checkpoints --show-the-hang     (the classic hang, and its report)
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import LaunchFailed, add_launch_arguments, launch_world
from dojo.toy_models import MODELS, loss, make_batch, make_model

CHECKPOINT_KEYS = ("model", "optimizer", "step")
GLOBAL_BATCH = 16  # every step's batch, split over the ranks
LR, MOMENTUM = 0.05, 0.9


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer, step: int) -> None:
    """Write ``{"model", "optimizer", "step"}`` to ``path`` from global rank 0 alone; return on
    every rank once the file is complete. Every rank must call it."""
    # BEGIN STEP 1: save from rank 0, then wait together
    # TODO: afterwards a file at path holds a dict with the keys of CHECKPOINT_KEYS: the state_dict
    # of the model itself (torch's DDP keeps it in model.module, and a plain model cannot load the
    # wrapper's "module."-prefixed keys), the optimizer's state_dict (momentum is state too) and
    # the step. Only global rank 0 writes it (whatever LOCAL_RANK says), and no rank returns
    # before the file is complete. Every rank calls this function. The tests run 4 ranks laid
    # out as 2 nodes x 2, record every torch.save, slow rank 0's write down, and note when each
    # rank returns; a rank that waits for ever ends as the harness's deadlock report.
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if dist.get_rank() == 0:  # the global rank: one writer for the whole job
        checkpoint = {
            "model": inner.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
        }
        torch.save(checkpoint, path)
    dist.barrier()  # every rank, outside the if: nobody goes on before the file is complete
    # END STEP 1


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer) -> int:
    """Load the checkpoint at ``path`` into ``model`` (the one inside its wrapper) and
    ``optimizer`` on this rank; return its step."""
    # BEGIN STEP 2: load on every rank, onto its own device
    # TODO: afterwards this rank's model (the one inside the wrapper, when there is one) and
    # optimizer hold the checkpoint's state, every tensor on this rank's device (never the
    # device it was saved from), and the checkpoint's step is returned as an int. A file
    # without the keys of CHECKPOINT_KEYS raises ValueError naming the ones it lacks. The tests
    # load one checkpoint on 2 ranks whose models differ, compare every weight and momentum
    # buffer, and record each torch.load and its map_location.
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    device = next(inner.parameters()).device
    checkpoint = torch.load(path, map_location=device)  # onto this rank's device, not rank 0's
    missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint]
    if missing:
        raise ValueError(
            f"{path} is not a checkpoint: it lacks {', '.join(map(repr, missing))} (a checkpoint "
            f"holds {', '.join(map(repr, CHECKPOINT_KEYS))})"
        )
    inner.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return int(checkpoint["step"])
    # END STEP 2


def train(
    rank: int,
    world_size: int,
    checkpoint: str,
    steps: int,
    save_every: int,
    model_name: str = "buffer",
    seed: int = 0,
    interrupt_at: int | None = None,
) -> dict:
    """Train ``steps`` steps with torch's DDP inside an initialised process group, resuming from
    ``checkpoint`` when that file exists and saving to it every ``save_every`` steps.

    ``interrupt_at`` simulates a crash: ``run.step`` raises ``Interrupted`` when the loop
    reaches that step. Returns ``run.result(...)``: this rank's final state, its optimizer's
    state, the step it started at, the steps it trained and their losses.
    """
    device = rank_device()
    model = make_model(model_name, seed).to(device)
    ddp = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    run = Run(rank, world_size, model_name, interrupt_at)

    # BEGIN STEP 3: the loop that resumes and saves
    # TODO: train steps 0..steps-1 with run.step(ddp, optimizer, step), but a run that finds a
    # checkpoint file goes on from the step it holds, with its state; after each step whose count
    # of steps done is a multiple of save_every, save that count (every rank calls the save).
    # Return run.result(ddp, optimizer, start), start being the step this run started from. The
    # tests train 8 steps, crash a run after 5 (run.step raises Interrupted), restart it, and
    # demand the uninterrupted run's weights and momentum bit for bit on every rank; they note
    # every step, save and load, and name the ranks that saved when the others did not.
    start = load_checkpoint(checkpoint, ddp, optimizer) if os.path.exists(checkpoint) else 0
    for step in range(start, steps):
        run.step(ddp, optimizer, step)
        if (step + 1) % save_every == 0:
            save_checkpoint(checkpoint, ddp, optimizer, step + 1)  # on every rank: a collective
    return run.result(ddp, optimizer, start)
    # END STEP 3


# --------------------------------------------------------------------------- plumbing


class Interrupted(Exception):
    """The simulated crash, raised at the start of a step (before any of its work)."""


def wrap(model: nn.Module) -> DistributedDataParallel:
    """torch's DDP around ``model`` (on its device)."""
    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def batch_for(model_name: str, step: int, rank: int, world_size: int):
    """This rank's share of step ``step``'s global batch: the same data whenever that step runs."""
    inputs, targets = make_batch(model_name, GLOBAL_BATCH, seed=step)
    per_rank = GLOBAL_BATCH // world_size
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    return inputs[part], targets[part]


def cpu_copy(state):
    """A state_dict (or any nest of dicts, lists and tensors) copied to the CPU."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {key: cpu_copy(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cpu_copy(value) for value in state)
    return copy.deepcopy(state)


def same(a, b) -> bool:
    """Two states (nests of dicts, lists and tensors) equal bit for bit, shapes and keys included."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class Run:
    """One rank's training, but the loop: each step's batch and update, the simulated crash,
    and what the rank returns."""

    def __init__(self, rank: int, world_size: int, model_name: str, interrupt_at: int | None):
        self.rank, self.world_size, self.model_name = rank, world_size, model_name
        self.interrupt_at = interrupt_at
        self.trained: list[int] = []
        self.losses: list[float] = []

    def step(self, model: nn.Module, optimizer, step: int) -> float:
        """Step number ``step`` (from 0) on this rank's share of that step's batch."""
        if step == self.interrupt_at:
            raise Interrupted(f"rank {self.rank}: a crash before step {step + 1}")
        device = next(model.parameters()).device
        inputs, targets = batch_for(self.model_name, step, self.rank, self.world_size)
        optimizer.zero_grad()
        value = loss(model, (inputs.to(device), targets.to(device)))
        value.backward()
        optimizer.step()
        self.trained.append(step)
        self.losses.append(value.item())
        return self.losses[-1]

    def result(self, model: nn.Module, optimizer, start: int) -> dict:
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        return {
            "state": cpu_copy(inner.state_dict()),
            "optimizer": cpu_copy(optimizer.state_dict()),
            "started_at": start,
            "trained": list(self.trained),
            "losses": list(self.losses),
        }


def train_until_the_crash(rank: int, world_size: int, *args, **kwargs) -> dict:
    """``train``, for a run that will be interrupted: the crash is its expected end."""
    try:
        train(rank, world_size, *args, **kwargs)
    except Interrupted as crash:
        return {"interrupted": str(crash)}
    return {"interrupted": None}


def train_with_the_classic_hang(
    rank: int, world_size: int, checkpoint: str, save_every: int, model_name: str
) -> None:
    """The mistake the lesson warns of, on purpose: the save called on rank 0 only."""
    model = make_model(model_name, 0).to(rank_device())
    ddp = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    run = Run(rank, world_size, model_name, None)
    for step in range(2 * save_every):
        run.step(ddp, optimizer, step)
        if rank == 0 and (step + 1) % save_every == 0:  # "only rank 0 saves": a collective inside
            save_checkpoint(checkpoint, ddp, optimizer, step + 1)


def _losses(result: dict) -> str:
    return " ".join(f"{value:.4f}" for value in result["losses"])


def _show_the_hang(args) -> int:
    say(None, f"the classic hang: {args.world_size} ranks, save_checkpoint called on rank 0 only")
    os.environ["DOJO_HANG_REPORT_S"] = "5"  # report after 5 s without progress...
    os.environ["DOJO_HANG_FAILS"] = "1"  # ...and end the world with that report
    with tempfile.TemporaryDirectory(prefix="k15-") as folder:
        try:
            launch_world(
                train_with_the_classic_hang,
                args.world_size,
                str(Path(folder) / "checkpoint.pt"),
                args.save_every,
                args.model,
                backend=args.backend,
                device=args.device,
            )
        except LaunchFailed as report:
            say(None, str(report))
            say(
                None,
                "That is the classic hang: a collective (the barrier in save_checkpoint) called "
                "inside `if rank == 0:`. Call save_checkpoint on every rank; only its write goes "
                "under the if.",
            )
            return 0
    say(None, "no hang: does your save_checkpoint make a collective call (a barrier) at all?")
    return 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Checkpoints under data parallelism: a crash, a restart, and the very same "
        "weights as a run that never stopped."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument(
        "--interrupt-at",
        type=int,
        default=6,
        help="the crash comes after this many steps (default 6)",
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="buffer")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="keep the checkpoints here (default: a temporary folder)",
    )
    parser.add_argument(
        "--show-the-hang",
        action="store_true",
        help="run the classic mistake (the save on rank 0 only) and show the harness's report",
    )
    args = parser.parse_args(argv)
    if args.world_size < 1 or GLOBAL_BATCH % args.world_size:
        parser.error(f"--world-size must divide the global batch of {GLOBAL_BATCH}")
    if args.save_every < 1:
        parser.error("--save-every must be at least 1")
    if not 0 < args.interrupt_at < args.steps:
        parser.error(f"--interrupt-at must be between 1 and --steps - 1 ({args.steps - 1})")
    if args.show_the_hang:
        return _show_the_hang(args)

    with tempfile.TemporaryDirectory(prefix="k15-") as scratch:
        folder = args.checkpoint_dir or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        paths = [folder / "uninterrupted.pt", folder / "interrupted.pt"]
        for path in paths:
            path.unlink(missing_ok=True)  # every run of the program starts from scratch
        common = (args.steps, args.save_every, args.model)
        world = {"backend": args.backend, "device": args.device}
        say(
            None,
            f"{args.model} model, {args.world_size} ranks, a checkpoint every {args.save_every} steps",
        )
        whole = launch_world(train, args.world_size, str(paths[0]), *common, **world)
        say(None, f"uninterrupted   steps 1-{args.steps}: losses {_losses(whole[0])}")
        crashed = launch_world(
            train_until_the_crash,
            args.world_size,
            str(paths[1]),
            *common,
            interrupt_at=args.interrupt_at,
            **world,
        )
        saved = args.interrupt_at // args.save_every * args.save_every
        say(
            None,
            f"interrupted     {crashed[0]['interrupted'] or 'no crash'}; the last checkpoint "
            f"holds step {saved}",
        )
        resumed = launch_world(train, args.world_size, str(paths[1]), *common, **world)
        first = resumed[0]["started_at"] + 1
        say(
            None,
            f"resumed at {resumed[0]['started_at']:<4} steps {first}-{args.steps}: losses "
            f"{_losses(resumed[0])}",
        )
        for rank, (a, b) in enumerate(zip(whole, resumed)):
            weights = same(a["state"], b["state"])
            momentum = same(a["optimizer"], b["optimizer"])
            verdict = (
                "the very same weights and momentum as the uninterrupted run, bit for bit"
                if weights and momentum
                else f"weights {'equal' if weights else 'DIFFERENT'}, optimizer state "
                f"{'equal' if momentum else 'DIFFERENT'}: the resumed run is not the same run"
            )
            say(None, f"rank {rank} after resuming: {verdict}")
        if args.checkpoint_dir:
            say(None, f"checkpoints kept in {folder}")
    return 0


if __name__ == "__main__":
    run_program(main)
