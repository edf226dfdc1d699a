"""The benchmarks run as `dojo bench NAME` runs them, cut down to seconds."""

from __future__ import annotations

import pytest

from dojo import impl
from dojo.testing import run_program


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~5 s on 2 cores
def test_benchmark_runs_on_your_ring():
    """`python -m benchmarks.allreduce` (what `dojo bench allreduce` runs), cut down to one size."""
    result = run_program(
        "benchmarks.allreduce",
        "--impl",
        impl.current(),
        "--world-size",
        "2",
        "--sizes",
        "1M",
        "--repeat",
        "1",
        timeout=90,
    )
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"the benchmark failed (exit {result.returncode}):\n{out}\n{err}"
    rows = [line for line in out.splitlines() if line.startswith("[main]     1 MB |")]
    assert len(rows) == 1 and "WRONG" not in rows[0], f"expected one correct 1 MB row in:\n{out}"


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~6 s on 2 cores
def test_ddp_benchmark_runs_on_your_ddps():
    """`python -m benchmarks.ddp` (what `dojo bench ddp` runs), cut down to a small model."""
    result = run_program(
        "benchmarks.ddp",
        "--impl",
        impl.current(),
        "--world-sizes",
        "2",
        "--width",
        "32",
        "--depth",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        timeout=120,
    )
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"the benchmark failed (exit {result.returncode}):\n{out}\n{err}"
    rows = [line for line in out.splitlines() if line.startswith("[main]     2 |")]
    assert len(rows) == 1 and "WRONG" not in rows[0], f"expected one correct 2-rank row in:\n{out}"
    assert rows[0].count(" ms ") == 4 and rows[0].rstrip().endswith("1.00x"), rows[0]
