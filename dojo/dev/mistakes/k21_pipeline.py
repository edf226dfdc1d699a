"""k21's mistakes catalogue: real mistakes in cutting a model into stages, writing the GPipe and
1F1B schedules, running them with send/recv and simulating their clock, and right answers
written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.toy_models import MODEL_DIM, transformer_loss
from solutions import k21_pipeline as reference

Stage = reference.Stage
PipelineRun = reference.PipelineRun
Timeline = reference.Timeline
_check = reference._check


# --------------------------------------------------------------------------- split_stages


def _split(model, stages, rank, *, sizes=None, copies=False, checks=True):
    blocks = len(model.blocks)
    if checks and not 1 <= stages <= blocks:
        raise ValueError(f"cannot cut {blocks} blocks into {stages} stages")
    if checks and not 0 <= rank < stages:
        raise ValueError(f"rank {rank} has no stage of {stages}")
    sizes = sizes or [blocks // stages + (r < blocks % stages) for r in range(stages)]
    start = sum(sizes[:rank])
    last = rank == stages - 1
    pick = copy.deepcopy if copies else (lambda module: module)
    return Stage(
        {i: pick(model.blocks[i]) for i in range(start, start + sizes[rank])},
        embedding=pick(model.embedding) if rank == 0 else None,
        norm=pick(model.norm) if last else None,
        output=pick(model.output) if last else None,
    )


def drops_the_extra_blocks(model, stages, rank):
    # blocks // stages each: 4 blocks over 3 stages leaves block 3 in no stage
    return _split(model, stages, rank, sizes=[len(model.blocks) // stages] * stages)


def extra_blocks_to_the_last_stages(model, stages, rank):
    blocks = len(model.blocks)
    size, extra = divmod(blocks, stages)
    return _split(model, stages, rank, sizes=[size + (r >= stages - extra) for r in range(stages)])


def copies_the_modules(model, stages, rank):
    # "each rank gets its own copy": the stage's gradients never reach the model
    return _split(model, stages, rank, copies=True)


def no_check_of_the_stage_count(model, stages, rank):
    if stages < 1 or not 0 <= rank < stages:
        raise ValueError(f"rank {rank} has no stage of {stages}")
    size, extra = divmod(len(model.blocks), stages)  # 5 stages of 4 blocks: rank 0 gets none
    return _split(
        model, stages, rank, sizes=[size + (r < extra) for r in range(stages)], checks=False
    )


def numbered_from_zero(model, stages, rank):
    # the stage's own numbering: blocks.0, blocks.1 on every stage, not the model's names
    stage = _split(model, stages, rank)
    return Stage(
        dict(enumerate(stage.blocks.values())),
        embedding=stage.embedding,
        norm=stage.norm,
        output=stage.output,
    )


# Right answer written another way.


def split_with_tensor_split(model, stages, rank):
    """torch.tensor_split gives the first chunks one element more, as the rule wants."""
    blocks = len(model.blocks)
    if not 1 <= stages <= blocks or not 0 <= rank < stages:
        raise ValueError(f"{stages} stages (rank {rank}) do not fit a model of {blocks} blocks")
    mine = torch.arange(blocks).tensor_split(stages)[rank].tolist()
    return Stage(
        {i: model.blocks[i] for i in mine},
        embedding=model.embedding if rank == 0 else None,
        norm=model.norm if rank == stages - 1 else None,
        output=model.output if rank == stages - 1 else None,
    )


# --------------------------------------------------------------------------- the schedules


def _one_f_one_b(stages, micro_batches, rank, warm_up, backward_first=False):
    _check(stages, micro_batches, rank)
    warm = max(0, min(warm_up, micro_batches))
    actions = [("F", i) for i in range(warm)]
    forward, backward = warm, 0
    while forward < micro_batches:
        pair = [("F", forward), ("B", backward)]
        actions += pair[::-1] if backward_first else pair
        forward, backward = forward + 1, backward + 1
    return actions + [("B", i) for i in range(backward, micro_batches)]


def warm_up_one_too_many(stages, micro_batches, rank):
    return _one_f_one_b(stages, micro_batches, rank, stages - rank)  # p - r, not p - 1 - r


def warm_up_one_too_few(stages, micro_batches, rank):
    return _one_f_one_b(stages, micro_batches, rank, stages - 2 - rank)


def backward_first_in_the_steady_state(stages, micro_batches, rank):
    return _one_f_one_b(stages, micro_batches, rank, stages - 1 - rank, backward_first=True)


def gpipe_backwards_last_first(stages, micro_batches, rank):
    """A course's GPipe: every forward, then the backwards last micro-batch first. GPipe too,
    and right elsewhere, but not the order this kata (and torch's ScheduleGPipe) runs."""
    _check(stages, micro_batches, rank)
    forwards = [("F", i) for i in range(micro_batches)]
    return forwards + [("B", i) for i in reversed(range(micro_batches))]


def gpipe_interleaved(stages, micro_batches, rank):
    # "forward then backward, micro-batch by micro-batch": no pipelining at all
    _check(stages, micro_batches, rank)
    return [action for i in range(micro_batches) for action in (("F", i), ("B", i))]


# Right answer written another way.


def one_f_one_b_by_counting(stages, micro_batches, rank):
    """Walk the slots: a forward while fewer than p - rank micro-batches are in flight."""
    _check(stages, micro_batches, rank)
    limit = stages - rank
    actions, forward, backward = [], 0, 0
    while backward < micro_batches:
        if forward < micro_batches and forward - backward < limit:
            actions.append(("F", forward))
            forward += 1
        else:
            actions.append(("B", backward))
            backward += 1
    return actions


# --------------------------------------------------------------------------- run_schedule


def _run(
    stage,
    actions,
    micro_batches,
    process_group=None,
    loss_fn=transformer_loss,
    *,
    divide=True,
    blocking=False,
    zero_each=False,
    requires_grad=True,
    free=True,
    global_peers=True,
    receive_async=False,
    shape_first=False,
    batched=False,
):
    rank = dist.get_rank(process_group)
    size = dist.get_world_size(process_group)
    group = process_group if process_group is not None else dist.group.WORLD

    def peer(r):
        return dist.get_global_rank(group, r) if global_peers else r

    previous = peer(rank - 1) if rank > 0 else None
    following = peer(rank + 1) if rank < size - 1 else None
    count = len(micro_batches)
    held, sends, peak, total = {}, [], 0, None

    def send(tensor, dst):
        if shape_first:  # the peer is told the shape before the tensor
            shape = torch.tensor(tensor.shape, dtype=torch.int64)
            sends.append(dist.isend(shape, dst=dst, group=process_group))
        if blocking:
            dist.send(tensor, dst=dst, group=process_group)
        elif batched:
            op = dist.P2POp(dist.isend, tensor, dst, process_group)
            sends.extend(dist.batch_isend_irecv([op]))
        else:
            sends.append(dist.isend(tensor, dst=dst, group=process_group))

    def recv(tensor, src):
        if shape_first:
            shape = torch.empty(tensor.dim(), dtype=torch.int64)
            dist.recv(shape, src=src, group=process_group)
            assert tuple(shape.tolist()) == tuple(tensor.shape)
        if receive_async:
            dist.irecv(tensor, src=src, group=process_group).wait()
        elif batched:
            op = dist.P2POp(dist.irecv, tensor, src, process_group)
            for work in dist.batch_isend_irecv([op]):
                work.wait()
        else:
            dist.recv(tensor, src=src, group=process_group)

    for kind, i in actions:
        tokens, targets = micro_batches[i]
        if kind == "F":
            if previous is None:
                inputs = tokens
            else:
                inputs = torch.empty(*tokens.shape, MODEL_DIM)
                recv(inputs, previous)
                if requires_grad:
                    inputs.requires_grad_()
            outputs = stage(inputs)
            if following is not None:
                send(outputs.detach(), following)
            held[i] = (inputs, outputs)
            peak = max(peak, len(held))
        else:
            inputs, outputs = held.pop(i) if free else held[i]
            if zero_each:
                stage.zero_grad()  # "a fresh gradient for each micro-batch"
            if following is None:
                loss = loss_fn(outputs, targets)
                if divide:
                    loss = loss / count
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            else:
                grad = torch.empty_like(outputs)
                recv(grad, following)
                outputs.backward(grad)
            if previous is not None:
                send(inputs.grad, previous)
    for work in sends:
        work.wait()
    return PipelineRun(None if total is None else total.item(), peak)


def loss_not_divided(stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss):
    return _run(stage, actions, micro_batches, process_group, loss_fn, divide=False)


def blocking_sends(stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss):
    return _run(stage, actions, micro_batches, process_group, loss_fn, blocking=True)


def zeroed_between_micro_batches(
    stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss
):
    return _run(stage, actions, micro_batches, process_group, loss_fn, zero_each=True)


def received_without_requires_grad(
    stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss
):
    return _run(stage, actions, micro_batches, process_group, loss_fn, requires_grad=False)


def activations_never_freed(
    stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss
):
    return _run(stage, actions, micro_batches, process_group, loss_fn, free=False)


def peers_as_group_ranks(
    stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss
):
    return _run(stage, actions, micro_batches, process_group, loss_fn, global_peers=False)


def sends_the_shape_first(
    stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss
):
    """A course's pipeline: every tensor preceded by a message with its shape. Right elsewhere
    (micro-batches of different shapes), but a message more per tensor, which this kata's
    stages, all knowing the shape, do without."""
    return _run(stage, actions, micro_batches, process_group, loss_fn, shape_first=True)


def returns_a_tuple(stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss):
    run = _run(stage, actions, micro_batches, process_group, loss_fn)
    return run.loss, run.peak_activations  # "the loss and the peak": not the PipelineRun asked


def ignores_the_loss_fn(stage, actions, micro_batches, process_group=None, loss_fn=None):
    """The argument taken and forgotten: the last stage computes transformer_loss as before."""
    return _run(stage, actions, micro_batches, process_group)


# Right answers written another way.


def receives_with_irecv(
    stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss
):
    """irecv and wait at once: a blocking receive written with the asynchronous call."""
    return _run(stage, actions, micro_batches, process_group, loss_fn, receive_async=True)


def messages_through_batch_isend_irecv(
    stage, actions, micro_batches, process_group=None, loss_fn=transformer_loss
):
    """Every send and recv posted through dist.batch_isend_irecv (as torch's schedules do)."""
    return _run(stage, actions, micro_batches, process_group, loss_fn, batched=True)


# --------------------------------------------------------------------------- simulate


def _simulate(schedules, *, forward_waits=True, own_span=False, gives_up=True):
    p = len(schedules)
    done, ticks, free, position = {}, [[] for _ in schedules], [0] * p, [0] * p
    while any(position[r] < len(schedules[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if position[r] == len(schedules[r]):
                continue
            kind, i = schedules[r][position[r]]
            if kind == "F":
                needs = [(r - 1, "F", i)] if r > 0 and forward_waits else []
            else:
                needs = [(r + 1, "B", i)] if r < p - 1 else [(r, "F", i)]
            if not all(n in done for n in needs):
                continue
            start = max([free[r]] + [done[n] for n in needs])
            ticks[r].append(start)
            done[(r, kind, i)] = free[r] = start + 1
            position[r] += 1
            moved = True
        if not moved and gives_up:
            raise ValueError("the schedules wait for each other for ever")
    length = max(free)
    if own_span:  # from the rank's first action to its last
        idle = [
            (free[r] - ticks[r][0] - len(schedules[r])) / (free[r] - ticks[r][0]) for r in range(p)
        ]
    else:
        idle = [(length - len(schedules[r])) / length for r in range(p)]
    return Timeline(ticks, length, idle)


def idle_over_its_own_span(schedules):
    return _simulate(schedules, own_span=True)


def forward_does_not_wait(schedules):
    return _simulate(schedules, forward_waits=False)


def returns_a_dict(schedules):
    timeline = _simulate(schedules)  # the right numbers, in a dict rather than a Timeline
    return {"ticks": timeline.ticks, "length": timeline.length, "idle": timeline.idle}


def waits_for_ever(schedules):
    return _simulate(schedules, gives_up=False)  # "some rank will move next time round"


# Right answer written another way.


def tick_by_tick(schedules):
    """Advance one tick at a time; at each, every rank whose input is there starts its next action.

    Every action takes one tick, so at each tick every rank is free again: a tick at which no
    rank can start means none ever will.
    """
    p = len(schedules)
    ends, ticks, position, tick = {}, [[] for _ in schedules], [0] * p, 0
    while any(position[r] < len(schedules[r]) for r in range(p)):
        started = []
        for r in range(p):
            if position[r] == len(schedules[r]):
                continue
            kind, i = schedules[r][position[r]]
            if kind == "F":
                need = (r - 1, "F", i) if r > 0 else None
            else:
                need = (r + 1, "B", i) if r < p - 1 else (r, "F", i)
            if need is None or ends.get(need, tick + 1) <= tick:
                started.append((r, kind, i))
        if not started:
            raise ValueError("no rank can start its next action: the schedules wait for ever")
        for r, kind, i in started:
            ticks[r].append(tick)
            ends[(r, kind, i)] = tick + 1
            position[r] += 1
        tick += 1
    return Timeline(ticks, tick, [(tick - len(s)) / tick for s in schedules])


_SPLIT = "test_split_stages_gives_each_rank_its_own_modules"
_GRADS = "test_pipeline_gradients_equal_one_process"
_SCHEDULES = "test_schedules_as_data"

MISTAKES = [
    Mistake(
        "drops_the_extra_blocks",
        replaces="split_stages",
        fails=[f"{_SPLIT}[3]"],
        says=["expected [0, 1]", "the extra ones (BLOCKS % stages) to the first stages"],
    ),
    Mistake(
        "extra_blocks_to_the_last_stages",
        replaces="split_stages",
        fails=[f"{_SPLIT}[3]"],
        says=["it holds the blocks [0], expected [0, 1]", "to the first stages"],
    ),
    Mistake(
        "copies_the_modules",
        replaces="split_stages",
        fails=[_SPLIT],
        says=["is not one of the model's parameters", "no copies"],
    ),
    Mistake(
        "no_check_of_the_stage_count",
        replaces="split_stages",
        fails=["test_split_stages_refuses_what_does_not_fit[5-0]"],
        says=["every stage needs at least one block"],
    ),
    Mistake(
        "numbered_from_zero",
        replaces="split_stages",
        fails=[f"{_SPLIT}[2]"],
        says=["keyed by their index in the model"],
    ),
    Mistake(
        "warm_up_one_too_many",
        replaces="one_f_one_b_actions",
        fails=[f"{_SCHEDULES}[1f1b]"],
        says=["warm-up runs", "p - 1 - r forwards", "one more holds an extra"],
    ),
    Mistake(
        "warm_up_one_too_few",
        replaces="one_f_one_b_actions",
        fails=[f"{_SCHEDULES}[1f1b]"],
        says=["warm-up runs", "p - 1 - r forwards", "one fewer leaves the pipeline idle"],
    ),
    Mistake(
        "backward_first_in_the_steady_state",
        replaces="one_f_one_b_actions",
        fails=[f"{_SCHEDULES}[1f1b]"],
        says=["alternate one forward and one backward (the forward first"],
    ),
    Mistake(
        "gpipe_backwards_last_first",
        replaces="gpipe_actions",
        fails=[f"{_SCHEDULES}[gpipe]"],
        says=["orders [0, 1, 2] and [2, 1, 0]", "right elsewhere", "ScheduleGPipe", "bit for bit"],
    ),
    Mistake(
        "gpipe_interleaved",
        replaces="gpipe_actions",
        fails=[f"{_SCHEDULES}[gpipe]"],
        says=["GPipe runs every forward, then every backward"],
    ),
    Mistake(
        "loss_not_divided",
        replaces="run_schedule",
        fails=[f"{_GRADS}[gpipe-p2-m4]", f"{_GRADS}[1f1b-p4-m6]"],
        says=["times one process's", "divided by the number of micro-batches"],
    ),
    Mistake(
        "blocking_sends",
        replaces="run_schedule",
        fails=[f"{_GRADS}[1f1b-p2-m4]"],
        says=["waited for each other for ever", "dist.isend"],
    ),
    Mistake(
        "zeroed_between_micro_batches",
        replaces="run_schedule",
        fails=[f"{_GRADS}[gpipe-p2-m4]"],
        says=["only the last micro-batch's", "zeroed between micro-batches"],
    ),
    Mistake(
        "received_without_requires_grad",
        replaces="run_schedule",
        fails=[f"{_GRADS}[gpipe-p2-m4]"],
        says=["the received activations have no gradient", "requires_grad_()"],
    ),
    Mistake(
        "activations_never_freed",
        replaces="run_schedule",
        fails=[
            "test_activations_held_at_once[1f1b-p2-m4]",
            "test_activations_held_at_once[1f1b-p4-m6]",
        ],
        says=["micro-batches' activations at once, expected at most", "once its backward has run"],
    ),
    Mistake(
        "peers_as_group_ranks",
        replaces="run_schedule",
        fails=["test_a_subgroup_runs_its_own_pipeline"],
        says=["global ranks of the group"],
    ),
    Mistake(
        "sends_the_shape_first",
        replaces="run_schedule",
        fails=[f"{_GRADS}[gpipe-p2-m4]"],
        says=["sent 8 messages", "This kata sends each tensor alone", "right elsewhere"],
    ),
    Mistake(
        "returns_a_tuple",
        replaces="run_schedule",
        fails=[f"{_GRADS}[gpipe-p2-m4]"],
        says=["run_schedule returned (", "return PipelineRun(loss, peak_activations)"],
    ),
    Mistake(
        "ignores_the_loss_fn",
        replaces="run_schedule",
        fails=["test_the_loss_fn_given_is_the_one_backpropagated"],
        says=["is that of transformer_loss, not of the loss_fn given"],
    ),
    Mistake(
        "returns_a_dict",
        replaces="simulate",
        fails=["test_simulate_places_each_action_on_the_clock"],
        says=["simulate(...) returned {", "return Timeline(ticks, length, idle)"],
    ),
    Mistake(
        "idle_over_its_own_span",
        replaces="simulate",
        fails=["test_bubble_matches_the_formula"],
        says=["over the whole run's length"],
    ),
    Mistake(
        "waits_for_ever",
        replaces="simulate",
        fails=["test_simulate_refuses_a_schedule_that_waits_for_ever"],
        says=["did not return within", "raise ValueError then"],
    ),
    Mistake(
        "forward_does_not_wait",
        replaces="simulate",
        fails=["test_simulate_places_each_action_on_the_clock"],
        says=["a forward of i on rank r after rank r - 1's forward of i"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("split_with_tensor_split", replaces="split_stages"),
    RightAnswer("one_f_one_b_by_counting", replaces="one_f_one_b_actions"),
    RightAnswer("receives_with_irecv", replaces="run_schedule"),
    RightAnswer("messages_through_batch_isend_irecv", replaces="run_schedule"),
    RightAnswer("tick_by_tick", replaces="simulate"),
]
