"""k26 · Context parallel: ring attention, the keys and values passed round the ranks.

THE IDEA
    Attention over L tokens needs every query against every key: an L x L matrix of scores per
    head. Flash attention never stores it, but the activations of a long sequence (128k tokens
    of a large model) still outgrow one device, and the compute grows as L^2. Context
    parallelism splits the SEQUENCE over the ranks: each rank keeps the queries, keys and
    values of its own tokens, and attention, the one layer where tokens meet, brings the keys
    and values to the queries. The ring (Liu et al., "Ring Attention", 2023) passes each rank's
    key/value block to its right neighbour, N - 1 hops, while every rank computes its queries
    against the block it holds:

        step 0          step 1          step 2          step 3         (4 ranks; Qr: rank r's
        Q0 . KV0        Q0 . KV3        Q0 . KV2        Q0 . KV1        queries, KVr: the keys
        Q1 . KV1        Q1 . KV0        Q1 . KV3        Q1 . KV2        and values it started
        Q2 . KV2        Q2 . KV1        Q2 . KV0        Q2 . KV3        with; at step s rank r
        Q3 . KV3        Q3 . KV2        Q3 . KV1        Q3 . KV0        holds KV(r - s))
           --KV to the right-->

    Overlap: the next block's transfer is posted (dist.isend of the block held, dist.irecv of
    the next) BEFORE the block held is computed, and waited for after; the wire works while
    the rank computes. A block's compute grows as (L/N)^2, its transfer as L/N: the longer
    the sequence, the better the transfer hides (the timeline, below, shows it).

    Merging (the online softmax). softmax(s) @ v over all keys is not a sum of each block's
    softmax(s_block) @ v_block: each block normalises by its own sum. Keep, per query row, the
    block's out and its lse = log(sum of e^score) (the log-sum-exp); two partials over disjoint
    keys merge exactly:

        lse = log(e^lse_a + e^lse_b)                 (torch.logaddexp: no overflow)
        out = e^(lse_a - lse) * out_a + e^(lse_b - lse) * out_b

    Each weight is that part's share of the softmax's mass, at most 1: nothing is ever
    exponentiated that can overflow (e^1002 is inf even in float64), and a row that saw no key
    yet (lse -inf) weighs nothing.

    Causal attention and the load-balanced split. Cut the sequence into 2N chunks. With the
    causal mask a query chunk attends to the key chunks before it fully, to itself causally
    (query i keeps keys 0..i) and to later chunks not at all: such a block is skipped, never
    computed. Naive split (rank r holds chunks 2r and 2r + 1): the last rank has the most
    keys before it, 4r + 3 blocks on rank r, 4N - 1 on the last, and every step waits for it.
    Balanced (head-tail, as torch's context_parallel): rank r holds chunk r AND chunk
    2N - 1 - r, one cheap and one dear: 2N + 1 blocks on every rank.

        blocks per rank    naive          balanced        (4 ranks, 8 chunks)
                           3 7 11 15      9 9 9 9          slowest: 15 against 9

    Backward. The gradient of a query needs every key again, and the gradient of a key
    needs every query that saw it. A second trip round the ring: the blocks travel as in
    forward, each rank computes its share of dq (kept) and of that block's dk and dv, and
    those travel WITH the block, each rank adding its share; after N hops (one more than the
    block needs) they are home. Each block's share uses the FINISHED out and lse of the
    queries, saved by forward: the probabilities of the whole row are e^(score - lse).
    Nothing else is saved, nothing recomputed but one block's scores at a time.

    What torch offers, and when each pays (L tokens, N ranks, d features per head):

        way                         moves per rank        holds at once      pays when
        ring (this kata; torch's    (N-1)/N of K and V    2 blocks: the one  long sequences, any
          context_parallel with     forward, twice that   computed, the one  network: each hop
          set_rotate_method(        backward, in N-1      arriving           hides under a
          "alltoall"))              hops under compute                       block's compute
        all-gather K and V (torch's the same bytes, in    all of K and V     moderate N on a fast
          context_parallel default, one collective                           link (NVLink): one
          "allgather")                                                       call, no per-hop cost
        all-to-all on heads         q, k, v and out re-   the whole sequence heads >= N: volume
          (DeepSpeed-Ulysses; not   sharded by heads:     for H/N heads      per rank stays
          in torch core)            4 all-to-alls                            constant as N grows
        no context parallelism      nothing               the whole          the sequence fits
          (F.scaled_dot_product_                          sequence           one device
          attention, flash)

    torch's context_parallel (torch.distributed.tensor.experimental) swaps
    F.scaled_dot_product_attention for its ring while inside the context, with head-tail
    sharding of the buffers you give it. On CUDA only: on CPU it stops with "Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
    registered" (no sharding rule for the CPU attention kernel). The ring inside it does not
    care (a private function that takes any kernel returning out and lse): the tests hold
    yours against it on CPU, the same world, the same shards, and against context_parallel
    itself on CUDA (a world of one on one GPU: NCCL needs a GPU per rank, and gloo moves CUDA
    tensors in all_reduce and broadcast only, never by send and recv).

STEPS
    1. ``merge_partials(out_a, lse_a, out_b, lse_b)``: two partial results of the same queries
       over disjoint keys, as one (the online softmax).
    2. ``block_mask(query_chunk, key_chunk, causal)`` ("full", "causal" or None) and
       ``attend_block(q, k, v, causal)``: one block's attention and its lse.
    3. ``ring_attention_forward(q, k, v, layout, causal)``: the ring, the next block posted
       before this one is computed, every block merged into its query chunk's result.
    4. ``chunk_layout``, ``shard_sequence``, ``unshard_sequence`` and ``blocks_per_rank``:
       the naive and the balanced split, and the blocks each rank computes in them.
    5. ``block_gradients`` and ``RingAttention.backward``: one block's share of the
       gradients, and the second trip round the ring that brings dk and dv home.

WHAT THE TESTS CHECK
    The merge against the softmax over both parts (at every cut, square partials whose
    weights must scale rows, scores near 1000, parts that saw no key); each block's out and lse
    against F.scaled_dot_product_attention and logsumexp (full, wide and diagonal blocks); by
    recording every rank's calls and watching attend_block (which query and key chunk each call
    got, with which mask, when): that the keys and values go to the right neighbour only,
    (N - 1) x one block per rank, no collective; that each step's transfer is posted before the
    block held is computed and waited for after; that every block the mask leaves anything of
    is computed once with its mask, and no hidden block at all; out and lse on 2 and 4 ranks,
    causal and not, equal to one process; the split's chunks, shards and counts (3 7 11 15
    against 9 9 9 9), and the ring on the balanced split; each block's gradients, and dq, dk,
    dv on 2 to 4 ranks, naive and balanced, equal to F.scaled_dot_product_attention's on one
    process; the backward's traffic (dk and dv N hops); equality with torch's own ring on the
    same world (CPU) and with context_parallel (CUDA); ValueError for inputs that do not fit;
    and the program. float64 throughout: the ring adds the same terms in another order, so it
    agrees with one process to rounding (1e-10 allowed), and any real mistake is far larger.

RUN IT
    .venv/bin/python -m katas.k26_ring_attention --world-size 4
    .venv/bin/python -m katas.k26_ring_attention --world-size 4 --split balanced --length 2048 \\
        --heads 4 --dim 32 --trace traces/k26                              # the timeline

    The program runs the naive and the balanced split (--split: one of them), forward and
    backward, prints the blocks each rank computed in each, and compares output and gradients
    with F.scaled_dot_product_attention on one process. Its timeline draws a strip per step
    ("attend block s" forward, "gradients of block s" backward) above the sends and receives:
    the thin bar of the next block's receive, in flight, runs under the strip of the block
    being computed (the reference's: docs/timelines/k26_ring_attention.png).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.profiler import record_function

from dojo.console import run_program, say, verdict
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo

# Which chunks of the sequence each rank holds: layout[r] lists rank r's chunk numbers, in the
# order they sit in its shard. chunk_layout(4, balanced=True) is [(0, 7), (1, 6), (2, 5), (3, 4)].
Layout = list[tuple[int, ...]]

# --------------------------------------------------------------------------- step 1: merging


def _check_partial(out: torch.Tensor, lse: torch.Tensor, name: str) -> None:
    if out.dim() < 2 or tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(
            f"partial {name}: out is shaped {tuple(out.shape)} and lse {tuple(lse.shape)}; a "
            "partial result is out (..., queries, dim) with lse (..., queries): one log-sum-exp "
            "per query row"
        )


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention results of the same queries over two disjoint sets of keys, as one.

    ``out_x`` is the attention over its keys alone (normalised by its own softmax), ``lse_x``
    the log-sum-exp of those keys' scores, one per query row. Returns ``(out, lse)`` of the
    attention over both sets of keys together. A row that saw no key in a part has lse -inf there.
    """
    # TODO: return (out, lse) of the attention over both parts' keys together, from the two
    # partials alone: out_x is normalised by its own part's softmax, lse_x (one per query row) is
    # the log-sum-exp of its part's scores. The tests compare with the softmax over all the keys
    # at several cuts (to 1e-10 in float64), with square partials (as many rows as features: each
    # row has its own weight), with scores near 1000 (nothing may overflow to inf or NaN), with a
    # part that saw no key (lse -inf, out 0: it must weigh nothing, and two such parts stay -inf
    # and 0, never NaN), and want a ValueError for partials whose shapes do not fit
    # (_check_partial checks one partial).
    raise KataTodo("k26", 1, "merge two partial results (the online softmax)")


# --------------------------------------------------------------------------- step 2: one block


def block_mask(query_chunk: int, key_chunk: int, causal: bool) -> str | None:
    """What the attention mask leaves of one query chunk against one key chunk (chunks of the
    same size, numbered along the sequence): ``"full"``, ``"causal"`` (the diagonal) or None."""
    # TODO: what the mask leaves of query chunk `query_chunk` against key chunk `key_chunk`
    # (chunks of one size, numbered along the sequence): "full", "causal" (only the chunk
    # against itself) or None (nothing: the block is never computed). The tests try every pair
    # of 4 chunks, causal or not.
    raise KataTodo("k26", 2, "one block's mask, and its attention with its lse")


def _cpu_kernel(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU attention kernel (which returns the log-sum-exp) takes ``q``."""
    return (
        q.device.type == "cpu"
        and q.dim() == 4
        and q.dtype in (torch.float32, torch.float64)
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


def attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the queries ``q`` over one block of keys ``k`` and values ``v`` alone.

    Shapes as ``F.scaled_dot_product_attention``'s: ``(..., queries, dim)``; the scale is
    ``1 / sqrt(dim)``. With ``causal`` the block is on the diagonal (queries and keys are the
    same positions): query i sees keys 0..i. Returns ``(out, lse)``: out ``(..., queries,
    value dim)`` normalised over this block's keys, lse ``(..., queries)`` the log-sum-exp of
    the scaled scores each query kept.
    """
    # TODO: (out, lse) of the queries over this block of keys alone, as
    # F.scaled_dot_product_attention computes out (scale 1 / sqrt(dim), causal: query i keeps
    # keys 0..i), with lse the log-sum-exp of each row's scaled scores over the keys it keeps
    # (what merge_partials needs). The tests compare both, to 1e-10 in float64, for a square, a
    # wide and a causal block, merge three blocks into the whole attention, and want a
    # ValueError for blocks that do not fit (a causal block of unequal lengths, keys and values
    # of different lengths, q and k of different feature dims). _cpu_kernel(q) says whether
    # torch's fused CPU kernel, which returns both, takes q (the reference uses it).
    raise KataTodo("k26", 2, "one block's mask, and its attention with its lse")


# --------------------------------------------------------------------------- step 3: the ring


def _check_layout(layout: Layout, world_size: int) -> int:
    """The chunks per rank ``layout`` gives; ValueError unless it fits the world."""
    if len(layout) != world_size:
        raise ValueError(
            f"the layout lists {len(layout)} ranks' chunks, the world has {world_size} ranks: "
            "give every rank's chunks (chunk_layout(world_size, balanced))"
        )
    per_rank = {len(chunks) for chunks in layout}
    everything = sorted(c for chunks in layout for c in chunks)
    if len(per_rank) != 1 or 0 in per_rank or everything != list(range(len(everything))):
        raise ValueError(
            f"layout {layout}: every rank must hold the same number of chunks (at least one), "
            f"and together they must be the chunks 0..n-1, each once"
        )
    return per_rank.pop()


def _check_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: int) -> int:
    """The tokens per chunk of this rank's shards; ValueError unless they fit."""
    if q.dim() < 2 or q.shape[:-1] != k.shape[:-1] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"this rank's q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be "
            "shards of the same tokens: (..., local length, dim), the same local length"
        )
    if k.dtype != v.dtype:
        raise ValueError(f"k is {k.dtype} and v {v.dtype}: give them one dtype")
    if q.shape[-2] % chunks:
        raise ValueError(
            f"this rank holds {q.shape[-2]} tokens, which do not cut into its {chunks} chunks: "
            "shard the sequence with shard_sequence (the length must divide into "
            "world_size x chunks per rank)"
        )
    return q.shape[-2] // chunks


def _by_chunk(x: torch.Tensor, chunks: int, dim: int = -2) -> torch.Tensor:
    """``x`` cut into its ``chunks`` along ``dim`` and stacked, chunk first: each chunk is then
    contiguous, what the attention kernel reads fastest."""
    return torch.stack(x.chunk(chunks, dim=dim))


def _pack(k: torch.Tensor, v: torch.Tensor, chunks: int) -> tuple[torch.Tensor, tuple]:
    """A rank's keys and values as ONE flat buffer (one message a hop), chunk by chunk, and the
    shapes ``_unpack`` needs to view them again."""
    keys, values = _by_chunk(k, chunks), _by_chunk(v, chunks)
    return torch.cat([keys.flatten(), values.flatten()]), (keys.shape, values.shape)


def _unpack(buffer: torch.Tensor, shapes: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the keys and values (chunk first) in a buffer ``_pack`` made."""
    count = math.prod(shapes[0])
    return buffer[:count].view(shapes[0]), buffer[count:].view(shapes[1])


def ring_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the attention over the whole sequence, the keys and values coming
    round the ring; ``q``, ``k``, ``v`` hold this rank's chunks (``layout[rank]``), in order.

    Returns ``(out, lse)`` for this rank's queries, as ``attend_block`` does for one block.
    """
    # TODO: this rank's rows of the attention over the whole sequence, (out, lse), its queries
    # against every rank's keys and values, which travel round the ring: N - 1 hops, each rank
    # sending to its right neighbour and receiving from its left. Call attend_block once per
    # (query chunk, key chunk) block the mask leaves anything of (block_mask), with its mask,
    # and merge each into its query chunk's result (merge_partials). Check the layout and the
    # shards first (_check_layout, _check_shards). The tests record your calls: point-to-point
    # only (through the dist module), (N - 1) x one block's keys and values sent per rank, to
    # the right only; each step's transfer (the send of the block held, the receive of the next)
    # posted BEFORE attend_block is called on the block held and waited for only after; every
    # visible block computed once with its mask and no hidden one; out and lse equal to one
    # process on 2 and 4 ranks, causal and not; a deadlock is reported within seconds. Name each
    # step's computation `with record_function(f"attend block {step}"):` for the timeline.
    raise KataTodo("k26", 3, "the ring: attend to each block while the next one travels")


# --------------------------------------------------------------------------- step 4: the split


def chunk_layout(world_size: int, balanced: bool) -> Layout:
    """Which two of the sequence's ``2 x world_size`` chunks each rank holds.

    Naive: rank r holds chunks 2r and 2r + 1, one contiguous slice of the sequence.
    Balanced (head-tail): rank r holds chunk r and chunk 2N - 1 - r, one from each end.
    """
    # TODO: the chunk numbers each rank holds, for 2 x world_size chunks: naive, one contiguous
    # slice each; balanced, one chunk from each end. The tests compare with the docstring's
    # layouts on 1 to 4 ranks.
    raise KataTodo("k26", 4, "the naive and the balanced split")


def _chunk_size(length: int, layout: Layout) -> int:
    chunks = sum(len(c) for c in layout)
    if chunks == 0 or length % chunks:
        raise ValueError(
            f"a sequence of {length} tokens does not cut into {chunks} chunks of equal length "
            f"({len(layout)} ranks x {chunks // max(1, len(layout))} chunks each): pad it to a "
            f"multiple of {chunks} tokens, or choose a world size that divides it"
        )
    return length // chunks


def shard_sequence(x: torch.Tensor, layout: Layout, rank: int, dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of the whole sequence ``x``: its chunks (``layout[rank]``) along
    ``dim``, in that order, as a new contiguous tensor."""
    # TODO: rank `rank`'s chunks of x along `dim`, in layout order, as a new contiguous tensor.
    # The tests number the tokens and check which ones each rank of 4 gets (naive and
    # balanced), and want a ValueError naming the length and the number of chunks when they do
    # not divide (100 tokens into 8 chunks): _chunk_size does that.
    raise KataTodo("k26", 4, "the naive and the balanced split")


def unshard_sequence(shards: list[torch.Tensor], layout: Layout, dim: int = -2) -> torch.Tensor:
    """The whole sequence again from every rank's shard (rank order), undoing ``shard_sequence``."""
    # TODO: the whole sequence back from every rank's shard (in rank order): each chunk back at
    # its place. The tests undo shard_sequence for both layouts exactly.
    raise KataTodo("k26", 4, "the naive and the balanced split")


def blocks_per_rank(layout: Layout, causal: bool = True) -> list[int]:
    """How many (query chunk, key chunk) blocks each rank computes in the ring: those the mask
    leaves anything of."""
    # TODO: per rank, the number of (query chunk, key chunk) blocks of its chunks against every
    # rank's that the mask leaves anything of, as your ring computes them. The tests want
    # 4r + 3 on rank r naive and 2N + 1 on every rank balanced (causal), 4N each not causal, on
    # 1 to 8 ranks, and count the attend_block calls of your ring on 4 ranks: they must agree.
    raise KataTodo("k26", 4, "the naive and the balanced split")


# --------------------------------------------------------------------------- step 5: backward


def block_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients: ``(dq, dk, dv)`` of the attention over the WHOLE
    sequence, from this block's keys alone. ``out`` and ``lse`` are the finished results of
    these queries (over every key), ``grad_out`` the gradient of ``out``."""
    # TODO: this block's share of dq (for these queries), dk and dv (for these keys and values)
    # of the attention over the WHOLE sequence, from the finished out and lse of these queries
    # (every key's, as forward left them) and grad_out. The tests split a sequence into three
    # key chunks on one process: each block's dk and dv must equal the gradients
    # scaled_dot_product_attention gives those keys from these queries, and the three dq's must
    # add up to its dq (to 1e-10 in float64), causal and not.
    raise KataTodo("k26", 5, "backward: each block's gradients, and dk and dv round the ring home")


class RingAttention(torch.autograd.Function):
    """Ring attention as one autograd function: forward ``ring_attention_forward``, backward a
    second trip round the ring."""

    @staticmethod
    def forward(ctx, q, k, v, layout: Layout, causal: bool):
        out, lse = ring_attention_forward(q, k, v, layout, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.causal = layout, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # TODO: (dq, dk, dv, None, None): the gradients of this rank's q, k and v, where every
        # rank's queries that saw these keys contribute to their dk and dv. A second trip round the
        # ring: the blocks travel as in forward; dk and dv of the block a rank holds travel with it,
        # each rank adding its share (block_gradients), and come home. The tests record the calls
        # (point-to-point only, to the right: N - 1 hops of keys and values and N of their gradients
        # per rank), compare dq, dk and dv with scaled_dot_product_attention on one process on 2 to 4
        # ranks, naive and balanced, and with torch's own ring on the same world, and name the rank
        # whose key gradients a rank ended with when they did not come home. Name each step's
        # computation `with record_function(f"gradients of block {step}"):` for the timeline.
        raise KataTodo(
            "k26", 5, "backward: each block's gradients, and dk and dv round the ring home"
        )


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, causal: bool = True
) -> torch.Tensor:
    """Ring attention, differentiable: this rank's rows of the attention over the whole sequence."""
    return RingAttention.apply(q, k, v, layout, causal)


# ------------------------------------------------------------------------- the program


def _inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """The whole sequence's q, k, v and the gradient of the output, the same on every rank."""
    generator = torch.Generator().manual_seed(args.seed)
    shape = (1, args.heads, args.length, args.dim)
    return [torch.randn(shape, generator=generator).to(device) for _ in range(4)]


def _splits(args: argparse.Namespace) -> list[str]:
    return ["naive", "balanced"] if args.split == "both" else [args.split]


def _demo(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    device = rank_device()
    q, k, v, grad = _inputs(args, device)
    with record_function("warm-up"):  # the first message to a neighbour connects them
        if world_size > 1:
            ping, pong = torch.zeros(1, device=device), torch.empty(1, device=device)
            request = dist.isend(ping, (rank + 1) % world_size)
            dist.recv(pong, (rank - 1) % world_size)
            request.wait()
    results = {}
    for name in _splits(args):
        balanced = name == "balanced"
        layout = chunk_layout(world_size, balanced)
        shards = [shard_sequence(t, layout, rank) for t in (q, k, v, grad)]
        mine = [t.clone().requires_grad_() for t in shards[:3]]
        # Named (torch's record_function) for `dojo trace k26`: a strip above the calls.
        with record_function(f"{name} split: forward"):
            out = ring_attention(*mine, layout, causal=not args.no_causal)
        with record_function(f"{name} split: backward"):
            out.backward(shards[3])
        results[name] = {
            "out": out.detach().cpu(),
            "grads": [t.grad.cpu() for t in mine],
            "blocks": blocks_per_rank(layout, causal=not args.no_causal)[rank],
            "chunks": layout[rank],
        }
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Ring attention: every rank's block of the sequence, the keys and values "
        "passed round the ring, against one process's scaled_dot_product_attention."
    )
    add_launch_arguments(parser, world_size=4)
    parser.add_argument("--length", type=int, default=256, help="tokens (default 256)")
    parser.add_argument("--heads", type=int, default=2, help="heads (default 2)")
    parser.add_argument("--dim", type=int, default=16, help="features per head (default 16)")
    parser.add_argument("--no-causal", action="store_true", help="every token sees every token")
    parser.add_argument(
        "--split",
        choices=("both", "naive", "balanced"),
        default="both",
        help="which split of the sequence to run (default both)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.length % (2 * args.world_size):
        parser.error(
            f"--length {args.length} must cut into 2 x --world-size = {2 * args.world_size} "
            "chunks of equal length"
        )
    causal = "causal" if not args.no_causal else "full (not causal)"
    say(
        None,
        f"{causal} attention over {args.length} tokens, {args.heads} heads of {args.dim}, "
        f"on {args.world_size} ranks: {2 * args.world_size} chunks of "
        f"{args.length // (2 * args.world_size)} tokens, two per rank",
    )
    results = launch_world(_demo, args.world_size, args, backend=args.backend, device=args.device)
    q, k, v, grad = (t.double().requires_grad_() for t in _inputs(args, torch.device("cpu")))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=not args.no_causal)
    expected.backward(grad)
    wanted = [expected.detach(), q.grad, k.grad, v.grad]
    worst = 0.0
    for name in _splits(args):
        layout = chunk_layout(args.world_size, name == "balanced")
        for rank, result in enumerate(results):
            got = result[name]
            say(
                rank,
                f"{name:>8} split: chunks {got['chunks']}, {got['blocks']} blocks computed",
            )
        got = [
            unshard_sequence([r[name]["out"] for r in results], layout),
            *(unshard_sequence([r[name]["grads"][i] for r in results], layout) for i in range(3)),
        ]
        gaps = [(a.double() - b).abs().max().item() for a, b in zip(got, wanted)]
        worst = max(worst, *gaps)
        blocks = [r[name]["blocks"] for r in results]
        say(
            None,
            f"{name:>8} split: blocks per rank {blocks} (the slowest rank computes "
            f"{max(blocks)}); largest gap to one process: output {gaps[0]:.1e}, gradients of "
            f"q {gaps[1]:.1e}, k {gaps[2]:.1e}, v {gaps[3]:.1e}",
        )
    equal = "both splits equal" if args.split == "both" else f"the {args.split} split equals"
    return verdict(
        worst,
        f"{equal} scaled_dot_product_attention on one process, forward and backward",
        "the ring differs from scaled_dot_product_attention",
    )


if __name__ == "__main__":
    run_program(main)
