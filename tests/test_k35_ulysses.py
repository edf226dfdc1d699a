"""k35 Ulysses: the all-to-all that re-shards a sequence shard by heads and back, its backward,
the attention over the whole sequence for H/N heads, and the bytes each rank sends, against one
process's ``F.scaled_dot_product_attention``, k26's ring and k25's all-gather on the same world.

Every re-shard is checked on a NUMBERED tensor (each element's value says which batch row,
head, token and feature it is), so a test can say which heads and tokens a rank ended with,
not just that they differ. Calls are recorded in each rank (``dojo.harness.calls``); the bytes a
call SENDS are counted per kind of call (``_sent``): an all-to-all keeps its own piece and sends
(N - 1)/N of its input, an all-gather sends its piece to the N - 1 others, a reduce-scatter the
N - 1 pieces of its input that are the others', a send what it sends.

Tolerances: float64 (Ulysses adds the same terms as one process, in the same order for a head,
so the results agree to rounding; 1e-10 catches any real mistake, a float32 cast included).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.states import close, gap
from dojo.spec.testing import run_module_ok, shared_run, streams
from dojo.todo import KataTodo

KATA = "k35_ulysses"
DEADLINE_S = 20.0
TOLERANCE = {"rtol": 1e-9, "atol": 1e-10}
BATCH, DIM = 2, 3  # a batch of 2: a re-shard that cuts the batch instead of the heads shows
ALL_TO_ALL = ("all_to_all", "all_to_all_single")
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")
SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
POINT_TO_POINT = ("send", "isend")
COMMUNICATION = (
    *ALL_TO_ALL, *GATHERS, *SCATTERS, *POINT_TO_POINT, "all_reduce", "broadcast", "reduce",
    "gather", "scatter", "recv", "irecv", "batch_isend_irecv", "barrier",
)  # fmt: skip


# --------------------------------------------------------------------------- shared helpers


def _numbered(heads: int, length: int) -> torch.Tensor:
    """(BATCH, heads, length, DIM), float64, element (b, h, t, d) holding its own flat index."""
    return torch.arange(BATCH * heads * length * DIM, dtype=torch.float64).view(
        BATCH, heads, length, DIM
    )


def _random(heads: int, length: int, count: int, seed: int = 0, dim: int = DIM, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, heads, length, dim)
    return [
        torch.randn(shape, generator=generator, dtype=torch.float64).to(device)
        for _ in range(count)
    ]


def _tokens(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s tokens (one slice of the sequence) of every head of the whole ``x``."""
    share = x.shape[2] // size
    return x[:, :, rank * share : (rank + 1) * share].contiguous()


def _heads(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s heads (rH/N..(r+1)H/N - 1) of the whole ``x``, the whole sequence."""
    share = x.shape[1] // size
    return x[:, rank * share : (rank + 1) * share].contiguous()


def _sent(call: dict, size: int) -> int:
    """The bytes one rank sends in a recorded call of a group of ``size`` ranks."""
    name, total = call["name"], call["bytes"]
    if name in ALL_TO_ALL:  # output and input alike; its own piece stays
        return total // 2 * (size - 1) // size
    if name in GATHERS:  # output N pieces, input one: the piece goes to the N - 1 others
        return total // (size + 1) * (size - 1)
    if name in SCATTERS:  # output one piece, input N: the others' N - 1
        return total // (size + 1) * (size - 1)
    if name == "all_reduce":  # a ring all-reduce: reduce-scatter and all-gather
        return 2 * total * (size - 1) // size
    if name in ("recv", "irecv"):  # received, counted as its sender's
        return 0
    return total


def _recorded(calls, group=None) -> list[dict]:
    return [
        {
            "name": c.name,
            "bytes": c.bytes,
            "right_group": c.group is group or (group is None and c.group is None),
        }
        for c in calls
        if c.name in COMMUNICATION
    ]


def _close(a, b) -> bool:
    return close(a, b, **TOLERANCE)


def _world(fn, world_size, *args):
    return run_world(fn, world_size, *args, deadline=DEADLINE_S)


def _group(grouped: bool):
    """None (the world), or this rank's pair: [0, 1] or [2, 3] of a world of 4."""
    import torch.distributed as dist

    if not grouped:
        return None
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pairs[dist.get_rank() // 2]


def _check_traffic(rank, what, calls, size, local_bytes, count=1):
    """Exactly ``count`` all-to-alls on the group, each sending (N - 1)/N of ``local_bytes``."""
    others = sorted({c["name"] for c in calls if c["name"] not in ALL_TO_ALL})
    if others:
        gathered = any(name in GATHERS for name in others)
        raise AssertionError(
            f"rank {rank}: {what} called {', '.join(others)}"
            + (
                ": an all-gather sends this rank's whole tensor to each of the N - 1 others, "
                "and every rank then keeps only its heads of it. One all-to-all sends each rank "
                "only its own piece"
                if gathered
                else ": the re-shard is an all-to-all (dist.all_to_all_single) and nothing else"
            )
        )
    assert len(calls) == count, (
        f"rank {rank}: {what} made {len(calls)} all-to-all(s), expected {count}"
        + (": one all-to-all moves the whole tensor, every piece at once" if count == 1 else "")
    )
    wrong = [c for c in calls if not c["right_group"]]
    assert not wrong, (
        f"rank {rank}: {what} ran its all-to-all on another group than the one it was given: pass "
        "group=group to the collective (the tests give each pair of ranks its own group)"
    )
    sent = sum(_sent(c, size) for c in calls)
    expected = count * local_bytes * (size - 1) // size
    assert sent == expected, (
        f"rank {rank}: {what} on {size} ranks sent {sent} bytes, expected {expected} = "
        f"{count} x (N - 1)/N of the {local_bytes} bytes it holds: a rank keeps its own piece"
    )


def _where(y: torch.Tensor, heads: int, length: int) -> dict:
    """Decode a numbered tensor: which batch rows, heads and tokens (in order) it holds."""
    index = y.round().long()
    d = index % DIM
    t = (index // DIM) % length
    h = (index // (DIM * length)) % heads
    b = index // (DIM * length * heads)
    return {
        "batches": [sorted(set(b[i].flatten().tolist())) for i in range(y.shape[0])],
        "heads": [sorted(set(h[:, j].flatten().tolist())) for j in range(y.shape[1])],
        "tokens": t[0, 0, :, 0].tolist(),
        "features": d[0, 0, 0].tolist(),
    }


def _check_head_shard(rank, size, y, heads, length):
    """``y`` is rank ``rank``'s head shard of the numbered tensor, else what it holds instead."""
    whole = _numbered(heads, length)
    expected = _heads(whole, rank, size)
    if _close(y, expected):
        return
    assert isinstance(y, torch.Tensor) and y.shape == expected.shape, (
        f"rank {rank} of {size}: scatter_heads' output is wrong ({gap(y, expected)}): expected "
        f"(batch, heads / N, whole sequence, dim) = (B, {heads}/{size}, {length // size} x "
        f"{size}, D)"
    )
    found = _where(y, heads, length)
    if any(rows != [i] for i, rows in enumerate(found["batches"])):
        raise AssertionError(
            f"rank {rank}: scatter_heads mixed the batch rows (row i of its result holds batch "
            f"rows {found['batches']}): the all-to-all cut along the batch, not the heads. Move "
            "the destination rank to dim 0 (reshape the heads into (N, H/N), then transpose it "
            "first) before the all-to-all"
        )
    wanted = list(range(rank * heads // size, (rank + 1) * heads // size))
    got = [h[0] if len(h) == 1 else h for h in found["heads"]]
    if got != wanted:
        raise AssertionError(
            f"rank {rank} of {size}: scatter_heads gave it heads {got}, expected {wanted}. The "
            "rule here (DeepSpeed's and DTensor's Shard(1)): rank r holds the contiguous heads "
            "r*H/N .. (r+1)*H/N - 1, in order, so that gather_heads and the output projection "
            "find them where they expect"
        )
    if found["tokens"] != list(range(length)):
        raise AssertionError(
            f"rank {rank}: scatter_heads holds the tokens in the order {found['tokens']}, "
            f"expected 0..{length - 1}: rank j's tokens are the j-th slice of the sequence, so "
            "lay the pieces received end to end in rank order"
        )
    raise AssertionError(f"rank {rank}: scatter_heads' values are wrong ({gap(y, expected)})")


def _value_error(call) -> tuple[str, str]:
    """(outcome, message) of a call that should refuse: "ValueError", another error's name or
    "returned"; a todo goes straight through."""
    try:
        value = call()
    except ValueError as error:
        return "ValueError", str(error)
    except KataTodo:
        raise
    except Exception as error:
        return type(error).__name__, str(error)
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
    return "returned", f"{shape}"


def _check_refusal(by_rank, what, heads, size):
    for rank, (outcome, message, calls) in enumerate(by_rank):
        assert outcome != "returned", (
            f"rank {rank}: {what} of {heads} heads on {size} ranks returned a result shaped "
            f"{message}: {heads} heads do not split into {size} equal whole heads. Raise a "
            "ValueError naming both numbers and what to do, before any communication"
        )
        assert outcome == "ValueError", (
            f"rank {rank}: {what} of {heads} heads on {size} ranks raised {outcome}: {message}. "
            "Check the heads first and raise a ValueError naming them and the ranks"
        )
        assert str(heads) in message and str(size) in message, (
            f"rank {rank}: {what} refused {heads} heads on {size} ranks with ValueError("
            f"{message!r}): name the {heads} heads and the {size} ranks, and what to do"
        )
        assert not calls, (
            f"rank {rank}: {what} called {', '.join(calls)} before refusing {heads} heads on "
            f"{size} ranks: check the input before any communication (a peer that checks "
            "later would wait for ever)"
        )


# --------------------------------------------------------------------------- step 1: re-shard


def _reshard_rank(rank, world_size, heads, length, grouped):
    import torch.distributed as dist

    kata = load_kata(KATA)
    group = _group(grouped)
    me, size = dist.get_rank(group), dist.get_world_size(group)
    whole = _numbered(heads, length)
    x = _tokens(whole, me, size)
    before = x.clone()
    with recording() as calls:
        y = kata.scatter_heads(x, group)
    head_shard = _heads(whole, me, size)
    with recording() as back:
        z = kata.gather_heads(head_shard, group)
    return {
        "me": me,
        "size": size,
        "y": y,
        "calls": _recorded(calls, group),
        "unchanged": torch.equal(x, before),
        "z": z,
        "back": _recorded(back, group),
        "bytes": x.numel() * x.element_size(),
    }


_reshard = shared_run(lambda *args: _world(_reshard_rank, *args))
RESHARD_CASES = [
    pytest.param(2, 4, 6, False, id="2-ranks"),
    pytest.param(4, 8, 8, False, id="4-ranks"),
    pytest.param(4, 4, 6, True, id="pairs-0-1-and-2-3"),
]


@pytest.mark.step(1)
@pytest.mark.parametrize("world_size, heads, length, grouped", RESHARD_CASES)
def test_scatter_heads_is_one_all_to_all(kata, world_size, heads, length, grouped):
    for rank, result in enumerate(_reshard(world_size, heads, length, grouped)):
        _check_traffic(rank, "scatter_heads", result["calls"], result["size"], result["bytes"])


@pytest.mark.step(1)
@pytest.mark.parametrize("world_size, heads, length, grouped", RESHARD_CASES)
def test_scatter_heads_gives_each_rank_the_whole_sequence_of_its_heads(
    kata, world_size, heads, length, grouped
):
    for rank, result in enumerate(_reshard(world_size, heads, length, grouped)):
        _check_head_shard(result["me"], result["size"], result["y"], heads, length)
        assert result["unchanged"], (
            f"rank {rank}: scatter_heads changed its input x: return a new tensor, leave x as "
            "it was (the caller, and autograd, still need it)"
        )


@pytest.mark.step(1)
@pytest.mark.parametrize("world_size, heads, length, grouped", RESHARD_CASES)
def test_gather_heads_gives_each_rank_its_tokens_back(kata, world_size, heads, length, grouped):
    for rank, result in enumerate(_reshard(world_size, heads, length, grouped)):
        me, size = result["me"], result["size"]
        _check_traffic(rank, "gather_heads", result["back"], size, result["bytes"])
        expected = _tokens(_numbered(heads, length), me, size)
        if _close(result["z"], expected):
            continue
        z = result["z"]
        assert isinstance(z, torch.Tensor) and z.shape == expected.shape, (
            f"rank {rank}: gather_heads' output is wrong ({gap(z, expected)}): expected (batch, "
            "every head, this rank's tokens, dim)"
        )
        found = _where(z, heads, length)
        got = [h[0] if len(h) == 1 else h for h in found["heads"]]
        share = length // size
        raise AssertionError(
            f"rank {rank}: gather_heads gave it heads {got} (expected 0..{heads - 1} in order) "
            f"and tokens {found['tokens']} (expected {me * share}..{(me + 1) * share - 1}): "
            "gather_heads must undo scatter_heads, piece j of the all-to-all going to rank j "
            "(its tokens) and the pieces received (rank j's heads) laid in rank order"
        )


def _refusal_rank(rank, world_size, function):
    kata = load_kata(KATA)
    x = _tokens(_numbered(6, 8), rank, world_size)
    with recording() as calls:
        outcome, message = _value_error(lambda: getattr(kata, function)(x))
    return outcome, message, [c.name for c in calls if c.name in COMMUNICATION]


@pytest.mark.step(1)
def test_scatter_heads_refuses_heads_that_do_not_split(kata):
    _check_refusal(_world(_refusal_rank, 4, "scatter_heads"), "scatter_heads", 6, 4)


# --------------------------------------------------------------------------- step 2: backward


def _functions_rank(rank, world_size, heads, length, grouped):
    import torch.distributed as dist

    kata = load_kata(KATA)
    group = _group(grouped)
    me, size = dist.get_rank(group), dist.get_world_size(group)
    whole = _numbered(heads, length)
    (grad,) = _random(heads, length, 1, seed=3)
    results = {"me": me, "size": size}
    for name, mine, theirs in (
        ("ScatterHeads", _tokens, _heads),
        ("GatherHeads", _heads, _tokens),
    ):
        leaf = mine(whole, me, size).requires_grad_()
        with recording() as forward:
            out = getattr(kata, name).apply(leaf, group)
        error = None
        with recording() as backward:
            try:
                out.backward(theirs(grad, me, size))
            except KataTodo:
                raise
            except (RuntimeError, ValueError) as failure:  # a gradient of the wrong shape
                error = f"{type(failure).__name__}: {str(failure).splitlines()[0]}"
        results[name] = {
            "out": out.detach(),
            "grad": leaf.grad,
            "error": error,
            "forward": _recorded(forward, group),
            "backward": _recorded(backward, group),
            "bytes": leaf.numel() * leaf.element_size(),
        }
    return results


_functions = shared_run(lambda *args: _world(_functions_rank, *args))
FUNCTION_CASES = [
    pytest.param(2, 4, 6, False, id="2-ranks"),
    pytest.param(4, 4, 6, True, id="pairs-0-1-and-2-3"),
]
INVERSE = {"ScatterHeads": ("gather_heads", _tokens), "GatherHeads": ("scatter_heads", _heads)}


@pytest.mark.step(2)
@pytest.mark.parametrize("name", ["ScatterHeads", "GatherHeads"])
@pytest.mark.parametrize("world_size, heads, length, grouped", FUNCTION_CASES)
def test_each_function_sends_the_gradient_back_where_it_came_from(
    kata, world_size, heads, length, grouped, name
):
    (grad,) = _random(heads, length, 1, seed=3)
    inverse, shape_of = INVERSE[name]
    for rank, result in enumerate(_functions(world_size, heads, length, grouped)):
        me, size, got = result["me"], result["size"], result[name]
        expected = shape_of(grad, me, size)
        assert got["error"] is None, (
            f"rank {rank}: {name}.backward failed: {got['error']}. Its gradient must be shaped "
            f"like the forward's input, {tuple(expected.shape)}: every piece of the gradient "
            f"goes back where it came from ({inverse}, the inverse all-to-all)"
        )
        g = got["grad"]
        assert g is not None, (
            f"rank {rank}: the input of {name} got no gradient: return ({inverse} of the "
            "gradient, None) from backward"
        )
        if _close(g, expected):
            continue
        extra = sorted({c["name"] for c in got["backward"] if c["name"] not in ALL_TO_ALL})
        assert not extra, (
            f"rank {rank}: {name}.backward called {', '.join(extra)}, and its gradient differs "
            f"from one process's ({gap(g, expected)}): an all-to-all only moves numbers (each "
            f"is sent once), so nothing is summed: its backward is {inverse} of the gradient, "
            "the inverse all-to-all, alone"
        )
        for factor, said in ((1 / size, "divided by"), (size, "multiplied by")):
            if _close(g, expected * factor):
                raise AssertionError(
                    f"rank {rank}: the gradient {name} gave its input is {said} N = {size}: an "
                    "all-to-all only moves numbers (each is sent once, nothing is summed or "
                    "averaged), so its backward moves the gradient back unscaled"
                )
        raise AssertionError(
            f"rank {rank}: the gradient {name} gave its input differs from one process's "
            f"({gap(g, expected)}): backward is {inverse} of the gradient, the inverse "
            "all-to-all"
        )


@pytest.mark.step(2)
@pytest.mark.parametrize("name", ["ScatterHeads", "GatherHeads"])
def test_each_function_is_one_all_to_all_each_way(kata, name):
    for rank, result in enumerate(_functions(4, 4, 6, True)):
        got = result[name]
        _check_traffic(rank, f"{name}'s forward", got["forward"], result["size"], got["bytes"])
        _check_traffic(rank, f"{name}'s backward", got["backward"], result["size"], got["bytes"])


# --------------------------------------------------------------------------- step 3: attention


def _attention_rank(rank, world_size, heads, length, causal):
    kata = load_kata(KATA)
    q, k, v, g = _random(heads, length, 4)
    leaves = [_tokens(t, rank, world_size).requires_grad_() for t in (q, k, v)]
    with recording() as forward:
        out = kata.ulysses_attention(*leaves, causal)
    result = {"out": out.detach(), "forward": _recorded(forward), "grads": None}
    if not out.requires_grad or out.shape != leaves[0].shape:
        return result  # no backward to run: the tests say why
    with recording() as backward:
        out.backward(_tokens(g, rank, world_size))
    result["grads"] = [t.grad for t in leaves]
    result["backward"] = _recorded(backward)
    return result


_attention = shared_run(lambda *args: _world(_attention_rank, *args))
ATTENTION_CASES = [
    pytest.param(2, 4, 8, True, id="2-ranks-causal"),
    pytest.param(4, 4, 8, True, id="4-ranks-causal"),
    pytest.param(4, 8, 8, False, id="4-ranks-full"),
]


def _sdpa(q, k, v, causal, **options):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **options)


def _diagnose_output(rank, size, out, q, k, v, causal):
    """What a wrong output of ulysses_attention most likely is, in the lesson's words."""
    mine = [_tokens(t, rank, size) for t in (q, k, v)]
    expected = _tokens(_sdpa(q, k, v, causal), rank, size)
    if isinstance(out, torch.Tensor) and out.dtype != q.dtype:
        return (
            f"ulysses_attention returned {out.dtype} for {q.dtype} inputs: keep q's dtype (a cast "
            "loses the precision the caller chose)"
        )
    if isinstance(out, torch.Tensor) and out.shape == _heads(q, rank, size).shape != expected.shape:
        return (
            f"ulysses_attention returned a head shard {tuple(out.shape)}, expected this rank's "
            f"tokens of every head {tuple(expected.shape)}: re-shard the output back (GatherHeads)"
        )
    if _close(out, _sdpa(*mine, causal)):
        return (
            "the output is the attention of this rank's tokens over its OWN tokens only: "
            "re-shard q, k and v by heads first, so that each rank attends over the whole "
            "sequence"
        )
    if _close(out, _tokens(_sdpa(q, k, v, not causal), rank, size)):
        return (
            f"the output is the {'full' if causal else 'causal'} attention, expected the "
            f"{'causal' if causal else 'full'}: pass is_causal=causal to the attention"
        )
    if _close(out, _tokens(_sdpa(q, k, v, causal, scale=1 / q.shape[-1]), rank, size)):
        return (
            "the scores are scaled by 1/dim, not 1/sqrt(dim): the scale was applied twice "
            "(scaled_dot_product_attention scales the scores itself; do not scale q first)"
        )
    return f"the output differs from one process's ({gap(out, expected)})"


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size, heads, length, causal", ATTENTION_CASES)
def test_ulysses_attention_equals_one_process(kata, world_size, heads, length, causal):
    q, k, v, _ = _random(heads, length, 4)
    expected = _sdpa(q, k, v, causal)
    for rank, result in enumerate(_attention(world_size, heads, length, causal)):
        out = result["out"]
        assert _close(out, _tokens(expected, rank, world_size)) and out.dtype == q.dtype, (
            f"rank {rank} of {world_size}: "
            + _diagnose_output(rank, world_size, out, q, k, v, causal)
        )


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size, heads, length, causal", ATTENTION_CASES)
def test_ulysses_attention_gradients_equal_one_process(kata, world_size, heads, length, causal):
    q, k, v, g = (t.requires_grad_() for t in _random(heads, length, 4))
    _sdpa(q, k, v, causal).backward(g)
    for rank, result in enumerate(_attention(world_size, heads, length, causal)):
        out = result["out"]
        assert out.shape == _tokens(q, rank, world_size).shape, (
            f"rank {rank}: ulysses_attention returned {tuple(out.shape)}, expected this rank's "
            f"tokens of every head {tuple(q.shape[:2])} + ({length // world_size}, {DIM}): no "
            "gradient to compare"
        )
        assert result["grads"] is not None, (
            f"rank {rank}: ulysses_attention's output has no grad_fn: autograd did not see the "
            "re-shards. Use the Functions of step 2 (ScatterHeads.apply, GatherHeads.apply), not "
            "step 1's plain scatter_heads and gather_heads"
        )
        for name, got, full in zip(("dq", "dk", "dv"), result["grads"], (q, k, v)):
            expected = _tokens(full.grad, rank, world_size)
            assert got is not None and _close(got, expected), (
                f"rank {rank}: {name} of its tokens differs from one process's "
                + ("(none)" if got is None else f"({gap(got, expected)})")
            )


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size, heads, length, causal", ATTENTION_CASES[1:2])
def test_ulysses_attention_moves_q_k_v_and_the_output_by_all_to_all(
    kata, world_size, heads, length, causal
):
    local = BATCH * heads * (length // world_size) * DIM * 8
    for rank, result in enumerate(_attention(world_size, heads, length, causal)):
        for phase in ("forward", "backward"):
            calls = result.get(phase)
            if calls is None:
                continue  # no backward: the gradient test says why
            others = sorted({c["name"] for c in calls if c["name"] not in ALL_TO_ALL})
            assert not others, (
                f"rank {rank}: ulysses_attention's {phase} called {', '.join(others)}: Ulysses "
                "moves q, k, v and the output (and their gradients) by all-to-all only; an "
                "all-gather of k and v sends N - 1 times this rank's shard instead of (N - 1)/N"
            )
            sent = sum(_sent(c, world_size) for c in calls)
            expected = 4 * local * (world_size - 1) // world_size
            assert sent == expected, (
                f"rank {rank}: ulysses_attention's {phase} sent {sent} bytes, expected "
                f"{expected}: 4 all-to-alls ("
                + ("q, k, v and the output" if phase == "forward" else "the output's gradient, "
                   "dq, dk and dv")
                + f"), each (N - 1)/N of this rank's {local}-byte shard"
            )  # fmt: skip


def _attention_refusal_rank(rank, world_size):
    kata = load_kata(KATA)
    q = _tokens(_numbered(6, 8), rank, world_size)
    with recording() as calls:
        outcome, message = _value_error(lambda: kata.ulysses_attention(q, q, q, True))
    return outcome, message, [c.name for c in calls if c.name in COMMUNICATION]


@pytest.mark.step(3)
def test_ulysses_attention_refuses_heads_that_do_not_split(kata):
    _check_refusal(_world(_attention_refusal_rank, 4), "ulysses_attention", 6, 4)


def _cuda_rank(rank, world_size, length):
    device = rank_gpu()
    kata = load_kata(KATA)
    q, k, v, g = _random(4, length, 4, device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kata.ulysses_attention(*leaves, True)
    out.backward(g)
    return {"out": out.detach().cpu(), "grads": [t.grad.cpu() for t in leaves]}


@pytest.mark.step(3)
@pytest.mark.cuda
def test_ulysses_attention_on_cuda_equals_one_process(kata):
    """A world of one on one GPU (NCCL needs a GPU per rank; gloo has no all-to-all of CUDA
    tensors): the re-shards, the attention and the backward run on the device."""
    length = 32
    result = run_world(_cuda_rank, 1, length, **on_cuda(1, "nccl", deadline=120))[0]
    q, k, v, g = (t.requires_grad_() for t in _random(4, length, 4))
    expected = _sdpa(q, k, v, True)
    expected.backward(g)
    assert _close(result["out"], expected), f"on CUDA: the output {gap(result['out'], expected)}"
    for name, got, full in zip(("dq", "dk", "dv"), result["grads"], (q, k, v)):
        assert _close(got, full.grad), f"on CUDA: {name} {gap(got, full.grad)}"


# --------------------------------------------------------------------------- step 4: bytes


def _counts(way: str, shape, n: int, element_size: int) -> tuple[int, int]:
    """The spec's own count of the bytes one rank sends (the lesson's table)."""
    batch, heads, length, dim = shape
    b = batch * heads * (length // n) * dim * element_size
    if way == "ulysses":
        return 4 * b * (n - 1) // n, 4 * b * (n - 1) // n
    if way == "ring":
        return 2 * (n - 1) * b, 2 * (n - 1) * b + 2 * n * b
    return 2 * (n - 1) * b, 2 * (n - 1) * b


def _bytes_problem(way, got, want, n, b) -> str:
    """What a wrong count most likely missed, in the lesson's words."""
    if way == "ulysses" and got[0] == 4 * b:
        return "a rank keeps its own piece of every all-to-all: it sends (N - 1)/N of b, not b"
    if way == "ulysses" and got[0] == 3 * b * (n - 1) // n:
        return "forward moves the output back too: 4 all-to-alls (q, k, v and the output)"
    if way == "ring" and got[1] == 4 * (n - 1) * b:
        return (
            "backward: k and v go round again (N - 1 hops), and dk, dv travel with them and "
            "come home: N hops, one more than the keys"
        )
    if way == "all-gather" and got[0] == 2 * b * (n - 1) // n:
        return (
            "an all-gather sends a rank's piece to each of the N - 1 others: (N - 1) b per "
            "tensor, not (N - 1)/N of it (that is an all-to-all's)"
        )
    return f"expected (forward, backward) = {want}, with b = {b} bytes"


@pytest.mark.step(4)
@pytest.mark.parametrize("way", ["ulysses", "ring", "all-gather"])
def test_bytes_per_rank_counts_each_way(kata, way):
    shape = (2, 8, 64, 16)
    for n in (1, 2, 4, 8):
        for element_size in (4, 8):
            got = kata.bytes_per_rank(way, shape, n, element_size)
            want = _counts(way, shape, n, element_size)
            if got == want:
                continue
            b = 2 * 8 * (64 // n) * 16 * element_size
            if got == _counts(way, shape, n, 4) and element_size != 4:
                problem = f"it is the count for 4-byte elements: use element_size ({element_size})"
            else:
                problem = _bytes_problem(way, tuple(got), want, n, b)
            raise AssertionError(
                f"bytes_per_rank({way!r}, {shape}, {n}, {element_size}) is {got}: {problem}"
            )


@pytest.mark.step(4)
def test_bytes_per_rank_refuses_what_does_not_split(kata):
    cases = [
        (("rings", (1, 8, 64, 16), 4), "a way that is not one of 'ulysses', 'ring', 'all-gather'"),
        (("ulysses", (1, 6, 64, 16), 4), "6 heads on 4 ranks (Ulysses splits whole heads)"),
        (("ring", (1, 8, 66, 16), 4), "a sequence of 66 tokens on 4 ranks"),
    ]
    for args, what in cases:
        outcome, message = _value_error(lambda args=args: kata.bytes_per_rank(*args))
        assert outcome == "ValueError", (
            f"bytes_per_rank{args}: {what} must be a ValueError, it {outcome}"
            + (f" {message}" if outcome == "returned" else f": {message}")
        )


def _ways_rank(rank, world_size, heads, length, causal):
    """Ulysses, k26's ring and k25's all-gather on the same world and the same shards, each
    forward and backward, their calls recorded."""
    kata = load_kata(KATA)
    ring = load_kata("k26_ring_attention")
    layout = [(2 * r, 2 * r + 1) for r in range(world_size)]  # k26's naive split: one slice each
    q, k, v, g = _random(heads, length, 4)
    ways = {
        "ulysses": lambda *t: kata.ulysses_attention(*t, causal),
        "ring": lambda *t: ring.ring_attention(*t, layout, causal),
        "all-gather": lambda *t: kata.all_gather_attention(*t, causal),
    }
    results = {}
    for way, attend in ways.items():
        leaves = [_tokens(t, rank, world_size).requires_grad_() for t in (q, k, v)]
        with recording() as forward:
            out = attend(*leaves)
        with recording() as backward:
            out.backward(_tokens(g, rank, world_size))
        results[way] = {
            "out": out.detach(),
            "grads": [t.grad for t in leaves],
            "sent": [
                sum(_sent(c, world_size) for c in _recorded(calls)) for calls in (forward, backward)
            ],
        }
    return results


_ways = shared_run(lambda *args: _world(_ways_rank, *args))


@pytest.mark.step(4)
def test_bytes_per_rank_is_what_each_way_sends_on_the_same_world(kata):
    world_size, heads, length = 4, 4, 16
    shape = (BATCH, heads, length, DIM)
    for rank, result in enumerate(_ways(world_size, heads, length, True)):
        for way, got in result.items():
            counted = tuple(kata.bytes_per_rank(way, shape, world_size, 8))
            assert tuple(got["sent"]) == counted, (
                f"rank {rank}: {way} sent {tuple(got['sent'])} bytes (forward, backward) on "
                f"{world_size} ranks, shape {shape} in float64; bytes_per_rank counts {counted}"
            )


@pytest.mark.step(4)
def test_ulysses_the_ring_and_the_all_gather_agree_on_the_same_inputs(kata):
    world_size, heads, length = 4, 4, 16
    q, k, v, g = (t.requires_grad_() for t in _random(heads, length, 4))
    out = _sdpa(q, k, v, True)
    out.backward(g)
    wanted = [out.detach(), q.grad, k.grad, v.grad]
    for rank, result in enumerate(_ways(world_size, heads, length, True)):
        for way, got in result.items():
            for name, mine, full in zip(
                ("output", "dq", "dk", "dv"), [got["out"], *got["grads"]], wanted
            ):
                expected = _tokens(full, rank, world_size)
                assert _close(mine, expected), (
                    f"rank {rank}: the {name} of {way} differs from one process's on the same "
                    f"inputs ({gap(mine, expected)})"
                )


def _program_check(done):
    shown = streams(done)
    assert "Ulysses equals scaled_dot_product_attention" in done.stdout, shown
    forward, backward = _counts("ulysses", (1, 4, 32, 16), 2, 4)
    assert f"{forward:>9,} bytes forward, {backward:>9,} backward" in done.stdout, shown
    for way in ("ring", "all-gather"):
        assert f"{way}: each rank sends" in done.stdout, shown


@pytest.mark.step(4)
def test_program_compares_the_three_ways(kata):
    _program_check(run_module_ok(KATA, "--world-size", "2", "--length", "32", "--heads", "4"))
