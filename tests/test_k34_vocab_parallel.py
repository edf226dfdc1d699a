"""k34 the vocabulary split: this rank's rows, the vocab-parallel embedding, the loss from three
scalars per token, its gradient with nothing sent, the split TinyTransformer and its bytes."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec.testing import require_gpus, run_module, shared_run
from dojo.todo import KataTodo

KATA = "k34_vocab_parallel"

# Worlds: the whole world of 2 or 4 ranks, or 4 ranks as two groups [0, 1] and [2, 3] (a grid's
# rows, k17): rank and size come from the group, never from the world.
WORLDS = {"2": (2, None), "4": (4, None), "4-rows": (4, [[0, 1], [2, 3]])}
VOCAB, DIM = 32, 8  # the TinyTransformer's vocabulary; 16, 8 or 4 rows a rank
IGNORE = -100  # F.cross_entropy's ignore_index
# Twelve tokens' targets: words of every rank's rows (the edges too), and two ignored tokens.
TARGETS = torch.tensor([[3, 17, IGNORE, 31, 9, 24], [0, 30, 15, 16, IGNORE, 8]])
# A loss adds its terms in another order than F.cross_entropy (per rank, then over the ranks):
# compared to a close tolerance. Lookups and masks move values unchanged: compared exactly.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _group(rank: int, world_size: int, groups):
    """``(group, members)``: the world (None) or this rank's row; every rank makes every group."""
    import torch.distributed as dist

    if groups is None:
        return None, list(range(world_size))
    made = [dist.new_group(ranks) for ranks in groups]
    index = next(i for i, ranks in enumerate(groups) if rank in ranks)
    return made[index], groups[index]


def _where(world: str) -> str:
    world_size, groups = WORLDS[world]
    if groups is None:
        return f"on {world_size} ranks"
    return f"in the groups {groups[0]} and {groups[1]} of a world of {world_size}"


def _calls(calls, group) -> list[tuple[str, str | None, str, int]]:
    """Each recorded call: its name, its op, its group (in words) and the bytes it carried."""
    import torch.distributed as dist

    def which(g):
        if g is group or (group is None and g is dist.group.WORLD):
            return "the group"
        if g is None or g is dist.group.WORLD:
            return "the whole world"
        return "another group"

    return [(c.name, c.op, which(c.group), c.bytes) for c in calls if c.name != "new_group"]


def _names(calls) -> list[str]:
    return [f"{name}({op})" if op else name for name, op, _, _ in calls]


def _fail(rank: int, what: str, error: Exception) -> str:
    return f"rank {rank}: {what} raised {type(error).__name__}: {str(error).strip()[:500]}"


def _close(a, b) -> bool:
    return a is not None and a.shape == b.shape and torch.allclose(a, b, **TOLERANCE)


def _gap(a, b) -> str:
    if a is None:
        return "None"
    if a.shape != b.shape:
        return f"shaped {tuple(a.shape)}, expected {tuple(b.shape)}"
    return f"largest difference {(a.double() - b.double()).abs().max().item():.3g}"


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _refusal(call) -> tuple[str | None, str | None, list]:
    """``(what it did instead, the ValueError's text, the names of the calls made)`` for a call
    that must raise ValueError before any communication."""
    with recording() as calls:
        try:
            value = call()
        except ValueError as error:
            return None, str(error), [c.name for c in calls]
        except KataTodo:
            raise
        except Exception as error:
            failed = f"raised {type(error).__name__}: {str(error)[:300]}"
            return failed, None, [c.name for c in calls]
    shown = tuple(value.shape) if hasattr(value, "shape") else value
    return f"returned {shown}", None, [c.name for c in calls]


def _check_refused(rank: int, what: str, outcome, names: list[str], why: str) -> None:
    did, message, calls = outcome
    assert did is None, f"rank {rank}: {what} {did}: {why}. Raise ValueError saying so"
    assert not calls, (
        f"rank {rank}: {what} raised ValueError, but only after calling {calls}: "
        "refuse before anything is sent (the other ranks may not refuse, and would wait)"
    )
    missing = [n for n in names if n not in message]
    assert not missing, (
        f"rank {rank}: {what} raised ValueError({message!r}): name {', '.join(names)} "
        "(what was wrong), and say what to do"
    )


# --------------------------------------------------------------------------- step 1


def _rows(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members = _group(rank, world_size, groups)
    out = {"members": members, "index": members.index(rank)}
    table = torch.arange(VOCAB * DIM, dtype=torch.float32).view(VOCAB, DIM)
    bias = torch.arange(VOCAB, dtype=torch.float32) - 0.5
    for name, call in (
        ("range", lambda: kata.vocab_range(VOCAB, group)),
        ("shard", lambda: kata.vocab_shard(table, group)),
        ("bias", lambda: kata.vocab_shard(nn.Parameter(bias.clone()), group)),
    ):
        try:
            out[name] = call()
        except KataTodo:
            raise
        except Exception as error:
            out[name] = _fail(rank, f"vocab_{name if name == 'range' else 'shard'}", error)
    for name in ("shard", "bias"):
        got = out[name]
        if isinstance(got, torch.Tensor):
            shares = got.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
            out[name] = {
                "value": got.detach().clone(),
                "storage": got.untyped_storage().nbytes(),
                "shares": shares,
            }
    if world_size == 4 and groups is None:  # 30 words on 4 ranks
        out["refused"] = {
            "vocab_range(30)": _refusal(lambda: kata.vocab_range(30, None)),
            "vocab_shard of a (30, 8) table": _refusal(
                lambda: kata.vocab_shard(torch.zeros(30, DIM), None)
            ),
        }
    return out


_rows_world = shared_run(lambda world: run_world(_rows, *WORLDS[world]))


@pytest.mark.step(1)
@pytest.mark.parametrize("world", list(WORLDS))
def test_vocab_range_gives_each_rank_its_rows_in_group_order(kata, world):
    where = _where(world)
    for rank, got in enumerate(_rows_world(world)):
        if isinstance(got["range"], str):
            raise AssertionError(got["range"])
        size, index = len(got["members"]), got["index"]
        per = VOCAB // size
        expected = (index * per, (index + 1) * per)
        assert tuple(got["range"]) == expected, (
            f"rank {rank} (rank {index} of its group {got['members']}): vocab_range({VOCAB}) is "
            f"{got['range']}, expected {expected} {where}: equal shares of the rows in the order "
            "of the ranks IN THE GROUP, dist.get_rank(group) (the world rank is another number "
            "in a subgroup)"
        )


@pytest.mark.step(1)
@pytest.mark.parametrize("world", ["2", "4-rows"])
def test_vocab_shard_copies_this_ranks_rows(kata, world):
    where = _where(world)
    table = torch.arange(VOCAB * DIM, dtype=torch.float32).view(VOCAB, DIM)
    bias = torch.arange(VOCAB, dtype=torch.float32) - 0.5
    for rank, got in enumerate(_rows_world(world)):
        size, index = len(got["members"]), got["index"]
        per = VOCAB // size
        rows = slice(index * per, (index + 1) * per)
        for name, whole in (("shard", table), ("bias", bias)):
            done = got[name]
            if isinstance(done, str):
                raise AssertionError(done)
            shape = tuple(whole.shape)
            assert torch.equal(done["value"], whole[rows]), (
                f"rank {rank}: vocab_shard of a {shape} table is not its rows "
                f"{rows.start}..{rows.stop - 1} ({_gap(done['value'], whole[rows])}) {where}: "
                "the rows vocab_range gives, along dim 0"
            )
            wanted = whole[rows].numel() * 4
            assert not done["shares"] and done["storage"] == wanted, (
                f"rank {rank}: vocab_shard of a {shape} table returned rows whose memory holds "
                f"{done['storage']} bytes, expected {wanted} (its rows alone) {where}: a slice "
                "is a view of the whole table, and keeps all of it alive for as long as the "
                "shard lives, the memory the split is there to save. .clone() the rows"
            )


@pytest.mark.step(1)
def test_a_vocabulary_that_does_not_divide_is_refused(kata):
    for rank, got in enumerate(_rows_world("4")):
        for what, outcome in got["refused"].items():
            _check_refused(
                rank,
                f"{what} on 4 ranks",
                outcome,
                ["30", "4"],
                "30 words do not split over 4 ranks (every rank holds as many rows)",
            )


# --------------------------------------------------------------------------- step 2

# Twice three sequences of eight tokens: every rank's first and last rows (the edges), and some.
TOKENS = torch.tensor(
    [[0, 7, 8, 15, 16, 23, 24, 31], [5, 5, 20, 11, 30, 2, 27, 14], [19, 0, 31, 9, 9, 26, 12, 21]]
)


def _dense_embedding() -> nn.Embedding:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        return nn.Embedding(VOCAB, DIM)


def _embed(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members = _group(rank, world_size, groups)
    dense = _dense_embedding()
    upstream = _randn(*TOKENS.shape, DIM, seed=5)
    dense(TOKENS).backward(upstream)
    out = {"members": members, "index": members.index(rank)}
    try:
        layer = kata.VocabParallelEmbedding(copy.deepcopy(dense), group)
        tokens = TOKENS.clone()
        with recording() as forward:
            y = layer(tokens)
        out["output"] = y.detach().clone()
        out["forward"] = _calls(forward, group)
        out["tokens changed"] = not torch.equal(tokens, TOKENS)
        with recording() as backward:
            y.backward(upstream)
        out["grad"] = None if layer.weight.grad is None else layer.weight.grad.clone()
        out["backward"] = _calls(backward, group)
        out["start"] = layer.start
        for bad in (VOCAB, -1):
            wrong = TOKENS.clone()
            wrong[1, 2] = bad
            out[f"refused {bad}"] = _refusal(lambda w=wrong: layer(w))
    except KataTodo:
        raise
    except Exception as error:
        out["failure"] = _fail(rank, "VocabParallelEmbedding", error)
    out["expected"] = dense(TOKENS).detach()
    out["expected grad"] = dense.weight.grad.clone()
    out["table"] = dense.weight.detach().clone()
    return out


_embed_world = shared_run(lambda world: run_world(_embed, *WORLDS[world]))


def _unmasked(table: torch.Tensor, members: list[int]) -> dict[str, torch.Tensor]:
    """What the embedding gives when every rank looks up the tokens it does not own too (as its
    row 0, or clamped to its rows) and never zeroes them: the sum of the ranks' lookups."""
    per = VOCAB // len(members)
    first = torch.zeros(*TOKENS.shape, DIM)
    clamped = torch.zeros(*TOKENS.shape, DIM)
    for index in range(len(members)):
        start = index * per
        rows = table[start : start + per]
        local = TOKENS - start
        outside = (local < 0) | (local >= per)
        first += rows[torch.where(outside, 0, local)]
        clamped += rows[local.clamp(0, per - 1)]
    return {"row 0": first, "clamped": clamped}


@pytest.mark.step(2)
@pytest.mark.parametrize("world", list(WORLDS))
def test_embedding_equals_the_dense_lookup_with_one_all_reduce(kata, world):
    where = _where(world)
    results = _embed_world(world)
    for rank, got in enumerate(results):
        if "failure" in got:
            raise AssertionError(got["failure"])
        y, expected = got["output"], got["expected"]
        size, index = len(got["members"]), got["index"]
        per = VOCAB // size
        names = _names(got["forward"])
        mine = (TOKENS >= index * per) & (TOKENS < (index + 1) * per)
        own = expected * mine.unsqueeze(-1)
        if y.shape == expected.shape and torch.equal(y, own) and not got["forward"]:
            raise AssertionError(
                f"rank {rank}: VocabParallelEmbedding's output holds the rows of the tokens this "
                f"rank owns and zeros for the others, and nothing was sent {where}: that is this "
                "rank's partial. Each token's row is on exactly one rank: sum the partials over "
                "the group (an all-reduce, k20's g) to give every rank every token's row"
            )
        for how, wrong in _unmasked(got["table"], got["members"]).items():
            if y.shape == expected.shape and torch.allclose(y, wrong):
                raise AssertionError(
                    f"rank {rank}: VocabParallelEmbedding's output is the sum over the ranks of "
                    f"each one's lookup of EVERY token ({how}) {where}: a rank that does not own "
                    "a token still looked up some row of its own for it, and left it in the "
                    "sum. Zero the rows of the tokens outside this rank's rows (masked_fill) "
                    "before the all-reduce"
                )
        if y.shape == expected.shape and size < WORLDS[world][0] and torch.equal(y, 2 * expected):
            raise AssertionError(
                f"rank {rank}: VocabParallelEmbedding's output is twice the embedding {where}: "
                f"the partials were summed over the whole world (both groups), not over the "
                f"group {got['members']}: pass the layer's process group to the all-reduce"
            )
        assert [n for n, _, _, _ in got["forward"]] == ["all_reduce"], (
            f"rank {rank}: VocabParallelEmbedding's forward called {names or 'nothing'} {where}: "
            "exactly one all-reduce (the partials' sum) for the whole batch"
        )
        _, op, group, sent = got["forward"][0]
        assert op in (None, "SUM") and group == "the group", (
            f"rank {rank}: the embedding's all-reduce ran with op={op} on {group} {where}: a "
            "SUM on the layer's group"
        )
        wanted = TOKENS.numel() * DIM * 4
        assert sent == wanted, (
            f"rank {rank}: the embedding's all-reduce carried {sent} bytes, expected {wanted} "
            f"(tokens x h floats: {TOKENS.numel()} x {DIM} x 4) {where}"
        )
        assert torch.equal(y, expected), (
            f"rank {rank}: VocabParallelEmbedding's output is not nn.Embedding's "
            f"({_gap(y, expected)}) {where}"
        )
        assert not got["tokens changed"], (
            f"rank {rank}: VocabParallelEmbedding changed the tokens it was given: shift a copy"
        )


@pytest.mark.step(2)
@pytest.mark.parametrize("world", list(WORLDS))
def test_embedding_backward_sends_nothing_and_gives_each_rank_its_rows_gradient(kata, world):
    where = _where(world)
    for rank, got in enumerate(_embed_world(world)):
        if "failure" in got:
            raise AssertionError(got["failure"])
        size, index = len(got["members"]), got["index"]
        per = VOCAB // size
        rows = slice(index * per, (index + 1) * per)
        grad, expected = got["grad"], got["expected grad"][rows]
        if grad is not None and grad.shape == expected.shape and _close(grad, size * expected):
            raise AssertionError(
                f"rank {rank}: the embedding's weight gradient is {size} times the dense one's "
                f"rows {where}, and backward called {_names(got['backward'])}: the sum's backward "
                "summed the gradient over the group again. Every rank computes the same loss "
                "from the same sum, so the gradient of the sum reaches each rank's partial as it "
                "is: k20's g has an identity backward (torch.distributed.nn.functional.all_reduce "
                "all-reduces in backward too: not for this)"
            )
        assert not got["backward"], (
            f"rank {rank}: the embedding's backward called {_names(got['backward'])} {where}: "
            "each rank already holds the whole gradient of the output, and its rows' gradients "
            "come from it alone. Backward sends nothing (g's backward is the identity)"
        )
        assert grad is not None, f"rank {rank}: the embedding's weight got no gradient {where}"
        if grad.shape == expected.shape and not _close(grad, expected):
            extra = grad - expected
            if _close(extra[1:], torch.zeros_like(extra[1:])):
                start = got["start"]
                raise AssertionError(
                    f"rank {rank}: the gradient of row {start} (this rank's first row, 0 of its "
                    f"own) is off by {extra[0].abs().max().item():.3g} {where}, the other rows are "
                    "right: the tokens this rank does not own, looked up as its row 0, sent "
                    "their gradient there. Zero their rows in a way autograd sees (masked_fill, "
                    "or a multiplication by the mask), not under torch.no_grad()"
                )
        assert _close(grad, expected), (
            f"rank {rank}: the embedding's weight gradient is not the dense embedding's rows "
            f"{rows.start}..{rows.stop - 1} ({_gap(grad, expected)}) {where}"
        )


@pytest.mark.step(2)
def test_embedding_refuses_tokens_outside_the_vocabulary(kata):
    for rank, got in enumerate(_embed_world("2")):
        if "failure" in got:
            raise AssertionError(got["failure"])
        for bad in (VOCAB, -1):
            _check_refused(
                rank,
                f"VocabParallelEmbedding of a token {bad} (vocabulary {VOCAB})",
                got[f"refused {bad}"],
                [str(bad), str(VOCAB)],
                f"no rank owns a row for {bad}, so its embedding would be silently zero where "
                "nn.Embedding raises",
            )


# --------------------------------------------------------------------------- step 3

BATCH, LENGTH = TARGETS.shape  # 12 tokens


def _logits(offset: float = 0.0) -> torch.Tensor:
    """The whole logits (BATCH, LENGTH, VOCAB); ``offset`` added to every one (1000: huge)."""
    return _randn(BATCH, LENGTH, VOCAB, seed=11) * 3 + offset


def _columns(logits: torch.Tensor, members: list[int], index: int) -> torch.Tensor:
    per = VOCAB // len(members)
    return logits[..., index * per : (index + 1) * per].clone()


def _loss(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members = _group(rank, world_size, groups)
    index = members.index(rank)
    out = {"members": members, "index": index}
    try:
        for name, offset in (("ordinary", 0.0), ("huge", 1000.0)):
            mine = _columns(_logits(offset), members, index)
            with recording() as calls:
                loss = kata.vocab_parallel_cross_entropy(mine, TARGETS.clone(), group)
            out[name] = loss.detach().clone()
            out[f"{name} calls"] = _calls(calls, group)
        mine = _columns(_logits(), members, index)
        out["refused"] = {}
        for what, targets in (
            (f"a target {VOCAB}", torch.where(TARGETS == 24, VOCAB, TARGETS)),
            ("a target -5", torch.where(TARGETS == 9, -5, TARGETS)),
            ("targets of shape (2, 5)", TARGETS[:, :5].clone()),
        ):
            out["refused"][what] = _refusal(
                lambda t=targets: kata.vocab_parallel_cross_entropy(mine, t, group)
            )
    except KataTodo:
        raise
    except Exception as error:
        out["failure"] = _fail(rank, "vocab_parallel_cross_entropy", error)
    return out


_loss_world = shared_run(lambda world: run_world(_loss, *WORLDS[world]))


def _expected_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, VOCAB), TARGETS.view(-1))


def _likely_wrong(logits: torch.Tensor, size: int) -> list[tuple[str, torch.Tensor]]:
    """Losses that real mistakes give, worked out from the whole logits, to name them."""
    flat, target = logits.view(-1, VOCAB).double(), TARGETS.view(-1)
    counted = target != IGNORE
    per_token = F.cross_entropy(flat, target, reduction="none")  # 0 where ignored
    per = VOCAB // size
    shards = flat.split(per, dim=1)
    owner = torch.where(counted, target, 0) // per
    safe = torch.where(counted, target, 0)
    picked = flat.gather(1, safe.unsqueeze(1)).squeeze(1)
    largest = flat.max(dim=1).values
    total = (flat - largest.unsqueeze(1)).exp().sum(1)
    # every rank shifts by its own max; the target's term comes from its owner, shifted by its max
    own_max = torch.stack([s.max(dim=1).values for s in shards], dim=1)
    own_total = sum((s - own_max[:, [i]]).exp().sum(1) for i, s in enumerate(shards))
    own = own_total.log() - (picked - own_max.gather(1, owner.unsqueeze(1)).squeeze(1))
    # every rank adds its own column (target - start, or 0 where that is not one of its own)
    everyone = torch.zeros_like(picked)
    for i, s in enumerate(shards):
        local = target - i * per
        local = torch.where((local >= 0) & (local < per), local, 0)
        everyone += s.gather(1, local.unsqueeze(1)).squeeze(1) - largest
    unmasked = total.log() - everyone
    count, tokens = counted.sum(), target.numel()
    ignored_adding = (total.log(), total.log() + largest)  # log s, shifted or not
    return [
        ("the sum over the counted tokens, not their mean", per_token.sum()),
        ("the mean over every token, the ignored ones counted", per_token.sum() / tokens),
        *(
            (
                "the mean over every token, the ignored ones adding log(sum of exp) each",
                torch.where(counted, per_token, adding).sum() / tokens,
            )
            for adding in ignored_adding
        ),
        (
            "every rank shifted its logits by its own max, not the group's",
            torch.where(counted, own, 0.0).sum() / count,
        ),
        (
            "every rank added a logit of its own as the target's (the owner the right one, the "
            "others the column target - start, or 0, unmasked)",
            torch.where(counted, unmasked, 0.0).sum() / count,
        ),
    ]


LIKELY = {
    "the sum over the counted tokens, not their mean": "divide the sum by the number of tokens "
    "whose target is not ignore_index",
    "the mean over every token, the ignored ones counted": "an ignored token (target "
    "ignore_index, -100) adds nothing and is not counted: divide by the counted tokens",
    "the mean over every token, the ignored ones adding log(sum of exp) each": "a token whose "
    "target is ignore_index (-100) adds nothing to the sum and is not counted",
    "every rank shifted its logits by its own max, not the group's": "the sum of exponentials "
    "adds terms shifted by different numbers: all-reduce the max first (op=MAX), then shift by "
    "that",
    "every rank added a logit of its own as the target's (the owner the right one, the "
    "others the column target - start, or 0, unmasked)": "only the rank whose columns hold the "
    "target gives its logit; every other rank gives 0 to the sum",
}


@pytest.mark.step(3)
def test_loss_refuses_bad_targets(kata):
    for rank, got in enumerate(_loss_world("2")):
        if "failure" in got:
            raise AssertionError(got["failure"])
        for what, outcome in got["refused"].items():
            if "shape" in what:
                names, why = ["(2, 5)"], "12 tokens' logits take 12 targets, of shape (2, 6)"
            else:
                bad = what.split()[-1]
                names = [bad, str(VOCAB)]
                why = (
                    f"{bad} is no word of a vocabulary of {VOCAB} (nor ignore_index, -100): no "
                    "rank holds its column, and the loss would silently leave its logit out, "
                    "where F.cross_entropy raises"
                )
            _check_refused(rank, f"vocab_parallel_cross_entropy with {what}", outcome, names, why)


@pytest.mark.step(3)
@pytest.mark.parametrize("world", list(WORLDS))
def test_loss_equals_cross_entropy_of_the_whole_logits(kata, world):
    where = _where(world)
    results = _loss_world(world)
    expected = _expected_loss(_logits())
    for rank, got in enumerate(results):
        if "failure" in got:
            raise AssertionError(got["failure"])
        loss = got["ordinary"]
        assert loss.dim() == 0, (
            f"rank {rank}: vocab_parallel_cross_entropy returned a tensor of shape "
            f"{tuple(loss.shape)} {where}: the loss is one number, the mean over the counted "
            "tokens (a 0-dim tensor)"
        )
        first = results[0]["ordinary"]
        if not torch.allclose(loss, expected, **TOLERANCE):
            for what, value in _likely_wrong(_logits(), len(got["members"])):
                if torch.allclose(loss.double(), value, **TOLERANCE):
                    raise AssertionError(
                        f"rank {rank}: the loss is {loss.item():.6f}, F.cross_entropy of the "
                        f"whole logits {expected.item():.6f} {where}: it is {what}. "
                        f"{LIKELY[what][0].upper()}{LIKELY[what][1:]}"
                    )
            if not torch.allclose(loss, first, **TOLERANCE):
                raise AssertionError(
                    f"rank {rank}'s loss is {loss.item():.6f}, rank 0's {first.item():.6f} "
                    f"(F.cross_entropy of the whole logits: {expected.item():.6f}) {where}: "
                    "every rank must end with the same loss: the group's max, sum of "
                    "exponentials and target logit per token, each all-reduced"
                )
        assert torch.allclose(loss, expected, **TOLERANCE), (
            f"rank {rank}: the loss is {loss.item():.6f}, F.cross_entropy of the whole logits "
            f"{expected.item():.6f} {where}: log(sum of exp(z - m)) - (z_target - m) per "
            "counted token, their mean"
        )


@pytest.mark.step(3)
@pytest.mark.parametrize("world", list(WORLDS))
def test_loss_sends_three_scalars_per_token_never_the_logits(kata, world):
    where = _where(world)
    tokens = TARGETS.numel()
    scalars = tokens * 4
    for rank, got in enumerate(_loss_world(world)):
        if "failure" in got:
            raise AssertionError(got["failure"])
        calls = got["ordinary calls"]
        gathers = [c for c in calls if "gather" in c[0]]
        if gathers:
            raise AssertionError(
                f"rank {rank}: the loss called {_names(calls)} {where}: {gathers[0][0]} of "
                f"{gathers[0][3]} bytes gathers the logits, what grows with the vocabulary "
                f"(tokens x V). The loss needs three numbers per token from the group: the "
                "max, the sum of exponentials and the target's logit, each all-reduced"
            )
        rule = (
            "the kata insists on Megatron-LM's and torch's loss_parallel's recipe: one "
            f"all-reduce with op=MAX of the {tokens} tokens' maxima, and SUM all-reduces of "
            f"{2 * tokens} floats in all (the sums of exponentials and the targets' logits, "
            "one call or two)"
        )
        assert all(name == "all_reduce" for name, _, _, _ in calls), (
            f"rank {rank}: the loss called {_names(calls)} {where}: {rule}"
        )
        maxima = [c for c in calls if c[1] == "MAX"]
        if not maxima:
            raise AssertionError(
                f"rank {rank}: the loss called {_names(calls)} {where}: no all-reduce with op "
                "MAX. Without the group's max, exp(z) overflows for logits above 88 (float32; "
                f"the tests try 1000), and shifts that differ between ranks do not add up: {rule}"
            )
        sums = [c for c in calls if c[1] in (None, "SUM")]
        others = [c for c in calls if c not in maxima and c not in sums]
        assert len(maxima) == 1 and maxima[0][3] == scalars and not others, (
            f"rank {rank}: the loss called {_names(calls)} {where}, its MAX carrying "
            f"{[c[3] for c in maxima]} bytes: {rule}"
        )
        assert 1 <= len(sums) <= 2 and sum(c[3] for c in sums) == 2 * scalars, (
            f"rank {rank}: the loss's SUM all-reduces carried {[c[3] for c in sums]} bytes "
            f"{where}, expected {2 * scalars} in all (2 floats a token, {tokens} tokens): {rule}"
        )
        assert all(c[2] == "the group" for c in calls), (
            f"rank {rank}: the loss's all-reduces ran on {[c[2] for c in calls]} {where}: on "
            "the group it was given"
        )


@pytest.mark.step(3)
def test_loss_is_stable_for_logits_of_1000(kata):
    expected = _expected_loss(_logits(1000.0))
    for rank, got in enumerate(_loss_world("2")):
        if "failure" in got:
            raise AssertionError(got["failure"])
        loss = got["huge"]
        if not torch.isfinite(loss):
            raise AssertionError(
                f"rank {rank}: with every logit near 1000 the loss is {loss.item()}, "
                f"F.cross_entropy's {expected.item():.6f}: exp(1000) overflows float32 (above "
                "88 it is inf). Subtract the group's max m from the logits before exp (z - m "
                "<= 0), and add the shift back where it cancels: log s - (z_target - m)"
            )
        assert torch.allclose(loss, expected, rtol=1e-4), (
            f"rank {rank}: with every logit near 1000 the loss is {loss.item():.6f}, "
            f"F.cross_entropy's {expected.item():.6f}"
        )


@contextlib.contextmanager
def _functional_all_reduces():
    """What DTensor's functional all-reduces carry meanwhile (loss_parallel calls them, not
    torch.distributed's): a list of (op, bytes)."""
    import torch.distributed._functional_collectives as funcol

    original, sent = funcol.all_reduce, []

    def counted(tensor, reduceOp, group, tag=""):
        sent.append((str(reduceOp).upper(), tensor.numel() * tensor.element_size()))
        return original(tensor, reduceOp, group, tag)

    funcol.all_reduce = counted
    try:
        yield sent
    finally:
        funcol.all_reduce = original


def _against_loss_parallel(rank, world_size, backward: bool):
    """Torch's loss_parallel and this rank's loss on the same columns of the same logits."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.parallel import loss_parallel
    except ImportError as error:
        return {"skip": f"this torch has no loss_parallel: {error}"}
    kata = load_kata(KATA)
    mesh = init_device_mesh("cpu", (world_size,))
    members = list(range(world_size))
    out = {"skip": None}
    flat_targets = TARGETS.view(-1)
    leaf = _columns(_logits(), members, rank).view(-1, VOCAB // world_size).requires_grad_()
    theirs = DTensor.from_local(leaf, mesh, [Shard(1)], run_check=False)
    with loss_parallel():
        with _functional_all_reduces() as sent:
            loss = F.cross_entropy(theirs, flat_targets)
        out["theirs"] = loss.to_local().detach().clone()
        out["theirs sent"] = sent
        if backward:
            loss.backward()
            out["theirs grad"] = leaf.grad.clone()
    mine = _columns(_logits(), members, rank).requires_grad_()
    with recording() as calls:
        loss = kata.vocab_parallel_cross_entropy(mine, TARGETS.clone())
    out["mine"] = loss.detach().clone()
    out["mine sent"] = [(c.op, c.bytes) for c in calls]
    if backward:
        loss.backward()
        out["mine grad"] = mine.grad.view(-1, VOCAB // world_size).clone()
    return out


@pytest.mark.step(3)
def test_loss_equals_torchs_loss_parallel_and_sends_as_much(kata):
    results = run_world(_against_loss_parallel, 2, False, deadline=60)
    if results[0]["skip"]:
        pytest.skip(results[0]["skip"])
    for rank, got in enumerate(results):
        assert torch.allclose(got["mine"], got["theirs"], **TOLERANCE), (
            f"rank {rank}: your loss is {got['mine'].item():.6f}, torch's loss_parallel's "
            f"(F.cross_entropy of a DTensor sharded on the vocabulary, Shard(1)) "
            f"{got['theirs'].item():.6f} on the same columns"
        )
        mine, theirs = sum(b for _, b in got["mine sent"]), sum(b for _, b in got["theirs sent"])
        assert mine == theirs, (
            f"rank {rank}: your loss's collectives carried {mine} bytes ({got['mine sent']}), "
            f"torch's loss_parallel's {theirs} ({got['theirs sent']}): three floats a token"
        )


# --------------------------------------------------------------------------- step 4

UPSTREAM = 2.5  # the loss's gradient from above: a loss scaled, or summed with others


def _kept_for_backward(run) -> tuple[object, list[tuple[tuple[int, ...], int]]]:
    """``run()``'s result and what its graph keeps for backward: the tensors autograd saved
    (save_for_backward, and what torch's own operations save) and the tensors set on an
    autograd Function's ctx, each distinct memory once, as (shape, bytes)."""
    saved: dict[int, tuple[tuple[int, ...], int]] = {}

    def keep(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = (tuple(tensor.shape), storage.nbytes())

    def pack(tensor):
        keep(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    seen, nodes = set(), [getattr(result, "grad_fn", None)]
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for value in getattr(node, "__dict__", {}).values():  # a Function's ctx attributes
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, torch.Tensor):
                    keep(item)
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return result, list(saved.values())


def _grads(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members = _group(rank, world_size, groups)
    index = members.index(rank)
    out = {"members": members, "index": index}
    try:
        leaf = _columns(_logits(), members, index).requires_grad_()
        loss, kept = _kept_for_backward(
            lambda: kata.vocab_parallel_cross_entropy(leaf, TARGETS.clone(), group)
        )
        out["kept"] = kept
        with recording() as calls:
            loss.backward(torch.tensor(UPSTREAM))
        out["grad"] = None if leaf.grad is None else leaf.grad.clone()
        out["backward"] = _calls(calls, group)
    except KataTodo:
        raise
    except Exception as error:
        out["failure"] = _fail(rank, "vocab_parallel_cross_entropy's backward", error)
    return out


_grads_world = shared_run(lambda world: run_world(_grads, *WORLDS[world]))


def _expected_grad() -> torch.Tensor:
    logits = _logits().requires_grad_()
    _expected_loss(logits).backward(torch.tensor(UPSTREAM))
    return logits.grad


def _likely_wrong_grads(index: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's gradient as real mistakes make it, worked out from the whole logits."""
    per = VOCAB // size
    columns = slice(index * per, (index + 1) * per)
    right = _expected_grad()[..., columns]
    counted = (TARGETS != IGNORE).unsqueeze(-1)
    count = counted.sum()
    softmax = _logits().softmax(-1)[..., columns]
    local = TARGETS - index * per
    mine = (local >= 0) & (local < per)
    one_hot = F.one_hot(torch.where(mine, local, 0), per) * mine.unsqueeze(-1)
    everyone = F.one_hot(torch.where(mine, local, 0), per)  # 1 off at column 0 when not mine
    scale = UPSTREAM / count
    return {
        "not divided by the count of counted tokens": right * count,
        "not multiplied by the upstream gradient (grad)": right / UPSTREAM,
        "the ignored tokens (target -100) given the softmax as their gradient": (
            right + softmax * scale * ~counted
        ),
        "the softmax alone, the one-hot never taken off": right + one_hot * scale * counted,
        "1 taken off on every rank, at column target - start (or 0) where the target is not "
        "this rank's": right - (everyone - one_hot) * scale * counted,
    }


LIKELY_GRAD = {
    "not divided by the count of counted tokens": "the loss is a mean: its gradient is divided "
    "by the number of tokens whose target is not ignore_index",
    "not multiplied by the upstream gradient (grad)": "backward's grad is d(final)/d(loss): "
    "multiply by it (here 2.5)",
    "the ignored tokens (target -100) given the softmax as their gradient": "a token whose "
    "target is ignore_index is not in the loss: its logits' gradient is 0",
    "the softmax alone, the one-hot never taken off": "d loss / d z_v = softmax_v - [v = y]: take "
    "1 off at the target's column",
    "1 taken off on every rank, at column target - start (or 0) where the target is not "
    "this rank's": "only the rank whose columns hold the target takes 1 off, at that column",
}


@pytest.mark.step(4)
@pytest.mark.parametrize("world", list(WORLDS))
def test_gradient_is_softmax_minus_one_hot(kata, world):
    where = _where(world)
    for rank, got in enumerate(_grads_world(world)):
        if "failure" in got:
            raise AssertionError(got["failure"])
        size, index = len(got["members"]), got["index"]
        per = VOCAB // size
        expected = _expected_grad()[..., index * per : (index + 1) * per]
        grad = got["grad"]
        assert grad is not None, f"rank {rank}: this rank's logits got no gradient {where}"
        if not _close(grad, expected) and grad.shape == expected.shape:
            for what, value in _likely_wrong_grads(index, size).items():
                if _close(grad, value):
                    raise AssertionError(
                        f"rank {rank}: the gradient of this rank's logits is "
                        f"{what} ({_gap(grad, expected)} from F.cross_entropy's columns "
                        f"{index * per}..{(index + 1) * per - 1}) {where}, with the loss's "
                        f"gradient {UPSTREAM}: {LIKELY_GRAD[what]}"
                    )
        assert _close(grad, expected), (
            f"rank {rank}: the gradient of this rank's logits is not F.cross_entropy's columns "
            f"{index * per}..{(index + 1) * per - 1} ({_gap(grad, expected)}) {where}, with the "
            f"loss's gradient {UPSTREAM}: (softmax - one-hot at the target) x grad / the count "
            "of counted tokens, 0 for ignored tokens"
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("world", ["2", "4-rows"])
def test_backward_sends_nothing(kata, world):
    where = _where(world)
    for rank, got in enumerate(_grads_world(world)):
        if "failure" in got:
            raise AssertionError(got["failure"])
        assert not got["backward"], (
            f"rank {rank}: the loss's backward called {_names(got['backward'])} {where}: "
            "everything it needs is on the rank after forward (the softmax of its columns is "
            "exp(z - m) / s, with m and s already the group's; the target's column is its own "
            "or not). Keep that in forward, and send nothing in backward"
        )


@pytest.mark.step(4)
def test_backward_keeps_one_shard_of_the_softmax(kata):
    tokens = TARGETS.numel()
    for rank, got in enumerate(_grads_world("2")):
        if "failure" in got:
            raise AssertionError(got["failure"])
        shard = tokens * (VOCAB // 2) * 4
        kept = sum(size for _, size in got["kept"])
        assert kept <= shard + 32 * tokens, (
            f"rank {rank}: the loss kept {kept} bytes for backward (tensors shaped "
            f"{[shape for shape, _ in got['kept']]}), where this rank's logits are {shard} "
            f"bytes ({tokens} tokens x {VOCAB // 2} columns x 4): keep ONE tensor of that "
            "size (the softmax of your columns, exp(z - m) in place divided by s; or the "
            "logits, to make it again in backward) and per-token vectors, not both, nor a "
            "one-hot of the logits' size. At V = 128 256 each extra copy is gigabytes"
        )


@pytest.mark.step(4)
def test_gradient_equals_torchs_loss_parallel(kata):
    results = run_world(_against_loss_parallel, 2, True, deadline=60)
    if results[0]["skip"]:
        pytest.skip(results[0]["skip"])
    for rank, got in enumerate(results):
        assert _close(got["mine grad"], got["theirs grad"]), (
            f"rank {rank}: the gradient of your columns differs from torch's loss_parallel's "
            f"on the same columns ({_gap(got['mine grad'], got['theirs grad'])})"
        )


# --------------------------------------------------------------------------- step 5

LM_BATCH = 2  # sequences of the TinyTransformer's 8 tokens


def _model(vocab: int):
    from dojo.toy_models import TinyTransformer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        return TinyTransformer(blocks=1, vocabulary=vocab)


def _lm_tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (LM_BATCH, 8), generator=generator)
    targets = torch.randint(0, vocab, (LM_BATCH, 8), generator=generator)
    targets[:, -1] = IGNORE  # padding
    return tokens, targets


ROWS = ("embedding.weight", "output.weight", "output.bias")  # split over the vocabulary


def _lm(rank, world_size, groups, vocab):
    from dojo.toy_models import transformer_loss

    kata = load_kata(KATA)
    group, members = _group(rank, world_size, groups)
    index = members.index(rank)
    dense = _model(vocab)
    before = {n: t.clone() for n, t in dense.state_dict().items()}
    tokens, targets = _lm_tokens(vocab)
    out = {"members": members, "index": index}
    try:
        split = kata.VocabParallelLM(dense, group)
        out["unchanged"] = all(torch.equal(before[n], t) for n, t in dense.state_dict().items())
        with recording() as forward:
            loss = split(tokens, targets)
        with recording() as backward:
            loss.backward()
        out["loss"] = loss.detach().clone()
        out["grads"] = {
            n: None if p.grad is None else p.grad.clone() for n, p in split.named_parameters()
        }
        out["forward"] = _calls(forward, group)
        out["backward"] = _calls(backward, group)
        out["tokens"] = tokens.numel()
    except KataTodo:
        raise
    except Exception as error:
        out["failure"] = _fail(rank, "VocabParallelLM", error)
    reference = _model(vocab)
    expected = transformer_loss(reference(tokens), targets)
    expected.backward()
    per = vocab // len(members)
    rows = slice(index * per, (index + 1) * per)
    out["expected"] = expected.detach()
    out["expected grads"] = {
        n: p.grad[rows] if n in ROWS else p.grad for n, p in reference.named_parameters()
    }
    return out


_lm_world = shared_run(lambda world, vocab: run_world(_lm, *WORLDS[world], vocab, deadline=30))


@pytest.mark.step(5)
@pytest.mark.parametrize("world", list(WORLDS))
def test_split_model_equals_one_process(kata, world):
    where = _where(world)
    results = _lm_world(world, VOCAB)
    for rank, got in enumerate(results):
        if "failure" in got:
            raise AssertionError(got["failure"])
        assert got["unchanged"], (
            f"rank {rank}: VocabParallelLM changed the model it was given {where}: copy what "
            "you keep of it"
        )
        expected = got["expected"]
        assert torch.allclose(got["loss"], expected, **TOLERANCE), (
            f"rank {rank}: the split model's loss is {got['loss'].item():.6f}, one process's "
            f"{expected.item():.6f} {where}"
        )
        grads, wanted = got["grads"], got["expected grads"]
        missing = sorted(set(wanted) - set(grads))
        assert not missing, (
            f"rank {rank}: VocabParallelLM has no parameters named {missing} {where}: keep the "
            "model's names (embedding, blocks, norm, output)"
        )
        members = got["members"]
        # the replicated parameters first: where they are wrong, the vocabulary's rows are too
        for name in sorted(wanted, key=lambda name: name in ROWS):
            grad, expected_grad = grads[name], wanted[name]
            if name not in ROWS and grad is not None and not _close(grad, expected_grad):
                shares = [results[m]["grads"][name] for m in members]
                if len(members) < WORLDS[world][0] and _close(grad, 2 * expected_grad):
                    raise AssertionError(
                        f"rank {rank}: the gradient of {name} is twice one process's {where}: "
                        "the hidden state's gradient was summed over the whole world (both "
                        f"groups), not over the group {members}: f's backward all-reduces on "
                        "the model's group (kept in ctx)"
                    )
                if all(s is not None for s in shares) and _close(sum(shares), expected_grad):
                    raise AssertionError(
                        f"rank {rank}: the gradient of {name} is this rank's share only: the "
                        f"shares of the ranks {members} add up to one process's {where}. Every "
                        "rank's output columns read the same hidden state, so its gradient is "
                        "the SUM of what each rank's columns send back: put k20's f (identity "
                        "forward, all-reduce backward) between the norm and the output layer"
                    )
            assert _close(grad, expected_grad), (
                f"rank {rank}: the gradient of {name} is not one process's"
                + (" rows of this rank" if name in ROWS else "")
                + f" ({_gap(grad, expected_grad)}) {where}"
            )


@pytest.mark.step(5)
@pytest.mark.parametrize("world", ["2", "4-rows"])
def test_split_model_sends_the_hidden_state_twice_and_three_scalars(kata, world):
    where = _where(world)
    for rank, got in enumerate(_lm_world(world, VOCAB)):
        if "failure" in got:
            raise AssertionError(got["failure"])
        hidden = got["tokens"] * 16 * 4  # the TinyTransformer's width is 16
        forward, backward = got["forward"], got["backward"]
        assert all(c[0] == "all_reduce" and c[2] == "the group" for c in forward + backward), (
            f"rank {rank}: the split model called {_names(forward)} forward and "
            f"{_names(backward)} backward {where}: all-reduces on the group, no gather"
        )
        sizes = sorted(c[3] for c in forward)
        scalars = 3 * got["tokens"] * 4
        assert sizes.count(hidden) == 1 and sum(sizes) == hidden + scalars, (
            f"rank {rank}: the split model's forward carried {sizes} bytes in "
            f"{_names(forward)} {where}: one all-reduce of the embedding's partials "
            f"({hidden} bytes: tokens x 16 floats), then the loss's three scalars a token"
        )
        assert [c[3] for c in backward] == [hidden], (
            f"rank {rank}: the split model's backward called {_names(backward)} "
            f"({[c[3] for c in backward]} bytes) {where}: exactly one all-reduce, of the "
            f"hidden state's gradient before the output layer ({hidden} bytes: k20's f), "
            "nothing for the embedding or the loss"
        )


@pytest.mark.step(5)
def test_bytes_per_step_is_what_a_step_sends(kata):
    for vocab in (VOCAB, 256):
        for rank, got in enumerate(_lm_world("2", vocab)):
            if "failure" in got:
                raise AssertionError(got["failure"])
            sent = {way: sum(c[3] for c in got[way]) for way in ("forward", "backward")}
            predicted = kata.bytes_per_step(got["tokens"], 16, 4)
            assert predicted == sent, (
                f"bytes_per_step({got['tokens']}, 16, 4) is {predicted}, but rank {rank} of 2 "
                f"sent {sent} in one step of the TinyTransformer (width 16) with a vocabulary "
                f"of {vocab}: forward the embedding's all-reduce (tokens x h floats) and the "
                "loss's three floats a token; backward the hidden state's gradient (tokens x "
                "h); none of it grows with the vocabulary"
            )


def _against_torch(rank, world_size):
    """The split TinyTransformer, yours and torch's parallelize_module under loss_parallel."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            loss_parallel,
            parallelize_module,
        )
    except ImportError as error:
        return {"skip": f"this torch has no loss_parallel: {error}"}
    kata = load_kata(KATA)
    mesh = init_device_mesh("cpu", (world_size,))
    plan = {
        "embedding": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    theirs = parallelize_module(_model(VOCAB), mesh, plan)
    tokens, targets = _lm_tokens(VOCAB)
    logits = theirs(tokens)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    mine = kata.VocabParallelLM(_model(VOCAB))
    my_loss = mine(tokens, targets)
    my_loss.backward()
    per = VOCAB // world_size
    rows = slice(rank * per, (rank + 1) * per)
    grads = {}
    for name, param in theirs.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):  # torch 2.14 hands back the embedding's Replicate
            grad = grad.full_tensor()[rows] if name in ROWS else grad.full_tensor()
        grads[name] = grad.clone()
    return {
        "skip": None,
        "theirs": loss.to_local().detach().clone(),
        "mine": my_loss.detach().clone(),
        "theirs grads": grads,
        "mine grads": {n: p.grad.clone() for n, p in mine.named_parameters()},
    }


@pytest.mark.step(5)
def test_split_model_equals_torchs_parallelize_module_under_loss_parallel(kata):
    results = run_world(_against_torch, 2, deadline=60)
    if results[0]["skip"]:
        pytest.skip(results[0]["skip"])
    for rank, got in enumerate(results):
        assert torch.allclose(got["mine"], got["theirs"], **TOLERANCE), (
            f"rank {rank}: your split model's loss is {got['mine'].item():.6f}, torch's "
            f"{got['theirs'].item():.6f} (parallelize_module: RowwiseParallel embedding, "
            "ColwiseParallel output with Shard(-1); F.cross_entropy under loss_parallel)"
        )
        for name, theirs in got["theirs grads"].items():
            mine = got["mine grads"].get(name)
            assert _close(mine, theirs), (
                f"rank {rank}: the gradient of your {name} differs from torch's "
                f"({_gap(mine, theirs)})"
            )


@pytest.mark.step(5)
def test_program_shows_the_split_against_one_process(kata):
    done = run_module(
        KATA, "--world-size", "2", "--vocab", "64", "--dim", "16", "--batch", "2",
        "--length", "4", timeout=120,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, f"the program exited with {done.returncode}:\n{out}\n{done.stderr}"
    lines = out.splitlines()
    for rank in (0, 1):
        rows = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert any("forward:" in line for line in rows) and any(
            "backward:" in line for line in rows
        ), f"the program shows no forward and backward bytes for rank {rank}:\n{out}"
    assert "equal one process's" in lines[-1], f"the program's verdict:\n{out}"


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    """The split TinyTransformer on this rank's GPU, against one process on the same GPU."""
    from dojo.devices import rank_device
    from dojo.toy_models import transformer_loss

    device = rank_device()
    torch.cuda.set_device(device)
    kata = load_kata(KATA)
    tokens, targets = (t.to(device) for t in _lm_tokens(VOCAB))
    split = kata.VocabParallelLM(_model(VOCAB).to(device))
    loss = split(tokens, targets)
    loss.backward()
    dense = _model(VOCAB).to(device)
    expected = transformer_loss(dense(tokens), targets)
    expected.backward()
    per = VOCAB // world_size
    rows = slice(rank * per, (rank + 1) * per)
    wanted = {n: p.grad[rows] if n in ROWS else p.grad for n, p in dense.named_parameters()}
    return {
        "device": str(loss.device),
        "loss": loss.item(),
        "expected": expected.item(),
        "gaps": {n: (p.grad - wanted[n]).abs().max().item() for n, p in split.named_parameters()},
    }


@pytest.mark.step(5)
@pytest.mark.cuda
@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 2)])
def test_split_model_on_cuda(kata, backend, world_size):
    require_gpus(1)
    results = run_world(
        _on_cuda, world_size, backend=backend, env={"DOJO_DEVICE": "cuda"}, deadline=120
    )
    for rank, got in enumerate(results):
        assert got["device"].startswith("cuda"), (
            f"{backend} on CUDA, {world_size} rank(s): rank {rank}'s loss is on {got['device']}: "
            "keep every tensor on the logits' device"
        )
        assert abs(got["loss"] - got["expected"]) <= 1e-5 * abs(got["expected"]), (
            f"{backend} on CUDA, {world_size} rank(s): rank {rank}'s loss is {got['loss']:.6f}, "
            f"one process's {got['expected']:.6f}"
        )
        name, gap = max(got["gaps"].items(), key=lambda item: item[1])
        assert gap < 1e-5, (
            f"{backend} on CUDA, {world_size} rank(s): rank {rank}'s gradient of {name} differs "
            f"from one process's by up to {gap:.3g}"
        )
