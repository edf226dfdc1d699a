"""k27 · Interleaved and zero-bubble pipelines: v chunks per rank, and the backward cut in two.

THE IDEA
    k21's 1F1B idles (p-1)/m of its work on every rank: the pipeline fills and drains once per
    step. Two ways shrink that bubble without more micro-batches.

    Interleaving (Megatron-LM, Narayanan et al. 2021). Cut the model into v * p VIRTUAL stages
    and give each rank v of them, looped: chunk c of rank r is virtual stage c * p + r. A
    micro-batch goes round the ranks v times (rank p - 1 sends chunk c's output to rank 0's
    chunk c + 1). Each chunk is 1/v of a rank's work, so the fill and the drain, still p - 1
    hops each way, cost 1/v as long: the bubble falls to (p-1)/(v*m) of the work.

        p = 2 ranks, v = 2 chunks, 4 blocks: virtual stages 0 1 2 3
            rank 0: chunk 0 = stage 0 (embedding, block 0)   chunk 1 = stage 2 (block 2)
            rank 1: chunk 0 = stage 1 (block 1)              chunk 1 = stage 3 (block 3, loss)
        micro-batch i: r0.c0 -> r1.c0 -> r0.c1 -> r1.c1 -> loss, and its gradient back the same way

    The schedule (torch's ScheduleInterleaved1F1B, Megatron's): forwards in rounds of p
    micro-batches, chunk after chunk (F0.0 F0.1 F1.0 F1.1 ...: chunk.micro-batch); a warm-up of
    (v-1)*p + 2*(p-1-r) forwards, then one forward one backward, then the backwards left, the
    backwards' chunks in reverse. So m must be a multiple of p. Each action is now
    (kind, chunk, i). Between two ranks, messages of several chunks and kinds share the pair:
    each one carries its own tag, so a recv takes exactly the message it waits for.

        interleaved 1F1B, p = 2, v = 2, m = 4 (F one tick, B two: ---- is its second; . = idle),
        bubble 3 idle ticks / 24 busy = (p-1)/(v*m) = 1/8 (k21's 1F1B: 1/4):
            ticks 0-13:
            rank 0: F0.0 F0.1 F1.0 F1.1 F0.2   .  B1.0 ---- F0.3 B1.1 ---- F1.2 B0.0 ----
            rank 1:   .  F0.0 F0.1 F1.0 B1.0 ---- F1.1 B1.1 ---- F0.2 B0.0 ---- F0.3 B0.1
            ticks 14-26:
            rank 0: F1.3 B0.1 ----   .  B1.2 ----   .  B1.3 ---- B0.2 ---- B0.3 ----
            rank 1: ---- F1.2 B1.2 ---- F1.3 B1.3 ---- B0.2 ---- B0.3 ----   .    .

    Zero bubble (Qi et al. 2023). A backward does two jobs: the gradient of the stage's INPUT
    (the previous stage waits for it) and the gradients of its WEIGHTS (nobody waits for them).
    Split it: B computes only the input's gradient, keeping the graph; W, later, only the
    weights'. With F, B and W one tick each, ZB-H1 (1F1B's order, a W after each B, but rank r
    runs its first r B's without one and catches up at the end) fills the drain with W's: the
    bubble falls to a third, (p-1)/(3m), holding at most p micro-batches, as 1F1B's rank 0. To keep W cheap, B keeps the gradient at the output of
    every layer that has weights; W turns each into that layer's weight gradients (one matrix
    product per linear, as a whole backward would), nothing recomputed.

        ZB-H1, p = 2, m = 4 (one tick each; . = idle):
            rank 0: F0.0 F0.1   .  B0.0 W0.0 F0.2 B0.1 W0.1 F0.3 B0.2 W0.2 B0.3 W0.3
            rank 1:   .  F0.0 B0.0 F0.1 B0.1 W0.0 F0.2 B0.2 W0.1 F0.3 B0.3 W0.2 W0.3

    The clock: F one tick, B one, W one; a B whose W is not scheduled does both, two ticks. The
    bubble is a rank's idle ticks over its busy ticks (Megatron's bubble fraction).

        schedule         bubble / work     activations held (rank 0, full stages)  when it pays
        GPipe            (p-1)/m           m micro-batches                          never over 1F1B
        1F1B (k21)       (p-1)/m           p                                        the default
        interleaved 1F1B (p-1)/(v*m)       p + (p-1)/v, v times the messages        m small, fast links
        ZB-H1            (p-1)/(3m)        p; W holds its inputs a while longer     compute-bound stages
        interleaved ZB   (p-1)/(3*v*m)     p (v * p chunks of 1/v), v times the msgs both

    What torch offers: ``torch.distributed.pipelining``: ``PipelineStage`` per chunk and the
    schedules ``ScheduleInterleaved1F1B`` (this kata's step 2), ``ScheduleLoopedBFS`` (GPipe per
    chunk), ``ScheduleInterleavedZeroBubble`` (step 5 with chunks), ``ScheduleZBVZeroBubble`` and
    ``ScheduleDualPipeV`` (two chunks per rank in a V: rank r holds stages r and 2p-1-r, so the
    last chunk's output stays on rank 0); their B/W split is ``stage_backward_input`` and
    ``stage_backward_weight``. Choose interleaving when m cannot grow (global batch, memory)
    and the links are fast (v times the sends); zero bubble when the stages are compute-bound
    and W is as dear as B; both need a model cut in p * v equal pieces.

STEPS
    1. ``virtual_stage`` and ``split_chunks``: the looped placement, and this rank's v chunks
       of the model (the model's own modules); ``ValueError`` when the blocks do not cut into
       p * v equal pieces.
    2. ``interleaved_actions``: a rank's list of ("F", c, i) and ("B", c, i) under interleaved
       1F1B; ``ValueError`` for m not a multiple of p, or fewer than 2 chunks.
    3. ``simulate``: every action on a clock (F 1 tick, B 1 or 2, W 1), each waiting for its
       input; the bubble, held against (p-1)/(v*m).
    4. ``run_schedule``: the actions for real, activations and gradients between virtual
       stages (rank p - 1 -> rank 0 for the next chunk), each message tagged; gradients equal
       to one process and to torch's ScheduleInterleaved1F1B.
    5. ``backward_input``, ``backward_weight`` and ``zero_bubble_actions``: the backward split
       in two, ZB-H1 (and interleaved ZB) as data, its bubble a third of 1F1B's, run for real.

WHAT THE TESTS CHECK
    Which blocks each chunk holds for several p and v (the model's own modules, names kept) and
    refused cuts; the interleaved schedule as data for several p, v and m, the same as torch's
    ScheduleInterleaved1F1B's order; the clock's ticks for the lesson's picture, the bubble
    (p-1)/(v*m), a stuck schedule refused; on 2 ranks (v = 2) and 4 ranks (v = 2), gradients
    bitwise those of one process looping over the micro-batches, every message tagged and
    received from the right rank, the activations held, and the same gradients as torch's
    ScheduleInterleaved1F1B on the same chunks; B giving the input's gradient and no weight's,
    W the weights' and no more matrix products than one backward; ZB-H1's bubble (p-1)/(3m),
    run for real equal to one process and to torch's ScheduleInterleavedZeroBubble; the program.

RUN IT
    .venv/bin/python -m katas.k27_interleaved_pipeline --world-size 2 --chunks 2 --micro-batches 4
    .venv/bin/python -m katas.k27_interleaved_pipeline --schedule zero-bubble --chunks 1
    .venv/bin/python -m dojo trace k27 --world-size 4 --chunks 2 --micro-batches 8

    The trace names every compute span F<chunk>.<i>, B<chunk>.<i>, W<chunk>.<i>. The reference's
    are docs/timelines/k27_interleaved.png and docs/timelines/k27_zero_bubble.png (4 ranks, 8
    micro-batches); the same schedules on a clock, as this lesson draws them (simulate's ticks),
    are docs/timelines/k27_interleaved_schedule.png and docs/timelines/k27_zero_bubble_schedule.png.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import (
    MODEL_DIM,
    TinyTransformer,
    make_tokens,
    make_transformer,
    transformer_loss,
)

from .k21_pipeline import Stage, against_one_process

Action = tuple[str, int, int]  # (kind, chunk, i): "F", "B" or "W" of micro-batch i on a chunk


# --------------------------------------------------------------------------- step 1


def virtual_stage(stages: int, chunk: int, rank: int) -> int:
    """The virtual stage that ``chunk`` of ``rank`` is, looped placement: chunk * stages + rank."""
    # BEGIN STEP 1: virtual stages: the looped placement and split_chunks
    # TODO: the virtual stage that chunk `chunk` of rank `rank` is, for `stages` ranks, placed looped
    # (rank 0 holds stages 0, p, 2p, ...). The tests try every chunk and rank for p = 1, 2, 4.
    return chunk * stages + rank
    # END STEP 1


def split_chunks(model: TinyTransformer, stages: int, chunks: int, rank: int) -> list[Stage]:
    """Rank ``rank``'s ``chunks`` Stages of ``model`` cut into ``stages * chunks`` virtual stages."""
    # BEGIN STEP 1: virtual stages: the looped placement and split_chunks
    # TODO: this rank's `chunks` Stages, chunk 0 first: chunk c holds the blocks of virtual stage
    # virtual_stage(stages, c, rank) of the model cut into stages * chunks EQUAL pieces of
    # consecutive blocks (the model's own modules, keyed by their index in the model); the embedding
    # on virtual stage 0 only, the norm and the output on the last only. Counts below 1, a rank
    # outside 0..stages - 1, or blocks that do not cut into stages * chunks equal pieces are a
    # ValueError saying what to use. The tests cut 8 blocks for several p and v (names, identities,
    # which blocks) and try cuts that do not fit.
    blocks = len(model.blocks)
    if stages < 1 or chunks < 1 or not 0 <= rank < stages:
        raise ValueError(
            f"no chunks for stages={stages}, chunks={chunks}, rank={rank}: stages and chunks "
            "must be at least 1 and rank between 0 and stages - 1"
        )
    pieces = stages * chunks
    if blocks % pieces:
        raise ValueError(
            f"cannot cut {blocks} blocks into {stages} stages x {chunks} chunks = {pieces} equal "
            f"virtual stages: use a number of chunks that divides {blocks} // {stages} (or a "
            "model whose blocks divide by stages * chunks)"
        )
    size = blocks // pieces
    mine = []
    for chunk in range(chunks):
        virtual = virtual_stage(stages, chunk, rank)
        mine.append(
            Stage(
                {i: model.blocks[i] for i in range(virtual * size, (virtual + 1) * size)},
                embedding=model.embedding if virtual == 0 else None,
                norm=model.norm if virtual == pieces - 1 else None,
                output=model.output if virtual == pieces - 1 else None,
            )
        )
    return mine
    # END STEP 1


# --------------------------------------------------------------------------- step 2


def _check(stages: int, chunks: int, micro_batches: int, rank: int) -> None:
    if stages < 1 or chunks < 1 or micro_batches < 1 or not 0 <= rank < stages:
        raise ValueError(
            f"no schedule for stages={stages}, chunks={chunks}, micro_batches={micro_batches}, "
            f"rank={rank}: stages, chunks and micro_batches must be at least 1 and rank between "
            "0 and stages - 1"
        )
    if chunks > 1 and stages < 2:
        raise ValueError(
            f"{chunks} chunks on {stages} rank: chunks go round the ranks, so interleaving needs "
            "at least 2 ranks; on one rank use chunks=1"
        )
    if chunks > 1 and micro_batches % stages:
        raise ValueError(
            f"{micro_batches} micro-batches do not go round {stages} ranks in whole rounds: an "
            f"interleaved schedule sends the micro-batches in rounds of p = {stages}; use a "
            f"multiple of {stages}"
        )


def interleaved_actions(stages: int, chunks: int, micro_batches: int, rank: int) -> list[Action]:
    """Interleaved 1F1B: rank ``rank``'s ("F", chunk, i) and ("B", chunk, i) in order."""
    # BEGIN STEP 2: the interleaved 1F1B schedule as data
    # TODO: rank's actions under interleaved 1F1B (torch's ScheduleInterleaved1F1B, Megatron's), as
    # ("F", chunk, i) and ("B", chunk, i): the k-th forward is on chunk (k // p) % v, the k-th
    # backward on the chunks in reverse, each chunk's micro-batches in order; a warm-up of
    # (v - 1) * p + 2 * (p - 1 - rank) forwards (at most v * m), then one forward and one backward
    # while forwards are left, then the backwards left. Bad arguments are a ValueError (_check does
    # most; fewer than 2 chunks is yours: one chunk is k21's 1F1B). The tests compare the lists for
    # several p, v, m and ranks, and with torch's own schedule's order.
    _check(stages, chunks, micro_batches, rank)
    if chunks < 2:
        raise ValueError(
            f"interleaving needs at least 2 chunks per rank, got {chunks}: one chunk is k21's "
            "1F1B (one_f_one_b_actions there)"
        )
    total = chunks * micro_batches  # each chunk runs every micro-batch
    warm_up = min((chunks - 1) * stages + 2 * (stages - 1 - rank), total)
    forwards, backwards = [0] * chunks, [0] * chunks
    actions: list[Action] = []
    for k in range(total + warm_up):
        if k < total:  # the k-th forward: rounds of p micro-batches, chunk after chunk
            chunk = (k // stages) % chunks
            actions.append(("F", chunk, forwards[chunk]))
            forwards[chunk] += 1
        if k >= warm_up:  # after the warm-up, a backward after each forward; then the rest
            chunk = chunks - 1 - ((k - warm_up) // stages) % chunks  # the chunks in reverse
            actions.append(("B", chunk, backwards[chunk]))
            backwards[chunk] += 1
    return actions
    # END STEP 2


# --------------------------------------------------------------------------- step 3


@dataclass
class Timeline:
    ticks: list[list[int]]  # ticks[r][k]: the tick at which rank r's k-th action starts
    length: int  # ticks until the last action ends
    busy: list[int]  # the ticks each rank computes
    bubble: list[float]  # each rank's idle ticks over its busy ticks


def simulate(schedules: Sequence[Sequence[Action]]) -> Timeline:
    """Every rank's actions on a clock, each starting when its rank is free and its input is there.

    ``schedules[r]`` is rank r's list; p = len(schedules), v = 1 + the highest chunk. Chunk c of
    rank r is virtual stage s = c * p + r. An F of i waits for stage s - 1's F of i; a B for
    stage s + 1's B of i (the last stage's for its own F of i); a W for its own B of i. A
    schedule whose ranks wait for each other for ever is a ``ValueError``.
    """
    # BEGIN STEP 3: simulate: the clock and the bubble (p-1)/(v*m)
    # TODO: place every rank's actions on a clock: each starts when its rank is free and its input
    # has ended (F of i on virtual stage s after stage s - 1's F of i; B after stage s + 1's B of i,
    # on the last stage after its own F of i; W after its own B of i). F and W take one tick, B one
    # if the rank's schedule has its W, else two. Return Timeline(start ticks per rank, the tick
    # the last action ends, each rank's busy ticks, each rank's idle ticks / busy ticks). If no rank
    # can move, ValueError. The tests check the lesson's two pictures, the bubble against
    # (p-1)/(v*m) for several p, v, m, and two stuck schedules.
    p = len(schedules)
    last = p * (1 + max((c for schedule in schedules for _, c, _ in schedule), default=0)) - 1
    sets = [set(schedule) for schedule in schedules]
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, i) -> the tick it ends
    ticks: list[list[int]] = [[] for _ in range(p)]
    free, busy, position = [0] * p, [0] * p, [0] * p
    while any(position[r] < len(schedules[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if position[r] == len(schedules[r]):
                continue
            kind, chunk, i = schedules[r][position[r]]
            s = virtual_stage(p, chunk, r)
            if kind == "F":
                needs = [("F", s - 1, i)] if s > 0 else []
            elif kind == "B":
                needs = [("B", s + 1, i)] if s < last else [("F", s, i)]
            else:
                needs = [("B", s, i)]
            if not all(need in done for need in needs):
                continue
            start = max([free[r]] + [done[need] for need in needs])
            length = 2 if kind == "B" and ("W", chunk, i) not in sets[r] else 1
            ticks[r].append(start)
            done[(kind, s, i)] = free[r] = start + length
            busy[r] += length
            position[r] += 1
            moved = True
        if not moved:
            waiting = {
                r: schedules[r][position[r]] for r in range(p) if position[r] < len(schedules[r])
            }
            raise ValueError(f"the schedules wait for each other for ever: next actions {waiting}")
    length = max(free)
    return Timeline(ticks, length, busy, [(length - b) / b for b in busy])
    # END STEP 3


def bubble_formula(stages: int, chunks: int, micro_batches: int, split: bool = False) -> float:
    """Interleaved 1F1B's idle over busy time, (p-1)/(v*m); a third of it with W's split off."""
    return (stages - 1) / ((3 if split else 1) * chunks * micro_batches)


# --------------------------------------------------------------------------- step 4


@dataclass
class PipelineRun:
    loss: float | None  # the last virtual stage's loss of the whole batch (None elsewhere)
    peak_activations: int  # the most (chunk, micro-batch) pairs held at once


@contextlib.contextmanager
def layer_outputs(stage: nn.Module) -> Iterator[list[tuple[nn.Module, torch.Tensor]]]:
    """While inside, every forward of a module with weights of its own adds (module, output)."""
    found: list[tuple[nn.Module, torch.Tensor]] = []
    handles = [
        module.register_forward_hook(lambda module, args, output: found.append((module, output)))
        for module in stage.modules()
        if any(True for _ in module.parameters(recurse=False))
    ]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def message_tag(kind: str, virtual: int, i: int, micro_batches: int) -> int:
    """The tag of the activation ("F") leaving virtual stage ``virtual`` for micro-batch i, or of
    the gradient ("B") leaving it: one tag per message of a step."""
    return 2 * (virtual * micro_batches + i) + (kind == "B")


def run_schedule(
    chunks: Sequence[nn.Module],
    actions: Sequence[Action],
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    process_group: dist.ProcessGroup | None = None,
) -> PipelineRun:
    """Run this rank's ``actions`` on its ``chunks`` (chunk c: virtual stage c * p + rank).

    Every rank gets the same ``micro_batches`` (tokens, targets). Gradients accumulate in the
    chunks' parameters. A B whose ("W", c, i) is among the actions computes only the input's
    gradient (``backward_input``), the W the weights' (``backward_weight``); else B does both.
    """
    # BEGIN STEP 4: run_schedule: chunks round the ranks, every message tagged
    # TODO: run the actions in order (chunk c of this rank, rank r of the group, is virtual stage
    # s = c * p + r). F of (c, i): virtual stage 0 runs the tokens; the others receive the
    # activations (tokens.shape + (MODEL_DIM,)) from the rank of stage s - 1; all but the last send
    # their output to the rank of stage s + 1. B of (c, i): the last stage backpropagates
    # transformer_loss(output, targets) / m, the others the gradient received from stage s + 1;
    # all but stage 0 send their input's gradient to stage s - 1. When ("W", c, i) is among the
    # actions, B calls backward_input and W backward_weight (step 5), else B does the whole
    # backward. Name each compute span record_function(f"F{c}.{i}") (B, W alike) for the trace.
    # Every message carries its own tag (message_tag) so that a recv takes exactly the tensor it
    # waits for; no rank may wait for ever; peers are global ranks of the group. Return
    # PipelineRun(the last stage's total loss, else None; the most (chunk, micro-batch) pairs
    # whose F ran and backward has not finished, held at once). The tests record every send and
    # recv (count, peers, tags), compare the gradients with one process (bitwise) and with torch's
    # ScheduleInterleaved1F1B on 2 and 4 ranks and a subgroup, and check the peak.
    rank = dist.get_rank(process_group)
    p = dist.get_world_size(process_group)
    group = process_group if process_group is not None else dist.group.WORLD
    last = p * len(chunks) - 1
    count = len(micro_batches)
    device = next(chunks[0].parameters()).device
    split = {(c, i) for kind, c, i in actions if kind == "W"}
    held: dict[tuple[int, int], tuple] = {}  # (c, i) -> (input, output, layers) until freed
    waiting: dict[tuple[int, int], WeightWork] = {}  # (c, i) -> what its W does
    sends: list[dist.Work] = []
    peak, total = 0, None

    def peer(virtual: int) -> int:
        return dist.get_global_rank(group, virtual % p)

    for kind, c, i in actions:
        s = virtual_stage(p, c, rank)
        tokens, targets = micro_batches[i]
        if kind == "F":
            if s == 0:
                inputs = tokens.to(device)
            else:
                inputs = torch.empty(*tokens.shape, MODEL_DIM, device=device)
                tag = message_tag("F", s - 1, i, count)
                dist.recv(inputs, src=peer(s - 1), group=process_group, tag=tag)
                inputs.requires_grad_()
            with torch.profiler.record_function(f"F{c}.{i}"), layer_outputs(chunks[c]) as layers:
                outputs = chunks[c](inputs)
            if s < last:
                tag = message_tag("F", s, i, count)
                sends.append(dist.isend(outputs.detach(), peer(s + 1), process_group, tag))
            held[(c, i)] = (inputs, outputs, layers)
            peak = max(peak, len(held))
        elif kind == "B":
            inputs, outputs, layers = held[(c, i)]
            if s == last:
                grad = None
            else:
                grad = torch.empty_like(outputs)
                tag = message_tag("B", s + 1, i, count)
                dist.recv(grad, src=peer(s + 1), group=process_group, tag=tag)
            with torch.profiler.record_function(f"B{c}.{i}"):
                if s == last:
                    outputs = transformer_loss(outputs, targets.to(device)) / count
                    total = outputs.detach() if total is None else total + outputs.detach()
                if (c, i) in split:
                    input_grad, waiting[(c, i)] = backward_input(inputs, outputs, grad, layers)
                else:
                    outputs.backward(grad)
                    input_grad = inputs.grad if s > 0 else None
                    del held[(c, i)]
            if s > 0:
                tag = message_tag("B", s, i, count)
                sends.append(dist.isend(input_grad, peer(s - 1), process_group, tag))
        else:
            with torch.profiler.record_function(f"W{c}.{i}"):
                backward_weight(waiting.pop((c, i)))
            del held[(c, i)]
    for work in sends:
        work.wait()
    return PipelineRun(None if total is None else total.item(), peak)
    # END STEP 4


# --------------------------------------------------------------------------- step 5


@dataclass
class WeightWork:
    """What a B leaves for its W: tensors of the graph, their gradients, the weights behind them."""

    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    weights: list[list[nn.Parameter]] = field(default_factory=list)  # per output: its weights


def backward_input(
    inputs: torch.Tensor,
    outputs: torch.Tensor,
    grad: torch.Tensor | None,
    layers: Sequence[tuple[nn.Module, torch.Tensor]],
) -> tuple[torch.Tensor | None, WeightWork]:
    """B: the gradient of ``inputs`` (None when it needs none), and what W needs, no weight's
    gradient computed; ``layers`` are the (module, output) pairs of the forward (layer_outputs)."""
    # BEGIN STEP 5: zero bubble: B and W apart, ZB-H1 as data and for real
    # TODO: B: the gradient of `inputs` (None when it requires none) under `grad` (None: `outputs`
    # is the loss), keeping the graph for W, filling no weight's .grad; and a WeightWork holding,
    # for each (module, output) of `layers`, the output, the gradient at it, and the module's own
    # weights. The tests compare both halves with one whole backward on the first, a middle and
    # the last stage, and count the matrix products: B's and W's together as many as one
    # backward's.
    wanted = [output for _, output in layers]
    needs_input = inputs.requires_grad
    found = torch.autograd.grad(
        outputs, ([inputs] if needs_input else []) + wanted, grad, retain_graph=True
    )
    input_grad = found[0] if needs_input else None
    work = WeightWork()
    for (module, output), output_grad in zip(layers, found[1 if needs_input else 0 :]):
        work.outputs.append(output)
        work.grads.append(output_grad)
        work.weights.append(list(module.parameters(recurse=False)))
    return input_grad, work
    # END STEP 5


def backward_weight(work: WeightWork) -> None:
    """W: the weights' gradients from what B kept, added to their ``.grad``."""
    # BEGIN STEP 5: zero bubble: B and W apart, ZB-H1 as data and for real
    # TODO: W: every weight's gradient from what B kept (each layer's output and the gradient at
    # it), added to its .grad (set where None), nothing of B's work done again; then let go of
    # the graph. The tests compare the gradients with one whole backward's.
    for output, output_grad, weights in zip(work.outputs, work.grads, work.weights):
        for weight, found in zip(weights, torch.autograd.grad(output, weights, output_grad)):
            if weight.grad is None:
                weight.grad = found
            else:
                weight.grad += found
    work.outputs.clear()
    work.grads.clear()
    # END STEP 5


def zero_bubble_actions(stages: int, chunks: int, micro_batches: int, rank: int) -> list[Action]:
    """ZB-H1 (chunks = 1) and its interleaved form: ("F", c, i), ("B", c, i), ("W", c, i)."""
    # BEGIN STEP 5: zero bubble: B and W apart, ZB-H1 as data and for real
    # TODO: rank's actions under ZB-H1 (chunks = 1) and its interleaved form (torch's
    # ScheduleInterleavedZeroBubble): as interleaved_actions, but with a warm-up of
    # (v - 1) * p + (p - 1 - rank) forwards, and after each B a W of the oldest B whose W has not
    # run, except that rank r puts its first r W's off until after its last B. Bad arguments are
    # a ValueError (_check). The tests compare the lists for several p, v, m, with torch's order,
    # the simulated bubble against (p-1)/(3*v*m), and run it for real.
    _check(stages, chunks, micro_batches, rank)
    total = chunks * micro_batches
    warm_up = min((chunks - 1) * stages + (stages - 1 - rank), total)
    forwards, backwards = [0] * chunks, [0] * chunks
    actions: list[Action] = []
    pending: list[tuple[int, int]] = []  # B's whose W has not run yet, oldest first
    for k in range(total + warm_up):
        if k < total:
            chunk = (k // stages) % chunks
            actions.append(("F", chunk, forwards[chunk]))
            forwards[chunk] += 1
        if k >= warm_up:
            chunk = chunks - 1 - ((k - warm_up) // stages) % chunks
            actions.append(("B", chunk, backwards[chunk]))
            pending.append((chunk, backwards[chunk]))
            backwards[chunk] += 1
            if k - warm_up >= rank:  # rank r puts its first r W's off to the end
                actions.append(("W", *pending.pop(0)))
    actions += [("W", chunk, i) for chunk, i in pending]
    return actions
    # END STEP 5


SCHEDULES = {"interleaved": interleaved_actions, "zero-bubble": zero_bubble_actions}


# --------------------------------------------------------------------------- the program


def draw(timeline: Timeline, schedules: Sequence[Sequence[Action]]) -> list[str]:
    """Rank by rank, one column of 5 characters per tick: F0.1, B1.0 (---- its second tick)."""
    lines = []
    for r, actions in enumerate(schedules):
        cells = ["  .  "] * timeline.length
        for action, tick in zip(actions, timeline.ticks[r]):
            kind, chunk, i = action
            cells[tick] = f"{kind}{chunk}.{i}".ljust(5)
            if kind == "B" and ("W", chunk, i) not in actions:
                cells[tick + 1] = "---- "
        lines.append(f"rank {r}: " + "".join(cells).rstrip())
    return lines


def train_pipeline(
    rank: int, world_size: int, schedule: str, chunks: int, micro_batches: int, seed: int
) -> dict:
    """One step of the pipeline; returns this rank's gradients, loss and activations held."""
    device = rank_device()
    model = make_transformer(seed, blocks=world_size * chunks).to(device)
    mine = split_chunks(model, world_size, chunks, rank)
    tokens, targets = make_tokens(2 * micro_batches, seed)
    batches = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)))
    actions = SCHEDULES[schedule](world_size, chunks, micro_batches, rank)
    run = run_schedule(mine, actions, batches)
    grads = {
        n: p.grad.detach().cpu().clone() for chunk in mine for n, p in chunk.named_parameters()
    }
    return {"loss": run.loss, "peak": run.peak_activations, "grads": grads}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Interleaved and zero-bubble pipeline schedules.")
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="interleaved")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks per rank (v)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    p, v, m = args.world_size, args.chunks, args.micro_batches
    if not 1 <= p <= 8 or not 1 <= v <= 4:
        parser.error("--world-size must be between 1 and 8 and --chunks between 1 and 4")
    try:
        schedules = [SCHEDULES[args.schedule](p, v, m, r) for r in range(p)]
    except ValueError as error:
        parser.error(str(error))
    timeline = simulate(schedules)
    say(None, f"{args.schedule} on {p} ranks x {v} chunks, {m} micro-batches (F<chunk>.<i>):")
    for line in draw(timeline, schedules):
        say(None, "  " + line)
    formula = bubble_formula(p, v, m, split=args.schedule == "zero-bubble")
    for r, bubble in enumerate(timeline.bubble):
        say(
            None,
            f"rank {r} idle {timeline.length - timeline.busy[r]} of {timeline.length} ticks: "
            f"bubble {bubble:.3f} of its work; formula {formula:.3f}",
        )
    results = launch_world(
        train_pipeline, p, args.schedule, v, m, args.seed, backend=args.backend, device=args.device
    )
    for r, result in enumerate(results):
        say(None, f"rank {r} held at most {result['peak']} chunk micro-batches' activations")
    return against_one_process(results, blocks=p * v, micro_batches=m, seed=args.seed)


if __name__ == "__main__":
    run_program(main)
