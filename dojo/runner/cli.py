"""The ``dojo`` command (also ``python -m dojo``): the learner's runner and the maintainers' gate.

Exit status: 0 done / passes, 1 a kata does not pass (or a question was answered no), 2 a usage
problem (unknown kata, missing file), 130 interrupted. Plain ``dojo`` is a view and exits 0
unless something is broken; ``check`` and ``verify`` are the commands whose status means pass/fail.
"""

from __future__ import annotations

import argparse
import os
import sys

from dojo import curriculum
from dojo.commands import dojo, environment_problem
from dojo.runner import progress
from dojo.runner.term import fail

DESCRIPTION = """\
torch-dist-katas: learn torch.distributed by doing. Edit katas/kNN_*.py until its tests pass.

With no command: your progress, a run of the current kata's tests, and what to do next."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dojo", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lang", choices=("en", "zh"), help="lessons, hints and messages in English or Chinese (中文); "
        "default: DOJO_LANG, else the locale"
    )  # fmt: skip
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=text, description=text)

    listing = command("list", "every kata: done, current, pending or not written yet")
    listing.add_argument("--json", action="store_true", help="as JSON, for scripts")
    check = command(
        "check", "run one kata's tests (default: the current kata); marks it done when it passes"
    )
    check.add_argument("kata", nargs="?", help="k01, 1 or k01_spawn")
    check.add_argument(
        "--solutions",
        action="store_true",
        help="test the reference instead (instructors; progress untouched)",
    )
    check.add_argument(
        "--trace",
        metavar="DIR",
        help="record every rank's torch.distributed calls of every test world: DIR/TEST.json "
        "(Perfetto, chrome://tracing) and DIR/TEST.png (a timeline)",
    )
    verify = command("verify", "every kata in order; exits 1 naming the first that does not pass")
    verify.add_argument(
        "--fresh", action="store_true", help="re-run katas that passed and have not changed since"
    )
    verify.add_argument(
        "--solutions",
        action="store_true",
        help="verify the reference solutions instead (progress untouched)",
    )
    command("next", "move on to the next kata once the current one passes")
    goto = command("goto", "make a kata the current one (going back, or skipping ahead on purpose)")
    goto.add_argument("kata")
    lesson = command("lesson", "the kata's lesson (default: the current kata), in your language")
    lesson.add_argument("kata", nargs="?", help="k01, 1 or k01_spawn")
    hint = command(
        "hint", "hints in tiers, from a nudge to nearly the answer; --more goes one tier further"
    )
    hint.add_argument("kata", nargs="?", help="default: the current kata")
    hint.add_argument("--step", type=int, help="default: the first failing step")
    hint.add_argument(
        "--more",
        action="store_true",
        help="one tier more than you have seen (closer to the answer)",
    )
    hint.add_argument("--level", type=int, help="show tiers 1..LEVEL")
    reset = command("reset", "give a kata its shipped stub back (your file is backed up first)")
    reset.add_argument("kata", nargs="?")
    reset.add_argument("--all", action="store_true", help="every kata you have changed")
    reset.add_argument("-y", "--yes", action="store_true", help="do not ask")
    reset.add_argument(
        "--undo", action="store_true", help="bring back the version the last reset backed up"
    )
    solution = command("solution", "show the reference solution, or --diff it against your file")
    solution.add_argument("kata", nargs="?", help="default: the current kata")
    solution.add_argument(
        "--diff", action="store_true", help="what differs between your file and the reference"
    )
    solution.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="show it even before your kata passes, without asking",
    )
    watch = command("watch", "re-run the current kata's tests on every save; keys: n h l r c q")
    watch.add_argument(
        "--interval",
        type=float,
        default=0.5,
        help="seconds between checks for saved files (default 0.5)",
    )
    watch.add_argument("-y", "--yes", action="store_true", help="[r] resets without asking")
    run = command("run", "run a kata's program: python -m katas.kNN_topic [ARGS]")
    run.add_argument("--solutions", action="store_true", help="run the reference program instead")
    run.add_argument("kata")
    run.add_argument(
        "args", nargs=argparse.REMAINDER, help="passed to the program (e.g. --world-size 2)"
    )
    traced = command(
        "trace",
        "run a kata's program with every rank's torch.distributed calls recorded: a timeline "
        "(PNG) and a trace for https://ui.perfetto.dev or chrome://tracing (JSON)",
    )
    traced.add_argument("--solutions", action="store_true", help="trace the reference program")
    traced.add_argument(
        "--out", metavar="DIR", help="where the files go (default: traces/kNN in the checkout)"
    )
    traced.add_argument("kata")
    traced.add_argument(
        "args", nargs=argparse.REMAINDER, help="passed to the program (e.g. --world-size 2)"
    )
    doctor = command("doctor", "what this machine offers the katas, and what will not work")
    doctor.add_argument("--json", action="store_true")
    from dojo.runner.bench import KNOWN  # light: names and one-line descriptions

    bench = command("bench", f"run a benchmark from benchmarks/: {', '.join(sorted(KNOWN))}")
    bench.add_argument(
        "name", help="which one (a file benchmarks/NAME.py; `--help` after it: its options)"
    )
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")

    grade = command(
        "grade", "instructors: grade a class's katas (checkouts, katas/ folders, zips or tarballs)"
    )
    grade.add_argument(
        "submissions",
        nargs="+",
        metavar="SUBMISSION",
        help="a learner's checkout, katas/ folder or archive",
    )
    grade.add_argument("--katas", help="which katas, e.g. k01-k06 or k02,k04 (default: all)")
    grade.add_argument("--jobs", type=int, default=1, help="learners graded at once (default 1)")
    grade.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds one kata's tests may take (default 600)",
    )
    grade.add_argument(
        "--out", help="folder for grades.csv/.json/.xml/.html (default: grades-DATE-TIME)"
    )
    dev = command("dev", "maintainer commands").add_subparsers(
        dest="dev_command", required=True, metavar="DEV_COMMAND"
    )
    devcheck_ = dev.add_parser("check", help="the maintainer gate that `make test` runs")
    devcheck_.add_argument(
        "--repeat", type=int, default=1, help="run the pytest passes this many times"
    )
    devcheck_.add_argument("-n", "--workers", default="2", help="pytest-xdist workers (default 2)")
    devcheck_.add_argument("--kata", action="append", help="check only this kata (repeatable)")
    devcheck_.add_argument(
        "--only",
        action="append",
        choices=("consistency", "solutions", "mistakes", "stubs"),
        help="run only this part (repeatable)",
    )
    devcheck_.add_argument(
        "-k",
        dest="select",
        metavar="EXPR",
        help="only the tests matching this pytest -k expression",
    )
    dev.add_parser(
        "classroom",
        help="rewrite dojo/classroom/autograding.yml (GitHub Classroom) from the curriculum",
    )
    dev.add_parser(
        "timelines",
        help="regenerate docs/timelines/*.png (the k09 and k21 lessons' timelines) from solutions/",
    )
    dev.add_parser("readme", help="rewrite README.md's kata table from dojo/curriculum/")
    dev.add_parser(
        "pristine",
        help="copy the shipped stubs in katas/ to dojo/pristine/ (what `dojo reset` restores)",
    )
    return parser


# Commands that run tests or programs, and so need torch and pytest in this Python.
_NEED_TORCH = (
    None, "check", "verify", "next", "hint", "watch", "run", "trace", "bench", "grade", "dev",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.lang:  # pytest and the programs the runner starts read it too
        os.environ["DOJO_LANG"] = args.lang
    if args.command in _NEED_TORCH and (problem := environment_problem(argv)):
        return fail(problem)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dojo list | head`
        return 0


def _kata(name: str | None, need_files: bool = True) -> curriculum.Kata:
    """The kata named, or the current one; raises ``_Usage`` with a message a learner can act on."""
    if name is None:
        kata = progress.current(progress.load())
        if kata is None:
            raise _Usage(f"every kata written so far passes; name one (`{dojo()} list` shows them)")
        return kata
    try:
        kata = curriculum.find(name)
    except KeyError as error:
        raise _Usage(error.args[0]) from None
    if need_files and not progress.available(kata):
        raise _Usage(
            f"{kata.id} · {kata.title} is not written yet (katas/{kata.module}.py or its tests are missing)"
        )
    return kata


class _Usage(Exception):
    pass


def _dispatch(args: argparse.Namespace) -> int:
    from dojo.runner import bench, devcheck, doctor, hints, learn, reset, solution, watch

    try:
        match args.command:
            case None:
                return learn.start()
            case "list":
                return learn.show_list(args.json)
            case "check":
                if args.trace:
                    from dojo.runner import trace

                    return trace.check_traced(_kata(args.kata), args.solutions, args.trace)
                return learn.check_command(_kata(args.kata), args.solutions)
            case "verify":
                return learn.verify(args.fresh, args.solutions)
            case "next":
                return learn.next_kata()
            case "goto":
                return learn.goto(_kata(args.kata))
            case "lesson":
                return learn.lesson(_kata(args.kata))
            case "hint":
                return hints.show(_kata(args.kata), args.step, args.level, args.more)
            case "reset":
                if args.undo:
                    return reset.undo(_kata(args.kata))
                if args.all == bool(args.kata):
                    raise _Usage(f"say which kata to reset (`{dojo()} reset k01`), or --all")
                katas = progress.available_katas() if args.all else [_kata(args.kata)]
                return reset.reset(katas, args.yes)
            case "solution":
                return solution.show(_kata(args.kata), args.diff, args.yes)
            case "watch":
                return watch.watch(args.interval, args.yes)
            case "run":
                extra = args.args[1:] if args.args[:1] == ["--"] else args.args
                return learn.run_program(_kata(args.kata), args.solutions, extra)
            case "trace":
                from dojo.runner import trace

                extra = args.args[1:] if args.args[:1] == ["--"] else args.args
                return trace.trace_program(_kata(args.kata), args.solutions, extra, args.out)
            case "doctor":
                return doctor.doctor(args.json)
            case "bench":
                return bench.bench(
                    args.name, args.args[1:] if args.args[:1] == ["--"] else args.args
                )
            case "grade":
                from dojo.runner import grade

                try:
                    return grade.grade(
                        args.submissions, args.katas, args.jobs, args.timeout, args.out
                    )
                except KeyError as error:
                    raise _Usage(error.args[0]) from None
            case "dev":
                return _dev(args, devcheck, reset)
    except _Usage as problem:
        return fail(str(problem))
    return fail(f"unknown command {args.command}")


def _dev(args: argparse.Namespace, devcheck, reset) -> int:
    if args.dev_command == "check":
        try:
            katas = devcheck.resolve(args.kata)
        except KeyError as error:
            raise _Usage(error.args[0]) from None
        return devcheck.check(args.repeat, args.workers, katas, args.only, args.select)
    if args.dev_command == "classroom":
        from dojo.runner import classroom

        classroom.write()
        print(f"wrote {curriculum.ROOT.name}/dojo/classroom/autograding.yml from dojo/curriculum/")
        return 0
    if args.dev_command == "timelines":
        from dojo.runner import trace

        return trace.timelines()
    if args.dev_command == "readme":
        from dojo.runner import consistency

        consistency.write_readme_tables()
        print(
            "README.md's kata and catalogue tables rewritten from dojo/curriculum/ and dojo/mistakes/"
        )
        return 0
    written = reset.refresh_pristine(list(curriculum.katas()))
    print("\n".join(f"wrote {path}" for path in written) or "dojo/pristine/ already matches katas/")
    return 0
