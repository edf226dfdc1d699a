"""k34 · The vocabulary split: a vocab-parallel embedding, and a cross-entropy that never gathers
the logits.

THE IDEA
    A language model's two widest layers sit at its two ends, and both are as wide as the
    vocabulary: the embedding (V rows of h) and the output layer that makes the logits (V rows
    of h, one logit per token per word). With Llama 3's V = 128 256 and h = 4096 each holds
    525 million parameters, and the logits of one batch of 8 x 8192 tokens are 8 x 8192 x
    128 256 floats: 31 GiB in fp32. Tensor parallelism (k20) splits both tables along the
    VOCABULARY: rank r of N holds rows [r V/N, (r+1) V/N) of each, and the loss is computed
    without ever putting one token's V logits together on one rank.

    The embedding. Every rank looks up the tokens it owns, and zeros for the others; exactly one
    rank owns each token, so the SUM over the ranks (one all-reduce) is the whole embedding:

        V = 32 on 2 ranks: rank 0 rows 0..15, rank 1 rows 16..31
        tokens     3     17     9     30
        rank 0    E[3]   0     E[9]   0       17 and 30 are not mine: looked up as my row 0
        rank 1    0      E[17] 0      E[30]   (any row will do), then zeroed
        all-reduce (sum) -> E[3] E[17] E[9] E[30] on both ranks

    Backward: every rank goes on with the same sum and computes the same loss, so the gradient of
    the sum reaches each rank's partial unchanged (k20's g: all-reduce forward, identity
    backward), and each rank's rows get the gradients of the tokens it owns: nothing is sent.

    The loss. The output layer is column-parallel (k20) on the vocabulary: rank r's logits are
    columns [r V/N, (r+1) V/N) of every token's logits z. The cross-entropy of a token with target
    y is

        loss = log sum_v exp(z_v) - z_y  =  log sum_v exp(z_v - m) - (z_y - m)     (m: any number)

    and each ingredient is a max or a sum over the vocabulary: a SCALAR per token that each rank
    computes over its own columns and the ranks then reduce (Megatron-LM's vocab-parallel
    cross-entropy, 2019):

        m      all-reduce MAX of each rank's largest logit                 tokens floats
        s      all-reduce SUM of each rank's sum of exp(z - m)             tokens floats
        z_y-m  all-reduce SUM: the rank whose columns hold y gives it,     tokens floats
               every other rank 0

    3 x tokens floats per rank, whatever V is; gathering the logits instead moves tokens x V. The
    max keeps exp from overflowing (z - m <= 0: logits of 1000 are fine) and cancels out of the
    result. The loss is the mean over the tokens that count: a target equal to ``ignore_index``
    (-100, padding) adds nothing and is not counted, as ``F.cross_entropy`` does.

    Backward without the gather: d loss / d z_v = softmax_v - [v = y], so each rank's gradient is
    its own columns of the softmax, exp(z - m) / s, with 1 taken off at the target's column by the
    rank that holds it; times the upstream gradient over the count of tokens that count; zero for
    ignored tokens. Everything it needs is on the rank after forward's three reductions: backward
    sends nothing. What it keeps: one (tokens, V/N) tensor, the softmax of its columns (exp(z - m)
    in place, divided by s), where F.cross_entropy on the gathered logits keeps (tokens, V).

        tokens x V/N logits  --max-->  all-reduce MAX (m)
                             --exp(z - m), sum-->  all-reduce SUM (s)      softmax kept
                             --pick y if mine-->   all-reduce SUM (z_y - m)
        loss = mean over counted tokens of log s - (z_y - m)           backward: local only

    What torch offers, and when a practitioner chooses it (per rank; b x s tokens, V words, h
    width, N ranks; fp32):

        the output layer whole on every rank          sends nothing; holds the V x h weight and
          + F.cross_entropy                           (b s) x V logits: fine while V h and the
                                                      logits fit, wasteful across N ranks
        ColwiseParallel output + all-gather + F.ce    sends (b s) x V (N-1)/N floats; holds all
          (the logits gathered: Replicate())          (b s) x V logits again: avoid
        ColwiseParallel(output_layouts=Shard(-1),     sends 3 x (b s) floats in 3 all-reduces
          use_local_output=False) + loss_parallel()   forward, nothing backward; holds (b s) x
          around F.cross_entropy and backward         V/N: what this kata writes (torchtitan
                                                      uses it with tensor parallelism)
        RowwiseParallel(input_layouts=Replicate())    sends (b s) x h floats (one all-reduce);
          on the nn.Embedding                         holds V/N x h: the embedding split
        ColwiseParallel() on the output layer         the same split of the output layer; its
                                                      input's gradient all-reduced in backward

    Llama 3 (V = 128 256, h = 4096) on 8 ranks, 8 x 8192 tokens: the loss sends 768 KiB per rank,
    the gather would receive 27 GiB; each rank holds 3.9 GiB of logits instead of 31 GiB, and
    16 032 rows of each table (66 million parameters) instead of 128 256 (525 million). The split
    pays whenever tensor parallelism is on (the output layer is split anyway) and V is large;
    with a small vocabulary (a classifier, V = 10) it saves nothing worth three all-reduces.

    Three habits of torch's (2.14, measured here on gloo and the CPU). loss_parallel and the
    RowwiseParallel embedding take a target or a token outside the vocabulary without a word (the
    loss leaves its logit out, the embedding gives a row of zeros), where F.cross_entropy and
    nn.Embedding raise: yours refuses them, before anything is sent. The embedding's weight
    gradient comes back Replicate, all V x h of it on every rank, until the optimizer's step
    takes its rows; yours is V/N x h from the start. And loss_parallel works on a DTensor
    sharded on the vocabulary (Shard(-1)), in a context manager that backward must run inside
    too; yours takes this rank's plain logits.

STEPS
    1. ``vocab_range`` (this rank's rows, by its rank in the group; a ``ValueError`` when the
       vocabulary does not divide) and ``vocab_shard`` (those rows of a table, a copy).
    2. ``ReduceFromVocabParallelRegion`` (k20's g: all-reduce forward, identity backward) and
       ``VocabParallelEmbedding.forward``: tokens outside my rows masked, the partials summed.
    3. ``VocabParallelCrossEntropy.forward``: the max, the sum of exponentials and the target's
       logit reduced per token as scalars; the mean over the tokens that count; bad targets
       refused before anything is sent.
    4. ``VocabParallelCrossEntropy.backward``: softmax minus one-hot from what forward kept,
       without any communication.
    5. ``VocabParallelLM``: the TinyTransformer with its embedding and output layer split over the
       vocabulary (``CopyToVocabParallelRegion``, k20's f, before the output layer), equal to one
       process; and ``bytes_per_step``, what one training step sends.

WHAT THE TESTS CHECK
    By recording every rank's calls: ``vocab_range`` gives each rank its rows in the group's order
    (2 and 4 ranks, two subgroups of 4) and refuses 30 words on 4 ranks before any call;
    ``vocab_shard`` copies (it does not keep the whole table alive); the embedding equals
    ``nn.Embedding`` exactly with one all-reduce forward (a sum on the group, tokens x h floats)
    and none backward, each rank's weight gradient the dense one's rows, tokens outside the
    vocabulary refused; the loss equals ``F.cross_entropy`` of the whole logits on one process
    (mean over counted tokens, ignore_index) with one MAX and SUMs of 3 x tokens floats in all,
    no gather, stable for logits of 1000, bad targets refused before any call, and the same loss
    and bytes as torch's ``loss_parallel`` on the same world; its gradient equals
    ``F.cross_entropy``'s columns and ``loss_parallel``'s with no call in backward and one (tokens,
    V/N) tensor kept; the split TinyTransformer's loss and every gradient equal one process's (2
    and 4 ranks, subgroups) with one all-reduce of tokens x h floats backward, and equal to torch's
    ``parallelize_module`` (RowwiseParallel embedding, ColwiseParallel output with Shard(-1)) under
    ``loss_parallel``; ``bytes_per_step`` equals what a step sends, for a vocabulary of 32 and of
    256; and the program.

RUN IT
    .venv/bin/python -m katas.k34_vocab_parallel --world-size 2 --vocab 32000
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dojo.console import run_program, say, verdict
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import TinyTransformer

IGNORE_INDEX = -100  # F.cross_entropy's default: a target that adds nothing (padding)

# --------------------------------------------------------------------------- step 1


def vocab_range(vocab_size: int, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(start, end)`` of the rows of a ``vocab_size``-row table this rank holds: rank r of the
    group (None: the world) holds [r V/N, (r+1) V/N). ValueError when V does not divide by N."""
    # BEGIN STEP 1: the vocabulary split: this rank's rows
    # TODO: (start, end) of this rank's equal share of vocab_size rows, in the order of the ranks IN
    # THE GROUP (None: the world), so that the group's ranks cover 0..vocab_size - 1 once. A
    # vocabulary that does not divide by the group's size is a ValueError naming both numbers and
    # what to do. The tests run in the world (2 and 4 ranks) and in the subgroups [0, 1] and [2, 3],
    # and try 30 words on 4 ranks.
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if vocab_size % size:
        raise ValueError(
            f"a vocabulary of {vocab_size} words does not split over {size} ranks: every rank "
            f"holds as many rows. Pad the vocabulary to a multiple of {size} (Megatron-LM pads "
            "it with rows no target ever names: --make-vocab-size-divisible-by), or choose a "
            "group size that divides it"
        )
    share = vocab_size // size
    return rank * share, (rank + 1) * share
    # END STEP 1


def vocab_shard(table: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's rows (``vocab_range``'s, along dim 0) of ``table``, a copy of its own."""
    # BEGIN STEP 1: the vocabulary split: this rank's rows
    # TODO: this rank's rows of table (dim 0: a weight (V, h) or a bias (V,)), detached from table
    # and in memory of their own: the whole table must not stay alive through them. The tests
    # compare the rows and the bytes the result's storage holds.
    start, end = vocab_range(table.shape[0], group)
    return table.detach()[start:end].clone()  # a slice alone would keep all V rows alive
    # END STEP 1


# --------------------------------------------------------------------------- step 2


class ReduceFromVocabParallelRegion(torch.autograd.Function):
    """k20's g: forward, the sum over the group; backward, the gradient as it came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # BEGIN STEP 2: the embedding: look up my rows, mask the others, sum
        # TODO: a new tensor holding the SUM of x over the group (None: the world); x itself stays
        # as it was. The tests record exactly one all-reduce (a sum, on the group) in the
        # embedding's forward.
        total = x.clone()  # the caller's partial stays as it was
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total
        # END STEP 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # BEGIN STEP 2: the embedding: look up my rows, mask the others, sum
        # TODO: the gradient of x, and None for the group. Every rank goes on with the same sum and
        # computes the same loss. The tests record no call in the embedding's backward and compare
        # each rank's weight gradient with the dense embedding's rows.
        # END TODO
        # d(sum)/d(my partial) = 1, and every rank already holds the whole gradient of the sum
        return grad, None
        # END STEP 2


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with its rows split over the group (``vocab_range``'s): each rank looks up
    the tokens it owns, the partials are summed. Its input and output are whole on every rank."""

    def __init__(self, embedding: nn.Embedding, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.process_group = process_group
        self.vocab_size, self.dim = embedding.weight.shape
        self.start, self.end = vocab_range(self.vocab_size, process_group)
        self.weight = nn.Parameter(vocab_shard(embedding.weight, process_group))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # BEGIN STEP 2: the embedding: look up my rows, mask the others, sum
        # TODO: the dense embedding of every token (tokens: any shape; the output adds a last
        # dimension of self.dim), from this rank's rows self.weight (rows self.start..self.end - 1
        # of the whole table): the tokens it owns looked up, zeros for the others, the partials
        # summed over the group in one call. A token outside 0..vocab_size - 1 is a ValueError
        # before anything is sent. The tests compare with nn.Embedding exactly, record the calls
        # forward and backward, and compare the weight's gradient with the dense rows.
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            wrong = tokens[(tokens < 0) | (tokens >= self.vocab_size)][0].item()
            raise ValueError(
                f"token {wrong} is outside the vocabulary of {self.vocab_size} words (0 to "
                f"{self.vocab_size - 1}): no rank owns its row, and its embedding would be "
                "silently zero. Check the tokenizer's vocabulary against the embedding's"
            )
        outside = (tokens < self.start) | (tokens >= self.end)
        local = torch.where(outside, 0, tokens - self.start)  # any row of mine: it is zeroed
        rows = F.embedding(local, self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)  # and no gradient reaches that row
        return ReduceFromVocabParallelRegion.apply(rows, self.process_group)
        # END STEP 2


# --------------------------------------------------------------------------- steps 3 and 4


class VocabParallelCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy`` (mean over the tokens whose target is not ``ignore_index``) of logits
    split over the group along the vocabulary: ``logits`` (..., V/N) are this rank's columns
    (``vocab_range``'s), ``targets`` (...) the whole targets, the same on every rank."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: dist.ProcessGroup | None,
        ignore_index: int,
    ) -> torch.Tensor:
        # BEGIN STEP 3: the loss from three scalars per token
        # TODO: a 0-dim tensor: F.cross_entropy of the whole logits (every rank's columns side by
        # side) with targets, the mean over the tokens whose target is not ignore_index, the same
        # on every rank; keep in ctx what backward needs. The logits are never gathered: what
        # travels is per-token scalars, tokens x 3 floats per rank in all (the kata insists: one MAX
        # all-reduce, then SUMs). Targets of another shape than the logits' without their last
        # dimension, or outside 0..V - 1 but not ignore_index, are a ValueError before anything is
        # sent. The tests compare with F.cross_entropy (rtol 1e-5) on 2 and 4 ranks and subgroups,
        # with logits of 1000, count every call's bytes, and hold it against torch's loss_parallel.
        size = dist.get_world_size(group)
        vocab = logits.shape[-1] * size
        start, end = vocab_range(vocab, group)
        if tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"targets of shape {tuple(targets.shape)} for logits of shape "
                f"{tuple(logits.shape)}: one target per token, the logits' shape without its "
                "last (vocabulary) dimension"
            )
        target = targets.reshape(-1)
        counted = target != ignore_index
        wrong = counted & ((target < 0) | (target >= vocab))
        if wrong.any():
            raise ValueError(
                f"target {target[wrong][0].item()} is outside the vocabulary of {vocab} words "
                f"({logits.shape[-1]} columns on each of {size} ranks): a target is a word "
                f"0..{vocab - 1}, or ignore_index ({ignore_index}) for a token that does not count"
            )
        flat = logits.reshape(-1, logits.shape[-1])  # (tokens, V/N): my columns
        largest = flat.max(dim=1).values
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)  # m, per token
        shifted = flat - largest.unsqueeze(1)  # <= 0: exp cannot overflow
        mine = (target >= start) & (target < end)
        column = torch.where(mine, target - start, 0)  # any column of mine: it is masked
        picked = shifted.gather(1, column.unsqueeze(1)).squeeze(1)
        target_shifted = torch.where(mine, picked, 0.0)  # z_y - m from its owner, 0 elsewhere
        softmax = shifted.exp_()  # in place: the one (tokens, V/N) tensor this makes
        total = softmax.sum(dim=1)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)  # s, per token
        dist.all_reduce(target_shifted, op=dist.ReduceOp.SUM, group=group)  # z_y - m
        losses = torch.where(counted, total.log() - target_shifted, 0.0)
        count = counted.sum()
        softmax.div_(total.unsqueeze(1))  # what backward needs, and all it keeps of the logits
        ctx.save_for_backward(softmax, column, mine & counted, counted, count)
        ctx.shape = logits.shape
        return losses.sum() / count
        # END STEP 3

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # BEGIN STEP 4: the gradient: softmax minus one-hot, nothing sent
        # TODO: the gradient of this rank's logits (their shape): the softmax of its columns, minus 1
        # at the target's column on the rank that holds it, times grad over the count of tokens
        # that count, zero for ignored tokens; then None for targets, the group and ignore_index.
        # Everything needed is on this rank after forward. The tests compare with the columns of
        # F.cross_entropy's gradient (and torch's loss_parallel's), record no call in backward,
        # backward with grad 2.5, and measure what forward kept: one (tokens, V/N) tensor at most.
        softmax, column, hit, counted, count = ctx.saved_tensors
        scale = counted.to(softmax.dtype) * (grad / count)  # 0 for ignored tokens
        result = softmax * scale.unsqueeze(1)  # a new tensor: the saved one stays as it was
        rows = torch.arange(result.shape[0], device=result.device)
        result[rows[hit], column[hit]] -= scale[hit]  # the one-hot, on the target's owner
        return result.view(ctx.shape), None, None, None
        # END STEP 4


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The mean cross-entropy of logits split along the vocabulary (this rank's columns)."""
    return VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index)


# --------------------------------------------------------------------------- step 5


class CopyToVocabParallelRegion(torch.autograd.Function):
    """k20's f: forward, the input as it is; backward, the gradient's sum over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # BEGIN STEP 5: the split TinyTransformer, and what a step sends
        # TODO: x's values unchanged (no communication), and whatever backward needs kept in ctx.
        ctx.group = group
        return x.view_as(x)
        # END STEP 5

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # BEGIN STEP 5: the split TinyTransformer, and what a step sends
        # TODO: the gradient's SUM over the group (each rank's output columns sent back their share),
        # without changing autograd's tensor, and None for the group. The tests record exactly one
        # all-reduce in the model's backward.
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None
        # END STEP 5


class VocabParallelLM(nn.Module):
    """``dojo.toy_models.TinyTransformer`` with its embedding and output layer split over the
    group along the vocabulary; the blocks and the final norm whole on every rank (copies).
    ``forward(tokens, targets)`` is the mean cross-entropy, never gathering the logits."""

    def __init__(self, model: TinyTransformer, process_group: dist.ProcessGroup | None = None):
        # BEGIN STEP 5: the split TinyTransformer, and what a step sends
        # TODO: embedding (a VocabParallelEmbedding of the model's), blocks and norm (copies of the
        # model's), output (an nn.Linear holding this rank's rows of the model's output weight and
        # bias: its columns of the logits), split over process_group (None: the world); the same
        # names as the model's (the tests read embedding.weight, output.weight, output.bias,
        # blocks.0.mlp.up.weight ...). The model itself stays as it was.
        super().__init__()
        self.process_group = process_group
        self.embedding = VocabParallelEmbedding(model.embedding, process_group)
        self.blocks = copy.deepcopy(model.blocks)
        self.norm = copy.deepcopy(model.norm)
        weight = vocab_shard(model.output.weight, process_group)
        self.output = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device)
        with torch.no_grad():
            self.output.weight.copy_(weight)
            self.output.bias.copy_(vocab_shard(model.output.bias, process_group))
        # END STEP 5

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
    ) -> torch.Tensor:
        # BEGIN STEP 5: the split TinyTransformer, and what a step sends
        # TODO: the dense model's transformer_loss (the mean cross-entropy over the tokens whose
        # target is not ignore_index) from the same tokens and targets on every rank, with this
        # rank's columns of the logits only. The tests compare the loss and every parameter's
        # gradient with one process's (2 and 4 ranks, subgroups), count the calls forward and
        # backward, and hold it against torch's parallelize_module under loss_parallel.
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        # every rank's output columns read the same hidden state: its gradient is their sum
        hidden = CopyToVocabParallelRegion.apply(self.norm(x), self.process_group)
        logits = self.output(hidden)  # (batch, sequence, V/N): my columns, never gathered
        return vocab_parallel_cross_entropy(logits, targets, self.process_group, ignore_index)
        # END STEP 5


def bytes_per_step(tokens: int, dim: int, element_size: int = 4) -> dict[str, int]:
    """The bytes one rank puts into collectives in one training step of a ``VocabParallelLM`` of
    width ``dim`` on ``tokens`` tokens (``element_size`` bytes a float): ``{"forward": ...,
    "backward": ...}``."""
    # BEGIN STEP 5: the split TinyTransformer, and what a step sends
    # TODO: {"forward": bytes, "backward": bytes}: what one rank's collectives carry in forward and
    # in backward of one VocabParallelLM step, from the numbers given. The tests record a step on 2
    # ranks with a vocabulary of 32 and one of 256 and compare.
    hidden = tokens * dim * element_size  # the embedding's sum; the hidden state's gradient
    return {"forward": hidden + 3 * tokens * element_size, "backward": hidden}
    # END STEP 5


# --------------------------------------------------------------------------- the program

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
)


def _tokens(batch: int, length: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and targets, the last position of every sequence padding (ignore_index)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, length), generator=generator)
    targets = torch.randint(0, vocab, (batch, length), generator=generator)
    targets[:, -1] = IGNORE_INDEX
    return tokens, targets


def _counted(run) -> tuple[object, list[tuple[str, int]]]:
    """``run()``'s result and this rank's collectives meanwhile: each one's name (and op) and the
    bytes of the tensors it was given."""
    calls = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, original):
        def counted(*args, **kwargs):
            given = [*args, *kwargs.values()]
            tensors = [t for a in given for t in (a if isinstance(a, list) else [a])]
            size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            op = kwargs.get("op")
            calls.append((f"{name}({op.name})" if op is not None else name, size))
            return original(*args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        return run(), calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def show_split(rank: int, world_size: int, args) -> dict:
    """One training step's loss and gradients, split over the vocabulary and on one process."""
    device = rank_device()
    torch.manual_seed(args.seed)  # the same model on every rank
    dense = TinyTransformer(blocks=args.blocks, dim=args.dim, vocabulary=args.vocab).to(device)
    tokens, targets = (
        t.to(device) for t in _tokens(args.batch, args.length, args.vocab, args.seed)
    )
    split = VocabParallelLM(dense)
    loss, forward = _counted(lambda: split(tokens, targets))
    _, backward = _counted(loss.backward)
    logits = dense(tokens)
    expected = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
    expected.backward()
    start, end = vocab_range(args.vocab)
    dense_params = dict(dense.named_parameters())
    gaps = {"loss": (loss - expected).abs().item()}
    for name, param in split.named_parameters():
        want = dense_params[name].grad
        if name in ("embedding.weight", "output.weight", "output.bias"):
            want = want[start:end]  # my rows of the vocabulary tables
        gaps[name] = (param.grad - want).abs().max().item()
    return {
        "rows": (start, end),
        "loss": loss.item(),
        "expected": expected.item(),
        "gaps": gaps,
        "forward": forward,
        "backward": backward,
        "formula": bytes_per_step(tokens.numel(), args.dim, 4),
        "logits": logits.numel() // world_size * 4,
        "gathered": logits.numel() * 4,
    }


def _listed(calls) -> str:
    return ", ".join(f"{name} {size:,}" for name, size in calls) or "nothing"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="The vocabulary split: a TinyTransformer whose embedding and output layer "
        "are split over the ranks, its loss computed without gathering the logits."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--vocab", type=int, default=32000, help="words (default 32000)")
    parser.add_argument("--dim", type=int, default=64, help="the model's width (default 64)")
    parser.add_argument("--blocks", type=int, default=1, help="its blocks (default 1)")
    parser.add_argument("--batch", type=int, default=4, help="sequences (default 4)")
    parser.add_argument("--length", type=int, default=32, help="tokens a sequence (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for option, value, least in (
        ("--vocab", args.vocab, 1),
        ("--dim", args.dim, 4),
        ("--blocks", args.blocks, 1),
        ("--batch", args.batch, 1),
        ("--length", args.length, 2),  # the last position of each sequence is padding
    ):
        if value < least:
            parser.error(f"{option} must be at least {least}")
    if args.dim % 4:
        parser.error(f"--dim {args.dim} must divide by the TinyTransformer's 4 heads")
    if args.world_size >= 1 and args.vocab % args.world_size:
        parser.error(
            f"--vocab {args.vocab} does not split over {args.world_size} ranks: choose a "
            f"multiple of {args.world_size} (a real run pads its vocabulary so)"
        )
    tokens = args.batch * args.length
    say(
        None,
        f"a TinyTransformer of {args.blocks} block(s), width {args.dim}, vocabulary "
        f"{args.vocab:,}, its embedding and output layer split over {args.world_size} ranks; "
        f"{args.batch} x {args.length} = {tokens} tokens, the last of each sequence padding",
    )
    results = launch_world(
        show_split, args.world_size, args, backend=args.backend, device=args.device
    )
    bytes_right = True
    for rank, got in enumerate(results):
        start, end = got["rows"]
        say(
            rank,
            f"rows {start}..{end - 1}: loss {got['loss']:.6f}, one process {got['expected']:.6f}",
        )
        for way in ("forward", "backward"):
            sent, formula = sum(b for _, b in got[way]), got["formula"][way]
            bytes_right &= sent == formula
            say(
                rank,
                f"{way}: {_listed(got[way])}: {sent:,} bytes in all (bytes_per_step: {formula:,})",
            )
    first = results[0]
    say(
        None,
        f"logits a rank holds: {first['logits']:,} bytes, gathered {first['gathered']:,}; an "
        f"all-gather of them would bring each rank {first['gathered'] - first['logits']:,} bytes, "
        f"the loss's all-reduces sent {3 * tokens * 4:,}",
    )
    if not bytes_right:
        say(None, "the bytes the ranks sent differ from what bytes_per_step says")
        return 1
    worst = max(gap for got in results for gap in got["gaps"].values())
    return verdict(
        worst,
        "the loss and every gradient equal one process's",
        "the vocabulary split differs from one process",
    )


if __name__ == "__main__":
    run_program(main)
