"""k19 FSDP: shard_of, then FullyShardedModule's sharding, gather, hooks, finish and full params,
then prefetch and reshard_after_forward."""

from __future__ import annotations

import functools
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dojo.harness.calls import clock, recording
from dojo.harness.culprit import describe
from dojo.harness.impl import load_kata
from dojo.harness.world import RankFailed, WorldDeadlock, run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import refusal, run_module_ok
from dojo.toy_models import Block, TinyTransformer, make_tokens, make_transformer, transformer_loss

KATA = "k19_fsdp"
LR = 0.05
# torch 2.14 renamed the flat collectives (the old names call the new ones): count either
GATHERS = {"all_gather", "all_gather_into_tensor", "all_gather_single"}
SCATTERS = {"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"}

# Exactness. In fp32 each rank computes its micro-batch's gradient as one process does (the same
# weights, the same operations: the harness runs every rank with one thread), and on 2 ranks
# every mean is (a + b) / 2 whatever the order: bitwise one process averaging the micro-batches'
# gradients. On 3 ranks gloo adds three numbers in an order of its own, and (a + b) + c is not
# always a + (b + c) in floating point: there a few ulps are allowed (and SGD, not AdamW, whose
# division by sqrt(v) turns an ulp in a near-zero gradient into a visible difference).
CLOSE = {"rtol": 1e-5, "atol": 1e-6}
# What a unit is: a layer each (the default), or fully_shard's way (a block each, the model the
# rest: the embedding, the last norm and the output).
UNIT_TYPES = {"layers": (nn.Linear, nn.Embedding), "blocks": (Block, TinyTransformer)}


def _expected_piece(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    chunk = -(-flat.numel() // world_size)
    padded = torch.cat([flat, flat.new_zeros(chunk * world_size - flat.numel())])
    return padded[rank * chunk : (rank + 1) * chunk]


def _sharded_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) and list(m.parameters(recurse=False))
    }


def _flat_of(layer: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in layer.parameters(recurse=False)])


def _units_of(model: nn.Module, units: str) -> dict[str, list[str]]:
    """Each unit's name in the model -> its parameters' names in the model: every parameter
    beneath a module of the unit types goes to the deepest such module above it."""
    found = [p for p, m in model.named_modules() if isinstance(m, UNIT_TYPES[units])]
    taken: dict[str, list[str]] = {p: [] for p in found}
    for name, _ in model.named_parameters():
        path = name.rpartition(".")[0]
        above = [p for p in found if p == "" or path == p or path.startswith(p + ".")]
        if above:
            taken[max(above, key=len)].append(name)
    return {p: names for p, names in taken.items() if names}


def _unit_flat(values: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([values[n].detach().reshape(-1) for n in names])


def _padded(numel: int, size: int) -> int:
    return -(-numel // size) * size


def _unit_bytes(model: nn.Module, units: str, size: int) -> dict[str, int]:
    """Each unit's full vector in bytes (fp32, padding included)."""
    numel = {n: p.numel() for n, p in model.named_parameters()}
    return {
        prefix: 4 * _padded(sum(numel[n] for n in names), size)
        for prefix, names in _units_of(model, units).items()
    }


def _shown(prefix: str) -> str:
    return repr(prefix) if prefix else "'' (the model's own)"


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# --------------------------------------------------------------------------- step 1: shard_of

SHARD_CASES = {"ten-on-3": (10, 3), "eight-on-2": (8, 2), "three-on-4": (3, 4), "one-rank": (5, 1)}


@pytest.mark.step(1)
@pytest.mark.parametrize("case", SHARD_CASES)
def test_shard_of_pads_and_keeps_one_piece(kata, case):
    numel, world_size = SHARD_CASES[case]
    flat = torch.arange(1.0, numel + 1, dtype=torch.float64)
    chunk = -(-numel // world_size)
    pieces = []
    for rank in range(world_size):
        got = kata.shard_of(flat, rank, world_size)
        expected = _expected_piece(flat, rank, world_size)
        call = f"shard_of(a flat tensor of {numel}, rank={rank}, world_size={world_size})"
        assert torch.is_tensor(got) and got.dim() == 1, f"{call} returned {got!r}: a 1-D tensor"
        if got.numel() != chunk:
            raise AssertionError(
                f"{call} returned {got.numel()} element(s), expected {chunk} = ceil({numel} / "
                f"{world_size}): every rank's piece has the same length, so pad the flat vector "
                "with zeros to a multiple of world_size first (the last rank's piece ends in "
                "padding)"
            )
        assert got.dtype == flat.dtype, f"{call} returned {got.dtype}, not the input's {flat.dtype}"
        if not torch.equal(got, expected):
            raise AssertionError(
                f"{call} returned {got.tolist()}, expected {expected.tolist()}: rank r keeps "
                f"elements [r * {chunk}, (r + 1) * {chunk}) of the padded vector"
            )
        pieces.append(got)
    pieces[0].fill_(-1)
    assert flat[0] == 1, (
        "changing the piece shard_of returned changed the flat tensor it was given: return a "
        "new tensor (.clone()), which the wrapper keeps as its parameter"
    )


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "args",
    [
        (torch.zeros(4), 2, 2),
        (torch.zeros(4), -1, 2),
        (torch.zeros(4), 0, 0),
        (torch.zeros(2, 2), 0, 2),
    ],
    ids=["rank-too-big", "negative-rank", "no-ranks", "not-flat"],
)
def test_shard_of_refuses_bad_input(kata, args):
    problem = refusal(lambda: kata.shard_of(*args))
    assert problem is None, (
        f"shard_of(shape {tuple(args[0].shape)}, rank={args[1]}, world_size={args[2]}) {problem}: "
        "a rank outside 0..world_size-1, a world of fewer than 1 rank, or a tensor that is not "
        "one-dimensional must raise ValueError saying what was wrong"
    )


# --------------------------------------------------------------------------- the rank side


def _group(rank, members):
    if not members:
        return None
    group = dist.new_group(members)
    return group if rank in members else "outside"


class _Watch:
    """Full weights alive at once, measured by watching storages: a storage is alive as long as
    any tensor (a view, a tensor autograd saved) still uses it. Gloo's worker thread lets go of a
    collective's tensors a moment after the call returns: when more watched storages are alive
    than ``expected``, the measure waits a little (1 s in all per watch) for such stragglers."""

    def __init__(self, expected: int = 1):
        self.storages: dict[int, tuple] = {}
        self.peak, self.where = 0, ""
        self.patience = 1.0
        self.expected = expected  # storages rightly alive at once (prefetch: one more)

    def track(self, tensor):
        if not torch.is_tensor(tensor):
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        known = self.storages.get(key)
        if known is None or known[0]() is None:
            self.storages[key] = (weakref.ref(storage), storage.nbytes())

    def _alive(self) -> list[int]:
        return [n for ref, n in self.storages.values() if ref() is not None]

    def alive_now(self) -> int:
        """The watched bytes still alive, after waiting a little for gloo's stragglers."""
        for _ in range(100):
            if not self._alive():
                break
            time.sleep(0.005)
        return sum(self._alive())

    def measure(self, where: str):
        alive = self._alive()
        while len(alive) > self.expected and self.patience > 0:
            time.sleep(0.005)
            self.patience -= 0.005
            alive = self._alive()
        if sum(alive) > self.peak:
            self.peak, self.where = sum(alive), where


def _watching(watch: _Watch, dtypes: list, phase: list):
    """Every all-gather's output watched (torch.distributed and its c10d module both patched)."""
    import torch.distributed.distributed_c10d as c10d

    originals = {}
    for name in ("all_gather_single", "all_gather_into_tensor", "all_gather"):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        originals[name] = original

        def watched(output, *args, _original=original, **kwargs):
            result = _original(output, *args, **kwargs)
            for tensor in output if isinstance(output, (list, tuple)) else [output]:
                dtypes.append(tensor.dtype)
                watch.track(tensor)
            watch.measure(f"an all-gather in {phase[0]}")
            return result

        functools.update_wrapper(watched, original)  # its signature: dojo.harness.calls reads it
        for module in (c10d, dist):
            setattr(module, name, watched)
    return originals


def _restore(originals):
    import torch.distributed.distributed_c10d as c10d

    for name, original in originals.items():
        for module in (c10d, dist):
            setattr(module, name, original)


def _one_step_of_reference(reference, tokens, targets, group, size, own=None):
    """The unsharded model's gradients, averaged over the group (the test's own all-reduce);
    ``own``, a dict, gets this rank's own gradients before the average."""
    reference.zero_grad()
    transformer_loss(reference(tokens), targets).backward()
    grads = {}
    for name, param in reference.named_parameters():
        grad = param.grad.clone()
        if own is not None:
            own[name] = grad.clone()
        dist.all_reduce(grad, group=group)
        grads[name] = grad / size
    return grads


def _wrap(kata, model, group, units="layers", compute_dtype=None, prefetch=False, reshard=True):
    return kata.FullyShardedModule(
        model,
        compute_dtype=compute_dtype,
        shard_types=UNIT_TYPES[units],
        process_group=group,
        prefetch=prefetch,
        reshard_after_forward=reshard,
    )


def _probe(
    rank,
    world_size,
    members=None,
    compute_dtype=None,
    run=True,
    units="layers",
    prefetch=False,
    reshard=True,
    steps=1,
):
    """``steps`` forwards and backwards through the wrapper, the last one watched: what was
    sharded, what was gathered (and when), what came out."""
    kata = load_kata(KATA)
    group = _group(rank, members)
    if group == "outside":
        return None
    size, mine = dist.get_world_size(group), dist.get_rank(group)
    model, reference = make_transformer(0), make_transformer(0)
    modules, layers = dict(model.named_modules()), _sharded_layers(model)
    wrapper = _wrap(kata, model, group, units, compute_dtype, prefetch, reshard)
    report = {
        "model_params": [n for n, _ in model.named_parameters()],
        "wrapper_params": [
            (tuple(p.shape), p.dtype, p.requires_grad) for p in wrapper.parameters()
        ],
        "units": [u.prefix for u in getattr(wrapper, "units", [])],
        "shards": {u.prefix: u.shard.detach().clone() for u in getattr(wrapper, "units", [])},
        "group_rank": mine,
    }
    if not run:  # the sharding alone (step 2)
        return report
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=LR)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(steps - 1):  # the steps before the watched one (prefetch needs one)
        optimizer.zero_grad()
        tokens, targets = make_tokens(4, 100 * step + mine)
        transformer_loss(wrapper(tokens), targets).backward()
        wrapper.finish_gradient_synchronization()
        optimizer.step()
        reference_grads = _one_step_of_reference(reference, tokens, targets, group, size)
        for name, param in reference.named_parameters():
            param.grad = reference_grads[name]
        reference_optimizer.step()
    optimizer.zero_grad()
    # the storages rightly alive at once: a unit (and the model's own), one more with prefetch,
    # every unit when kept; more than that waits a little for gloo's stragglers to go
    expected = (1 + (units == "blocks") + prefetch) if reshard else len(report["units"]) + 1
    watch, dtypes, weight_dtypes, phase, started = _Watch(expected), [], [], ["forward"], []

    def look(name):
        def hook(module, args):
            for attribute in ("weight", "bias"):
                value = getattr(module, attribute, None)
                if torch.is_tensor(value):
                    watch.track(value)
                    weight_dtypes.append(value.dtype)
            watch.measure(f"{name or 'the model'}'s forward")

        return hook

    def ran(prefix, when):
        def hook(module, *args):
            started.append((prefix, when, clock()))

        return hook

    # after the wrapper's own hooks: these see the gathered weights
    for name, layer in layers.items():
        layer.register_forward_pre_hook(look(name))
    for prefix in _units_of(make_transformer(0), units):
        modules[prefix].register_forward_pre_hook(ran(prefix, "start"))
        modules[prefix].register_forward_hook(ran(prefix, "end"))
    tokens, targets = make_tokens(4, 100 * (steps - 1) + mine)
    originals = _watching(watch, dtypes, phase)
    try:
        with recording() as forward_calls:
            output = wrapper(tokens)
            loss = transformer_loss(output, targets)
        watch.measure("the end of forward")
        peak_forward = watch.peak
        kept = [u.prefix for u in getattr(wrapper, "units", []) if u.full is not None]
        phase[0] = "backward"
        with recording() as backward_calls:
            loss.backward()
    finally:
        _restore(originals)
    output_value, output_dtype = output.detach().clone(), output.dtype
    del output, loss  # what backward left alive is measured with these gone
    left = watch.alive_now()
    expected = _one_step_of_reference(reference, tokens, targets, group, size)
    with torch.no_grad():
        expected_output = reference(tokens)
    expected_units = _units_of(reference, units)

    def calls(recorded):
        return [
            {"name": c.name, "async": c.async_op, "done": c.done, "start": c.start}
            for c in recorded
        ]

    report.update(
        {
            "output": output_value,
            "output_dtype": output_dtype,
            "expected_output": expected_output,
            "forward": [c.name for c in forward_calls],
            "backward": [c.name for c in backward_calls],
            "forward_calls": calls(forward_calls),
            "backward_calls": calls(backward_calls),
            "started": started,
            "peak": watch.peak,
            "peak_where": watch.where,
            "peak_forward": peak_forward,
            "kept_after_forward": kept,
            "left": left,
            "pending": [u.prefix for u in getattr(wrapper, "units", []) if u.pending is not None],
            "gathered_dtypes": sorted({str(d) for d in dtypes}),
            "weight_dtypes": sorted({str(d) for d in weight_dtypes}),
            "shard_grads": {
                u.prefix: None if u.shard.grad is None else u.shard.grad.clone()
                for u in getattr(wrapper, "units", [])
            },
            "shard_dtypes": sorted({str(p.dtype) for p in wrapper.parameters()}),
            "expected_grads": {
                prefix: _expected_piece(_unit_flat(expected, names), mine, size)
                for prefix, names in expected_units.items()
            },
        }
    )
    return report


# --------------------------------------------------------------------------- step 2: sharding


@pytest.mark.step(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_linear_and_embedding_is_sharded(kata, world_size):
    _check_sharding(run_world(_probe, world_size, None, None, False), world_size, None)


@pytest.mark.step(2)
def test_a_subgroup_shards_by_its_own_ranks(kata):
    try:
        results = run_world(_probe, 3, [1, 2], None, False)
    except RankFailed as failure:
        raise AssertionError(
            "FullyShardedModule(process_group=the group [1, 2]) on 3 ranks: a rank failed while "
            "sharding. Global rank 2 is rank 1 in that group of 2: shard by the rank in the "
            "group, dist.get_rank(process_group), not the rank in the whole world\n" + str(failure)
        ) from None
    _check_sharding(results, 3, [1, 2])


@pytest.mark.step(2)
def test_a_block_unit_takes_every_parameter_beneath_it(kata):
    results = run_world(_probe, 2, None, None, False, "blocks")
    _check_sharding(results, 2, None, "blocks")


def _check_sharding(results, world_size, members, units="layers"):
    model = make_transformer(0)
    params = dict(model.named_parameters())
    expected_units = _units_of(model, units)
    ranks = members or list(range(world_size))
    size = len(ranks)
    types = ", ".join(t.__name__ for t in UNIT_TYPES[units])
    where = f"FullyShardedModule(TinyTransformer, shard_types=({types})) on {world_size} ranks" + (
        f", the group {members}" if members else ""
    )
    taken = {n for names in expected_units.values() for n in names}
    replicated = [n for n in params if n not in taken]
    for position, rank in enumerate(ranks):
        got = results[rank]
        missing = [p for p in expected_units if p not in got["shards"]]
        if missing:
            deeper = (
                " A unit takes every parameter beneath it (named_parameters() of the unit's "
                "module, its children's too), except those beneath a deeper unit, which that "
                "unit takes: a block's LayerNorms and Linears all go in the block's one vector"
                if units == "blocks"
                else ""
            )
            raise AssertionError(
                f"{where}: rank {rank} has no ShardedUnit for "
                f"{', '.join(_shown(p) for p in missing[:4])} (its units: "
                f"{', '.join(_shown(p) for p in got['units'][:6])}): every module of shard_types "
                "with parameters to take gets one, with its name in the model as prefix." + deeper
            )
        kept = [n for n in got["model_params"] if n in taken]
        assert not kept, (
            f"{where}: after sharding, rank {rank}'s modules still have parameters of their own "
            f"({', '.join(kept[:3])}): remove each from the module it lives in (delattr; "
            "owner_of finds it), so that only the shards (and the replicated parameters) are "
            "parameters"
        )
        assert got["units"] == list(expected_units), (
            f"{where}: rank {rank} has {len(got['units'])} units "
            f"({', '.join(_shown(p) for p in got['units'][:6])}...), expected "
            f"{len(expected_units)}, {', '.join(_shown(p) for p in expected_units)}: one "
            "ShardedUnit per module of shard_types, in named_modules() order, all its parameters "
            "in one flat shard (one all-gather for all of them, not one per parameter)"
        )
        for prefix, names in expected_units.items():
            shard = got["shards"][prefix]
            flat = _unit_flat(params, names)
            expected = _expected_piece(flat, position, size)
            if shard.shape != expected.shape:
                raise AssertionError(
                    f"{where}: rank {rank}'s shard of {_shown(prefix)} has {shard.numel()} "
                    f"element(s), expected {expected.numel()} (its {flat.numel()} elements: "
                    f"{', '.join(n[len(prefix) + 1 if prefix else 0 :] for n in names[:4])}"
                    f"{'...' if len(names) > 4 else ''} end to end, in named_parameters() order, "
                    f"padded to a multiple of {size}, then 1/{size}): "
                    + _why_this_size(model, prefix, flat.numel(), shard.numel(), size)
                )
            if not torch.equal(shard, expected):
                which = next(
                    (
                        r
                        for r in range(world_size)
                        if torch.equal(shard, _expected_piece(flat, r, size))
                    ),
                    None,
                )
                hint = (
                    f"it holds piece {which}: keep the piece of the rank in the group, "
                    "dist.get_rank(process_group), not the rank in the whole world"
                    if which is not None
                    else "expected this rank's piece of the unit's parameters laid end to end "
                    "(in named_parameters() order: weight, then bias), padded"
                )
                raise AssertionError(
                    f"{where}: rank {rank}'s shard of {_shown(prefix)} is wrong: {hint}"
                )
        shapes = [shape for shape, _, _ in got["wrapper_params"]]
        expected_count = len(expected_units) + len(replicated)
        assert len(shapes) == expected_count, (
            f"{where}: rank {rank}'s wrapper.parameters() yields {len(shapes)} tensors, expected "
            f"{expected_count}: one shard per unit plus the {len(replicated)} replicated "
            "parameters (of no unit: the LayerNorms, with a unit per layer). Register each shard "
            "as a parameter of the wrapper (self.shards, an nn.ParameterList) and keep no full "
            "copy as a parameter"
        )
        for shape, dtype, trainable in got["wrapper_params"]:
            assert dtype == torch.float32 and trainable, (
                f"{where}: rank {rank}'s wrapper has a parameter of shape {shape}, {dtype}, "
                f"requires_grad={trainable}: shards are fp32 parameters the optimizer trains"
            )


def _why_this_size(model: nn.Module, prefix: str, numel: int, got: int, size: int) -> str:
    """What a shard of ``got`` elements shows of how the unit's ``numel`` elements were cut: a
    cut without padding, a unit that took the deeper units' parameters or only its own; where
    its size matches none of these, what it would be a piece of, and no more."""
    uneven = {len(piece) for piece in torch.empty(numel).chunk(size)} | {numel // size}
    if got in uneven:  # torch.chunk's pieces, or the remainder dropped
        return (
            "every piece has the same length, so pad the flat vector with zeros to a multiple of "
            f"{size} first (torch.chunk's last piece is shorter, floor division drops the rest)"
        )
    module = model.get_submodule(prefix)
    beneath = sum(p.numel() for p in module.parameters())
    own = sum(p.numel() for p in module.parameters(recurse=False))
    if beneath != numel and got == -(-beneath // size):
        return (
            f"that is 1/{size} of every parameter beneath {_shown(prefix)} ({beneath} elements), "
            "the deeper units' too. A parameter beneath a deeper unit of shard_types is that "
            "unit's alone: each parameter goes to the deepest unit above it"
        )
    if own != numel and got == -(-own // size):
        return (
            f"that is 1/{size} of {_shown(prefix)}'s own parameters ({own} elements, "
            "named_parameters(recurse=False)). A unit takes every parameter beneath it, its "
            "children's too, except those beneath a deeper unit"
        )
    return f"a shard of {got} is 1/{size} of about {got * size} elements, not of {numel}"


# --------------------------------------------------------------------------- step 3: the gather


def _gather_probe(rank, world_size, compute_dtype):
    kata = load_kata(KATA)
    flat = torch.arange(1.0, 11.0)  # 10 elements: padded to 12 on 3 ranks
    shard = nn.Parameter(kata.shard_of(flat, rank, world_size))
    with recording() as forward_calls:
        full = kata.AllGatherShard.apply(shard, None, compute_dtype)
    plain = kata.gather_shard(shard, None, compute_dtype)
    error = None
    with recording() as backward_calls:
        try:
            full.backward(torch.full(full.shape, float(rank + 1), dtype=full.dtype))
        except RuntimeError as problem:  # autograd refuses a gradient of the wrong shape
            error = str(problem).splitlines()[0]
    return {
        "error": error,
        "full": full.detach().float(),
        "dtype": full.dtype,
        "plain": plain.float(),
        "plain_dtype": plain.dtype,
        "grad": shard.grad,
        "forward": [c.name for c in forward_calls],
        "backward": [c.name for c in backward_calls],
    }


@pytest.mark.step(3)
@pytest.mark.parametrize("compute_dtype", [None, torch.float16], ids=["fp32", "fp16"])
def test_the_gather_and_its_backward(kata, compute_dtype):
    world_size = 3
    results = run_world(_gather_probe, world_size, compute_dtype)
    padded = torch.cat([torch.arange(1.0, 11.0), torch.zeros(2)])
    expected_grad = torch.full((4,), (1 + 2 + 3) / 3)
    wanted = compute_dtype or torch.float32
    where = f"AllGatherShard.apply(shard, None, {compute_dtype}) on 3 ranks, 10 elements"
    for rank, got in enumerate(results):
        gathers = [c for c in got["forward"] if c in GATHERS]
        assert len(gathers) == 1 and len(got["forward"]) == 1, (
            f"{where}: rank {rank}'s forward made {got['forward']}: exactly one all-gather"
        )
        assert torch.equal(got["full"], padded), (
            f"{where}: rank {rank} gathered {got['full'].tolist()}, expected every rank's shard "
            f"end to end in rank order, {padded.tolist()} (padding included)"
        )
        assert got["dtype"] == wanted and got["plain_dtype"] == wanted, (
            f"{where}: rank {rank} gathered {got['dtype']} (gather_shard: {got['plain_dtype']}), "
            f"expected {wanted}: cast the shard to compute_dtype before the all-gather"
        )
        assert torch.equal(got["plain"], padded), (
            f"{where}: gather_shard gave rank {rank} {got['plain'].tolist()}"
        )
        scatters = [c for c in got["backward"] if c in SCATTERS]
        grad = got["grad"]
        if got["error"] and "all_reduce" in got["backward"]:
            raise AssertionError(
                f"{where}: rank {rank}'s backward made {got['backward']} and autograd refused "
                f"its gradient ({got['error']}): reduce-scatter the full gradient (each rank gets "
                "the sum of its own piece, the shard's size), not all-reduce it"
            )
        assert got["error"] is None, f"{where}: rank {rank}'s backward failed: {got['error']}"
        if grad is None:
            raise AssertionError(f"{where}: after backward rank {rank}'s shard has no gradient")
        if grad.shape != expected_grad.shape or "all_reduce" in got["backward"]:
            raise AssertionError(
                f"{where}: backward made {got['backward']} and left a gradient of shape "
                f"{tuple(grad.shape)} on rank {rank}'s shard: reduce-scatter the full gradient "
                "(each rank gets the sum of its own piece only: 1/N of the bytes an all-reduce "
                "leaves on every rank), not all-reduce it"
            )
        assert len(scatters) == 1 and len(got["backward"]) == 1, (
            f"{where}: rank {rank}'s backward made {got['backward']}: exactly one reduce-scatter"
        )
        if torch.equal(grad, expected_grad * 3):
            raise AssertionError(
                f"{where}: rank {rank}'s shard gradient is {grad.tolist()}, the sum over the 3 "
                f"ranks; expected the mean {expected_grad.tolist()}: divide by the group's size"
            )
        assert grad.dtype == torch.float32, (
            f"{where}: rank {rank}'s shard gradient is {grad.dtype}: the master shard is fp32, "
            "so its gradient is too (cast the reduce-scattered gradient back)"
        )
        # Dividing by the group's size before the reduce-scatter (as fully_shard does) is as
        # right as after it, and rounds each rank's share first: in float16, 1/3 + 2/3 + 3/3
        # lands an ulp below 2. One rounding of the gathered dtype is allowed, no more.
        assert torch.allclose(grad, expected_grad, rtol=torch.finfo(wanted).eps, atol=0), (
            f"{where}: rank {rank}'s shard gradient is {grad.tolist()}, expected the mean of its "
            f"piece over the ranks, {expected_grad.tolist()} (to one rounding of {wanted}, "
            "whether it divides before the reduce-scatter or after)"
        )


def _gathered_ahead_probe(rank, world_size):
    kata = load_kata(KATA)
    shard = nn.Parameter(kata.shard_of(torch.arange(1.0, 11.0), rank, world_size))
    ahead = torch.arange(100.0, 100.0 + 4 * world_size)  # "a prefetch gathered it"
    with recording() as forward_calls:
        full = kata.AllGatherShard.apply(shard, None, None, ahead)
    with recording() as backward_calls:
        full.backward(torch.full(full.shape, float(rank + 1)))
    return {
        "full": full.detach().clone(),
        "same_storage": full.untyped_storage().data_ptr() == ahead.untyped_storage().data_ptr(),
        "grad": shard.grad,
        "forward": [c.name for c in forward_calls],
        "backward": [c.name for c in backward_calls],
    }


@pytest.mark.step(3)
def test_a_vector_gathered_ahead_is_used_as_it_is(kata):
    results = run_world(_gathered_ahead_probe, 3)
    where = "AllGatherShard.apply(shard, None, None, gathered) on 3 ranks"
    for rank, got in enumerate(results):
        assert not [c for c in got["forward"] if c in GATHERS], (
            f"{where}: rank {rank}'s forward made {got['forward']}: the vector was gathered "
            "ahead (a prefetch), so forward returns `gathered` itself and calls no collective"
        )
        assert torch.equal(got["full"], torch.arange(100.0, 112.0)) and got["same_storage"], (
            f"{where}: rank {rank}'s forward returned {got['full'].tolist()[:4]}...: return "
            "`gathered` as it is (the same tensor: _pack knows a unit by its storage)"
        )
        scatters = [c for c in got["backward"] if c in SCATTERS]
        assert len(scatters) == 1 and got["grad"] is not None, (
            f"{where}: rank {rank}'s backward made {got['backward']} and left the shard's "
            f"gradient {got['grad']}: backward is the same reduce-scatter whoever gathered"
        )
        assert torch.equal(got["grad"], torch.full((4,), 2.0)), (
            f"{where}: rank {rank}'s shard gradient is {got['grad'].tolist()}, expected the mean "
            "2.0 of the ranks' 1, 2 and 3"
        )


# --------------------------------------------------------------------------- step 4: the hooks


def _check_outputs_and_grads(results, where, exact):
    for rank, got in enumerate(results):
        if got is None:
            continue
        same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, **CLOSE))
        assert same(got["output"], got["expected_output"]), (
            f"{where}: rank {rank}'s output differs from the unsharded model's by up to "
            f"{_gap(got['output'], got['expected_output']):.3g}: before each unit runs, its "
            "parameters must be the full ones (views of the gathered vector, in order)"
        )
        for prefix, expected in got["expected_grads"].items():
            grad = got["shard_grads"].get(prefix)
            assert grad is not None, (
                f"{where}: after backward rank {rank}'s shard of {_shown(prefix)} has no "
                "gradient: the unit's parameters must be views of AllGatherShard.apply(shard, "
                "...) so that autograd carries their gradient back to the shard"
            )
            assert same(grad, expected), (
                f"{where}: rank {rank}'s shard gradient of {_shown(prefix)} differs from the mean "
                f"of the unsharded model's gradients (that piece) by up to {_gap(grad, expected):.3g}"
            )


@pytest.mark.step(4)
@pytest.mark.parametrize(
    "world_size,units", [(2, "layers"), (3, "layers"), (2, "blocks")], ids=["2", "3", "2-blocks"]
)
def test_forward_and_shard_gradients_equal_the_unsharded_model(kata, world_size, units):
    results = run_world(_probe, world_size, None, None, True, units)
    where = f"FullyShardedModule(TinyTransformer, a unit per {units[:-1]}) on {world_size} ranks"
    _check_outputs_and_grads(results, where, world_size == 2)


@pytest.mark.step(4)
@pytest.mark.parametrize("units", ["layers", "blocks"])
def test_one_gather_per_unit_in_forward_and_again_in_backward(kata, units):
    results = run_world(_probe, 2, None, None, True, units)
    count = len(_units_of(make_transformer(0), units))
    where = f"FullyShardedModule(TinyTransformer, a unit per {units[:-1]}) on 2 ranks, one step"
    again = (
        "one per unit whose backward needs its weights (the embedding's needs only the token ids)"
        if units == "layers"
        else "one per block (the model's own unit is kept from forward to backward: its forward "
        "ends last)"
    )
    for rank, got in enumerate(results):
        forward = [c for c in got["forward"] if c in GATHERS]
        backward = [c for c in got["backward"] if c in GATHERS]
        scatters = [c for c in got["backward"] if c in SCATTERS]
        assert len(forward) == count, (
            f"{where}: rank {rank} made {len(forward)} all-gathers in forward, expected {count}: "
            "one per unit, just before it runs (all of a unit's parameters in one vector)"
        )
        kept = [p for p in got["kept_after_forward"] if p]  # the model's own is kept: rightly
        if not backward and kept:
            raise AssertionError(
                f"{where}: rank {rank} gathered nothing in backward: after forward its units "
                f"{', '.join(_shown(p) for p in kept[:3])} still had their full vector "
                "(unit.full). After a unit's forward free it, self._reshard(unit) in "
                "_after_forward (the attributes back to None too), so that only shards stay "
                "between forward and backward and backward gathers again"
            )
        if not backward:
            raise AssertionError(
                f"{where}: rank {rank} gathered nothing in backward: autograd kept forward's full "
                "weights alive until backward (a linear layer saves its weight). Gather only in "
                "forward is not enough: in _pack turn a view of a gathered unit into a note, and "
                "in _unpack gather that unit again"
            )
        assert len(backward) == count - 1, (
            f"{where}: rank {rank} made {len(backward)} all-gathers in backward, expected "
            f"{count - 1}: {again}. A unit is gathered once in backward, at its first note, and "
            "its other notes use the same vector: _unpack takes it from self._unshard(unit)"
        )
        assert len(scatters) == count and "all_reduce" not in got["backward"], (
            f"{where}: rank {rank}'s backward made {len(scatters)} reduce-scatter(s) and "
            f"{got['backward'].count('all_reduce')} all-reduce(s), expected {count} "
            "reduce-scatters: one per unit (the replicated parameters are averaged in "
            "finish_gradient_synchronization, after backward)"
        )


def _one_unit_allowed(units: str, size: int) -> tuple[int, str]:
    """The full weights one unit at a time may keep alive: the largest unit's (a unit per
    layer), the model's own unit (alive from the first forward to the last backward) and the
    largest block's (a unit per block)."""
    sizes = _unit_bytes(make_transformer(0), units, size)
    if units == "layers":
        return max(sizes.values()), "the largest layer's"
    return sizes[""] + max(v for p, v in sizes.items() if p), "the model's unit's and one block's"


@pytest.mark.step(4)
@pytest.mark.parametrize(
    "world_size,units", [(2, "layers"), (3, "layers"), (2, "blocks")], ids=["2", "3", "2-blocks"]
)
def test_full_weights_alive_at_once_are_one_units(kata, world_size, units):
    results = run_world(_probe, world_size, None, None, True, units)
    allowed, whose = _one_unit_allowed(units, world_size)
    where = f"FullyShardedModule(TinyTransformer, a unit per {units[:-1]}) on {world_size} ranks"
    for rank, got in enumerate(results):
        if got["peak"] > allowed and got["peak_where"].endswith("in backward"):
            raise AssertionError(
                f"{where}: rank {rank} held {got['peak']:,} bytes of full weights at once (at "
                f"{got['peak_where']}), more than {whose} {allowed:,}: a unit's vector gathered "
                "for backward must go once the unit's gradient is done. In _before_forward "
                "register self._after_backward(unit, grad) on the gathered vector "
                "(full.register_hook), which lets it go"
            )
        assert got["peak"] <= allowed, (
            f"{where}: rank {rank} held {got['peak']:,} bytes of full weights at once (at "
            f"{got['peak_where']}), more than {whose} {allowed:,}: full weights must be freed "
            "after use. After a unit's forward drop every reference to them (the modules' "
            "attributes back to None, self._reshard(unit), and autograd must not keep them: "
            "_pack saves a note instead); in backward the weights gathered again live only "
            "while that unit's gradients are computed"
        )
        assert got["left"] == 0, (
            f"{where}: after backward rank {rank} still holds {got['left']:,} bytes of full "
            "weights: every unit's vector goes once its gradient is done (self._after_backward)"
        )


@pytest.mark.step(4)
def test_compute_dtype_gathers_float16_and_keeps_fp32_masters(kata):
    results = run_world(_probe, 2, None, torch.float16)
    plain = run_world(_probe, 2)
    where = "FullyShardedModule(TinyTransformer, compute_dtype=torch.float16) on 2 ranks"
    for rank, got in enumerate(results):
        assert got["gathered_dtypes"] == ["torch.float16"], (
            f"{where}: rank {rank}'s all-gathers moved {got['gathered_dtypes']}: cast each shard "
            "to compute_dtype before the all-gather (half the bytes on the wire)"
        )
        assert got["weight_dtypes"] == ["torch.float16"], (
            f"{where}: during forward rank {rank}'s layers held weights of {got['weight_dtypes']}"
        )
        assert got["shard_dtypes"] == ["torch.float32"], (
            f"{where}: rank {rank}'s wrapper parameters are {got['shard_dtypes']}: the master "
            "shards stay fp32 (the optimizer updates them: small updates would round away in "
            "float16); cast a copy for the gather, never the shard itself"
        )
        grads = {str(g.dtype) for g in got["shard_grads"].values() if g is not None}
        assert grads == {"torch.float32"}, (
            f"{where}: rank {rank}'s shard gradients are {sorted(grads)}: fp32, like the shards"
        )
        assert got["output_dtype"] == torch.float32, (
            f"{where}: the model's output is {got['output_dtype']}: each sharded layer computes "
            "in float16 (its floating inputs cast) and gives back its output cast to fp32, so the "
            "rest of the model (LayerNorms, the loss) runs as before"
        )
        gap = _gap(got["output"], plain[rank]["output"])
        assert gap < 0.05, f"{where}: the output differs from fp32's by up to {gap:.3g}"


# --------------------------------------------------------------------------- step 5: training


def _train(
    rank,
    world_size,
    steps,
    optimizer_name,
    members=None,
    against=None,
    units="layers",
    prefetch=False,
):
    kata = load_kata(KATA)
    group = _group(rank, members)
    if group == "outside":
        return None
    size, mine = dist.get_world_size(group), dist.get_rank(group)
    model = make_transformer(0)
    if against == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # fully_shard's units: a block each, the model the rest
            fully_shard(block)
        wrapper = fully_shard(model)
    else:
        wrapper = _wrap(kata, model, group, units, prefetch=prefetch)
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR / 10),
    }[optimizer_name]
    optimizer = make(wrapper.parameters())
    reference = make_transformer(0)
    reference_optimizer = make(reference.parameters())
    taken = _units_of(reference, units)
    first = None  # the first step's gradients: those made from the same weights as one process's
    for step in range(steps):
        optimizer.zero_grad()
        tokens, targets = make_tokens(4, 100 * step + mine)
        transformer_loss(wrapper(tokens), targets).backward()
        if against is None:
            wrapper.finish_gradient_synchronization()
            held = _gradients(wrapper, model) if step == 0 else None
        optimizer.step()
        own = {}
        grads = _one_step_of_reference(reference, tokens, targets, group, size, own)
        if step == 0 and against is None:
            first = {
                "got": held,
                "mean": _as_held(grads, taken, mine, size),
                "own": _as_held(own, taken, mine, size),
            }
        for name, param in reference.named_parameters():
            param.grad = grads[name]
        reference_optimizer.step()
    if against == "fully_shard":
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    else:
        full = wrapper.gather_full_params()
    expected = {n: p.detach().clone() for n, p in reference.named_parameters()}
    return {
        "full": {n: _copy(t) for n, t in full.items()} if isinstance(full, dict) else None,
        "keys": list(full) if isinstance(full, dict) else None,
        "returned": type(full).__name__,
        "expected": expected,
        "units": taken,
        "size": size,
        "world": world_size,
        "first": first,
        # after training: the shards and the replicated parameters themselves, and one
        # process's (to tell a training that went astray from a wrong gather_full_params())
        "last": None if first is None else _gradients(wrapper, model, "data"),
        "last_expected": _as_held(expected, taken, mine, size),
    }


def _copy(value):
    return value.detach().clone() if torch.is_tensor(value) else value


def _as_held(values: dict, taken: dict[str, list[str]], rank: int, size: int) -> dict:
    """Full tensors by the model's names, as the wrapper holds them on ``rank``: each unit's
    piece (by the unit's prefix), and the parameters of no unit whole (by name)."""
    inside = {n for unit in taken.values() for n in unit}
    return {
        "shards": {p: _expected_piece(_unit_flat(values, n), rank, size) for p, n in taken.items()},
        "replicated": {n: v for n, v in values.items() if n not in inside},
    }


def _gradients(wrapper, model, what="grad") -> dict:
    """Each unit's shard's ``grad`` (or ``data``), by the unit's prefix, and each replicated
    parameter's (those the model still holds), by name."""
    return {
        "shards": {u.prefix: _copy(getattr(u.shard, what)) for u in getattr(wrapper, "units", [])},
        "replicated": {n: _copy(getattr(p, what)) for n, p in model.named_parameters()},
    }


def _what_it_holds(mine, mean, own, size, world, group_size) -> str:
    """What a gradient that is not the group's mean holds instead, where that is evident
    (``group_size``: how the code that averages it reads the group's size)."""
    if mine is None:
        return "is None (no gradient reached it)"
    if mine.shape != mean.shape:
        return f"has shape {tuple(mine.shape)}, expected {tuple(mean.shape)}"
    near = functools.partial(torch.allclose, **CLOSE)
    if near(mine, own):
        return "is this rank's own gradient: it was not averaged over the group"
    if near(mine, mean * size):
        return f"is the sum over the group's {size} ranks, not their mean"
    if world != size and near(mine, mean * size / world):
        return (
            f"is the sum over the group's {size} ranks divided by {world}, the whole world's "
            f"size: divide by the group's size, {group_size}, not dist.get_world_size()"
        )
    return f"differs from the group's mean by up to {_gap(mine, mean):.3g}"


def _check_first_gradients(got, rank, where, exact):
    """The first step's gradients, before any update: each shard's and each replicated one's
    against the group's mean of one process's, so a wrong one is named by what holds it."""
    same = torch.equal if exact else functools.partial(torch.allclose, **CLOSE)
    first, size, world = got["first"], got["size"], got["world"]
    mean, own = first["mean"], first["own"]
    for prefix, expected in mean["shards"].items():
        mine = first["got"]["shards"].get(prefix)
        if mine is not None and mine.shape == expected.shape and same(mine, expected):
            continue
        holds = _what_it_holds(
            mine, expected, own["shards"][prefix], size, world, "dist.get_world_size(ctx.group)"
        )
        raise AssertionError(
            f"{where}: after the first backward rank {rank}'s gradient of the shard of "
            f"{_shown(prefix)} {holds}. A shard's gradient is what AllGatherShard.backward "
            "returns: the reduce-scatter of the full gradient on the unit's group, this rank's "
            "piece, divided by that group's size"
        )
    for name, expected in mean["replicated"].items():
        mine = first["got"]["replicated"].get(name)
        if mine is not None and mine.shape == expected.shape and same(mine, expected):
            continue
        holds = _what_it_holds(
            mine,
            expected,
            own["replicated"][name],
            size,
            world,
            "self.world_size (dist.get_world_size(self.process_group))",
        )
        raise AssertionError(
            f"{where}: after the first backward and finish_gradient_synchronization(), rank "
            f"{rank}'s {name}.grad (a replicated parameter, in no unit) {holds}. "
            "finish_gradient_synchronization() must all-reduce its gradient on "
            "self.process_group and divide by the group's size, every rank in the same order"
        )


def _check_keys(got, rank, where):
    names = list(got["expected"])
    if got["keys"] is None:
        raise AssertionError(
            f"{where}: rank {rank}'s gather_full_params() returned a {got['returned']}, expected "
            "a dict of the model's parameter names to their full tensors"
        )
    missing = [n for n in names if n not in got["keys"]]
    extra = [k for k in got["keys"] if k not in names]
    if not missing and not extra:
        return
    for prefix in {k[: -len(n)] for k in extra for n in missing if k.endswith("." + n)}:
        stripped = [k[len(prefix) :] for k in extra if k.startswith(prefix)]
        if sorted(stripped) == sorted(missing) and len(stripped) == len(extra):  # a prefix only
            raise AssertionError(
                f"{where}: rank {rank}'s gather_full_params() has the key {extra[0]!r}: "
                f"{prefix!r} before the model's own name {extra[0][len(prefix) :]!r}. Key each "
                "tensor by the model's own name, as model.named_parameters() gives it (no "
                "wrapper prefix)"
            )
    raise AssertionError(
        f"{where}: rank {rank}'s gather_full_params() lacks {missing[:3]}"
        + ("..." if len(missing) > 3 else "")
        + (f" and has {extra[:3]} besides" if extra else "")
        + ": key every parameter by its name in the model (a unit's prefix, a dot, the "
        "parameter's name in the unit; the replicated ones by their names in self.module)"
    )


def _check_training(results, where, exact):
    same = torch.equal if exact else functools.partial(torch.allclose, **CLOSE)
    for rank, got in enumerate(results):
        if got is None:
            continue
        if got["first"] is not None:
            _check_first_gradients(got, rank, where, exact)
        _check_keys(got, rank, where)
        names = list(got["expected"])
        unit_of = {n: p for p, unit in got["units"].items() for n in unit}
        # the replicated first: each rank updates its own copy, so a wrong one spoils the rest
        for name in sorted(names, key=lambda n: n in unit_of):
            mine, expected = got["full"][name], got["expected"][name]
            if not torch.is_tensor(mine) or mine.shape != expected.shape:
                raise AssertionError(
                    f"{where}: rank {rank}'s gather_full_params()[{name!r}] is "
                    f"{describe(mine)}, expected a tensor of shape {tuple(expected.shape)}: "
                    "cut the gathered vector into the layer's parameters by their shapes "
                    "(padding dropped)"
                )
            if same(mine, expected):
                continue
            raise AssertionError(
                f"{where}: after training, rank {rank}'s gather_full_params()[{name!r}] "
                f"differs from one process's by up to {_gap(mine, expected):.3g}; "
                + _where_it_went_astray(got, name, unit_of.get(name), same)
            )
        if got["keys"] != names:
            first = next(i for i, (a, b) in enumerate(zip(got["keys"], names)) if a != b)
            raise AssertionError(
                f"{where}: rank {rank}'s gather_full_params() holds every parameter, each equal "
                f"to one process's, but in another order: its key {first} is "
                f"{got['keys'][first]!r}, the model's is {names[first]!r}. The kata asks for the "
                "model's own order (self.names, as model.named_parameters() and state_dict() "
                "give it) because a full state dict is also read by position: an optimizer's "
                "state_dict numbers the parameters in that order, and code that pairs the dict "
                "with model.parameters() zips the two. Looked up by name only, your order would "
                "do; here, build the dict in the order of self.names"
            )


def _where_it_went_astray(got, name, prefix, same) -> str:
    """Whether the wrapper's own tensors already differ (the training went astray after a first
    step whose gradients were right) or only gather_full_params()'s copy does."""
    if prefix is None:
        mine, expected = (
            got["last"]["replicated"].get(name),
            got["last_expected"]["replicated"][name],
        )
        what = f"the model's own {name} (a replicated parameter)"
    else:
        mine, expected = got["last"]["shards"].get(prefix), got["last_expected"]["shards"][prefix]
        what = f"the shard of {_shown(prefix)} itself"
    if torch.is_tensor(mine) and mine.shape == expected.shape and same(mine, expected):
        return (
            f"yet {what} equals one process's: gather_full_params() puts it back together "
            "wrong (each unit's gathered vector cut by its parameters' shapes, in the unit's "
            "order, padding dropped; the replicated ones as self.module holds them)"
        )
    return (
        f"{what} differs too, though the first step's gradients were the group's mean: "
        "a later step computed or applied them otherwise"
    )


@pytest.mark.step(5)
@pytest.mark.parametrize(
    "world_size,optimizer",
    [(2, "sgd"), (2, "adamw"), (3, "sgd")],
    ids=["2-sgd", "2-adamw", "3-sgd"],
)
def test_training_equals_one_process(kata, world_size, optimizer):
    results = run_world(_train, world_size, 3, optimizer)
    where = f"FullyShardedModule(TinyTransformer) on {world_size} ranks, 3 {optimizer} steps"
    _check_training(results, where, world_size == 2)


@pytest.mark.step(5)
def test_training_in_a_subgroup(kata):
    results = run_world(_train, 3, 2, "sgd", [1, 2])
    _check_training(results, "FullyShardedModule(process_group=[1, 2]) on 3 ranks", True)


# --------------------------------------------------------------------------- step 6: prefetch, keep


def _where(units, prefetch=True, reshard=True, world=2):
    return (
        f"FullyShardedModule(TinyTransformer, a unit per {units[:-1]}, prefetch={prefetch}, "
        f"reshard_after_forward={reshard}) on {world} ranks"
    )


# What autograd says when a gather launched ahead writes a unit's vector while the forward uses
# it: a saved view found changed, or (landing while it is being saved) a pack hook's input.
_LANDED_MID_FORWARD = ("modified inplace", "pack hook is modifying its input in place")


@pytest.mark.step(6)
@pytest.mark.parametrize("units", ["layers", "blocks"])
def test_prefetch_launches_each_next_gather_ahead(kata, units):
    count = len(_units_of(make_transformer(0), units))
    where = _where(units) + ", the second step"
    try:
        results = run_world(_probe, 2, None, None, True, units, True, True, 2)
    except RankFailed as failure:
        if not any(sign in str(failure) for sign in _LANDED_MID_FORWARD):
            raise
        # the only in-place write to a unit's vector after its views exist: a gather landing
        raise AssertionError(
            f"{where}: autograd found a unit's full vector written after the forward had used "
            "its views: a gather launched ahead landed while the unit ran, because _wait never "
            "waited for it. Call work.wait() on the pending gather before handing its vector "
            "over\n" + str(failure)
        ) from None
    for rank, got in enumerate(results):
        gathers = [c for c in got["forward_calls"] if c["name"] in GATHERS]
        assert len(gathers) == count, (
            f"{where}: rank {rank} made {len(gathers)} all-gathers in forward, expected {count}: "
            "one per unit, the prefetched one in place of the unit's own (_prefetch launches "
            "nothing for a unit gathered already or with a gather pending)"
        )
        starts = [when for _, event, when in got["started"] if event == "start"]
        ends = {prefix: when for prefix, event, when in got["started"] if event == "end"}
        order = [prefix for prefix, event, _ in got["started"] if event == "start"]
        for index, call in enumerate(gathers[1:], start=1):
            before = order[index - 1]
            assert call["async"], (
                f"{where}: rank {rank}'s all-gather of unit {_shown(order[index])} in forward was "
                "made when that unit started, not launched ahead: from the second step on, "
                "every gather but a phase's first comes from _prefetch (all_gather_flat with "
                "async_op=True), launched for the unit that comes next in the last step's order "
                "(_next_unit) while this one runs"
            )
            assert call["done"] is not None, (
                f"{where}: rank {rank} launched unit {_shown(order[index])}'s all-gather ahead "
                "and never waited for it: the vector is filled only once the gather is done, so "
                "_wait calls work.wait() before it hands the vector over"
            )
            assert call["start"] <= ends[before] and call["done"] <= starts[index], (
                f"{where}: rank {rank}'s all-gather of unit {_shown(order[index])} was launched "
                f"after unit {_shown(before)} had run (or waited for after its unit started): "
                "launch the next unit's gather as soon as this one has its vector"
            )
            # Launched ahead is not enough: the gather must travel while the unit before it
            # computes, so its wait comes after that unit started.
            if call["done"] < starts[index - 1]:
                raise AssertionError(
                    f"{where}: rank {rank} launched unit {_shown(order[index])}'s all-gather "
                    f"ahead, but waited for it at once, before unit {_shown(before)} started "
                    "computing: nothing overlapped, the rank still sat idle while the bytes "
                    "travelled. _prefetch only launches (async_op=True) and keeps the handle in "
                    "unit.pending; the wait belongs in _wait, when the unit needs its vector"
                )
        backward = [c for c in got["backward_calls"] if c["name"] in GATHERS]
        assert len(backward) >= count - 1, (
            f"{where}: rank {rank} made {len(backward)} all-gathers in backward, expected "
            f"{count - 1}, as without prefetch: a unit used a vector gathered before, for its "
            "forward (unit.pending still set after _wait handed it over). _wait must clear it "
            "(unit.pending = None), so that backward gathers the unit again"
        )
        on_the_spot = [c for c in backward if not c["async"]]
        first = "none: the model's unit, kept, is first" if units == "blocks" else "the first"
        assert len(on_the_spot) == (0 if units == "blocks" else 1), (
            f"{where}: rank {rank} made {len(on_the_spot)} of its {len(backward)} all-gathers "
            f"in backward on the spot, expected {first} only: backward runs the units the other "
            "way round, and _next_unit follows the order the last step's backward gathered "
            "them in (self._order['backward'] when self._phase is 'backward'), not the forward's"
        )
        unwaited = [c for c in backward if c["async"] and c["done"] is None]
        assert not unwaited, (
            f"{where}: rank {rank} launched {len(unwaited)} all-gather(s) ahead in backward and "
            "never waited for them: _wait calls work.wait() before it hands the vector over"
        )
        assert len(backward) == count - 1 and not got["pending"], (
            f"{where}: rank {rank} made {len(backward)} all-gathers in backward, expected "
            f"{count - 1}, and left a gather pending for {got['pending'][:3]}: a prefetch "
            "launched for a unit that did not come next (_next_unit: the unit after this one in "
            "self._order[self._phase]), or _wait did not clear unit.pending"
        )
    _check_outputs_and_grads(results, where, True)


@pytest.mark.step(6)
@pytest.mark.parametrize("units", ["layers", "blocks"])
def test_prefetch_holds_two_units_at_most(kata, units):
    results = run_world(_probe, 2, None, None, True, units, True, True, 2)
    sizes = _unit_bytes(make_transformer(0), units, 2)
    two = sorted((v for p, v in sizes.items() if p), reverse=True)[:2]
    allowed = sum(two) + sizes.get("", 0)
    whose = "the two largest layers'" if units == "layers" else "the model's unit's and 2 blocks'"
    for rank, got in enumerate(results):
        assert got["peak"] <= allowed, (
            f"{_where(units)}: rank {rank} held {got['peak']:,} bytes of full weights at once "
            f"(at {got['peak_where']}), more than {whose} {allowed:,}: prefetch gathers one unit "
            "ahead, the next one only (and _wait's vector is the unit's own, not a copy)"
        )
        assert got["left"] == 0, (
            f"{_where(units)}: after backward rank {rank} still holds {got['left']:,} bytes of "
            "full weights: a unit's prefetched vector becomes unit.full and goes with it"
        )


@pytest.mark.step(6)
@pytest.mark.parametrize("units", ["layers", "blocks"])
def test_reshard_after_forward_off_keeps_every_unit_until_backward(kata, units):
    results = run_world(_probe, 2, None, None, True, units, True, False, 2)
    count = len(_units_of(make_transformer(0), units))
    every = sum(_unit_bytes(make_transformer(0), units, 2).values())
    where = _where(units, True, False)
    for rank, got in enumerate(results):
        backward = [c for c in got["backward"] if c in GATHERS]
        assert not backward, (
            f"{where}: rank {rank} made {len(backward)} all-gathers in backward, expected none: "
            "with reshard_after_forward off, _keep leaves each unit's full vector gathered "
            "(unit.full, its storage in self._live: no self._reshard) for backward's notes, and "
            "_prefetch launches nothing for a unit gathered already"
        )
        scatters = [c for c in got["backward"] if c in SCATTERS]
        assert len(scatters) == count, (
            f"{where}: rank {rank}'s backward made {len(scatters)} reduce-scatters, expected "
            f"{count}: one per unit, as with resharding"
        )
        assert got["peak_forward"] >= every, (
            f"{where}: at the end of forward rank {rank} held {got['peak_forward']:,} bytes of "
            f"full weights, expected every unit's, {every:,}: kept until backward"
        )
        assert got["left"] == 0, (
            f"{where}: after backward rank {rank} still holds {got['left']:,} bytes of full "
            "weights: _keep sets the modules' attributes back to None as _after_forward does "
            "(the vector stays only in unit.full, which _after_backward lets go)"
        )
    _check_outputs_and_grads(results, where, True)


@pytest.mark.step(6)
def test_prefetch_in_a_subgroup(kata):
    try:
        results = run_world(_train, 3, 3, "sgd", [1, 2], None, "blocks", True)
    except (RankFailed, WorldDeadlock) as failure:  # a gather on the world waits for rank 0
        raise AssertionError(
            f"{_where('blocks', world=3)}, process_group=[1, 2]: a rank failed. Every collective "
            "of the wrapper runs on self.process_group, the prefetched gathers too (a vector of "
            "len(shard) * self.world_size, the group's size)\n" + str(failure)
        ) from None
    _check_training(results, f"{_where('blocks', world=3)}, process_group=[1, 2], 3 steps", True)


@pytest.mark.step(6)
def test_against_torchs_fully_shard(kata):
    fsdp = pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    ours = run_world(_train, 2, 3, "sgd", None, None, "blocks", True)
    theirs = run_world(_train, 2, 3, "sgd", None, "fully_shard")
    # Bitwise: on 2 ranks fully_shard (gloo has no AVG) divides each gradient by 2 before its
    # reduce-scatter, a / 2 + b / 2, and we divide after, (a + b) / 2: both exact, the same
    # number (but for a gradient below 2^-125, where halving rounds: none here). Its units are
    # ours (a block each, the model the rest), the elementwise SGD the same numbers.
    for rank in range(2):
        for name, expected in theirs[rank]["full"].items():
            mine = ours[rank]["full"][name]
            assert torch.equal(mine, expected), (
                f"{_where('blocks')}, 3 SGD steps: rank {rank}'s {name} differs from torch's "
                f"fully_shard (a block each and the model) by up to {_gap(mine, expected):.3g}; "
                "they must be bitwise equal, as each is to one process"
            )


@pytest.mark.step(6)
def test_program_trains_like_one_process(kata):
    out = run_module_ok(KATA, "--world-size", "2", "--steps", "2").stdout
    assert "3 all-gathers in forward, 2 in backward, 3 reduce-scatters" in out, out
    assert "(bitwise equal)" in out, out


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    kata = load_kata(KATA)
    device = rank_gpu()
    model, reference = make_transformer(0).to(device), make_transformer(0).to(device)
    wrapper = kata.FullyShardedModule(model, compute_dtype=torch.bfloat16, prefetch=False)
    tokens, targets = (t.to(device) for t in make_tokens(4, rank))
    transformer_loss(wrapper(tokens), targets).backward()
    wrapper.finish_gradient_synchronization()
    with torch.no_grad():
        expected = reference(tokens)
        got = wrapper(tokens)
    shards = {str(p.device) for p in wrapper.parameters()}
    return shards, _gap(got.float().cpu(), expected.cpu())


def _check_cuda(results):
    for rank, (devices, gap) in enumerate(results):
        assert all(d.startswith("cuda") for d in devices), f"rank {rank}'s shards are on {devices}"
        assert gap < 0.1, f"rank {rank}: bfloat16 output off by {gap:.3g} on CUDA"


@pytest.mark.step(4)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    _check_cuda(run_world(_on_cuda, 1, **on_cuda(1, "nccl")))


@pytest.mark.step(4)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    _check_cuda(run_world(_on_cuda, 2, **on_cuda(2, "gloo")))
