"""k27's mistakes catalogue: real mistakes in placing virtual stages, writing the interleaved and
zero-bubble schedules, clocking them, running them with tagged messages and splitting the
backward, and right answers written another way. See ``dojo/dev/mistakes/__init__.py``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.toy_models import MODEL_DIM, transformer_loss
from solutions import k27_interleaved_pipeline as reference

Stage = reference.Stage
Timeline = reference.Timeline
PipelineRun = reference.PipelineRun
WeightWork = reference.WeightWork
_check = reference._check
layer_outputs = reference.layer_outputs
message_tag = reference.message_tag
backward_input = reference.backward_input
backward_weight = reference.backward_weight


# --------------------------------------------------------------------------- step 1


def virtual_stage_swapped(stages, chunk, rank):
    return rank * stages + chunk  # "rank r's c-th": numbered rank-major


def _split(
    model, stages, chunks, rank, *, where=None, first=None, last=None, pick=None, check=True
):
    blocks = len(model.blocks)
    if stages < 1 or chunks < 1 or not 0 <= rank < stages:
        raise ValueError(f"no chunks for stages={stages}, chunks={chunks}, rank={rank}")
    pieces = stages * chunks
    if check and blocks % pieces:
        raise ValueError(f"{blocks} blocks do not cut into {pieces} equal virtual stages")
    size = max(1, blocks // pieces)
    where = where or (lambda c: c * stages + rank)
    first = first or (lambda c, s: s == 0)
    last = last or (lambda c, s: s == pieces - 1)
    pick = pick or (lambda module: module)
    mine = []
    for c in range(chunks):
        s = where(c)
        mine.append(
            Stage(
                {i: pick(model.blocks[i]) for i in range(s * size, min((s + 1) * size, blocks))},
                embedding=pick(model.embedding) if first(c, s) else None,
                norm=pick(model.norm) if last(c, s) else None,
                output=pick(model.output) if last(c, s) else None,
            )
        )
    return mine


def contiguous_chunks(model, stages, chunks, rank):
    # rank r holds virtual stages r * v .. r * v + v - 1: k21's stages cut finer, no looping
    return _split(model, stages, chunks, rank, where=lambda c: rank * chunks + c)


def embedding_on_every_first_chunk(model, stages, chunks, rank):
    return _split(model, stages, chunks, rank, first=lambda c, s: c == 0)


def copies_the_chunks(model, stages, chunks, rank):
    return _split(model, stages, chunks, rank, pick=copy.deepcopy)


def no_check_of_the_cut(model, stages, chunks, rank):
    return _split(model, stages, chunks, rank, check=False)  # 8 blocks in 6 pieces: 1 each, 2 lost


# Right answer written another way.


def split_chunks_from_every_stage(model, stages, chunks, rank):
    """Cut all p * v virtual stages, then take every p-th from this rank's."""
    blocks, pieces = len(model.blocks), stages * chunks
    if stages < 1 or chunks < 1 or not 0 <= rank < stages or blocks % pieces:
        raise ValueError(f"cannot cut {blocks} blocks into {stages} x {chunks} equal pieces")
    size = blocks // pieces
    every = [
        Stage(
            {i: model.blocks[i] for i in range(s * size, s * size + size)},
            embedding=model.embedding if s == 0 else None,
            norm=model.norm if s == pieces - 1 else None,
            output=model.output if s == pieces - 1 else None,
        )
        for s in range(pieces)
    ]
    return every[rank::stages]


# --------------------------------------------------------------------------- step 2


def _interleaved(
    stages,
    chunks,
    m,
    rank,
    *,
    warm_up=None,
    forward_chunk=None,
    backward_chunk=None,
    backward_first=False,
    checks=True,
):
    if checks:
        _check(stages, chunks, m, rank)
        if chunks < 2:
            raise ValueError("interleaving needs at least 2 chunks")
    p, v = stages, chunks
    total = v * m
    warm = min((v - 1) * p + 2 * (p - 1 - rank) if warm_up is None else warm_up, total)
    forward_chunk = forward_chunk or (lambda k: (k // p) % v)
    backward_chunk = backward_chunk or (lambda k: v - 1 - (k // p) % v)
    forwards, backwards, actions = [0] * v, [0] * v, []
    for k in range(total + warm):
        pair = []
        if k < total:
            c = forward_chunk(k)
            pair.append(("F", c, forwards[c]))
            forwards[c] += 1
        if k >= warm:
            c = backward_chunk(k - warm)
            pair.append(("B", c, backwards[c]))
            backwards[c] += 1
        actions += pair[::-1] if backward_first else pair
    return actions


def warm_up_of_zero_bubble(stages, chunks, micro_batches, rank):
    return _interleaved(
        stages, chunks, micro_batches, rank, warm_up=(chunks - 1) * stages + stages - 1 - rank
    )


def backward_chunks_not_reversed(stages, chunks, micro_batches, rank):
    return _interleaved(
        stages, chunks, micro_batches, rank, backward_chunk=lambda k: (k // stages) % chunks
    )


def chunks_alternate_every_forward(stages, chunks, micro_batches, rank):
    # depth-first by micro-batch: F0.0 F1.0 F0.1 F1.1 ...: not rounds of p
    return _interleaved(
        stages,
        chunks,
        micro_batches,
        rank,
        forward_chunk=lambda k: k % chunks,
        backward_chunk=lambda k: chunks - 1 - k % chunks,
    )


def backward_first_in_the_steady_state(stages, chunks, micro_batches, rank):
    return _interleaved(stages, chunks, micro_batches, rank, backward_first=True)


def no_check_of_the_rounds(stages, chunks, micro_batches, rank):
    if chunks < 2 or not 0 <= rank < stages:
        raise ValueError("interleaving needs at least 2 chunks and a rank of the stages")
    return _interleaved(stages, chunks, micro_batches, rank, checks=False)


# Right answer written another way.


def interleaved_in_three_phases(stages, chunks, micro_batches, rank):
    """Warm-up, steady state, cool-down as three loops over the forward and backward numbers."""
    _check(stages, chunks, micro_batches, rank)
    if chunks < 2:
        raise ValueError(f"interleaving needs at least 2 chunks, got {chunks}")
    p, v, total = stages, chunks, chunks * micro_batches
    warm = min((v - 1) * p + 2 * (p - 1 - rank), total)

    def forward(k):
        c = (k // p) % v
        return ("F", c, (k // (p * v)) * p + k % p)

    def backward(k):
        c = v - 1 - (k // p) % v
        return ("B", c, (k // (p * v)) * p + k % p)

    actions = [forward(k) for k in range(warm)]
    for k in range(total - warm):
        actions += [forward(warm + k), backward(k)]
    return actions + [backward(k) for k in range(total - warm, total)]


# --------------------------------------------------------------------------- step 3


def _simulate(schedules, *, full=2, over_length=False, k21_neighbours=False, w_waits=True):
    p = len(schedules)
    v = 1 + max((c for s in schedules for _, c, _ in s), default=0)
    last = p * v - 1
    sets = [set(s) for s in schedules]
    done, ticks = {}, [[] for _ in range(p)]
    free, busy, position = [0] * p, [0] * p, [0] * p
    while any(position[r] < len(schedules[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if position[r] == len(schedules[r]):
                continue
            kind, c, i = schedules[r][position[r]]
            s = c * p + r
            if kind == "F":
                if k21_neighbours:  # "the rank before me", chunk by chunk
                    needs = [("F", s - 1, i)] if r > 0 else []
                else:
                    needs = [("F", s - 1, i)] if s > 0 else []
            elif kind == "B":
                needs = [("B", s + 1, i)] if s < last else [("F", s, i)]
            else:
                needs = [("B", s, i)] if w_waits else []
            if not all(n in done for n in needs):
                continue
            start = max([free[r]] + [done[n] for n in needs])
            length = full if kind == "B" and ("W", c, i) not in sets[r] else 1
            ticks[r].append(start)
            done[(kind, s, i)] = free[r] = start + length
            busy[r] += length
            position[r] += 1
            moved = True
        if not moved:
            raise ValueError("the schedules wait for each other for ever")
    length = max(free)
    if over_length:
        return Timeline(ticks, length, busy, [(length - b) / length for b in busy])
    return Timeline(ticks, length, busy, [(length - b) / b for b in busy])


def backward_one_tick(schedules):
    return _simulate(schedules, full=1)


def bubble_over_the_length(schedules):
    return _simulate(schedules, over_length=True)  # k21's idle fraction


def forward_waits_for_the_rank_before(schedules):
    return _simulate(schedules, k21_neighbours=True)


def weight_does_not_wait(schedules):
    return _simulate(schedules, w_waits=False)


# --------------------------------------------------------------------------- step 4


def _run(
    chunks,
    actions,
    micro_batches,
    process_group=None,
    *,
    tags=True,
    divide=True,
    global_peers=True,
    free=True,
    free_at_b=False,
    requires_grad=True,
    receive_async=False,
):
    rank = dist.get_rank(process_group)
    p = dist.get_world_size(process_group)
    group = process_group if process_group is not None else dist.group.WORLD
    last = p * len(chunks) - 1
    count = len(micro_batches)
    split = {(c, i) for k, c, i in actions if k == "W"}
    held, waiting, sends, peak, total = {}, {}, [], 0, None

    def peer(s):
        return dist.get_global_rank(group, s % p) if global_peers else s % p

    def tag(kind, s, i):
        return message_tag(kind, s, i, count) if tags else 0

    def recv(tensor, src, t):
        if receive_async:
            dist.irecv(tensor, src=src, group=process_group, tag=t).wait()
        else:
            dist.recv(tensor, src=src, group=process_group, tag=t)

    for kind, c, i in actions:
        s = c * p + rank
        tokens, targets = micro_batches[i]
        if kind == "F":
            if s == 0:
                inputs = tokens
            else:
                inputs = torch.empty(*tokens.shape, MODEL_DIM)
                recv(inputs, peer(s - 1), tag("F", s - 1, i))
                if requires_grad:
                    inputs.requires_grad_()
            with layer_outputs(chunks[c]) as layers:
                outputs = chunks[c](inputs)
            if s < last:
                sends.append(
                    dist.isend(outputs.detach(), peer(s + 1), process_group, tag("F", s, i))
                )
            held[(c, i)] = (inputs, outputs, layers)
            peak = max(peak, len(held))
        elif kind == "B":
            inputs, outputs, layers = held[(c, i)]
            grad = None
            if s < last:
                grad = torch.empty_like(outputs)
                recv(grad, peer(s + 1), tag("B", s + 1, i))
            if s == last:
                outputs = transformer_loss(outputs, targets)
                if divide:
                    outputs = outputs / count
                total = outputs.detach() if total is None else total + outputs.detach()
            if (c, i) in split:
                input_grad, waiting[(c, i)] = backward_input(inputs, outputs, grad, layers)
                if free_at_b:
                    del held[(c, i)]
            else:
                outputs.backward(grad)
                input_grad = inputs.grad if s > 0 else None
                if free:
                    del held[(c, i)]
            if s > 0:
                sends.append(dist.isend(input_grad, peer(s - 1), process_group, tag("B", s, i)))
        else:
            backward_weight(waiting.pop((c, i)))
            if not free_at_b:
                del held[(c, i)]
    for work in sends:
        work.wait()
    return PipelineRun(None if total is None else total.item(), peak)


def untagged_messages(chunks, actions, micro_batches, process_group=None):
    return _run(chunks, actions, micro_batches, process_group, tags=False)


def loss_not_divided(chunks, actions, micro_batches, process_group=None):
    return _run(chunks, actions, micro_batches, process_group, divide=False)


def peers_as_group_ranks(chunks, actions, micro_batches, process_group=None):
    return _run(chunks, actions, micro_batches, process_group, global_peers=False)


def activations_never_freed(chunks, actions, micro_batches, process_group=None):
    return _run(chunks, actions, micro_batches, process_group, free=False)


def freed_at_the_input_backward(chunks, actions, micro_batches, process_group=None):
    # "B is the backward": the micro-batch let go before its W has used it
    return _run(chunks, actions, micro_batches, process_group, free_at_b=True)


def received_without_requires_grad(chunks, actions, micro_batches, process_group=None):
    return _run(chunks, actions, micro_batches, process_group, requires_grad=False)


# Right answer written another way.


def receives_with_irecv(chunks, actions, micro_batches, process_group=None):
    return _run(chunks, actions, micro_batches, process_group, receive_async=True)


# --------------------------------------------------------------------------- step 5


def weights_from_the_stage_output(inputs, outputs, grad, layers):
    """W as torch.autograd.grad(stage output, every weight): right values, B's work done twice."""
    needs = inputs.requires_grad
    input_grad = (
        torch.autograd.grad(outputs, [inputs], grad, retain_graph=True)[0] if needs else None
    )
    weights = [w for module, _ in layers for w in module.parameters(recurse=False)]
    return input_grad, WeightWork(
        [outputs], [grad if grad is not None else torch.ones_like(outputs)], [weights]
    )


def input_backward_with_backward(inputs, outputs, grad, layers):
    # .backward(retain_graph=True) "and W does the rest": every weight's .grad filled in B
    outputs.backward(grad, retain_graph=True)
    return (inputs.grad if inputs.requires_grad else None), WeightWork()


def weight_grads_overwritten(work):
    for output, output_grad, weights in zip(work.outputs, work.grads, work.weights):
        for weight, found in zip(weights, torch.autograd.grad(output, weights, output_grad)):
            weight.grad = found  # the last micro-batch's only


def _zero_bubble(stages, chunks, m, rank, *, warm_up=None, put_off=True):
    _check(stages, chunks, m, rank)
    p, v, total = stages, chunks, chunks * m
    warm = min((v - 1) * p + (p - 1 - rank) if warm_up is None else warm_up, total)
    forwards, backwards, pending, actions = [0] * v, [0] * v, [], []
    for k in range(total + warm):
        if k < total:
            c = (k // p) % v
            actions.append(("F", c, forwards[c]))
            forwards[c] += 1
        if k >= warm:
            c = v - 1 - ((k - warm) // p) % v
            actions.append(("B", c, backwards[c]))
            pending.append((c, backwards[c]))
            backwards[c] += 1
            if not put_off or k - warm >= rank:
                actions.append(("W", *pending.pop(0)))
    return actions + [("W", c, i) for c, i in pending]


def weight_right_after_every_backward(stages, chunks, micro_batches, rank):
    return _zero_bubble(stages, chunks, micro_batches, rank, put_off=False)


def warm_up_of_interleaved(stages, chunks, micro_batches, rank):
    warm = (chunks - 1) * stages + 2 * (stages - 1 - rank)
    return _zero_bubble(stages, chunks, micro_batches, rank, warm_up=warm)


# Right answer written another way.


def zero_bubble_from_the_interleaved_order(stages, chunks, micro_batches, rank):
    """Take the F and B order (warm-up (v-1)p + p-1-r), then slot the W's in after the B's."""
    _check(stages, chunks, micro_batches, rank)
    p, v = stages, chunks
    plain = _interleaved(
        p, v, micro_batches, rank, warm_up=(v - 1) * p + p - 1 - rank, checks=False
    )
    actions, pending, seen = [], [], 0
    for action in plain:
        actions.append(action)
        if action[0] == "B":
            pending.append(action[1:])
            if seen >= rank:
                actions.append(("W", *pending.pop(0)))
            seen += 1
    return actions + [("W", *rest) for rest in pending]


_SPLIT = "test_split_chunks_gives_each_chunk_its_virtual_stage"
_GRADS = "test_pipeline_gradients_equal_one_process"
_ZB = "test_zero_bubble_gradients_equal_one_process"

MISTAKES = [
    Mistake(
        "virtual_stage_swapped",
        replaces="virtual_stage",
        fails=["test_virtual_stage_is_looped"],
        says=["chunk c of rank r is virtual stage c * p + r"],
    ),
    Mistake(
        "contiguous_chunks",
        replaces="split_chunks",
        fails=[f"{_SPLIT}[2-2]"],
        says=["chunk c of rank r is virtual stage c * p + r"],
    ),
    Mistake(
        "embedding_on_every_first_chunk",
        replaces="split_chunks",
        fails=[f"{_SPLIT}[2-2]"],
        says=["the embedding only on virtual stage 0", "['embedding'] wrong"],
    ),
    Mistake(
        "copies_the_chunks",
        replaces="split_chunks",
        fails=[_SPLIT],
        says=["no copies"],
    ),
    Mistake(
        "no_check_of_the_cut",
        replaces="split_chunks",
        fails=["test_split_chunks_refuses_what_does_not_fit[2-3-0]"],
        says=["p * v equal virtual stages"],
    ),
    Mistake(
        "warm_up_of_zero_bubble",
        replaces="interleaved_actions",
        fails=["test_interleaved_actions_as_data"],
        says=["forwards before the first backward", "(v - 1) * p + 2 * (p - 1 - rank)"],
    ),
    Mistake(
        "backward_chunks_not_reversed",
        replaces="interleaved_actions",
        fails=["test_interleaved_actions_as_data"],
        says=["the chunks in reverse"],
    ),
    Mistake(
        "chunks_alternate_every_forward",
        replaces="interleaved_actions",
        fails=["test_interleaved_actions_as_data"],
        says=["forwards go in rounds of p"],
    ),
    Mistake(
        "backward_first_in_the_steady_state",
        replaces="interleaved_actions",
        fails=["test_interleaved_actions_as_data"],
        says=["the forward first"],
    ),
    Mistake(
        "no_check_of_the_rounds",
        replaces="interleaved_actions",
        fails=["test_interleaved_actions_refuse_what_does_not_fit[2-2-3-0]"],
        says=["m a multiple of p"],
    ),
    Mistake(
        "backward_one_tick",
        replaces="simulate",
        fails=["test_simulate_places_each_action_on_the_clock[interleaved]"],
        says=["B one when its W is in the schedule, else two"],
    ),
    Mistake(
        "bubble_over_the_length",
        replaces="simulate",
        fails=["test_bubble_matches_the_formula"],
        says=["over its busy ticks"],
    ),
    Mistake(
        "forward_waits_for_the_rank_before",
        replaces="simulate",
        fails=["test_simulate_places_each_action_on_the_clock[round-trip]"],
        says=["rank 0's chunk c waits for rank p - 1's chunk c - 1"],
    ),
    Mistake(
        "weight_does_not_wait",
        replaces="simulate",
        fails=["test_simulate_refuses_a_schedule_that_waits_for_ever[weight-first]"],
        says=["a W waits for its own B"],
    ),
    Mistake(
        "untagged_messages",
        replaces="run_schedule",
        fails=[f"{_GRADS}[p2-v2-m4]"],
        says=["with the same tag", "give every message its own tag"],
    ),
    Mistake(
        "loss_not_divided",
        replaces="run_schedule",
        fails=[f"{_GRADS}[p2-v2-m4]"],
        says=["times one process's", "divide each micro-batch's loss"],
    ),
    Mistake(
        "peers_as_group_ranks",
        replaces="run_schedule",
        fails=["test_a_subgroup_runs_its_own_pipeline"],
        says=["dist.get_global_rank(group, s % p)"],
    ),
    Mistake(
        "activations_never_freed",
        replaces="run_schedule",
        fails=["test_activations_held_at_once[p2-v2-m4]"],
        says=["activations held at once", "free them then"],
    ),
    Mistake(
        "received_without_requires_grad",
        replaces="run_schedule",
        fails=[f"{_GRADS}[p2-v2-m4]"],
        says=["requires_grad_()"],
    ),
    Mistake(
        "freed_at_the_input_backward",
        replaces="run_schedule",
        fails=[f"{_ZB}[zb-h1-p2-m4]"],
        says=["held until its W has run"],
    ),
    Mistake(
        "weights_from_the_stage_output",
        replaces="backward_input",
        fails=["test_backward_split_into_input_and_weights[middle]"],
        says=["repeats B's work"],
    ),
    Mistake(
        "input_backward_with_backward",
        replaces="backward_input",
        fails=["test_backward_split_into_input_and_weights"],
        says=["B computes only the input's gradient"],
    ),
    Mistake(
        "weight_grads_overwritten",
        replaces="backward_weight",
        fails=[f"{_ZB}[zb-h1-p2-m4]"],
        says=["only the last micro-batch's gradient"],
    ),
    Mistake(
        "weight_right_after_every_backward",
        replaces="zero_bubble_actions",
        fails=["test_zero_bubble_actions_as_data"],
        says=["its W's are not", "puts its first r off"],
    ),
    Mistake(
        "warm_up_of_interleaved",
        replaces="zero_bubble_actions",
        fails=["test_zero_bubble_actions_as_data"],
        says=["(v - 1) * p + (p - 1 - rank) forwards"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("split_chunks_from_every_stage", replaces="split_chunks"),
    RightAnswer("interleaved_in_three_phases", replaces="interleaved_actions"),
    RightAnswer("receives_with_irecv", replaces="run_schedule"),
    RightAnswer("zero_bubble_from_the_interleaved_order", replaces="zero_bubble_actions"),
]
