"""k35's mistakes catalogue: real mistakes in the re-shards, their backward, the attention and the
byte counts, and right answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what
each list promises.

Each entry differs from the reference in the one function it replaces; the others call the
reference's functions through the module, as a learner's would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from dojo.dev.mistakes import Mistake, RightAnswer


def _kata():
    from dojo.harness.impl import load_kata

    return load_kata("k35_ulysses")


def _check(heads: int, size: int) -> None:
    if heads % size:
        raise ValueError(f"{heads} heads do not split over {size} ranks: use a multiple of {size}")


def _a2a(pieces: torch.Tensor, group) -> torch.Tensor:
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group)
    return received


# --------------------------------------------------------------------------- scatter_heads


def scatter_cuts_the_batch(x, group=None):
    size = dist.get_world_size(group)
    batch, heads, tokens, dim = x.shape
    _check(heads, size)
    # reshape straight to (N, ...): with a batch of 2 the first cut is along the batch
    received = _a2a(x.contiguous().reshape(size, -1), group)
    received = received.reshape(size, batch, heads // size, tokens, dim)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * tokens, dim)


def scatter_strided_heads(x, group=None):
    size = dist.get_world_size(group)
    batch, heads, tokens, dim = x.shape
    _check(heads, size)
    # heads r, r + N, ...: rank r gets every N-th head
    pieces = x.reshape(batch, heads // size, size, tokens, dim).permute(2, 0, 1, 3, 4)
    received = _a2a(pieces.contiguous(), group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * tokens, dim)


def scatter_tokens_interleaved(x, group=None):
    size = dist.get_world_size(group)
    batch, heads, tokens, dim = x.shape
    _check(heads, size)
    pieces = x.reshape(batch, size, heads // size, tokens, dim).transpose(0, 1).contiguous()
    received = _a2a(pieces, group)
    # (B, H/N, s, N, D): token i of every rank before token i + 1 of any
    return received.permute(1, 2, 3, 0, 4).reshape(batch, heads // size, size * tokens, dim)


def scatter_by_all_gather(x, group=None):
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, heads, tokens, dim = x.shape
    _check(heads, size)
    gathered = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(gathered, x.contiguous(), group=group)  # every head of every rank's tokens
    share = heads // size
    return torch.cat([g[:, rank * share : (rank + 1) * share] for g in gathered], dim=2)


def scatter_on_the_world(x, group=None):
    size = dist.get_world_size()  # the group forgotten: the world's size and all-to-all
    batch, heads, tokens, dim = x.shape
    _check(heads, size)
    pieces = x.reshape(batch, size, heads // size, tokens, dim).transpose(0, 1).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * tokens, dim)


def scatter_drops_the_extra_heads(x, group=None):
    size = dist.get_world_size(group)
    batch, heads, tokens, dim = x.shape
    share = heads // size  # 6 heads on 4 ranks: 1 each, 2 heads lost, no error
    pieces = x[:, : share * size].reshape(batch, size, share, tokens, dim).transpose(0, 1)
    received = _a2a(pieces.contiguous(), group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, share, size * tokens, dim)


def scatter_checks_after_sending(x, group=None):
    size = dist.get_world_size(group)
    batch, heads, tokens, dim = x.shape
    if heads % size:
        dist.barrier(group=group)  # "let every rank reach the error together"
        _check(heads, size)
    pieces = x.reshape(batch, size, heads // size, tokens, dim).transpose(0, 1).contiguous()
    received = _a2a(pieces, group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * tokens, dim)


def scatter_with_lists(x, group=None):
    size = dist.get_world_size(group)
    batch, heads, tokens, dim = x.shape
    _check(heads, size)
    outputs = [torch.empty_like(c) for c in x.chunk(size, dim=1)]
    dist.all_to_all(outputs, [c.contiguous() for c in x.chunk(size, dim=1)], group=group)
    return torch.cat(outputs, dim=2)


def scatter_with_movedim(x, group=None):
    size = dist.get_world_size(group)
    _check(x.shape[1], size)
    pieces = x.unflatten(1, (size, -1)).movedim(1, 0).contiguous()
    return _a2a(pieces, group).movedim(0, 2).flatten(2, 3)


# --------------------------------------------------------------------------- gather_heads


def gather_heads_reversed(y, group=None):
    size = dist.get_world_size(group)
    batch, heads, length, dim = y.shape
    pieces = y.reshape(batch, heads, size, length // size, dim).permute(2, 0, 1, 3, 4)
    received = _a2a(pieces.contiguous(), group).flip(0)  # the ranks' heads last to first
    return received.transpose(0, 1).reshape(batch, size * heads, length // size, dim)


# --------------------------------------------------------------------------- the Functions


class ScatterHeadsAveraged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _kata().scatter_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        # "every rank took part": averaged as DDP averages
        return _kata().gather_heads(grad, ctx.group) / dist.get_world_size(ctx.group), None


class ScatterHeadsIdentityBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _kata().scatter_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # "communication needs no gradient"


class GatherHeadsScattersAgain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _kata().gather_heads(y, group)

    @staticmethod
    def backward(ctx, grad):
        # the gradient of the re-shard taken as the same re-shard
        return _kata().gather_heads(grad.contiguous(), ctx.group), None


class GatherHeadsSummed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _kata().gather_heads(y, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # "sum the gradient over the ranks"
        return _kata().scatter_heads(grad, ctx.group), None


class ScatterHeadsTorchAutograd(torch.autograd.Function):
    """Right: backward written with all_to_all_single itself, the pieces sent back by hand."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.shape = group, x.shape
        return _kata().scatter_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        batch, heads, tokens, dim = ctx.shape
        pieces = grad.reshape(batch, heads // size, size, tokens, dim).movedim(2, 0)
        back = _a2a(pieces.contiguous(), ctx.group)  # piece j back to rank j
        return back.movedim(0, 1).reshape(ctx.shape), None


# --------------------------------------------------------------------------- ulysses_attention


def attention_on_own_tokens(q, k, v, causal=True, group=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # no re-shard at all


def attention_ignores_causal(q, k, v, causal=True, group=None):
    kata = _kata()
    heads = [kata.ScatterHeads.apply(t, group) for t in (q, k, v)]
    return kata.GatherHeads.apply(F.scaled_dot_product_attention(*heads), group)


def attention_scales_twice(q, k, v, causal=True, group=None):
    kata = _kata()
    q = q * q.shape[-1] ** -0.5  # scaled by hand, and again by the attention
    heads = [kata.ScatterHeads.apply(t, group) for t in (q, k, v)]
    return kata.GatherHeads.apply(F.scaled_dot_product_attention(*heads, is_causal=causal), group)


def attention_returns_head_shard(q, k, v, causal=True, group=None):
    kata = _kata()
    heads = [kata.ScatterHeads.apply(t, group) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*heads, is_causal=causal)  # never gathered back


def attention_with_plain_functions(q, k, v, causal=True, group=None):
    kata = _kata()
    heads = [kata.scatter_heads(t, group) for t in (q, k, v)]  # autograd does not see these
    return kata.gather_heads(F.scaled_dot_product_attention(*heads, is_causal=causal), group)


def attention_in_float32(q, k, v, causal=True, group=None):
    kata = _kata()
    heads = [kata.ScatterHeads.apply(t.float(), group) for t in (q, k, v)]  # "faster"
    return kata.GatherHeads.apply(F.scaled_dot_product_attention(*heads, is_causal=causal), group)


class _GatherKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        size = dist.get_world_size()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(), dist.get_rank()
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad.chunk(size, dim=2)[rank].contiguous()


def attention_gathers_keys(q, k, v, causal=True, group=None):
    """k and v all-gathered along the sequence, q re-sharded: right values, too many bytes."""
    kata = _kata()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    share = q.shape[1] // size
    keys = [_GatherKeys.apply(t)[:, rank * share : (rank + 1) * share] for t in (k, v)]
    out = F.scaled_dot_product_attention(kata.ScatterHeads.apply(q, group), *keys, is_causal=causal)
    return kata.GatherHeads.apply(out, group)


def attention_fused_qkv(q, k, v, causal=True, group=None):
    """Right: q, k and v re-sharded together, one all-to-all of three times the bytes."""
    kata = _kata()
    if not q.shape == k.shape == v.shape:
        raise ValueError("q, k and v must be shaped alike")
    _check(q.shape[1], dist.get_world_size(group))
    size, heads = dist.get_world_size(group), q.shape[1]
    # (B, N, 3, H/N, s, D): each rank's piece holds its heads of q, k and v
    packed = torch.stack([t.unflatten(1, (size, heads // size)) for t in (q, k, v)], dim=2)
    moved = kata.ScatterHeads.apply(packed.flatten(1, 3), group)
    qh, kh, vh = moved.unflatten(1, (3, heads // size)).unbind(1)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    return kata.GatherHeads.apply(out, group)


def attention_by_hand(q, k, v, causal=True, group=None):
    """Right: the softmax written out, in the head shard."""
    kata = _kata()
    if not q.shape == k.shape == v.shape:
        raise ValueError("q, k and v must be shaped alike")
    qh, kh, vh = (kata.ScatterHeads.apply(t, group) for t in (q, k, v))
    scores = qh @ kh.transpose(-2, -1) / qh.shape[-1] ** 0.5
    if causal:
        length = scores.shape[-1]
        hidden = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return kata.GatherHeads.apply(torch.softmax(scores, dim=-1) @ vh, group)


# --------------------------------------------------------------------------- bytes_per_rank


def _shard(way, shape, n, element_size):
    if way not in ("ulysses", "ring", "all-gather"):
        raise ValueError(f"unknown way {way!r}")
    batch, heads, length, dim = shape
    if length % n or (way == "ulysses" and heads % n):
        raise ValueError(f"{shape} does not split over {n} ranks")
    return batch * heads * (length // n) * dim * element_size


def bytes_keeps_no_piece(way, shape, world_size, element_size=4):
    b, n = _shard(way, shape, world_size, element_size), world_size
    if way == "ulysses":
        return 4 * b, 4 * b  # the whole local tensor counted as sent
    return _kata_bytes(way, shape, n, element_size)


def bytes_forgets_the_output(way, shape, world_size, element_size=4):
    b, n = _shard(way, shape, world_size, element_size), world_size
    if way == "ulysses":
        return 3 * b * (n - 1) // n, 4 * b * (n - 1) // n  # q, k, v only
    return _kata_bytes(way, shape, n, element_size)


def bytes_ring_gradients_n_minus_1_hops(way, shape, world_size, element_size=4):
    b, n = _shard(way, shape, world_size, element_size), world_size
    if way == "ring":
        return 2 * (n - 1) * b, 4 * (n - 1) * b  # dk, dv as many hops as the keys
    return _kata_bytes(way, shape, n, element_size)


def bytes_all_gather_like_all_to_all(way, shape, world_size, element_size=4):
    b, n = _shard(way, shape, world_size, element_size), world_size
    if way == "all-gather":
        return 2 * b * (n - 1) // n, 2 * b * (n - 1) // n  # sent as an all-to-all would
    return _kata_bytes(way, shape, n, element_size)


def bytes_ignore_element_size(way, shape, world_size, element_size=4):
    return _kata_bytes(way, shape, world_size, 4)  # "float32, always"


def _kata_bytes(way, shape, world_size, element_size):
    b, n = _shard(way, shape, world_size, element_size), world_size
    if way == "ulysses":
        return 4 * b * (n - 1) // n, 4 * b * (n - 1) // n
    if way == "ring":
        return 2 * (n - 1) * b, 2 * (n - 1) * b + 2 * n * b
    return 2 * (n - 1) * b, 2 * (n - 1) * b


def bytes_from_the_whole_tensor(way, shape, world_size, element_size=4):
    """Right: counted from M, the whole tensor's bytes, with fractions."""
    from fractions import Fraction

    _shard(way, shape, world_size, element_size)
    n = world_size
    whole = Fraction(shape[0] * shape[1] * shape[2] * shape[3] * element_size)
    per = {
        "ulysses": (4 * whole * (n - 1) / n / n, 4 * whole * (n - 1) / n / n),
        "ring": (2 * whole * (n - 1) / n, (4 * n - 2) * whole / n),
        "all-gather": (2 * whole * (n - 1) / n, 2 * whole * (n - 1) / n),
    }[way]
    return int(per[0]), int(per[1])


MISTAKES = [
    # scatter_heads
    Mistake(
        "scatter_cuts_the_batch",
        replaces="scatter_heads",
        fails=["test_scatter_heads_gives_each_rank_the_whole_sequence_of_its_heads"],
        says=["mixed the batch rows", "cut along the batch"],
    ),
    Mistake(
        "scatter_strided_heads",
        replaces="scatter_heads",
        fails=["test_scatter_heads_gives_each_rank_the_whole_sequence_of_its_heads"],
        says=["The rule here", "contiguous heads"],
    ),
    Mistake(
        "scatter_tokens_interleaved",
        replaces="scatter_heads",
        fails=["test_scatter_heads_gives_each_rank_the_whole_sequence_of_its_heads"],
        says=["holds the tokens in the order", "end to end in rank order"],
    ),
    Mistake(
        "scatter_by_all_gather",
        replaces="scatter_heads",
        fails=["test_scatter_heads_is_one_all_to_all"],
        says=["called all_gather", "an all-gather sends this rank's whole tensor"],
    ),
    Mistake(
        "scatter_on_the_world",
        replaces="scatter_heads",
        fails=["test_scatter_heads_is_one_all_to_all[pairs-0-1-and-2-3]"],
        says=["another group than the one it was given"],
    ),
    Mistake(
        "scatter_drops_the_extra_heads",
        replaces="scatter_heads",
        fails=["test_scatter_heads_refuses_heads_that_do_not_split"],
        says=["6 heads on 4 ranks returned", "Raise a ValueError"],
    ),
    Mistake(
        "scatter_checks_after_sending",
        replaces="scatter_heads",
        fails=["test_scatter_heads_refuses_heads_that_do_not_split"],
        says=["called barrier before refusing", "before any communication"],
    ),
    # gather_heads
    Mistake(
        "gather_heads_reversed",
        replaces="gather_heads",
        fails=["test_gather_heads_gives_each_rank_its_tokens_back"],
        says=["gather_heads gave it heads", "must undo scatter_heads"],
    ),
    # the Functions
    Mistake(
        "ScatterHeadsAveraged",
        replaces="ScatterHeads",
        fails=[
            "test_each_function_sends_the_gradient_back_where_it_came_from[2-ranks-ScatterHeads]",
            "test_each_function_sends_the_gradient_back_where_it_came_from[pairs-0-1-and-2-3-ScatterHeads]",
        ],
        says=["divided by N", "nothing is summed or averaged"],
    ),
    Mistake(
        "ScatterHeadsIdentityBackward",
        replaces="ScatterHeads",
        fails=[
            "test_each_function_sends_the_gradient_back_where_it_came_from[2-ranks-ScatterHeads]",
            "test_each_function_sends_the_gradient_back_where_it_came_from[pairs-0-1-and-2-3-ScatterHeads]",
        ],
        says=["ScatterHeads.backward failed", "goes back where it came from"],
    ),
    Mistake(
        "GatherHeadsScattersAgain",
        replaces="GatherHeads",
        fails=[
            "test_each_function_sends_the_gradient_back_where_it_came_from[2-ranks-GatherHeads]",
            "test_each_function_sends_the_gradient_back_where_it_came_from[pairs-0-1-and-2-3-GatherHeads]",
        ],
        says=["GatherHeads.backward failed", "scatter_heads, the inverse all-to-all"],
    ),
    Mistake(
        "GatherHeadsSummed",
        replaces="GatherHeads",
        fails=[
            "test_each_function_sends_the_gradient_back_where_it_came_from[2-ranks-GatherHeads]",
            "test_each_function_sends_the_gradient_back_where_it_came_from[pairs-0-1-and-2-3-GatherHeads]",
        ],
        says=["GatherHeads.backward called all_reduce", "nothing is summed"],
    ),
    # ulysses_attention
    Mistake(
        "attention_on_own_tokens",
        replaces="ulysses_attention",
        fails=["test_ulysses_attention_equals_one_process"],
        says=["over its OWN tokens only", "re-shard q, k and v by heads"],
    ),
    Mistake(
        "attention_ignores_causal",
        replaces="ulysses_attention",
        fails=["test_ulysses_attention_equals_one_process[2-ranks-causal]"],
        says=["the full attention, expected the causal", "is_causal=causal"],
    ),
    Mistake(
        "attention_scales_twice",
        replaces="ulysses_attention",
        fails=["test_ulysses_attention_equals_one_process"],
        says=["scale was applied twice"],
    ),
    Mistake(
        "attention_returns_head_shard",
        replaces="ulysses_attention",
        fails=["test_ulysses_attention_equals_one_process"],
        says=["returned a head shard", "GatherHeads"],
    ),
    Mistake(
        "attention_with_plain_functions",
        replaces="ulysses_attention",
        fails=["test_ulysses_attention_gradients_equal_one_process"],
        says=["has no grad_fn", "ScatterHeads.apply"],
    ),
    Mistake(
        "attention_in_float32",
        replaces="ulysses_attention",
        fails=["test_ulysses_attention_equals_one_process"],
        says=["returned torch.float32 for torch.float64 inputs", "keep q's dtype"],
    ),
    Mistake(
        "attention_gathers_keys",
        replaces="ulysses_attention",
        fails=["test_ulysses_attention_moves_q_k_v_and_the_output_by_all_to_all"],
        says=["called all_gather", "by all-to-all only"],
    ),
    # bytes_per_rank
    Mistake(
        "bytes_keeps_no_piece",
        replaces="bytes_per_rank",
        fails=["test_bytes_per_rank_counts_each_way[ulysses]"],
        says=["keeps its own piece"],
    ),
    Mistake(
        "bytes_forgets_the_output",
        replaces="bytes_per_rank",
        fails=["test_bytes_per_rank_counts_each_way[ulysses]"],
        says=["4 all-to-alls (q, k, v and the output)"],
    ),
    Mistake(
        "bytes_ring_gradients_n_minus_1_hops",
        replaces="bytes_per_rank",
        fails=["test_bytes_per_rank_counts_each_way[ring]"],
        says=["dk, dv travel with them", "N hops"],
    ),
    Mistake(
        "bytes_all_gather_like_all_to_all",
        replaces="bytes_per_rank",
        fails=["test_bytes_per_rank_counts_each_way[all-gather]"],
        says=["to each of the N - 1 others"],
    ),
    Mistake(
        "bytes_ignore_element_size",
        replaces="bytes_per_rank",
        fails=["test_bytes_per_rank_counts_each_way"],
        says=["use element_size (8)"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("scatter_with_lists", replaces="scatter_heads"),
    RightAnswer("scatter_with_movedim", replaces="scatter_heads"),
    RightAnswer("ScatterHeadsTorchAutograd", replaces="ScatterHeads"),
    RightAnswer("attention_fused_qkv", replaces="ulysses_attention"),
    RightAnswer("attention_by_hand", replaces="ulysses_attention"),
    RightAnswer("bytes_from_the_whole_tensor", replaces="bytes_per_rank"),
]
