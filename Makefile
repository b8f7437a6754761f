# Two commands do all set-up from a clean clone: `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline
export PYTHONUNBUFFERED := 1
# Small models on a 2-core machine shared with simulators: more intra-op threads only spin.
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-slow bench clean

setup:
	bash scripts/setup_vulkan.sh
	bash scripts/setup_venv.sh

demo: setup
	$(PY) -m groundflow.demo $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(ARGS)

bench: setup
	$(PY) benchmarks/envs.py

clean:
	rm -rf .venv .vulkan .assets runs
