"""The stub generator (``dojo.curriculum.stubs``): a kata's stub made from its marked reference,
byte for byte as ruff would write it, and a clear error, naming file and line, for a bad marker."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

from dojo import curriculum
from dojo.curriculum import stubs

SOLUTION = '''"""A lesson."""

import torch

from dojo.console import say
from dojo.toy_models import TinyTransformer

LIMIT = 3


def helper(x):
    """Written for the learner."""
    return x + 1


def task(x: int) -> int:
    """The learner writes this, in two steps."""
    # BEGIN STEP 1: double it
    # TODO: double helper(x)
    #   (one TODO spans lines)
    doubled = helper(x) * 2
    # END STEP 1
    # BEGIN STEP 2: take the limit off
    # TODO: take LIMIT off
    # END TODO
    # the reference's own comment
    return doubled - LIMIT
    # END STEP 2
'''

STUB = '''"""A lesson."""

import torch

from dojo.console import say
from dojo.todo import KataTodo
from dojo.toy_models import TinyTransformer

LIMIT = 3


def helper(x):
    """Written for the learner."""
    return x + 1


def task(x: int) -> int:
    """The learner writes this, in two steps."""
    # TODO: double helper(x)
    #   (one TODO spans lines)
    raise KataTodo("k99", 1, "double it")
    # TODO: take LIMIT off
    raise KataTodo("k99", 2, "take the limit off")
'''


RUFF = shutil.which("ruff", path=os.path.dirname(sys.executable))


def make(source: str) -> str:
    return stubs.stub_source(source, "k99", "solutions/k99_demo.py")


def test_a_function_with_two_regions_becomes_its_todos_and_the_import_is_added():
    assert make(SOLUTION) == STUB
    assert [(r.step, r.what, r.begin, r.end) for r in stubs.regions(SOLUTION, "x")] == [
        (1, "double it", 18, 22),
        (2, "take the limit off", 23, 28),
    ]
    assert make(STUB.replace("raise KataTodo", "return KataTodo")) == STUB.replace(
        "raise KataTodo", "return KataTodo"
    ), "a source without regions is its own stub"


@pytest.mark.parametrize(
    "imports, expected",
    [
        pytest.param(
            "from dojo import console\nfrom dojo.console import say\n",
            "from dojo import console\nfrom dojo.console import say\nfrom dojo.todo import KataTodo\n",
            id="after-the-last-dojo-import",
        ),
        pytest.param(
            "import dojo.console\nfrom tests.helpers import probe\n",
            "import dojo.console\nfrom dojo.todo import KataTodo\nfrom tests.helpers import probe\n",
            id="from-imports-after-plain-ones-sorted-by-module",
        ),
        pytest.param(
            "from dojo.todo import find_todo\n",
            "from dojo.todo import KataTodo, find_todo\n",
            id="into-the-modules-own-dojo-todo-import",
        ),
        pytest.param(
            "from dojo.todo import (\n    find_todo,\n)\n",
            "from dojo.todo import (\n    KataTodo,\n    find_todo,\n)\n",
            id="kept-split-where-it-was-split",
        ),
        pytest.param(
            f"from dojo.todo import {'a' * 40}, {'b' * 40}\n",
            f"from dojo.todo import (\n    KataTodo,\n    {'a' * 40},\n    {'b' * 40},\n)\n",
            id="split-where-one-line-would-pass-100-columns",
        ),
    ],
)
def test_the_katatodo_import_goes_where_isort_puts_it(imports, expected):
    solution = SOLUTION.replace(
        "from dojo.console import say\nfrom dojo.toy_models import TinyTransformer\n", imports
    )
    stub = make(solution)
    head = stub.split("LIMIT = 3")[0]
    assert head == f'"""A lesson."""\n\nimport torch\n\n{expected}\n', head


def test_a_reference_that_imports_nothing_from_dojo_is_told_where_the_import_must_go():
    solution = SOLUTION.replace(
        "from dojo.console import say\nfrom dojo.toy_models import TinyTransformer\n", ""
    )
    with pytest.raises(stubs.StubError, match="imports nothing from dojo"):
        make(solution)


def _one_region(what: str, indent: str = "    ") -> str:
    body = "\n".join(
        f"{indent}{line}"
        for line in (f"# BEGIN STEP 1: {what}", "# TODO: it", "return 1", "# END STEP 1")
    )
    head = "def task():\n" if indent == "    " else "class A:\n    def task(self):\n"
    return f"from dojo.console import say\n\n\n{head}{body}\n"


@pytest.mark.parametrize(
    "indent, width, expected",
    [
        ("    ", 100, ['    raise KataTodo("k99", 1, "{w}")']),
        ("    ", 101, ["    raise KataTodo(", '        "k99", 1, "{w}"', "    )"]),
        ("        ", 100, ['        raise KataTodo("k99", 1, "{w}")']),
        ("        ", 101, ["        raise KataTodo(", '            "k99", 1, "{w}"', "        )"]),
        ("    ", 112, ["    raise KataTodo(", '        "k99", 1, "{w}"', "    )"]),
        (
            "    ",
            113,
            ["    raise KataTodo(", '        "k99",', "        1,", '        "{w}",', "    )"],
        ),
    ],
)
def test_the_raise_is_wrapped_as_ruff_format_wraps_it_at_the_100_column_edge(
    indent, width, expected
):
    """``width``: the one-line raise's columns; 100 fits, 101 splits after the parenthesis; once
    the arguments' own line would pass 100 (from 113 here), one argument per line."""
    what = "w" * (width - len(f'{indent}raise KataTodo("k99", 1, "")'))
    lines = make(_one_region(what, indent)).splitlines()
    start = next(i for i, line in enumerate(lines) if "raise KataTodo" in line)
    assert lines[start : start + len(expected)] == [e.format(w=what) for e in expected]
    assert len(lines) == start + len(expected), "the raise ends the stub"


def test_wide_characters_take_two_columns_and_quotes_are_ruffs():
    assert make(_one_region("中" * 35)).count("raise KataTodo(\n") == 1, (
        "35 wide characters: 102 columns"
    )
    assert 'raise KataTodo("k99", 1, "' + "中" * 33 + '")' in make(_one_region("中" * 33))
    assert """raise KataTodo("k99", 1, 'say "hi"')""" in make(_one_region('say "hi"'))
    assert """raise KataTodo("k99", 1, "it's")""" in make(_one_region("it's"))
    assert r"""raise KataTodo("k99", 1, "a\\b")""" in make(_one_region("a\\b"))


@pytest.mark.skipif(RUFF is None, reason="ruff (the dev extra) is missing: pip install -e '.[dev]'")
def test_ruff_finds_nothing_to_change_in_the_stubs_made_here(tmp_path):
    """What the tests above hold the generator to is what the pinned ruff does."""
    made = [STUB] + [make(_one_region(w * n)) for w in ("w", "中") for n in range(25, 95)]
    made += [make(_one_region("x" * 70, "        "))]
    for number, text in enumerate(made):
        (tmp_path / f"s{number}.py").write_text(text, encoding="utf-8")
    for args in (["format", "--check"], ["check", "--select", "I,E,W", "--ignore", "E501"]):
        done = subprocess.run(
            [RUFF, *args, "--config", f"{curriculum.ROOT / 'pyproject.toml'}", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"ruff {args[0]} disagrees:\n{done.stdout}{done.stderr}"


BAD = {
    "no-end": (
        "    # BEGIN STEP 1: it\n    # TODO: it\n    return 1\n",
        "line 5: BEGIN STEP 1 has no END STEP 1 after it",
    ),
    "mismatched": (
        "    # BEGIN STEP 1: it\n    # TODO: it\n    return 1\n    # END STEP 2\n",
        "line 8: END STEP 2 closes the region of step 1 (BEGIN at line 5)",
    ),
    "no-todo": (
        "    # BEGIN STEP 1: it\n    return 1\n    # END STEP 1\n",
        "line 6: the region of step 1 has no TODO",
    ),
    "todo-not-first": (
        "    # BEGIN STEP 1: it\n    # the reference's comment\n    return 1\n    # END STEP 1\n",
        "line 6: the region of step 1 has no TODO",
    ),
    "no-code": (
        "    # BEGIN STEP 1: it\n    # TODO: it\n    # END STEP 1\n    return 1\n",
        "line 5: the region of step 1 has no reference code",
    ),
    "nested": (
        "    # BEGIN STEP 1: it\n    # TODO: it\n    # BEGIN STEP 2: more\n    # TODO: more\n"
        "    return 1\n    # END STEP 2\n    # END STEP 1\n",
        "line 7: BEGIN STEP 2 inside step 1's region (line 5)",
    ),
    "end-alone": ("    return 1\n    # END STEP 1\n", "line 6: END STEP 1 without a BEGIN"),
    "misspelt": (
        "    # BEGIN STEP one: it\n    # TODO: it\n    return 1\n    # END STEP 1\n",
        "line 5: '# BEGIN STEP one: it' is no marker",
    ),
    "no-what": (
        "    # BEGIN STEP 1\n    # TODO: it\n    return 1\n    # END STEP 1\n",
        "line 5: '# BEGIN STEP 1' is no marker",
    ),
    "end-indented-elsewhere": (
        "    # BEGIN STEP 1: it\n    # TODO: it\n    if True:\n        return 1\n        # END STEP 1\n",
        "line 9: END STEP 1 is not indented as its BEGIN (line 5)",
    ),
    "end-todo-astray": (
        "    # BEGIN STEP 1: it\n    # TODO: it\n    x = 1\n    # END TODO\n    return x\n"
        "    # END STEP 1\n",
        "line 8: `# END TODO` ends the TODO text of step 1's region",
    ),
    "half-a-statement": (
        "    # BEGIN STEP 1: it\n    # TODO: it\n    if True:\n        return 1\n    # END STEP 1\n"
        "    else:\n        return 2\n",
        "the stub made from it does not parse",
    ),
}


@pytest.mark.parametrize("body, message", BAD.values(), ids=BAD.keys())
def test_a_malformed_marker_is_named_with_its_file_and_line(body, message):
    source = f"from dojo.console import say\n\n\ndef task():\n{body}"
    with pytest.raises(stubs.StubError) as caught:
        make(source)
    assert str(caught.value).startswith("solutions/k99_demo.py"), str(caught.value)
    assert message in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    "source, place",
    [
        ("# BEGIN STEP 1: it\n# TODO: it\nLIMIT = 3\n# END STEP 1\n", "no function"),
        (
            "class A:\n    # BEGIN STEP 1: it\n    # TODO: it\n    LIMIT = 3\n    # END STEP 1\n",
            "class A's body",
        ),
    ],
    ids=["module", "class-body"],
)
def test_a_region_outside_a_function_is_refused(source, place):
    with pytest.raises(stubs.StubError, match=f"line [0-9]+: the region of step 1 is in {place}"):
        make(f"from dojo.console import say\n\n\n{source}")


def test_markers_inside_a_string_are_text_not_markers():
    source = _one_region("it").replace("def task", 'DOC = """\n# END STEP 7\n"""\n\n\ndef task')
    assert [r.step for r in stubs.regions(source, "x")] == [1]


def test_write_makes_only_the_files_that_changed(tmp_path):
    kata = curriculum.find("k04")
    assert stubs.write([kata], tmp_path) == [tmp_path / f"{kata.module}.py"]
    made = (tmp_path / f"{kata.module}.py").read_text(encoding="utf-8")
    assert made == stubs.stub(kata)
    assert stubs.write([kata], tmp_path) == [], "an unchanged stub is not written again"
    assert any(_todo(n) for n in ast.walk(ast.parse(made))), "k04's stub raises its todos"
    assert list(tmp_path.iterdir()) == [tmp_path / f"{kata.module}.py"], "nothing left beside it"


def _todo(node) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "KataTodo"


def test_the_solved_reference_has_no_marker_and_no_todo_text():
    """``dojo solution`` shows (and diffs against) the reference as a finished kata reads."""
    for kata in curriculum.katas():
        solved = stubs.solved(kata)
        ast.parse(solved)
        for line in solved.splitlines():
            text = line.strip()
            assert not text.startswith(("# BEGIN STEP", "# END STEP", "# END TODO")), (
                f"{kata.id}: a marker is left in the solved reference: {line!r}"
            )
        regions = stubs.regions(kata.solution_file.read_text(encoding="utf-8"), kata.id)
        for region in regions:
            assert region.todo[0] not in solved.splitlines(keepends=False), (
                f"{kata.id}: step {region.step}'s TODO text is left in the solved reference"
            )
