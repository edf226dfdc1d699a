"""k30 compressed gradients: the hook contract, fp16/bf16, PowerSGD's pieces and hook, bytes."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import RankCrashed, WorldDeadlock, run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import run_module_ok
from dojo.todo import KataTodo
from dojo.toy_models import (
    loss,
    make_batch,
    make_model,
    make_tokens,
    make_transformer,
    transformer_loss,
)

KATA = "k30_compressed_gradients"
MIB = 1 << 20
SPLIT = 280 / MIB  # a bucket cap below the toy models' size: several buckets
LR, MOMENTUM = 0.1, 0.9
FUTURES = (torch.futures.Future, torch._C.Future)  # work.get_future() and .then() give the latter


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"


def _sent_first(error: ValueError) -> bool:
    """Torch's own ValueError for a collective without a process group: it tried to send."""
    return "init_process_group" in str(error)


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _group(group_ranks):
    import torch.distributed as dist

    return dist.new_group(group_ranks) if group_ranks else None


class Bucket:
    """Stands in for ``dist.GradBucket``: a flat buffer and per-parameter views of it."""

    def __init__(self, values: torch.Tensor, shapes=None, index: int = 0, last: bool = True):
        self._buffer = values.clone()
        self._shapes = shapes or [tuple(values.shape)]
        self._index, self._last = index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for shape in self._shapes:
            count = math.prod(shape)
            views.append(self._buffer[offset : offset + count].view(shape))
            offset += count
        return views

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def _bucket_values(rank: int, count: int = 12, dtype=torch.float32) -> torch.Tensor:
    """Rank r's flat gradient: multiples of 6 (exact means over 2 and 3 ranks), some tiny."""
    base = torch.arange(1, count + 1, dtype=torch.float64) * 6 * (rank + 1)
    base[::3] *= -1
    return base.to(dtype)


def _call_hook(kata, name: str, dtype, group, values: torch.Tensor) -> dict:
    bucket = Bucket(values)
    with recording(("all_reduce",)) as calls:
        if name == "allreduce":
            future = kata.allreduce_hook(group, bucket)
        else:
            future = kata.compress_hook(dtype, group, bucket)
        result = future.wait() if isinstance(future, FUTURES) else None
    got = {
        "type": "Future" if isinstance(future, FUTURES) else type(future).__name__,
        "value_type": type(result).__name__,
        "calls": [(c.async_op, c.dtypes, c.bytes) for c in calls],
    }
    if isinstance(result, list) and result and isinstance(result[0], torch.Tensor):
        got["list_of"] = len(result)
    if isinstance(result, torch.Tensor):
        got["value"] = result.detach().clone()
    return got


def _hook_on_a_bucket(rank, world_size, name, dtype=None, group_ranks=None, scale=1.0):
    kata = load_kata(KATA)
    group = _group(group_ranks)
    if group_ranks and rank not in group_ranks:
        return None
    shard = rank if not group_ranks else group_ranks.index(rank)
    return _call_hook(kata, name, dtype, group, _bucket_values(shard) * scale)


def check_future(where: str, rank: int, got: dict) -> torch.Tensor:
    assert got["type"] == "Future", (
        f"{where}: rank {rank} got a {got['type']} back: a hook returns a torch.futures.Future "
        "whose value is the averaged flat buffer (dist.all_reduce(..., async_op=True) returns a "
        "work; work.get_future() is its Future)"
    )
    if "list_of" in got:
        raise AssertionError(
            f"{where}: rank {rank}'s Future holds a list of {got['list_of']} tensor(s), not a "
            "tensor: an all-reduce's future holds the list of tensors it reduced; DDP wants the "
            "tensor. Chain .then(lambda fut: fut.value()[0])"
        )
    assert "value" in got, (
        f"{where}: rank {rank}'s Future holds a {got['value_type']}, not the averaged buffer"
    )
    return got["value"]


# --------------------------------------------------------------------------- step 1: allreduce


@pytest.mark.step(1)
def test_allreduce_hook_returns_a_future_of_the_mean(kata):
    results = run_world(_hook_on_a_bucket, 3, "allreduce")
    values = [_bucket_values(r) for r in range(3)]
    mean, total = sum(v / 3 for v in values), sum(values)
    where = "allreduce_hook(None, bucket) on 3 ranks"
    for rank, got in enumerate(results):
        value = check_future(where, rank, got)
        if torch.equal(value, total):
            raise AssertionError(
                f"{where}: rank {rank}'s buffer holds the sum of the 3 ranks' gradients: DDP "
                "wants their mean; divide by the group's size (before the all-reduce, as DDP "
                "does: the sum of big gradients can overflow)"
            )
        assert torch.allclose(value, mean), (
            f"{where}: rank {rank} got {value[:4].tolist()}..., expected the mean "
            f"{mean[:4].tolist()}..."
        )
        assert len(got["calls"]) == 1, (
            f"{where}: rank {rank} made {len(got['calls'])} all-reduces for one bucket: one does"
        )
        assert got["calls"][0][0], (
            f"{where}: rank {rank}'s hook waited for its all-reduce before returning: DDP calls "
            "the hook while backward is still running, so that the bucket travels while the "
            "next gradients are computed. Call dist.all_reduce(..., async_op=True) and return "
            "its work's future (.get_future()), chained with .then(...)"
        )


@pytest.mark.step(1)
def test_allreduce_hook_on_a_subgroup(kata):
    try:
        results = run_world(_hook_on_a_bucket, 3, "allreduce", None, [1, 2], deadline=20)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            "allreduce_hook(group, bucket) with the group [1, 2] of a world of 3: ranks 1 and 2 "
            "waited in an all-reduce that rank 0, outside their group, never calls. The hook's "
            "state is the process group: all-reduce with group=process_group (None: the world)\n"
            + str(deadlock)
        ) from None
    values = [_bucket_values(r) for r in range(2)]
    mean = sum(v / 2 for v in values)
    for rank in (1, 2):
        value = check_future("allreduce_hook on the group [1, 2]", rank, results[rank])
        if torch.allclose(value, sum(values) / 3):
            raise AssertionError(
                f"allreduce_hook on the group [1, 2]: rank {rank} divided the sum by 3, the "
                "world's size: the mean is over the group's 2 ranks "
                "(dist.get_world_size(process_group), or process_group.size())"
            )
        assert torch.allclose(value, mean), (
            f"allreduce_hook on the group [1, 2]: rank {rank} got {value[:4].tolist()}..., "
            f"expected the group's mean {mean[:4].tolist()}..."
        )


def _state(model) -> dict:
    return {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}


def _largest(a: dict, b: dict) -> tuple[float, str]:
    return max((_difference(a[k], b[k]), k) for k in b)


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def _torch_hook(name: str):
    """Torch's own hook for ``name`` (allreduce, fp16, bf16, powersgd), usable on gloo CPU."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "allreduce": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": torch_bf16,
        "powersgd": torch_powersgd,
    }[name]


def torch_bf16(process_group, bucket):
    """Torch's bf16_compress_hook: DDP refuses to register a hook of that name without CUDA and
    NCCL (a check of the name alone), so it is called from here."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


@contextlib.contextmanager
def _finished_all_reduces():
    """Every async all-reduce waits before it returns, so that a future's ``.then`` runs at once.

    Torch's powerSGD_hook waits for its second and third all-reduces inside callbacks of the
    first one's future; on gloo those callbacks run on the group's own worker thread, which then
    waits for work queued behind itself: a deadlock (torch 2.x, gloo, CPU). With the work done
    before ``.then``, every callback runs in the calling thread: the same arithmetic, in order.
    """
    import torch.distributed as dist

    original = dist.all_reduce

    def finished(*args, **kwargs):
        work = original(*args, **kwargs)
        if kwargs.get("async_op") and work is not None:
            work.wait()
        return work

    dist.all_reduce = finished
    try:
        yield
    finally:
        dist.all_reduce = original


def torch_powersgd(state, bucket):
    """Torch's powerSGD_hook itself, its all-reduces finished before it chains on them."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    with _finished_all_reduces():
        return powerSGD_hook(state, bucket)


def _ddp(model, cap, group=None):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=cap, process_group=group)


def _batches(name: str, steps: int, shard: int):
    if name == "transformer":
        return [make_tokens(4, 1000 * step + shard) for step in range(steps)]
    return [make_batch(name, 4, 1000 * step + shard) for step in range(steps)]


def _model(name: str, seed: int):
    return make_transformer(seed) if name == "transformer" else make_model(name, seed)


def _loss(name: str, model, batch):
    if name == "transformer":
        return transformer_loss(model(batch[0]), batch[1])
    return loss(model, batch)


def _train_with(name, rank, model_name, steps, cap, make_state, group=None, shard=None):
    """Train ``model_name`` under torch's DDP with hook ``name`` (None: no hook); every step's
    state, and the hook's state."""
    kata = load_kata(KATA)
    model = _model(model_name, 100 + rank)
    ddp = _ddp(model, cap, group)
    hook_state = make_state(ddp) if make_state else None
    if name is not None:
        which, hook = name
        ddp.register_comm_hook(hook_state, getattr(kata, hook) if which == "ours" else hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    states = []
    for batch in _batches(model_name, steps, rank if shard is None else shard):
        optimizer.zero_grad()
        _loss(model_name, ddp, batch).backward()
        optimizer.step()
        states.append(_state(model))
    return states, hook_state


def _group_state(ddp):
    return ddp.process_group


def _against_plain(rank, world_size, steps, cap):
    ours, _ = _train_with(("ours", "allreduce_hook"), rank, "tied", steps, cap, _group_state)
    plain, _ = _train_with(None, rank, "tied", steps, cap, None)
    theirs, _ = _train_with(("torch", _torch_hook("allreduce")), rank, "tied", steps, cap, None)
    return {"ours": ours, "plain": plain, "torch": theirs}


@pytest.mark.step(1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_hook_trains_bitwise_like_ddp_without_a_hook(kata, world_size):
    # Without a hook DDP multiplies each gradient by 1/N as it copies it into the bucket; a hook
    # divides by N. On 2 ranks the two are the same number (a halving is exact), so the hook
    # must agree bitwise with plain DDP; on 3 it agrees bitwise with torch's allreduce_hook and
    # within an ulp or two with plain DDP.
    results = run_world(_against_plain, world_size, 3, SPLIT, deadline=40)
    reference = "DDP without a hook" if world_size == 2 else "torch's allreduce_hook"
    for rank, got in enumerate(results):
        others = got["plain"] if world_size == 2 else got["torch"]
        for step, (ours, theirs) in enumerate(zip(got["ours"], others)):
            assert _equal(ours, theirs), (
                f"DDP with allreduce_hook on {world_size} ranks: after step {step + 1} rank "
                f"{rank}'s parameters differ from {reference}'s by up to "
                f"{_largest(ours, theirs)[0]:.3g} ({_largest(ours, theirs)[1]!r}): divide "
                "bucket.buffer() by the group's size, then sum it over the group"
            )
        for ours, plain in zip(got["ours"], got["plain"]):
            assert all(torch.allclose(ours[k], plain[k], rtol=1e-5, atol=1e-7) for k in plain)


# --------------------------------------------------------------------------- step 2: fp16, bf16

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.step(2)
@pytest.mark.parametrize("name", list(DTYPES))
def test_compress_hook_all_reduces_16_bits_and_returns_the_buckets_dtype(kata, name):
    dtype = DTYPES[name]
    results = run_world(_hook_on_a_bucket, 2, "compress", dtype)
    mean = sum(_bucket_values(r) / 2 for r in range(2))
    where = f"compress_hook(torch.{str(dtype).split('.')[-1]}, None, bucket) on 2 ranks"
    wanted = str(dtype).removeprefix("torch.")
    for rank, got in enumerate(results):
        value = check_future(where, rank, got)
        carried = [dtypes for _, dtypes, _ in got["calls"]]
        assert carried == [[wanted]], (
            f"{where}: rank {rank}'s all-reduces carried {carried}, expected one of {wanted}: "
            f"compression is the bytes on the wire; all-reduce a {wanted} copy of the bucket "
            "(buffer.to(dtype)), not the buffer itself"
        )
        assert value.dtype == torch.float32 and value.shape == mean.shape, (
            f"{where}: rank {rank}'s Future holds a {value.dtype} tensor of shape "
            f"{tuple(value.shape)}, the bucket a float32 one of {tuple(mean.shape)}: decompress, "
            "copy the reduced values back into the bucket's buffer (buffer.copy_(...)) and "
            "return that"
        )
        assert torch.allclose(value, mean, rtol=1e-2), (
            f"{where}: rank {rank} got {value[:4].tolist()}..., expected about the mean "
            f"{mean[:4].tolist()}..."
        )
        assert got["calls"][0][0], (
            f"{where}: rank {rank}'s hook waited for its all-reduce: use async_op=True and chain "
            "the decompression on the work's future with .then(...)"
        )


@pytest.mark.step(2)
def test_compress_hook_refuses_what_is_not_16_bit_floats(kata):
    for dtype in (torch.float32, torch.int8):
        try:
            kata.compress_hook(dtype, None, Bucket(_bucket_values(0)))
        except ValueError as error:
            if not _sent_first(error):
                continue
            raise AssertionError(
                f"compress_hook({dtype}, ...) tried to all-reduce before refusing ({error}): "
                "check the dtype first and raise ValueError saying what to pass"
            ) from None
        except KataTodo:
            raise
        except Exception as error:
            raise AssertionError(
                f"compress_hook({dtype}, ...) raised {_failure(error)}: refuse any dtype but "
                "torch.float16 and torch.bfloat16 with a ValueError saying so, before anything "
                "is cast or sent"
            ) from None
        raise AssertionError(
            f"compress_hook({dtype}, ...) did not refuse: it compresses to torch.float16 or "
            "torch.bfloat16 only; raise ValueError for anything else"
        )


@pytest.mark.step(2)
def test_fp16_compression_does_not_overflow_on_large_gradients(kata):
    # 2500 * k * (rank + 1), k up to 12: 30000 on rank 0, 60000 on rank 1, each below fp16's
    # largest number (65504), their sum above it
    results = run_world(_hook_on_a_bucket, 2, "compress", torch.float16, None, 2500.0 / 6)
    for rank, got in enumerate(results):
        value = check_future("compress_hook(torch.float16, ...) on large gradients", rank, got)
        expected = sum(_bucket_values(r) * 2500.0 / 6 / 2 for r in range(2))
        if not torch.isfinite(value).all():
            raise AssertionError(
                f"compress_hook(torch.float16, ...) on gradients up to 60000 (the mean up to "
                f"45000): rank {rank} got {value[-4:].tolist()}: the sum of the ranks' "
                "gradients overflowed fp16 (65504 at most). Divide by the group's size before "
                "the all-reduce, in fp16, not after"
            )
        assert torch.allclose(value, expected, rtol=1e-2), (
            f"compress_hook(torch.float16, ...) on large gradients: rank {rank} got "
            f"{value[-4:].tolist()}, expected about {expected[-4:].tolist()}"
        )


def _against_torch_compression(rank, world_size, name, steps):
    mine, _ = _train_with(("ours", f"{name}_hook"), rank, "frozen", steps, SPLIT, _group_state)
    theirs, _ = _train_with(("torch", _torch_hook(name)), rank, "frozen", steps, SPLIT, None)
    return {"ours": mine, "torch": theirs}


@pytest.mark.step(2)
@pytest.mark.parametrize("name, world_size", [("fp16", 2), ("fp16", 3), ("bf16", 2)])
def test_compression_trains_bitwise_like_torchs_hook(kata, name, world_size):
    torchs = f"{name}_compress_hook"
    results = run_world(_against_torch_compression, world_size, name, 3, deadline=40)
    for rank, got in enumerate(results):
        for step, (ours, theirs) in enumerate(zip(got["ours"], got["torch"])):
            if _equal(ours, theirs):
                continue
            difference, key = _largest(ours, theirs)
            raise AssertionError(
                f"DDP with {name}_hook (your compress_hook) on {world_size} ranks: after step "
                f"{step + 1} rank {rank}'s {key!r} differs by up to {difference:.3g} from DDP "
                f"with torch's {torchs}. Torch casts first and divides in 16 bits, "
                "buffer.to(dtype).div_(N): dividing in fp32 and then casting rounds "
                "differently (and all-reducing in fp32 sends twice the bytes)"
            )


# ------------------------------------------------------------------ step 3: PowerSGD's pieces


def _torch_orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    _orthogonalize(matrices, epsilon)
    return matrices


ORTHOGONALIZE = [  # (batch, n, r), dtype
    ((1, 8, 1), torch.float32),
    ((3, 8, 2), torch.float32),
    ((2, 10, 4), torch.float32),
    ((1, 12, 3), torch.float16),
]


def _random(shape, dtype, seed) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.mark.step(3)
def test_orthogonalize_gives_orthonormal_columns(kata):
    for number, (shape, dtype) in enumerate(ORTHOGONALIZE):
        matrices = _random(shape, dtype, number)
        original = matrices.clone()
        got = kata.orthogonalize(matrices)
        where = f"orthogonalize(a {dtype} batch of shape {shape})"
        assert got is matrices or (got is None and not torch.equal(matrices, original)), (
            f"{where} returned a new tensor and left its argument as it was: it works in place "
            "(PowerSGD orthogonalises views of its P and Q memory), and returns the argument"
        )
        gram = matrices.double().transpose(1, 2) @ matrices.double()
        identity = torch.eye(shape[2], dtype=torch.float64).expand_as(gram)
        tolerance = 1e-2 if dtype == torch.float16 else 1e-5
        norms = gram.diagonal(dim1=1, dim2=2)
        assert torch.allclose(norms, torch.ones_like(norms), atol=tolerance), (
            f"{where}: the columns' squared norms are {norms.tolist()}, expected 1 each: divide "
            "each column of each matrix by its own norm over its n entries (dim=1, keepdim)"
        )
        assert torch.allclose(gram, identity, atol=tolerance), (
            f"{where}: the columns are unit vectors but not orthogonal (Q^T Q = "
            f"{gram[0].tolist()}): subtract from every later column its projection on column i "
            "after normalising column i"
        )


@pytest.mark.step(3)
def test_orthogonalize_equals_torchs_bitwise(kata):
    cases = [*ORTHOGONALIZE, ((2, 6, 2), torch.float32)]
    for number, (shape, dtype) in enumerate(cases):
        mine = _random(shape, dtype, 10 + number)
        if number == len(cases) - 1:
            mine[1, :, 0] = 0  # a column of zeros: epsilon keeps it finite
        theirs = mine.clone()
        epsilon = 1e-8 if number == len(cases) - 1 else 0.0
        kata.orthogonalize(mine, epsilon)
        _torch_orthogonalize(theirs, epsilon)
        if torch.equal(mine, theirs):
            continue
        where = f"orthogonalize(a {dtype} batch of shape {shape}, epsilon={epsilon:g})"
        if shape[2] > 2 and dtype == torch.float32:
            raise AssertionError(
                f"{where} differs from torch's _orthogonalize by up to "
                f"{_difference(mine, theirs):.3g}: for more than 2 columns in full precision "
                "torch uses a QR factorisation, torch.linalg.qr(matrices, out=(matrices, "
                "<an empty (batch, r, r) tensor>)); Gram-Schmidt below that and in 16 bits"
            )
        raise AssertionError(
            f"{where} differs from torch's _orthogonalize by up to "
            f"{_difference(mine, theirs):.3g}: torch's Gram-Schmidt takes column i, divides it "
            "by torch.linalg.vector_norm(column, dim=1, keepdim=True) (+ epsilon when epsilon "
            "is not 0), then subtracts from all later columns at once their projections, "
            "rest -= torch.sum(column * rest, dim=1, keepdim=True) * column"
        )


def _matrices(rank: int, shapes, low_rank: bool = False) -> list[torch.Tensor]:
    out = []
    for number, (n, m) in enumerate(shapes):
        generator = torch.Generator().manual_seed(100 * number + rank)
        if low_rank:  # every rank's matrix a multiple of one u v^T: the mean has rank 1
            shared = torch.Generator().manual_seed(100 * number)
            u, v = torch.randn(n, 1, generator=shared), torch.randn(m, 1, generator=shared)
            out.append(((rank + 1) * u @ v.T).unsqueeze(0))
        else:
            out.append(torch.randn(1, n, m, generator=generator))
    return out


def _qs(shapes, rank_r: int) -> list[torch.Tensor]:
    qs = []
    for number, (_, m) in enumerate(shapes):
        q = torch.randn(1, m, rank_r, generator=torch.Generator().manual_seed(7 + number))
        qs.append(_torch_orthogonalize(q))
    return qs


def _low_rank(rank, world_size, shapes, rank_r, low_rank):
    kata = load_kata(KATA)
    matrices = _matrices(rank, shapes, low_rank)
    qs = [q.clone() for q in _qs(shapes, rank_r)]
    with recording(("all_reduce",)) as calls:
        ps = kata.low_rank_mean(matrices, qs)
    return {
        "matrices": matrices,
        "qs": qs,
        "ps": ps,
        "calls": [(c.shapes, c.bytes) for c in calls],
    }


def _reference_round(world_size, shapes, rank_r, low_rank):
    """Torch's pieces in one process: sums over ranks as gloo adds two ranks' terms."""
    every = [_matrices(r, shapes, low_rank) for r in range(world_size)]
    qs = _qs(shapes, rank_r)
    out = {"matrices": [], "qs": [], "ps": [], "mean": []}
    for i in range(len(shapes)):
        ms = [every[r][i] for r in range(world_size)]
        p = torch.bmm(ms[0], qs[i]) + sum(torch.bmm(m, qs[i]) for m in ms[1:])
        _torch_orthogonalize(p)
        q = torch.bmm(ms[0].transpose(1, 2), p)
        for m in ms[1:]:
            q = q + torch.bmm(m.transpose(1, 2), p)
        q = q / world_size
        out["ps"].append(p)
        out["qs"].append(q)
        out["matrices"].append(torch.bmm(p, q.transpose(1, 2)))
        out["mean"].append(sum(ms) / world_size)
    return out


SHAPES = [(6, 4), (5, 7), (6, 4)]


def check_round(where, results, world_size, shapes, rank_r, low_rank, exact_mean):
    reference = _reference_round(world_size, shapes, rank_r, low_rank)
    for rank, got in enumerate(results):
        for i, (mine, mean) in enumerate(zip(got["matrices"], reference["mean"])):
            if not exact_mean:
                break
            if torch.allclose(mine, mean * world_size, atol=1e-4):
                raise AssertionError(
                    f"{where}: rank {rank}'s matrix {i} became {world_size} times the mean: "
                    f"the all-reduce sums the ranks' Qs; divide Q by the group's size "
                    f"({world_size}) after it"
                )
            assert torch.allclose(mine, mean, atol=1e-4), (
                f"{where}: rank {rank}'s matrix {i} differs by up to "
                f"{_difference(mine, mean):.3g} from the mean over the ranks, which a rank-"
                f"{rank_r} approximation must hold exactly here. P = M Q summed over the ranks, "
                "its columns orthonormalised (orthogonalize), then Q = M^T P summed and divided "
                "by N: P Q^T is then the mean projected on P's columns"
            )
        assert isinstance(got["ps"], list) and len(got["ps"]) == len(shapes), (
            f"{where}: rank {rank} returned {type(got['ps']).__name__}: return the list of Ps"
        )
        for i in range(len(shapes)):
            for what in ("matrices", "ps", "qs"):
                mine, theirs = got[what][i], reference[what][i]
                if world_size == 2 and torch.equal(mine, theirs):
                    continue
                if world_size != 2 and torch.allclose(mine, theirs, atol=1e-5):
                    continue
                if what == "qs":
                    raise AssertionError(
                        f"{where}: rank {rank}'s qs[{i}] does not hold the new Q (M^T P summed "
                        "and divided by N): write it into the Q given (torch.bmm(..., out=q) "
                        "or q.copy_(...)): the next step starts from it (warm start)"
                    )
                raise AssertionError(
                    f"{where}: rank {rank}'s {what}[{i}] differs by up to "
                    f"{_difference(mine, theirs):.3g} from torch's pieces (torch.bmm, "
                    "_orthogonalize, the all-reduced sums): P = bmm(M, Q), all-reduce, "
                    "orthogonalize(P); Q = bmm(M^T, P), all-reduce, / N; M = bmm(P, Q^T)"
                )


@pytest.mark.step(3)
@pytest.mark.parametrize("case", ["full rank", "a rank-1 mean"], ids=["full_rank", "rank_1_mean"])
def test_low_rank_mean_is_exact_where_the_mean_has_that_rank(kata, case):
    shapes = [(6, 4), (4, 5)] if case == "full rank" else SHAPES
    rank_r = 4 if case == "full rank" else 1
    low_rank = case != "full rank"
    results = run_world(_low_rank, 2, shapes, rank_r, low_rank)
    where = f"low_rank_mean on 2 ranks, rank {rank_r}, {case}"
    check_round(where, results, 2, shapes, rank_r, low_rank, exact_mean=True)


@pytest.mark.step(3)
def test_low_rank_mean_all_reduces_every_p_and_every_q_at_once(kata):
    results = run_world(_low_rank, 3, SHAPES, 2, False)
    check_round("low_rank_mean on 3 ranks, rank 2", results, 3, SHAPES, 2, False, False)
    p_bytes = sum(n * 2 * 4 for n, _ in SHAPES)
    q_bytes = sum(m * 2 * 4 for _, m in SHAPES)
    for rank, got in enumerate(results):
        sent = [b for _, b in got["calls"]]
        assert sent == [p_bytes, q_bytes], (
            f"low_rank_mean of {len(SHAPES)} matrices {SHAPES} at rank 2 on 3 ranks: rank {rank} "
            f"made all-reduces of {sent} bytes, expected two: every P at once ({p_bytes} bytes) "
            f"and then every Q at once ({q_bytes}): each all-reduce costs a latency, so torch "
            "packs a bucket's Ps into one flat tensor, and its Qs into another"
        )


@pytest.mark.step(3)
def test_low_rank_mean_refuses_a_rank_larger_than_the_matrix(kata):
    cases = [
        ("a 3x5 matrix at rank 4", [torch.zeros(1, 3, 5)], [torch.zeros(1, 5, 4)]),
        ("a Q of the wrong length", [torch.zeros(1, 3, 5)], [torch.zeros(1, 4, 1)]),
    ]
    for what, matrices, qs in cases:
        try:
            kata.low_rank_mean(matrices, qs)
        except ValueError as error:
            if not _sent_first(error):
                continue
            raise AssertionError(
                f"low_rank_mean with {what} tried to all-reduce before refusing ({error}): "
                "check the shapes first (a rank of at most min(n, m); Q of shape (1, m, r)) and "
                "raise ValueError saying what is wrong"
            ) from None
        except KataTodo:
            raise
        except Exception as error:
            raise AssertionError(
                f"low_rank_mean with {what} raised {_failure(error)}: check the shapes first "
                "and raise ValueError saying what is wrong and what to do (a rank of at most "
                "min(n, m); Q of shape (1, m, r)), before anything is sent"
            ) from None
        raise AssertionError(
            f"low_rank_mean with {what} did not refuse: raise ValueError (a rank above min(n, m) "
            "cannot be orthonormalised, a Q of another length does not multiply M)"
        )


# --------------------------------------------------------------------------- step 4: the hook

POWERSGD = {  # name: (model, steps, cap, PowerSGDState settings)
    "plain start": ("frozen", 3, SPLIT, {"start_powerSGD_iter": 4}),
    "cold": (
        "frozen",
        4,
        SPLIT,
        {"start_powerSGD_iter": 2, "warm_start": False, "use_error_feedback": False},
    ),
    "warm start": ("tied", 5, SPLIT, {"start_powerSGD_iter": 2, "use_error_feedback": False}),
    "error feedback": ("tied", 5, SPLIT, {"start_powerSGD_iter": 2, "warm_start": False}),
    "both": ("frozen", 5, SPLIT, {"start_powerSGD_iter": 2}),
    "rank 2": ("tied", 4, None, {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2}),
    "rank 4": ("tied", 4, None, {"start_powerSGD_iter": 3, "matrix_approximation_rank": 4}),
    "min rate": ("frozen", 4, None, {"start_powerSGD_iter": 2, "min_compression_rate": 4}),
    "transformer": ("transformer", 4, None, {"start_powerSGD_iter": 2, "random_seed": 5}),
}


def _powersgd_state(settings):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    def make(ddp):
        return PowerSGDState(ddp.process_group, **settings)

    return make


def _hook_facts(state) -> dict:
    return {
        "iter": state.iter,
        "error": {k: v.clone() for k, v in state.error_dict.items()},
        "q": {k: v.clone() for k, v in state.q_memory_dict.items()},
        "rng": state.rng.randint(1 << 30),
    }


def _against_torch_powersgd(rank, world_size, case):
    model_name, steps, cap, settings = POWERSGD[case]
    make = _powersgd_state(settings)
    ours, our_state = _train_with(("ours", "powersgd_hook"), rank, model_name, steps, cap, make)
    theirs, their_state = _train_with(("torch", torch_powersgd), rank, model_name, steps, cap, make)
    plain, _ = _train_with(None, rank, model_name, steps, cap, None)
    return {
        "ours": ours,
        "torch": theirs,
        "plain": plain,
        "our_state": _hook_facts(our_state),
        "torch_state": _hook_facts(their_state),
    }


def check_powersgd(case, results):
    _, steps, cap, settings = POWERSGD[case]
    start = settings["start_powerSGD_iter"]
    where = f"powersgd_hook ({case}: {settings}), {steps} steps on 2 ranks"
    for rank, got in enumerate(results):
        mine, theirs = got["our_state"], got["torch_state"]
        for step, (ours, torchs) in enumerate(zip(got["ours"], got["torch"])):
            if _equal(ours, torchs):
                continue
            difference, key = _largest(ours, torchs)
            said = (
                f"{where}: after step {step + 1} rank {rank}'s {key!r} differs by up to "
                f"{difference:.3g} from torch's powerSGD_hook with the same settings"
            )
            if step < start:
                raise AssertionError(
                    f"{said}. The first start_powerSGD_iter ({start}) steps are plain "
                    "all-reduces (allreduce_hook), with state.iter counted once a step (at "
                    "the bucket for which bucket.is_last())"
                )
            if step == start and _equal(ours, got["plain"][step]):
                raise AssertionError(
                    f"{said}: in step {step + 1}, the first that torch compresses, your hook "
                    "was still a plain all-reduce: compress once state.iter reaches "
                    "start_powerSGD_iter (plain while state.iter < state.start_powerSGD_iter; "
                    "iter counts the steps done, from 0)"
                )
            if step == start:
                raise AssertionError(
                    f"{said}: the first compressed step. Check which tensors are compressed "
                    "(each a matrix tensor.view(shape[0], -1), at rank min(n, m, "
                    "matrix_approximation_rank), when (n + m) * rank * min_compression_rate < "
                    "n * m; the others all-reduced as they are and divided by N), the random "
                    "Q (torch.manual_seed(state.rng.randint(1_000_000_000)) inside "
                    "torch.random.fork_rng(devices=[]), then torch.randn(*q.shape) on the CPU "
                    "for each Q in order, the matrices grouped by shape, each orthogonalised)"
                    + (
                        ", the error feedback's first step"
                        if settings.get("use_error_feedback", True)
                        else ""
                    )
                )
            hints = []
            if settings.get("warm_start", True):
                hints.append(
                    "warm start: keep each bucket's Qs (state.q_memory_dict[bucket.index()]) "
                    "and start the next step from them, orthogonalised again, without drawing"
                )
            else:
                hints.append(
                    "without warm start every compressed step draws fresh random Qs (the next "
                    "state.rng.randint) and keeps no memory"
                )
            if settings.get("use_error_feedback", True):
                hints.append(
                    "error feedback: add state.error_dict[bucket.index()] to the bucket before "
                    "compressing, and afterwards keep there what this rank's bucket lost: its "
                    "input (after adding) minus its output"
                )
            raise AssertionError(
                f"{said}, though the first compressed step agreed: " + "; ".join(hints)
            )
        assert mine["iter"] == theirs["iter"], (
            f"{where}: rank {rank}'s state.iter is {mine['iter']}, torch's {theirs['iter']}: "
            "count a step once (state.maybe_increase_iter(bucket) counts at the last bucket)"
        )
        for what, label in (("error", "error_dict"), ("q", "q_memory_dict")):
            assert sorted(mine[what]) == sorted(theirs[what]), (
                f"{where}: rank {rank}'s state.{label} has the buckets {sorted(mine[what])}, "
                f"torch's {sorted(theirs[what])}"
            )
            for index, value in theirs[what].items():
                assert torch.equal(mine[what][index].reshape(-1), value), (
                    f"{where}: rank {rank}'s state.{label}[{index}] differs from torch's: keep "
                    "it as torch does (one flat tensor a bucket)"
                )
        assert mine["rng"] == theirs["rng"], (
            f"{where}: rank {rank}'s state.rng drew other numbers than torch's: draw once per "
            "random initialisation of a bucket's Qs, state.rng.randint(1_000_000_000)"
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("case", list(POWERSGD))
def test_powersgd_hook_trains_bitwise_like_torchs(kata, case):
    try:
        results = run_world(_against_torch_powersgd, 2, case, deadline=15)
    except RankCrashed as crash:
        if "Received data size" not in str(crash) or "wait()" not in str(crash):
            raise
        # the same callback wait, met as gloo's thread takes the next message out of turn
        raise AssertionError(
            f"powersgd_hook ({case}) on 2 ranks under torch's DDP: a rank crashed inside "
            "backward, in your hook, waiting for an all-reduce: gloo received a message of "
            "another size than the one it waited for. If your hook waits inside a future's "
            "callback (as torch's own hook does: .then(...) callbacks that call .wait()), that "
            "is why: the callback runs on the process group's own thread. Make the all-reduces "
            "synchronous (dist.all_reduce(t, group=group)) and return a Future that is already "
            "done (fut = torch.futures.Future(); fut.set_result(buffer)); else your ranks' "
            "all-reduces in the hook differ in order or size\n" + str(crash)
        ) from None
    except WorldDeadlock as deadlock:
        raise AssertionError(
            f"powersgd_hook ({case}) on 2 ranks under torch's DDP: both ranks stopped inside "
            "backward, in your hook. Waiting for an all-reduce inside a future's callback (as "
            "torch's own hook does: .then(...) callbacks that call .wait()) deadlocks on gloo: "
            "the callback runs on the process group's own thread, which then waits for work "
            "queued behind itself. Make the all-reduces synchronous (dist.all_reduce(t, "
            "group=group)) and return a Future that is already done (fut = "
            "torch.futures.Future(); fut.set_result(buffer))\n" + str(deadlock)
        ) from None
    check_powersgd(case, results)


@pytest.mark.step(4)
def test_powersgd_hook_refuses_batched_same_shape_states(kata):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    state = PowerSGDState(None, start_powerSGD_iter=2, batch_tensors_with_same_shape=True)
    state.iter = 5
    try:
        kata.powersgd_hook(state, Bucket(_bucket_values(0)))
    except ValueError as error:
        if not _sent_first(error):
            return
        raise AssertionError(
            f"powersgd_hook with batch_tensors_with_same_shape=True tried to all-reduce "
            f"({error}): this hook compresses each tensor alone; refuse that setting with a "
            "ValueError before anything is sent"
        ) from None
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(
            f"powersgd_hook with batch_tensors_with_same_shape=True raised {_failure(error)}: "
            "this hook compresses each tensor alone, so refuse that setting with a ValueError "
            "(saying to make the state with batch_tensors_with_same_shape=False) before "
            "anything is sent"
        ) from None
    raise AssertionError(
        "powersgd_hook with batch_tensors_with_same_shape=True did not refuse: this hook "
        "compresses each tensor alone; raise ValueError rather than train differently from torch"
    )


# ------------------------------------------------------------------ step 5: registering, bytes


def _register(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    kata = load_kata(KATA)
    sub = dist.new_group([1, 2])
    if rank == 0:
        return None
    out = {}
    cases = {
        "powersgd, a state for the world": ("powersgd", lambda: PowerSGDState(None)),
        "fp16, the world's group": ("fp16", lambda: dist.group.WORLD),
        "an unknown method": ("int8", lambda: None),
        "powersgd, a process group for state": ("powersgd", lambda: sub),
    }
    for what, (method, state) in cases.items():
        ddp = _ddp(make_model("frozen", 1), 25.0, sub)
        try:
            kata.register_compression(ddp, method, state())
        except ValueError:
            out[what] = None
            continue
        except KataTodo:
            raise
        except Exception as error:
            out[what] = _failure(error)
            continue
        out[what] = "registered"
    for method in ("allreduce", "fp16", "bf16", "powersgd"):
        ddp = _ddp(make_model("frozen", 1), 25.0, sub)
        state = kata.register_compression(ddp, method)
        if method == "powersgd":
            out[method] = (
                type(state).__name__,
                getattr(state, "process_group", None) is sub,
            )
        else:
            out[method] = state is sub or state is None
    return out


@pytest.mark.step(5)
def test_register_compression_refuses_a_state_for_another_group(kata):
    results = run_world(_register, 3, deadline=30)
    for rank in (1, 2):
        got = results[rank]
        for what, outcome in got.items():
            if what in ("allreduce", "fp16", "bf16", "powersgd"):
                continue
            assert outcome is None, (
                f"rank {rank}: register_compression(<a DDP on the group [1, 2]>, {what}) "
                + (
                    "registered it: its all-reduces would average over other ranks than "
                    "DDP's. Refuse with a ValueError (the state's group must be the DDP's, "
                    "ddp.process_group)"
                    if outcome == "registered"
                    else f"raised {outcome}: raise ValueError saying what was wrong"
                )
                if "unknown" not in what
                else f"did not raise ValueError ({outcome}): name the methods there are"
            )
        assert got["powersgd"] == ("PowerSGDState", True), (
            f"rank {rank}: register_compression(ddp, 'powersgd') with no state returned "
            f"{got['powersgd']}: make a PowerSGDState on the DDP's group (ddp.process_group)"
        )
        for method in ("allreduce", "fp16", "bf16"):
            assert got[method], (
                f"rank {rank}: register_compression(ddp, {method!r}) returned a state that is "
                "not the DDP's group"
            )


def _bytes(rank, world_size, model_name, method, settings, ours):
    kata = load_kata(KATA)
    if model_name == "convnet":
        from dojo.models import ConvNet

        torch.manual_seed(3)
        model = ConvNet()
    else:
        model = _model(model_name, 3)
    ddp = _ddp(model, 25.0)
    if method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        state = PowerSGDState(ddp.process_group, start_powerSGD_iter=2, **settings)
    else:
        state = ddp.process_group
    if ours:
        kata.register_compression(ddp, method, state)
    else:
        ddp.register_comm_hook(state, _torch_hook(method))
    sent = []
    for step in range(3):
        if model_name == "convnet":
            generator = torch.Generator().manual_seed(step)
            batch = torch.randn(4, 1, 28, 28, generator=generator), torch.arange(4)
            outputs = ddp(batch[0])
            step_loss = torch.nn.functional.cross_entropy(outputs, batch[1])
        else:
            step_loss = _loss(model_name, ddp, _batches(model_name, 1, 10 * step + rank)[0])
        with recording(("all_reduce",)) as calls:
            step_loss.backward()
        sent.append(sum(c.bytes for c in calls))
    predicted = kata.bytes_per_step(model, method, **settings)
    return {"sent": sent, "predicted": predicted}


BYTES = {
    "allreduce": ("convnet", "allreduce", {}),
    "fp16": ("convnet", "fp16", {}),
    "powersgd": ("convnet", "powersgd", {}),
    "powersgd rank 2": ("transformer", "powersgd", {"matrix_approximation_rank": 2}),
    "powersgd rate 8": ("frozen", "powersgd", {"min_compression_rate": 8}),
}


@pytest.mark.step(5)
@pytest.mark.parametrize("case", list(BYTES))
def test_bytes_per_step_is_what_torchs_hooks_send(kata, case):
    model_name, method, settings = BYTES[case]
    results = run_world(_bytes, 2, model_name, method, settings, False, deadline=40)
    for rank, got in enumerate(results):
        sent, predicted = got["sent"][-1], got["predicted"]
        assert predicted == sent, (
            f"bytes_per_step({model_name} model, {method!r}, {settings}) says {predicted}, but "
            f"with torch's hook rank {rank} put {sent} bytes into all-reduces in a step "
            + ("(after PowerSGD started) " if method == "powersgd" else "")
            + ": count every trained parameter once (DDP reduces only those), its element "
            "size for allreduce, 2 bytes for fp16/bf16; for PowerSGD a matrix (shape[0], rest) "
            "sends (n + m) * r elements when (n + m) * r * min_compression_rate < n * m (r = "
            "min(n, m, rank)), and n * m otherwise"
        )


def _bytes_ours(rank, world_size):
    return {
        method: _bytes(rank, world_size, "convnet", method, {}, True)
        for method in ("allreduce", "fp16", "bf16", "powersgd")
    }


@pytest.mark.step(5)
def test_your_hooks_send_what_bytes_per_step_says(kata):
    results = run_world(_bytes_ours, 2, deadline=60)
    plain = results[0]["allreduce"]["predicted"]
    for rank, got in enumerate(results):
        for method, facts in got.items():
            assert facts["sent"][-1] == facts["predicted"], (
                f"the ConvNet under DDP with register_compression(ddp, {method!r}): rank {rank} "
                f"sent {facts['sent'][-1]} bytes in a step, bytes_per_step says "
                f"{facts['predicted']}"
            )
    half, powersgd = results[0]["fp16"]["predicted"], results[0]["powersgd"]["predicted"]
    assert half * 2 == plain, (
        f"the ConvNet: fp16 sends {half} bytes a step, plain DDP {plain}: 2 bytes a parameter "
        "instead of 4 is half"
    )
    assert powersgd * 10 < plain, (
        f"the ConvNet: PowerSGD at rank 1 sends {powersgd} bytes a step, plain DDP {plain}: "
        "expected more than 10 times less"
    )


def _accuracy(rank, world_size, method, steps):
    kata = load_kata(KATA)
    return kata.train_digits(rank, world_size, method, steps, 16, 0.02, 0, 1, 10)


@pytest.mark.step(5)
@pytest.mark.parametrize("method", ["allreduce", "powersgd"])
def test_compressed_training_on_the_convnet_learns_the_digits(kata, method):
    results = run_world(_accuracy, 2, method, 25, deadline=90)
    for rank, got in enumerate(results):
        assert got["accuracy"] > 0.7, (
            f"the ConvNet on the digits, 2 ranks, 25 steps with {method}: rank {rank}'s "
            f"held-out accuracy is {got['accuracy']:.1%} (losses {got['losses'][::5]})"
        )


@pytest.mark.step(5)
def test_program_compares_the_methods(kata):
    out = run_module_ok(
        KATA, "--world-size", "2", "--steps", "3", "--start", "2", "--methods",
        "allreduce,fp16,powersgd", "--per-rank", "4", timeout=180,
    ).stdout  # fmt: skip
    rows = {line.split()[1]: line.split()[2:] for line in out.splitlines() if "%" in line}
    for method in ("allreduce", "fp16", "powersgd"):
        assert method in rows, f"the program shows no row for {method}:\n{out}"
    sent = {method: int(rows[method][0].replace(",", "")) for method in rows}
    assert sent["fp16"] * 2 == sent["allreduce"] > 10 * sent["powersgd"], (
        f"the program's bytes per step should be plain DDP's, half, and PowerSGD's far less:\n{out}"
    )


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size, case):
    return _against_torch_powersgd_on(rank, case, rank_gpu())


def _against_torch_powersgd_on(rank, case, device):
    model_name, steps, cap, settings = POWERSGD[case]
    make = _powersgd_state(settings)
    kata = load_kata(KATA)
    out = {}
    for which, hook in (("ours", kata.powersgd_hook), ("torch", torch_powersgd)):
        model = _model(model_name, 100 + rank).to(device)
        ddp = _ddp(model, cap)
        ddp.register_comm_hook(make(ddp), hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        for batch in _batches(model_name, steps, rank):
            batch = tuple(t.to(device) for t in batch)
            optimizer.zero_grad()
            _loss(model_name, ddp, batch).backward()
            optimizer.step()
        out[which] = _state(model)
    return out


def _compression_on_cuda(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    device = rank_gpu()
    kata = load_kata(KATA)
    hooks = {
        "fp16": (kata.fp16_hook, default_hooks.fp16_compress_hook),
        "bf16": (kata.bf16_hook, default_hooks.bf16_compress_hook),  # by name: NCCL allows it
    }
    out = {}
    for name, pair in hooks.items():
        for which, hook in zip(("ours", "torch"), pair):
            model = _model("frozen", 100 + rank).to(device)
            ddp = _ddp(model, SPLIT)
            ddp.register_comm_hook(None, hook)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
            for batch in _batches("frozen", 3, rank):
                optimizer.zero_grad()
                _loss("frozen", ddp, tuple(t.to(device) for t in batch)).backward()
                optimizer.step()
            out[(name, which)] = _state(model)
    return out


@pytest.mark.step(2)
@pytest.mark.cuda
def test_compression_like_torchs_on_nccl(kata):
    results = run_world(_compression_on_cuda, 1, **on_cuda(1, "nccl", deadline=120))
    for name in ("fp16", "bf16"):
        ours, theirs = results[0][(name, "ours")], results[0][(name, "torch")]
        assert _equal(ours, theirs), (
            f"NCCL on CUDA: DDP with your {name}_hook differs from torch's {name}_compress_hook "
            f"by up to {_largest(ours, theirs)[0]:.3g}"
        )


@pytest.mark.step(4)
@pytest.mark.cuda
@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 2)])
def test_powersgd_hook_like_torchs_on_cuda(kata, backend, world_size):
    results = run_world(_on_cuda, world_size, "both", **on_cuda(world_size, backend, deadline=120))
    for rank, got in enumerate(results):
        difference, key = _largest(got["ours"], got["torch"])
        assert difference < 1e-5, (
            f"{backend} on CUDA, {world_size} rank(s): rank {rank}'s {key!r} differs by up to "
            f"{difference:.3g} from torch's powerSGD_hook"
        )
