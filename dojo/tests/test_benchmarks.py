"""The benchmarks run as `dojo bench NAME` runs them, cut down to seconds."""

from __future__ import annotations

import re

import pytest

from dojo.harness import impl
from dojo.spec.testing import run_module


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~5 s on 2 cores
def test_benchmark_runs_on_your_ring():
    """`python -m benchmarks.allreduce` (what `dojo bench allreduce` runs), cut down to one size."""
    result = run_module(
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
    result = run_module(
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


@pytest.mark.slow  # a world, fresh ranks, then processes that each import torch: ~15 s on 2 cores
def test_harness_benchmark_says_what_it_times_as_it_goes():
    """`python -m benchmarks.harness` (`dojo bench harness`), cut down to 2 ranks, once each way:
    a line as each way starts and ends (the whole thing takes about a minute), then the table."""
    result = run_module("benchmarks.harness", "--world-size", "2", "--repeat", "1", timeout=150)
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"the benchmark failed (exit {result.returncode}):\n{out}\n{err}"
    started = re.findall(r"^  \S.* \.\.\.$", out, re.M)
    ended = re.findall(r"^    \d+\.\d{3} s$", out, re.M)
    assert len(started) == len(ended) == 4, (
        f"expected a line as each of 4 ways starts and ends:\n{out}"
    )
    assert out.index(started[-1]) < out.index("torch.multiprocessing.spawn "), out


def test_memory_formulas_are_the_zero_papers():
    from benchmarks.memory import WAYS, formulas

    got = formulas(1000, 4)
    assert got[WAYS[0]] == (4000, 4000, 8000)  # DDP: 16 bytes per parameter
    assert got[WAYS[1]] == (4000, 4000, 2000)  # ZeRO-1: 4 + 4 + 8/N
    assert got[WAYS[2]] == (1000, 1000, 2000)  # ZeRO-3: 16/N


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~5 s on 2 cores
def test_memory_benchmark_measures_what_the_formulas_say():
    """`python -m benchmarks.memory` (what `dojo bench memory` runs), on a small model."""
    result = run_module(
        "benchmarks.memory", "--ranks", "2", "--blocks", "2", "--dim", "64", timeout=120
    )
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"the benchmark failed (exit {result.returncode}):\n{out}\n{err}"
    from benchmarks.memory import GATHERED, WAYS

    rows = [line for line in out.splitlines() if line.startswith("[main]     2 |")]
    held = [row for row in rows if any(f"| {way} " in row for way in WAYS)]
    assert len(held) == 3, f"expected three 2-rank rows (DDP, ZeRO-1, ZeRO-3) in:\n{out}"
    for row in held:
        ratio = float(row.rsplit("|", 1)[1])
        assert 1.0 <= ratio < 1.05, f"measured / formula should be about 1:\n{row}"
    gathered = [row for row in rows if any(f"| {way} " in row for way in GATHERED)]
    assert len(gathered) == 3, f"expected three 2-rank rows of gathered parameters in:\n{out}"
    for row in gathered:  # measured | should be: one unit, two, every one
        measured, expected = (
            float(cell.split()[0].replace(",", "")) for cell in row.split("|")[2:4]
        )
        assert expected <= measured <= 1.05 * expected, (
            f"measured should be what it should be:\n{row}"
        )
    if impl.current() == "solutions":  # k25: the activations a block keeps, each its formula
        saved = [row for row in rows if "sequence parallel (k25)" in row or "k20's layout" in row]
        assert len(saved) == 2, f"expected k20's and k25's 2-rank activation rows in:\n{out}"
        for row in saved:
            assert row.rsplit("|", 1)[1].strip() == "1.000", f"measured = formula:\n{row}"
        from benchmarks.memory import CHECKPOINTING  # k32: what a block keeps, each way

        kept = [
            line for line in out.splitlines() if any(f"| {way} " in line for way in CHECKPOINTING)
        ]
        assert len(kept) == len(CHECKPOINTING), (
            f"expected k32's {len(CHECKPOINTING)} rows in:\n{out}"
        )
        for row in kept:
            assert row.rsplit("|", 1)[1].strip() in ("1.000", ""), f"measured = formula:\n{row}"


def test_collectives_bus_factors_are_nccl_tests():
    """busbw = algbw x factor, the factors of nccl-tests' doc/PERFORMANCE.md."""
    from benchmarks.collectives import OPERATIONS, bus_factor

    for n in (1, 2, 4, 8):
        expected = {
            "all_reduce": 2 * (n - 1) / n,
            "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0,
            "all_to_all": (n - 1) / n,
        }
        got = {op: bus_factor(op, n) for op in OPERATIONS}
        assert got == expected, f"{n} ranks: got {got}, nccl-tests say {expected}"
    assert bus_factor("all_reduce", 4) == 1.5
    with pytest.raises(ValueError, match="unknown operation 'reduce'"):
        bus_factor("reduce", 4)
    with pytest.raises(ValueError, match="at least one rank"):
        bus_factor("all_reduce", 0)


def test_collectives_sweep_is_nccl_tests_begin_end_factor():
    from benchmarks.collectives import elements, sweep

    assert sweep(1024, 64 << 20, 4) == [1024 << (2 * k) for k in range(9)]
    assert sweep(4096, 4096, 2) == [4096]
    assert sweep(1024, 5000, 2) == [1024, 2048, 4096]
    assert elements(1024, 4) == 256 and elements(1024, 3) == 255  # splits into n equal pieces
    with pytest.raises(ValueError, match="factor of at least 2"):
        sweep(1024, 4096, 1)


def _held(rank: int, count: int):
    """Rank ``rank``'s whole array in benchmarks.collectives: (7 i + 13 rank) mod 61."""
    import torch

    return ((torch.arange(count) * 7 + rank * 13) % 61).float()


def _by_hand(operation: str, rank: int, n: int, count: int):
    """What ``operation`` gives ``rank``, worked out from the collective's definition, not from
    the benchmark's own check."""
    import torch

    piece = slice(rank * (count // n), (rank + 1) * (count // n))
    if operation == "all_reduce":
        return sum(_held(r, count) for r in range(n))
    if operation == "broadcast":
        return _held(0, count)
    if operation == "reduce_scatter":
        return sum(_held(r, count) for r in range(n))[piece]
    if operation == "all_gather":  # rank r gives its own piece r
        return torch.cat([_by_hand("all_gather_input", r, n, count) for r in range(n)])
    if operation == "all_gather_input":
        return _held(rank, count)[piece]
    return torch.cat([_held(r, count)[piece] for r in range(n)])  # all_to_all: piece `rank` of each


@pytest.mark.parametrize(
    "operation", ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]
)
def test_collectives_check_fails_a_wrong_result(operation):
    """A wrong backend result is a failure, not a number: the check names the rank and element."""
    import torch

    from benchmarks.collectives import check, inputs

    n, count, rank = 3, 3 * 70, 1  # pieces longer than the inputs' period of 61
    given = inputs(operation, rank, count, n, "cpu")
    own = _by_hand("all_gather_input", rank, n, count) if operation == "all_gather" else None
    assert torch.equal(given, _held(rank, count) if own is None else own), operation
    right = _by_hand(operation, rank, n, count)
    assert check(operation, right.clone(), rank, n, count) is None, f"{operation}: right, refused"
    wrong = right.clone()
    wrong[-1] += 1
    message = check(operation, wrong, rank, n, count)
    assert message is not None and message.startswith(f"rank 1's {operation} result is wrong"), (
        message
    )
    assert f"element {len(right) - 1} is {right[-1].item() + 1:g}, expected" in message, message


def test_collectives_arguments_are_checked(capsys):
    from benchmarks.collectives import main

    for argv, says in (
        (["--factor", "1"], "--factor must be at least 2"),
        (["--min-bytes", "4K", "--max-bytes", "1K"], "--max-bytes must be at least --min-bytes"),
        (["--min-bytes", "3"], "a positive multiple of 4 bytes"),
        (["--world-sizes", "2,x"], "is not a list like 2,4"),
        (["--plot", "out.jpg"], "should name a .png file"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv
        assert says in capsys.readouterr().err, argv


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~7 s on 2 cores
def test_collectives_benchmark_makes_its_table_and_plot(tmp_path):
    """`python -m benchmarks.collectives` (what `dojo bench collectives` runs), one small size."""
    from dojo.curriculum import ROOT  # where run_module runs it

    plot = tmp_path / "collectives.png"
    result = run_module(
        "benchmarks.collectives",
        "--world-sizes",
        "2",
        "--min-bytes",
        "4K",
        "--max-bytes",
        "4K",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--copy-bytes",
        "1M",
        "--plot",
        str(plot),
        timeout=120,
    )
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"the benchmark failed (exit {result.returncode}):\n{out}\n{err}"
    lines = out.splitlines()
    header = [line for line in lines if line.startswith("[main]     size |")]
    assert len(header) == 1 and header[0].split("|")[1].strip() == "all_reduce", out
    rows = [line for line in lines if line.startswith("[main]     4 KB |")]
    assert len(rows) == 1 and "WRONG" not in rows[0] and "not run" not in rows[0], out
    cells = rows[0].split("|")[1:]
    assert len(cells) == 5 and all(len(c.split()) == 3 for c in cells), rows[0]
    for cell in cells:
        time_us, algbw, busbw = (float(v) for v in cell.split())
        assert time_us > 0 and algbw > 0, rows[0]
    assert any(line.startswith("[main] memory copy (one CPU thread): 1 MB in") for line in lines)
    assert any(line.startswith("[main] best busbw / memory copy: all_reduce ") for line in lines)
    shown = [
        line.removeprefix("[main] plot: ") for line in lines if line.startswith("[main] plot: ")
    ]
    assert len(shown) == 1 and (ROOT / shown[0]).resolve() == plot.resolve(), out  # ran in ROOT
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{plot} is not a PNG"


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~8 s on 2 cores
def test_parallel_benchmark_holds_each_kata_against_torch():
    """`python -m benchmarks.parallel` (what `dojo bench parallel` runs), one step of each row."""
    result = run_module(
        "benchmarks.parallel",
        "--impl",
        impl.current(),
        "--steps",
        "1",
        "--warmup",
        "0",
        "--dim",
        "32",
        timeout=120,
    )
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"the benchmark failed (exit {result.returncode}):\n{out}\n{err}"
    rows = [line for line in out.splitlines() if " vs " in line]
    from benchmarks.parallel import COMPARISONS  # every row, however many katas add one

    assert len(rows) == len(COMPARISONS), f"expected the {', '.join(COMPARISONS)} rows in:\n{out}"
    # k28's needs a 2-D mesh, 4 ranks (k28's own test holds it against torch's there)
    mesh = next(row for row in rows if row.startswith("[main] k28"))
    assert "--world-size 4" in mesh, mesh
    rows.remove(mesh)
    fsdp = next(row for row in rows if row.startswith("[main] k19"))
    if "not implemented yet" not in fsdp:  # beside the times: each way's collectives per step
        assert re.search(r"\d\.\d\dx +\d+ +\d+ ", fsdp), fsdp
        assert "(median of 1 steps)" in fsdp, fsdp
    if impl.current() == "solutions":
        wrong = [row for row in rows if "same weights" not in row]
        assert not wrong, "the references must end with torch's weights:\n" + "\n".join(wrong)
        # k32: beside the times, the activations each way keeps; the same bytes as torch's
        checkpointed = next(row for row in rows if row.startswith("[main] k32"))
        kept = re.search(r"activations kept ([\d,]+) B and ([\d,]+) B", checkpointed)
        assert kept and kept.group(1) == kept.group(2), checkpointed


def _row(only: str, row: str, *options: str) -> str:
    """`python -m benchmarks.parallel --only ONLY` (with ``options``), one step: its one row,
    which starts with "[main] ROW"."""
    result = run_module(
        "benchmarks.parallel", "--impl", impl.current(), "--only", only, "--steps", "1",
        "--warmup", "0", "--dim", "32", *options, timeout=120,
    )  # fmt: skip
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"the benchmark failed (exit {result.returncode}):\n{out}\n{err}"
    rows = [line for line in out.splitlines() if " vs " in line]
    assert len(rows) == 1 and rows[0].startswith(f"[main] {row}"), (
        f"expected the row {row!r} alone in:\n{out}"
    )
    return rows[0]


@pytest.mark.slow  # a process importing torch, then a 2-rank world running DTensor: ~6 s on 2 cores
def test_parallel_benchmark_holds_the_vocabulary_split_against_loss_parallel():
    """`python -m benchmarks.parallel --only vocab` (k34's row), one step of a one-block model."""
    row = _row("vocab", "k34 VocabParallelLM vs loss_parallel", "--blocks", "1")
    if impl.current() == "solutions":  # the embedding's sum, the loss's three, f's in backward
        assert re.search(r"\d\.\d\dx +5 +\d+ +same weights", row), row


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~6 s on 2 cores
def test_parallel_benchmark_holds_mixed_precision_fsdp_against_fully_shard():
    """`dojo bench parallel --only mp`: k31's MixedPrecisionFSDP beside fully_shard with the same
    MixedPrecisionPolicy (bf16 gathers, fp32 reduce-scatters), one step."""
    row = _row("mp", "k31 MixedPrecisionFSDP vs")
    if "not implemented yet" in row:
        return
    # the same units, the same calls: 4 blocks and the model, a gather and a reduce-scatter each
    assert re.search(r"\d\.\d\dx +10 +10 ", row), row
    if impl.current() == "solutions":
        assert "same weights" in row, row


@pytest.mark.slow  # a process importing torch, then a 4-rank world running DTensor: ~8 s on 2 cores
def test_parallel_benchmark_holds_hsdp_against_fully_shard_on_a_2d_mesh():
    """`dojo bench parallel --world-size 4 --only hsdp`: k36's HsdpTransformer beside fully_shard
    on a (replicate, shard) = (2, 2) mesh, the same units, one step."""
    row = _row("hsdp", "k36 HsdpTransformer vs", "--world-size", "4")
    if "not implemented yet" in row:
        return
    if impl.current() == "solutions":
        assert "same weights" in row, row


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~5 s on 2 cores
def test_parallel_benchmark_holds_ulysses_against_the_ring():
    """`dojo bench parallel --only ulysses` (k35's row): Ulysses beside k26's ring on the same
    inputs (torch has no Ulysses in core), both held to one process's attention, one step."""
    row = _row("ulysses", "k35 ulysses_attention vs k26's ring_attention")
    if impl.current() == "solutions":  # 4 all-to-alls each way; the ring's 2 + 6 sends and receives
        assert re.search(r"\d\.\d\dx +8 +\d+ +same weights", row), row


@pytest.mark.slow  # a process importing torch, then a 2-rank world: ~5 s on 2 cores
def test_parallel_benchmark_holds_local_sgd_against_post_local_sgd_optimizer():
    """`dojo bench parallel --only localsgd` (k37's row): local_sgd_step beside torch's
    PostLocalSGDOptimizer with a PeriodicModelAverager of the same period, one period timed
    (4 optimizer steps and one average) and one counted: one all-reduce each way."""
    row = _row("localsgd", "k37 local_sgd_step vs PostLocalSGDOptimizer")
    if impl.current() == "solutions":
        assert re.search(r"\d\.\d\dx +1 +1 +same weights", row), row
