"""k14 · Against torch's DDP: your buckets beside DistributedDataParallel, and SyncBatchNorm.

THE IDEA
    k13's ``BucketedDDP`` claims to do what ``torch.nn.parallel.DistributedDataParallel`` does.
    Claims are cheap: hold them side by side. The same model (the same seed), the same data on
    each rank, the same optimizer, N steps, once with each wrapper; afterwards both must hold
    the same parameters on every rank.

        rank r:  make_model(name, seed + r) --> BucketedDDP(...) ------------+
                 make_model(name, seed + r) --> DistributedDataParallel(...) +-> train on the
                 rank_batches(..., shard r)  (the same micro-batches for both) |   same batches
                                                                              v
                                    ours' parameters  ==  torch's parameters   (every rank)

    On 2 ranks "the same" means bitwise: each averaged element is a/2 + b/2 in both (halving is
    exact), and fp32 addition of two numbers does not depend on the order. On 3 or more ranks
    gloo may add the terms in different orders (torch lays out its buckets differently: a first
    bucket of at most 1 MiB, then in the order gradients arrived in the first step), so the
    weights agree to a few ulps, not bitwise.

    One loop drives both. Torch's DDP finishes its all-reduces inside ``backward()`` (it queues
    a callback that waits for its buckets), so ``optimizer.step()`` may follow at once; yours
    needs ``finish_gradient_synchronization()`` between the two. Both have ``no_sync()`` for
    gradient accumulation: all micro-batches but the last inside it, the loss divided by their
    number, one synchronisation per step.

    BatchNorm is where data parallelism stops being exact. It normalises with the statistics of
    the batch it sees, and each rank sees only its shard:

        one process, 16 images:   mean over 16 -> normalise -> the whole batch's gradient
        2 ranks, 8 images each:   rank 0: mean over its 8    rank 1: mean over its 8
                                  (other outputs, other gradients, other running statistics)

    ``SyncBatchNorm`` computes the statistics over every rank: each rank sums its values, their
    squares and their count per channel, one all-reduce adds those up, and every rank normalises
    with the mean and variance of the whole batch. The all-reduce sits inside the forward
    pass, so backward must go through it too: a sum over ranks whose backward is a sum over
    ranks of the gradients (``SumOverRanks``), or each rank would miss how its values moved the
    other ranks' outputs. Torch's ``nn.SyncBatchNorm`` runs only on GPUs (torch 2.x refuses
    CPU tensors); yours runs anywhere, and the tests hold it against one process on the whole
    batch, and against torch's where there is a GPU.

        mean = sum_r S_r / sum_r n_r         var = sum_r Q_r / sum_r n_r - mean**2
        (S_r: rank r's sum per channel, Q_r: its sum of squares, n_r: its values per channel)
        running_var takes the unbiased variance, var * n / (n - 1), as BatchNorm's does.

    ``convert_sync_batchnorm`` swaps every ``BatchNorm2d`` of a model for a ``SyncBatchNorm2d``
    that keeps its very parameters and statistics, as ``nn.SyncBatchNorm.convert_sync_batchnorm``
    does: an optimizer made before the conversion still trains the same tensors.

STEPS
    (The side-by-side run uses your k13: ``BucketedDDP`` comes from katas/k13_buckets.py.)
    1. ``torch_ddp``: torch's ``DistributedDataParallel`` around a module on its device, with
       the same bucket cap (None: one bucket) and process group.
    2. ``train``: the loop both wrappers share (micro-batches, ``no_sync``, the finish yours
       needs), returning each step's loss.
    3. ``against_torch_ddp``: the same model, data and seeds through both wrappers; both
       states.
    4. ``SumOverRanks``: an all-reduce that autograd can differentiate (forward and backward).
    5. ``SyncBatchNorm2d.forward``: BatchNorm with the statistics of every rank's batch.
    6. ``convert_sync_batchnorm``: every ``BatchNorm2d`` of a model made a ``SyncBatchNorm2d``.

WHAT THE TESTS CHECK
    ``torch_ddp`` builds the DDP torch would (its module, cap and group; device_ids on CUDA);
    ``train`` with both wrappers on 2 ranks, 1, 2 and 4 micro-batches: each equals one process
    on the whole batch, and BucketedDDP makes one all-reduce per bucket per step (recorded);
    ``against_torch_ddp`` on 2 ranks gives bitwise equal parameters on every rank for the
    frozen, tied and buffer models (3 ranks and a subgroup: within a few ulps);
    ``SumOverRanks`` forward and backward on 3 ranks and a subgroup; ``SyncBatchNorm2d`` on 2
    and 3 ranks with batches of different sizes: outputs, input gradients, parameter gradients
    and running statistics equal one ``BatchNorm2d`` on the whole batch, no communication in
    eval; ``convert_sync_batchnorm`` against torch's own on the ConvNet, and the converted
    ConvNet under torch's DDP trains like one process on the whole batch, where plain BatchNorm
    does not; on GPUs, torch's own ``nn.SyncBatchNorm`` and NCCL too; the program.

RUN IT
    .venv/bin/python -m katas.k14_against_ddp --world-size 2 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.models import ConvNet
from dojo.todo import KataTodo
from dojo.toy_models import loss, make_batch, make_model

from .k13_buckets import BucketedDDP

MIB = 1 << 20  # bytes in a MiB (bucket_cap_mb counts these)
MOMENTUM = 0.9  # both optimizers: SGD(lr, momentum=MOMENTUM)
PER_RANK = 4  # samples per rank in each micro-batch


def torch_ddp(
    module: nn.Module,
    bucket_cap_mb: float | None = 25.0,
    process_group: dist.ProcessGroup | None = None,
) -> DistributedDataParallel:
    """Torch's DDP around ``module``, on the module's device, with BucketedDDP's arguments.

    ``bucket_cap_mb=None`` means one bucket for every gradient, as in BucketedDDP.
    """
    # TODO: torch's DistributedDataParallel around module itself, on the module's own device (a CUDA
    # module's DDP names its GPU; a CPU module's names none), with the same bucket cap as
    # BucketedDDP's (in MiB; None: one bucket for every gradient, however large the model) and the
    # same process group. The tests build it for three toy models and a 27 MB one at caps of 25,
    # 0.5, 1e-6 MiB and None, read its bucket_bytes_cap, device_ids and process_group, and wrap a
    # subgroup [1, 2] of 3 ranks.
    raise KataTodo("k14", 1, "torch's DDP, wrapped as BucketedDDP is")


def train(
    wrapper: nn.Module, optimizer: torch.optim.Optimizer, steps: list[list[tuple]]
) -> list[float]:
    """Train ``wrapper`` (BucketedDDP or torch's DDP): ``steps[i]`` is step i's micro-batches.

    Each step accumulates the micro-batches' gradients (all but the last inside
    ``wrapper.no_sync()``), with the loss divided by their number, then synchronises once and
    steps. Returns each step's loss on this rank (the mean over its micro-batches) as a float.
    """
    # TODO: for each step of steps (a list of micro-batches): the gradient of the mean loss over the
    # step's micro-batches (toy_models.loss), synchronised over the ranks exactly once, then one
    # optimizer step; nothing left from earlier steps. It must work for BucketedDDP and for torch's
    # DDP alike (they differ in how the synchronisation ends). Returns each step's loss on this rank
    # (the mean over its micro-batches) as a float; a step without micro-batches is a ValueError.
    # The tests train the tied model on 2 ranks with 1, 2 and 4 micro-batches per step, compare both
    # wrappers with one process on the whole batch and with each other (bitwise), and count
    # BucketedDDP's all-reduces.
    raise KataTodo("k14", 2, "one training loop for both wrappers")


def against_torch_ddp(
    model_name: str,
    steps: int = 3,
    micro_batches: int = 1,
    bucket_cap_mb: float | None = 25.0,
    lr: float = 0.1,
    seed: int = 0,
    process_group: dist.ProcessGroup | None = None,
) -> dict:
    """Train the toy model ``model_name`` with BucketedDDP and with torch's DDP, side by side.

    On this rank (``dist.get_rank()`` in the world, ``shard`` = its rank in the group) both
    models are ``make_model(model_name, seed + rank)`` on ``rank_device()``, both train on
    ``rank_batches(model_name, steps, micro_batches, seed, shard)`` with
    ``SGD(lr, momentum=MOMENTUM)``. Returns ``{"ours": state, "torch": state, "ours_losses":
    [...], "torch_losses": [...]}``, each state a ``{name: CPU tensor}`` of the wrapped model's
    ``state_dict()``.
    """
    # TODO: the docstring's comparison: two models, one per wrapper, both as the docstring says; the
    # same data for both; the same optimizer settings; train with your train(); return both models'
    # states (state_of) and losses. The tests compare the two states on every rank (bitwise on 2
    # ranks, within a few ulps on 3) and each with one process on the whole batch, for the frozen,
    # tied and buffer models, and in a subgroup [1, 2] of 3 ranks.
    raise KataTodo("k14", 3, "the same model, data and seeds through both")


class SumOverRanks(torch.autograd.Function):
    """``SumOverRanks.apply(x, group)``: the sum of ``x`` over the group's ranks, on every rank.

    Autograd can differentiate it: the gradient reaching ``x`` on each rank is the sum over the
    ranks of the gradients of their outputs.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        # TODO: returns the sum of tensor over the ranks of group (None: the world), on every rank,
        # leaving tensor itself as it was; keeps what backward needs in ctx. The tests give 3 ranks
        # different vectors (and a subgroup [1, 2]) and check the sum, the input and the calls made.
        raise KataTodo("k14", 4, "an all-reduce autograd can differentiate")

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # TODO: the gradients for forward's two arguments (tensor, group): for tensor, how the loss
        # of every rank changes with this rank's tensor. The tests give each rank's output its own
        # gradient and check what reaches each rank's input.
        raise KataTodo("k14", 4, "an all-reduce autograd can differentiate")


class SyncBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of every rank's batch together.

    ``process_group`` (None: the world) says which ranks share statistics. In eval mode it is
    BatchNorm2d: the running statistics, no communication.
    """

    def __init__(self, *args, process_group: dist.ProcessGroup | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO: in training, BatchNorm2d's output, running statistics and num_batches_tracked as one
        # BatchNorm2d would have them on every rank's images together (group: self.process_group),
        # with gradients that flow back to every rank's input as they would there; in eval,
        # BatchNorm2d itself, without any communication. The tests run 2 and 3 ranks holding 2, 3
        # and 4 images (batches of different sizes) for two passes and compare outputs, input
        # gradients, the ranks' weight and bias gradients added up, and the running statistics with
        # one BatchNorm2d.
        raise KataTodo("k14", 5, "SyncBatchNorm2d: the whole batch's statistics")


def convert_sync_batchnorm(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Every ``nn.BatchNorm2d`` in ``module`` (at any depth) replaced by a ``SyncBatchNorm2d``
    holding the same parameters, running statistics and mode; returns the module (or the new
    layer, when ``module`` itself is a BatchNorm2d)."""
    # TODO: module with every nn.BatchNorm2d in it, at any depth, replaced by a SyncBatchNorm2d on
    # process_group that keeps the layer's settings, its mode and its very tensors (parameters and
    # running statistics, not copies); a BatchNorm2d passed itself comes back converted. The tests
    # hold it against nn.SyncBatchNorm.convert_sync_batchnorm on the ConvNet, then train the
    # converted ConvNet under torch's DDP on 2 ranks against one process on the whole batch.
    raise KataTodo("k14", 6, "convert_sync_batchnorm: every BatchNorm2d of a model")


# --------------------------------------------------------------------------- plumbing


def rank_batches(
    model_name: str, steps: int, micro_batches: int, seed: int, shard: int, device=None
) -> list[list[tuple]]:
    """Shard ``shard``'s micro-batches: ``[step][micro-batch] -> (inputs, targets)``, PER_RANK
    samples each; one process that concatenates every shard's has the whole batch."""
    return [
        [
            tuple(
                t.to(device) if device is not None else t
                for t in make_batch(
                    model_name, PER_RANK, seed * 1_000_000 + 10_000 * step + 100 * micro + shard
                )
            )
            for micro in range(micro_batches)
        ]
        for step in range(steps)
    ]


def state_of(model: nn.Module) -> dict:
    return {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}


def show_rank(rank: int, world_size: int, steps: int, per_rank: int, seed: int) -> dict:
    """What the program runs on each rank: every toy model through both wrappers (the largest
    difference each), then one ConvNet step on this rank's digits with BatchNorm2d and with
    SyncBatchNorm2d (layer1's running mean after each)."""
    differences = {}
    for name, (cap, micro) in PROGRAM_CASES.items():
        result = against_torch_ddp(name, steps, micro, cap, seed=seed)
        differences[name] = max(
            (result["ours"][k].double() - result["torch"][k].double()).abs().max().item()
            for k in result["ours"]
        )
    means = {
        sync: _batchnorm_step(rank, world_size, per_rank, sync, seed) for sync in (False, True)
    }
    return {"differences": differences, "means": means}


PROGRAM_CASES = {"frozen": (25.0, 1), "tied": (1e-6, 2), "buffer": (None, 1)}  # cap, micro-batches


def _batchnorm_step(rank: int, world_size: int, per_rank: int, sync: bool, seed: int):
    from dojo import data

    device = rank_device()
    images, labels = _digits(data, per_rank * world_size)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    torch.manual_seed(seed)
    model = ConvNet().to(device)
    if sync:
        model = convert_sync_batchnorm(model)
    ddp = DistributedDataParallel(model)  # it broadcasts rank 0's buffers before each forward
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    optimizer.zero_grad()
    F.cross_entropy(ddp(images[mine].to(device)), labels[mine].to(device)).backward()
    optimizer.step()
    return model.layer1[1].running_mean.detach().cpu().clone()


def _digits(data, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    train_set = data.load("digits", "train")
    pairs = [train_set[i] for i in range(count)]
    return torch.stack([p[0] for p in pairs]), torch.tensor([int(p[1]) for p in pairs])


def _one_process_statistics(per_rank: int, world_size: int, seed: int) -> torch.Tensor:
    from dojo import data

    images, labels = _digits(data, per_rank * world_size)
    torch.manual_seed(seed)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    return model.layer1[1].running_mean.detach().clone()


def _show(values: torch.Tensor) -> str:
    return "  ".join(f"{v:+.4f}" for v in values[:4].tolist())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="BucketedDDP against torch's DistributedDataParallel; SyncBatchNorm."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--images", type=int, default=8, help="digits per rank in the BatchNorm step (default 8)"
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.images < 2:
        parser.error("--images must be at least 2 (BatchNorm needs a variance)")
    say(
        None,
        f"BucketedDDP (your k13) against torch's DistributedDataParallel: {args.world_size} "
        f"ranks, {args.steps} steps, the same models, seeds and data",
    )
    results = launch_world(
        show_rank,
        args.world_size,
        args.steps,
        args.images,
        args.seed,
        backend=args.backend,
        device=args.device,
    )
    for name, (cap, micro) in PROGRAM_CASES.items():
        largest = max(result["differences"][name] for result in results)
        verdict = "bitwise equal" if largest == 0 else f"largest difference {largest:.3g}"
        cap_text = "None" if cap is None else f"{cap:g} MiB"
        say(None, f"  {name:<7} cap {cap_text}, {micro} micro-batch(es): {verdict} on every rank")
    say(
        None,
        f"BatchNorm: one step of the ConvNet under torch's DDP, {args.images} digits per rank; "
        "layer1's running mean (first 4 channels) afterwards:",
    )
    whole = _one_process_statistics(args.images, args.world_size, args.seed)
    label = f"one process, all {args.images * args.world_size} digits:"
    say(None, f"  {label:<30}{_show(whole)}")
    for sync in (False, True):
        kind = "SyncBatchNorm2d" if sync else "BatchNorm2d"
        for rank, result in enumerate(results):
            label = f"rank {rank}, {kind}:"
            say(None, f"  {label:<30}{_show(result['means'][sync])}")
        largest = max(
            (r["means"][sync].double() - whole.double()).abs().max().item() for r in results
        )
        say(None, f"  {kind}: largest difference from one process {largest:.2g}")
    return 0


if __name__ == "__main__":
    run_program(main)
