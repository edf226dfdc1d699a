"""k39 the capstone: a 3-D mesh (pp x dp x tp) and its groups made once, a pipeline stage of
tensor-parallel blocks (recomputed in backward with k32's checkpoint), one step through the
pipeline averaged over dp with the loss on every rank, the global gradient norm and one clipping
factor, and 3 steps on 8 ranks, every block recomputed, held against one process on the same
global batch.

The 8-rank worlds are the gate's largest: each runs once and is shared by its step's tests."""

from __future__ import annotations

import math

import pytest
import torch

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec import collectives
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.states import close, gap
from dojo.spec.testing import run_module_ok, shared_run
from dojo.todo import KataTodo
from dojo.toy_models import MODEL_DIM, SEQUENCE, make_tokens, make_transformer, transformer_loss

KATA = "k39_capstone"

SEED, BLOCKS, MICRO, STEPS, LR = 0, 4, 2, 3, 0.1
MOMENTUM = 0.9  # the bf16 trainer's SGD: a state the optimizer keeps, in fp32
MAX_NORM = 0.5  # below the tiny transformer's gradient norms (~0.9): clipping bites
CAPSTONE = (2, 2, 2)  # (dp, tp, pp) on 8 ranks
ODD = 6  # sequences: no split into dp 2 x 2 micro-batches
# 8 ranks add the same numbers in other orders than one process: close, not bitwise.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
# Which linears tensor parallelism splits: a block's (k28's plan), column-parallel keeping output
# features (weight rows, bias entries), row-parallel input features (weight columns); and the last
# stage's output layer, its vocabulary rows split as k34 splits them (column-parallel too).
SPLIT = {
    "output": "column",
    "attention.query": "column",
    "attention.key": "column",
    "attention.value": "column",
    "attention.out": "row",
    "mlp.up": "column",
    "mlp.down": "row",
}


def _split_dim(name: str) -> int | None:
    """The dimension tp splits parameter ``name`` on (None: every tp rank holds a copy)."""
    layer, _, kind = name.rpartition(".")
    style = next((s for planned, s in SPLIT.items() if layer.endswith(planned)), None)
    if style == "column":
        return 0
    return 1 if style == "row" and kind == "weight" else None


def _tp_slice(name: str, whole: torch.Tensor, tp: int, tp_index: int) -> torch.Tensor:
    dim = _split_dim(name)
    return whole if dim is None else whole.chunk(tp, dim=dim)[tp_index]


def _stage_names(pp: int, pp_index: int) -> set[str]:
    """The dense model's parameter names on stage ``pp_index`` of ``pp`` (k21's split)."""
    names = set()
    per = BLOCKS // pp
    for name, _ in make_transformer(SEED, blocks=BLOCKS).named_parameters():
        if name.startswith("blocks."):
            keep = int(name.split(".")[1]) // per == pp_index
        elif name.startswith("embedding."):
            keep = pp_index == 0
        else:
            keep = pp_index == pp - 1
        if keep:
            names.add(name)
    return names


def _where(rank: int, place) -> str:
    pp_index, dp_index, tp_index = place
    return f"rank {rank} (pp {pp_index}, dp {dp_index}, tp {tp_index})"


def _group_of(group, mesh) -> str:
    import torch.distributed as dist

    for name in ("tp", "dp", "pp"):
        if group is getattr(mesh, f"{name}_group"):
            return name
    if group is None or group is dist.group.WORLD:
        return "world"
    return "another group"


def _calls(calls, mesh) -> list[dict]:
    return [
        {
            "kind": collectives.kind(c.name),
            "group": _group_of(c.group, mesh),
            "shapes": c.shapes,
            "bytes": c.bytes,
            # batch_isend_irecv: each op's kind, in the order of its tensors' shapes
            "parts": [part[0] for part in c.parts],
            "dtypes": c.dtypes,
        }
        for c in calls
    ]


def _global_batch(dp: int, step: int):
    return make_tokens(2 * MICRO * dp, SEED + 1 + step)


def _failed(rank: int, what: str, error: Exception) -> str:
    return f"rank {rank}: {what} raised {type(error).__name__}: {str(error).strip()[:400]}"


# --------------------------------------------------------------------------- step 1: the mesh


MESHES = ((2, 2, 1), (1, 2, 2), (2, 1, 2))  # (dp, tp, pp) on 4 ranks
MISFITS = ((2, 2, 2), (1, 1, 2), (0, 2, 2), (2, 2, 0))
FIELDS = ("dp_index", "tp_index", "pp_index", "dp_group", "tp_group", "pp_group")


def _expected(rank: int, dp: int, tp: int, pp: int) -> dict:
    pp_index, rest = divmod(rank, dp * tp)
    dp_index, tp_index = divmod(rest, tp)

    def at(p, d, t):
        return (p * dp + d) * tp + t

    return {
        "indices": (pp_index, dp_index, tp_index),
        "tp": [at(pp_index, dp_index, t) for t in range(tp)],
        "dp": [at(pp_index, d, tp_index) for d in range(dp)],
        "pp": [at(p, dp_index, tp_index) for p in range(pp)],
    }


def _meshes(rank, world_size):
    import torch.distributed as dist

    kata = load_kata(KATA)
    out = {}
    for dp, tp, pp in MESHES:
        mesh = kata.make_mesh(dp, tp, pp)
        lacks = [name for name in FIELDS if not hasattr(mesh, name)]
        if lacks:
            raise AssertionError(
                f"make_mesh({dp}, {tp}, {pp}) returned {mesh!r}, which has no "
                f"{', '.join(lacks)}: return the Mesh3D written for you"
            )
        groups = {name: getattr(mesh, f"{name}_group") for name in ("tp", "dp", "pp")}
        # all-reduce over the groups only when every rank is in its own three: a rank outside
        # a group it was given would leave its peers waiting for ever
        fits = all(
            g is not None and rank in dist.get_process_group_ranks(g) for g in groups.values()
        )
        agree = torch.tensor([1.0 if fits else 0.0])
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
        sums = {}
        for name, group in groups.items():
            total = torch.tensor([float(rank)])
            if agree.item() == 1.0:
                dist.all_reduce(total, group=group)
            sums[name] = total.item()
        out[(dp, tp, pp)] = {
            "indices": (mesh.pp_index, mesh.dp_index, mesh.tp_index),
            "members": {
                name: sorted(dist.get_process_group_ranks(g)) if fits else None
                for name, g in groups.items()
            },
            "sums": sums,
        }
    from torch.distributed.device_mesh import init_device_mesh

    for dp, tp, pp in MESHES:  # torch's own mesh of the same shape, on the same world
        theirs = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        out[(dp, tp, pp)]["torch"] = {
            name: (
                theirs.get_local_rank(name),
                sorted(dist.get_process_group_ranks(theirs.get_group(name))),
            )
            for name in ("pp", "dp", "tp")
        }
    refused = {}
    for dp, tp, pp in MISFITS:
        with recording() as calls:
            try:
                kata.make_mesh(dp, tp, pp)
                refused[(dp, tp, pp)] = None
            except KataTodo:
                raise
            except Exception as error:  # what a learner's version raised, as it raised it
                refused[(dp, tp, pp)] = (type(error).__name__, str(error), len(calls))
    out["refused"] = refused
    return out


@shared_run
def _mesh_world():
    return run_world(_meshes, 4, deadline=60)


@pytest.mark.step(1)
@pytest.mark.parametrize("dp,tp,pp", MESHES)
def test_mesh_groups_are_the_grid_s_lines(kata, dp, tp, pp):
    results = [result[(dp, tp, pp)] for result in _mesh_world()]
    name = f"make_mesh(dp={dp}, tp={tp}, pp={pp}) on 4 ranks"
    # indices first, then members, then sums: a mistake shows as the narrowest thing it breaks
    for rank, got in enumerate(results):
        want = _expected(rank, dp, tp, pp)["indices"]
        assert got["indices"] == want, (
            f"rank {rank} of {name} says (pp_index, dp_index, tp_index) = {got['indices']}, "
            f"expected {want}: rank = (pp_index * dp + dp_index) * tp + tp_index (tp innermost: "
            "its all-reduces run in every layer and want the fastest links; torch's "
            "init_device_mesh lays (pp, dp, tp) out so)"
        )
    for rank, got in enumerate(results):
        want = _expected(rank, dp, tp, pp)
        for group in ("tp", "dp", "pp"):
            members = got["members"][group]
            assert members == want[group], (
                f"rank {rank} of {name}: its {group}_group holds ranks {members}, expected "
                f"{want[group]} (the ranks that differ from it only in {group}_index)"
                + (
                    f": that is its {other} line; {group}_group and {other}_group swapped?"
                    if members is not None
                    and (
                        other := next(
                            (
                                o
                                for o in ("tp", "dp", "pp")
                                if o != group and want[o] == members and len(members) > 1
                            ),
                            None,
                        )
                    )
                    else ""
                )
            )
    for rank, got in enumerate(results):
        want = _expected(rank, dp, tp, pp)
        for group in ("tp", "dp", "pp"):
            assert got["sums"][group] == float(sum(want[group])), (
                f"rank {rank} of {name}: an all-reduce of the ranks over {group}_group gave "
                f"{got['sums'][group]}, expected {sum(want[group])} ({want[group]}): the group "
                "does not hold those ranks (or some rank is not in the groups it was given)"
            )


@pytest.mark.step(1)
@pytest.mark.parametrize("dp,tp,pp", MESHES)
def test_mesh_is_torch_s_init_device_mesh(kata, dp, tp, pp):
    torch_mesh = 'init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))'
    for rank, got in enumerate(result[(dp, tp, pp)] for result in _mesh_world()):
        mine = dict(zip(("pp", "dp", "tp"), got["indices"]))
        for name, (index, members) in got["torch"].items():
            assert (mine[name], got["members"][name]) == (index, members), (
                f"rank {rank} of make_mesh(dp={dp}, tp={tp}, pp={pp}): {name}_index "
                f"{mine[name]} and {name}_group {got['members'][name]}, torch's {torch_mesh} "
                f"gives this rank {name} index {index} and the group {members} on the same world"
            )


@pytest.mark.step(1)
def test_a_mesh_that_does_not_fit_is_refused(kata):
    for (dp, tp, pp), got in _mesh_world()[0]["refused"].items():
        said = f"make_mesh(dp={dp}, tp={tp}, pp={pp}) on 4 ranks"
        assert got is not None, (
            f"{said} returned a mesh: raise ValueError (dp x tp x pp must be the world size, "
            "each at least 1)"
        )
        kind, message, calls = got
        assert kind == "ValueError", (
            f"{said} raised {kind}: {message[:200]}; check first and raise ValueError, saying "
            "dp x tp x pp must equal the world size"
        )
        if min(dp, tp, pp) >= 1:
            assert "4" in message, (
                f"{said}'s ValueError says {message!r}: name the world size (4), so that the "
                "reader knows what dp x tp x pp must be"
            )
        assert calls == 0, (
            f"{said} made {calls} call(s) of torch.distributed before its ValueError: check the "
            "mesh first (dist.new_group is a collective of the whole world; a rank that stops "
            "half-way leaves the others waiting in it)"
        )


# --------------------------------------------------------------------------- step 2: the stage


def _stages(rank, world_size):
    kata = load_kata(KATA)
    mesh = kata.make_mesh(1, 2, 2)  # tp 2 x pp 2
    dense = make_transformer(SEED, blocks=BLOCKS)
    stage = kata.build_stage(make_transformer(SEED, blocks=BLOCKS), mesh)
    params = {n: p.detach().clone() for n, p in stage.named_parameters()}
    tokens, _ = make_tokens(2, SEED)
    with torch.no_grad():
        hidden = dense.embedding(tokens)
        for block in dense.blocks[:2]:
            hidden = block(hidden)
        # the last stage: this tp rank's vocabulary columns of the logits, never all of them
        expected = hidden if mesh.pp_index == 0 else dense(tokens).chunk(2, -1)[mesh.tp_index]
        given = tokens if mesh.pp_index == 0 else hidden
        with recording() as calls:
            try:
                output, failure = stage(given).detach().clone(), None
            except KataTodo:
                raise
            except Exception as error:  # told by the forward's test, after the parameters'
                output, failure = None, _failed(rank, "the stage's forward", error)
    return {
        "place": (mesh.pp_index, mesh.dp_index, mesh.tp_index),
        "params": params,
        "output": output,
        "failure": failure,
        "expected": expected,
        "calls": _calls(calls, mesh),
        "recompute": _recomputed(rank, kata, mesh, stage, given),
    }


def _recomputed(rank, kata, mesh, plain, given) -> dict:
    """The stage built with recompute=True against ``plain`` (the same stage keeping
    everything): both stages' gradients after one forward and backward, and each block's
    forwards in forward and in backward, counted at its first LayerNorm (a block's forward runs
    it once: the recompute runs it again)."""
    again = kata.build_stage(make_transformer(SEED, blocks=BLOCKS), mesh, recompute=True)
    runs = {index: 0 for index in again.blocks.keys()}

    def counter(index: str):
        def count(*_):
            runs[index] += 1

        return count

    for index, block in again.blocks.items():
        for name, module in block.named_modules():
            if name.endswith("attention_norm"):
                module.register_forward_pre_hook(counter(index))
    grads = {}
    for name, stage in (("plain", plain), ("recomputed", again)):
        try:
            output = stage(given)
            forwards = dict(runs)
            output.square().mean().backward()
        except KataTodo:
            raise
        except Exception as error:  # a learner's block that cannot run: said by the test
            return {"failure": _failed(rank, f"the {name} stage's forward and backward", error)}
        grads[name] = {
            n: None if p.grad is None else p.grad.detach().clone()
            for n, p in stage.named_parameters()
        }
    return {
        "failure": None,
        "forwards": {i: (forwards[i], runs[i] - forwards[i]) for i in runs},
        "plain": grads["plain"],
        "recomputed": grads["recomputed"],
    }


@shared_run
def _stage_world():
    return run_world(_stages, 4, deadline=60)


@pytest.mark.step(2)
def test_each_stage_holds_its_blocks_tp_slices(kata):
    dense = dict(make_transformer(SEED, blocks=BLOCKS).named_parameters())
    for rank, got in enumerate(_stage_world()):
        pp_index, _, tp_index = got["place"]
        who = _where(rank, got["place"])
        want = _stage_names(2, pp_index)
        names = set(got["params"])
        assert names == want, (
            f"{who} holds parameters {sorted(names - want)[:4]} it should not and lacks "
            f"{sorted(want - names)[:4]}: stage {pp_index} of 2 holds "
            + (
                "the embedding and blocks 0-1"
                if pp_index == 0
                else "blocks 2-3, the norm and the output"
            )
            + ", under the model's names (k21's split_stages of the pp index)"
        )
        for name, mine in got["params"].items():
            whole = dense[name].detach()
            want_slice = _tp_slice(name, whole, 2, tp_index)
            output = name.startswith("output.")
            if mine.shape == whole.shape and want_slice.shape != whole.shape:
                raise AssertionError(
                    f"{who} holds the whole {name} {tuple(whole.shape)}, expected its tp slice "
                    f"{tuple(want_slice.shape)}: "
                    + (
                        "the last stage's output layer is split over the tp group by vocabulary "
                        "rows (k34's vocab_shard), so that its logits stay split"
                        if output
                        else "every block of the stage is split over the tp group (k28's "
                        "TensorParallelBlock)"
                    )
                )
            others = (whole[tp_index::2], *whole.chunk(2, dim=0))  # dealt out, or another's
            if output and not torch.equal(mine, want_slice):
                if any(mine.shape == rows.shape and torch.equal(mine, rows) for rows in others):
                    raise AssertionError(
                        f"{who}: {name} holds rows of the model's {tuple(whole.shape)}, but not "
                        f"tp rank {tp_index}'s: k34's vocab_parallel_cross_entropy on the tp group "
                        "takes tp rank r's logits for words [r V/tp, (r+1) V/tp), so its output "
                        "layer holds those rows, in that order (k34's vocab_shard on the tp group)"
                    )
            assert mine.shape == want_slice.shape and torch.equal(mine, want_slice), (
                f"{who}: {name} {tuple(mine.shape)} is not tp rank {tp_index}'s slice of the "
                f"model's {tuple(whole.shape)} ({tuple(want_slice.shape)}): split it with the "
                "mesh's tp_index and tp_group"
            )


@pytest.mark.step(2)
def test_each_stage_s_forward_is_the_dense_model_s(kata):
    for rank, got in enumerate(_stage_world()):
        pp_index = got["place"][0]
        what = (
            "the activations after block 1"
            if pp_index == 0
            else f"tp rank {got['place'][2]}'s vocabulary columns of the logits"
        )
        assert got["failure"] is None, got["failure"]
        if pp_index == 1 and got["output"].shape != got["expected"].shape:
            raise AssertionError(
                f"{_where(rank, got['place'])}: the last stage's forward gave logits of shape "
                f"{tuple(got['output'].shape)}, expected {tuple(got['expected'].shape)}, this tp "
                "rank's vocabulary columns only: the output layer's rows are split over tp (k34) "
                "and its logits are never gathered"
            )
        assert got["output"].shape == got["expected"].shape and close(
            got["output"], got["expected"], **TOLERANCE
        ), (
            f"{_where(rank, got['place'])}: the stage's forward differs from the dense model's "
            f"({what}): {gap(got['output'], got['expected'])}"
        )


@pytest.mark.step(2)
def test_a_stage_s_forward_calls_only_on_the_tp_group(kata):
    for rank, got in enumerate(_stage_world()):
        elsewhere = [c for c in got["calls"] if c["group"] != "tp"]
        assert not elsewhere, (
            f"{_where(rank, got['place'])}: the stage's forward made "
            + ", ".join(f"{c['kind']} on the {c['group']}" for c in elsewhere[:3])
            + ": a stage's blocks sum their slices over the tp group only (the dp ranks read "
            "other data, the pp ranks hold other layers)"
        )
        assert got["calls"], (
            f"{_where(rank, got['place'])}: the stage's forward made no call: its blocks hold "
            "slices, whose partial products are summed over the tp group"
        )


@pytest.mark.step(2)
def test_a_recomputed_stage_runs_each_block_again_with_the_same_gradients(kata):
    for rank, got in enumerate(_stage_world()):
        who = _where(rank, got["place"])
        said = f"{who}, build_stage(model, mesh, recompute=True)"
        mine = got["recompute"]
        assert mine["failure"] is None, mine["failure"]
        names, want = set(mine["recomputed"]), set(mine["plain"])
        assert names == want, (
            f"{said} holds parameters {sorted(names - want)[:3]} where the stage without "
            f"recompute holds {sorted(want - names)[:3]}: the names stay the model's"
            + (
                " (k32's Checkpointed puts the block under .module: checkpoint the "
                "TensorParallelBlock's own forward instead)"
                if any(".module." in n for n in names)
                else ""
            )
        )
        for name, grad in mine["plain"].items():
            again = mine["recomputed"][name]
            assert again is not None, (
                f"{said}: {name} has no gradient after backward, where the stage without "
                "recompute gives it one: a checkpoint gives the parameters their gradients even "
                "when its input needs none (k32's does; torch's use_reentrant=True does not) and "
                "keeps the input as it came (not detached)"
            )
            assert close(again, grad, **TOLERANCE), (
                f"{said}: the gradient of {name} differs from the same stage's without "
                f"recompute: {gap(again, grad)}; recomputing runs the same forward on the same "
                "input, so the gradients are the same numbers (is the input kept as it is, "
                "not detached?)"
            )
        for index, (forward, backward) in sorted(mine["forwards"].items(), key=lambda i: int(i[0])):
            assert forward == 1, (
                f"{said}: block {index}'s forward ran {forward} time(s) in the stage's forward, "
                "expected once"
            )
            assert backward == 1, (
                f"{said}: block {index}'s forward ran {backward} time(s) in backward, expected "
                "once more: "
                + (
                    "it did not run again in backward, so it kept its activations; every block "
                    "of the stage runs through k32's checkpoint"
                    if backward == 0
                    else "the recompute runs once per block"
                )
            )


# --------------------------------------------------------------------------- step 3: one step


def _one_step(rank, world_size):
    kata = load_kata(KATA)
    dp, tp, pp = CAPSTONE
    mesh = kata.make_mesh(dp, tp, pp)
    stage = kata.build_stage(make_transformer(SEED, blocks=BLOCKS), mesh, recompute=True)
    tokens, targets = _global_batch(dp, 0)
    shapes = []  # what the stage's forward gives: on the last stage, the logits this rank holds
    stage.register_forward_hook(lambda _, __, out: shapes.append(tuple(out.shape)))
    with recording() as calls:
        loss = kata.forward_backward(stage, tokens, targets, mesh)
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else None)
        for n, p in stage.named_parameters()
    }
    with recording() as probed:  # after the step: a batch that does not split must be refused
        try:
            kata.forward_backward(stage, tokens[:ODD], targets[:ODD], mesh)
            refused = None
        except KataTodo:
            raise
        except Exception as error:  # what a learner's version raised, as it raised it
            refused = (type(error).__name__, str(error), len(probed))
    return {
        "place": (mesh.pp_index, mesh.dp_index, mesh.tp_index),
        "loss": loss,
        "grads": grads,
        "calls": _calls(calls, mesh),
        "refused": refused,
        "shapes": shapes,
    }


@shared_run
def _step_world():
    return run_world(_one_step, 8, deadline=90)


def _dense_step(rows: slice | None = None) -> tuple[float, dict]:
    """One process's loss and gradients on the global batch (or on ``rows`` of it)."""
    model = make_transformer(SEED, blocks=BLOCKS)
    tokens, targets = _global_batch(CAPSTONE[0], 0)
    if rows is not None:
        tokens, targets = tokens[rows], targets[rows]
    loss = transformer_loss(model(tokens), targets)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.step(3)
def test_one_step_s_gradients_equal_one_process_s(kata):
    dp, tp, _ = CAPSTONE
    _, whole = _dense_step()
    share = 2 * MICRO
    replicas = [_dense_step(slice(d * share, (d + 1) * share))[1] for d in range(dp)]
    for rank, got in enumerate(_step_world()):
        _, dp_index, tp_index = got["place"]
        who = _where(rank, got["place"])
        for name, grad in got["grads"].items():
            want = _tp_slice(name, whole[name], tp, tp_index)
            assert grad is not None, (
                f"{who}: {name} has no gradient after forward_backward: every stage runs "
                "backward through its part of the pipeline"
            )
            if grad.shape == want.shape and close(grad, want, **TOLERANCE):
                continue
            own = _tp_slice(name, replicas[dp_index][name], tp, tp_index)
            summed = _tp_slice(name, sum(r[name] for r in replicas), tp, tp_index)
            if grad.shape == own.shape and close(grad, own, **TOLERANCE):
                likely = (
                    ": it is this replica's own gradient; average the replicas' gradients over "
                    "the dp group"
                )
            elif grad.shape == summed.shape and close(grad, summed, **TOLERANCE):
                likely = f": it is the SUM of the {dp} replicas' gradients; the mean divides by dp"
            else:
                likely = ""
            raise AssertionError(
                f"{who}: the gradient of {name} after one forward_backward differs from one "
                f"process's on the global batch (its tp slice): "
                f"{gap(grad, want) if grad.shape == want.shape else tuple(grad.shape)}{likely}"
            )


@pytest.mark.step(3)
def test_the_loss_is_the_global_batch_s_on_every_rank(kata):
    dp = CAPSTONE[0]
    loss, _ = _dense_step()
    share = 2 * MICRO
    own = [_dense_step(slice(d * share, (d + 1) * share))[0] for d in range(dp)]
    for rank, got in enumerate(_step_world()):
        value = got["loss"]
        who = _where(rank, got["place"])
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (
            f"{who}: forward_backward returned {value!r}, expected the loss as a float on "
            "every rank, the first stage's too (k33: the last stage's sums, shared)"
        )
        if math.isclose(value, loss, rel_tol=1e-5, abs_tol=1e-6):
            continue
        _, dp_index, _ = got["place"]
        if math.isclose(value, own[dp_index], rel_tol=1e-5, abs_tol=1e-6):
            likely = ": that is its own replica's loss; the mean is over every replica's tokens"
        elif math.isclose(value, sum(own), rel_tol=1e-5):
            likely = f": that is the sum of the {dp} replicas' losses, not their mean"
        else:
            likely = ""
        raise AssertionError(
            f"{who}: forward_backward returned the loss {value:.6f}, expected one process's "
            f"{loss:.6f} on the global batch{likely}"
        )


@pytest.mark.step(3)
def test_the_last_stage_holds_its_vocabulary_columns_and_never_gathers_them(kata):
    _, tp, pp = CAPSTONE
    vocab = make_transformer(SEED, blocks=BLOCKS).output.out_features
    for rank, got in enumerate(_step_world()):
        if got["place"][0] != pp - 1:
            continue
        who = _where(rank, got["place"])
        wide = [shape for shape in got["shapes"] if shape[-1] != vocab // tp]
        assert not wide, (
            f"{who}: the last stage's forward gave logits of shape {wide[0]}: a rank holds its "
            f"vocabulary columns only, {vocab // tp} of the {vocab} words"
        )
        gathers = [c for c in got["calls"] if c["kind"] == "all-gather"]
        assert not gathers, (
            f"{who} gathered {gathers[0]['shapes']} on the {gathers[0]['group']} group: the loss "
            "of split logits needs three numbers per token from each tp rank (k34's "
            "vocab_parallel_cross_entropy on the tp group, given to run_schedule as its loss_fn), "
            "never the logits themselves"
        )


@pytest.mark.step(3)
def test_the_pipeline_carries_a_replica_s_share_on_the_pp_group(kata):
    dp = CAPSTONE[0]
    share = 2 * MICRO
    for rank, got in enumerate(_step_world()):
        who = _where(rank, got["place"])
        sends = [c for c in got["calls"] if c["kind"] in ("isend", "send")]
        wrong = [c for c in sends if c["group"] != "pp"]  # a batch's ops carry their own groups
        assert not wrong, (
            f"{who} sent on the {wrong[0]['group']}: the stages' activations and gradients go "
            "between the ranks of a pp group (the same tp slice and data, the next stage)"
        )
        if got["place"][0] == 0:  # the first stage sends each micro-batch's activations
            sent = [c["shapes"][0] for c in sends if c["shapes"]]
            for c in got["calls"]:
                if c["kind"] == "batch-isend-irecv":
                    sent += [
                        shape for kind, shape in zip(c["parts"], c["shapes"]) if kind == "isend"
                    ]
            rows = sum(shape[0] for shape in sent)
            assert rows == share, (
                f"{who} sent the activations of {rows} sequences to the next stage, expected "
                f"{share}: each of the {dp} dp replicas runs its share of the global batch of "
                f"{share * dp} (rows dp_index * {share} onwards)"
                + (": every replica ran the whole batch" if rows == share * dp else "")
            )
            assert all(shape[1:] == (SEQUENCE, MODEL_DIM) for shape in sent), (
                f"{who} sent tensors of shapes {sent}: activations are "
                f"(sequences, {SEQUENCE}, {MODEL_DIM})"
            )


@pytest.mark.step(3)
def test_gradients_are_averaged_on_the_dp_group_and_no_group_is_made(kata):
    for rank, got in enumerate(_step_world()):
        who = _where(rank, got["place"])
        made = [c for c in got["calls"] if c["kind"] == "new-group"]
        assert not made, (
            f"{who}: forward_backward made {len(made)} process group(s): the mesh's groups are "
            "made once, by make_mesh, and used every step (a group made every step costs a "
            "rendezvous of the whole world each time)"
        )
        world = [  # a batch_isend_irecv's group is its ops', not the call's
            c
            for c in got["calls"]
            if c["group"] in ("world", "another group") and c["kind"] != "batch-isend-irecv"
        ]
        assert not world, (
            f"{who}: forward_backward made {world[0]['kind']} on {world[0]['group']}: every "
            "call belongs to one of the mesh's groups (tp, dp or pp)"
        )
        on_dp = [c for c in got["calls"] if c["kind"] == "all-reduce" and c["group"] == "dp"]
        assert on_dp, (
            f"{who}: forward_backward made no all-reduce on the dp group: the replicas' "
            "gradients are averaged there"
        )


@pytest.mark.step(3)
def test_a_batch_that_does_not_split_is_refused(kata):
    dp = CAPSTONE[0]
    for rank, got in enumerate(_step_world()):
        said = (
            f"{_where(rank, got['place'])}: forward_backward on a batch of {ODD} sequences "
            f"(dp {dp} x {MICRO} micro-batches)"
        )
        assert got["refused"] is not None, (
            f"{said} returned: raise ValueError, saying the batch must be a multiple of dp x "
            f"micro_batches ({dp * MICRO})"
        )
        kind, message, calls = got["refused"]
        assert kind == "ValueError", (
            f"{said} raised {kind}: {message[:200]}; check the batch first and raise ValueError"
        )
        assert calls == 0, (
            f"{said} made {calls} call(s) of torch.distributed before its ValueError: check "
            "first (a rank that stops half-way through a step leaves its peers waiting)"
        )


# --------------------------------------------------------------------------- step 4: the norm


def _training(rank, world_size):
    kata = load_kata(KATA)
    dp, tp, pp = CAPSTONE
    mesh = kata.make_mesh(dp, tp, pp)
    stage = kata.build_stage(make_transformer(SEED, blocks=BLOCKS), mesh, recompute=True)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, targets = _global_batch(dp, step)
        loss, norm = kata.train_step(stage, optimizer, tokens, targets, mesh, MAX_NORM)
        losses.append(loss)
        norms.append(norm)
    return {
        "place": (mesh.pp_index, mesh.dp_index, mesh.tp_index),
        "losses": losses,
        "norms": norms,
        "weights": {n: p.detach().clone() for n, p in stage.named_parameters()},
        "bf16": _bf16_training(kata, mesh),
    }


def _bf16_training(kata, mesh) -> dict:
    """The same trainer in bf16 with k31's fp32 masters, on the same ranks (a second stage):
    3 steps of SGD with momentum (a state to hold in fp32), the first step's calls."""
    stage = kata.build_stage(make_transformer(SEED, blocks=BLOCKS), mesh, recompute=True)
    mixed = kata.MasterWeights(stage, torch.bfloat16)
    optimizer = torch.optim.SGD(mixed.masters, lr=LR, momentum=MOMENTUM)
    losses, norms, calls = [], [], []
    for step in range(STEPS):
        tokens, targets = _global_batch(CAPSTONE[0], step)
        with recording() as made:
            loss, norm = kata.train_step(
                stage, optimizer, tokens, targets, mesh, MAX_NORM, mixed=mixed
            )
        calls = calls or _calls(made, mesh)
        losses.append(loss)
        norms.append(norm)
    names = [n for n, _ in stage.named_parameters()]
    return {
        "losses": losses,
        "norms": norms,
        "calls": calls,
        "model": sorted({str(p.dtype) for p in stage.parameters()}),
        "steps_the_model": any(
            p is q for g in optimizer.param_groups for p in g["params"] for q in stage.parameters()
        ),
        "stepped": sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"]}),
        "state": sorted(
            {
                str(t.dtype)
                for s in optimizer.state.values()
                for t in s.values()
                if torch.is_tensor(t)
            }
        ),
        "weights": {n: m.detach().clone() for n, m in zip(names, mixed.masters)},
    }


@shared_run
def _training_world():
    return run_world(_training, 8, deadline=120)


def _alone(clip: bool = True, steps: int = STEPS) -> dict:
    model = make_transformer(SEED, blocks=BLOCKS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        tokens, targets = _global_batch(CAPSTONE[0], step)
        loss = transformer_loss(model(tokens), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM if clip else math.inf)
        losses.append(loss.item())
        norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "norms": norms, "weights": dict(model.named_parameters())}


def _miscounted_norms() -> dict[str, float]:
    """The first step's norm as the usual mistakes count it, from one process's gradient."""
    _, grads = _dense_step()
    tp, pp = CAPSTONE[1], CAPSTONE[2]
    sliced = sum(
        g.double().square().sum().item() for n, g in grads.items() if _split_dim(n) is not None
    )
    copies = sum(
        g.double().square().sum().item() for n, g in grads.items() if _split_dim(n) is None
    )
    first_slices = sum(
        _tp_slice(n, g, tp, 0).double().square().sum().item()
        for n, g in grads.items()
        if _split_dim(n) is not None
    )
    output_first_rows = sum(
        _tp_slice(n, g, tp, 0).double().square().sum().item()
        for n, g in grads.items()
        if n.startswith("output.")
    )
    output = sum(
        g.double().square().sum().item() for n, g in grads.items() if n.startswith("output.")
    )
    stage_zero = sum(
        g.double().square().sum().item() for n, g in grads.items() if n in _stage_names(pp, 0)
    )
    return {
        "the replicated parameters (LayerNorms, the row-parallel biases, the embedding, the "
        "head) counted once per tp rank: count a copy on tp rank 0 only": math.sqrt(
            sliced + tp * copies
        ),
        "the output layer's vocabulary rows counted as a copy (on tp rank 0 only): they are "
        "tp slices like a column-parallel linear's, their squares summed over tp": math.sqrt(
            sliced - output + output_first_rows + copies
        ),
        "only tp rank 0's slices counted: the tp slices are different parts, their squares are "
        "summed over tp": math.sqrt(first_slices + copies),
        "only the first stage's parameters counted: the stages hold different parameters, their "
        'squares are summed over pp (stages="pp")': math.sqrt(stage_zero),
        f"the squares summed on every dp replica: the {CAPSTONE[0]} replicas hold copies after "
        "the mean, count them once": math.sqrt(CAPSTONE[0] * (sliced + copies)),
    }


@pytest.mark.step(4)
def test_every_rank_clips_by_the_same_norm(kata):
    results = _training_world()
    for rank, got in enumerate(results):
        assert len(got["norms"]) == STEPS and all(
            isinstance(n, (int, float)) and not isinstance(n, bool) for n in got["norms"]
        ), (
            f"{_where(rank, got['place'])}: train_step returned the norms {got['norms']}: a float each step"
        )
        assert all(
            math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)
            for a, b in zip(got["norms"], results[0]["norms"])
        ), (
            f"{_where(rank, got['place'])} returned the gradient norms {got['norms']}, rank 0 "
            f"{results[0]['norms']}: the norm is the whole model's, the same on every rank; a "
            "rank's own pieces alone give a norm (and a clipping factor) of its own, and the "
            "copies of a parameter drift apart"
        )


@pytest.mark.step(4)
def test_the_norm_equals_one_process_s(kata):
    alone = _alone()
    unclipped = _alone(clip=False)
    got = _training_world()[0]
    for step, (mine, want) in enumerate(zip(got["norms"], alone["norms"])):
        if math.isclose(mine, want, rel_tol=1e-4):
            continue
        likely = ""
        if step > 0 and math.isclose(mine, unclipped["norms"][step], rel_tol=1e-4):
            likely = (
                ": that is the norm of a run trained WITHOUT clipping (step 1's norm was right); "
                "scale every gradient in place by min(1, max_norm / (norm + 1e-6))"
            )
        if step == 0:
            for mistake, value in _miscounted_norms().items():
                if math.isclose(mine, value, rel_tol=1e-4):
                    likely = f": that is {mistake}"
                    break
        raise AssertionError(
            f"step {step + 1}: every rank returned the gradient norm {mine:.6f}, expected one "
            f"process's clip_grad_norm_ on the global batch {want:.6f} (each element of the whole "
            f"model once){likely}"
        )


@pytest.mark.step(4)
def test_three_steps_equal_one_process_s_loss_and_weights(kata):
    alone = _alone()
    unclipped = _alone(clip=False)
    dp, tp, _ = CAPSTONE
    for rank, got in enumerate(_training_world()):
        who = _where(rank, got["place"])
        tp_index = got["place"][2]
        for name, mine in got["weights"].items():
            want = _tp_slice(name, alone["weights"][name].detach(), tp, tp_index)
            if close(mine, want, **TOLERANCE):
                continue
            raw = _tp_slice(name, unclipped["weights"][name].detach(), tp, tp_index)
            likely = (
                ": those are the weights trained WITHOUT clipping; scale every gradient by the "
                "factor min(1, max_norm / (norm + 1e-6))"
                if close(mine, raw, **TOLERANCE)
                else ""
            )
            raise AssertionError(
                f"{who}: {name} after {STEPS} clipped SGD steps differs from one process's "
                f"(its tp slice): {gap(mine, want)}{likely}"
            )
        for step, (mine, want) in enumerate(zip(got["losses"], alone["losses"])):
            assert math.isclose(mine, want, rel_tol=1e-4), (
                f"{who}: step {step + 1}'s loss is {mine:.6f}, one process's {want:.6f}: the "
                "weights were one process's, so the loss is computed or shared another way"
            )


def _alone_bf16() -> dict:
    """One process in the same policy: the model in bf16, fp32 masters (plain torch), the loss
    of the logits in fp32, SGD with momentum on the masters; the initial and final weights."""
    model = make_transformer(SEED, blocks=BLOCKS)
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    model.to(torch.bfloat16)
    optimizer = torch.optim.SGD(masters, lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, targets = _global_batch(CAPSTONE[0], step)
        loss = transformer_loss(model(tokens).float(), targets)
        loss.backward()
        for master, param in zip(masters, model.parameters()):
            master.grad, param.grad = param.grad.float(), None
        norms.append(torch.nn.utils.clip_grad_norm_(masters, MAX_NORM).item())
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, param in zip(masters, model.parameters()):
                param.copy_(master)
    names = [n for n, _ in model.named_parameters()]
    return {"losses": losses, "norms": norms, "first": first, "weights": dict(zip(names, masters))}


# bf16 keeps 8 bits of mantissa (its epsilon 2^-8 = 0.4%): tp's partial sums, rounded to bf16
# before they are added, and the activations sent between the stages round otherwise than one
# process's full products, so the run is held to bf16's rounding, not to fp32's. The weights move
# by up to ~1e-2 in 3 steps; the run stays within a fifth of that movement (measured: at most
# 0.043), while masters kept in bf16 drop the updates below half a bf16 weight's ulp and miss by
# 1.7 times it. A dp mean in bf16 stays within it (0.033): its dtype is what the spec holds.
BF16_LOSS = 4e-3  # relative: bf16's epsilon
BF16_NORM = 2e-2  # relative: a sum of squares of bf16 gradients (measured: 0.7%)
BF16_DRIFT = 0.2  # the weights' largest gap over their largest movement in 3 steps


@pytest.mark.step(4)
def test_bf16_keeps_fp32_masters_sends_bf16_and_reduces_in_fp32(kata):
    dp = CAPSTONE[0]
    for rank, got in enumerate(_training_world()):
        who = f"{_where(rank, got['place'])}, in bf16 with k31's MasterWeights"
        run = got["bf16"]
        assert run["model"] == ["torch.bfloat16"], (
            f"{who}: the stage's parameters are {run['model']}: k31's MasterWeights casts the "
            "stage to bf16, its forward and backward compute in bf16"
        )
        assert not run["steps_the_model"], (
            f"{who}: MasterWeights.masters, which the optimizer steps, are the stage's own bf16 "
            "parameters: the optimizer steps the bf16 copy and its updates (lr x g ~1e-3) round "
            "away below half a bf16 weight's ulp; keep fp32 copies of their own as the masters"
        )
        masters = sorted({str(m.dtype) for m in run["weights"].values()})
        assert masters == ["torch.float32"], (
            f"{who}: the master weights are {masters}: keep them fp32 (an SGD update, lr x g "
            "~1e-3, is below half the ulp of a bf16 weight near 1, and rounds away)"
        )
        assert run["stepped"] == ["torch.float32"] and run["state"] == ["torch.float32"], (
            f"{who}: the optimizer steps {run['stepped']} parameters and keeps its momentum in "
            f"{run['state']}: it must step the fp32 masters (MasterWeights.masters), never the "
            "bf16 copy the model computes with, and keep its state fp32"
        )
        sends = [c for c in run["calls"] if c["kind"] in ("isend", "send")]
        assert sends and all(c["dtypes"] == ["bfloat16"] for c in sends), (
            f"{who}: the pipeline sent {[c['dtypes'] for c in sends]}: a bf16 stage sends its "
            "bf16 activations (and their gradients back), half the bytes of fp32"
        )
        for c in sends:
            count = math.prod(c["shapes"][0])
            assert c["bytes"] == 2 * count, (
                f"{who}: a send of {count} values carried {c['bytes']} bytes: bf16 is 2 bytes a "
                f"value (fp32's {4 * count} halved)"
            )
        means = [  # not k33's loss (2 numbers) and norm (1), in float64
            c for c in run["calls"] if c["group"] == "dp" and math.prod(c["shapes"][0]) > 2
        ]
        assert means and all(c["dtypes"] == ["float32"] for c in means), (
            f"{who}: the gradients' mean over the {dp} dp replicas was all-reduced in "
            f"{[c['dtypes'] for c in means]}: reduce in fp32 (k31's reduce_gradients(torch."
            "float32, the dp group)); bf16 rounds every partial sum to 8 bits"
        )


@pytest.mark.step(4)
def test_bf16_three_steps_equal_one_process_in_the_same_policy(kata):
    alone = _alone_bf16()
    tp = CAPSTONE[1]
    for rank, got in enumerate(_training_world()):
        who = f"{_where(rank, got['place'])}, in bf16"
        run = got["bf16"]
        for step, (mine, want) in enumerate(zip(run["losses"], alone["losses"])):
            assert math.isclose(mine, want, rel_tol=BF16_LOSS), (
                f"{who}: step {step + 1}'s loss is {mine:.6f}, one process's in the same policy "
                f"{want:.6f}: more apart than bf16's rounding ({BF16_LOSS:.0e})"
            )
        for step, (mine, want) in enumerate(zip(run["norms"], alone["norms"])):
            assert math.isclose(mine, want, rel_tol=BF16_NORM), (
                f"{who}: step {step + 1}'s gradient norm is {mine:.6f}, one process's "
                f"{want:.6f}: measure and clip the fp32 masters' gradients (the dp mean)"
            )
        drift = moved = 0.0
        for name, mine in run["weights"].items():
            want = _tp_slice(name, alone["weights"][name].detach(), tp, got["place"][2])
            first = _tp_slice(name, alone["first"][name], tp, got["place"][2])
            assert mine.shape == want.shape, f"{who}: {name} is {gap(mine, want)}"
            drift = max(drift, (mine.double() - want.double()).abs().max().item())
            moved = max(moved, (want.double() - first.double()).abs().max().item())
        assert drift <= BF16_DRIFT * moved, (
            f"{who}: after {STEPS} steps the masters differ from one process's in the same "
            f"policy by up to {drift:.3g}, while its weights moved by up to {moved:.3g}: bf16's "
            f"rounding keeps them within {BF16_DRIFT} of that; updates lost (masters in bf16) or "
            "not taken miss by the movement itself"
        )


@pytest.mark.step(4)
def test_program_trains_on_8_ranks_and_draws_its_timeline(kata, tmp_path):
    out = run_module_ok(KATA, "--steps", "1", "--recompute", "--trace", str(tmp_path)).stdout
    shown = f"`python -m katas.{KATA} --steps 1 --recompute --trace DIR`"
    for line, why in (
        ("pp 2 x dp 2 x tp 2 on 8 ranks", "the mesh"),
        ("every block recomputed in backward", "what --recompute does"),
        ("one step's calls in order: tp: all-reduce", "rank 0's calls by group, in order"),
        ("dp: all-reduce", "the gradients' mean on the dp group"),
        ("equal one process's", "its verdict"),
    ):
        assert line in out, f"{shown} should print {line!r} ({why}); it printed:\n{out}"
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn, (
        f"{shown} drew no timeline in DIR (it holds {sorted(p.name for p in tmp_path.iterdir())}): "
        f"the program's ranks run through launch_world, which draws them; it printed:\n{out}"
    )


@pytest.mark.step(4)
def test_program_trains_in_bf16_with_fp32_masters(kata):
    out = run_module_ok(KATA, "--steps", "1", "--precision", "bf16").stdout
    shown = f"`python -m katas.{KATA} --steps 1 --precision bf16`"
    for line, why in (
        ("in bf16, fp32 masters, the dp mean in fp32", "what --precision bf16 does"),
        ("one process's in the same policy to bf16's rounding", "its verdict, to bf16's rounding"),
    ):
        assert line in out, f"{shown} should print {line!r} ({why}); it printed:\n{out}"


# --------------------------------------------------------------------------- CUDA


def _step_on_cuda(rank, world_size):
    device = rank_gpu()
    kata = load_kata(KATA)
    dp, tp, pp = CAPSTONE
    mesh = kata.make_mesh(dp, tp, pp)
    model = make_transformer(SEED, blocks=BLOCKS).to(device)
    stage = kata.build_stage(model, mesh, recompute=True)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    tokens, targets = (t.to(device) for t in _global_batch(dp, 0))
    loss, norm = kata.train_step(stage, optimizer, tokens, targets, mesh, MAX_NORM)
    return {
        "place": (mesh.pp_index, mesh.dp_index, mesh.tp_index),
        "loss": loss,
        "norm": norm,
        "devices": sorted({p.device.type for p in stage.parameters()}),
        "weights": {n: p.detach().cpu() for n, p in stage.named_parameters()},
    }


@pytest.mark.step(4)
@pytest.mark.cuda
def test_one_step_on_8_gpus_equals_one_process_s(kata):
    """The capstone on NCCL, a GPU per rank (dp 2 x tp 2 x pp 2), every block recomputed: one
    train_step's loss, norm and weights against one process on the CPU. Its pieces move CUDA
    tensors on NCCL: k21's sends and receives, k28's all-reduces on the tp group, k33's float64
    all-reduces of the loss and the norm, the dp mean."""
    results = run_world(_step_on_cuda, 8, **on_cuda(8, "nccl", deadline=180))
    alone = _alone(steps=1)
    tp = CAPSTONE[1]
    for rank, got in enumerate(results):
        who = f"NCCL on CUDA, {_where(rank, got['place'])}"
        assert got["devices"] == ["cuda"], f"{who}: the stage's parameters are on {got['devices']}"
        assert math.isclose(got["loss"], alone["losses"][0], rel_tol=1e-4), (
            f"{who}: one step's loss is {got['loss']:.6f}, one process's {alone['losses'][0]:.6f}"
        )
        assert math.isclose(got["norm"], alone["norms"][0], rel_tol=1e-4), (
            f"{who}: one step's gradient norm is {got['norm']:.6f}, one process's "
            f"{alone['norms'][0]:.6f}"
        )
        for name, mine in got["weights"].items():
            want = _tp_slice(name, alone["weights"][name].detach(), tp, got["place"][2])
            assert close(mine, want, **TOLERANCE), (
                f"{who}: {name} after one clipped SGD step differs from one process's (its tp "
                f"slice): {gap(mine, want)}"
            )
