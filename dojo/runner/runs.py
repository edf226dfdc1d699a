"""Running one kata's tests for the learner, and telling them what happened.

pytest prints a line of progress; the outcomes come back through ``dojo.runner.testlog``, and the
runner renders them, in the learner's language: the first real failure in full, one line for
each other one with the learner's own line, the steps not written yet with the first one's hint,
the first failing step (``dojo.curriculum.steps``), and where the ranks waited when Ctrl-C
stopped the run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from dojo import curriculum
from dojo.commands import dojo, python
from dojo.curriculum import steps
from dojo.harness import impl
from dojo.lang import t, tn
from dojo.runner import progress, testlog
from dojo.runner.term import display_width, wrap
from dojo.spec.report import Place
from dojo.todo import KataTodo

PYTEST_EXIT_NO_TESTS = 5


@dataclass
class RunResult:
    kata: curriculum.Kata
    returncode: int
    records: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    output: str = ""  # only when captured
    fingerprint: str = ""  # of the files the run tested, taken before it started
    state: progress.State | None = None  # the progress file as recording this run left it

    @property
    def passed(self) -> bool:
        return self.returncode == 0

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.records if r["when"] == "call" and r["outcome"] == outcome)

    @property
    def not_run(self) -> int:
        """Tests the session did not run after it stopped at the first deadlock."""
        return sum(r.get("left", 0) for r in self.records if r["when"] == "session")

    @property
    def broken(self) -> list[dict]:
        """Failures outside a test's body: the file did not import, a fixture failed."""
        return [r for r in self.records if r["outcome"] == "failed" and r["when"] != "call"]

    @property
    def interruption(self) -> dict | None:
        """What Ctrl-C stopped: the test, and where its ranks waited."""
        return next((r for r in self.records if r["outcome"] == "interrupted"), None)

    @functools.cached_property
    def failing_steps(self) -> list[int]:
        found = set()
        for record in self.records:
            if record["outcome"] == "failed":
                todo = testlog.todo_of(record)
                found |= steps.of_failure(self.kata.id, todo, record.get("steps", ()))
        return sorted(found)

    def first_failing_step(self) -> int | None:
        return self.failing_steps[0] if self.failing_steps else None

    def summary(self) -> dict:
        return {
            "passed": self.count("passed"),
            "failed": self.count("failed") + len(self.broken),
            "skipped": self.count("skipped"),
            "step": self.first_failing_step(),
            "exit": self.returncode,
        }

    def digest(self, shown: int = 6) -> str:
        """The failures, for a learner: the first real one in full (where, and the message), one
        line for each other with the learner's own line, the steps not written yet counted (the
        first one with where to write it and its hint), and what Ctrl-C stopped."""
        real, todos = [], {}
        for record in self.records:
            todo = testlog.todo_of(record)
            if todo is not None and record["when"] == "call":
                todos.setdefault((todo.kata, todo.step), []).append(todo)
            elif record["outcome"] == "failed":
                real.append(record)
        lines = _failures(real, shown)
        if todos:
            lines += _todos(self.kata, todos)
        if self.not_run:
            lines += _wrapped(
                t(
                    "Stopped at that deadlock: the {count} test(s) after it did not run (most would wait for the same one). Fix it, then run the tests again.",
                    count=self.not_run,
                )
            )
        if self.interruption is not None:
            lines += _interrupted(self.interruption)
        if real or todos:
            lines.append(
                t(
                    "(every failure in full: {command})",
                    command=f"{python()} -m pytest {spec_file(self.kata)}",
                )
            )
        return "\n".join(lines)

    def describe(self) -> str:
        """One line for the learner: how many tests pass, and what fails first."""
        k = self.kata
        if self.passed:
            skipped = len({r["test"] for r in self.records if r["outcome"] == "skipped"})
            return t(
                "{kata} passes: all {count} tests{skipped} in {seconds} s.", kata=k.id, count=self.count("passed"), seconds=f"{self.seconds:.0f}",
                skipped=t(" ({count} skipped)", count=skipped) if skipped else "",
            )  # fmt: skip
        if self.returncode == PYTEST_EXIT_NO_TESTS:
            return t("{kata}: pytest found no tests in {file}.", kata=k.id, file=spec_file(k))
        skipped = {r["test"] for r in self.records if r["outcome"] == "skipped"}
        ran = {r["test"] for r in self.records if r["when"] not in ("collect", "session")}
        total = len(ran - skipped) + self.not_run
        line = t(
            "{kata}: {passed} of {total} tests pass{skipped}", kata=k.id, passed=self.count("passed"), total=total,
            skipped=t(" ({count} skipped)", count=len(skipped)) if skipped else "",
        )  # fmt: skip
        if self.broken:
            line += t(
                "; {count} could not start (the error above: does {file} import?)",
                count=len(self.broken),
                file=f"katas/{k.module}.py",
            )
        step = self.first_failing_step()
        if step is not None and not self.broken:
            line += t(". First failing step: {step}", step=describe_step(k, step))
        # TRANSLATORS: the end of that sentence (a Chinese one ends with its own full stop)
        return line + t(".")

    def describe_interrupted(self) -> str:
        """One line after Ctrl-C: how far the run got, and that it did not finish."""
        finished = {r["test"] for r in self.records if r["when"] == "call"}
        return t(
            "Interrupted after {seconds} s: {count} test(s) had finished ({passed} passed, "
            "{failed} failed) and the others did not run, so {kata} does not pass yet.",
            seconds=f"{self.seconds:.0f}", count=len(finished), kata=self.kata.id,
            passed=self.count("passed"), failed=self.count("failed"),
        )  # fmt: skip


def _failures(real: list[dict], shown: int) -> list[str]:
    """The first failure whole, as the learner's report wrote it; each other on a line (those
    with the same message together) with the learner's own line."""
    if not real:
        return []
    first, lines = real[0], []
    # TRANSLATORS: pytest's word for a failed test; {test} is the test's name
    failed = t("FAILED {test}", test=_name(first))
    lines.append(failed + (f" ({first['when']})" if first["when"] != "call" else ""))
    for line in first.get("text", "").rstrip().splitlines():
        lines += _wrapped("  " + line)
    groups: dict[str, list[dict]] = {}
    for record in real[1:]:
        groups.setdefault(_message(record), []).append(record)
    for message, records in list(groups.items())[:shown]:
        more = t(" and {count} more", count=len(records) - 1) if len(records) > 1 else ""
        failed = t("FAILED {test}", test=_name(records[0])) + more
        if message == _message(first):
            lines.append(f"{failed}: " + t("the same error"))
        else:  # the whole message: its end is often the advice
            lines += _wrapped(f"{failed}: {message}")
        where = _where(records[0])  # the first's is in its text already
        if where and (message != _message(first) or where != _where(first)):
            lines += _wrapped("    " + where)
    if len(groups) > shown:
        lines.append(t("... and more failing tests with other errors"))
    return lines


def _where(record: dict) -> str:
    """The learner's own line of a failure, and the rank it failed on (where known)."""
    places = record.get("where") or ()
    if not places:
        return ""
    said = t("your code: {place}", place=Place(**places[-1]))
    return said + (t(" (rank {rank})", rank=record["rank"]) if "rank" in record else "")


def _todos(kata: curriculum.Kata, todos: dict[tuple[str, int], list[KataTodo]]) -> list[str]:
    """The steps not written yet, each with its tests counted; the first with where to write it
    and the gentlest hint (a kata whose tests use an earlier kata's code may stop at that one's)."""
    lines = [t("not implemented yet:")]
    for (kata_id, number), found in sorted(todos.items()):
        owner = kata if kata_id == kata.id else curriculum.find(kata_id)
        step = describe_step(owner, number)
        if owner.id != kata.id:
            step = f"{owner.id} {step}"
        # the todos' own words, where they say more than the step's title (they are English)
        whats = sorted({todo.what for todo in found} - {"", _english_title(owner, number)})
        if whats:
            step += t(" (also: {whats})", whats="; ".join(whats))
        counted = tn("{count} test", "{count} tests", len(found))
        lines.append(t("  {step}: {counted}", step=step, counted=counted))
        if owner.id != kata.id:
            lines.append(
                "    "
                + t(
                    "({kata}'s tests use {other}'s code: write that step first)",
                    kata=kata.id,
                    other=owner.id,
                )
            )
    kata_id, number = min(todos)  # an earlier kata's step first: this one's tests need it
    owner = curriculum.find(kata_id)
    lines.append(
        t(
            "  -> write step {step} in {file} (its lesson explains it)",
            step=number,
            file=f"katas/{owner.module}.py",
        )
    )
    with contextlib.suppress(KeyError, IndexError):
        hint = owner.step(number).hints[0]
        lines += _wrapped(
            t("  hint: {hint}  (more: {more})", hint=hint, more=f"{dojo()} hint {owner.id}")
        )
    return lines


def _english_title(kata: curriculum.Kata, number: int) -> str:
    english = next(k for k in curriculum.katas("en") if k.id == kata.id)
    return next((s.title for s in english.steps if s.number == number), "")


def _interrupted(record: dict) -> list[str]:
    """What Ctrl-C stopped, and where its ranks waited (the harness's report, as a program's)."""
    lines = [t("Ctrl-C stopped {test}:", test=_name(record) or "?")]
    for line in record.get("text", "").rstrip().splitlines():
        lines += _wrapped("  " + line)
    where = _where(record)
    if where:
        lines += _wrapped("  " + where.strip())
    return lines


def _name(record: dict) -> str:
    return record["test"].split("::", 1)[-1]


def _message(record: dict) -> str:
    """A failure's message on one line: the exception's first line (the log holds it whole)."""
    message = record.get("message") or (record.get("text", "").strip().splitlines() or [""])[-1]
    return (message.strip().splitlines() or [""])[0]


def _wrapped(line: str, more: str = "    ") -> list[str]:
    """A line cut at spaces to the terminal's width (never inside a word or an identifier), its
    continuations indented ``more`` beyond its own indentation."""
    width = max(60, shutil.get_terminal_size((100, 24)).columns - 2)
    if display_width(line) <= width:
        return [line]
    indent = line[: len(line) - len(line.lstrip())]
    first, *rest = wrap(line.strip(), width=width - len(indent) - len(more))
    return [indent + first, *(indent + more + piece for piece in rest)]


def describe_step(kata: curriculum.Kata, number: int) -> str:
    try:
        return t("step {number} · {title}", number=number, title=kata.step(number).title)
    except KeyError:
        return t("step {number}", number=number)


def spec_file(kata: curriculum.Kata) -> str:
    """The kata's spec, as a learner types it: ``tests/test_kNN_topic.py``."""
    return kata.relative(kata.test_file)


def pytest_command(kata: curriculum.Kata, solutions: bool = False) -> list[str]:
    # pytest shows a line of progress; the runner then shows a digest of the failures it logged
    args = [sys.executable, "-m", "pytest", "-q", "--tb=no", "-rN", "-p", "dojo.runner.testlog"]
    if solutions:
        args.append("--solutions")
    return [*args, spec_file(kata)]


def _forget_bytecode(kata: curriculum.Kata) -> None:
    """Drop Python's cached compile of the learner's kata file. Python reuses it while the
    file's size and the second of its last change are unchanged, so a save within the second
    after a run compiled the file (``VALUE = 2`` to ``VALUE = 1``: an editor's quick saves,
    ``dojo watch`` starting a run on each) would run the code as it was before."""
    cached = importlib.util.cache_from_source(str(kata.kata_file))
    with contextlib.suppress(OSError):
        os.unlink(cached)


class Running:
    """A kata's tests running in the background (``dojo watch`` keeps listening meanwhile)."""

    def __init__(self, kata: curriculum.Kata, solutions: bool = False, capture: bool = False):
        self.kata, self.started = kata, time.monotonic()
        # what the run tests, before it starts: a save during the run is not the code it tested
        self.fingerprint = progress.fingerprint(kata)
        _forget_bytecode(kata)
        handle, self.log = tempfile.mkstemp(prefix="dojo-run-", suffix=".jsonl")
        os.close(handle)
        env = {k: v for k, v in os.environ.items() if k != impl.ENV_VAR}  # the learner's katas/
        env[testlog.ENV_VAR] = self.log
        env[testlog.STOP_VAR] = "1"  # a deadlock is reported in seconds, not after minutes
        self.process = subprocess.Popen(
            pytest_command(kata, solutions),
            cwd=curriculum.ROOT,
            env=env,
            # its own session: the runner can stop pytest and everything it started, and the
            # terminal's Ctrl-C reaches the runner, which does that
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            text=capture,
        )

    def done(self) -> bool:
        return self.process.poll() is not None

    def result(self) -> RunResult:
        """Wait for the end (reading the output as it comes, if captured) and read the outcomes."""
        output = self.process.communicate()[0] or ""
        _signal_group(
            self.process.pid, getattr(signal, "SIGKILL", signal.SIGTERM)
        )  # anything it left
        records = self._read_log()
        seconds = time.monotonic() - self.started
        return RunResult(
            self.kata, self.process.returncode, records, seconds, output, self.fingerprint
        )

    def stop(self) -> list[dict]:
        """Interrupt pytest (it tears its worlds down), then kill whatever is left of its group;
        the outcomes of the tests that had finished (a second Ctrl-C meanwhile kills at once)."""
        try:
            if self.process.poll() is None:
                _signal_group(self.process.pid, signal.SIGINT)
                try:
                    self.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            _signal_group(self.process.pid, getattr(signal, "SIGKILL", signal.SIGTERM))
            self.process.wait()
        return self._read_log()

    def _read_log(self) -> list[dict]:
        try:
            with open(self.log, encoding="utf-8") as log:
                return [json.loads(line) for line in log if line.strip()]
        except (OSError, ValueError):
            return []
        finally:
            if os.path.exists(self.log):
                os.unlink(self.log)


def _signal_group(pid: int, sig: int) -> None:
    if not hasattr(os, "killpg"):  # pragma: no cover - Windows: no process groups; end the tree
        subprocess.call(
            ["taskkill", "/F", "/T", "/PID", str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a kata's tests; ``result`` holds the outcomes of those that had finished."""

    def __init__(self, result: RunResult):
        super().__init__()
        self.result = result


def run_kata(kata: curriculum.Kata, solutions: bool = False, capture: bool = False) -> RunResult:
    """Run a kata's tests to the end (Ctrl-C stops them, and everything they started, and
    raises ``Interrupted`` with what they had found)."""
    running = Running(kata, solutions, capture)
    try:
        return running.result()
    except KeyboardInterrupt:
        records = running.stop()
        seconds = time.monotonic() - running.started
        raise Interrupted(RunResult(kata, 130, records, seconds, "", running.fingerprint)) from None
