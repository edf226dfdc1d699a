"""k10's mistakes catalogue: real mistakes in the tutorial's partitioner, the batch size and
DistributedSampler by hand, and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import itertools
import math
import random

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from dojo.dev.mistakes import Mistake, RightAnswer


def _kata():
    from dojo.harness.impl import load_kata

    return load_kata("k10_sharding")


# --------------------------------------------------------------------------- DataPartitioner


class _Partitioner:
    """The reference's partitioner, with the shuffle and the cut as hooks for the mistakes."""

    def __init__(self, data, sizes=(0.7, 0.2, 0.1), seed=1234):
        self.check(sizes)
        self.data = data
        indexes = list(range(len(data)))
        self.shuffle(indexes, seed)
        self.partitions = []
        for fraction in sizes:
            part_len = self.part_length(fraction, len(data))
            self.partitions.append(indexes[:part_len])
            indexes = indexes[part_len:]

    def check(self, sizes):
        if any(size < 0 for size in sizes) or sum(sizes) > 1 + 1e-9:
            raise ValueError(f"sizes must be fractions >= 0 summing to at most 1, got {sizes}")

    def shuffle(self, indexes, seed):
        random.Random(seed).shuffle(indexes)

    def part_length(self, fraction, length):
        return int(fraction * length)

    def use(self, partition):
        return _kata().Partition(self.data, self.partitions[partition])


class PartitionerGlobalRandom(_Partitioner):
    def shuffle(self, indexes, seed):
        random.shuffle(indexes)  # the global random module: every rank shuffles its own way


class PartitionerUnseeded(_Partitioner):
    def shuffle(self, indexes, seed):
        random.Random().shuffle(indexes)  # a generator of its own, but seeded from the clock


class PartitionerRoundsSizes(_Partitioner):
    def part_length(self, fraction, length):
        return round(fraction * length)  # round, where the tutorial truncates with int()


class PartitionerNoShuffle(_Partitioner):
    def shuffle(self, indexes, seed):
        pass  # "the seed is only for the sampler": the parts are contiguous ranges


class PartitionerNoSizeCheck(_Partitioner):
    def check(self, sizes):
        pass  # sizes summing to 1.4 silently give the last part what is left


class PartitionerSilentValueError(_Partitioner):
    def check(self, sizes):
        if any(size < 0 for size in sizes) or sum(sizes) > 1:
            raise ValueError("invalid argument")


class PartitionerShufflesTheCallersList(_Partitioner):
    """The tutorial's random.Random(seed), used on the caller's own list: data shuffled in place
    and the parts cut from it (on a data set of indices, 0..49, the tutorial's parts, once; a
    second partitioner on the same list shuffles the shuffled list again)."""

    def __init__(self, data, sizes=(0.7, 0.2, 0.1), seed=1234):
        self.check(sizes)
        self.data = data
        random.Random(seed).shuffle(data)  # the caller's list, in place
        self.partitions, start = [], 0
        for fraction in sizes:
            part_len = self.part_length(fraction, len(data))
            self.partitions.append(data[start : start + part_len])
            start += part_len


class PartitionerRightWithAccumulate:
    """Right, written another way: cut points from running totals, one slice per part."""

    def __init__(self, data, sizes=(0.7, 0.2, 0.1), seed=1234):
        if min(sizes, default=0) < 0 or sum(sizes) > 1 + 1e-9:
            raise ValueError(f"sizes: fractions >= 0 summing to at most 1, got {list(sizes)}")
        self.data = data
        order = list(range(len(data)))
        random.Random(seed).shuffle(order)
        ends = list(itertools.accumulate(int(f * len(data)) for f in sizes))
        self.partitions = [order[a:b] for a, b in zip([0, *ends], ends)]

    def use(self, partition):
        return _kata().Partition(self.data, self.partitions[partition])


# --------------------------------------------------------------------------- per_rank_batch_size


def batch_rounded_up(global_batch_size, world_size):
    if world_size < 1 or global_batch_size < world_size:
        raise ValueError(f"{world_size} ranks cannot share a batch of {global_batch_size}")
    return math.ceil(global_batch_size / world_size)  # "so that no sample is lost"


def batch_as_a_float(global_batch_size, world_size):
    if world_size < 1 or global_batch_size < world_size:
        raise ValueError(f"{world_size} ranks cannot share a batch of {global_batch_size}")
    return global_batch_size / world_size  # the tutorial's 128 / float(size)


def batch_without_checks(global_batch_size, world_size):
    return global_batch_size // world_size  # 2 on 4 ranks: 0; 0 ranks: ZeroDivisionError


# --------------------------------------------------------------------------- shard_size


def size_drop_last_floored(dataset_length, num_replicas, drop_last=False):
    if drop_last and dataset_length % num_replicas != 0:
        return (dataset_length - num_replicas) // num_replicas  # floor, where torch takes ceil
    return math.ceil(dataset_length / num_replicas)


def size_ignores_drop_last(dataset_length, num_replicas, drop_last=False):
    return math.ceil(dataset_length / num_replicas)


# --------------------------------------------------------------------------- shard_indices


def _indices_with(
    dataset_length, num_replicas, rank, shuffle, seed, epoch, drop_last, order=None, pad=None
):
    """The reference's arithmetic, with the order and the padding replaceable."""
    size = _kata().shard_size(dataset_length, num_replicas, drop_last)
    total = size * num_replicas
    if order is None:
        if shuffle:
            generator = torch.Generator()
            generator.manual_seed(seed + epoch)
            order = torch.randperm(dataset_length, generator=generator).tolist()
        else:
            order = list(range(dataset_length))
    if drop_last:
        order = order[:total]
    elif order:
        order = pad(order, total) if pad else (order * math.ceil(total / len(order)))[:total]
    return order[rank:total:num_replicas]


def indices_contiguous_blocks(
    dataset_length, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False
):
    size = _kata().shard_size(dataset_length, num_replicas, drop_last)
    everything = _indices_with(dataset_length, 1, 0, shuffle, seed, epoch, False)
    everything = (everything * (size * num_replicas // max(len(everything), 1) + 1))[
        : size * num_replicas
    ]
    return everything[rank * size : (rank + 1) * size]  # a block each, not every N-th index


def indices_seed_without_epoch(
    dataset_length, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False
):
    # The generator seeded with the seed alone: every epoch the same order.
    return _indices_with(dataset_length, num_replicas, rank, shuffle, seed, 0, drop_last)


def indices_global_rng(
    dataset_length, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False
):
    order = torch.randperm(dataset_length).tolist() if shuffle else None  # the global RNG
    return _indices_with(
        dataset_length, num_replicas, rank, shuffle, seed, epoch, drop_last, order=order
    )


def indices_padded_from_the_end(
    dataset_length, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False
):
    def pad(order, total):
        while len(order) < total:
            order = order + order[-(total - len(order)) :]  # repeats the tail, not the head
        return order

    return _indices_with(
        dataset_length, num_replicas, rank, shuffle, seed, epoch, drop_last, pad=pad
    )


def indices_not_padded(
    dataset_length, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False
):
    def pad(order, total):
        return order  # "padding would repeat samples": the ranks get different counts

    return _indices_with(
        dataset_length, num_replicas, rank, shuffle, seed, epoch, drop_last, pad=pad
    )


def indices_cut_before_shuffling(
    dataset_length, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False
):
    total = _kata().shard_size(dataset_length, num_replicas, drop_last) * num_replicas
    kept = total if drop_last else dataset_length  # the tail is dropped before the shuffle
    return _indices_with(kept, num_replicas, rank, shuffle, seed, epoch, False)


def indices_with_itertools(
    dataset_length, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False
):
    """Right, written another way: a cycling iterator does the padding."""
    size = _kata().shard_size(dataset_length, num_replicas, drop_last)
    if shuffle:
        order = torch.randperm(
            dataset_length, generator=torch.Generator().manual_seed(seed + epoch)
        ).tolist()
    else:
        order = list(range(dataset_length))
    padded = list(itertools.islice(itertools.cycle(order), size * num_replicas)) if order else []
    return padded[rank::num_replicas]


# --------------------------------------------------------------------------- ShardSampler


class _Sampler(Sampler[int]):
    """The reference's sampler, with hooks for the mistakes."""

    def __init__(
        self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False
    ):
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = self.default_rank() if rank is None else rank
        self.check(rank, num_replicas)
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def default_rank(self):
        return dist.get_rank()

    def check(self, rank, num_replicas):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")

    def indices(self):
        return _kata().shard_indices(
            len(self.dataset),
            self.num_replicas,
            self.rank,
            self.shuffle,
            self.seed,
            self.epoch,
            self.drop_last,
        )

    def __iter__(self):
        return iter(self.indices())

    def __len__(self):
        return _kata().shard_size(len(self.dataset), self.num_replicas, self.drop_last)

    def set_epoch(self, epoch):
        self.epoch = epoch


class SamplerIgnoresSetEpoch(_Sampler):
    def set_epoch(self, epoch):
        pass  # "the generator is seeded already"


class SamplerRankDefaultsToZero(_Sampler):
    def default_rank(self):
        return 0  # every rank trains on rank 0's shard


class SamplerLenIgnoresDropLast(_Sampler):
    def __len__(self):
        return math.ceil(len(self.dataset) / self.num_replicas)  # padding's count, always


class SamplerIterReturnsAList(_Sampler):
    def __iter__(self):
        return self.indices()  # a list is iterable, but not an iterator


class SamplerRankCheckOffByOne(_Sampler):
    def check(self, rank, num_replicas):
        if rank < 0 or rank > num_replicas:  # lets rank == num_replicas through
            raise ValueError(f"rank {rank} is outside 0..{num_replicas}")


class SamplerWithAGenerator(Sampler[int]):
    """Right, written another way: everything in __iter__, yielding as it goes."""

    def __init__(
        self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False
    ):
        self.num_replicas = num_replicas if num_replicas is not None else dist.get_world_size()
        self.rank = rank if rank is not None else dist.get_rank()
        if self.rank < 0 or self.rank >= self.num_replicas:
            raise ValueError(f"rank must be in [0, {self.num_replicas - 1}], got {self.rank}")
        self.dataset, self.shuffle, self.seed, self.drop_last = dataset, shuffle, seed, drop_last
        self.epoch = 0

    def __len__(self):
        n, replicas = len(self.dataset), self.num_replicas
        if self.drop_last and n % replicas:
            return math.ceil((n - replicas) / replicas)
        return math.ceil(n / replicas)

    def __iter__(self):
        n, total = len(self.dataset), len(self) * self.num_replicas
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        position = self.rank
        while position < total:
            yield order[position % n]
            position += self.num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch


# --------------------------------------------------------------------------- the catalogue

SAMPLER_GRID = ["test_sampler_matches_distributed_sampler"]

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "PartitionerGlobalRandom",
        replaces="DataPartitioner",
        fails=["test_every_rank_gets_the_same_cut"],
        says=["cut the data differently", "not the global random module"],
    ),
    Mistake(
        "PartitionerUnseeded",
        replaces="DataPartitioner",
        fails=["test_every_rank_gets_the_same_cut", "test_default_partitioner_is_the_tutorials"],
        says=["random.Random(seed)"],
    ),
    Mistake(
        "PartitionerShufflesTheCallersList",
        replaces="DataPartitioner",
        fails=["test_every_rank_gets_the_same_cut"],
        says=[
            "changed the list it was given",
            "shuffles x itself",
            "a list of indices of your own",
        ],
    ),
    Mistake(
        "PartitionerRoundsSizes",
        replaces="DataPartitioner",
        fails=["test_data_partitioner_cuts_as_the_tutorial_does[7-sizes3-5]"],
        says=["the parts hold [4, 3] indices, expected [3, 3]", "rounded down"],
    ),
    Mistake(
        "PartitionerNoShuffle",
        replaces="DataPartitioner",
        fails=[
            "test_data_partitioner_cuts_as_the_tutorial_does[10-sizes0-1234]",
            "test_data_partitioner_cuts_as_the_tutorial_does[10-sizes1-1234]",
        ],
        says=["cut from the unshuffled indices", "random.Random(seed).shuffle first"],
    ),
    Mistake(
        "PartitionerNoSizeCheck",
        replaces="DataPartitioner",
        fails=["test_partitioner_rejects_impossible_sizes"],
        says=["returned", "must raise ValueError saying what is wrong"],
    ),
    Mistake(
        "PartitionerSilentValueError",
        replaces="DataPartitioner",
        fails=["test_partitioner_rejects_impossible_sizes"],
        says=["raised ValueError('invalid argument')", "naming size or fraction"],
    ),
    Mistake(
        "batch_rounded_up",
        replaces="per_rank_batch_size",
        fails=["test_per_rank_batch_size_is_a_whole_number[128-3-42]"],
        says=["returned 43, expected the int 42", "round down"],
    ),
    Mistake(
        "batch_as_a_float",
        replaces="per_rank_batch_size",
        fails=["test_per_rank_batch_size_is_a_whole_number[128-3-42]"],
        says=["returned 42.666666666666664", "DataLoader needs a whole number"],
    ),
    Mistake(
        "batch_without_checks",
        replaces="per_rank_batch_size",
        fails=[
            "test_per_rank_batch_size_rejects_impossible_shares[2-4]",
            "test_per_rank_batch_size_rejects_impossible_shares[8-0]",
        ],
        says=["ValueError saying what is wrong"],
    ),
    Mistake(
        "size_drop_last_floored",
        replaces="shard_size",
        fails=["test_shard_size_matches_distributed_sampler"],
        says=["drop_last=True", "ceil((n - N) / N)"],
    ),
    Mistake(
        "size_ignores_drop_last",
        replaces="shard_size",
        fails=["test_shard_size_matches_distributed_sampler"],
        says=["drop_last=True", "ceil((n - N) / N) when n is not a multiple of N"],
    ),
    Mistake(
        "indices_contiguous_blocks",
        replaces="shard_indices",
        fails=["test_shard_indices_match_distributed_sampler"],
        says=["a contiguous block of the order", "order[r::N]"],
    ),
    Mistake(
        "indices_seed_without_epoch",
        replaces="shard_indices",
        fails=["test_shard_indices_match_distributed_sampler"],
        says=["that is epoch 0's order", "seed + epoch (here"],
    ),
    Mistake(
        "indices_global_rng",
        replaces="shard_indices",
        fails=["test_shard_indices_match_distributed_sampler"],
        says=["for the same arguments", "not the global random state"],
    ),
    Mistake(
        "indices_padded_from_the_end",
        replaces="shard_indices",
        fails=["test_shard_indices_match_distributed_sampler"],
        says=["padded with its last", "repeating the order from its start"],
    ),
    Mistake(
        "indices_not_padded",
        replaces="shard_indices",
        fails=["test_shard_indices_match_distributed_sampler"],
        says=["without drop_last each rank gets ceil(n / N)", "pad the order"],
    ),
    Mistake(
        "indices_cut_before_shuffling",
        replaces="shard_indices",
        fails=["test_shard_indices_match_distributed_sampler"],
        says=["cut to the first", "before shuffling", "never used in any epoch"],
    ),
    Mistake(
        "SamplerIgnoresSetEpoch",
        replaces="ShardSampler",
        fails=SAMPLER_GRID + ["test_set_epoch_reshuffles_and_iterating_again_repeats"],
        says=["set_epoch must store the epoch"],
    ),
    Mistake(
        "SamplerRankDefaultsToZero",
        replaces="ShardSampler",
        fails=["test_data_parallel_run_on_your_sampler[2]"],
        says=["each sample once, on one rank", "take num_replicas and rank from the process group"],
    ),
    Mistake(
        "SamplerLenIgnoresDropLast",
        replaces="ShardSampler",
        fails=SAMPLER_GRID,
        says=["len(ShardSampler) with", "DataLoader uses len() to count batches"],
    ),
    Mistake(
        "SamplerIterReturnsAList",
        replaces="ShardSampler",
        fails=SAMPLER_GRID + ["test_shards_are_disjoint_and_cover_the_data"],
        says=["__iter__ must return an iterator", "return iter(indices)"],
    ),
    Mistake(
        "SamplerRankCheckOffByOne",
        replaces="ShardSampler",
        fails=["test_sampler_rejects_a_rank_outside_the_world[4-4]"],
        says=["ShardSampler(range(10), num_replicas=4, rank=4)", "must raise ValueError"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("PartitionerRightWithAccumulate", replaces="DataPartitioner"),
    RightAnswer("indices_with_itertools", replaces="shard_indices"),
    RightAnswer("SamplerWithAGenerator", replaces="ShardSampler"),
]
