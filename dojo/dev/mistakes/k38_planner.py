"""k38's mistakes catalogue: real mistakes in planning a layout (the parameters a rank holds, what
ZeRO, precision, recomputation and a pipeline do to memory, the bytes of each group, time and
overlap, the plan's order and its refusals), and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import math
from fractions import Fraction

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k38_planner as reference

Memory, Plan, Timing = reference.Memory, reference.Plan, reference.Timing
BYTES, COLLECTIVES = reference.BYTES, reference.COLLECTIVES
# The reference's own functions, kept before any entry is swapped in: an entry that replaces
# one of them and calls it would call itself.
_parameters_per_rank = reference.parameters_per_rank
_memory_per_rank = reference.memory_per_rank
_step_traffic = reference.step_traffic
_step_time = reference.step_time
_wire_bytes = reference.wire_bytes


def _k38():
    """The reference module, with this entry swapped in (what every test and rank sees)."""
    from dojo.harness import impl

    return impl.load_kata("k38_planner")


# --------------------------------------------------------------------------- parameters_per_rank


def _parameters(model, tp, pp, *, split=7, whole=6, extra_first=True, output_bias=True,
                embedding_everywhere=False, vocab_split=False, check=True):  # fmt: skip
    """parameters_per_rank with the knobs a mistake turns."""
    if check:
        _parameters_per_rank(model, tp, pp)  # the reference's refusals
    h, vocab = model.dim, model.vocab
    layer = (12 * h * h + split * h) // tp + whole * h
    size, extra = divmod(model.layers, pp)
    stages = []
    for stage in range(pp):
        more = stage < extra if extra_first else stage >= pp - extra
        held = (size + more) * layer
        table = vocab * h // (tp if vocab_split else 1)
        if stage == 0 or embedding_everywhere:
            held += table
        if stage == pp - 1:
            held += 2 * h + table + (vocab if output_bias else 0)
        stages.append(held)
    return stages


def tp_splits_every_parameter(model, tp=1, pp=1):
    # the norms and the row-parallel biases divided too
    return _parameters(model, tp, pp, split=13, whole=0)


def extra_layers_on_the_last_stages(model, tp=1, pp=1):
    return _parameters(model, tp, pp, extra_first=False)


def output_without_its_bias(model, tp=1, pp=1):
    return _parameters(model, tp, pp, output_bias=False)


def embedding_on_every_stage(model, tp=1, pp=1):
    return _parameters(model, tp, pp, embedding_everywhere=True)


def vocabulary_split_by_tp(model, tp=1, pp=1):
    # k34's vocabulary split, which k20's and k25's blocks do not do
    return _parameters(model, tp, pp, vocab_split=True)


def tp_unchecked(model, tp=1, pp=1):
    if tp < 1 or pp > model.layers:
        raise ValueError(f"tp={tp}, pp={pp} do not fit")
    return _parameters(model, tp, pp, check=False)


def parameters_module_by_module(model, tp=1, pp=1):
    # right: every module's parameters listed, then added up
    _parameters_per_rank(model, tp, pp)
    h, vocab = model.dim, model.vocab
    split = {"query": h * h + h, "key": h * h + h, "value": h * h + h, "out": h * h,
             "up": 4 * h * h + 4 * h, "down": 4 * h * h}  # fmt: skip
    whole = {"attention_norm": 2 * h, "mlp_norm": 2 * h, "out.bias": h, "down.bias": h}
    layer = sum(split.values()) // tp + sum(whole.values())
    counts = [len(range(stage, model.layers, pp)) for stage in range(pp)]  # the same counts
    counts.sort(reverse=True)
    stages = [count * layer for count in counts]
    stages[0] += vocab * h
    stages[-1] += 2 * h + (h + 1) * vocab
    return stages


# --------------------------------------------------------------------------- memory_per_rank


def _memory(model, layout, *, grads_from=2, params_from=3, state_bytes=None, round_up=True,
            recompute_keeps=True, mask_split=False, in_flight=None, busiest=True,
            activation_bytes=None):  # fmt: skip
    """memory_per_rank with the knobs a mistake turns."""
    _memory_per_rank(model, layout)  # the reference's refusals
    k38 = _k38()
    weight, gradient, state, element = BYTES[layout.precision]
    state = state_bytes.get(layout.precision, state) if state_bytes else state
    element = activation_bytes or element
    dp, tp, pp, zero = layout.dp, layout.tp, layout.pp, layout.zero
    m = k38.micro_batches(model, dp)

    def sharded(n, from_stage):
        if zero < from_stage:
            return n
        return -(-n // dp) if round_up else n // dp

    b, s, h, a = model.micro_batch, model.sequence, model.dim, model.heads
    if layout.recompute:
        per_layer = element * b * s * h // tp if recompute_keeps else 0
    else:
        floats = 12 * b * s * h + a * b * s * s + 4 * b * s
        per_layer = (
            (element * floats + s * s) // tp if mask_split else element * floats // tp + s * s
        )
    memories = []
    for stage, (params, layers) in enumerate(
        zip(k38.parameters_per_rank(model, tp, pp), k38._layers_of_stages(model, pp))
    ):
        flight = min(pp - stage, m) if in_flight is None else in_flight(pp, stage, m)
        memories.append(
            Memory(
                weight * sharded(params, params_from),
                gradient * sharded(params, grads_from),
                state * sharded(params, 1),
                layers * flight * per_layer,
            )  # fmt: skip
        )
    return max(memories, key=lambda mem: mem.total) if busiest else memories[0]


def zero1_shards_the_gradients(model, layout):
    return _memory(model, layout, grads_from=1)


def zero2_keeps_the_gradients_whole(model, layout):
    return _memory(model, layout, grads_from=3)


def bf16_without_master_weights(model, layout):
    return _memory(model, layout, state_bytes={"bf16": 8})


def shards_rounded_down(model, layout):
    return _memory(model, layout, round_up=False)


def recomputation_keeps_nothing(model, layout):
    return _memory(model, layout, recompute_keeps=False)


def mask_divided_by_tp(model, layout):
    return _memory(model, layout, mask_split=True)


def bf16_activations_kept_in_fp32(model, layout):
    return _memory(model, layout, activation_bytes=4)


def one_micro_batch_in_flight(model, layout):
    return _memory(model, layout, in_flight=lambda pp, stage, m: 1)


def every_micro_batch_in_flight(model, layout):
    # GPipe's count, not 1F1B's
    return _memory(model, layout, in_flight=lambda pp, stage, m: m)


def first_stage_only(model, layout):
    return _memory(model, layout, busiest=False)


def memory_with_ceil(model, layout):
    # right: math.ceil of a true division (exact for any size a GPU holds)
    _memory_per_rank(model, layout)
    k38 = _k38()
    weight, gradient, state, element = BYTES[layout.precision]
    dp, m = layout.dp, k38.micro_batches(model, layout.dp)
    b, s, h, a = model.micro_batch, model.sequence, model.dim, model.heads
    keep = [b * s * h * element // layout.tp, 0]
    if not layout.recompute:
        keep = [element * (12 * b * s * h + a * b * s * s + 4 * b * s) // layout.tp, s * s]
    stages = [
        Memory(
            weight * (math.ceil(n / dp) if layout.zero == 3 else n),
            gradient * (math.ceil(n / dp) if layout.zero >= 2 else n),
            state * (math.ceil(n / dp) if layout.zero >= 1 else n),
            sum(keep) * layers * min(layout.pp - i, m),
        )
        for i, (n, layers) in enumerate(
            zip(
                k38.parameters_per_rank(model, layout.tp, layout.pp),
                k38._layers_of_stages(model, layout.pp),
            )  # fmt: skip
        )
    ]
    return sorted(stages, key=lambda mem: -mem.total)[0]  # sorted is stable: the first of equals


# --------------------------------------------------------------------------- wire_bytes


def all_reduce_sends_once(collective, payload, ranks):
    if collective == "all_reduce":
        return (ranks - 1) * payload // ranks
    return _wire_bytes(collective, payload, ranks)


def wire_bytes_unchecked(collective, payload, ranks):
    factors = {"all_reduce": 2 * (ranks - 1), "all_gather": ranks - 1, "reduce_scatter": ranks - 1}
    return payload if collective not in factors else factors[collective] * payload // ranks


def wire_bytes_as_fractions(collective, payload, ranks):
    # right: exact fractions, rounded down at the end
    _wire_bytes(collective, payload, ranks)  # the reference's refusals
    factor = {"all_reduce": Fraction(2 * (ranks - 1), ranks), "send": Fraction(1)}.get(
        collective, Fraction(ranks - 1, ranks)
    )
    return math.floor(factor * payload)


# --------------------------------------------------------------------------- step_traffic


def _traffic(model, layout, stage, *, zero3_gathers=(2, 1), tp_kinds="k25", both_ways=False,
             dp_per_micro_batch=False, element=None):  # fmt: skip
    """step_traffic with the knobs a mistake turns."""
    _step_traffic(model, layout, stage)  # the reference's refusals
    k38 = _k38()
    size = BYTES[layout.precision][3] if element is None else element
    params = k38.parameters_per_rank(model, layout.tp, layout.pp)[stage]
    layers = k38._layers_of_stages(model, layout.pp)[stage]
    m, h = k38.micro_batches(model, layout.dp), model.dim
    activation = model.micro_batch * model.sequence * h * size
    traffic = {}
    if layout.dp > 1:
        times = m if dp_per_micro_batch else 1
        if layout.zero == 0:
            traffic["dp"] = {"all_reduce": times * params * size}
        elif layout.zero < 3:
            traffic["dp"] = {"reduce_scatter": params * size, "all_gather": params * size}
        else:
            blocks = layers * ((12 * h * h + 7 * h) // layout.tp + 6 * h)
            gathered = zero3_gathers[0] * blocks + zero3_gathers[1] * (params - blocks)
            traffic["dp"] = {"all_gather": m * gathered * size, "reduce_scatter": m * params * size}
    if layout.tp > 1:
        if tp_kinds == "k25":
            traffic["tp"] = {"all_gather": 6 * layers * m * activation,
                             "reduce_scatter": 4 * layers * m * activation,
                             "all_reduce": 6 * h * layers * size}  # fmt: skip
        else:  # k20's block: 4 all-reduces a layer
            traffic["tp"] = {"all_reduce": 4 * layers * m * activation}
    if layout.pp > 1:
        ways = 2 if both_ways else (stage < layout.pp - 1) + (stage > 0)
        traffic["pp"] = {"send": ways * m * activation}
    return traffic


def zero3_gathers_once(model, layout, stage=0):
    return _traffic(model, layout, stage, zero3_gathers=(1, 1))


def zero3_gathers_the_root_twice(model, layout, stage=0):
    return _traffic(model, layout, stage, zero3_gathers=(2, 2))


def tp_all_reduces_like_k20(model, layout, stage=0):
    return _traffic(model, layout, stage, tp_kinds="k20")


def pp_sends_both_ways_on_every_stage(model, layout, stage=0):
    return _traffic(model, layout, stage, both_ways=True)


def ddp_all_reduces_every_micro_batch(model, layout, stage=0):
    return _traffic(model, layout, stage, dp_per_micro_batch=True)


def traffic_always_fp32(model, layout, stage=0):
    return _traffic(model, layout, stage, element=4)


# --------------------------------------------------------------------------- step_time


def _time(model, layout, hardware, *, overlap=True, recompute_flops=8, bubble=True,
          mfu_of_effective=False, tokens_per_rank=False):  # fmt: skip
    """step_time with the knobs a mistake turns."""
    _step_time(model, layout, hardware)  # the reference's refusals
    k38 = _k38()
    world = layout.dp * layout.tp * layout.pp
    whole = sum(k38.parameters_per_rank(model))
    tokens = model.batch * model.sequence // (layout.dp if tokens_per_rank else 1)
    flops = (recompute_flops if layout.recompute else 6) * whole * tokens
    stretch = 1 + (layout.pp - 1) / k38.micro_batches(model, layout.dp) if bubble else 1
    compute = flops / (world * hardware.flops * hardware.mfu) * stretch
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    comm = {}
    for stage in range(layout.pp):
        for group, payloads in k38.step_traffic(model, layout, stage).items():
            sent = sum(k38.wire_bytes(k, p, sizes[group]) for k, p in payloads.items())
            comm[group] = max(comm.get(group, 0.0), sent / hardware.bandwidth[group])
    dp, tp, pp = (comm.get(g, 0.0) for g in ("dp", "tp", "pp"))
    step = (max(compute, dp) if overlap else compute + dp) + tp + pp
    peak = hardware.flops * (hardware.mfu if mfu_of_effective else 1)
    return Timing(compute, comm, step, 6 * whole * tokens / (step * world * peak))


def dp_not_overlapped(model, layout, hardware):
    return _time(model, layout, hardware, overlap=False)


def recomputation_costs_nothing(model, layout, hardware):
    return _time(model, layout, hardware, recompute_flops=6)


def no_pipeline_bubble(model, layout, hardware):
    return _time(model, layout, hardware, bubble=False)


def mfu_of_the_reachable_rate(model, layout, hardware):
    return _time(model, layout, hardware, mfu_of_effective=True)


def tokens_of_one_rank(model, layout, hardware):
    return _time(model, layout, hardware, tokens_per_rank=True)


# --------------------------------------------------------------------------- plan


def _plan(model, world, hardware, budget=None, layouts=None, *, check_world=True,
          fits=lambda need, budget: need <= budget, order=None, refuse=True):  # fmt: skip
    """plan with the knobs a mistake turns."""
    k38 = _k38()
    budget = hardware.memory if budget is None else budget
    candidates = k38.every_layout(model, world) if layouts is None else list(layouts)
    for layout in candidates:
        if check_world and layout.dp * layout.tp * layout.pp != world:
            raise ValueError(
                f"layout {layout}: {layout.dp * layout.tp * layout.pp} GPUs, not {world}"
            )
    plans = [
        Plan(layout, k38.memory_per_rank(model, layout), k38.step_time(model, layout, hardware))
        for layout in candidates
    ]
    fitting = [(i, p) for i, p in enumerate(plans) if fits(p.memory.total, budget)]
    if not fitting and refuse:
        least = min(p.memory.total for p in plans)
        raise ValueError(f"no layout fits {budget} bytes; the least any needs is {least}")
    key = order or (lambda ip: (ip[1].timing.step, ip[1].memory.total, ip[0]))
    return [p for _, p in sorted(fitting, key=key)]


def slowest_first(model, world, hardware, budget=None, layouts=None):
    return _plan(model, world, hardware, budget, layouts,
                 order=lambda ip: (-ip[1].timing.step, ip[1].memory.total, ip[0]))  # fmt: skip


def budget_excluded(model, world, hardware, budget=None, layouts=None):
    return _plan(model, world, hardware, budget, layouts, fits=lambda need, budget: need < budget)


def ties_by_name(model, world, hardware, budget=None, layouts=None):
    return _plan(model, world, hardware, budget, layouts,
                 order=lambda ip: (ip[1].timing.step, ip[1].memory.total, str(ip[1].layout)))  # fmt: skip


def nothing_fits_returns_empty(model, world, hardware, budget=None, layouts=None):
    return _plan(model, world, hardware, budget, layouts, refuse=False)


def world_unchecked(model, world, hardware, budget=None, layouts=None):
    return _plan(model, world, hardware, budget, layouts, check_world=False)


def plan_by_stable_sort(model, world, hardware, budget=None, layouts=None):
    # right: Python's sort is stable, so the order given survives without an index
    k38 = _k38()
    budget = hardware.memory if budget is None else budget
    candidates = k38.every_layout(model, world) if layouts is None else list(layouts)
    wrong = [x for x in candidates if x.dp * x.tp * x.pp != world]
    if wrong:
        raise ValueError(
            f"{wrong[0]} uses {wrong[0].dp * wrong[0].tp * wrong[0].pp} GPUs, not the {world} "
            "of the world: make dp x tp x pp the world's size"
        )
    plans = [Plan(x, k38.memory_per_rank(model, x), k38.step_time(model, x, hardware))
             for x in candidates]  # fmt: skip
    fitting = [p for p in plans if p.memory.total <= budget]
    if not fitting:
        least = min(p.memory.total for p in plans)
        raise ValueError(f"nothing fits {budget} bytes: the smallest layout needs {least}")
    return sorted(fitting, key=lambda p: (p.timing.step, p.memory.total))


_REFERENCES = "test_parameters_are_what_the_references_hold"
_BY_HAND = "test_parameters_by_layer_and_stage"
_ACTIVATIONS = "test_activations_are_what_autograd_saves"
_IN_FLIGHT = "test_a_pipeline_stage_keeps_what_k21_holds_in_flight"
_PRECISION = "test_memory_by_precision_and_zero_stage"
_BY_LAYOUT = "test_activations_by_layout"
_TRAFFIC = "test_traffic_is_what_the_references_send"
_ARITHMETIC = "test_traffic_by_arithmetic"
_COMPUTE = "test_compute_time_is_6n_per_token_at_the_mfu"
_OVERLAP = "test_step_time_overlaps_dp_and_waits_for_tp_and_pp"
_PLAN = "test_plan_keeps_every_layout_that_fits_fastest_first"
_TIES = "test_plan_breaks_ties_by_the_order_given_and_keeps_the_budgets_edge"
_REFUSES = "test_plan_refuses_a_layout_of_another_world_and_a_budget_nothing_fits"

MISTAKES = [
    Mistake("tp_splits_every_parameter", replaces="parameters_per_rank", fails=[_REFERENCES],
            says=["k25's tensor-parallel block holds 1688", "stay whole on every rank"]),
    Mistake("extra_layers_on_the_last_stages", replaces="parameters_per_rank",
            fails=[_REFERENCES], says=["stage 0 holds 7072", "Stage 0 gets the extra block"]),
    Mistake("output_without_its_bias", replaces="parameters_per_rank", fails=[_REFERENCES],
            says=["the model has 7648 parameters"]),
    Mistake("embedding_on_every_stage", replaces="parameters_per_rank", fails=[_REFERENCES],
            says=["stage 1 3856", "the embedding"]),
    Mistake("vocabulary_split_by_tp", replaces="parameters_per_rank", fails=[f"{_BY_HAND}[2-1]"],
            says=["tp=2, pp=1", "counted parameter by parameter"]),
    Mistake("tp_unchecked", replaces="parameters_per_rank",
            fails=["test_parameters_refuse_what_does_not_fit"],
            says=["a tp must divide the 4 heads", "raise ValueError"]),
    Mistake("zero1_shards_the_gradients", replaces="memory_per_rank", fails=[_PRECISION],
            says=["ZeRO-1 shards only the optimizer state"]),
    Mistake("zero2_keeps_the_gradients_whole", replaces="memory_per_rank", fails=[_PRECISION],
            says=["ZeRO-2 shards the gradients too"]),
    Mistake("bf16_without_master_weights", replaces="memory_per_rank", fails=[_PRECISION],
            says=["12 of optimizer state (fp32 master and moments)"]),
    Mistake("shards_rounded_down", replaces="memory_per_rank", fails=[_PRECISION],
            says=["rounded up"]),
    Mistake("recomputation_keeps_nothing", replaces="memory_per_rank", fails=[_ACTIVATIONS],
            says=["a checkpointed Block keeps", "recomputed, the input only"]),
    Mistake("mask_divided_by_tp", replaces="memory_per_rank", fails=[_ACTIVATIONS],
            says=["k25's sequence-parallel Block keeps", "+ s^2 (the mask, whole)"]),
    Mistake("bf16_activations_kept_in_fp32", replaces="memory_per_rank", fails=[_BY_LAYOUT],
            says=["bf16 activations are 2 bytes a float"]),
    Mistake("one_micro_batch_in_flight", replaces="memory_per_rank", fails=[_IN_FLIGHT],
            says=["held 2 of them at once", "keeps min(pp - i, m) micro-batches"]),
    Mistake("every_micro_batch_in_flight", replaces="memory_per_rank", fails=[_IN_FLIGHT],
            says=["held 2 of them at once", "keeps min(pp - i, m) micro-batches"]),
    Mistake("first_stage_only", replaces="memory_per_rank",
            fails=["test_memory_is_the_busiest_stage"],
            says=["report the stage whose total is largest"]),
    Mistake("all_reduce_sends_once", replaces="wire_bytes",
            fails=["test_wire_bytes_follow_the_ring"], says=["wire_bytes('all_reduce'", "a ring sends 1 x"]),
    Mistake("wire_bytes_unchecked", replaces="wire_bytes",
            fails=["test_wire_bytes_follow_the_ring"], says=["wire_bytes('gossip', 10, 2)"]),
    Mistake("zero3_gathers_once", replaces="step_traffic", fails=[f"{_TRAFFIC}[zero3]"],
            says=["k19's FullyShardedModule", "gathered forward and again backward, the root once"]),
    Mistake("zero3_gathers_the_root_twice", replaces="step_traffic", fails=[f"{_TRAFFIC}[zero3]"],
            says=["k19's FullyShardedModule", "the root once"]),
    Mistake("tp_all_reduces_like_k20", replaces="step_traffic", fails=[f"{_TRAFFIC}[tp]"],
            says=["k25's block", "6 all-gathers and 4 reduce-scatters"]),
    Mistake("pp_sends_both_ways_on_every_stage", replaces="step_traffic",
            fails=[f"{_TRAFFIC}[pp]"],
            says=["k21's 1F1B step", "their gradients back from every stage but the first"]),
    Mistake("ddp_all_reduces_every_micro_batch", replaces="step_traffic", fails=[_ARITHMETIC],
            says=["DDP all-reduces every gradient once a step"]),
    Mistake("traffic_always_fp32", replaces="step_traffic", fails=[f"{_TRAFFIC}[fully_shard_bf16]"],
            says=["torch's fully_shard gathering and reducing in bf16", "2 bytes"]),
    Mistake("dp_not_overlapped", replaces="step_time", fails=[_OVERLAP],
            says=["max(compute, dp) + tp + pp"]),
    Mistake("recomputation_costs_nothing", replaces="step_time", fails=[_COMPUTE],
            says=["recomputing runs forward twice: 8 N"]),
    Mistake("no_pipeline_bubble", replaces="step_time", fails=[_COMPUTE],
            says=["a pipeline of 2, 4 micro-batches: 1 + 1/4"]),
    Mistake("mfu_of_the_reachable_rate", replaces="step_time", fails=[_OVERLAP],
            says=["the peak, not peak x MFU"]),
    Mistake("tokens_of_one_rank", replaces="step_time", fails=[_COMPUTE],
            says=["6 N FLOPs per token of the whole batch"]),
    Mistake("slowest_first", replaces="plan", fails=[_PLAN], says=["fastest first"]),
    Mistake("budget_excluded", replaces="plan", fails=[_PLAN], says=["it left out"]),
    Mistake("ties_by_name", replaces="plan", fails=[_TIES],
            says=["equal ones in the order they came in"]),
    Mistake("nothing_fits_returns_empty", replaces="plan", fails=[_REFUSES],
            says=["nothing fits, so say so"]),
    Mistake("world_unchecked", replaces="plan", fails=[_REFUSES],
            says=["a layout of 4 GPUs does not run on 8"]),
]  # fmt: skip

RIGHT_ANSWERS = [
    RightAnswer("parameters_module_by_module", replaces="parameters_per_rank"),
    RightAnswer("memory_with_ceil", replaces="memory_per_rank"),
    RightAnswer("wire_bytes_as_fractions", replaces="wire_bytes"),
    RightAnswer("plan_by_stable_sort", replaces="plan"),
]
