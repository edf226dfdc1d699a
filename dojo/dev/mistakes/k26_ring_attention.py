"""k26's mistakes catalogue: real mistakes in the merge, one block's attention, the ring, the split
and the backward, and right answers written another way. See ``dojo/dev/mistakes/__init__.py`` for
what each list promises.

Each entry differs from the reference in the one function it replaces; the rings call the
reference's helpers (``_check_layout``, ``_by_chunk``, ``attend_block``, ...) through the module,
so the spec's watch on ``attend_block`` sees them as it sees a learner's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dojo.dev.mistakes import Mistake, RightAnswer


def _kata():
    from dojo.harness.impl import load_kata

    return load_kata("k26_ring_attention")


# --------------------------------------------------------------------------- merge_partials


def _checked(out_a, lse_a, out_b, lse_b):
    kata = _kata()
    kata._check_partial(out_a, lse_a, "a")
    kata._check_partial(out_b, lse_b, "b")
    if out_a.shape != out_b.shape:
        raise ValueError(f"the partials hold different rows: {out_a.shape} and {out_b.shape}")


def merge_sums_the_outs(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)  # each part is normalised already


def merge_averages_the_outs(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_keeps_the_larger_lse(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    top = torch.maximum(lse_a, lse_b)  # "the running max" taken for the log-sum-exp itself
    out = out_a * torch.exp(lse_a - top).unsqueeze(-1) + out_b * torch.exp(lse_b - top).unsqueeze(
        -1
    )
    return out, top


def merge_adds_the_lses(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    lse = lse_a + lse_b  # log(a) + log(b) taken for log(a + b)
    out = out_a * torch.exp(lse_a - torch.logaddexp(lse_a, lse_b)).unsqueeze(-1)
    out = out + out_b * torch.exp(lse_b - torch.logaddexp(lse_a, lse_b)).unsqueeze(-1)
    return out, lse


def merge_exponentiates_the_lses(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    mass_a, mass_b = torch.exp(lse_a), torch.exp(lse_b)  # e^1002 is inf
    total = mass_a + mass_b
    out = out_a * (mass_a / total).unsqueeze(-1) + out_b * (mass_b / total).unsqueeze(-1)
    return out, torch.log(total)


def merge_weights_not_unsqueezed(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    seen = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    # (..., rows) against (..., rows, dim): broadcast along the features when rows == dim
    return out_a * torch.exp(lse_a - seen) + out_b * torch.exp(lse_b - seen), lse


def merge_nan_for_empty_rows(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    lse = torch.logaddexp(lse_a, lse_b)  # -inf where neither part saw a key: -inf - -inf = NaN
    share_a, share_b = torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)
    return out_a * share_a + out_b * share_b, lse


def merge_sigmoid_form(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    # the stable form of ring-flash-attention (torch's merger): right for finite lse's only
    out = out_a - torch.sigmoid(lse_b - lse_a).unsqueeze(-1) * (out_a - out_b)
    lse = lse_a - torch.nn.functional.logsigmoid(lse_a - lse_b)
    return out, lse


def merge_without_checks(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    seen = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    share_a = torch.exp(lse_a - seen)
    share_b = torch.exp(lse_b - seen)
    if share_a.dim() < out_a.dim():
        share_a, share_b = share_a.unsqueeze(-1), share_b.unsqueeze(-1)
    out = out_a * share_a
    return (out[..., : out_b.shape[-2], :] + out_b * share_b).to(out_a.dtype), lse


def merge_with_max_by_hand(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # no key yet: any finite
    mass_a, mass_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = mass_a + mass_b
    lse = top + torch.log(total)  # log(0) = -inf where neither part saw a key
    total = torch.where(total == 0, torch.ones_like(total), total)
    out = (out_a * mass_a.unsqueeze(-1) + out_b * mass_b.unsqueeze(-1)) / total.unsqueeze(-1)
    return out, lse


def merge_by_stacking(out_a, lse_a, out_b, lse_b):
    _checked(out_a, lse_a, out_b, lse_b)
    lses = torch.stack([lse_a, lse_b])
    lse = torch.logsumexp(lses, dim=0)  # -inf where both are
    shares = torch.exp(lses - lse.nan_to_num(neginf=0.0)).unsqueeze(-1)
    return (shares * torch.stack([out_a, out_b])).sum(dim=0), lse


# --------------------------------------------------------------------------- block_mask


def mask_later_chunks_full(query_chunk, key_chunk, causal):
    if not causal or key_chunk != query_chunk:
        return "full"  # "only the diagonal is masked"
    return "causal"


def mask_diagonal_full(query_chunk, key_chunk, causal):
    if not causal or key_chunk <= query_chunk:
        return "full"  # the chunk against itself taken as seen whole
    return None


# --------------------------------------------------------------------------- attend_block


def _fits(q, k, v, causal):
    if k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1] or q.shape[:-2] != k.shape[:-2]:
        raise ValueError("q, k and v do not fit")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError("a causal block needs as many queries as keys")


def _attend(q, k, v, causal, scale, hidden_from=1, lse_scale=None):
    scores = q @ k.transpose(-2, -1)
    if causal:
        hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(hidden_from)
        if hidden_from < 0:
            hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(hidden_from)
    else:
        hidden = None
    scaled = scores * scale
    if hidden is not None:
        scaled = scaled.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scaled, dim=-1)
    out = torch.exp(scaled - lse.unsqueeze(-1)) @ v
    if lse_scale is not None:
        raw = scores * lse_scale
        if hidden is not None:
            raw = raw.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(raw, dim=-1)
    return out, lse


def attend_without_scale(q, k, v, causal):
    _fits(q, k, v, causal)
    return _attend(q, k, v, causal, 1.0)


def attend_scaled_by_dim(q, k, v, causal):
    _fits(q, k, v, causal)
    return _attend(q, k, v, causal, 1.0 / q.shape[-1])


def attend_hides_the_diagonal(q, k, v, causal):
    _fits(q, k, v, causal)
    return _attend(q, k, v, causal, q.shape[-1] ** -0.5, hidden_from=0)  # triu(0): itself too


def attend_mask_the_wrong_way(q, k, v, causal):
    _fits(q, k, v, causal)
    return _attend(q, k, v, causal, q.shape[-1] ** -0.5, hidden_from=-1)  # hides the past


def attend_lse_of_unscaled_scores(q, k, v, causal):
    _fits(q, k, v, causal)
    return _attend(q, k, v, causal, q.shape[-1] ** -0.5, lse_scale=1.0)


def attend_lse_is_the_row_max(q, k, v, causal):
    _fits(q, k, v, causal)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    top = scores.amax(dim=-1)  # the max subtracted for stability, returned as the "lse"
    return torch.softmax(scores, dim=-1) @ v, top


def attend_ignores_causal(q, k, v, causal):
    _fits(q, k, v, causal)
    return _attend(q, k, v, False, q.shape[-1] ** -0.5)


def attend_without_checks(q, k, v, causal):
    return _attend(q, k, v, causal, q.shape[-1] ** -0.5)


def attend_with_softmax(q, k, v, causal):
    _fits(q, k, v, causal)
    scores = torch.einsum("...qd,...kd->...qk", q, k) / q.shape[-1] ** 0.5
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


# --------------------------------------------------------------------------- ring_attention_forward


def _ring(q, k, v, layout, causal, *, order="overlap", source_of=None, merge=True, masks=None,
          hops=None, receive_from=None, blocking_send=False, chunk_numbers=None,
          checks=True):  # fmt: skip
    """The reference ring with one thing changed (each mistake below names which)."""
    kata = _kata()
    rank, world = dist.get_rank(), dist.get_world_size()
    if checks:
        per_rank = kata._check_layout(layout, world)
        kata._check_shards(q, k, v, per_rank)
    else:
        per_rank = len(layout[rank])  # an IndexError for a layout too short; nothing else
    right, left = (rank + 1) % world, (rank - 1) % world
    queries = kata._by_chunk(q, per_rank)
    keys, values = kata._by_chunk(k, per_rank), kata._by_chunk(v, per_rank)
    outs, lses = [None] * per_rank, [None] * per_rank
    hops = world - 1 if hops is None else hops
    left = left if receive_from is None else receive_from(rank, world)

    def exchange():
        coming = torch.empty_like(keys), torch.empty_like(values)
        if blocking_send:
            dist.send(keys, right)
            dist.send(values, right)
            dist.recv(coming[0], left)
            dist.recv(coming[1], left)
            return coming, []
        if order == "blocking-recv":
            requests = [dist.isend(keys, right), dist.isend(values, right)]
            dist.recv(coming[0], left)
            dist.recv(coming[1], left)
            return coming, requests
        return coming, [
            dist.isend(keys, right),
            dist.isend(values, right),
            dist.irecv(coming[0], left),
            dist.irecv(coming[1], left),
        ]

    for step in range(world):
        source = (rank - step) % world if source_of is None else source_of(rank, step, world)
        sending = step < hops
        if sending and order != "compute-first":
            coming, requests = exchange()
            if order == "wait-first":
                for request in requests:
                    request.wait()
                requests = []  # a gloo request waited twice waits for a second message
        with record_function(f"attend block {step}"):
            numbers = layout[source] if chunk_numbers is None else chunk_numbers(source)
            for i, query_chunk in enumerate(layout[rank]):
                for j, key_chunk in enumerate(numbers):
                    mask = (masks or kata.block_mask)(query_chunk, key_chunk, causal)
                    if mask is None:
                        continue
                    out, lse = kata.attend_block(queries[i], keys[j], values[j], mask == "causal")
                    if outs[i] is None or not merge:
                        outs[i], lses[i] = out, lse
                    else:
                        outs[i], lses[i] = kata.merge_partials(outs[i], lses[i], out, lse)
        if sending and order == "compute-first":
            coming, requests = exchange()
        if sending:
            for request in requests:
                request.wait()
            keys, values = coming
    return torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)


def ring_sends_blocking_first(q, k, v, layout, causal=True):
    return _ring(q, k, v, layout, causal, blocking_send=True)  # every rank sends, nobody receives


def ring_receives_from_the_right(q, k, v, layout, causal=True):
    return _ring(q, k, v, layout, causal, receive_from=lambda rank, world: (rank + 1) % world)


def ring_computes_then_exchanges(q, k, v, layout, causal=True):
    return _ring(q, k, v, layout, causal, order="compute-first")


def ring_waits_before_computing(q, k, v, layout, causal=True):
    return _ring(q, k, v, layout, causal, order="wait-first")


def ring_receives_blocking(q, k, v, layout, causal=True):
    return _ring(q, k, v, layout, causal, order="blocking-recv")


def ring_source_plus_step(q, k, v, layout, causal=True):
    return _ring(q, k, v, layout, causal, source_of=lambda rank, step, world: (rank + step) % world)


def ring_overwrites_instead_of_merging(q, k, v, layout, causal=True):
    return _ring(q, k, v, layout, causal, merge=False)


def ring_causal_on_every_block(q, k, v, layout, causal=True):
    def masks(a, b, causal):
        mask = _kata().block_mask(a, b, causal)
        return None if mask is None else ("causal" if causal else "full")

    return _ring(q, k, v, layout, causal, masks=masks)


def ring_computes_hidden_blocks(q, k, v, layout, causal=True):
    def masks(a, b, causal):
        return _kata().block_mask(a, b, causal) or "full"  # "skipping is an optimisation"

    return _ring(q, k, v, layout, causal, masks=masks)


def ring_sends_after_the_last_step(q, k, v, layout, causal=True):
    return _ring(q, k, v, layout, causal, hops=dist.get_world_size())


def ring_naive_chunk_numbers(q, k, v, layout, causal=True):
    # "rank s holds chunks 2s and 2s + 1": right for the naive layout only
    return _ring(q, k, v, layout, causal, chunk_numbers=lambda source: (2 * source, 2 * source + 1))


def ring_without_checks(q, k, v, layout, causal=True):
    return _ring(q, k, v, layout, causal, checks=False)


def ring_with_batched_calls(q, k, v, layout, causal=True):
    kata = _kata()
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = kata._check_layout(layout, world)
    size = kata._check_shards(q, k, v, per_rank)
    right, left = (rank + 1) % world, (rank - 1) % world
    # one message per hop: keys and values stacked
    block = torch.stack([k, v]).contiguous()
    running: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(world):
        source = (rank - step) % world
        requests = []
        if step < world - 1:
            coming = torch.empty_like(block)
            requests = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, block, right), dist.P2POp(dist.irecv, coming, left)]
            )
        for i, a in enumerate(layout[rank]):
            for j, b in enumerate(layout[source]):
                mask = kata.block_mask(a, b, causal)
                if mask is None:
                    continue
                rows, cols = slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size)
                part = kata.attend_block(
                    q[..., rows, :],
                    block[0][..., cols, :],
                    block[1][..., cols, :],
                    mask == "causal",
                )
                running[i] = part if i not in running else kata.merge_partials(*running[i], *part)
        for request in requests:
            request.wait()
        if step < world - 1:
            block = coming
    return (
        torch.cat([running[i][0] for i in range(per_rank)], dim=-2),
        torch.cat([running[i][1] for i in range(per_rank)], dim=-1),
    )


def ring_from_an_empty_start(q, k, v, layout, causal=True):
    kata = _kata()
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = kata._check_layout(layout, world)
    size = kata._check_shards(q, k, v, per_rank)
    out = torch.zeros_like(q)  # nothing seen yet: out 0, lse -inf, merged into as blocks come
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    k, v = k.contiguous(), v.contiguous()
    for step in range(world):
        source = (rank - step) % world
        if step < world - 1:
            next_k, next_v = torch.empty_like(k), torch.empty_like(v)
            requests = [
                dist.isend(k, (rank + 1) % world),
                dist.irecv(next_k, (rank - 1) % world),
                dist.isend(v, (rank + 1) % world),
                dist.irecv(next_v, (rank - 1) % world),
            ]
        for i, a in enumerate(layout[rank]):
            rows = slice(i * size, (i + 1) * size)
            for j, b in enumerate(layout[source]):
                mask = kata.block_mask(a, b, causal)
                if mask is not None:
                    cols = slice(j * size, (j + 1) * size)
                    part = kata.attend_block(
                        q[..., rows, :], k[..., cols, :], v[..., cols, :], mask == "causal"
                    )
                    out[..., rows, :], lse[..., rows] = kata.merge_partials(
                        out[..., rows, :], lse[..., rows], *part
                    )
        if step < world - 1:
            for request in requests:
                request.wait()
            k, v = next_k, next_v
    return out, lse


# --------------------------------------------------------------------------- the split


def layout_balanced_off_by_one(world_size, balanced):
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if balanced:
        return [(r, 2 * world_size - r) for r in range(world_size)]  # 2N - r: one past the end
    return [(2 * r, 2 * r + 1) for r in range(world_size)]


def layout_naive_strided(world_size, balanced):
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if balanced:
        return [(r, 2 * world_size - 1 - r) for r in range(world_size)]
    return [(r, r + world_size) for r in range(world_size)]  # "every N-th chunk"


def shard_contiguous_slice(x, layout, rank, dim=-2):
    _kata()._chunk_size(x.shape[dim], layout)
    return x.chunk(len(layout), dim=dim)[rank].contiguous()  # right for the naive layout only


def shard_without_check(x, layout, rank, dim=-2):
    size = x.shape[dim] // sum(len(c) for c in layout)  # 100 // 8: the last 4 tokens dropped
    return torch.cat([x.narrow(dim, c * size, size) for c in layout[rank]], dim=dim).contiguous()


def shard_says_too_little(x, layout, rank, dim=-2):
    chunks = sum(len(c) for c in layout)
    if x.shape[dim] % chunks:
        raise ValueError("the sequence does not divide")
    return shard_without_check(x, layout, rank, dim)


def unshard_in_rank_order(shards, layout, dim=-2):
    if len(shards) != len(layout):
        raise ValueError("a shard per rank")
    return torch.cat(shards, dim=dim)  # right for the naive layout only


def unshard_by_index(shards, layout, dim=-2):
    if len(shards) != len(layout):
        raise ValueError("a shard per rank")
    joined = torch.cat(shards, dim=dim)
    order = [c for chunks in layout for c in chunks]
    size = joined.shape[dim] // len(order)
    positions = torch.cat([torch.arange(c * size, (c + 1) * size) for c in order])
    return joined.index_select(dim % joined.dim(), torch.argsort(positions))


def blocks_ignore_the_mask(layout, causal=True):
    keys = sum(len(c) for c in layout)
    return [len(chunks) * keys for chunks in layout]


def blocks_without_the_diagonal(layout, causal=True):
    keys = [c for chunks in layout for c in chunks]
    return [sum(b < a or not causal for a in chunks for b in keys) for chunks in layout]


# --------------------------------------------------------------------------- block_gradients


def _scores(q, k, causal):
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def grads_with_the_blocks_own_softmax(q, k, v, out, lse, grad_out, causal):
    scale = q.shape[-1] ** -0.5
    p = torch.softmax(_scores(q, k, causal), dim=-1)  # this block's softmax, not the row's
    dv = p.transpose(-2, -1) @ grad_out
    ds = p * (grad_out @ v.transpose(-2, -1) - (grad_out * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def grads_without_the_row_term(q, k, v, out, lse, grad_out, causal):
    scale = q.shape[-1] ** -0.5
    p = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ grad_out
    ds = p * (grad_out @ v.transpose(-2, -1))  # the softmax's Jacobian has a second term
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def grads_without_the_scale(q, k, v, out, lse, grad_out, causal):
    p = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ grad_out
    ds = p * (grad_out @ v.transpose(-2, -1) - (grad_out * out).sum(-1, keepdim=True))
    return ds @ k, ds.transpose(-2, -1) @ q, dv  # the scores were scaled: so are their grads


def grads_by_autograd(q, k, v, out, lse, grad_out, causal):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        p = torch.exp(_scores(*leaves[:2], causal) - lse.unsqueeze(-1))
        part = p @ leaves[2]  # this block's term of the finished out
        # out = sum of the blocks' terms, and the loss's gradient through the normaliser
        # (lse) is the same -(grad_out * out) row term for every block:
        loss = (grad_out * part).sum() - ((grad_out * out).sum(-1).detach() * p.sum(-1)).sum()
        return torch.autograd.grad(loss, leaves)


# --------------------------------------------------------------------------- the backward


def _backward(ctx, grad_out, *, home_hops=None, direction=+1, keep_local=False, masks=None):
    kata = _kata()
    q, k, v, out, lse = ctx.saved_tensors
    layout, causal = ctx.layout, ctx.causal
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = len(layout[rank])
    right, left = (rank + 1) % world, (rank - 1) % world
    to, frm = (right, left) if direction > 0 else (left, right)
    queries, outs, grads = (kata._by_chunk(t, per_rank) for t in (q, out, grad_out))
    lses = kata._by_chunk(lse, per_rank, dim=-1)
    keys, values = kata._by_chunk(k, per_rank), kata._by_chunk(v, per_rank)
    dq = torch.zeros_like(queries)
    dk, dv = torch.zeros_like(keys), torch.zeros_like(values)
    home_hops = world if home_hops is None else home_hops
    for step in range(world):
        source = (rank - step) % world
        requests = []
        if step < world - 1:
            coming = torch.empty_like(keys), torch.empty_like(values)
            requests += [
                dist.isend(keys, right),
                dist.isend(values, right),
                dist.irecv(coming[0], left),
                dist.irecv(coming[1], left),
            ]
        passing = world > 1 and step < home_hops and not keep_local
        if passing:
            grads_coming = torch.empty_like(dk), torch.empty_like(dv)
            requests += [dist.irecv(grads_coming[0], frm), dist.irecv(grads_coming[1], frm)]
        for i, a in enumerate(layout[rank]):
            for j, b in enumerate(layout[source]):
                mask = (masks or kata.block_mask)(a, b, causal)
                if mask is None:
                    continue
                parts = kata.block_gradients(
                    queries[i], keys[j], values[j], outs[i], lses[i], grads[i], mask == "causal"
                )
                dq[i] += parts[0]
                dk[j if not keep_local else i] += parts[1]
                dv[j if not keep_local else i] += parts[2]
        if passing:
            requests += [dist.isend(dk, to), dist.isend(dv, to)]
        for request in requests:
            request.wait()
        if step < world - 1:
            keys, values = coming
        if passing:
            dk, dv = grads_coming
    return (
        torch.cat(list(dq), dim=-2),
        torch.cat(list(dk), dim=-2),
        torch.cat(list(dv), dim=-2),
        None,
        None,
    )


def _forward(ctx, q, k, v, layout, causal):
    """The reference's forward (the module's RingAttention is the swapped class itself)."""
    out, lse = _kata().ring_attention_forward(q, k, v, layout, causal)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.layout, ctx.causal = layout, causal
    return out


class BackwardOneHopShort(torch.autograd.Function):
    """dk and dv passed on N - 1 times, as the keys are: they end one rank short of home."""

    forward = staticmethod(_forward)
    backward = staticmethod(
        lambda ctx, grad_out: _backward(ctx, grad_out, home_hops=dist.get_world_size() - 1)
    )


class BackwardGradientsToTheLeft(torch.autograd.Function):
    """dk and dv sent against the blocks' direction: each rank's share lands on another block."""

    forward = staticmethod(_forward)
    backward = staticmethod(lambda ctx, grad_out: _backward(ctx, grad_out, direction=-1))


class BackwardKeepsGradientsLocal(torch.autograd.Function):
    """Every block's dk and dv added into this rank's own, never passed on."""

    forward = staticmethod(_forward)
    backward = staticmethod(lambda ctx, grad_out: _backward(ctx, grad_out, keep_local=True))


def _masks_no_causal(a, b, causal):
    mask = _kata().block_mask(a, b, causal)
    return None if mask is None else "full"


class BackwardForgetsTheDiagonalMask(torch.autograd.Function):
    """The diagonal block's gradients computed as if it were full."""

    forward = staticmethod(_forward)
    backward = staticmethod(lambda ctx, grad_out: _backward(ctx, grad_out, masks=_masks_no_causal))


class BackwardReturnsThreeGradients(torch.autograd.Function):
    """(dq, dk, dv) only: autograd wants one gradient (or None) per input of forward."""

    forward = staticmethod(_forward)
    backward = staticmethod(lambda ctx, grad_out: _backward(ctx, grad_out)[:3])


class BackwardBatched(torch.autograd.Function):
    """Right: keys, values and their gradients moved with batch_isend_irecv, one call a step."""

    forward = staticmethod(_forward)

    @staticmethod
    def backward(ctx, grad_out):
        kata = _kata()
        q, k, v, out, lse = ctx.saved_tensors
        layout, causal = ctx.layout, ctx.causal
        rank, world = dist.get_rank(), dist.get_world_size()
        size = q.shape[-2] // len(layout[rank])
        right, left = (rank + 1) % world, (rank - 1) % world
        dq = torch.zeros_like(q)
        block = torch.stack([k, v]).contiguous()
        grads = torch.zeros_like(block)  # dk and dv of the block held, stacked alike
        for step in range(world):
            source = (rank - step) % world
            for i, a in enumerate(layout[rank]):
                rows = slice(i * size, (i + 1) * size)
                for j, b in enumerate(layout[source]):
                    mask = kata.block_mask(a, b, causal)
                    if mask is None:
                        continue
                    cols = slice(j * size, (j + 1) * size)
                    parts = kata.block_gradients(
                        q[..., rows, :].contiguous(),
                        block[0][..., cols, :].contiguous(),
                        block[1][..., cols, :].contiguous(),
                        out[..., rows, :].contiguous(),
                        lse[..., rows].contiguous(),
                        grad_out[..., rows, :].contiguous(),
                        mask == "causal",
                    )
                    dq[..., rows, :] += parts[0]
                    grads[0][..., cols, :] += parts[1]
                    grads[1][..., cols, :] += parts[2]
            if world == 1:
                break
            ops, coming, grads_coming = [], torch.empty_like(block), torch.empty_like(grads)
            if step < world - 1:
                ops += [dist.P2POp(dist.isend, block, right), dist.P2POp(dist.irecv, coming, left)]
            ops += [
                dist.P2POp(dist.isend, grads, right),
                dist.P2POp(dist.irecv, grads_coming, left),
            ]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            block, grads = coming, grads_coming
        return dq, grads[0], grads[1], None, None


MISTAKES = [
    # merge_partials
    Mistake(
        "merge_sums_the_outs",
        replaces="merge_partials",
        fails=["test_merge_equals_the_softmax_over_both_parts"],
        says=["out_a + out_b", "e^(lse_x - lse)"],
    ),
    Mistake(
        "merge_averages_the_outs",
        replaces="merge_partials",
        fails=["test_merge_equals_the_softmax_over_both_parts"],
        says=["the mean of the two parts"],
    ),
    Mistake(
        "merge_keeps_the_larger_lse",
        replaces="merge_partials",
        fails=["test_merge_equals_the_softmax_over_both_parts"],
        says=["the larger of the two lse's", "torch.logaddexp"],
    ),
    Mistake(
        "merge_adds_the_lses",
        replaces="merge_partials",
        fails=["test_merge_equals_the_softmax_over_both_parts"],
        says=["lse_a + lse_b", "logs of sums do not add"],
    ),
    Mistake(
        "merge_exponentiates_the_lses",
        replaces="merge_partials",
        fails=["test_merge_survives_large_scores"],
        says=["e^1002 overflows", "Never exponentiate an lse itself"],
    ),
    Mistake(
        "merge_weights_not_unsqueezed",
        replaces="merge_partials",
        fails=[
            "test_merge_equals_the_softmax_over_both_parts",
            "test_merge_keeps_each_rows_own_weights",
        ],
        says=["unsqueeze(-1)"],
    ),  # fmt: skip
    Mistake(
        "merge_nan_for_empty_rows",
        replaces="merge_partials",
        fails=["test_merge_with_a_part_that_saw_no_key"],
        says=["gave NaN", "-inf - (-inf) is NaN"],
    ),
    Mistake(
        "merge_sigmoid_form",
        replaces="merge_partials",
        fails=["test_merge_with_a_part_that_saw_no_key"],
        says=["merging an empty part", "the empty part weighs nothing"],
    ),
    Mistake(
        "merge_without_checks",
        replaces="merge_partials",
        fails=["test_merge_refuses_partials_that_do_not_fit"],
        says=["raise ValueError saying which shapes do not fit"],
    ),
    # block_mask
    Mistake(
        "mask_later_chunks_full",
        replaces="block_mask",
        fails=["test_block_mask_for_each_pair_of_chunks"],
        says=["a later one not at all"],
    ),
    Mistake(
        "mask_diagonal_full",
        replaces="block_mask",
        fails=["test_block_mask_for_each_pair_of_chunks"],
        says=["is 'full', expected 'causal'"],
    ),
    # attend_block
    Mistake(
        "attend_without_scale",
        replaces="attend_block",
        fails=["test_attend_block_equals_scaled_dot_product_attention"],
        says=["no scale at all", "1 / sqrt(dim)"],
    ),
    Mistake(
        "attend_scaled_by_dim",
        replaces="attend_block",
        fails=["test_attend_block_equals_scaled_dot_product_attention"],
        says=["scaled by 1 / dim"],
    ),
    Mistake(
        "attend_hides_the_diagonal",
        replaces="attend_block",
        fails=["test_attend_block_equals_scaled_dot_product_attention[causal-diagonal]"],
        says=["NaNs", "itself included"],
    ),
    Mistake(
        "attend_mask_the_wrong_way",
        replaces="attend_block",
        fails=["test_attend_block_equals_scaled_dot_product_attention[causal-diagonal]"],
        says=["the mask is the wrong way round"],
    ),
    Mistake(
        "attend_lse_of_unscaled_scores",
        replaces="attend_block",
        fails=["test_attend_block_equals_scaled_dot_product_attention"],
        says=["UNSCALED scores"],
    ),
    Mistake(
        "attend_lse_is_the_row_max",
        replaces="attend_block",
        fails=["test_attend_block_equals_scaled_dot_product_attention"],
        says=["each row's largest score", "torch.logsumexp"],
    ),
    Mistake(
        "attend_ignores_causal",
        replaces="attend_block",
        fails=["test_attend_block_equals_scaled_dot_product_attention[causal-diagonal]"],
        says=["ignores the causal mask"],
    ),
    Mistake(
        "attend_without_checks",
        replaces="attend_block",
        fails=["test_attend_block_refuses_blocks_that_do_not_fit"],
        says=["raise ValueError saying what does not fit"],
    ),
    # ring_attention_forward
    Mistake(
        "ring_sends_blocking_first",
        replaces="ring_attention_forward",
        fails=["test_ring_passes_keys_and_values_to_the_right"],
        says=["deadlock: rank(s)", "in a blocking dist.send or dist.recv"],
    ),
    Mistake(
        "ring_receives_from_the_right",
        replaces="ring_attention_forward",
        fails=["test_ring_passes_keys_and_values_to_the_right[4-ranks-causal]"],
        says=["deadlock: rank(s)", "receives from its left one, (rank - 1) % N"],
    ),
    Mistake(
        "ring_computes_then_exchanges",
        replaces="ring_attention_forward",
        fails=["test_ring_posts_the_next_block_before_computing_this_one"],
        says=["only after it began computing", "Post dist.irecv"],
    ),
    Mistake(
        "ring_waits_before_computing",
        replaces="ring_attention_forward",
        fails=["test_ring_posts_the_next_block_before_computing_this_one"],
        says=["waited for the next block", "request.wait() came before attend_block"],
    ),
    Mistake(
        "ring_receives_blocking",
        replaces="ring_attention_forward",
        fails=["test_ring_posts_the_next_block_before_computing_this_one"],
        says=["a blocking dist.recv"],
    ),
    Mistake(
        "ring_source_plus_step",
        replaces="ring_attention_forward",
        fails=["test_ring_attends_each_block_once_with_its_mask[4-ranks-causal]"],
        says=["(rank - step) % N"],
    ),
    Mistake(
        "ring_overwrites_instead_of_merging",
        replaces="ring_attention_forward",
        fails=["test_ring_forward_equals_one_process"],
        says=["merged into the running result", "not replacing it"],
    ),
    Mistake(
        "ring_causal_on_every_block",
        replaces="ring_attention_forward",
        fails=["test_ring_attends_each_block_once_with_its_mask[2-ranks-causal]"],
        says=["with causal=True, expected causal=False", "only a chunk against itself is causal"],
    ),
    Mistake(
        "ring_computes_hidden_blocks",
        replaces="ring_attention_forward",
        fails=["test_ring_attends_each_block_once_with_its_mask[2-ranks-causal]"],
        says=["hides entirely", "skip such a block"],
    ),
    Mistake(
        "ring_sends_after_the_last_step",
        replaces="ring_attention_forward",
        fails=["test_ring_passes_keys_and_values_to_the_right"],
        says=["none after the last step"],
    ),
    Mistake(
        "ring_naive_chunk_numbers",
        replaces="ring_attention_forward",
        fails=["test_the_ring_computes_the_blocks_counted[balanced]"],
        says=["read each block's chunk numbers from the layout"],
    ),
    Mistake(
        "ring_without_checks",
        replaces="ring_attention_forward",
        fails=["test_ring_refuses_a_layout_that_does_not_fit"],
        says=["raise ValueError saying what does not fit"],
    ),
    # the split
    Mistake(
        "layout_balanced_off_by_one",
        replaces="chunk_layout",
        fails=["test_chunk_layout_naive_and_balanced"],
        says=["chunk 2N - 1 - r from the back"],
    ),
    Mistake(
        "layout_naive_strided",
        replaces="chunk_layout",
        fails=["test_chunk_layout_naive_and_balanced[2]"],
        says=["one contiguous slice of the sequence"],
    ),
    Mistake(
        "shard_contiguous_slice",
        replaces="shard_sequence",
        fails=["test_shard_and_unshard_the_sequence[balanced]"],
        says=["take layout[rank]'s chunks in that order"],
    ),
    Mistake(
        "shard_without_check",
        replaces="shard_sequence",
        fails=["test_shard_refuses_a_sequence_that_does_not_cut_into_chunks"],
        says=["returned a shard", "pad the sequence to a multiple of 8"],
    ),
    Mistake(
        "shard_says_too_little",
        replaces="shard_sequence",
        fails=["test_shard_refuses_a_sequence_that_does_not_cut_into_chunks"],
        says=["name the length (100) and the number of chunks (8)"],
    ),
    Mistake(
        "unshard_in_rank_order",
        replaces="unshard_sequence",
        fails=["test_shard_and_unshard_the_sequence[balanced]"],
        says=["put each shard's chunks back at their places"],
    ),
    Mistake(
        "blocks_ignore_the_mask",
        replaces="blocks_per_rank",
        fails=["test_blocks_per_rank_naive_against_balanced"],
        says=["that the mask leaves anything of"],
    ),
    Mistake(
        "blocks_without_the_diagonal",
        replaces="blocks_per_rank",
        fails=["test_blocks_per_rank_naive_against_balanced"],
        says=["expected [3"],
    ),
    # block_gradients
    Mistake(
        "grads_with_the_blocks_own_softmax",
        replaces="block_gradients",
        fails=["test_block_gradients_add_up_to_the_whole"],
        says=["the probabilities of the WHOLE row"],
    ),
    Mistake(
        "grads_without_the_row_term",
        replaces="block_gradients",
        fails=["test_block_gradients_add_up_to_the_whole"],
        says=["D = rowsum(grad_out * out)"],
    ),
    Mistake(
        "grads_without_the_scale",
        replaces="block_gradients",
        fails=["test_block_gradients_add_up_to_the_whole"],
        says=["dk = dS^T @ q * scale"],
    ),
    # the backward's ring
    Mistake(
        "BackwardOneHopShort",
        replaces="RingAttention",
        fails=["test_ring_backward_sends_the_gradients_home"],
        says=["of their gradients"],
    ),
    Mistake(
        "BackwardGradientsToTheLeft",
        replaces="RingAttention",
        fails=["test_ring_backward_sends_the_gradients_home"],
        says=["sends to its right neighbour only"],
    ),
    Mistake(
        "BackwardKeepsGradientsLocal",
        replaces="RingAttention",
        fails=["test_ring_backward_sends_the_gradients_home"],
        says=["of their gradients"],
    ),
    Mistake(
        "BackwardForgetsTheDiagonalMask",
        replaces="RingAttention",
        fails=["test_ring_backward_equals_one_process[2-ranks-balanced]"],
        says=["dq of its rows differs"],
    ),
    Mistake(
        "BackwardReturnsThreeGradients",
        replaces="RingAttention",
        fails=["test_ring_backward_sends_the_gradients_home"],
        says=["incorrect number of gradients"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("merge_with_max_by_hand", replaces="merge_partials"),
    RightAnswer("merge_by_stacking", replaces="merge_partials"),
    RightAnswer("attend_with_softmax", replaces="attend_block"),
    RightAnswer("ring_with_batched_calls", replaces="ring_attention_forward"),
    RightAnswer("ring_from_an_empty_start", replaces="ring_attention_forward"),
    RightAnswer("unshard_by_index", replaces="unshard_sequence"),
    RightAnswer("grads_by_autograd", replaces="block_gradients"),
    RightAnswer("BackwardBatched", replaces="RingAttention", steps=(5,)),
]
