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


LANG_HELP = (
    "lessons, hints and messages in English or Chinese (中文); default: DOJO_LANG, else the locale"
)
SOLUTIONS_HELP = "the reference solutions instead of your katas (check, verify, run, trace, bench)"
# The commands --solutions means something to; it may come before or after the command and kata.
TAKE_SOLUTIONS = ("check", "verify", "run", "trace", "bench")
# Commands that run a program: what follows the kata (the benchmark) is the program's, except
# these options of dojo's own (anywhere before a `--`; after it, everything is the program's).
PROGRAM_RUNNERS = {"run": ("--lang",), "trace": ("--lang", "--out"), "bench": ("--lang",)}


def _global_options(parser: argparse.ArgumentParser, solutions: str | None = None) -> None:
    """--lang and --solutions on a command too, so that they work after it as well as before.
    SUPPRESS: given before the command, a command's own default must not overwrite them."""
    parser.add_argument("--lang", choices=("en", "zh"), default=argparse.SUPPRESS, help=LANG_HELP)
    parser.add_argument(
        "--solutions", action="store_true", default=argparse.SUPPRESS,
        help=solutions or argparse.SUPPRESS,
    )  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dojo", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lang", choices=("en", "zh"), help=LANG_HELP)
    parser.add_argument("--solutions", action="store_true", help=SOLUTIONS_HELP)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, text: str, solutions: str | None = None) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        _global_options(sub, solutions)
        return sub

    listing = command("list", "every kata: done, current, pending or not written yet")
    listing.add_argument("--json", action="store_true", help="as JSON, for scripts")
    check = command(
        "check",
        "run one kata's tests (default: the current kata); marks it done when it passes",
        solutions="test the reference instead (instructors; progress untouched)",
    )
    check.add_argument("kata", nargs="?", help="k01, 1 or k01_spawn")
    check.add_argument(
        "--trace",
        metavar="DIR",
        help="record every rank's torch.distributed calls of every test world: DIR/TEST.json "
        "(Perfetto, chrome://tracing) and DIR/TEST.png (a timeline)",
    )
    verify = command(
        "verify",
        "every kata in order; exits 1 naming the first that does not pass",
        solutions="verify the reference solutions instead (progress untouched)",
    )
    verify.add_argument(
        "--fresh", action="store_true", help="re-run katas that passed and have not changed since"
    )
    command("next", "move on to the next kata once the current one passes")
    goto = command("goto", "make a kata the current one (going back, or skipping ahead on purpose)")
    goto.add_argument("kata", nargs="?", help="k01, 1 or k01_spawn")
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
    program_args = (
        "passed to the program (e.g. --world-size 2; --help: its options), but for this "
        "command's own options; after `--`, everything is the program's"
    )
    run = command(
        "run",
        "run a kata's program (default: the current kata's): python -m katas.kNN_topic [ARGS]",
        solutions="run the reference program instead",
    )
    run.add_argument("kata", nargs="?", help="k01, 1 or k01_spawn")
    run.add_argument("args", nargs="*", metavar="ARGS", help=program_args)
    traced = command(
        "trace",
        "run a kata's program (default: the current kata's) with every rank's torch.distributed "
        "calls recorded: a timeline (PNG) and a trace for https://ui.perfetto.dev or "
        "chrome://tracing (JSON)",
        solutions="trace the reference program",
    )
    traced.add_argument(
        "--out", metavar="DIR", help="where the files go (default: traces/kNN in the checkout)"
    )
    traced.add_argument("kata", nargs="?", help="k01, 1 or k01_spawn")
    traced.add_argument("args", nargs="*", metavar="ARGS", help=program_args)
    doctor = command("doctor", "what this machine offers the katas, and what will not work")
    doctor.add_argument("--json", action="store_true")
    from dojo.runner.bench import KNOWN  # light: names and one-line descriptions

    bench = command(
        "bench",
        f"run a benchmark from benchmarks/: {', '.join(sorted(KNOWN))}",
        solutions="measure the reference solutions instead of your katas",
    )
    bench.add_argument(
        "name",
        nargs="?",
        help="which one (a file benchmarks/NAME.py; `--help` after it: its options)",
    )
    bench.add_argument("args", nargs="*", metavar="ARGS", help="passed to the benchmark")

    grade = command(
        "grade", "instructors: grade a class's katas (checkouts, katas/ folders, zips or tarballs)"
    )
    grade.add_argument(
        "submissions",
        nargs="*",
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
        dest="dev_command", metavar="DEV_COMMAND"
    )

    def dev_command(name: str, text: str) -> argparse.ArgumentParser:
        sub = dev.add_parser(name, help=text, description=text)
        _global_options(sub)
        return sub

    devcheck_ = dev_command("check", "the maintainer gate that `make test` runs")
    devcheck_.add_argument(
        "--repeat", type=int, default=1, help="run the pytest passes this many times"
    )
    devcheck_.add_argument("-n", "--workers", default="2", help="pytest-xdist workers (default 2)")
    devcheck_.add_argument("--kata", action="append", help="check only this kata (repeatable)")
    devcheck_.add_argument("named", nargs="*", metavar="KATA", help="the same as --kata KATA")
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
    dev_command(
        "classroom",
        "rewrite dojo/classroom/autograding.yml (GitHub Classroom) from the curriculum",
    )
    dev_command(
        "timelines",
        "regenerate docs/timelines/*.png (the k09, k21, k26 and k27 lessons' timelines) from solutions/",
    )
    dev_command("readme", "rewrite README.md's kata table from dojo/curriculum/")
    dev_command(
        "messages",
        "extract the sentences marked for translation, merge them into dojo/locale/*/dojo.po "
        "and compile each dojo.mo (Babel, the dev extra)",
    )
    stubs_ = dev_command(
        "stubs",
        "write katas/ from solutions/: each stub made from its reference's markers (never over a "
        "learner's work)",
    )
    stubs_.add_argument("named", nargs="*", metavar="KATA", help="only these katas (default: all)")
    return parser


# Commands that run tests or programs, and so need torch and pytest in this Python.
_NEED_TORCH = (
    None, "check", "verify", "next", "hint", "watch", "run", "trace", "bench", "grade", "dev",
)  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line as a person types it: --lang and --solutions before or after the command
    and the kata; for run, trace and bench, what follows the kata goes to the program
    (``args.args``), but for the command's own options."""
    ours, program = split_program_args(argv)
    args = _parser().parse_args(ours)
    if program is not None:
        args.args = program
    return args


def split_program_args(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``(words for dojo, the program's arguments)``; None for a command that runs no program.

    Before the kata, ``-h`` is dojo's; after it, the program's. The kata is the first word that is
    not an option, if it comes before the program's first argument (else: the current kata)."""
    at = 0
    while at < len(argv) and argv[at].startswith("-"):
        at += 2 if argv[at] == "--lang" else 1  # the only top-level option with a value
    if at >= len(argv) or argv[at] not in PROGRAM_RUNNERS:
        return argv, None
    valued = PROGRAM_RUNNERS[argv[at]]
    ours, program, rest = argv[: at + 1], [], argv[at + 1 :]
    named, index = False, 0
    while index < len(rest):
        word = rest[index]
        if word == "--":
            program += rest[index + 1 :]
            break
        if word.split("=", 1)[0] in valued:
            width = 1 if "=" in word else 2
            ours += rest[index : index + width]
            index += width
            continue
        if word == "--solutions" or (not program and not named and word in ("-h", "--help")):
            ours.append(word)
        elif not program and not named and not word.startswith("-"):
            ours.append(word)
            named = True
        else:
            program.append(word)
        index += 1
    return ours, program


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    if args.lang:  # pytest and the programs the runner starts read it too
        os.environ["DOJO_LANG"] = args.lang
    if args.solutions and args.command not in TAKE_SOLUTIONS:
        what = f"`{dojo()} {args.command}`" if args.command else f"plain `{dojo()}`"
        return fail(
            f"--solutions (the reference instead of your katas) goes with "
            f"{', '.join(TAKE_SOLUTIONS)}, not {what}: e.g. `{dojo()} check k01 --solutions`"
        )
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
    from dojo.runner import bench, doctor, hints, learn, reset, solution, watch

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
                if args.kata is None:
                    raise _Usage(
                        f"say which kata to make the current one: `{dojo()} goto k05` "
                        f"(`{dojo()} list` shows them)"
                    )
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
                return learn.run_kata_program(_kata(args.kata), args.solutions, args.args)
            case "trace":
                from dojo.runner import trace

                return trace.trace_program(_kata(args.kata), args.solutions, args.args, args.out)
            case "doctor":
                return doctor.doctor(args.json)
            case "bench":
                if args.name is None:
                    raise _Usage(
                        f"say which benchmark: {', '.join(bench.available())} "
                        f"(`{dojo()} bench allreduce`; `--help` after the name: its options)"
                    )
                return bench.bench(args.name, args.args, args.solutions)
            case "grade":
                from dojo.runner import grade

                if not args.submissions:
                    raise _Usage(
                        "say whose work to grade: learners' checkouts, katas/ folders, zips or "
                        f"tarballs (`{dojo()} grade class/* --katas k01-k04`)"
                    )
                try:
                    return grade.grade(
                        args.submissions, args.katas, args.jobs, args.timeout, args.out
                    )
                except KeyError as error:
                    raise _Usage(error.args[0]) from None
            case "dev":
                return _dev(args)
    except _Usage as problem:
        return fail(str(problem))
    return fail(f"unknown command {args.command}")


def _dev(args: argparse.Namespace) -> int:
    """``dojo dev``: the maintainers' commands (the only place the runner hands over to dojo.dev)."""
    if args.dev_command is None:
        raise _Usage(
            f"say which: `{dojo()} dev check` (the gate `make test` runs), classroom, timelines, "
            f"readme, messages or stubs (`{dojo()} dev --help`)"
        )
    if args.dev_command == "check":
        from dojo.dev import check as devcheck

        try:
            katas = devcheck.resolve([*(args.kata or []), *args.named] or None)
        except KeyError as error:
            raise _Usage(error.args[0]) from None
        return devcheck.check(args.repeat, args.workers, katas, args.only, args.select)
    if args.dev_command == "classroom":
        from dojo.dev import classroom

        classroom.write()
        print(f"wrote {curriculum.ROOT.name}/dojo/classroom/autograding.yml from dojo/curriculum/")
        return 0
    if args.dev_command == "timelines":
        from dojo.dev import timelines

        return timelines.make()
    if args.dev_command == "readme":
        from dojo.dev import consistency

        consistency.write_readme_tables()
        print(
            "README.md's kata and catalogue tables rewritten from dojo/curriculum/ and dojo/dev/mistakes/"
        )
        return 0
    if args.dev_command == "messages":
        from dojo.dev import messages

        for line in messages.update():
            print(line)
        return 0
    from dojo.dev import consistency

    try:
        katas = [curriculum.find(name) for name in args.named] or list(curriculum.katas())
    except KeyError as error:
        raise _Usage(error.args[0]) from None
    written, refused = consistency.refresh_stubs(katas)
    for path in written:
        print(f"wrote {path}")
    if not written and not refused:
        print("katas/ already holds the stubs made from solutions/")
    return 1 if refused else 0
