"""k07 point-to-point: ping-pong, a token ring, a shift that cannot deadlock, irecv and wait, a halo.

Every rank runs the kata's function inside a ``_Trace``: dojo.harness.calls.recording() notes each
torch.distributed call (with its peers, and whether it returned), and every request an isend or an
irecv returns is watched for its wait(). The trace lands on disk as it happens, so when a world
deadlocks, crashes or raises, the test still knows what each rank called and can say which rank
waits for what; when it finishes, the test checks the values and how they travelled.
"""

import inspect
import os
import shutil
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from dojo.harness.impl import load_kata
from dojo.harness.world import WorldDeadlock, run_world
from dojo.lang import t
from dojo.spec.testing import refusal, run_module_ok
from dojo.spec.traces import RankTrace, read_trace, read_traces, run_traced

KATA = "k07_point_to_point"
DEADLINE_S = 10.0  # correct code finishes in well under a second; a deadlock ends here
BIG = 1 << 21  # int32 elements per rank in a shift: 8 MB, more than any backend buffers
TAG_TO_LEFT, TAG_TO_RIGHT = 1, 2  # the kata's tags (the lesson names them)
_TAG_NAMES = {TAG_TO_LEFT: "TAG_TO_LEFT", TAG_TO_RIGHT: "TAG_TO_RIGHT"}


# ------------------------------------------------------------------------------ the trace (in a rank)


class _Request:
    """A request that isend or irecv returned, watched: the trace notes its wait() and its end."""

    def __init__(self, work, note: dict, tensor: torch.Tensor, trace: "_Trace"):
        self._work, self._note, self._tensor, self._trace = work, note, tensor, trace

    def wait(self, *args, **kwargs):
        self._note["waited"] = time.perf_counter()
        self._trace.flush()
        result = self._work.wait(*args, **kwargs)
        self._finished()
        return result

    def is_completed(self):
        self._note["polled"] = True
        done = self._work.is_completed()
        if done:
            self._finished()
        else:
            self._trace.flush()
        return done

    def _finished(self) -> None:
        if not self._note["done"]:
            self._note["done"] = True
            if self._note["kind"] == "irecv":
                self._note["values"] = _small(self._tensor)
            self._trace.flush()

    def __getattr__(self, name):
        return getattr(self._work, name)


class _Trace(RankTrace):
    """What this rank asked of torch.distributed, written to ``<folder>/rank<N>.json`` as it happens.

    Besides recording(), it stops a call to a peer outside the world with a failed check that
    names it (torch would hang or crash there), and watches isend/irecv requests (alone or in a
    batch_isend_irecv): peer, tag, the values of a small message, and whether wait() was called.
    """

    HOOKED = ("send", "recv", "isend", "irecv", "batch_isend_irecv")

    def __init__(self, folder: str):
        super().__init__(folder)
        self.requests: list[dict] = []
        self._blocking = self._batch = False

    def _raised(self) -> None:
        """The call in progress raised: recording() leaves it without an end, the trace says so."""
        if self.calls and self.calls[-1].end is None:
            self.calls[-1].end = time.perf_counter()
            self.calls[-1].raised = True
        self.flush()

    def data(self) -> dict:
        return {
            "calls": [
                {
                    "name": c.name,
                    "peers": c.peers,
                    "start": c.start,
                    "done": c.end is not None,
                    "raised": getattr(c, "raised", False),
                }
                for c in self.calls
            ],
            "requests": self.requests,
            "marks": self.marks,
        }

    def hook(self, name: str, original):
        signature = inspect.signature(original)

        def hooked(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            key = next((k for k in ("dst", "src", "group_dst", "group_src") if k in bound), None)
            peer = bound.get(key) if key else None
            if isinstance(peer, int) and not 0 <= peer < self.world_size:
                self._raised()
                raise AssertionError(
                    t(
                        "rank {rank} called dist.{name}({key}={peer}), but this world has ranks "
                        "0..{last} (the test stopped the call: torch would hang or crash on it)",
                        rank=self.rank,
                        name=name,
                        key=key.replace("group_", ""),
                        peer=peer,
                        last=self.world_size - 1,
                    )
                )
            note, blocking_before = None, self._blocking
            if name in ("isend", "irecv") and not self._blocking:
                tensor = bound["tensor"]
                note = {
                    "kind": name,
                    "peer": peer,
                    "tag": bound.get("tag", 0),
                    "batch": self._batch,
                    "start": time.perf_counter(),
                    "waited": None,
                    "polled": False,
                    "done": False,
                    "values": _small(tensor) if name == "isend" else None,
                }
                self.requests.append(note)
            self._blocking = self._blocking or name in ("send", "recv")
            self._batch = self._batch or name == "batch_isend_irecv"
            self.flush()
            try:
                result = original(*args, **kwargs)
            except BaseException:
                self._raised()
                raise
            finally:
                self._blocking = blocking_before
                self._batch = self._batch and name != "batch_isend_irecv"
            if note is not None and result is not None:
                result = _Request(result, note, bound["tensor"], self)
            return result

        return hooked


def _small(tensor: torch.Tensor) -> list | None:
    """A small message's values (a halo's edge), as a flat list; None for a big one."""
    return tensor.detach().reshape(-1).tolist() if tensor.numel() <= 8 else None


# ------------------------------------------------------------------------------ the trace (in the test)


EMPTY_TRACE = {"calls": [], "requests": [], "marks": {}}  # a rank that wrote none


def _run(fn, world_size, *args, explain=None, deadline=DEADLINE_S):
    """run_world with every rank traced: (results, traces). A failure is explained from the traces
    (``explain(traces, world_size)``, then the general checks) in front of the harness's report."""

    def why(traces, report):
        return [
            _outside_the_world(traces, world_size)
            or (explain and explain(traces, world_size))
            or _general_problem(traces, world_size),
            _story(traces, world_size),
        ]

    options = {"explain": why, "deadline": deadline, "empty": EMPTY_TRACE}
    return run_traced(fn, world_size, *args, **options)


def _said(call: dict, *keys: str) -> str:
    """``send(dst=1, tag=2)``; with ``keys``, only those peers are shown."""
    peers = ", ".join(f"{k}={v}" for k, v in call["peers"].items() if not keys or k in keys)
    return f"{call['name']}({peers})"


def _said_request(note: dict) -> str:
    key = "dst" if note["kind"] == "isend" else "src"
    return f"{note['kind']}({key}={note['peer']}, tag={note['tag']})"


def _blocking(trace: dict) -> list[dict]:
    """The rank's blocking send and recv calls, in order."""
    return [c for c in trace["calls"] if c["name"] in ("send", "recv")]


def _stuck_in(trace: dict) -> str | None:
    """What the rank was still inside when its trace ended (None: nothing)."""
    for call in reversed(trace["calls"]):
        if not call["done"] and call["name"] in ("send", "recv"):
            return _said(call)
    for note in trace["requests"]:
        if note["waited"] is not None and not note["done"]:
            return t("wait() on its {request}", request=_said_request(note))
    return None


def _story(traces: dict[int, dict], world_size: int) -> str:
    """What each rank called, oldest first, and where it was left waiting."""
    lines = []
    for rank in range(world_size):
        trace = traces[rank]
        events = [
            (c["start"], _said(c) + (t(" (raised)") if c["raised"] else ""), False)
            for c in trace["calls"]
            if c["name"] in ("send", "recv") or c["raised"]
        ]
        events += [(n["start"], _said_request(n), n["batch"]) for n in trace["requests"]]
        shown: list[str] = []
        in_batch = False
        for _, text, batch in sorted(events):
            if batch and in_batch:
                shown[-1] = shown[-1][:-2] + f", {text}])"
            else:
                shown.append(f"batch_isend_irecv([{text}])" if batch else text)
            in_batch = batch
        said = ", ".join(shown) or t("no send or receive")
        stuck = _stuck_in(trace)
        still = t("  <- still in {call}", call=stuck) if stuck else ""
        lines.append(t("  rank {rank}: {calls}", rank=rank, calls=said) + still)
    return t("what each rank called (recorded by the test):") + "\n" + "\n".join(lines)


def _outside_the_world(traces: dict[int, dict], world_size: int) -> str | None:
    """A call to or from a rank that does not exist: a ring's neighbour computed without modulo."""
    for rank in range(world_size):
        trace = traces[rank]
        for call in trace["calls"] + [
            {"name": n["kind"], "peers": {"peer": n["peer"]}} for n in trace["requests"]
        ]:
            for key, peer in call["peers"].items():
                if key != "tag" and isinstance(peer, int) and not 0 <= peer < world_size:
                    return t(
                        "rank {rank} called dist.{name} with {key}={peer}, which is not a rank of "
                        "this world of {world_size}: a ring wraps round, so rank 0's left neighbour "
                        "is rank {last} and rank {last}'s right neighbour is rank 0. Compute them "
                        "modulo the world size: (rank - 1) % world_size and (rank + 1) % world_size.",
                        rank=rank,
                        name=call["name"],
                        key=key,
                        peer=peer,
                        world_size=world_size,
                        last=world_size - 1,
                    )
    return None


def _general_problem(traces: dict[int, dict], world_size: int) -> str | None:
    """What a trace shows whatever the step: a message nobody sends, every rank blocked alike."""
    unmatched = _unmatched_receives(traces, world_size)
    if unmatched:
        return unmatched
    stuck = {rank: _stuck_in(traces[rank]) for rank in range(world_size)}
    each = ", ".join(t("rank {rank} in {call}", rank=r, call=c) for r, c in stuck.items())
    if all(s and s.startswith("send(") for s in stuck.values()):
        return t(
            "every rank is inside a blocking send ({each}) and none has reached its receive: a "
            "send returns only once its receiver has taken the data, so each rank waits for a "
            "peer that is sending too. Let one side receive first, or post the send with "
            "dist.isend, then receive, then wait on the send.",
            each=each,
        )
    if all(s and s.startswith("recv(") for s in stuck.values()):
        return t(
            "every rank is inside a blocking recv ({each}) and none of them sends: a recv returns "
            "only once its source sends to it, so each rank waits for a peer that is receiving "
            "too. Let one side send first, or post the sends with dist.isend before receiving.",
            each=each,
        )
    return None


def _unmatched_receives(traces: dict[int, dict], world_size: int) -> str | None:
    """A receive (irecv or recv) for which its source never posts a send with that tag."""
    sends: dict[tuple[int, int], list[int]] = {}  # (from, to) -> tags
    receives = []  # (rank, src, tag)
    for rank in range(world_size):
        for note in traces[rank]["requests"]:
            if note["kind"] == "isend":
                sends.setdefault((rank, note["peer"]), []).append(note["tag"])
            elif isinstance(note["peer"], int):
                receives.append((rank, note["peer"], note["tag"]))
        for call in _blocking(traces[rank]):
            peers = call["peers"]
            if call["name"] == "send" and "dst" in peers:
                sends.setdefault((rank, peers["dst"]), []).append(peers.get("tag", 0))
            elif call["name"] == "recv" and "src" in peers:
                receives.append((rank, peers["src"], peers.get("tag", 0)))
    for rank, src, tag in receives:
        sent = sends.get((src, rank), [])
        if sent and tag not in sent:
            return t(
                "rank {rank} waits for a message from rank {src} with tag={tag}{name}, but rank "
                "{src} sent rank {rank} only tag(s) {sent}: a receive matches only a send with the "
                "same tag, so this one waits for ever.",
                rank=rank,
                src=src,
                tag=tag,
                name=_tag_name(tag),
                sent=", ".join(f"{other}{_tag_name(other)}" for other in sorted(set(sent))),
            )
    return None


def _tag_name(tag: int) -> str:
    return f" ({_TAG_NAMES[tag]})" if tag in _TAG_NAMES else ""


def _never_waited(traces: dict[int, dict], world_size: int) -> str | None:
    """A request that was never waited on: one a stuck peer waits for first, then any other of a
    rank that is not stuck (in a deadlock, the requests after the one a rank waits on are not
    waited on yet)."""
    for rank in range(world_size):
        for waiting in traces[rank]["requests"]:
            if waiting["waited"] is None or waiting["done"]:
                continue  # not what this rank is stuck on
            other = "irecv" if waiting["kind"] == "isend" else "isend"
            for note in traces.get(waiting["peer"], {"requests": []})["requests"]:
                if (note["kind"], note["peer"], note["tag"]) == (other, rank, waiting["tag"]) and (
                    note["waited"] is None and not note["polled"]
                ):
                    return _not_waited_text(waiting["peer"], note) + t(
                        " Rank {rank} waits for the other end of it, in wait() on its {request}: a "
                        "message is only sure to travel once both ends wait on their requests.",
                        rank=rank,
                        request=_said_request(waiting),
                    )
    for rank in range(world_size):
        if _stuck_in(traces[rank]):
            continue
        for note in traces[rank]["requests"]:
            if note["waited"] is None and not note["polled"]:
                return _not_waited_text(rank, note)
    return None


def _not_waited_text(rank: int, note: dict) -> str:
    what = (
        t("the data may still be on its way into the buffer you return")
        if note["kind"] == "irecv"
        else t("its tensor must not be changed or freed until the send has finished")
    )
    return t(
        "rank {rank} never called wait() on the request of its {request}: {what}. Call .wait() on "
        "every request isend and irecv return, before the function returns.",
        rank=rank,
        request=_said_request(note),
        what=what,
    )


# ------------------------------------------------------------------------------ step 1


def _ping_pong(rank, world_size, rounds, trace_dir):
    with _Trace(trace_dir):
        return load_kata(KATA).ping_pong(rounds)


def _explain_ping_pong(traces, world_size):
    first = {rank: _blocking(traces[rank])[:1] for rank in (0, 1)}
    names = [call[0]["name"] if call else None for call in first.values()]
    if names == ["send", "send"]:
        return t(
            "ping-pong deadlocked: rank 0 and rank 1 both began with send. A blocking send returns "
            "only once the other rank has received, so both wait for ever: rank 0 serves (send, "
            "then recv), while rank 1 receives first (recv, then send)."
        )
    if names == ["recv", "recv"]:
        return t(
            "ping-pong deadlocked: rank 0 and rank 1 both began with recv, so nobody serves: rank 0 "
            "sends the 0 first, while rank 1 receives first."
        )
    return None


@pytest.mark.step(1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ping_pong(world_size):
    rounds = 3
    results, traces = _run(_ping_pong, world_size, rounds, explain=_explain_ping_pong)
    expected = {0: [1, 3, 5], 1: [0, 2, 4]}
    for rank, got in enumerate(results):
        if rank > 1:
            calls = [_said(c) for c in traces[rank]["calls"]]
            assert got == [] and not calls, t(
                "rank {rank} returned {got!r} after calling {calls}, expected [] and no "
                "message: only ranks 0 and 1 play ping-pong, the others return an empty "
                "list at once",
                rank=rank,
                got=got,
                calls=calls or t("nothing"),
            )
            continue
        want = expected[rank]
        assert isinstance(got, list) and all(type(v) is int for v in got), t(
            "rank {rank} returned {got!r}: return a list of Python ints, the counter's "
            "value as each one arrived (int(ball.item()), noted before you add 1)",
            rank=rank,
            got=got,
        )
        if got == [v + 1 for v in want]:
            pytest.fail(
                t(
                    "rank {rank} received {got}, expected {want}: it noted the counter after "
                    "adding 1. Note the value as it arrives, then add 1 and send it back.",
                    rank=rank,
                    got=got,
                    want=want,
                ),
                pytrace=False,
            )
        if rank == 0 and got == list(range(rounds)):
            pytest.fail(
                t(
                    "rank 0 received {got}, expected {want}: rank 1 sent the counter back "
                    "without adding 1. Whoever receives the counter (rank 1 too) adds 1 "
                    "before sending it back.",
                    got=got,
                    want=want,
                ),
                pytrace=False,
            )
        assert got == want, t(
            "rank {rank} received {got}, expected {want} in {rounds} rounds: rank 0 "
            "serves 0, and whoever receives the counter notes it, adds 1 and sends it "
            "back",
            rank=rank,
            got=got,
            want=want,
            rounds=rounds,
        )


# ------------------------------------------------------------------------------ step 2


def _token_ring(rank, world_size, token, trace_dir):
    with _Trace(trace_dir):
        return load_kata(KATA).token_ring(token)


def _explain_token_ring(traces, world_size):
    firsts = [(_blocking(traces[r])[:1] or [{"name": None}])[0]["name"] for r in range(world_size)]
    if all(name == "recv" for name in firsts):
        return (
            "the token ring deadlocked: every rank began with recv, so nobody ever sent the token. "
            "Rank 0 starts it: it adds its 1 and sends first, and receives the token back last; "
            "every other rank receives first, then sends."
        )
    if all(name == "send" for name in firsts):
        return (
            "the token ring deadlocked: every rank began with send, and a blocking send waits for "
            "its receiver, who is sending too. Only rank 0 sends first (the token starts there); "
            "every other rank receives first, then sends."
        )
    return None


def _ring_value(token: int, rank: int, world_size: int) -> int:
    """What rank receives: the token plus r + 1 for every rank r it passed (all of them for 0)."""
    passed = range(world_size) if rank == 0 else range(rank)
    return token + sum(r + 1 for r in passed)


@pytest.mark.step(2)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_token_ring(world_size):
    token = 100
    results, traces = _run(_token_ring, world_size, token, explain=_explain_token_ring)
    want = [_ring_value(token, rank, world_size) for rank in range(world_size)]
    if results == [token] * world_size:
        pytest.fail(
            t(
                "every rank returned {token}: nobody added to the token. Each rank adds rank "
                "+ 1 before passing it on, so rank 1 receives {want1} and rank 0 gets "
                "{want0} back.",
                token=token,
                want1=want[1],
                want0=want[0],
            ),
            pytrace=False,
        )
    for rank, got in enumerate(results):
        if rank > 0 and got == want[rank] + rank + 1:
            pytest.fail(
                t(
                    "rank {rank} returned {got}, expected {want}: it returned the token "
                    "after adding its own {added}. Return the value as it arrived; add rank "
                    "+ 1 only to what you pass on.",
                    rank=rank,
                    got=got,
                    want=want[rank],
                    added=rank + 1,
                ),
                pytrace=False,
            )
        if rank == 0 and got == want[0] + 1:
            pytest.fail(
                t(
                    "rank 0 returned {got}, expected {want0}: it added its 1 twice, before "
                    "the first send and again when the token came back. Add it once, before "
                    "sending.",
                    got=got,
                    want0=want[0],
                ),
                pytrace=False,
            )
        if rank == 0 and got == want[0] - 1 and results[1:] == [w - 1 for w in want[1:]]:
            pytest.fail(
                t(
                    "rank 0 got {got} back and rank 1 received {results1}, expected {want0} "
                    "and {want1}: rank 0 never added its 1. Like every rank, it adds rank + "
                    "1 before it passes the token on.",
                    got=got,
                    results1=results[1],
                    want0=want[0],
                    want1=want[1],
                ),
                pytrace=False,
            )
        if rank == 0:
            why = t(
                "the token goes all the way round, and every rank r adds r + 1 (rank 0 adds 1 "
                "before it sends)"
            )
        else:
            why = t(
                "ranks 0..{last} each added their rank + 1 before it reached rank {rank}",
                last=rank - 1,
                rank=rank,
            )
        assert got == want[rank], t(
            "rank {rank} returned {got!r}, expected {want}: {why}",
            rank=rank,
            got=got,
            want=want[rank],
            why=why,
        )
    for rank in range(world_size):
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        said = [_said(c, "dst", "src") for c in _blocking(traces[rank])]
        first = f"send(dst={right})" if rank == 0 else f"recv(src={left})"
        assert said[:1] == [first] and len(said) == 2, t(
            "rank {rank} called {said}: each rank makes one blocking recv from its left "
            "neighbour (rank {left}) and one send to its right (rank {right}), rank 0 "
            "sending first and every other rank receiving first",
            rank=rank,
            said=said,
            left=left,
            right=right,
        )


# ------------------------------------------------------------------------------ step 3


def _pattern(rank):
    return torch.arange(BIG, dtype=torch.int32) + 1000 * rank


def _shift(rank, world_size, which, trace_dir):
    kata = load_kata(KATA)
    mine = _pattern(rank)
    with _Trace(trace_dir) as trace:
        if which == "naive":
            trace.mark("naive shift starts")
        got = (kata.shift_right if which == "yours" else _naive_shift_right)(mine)
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    return {
        "shape": tuple(got.shape),
        "dtype": str(got.dtype),
        "head": got[:3].tolist(),
        "from_left": torch.equal(got, _pattern(left)),
        "from_right": torch.equal(got, _pattern(right)),
        "sent_intact": torch.equal(mine, _pattern(rank)),
        "is_sent": got is mine,
    }


def _naive_shift_right(tensor):
    """The shift everyone writes first: blocking send, then recv. It deadlocks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    dist.send(tensor, dst=(rank + 1) % world_size)
    dist.recv(received, src=(rank - 1) % world_size)
    return received


def _explain_shift(traces, world_size):
    stuck = [_stuck_in(traces[r]) or "" for r in range(world_size)]
    if all(s.startswith("send(") for s in stuck):
        return t(
            "shift_right deadlocked with 8 MB tensors: every rank was stuck in a blocking send "
            "while its neighbour was stuck in one too (see the lesson's picture). Post dist.isend "
            "and dist.irecv first, then wait() on both requests."
        )
    return _never_waited(traces, world_size)


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shift_right(world_size):
    results, traces = _run(_shift, world_size, "yours", explain=_explain_shift)
    for rank, got in enumerate(results):
        left, right = (rank - 1) % world_size, (rank + 1) % world_size
        assert got["shape"] == (BIG,) and got["dtype"] == "torch.int32", t(
            "rank {rank} returned a tensor of shape {shape} and dtype {dtype}, expected "
            "({BIG},) int32 like the one it sent: receive into torch.empty_like(tensor)",
            rank=rank,
            shape=got["shape"],
            dtype=got["dtype"],
            BIG=BIG,
        )
        assert got["sent_intact"] and not got["is_sent"], t(
            "rank {rank}'s own tensor changed while it was being sent: it received into "
            "the tensor it was sending. Receive into a new buffer "
            "(torch.empty_like(tensor)), never into the tensor an isend is still sending.",
            rank=rank,
        )
        if got["from_right"] and not got["from_left"]:
            pytest.fail(
                t(
                    "rank {rank} returned rank {right}'s tensor, its right neighbour's: the "
                    "data moved left. Send to the right, (rank + 1) % world_size, and "
                    "receive from the left, (rank - 1) % world_size (rank {left} for rank "
                    "{rank}).",
                    rank=rank,
                    right=right,
                    left=left,
                ),
                pytrace=False,
            )
    never = _never_waited(traces, world_size)
    assert never is None, never
    for rank, got in enumerate(results):
        left = (rank - 1) % world_size
        assert got["from_left"], t(
            "rank {rank} returned a tensor starting {head}, expected rank {left}'s, "
            "starting {pattern}: send to (rank + 1) % world_size, receive from (rank - "
            "1) % world_size, and wait() on both requests before returning",
            rank=rank,
            head=got["head"],
            left=left,
            pattern=_pattern(left)[:3].tolist(),
        )


def _settle(rank, world_size):
    dist.barrier()


@pytest.mark.step(3)
def test_naive_shift_deadlocks_where_yours_does_not():
    """The proof that test_shift_right can catch a deadlocking shift: the naive one is caught.

    The naive shift gets a few times as long as a world takes to start right now (a busy machine is
    slow); the test then asks each rank's trace whether it was stuck inside its send. A rank that had
    not even reached its send proves nothing either way: then the naive shift runs again, with
    twice as long.
    """
    world_size = 3
    _run(_shift, world_size, "yours", explain=_explain_shift)
    start = time.monotonic()
    run_world(_settle, world_size)
    deadline = 1.0 + 3 * (time.monotonic() - start)
    for _ in range(4):
        folder = tempfile.mkdtemp(prefix="k07-naive-")
        try:
            run_world(_shift, world_size, "naive", deadline=deadline, trace_dir=folder)
        except WorldDeadlock:
            traces = read_traces(folder, world_size, EMPTY_TRACE)
        else:
            pytest.fail(
                t(
                    "the naive 'send, then recv' shift finished: this backend buffered 8 MB "
                    "sends, so the shift tests cannot prove that a shift does not deadlock "
                    "(raise BIG in this test file)"
                )
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        stuck = [_stuck_in(traces[r]) for r in range(world_size)]
        if all(s and s.startswith(f"send(dst={(r + 1) % world_size}") for r, s in enumerate(stuck)):
            return
        if all("naive shift starts" in traces[r]["marks"] for r in range(world_size)):
            pytest.fail(
                t(
                    "the naive shift should leave every rank stuck in its send, but the "
                    "ranks were in {stuck}:\n"
                    "{story}",
                    stuck=stuck,
                    story=_story(traces, world_size),
                )
            )
        deadline *= 2  # a rank had not reached its send yet: the machine is busy
    pytest.fail(
        t(
            "the naive shift's ranks did not all reach their send within {deadline:g} s",
            deadline=deadline / 2,
        )
    )


# ------------------------------------------------------------------------------ step 4

_SENDER_DELAY_S = 0.3  # the message leaves at least this long after the receiver started working
_WAIT_FOR_WORK_S = 5.0


def _waiting_for_message(trace: dict | None) -> str | None:
    """How rank 1 waits for the message now, if it does: a blocking recv, or wait() on a request."""
    if trace is None:
        return None
    for call in trace["calls"]:
        if call["name"] == "recv" and not call["done"]:
            return t("waits in a blocking dist.recv")
    for note in trace["requests"]:
        if note["kind"] == "irecv" and (note["waited"] is not None or note["polled"]):
            return t("waits on its irecv's request")
    return None


def _send_when_ready(message, flag_path, trace_dir):
    """The test's sender (rank 0). It holds the message until rank 1's work() has begun, dawdles,
    and then until rank 1 waits for the message (or has returned): a buffer read before wait()
    can only hold its zeros, however busy the machine."""
    give_up = time.monotonic() + _WAIT_FOR_WORK_S
    while not os.path.exists(flag_path):
        waiting = _waiting_for_message(read_trace(trace_dir, 1))
        if waiting:
            raise AssertionError(
                t(
                    "rank 1 {waiting} before it called work(): the test's sender holds its "
                    "message until work() has begun, so nothing arrives. "
                    "receive_while_working posts dist.irecv (which returns at once), calls "
                    "work(), and only then waits.",
                    waiting=waiting,
                )
            )
        if time.monotonic() > give_up:
            raise AssertionError(
                t(
                    "rank 1 did not call work() within {WAIT_FOR_WORK_S:g} s while rank 0 "
                    "held back its message: receive_while_working must post dist.irecv "
                    "(which returns at once) and call work() before waiting.",
                    WAIT_FOR_WORK_S=_WAIT_FOR_WORK_S,
                )
            )
        time.sleep(0.01)
    time.sleep(_SENDER_DELAY_S)
    give_up = time.monotonic() + _WAIT_FOR_WORK_S
    while time.monotonic() < give_up:
        trace = read_trace(trace_dir, 1)
        if _waiting_for_message(trace):
            break
        if trace and "returned" in trace["marks"]:
            return  # without waiting: nobody will take the message (the test says so)
        time.sleep(0.01)
    dist.send(message, dst=1)


def _receive_while_working(rank, world_size, flag_path, trace_dir):
    expected = torch.arange(1000, dtype=torch.int64) + 100
    if rank == 0:
        _send_when_ready(expected, flag_path, trace_dir)
        return None
    with _Trace(trace_dir) as trace:

        def work():
            trace.mark("work")
            open(flag_path, "w").close()
            return "work done"

        buffer = torch.zeros(1000, dtype=torch.int64)
        got, result = load_kata(KATA).receive_while_working(0, buffer, work)
        snapshot = got.clone()  # what the caller sees the moment the function returns
        trace.mark("returned")
    return {
        "matches": torch.equal(snapshot, expected),
        "head": snapshot[:3].tolist(),
        "result": result,
    }


@pytest.mark.step(4)
def test_receive_while_working_reads_the_buffer_only_after_wait(tmp_path):
    results, traces = _run(_receive_while_working, 2, str(tmp_path / "work-started"))
    got, trace = results[1], traces[1]
    assert got["result"] == "work done", t(
        "receive_while_working returned {result!r} as work's result, expected 'work "
        "done': return (buffer, work())",
        result=got["result"],
    )
    received = [c for c in trace["calls"] if c["name"] == "recv"]
    posted = [n for n in trace["requests"] if n["kind"] == "irecv"]
    work = trace["marks"].get("work", float("inf"))
    assert not received and posted and posted[0]["start"] < work, (
        t(
            "rank 1 received with a blocking dist.recv after work() had returned: the message "
            "could not travel while rank 1 worked. Post dist.irecv before calling work(), and "
            "wait() after it."
        )
        if received
        else t(
            "rank 1 posted no dist.irecv before calling work(): post it first, so that the "
            "message travels while the work runs"
        )
    )
    never = _never_waited(traces, 2)
    assert never is None, never
    assert got["matches"], t(
        "rank 1's buffer held {head}... when receive_while_working returned, expected "
        "[100, 101, 102]...: it was read before the message arrived (the test's sender "
        "sends only once you wait). The buffer of an irecv holds nothing useful until "
        "its wait() has returned: call wait() on the request first, then use or copy the "
        "buffer.",
        head=got["head"],
    )


# ------------------------------------------------------------------------------ step 5


def _halo(rank, world_size, trace_dir):
    with _Trace(trace_dir) as trace:
        strip = torch.arange(3, dtype=torch.int64) + 10 * rank
        halo = load_kata(KATA).halo_exchange(strip)
    batches = [c for c in trace.calls if c.name == "batch_isend_irecv"]
    return {"halo": halo.tolist(), "strip": strip.tolist(), "batches": len(batches)}


def _explain_halo(traces, world_size):
    return (
        _halo_sends_problem(traces, world_size)
        or _unmatched_receives(traces, world_size)
        or _never_waited(traces, world_size)
    )


def _halo_sends_problem(traces, world_size) -> str | None:
    """A send that goes the wrong way, carries the wrong element or the wrong tag."""
    for rank in range(world_size):
        left, right = (rank - 1) % world_size, (rank + 1) % world_size
        first, last = 10 * rank, 10 * rank + 2
        for note in traces[rank]["requests"]:
            if note["kind"] != "isend" or note["values"] not in ([first], [last]):
                continue
            leftwards = note["values"] == [first]  # the first element goes left, the last right
            edge = t("first") if leftwards else t("last")
            to, away = (t("left"), t("right")) if leftwards else (t("right"), t("left"))
            peer, tag = (left, TAG_TO_LEFT) if leftwards else (right, TAG_TO_RIGHT)
            if note["peer"] != peer:
                return t(
                    "rank {rank} sent its {edge} element {values} to rank {sent_to}, expected rank "
                    "{peer}, its {to} neighbour: the first element goes left (the left neighbour "
                    "puts it at the end of its halo) and the last element goes right. Are the two "
                    "edges swapped?",
                    rank=rank,
                    edge=edge,
                    values=note["values"],
                    sent_to=note["peer"],
                    peer=peer,
                    to=to,
                )
            other = TAG_TO_RIGHT if tag == TAG_TO_LEFT else TAG_TO_LEFT
            tagged = f"{note['tag']}{_tag_name(note['tag'])}"
            if note["tag"] == other and left == right:
                return t(
                    "rank {rank} sent its {edge} element with tag={tag}, as if it travelled "
                    "{away}: on a ring of two both neighbours are rank {peer}, so only the tag says "
                    "which way a message goes. The first element goes left (TAG_TO_LEFT), the last "
                    "goes right (TAG_TO_RIGHT). Are the two edges swapped?",
                    rank=rank,
                    edge=edge,
                    tag=tagged,
                    away=away,
                    peer=peer,
                )
            if note["tag"] != tag:
                return t(
                    "rank {rank} sent its {edge} element to its {to} neighbour with tag={tag}, "
                    "expected {expected}: tag each message with the direction it travels, and "
                    "receive with the tag its sender used (the message from your left neighbour "
                    "travelled right: TAG_TO_RIGHT).",
                    rank=rank,
                    edge=edge,
                    to=to,
                    tag=tagged,
                    expected=_TAG_NAMES[tag],
                )
    return None


def _halo_receives_problem(traces, world_size, results) -> str | None:
    """On a ring of two both messages come from the same rank: only the tags tell them apart."""
    for rank in range(world_size):
        got = results[rank]["halo"]
        receives = [n for n in traces[rank]["requests"] if n["kind"] == "irecv"]
        tags = sorted(n["tag"] for n in receives)
        if len(receives) == 2 and tags[0] == tags[1]:
            return t(
                "rank {rank} received both edges with the same tag={tag}: on a ring of two, left "
                "and right are the same rank, so both messages travel between the same pair and "
                "nothing tells them apart. Give 'to the left' and 'to the right' each its own tag, "
                "and receive each direction with the tag it was sent with.",
                rank=rank,
                tag=tags[0],
            )
        for note in receives:
            if note["values"] and note["values"] == got[:1] and note["tag"] != TAG_TO_RIGHT:
                return t(
                    "rank {rank} put on its left the element received with tag={tag}: the message "
                    "from the left neighbour travelled to the right, so it carries TAG_TO_RIGHT "
                    "(and the one from the right carries TAG_TO_LEFT). Receive each with the tag it "
                    "was sent with.",
                    rank=rank,
                    tag=f"{note['tag']}{_tag_name(note['tag'])}",
                )
    return None


@pytest.mark.step(5)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_halo_exchange(world_size):
    results, traces = _run(_halo, world_size, explain=_explain_halo)
    for rank, got in enumerate(results):
        assert got["batches"], t(
            "rank {rank} never called dist.batch_isend_irecv: this step posts its sends "
            "and receives as one batch of dist.P2POp",
            rank=rank,
        )
        assert got["strip"] == [10 * rank + i for i in range(3)], t(
            "rank {rank}'s strip changed to {strip}: leave it as it was (send copies or "
            "slices of it, receive into new tensors)",
            rank=rank,
            strip=got["strip"],
        )
    never = _never_waited(traces, world_size)
    assert never is None, never
    for rank, got in enumerate(results):
        left, right = (rank - 1) % world_size, (rank + 1) % world_size
        strip = [10 * rank + i for i in range(3)]
        want = [10 * left + 2, *strip, 10 * right]
        if got["halo"] != want:
            why = _halo_sends_problem(traces, world_size) or _halo_receives_problem(
                traces, world_size, results
            )
            pytest.fail(
                t(
                    "rank {rank} returned {got}, expected {want}: [left neighbour's last, *strip, "
                    "right neighbour's first], where the left neighbour is rank {left} and the "
                    "right rank {right}.",
                    rank=rank,
                    got=got["halo"],
                    want=want,
                    left=left,
                    right=right,
                )
                + (f"\n{why}" if why else ""),
                pytrace=False,
            )


# ------------------------------------------------------------------------------ bad input


def _bad_arguments(rank, world_size, function):
    kata = load_kata(KATA)
    if function == "ping_pong":
        kata.ping_pong(1)  # the function works ...
        return {  # ... and refuses what cannot work
            "ping_pong(0)": refusal(lambda: kata.ping_pong(0)),
            "ping_pong(-2)": refusal(lambda: kata.ping_pong(-2)),
        }
    if function == "token_ring":
        kata.token_ring(0)
    elif function == "shift_right":
        kata.shift_right(torch.zeros(2))
    elif function == "halo_exchange":
        kata.halo_exchange(torch.zeros(2))
        return {
            t("halo_exchange(an empty strip)"): refusal(lambda: kata.halo_exchange(torch.zeros(0))),
            t("halo_exchange(a 2-D strip)"): refusal(lambda: kata.halo_exchange(torch.zeros(2, 2))),
        }
    return {}


def _world_of_one(rank, world_size, function):
    kata = load_kata(KATA)
    calls = {
        "ping_pong": lambda: kata.ping_pong(1),
        "token_ring": lambda: kata.token_ring(0),
        "shift_right": lambda: kata.shift_right(torch.zeros(1)),
        "halo_exchange": lambda: kata.halo_exchange(torch.zeros(3)),
    }
    return {
        t("{function}(...) in a world of one rank", function=function): refusal(calls[function])
    }


def _check_refusals(function: str) -> None:
    outcomes = {
        **run_world(_bad_arguments, 2, function, deadline=DEADLINE_S)[0],
        **run_world(_world_of_one, 1, function, deadline=DEADLINE_S)[0],
    }
    for call, outcome in outcomes.items():
        assert outcome is None, t(
            "{call} {outcome}, expected a ValueError that says what is wrong",
            call=call,
            outcome=outcome,
        )


@pytest.mark.step(1)
def test_ping_pong_refuses_bad_arguments():
    _check_refusals("ping_pong")


@pytest.mark.step(2)
def test_token_ring_refuses_a_world_of_one():
    _check_refusals("token_ring")


@pytest.mark.step(3)
def test_shift_right_refuses_a_world_of_one():
    _check_refusals("shift_right")


@pytest.mark.step(5)
def test_halo_exchange_refuses_bad_strips():
    _check_refusals("halo_exchange")


# ------------------------------------------------------------------------------ the program


@pytest.mark.step(5)
def test_program_shows_every_exchange(kata, capsys):
    out = run_module_ok(KATA, "--world-size", "3", timeout=120).stdout
    for lines in (
        ["[rank 0] ping-pong: received [1, 3, 5]", "[rank 1] ping-pong: received [0, 2, 4]"],
        [
            "[rank 0] token ring: got the token back as 106",
            "[rank 1] token ring: received the token as 101",
            "[rank 2] token ring: received the token as 103",
        ],
        ["[rank 0] shift right: sent [0, 0], received [2, 2]"],
        ["[rank 1] halo exchange: [10, 11, 12] -> [2, 10, 11, 12, 20]"],
        ["[main] 3 ranks exchanged messages point to point, and none deadlocked"],
    ):
        block = "\n".join(lines)
        assert block in out, t(
            "the program's output lacks these lines, in this order:\n{block}\n\nit printed:\n{out}",
            block=block,
            out=out,
        )
    with pytest.raises(SystemExit) as stopped:  # in this process: no second torch start-up
        kata.main(["--world-size", "1"])
    message = capsys.readouterr().err
    assert stopped.value.code == 2 and "at least two ranks" in message, t(
        "--world-size 1 should stop the program with 'at least two ranks', got exit "
        "{code}:\n"
        "{message}",
        code=stopped.value.code,
        message=message,
    )
