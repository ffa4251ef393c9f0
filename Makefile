# Two set-up commands for a fresh machine with only python3:
#   make demo   -- create .venv, install tokenbal, run `tokenbal demo`
#   make test   -- create .venv, install tokenbal[test], run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first, pinned to the CPU build, so nothing pulls a multi-GB CUDA wheel.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-slow test-compat test-frameworks envs lint venv clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PY) -m pip install -q -e ".[hf,plot]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.torch pyproject.toml
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/tokenbal demo

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check tokenbal collate tests scripts
	$(PY) -m pytest -q -m "not slow and not compat and not frameworks"

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -q -m "slow and not compat and not frameworks"

# The transformers version matrix and the framework checks build side environments from
# tests/envs/*.txt with pip (minutes each the first time, cached under $$TOKENBAL_ENV_ROOT,
# default ~/.cache/tokenbal/envs) and are not part of `make test`.
test-compat: $(VENV)/.installed-test
	$(PY) -m pytest -q -m compat

test-frameworks: $(VENV)/.installed-test
	$(PY) -m pytest -q -m frameworks

envs:
	$(PYTHON) scripts/envs.py list

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check tokenbal collate tests scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
