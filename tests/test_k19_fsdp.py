"""k19 FSDP: shard_of, then FullyShardedModule's sharding, gather, hooks, finish and full params."""

from __future__ import annotations

import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dojo.calls import recording
from dojo.impl import load_kata
from dojo.testing import refusal, require_gpus, run_program
from dojo.toy_models import make_tokens, make_transformer, transformer_loss
from dojo.world import RankFailed, run_world

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
    collective's tensors a moment after the call returns: when more than one watched storage is
    alive, the measure waits a little (1 s in all per watch) for such stragglers to go."""

    def __init__(self):
        self.storages: dict[int, tuple] = {}
        self.peak, self.where = 0, ""
        self.patience = 1.0

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

    def measure(self, where: str):
        alive = self._alive()
        while len(alive) > 1 and self.patience > 0:
            time.sleep(0.005)
            self.patience -= 0.005
            alive = self._alive()
        if sum(alive) > self.peak:
            self.peak, self.where = sum(alive), where


def _watching(watch: _Watch, dtypes: list):
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
            watch.measure("an all-gather")
            return result

        for module in (c10d, dist):
            setattr(module, name, watched)
    return originals


def _restore(originals):
    import torch.distributed.distributed_c10d as c10d

    for name, original in originals.items():
        for module in (c10d, dist):
            setattr(module, name, original)


def _one_step_of_reference(reference, tokens, targets, group, size):
    """The unsharded model's gradients, averaged over the group (the test's own all-reduce)."""
    reference.zero_grad()
    transformer_loss(reference(tokens), targets).backward()
    grads = {}
    for name, param in reference.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        grads[name] = grad / size
    return grads


def _probe(rank, world_size, members=None, compute_dtype=None, run=True):
    """One forward and backward through the wrapper, watched: what was sharded, what was
    gathered, what came out."""
    kata = load_kata(KATA)
    group = _group(rank, members)
    if group == "outside":
        return None
    size = dist.get_world_size(group)
    model, reference = make_transformer(0), make_transformer(0)
    layers = _sharded_layers(model)
    wrapper = kata.FullyShardedModule(model, compute_dtype=compute_dtype, process_group=group)
    report = {
        "own_params": {
            n: [k for k, _ in m.named_parameters(recurse=False)] for n, m in layers.items()
        },
        "wrapper_params": [
            (tuple(p.shape), p.dtype, p.requires_grad) for p in wrapper.parameters()
        ],
        "model_params": sorted(n for n, _ in model.named_parameters()),
        "shards": {u.prefix: u.shard.detach().clone() for u in getattr(wrapper, "units", [])},
        "group_rank": dist.get_rank(group),
    }
    if not run:  # the sharding alone (step 2)
        return report
    watch, dtypes, weight_dtypes = _Watch(), [], []

    def look(name):
        def hook(module, args):
            for attribute in ("weight", "bias"):
                value = getattr(module, attribute, None)
                if torch.is_tensor(value):
                    watch.track(value)
                    weight_dtypes.append(value.dtype)
            watch.measure(f"{name}'s forward")

        return hook

    for name, layer in layers.items():  # after the wrapper's own hooks: sees the gathered weights
        layer.register_forward_pre_hook(look(name))
    tokens, targets = make_tokens(4, 10 + dist.get_rank(group))
    originals = _watching(watch, dtypes)
    try:
        with recording() as forward_calls:
            output = wrapper(tokens)
            loss = transformer_loss(output, targets)
        with recording() as backward_calls:
            loss.backward()
    finally:
        _restore(originals)
    expected = _one_step_of_reference(reference, tokens, targets, group, size)
    with torch.no_grad():
        expected_output = reference(tokens)
    report.update(
        {
            "output": output.detach().clone(),
            "output_dtype": output.dtype,
            "expected_output": expected_output,
            "forward": [c.name for c in forward_calls],
            "backward": [c.name for c in backward_calls],
            "peak": watch.peak,
            "peak_where": watch.where,
            "gathered_dtypes": sorted({str(d) for d in dtypes}),
            "weight_dtypes": sorted({str(d) for d in weight_dtypes}),
            "shard_grads": {
                u.prefix: None if u.shard.grad is None else u.shard.grad.clone()
                for u in getattr(wrapper, "units", [])
            },
            "shard_dtypes": sorted({str(p.dtype) for p in wrapper.parameters()}),
            "expected_grads": {
                name: _expected_piece(
                    torch.cat(
                        [expected[f"{name}.{k}"].reshape(-1) for k, _ in layer_params(layer)]
                    ),
                    dist.get_rank(group),
                    size,
                )
                for name, layer in _sharded_layers(reference).items()
            },
            "largest": max(
                -(-sum(p.numel() for p in m.parameters(recurse=False)) // size) * size
                for m in _sharded_layers(reference).values()
            ),
        }
    )
    return report


def layer_params(layer):
    return list(layer.named_parameters(recurse=False))


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


def _check_sharding(results, world_size, members):
    model = make_transformer(0)
    layers = _sharded_layers(model)
    ranks = members or list(range(world_size))
    size = len(ranks)
    where = f"FullyShardedModule(TinyTransformer) on {world_size} ranks" + (
        f", the group {members}" if members else ""
    )
    replicated = [p for name, p in model.named_parameters() if name.rsplit(".", 1)[0] not in layers]
    for position, rank in enumerate(ranks):
        got = results[rank]
        kept = {n: own for n, own in got["own_params"].items() if own}
        assert not kept, (
            f"{where}: after sharding, rank {rank}'s layers still have parameters of their own "
            f"({', '.join(f'{n}.{k[0]}' for n, k in list(kept.items())[:3])}): remove them from "
            "the layer (delattr), so that only the shards (and the replicated parameters) are "
            "parameters"
        )
        missing = sorted(set(layers) - set(got["shards"]))
        assert not missing, (
            f"{where}: rank {rank} has no ShardedLayer for {', '.join(missing[:4])}: every layer "
            "of shard_types with parameters of its own gets one, with its name in the model as "
            "prefix"
        )
        for name, layer in layers.items():
            shard = got["shards"][name]
            expected = _expected_piece(_flat_of(layer), position, size)
            if shard.shape != expected.shape:
                raise AssertionError(
                    f"{where}: rank {rank}'s shard of {name} has {shard.numel()} element(s), "
                    f"expected {expected.numel()} (its {_flat_of(layer).numel()} elements, weight "
                    f"then bias, padded to a multiple of {size}, then 1/{size}): every piece has "
                    "the same length, so pad the flat vector with zeros first"
                )
            if not torch.equal(shard, expected):
                which = next(
                    (
                        r
                        for r in range(world_size)
                        if torch.equal(shard, _expected_piece(_flat_of(layer), r, size))
                    ),
                    None,
                )
                hint = (
                    f"it holds piece {which}: keep the piece of the rank in the group, "
                    "dist.get_rank(process_group), not the rank in the whole world"
                    if which is not None
                    else "expected this rank's piece of the layer's parameters laid end to end "
                    "(weight, then bias), padded"
                )
                raise AssertionError(f"{where}: rank {rank}'s shard of {name} is wrong: {hint}")
        shapes = [shape for shape, _, _ in got["wrapper_params"]]
        expected_count = len(layers) + len(replicated)
        assert len(shapes) == expected_count, (
            f"{where}: rank {rank}'s wrapper.parameters() yields {len(shapes)} tensors, expected "
            f"{expected_count}: one shard per sharded layer plus the {len(replicated)} replicated "
            "parameters (the LayerNorms). Register each shard as a parameter of the wrapper "
            "(self.shards, an nn.ParameterList) and keep no full copy as a parameter"
        )
        for shape, dtype, trainable in got["wrapper_params"]:
            assert dtype == torch.float32 and trainable, (
                f"{where}: rank {rank}'s wrapper has a parameter of shape {shape}, {dtype}, "
                f"requires_grad={trainable}: shards are fp32 parameters the optimizer trains"
            )


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
        assert torch.equal(grad, expected_grad), (
            f"{where}: rank {rank}'s shard gradient is {grad.tolist()}, expected the mean of its "
            f"piece over the ranks, {expected_grad.tolist()}"
        )


# --------------------------------------------------------------------------- step 4: the hooks


def _check_outputs_and_grads(results, where, exact):
    for rank, got in enumerate(results):
        if got is None:
            continue
        same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, **CLOSE))
        assert same(got["output"], got["expected_output"]), (
            f"{where}: rank {rank}'s output differs from the unsharded model's by up to "
            f"{_gap(got['output'], got['expected_output']):.3g}: before each layer runs, its "
            "weight and bias must be the full ones (views of the gathered vector, in order)"
        )
        for name, expected in got["expected_grads"].items():
            grad = got["shard_grads"].get(name)
            assert grad is not None, (
                f"{where}: after backward rank {rank}'s shard of {name} has no gradient: the "
                "layer's weights must come from AllGatherShard.apply(shard, ...) so that autograd "
                "carries their gradient back to the shard"
            )
            assert same(grad, expected), (
                f"{where}: rank {rank}'s shard gradient of {name} differs from the mean of the "
                f"unsharded model's gradients (that piece) by up to {_gap(grad, expected):.3g}"
            )


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [2, 3])
def test_forward_and_shard_gradients_equal_the_unsharded_model(kata, world_size):
    results = run_world(_probe, world_size)
    _check_outputs_and_grads(
        results, f"FullyShardedModule(TinyTransformer) on {world_size} ranks", world_size == 2
    )


@pytest.mark.step(4)
def test_one_gather_per_layer_in_forward_and_again_in_backward(kata):
    results = run_world(_probe, 2)
    layers = len(_sharded_layers(make_transformer(0)))
    where = "FullyShardedModule(TinyTransformer) on 2 ranks, one forward and backward"
    for rank, got in enumerate(results):
        forward = [c for c in got["forward"] if c in GATHERS]
        backward = [c for c in got["backward"] if c in GATHERS]
        scatters = [c for c in got["backward"] if c in SCATTERS]
        assert len(forward) == layers, (
            f"{where}: rank {rank} made {len(forward)} all-gathers in forward, expected {layers}: "
            "one per sharded layer, just before it runs"
        )
        if not backward:
            raise AssertionError(
                f"{where}: rank {rank} gathered nothing in backward: autograd kept forward's full "
                "weights alive until backward (a linear layer saves its weight). Gather only in "
                "forward is not enough: in _pack turn a view of a gathered layer into a note, and "
                "in _unpack gather that layer again"
            )
        assert len(backward) == layers - 1, (
            f"{where}: rank {rank} made {len(backward)} all-gathers in backward, expected "
            f"{layers - 1}: one per layer whose backward needs its weights (the embedding's "
            "needs only the token ids), one gather per note unpacked"
        )
        assert len(scatters) == layers and "all_reduce" not in got["backward"], (
            f"{where}: rank {rank}'s backward made {len(scatters)} reduce-scatter(s) and "
            f"{got['backward'].count('all_reduce')} all-reduce(s), expected {layers} "
            "reduce-scatters: one per sharded layer (the replicated parameters are averaged "
            "in finish_gradient_synchronization, after backward)"
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [2, 3])
def test_full_weights_alive_at_once_are_one_layers(kata, world_size):
    results = run_world(_probe, world_size)
    for rank, got in enumerate(results):
        largest = got["largest"] * 4
        assert got["peak"] <= largest, (
            f"FullyShardedModule(TinyTransformer) on {world_size} ranks: rank {rank} held "
            f"{got['peak']:,} bytes of full weights at once (at {got['peak_where']}), more than "
            f"the largest layer's {largest:,}: full weights must be freed after use. After a "
            "layer's forward drop every reference to them (the layer's attributes back to None, "
            "and autograd must not keep them: _pack saves a note instead); in backward the "
            "weights gathered again live only while that layer's gradients are computed"
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


def _train(rank, world_size, steps, optimizer_name, members=None, against=None):
    kata = load_kata(KATA)
    group = _group(rank, members)
    if group == "outside":
        return None
    size, mine = dist.get_world_size(group), dist.get_rank(group)
    model = make_transformer(0)
    if against == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        for layer in _sharded_layers(model).values():
            fully_shard(layer)
        wrapper = fully_shard(model)
    else:
        wrapper = kata.FullyShardedModule(model, process_group=group)
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR / 10),
    }[optimizer_name]
    optimizer = make(wrapper.parameters())
    reference = make_transformer(0)
    reference_optimizer = make(reference.parameters())
    with recording() as calls:
        for step in range(steps):
            optimizer.zero_grad()
            tokens, targets = make_tokens(4, 100 * step + mine)
            transformer_loss(wrapper(tokens), targets).backward()
            if against is None:
                wrapper.finish_gradient_synchronization()
            optimizer.step()
            grads = _one_step_of_reference(reference, tokens, targets, group, size)
            for name, param in reference.named_parameters():
                param.grad = grads[name]
            reference_optimizer.step()
    if against == "fully_shard":
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    else:
        full = wrapper.gather_full_params()
    return {
        "full": {n: t.detach().clone() for n, t in full.items()},
        "keys": list(full),
        "expected": {n: p.detach().clone() for n, p in reference.named_parameters()},
        "finish_calls": [c.name for c in calls],
    }


def _check_training(results, where, exact):
    for rank, got in enumerate(results):
        if got is None:
            continue
        names = list(got["expected"])
        names_first = [n for n in names if "norm" in n] + [n for n in names if "norm" not in n]
        assert got["keys"] == names, (
            f"{where}: rank {rank}'s gather_full_params() has the keys {got['keys'][:3]}..., "
            f"expected the model's own names in its order, {names[:3]}...: key each tensor by "
            "the layer's name in the model and the parameter's (no wrapper prefix such as "
            "'module.'), the replicated ones by their names in self.module"
        )
        for name in names_first:  # the replicated first: a wrong one spoils the rest
            mine, expected = got["full"][name], got["expected"][name]
            assert mine.shape == expected.shape, (
                f"{where}: rank {rank}'s gather_full_params()[{name!r}] has shape "
                f"{tuple(mine.shape)}, expected {tuple(expected.shape)}: cut the gathered vector "
                "into the layer's parameters by their shapes (padding dropped)"
            )
            same = torch.equal(mine, expected) if exact else torch.allclose(mine, expected, **CLOSE)
            if not same:
                replicated = "norm" in name
                hint = (
                    "a replicated parameter (a LayerNorm's): finish_gradient_synchronization() "
                    "must all-reduce its gradient and divide by the group's size, every rank in "
                    "the same order"
                    if replicated
                    else "a sharded layer's: check the reduce-scattered mean and the full "
                    "parameters gather_full_params() puts back together (padding dropped)"
                )
                raise AssertionError(
                    f"{where}: after training, rank {rank}'s {name} differs from one process by "
                    f"up to {_gap(mine, expected):.3g}; it is {hint}"
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


@pytest.mark.step(5)
def test_against_torchs_fully_shard(kata):
    fsdp = pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    ours = run_world(_train, 2, 3, "sgd")
    theirs = run_world(_train, 2, 3, "sgd", None, "fully_shard")
    # fully_shard divides its reduce-scatter in its own way (and flattens differently): a few
    # ulps apart from one process, so the comparison allows a tolerance
    for rank in range(2):
        for name, expected in theirs[rank]["full"].items():
            mine = ours[rank]["full"][name]
            assert torch.allclose(mine, expected, **CLOSE), (
                f"after 3 SGD steps on 2 ranks rank {rank}'s {name} differs from torch's "
                f"fully_shard by up to {_gap(mine, expected):.3g}"
            )


@pytest.mark.step(5)
def test_program_trains_like_one_process(kata):
    done = run_program(KATA, "--world-size", "2", "--steps", "2", timeout=120)
    out = done.stdout
    assert done.returncode == 0, (
        f"`python -m {KATA} --world-size 2 --steps 2` exited with {done.returncode}:\n{out}\n"
        f"{done.stderr}"
    )
    assert "14 all-gathers in forward, 13 in backward" in out, out
    assert "(bitwise equal)" in out, out


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    kata = load_kata(KATA)
    from dojo.devices import rank_device

    device = rank_device()
    torch.cuda.set_device(device)
    model, reference = make_transformer(0).to(device), make_transformer(0).to(device)
    wrapper = kata.FullyShardedModule(model, compute_dtype=torch.bfloat16)
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
    require_gpus(1)
    _check_cuda(run_world(_on_cuda, 1, backend="nccl", env={"DOJO_DEVICE": "cuda"}, deadline=60))


@pytest.mark.step(4)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    require_gpus(1)
    _check_cuda(run_world(_on_cuda, 2, backend="gloo", env={"DOJO_DEVICE": "cuda"}, deadline=60))
