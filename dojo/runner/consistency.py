"""The maintainer's consistency checks: the curriculum, the files on disk and the README agree.

Every kata has a lesson (THE IDEA, STEPS, WHAT THE TESTS CHECK, RUN IT), steps with 2-3 hint
tiers, a spec, a stub that raises a ``KataTodo`` for exactly its steps and otherwise equals its
solution, a solution without todos, and a pristine copy of its stub identical to ``katas/``.
"""

from __future__ import annotations

import ast
import copy
import re
import sys

from dojo import curriculum

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib
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
        found += readme_problems()
        zh_parts = set(curriculum.parts("zh").values()) - set(curriculum.parts("en").values())
        if len(zh_parts) < len(curriculum.parts("en")):
            found.append("dojo/curriculum/zh/parts.toml must name every part in Chinese")
        if not (curriculum.ROOT / "README.zh-CN.md").exists():
            found.append("README.zh-CN.md (the quick start in Chinese) is missing")
        elif "README.zh-CN.md" not in (curriculum.ROOT / "README.md").read_text(encoding="utf-8"):
            found.append("README.md does not link README.zh-CN.md")
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
        found += chinese_problems(kata)
    return found


# ------------------------------------------------------------------------ the Chinese lessons

ZH_SECTIONS = {
    "THE IDEA": "思路",
    "STEPS": "步骤",
    "WHAT THE TESTS CHECK": "测试检查什么",
    "RUN IT": "运行",
}
_CODE = re.compile(r"``([^`]+)``|`([^`]+)`")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\(\))?$")


def chinese_problems(kata: curriculum.Kata) -> list[str]:
    """Every kata has its Chinese lesson, title and hints (dojo/curriculum/zh/kNN_topic.toml),
    with the lesson's four sections, the same steps as the English, and no code identifier the
    kata does not have."""
    path = curriculum.ZH_DIR / f"{kata.module}.toml"
    where = f"dojo/curriculum/zh/{kata.module}.toml"
    if not path.exists():
        return [f"{kata.id}: no Chinese lesson and hints: write {where}"]
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        return [f"{where} does not parse: {error}"]
    found = [
        f"{where} lacks {key!r}" for key in ("title", "teaches", "lesson") if not data.get(key)
    ]
    lesson = data.get("lesson", "")
    in_english = next(k for k in curriculum.katas("en") if k.id == kata.id)
    english = {step.number: step for step in in_english.steps}
    steps = {int(s.get("number", 0)): s for s in data.get("step", ())}
    if set(steps) != set(english):
        found.append(
            f"{where} has steps {sorted(steps)}, the curriculum {sorted(english)}: both languages name the same steps"
        )
    for number, step in sorted(steps.items()):
        if not step.get("title") or not 2 <= len(step.get("hints", ())) <= 3:
            found.append(f"{where} step {number}: needs a title and 2 or 3 hints")
    lacking = [zh for zh in ZH_SECTIONS.values() if zh not in lesson]
    if lesson and lacking:
        found.append(f"{where}: the lesson lacks the sections {', '.join(lacking)}")
    english_lesson = curriculum.lesson(kata, "en") or ""
    if lesson and _listed_steps(lesson, "步骤", "测试检查什么") != _listed_steps(
        english_lesson, "STEPS", "WHAT THE TESTS CHECK"
    ):
        found.append(f"{where}: the lesson's 步骤 lists other step numbers than the English STEPS")
    known = "\n".join(p.read_text(encoding="utf-8") for p in (kata.kata_file, kata.solution_file))
    texts = [lesson] + [h for s in steps.values() for h in s.get("hints", ())]
    known += "\n".join(h for s in english.values() for h in s.hints)
    for text in texts:
        for match in _CODE.finditer(text):
            code = (match.group(1) or match.group(2)).strip()
            name = code.removesuffix("()").split(".")[-1]
            if _IDENTIFIER.match(code) and not re.search(rf"\b{re.escape(name)}\b", known):
                found.append(f"{where} names `{code}`, which katas/{kata.module}.py does not have")
    return found


def _listed_steps(lesson: str, heading: str, next_heading: str) -> list[int]:
    section = lesson.split(heading, 1)[-1].split(next_heading, 1)[0] if heading in lesson else ""
    return [int(n) for n in re.findall(r"^\s*(\d+)\.\s", section, flags=re.M)]


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


def catalogue_table() -> str:
    """How many mistakes and right answers each kata's catalogue holds (the README's)."""
    from dojo import mistakes

    rows = ["| kata | mistakes that must fail, naming themselves | right answers written another way |",
            "| --- | --- | --- |"]  # fmt: skip
    for kata in curriculum.katas():
        catalogue = mistakes.load(kata)
        if catalogue is not None:
            rows.append(
                f"| {kata.id} | {len(catalogue.MISTAKES)} | {len(catalogue.RIGHT_ANSWERS)} |"
            )
    return "\n".join(rows)


# The READMEs' blocks that are made, not written: (file, name) -> what makes them.
README_BLOCKS = {
    ("README.md", "kata-table"): curriculum.kata_table,
    ("README.md", "catalogue-table"): catalogue_table,
    ("README.zh-CN.md", "kata-table"): lambda: curriculum.kata_table("zh"),
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start (made by `python -m dojo dev readme`) -->", f"<!-- {name}:end -->"


def readme_problems() -> list[str]:
    found = []
    for (file, name), make in README_BLOCKS.items():
        path = curriculum.ROOT / file
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        start, end = _markers(name)
        if start not in text or end not in text:
            found.append(f"{file} has no {name} markers ({start} ... {end})")
        elif text.split(start, 1)[1].split(end, 1)[0].strip() != make():
            found.append(f"{file}'s {name} is stale: run `python -m dojo dev readme`")
    return found


def write_readme_tables() -> None:
    for (file, name), make in README_BLOCKS.items():
        path = curriculum.ROOT / file
        text = path.read_text(encoding="utf-8")
        start, end = _markers(name)
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        path.write_text(f"{head}{start}\n{make()}\n{end}{tail}", encoding="utf-8")
