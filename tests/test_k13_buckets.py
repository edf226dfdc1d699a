"""k13 buckets: assign_buckets, then BucketedDDP's start, buckets, hooks, finish and no_sync."""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch
from torch import nn

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import WorldDeadlock, run_world
from dojo.spec import wrappers
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import run_module_ok
from dojo.todo import KataTodo
from dojo.toy_models import loss, make_batch, make_model

KATA = "k13_buckets"
MIB = 1 << 20
MODELS = ("frozen", "tied", "buffer")
LR, MOMENTUM = 0.1, 0.9
PER_RANK = 4  # samples per rank per micro-batch

# Caps in MiB for the toy models (their trainable tensors hold 16 to 2048 bytes):
#   25 MiB: torch's default, one bucket here; TINY: below every tensor, one bucket each;
#   SPLIT: 280 bytes, where a cap read as MB (10**6 bytes) instead of MiB splits differently.
TINY, SPLIT = 1e-6, 280 / MIB
CAPS = (25.0, TINY, SPLIT, None)

# Exactness. On 2 ranks each averaged element is (a + b) / 2: fp32 addition is commutative and
# halving is exact, so any correct wrapper gives bitwise the gradients of all-reducing each
# tensor on its own. On 3 ranks gloo adds three numbers in an order that depends on where they
# sit in the buffer (a bucket is not the tensor alone), and a + b + c is not always c + b + a
# in floating point: there the tests allow a few ulps. One process on the whole batch sums its
# mean loss's terms in yet another order, so it too is compared with a tolerance.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _state(model: nn.Module) -> dict:
    return {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _cap_text(cap) -> str:
    if cap is None:
        return "None"
    if cap == TINY:
        return "1e-6 MiB (smaller than every tensor)"
    if cap == SPLIT:
        return "280 bytes (280 / 2**20 MiB)"
    return f"{cap:g} MiB"


def _trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


# --------------------------------------------------------------------------- step 1: assign_buckets


def _expected(nbytes: list[int], cap) -> list[list[int]]:
    """The rule, written plainly: reverse order, close before the cap would be exceeded."""
    buckets, current, size = [], [], 0
    for index in reversed(range(len(nbytes))):
        if current and cap is not None and size + nbytes[index] > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes[index]
    return buckets + ([current] if current else [])


def _greedy(sizes: list[int], order: list[int], cap, closes) -> list[list[int]]:
    buckets, current, size = [], [], 0
    for index in order:
        if closes(current, size, sizes[index], cap):
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += sizes[index]
    return buckets + ([current] if current else [])


def _before(current, size, nbytes, cap) -> bool:
    return bool(current) and cap is not None and size + nbytes > cap


def _known_mistakes(nbytes: list[int], numels: list[int], cap) -> list[tuple[list, str]]:
    """What each usual mistake returns for these sizes, and what to say when it shows."""
    n = len(nbytes)
    back, forth = list(reversed(range(n))), list(range(n))
    forward = _greedy(nbytes, forth, cap, _before)
    return [
        (
            forward,
            "filled the buckets in forward parameter order: backward produces gradients from "
            "the last layer to the first, so fill them in reverse order (the first bucket "
            "starts with the last parameter, index len(params) - 1)",
        ),
        (
            [list(reversed(b)) for b in reversed(forward)],
            "built the buckets in forward order and then reversed the list: the boundaries "
            "must be found walking backwards from the last parameter, and each bucket lists "
            "its indices in that order too",
        ),
        (
            _greedy(
                nbytes,
                back,
                cap,
                lambda current, size, _nbytes, cap: cap is not None and current and size >= cap,
            ),
            "let a bucket grow past the cap and closed it only once it had reached it (torch's "
            "DDP does that; this kata's rule is stricter): close a bucket before a tensor "
            "would push it over cap_bytes",
        ),
        (
            _greedy(numels, back, cap, _before),
            "compared element counts (numel()) with a cap in bytes: a tensor's size in bytes is "
            "numel() * element_size()",
        ),
        (
            _greedy([4 * x for x in numels], back, cap, _before),
            "assumed 4 bytes per element: a tensor's size in bytes is numel() * element_size() "
            "(8 for float64, 2 for float16)",
        ),
        (
            _greedy(
                nbytes,
                back,
                cap,
                lambda current, size, nbytes, cap: (
                    bool(current) and cap is not None and size + nbytes >= cap
                ),
            ),
            "closed a bucket that the next tensor would fill exactly to the cap: a bucket may "
            "hold exactly cap_bytes; it closes only when a tensor would push it over",
        ),
        (
            _greedy(
                nbytes,
                back,
                cap,
                lambda current, size, nbytes, cap: cap is not None and size + nbytes > cap,
            ),
            "started with an empty bucket: a tensor larger than the cap must not close a "
            "bucket that holds nothing yet (check that the current bucket is not empty)",
        ),
    ]


def _tensors(numels: list[int], dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for n in numels]


def _call_assign(kata, params, cap):
    call = f"assign_buckets(<{len(params)} tensors>, {cap!r})"
    try:
        got = kata.assign_buckets(params, cap)
    except KataTodo:
        raise
    except Exception as error:
        why = (
            ": None means no cap, one bucket holding every index (never compare a size with None)"
            if cap is None
            else ""
        )
        raise AssertionError(f"{call} raised {type(error).__name__}: {error}{why}") from None
    assert isinstance(got, (list, tuple)) and all(isinstance(b, (list, tuple)) for b in got), (
        f"{call} returned {got!r}: return a list of buckets, each a list of indices into params"
    )
    return [[int(i) for i in bucket] for bucket in got]


def check_assignment(kata, numels: list[int], dtype, cap) -> None:
    params = _tensors(numels, dtype)
    nbytes = [t.numel() * t.element_size() for t in params]
    got = _call_assign(kata, params, cap)
    expected = _expected(nbytes, cap)
    if got == expected:
        return
    sizes = ", ".join(f"{i}: {b} B" for i, b in enumerate(nbytes))
    case = f"assign_buckets with sizes {{{sizes}}} ({dtype}) and cap_bytes={cap!r}"
    if any(len(bucket) == 0 for bucket in got):
        raise AssertionError(
            f"{case} returned {got} with an empty bucket: every bucket holds at least one "
            "tensor (a tensor larger than the cap must not close a bucket that holds nothing yet: "
            f"check that the current bucket is not empty). Expected {expected}"
        )
    whys = [why for wrong, why in _known_mistakes(nbytes, numels, cap) if got == wrong != expected]
    if whys:  # two mistakes can give the same buckets (numel, or 4 bytes, for float64): name both
        raise AssertionError(
            f"{case} returned {got}, expected {expected}: it " + "; or it ".join(whys)
        )
    flat = sorted(i for bucket in got for i in bucket)
    if flat != list(range(len(params))):
        raise AssertionError(
            f"{case} returned {got}: every index 0..{len(params) - 1} must be in exactly one "
            f"bucket. Expected {expected}"
        )
    over = [b for b in got if len(b) > 1 and cap is not None and sum(nbytes[i] for i in b) > cap]
    raise AssertionError(
        f"{case} returned {got}, expected {expected}"
        + (
            f" (bucket {over[0]} holds {sum(nbytes[i] for i in over[0])} bytes, over the cap)"
            if over
            else ""
        )
        + ". Walk the indices from the last to the first; add each tensor to the current bucket "
        "unless it would push the bucket over the cap, in which case close the bucket first"
    )


ASSIGNMENTS = {
    # The lesson's example: 400 300 600 200 1200 bytes, cap 1000 -> [[4], [3, 2], [1, 0]].
    "lesson": ([100, 75, 150, 50, 300], torch.float32, 1000),
    # 500 + 500 fills a bucket exactly to the cap, which is allowed.
    "exactly-the-cap": ([100, 150, 125, 125], torch.float32, 1000),
    # float64: 400 bytes per tensor, though only 50 elements each.
    "float64": ([50, 50, 50, 50, 50], torch.float64, 1000),
    # Tensors larger than the cap between small ones.
    "larger-than-the-cap": ([25, 1250, 25, 25, 1250, 25], torch.float32, 1000),
    "float16": ([300, 200, 700, 100], torch.float16, 1000),
    # Four equal tensors: where the walk starts decides where the boundaries fall.
    "four-equal": ([75, 75, 75, 75], torch.float32, 1000),
}


@pytest.mark.step(1)
@pytest.mark.parametrize("case", list(ASSIGNMENTS))
def test_assign_buckets_fills_in_reverse_order_under_the_cap(kata, case):
    numels, dtype, cap = ASSIGNMENTS[case]
    check_assignment(kata, numels, dtype, cap)


@pytest.mark.step(1)
def test_assign_buckets_none_means_one_bucket(kata):
    for numels in ([100, 75, 150, 50, 300], [1], [10**6, 3, 10**5]):
        got = _call_assign(kata, _tensors(numels), None)
        expected = [list(reversed(range(len(numels))))]
        assert got == expected, (
            f"assign_buckets(<{len(numels)} tensors>, None) returned {got}: None means no cap, "
            f"one bucket holding every index from the last to the first, {expected}"
        )
    for cap in (None, 1000):
        got = _call_assign(kata, [], cap)
        assert got == [], f"assign_buckets([], {cap!r}) returned {got}: no tensors, no buckets: []"


@pytest.mark.step(1)
def test_assign_buckets_cap_smaller_than_every_tensor(kata):
    check_assignment(kata, [100, 75, 150, 50, 300], torch.float32, 1)
    check_assignment(kata, [3, 1, 2], torch.float32, 0.5)


@pytest.mark.step(1)
@pytest.mark.parametrize("cap", [0, -1, -0.5])
def test_assign_buckets_refuses_a_cap_that_is_not_positive(kata, cap):
    params = _tensors([10, 20])
    try:
        got = kata.assign_buckets(params, cap)
    except ValueError as error:
        assert str(cap) in str(error), (
            f"assign_buckets(params, {cap!r}) raised ValueError({str(error)!r}): say which cap is "
            f"wrong ({cap!r}) and that it must be a positive number of bytes (or None)"
        )
        return
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(
            f"assign_buckets(params, {cap!r}) raised {type(error).__name__}: {error}; a cap that is "
            "not positive must raise ValueError saying so"
        ) from None
    raise AssertionError(
        f"assign_buckets(params, {cap!r}) returned {got}: a cap of {cap!r} bytes holds nothing; "
        "raise ValueError saying that cap_bytes must be positive (or None for one bucket)"
    )


# --------------------------------------------------------------------------- step 2: the same start


def _group(group_ranks):
    import torch.distributed as dist

    return dist.new_group(group_ranks) if group_ranks else None


def _start(rank, world_size, name, group_ranks):
    """Wrap a model built from this rank's own seed: what the start leaves (the wrapper is built
    through its public constructor; a todo of a later step only means the buckets are not there)."""
    kata = load_kata(KATA)
    group = _group(group_ranks)
    model = make_model(name, 100 + rank)
    before = _state(model)
    if group_ranks and rank not in group_ranks:
        return before, before, [], None

    failure = None
    with recording() as calls:
        try:
            kata.BucketedDDP(model, process_group=group)
        except KataTodo as todo:
            if todo.step <= 2:
                raise
            # A later step (the buckets) is not written yet: the start comes first, and is done.
        except Exception as error:
            failure = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    made = [(c.name, c.peers.get("src"), c.shapes[0] if c.shapes else (), c.group) for c in calls]
    made = [(n, src, shape, group is not None and g is group) for n, src, shape, g in made]
    return before, _state(model), made, failure


def check_same_start(name: str, world_size: int, group_ranks=None) -> None:
    try:
        results = run_world(_start, world_size, name, group_ranks, deadline=15)
    except WorldDeadlock as deadlock:
        if group_ranks:
            outside = [r for r in range(world_size) if r not in group_ranks]
            raise AssertionError(
                f"BucketedDDP on the group {group_ranks} (of a world of {world_size}): its ranks "
                f"waited in a collective that rank(s) {outside}, outside the group, never call. "
                "Pass group=self.process_group to every collective (dist.broadcast(..., "
                f"group=self.process_group)).\n{deadlock}"
            ) from None
        raise AssertionError(
            "BucketedDDP's construction never finished: the ranks waited for each other in their "
            "broadcasts. Every rank must broadcast the same tensors in the same order from the "
            f"same source, the group's first rank.\n{deadlock}"
        ) from None
    members = group_ranks or list(range(world_size))
    first = members[0]
    source = results[first][0]
    where = f"on the group {group_ranks} of a world of {world_size}" if group_ranks else ""
    for rank in members:
        before, after, made, failure = results[rank]
        sources = sorted({src for call, src, _, _ in made if call == "broadcast"})
        if sources and sources != [first]:
            raise AssertionError(
                f"rank {rank} broadcast from src={sources[0]} {where}: the source is the group's "
                f"first rank, here global rank {first} (dist.get_global_rank(group, 0), with "
                "dist.group.WORLD when process_group is None); broadcast takes a global rank"
                + (f". It raised {failure}" if failure else "")
            )
        if failure:
            raise _construction_failure(f"rank {rank}'s BucketedDDP(...)", failure, 25.0)
        others = sorted({call for call, *_ in made if call != "broadcast"})
        assert not others, (
            f"rank {rank}'s _broadcast_state called {', '.join(others)}: copying the first rank's "
            "tensors takes only dist.broadcast (a copy, not an average)"
        )
        if group_ranks and made and not all(in_group for *_, in_group in made):
            raise AssertionError(
                f"rank {rank} broadcast on the whole world, not on its group {group_ranks}: pass "
                "group=self.process_group to dist.broadcast"
            )
        for key, expected in source.items():
            if torch.equal(after[key], expected):
                continue
            if rank == first:
                raise AssertionError(
                    f"BucketedDDP changed the first rank's (rank {first}'s) own {key!r}: it is the "
                    "source every rank copies"
                )
            if "frozen" in key:
                what = (
                    "a frozen parameter: it gets no gradient, but it is random like the others. "
                    "Broadcast every parameter, frozen ones too (model.parameters(), not only "
                    "those with requires_grad)"
                )
            elif key == "scale":
                what = (
                    "a buffer: no gradient ever touches it, yet the forward pass uses it. "
                    "Broadcast every buffer too (model.buffers())"
                )
            else:
                what = "a parameter: broadcast every parameter (in place, inside torch.no_grad())"
            raise AssertionError(
                f"after BucketedDDP(...) {where} rank {rank}'s {key!r} still differs from rank "
                f"{first}'s by up to {_difference(after[key], expected):.3g}; {key!r} is {what}"
            )
    shapes = [[shape for _, _, shape, _ in results[r][2]] for r in members]
    for rank, mine in zip(members, shapes):
        assert mine == shapes[0], (
            f"rank {rank} broadcast tensors shaped {mine}, rank {members[0]} {shapes[0]}: every "
            "rank must broadcast the same tensors in the same order (module order)"
        )
    for rank in range(world_size):
        if rank not in members:
            assert all(torch.equal(results[rank][1][k], results[rank][0][k]) for k in source), (
                f"rank {rank}, outside the group {group_ranks}, changed its model"
            )


@pytest.mark.step(2)
@pytest.mark.parametrize("name", MODELS)
def test_every_rank_starts_from_the_first_ranks_state(kata, name):
    check_same_start(name, 3)


@pytest.mark.step(2)
def test_a_subgroup_starts_from_its_own_first_rank(kata):
    check_same_start("buffer", 3, group_ranks=[1, 2])


# --------------------------------------------------------------------------- step 3: the buckets


def _crash_text(error: BaseException) -> str:
    """A construction's or a backward's exception, with what the usual torch crashes mean here."""
    text = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
    if "setStorage" in text or "out of bounds" in text:
        text += (
            " (torch means a slot reaches past the end of its bucket's flat buffer: each slot is "
            "flat[offset:offset + numel] with offset the sum of the numels before it, and the "
            "flat buffer holds every slot of its bucket)"
        )
    elif "split_with_sizes" in text:
        text += (
            " (torch means the slot sizes do not add up to the flat buffer's: the buffer holds "
            "exactly the numel of every parameter of its bucket)"
        )
    return text


def _wrapped(kata, model, cap):
    """``(BucketedDDP(model, cap), None)``, or ``(None, what its construction raised)``."""
    try:
        return kata.BucketedDDP(model, bucket_cap_mb=cap), None
    except KataTodo:
        raise
    except Exception as error:
        return None, _crash_text(error)


def _construction_failure(where: str, failure: str, cap) -> AssertionError:
    if "hook" in failure and "require" in failure:
        return AssertionError(
            f"{where} raised {failure}: a hook went on a frozen parameter. Frozen parameters get "
            "no gradient: give hooks (and bucket slots) to the trainable parameters only "
            "(requires_grad)"
        )
    if cap is None and "TypeError" in failure:
        return AssertionError(
            f"{where} raised {failure}: bucket_cap_mb=None means no cap, one bucket holding every "
            "trainable parameter (the lesson, and torch's own bucket rule's None). Pass None on to "
            "assign_buckets as the cap in bytes (None stays None): never multiply or compare it"
        )
    return AssertionError(f"{where} raised {failure}")


def _facade(rank, world_size, name, caps):
    """The wrapper as a module, through its public face only: .module, its parameters, buffers
    and state_dict, and forward with a keyword argument."""

    kata = load_kata(KATA)
    out = {}
    for cap in caps:
        model = make_model(name, 100 + rank)
        ddp, failure = _wrapped(kata, model, cap)
        if failure:
            out[cap] = {"failure": failure}
            continue
        inputs, _ = make_batch(name, PER_RANK, rank)
        keyword, keywords = wrappers.forward_keywords(ddp, model, inputs)
        out[cap] = {
            "failure": None,
            "module_is_model": ddp.module is model,
            "own_parameters": [n for n, _ in ddp.named_parameters()],
            "own_buffers": [n for n, _ in ddp.named_buffers()],
            "model_state_keys": list(model.state_dict()),
            "state_keys": sorted(ddp.state_dict()),
            "keyword": keyword,
            "keywords": keywords,
        }
    return out


@pytest.mark.step(3)
@pytest.mark.parametrize("name", MODELS)
def test_the_wrapper_is_its_module_and_passes_every_argument_on(kata, name):
    for cap, got in run_world(_facade, 2, name, (25.0, None))[1].items():
        where = f"BucketedDDP({name} model, bucket_cap_mb={_cap_text(cap)})"
        if got["failure"]:
            raise _construction_failure(where, got["failure"], cap)
        assert got["module_is_model"], f"{where}: .module must be the wrapped model itself"
        extra_params = [n for n in got["own_parameters"] if not n.startswith("module.")]
        extra_buffers = [n for n in got["own_buffers"] if not n.startswith("module.")]
        assert not extra_params and not extra_buffers, (
            f"{where} registered {extra_params + extra_buffers} as parameters or buffers of its "
            "own: they would land in the state_dict and in the optimizer. Keep the flat buffers in "
            "plain attributes (a Bucket in self.buckets), not register_buffer or nn.Parameter"
        )
        expected_keys = sorted(f"module.{k}" for k in got["model_state_keys"])
        assert got["state_keys"] == expected_keys, (
            f"{where}: its state_dict holds {got['state_keys']}, expected the module's own keys "
            f"under 'module.', {expected_keys}, as torch's DDP"
        )
        wrappers.check_forward_keywords(got["keyword"], got["keywords"], f"{where}: ")


def _layout(rank, world_size, name, caps):
    """For each cap: the buckets as parameter names, and what each flat buffer and view is."""
    kata = load_kata(KATA)
    out = {}
    for cap in caps:
        model = make_model(name, 100 + rank)
        names = {id(p): n for n, p in model.named_parameters()}
        ddp, failure = _wrapped(kata, model, cap)
        if failure:
            out[cap] = {"failure": failure}
            continue
        buckets = []
        for bucket in getattr(ddp, "buckets", []):
            flat = bucket.flat
            views = []
            for param, view in zip(bucket.params, bucket.views):
                shares = view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                views.append(
                    {
                        "shape": tuple(view.shape),
                        "param_shape": tuple(param.shape),
                        "shares": shares,
                        "offset": view.storage_offset() - flat.storage_offset(),
                    }
                )
            buckets.append(
                {
                    "names": [
                        names.get(id(p), "<not a parameter of the model>") for p in bucket.params
                    ],
                    "numel": flat.numel(),
                    "dim": flat.dim(),
                    "dtype": str(flat.dtype),
                    "device": str(flat.device),
                    "contiguous": flat.is_contiguous(),
                    "views": views,
                    "arrived": list(bucket.arrived),
                    "handle": bucket.handle is not None,
                }
            )
        out[cap] = {
            "failure": None,
            "has_buckets": isinstance(getattr(ddp, "buckets", None), list),
            "buckets": buckets,
            "trainable": _trainable_names(model),
            "sizes": {n: p.numel() * p.element_size() for n, p in model.named_parameters()},
        }
    return out


def check_layout(name: str, layout: dict) -> None:
    for cap, got in layout.items():
        where = f"BucketedDDP({name} model, bucket_cap_mb={_cap_text(cap)})"
        if got["failure"]:
            raise _construction_failure(where, got["failure"], cap)
        assert got["has_buckets"], (
            f"{where} has no list self.buckets: this kata's layout is self.buckets, one Bucket("
            "params, flat, views, arrived) per bucket in bucket order (the other tests judge only "
            "what the wrapper does; this one reads the layout the stub asks for)"
        )
        trainable = got["trainable"]
        sizes = [got["sizes"][n] for n in trainable]
        cap_bytes = None if cap is None else cap * MIB
        expected = [[trainable[i] for i in b] for b in _expected(sizes, cap_bytes)]
        buckets = got["buckets"]
        names = [b["names"] for b in buckets]
        every = [n for bucket in names for n in bucket]
        frozen = [n for n in every if n not in trainable]
        if frozen:
            raise AssertionError(
                f"{where}: the buckets hold {frozen}, which is frozen (requires_grad=False): it "
                "never gets a gradient, so its bucket would never be complete. Bucket the "
                "trainable parameters only"
            )
        twice = sorted({n for n in every if every.count(n) > 1})
        if twice:
            raise AssertionError(
                f"{where}: {twice} sits in {every.count(twice[0])} slots. Tied weights are one "
                "parameter reached twice: one slot, one hook. module.parameters() lists each "
                "parameter once; named_parameters(remove_duplicate=False) or walking the "
                "submodules lists a tied one twice"
            )
        if names != expected:
            mb = [[trainable[i] for i in b] for b in _expected(sizes, cap * 10**6)] if cap else None
            if mb is not None and names == mb and mb != expected:
                raise AssertionError(
                    f"{where} made the buckets {names}, expected {expected}: bucket_cap_mb is in MiB "
                    "(2**20 = 1048576 bytes), as in torch's DDP, not MB (10**6 bytes)"
                )
            raise AssertionError(
                f"{where} made the buckets {names}, expected {expected}: the trainable parameters "
                "(module.parameters() with requires_grad, in module order) through your "
                "assign_buckets, with the cap converted to bytes (None stays None)"
            )
        for number, bucket in enumerate(buckets):
            label = f"{where}: bucket {number} ({', '.join(bucket['names'])})"
            total = sum(got["sizes"][n] for n in bucket["names"]) // 4
            assert bucket["dim"] == 1 and bucket["contiguous"] and bucket["numel"] == total, (
                f"{label}: its flat buffer must be one contiguous 1-D tensor of {total} elements "
                f"(every gradient end to end), got {bucket['dim']}-D with {bucket['numel']}"
            )
            assert bucket["dtype"] == "torch.float32" and bucket["device"] == "cpu", (
                f"{label}: its flat buffer is {bucket['dtype']} on {bucket['device']}, expected the "
                "parameters' dtype and device (float32 on cpu here)"
            )
            offset = 0
            for param_name, view in zip(bucket["names"], bucket["views"]):
                assert view["shares"], (
                    f"{label}: the slot of {param_name} is not a view of the flat buffer: make it "
                    "flat[offset:offset + numel].view_as(param), the same memory, so that the "
                    "all-reduce of the flat buffer reaches it"
                )
                assert view["shape"] == view["param_shape"], (
                    f"{label}: the slot of {param_name} is shaped {view['shape']}, the parameter "
                    f"{view['param_shape']}: view it as the parameter (view_as)"
                )
                assert view["offset"] == offset, (
                    f"{label}: the slot of {param_name} starts at element {view['offset']} of the "
                    f"flat buffer, expected {offset}: slots follow each other in the bucket's "
                    "order, without gaps or overlaps"
                )
                offset += math.prod(view["param_shape"])
            assert bucket["arrived"] == [False] * len(bucket["names"]) and not bucket["handle"], (
                f"{label}: a new bucket starts with arrived = [False] * {len(bucket['names'])} and "
                "no handle"
            )


@pytest.mark.step(3)
@pytest.mark.parametrize("name", MODELS)
def test_buckets_hold_the_trainable_parameters_in_reverse_order(kata, name):
    """The one test of the layout this kata asks for: ``ddp.buckets``, a list of ``Bucket``s in
    bucket order, each with its parameters, one flat buffer, a view of it per parameter and its
    arrived flags. Every other test judges what the wrapper does, through its public face."""
    layout = run_world(_layout, 2, name, CAPS)[1]
    check_layout(name, layout)


def _hook_counts(rank, world_size, name, cap):
    """How many post-accumulate-grad hooks the wrapper put on each parameter (torch's record)."""
    kata = load_kata(KATA)
    model = make_model(name, 100 + rank)
    _, failure = _wrapped(kata, model, cap)
    if failure:
        return {"failure": failure}
    counts = {
        n: len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        for n, p in model.named_parameters()
    }
    return {"failure": None, "counts": counts, "trainable": _trainable_names(model)}


@pytest.mark.step(3)
@pytest.mark.parametrize("name", MODELS)
def test_one_hook_per_trainable_parameter(kata, name):
    for cap in (TINY, None):
        got = run_world(_hook_counts, 2, name, cap)[0]
        where = f"BucketedDDP({name} model, bucket_cap_mb={_cap_text(cap)})"
        if got["failure"]:
            raise _construction_failure(where, got["failure"], cap)
        counts, trainable = got["counts"], got["trainable"]
        if not any(counts.values()):
            raise AssertionError(
                f"{where} registered no post-accumulate-grad hook: register, on each trainable "
                "parameter, param.register_post_accumulate_grad_hook(hook), a hook that hands "
                "the gradient to its bucket (self._on_gradient_ready(bucket_index, position, "
                "param))"
            )
        for param_name in trainable:
            count = counts[param_name]
            assert count == 1, (
                f"{where} put {count} post-accumulate-grad hooks on {param_name}, expected one: "
                "one hook per trainable parameter (a tied weight is one parameter: one hook)"
            )
        frozen = [n for n, c in counts.items() if c and n not in trainable]
        assert not frozen, f"{where} put a hook on {frozen}, which is frozen"


# --------------------------------------------------------------------------- step 4: launches


class ReorderedModel(nn.Module):
    """Layers used in another order than they are registered: ``second`` is registered first but
    runs after ``first``, so its gradients arrive before ``first``'s, out of reverse
    registration order (the order of a bucket's slots). Inputs and targets as the frozen model's."""

    def __init__(self):
        super().__init__()
        self.second = nn.Linear(16, 16)
        self.first = nn.Linear(8, 16)
        self.last = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.second(torch.relu(self.first(x)))))


def _model(name: str, seed: int) -> nn.Module:
    if name != "reordered":
        return make_model(name, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ReorderedModel()


def _data(name: str, size: int, seed: int):
    return make_batch("frozen" if name == "reordered" else name, size, seed)


def _rule_buckets(model: nn.Module, cap) -> list[list[tuple[str, int]]]:
    """The buckets the kata's rule makes for ``model``: (name, numel) of each slot, in order."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cap_bytes = None if cap is None else cap * MIB
    sizes = [p.numel() * p.element_size() for _, p in trainable]
    return [
        [(trainable[i][0], trainable[i][1].numel()) for i in b] for b in _expected(sizes, cap_bytes)
    ]


def _arrived_flags(ddp) -> list | None:
    """The kata layout's arrived flags, if the wrapper has them: only to explain a failure."""
    try:
        return [list(bucket.arrived) for bucket in ddp.buckets]
    except Exception:
        return None


def _launches(rank, world_size, name, cap):
    """One backward: when each gradient was ready, when each all-reduce was launched."""
    import torch.distributed as dist

    kata = load_kata(KATA)
    model = _model(name, 100 + rank)
    names = {id(p): n for n, p in model.named_parameters()}
    ready = []
    for param in model.parameters():  # registered before the wrapper's: they fire first
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(
                lambda p: ready.append((time.perf_counter(), names[id(p)]))
            )
    ddp = kata.BucketedDDP(model, bucket_cap_mb=cap)
    batch = _data(name, PER_RANK, rank)
    with recording() as calls:
        loss(ddp, batch).backward()
        returned = time.perf_counter()
    dist.barrier()  # gloo's barrier waits for every pending all-reduce first
    launched = [
        {
            "name": c.name,
            "start": c.start,
            "shapes": c.shapes,
            "async": c.async_op,
            "op": c.op,
        }
        for c in calls
    ]
    buckets = [([n for n, _ in b], sum(numel for _, numel in b)) for b in _rule_buckets(model, cap)]
    return {
        "ready": ready,
        "returned": returned,
        "launched": launched,
        "buckets": buckets,
        "arrived": _arrived_flags(ddp),
    }


def check_launches(name: str, cap, got: dict) -> None:
    where = f"BucketedDDP({name} model, bucket_cap_mb={_cap_text(cap)})"
    buckets, launched, ready = got["buckets"], got["launched"], got["ready"]
    flags = got["arrived"]
    if flags is not None and len(ready) > 1 and sum(map(sum, flags)) == 1:
        raise AssertionError(
            f"{where}: all {len(ready)} gradients arrived, but only one slot of one bucket is "
            "marked arrived: every hook reported the same slot. A lambda made in a loop sees the "
            "loop's variables as they are when it runs, after the loop ended: bind them when the "
            "hook is made, functools.partial(self._on_gradient_ready, index, position), or "
            "default arguments"
        )
    others = sorted({c["name"] for c in launched if c["name"] != "all_reduce"})
    assert not others, (
        f"{where}: backward called {others}: a hook launches one all_reduce per bucket, nothing else"
    )
    if not launched:
        raise AssertionError(
            f"{where}: backward returned without a single all-reduce launched: when a bucket's "
            "last gradient arrives, the hook must launch its all-reduce right away "
            "(async_op=True), so that it runs while backward computes the rest. That is the overlap"
        )
    sizes = [numel for _, numel in buckets]
    shapes = [tuple(c["shapes"][0]) if c["shapes"] else () for c in launched]
    if len(launched) > len(buckets):
        raise AssertionError(
            f"{where}: one backward launched {len(launched)} all-reduces for {len(buckets)} "
            f"bucket(s) (shapes {shapes}): launch one all-reduce of the bucket's flat buffer when "
            "its last gradient arrives, not one per gradient"
        )
    blocking = [i for i, c in enumerate(launched) if not c["async"]]
    if blocking:
        raise AssertionError(
            f"{where}: the all-reduce of bucket {blocking[0]} was blocking (async_op=False): "
            "backward stopped until it finished, so nothing overlapped. Launch it with "
            "async_op=True, keep the handle in the bucket, and wait in "
            "finish_gradient_synchronization"
        )
    flat_shapes = sorted((n,) for n in sizes)
    not_flat = [s for s in shapes if s not in flat_shapes]
    assert not not_flat, (
        f"{where}: it all-reduced tensors shaped {not_flat}, but the buckets hold "
        f"{[n for n in sizes]} elements: all-reduce the bucket's flat buffer (every gradient of "
        "the bucket end to end), into which the hook copied the gradient"
    )
    order = [n for _, n in sorted(ready)]
    arrival = {n: i for i, n in enumerate(order)}
    times = [t for t, _ in sorted(ready)] + [got["returned"]]
    expected_order = sorted(
        range(len(buckets)), key=lambda b: max(arrival[n] for n in buckets[b][0])
    )
    for call, number in zip(launched, expected_order):
        members, numel = buckets[number]
        last = max(arrival[n] for n in members)
        assert call["shapes"] and tuple(call["shapes"][0]) == (numel,), (
            f"{where}: the all-reduces came in the order {shapes}; bucket {number} ({members}) "
            f"was complete first and must be launched then, {(numel,)}"
        )
        if call["start"] < times[last]:
            early = [n for n in members if times[arrival[n]] <= call["start"]]
            missing = [n for n in members if n not in early]
            if early and max(early, key=arrival.get) == members[-1]:
                raise AssertionError(
                    f"{where}: bucket {number}'s all-reduce started once the gradient of its last "
                    f"slot ({members[-1]}) had arrived, before {', '.join(missing)}: gradients do "
                    "not always arrive in slot order (this model uses its layers in another order "
                    "than it registers them). Launch a bucket when every one of its gradients has "
                    "arrived (all(bucket.arrived)), not when its last slot is filled"
                )
            raise AssertionError(
                f"{where}: bucket {number}'s all-reduce started after {len(early)} of its "
                f"{len(members)} gradients had arrived: launch it when its last gradient is in "
                "(all of bucket.arrived), or the others are summed before they are there"
            )
        if call["start"] > times[last + 1]:
            what = "backward returned" if last + 1 == len(order) else f"{order[last + 1]} was ready"
            raise AssertionError(
                f"{where}: bucket {number}'s last gradient ({order[last]}) arrived, but its "
                f"all-reduce started only after {what}: launch it in the hook of its last gradient"
            )
    assert len(launched) == len(buckets), (
        f"{where}: one backward launched {len(launched)} all-reduce(s) for {len(buckets)} "
        "buckets: every bucket whose gradients all arrived must be launched by the hook"
    )
    assert launched[0]["start"] < got["returned"]


@pytest.mark.step(4)
@pytest.mark.parametrize("name", (*MODELS, "reordered"))
def test_each_bucket_is_launched_when_its_last_gradient_arrives(kata, name):
    for cap in (None, SPLIT, TINY):
        results = run_world(_launches, 2, name, cap)
        for got in results:
            check_launches(name, cap, got)


# --------------------------------------------------------------------------- step 5: finish


def _batch(name: str, step: int, micro: int, shard: int):
    return make_batch(name, PER_RANK, 10_000 * step + 100 * micro + shard)


def _train(rank, world_size, name, caps, steps, micro_batches, group_ranks=None):
    """Train with BucketedDDP beside a lockstep reference that all-reduces each gradient alone."""
    import torch.distributed as dist

    kata = load_kata(KATA)
    group = _group(group_ranks)
    members = group_ranks or list(range(world_size))
    if rank not in members:
        return None
    shard = members.index(rank)
    out = {}
    for cap in caps:
        model = make_model(name, 100 + rank)
        ddp = kata.BucketedDDP(model, bucket_cap_mb=cap, process_group=group)
        reference = make_model(name, 0)
        reference.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
        record = []
        for step in range(steps):
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
            inside = []
            with recording() as calls:
                for micro in range(micro_batches):
                    batch = _batch(name, step, micro, shard)
                    last = micro == micro_batches - 1
                    with contextlib.nullcontext() if last else ddp.no_sync():
                        with recording() as during:
                            (loss(ddp, batch) / micro_batches).backward()
                    if not last:
                        inside.append(len(during))
                dist.barrier(group=group)  # nothing below may depend on timing
                _finish(ddp)
                again = len(calls)
                _finish(ddp)  # a second call does nothing
                twice = len(calls) - again
            for micro in range(micro_batches):
                (loss(reference, _batch(name, step, micro, shard)) / micro_batches).backward()
            local = {
                n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None
            }
            for param in reference.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=group)
                    param.grad /= len(members)
            record.append(
                {
                    "collectives": [c.name for c in calls[:again] if c.name != "barrier"],
                    "twice": twice,
                    "inside": inside,
                    "grads": {
                        n: (None if p.grad is None else p.grad.clone())
                        for n, p in model.named_parameters()
                    },
                    "expected": {
                        n: p.grad.clone()
                        for n, p in reference.named_parameters()
                        if p.grad is not None
                    },
                    "local": local,
                }
            )
            optimizer.step()
            reference_optimizer.step()
        out[cap] = {
            "steps": record,
            "buckets": len(_rule_buckets(model, cap)),
            "state": _state(model),
            "buffers": [n for n, _ in model.named_buffers()],
        }
    return out


def _finish(ddp) -> None:
    wrappers.finish(
        ddp,
        "A bucket whose gradients did not all arrive was never launched by a hook (launch every "
        "bucket still waiting first, in bucket order), or an all_reduce without async_op=True "
        "returned None instead of a handle",
    )


def _one_process(name: str, steps: int, micro_batches: int, shards: int, seed: int) -> dict:
    """One process, the first rank's model, on the whole batch (every shard's micro-batches)."""
    model = make_model(name, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        parts = [_batch(name, step, m, s) for s in range(shards) for m in range(micro_batches)]
        whole = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        optimizer.zero_grad()
        loss(model, whole).backward()
        optimizer.step()
    return _state(model)


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(a, b)
    return torch.allclose(a, b, **TOLERANCE)


def check_gradients(
    where: str, rank: int, step: int, got: dict, size: int, world: int, exact: bool
):
    """The step's averaged gradients against the lockstep reference, with what a mismatch means."""
    for name, expected in got["expected"].items():
        mine = got["grads"].get(name)
        if mine is None:
            raise AssertionError(
                f"{where}: after step {step + 1} rank {rank}'s {name}.grad is None: copy the "
                "averages back into each parameter's .grad"
            )
        if _same(mine, expected, exact):
            continue
        local = got["local"][name]
        if torch.equal(mine, local):
            raise AssertionError(
                f"{where}: after finish_gradient_synchronization() rank {rank}'s {name}.grad still "
                "holds this rank's own gradient: wait for the bucket's handle, divide, and copy "
                "its slot back into .grad (the flat buffer holds a copy, not the gradient itself)"
            )
        if torch.allclose(mine, expected * size, **TOLERANCE):
            raise AssertionError(
                f"{where}: rank {rank}'s {name}.grad holds the sum over the {size} ranks, not "
                f"their mean: divide by the group's size (dist.get_world_size(self.process_group))"
            )
        if torch.allclose(mine * size, expected, **TOLERANCE):
            raise AssertionError(
                f"{where}: rank {rank}'s {name}.grad holds the mean divided by {size} once more. "
                "Either the gradients were divided twice (in the hook and again in finish: "
                "divide once), or the second finish_gradient_synchronization() of the step (the "
                "test calls it twice) worked on the finished step again: the first call must "
                "reset the step's state (every bucket's arrived flags and handle), so that a "
                "second call does nothing and the next step starts clean"
            )
        if world != size and torch.allclose(mine * world, expected * size, **TOLERANCE):
            raise AssertionError(
                f"{where}: rank {rank}'s {name}.grad is the sum over the group's {size} ranks "
                f"divided by {world}, the whole world's size: divide by the group's size, "
                "dist.get_world_size(self.process_group)"
            )
        if step > 0:
            raise AssertionError(
                f"{where}: step 1 averaged right, but after step {step + 1} rank {rank}'s "
                f"{name}.grad is off by up to {_difference(mine, expected):.3g}: "
                "finish_gradient_synchronization() must reset the step (arrived flags, handles) "
                "so that the next step starts clean, with nothing to call first"
            )
        raise AssertionError(
            f"{where}: after finish_gradient_synchronization() rank {rank}'s {name}.grad differs "
            f"from the mean over the ranks by up to {_difference(mine, expected):.3g}"
        )


def check_training(name, caps, results, world_size, steps, micro_batches, group_ranks=None):
    members = group_ranks or list(range(world_size))
    size = len(members)
    exact = size == 2  # see TOLERANCE
    whole = _one_process(name, steps, micro_batches, size, 100 + members[0])
    for cap in caps:
        where = f"BucketedDDP({name} model, bucket_cap_mb={_cap_text(cap)})" + (
            f" on the group {group_ranks}" if group_ranks else f" on {world_size} ranks"
        )
        for rank in members:
            got = results[rank][cap]
            for step, record in enumerate(got["steps"]):
                count = len(record["collectives"])
                first = len(got["steps"][0]["collectives"])
                if step and count != got["buckets"] and first == got["buckets"]:
                    raise AssertionError(
                        f"{where}: rank {rank} made {first} all-reduce(s) in step 1, one per "
                        f"bucket, but {count} in step {step + 1} ({record['collectives']}): "
                        "finish_gradient_synchronization() must reset the step's state (every "
                        "bucket's arrived flags and handle), so that the next step starts clean"
                    )
                if count != got["buckets"]:
                    raise AssertionError(
                        f"{where}: rank {rank} made {count} collective(s) in step {step + 1} "
                        f"({record['collectives']}), expected {got['buckets']}: one all-reduce per "
                        "bucket each step"
                    )
                assert record["twice"] == 0, (
                    f"{where}: a second finish_gradient_synchronization() in step {step + 1} made "
                    f"{record['twice']} more collective(s): after the first, nothing is pending "
                    "and a second call does nothing"
                )
                check_gradients(where, rank, step, record, size, world_size, exact)
            for key, expected in whole.items():
                mine = got["state"][key]
                if key in got["buffers"] and not torch.equal(mine, expected):
                    raise AssertionError(
                        f"{where}: after {steps} steps rank {rank}'s buffer {key!r} is not the "
                        f"first rank's (off by up to {_difference(mine, expected):.3g}): no "
                        "gradient touches a buffer, so it differs since construction. Broadcast "
                        "every buffer too (module.buffers()) from the group's first rank"
                    )
                assert torch.allclose(mine, expected, **TOLERANCE), (
                    f"{where}: after {steps} steps rank {rank}'s {key!r} differs by up to "
                    f"{_difference(mine, expected):.3g} from one process trained on the whole "
                    f"batch ({size} ranks x {micro_batches} x {PER_RANK} samples)"
                )


@pytest.mark.step(5)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", MODELS)
def test_training_equals_one_process_on_the_whole_batch(kata, name, world_size):
    caps = (25.0, TINY, None) if world_size == 2 else (SPLIT,)
    results = run_world(_train, world_size, name, caps, 3, 1)
    check_training(name, caps, results, world_size, 3, 1)


@pytest.mark.step(5)
def test_a_subgroup_averages_over_its_own_ranks(kata):
    try:
        results = run_world(_train, 3, "frozen", (SPLIT,), 2, 1, [1, 2], deadline=20)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            "BucketedDDP on the group [1, 2] of a world of 3: ranks 1 and 2 waited in a "
            "collective that rank 0, outside their group, never calls. Pass "
            "group=self.process_group to every collective (all_reduce too)\n" + str(deadlock)
        ) from None
    check_training("frozen", (SPLIT,), results, 3, 2, 1, [1, 2])


class SpareModel(nn.Module):
    """A model with a layer that forward never uses: its gradient never comes."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.last = nn.Linear(16, 4)
        self.spare = nn.Linear(16, 16)  # listed last: its bucket is the first to fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x)))


def _incomplete(rank, world_size, cap):
    kata = load_kata(KATA)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(100 + rank)
        model = SpareModel()
    ddp = kata.BucketedDDP(model, bucket_cap_mb=cap)
    reference = SpareModel()
    reference.load_state_dict(model.state_dict())
    batch = make_batch("frozen", PER_RANK, rank)
    with recording() as calls:
        loss(ddp, batch).backward()
        during = len(calls)
        _finish(ddp)
    loss(reference, batch).backward()
    for param in reference.parameters():
        if param.grad is not None:
            torch.distributed.all_reduce(param.grad)
            param.grad /= world_size
    return {
        "during": during,
        "calls": [(c.name, c.shapes[0] if c.shapes else ()) for c in calls],
        "buckets": [sum(n for _, n in b) for b in _rule_buckets(model, cap)],
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "expected": {n: p.grad for n, p in reference.named_parameters()},
    }


@pytest.mark.step(5)
@pytest.mark.parametrize("cap", [None, TINY], ids=["one-bucket", "tiny-cap"])
def test_finish_launches_buckets_that_never_filled(kata, cap):
    results = run_world(_incomplete, 2, cap)
    where = f"BucketedDDP(a model whose spare layer is unused, bucket_cap_mb={_cap_text(cap)})"
    for rank, got in enumerate(results):
        launched = [shape for call, shape in got["calls"] if call == "all_reduce"]
        if len(launched) < len(got["buckets"]):
            raise AssertionError(
                f"{where}: rank {rank} all-reduced {len(launched)} of its {len(got['buckets'])} "
                "bucket(s): a bucket waiting for a gradient that never came (spare.weight, "
                "spare.bias) was never launched. finish_gradient_synchronization() must launch "
                "every bucket still waiting, in bucket order, its missing slots zeroed"
            )
        assert len(launched) == len(got["buckets"]), (
            f"{where}: rank {rank} made {len(launched)} all-reduces for {len(got['buckets'])} "
            "buckets: one each"
        )
        for name, expected in got["expected"].items():
            mine = got["grads"][name]
            if expected is None:
                assert mine is None or not mine.any(), (
                    f"{where}: rank {rank}'s {name} got no gradient, yet holds {mine}"
                )
                continue
            assert mine is not None and torch.equal(mine, expected), (
                f"{where}: rank {rank}'s {name}.grad is not the mean over the ranks (off by up to "
                f"{_difference(mine, expected) if mine is not None else 'None'})"
            )
    assert results[0]["calls"] == results[1]["calls"], (
        f"{where}: the ranks launched their buckets in different orders ({results[0]['calls']} and "
        f"{results[1]['calls']}): collectives must meet in the same order on every rank"
    )


def _idle_finish(rank, world_size, name):
    kata = load_kata(KATA)
    model = make_model(name, 100 + rank)
    ddp = kata.BucketedDDP(model)
    with recording() as calls:
        ddp.finish_gradient_synchronization()  # no backward yet: nothing to wait for
    grads = [p.grad for p in model.parameters()]
    return [c.name for c in calls], all(g is None for g in grads)


@pytest.mark.step(5)
def test_finish_with_nothing_launched_is_harmless(kata):
    for rank, (calls, untouched) in enumerate(run_world(_idle_finish, 2, "tied")):
        assert not calls, (
            f"rank {rank}: finish_gradient_synchronization() before any backward made {calls}: "
            "with no gradient arrived this step there is nothing to launch or wait for, so it does nothing"
        )
        assert untouched, (
            f"rank {rank}: finish_gradient_synchronization() before backward set .grad"
        )


# --------------------------------------------------------------------------- step 6: no_sync


@pytest.mark.step(6)
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_no_sync_accumulates_and_syncs_once(kata, micro_batches):
    caps = (SPLIT,)
    results = run_world(_train, 2, "tied", caps, 2, micro_batches)
    for rank, result in enumerate(results):
        for step, record in enumerate(result[SPLIT]["steps"]):
            assert not any(record["inside"]), (
                f"rank {rank}, step {step + 1}: backward inside no_sync() made "
                f"{record['inside']} collective(s): inside no_sync the hooks launch nothing "
                "(gradients accumulate in .grad); the first backward after it syncs"
            )
    check_training("tied", caps, results, 2, 2, micro_batches)


def _nesting(rank, world_size):
    kata = load_kata(KATA)
    model = make_model("frozen", 100 + rank)
    ddp = kata.BucketedDDP(model, bucket_cap_mb=None)
    batch = make_batch("frozen", PER_RANK, rank)
    counts = {}
    with recording() as calls:
        with ddp.no_sync():
            with ddp.no_sync():
                pass
            loss(ddp, batch).backward()  # still inside the outer no_sync
        counts["nested"] = len(calls)
        ddp.finish_gradient_synchronization()
        counts["finish after no_sync"] = len(calls) - counts["nested"]
    try:
        with ddp.no_sync():
            raise KeyError("interrupted")
    except KeyError:
        pass
    with recording() as calls:
        loss(ddp, batch).backward()
        ddp.finish_gradient_synchronization()
    counts["after an error"] = len([c for c in calls if c.name == "all_reduce"])
    return counts


@pytest.mark.step(6)
def test_no_sync_restores_what_was_there(kata):
    for rank, counts in enumerate(run_world(_nesting, 2)):
        assert counts["nested"] == 0, (
            f"rank {rank}: after a nested `with ddp.no_sync():` ended inside another, backward "
            f"made {counts['nested']} collective(s): no_sync must restore the value it found "
            "(still off inside the outer one), not switch syncing back on"
        )
        assert counts["finish after no_sync"] == 0, (
            f"rank {rank}: finish_gradient_synchronization() after a backward inside no_sync made "
            f"{counts['finish after no_sync']} collective(s): nothing was launched, so it does nothing"
        )
        assert counts["after an error"] == 1, (
            f"rank {rank}: after an exception inside `with ddp.no_sync():`, a step made "
            f"{counts['after an error']} all-reduce(s), expected 1 (one bucket): restore syncing "
            "in a finally (try: yield finally: ...), so it comes back even when the block raises"
        )


@pytest.mark.step(6)
def test_program_shows_buckets_and_overlap(kata):
    out = run_module_ok(KATA, "--world-size", "2", "--steps", "2").stdout
    assert "[rank 0] 3 bucket(s), cap 0.3 MiB" in out, out
    lines = out.splitlines()
    launch = [i for i, line in enumerate(lines) if "all-reduce launched bucket 0 (async)" in line]
    returned = [i for i, line in enumerate(lines) if "backward returned" in line]
    assert launch and returned and launch[0] < returned[0], (
        f"the program should show bucket 0's all-reduce launched before backward returned:\n{out}"
    )
    assert "[rank 0] step 2: 3 all-reduce(s), 3 bucket(s)" in out, out
    assert "every rank holds the same parameters" in out, out


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    import torch.distributed as dist

    device = rank_gpu()
    kata = load_kata(KATA)
    model = make_model("tied", 100 + rank).to(device)
    ddp = kata.BucketedDDP(model, bucket_cap_mb=SPLIT)
    reference = make_model("tied", 0).to(device)
    reference.load_state_dict(model.state_dict())
    batch = tuple(t.to(device) for t in make_batch("tied", PER_RANK, rank))
    devices = []
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):  # where the wrapper's all-reduces run
        devices.append(tensor.device)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        loss(ddp, batch).backward()
        ddp.finish_gradient_synchronization()
    finally:
        dist.all_reduce = original
    loss(reference, batch).backward()
    for param in reference.parameters():
        dist.all_reduce(param.grad)
        param.grad /= world_size
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    expected = {n: p.grad.cpu() for n, p in reference.named_parameters()}
    reduced = sorted({str(device) for device in devices})
    return reduced, grads, expected


def check_on_cuda(results) -> None:
    for rank, (devices, grads, expected) in enumerate(results):
        assert devices and all(d.startswith("cuda") for d in devices), (
            f"rank {rank} all-reduced tensors on {devices}: make the flat buffers on the "
            "parameters' device"
        )
        for name, value in expected.items():
            assert torch.allclose(grads[name], value, **TOLERANCE), (
                f"rank {rank}'s {name}.grad is not the mean over the ranks on CUDA"
            )


@pytest.mark.step(5)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    check_on_cuda(run_world(_on_cuda, 1, **on_cuda(1, "nccl")))


@pytest.mark.step(5)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    check_on_cuda(run_world(_on_cuda, 2, **on_cuda(2, "gloo")))
