"""The message catalogues: every sentence marked ``t(...)``/``tn(...)`` (``dojo.lang``) in the
code a learner runs, translated per language in ``dojo/locale/LANG/LC_MESSAGES/dojo.po``.

``python -m dojo dev messages`` does what Babel's extract, update and compile do, in one step:
it extracts the marked sentences (English, the msgids) from the runner, the harness, the spec
helpers and the specs, merges them into each language's ``.po`` (a new sentence arrives
untranslated, a changed one "fuzzy" with its old translation, a removed one goes) and compiles
each ``.po`` into the ``.mo`` beside it, which is committed: learners read it through the
standard library's gettext and never build anything. The gate (``dojo.dev.consistency``) holds
the catalogues to the code with ``extracted`` and ``compiled``.

Babel is a maintainers' tool (the ``dev`` extra); nothing a learner runs imports this module.
"""

from __future__ import annotations

import io
from pathlib import Path

from dojo import curriculum, lang

# dojo.lang's calls (the msgid first; tn's plural second; N_ marks one to translate later), and
# dojo.harness.known_errors's entries, whose meaning is their fourth argument
KEYWORDS = {"t": None, "tn": (1, 2), "N_": None, "_k": (4,)}
COMMENT_TAG = "TRANSLATORS:"  # a comment above a marked sentence, shown to its translators
_SKIPPED = ("dojo/dev/", "dojo/tests/")  # the maintainers' own words stay English


def sources() -> list[Path]:
    """The files whose sentences a learner reads: dojo/ but its maintainers' parts, the specs."""
    root = curriculum.ROOT
    found = [
        path
        for path in sorted((root / "dojo").rglob("*.py"))
        if not path.relative_to(root).as_posix().startswith(_SKIPPED)
    ]
    return found + sorted((root / "tests").glob("test_k*.py"))


def shown(path: Path) -> str:
    """A catalogue's path as the gate names it: from the checkout's root where it lies inside."""
    return (
        path.relative_to(curriculum.ROOT).as_posix()
        if path.is_relative_to(curriculum.ROOT)
        else str(path)
    )


def po_path(language: str) -> Path:
    return lang.LOCALE_DIR / language / "LC_MESSAGES" / f"{lang.DOMAIN}.po"


def languages() -> list[str]:
    """The languages with a catalogue (English is the code's own text)."""
    return [code for code in lang.LANGUAGES if code != "en"]


def _babel():
    try:
        from babel.messages import catalog, extract, mofile, pofile
    except ImportError:
        raise SystemExit(
            "Babel is not installed in this environment: `pip install -e '.[dev]'` (make test does)"
        ) from None
    return catalog, extract, mofile, pofile


def extracted():
    """The catalogue the code asks for (a Babel template): each marked sentence once, with
    where it is said and its translators' comments."""
    catalog, extract, _, _ = _babel()
    template = catalog.Catalog(project="torch-dist-katas", fuzzy=False)
    for path in sources():
        shown = path.relative_to(curriculum.ROOT).as_posix()
        with path.open("rb") as source:
            found = extract.extract(
                "python", source, keywords=KEYWORDS, comment_tags=(COMMENT_TAG,),
                strip_comment_tags=True,
            )  # fmt: skip
            for line, message, comments, context in found:
                template.add(
                    message, None, [(shown, line)], auto_comments=comments, context=context
                )
    return template


def read(language: str):
    _, _, _, pofile = _babel()
    with po_path(language).open("rb") as file:
        return pofile.read_po(file, locale=language, domain=lang.DOMAIN)


def compiled(catalogue) -> bytes:
    """The ``.mo`` of a catalogue (as ``pybabel compile`` writes it; fuzzy ones left out)."""
    _, _, mofile, _ = _babel()
    out = io.BytesIO()
    mofile.write_mo(out, catalogue)
    return out.getvalue()


def mo_path(language: str) -> Path:
    return po_path(language).with_suffix(".mo")


def update() -> list[str]:
    """Extract, merge into every language's ``.po`` (made if missing), compile; what it did."""
    catalog, _, _, pofile = _babel()
    template = extracted()
    said = []
    for language in languages():
        path = po_path(language)
        if path.exists():
            catalogue = read(language)
            kept = catalogue.creation_date  # a file that changes only where its messages do
            catalogue.update(template)
            catalogue.creation_date = kept
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            catalogue = catalog.Catalog(
                locale=language, domain=lang.DOMAIN, project="torch-dist-katas", fuzzy=False
            )
            catalogue.update(template)
        with path.open("wb") as file:
            pofile.write_po(file, catalogue, ignore_obsolete=True, include_lineno=False, width=100)
        mo_path(language).write_bytes(compiled(read(language)))
        left = untranslated(read(language))
        said.append(
            f"{shown(path)}: {len(catalogue)} messages"
            + (f", {len(left)} to translate (empty or fuzzy)" if left else ", all translated")
            + f"; compiled into {mo_path(language).name}"
        )
    return said


def untranslated(catalogue) -> list[str]:
    """The msgids of a catalogue that have no translation yet, or only a fuzzy one."""
    return [
        _first(message.id)
        for message in catalogue
        if message.id and (message.fuzzy or not all(_strings(message.string)))
    ]


def _strings(value) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _first(value) -> str:
    return _strings(value)[0]
