"""k38 the planner: the memory, bytes and time of every layout from the model's shape, held to
the byte against what the references of k18 (ZeRO-1), k19 (FSDP), k21 (pipeline stages) and
k25 (tensor and sequence parallelism), and torch's fully_shard, hold and send on TinyTransformer,
measured on 2 ranks; the rest by arithmetic; the plan's order, its budget and its refusals."""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from dojo.harness.calls import recording
from dojo.harness.impl import current
from dojo.harness.world import run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import check_refuses_naming, run_module_ok
from dojo.toy_models import (
    BLOCKS,
    HEADS,
    MODEL_DIM,
    SEQUENCE,
    VOCABULARY,
    Block,
    TinyTransformer,
    make_tokens,
    make_transformer,
    transformer_loss,
)

KATA = "k38_planner"
SEED, WORLD, PER_RANK = 3, 2, 2  # the measured world: 2 ranks, 2 sequences each
PIPELINED = 4  # micro-batches through k21's 1F1B pipeline of 2 stages
# k36 (HSDP / ZeRO-2) joins as one more row of MEASURED_MEMORY and MEASURED_TRAFFIC below.


def _model(kata, layers: int = BLOCKS, **changes):
    """TinyTransformer's shape as the planner's Model: one micro-batch of PER_RANK sequences
    per rank of the measured world."""
    shape = dict(layers=layers, dim=MODEL_DIM, heads=HEADS, vocab=VOCABULARY, sequence=SEQUENCE,
                 batch=WORLD * PER_RANK, micro_batch=PER_RANK)  # fmt: skip
    return kata.Model(**{**shape, **changes})


# --------------------------------------------------------------------------- the measurements


def _reference(name: str):
    """An earlier kata's reference: the planner is held against what the references hold and
    send (a learner's own k19 may be unwritten yet, or hold its shards another correct way)."""
    return importlib.import_module(f"solutions.{name}")


def _payloads(calls) -> dict[str, int]:
    """Recorded calls as the planner counts them: per kind, the bytes of the whole buffer (an
    all-gather's output, a reduce-scatter's input, an all-reduce's or a broadcast's tensor)."""
    kinds = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce", "broadcast": "all_gather", "isend": "send"}  # fmt: skip
    found: dict[str, int] = {}
    for call in calls:
        if call.name in ("recv", "irecv"):  # what a rank sends is counted once, by its sender
            continue
        size = getattr(torch, call.dtypes[0]).itemsize
        whole = max(math.prod(shape) for shape in call.shapes) * size
        kind = kinds.get(call.name, call.name)
        found[kind] = found.get(kind, 0) + whole
    return found


def _bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor: its local shard)."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


def _moments(optimizer) -> int:
    """The bytes of Adam's two moments (its step counters aside)."""
    return _bytes(s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))


def _saved(run, module) -> int:
    """The bytes of the distinct storages autograd saves while ``run()`` runs, ``module``'s
    parameters aside (k25's and k32's measure)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(saved.values())


def _fully_sharded(device: torch.device, rank: int, param_dtype=None) -> dict:
    """What torch's fully_shard (every block and the root, gathering and reducing in
    ``param_dtype``; None: fp32) holds on this rank after one AdamW step, and what it sent."""
    model = make_transformer(SEED).to(device)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for piece in (*model.blocks, model):
        fully_shard(piece, mp_policy=policy)
    adam = torch.optim.AdamW(model.parameters())
    tokens, targets = (t.to(device) for t in make_tokens(PER_RANK, SEED + rank))
    with recording() as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's note that the model's output is a view
        transformer_loss(model(tokens).float(), targets).backward()
    adam.step()
    return {"parameters": _bytes(model.parameters()),
            "gradients": _bytes(p.grad for p in model.parameters()),
            "optimizer": _moments(adam), "traffic": _payloads(calls)}  # fmt: skip


def _measure(rank: int, world_size: int) -> dict:
    """What the references hold and send on this rank: parameters, gradients and AdamW's
    moments (bytes), activations saved (bytes), collectives' payloads (bytes)."""
    tokens, targets = make_tokens(PER_RANK, SEED + rank)
    found: dict = {}

    plain = make_transformer(SEED)  # zero 0: everything whole
    adam = torch.optim.AdamW(plain.parameters())
    transformer_loss(plain(tokens), targets).backward()
    adam.step()
    found["zero0"] = {"parameters": _bytes(plain.parameters()),
                      "gradients": _bytes(p.grad for p in plain.parameters()),
                      "optimizer": _moments(adam)}  # fmt: skip

    k19 = _reference("k19_fsdp")  # zero 3: every block a unit, the root one
    sharded = k19.FullyShardedModule(make_transformer(SEED), shard_types=(Block, TinyTransformer))
    adam = torch.optim.AdamW(sharded.parameters())
    with recording() as calls:
        transformer_loss(sharded(tokens), targets).backward()
        sharded.finish_gradient_synchronization()
    adam.step()
    found["zero3"] = {"parameters": _bytes(sharded.parameters()),
                      "gradients": _bytes(p.grad for p in sharded.parameters()),
                      "optimizer": _moments(adam), "traffic": _payloads(calls)}  # fmt: skip

    found["fully_shard"] = _fully_sharded(torch.device("cpu"), rank)  # zero 3, torch's own
    found["fully_shard_bf16"] = _fully_sharded(torch.device("cpu"), rank, torch.bfloat16)

    k18 = _reference("k18_zero")  # zero 1: AdamW's state on each parameter's owner
    model = make_transformer(SEED)
    zero1 = k18.ShardedOptimizer(model.parameters(), torch.optim.AdamW)
    transformer_loss(model(tokens), targets).backward()
    with recording() as calls:
        zero1.step()
    found["zero1"] = {"optimizer": _moments(zero1.inner), "traffic": _payloads(calls)}

    k21 = _reference("k21_pipeline")  # pp: 3 blocks over 2 stages
    stage = k21.split_stages(make_transformer(SEED, blocks=3), world_size, rank)
    found["stage"] = sum(p.numel() for p in stage.parameters())
    stage = k21.split_stages(make_transformer(SEED), world_size, rank)  # 1F1B, 4 micro-batches
    tokens, targets = make_tokens(PER_RANK * PIPELINED, SEED)
    batches = list(zip(tokens.chunk(PIPELINED), targets.chunk(PIPELINED)))
    with recording() as calls:
        run = k21.run_schedule(stage, k21.one_f_one_b_actions(world_size, PIPELINED, rank), batches)
    found["pp"] = {"traffic": _payloads(calls), "in flight": run.peak_activations}

    block = make_transformer(SEED).blocks[0]  # activations: one block, plain and checkpointed
    x = torch.randn(PER_RANK, SEQUENCE, MODEL_DIM, generator=torch.Generator().manual_seed(SEED))
    found["saved"] = _saved(lambda: block(x.clone().requires_grad_()), block)
    found["saved recomputed"] = _saved(
        lambda: checkpoint(block, x.clone().requires_grad_(), use_reentrant=False), block
    )

    k25 = _reference("k25_sequence_parallel")  # tp = 2 with the sequence split
    split = k25.SequenceParallelBlock(block, None)
    mine = k25.sequence_shard(x, None).requires_grad_()
    with recording() as calls:
        out: list = []
        found["saved tp"] = _saved(lambda: out.append(split(mine)), split)
        out[0].square().sum().backward()
        k25.sync_sequence_parallel_grads(split, None)
    found["tp"] = {"parameters": sum(p.numel() for p in split.parameters()),
                   "traffic": _payloads(calls)}  # fmt: skip
    return found


_measured: dict = {}


def _measurements() -> list[dict]:
    """Every rank's measurements, taken once per implementation: they run the references and
    torch only, none of the planner's code (so no catalogue entry changes them)."""
    if current() not in _measured:
        _measured[current()] = run_world(_measure, WORLD, deadline=60)
    return _measured[current()]


def _rank_differs(what: str, measured: dict[int, int], planned, hint: str) -> str | None:
    """The first rank whose measure is not the planner's, said for a learner; None if none."""
    for rank, value in measured.items():
        if value != planned:
            return (
                f"rank {rank} of {WORLD} measured {value} {what}; the planner says {planned}. "
                f"{hint}"
            )
    return None


# --------------------------------------------------------------------------- step 1: parameters


@pytest.mark.step(1)
def test_parameters_are_what_the_references_hold(kata):
    whole = kata.parameters_per_rank(_model(kata))
    three = kata.parameters_per_rank(_model(kata, layers=3), 1, 2)
    one_tp = kata.parameters_per_rank(_model(kata, layers=1), 2)
    two_tp = kata.parameters_per_rank(_model(kata, layers=2), 2)
    measured = _measurements()
    numel = sum(p.numel() for p in make_transformer(SEED).parameters())
    assert whole == [numel], (
        f"parameters_per_rank(TinyTransformer's Model) returned {whole}; the model has {numel} "
        "parameters (one stage, no tensor parallelism: [every parameter])"
    )
    stages = [r["stage"] for r in measured]
    assert three == stages, (
        f"k21's split_stages cuts 3 blocks over 2 stages so that stage 0 holds {stages[0]} "
        f"parameters and stage 1 {stages[1]}; parameters_per_rank(.., tp=1, pp=2) returned "
        f"{three}. Stage 0 gets the extra block and the embedding, the last the norm and output"
    )
    block = [r["tp"]["parameters"] for r in measured]
    one_layer = two_tp[0] - one_tp[0] if len(two_tp) == len(one_tp) == 1 else None
    assert one_layer == block[0], (
        f"k25's tensor-parallel block holds {block[0]} parameters on each of 2 ranks; the "
        f"planner's layer at tp=2 (2 layers' {two_tp} minus 1 layer's {one_tp}) is {one_layer}. "
        "The norms and the row-parallel layers' biases (6 h) stay whole on every rank"
    )


def _split_by_hand(layers: int, dim: int, heads: int, vocab: int, tp: int, pp: int) -> list[int]:
    """Each stage's parameters, counted on a TinyTransformer built on the meta device: the
    column-parallel layers' weights and biases and the row-parallel ones' weights over tp."""
    with torch.device("meta"):
        model = TinyTransformer(layers, dim, vocab)
    split = ("query.", "key.", "value.", "up.", "out.weight", "down.weight")
    size, extra = divmod(layers, pp)
    starts = [stage * size + min(stage, extra) for stage in range(pp + 1)]
    held = [0] * pp
    for name, param in model.named_parameters():
        if name.startswith("blocks."):
            index = int(name.split(".")[1])
            stage = max(s for s in range(pp) if starts[s] <= index)
        else:
            stage = 0 if name.startswith("embedding") else pp - 1
        divided = any(part in name for part in split) and name.startswith("blocks.")
        held[stage] += param.numel() // tp if divided else param.numel()
    return held


@pytest.mark.step(1)
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (4, 3), (8, 2), (1, 4), (2, 5)])
def test_parameters_by_layer_and_stage(kata, tp, pp):
    layers, dim, heads, vocab = 5, 32, 8, 41
    model = _model(kata, layers=layers, dim=dim, heads=heads, vocab=vocab)
    got = kata.parameters_per_rank(model, tp, pp)
    expected = _split_by_hand(layers, dim, heads, vocab, tp, pp)
    assert got == expected, (
        f"parameters_per_rank(5 layers, dim 32, 8 heads, vocab 41, tp={tp}, pp={pp}) returned "
        f"{got}; counted parameter by parameter, the stages hold {expected}"
        + (". Stages get 5 // pp layers, the first 5 % pp stages one more" if pp > 1 else "")
    )


@pytest.mark.step(1)
def test_parameters_refuse_what_does_not_fit(kata):
    model = _model(kata, layers=4)
    for tp, pp, wrong, why in (
        (3, 1, "3", "a tp must divide the 4 heads"),
        (1, 5, "5", "a pipeline of 4 layers has at most 4 stages"),
        (0, 1, "0", "tp must be a positive int"),
    ):
        check_refuses_naming(
            lambda tp=tp, pp=pp: kata.parameters_per_rank(model, tp, pp),
            f"parameters_per_rank(4 layers, 4 heads, tp={tp}, pp={pp})",
            wrong,
            why,
            lambda got, why=why: f"returned {got!r}: {why}, so raise ValueError saying so",
        )


# --------------------------------------------------------------------------- step 2: memory


# A layout measured on the world, and what each of its ranks holds (k36's ZeRO-2: one more row)
MEASURED_MEMORY = [
    ("zero0", dict(dp=2, zero=0), "plain AdamW: everything whole on every rank"),
    ("zero1", dict(dp=2, zero=1), "k18's ShardedOptimizer: AdamW's moments on the owner only"),
    ("zero3", dict(dp=2, zero=3), "k19's FullyShardedModule: every block and the root sharded"),
    ("fully_shard", dict(dp=2, zero=3), "torch's fully_shard on every block and the root"),
]


@pytest.mark.step(2)
@pytest.mark.parametrize("name, layout, what", MEASURED_MEMORY, ids=[m[0] for m in MEASURED_MEMORY])
def test_memory_is_what_the_references_hold(kata, name, layout, what):
    planned = kata.memory_per_rank(_model(kata), kata.Layout(**layout))
    measured = [r[name] for r in _measurements()]
    for kind in ("parameters", "gradients", "optimizer"):
        if kind not in measured[0]:
            continue
        failure = _rank_differs(
            f"bytes of {kind} under {what}",
            {rank: found[kind] for rank, found in enumerate(measured)},
            getattr(planned, kind),
            f"memory_per_rank(TinyTransformer, Layout(dp=2, zero={layout['zero']})).{kind}: fp32 "
            "is 4 bytes a weight, 4 a gradient, 8 of Adam's moments; ZeRO stage 1 shards the "
            "optimizer, 2 the gradients too, 3 the parameters too",
        )
        assert failure is None, failure


@pytest.mark.step(2)
def test_activations_are_what_autograd_saves(kata):
    one = _model(kata, layers=1, batch=PER_RANK)
    cases = [
        ("saved", kata.Layout(), "a Block keeps for backward (fp32)"),
        ("saved recomputed", kata.Layout(recompute=True), "a checkpointed Block keeps"),
        ("saved tp", kata.Layout(tp=2), "k25's sequence-parallel Block keeps on each of 2 ranks"),
    ]
    planned = {name: kata.memory_per_rank(one, layout).activations for name, layout, _ in cases}
    measured = _measurements()
    for name, layout, what in cases:
        failure = _rank_differs(
            f"bytes that {what} ({PER_RANK} x {SEQUENCE} tokens, dim {MODEL_DIM}, {HEADS} heads)",
            {rank: found[name] for rank, found in enumerate(measured)},
            planned[name],
            f"memory_per_rank(1 layer, {layout}).activations: e (12 b s h + a b s^2 + 4 b s) "
            "+ s^2 (the mask, whole); recomputed, the input only; tp divides the floats",
        )
        assert failure is None, failure


@pytest.mark.step(2)
def test_a_pipeline_stage_keeps_what_k21_holds_in_flight(kata):
    one = kata.memory_per_rank(_model(kata, layers=1, batch=PER_RANK), kata.Layout())
    piped = _model(kata, batch=PER_RANK * PIPELINED)
    got = kata.memory_per_rank(piped, kata.Layout(pp=2))
    held = _measurements()[0]["pp"]["in flight"]
    expected = held * one.activations  # stage 0: its one layer, `held` micro-batches at once
    assert got.activations == expected, (
        f"k21's 1F1B pipeline of 2 stages, {PIPELINED} micro-batches, held {held} of them at once "
        f"on stage 0 (its forward run, its backward not yet), {held} x {one.activations} bytes of "
        f"its layer's activations; memory_per_rank(2 layers, {PIPELINED} micro-batches, pp=2) "
        f"keeps {got.activations}. A 1F1B stage i keeps min(pp - i, m) micro-batches"
    )


def _memory(kata, layout, **model):
    got = kata.memory_per_rank(_model(kata, **model), layout)
    changed = "".join(f", {k}={v}" for k, v in model.items())
    return got, f"memory_per_rank(TinyTransformer's Model{changed}, {layout})"


@pytest.mark.step(2)
def test_memory_by_precision_and_zero_stage(kata):
    n = kata.parameters_per_rank(_model(kata, vocab=33))[0]  # odd: ZeRO's shards round up
    half = -(-n // 2)
    for layout, expected, rule in (
        (kata.Layout(precision="bf16"), (2 * n, 2 * n, 12 * n),
         "bf16: 2 bytes a weight and a gradient, 12 of optimizer state (fp32 master and moments)"),
        (kata.Layout(dp=2, zero=1), (4 * n, 4 * n, 8 * half),
         "ZeRO-1 shards only the optimizer state, rounded up (a shard is padded)"),
        (kata.Layout(dp=2, zero=2), (4 * n, 4 * half, 8 * half),
         "ZeRO-2 shards the gradients too, not the parameters"),
        (kata.Layout(dp=2, zero=3, precision="bf16"), (2 * half, 2 * half, 12 * half),
         "ZeRO-3 shards all three, rounded up"),
    ):  # fmt: skip
        got, call = _memory(kata, layout, vocab=33)
        held = (got.parameters, got.gradients, got.optimizer)
        assert held == expected, (
            f"{call} holds (parameters, gradients, optimizer) = {held} bytes for {n} parameters; "
            f"expected {expected}: {rule}"
        )


@pytest.mark.step(2)
def test_activations_by_layout(kata):
    b, s, h, a = PER_RANK, SEQUENCE, MODEL_DIM, HEADS
    floats = 12 * b * s * h + a * b * s * s + 4 * b * s
    for layout, model, expected, rule in (
        (kata.Layout(precision="bf16"), {"batch": b}, 2 * (2 * floats + s * s),
         "bf16 activations are 2 bytes a float, the mask still a byte a pair; 2 layers"),
        (kata.Layout(), {"layers": 1, "batch": 4 * b}, 4 * floats + s * s,
         "without a pipeline the 4 micro-batches run one after another: one in flight"),
        (kata.Layout(tp=4), {"layers": 1, "batch": b}, 4 * floats // 4 + s * s,
         "tp divides the floats over its ranks but not the causal mask"),
        (kata.Layout(tp=2, recompute=True), {"layers": 1, "batch": b}, 4 * b * s * h // 2,
         "recomputed, a block keeps its input, which sequence parallelism splits"),
        (kata.Layout(pp=2), {"layers": 4, "batch": 8 * b}, 2 * 2 * (4 * floats + s * s),
         "a 1F1B stage 0 of 2 keeps min(pp - 0, m) = 2 micro-batches of its 2 layers"),
        (kata.Layout(pp=2), {"layers": 4, "batch": b}, 2 * 1 * (4 * floats + s * s),
         "with one micro-batch a stage keeps one, whatever pp"),
    ):  # fmt: skip
        got, call = _memory(kata, layout, **model)
        assert got.activations == expected, (
            f"{call} keeps {got.activations} bytes of activations; expected {expected}: {rule}"
        )


@pytest.mark.step(2)
def test_memory_is_the_busiest_stage(kata):
    model = _model(kata, layers=2, vocab=4096, batch=8 * PER_RANK)  # the output dwarfs a block
    got = kata.memory_per_rank(model, kata.Layout(pp=2))
    stages = kata.parameters_per_rank(model, 1, 2)
    assert got.parameters == 4 * max(stages), (
        f"memory_per_rank(a 2-layer model with a vocabulary of 4096, pp=2) holds "
        f"{got.parameters} bytes of parameters; its stages hold {stages} parameters, so the "
        f"busiest rank (the last stage, with the output) holds {4 * max(stages)}: report the "
        "stage whose total is largest"
    )


@pytest.mark.step(2)
def test_memory_refuses_bad_layouts(kata):
    model = _model(kata)
    for layout, wrong, why in (
        (kata.Layout(zero=4), "4", "a ZeRO stage is 0 to 3"),
        (kata.Layout(precision="fp16"), "fp16", "the precisions are fp32 and bf16"),
        (kata.Layout(dp=3), "3", f"a batch of {WORLD * PER_RANK} does not split over 3 ranks"),
    ):
        check_refuses_naming(
            lambda layout=layout: kata.memory_per_rank(model, layout),
            f"memory_per_rank(TinyTransformer, {layout!r})",
            wrong,
            why,
            lambda got, why=why: f"returned {got!r}: {why}, so raise ValueError saying so",
        )


# --------------------------------------------------------------------------- step 3: bytes


@pytest.mark.step(3)
def test_wire_bytes_follow_the_ring(kata):
    payload = 840 * 1024  # divides by 1 to 8
    for ranks in range(1, 9):
        for collective, factor in (("all_reduce", 2 * (ranks - 1) / ranks),
                                   ("all_gather", (ranks - 1) / ranks),
                                   ("reduce_scatter", (ranks - 1) / ranks), ("send", 1)):  # fmt: skip
            got = kata.wire_bytes(collective, payload, ranks)
            assert got == round(factor * payload), (
                f"wire_bytes({collective!r}, {payload}, {ranks}) = {got}; a ring sends "
                f"{factor:g} x the payload each rank, {round(factor * payload)}"
            )
    check_refuses_naming(
        lambda: kata.wire_bytes("gossip", 10, 2),
        "wire_bytes('gossip', 10, 2)",
        "gossip",
        "the collectives are all_reduce, all_gather, reduce_scatter and send",
        lambda got: f"returned {got!r}: name the collectives it knows in a ValueError",
    )


# A layout measured on the world, and the group whose payloads it recorded
MEASURED_TRAFFIC = [
    ("zero3", dict(dp=2, zero=3), {}, "dp", "k19's FullyShardedModule, one forward and backward"),
    ("fully_shard", dict(dp=2, zero=3), {}, "dp", "torch's fully_shard, one forward and backward"),
    (
        "fully_shard_bf16",
        dict(dp=2, zero=3, precision="bf16"),
        {},
        "dp",
        "torch's fully_shard gathering and reducing in bf16 (MixedPrecisionPolicy)",
    ),
    ("zero1", dict(dp=2, zero=1), {}, "dp", "k18's ShardedOptimizer's step (its all-gather half)"),
    ("tp", dict(tp=2), {"layers": 1, "batch": PER_RANK}, "tp", "k25's block, both ways, synced"),
    ("pp", dict(pp=2), {"batch": PER_RANK * PIPELINED}, "pp", "k21's 1F1B step, 4 micro-batches"),
]


@pytest.mark.step(3)
@pytest.mark.parametrize(
    "name, layout, model, group, what", MEASURED_TRAFFIC, ids=[m[0] for m in MEASURED_TRAFFIC]
)
def test_traffic_is_what_the_references_send(kata, name, layout, model, group, what):
    stages = kata.Layout(**layout).pp  # rank r of a pipeline is stage r
    planned = [
        kata.step_traffic(_model(kata, **model), kata.Layout(**layout), r % stages).get(group, {})
        for r in range(WORLD)
    ]
    for rank, found in enumerate(_measurements()):
        recorded, says = found[name]["traffic"], planned[rank]
        if name == "zero1":  # k18 broadcasts what ZeRO-1 all-gathers; the loop sums the gradients
            says = {k: v for k, v in says.items() if k == "all_gather"}
        stage = f", stage={rank}" if stages > 1 else ""
        assert says == recorded, (
            f"rank {rank} recorded {what} putting {recorded} bytes into its collectives; "
            f"step_traffic(.., {kata.Layout(**layout)}{stage})[{group!r}] says {says}"
            + (". The blocks are gathered forward and again backward, the root once"
               if name.startswith(("zero3", "fully_shard")) else "")
            + (". In bf16 every element that travels is 2 bytes" if "bf16" in name else "")
            + (". k25's block: 6 all-gathers and 4 reduce-scatters of b s h, the 6 h whole "
               "parameters' gradients all-reduced" if name == "tp" else "")
            + (". Each micro-batch's activations go forward from every stage but the last, "
               "their gradients back from every stage but the first" if name == "pp" else "")
        )  # fmt: skip


@pytest.mark.step(3)
def test_traffic_by_arithmetic(kata):
    model = _model(kata, layers=4, batch=8 * PER_RANK)  # dp=2: 4 micro-batches a rank
    n = kata.parameters_per_rank(model)[0]
    act = PER_RANK * SEQUENCE * MODEL_DIM  # elements of one micro-batch's b s h
    layer = 12 * MODEL_DIM**2 + 13 * MODEL_DIM
    for layout, stage, expected, rule in (
        (kata.Layout(dp=2), 0, {"dp": {"all_reduce": 4 * n}},
         "DDP all-reduces every gradient once a step; a group of one rank moves nothing"),
        (kata.Layout(dp=2, zero=2, precision="bf16"), 0,
         {"dp": {"reduce_scatter": 2 * n, "all_gather": 2 * n}},
         "ZeRO-2 reduce-scatters the gradients and all-gathers the parameters, bf16: 2 bytes"),
        (kata.Layout(dp=2, zero=3), 0,
         {"dp": {"all_gather": 4 * 4 * (n + 4 * layer), "reduce_scatter": 4 * 4 * n}},
         "ZeRO-3, per micro-batch (4): the blocks gathered twice, the root once"),
        (kata.Layout(dp=2, pp=2), 1,
         {"dp": {"all_reduce": 4 * kata.parameters_per_rank(model, 1, 2)[1]},
          "pp": {"send": 4 * 4 * act}},
         "the last stage of 2 sends each micro-batch's gradient back, its own parameters' "
         "gradients to dp"),
        (kata.Layout(pp=4), 1, {"pp": {"send": 2 * 8 * 4 * act}},
         "a middle stage sends activations forward and gradients back, 8 micro-batches"),
        (kata.Layout(tp=2, dp=2), 0,
         {"dp": {"all_reduce": 4 * kata.parameters_per_rank(model, 2)[0]},
          "tp": {"all_gather": 6 * 4 * 4 * 4 * act, "reduce_scatter": 4 * 4 * 4 * 4 * act,
                 "all_reduce": 4 * 4 * 6 * MODEL_DIM}},
         "tp per layer (4) and micro-batch (4): 6 all-gathers, 4 reduce-scatters; once: 6 h "
         "whole gradients"),
    ):  # fmt: skip
        got = kata.step_traffic(model, layout, stage)
        assert got == expected, (
            f"step_traffic(4 layers, {model.batch} sequences in micro-batches of {PER_RANK}, "
            f"{layout}, stage={stage}) = {got}; expected {expected}: {rule}"
        )


@pytest.mark.step(3)
def test_traffic_refuses_a_stage_outside_the_pipeline(kata):
    model = _model(kata, layers=4)
    check_refuses_naming(
        lambda: kata.step_traffic(model, kata.Layout(pp=2, dp=1), 2),
        "step_traffic(.., Layout(pp=2), stage=2)",
        "2",
        "a pipeline of 2 has stages 0 and 1",
        lambda got: f"returned {got!r}: stage 2 does not exist, so raise ValueError",
    )


# --------------------------------------------------------------------------- step 4: time


def _hardware(kata, **bandwidth):
    return kata.Hardware(flops=1e12, mfu=0.5, memory=2**30, bandwidth=bandwidth)


@pytest.mark.step(4)
def test_compute_time_is_6n_per_token_at_the_mfu(kata):
    model = _model(kata, layers=4, batch=8 * PER_RANK)
    n = kata.parameters_per_rank(model)[0]
    tokens = 8 * PER_RANK * SEQUENCE
    for layout, flops, bubble, rule in (
        (kata.Layout(dp=2), 6, 1, "6 N FLOPs per token of the whole batch, over 2 GPUs"),
        (kata.Layout(dp=2, recompute=True), 8, 1, "recomputing runs forward twice: 8 N"),
        (kata.Layout(pp=2, dp=2), 6, 1 + 1 / 4, "a pipeline of 2, 4 micro-batches: 1 + 1/4"),
    ):
        got = kata.step_time(model, layout, _hardware(kata, dp=1e30, pp=1e30))
        world = layout.dp * layout.tp * layout.pp
        expected = flops * n * tokens / (world * 1e12 * 0.5) * bubble
        assert got.compute == pytest.approx(expected, rel=1e-9), (
            f"step_time({layout}) computes for {got.compute:.6g} s; expected {expected:.6g} s: "
            f"{rule}, at 1e12 FLOP/s x MFU 0.5"
        )


@pytest.mark.step(4)
def test_step_time_overlaps_dp_and_waits_for_tp_and_pp(kata):
    model = _model(kata, layers=4, batch=4 * PER_RANK)
    layout = kata.Layout(dp=2, tp=2, pp=2)
    slow = _hardware(kata, dp=1e3, tp=1e5, pp=1e6)
    got = kata.step_time(model, layout, slow)
    sizes = {"dp": 2, "tp": 2, "pp": 2}
    expected = {}
    for stage in range(2):
        for group, payloads in kata.step_traffic(model, layout, stage).items():
            sent = sum(kata.wire_bytes(k, p, sizes[group]) for k, p in payloads.items())
            expected[group] = max(expected.get(group, 0.0), sent / slow.bandwidth[group])
    assert got.communication == pytest.approx(expected, rel=1e-9), (
        f"step_time({layout}).communication = {got.communication}; expected {expected}: each "
        "group's wire bytes (wire_bytes of step_traffic) over its bandwidth, the slowest stage's"
    )
    step = max(got.compute, expected["dp"]) + expected["tp"] + expected["pp"]
    assert got.step == pytest.approx(step, rel=1e-9), (
        f"step_time({layout}).step = {got.step:.6g} s with compute {got.compute:.6g} s and "
        f"communication {expected}; expected {step:.6g} s: max(compute, dp) + tp + pp (dp's "
        "traffic overlaps with backward, tp's and pp's wait on the critical path)"
    )
    n, tokens = kata.parameters_per_rank(model)[0], 4 * PER_RANK * SEQUENCE
    mfu = 6 * n * tokens / (got.step * 8 * 1e12)
    assert got.mfu == pytest.approx(mfu, rel=1e-9), (
        f"step_time({layout}).mfu = {got.mfu:.6g}; expected 6 N tokens / (step x 8 GPUs x "
        f"peak) = {mfu:.6g} (the peak, not peak x MFU: it says how much of the peak a step uses)"
    )


@pytest.mark.step(4)
def test_step_time_refuses_a_group_without_bandwidth(kata):
    check_refuses_naming(
        lambda: kata.step_time(_model(kata), kata.Layout(dp=2), _hardware(kata, tp=1e9)),
        "step_time(.., Layout(dp=2), Hardware(bandwidth={'tp': 1e9}))",
        "dp",
        "the dp group sends, and hardware.bandwidth has no 'dp'",
        lambda got: f"returned {got!r}: name the group that has no bandwidth in a ValueError",
    )


# --------------------------------------------------------------------------- step 5: the plan


def _gpt(kata):
    return kata.Model(layers=8, dim=256, heads=8, vocab=1024, sequence=256, batch=32, micro_batch=2)


@pytest.mark.step(5)
def test_plan_keeps_every_layout_that_fits_fastest_first(kata):
    model, hardware = _gpt(kata), _hardware(kata, dp=2e9, tp=2e10, pp=2e10)
    layouts = kata.every_layout(model, 8)
    needs = {layout: kata.memory_per_rank(model, layout).total for layout in layouts}
    budget = sorted(needs.values())[len(needs) // 2]  # half of them fit
    plans = kata.plan(model, 8, hardware, budget=budget)
    got = [p.layout for p in plans]
    fitting = [layout for layout in layouts if needs[layout] <= budget]
    missing = [str(layout) for layout in fitting if layout not in got]
    extra = [str(layout) for layout in got if layout not in fitting]
    assert not missing and not extra, (
        f"plan(.., budget={budget}) should keep the {len(fitting)} layouts whose memory is at "
        f"most the budget; it left out {missing[:3]} and kept {extra[:3]} (over the budget)"
    )
    keys = [(p.timing.step, p.memory.total) for p in plans]
    for i, (before, after) in enumerate(zip(keys, keys[1:])):
        assert before <= after, (
            f"plan's layouts {i} and {i + 1} (from 0), {got[i]} then {got[i + 1]}, take "
            f"{before[0]:.6g} s and {after[0]:.6g} s ({before[1]} and {after[1]} bytes): fastest "
            "first, and of equal times the one with less memory"
        )
    assert plans[0].memory == kata.memory_per_rank(model, got[0]) and plans[0].timing == (
        kata.step_time(model, got[0], hardware)
    ), f"plan's first Plan should carry memory_per_rank's and step_time's results for {got[0]}"


@pytest.mark.step(5)
def test_plan_breaks_ties_by_the_order_given_and_keeps_the_budgets_edge(kata):
    model, hardware = _gpt(kata), _hardware(kata)
    given = [kata.Layout(zero=2), kata.Layout(zero=0), kata.Layout(zero=1)]  # dp=1: alike
    exact = kata.memory_per_rank(model, given[0]).total
    got = [p.layout for p in kata.plan(model, 1, hardware, budget=exact, layouts=given)]
    assert got == given, (
        f"plan of three layouts with the same memory and time, given as {[str(g) for g in given]}"
        f" with a budget of exactly their memory, returned {[str(g) for g in got]}: keep every "
        "layout at most the budget, and equal ones in the order they came in"
    )


@pytest.mark.step(5)
def test_plan_refuses_a_layout_of_another_world_and_a_budget_nothing_fits(kata):
    model, hardware = _gpt(kata), _hardware(kata, dp=1e9, tp=1e9, pp=1e9)
    check_refuses_naming(
        lambda: kata.plan(model, 8, hardware, layouts=[kata.Layout(dp=2, tp=2)]),
        "plan(.., world=8, layouts=[Layout(dp=2, tp=2)])",
        "4",
        "dp x tp x pp = 4 is not the world's 8 GPUs",
        lambda got: f"returned {got!r}: a layout of 4 GPUs does not run on 8; refuse it",
    )
    least = min(kata.memory_per_rank(model, lay).total for lay in kata.every_layout(model, 8))
    check_refuses_naming(
        lambda: kata.plan(model, 8, hardware, budget=least - 1),
        f"plan(.., world=8, budget={least - 1})",
        str(least),
        f"no layout fits, and the least any needs is {least} bytes",
        lambda got: f"returned {got!r}: nothing fits, so say so and what the least need is",
    )


@pytest.mark.step(5)
def test_program_plans_a_node_and_agrees_with_fully_shard(kata):
    out = run_module_ok(KATA, "--top", "3", timeout=120).stdout
    assert "the pick: dp" in out, f"the program names no pick:\n{out}"
    assert "to the byte" in out, f"the program's planner disagrees with fully_shard:\n{out}"


# --------------------------------------------------------------------------- CUDA


def _fully_sharded_on_cuda(rank: int, world_size: int) -> dict:
    return _fully_sharded(rank_gpu(), rank, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.step(3)
def test_traffic_in_bf16_is_what_fully_shard_sends_over_nccl(kata):
    layout = kata.Layout(dp=2, zero=3, precision="bf16")
    planned = kata.step_traffic(_model(kata), layout).get("dp", {})
    measured = run_world(_fully_sharded_on_cuda, WORLD, **on_cuda(WORLD, "nccl"))
    for rank, found in enumerate(measured):
        assert found["traffic"] == planned, (
            f"rank {rank} recorded torch's fully_shard (bf16, NCCL, on GPUs) putting "
            f"{found['traffic']} bytes into its collectives; step_traffic(.., {layout})['dp'] "
            f"says {planned}"
        )
