"""``dojo trace kNN [ARGS]`` (a kata's program, traced), ``dojo check kNN --trace DIR`` (its tests,
traced) and ``dojo dev timelines`` (the lessons' timelines in docs/timelines/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from dojo import curriculum
from dojo.harness import timeline
from dojo.runner.term import foreground

DEFAULT_DIR = "traces"  # under the checkout (ignored by git)

# The lessons' pictures: (file in docs/timelines/, the program, its arguments)
TIMELINES = (
    ("k09_ring_allreduce.png", "k09_ring_allreduce", ["--world-size", "4", "--length", "64"]),
    (
        "k21_gpipe.png",
        "k21_pipeline",
        ["--world-size", "4", "--schedule", "gpipe", "--micro-batches", "8"],
    ),  # fmt: skip
    (
        "k21_1f1b.png",
        "k21_pipeline",
        ["--world-size", "4", "--schedule", "1f1b", "--micro-batches", "8"],
    ),  # fmt: skip
    (
        "k27_interleaved.png",
        "k27_interleaved_pipeline",
        "--world-size 4 --chunks 2 --schedule interleaved --micro-batches 8".split(),
    ),
    (
        "k27_zero_bubble.png",
        "k27_interleaved_pipeline",
        "--world-size 4 --chunks 1 --schedule zero-bubble --micro-batches 8".split(),
    ),
    (
        "k26_ring_attention.png",
        "k26_ring_attention",
        "--world-size 4 --split balanced --length 2048 --heads 4 --dim 32".split(),
    ),
)


def _folder(out: str | None, kata: curriculum.Kata) -> str:
    folder = os.path.abspath(out or os.path.join(curriculum.ROOT, DEFAULT_DIR, kata.id))
    os.makedirs(folder, exist_ok=True)
    return folder


def trace_program(
    kata: curriculum.Kata, solutions: bool, args: list[str], out: str | None = None
) -> int:
    """The kata's program with every world traced; the files' paths and how to open them.

    The program writes the files itself when its world ends (``dojo.launch``); this says
    where they are once more, after the program's own output."""
    folder = _folder(out, kata)
    before = {p: os.path.getmtime(os.path.join(folder, p)) for p in os.listdir(folder)}
    package = "solutions" if solutions else "katas"
    os.environ[timeline.ENV_VAR] = folder  # the program and its ranks inherit it
    code = foreground([sys.executable, "-m", f"{package}.{kata.module}", *args], curriculum.ROOT)
    made = sorted(
        name
        for name in os.listdir(folder)
        if name.endswith(".png")
        and before.get(name) != os.path.getmtime(os.path.join(folder, name))
    )
    if made:
        print(f"\ntimelines of {package}/{kata.module}.py in {_shown(folder)}/:")
        for name in made:
            stem = name.removesuffix(".png")
            print(
                f"  {stem}.png   the picture: a lane per rank, a bar per call, arrows send -> recv"
            )
            print(
                f"  {stem}.json  open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing"
            )
    return code


def check_traced(kata: curriculum.Kata, solutions: bool, out: str) -> int:
    """``dojo check kNN --trace DIR``: the kata's tests, every world they start traced."""
    from dojo.runner import learn

    folder = _folder(out, kata)
    os.environ[timeline.ENV_VAR] = folder
    try:
        return learn.check_command(kata, solutions)
    finally:
        written = timeline.write_pending(folder)
        if written:
            print("\n" + timeline.summary(written, folder))


def timelines() -> int:
    """``dojo dev timelines``: regenerate docs/timelines/*.png from the reference programs."""
    target = curriculum.ROOT / "docs" / "timelines"
    target.mkdir(parents=True, exist_ok=True)
    failed = 0
    for picture, module, args in TIMELINES:
        if not (curriculum.ROOT / "solutions" / f"{module}.py").exists():
            print(
                f"skipped docs/timelines/{picture}: solutions/{module}.py is not in this checkout"
            )
            continue
        with tempfile.TemporaryDirectory(prefix="dojo-timeline-") as folder:
            env = {**os.environ, timeline.ENV_VAR: folder, "DOJO_IMPL": "solutions"}
            done = subprocess.run(
                [sys.executable, "-m", f"solutions.{module}", *args],
                cwd=curriculum.ROOT,
                env=env,
                capture_output=True,
                text=True,
            )
            made = sorted(p for p in os.listdir(folder) if p.endswith(".png"))
            if done.returncode != 0 or not made:
                print(
                    f"FAILED docs/timelines/{picture}: python -m solutions.{module} {' '.join(args)}"
                )
                print(done.stdout[-2000:] + done.stderr[-2000:])
                failed += 1
                continue
            shutil.copyfile(os.path.join(folder, made[0]), target / picture)
            print(f"wrote docs/timelines/{picture} (python -m solutions.{module} {' '.join(args)})")
    return 1 if failed else 0


def _shown(path: str) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path
