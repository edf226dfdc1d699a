"""k05 · Data-parallel training by hand.

THE IDEA
    Every rank holds a full replica of the model and trains it on its own part of the data.
    After each backward pass the ranks average their gradients (k04), so every replica takes
    the very same step and the replicas stay identical, while each rank only did 1/N of the
    work. One step, on 4 ranks with a global batch of 64:

        rank 0   images  0-15 -> forward, loss, backward -> g0 --+
        rank 1   images 16-31 -> forward, loss, backward -> g1 --+-> all-reduce, / 4 -> mean g
        rank 2   images 32-47 -> forward, loss, backward -> g2 --+   (on every rank)
        rank 3   images 48-63 -> forward, loss, backward -> g3 --+
                 then every rank: optimizer.step() with the same mean g -> same new weights

    The mean of the four mean-losses' gradients is the gradient of the mean loss over all 64
    images: N ranks with averaged gradients compute exactly what one process computes on the
    whole batch (for a model without BatchNorm: see below).

    Two things the tutorial forgot:

    - identical start: replicas that start from different random weights never agree; every
      rank takes rank 0's weights (``dist.broadcast(tensor, src=0)`` of every parameter and
      buffer). The same seed on every rank also works, but only if every rank builds the
      model in exactly the same way: the broadcast is what makes it certain;
    - a shard per rank: the tutorial gives every rank the whole data set, so four ranks do the
      same work four times. Here rank r trains on its own disjoint slice; every rank gets the
      same number of samples (the few left over are dropped), because a rank with one batch
      more would wait for ever in its last all-reduce.

        1438 training digits:  [ rank 0: 359 | rank 1: 359 | rank 2: 359 | rank 3: 359 ] + 2 left

    The BatchNorm caveat: BatchNorm normalises with the statistics of the batch it sees, and
    each rank sees only its own 16 images, so its gradients are not those of one process on all
    64, and its running statistics (buffers, not parameters: no gradient averages them) drift
    apart from the other ranks'. Before evaluating, copy rank 0's buffers to every rank
    (``broadcast_buffers``; DistributedDataParallel broadcasts buffers at every forward), or use
    ``nn.SyncBatchNorm``, which computes the statistics over all ranks.

    Only rank 0 prints progress: N ranks printing the same lines is noise.

STEPS
    1. ``broadcast_buffers``: broadcast every buffer from rank 0 (parameters untouched);
       ``make_replicas_identical``: broadcast every parameter from rank 0, and the buffers.
    2. ``shard_indices``: rank r's disjoint share of ``range(num_samples)``, ``num_samples //
       world_size`` indices each; ``ValueError`` for a rank outside the world or fewer samples
       than ranks.
    3. ``train_step``: forward, cross-entropy loss, zero_grad, backward, ``average_gradients``
       (from your k04), step; return this rank's loss as a float.
    4. ``run_training``: the tutorial's loop. The data, model and optimizer are set up for you;
       make the replicas identical, load this rank's shard (``Subset``, a ``DataLoader`` with
       ``batch_size // world_size`` per rank, ``shuffle=True``, ``drop_last=True``), train
       ``epochs`` epochs with ``train_step``, let rank 0 alone show progress, and after each
       epoch broadcast the buffers and measure held-out accuracy.

WHAT THE TESTS CHECK
    Replicas built differently become rank 0's (parameters and BatchNorm buffers; buffers alone
    with ``broadcast_buffers``); shards are disjoint, equal and cover the data; ``train_step``
    on 4 ranks of 2 images gives the same weights as one process on 8 (no BatchNorm);
    ``run_training`` on 2 ranks for one epoch ends with identical replicas, a falling loss and
    at least 85 % held-out accuracy on the digits; the program prints progress from rank 0 only
    and saves its loss curve.

RUN IT
    .venv/bin/python -m katas.k05_data_parallel --world-size 4 --epochs 3     (saves k05_loss_curve.png)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from dojo import data as datasets
from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.models import ConvNet, accuracy

from .k04_allreduce import average_gradients

MOMENTUM = 0.9


def broadcast_buffers(model: nn.Module) -> None:
    """Give this rank's model rank 0's buffers (BatchNorm's running statistics), nothing else."""
    # BEGIN STEP 1: give every replica rank 0's buffers
    # TODO: afterwards every rank's buffers (model.buffers(): BatchNorm's running statistics)
    # hold rank 0's values, and no parameter has changed. Every rank calls it, rank 0 too. The
    # tests give 3 ranks different buffers, compare them after, and record each rank's calls.
    with torch.no_grad():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    # END STEP 1


def make_replicas_identical(model: nn.Module) -> None:
    """Give this rank's model rank 0's parameters and buffers (every rank must call it)."""
    # BEGIN STEP 1: give every replica rank 0's weights
    # TODO: afterwards every rank's parameters and buffers hold exactly rank 0's values (a copy,
    # not an average; rank 0's own unchanged). Every rank calls it and names the same source. The
    # tests build 3 different replicas, compare them after, and report which source each rank
    # used when the ranks disagree or wait for each other.
    with torch.no_grad():  # a copy of weights, not a step autograd should record
        for param in model.parameters():
            dist.broadcast(param, src=0)
    broadcast_buffers(model)
    # END STEP 1


def shard_indices(num_samples: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s own ``num_samples // world_size`` indices of ``range(num_samples)``."""
    # BEGIN STEP 2: this rank's shard of the data
    # TODO: rank's own share of range(num_samples): num_samples // world_size indices for every
    # rank (the few left over belong to no rank), no index in two shards, and the same answer
    # every time (each rank computes it on its own). A rank outside 0..world_size-1, or fewer
    # samples than ranks, is a ValueError whose message says which number is wrong.
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} (0..{world_size - 1})")
    if num_samples < world_size:
        raise ValueError(f"{num_samples} samples cannot give each of {world_size} ranks a shard")
    per_rank = num_samples // world_size  # equal shards: every rank takes the same number of steps
    return list(range(rank * per_rank, (rank + 1) * per_rank))
    # END STEP 2


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor
) -> float:
    """One data-parallel step on this rank's part of the batch; returns this rank's loss."""
    # BEGIN STEP 3: one data-parallel training step
    # TODO: one step of this rank's replica on its part of the batch, with the mean
    # cross-entropy of these images as the loss; the optimizer must step with the gradient
    # averaged over every rank (your k04), of this batch only (nothing left from earlier steps).
    # Returns this rank's own loss, before the step, as a float. The tests check that 4 ranks
    # with 2 images each end with the weights of one process that stepped on all 8.
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    average_gradients(model)  # every replica now holds the same gradient...
    optimizer.step()  # ...so every replica takes the same step
    return loss.item()
    # END STEP 3


def run_training(
    rank: int,
    world_size: int,
    epochs: int = 1,
    batch_size: int = 64,
    lr: float = 0.01,
    seed: int = 0,
    data: str = "digits",
    data_root: str | None = None,
    download: bool = False,
    log_every: int = 10,
    show_progress: bool = True,
    limit: int | None = None,
) -> dict:
    """Train the ConvNet data-parallel inside an initialised process group (this rank's part).

    ``batch_size`` is the global batch: each rank takes ``batch_size // world_size`` of it
    (rounded down);
    ``limit`` trains on the first ``limit`` training images only (a quick run).
    Returns ``{"losses": [this rank's loss at every step], "epoch_losses": [...],
    "accuracies": [held-out accuracy after each epoch], "accuracy": the last one,
    "shard": [the training indices this rank used], "state_dict": {name: CPU tensor}}``.
    """
    device = rank_device()
    per_rank_batch = _per_rank_batch(batch_size, world_size)
    train_set = datasets.load(data, "train", data_root, download)
    test_set = datasets.load(data, "test", data_root, download)
    if limit is not None:
        train_set = Subset(train_set, range(min(limit, len(train_set))))
    torch.manual_seed(seed)
    model = ConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)

    # BEGIN STEP 4: the training loop
    # TODO: train ``epochs`` epochs data-parallel and return the dict the docstring describes
    # (state_dict as CPU copies). What the tests hold it to, on 2 ranks that build different models:
    #   - every rank starts from rank 0's weights and ends with rank 0's weights and buffers;
    #   - each rank trains, through train_step, on its own shard only (shard_indices), shuffled
    #     (seeded with seed * 1000 + rank), in batches of per_rank_batch images, a last partial
    #     batch dropped (_check_steps says when a shard holds no full batch): one loss per step;
    #   - after each epoch every rank holds rank 0's BatchNorm statistics before it measures the
    #     held-out accuracy (accuracy(model, test_set, device=device)), so all ranks agree;
    #   - only rank 0 shows progress: show_step each step (if show_progress), show_epoch each
    #     epoch with the epoch's mean loss.
    make_replicas_identical(model)
    shard = shard_indices(len(train_set), rank, world_size)
    loader = DataLoader(
        Subset(train_set, shard),
        batch_size=per_rank_batch,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed * 1000 + rank),
    )
    _check_steps(len(loader), len(shard), per_rank_batch)
    losses, epoch_losses, accuracies = [], [], []
    for epoch in range(1, epochs + 1):
        model.train()
        for step, (images, labels) in enumerate(loader, start=1):
            losses.append(train_step(model, optimizer, images.to(device), labels.to(device)))
            if rank == 0 and show_progress:
                show_step(rank, epoch, epochs, step, len(loader), losses[-1], log_every)
        broadcast_buffers(model)  # BatchNorm's running statistics differ per rank
        accuracies.append(accuracy(model, test_set, device=device))
        epoch_losses.append(sum(losses[-len(loader) :]) / len(loader))
        if rank == 0:
            show_epoch(rank, epoch, epochs, epoch_losses[-1], accuracies[-1])
    return {
        "losses": losses,
        "epoch_losses": epoch_losses,
        "accuracies": accuracies,
        "accuracy": accuracies[-1] if accuracies else float("nan"),
        "shard": shard,
        "state_dict": {name: t.detach().cpu().clone() for name, t in model.state_dict().items()},
    }
    # END STEP 4


# --------------------------------------------------------------------------- plumbing


def _per_rank_batch(batch_size: int, world_size: int) -> int:
    """Each rank's part of the global batch (rounded down: 64 over 3 ranks is 21 each)."""
    if batch_size < world_size:
        raise ValueError(
            f"a global batch of {batch_size} cannot give each of {world_size} ranks an image: use "
            f"--batch-size {world_size} or more"
        )
    return batch_size // world_size


def _check_steps(steps: int, shard_size: int, per_rank_batch: int) -> None:
    if steps == 0:
        raise ValueError(
            f"a shard of {shard_size} samples holds no full batch of {per_rank_batch}: use a "
            "smaller batch or fewer ranks"
        )


def show_step(
    rank: int, epoch: int, epochs: int, step: int, steps: int, loss: float, every: int
) -> None:
    """A progress bar: redrawn in place on a terminal, a line every ``every`` steps otherwise."""
    done = round(20 * step / steps)
    bar = "#" * done + "." * (20 - done)
    text = f"epoch {epoch}/{epochs} [{bar}] {step}/{steps} loss {loss:.3f}"
    if sys.stdout.isatty():
        sys.stdout.write(f"\r[rank {rank}] {text}" + ("\n" if step == steps else ""))
        sys.stdout.flush()
    elif step % every == 0 or step == steps:
        say(rank, text)


def show_epoch(rank: int, epoch: int, epochs: int, loss: float, held_out_accuracy: float) -> None:
    say(
        rank,
        f"epoch {epoch}/{epochs}: mean loss {loss:.3f}, held-out accuracy {held_out_accuracy:.1%}",
    )


PLOT_METADATA_KEY = "Description"  # the PNG text chunk that holds what the figure shows, as JSON


def save_loss_curve(results: list[dict], data: str, batch_size: int, path: Path) -> Path:
    """Plot what each rank saw: its own loss at every step (one line per rank, the loss of its
    own shard's batch) above the held-out accuracy after each epoch; save it as a PNG.

    The PNG also carries what it plots, as JSON under the text key ``PLOT_METADATA_KEY``: the
    title and, per panel, each line's label and points (read back from the figure itself).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    world_size = len(results)
    steps = len(results[0]["losses"])
    epochs = max(1, len(results[0]["accuracies"]))
    per_epoch = steps // epochs
    figure, (losses, held_out) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1.4), layout="constrained"
    )
    for rank, result in enumerate(results):
        losses.plot(
            range(1, len(result["losses"]) + 1),
            result["losses"],
            label=f"rank {rank}",
            linewidth=1.2,
            alpha=0.85,
        )
    ends = [per_epoch * epoch for epoch in range(1, epochs + 1)]
    for end in ends[:-1]:
        for axes in (losses, held_out):
            axes.axvline(end + 0.5, color="grey", linestyle=":", linewidth=1)
    for epoch, end in enumerate(ends, start=1):
        losses.annotate(
            f"epoch {epoch}",
            (end - per_epoch / 2 + 0.5, 1),
            xycoords=("data", "axes fraction"),
            xytext=(0, -12),
            textcoords="offset points",
            ha="center",
            color="grey",
            fontsize="small",
        )
    losses.set(
        ylabel="training loss\n(each rank on its own shard)",
        title="each rank's own loss at every step: different batches, one averaged gradient, "
        "identical replicas",
    )
    losses.title.set_fontsize("medium")
    losses.set_ylim(bottom=0)
    losses.legend(loc="center right", fontsize="small")
    accuracies = [100 * a for a in results[0]["accuracies"]]
    held_out.plot(
        ends[: len(accuracies)],
        accuracies,
        marker="o",
        color="black",
        label="held-out accuracy after each epoch (the same on every rank)",
    )
    for end, value in zip(ends, accuracies):
        held_out.annotate(
            f"{value:.1f} %",
            (end, value),
            textcoords="offset points",
            xytext=(-6, 6),
            ha="right",
            fontsize="small",
        )
    held_out.set(xlabel="step", ylabel="held-out accuracy (%)\nafter each epoch")
    held_out.set_ylim(max(0.0, min(accuracies + [80.0]) - 10), 105)
    held_out.set_xlim(0.5, steps + 0.5)
    for axes in (losses, held_out):
        axes.grid(alpha=0.3)
    per_rank = batch_size // world_size
    figure.suptitle(
        f"data-parallel ConvNet on {data}: {world_size} ranks x {per_rank} images per step "
        f"(global batch {per_rank * world_size})"
    )
    plotted = {
        "title": figure.get_suptitle(),
        "panels": [
            {
                "ylabel": axes.get_ylabel(),
                "lines": [
                    {
                        "label": line.get_label(),
                        "x": [float(x) for x in line.get_xdata()],
                        "y": [float(y) for y in line.get_ydata()],
                    }
                    for line in axes.get_lines()
                    if not line.get_label().startswith("_")  # epoch boundaries
                ],
            }
            for axes in figure.axes
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, metadata={PLOT_METADATA_KEY: json.dumps(plotted)})
    plt.close(figure)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="The tutorial's multiprocess_training.py, done right."
    )
    add_launch_arguments(parser)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--batch-size", type=int, default=64, help="the global batch, split over the ranks"
    )
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="steps between progress lines (when not on a terminal)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="train on the first N training images only (a quick run)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("k05_loss_curve.png"),
        help="where to save the loss curve (default: ./k05_loss_curve.png)",
    )
    parser.add_argument("--no-plot", action="store_true")
    datasets.add_data_arguments(parser)
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    try:  # a bad batch split, data path or limit fails here, before any rank starts
        per_rank_batch = _per_rank_batch(args.batch_size, args.world_size)
        train_size = len(datasets.load(args.data, "train", args.data_root, args.download))
        shard_size = min(train_size, args.limit or train_size) // args.world_size
        _check_steps(shard_size // per_rank_batch, shard_size, per_rank_batch)
    except ValueError as error:
        parser.error(str(error))
    say(
        None,
        f"training on {args.data} with {args.world_size} ranks, "
        f"{per_rank_batch} images each per step",
    )
    results = launch_world(
        run_training,
        args.world_size,
        args.epochs,
        args.batch_size,
        args.lr,
        args.seed,
        args.data,
        args.data_root,
        args.download,
        args.log_every,
        True,
        args.limit,
        backend=args.backend,
        device=args.device,
    )
    final = results[0]
    say(
        None,
        f"held-out accuracy {final['accuracy']:.1%} after {args.epochs} epoch{'' if args.epochs == 1 else 's'}",
    )
    if not args.no_plot:
        path = save_loss_curve(results, args.data, args.batch_size, args.plot.resolve())
        say(None, f"loss curve saved to {path}")
    return 0


if __name__ == "__main__":
    run_program(main)
