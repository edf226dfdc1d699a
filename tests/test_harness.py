import os, time
import pytest
import torch
import torch.distributed as dist
from dojo.world import run_world, RankFailed, RankCrashed, WorldDeadlock

def _sum(rank, world_size):
    t = torch.tensor([rank])
    dist.all_reduce(t)
    return int(t.item()), dist.get_rank(), dist.get_world_size(), os.getpid()

def test_passing():
    t = time.time()
    r = run_world(_sum, 4)
    print(time.time()-t)
    t = time.time()
    r = run_world(_sum, 4)
    print("warm", time.time()-t)
    assert [x[:3] for x in r] == [(6, i, 4) for i in range(4)]

def _raise(rank, world_size):
    if rank == 1:
        raise ValueError("boom")
    time.sleep(30)

def test_raise():
    t=time.time()
    with pytest.raises(RankFailed) as e:
        run_world(_raise, 3)
    print(e.value, time.time()-t)

def _deadlock(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    return rank

def test_deadlock():
    t=time.time()
    with pytest.raises(WorldDeadlock) as e:
        run_world(_deadlock, 3)
    print(e.value, time.time()-t)

def _crash(rank, world_size):
    if rank == 2:
        print("about to die")
        os.abort()
    time.sleep(30)

def test_crash():
    with pytest.raises(RankCrashed) as e:
        run_world(_crash, 3)
    print(e.value)
