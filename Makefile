# Two commands for everyone:
#   make learn   set up (first time only) and start learning at the first unfinished kata
#   make test    set up (first time only) and run the full maintainer check (what CI runs)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: learn test watch flake-hunt clean-venv

learn: $(STAMP)
	@$(BIN)/python -m dojo

test: $(STAMP)
	$(BIN)/python -m dojo dev check

# The environment is rebuilt only when pyproject.toml changes.
$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10) and "Python 3.10 or newer is needed, found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
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
