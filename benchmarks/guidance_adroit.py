"""Guidance under tighter joint limits on the four Adroit tasks (train/constrained_eval.py).

Per task: a tiny flow policy trained on 50 DAPG expert demos (cached under
runs/bench_guidance_adroit/), then none / clip / coupled / velocity_gradient / state_gradient /
pnp_renoise over a scale sweep of two decades, each on the same episodes (seeds) and the same
sampler noise. Per method the reported scale is the one with the lowest violation rate, ties
broken by success. Writes the "adroit" and "adroit_sweep" sections of
benchmarks/results/guidance.json (other sections kept) and benchmarks/results/guidance_adroit.md.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/guidance_adroit.py   # ~15-20 min, 1 core
    .venv/bin/python benchmarks/guidance_adroit.py --tasks door --episodes 5 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, RESULTS, ROOT, demos, machine, md_table  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import envs  # noqa: E402
import policies  # noqa: E402
from train.bc import TrainArgs, train  # noqa: E402
from train.constrained_eval import CONSTRAINTS, TOL, evaluate_constrained  # noqa: E402

TASKS = {  # task -> (demos, train steps); door's budget reached 0.98 success in policies.md
    "door": (50, 3000), "hammer": (50, 3000), "pen": (50, 3000), "relocate": (50, 3000),
}
RUNS = ROOT / "runs" / "bench_guidance_adroit"
SCALES = (0.1, 1.0, 10.0)
METHODS = ("none", "clip", "coupled", "velocity_gradient", "state_gradient", "pnp_renoise")
SEED = 3000


def policy_for(task: str, log=print) -> tuple[Any, dict]:
    """Train (or reuse) the tiny flow policy of ``task``."""
    n_demos, steps = TASKS[task]
    data = demos(f"adroit/{task}", n_demos)
    out = RUNS / task
    info_path = out / "bench_train.json"
    if (out / "ckpt").exists() and info_path.exists():
        return policies.load(out / "ckpt"), json.loads(info_path.read_text())
    t = time.time()
    s = train(TrainArgs(data=(data,), policy="flow", steps=steps, batch_size=64, horizon=16, n_exec=8, out=out,
                        wandb="disabled", progress=False, seed=0))
    info = {"demos": n_demos, "train_steps": steps, "train_seconds": time.time() - t,
            "train_samples_per_s": s.get("samples_per_s"), "data": str(data.relative_to(ROOT))}
    info_path.write_text(json.dumps(info))
    log(f"trained {task}: {info}")
    return policies.load(out / "ckpt"), info
