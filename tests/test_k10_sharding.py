"""k10 sharding: the tutorial's DataPartitioner, whole-number batches, DistributedSampler by hand."""

import itertools
import math
import random

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dojo.harness.impl import load_kata
from dojo.lang import t
from dojo.spec.testing import run_module_ok
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
    return t(
        "{length} samples, num_replicas={num_replicas}, rank={rank}, shuffle={shuffle}, "
        "seed={seed}, epoch={epoch}, drop_last={drop_last}",
        length=length,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        drop_last=drop_last,
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
            return t(
                "with drop_last each rank gets ceil((n - N) / N) = {size} when n is not a "
                "multiple of N (rounded up, not down), else n / N; the tail of the order is cut "
                "off",
                size=len(expected),
            )
        return t(
            "without drop_last each rank gets ceil(n / N) = {size}: pad the order to {total} by "
            "repeating it from its start (several times if n is smaller than the padding), so "
            "that every rank gets as many indices",
            size=len(expected),
            total=total,
        )
    if shuffle and epoch and got == torch_indices(length, n, rank, shuffle, seed, 0, drop_last):
        if sampler:
            return t(
                "after set_epoch({epoch}) the sampler still gives epoch 0's order: set_epoch "
                "must store the epoch, and __iter__ must shuffle with seed + epoch (here {seed} "
                "+ {epoch})",
                epoch=epoch,
                seed=seed,
            )
        return t(
            "that is epoch 0's order: seed the generator with seed + epoch (here {seed} + {epoch})",
            seed=seed,
            epoch=epoch,
        )
    if shuffle and got == torch_indices(length, n, rank, False, seed, epoch, drop_last):
        return t(
            "that is the unshuffled order: with shuffle=True the order is a seeded "
            "torch.randperm(n)"
        )
    if not shuffle and got == torch_indices(length, n, rank, True, seed, epoch, drop_last):
        return t("that is a shuffled order: with shuffle=False the order is range(n), as it is")
    if n > 1 and got == padded[rank * size : (rank + 1) * size]:
        return t(
            "that is a contiguous block of the order (positions {first}..{last}): "
            "DistributedSampler deals the order out like cards, rank r takes every N-th index "
            "starting at r, order[r::N]",
            first=rank * size,
            last=(rank + 1) * size - 1,
        )
    pad = total - length
    if not drop_last and 0 < pad <= length and got == (order + order[-pad:])[rank::n]:
        return t(
            "the order was padded with its last {pad} indices: DistributedSampler pads by "
            "repeating the order from its start (order + order[:{pad}])",
            pad=pad,
        )
    if drop_last and shuffle and got == the_order(total, shuffle, seed, epoch)[rank::n]:
        return t(
            "the indices were cut to the first {total} before shuffling, so the last {unused} "
            "sample(s) are never used in any epoch: shuffle all {length} indices first, then cut "
            "the tail off the shuffled order",
            total=total,
            unused=length - total,
            length=length,
        )
    strided = t("rank r takes every N-th index of the order, starting at r: order[r::N]")
    if not shuffle:
        return t(
            "without shuffle the order is range(n), padded from its start; {strided}",
            strided=strided,
        )
    return t(
        "the order is torch.randperm(n, generator=g) with g = torch.Generator() and "
        "g.manual_seed(seed + epoch), padded from its start; {strided}",
        strided=strided,
    )


def check_repeatable(first, again, call):
    assert first == again, t(
        "{call} gave {first}, then {again} for the same arguments: the order must depend "
        "only on seed + epoch. Shuffle with a torch.Generator of your own seeded with "
        "seed + epoch, not the global random state: every rank's global state differs, "
        "so the ranks' shards would overlap",
        call=call,
        first=first,
        again=again,
    )


def refused(call, what, named=()):
    """Fail unless ``call()`` raises ValueError whose text names one of ``named``."""
    try:
        got = call()
    except ValueError as error:
        text = str(error)
        assert not named or any(name in text for name in named), t(
            "{what} raised ValueError({text!r}): say what is wrong, naming {names} and "
            "the value given, so that the caller can fix the call",
            what=what,
            text=text,
            names=" or ".join(named),
        )
        return
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(
            t(
                "{what} raised {type_name}: {error}. Check the arguments first and raise "
                "ValueError saying what is wrong",
                what=what,
                type_name=type(error).__name__,
                error=error,
            )
        ) from error
    raise AssertionError(
        t(
            "{what} returned {got!r}: it must raise ValueError saying what is wrong",
            what=what,
            got=got,
        )
    )


def indices_of(sampler, what):
    """``list(sampler)``, explaining a sampler whose __iter__ is no iterator."""
    try:
        return list(sampler)
    except TypeError as error:
        if "iter" not in str(error):
            raise
        raise AssertionError(
            t(
                "list({what}) raised TypeError: {error}. __iter__ must return an iterator, "
                "as DataLoader calls iter(sampler): return iter(indices), or yield from "
                "indices",
                what=what,
                error=error,
            )
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
        return t(
            "the parts hold {got_sizes} indices, expected {want_sizes}: part i holds "
            "int(sizes[i] * len(data)) indices, rounded down like the tutorial's int(), "
            "whatever is left over stays unused",
            got_sizes=got_sizes,
            want_sizes=want_sizes,
        )
    if sorted(i for p in got for i in p) == list(range(sum(want_sizes))):
        return t(
            "the parts are cut from the unshuffled indices: shuffle list(range(len(data))) "
            "with random.Random(seed).shuffle first, then cut the parts from the shuffled list"
        )
    if [sorted(p) for p in got] == [sorted(p) for p in expected]:
        return t(
            "each part holds the right indices in another order: keep the shuffled order, "
            "cut each part as a slice of it"
        )
    return t(
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
            t(
                "{call} changed the list it was given: it held the samples in order, now "
                "[{shown}]. random.Random(seed).shuffle(x) shuffles x itself, so shuffling data "
                "reorders the caller's samples, and the next DataPartitioner built on that list "
                "shuffles an already shuffled list and cuts other parts. Shuffle a list of "
                "indices of your own, list(range(len(data))), and leave data as it was given",
                call=call,
                shown=shown,
            )
        )


@pytest.mark.step(1)
def test_every_rank_gets_the_same_cut(kata):
    """Each rank builds its own DataPartitioner: only a shared seed makes the parts disjoint."""
    data = list(range(50))
    random.seed(99)  # a partitioner that uses the global random module would depend on this
    first = kata.DataPartitioner(data, [0.25] * 4).partitions
    check_data_untouched(data, list(range(50)), t("DataPartitioner(data of 50, [0.25] * 4)"))
    random.seed(11)
    second = kata.DataPartitioner(data, [0.25] * 4).partitions
    assert [list(p) for p in first] == [list(p) for p in second], t(
        "two DataPartitioners with the same seed cut the data differently, so ranks "
        "would train on overlapping parts: shuffle with random.Random(seed), a generator "
        "of its own seeded with the seed given, not the global random module nor an "
        "unseeded random.Random()"
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
    call = t(
        "DataPartitioner(data of {length}, sizes={sizes}, seed={seed})",
        length=length,
        sizes=list(sizes),
        seed=seed,
    )
    check_data_untouched(data, [f"sample {i}" for i in range(length)], call)
    assert got == expected, t(
        "{call}.partitions is {got}, expected the tutorial's {expected}: {why}",
        call=call,
        got=got,
        expected=expected,
        why=why_partitions_differ(got, expected, length, sizes),
    )
    flat = [i for part in got for i in part]
    assert len(flat) == len(set(flat)), t(
        "the parts {got} share indices: they must be disjoint",
        got=got,
    )


@pytest.mark.step(1)
def test_default_partitioner_is_the_tutorials(kata):
    partitioner = kata.DataPartitioner(list(range(20)))
    expected = tutorial_partitions(20, (0.7, 0.2, 0.1), 1234)
    got = [list(p) for p in partitioner.partitions]
    assert got == expected, t(
        "DataPartitioner(data of 20) gave the parts {got}, expected {expected}: it must default "
        "to the tutorial's sizes=[0.7, 0.2, 0.1] and seed=1234; {why}",
        got=got,
        expected=expected,
        why=why_partitions_differ(got, expected, 20, (0.7, 0.2, 0.1)),
    )


@pytest.mark.step(1)
def test_partition_is_a_view_of_its_indices(kata):
    data = [f"sample {i}" for i in range(10)]
    partitioner = kata.DataPartitioner(data, [0.5, 0.5], 3)
    for number in range(2):
        part = partitioner.use(number)
        indices = list(partitioner.partitions[number])
        assert len(part) == len(indices), t(
            "len(use({number})) is {count}, but partition {number} has {count2} indices",
            number=number,
            count=len(part),
            count2=len(indices),
        )
        got = [part[i] for i in range(len(part))]
        expected = [data[i] for i in indices]
        assert got == expected, t(
            "use({number})[i] gave {got}, expected {expected}: item i of a Partition is "
            "data[index[i]]",
            number=number,
            got=got,
            expected=expected,
        )


@pytest.mark.step(1)
@pytest.mark.parametrize("sizes", [[0.7, 0.7], [-0.1, 0.5]])
def test_partitioner_rejects_impossible_sizes(kata, sizes):
    refused(
        lambda: kata.DataPartitioner(list(range(10)), sizes).partitions,
        t("DataPartitioner(10 samples, sizes={sizes})", sizes=sizes),
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
    assert got == expected and isinstance(got, int), t(
        "per_rank_batch_size({global_batch}, {world_size}) returned {got!r}, expected "
        "the int {expected}: DataLoader needs a whole number of samples (the tutorial's "
        "128 / float(3) = 42.67 is refused), so round down",
        global_batch=global_batch,
        world_size=world_size,
        got=got,
        expected=expected,
    )


@pytest.mark.step(2)
@pytest.mark.parametrize("global_batch, world_size", [(2, 4), (0, 1), (8, 0)])
def test_per_rank_batch_size_rejects_impossible_shares(kata, global_batch, world_size):
    refused(
        lambda: kata.per_rank_batch_size(global_batch, world_size),
        t(
            "per_rank_batch_size({global_batch}, {world_size}), where a rank would get no sample,",
            global_batch=global_batch,
            world_size=world_size,
        ),
        named=("batch", "world_size", "rank"),
    )


# ------------------------------------------------------------------ step 3: DistributedSampler's arithmetic


@pytest.mark.step(3)
def test_shard_size_matches_distributed_sampler(kata):
    for length, world, drop_last in itertools.product(LENGTHS, WORLD_SIZES, (False, True)):
        expected = len(DistributedSampler(range(length), world, 0, drop_last=drop_last))
        got = kata.shard_size(length, world, drop_last)
        assert got == expected, t(
            "shard_size({length}, {world}, drop_last={drop_last}) returned {got!r}, "
            "DistributedSampler gives each rank {expected}: {rule}",
            length=length,
            world=world,
            drop_last=drop_last,
            got=got,
            expected=expected,
            rule=t("ceil((n - N) / N) when n is not a multiple of N, else n / N")
            if drop_last
            else t("ceil(n / N), padding included"),
        )


def report_clearest(failures, total):
    """Fail with the failure of the longest data set: there a wrong shard shows its pattern best."""
    if failures:
        _, message = max(failures, key=lambda failure: failure[0])
        raise AssertionError(
            t(
                "{count} of the {total} cases tried differ from DistributedSampler; the "
                "clearest: {message}",
                count=len(failures),
                total=total,
                message=message,
            )
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
                            t(
                                "shard_indices with {case} returned {got}, DistributedSampler "
                                "gives {expected}: {why}",
                                case=describe(*case),
                                got=got,
                                expected=expected,
                                why=why_different(got, case),
                            ),
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
                            t(
                                "ShardSampler with {case}, after set_epoch({epoch}), gave {got}; "
                                "DistributedSampler gives {expected}: {why}",
                                case=describe(*case),
                                epoch=epoch,
                                got=got,
                                expected=expected,
                                why=why_different(got, case, sampler=True),
                            ),
                        )
                    )
                elif len(sampler) != len(expected):
                    failures.append(
                        (
                            (length, world),
                            t(
                                "len(ShardSampler) with {case} is {length}, but it yields "
                                "{count} indices (as DistributedSampler does): DataLoader uses "
                                "len() to count batches, so len() must count what __iter__ "
                                "yields",
                                case=describe(*case),
                                length=len(sampler),
                                count=len(expected),
                            ),
                        )
                    )
    report_clearest(failures, total)


@pytest.mark.step(4)
def test_set_epoch_reshuffles_and_iterating_again_repeats(kata):
    sampler = kata.ShardSampler(range(40), num_replicas=2, rank=0, shuffle=True, seed=3)
    first, again = indices_of(sampler, "ShardSampler"), indices_of(sampler, "ShardSampler")
    assert first == again, t(
        "iterating the same epoch twice gave {first} then {again}: the order must depend "
        "only on seed + epoch (a fresh torch.Generator each time), not on how often it "
        "was iterated",
        first=first,
        again=again,
    )
    sampler.set_epoch(1)
    assert list(sampler) != first, t(
        "set_epoch(1) left the order unchanged: set_epoch must store the epoch, and "
        "__iter__ must seed the generator with seed + epoch, so each epoch is shuffled "
        "differently"
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
            assert len(sizes) <= 1, t(
                "with {length} samples on {world} ranks (drop_last={drop_last}) the "
                "shards have sizes {value}: every rank needs as many samples, or the "
                "ranks with fewer batches leave the others waiting in an all-reduce",
                length=length,
                world=world,
                drop_last=drop_last,
                value=[len(s) for s in shards],
            )
            if drop_last:
                dropped = length - len(set(taken))
                assert len(taken) == len(set(taken)) and dropped < world, t(
                    "with drop_last, {length} samples on {world} ranks: shards {shards} "
                    "must be disjoint and leave out fewer than {world} samples",
                    length=length,
                    world=world,
                    shards=shards,
                )
            else:
                assert set(taken) == set(range(length)), t(
                    "{length} samples on {world} ranks: the shards {shards} leave out "
                    "{value}: without drop_last every sample is used",
                    length=length,
                    world=world,
                    shards=shards,
                    value=sorted(set(range(length)) - set(taken)),
                )
                padding = len(taken) - length
                assert padding == world * math.ceil(length / world) - length, t(
                    "{length} samples on {world} ranks: {padding} indices are repeated, "
                    "but padding only fills the last round: {count} = {world} x "
                    "ceil({length} / {world})",
                    length=length,
                    world=world,
                    padding=padding,
                    count=len(taken),
                )


@pytest.mark.step(4)
@pytest.mark.parametrize("rank, num_replicas", [(4, 4), (-1, 4)])
def test_sampler_rejects_a_rank_outside_the_world(kata, rank, num_replicas):
    refused(
        lambda: kata.ShardSampler(range(10), num_replicas=num_replicas, rank=rank),
        t(
            "ShardSampler(range(10), num_replicas={num_replicas}, rank={rank}) (ranks run "
            "0..{last})",
            num_replicas=num_replicas,
            rank=rank,
            last=num_replicas - 1,
        ),
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
        assert shared == 0 and len(taken) == LENGTH, t(
            "epoch {epoch} on {world_size} ranks: the ranks trained on {count} samples, "
            "{count2} different ones, of the {LENGTH}; expected each sample once, on one "
            "rank: every rank needs a shard of its own (does the sampler take "
            "num_replicas and rank from the process group when they are not given?)",
            epoch=epoch,
            world_size=world_size,
            count=len(taken),
            count2=len(set(taken)),
            LENGTH=LENGTH,
        )
    for rank, (seen, params) in enumerate(results):
        assert seen == expected_seen[rank], t(
            "rank {rank} of {world_size} trained on the batches {seen} (per epoch), but "
            "DistributedSampler would have fed it {expected_seen}",
            rank=rank,
            world_size=world_size,
            seen=seen,
            expected_seen=expected_seen[rank],
        )
        for got, expected in zip(params, expected_params):
            assert torch.allclose(got, expected, atol=1e-5), t(
                "rank {rank}'s model after {EPOCHS} epochs is {got}, the reference run's "
                "is {expected}",
                rank=rank,
                EPOCHS=EPOCHS,
                got=got.flatten().tolist(),
                expected=expected.flatten().tolist(),
            )


@pytest.mark.step(4)
def test_program_shows_the_shards(kata):
    """`python -m katas.k10_sharding`: the tutorial's parts and the sampler's shards, per rank."""
    out = run_module_ok(KATA, "--world-size", "4", "--dataset-size", "10", timeout=90).stdout
    verdicts = [line for line in out.splitlines() if "same as DistributedSampler" in line]
    assert len(verdicts) == 2 and all(line.endswith("yes") for line in verdicts), t(
        "expected two epochs, each the same as DistributedSampler, in:\n{out}",
        out=out,
    )
    assert "12 indices handed out, 2 of them repeated (padding)" in verdicts[0], t(
        "10 samples on 4 ranks: 12 indices, 2 padded, expected in:\n{verdicts0}",
        verdicts0=verdicts[0],
    )
