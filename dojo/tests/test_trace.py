"""dojo.harness.timeline: every rank's torch.distributed calls recorded, drawn, and mismatches named early.

The programs traced are the implementation under test's (solutions in ``make test``): k09's ring
all-reduce, k21's pipeline where that kata is in the checkout (else a two-stage pipeline here).
"""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch
import torch.distributed as dist

from dojo.harness import impl, timeline
from dojo.harness.calls import recording
from dojo.harness.world import RankFailed, WorldDeadlock, run_world
from dojo.spec.testing import run_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """Worlds started in the test are traced into tmp_path; returns a reader of the last one."""
    monkeypatch.setenv(timeline.ENV_VAR, str(tmp_path))

    def last_world():
        worlds = timeline.pending(str(tmp_path))
        assert worlds, f"no world was recorded in {tmp_path}"
        return worlds[-1]

    return last_world


def _sends_and_recvs(calls):
    return [c for c in calls if c["name"] in ("send", "isend", "recv", "irecv")]


# --------------------------------------------------------------------------- k09's ring


def _ring(rank, world_size, length):
    kata = impl.load_kata("k09_ring_allreduce")
    tensor = torch.arange(length, dtype=torch.float32) * (rank + 1)
    kata.ring_allreduce(tensor)
    return tensor


def test_ring_allreduce_of_4_ranks_sends_2_n_minus_1_chunks_per_rank_in_order(traced):
    length, n = 10, 4  # chunks of 3, 3, 2, 2 elements: which chunk went out shows in its bytes
    results = run_world(_ring, n, length)
    meta, ranks = timeline.read_world(traced())
    assert meta["world_size"] == n and sorted(ranks) == list(range(n))
    sizes = [3, 3, 2, 2]
    for rank, calls in ranks.items():
        sends = [c for c in calls if c["name"] in ("send", "isend")]
        recvs = [c for c in calls if c["name"] in ("recv", "irecv")]
        assert len(sends) == 2 * (n - 1), (
            f"rank {rank} sent {len(sends)} chunks, expected 2(N-1) = {2 * (n - 1)}: "
            f"{[c['what'] for c in sends]}"
        )
        assert {c["peer"] for c in sends} == {(rank + 1) % n}, f"rank {rank} sent off the ring"
        assert {c["peer"] for c in recvs} == {(rank - 1) % n}, f"rank {rank} got off the ring"
        # reduce-scatter: step s sends chunk (r - s) % n; all-gather: chunk (r + 1 - s) % n
        expected = [sizes[(rank - s) % n] * 4 for s in range(n - 1)]
        expected += [sizes[(rank + 1 - s) % n] * 4 for s in range(n - 1)]
        assert [c["bytes"] for c in sends] == expected, (
            f"rank {rank}'s sends carried {[c['bytes'] for c in sends]} bytes in this order, "
            f"expected {expected} (reduce-scatter's chunks, then all-gather's)"
        )
        assert all(c["end"] is not None and c["done"] is not None for c in sends), (
            "every isend returned and its wait() was recorded"
        )
        assert all(c["end"] >= c["start"] for c in calls)
    pairs = timeline.messages(ranks)
    assert len(pairs) == 2 * (n - 1) * n, "every send is paired with its recv"
    for src, send, dst, recv in pairs:
        assert dst == (src + 1) % n
        arrived = recv["done"] if recv["async"] else recv["end"]  # an irecv's data: at its wait()
        assert arrived >= send["start"], "a message arrives after it was sent"
    total = torch.arange(length, dtype=torch.float32) * sum(range(1, n + 1))
    assert all(torch.equal(r, total) for r in results), "tracing changed the ring's result"


# --------------------------------------------------------------------------- a pipeline


def _has_k21() -> bool:
    return os.path.exists(os.path.join(ROOT, impl.current(), "k21_pipeline.py"))


def _pipeline(rank, world_size, schedule, micro_batches):
    if _has_k21():
        kata = impl.load_kata("k21_pipeline")
        from dojo.toy_models import make_tokens, make_transformer

        model = make_transformer(0, blocks=4)
        stage = kata.split_stages(model, world_size, rank)
        tokens, targets = make_tokens(2 * micro_batches, 0)
        batches = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)))
        actions = {"gpipe": kata.gpipe_actions, "1f1b": kata.one_f_one_b_actions}[schedule](
            world_size, micro_batches, rank
        )
        kata.run_schedule(stage, actions, batches)
        return actions
    # Without k21: two stages, GPipe, each F or B a little work; activations forward, grads back.
    actions = [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]
    sends = []
    for kind, _ in actions:
        buffer = torch.ones(256)
        for _ in range(50):
            buffer = torch.tanh(buffer * 1.01)
        if (kind == "F") == (rank == 0):
            sends.append(dist.isend(buffer, 1 - rank))
        else:
            dist.recv(buffer, 1 - rank)
    for work in sends:
        work.wait()
    return actions


def test_a_pipelines_bubbles_show_as_waiting_recvs(traced):
    m = 4
    actions = run_world(_pipeline, 2, "gpipe", m)
    _, ranks = timeline.read_world(traced())
    first = [c["name"] for c in _sends_and_recvs(ranks[0])]
    last = [c["name"] for c in _sends_and_recvs(ranks[1])]
    assert first == ["isend"] * m + ["recv"] * m, (
        f"GPipe: rank 0 sends every activation, then receives every gradient; got {first}"
    )
    assert last == ["recv"] * m + ["isend"] * m, f"GPipe: the last stage; got {last}"
    pairs = timeline.messages(ranks)
    assert len(pairs) == 2 * m, "every activation and every gradient is one message, paired"
    # The bubble, as the recorded times show it (causes only: ranks start at different times,
    # so no claim on how long anything took): rank 1 leaves its first recv only after rank 0
    # has sent its first activation; it sends the first gradient back only after its last
    # forward; rank 0 waits in its first recv until that gradient was sent.
    recvs_1 = [c for c in ranks[1] if c["name"] == "recv"]
    send_0 = next(c for c in ranks[0] if c["name"] == "isend")
    assert recvs_1[0]["end"] >= send_0["start"], "rank 1's first recv ended before rank 0 sent"
    sends_1 = [c for c in ranks[1] if c["name"] == "isend"]
    assert sends_1[0]["start"] >= recvs_1[-1]["end"], "GPipe: every forward before a backward"
    recv_0 = next(c for c in ranks[0] if c["name"] == "recv")
    assert recv_0["end"] >= sends_1[0]["start"], (
        "rank 0's first gradient arrives after rank 1 sent it: rank 0 idles from its last "
        "forward until then (the bubble)"
    )
    assert actions[0][:1] == [("F", 0)]


@pytest.mark.skipif(not _has_k21(), reason="k21_pipeline is not in this checkout")
def test_one_f_one_b_interleaves_sends_and_recvs_as_its_schedule_says(traced):
    m = 4
    actions = run_world(_pipeline, 2, "1f1b", m)
    _, ranks = timeline.read_world(traced())
    for rank in (0, 1):
        expected = []
        for kind, _ in actions[rank]:
            if rank == 0:
                expected += ["isend"] if kind == "F" else ["recv"]
            else:
                expected += ["recv"] if kind == "F" else ["isend"]
        got = [c["name"] for c in _sends_and_recvs(ranks[rank])]
        assert got == expected, f"rank {rank}: calls {got}, the schedule {actions[rank]}"


# --------------------------------------------------------------------------- the files


def _exchange(rank, world_size):
    tensor = torch.full((4,), float(rank))
    dist.all_reduce(tensor)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    work = dist.isend(tensor.clone(), right)
    dist.recv(tensor, left)
    work.wait()
    incoming = torch.empty(4)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, tensor.clone(), right), dist.P2POp(dist.irecv, incoming, left)]
    )
    for work in works:
        work.wait()
    dist.barrier()
    return tensor + incoming


def test_the_chrome_trace_has_a_track_per_rank_and_a_flow_per_message(traced, tmp_path):
    run_world(_exchange, 3)
    json_path, png_path = timeline.write_world(traced(), str(tmp_path), name="exchange")
    with open(json_path) as f:
        data = json.load(f)  # valid JSON
    events = data["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert tracks == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    slices = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert {e["pid"] for e in slices} == {0, 1, 2}
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slices), "µs from the first call"
    names = [e["name"] for e in slices if e["pid"] == 0]
    assert names == ["all_reduce", "isend", "recv", "batch_isend_irecv", "barrier"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == 6, "3 ranks x (one isend + one batched isend): 6 messages"
    assert starts.keys() == ends.keys(), "every flow that starts at a send ends at a recv"
    for number, start in starts.items():
        assert ends[number]["pid"] == (start["pid"] + 1) % 3, "each message goes to the right"
        assert ends[number]["ts"] >= start["ts"]
    with open(png_path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "a real PNG"
    width, height = struct.unpack(">II", head[16:24])
    assert 800 <= width <= 4000 and 200 <= height <= 3000, f"a {width}x{height} picture"
    assert not timeline.pending(str(tmp_path)), "the world's records go once written"


def test_a_correct_run_gives_the_same_results_traced(tmp_path, monkeypatch):
    untraced = run_world(_many, 4)
    monkeypatch.setenv(timeline.ENV_VAR, str(tmp_path))
    traced_results = run_world(_many, 4)
    for rank, (a, b) in enumerate(zip(untraced, traced_results)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"rank {rank}'s {key} changed under the trace"
    _, ranks = timeline.read_world(timeline.pending(str(tmp_path))[-1])
    assert all(len(calls) >= 9 for calls in ranks.values())


def _many(rank, world_size):
    """Collectives a correct program makes that differ between ranks in legal ways."""
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(5, generator=generator)
    out = {}
    summed = x.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    out["sum"] = summed
    source = x.clone()
    dist.broadcast(source, src=2)
    out["broadcast"] = source
    work = dist.all_reduce(x.clone(), async_op=True)
    work.wait()
    gathered = [torch.empty(5) for _ in range(world_size)] if rank == 1 else None
    dist.gather(x, gathered, dst=1)
    out["gathered"] = torch.stack(gathered) if gathered else torch.zeros(0)
    scattered = torch.empty(2)
    parts = [torch.full((2,), float(i)) for i in range(world_size)] if rank == 0 else None
    dist.scatter(scattered, parts, src=0)
    out["scattered"] = scattered
    pair = dist.new_group([0, 1])
    odd = dist.new_group([2, 3])
    mine = pair if rank < 2 else odd
    local = x.clone()
    dist.all_reduce(local, group=mine)
    out["local"] = local
    everyone = [torch.empty(5) for _ in range(world_size)]
    dist.all_gather(everyone, x)
    out["all"] = torch.stack(everyone)
    dist.barrier()
    return out


# --------------------------------------------------------------------------- mismatches, hangs


def _mismatch(rank, world_size):
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    dist.all_reduce(tensor)
    if rank == 0:
        dist.broadcast(tensor, src=0)
    else:
        dist.all_reduce(tensor)
    return tensor


def test_a_mismatch_is_named_before_the_deadline(traced):
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run_world(_mismatch, 4, deadline=60)
    message = str(failure.value)
    assert time.monotonic() - start < 30, "it did not wait for the deadline"
    assert "3rd collective on the world" in message, message
    assert "broadcast(float32[4], src=0)" in message and "all_reduce(float32[4])" in message
    assert "the ranks called different collectives" in message
    assert "test_trace.py" in message, "where each rank made the call"


def _one_waits(rank, world_size):
    if rank == 0:
        dist.recv(torch.empty(3), src=1)  # rank 1 never sends


def test_a_hung_world_still_leaves_its_calls_and_the_one_that_never_returned(traced, tmp_path):
    with pytest.raises(WorldDeadlock):
        run_world(_one_waits, 2, deadline=20, straggler=1)
    _, ranks = timeline.read_world(traced())
    assert [c["name"] for c in ranks[0]] == ["recv"] and ranks[0][0]["end"] is None
    assert ranks[1] == []
    json_path, png_path = timeline.write_world(traced(), str(tmp_path), name="hung")
    with open(json_path) as f:
        events = json.load(f)["traceEvents"]
    (stuck,) = [e for e in events if e["ph"] == "X"]
    assert "never" in stuck["args"]["returned"]
    assert os.path.getsize(png_path) > 1000


def test_recording_without_the_trace_is_as_before():
    results = run_world(_recorded, 2)
    assert results[0] == (["all_reduce()", "isend(dst=1)"], [16, 16], True)


def _recorded(rank, world_size):
    with recording() as calls:
        tensor = torch.ones(4)
        dist.all_reduce(tensor)
        if rank == 0:
            dist.isend(tensor, 1).wait()
        else:
            dist.recv(tensor, 0)
    return [str(c) for c in calls], [c.bytes for c in calls], calls[-1].done is not None or rank


# --------------------------------------------------------------------------- the program


def test_a_program_traced_with_dash_dash_trace_writes_both_files(tmp_path):
    done = run_module("k04_allreduce", "--world-size", "2", "--trace", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    made = sorted(os.listdir(tmp_path))
    assert made == ["k04_allreduce.json", "k04_allreduce.png"], made
    assert "ui.perfetto.dev" in done.stdout + done.stderr
    with open(tmp_path / "k04_allreduce.json") as f:
        data = json.load(f)
    assert "--trace" not in data["otherData"]["title"]
    assert {e["pid"] for e in data["traceEvents"] if e["ph"] == "X"} == {0, 1}


# --------------------------------------------------------------------------- named parts


def _named_parts(rank, world_size):
    """A program naming its parts with torch's record_function, one nested, one a decorator."""
    tensor = torch.ones(4)
    with torch.profiler.record_function("exchange"):
        dist.all_reduce(tensor)
        with torch.profiler.record_function("compute 0"):
            tensor = torch.tanh(tensor)
    _decorated(tensor)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    optimizer.step()  # torch names its own step (Optimizer.step#SGD.step): not a kata's part
    return tensor


@torch.profiler.record_function("compute 1")
def _decorated(tensor):
    dist.barrier()


def test_a_katas_named_parts_become_spans_strips_and_a_track(traced, tmp_path):
    run_world(_named_parts, 2)
    world = traced()
    spans = timeline.read_spans(world)
    for rank in (0, 1):
        got = [(s["name"], s["depth"]) for s in spans[rank]]
        assert got == [("exchange", 0), ("compute 0", 1), ("compute 1", 0)], (
            f"rank {rank}'s named parts, in the order opened, with their nesting: {got}"
        )
        exchange, inner, decorated = spans[rank]
        assert exchange["start"] <= inner["start"] <= inner["end"] <= exchange["end"]
        assert decorated["start"] >= exchange["end"]
        _, ranks = timeline.read_world(world)
        all_reduce, barrier = ranks[rank]
        assert exchange["start"] <= all_reduce["start"] <= all_reduce["end"] <= exchange["end"], (
            "the all_reduce happened inside the part 'exchange'"
        )
        assert decorated["start"] <= barrier["start"] <= barrier["end"] <= decorated["end"]
    json_path, png_path = timeline.write_world(world, str(tmp_path), name="parts")
    with open(json_path) as f:
        events = json.load(f)["traceEvents"]
    parts = [e for e in events if e.get("cat") == "part"]
    assert sorted((e["pid"], e["name"]) for e in parts) == sorted(
        (rank, name) for rank in (0, 1) for name in ("exchange", "compute 0", "compute 1")
    )
    assert {e["tid"] for e in parts} == {2}, "the parts have a track of their own"
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(0, 2)] == "parts"
    assert os.path.getsize(png_path) > 1000


def test_record_function_untraced_is_torchs_alone():
    cls = torch.autograd.profiler.record_function
    before = (cls.__enter__, cls.__exit__)
    run_world(_named_parts, 2)
    assert (cls.__enter__, cls.__exit__) == before
