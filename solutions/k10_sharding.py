"""k10 · Sharding the data: the tutorial's DataPartitioner, then DistributedSampler by hand.

THE IDEA
    Data-parallel ranks hold the same model and must each see a different part of the data,
    or they compute the same gradients N times. The tutorial shuffles the indices once, with
    a seed every rank shares, and cuts them into one part per rank:

        10 indices shuffled with seed 1234:   2 8 3 5 6 4 9 0 1 7
        sizes [0.25] * 4, int(0.25 * 10) = 2 each:
            rank 0: 2 8   rank 1: 3 5   rank 2: 6 4   rank 3: 9 0      (1 and 7 unused)

    Every rank runs this on its own, so the seed is what makes the parts disjoint: with a seed
    of its own, each rank would shuffle differently and the parts would overlap. The tutorial
    gives each rank a batch of ``128 / float(size)``: 42.67 on 3 ranks, which ``DataLoader``
    refuses. A batch is a whole number of samples, so each rank takes ``128 // 3 = 42``.

    ``torch.utils.data.DistributedSampler`` does the same job for a whole training run: every
    sample is used, the order changes every epoch, and every rank gets the same number of
    samples (ranks that run out early would leave the others waiting in an all-reduce):

        1. the order: ``torch.randperm(n)`` from a ``torch.Generator`` seeded with
           ``seed + epoch`` (``set_epoch(epoch)`` before each epoch), or ``range(n)``
           without shuffling;
        2. the size: each rank gets ``ceil(n / N)`` samples. Without ``drop_last`` the order
           is padded to ``N * ceil(n / N)`` by repeating it from its start (again and again
           if n is tiny); with ``drop_last`` (and n not a multiple of N) each rank gets
           ``ceil((n - N) / N)`` and the tail is cut off;
        3. the shard: rank r takes every N-th index starting at r, ``order[r::N]``.

        10 samples, 4 ranks, no shuffle:  order 0 1 2 3 4 5 6 7 8 9 | 0 1   (2 padded)
            rank 0: 0 4 8   rank 1: 1 5 9   rank 2: 2 6 0   rank 3: 3 7 1
        the same with drop_last:          order 0 1 2 3 4 5 6 7 | 8 9     (2 dropped)
            rank 0: 0 4     rank 1: 1 5     rank 2: 2 6     rank 3: 3 7

STEPS
    1. ``Partition`` and ``DataPartitioner``: the tutorial's, shuffling with
       ``random.Random(seed)`` exactly as it does.
    2. ``per_rank_batch_size``: a whole number of samples per rank.
    3. ``shard_size`` and ``shard_indices``: DistributedSampler's arithmetic, as functions.
    4. ``ShardSampler``: a ``Sampler`` with DistributedSampler's arguments and behaviour
       (``num_replicas`` and ``rank`` default to the process group's), ``__len__`` and
       ``set_epoch``.

WHAT THE TESTS CHECK
    The tutorial's partitions (disjoint, seeded, sized ``int(fraction * n)``); whole-number
    batch sizes; that your sampler gives the same indices, in the same order, as
    DistributedSampler for every combination of dataset length, world size, rank, shuffle,
    seed, epoch and drop_last, padding included, with the same ``len()``; that its shards are
    disjoint and cover the data; and a short data-parallel training run on 2 and 3 ranks fed
    by your sampler, which must match a reference run fed by DistributedSampler.

RUN IT
    .venv/bin/python -m katas.k10_sharding --world-size 4 --dataset-size 10 [--drop-last] [--no-shuffle]
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from dojo.console import run_program, say
from dojo.launch import add_launch_arguments, launch_world


class Partition(Dataset):
    """The samples of ``data`` at positions ``index``, as a data set of their own."""

    def __init__(self, data, index: Sequence[int]):
        self.data = data
        self.index = list(index)

    def __len__(self) -> int:
        # BEGIN STEP 1: Partition's length
        # TODO: how many samples this part holds (len(use(i)) equals len(partitions[i])).
        return len(self.index)
        # END STEP 1

    def __getitem__(self, position: int):
        # BEGIN STEP 1: Partition's items
        # TODO: item `position` of this part is item index[position] of the whole data (the
        # tests compare use(i)[j] with data[partitions[i][j]]).
        return self.data[self.index[position]]
        # END STEP 1


class DataPartitioner:
    """The tutorial's partitioner: shuffle the indices with ``seed``, cut one part per size.

    ``sizes`` are fractions of the data (their sum at most 1); part ``i`` holds
    ``int(sizes[i] * len(data))`` indices. ``partitions`` lists each part's indices.
    """

    def __init__(self, data, sizes: Sequence[float] = (0.7, 0.2, 0.1), seed: int = 1234):
        # BEGIN STEP 1: shuffle with the seed and cut the parts
        # TODO: sizes that are negative or sum to more than 1 raise ValueError saying what is
        # wrong. Otherwise keep data in self.data and, in self.partitions, one list of indices per
        # size: disjoint, part i holding int(sizes[i] * len(data)) of them, exactly the tutorial's
        # cut (the tests compare with it for several lengths, sizes and seeds). Every rank builds
        # its own partitioner, so the cut must depend on the seed alone, never on global state.
        if any(size < 0 for size in sizes) or sum(sizes) > 1 + 1e-9:
            raise ValueError(
                f"sizes are fractions of the data, none negative, summing to at most 1; got {list(sizes)}"
            )
        self.data = data
        self.partitions = []
        rng = random.Random(seed)  # every rank must shuffle the same way, or the parts overlap
        indexes = list(range(len(data)))
        rng.shuffle(indexes)
        for fraction in sizes:
            part_len = int(fraction * len(data))
            self.partitions.append(indexes[:part_len])
            indexes = indexes[part_len:]
        # END STEP 1

    def use(self, partition: int) -> Partition:
        """Part number ``partition`` of the data (a rank uses its rank)."""
        # BEGIN STEP 1: a Partition of the part's indices
        # TODO: a Partition of self.data holding exactly the indices of that part.
        return Partition(self.data, self.partitions[partition])
        # END STEP 1


def per_rank_batch_size(global_batch_size: int, world_size: int) -> int:
    """Each rank's batch when ``world_size`` ranks share a batch of ``global_batch_size``.

    A whole number (``DataLoader`` takes no fractions): ``per_rank_batch_size(128, 3)`` is 42.
    """
    # BEGIN STEP 2: a whole-number batch per rank
    # TODO: an int, the largest share every rank can take (128 on 3 ranks: 42). When a rank
    # would get no sample, or world_size < 1, raise ValueError saying what is wrong.
    if world_size < 1 or global_batch_size < world_size:
        raise ValueError(
            f"{world_size} ranks cannot share a batch of {global_batch_size}: each rank needs at "
            "least one sample (and world_size must be at least 1)"
        )
    return global_batch_size // world_size
    # END STEP 2


def shard_size(dataset_length: int, num_replicas: int, drop_last: bool = False) -> int:
    """How many indices each rank gets, as DistributedSampler counts them."""
    # BEGIN STEP 3: how many indices each rank gets
    # TODO: exactly len(DistributedSampler(range(dataset_length), num_replicas, 0,
    # drop_last=drop_last)), the lesson's step 2; the tests compare lengths 0 to 13, 31 and 100
    # on 1 to 5 replicas, with and without drop_last.
    if drop_last and dataset_length % num_replicas != 0:
        return math.ceil((dataset_length - num_replicas) / num_replicas)
    return math.ceil(dataset_length / num_replicas)
    # END STEP 3


def shard_indices(
    dataset_length: int,
    num_replicas: int,
    rank: int,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> list[int]:
    """The indices rank ``rank`` of ``num_replicas`` gets, in DistributedSampler's order."""
    # BEGIN STEP 3: the indices of one rank's shard
    # TODO: the very list DistributedSampler(range(dataset_length), num_replicas, rank, shuffle,
    # seed, drop_last) yields after set_epoch(epoch), padding and order included (the lesson's
    # steps 1 to 3). The tests compare every rank on the grid of ShardSampler's tests, and call
    # it twice with the same arguments: the answer must not depend on global random state.
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)  # a new order every epoch, the same on every rank
        order = torch.randperm(dataset_length, generator=generator).tolist()
    else:
        order = list(range(dataset_length))
    total = shard_size(dataset_length, num_replicas, drop_last) * num_replicas
    if drop_last:
        order = order[:total]
    elif order:
        repeats = math.ceil(total / len(order))  # a tiny data set is repeated more than once
        order = (order * repeats)[:total]
    return order[rank:total:num_replicas]
    # END STEP 3


class ShardSampler(Sampler[int]):
    """A sampler that behaves exactly like ``torch.utils.data.DistributedSampler``."""

    def __init__(
        self,
        dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        # BEGIN STEP 4: the sampler's arguments
        # TODO: num_replicas and rank default to the process group's (the training test
        # passes neither); a rank outside 0..num_replicas-1 raises ValueError naming the rank.
        # Keep every argument for __iter__, and start at epoch 0.
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        if rank is None:
            rank = dist.get_rank()
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        # END STEP 4

    def __iter__(self) -> Iterator[int]:
        # BEGIN STEP 4: iterate over this rank's shard
        # TODO: an iterator (DataLoader calls iter(sampler)) over this rank's shard for the
        # current epoch: the same indices, in the same order, as DistributedSampler's, every time.
        return iter(
            shard_indices(
                len(self.dataset),
                self.num_replicas,
                self.rank,
                self.shuffle,
                self.seed,
                self.epoch,
                self.drop_last,
            )
        )
        # END STEP 4

    def __len__(self) -> int:
        # BEGIN STEP 4: the number of indices this rank gets
        # TODO: how many indices __iter__ yields (DataLoader counts batches with it).
        return shard_size(len(self.dataset), self.num_replicas, self.drop_last)
        # END STEP 4

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch: with shuffle, each epoch gets its own order."""
        # BEGIN STEP 4: remember the epoch
        # TODO: from now on __iter__ gives epoch `epoch`'s order.
        self.epoch = epoch
        # END STEP 4


# ------------------------------------------------------------------------- the program


def _shards(
    rank: int, world_size: int, size: int, epochs: int, shuffle: bool, drop_last: bool, seed: int
) -> dict:
    data = list(range(size))  # the indices stand in for samples
    tutorial = DataPartitioner(data, [1.0 / world_size] * world_size).use(rank)
    say(rank, f"the tutorial's partition: {[tutorial[i] for i in range(len(tutorial))]}")
    sampler = ShardSampler(data, shuffle=shuffle, seed=seed, drop_last=drop_last)
    shards = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
        say(rank, f"epoch {epoch}: ShardSampler gives {len(sampler)} indices {shards[-1]}")
    return {"partition": list(tutorial.index), "shards": shards}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="How the tutorial and DistributedSampler shard a data set."
    )
    add_launch_arguments(parser)
    parser.add_argument(
        "--dataset-size", type=int, default=10, help="samples in the data set (default 10)"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    parser.add_argument("--drop-last", action="store_true")
    args = parser.parse_args(argv)
    if args.dataset_size < 0 or args.epochs < 1:
        parser.error("--dataset-size must be at least 0 and --epochs at least 1")
    per_rank = launch_world(
        _shards,
        args.world_size,
        args.dataset_size,
        args.epochs,
        args.shuffle,
        args.drop_last,
        args.seed,
        backend=args.backend,
        device=args.device,
    )
    used = sum(len(r["partition"]) for r in per_rank)
    say(None, f"the tutorial's partitions use {used} of {args.dataset_size} samples, each once")
    for epoch in range(args.epochs):
        shards = [r["shards"][epoch] for r in per_rank]
        torch_shards = [_torch_epoch(args, rank, epoch) for rank in range(args.world_size)]
        taken = [i for shard in shards for i in shard]
        repeated = len(taken) - len(set(taken))
        unused = args.dataset_size - len(set(taken))
        say(
            None,
            f"epoch {epoch}: {len(taken)} indices handed out, {repeated} of them repeated "
            f"(padding), {unused} samples unused (dropped); same as DistributedSampler: "
            f"{'yes' if shards == torch_shards else 'NO'}",
        )
    return 0


def _torch_epoch(args, rank: int, epoch: int) -> list[int]:
    sampler = torch.utils.data.DistributedSampler(
        range(args.dataset_size),
        args.world_size,
        rank,
        args.shuffle,
        args.seed,
        args.drop_last,
    )
    sampler.set_epoch(epoch)
    return list(sampler)


if __name__ == "__main__":
    run_program(main)
