"""k34's mistakes catalogue: real mistakes in splitting a model's vocabulary (this rank's rows,
the masked embedding and its sum, the loss from three scalars per token, its gradient, the split
TinyTransformer and its bytes), and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises.

Autograd functions and modules are whole classes (subclasses of the reference with one method
done the way a learner might): the catalogue swaps whole classes.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k34_vocab_parallel as reference

# The reference's own, kept before any entry is swapped in (an entry that calls
# reference.vocab_range while it replaces vocab_range would call itself).
vocab_range = reference.vocab_range
vocab_shard = reference.vocab_shard


def _k34():
    """The reference module, with this entry swapped in (what every test and rank sees)."""
    from dojo.harness import impl

    return impl.load_kata("k34_vocab_parallel")


# --------------------------------------------------------------------------- step 1


def range_world_rank(vocab_size, group=None):
    size, rank = dist.get_world_size(group), dist.get_rank()  # the world's rank
    if vocab_size % size:
        raise ValueError(f"{vocab_size} words do not split over {size} ranks")
    share = vocab_size // size
    return rank * share, (rank + 1) * share


def range_unchecked(vocab_size, group=None):
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    share = vocab_size // size  # 30 // 4 = 7: two words belong to no rank
    return rank * share, (rank + 1) * share


def range_last_takes_the_rest(vocab_size, group=None):
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    share = vocab_size // size
    end = vocab_size if rank == size - 1 else (rank + 1) * share  # the last rank a bigger table
    return rank * share, end


def range_with_chunks(vocab_size, group=None):
    """Right: the bounds of torch.chunk's pieces, the check first."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if vocab_size % size:
        raise ValueError(
            f"cannot give {size} ranks equal parts of {vocab_size} words: pad the vocabulary "
            f"to a multiple of {size}"
        )
    piece = torch.arange(vocab_size).chunk(size)[rank]
    return int(piece[0]), int(piece[-1]) + 1


def shard_a_view(table, group=None):
    start, end = _k34().vocab_range(table.shape[0], group)
    return table.detach()[start:end]  # a view: the whole table stays alive


def shard_columns(table, group=None):
    start, end = _k34().vocab_range(table.shape[-1], group)
    return table.detach()[..., start:end].clone()  # the last dimension, not the rows


def shard_with_narrow(table, group=None):
    """Right: narrow along dim 0, then a copy in memory of its own."""
    start, end = _k34().vocab_range(table.shape[0], group)
    return table.detach().narrow(0, start, end - start).contiguous().clone()


# --------------------------------------------------------------------------- step 2

_Reduce = reference.ReduceFromVocabParallelRegion


class ReduceOnTheWorld(_Reduce):
    @staticmethod
    def forward(ctx, x, group):
        total = x.clone()
        dist.all_reduce(total)  # the group not passed: the whole world
        return total


class _Embedding(reference.VocabParallelEmbedding):
    """The reference's embedding, a learner's way: ``how`` says which."""

    how = ""

    def forward(self, tokens):
        k34 = _k34()
        if self.how != "unchecked" and tokens.numel():
            if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
                wrong = tokens[(tokens < 0) | (tokens >= self.vocab_size)][0].item()
                raise ValueError(f"token {wrong} is outside the vocabulary of {self.vocab_size}")
        outside = (tokens < self.start) | (tokens >= self.end)
        if self.how == "clamped":
            local = (tokens - self.start).clamp(0, self.end - self.start - 1)
        else:
            local = torch.where(outside, 0, tokens - self.start)
        rows = F.embedding(local, self.weight)
        if self.how == "no grad":
            with torch.no_grad():
                rows[outside] = 0.0  # the values zeroed, autograd never told
        elif self.how not in ("not zeroed", "clamped"):
            rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.how == "not summed":
            return rows
        if self.how == "dist.nn":
            from torch.distributed.nn.functional import all_reduce

            return all_reduce(rows, group=self.process_group or dist.group.WORLD)
        return k34.ReduceFromVocabParallelRegion.apply(rows, self.process_group)


class EmbeddingNotSummed(_Embedding):
    how = "not summed"


class EmbeddingNotZeroed(_Embedding):
    how = "not zeroed"


class EmbeddingClamped(_Embedding):
    how = "clamped"


class EmbeddingZeroedWithoutGrad(_Embedding):
    how = "no grad"


class EmbeddingWithDistNn(_Embedding):
    how = "dist.nn"


class EmbeddingUnchecked(_Embedding):
    how = "unchecked"


class EmbeddingByMultiplying(reference.VocabParallelEmbedding):
    """Right: the lookup multiplied by the ownership mask, the sum all-reduced in place on a
    detached copy inside an autograd function of its own (identity backward)."""

    def forward(self, tokens):
        wrong = tokens[(tokens < 0) | (tokens >= self.vocab_size)]
        if wrong.numel():
            raise ValueError(f"tokens {wrong.tolist()} are not among the {self.vocab_size} words")
        mine = (tokens >= self.start) & (tokens < self.end)
        rows = self.weight[(tokens - self.start) * mine] * mine.unsqueeze(-1).to(self.weight.dtype)
        return _SumForward.apply(rows, self.process_group)


class _SumForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --------------------------------------------------------------------------- steps 3 and 4

_Loss = reference.VocabParallelCrossEntropy


def _forward(ctx, logits, targets, group, ignore_index, how=""):
    """The reference's forward, a learner's way: ``how`` says which."""
    size = dist.get_world_size(group)
    vocab = logits.shape[-1] * size
    start, end = _k34().vocab_range(vocab, group)
    target = targets.reshape(-1)
    counted = target != ignore_index
    if how != "unchecked":
        if tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"targets {tuple(targets.shape)} for logits {tuple(logits.shape)}")
        wrong = counted & ((target < 0) | (target >= vocab))
        if wrong.any():
            raise ValueError(
                f"target {target[wrong][0].item()} is no word of the {vocab} (0..{vocab - 1})"
            )
    flat = logits.reshape(-1, logits.shape[-1])
    largest = flat.max(dim=1).values
    if how not in ("own max", "no max"):
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    if how in ("no max", "max not subtracted"):
        shifted = flat.clone()  # exp(z) itself
        largest = torch.zeros_like(largest)
    else:
        shifted = flat - largest.unsqueeze(1)
    mine = (target >= start) & (target < end)
    column = torch.where(mine, target - start, 0)
    picked = shifted.gather(1, column.unsqueeze(1)).squeeze(1)
    target_shifted = picked if how == "target unmasked" else torch.where(mine, picked, 0.0)
    softmax = shifted.exp_()
    total = softmax.sum(dim=1)
    dist.all_reduce(total, group=group)
    dist.all_reduce(target_shifted, group=group)
    losses = total.log() - target_shifted
    if how != "ignored not masked":
        losses = torch.where(counted, losses, 0.0)
    count = counted.sum()
    softmax.div_(total.unsqueeze(1))
    ctx.save_for_backward(softmax, column, mine & counted, counted, count)
    ctx.shape = logits.shape
    if how == "sum":
        return losses.sum()
    if how in ("every token", "ignored not masked"):
        return losses.sum() / target.numel()
    return losses.sum() / count


class LossSumNotMean(_Loss):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _forward(ctx, logits, targets, group, ignore_index, "sum")


class LossMeanOverEveryToken(_Loss):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _forward(ctx, logits, targets, group, ignore_index, "every token")


class LossIgnoredNotMasked(_Loss):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _forward(ctx, logits, targets, group, ignore_index, "ignored not masked")


class LossOwnMax(_Loss):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _forward(ctx, logits, targets, group, ignore_index, "own max")


class LossTargetUnmasked(_Loss):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _forward(ctx, logits, targets, group, ignore_index, "target unmasked")


class LossWithoutTheMax(_Loss):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _forward(ctx, logits, targets, group, ignore_index, "no max")


class LossMaxNotSubtracted(_Loss):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _forward(ctx, logits, targets, group, ignore_index, "max not subtracted")


class LossUnchecked(_Loss):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _forward(ctx, logits, targets, group, ignore_index, "unchecked")


class LossGathersTheLogits(_Loss):
    """ "The loss needs every logit": gathered, then F.cross_entropy on one rank's copy."""

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        vocab = logits.shape[-1] * size
        if tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"targets {tuple(targets.shape)} for logits {tuple(logits.shape)}")
        wrong = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
        if wrong.any():
            raise ValueError(f"target {targets[wrong][0].item()}: not a word of the {vocab}")
        flat = logits.reshape(-1, logits.shape[-1]).contiguous()
        pieces = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(pieces, flat, group=group)
        whole = torch.cat(pieces, dim=1)
        target = targets.reshape(-1)
        ctx.save_for_backward(whole, target)
        ctx.shape, ctx.rank, ctx.ignore = logits.shape, rank, ignore_index
        return F.cross_entropy(whole, target, ignore_index=ignore_index)

    @staticmethod
    def backward(ctx, grad):
        whole, target = ctx.saved_tensors
        with torch.enable_grad():
            leaf = whole.detach().requires_grad_()
            F.cross_entropy(leaf, target, ignore_index=ctx.ignore).backward(grad)
        per = ctx.shape[-1]
        mine = leaf.grad[:, ctx.rank * per : (ctx.rank + 1) * per]
        return mine.reshape(ctx.shape), None, None, None


class _Backward(_Loss):
    """The reference's forward, and its backward a learner's way: ``how`` says which."""

    how = ""

    @classmethod
    def gradient(cls, ctx, grad):
        softmax, column, hit, counted, count = ctx.saved_tensors
        weights = counted.to(softmax.dtype)
        if cls.how == "ignored":
            weights = torch.ones_like(weights)
        scale = weights * grad if cls.how == "not divided" else weights * (grad / count)
        if cls.how == "no upstream":
            scale = weights / count
        result = softmax * scale.unsqueeze(1)
        rows = torch.arange(result.shape[0])
        which = counted if cls.how == "everywhere" else hit
        if cls.how != "no one-hot":
            result[rows[which], column[which]] -= scale[which]
        return result.view(ctx.shape), None, None, None


class GradNotDivided(_Backward):
    how = "not divided"

    @staticmethod
    def backward(ctx, grad):
        return GradNotDivided.gradient(ctx, grad)


class GradIgnoresUpstream(_Backward):
    how = "no upstream"

    @staticmethod
    def backward(ctx, grad):
        return GradIgnoresUpstream.gradient(ctx, grad)


class GradToIgnoredTokens(_Backward):
    how = "ignored"

    @staticmethod
    def backward(ctx, grad):
        return GradToIgnoredTokens.gradient(ctx, grad)


class GradWithoutOneHot(_Backward):
    how = "no one-hot"

    @staticmethod
    def backward(ctx, grad):
        return GradWithoutOneHot.gradient(ctx, grad)


class GradOneHotOnEveryRank(_Backward):
    how = "everywhere"

    @staticmethod
    def backward(ctx, grad):
        return GradOneHotOnEveryRank.gradient(ctx, grad)


def _recomputing_forward(ctx, logits, targets, group, ignore_index):
    """The loss as the reference makes it, keeping the logits (and per-token m and s) in place
    of the softmax, to make the softmax again in backward."""
    flat = logits.reshape(-1, logits.shape[-1])
    size = dist.get_world_size(group)
    start, end = _k34().vocab_range(flat.shape[1] * size, group)
    target = targets.reshape(-1)
    counted = target != ignore_index
    wrong = counted & ((target < 0) | (target >= flat.shape[1] * size))
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets {tuple(targets.shape)} for logits {tuple(logits.shape)}")
    if wrong.any():
        raise ValueError(
            f"target {target[wrong][0].item()} is outside a vocabulary of {flat.shape[1] * size}"
        )
    largest = flat.max(dim=1).values
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    mine = (target >= start) & (target < end)
    column = torch.where(mine, target - start, 0)
    picked = flat.gather(1, column.unsqueeze(1)).squeeze(1) - largest
    picked = torch.where(mine, picked, 0.0)
    total = (flat - largest.unsqueeze(1)).exp().sum(dim=1)
    both = torch.stack([total, picked])  # one SUM all-reduce for both sums
    dist.all_reduce(both, group=group)
    total, picked = both[0], both[1]
    count = counted.sum()
    ctx.save_for_backward(flat, largest, total, column, mine & counted, counted, count)
    ctx.shape, ctx.group = logits.shape, group
    return torch.where(counted, total.log() - picked, 0.0).sum() / count


def _recomputed_gradient(ctx, grad, softmax):
    _, _, _, column, hit, counted, count = ctx.saved_tensors
    scale = counted.to(softmax.dtype) * (grad / count)
    result = softmax * scale.unsqueeze(1)
    rows = torch.arange(result.shape[0])
    result[rows[hit], column[hit]] -= scale[hit]
    return result.view(ctx.shape), None, None, None


class LossRecomputedWithCalls(_Loss):
    """Keeps the logits to save memory, then makes the group's max and sum again in backward."""

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _recomputing_forward(ctx, logits, targets, group, ignore_index)

    @staticmethod
    def backward(ctx, grad):
        flat = ctx.saved_tensors[0]
        largest = flat.max(dim=1).values
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ctx.group)
        exp = (flat - largest.unsqueeze(1)).exp()
        total = exp.sum(dim=1)
        dist.all_reduce(total, group=ctx.group)
        return _recomputed_gradient(ctx, grad, exp / total.unsqueeze(1))


class LossRecomputes(_Loss):
    """Right: one SUM all-reduce for both sums; the logits, m and s kept, and the softmax made
    again in backward from them (the group's m and s: nothing sent)."""

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        return _recomputing_forward(ctx, logits, targets, group, ignore_index)

    @staticmethod
    def backward(ctx, grad):
        flat, largest, total = ctx.saved_tensors[:3]
        softmax = (flat - largest.unsqueeze(1)).exp() / total.unsqueeze(1)
        return _recomputed_gradient(ctx, grad, softmax)


class LossKeepsLogitsAndSoftmax(_Loss):
    """Keeps the softmax, and the logits too ("backward might need them")."""

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        loss = _Loss.forward(ctx, logits, targets, group, ignore_index)
        ctx.logits = logits.reshape(-1, logits.shape[-1])  # kept alive until backward
        return loss


class LossWithLogSoftmax(_Loss):
    """Right: the log-softmax of the columns (z - m - log s), its target term gathered; backward
    from exp(log-softmax), kept in place of the softmax."""

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        size = dist.get_world_size(group)
        vocab = logits.shape[-1] * size
        start, end = _k34().vocab_range(vocab, group)
        target = targets.reshape(-1)
        counted = target != ignore_index
        if tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"targets {tuple(targets.shape)} for logits {tuple(logits.shape)}")
        wrong = counted & ((target < 0) | (target >= vocab))
        if wrong.any():
            raise ValueError(f"{target[wrong].tolist()}: not words of a vocabulary of {vocab}")
        flat = logits.reshape(-1, logits.shape[-1])
        largest = flat.amax(dim=1, keepdim=True)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        sums = (flat - largest).exp().sum(dim=1, keepdim=True)
        dist.all_reduce(sums, group=group)
        log_softmax = flat - largest - sums.log()
        mine = (target >= start) & (target < end)
        column = torch.where(mine, target - start, 0).unsqueeze(1)
        own = log_softmax.gather(1, column).squeeze(1) * mine
        dist.all_reduce(own, group=group)
        count = counted.sum()
        ctx.save_for_backward(log_softmax.exp_(), column.squeeze(1), mine & counted, counted, count)
        ctx.shape = logits.shape
        return -(own * counted).sum() / count


# --------------------------------------------------------------------------- step 5

_Copy = reference.CopyToVocabParallelRegion


class CopyOnTheWorld(_Copy):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)  # the whole world, not the model's group
        return grad, None


class LMWithoutF(reference.VocabParallelLM):
    def forward(self, tokens, targets, ignore_index=-100):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.output(self.norm(x))  # the hidden state's gradient: this rank's share
        return _k34().vocab_parallel_cross_entropy(
            logits, targets, self.process_group, ignore_index
        )


class LMShardsInPlace(reference.VocabParallelLM):
    """Right: the output layer a copy of the model's, its parameters replaced by the shards;
    the blocks run as one Sequential."""

    def __init__(self, model, process_group=None):
        nn.Module.__init__(self)
        k34 = _k34()
        self.process_group = process_group
        self.embedding = k34.VocabParallelEmbedding(model.embedding, process_group)
        self.blocks = copy.deepcopy(model.blocks)
        self.norm = copy.deepcopy(model.norm)
        self.output = nn.Linear(1, 1)
        self.output.weight = nn.Parameter(k34.vocab_shard(model.output.weight, process_group))
        self.output.bias = nn.Parameter(k34.vocab_shard(model.output.bias, process_group))

    def forward(self, tokens, targets, ignore_index=-100):
        k34 = _k34()
        hidden = self.norm(nn.Sequential(*self.blocks)(self.embedding(tokens)))
        hidden = k34.CopyToVocabParallelRegion.apply(hidden, self.process_group)
        logits = F.linear(hidden, self.output.weight, self.output.bias)
        return k34.vocab_parallel_cross_entropy(logits, targets, self.process_group, ignore_index)


def bytes_without_backward(tokens, dim, element_size=4):
    return {"forward": tokens * dim * element_size + 3 * tokens * element_size, "backward": 0}


def bytes_one_float_for_the_loss(tokens, dim, element_size=4):
    hidden = tokens * dim * element_size
    return {"forward": hidden + tokens * element_size, "backward": hidden}  # "the loss: one"


def bytes_term_by_term(tokens, dim, element_size=4):
    """Right: every collective named, then added up."""
    forward = {
        "embedding's sum": tokens * dim,
        "max": tokens,
        "exp sums": tokens,
        "targets": tokens,
    }
    backward = {"hidden state's gradient": tokens * dim}
    return {
        "forward": sum(forward.values()) * element_size,
        "backward": sum(backward.values()) * element_size,
    }


_RANGE = "test_vocab_range_gives_each_rank_its_rows_in_group_order"
_SHARD = "test_vocab_shard_copies_this_ranks_rows"
_REFUSED = "test_a_vocabulary_that_does_not_divide_is_refused"
_EMBED = "test_embedding_equals_the_dense_lookup_with_one_all_reduce"
_EMBED_BACK = "test_embedding_backward_sends_nothing_and_gives_each_rank_its_rows_gradient"
_EMBED_REFUSED = "test_embedding_refuses_tokens_outside_the_vocabulary"
_TARGETS = "test_loss_refuses_bad_targets"
_LOSS = "test_loss_equals_cross_entropy_of_the_whole_logits"
_SCALARS = "test_loss_sends_three_scalars_per_token_never_the_logits"
_STABLE = "test_loss_is_stable_for_logits_of_1000"
_GRAD = "test_gradient_is_softmax_minus_one_hot"
_NOTHING = "test_backward_sends_nothing"
_KEPT = "test_backward_keeps_one_shard_of_the_softmax"
_LM = "test_split_model_equals_one_process"
_BYTES = "test_bytes_per_step_is_what_a_step_sends"

MISTAKES = [
    Mistake(
        "range_world_rank",
        replaces="vocab_range",
        fails=[f"{_RANGE}[4-rows]"],
        says=["ranks IN THE GROUP", "dist.get_rank(group)"],
    ),
    Mistake(
        "range_unchecked",
        replaces="vocab_range",
        fails=[_REFUSED],
        says=["30 words do not split over 4 ranks", "Raise ValueError"],
    ),
    Mistake(
        "range_last_takes_the_rest",
        replaces="vocab_range",
        fails=[_REFUSED],
        says=["30 words do not split over 4 ranks", "Raise ValueError"],
    ),
    Mistake(
        "shard_a_view",
        replaces="vocab_shard",
        fails=[_SHARD],
        says=["keeps all of it alive", ".clone() the rows"],
    ),
    Mistake(
        "shard_columns",
        replaces="vocab_shard",
        fails=[_SHARD],
        says=["is not its rows", "along dim 0"],
    ),
    Mistake(
        "EmbeddingNotSummed",
        replaces="VocabParallelEmbedding",
        fails=[_EMBED],
        says=["that is this rank's partial", "sum the partials over the group"],
    ),
    Mistake(
        "EmbeddingNotZeroed",
        replaces="VocabParallelEmbedding",
        fails=[_EMBED],
        says=["(row 0)", "Zero the rows of the tokens outside this rank's rows"],
    ),
    Mistake(
        "EmbeddingClamped",
        replaces="VocabParallelEmbedding",
        fails=[_EMBED],
        says=["(clamped)", "Zero the rows of the tokens outside this rank's rows"],
    ),
    Mistake(
        "ReduceOnTheWorld",
        replaces="ReduceFromVocabParallelRegion",
        fails=[f"{_EMBED}[4-rows]"],
        says=["twice the embedding", "pass the layer's process group"],
    ),
    Mistake(
        "EmbeddingWithDistNn",
        replaces="VocabParallelEmbedding",
        fails=[_EMBED_BACK],
        says=["is 2 times the dense one's rows", "g has an identity backward"],
    ),
    Mistake(
        "EmbeddingZeroedWithoutGrad",
        replaces="VocabParallelEmbedding",
        fails=[_EMBED_BACK],
        says=["sent their gradient there", "not under torch.no_grad()"],
    ),
    Mistake(
        "EmbeddingUnchecked",
        replaces="VocabParallelEmbedding",
        fails=[_EMBED_REFUSED],
        says=["no rank owns a row for 32", "Raise ValueError"],
    ),
    Mistake(
        "LossUnchecked",
        replaces="VocabParallelCrossEntropy",
        fails=[_TARGETS],
        says=["32 is no word of a vocabulary of 32", "Raise ValueError"],
    ),
    Mistake(
        "LossSumNotMean",
        replaces="VocabParallelCrossEntropy",
        fails=[_LOSS],
        says=[
            "the sum over the counted tokens",
            "the number of tokens whose target is not ignore_index",
        ],
    ),
    Mistake(
        "LossMeanOverEveryToken",
        replaces="VocabParallelCrossEntropy",
        fails=[_LOSS],
        says=["the ignored ones counted", "divide by the counted tokens"],
    ),
    Mistake(
        "LossIgnoredNotMasked",
        replaces="VocabParallelCrossEntropy",
        fails=[_LOSS],
        says=["the ignored ones adding log(sum of exp) each", "adds nothing to the sum"],
    ),
    Mistake(
        "LossOwnMax",
        replaces="VocabParallelCrossEntropy",
        fails=[_LOSS],
        says=["shifted its logits by its own max", "all-reduce the max first (op=MAX)"],
    ),
    Mistake(
        "LossTargetUnmasked",
        replaces="VocabParallelCrossEntropy",
        fails=[_LOSS],
        says=["added a logit of its own as the target's", "every other rank gives 0"],
    ),
    Mistake(
        "LossGathersTheLogits",
        replaces="VocabParallelCrossEntropy",
        fails=[_SCALARS],
        says=["gathers the logits", "three numbers per token"],
    ),
    Mistake(
        "LossWithoutTheMax",
        replaces="VocabParallelCrossEntropy",
        fails=[_SCALARS],
        says=["no all-reduce with op MAX", "exp(z) overflows"],
    ),
    Mistake(
        "LossMaxNotSubtracted",
        replaces="VocabParallelCrossEntropy",
        fails=[_STABLE],
        says=["exp(1000) overflows float32", "Subtract the group's max"],
    ),
    Mistake(
        "GradNotDivided",
        replaces="VocabParallelCrossEntropy",
        fails=[_GRAD],
        says=["not divided by the count of counted tokens", "the loss is a mean"],
    ),
    Mistake(
        "GradIgnoresUpstream",
        replaces="VocabParallelCrossEntropy",
        fails=[_GRAD],
        says=["not multiplied by the upstream gradient", "multiply by it (here 2.5)"],
    ),
    Mistake(
        "GradToIgnoredTokens",
        replaces="VocabParallelCrossEntropy",
        fails=[_GRAD],
        says=["the ignored tokens (target -100) given the softmax", "its logits' gradient is 0"],
    ),
    Mistake(
        "GradWithoutOneHot",
        replaces="VocabParallelCrossEntropy",
        fails=[_GRAD],
        says=["the one-hot never taken off", "take 1 off at the target's column"],
    ),
    Mistake(
        "GradOneHotOnEveryRank",
        replaces="VocabParallelCrossEntropy",
        fails=[f"{_GRAD}[2]", f"{_GRAD}[4]"],
        says=["1 taken off on every rank", "only the rank whose columns hold the target"],
    ),
    Mistake(
        "LossRecomputedWithCalls",
        replaces="VocabParallelCrossEntropy",
        fails=[_NOTHING],
        says=["the loss's backward called", "send nothing in backward"],
    ),
    Mistake(
        "LossKeepsLogitsAndSoftmax",
        replaces="VocabParallelCrossEntropy",
        fails=[_KEPT],
        says=["keep ONE tensor of that size", "not both"],
    ),
    Mistake(
        "LMWithoutF",
        replaces="VocabParallelLM",
        fails=[_LM],
        says=["this rank's share only", "put k20's f"],
    ),
    Mistake(
        "CopyOnTheWorld",
        replaces="CopyToVocabParallelRegion",
        fails=[f"{_LM}[4-rows]"],
        says=["summed over the whole world", "the model's group"],
    ),
    Mistake(
        "bytes_without_backward",
        replaces="bytes_per_step",
        fails=[_BYTES],
        says=["backward the hidden state's gradient"],
    ),
    Mistake(
        "bytes_one_float_for_the_loss",
        replaces="bytes_per_step",
        fails=[_BYTES],
        says=["the loss's three floats a token"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("range_with_chunks", replaces="vocab_range"),
    RightAnswer("shard_with_narrow", replaces="vocab_shard"),
    RightAnswer("EmbeddingByMultiplying", replaces="VocabParallelEmbedding"),
    RightAnswer("LossRecomputes", replaces="VocabParallelCrossEntropy", steps=(3, 4)),
    RightAnswer("LossWithLogSoftmax", replaces="VocabParallelCrossEntropy", steps=(3, 4)),
    RightAnswer("LMShardsInPlace", replaces="VocabParallelLM"),
    RightAnswer("bytes_term_by_term", replaces="bytes_per_step"),
]
