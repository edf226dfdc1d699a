"""The learner's language: --lang, else DOJO_LANG, else the locale; lessons, hints and the
runner's main messages follow it."""

from __future__ import annotations

import shutil

from dojo import lang
from dojo.curriculum import ROOT
from dojo.tests.test_runner import dojo, learner_copy, learner_env


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
