"""The maintainer's structure checks, tested: each catches what it is for."""

from __future__ import annotations

from dojo import curriculum
from dojo.dev import consistency, imports

STUB = '''"""A lesson."""
from dojo.todo import KataTodo

LIMIT = 3


def helper(x):
    """Written for the learner."""
    return x + 1


def task(x: int) -> int:
    """The learner writes this."""
    # TODO: what it must achieve
    raise KataTodo("k99", 1, "the task")
'''

SOLUTION = '''"""A lesson."""

LIMIT = 3


def helper(x):
    """Written for the learner."""
    return x + 1


def task(x: int) -> int:
    """The learner writes this."""
    doubled = helper(x) * 2
    return doubled - LIMIT
'''


def test_a_stub_may_differ_from_its_solution_only_inside_the_todo_functions():
    assert consistency.first_difference(STUB, SOLUTION) is None
    drifted = SOLUTION.replace("LIMIT = 3", "LIMIT = 4")
    assert consistency.first_difference(STUB, drifted) == (4, 3), (
        "a changed constant must be caught"
    )
    renamed = SOLUTION.replace("def task(x: int)", "def task(y: int)")
    assert consistency.first_difference(STUB, renamed) is not None, (
        "a changed signature must be caught"
    )
    redocumented = SOLUTION.replace('"""The learner writes this."""', '"""Another docstring."""')
    assert consistency.first_difference(STUB, redocumented) is not None, (
        "a changed docstring must be caught"
    )
    extra = SOLUTION + "\n\ndef only_in_the_solution():\n    return 1\n"
    assert consistency.first_difference(STUB, extra) is not None, (
        "a function the stub lacks must be caught"
    )


def test_the_shipped_stubs_equal_their_solutions_outside_the_todos():
    for kata in curriculum.katas():
        assert consistency.stub_differences(kata) == [], kata.id


def test_import_circles_are_found_and_packages_are_not_circles():
    graph = {
        "dojo.a": {"dojo.b"},
        "dojo.b": {"dojo.c"},
        "dojo.c": {"dojo.a"},
        "dojo.runner": {"dojo.runner.x"},
        "dojo.runner.x": {"dojo.runner"},
    }
    assert imports.find_cycles(graph) == [["dojo.a", "dojo.b", "dojo.c", "dojo.a"]]


def test_import_rules_hold_in_this_tree():
    assert imports.problems() == []


def test_imports_are_read_from_every_form(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import dojo.harness.world\nfrom dojo import data as d, todo\n\ndef f():\n    from dojo.runner import cli\n"
    )
    assert imports.imported(module) == {
        "dojo.harness.world",
        "dojo.data",
        "dojo.todo",
        "dojo.runner.cli",
    }


def test_a_chinese_lesson_is_held_to_the_english_one(tmp_path, monkeypatch):
    from dojo import curriculum

    kata = curriculum.find("k04")
    good = (curriculum.ZH_DIR / f"{kata.module}.toml").read_text(encoding="utf-8")
    monkeypatch.setattr(curriculum, "ZH_DIR", tmp_path)
    (tmp_path / f"{kata.module}.toml").write_text(good, encoding="utf-8")
    assert consistency.chinese_problems(kata) == []
    invented = good.replace(
        "``average_gradients``：执行之后", "``average_all_gradients``：执行之后"
    )
    (tmp_path / f"{kata.module}.toml").write_text(invented, encoding="utf-8")
    assert any("names `average_all_gradients`" in p for p in consistency.chinese_problems(kata))
    step_lost = good.replace("[[step]]\nnumber = 3", "[[step]]\nnumber = 4")
    (tmp_path / f"{kata.module}.toml").write_text(step_lost, encoding="utf-8")
    assert any(
        "both languages name the same steps" in p for p in consistency.chinese_problems(kata)
    )
    no_section = good.replace("测试检查什么\n", "检查\n")
    (tmp_path / f"{kata.module}.toml").write_text(no_section, encoding="utf-8")
    assert any("lacks the sections 测试检查什么" in p for p in consistency.chinese_problems(kata))
    (tmp_path / f"{kata.module}.toml").unlink()
    assert consistency.chinese_problems(kata) == [
        "k04: no Chinese lesson and hints: write dojo/curriculum/zh/k04_allreduce.toml"
    ]
