"""Imported once by the harness's forkserver, so every rank forked from it starts warm.

Importing torch costs ~1.5 s per process, and the first ``torch.testing.assert_close`` imports
sympy (~1 s more); paying both here makes a new 4-rank world cost a fraction of a second.
"""

import gc
import signal

# The harness asks a rank for its stacks with SIGUSR1 (dojo.harness.rank registers faulthandler for it
# as the rank starts). One that arrives before that must not kill the rank: ranks fork from this
# process and inherit this.
if hasattr(signal, "SIGUSR1"):
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

import pytest  # noqa: F401  (test modules, which ranks import, all need it)
import torch
import torch.distributed
import torch.multiprocessing

# What every rank imports besides: the harness's rank side and the kata API (each rank would
# compile them from source where Python writes no bytecode caches, PYTHONDONTWRITEBYTECODE).

torch.testing.assert_close(torch.zeros(2), torch.zeros(2))
# A process's first optimizer imports ~900 modules (torch._dynamo among them): ~0.7 s per rank.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()

# Objects created by the imports above live as long as the process: freezing them keeps every
# rank's gc.collect() (part of its teardown) fast, and copy-on-write pages untouched.
gc.freeze()
