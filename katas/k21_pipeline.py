"""k21 · Pipeline parallel: a model cut into stages, micro-batches flowing through them.

THE IDEA
    Data parallelism copies the whole model to every rank. When the model no longer fits, cut
    it into consecutive stages, one per rank: rank 0 holds the embedding and the first blocks,
    the last rank the last blocks, the norm and the output layer. A forward pass runs stage
    after stage, each rank sending its output activations to the next (``dist.send``/``recv``);
    backward runs the other way, each rank sending the gradient of its input activations back.

        rank 0: embedding, blocks 0-1  --activations-->  rank 1: blocks 2-3, norm, output, loss
                                       <--their grads--

    One batch at a time, only one rank works while the others wait. Cut the batch into m
    micro-batches and the stages overlap: rank 1 runs micro-batch 0 while rank 0 runs
    micro-batch 1. GPipe runs every forward, then every backward; each rank idles p - 1 ticks
    at the start of the forwards and p - 1 at the end of the backwards (one tick = one stage's
    forward or backward of one micro-batch). That idle fraction is the bubble:

        GPipe, p = 2, m = 4 (ticks left to right; . = idle):
            rank 0: F0 F1 F2 F3 .  .  B0 B1 B2 B3
            rank 1: .  F0 F1 F2 F3 B0 B1 B2 B3 .        bubble = (p-1)/(m+p-1) = 1/5

    GPipe holds all m micro-batches' activations at once before the first backward. 1F1B
    (one forward, one backward) starts each micro-batch's backward as soon as it can: rank r
    runs p - 1 - r forwards to fill the pipeline (warm-up), then alternates one forward and one
    backward (steady state), then runs the backwards left (cool-down). Same bubble, but at most
    p - r micro-batches are in flight on rank r: activations held are bounded by p, not m.

        1F1B, p = 2, m = 4:
            rank 0: F0 F1 .  B0 F2 B1 F3 B2 .  B3
            rank 1: .  F0 B0 F1 B1 F2 B2 F3 B3 .

    Messages: a blocking ``dist.send`` returns only once the peer has called the matching
    ``recv`` (with gloo too), and in 1F1B two neighbours can be sending to each other at the
    same moment (rank 0 an activation forward, rank 1 a gradient back): both wait for ever.
    So send with ``dist.isend`` (keep the handles, wait for them all at the end of the step)
    and receive with a blocking ``dist.recv`` just before the action that needs the tensor.

    The loss is the mean over the whole batch: each micro-batch's loss (a mean over its own
    tokens) divided by m, and the gradients accumulate over the micro-batches, so the step
    equals one process on the whole batch (to rounding: a mean of means adds in another order).

STEPS
    1. ``split_stages(model, stages, rank)``: this rank's ``Stage`` (the model's own modules,
       blocks spread evenly, the extra ones to the first stages); ``ValueError`` for a count
       of stages or a rank that does not fit.
    2. ``gpipe_actions`` and ``one_f_one_b_actions``: each rank's ordered list of ``("F", i)``
       and ``("B", i)`` for p stages and m micro-batches.
    3. ``run_schedule(stage, actions, micro_batches, process_group=None, loss_fn=...)``: the
       actions run, activations sent forward and their gradients back, the loss on the last
       stage (``loss_fn``, ``transformer_loss`` unless told), gradients accumulated; returns the
       loss and the most activations held at once.
    4. ``simulate(schedules)``: a clock of ticks, one per action, a rank waiting for its input:
       every action's tick and every rank's idle fraction (the bubble).

WHAT THE TESTS CHECK
    The stages of 4 blocks over 1, 2, 3 and 4 ranks (which modules, the model's own, refused
    counts); both schedules as data for several p and m (each micro-batch once forward and
    once backward, 1F1B's warm-up, steady state and cool-down); on 2 and 4 ranks, that both
    schedules give the gradients of one process (bitwise those of one process looping over
    the same micro-batches, close to the whole batch at once), by recording every send and
    recv (how many, to which rank), the activations held at once (m for GPipe, at most p - r
    for 1F1B) and the same gradients as torch.distributed.pipelining's ScheduleGPipe and
    Schedule1F1B on the same stages; a pipeline inside a subgroup; a loss_fn given is the one
    backpropagated; the simulated bubble against (p-1)/(m+p-1); a schedule that waits for ever;
    the program.

RUN IT
    .venv/bin/python -m katas.k21_pipeline --world-size 2 --schedule 1f1b --micro-batches 4
    .venv/bin/python -m dojo trace k21 --world-size 4 --schedule gpipe --micro-batches 8

    The trace draws the schedule as it really ran: one lane per rank, each send an arrow to its
    recv, a rank's long recv bars are its bubble. The reference's are
    docs/timelines/k21_gpipe.png and docs/timelines/k21_1f1b.png (4 stages, 8 micro-batches);
    the same schedules on a clock, as this lesson draws them (simulate's ticks), are
    docs/timelines/k21_gpipe_schedule.png and docs/timelines/k21_1f1b_schedule.png.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo
from dojo.toy_models import (
    MODEL_DIM,
    Block,
    TinyTransformer,
    make_tokens,
    make_transformer,
    transformer_loss,
)

Action = tuple[str, int]  # ("F", i): forward of micro-batch i; ("B", i): its backward


class Stage(nn.Module):
    """Consecutive pieces of a TinyTransformer: its own modules, under the model's own names.

    ``blocks`` maps each block's index in the model to the block, so that the stage's
    parameter names (``blocks.2.mlp.up.weight``) are the model's. The first stage has the
    embedding (it takes tokens); the last has the norm and the output layer (it returns
    logits); the others take and return activations of shape (batch, sequence, dim).
    """

    def __init__(
        self,
        blocks: dict[int, Block],
        embedding: nn.Embedding | None = None,
        norm: nn.LayerNorm | None = None,
        output: nn.Linear | None = None,
    ):
        super().__init__()
        self.embedding = embedding
        self.blocks = nn.ModuleDict({str(index): block for index, block in blocks.items()})
        self.norm = norm
        self.output = output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks.values():
            x = block(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def split_stages(model: TinyTransformer, stages: int, rank: int) -> Stage:
    """Rank ``rank``'s stage of ``model`` cut into ``stages`` consecutive stages."""
    # TODO: rank's Stage of the model cut into `stages` consecutive stages: the model's own modules
    # (no copies), blocks keyed by their index in the model, spread as evenly as possible with the
    # extra ones (blocks % stages) on the first stages; the embedding on the first stage only, the
    # norm and the output on the last only. A count of stages that leaves a stage without a block
    # (or is below 1), or a rank outside 0..stages - 1, is a ValueError saying what does not fit.
    # The tests cut 4 blocks over 1 to 4 stages (names, identities, the chained forward) and try
    # counts and ranks that do not fit.
    raise KataTodo("k21", 1, "split_stages: this rank's piece of the model")


def _check(stages: int, micro_batches: int, rank: int) -> None:
    if stages < 1 or micro_batches < 1 or not 0 <= rank < stages:
        raise ValueError(
            f"no schedule for stages={stages}, micro_batches={micro_batches}, rank={rank}: "
            "stages and micro_batches must be at least 1 and rank between 0 and stages - 1"
        )


def gpipe_actions(stages: int, micro_batches: int, rank: int) -> list[Action]:
    """GPipe: every micro-batch's forward, then every backward, in micro-batch order."""
    # TODO: rank's actions under GPipe: every micro-batch's forward, then every backward, both in
    # micro-batch order, as ("F", i) and ("B", i). Bad arguments are a ValueError (_check does
    # it). The tests compare the lists for many p, m and ranks.
    raise KataTodo("k21", 2, "the schedules as data: GPipe and 1F1B")


def one_f_one_b_actions(stages: int, micro_batches: int, rank: int) -> list[Action]:
    """1F1B: p - 1 - rank warm-up forwards, then one forward one backward, then the rest."""
    # TODO: rank's actions under 1F1B: a warm-up of p - 1 - rank forwards (never more than m),
    # then one forward and one backward (forward first) while forwards are left, then the
    # backwards left; micro-batches in order. Bad arguments are a ValueError (_check does it).
    # The tests compare the lists for many p, m and ranks.
    raise KataTodo("k21", 2, "the schedules as data: GPipe and 1F1B")


SCHEDULES = {"gpipe": gpipe_actions, "1f1b": one_f_one_b_actions}


@dataclass
class PipelineRun:
    loss: float | None  # the last stage's loss of the whole batch (None on the other stages)
    peak_activations: int  # the most micro-batches whose forward ran and backward had not yet


def run_schedule(
    stage: nn.Module,
    actions: Sequence[Action],
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    process_group: dist.ProcessGroup | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = transformer_loss,
) -> PipelineRun:
    """Run this rank's ``actions`` on its ``stage``; gradients accumulate in its parameters.

    Every rank gets the same ``micro_batches`` (tokens, targets): the first stage reads the
    tokens, the last the targets, the others only their shape. The group's rank r is stage r.
    ``loss_fn(outputs, targets)`` is a micro-batch's mean loss on the last stage: a later kata
    whose last stage holds only a shard of the logits passes a loss of its own (k39).
    """
    # TODO: run the actions in order on this rank's stage (rank r of process_group is stage r). A
    # forward of micro-batch i: the first stage runs the tokens; the others receive the
    # activations, of shape tokens.shape + (MODEL_DIM,), from the previous rank; every stage but
    # the last sends its output to the next. A backward of i: the last stage backpropagates
    # loss_fn(output, targets) / number of micro-batches (the loss it is given, whatever it is:
    # transformer_loss unless told); the others receive the gradient of their output from the next
    # rank and backpropagate it; every stage but the first sends the gradient of its input to the
    # previous rank. Gradients accumulate in .grad over the micro-batches. No rank may wait for ever, for any p and m (peers as global ranks of the
    # group). Return PipelineRun(the last stage's total loss, else None; the most micro-batches
    # whose forward ran and backward not yet, held at once). The tests record every send and recv,
    # compare the gradients with one process (bitwise, looping over the same micro-batches) and
    # with torch.distributed.pipelining, on 2 and 4 ranks and a subgroup, check the peak, and that
    # a loss_fn given is the one backpropagated.
    raise KataTodo("k21", 3, "run_schedule: activations forward, gradients back")


@dataclass
class Timeline:
    ticks: list[list[int]]  # ticks[r][k]: the tick at which rank r's k-th action starts
    length: int  # ticks until the last action ends
    idle: list[float]  # each rank's idle fraction of the length: the bubble


def simulate(schedules: Sequence[Sequence[Action]]) -> Timeline:
    """Each rank's actions on a clock: one tick each, never before the input they wait for.

    ``schedules[r]`` is rank r's list of actions. A forward of micro-batch i on rank r waits
    for rank r - 1's forward of i; a backward waits for rank r + 1's backward of i (the last
    rank's for its own forward). A schedule whose ranks wait for each other for ever is a
    ``ValueError``.
    """
    # TODO: place every rank's actions on a clock of ticks: each takes one tick and starts when its
    # rank is free and its input has arrived (a forward of i on rank r after rank r - 1's forward
    # of i ended; a backward of i after rank r + 1's backward of i, or on the last rank after its
    # own forward of i). Return Timeline(the start tick of each action per rank, the tick at which
    # the last ends, each rank's idle fraction of that length). If no rank can move, ValueError.
    # The tests check the lesson's pictures, the bubble against (p-1)/(m+p-1), and a stuck schedule.
    raise KataTodo("k21", 4, "simulate: the clock and the bubble")


def bubble_formula(stages: int, micro_batches: int) -> float:
    """GPipe's and 1F1B's idle fraction with equal forward and backward ticks: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


# --------------------------------------------------------------------------- the program


def draw(timeline: Timeline, schedules: Sequence[Sequence[Action]]) -> list[str]:
    """Rank by rank, one column of 3 characters per tick: F0, B0, or idle dots."""
    lines = []
    for r, actions in enumerate(schedules):
        cells = [" . "] * timeline.length
        for (kind, i), tick in zip(actions, timeline.ticks[r]):
            cells[tick] = f"{kind}{i}".ljust(3)
        lines.append(f"rank {r}: " + "".join(cells).rstrip())
    return lines


def train_pipeline(
    rank: int, world_size: int, schedule: str, micro_batches: int, seed: int
) -> dict:
    """One step of the pipeline; returns this rank's gradients, loss and activations held."""
    device = rank_device()
    model = make_transformer(seed, blocks=4).to(device)
    stage = split_stages(model, world_size, rank)
    tokens, targets = make_tokens(2 * micro_batches, seed)
    batches = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)))
    actions = SCHEDULES[schedule](world_size, micro_batches, rank)
    run = run_schedule(stage, actions, batches)
    grads = {n: p.grad.detach().cpu().clone() for n, p in stage.named_parameters()}
    return {"loss": run.loss, "peak": run.peak_activations, "grads": grads}


def against_one_process(results: list[dict], blocks: int, micro_batches: int, seed: int) -> int:
    """Say the loss and how far the ranks' gradients are from one process's on the whole batch
    (``train_pipeline``'s model of ``blocks`` blocks and tokens); the program's exit status."""
    model = make_transformer(seed, blocks=blocks)
    tokens, targets = make_tokens(2 * micro_batches, seed)
    transformer_loss(model(tokens), targets).backward()
    whole = {n: p.grad for n, p in model.named_parameters()}
    gap = max(
        (grad.double() - whole[name].double()).abs().max().item()
        for result in results
        for name, grad in result["grads"].items()
    )
    say(
        None,
        f"loss {results[-1]['loss']:.6f}; gradients against one process on the whole batch: "
        f"largest difference {gap:.2g}",
    )
    return 0 if gap < 1e-5 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Pipeline parallel: GPipe and 1F1B schedules.")
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    p, m = args.world_size, args.micro_batches
    if m < 1:
        parser.error("--micro-batches must be at least 1")
    if not 1 <= p <= 4:
        parser.error("--world-size must be between 1 and 4 (the model has 4 blocks)")
    schedules = [SCHEDULES[args.schedule](p, m, r) for r in range(p)]
    timeline = simulate(schedules)
    say(None, f"{args.schedule} on {p} stages, {m} micro-batches (one tick per F or B):")
    for line in draw(timeline, schedules):
        say(None, "  " + line)
    formula = bubble_formula(p, m)
    for r, idle in enumerate(timeline.idle):
        say(
            None,
            f"rank {r} idle {idle:.3f} of {timeline.length} ticks; (p-1)/(m+p-1) = {formula:.3f}",
        )
    results = launch_world(
        train_pipeline, p, args.schedule, m, args.seed, backend=args.backend, device=args.device
    )
    for r, result in enumerate(results):
        held = f"{result['peak']} micro-batch" + ("'s" if result["peak"] == 1 else "es'")
        say(None, f"rank {r} held at most {held} activations at once")
    return against_one_process(results, blocks=4, micro_batches=m, seed=args.seed)


if __name__ == "__main__":
    run_program(main)
