"""The curriculum as Python objects, and the README's kata table made from it.

The data lives beside this module, one file per kata (``kNN_topic.toml``: part, title, what it
teaches, steps and hints) and ``parts.toml``; the runner, the pytest plugin and the README's
table all read it from here. A kata's files (stub, reference, spec, mistakes catalogue) are
facts about the kata too: ask the ``Kata`` for them. ``stubs`` makes a kata's stub from its
reference.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dojo import lang as language

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CURRICULUM_DIR = Path(__file__).resolve().parent
DOJO = CURRICULUM_DIR.parent
ROOT = DOJO.parent
PARTS_FILE = CURRICULUM_DIR / "parts.toml"
ZH_DIR = CURRICULUM_DIR / "zh"  # the Chinese lessons, titles and hints, one file per kata


@dataclass(frozen=True)
class Step:
    number: int
    title: str
    hints: tuple[str, ...]


@dataclass(frozen=True)
class Kata:
    id: str  # "k04"
    module: str  # "k04_allreduce"
    part: int
    title: str
    teaches: str
    world_size: int
    steps: tuple[Step, ...]

    @property
    def kata_file(self) -> Path:
        return ROOT / "katas" / f"{self.module}.py"

    @property
    def solution_file(self) -> Path:
        return ROOT / "solutions" / f"{self.module}.py"

    @property
    def test_file(self) -> Path:
        """The learner's spec: the one test file of this kata."""
        return ROOT / "tests" / f"test_{self.module}.py"

    @property
    def catalogue_file(self) -> Path:
        """The mistakes catalogue (maintainers only): real mistakes and right answers written another way."""
        return DOJO / "dev" / "mistakes" / f"{self.module}.py"

    @property
    def curriculum_file(self) -> Path:
        return CURRICULUM_DIR / f"{self.module}.toml"

    def relative(self, path: Path) -> str:
        return path.relative_to(ROOT).as_posix()

    def step(self, number: int) -> Step:
        for step in self.steps:
            if step.number == number:
                return step
        raise KeyError(
            f"{self.id} has no step {number} (it has {', '.join(str(s.number) for s in self.steps)})"
        )


@lru_cache(maxsize=2)
def load(lang: str = "en") -> tuple[tuple[Kata, ...], dict[int, str]]:
    """All katas in order, and the parts' names, in ``lang`` (Chinese where a kata has its
    ``zh/kNN_topic.toml``, English otherwise)."""
    katas = []
    for path in sorted(CURRICULUM_DIR.glob("k[0-9][0-9]_*.toml")):
        k = tomllib.loads(path.read_text(encoding="utf-8"))
        own = _translation(path.name) if lang == "zh" else {}
        own_steps = {int(s["number"]): s for s in own.get("step", ())}
        steps = []
        for s in k.get("step", ()):
            there = own_steps.get(int(s["number"]), {})
            steps.append(
                Step(
                    int(s["number"]),
                    there.get("title", s["title"]),
                    tuple(there.get("hints", s.get("hints", ()))),
                )
            )
        katas.append(
            Kata(
                id=k["id"],
                module=path.stem,
                part=int(k["part"]),
                title=own.get("title", k["title"]),
                teaches=own.get("teaches", k["teaches"]),
                world_size=int(k.get("world_size", 1)),
                steps=tuple(steps),
            )
        )
    names = tomllib.loads(PARTS_FILE.read_text(encoding="utf-8"))
    if lang == "zh":
        names.update(_translation("parts.toml"))
    return tuple(katas), {int(number): name for number, name in names.items()}


def _translation(name: str) -> dict:
    path = ZH_DIR / name
    return tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def katas(lang: str | None = None) -> tuple[Kata, ...]:
    return load(lang or language.current())[0]


def parts(lang: str | None = None) -> dict[int, str]:
    return load(lang or language.current())[1]


def lesson(kata: Kata, lang: str | None = None) -> str | None:
    """The kata's lesson: the module docstring of its reference (the stub's is the same) in
    English, ``zh/kNN_topic.toml``'s in Chinese (None where there is none)."""
    if (lang or language.current()) == "zh":
        return _translation(f"{kata.module}.toml").get("lesson")
    import ast

    source = kata.solution_file if kata.solution_file.exists() else kata.kata_file
    try:
        return ast.get_docstring(ast.parse(source.read_text(encoding="utf-8")))
    except (OSError, SyntaxError):
        return None


def find(name: str) -> Kata:
    """A kata by id (``k04``, ``4``, ``04``) or module name (``k04_allreduce``)."""
    wanted = name.strip().lower()
    if wanted.isdigit():
        wanted = f"k{int(wanted):02d}"
    for kata in katas():
        if wanted in (kata.id, kata.module):
            return kata
    known = ", ".join(k.id for k in katas())
    raise KeyError(f"no kata called {name!r}; the katas are {known}")


def kata_table(lang: str = "en") -> str:
    """The README's kata table (README.zh-CN.md's in Chinese), one block per part."""
    head = {
        "en": "| kata | title | what it teaches | steps |",
        "zh": "| 练习 | 标题 | 学什么 | 步骤数 |",
    }[lang]
    blocks = []
    for number, name in parts(lang).items():
        rows = [
            f"| [{kata.id}](katas/{kata.module}.py) | {kata.title} | {kata.teaches} | {len(kata.steps)} |"
            for kata in katas(lang)
            if kata.part == number
        ]
        if rows:  # a part named before its first kata lands is not shown yet
            blocks.append("\n".join([f"**{name}**", "", head, "| --- | --- | --- | --- |", *rows]))
    return "\n\n".join(blocks)
