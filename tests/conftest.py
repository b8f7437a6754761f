import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny models: extra threads only contend

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import envs  # noqa: E402,F401  (platform set-up before any simulator import)
