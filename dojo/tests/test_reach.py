"""dojo.dev.reach: what each spec test reaches of the reference, in the test process and its ranks."""

import os
import subprocess
import sys
import types

from dojo.curriculum import ROOT
from dojo.dev import reach


def test_a_spec_run_notes_what_each_test_reaches_in_its_ranks_too(tmp_path):
    # k04's step 3 averages gradients in the ranks only; its step 1 test never gets there
    tests = [
        "tests/test_k04_allreduce.py::test_tutorial_allreduce_gives_every_rank_the_sum[4]",
        "tests/test_k04_allreduce.py::test_average_gradients_gives_every_rank_the_mean",
    ]
    env = {**os.environ, **reach.environment_for(str(tmp_path)), "DOJO_IMPL": "solutions"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "dojo.dev.reach",
            "-q",
            "-p",
            "no:cacheprovider",
            *tests,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = reach.read(tmp_path)
    first, averaging = (found.get(t) for t in tests)
    assert first is not None and averaging is not None, f"tests not recorded: {sorted(found)}"
    assert "k04_allreduce:tutorial_allreduce" in first
    assert "k04_allreduce:average_gradients" not in first
    assert "k04_allreduce:average_gradients" in averaging  # called in the ranks alone
    assert "k04_allreduce:tutorial_allreduce" not in averaging


def _module() -> types.ModuleType:
    module = types.ModuleType("fake_kata")
    source = """
import dataclasses

def helper():
    return 1

def uses_helper():
    return helper()

def alone():
    return 2

class Built:
    def __init__(self):
        self.value = uses_helper()

class Inherited(list):
    pass

@dataclasses.dataclass
class Record:
    x: int = 0

LIMIT = 3
"""
    module.__file__ = "/fake/kata.py"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def test_reached_adds_every_name_the_code_that_ran_refers_to():
    module = _module()
    # a callback run on a thread the trace does not see is still counted through its caller
    assert reach.reached(module, {"Built"}) == {"Built", "uses_helper", "helper"}
    assert reach.reached(module, {"alone"}) == {"alone"}


def test_only_what_cannot_run_unseen_is_observable():
    module = _module()
    assert reach.observable(module, "helper")
    assert reach.observable(module, "Built")  # its own __init__ runs when it is built
    assert not reach.observable(module, "Inherited")  # built by list's code
    assert not reach.observable(module, "Record")  # a dataclass's __init__ is generated
    assert not reach.observable(module, "LIMIT")
