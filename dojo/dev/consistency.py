"""The maintainer's consistency checks: the curriculum, the files on disk and the README agree.

Every kata has a lesson (THE IDEA, STEPS, WHAT THE TESTS CHECK, RUN IT), steps with 2-3 hint
tiers, a spec, and a reference whose marked regions (``dojo.curriculum.stubs``) make its stub:
at least one region for each step of the curriculum, none for a step it lacks, and no todo of
the reference's own.

The stub checked is the one made from the reference, whatever a learner has written in
``katas/`` (their work is not the maintainers' to check). Where ``katas/`` differs from it,
``unshipped`` says so: a learner's work, or a stub a maintainer has not made again yet.
"""

from __future__ import annotations

import ast
import re
import string
import sys
from pathlib import Path

from dojo import curriculum
from dojo.commands import dojo
from dojo.curriculum import steps, stubs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

LESSON_SECTIONS = ("THE IDEA", "STEPS", "WHAT THE TESTS CHECK", "RUN IT")


def problems(katas: list[curriculum.Kata] | None = None) -> list[str]:
    """Everything that disagrees between dojo/curriculum/, solutions/ (and the stubs made from
    it), tests/ and README. ``katas`` restricts the check to those (and skips the
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
    if full:
        found += readme_problems()
        zh_parts = set(curriculum.parts("zh").values()) - set(curriculum.parts("en").values())
        if len(zh_parts) < len(curriculum.parts("en")):
            found.append("dojo/curriculum/zh/parts.toml must name every part in Chinese")
        if not (curriculum.ROOT / "README.zh-CN.md").exists():
            found.append("README.zh-CN.md (the quick start in Chinese) is missing")
        elif "README.zh-CN.md" not in (curriculum.ROOT / "README.md").read_text(encoding="utf-8"):
            found.append("README.md does not link README.zh-CN.md")
        found += catalogue_problems()
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
    if not kata.solution_file.exists():
        return found
    source = kata.solution_file.read_text(encoding="utf-8")
    try:
        stub = stubs.stub_source(source, kata.id, _shown(kata.solution_file))
    except stubs.StubError as error:
        return [*found, f"{error} (the stub is made from it)"]
    tree = ast.parse(source)
    found += region_problems(kata, stubs.regions(source, _shown(kata.solution_file)))
    found += lesson_problems(kata, tree)
    if any(map(steps.is_todo_call, ast.walk(tree))):
        found.append(f"solutions/{kata.module}.py raises a KataTodo: a solution must be complete")
    found += chinese_problems(kata, stub)
    return found


def _shown(path: Path) -> str:
    return path.relative_to(curriculum.ROOT).as_posix()


# -------------------------------------------------------- the stubs made from the references


def region_problems(kata: curriculum.Kata, regions: list[stubs.Region]) -> list[str]:
    """The reference's regions agree with the curriculum: each step has at least one (its stub
    raises a todo for it), and none names a step the curriculum lacks."""
    where = f"solutions/{kata.module}.py"
    steps = {s.number for s in kata.steps}
    found = [
        f"{where} has no region for step {number} ({kata.step(number).title}): mark the code the "
        f"learner writes with `# BEGIN STEP {number}: ...` ... `# END STEP {number}`"
        for number in sorted(steps - {r.step for r in regions})
    ]
    found += [
        f"{where}, line {r.begin}: a region for step {r.step}, which the curriculum lacks"
        for r in regions
        if r.step not in steps
    ]
    return found


def lesson_problems(kata: curriculum.Kata, reference: ast.Module) -> list[str]:
    """The stub teaches: its lesson (the reference's module docstring) has every section."""
    where = f"solutions/{kata.module}.py"
    doc = ast.get_docstring(reference) or ""
    if not doc:
        return [f"{where} has no lesson (module docstring): the stub's lesson is the reference's"]
    lacking = [s for s in LESSON_SECTIONS if s not in doc]
    if lacking:
        return [f"{where}: the lesson (module docstring) lacks {', '.join(lacking)}"]
    return [f"{where}: {problem}" for problem in run_it_problems(doc.split("RUN IT", 1)[1])]


# A command of RUN IT that a plain shell runs with another Python (or none): `python -m ...`,
# `torchrun ...`, maybe after VAR=value; the environment's own is .venv/bin/python.
_OUTSIDE_THE_ENVIRONMENT = re.compile(r"^\s+(?:[A-Z_]+=\S+\s+)*(python3?|torchrun)\s", re.M)


def run_it_problems(section: str) -> list[str]:
    """The commands of a lesson's RUN IT (or 运行) section work as printed, from a plain shell in
    the checkout: with the environment's interpreter, not whichever `python` the shell finds."""
    return [
        f"RUN IT says `{match.group(0).strip()} ...`, which a plain shell runs outside the "
        f"environment: write `.venv/bin/{match.group(1)} ...`, as the runner says it"
        for match in _OUTSIDE_THE_ENVIRONMENT.finditer(section)
    ]


def unshipped(katas: list[curriculum.Kata] | None = None) -> list[str]:
    """The files in ``katas/`` that are not the stubs made from ``solutions/``: a learner's work
    (or a stub a maintainer has not made again since changing its reference); with every kata,
    also files in katas/ that belong to none."""
    full = katas is None
    katas = list(curriculum.katas()) if full else katas
    found = []
    for kata in katas:
        if not (kata.kata_file.exists() and kata.solution_file.exists()):
            continue
        try:
            made = stubs.stub(kata)
        except stubs.StubError:
            continue  # a consistency problem already
        if kata.kata_file.read_text(encoding="utf-8") != made:
            found.append(f"katas/{kata.module}.py")
    if full:
        listed = {k.module for k in katas}
        found += [
            f"katas/{path.name}"
            for path in sorted((curriculum.ROOT / "katas").glob("k[0-9][0-9]_*.py"))
            if path.stem not in listed
        ]
    return found


def unshipped_text(files: list[str]) -> str:
    """What the gate says of them: it checked the stubs made from the references, and what a
    maintainer does."""
    which = files[0] if len(files) == 1 else f"{len(files)} files in katas/ ({', '.join(files)})"
    return (
        f"{which} {'is not the stub' if len(files) == 1 else 'are not the stubs'} made from "
        "solutions/: the checks use the stubs made from the references, whatever katas/ holds (a "
        "learner's work stays where it is). A maintainer who changed a reference makes its stub "
        "again (`python -m dojo dev stubs`, which never overwrites a learner's work) and commits "
        "both: CI, on a clean checkout, fails while they differ."
    )


def learner_work(mine: str, made: str) -> str | None:
    """Why ``mine`` (a file in katas/) holds a learner's work, or None when it is a stub, maybe of
    an older reference: every function that ``made`` (the stub made now) leaves to the learner is
    there as in ``made``, its todos still raised (comments, docstrings and todo texts aside)."""
    try:
        theirs = _todo_functions(ast.parse(mine))
    except SyntaxError as error:
        return f"it does not parse (line {error.lineno})"
    for name, body in _todo_functions(ast.parse(made)).items():
        if name not in theirs:
            return f"{name} raises no KataTodo there"
        if theirs[name] != body:
            return f"{name} holds code the stub does not have"
    return None


def _todo_functions(tree: ast.Module) -> dict[str, str]:
    """Each function that raises a KataTodo (qualified name) -> its body, docstring, comments
    and the todos' arguments left out."""
    found = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                visit(child, f"{name}.")
                if not isinstance(child, ast.ClassDef) and any(
                    map(steps.is_todo_call, ast.walk(child))
                ):
                    body = child.body[1:] if ast.get_docstring(child) is not None else child.body
                    found[name] = "".join(ast.dump(_without_todo_texts(s)) for s in body)

    visit(tree, "")
    return found


def _without_todo_texts(statement: ast.stmt) -> ast.stmt:
    for node in ast.walk(statement):
        if steps.is_todo_call(node):
            node.args = []
    return statement


# ------------------------------------------------------------------------ the Chinese lessons

ZH_SECTIONS = {
    "THE IDEA": "思路",
    "STEPS": "步骤",
    "WHAT THE TESTS CHECK": "测试检查什么",
    "RUN IT": "运行",
}
_CODE = re.compile(r"``([^`]+)``|`([^`]+)`")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\(\))?$")


def chinese_problems(kata: curriculum.Kata, stub: str | None = None) -> list[str]:
    """Every kata has its Chinese lesson, title and hints (dojo/curriculum/zh/kNN_topic.toml),
    with the lesson's four sections, the same steps as the English, and no code identifier the
    kata does not have (in its reference or its stub, ``stub``: made here if not given)."""
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
    elif lesson:
        found += [f"{where}: {p}" for p in run_it_problems(lesson.split("\n运行\n", 1)[-1])]
    english_lesson = curriculum.lesson(kata, "en") or ""
    if lesson and _listed_steps(lesson, "步骤", "测试检查什么") != _listed_steps(
        english_lesson, "STEPS", "WHAT THE TESTS CHECK"
    ):
        found.append(f"{where}: the lesson's 步骤 lists other step numbers than the English STEPS")
    reference = kata.solution_file.read_text(encoding="utf-8")
    known = "\n".join((reference, stubs.stub(kata) if stub is None else stub))
    texts = [lesson] + [h for s in steps.values() for h in s.get("hints", ())]
    known += "\n".join(h for s in english.values() for h in s.hints)
    for text in texts:
        for match in _CODE.finditer(text):
            code = (match.group(1) or match.group(2)).strip()
            name = code.removesuffix("()").split(".")[-1]
            if _IDENTIFIER.match(code) and not re.search(rf"\b{re.escape(name)}\b", known):
                found.append(
                    f"{where} names `{code}`, which solutions/{kata.module}.py does not have"
                )
    return found


# ------------------------------------------------------------------ the message catalogues

_SHOWN = 5  # sentences named per problem; the count says the rest


def catalogue_problems() -> list[str]:
    """Each language's message catalogue is complete and in step with the code
    (``dojo.dev.messages``): its ``.po`` holds exactly the sentences the code marks, each
    translated (not fuzzy) with no placeholder its English lacks (but those a ``TRANSLATORS:``
    comment names), and the ``.mo`` beside it is that ``.po`` compiled."""
    from dojo.dev import messages

    fix = f"`{dojo()} dev messages` merges and compiles"
    template = messages.extracted()
    wanted = {message.id: message for message in template if message.id}
    found = []
    for language in messages.languages():
        path = messages.po_path(language)
        where = messages.shown(path)
        if not path.exists():
            found.append(f"{where} is missing: {fix} it")
            continue
        catalogue = messages.read(language)
        held = {message.id: message for message in catalogue if message.id}
        for what, ids in (
            ("lacks sentences the code marks", [i for i in wanted if i not in held]),
            ("holds sentences the code no longer marks", [i for i in held if i not in wanted]),
            ("has sentences not translated yet (empty or fuzzy)", messages.untranslated(catalogue)),
        ):
            if ids:
                found.append(f"{where} {what} ({fix}; then translate): {_some(ids)}")
        for msgid, message in held.items():
            if msgid in wanted and not message.fuzzy:
                found += [f"{where}: {p}" for p in _placeholder_problems(message, wanted[msgid])]
        mo = messages.mo_path(language)
        if not mo.exists() or mo.read_bytes() != messages.compiled(catalogue):
            found.append(f"{messages.shown(mo)} is not {path.name} compiled: {fix} (commit both)")
    return found


def _placeholder_problems(message, english) -> list[str]:
    """A translation's ``{name}`` fields must be the English's (``.format`` fills only those),
    or ones its translators' comment names."""
    allowed = set().union(*(_fields(text) or set() for text in messages_of(english.id)))
    for comment in english.auto_comments:
        allowed |= set(re.findall(r"\{(\w+)\}", comment))
    found = []
    for text in messages_of(message.string):
        fields = _fields(text)
        if fields is None:
            found.append(
                f"the translation {text!r} is no format string (a lone brace: write {{{{ or }}}} for one)"
            )
        elif fields - allowed:
            found.append(
                f"the translation of {_some([english.id])} uses {sorted(fields - allowed)}, "
                f"which the English does not fill in (it has {sorted(allowed)})"
            )
    return found


def messages_of(value) -> tuple[str, ...]:
    """A message's texts: one, or a plural's forms."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _fields(text: str) -> set[str] | None:
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError:
        return None
    return {re.split(r"[.\[]", name)[0] for _, name, _, _ in parsed if name is not None}


def _some(ids: list) -> str:
    shown = [repr(messages_of(i)[0]) for i in ids[:_SHOWN]]
    more = f" and {len(ids) - _SHOWN} more" if len(ids) > _SHOWN else ""
    return ", ".join(shown) + more


def _listed_steps(lesson: str, heading: str, next_heading: str) -> list[int]:
    section = lesson.split(heading, 1)[-1].split(next_heading, 1)[0] if heading in lesson else ""
    return [int(n) for n in re.findall(r"^\s*(\d+)\.\s", section, flags=re.M)]


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


def refresh_stubs(katas: list[curriculum.Kata]) -> tuple[list[str], list[str]]:
    """Write ``katas/`` from ``solutions/``: each kata's file that is missing or a stub (maybe of
    an older reference). (the files written, the katas refused) A learner's work is never
    overwritten: each refusal is printed, with the way to replace it all the same (``dojo reset``,
    which keeps a backup)."""
    chosen, refused = [], []
    for kata in katas:
        if not kata.solution_file.exists():
            print(f"{kata.id}: solutions/{kata.module}.py is missing: no stub to make")
            refused.append(kata.id)
            continue
        try:
            made = stubs.stub(kata)
        except stubs.StubError as error:
            print(f"{kata.id}: no stub made: {error}")
            refused.append(kata.id)
            continue
        why = (
            learner_work(kata.kata_file.read_text(encoding="utf-8"), made)
            if kata.kata_file.exists()
            else None
        )
        if why:
            print(
                f"{kata.id}: katas/{kata.module}.py is not a stub ({why}): left as it is; "
                f"`{dojo()} reset {kata.id}` replaces it, keeping a backup"
            )
            refused.append(kata.id)
            continue
        chosen.append(kata)
    return [_shown(path) for path in stubs.write(chosen)], refused
