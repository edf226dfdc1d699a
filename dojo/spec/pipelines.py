"""What the pipeline katas' specs (k21's, k27's) share: the micro-batches they feed a pipeline,
a rank's place in the pipeline's group, and a schedule that can never move, refused.

micro_batches(m, per, seed)                  ``m`` micro-batches of ``per`` token sequences
stage_of(rank, world_size, group_ranks)      in a rank: (group, stages, its stage), None outside
check_refuses_for_ever(simulate, stuck, why) simulate raises ValueError on a schedule stuck for ever
"""

from __future__ import annotations

from dojo.spec.testing import DidNotReturn, returns_within


def micro_batches(m: int, per: int, seed: int = 1) -> list:
    """``m`` micro-batches of ``per`` sequences each: ``[(tokens, targets), ...]``."""
    from dojo.toy_models import make_tokens

    tokens, targets = make_tokens(per * m, seed)
    return list(zip(tokens.chunk(m), targets.chunk(m)))


def stage_of(rank: int, world_size: int, group_ranks=None):
    """In a rank: ``(group, stages, stage)``, the pipeline's process group (None: the world),
    its length and this rank's place in it; None for a rank outside ``group_ranks``. Every rank
    makes the group (``dist.new_group`` is a collective of the whole world)."""
    import torch.distributed as dist

    group = dist.new_group(group_ranks) if group_ranks else None
    if group_ranks and rank not in group_ranks:
        return None
    if not group_ranks:
        return group, world_size, rank
    return group, len(group_ranks), group_ranks.index(rank)


def check_refuses_for_ever(simulate, stuck, why: str) -> None:
    """``simulate(stuck)`` raises ValueError: no action of ``stuck`` can ever start (``why``,
    in words). One that goes round for ever is stopped, and told so."""
    from dojo.todo import KataTodo

    try:
        got = returns_within(f"simulate({stuck})", simulate, stuck)
    except DidNotReturn as error:
        raise AssertionError(
            f"{error}: {why}. When a pass over the ranks starts no action, none ever will: raise "
            "ValueError then"
        ) from None
    except ValueError:
        return
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(
            f"simulate({stuck}) raised {type(error).__name__}: {error}; a schedule whose ranks "
            "wait for each other for ever is a ValueError saying so"
        ) from None
    raise AssertionError(
        f"simulate({stuck}) returned {got!r}: {why}. Raise ValueError when no rank can move"
    )
