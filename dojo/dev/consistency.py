"""The maintainer's consistency checks: the curriculum, the files on disk and the README agree.

Every kata has a lesson (THE IDEA, STEPS, WHAT THE TESTS CHECK, RUN IT), steps with 2-3 hint
tiers, a spec, a stub that raises a ``KataTodo`` for exactly its steps and otherwise equals its
solution, a solution without todos, and a pristine copy of its stub.

The stub checked is the SHIPPED one, ``dojo/pristine/kNN_topic.py``, whatever a learner has
written in ``katas/`` (their work is not the maintainers' to check). Where ``katas/`` differs
from it, ``unshipped`` says so: a learner's work, or a maintainer's stub not copied yet.
"""

from __future__ import annotations

import ast
import copy
import filecmp
import re
import shutil
import sys
from pathlib import Path

from dojo import curriculum

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

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
        # katas/ is the learner's: a file of theirs there is theirs (``unshipped`` names it).
        for folder in ("solutions", "dojo/dev/mistakes"):
            for path in sorted((curriculum.ROOT / folder).glob("k[0-9][0-9]_*.py")):
                if path.stem not in listed:
                    found.append(f"{folder}/{path.name} is not in dojo/curriculum/")
        for path in sorted((curriculum.ROOT / "tests").glob("*.py")):
            if path.name != "__init__.py" and path.stem.removeprefix("test_") not in listed:
                found.append(
                    f"tests/{path.name}: tests/ holds one spec per kata (test_kNN_topic.py); "
                    "the tooling's own tests go in dojo/tests/, catalogues in dojo/dev/mistakes/"
                )
    for kata in katas:
        found += _kata_problems(kata)
    found += pristine_problems(katas)
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
    stub = shipped_stub(kata)
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
    if stub.exists():
        found += stub_problems(kata, stub)
    if kata.solution_file.exists() and _raises_todo(kata.solution_file):
        found.append(f"solutions/{kata.module}.py raises a KataTodo: a solution must be complete")
    if stub.exists() and kata.solution_file.exists():
        found += stub_differences(kata, stub)
        found += chinese_problems(kata)
    return found


def shipped_stub(kata: curriculum.Kata) -> Path:
    """The stub the maintainers ship: its copy in dojo/pristine/ (``katas/`` may hold a learner's
    work); ``katas/``'s own file only while that copy does not exist (reported as missing)."""
    return kata.pristine_file if kata.pristine_file.exists() else kata.kata_file


def _shown(path: Path) -> str:
    return path.relative_to(curriculum.ROOT).as_posix()


# ------------------------------------------------------------------- the shipped stubs' copies


def pristine_problems(katas: list[curriculum.Kata]) -> list[str]:
    """Every kata has its shipped stub in dojo/pristine/, and that folder holds nothing else."""
    problems = []
    for kata in katas:
        if kata.kata_file.exists() and not kata.pristine_file.exists():
            problems.append(
                f"{kata.id}: the shipped stub dojo/pristine/{kata.module}.py is missing (`dojo reset` "
                f"and this check need it): a maintainer copies the stub there, `cp katas/{kata.module}.py "
                "dojo/pristine/`, and commits both"
            )
    listed = {k.module for k in curriculum.katas()}
    for stray in sorted((curriculum.DOJO / "pristine").glob("*.py")):
        if stray.stem not in listed:
            problems.append(f"dojo/pristine/{stray.name} belongs to no kata in dojo/curriculum/")
    return problems


def unshipped(katas: list[curriculum.Kata] | None = None) -> list[str]:
    """The files in ``katas/`` that are not the shipped stubs: a learner's work (or a stub a
    maintainer changed and has not copied to dojo/pristine/ yet); with every kata, also files
    in katas/ that belong to none."""
    full = katas is None
    katas = list(curriculum.katas()) if full else katas
    found = [
        f"katas/{k.module}.py"
        for k in katas
        if k.kata_file.exists()
        and k.pristine_file.exists()
        and not filecmp.cmp(k.kata_file, k.pristine_file, shallow=False)
    ]
    if full:
        listed = {k.module for k in katas}
        found += [
            f"katas/{path.name}"
            for path in sorted((curriculum.ROOT / "katas").glob("k[0-9][0-9]_*.py"))
            if path.stem not in listed
        ]
    return found


def unshipped_text(files: list[str]) -> str:
    """What the gate says of them: it checked the shipped stubs, and what a maintainer does."""
    which = files[0] if len(files) == 1 else f"{len(files)} files in katas/ ({', '.join(files)})"
    return (
        f"{which} {'is not the shipped stub' if len(files) == 1 else 'are not the shipped stubs'}: "
        "the checks use "
        "the shipped copies in dojo/pristine/, whatever katas/ holds (a learner's work stays "
        "where it is). A maintainer who changed a stub copies it there (`cp katas/kNN_topic.py "
        "dojo/pristine/`) and commits both: CI, on a clean checkout, fails while they differ."
    )


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
    stub = shipped_stub(kata)
    known = "\n".join(p.read_text(encoding="utf-8") for p in (stub, kata.solution_file))
    texts = [lesson] + [h for s in steps.values() for h in s.get("hints", ())]
    known += "\n".join(h for s in english.values() for h in s.hints)
    for text in texts:
        for match in _CODE.finditer(text):
            code = (match.group(1) or match.group(2)).strip()
            name = code.removesuffix("()").split(".")[-1]
            if _IDENTIFIER.match(code) and not re.search(rf"\b{re.escape(name)}\b", known):
                found.append(f"{where} names `{code}`, which {_shown(stub)} does not have")
    return found


def _listed_steps(lesson: str, heading: str, next_heading: str) -> list[int]:
    section = lesson.split(heading, 1)[-1].split(next_heading, 1)[0] if heading in lesson else ""
    return [int(n) for n in re.findall(r"^\s*(\d+)\.\s", section, flags=re.M)]


def stub_problems(kata: curriculum.Kata, stub: Path) -> list[str]:
    """The stub teaches (a lesson with every section) and raises a todo for exactly its steps."""
    name = _shown(stub)
    try:
        tree = ast.parse(stub.read_text(encoding="utf-8"))
    except SyntaxError as error:
        return [f"{name} does not parse: {error}"]
    found = []
    doc = ast.get_docstring(tree) or ""
    if not doc:
        found.append(f"{name} has no lesson (module docstring)")
    else:
        lacking = [s for s in LESSON_SECTIONS if s not in doc]
        if lacking:
            found.append(f"{name}: the lesson (module docstring) lacks {', '.join(lacking)}")
    raised = set()
    for node in ast.walk(tree):
        if _is_todo(node):
            args = [a.value for a in node.args[:2] if isinstance(a, ast.Constant)]
            if len(args) == 2:
                if args[0] != kata.id:
                    found.append(f"{name} raises a todo for {args[0]}, not {kata.id}")
                raised.add(args[1])
    steps = {s.number for s in kata.steps}
    for number in sorted(steps - raised):
        found.append(f"{name} has no KataTodo for step {number}")
    for number in sorted(raised - steps):
        found.append(f"{name} raises a todo for step {number}, which the curriculum lacks")
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


def stub_differences(kata: curriculum.Kata, stub: Path | None = None) -> list[str]:
    """A stub (default: the shipped one) equals its solution everywhere except inside the
    functions whose stub raises the todo (their names, signatures and docstrings included): the
    learner writes exactly those."""
    stub = stub or shipped_stub(kata)
    where = first_difference(
        stub.read_text(encoding="utf-8"), kata.solution_file.read_text(encoding="utf-8")
    )
    if where is None:
        return []
    return [
        f"{kata.id}: the stub and its solution differ outside the functions the learner writes, first at "
        f"line {where[0]} of {_shown(stub)} / line {where[1]} of solutions/{kata.module}.py "
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
    from dojo.dev import mistakes

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


# ------------------------------------------------------------------- every test names its step


def coverage_problems(kata: curriculum.Kata, collected: list[dict]) -> list[str]:
    """From a ``--collect-only`` log of the kata's spec: tests without a step (or with one the
    kata lacks), and steps that no test checks."""
    known = {step.number for step in kata.steps}
    problems, checked = [], set()
    for record in collected:
        steps = set(record.get("steps", ()))
        name = record["test"].split("::", 1)[-1]
        if len(steps) != 1:
            problems.append(
                f"{kata.id}: {name} says which step it checks with exactly one @pytest.mark.step(N), "
                f"it has {sorted(steps) or 'none'}"
            )
        elif not steps <= known:
            problems.append(
                f"{kata.id}: {name} is marked step {min(steps)}, which the curriculum lacks"
            )
        checked |= steps
    for number in sorted(known - checked):
        problems.append(f"{kata.id}: no test checks step {number} ({kata.step(number).title})")
    return problems


def refresh_pristine(katas: list[curriculum.Kata]) -> list[str]:
    """Copy the stubs in ``katas/`` to ``dojo/pristine/``; the names of those that changed.

    Only a file that is a stub (a ``KataTodo`` for every step, the solution elsewhere) is copied:
    a learner's solved kata is theirs, never the shipped stub (each refusal is printed)."""
    (curriculum.DOJO / "pristine").mkdir(exist_ok=True)
    written = []
    for kata in katas:
        if not kata.kata_file.exists() or (
            kata.pristine_file.exists()
            and filecmp.cmp(kata.kata_file, kata.pristine_file, shallow=False)
        ):
            continue
        why = stub_problems(kata, kata.kata_file)
        if not why and kata.solution_file.exists():
            why = stub_differences(kata, kata.kata_file)
        if why:
            print(
                f"{kata.id}: katas/{kata.module}.py is not a stub ({why[0]}): not copied, "
                f"dojo/pristine/{kata.module}.py is still the shipped one"
            )
            continue
        shutil.copyfile(kata.kata_file, kata.pristine_file)
        written.append(f"dojo/pristine/{kata.module}.py")
    return written
