"""A kata's stub, made from its reference: ``solutions/kNN_topic.py`` is the one source.

Each part the learner writes is a region of a function's body in the reference, between two
marker comments:

    # BEGIN STEP 1: the tutorial's all-reduce of every rank's number
    # TODO: every rank returns two tensors ...  <- the stub's TODO text: the comment lines
    # ...                                          right after BEGIN (the first says TODO)
    tensor = torch.tensor([rank], device=...)  <- the reference's code, up to END
    # END STEP 1

Where the reference's code starts with a comment of its own, a line ``# END TODO`` ends the TODO
text before it. The stub is the reference with each region turned into its TODO lines and
``raise KataTodo("kNN", 1, "the tutorial's all-reduce of every rank's number")`` at the BEGIN
line's indentation, wrapped as ``ruff format`` wraps it, and ``KataTodo`` imported where isort
puts it. ``dojo reset`` and the maintainers' gate both make stubs here: standard library only
(no ruff), the same bytes every time.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dojo import curriculum

LINE_LENGTH = 100  # pyproject.toml's line-length: a stub is formatted as the code around it
_BEGIN = re.compile(r"# BEGIN STEP (\d+): (\S.*?)\s*$")
_END = re.compile(r"# END STEP (\d+)\s*$")
_END_TODO = "# END TODO"  # ends the TODO text where the reference's code starts with a comment
_MARKER = re.compile(r"#\s*(BEGIN|END)\s*(STEP|TODO)")  # meant as a marker, spelt right or not
_SHAPE = (
    "a region is `# BEGIN STEP N: what the step is`, its `# TODO` lines (and `# END TODO` where "
    "the code starts with a comment), its code, `# END STEP N`"
)
_FIRST_PARTY = ("dojo", "katas", "solutions", "tests", "benchmarks")  # pyproject's isort's
_TODO_MODULE, _TODO = "dojo.todo", "KataTodo"


class StubError(ValueError):
    """A reference whose markers make no stub; the message names the file and the line."""


@dataclass(frozen=True)
class Region:
    """A part of the reference the learner writes: lines ``begin`` to ``end`` (its markers), counted
    from 1."""

    step: int
    what: str  # the KataTodo's third argument: what the step is
    begin: int
    end: int
    indent: str
    todo: tuple[str, ...]  # the stub's TODO comment lines, as written


def stub(kata: curriculum.Kata) -> str:
    """The kata's stub, made from ``solutions/kNN_topic.py`` (StubError where its markers are wrong,
    OSError where it is missing)."""
    source = kata.solution_file.read_text(encoding="utf-8")
    return stub_source(source, kata.id, kata.relative(kata.solution_file))


def write(katas: Iterable[curriculum.Kata] | None = None, folder: Path | None = None) -> list[Path]:
    """Write the katas' stubs (default: all) into ``folder`` (default: ``katas/``), each as
    ``kNN_topic.py``; the files that changed. A file that is already the stub is left alone."""
    folder = folder or curriculum.ROOT / "katas"
    changed = []
    for kata in curriculum.katas() if katas is None else katas:
        text, target = stub(kata), folder / f"{kata.module}.py"
        if target.exists() and target.read_text(encoding="utf-8") == text:
            continue
        part = target.with_name(f".{target.name}.{os.getpid()}.part")
        part.write_text(text, encoding="utf-8")
        os.replace(part, target)  # a process importing it meanwhile reads one whole version
        # Python would trust its compile of a file of the same size saved in the same second
        Path(importlib.util.cache_from_source(str(target))).unlink(missing_ok=True)
        changed.append(target)
    return changed


def stub_source(source: str, kata_id: str, where: str) -> str:
    """The stub of the reference ``source`` (the file ``where``, for errors) of kata ``kata_id``."""
    tree = _parse(source, where)
    found = _regions(tree, source.splitlines(), where)
    if not found:
        return source
    lines = source.splitlines(keepends=True)
    edits = [_import_edit(tree, lines, where)]
    for region in found:
        made = _raise(kata_id, region.step, region.what, region.indent)
        edits.append((region.begin - 1, region.end, [f"{t}\n" for t in (*region.todo, *made)]))
    out, at = [], 0
    for start, stop, replacement in edits:
        out += lines[at:start] + replacement
        at = stop
    text = "".join(out + lines[at:])
    try:
        ast.parse(text)
    except SyntaxError as error:
        raise StubError(
            f"{where}: the stub made from it does not parse (its line {error.lineno}: {error.msg}): "
            "does a region end inside a statement? A region is whole statements of one block"
        ) from None
    return text


def solved(kata: curriculum.Kata) -> str:
    """The reference as a learner's finished file reads: its markers and TODO lines left out."""
    source = kata.solution_file.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    dropped = set()
    for region in regions(source, kata.relative(kata.solution_file)):
        dropped |= {
            region.begin,
            region.end,
            *range(region.begin + 1, region.begin + 1 + len(region.todo)),
        }
        after_todo = region.begin + len(region.todo) + 1
        if lines[after_todo - 1].strip() == _END_TODO:
            dropped.add(after_todo)
    return "".join(line for number, line in enumerate(lines, 1) if number not in dropped)


def regions(source: str, where: str) -> list[Region]:
    """The regions of a reference, in order; StubError names the first malformed marker."""
    return _regions(_parse(source, where), source.splitlines(), where)


def _parse(source: str, where: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as error:
        raise StubError(f"{where}, line {error.lineno}: does not parse: {error.msg}") from None


def _regions(tree: ast.Module, lines: list[str], where: str) -> list[Region]:
    scopes, comments = _read(tree, lines)
    found, begun, todo_end = [], None, None  # begun: the open region's (step, what, line, indent)
    for number in comments:
        text = lines[number - 1].lstrip()
        indent = lines[number - 1][: -len(text)]
        if not _MARKER.match(text):
            continue
        begin, end = _BEGIN.match(text), _END.match(text)
        if begin and begun:
            raise StubError(
                f"{where}, line {number}: BEGIN STEP {begin[1]} inside step {begun[0]}'s region "
                f"(line {begun[2]}), which has no END yet: regions do not nest"
            )
        if begin:
            begun, todo_end = (int(begin[1]), begin[2], number, indent), None
        elif text.rstrip() == _END_TODO:
            if not begun or todo_end:
                raise StubError(
                    f"{where}, line {number}: `{_END_TODO}` outside a region's TODO text: {_SHAPE}"
                )
            todo_end = number
        elif end and not begun:
            raise StubError(f"{where}, line {number}: END STEP {end[1]} without a BEGIN: {_SHAPE}")
        elif end:
            step, what, start, opened_indent = begun
            if int(end[1]) != step:
                raise StubError(
                    f"{where}, line {number}: END STEP {end[1]} closes the region of step "
                    f"{step} (BEGIN at line {start}): the step numbers must match"
                )
            if indent != opened_indent:
                raise StubError(
                    f"{where}, line {number}: END STEP {end[1]} is not indented as its BEGIN "
                    f"(line {start}): the stub's raise goes at the BEGIN's indentation"
                )
            found.append(_region(scopes, lines, where, begun, number, todo_end))
            begun = None
        else:
            raise StubError(f"{where}, line {number}: {text!r} is no marker: {_SHAPE}")
    if begun:
        raise StubError(
            f"{where}, line {begun[2]}: BEGIN STEP {begun[0]} has no END STEP {begun[0]} after it"
        )
    return found


def _region(scopes, lines, where, begun, end, todo_end) -> Region:
    """The region from BEGIN (``begun``) to the END at line ``end``, checked."""
    step, what, begin, indent = begun
    todo = []
    for line in lines[begin : (todo_end or end) - 1]:
        if not line.lstrip().startswith("#"):
            break
        todo.append(line)
    if not todo or not todo[0].lstrip().startswith("# TODO"):
        raise StubError(
            f"{where}, line {begin + 1}: the region of step {step} has no TODO: the comment lines "
            "right after its BEGIN are the stub's TODO text, the first starting `# TODO`"
        )
    if todo_end and todo_end != begin + len(todo) + 1:
        raise StubError(
            f"{where}, line {todo_end}: `{_END_TODO}` ends the TODO text of step {step}'s region: "
            f"it goes right after the TODO lines (line {begin + len(todo) + 1}), before the code"
        )
    code = [
        n
        for n in range((todo_end or begin + len(todo)) + 1, end)
        if lines[n - 1].strip() and not lines[n - 1].lstrip().startswith("#")
    ]
    if not code:
        raise StubError(
            f"{where}, line {begin}: the region of step {step} has no reference code between its "
            "TODO and its END"
        )
    owner = _innermost(scopes, code[0])
    if not isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef)) or begin <= owner.lineno:
        place = f"class {owner.name}'s body" if isinstance(owner, ast.ClassDef) else "no function"
        raise StubError(
            f"{where}, line {begin}: the region of step {step} is in {place}: a region is part "
            "of a function's body (the stub raises its todo there)"
        )
    return Region(step, what, begin, end, indent, tuple(todo))


def _read(tree: ast.Module, lines: list[str]) -> tuple[list[ast.AST], list[int]]:
    """Every function and class (innermost last where they nest), and the lines that hold a
    comment and nothing else (never a line of text inside a string)."""
    scopes, in_strings = [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scopes.append(node)
        elif isinstance(node, (ast.Constant, ast.JoinedStr)) and node.end_lineno > node.lineno:
            in_strings.update(range(node.lineno + 1, node.end_lineno + 1))
    comments = [
        number
        for number, line in enumerate(lines, 1)
        if line.lstrip().startswith("#") and number not in in_strings
    ]
    return sorted(scopes, key=lambda node: node.body[0].lineno), comments


def _innermost(scopes: list[ast.AST], line: int) -> ast.AST | None:
    """The innermost function or class whose body holds ``line``."""
    holding = [n for n in scopes if n.body[0].lineno <= line <= n.end_lineno]
    return holding[-1] if holding else None


# ----------------------------------------------------------------- written as ruff writes it


def _raise(kata_id: str, step: int, what: str, indent: str) -> list[str]:
    """``raise KataTodo(...)`` as ``ruff format`` wraps it: one line if it fits; else the
    arguments on one indented line; else one per line, with a trailing comma."""
    args = [_literal(kata_id), str(step), _literal(what)]
    one = f"{indent}raise {_TODO}({', '.join(args)})"
    if _width(one) <= LINE_LENGTH:
        return [one]
    inner = indent + "    "
    if _width(f"{inner}{', '.join(args)}") <= LINE_LENGTH:
        return [f"{indent}raise {_TODO}(", f"{inner}{', '.join(args)}", f"{indent})"]
    return [f"{indent}raise {_TODO}(", *(f"{inner}{a}," for a in args), f"{indent})"]


def _literal(text: str) -> str:
    """A string literal in ruff's quotes: double, unless single ones need fewer escapes."""
    quote = "'" if text.count('"') > text.count("'") else '"'
    return quote + text.replace("\\", "\\\\").replace(quote, "\\" + quote) + quote


def _width(line: str) -> int:
    """Columns, as ruff counts them: wide characters (Chinese) take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def _import_edit(tree: ast.Module, lines: list[str], where: str) -> tuple[int, int, list[str]]:
    """Where ``from dojo.todo import KataTodo`` goes, as isort puts it: into the module's own
    import from dojo.todo, or a line of its own in order among the first-party from-imports.
    (start, stop, lines): lines[start:stop] become those lines."""
    first_party = [
        node
        for node in tree.body
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and _first_party(node.module))
        or (isinstance(node, ast.Import) and _first_party(node.names[0].name))
    ]
    froms = [node for node in first_party if isinstance(node, ast.ImportFrom)]
    for node in froms:
        if node.module == _TODO_MODULE:
            names = [(a.name, a.asname) for a in node.names]
            if (_TODO, None) not in names:
                names.append((_TODO, None))
            split = lines[node.end_lineno - 1].rstrip().endswith(")")  # as isort keeps it
            return node.lineno - 1, node.end_lineno, _from_import(names, split)
    if not first_party:
        raise StubError(
            f"{where}: imports nothing from dojo at the top, so its stub's `from {_TODO_MODULE} "
            f"import {_TODO}` has no place among the first-party imports: import the kata API "
            "there (dojo.console's run_program runs a kata's program)"
        )
    after = [n for n in froms if n.module.lower() > _TODO_MODULE]  # ``import x`` lines come first
    at = after[0].lineno - 1 if after else first_party[-1].end_lineno
    return at, at, _from_import([(_TODO, None)], False)


def _first_party(module: str) -> bool:
    return module.split(".")[0] in _FIRST_PARTY


def _from_import(names: list[tuple[str, str | None]], split: bool) -> list[str]:
    """``from dojo.todo import ...`` as isort writes it: names ordered constants, classes, then the
    rest; one line if it fits and was not split before."""

    def key(pair):
        name = pair[0]
        kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
        return kind, name.lower(), name

    shown = [f"{n} as {a}" if a else n for n, a in sorted(names, key=key)]
    one = f"from {_TODO_MODULE} import {', '.join(shown)}"
    if not split and _width(one) <= LINE_LENGTH:
        return [f"{one}\n"]
    return [f"from {_TODO_MODULE} import (\n", *(f"    {s},\n" for s in shown), ")\n"]
