"""``dojo grade SUBMISSION...``: a class's katas graded against this project's own specs.

Each submission is a learner's checkout, its ``katas/`` folder, or a zip or tarball of either.
Only the learner's kata files (``katas/kNN_topic.py``) are taken, never anything else: they are
graded in a fresh copy of this project's tests, harness and curriculum, so a learner who edited
``tests/`` or ``dojo/`` gains nothing, and nothing in the submissions is changed. Every kata's
spec runs with a deadline in a session of its own, which is killed afterwards whatever happened:
a learner whose code hangs, crashes or deadlocks gets that kata failed with the reason, and the
class goes on. The result is printed as a table (each stuck learner's reason cut to a line) and
written whole as CSV, JSON, JUnit XML (one test suite per learner) and an HTML page for after the
class: its totals, each kata's pass rate, a learner x kata grid, and behind a click each learner's
first failing test, its whole message, the line of the learner's own code it failed at (the test
log's record: ``dojo.runner.testlog``) and the end of its log.
"""

from __future__ import annotations

import ast
import csv
import html
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from xml.etree import ElementTree

from dojo import curriculum
from dojo.curriculum import stubs
from dojo.harness import impl
from dojo.runner import runs, testlog
from dojo.spec.report import Place
from dojo.spec.testing import kill_session

DEFAULT_TIMEOUT_S = 600.0  # one kata's spec; k06 takes a few minutes on two busy cores


class BadSubmission(Exception):
    """A submission that cannot be graded; the message says why, for the instructor."""


SHORT_REASON = 240  # characters of a reason on the terminal; the reports hold it whole
LOG_LINES = 60  # the end of a failure's report kept in the reports


@dataclass
class KataGrade:
    kata: str
    status: str  # "passed", "failed", "not submitted"
    passed: int = 0
    total: int = 0
    first_failing_step: str = ""
    seconds: float = 0.0
    reason: str = ""  # why it fails, whole: the first failure's message (a todo: its line)
    failing_test: str = ""  # the first failing test, as the spec names it
    failed_tests: list[str] = field(default_factory=list)  # every failing test, in file order
    log: str = ""  # the end of the first failure's report (where it failed, and why)
    where: str = ""  # the first failure's line in the learner's own code (and rank), if known

    @property
    def short_reason(self) -> str:
        """The reason's first paragraph on one line, cut at a word (the terminal's; the reports
        keep it whole)."""
        line = " ".join(self.reason.split("\n\n", 1)[0].split())
        if len(line) <= SHORT_REASON:
            return line
        return line[:SHORT_REASON].rsplit(" ", 1)[0] + " ..."


@dataclass
class LearnerGrade:
    learner: str
    submission: str
    katas: list[KataGrade] = field(default_factory=list)
    problem: str = ""  # the whole submission could not be graded

    @property
    def katas_passed(self) -> int:
        return sum(1 for k in self.katas if k.status == "passed")


# ------------------------------------------------------------------------ reading a submission


def learner_name(submission: Path) -> str:
    name = submission.name
    for suffix in (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return submission.parent.name if name == "katas" and submission.is_dir() else name


def kata_files(submission: Path, unpack_to: Path) -> dict[str, str]:
    """The learner's kata sources by module name; ``BadSubmission`` when there are none."""
    if not submission.exists():
        raise BadSubmission(f"{submission} does not exist")
    if submission.is_dir():
        folder = submission
    elif zipfile.is_zipfile(submission):
        folder = _unzip(submission, unpack_to)
    elif _is_tarball(submission):
        folder = _untar(submission, unpack_to)
    else:
        raise BadSubmission(
            f"{submission.name} is neither a folder nor a readable zip or tar archive (is it corrupt?)"
        )
    found = _find_katas(folder)
    if not found:
        listed = ", ".join(f"katas/{k.module}.py" for k in curriculum.katas()[:2])
        raise BadSubmission(f"no kata files in {submission.name} (expected files such as {listed})")
    return found


def _is_tarball(path: Path) -> bool:
    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


def _unzip(archive: Path, target: Path) -> Path:
    try:
        with zipfile.ZipFile(archive) as bundle:
            for name in bundle.namelist():
                if name.startswith(("/", "\\")) or ".." in Path(name).parts:
                    raise BadSubmission(
                        f"{archive.name} holds a path outside itself ({name}): not unpacked"
                    )
            bundle.extractall(target)
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise BadSubmission(f"{archive.name} is not a readable zip archive: {error}") from None
    return target


def _untar(archive: Path, target: Path) -> Path:
    try:
        with tarfile.open(archive) as bundle:
            members = []
            for member in bundle.getmembers():
                if member.name.startswith("/") or ".." in Path(member.name).parts:
                    raise BadSubmission(
                        f"{archive.name} holds a path outside itself ({member.name})"
                    )
                if member.isfile() or member.isdir():  # no links, devices or fifos
                    members.append(member)
            bundle.extractall(target, members=members)
    except (tarfile.TarError, OSError, EOFError) as error:
        raise BadSubmission(f"{archive.name} is not a readable tar archive: {error}") from None
    return target


def _find_katas(folder: Path) -> dict[str, str]:
    """Kata files in the shallowest ``katas/`` folder, else the shallowest folder holding them."""
    modules = {k.module for k in curriculum.katas()}
    candidates = sorted(
        {
            p.parent
            for p in folder.rglob("k[0-9][0-9]_*.py")
            if p.stem in modules and "__MACOSX" not in p.parts
        },
        key=lambda p: (p.name != "katas", len(p.parts), str(p)),
    )
    if not candidates:
        return {}
    chosen = candidates[0]
    return {
        p.stem: p.read_text(encoding="utf-8", errors="replace")
        for p in sorted(chosen.glob("k[0-9][0-9]_*.py"))
        if p.stem in modules
    }


# ------------------------------------------------------------------------ grading one learner


def workspace(target: Path, learner_katas: dict[str, str]) -> None:
    """A fresh copy of this project's specs, harness and curriculum, with the learner's katas over
    the shipped stubs (a kata not submitted stays a stub)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(curriculum.ROOT / "dojo", target / "dojo", ignore=ignore)
    shutil.copytree(curriculum.ROOT / "tests", target / "tests", ignore=ignore)
    for name in ("conftest.py", "pyproject.toml"):
        shutil.copy(curriculum.ROOT / name, target / name)
    (target / "katas").mkdir()
    (target / "katas" / "__init__.py").write_text("")
    for kata in curriculum.katas():
        if kata.solution_file.exists():
            (target / "katas" / f"{kata.module}.py").write_text(stubs.stub(kata), encoding="utf-8")
    for module, source in learner_katas.items():
        (target / "katas" / f"{module}.py").write_text(source, encoding="utf-8")


def grade_kata(root: Path, kata: curriculum.Kata, submitted: bool, timeout: float) -> KataGrade:
    if not submitted:
        return KataGrade(
            kata.id, "not submitted", reason=f"no katas/{kata.module}.py in the submission"
        )
    source = (root / "katas" / f"{kata.module}.py").read_text(encoding="utf-8", errors="replace")
    try:
        ast.parse(source)
    except SyntaxError as error:
        where = f"katas/{kata.module}.py, line {error.lineno}"
        pointer = " " * max(0, (error.offset or 1) - 1) + "^"
        return KataGrade(
            kata.id,
            "failed",
            reason=f"katas/{kata.module}.py does not parse: line {error.lineno}: {error.msg}",
            log=f"{where}\n    {(error.text or '').rstrip()}\n    {pointer}\nSyntaxError: {error.msg}",
        )
    log, output = root / f".grade-{kata.id}.jsonl", root / f".grade-{kata.id}.out"
    env = {k: v for k, v in os.environ.items() if k not in (impl.ENV_VAR, impl.INSTRUMENTS_VAR)}
    env.update({testlog.ENV_VAR: str(log), "PYTHONDONTWRITEBYTECODE": "1"})
    # --tb=short: pytest's own report, every line of the message (a learner's run cuts it)
    command = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-rN", "-p", "dojo.runner.testlog",
               "-p", "no:cacheprovider", runs.spec_file(kata)]  # fmt: skip
    start = time.monotonic()
    with open(output, "wb") as printed:  # kept for a run that ends without a failure to show
        process = subprocess.Popen(
            command, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=printed,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        timed_out = False
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_session(process.pid)  # whatever it left: ranks, programs, a learner's children
            process.wait()
    seconds = time.monotonic() - start
    records = (
        [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        if log.exists()
        else []
    )
    result = runs.RunResult(kata, 1 if timed_out else process.returncode, records, seconds)
    summary = result.summary()
    grade = KataGrade(
        kata.id, "passed" if result.passed else "failed", summary["passed"],
        summary["passed"] + summary["failed"], seconds=round(seconds, 1),
    )  # fmt: skip
    if result.passed:
        return grade
    step = result.first_failing_step()
    if step is not None:
        grade.first_failing_step = runs.describe_step(kata, step)
    failures = [r for r in records if r["outcome"] == "failed"]
    grade.failed_tests = [_test_name(r) for r in failures]
    if failures:
        grade.failing_test = grade.failed_tests[0]
        grade.log = _tail(failures[0].get("text", ""))
        grade.where = _where(failures[0])
    if timed_out:
        finished = [r for r in records if r["when"] == "call"]
        grade.reason = (
            f"stopped after {timeout:g} s: the tests did not finish (a hang the harness did not "
            "catch); the last test to finish was "
            + (_test_name(finished[-1]) if finished else "none")
        )
        grade.log = _tail(output.read_text(encoding="utf-8", errors="replace"))
    else:
        grade.reason = _first_reason(result) or f"pytest exited with status {process.returncode}"
        grade.log = grade.log or _tail(output.read_text(encoding="utf-8", errors="replace"))
    return grade


def _test_name(record: dict) -> str:
    return record["test"].split("::", 1)[-1]


def _tail(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-LOG_LINES:])


def _first_reason(result: runs.RunResult) -> str:
    """The first failure's message, whole: a todo as its own line, else the exception."""
    for record in result.records:
        if record["outcome"] == "failed":
            todo = testlog.todo_of(record)
            if todo is not None and todo.kata != result.kata.id:  # it uses an earlier kata's code
                return (
                    f"{todo}: {result.kata.id}'s tests use {todo.kata}'s code, which this "
                    f"submission leaves unwritten (katas/{curriculum.find(todo.kata).module}.py)"
                )
            if todo is not None:
                return str(todo)
            return record.get("message") or record.get("text", "").strip()
    return ""


def _where(record: dict) -> str:
    """``katas/k04_allreduce.py:92, in average_gradients (rank 2)``: the learner's own line."""
    places = record.get("where") or ()
    if not places:
        return ""
    rank = f" (rank {record['rank']})" if "rank" in record else ""
    return f"{Place(**places[-1])}{rank}"


def grade_learner(submission: Path, katas: list[curriculum.Kata], timeout: float) -> LearnerGrade:
    grade = LearnerGrade(learner_name(submission), str(submission))
    with tempfile.TemporaryDirectory(prefix="dojo-grade-") as scratch:
        scratch = Path(scratch)
        try:
            files = kata_files(submission, scratch / "unpacked")
        except BadSubmission as problem:
            grade.problem = str(problem)
            return grade
        root = scratch / "project"
        root.mkdir()
        workspace(root, files)
        for kata in katas:
            grade.katas.append(grade_kata(root, kata, kata.module in files, timeout))
    return grade


# ------------------------------------------------------------------------ the class


def select(spec: str | None) -> list[curriculum.Kata]:
    """``k01-k06``, ``k02,k04``, ``4-6`` or None (every kata); KeyError names a bad one."""
    everything = list(curriculum.katas())
    if not spec:
        return everything
    chosen: list[curriculum.Kata] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        low, high = curriculum.find(first), curriculum.find(last or first)
        chosen += [k for k in everything if low.id <= k.id <= high.id and k not in chosen]
    return chosen


def grade_class(
    submissions: list[Path], katas: list[curriculum.Kata], jobs: int, timeout: float
) -> list[LearnerGrade]:
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda s: grade_learner(s, katas, timeout), submissions))


def _cell(kata: KataGrade) -> str:
    if kata.status == "not submitted":
        return "-"
    if kata.status == "failed" and kata.total == 0:
        return "broken"  # it did not parse, or no test could run
    return f"{kata.passed}/{kata.total}" + (" ok" if kata.status == "passed" else "")


def _graded(grades: list[LearnerGrade]) -> list[LearnerGrade]:
    return [g for g in grades if not g.problem]


def pass_rate(grades: list[LearnerGrade], kata_id: str) -> tuple[int, int]:
    """(learners who pass the kata, learners graded)."""
    graded = _graded(grades)
    passed = sum(1 for g in graded for k in g.katas if k.kata == kata_id and k.status == "passed")
    return passed, len(graded)


def table(grades: list[LearnerGrade], katas: list[curriculum.Kata]) -> str:
    rows = [[g.learner, *(_cell(k) for k in g.katas), f"{g.katas_passed} of {len(katas)}"]
            for g in grades if not g.problem]  # fmt: skip
    rates = [pass_rate(grades, k.id) for k in katas]
    footer = ["passed by", *(f"{n}/{total}" for n, total in rates), ""]
    width = max(len(r[0]) for r in [["learner"], footer, *rows])
    cells = [max([7, *(len(r[i + 1]) for r in [footer, *rows])]) for i in range(len(katas))]

    def line(row: list[str]) -> str:
        middle = "  ".join(f"{c:>{w}}" for c, w in zip(row[1:-1], cells))
        return f"{row[0]:<{width}}  {middle}  {row[-1]}".rstrip()

    lines = [line(["learner", *(k.id for k in katas), "katas passed"])]
    for grade in grades:
        if grade.problem:
            lines.append(f"{grade.learner:<{width}}  not graded: {grade.problem}")
        else:
            lines.append(line(rows.pop(0)))
    lines.append(line(footer))
    details = [
        f"  {g.learner} {k.kata}: "
        + (f"{k.first_failing_step}: " if k.first_failing_step else "")
        + k.short_reason
        for g in grades
        for k in g.katas
        if k.status == "failed"
    ]
    return "\n".join(lines + (["", "where each one is stuck:", *details] if details else []))


def write_reports(
    grades: list[LearnerGrade], katas: list[curriculum.Kata], folder: Path
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"grades.{ext}" for ext in ("csv", "json", "xml", "html")]
    columns = ["learner", "kata", "status", "passed", "total", "first_failing_step", "seconds",
               "reason", "failing_test", "where", "failed_tests", "log"]  # fmt: skip
    with open(paths[0], "w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(columns)
        for g in grades:
            if g.problem:
                writer.writerow(
                    [g.learner, "", "not graded", 0, 0, "", 0, g.problem, "", "", "", ""]
                )
            for k in g.katas:
                row = {**asdict(k), "learner": g.learner, "failed_tests": " ".join(k.failed_tests)}
                writer.writerow([row[c] for c in columns])
    paths[1].write_text(json.dumps([asdict(g) for g in grades], indent=2) + "\n", encoding="utf-8")
    paths[2].write_text(_junit(grades), encoding="utf-8")
    paths[3].write_text(report_html(grades, katas), encoding="utf-8")
    return paths


def _junit(grades: list[LearnerGrade]) -> str:
    suites = ElementTree.Element("testsuites", name="torch-dist-katas")
    for g in grades:
        failures = sum(1 for k in g.katas if k.status == "failed")
        suite = ElementTree.SubElement(
            suites, "testsuite", name=g.learner, tests=str(max(1, len(g.katas))),
            failures=str(failures), errors="1" if g.problem else "0",
            skipped=str(sum(1 for k in g.katas if k.status == "not submitted")),
            time=f"{sum(k.seconds for k in g.katas):.1f}",
        )  # fmt: skip
        if g.problem:
            case = ElementTree.SubElement(suite, "testcase", classname=g.learner, name="submission")
            ElementTree.SubElement(case, "error", message=g.problem)
        for k in g.katas:
            case = ElementTree.SubElement(
                suite, "testcase", classname=g.learner, name=k.kata, time=f"{k.seconds:.1f}"
            )
            ElementTree.SubElement(case, "system-out").text = f"{k.passed} of {k.total} tests pass"
            if k.status == "not submitted":
                ElementTree.SubElement(case, "skipped", message=k.reason)
            elif k.status != "passed":
                failure = ElementTree.SubElement(
                    case, "failure", message=f"{k.first_failing_step}: {k.reason}".strip(": "),
                    type=k.failing_test or "kata",
                )  # fmt: skip
                failure.text = k.log  # a failure's body is its trace, as JUnit readers show it
    ElementTree.indent(suites)
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        + ElementTree.tostring(suites, encoding="unicode")
        + "\n"
    )


def _css_class(kata: KataGrade) -> str:
    if kata.status == "passed":
        return "ok"
    if kata.status == "not submitted":
        return "none"
    return "part" if kata.passed else "bad"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _bar(part: int, whole: int) -> str:
    width = 100 * part / whole if whole else 0
    return (
        f"<span class='bar' title='{_percent(part, whole)}'>"
        f"<span style='width:{width:.0f}%'></span></span>"
    )


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def report_html(grades: list[LearnerGrade], katas: list[curriculum.Kata]) -> str:
    """One self-contained page (no external assets): class totals, each kata's pass rate and where
    the class is stuck, a learner x kata grid, and each learner's detail behind a click."""
    graded = _graded(grades)
    titles = {k.id: k.title for k in katas}
    cells_total = len(graded) * len(katas)
    passed_total = sum(g.katas_passed for g in graded)
    tests = (
        sum(k.passed for g in graded for k in g.katas),
        sum(k.total for g in graded for k in g.katas),
    )
    every = [g.learner for g in graded if katas and g.katas_passed == len(katas)]
    counts = sorted(g.katas_passed for g in graded)
    median = (counts[(len(counts) - 1) // 2] + counts[len(counts) // 2]) / 2 if counts else 0
    unread = len(grades) - len(graded)
    cards = [
        ("learners graded", f"{len(graded)}", f"{unread} not graded" if unread else "every submission read"),
        ("katas passed", f"{passed_total} of {cells_total}", f"{_percent(passed_total, cells_total)} of learner x kata"),
        ("tests passed", f"{tests[0]} of {tests[1]}", _percent(*tests)),
        ("passed every kata", f"{len(every)}", ", ".join(every) or "nobody yet"),
        ("median learner", f"{median:g} of {len(katas)}", "katas passed"),
    ]  # fmt: skip
    totals = "".join(
        f"<div class='card'><div class='label'>{_e(label)}</div><div class='big'>{_e(value)}</div>"
        f"<div class='small'>{_e(note)}</div></div>"
        for label, value, note in cards
    )

    per_kata = []
    for kata in katas:
        passed, of = pass_rate(grades, kata.id)
        mine = [k for g in graded for k in g.katas if k.kata == kata.id]
        stuck: dict[str, int] = {}
        for k in mine:
            if k.status == "failed":
                where = k.first_failing_step or ("broken" if k.total == 0 else "failing")
                stuck[where] = stuck.get(where, 0) + 1
        missing = sum(1 for k in mine if k.status == "not submitted")
        notes = [
            f"{_e(where)} <b>×{n}</b>"
            for where, n in sorted(stuck.items(), key=lambda i: (-i[1], i[0]))
        ]
        notes += [f"not submitted <b>×{missing}</b>"] if missing else []
        kata_tests = (sum(k.passed for k in mine), sum(k.total for k in mine))
        per_kata.append(
            f"<tr><th>{kata.id}</th><td class='title'>{_e(kata.title)}</td>"
            f"<td class='num'>{passed} of {of}</td><td class='num'>{_percent(passed, of)}</td>"
            f"<td>{_bar(passed, of)}</td><td class='num'>{_percent(*kata_tests)}</td>"
            f"<td class='stuck'>{'<br>'.join(notes) or '-'}</td></tr>"
        )

    head = "".join(f"<th title='{_e(k.title)}'>{k.id}</th>" for k in katas)
    rows = []
    for i, g in enumerate(grades):
        name = f"<th class='who'><a href='#g{i}'>{_e(g.learner)}</a></th>"
        if g.problem:
            rows.append(f"<tr>{name}<td class='bad problem' colspan='{len(katas) + 1}'>"
                        f"not graded: {_e(g.problem)}</td></tr>")  # fmt: skip
            continue
        cells = "".join(
            f"<td class='{_css_class(k)}' title='{_e(_tip(k))}'>"
            f"<a href='#g{i}-{k.kata}'>{_e(_cell(k))}</a></td>"
            for k in g.katas
        )
        rows.append(f"<tr>{name}{cells}<td class='num'>{g.katas_passed} of {len(katas)}</td></tr>")
    rates = "".join(f"<td class='num'>{_percent(*pass_rate(grades, k.id))}</td>" for k in katas)
    rows.append(f"<tr class='foot'><th>passed by</th>{rates}"
                f"<td class='num'>{_percent(passed_total, cells_total)}</td></tr>")  # fmt: skip

    learners = "".join(_learner_html(i, g, titles, len(katas)) for i, g in enumerate(grades))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>torch-dist-katas: grades {time.strftime("%Y-%m-%d")}</title>
<style>{_STYLE}</style></head><body>
<h1>torch-dist-katas: grades</h1>
<p class="meta">{len(grades)} submission(s), graded {time.strftime("%Y-%m-%d %H:%M")} on
{", ".join(k.id for k in katas)} against this project's own specs (never the learners' own
tests or tooling).</p>
<h2>The class</h2><div class="cards">{totals}</div>
<h2>Each kata</h2>
<table class="katas"><thead><tr><th>kata</th><th>title</th><th>passed by</th>
<th colspan="2">pass rate</th><th>tests passed</th>
<th>where the others are stuck (first failing step)</th></tr></thead><tbody>
{"".join(per_kata)}</tbody></table>
<h2>Learners x katas</h2>
<p class="legend"><span class="ok">8/8 ok</span> passes · <span class="part">5/8</span> some
tests pass · <span class="bad">0/8</span> none pass · <span class="bad">broken</span> does not
parse · <span class="none">-</span> not submitted. Click a cell: the failing test, its whole
message, the learner's line it failed at and the end of its log.</p>
<div class="scroll"><table class="grid"><thead><tr><th>learner</th>{head}<th>katas passed</th>
</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table></div>
<h2>Each learner <button type="button" onclick="openAll(true)">open all</button>
<button type="button" onclick="openAll(false)">close all</button></h2>
{learners}
<script>{_SCRIPT}</script>
</body></html>
"""


def _tip(kata: KataGrade) -> str:
    if kata.status == "passed":
        return f"every test passes ({kata.seconds:g} s)"
    return f"{kata.first_failing_step}: {kata.short_reason}".strip(": ") or kata.status


def _learner_html(index: int, grade: LearnerGrade, titles: dict[str, str], count: int) -> str:
    if grade.problem:
        return (
            f"<details class='learner' id='g{index}'><summary><b>{_e(grade.learner)}</b> "
            f"<span class='bad'>not graded</span></summary><p>{_e(grade.problem)}</p>"
            f"<p class='small'>submission: <code>{_e(grade.submission)}</code></p></details>\n"
        )
    parts = []
    for k in grade.katas:
        anchor, title = f"g{index}-{k.kata}", _e(titles.get(k.kata, ""))
        if k.status != "failed":
            said = (
                f"every test passes ({k.total}, {k.seconds:g} s)"
                if k.status == "passed"
                else _e(k.reason)
            )
            parts.append(
                f"<div class='kata {_css_class(k)}' id='{anchor}'><b>{k.kata}</b> {title}: {said}</div>"
            )
            continue
        facts = [("first failing step", _e(k.first_failing_step or "-"))]
        if k.failing_test:
            facts.append(("first failing test", f"<code>{_e(k.failing_test)}</code>"))
        if k.where:
            facts.append(("in their code", f"<code>{_e(k.where)}</code>"))
        facts.append(("why", f"<pre class='reason'>{_e(k.reason)}</pre>"))
        others = k.failed_tests[1:]
        if others:
            listed = (
                "<div class='tests'>" + " ".join(f"<code>{_e(t)}</code>" for t in others) + "</div>"
            )
            facts.append((f"also failing ({len(others)})", listed))
        if k.log:
            facts.append(("the log's end", f"<pre class='log'>{_e(k.log)}</pre>"))
        facts.append(("time", f"{k.seconds:g} s"))
        body = "".join(f"<dt>{label}</dt><dd>{value}</dd>" for label, value in facts)
        parts.append(
            f"<details class='kata {_css_class(k)}' id='{anchor}'><summary><b>{k.kata}</b> "
            f"{title}: {_e(_cell(k))} · {_e(k.first_failing_step or k.short_reason)}</summary>"
            f"<dl>{body}</dl></details>"
        )
    stuck = ", ".join(
        f"{k.kata} ({k.first_failing_step.split(' · ')[0] or _cell(k)})" if k.first_failing_step
        else f"{k.kata} ({_cell(k)})"
        for k in grade.katas
        if k.status == "failed"
    )  # fmt: skip
    return (
        f"<details class='learner' id='g{index}'><summary><b>{_e(grade.learner)}</b> "
        f"{grade.katas_passed} of {count} katas {_bar(grade.katas_passed, count)}"
        + (f" <span class='small'>stuck: {_e(stuck)}</span>" if stuck else "")
        + "</summary>"
        f"<p class='small'>submission: <code>{_e(grade.submission)}</code></p>"
        f"{''.join(parts)}</details>\n"
    )


_STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em 2em;
       color: #1f2328; }
h1 { margin: 0 0 .2em; }
h2 { margin-top: 1.6em; border-bottom: 1px solid #d0d7de; padding-bottom: .2em; }
h2 button { font-size: 12px; margin-left: .6em; vertical-align: middle; }
.meta, .small, .legend { color: #59636e; } .small { font-size: 13px; }
.cards { display: flex; flex-wrap: wrap; gap: .8em; }
.card { border: 1px solid #d0d7de; border-radius: 8px; padding: .6em 1em; min-width: 11em;
        background: #f6f8fa; }
.card .label { font-size: 13px; color: #59636e; } .card .big { font-size: 24px; font-weight: 600; }
table { border-collapse: collapse; } th, td { border: 1px solid #d0d7de; padding: .3em .6em; }
table.katas td.title { text-align: left; } td.num { text-align: right; white-space: nowrap; }
td.stuck { font-size: 13px; text-align: left; }
.scroll { overflow-x: auto; } table.grid td { text-align: center; white-space: nowrap; }
table.grid th.who { text-align: left; }
table.grid a { color: inherit; text-decoration: none; display: block; }
table.grid tr.foot th, table.grid tr.foot td { background: #f6f8fa; font-weight: 600; }
td.problem { text-align: left !important; white-space: normal !important; }
.ok { background: #dafbe1; color: #116329; } .part { background: #fff8c5; color: #7d4e00; }
.bad { background: #ffebe9; color: #a40e26; } .none { color: #8c959f; }
.legend span { padding: 0 .3em; border-radius: 3px; }
.bar { display: inline-block; width: 7em; height: .7em; background: #eaeef2; border-radius: 4px;
       vertical-align: middle; overflow: hidden; }
.bar span { display: block; height: 100%; background: #2da44e; }
details.learner { border: 1px solid #d0d7de; border-radius: 6px; margin: .4em 0; padding: .3em .8em; }
details.learner > summary { cursor: pointer; font-size: 16px; }
.kata { margin: .35em 0 .35em 1em; padding: .25em .6em; border-radius: 4px; }
details.kata > summary { cursor: pointer; }
details.kata[open] { background: #fff; border: 1px solid #d0d7de; color: #1f2328; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: .3em 1em; margin: .6em 0; }
dt { font-weight: 600; color: #59636e; } dd { margin: 0; min-width: 0; }
.tests code { display: inline-block; margin-right: 1.2em; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; margin: 0; font-size: 13px; }
pre.reason { background: #fff5f5; padding: .4em .6em; border-left: 3px solid #cf222e; }
pre.log { background: #f6f8fa; padding: .4em .6em; max-height: 28em; overflow: auto; }
:target { outline: 2px solid #0969da; }
@media print { button { display: none; } }
"""

# A cell's link opens the learner's detail and the kata's in it (a closed <details> hides its
# target); the buttons open or close every detail at once.
_SCRIPT = """
function reveal() {
  const target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
  for (let node = target; node; node = node.parentElement)
    if (node.tagName === 'DETAILS') node.open = true;
  if (target) target.scrollIntoView({block: 'start'});
}
function openAll(open) { document.querySelectorAll('details').forEach(d => { d.open = open; }); }
addEventListener('hashchange', reveal);
addEventListener('DOMContentLoaded', reveal);
"""


def grade(
    submissions: list[str], katas_spec: str | None, jobs: int, timeout: float, out: str | None
) -> int:
    katas = select(katas_spec)
    paths = [Path(s) for s in submissions]
    started = time.monotonic()
    print(
        f"grading {len(paths)} submission(s) on {', '.join(k.id for k in katas)} with {jobs} job(s)...",
        flush=True,
    )
    grades = grade_class(paths, katas, jobs, timeout)
    print(table(grades, katas))
    folder = Path(out) if out else Path(f"grades-{time.strftime('%Y%m%d-%H%M%S')}")
    written = write_reports(grades, katas, folder)
    print(f"\nwritten in {time.monotonic() - started:.0f} s: " + ", ".join(str(p) for p in written))
    if any(k.status == "failed" for g in grades for k in g.katas):
        print(
            f"each reason whole, the failing tests and the end of their logs: open {written[3]} "
            "(click a cell), or read the CSV, JSON or XML"
        )
    return 0
