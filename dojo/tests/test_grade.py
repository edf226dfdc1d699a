"""`dojo grade` on a small class made here: one learner with every kata solved, one half way, one
whose code deadlocks, one who edited the tests, one with a kata that does not parse, an empty
archive and a corrupt one. Graded against this project's own specs, with nothing changed in the
submissions and no process left behind."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from xml.etree import ElementTree

import pytest

from dojo import curriculum
from dojo.curriculum import ROOT, stubs

KATAS = ("k04_allreduce", "k10_sharding")
DEADLOCK = (
    "    size = float(dist.get_world_size())\n",
    "    size = float(dist.get_world_size())\n    if dist.get_rank() == 0:\n        return  # rank 0 'already has it'\n",
)


def _checkout(folder: Path, solved: dict[str, str | None]) -> Path:
    """A learner's checkout: katas/ with each kata solved (the reference), as shipped (None), or
    the given source."""
    (folder / "katas").mkdir(parents=True)
    for module, source in solved.items():
        text = (ROOT / "solutions" / f"{module}.py").read_text() if source == "solved" else source
        if source is None:
            text = stubs.stub(curriculum.find(module))
        (folder / "katas" / f"{module}.py").write_text(text)
    return folder


def _digest(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


def _class(tmp_path: Path) -> list[Path]:
    reference = (ROOT / "solutions" / "k04_allreduce.py").read_text()
    assert DEADLOCK[0] in reference
    ada = _checkout(tmp_path / "ada", {m: "solved" for m in KATAS})
    bo_dir = _checkout(tmp_path / "bo-work", {"k04_allreduce": "solved", "k10_sharding": None})
    bo = tmp_path / "bo.zip"
    with zipfile.ZipFile(bo, "w") as bundle:
        for path in (bo_dir / "katas").iterdir():
            bundle.write(path, f"katas/{path.name}")
    cy_dir = _checkout(tmp_path / "cy-work", {"k04_allreduce": reference.replace(*DEADLOCK)})
    cy = tmp_path / "cy.tar.gz"
    with tarfile.open(cy, "w:gz") as bundle:
        bundle.add(cy_dir, arcname="cy-repo")
    di = _checkout(tmp_path / "di", {"k04_allreduce": None, "k10_sharding": None})
    (di / "tests").mkdir()
    (di / "tests" / "test_k04_allreduce.py").write_text("def test_everything():\n    pass\n")
    fi = _checkout(
        tmp_path / "fi",
        {"k04_allreduce": reference.replace("def average_gradients(", "def average_gradients(:")},
    )
    ed = tmp_path / "ed.zip"
    zipfile.ZipFile(ed, "w").close()
    gus = tmp_path / "gus.zip"
    gus.write_bytes(b"PK\x03\x04 this is not really a zip")
    return [ada, bo, cy, di, fi, ed, gus]


@pytest.mark.slow  # a pytest per learner and kata: about a minute on two cores
@pytest.mark.timeout(900)
def test_a_class_is_graded_against_our_own_specs_and_nothing_is_left_behind(tmp_path):
    submissions = _class(tmp_path)
    before = {p.name: _digest(p) for p in submissions}
    token = f"grade-{os.getpid()}-{time.monotonic_ns()}"
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "dojo", "grade", *map(str, submissions), "--katas", "k04,k10", "--jobs", "2",
         "--timeout", "300", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "DOJO_TEST_TOKEN": token}, capture_output=True, text=True, timeout=850,
    )  # fmt: skip
    printed = done.stdout
    assert done.returncode == 0, printed + done.stderr

    rows = {
        line.split()[0]: line.split(None, 1)[1]
        for line in printed.splitlines()
        if line[:1].isalpha()
    }
    assert rows["ada"].endswith("ok  2 of 2") and rows["ada"].startswith("8/8 ok"), printed
    assert rows["bo"].endswith("1 of 2") and rows["cy"].endswith("0 of 2"), printed
    assert rows["di"].endswith("0 of 2"), f"edited tests must gain nothing:\n{printed}"
    assert rows["ed"].startswith("not graded: no kata files in ed.zip"), printed
    assert rows["gus"].startswith(
        "not graded: gus.zip is neither a folder nor a readable zip or tar"
    ), printed
    assert (
        "cy k04: step 3 · average every gradient over the ranks: AssertionError: average_gradients deadlocked"
        in printed
    )

    by = {}
    with open(out / "grades.csv", newline="") as grades:
        for row in csv.DictReader(grades):
            by[(row["learner"], row["kata"])] = row
    assert by[("ada", "k04")]["status"] == "passed" and by[("ada", "k10")]["status"] == "passed"
    assert by[("bo", "k10")]["status"] == "failed" and by[("bo", "k10")][
        "first_failing_step"
    ].startswith("step 1")
    assert "not implemented yet" in by[("bo", "k10")]["reason"]
    assert by[("cy", "k04")]["status"] == "failed" and "deadlock" in by[("cy", "k04")]["reason"], (
        by[("cy", "k04")]
    )
    assert by[("cy", "k10")]["status"] == "not submitted"
    assert by[("di", "k04")]["status"] == "failed" and int(by[("di", "k04")]["total"]) > 1
    assert "does not parse: line" in by[("fi", "k04")]["reason"]

    learners = json.loads((out / "grades.json").read_text())
    assert [g["learner"] for g in learners] == ["ada", "bo", "cy", "di", "fi", "ed", "gus"]
    suites = ElementTree.parse(out / "grades.xml").getroot()
    assert [s.get("name") for s in suites] == ["ada", "bo", "cy", "di", "fi", "ed", "gus"]
    assert suites[0].get("failures") == "0" and suites[2].find("testcase/failure") is not None
    page = (out / "grades.html").read_text()
    assert '<table class="grid">' in page and "<details class='kata part' id='g2-k04'>" in page
    assert (
        by[("cy", "k04")]["failing_test"].startswith("test_")
        and "Every rank must call dist.all_reduce for every parameter"
        in by[("cy", "k04")]["reason"]
    ), by[("cy", "k04")]
    assert "deadlock" in by[("cy", "k04")]["log"], "the end of the failure's log"
    assert by[("cy", "k04")]["where"].startswith("katas/k04_allreduce.py:"), (
        "the line of cy's own code the stuck ranks wait at"
    )

    assert {p.name: _digest(p) for p in submissions} == before, "grading changed a submission"
    left = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"DOJO_TEST_TOKEN={token}".encode() in Path(
                f"/proc/{entry}/environ"
            ).read_bytes().split(b"\0"):
                left.append(entry)
        except OSError:
            continue
    assert not left, f"grading left processes running: {left}"
    shutil.rmtree(out)


def test_kata_ranges_and_bad_submissions_are_read_plainly(tmp_path):
    from dojo.runner import grade

    assert [k.id for k in grade.select("k02-k04")] == ["k02", "k03", "k04"]
    assert [k.id for k in grade.select("4,k01")] == ["k04", "k01"]
    with pytest.raises(KeyError, match="no kata called 'k99'"):
        grade.select("k01-k99")
    with pytest.raises(grade.BadSubmission, match="does not exist"):
        grade.kata_files(tmp_path / "nobody", tmp_path / "x")
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as bundle:
        bundle.writestr("../outside.py", "x = 1")
    with pytest.raises(grade.BadSubmission, match="a path outside itself"):
        grade.kata_files(evil, tmp_path / "unpacked")
    assert not (tmp_path / "outside.py").exists()


def test_the_classroom_workflow_grades_every_kata_and_is_current():
    from dojo import curriculum
    from dojo.dev import classroom

    text = classroom.workflow()
    for kata in curriculum.katas():
        assert f"command: python -m dojo check {kata.id}\n" in text, kata.id
    assert classroom.problems() == [], "run `python -m dojo dev classroom`"


# ------------------------------------------------------------------ the reports, without a kata run

LONG = (
    "AssertionError: average_gradients deadlocked: ranks 1, 2 and 3 were still waiting in a "
    "collective after rank 0 had returned, so rank 0 skipped the all-reduces that ranks 1, 2 and 3 "
    "made. Every rank must call dist.all_reduce for every parameter with a gradient (a collective "
    "completes only when all ranks call it): no `if rank == ...` around the loop."
)


def _graded_class():
    from dojo.runner.grade import KataGrade, LearnerGrade

    stuck = KataGrade(
        "k04", "failed", 5, 8, "step 3 · average every gradient over the ranks", 12.5,
        LONG + "\n\nrank 1 waits in all_reduce", "test_average_gradients[4]",
        ["test_average_gradients[4]", "test_average_skips_none"],
        "tests/test_k04_allreduce.py:250: in _run_average\nE   " + LONG + "\nTHE LOG'S LAST LINE",
        "katas/k04_allreduce.py:99, in average_gradients (rank 1)",
    )  # fmt: skip
    return [
        LearnerGrade("ada", "/class/ada", [KataGrade("k04", "passed", 8, 8, seconds=9.0),
                                           KataGrade("k10", "passed", 27, 27, seconds=20.0)]),
        LearnerGrade("cy <b>", "/class/cy.tar.gz", [stuck, KataGrade("k10", "not submitted", reason="no katas/k10_sharding.py")]),
        LearnerGrade("ed", "/class/ed", [KataGrade("k04", "failed", reason="katas/k04_allreduce.py does not parse: line 91: invalid syntax"),
                                         KataGrade("k10", "passed", 27, 27)]),
        LearnerGrade("gus", "/class/gus.zip", problem="gus.zip is neither a folder nor a readable zip"),
    ]  # fmt: skip


def test_every_report_holds_each_reason_whole_with_the_failing_test_and_its_log(tmp_path):
    from dojo import curriculum
    from dojo.runner import grade

    grades, katas = _graded_class(), [curriculum.find("k04"), curriculum.find("k10")]
    printed = grade.table(grades, katas)
    assert "Every rank must call dist.all_reduce for every ..." in printed, (
        "the terminal keeps a line per stuck learner"
    )
    assert printed.splitlines()[3].split() == ["ed", "broken", "27/27", "ok", "1", "of", "2"], (
        "a kata that does not parse ran no test: it is broken, not 0/0"
    )
    assert printed.splitlines()[5].split() == ["passed", "by", "1/3", "2/3"], printed
    grade.write_reports(grades, katas, tmp_path)

    rows = list(csv.DictReader(open(tmp_path / "grades.csv", newline="", encoding="utf-8")))
    cy = next(r for r in rows if r["learner"] == "cy <b>" and r["kata"] == "k04")
    assert cy["reason"].startswith(LONG) and cy["reason"].endswith("rank 1 waits in all_reduce")
    assert cy["failing_test"] == "test_average_gradients[4]" and cy["log"].endswith("LAST LINE")
    assert cy["failed_tests"] == "test_average_gradients[4] test_average_skips_none"
    assert cy["where"] == "katas/k04_allreduce.py:99, in average_gradients (rank 1)"
    learners = json.loads((tmp_path / "grades.json").read_text())
    assert learners[1]["katas"][0]["reason"].endswith("waits in all_reduce"), learners[1]
    assert learners[1]["katas"][0]["log"].endswith("LAST LINE")
    suites = ElementTree.parse(tmp_path / "grades.xml").getroot()
    failure = suites[1].find("testcase/failure")
    assert LONG in failure.get("message") and failure.text.endswith("LAST LINE")
    assert suites[1].get("skipped") == "1" and suites[3].find("testcase/error") is not None

    page = (tmp_path / "grades.html").read_text()
    assert LONG in page.replace("&#x27;", "'").replace("&quot;", '"'), "the HTML holds it whole"
    assert "<details class='kata part' id='g1-k04'>" in page, "behind a click: <details>"
    assert "THE LOG&#x27;S LAST LINE" in page and "test_average_skips_none" in page
    assert (
        "<dt>in their code</dt><dd><code>katas/k04_allreduce.py:99, in average_gradients (rank 1)"
        in page
    ), "the learner's own line, not only the end of the spec's log"
    assert "cy &lt;b&gt;" in page and "cy <b>" not in page, "a learner's text is escaped"
    assert "<div class='big'>3 of 6</div>" in page, "class totals: katas passed of learner x kata"
    assert "<td class='num'>1 of 3</td><td class='num'>33%</td>" in page, "k04's pass rate"
    assert "step 3 · average every gradient over the ranks <b>×1</b>" in page
    assert "href='#g1-k04'" in page and "not graded: gus.zip" in page
    for external in ("http://", "https://", "<link", " src=", "@import", "url("):
        assert external not in page, f"the page must be self-contained: it holds {external!r}"


def test_a_failures_reason_and_line_come_from_its_record():
    from dojo import curriculum
    from dojo.runner import grade, runs

    whole = "AssertionError: first line\n\nsecond paragraph\n  indented"
    place = {"file": "katas/k04_allreduce.py", "line": 99, "function": "average_gradients"}
    record = {"test": "tests/test_k04_allreduce.py::test_a", "when": "call", "outcome": "failed",
              "text": "tests/test_k04_allreduce.py:250: in _run_average\nE   cut", "message": whole,
              "steps": [3], "rank": 2, "where": [place]}  # fmt: skip
    k04 = curriculum.find("k04")
    assert grade._first_reason(runs.RunResult(k04, 1, [record])) == whole, (
        "the message whole, as the log recorded it"
    )
    assert grade._where(record) == "katas/k04_allreduce.py:99, in average_gradients (rank 2)"
    other = {**record, "todo": {"kata": "k01", "step": 4, "what": "spawn, collect, join"}}
    reason = grade._first_reason(runs.RunResult(curriculum.find("k02"), 1, [other]))
    assert (
        reason.startswith("not implemented yet: k01 step 4 (spawn, collect, join)")
        and "k02's tests use k01's" in reason
        and "katas/k01_spawn.py" in reason
    ), reason
