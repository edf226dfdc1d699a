"""The curriculum as Python objects, and the README's kata table made from it.

The data lives beside this module, one file per kata (``kNN_topic.toml``: part, title, what it
teaches, steps and hints) and ``parts.toml``; the runner, the pytest plugin and the README's
table all read it from here. A kata's files (stub, reference, spec, pristine copy, mistakes
catalogue) are facts about the kata too: ask the ``Kata`` for them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CURRICULUM_DIR = Path(__file__).resolve().parent
DOJO = CURRICULUM_DIR.parent
ROOT = DOJO.parent
PARTS_FILE = CURRICULUM_DIR / "parts.toml"
TABLE_START = (
    "<!-- kata-table:start (made by `python -m dojo dev readme` from dojo/curriculum/) -->"
)
TABLE_END = "<!-- kata-table:end -->"


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
    def pristine_file(self) -> Path:
        """The shipped stub's byte-for-byte copy, which ``dojo reset`` restores."""
        return DOJO / "pristine" / f"{self.module}.py"

    @property
    def catalogue_file(self) -> Path:
        """The mistakes catalogue (maintainers only): real mistakes and right answers written another way."""
        return DOJO / "mistakes" / f"{self.module}.py"

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


@lru_cache(maxsize=1)
def load() -> tuple[tuple[Kata, ...], dict[int, str]]:
    """All katas in order, and the parts' names."""
    katas = []
    for path in sorted(CURRICULUM_DIR.glob("k[0-9][0-9]_*.toml")):
        k = tomllib.loads(path.read_text(encoding="utf-8"))
        katas.append(
            Kata(
                id=k["id"],
                module=path.stem,
                part=int(k["part"]),
                title=k["title"],
                teaches=k["teaches"],
                world_size=int(k.get("world_size", 1)),
                steps=tuple(
                    Step(int(s["number"]), s["title"], tuple(s.get("hints", ())))
                    for s in k.get("step", ())
                ),
            )
        )
    parts = {
        int(number): name
        for number, name in tomllib.loads(PARTS_FILE.read_text(encoding="utf-8")).items()
    }
    return tuple(katas), parts


def katas() -> tuple[Kata, ...]:
    return load()[0]


def parts() -> dict[int, str]:
    return load()[1]


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


def kata_table() -> str:
    """The README's kata table, one block per part."""
    blocks = []
    for number, name in parts().items():
        rows = [
            f"**{name}**",
            "",
            "| kata | title | what it teaches | steps |",
            "| --- | --- | --- | --- |",
        ]
        for kata in katas():
            if kata.part == number:
                rows.append(
                    f"| [{kata.id}](katas/{kata.module}.py) | {kata.title} | {kata.teaches} | {len(kata.steps)} |"
                )
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks)
