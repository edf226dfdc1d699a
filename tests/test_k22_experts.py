"""k22 experts: route, exchange_counts, AllToAll and ExpertParallelMoE against one process."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings

import pytest
import torch

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import RankCrashed, RankFailed, WorldDeadlock, run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import run_module_ok, shared_run
from dojo.todo import KataTodo
from dojo.toy_models import MODEL_DIM

KATA = "k22_experts"
TOKENS = 12  # tokens per rank
DEADLINE = 15

# Exactness. The router and the experts multiply matrices of other heights here than in one
# process (a rank's 12 tokens, not all of them; an expert's tokens from every rank), and BLAS
# may split a product's sums differently for another height: the last bits may differ, so the
# layer is compared with a close tolerance. The all-to-all only moves numbers: exact.
CLOSE = {"rtol": 1e-5, "atol": 1e-6}


class _OffTheGroup(Exception):
    """A collective called with another group than the one the code under test was given."""


_WATCHED = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
            "all_reduce", "broadcast", "barrier")  # fmt: skip


@contextlib.contextmanager
def _only_on(group):
    """Inside a rank: a collective called with another group than ``group`` raises
    ``_OffTheGroup`` at once, naming it, instead of waiting for ranks outside the group."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    originals = {name: getattr(c10d, name) for name in _WATCHED if hasattr(c10d, name)}

    def watched(name, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def call(*args, **kwargs):
            given = signature.bind_partial(*args, **kwargs).arguments.get("group")
            if given is not group:
                where = "the whole world (no group=)" if given is None else "another group"
                raise _OffTheGroup(f"{name} on {where}")
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        for module in (c10d, dist):
            setattr(module, name, watched(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            for module in (c10d, dist):
                setattr(module, name, original)


def _error(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


# --------------------------------------------------------------------------- step 1: route


def _call_route(kata, logits):
    try:
        return kata.route(logits)
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(
            f"route(<logits of shape {tuple(logits.shape)}: tokens x experts>) raised "
            f"{_error(error)}"
        ) from None


@pytest.mark.step(1)
def test_route_picks_each_tokens_top_expert_and_its_gate(kata):
    logits = torch.tensor(
        [[0.1, 2.0, -1.0], [3.0, 0.0, 0.5], [0.0, 0.2, 0.1], [1.0, 1.5, 0.0], [2.5, 0.0, 0.0]],
        requires_grad=True,
    )  # 5 tokens, 3 experts: experts 1 0 1 1 0; expert 2 gets nothing
    got = _call_route(kata, logits)
    expert = torch.as_tensor(got.expert).tolist()
    if expert == logits.argmax(dim=0).tolist():
        raise AssertionError(
            f"route(logits of 5 tokens x 3 experts) chose {expert}: that is one index per "
            "expert, the argmax over the tokens (dim 0). Each token picks among the experts: "
            "take the max over the last dimension (dim=-1)"
        )
    assert expert == [1, 0, 1, 1, 0], (
        f"route chose the experts {expert} for the 5 tokens, expected [1, 0, 1, 1, 0]: each "
        "token's expert is the argmax of its row of logits"
    )
    probabilities = logits.detach().softmax(dim=-1)
    expected_gate = probabilities.max(dim=-1).values
    gate = got.gate
    if torch.allclose(gate.detach(), logits.detach().max(dim=-1).values):
        raise AssertionError(
            f"route's gate is {gate.detach().tolist()}: the raw logits of the chosen experts. The "
            "gate is the router's probability of the chosen expert: softmax over the experts "
            "first, then the largest probability"
        )
    assert torch.allclose(gate.detach(), expected_gate, rtol=1e-6, atol=0), (
        f"route's gate is {gate.detach().tolist()}, expected the softmax probability of each "
        f"token's expert, {expected_gate.tolist()}"
    )
    assert gate.requires_grad, (
        "route's gate has no gradient: keep it in the graph (no .detach(), no torch.no_grad()), "
        "the router learns through it"
    )
    order = torch.as_tensor(got.order).tolist()
    assert order == [1, 4, 0, 2, 3], (
        f"route's order is {order}, expected [1, 4, 0, 2, 3]: the token indices sorted by their "
        "expert (expert 0's tokens first), keeping the tokens' order within an expert (a stable "
        "sort: torch.argsort(expert, stable=True))"
    )
    counts = [int(c) for c in got.counts]
    if counts == [2, 3]:
        raise AssertionError(
            "route's counts are [2, 3] for 3 experts: the expert that got no token is missing. "
            "One count per expert, zeros included (torch.bincount(..., minlength=experts))"
        )
    assert counts == [2, 3, 0], f"route's counts are {counts}, expected [2, 3, 0]"


@pytest.mark.step(1)
def test_route_counts_every_expert_for_many_shapes(kata):
    generator = torch.Generator().manual_seed(0)
    for tokens, experts in [(1, 2), (7, 4), (40, 3), (64, 8)]:
        logits = torch.randn(tokens, experts, generator=generator)
        got = _call_route(kata, logits)
        expert = logits.argmax(dim=-1)
        counts = [int(c) for c in got.counts]
        expected = [int((expert == e).sum()) for e in range(experts)]
        assert counts == expected, (
            f"route(<{tokens} x {experts} logits>): counts {counts}, expected {expected} (one per "
            "expert, zeros included)"
        )
        order = torch.as_tensor(got.order)
        assert order.tolist() == torch.argsort(expert, stable=True).tolist(), (
            f"route(<{tokens} x {experts} logits>): order {order.tolist()} does not sort the "
            "tokens by expert, stably"
        )


# --------------------------------------------------------------------------- step 2: exchange_counts


def _exchange(rank, world_size):
    kata = load_kata(KATA)
    counts = [10 * rank + e for e in range(world_size)]
    with recording() as calls:
        got = kata.exchange_counts(counts)
    return [int(c) for c in got], [(c.name, c.shapes) for c in calls]


@pytest.mark.step(2)
@pytest.mark.parametrize("world_size", [2, 4])
def test_exchange_counts_tells_each_rank_what_it_will_receive(kata, world_size):
    results = run_world(_exchange, world_size, deadline=DEADLINE)
    for rank, (got, calls) in enumerate(results):
        expected = [10 * j + rank for j in range(world_size)]
        mine = [10 * rank + e for e in range(world_size)]
        if got == mine and got != expected:
            raise AssertionError(
                f"rank {rank}'s exchange_counts returned its own counts {got}: the receiver "
                "used its own counts. It must learn how many tokens each rank sends it: "
                f"expected {expected} (rank j's counts[{rank}]), exchanged with all_to_all_single"
            )
        assert got == expected, (
            f"rank {rank}'s exchange_counts returned {got}, expected {expected}: element j is "
            f"how many tokens rank j sends rank {rank} (rank j's counts[{rank}])"
        )
        names = [name for name, _ in calls]
        assert names == ["all_to_all_single"], (
            f"rank {rank}'s exchange_counts made {names}: one all_to_all_single of the counts "
            "(one number to each rank, one from each) is all it takes"
        )


GROUP, GROUP_WORLD = [1, 2], 3  # a subgroup: rank 0 is outside it and calls nothing of it


def _exchange_in_a_group(rank, world_size):
    import torch.distributed as dist

    kata = load_kata(KATA)
    group = dist.new_group(GROUP)
    if rank not in GROUP:
        return None
    me = GROUP.index(rank)
    try:
        with _only_on(group):
            got = kata.exchange_counts([10 * me + e for e in range(len(GROUP))], group)
    except KataTodo:
        raise
    except _OffTheGroup as error:
        return "off", str(error)
    except Exception as error:
        return "raised", _error(error)
    return "returned", [int(c) for c in got]


@pytest.mark.step(2)
def test_exchange_counts_runs_on_the_layers_group(kata):
    where = f"exchange_counts(counts, process_group=the group {GROUP} of a world of {GROUP_WORLD})"
    try:
        results = run_world(_exchange_in_a_group, GROUP_WORLD, deadline=DEADLINE)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            f"{where}: ranks {GROUP[0]} and {GROUP[1]} waited for ever, in a collective that rank "
            "0, outside their group, never calls: exchange the counts on process_group "
            "(all_to_all_single(..., group=process_group))\n" + str(deadlock)
        ) from None
    for rank in GROUP:
        me = GROUP.index(rank)
        outcome, got = results[rank]
        if outcome == "off":
            raise AssertionError(
                f"{where}: rank {rank} called {got}, not on the group it was given: rank 0, "
                "outside the group, never joins it, so ranks 1 and 2 would wait for ever (the "
                "test stopped the call). Exchange the counts on the layer's group: "
                "all_to_all_single(..., group=process_group)"
            )
        assert outcome == "returned", (
            f"{where}: rank {rank} (rank {me} of the group) raised {got}. The group has "
            f"{len(GROUP)} ranks and the counts are one per rank of the group: size and rank come "
            "from dist.get_world_size(process_group), and the all_to_all_single runs with "
            "group=process_group"
        )
        expected = [10 * j + me for j in range(len(GROUP))]
        assert got == expected, (
            f"{where}: rank {rank} (rank {me} of the group) returned {got}, expected {expected}: "
            "element j is how many tokens rank j of the group sends this one"
        )


# --------------------------------------------------------------------------- step 3: AllToAll


def _splits(world_size):
    """send[i][j]: rows rank i sends rank j; uneven, with zeros (and an idle rank 0 -> 1)."""
    return [[(i + 2 * j + 1) % 4 if (i, j) != (0, 1) else 0 for j in range(world_size)]
            for i in range(world_size)]  # fmt: skip


def _all_to_all(rank, world_size, theirs):
    import torch.distributed as dist

    kata = load_kata(KATA)
    send = _splits(world_size)
    inputs, outputs = send[rank], [send[j][rank] for j in range(world_size)]
    x = torch.arange(sum(inputs) * 3, dtype=torch.float32).reshape(-1, 3) + 100 * rank
    x.requires_grad_()
    weight = torch.randn(sum(outputs), 3, generator=torch.Generator().manual_seed(rank))
    function = kata.AllToAll.apply
    if theirs:
        import torch.distributed.nn.functional as functional

        def function(tensor, out_splits, in_splits, group):
            out = tensor.new_empty(sum(out_splits), tensor.shape[1])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated in favour of functional collectives
                return functional.all_to_all_single(
                    out, tensor, out_splits, in_splits, group or dist.group.WORLD
                )

    phase = "forward"
    try:
        y = function(x, outputs, inputs, None)
        phase = "backward"
        (y * weight).sum().backward()
    except KataTodo:
        raise
    except Exception as error:
        return {"error": f"{_error(error)} (in {phase})", "phase": phase}
    return {"y": y.detach(), "grad": None if x.grad is None else x.grad.clone()}


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_moves_rows_and_their_gradients_back(kata, world_size):
    try:
        mine = run_world(_all_to_all, world_size, False, deadline=DEADLINE)
    except (WorldDeadlock, RankCrashed) as deadlock:
        raise AssertionError(
            f"AllToAll on {world_size} ranks: the ranks waited for each other for ever (or gloo "
            "stopped a rank on a size that did not match): every "
            "rank must call all_to_all_single in forward and in backward, even when it sends or "
            "receives nothing, with split sizes that agree (what rank i sends rank j, its "
            "input_splits[j], is what rank j expects from rank i, its output_splits[i]): pass "
            "both split lists to all_to_all_single\n" + str(deadlock)
        ) from None
    send = _splits(world_size)
    for rank, got in enumerate(mine):
        where = f"AllToAll on {world_size} ranks, splits {send} (row i: what rank i sends)"
        if "error" in got:
            raise AssertionError(
                f"{where}: rank {rank} raised {got['error']}"
                + (
                    ". In backward the gradient goes back the way the rows came: the same "
                    "all_to_all_single with the output and input split sizes swapped, into a "
                    "tensor of the input's shape"
                    if got["phase"] == "backward"
                    else ". In forward, pass both split lists to all_to_all_single "
                    "(output_split_sizes=output_splits, input_split_sizes=input_splits) and "
                    "receive into a new tensor of sum(output_splits) rows"
                )
            )
        pieces = []
        for j in range(world_size):
            start = sum(send[j][:rank])
            rows = torch.arange(sum(send[j]) * 3, dtype=torch.float32).reshape(-1, 3) + 100 * j
            pieces.append(rows[start : start + send[j][rank]])
        expected = torch.cat(pieces)
        assert got["y"].shape == expected.shape and torch.equal(got["y"], expected), (
            f"{where}: rank {rank} received {got['y'].tolist()}, expected {expected.tolist()}: "
            "rank j's rows for this rank, in rank order (output_split_sizes: what each rank "
            "sends this one; input_split_sizes: what this one sends each)"
        )
    functional = pytest.importorskip(
        "torch.distributed.nn.functional", reason="this torch has no torch.distributed.nn"
    )
    if not hasattr(functional, "all_to_all_single"):
        pytest.skip("this torch has no torch.distributed.nn.functional.all_to_all_single")
    theirs = run_world(_all_to_all, world_size, True, deadline=DEADLINE)
    for rank, (got, want) in enumerate(zip(mine, theirs)):
        grad = got["grad"]
        if grad is None:
            raise AssertionError(
                f"AllToAll on {world_size} ranks: rank {rank}'s input got no gradient: "
                "AllToAll.backward must return the gradient of x (the first input), the "
                "others None"
            )
        assert grad.shape == want["grad"].shape and torch.equal(grad, want["grad"]), (
            f"AllToAll on {world_size} ranks: rank {rank}'s input gradient differs from torch's "
            "(torch.distributed.nn.functional.all_to_all_single): the gradient of a row is "
            "where that row went; send the gradients back with the splits swapped (the "
            f"rows it received go back to their senders).\ngot {grad.tolist()}\nexpected "
            f"{want['grad'].tolist()}"
        )


# --------------------------------------------------------------------------- step 4: the layer


def _inputs(world_size, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(world_size, 3, TOKENS // 3, MODEL_DIM, generator=generator), torch.randn(
        world_size, 3, TOKENS // 3, MODEL_DIM, generator=generator
    )


def _layer_rank(rank, world_size, empty, group_ranks=None):
    import torch.distributed as dist

    kata = load_kata(KATA)
    group = dist.new_group(group_ranks) if group_ranks else None
    if group_ranks and rank not in group_ranks:
        return None
    size = len(group_ranks) if group_ranks else world_size
    me = group_ranks.index(rank) if group_ranks else rank
    router = kata.make_router(0, size)
    if empty is not None:
        with torch.no_grad():
            router.bias[empty] -= 100.0  # no token chooses this expert
    moe = kata.ExpertParallelMoE(router, kata.make_expert(0, me), process_group=group)
    x, weights = _inputs(size)
    x = x[me].clone().requires_grad_()
    phase = "forward"
    with contextlib.ExitStack() as stack:
        if group is not None:  # a collective off the group raises at once instead of hanging
            stack.enter_context(_only_on(group))
        calls = stack.enter_context(recording())
        try:
            y = moe(x)
            forward = len(calls)
            phase = "backward"
            (y * weights[me]).sum().backward()
        except _OffTheGroup as error:
            return {"off": f"{error} (in {phase})"}
    return {
        "y": y.detach(),
        "x": x.grad,
        "router": {n: p.grad for n, p in moe.router.named_parameters()},
        "expert": {n: p.grad for n, p in moe.expert.named_parameters()},
        "calls": [(c.name, c.shapes) for c in calls],
        "forward": forward,
        "counts": [int(c) for c in moe.tokens_per_expert],
        "received": int(moe.tokens_received),
    }


def _one_process(world_size, empty):
    """The same layer on one process, every expert local (one thread, as the ranks)."""
    kata = load_kata(KATA)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        router = kata.make_router(0, world_size)
        if empty is not None:
            with torch.no_grad():
                router.bias[empty] -= 100.0
        experts = [kata.make_expert(0, e) for e in range(world_size)]
        local = kata.LocalMoE(router, experts)
        x, weights = _inputs(world_size)
        x = x.clone().requires_grad_()
        y = local(x)
        (y * weights).sum().backward()
        chosen = local.router(x.detach().reshape(-1, MODEL_DIM)).argmax(dim=-1)
    finally:
        torch.set_num_threads(threads)
    return {
        "y": y.detach(),
        "x": x.grad,
        "router": {n: p.grad for n, p in router.named_parameters()},
        "experts": [{n: p.grad for n, p in e.named_parameters()} for e in experts],
        "chosen": chosen.reshape(world_size, -1),
    }


def _run_layer(world_size, empty=None, group_ranks=None, world=None):
    where = f"ExpertParallelMoE on {world_size} ranks" + (
        f" (the group {group_ranks} of {world})" if group_ranks else ""
    )
    if empty is not None:
        where += f", expert {empty} getting no token"
    try:
        results = run_world(_layer_rank, world or world_size, empty, group_ranks, deadline=DEADLINE)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            f"{where}: the ranks waited for each other for ever. Every rank must call every "
            "all_to_all_single (counts, tokens out, results back, and both again in backward), "
            "in the same order, even when it has nothing to send or receive (splits of zero)\n"
            + str(deadlock)
        ) from None
    except (RankFailed, RankCrashed) as failure:
        text = str(failure)
        if group_ranks and _works_on_a_world(len(group_ranks)):
            raise AssertionError(
                f"{where}: a rank failed ({text.splitlines()[0][:300]}), yet the same layer on a "
                f"world of {len(group_ranks)} ranks works: inside a group, the group's size and "
                "ranks belong where the world's are (dist.get_world_size(process_group), "
                "dist.get_rank(process_group)), and every collective gets group=process_group\n"
                + text
            ) from None
        if "split" in text.lower() or "size" in text.lower():
            raise AssertionError(
                f"{where}: a rank's all_to_all_single failed ({text.splitlines()[0][:300]}): its "
                "split sizes do not add up to its tensors' first dimension. The tokens go out with "
                "input splits = this rank's counts and output splits = the counts it received "
                "(exchange_counts), on a tensor of shape (tokens, dim); the results come back with "
                "the two swapped\n" + text
            ) from None
        raise
    members = group_ranks or list(range(world_size))
    for rank in members:
        if "off" in results[rank]:
            raise AssertionError(
                f"{where}: rank {rank} called {results[rank]['off']}, not on the layer's "
                "process_group: the ranks outside the group never join it, so the others would "
                "wait for ever (the test stopped the call). Every all_to_all_single of the layer "
                "(the counts, the tokens out, the results back, and both again in backward: keep "
                "the group in ctx) runs with group=process_group"
            )
    return where, [results[r] for r in members]


def _works_on_a_world(world_size) -> bool:
    try:
        _layer(world_size)
    except (AssertionError, RankFailed, RankCrashed):
        return False
    return True


@shared_run
def _layer(world_size, empty=None):
    """Several tests look at one run."""
    return _run_layer(world_size, empty)


def check_layer(where, results, world_size, empty=None):
    reference = _one_process(world_size, empty)
    y_all, chosen = reference["y"], reference["chosen"]
    for rank, got in enumerate(results):
        y, expected = got["y"], y_all[rank]
        if y.shape != expected.shape:
            raise AssertionError(
                f"{where}: rank {rank}'s output has shape {tuple(y.shape)}, expected "
                f"{tuple(expected.shape)}, the input's"
            )
        if torch.allclose(y, expected, **CLOSE):
            continue
        flat, want = y.reshape(-1, MODEL_DIM), expected.reshape(-1, MODEL_DIM)
        order = torch.argsort(chosen[rank], stable=True)
        if torch.allclose(flat, want[order], **CLOSE):
            raise AssertionError(
                f"{where}: rank {rank}'s output rows are the right ones, sorted by expert: the "
                "tokens were not put back in their order. The results come back in the sorted "
                "order; write row k of them to token order[k] (index_copy, or index with the "
                "inverse permutation)"
            )
        raise AssertionError(
            f"{where}: rank {rank}'s output differs from one process running every expert by up "
            f"to {(y - expected).abs().max():.3g} (the same router and experts). Each token's "
            "output is gate * expert_e(token), e = its argmax over the experts, gate = the "
            "softmax probability of e; the token must travel to rank e (all_to_all_single), "
            "not stay with this rank's expert" + _gate_hint(flat, want, reference, rank)
        )
    for rank, got in enumerate(results):
        assert got["x"] is not None and torch.allclose(got["x"], reference["x"][rank], **CLOSE), (
            f"{where}: rank {rank}'s input gradient differs from one process's"
            + (
                ""
                if got["x"] is None
                else f" by up to {(got['x'] - reference['x'][rank]).abs().max():.3g}"
            )
            + ": backward must carry the gradients back through both all-to-alls (AllToAll)"
        )
        for name, grad in got["expert"].items():
            want = reference["experts"][rank][name]
            assert grad is not None and torch.allclose(grad, want, **CLOSE), (
                f"{where}: expert {rank}'s (rank {rank}'s) {name}.grad differs from one "
                "process's: it must come from every token routed to it, from every rank"
            )
    for name, want in reference["router"].items():
        grads = [got["router"][name] for got in results]
        assert all(g is not None for g in grads), (
            f"{where}: the router's {name} got no gradient: the gate must stay in the graph"
        )
        total = torch.stack(grads).sum(0)
        assert torch.allclose(total, want, **CLOSE), (
            f"{where}: the router's {name}.grad summed over the ranks differs from one process's "
            f"by up to {(total - want).abs().max():.3g}: the router learns through the gate "
            "(the output is gate * expert(token))"
        )


def _gate_hint(flat, want, reference, rank) -> str:
    ratio = (flat * want).sum(-1) / (want * want).sum(-1).clamp_min(1e-30)
    if torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4):
        return ""
    spread = (ratio.max() - ratio.min()).item()
    if spread > 1e-3 and (ratio > 1.0 + 1e-4).all():
        return (
            f": each row is {ratio.min():.3g} to {ratio.max():.3g} times the expected one, as "
            "if the gate was not applied (the output is gate * expert(token), the gate at most 1)"
        )
    if spread > 1e-3 and (ratio < 1.0 - 1e-4).all():
        return (
            f": each row is {ratio.min():.3g} to {ratio.max():.3g} times the expected one, as if "
            "the gate was applied twice: multiply by the gate once"
        )
    return ""


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [2, 4])
def test_layer_equals_one_process(kata, world_size):
    where, results = _layer(world_size)
    check_layer(where, results, world_size)


@pytest.mark.step(4)
def test_an_expert_with_no_tokens(kata):
    where, results = _layer(2, empty=1)
    check_layer(where, results, 2, empty=1)
    for rank, got in enumerate(results):
        assert got["counts"] == [TOKENS, 0], (
            f"{where}: rank {rank} reports tokens_per_expert {got['counts']}, expected "
            f"[{TOKENS}, 0]"
        )


@pytest.mark.step(4)
def test_counts_are_exchanged_before_the_tokens(kata):
    where, results = _layer(4)
    for rank, got in enumerate(results):
        forward = got["calls"][: got["forward"]]
        names = [name for name, _ in forward]
        assert names == ["all_to_all_single"] * 3, (
            f"{where}: rank {rank}'s forward made {names}, expected three all_to_all_single: "
            "the counts, the tokens out, the results back"
        )
        counts, out, back = [shapes for _, shapes in forward]
        assert len(counts) == 2 and all(math.prod(shape) == 4 for shape in counts), (
            f"{where}: rank {rank}'s first all_to_all_single moved tensors of shapes {counts}: "
            "exchange the counts first (one number per rank), so that every receiver knows "
            "its split sizes before the tokens move"
        )
        assert all(len(s) == 2 and s[1] == MODEL_DIM for s in out + back), (
            f"{where}: rank {rank}'s token all-to-alls moved shapes {out} and {back}: send "
            f"the tokens as one (tokens, {MODEL_DIM}) tensor, sorted by expert"
        )
        backward = [name for name, _ in got["calls"][got["forward"] :]]
        assert backward == ["all_to_all_single"] * 2, (
            f"{where}: rank {rank}'s backward made {backward}, expected two all_to_all_single "
            "(the gradients of the results, then of the tokens, each back the way it came)"
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tokens_per_expert_are_reported(kata, world_size):
    where, results = _layer(world_size)
    chosen = _one_process(world_size, None)["chosen"]
    for rank, got in enumerate(results):
        expected = [int((chosen[rank] == e).sum()) for e in range(world_size)]
        assert got["counts"] == expected, (
            f"{where}: rank {rank}'s tokens_per_expert is {got['counts']}, expected {expected}: "
            "how many of this rank's tokens went to each expert, in the last forward"
        )
        received = int((chosen == rank).sum())
        assert got["received"] == received, (
            f"{where}: rank {rank}'s tokens_received is {got['received']}, expected {received}: "
            f"how many tokens, from every rank, expert {rank} processed"
        )


@pytest.mark.step(4)
def test_a_subgroup_holds_its_own_experts(kata):
    where, results = _run_layer(2, group_ranks=[1, 2], world=3)
    check_layer(where, results, 2)


@pytest.mark.step(4)
def test_program_reports_tokens_per_expert(kata):
    out = run_module_ok(KATA, "--world-size", "2", "--tokens", "12").stdout
    assert "[rank 0] sent its 12 tokens to the experts [" in out, out
    assert "expert 1 processed" in out, out
    assert "against one process running every expert" in out, out


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    device = rank_gpu()
    kata = load_kata(KATA)
    moe = kata.ExpertParallelMoE(
        kata.make_router(0, world_size).to(device), kata.make_expert(0, rank).to(device)
    )
    x, weights = _inputs(world_size)
    x = x[rank].to(device).requires_grad_()
    y = moe(x)
    (y * weights[rank].to(device)).sum().backward()
    return {"y": y.detach().cpu(), "x": x.grad.cpu()}


def check_on_cuda(results, world_size) -> None:
    reference = _one_process(world_size, None)
    for rank, got in enumerate(results):
        for key in ("y", "x"):
            assert torch.allclose(got[key], reference[key][rank], rtol=1e-4, atol=1e-5), (
                f"rank {rank}'s {key} on CUDA differs from one process's"
            )


@pytest.mark.step(4)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    results = run_world(_on_cuda, 1, **on_cuda(1, "nccl"))
    check_on_cuda(results, 1)


@pytest.mark.step(4)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    results = run_world(_on_cuda, 2, **on_cuda(2, "gloo"))
    check_on_cuda(results, 2)
