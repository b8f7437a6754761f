"""Guidance on the robot: the ManiSkill collision-avoidance task, every method over a scale sweep.

A tiny flow policy is trained on straight reaches WITHOUT obstacles (DART demos: clean expert
labels, noisy execution), then steered around boxes and spheres at test time by each guidance
method with the same cost (train/guided_eval.py: gripper key points along the chunk's TCP path
kept ``margin`` from every obstacle, plus a pull of the chunk end toward the goal). The scale is
swept over two decades on one set of seeds; each method's best scale (by success without
collision) is then evaluated on fresh seeds, so the reported rates are not selected on their own
episodes. Writes the ``collision`` section of benchmarks/results/guidance.json (others kept),
guidance_collision.md and guidance_collision.png.

    .venv/bin/python benchmarks/guidance_collision.py              # ~15-20 min on 2 cores
    .venv/bin/python benchmarks/guidance_collision.py --quick      # smoke run
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, demos, machine, md_table, merge_json  # noqa: E402

import tyro  # noqa: E402
from tqdm import tqdm  # noqa: E402

import policies  # noqa: E402
from envs.metrics import wilson  # noqa: E402
from train.bc import TrainArgs, train  # noqa: E402
from train.guided_eval import evaluate_collision  # noqa: E402

ENV = "maniskill/CollisionAvoidance-v1"
# mc is left out: it needs samples of the *conditional* chunk distribution for each observation
# (it is defined for unconditional models with a data set); cfg takes no cost.
# name -> (method, options): coupled is the library default (diagonal Sigma_t, line-search step);
# coupled_jacobian_ls the Tweedie Sigma_t with the same step (one backward pass); coupled_linear is
# DESIGN.md's plain posterior-covariance step (no extra cost evaluations).
CONFIGS = {"coupled": ("coupled", {}), "coupled_jacobian_ls": ("coupled", {"sigma": "jacobian"}),
           "coupled_linear": ("coupled", {"step": "linear"}),
           "velocity_gradient": ("velocity_gradient", {}), "state_gradient": ("state_gradient", {}),
           "pnp_renoise": ("pnp_renoise", {})}
METHODS = tuple(CONFIGS)


@dataclass
class Args:
    methods: tuple[str, ...] = METHODS
    scales: tuple[float, ...] = (1.0, 3.0, 10.0, 30.0, 100.0)
    """guidance scales swept (two decades)"""
    sweep_episodes: int = 20
    final_episodes: int = 50
    demos: int = 120
    dart_noise: float = 0.3
    train_steps: int = 2000
    margin: float = 0.05
    goal_weight: float = 30.0
    seed: int = 0
    quick: bool = False
    keep_other_rows: bool = False
    """keep the results of methods not run now (a partial rerun, e.g. after a default changed)"""


def main() -> None:
    a = tyro.cli(Args)
    unknown = [m for m in a.methods if m not in CONFIGS]
    if unknown:  # "none" (unguided) is always run as the reference row
        raise SystemExit(f"unknown --methods {unknown}; valid: {', '.join(CONFIGS)} (unguided 'none' always runs)")
    if a.quick:
        a.scales, a.sweep_episodes, a.final_episodes, a.train_steps = (3.0, 30.0), 4, 6, 300
    data = demos(ENV, a.demos, seed=a.seed, dart_noise=a.dart_noise)
    out = ROOT / "runs" / "bench_guidance_collision" / f"s{a.seed}_n{a.demos}_st{a.train_steps}"
    if not (out / "ckpt").exists():
        train(TrainArgs(data=(data,), policy="flow", steps=a.train_steps, horizon=8, n_exec=4, out=out,
                        wandb="disabled", progress=False, seed=a.seed))
    pol = policies.load(out / "ckpt")
    kw = {"margin": a.margin, "goal_weight": a.goal_weight}
    t0 = time.time()
    sweep_seed, final_seed = 3000, 5000
    ref = {"no_obstacle": evaluate_collision(pol, "none", 0.0, a.final_episodes, seed=final_seed, obstacles="none"),
           "none": evaluate_collision(pol, "none", 0.0, a.final_episodes, seed=final_seed)}
    sweep: dict[str, dict[str, dict]] = {}
    for m in a.methods:
        sweep[m] = {}
        for s in tqdm(a.scales, desc=f"sweep {m}"):
            method, opts = CONFIGS[m]
            sweep[m][f"{s:g}"] = evaluate_collision(pol, method, s, a.sweep_episodes, seed=sweep_seed, options=opts, **kw)
    final: dict[str, dict] = {"none": {**ref["none"], "scale": 0.0}}
    for m in a.methods:
        best = max(sweep[m].items(), key=lambda kv: (kv[1]["clean_success_rate"], -kv[1]["collision_rate"]))[0]
        method, opts = CONFIGS[m]
        final[m] = evaluate_collision(pol, method, float(best), a.final_episodes, seed=final_seed, options=opts, **kw)
    base_ms, base_nfe = final["none"]["ms_per_chunk"], final["none"]["nfe_per_chunk"]
    for r in final.values():
        n = r["episodes"]
        r["success_ci95"] = list(wilson(round(r["success_rate"] * n), n))
        r["collision_ci95"] = list(wilson(round(r["collision_rate"] * n), n))
        r["time_ratio"] = r["ms_per_chunk"] / base_ms
        r["nfe_ratio"] = r["nfe_per_chunk"] / base_nfe
    meta = {"env": ENV, "policy": "flow tiny, H=8, n_exec=4", "demos": a.demos, "dart_noise": a.dart_noise,
            "train_steps": a.train_steps, "margin_m": a.margin, "goal_weight": a.goal_weight,
            "sweep_episodes": a.sweep_episodes, "final_episodes": a.final_episodes,
            "no_obstacle_success": ref["no_obstacle"]["success_rate"], "seconds": time.time() - t0,
            "machine": machine(), "skipped": {"mc": "needs conditional chunk samples per observation",
                                              "cfg": "takes no cost"}}
    if a.keep_other_rows:  # a rerun of some methods: rows of the others stay (each row has its own episodes)
        old = json.loads((RESULTS / "guidance.json").read_text()) if (RESULTS / "guidance.json").exists() else {}
        final = {**{k: v for k, v in old.get("collision", {}).items() if k not in final}, **final}
        sweep = {**{k: v for k, v in old.get("collision_sweep", {}).items() if k not in sweep}, **sweep}
        meta = {**old.get("collision_meta", {}), "rerun": {**meta, "methods": list(a.methods)}}
    merge_json(RESULTS / "guidance.json", {"collision": final, "collision_sweep": sweep, "collision_meta": meta})
    free = ref["no_obstacle"]
    rows = [["no obstacles, unguided", "-", f"{free['success_rate']:.2f}", f"{free['collision_rate']:.2f}", "-", "-", "-", "-"]]
    for m, r in final.items():
        rows.append([m, f"{r['scale']:g}", f"{r['success_rate']:.2f} [{r['success_ci95'][0]:.2f}, {r['success_ci95'][1]:.2f}]",
                     f"{r['collision_rate']:.2f} [{r['collision_ci95'][0]:.2f}, {r['collision_ci95'][1]:.2f}]",
                     f"{r['clean_success_rate']:.2f}", f"{r['time_ratio']:.2f}", f"{r['nfe_ratio']:.2f}", r["episodes"]])
    table = (f"## Collision avoidance (fresh episodes per row, best scale of a "
             f"{a.sweep_episodes}-episode sweep)\n\n" + md_table(
                 ["method", "scale", "success [95% CI]", "collision [95% CI]", "clean success", "time/chunk vs none",
                  "NFE vs none", "episodes"], rows))
    srows = [[m, s, f"{r['success_rate']:.2f}", f"{r['collision_rate']:.2f}", f"{r['clean_success_rate']:.2f}",
              f"{r['ms_per_chunk']:.1f}"] for m, d in sweep.items() for s, r in d.items()]
    table += "\n## Scale sweep\n\n" + md_table(["method", "scale", "success", "collision", "clean", "ms/chunk"], srows)
    table += f"\n{json.dumps({k: v for k, v in meta.items() if k != 'machine'})}\n"
    (RESULTS / "guidance_collision.md").write_text(table)
    print(table)
    _plot(sweep, free["success_rate"], RESULTS / "guidance_collision.png")


def _plot(sweep: dict, free_success: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for m, d in sweep.items():
        xs = [float(s) for s in d]
        axes[0].plot(xs, [r["clean_success_rate"] for r in d.values()], marker="o", label=m)
        axes[1].plot(xs, [r["collision_rate"] for r in d.values()], marker="o", label=m)
    axes[0].axhline(free_success, color="k", ls="--", lw=1, label="no obstacles")
    axes[1].axhline(0.05, color="r", ls=":", lw=1, label="5% target")
    for ax, name in zip(axes, ("success without collision", "collision rate")):
        ax.set_xscale("log")
        ax.set_xlabel("guidance scale")
        ax.set_ylabel(name)
        ax.set_ylim(-0.02, 1.02)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
