"""k22 · Expert parallel: a mixture of experts, one expert per rank, tokens sent to their expert.

THE IDEA
    A mixture-of-experts (MoE) layer replaces one MLP by several (the experts) and a small router
    that picks, for every token, the expert that will process it. With top-1 routing each token
    goes through one expert only, so the layer holds E times the weights of an MLP for the cost
    of one. Expert parallelism puts one expert on each rank: the router is replicated, and every
    token travels to the rank of its expert and back.

        token t:  probabilities = softmax(router(t));  e = argmax;  gate = probabilities[e]
                  output(t) = gate * expert_e(t)       (the gate lets the router learn)

    Each rank routes its own tokens, sorts them by expert (a stable sort: tokens keep their
    order within an expert) and counts them: counts[e] tokens go to rank e. The counts differ
    from rank to rank and step to step, so the receivers must learn them first: one
    all_to_all_single of the counts (rank j receives counts[j] from every rank). Then one
    all_to_all_single of the tokens with those uneven split sizes, the expert on what arrived,
    and a second all_to_all_single that sends the results back (the splits swapped), and the
    tokens go back to their order and are multiplied by their gate.

        rank 0: tokens a b c d    experts 1 0 1 1   sorted b | a c d   counts [1, 3]
        rank 1: tokens e f g      experts 0 0 1     sorted e f | g     counts [2, 1]
        counts exchanged: rank 0 receives [1, 2] (from ranks 0, 1), rank 1 receives [3, 1]
        dispatch:  rank 0 (expert 0) gets b e f;  rank 1 (expert 1) gets a c d g
        combine:   the results travel back the same way; unsort; times the gate

    An expert may get no token at all (split sizes of zero): every rank still takes part in
    every all-to-all, with empty pieces.

    Backward: all_to_all_single is a plain collective, autograd does not see through it. The
    gradient of an all-to-all is the all-to-all of the gradients the other way: what rank i
    sent to rank j, rank j's gradient of it must go back to rank i, so the backward is the same
    collective with the input and output split sizes swapped. ``AllToAll`` is that autograd
    Function (torch has one too, torch.distributed.nn.functional.all_to_all_single).

STEPS
    1. ``route(logits)``: each token's expert and gate, the order that sorts the tokens by
       expert, and the number of tokens per expert.
    2. ``exchange_counts(counts, process_group=None, device=None)``: how many tokens this rank will receive
       from each rank.
    3. ``AllToAll``: the all-to-all with uneven split sizes as an autograd Function (forward:
       the tokens go out; backward: their gradients come back).
    4. ``ExpertParallelMoE.forward``: route, sort, exchange counts, dispatch, expert, combine,
       unsort, gate; and the tokens per expert, kept for the report.

WHAT THE TESTS CHECK
    ``route`` on logits where the dimension, the gate, a tie and an empty expert matter;
    ``exchange_counts`` on 2 and 4 ranks and inside a subgroup (a collective off the group is
    stopped and named); by recording every rank's calls, that the counts are exchanged with one
    all_to_all_single before the tokens move; ``AllToAll`` with uneven and empty splits, forward and backward,
    against torch's own; on 2 and 4 ranks, that the layer's outputs and the gradients of its
    input, router and experts equal one process running every expert (``LocalMoE``, the same
    weights), and inside a subgroup; an expert that gets no token; the tokens per expert; and the
    program.

RUN IT
    .venv/bin/python -m katas.k22_experts --world-size 2 --tokens 12
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo
from dojo.toy_models import MLP, MLP_DIM, MODEL_DIM


@dataclass
class Routing:
    expert: torch.Tensor  # (tokens,) int64: each token's expert
    gate: torch.Tensor  # (tokens,): the router's probability of that expert (keeps its grad)
    order: torch.Tensor  # (tokens,) int64: token indices sorted by expert, stable
    counts: list[int]  # counts[e]: how many tokens go to expert e (zeros included)


def route(logits: torch.Tensor) -> Routing:
    """Top-1 routing of ``logits`` (tokens, experts): expert, gate, sorting order and counts."""
    # TODO: top-1 routing of logits (tokens, experts): each token's expert (the argmax of its row),
    # its gate (the softmax probability of that expert, still in the autograd graph), the order
    # that sorts the tokens by expert keeping their order within an expert, and the number of
    # tokens per expert (one count per expert, zeros included) as a list of ints. The tests try
    # hand-made logits (an expert with no token) and random ones of several shapes.
    raise KataTodo("k22", 1, "route: each token's expert, gate and place")


def exchange_counts(
    counts: list[int],
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> list[int]:
    """``counts[j]``: tokens this rank sends rank j. Returns how many each rank sends this one.

    The counts travel in tensors on ``device`` (None: the CPU; NCCL moves CUDA tensors only).
    """
    # TODO: counts[j] is how many tokens this rank sends rank j; return, as a list of ints, how many
    # tokens each rank sends this one (element j: rank j's counts[this rank]), learned with one
    # collective on process_group, its tensors on device. A list of another length than the
    # group's size is a ValueError. The tests record every rank's calls on 2 and 4 ranks.
    raise KataTodo("k22", 2, "exchange_counts: who sends me how many")


class AllToAll(torch.autograd.Function):
    """``AllToAll.apply(x, output_splits, input_splits, process_group)``, with a backward.

    Rows ``x[sum(input_splits[:j]):][:input_splits[j]]`` go to rank j; the result holds
    ``output_splits[j]`` rows from each rank j, in rank order.
    """

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, process_group=None):
        # TODO: send rows of x to every rank of process_group: input_splits[j] rows (consecutive, in
        # rank order) to rank j; return the rows received, output_splits[j] from each rank j, in rank
        # order. Keep on ctx what backward needs. Every rank takes part even with splits of zero.
        raise KataTodo("k22", 3, "AllToAll: the all-to-all and its backward")

    @staticmethod
    def backward(ctx, grad_output):
        # TODO: the gradient of x: each received row's gradient goes back to the rank that sent it, to
        # the place it came from (shaped like x); None for the other arguments. The tests compare it
        # with torch.distributed.nn.functional.all_to_all_single on 2 and 3 ranks, with uneven and
        # empty splits.
        raise KataTodo("k22", 3, "AllToAll: the all-to-all and its backward")


class ExpertParallelMoE(nn.Module):
    """A top-1 mixture of experts, one expert per rank of ``process_group`` (None: the world).

    ``router`` (an ``nn.Linear(dim, experts)``) is the same on every rank; ``expert`` is this
    rank's own (rank r of the group holds expert r). After a forward, ``tokens_per_expert``
    lists how many of this rank's tokens went to each expert, and ``tokens_received`` how many
    tokens this rank's expert processed.
    """

    def __init__(
        self, router: nn.Linear, expert: nn.Module, process_group: dist.ProcessGroup | None = None
    ):
        super().__init__()
        experts = router.out_features
        size = dist.get_world_size(process_group)
        if experts != size:
            raise ValueError(
                f"the router chooses among {experts} experts but the group has {size} ranks: "
                "expert parallelism here puts one expert on each rank"
            )
        self.router = router
        self.expert = expert
        self.process_group = process_group
        self.tokens_per_expert: list[int] = []
        self.tokens_received = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO: the layer on this rank's tokens (any shape ending in dim): route them with the router,
        # send each to its expert's rank (rank e of the group holds expert e) in one all-to-all after
        # exchanging the counts, run this rank's expert on the tokens that arrived, send the results
        # back, put them back in token order and multiply each by its gate; the output has x's shape.
        # Keep self.tokens_per_expert (this rank's counts) and self.tokens_received (how many tokens
        # this rank's expert processed). The tests compare outputs and gradients with LocalMoE on one
        # process (2 and 4 ranks, a subgroup, an expert with no token) and record the calls' order.
        raise KataTodo("k22", 4, "the layer: dispatch, expert, combine")


class LocalMoE(nn.Module):
    """The same layer on one process: every expert here, each token through its own."""

    def __init__(self, router: nn.Linear, experts: list[nn.Module]):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probabilities = self.router(tokens).softmax(dim=-1)
        gate, chosen = probabilities.max(dim=-1)
        output = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            mine = (chosen == index).nonzero().squeeze(-1)
            output = output.index_copy(0, mine, expert(tokens[mine]))
        return (output * gate.unsqueeze(-1)).reshape(x.shape)


def make_router(seed: int, experts: int, dim: int = MODEL_DIM) -> nn.Linear:
    """The router, drawn from ``seed``: every rank builds the same one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(dim, experts)


def make_expert(seed: int, index: int, dim: int = MODEL_DIM, hidden: int = MLP_DIM) -> MLP:
    """Expert ``index``, drawn from ``seed`` and its index: rank r builds expert r."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 * seed + 1 + index)
        return MLP(dim, hidden)


# --------------------------------------------------------------------------- the program


def show_experts(rank: int, world_size: int, tokens: int, seed: int) -> dict:
    device = rank_device()
    moe = ExpertParallelMoE(
        make_router(seed, world_size).to(device), make_expert(seed, rank).to(device)
    )
    generator = torch.Generator().manual_seed(seed + 1)
    everything = torch.randn(world_size, tokens, MODEL_DIM, generator=generator)
    x = everything[rank].to(device).requires_grad_()
    y = moe(x)
    y.pow(2).sum().backward()
    say(
        rank,
        f"sent its {tokens} tokens to the experts {moe.tokens_per_expert}; expert {rank} "
        f"processed {moe.tokens_received} tokens",
    )
    return {"y": y.detach().cpu(), "grad": x.grad.cpu(), "everything": everything}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Expert parallel: one expert per rank, top-1.")
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--tokens", type=int, default=12, help="tokens per rank (default 12)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    p = args.world_size
    say(None, f"a mixture of {p} experts, one per rank, {args.tokens} tokens per rank, top-1")
    results = launch_world(
        show_experts, p, args.tokens, args.seed, backend=args.backend, device=args.device
    )
    local = LocalMoE(make_router(args.seed, p), [make_expert(args.seed, e) for e in range(p)])
    x = results[0]["everything"].reshape(-1, MODEL_DIM).requires_grad_()
    y = local(x)
    y.pow(2).sum().backward()
    gap = max(
        max(
            (r["y"] - y[i * args.tokens : (i + 1) * args.tokens]).abs().max().item(),
            (r["grad"] - x.grad[i * args.tokens : (i + 1) * args.tokens]).abs().max().item(),
        )
        for i, r in enumerate(results)
    )
    say(
        None,
        f"outputs and input gradients against one process running every expert: largest "
        f"difference {gap:.2g}",
    )
    return 0 if gap < 1e-5 else 1


if __name__ == "__main__":
    run_program(main)
