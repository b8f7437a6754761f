# Two commands do all set-up from a clean clone: `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline
export PYTHONUNBUFFERED := 1
# Small models on a 2-core machine shared with simulators: more intra-op threads only spin.
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-slow bench lerobot-check clean

setup:
	bash scripts/setup_vulkan.sh
	bash scripts/setup_venv.sh

demo: setup
	$(PY) -m groundflow.demo $(ARGS)

# Two pytest workers, one test file each at a time (a file's module fixtures are built once): on the 2-core CI
# machine most tests run one torch thread or wait on a simulator, so a second worker fills the idle core.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(ARGS)

bench: setup
	$(PY) benchmarks/envs.py

# LeRobotDataset interop checked against the lerobot package itself. lerobot 0.4.4 pins torch<2.11,
# so it gets its own venv (first build: pip downloads lerobot and a CUDA torch, several GB, ~4 min here).
# Rewrites the fixture tests/data/lerobot_v30 with lerobot's writer, then checks both directions
# (scripts/lerobot_check.py). lerobot decodes with torchcodec where the system's FFmpeg libraries are
# installed (Debian: apt-get install libavcodec59 libavformat59 libavdevice59 libavfilter8), else PyAV.
LEROBOT_VENV := .venv-lerobot
$(LEROBOT_VENV)/.installed:
	[ -x $(LEROBOT_VENV)/bin/python ] || python3 -m venv $(LEROBOT_VENV)
	$(LEROBOT_VENV)/bin/python -m pip install -q --disable-pip-version-check lerobot==0.4.4
	touch $@

lerobot-check: setup $(LEROBOT_VENV)/.installed
	$(LEROBOT_VENV)/bin/python scripts/lerobot_check.py

clean:
	rm -rf .venv .venv-lerobot .vulkan .assets runs
