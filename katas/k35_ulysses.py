"""k35 · Ulysses: sequence parallel by all-to-all, the sequence re-sharded by heads.

THE IDEA
    Context parallelism (k26) splits the SEQUENCE over the ranks, and attention, the one layer
    where tokens meet, must bring every key to every query. The ring (k26) moves the keys and
    values round the ranks; DeepSpeed-Ulysses (Jacobs et al., 2023) changes what is split
    instead. Attention's heads are independent: a head needs the whole sequence, but only its
    own q, k and v. So before attention one ALL-TO-ALL re-shards q, k and v from "my tokens,
    every head" to "every token, my heads"; each rank runs plain attention (flash, causal or
    not) over the whole sequence for H/N heads; a second all-to-all brings the output back to
    "my tokens, every head" for the rest of the block:

        2 ranks, 4 heads (h0..h3), 8 tokens; rank r starts with tokens 4r..4r+3 of every head

              rank 0            rank 1                       rank 0           rank 1
        h0  [ t0..t3 ]        [ t4..t7 ]                h0  [ t0 .. t7 ]
        h1  [ t0..t3 ]        [ t4..t7 ]   all-to-all   h1  [ t0 .. t7 ]
        h2  [ t0..t3 ]        [ t4..t7 ]  ----------->  h2                   [ t0 .. t7 ]
        h3  [ t0..t3 ]        [ t4..t7 ]  (q, k, v)     h3                   [ t0 .. t7 ]
            (B, H, S/N, D): a sequence shard            (B, H/N, S, D): a head shard
                            <---------------------------  attention per head, then the
                              all-to-all (the output)     output's all-to-all back

    An all-to-all sends piece j of every rank's tensor to rank j: rank r cuts its tokens into N
    pieces by HEADS (heads jH/N..(j+1)H/N - 1 go to rank j) and receives from every rank j that
    rank's tokens of its own heads, which it lays end to end in rank order: the whole sequence.
    It keeps its own piece, so each all-to-all sends (N - 1)/N of the local tensor. Rank r
    holds heads rH/N..(r+1)H/N - 1, in order (as DeepSpeed and DTensor's Shard(1) place them).

    Backward is the same picture run the other way: the gradient of an all-to-all is the
    inverse all-to-all (each piece goes back to where it came from), so the pair is written as
    two autograd Functions, each the other's backward. Forward moves q, k, v and the output
    (4 all-to-alls), backward the output's gradient and dq, dk, dv (4 more).

    The price: the heads must divide by the ranks (H % N == 0; with grouped-query attention,
    the key/value heads too), so Ulysses stops at N = H; the ring and the all-gather do not.
    An all-to-all talks to every rank at once: it wants all-pairs bandwidth (NVLink inside a
    node); the ring talks to one neighbour, and hides its hops under compute.

    Bytes each rank sends, a whole q (B x H x S x D, e bytes each) of M bytes, b = M / N the
    local shard of one tensor; the three ways on the same shapes (step 4 measures them):

        way                      forward            backward            holds at once
        Ulysses (this kata)      4 (N-1)/N b        4 (N-1)/N b         q, k, v, out for H/N
          4 all-to-alls each                                            heads, the whole
                                                                        sequence (= b each)
        ring (k26)               2 (N-1) b          (4N - 2) b          2 blocks of k and v
          k, v: N-1 hops         (k and v)          (k, v N-1 hops,
                                                    dk, dv N)
        all-gather k, v (k25's   2 (N-1) b          2 (N-1) b           all of k and v
          gather; torch's                           (reduce-scatter     (2 N b)
          context_parallel                          dk, dv)
          "allgather")

        N = 4, b = 1 MB:  Ulysses 3 + 3 MB, ring 6 + 14 MB, all-gather 6 + 6 MB.
        N = 2:            Ulysses 2 + 2 MB, ring 2 + 6 MB,  all-gather 2 + 2 MB.

    When each wins. Ulysses sends (N-1)/N b per tensor whatever N: as N grows with the sequence
    (b fixed), its volume per rank stays flat while the ring's and the all-gather's grow with
    N. It wins inside a node (fast all-to-all) while N <= H (it cannot split a head). The ring
    wins across nodes and past N = H: it talks to one neighbour and hides each hop under a
    block's compute, but sends N/2 times Ulysses' bytes. All-gathering k and v is the simplest,
    one call, but holds the whole sequence's keys and values: for moderate N on a fast link.
    The two combine (USP, "unified sequence parallel"): Ulysses inside a node, the ring across.
    torch has no Ulysses in core (DTensor's Shard(2) -> Shard(1) redistribute is its
    all-to-all, but on CPU it falls back to an all-gather); DeepSpeed has it (DistributedAttention).

STEPS
    1. ``scatter_heads`` (a sequence shard to a head shard: one all-to-all, a ValueError before
       any communication when the heads do not divide) and ``gather_heads`` (the inverse).
    2. ``ScatterHeads`` and ``GatherHeads``: each an autograd Function whose backward is the
       other's all-to-all.
    3. ``ulysses_attention(q, k, v, causal)``: q, k and v to head shards, attention over the
       whole sequence, the output back: equal to one process, forward and backward.
    4. ``bytes_per_rank(way, shape, world_size, element_size)``: the bytes each rank sends
       forward and backward, Ulysses against k26's ring and k25's all-gathers.

WHAT THE TESTS CHECK
    By recording every rank's calls: that each re-shard is one all-to-all on the group, sending
    (N - 1)/N of the local tensor (no all-gather), with every rank's tokens of its heads in rank
    order (on 2 and 4 ranks, a batch of 2, in two subgroups of 2); that gather_heads undoes it;
    a ValueError naming the heads and the ranks before any call; each Function's gradient equal
    to the inverse re-shard, by one all-to-all; ulysses_attention's output and dq, dk, dv equal
    to F.scaled_dot_product_attention on one process (2 and 4 ranks, causal and not, float64,
    1e-10), its dtype kept, with 4 all-to-alls' bytes forward and 4 backward; your byte counts
    for Ulysses, the ring and the all-gather on 1 to 8 ranks, and against what each sends when
    measured on the same world and inputs (k26's ring_attention and k25's all-gather), all three
    equal to one process; and the program.

RUN IT
    .venv/bin/python -m katas.k35_ulysses --world-size 4
    .venv/bin/python -m katas.k35_ulysses --world-size 2 --heads 8 --length 512 --no-causal

    The program runs Ulysses, k26's ring and k25's all-gather of k and v on the same inputs,
    forward and backward, prints the bytes each rank sends each way and the largest gap of each
    to one process's scaled_dot_product_attention, and ends with the verdict on Ulysses.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn import functional as F

from dojo.console import run_program, say, verdict
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo

from .k25_sequence_parallel import gather_from_sequence_parallel_region
from .k26_ring_attention import chunk_layout, ring_attention

WAYS = ("ulysses", "ring", "all-gather")  # step 4's ways of attending over a split sequence

# --------------------------------------------------------------------------- step 1: re-shard


def scatter_heads(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A sequence shard ``(B, H, S/N, D)`` (this rank's tokens of every head) as a head shard
    ``(B, H/N, S, D)``: the whole sequence, rank order, for this rank's heads rH/N..(r+1)H/N-1.
    One all-to-all on ``group`` (None: the world); ValueError when H does not divide by N."""
    # TODO: a new tensor (B, H/N, S, D): for this rank's heads (rank r of the group: heads
    # r*H/N .. (r+1)*H/N - 1, in order), every rank's tokens laid end to end in the group's rank
    # order, by ONE all-to-all on the group. The tests record your calls: one all-to-all (no
    # all-gather) sending (N - 1)/N of x, on 2 and 4 ranks with a batch of 2, and in subgroups
    # [0, 1] and [2, 3]; x unchanged; and a ValueError naming the heads and the ranks, before
    # any communication, when the heads do not divide by the group's size (6 heads, 4 ranks).
    raise KataTodo("k35", 1, "the all-to-all from a sequence shard to a head shard, and back")


def gather_heads(y: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The inverse of ``scatter_heads``: a head shard ``(B, H/N, S, D)`` back as this rank's
    sequence shard ``(B, H, S/N, D)`` of every head. One all-to-all on ``group``."""
    # TODO: a new tensor (B, H, S/N, D): this rank's tokens (rank r: S/N*r .. S/N*(r+1) - 1) of
    # every head, heads in order (rank j's heads are j*H/N .. (j+1)*H/N - 1), by ONE all-to-all
    # on the group; gather_heads(scatter_heads(x)) is x again. A sequence that does not divide
    # by the group's size is a ValueError before any communication. The tests record one
    # all-to-all sending (N - 1)/N of y and compare the values exactly.
    raise KataTodo("k35", 1, "the all-to-all from a sequence shard to a head shard, and back")


# --------------------------------------------------------------------------- step 2: autograd


class ScatterHeads(torch.autograd.Function):
    """``scatter_heads`` forward; backward the gradient of the head shard gathered back
    (``gather_heads``): each piece returns to the rank it came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # TODO: the head shard (step 1), and whatever backward needs kept in ctx. The tests record
        # one all-to-all forward and compare with step 1's result.
        raise KataTodo("k35", 2, "differentiable: each all-to-all's backward is the other one")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # TODO: the gradient of x (B, H, S/N, D) from the gradient of the head shard, and None for
        # the group. The tests compare it exactly with what one process's gradient of the whole
        # tensor gives this rank's tokens (2 and 4 ranks, and subgroups), and record one
        # all-to-all on the group, sending (N - 1)/N of the gradient: nothing is summed.
        raise KataTodo("k35", 2, "differentiable: each all-to-all's backward is the other one")


class GatherHeads(torch.autograd.Function):
    """``gather_heads`` forward; backward the gradient of the sequence shard scattered back
    (``scatter_heads``)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # TODO: the sequence shard (step 1), and whatever backward needs kept in ctx.
        raise KataTodo("k35", 2, "differentiable: each all-to-all's backward is the other one")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # TODO: the gradient of y (B, H/N, S, D) from the gradient of the sequence shard, and None
        # for the group. The tests compare it exactly and record one all-to-all on the group.
        raise KataTodo("k35", 2, "differentiable: each all-to-all's backward is the other one")


# --------------------------------------------------------------------------- step 3: attention


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's tokens of the attention over the whole sequence, every head: ``q``, ``k``,
    ``v`` are this rank's sequence shards ``(B, H, S/N, D)`` (rank r: tokens rS/N..(r+1)S/N-1),
    the result too. Differentiable; scale 1/sqrt(D); ``causal``: token i sees tokens 0..i."""
    # TODO: this rank's tokens of F.scaled_dot_product_attention(q, k, v, is_causal=causal) over
    # the WHOLE sequence, for every head, shaped and typed like q, differentiable (q, k and v get
    # their gradients). The tests compare output and dq, dk, dv with one process on 2 and 4 ranks,
    # causal and not (float64, to 1e-10), record only all-to-alls: 4 of q's size forward (q, k,
    # v, the output) and 4 backward, each sending (N - 1)/N of it, and want a ValueError naming the
    # heads before any communication when they do not divide by the ranks (6 heads, 4 ranks).
    raise KataTodo("k35", 3, "Ulysses attention: re-shard by heads, attend, re-shard back")


# --------------------------------------------------------------------------- step 4: bytes


def bytes_per_rank(
    way: str, shape: tuple[int, int, int, int], world_size: int, element_size: int = 4
) -> tuple[int, int]:
    """``(forward, backward)``: the bytes each rank sends for one attention over the whole
    ``shape = (B, H, S, D)`` split over ``world_size`` ranks by ``way``: "ulysses" (this kata),
    "ring" (k26's ring_attention, keys and values N - 1 hops, their gradients N) or
    "all-gather" (k25's gather of k and v forward, reduce-scatter of dk and dv backward)."""
    # TODO: (forward, backward), the bytes ONE rank sends, for each way of the lesson's table (b =
    # one local shard of q: B*H*(S/N)*D elements of element_size bytes; a rank never sends itself
    # its own piece). A way that is not one of WAYS, or shapes the ranks do not split (S % N, and
    # for Ulysses H % N), are a ValueError. The tests compare with their own counts on 1 to 8
    # ranks, and with the bytes each way really sends, recorded on the same world and inputs.
    raise KataTodo("k35", 4, "the bytes each rank sends: Ulysses, the ring, the all-gather")


# --------------------------------------------------------------------------- the other ways


def sequence_slice(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s tokens of the whole ``x`` (B, H, S, D): one contiguous slice, a copy."""
    tokens = x.shape[2] // world_size
    return x[:, :, rank * tokens : (rank + 1) * tokens].contiguous()


def all_gather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, group=None
) -> torch.Tensor:
    """The all-gather way, on the same shards as ``ulysses_attention``: k and v gathered along
    the sequence by k25's gather (all-gather forward, reduce-scatter backward), this rank's
    queries against every key."""
    gathered = [
        gather_from_sequence_parallel_region(t.transpose(1, 2).contiguous(), group).transpose(1, 2)
        for t in (k, v)
    ]  # k25 gathers dim 1 of (batch, sequence, ...): the sequence moved there and back
    mask = None
    if causal:  # my queries are tokens rank * s ..: each sees the keys up to its own position
        start = dist.get_rank(group) * q.shape[2]
        queries = torch.arange(start, start + q.shape[2], device=q.device)
        mask = torch.arange(gathered[0].shape[2], device=q.device) <= queries.unsqueeze(-1)
    return F.scaled_dot_product_attention(q, *gathered, attn_mask=mask)


def ring_way(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True):
    """k26's ring on the same shards (its naive layout: rank r's tokens are one slice, chunks
    2r and 2r + 1), in the world."""
    return ring_attention(q, k, v, chunk_layout(dist.get_world_size(), False), causal)


# ------------------------------------------------------------------------- the program


def _inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """The whole sequence's q, k, v and the output's gradient, the same on every rank."""
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, args.length, args.dim)
    return [torch.randn(shape, generator=generator).to(device) for _ in range(4)]


def _demo(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    device = rank_device()
    whole = _inputs(args, device)
    causal = not args.no_causal
    results = {}
    for way, attend in (
        ("ulysses", lambda q, k, v: ulysses_attention(q, k, v, causal)),
        ("ring", lambda q, k, v: ring_way(q, k, v, causal)),
        ("all-gather", lambda q, k, v: all_gather_attention(q, k, v, causal)),
    ):
        q, k, v, grad = (sequence_slice(t, rank, world_size) for t in whole)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        out.backward(grad)
        results[way] = [out.detach().cpu(), *(t.grad.cpu() for t in leaves)]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Ulysses: q, k and v re-sharded by heads with an all-to-all, against k26's "
        "ring and k25's all-gather on the same inputs, and one process's attention."
    )
    add_launch_arguments(parser, world_size=4)
    parser.add_argument("--length", type=int, default=256, help="tokens (default 256)")
    parser.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    parser.add_argument("--dim", type=int, default=16, help="features per head (default 16)")
    parser.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    parser.add_argument("--no-causal", action="store_true", help="every token sees every token")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    n = args.world_size
    if n < 1 or args.length % (2 * n) or args.heads % n:
        parser.error(
            f"--heads {args.heads} must be a multiple of --world-size {n} (Ulysses splits whole "
            f"heads) and --length {args.length} a multiple of 2 x --world-size = {2 * n} (k26's "
            "ring cuts it into 2N chunks)"
        )
    shape = (args.batch, args.heads, args.length, args.dim)
    kind = "full (not causal)" if args.no_causal else "causal"
    say(None, f"{kind} attention, (batch, heads, tokens, dim) = {shape}, on {n} ranks")
    results = launch_world(_demo, n, args, backend=args.backend, device=args.device)
    q, k, v, grad = (t.double().requires_grad_() for t in _inputs(args, torch.device("cpu")))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=not args.no_causal)
    expected.backward(grad)
    wanted = [expected.detach(), q.grad, k.grad, v.grad]
    gaps = {}
    for way in WAYS:
        got = [torch.cat([r[way][i] for r in results], dim=2) for i in range(4)]
        gaps[way] = max((a.double() - b).abs().max().item() for a, b in zip(got, wanted))
        forward, backward = bytes_per_rank(way, shape, n, element_size=4)
        say(
            None,
            f"{way:>10}: each rank sends {forward:>9,} bytes forward, {backward:>9,} backward; "
            f"largest gap to one process {gaps[way]:.1e}",
        )
    return verdict(
        gaps["ulysses"],
        "Ulysses equals scaled_dot_product_attention on one process, forward and backward",
        "Ulysses differs from scaled_dot_product_attention",
    )


if __name__ == "__main__":
    run_program(main)
