"""The maintainer's consistency checks: the curriculum, the files on disk and the README agree.

Every kata has a lesson (THE IDEA, STEPS, WHAT THE TESTS CHECK, RUN IT), steps with 2-3 hint
tiers, a spec, a stub that raises a ``KataTodo`` for exactly its steps and otherwise equals its
solution, a solution without todos, and a pristine copy of its stub identical to ``katas/``.
"""

from __future__ import annotations

import ast
import copy

from dojo import curriculum
from dojo.runner import reset

LESSON_SECTIONS = ("THE IDEA", "STEPS", "WHAT THE TESTS CHECK", "RUN IT")


def problems(katas: list[curriculum.Kata] | None = None) -> list[str]:
    """Everything that disagrees between dojo/curriculum/, katas/, solutions/, tests/,
    dojo/pristine/ and README. ``katas`` restricts the check to those (and skips the
    whole-repository checks)."""
    full = katas is None
    katas = list(curriculum.katas()) if full else katas
    found = []
    if full:
        listed = {k.module for k in curriculum.katas()}
        for folder in ("katas", "solutions", "dojo/mistakes"):
            for path in sorted((curriculum.ROOT / folder).glob("k[0-9][0-9]_*.py")):
                if path.stem not in listed:
                    found.append(f"{folder}/{path.name} is not in dojo/curriculum/")
        for path in sorted((curriculum.ROOT / "tests").glob("*.py")):
            if path.name != "__init__.py" and path.stem.removeprefix("test_") not in listed:
                found.append(
                    f"tests/{path.name}: tests/ holds one spec per kata (test_kNN_topic.py); "
                    "the tooling's own tests go in dojo/tests/, catalogues in dojo/mistakes/"
                )
    for kata in katas:
        found += _kata_problems(kata)
    found += reset.pristine_problems(katas)
    if full:
        readme = curriculum.ROOT / "README.md"
        text = readme.read_text(encoding="utf-8") if readme.exists() else ""
        if curriculum.TABLE_START not in text or curriculum.TABLE_END not in text:
            found.append("README.md has no kata table markers")
        elif _readme_table(text) != curriculum.kata_table():
            found.append("README.md's kata table is stale: run `python -m dojo dev readme`")
    return found


def _kata_problems(kata: curriculum.Kata) -> list[str]:
    found = []
    if kata.id != kata.module[:3]:
        found.append(
            f"{kata.relative(kata.curriculum_file)}: id {kata.id!r} does not match the file name"
        )
    missing = [p for p in (kata.kata_file, kata.solution_file, kata.test_file) if not p.exists()]
    found += [f"{kata.id}: {kata.relative(p)} is missing" for p in missing]
    if not kata.steps:
        found.append(f"{kata.id}: the curriculum lists no steps")
    for step in kata.steps:
        if not 2 <= len(step.hints) <= 3:
            found.append(
                f"{kata.id} step {step.number}: needs 2 or 3 hint tiers (a nudge first, nearly the answer "
                f"last), has {len(step.hints)}"
            )
    if kata.world_size < 1:
        found.append(f"{kata.id}: world_size must be at least 1")
    if kata.kata_file.exists():
        found += _stub_problems(kata)
    if kata.solution_file.exists() and _raises_todo(kata.solution_file):
        found.append(f"solutions/{kata.module}.py raises a KataTodo: a solution must be complete")
    if kata.kata_file.exists() and kata.solution_file.exists():
        found += stub_differences(kata)
    return found


def _stub_problems(kata: curriculum.Kata) -> list[str]:
    """The stub teaches (a lesson with every section) and raises a todo for exactly its steps."""
    try:
        tree = ast.parse(kata.kata_file.read_text(encoding="utf-8"))
    except SyntaxError as error:
        return [f"katas/{kata.module}.py does not parse: {error}"]
    found = []
    doc = ast.get_docstring(tree) or ""
    if not doc:
        found.append(f"katas/{kata.module}.py has no lesson (module docstring)")
    else:
        lacking = [s for s in LESSON_SECTIONS if s not in doc]
        if lacking:
            found.append(
                f"katas/{kata.module}.py: the lesson (module docstring) lacks {', '.join(lacking)}"
            )
    raised = set()
    for node in ast.walk(tree):
        if _is_todo(node):
            args = [a.value for a in node.args[:2] if isinstance(a, ast.Constant)]
            if len(args) == 2:
                if args[0] != kata.id:
                    found.append(
                        f"katas/{kata.module}.py raises a todo for {args[0]}, not {kata.id}"
                    )
                raised.add(args[1])
    steps = {s.number for s in kata.steps}
    for number in sorted(steps - raised):
        found.append(f"katas/{kata.module}.py has no KataTodo for step {number}")
    for number in sorted(raised - steps):
        found.append(
            f"katas/{kata.module}.py raises a todo for step {number}, which the curriculum lacks"
        )
    return found


def _is_todo(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "KataTodo"


def _raises_todo(path) -> bool:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except SyntaxError:
        return False  # the solutions' pytest run reports it
    return any(_is_todo(n) for n in ast.walk(tree))


# ------------------------------------------------------------------------ stub = solution, but the todos


def stub_differences(kata: curriculum.Kata) -> list[str]:
    """A stub equals its solution everywhere except inside the functions whose stub raises the
    todo (their names, signatures and docstrings included): the learner writes exactly those."""
    where = first_difference(
        kata.kata_file.read_text(encoding="utf-8"), kata.solution_file.read_text(encoding="utf-8")
    )
    if where is None:
        return []
    return [
        f"{kata.id}: the stub and its solution differ outside the functions the learner writes, first at "
        f"line {where[0]} of katas/{kata.module}.py / line {where[1]} of solutions/{kata.module}.py "
        "(only the bodies of functions whose stub raises a KataTodo may differ)"
    ]


def first_difference(stub_source: str, solution_source: str) -> tuple[int, int] | None:
    """The lines (stub, solution) of the first top-level statement that differs once the todo
    functions' bodies are cut away, or None when they agree."""
    try:
        stub, solution = ast.parse(stub_source), ast.parse(solution_source)
    except SyntaxError:
        return None  # reported elsewhere
    todo_functions = _todo_functions(stub)
    ours, theirs = _hollowed(stub, todo_functions), _hollowed(solution, todo_functions)
    for index in range(max(len(ours), len(theirs))):
        mine = ours[index] if index < len(ours) else None
        reference = theirs[index] if index < len(theirs) else None
        if mine is None or reference is None or ast.dump(mine) != ast.dump(reference):
            return (
                mine.lineno if mine is not None else len(stub_source.splitlines()),
                reference.lineno if reference is not None else len(solution_source.splitlines()),
            )
    return None


def _todo_functions(tree: ast.Module) -> set[str]:
    found = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and any(
                    _is_todo(n) for n in ast.walk(child)
                ):
                    found.add(name)
                else:
                    visit(child, f"{name}.")

    visit(tree, "")
    return found


def _hollowed(tree: ast.Module, todo_functions: set[str]) -> list[ast.stmt]:
    """The module's statements with every todo function's body cut to its docstring, and the
    ``KataTodo`` import dropped."""
    tree = copy.deepcopy(tree)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if name in todo_functions:
                    doc = ast.get_docstring(child, clean=False)
                    child.body = [ast.Expr(ast.Constant(doc))] if doc is not None else []
                else:
                    visit(child, f"{name}.")

    visit(tree, "")
    body = []
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module == "dojo.todo":
            statement.names = [n for n in statement.names if n.name != "KataTodo"]
            if not statement.names:
                continue
        body.append(statement)
    return body


# ---------------------------------------------------------------------------------------- README


def _readme_table(text: str) -> str:
    return text.split(curriculum.TABLE_START, 1)[1].split(curriculum.TABLE_END, 1)[0].strip()


def write_readme_table() -> None:
    readme = curriculum.ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    head, rest = text.split(curriculum.TABLE_START, 1)
    _, tail = rest.split(curriculum.TABLE_END, 1)
    readme.write_text(
        f"{head}{curriculum.TABLE_START}\n{curriculum.kata_table()}\n{curriculum.TABLE_END}{tail}",
        encoding="utf-8",
    )
