"""The learner's language: English, or Chinese (the language the tutorial was written in).

``--lang zh`` (the runner sets ``DOJO_LANG``, which pytest, ranks and programs inherit), else
``DOJO_LANG``, else the locale (``LC_ALL``, ``LC_MESSAGES``, ``LANG`` such as ``zh_CN.UTF-8``),
else English. Lessons and hints in Chinese live in ``dojo/curriculum/zh/``.

Every other sentence a learner reads (the runner's, the specs', the harness's reports) is
written in English where it is said, as ``t("rank {rank} holds {value}", rank=..., value=...)``,
and translated with the standard library's gettext: the English text is the msgid, its
placeholders have names (never an f-string inside ``t``), and the catalogue of a language is
``dojo/locale/LANG/LC_MESSAGES/dojo.po`` (what translators edit) compiled into ``dojo.mo`` beside
it (committed: read at run time, no build step). ``python -m dojo dev messages`` extracts the
marked sentences from the code, merges them into each ``.po`` and compiles the ``.mo``; the gate
checks that every one is translated and the ``.mo`` is its ``.po`` compiled.
"""

from __future__ import annotations

import functools
import gettext
import os
from pathlib import Path

LANGUAGES = ("en", "zh")
ENV_VAR = "DOJO_LANG"
DOMAIN = "dojo"
LOCALE_DIR = Path(__file__).resolve().parent / "locale"


def current() -> str:
    chosen = (os.environ.get(ENV_VAR) or "").strip().lower()
    if chosen:
        return "zh" if chosen.startswith("zh") else "en"
    for name in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = os.environ.get(name)
        if value:
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


def t(message: str, /, **values: object) -> str:
    """``message`` (English, the msgid) in the learner's language, with ``values`` filled in
    (any names: the message is positional only)."""
    return catalogue(current()).gettext(message).format(**values)


def tn(singular: str, plural: str, count: int, /, **values: object) -> str:
    """``t`` for a sentence whose English changes with ``count`` ("rank 2 waits", "ranks 1, 2
    wait"); ``count`` is among the values too."""
    return catalogue(current()).ngettext(singular, plural, count).format(count=count, **values)


def N_(message: str) -> str:  # gettext's own name for it (gettext_noop)
    """``message`` unchanged, marked for the catalogue where it is written (a test's parameter,
    a table) and translated later, where it is said: ``t(message)``."""
    return message


@functools.cache
def catalogue(lang: str) -> gettext.NullTranslations:
    """The compiled catalogue of ``lang``; English is the code's own text."""
    if lang == "en":
        return gettext.NullTranslations()
    return gettext.translation(DOMAIN, LOCALE_DIR, languages=[lang])
