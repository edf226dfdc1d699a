"""Where stuck ranks wait: faulthandler's stack dumps, trimmed for a learner and grouped.

    ranks 1, 2, 3 wait in all_reduce (katas/k04_allreduce.py:88, average_gradients); rank 0 returned

A rank's dump is cut to its main thread, harness frames hidden and torch's plumbing shrunk to the
call the rank is inside; ranks stuck at the same place are shown once; ranks stuck in different
collectives are named as such.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
from dataclasses import dataclass

from dojo import lang
from dojo.lang import t, tn

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_HIDDEN = (
    os.sep + "multiprocessing" + os.sep,
    os.path.join(os.sep + "dojo", "harness", "rank.py"),
    os.path.join(os.sep + "dojo", "harness", "calls.py"),  # the recorder's wrapper of each call
    os.path.join(
        os.sep + "dojo", "harness", "timeline.py"
    ),  # a traced rank's wrapper of its function
    "threading.py",
)
_RECORDERS = ("calls.py", "timeline.py")  # their wrappers wait inside a torch.distributed call
# The kata: the learner's, the reference, the shipped stubs or a catalogue's stand-in for it
_KATA_CODE = (
    "katas",
    "solutions",
    os.path.join("dojo", "dev", "shipped"),
    os.path.join("dojo", "dev", "mistakes"),
)
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\n", re.M)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LIBRARIES = tuple(
    {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def in_torch(self) -> bool:
        return f"{os.sep}torch{os.sep}" in self.file

    @property
    def in_torch_distributed(self) -> bool:
        """In torch.distributed's own code (its futures too: an async handle's result)."""
        folder = os.sep + "torch" + os.sep
        return (
            folder + "distributed" + os.sep in self.file or folder + "futures" + os.sep in self.file
        )

    @property
    def is_learners(self) -> bool:
        """In a kata (the learner's, the reference, or a catalogue's stand-in for it)."""
        return any(f"{os.sep}{folder}{os.sep}" in self.file for folder in _KATA_CODE)

    @property
    def shown_path(self) -> str:
        """Relative to the checkout, or from site-packages on: short enough to read."""
        if (
            self.file.startswith(ROOT + os.sep)
            and os.sep + "site-packages" + os.sep not in self.file
        ):
            return os.path.relpath(self.file, ROOT)
        return self.file.split(os.sep + "site-packages" + os.sep, 1)[-1]

    def __str__(self) -> str:
        source = linecache.getline(self.file, self.line).strip()
        head = f'  File "{self.shown_path}", line {self.line}, in {self.function}'
        return f"{head}\n    {source}" if source else head


def main_thread_frames(dump: str) -> list[Frame] | None:
    """The rank's main-thread frames, oldest first, as a learner should see them; None when the
    dump holds no stack of the rank's main thread."""
    for block in _THREAD.split(dump)[1:]:
        matches = [m for m in map(_FRAME.match, block.splitlines()) if m]
        frames = [Frame(m["file"], int(m["line"]), m["func"]) for m in reversed(matches)]
        if not any(
            f.function == "main" and f.file.endswith(os.path.join("dojo", "harness", "rank.py"))
            for f in frames
        ):
            continue  # not the main thread (the lifeline watcher, gloo's threads)
        shown: list[Frame] = []
        for frame in frames:
            if frame.file.startswith("<") or any(part in frame.file for part in _HIDDEN):
                continue
            if shown and shown[-1].in_torch and frame.in_torch:
                # keep only the innermost torch frame of a run: the torch.distributed call, not
                # the op dispatch beneath it (a functional collective's wait, a DTensor's)
                if frame.in_torch_distributed or not shown[-1].in_torch_distributed:
                    shown[-1] = frame
                continue
            shown.append(frame)
        return shown
    return None


def format_stack_dump(dump: str) -> str:
    """A rank's dump as the report shows it (most recent call last)."""
    frames = main_thread_frames(dump)
    if frames is None:
        return t("  (no stack: the rank did not answer the request for one)")
    return "\n".join(map(str, frames)) or t("  (no Python frames outside the harness)")


def where(frames: list[Frame] | None) -> str:
    """``all_reduce (katas/k04_allreduce.py:88, average_gradients)``: the call a rank is inside
    and the line of its own code that made it."""
    if not frames:
        return t("an unknown place (no stack)")
    own = _own_frame(frames)
    call = _call(frames)
    if own is None:
        return call or frames[-1].function
    line = f"{own.shown_path}:{own.line}, {own.function}"
    return f"{call} ({line})" if call else f"{own.function} ({line})"


def _own_frame(frames: list[Frame] | None) -> Frame | None:
    """The innermost frame outside torch: the learner's line, not a test's wrapper around
    torch.distributed (which records calls), where the learner's code is on the stack."""
    own = [f for f in frames or [] if not f.in_torch]
    own = [f for f in own if f.is_learners] or own
    return own[-1] if own else None


# torch.distributed's point-to-point calls: a rank that waits in one waits for one peer.
_POINT_TO_POINT = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}


def _all_frames(dump: str) -> list[Frame]:
    """The rank's main-thread frames, innermost first, harness and library frames included."""
    for block in _THREAD.split(dump)[1:]:
        frames = [
            Frame(m["file"], int(m["line"]), m["func"])
            for m in map(_FRAME.match, block.splitlines())
            if m
        ]
        if any(
            f.function == "main" and f.file.endswith(os.path.join("dojo", "harness", "rank.py"))
            for f in frames
        ):
            return frames
    return []


def innermost(dump: str) -> Frame | None:
    """The frame the rank's main thread is executing, harness and library frames included."""
    frames = _all_frames(dump)
    return frames[0] if frames else None


def waits_in_torch_distributed(dump: str) -> bool:
    """Whether the rank's main thread is blocked in a torch.distributed call: in its Python
    code (``dist.all_reduce``, ``dist.recv``, a barrier), in torch's op dispatch beneath it (a
    functional collective's wait: DTensor's ``full_tensor``, ``redistribute``, a comparison
    world's torch side) or in the C++ ``wait()`` of an asynchronous operation's handle
    (``work.wait()``, whose innermost Python frame is the line that called it). A rank that
    sleeps, computes, imports or waits for a process is not."""
    frames = _all_frames(dump)
    if not frames:
        return False
    frame = frames[0]
    torch_run = []  # the innermost frames that are torch's: the call the rank is inside
    for outer in frames:
        if not outer.in_torch:
            break
        torch_run.append(outer)
    if any(f.in_torch_distributed for f in torch_run):
        return True
    if any(frame.file.endswith(os.path.join("dojo", "harness", n)) for n in _RECORDERS):
        return True  # inside the recorder's wrapper of a torch.distributed call or a wait()
    if frame.in_torch or frame.file.startswith(_LIBRARIES) or frame.file.startswith("<"):
        return False  # torch computing, or the standard library (time.sleep, queue.get, join)
    return ".wait(" in linecache.getline(frame.file, frame.line)


def learners_line(dump: str) -> tuple[str, int] | None:
    """The learner's own line (kata code) a rank waits at: what a deadlock is remembered by."""
    frames = [f for f in main_thread_frames(dump) or [] if f.is_learners]
    return (frames[-1].file, frames[-1].line) if frames else None


def own_line(dump: str) -> tuple[str, int] | None:
    """The innermost line outside torch a rank waits at (the learner's, or the checking code's)."""
    frames = [f for f in main_thread_frames(dump) or [] if not f.in_torch]
    return (frames[-1].file, frames[-1].line) if frames else None


def _call(frames: list[Frame] | None) -> str | None:
    """The torch.distributed call a rank waits in (``wait`` for an async handle's wait)."""
    if not frames:
        return None
    if frames[-1].in_torch:
        return frames[-1].function
    return "wait" if ".wait(" in linecache.getline(frames[-1].file, frames[-1].line) else None


def calls(dumps: dict[int, str]) -> set[str]:
    return {c for c in (_call(main_thread_frames(d)) for d in dumps.values()) if c}


def advice(dumps: dict[int, str]) -> str:
    """What the stacks show the ranks wait in, and the lesson for those calls only: a send or
    recv waits for its peer's matching call, a request's wait() for the call at its other end,
    a collective for every rank of its group. Where no rank waits in a torch.distributed call,
    it says so and advises nothing."""
    waiting: dict[str, list[int]] = {}
    for number, dump in sorted(dumps.items()):
        call = _call(main_thread_frames(dump))
        if call:
            waiting.setdefault(call, []).append(number)
    called = set(waiting)
    if not called:
        return t(
            "No rank waits inside a torch.distributed call: the stacks below say where each is."
        )
    seen = _waits_text(waiting, dumps)
    point, handles = called & _POINT_TO_POINT, "wait" in called
    everyone = sum(map(len, waiting.values())) == len(dumps)  # no stuck rank is elsewhere
    collectives = called - _POINT_TO_POINT - {"wait"}
    if collectives and point:
        return t(
            "{seen}. Some ranks wait in a send or recv, others in a collective: a rank whose peer "
            "is inside a collective never gets the matching call. Does every rank make the same "
            "calls in the same order?",
            seen=seen,
        )
    if collectives and not handles:
        return t(
            "{seen}. Every rank of a group must call every collective, in the same order: is "
            "there one that only some ranks call, or that they call in a different order?",
            seen=seen,
        )
    if collectives:
        return t(
            "{seen}. A request's wait() returns once every rank of its group has started the "
            "collective it came from (async_op=True): does every rank start the same collectives, "
            "in the same order?",
            seen=seen,
        )
    if called == {"wait"}:
        return t(
            "{seen}. A request completes only once its peer makes the matching call (the recv "
            "for an isend, the send for an irecv, the same collective for one started with "
            "async_op=True): which call does each waiting request need, and does its peer make "
            "it (and wait on its own request)?",
            seen=seen,
        )
    if called == {"send"} and everyone:
        return t(
            "{seen}. A blocking send returns only once its peer has made the matching call "
            "(gloo's send waits for the recv), so ranks that all send first wait for each other: "
            "let one side receive first, or post the send with dist.isend, then receive, then "
            "wait on the send.",
            seen=seen,
        )
    if called == {"recv"} and everyone:
        return t(
            "{seen}. A recv returns only once its source sends to it, and every waiting rank is "
            "receiving: which rank should send each of these messages, and does it, to this rank "
            "with this tag, before it waits itself? Let one side send first, or post the sends "
            "with dist.isend before receiving.",
            seen=seen,
        )
    return t(
        "{seen}. A send or recv returns only once its peer has made the matching call: does "
        "every send have its recv on the destination (same peer, same tag), posted in time? "
        "Blocking sends on both sides wait for each other: post them with dist.isend or "
        "dist.irecv and wait on the requests.",
        seen=seen,
    )


def _waits_text(waiting: dict[str, list[int]], dumps: dict[int, str]) -> str:
    """``Ranks 0, 1 wait in recv (`dist.recv(t, src=1 - rank)`); rank 2 in send (...)``: which
    ranks wait in which call, with their line that made it (it names the peer) where they share
    one."""
    parts = []
    for call, numbers in waiting.items():
        lines = {_calling_line(main_thread_frames(dumps[n])) for n in numbers}
        line = lines.pop() if len(lines) == 1 else None
        what = t("wait() on a request") if call == "wait" else call
        parts.append((numbers, what + (f" (`{line}`)" if line else "")))
    (numbers, what), *others = parts
    first = tn(
        "{ranks} waits in {what}", "{ranks} wait in {what}", len(numbers),
        ranks=ranks_text(numbers), what=what,
    )  # fmt: skip
    rest = [t("{ranks} in {what}", ranks=ranks_text(n), what=w) for n, w in others]
    if lang.current() == "en":  # a sentence's first word; Chinese has no capitals
        first = first[0].upper() + first[1:]
    return "; ".join([first, *rest])


def _calling_line(frames: list[Frame] | None) -> str | None:
    """The source of the line outside torch that made the call a rank waits in, without its
    comment."""
    own = _own_frame(frames)
    source = linecache.getline(own.file, own.line) if own else ""
    return re.sub(r"\s+#.*$", "", source.strip()) or None


def only_in_checking_code(dumps: dict[int, str]) -> bool:
    """No stuck rank is inside kata code, and some wait in a kata spec's own code (a barrier
    after the learner's function returned, say)."""
    frames = [f for d in dumps.values() for f in main_thread_frames(d) or []]
    spec = os.sep + "tests" + os.sep + "test_k"
    return not any(f.is_learners for f in frames) and any(spec in f.file for f in frames)


def ranks_text(numbers: list[int]) -> str:
    return tn("rank {ranks}", "ranks {ranks}", len(numbers), ranks=", ".join(map(str, numbers)))


def summary(dumps: dict[int, str], returned: list[int]) -> str:
    """One line: which ranks wait where, grouped; a note when they wait in different calls."""
    groups: dict[str, list[int]] = {}
    for number, dump in _learners_first(dumps):
        groups.setdefault(where(main_thread_frames(dump)), []).append(number)
    parts = [
        tn(
            "{ranks} waits in {place}",
            "{ranks} wait in {place}",
            len(numbers),
            ranks=ranks_text(numbers),
            place=place,
        )
        for place, numbers in groups.items()
    ]
    line = "; ".join(parts)
    if returned:
        line += "; " + t("{ranks} returned", ranks=ranks_text(returned))
    waited = calls(dumps)
    if len(waited) > 1:
        names = ", ".join(sorted(waited))
        if waited & _POINT_TO_POINT:
            line += t(": the ranks called different calls ({names})", names=names)
        else:
            line += t(": the ranks called different collectives ({names})", names=names)
    return line


def _learners_first(dumps: dict[int, str]) -> list[tuple[int, str]]:
    """Ranks waiting in the learner's own code first (their line is the one to look at), then
    those waiting in the checking code; each in rank order."""
    return sorted(dumps.items(), key=lambda item: (learners_line(item[1]) is None, item[0]))


def grouped_stacks(dumps: dict[int, str]) -> str:
    """Each distinct stack once, headed by the ranks stuck in it."""
    groups: dict[str, list[int]] = {}
    for number, dump in _learners_first(dumps):
        groups.setdefault(format_stack_dump(dump), []).append(number)
    return "\n\n".join(
        tn(
            "{ranks} is waiting here (most recent call last):",
            "{ranks} are waiting here (most recent call last):",
            len(numbers),
            ranks=ranks_text(numbers),
        )
        + f"\n{stack}"
        for stack, numbers in groups.items()
    )
