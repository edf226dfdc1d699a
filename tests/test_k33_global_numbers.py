"""k33 the numbers that must be global: the loss over every valid token (micro-batches, DDP,
pipeline stages) and the gradient norm over every piece (shards, copies, stages), clipped by one
factor; held against one process and against torch's get_total_norm and clip_grads_with_norm_
on DTensors."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import RankFailed, run_world
from dojo.spec.testing import require_gpus, run_module, shared_run
from dojo.todo import KataTodo
from dojo.toy_models import SEQUENCE, VOCABULARY, make_transformer

KATA = "k33_global_numbers"
IGNORE = -100  # cross_entropy's ignore_index: a label that is padding
SEED, LR = 7, 0.5
CLOSE = {"rtol": 1e-5, "atol": 1e-7}  # sums over ranks add in another order than one process
INF = float("inf")


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"


def _sent_first(error: ValueError) -> bool:
    """Torch's own ValueError for a collective without a process group: it tried to send."""
    return "init_process_group" in str(error)


def _padded(valid, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, labels)``: one sequence per entry of ``valid``, its first ``valid[i]`` labels
    real, the rest padding."""
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCABULARY, (len(valid), SEQUENCE + 1), generator=generator)
    tokens, labels = stream[:, :-1], stream[:, 1:].clone()
    for row, keep in enumerate(valid):
        labels[row, keep:] = IGNORE
    return tokens, labels


def _logits(valid, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(logits, labels)`` of one micro-batch, as a model would give them."""
    _, labels = _padded(valid, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(len(valid), SEQUENCE, VOCABULARY, generator=generator), labels


def _mean(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """One process: cross-entropy's mean over the valid tokens of the whole batch."""
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten()).item()


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


# --------------------------------------------------------------------------- step 1: the loss


@pytest.mark.step(1)
def test_token_loss_sums_the_valid_tokens(kata):
    for valid, seed in (((5, 3), 1), ((0, 0), 2)):
        logits, labels = _logits(valid, seed)
        logits.requires_grad_(True)
        where = f"token_loss on 2 sequences of {SEQUENCE} tokens with {list(valid)} valid ones"
        got = kata.token_loss(logits, labels)
        assert isinstance(got, tuple) and len(got) == 2, (
            f"{where} returned {type(got).__name__}: return (loss_sum, count)"
        )
        loss_sum, count = got
        wanted = sum(valid)
        assert isinstance(count, int) and not isinstance(count, bool), (
            f"{where}: count is a {type(count).__name__}: return it as an int (int(...)), the "
            "number global_mean all-reduces"
        )
        assert count != labels.numel() or wanted == labels.numel(), (
            f"{where}: count is {count}, every label: the padding (label {IGNORE}) is no token. "
            f"Count the labels that are not IGNORE_INDEX ({wanted})"
        )
        assert count == wanted, f"{where}: count is {count}, expected {wanted} valid tokens"
        expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        assert isinstance(loss_sum, torch.Tensor) and loss_sum.dim() == 0, (
            f"{where}: loss_sum is {loss_sum!r}, not a 0-d tensor: backward must go through it"
        )
        value = loss_sum.item()
        if math.isnan(value):
            raise AssertionError(
                f"{where}: loss_sum is nan: a mean over no valid token is 0 / 0. Sum the token "
                "losses (reduction='sum'): a micro-batch of padding only adds 0, and its count 0"
            )
        if wanted and math.isclose(value, expected.item() / wanted, rel_tol=1e-5):
            raise AssertionError(
                f"{where}: loss_sum is {value:.6f}, the MEAN over its {wanted} valid tokens: "
                "return their SUM (reduction='sum'). Means of micro-batches do not add up to "
                "the mean of the batch; sums and counts do"
            )
        assert math.isclose(value, expected.item(), rel_tol=1e-5, abs_tol=1e-6), (
            f"{where}: loss_sum is {value:.6f}, expected cross_entropy's sum over the valid "
            f"tokens {expected.item():.6f}"
        )
        assert loss_sum.requires_grad, (
            f"{where}: loss_sum does not require grad: backward cannot go through it. Keep it "
            "a tensor of the graph (no .item(), no detach)"
        )


@pytest.mark.step(1)
def test_token_loss_refuses_labels_that_do_not_fit(kata):
    logits, _ = _logits((4, 4), 3)
    for labels in (torch.zeros(SEQUENCE, 2, dtype=torch.long), torch.zeros(2, dtype=torch.long)):
        where = (
            f"token_loss(logits of shape {tuple(logits.shape)}, labels of shape "
            f"{tuple(labels.shape)})"
        )
        try:
            kata.token_loss(logits, labels)
        except ValueError:
            continue
        except KataTodo:
            raise
        except Exception as error:
            raise AssertionError(
                f"{where} raised {_failure(error)}: check that labels' shape is logits' without "
                "the last dimension, and raise ValueError saying so"
            ) from None
        raise AssertionError(
            f"{where} did not refuse: the same number of labels in another shape pairs each "
            "token with another token's label. Raise ValueError when labels' shape is not "
            "logits' without the last dimension"
        )


GLOBAL_VALID = {0: [(5, 7)], 1: [(0, 0)], 2: [(4, 1)]}  # rank -> micro-batches' valid tokens


def _rank_sums(rank: int) -> tuple[torch.Tensor, int]:
    """This rank's token-loss sum and valid-token count, as token_loss should give them."""
    total, count = torch.zeros(()), 0
    for number, valid in enumerate(GLOBAL_VALID[rank]):
        logits, labels = _logits(valid, 100 * rank + number)
        total = total + F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        count += sum(valid)
    return total, count


def _global_mean_world(rank, world_size):
    kata = load_kata(KATA)
    loss_sum, count = _rank_sums(rank)
    with recording(("all_reduce", "reduce", "all_gather", "broadcast")) as calls:
        value = kata.global_mean(loss_sum, count)
    out = {"value": _number(value), "type": type(value).__name__}
    out["calls"] = [(c.name, c.shapes) for c in calls]
    try:
        empty = kata.global_mean(torch.zeros(()), 0)
        out["empty"] = f"returned {empty!r}"
    except ValueError:
        out["empty"] = None
    except KataTodo:
        raise
    except Exception as error:
        out["empty"] = f"raised {_failure(error)}"
    return out


@shared_run
def _global_mean_results():
    return run_world(_global_mean_world, 3)


def _global_mean_expected() -> tuple[float, list[float], list[int], float]:
    every = [_logits(v, 100 * r + n) for r, vs in GLOBAL_VALID.items() for n, v in enumerate(vs)]
    expected = _mean(torch.cat([lg for lg, _ in every]), torch.cat([lb for _, lb in every]))
    sums = [_rank_sums(rank)[0].item() for rank in GLOBAL_VALID]
    counts = [_rank_sums(rank)[1] for rank in GLOBAL_VALID]
    return expected, sums, counts, sum(sums)


@pytest.mark.step(1)
def test_global_mean_is_the_mean_over_every_valid_token(kata):
    results = _global_mean_results()
    expected, sums, counts, total = _global_mean_expected()
    where = f"global_mean on 3 ranks whose valid tokens are {counts}"
    values = []
    for rank, got in enumerate(results):
        value = got["value"]
        assert value is not None, f"{where}: rank {rank} returned a {got['type']}: return a float"
        if math.isnan(value):
            raise AssertionError(
                f"{where}: rank {rank} got nan. A rank of padding only (rank 1: 0 tokens) has "
                "no mean of its own, 0 / 0: a mean per rank, averaged over the ranks, is not the "
                "mean (x1/n1 + x2/n2)/2 != (x1 + x2)/(n1 + n2). All-reduce the sum and the count "
                "together and divide once"
            )
        ranks_means = [s / c for s, c in zip(sums, counts) if c]
        guesses = {
            "the mean of the ranks' own means (those with tokens): (x1/n1 + x2/n2)/2 is not "
            "(x1 + x2)/(n1 + n2). All-reduce the sum and the count together and divide once": (
                sum(ranks_means) / len(ranks_means)
            ),
            f"every rank's sum over this rank's own count ({counts[rank]}): divide by the "
            "all-reduced count, every rank's": total / counts[rank] if counts[rank] else None,
            f"every rank's sum over {len(counts)} times this rank's count: as if every rank "
            "held as many valid tokens as this one. All-reduce the count too": (
                total / (counts[rank] * len(counts)) if counts[rank] else None
            ),
            "this rank's own mean: nothing came from the other ranks. All-reduce the sum and "
            "the count over the group": sums[rank] / counts[rank] if counts[rank] else None,
        }
        if not math.isclose(value, expected, rel_tol=1e-5):
            for why, guess in guesses.items():
                if guess is not None and math.isclose(value, guess, rel_tol=1e-5):
                    raise AssertionError(f"{where}: rank {rank} got {value:.6f}, {why}")
            raise AssertionError(
                f"{where}: rank {rank} got {value:.6f}, expected {expected:.6f}, one process's "
                "mean over every valid token: every rank's loss sums over every rank's counts"
            )
        values.append(value)
    assert len(set(values)) == 1, f"{where}: the ranks got {values}: every rank the same mean"


@pytest.mark.step(1)
def test_global_mean_sends_the_sum_and_the_count_together(kata):
    # The rule: one all-reduce. Every collective is a latency paid every step (tens of
    # microseconds across machines, more than the bytes of two numbers); both fit in one.
    for rank, got in enumerate(_global_mean_results()):
        assert len(got["calls"]) == 1, (
            f"global_mean on 3 ranks: rank {rank} made {len(got['calls'])} collectives "
            f"{got['calls']}: one all-reduce carries the sum and the count together (a tensor "
            "of two numbers): each collective costs a latency on every step"
        )


@pytest.mark.step(1)
def test_global_mean_refuses_bad_counts(kata):
    for count in (-1, 2.5, True, "3"):
        where = f"global_mean(torch.tensor(1.0), {count!r})"
        try:
            kata.global_mean(torch.tensor(1.0), count)
        except ValueError as error:
            if not _sent_first(error):
                continue
            raise AssertionError(
                f"{where} tried to all-reduce before refusing ({error}): check the count first "
                "and raise ValueError saying what it must be"
            ) from None
        except KataTodo:
            raise
        except Exception as error:
            raise AssertionError(
                f"{where} raised {_failure(error)}: a count is an int of at least 0; raise "
                "ValueError saying so, before anything is sent"
            ) from None
        raise AssertionError(
            f"{where} did not refuse: a count is the number of valid tokens, an int of at "
            "least 0; raise ValueError for anything else"
        )
    for rank, got in enumerate(_global_mean_results()):
        assert got["empty"] is None, (
            f"global_mean(0.0, 0) on every one of 3 ranks (a batch of padding only): rank "
            f"{rank} {got['empty']}: no rank has a valid token, so there is no mean: raise "
            "ValueError saying so (every rank knows it after the all-reduce)"
        )


# --------------------------------------------------------------------------- step 2: accumulation

ACCUMULATION = {  # case: (ranks, each rank's micro-batches' valid tokens per sequence)
    "2 ranks, 3 micro-batches": [
        [(8, 2), (0, 0), (5, 8)],
        [(1, 1), (8, 3), (6, 0)],
    ],
    "3 ranks, 2 micro-batches": [
        [(8, 8), (2, 0)],
        [(0, 0), (3, 5)],
        [(7, 1), (8, 6)],
    ],
}
STEPS = 2


def _micro_batches(case: str, rank: int, step: int):
    return [
        _padded(valid, 1000 * step + 10 * rank + number)
        for number, valid in enumerate(ACCUMULATION[case][rank])
    ]


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _accumulate(rank, world_size, case):
    from torch.nn.parallel import DistributedDataParallel

    kata = load_kata(KATA)
    model = make_transformer(SEED)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    out = {"weights": [_weights(model)], "losses": [], "zeroed": []}
    try:
        kata.accumulation_step(ddp, optimizer, [])
        out["empty"] = "returned"
    except ValueError:
        out["empty"] = None
    except KataTodo:
        raise
    except Exception as error:
        out["empty"] = f"raised {_failure(error)}"
    for step in range(STEPS):
        loss = kata.accumulation_step(ddp, optimizer, _micro_batches(case, rank, step))
        out["losses"].append(_number(loss))
        out["weights"].append(_weights(model))
        out["zeroed"].append(all(p.grad is None or not p.grad.any() for p in model.parameters()))
    if rank == 0:  # one process's run, in a warm rank of one thread
        out["alone"] = _alone(case)
    return out


@shared_run
def _accumulation_results(case):
    return run_world(_accumulate, len(ACCUMULATION[case]), case, deadline=40)


def _alone(case: str) -> dict:
    """One process on every rank's micro-batches at once: the loss before each step, the
    weights after it, and what the usual mistakes would have made of the first update."""
    ranks = len(ACCUMULATION[case])
    model = make_transformer(SEED)
    out = {"weights": [_weights(model)], "losses": []}
    for step in range(STEPS):
        every = [b for r in range(ranks) for b in _micro_batches(case, r, step)]
        tokens, labels = torch.cat([t for t, _ in every]), torch.cat([y for _, y in every])
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        out["losses"].append(loss.item())
        loss.backward()
        with torch.no_grad():  # SGD's step, by hand: a first optimizer imports torch._dynamo
            for param in model.parameters():
                param.add_(param.grad, alpha=-LR)
                param.grad = None
        out["weights"].append(_weights(model))
    # the first step's gradient of each rank's token sum and of its micro-batches' own means
    # (k11's recipe, a micro-batch of padding only adding nothing), for the usual mistakes
    out["rank sums"], out["counts"], out["own means"], out["means of means"] = [], [], [], []
    for rank in range(ranks):
        model = make_transformer(SEED)
        batches = _micro_batches(case, rank, 0)
        sums = [
            F.cross_entropy(model(t).flatten(0, 1), y.flatten(), reduction="sum")
            for t, y in batches
        ]
        counts = [int((y != IGNORE).sum()) for _, y in batches]
        total = sum(sums)
        total.backward(retain_graph=True)  # the means of means go through it again
        out["rank sums"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
        if any(counts):
            sum(s / c for s, c in zip(sums, counts) if c).backward()
        out["means of means"].append(
            {n: p.grad.clone() / (len(batches) * ranks) for n, p in model.named_parameters()}
        )
        out["counts"].append(sum(counts))
        out["own means"].append(total.item() / sum(counts) if any(counts) else float("nan"))
    return out


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([t.flatten().double() for t in state.values()])


def _near(update: torch.Tensor, guess: torch.Tensor) -> bool:
    """Whether a first update is ``guess``, to float32 weights' rounding."""
    return ((update - guess).norm() / guess.norm()).item() < 1e-4


def _explain_first_step(where: str, rank: int, mine: dict, alone: dict, case: str) -> None:
    """Name the mistake behind a first update that is not one process's, when it is a usual one."""
    ranks = len(ACCUMULATION[case])
    micro = len(ACCUMULATION[case][0])
    start = _flat(alone["weights"][0])
    ours, theirs = _flat(mine) - start, _flat(alone["weights"][1]) - start
    if not torch.isfinite(ours).all():
        raise AssertionError(
            f"{where}: rank {rank}'s weights hold nan after the first step: something was "
            "divided by a count of 0 (a micro-batch, or a rank, of padding only has no valid "
            "token). Scale each micro-batch's token SUM by one factor from the GLOBAL count of "
            "valid tokens, which is never 0 when there is anything to learn"
        )
    ratio = (ours @ theirs / (theirs @ theirs)).item()
    residual = ((ours - ratio * theirs).norm() / theirs.norm()).item()
    total = sum(alone["counts"])
    if residual < 1e-4:
        scales = {
            1 / ranks: f"1/{ranks} of one process's: DDP averages the gradients over its "
            f"{ranks} ranks on top of your division by the global count, a scale applied "
            f"twice. Scale each loss by N / count ({ranks} / {total}), so that DDP's division "
            "by N leaves 1 / count",
            1 / micro: f"1/{micro} of one process's: divided again by the number of "
            f"micro-batches ({micro}): the global count already divides every token once. "
            "Apply the scale once",
            total / ranks: f"{total / ranks:g} times one process's: backward went through the "
            "raw token sums, never divided by the count: scale each micro-batch's loss before "
            "its backward",
        }
        for scale, why in scales.items():
            if abs(ratio - scale) < 1e-3 * scale:
                raise AssertionError(f"{where}: rank {rank}'s first update is {why}")
    first = alone["means of means"][0]
    means = {n: -LR * sum(m[n] for m in alone["means of means"]) for n in first}
    if _near(ours, _flat(means)):
        raise AssertionError(
            f"{where}: rank {rank}'s first update is that of the mean of every micro-batch's "
            "own mean, divided by the number of micro-batches (k11's recipe): right only when "
            "every micro-batch holds as many valid tokens. Here they hold "
            f"{ACCUMULATION[case]} per sequence, one micro-batch none: (x1/n1 + x2/n2)/2 is not "
            "(x1 + x2)/(n1 + n2). Scale each micro-batch's token SUM by one factor from the "
            "GLOBAL count of valid tokens"
        )
    for divisor, label in ((1, ""), (ranks, " / N")):
        step = {}
        for name in alone["rank sums"][0]:
            step[name] = sum(
                s[name] / c for s, c in zip(alone["rank sums"], alone["counts"]) if c
            ) * (-LR / divisor)
        if _near(ours, _flat(step)):
            raise AssertionError(
                f"{where}: rank {rank}'s first update divides each rank's gradient by that "
                f"rank's own count of valid tokens{label} ({alone['counts']}): the tokens of "
                f"a rank with few count for more. Divide by the global count ({total}): "
                "all-reduce the counts before the first backward"
            )


@pytest.mark.step(2)
@pytest.mark.parametrize("case", list(ACCUMULATION))
def test_accumulation_step_trains_like_one_process(kata, case):
    results = _accumulation_results(case)
    alone = results[0]["alone"]
    where = f"accumulation_step under torch's DDP on {case}, valid tokens {ACCUMULATION[case]}"
    for rank, got in enumerate(results):
        for step in range(1, STEPS + 1):
            mine, theirs = got["weights"][step], alone["weights"][step]
            if all(torch.allclose(mine[n], theirs[n], **CLOSE) for n in theirs):
                if not got["zeroed"][step - 1]:
                    raise AssertionError(
                        f"{where}: after step {step} rank {rank}'s gradients are not zero: "
                        "zero them after the optimizer's step (the next step's backward adds "
                        "to them)"
                    )
                continue
            if step == 1:
                _explain_first_step(where, rank, mine, alone, case)
            name = max(theirs, key=lambda n: (mine[n] - theirs[n]).abs().max().item())
            gap = (mine[name] - theirs[name]).abs().max().item()
            raise AssertionError(
                f"{where}: after step {step} rank {rank}'s weights differ from one process's "
                f"on the whole batch by up to {gap:.3g} ({name!r})"
                + (
                    ": were the gradients zeroed after the first step? The second step's "
                    "backward adds to them"
                    if step > 1 and not got["zeroed"][0]
                    else ". The gradient must be that of the mean over every valid token of "
                    "every rank's micro-batches: count the valid tokens of every rank first "
                    "(one all-reduce), then scale each micro-batch's token sum by N / count "
                    "(DDP divides by N): applied once, not again per micro-batch nor on the "
                    "gradients accumulated so far"
                )
            )


@pytest.mark.step(2)
@pytest.mark.parametrize("case", list(ACCUMULATION))
def test_accumulation_step_returns_the_global_loss(kata, case):
    results = _accumulation_results(case)
    alone = results[0]["alone"]
    where = f"accumulation_step under torch's DDP on {case}"
    for rank, got in enumerate(results):
        for step, (value, expected) in enumerate(zip(got["losses"], alone["losses"])):
            said = f"{where}: step {step + 1}'s loss on rank {rank} is {value}"
            assert value is not None, f"{said}: return the mean loss as a float"
            if step == 0 and math.isclose(value, alone["own means"][rank], rel_tol=1e-5):
                raise AssertionError(
                    f"{said}, this rank's own mean: the run reports the mean over every rank's "
                    f"valid tokens, {expected:.6f}: global_mean of this rank's sum and count"
                )
            ranks = len(ACCUMULATION[case])
            total = sum(alone["counts"])
            if math.isclose(value, expected * ranks / total, rel_tol=1e-5) or math.isclose(
                value, expected / total, rel_tol=1e-5
            ):
                raise AssertionError(
                    f"{said}, the scaled loss backward went through: report the mean, "
                    f"{expected:.6f} (every rank's token sums over every rank's counts)"
                )
            assert math.isclose(value, expected, rel_tol=1e-5), (
                f"{said}, expected {expected:.6f}: one process's mean over every valid token "
                "of the whole batch, before the step"
            )


@pytest.mark.step(2)
def test_accumulation_step_refuses_no_micro_batches(kata):
    for rank, got in enumerate(_accumulation_results("2 ranks, 3 micro-batches")):
        assert got["empty"] is None, (
            f"accumulation_step(ddp, optimizer, []) on rank {rank} {got['empty']}: a step "
            "without micro-batches has nothing to learn from; raise ValueError saying so"
        )


# --------------------------------------------------------------------------- step 3: pipeline

PIPELINE_VALID = [  # replica -> its micro-batches' valid tokens per sequence (the same on every stage)
    [(8, 3), (0, 0)],
    [(2, 2), (7, 5)],
]
PIPELINES = {  # case: the mesh's shape, the stages' dimension first or not
    "2 stages x 2 replicas": {"pp": 2, "dp": 2},
    "2 replicas x 2 stages": {"dp": 2, "pp": 2},
    "2 stages": {"pp": 2},
}


def _mesh(shape: dict):
    from torch.distributed.device_mesh import init_device_mesh

    from dojo.devices import rank_device

    return init_device_mesh(rank_device().type, tuple(shape.values()), mesh_dim_names=tuple(shape))


def _replica_sums(replica: int) -> tuple[torch.Tensor, int]:
    total, count = torch.zeros(()), 0
    for number, valid in enumerate(PIPELINE_VALID[replica]):
        logits, labels = _logits(valid, 500 + 10 * replica + number)
        total = total + F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        count += sum(valid)
    return total, count


def _pipeline(rank, world_size, case):
    kata = load_kata(KATA)
    shape = PIPELINES[case]
    mesh = _mesh(shape)
    replica = mesh.get_local_rank("dp") if "dp" in shape else 0
    stage = mesh.get_local_rank("pp")
    loss_sum, count = _replica_sums(replica)
    last = stage == shape["pp"] - 1
    value = kata.pipeline_mean(loss_sum if last else None, count, mesh, "pp")
    return {"stage": stage, "replica": replica, "value": value, "number": _number(value)}


@shared_run
def _pipeline_results(case):
    shape = PIPELINES[case]
    return run_world(_pipeline, math.prod(shape.values()), case)


@pytest.mark.step(3)
@pytest.mark.parametrize("case", list(PIPELINES))
def test_pipeline_mean_reports_the_loss_on_every_rank(kata, case):
    shape = PIPELINES[case]
    replicas = range(shape.get("dp", 1))
    every = [
        _logits(v, 500 + 10 * r + n) for r in replicas for n, v in enumerate(PIPELINE_VALID[r])
    ]
    expected = _mean(torch.cat([lg for lg, _ in every]), torch.cat([lb for _, lb in every]))
    own = {r: _replica_sums(r)[0].item() / _replica_sums(r)[1] for r in replicas}
    results = _pipeline_results(case)
    where = f"pipeline_mean on a mesh {shape} (stages: 'pp')"
    for rank, got in enumerate(results):
        said = f"{where}: rank {rank} (stage {got['stage']}, replica {got['replica']})"
        value, last = got["number"], got["stage"] == shape["pp"] - 1
        if value is None or value in (-1.0, 0.0) or math.isnan(value):
            raise AssertionError(
                f"{said} returned {got['value']!r}. Only the last stage computes a loss; the "
                "others have none of their own (torchtitan printed -1 there, and logs rank 0 "
                "by default: #550). Every rank reports the run's loss: the last stage's sums "
                "and counts, summed over the whole mesh, the other stages adding nothing"
            )
        if math.isclose(value, expected / shape["pp"], rel_tol=1e-5):
            raise AssertionError(
                f"{said} got {value:.6f}, 1/{shape['pp']} of the mean {expected:.6f}: every "
                "stage reads the same labels, so counting them on every stage counts each "
                "token once per stage. Count the tokens of the last stage only"
            )
        if len(own) > 1 and math.isclose(value, own[got["replica"]], rel_tol=1e-5):
            raise AssertionError(
                f"{said} got {value:.6f}, its replica's own mean: the other dimension splits "
                f"the batch: sum over it too (the mean over everything is {expected:.6f})"
            )
        assert math.isclose(value, expected, rel_tol=1e-5), (
            f"{said} got {value:.6f}, expected one process's mean over the whole batch "
            f"{expected:.6f}" + ("" if last else ", on this stage too (it has no loss of its own)")
        )


def _pipeline_refusals(rank, world_size):
    kata = load_kata(KATA)
    mesh = _mesh({"pp": 2})
    last = mesh.get_local_rank("pp") == 1
    probes = {
        "stages='tp', which the mesh lacks": (torch.tensor(3.0), 2, "tp"),
        "a loss sum on stage 0 and None on the last stage": (
            None if last else torch.tensor(3.0),
            2,
            "pp",
        ),
        "a count of -1": (torch.tensor(3.0) if last else None, -1, "pp"),
    }
    out = {}
    for what, (loss_sum, count, stages) in probes.items():
        with recording(("all_reduce", "broadcast", "reduce", "all_gather")) as calls:
            try:
                value = kata.pipeline_mean(loss_sum, count, mesh, stages)
                out[what] = f"returned {value!r}"
            except ValueError:
                out[what] = "sent first" if calls else None
            except KataTodo:
                raise
            except Exception as error:
                out[what] = f"raised {_failure(error)}"
    return out


@pytest.mark.step(3)
def test_pipeline_mean_refuses_what_does_not_fit(kata):
    for rank, got in enumerate(run_world(_pipeline_refusals, 2)):
        for what, outcome in got.items():
            assert outcome is None, f"pipeline_mean with {what}, on rank {rank} of 2 stages: " + (
                "it all-reduced before refusing: check first, then send"
                if outcome == "sent first"
                else f"{outcome}: raise ValueError saying what is wrong (the stages' "
                "dimension must be the mesh's; only the last stage has a loss sum; a "
                "count is an int of at least 0), before anything is sent"
            )


# --------------------------------------------------------------------------- step 4: the norm

# Hand-made pieces on a 2 x 2 mesh, each parameter whole (name: values), and how it lies:
# sharded on some dimensions (the rank's chunk of it), a copy on the others, or on one stage.
HAND = {
    "FSDP x TP": (
        {"dp": 2, "tp": 2},
        None,
        {
            "w": ([3.0, -1.0, 2.0, 5.0, -4.0, 1.0, 0.5, 2.0], ("dp", "tp")),  # each rank a part
            "g": ([1.0, -2.0, 2.0, 4.0], ("dp",)),  # a part down dp, a copy across tp
            "b": ([3.0, -4.0], ()),  # a copy on every rank
            "e": ([-9.0], ("dp",)),  # dp 0 holds it, dp 1 an empty piece (FSDP past the end)
        },
    ),
    "PP x TP": (
        {"pp": 2, "tp": 2},
        "pp",
        {
            "a": ([1.0, 2.0, 3.0, 4.0], ("tp",), 0),  # stage 0, sliced across tp
            "n0": ([2.0, -2.0], (), 0),  # stage 0, a copy across tp
            "c": ([5.0, -1.0], ("tp",), 1),  # stage 1, sliced
            "n1": ([1.0, 1.0, -3.0], (), 1),  # stage 1, a copy
        },
    ),
}
HAND_NORMS = (2.0, 1.0, INF)


def _hand_pieces(case: str, coords: dict) -> list[tuple[str, tuple, torch.Tensor]]:
    """A rank's pieces of ``HAND[case]`` at ``coords`` (dimension -> index): (name, sharded_on,
    values), cut as lay_out cuts (torch.chunk, the mesh's dimensions in order)."""
    shape, stages, parameters = HAND[case]
    out = []
    for name, spec in parameters.items():
        values, sharded = torch.tensor(spec[0]), spec[1]
        if stages is not None and spec[2] != coords[stages]:
            continue
        for dim in shape:
            if dim in sharded:
                chunks = torch.chunk(values, shape[dim])
                index = coords[dim]
                values = chunks[index] if index < len(chunks) else values[:0]
        out.append((name, sharded, values))
    return out


def _norm_world(rank, world_size, case_names):
    kata = load_kata(KATA)
    out = {}
    for case in case_names:
        shape, stages, _ = HAND[case]
        mesh = _mesh(shape)
        coords = {dim: mesh.get_local_rank(dim) for dim in shape}
        pieces = [kata.Piece(n, v, s) for n, s, v in _hand_pieces(case, coords)]
        out[case] = {"coords": coords, "norms": {}}
        for p in HAND_NORMS:
            norm = kata.global_grad_norm(pieces, mesh, p, stages)
            out[case]["norms"][p] = _number(norm)
    return out


def _candidates(shape: dict, stages, ranks: list[dict], p: float) -> dict[str, list[float]]:
    """What the usual mistakes give on every rank: ``ranks[r]`` = {"coords": ..., "pieces":
    [(sharded_on, values)]}. Each value is a list over the ranks."""
    dims = list(shape)

    def total(values, of):  # combine p-th powers (or maxes) of what ``of`` selects
        chosen = [v.double() for v in values if v.numel()]
        if not chosen:
            return 0.0
        if math.isinf(of):
            return max(v.abs().max().item() for v in chosen)
        return sum((v.abs() ** of).sum().item() for v in chosen)

    def counted(rank, keep_copies=False, stages_as_copies=False):
        coords = ranks[rank]["coords"]
        out = []
        for sharded, values in ranks[rank]["pieces"]:
            copy_dims = [d for d in dims if d not in sharded and (d != stages or stages_as_copies)]
            if keep_copies or all(coords[d] == 0 for d in copy_dims):
                out.append(values)
        return out

    def over(group_dims, of=p, combine=None, **kinds):
        """Every rank's value reduced over the ranks that share its coordinates off group_dims."""
        values = []
        for facts in ranks:
            peers = [
                r
                for r, other in enumerate(ranks)
                if all(
                    other["coords"][d] == facts["coords"][d] for d in dims if d not in group_dims
                )
            ]
            parts = [total(counted(r, **kinds), of) for r in peers]
            if combine == "add norms":
                values.append(sum(part ** (1 / of) for part in parts))
            elif combine == "sum maxes":
                values.append(sum(parts))
            elif math.isinf(of):
                values.append(max(parts))
            else:
                values.append(sum(parts) ** (1 / of))
        return values

    out = {"right": over(dims)}
    if stages is not None:  # before the single dimensions: "no stages" is one of them
        out["no stages"] = over([d for d in dims if d != stages])
        out["stages as copies"] = over(dims, stages_as_copies=True)
    out["every copy"] = over(dims, keep_copies=True)
    out["local"] = over([], keep_copies=True)
    out["local, copies once"] = over([])
    out[f"{dims[0]} only"] = over([dims[0]])
    out[f"{dims[-1]} only"] = over([dims[-1]])
    if math.isinf(p):
        out["sum maxes"] = over(dims, combine="sum maxes")
    else:
        out["add norms"] = over(dims, combine="add norms")
        if p != 2:
            out["2-norm"] = over(dims, of=2.0)
    return out


def _why(mistake: str, p: float, dims: list[str], stages) -> str:
    name = "inf" if math.isinf(p) else f"{p:g}"
    return {
        "every copy": "every copy counted: a replicated piece counted once per rank that holds "
        "it (torchtitan #596). On every dimension a piece is not sharded on (the stages "
        "aside) its values are a copy: count them on the first rank of that dimension only",
        "local": "the norm of this rank's own pieces only: the norm is the whole model's: "
        "sum the p-th powers over every rank of the mesh, one all-reduce over each dimension",
        "local, copies once": "this rank's own pieces only, never reduced: sum the p-th "
        "powers over every rank of the mesh, one all-reduce over each dimension",
        f"{dims[0]} only": f"reduced over the {dims[0]!r} dimension only: every dimension "
        "holds other parts of the model (shards, slices, stages): reduce over each",
        f"{dims[-1]} only": f"reduced over the {dims[-1]!r} dimension only: every dimension "
        "holds other parts of the model (shards, slices, stages): reduce over each",
        "no stages": "its stage's norm only: the stages hold different parameters, so their "
        "p-th powers add up over the stages' dimension too (torchtitan all-reduces the norm "
        "over the pipeline's group)",
        "stages as copies": "only the first stage's pieces: the stages are not copies of one "
        "another: each holds its own parameters, and every one counts",
        "sum maxes": "the sum of the ranks' largest entries: the inf-norm is the largest "
        "absolute entry of them all: reduce with ReduceOp.MAX",
        "add norms": "the sum of the ranks' norms: norms do not add up, p-th powers do: sum "
        "|x|^p over the ranks, then take the p-th root once",
        "2-norm": f"the 2-norm, not the {name}-norm: raise every entry's absolute value to "
        "norm_type, sum, and take the norm_type-th root",
    }[mistake]


def explain_norm(where: str, got: list, shape: dict, stages, ranks: list[dict], p, expected):
    """Fail when a rank's norm is not ``expected``, naming the usual mistake that gives every
    rank's value (one rank's alone can fit several); else saying what the norm is."""
    dims = list(shape)
    name = "inf" if math.isinf(p) else f"{p:g}"
    for rank, value in enumerate(got):
        if value is None:
            raise AssertionError(
                f"{where}: rank {rank}'s {name}-norm is not a number: return a 0-d tensor"
            )

    def close(a, b):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)

    wrong = [rank for rank, value in enumerate(got) if not close(value, expected)]
    if not wrong:
        return
    rank = wrong[0]
    said = (
        f"{where}: rank {rank}'s {name}-norm is {got[rank]:.6g}, one process's over the whole "
        f"gradient {expected:.6g}"
    )
    for mistake, values in _candidates(shape, stages, ranks, p).items():
        if mistake != "right" and all(close(v, c) for v, c in zip(got, values)):
            raise AssertionError(f"{said}: {_why(mistake, p, dims, stages)}")
    raise AssertionError(
        f"{said} (the same on every rank; the ranks got "
        + ", ".join(f"{v:.6g}" for v in got)
        + "). Every element "
        "once: a piece's p-th powers summed over the dimensions it is sharded on, counted on "
        "the first rank of those it is a copy on, summed over the stages; the inf-norm the "
        "largest absolute entry (MAX)"
    )


@shared_run
def _hand_results():
    return run_world(_norm_world, 4, list(HAND))


def _hand_expected(case: str, p: float) -> float:
    values = torch.cat([torch.tensor(spec[0]) for spec in HAND[case][2].values()])
    return torch.linalg.vector_norm(values.double(), p).item()


@pytest.mark.step(4)
def test_global_grad_norm_counts_every_element_once(kata):
    for case in HAND:
        check_hand_made(case)


def check_hand_made(case: str) -> None:
    shape, stages, _ = HAND[case]
    try:
        results = _hand_results()
    except RankFailed as failure:  # torch's words for the largest entry of nothing
        if "empty" not in str(failure) and "numel() == 0" not in str(failure):
            raise
        raise AssertionError(
            "global_grad_norm on hand-made pieces: a rank failed on an empty piece (an FSDP "
            "shard past the last chunk: 'e' on dp 1): an empty piece has no largest entry "
            "and adds nothing: skip it\n" + str(failure)
        ) from None
    ranks = [
        {
            "coords": got[case]["coords"],
            "pieces": [(s, v) for _, s, v in _hand_pieces(case, got[case]["coords"])],
        }
        for got in results
    ]
    stages_said = f", stages {stages!r}" if stages else ""
    where = f"global_grad_norm of hand-made pieces on a mesh {shape}{stages_said}"
    for p in HAND_NORMS:
        got = [r[case]["norms"][p] for r in results]
        explain_norm(where, got, shape, stages, ranks, p, _hand_expected(case, p))


LAYOUTS = {  # case: (mesh shape, what each dimension does, see lay_out)
    "FSDP x TP": ({"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "tp"}),
    "DDP x TP": ({"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "tp"}),
    "PP x TP": ({"pp": 2, "tp": 2}, {"pp": "pp", "tp": "tp"}),
    "PP x FSDP": ({"pp": 2, "dp": 2}, {"pp": "pp", "dp": "fsdp"}),
    "FSDP over 4": ({"dp": 4}, {"dp": "fsdp"}),
}
NORMS = (2.0, 1.0, 3.0, INF)


def _whole_gradient() -> dict[str, torch.Tensor]:
    """The TinyTransformer's gradient on a padded batch, in one process (the same on every
    rank): new tensors at every call."""
    return {name: grad.clone() for name, grad in _gradient().items()}


@functools.cache
def _gradient() -> dict[str, torch.Tensor]:
    model = make_transformer(SEED)
    tokens, labels = _padded((8, 5, 0, 3), SEED)
    F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _layout_pieces(kata, case, mesh=None):
    shape, layout = LAYOUTS[case]
    mesh = mesh or _mesh(shape)
    stages = next((d for d, kind in layout.items() if kind == "pp"), None)
    pieces = kata.lay_out(_whole_gradient(), mesh, layout)
    coords = {dim: mesh.get_local_rank(dim) for dim in shape}
    return mesh, stages, pieces, coords


def _layout_norms(rank, world_size):
    kata = load_kata(KATA)
    out = {}
    for case in LAYOUTS:
        mesh, stages, pieces, coords = _layout_pieces(kata, case)
        facts = [(piece.sharded_on, piece.grad.clone()) for piece in pieces]
        norms = {p: _number(kata.global_grad_norm(pieces, mesh, p, stages)) for p in NORMS}
        out[case] = {"coords": coords, "pieces": facts, "norms": norms}
    grads = list(_whole_gradient().values())  # one process's norms
    out["alone"] = {p: torch.nn.utils.get_total_norm(grads, p).item() for p in NORMS}
    return out


@shared_run
def _layout_norm_results():
    return run_world(_layout_norms, 4, deadline=40)


@pytest.mark.step(4)
def test_global_grad_norm_equals_one_process_on_the_transformer(kata):
    results = _layout_norm_results()  # one world for every layout
    for case, (shape, layout) in LAYOUTS.items():
        stages = next((d for d, kind in layout.items() if kind == "pp"), None)
        ranks = [{"coords": r[case]["coords"], "pieces": r[case]["pieces"]} for r in results]
        where = f"global_grad_norm of the TinyTransformer's gradient laid out {layout} on {shape}"
        for p in NORMS:
            got = [r[case]["norms"][p] for r in results]
            explain_norm(where, got, shape, stages, ranks, p, results[0]["alone"][p])


PLAN = {  # TP_PLAN, the spec's own copy: which linears tensor parallelism splits, and how
    "attention.query": "column",
    "attention.key": "column",
    "attention.value": "column",
    "attention.out": "row",
    "mlp.up": "column",
    "mlp.down": "row",
}
AGAINST_TORCH = ("FSDP x TP", "PP x TP")


def _stage(name: str, stages: int) -> int:
    from dojo.toy_models import BLOCKS

    if name.startswith("blocks."):
        return int(name.split(".")[1]) * stages // BLOCKS
    return 0 if name.startswith("embedding.") else stages - 1


def _placement(name: str, kind: str):
    from torch.distributed.tensor import Replicate, Shard

    if kind == "fsdp":
        return Shard(0)
    layer, _, what = name.rpartition(".")
    style = next((s for planned, s in PLAN.items() if layer.endswith(planned)), None)
    if kind == "tp" and style == "column":
        return Shard(0)
    if kind == "tp" and style == "row" and what == "weight":
        return Shard(1)
    return Replicate()


def _as_dtensors(mesh, layout: dict, grads: dict) -> dict:
    """Torch's way of holding the same pieces: this rank's parameters (its stage's) as DTensor
    parameters with DTensor gradients on the mesh's other dimensions. Every rank holds the
    whole gradient, so each takes its own shards (src_data_rank=None: nothing is sent)."""
    from torch.distributed.tensor import distribute_tensor

    stages = next((d for d, kind in layout.items() if kind == "pp"), None)
    dims = [d for d in layout if d != stages]
    sub = mesh[tuple(dims)] if len(dims) > 1 else mesh[dims[0]]
    params = {}
    for name, grad in grads.items():
        if stages and _stage(name, mesh[stages].size()) != mesh.get_local_rank(stages):
            continue
        placements = [_placement(name, layout[d]) for d in dims]
        param = torch.nn.Parameter(
            distribute_tensor(torch.zeros_like(grad), sub, placements, src_data_rank=None)
        )
        param.grad = distribute_tensor(grad.clone(), sub, placements, src_data_rank=None)
        params[name] = param
    return params


def _torchs_norm(mesh, layout: dict, params: dict, p: float) -> torch.Tensor:
    """get_total_norm of the DTensor gradients (full_tensor), then torchtitan's all-reduce of
    the stages' norms over the pipeline's group."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    total = get_total_norm([q.grad for q in params.values()], p)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    stages = next((d for d, kind in layout.items() if kind == "pp"), None)
    if stages:
        group = mesh.get_group(stages)
        if math.isinf(p):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total**p
            dist.all_reduce(total, group=group)
            total = total ** (1.0 / p)
    return total


def _against_torch_norms(rank, world_size):
    kata = load_kata(KATA)
    out = {}
    for case in AGAINST_TORCH:
        mesh, stages, pieces, _ = _layout_pieces(kata, case)
        _, layout = LAYOUTS[case]
        params = _as_dtensors(mesh, layout, _whole_gradient())
        for p in (2.0, INF):
            theirs = _torchs_norm(mesh, layout, params, p).item()
            out[(case, p)] = (_number(kata.global_grad_norm(pieces, mesh, p, stages)), theirs)
    return out


@pytest.mark.step(4)
def test_global_grad_norm_equals_torchs_get_total_norm_on_dtensors(kata):
    results = run_world(_against_torch_norms, 4, deadline=60)
    for rank, got in enumerate(results):
        for (case, p), (mine, theirs) in got.items():
            shape, layout = LAYOUTS[case]
            torchs = "get_total_norm on the same gradients as DTensors" + (
                ", with torchtitan's all-reduce over the stages" if "pp" in layout.values() else ""
            )
            assert mine is not None and math.isclose(mine, theirs, rel_tol=1e-5), (
                f"the TinyTransformer's gradient laid out {layout} on {shape}: rank {rank}'s "
                f"global_grad_norm (norm_type {p}) is {mine}, torch's {torchs} gives "
                f"{theirs:.6g}"
            )


def _norm_refusals(rank, world_size):
    kata = load_kata(KATA)
    mesh = _mesh({"dp": 2})
    piece = kata.Piece("w", torch.tensor([3.0, 4.0]), ("dp",))
    probes = {
        **{f"norm_type={p!r}": ([piece], p, None) for p in (0, -1.0, float("nan"), -INF, "fro")},
        "norm_type=True": ([piece], True, None),
        "a piece sharded on 'tp', which the mesh lacks": (
            [kata.Piece("w", torch.ones(2), ("tp",))],
            2.0,
            None,
        ),
        "stages='pp', which the mesh lacks": ([piece], 2.0, "pp"),
        "a piece sharded on the stages' dimension": ([piece], 2.0, "dp"),
    }
    out = {}
    for what, (pieces, p, stages) in probes.items():
        with recording(("all_reduce", "broadcast", "reduce", "all_gather")) as calls:
            try:
                value = kata.global_grad_norm(pieces, mesh, p, stages)
                out[what] = f"returned {value!r}"
            except ValueError:
                out[what] = "sent first" if calls else None
            except KataTodo:
                raise
            except Exception as error:
                out[what] = f"raised {_failure(error)}"
    return out


@pytest.mark.step(4)
def test_global_grad_norm_refuses_what_it_cannot_compute(kata):
    for rank, got in enumerate(run_world(_norm_refusals, 2)):
        for what, outcome in got.items():
            assert outcome is None, f"global_grad_norm with {what}, on rank {rank} of 2: " + (
                "it all-reduced before refusing: check everything first, then send"
                if outcome == "sent first"
                else f"{outcome}: raise ValueError saying what is supported (norm_type a "
                "positive number or inf; pieces sharded only on the mesh's dimensions, "
                "never on the stages), before anything is sent"
            )


# --------------------------------------------------------------------------- step 5: clipping

SHRINK, GROW = 0.5, 2.0  # max_norm as a share of the true norm: clipped, and left alone


def _clipped_alone(grads: dict, max_norm: float, p: float) -> dict:
    params = []
    for grad in grads.values():
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        params.append(param)
    torch.nn.utils.clip_grad_norm_(params, max_norm, p)
    return {name: q.grad for name, q in zip(grads, params)}


CLIPS = [(case, 2.0) for case in LAYOUTS] + [("PP x TP", INF)]  # (layout, norm_type)


def _clip_world(rank, world_size):
    kata = load_kata(KATA)
    out, meshes = {}, {}
    for case, p in CLIPS:
        _, layout = LAYOUTS[case]
        meshes[case] = meshes.get(case) or _mesh(LAYOUTS[case][0])
        true = torch.nn.utils.get_total_norm(list(_whole_gradient().values()), p).item()
        out[("true", p)] = true
        for share in (SHRINK, GROW) if p == 2.0 else (SHRINK,):
            mesh, stages, pieces, _ = _layout_pieces(kata, case, meshes[case])
            tensors = [piece.grad for piece in pieces]  # the model's gradients
            before = [t.clone() for t in tensors]
            norm = kata.clip_grad_norm(pieces, share * true, mesh, p, stages)
            alone = _clipped_alone(_whole_gradient(), share * true, p)
            out[(case, p, share)] = {
                "norm": _number(norm),
                "names": [piece.name for piece in pieces],
                "replaced": [piece.grad is not t for piece, t in zip(pieces, tensors)],
                "after": [t.clone() for t in tensors],
                "before": before,
                "expected": [e.grad for e in kata.lay_out(alone, mesh, layout)],
                "sharded": [piece.sharded_on for piece in pieces],
            }
    return out


@shared_run
def _clip_results():
    return run_world(_clip_world, 4, deadline=60)


def _factors(before, after) -> list[float]:
    """Each nonzero piece's scale, after / before."""
    return [
        (a.double().norm() / b.double().norm()).item()
        for b, a in zip(before, after)
        if b.numel() and b.double().norm() > 0
    ]


@pytest.mark.step(5)
def test_clip_grad_norm_clips_every_rank_by_one_factor(kata):
    results = _clip_results()  # one world for every layout: the tests of a step share it
    for case, p in CLIPS:
        check_clipping(results, case, p)


def check_clipping(results: list, case: str, p: float) -> None:
    shape, layout = LAYOUTS[case]
    true = results[0][("true", p)]
    where = (
        f"clip_grad_norm(max_norm={SHRINK * true:.4g}, norm_type={p}) of the TinyTransformer's "
        f"gradient (its norm {true:.4g}) laid out {layout} on {shape}"
    )
    every = {}
    for rank, got in enumerate(results):
        facts = got[(case, p, SHRINK)]
        if any(facts["replaced"]):
            name = facts["names"][facts["replaced"].index(True)]
            raise AssertionError(
                f"{where}: on rank {rank} piece {name!r}'s grad is a new tensor; the tensor it "
                "held (the model's own gradient, which the optimizer reads) is as it was. Scale "
                "it in place (mul_)"
            )
        factors = _factors(facts["before"], facts["after"])
        every[rank] = factors
        if factors and max(factors) > 1 + 1e-6:
            raise AssertionError(
                f"{where}: rank {rank} scaled a piece by {max(factors):.4f}: clipping only ever "
                "scales down: min(1, max_norm / (norm + 1e-6))"
            )
        if factors and max(factors) - min(factors) > 1e-5:
            unscaled = [
                (n, s)
                for n, s, b, a in zip(
                    facts["names"], facts["sharded"], facts["before"], facts["after"]
                )
                if b.numel() and torch.equal(a, b) and b.norm() > 0
            ]
            raise AssertionError(
                f"{where}: rank {rank} scaled its pieces by different factors "
                f"({min(factors):.4f} to {max(factors):.4f})"
                + (
                    f"; {unscaled[0][0]!r} (sharded on {unscaled[0][1]}) not at all: every "
                    "piece is scaled, the copies too (each rank scales its own copy)"
                    if unscaled
                    else ": one factor, the global norm's, for every piece"
                )
            )
    factors = {rank: round(f[0], 5) for rank, f in every.items() if f}
    if len(set(factors.values())) > 1:
        raise AssertionError(
            f"{where}: the ranks scaled by different factors {factors}: each rank clipped by a "
            "norm of its own. The factor comes from the global norm (global_grad_norm), the "
            "same on every rank, or the replicas of a parameter drift apart"
        )
    for rank, got in enumerate(results):
        facts = got[(case, p, SHRINK)]
        if facts["norm"] is not None and math.isclose(facts["norm"], SHRINK * true, rel_tol=1e-4):
            raise AssertionError(
                f"{where}: rank {rank} returned {facts['norm']:.6g}, the norm after clipping "
                f"(max_norm): return the norm before it, {true:.6g}, as clip_grad_norm_ does"
            )
        assert facts["norm"] is not None and math.isclose(facts["norm"], true, rel_tol=1e-5), (
            f"{where}: rank {rank} returned {facts['norm']}, expected the global norm before "
            f"clipping {true:.6g}"
        )
        for name, after, expected in zip(facts["names"], facts["after"], facts["expected"]):
            assert torch.allclose(after, expected, rtol=1e-5, atol=1e-8), (
                f"{where}: rank {rank}'s clipped piece {name!r} differs from one process's "
                f"clip_grad_norm_ laid out the same way by up to "
                f"{(after - expected).abs().max().item():.3g}"
            )


@pytest.mark.step(5)
def test_clip_grad_norm_leaves_small_gradients_alone(kata):
    results = _clip_results()
    true = results[0][("true", 2.0)]
    for case, (shape, layout) in LAYOUTS.items():
        for rank, got in enumerate(results):
            facts = got[(case, 2.0, GROW)]
            for name, before, after in zip(facts["names"], facts["before"], facts["after"]):
                if torch.equal(before, after):
                    continue
                factor = (after.double().norm() / before.double().norm()).item()
                raise AssertionError(
                    f"clip_grad_norm(max_norm={GROW * true:.4g}) of a gradient whose norm is "
                    f"only {true:.4g}, laid out {layout} on {shape}: rank {rank} scaled "
                    f"{name!r} by {factor:.4f}: below max_norm nothing changes (the factor is "
                    "min(1, ...)): clipping never scales up"
                )


def _against_torch_clip(rank, world_size):
    kata = load_kata(KATA)
    out = {}
    for case in AGAINST_TORCH:
        _, layout = LAYOUTS[case]
        true = torch.nn.utils.get_total_norm(list(_whole_gradient().values())).item()
        mesh, stages, pieces, _ = _layout_pieces(kata, case)
        kata.clip_grad_norm(pieces, SHRINK * true, mesh, 2.0, stages)
        params = _as_dtensors(mesh, layout, _whole_gradient())
        torch.nn.utils.clip_grads_with_norm_(
            list(params.values()), SHRINK * true, _torchs_norm(mesh, layout, params, 2.0)
        )
        theirs = {name: q.grad.to_local() for name, q in params.items()}
        out[case] = [(piece.name, piece.grad, theirs[piece.name]) for piece in pieces]
    return out


@pytest.mark.step(5)
def test_clip_grad_norm_equals_torchs_clip_grads_with_norm_on_dtensors(kata):
    results = run_world(_against_torch_clip, 4, deadline=60)
    for rank, got in enumerate(results):
        for case, pieces in got.items():
            shape, layout = LAYOUTS[case]
            for name, mine, theirs in pieces:
                assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-8), (
                    f"the TinyTransformer's gradient laid out {layout} on {shape}: rank "
                    f"{rank}'s clipped piece {name!r} differs by up to "
                    f"{(mine - theirs).abs().max().item():.3g} from torch's "
                    "clip_grads_with_norm_ on the same gradients as DTensors, with the norm of "
                    "get_total_norm"
                    + (
                        " and torchtitan's all-reduce over the stages"
                        if "pp" in layout.values()
                        else ""
                    )
                )


def _clip_refusals(rank, world_size):
    kata = load_kata(KATA)
    mesh = _mesh({"dp": 2})
    out = {}
    for max_norm in (0, -1.0, float("nan"), "1", True):
        piece = kata.Piece("w", torch.tensor([3.0, 4.0]), ("dp",))
        with recording(("all_reduce", "broadcast", "reduce", "all_gather")) as calls:
            try:
                kata.clip_grad_norm([piece], max_norm, mesh)
                out[repr(max_norm)] = f"returned; the piece became {piece.grad.tolist()}"
            except ValueError:
                out[repr(max_norm)] = "sent first" if calls else None
            except KataTodo:
                raise
            except Exception as error:
                out[repr(max_norm)] = f"raised {_failure(error)}"
    return out


@pytest.mark.step(5)
def test_clip_grad_norm_refuses_a_max_norm_that_is_not_positive(kata):
    for rank, got in enumerate(run_world(_clip_refusals, 2)):
        for max_norm, outcome in got.items():
            assert outcome is None, (
                f"clip_grad_norm(pieces, max_norm={max_norm}, ...) on rank {rank} of 2: "
                + (
                    "it all-reduced before refusing: check max_norm first, then send"
                    if outcome == "sent first"
                    else f"{outcome}: max_norm must be a positive number (a norm of 0 or less "
                    "would zero or flip every gradient); raise ValueError saying so, before "
                    "anything is sent"
                )
            )


@pytest.mark.step(5)
def test_program_shows_every_rank_the_global_numbers(kata):
    done = run_module(KATA, "--max-norm", "0.5", timeout=180)
    out = done.stdout
    assert done.returncode == 0, f"the program exited with {done.returncode}:\n{out}\n{done.stderr}"
    globals_ = [line for line in out.splitlines() if "global_mean" in line]
    assert len(globals_) == 4, f"the program shows no global_mean line for each of 4 ranks:\n{out}"
    assert len({line.rsplit(" ", 1)[-1] for line in globals_}) == 1, (
        f"the program's ranks report different global means:\n{out}"
    )
    assert "equal one process's" in out.splitlines()[-1], (
        f"the program's verdict is not agreement with one process:\n{out}"
    )


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    from dojo.devices import rank_device

    device = rank_device()
    torch.cuda.set_device(device)
    kata = load_kata(KATA)
    grads = {n: g.to(device) for n, g in _whole_gradient().items()}
    true = torch.nn.utils.get_total_norm(list(grads.values())).item()
    shape = {"dp": 2, "tp": 2} if world_size == 4 else {"dp": 1}
    layout = {"dp": "fsdp", "tp": "tp"} if world_size == 4 else {"dp": "fsdp"}
    mesh = _mesh(shape)
    pieces = kata.lay_out(grads, mesh, layout)
    norm = kata.clip_grad_norm(pieces, SHRINK * true, mesh)
    expected = kata.lay_out(_clipped_alone(grads, SHRINK * true, 2.0), mesh, layout)
    mean = kata.global_mean(torch.tensor(6.0, device=device), 3)
    gap = max((p.grad - e.grad).abs().max().item() for p, e in zip(pieces, expected))
    return {"norm": _number(norm), "true": true, "gap": gap, "mean": mean}


@pytest.mark.step(5)
@pytest.mark.cuda
@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 4)])
def test_global_numbers_on_cuda(kata, backend, world_size):
    require_gpus(1)
    results = run_world(
        _on_cuda, world_size, backend=backend, env={"DOJO_DEVICE": "cuda"}, deadline=120
    )
    for rank, got in enumerate(results):
        assert got["norm"] is not None and math.isclose(got["norm"], got["true"], rel_tol=1e-5), (
            f"{backend} on CUDA, {world_size} rank(s): rank {rank}'s norm is {got['norm']}, one "
            f"process's {got['true']:.6g}"
        )
        assert got["gap"] < 1e-6, (
            f"{backend} on CUDA: rank {rank}'s clipped pieces differ from one process's by up "
            f"to {got['gap']:.3g}"
        )
        assert math.isclose(got["mean"], 2.0, rel_tol=1e-9), (
            f"{backend} on CUDA: global_mean(6.0, 3) on every rank gave {got['mean']}, expected 2"
        )
