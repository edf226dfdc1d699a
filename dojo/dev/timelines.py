"""``dojo dev timelines``: the lessons' pictures in docs/timelines/, made from the reference.

Two kinds, side by side for the pipeline katas:
- measured: a reference program run traced (``dojo.harness.timeline``), a lane per rank and a bar
  per torch.distributed call, its compute spans named above. On a CPU most of it is waiting.
- on a clock: the schedule as data (the reference's ``*_actions`` and ``simulate``), each
  action a box of its ticks, as a textbook draws a pipeline: what the lesson explains.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

from dojo import curriculum
from dojo.harness import timeline

TARGET = curriculum.ROOT / "docs" / "timelines"

# The measured pictures: (file in docs/timelines/, the program, its arguments)
MEASURED = (
    ("k09_ring_allreduce.png", "k09_ring_allreduce", "--world-size 4 --length 64"),
    ("k21_gpipe.png", "k21_pipeline", "--world-size 4 --schedule gpipe --micro-batches 8"),
    ("k21_1f1b.png", "k21_pipeline", "--world-size 4 --schedule 1f1b --micro-batches 8"),
    (
        "k27_interleaved.png",
        "k27_interleaved_pipeline",
        "--world-size 4 --chunks 2 --schedule interleaved --micro-batches 8",
    ),
    (
        "k27_zero_bubble.png",
        "k27_interleaved_pipeline",
        "--world-size 4 --chunks 1 --schedule zero-bubble --micro-batches 8",
    ),
    (
        "k26_ring_attention.png",
        "k26_ring_attention",
        "--world-size 4 --split balanced --length 2048 --heads 4 --dim 32",
    ),
)

# The same colours as the measured pictures' named parts (F, B, W, in that order there too).
KIND_COLOURS = {"F": "#efe3c2", "B": "#ddd3f0", "W": "#cde8e2"}
WHOLE_BACKWARD = {"F": "F: forward", "B": "B: backward"}
SPLIT_BACKWARD = {
    "F": "F: forward",
    "B": "B: backward, the input's gradient only",
    "W": "W: backward, the weights' gradient",
}

Box = tuple[int, int, str, str]  # (first tick, ticks, label, kind)
Picture = tuple[list[list[Box]], str, dict[str, str]]  # a row of boxes per rank, title, legend


def _k21(schedule: str) -> Callable[[], Picture]:
    def boxes() -> Picture:
        kata = importlib.import_module("solutions.k21_pipeline")
        p, m = 4, 8
        actions = {"gpipe": kata.gpipe_actions, "1f1b": kata.one_f_one_b_actions}[schedule]
        schedules = [actions(p, m, r) for r in range(p)]
        clock = kata.simulate(schedules)
        rows = [
            [(tick, 1, f"{kind}{i}", kind) for (kind, i), tick in zip(actions_r, clock.ticks[r])]
            for r, actions_r in enumerate(schedules)
        ]
        name = {"gpipe": "GPipe", "1f1b": "1F1B"}[schedule]
        bubble = kata.bubble_formula(p, m)
        return (
            rows,
            (
                f"{name} on a clock: p = {p} ranks, m = {m} micro-batches, F and B one tick each; "
                f"idle (p-1)/(m+p-1) = {bubble:.0%} of every rank's time"
            ),
            WHOLE_BACKWARD,
        )

    return boxes


def _k27(schedule: str, chunks: int) -> Callable[[], Picture]:
    def boxes() -> Picture:
        kata = importlib.import_module("solutions.k27_interleaved_pipeline")
        p, m = 4, 8
        schedules = [kata.SCHEDULES[schedule](p, chunks, m, r) for r in range(p)]
        clock = kata.simulate(schedules)
        rows = []
        for r, actions in enumerate(schedules):
            row = []
            for (kind, chunk, i), tick in zip(actions, clock.ticks[r]):
                ticks = 2 if kind == "B" and ("W", chunk, i) not in actions else 1
                row.append((tick, ticks, f"{kind}{chunk}.{i}", kind))
            rows.append(row)
        split = schedule == "zero-bubble"
        bubble = kata.bubble_formula(p, chunks, m, split=split)
        name = "ZB-H1" if split and chunks == 1 else f"interleaved 1F1B, v = {chunks} chunks"
        ticks = "F, B and W one tick each" if split else "F one tick, B two"
        return (
            rows,
            (
                f"{name} on a clock: p = {p} ranks, m = {m} micro-batches, {ticks} "
                f"(labels: kind chunk.micro-batch); idle over busy = {bubble:.1%}"
            ),
            SPLIT_BACKWARD if split else WHOLE_BACKWARD,
        )

    return boxes


# The pictures on a clock: (file in docs/timelines/, what draws its boxes)
ON_A_CLOCK = (
    ("k21_gpipe_schedule.png", _k21("gpipe")),
    ("k21_1f1b_schedule.png", _k21("1f1b")),
    ("k27_interleaved_schedule.png", _k27("interleaved", 2)),
    ("k27_zero_bubble_schedule.png", _k27("zero-bubble", 1)),
)


def draw_clock(rows: list[list[Box]], path: str, title: str, names: dict[str, str]) -> None:
    """A row per rank, a box per action over its ticks, labelled; idle ticks left white."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    length = max((start + ticks for row in rows for start, ticks, _, _ in row), default=1)
    width = max(13.0, 0.3 * length)  # inches: a tick wide enough for its label
    figure, axes = plt.subplots(figsize=(width, 1.4 + 0.55 * len(rows)), dpi=110)
    points_per_tick = width * 0.82 * 72 / (length * 1.12)
    kinds = []
    for rank, row in enumerate(rows):
        for start, ticks, label, kind in row:
            axes.broken_barh(
                [(start, ticks)],
                (rank - 0.38, 0.76),
                facecolors=KIND_COLOURS.get(kind, "#e2e2e2"),
                edgecolor="#777777",
                linewidth=0.6,
            )
            # the largest font up to 6.5 whose label fits the box
            size = min(6.5, points_per_tick * ticks / (0.62 * len(label) + 0.6))
            axes.text(start + ticks / 2, rank, label, ha="center", va="center", fontsize=size)
            if kind not in kinds:
                kinds.append(kind)
        busy = sum(ticks for _, ticks, _, _ in row)
        axes.text(length * 1.01, rank, f"{busy}/{length} ticks busy", va="center", fontsize=8)
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels([f"rank {r}" for r in range(len(rows))])
    axes.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top
    axes.set_xlim(0, length * 1.12)
    axes.set_xticks(range(0, length + 1, 2))
    axes.set_xlabel("ticks (white = the rank is idle: the bubble)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_title(title, fontsize=10)
    entries = [
        Patch(facecolor=KIND_COLOURS.get(k, "#e2e2e2"), edgecolor="#777777", label=names[k])
        for k in kinds
    ]
    figure.legend(handles=entries, loc="lower center", ncol=len(entries), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    figure.savefig(path)
    plt.close(figure)


def _measured(picture: str, module: str, args: str) -> bool:
    with tempfile.TemporaryDirectory(prefix="dojo-timeline-") as folder:
        env = {**os.environ, timeline.ENV_VAR: folder, "DOJO_IMPL": "solutions"}
        command = [sys.executable, "-m", f"solutions.{module}", *args.split()]
        done = subprocess.run(command, cwd=curriculum.ROOT, env=env, capture_output=True, text=True)
        made = sorted(p for p in os.listdir(folder) if p.endswith(".png"))
        if done.returncode != 0 or not made:
            print(f"FAILED docs/timelines/{picture}: python -m solutions.{module} {args}")
            print(done.stdout[-2000:] + done.stderr[-2000:])
            return False
        shutil.copyfile(os.path.join(folder, made[0]), TARGET / picture)
    print(f"wrote docs/timelines/{picture} (python -m solutions.{module} {args})")
    return True


def make() -> int:
    """Regenerate docs/timelines/*.png from the reference; 1 when one could not be made."""
    TARGET.mkdir(parents=True, exist_ok=True)
    failed = 0
    for picture, module, args in MEASURED:
        if not (curriculum.ROOT / "solutions" / f"{module}.py").exists():
            print(f"skipped docs/timelines/{picture}: solutions/{module}.py is not here")
            continue
        failed += not _measured(picture, module, args)
    for picture, boxes in ON_A_CLOCK:
        rows, title, names = boxes()
        draw_clock(rows, str(TARGET / picture), title, names)
        print(f"wrote docs/timelines/{picture} (the reference's schedule on a clock)")
    return 1 if failed else 0
