"""The maintainer's structure checks, tested: each catches what it is for."""

from __future__ import annotations

import dataclasses

from dojo import curriculum
from dojo.curriculum import stubs
from dojo.dev import consistency, imports

SOLUTION = '''"""A lesson."""

from dojo.console import say

LIMIT = 3


def helper(x):
    """Written for the learner."""
    return x + 1


def task(x: int) -> int:
    """The learner writes this."""
    # BEGIN STEP 1: the task
    # TODO: what it must achieve
    doubled = helper(x) * 2
    return doubled - LIMIT
    # END STEP 1
'''
STUB = stubs.stub_source(SOLUTION, "k99", "solutions/k99_demo.py")


def test_a_stub_of_an_older_reference_is_a_stub_and_a_learners_work_is_not():
    assert consistency.learner_work(STUB, STUB) is None
    older = STUB.replace("# TODO: what it must achieve", "# TODO: said otherwise").replace(
        '"the task"', '"named otherwise"'
    )
    assert consistency.learner_work(older, STUB) is None, "a todo's text is not a learner's work"
    redocumented = STUB.replace('"""The learner writes this."""', '"""Said otherwise."""')
    assert consistency.learner_work(redocumented, STUB) is None
    elsewhere = STUB.replace("LIMIT = 3", "LIMIT = 4")
    assert consistency.learner_work(elsewhere, STUB) is None, "outside the todo functions"

    solved = SOLUTION
    assert consistency.learner_work(solved, STUB) == "task raises no KataTodo there"
    started = STUB.replace("    raise KataTodo", "    doubled = helper(x) * 2\n    raise KataTodo")
    assert consistency.learner_work(started, STUB) == "task holds code the stub does not have", (
        "code written above a todo still raised is a learner's work"
    )
    assert consistency.learner_work("def task(:\n", STUB) == "it does not parse (line 1)"


def test_every_reference_makes_its_stub_with_a_region_for_exactly_its_steps():
    for kata in curriculum.katas():
        source = kata.solution_file.read_text(encoding="utf-8")
        assert stubs.stub(kata), kata.id
        assert consistency.region_problems(kata, stubs.regions(source, kata.id)) == [], kata.id


def test_regions_that_disagree_with_the_curriculum_are_named():
    kata = curriculum.find("k04")
    regions = stubs.regions(kata.solution_file.read_text(encoding="utf-8"), "k04")
    step_2 = next(r for r in regions if r.step == 2)
    found = consistency.region_problems(
        kata, [r for r in regions if r.step != 2] + [dataclasses.replace(step_2, step=7)]
    )
    assert found == [
        "solutions/k04_allreduce.py has no region for step 2 (all-reduce with a named reduce op): "
        "mark the code the learner writes with `# BEGIN STEP 2: ...` ... `# END STEP 2`",
        f"solutions/k04_allreduce.py, line {step_2.begin}: a region for step 7, which the "
        "curriculum lacks",
    ], found


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


def test_run_it_commands_use_the_environments_interpreter():
    from dojo.dev import consistency

    section = (
        "\n    python -m katas.k04_allreduce --world-size 4\n"
        "    GLOO_SOCKET_IFNAME=eth0 python -m katas.k06_multi_node --nnodes 2\n"
        "    torchrun --standalone -m katas.k16_elastic\n"
        "    .venv/bin/python -m katas.k04_allreduce\n"
        "    The trace names every python -m call it saw.\n"
    )
    found = consistency.run_it_problems(section)
    assert len(found) == 3, found
    assert "write `.venv/bin/python ...`" in found[0] and "`.venv/bin/torchrun ...`" in found[2]
