"""torch's, gloo's and Python's own errors, said in a kata's words.

A learner's mistake often surfaces deep inside torch or gloo, in words written for torch's
developers ("[enforce fail at pair.cc:809] ... Pair is not connected"). Each entry here is one
such error: the text that identifies it, the evidence it needs besides (the learner's line, the
call it made), what it means in a kata, and what to check. A report shows that first and the
raw text below it. An entry only speaks where its evidence holds: no match, no word.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from dataclasses import dataclass

from dojo.harness.culprit import Culprit
from dojo.lang import t


@dataclass(frozen=True)
class Known:
    name: str
    types: tuple[str, ...]  # exception class names it applies to; () for any
    pattern: re.Pattern
    means: str  # English (a msgid: translated as it is said), filled with the pattern's groups
    evidence: Callable[[Culprit | None], bool] = lambda culprit: True
    likely: bool = False  # inferred from the learner's line, not certain: said as "Likely:"
    # raised by torch on behalf of the learner's code when the spec's call reaches it (autograd
    # checks what a learner's Function's backward returned only after it returned)
    learners_through_spec: bool = False


def _line_has(*words: str) -> Callable[[Culprit | None], bool]:
    def holds(culprit: Culprit | None) -> bool:
        text = "" if culprit is None else f"{culprit.source} {culprit.callee}"
        return any(word in text for word in words)

    return holds


def _k(name, types, pattern, means, evidence=None, learners_through_spec=False) -> Known:
    """An entry; one with ``evidence`` reads the learner's line, so it says "Likely". (``means``
    is marked for translation as ``_k``'s fourth argument: ``dojo.dev.messages.KEYWORDS``.)"""
    holds = evidence or (lambda culprit: True)
    return Known(
        name, types, re.compile(pattern, re.I | re.S), means, holds, evidence is not None,
        learners_through_spec,
    )  # fmt: skip


KNOWN = (
    _k(
        "gloo_sizes_differ",
        (),
        r"invalid tensor size.*?expected \(?(?P<want>[\d, ]+)\)?, got \(?(?P<got>[\d, ]+)\)?",
        "the ranks handed one collective tensors of different sizes (one of ({got}) where "
        "({want}) was expected): every rank's tensor in a collective must have the same shape. "
        "Pieces cut with torch.chunk or "
        "torch.split differ from rank to rank when the length does not divide evenly: pad them "
        "to one size for the collective (and cut the padding off after), or use send/recv.",
    ),
    _k(
        "gloo_not_connected",
        (),
        r"pair is not connected|(?:destination|source) rank should not be the same as the rank",
        "a rank sent to (or received from) itself, or a rank outside its group: gloo connects a "
        "rank only to its peers. On a world of one rank there is nobody to send to: with "
        "world_size 1 the ring must not send at all.",
    ),
    _k(
        "storage_out_of_bounds",
        (),
        r"setStorage:.*out of bounds|out of bounds for storage",
        "a view reaches past the end of the memory it views: a flat buffer smaller than the "
        "tensors made from it (count every element, padding included), or an offset past its "
        "end.",
    ),
    _k(
        "split_sizes",
        (),
        r"split_with_sizes expects split_sizes to sum exactly to (?P<length>\d+)",
        "the sizes given to torch.split add up to another length than the tensor's "
        "{length}: the pieces must cover it exactly, the last one too.",
    ),
    _k(
        "dim_out_of_range",
        ("IndexError", "RuntimeError"),
        r"Dimension out of range \(expected to be in range of \[(?P<low>-?\d+), (?P<high>-?\d+)\]"
        r", but got (?P<got>-?\d+)\)",
        "a dimension the tensor does not have: it has {high_plus_one} (dims {low} to {high}), "
        "the code asked for dim {got}. Is the tensor of the shape you think (print .shape)?",
    ),
    _k(
        "peer_gone",
        (),
        r"connection (?:closed|reset) by peer|broken pipe",
        "another rank went away first (it raised, crashed or returned early), so this rank lost "
        "its connection: that rank's report is the cause, this one only follows from it.",
    ),
    _k(
        "collective_returns_none",
        ("AttributeError", "TypeError"),
        r"'NoneType' object (?:has no attribute|is not subscriptable|is not iterable)",
        "torch.distributed's collectives change the tensor you pass in place and return None "
        "(a Work handle with async_op=True): use that tensor afterwards, not what the call "
        "returned.",
        _line_has("dist.", "all_reduce", "all_gather", "broadcast", "reduce_scatter"),
    ),
    _k(
        "chunk_fewer_pieces",
        ("IndexError",),
        r"list index out of range|tuple index out of range",
        "torch.chunk(t, n) returns FEWER than n pieces when t has fewer than n elements (or "
        "when they do not divide so): torch.tensor_split(t, n) always returns n, some of them "
        "maybe empty.",
        _line_has("chunk"),
    ),
    _k(
        "gloo_lacks_collective",
        (),
        r"Backend gloo does not support (?P<what>\w+)",
        "this torch's gloo has no {what}: the installed torch is older than the one this kata "
        "was written for (`dojo doctor` says which it needs).",
    ),
    _k(
        "two_ranks_one_file",
        ("FileNotFoundError", "FileExistsError"),
        r".",
        "two ranks moved or wrote the same file at once: let one rank (rank 0) write and rename "
        "a shared file while the others wait for it (a barrier), or give each rank a file of "
        "its own.",
        _line_has("rename", "replace", "remove", "unlink"),
    ),
    _k(
        "nccl_cpu_tensor",
        (),
        r"No backend type associated with device type cpu|Tensors must be CUDA and dense",
        "NCCL moves CUDA tensors only: put every tensor of a collective on the rank's device "
        "(dojo.devices.rank_device()).",
    ),
    _k(
        "not_contiguous",
        (),
        r"Tensors? must be (?:non-overlapping and dense|contiguous)",
        "a collective needs each tensor contiguous in memory: a transposed, strided or "
        "sliced-across view is not (.contiguous() makes a copy that is).",
    ),
    _k(
        "no_default_group",
        (),
        r"Default process group has not been initialized",
        "a torch.distributed call with no group: before init_process_group, or after "
        "destroy_process_group.",
    ),
    _k(
        "backward_gradient_count",
        ("RuntimeError",),
        r"returned an incorrect number of gradients \(expected (?P<want>\d+), got (?P<got>\d+)\)",
        "an autograd.Function's backward returned {got} of the {want} gradients its forward's "
        "inputs need (one per input after ctx): backward returns one per input of forward, in the "
        "same order, and None for each input that needs none (a group, a flag, a size).",
        learners_through_spec=True,
    ),
    _k(
        "in_place_on_leaf",
        ("RuntimeError",),
        r"a leaf Variable that requires grad is being used in an in-place operation",
        "a parameter changed in place while autograd records: a copy of weights is no step to "
        "learn from, so do it under torch.no_grad().",
    ),
    _k(
        "shapes_cannot_multiply",
        ("RuntimeError",),
        r"mat1 and mat2 shapes cannot be multiplied \((?P<a>[\dx]+) and (?P<b>[\dx]+)\)",
        "a matrix product of shapes that do not fit ({a} by {b}): a shard met the full "
        "weight, or a weight is not transposed as nn.Linear keeps it (out_features x "
        "in_features).",
    ),
    _k(
        "sizes_must_match",
        ("RuntimeError",),
        r"The size of tensor a \((?P<a>\d+)\) must match the size of tensor b \((?P<b>\d+)\)",
        "two tensors of different lengths met in one operation ({a} against {b}): a shard "
        "against a whole, or pieces cut differently on two sides.",
    ),
)


def _found(type_name: str, message: str, culprit: Culprit | None):
    """The entry that knows this error, with its match, where its evidence holds."""
    for known in KNOWN:
        if known.types and type_name not in known.types:
            continue
        match = known.pattern.search(message)
        if match is not None and known.evidence(culprit):
            return known, match
    return None, None


def explain(type_name: str, message: str, culprit: Culprit | None = None) -> str | None:
    """What the error means in a kata's words ("Likely: ..." where it is inferred from the
    learner's line), where an entry knows it and its evidence holds; else None."""
    known, match = _found(type_name, message, culprit)
    if known is not None:
        values = {k: v for k, v in match.groupdict().items() if v is not None}
        if "high" in values:
            values["high_plus_one"] = str(int(values["high"]) + 1)
        fields = {name for _, name, _, _ in string.Formatter().parse(known.means) if name}
        if fields <= set(values):
            means = t(known.means, **values)
        else:  # an alternative of the pattern without the group: say it plainly, with no value
            means = re.sub(
                _UNFILLED, "", t(known.means, **{name: f"{{{name}}}" for name in fields})
            )
        return t("Likely: {means}", means=means) if known.likely else means
    return None


# A placeholder left unfilled, with the parenthesis around it (in either language's brackets)
_UNFILLED = r"\s*[(（][^()（）]*\{\w+\}[^()（）]*[)）]|\{\w+\}"
_RAW_LINES = 6  # torch's and gloo's messages run long: their first lines say enough


def said(type_name: str, message: str, culprit: Culprit | None) -> str:
    """An exception as a report's first lines say it, in a kata's words first: whose code raised
    it (called how, at which line), what it means; the raw text after."""
    lines = message.strip().splitlines() or [""]
    if len(lines) > _RAW_LINES:
        lines = [*lines[:_RAW_LINES], "..."]
    raw = f"{type_name}: {chr(10).join(lines)}" if message.strip() else type_name
    meaning = explain(type_name, message, culprit)
    if culprit is not None and culprit.origin == "spec" and is_assertion(type_name):
        return message  # the spec's own words
    if culprit is None:  # neither a kata's nor a spec's code: the harness's, or a process's
        return raw if meaning is None else f"{raw}\n{meaning}"
    where = t(
        "{file}:{line}, in {function}",
        file=culprit.file,
        line=culprit.line,
        function=culprit.function,
    )
    source = f"\n    {culprit.source}" if culprit.source else ""
    if culprit.origin == "kata":
        head = t(
            "your {entry} raised {error_type} at {where}:",
            entry=culprit.entry,
            error_type=type_name,
            where=where,
        )
        head = f"{head}{source}\n  {raw}"
        return head if meaning is None else f"{head}\n{meaning}"
    if culprit.origin in ("torch", "library"):
        whose = "torch" if culprit.origin == "torch" else t("a library")
        head = t(
            "{callee} ({whose}), called by your {entry} at {where}:",
            callee=culprit.callee,
            whose=whose,
            entry=culprit.entry,
            where=where,
        )
        head += source
        if meaning is None:
            return f"{head}\n" + t("raised {raw}", raw=raw)
        failed = t("failed: {meaning}", meaning=meaning)
        return f"{head}\n{failed}\n  " + t("{whose} said: {raw}", whose=whose, raw=raw)
    if meaning is not None and _learners_through_spec(type_name, message, culprit):
        head = t("the test's call at {where} reached your code, and torch refused it:", where=where)
        failed = t("failed: {meaning}", meaning=meaning)
        return f"{head}{source}\n{failed}\n  " + t("{whose} said: {raw}", whose="torch", raw=raw)
    said = t(
        "the test's own code failed on what your code gave it, at {where} (a fault of the "
        "test: please report it, with your code):",
        where=where,
    )
    return f"{said}{source}\n  {raw}"


def _learners_through_spec(type_name: str, message: str, culprit: Culprit | None) -> bool:
    known, _ = _found(type_name, message, culprit)
    return known is not None and known.learners_through_spec


def is_assertion(type_name: str) -> bool:
    """A failed check (the spec's assert, the harness's reports): words written for a learner."""
    return type_name == "AssertionError" or type_name in _ASSERTIONS


# The harness's and the specs' own failures, all written for a learner: AssertionErrors, and
# pytest.fail's Failed (a spec's message with pytrace=False).
_ASSERTIONS = {
    "RankFailed",
    "RankCrashed",
    "WorldDeadlock",
    "WorldFailure",
    "DidNotReturn",
    "Failed",
}


def is_raw(type_name: str, message: str, culprit: Culprit | None) -> bool:
    """Whether a learner would meet this error in words that are not the kata's: the spec's own
    code crashing, or torch's, gloo's or Python's text that no entry here explains (a learner's
    own exception with its function, arguments and line is not raw; a "Likely" is a bonus)."""
    if is_assertion(type_name):
        return False
    if culprit is not None and culprit.origin == "kata":
        return False
    if explain(type_name, message, culprit) is None:
        return True
    spec = culprit is not None and culprit.origin == "spec"
    return spec and not _learners_through_spec(type_name, message, culprit)
