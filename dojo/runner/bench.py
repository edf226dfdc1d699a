"""``dojo bench NAME``: run ``benchmarks/NAME.py`` as its own program (``python -m benchmarks.NAME``).

A separate process, exactly as its docstring says to run it: its ranks, Ctrl-C handling and exit
status are its own.
"""

from __future__ import annotations

import os
import sys

from dojo import curriculum
from dojo.commands import dojo
from dojo.harness import impl
from dojo.runner.term import foreground

KNOWN = {
    "allreduce": "your ring all-reduce (k09) against gloo's dist.all_reduce",
    "collectives": "time, algorithm and bus bandwidth of the collectives over a sweep of sizes (nccl-tests' way)",
    "ddp": "a data-parallel step: your k04, k12 and k13 against torch's DistributedDataParallel",
    "harness": "what a test world costs: the rank harness's start-up and per-world times",
    "memory": "bytes per rank of parameters, gradients and optimizer state: DDP, ZeRO-1 (k18), FSDP (k19); and the full parameters ZeRO-3 gathers at once (one unit, prefetch, kept)",
    "parallel": "a training step of each Part IV kata's reference against torch's own, on the same world",
}


def available() -> list[str]:
    found = {
        p.stem for p in (curriculum.ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")
    }
    return sorted(found | set(KNOWN))


def bench(name: str, args: list[str], solutions: bool = False) -> int:
    """``solutions``: the benchmarks that time a kata time the reference (they read DOJO_IMPL)."""
    path = curriculum.ROOT / "benchmarks" / f"{name}.py"
    if not path.exists():
        what = f" ({KNOWN[name]})" if name in KNOWN else ""
        present = sorted(p.stem for p in path.parent.glob("*.py") if not p.stem.startswith("_"))
        print(
            f"dojo: benchmarks/{name}.py{what} is not in this checkout, so `{dojo()} bench {name}` cannot run. "
            f"Benchmarks here: {', '.join(present) or 'none'}.",
            file=sys.stderr,
        )
        return 2
    if solutions:
        os.environ[impl.ENV_VAR] = "solutions"  # the benchmark and its ranks inherit it
    return foreground([sys.executable, "-m", f"benchmarks.{name}", *args], curriculum.ROOT)
