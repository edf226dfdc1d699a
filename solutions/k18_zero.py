"""k18 · ZeRO-1: an optimizer whose state is split over the ranks.

THE IDEA
    Data parallelism (k04-k14) keeps a whole copy of everything on every rank: the parameters,
    their gradients and the optimizer's state. For Adam the state is the biggest part: two
    numbers (exp_avg, exp_avg_sq) per parameter, 8 bytes in fp32 beside the parameter's 4 and
    the gradient's 4. Yet every rank computes the very same update from the very same averaged
    gradient: N ranks do the same work N times and store the same state N times.

    ZeRO stage 1 (Rajbhandari et al., 2020) gives each parameter one OWNER rank. Only the owner
    keeps that parameter's optimizer state and computes its update; then it sends the new
    values to the others with a broadcast. The state per rank drops to about 1/N:

        parameters:    p0 (1024)  p1 (1024)  p2 (512)  p3 (256)  p4 (16)  p5 (16)
        owners, N = 2, largest first to the least-loaded rank (ties: the lower index, rank):
            p0 -> rank 0 (load 1024)   p1 -> rank 1 (1024)   p2 -> rank 0 (1536)
            p3 -> rank 1 (1280)        p4 -> rank 1 (1296)   p5 -> rank 1 (1312)

        step():        rank 0                          rank 1
          inner step   update p0, p2 (its state only)   update p1, p3, p4, p5
          broadcast    p0 from 0, p1 from 1, p2 from 0, p3 from 1, p4 from 1, p5 from 1
                       (every parameter, in the same order on every rank)
          afterwards   every rank holds every new parameter; the state lives where it was made

    Owners are decided by sizes alone, the same way on every rank, without touching a random
    number generator (the ranks must agree, and a training run's randomness must not depend on
    how its optimizer is split). Assigning by index (p0 to rank 0, p1 to rank 1, ...) is not
    balanced: in a model whose weights and biases alternate, every weight lands on one rank.

    The class IS a ``torch.optim.Optimizer``: schedulers, ``zero_grad`` and training loops use it
    as any other. ``Optimizer.__init__`` reads ``params`` once (a generator cannot be read
    twice), turns it into parameter groups with the defaults filled in, and calls
    ``add_param_group`` for each; ``zero_grad`` clears every parameter's gradient (owned or not:
    every rank computes every gradient). Inside, an ordinary optimizer does the work:
    ``optimizer_cls(owned groups, **defaults)``, the keyword arguments passed on untouched, one
    inner group per outer group (its options, only the owned parameters), so a group's own lr
    stays its own. torch's ``ZeroRedundancyOptimizer`` works the same way.

    Exact? Adam's update of one parameter depends on that parameter's gradient and state alone,
    and on the CPU torch updates each tensor on its own: the owner computes bitwise what an
    unsharded AdamW computes, and a broadcast copies bits. So the tests demand bitwise equality.

STEPS
    1. ``assign_owners(sizes, world_size, loads=None)``: one owner per size, largest first to
       the least-loaded rank, starting from ``loads``.
    2. ``ShardedOptimizer.__init__``: an Optimizer over every parameter, read once; owners for
       every group; the inner optimizer over this rank's parameters.
    3. ``ShardedOptimizer.step``: the inner step, then every parameter broadcast from its owner,
       in the same order on every rank.
    4. ``ShardedOptimizer.add_param_group``: a group added after construction gets owners (on
       top of the loads so far) and its owned part joins the inner optimizer.

WHAT THE TESTS CHECK
    ``assign_owners`` on the lesson's sizes and others (ties, loads carried, one rank, bad
    input), with the random number generators untouched. On 2, 3 and 4 ranks and in subgroups:
    every parameter owned by exactly one rank, the same on every rank; the inner optimizer's
    constructor arguments (recorded); its state bytes per rank measured (the sum of its state
    tensors' bytes) within the balanced bound and about 1/N of unsharded AdamW's; several AdamW
    steps on TinyTransformer bitwise equal to unsharded AdamW and to torch's
    ``ZeroRedundancyOptimizer`` on every rank; recorded broadcasts: one per parameter per step,
    from its owner, in the same order on every rank; a generator of parameters; groups with
    options of their own; options changed after construction (``param_groups[0]["lr"] = ...``,
    an LR scheduler) reaching the inner optimizer's step; ``step(closure)`` returning the
    closure's loss; ``add_param_group`` after construction; ``zero_grad``; and the program.

RUN IT
    .venv/bin/python -m katas.k18_zero --world-size 2 --steps 3
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import make_tokens, make_transformer, transformer_loss


def assign_owners(
    sizes: Sequence[int], world_size: int, loads: Sequence[int] | None = None
) -> list[int]:
    """The owner rank of each of ``sizes`` (element counts), balanced: largest first, each to
    the rank with the least load so far (ties: the lower index first, the lower rank), starting
    from ``loads`` (elements each rank already owns; None: nothing yet)."""
    # BEGIN STEP 1: assign_owners: who keeps which parameter's state
    # TODO: the owner rank of each size (a list as long as sizes), balanced: the largest size
    # first (ties: the lower index first), each to the rank with the least load so far (ties:
    # the lower rank), the loads starting from `loads` (None: all zero; the list given is not
    # changed). The same sizes always give the same owners, and no random number generator is
    # touched: every rank computes this and must agree. A world_size that is not a positive
    # int, or loads not one per rank, is a ValueError saying so. The tests check the lesson's
    # example, alternating big and small sizes, ties, carried loads, one rank and no sizes,
    # and that torch's and Python's RNG states are unchanged.
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    loads = [0] * world_size if loads is None else list(loads)
    if len(loads) != world_size:
        raise ValueError(
            f"loads has {len(loads)} entries for a world of {world_size}: give one per rank"
        )
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners
    # END STEP 1


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: each parameter's optimizer state on one owner rank only.

    ``ShardedOptimizer(params, optimizer_cls, process_group=None, **defaults)``: ``params`` as
    for any optimizer (tensors or parameter groups, a generator too), ``optimizer_cls`` the inner
    optimizer's class (``torch.optim.AdamW``), ``defaults`` its keyword arguments. Every rank of
    the group must call ``step()``. ``owners`` maps each parameter to its owner's rank in the
    group; ``inner`` is this rank's optimizer over the parameters it owns.
    """

    def __init__(
        self,
        params,
        optimizer_cls: type[torch.optim.Optimizer],
        process_group: dist.ProcessGroup | None = None,
        **defaults,
    ):
        # BEGIN STEP 2: __init__: an Optimizer, owners, the inner optimizer
        # TODO: afterwards self is a torch.optim.Optimizer whose param_groups hold every parameter
        # (params read once: it may be a generator), with self.process_group, self.rank and
        # self.world_size (read from the group: None is the world), self.optimizer_cls,
        # self.owners (each parameter -> its owner's rank in the group), self.loads (elements
        # owned per rank) and self.inner: optimizer_cls(one group per param group, with its
        # options and only this rank's parameters, **defaults), the keyword arguments passed on
        # untouched. torch.optim.Optimizer.__init__ calls self.add_param_group for every group;
        # add_param_group (written) shards a group itself only once self.inner is set. The tests
        # record optimizer_cls's arguments, check every parameter is in exactly one rank's inner
        # optimizer, the same on every rank, balanced by size, with the RNGs untouched, on 2 and 3
        # ranks, for a generator and for two groups with options of their own (lr, weight_decay).
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.optimizer_cls = optimizer_cls
        self.owners: dict[torch.Tensor, int] = {}
        self.loads = [0] * self.world_size
        self.inner: torch.optim.Optimizer | None = None
        # torch reads params once, fills in the defaults and calls add_param_group for each group
        super().__init__(params, defaults)
        self.inner = optimizer_cls(
            [self._owned_part(group) for group in self.param_groups], **defaults
        )
        # END STEP 2

    def _owned_part(self, group: dict) -> dict:
        """``group``'s options with only this rank's parameters; its new parameters get owners."""
        # BEGIN STEP 2: __init__: an Optimizer, owners, the inner optimizer
        # TODO: group's options (every key but params, as they are) with params narrowed to the
        # parameters this rank owns, in their order. Parameters of the group without an owner yet
        # get one here, from assign_owners on their numel(), on top of self.loads (updated), so
        # that a group added later does not move the owners of earlier ones.
        params = group["params"]
        new = [p for p in params if p not in self.owners]
        for param, owner in zip(
            new, assign_owners([p.numel() for p in new], self.world_size, self.loads)
        ):
            self.owners[param] = owner
            self.loads[owner] += param.numel()
        return {**group, "params": [p for p in params if self.owners[p] == self.rank]}
        # END STEP 2

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer``'s (its checks, the defaults filled in); after construction
        the new group is sharded too (``Optimizer.__init__`` calls this for every group first,
        before ``inner`` exists)."""
        super().add_param_group(param_group)
        if getattr(self, "inner", None) is not None:
            self._shard_new_group(self.param_groups[-1])

    def _shard_new_group(self, group: dict) -> None:
        """A group added after construction: owners for its parameters, its part to ``inner``."""
        # BEGIN STEP 4: add_param_group: shard a group added later
        # TODO: group (already in self.param_groups, its defaults filled in) is sharded like the
        # groups given at construction: its parameters get owners on top of the loads so far
        # (earlier parameters keep theirs, and their state) and its owned part joins self.inner as
        # a new group. The tests add a group after one step and compare the next steps with
        # unsharded AdamW.
        self.inner.add_param_group(self._owned_part(group))
        # END STEP 4

    @torch.no_grad()
    def step(self, closure=None):
        # BEGIN STEP 3: step: update what you own, broadcast every parameter from its owner
        # TODO: one optimizer step on every rank: the inner optimizer updates the parameters this
        # rank owns (with the options of self.param_groups, which a scheduler may have changed),
        # then every rank holds every parameter's new value, broadcast from its owner, every
        # parameter in the same order on every rank, on self.process_group (src: a rank of the
        # whole world). A closure, if given, is called (with grad enabled) and its loss returned.
        # The tests record every call of step(): exactly one broadcast per parameter, from its
        # owner, the same sequence on every rank, and compare 3 AdamW steps bitwise with unsharded
        # AdamW and torch's ZeroRedundancyOptimizer, on 2 and 3 ranks and in the subgroups [0, 2]
        # and [1, 3] of a world of 4; then they change lr and weight_decay after a step (by hand,
        # and with an LR scheduler), read the options every inner step ran with, and check that
        # step(closure) returns the closure's loss.
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # a scheduler's lr
        self.inner.step()
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        for outer in self.param_groups:
            for param in outer["params"]:
                source = dist.get_global_rank(group, self.owners[param])
                dist.broadcast(param, src=source, group=self.process_group)
        return loss
        # END STEP 3

    def local_state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds (its inner optimizer's tensors)."""
        return sum(
            t.numel() * t.element_size()
            for state in self.inner.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )


# --------------------------------------------------------------------------- the program


def _count_broadcasts(counter: list) -> object:
    original = dist.broadcast

    def counted(*args, **kwargs):
        counter.append(1)
        return original(*args, **kwargs)

    return original, counted


def show_zero(rank: int, world_size: int, steps: int, lr: float, seed: int) -> dict:
    """Train TinyTransformer with ShardedOptimizer(AdamW) and with plain AdamW, side by side."""
    device = rank_device()
    model = make_transformer(seed).to(device)  # the same start on every rank
    plain = make_transformer(seed).to(device)
    sharded = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, weight_decay=0.01)
    reference = torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=0.01)
    names = {p: name for name, p in model.named_parameters()}
    mine = [names[p] for p in names if sharded.owners[p] == sharded.rank]
    counter: list = []
    for step in range(1, steps + 1):
        tokens, targets = (t.to(device) for t in make_tokens(4, 1000 * seed + 10 * step + rank))
        for net, optimizer in ((model, sharded), (plain, reference)):
            optimizer.zero_grad()
            transformer_loss(net(tokens), targets).backward()
            for param in net.parameters():  # data parallel: every rank the mean gradient
                dist.all_reduce(param.grad)
                param.grad /= world_size
        reference.step()
        original, counted = _count_broadcasts(counter)
        dist.broadcast = counted
        try:
            sharded.step()
        finally:
            dist.broadcast = original
    full = sum(
        t.numel() * t.element_size()
        for state in reference.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    owned = sum(p.numel() for p in model.parameters() if sharded.owners[p] == sharded.rank)
    say(
        rank,
        f"owns {len(mine)} of {len(names)} tensors ({owned:,} of "
        f"{sum(p.numel() for p in model.parameters()):,} elements), e.g. {', '.join(mine[:2])}",
    )
    say(
        rank,
        f"AdamW state held: {sharded.local_state_bytes():,} bytes (unsharded AdamW: {full:,}, "
        f"{sharded.local_state_bytes() / full:.0%}); {len(counter) // steps} broadcasts per step",
    )
    return {"same": same, "state": sharded.local_state_bytes(), "full": full}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="ZeRO-1: optimizer state sharded over the ranks.")
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    say(
        None,
        f"ShardedOptimizer(AdamW) on {args.world_size} ranks, TinyTransformer, {args.steps} steps",
    )
    results = launch_world(
        show_zero,
        args.world_size,
        args.steps,
        args.lr,
        args.seed,
        backend=args.backend,
        device=args.device,
    )
    total = sum(r["state"] for r in results)
    shares = ", ".join(f"{r['state'] / r['full']:.0%}" for r in results)
    say(
        None,
        f"state per rank (of unsharded): {shares}; all ranks together {total:,} bytes = one "
        f"unsharded copy ({results[0]['full']:,})",
    )
    same = all(r["same"] for r in results)
    say(
        None,
        "every rank's parameters are bitwise those of unsharded AdamW"
        if same
        else "some rank's parameters differ from unsharded AdamW",
    )
    return 0 if same else 1


if __name__ == "__main__":
    run_program(main)
