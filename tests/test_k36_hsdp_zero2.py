"""k36 HSDP and ZeRO-2: the two groups of a 2-D mesh, HSDP's gather in the row and its
reduce-scatter-then-all-reduce (held against torch's fully_shard on a (replicate, shard) mesh,
the whole state), ZeRO-2's sharded gradients and optimizer state, and its bytes by the formula."""

from __future__ import annotations

import copy

import pytest
import torch

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec import collectives, meshes
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.states import close, gap
from dojo.spec.testing import refusal, run_module_ok, shared_run
from dojo.toy_models import make_tokens, make_transformer, transformer_loss

KATA = "k36_hsdp_zero2"

MESHES = ((2, 2), (1, 4), (4, 1))  # (replicate, shard) on 4 ranks
STEPS, LR = 2, 0.1
# HSDP and one process add the same numbers in other orders: close, not bitwise.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# ZeRO-2's AdamW. eps=1e-3: gloo's reduce-scatter and all-reduce add 4 ranks' numbers in
# different orders, and with a tiny eps Adam's first step turns a near-zero gradient's last
# bit into a whole step of lr.
ADAMW = {"lr": 0.01, "eps": 1e-3, "weight_decay": 0.01}
ZERO_STEPS = 3


GRID = meshes.Grid(
    "HsdpMesh",
    outer="replicate",
    inner="shard",
    row="the pieces of one copy",
    column="the copies of its piece",
)
_calls = GRID.kinds


# --------------------------------------------------------------------------- step 1: the mesh


def _meshes(rank, world_size):
    return GRID.facts(load_kata(KATA), rank, MESHES)


@shared_run
def _mesh_world():
    return run_world(_meshes, 4, deadline=60)


@pytest.mark.step(1)
@pytest.mark.parametrize("replicate,shard", MESHES)
def test_mesh_groups_are_rows_and_columns(kata, replicate, shard):
    GRID.check_groups([result[(replicate, shard)] for result in _mesh_world()], replicate, shard)


@pytest.mark.step(1)
def test_a_mesh_that_does_not_fit_is_refused(kata):
    GRID.check_refusals(_mesh_world()[0]["refused"])


# --------------------------------------------------------------------------- step 2: HSDP


def _hsdp_collectives(rank, world_size):
    kata = load_kata(KATA)
    out = {}
    for replicate, shard in MESHES:
        mesh = kata.make_mesh(replicate, shard)
        mine = torch.tensor([10.0 * rank, 10.0 * rank + 1])
        with recording() as gathered:
            full = kata.gather_params(mine, mesh)
        grad = torch.arange(2.0 * shard) + 100.0 * rank  # 2 elements a piece
        before = grad.clone()
        with recording() as reduced:
            piece = kata.reduce_gradient(grad, mesh)
        out[(replicate, shard)] = {
            "mesh": (mesh.replicate_index, mesh.shard_index),
            "full": full.detach().clone(),
            "piece": piece.detach().clone(),
            "kept": torch.equal(grad, before),
            "gather calls": _calls(gathered, mesh),
            "reduce calls": _calls(reduced, mesh),
            "reduce bytes": [c.bytes for c in reduced if c.name != "new_group"],
        }
    return out


@shared_run
def _collectives_world():
    return run_world(_hsdp_collectives, 4, deadline=60)


@pytest.mark.step(2)
@pytest.mark.parametrize("replicate,shard", MESHES)
def test_gather_params_gathers_this_rank_s_row(kata, replicate, shard):
    for rank, result in enumerate(_collectives_world()):
        got = result[(replicate, shard)]
        r, _ = got["mesh"]
        row = list(range(r * shard, (r + 1) * shard))
        want = torch.tensor([v for peer in row for v in (10.0 * peer, 10.0 * peer + 1)])
        assert got["gather calls"] == [("all-gather", "shard")], (
            f"rank {rank} of a {replicate} x {shard} mesh: gather_params called "
            f"{got['gather calls'] or 'nothing'}: expected one all-gather on mesh.shard_group. "
            "The row holds the pieces of one copy; the column (replicate group) holds copies of "
            "the same piece"
        )
        assert torch.equal(got["full"], want), (
            f"rank {rank} of a {replicate} x {shard} mesh: gather_params gave "
            f"{got['full'].tolist()}, expected the shards of its row {row} end to end, "
            f"{want.tolist()}"
        )


@pytest.mark.step(2)
@pytest.mark.parametrize("replicate,shard", MESHES)
def test_reduce_gradient_is_the_world_s_mean_of_this_piece(kata, replicate, shard):
    for rank, result in enumerate(_collectives_world()):
        got = result[(replicate, shard)]
        r, s = got["mesh"]
        total = sum(torch.arange(2.0 * shard) + 100.0 * peer for peer in range(4))
        piece = total[2 * s : 2 * s + 2]
        row = sum(torch.arange(2.0 * shard) + 100.0 * p for p in range(r * shard, (r + 1) * shard))
        mine = got["piece"]
        where = f"rank {rank} of a {replicate} x {shard} mesh"
        if mine.shape == piece.shape and not torch.allclose(mine, piece / 4):
            wrong = {
                "the SUM over the world: divide by the world size (replicate x shard = 4)": piece,
                f"the sum divided by shard ({shard}) only: divide by replicate x shard, every "
                "rank's gradient counts once": piece / shard,
                f"the sum divided by replicate ({replicate}) only: divide by replicate x shard": (
                    piece / replicate
                ),
                "the mean of this ROW only: all-reduce the piece on mesh.replicate_group too, "
                "the other copies read other data": row[2 * s : 2 * s + 2] / shard,
                "the row's sum, unreduced across the copies: all-reduce the piece on "
                "mesh.replicate_group, then divide by the world size": row[2 * s : 2 * s + 2],
            }
            why = next((w for w, t in wrong.items() if torch.allclose(mine, t)), None)
            if why is not None:
                raise AssertionError(
                    f"{where}: reduce_gradient gave {mine.tolist()}, expected piece {s} of the "
                    f"mean over all 4 ranks, {(piece / 4).tolist()}: that is {why}"
                )
        assert close(mine, piece / 4), (
            f"{where}: reduce_gradient gave {mine.tolist()}, expected piece {s} (shard_index) of "
            f"the mean over all 4 ranks, {(piece / 4).tolist()} ({gap(mine, piece / 4)})"
        )
        assert got["kept"], (
            f"{where}: reduce_gradient changed the full_grad it was given: return a new tensor "
            "(autograd's gradient may be used again)"
        )


@pytest.mark.step(2)
@pytest.mark.parametrize("replicate,shard", MESHES)
def test_reduce_gradient_reduces_in_the_row_first(kata, replicate, shard):
    for rank, result in enumerate(_collectives_world()):
        got = result[(replicate, shard)]
        calls = got["reduce calls"]
        expected = [("reduce-scatter", "shard"), ("all-reduce", "replicate")]
        assert calls == expected, (
            f"rank {rank} of a {replicate} x {shard} mesh: reduce_gradient called "
            f"{calls or 'nothing'}, expected {expected}. The kata's rule (HSDP's, torch's): "
            "reduce-scatter on the shard group FIRST, then all-reduce the piece on the replicate "
            "group. All-reducing the whole gradient across the copies first is as correct and "
            f"sends {shard} times the bytes over the replicate link, the slow one between "
            "machines"
        )
        piece_bytes = 2 * 4  # 2 fp32 elements a piece
        assert got["reduce bytes"][1] == piece_bytes, (
            f"rank {rank} of a {replicate} x {shard} mesh: the all-reduce on the replicate group "
            f"carried {got['reduce bytes'][1]} bytes, expected one piece, {piece_bytes}: "
            "all-reduce the reduce-scatter's output, not the whole gradient"
        )


def _train(model, rank: int | None = None, device="cpu", sequences: int = 8):
    """``model`` after STEPS SGD steps on ``sequences`` sequences a step: all of them, or rank
    ``rank``'s 2 (each rank its own data, all different)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        tokens, targets = (t.to(device) for t in make_tokens(sequences, 70 + step))
        if rank is not None:
            part = slice(2 * rank, 2 * rank + 2)
            tokens, targets = tokens[part], targets[part]
        transformer_loss(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _torch_hsdp(dense, device_mesh):
    from torch.distributed.fsdp import fully_shard

    theirs = copy.deepcopy(dense)
    for block in theirs.blocks:
        fully_shard(block, mesh=device_mesh)
    fully_shard(theirs, mesh=device_mesh)
    return theirs


def _training(rank, world_size):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    # FSDP2 warns that the model returns a view (the logits' reshape): nothing writes into it
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    kata = load_kata(KATA)
    out = {}
    for replicate, shard in MESHES:
        mesh = kata.make_mesh(replicate, shard)
        dense = make_transformer(11)
        model = kata.HsdpTransformer(dense, mesh)
        alone = copy.deepcopy(dense)
        theirs = None
        if (replicate, shard) == (2, 2):
            device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            theirs = _train(_torch_hsdp(dense, device_mesh), rank)
        _train(model, rank)
        _train(alone)
        # torch's whole state first, then the kata's gathers
        their_state = None
        if theirs is not None:
            their_state = {
                n: p.full_tensor().detach().clone() for n, p in theirs.named_parameters()
            }
        out[(replicate, shard)] = {
            "state": kata.full_state(model),
            "alone": {n: p.detach().clone() for n, p in alone.named_parameters()},
            "theirs": their_state,
        }
    return out


@shared_run
def _training_world():
    return run_world(_training, 4, deadline=120)


@pytest.mark.step(2)
@pytest.mark.parametrize("replicate,shard", MESHES)
def test_hsdp_training_equals_one_process(kata, replicate, shard):
    for rank, result in enumerate(_training_world()):
        got = result[(replicate, shard)]
        for name, want in got["alone"].items():
            mine = got["state"].get(name)
            assert close(mine, want, **TOLERANCE), (
                f"rank {rank} of a {replicate} x {shard} mesh: after {STEPS} SGD steps of "
                f"HsdpTransformer (each rank 2 of the 8 sequences) {name} differs from one process "
                f"trained on all 8: {gap(mine, want)}. Each shard's gradient must be the mean "
                "over ALL the world's ranks: reduce-scatter in the row, all-reduce across the "
                "copies, divide by replicate x shard"
            )


@pytest.mark.step(2)
def test_against_torchs_fully_shard_on_a_replicate_shard_mesh(kata):
    for rank, result in enumerate(_training_world()):
        got = result[(2, 2)]
        for name, want in got["theirs"].items():
            mine = got["state"].get(name)
            assert close(mine, want, **TOLERANCE), (
                f"rank {rank}: after {STEPS} SGD steps {name} differs from torch's fully_shard "
                "on init_device_mesh('cpu', (2, 2), mesh_dim_names=('replicate', 'shard')) (HSDP: "
                f"Replicate() x Shard(0)) trained on the same 4 ranks and data: {gap(mine, want)}"
            )


# --------------------------------------------------------------------------- step 3: ZeRO-2


def _zero2_steps(rank, world_size, device="cpu"):
    """ZERO_STEPS AdamW steps of the kata's Zero2Optimizer beside unsharded AdamW on the mean
    gradient (each rank its own data): the model, the optimizer and what each step did."""
    import torch.distributed as dist

    kata = load_kata(KATA)
    model, plain = make_transformer(13).to(device), make_transformer(13).to(device)
    optimizer = kata.Zero2Optimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    reference = torch.optim.AdamW(plain.parameters(), **ADAMW)
    steps = []
    for step in range(ZERO_STEPS):
        tokens, targets = (t.to(device) for t in make_tokens(2, 500 + 10 * step + rank))
        for net in (model, plain):
            transformer_loss(net(tokens), targets).backward()
        with recording() as calls:
            optimizer.step()
        grads_left = [n for n, p in model.named_parameters() if p.grad is not None]
        shard_grad = optimizer.shard.grad
        for p in plain.parameters():  # unsharded AdamW on the mean gradient
            dist.all_reduce(p.grad)
            p.grad /= world_size
        reference.step()
        reference.zero_grad(set_to_none=True)
        steps.append(
            {
                "calls": [
                    (collectives.kind(c.name), collectives.which_group(c.group, None))
                    for c in calls
                ],
                "grads left": grads_left,
                "shard grad": None if shard_grad is None else tuple(shard_grad.shape),
                "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
                "expected": {n: p.detach().cpu().clone() for n, p in plain.named_parameters()},
            }
        )
        optimizer.zero_grad()
    return model, optimizer, steps


def _zero2(rank, world_size):
    model, optimizer, steps = _zero2_steps(rank, world_size)
    for p in model.parameters():  # one more backward: held_bytes after a step, as training does
        p.grad = None
    tokens, targets = make_tokens(2, 900 + rank)
    transformer_loss(model(tokens), targets).backward()
    optimizer.step()
    return {
        "steps": steps,
        "shard": tuple(optimizer.shard.shape),
        "numel": sum(p.numel() for p in model.parameters()),
        "held": optimizer.held_bytes(),
    }


@shared_run
def _zero2_world():
    return run_world(_zero2, 4, deadline=90)


@pytest.mark.step(3)
def test_zero2_calls_one_reduce_scatter_and_one_all_gather_a_step(kata):
    for rank, result in enumerate(_zero2_world()):
        for step, got in enumerate(result["steps"]):
            calls = got["calls"]
            expected = [("reduce-scatter", "the group"), ("all-gather", "the group")]
            assert calls == expected, (
                f"rank {rank}: Zero2Optimizer.step() (step {step}) called {calls or 'nothing'}, "
                f"expected {expected}: the flat gradient reduce-scattered (each rank receives "
                "only its slice of the sum: no all-reduce, ZeRO-2 never holds the whole "
                "averaged gradient), the inner step, then one all-gather of the new slices, all "
                "on self.process_group"
            )


@pytest.mark.step(3)
def test_zero2_keeps_only_its_slice_of_the_gradient(kata):
    for rank, result in enumerate(_zero2_world()):
        for step, got in enumerate(result["steps"]):
            assert not got["grads left"], (
                f"rank {rank}: after Zero2Optimizer.step() (step {step}) the model's parameters "
                f"{got['grads left'][:3]} still hold their whole gradients: set each p.grad to "
                "None once the reduce-scatter has its slice (that is ZeRO-2's saving over ZeRO-1)"
            )
            assert got["shard grad"] == result["shard"], (
                f"rank {rank}: after step {step} self.shard.grad is shaped {got['shard grad']}, "
                f"expected this rank's slice, shaped like self.shard {result['shard']}: the "
                "reduce-scatter's output, divided by the world size, is the inner optimizer's "
                "gradient"
            )


@pytest.mark.step(3)
def test_zero2_trains_like_unsharded_adamw(kata):
    for rank, result in enumerate(_zero2_world()):
        for step, got in enumerate(result["steps"]):
            for name, want in got["expected"].items():
                mine = got["params"][name]
                if close(mine, want, **TOLERANCE):
                    continue
                hint = (
                    "every rank must hold every new value: all-gather the slices after the inner "
                    "step and copy them into the parameters"
                )
                if torch.equal(mine, result["steps"][0]["expected"][name]) and step:
                    hint = "it did not change after step 0: " + hint
                raise AssertionError(
                    f"rank {rank}: after step {step} of Zero2Optimizer(AdamW) {name} differs "
                    f"from unsharded AdamW on the mean gradient over the 4 ranks: "
                    f"{gap(mine, want)}. The slice's gradient is the MEAN (the reduce-scatter "
                    f"sums: divide by the world size); {hint}"
                )


# --------------------------------------------------------------------------- step 4: the bytes


def _formula(numel, world_size, stage, state_bytes):
    piece = -(-numel // world_size)
    return {
        "params": 4 * (piece if stage >= 3 else numel),
        "grads": 4 * (piece if stage >= 2 else numel),
        "optimizer": state_bytes * (piece if stage >= 1 else numel),
    }


@pytest.mark.step(4)
@pytest.mark.parametrize("numel,world_size,state_bytes", [(1000, 4, 8), (1001, 4, 8), (7, 3, 4)])
def test_zero_bytes_follows_the_formula(kata, numel, world_size, state_bytes):
    for stage in range(4):
        got = kata.zero_bytes(numel, world_size, stage, state_bytes)
        want = _formula(numel, world_size, stage, state_bytes)
        assert got == want, (
            f"zero_bytes({numel}, {world_size}, stage={stage}, state_bytes={state_bytes}) is "
            f"{got}, expected {want}: stage 1 shards the optimizer state, stage 2 the gradients "
            "too, stage 3 the parameters too (fp32: 4 bytes a parameter or gradient); a sharded "
            f"thing is one piece of the padded flat vector, ceil({numel} / {world_size}) elements"
        )


@pytest.mark.step(4)
def test_zero_bytes_refuses_bad_input(kata):
    for args in ((100, 4, 4), (100, 0, 2), (-1, 4, 2), (100, 4, 2, -8), (100, 2.0, 2)):
        did = refusal(lambda args=args: kata.zero_bytes(*args))
        assert did is None, (
            f"zero_bytes{args} {did}: raise ValueError saying what was wrong (stage one of 0-3, "
            "numel and state_bytes ints of at least 0, world_size an int of at least 1)"
        )


@pytest.mark.step(4)
def test_zero2_holds_what_the_formula_says(kata):
    for rank, result in enumerate(_zero2_world()):
        want = kata.zero_bytes(result["numel"], 4, 2, 8)
        assert result["held"] == want, (
            f"rank {rank}: after a step Zero2Optimizer(AdamW) holds {result['held']} bytes, "
            f"zero_bytes({result['numel']}, 4, stage=2) says {want}: the whole parameters, a "
            "slice of the gradient and AdamW's 2 state tensors for the slice only"
        )


@pytest.mark.step(4)
def test_program_trains_and_shows_the_bytes(kata):
    args = ("--replicate", "2", "--shard", "2", "--steps", "2")
    out = run_module_ok(KATA, *args).stdout
    shown = f"`python -m katas.{KATA} {' '.join(args)}`"
    for line, why in (
        ("ZeRO-2         params   30,592  grads    7,648", "ZeRO-2's bytes by the formula"),
        ("measured (ZeRO-2) params   30,592  grads    7,648", "the bytes Zero2Optimizer holds"),
        ("DeepSpeed #1302", "why ZeRO-2 can peak higher than ZeRO-1"),
        ("HSDP equals one process and ZeRO-2 unsharded AdamW", "its verdict"),
    ):
        assert line in out, f"{shown} should print {line!r} ({why}); it printed:\n{out}"


# --------------------------------------------------------------------------- CUDA


# CUDA's kernels add in other orders than the CPU's: one process on the CPU is met to rounding.
CUDA_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
# A 2x2 mesh is HSDP whole (a row of 2 to shard over, a column of 2 to replicate down): 4 GPUs.
# A 2-GPU machine runs the two halves: 1x2 (the reduce-scatter in a row of 2) and 2x1 (the
# all-reduce down a column of 2).
CUDA_MESHES = [
    pytest.param(2, 2, id="2x2-on-4-gpus"),
    pytest.param(1, 2, id="1x2-on-2-gpus"),
    pytest.param(2, 1, id="2x1-on-2-gpus"),
]


def _hsdp_on_cuda(rank, world_size, replicate, shard):
    device = rank_gpu()
    kata = load_kata(KATA)
    mesh = kata.make_mesh(replicate, shard)
    grad = (torch.arange(2.0 * shard) + 100.0 * rank).to(device)  # 2 elements a piece
    with recording() as reduced:
        piece = kata.reduce_gradient(grad, mesh)
    model = kata.HsdpTransformer(make_transformer(11).to(device), mesh)
    _train(model, rank, device, sequences=2 * world_size)
    return {
        "mesh": (mesh.replicate_index, mesh.shard_index),
        "piece": piece.detach().cpu(),
        "reduce calls": _calls(reduced, mesh),
        "device": str(model.embedding.shard.device),
        "state": {n: t.cpu() for n, t in kata.full_state(model).items()},
    }


def _one_process(sequences: int) -> dict[str, torch.Tensor]:
    """One process on the CPU, trained on every rank's sequences at once."""
    model = _train(make_transformer(11), sequences=sequences)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.step(2)
@pytest.mark.cuda
@pytest.mark.parametrize("replicate,shard", CUDA_MESHES)
def test_hsdp_on_nccl_equals_one_process(kata, replicate, shard):
    """NCCL, a GPU per rank: the reduction's groups and values, then 2 SGD steps of
    HsdpTransformer against one process on the CPU."""
    world = replicate * shard
    results = run_world(
        _hsdp_on_cuda, world, replicate, shard, **on_cuda(world, "nccl", deadline=120)
    )
    alone = _one_process(2 * world)
    expected_calls = [("reduce-scatter", "shard"), ("all-reduce", "replicate")]
    for rank, got in enumerate(results):
        where = f"NCCL on CUDA, rank {rank} of a {replicate} x {shard} mesh"
        assert got["device"].startswith("cuda"), (
            f"{where}: the shards left the GPU: {got['device']}"
        )
        assert got["reduce calls"] == expected_calls, (
            f"{where}: reduce_gradient called {got['reduce calls'] or 'nothing'}, expected "
            f"{expected_calls}"
        )
        _, s = got["mesh"]
        total = sum(torch.arange(2.0 * shard) + 100.0 * peer for peer in range(world))
        want = total[2 * s : 2 * s + 2] / world
        assert close(got["piece"], want), (
            f"{where}: reduce_gradient gave {got['piece'].tolist()}, expected piece {s} of the "
            f"mean over all {world} ranks, {want.tolist()}"
        )
        for name, value in alone.items():
            mine = got["state"].get(name)
            assert close(mine, value, **CUDA_TOLERANCE), (
                f"{where}: after {STEPS} SGD steps of HsdpTransformer {name} differs from one "
                f"process's on the CPU: {gap(mine, value)}"
            )


def _zero2_on_cuda(rank, world_size):
    _, optimizer, steps = _zero2_steps(rank, world_size, rank_gpu())
    return {
        "steps": steps,
        "device": str(optimizer.shard.device),
        "params": steps[-1]["params"],
        "expected": steps[-1]["expected"],
    }


@pytest.mark.step(3)
@pytest.mark.cuda
@pytest.mark.parametrize("world", [pytest.param(4, id="4-gpus"), pytest.param(2, id="2-gpus")])
def test_zero2_on_nccl_trains_like_unsharded_adamw(kata, world):
    """NCCL, a GPU per rank: 3 AdamW steps of Zero2Optimizer against unsharded AdamW on the same
    GPUs and the mean gradient, with one reduce-scatter and one all-gather a step."""
    results = run_world(_zero2_on_cuda, world, **on_cuda(world, "nccl", deadline=120))
    expected_calls = [("reduce-scatter", "the group"), ("all-gather", "the group")]
    for rank, got in enumerate(results):
        where = f"NCCL on CUDA, rank {rank} of {world}"
        assert got["device"].startswith("cuda"), f"{where}: the slice left the GPU: {got['device']}"
        for step, done in enumerate(got["steps"]):
            assert done["calls"] == expected_calls, (
                f"{where}: Zero2Optimizer.step() (step {step}) called {done['calls'] or 'nothing'}, "
                f"expected {expected_calls}"
            )
            assert not done["grads left"], (
                f"{where}: after step {step} the parameters {done['grads left'][:3]} still hold "
                "their whole gradients: ZeRO-2 keeps only its slice"
            )
        for name, want in got["expected"].items():
            mine = got["params"][name]
            assert close(mine, want, **TOLERANCE), (
                f"{where}: after {ZERO_STEPS} steps of Zero2Optimizer(AdamW) {name} differs from "
                f"unsharded AdamW on the mean gradient: {gap(mine, want)}"
            )
