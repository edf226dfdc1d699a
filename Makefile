# Two commands:
#   make learn   set up (first time only) and start learning at the first unfinished kata
#   make test    maintainers and CI: set up (first time only) and run the full check (about 16 min on a slow 2-core machine)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    ?= $(BIN)/python -m pip
# Which PyTorch build the set-up installs (`make learn TORCH=cpu`, or TORCH=cpu in the
# environment): auto, PyTorch's CPU-only build (its own wheel index) on Linux without an NVIDIA
# GPU, else the default index's (CUDA on Linux), and the default one when the CPU-only index
# cannot be reached; cpu, that build or nothing (it stops, saying why and what to do); or default.
# The CPU build saves ~4.5 GB.
TORCH           ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# Seconds to wait for that index's answer (pip would wait 180, then retry).
TORCH_PROBE_S   ?= 5
# The versions the suite was run on (its head says where): every install takes exactly these.
CONSTRAINTS     := constraints.txt
ifeq ($(filter $(TORCH),auto cpu default),)
$(error TORCH=$(TORCH): say TORCH=cpu (the CPU-only build), TORCH=default (the default index's, CUDA on Linux) or TORCH=auto)
endif
GOAL := $(or $(firstword $(MAKECMDGOALS)),learn)

.PHONY: learn test watch flake-hunt clean-venv

learn: $(STAMP)
	@$(BIN)/python -m dojo

test: $(STAMP)
	$(BIN)/python -m dojo dev check

# The environment is rebuilt only when pyproject.toml or the constraints change. Whether the
# CPU-only index answers is asked first (dojo/runner/torch_index.py, with this system's Python):
# TORCH=cpu stops there, before anything is installed, when it does not. torch comes first, from
# the index the build picks; the project's own install then finds it there and keeps it.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10) and "Python 3.10 or newer is needed, found " + sys.version.split()[0])'
	@case "$(TORCH)" in \
	  auto) if [ "$$(uname -s)" = Linux ] && ! [ -e /proc/driver/nvidia/version ] && \
	           ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1 && \
	           ! [ -e /usr/lib/wsl/lib/nvidia-smi ]; then build=cpu; else build=default; fi;; \
	  *) build="$(TORCH)";; \
	esac; \
	if [ "$$build" = cpu ] && ! why=$$($(PYTHON) -m dojo.runner.torch_index '$(TORCH_CPU_INDEX)' '$(TORCH_PROBE_S)' 2>&1); then \
	  if [ "$(TORCH)" = cpu ]; then \
	    echo "error: TORCH=cpu, but PyTorch's CPU-only index ($(TORCH_CPU_INDEX)) cannot be reached: $$why." >&2; \
	    echo "Nothing was installed. Either:" >&2; \
	    echo "  make $(GOAL) TORCH=default    the default index's build (on Linux with CUDA libraries: 5.8 GB in all; it runs on the CPU all the same)" >&2; \
	    echo "  make $(GOAL) TORCH=cpu TORCH_CPU_INDEX=URL    a mirror of that index that this machine reaches" >&2; \
	    echo "or run the same command again once $(TORCH_CPU_INDEX) can be reached (behind a proxy: set HTTPS_PROXY)." >&2; \
	    exit 1; \
	  fi; \
	  echo "note: PyTorch's CPU-only index ($(TORCH_CPU_INDEX)) cannot be reached: $$why. Installing the default build instead (on Linux with CUDA libraries: 5.8 GB in all; \`make clean-venv && make learn TORCH=cpu\` once that index answers)"; \
	  build=default; \
	fi; \
	$(PYTHON) -m venv $(VENV) && $(PIP) install --quiet --upgrade pip || exit 1; \
	if [ "$$build" = cpu ]; then \
	  echo "Installing PyTorch's CPU-only build from $(TORCH_CPU_INDEX) (about 1.3 GB in all; TORCH=default for the CUDA one)"; \
	  if ! $(PIP) install --quiet --index-url '$(TORCH_CPU_INDEX)' --constraint $(CONSTRAINTS) torch torchvision; then \
	    if [ "$(TORCH)" = cpu ]; then echo "error: TORCH=cpu, but installing PyTorch's CPU-only build failed (above); make $(GOAL) TORCH=default installs the default one" >&2; exit 1; fi; \
	    echo "note: installing PyTorch's CPU-only build failed; installing the default build instead"; \
	  fi; \
	fi
	$(PIP) install --quiet --constraint $(CONSTRAINTS) -e '.[dev]'
	@touch $(STAMP)

clean-venv:
	rm -rf $(VENV)

watch: $(STAMP)
	@$(BIN)/python -m dojo watch

# Maintainers: the harness's tests and katas 01-03, ten times in a row under -n 2.
flake-hunt: $(STAMP)
	@for i in 1 2 3 4 5 6 7 8 9 10; do \
	  echo "=== round $$i of 10"; \
	  $(BIN)/python -m pytest --solutions -n 2 -q dojo/tests/test_harness.py tests/test_k01_spawn.py \
	    tests/test_k02_init_group.py tests/test_k03_world_size.py || exit 1; \
	done
