"""k22's mistakes catalogue: real mistakes in routing tokens, exchanging counts, the all-to-all's
backward and the expert-parallel layer, and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises.

Each ExpertParallelMoE entry is a subclass of the reference with its forward done the way a
learner might (the catalogue swaps whole classes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k22_experts as reference

Routing = reference.Routing
_Reference = reference.ExpertParallelMoE
_route = reference.route
_exchange = reference.exchange_counts


# --------------------------------------------------------------------------- route


def argmax_over_the_tokens(logits):
    probabilities = logits.softmax(dim=0)  # "softmax and max over dim 0"
    gate, expert = probabilities.max(dim=0)
    order = torch.argsort(expert, stable=True)
    return Routing(expert, gate, order, torch.bincount(expert, minlength=logits.shape[-1]).tolist())


def gate_is_the_logit(logits):
    gate, expert = logits.max(dim=-1)  # the score, not the probability
    order = torch.argsort(expert, stable=True)
    return Routing(expert, gate, order, torch.bincount(expert, minlength=logits.shape[-1]).tolist())


def gate_detached(logits):
    with torch.no_grad():  # "routing is a decision, not a computation"
        gate, expert = logits.softmax(dim=-1).max(dim=-1)
    order = torch.argsort(expert, stable=True)
    return Routing(expert, gate, order, torch.bincount(expert, minlength=logits.shape[-1]).tolist())


def counts_without_minlength(logits):
    gate, expert = logits.softmax(dim=-1).max(dim=-1)
    order = torch.argsort(expert, stable=True)
    return Routing(expert, gate, order, torch.bincount(expert).tolist())  # stops at the last used


def exchanges_on_the_world(counts, process_group=None, device=None):
    sending = torch.tensor(counts, dtype=torch.int64, device=device)
    receiving = torch.empty_like(sending)
    dist.all_to_all_single(receiving, sending)  # the layer's group forgotten: the world
    return receiving.tolist()


def counts_the_world(counts, process_group=None, device=None):
    size = dist.get_world_size()  # the world's size, where the group's belongs
    if len(counts) != size:
        raise ValueError(f"{len(counts)} counts for a group of {size} ranks")
    sending = torch.tensor(counts, dtype=torch.int64, device=device)
    receiving = torch.empty(size, dtype=torch.int64, device=device)
    dist.all_to_all_single(receiving, sending, group=process_group)
    return receiving.tolist()


# Right answer written another way.


def route_with_topk(logits):
    """topk(1) and a count per expert by comparison."""
    gate, expert = torch.topk(torch.softmax(logits, dim=1), k=1, dim=1)
    gate, expert = gate.squeeze(1), expert.squeeze(1)
    counts = [int((expert == e).sum()) for e in range(logits.shape[1])]
    order = torch.cat([(expert == e).nonzero().flatten() for e in range(logits.shape[1])])
    return Routing(expert, gate, order, counts)


# --------------------------------------------------------------------------- exchange_counts


def own_counts(counts, process_group=None, device=None):
    return list(counts)  # "everyone sends the same split sizes"


def summed_counts(counts, process_group=None, device=None):
    total = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(total, group=process_group)  # how many every expert gets in all
    return total.tolist()


# Right answer written another way.


def exchange_with_explicit_splits(counts, process_group=None, device=None):
    """One count to each rank, said out loud with split sizes of 1."""
    size = dist.get_world_size(process_group)
    if len(counts) != size:
        raise ValueError(f"{len(counts)} counts for {size} ranks")
    out = torch.zeros(size, 1, dtype=torch.int64, device=device)
    dist.all_to_all_single(
        out,
        torch.tensor(counts, dtype=torch.int64, device=device).unsqueeze(1),
        output_split_sizes=[1] * size,
        input_split_sizes=[1] * size,
        group=process_group,
    )
    return [int(v) for v in out.flatten()]


# --------------------------------------------------------------------------- AllToAll


class BackwardSplitsNotSwapped(reference.AllToAll):
    @staticmethod
    def backward(ctx, grad_output):
        output_splits, input_splits = ctx.splits
        grad_input = grad_output.new_empty(sum(input_splits), *grad_output.shape[1:])
        dist.all_to_all_single(  # the forward's splits again
            grad_input,
            grad_output.contiguous(),
            output_split_sizes=output_splits,
            input_split_sizes=input_splits,
            group=ctx.process_group,
        )
        return grad_input, None, None, None


class BackwardPassesThrough(reference.AllToAll):
    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None, None  # "the all-to-all is just a copy"


class EvenSplits(reference.AllToAll):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, process_group=None):
        ctx.splits = (list(output_splits), list(input_splits))
        ctx.process_group = process_group
        output = torch.empty_like(x)  # "an all-to-all keeps the shape"
        dist.all_to_all_single(output, x.contiguous(), group=process_group)
        return output


class BackwardOnTheWorld(reference.AllToAll):
    @staticmethod
    def backward(ctx, grad_output):
        output_splits, input_splits = ctx.splits
        grad = grad_output.contiguous()
        grad_input = grad.new_empty(sum(input_splits), *grad.shape[1:])
        dist.all_to_all_single(  # the way back, but the group forgotten: the world
            grad_input, grad, output_split_sizes=input_splits, input_split_sizes=output_splits
        )
        return grad_input, None, None, None


# Right answer written another way.


class BackwardThroughItself(reference.AllToAll):
    """backward calls the Function itself (so a second backward would work too), as torch's."""

    @staticmethod
    def backward(ctx, grad_output):
        output_splits, input_splits = ctx.splits
        grad = BackwardThroughItself.apply(
            grad_output, input_splits, output_splits, ctx.process_group
        )
        return grad, None, None, None


# --------------------------------------------------------------------------- the layer


class _Layer(_Reference):
    """The reference's forward with its pieces open to change."""

    def received(self, routing):
        return _exchange(routing.counts, self.process_group, routing.expert.device)

    def outgoing(self, tokens, routing):
        return tokens[routing.order]

    def run_expert(self, arrived):
        return self.expert(arrived)

    def combine(self, back, routing):
        restored = torch.empty_like(back).index_copy(0, routing.order, back)
        return restored * routing.gate.unsqueeze(-1)

    def forward(self, x):
        shape = x.shape
        tokens = self.flatten(x)
        routing = _route(self.router(tokens))
        received = self.received(routing)
        arrived = reference.AllToAll.apply(
            self.outgoing(tokens, routing), received, routing.counts, self.process_group
        )
        processed = self.run_expert(arrived)
        back = self.send_back(processed, routing, received)
        self.tokens_per_expert = routing.counts
        self.tokens_received = sum(received)
        return self.combine(back, routing).reshape(shape)

    def flatten(self, x):
        return x.reshape(-1, x.shape[-1])

    def send_back(self, processed, routing, received):
        return reference.AllToAll.apply(processed, routing.counts, received, self.process_group)


class NotRestoredToTokenOrder(_Layer):
    def combine(self, back, routing):
        return back * routing.gate[routing.order].unsqueeze(-1)  # right gates, sorted order


class GateNotApplied(_Layer):
    def combine(self, back, routing):
        return torch.empty_like(back).index_copy(0, routing.order, back)


class GateAppliedTwice(_Layer):
    def outgoing(self, tokens, routing):
        return (tokens * routing.gate.unsqueeze(-1))[routing.order]  # gated going out...

    # ... and again on the way back (the reference's combine)


class ExpertChosenByRank(_Layer):
    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        routing = _route(self.router(tokens))  # routed, and then every token stays here
        self.tokens_per_expert = routing.counts
        self.tokens_received = tokens.shape[0]
        return (self.expert(tokens) * routing.gate.unsqueeze(-1)).reshape(x.shape)


class SplitsNotExchanged(_Layer):
    def received(self, routing):
        return list(routing.counts)  # the receiver assumes its own counts


class UnflattenedTokens(_Layer):
    def flatten(self, x):
        return x  # (batch, sequence, dim): the splits count tokens, dim 0 counts sequences

    def forward(self, x):
        shape = x.shape
        routing = _route(self.router(x.reshape(-1, shape[-1])))
        received = self.received(routing)
        arrived = reference.AllToAll.apply(x, received, routing.counts, self.process_group)
        back = self.send_back(self.run_expert(arrived), routing, received)
        self.tokens_per_expert = routing.counts
        self.tokens_received = sum(received)
        return self.combine(back, routing).reshape(shape)


class SkipsAnIdleExpert(_Layer):
    def send_back(self, processed, routing, received):
        if sum(received) == 0:  # "no tokens, nothing to send back"
            return processed.new_zeros(sum(routing.counts), processed.shape[-1])
        return super().send_back(processed, routing, received)


class ResultsBackOnTheWorld(_Layer):
    def send_back(self, processed, routing, received):
        return reference.AllToAll.apply(processed, routing.counts, received)  # group forgotten


class TokensSentUnsorted(_Layer):
    def outgoing(self, tokens, routing):
        return tokens  # the counts are per expert, but the rows are in token order


# Right answer written another way.


class InversePermutation(_Layer):
    """Undo the sort by indexing with the inverse permutation."""

    def combine(self, back, routing):
        inverse = torch.argsort(routing.order)
        return back[inverse] * routing.gate[:, None]


_LAYER = "test_layer_equals_one_process"

MISTAKES = [
    Mistake(
        "argmax_over_the_tokens",
        replaces="route",
        fails=["test_route_picks_each_tokens_top_expert_and_its_gate"],
        says=["the argmax over the tokens (dim 0)", "dim=-1"],
    ),
    Mistake(
        "gate_is_the_logit",
        replaces="route",
        fails=["test_route_picks_each_tokens_top_expert_and_its_gate"],
        says=["the raw logits of the chosen experts", "softmax"],
    ),
    Mistake(
        "gate_detached",
        replaces="route",
        fails=["test_route_picks_each_tokens_top_expert_and_its_gate"],
        says=["gate has no gradient", "keep it in the graph"],
    ),
    Mistake(
        "counts_without_minlength",
        replaces="route",
        fails=["test_route_picks_each_tokens_top_expert_and_its_gate"],
        says=["the expert that got no token is missing", "zeros included"],
    ),
    Mistake(
        "own_counts",
        replaces="exchange_counts",
        fails=["test_exchange_counts_tells_each_rank_what_it_will_receive"],
        says=["the receiver used its own counts", "all_to_all_single"],
    ),
    Mistake(
        "summed_counts",
        replaces="exchange_counts",
        fails=["test_exchange_counts_tells_each_rank_what_it_will_receive"],
        says=["element j is how many tokens rank j sends"],
    ),
    Mistake(
        "exchanges_on_the_world",
        replaces="exchange_counts",
        fails=["test_exchange_counts_runs_on_the_layers_group"],
        says=["all_to_all_single on the whole world", "group=process_group"],
    ),
    Mistake(
        "counts_the_world",
        replaces="exchange_counts",
        fails=["test_exchange_counts_runs_on_the_layers_group"],
        says=["counts for a group of 3 ranks", "dist.get_world_size(process_group)"],
    ),
    Mistake(
        "BackwardSplitsNotSwapped",
        replaces="AllToAll",
        fails=["test_all_to_all_moves_rows_and_their_gradients_back"],
        says=["(in backward)", "split sizes swapped"],
    ),
    Mistake(
        "BackwardPassesThrough",
        replaces="AllToAll",
        fails=["test_all_to_all_moves_rows_and_their_gradients_back"],
        says=["(in backward)", "the gradient goes back the way the rows came"],
    ),
    Mistake(
        "EvenSplits",
        replaces="AllToAll",
        fails=["test_all_to_all_moves_rows_and_their_gradients_back"],
        says=["pass both split lists"],
    ),
    Mistake(
        "BackwardOnTheWorld",
        replaces="AllToAll",
        fails=["test_a_subgroup_holds_its_own_experts"],
        says=[
            "all_to_all_single on the whole world (no group=) (in backward)",
            "keep the group in ctx",
        ],
    ),
    Mistake(
        "NotRestoredToTokenOrder",
        replaces="ExpertParallelMoE",
        fails=[_LAYER],
        says=["the tokens were not put back in their order"],
    ),
    Mistake(
        "GateNotApplied",
        replaces="ExpertParallelMoE",
        fails=[_LAYER],
        says=["as if the gate was not applied"],
    ),
    Mistake(
        "GateAppliedTwice",
        replaces="ExpertParallelMoE",
        fails=[_LAYER],
        says=["as if the gate was applied twice"],
    ),
    Mistake(
        "ExpertChosenByRank",
        replaces="ExpertParallelMoE",
        fails=[_LAYER],
        says=["not stay with this rank's expert"],
    ),
    Mistake(
        "SplitsNotExchanged",
        replaces="ExpertParallelMoE",
        fails=[_LAYER],
        says=["split sizes do not add up", "the counts it received"],
    ),
    Mistake(
        "UnflattenedTokens",
        replaces="ExpertParallelMoE",
        fails=[_LAYER],
        says=["split sizes do not add up", "on a tensor of shape (tokens, dim)"],
    ),
    Mistake(
        "SkipsAnIdleExpert",
        replaces="ExpertParallelMoE",
        fails=["test_an_expert_with_no_tokens"],
        says=["waited for each other for ever", "even when it has nothing to send or receive"],
    ),
    Mistake(
        "ResultsBackOnTheWorld",
        replaces="ExpertParallelMoE",
        fails=["test_a_subgroup_holds_its_own_experts"],
        says=[
            "all_to_all_single on the whole world (no group=) (in forward)",
            "group=process_group",
        ],
    ),
    Mistake(
        "TokensSentUnsorted",
        replaces="ExpertParallelMoE",
        fails=[_LAYER],
        says=["must travel to rank e"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("route_with_topk", replaces="route"),
    RightAnswer("exchange_with_explicit_splits", replaces="exchange_counts"),
    RightAnswer("BackwardThroughItself", replaces="AllToAll"),
    RightAnswer("InversePermutation", replaces="ExpertParallelMoE"),
]
