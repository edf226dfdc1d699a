"""k30's mistakes catalogue: real mistakes in writing DDP communication hooks (the contract, the
16-bit compression, PowerSGD's pieces and hook, registering and counting bytes), and right
answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k30_compressed_gradients as reference

# The reference's own functions, kept before any entry is swapped in: an entry that replaces
# orthogonalize and calls reference.orthogonalize would call itself.
_orthogonalize = reference.orthogonalize


def _k30():
    """The reference module, with this entry swapped in (what every test and rank sees)."""
    from dojo.harness import impl

    return impl.load_kata("k30_compressed_gradients")


def _group(process_group):
    return process_group if process_group is not None else dist.group.WORLD


def _done(value) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(value)
    return future


# --------------------------------------------------------------------------- allreduce_hook


def allreduce_summed(process_group, bucket):
    # "all_reduce averages": it sums
    work = dist.all_reduce(bucket.buffer(), group=_group(process_group), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_divided_by_the_world(process_group, bucket):
    group = _group(process_group)
    buffer = bucket.buffer().div_(dist.get_world_size())  # the world's size, not the group's
    return (
        dist.all_reduce(buffer, group=group, async_op=True)
        .get_future()
        .then(lambda fut: fut.value()[0])
    )


def allreduce_on_the_world(process_group, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size(_group(process_group)))
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def allreduce_future_of_a_list(process_group, bucket):
    group = _group(process_group)
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future()  # value: [buffer]


def allreduce_waits(process_group, bucket):
    group = _group(process_group)
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(buffer, group=group)  # backward stands still while the bucket travels
    return _done(buffer)


def allreduce_returns_the_tensor(process_group, bucket):
    group = _group(process_group)
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(buffer, group=group)
    return buffer


def allreduce_with_wait_in_then(process_group, bucket):
    """Right: the group's size from the group, the tensor from the future's wait()."""
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer()
    buffer /= group.size()
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return future.then(lambda done: done.wait()[0])


# --------------------------------------------------------------------------- compress_hook


def _compress(dtype, process_group, bucket, *, check=True, cast=True, before=True, fp32=False,
              back=True):  # fmt: skip
    if check and dtype not in reference.COMPRESSED_DTYPES:
        raise ValueError(f"compress to float16 or bfloat16, not {dtype}")
    group = _group(process_group)
    size = dist.get_world_size(group)
    buffer = bucket.buffer()
    if fp32:
        compressed = (buffer / size).to(dtype)
    elif cast:
        compressed = buffer.to(dtype)
        if before:
            compressed.div_(size)
    else:
        compressed = buffer.div_(size) if before else buffer

    def decompress(fut):
        value = fut.value()[0]
        if not before:
            value = value / size
        return buffer.copy_(value) if back else value

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def compress_divides_after(dtype, process_group, bucket):
    return _compress(dtype, process_group, bucket, before=False)


def compress_sends_fp32(dtype, process_group, bucket):
    return _compress(dtype, process_group, bucket, cast=False)


def compress_returns_16_bits(dtype, process_group, bucket):
    return _compress(dtype, process_group, bucket, back=False)


def compress_divides_in_fp32(dtype, process_group, bucket):
    return _compress(dtype, process_group, bucket, fp32=True)


def compress_always_fp16(dtype, process_group, bucket):
    return _compress(torch.float16, process_group, bucket)


def compress_without_a_check(dtype, process_group, bucket):
    return _compress(dtype, process_group, bucket, check=False)


def compress_into_a_new_tensor(dtype, process_group, bucket):
    """Right: the result decompressed into a new tensor of the bucket's dtype."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"compress_hook takes torch.float16 or torch.bfloat16, not {dtype}")
    group = _group(process_group)
    original = bucket.buffer().dtype
    compressed = bucket.buffer().to(dtype)
    compressed /= dist.get_world_size(group)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0].to(original))


# --------------------------------------------------------------------------- orthogonalize


def _gram_schmidt(matrices, epsilon=0.0, *, batch_norm=False, classical=False, qr=True):
    count, _, rank = matrices.shape
    if qr and rank > 2 and matrices.dtype not in reference.COMPRESSED_DTYPES:
        torch.linalg.qr(matrices, out=(matrices, matrices.new_empty(count, rank, rank)))
        return matrices
    original = matrices.clone()
    for i in range(rank):
        column = matrices[:, :, i : i + 1]
        if classical:  # every projection from the original column
            for j in range(i):
                earlier = matrices[:, :, j : j + 1]
                column -= (
                    torch.sum(earlier * original[:, :, i : i + 1], dim=1, keepdim=True) * earlier
                )
        if batch_norm:
            column /= torch.linalg.vector_norm(column) + epsilon  # the whole batch's norm
        else:
            column /= torch.linalg.vector_norm(column, dim=1, keepdim=True) + epsilon
        if not classical and i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(column * rest, dim=1, keepdim=True) * column
    return matrices


def orthogonalize_by_the_batchs_norm(matrices, epsilon=0.0):
    return _gram_schmidt(matrices, epsilon, batch_norm=True)


def orthogonalize_classically(matrices, epsilon=0.0):
    return _gram_schmidt(matrices, epsilon, classical=True)


def orthogonalize_never_qr(matrices, epsilon=0.0):
    return _gram_schmidt(matrices, epsilon, qr=False)


def orthogonalize_a_copy(matrices, epsilon=0.0):
    return _orthogonalize(matrices.clone(), epsilon)


def orthogonalize_without_epsilon(matrices, epsilon=0.0):
    return _orthogonalize(matrices, 0.0)


def orthogonalize_matrix_by_matrix(matrices, epsilon=0.0):
    """Right: each matrix of the batch on its own (the same operations, per matrix)."""
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError("orthogonalize takes (batch, n, r) with r <= n")
    for matrix in matrices:
        _orthogonalize(matrix.unsqueeze(0), epsilon)
    return matrices


# --------------------------------------------------------------------------- low_rank_mean


def _round(matrices, qs, process_group=None, epsilon=0.0, *, check=True, divide=True,
           orthogonal=True, together=True, keep=True):  # fmt: skip
    if check:
        for matrix, q in zip(matrices, qs):
            if q.shape[1] != matrix.shape[2] or q.shape[2] > min(matrix.shape[1:]):
                raise ValueError("the rank is larger than the matrix, or Q does not fit")
    group = _group(process_group)
    k30 = _k30()

    def reduce(tensors):
        if together:
            reference._all_reduce_together(tensors, group)
        else:
            for tensor in tensors:
                dist.all_reduce(tensor, group=group)

    ps = [torch.bmm(m, q) for m, q in zip(matrices, qs)]
    reduce(ps)
    if orthogonal:
        for p in ps:
            k30.orthogonalize(p, epsilon)
    new_qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(matrices, ps)]
    reduce(new_qs)
    for q in new_qs:
        if divide:
            q.div_(dist.get_world_size(group))
    for matrix, p, q in zip(matrices, ps, new_qs):
        torch.bmm(p, q.transpose(1, 2), out=matrix)
    if keep:
        for q, new in zip(qs, new_qs):
            q.copy_(new)
    return ps


def low_rank_q_not_divided(matrices, qs, process_group=None, epsilon=0.0):
    return _round(matrices, qs, process_group, epsilon, divide=False)


def low_rank_p_not_orthogonalized(matrices, qs, process_group=None, epsilon=0.0):
    return _round(matrices, qs, process_group, epsilon, orthogonal=False)


def low_rank_one_matrix_at_a_time(matrices, qs, process_group=None, epsilon=0.0):
    return _round(matrices, qs, process_group, epsilon, together=False)


def low_rank_q_not_kept(matrices, qs, process_group=None, epsilon=0.0):
    return _round(matrices, qs, process_group, epsilon, keep=False)


def low_rank_no_shape_check(matrices, qs, process_group=None, epsilon=0.0):
    return _round(matrices, qs, process_group, epsilon, check=False)


def low_rank_with_stack(matrices, qs, process_group=None, epsilon=0.0):
    """Right: the Ps and Qs packed by hand into one flat tensor each, and out= everywhere."""
    for matrix, q in zip(matrices, qs):
        n, m = matrix.shape[1:]
        if q.shape != (1, m, q.shape[2]) or not 1 <= q.shape[2] <= min(n, m):
            raise ValueError(f"Q of shape {tuple(q.shape)} does not fit a {n}x{m} matrix")
    group = _group(process_group)
    size = dist.get_world_size(group)
    sizes = [matrix.shape[1] * q.shape[2] for matrix, q in zip(matrices, qs)]
    p_memory = torch.empty(sum(sizes))
    ps = list(p_memory.split(sizes))
    ps = [p.view(1, m.shape[1], q.shape[2]) for p, m, q in zip(ps, matrices, qs)]
    for matrix, q, p in zip(matrices, qs, ps):
        torch.bmm(matrix, q, out=p)
    dist.all_reduce(p_memory, group=group)
    for p in ps:
        _k30().orthogonalize(p, epsilon)
    q_memory = torch.cat(
        [torch.bmm(m.transpose(1, 2), p).reshape(-1) for m, p in zip(matrices, ps)]
    )
    dist.all_reduce(q_memory, group=group)
    q_memory /= size
    offset = 0
    for matrix, p, q in zip(matrices, ps, qs):
        q.copy_(q_memory[offset : offset + q.numel()].view_as(q))
        offset += q.numel()
        torch.bmm(p, q.transpose(1, 2), out=matrix)
    return ps


# --------------------------------------------------------------------------- powersgd_hook


def _powersgd(state, bucket, *, count_each=False, late=False, torch_seed=False, warm=True,
              reorthogonalize=True, feedback=True, rate=True, by_shape=True, refuse=True):  # fmt: skip
    if refuse and state.batch_tensors_with_same_shape:
        raise ValueError("make the PowerSGDState with batch_tensors_with_same_shape=False")
    k30 = _k30()
    group = _group(state.process_group)
    size = dist.get_world_size(group)
    buffer = bucket.buffer()

    def count():
        if count_each:
            state.iter += 1
        else:
            state.maybe_increase_iter(bucket)

    if state.iter < state.start_powerSGD_iter + late:  # late: "iter <= start" is plain
        count()
        return reference.allreduce_hook(group, bucket)
    index = bucket.index()
    use_feedback = state.use_error_feedback and feedback
    if use_feedback:
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        else:
            state.error_dict[index] = torch.zeros_like(buffer)
        before = buffer.clone()
    compress, plain = [], []
    for tensor in bucket.gradients():
        matrix = tensor.view(tensor.shape[0], -1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        worth = (n + m) * r * state.min_compression_rate < n * m if rate else tensor.dim() > 1
        (compress if worth else plain).append(matrix if worth else tensor)
    flat = torch.cat([t.view(-1) for t in plain]) if plain else buffer.new_empty(0)
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for tensor in plain:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    ordered = reference._by_shape(compress) if by_shape else compress
    matrices = [m.unsqueeze(0) for m in ordered]
    shapes = [(1, m.shape[2], min(m.shape[1], m.shape[2], state.matrix_approximation_rank))
              for m in matrices]  # fmt: skip
    warm_start = state.warm_start and warm
    if not warm_start or index not in state.q_memory_dict:
        state.q_memory_dict[index] = buffer.new_empty(sum(s[1] * s[2] for s in shapes))
        qs = reference._views(state.q_memory_dict[index], shapes)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if torch_seed else state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=buffer.dtype))
                k30.orthogonalize(q, state.orthogonalization_epsilon)
    else:
        qs = reference._views(state.q_memory_dict[index], shapes)
        if reorthogonalize:
            for q in qs:
                k30.orthogonalize(q, state.orthogonalization_epsilon)
    ps = k30.low_rank_mean(matrices, qs, group, state.orthogonalization_epsilon)
    state.p_memory_dict[index] = torch.cat([p.view(-1) for p in ps]) if ps else buffer.new_empty(0)
    if use_feedback:
        state.error_dict[index] = before - buffer
    if not warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    count()
    return _done(buffer)


def powersgd_counts_every_bucket(state, bucket):
    return _powersgd(state, bucket, count_each=True)


def powersgd_starts_late(state, bucket):
    return _powersgd(state, bucket, late=True)


def powersgd_seeds_torch_itself(state, bucket):
    return _powersgd(state, bucket, torch_seed=True)


def powersgd_never_warm(state, bucket):
    return _powersgd(state, bucket, warm=False)


def powersgd_kept_q_not_orthogonalized(state, bucket):
    return _powersgd(state, bucket, reorthogonalize=False)


def powersgd_without_error_feedback(state, bucket):
    return _powersgd(state, bucket, feedback=False)


def powersgd_every_matrix(state, bucket):
    return _powersgd(state, bucket, rate=False)


def powersgd_in_bucket_order(state, bucket):
    return _powersgd(state, bucket, by_shape=False)


def powersgd_batched_accepted(state, bucket):
    return _powersgd(state, bucket, refuse=False)


def powersgd_chained_like_torchs(state, bucket):
    # torch's own hook, copied futures and all: its callbacks wait for the next all-reduce
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    return powerSGD_hook(state, bucket)


def powersgd_with_a_generator(state, bucket):
    """Right: the random Qs from a generator of their own (the same numbers as a seeded global
    generator, without touching it), the memories kept as torch keeps them."""
    if state.batch_tensors_with_same_shape:
        raise ValueError("batch_tensors_with_same_shape=True is not supported here")
    group = _group(state.process_group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return _k30().allreduce_hook(group, bucket)
    index = bucket.index()
    if state.use_error_feedback:
        buffer += state.error_dict.get(index, torch.zeros_like(buffer))
        state.error_dict.setdefault(index, torch.zeros_like(buffer))
        before = buffer.clone()
    shapes = defaultdict(list)
    plain = []
    for tensor in bucket.gradients():
        n, m = tensor.shape[0], tensor.numel() // tensor.shape[0]
        r = min(n, m, state.matrix_approximation_rank)
        if (n + m) * r * state.min_compression_rate < n * m:
            shapes[(n, m)].append(tensor.view(1, n, m))
        else:
            plain.append(tensor)
    reference._all_reduce_together(plain, group)
    for tensor in plain:
        tensor /= dist.get_world_size(group)
    matrices = [matrix for same in shapes.values() for matrix in same]
    dims = [(1, m.shape[2], min(m.shape[1], m.shape[2], state.matrix_approximation_rank))
            for m in matrices]  # fmt: skip
    fresh = not state.warm_start or index not in state.q_memory_dict
    if fresh:
        state.q_memory_dict[index] = torch.empty(sum(d[1] * d[2] for d in dims))
        generator = torch.Generator().manual_seed(state.rng.randint(1_000_000_000))
    qs = reference._views(state.q_memory_dict[index], dims)
    for q in qs:
        if fresh:
            q.copy_(torch.randn(q.shape, generator=generator))
        _k30().orthogonalize(q, state.orthogonalization_epsilon)
    ps = _k30().low_rank_mean(matrices, qs, group, state.orthogonalization_epsilon)
    state.p_memory_dict[index] = torch.cat([p.reshape(-1) for p in ps] or [buffer[:0]])
    if state.use_error_feedback:
        state.error_dict[index] = before - buffer
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    return _done(buffer)


# --------------------------------------------------------------------------- register, bytes


def register_without_checks(ddp, method, state=None):
    k30 = _k30()
    hooks = {"allreduce": k30.allreduce_hook, "fp16": k30.fp16_hook, "bf16": k30.bf16_hook,
             "powersgd": k30.powersgd_hook}  # fmt: skip
    if method not in hooks:
        raise ValueError(f"unknown method {method!r}")
    if state is None:
        state = (
            PowerSGDState(ddp.process_group, **reference.POWERSGD_DEFAULTS)
            if method == "powersgd"
            else ddp.process_group
        )
    ddp.register_comm_hook(state, hooks[method])  # whatever group the state is for
    return state


def _bytes(model, method, rank=1, rate=2, *, half=2, frozen=False, clamp=True, use_rate=True,
           q=True):  # fmt: skip
    if method not in reference.METHODS:
        raise ValueError(f"unknown method {method!r}")
    total = 0
    for param in model.parameters():
        if not param.requires_grad and not frozen:
            continue
        if method in ("fp16", "bf16"):
            total += param.numel() * half
            continue
        n = param.shape[0]
        m = param.numel() // n
        r = min(n, m, rank) if clamp else rank
        worth = (n + m) * r * rate < n * m if use_rate else param.dim() > 1
        if method == "powersgd" and worth:
            total += ((n + m) if q else n) * r * param.element_size()
        else:
            total += n * m * param.element_size()
    return total


def bytes_fp16_as_four(model, method, matrix_approximation_rank=1, min_compression_rate=2):
    return _bytes(model, method, matrix_approximation_rank, min_compression_rate, half=4)


def bytes_counts_frozen(model, method, matrix_approximation_rank=1, min_compression_rate=2):
    return _bytes(model, method, matrix_approximation_rank, min_compression_rate, frozen=True)


def bytes_ignores_the_rate(model, method, matrix_approximation_rank=1, min_compression_rate=2):
    return _bytes(model, method, matrix_approximation_rank, min_compression_rate, use_rate=False)


def bytes_counts_only_p(model, method, matrix_approximation_rank=1, min_compression_rate=2):
    return _bytes(model, method, matrix_approximation_rank, min_compression_rate, q=False)


def bytes_from_named_parameters(model, method, matrix_approximation_rank=1, min_compression_rate=2):
    """Right: over named_parameters, the element size from the dtype."""
    if method not in ("allreduce", "fp16", "bf16", "powersgd"):
        raise ValueError(f"unknown method {method!r}")
    total = 0
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        width = 2 if method in ("fp16", "bf16") else torch.finfo(param.dtype).bits // 8
        rows = param.shape[0]
        cols = param.numel() // rows
        r = min(rows, cols, matrix_approximation_rank)
        small = (rows + cols) * r
        if method == "powersgd" and small * min_compression_rate < rows * cols:
            total += small * width
        else:
            total += param.numel() * width
    return total


_ONE = "test_allreduce_hook_returns_a_future_of_the_mean"
_SUB = "test_allreduce_hook_on_a_subgroup"
_16 = "test_compress_hook_all_reduces_16_bits_and_returns_the_buckets_dtype"
_REFUSE16 = "test_compress_hook_refuses_what_is_not_16_bit_floats"
_OVERFLOW = "test_fp16_compression_does_not_overflow_on_large_gradients"
_AGAINST16 = "test_compression_trains_bitwise_like_torchs_hook"
_ORTHONORMAL = "test_orthogonalize_gives_orthonormal_columns"
_ORTHO_BITS = "test_orthogonalize_equals_torchs_bitwise"
_EXACT = "test_low_rank_mean_is_exact_where_the_mean_has_that_rank"
_AT_ONCE = "test_low_rank_mean_all_reduces_every_p_and_every_q_at_once"
_RANK_CHECK = "test_low_rank_mean_refuses_a_rank_larger_than_the_matrix"
_POWERSGD = "test_powersgd_hook_trains_bitwise_like_torchs"
_BATCHED = "test_powersgd_hook_refuses_batched_same_shape_states"
_REGISTER = "test_register_compression_refuses_a_state_for_another_group"
_BYTES = "test_bytes_per_step_is_what_torchs_hooks_send"

MISTAKES = [
    Mistake(
        "allreduce_summed",
        replaces="allreduce_hook",
        fails=[_ONE],
        says=["holds the sum of the 3 ranks' gradients", "divide by the group's size"],
    ),
    Mistake(
        "allreduce_divided_by_the_world",
        replaces="allreduce_hook",
        fails=[_SUB],
        says=["divided the sum by 3, the world's size", "the group's 2 ranks"],
    ),
    Mistake(
        "allreduce_on_the_world",
        replaces="allreduce_hook",
        fails=[_SUB],
        says=["rank 0, outside their group, never calls", "group=process_group"],
    ),
    Mistake(
        "allreduce_future_of_a_list",
        replaces="allreduce_hook",
        fails=[_ONE],
        says=["holds a list of 1 tensor(s)", ".then(lambda fut: fut.value()[0])"],
    ),
    Mistake(
        "allreduce_waits",
        replaces="allreduce_hook",
        fails=[_ONE],
        says=["waited for its all-reduce before returning", "async_op=True"],
    ),
    Mistake(
        "allreduce_returns_the_tensor",
        replaces="allreduce_hook",
        fails=[_ONE],
        says=["got a Tensor back", "returns a torch.futures.Future"],
    ),
    Mistake(
        "compress_divides_after",
        replaces="compress_hook",
        fails=[_OVERFLOW],
        says=["overflowed fp16", "before the all-reduce"],
    ),
    Mistake(
        "compress_sends_fp32",
        replaces="compress_hook",
        fails=[_16],
        says=["carried [['float32']]", "not the buffer itself"],
    ),
    Mistake(
        "compress_returns_16_bits",
        replaces="compress_hook",
        fails=[_16],
        says=["the bucket a float32 one", "copy the reduced values back"],
    ),
    Mistake(
        "compress_divides_in_fp32",
        replaces="compress_hook",
        fails=[f"{_AGAINST16}[fp16-2]", f"{_AGAINST16}[fp16-3]"],
        says=["Torch casts first and divides in 16 bits", "rounds differently"],
    ),
    Mistake(
        "compress_always_fp16",
        replaces="compress_hook",
        fails=[f"{_16}[bf16]"],
        says=["carried [['float16']], expected one of bfloat16"],
    ),
    Mistake(
        "compress_without_a_check",
        replaces="compress_hook",
        fails=[_REFUSE16],
        says=["tried to all-reduce before refusing", "check the dtype first"],
    ),
    Mistake(
        "orthogonalize_by_the_batchs_norm",
        replaces="orthogonalize",
        fails=[_ORTHONORMAL],
        says=["expected 1 each", "by its own norm over its n entries"],
    ),
    Mistake(
        "orthogonalize_never_qr",
        replaces="orthogonalize",
        fails=[_ORTHO_BITS],
        says=["torch uses a QR factorisation", "torch.linalg.qr"],
    ),
    Mistake(
        "orthogonalize_classically",
        replaces="orthogonalize",
        fails=[_ORTHO_BITS],
        says=["torch's Gram-Schmidt takes column i", "subtracts from all later columns at once"],
    ),
    Mistake(
        "orthogonalize_a_copy",
        replaces="orthogonalize",
        fails=[_ORTHONORMAL],
        says=["returned a new tensor and left its argument as it was", "works in place"],
    ),
    Mistake(
        "orthogonalize_without_epsilon",
        replaces="orthogonalize",
        fails=[_ORTHO_BITS],
        says=["epsilon=1e-08", "(+ epsilon when epsilon is not 0)"],
    ),
    Mistake(
        "low_rank_q_not_divided",
        replaces="low_rank_mean",
        fails=[_EXACT],
        says=["became 2 times the mean", "divide Q by the group's size"],
    ),
    Mistake(
        "low_rank_p_not_orthogonalized",
        replaces="low_rank_mean",
        fails=[_EXACT],
        says=["from the mean over the ranks", "its columns orthonormalised"],
    ),
    Mistake(
        "low_rank_one_matrix_at_a_time",
        replaces="low_rank_mean",
        fails=[_AT_ONCE],
        says=["expected two: every P at once", "packs a bucket's Ps into one flat tensor"],
    ),
    Mistake(
        "low_rank_q_not_kept",
        replaces="low_rank_mean",
        fails=[_EXACT],
        says=["does not hold the new Q", "warm start"],
    ),
    Mistake(
        "low_rank_no_shape_check",
        replaces="low_rank_mean",
        fails=[_RANK_CHECK],
        says=["tried to all-reduce before refusing", "check the shapes first"],
    ),
    Mistake(
        "powersgd_counts_every_bucket",
        replaces="powersgd_hook",
        fails=[f"{_POWERSGD}[plain start]"],
        says=["steps are plain all-reduces", "state.iter counted once a step"],
    ),
    Mistake(
        "powersgd_starts_late",
        replaces="powersgd_hook",
        fails=[f"{_POWERSGD}[cold]"],
        says=["was still a plain all-reduce", "state.iter < state.start_powerSGD_iter"],
    ),
    Mistake(
        "powersgd_seeds_torch_itself",
        replaces="powersgd_hook",
        fails=[f"{_POWERSGD}[cold]"],
        says=["the first compressed step", "torch.manual_seed(state.rng.randint(1_000_000_000))"],
    ),
    Mistake(
        "powersgd_never_warm",
        replaces="powersgd_hook",
        fails=[f"{_POWERSGD}[warm start]"],
        says=["though the first compressed step agreed", "warm start: keep each bucket's Qs"],
    ),
    Mistake(
        "powersgd_kept_q_not_orthogonalized",
        replaces="powersgd_hook",
        fails=[f"{_POWERSGD}[warm start]"],
        says=["though the first compressed step agreed", "orthogonalised again"],
    ),
    Mistake(
        "powersgd_without_error_feedback",
        replaces="powersgd_hook",
        fails=[f"{_POWERSGD}[error feedback]"],
        says=["though the first compressed step agreed", "error feedback: add"],
    ),
    Mistake(
        "powersgd_every_matrix",
        replaces="powersgd_hook",
        fails=[f"{_POWERSGD}[rank 4]", f"{_POWERSGD}[min rate]"],
        says=["the first compressed step", "min_compression_rate < n * m"],
    ),
    Mistake(
        "powersgd_in_bucket_order",
        replaces="powersgd_hook",
        fails=[f"{_POWERSGD}[transformer]"],
        says=["the first compressed step", "the matrices grouped by shape"],
    ),
    Mistake(
        "powersgd_chained_like_torchs",
        replaces="powersgd_hook",
        fails=[f"{_POWERSGD}[cold]"],
        # deadlocks in the callback's wait, or gloo aborts there on a message out of turn
        says=["inside backward, in your hook", "return a Future that is already done"],
    ),
    Mistake(
        "powersgd_batched_accepted",
        replaces="powersgd_hook",
        fails=[_BATCHED],
        says=["batch_tensors_with_same_shape=True", "before anything is sent"],
    ),
    Mistake(
        "register_without_checks",
        replaces="register_compression",
        fails=[_REGISTER],
        says=["registered it", "Refuse with a ValueError"],
    ),
    Mistake(
        "bytes_fp16_as_four",
        replaces="bytes_per_step",
        fails=[f"{_BYTES}[fp16]"],
        says=["2 bytes for fp16/bf16"],
    ),
    Mistake(
        "bytes_counts_frozen",
        replaces="bytes_per_step",
        fails=[f"{_BYTES}[powersgd rate 8]"],
        says=["count every trained parameter once"],
    ),
    Mistake(
        "bytes_ignores_the_rate",
        replaces="bytes_per_step",
        fails=[f"{_BYTES}[powersgd rate 8]"],
        says=["when (n + m) * r * min_compression_rate < n * m"],
    ),
    Mistake(
        "bytes_counts_only_p",
        replaces="bytes_per_step",
        fails=[f"{_BYTES}[powersgd]"],
        says=["sends (n + m) * r elements"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("allreduce_with_wait_in_then", replaces="allreduce_hook"),
    RightAnswer("compress_into_a_new_tensor", replaces="compress_hook"),
    RightAnswer("orthogonalize_matrix_by_matrix", replaces="orthogonalize", steps=(3, 4)),
    RightAnswer("low_rank_with_stack", replaces="low_rank_mean", steps=(3, 4)),
    RightAnswer("powersgd_with_a_generator", replaces="powersgd_hook"),
    RightAnswer("bytes_from_named_parameters", replaces="bytes_per_step"),
]
