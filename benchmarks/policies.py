"""Flow vs autoregressive VLA on the same demos and budget: success, throughput, latency.

    .venv/bin/python benchmarks/policies.py            # full (about 30-40 min on 2 cores)
    .venv/bin/python benchmarks/policies.py --quick    # smaller, for a smoke run

Writes benchmarks/results/policies.json and policies.md.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, demos, machine, md_table, write  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import policies  # noqa: E402
from train.bc import TrainArgs, train  # noqa: E402
from train.evaluate import evaluate, wilson  # noqa: E402

TASKS = {  # env id -> (demos, train steps, horizon, n_exec)
    "maniskill/PushCube-v1": (150, 3000, 16, 8),
    "adroit/door": (50, 3000, 16, 8),
    "maniskill/TabletopSuite-v1": (120, 2000, 16, 8),
    "robosuite/KitchenSuite": (60, 2000, 16, 8),
}

# AR decodes H * action_dim tokens per chunk: on the 28-dim door H=16 is 448 tokens, and training
# ran 500 steps in 33 min on the shared cores (flow: 3000 in ~1 min). The AR door row uses H=4.
AR_CHUNK = {"adroit/door": (4, 4)}


def latency(kind: str, size: str, state_dim: int = 35, action_dim: int = 8, n: int = 50) -> dict[str, float]:
    cfg = policies.PolicyConfig(kind=kind, size=size, state_dim=state_dim, action_dim=action_dim, horizon=16, n_exec=8)
    p = policies.make_policy(cfg).eval()
    obs = {"state": np.zeros(state_dim, np.float32), "instruction": "push the cube to the goal region"}
    p.predict_action_chunk(obs)
    ts = []
    for _ in range(n if kind == "flow" else max(5, n // 5)):
        t = time.perf_counter()
        p.predict_action_chunk(obs)
        ts.append((time.perf_counter() - t) * 1000)
    return {"p50": float(np.percentile(ts, 50)), "p99": float(np.percentile(ts, 99)),
            "params_m": sum(x.numel() for x in p.parameters()) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--tasks", nargs="*", default=list(TASKS))
    ap.add_argument("--latency-only", action="store_true", help="keep the task results of the last run")
    ap.add_argument("--merge", action="store_true", help="add --tasks to the task results of the last run")
    ap.add_argument("--kinds", nargs="*", default=["flow", "ar"], help="policy families to train and evaluate")
    a = ap.parse_args()
    results: dict = {"machine": machine(), "tasks": {}, "latency_ms": {}, "train_samples_per_s": {}}
    rows = []
    if a.latency_only or a.merge:
        import json
        from common import RESULTS
        old = json.loads((RESULTS / "policies.json").read_text())
        results["tasks"], results["train_samples_per_s"] = old["tasks"], old["train_samples_per_s"]
        for env_id, kinds in results["tasks"].items():
            for kind, r in kinds.items():
                if env_id in a.tasks and kind in a.kinds and not a.latency_only:
                    continue  # re-run below
                rows.append([env_id, kind, f"{r['success_rate']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]",
                             r["episodes"], r["demos"], r["train_steps"], f"{r.get('horizon', 16)}/{r.get('n_exec', 8)}",
                             round(r["train_samples_per_s"])])
    for env_id in ([] if a.latency_only else a.tasks):
        n_demos, steps, h, ne = TASKS[env_id]
        if a.quick:
            n_demos, steps = max(10, n_demos // 5), 300
        data = demos(env_id, n_demos)
        results["tasks"].setdefault(env_id, {})
        for kind in a.kinds:
            h, ne = AR_CHUNK.get(env_id, TASKS[env_id][2:]) if kind == "ar" else TASKS[env_id][2:]
            out = ROOT / "runs" / "bench_policies" / f"{env_id.replace('/', '_')}_{kind}"
            shutil.rmtree(out, ignore_errors=True)
            s = train(TrainArgs(data=(data,), policy=kind, steps=steps, batch_size=64, horizon=h, n_exec=ne,
                                out=out, wandb="disabled", progress=False, seed=0))
            pol = policies.load(out / "ckpt")
            ev = evaluate(pol, env_id, a.episodes if not a.quick else 10, seed=100_000, progress=False)
            lo, hi = wilson(ev.successes, ev.episodes)
            results["tasks"][env_id][kind] = {"success_rate": ev.success_rate, "episodes": ev.episodes, "ci95": [lo, hi],
                                              "demos": n_demos, "train_steps": steps, "horizon": h, "n_exec": ne,
                                              "train_samples_per_s": s["samples_per_s"], "eval_seconds": ev.seconds,
                                              "per_instruction": ev.per_instruction}
            results["train_samples_per_s"][f"{kind}_tiny/{env_id}"] = s["samples_per_s"]
            rows.append([env_id, kind, f"{ev.success_rate:.2f} [{lo:.2f}, {hi:.2f}]", ev.episodes, n_demos, steps,
                         f"{h}/{ne}", round(s["samples_per_s"])])
            print(rows[-1], flush=True)
            write("policies", results, md_table(["task", "policy", "success [95% CI]", "episodes", "demos",
                                                 "train steps", "H/n_exec", "train samples/s"], rows))  # partial results survive
    for kind in ("flow", "ar"):
        for size in ("tiny", "base"):
            results["latency_ms"][f"{kind}_{size}"] = latency(kind, size)
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    table = "## Success (tiny policies, state observations, same demos and steps)\n\n" + md_table(
        ["task", "policy", "success [95% CI]", "episodes", "demos", "train steps", "H/n_exec", "train samples/s"], rows)
    table += "\n## Chunk latency on this CPU (1 thread, H=16)\n\n" + md_table(
        ["policy", "p50 ms", "p99 ms", "params (M)"],
        [[k, v["p50"], v["p99"], v["params_m"]] for k, v in results["latency_ms"].items()])
    table += f"\nPeak RSS {results['peak_rss_mb']:.0f} MB. Machine: {results['machine']}\n"
    write("policies", results, table)


if __name__ == "__main__":
    main()
