"""k18 ZeRO-1: assign_owners, then ShardedOptimizer's construction, step and add_param_group."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dojo.calls import recording
from dojo.impl import load_kata
from dojo.states import to_cpu
from dojo.testing import refusal, require_gpus, run_program
from dojo.toy_models import make_tokens, make_transformer, transformer_loss
from dojo.world import RankFailed, WorldDeadlock, run_world

KATA = "k18_zero"
LR, WEIGHT_DECAY, BETAS = 0.01, 0.01, (0.9, 0.95)
STEPS = 3

# Exactness: AdamW updates each tensor from its own gradient and state alone, and on the CPU
# torch's AdamW loops over the tensors one by one (no foreach kernels for CPU tensors), so the
# owner computes bitwise what an unsharded AdamW computes; a broadcast copies bits. The tests
# demand bitwise equality (stronger than the rtol 1e-7). On CUDA AdamW may use fused or
# foreach kernels whose grouping differs: there the tests allow rtol 1e-7.


# --------------------------------------------------------------------------- step 1: assign_owners


def _by_index(sizes, world_size):
    return [i % world_size for i in range(len(sizes))]


def _in_order(sizes, world_size, loads=None):
    loads = [0] * world_size if loads is None else list(loads)
    owners = []
    for size in sizes:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners.append(rank)
        loads[rank] += size
    return owners


def _greedy(sizes, world_size, loads=None):
    loads = [0] * world_size if loads is None else list(loads)
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


CASES = {
    "lesson": ([1024, 1024, 512, 256, 16, 16], 2, None),
    "alternating": ([256, 16, 256, 16, 256, 16, 256, 16], 2, None),
    "three-ranks": ([5, 9, 9, 3, 7, 1, 4], 3, None),
    "ties": ([8, 8, 8, 8, 8], 4, None),
    "loads-carried": ([10, 10, 4], 2, [0, 15]),
    "one-rank": ([3, 1, 2], 1, None),
    "nothing": ([], 3, None),
}


@pytest.mark.step(1)
@pytest.mark.parametrize("case", CASES)
def test_assign_owners_gives_the_largest_first_to_the_least_loaded(kata, case):
    sizes, world_size, loads = CASES[case]
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    given = None if loads is None else list(loads)
    got = kata.assign_owners(sizes, world_size, given)
    again = kata.assign_owners(sizes, world_size, None if loads is None else list(loads))
    call = f"assign_owners({sizes}, {world_size}, {loads})"
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng, (
        f"{call} changed a random number generator's state: owners must come from the sizes "
        "alone (every rank computes them and must agree; the training's randomness must not "
        "depend on the optimizer), so no torch.randperm, random.shuffle or the like"
    )
    assert given == loads, f"{call} changed the loads list it was given: copy it first"
    assert got == again, (
        f"{call} gave {got}, then {again}: the same sizes must give the same owners"
    )
    expected = _greedy(sizes, world_size, loads)
    if got == expected:
        return
    if got == _by_index(sizes, world_size) and loads is None:
        hint = (
            "assigned owners by index (round robin): that is not balanced by size (in a model "
            "whose weights and biases alternate, every weight lands on one rank). Give each "
            "size, largest first, to the rank with the least load so far"
        )
    elif got == _in_order(sizes, world_size, loads):
        hint = (
            "gave each size to the least-loaded rank in the order given: take the largest "
            "first (sorted by size, descending; ties by the lower index)"
        )
    elif loads is not None and got == _greedy(sizes, world_size):
        hint = "ignored the loads it was given: start from them (the elements each rank owns)"
    else:
        hint = (
            "expected: largest size first (ties: lower index), each to the rank with the least "
            "load so far (ties: the lower rank)"
        )
    raise AssertionError(f"{call} returned {got}, expected {expected}: {hint}")


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "args",
    [([1, 2], 0, None), ([1, 2], -1, None), ([1, 2], 2, [0]), ([1], 2.0, None)],
    ids=["no-ranks", "negative", "loads-of-one", "float-world"],
)
def test_assign_owners_refuses_bad_input(kata, args):
    problem = refusal(lambda: kata.assign_owners(*args))
    assert problem is None, (
        f"assign_owners{args} {problem}: a world of fewer than 1 rank (or not an int), or loads "
        "not one per rank, must raise ValueError saying what was wrong"
    )


# --------------------------------------------------------------------------- the rank side


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps what it was built with (the test reads it back)."""

    def __init__(self, params, **kwargs):
        params = list(params)
        self.given = {"params": params, "kwargs": dict(kwargs)}
        super().__init__(params, **kwargs)


def _names(model):
    return {p: name for name, p in model.named_parameters()}


def _groups(model, how: str, names=None):
    """The parameters as the test hands them over: a generator, or two groups."""
    if how == "generator":
        return model.parameters()
    decay = [
        p for n, p in model.named_parameters() if p.dim() > 1 and (names is None or n in names)
    ]
    rest = [
        p for n, p in model.named_parameters() if p.dim() <= 1 and (names is None or n in names)
    ]
    return [{"params": decay}, {"params": rest, "lr": LR / 3, "weight_decay": 0.0}]


def _state_bytes(optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def _subgroup(rank, rows):
    mine = None
    for members in rows:  # every rank makes every group, in the same order
        group = dist.new_group(members)
        if rank in members:
            mine = group
    return mine


def _train(rank, world_size, how="generator", against="adamw", rows=None, add=False, steps=STEPS):
    """Train TinyTransformer with ShardedOptimizer and with ``against`` on this rank's data."""
    kata = load_kata(KATA)
    group = _subgroup(rank, rows) if rows else None
    model, plain = make_transformer(0), make_transformer(0)
    names = _names(model)
    first = None
    if add:  # the blocks first, the rest added after the first step
        first = {n for n in _names(model).values() if n.startswith("blocks.")}
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    if how == "generator":
        given = model.parameters() if not add else (p for p, n in names.items() if n in first)
    else:
        given = _groups(model, how, first)
    try:
        sharded = kata.ShardedOptimizer(
            given,
            RecordingAdamW,
            process_group=group,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            betas=BETAS,
        )
    except ValueError as error:
        if "empty parameter list" in str(error) and how == "generator":
            raise AssertionError(
                f"rank {rank}: ShardedOptimizer(model.parameters(), ...) raised {error!r}: params "
                "was a generator and it was read twice (the second read finds it empty). Read it "
                "once: let torch.optim.Optimizer.__init__ read it, or make a list first and use "
                "only that"
            ) from None
        raise
    rng_kept = torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng
    if against == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        other = ZeroRedundancyOptimizer(
            plain.parameters(),
            optimizer_class=torch.optim.AdamW,
            process_group=group,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            betas=BETAS,
        )
    else:
        plain_names = {n: p for p, n in _names(plain).items()}
        if how == "generator":
            other = torch.optim.AdamW(
                [plain_names[n] for n in names.values() if first is None or n in first],
                lr=LR,
                weight_decay=WEIGHT_DECAY,
                betas=BETAS,
            )
        else:
            other = torch.optim.AdamW(
                _groups(plain, how, first), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS
            )
    inner = sharded.inner
    construction = {
        "is_optimizer": isinstance(sharded, torch.optim.Optimizer),
        "outer": [sorted(names[p] for p in g["params"]) for g in sharded.param_groups],
        "outer_lr": [g["lr"] for g in sharded.param_groups],
        "kwargs": inner.given["kwargs"] if isinstance(inner, RecordingAdamW) else None,
        "inner_type": type(inner).__name__,
        "owned": sorted(names[p] for g in inner.param_groups for p in g["params"]),
        "inner_lr": [g["lr"] for g in inner.param_groups],
        "rng_kept": rng_kept,
    }
    steps_record = []
    size = dist.get_world_size(group)
    for step in range(steps):
        if add and step == 1:
            rest = [p for p, n in names.items() if n not in first]
            sharded.add_param_group({"params": rest, "lr": 2 * LR})
            plain_by_name = {n: p for p, n in _names(plain).items()}
            other.add_param_group({"params": [plain_by_name[names[p]] for p in rest], "lr": 2 * LR})
        tokens, targets = make_tokens(4, 100 * step + dist.get_rank(group))
        for net in (model, plain):
            transformer_loss(net(tokens), targets).backward()
            for param in net.parameters():  # data parallel: the group's mean gradient
                dist.all_reduce(param.grad, group=group)
                param.grad /= size
        other.step()
        with recording() as calls:
            sharded.step()
        steps_record.append(
            [
                (
                    c.name,
                    c.peers.get("src", c.peers.get("group_src")),
                    c.shapes[0] if c.shapes else (),
                )
                for c in calls
            ]
        )
        sharded.zero_grad()
        other.zero_grad()
        cleared = {names[p]: p.grad is None or not p.grad.any() for p in model.parameters()}
    plain_names = {p: n for n, p in plain.named_parameters()}
    return {
        **construction,
        "owned_after": sorted(names[p] for g in sharded.inner.param_groups for p in g["params"]),
        "state_bytes": _state_bytes(sharded.inner),
        "other_state_bytes": _state_bytes(other) if against == "adamw" else None,
        "params": {names[p]: p.detach().clone() for p in model.parameters()},
        "expected": {plain_names[p]: p.detach().clone() for p in plain.parameters()},
        "broadcasts": steps_record,
        "cleared": cleared,
        "order": [names[p] for g in sharded.param_groups for p in g["params"]],
        "global_members": rows and next(r for r in rows if rank in r),
    }


def _run(world_size, *args, **kwargs):
    try:
        return run_world(_train, world_size, *args, deadline=15, **kwargs)
    except RankFailed as failure:
        if "is not part of group" not in str(failure):
            raise
        raise AssertionError(
            "ShardedOptimizer in a subgroup: a broadcast named a source outside the group. src "
            "is a rank of the whole world, while owners are ranks in the group: turn one into "
            "the other with dist.get_global_rank(group, owner) (group: self.process_group, or "
            "dist.group.WORLD for None)\n" + str(failure)
        ) from None
    except WorldDeadlock as deadlock:
        raise AssertionError(
            "ShardedOptimizer: the ranks waited for each other for ever. Every rank must make "
            "the same collectives in the same order: step() broadcasts every parameter (not "
            "only the owned ones, not the owned ones first) in the order of param_groups, from "
            "its owner, on the optimizer's process group\n" + str(deadlock)
        ) from None


# --------------------------------------------------------------------------- step 2: construction


def _check_owners(results, where):
    everything = set(results[0]["params"])
    owned = [set(r["owned"]) for r in results]
    for rank, result in enumerate(results):
        assert result["rng_kept"], (
            f"{where}: constructing ShardedOptimizer on rank {rank} changed a random number "
            "generator's state: owners must come from the sizes alone, never from torch's or "
            "Python's random numbers"
        )
        if set(result["owned"]) == everything and len(results) > 1:
            raise AssertionError(
                f"{where}: rank {rank}'s inner optimizer was given every parameter: that saves no "
                "memory. Give optimizer_cls only the parameters this rank owns"
            )
    for name in sorted(everything):
        holders = [rank for rank, mine in enumerate(owned) if name in mine]
        if len(holders) != 1:
            raise AssertionError(
                f"{where}: {name} is in the inner optimizer of "
                f"{'no rank' if not holders else 'ranks ' + str(holders)}: every parameter has "
                "exactly one owner, the same on every rank (decided from the sizes, in the same "
                "order everywhere, by the group's rank and size)"
            )


@pytest.mark.step(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_parameter_has_one_owner_and_the_inner_optimizer_only_its_own(kata, world_size):
    results = _run(world_size, "generator", steps=1)
    where = f"ShardedOptimizer(model.parameters(), AdamW) on {world_size} ranks"
    _check_owners(results, where)
    sizes = {n: t.numel() for n, t in results[0]["params"].items()}
    total, largest = sum(sizes.values()), max(sizes.values())
    for rank, result in enumerate(results):
        assert result["is_optimizer"], (
            f"{where}: ShardedOptimizer is not a torch.optim.Optimizer: subclass it"
        )
        assert result["kwargs"] == {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": BETAS}, (
            f"{where}: rank {rank}'s inner optimizer was built with {result['kwargs']}, expected "
            f"exactly the keyword arguments given, {{'lr': {LR}, 'weight_decay': "
            f"{WEIGHT_DECAY}, 'betas': {BETAS}}}: pass **defaults on untouched (pop nothing, add "
            "nothing) to optimizer_cls(owned groups, **defaults)"
        )
        assert result["outer"] == [sorted(sizes)], (
            f"{where}: rank {rank}'s param_groups hold {result['outer']}: the optimizer's own "
            "param_groups hold every parameter (torch.optim.Optimizer.__init__ makes them)"
        )
        elements = sum(sizes[n] for n in result["owned"])
        assert elements <= total / world_size + largest, (
            f"{where}: rank {rank} owns {elements} of {total} elements, more than total / "
            f"{world_size} + the largest tensor ({total / world_size + largest:.0f}): the owners "
            "are not balanced by size (assigned by index, round robin?). Use assign_owners on "
            "the parameters' numel()"
        )


@pytest.mark.step(2)
def test_groups_keep_their_own_options(kata):
    results = _run(2, "groups", steps=1)
    where = "ShardedOptimizer([{'params': weights}, {'params': the rest, 'lr': lr / 3}], AdamW)"
    _check_owners(results, where)
    for rank, result in enumerate(results):
        assert result["outer_lr"] == [LR, LR / 3], (
            f"{where}: rank {rank}'s param_groups have lr {result['outer_lr']}"
        )
        assert result["inner_lr"] == [LR, LR / 3], (
            f"{where}: rank {rank}'s inner optimizer has groups with lr {result['inner_lr']}, "
            f"expected [{LR}, {LR / 3}]: give optimizer_cls one group per group of "
            "self.param_groups, with that group's options and only its owned parameters"
        )


@pytest.mark.step(2)
def test_zero_grad_clears_every_parameter(kata):
    for rank, result in enumerate(_run(2, "generator", steps=1)):
        kept = [n for n, cleared in result["cleared"].items() if not cleared]
        assert not kept, (
            f"rank {rank}: after zero_grad() {len(kept)} parameter(s) still hold a gradient "
            f"({', '.join(kept[:3])}...): every rank computes every gradient, so zero_grad "
            "clears every parameter's, owned or not (torch.optim.Optimizer.zero_grad does, "
            "over self.param_groups: do not narrow it to the inner optimizer's)"
        )


# --------------------------------------------------------------------------- step 3: step


def _check_training(results, where, exact=True):
    for rank, result in enumerate(results):
        for name, expected in result["expected"].items():
            mine = result["params"][name]
            same = (
                torch.equal(mine, expected)
                if exact
                else torch.allclose(mine, expected, rtol=1e-7, atol=0)
            )
            if same:
                continue
            gap = (mine.double() - expected.double()).abs().max().item()
            owner = next(r for r, other in enumerate(results) if name in other["owned"])
            unchanged = not result["broadcasts"] or all(not calls for calls in result["broadcasts"])
            hint = (
                "step() made no broadcast: after the inner step, broadcast every parameter from "
                "its owner, or the other ranks keep their old values"
                if unchanged
                else "after the inner step every parameter must be broadcast from its owner "
                "(the owner's rank in the whole world: dist.get_global_rank(group, owner))"
            )
            raise AssertionError(
                f"{where}: after {len(result['broadcasts'])} step(s) rank {rank}'s {name} (owned "
                f"by rank {owner}) differs from the reference by up to {gap:.3g}: {hint}"
            )


def _check_broadcasts(results, where, rows=None):
    expected_count = len(results[0]["order"])
    for rank, result in enumerate(results):
        members = result["global_members"] or list(range(len(results)))
        for step, calls in enumerate(result["broadcasts"]):
            names = [c[0] for c in calls]
            assert names == ["broadcast"] * expected_count, (
                f"{where}: in step {step + 1} rank {rank} made {len(calls)} call(s) "
                f"({', '.join(sorted(set(names))) or 'none'}), expected {expected_count} "
                "broadcasts: one per parameter, each from its owner, after the inner step"
            )
            sources = {c[1] for c in calls}
            assert sources <= set(members), (
                f"{where}: rank {rank} broadcast from rank(s) {sorted(sources - set(members))}, "
                f"outside its group {members}: src is a rank of the whole world; turn the "
                "owner's group rank into it with dist.get_global_rank(group, owner)"
            )
    for result in results:
        members = result["global_members"] or list(range(len(results)))
        first = results[members[0]]
        if result["broadcasts"] != first["broadcasts"]:
            raise AssertionError(
                f"{where}: ranks {members[0]} and another of its group broadcast in different "
                f"orders or from different sources (rank {members[0]}: "
                f"{first['broadcasts'][0][:3]}...; the other: {result['broadcasts'][0][:3]}...): "
                "broadcast every parameter in the order of param_groups, the same on every "
                "rank, each from its owner (not the owned ones first)"
            )


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_adamw_steps_equal_unsharded_adamw_bitwise(kata, world_size):
    results = _run(world_size, "generator")
    where = f"ShardedOptimizer(AdamW) on {world_size} ranks, {STEPS} steps"
    _check_owners(results, where)
    _check_broadcasts(results, where)
    _check_training(results, where)


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size", [2, 4])
def test_state_bytes_per_rank_are_about_one_nth(kata, world_size):
    results = _run(world_size, "generator", steps=1)
    where = f"ShardedOptimizer(AdamW) on {world_size} ranks"
    full = results[0]["other_state_bytes"]
    sizes = {n: t.numel() for n, t in results[0]["params"].items()}
    largest = max(sizes.values())
    held = [r["state_bytes"] for r in results]
    # AdamW keeps exp_avg and exp_avg_sq (8 bytes per element) and a 4-byte step per tensor
    bound = full / world_size + 8 * largest + 4 * len(sizes)
    for rank, nbytes in enumerate(held):
        if nbytes >= full:
            raise AssertionError(
                f"{where}: rank {rank} holds {nbytes:,} bytes of AdamW state, as much as unsharded "
                f"AdamW ({full:,}): its inner optimizer updates every parameter. Give it only "
                "the parameters this rank owns"
            )
        assert nbytes <= bound, (
            f"{where}: rank {rank} holds {nbytes:,} bytes of optimizer state, more than "
            f"1/{world_size} of unsharded AdamW's {full:,} plus the largest tensor's state "
            f"({bound:,.0f}): the owners are not balanced by size (assigned by index, round "
            "robin?); per-rank state: " + ", ".join(f"{b:,}" for b in held)
        )
    assert sum(held) == full, (
        f"{where}: the ranks together hold {sum(held):,} bytes of state, unsharded AdamW "
        f"{full:,}: each parameter's state lives on exactly one rank"
    )


@pytest.mark.step(3)
def test_groups_with_their_own_lr_train_as_unsharded(kata):
    results = _run(2, "groups")
    _check_training(results, "ShardedOptimizer with two groups (the second at lr / 3)")


@pytest.mark.step(3)
def test_subgroups_of_a_grid_each_shard_over_their_own_ranks(kata):
    rows = [[0, 2], [1, 3]]
    results = _run(4, "generator", rows=rows)
    where = "ShardedOptimizer(process_group=the group [0, 2] or [1, 3] of a world of 4)"
    for members in rows:
        _check_owners([results[r] for r in members], where)
    _check_broadcasts(results, where, rows)
    _check_training(results, where)


@pytest.mark.step(3)
def test_against_torchs_zero_redundancy_optimizer(kata):
    pytest.importorskip(
        "torch.distributed.optim", reason="this torch has no ZeroRedundancyOptimizer"
    )
    results = _run(2, "generator", against="zero")
    _check_training(results, "ShardedOptimizer(AdamW) against torch's ZeroRedundancyOptimizer")


# --------------------------------------------------------------------------- step 4: add_param_group


@pytest.mark.step(4)
def test_add_param_group_after_construction(kata):
    results = _run(2, "generator", add=True)
    where = (
        "ShardedOptimizer over the blocks, then add_param_group(the rest, lr=2 * lr) after step 1"
    )
    for rank, result in enumerate(results):
        before, after = set(result["owned"]), set(result["owned_after"])
        assert before <= after, (
            f"{where}: rank {rank} owned {sorted(before - after)} before the new group and not "
            "after: parameters already sharded keep their owner (and their state); give only "
            "the new group's parameters owners, on top of the loads so far"
        )
    final = [{**r, "owned": r["owned_after"]} for r in results]
    _check_owners(final, where)
    _check_training(results, where)


@pytest.mark.step(4)
def test_program_shows_the_state_split(kata):
    done = run_program(KATA, "--world-size", "2", "--steps", "2", timeout=120)
    out = done.stdout
    assert done.returncode == 0, (
        f"`python -m {KATA} --world-size 2 --steps 2` exited with {done.returncode}:\n{out}\n"
        f"{done.stderr}"
    )
    assert "[rank 1] AdamW state held:" in out and "50%" in out, out
    assert "bitwise those of unsharded AdamW" in out, out


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    kata = load_kata(KATA)
    from dojo.devices import rank_device

    device = rank_device()
    torch.cuda.set_device(device)
    model, plain = make_transformer(0).to(device), make_transformer(0).to(device)
    sharded = kata.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    other = torch.optim.AdamW(plain.parameters(), lr=LR)
    for step in range(2):
        tokens, targets = (t.to(device) for t in make_tokens(4, 10 * step + rank))
        for net, optimizer in ((model, sharded), (plain, other)):
            optimizer.zero_grad()
            transformer_loss(net(tokens), targets).backward()
            for param in net.parameters():
                dist.all_reduce(param.grad)
                param.grad /= world_size
            optimizer.step()
    return to_cpu(dict(model.named_parameters())), to_cpu(dict(plain.named_parameters()))


def _check_cuda(results):
    for rank, (mine, expected) in enumerate(results):
        for name, value in expected.items():
            assert torch.allclose(mine[name], value, rtol=1e-7, atol=1e-8), (
                f"rank {rank}'s {name} differs from unsharded AdamW on CUDA"
            )


@pytest.mark.step(3)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    require_gpus(1)
    _check_cuda(run_world(_on_cuda, 1, backend="nccl", env={"DOJO_DEVICE": "cuda"}, deadline=60))


@pytest.mark.step(3)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    require_gpus(1)
    _check_cuda(run_world(_on_cuda, 2, backend="gloo", env={"DOJO_DEVICE": "cuda"}, deadline=60))
