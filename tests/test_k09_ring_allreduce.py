"""k09 ring all-reduce: the chunk arithmetic, the pass-along ring, the bandwidth-optimal ring.

Inside each rank the learner's functions run while the point-to-point calls are watched (every
send counted and traced: which chunk went to whom, in which order; every ``dist.isend`` request
checked for a ``wait()``) and the collectives are replaced by functions that fail: the kata is
to build all-reduce from point-to-point calls alone.

The integer inputs make a wrong sum readable: rank r holds ``(i + 1) * 100**r`` at element i,
so any sum of the ranks' values spells, in base 100, how often each rank's value went into it
("rank 2's value only", "ranks 0 and 1 only", "rank 3's value twice").
"""

import contextlib
import functools
import os
import shutil
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dojo.harness.impl import load_kata
from dojo.harness.world import WorldDeadlock, run_world
from dojo.lang import N_, t, tn
from dojo.spec.testing import run_module_ok, shared_run
from dojo.todo import KataTodo

KATA = "k09_ring_allreduce"
DEADLINE_S = 10.0  # a ring that deadlocks ends as a stuck-rank report, not a hang
# Lengths that do and do not divide by the world size, and lengths below it.
LENGTHS = (1, 2, 3, 5, 10, 12, 1001)
BASE = 100  # rank r's integers are multiples of BASE**r: a sum's base-100 digits count the ranks
COUNTED = N_(  # said in several messages, translated where it is said
    "(sends are counted by wrapping dist.isend and dist.send: call them through the dist module, "
    "not as names imported from it)"
)
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)


# ------------------------------------------------------------------ inputs and chunks


def expected_bounds(length, world_size):
    """The chunks of torch.tensor_split: sizes differ by at most one, the larger first."""
    sizes = [len(c) for c in torch.arange(length).tensor_split(world_size)]
    starts = [sum(sizes[:i]) for i in range(world_size)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def make_input(rank, length, dtype, shape=None):
    """What rank ``rank`` holds: readable integers, plain floats, or floats of very different sizes."""
    generator = torch.Generator().manual_seed(1000 * rank + length)
    if dtype == "int64":
        data = (torch.arange(length) + 1) * BASE**rank
    elif dtype == "float32":
        data = torch.randn(length, generator=generator)
    else:  # "mixed": 1, 1e3, 1e6 by rank, where the order of additions shows in the last bits
        data = torch.randn(length, generator=generator) * 10.0 ** (3 * (rank % 3))
    return data.reshape(shape) if shape else data


def counts_of(values, start, world_size):
    """How many times each rank's value went into ``values`` (elements ``start``..), or None
    when they are no such sum (values from elsewhere, garbage)."""
    positions = torch.arange(start + 1, start + len(values) + 1)
    if len(values) == 0 or (values < 0).any() or (values % positions).any():
        return None
    multiples = values // positions
    if not (multiples == multiples[0]).all():
        return None
    number, counts = int(multiples[0]), []
    for _ in range(world_size):
        number, digit = divmod(number, BASE)
        counts.append(digit)
    return None if number else counts


def what_it_holds(counts, world_size):
    """``counts`` in words: "rank 2's value only", "a partial sum of 2 of the 4 ranks (0, 1)"."""
    if counts is None:
        return t("values that are no sum of the ranks' values at these positions")
    present = [r for r, c in enumerate(counts) if c]
    if not present:
        return t("zeros (no rank's value)")
    if any(c > 1 for c in counts):
        terms = " + ".join(
            t("{count} x rank {rank}'s", count=c, rank=r) if c > 1 else t("rank {rank}'s", rank=r)
            for r, c in enumerate(counts)
            if c
        )
        return t("{terms} values", terms=terms)
    if len(present) == 1:
        return t("rank {rank}'s value only", rank=present[0])
    if len(present) < world_size:
        return t(
            "a partial sum of {count} of the {world_size} ranks (ranks {ranks})",
            count=len(present),
            world_size=world_size,
            ranks=", ".join(map(str, present)),
        )
    return t("the sum over every rank")


def wrong_place(values, start, bounds, world_size):
    """The chunk whose values ``values`` are (a chunk written into the wrong place), or None."""
    for chunk, (a, b) in enumerate(bounds):
        if a != start and b - a == len(values) and counts_of(values, a, world_size) is not None:
            return chunk
    return None


def _describe(case):
    length, dtype, shape = case
    if shape:
        return t("a tensor of shape {shape}", shape=tuple(shape))
    if dtype == "int64":
        return tn("{count} integer", "{count} integers", length)
    if dtype == "float32":
        return tn("{count} float", "{count} floats", length)
    return tn("{count} float of mixed sizes", "{count} floats of mixed sizes", length)


def _span(bounds, chunk):
    start, stop = bounds[chunk]
    return _elements(start, stop)


def _elements(start, stop):
    """``element 3`` or ``elements 3..5`` (``stop`` exclusive)."""
    if stop - start == 1:
        return t("element {start}", start=start)
    return t("elements {start}..{last}", start=start, last=stop - 1)


# ------------------------------------------------------------------ watching the point-to-point calls


class _Request:
    """A ``dist.isend`` request that remembers whether anyone waited for it."""

    def __init__(self, work):
        self._work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def is_completed(self):
        done = self._work.is_completed()
        self.waited = self.waited or done
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _chunk_of(tensor, given, bounds):
    """Which chunk of ``given`` a sent or received tensor is: a view of it, or an equal copy."""
    if given is None or tensor.numel() == 0:
        return None
    flat = given.reshape(-1)
    if tensor.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
        start = tensor.storage_offset() - given.storage_offset()
        span = (start, start + tensor.numel())
        return (
            bounds.index(span)
            if span in bounds
            else t("elements {start}..{last}", start=span[0], last=span[1] - 1)
        )
    for chunk, (a, b) in enumerate(bounds):
        if b - a == tensor.numel() and torch.equal(tensor.reshape(-1), flat[a:b]):
            return chunk
    return None


@contextlib.contextmanager
def watching(given=None, trace_path=None):
    """Inside the block: count and trace this rank's sends and receives, keep every isend request
    (to check it is waited on), and make every collective fail.

    With ``trace_path`` each call is also written to that file as it starts and ends, so that a
    deadlocked world can still say which rank was blocked in which call.
    """
    world = dist.get_world_size()
    bounds = expected_bounds(given.numel(), world) if given is not None else []
    seen = {"elements": 0, "messages": 0, "sends": [], "recvs": [], "requests": []}
    inside = threading.local()  # dist.send calls dist.isend: count once
    trace = open(trace_path, "a", encoding="utf-8") if trace_path else None
    patched = []

    def patch(name, replacement):
        for module in (dist, c10d):
            if hasattr(module, name):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, replacement)

    def note(text):
        if trace is not None:
            trace.write(text + "\n")
            trace.flush()

    def watched(name, original):
        sending = "send" in name

        @functools.wraps(original)
        def wrapper(tensor, *args, **kwargs):  # the name culprit.py skips: torch's call is named
            if getattr(inside, "active", False):
                return original(tensor, *args, **kwargs)
            peer = args[0] if args else kwargs.get("dst" if sending else "src")
            if peer is None:  # batch_isend_irecv passes the peer as group_dst / group_src
                peer = kwargs.get("group_dst" if sending else "group_src")
            chunk = _chunk_of(tensor, given, bounds)
            entry = {"chunk": chunk, "elements": tensor.numel(), "peer": peer}
            if sending:  # a buffer the input never reached sends zeros (the inputs hold none)
                entry["zeros"] = tensor.numel() > 0 and not bool(tensor.any())
            if sending:
                seen["elements"] += tensor.numel()
                seen["messages"] += 1
                seen["sends"].append(entry)
            else:
                seen["recvs"].append(entry)
            note(f"begin {name} {peer} {tensor.numel()} {chunk}")
            inside.active = True
            try:
                work = original(tensor, *args, **kwargs)
            finally:
                inside.active = False
            note("end")
            if name == "isend" and work is not None:
                work = _Request(work)
                seen["requests"].append(work)
            return work

        return wrapper

    def forbidden(name):
        def collective(*args, **kwargs):
            raise AssertionError(
                t(
                    "the ring called dist.{name}: build it from point-to-point calls only "
                    "(dist.isend/dist.irecv/dist.send/dist.recv)",
                    name=name,
                )
            )

        return collective

    for name in ("send", "isend", "recv", "irecv"):
        patch(name, watched(name, getattr(dist, name)))
    for name in COLLECTIVES:
        patch(name, forbidden(name))
    try:
        yield seen
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)
        if trace is not None:
            trace.close()
        requests = seen.pop("requests")
        seen["isends"] = len(requests)
        seen["unwaited"] = sum(not r.waited for r in requests)
        for request in requests:  # finish what the ring left: a freed request can drop its send
            if not request.waited:
                with contextlib.suppress(RuntimeError):
                    request._work.wait()


def _trace_path(trace_dir, rank):
    return os.path.join(trace_dir, f"rank{rank}.txt") if trace_dir else None


def _blocked_in(trace_dir, world_size):
    """rank -> (call, peer, elements) it had started but not finished, read from the traces."""
    blocked = {}
    for rank in range(world_size):
        try:
            with open(_trace_path(trace_dir, rank), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        if lines and lines[-1].startswith("begin "):
            _, call, peer, elements, _ = lines[-1].split(" ", 4)
            blocked[rank] = (call, peer, elements)
    return blocked


def explain_deadlock(trace_dir, world_size):
    """What the stuck ranks were doing, in the ring's terms."""
    blocked = _blocked_in(trace_dir, world_size)
    if not blocked:
        return t(
            "no rank was inside a dist.send or dist.recv when the world was stopped: is a rank "
            "waiting on a request (request.wait()) whose matching send or recv never came?"
        )
    lines = [
        (
            tn(
                "  rank {rank} was blocked in dist.{call} to rank {peer} ({count} element)",
                "  rank {rank} was blocked in dist.{call} to rank {peer} ({count} elements)",
                int(elements),
                rank=rank,
                call=call,
                peer=peer,
            )
            if "send" in call
            else tn(
                "  rank {rank} was blocked in dist.{call} from rank {peer} ({count} element)",
                "  rank {rank} was blocked in dist.{call} from rank {peer} ({count} elements)",
                int(elements),
                rank=rank,
                call=call,
                peer=peer,
            )
        )
        for rank, (call, peer, elements) in sorted(blocked.items())
    ]
    calls = {call for call, _, _ in blocked.values()}
    if calls == {"send"} and len(blocked) == world_size:
        advice = t(
            "Every rank is blocked in a blocking dist.send and none has reached its dist.recv: "
            "gloo's dist.send returns only once the receiver has posted the matching recv, so if "
            "every rank sends first they all wait for ever. Post the send with dist.isend, then "
            "dist.recv, then wait for the send (or let even ranks send first and odd ranks "
            "receive first)."
        )
    elif "recv" in calls:
        froms = [(rank, int(peer)) for rank, (call, peer, _) in blocked.items() if call == "recv"]
        wrong = [(r, p) for r, p in froms if p != (r - 1) % world_size]
        if wrong:
            rank, peer = wrong[0]
            advice = t(
                "rank {rank} waits for a message from rank {peer}, but in the ring every rank "
                "sends to its right neighbour only: receive from the left one, (rank - 1) % N = "
                "{left}.",
                rank=rank,
                peer=peer,
                left=(rank - 1) % world_size,
            )
        else:
            advice = t(
                "the ranks wait in dist.recv for a message their left neighbour never sent: every "
                "rank must post its send (dist.isend) before it waits in recv, and make as many "
                "sends as its right neighbour makes receives (an empty chunk is neither sent nor "
                "received)."
            )
    else:
        advice = t("every send needs a matching recv on the neighbour, in the same order.")
    return "\n".join([t("the ring deadlocked:"), *lines, advice])


def run_ring_world(fn, world_size, *args):
    """``run_world`` with traced calls: a deadlock says which rank was blocked in which call."""
    trace_dir = tempfile.mkdtemp(prefix="dojo-k09-")
    try:
        return run_world(fn, world_size, *args, trace_dir, deadline=DEADLINE_S)
    except WorldDeadlock as error:  # the ring's own diagnosis stands alone
        why = explain_deadlock(trace_dir, world_size)
        raise AssertionError(f"{why}\n\n{error.without_advice()}") from error
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def check_requests_waited(by_rank, name):
    for rank, outcomes in enumerate(by_rank):
        for outcome in outcomes:
            seen = outcome["seen"]
            if seen["unwaited"]:
                raise AssertionError(
                    t(
                        "{name} on rank {rank} with {describe} posted {isends} dist.isend "
                        "requests and never waited on {unwaited} of them: keep the request "
                        "that dist.isend returns and call request.wait() before you reuse "
                        "the buffer or return. Until then gloo may still be reading the "
                        "buffer (the neighbour gets changed data), and a request that is "
                        "freed unwaited can drop its send (the neighbour waits for ever).",
                        name=name,
                        rank=rank,
                        describe=_describe(outcome["case"]),
                        isends=seen["isends"],
                        unwaited=seen["unwaited"],
                    )
                )


def sent_chunks(seen):
    return [entry["chunk"] for entry in seen["sends"]]


def trace_text(rank, seen, expected):
    got = sent_chunks(seen)
    names = [
        str(e["chunk"])
        if e["chunk"] is not None
        else (t("zeros") if e.get("zeros") else t("a copy matching no chunk"))
        for e in seen["sends"]
    ]
    shown = ", ".join(names)
    if got == expected:
        return t("rank {rank} sent chunks {shown}, in the expected order", rank=rank, shown=shown)
    for step, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            sent = t("chunk {a}", a=a) if a is not None else names[step]
            first = t(
                "in step {step} it sent {sent}, expected chunk {b}", step=step, sent=sent, b=b
            )
            break
    else:
        first = t(
            "it sent {count} chunks, expected {expected}", count=len(got), expected=len(expected)
        )
    return t(
        "rank {rank} sent chunks {shown} (one per step), expected {expected}: {first}",
        rank=rank,
        shown=shown,
        expected=", ".join(map(str, expected)),
        first=first,
    )


# ------------------------------------------------------------------ the rings' answers


def _run_cases(rank, world_size, function_name, cases, trace_dir):
    """Run the learner's all-reduce on every case; return what each rank got and sent."""
    ring = getattr(load_kata(KATA), function_name)
    outcomes = []
    for length, dtype, shape in cases:
        mine = make_input(rank, length, dtype, shape)
        expected = mine.clone()
        dist.all_reduce(expected)
        given = mine.clone()
        with watching(given, _trace_path(trace_dir, rank)) as seen:
            returned = ring(given)
        outcomes.append(
            {
                "case": (length, dtype, shape),
                "mine": mine,
                "given": given,
                "expected": expected,
                "returned_given": returned is given,
                "returned": (
                    returned.detach().clone()
                    if isinstance(returned, torch.Tensor) and returned is not given
                    else repr(returned)
                ),
                "seen": seen,
            }
        )
    return outcomes


def _cases():
    cases = [(n, dtype, None) for n in LENGTHS for dtype in ("int64", "float32", "mixed")]
    # A gradient-sized tensor too (4.8 MB): a ring that cuts chunks into slices (the lesson's
    # pipelining) must sum these the same, every slice sent and received.
    return cases + [(21, "int64", (3, 7)), (600_001, "int64", None)]


@shared_run
def world_outcomes(function_name, world_size):
    """Every case on one world (a world costs ~0.2 s); tests of the same ring share it."""
    return run_ring_world(_run_cases, world_size, function_name, _cases())


def check_not_padded(seens, length, world_size, steps, name):
    """Fail with the kata's rule of uneven chunks, and its reason, when the ranks' sends show a
    tensor padded to N equal chunks: every message ceil(length / N) long, ``steps`` per rank,
    where the length does not divide by N."""
    n, size = world_size, -(-length // world_size)
    sizes = [entry["elements"] for seen in seens for entry in seen["sends"]]
    if length % n == 0 or len(sizes) != n * steps or any(s != size for s in sizes):
        return
    sent = [seen["elements"] for seen in seens]
    long = tn(
        "every message was {count} element long", "every message was {count} elements long", size
    )
    raise AssertionError(
        t(
            "{name} of {length} elements on {n} ranks: the ranks sent {sent} elements, {total} in "
            "all expected; {long}, {steps} per rank: the tensor was padded to N = {n} equal chunks "
            "({length} -> {padded} elements), and the padding travelled with it ({extra} of the "
            "{all_sent} elements sent). Padding to equal chunks makes a correct ring, and it is "
            "right elsewhere (FSDP pads its flat shards; dist.reduce_scatter_tensor and "
            "all_gather_into_tensor need equal pieces), but this kata's ring cuts the tensor with "
            "chunk_bounds (torch.tensor_split's rule: chunks one element apart, empty ones not "
            "sent) so that only the tensor's own elements travel: exactly (N-1)/N of it per rank "
            "in each half of the ring, in place, with no copy to pad and cut, however short the "
            "tensor",
            name=name,
            length=length,
            n=n,
            sent=sent,
            total=steps * length,
            long=long,
            steps=steps,
            padded=n * size,
            extra=steps * (n * size - length),
            all_sent=n * steps * size,
        )
    )


def _expected_ring_sends(rank, world_size, bounds):
    """The chunks the optimal ring sends, in order (empty chunks are not sent)."""
    n = world_size
    order = [(rank - s) % n for s in range(n - 1)] + [(rank + 1 - s) % n for s in range(n - 1)]
    return [c for c in order if bounds[c][1] > bounds[c][0]]


def _zeros_sent(outcome, rank):
    """What a rank's sends show, for a result that holds no sum of the inputs: a sentence when
    every message it sent held only zeros (no input holds a zero), else nothing."""
    sends = outcome["seen"]["sends"]
    if not sends or not all(entry.get("zeros") for entry in sends):
        return ""
    return t(
        " Every one of the {count} messages rank {rank} sent held only zeros, though no rank's "
        "tensor holds a zero: the values of the tensor passed in never reached what the ring "
        "sends.",
        count=len(sends),
        rank=rank,
    )


def _likely(likely):
    """`` Likely: ...``: the lead a message adds where what was observed supports one."""
    return t(" Likely: {likely}.", likely=likely)


def _diagnose_int(outcome, rank, n, name):
    """For an integer case that came out wrong: which chunk (or the whole tensor), and why (a
    "Likely" only where what the ranks hold and sent supports it)."""
    got = outcome["given"].reshape(-1)
    length = got.numel()
    where = _where(name, rank, n, outcome["case"])
    if name == "pass_along_allreduce":
        counts = counts_of(got, 0, n)
        held = what_it_holds(counts, n)
        if (
            counts is not None
            and counts[rank] == 0
            and all(counts[r] == 1 for r in range(n) if r != rank)
        ):
            likely = t(
                "it holds every other rank's tensor but not its own: start the sum from your own "
                "tensor (add each arrival into the tensor passed in)"
            )
        elif counts is not None and any(c > 1 for c in counts):
            likely = t(
                "a tensor was added more than once: at each hop pass on the tensor that just "
                "arrived, not your own tensor again nor your running sum"
            )
        elif counts is not None and counts[rank] == 1 and sum(counts) == 1:
            likely = t(
                "it still holds its own tensor: add what arrives into the tensor passed in (in "
                "place: flat += incoming), N-1 times"
            )
        elif counts is not None and sum(counts):  # a partial sum: some hops brought nothing
            likely = t(
                "each of the N-1 hops must bring one more rank's tensor: add each arrival once"
            )
        else:  # zeros, or no sum of the inputs: say what was seen, guess nothing
            return t(
                "{where}: the tensor holds {held}, expected the sum over all {n} ranks.{seen}",
                where=where,
                held=held,
                n=n,
                seen=_zeros_sent(outcome, rank),
            )
        return t(
            "{where}: the tensor holds {held}, expected the sum over all {n} ranks. Likely: "
            "{likely}",
            where=where,
            held=held,
            n=n,
            likely=likely,
        )
    bounds = expected_bounds(length, n)
    for chunk, (a, b) in enumerate(bounds):
        values = got[a:b]
        if b == a or torch.equal(values, outcome["expected"].reshape(-1)[a:b]):
            continue
        counts = counts_of(values, a, n)
        held = what_it_holds(counts, n)
        elsewhere = wrong_place(values, a, bounds, n) if counts is None else None
        if elsewhere is not None:
            held = t(
                "chunk {chunk}'s values ({span}): a chunk landed in the wrong place",
                chunk=elsewhere,
                span=_span(bounds, elsewhere),
            )
            likely = t(
                "receive each chunk into its own slice, flat[start:stop] of that chunk's bounds"
            )
        elif counts is not None and any(c > 1 for c in counts):
            likely = t(
                "some values were added more than once. The all-gather must store each "
                "arriving chunk (it is already the full sum), not add it; and the reduce-scatter "
                "adds each arriving chunk once"
            )
        elif counts is not None and sum(counts) == 1 and counts[rank] == 0:
            likely = t(
                "a chunk was stored where it should have been added: the reduce-scatter adds the "
                "arriving chunk (+=), only the all-gather stores it"
            )
        elif counts is not None and sum(counts):  # a partial sum: some addends never came
            likely = t(
                "the chunk was passed on before it had every addend, or another chunk was sent: "
                "in step s send (rank - s) % N in the reduce-scatter, then (owned - s) % N in the "
                "all-gather"
            )
        else:  # zeros, or no sum of the inputs: say what was seen, guess nothing
            likely = None
        expected_sends = _expected_ring_sends(rank, n, bounds)
        return t(
            "{where}: chunk {chunk} ({span}) holds {held}, expected the sum over all {n} ranks."
            "{likely}\n{sends} (reduce-scatter, then all-gather)",
            where=where,
            chunk=chunk,
            span=_span(bounds, chunk),
            held=held,
            n=n,
            likely=_likely(likely) if likely else _zeros_sent(outcome, rank),
            sends=trace_text(rank, outcome["seen"], expected_sends),
        )
    return t("{where}: the result differs from dist.all_reduce's", where=where)


def _where(name, rank, n, case):
    """``ring_allreduce on rank 1 of 4 with 5 integers``: which call a message is about."""
    return t(
        "{name} on rank {rank} of {n} with {case}", name=name, rank=rank, n=n, case=_describe(case)
    )


def check_sums(outcomes_by_rank, name):
    """Every rank holds dist.all_reduce's answer: exactly for integers, closely for floats."""
    check_requests_waited(outcomes_by_rank, name)
    n = len(outcomes_by_rank)
    # The readable integer cases first, the longer ones (every chunk non-empty) before the rest.
    order = sorted(
        range(len(outcomes_by_rank[0])),
        key=lambda i: (
            outcomes_by_rank[0][i]["case"][1] != "int64",
            outcomes_by_rank[0][i]["given"].numel() < n,
        ),
    )
    for i in order:
        for rank, outcomes in enumerate(outcomes_by_rank):
            outcome = outcomes[i]
            got, expected, (_, dtype, _) = outcome["given"], outcome["expected"], outcome["case"]
            where = _where(name, rank, n, outcome["case"])
            assert got.shape == expected.shape and got.dtype == expected.dtype, t(
                "{where}: the tensor became {dtype} of shape {shape}, expected it to "
                "stay {dtype2} of shape {shape2}",
                where=where,
                dtype=got.dtype,
                shape=tuple(got.shape),
                dtype2=expected.dtype,
                shape2=tuple(expected.shape),
            )
            returned = outcome["returned"]
            if not outcome["returned_given"]:
                if (
                    isinstance(returned, torch.Tensor)
                    and torch.equal(got, outcome["mine"])
                    and n > 1
                ):
                    raise AssertionError(
                        t(
                            "{where}: it returned a new tensor, and the tensor passed in "
                            "still holds rank {rank}'s own values: work in place (flat += "
                            "incoming writes into the caller's tensor; tensor = tensor + "
                            "incoming makes a new one), and return the tensor you were "
                            "given, like dist.all_reduce",
                            where=where,
                            rank=rank,
                        )
                    )
                raise AssertionError(
                    t(
                        "{where}: it returned {value}; return the tensor you were given (it "
                        "holds the sum, in place, like dist.all_reduce), also when there is "
                        "nothing to send",
                        where=where,
                        value=t("a new tensor") if isinstance(returned, torch.Tensor) else returned,
                    )
                )
            if dtype == "int64":
                ok = torch.equal(got, expected)
            else:
                # Sums in another order differ in the last bits only (scaled by the addends' size).
                scale = 1.0 if dtype == "float32" else 1e6
                ok = bool(torch.isclose(got, expected, rtol=1e-5, atol=1e-5 * scale).all())
            if ok:
                continue
            if dtype == "int64":
                raise AssertionError(_diagnose_int(outcome, rank, n, name))
            flat_got, flat_expected = got.reshape(-1), expected.reshape(-1)
            close = torch.isclose(flat_got, flat_expected, rtol=1e-5, atol=1e-5 * scale)
            wrong = (~close).nonzero().flatten()
            index = int(wrong[0])
            raise AssertionError(
                t(
                    "{where}: element {index} holds {flat_got!r}, dist.all_reduce gives "
                    "{flat_expected!r} ({count} of {got} elements wrong), while its integer "
                    "cases came out right: does the ring work on the tensor's own dtype (no "
                    "int conversion, no rounding)?",
                    where=where,
                    index=index,
                    flat_got=flat_got[index].item(),
                    flat_expected=flat_expected[index].item(),
                    count=len(wrong),
                    got=got.numel(),
                )
            )


# ------------------------------------------------------------------ step 1: chunk arithmetic


def why_bounds_differ(got, length, world_size):
    """What is wrong with ``got`` as chunk bounds, in words."""
    expected = expected_bounds(length, world_size)
    try:
        pairs = [(int(a), int(b)) for a, b in got]
    except (TypeError, ValueError):
        return t("return a list of (start, stop) pairs, one per chunk")
    if len(pairs) != world_size:
        return t(
            "return one (start, stop) per rank: {world_size} chunks, got {count}",
            world_size=world_size,
            count=len(pairs),
        )
    for index, (start, stop) in enumerate(pairs):
        if stop < start:
            return t(
                "chunk {index} is ({start}, {stop}), it stops before it starts: stop is "
                "exclusive, as in a slice, and each chunk starts where the previous one stops",
                index=index,
                start=start,
                stop=stop,
            )
    for index in range(1, world_size):
        if pairs[index][0] != pairs[index - 1][1]:
            return t(
                "chunk {index} starts at {start} but chunk {previous} stops at {stop}: stop is "
                "exclusive, as in a slice, and each chunk starts where the previous one stops",
                index=index,
                start=pairs[index][0],
                previous=index - 1,
                stop=pairs[index - 1][1],
            )
    if pairs[0][0] != 0 or pairs[-1][1] != length:
        missing = (
            t("elements {start}..{last} are in no chunk", start=pairs[-1][1], last=length - 1)
            if pairs[-1][1] < length
            else t("the last chunk runs past the end, to {stop}", stop=pairs[-1][1])
        )
        return t(
            "the chunks must cover 0..{length} exactly: {missing}", length=length, missing=missing
        )
    sizes = [b - a for a, b in pairs]
    want = [b - a for a, b in expected]
    if max(sizes) - min(sizes) > 1:
        return t(
            "the chunk sizes {sizes} differ by more than one: spread the remainder ({length} % "
            "{world_size} = {remainder}) one element each over the first chunks, {want}",
            sizes=sizes,
            length=length,
            world_size=world_size,
            remainder=length % world_size,
            want=want,
        )
    if sizes != want:
        return t(
            "the chunk sizes {sizes} put the larger chunks last: the larger chunks come first, "
            "{want} (torch.tensor_split's rule)",
            sizes=sizes,
            want=want,
        )
    return t("chunk sizes differ by at most one, the larger chunks first")


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "length, world_size, expected",
    [
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_chunk_bounds_examples(kata, length, world_size, expected):
    got = kata.chunk_bounds(length, world_size)
    assert [tuple(b) for b in got] == expected, t(
        "chunk_bounds({length}, {world_size}) returned {got!r}, expected {expected}: {why}",
        length=length,
        world_size=world_size,
        got=got,
        expected=expected,
        why=why_bounds_differ(got, length, world_size),
    )


@pytest.mark.step(1)
def test_chunk_bounds_cover_every_length(kata):
    wrong = []
    for world_size in range(1, 9):
        for length in range(0, 3 * world_size + 2):
            got = kata.chunk_bounds(length, world_size)
            if [tuple(b) for b in got] != expected_bounds(length, world_size):
                wrong.append((length, world_size, got))
    if wrong:
        # Report the case that shows the mistake best: the most uneven chunks, the longest.
        def unevenness(case):
            length, world_size, got = case
            try:
                sizes = [int(b) - int(a) for a, b in got]
            except (TypeError, ValueError):
                return (0, length)
            return (max(sizes, default=0) - min(sizes, default=0), length)

        length, world_size, got = max(wrong, key=unevenness)
        raise AssertionError(
            t(
                "chunk_bounds gave the wrong chunks for {count} of the (length, world_size) pairs "
                "tried; chunk_bounds({length}, {world_size}) returned {got}, expected {expected}: "
                "{why}",
                count=len(wrong),
                length=length,
                world_size=world_size,
                got=got,
                expected=expected_bounds(length, world_size),
                why=why_bounds_differ(got, length, world_size),
            )
        )


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "length, world_size, named", [(10, 0, "world_size"), (-1, 2, "length"), (10, -3, "world_size")]
)
def test_chunk_bounds_rejects_bad_input(kata, length, world_size, named):
    call = f"chunk_bounds({length}, {world_size})"
    try:
        got = kata.chunk_bounds(length, world_size)
    except ValueError as error:
        assert named in str(error) or named.replace("_", " ") in str(error), t(
            "{call} raised ValueError({error!r}): say what is wrong, naming {named} and "
            "the value it got, so that the caller can fix the call",
            call=call,
            error=str(error),
            named=named,
        )
        return
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(
            t(
                "{call} raised {type_name}: {error}. Check the arguments first: {named} out "
                "of range must raise ValueError saying what is wrong (world_size >= 1, "
                "length >= 0)",
                call=call,
                type_name=type(error).__name__,
                error=error,
                named=named,
            )
        ) from error
    raise AssertionError(
        t(
            "{call} returned {got!r}: {named} out of range must raise ValueError saying what "
            "is wrong (world_size >= 1, length >= 0)",
            call=call,
            got=got,
            named=named,
        )
    )


# ------------------------------------------------------------------ step 2: the pass-along ring


@pytest.mark.step(2)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_pass_along_equals_all_reduce(kata, world_size):
    by_rank = world_outcomes("pass_along_allreduce", world_size)
    check_sums(by_rank, "pass_along_allreduce")
    for rank, outcomes in enumerate(by_rank):
        for outcome in outcomes:
            numel = outcome["given"].numel()
            sent = outcome["seen"]["elements"]
            assert sent == (world_size - 1) * numel, t(
                "pass_along_allreduce on rank {rank} of {world_size} with {describe} "
                "sent {sent} elements, expected {world_size2} whole tensors = {value}: "
                "pass the whole tensor on at each of the N-1 hops {COUNTED}",
                rank=rank,
                world_size=world_size,
                describe=_describe(outcome["case"]),
                sent=sent,
                world_size2=world_size - 1,
                value=(world_size - 1) * numel,
                COUNTED=t(COUNTED),
            )


def _three_ranks_cancel(rank, world_size, trace_dir):
    ring = load_kata(KATA).pass_along_allreduce
    mine = torch.tensor([[1e8, 1.0, -1e8][rank]], dtype=torch.float32)
    with watching():
        ring(mine)
    return mine.item()


@pytest.mark.step(2)
def test_pass_along_ranks_disagree_in_the_last_bits(kata):
    """The lesson's example: 1e8, 1 and -1e8 summed in a different order on each rank."""
    got = run_ring_world(_three_ranks_cancel, 3)
    assert all(value in (0.0, 1.0) for value in got), t(
        "ranks 0, 1, 2 holding 1e8, 1, -1e8 (float32) ended with {got}: any order of "
        "these additions gives 0 or 1",
        got=got,
    )
    assert len(set(got)) > 1, t(
        "every rank ended with {got0}: the pass-along ring adds in a different order on "
        "each rank (its own tensor first, then each arrival), so float rounding should "
        "make the ranks disagree here. Each rank should start from its own tensor and "
        "add what arrives from its left neighbour, hop by hop",
        got0=got[0],
    )


# ------------------------------------------------------------------ step 3: reduce-scatter


def _reduce_scatter(rank, world_size, lengths, trace_dir):
    kata = load_kata(KATA)
    outcomes = []
    for length in lengths:
        mine = make_input(rank, length, "int64")
        expected = mine.clone()
        dist.all_reduce(expected)
        given = mine.clone()
        with watching(given, _trace_path(trace_dir, rank)) as seen:
            owned = kata.ring_reduce_scatter(given)
        outcomes.append(
            {"length": length, "owned": owned, "given": given, "expected": expected, "seen": seen}
        )
    return outcomes


def _owners_text(world_size):
    return ", ".join(
        t("rank {rank} chunk {chunk}", rank=r, chunk=(r + 1) % world_size)
        for r in range(world_size)
    )


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_leaves_one_summed_chunk_per_rank(kata, world_size):
    n = world_size
    by_rank = run_ring_world(_reduce_scatter, n, LENGTHS)
    check_requests_waited(
        [[{**o, "case": (o["length"], "int64", None)} for o in outcomes] for outcomes in by_rank],
        "ring_reduce_scatter",
    )
    # The lengths where every chunk is sent first: the clearest diagnosis.
    order = sorted(range(len(LENGTHS)), key=lambda i: LENGTHS[i] < n)
    for i in order:
        length = LENGTHS[i]
        bounds = expected_bounds(length, n)
        check_not_padded([o[i]["seen"] for o in by_rank], length, n, n - 1, "ring_reduce_scatter")
        owners = [outcomes[i]["owned"] for outcomes in by_rank]
        expected_owners = [(r + 1) % n for r in range(n)]
        assert owners == expected_owners, t(
            "with {length} elements on {n} ranks, ring_reduce_scatter returned the chunk "
            "indices {owners} (rank 0 first), expected {expected_owners}: after N-1 = "
            "{n2} steps rank r owns chunk (r + 1) % N ({owners_text}), the chunk it "
            "added into in its last step. ring_all_gather relies on it: the right "
            "neighbour owns chunk owned + 1",
            length=length,
            n=n,
            owners=owners,
            expected_owners=expected_owners,
            n2=n - 1,
            owners_text=_owners_text(n),
        )
        for rank, outcomes in enumerate(by_rank):
            outcome = outcomes[i]
            owned = outcome["owned"]
            start, stop = bounds[owned]
            got, expected = outcome["given"][start:stop], outcome["expected"][start:stop]
            if torch.equal(got, expected):
                continue
            counts = counts_of(got, start, n)
            expected_sends = [
                c for c in ((rank - s) % n for s in range(n - 1)) if bounds[c][1] > bounds[c][0]
            ]
            backwards = [
                c for c in ((rank + s) % n for s in range(n - 1)) if bounds[c][1] > bounds[c][0]
            ]
            if sent_chunks(outcome["seen"]) == backwards != expected_sends:
                likely = (
                    "the chunks went round the wrong way: in step s send (rank - s) % N, the "
                    "chunk you added into in step s - 1 (it then moves on to the right), not "
                    "(rank + s) % N"
                )
            elif counts is not None and sum(counts) == 1 and counts[rank] == 1:
                likely = (
                    "no addend ever arrived into this chunk: the chunk index must move with the "
                    "step. In step s send chunk (rank - s) % N and add the arriving chunk "
                    "(rank - s - 1) % N into its place"
                )
            elif counts is not None and sum(counts) == 1:
                likely = (
                    "the arriving chunk was stored instead of added: add it into your own "
                    "(flat[start:stop] += arrived), so that it picks up one addend per rank"
                )
            elif counts is not None and any(c > 1 for c in counts):
                likely = "add each arriving chunk once, into the chunk it is, and nothing else"
            elif counts is not None and sum(counts):  # a partial sum: some addends never came
                likely = (
                    "the chunk you send in each step must be the one you just added into: send "
                    "(rank - s) % N, receive and add (rank - s - 1) % N"
                )
            else:  # zeros, or no sum of the inputs: say what was seen, guess nothing
                likely = None
            raise AssertionError(
                t(
                    "with {length} integers on {n} ranks, after the reduce-scatter's {n2} "
                    "steps rank {rank} should own chunk {owned} ({span}) summed over all {n} "
                    "ranks, but it holds {what_it_holds}.{likely}\n"
                    "{trace_text} (after the reduce-scatter {owners_text})",
                    length=length,
                    n=n,
                    n2=n - 1,
                    rank=rank,
                    owned=owned,
                    span=_span(bounds, owned),
                    what_it_holds=what_it_holds(counts, n),
                    likely=_likely(likely) if likely else _zeros_sent(outcome, rank),
                    trace_text=trace_text(rank, outcome["seen"], expected_sends),
                    owners_text=_owners_text(n),
                )
            )
        for rank, outcomes in enumerate(by_rank):
            sent = outcomes[i]["seen"]["elements"]
            low, high = (n - 1) * (length // n), (n - 1) * -(-length // n)
            assert low <= sent <= high, t(
                "with {length} elements on {n} ranks, rank {rank} sent {sent} elements "
                "in the reduce-scatter, expected N-1 = {n2} chunks ({low}..{high} "
                "elements): send one chunk per step, never the whole tensor",
                length=length,
                n=n,
                rank=rank,
                sent=sent,
                n2=n - 1,
                low=low,
                high=high,
            )
        total = sum(outcomes[i]["seen"]["elements"] for outcomes in by_rank)
        assert total == (n - 1) * length, t(
            "with {length} elements on {n} ranks the reduce-scatter sent {total} "
            "elements in all, expected (N-1) x {length} = {value}: each chunk travels "
            "N-1 hops {COUNTED}",
            length=length,
            n=n,
            total=total,
            value=(n - 1) * length,
            COUNTED=t(COUNTED),
        )


# ------------------------------------------------------------------ step 4: all-gather, whole ring


def _filler(rank):
    """What rank ``rank`` holds outside its owned chunk before the all-gather: -(rank + 1)."""
    return -(rank + 1)


def _answer(length):
    return (torch.arange(length) + 1) * 10


def _all_gather(rank, world_size, cases, trace_dir):
    """Rank r owns chunk (r + shift) % N, holding its final value; the rest is filler."""
    kata = load_kata(KATA)
    results = []
    for length, shift in cases:
        answer = _answer(length)
        owned = (rank + shift) % world_size
        start, stop = expected_bounds(length, world_size)[owned]
        mine = torch.full((length,), _filler(rank))
        mine[start:stop] = answer[start:stop]
        with watching(mine, _trace_path(trace_dir, rank)) as seen:
            kata.ring_all_gather(mine, owned)
        results.append({"got": mine, "case": (length, "int64", None), "seen": seen})
    return results


def _all_gather_problem(got, rank, n, length, shift):
    """The first wrong chunk of an all-gather's result, in words."""
    answer = _answer(length)
    bounds = expected_bounds(length, n)
    for chunk, (a, b) in enumerate(bounds):
        values, want = got[a:b], answer[a:b]
        if torch.equal(values, want):
            continue
        span = t("chunk {chunk} ({span})", chunk=chunk, span=_span(bounds, chunk))
        owner = next(r for r in range(n) if (r + shift) % n == chunk)
        fillers = {_filler(r): r for r in range(n)}
        if (values == values[0]).all() and int(values[0]) in fillers:
            who = fillers[int(values[0])]
            if who == rank:
                return t(
                    "{span} never arrived on rank {rank}: it still holds its own filler "
                    "{filler}. Pass on each chunk as it arrives, N-1 steps in all",
                    span=span,
                    rank=rank,
                    filler=_filler(rank),
                )
            return t(
                "{span} on rank {rank} holds rank {who}'s filler {filler}: rank {who} passed on a "
                "chunk it had not received yet. In step s send (owned - s) % N, the chunk that "
                "arrived in step s-1",
                span=span,
                rank=rank,
                who=who,
                filler=_filler(who),
            )
        if torch.equal(values, want + _filler(rank)):
            return t(
                "{span} on rank {rank} holds the owned value plus what the rank held there "
                "before ({filler}): the arriving chunk was added. In the all-gather every chunk "
                "is already final: store it (receive straight into its slice), do not add",
                span=span,
                rank=rank,
                filler=_filler(rank),
            )
        for other, (c, d) in enumerate(bounds):
            if other != chunk and d - c == b - a and torch.equal(values, answer[c:d]):
                return t(
                    "{span} on rank {rank} holds chunk {other}'s values: a chunk landed in the "
                    "wrong place; receive chunk (owned - s - 1) % N into its own slice",
                    span=span,
                    rank=rank,
                    other=other,
                )
        return t(
            "{span} on rank {rank} holds {values}, expected {want} (the value rank {owner} owned)",
            span=span,
            rank=rank,
            values=values.tolist(),
            want=want.tolist(),
            owner=owner,
        )
    return None


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_gather_copies_every_owned_chunk_everywhere(kata, world_size):
    n = world_size
    cases = [(10, 1), (10, 0), (5, 1), (3, 1)]
    by_rank = run_ring_world(_all_gather, n, cases)
    check_requests_waited(by_rank, "ring_all_gather")
    for i, (length, shift) in enumerate(cases):
        for rank, results in enumerate(by_rank):
            got = results[i]["got"]
            problem = _all_gather_problem(got, rank, n, length, shift)
            if problem is None:
                continue
            bounds = expected_bounds(length, n)
            owned = (rank + shift) % n
            expected_sends = [
                c for c in ((owned - s) % n for s in range(n - 1)) if bounds[c][1] > bounds[c][0]
            ]
            raise AssertionError(
                t(
                    "ring_all_gather on {n} ranks with {length} elements, rank r owning chunk "
                    "(r + {shift}) % {n} (rank {rank} owns chunk {owned}; elsewhere rank r holds "
                    "the filler -(r + 1)): rank {rank} ended with {got}, expected {answer}.\n"
                    "{problem}.\n{sends}",
                    n=n,
                    length=length,
                    shift=shift,
                    rank=rank,
                    owned=owned,
                    got=got.tolist(),
                    answer=_answer(length).tolist(),
                    problem=problem,
                    sends=trace_text(rank, results[i]["seen"], expected_sends),
                )
                + (
                    t(
                        "; rank {rank} was told it owns chunk {owned}: use `owned` rather than "
                        "assuming which chunk a rank owns",
                        rank=rank,
                        owned=owned,
                    )
                    if sent_chunks(results[i]["seen"])[:1] != expected_sends[:1]
                    else ""
                )
            )
        total = sum(results[i]["seen"]["elements"] for results in by_rank)
        assert total == (n - 1) * length, t(
            "the all-gather of {length} elements on {n} ranks sent {total} elements in "
            "all, expected (N-1) x {length} = {value}: each owned chunk travels N-1 "
            "hops, once {COUNTED}",
            length=length,
            n=n,
            total=total,
            value=(n - 1) * length,
            COUNTED=t(COUNTED),
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_allreduce_equals_all_reduce(kata, world_size):
    by_rank = world_outcomes("ring_allreduce", world_size)
    check_sums(by_rank, "ring_allreduce")


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [3, 4])
def test_ring_allreduce_is_bitwise_identical_on_every_rank(kata, world_size):
    by_rank = world_outcomes("ring_allreduce", world_size)
    for i, case in enumerate(_cases()):
        if case[1] != "mixed":
            continue
        first = by_rank[0][i]["given"]
        for rank in range(1, world_size):
            other = by_rank[rank][i]["given"]
            differ = (other != first).nonzero().flatten()
            assert len(differ) == 0, t(
                "ring_allreduce with {describe} on {world_size} ranks: rank {rank} and "
                "rank 0 differ in {count} elements (element {differ0}: {other!r} vs "
                "{first!r}). Each chunk should be summed on one rank only and then "
                "copied: is every rank adding on its own?",
                describe=_describe(case),
                world_size=world_size,
                rank=rank,
                count=len(differ),
                differ0=int(differ[0]),
                other=other[differ[0]].item(),
                first=first[differ[0]].item(),
            )


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_allreduce_sends_two_n_minus_one_over_n(kata, world_size):
    by_rank = world_outcomes("ring_allreduce", world_size)
    n = world_size
    for i, (length, _, _) in enumerate(_cases()):
        sent = [outcomes[i]["seen"]["elements"] for outcomes in by_rank]
        check_not_padded([o[i]["seen"] for o in by_rank], length, n, 2 * (n - 1), "ring_allreduce")
        if length % n == 0:
            expected = 2 * (n - 1) * length // n
            assert sent == [expected] * n, t(
                "ring_allreduce of {length} elements on {n} ranks: the ranks sent {sent} "
                "elements, expected 2(N-1)/N of the tensor = {expected} each (N-1 chunks "
                "of {length2} in the reduce-scatter, N-1 more in the all-gather)",
                length=length,
                n=n,
                sent=sent,
                expected=expected,
                length2=length // n,
            )
        low, high = 2 * (n - 1) * (length // n), 2 * (n - 1) * -(-length // n)
        assert all(low <= s <= high for s in sent) and sum(sent) == 2 * (n - 1) * length, t(
            "ring_allreduce of {length} elements on {n} ranks: the ranks sent {sent} "
            "elements; each should send 2(N-1) chunks ({low}..{high} elements), {value} "
            "in all {COUNTED}",
            length=length,
            n=n,
            sent=sent,
            low=low,
            high=high,
            value=2 * (n - 1) * length,
            COUNTED=t(COUNTED),
        )


@pytest.mark.step(4)
def test_program_shows_both_rings(kata):
    """`python -m katas.k09_ring_allreduce`: both rings against dist.all_reduce."""
    out = run_module_ok(KATA, "--world-size", "3", "--length", "200", timeout=90).stdout
    lines = out.splitlines()
    for name in ("pass-along", "ring"):
        verdict = next(
            (line for line in lines if line.startswith("[main]") and f" {name}:" in line), None
        )
        assert verdict is not None, t(
            "no verdict line for the {name} ring in:\n{out}",
            name=name,
            out=out,
        )
        assert "close to dist.all_reduce: yes" in verdict, t(
            "the {name} ring's sum is wrong:\n{verdict}",
            name=name,
            verdict=verdict,
        )
    ring_line = next(line for line in lines if line.startswith("[main]") and " ring:" in line)
    assert "same bits: yes" in ring_line, t(
        "the optimal ring must agree bitwise on every rank:\n{ring_line}",
        ring_line=ring_line,
    )
