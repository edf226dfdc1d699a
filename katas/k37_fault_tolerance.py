"""k37 · Training that survives a lost replica: a quorum through the store, LocalSGD, DiLoCo.

THE IDEA
    k16 restarts everything when one worker dies: every rank stops, loads the last snapshot
    and trains again what was lost. With many replicas that is wasteful: one lost replica stops
    all the others. Fault-tolerant training (torchft, in the spirit of the DiLoCo papers) lets
    the replicas go on without it. A gloo or NCCL group cannot outlive a member, so the
    members are agreed again at every step through the store, and a group is made afresh for
    each new membership (an "era"):

        step   3            4                     5                 6
        r0     quorum {0,1,2} quorum {0,1}        quorum {0,1}      quorum {0,1,2}
        r1     all-reduce/3  (waits for r2 until  all-reduce/2      a new group; r2 takes
        r2     x killed      the deadline)        ...               the weights from r0
                             new group {0,1}                         r2' (a replacement)

    The quorum of step s, through the store (``TCPStore``: ``add``, ``set``, ``get``,
    ``check``, ``compare_set``): every live replica registers for step s; it waits until every
    member of step s-1's quorum has registered too, or until a deadline (a member that does not
    come is dead, or too slow); then it proposes who registered, and ``compare_set`` makes the
    first proposal the answer for everyone. A replica left out (slow, or a newcomer that came
    too late) joins the next quorum. Each step's gradient is the mean over that step's members
    only: a dead replica's step is never counted, a replica that missed one counts none twice.
    A newcomer (a replacement, or a replica left out) takes the weights and the momentum from a
    live member of the last quorum before its first step.

    The faults here land between steps. A replica killed inside an all-reduce breaks that call
    on its peers too (gloo: "Connection closed by peer"; NCCL: a hang until the group's
    timeout); torchft then aborts the group, every member votes that the step failed
    (``should_commit`` is False everywhere), nobody applies it, and the step is taken again
    under the next quorum. A slow replica is the other fault: one late for a quorum is left
    out at the deadline (the others do not wait longer for it), trains nothing that step and
    joins the next quorum as a newcomer. The deadline is the trade: too short and a replica
    that was only slow loses steps, too long and every step waits that long for a dead one.

    Then fewer all-reduces. LocalSGD: each replica takes H steps on its own, then the replicas
    average their parameters (H = 1 is DDP up to rounding: the mean of p - lr g_i is
    p - lr mean(g_i)). DiLoCo (Douillard et al., 2023): after H inner steps, the averaged
    change is an outer gradient, outer_grad = params_at_sync - mean(params), and an outer
    optimizer (SGD, Nesterov momentum 0.9, lr 0.7) steps from params_at_sync with it.

        what torch offers                                 all-reduces       when
        ------------------------------------------------  ----------------  ----------------------
        DDP                                               every step,       fast links, lock-step
                                                          all gradients     replicas
        PeriodicModelAverager + PostLocalSGDOptimizer     every H steps,    slow links; replicas
        (torch.distributed.algorithms.model_averaging)    all parameters    drift between averages
        DiLoCo (torchft; not in torch)                    every H steps,    across data centres:
                                                          + outer momentum  H = 500 in the paper
        torchft's quorum (a lighthouse server)            a quorum a step   replicas that die

    Memory: LocalSGD keeps nothing more; DiLoCo one copy of the parameters (params_at_sync)
    and the outer momentum (two copies). Bytes: all-reduces of a model's size, every H steps.

STEPS
    1. ``join_quorum``: register for a step, wait for the last quorum's members or a
       deadline, agree on the members through ``compare_set``; a quorum of zero refused.
    2. ``train_step``: one step among the quorum: the mean gradient over its members only.
    3. ``sync_from_peer``: a newcomer takes the weights and momentum from a live member.
    4. ``local_sgd_step``: the optimizer's step, then the parameters averaged every H steps.
    5. ``diloco_outer_step``: the averaged delta as an outer gradient, an outer Nesterov step.
    ``run_replica`` (written for you) is the loop that calls steps 1-3, and ``run_in_child``
    runs a replica in a process of its own, so that the tests can kill it.

WHAT THE TESTS CHECK
    On 3 replicas sharing a store: every live replica gets the same members; a replica that
    never registers is left out after the deadline (not before); a late one is left out and
    told so; a quorum of zero is a ValueError before the store is touched; fewer than
    ``min_replicas`` at the deadline is a TimeoutError. ``train_step`` averages over the
    group's members (3, then 2) and equals one process's mean. A replica killed (SIGKILL) at
    step 2, the survivors going on, a replacement joining at step 4, a replica that comes to
    step 5's quorum only after the others closed it (at its 1 s deadline) left out of that step and back at the next: every live
    replica ends with the same weights, equal to a replay of the agreed quorums (no step lost,
    none counted twice), each newcomer's state taken from a member of the last quorum. ``local_sgd_step`` equals torch's ``PostLocalSGDOptimizer`` with
    ``PeriodicModelAverager`` bitwise (H = 2, H = 3 after 2 warm-up steps), makes one average
    every H steps, and at H = 1 equals torch's DDP to 1e-6; on 2 GPUs, over NCCL, it equals
    ``PostLocalSGDOptimizer`` bitwise too (the quorum is the store's and gloo's: it stays on the
    CPU). ``diloco_outer_step`` equals the outer Nesterov formula, and with outer lr 1 and no
    momentum equals LocalSGD. The program.

RUN IT
    .venv/bin/python -m katas.k37_fault_tolerance                  (3 replicas, one killed)
    .venv/bin/python -m katas.k37_fault_tolerance --kill-at 0      (no fault)
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say, verdict
from dojo.launch import launch_world
from dojo.todo import KataTodo
from dojo.toy_models import loss, make_batch, make_model

QUORUM_TIMEOUT_S = 2.0  # how long a quorum waits for the last quorum's members
POLL_S = 0.005  # how often a waiting replica reads the store again
LR, MOMENTUM = 0.05, 0.9
MODEL = "buffer"  # dojo.toy_models' model with a buffer: state beyond the parameters


def join_quorum(
    store: dist.Store,
    step: int,
    replica: int,
    previous: list[int],
    min_replicas: int = 1,
    timeout: float = QUORUM_TIMEOUT_S,
) -> list[int]:
    """Register ``replica`` for ``step``'s quorum and return its members (sorted), the same
    list on every replica that asks: who had registered when the first replica closed it.

    A replica closes the quorum once every replica of ``previous`` (the last quorum's members)
    has registered, or ``timeout`` seconds after it registered, whichever comes first; with
    fewer than ``min_replicas`` registered by then it raises ``TimeoutError``.

    The store's keys for ``step`` are the program's and the tests' way to watch a quorum:
    ``quorum/{step}/registered``, a counter each replica adds 1 to as it registers, and
    ``quorum/{step}/members``, set once, when the quorum closes, to its members as text
    (``"0,1,2"``). Other keys under ``quorum/{step}/`` are yours."""
    # TODO: every replica that calls this for the same step gets the same sorted list back:
    # the replicas registered for that step when the first one closed it. Close once every
    # replica of previous has registered, or timeout seconds after registering (not before:
    # a member of the last quorum may still come), with at least min_replicas registered,
    # else TimeoutError. A replica that registers after the close gets that list, without it.
    # min_replicas below 1 is a ValueError before the store is touched. The tests run 3
    # replicas on one store: all present (0.15 s apart: closed as soon as the last comes), one
    # never coming, one late, too few at the deadline, a quorum of zero.
    raise KataTodo("k37", 1, "the quorum through the store")


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch, group: dist.ProcessGroup
) -> float:
    """One training step of this replica inside its quorum: its own gradient on ``batch``,
    averaged over ``group`` (the quorum's members), then ``optimizer``'s step. Returns this
    replica's loss."""
    # TODO: after it, every member of group holds the same parameters: one optimizer step with
    # the mean over the group's members of their gradients on their own batches (the quorum's
    # size, not the number of replicas the run started with). Returns this replica's loss. The
    # tests run 3 members, then 2, and compare with one process's mean gradient step.
    raise KataTodo("k37", 2, "a step among the quorum")


def sync_from_peer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup,
    members: list[int],
    previous: list[int],
) -> int:
    """Give every member of ``group`` (``members``, sorted: member i is the group's rank i) the
    state of the first member that was also in ``previous`` (the last quorum): its parameters,
    buffers and SGD momentum. Returns that donor's replica number."""
    # TODO: afterwards every member holds the donor's parameters, buffers and momentum buffers;
    # the donor is the lowest member that was in previous (it lived through the last step); a
    # quorum with no such member is a ValueError. Returns the donor's replica number. The tests
    # give a newcomer other weights and no momentum, and check that a replacement, and a
    # replica left out of a step for being slow, end equal to the others.
    raise KataTodo("k37", 3, "a newcomer takes its state from a live peer")


def local_sgd_step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    step: int,
    period: int,
    warmup_steps: int = 0,
    group: dist.ProcessGroup | None = None,
) -> bool:
    """LocalSGD's step ``step`` (0, 1, ...): ``optimizer.step()``, then, from ``warmup_steps``
    on and every ``period`` steps after it, ``params`` averaged over ``group`` (None: the
    world), as torch's ``PostLocalSGDOptimizer`` does.
    Returns whether it averaged."""
    # TODO: the optimizer's step at every call; at steps warmup_steps, warmup_steps + period,
    # ... (none before warmup_steps) params then hold the group's mean, in place, with one
    # all-reduce; returns whether it averaged. period below 1 is a ValueError. The tests hold
    # the parameters bitwise to torch's own LocalSGD on the same world after 6 steps (3 ranks,
    # period 2; period 3 after 2 warm-up steps), count the all-reduces, and at period 1
    # compare it with DDP.
    raise KataTodo("k37", 4, "LocalSGD: average every H steps")


def diloco_outer_step(
    params: list[torch.Tensor],
    anchors: list[torch.Tensor],
    outer_optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None = None,
) -> None:
    """DiLoCo's outer step, after the inner steps: the outer gradient of each parameter is
    ``anchor - mean over the group of params`` (``anchors``: the parameters at the last sync,
    the same on every rank); each parameter goes back to its anchor and ``outer_optimizer``
    (built over ``params``) steps with that gradient; the anchors become the new parameters."""
    # TODO: afterwards params hold outer_optimizer's step taken from the anchors with the outer
    # gradient anchor - (the group's mean of params), and anchors equal the new params (every
    # rank the same). The tests hold it to the Nesterov formula over 3 outer steps on 2 ranks, and
    # with outer SGD lr 1 and no momentum to LocalSGD with the same period.
    raise KataTodo("k37", 5, "DiLoCo: an outer optimizer on the averaged deltas")


# --------------------------------------------------------------------------- plumbing


def form_group(
    store: dist.Store, step: int, members: list[int], replica: int, timeout: float = 10.0
) -> dist.ProcessGroup:
    """A fresh gloo group of ``members`` (member i: rank i), under a store prefix of its own
    (the step that formed it): a new era, which nobody of an older one can disturb."""
    prefix = dist.PrefixStore(f"group/{step}/", store)
    return dist.ProcessGroupGloo(
        prefix, members.index(replica), len(members), timedelta(seconds=timeout)
    )


def first_open_step(store: dist.Store) -> tuple[int, list[int]]:
    """For a newcomer: the first step whose quorum is not closed yet, and the last closed
    quorum's members."""
    step = 0
    while store.check([f"quorum/{step}/members"]):
        step += 1
    if step == 0:
        return 0, []
    return step, [int(r) for r in store.get(f"quorum/{step - 1}/members").decode().split(",")]


def run_replica(
    store: dist.Store,
    replica: int,
    steps: int,
    first: list[int],
    seed: int = 0,
    joining: bool = False,
    fault: Callable[[dist.Store, int, int, list[int]], None] | None = None,
    timeout: float = QUORUM_TIMEOUT_S,
    per_replica: int = 8,
) -> dict:
    """Train replica ``replica`` until step ``steps``, a quorum a step (``first``: the replicas
    the run starts with; ``joining``: a newcomer, which starts at the first open step).
    ``fault(store, replica, step, previous)`` runs before each quorum (the tests kill or slow
    a replica there).
    Returns the steps it trained with their members, its donors, and its final state."""
    # The first replicas start alike (as from one checkpoint); a newcomer does not: its state
    # comes from a peer (sync_from_peer).
    model = make_model(MODEL, seed + 1 + replica if joining else seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    step, previous = first_open_step(store) if joining else (0, list(first))
    group, trained, donors, losses = None, [], [], []
    while step < steps:
        if fault is not None:
            fault(store, replica, step, previous)
        members = join_quorum(store, step, replica, previous, timeout=timeout)
        if replica not in members:  # left out: join the next one as a newcomer
            previous, step, group = members, step + 1, None
            continue
        if group is None or members != previous:  # a new era: a fresh group
            group = form_group(store, step, members, replica)
            if any(m not in previous for m in members):  # a newcomer among them
                donors.append(sync_from_peer(model, optimizer, group, members, previous))
        losses.append(train_step(model, optimizer, batch_for(replica, step, per_replica), group))
        trained.append((step, members))
        previous, step = members, step + 1
    # A last quorum, for leaving: a replica whose process ends while a peer still reads its
    # last all-reduce breaks that peer's (gloo: "Connection closed by peer").
    if trained:
        join_quorum(store, steps, replica, previous, timeout=timeout)
    return {
        "replica": replica,
        "trained": trained,
        "donors": donors,
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def batch_for(replica: int, step: int, size: int = 8):
    """Replica ``replica``'s own batch at ``step``: the same whichever process trains it."""
    return make_batch(MODEL, size, seed=1000 * step + replica)


def run_in_child(fn: Callable, *args, deadline: float = 30.0, **kwargs):
    """``fn(*args, **kwargs)`` in a forked process of its own, which a fault may kill: returns
    its result, or None if it was killed by a signal; raises what it raised. Killed at
    ``deadline`` (a TimeoutError then); never left running."""
    fd, path = tempfile.mkstemp(prefix="k37-replica-")
    os.close(fd)
    pid = os.fork()
    if pid == 0:  # the replica
        code = 0
        try:
            outcome = ("ok", fn(*args, **kwargs))
        except BaseException as error:  # carried to the parent, with where it happened
            error.add_note("in the replica's process:\n" + traceback.format_exc())
            outcome, code = ("error", error), 1
        try:
            with open(path, "wb") as f:
                pickle.dump(outcome, f)
        finally:
            os._exit(code)
    try:
        end = time.monotonic() + deadline
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > end:
                raise TimeoutError(f"a replica ran past its {deadline:g} s deadline")
            time.sleep(0.01)
        if os.WIFSIGNALED(status):
            return None
        with open(path, "rb") as f:
            kind, value = pickle.load(f)
        if kind == "error":
            raise value
        return value
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.unlink(path)


def kill_at(victim: int, at_step: int) -> Callable:
    """A fault: replica ``victim`` kills itself (SIGKILL) before step ``at_step``'s quorum,
    once every other member of the last quorum has registered for it (so has finished the last
    step's all-reduce: a replica killed inside one breaks its peers' too, and torchft then
    throws that step away on every member; the faults here land between steps)."""

    def fault(store: dist.Store, replica: int, step: int, previous: list[int]) -> None:
        if replica == victim and step == at_step:
            others = len([r for r in previous if r != replica])
            while store.add(f"quorum/{step}/registered", 0) < others:
                time.sleep(POLL_S)
            os.kill(os.getpid(), signal.SIGKILL)

    return fault


def loopback_store() -> dist.TCPStore:
    """A store server on 127.0.0.1 only (torch's own binds every interface)."""
    listening = socket.socket()
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.bind(("127.0.0.1", 0))
    listening.listen(128)
    port = listening.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1", port, None, is_master=True, master_listen_fd=listening.detach()
    )


def connect(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=30))


def replay(results: list[dict], steps: int, seed: int = 0, per_replica: int = 8) -> dict:
    """One process's replay of the agreed quorums: each step, the mean gradient of that step's
    members on their batches, from replica ``min(first members)``'s start."""
    trained = {}
    for result in results:
        for step, members in result["trained"]:
            trained[step] = members
    model = make_model(MODEL, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in sorted(trained):
        optimizer.zero_grad()
        for member in trained[step]:
            (loss(model, batch_for(member, step, per_replica)) / len(trained[step])).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _show_replica(rank: int, world_size: int, port: int, steps: int, kill: int) -> list:
    """Rank r runs replica r in a process of its own; the victim's rank then starts its
    replacement, a new replica (number r + world_size: a process that has none of the lost
    one's state must not pass for it), which joins at the next open quorum."""
    fault = kill_at(world_size - 1, kill) if kill else None
    first = list(range(world_size))
    done = [run_in_child(_replica, port, rank, steps, first, False, fault, deadline=60)]
    if done[0] is None:
        new = rank + world_size
        say(rank, f"replica {rank} was killed before step {kill}; replica {new} replaces it")
        after = min(kill + 1, steps - 1)  # the survivors go on alone for a step or two first
        done.append(run_in_child(_replica, port, new, steps, first, after, None, deadline=60))
    return done


def _replica(port, replica, steps, first, after, fault):
    """One replica's process; a newcomer (``after`` a step) starts once that step is agreed."""
    store = connect(port)
    if after is not False:
        store.wait([f"quorum/{after}/members"])
    return run_replica(store, replica, steps, first, joining=after is not False, fault=fault)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Replicas that survive a lost one: a quorum a step through the store."
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--kill-at", type=int, default=3, help="the last replica dies before this step (0: none)"
    )
    args = parser.parse_args(argv)
    if args.replicas < 2 or args.steps < 2 or not 0 <= args.kill_at < args.steps:
        parser.error("--replicas and --steps at least 2, --kill-at between 0 and --steps - 1")
    store = loopback_store()
    say(None, f"{args.replicas} replicas, {args.steps} steps, a quorum a step through the store")
    began = time.monotonic()
    ranks = launch_world(
        _show_replica, args.replicas, store.port, args.steps, args.kill_at, init_group=False
    )
    results = [r for done in ranks for r in done if r is not None]
    for step in range(args.steps):
        members = store.get(f"quorum/{step}/members").decode()
        say(None, f"  step {step}: quorum {{{members}}}")
    for result in results:
        say(None, f"  replica {result['replica']}: trained steps "
            f"{[s for s, _ in result['trained']]}, state from {result['donors']}")  # fmt: skip
    expected = replay(results, args.steps)
    finishers = [r for r in results if r["trained"] and r["trained"][-1][0] == args.steps - 1]
    gap = max(
        (r["state"][k].double() - expected[k].double()).abs().max().item()
        for r in finishers
        for k in expected
    )
    say(None, f"  {time.monotonic() - began:.1f} s; the live replicas against a replay of the "
        f"agreed quorums: largest difference {gap:.2e}")  # fmt: skip
    return verdict(
        gap,
        "every live replica ends as the agreed quorums' steps say: none lost, none twice",
        "the live replicas differ from the replay of the agreed quorums",
    )


if __name__ == "__main__":
    run_program(main)
