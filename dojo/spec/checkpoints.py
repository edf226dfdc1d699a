"""A checkpoint's load that failed in a rank, read from torch's own words (k15, k16).

load_failure(failure, ...)   what a failed ``load_state_dict`` means, in the kata's words, or None
"""

from __future__ import annotations

import re

_LOADING = re.compile(r"Error\(s\) in loading state_dict for (\w+)")
_KEYS = re.compile(r'(Missing|Unexpected) key\(s\) in state_dict: ((?:"[^"]*"(?:, )?)+)')


def load_failure(
    failure: BaseException, written_by_the_test: bool, *, file: str, loader: str, writer: str
) -> AssertionError | None:
    """What a failed load_state_dict in a rank means, read from torch's own words: the model's
    keys loaded into the DDP wrapper (whose keys all start with 'module.'), or a ``file`` (the
    kata's word: "checkpoint", "snapshot") that lacks some of the model's state; None when the
    failure is something else. ``loader`` and ``writer`` name the kata's functions that read and
    write it. (Never from a 'module.' anywhere in the text: every traceback through
    torch/nn/modules/module.py has one.)"""
    text = str(failure)
    loading = _LOADING.search(text)
    if loading is None:
        return None
    into = loading.group(1)
    keys = {kind: re.findall(r'"([^"]*)"', listed) for kind, listed in _KEYS.findall(text)}
    missing, unexpected = keys.get("Missing", []), keys.get("Unexpected", [])
    if into == "DistributedDataParallel" or (
        missing and all(key.startswith("module.") for key in missing)
    ):
        return AssertionError(
            f"{loader} loaded the model's state_dict into the DDP wrapper, whose keys all "
            "start with 'module.', so none matched. Load it into the model inside the wrapper "
            f"(model.module), which is what the {file} holds.\n\n{text}"
        )
    if not missing and not unexpected:
        return None
    found = (
        f"the {file} lacks {missing}, which {into} has"
        if missing
        else f"the {file} holds {unexpected}, which {into} does not have"
    )
    if written_by_the_test:  # the test's file is whole: the load changed it
        cure = (
            f"the test wrote this {file} from the whole state_dict: hand load_state_dict "
            f"the {file}'s 'model' as it is, into the model inside the wrapper (model.module)"
        )
    else:
        cure = (
            f"the {file} was written by {writer}: save the model's whole state_dict, "
            "model.module.state_dict(). A tied weight is in it under each of its names and a "
            "buffer is in it too, while named_parameters() lists a shared parameter once and "
            "no buffer at all"
        )
    return AssertionError(f"{loader}'s load_state_dict found that {found}: {cure}.\n\n{text}")
