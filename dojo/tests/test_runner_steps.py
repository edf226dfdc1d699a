"""How the runner reads a test run: which step a failure is about, and the digest a learner sees,
rendered from the test log's records (``dojo.runner.testlog``), never from their English text.
In-process and read-only, on k01's shipped files."""

from __future__ import annotations

import pytest

from dojo import curriculum
from dojo.dev.consistency import coverage_problems
from dojo.runner.runs import RunResult

K01 = curriculum.find("k01")
TEST = "tests/test_k01_spawn.py"


@pytest.fixture(autouse=True)
def a_terminal_100_columns_wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # the runner wraps its lines to it (xdist's says 80)


def record(
    test: str, outcome: str = "failed", text: str = "", when: str = "call", steps=(1,), **more
) -> dict:
    return {
        "test": f"{TEST}::{test}",
        "when": when,
        "outcome": outcome,
        "text": text,
        "steps": list(steps),
        **more,
    }


def todo(kata: str, step: int, what: str) -> dict:
    """A todo's record as the test log writes it (its text is the plugin's, in any language)."""
    return {"todo": {"kata": kata, "step": step, "what": what}, "text": "尚未实现：..."}


def test_a_failure_belongs_to_its_todo_or_else_to_its_tests_step_marker():
    ran_into = record("test_launch_names_the_rank_that_failed", steps=[4], **todo("k01", 2, "x"))
    assert RunResult(K01, 1, [ran_into]).failing_steps == [2], (
        "an unwritten step names itself, whichever test ran into it"
    )
    wrong = record("test_launch_names_the_rank_that_failed", message="AssertionError", steps=[4])
    assert RunResult(K01, 1, [wrong]).failing_steps == [4], (
        "a real failure belongs to the step its test is marked with"
    )
    other = record("test_x", steps=[3], **todo("k02", 1, "set MASTER_ADDR"))
    assert RunResult(K01, 1, [other]).failing_steps == [3], (
        "another kata's todo says nothing about this kata's steps"
    )


def test_coverage_names_unmarked_tests_and_steps_without_a_test():
    collected = [
        {"test": f"{TEST}::test_a", "steps": [1]},
        {"test": f"{TEST}::test_b", "steps": []},
        {"test": f"{TEST}::test_c", "steps": [2, 3]},
        {"test": f"{TEST}::test_d", "steps": [9]},
    ]
    problems = "\n".join(coverage_problems(K01, collected))
    assert (
        "test_b says which step it checks with exactly one @pytest.mark.step(N), it has none"
        in problems
    ), problems
    assert "test_c says which step" in problems and "it has [2, 3]" in problems, problems
    assert "test_d is marked step 9, which the curriculum lacks" in problems, problems
    assert "no test checks step 4 (spawn, collect, join)" in problems, problems


def test_the_digest_shows_the_first_real_failure_in_full_and_the_todos_with_the_first_hint():
    result = RunResult(
        K01,
        1,
        [
            record("test_global_rank[0-0-3-0]", "passed"),
            record(
                "test_global_rank[1-0-3-3]",
                text="tests/test_k01_spawn.py:27: in test_global_rank\nE   AssertionError: returned 1, expected 3",
            ),
            record("test_global_rank[1-2-3-5]", message="AssertionError: returned 3, expected 5"),
            record("test_greet", **todo("k01", 2, "the greeting")),
            record("test_launch_spawns", **todo("k01", 4, "spawn, collect, join")),
            record("test_launch_names_the_rank", **todo("k01", 4, "spawn, collect, join")),
            record("test_launch_another", **todo("k01", 4, "a todo's own words")),
            record("test_cuda", "skipped"),
        ],
    )
    digest = result.digest()
    assert (
        "FAILED test_global_rank[1-0-3-3]\n  tests/test_k01_spawn.py:27: in test_global_rank"
        in digest
    ), digest
    assert "FAILED test_global_rank[1-2-3-5]: AssertionError: returned 3, expected 5" in digest, (
        digest
    )
    assert "step 2 · the greeting: 1 test\n" in digest, "the todo's words are its step's title"
    assert "step 4 · spawn, collect, join (also: a todo's own words): 3 tests" in digest, (
        "a todo's own words where they say more than the step's title"
    )
    hint = K01.step(2).hints[0]
    assert "-> write step 2 in katas/k01_spawn.py" in digest, digest
    assert f"hint: {hint[:30]}" in digest and "hint k01)" in digest, (
        f"the first unwritten step's gentlest hint, as the plugin's own report gives it:\n{digest}"
    )
    assert "尚未实现" not in digest, "rendered from the record, not the plugin's text"
    assert result.first_failing_step() == 1
    assert result.describe().startswith(
        "k01: 1 of 7 tests pass (1 skipped). First failing step: step 1"
    ), result.describe()


def test_a_todo_of_an_earlier_kata_is_named_with_that_kata_and_its_file():
    k02 = curriculum.find("k02")
    result = RunResult(k02, 1, [record("test_run", steps=[3], **todo("k01", 4, "spawn"))])
    digest = result.digest()
    assert "k01 step 4 · spawn, collect, join" in digest, digest
    assert "(k02's tests use k01's code: write that step first)" in digest, digest
    assert "-> write step 4 in katas/k01_spawn.py" in digest, digest
    assert result.first_failing_step() == 3, "k02's own step: the test's marker"


DEADLOCK = (
    "dojo.harness.world.WorldDeadlock: deadlock: rank(s) 0 waits inside torch.distributed calls, "
    "making no progress for 3 s, after rank(s) 1 returned: a call its peers never make."
)


def test_every_failure_in_the_summary_carries_the_learners_own_line():
    place = {"file": "katas/k01_spawn.py", "line": 149, "function": "launch"}
    result = RunResult(
        K01,
        1,
        [
            record("test_first", message="AssertionError: the first failure, in full"),
            record("test_hangs", message=DEADLOCK, deadlock=True, where=[place]),
            record("test_raises", message="ZeroDivisionError: division by zero", rank=2,
                   where=[{**place, "line": 90}, {**place, "line": 100, "function": "greet"}]),
        ],
    )  # fmt: skip
    lines = result.digest().splitlines()
    hang = next(i for i, line in enumerate(lines) if line.startswith("FAILED test_hangs"))
    below = lines[hang + 1 : hang + 4]
    assert "    your code: katas/k01_spawn.py:149, in launch" in below, "\n".join(lines)
    assert "    your code: katas/k01_spawn.py:100, in greet (rank 2)" in lines, (
        "the innermost of the learner's lines, and the rank that raised:\n" + "\n".join(lines)
    )


def test_after_ctrl_c_the_summary_says_what_stopped_and_does_not_read_as_a_pass():
    stuck = "interrupted: rank 0 waits in wait (katas/k01_spawn.py:99, launch); rank 1 returned"
    result = RunResult(
        K01,
        130,
        [
            record("test_a", "passed"),
            record("test_b", "passed"),
            {
                "test": f"{TEST}::test_c",
                "when": "session",
                "outcome": "interrupted",
                "text": stuck,
                "where": [{"file": "katas/k01_spawn.py", "line": 99, "function": "launch"}],
            },
        ],  # fmt: skip
        seconds=12.3,
    )
    digest = result.digest()
    assert f"Ctrl-C stopped test_c:\n  {stuck}" in digest, digest
    line = result.describe_interrupted()
    assert line == (
        "Interrupted after 12 s: 2 test(s) had finished (2 passed, 0 failed) and the others did "
        "not run, so k01 does not pass yet."
    ), line


def test_the_digest_speaks_the_learners_language(monkeypatch):
    monkeypatch.setenv("DOJO_LANG", "zh")
    k01 = curriculum.find("k01")
    place = {"file": "katas/k01_spawn.py", "line": 149, "function": "launch"}
    result = RunResult(
        k01,
        1,
        [
            record("test_first", message="AssertionError: one"),
            record("test_second", message="AssertionError: two", where=[place], rank=1),
            record("test_greet", **todo("k01", 2, "the greeting")),
        ],
    )
    digest = result.digest()
    assert "你的代码：katas/k01_spawn.py:149，在 launch 中（rank 1）" in digest, digest
    assert f"第 2 步 · {k01.step(2).title}" in digest and "尚未实现：" in digest, digest
    assert f"提示：{k01.step(2).hints[0][:20]}" in digest, digest
    assert "not implemented" not in digest and "your code" not in digest, digest


def test_the_first_failure_is_wrapped_like_the_others(monkeypatch):
    monkeypatch.setenv("COLUMNS", "82")
    words = " ".join(f"launched{n}" for n in range(40))
    text = f"step 2 · the greeting (tests/test_k01_spawn.py:141)\nAssertionError: {words}"
    result = RunResult(
        K01, 1, [record("test_a", text=text), record("test_b", message=f"ValueError: {words}")]
    )
    lines = result.digest().splitlines()
    assert all(len(line) <= 80 for line in lines if " " in line.strip()), "\n".join(lines)
    said = " ".join(" ".join(lines).split())
    assert f"AssertionError: {words}" in said and f"ValueError: {words}" in said, (
        "a line is cut between words, never inside one"
    )
    first = next(i for i, line in enumerate(lines) if line.startswith("  AssertionError: "))
    assert lines[first + 1].startswith("      launched"), "a cut line's rest is indented"


def test_a_kata_file_that_does_not_import_is_said_plainly():
    error = 'E     File "katas/k01_spawn.py", line 116\nE   SyntaxError: invalid syntax'
    result = RunResult(
        K01, 1, [record(f"test_global_rank[{i}]", "failed", error, when="setup") for i in range(3)]
    )
    assert "FAILED test_global_rank[1] and 1 more: the same error" in result.digest(), (
        result.digest()
    )
    assert (
        "3 could not start" in result.describe()
        and "does katas/k01_spawn.py import?" in result.describe()
    )


def test_every_failure_after_the_first_keeps_its_whole_message_with_the_advice_at_its_end():
    advice = "after the SUM all-reduce, divide by the world size, dist.get_world_size()"
    long = (
        "AssertionError: with 4 ranks: every rank holds the sum "
        + "x" * 200
        + ", not their mean: "
        + advice
    )
    result = RunResult(
        K01,
        1,
        [
            record("test_a", text="E   AssertionError: first", steps=[1]),
            {**record("test_b", text="whatever", steps=[1]), "message": long},
        ],
    )
    digest = " ".join(result.digest().split())
    assert advice in digest, f"the advice at the end of the message was cut off:\n{result.digest()}"


# ---------------------------------------------------------------- how the runner reads a command line


def _commands(parser) -> dict:
    """Every subcommand's parser by its words: ``("check",)``, ``("dev", "check")``, ..."""
    import argparse

    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[(name,)] = sub
                found.update({(name, *words): p for words, p in _commands(sub).items()})
    return found


def test_lang_and_solutions_work_before_and_after_every_command_and_its_kata():
    from dojo.runner import cli

    commands = [words for words in _commands(cli._parser()) if words != ("dev",)]
    assert ("lesson",) in commands and ("dev", "check") in commands, commands
    for words in commands:
        kata = ["k05"] if words[0] in ("check", "lesson", "hint", "goto", "run", "trace") else []
        for line in (["--lang", "zh", *words, *kata], [*words, *kata, "--lang", "zh"],
                     [*words, "--lang=zh", *kata]):  # fmt: skip
            args = cli.parse(line)
            assert args.lang == "zh", f"`dojo {' '.join(line)}` lost --lang"
            assert getattr(args, "args", []) == [], (
                f"`dojo {' '.join(line)}` gave it to the program"
            )
        if words[0] in cli.TAKE_SOLUTIONS:
            for line in (["--solutions", *words, *kata], [*words, *kata, "--solutions"]):
                args = cli.parse(line)
                assert args.solutions is True and getattr(args, "args", []) == [], line


def test_a_programs_arguments_are_its_own_but_for_dojos_options():
    from dojo.runner import cli

    def read(*line):
        args = cli.parse(list(line))
        return args.kata, args.solutions, args.args

    assert read("trace", "k09", "--solutions", "--world-size", "2") == (
        "k09",
        True,
        ["--world-size", "2"],
    )
    assert read("run", "--solutions", "k09", "--length", "8", "--lang", "zh") == (
        "k09",
        True,
        ["--length", "8"],
    )
    assert read("run", "k01", "--help") == ("k01", False, ["--help"]), (
        "after the kata: the program's help"
    )
    assert read("run", "--world-size", "2") == (None, False, ["--world-size", "2"]), (
        "the current kata"
    )
    assert read("run") == (None, False, [])
    assert read("run", "k01", "--", "--solutions", "k02") == ("k01", False, ["--solutions", "k02"])
    assert read("run", "k01", "--world-size", "2", "k02") == (
        "k01",
        False,
        ["--world-size", "2", "k02"],
    )
    traced = cli.parse(["trace", "k16", "--out", "/tmp/t", "--", "--out", "final.pt"])
    assert (traced.out, traced.args) == ("/tmp/t", ["--out", "final.pt"])
    bench = cli.parse(["bench", "ddp", "--steps", "3", "--solutions"])
    assert (bench.name, bench.solutions, bench.args) == ("ddp", True, ["--steps", "3"])
    assert cli.parse(["check", "k01", "--trace", "t"]).trace == "t"
    dev = cli.parse(["dev", "check", "k04", "--only", "consistency", "--kata", "k05"])
    assert (dev.named, dev.kata) == (["k04"], ["k05"]), "dev check takes a kata either way"


def test_run_and_trace_without_a_kata_take_the_current_one(monkeypatch):
    from dojo.runner import cli, learn, progress, trace

    seen = []
    monkeypatch.setattr(progress, "load", lambda: None)
    monkeypatch.setattr(progress, "current", lambda state: K01)
    monkeypatch.setattr(learn, "run_kata_program", lambda *a: seen.append(("run", *a)) or 0)
    monkeypatch.setattr(trace, "trace_program", lambda *a: seen.append(("trace", *a)) or 0)
    assert cli.main(["run", "--world-size", "2"]) == 0
    assert cli.main(["trace", "--solutions"]) == 0
    assert seen == [("run", K01, False, ["--world-size", "2"]), ("trace", K01, True, [], None)]


def test_a_missing_argument_or_a_misplaced_option_is_explained_in_one_line(capsys):
    from dojo.runner import cli

    for line, says in (
        (["goto"], "say which kata to make the current one"),
        (["grade"], "say whose work to grade"),
        (["bench"], "say which benchmark: allreduce"),
        (["dev"], "dev check` (the gate `make test` runs)"),
        (["lesson", "k01", "--solutions"], "--solutions (the reference instead of your katas) goes with check"),
        (["--solutions"], "not plain `"),
    ):  # fmt: skip
        assert cli.main(line) == 2, line
        err = capsys.readouterr().err
        assert err.startswith("dojo: ") and says in err and err.count("\n") == 1, (line, err)
