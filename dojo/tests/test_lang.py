"""The learner's language: --lang, else DOJO_LANG, else the locale; lessons, hints, the
runner's sentences, the specs' diagnoses and the harness's reports follow it (the catalogue:
``dojo/locale``, held complete by the gate)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from dojo import lang
from dojo.curriculum import ROOT
from dojo.dev import consistency, messages, swaps
from dojo.dev.consistency import messages_of
from dojo.harness.world import DEADLOCK_MARKS, deadlock_report
from dojo.tests.test_runner import dojo, learner_copy, learner_env


def _first(msgid) -> str:
    return messages_of(msgid)[0]


def test_the_language_comes_from_the_flag_the_variable_or_the_locale(monkeypatch):
    for name in ("DOJO_LANG", "LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(name, raising=False)
    assert lang.current() == "en"
    monkeypatch.setenv("LANG", "zh_CN.UTF-8")
    assert lang.current() == "zh"
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    assert lang.current() == "en", "LC_ALL wins over LANG, as for every program"
    monkeypatch.setenv("DOJO_LANG", "zh")
    assert lang.current() == "zh"


def test_a_chinese_learner_reads_the_runner_the_lesson_and_the_hints_in_chinese(tmp_path):
    root = learner_copy(tmp_path)
    for folder, name in (("katas", "k04_allreduce.py"), ("tests", "test_k04_allreduce.py")):
        shutil.copy(ROOT / folder / name, root / folder / name)
    env = learner_env(DOJO_LANG="", LANG="zh_CN.UTF-8", LC_ALL="", LC_MESSAGES="")
    listed = dojo(root, "list", env=env)
    assert "第一部分：教程" in listed.stdout and "当前" in listed.stdout, listed.stdout
    lesson = dojo(root, "--lang", "zh", "lesson", "k04")
    assert "思路" in lesson.stdout and "``average_gradients``" in lesson.stdout, lesson.stdout
    hint = dojo(root, "--lang", "zh", "hint", "k04", "--step", "3")
    assert "第 3 步" in hint.stdout and "提示 1/3" in hint.stdout, hint.stdout
    after = dojo(root, "lesson", "k04", "--lang", "zh", env=learner_env(DOJO_LANG="en"))
    assert "思路" in after.stdout, f"--lang after the kata is the same --lang:\n{after.stderr}"
    english = dojo(root, "--lang", "en", "lesson", "k04")
    assert "THE IDEA" in english.stdout, english.stdout


def test_hints_wrap_by_columns_and_never_inside_an_identifier():
    from dojo.runner.term import display_width, wrap

    text = "先用 make_replicas_identical 让起点相同，再取各自的分片（shard_indices + Subset）" * 3
    lines = wrap(text, width=40, indent="  ")
    assert all(
        display_width(line) <= 40 for line in lines if " " in line.strip() or len(line) < 40
    ), lines
    joined = "".join(line.strip() for line in lines)
    assert "make_replicas_identical" in joined and "shard_indices" in joined, lines
    assert wrap("one two three", width=8) == ["one two", "three"]


def test_a_todo_reads_in_the_learners_language_without_english_kept_for_a_parser(monkeypatch):
    from dojo import curriculum
    from dojo.spec.plugin import _todo_report
    from dojo.todo import KataTodo

    todo = KataTodo("k01", 2, "the greeting")
    monkeypatch.setenv("DOJO_LANG", "zh")
    said = _todo_report(todo)
    title = curriculum.find("k01").step(2).title
    assert said.startswith(f"尚未实现：k01 第 2 步（{title}）\n"), said
    assert "not implemented yet" not in said, "the runner reads the log's record, not this text"
    monkeypatch.setenv("DOJO_LANG", "en")
    assert _todo_report(todo).startswith("not implemented yet: k01 step 2 (the greeting)\n")


# --------------------------------------------------------------- the specs' and harness's words


def _spec_run(spec: str, test: str, kata: str, function: str, entry: str, language: str):
    """A catalogue entry swapped into the reference, its test run as a learner's plain pytest."""
    env = {
        **learner_env(DOJO_LANG=language, DOJO_IMPL="solutions"),
        **swaps.environment_for({kata: {function: f"dojo.dev.mistakes.{kata}:{entry}"}}),
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", spec, "-k", test],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_k04_mistake_is_diagnosed_in_chinese():
    spec, test = "tests/test_k04_allreduce.py", "test_average_gradients_gives_every_rank_the_mean"
    said = _spec_run(spec, test, "k04_allreduce", "average_gradients", "summed_not_divided", "zh")
    out = said.stdout
    assert said.returncode == 1, out
    assert "第 3 步 · " in out, f"the step in Chinese:\n{out}"
    assert "4 个 rank 时：每个 rank 上" in out and "再除以 world size" in out, out
    assert "divide by the world size" not in out, f"the diagnosis is still English:\n{out}"
    english = _spec_run(
        spec, test, "k04_allreduce", "average_gradients", "summed_not_divided", "en"
    )
    assert "with 4 ranks: every rank holds the sum" in english.stdout, english.stdout


def test_a_k04_deadlock_is_reported_in_chinese_by_the_spec_and_the_harness():
    spec, test = "tests/test_k04_allreduce.py", "test_average_gradients_gives_every_rank_the_mean"
    entry = "only_rank_0_calls_all_reduce"
    out = _spec_run(spec, test, "k04_allreduce", "average_gradients", entry, "zh").stdout
    assert "average_gradients 死锁了：rank 1, 2 和 3 已经返回" in out, out
    assert "死锁：rank 0" in out and "在这里等待（最近的调用在最后）" in out, out
    assert "deadlock" not in out and "waiting here" not in out, out


def test_a_k01_mistake_is_diagnosed_in_chinese():
    spec, test = "tests/test_k01_spawn.py", "test_global_rank"
    out = _spec_run(spec, test, "k01_spawn", "global_rank", "ranks_from_one", "zh").stdout
    assert "返回了 1，应为 0：多了一：rank 从 0 开始数" in out, out
    assert "ranks count from 0" not in out, f"the diagnosis is still English:\n{out}"


def test_every_deadlock_report_begins_with_its_mark_in_every_language():
    """A program's deadlock report is found in its output by its first words
    (``dojo.harness.world.DEADLOCK_MARKS``), whichever language it is in."""
    reports = [m for m in messages.read("zh") if _first(m.id).startswith(DEADLOCK_MARKS[0])]
    assert reports, "the harness's deadlock reports are marked for translation"
    for message in reports:
        for text in messages_of(message.string):
            assert deadlock_report("[main] " + text) == text, (
                f"{text!r} does not begin with one of {DEADLOCK_MARKS}: the specs and the "
                "runner would not find a program's deadlock report in Chinese"
            )


# --------------------------------------------------------------- the gate's catalogue check


def _catalogue_copy(tmp_path, monkeypatch) -> Path:
    """The catalogues copied where the gate reads them, to spoil in a test."""
    locale = tmp_path / "locale"
    shutil.copytree(lang.LOCALE_DIR, locale)
    monkeypatch.setattr(lang, "LOCALE_DIR", locale)
    return locale / "zh" / "LC_MESSAGES" / "dojo.po"


def test_the_gate_holds_the_catalogue_complete_and_compiled(tmp_path, monkeypatch):
    assert consistency.catalogue_problems() == [], "the committed catalogue is in step"
    po = _catalogue_copy(tmp_path, monkeypatch)
    text = po.read_text(encoding="utf-8")
    english = "the element-wise largest"
    assert f'msgid "{english}"\nmsgstr "逐元素的最大值"' in text
    po.write_text(text.replace('msgstr "逐元素的最大值"', 'msgstr ""'), encoding="utf-8")
    found = "\n".join(consistency.catalogue_problems())
    assert "not translated yet" in found and repr(english) in found, found
    assert "dojo.mo is not dojo.po compiled" in found, found


def test_the_gate_finds_sentences_missing_stale_or_with_foreign_placeholders(tmp_path, monkeypatch):
    po = _catalogue_copy(tmp_path, monkeypatch)
    text = po.read_text(encoding="utf-8")
    spoiled = text.replace('msgid "the element-wise sum"', 'msgid "the element-wise total"')
    spoiled = spoiled.replace('msgstr "rank {rank} 的输出："', 'msgstr "rank {rnak} 的输出："')
    assert spoiled.count("{rnak}") == 1 and "element-wise total" in spoiled
    po.write_text(spoiled, encoding="utf-8")
    found = "\n".join(consistency.catalogue_problems())
    assert "lacks sentences the code marks" in found and "'the element-wise sum'" in found, found
    assert "no longer marks" in found and "'the element-wise total'" in found, found
    assert "uses ['rnak']" in found, found
    po.unlink()
    assert any("dojo.po is missing" in p for p in consistency.catalogue_problems())
