"""Benchmark: data-parallel step time, your DDPs (k04, k12, k13) against torch's, on one world.

    python -m benchmarks.ddp                       # katas/ (yours): 2 and 4 ranks, gloo on CPU
    python -m benchmarks.ddp --impl solutions      # the reference implementations
    python -m benchmarks.ddp --world-sizes 2 --steps 50 --cap-mb 1

The same model (an MLP of about 6 MiB in 24 tensors: a few MB, many tensors, as a real model
has) and the same data, four ways, on the same world: no overlap (k04's ``average_gradients``
after backward: one blocking all-reduce per tensor), k12's ``OverlappingDDP`` (one async
all-reduce per tensor, launched from its hook), k13's ``BucketedDDP`` (one async all-reduce per
bucket) and torch's ``DistributedDataParallel``, both with a bucket cap of ``--cap-mb`` (25 MiB
by default, torch's own default). A step is zero_grad, forward, loss, backward, the
synchronisation and ``optimizer.step()``; its time is the slowest rank's, between two
barriers. The four ways take turns step by step, so a busy machine slows them alike; the table
shows the median step time and ``torch's DDP time / this time`` (the throughput relative to
torch's DDP: above 1 is faster). Every way must end with the same weights as torch's DDP (to a
few ulps): a way that does not is marked WRONG and the run fails.
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._timing import timed
from dojo.console import run_program, say
from dojo.devices import BACKENDS, DEVICES, choose_for_this_machine, rank_device
from dojo.harness import impl
from dojo.launch import launch_world

WAYS = ("no overlap (k04)", "per-parameter (k12)", "bucketed (k13)", "torch DDP")
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # 4 ranks may add in different orders (see k14)


class Model(nn.Module):
    """``depth`` square linear layers of ``width`` and a head: 2 * depth + 2 tensors."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def describe(width: int, depth: int) -> str:
    model = Model(width, depth)
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return f"an MLP of {nbytes / 2**20:.1f} MiB in {len(params)} tensors"


class _NoOverlap(nn.Module):
    """k04's way: after backward, all-reduce each gradient, blocking, and divide."""

    def __init__(self, module: nn.Module, average_gradients):
        super().__init__()
        self.module = module
        self.average_gradients = average_gradients
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self) -> None:
        self.average_gradients(self.module)


def _wrappers(impl_name: str, width: int, depth: int, cap_mb: float, seed: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    k04 = importlib.import_module(f"{impl_name}.k04_allreduce")
    k12 = importlib.import_module(f"{impl_name}.k12_ddp_overlap")
    k13 = importlib.import_module(f"{impl_name}.k13_buckets")
    device = rank_device()

    def model():
        torch.manual_seed(seed + dist.get_rank())  # every way broadcasts the first rank's
        return Model(width, depth).to(device)

    cuda = device.type == "cuda"
    return {
        WAYS[0]: _NoOverlap(model(), k04.average_gradients),
        WAYS[1]: k12.OverlappingDDP(model()),
        WAYS[2]: k13.BucketedDDP(model(), bucket_cap_mb=cap_mb),
        WAYS[3]: DistributedDataParallel(
            model(), device_ids=[device.index] if cuda else None, bucket_cap_mb=cap_mb
        ),
    }


def _step(wrapper: nn.Module, optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    from torch.nn.parallel import DistributedDataParallel

    optimizer.zero_grad()
    nn.functional.cross_entropy(wrapper(inputs), targets).backward()
    if not isinstance(wrapper, DistributedDataParallel):  # torch's finishes in backward
        wrapper.finish_gradient_synchronization()
    optimizer.step()


def _bench_rank(
    rank: int,
    world_size: int,
    impl_name: str,
    width: int,
    depth: int,
    batch: int,
    cap_mb: float,
    steps: int,
    warmup: int,
    seed: int,
) -> dict:

    device = rank_device()
    wrappers = _wrappers(impl_name, width, depth, cap_mb, seed)
    optimizers = {
        name: torch.optim.SGD(w.parameters(), lr=0.01, momentum=0.9) for name, w in wrappers.items()
    }
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    times = {name: [] for name in wrappers}
    for step in range(warmup + steps):
        inputs = torch.randn(batch, width, generator=generator).to(device)
        targets = torch.randint(0, 10, (batch,), generator=generator).to(device)
        for name, wrapper in wrappers.items():  # take turns: noise hits every way alike
            elapsed = timed(_step, wrapper, optimizers[name], inputs, targets)
            if step >= warmup:
                times[name].append(elapsed)
    reference = wrappers[WAYS[3]].module.state_dict()
    correct = {
        name: all(
            torch.allclose(tensor, reference[key], **TOLERANCE)
            for key, tensor in wrapper.module.state_dict().items()
        )
        for name, wrapper in wrappers.items()
    }
    return {"median": {n: statistics.median(t) for n, t in times.items()}, "correct": correct}


def _header() -> str:
    return f"{'ranks':>5} | " + " | ".join(f"{way:>20}" for way in WAYS)


def _format_row(world_size: int, row: dict) -> str:
    torch_time = row["median"][WAYS[3]]
    cells = []
    for way in WAYS:
        seconds = row["median"][way]
        cell = f"{seconds * 1e3:7.2f} ms {torch_time / seconds:5.2f}x"
        cells.append(f"{cell:>20}" if row["correct"][way] else f"{cell + ' WRONG':>20}")
    return f"{world_size:>5} | " + " | ".join(cells)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None, help="default: gloo (with --device: as k04)"
    )
    parser.add_argument("--device", choices=DEVICES, default=None, help="default: cpu")
    parser.add_argument(
        "--impl",
        choices=impl.PACKAGES,
        default=impl.current(),
        help="whose k04, k12 and k13: katas (yours) or solutions (default: $DOJO_IMPL, else katas)",
    )
    parser.add_argument(
        "--world-sizes",
        default="2,4",
        help="comma-separated world sizes, one run each (default 2,4)",
    )
    parser.add_argument("--width", type=int, default=384, help="the MLP's width (default 384)")
    parser.add_argument("--depth", type=int, default=11, help="its square layers (default 11)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank (default 32)")
    parser.add_argument(
        "--cap-mb", type=float, default=25.0, help="bucket cap of k13 and torch (default 25)"
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per way (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        world_sizes = [int(n) for n in args.world_sizes.split(",")]
    except ValueError:
        parser.error(f"--world-sizes: {args.world_sizes!r} is not a list like 2,4")
    if any(n < 1 for n in world_sizes):
        parser.error("--world-sizes: every world needs at least one rank")
    for name, value, least in (
        ("--width", args.width, 1),
        ("--depth", args.depth, 1),
        ("--batch", args.batch, 1),
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
    ):
        if value < least:
            parser.error(f"{name} must be at least {least}")
    if not args.cap_mb > 0:
        parser.error("--cap-mb must be positive")
    say(
        None,
        f"one data-parallel step of {describe(args.width, args.depth)}, {args.batch} samples per "
        f"rank, bucket cap {args.cap_mb:g} MiB: k04, k12 and k13 from {args.impl}/ against "
        f"torch's DistributedDataParallel; median of {args.steps} steps (x: torch's time / this "
        "time)",
    )
    header_shown = False
    wrong = []
    for world_size in world_sizes:
        if args.backend is None and args.device is None:
            backend, device = "gloo", "cpu"  # the comparison the katas are about, GPUs or not
        else:
            backend, device = choose_for_this_machine(world_size, args.backend, args.device)
        if not header_shown:
            say(None, f"{backend} on {device}")
            say(None, _header())
            header_shown = True
        row = launch_world(
            _bench_rank,
            world_size,
            args.impl,
            args.width,
            args.depth,
            args.batch,
            args.cap_mb,
            args.steps,
            args.warmup,
            args.seed,
            backend=backend,
            device=device,
        )[0]
        say(None, _format_row(world_size, row))
        wrong += [f"{way} on {world_size} ranks" for way in WAYS if not row["correct"][way]]
    if wrong:
        say(
            None, f"weights differ from torch's DDP: {', '.join(wrong)} (see k04, k12, k13's tests)"
        )
        return 1
    return 0


if __name__ == "__main__":
    run_program(main)
