"""k10 sharding: the tutorial's DataPartitioner, whole-number batches, DistributedSampler by hand."""

import itertools
import math
import random

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dojo.harness.impl import load_kata
from dojo.spec.testing import run_program_ok
from dojo.todo import KataTodo

KATA = "k10_sharding"

# The grid the sampler must match DistributedSampler on: tiny data sets (fewer samples than
# ranks, so padding repeats the order more than once), lengths around multiples of the world
# size, and a longer one.
LENGTHS = (*range(0, 14), 31, 100)
WORLD_SIZES = (1, 2, 3, 4, 5)
SETTINGS = list(
    itertools.product((True, False), (0, 7), (0, 3), (False, True))
)  # shuffle, seed, epoch, drop_last


def torch_indices(length, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False):
    sampler = DistributedSampler(range(length), num_replicas, rank, shuffle, seed, drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def describe(length, num_replicas, rank, shuffle, seed, epoch, drop_last):
    return (
        f"{length} samples, num_replicas={num_replicas}, rank={rank}, shuffle={shuffle}, "
        f"seed={seed}, epoch={epoch}, drop_last={drop_last}"
    )


def the_order(length, shuffle, seed, epoch):
    """DistributedSampler's order before padding: a seeded permutation, or range(n)."""
    if not shuffle:
        return list(range(length))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator).tolist()


def why_different(got, case, sampler=False):
    """A hint for the learner from how their index list differs from DistributedSampler's."""
    length, num_replicas, rank, shuffle, seed, epoch, drop_last = case
    expected = torch_indices(*case)
    n, size = num_replicas, len(expected)
    total = size * n
    order = the_order(length, shuffle, seed, epoch)
    padded = (order * (total // length + 1))[:total] if length else []
    if len(got) != len(expected):
        if drop_last:
            return (
                f"with drop_last each rank gets ceil((n - N) / N) = {len(expected)} when n is not "
                "a multiple of N (rounded up, not down), else n / N; the tail of the order is cut "
                "off"
            )
        return (
            f"without drop_last each rank gets ceil(n / N) = {len(expected)}: pad the order to "
            f"{total} by repeating it from its start (several times if n is smaller than the "
            "padding), so that every rank gets as many indices"
        )
    if shuffle and epoch and got == torch_indices(length, n, rank, shuffle, seed, 0, drop_last):
        if sampler:
            return (
                f"after set_epoch({epoch}) the sampler still gives epoch 0's order: set_epoch "
                "must store the epoch, and __iter__ must shuffle with seed + epoch "
                f"(here {seed} + {epoch})"
            )
        return (
            f"that is epoch 0's order: seed the generator with seed + epoch (here {seed} + {epoch})"
        )
    if shuffle and got == torch_indices(length, n, rank, False, seed, epoch, drop_last):
        return "that is the unshuffled order: with shuffle=True the order is a seeded torch.randperm(n)"
    if not shuffle and got == torch_indices(length, n, rank, True, seed, epoch, drop_last):
        return "that is a shuffled order: with shuffle=False the order is range(n), as it is"
    if n > 1 and got == padded[rank * size : (rank + 1) * size]:
        return (
            f"that is a contiguous block of the order (positions {rank * size}..{(rank + 1) * size - 1}): "
            "DistributedSampler deals the order out like cards, rank r takes every N-th index "
            "starting at r, order[r::N]"
        )
    pad = total - length
    if not drop_last and 0 < pad <= length and got == (order + order[-pad:])[rank::n]:
        return (
            f"the order was padded with its last {pad} indices: DistributedSampler pads by "
            f"repeating the order from its start (order + order[:{pad}])"
        )
    if drop_last and shuffle and got == the_order(total, shuffle, seed, epoch)[rank::n]:
        return (
            f"the indices were cut to the first {total} before shuffling, so the last "
            f"{length - total} sample(s) are never used in any epoch: shuffle all {length} indices "
            "first, then cut the tail off the shuffled order"
        )
    strided = "rank r takes every N-th index of the order, starting at r: order[r::N]"
    if not shuffle:
        return f"without shuffle the order is range(n), padded from its start; {strided}"
    return (
        f"the order is torch.randperm(n, generator=g) with g = torch.Generator() and "
        f"g.manual_seed(seed + epoch), padded from its start; {strided}"
    )


def check_repeatable(first, again, call):
    assert first == again, (
        f"{call} gave {first}, then {again} for the same arguments: the order must depend only "
        "on seed + epoch. Shuffle with a torch.Generator of your own seeded with seed + epoch, "
        "not the global random state: every rank's global state differs, so the ranks' shards "
        "would overlap"
    )


def refused(call, what, named=()):
    """Fail unless ``call()`` raises ValueError whose text names one of ``named``."""
    try:
        got = call()
    except ValueError as error:
        text = str(error)
        assert not named or any(name in text for name in named), (
            f"{what} raised ValueError({text!r}): say what is wrong, naming "
            f"{' or '.join(named)} and the value given, so that the caller can fix the call"
        )
        return
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(
            f"{what} raised {type(error).__name__}: {error}. Check the arguments first and raise "
            "ValueError saying what is wrong"
        ) from error
    raise AssertionError(f"{what} returned {got!r}: it must raise ValueError saying what is wrong")


def indices_of(sampler, what):
    """``list(sampler)``, explaining a sampler whose __iter__ is no iterator."""
    try:
        return list(sampler)
    except TypeError as error:
        if "iter" not in str(error):
            raise
        raise AssertionError(
            f"list({what}) raised TypeError: {error}. __iter__ must return an iterator, as "
            "DataLoader calls iter(sampler): return iter(indices), or yield from indices"
        ) from error


# ------------------------------------------------------------------ step 1: the tutorial's partitioner


def tutorial_partitions(length, sizes, seed):
    rng = random.Random(seed)
    indexes = list(range(length))
    rng.shuffle(indexes)
    parts = []
    for fraction in sizes:
        part_len = int(fraction * length)
        parts.append(indexes[:part_len])
        indexes = indexes[part_len:]
    return parts


def why_partitions_differ(got, expected, length, sizes):
    got_sizes, want_sizes = [len(p) for p in got], [len(p) for p in expected]
    if got_sizes != want_sizes:
        return (
            f"the parts hold {got_sizes} indices, expected {want_sizes}: part i holds "
            f"int(sizes[i] * len(data)) indices, rounded down like the tutorial's int(), "
            "whatever is left over stays unused"
        )
    if sorted(i for p in got for i in p) == list(range(sum(want_sizes))):
        return (
            "the parts are cut from the unshuffled indices: shuffle list(range(len(data))) "
            "with random.Random(seed).shuffle first, then cut the parts from the shuffled list"
        )
    if [sorted(p) for p in got] == [sorted(p) for p in expected]:
        return (
            "each part holds the right indices in another order: keep the shuffled order, "
            "cut each part as a slice of it"
        )
    return (
        "shuffle list(range(len(data))) with random.Random(seed).shuffle (the tutorial's "
        "generator, not torch's nor the global random module), then cut int(fraction * "
        "len(data)) indices per part, in order"
    )


def check_data_untouched(data, before, call):
    """The caller's list stays the caller's: shuffled in place, it reaches the next partitioner
    (every rank builds its own) in another order, and that one cuts other parts."""
    if data != before:
        shown = ", ".join(map(repr, data[:6])) + (", ..." if len(data) > 6 else "")
        raise AssertionError(
            f"{call} changed the list it was given: it held the samples in order, now [{shown}]. "
            "random.Random(seed).shuffle(x) shuffles x itself, so shuffling data reorders the "
            "caller's samples, and the next DataPartitioner built on that list shuffles an "
            "already shuffled list and cuts other parts. Shuffle a list of indices of your own, "
            "list(range(len(data))), and leave data as it was given"
        )


@pytest.mark.step(1)
def test_every_rank_gets_the_same_cut(kata):
    """Each rank builds its own DataPartitioner: only a shared seed makes the parts disjoint."""
    data = list(range(50))
    random.seed(99)  # a partitioner that uses the global random module would depend on this
    first = kata.DataPartitioner(data, [0.25] * 4).partitions
    check_data_untouched(data, list(range(50)), "DataPartitioner(data of 50, [0.25] * 4)")
    random.seed(11)
    second = kata.DataPartitioner(data, [0.25] * 4).partitions
    assert [list(p) for p in first] == [list(p) for p in second], (
        "two DataPartitioners with the same seed cut the data differently, so ranks would train on "
        "overlapping parts: shuffle with random.Random(seed), a generator of its own seeded with "
        "the seed given, not the global random module nor an unseeded random.Random()"
    )


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "length, sizes, seed",
    [
        (10, (0.7, 0.2, 0.1), 1234),
        (10, [0.25] * 4, 1234),
        (1000, [1 / 3] * 3, 1234),
        (7, [0.5, 0.5], 5),
        (0, [1.0], 1),
    ],
)
def test_data_partitioner_cuts_as_the_tutorial_does(kata, length, sizes, seed):
    data = [f"sample {i}" for i in range(length)]
    partitioner = kata.DataPartitioner(data, sizes, seed)
    expected = tutorial_partitions(length, sizes, seed)
    got = [list(p) for p in partitioner.partitions]
    call = f"DataPartitioner(data of {length}, sizes={list(sizes)}, seed={seed})"
    check_data_untouched(data, [f"sample {i}" for i in range(length)], call)
    assert got == expected, f"{call}.partitions is {got}, expected the tutorial's {expected}: " + (
        why_partitions_differ(got, expected, length, sizes)
    )
    flat = [i for part in got for i in part]
    assert len(flat) == len(set(flat)), f"the parts {got} share indices: they must be disjoint"


@pytest.mark.step(1)
def test_default_partitioner_is_the_tutorials(kata):
    partitioner = kata.DataPartitioner(list(range(20)))
    expected = tutorial_partitions(20, (0.7, 0.2, 0.1), 1234)
    got = [list(p) for p in partitioner.partitions]
    assert got == expected, (
        f"DataPartitioner(data of 20) gave the parts {got}, expected {expected}: it must default "
        "to the tutorial's sizes=[0.7, 0.2, 0.1] and seed=1234; "
        + why_partitions_differ(got, expected, 20, (0.7, 0.2, 0.1))
    )


@pytest.mark.step(1)
def test_partition_is_a_view_of_its_indices(kata):
    data = [f"sample {i}" for i in range(10)]
    partitioner = kata.DataPartitioner(data, [0.5, 0.5], 3)
    for number in range(2):
        part = partitioner.use(number)
        indices = list(partitioner.partitions[number])
        assert len(part) == len(indices), (
            f"len(use({number})) is {len(part)}, but partition {number} has {len(indices)} indices"
        )
        got = [part[i] for i in range(len(part))]
        expected = [data[i] for i in indices]
        assert got == expected, (
            f"use({number})[i] gave {got}, expected {expected}: item i of a Partition is "
            "data[index[i]]"
        )


@pytest.mark.step(1)
@pytest.mark.parametrize("sizes", [[0.7, 0.7], [-0.1, 0.5]])
def test_partitioner_rejects_impossible_sizes(kata, sizes):
    refused(
        lambda: kata.DataPartitioner(list(range(10)), sizes).partitions,
        f"DataPartitioner(10 samples, sizes={sizes})",
        named=("size", "fraction"),
    )


# ------------------------------------------------------------------ step 2: whole-number batches


@pytest.mark.step(2)
@pytest.mark.parametrize(
    # 128 on 3 ranks first: the tutorial's 128 / float(3) shows at once what goes wrong
    "global_batch, world_size, expected",
    [(128, 3, 42), (128, 1, 128), (128, 4, 32), (10, 10, 1)],
)
def test_per_rank_batch_size_is_a_whole_number(kata, global_batch, world_size, expected):
    got = kata.per_rank_batch_size(global_batch, world_size)
    assert got == expected and isinstance(got, int), (
        f"per_rank_batch_size({global_batch}, {world_size}) returned {got!r}, expected the int "
        f"{expected}: DataLoader needs a whole number of samples (the tutorial's 128 / float(3) "
        "= 42.67 is refused), so round down"
    )


@pytest.mark.step(2)
@pytest.mark.parametrize("global_batch, world_size", [(2, 4), (0, 1), (8, 0)])
def test_per_rank_batch_size_rejects_impossible_shares(kata, global_batch, world_size):
    refused(
        lambda: kata.per_rank_batch_size(global_batch, world_size),
        f"per_rank_batch_size({global_batch}, {world_size}), where a rank would get no sample,",
        named=("batch", "world_size", "rank"),
    )


# ------------------------------------------------------------------ step 3: DistributedSampler's arithmetic


@pytest.mark.step(3)
def test_shard_size_matches_distributed_sampler(kata):
    for length, world, drop_last in itertools.product(LENGTHS, WORLD_SIZES, (False, True)):
        expected = len(DistributedSampler(range(length), world, 0, drop_last=drop_last))
        got = kata.shard_size(length, world, drop_last)
        assert got == expected, (
            f"shard_size({length}, {world}, drop_last={drop_last}) returned {got!r}, "
            f"DistributedSampler gives each rank {expected}: "
            + (
                "ceil((n - N) / N) when n is not a multiple of N, else n / N"
                if drop_last
                else "ceil(n / N), padding included"
            )
        )


def report_clearest(failures, total):
    """Fail with the failure of the longest data set: there a wrong shard shows its pattern best."""
    if failures:
        _, message = max(failures, key=lambda failure: failure[0])
        raise AssertionError(
            f"{len(failures)} of the {total} cases tried differ from DistributedSampler; the "
            f"clearest: {message}"
        )


@pytest.mark.step(3)
def test_shard_indices_match_distributed_sampler(kata):
    check_repeatable(
        list(kata.shard_indices(100, 4, 1, True, 7, 3)),
        list(kata.shard_indices(100, 4, 1, True, 7, 3)),
        "shard_indices(100, 4, 1, shuffle=True, seed=7, epoch=3)",
    )
    failures, total = [], 0
    for length, world in itertools.product(LENGTHS, WORLD_SIZES):
        for shuffle, seed, epoch, drop_last in SETTINGS:
            for rank in range(world):
                case = (length, world, rank, shuffle, seed, epoch, drop_last)
                expected = torch_indices(*case)
                got = list(kata.shard_indices(*case))
                total += 1
                if got != expected:
                    failures.append(
                        (
                            (length, world),
                            f"shard_indices with {describe(*case)} returned {got}, "
                            f"DistributedSampler gives {expected}: " + why_different(got, case),
                        )
                    )
    report_clearest(failures, total)


# ------------------------------------------------------------------ step 4: the sampler


@pytest.mark.step(4)
def test_sampler_matches_distributed_sampler(kata):
    failures, total = [], 0
    for length, world in itertools.product(LENGTHS, WORLD_SIZES):
        dataset = range(length)
        for shuffle, seed, epoch, drop_last in SETTINGS:
            for rank in range(world):
                case = (length, world, rank, shuffle, seed, epoch, drop_last)
                sampler = kata.ShardSampler(
                    dataset,
                    num_replicas=world,
                    rank=rank,
                    shuffle=shuffle,
                    seed=seed,
                    drop_last=drop_last,
                )
                sampler.set_epoch(epoch)
                expected = torch_indices(*case)
                got = indices_of(sampler, "ShardSampler")
                total += 1
                if got != expected:
                    failures.append(
                        (
                            (length, world),
                            f"ShardSampler with {describe(*case)}, after set_epoch({epoch}), "
                            f"gave {got}; DistributedSampler gives {expected}: "
                            + why_different(got, case, sampler=True),
                        )
                    )
                elif len(sampler) != len(expected):
                    failures.append(
                        (
                            (length, world),
                            f"len(ShardSampler) with {describe(*case)} is {len(sampler)}, but "
                            f"it yields {len(expected)} indices (as DistributedSampler does): "
                            "DataLoader uses len() to count batches, so len() must count what "
                            "__iter__ yields",
                        )
                    )
    report_clearest(failures, total)


@pytest.mark.step(4)
def test_set_epoch_reshuffles_and_iterating_again_repeats(kata):
    sampler = kata.ShardSampler(range(40), num_replicas=2, rank=0, shuffle=True, seed=3)
    first, again = indices_of(sampler, "ShardSampler"), indices_of(sampler, "ShardSampler")
    assert first == again, (
        f"iterating the same epoch twice gave {first} then {again}: the order must depend only on "
        "seed + epoch (a fresh torch.Generator each time), not on how often it was iterated"
    )
    sampler.set_epoch(1)
    assert list(sampler) != first, (
        "set_epoch(1) left the order unchanged: set_epoch must store the epoch, and __iter__ "
        "must seed the generator with seed + epoch, so each epoch is shuffled differently"
    )


@pytest.mark.step(4)
def test_shards_are_disjoint_and_cover_the_data(kata):
    for length, world in itertools.product(LENGTHS, WORLD_SIZES):
        for drop_last in (False, True):
            shards = [
                indices_of(
                    kata.ShardSampler(range(length), world, rank, True, 5, drop_last),
                    "ShardSampler",
                )
                for rank in range(world)
            ]
            taken = [i for shard in shards for i in shard]
            sizes = {len(s) for s in shards}
            assert len(sizes) <= 1, (
                f"with {length} samples on {world} ranks (drop_last={drop_last}) the shards have "
                f"sizes {[len(s) for s in shards]}: every rank needs as many samples, or the ranks "
                "with fewer batches leave the others waiting in an all-reduce"
            )
            if drop_last:
                dropped = length - len(set(taken))
                assert len(taken) == len(set(taken)) and dropped < world, (
                    f"with drop_last, {length} samples on {world} ranks: shards {shards} must be "
                    f"disjoint and leave out fewer than {world} samples"
                )
            else:
                assert set(taken) == set(range(length)), (
                    f"{length} samples on {world} ranks: the shards {shards} leave out "
                    f"{sorted(set(range(length)) - set(taken))}: without drop_last every sample is used"
                )
                padding = len(taken) - length
                assert padding == world * math.ceil(length / world) - length, (
                    f"{length} samples on {world} ranks: {padding} indices are repeated, but padding "
                    f"only fills the last round: {len(taken)} = {world} x ceil({length} / {world})"
                )


@pytest.mark.step(4)
@pytest.mark.parametrize("rank, num_replicas", [(4, 4), (-1, 4)])
def test_sampler_rejects_a_rank_outside_the_world(kata, rank, num_replicas):
    refused(
        lambda: kata.ShardSampler(range(10), num_replicas=num_replicas, rank=rank),
        f"ShardSampler(range(10), num_replicas={num_replicas}, rank={rank}) (ranks run 0.."
        f"{num_replicas - 1})",
        named=("rank",),
    )


# ------------------------------------------------------------------ a data-parallel run on your sampler

LENGTH, GLOBAL_BATCH, EPOCHS, SEED = 48, 16, 2, 5


def make_dataset():
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(LENGTH, 3, generator=generator)
    targets = inputs @ torch.tensor([1.0, -2.0, 3.0]) + 0.5
    return TensorDataset(torch.arange(LENGTH), inputs, targets)


def make_model():
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    return model


def step_gradient(model, inputs, targets):
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs).squeeze(1), targets).backward()


def sgd_step(model, lr=0.1):
    # By hand: creating a torch.optim optimizer first imports torch._dynamo (~2-4 s per process).
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= lr * parameter.grad


def _train_on_rank(rank, world_size):
    """Data-parallel SGD fed by the learner's sampler and batch size (num_replicas, rank from the group)."""
    kata = load_kata(KATA)
    dataset = make_dataset()
    sampler = kata.ShardSampler(dataset, shuffle=True, seed=SEED)
    loader = DataLoader(
        dataset, batch_size=kata.per_rank_batch_size(GLOBAL_BATCH, world_size), sampler=sampler
    )
    model = make_model()
    seen = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = []
        for indices, inputs, targets in loader:
            step_gradient(model, inputs, targets)
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= world_size
            sgd_step(model)
            batches.append(indices.tolist())
        seen.append(batches)
    return seen, [p.detach().clone() for p in model.parameters()]


def reference_run(world_size):
    """The same training, every rank simulated in one process, fed by torch's DistributedSampler."""
    dataset = make_dataset()
    batch = GLOBAL_BATCH // world_size
    model = make_model()
    seen = [[] for _ in range(world_size)]
    for epoch in range(EPOCHS):
        per_rank = [
            torch_indices(LENGTH, world_size, r, True, SEED, epoch) for r in range(world_size)
        ]
        batches = [
            [shard[i : i + batch] for i in range(0, len(shard), batch)] for shard in per_rank
        ]
        for rank in range(world_size):
            seen[rank].append(batches[rank])
        for step in range(len(batches[0])):
            grads = []
            for rank in range(world_size):
                _, inputs, targets = dataset[batches[rank][step]]
                step_gradient(model, inputs, targets)
                grads.append([p.grad.clone() for p in model.parameters()])
            for parameter, *rank_grads in zip(model.parameters(), *grads):
                parameter.grad = sum(rank_grads) / world_size
            sgd_step(model)
    return seen, [p.detach() for p in model.parameters()]


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [2, 3])
def test_data_parallel_run_on_your_sampler(world, world_size):
    results = world.run(_train_on_rank, world_size, deadline=20)
    expected_seen, expected_params = reference_run(world_size)
    for epoch in range(EPOCHS):
        shards = [sorted(i for batch in seen[epoch] for i in batch) for seen, _ in results]
        taken = [i for shard in shards for i in shard]
        shared = len(taken) - len(set(taken))
        assert shared == 0 and len(taken) == LENGTH, (
            f"epoch {epoch} on {world_size} ranks: the ranks trained on {len(taken)} samples, "
            f"{len(set(taken))} different ones, of the {LENGTH}; expected each sample once, on "
            "one rank: every rank needs a shard of its own (does the sampler take num_replicas "
            "and rank from the process group when they are not given?)"
        )
    for rank, (seen, params) in enumerate(results):
        assert seen == expected_seen[rank], (
            f"rank {rank} of {world_size} trained on the batches {seen} (per epoch), but "
            f"DistributedSampler would have fed it {expected_seen[rank]}"
        )
        for got, expected in zip(params, expected_params):
            assert torch.allclose(got, expected, atol=1e-5), (
                f"rank {rank}'s model after {EPOCHS} epochs is {got.flatten().tolist()}, the reference "
                f"run's is {expected.flatten().tolist()}"
            )


@pytest.mark.step(4)
def test_program_shows_the_shards(kata):
    """`python -m katas.k10_sharding`: the tutorial's parts and the sampler's shards, per rank."""
    out = run_program_ok(KATA, "--world-size", "4", "--dataset-size", "10", timeout=90).stdout
    verdicts = [line for line in out.splitlines() if "same as DistributedSampler" in line]
    assert len(verdicts) == 2 and all(line.endswith("yes") for line in verdicts), (
        f"expected two epochs, each the same as DistributedSampler, in:\n{out}"
    )
    assert "12 indices handed out, 2 of them repeated (padding)" in verdicts[0], (
        f"10 samples on 4 ranks: 12 indices, 2 padded, expected in:\n{verdicts[0]}"
    )
