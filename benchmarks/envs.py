"""Environment throughput through envs.make vs the raw backend, expert success, collection speed.

    .venv/bin/python benchmarks/envs.py                 # full (>= 50 expert episodes per task)
    .venv/bin/python benchmarks/envs.py --quick         # smoke run

Writes benchmarks/results/envs.json and envs.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, machine, md_table, write  # noqa: E402

import numpy as np  # noqa: E402

import envs  # noqa: E402
from train.collect import CollectArgs, collect  # noqa: E402

CAMERA = {"maniskill": "base_camera", "adroit": "vil_camera", "robosuite": "agentview"}
THROUGHPUT = ["maniskill/PushCube-v1", "maniskill/PickCube-v1", "maniskill/TabletopSuite-v1",
              "maniskill/CollisionAvoidance-v1", "adroit/door", "adroit/hammer", "adroit/pen", "adroit/relocate",
              "robosuite/Lift", "robosuite/Door", "robosuite/KitchenSuite"]
EXPERTS = ["maniskill/PushCube-v1", "maniskill/PullCube-v1", "maniskill/PickCube-v1", "maniskill/StackCube-v1",
           "maniskill/LiftPegUpright-v1", "maniskill/PlugCharger-v1", "maniskill/PegInsertionSide-v1",
           "maniskill/TabletopSuite-v1", "maniskill/CollisionAvoidance-v1", "adroit/door", "adroit/hammer",
           "adroit/pen", "adroit/relocate", "robosuite/KitchenSuite"]


def steps_per_s(env, n: int, raw: bool, seed: int = 0) -> float:
    """Steps/s over ``n`` random actions from one reset (no resets inside the timed loop, so both
    sides do exactly the same simulation work)."""
    rng = np.random.default_rng(seed)
    lo, hi = env.action_space.low, env.action_space.high
    acts = (rng.uniform(lo, hi, (n, lo.shape[0])) * 0.3).astype(np.float32)
    env.reset(seed=seed)
    step = env.raw_step if raw else env.step
    t = time.perf_counter()
    for a in acts:
        step(a)
    return n / (time.perf_counter() - t)


def paired(env, n: int, repeats: int = 3) -> tuple[float, float]:
    """Best of interleaved wrapped/raw runs: load from other processes hits both sides alike."""
    w, r = [], []
    for i in range(repeats):
        w.append(steps_per_s(env, n, raw=False, seed=i))
        r.append(steps_per_s(env, n, raw=True, seed=i))
    return max(w), max(r)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--expert-episodes", type=int, default=50)
    ap.add_argument("--throughput-only", action="store_true", help="keep the expert results of the last run")
    a = ap.parse_args()
    n_steps = 100 if a.quick else 300
    res: dict = {"machine": machine(), "envs": {}, "experts": {}, "collection": {}}
    rows = []
    for env_id in THROUGHPUT:
        backend = envs.spec(env_id).backend
        for camera in (False, True):
            opts = {"cameras": (CAMERA[backend],), "image_size": 128} if camera else {}
            env = envs.make(env_id, **opts)
            n = n_steps // (4 if camera else 1)
            steps_per_s(env, 10, raw=False)  # warm-up (shader compilation on first render)
            wrapped, raw = paired(env, n)
            env.close()
            key = env_id + (" +camera128" if camera else "")
            res["envs"][key] = {"steps_per_s": wrapped, "raw_steps_per_s": raw, "overhead_ratio": raw / wrapped,
                                "camera": camera}
            rows.append([key, wrapped, raw, raw / wrapped])
            print(rows[-1], flush=True)
    erows = []
    n_ep = 10 if a.quick else a.expert_episodes
    if a.throughput_only:
        import json
        from common import RESULTS
        old = json.loads((RESULTS / "envs.json").read_text())
        res["experts"], res["collection"] = old["experts"], old["collection"]
        for env_id, e in res["experts"].items():
            c = res["collection"][env_id]
            erows.append([env_id, e["success_rate"], e["episodes"], c["steps_per_s"], c["episodes_per_min"]])
    for env_id in ([] if a.throughput_only else EXPERTS):
        t = time.time()
        out = DATA / "envs_bench" / f"{env_id.replace('/', '_')}.h5"
        s = collect(CollectArgs(env=env_id, episodes=n_ep, out=out, seed=0, keep_failures=True, progress=False,
                                overwrite=True, max_attempts=n_ep))
        res["experts"][env_id] = {"success_rate": s["expert_success_rate"], "episodes": s["attempts"]}
        res["collection"][env_id] = {"steps_per_s": s["steps_per_s"], "episodes_per_min": 60 * s["episodes"] / s["seconds"]}
        erows.append([env_id, s["expert_success_rate"], s["attempts"], s["steps_per_s"],
                      60 * s["episodes"] / s["seconds"]])
        print(erows[-1], f"{time.time() - t:.0f}s", flush=True)
    table = ("## Step throughput: envs.make vs raw backend (random actions, 1 process)\n\n"
             + md_table(["env", "steps/s (envs.make)", "steps/s (raw)", "overhead ratio raw/wrapped"], rows)
             + "\n## Experts and collection (`groundflow collect`, HDF5 with sim state)\n\n"
             + md_table(["task", "expert success", "episodes", "collect steps/s", "episodes/min"], erows)
             + f"\nMachine: {res['machine']}\n")
    write("envs", res, table)


if __name__ == "__main__":
    main()
