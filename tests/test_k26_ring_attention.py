"""k26 ring attention: the online-softmax merge, one block's attention, the ring, the balanced
causal split and the backward, each held to ``F.scaled_dot_product_attention`` on one process.

Inside each rank the learner's ring runs while its calls are recorded (``dojo.harness.calls``: every
send and receive, with its peer, bytes, and when it was posted and waited for) and while
``attend_block`` is watched: each call is matched, by its values, with the query chunk and key
chunk of the whole sequence it was given, so a test can say which blocks a rank computed, with
which mask and in what order, against when the next block's transfer was posted.

Tolerances: float64 throughout (the ring adds the same terms as one process in another order,
so the results agree to rounding, ~1e-15, and 1e-10 leaves room for it while still catching a
mistake of any size a real bug makes).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from dojo.harness.calls import clock, recording
from dojo.harness.impl import load_kata
from dojo.harness.world import WorldDeadlock, run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.states import close, gap
from dojo.spec.testing import run_module_ok, shared_run, streams
from dojo.todo import KataTodo

KATA = "k26_ring_attention"
DEADLINE_S = 20.0
STALL_S = 3.0  # every rank idle this long (in a wait, a recv): a deadlocked ring, reported
TOLERANCE = {"rtol": 1e-9, "atol": 1e-10}  # float64: rounding only (see the module docstring)
HEADS, DIM = 2, 16
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier",
)  # fmt: skip


# --------------------------------------------------------------------------- shared helpers


def _tensors(length: int, count: int = 4, seed: int = 0, dim: int = DIM, device="cpu"):
    """q, k, v and an output gradient over the whole sequence, (1, HEADS, length, dim), float64."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1, HEADS, length, dim, generator=generator, dtype=torch.float64).to(device)
        for _ in range(count)
    ]


def _naive(world_size: int) -> list[tuple[int, int]]:
    return [(2 * r, 2 * r + 1) for r in range(world_size)]


def _balanced(world_size: int) -> list[tuple[int, int]]:
    return [(r, 2 * world_size - 1 - r) for r in range(world_size)]


LAYOUTS = {"naive": _naive, "balanced": _balanced}


def _shard(x: torch.Tensor, layout, rank: int) -> torch.Tensor:
    """The test's own sharding (step 3 must not depend on step 4's)."""
    size = x.shape[-2] // sum(len(c) for c in layout)
    return torch.cat([x[..., c * size : (c + 1) * size, :] for c in layout[rank]], dim=-2)


def _rows(layout, rank: int, length: int) -> torch.Tensor:
    """The positions of the whole sequence rank ``rank`` holds, in its shard's order."""
    size = length // sum(len(c) for c in layout)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in layout[rank]])


def _reference(q, k, v, causal: bool):
    """Output and log-sum-exp of the attention over the whole sequence, on one process."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        length = q.shape[-2]
        hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out, torch.logsumexp(scores, dim=-1)


def _close(a, b) -> bool:
    return close(a, b, **TOLERANCE)


def _mask_of(query_chunk: int, key_chunk: int, causal: bool) -> str | None:
    if not causal or key_chunk < query_chunk:
        return "full"
    return "causal" if key_chunk == query_chunk else None


def _call(function, *args):
    """``(value, None)`` or ``(None, the exception)``; a todo goes straight through."""
    try:
        return function(*args), None
    except KataTodo:
        raise
    except Exception as error:
        return None, error


def _ring_advice(report: str) -> str:
    """What a deadlocked ring most likely did, from the harness's report of where ranks wait."""
    if " in send (" in report or " in recv (" in report:
        return (
            "the ring deadlocked in a blocking dist.send or dist.recv: gloo's send returns only "
            "once the receiver has posted its recv, so if every rank sends (or receives) first, "
            "they all wait for ever. Post the block's dist.isend and the next block's "
            "dist.irecv, compute, then wait for both requests"
        )
    return (
        "the ring deadlocked: the ranks wait for a message that never comes. Each rank sends "
        "to its right neighbour, (rank + 1) % N, and receives from its left one, (rank - 1) % "
        "N, as many blocks as the left neighbour sends, in the same order; and waits each "
        "request once (a gloo request waited twice waits for a second message)"
    )


def _world(fn, world_size, *args, **options):
    """``run_world`` with this spec's deadlines; a deadlock ends as the harness's report, with
    what a ring that deadlocks usually did first."""
    try:
        return run_world(fn, world_size, *args, deadline=DEADLINE_S, stall=STALL_S, **options)
    except WorldDeadlock as error:
        raise WorldDeadlock(f"{_ring_advice(str(error))}.\n\n{error}", error.stuck) from None


# --------------------------------------------------------------------------- step 1: merging


def _partial(scores: torch.Tensor, v: torch.Tensor):
    """The attention over one part of the keys: (softmax(scores) @ v, logsumexp(scores))."""
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def _split_case(rows=5, keys=12, dim=3, cut=7, shift=0.0, seed=1, batch=2):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, rows, keys, generator=generator, dtype=torch.float64) * 3 + shift
    v = torch.randn(batch, keys, dim, generator=generator, dtype=torch.float64)
    a = _partial(scores[..., :cut], v[..., :cut, :])
    b = _partial(scores[..., cut:], v[..., cut:, :])
    return a, b, _partial(scores, v)


def _merge_problem(got, a, b, whole) -> str | None:
    """What is wrong with a merge's (out, lse), in the lesson's words, or None."""
    (out_a, lse_a), (out_b, lse_b), (out, lse) = a, b, whole
    if not isinstance(got, tuple) or len(got) != 2:
        return f"merge_partials returned {type(got).__name__}, expected the pair (out, lse)"
    got_out, got_lse = got
    if not _close(got_lse, lse):
        if _close(got_lse, torch.maximum(lse_a, lse_b)):
            return (
                "the merged lse is the larger of the two lse's: it is the log of the SUM of "
                "both parts' exponentials, log(e^lse_a + e^lse_b) (torch.logaddexp)"
            )
        if _close(got_lse, lse_a + lse_b):
            return (
                "the merged lse is lse_a + lse_b: logs of sums do not add; the merged lse is "
                "log(e^lse_a + e^lse_b) (torch.logaddexp)"
            )
        return f"the merged lse is wrong ({gap(got_lse, lse)}): it is log(e^lse_a + e^lse_b)"
    if _close(got_out, out):
        return None
    if _close(got_out, out_a + out_b):
        return (
            "the merged out is out_a + out_b: each part is normalised by its own softmax, so "
            "weigh each by its share of the whole softmax, e^(lse_x - lse)"
        )
    if _close(got_out, (out_a + out_b) / 2):
        return (
            "the merged out is the mean of the two parts: weigh each by its share of the whole "
            "softmax's mass, e^(lse_x - lse), not one half"
        )
    return f"the merged out is wrong ({gap(got_out, out)}): out = sum of e^(lse_x - lse) * out_x"


@pytest.mark.step(1)
@pytest.mark.parametrize("cut", [1, 6, 11])
def test_merge_equals_the_softmax_over_both_parts(kata, cut):
    a, b, whole = _split_case(cut=cut)
    got, error = _call(kata.merge_partials, *a, *b)
    if error is not None:
        hint = (
            ": lse is (..., rows) and out (..., rows, dim), so a row's weight e^(lse_x - lse) "
            "must be made (..., rows, 1) (unsqueeze(-1)) to scale that row"
            if "size of tensor" in str(error)
            else ""
        )
        raise AssertionError(
            f"merge_partials of two partials (out (2, 5, 3), lse (2, 5)) raised "
            f"{type(error).__name__}: {error}{hint}"
        )
    problem = _merge_problem(got, a, b, whole)
    assert problem is None, (
        f"merging the attention over keys 0..{cut - 1} with the one over keys {cut}..11 must "
        f"give the attention over all 12 keys: {problem}"
    )


@pytest.mark.step(1)
def test_merge_keeps_each_rows_own_weights(kata):
    """Square partials (as many rows as features): a weight applied per column goes unnoticed
    by shape, not by value."""
    a, b, whole = _split_case(rows=4, dim=4, cut=5, batch=1)
    got, error = _call(kata.merge_partials, *a, *b)
    if error is not None:
        raise AssertionError(
            f"merge_partials of square partials (out (1, 4, 4), lse (1, 4)) raised "
            f"{type(error).__name__}: {error}: a row's weight must be made (..., rows, 1) "
            "(unsqueeze(-1)) to scale that row"
        )
    assert isinstance(got, tuple) and _close(got[0], whole[0]), (
        f"with 4 query rows of 4 features the merged out is wrong ({gap(got[0], whole[0])}) "
        "although it is right when rows and features differ in number: each ROW has its own "
        "lse, so its weight e^(lse_x - lse) must scale that row: lse is (..., rows), make it "
        "(..., rows, 1) (unsqueeze(-1)) before multiplying, or it is broadcast along the features"
    )


@pytest.mark.step(1)
def test_merge_survives_large_scores(kata):
    a, b, whole = _split_case(shift=1000.0)
    got, error = _call(kata.merge_partials, *a, *b)
    if error is not None:
        raise AssertionError(f"merge_partials raised {type(error).__name__}: {error}")
    out, lse = got
    bad = not (torch.isfinite(out).all() and torch.isfinite(lse).all())
    assert not bad, (
        "with scores near 1000 (lse ~ 1002) the merge gave inf or NaN: e^1002 overflows even "
        "in float64 (the largest is ~e^709). Never exponentiate an lse itself: the weights "
        "e^(lse_x - lse) are at most 1, and the merged lse is max + log(e^(a - max) + e^(b - max)) "
        "(torch.logaddexp does it)"
    )
    assert _close(out, whole[0]) and _close(lse, whole[1]), (
        f"with scores near 1000 the merge is wrong: out {gap(out, whole[0])}, lse "
        f"{gap(lse, whole[1])}"
    )


@pytest.mark.step(1)
def test_merge_with_a_part_that_saw_no_key(kata):
    """A row whose part saw no key has lse -inf there (and out 0): the other part is the answer;
    a row that saw no key at all stays -inf, out 0, and no NaN."""
    (out_a, lse_a), _, _ = _split_case()
    empty_out, empty_lse = torch.zeros_like(out_a), torch.full_like(lse_a, float("-inf"))
    got, error = _call(kata.merge_partials, empty_out, empty_lse, out_a, lse_a)
    if error is not None:
        raise AssertionError(f"merge_partials raised {type(error).__name__}: {error}")
    assert _close(got[0], out_a) and _close(got[1], lse_a), (
        "merging an empty part (lse -inf, out 0: a row that saw no key yet, how a running result "
        f"starts) with a part must give that part: out {gap(got[0], out_a)}, lse "
        f"{gap(got[1], lse_a)}. e^(-inf - lse) is 0: the empty part weighs nothing"
    )
    got, error = _call(kata.merge_partials, empty_out, empty_lse, empty_out, empty_lse)
    if error is not None:
        raise AssertionError(f"merge_partials raised {type(error).__name__}: {error}")
    out, lse = got
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), (
        "merging two empty parts (lse -inf on both sides) gave NaN: -inf - (-inf) is NaN. A row "
        "that has seen no key stays out 0, lse -inf: take the weights where the merged lse is "
        "finite only (torch.where)"
    )
    assert torch.isneginf(lse).all() and (out == 0).all(), (
        f"merging two empty parts must stay empty (lse -inf, out 0), got lse {lse.flatten()[:3]} "
        f"and out {out.flatten()[:3]}"
    )


@pytest.mark.step(1)
def test_merge_refuses_partials_that_do_not_fit(kata):
    (out_a, lse_a), (out_b, lse_b), _ = _split_case()
    for what, args in (
        ("out_b for other rows", (out_a, lse_a, out_b[:, :3], lse_b[:, :3])),
        ("an lse per feature, not per row", (out_a, out_a, out_b, lse_b)),
    ):
        value, error = _call(kata.merge_partials, *args)
        assert isinstance(error, ValueError), (
            f"merge_partials with {what} "
            + (f"raised {type(error).__name__}: {error}" if error else "returned a result")
            + ": raise ValueError saying which shapes do not fit"
        )


# --------------------------------------------------------------------------- step 2: one block


@pytest.mark.step(2)
def test_block_mask_for_each_pair_of_chunks(kata):
    for causal in (True, False):
        for a in range(4):
            for b in range(4):
                got = kata.block_mask(a, b, causal)
                want = _mask_of(a, b, causal)
                assert got == want, (
                    f"block_mask(query_chunk={a}, key_chunk={b}, causal={causal}) is {got!r}, "
                    f"expected {want!r}: "
                    + (
                        "without a causal mask every query sees every key"
                        if not causal
                        else "a key chunk before the query chunk is seen whole ('full'), the "
                        "chunk itself only up to each query ('causal'), a later one not at all "
                        "(None)"
                    )
                )


def _block(queries=8, keys=8, seed=2, dim=DIM):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, queries, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(1, HEADS, keys, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(1, HEADS, keys, dim, generator=generator, dtype=torch.float64)
    return q, k, v


def _scores(q, k, causal, scale=None):
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _block_problem(got, q, k, v, causal) -> str | None:
    if not isinstance(got, tuple) or len(got) != 2:
        return f"it returned {type(got).__name__}, expected the pair (out, lse)"
    out, lse = got
    want_out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    want_lse = torch.logsumexp(_scores(q, k, causal), dim=-1)
    if not _close(out, want_out):
        if isinstance(out, torch.Tensor) and torch.isnan(out).any():
            return (
                f"out holds NaNs in rows {sorted(set(torch.isnan(out).nonzero()[:, 2].tolist()))}: "
                "a row whose every score is -inf (masked) gives 0/0. The causal mask hides the "
                "keys AFTER each query: query i keeps keys 0..i, itself included (triu(1), not "
                "triu(0))"
            )
        for scale, words in ((1.0, "no scale at all"), (1 / q.shape[-1], "1 / dim")):
            wrong = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            if _close(out, wrong):
                return (
                    f"out equals the attention with scores scaled by {words}: the scale is "
                    "1 / sqrt(dim), as scaled_dot_product_attention's"
                )
        if causal and _close(out, F.scaled_dot_product_attention(q, k, v)):
            return "out ignores the causal mask: on the diagonal query i sees keys 0..i only"
        if causal:
            flipped = torch.softmax(
                ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).masked_fill(
                    torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(-1), float("-inf")
                ),
                dim=-1,
            )
            if _close(out, flipped @ v):
                return "out lets query i see keys i..end: the mask is the wrong way round"
        return f"out differs from scaled_dot_product_attention ({gap(out, want_out)})"
    if not _close(lse, want_lse):
        if isinstance(lse, torch.Tensor) and lse.shape == want_lse.shape:
            if _close(lse, torch.logsumexp(_scores(q, k, causal, scale=1.0), dim=-1)):
                return "lse is the log-sum-exp of the UNSCALED scores: take it of the scaled ones"
            if _close(lse, _scores(q, k, causal).amax(dim=-1)):
                return (
                    "lse is each row's largest score: it is the log of the sum of e^score over "
                    "the row's keys (torch.logsumexp), which the merge needs"
                )
        return (
            f"lse is wrong ({gap(lse, want_lse)}): one per query row, the log-sum-exp of that "
            "row's scaled scores over the keys it keeps"
        )
    return None


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "queries, keys, causal",
    [(8, 8, False), (8, 12, False), (8, 8, True)],
    ids=["full-square", "full-wide", "causal-diagonal"],
)
def test_attend_block_equals_scaled_dot_product_attention(kata, queries, keys, causal):
    q, k, v = _block(queries, keys)
    got, error = _call(kata.attend_block, q, k, v, causal)
    if error is not None:
        raise AssertionError(
            f"attend_block(q {tuple(q.shape)}, k {tuple(k.shape)}, v, causal={causal}) raised "
            f"{type(error).__name__}: {error}"
        )
    problem = _block_problem(got, q, k, v, causal)
    assert problem is None, (
        f"attend_block of {queries} queries over {keys} keys (causal={causal}): {problem}"
    )


@pytest.mark.step(2)
def test_blocks_merge_into_the_whole_attention(kata):
    """The ring's arithmetic on one process: the diagonal block causal, the earlier ones full,
    merged one by one, equal the causal attention of the last chunk over every key."""
    q, k, v = _block(queries=24, keys=24)
    size = 8
    last = slice(16, 24)
    out, lse = kata.attend_block(q[..., last, :], k[..., last, :], v[..., last, :], True)
    for chunk in (1, 0):
        keys = slice(chunk * size, (chunk + 1) * size)
        part = kata.attend_block(q[..., last, :], k[..., keys, :], v[..., keys, :], False)
        out, lse = kata.merge_partials(out, lse, *part)
    want_out, want_lse = _reference(q, k, v, causal=True)
    assert _close(out, want_out[..., last, :]) and _close(lse, want_lse[..., last]), (
        "the last of 3 chunks attended causally to itself and fully to the two before, merged "
        f"with merge_partials, differs from the causal attention over all 24 keys: out "
        f"{gap(out, want_out[..., last, :])}, lse {gap(lse, want_lse[..., last])}. Each "
        "block alone passes: does attend_block's lse belong to the same scaled scores as its out?"
    )


@pytest.mark.step(2)
def test_attend_block_refuses_blocks_that_do_not_fit(kata):
    q, k, v = _block(8, 12)
    for what, args in (
        ("a causal block of 8 queries over 12 keys", (q, k, v, True)),
        ("keys and values of different lengths", (q, k, v[..., :6, :], False)),
        ("q and k of different feature dims", (q, k[..., :8], v, False)),
    ):
        _, error = _call(kata.attend_block, *args)
        assert isinstance(error, ValueError), (
            f"attend_block with {what} "
            + (f"raised {type(error).__name__}: {error}" if error else "returned a result")
            + ": raise ValueError saying what does not fit"
            + (" (only a chunk against itself is causal)" if "causal" in what else "")
        )


# --------------------------------------------------------------------------- step 3: the ring


def _chunks_of(x: torch.Tensor, whole: torch.Tensor, size: int):
    """Which chunks of ``whole`` (in order) the tensor ``x`` holds, by value, or None."""
    if not isinstance(x, torch.Tensor) or x.shape[:-2] != whole.shape[:-2]:
        return None
    if x.shape[-2] % size or x.shape[-1] != whole.shape[-1]:
        return None
    found = []
    for start in range(0, x.shape[-2], size):
        piece = x[..., start : start + size, :]
        match = next(
            (
                c
                for c in range(whole.shape[-2] // size)
                if torch.equal(piece.to(whole.dtype), whole[..., c * size : (c + 1) * size, :])
            ),
            None,
        )
        if match is None:
            return None
        found.append(match)
    return tuple(found)


def _watched_ring(kata, layout, length, causal, function="ring_attention_forward", grad=False):
    """Run the kata's ring on this rank's shards, recording its calls and attend_block's."""
    import torch.distributed as dist

    rank = dist.get_rank()
    q, k, v, g = _tensors(length)
    size = length // sum(len(c) for c in layout)
    attended = []
    original = kata.attend_block

    def watched(qq, kk, vv, causal_block, *rest, **kwargs):
        attended.append(
            {
                "time": clock(),
                "q": _chunks_of(qq, q, size),
                "k": _chunks_of(kk, k, size),
                "causal": bool(causal_block),
            }
        )
        return original(qq, kk, vv, causal_block, *rest, **kwargs)

    shards = [_shard(t, layout, rank) for t in (q, k, v, g)]
    kata.attend_block = watched
    try:
        with recording() as calls:
            if grad:
                leaves = [t.clone().requires_grad_() for t in shards[:3]]
                out = kata.ring_attention(*leaves, layout, causal)
                forward_calls = len(calls)
                out.backward(shards[3])
                result = {
                    "out": out.detach(),
                    "grads": [None if t.grad is None else t.grad.clone() for t in leaves],
                    "forward_calls": forward_calls,
                }
            else:
                out, lse = getattr(kata, function)(*shards[:3], layout, causal)
                result = {"out": out, "lse": lse}
    finally:
        kata.attend_block = original
    result["attended"] = attended
    result["calls"] = [
        {
            "name": c.name,
            "peers": dict(c.peers),
            "bytes": c.bytes,
            "start": c.start,
            "end": c.end,
            "done": c.done,
            "parts": list(c.parts),
        }
        for c in calls
    ]
    result["kv_bytes"] = shards[1].numel() * 8 + shards[2].numel() * 8
    return result


def _ring_rank(rank, world_size, layout_name, length, causal):
    kata = load_kata(KATA)
    return _watched_ring(kata, LAYOUTS[layout_name](world_size), length, causal)


def _ring_world(world_size, layout_name, length, causal):
    return _world(_ring_rank, world_size, layout_name, length, causal)


_ring = shared_run(_ring_world)
RING_CASES = [
    pytest.param(2, True, id="2-ranks-causal"),
    pytest.param(4, True, id="4-ranks-causal"),
    pytest.param(4, False, id="4-ranks-full"),
]


def _messages(calls, kind: str):
    """This rank's sends (kind "send") or receives ("recv"), batched ones unpacked: (call, peer,
    bytes) in the order they were posted."""
    found = []
    for call in calls:
        if call["name"] == "batch_isend_irecv":
            for name, peer, _, size in call["parts"]:
                if kind in name:
                    found.append((call, peer, size))
        elif call["name"] in (kind, "i" + kind):
            peer = next(iter(v for key, v in call["peers"].items() if key != "tag"), None)
            found.append((call, peer, call["bytes"]))
    return found


def _check_ring_traffic(by_rank, world_size, what, kv_hops=None, extra_hops=0):
    kv_hops = world_size - 1 if kv_hops is None else kv_hops
    for rank, result in enumerate(by_rank):
        calls = result["calls"]
        used = sorted({c["name"] for c in calls if c["name"] in COLLECTIVES})
        assert not used, (
            f"rank {rank}: {what} called {', '.join(used)}: the keys and values travel round the "
            "ring by point-to-point calls only (dist.isend/dist.irecv to the neighbours)"
        )
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        sends, recvs = _messages(calls, "send"), _messages(calls, "recv")
        wrong = [peer for _, peer, _ in sends if peer != right]
        assert not wrong, (
            f"rank {rank}: {what} sent to rank(s) {sorted(set(wrong))}: in the ring every rank "
            f"sends to its right neighbour only, (rank + 1) % N = {right}"
        )
        wrong = [peer for _, peer, _ in recvs if peer != left]
        assert not wrong, (
            f"rank {rank}: {what} received from rank(s) {sorted(set(wrong))}: in the ring every "
            f"rank receives from its left neighbour only, (rank - 1) % N = {left}"
        )
        sent = sum(size for _, _, size in sends)
        block = result["kv_bytes"]
        expected = kv_hops * block + extra_hops * block
        assert sent == expected, (
            f"rank {rank}: {what} on {world_size} ranks sent {sent} bytes, expected "
            f"{expected} = "
            + (
                f"{kv_hops} x this rank's keys and values ({block} bytes): each block makes "
                f"N - 1 = {world_size - 1} hops, and none after the last step (its keys have "
                "then been everywhere)"
                if not extra_hops
                else f"{kv_hops} hops of keys and values and {extra_hops} of their gradients, "
                f"{block} bytes each"
            )
        )


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size, causal", RING_CASES)
def test_ring_passes_keys_and_values_to_the_right(kata, world_size, causal):
    by_rank = _ring(world_size, "naive", 16 * world_size, causal)
    _check_ring_traffic(by_rank, world_size, "ring_attention_forward")


def _first_use(attended, chunks):
    """When the first attend_block call on key chunk(s) ``chunks`` started, or None."""
    times = [a["time"] for a in attended if a["k"] and set(a["k"]) <= set(chunks)]
    return min(times) if times else None


@pytest.mark.step(3)
def test_ring_posts_the_next_block_before_computing_this_one(kata):
    """Every block is computed (no causal mask), so each step's computation can be placed
    against the transfers: the next block's receive is posted before this block's first
    attend_block and waited for only after it started; this block's send likewise posted first."""
    world_size = 4
    layout = _naive(world_size)
    by_rank = _ring(world_size, "naive", 16 * world_size, False)
    for rank, result in enumerate(by_rank):
        recvs = _messages(result["calls"], "recv")
        sends = _messages(result["calls"], "send")
        block = result["kv_bytes"]
        for step in range(world_size - 1):
            source = (rank - step) % world_size
            begun = _first_use(result["attended"], layout[source])
            assert begun is not None, (
                f"rank {rank} never called attend_block on the keys of rank {source} (its "
                f"block in step {step}): compute every block with attend_block"
            )
            # the receives that bring block step + 1, and the sends that pass block `step` on
            window = (step * block, (step + 1) * block)

            def within(messages, window=window):
                total, found = 0, []
                for call, _, size in messages:
                    if window[0] <= total < window[1]:
                        found.append(call)
                    total += size
                return found

            coming, going = within(recvs), within(sends)
            assert coming and going, (
                f"rank {rank}: in step {step} no transfer of the next block was found (it "
                f"received {sum(s for _, _, s in recvs)} bytes in all)"
            )
            if any(c["start"] > begun for c in coming):
                raise AssertionError(
                    f"rank {rank} posted the receive of the next block (step {step + 1}'s, from "
                    f"rank {(rank - 1) % world_size}) only after it began computing on step "
                    f"{step}'s block: the transfer then waits for the computation. Post "
                    "dist.irecv (and dist.isend of the block you hold) first, then compute, "
                    "then wait"
                )
            blocking = [c for c in coming if c["name"] == "recv"]
            waited = [c["done"] for c in coming if c["name"] != "recv"]
            if blocking or any(w is not None and w < begun for w in waited):
                raise AssertionError(
                    f"rank {rank} waited for the next block (step {step + 1}'s) before it "
                    f"computed on step {step}'s: "
                    + (
                        "a blocking dist.recv returns only once the block has arrived"
                        if blocking
                        else "request.wait() came before attend_block"
                    )
                    + ". Nothing overlaps then: post dist.irecv, compute this block, and only "
                    "then wait for the requests"
                )
            if any(c["start"] > begun for c in going):
                raise AssertionError(
                    f"rank {rank} sent step {step}'s block on to rank {(rank + 1) % world_size} "
                    "only after computing on it: the right neighbour waits for it all that "
                    "time. Post dist.isend of the block you hold before computing on it"
                )


def _expected_blocks(layout, rank, causal):
    """(query chunk, key chunk, causal?) of every block rank ``rank`` must compute."""
    keys = [c for chunks in layout for c in chunks]
    return sorted(
        (a, b, _mask_of(a, b, causal) == "causal")
        for a in layout[rank]
        for b in keys
        if _mask_of(a, b, causal) is not None
    )


def _blocks_problem(result, layout, rank, causal) -> str | None:
    got = [(a["q"], a["k"], a["causal"]) for a in result["attended"]]
    if not got:
        return (
            f"rank {rank} never called attend_block: compute each (query chunk, key chunk) block "
            "with attend_block, one call per block"
        )
    whole = [g for g in got if g[0] is None or g[1] is None or len(g[0]) != 1 or len(g[1]) != 1]
    if whole:
        return (
            f"rank {rank} called attend_block with queries or keys that are not one chunk of the "
            "sequence: call it once per (query chunk, key chunk) pair, the query rows and key rows "
            "of one chunk each"
        )
    done = sorted((a[0], b[0], c) for a, b, c in got)
    expected = _expected_blocks(layout, rank, causal)
    for block in done:
        a, b, was_causal = block
        mask = _mask_of(a, b, causal)
        if mask is None:
            return (
                f"rank {rank} attended query chunk {a} to key chunk {b}, which the causal mask "
                "hides entirely (every key after every query): skip such a block, compute "
                "nothing (block_mask is None), or the queries see the future. Is each block "
                "numbered by the rank it came from, layout[(rank - step) % N]?"
            )
        if was_causal != (mask == "causal"):
            return (
                f"rank {rank} attended query chunk {a} to key chunk {b} with causal={was_causal}, "
                f"expected causal={mask == 'causal'}: only a chunk against itself is causal "
                "(block_mask). Is each block numbered by the rank it came from, "
                "layout[(rank - step) % N]?"
            )
    for block in sorted(set(done)):
        if done.count(block) > 1:
            return (
                f"rank {rank} attended query chunk {block[0]} to key chunk {block[1]} "
                f"{done.count(block)} times: each block once"
            )
    missing = [b for b in expected if b not in done]
    if missing:
        a, b, _ = missing[0]
        return (
            f"rank {rank} never attended query chunk {a} to key chunk {b}: every rank's block "
            "must reach every rank, N - 1 hops round the ring"
        )
    return None


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size, causal", RING_CASES)
def test_ring_attends_each_block_once_with_its_mask(kata, world_size, causal):
    by_rank = _ring(world_size, "naive", 16 * world_size, causal)
    layout = _naive(world_size)
    for rank, result in enumerate(by_rank):
        problem = _blocks_problem(result, layout, rank, causal)
        assert problem is None, (
            f"ring_attention_forward on {world_size} ranks (naive split {layout}, "
            f"causal={causal}): {problem}"
        )


def _check_ring_values(by_rank, layout, length, causal, what):
    q, k, v, _ = _tensors(length)
    want_out, want_lse = _reference(q, k, v, causal)
    for rank, result in enumerate(by_rank):
        rows = _rows(layout, rank, length)
        out, lse = result["out"], result["lse"]
        assert _close(out, want_out[..., rows, :]), (
            f"rank {rank}: {what}'s output for its rows {layout[rank]} differs from "
            f"scaled_dot_product_attention on one process ({gap(out, want_out[..., rows, :])}). "
            "Every block is the right one (the test before passed): is each block merged into "
            "the running result of its query chunk with merge_partials (not replacing it), and "
            "the chunks put back in layout order?"
        )
        assert _close(lse, want_lse[..., rows]), (
            f"rank {rank}: {what}'s lse for its rows differs from the log-sum-exp over the whole "
            f"row ({gap(lse, want_lse[..., rows])}): return the merged lse, (..., local length)"
        )


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size, causal", RING_CASES)
def test_ring_forward_equals_one_process(kata, world_size, causal):
    length = 16 * world_size
    by_rank = _ring(world_size, "naive", length, causal)
    _check_ring_values(by_rank, _naive(world_size), length, causal, "ring_attention_forward")


def _bad_layouts(rank, world_size):
    kata = load_kata(KATA)
    q, k, v, _ = _tensors(24)
    shards = [_shard(t, _naive(world_size), rank) for t in (q, k, v)]
    results = {}
    for what, layout, args in (
        ("a layout of 1 rank in a world of 2", [(0, 1)], shards),
        ("a layout that holds chunk 1 twice", [(0, 1), (1, 2)], shards),
        ("12 tokens that do not cut into 5 chunks", [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)], shards),
    ):
        _, error = _call(kata.ring_attention_forward, *args, layout, True)
        results[what] = None if error is None else (type(error).__name__, str(error))
    return results


@pytest.mark.step(3)
def test_ring_refuses_a_layout_that_does_not_fit(kata):
    by_rank = _world(_bad_layouts, 2)
    for rank, results in enumerate(by_rank):
        for what, outcome in results.items():
            assert outcome is not None and outcome[0] == "ValueError", (
                f"rank {rank}: ring_attention_forward with {what} "
                + (f"raised {outcome[0]}: {outcome[1]}" if outcome else "ran")
                + ": check the layout and the shards first (before any send) and raise "
                "ValueError saying what does not fit"
            )


# --------------------------------------------------------------------------- step 4: the split


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_chunk_layout_naive_and_balanced(kata, world_size):
    for balanced, expected in ((False, _naive(world_size)), (True, _balanced(world_size))):
        got = [tuple(c) for c in kata.chunk_layout(world_size, balanced)]
        assert got == expected, (
            f"chunk_layout({world_size}, balanced={balanced}) is {got}, expected {expected}: "
            + (
                "rank r holds chunk r from the front and chunk 2N - 1 - r from the back, so "
                "every rank gets one cheap chunk and one dear one"
                if balanced
                else "rank r holds the two chunks 2r and 2r + 1, one contiguous slice of the "
                "sequence"
            )
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("layout_name", ["naive", "balanced"])
def test_shard_and_unshard_the_sequence(kata, layout_name):
    world_size, length = 4, 32
    layout = LAYOUTS[layout_name](world_size)
    x = torch.arange(length, dtype=torch.float64).view(1, 1, length, 1).expand(1, 2, length, 3)
    shards = []
    for rank in range(world_size):
        shard = kata.shard_sequence(x, layout, rank)
        want = _rows(layout, rank, length)
        got = shard[0, 0, :, 0].long() if shard.dim() == 4 else None
        assert got is not None and shard.shape == (1, 2, 8, 3) and torch.equal(got, want), (
            f"shard_sequence of a 32-token sequence (token i holds i) for rank {rank} of 4 "
            f"({layout_name}, layout {layout}): "
            + (
                f"it holds the tokens {got.tolist()}, expected {want.tolist()}: chunk c of 8 "
                "is tokens 4c..4c+3; take layout[rank]'s chunks in that order"
                if got is not None and got.shape == want.shape
                else f"shaped {tuple(shard.shape)}, expected (1, 2, 8, 3)"
            )
        )
        assert shard.is_contiguous(), (
            f"rank {rank}'s shard is not contiguous: dist.isend needs contiguous tensors; "
            "torch.cat makes one"
        )
        shards.append(shard)
    whole = kata.unshard_sequence(shards, layout)
    assert isinstance(whole, torch.Tensor) and torch.equal(whole, x), (
        f"unshard_sequence of the 4 shards ({layout_name}) must give the sequence back in order; "
        + (
            f"its tokens are {whole[0, 0, :, 0].long().tolist()}"
            if isinstance(whole, torch.Tensor) and whole.shape == x.shape
            else f"got {getattr(whole, 'shape', whole)}"
        )
        + ": put each shard's chunks back at their places (layout[rank][i] is the i-th)"
    )


@pytest.mark.step(4)
def test_shard_refuses_a_sequence_that_does_not_cut_into_chunks(kata):
    x = torch.zeros(1, 2, 100, 4)
    _, error = _call(kata.shard_sequence, x, _balanced(4), 0)
    assert isinstance(error, ValueError), (
        "shard_sequence of 100 tokens into 4 ranks x 2 chunks "
        + (f"raised {type(error).__name__}: {error}" if error else "returned a shard")
        + ": 100 does not divide into 8 equal chunks; raise ValueError saying so and what to do "
        "(pad the sequence to a multiple of 8)"
    )
    text = str(error)
    assert "100" in text and "8" in text, (
        f"shard_sequence's ValueError says {text!r}: name the length (100) and the number of "
        "chunks (8) it must divide into"
    )


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_blocks_per_rank_naive_against_balanced(kata, world_size):
    n = world_size
    cases = {
        ("naive", True): [4 * r + 3 for r in range(n)],
        ("balanced", True): [2 * n + 1] * n,
        ("naive", False): [4 * n] * n,
    }
    for (name, causal), expected in cases.items():
        got = list(kata.blocks_per_rank(LAYOUTS[name](n), causal))
        assert got == expected, (
            f"blocks_per_rank({name} layout of {n} ranks, causal={causal}) is {got}, expected "
            f"{expected}: count each (query chunk, key chunk) pair of the rank's 2 query chunks "
            f"against all {2 * n} key chunks that the mask leaves anything of (block_mask not None)"
        )


def _split_rank(rank, world_size, balanced, length):
    kata = load_kata(KATA)
    layout = [tuple(c) for c in kata.chunk_layout(world_size, balanced)]
    result = _watched_ring(kata, layout, length, True)
    result["layout"] = layout
    result["counted"] = list(kata.blocks_per_rank(layout, True))
    return result


@pytest.mark.step(4)
@pytest.mark.parametrize("balanced", [False, True], ids=["naive", "balanced"])
def test_the_ring_computes_the_blocks_counted(kata, balanced):
    """The ring on the kata's own layout: balanced, every rank computes 2N + 1 blocks; naive,
    rank r computes 4r + 3 (the last rank 4N - 1, nearly twice the balanced share)."""
    world_size, length = 4, 64
    by_rank = _world(_split_rank, world_size, balanced, length)
    layout = by_rank[0]["layout"]
    for rank, result in enumerate(by_rank):
        problem = _blocks_problem(result, layout, rank, True)
        assert problem is None, (
            f"the ring on the {'balanced' if balanced else 'naive'} layout {layout}: {problem}. "
            "The naive layout passed in step 3: read each block's chunk numbers from the layout, "
            "layout[(rank - step) % N], never from the rank number itself"
        )
        computed = len(result["attended"])
        assert computed == result["counted"][rank], (
            f"rank {rank} computed {computed} blocks, blocks_per_rank says "
            f"{result['counted'][rank]}"
        )
    _check_ring_values(by_rank, layout, length, True, "the ring on the balanced layout")


# --------------------------------------------------------------------------- step 5: backward


def _sdpa_grads(q, k, v, g, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.step(5)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_block_gradients_add_up_to_the_whole(kata, causal):
    """One process: three chunks; the last chunk's queries against each key chunk."""
    q, k, v, g = _tensors(24, seed=3)
    out, lse = _reference(q, k, v, causal)
    _, (dq, dk, dv) = _sdpa_grads(q, k, v, g, causal)
    size, last = 8, slice(16, 24)
    # the gradients that flow from the last chunk's queries alone
    _, (dq_last, dk_last, dv_last) = _sdpa_grads(
        q, k, v, g * (torch.arange(24) >= 16).view(1, 1, 24, 1).double(), causal
    )
    total_dq = torch.zeros_like(q[..., last, :])
    for chunk in range(3):
        keys = slice(chunk * size, (chunk + 1) * size)
        got, error = _call(
            kata.block_gradients,
            q[..., last, :],
            k[..., keys, :],
            v[..., keys, :],
            out[..., last, :],
            lse[..., last],
            g[..., last, :],
            causal and chunk == 2,
        )
        if error is not None:
            raise AssertionError(f"block_gradients raised {type(error).__name__}: {error}")
        block_dq, block_dk, block_dv = got
        where = f"the last of 3 chunks' queries against key chunk {chunk} (causal={causal})"
        assert _close(block_dv, dv_last[..., keys, :]), (
            f"block_gradients for {where}: dv {gap(block_dv, dv_last[..., keys, :])}. dv is "
            "P^T @ grad_out with P the probabilities of the WHOLE row: e^(scores - lse), lse "
            "the finished one passed in (not this block's own softmax)"
        )
        assert _close(block_dk, dk_last[..., keys, :]), (
            f"block_gradients for {where}: dk {gap(block_dk, dk_last[..., keys, :])}. "
            "dS = P * (grad_out @ v^T - D), D = rowsum(grad_out * out) with the finished out; "
            "dk = dS^T @ q * scale"
        )
        total_dq = total_dq + block_dq
    assert _close(total_dq, dq[..., last, :]), (
        f"the last chunk's dq summed over its 3 key blocks differs from scaled_dot_product_"
        f"attention's ({gap(total_dq, dq[..., last, :])}): dq = dS @ k * scale, each block "
        "adding its share"
    )


def _grads_rank(rank, world_size, layout_name, length, causal):
    kata = load_kata(KATA)
    return _watched_ring(kata, LAYOUTS[layout_name](world_size), length, causal, grad=True)


def _grads_world(world_size, layout_name, length, causal):
    return _world(_grads_rank, world_size, layout_name, length, causal)


_grads = shared_run(_grads_world)
GRAD_CASES = [
    pytest.param(2, "balanced", True, id="2-ranks-balanced"),
    pytest.param(4, "balanced", True, id="4-ranks-balanced"),
    pytest.param(4, "naive", True, id="4-ranks-naive"),
    pytest.param(3, "naive", False, id="3-ranks-full"),
]


@pytest.mark.step(5)
@pytest.mark.parametrize("world_size, layout_name, causal", GRAD_CASES[1:2])
def test_ring_backward_sends_the_gradients_home(kata, world_size, layout_name, causal):
    by_rank = _grads(world_size, layout_name, 16 * world_size, causal)
    backward = [{**r, "calls": r["calls"][r["forward_calls"] :]} for r in by_rank]
    _check_ring_traffic(backward, world_size, "ring_attention's backward", extra_hops=world_size)


@pytest.mark.step(5)
@pytest.mark.parametrize("world_size, layout_name, causal", GRAD_CASES)
def test_ring_backward_equals_one_process(kata, world_size, layout_name, causal):
    length = 16 * world_size
    layout = LAYOUTS[layout_name](world_size)
    by_rank = _grads(world_size, layout_name, length, causal)
    q, k, v, g = _tensors(length)
    want_out, want = _sdpa_grads(q, k, v, g, causal)
    shards = [[_shard(t, layout, r) for r in range(world_size)] for t in want]
    for rank, result in enumerate(by_rank):
        rows = _rows(layout, rank, length)
        assert _close(result["out"], want_out[..., rows, :]), (
            f"rank {rank}: ring_attention's output differs from one process "
            f"({gap(result['out'], want_out[..., rows, :])})"
        )
        grads = result["grads"]
        assert all(t is not None for t in grads), (
            f"rank {rank}: q, k or v got no gradient through ring_attention: return (dq, dk, dv, "
            "None, None) from backward"
        )
        dq, dk, dv = grads
        assert _close(dq, shards[0][rank]), (
            f"rank {rank}: dq of its rows differs from one process's ({gap(dq, shards[0][rank])}): "
            "each block this rank computed adds to dq of its own queries"
        )
        for name, got, theirs in (("dk", dk, shards[1]), ("dv", dv, shards[2])):
            if _close(got, theirs[rank]):
                continue
            owner = next((r for r in range(world_size) if _close(got, theirs[r])), None)
            if owner is not None:
                raise AssertionError(
                    f"rank {rank} ended with {name} of rank {owner}'s keys: the gradients travel "
                    f"with their block and need N = {world_size} hops in all to come home (one "
                    "more after the last block is computed), to the right like the block"
                )
            raise AssertionError(
                f"rank {rank}: {name} of its keys differs from one process's "
                f"({gap(got, theirs[rank])}): every rank that attended to these keys adds its "
                f"share; the sum travels round the ring with the block and comes home. dq is "
                "right, so the shares are: are they carried along and added up, not kept where "
                "they were computed?"
            )


def _torch_ring_rank(rank, world_size, length, causal):
    """torch's own ring (the one context_parallel runs on CUDA, private:
    _templated_ring_attention and its backward) with torch's CPU attention kernel, and the
    kata's ring, on the same world and the same balanced shards."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    kata = load_kata(KATA)
    aten = torch.ops.aten
    cp.set_rotate_method("alltoall")  # the ring, not the default all-gather
    cp._cp_options.enable_load_balance = causal  # head-tail: chunks r and 2N - 1 - r
    cp._cp_options.convert_to_f32 = False  # merge in float64, as the kata's ring does here
    layout = _balanced(world_size) if causal else _naive(world_size)
    q, k, v, g = (_shard(t, layout, rank).contiguous() for t in _tensors(length))
    group = dist.group.WORLD
    out, lse = cp._templated_ring_attention(
        group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
        is_causal=causal, dropout_p=0.0,
    )  # fmt: skip
    torch_grads = cp._templated_ring_attention_backward(
        group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, g,
        "grad_out", q, k, v, out, lse, is_causal=causal, dropout_p=0.0,
    )[:3]  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mine = kata.ring_attention(*leaves, layout, causal)
    mine.backward(g)
    return {
        "out": (mine.detach(), out),
        "grads": [(a.grad, b) for a, b in zip(leaves, torch_grads)],
    }


@pytest.mark.step(5)
@pytest.mark.parametrize("world_size, causal", [(2, True), (4, True), (2, False)])
def test_ring_equals_torchs_own_ring_on_the_same_world(kata, world_size, causal):
    """torch's context_parallel refuses the CPU kernel (no sharding rule for it), but the ring
    it runs on CUDA takes any attention op that returns (out, lse): here with the CPU one."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    except ImportError as error:
        pytest.skip(f"this torch has no context-parallel ring to compare with ({error})")
    names = ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options")
    if not all(hasattr(cp, n) for n in names) or not hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
    ):
        pytest.skip("this torch's context-parallel ring (a private API) has moved")
    import inspect

    expected = {
        "_templated_ring_attention": ["group", "seq_dim", "op", "query", "key", "value"],
        "_templated_ring_attention_backward": ["group", "seq_dim", "op", "grad_out"],
    }
    for name, first in expected.items():
        if list(inspect.signature(getattr(cp, name)).parameters)[: len(first)] != first:
            pytest.skip(f"this torch's {name} (a private API) takes other arguments")
    by_rank = _world(_torch_ring_rank, world_size, 16 * world_size, causal)
    for rank, result in enumerate(by_rank):
        for name, (mine, theirs) in zip(
            ("output", "dq", "dk", "dv"), [result["out"], *result["grads"]]
        ):
            assert _close(mine, theirs), (
                f"rank {rank}: the {name} of ring_attention differs from torch's own ring's on "
                f"the same {world_size} ranks and shards ({gap(mine, theirs)})"
            )


def _program_check(done):
    shown = streams(done)
    assert "both splits equal scaled_dot_product_attention" in done.stdout, shown
    assert "blocks per rank [3, 7]" in done.stdout and "blocks per rank [5, 5]" in done.stdout, (
        shown
    )


@pytest.mark.step(5)
def test_program_compares_both_splits(kata):
    _program_check(run_module_ok(KATA, "--world-size", "2", "--length", "32"))


# --------------------------------------------------------------------------- CUDA
# One GPU makes a world of one: NCCL needs a GPU per rank, and gloo moves CUDA tensors in
# all_reduce and broadcast only (no send or recv), so a ring of several ranks on one GPU has no
# backend. A world of one still runs every kernel, mask and buffer of the ring on the device.


def _cuda_rank(rank, world_size, length):
    device = rank_gpu()
    kata = load_kata(KATA)
    layout = _balanced(world_size)
    q, k, v, g = _tensors(length, device=device)
    shards = [_shard(t, layout, rank).contiguous() for t in (q, k, v, g)]
    leaves = [t.clone().requires_grad_() for t in shards[:3]]
    out = kata.ring_attention(*leaves, layout, True)
    out.backward(shards[3])
    return {"out": out.detach().cpu(), "grads": [t.grad.cpu() for t in leaves]}


@pytest.mark.step(5)
@pytest.mark.cuda
def test_ring_on_cuda_equals_one_process(kata):
    """The ring's tensors on the GPU (float64: the math, not a fused kernel), forward and
    backward, against scaled_dot_product_attention on the CPU."""
    length = 64
    by_rank = run_world(_cuda_rank, 1, length, **on_cuda(1, "nccl", deadline=120))
    q, k, v, g = _tensors(length)
    want_out, want = _sdpa_grads(q, k, v, g, True)
    result = by_rank[0]
    assert _close(result["out"], want_out), f"on CUDA: the output {gap(result['out'], want_out)}"
    for name, got, full in zip(("dq", "dk", "dv"), result["grads"], want):
        assert _close(got, full), f"on CUDA: {name} {gap(got, full)}"


def _context_parallel_rank(rank, world_size, length):
    """torch's context_parallel (its ring, on CUDA's own attention kernel) and the kata's ring,
    on the same world, the same inputs and the same balanced (head-tail) layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    device = rank_gpu()
    kata = load_kata(KATA)
    mesh = init_device_mesh("cuda", (world_size,))
    q, k, v, g = (t.float() for t in _tensors(length, device=device))
    layout = _balanced(world_size)
    mine = [_shard(t, layout, rank).contiguous().requires_grad_() for t in (q, k, v)]
    out = kata.ring_attention(*mine, layout, True)
    out.backward(_shard(g, layout, rank).contiguous())
    set_rotate_method("alltoall")  # the ring: each rank's keys and values passed to the next
    theirs = [t.clone() for t in (q, k, v, g)]
    with context_parallel(mesh, buffers=theirs, buffer_seq_dims=[2, 2, 2, 2]):
        leaves = [t.detach().clone().requires_grad_() for t in theirs[:3]]
        torch_out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        torch_out.backward(theirs[3])
    return {
        "out": (out.detach().cpu(), torch_out.detach().cpu()),
        "grads": [(a.grad.cpu(), b.grad.cpu()) for a, b in zip(mine, leaves)],
    }


@pytest.mark.step(5)
@pytest.mark.cuda
def test_ring_against_torchs_context_parallel_on_cuda(kata):
    """torch's context_parallel on CUDA, the same world and shards: the same rows and gradients
    (its kernel computes in float32: a float32 tolerance)."""
    by_rank = run_world(_context_parallel_rank, 1, 64, **on_cuda(1, "nccl", deadline=120))
    for rank, result in enumerate(by_rank):
        mine, theirs = result["out"]
        assert torch.allclose(mine, theirs, rtol=1e-3, atol=1e-4), (
            f"rank {rank}: the output against context_parallel's: largest difference "
            f"{(mine - theirs).abs().max().item():.3g}"
        )
        for name, (a, b) in zip(("dq", "dk", "dv"), result["grads"]):
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), (
                f"rank {rank}: {name} against context_parallel's: largest difference "
                f"{(a - b).abs().max().item():.3g}"
            )
