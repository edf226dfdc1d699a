"""The set-up's PyTorch build: whether the CPU-only index answers, and why not
(``dojo/runner/torch_index.py``), and what ``make learn`` does about it (the Makefile)."""

from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dojo.curriculum import ROOT
from dojo.runner import doctor
from dojo.runner.torch_index import unreachable
from dojo.spec.testing import needs_torch, torch_older_than


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_index_whose_name_does_not_resolve_says_so():
    why = unreachable("http://download.pytorch.invalid/whl/cpu", 2)
    assert why and why.startswith("its host name did not resolve in "), why


def test_an_index_that_refuses_says_so():
    why = unreachable(f"http://127.0.0.1:{_closed_port()}/whl/cpu", 2)
    assert why and "refused" in why, why


def test_an_index_that_never_answers_says_how_long_it_was_given():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, and never says a word
        start = time.monotonic()
        why = unreachable(f"http://127.0.0.1:{silent.getsockname()[1]}/whl/cpu", 0.5)
    assert why == "it did not answer within 0.5 s", why
    assert time.monotonic() - start < 5, "the probe must not wait past its time"


class _Index(http.server.BaseHTTPRequestHandler):
    """An index with a page for torch, and nothing else."""

    def do_GET(self):
        self.send_response(200 if self.path == "/whl/cpu/torch/" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _answering_index():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/whl/cpu"
    finally:
        server.shutdown()
        server.server_close()


def test_an_index_that_answers_is_reachable():
    with _answering_index() as index:
        assert unreachable(index, 5) is None


def _setup(tmp_path: Path, torch: str, index: str) -> subprocess.CompletedProcess:
    """``make .venv/.installed TORCH=...`` in a copy of what the set-up reads, with pip replaced
    by ``true``: what it decides and says, not the install."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "dojo/runner/torch_index.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH", "MAKE"))}
    return subprocess.run(
        ["make", ".venv/.installed", f"TORCH={torch}", f"TORCH_CPU_INDEX={index}",
         f"PYTHON={sys.executable}", "PIP=true"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_torch_cpu_stops_when_its_index_cannot_be_reached(tmp_path):
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    start = time.monotonic()
    done = _setup(tmp_path, "cpu", index)
    out = done.stdout + done.stderr
    assert done.returncode != 0, f"TORCH=cpu went on without its index:\n{out}"
    assert (
        f"TORCH=cpu, but PyTorch's CPU-only index ({index}) cannot be reached: the connection was refused"
        in out
    ), out
    for advice in ("TORCH=default", "TORCH_CPU_INDEX=URL"):
        assert advice in out, f"the error should say what to do ({advice}):\n{out}"
    assert not (tmp_path / ".venv").exists(), "nothing is installed before it stops"
    assert time.monotonic() - start < 30, "it says so within seconds"


@pytest.mark.slow  # it makes a venv: ~5-20 s
def test_torch_auto_falls_back_and_says_why(tmp_path):
    if Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi"):
        pytest.skip("an NVIDIA GPU is seen here: TORCH=auto takes the default build at once")
    if not sys.platform.startswith("linux"):
        pytest.skip("TORCH=auto asks for the CPU-only build on Linux only")
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    done = _setup(tmp_path, "auto", index)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"TORCH=auto must fall back, not stop:\n{out}"
    assert (
        f"note: PyTorch's CPU-only index ({index}) cannot be reached: the connection was refused"
        in out
    ), out
    assert "Installing the default build instead" in out, out
    assert (tmp_path / ".venv" / ".installed").exists(), out


def test_torch_versions_compare_by_release():
    assert torch_older_than("2.12", "2.11.0+cu128")
    assert not torch_older_than("2.12", "2.12.0")
    assert not torch_older_than("2.12", "2.14.1+cpu")
    assert not torch_older_than("2.10", "2.10.0a0+git1234")


@needs_torch("gloo all_to_all")
def test_needs_torch_lets_a_test_run_on_a_torch_that_has_it():
    assert not torch_older_than("2.12")


def test_needs_torch_skips_on_an_older_torch_saying_which_it_needs(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")
    mark = needs_torch("gloo all_to_all")
    assert mark.args == (True,)
    assert mark.kwargs["reason"].startswith("k08 needs torch 2.12 or newer for all_to_all_rows"), (
        mark.kwargs["reason"]
    )
    assert "this is torch 2.11.0+cu128" in mark.kwargs["reason"]


def test_doctor_advises_the_cpu_build_only_where_its_index_answers(monkeypatch):
    with _answering_index() as index:
        monkeypatch.setenv("TORCH_CPU_INDEX", index)
        advice = doctor._cpu_build_advice()
    assert "`make clean-venv && make learn TORCH=cpu` installs the CPU-only build" in advice.text
    closed = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    monkeypatch.setenv("TORCH_CPU_INDEX", closed)
    advice = doctor._cpu_build_advice()
    assert f"({closed}) cannot be reached from here: the connection was refused" in advice.text
    assert "would stop" in advice.text and "keep it" in advice.text, advice.text


def test_doctor_holds_this_torch_to_the_ones_the_suite_was_run_on():
    floor, pinned = doctor._declared_torch()
    assert floor and pinned, "pyproject.toml's torch floor and constraints.txt's pin are read"
    assert doctor._torch_release(pinned).status == "ok"
    older = doctor._torch_release("2.9.1+cu128")
    assert older.status == "FAIL" and f"older than {floor}" in older.text, older.text
    gloo = doctor._torch_release("2.11.0+cu128")
    assert gloo.status == "note" and "k08's tests of all_to_all_rows" in gloo.text, gloo.text
    assert "need torch 2.12" in gloo.text, gloo.text
