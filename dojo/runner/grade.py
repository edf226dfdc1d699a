"""``dojo grade SUBMISSION...``: a class's katas graded against this project's own specs.

Each submission is a learner's checkout, its ``katas/`` folder, or a zip or tarball of either.
Only the learner's kata files (``katas/kNN_topic.py``) are taken, never anything else: they are
graded in a fresh copy of this project's tests, harness and curriculum, so a learner who edited
``tests/`` or ``dojo/`` gains nothing, and nothing in the submissions is changed. Every kata's
spec runs with a deadline in a session of its own, which is killed afterwards whatever happened:
a learner whose code hangs, crashes or deadlocks gets that kata failed with the reason, and the
class goes on. The result is printed as a table and written as CSV, JSON, JUnit XML (one test
suite per learner) and an HTML page.
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

from dojo import curriculum, impl
from dojo.runner import runs, testlog
from dojo.testing import kill_session
from dojo.todo import TODO_PATTERN

DEFAULT_TIMEOUT_S = 600.0  # one kata's spec; k06 takes a few minutes on two busy cores


class BadSubmission(Exception):
    """A submission that cannot be graded; the message says why, for the instructor."""


@dataclass
class KataGrade:
    kata: str
    status: str  # "passed", "failed", "not submitted"
    passed: int = 0
    total: int = 0
    first_failing_step: str = ""
    seconds: float = 0.0
    reason: str = ""


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
        if kata.pristine_file.exists():
            shutil.copy(kata.pristine_file, target / "katas" / f"{kata.module}.py")
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
        return KataGrade(
            kata.id,
            "failed",
            reason=f"katas/{kata.module}.py does not parse: line {error.lineno}: {error.msg}",
        )
    log = root / f".grade-{kata.id}.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in (impl.ENV_VAR, impl.SUBSTITUTE_VAR)}
    env.update({testlog.ENV_VAR: str(log), "PYTHONDONTWRITEBYTECODE": "1"})
    command = [sys.executable, "-m", "pytest", "-q", "--tb=no", "-rN", "-p", "dojo.runner.testlog",
               "-p", "no:cacheprovider", runs.spec_file(kata)]  # fmt: skip
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
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
    step = result.first_failing_step()
    if step is not None and not result.passed:
        grade.first_failing_step = runs.describe_step(kata, step)
    if timed_out:
        grade.reason = f"stopped after {timeout:g} s: the tests did not finish (a hang the harness did not catch)"
    elif not result.passed:
        grade.reason = _first_reason(result) or f"pytest exited with status {process.returncode}"
    return grade


def _first_reason(result: runs.RunResult) -> str:
    """The first failure's message, short: a todo as its own line, anything else cut at a word."""
    for record in result.records:
        if record["outcome"] == "failed":
            todo = TODO_PATTERN.search(record["text"]) or TODO_PATTERN.search(
                record.get("message", "")
            )
            if todo:
                return todo.group(0)
            message = " ".join((record.get("message") or record["text"].strip()).split())
            return message if len(message) <= 240 else message[:240].rsplit(" ", 1)[0] + " ..."
    return ""


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


def table(grades: list[LearnerGrade], katas: list[curriculum.Kata]) -> str:
    width = max([len("learner"), *(len(g.learner) for g in grades)])
    lines = [f"{'learner':<{width}}  " + "  ".join(f"{k.id:>7}" for k in katas) + "  katas passed"]
    for grade in grades:
        if grade.problem:
            lines.append(f"{grade.learner:<{width}}  not graded: {grade.problem}")
            continue
        cells = []
        for kata in grade.katas:
            cell = "-" if kata.status == "not submitted" else f"{kata.passed}/{kata.total}"
            cells.append(f"{cell + (' ok' if kata.status == 'passed' else ''):>7}")
        lines.append(
            f"{grade.learner:<{width}}  "
            + "  ".join(cells)
            + f"  {grade.katas_passed} of {len(katas)}"
        )
    details = [
        f"  {g.learner} {k.kata}: "
        + (f"{k.first_failing_step}: " if k.first_failing_step else "")
        + k.reason
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
    with open(paths[0], "w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(
            [
                "learner",
                "kata",
                "status",
                "passed",
                "total",
                "first_failing_step",
                "seconds",
                "reason",
            ]
        )
        for g in grades:
            if g.problem:
                writer.writerow([g.learner, "", "not graded", 0, 0, "", 0, g.problem])
            for k in g.katas:
                writer.writerow(
                    [
                        g.learner,
                        k.kata,
                        k.status,
                        k.passed,
                        k.total,
                        k.first_failing_step,
                        k.seconds,
                        k.reason,
                    ]
                )
    paths[1].write_text(json.dumps([asdict(g) for g in grades], indent=2) + "\n", encoding="utf-8")
    paths[2].write_text(_junit(grades), encoding="utf-8")
    paths[3].write_text(_html(grades, katas), encoding="utf-8")
    return paths


def _junit(grades: list[LearnerGrade]) -> str:
    suites = ElementTree.Element("testsuites", name="torch-dist-katas")
    for g in grades:
        failures = sum(1 for k in g.katas if k.status != "passed")
        suite = ElementTree.SubElement(
            suites, "testsuite", name=g.learner, tests=str(max(1, len(g.katas))),
            failures=str(failures), errors="1" if g.problem else "0",
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
                ElementTree.SubElement(
                    case, "failure", message=f"{k.first_failing_step}: {k.reason}".strip(": ")
                )
    ElementTree.indent(suites)
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        + ElementTree.tostring(suites, encoding="unicode")
        + "\n"
    )


def _html(grades: list[LearnerGrade], katas: list[curriculum.Kata]) -> str:
    head = "".join(f"<th title='{html.escape(k.title)}'>{k.id}</th>" for k in katas)
    rows = []
    for g in grades:
        if g.problem:
            rows.append(f"<tr><th>{html.escape(g.learner)}</th><td class='bad' colspan='{len(katas) + 1}'>"
                        f"not graded: {html.escape(g.problem)}</td></tr>")  # fmt: skip
            continue
        cells = []
        for k in g.katas:
            css = {"passed": "ok", "failed": "bad"}.get(k.status, "none")
            text = "-" if k.status == "not submitted" else f"{k.passed}/{k.total}"
            tip = html.escape(f"{k.first_failing_step}: {k.reason}".strip(": ") or k.status)
            cells.append(f"<td class='{css}' title='{tip}'>{text}</td>")
        rows.append(
            f"<tr><th>{html.escape(g.learner)}</th>{''.join(cells)}<td>{g.katas_passed} of {len(katas)}</td></tr>"
        )
    stuck = "".join(
        f"<li><b>{html.escape(g.learner)} {k.kata}</b>: "
        + (f"{html.escape(k.first_failing_step)}: " if k.first_failing_step else "")
        + f"{html.escape(k.reason)}</li>"
        for g in grades
        for k in g.katas
        if k.status == "failed"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>torch-dist-katas: grades</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }} th, td {{ border: 1px solid #ccc; padding: .3em .6em; text-align: center; }}
td.ok {{ background: #d9f2d9; }} td.bad {{ background: #f8d7d7; }} td.none {{ color: #999; }}
</style></head><body>
<h1>torch-dist-katas: grades</h1>
<p>Tests passed of total, per learner and kata (hover a cell for the first failing step).
Made {time.strftime("%Y-%m-%d %H:%M")}.</p>
<table><tr><th>learner</th>{head}<th>katas passed</th></tr>
{chr(10).join(rows)}
</table>
<h2>Where each one is stuck</h2><ul>{stuck or "<li>nowhere: every graded kata passes</li>"}</ul>
</body></html>
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
    return 0
