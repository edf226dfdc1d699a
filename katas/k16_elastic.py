"""k16 · Elastic training: a worker dies, torchrun restarts the group, training goes on.

THE IDEA
    torchrun does more than start the ranks (k06). Its agent watches them, and with
    ``--max-restarts N``, when one dies (a kill, an out-of-memory, a lost node) it stops the
    others and starts the whole group again, up to N times. It cannot restart a process where
    it was: every worker starts again from the top of the script. So the script must be able to
    start from where the last one stopped: it writes a snapshot after every epoch, and on every
    start it loads the snapshot if one is there.

        torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m katas.k16_elastic

        restart 0   epoch 0 -> snapshot(1)   epoch 1: step 0, 1, x rank 1 is killed
                    the agent stops rank 0, starts both workers again
        restart 1   load snapshot(1) -> epoch 1 -> snapshot(2) -> epoch 2 -> snapshot(3)
                    == a run that was never interrupted, bit for bit

    Writing a snapshot atomically. A worker can die at any moment, also in the middle of
    ``torch.save``; writing straight to the snapshot's path would then leave half a file where
    the last good snapshot was, and the restart could not load anything. So write to a
    temporary file in the same folder, then rename it over the snapshot:

        torch.save(snapshot, "snapshot.pt.tmp")        a crash here: snapshot.pt is untouched
        os.replace("snapshot.pt.tmp", "snapshot.pt")   one step: the old file or the new one

    ``os.replace`` is atomic within one file system (a temporary file elsewhere, say in /tmp,
    may be on another one, where a "move" is a copy: not atomic). Only global rank 0 writes
    (the replicas are identical); every rank loads, onto its own device (``map_location``).

    What a snapshot holds: the model's state_dict (the model inside DDP, ``model.module``), the
    optimizer's state_dict (Adam's moments and step count) and the number of epochs done.
    Write it after each epoch: every epoch without one is an epoch the restart trains again.

    A fault, injected: ``--fault RANK:EPOCH:STEP`` makes that rank kill itself (SIGKILL, no
    clean-up) at that step, once: it leaves a marker file beside the snapshot, and the
    restarted worker, seeing the marker, lives on.

    One trap found on the way, in torch's own plumbing: under torchrun, ``init_process_group``
    with the default ``env://`` reuses the agent's store across restarts, where the dead
    group's addresses are still written, so a restarted group may try to reach its dead
    predecessors (here about one restart in two failed with "Connection refused"; compare
    pytorch/pytorch#167288). The workers here join through that store under a prefix of their
    own per restart (``join_the_group``, written for you).

    Exactness: on 2 ranks the restarted run equals the uninterrupted one bit for bit (see k15
    for why more ranks differ by rounding under torch's DDP).

STEPS
    1. ``write_snapshot``: global rank 0 alone writes ``{"model", "optimizer", "epoch"}`` to a
       temporary file in the snapshot's folder, then renames it over the snapshot.
    2. ``load_snapshot``: on every rank, load the snapshot onto this rank's device into the
       unwrapped model and the optimizer, and return its epoch; with no snapshot yet, return 0
       and touch nothing. A file without those keys is a ``ValueError`` naming what it lacks.
    3. ``train``: load the snapshot, train the remaining epochs (``run.epoch``), write a
       snapshot after each one, return ``run.result(...)``.

WHAT THE TESTS CHECK
    On 4 ranks laid out as 2 nodes x 2, only global rank 0 writes (every ``torch.save`` is
    recorded), to another file in the same folder that then becomes the snapshot (the same
    inode: renamed, not copied), leaving no temporary file behind and a snapshot at the path
    at every moment (every remove and rename is watched); a write that dies halfway leaves the
    previous snapshot whole and loadable. Every rank loads the snapshot (Adam's
    moments included, ``map_location`` recorded), a first start finds none and gets 0, and a file that
    is not a snapshot is refused. In the harness, a rank killed mid-epoch and a new world
    started after it end with exactly the weights and optimizer state of a run that was never
    interrupted, having trained only the epochs after the last snapshot. Then the real thing
    (slow): the program runs torchrun with ``--max-restarts 1`` on loopback, a worker is killed,
    the group restarts and ends bit for bit like the uninterrupted run, within a deadline, and
    no agent or worker is left running.

RUN IT
    .venv/bin/python -m katas.k16_elastic                  (torchrun, a fault, a restart; then the check)
    .venv/bin/python -m katas.k16_elastic --no-fault       (the same without the fault)
    .venv/bin/torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m katas.k16_elastic --fault 1:1:2
        (by hand: the workers keep ./k16_snapshot.pt and its .fault-fired marker; delete both
        to start again)
    Across hosts (--nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400), where a host may
    be replaced, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every host: in torch 2.14 a
    replaced host's agent otherwise waits 60 s for an address the surviving one never rewrites.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dojo.console import run_program, say
from dojo.devices import choose_for_this_machine, rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo, find_todo
from dojo.toy_models import MODELS, loss, make_batch, make_model

from .k15_checkpoints import Run as K15Run
from .k15_checkpoints import same, wrap

SNAPSHOT_KEYS = ("model", "optimizer", "epoch")
STEPS_PER_EPOCH = 4
GLOBAL_BATCH = 16  # every step's batch, split over the ranks
LR = 0.01
DEFAULT_FAULT = "1:1:2"  # the program's: rank 1 dies in epoch 1, at step 2


def write_snapshot(path: str | os.PathLike, model: nn.Module, optimizer, epoch: int) -> None:
    """From global rank 0 alone, replace the snapshot at ``path`` with one of ``epoch`` epochs
    done, atomically: at every moment ``path`` holds the old snapshot or the new one, whole."""
    # TODO: afterwards the file at path holds {"model": the state_dict of the model itself (inside
    # torch's DDP: model.module), "optimizer": the optimizer's state_dict, "epoch": epoch}, and at
    # no moment did path hold anything but the previous snapshot or this one, whole: a process
    # killed halfway through must not leave a torn file behind. Only global rank 0 writes. The
    # tests run 4 ranks laid out as 2 nodes x 2, record every torch.save (where, by whom),
    # compare the inode of what it wrote with the snapshot's, look for leftovers, watch every
    # os.remove/os.rename/os.replace for a moment without a snapshot, and kill a write halfway
    # through.
    raise KataTodo("k16", 1, "write the snapshot atomically, from rank 0")


def load_snapshot(path: str | os.PathLike, model: nn.Module, optimizer) -> int:
    """Load the snapshot at ``path`` into ``model`` (the one inside its wrapper) and
    ``optimizer`` on this rank; return the epochs it holds (0, touching nothing, without one)."""
    # TODO: with no file at path (a first start) return 0 and change nothing. Otherwise this
    # rank's model (the one inside the wrapper) and optimizer hold the snapshot's state, every
    # tensor on this rank's device, and the snapshot's epoch is returned as an int; a file
    # without the keys of SNAPSHOT_KEYS raises ValueError naming the ones it lacks. The tests
    # load one snapshot on 2 ranks whose models differ, compare every weight and Adam moment,
    # and record each torch.load and its map_location.
    raise KataTodo("k16", 2, "load the snapshot on every rank, or start fresh")


def train(
    rank: int,
    world_size: int,
    snapshot: str,
    epochs: int,
    model_name: str = "buffer",
    seed: int = 0,
    fault: Fault | None = None,
) -> dict:
    """Train ``epochs`` epochs with torch's DDP inside an initialised process group, going on
    from the snapshot at ``snapshot`` when there is one and writing one after every epoch.

    ``fault`` (see ``Fault``) makes one rank kill itself once, inside ``run.epoch``. Returns
    ``run.result(...)``: this rank's final state, its optimizer's state, the epoch it started
    from and the epochs it trained.
    """
    device = rank_device()
    model = make_model(model_name, seed).to(device)
    ddp = wrap(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    run = Run(rank, world_size, model_name, fault)

    # TODO: train epochs 0..epochs-1 with run.epoch(ddp, optimizer, epoch), going on from the
    # snapshot's epoch when there is one, and after every epoch leave a snapshot holding the
    # count of epochs done (every rank calls write_snapshot). Return run.result(ddp, optimizer,
    # start), start being the epoch this run started from. The tests kill a rank mid-epoch (a
    # Fault), start a new world, and demand the weights and Adam state of a run that was never
    # interrupted, bit for bit, having trained only the epochs after the last snapshot; then the
    # same under torchrun for real.
    raise KataTodo("k16", 3, "the loop a restart can go on from")


# --------------------------------------------------------------------------- plumbing


@dataclass(frozen=True)
class Fault:
    """Rank ``rank`` kills itself (SIGKILL) at step ``step`` of epoch ``epoch``, unless the file
    ``marker`` exists; it creates the marker first, so a restarted worker lives on."""

    rank: int
    epoch: int
    step: int
    marker: str

    @staticmethod
    def parse(text: str, marker: str) -> Fault:
        """``"RANK:EPOCH:STEP"`` (epochs and steps count from 0)."""
        try:
            rank, epoch, step = (int(part) for part in text.split(":"))
        except ValueError:
            raise ValueError(
                f"--fault {text!r}: give RANK:EPOCH:STEP, three whole numbers (1:1:2)"
            ) from None
        if rank < 0 or epoch < 0 or not 0 <= step < STEPS_PER_EPOCH:
            raise ValueError(
                f"--fault {text!r}: rank and epoch from 0, step from 0 to {STEPS_PER_EPOCH - 1}"
            )
        return Fault(rank, epoch, step, marker)

    def strike(self, rank: int, epoch: int, step: int) -> None:
        if (rank, epoch, step) != (self.rank, self.epoch, self.step) or os.path.exists(self.marker):
            return
        Path(self.marker).touch()
        say(rank, f"injected fault: killed (SIGKILL) in epoch {epoch}, step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


def batch_for(model_name: str, epoch: int, step: int, rank: int, world_size: int):
    """This rank's share of the global batch of ``step`` in ``epoch``: the same data whenever
    that step runs, before or after a restart."""
    inputs, targets = make_batch(model_name, GLOBAL_BATCH, seed=epoch * 1000 + step)
    per_rank = GLOBAL_BATCH // world_size
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    return inputs[part], targets[part]


class Run(K15Run):
    """One rank's training, but the loop, by epochs: an epoch's steps, the injected fault and the
    progress rank 0 shows; what the rank returns is k15's (``result``)."""

    def __init__(self, rank: int, world_size: int, model_name: str, fault: Fault | None):
        super().__init__(rank, world_size, model_name, interrupt_at=None)
        self.fault = fault

    def epoch(self, model: nn.Module, optimizer, epoch: int) -> float:
        """One epoch of ``STEPS_PER_EPOCH`` steps; returns this rank's mean loss."""
        device = next(model.parameters()).device
        losses = []
        for step in range(STEPS_PER_EPOCH):
            if self.fault is not None:
                self.fault.strike(self.rank, epoch, step)
            inputs, targets = batch_for(self.model_name, epoch, step, self.rank, self.world_size)
            optimizer.zero_grad()
            value = loss(model, (inputs.to(device), targets.to(device)))
            value.backward()
            optimizer.step()
            losses.append(value.item())
        self.trained.append(epoch)
        self.losses.append(sum(losses) / len(losses))
        if self.rank == 0:
            say(self.rank, f"epoch {epoch}: mean loss {self.losses[-1]:.4f}")
        return self.losses[-1]


def train_one_thread(rank: int, world_size: int, *args, **kwargs) -> dict:
    """``train`` on one thread per rank, as torchrun's workers run: the same order of
    operations, so the same bits."""
    torch.set_num_threads(1)
    return train(rank, world_size, *args, **kwargs)


# --------------------------------------------------------------------------- a torchrun worker


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def join_the_group(backend: str, timeout_s: float = 60.0) -> None:
    """``init_process_group`` from torchrun's variables, through a store prefixed per restart
    (torch's own env:// keeps the dead group's addresses in the agent's store)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts_it,
        timeout=timeout,
    )
    if agent_hosts_it:  # the agent's store outlives a group: a prefix per restart (a store of
        # its own each round, as when hosts come and go, needs none: their counts differ)
        store = dist.PrefixStore(f"k16/restart-{restart}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _die_with_the_agent() -> None:
    """torchrun starts each worker in a session of its own: if the agent dies (killed by a test's
    deadline, Ctrl-C), nothing would stop the workers. This one watches and follows it."""
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="k16-agent-watch", daemon=True).start()


def worker(args) -> int:
    """What each torchrun worker runs: join, train (going on from the snapshot), report."""
    _die_with_the_agent()
    torch.set_num_threads(1)
    os.environ["DOJO_DEVICE"] = args.device or "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank_device())
    join_the_group(args.backend or "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    say(rank, f"pid {os.getpid()}, restart {restart}")
    fault = Fault.parse(args.fault, _marker(args.snapshot)) if args.fault else None
    result = train(rank, world_size, args.snapshot, args.epochs, args.model, args.seed, fault)
    say(
        rank,
        f"restart {restart} started at epoch {result['started_at']} and trained {result['trained']}",
    )
    if rank == 0 and args.out:
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _marker(snapshot: str) -> str:
    return f"{snapshot}.fault-fired"


# --------------------------------------------------------------------------- the driver


_AGENT_LOG = re.compile(r"^[DIWE]\d{4} [\d:.]+ \d+ \S+\] (.*)$")  # torchrun's log lines
_WORKER_TRACEBACK = re.compile(r"^\[rank(\d+)\]: (.*)$")  # a worker's traceback, torch-prefixed


def _shown(line: str) -> str | None:
    """A line of torchrun's output as the program shows it (None: left out)."""
    traceback = _WORKER_TRACEBACK.match(line)
    if traceback:  # only its last line, the error: the agent's own lines tell the rest
        rank, text = traceback.groups()
        return f"[rank {rank}] {text[:200]}" if re.match(r"\w+(Error|Exception)\b", text) else None
    if line.startswith("["):
        return line  # a worker's own line
    agent = _AGENT_LOG.match(line)
    return f"[torchrun] {agent.group(1) if agent else line}"


def _torchrun(command: list[str], timeout: float) -> tuple[int | None, str]:
    """Run torchrun, echoing its output as it comes; its exit status (None: timed out)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    fired = threading.Event()

    def stop() -> None:
        fired.set()
        process.terminate()  # torchrun stops its workers on SIGTERM...
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()  # ...or it goes, and its workers follow (_die_with_the_agent)

    timer = threading.Timer(timeout, stop)
    timer.start()
    try:
        for line in process.stdout:
            lines.append(line)
            shown = _shown(line.rstrip("\n"))
            if shown is not None:
                sys.stdout.write(shown + "\n")
                sys.stdout.flush()
        code = process.wait()
    finally:
        timer.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
    return (None if fired.is_set() else code), "".join(lines)


def drive(args) -> int:
    """Not under torchrun: run the uninterrupted reference, then torchrun with the fault, and
    compare."""
    backend, device = choose_for_this_machine(args.world_size, args.backend, args.device)
    with tempfile.TemporaryDirectory(prefix="k16-") as scratch:
        folder = Path(args.snapshot_dir or scratch).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        snapshot, reference = folder / "snapshot.pt", folder / "reference.pt"
        for path in (
            snapshot,
            reference,
            Path(_marker(str(snapshot))),
            Path(_marker(str(reference))),
        ):
            path.unlink(missing_ok=True)  # every run of the program starts from scratch
        out = Path(args.out).resolve() if args.out else folder / "result.pt"
        common = (args.epochs, args.model, args.seed)
        if args.no_reference:
            whole = None
        else:
            say(
                None,
                f"the reference: {args.epochs} epochs on {args.world_size} ranks, never interrupted",
            )
            whole = launch_world(
                train_one_thread,
                args.world_size,
                str(reference),
                *common,
                backend=backend,
                device=device,
            )
        fault = args.fault
        module = __spec__.name if __spec__ else "katas.k16_elastic"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(args.world_size), "--max-restarts", str(args.max_restarts),
            "--monitor-interval", "0.2", "-m", module,
            "--snapshot", str(snapshot), "--epochs", str(args.epochs), "--model", args.model,
            "--seed", str(args.seed), "--backend", backend, "--device", device, "--out", str(out),
        ]  # fmt: skip
        if fault:
            command += ["--fault", fault]
        say(
            None,
            f"torchrun: {args.world_size} workers, --max-restarts {args.max_restarts}"
            + (f", rank {fault.split(':')[0]} killed once (--fault {fault})" if fault else ""),
        )
        code, output = _torchrun(command, args.timeout)
        if code != 0:
            todo = find_todo(RuntimeError(output))
            if todo is not None:
                raise todo
            why = f"ran past {args.timeout:g} s" if code is None else f"exited with status {code}"
            say(None, f"torchrun {why}: the group did not finish")
            return 1
        result = torch.load(out, map_location="cpu", weights_only=False)
        say(
            None,
            f"the group that finished started at epoch {result['started_at']} and trained "
            f"epochs {result['trained']}",
        )
        if whole is not None:
            weights = same(whole[0]["state"], result["state"])
            moments = same(whole[0]["optimizer"], result["optimizer"])
            verdict = (
                "the very same weights and optimizer state as the uninterrupted run, bit for bit"
                if weights and moments
                else f"weights {'equal' if weights else 'DIFFERENT'}, optimizer state "
                f"{'equal' if moments else 'DIFFERENT'}: not the same run"
            )
            say(None, f"after the restart: {verdict}")
            if not (weights and moments):
                return 1
        if args.snapshot_dir:
            say(None, f"snapshots kept in {folder}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Elastic training: a worker is killed, torchrun restarts the group, and "
        "training goes on from the last snapshot."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", choices=sorted(MODELS), default="buffer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fault",
        default=None,
        help=f"RANK:EPOCH:STEP where one worker kills itself, once (the program's default "
        f"{DEFAULT_FAULT}; under torchrun, none unless given)",
    )
    parser.add_argument("--no-fault", action="store_true", help="no worker is killed")
    parser.add_argument("--max-restarts", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=180.0, help="torchrun's deadline (s)")
    parser.add_argument(
        "--snapshot-dir", default=None, help="keep the snapshots here (default: a temporary folder)"
    )
    parser.add_argument("--out", default=None, help="where rank 0 saves its final result")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the uninterrupted run and the check"
    )
    parser.add_argument(
        "--snapshot",
        default="k16_snapshot.pt",
        help="under torchrun: the workers' snapshot (default ./k16_snapshot.pt; delete it, and its "
        ".fault-fired marker, to start again)",
    )
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    if args.world_size < 1 or GLOBAL_BATCH % args.world_size:
        parser.error(f"--world-size must divide the global batch of {GLOBAL_BATCH}")
    if args.no_fault:
        args.fault = None
    elif not under_torchrun():
        args.fault = args.fault or DEFAULT_FAULT
    if args.fault:
        try:
            fault = Fault.parse(args.fault, "")
        except ValueError as error:
            parser.error(str(error))
        if fault.epoch >= args.epochs:
            parser.error(f"--fault {args.fault}: training has epochs 0 to {args.epochs - 1}")
        if not under_torchrun() and fault.rank >= args.world_size:
            parser.error(f"--fault {args.fault}: there are ranks 0 to {args.world_size - 1}")
    return worker(args) if under_torchrun() else drive(args)


if __name__ == "__main__":
    run_program(main)
