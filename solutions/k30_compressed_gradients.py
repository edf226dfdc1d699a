"""k30 · Compressed gradients: DDP communication hooks, fp16/bf16 and PowerSGD.

THE IDEA
    DDP spends its communication on one thing: every step, every rank sends its whole gradient
    (4 bytes a parameter) into an all-reduce. When the network, not the GPU, is what a step
    waits for, send fewer bytes. DDP lets you say how a bucket is reduced: a communication hook,
    ``ddp.register_comm_hook(state, hook)``, is called once per bucket per step with the
    bucket's flat gradient and returns a ``torch.futures.Future`` of the averaged buffer.

        backward fills bucket b --> hook(state, bucket) --> Future --(done)--> DDP copies its
                                    bucket.buffer(): 1-D    value (1-D, the    value into the
                                    bucket.gradients():     bucket's dtype)    parameters' .grad
                                    views of it, one a parameter

    Three hooks, from cheap to clever:

        allreduce   divide by N, all-reduce, done            4 bytes a parameter (plain DDP)
        fp16/bf16   cast, divide by N, all-reduce in 16 bits,  2 bytes a parameter
                    copy back into the bucket (its dtype)
        PowerSGD    a matrix M (n x m) becomes P (n x r) and  4 (n + m) r bytes per matrix,
                    Q (m x r): M ~ P Q^T, rank r              e.g. 1568 x 10 at r = 1: 10x less

    PowerSGD (Vogels et al., 2019) views each gradient as a matrix (its first dimension by the
    rest) and runs one step of power iteration per training step, across the ranks:

        P = M Q             (each rank its own M, the same Q)    all-reduce P (sum)
        P = orthogonalize(P)  (Gram-Schmidt: orthonormal columns)
        Q = M^T P           all-reduce Q, divide by N             mean M ~ P Q^T

    Two tricks make rank 1 or 2 enough. Warm start: Q is kept from step to step (the power
    iteration goes on converging; only the first step draws it at random, from
    ``state.rng``). Error feedback: what the approximation dropped on this rank, M - P Q^T, is
    added to the next step's gradient, so nothing is lost for ever, only delayed. Vectors
    (biases, norms) and matrices too small to gain are all-reduced as they are; the first
    ``start_powerSGD_iter`` steps are plain all-reduces (early training is fragile).

        what torch offers         bytes a step (the ConvNet)    when it pays
        ------------------------  ----------------------------  ------------------------------
        no hook, allreduce_hook   116 136 (4 x 29 034 params)   compute-bound steps, fast links
        fp16_compress_hook        58 068 (half)                 bandwidth-bound steps; fp16
                                                                keeps 3 digits, overflows past
                                                                65504 (so: divide first)
        bf16_compress_hook        58 068 (half)                 the same with fp32's range and
                                                                2-3 digits; NCCL 2.10+ (DDP
                                                                refuses it by name off CUDA)
        powerSGD_hook, rank 1     8 820 (13x less)              slow links (Ethernet, many
                                                                hosts), big matrices: 4096 x
                                                                4096 at rank 4 sends 1/512

    Two of torch's habits the tests hold you to. Without a hook DDP multiplies each gradient
    by 1/N as it fills the bucket, a hook divides by N: on 2 ranks the same number, on 3 an ulp
    apart (so on 3 ranks your allreduce_hook is held against torch's). And torch's
    powerSGD_hook waits for its second and third all-reduces inside the callbacks of the
    first one's future: on gloo those run on the group's own thread, which then waits for work
    queued behind itself, a deadlock (torch 2.14, CPU). The tests run torch's hook with each
    all-reduce finished before it chains on it; yours may all-reduce synchronously and return
    a Future already done (``fut = torch.futures.Future(); fut.set_result(buffer)``).

    What it costs in accuracy, on the ConvNet and the digits (the program, 2 ranks x 16):

        steps  PowerSGD plain for   plain    fp16     bf16     PowerSGD rank 1
        60     10                   96.9 %   96.4 %   96.4 %   96.1 %
        25     2                    83.0 %                     37.9 %

    Compressing from the second step wrecks the start of training; after 10 plain steps rank 1
    costs under a point. Measure on your model: the bytes are certain, the accuracy is not.

    Memory: fp16/bf16 hooks hold one half-size copy of a bucket; PowerSGD holds, per bucket,
    the error (a full copy), P and Q (small) and a copy of the input while it works. Compute:
    fp16 is a cast; PowerSGD is 3 matrix products and 2 orthogonalisations per matrix per step.

STEPS
    1. ``allreduce_hook``: the hook contract: average the bucket over the group, return a
       Future of the averaged flat buffer, without waiting for the all-reduce.
    2. ``compress_hook``: cast to fp16 or bf16, divide by N, all-reduce the 16-bit copy,
       decompress into the bucket.
    3. ``orthogonalize`` (Gram-Schmidt, as torch's PowerSGD does) and ``low_rank_mean``:
       one PowerSGD round for a list of matrices: P, all-reduce, orthogonalise, Q, all-reduce,
       P Q^T.
    4. ``powersgd_hook``: the whole hook on torch's ``PowerSGDState``: the plain start, which
       tensors to compress, the random first Q, warm start and error feedback.
    5. ``register_compression`` (the right hook and state on a DDP, bad ones refused) and
       ``bytes_per_step`` (what a step sends, predicted: the tests count it).
    The plumbing below them is yours to use: ``_all_reduce_together`` (a list of tensors in one
    all-reduce), ``_by_shape`` (matrices in torch's PowerSGD order) and ``_views`` (shaped views
    of a flat memory, as torch keeps its Ps and Qs).

WHAT THE TESTS CHECK
    ``allreduce_hook`` on a bucket of its own returns a Future of the mean, from an
    ``async_op`` all-reduce, also on a subgroup; registered on torch's DDP it trains bitwise
    like DDP without a hook (2 ranks) and like torch's ``allreduce_hook`` (3 ranks);
    ``compress_hook`` all-reduces float16 (bfloat16) tensors, returns the bucket's dtype, does
    not overflow on large gradients, refuses other dtypes and trains bitwise like torch's
    ``fp16_compress_hook`` and ``bf16_compress_hook``; ``orthogonalize`` equals torch's
    ``_orthogonalize`` bitwise (rank 1 to 4, a batch, fp16, a zero column with epsilon);
    ``low_rank_mean`` is exact at full rank and for rank-1 means, equals torch's pieces bitwise
    on 2 ranks, makes two all-reduces, keeps the new Q and refuses a rank larger than the
    matrix; ``powersgd_hook`` trains bitwise like torch's ``powerSGD_hook`` on 2 ranks with the
    same ``PowerSGDState`` settings (start iteration, warm start and error feedback off and on,
    rank 1, 2 and 4, min_compression_rate, the TinyTransformer) and leaves the same state;
    ``register_compression`` refuses a state for another group and unknown methods; the bytes
    recorded in one step equal ``bytes_per_step`` for torch's hooks and yours; on the ConvNet
    and the digits plain and PowerSGD training both learn in 25 steps; on a GPU: NCCL and gloo
    on CUDA; the program.

RUN IT
    .venv/bin/python -m katas.k30_compressed_gradients --world-size 2 --steps 60
"""

import argparse
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel

from dojo import data
from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.models import ConvNet, accuracy

COMPRESSED_DTYPES = (torch.float16, torch.bfloat16)  # what compress_hook casts to
METHODS = ("allreduce", "fp16", "bf16", "powersgd")  # register_compression's methods
RANDOM_SEED_BOUND = 1_000_000_000  # torch's PowerSGD seeds each random Q with rng.randint(this)


def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The mean of ``bucket``'s flat gradient over ``process_group`` (None: the world), as a
    Future of the bucket's buffer: what DDP does without a hook."""
    # BEGIN STEP 1: the hook contract: an all-reduce hook
    # TODO: the mean over process_group (None: the world) of this rank's bucket.buffer(), as a
    # torch.futures.Future whose value is that flat tensor, returned without waiting for the
    # communication (DDP goes on with backward meanwhile). The tests call it on a bucket of their
    # own on 3 ranks (the Future's value, the mean, one async all-reduce, recorded), on a subgroup
    # [1, 2], and register it on torch's DDP: 3 steps bitwise equal to DDP without a hook (2 ranks)
    # and to torch's allreduce_hook (3 ranks).
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))  # before the sum, as DDP does
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])
    # END STEP 1


def compress_hook(
    dtype: torch.dtype, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Like ``allreduce_hook``, but the all-reduce carries a ``dtype`` (float16 or bfloat16)
    copy of the bucket: a Future of the bucket's buffer, in its own dtype, holding the mean."""
    # BEGIN STEP 2: fp16 and bf16 compression
    # TODO: allreduce_hook's result, but the bytes that travel are a dtype (float16 or bfloat16)
    # copy of the bucket; the Future's value is the bucket's own buffer, in its own dtype, holding
    # the mean. Any other dtype is a ValueError, before anything is sent. The tests record the all-
    # reduce's dtype, feed gradients whose sum overflows fp16, and hold DDP with fp16_hook and
    # bf16_hook bitwise against torch's fp16_compress_hook and bf16_compress_hook (2 and 3 ranks).
    if dtype not in COMPRESSED_DTYPES:
        raise ValueError(
            f"compress_hook compresses to torch.float16 or torch.bfloat16, not {dtype}: "
            "pass one of those (fp16: finer digits; bf16: fp32's range)"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(group))  # divide before: no overflow

    def decompress(future):
        return buffer.copy_(future.value()[0])  # in place: no second full-size buffer

    work = dist.all_reduce(compressed, group=group, async_op=True)
    return work.get_future().then(decompress)
    # END STEP 2


def fp16_hook(process_group, bucket):  # DDP refuses a hook named bf16_compress_hook off CUDA
    return compress_hook(torch.float16, process_group, bucket)


def bf16_hook(process_group, bucket):
    return compress_hook(torch.bfloat16, process_group, bucket)


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Make the columns of every matrix of the batch ``matrices`` (shape (batch, n, r), r <= n)
    orthonormal, in place, exactly as torch's PowerSGD does; returns ``matrices``.

    ``epsilon`` is added to each column's norm before dividing (0: none)."""
    # BEGIN STEP 3: PowerSGD's pieces: orthogonalize and one round
    # TODO: every matrix of the batch (batch, n, r) gets orthonormal columns, in place, bitwise as
    # torch's PowerSGD makes them (its _orthogonalize: Gram-Schmidt for r <= 2 or 16-bit dtypes, a
    # QR factorisation otherwise; epsilon added to each norm when not 0); r > n is a ValueError. The
    # tests check Q^T Q = I and compare with torch's _orthogonalize for ranks 1, 2, 3 and 4, a
    # batch, fp16 and a zero column with epsilon.
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(
            f"orthogonalize takes a batch of matrices (batch, n, r) with r <= n, got shape "
            f"{tuple(matrices.shape)}: more columns than rows cannot all be orthogonal"
        )
    count, _, rank = matrices.shape
    if rank > 2 and matrices.dtype not in COMPRESSED_DTYPES:  # torch's choice: QR is faster
        torch.linalg.qr(
            matrices,
            out=(
                matrices,
                torch.empty(count, rank, rank, device=matrices.device, dtype=matrices.dtype),
            ),
        )
        return matrices
    for i in range(rank):  # modified Gram-Schmidt, column by column
        column = matrices[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(column, dim=1, keepdim=True)
        column /= norm + epsilon if epsilon else norm
        if i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(column * rest, dim=1, keepdim=True) * column
    return matrices
    # END STEP 3


def low_rank_mean(
    matrices: list[torch.Tensor],
    qs: list[torch.Tensor],
    process_group: dist.ProcessGroup | None = None,
    epsilon: float = 0.0,
) -> list[torch.Tensor]:
    """One PowerSGD round: each ``matrices[i]`` (shape (1, n, m), this rank's) becomes, in
    place, its rank-r approximation of the mean over the group of every rank's matrix.

    ``qs[i]`` (shape (1, m, r), orthonormal columns, the same on every rank) is the round's Q
    and is overwritten with the new one (kept for the next round: warm start). Returns the
    ``ps`` (each (1, n, r), orthonormal columns), with ``P @ Q^T`` the approximation."""
    # BEGIN STEP 3: PowerSGD's pieces: orthogonalize and one round
    # TODO: one PowerSGD round for this rank's matrices against every other rank's: afterwards each
    # matrix holds P Q^T, the rank-r approximation of the group's mean matrix; qs hold the new Qs;
    # the Ps come back. Every P travels in one all-reduce, every Q in another. Shapes that do not
    # fit (a rank above min(n, m), a Q of another length) are a ValueError before anything is sent.
    # The tests check exactness at full rank and for a rank-1 mean, compare with torch's pieces
    # (bitwise on 2 ranks), and count the all-reduces' bytes on 3 ranks.
    if len(matrices) != len(qs):
        raise ValueError(f"{len(matrices)} matrices but {len(qs)} Qs: give one Q a matrix")
    for matrix, q in zip(matrices, qs):
        if matrix.dim() != 3 or q.dim() != 3 or q.shape[:2] != (matrix.shape[0], matrix.shape[2]):
            raise ValueError(
                f"a matrix of shape {tuple(matrix.shape)} takes a Q of shape (batch, m, r) = "
                f"({matrix.shape[0]}, {matrix.shape[-1]}, r), got {tuple(q.shape)}"
            )
        if q.shape[2] > min(matrix.shape[1], matrix.shape[2]):
            raise ValueError(
                f"rank {q.shape[2]} is larger than the {matrix.shape[1]}x{matrix.shape[2]} "
                f"matrix allows (at most {min(matrix.shape[1:])}): use a rank of at most "
                "min(n, m), as torch's PowerSGD does (min(n, m, matrix_approximation_rank))"
            )
    group = process_group if process_group is not None else dist.group.WORLD
    ps = [torch.bmm(matrix, q) for matrix, q in zip(matrices, qs)]
    _all_reduce_together(ps, group)  # one call for every P: latency, not bandwidth, is per call
    for p in ps:
        orthogonalize(p, epsilon)
    for matrix, p, q in zip(matrices, ps, qs):
        torch.bmm(matrix.transpose(1, 2), p, out=q)
    _all_reduce_together(qs, group)
    size = dist.get_world_size(group)
    for q in qs:
        q.div_(size)
    for matrix, p, q in zip(matrices, ps, qs):
        torch.bmm(p, q.transpose(1, 2), out=matrix)
    return ps
    # END STEP 3


def powersgd_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook``, written out: the same results and the same ``state``
    afterwards (``iter``, ``error_dict``, ``p_memory_dict``, ``q_memory_dict``, ``rng``)."""
    # BEGIN STEP 4: the whole PowerSGD hook
    # TODO: torch's powerSGD_hook's results and state for the same PowerSGDState: plain all-reduces
    # for the first state.start_powerSGD_iter steps; then each bucket's tensors compressed or not as
    # torch decides, the random first Qs drawn as torch draws them, warm start and error feedback as
    # the state says; a state with batch_tensors_with_same_shape is a ValueError. The tests train
    # toy models and the TinyTransformer on 2 ranks with both hooks (settings: start, warm start and
    # error feedback off and on, ranks 1, 2 and 4, min_compression_rate, a random seed) and compare
    # the parameters after every step bitwise, then state.iter, error_dict, q_memory_dict and rng.
    if state.batch_tensors_with_same_shape:
        raise ValueError(
            "this hook compresses each tensor alone: make the PowerSGDState with "
            "batch_tensors_with_same_shape=False"
        )
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:  # the plain start
        state.maybe_increase_iter(bucket)
        return allreduce_hook(group, bucket)
    index = bucket.index()
    if state.use_error_feedback:  # last step's residual joins this step's gradient
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        else:
            state.error_dict[index] = torch.zeros_like(buffer)
        before = buffer.detach().clone()
    compress, plain = [], []
    for tensor in bucket.gradients():
        matrix = tensor.view(tensor.shape[0], -1)
        n, m = matrix.shape
        rank = min(n, m, state.matrix_approximation_rank)
        worth = (n + m) * rank * state.min_compression_rate < n * m
        (compress if worth else plain).append(matrix if worth else tensor)
    flat = torch.cat([t.view(-1) for t in plain]) if plain else buffer.new_empty(0)
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    offset = 0
    for tensor in plain:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    matrices = [m.unsqueeze(0) for m in _by_shape(compress)]
    ranks = [min(m.shape[1], m.shape[2], state.matrix_approximation_rank) for m in matrices]
    if not state.warm_start or index not in state.q_memory_dict:  # a random first Q
        total = sum(m.shape[2] * r for m, r in zip(matrices, ranks))
        state.q_memory_dict[index] = buffer.new_empty(total)
        qs = _views(
            state.q_memory_dict[index], [(1, m.shape[2], r) for m, r in zip(matrices, ranks)]
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(RANDOM_SEED_BOUND))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=buffer.dtype))
                orthogonalize(q, state.orthogonalization_epsilon)
    else:
        qs = _views(
            state.q_memory_dict[index], [(1, m.shape[2], r) for m, r in zip(matrices, ranks)]
        )
        for q in qs:
            orthogonalize(q, state.orthogonalization_epsilon)
    ps = low_rank_mean(matrices, qs, group, state.orthogonalization_epsilon)
    state.p_memory_dict[index] = torch.cat([p.view(-1) for p in ps]) if ps else buffer.new_empty(0)
    if state.use_error_feedback:
        state.error_dict[index] = before - buffer
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done
    # END STEP 4


def register_compression(ddp: DistributedDataParallel, method: str, state: object = None) -> object:
    """Register this kata's hook for ``method`` (one of METHODS) on ``ddp``; returns its state.

    ``state`` is what the hook gets: for "allreduce", "fp16" and "bf16" a process group (None:
    the DDP's own), for "powersgd" a ``PowerSGDState`` (None: ``PowerSGDState(<the DDP's
    group>, **POWERSGD_DEFAULTS)``). A state for another group than the DDP's is refused."""
    # BEGIN STEP 5: registering a hook, and the bytes it sends
    # TODO: the docstring's registration: this kata's hook for method on ddp, with the state the
    # docstring says (None: the DDP's group; for powersgd a PowerSGDState on it); returns that
    # state. An unknown method, or a state whose group is not the DDP's, is a ValueError. The tests
    # build DDPs on a subgroup [1, 2] of 3 ranks and hand it states for the world, then train the
    # ConvNet with each method and count the bytes its all-reduces carry.
    hooks = {
        "allreduce": allreduce_hook,
        "fp16": fp16_hook,
        "bf16": bf16_hook,
        "powersgd": powersgd_hook,
    }
    if method not in hooks:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    group = ddp.process_group
    if method == "powersgd":
        if state is None:
            state = PowerSGDState(group, **POWERSGD_DEFAULTS)
        if not isinstance(state, PowerSGDState):
            raise ValueError(
                f"the powersgd hook's state is a PowerSGDState, not a {type(state).__name__}: "
                "make one with PowerSGDState(process_group, matrix_approximation_rank=...)"
            )
        given = state.process_group
    else:
        given = group if state is None else state
        state = given
    if (given if given is not None else dist.group.WORLD) is not group:
        raise ValueError(
            f"the {method} hook's state is for another process group than the DDP's: its "
            "all-reduces would average over other ranks than DDP's. Make the state with the "
            "DDP's group (ddp.process_group), or None for the world"
        )
    ddp.register_comm_hook(state, hooks[method])
    return state
    # END STEP 5


def bytes_per_step(
    model: nn.Module,
    method: str,
    matrix_approximation_rank: int = 1,
    min_compression_rate: float = 2,
) -> int:
    """The bytes each rank puts into all-reduces in one training step of ``model`` under DDP
    with ``method``'s hook (for "powersgd": once compression has started)."""
    # BEGIN STEP 5: registering a hook, and the bytes it sends
    # TODO: the bytes one rank's all-reduces carry in one step of DDP training of model with
    # method's hook (PowerSGD: once compressing, with the given rank and min_compression_rate),
    # counted from the model's parameters alone; an unknown method is a ValueError. The tests record
    # one step of torch's hooks (and yours) on the ConvNet, a toy model and the TinyTransformer and
    # compare.
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    total = 0
    for param in model.parameters():
        if not param.requires_grad:  # DDP reduces only what trains
            continue
        size = param.element_size()
        if method in ("fp16", "bf16"):
            total += param.numel() * 2
            continue
        n = param.shape[0] if param.dim() else 1
        m = param.numel() // n
        rank = min(n, m, matrix_approximation_rank)
        if method == "powersgd" and (n + m) * rank * min_compression_rate < n * m:
            total += (n + m) * rank * size
        else:
            total += n * m * size
    return total
    # END STEP 5


# --------------------------------------------------------------------------- plumbing

POWERSGD_DEFAULTS = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 10}


def _all_reduce_together(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in one all-reduce (a flat copy), back in place."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def _by_shape(matrices: list[torch.Tensor]) -> list[torch.Tensor]:
    """``matrices`` in torch's PowerSGD order: grouped by shape, the shapes as first seen."""
    groups = defaultdict(list)
    for matrix in matrices:
        groups[matrix.shape].append(matrix)
    return [matrix for same in groups.values() for matrix in same]


def _views(memory: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    views, offset = [], 0
    for shape in shapes:
        count = shape[0] * shape[1] * shape[2]
        views.append(memory[offset : offset + count].view(shape))
        offset += count
    return views


def train_digits(
    rank: int,
    world_size: int,
    method: str,
    steps: int,
    per_rank: int,
    lr: float,
    seed: int,
    matrix_approximation_rank: int = 1,
    start: int = 10,
) -> dict:
    """One rank of a short run: the ConvNet on its shard of the digits under torch's DDP with
    ``method``'s hook (through ``register_compression``). Returns this rank's losses, the
    held-out accuracy, the bytes per step predicted and the seconds per step."""
    device = rank_device()
    torch.manual_seed(seed)
    model = ConvNet().to(device)
    ddp = DistributedDataParallel(model)
    state = None
    if method == "powersgd":
        state = PowerSGDState(
            ddp.process_group,
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start,
        )
    register_compression(ddp, method, state)
    images, labels = data.load("digits", "train").tensors
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    losses, began = [], time.perf_counter()
    for _ in range(steps):
        chosen = torch.randperm(len(images), generator=generator)[: per_rank * world_size]
        mine = chosen[rank * per_rank : (rank + 1) * per_rank]
        optimizer.zero_grad()
        step_loss = F.cross_entropy(ddp(images[mine].to(device)), labels[mine].to(device))
        step_loss.backward()
        optimizer.step()
        losses.append(step_loss.item())
    seconds = (time.perf_counter() - began) / steps
    return {
        "losses": losses,
        "accuracy": accuracy(model, data.load("digits", "test")),
        "bytes": bytes_per_step(model, method, matrix_approximation_rank),
        "seconds": seconds,
    }


def show_rank(rank: int, world_size: int, methods: list[str], args) -> dict:
    return {
        method: train_digits(
            rank,
            world_size,
            method,
            args.steps,
            args.per_rank,
            args.lr,
            args.seed,
            args.rank,
            args.start,
        )
        for method in methods
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="DDP communication hooks: fp16/bf16 compression and PowerSGD on the ConvNet."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--per-rank", type=int, default=16, help="digits per rank per step")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=1, help="PowerSGD's matrix rank (default 1)")
    parser.add_argument(
        "--start", type=int, default=10, help="PowerSGD's plain all-reduce steps (default 10)"
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)}")
    if args.steps < 1 or args.per_rank < 2:
        parser.error("--steps must be at least 1 and --per-rank at least 2")
    if args.start < 2:
        parser.error("--start must be at least 2 (torch's PowerSGD needs two plain steps)")
    say(
        None,
        f"the ConvNet on the digits, {args.world_size} ranks x {args.per_rank} per step, "
        f"{args.steps} steps, each method's hook on torch's DDP (PowerSGD: rank {args.rank}, "
        f"plain for the first {args.start} steps)",
    )
    results = launch_world(
        show_rank, args.world_size, methods, args, backend=args.backend, device=args.device
    )
    plain = None
    say(None, f"  {'method':<10}{'bytes/step':>12}{'vs plain':>10}{'last loss':>11}"
        f"{'accuracy':>10}{'ms/step':>9}")  # fmt: skip
    for method in methods:
        got = results[0][method]
        plain = plain or (got["bytes"] if method == "allreduce" else None)
        ratio = f"{got['bytes'] / plain:.3f}" if plain else "-"
        last = sum(r[method]["losses"][-1] for r in results) / len(results)
        say(
            None,
            f"  {method:<10}{got['bytes']:>12,}{ratio:>10}{last:>11.3f}"
            f"{got['accuracy']:>10.1%}{got['seconds'] * 1000:>9.1f}",
        )
    return 0


if __name__ == "__main__":
    run_program(main)
