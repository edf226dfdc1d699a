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


def test_memory_formulas_are_the_zero_papers():
    from benchmarks.memory import WAYS, formulas

    got = formulas(1000, 4)
    assert got[WAYS[0]] == (4000, 4000, 8000)  # DDP: 16 bytes per parameter
    assert got[WAYS[1]] == (4000, 4000, 2000)  # ZeRO-1: 4 + 4 + 8/N
    assert got[WAYS[2]] == (1000, 1000, 2000)  # ZeRO-3: 16/N


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~5 s on 2 cores
def test_memory_benchmark_measures_what_the_formulas_say():
    """`python -m benchmarks.memory` (what `dojo bench memory` runs), on a small model."""
    result = run_program(
        "benchmarks.memory", "--ranks", "2", "--blocks", "2", "--dim", "64", timeout=120
    )
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"the benchmark failed (exit {result.returncode}):\n{out}\n{err}"
    rows = [line for line in out.splitlines() if line.startswith("[main]     2 |")]
    assert len(rows) == 3, f"expected three 2-rank rows (DDP, ZeRO-1, ZeRO-3) in:\n{out}"
    for row in rows:
        ratio = float(row.rsplit("|", 1)[1])
        assert 1.0 <= ratio < 1.05, f"measured / formula should be about 1:\n{row}"
