"""dojo.harness.calls records what each rank asked of torch.distributed, and nothing of torch's own plumbing."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dojo.harness.calls import recording
from dojo.harness.world import run_world


def _exchange(rank, world_size):
    before = dist.all_reduce
    with recording() as calls:
        tensor = torch.ones(3)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        dist.broadcast(tensor, src=1)
        if rank == 0:
            dist.send(tensor, dst=1)  # torch sends through its own isend: not the rank's call
        else:
            dist.recv(tensor, src=0)
        dist.barrier()
    restored = dist.all_reduce is before  # the wrappers go with the block
    return [str(c) for c in calls], [c.shapes for c in calls], all(c.end for c in calls), restored


def test_every_call_of_the_rank_is_recorded_once_with_its_peers():
    results = run_world(_exchange, 2)
    assert results[0][0] == ["all_reduce(op=MAX)", "broadcast(src=1)", "send(dst=1)", "barrier()"]
    assert results[1][0] == ["all_reduce(op=MAX)", "broadcast(src=1)", "recv(src=0)", "barrier()"]
    assert results[0][1] == [[(3,)], [(3,)], [(3,)], []]
    assert all(r[2] for r in results), "every call returned, so every call has an end"
    assert all(r[3] for r in results), "after the block, torch.distributed is as it was"
