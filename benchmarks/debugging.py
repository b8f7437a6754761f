"""Benchmark counterfactual world-model debugging on injected faults with known ground truth.

    .venv/bin/python benchmarks/debugging.py            # full grid (~10-15 min on 2 cores)
    .venv/bin/python benchmarks/debugging.py --quick    # a few runs (~1-2 min)

Three systems, each a "real" system with small errors at every step plus injected faults:

- ``maniskill/PushCube-v1`` (SAPIEN/PhysX): real = shifted twin (mass x1.05, friction x0.95,
  sensor noise 1e-4), model = nominal simulator, policy = a feedback push controller.
- ``adroit/door`` (MuJoCo): real = shifted twin (mass x1.03, friction x0.97, sensor noise 1e-3),
  model = nominal simulator, policy = the DAPG expert's mean action.
- ``worldmodel/door`` (learned): an ensemble world model trained here on Adroit door data;
  real = the model with sensor noise 1e-4, debugged against the noiseless model; batched rollouts.

Fault types (k causal faults per run at seeded random steps, plus 2 large harmless errors on
the simulators): ``physics`` (teleport: cube pose / door hinge angle), ``observation`` (corrupted
cube position the policy sees; only where the controller can be misled, the first 20 steps),
``reward`` (reward misprediction). Door pushes close the door 0.3 rad (k <= 2: the policy never
reopens it, so a third push changes nothing); in the learned model a push closes the door
reading 0.3 rad after the door is open (step 100 on), and the model's policy loop slowly
reopens it, so pushes add up. Harmless: corrupted joint velocities the controller never
reads, a jump of the goal marker's height or of the simulation clock, a corrupted door reading
after the door is open. Outcome: return; a patch reproduces the real outcome within an absolute
tolerance per system (2.5, 50, 10 return units), chosen above the background errors' effect and
below one fault's effect, so every injected fault is necessary.

Metrics per run: precision (found steps that are injected causal faults), recall (injected
faults found), hybrid rollouts and wall time of the search vs exhaustive single-step ablation
(T + 2 rollouts; run where affordable, else its rollout count is given and its time is null),
and the information bound log2 C(T, k): the fewest yes/no rollouts any search needs to single
out k causal steps among T.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import tyro  # noqa: E402

import envs  # noqa: E402
from deploy.debugging.search import DebugConfig, Outcome, attribute, exhaustive_ablation, prepare  # noqa: E402
from deploy.debugging.faults import DapgMeanPolicy, Fault, FaultyEnv, PushCubeController, record_episode  # noqa: E402
from envs.shifted import PhysicsShift, ShiftedEnv, make_shifted  # noqa: E402

DOOR_HINGE_SIM, DOOR_HINGE_OBS = 29, 28


@dataclass
class Args:
    out: Path = ROOT / "benchmarks" / "results"
    quick: bool = False
    """a handful of runs (smoke test of the benchmark)"""
    systems: tuple[str, ...] = ("maniskill", "adroit", "worldmodel")
    seed: int = 0
    threads: int = 1
    """torch threads (the machine has 2 shared cores)"""


@dataclass
class System:
    name: str
    make_real: Callable[[int, list[Fault], int], Any]
    model: Any
    policy: Any
    faults: dict[str, Callable[[np.random.Generator, int, int], list[Fault] | None]]
    harmless: Callable[[np.random.Generator, int, set[int]], list[Fault]]
    config: DebugConfig
    grid: list[tuple[str, int, int, bool]] = field(default_factory=list)  # (fault, T, k, run exhaustive)


def pick_steps(rng: np.random.Generator, lo: int, hi: int, k: int, avoid: set[int] = frozenset(), gap: int = 3
               ) -> list[int] | None:
    """k distinct steps in [lo, hi), consecutive ones at least ``gap`` apart and ``gap`` away from
    ``avoid``; uniformly spread (sorted offsets plus gaps); None if they cannot fit."""
    slack = (hi - lo) - (k - 1) * gap
    if k < 1 or slack < 1:
        return None
    for _ in range(100):
        u = np.sort(rng.integers(0, slack, size=k))
        steps = [int(lo + u[i] + i * gap) for i in range(k)]
        if all(min((abs(t - a) for a in avoid), default=gap) >= gap for t in steps):
            return steps
    return None


# ----- systems ---------------------------------------------------------------------------------

def maniskill_system(quick: bool) -> System:
    pi = PushCubeController()
    model = envs.make("maniskill/PushCube-v1", control_mode="pd_ee_delta_pos")
    twin: dict[int, Any] = {}

    def make_real(T: int, faults: list[Fault], seed: int) -> Any:
        if "env" not in twin:
            twin["env"] = make_shifted("maniskill/PushCube-v1", mass_scale=1.05, friction_scale=0.95, obs_noise=1e-4,
                                       seed=seed, control_mode="pd_ee_delta_pos")
        base = twin["env"]
        base.max_episode_steps = T
        return FaultyEnv(base, faults)

    def physics(rng, T, k):  # knock the cube out of place once it is being pushed or held
        s = pick_steps(rng, 20, T - 5, k, gap=8)
        return s and [Fault(t, "teleport", dims=(13, 14), delta=(-0.12, 0.1)) for t in s]

    def observation(rng, T, k):  # a wrong cube reading misleads the controller only while it pushes
        s = pick_steps(rng, 5, 20, k, gap=8)
        return s and [Fault(t, "observation", dims=(29,), delta=0.08) for t in s]

    def reward(rng, T, k):
        s = pick_steps(rng, 0, T, k)
        return s and [Fault(t, "reward", delta=-5.0) for t in s]

    def harmless(rng, T, used):
        s = pick_steps(rng, 2, T - 1, 2, avoid=used)
        return [Fault(s[0], "observation", dims=tuple(range(9, 18)), delta=5.0, harmless=True),
                Fault(s[1], "teleport", dims=(28,), delta=0.3, harmless=True)]

    grid = [("physics", 50, 1, True), ("observation", 50, 1, True), ("reward", 50, 2, True)] if quick else [
        ("physics", 50, 1, True), ("physics", 100, 2, False), ("observation", 50, 1, True),
        ("observation", 100, 1, False), ("reward", 50, 2, True), ("reward", 100, 4, False)]
    return System("maniskill/PushCube-v1", make_real, model, pi,
                  {"physics": physics, "observation": observation, "reward": reward}, harmless,
                  DebugConfig(outcome=Outcome("return"), rel_tol=0.0, abs_tol=2.5), grid)


def adroit_system(quick: bool) -> System:
    pi = DapgMeanPolicy("door")
    model = envs.make("adroit/door")

    def make_real(T: int, faults: list[Fault], seed: int) -> Any:
        base = make_shifted("adroit/door", mass_scale=1.03, friction_scale=0.97, obs_noise=1e-3, seed=seed,
                            max_episode_steps=T)
        return FaultyEnv(base, faults)

    def physics(rng, T, k):
        # the door is open from step ~55 on: pushing it 0.3 rad closed costs the >1.35 rad bonus, a second
        # push the >1.0 rad one; the policy does not reopen it, so more pushes would change nothing (k <= 2)
        s = pick_steps(rng, 70, T - 20, k, gap=12)
        return s and [Fault(t, "teleport", dims=(DOOR_HINGE_SIM,), delta=-0.3) for t in s]

    def reward(rng, T, k):
        s = pick_steps(rng, 0, T, k)
        return s and [Fault(t, "reward", delta=-100.0) for t in s]

    def harmless(rng, T, used):
        s = pick_steps(rng, 60, T - 1, 2, avoid=used)
        return [Fault(s[0], "teleport", dims=(0,), delta=100.0, harmless=True),  # the simulation clock
                Fault(s[1], "observation", dims=(27, 28), delta=-3.0, harmless=True)]  # door already open

    if quick:
        grid = [("physics", 200, 2, True), ("reward", 100, 4, True)]
    else:
        grid = [("reward", T, k, (T, k) in ((100, 1), (100, 4), (200, 1))) for T, ks in
                ((100, (1, 4)), (200, (1, 2, 4, 8)), (500, (1, 4, 8)), (1000, (1, 2))) for k in ks]
        grid += [("physics", T, k, (T, k) in ((100, 1), (200, 1))) for T, ks in
                 ((100, (1,)), (200, (1, 2)), (500, (1, 2)), (1000, (1, 2))) for k in ks]
    return System("adroit/door", make_real, model, pi, {"physics": physics, "reward": reward}, harmless,
                  DebugConfig(outcome=Outcome("return"), rel_tol=0.0, abs_tol=50.0), grid)


def worldmodel_system(quick: bool, workdir: Path, seed: int) -> System:
    from envs.world_model import load_world_model_env
    from dataset import DatasetWriter
    from train.world_model import train_world_model
    pi = DapgMeanPolicy("door")
    ckpt = workdir / "door_world_model"
    if not (ckpt / "config.json").exists():
        env = envs.make("adroit/door", max_episode_steps=150)
        rng = np.random.default_rng(seed)

        class Noisy:
            def __init__(self, std):
                self.std = std

            def select_action(self, obs):
                return np.clip(pi.select_action(obs) + rng.normal(0, self.std, 28), -1, 1).astype(np.float32)

        with DatasetWriter(workdir / "door.h5", "adroit/door", 39, 28, overwrite=True) as w:
            for i in range(30):
                w.add(record_episode(env, Noisy([0.0, 0.1, 0.3][i % 3]), seed=100 + i, steps=150))
        train_world_model([workdir / "door.h5"], ckpt, steps=1000, hidden=128, ensemble=4, seed=seed, progress=False)
    model = load_world_model_env(ckpt, precision="float64")

    def make_real(T: int, faults: list[Fault], seed: int) -> Any:
        wm = load_world_model_env(ckpt, precision="float64", max_episode_steps=T)
        return FaultyEnv(ShiftedEnv(wm, PhysicsShift(obs_noise=1e-4), seed=seed), faults)

    def physics(rng, T, k):  # the door reading is the model's state: push it 0.3 rad closed once it is open
        s = pick_steps(rng, 100, T - 40, k, gap=12)
        return s and [Fault(t, "teleport", dims=(DOOR_HINGE_OBS,), delta=-0.3) for t in s]

    def reward(rng, T, k):
        s = pick_steps(rng, 0, T, k)
        return s and [Fault(t, "reward", delta=-100.0) for t in s]

    if quick:
        grid = [("physics", 200, 2, True), ("reward", 1000, 8, True)]
    else:
        grid = [("reward", T, k, T <= 500 or k in (1, 8)) for T in (50, 100, 200, 500, 1000) for k in (1, 2, 4, 8)]
        grid += [("physics", T, k, T <= 500 or k == 1) for T, ks in ((200, (1, 2)), (500, (1, 2, 4, 8)),
                                                                    (1000, (1, 2, 4, 8))) for k in ks]
    return System("worldmodel/door", make_real, model, pi, {"physics": physics, "reward": reward},
                  lambda rng, T, used: [], DebugConfig(outcome=Outcome("return"), rel_tol=0.0, abs_tol=10.0), grid)


# ----- one run ---------------------------------------------------------------------------------

def run_one(sys_: System, fault: str, T: int, k: int, exhaustive: bool, seed: int) -> dict[str, Any] | None:
    rng = np.random.default_rng([seed, T, k, {"physics": 1, "observation": 2, "reward": 3}[fault]])
    causal = sys_.faults[fault](rng, T, k)
    if not causal:
        return None
    gt = sorted({s for f in causal for s in f.steps})
    harmless = sys_.harmless(rng, T, set(gt))
    h_steps = sorted(f.step for f in harmless)
    ep = record_episode(sys_.make_real(T, causal + harmless, seed), sys_.policy, seed=seed, steps=T)
    # what exhaustive ablation costs, + rollout_slack only where the opening guess fails (a max_rollouts
    # alone would be a hard cap)
    cfg = replace(sys_.config, max_rollouts=T + 2, rollout_slack=8)
    t0 = time.perf_counter()
    prep = prepare(sys_.model, sys_.policy, ep, cfg)
    residual_s = time.perf_counter() - t0
    res = attribute(prep, cfg)
    found = res.steps
    hit = len(set(found) & set(gt))
    nm = res.normalized_magnitudes.max(axis=1)
    by_size = [int(t) for t in np.argsort(-nm)[:len(gt)]]
    row: dict[str, Any] = {
        "env": sys_.name, "fault": fault, "T": T, "k": k,
        "precision": hit / len(found) if found else 1.0, "recall": hit / len(gt),
        "rollouts": res.rollouts, "exhaustive_rollouts": T + 2,
        "seconds": round(res.seconds, 3), "exhaustive_seconds": None,
        "budget_2klog2T": round(2 * k * math.log2(T), 1), "within_budget": res.rollouts <= 2 * k * math.log2(T),
        "log2_binom_T_k": round(math.log2(math.comb(T, k)), 1), "rollout_budget": res.rollout_budget,
        "search_rollouts": res.search_rollouts, "steps_simulated": res.steps_simulated,
        "residual_seconds": round(residual_s, 3), "fault_steps": gt, "harmless_steps": h_steps, "found": found,
        "harmless_blamed": len(set(found) & set(h_steps)), "gap": round(res.gap, 4), "tol": res.tol,
        "reproduction_error": res.reproduction_error, "verified": res.verified,
        "magnitude_baseline_precision": len(set(by_size) & set(gt)) / len(gt),
        "error_types": {str(a.step): a.error_type for a in res.causal}}
    if exhaustive:
        prep.engine = prep.fresh_engine()
        ab = exhaustive_ablation(prep, cfg)
        ehit = len(set(ab.causal) & set(gt))
        row.update(exhaustive_rollouts=ab.rollouts, exhaustive_seconds=round(ab.seconds, 3),
                   exhaustive_precision=ehit / len(ab.causal) if ab.causal else 1.0, exhaustive_recall=ehit / len(gt),
                   effective_faults=[t for t in gt if abs(ab.effects[t]) > ab.tol])
    else:  # which injected faults matter at all: f(all) - f(all without t) beyond tol (not counted)
        eng = prep.fresh_engine()
        full = eng.items(range(T))
        fa = eng.f(full)
        row["effective_faults"] = [t for t, v in zip(gt, eng.f_many([full - eng.items([t]) for t in gt]))
                                   if abs(fa - v) > res.tol]
    eff = row["effective_faults"]
    row["recall_effective"] = len(set(found) & set(eff)) / len(eff) if eff else 1.0
    row["search_stopped"] = res.fell_back
    row["rollout_ratio"] = round(row["exhaustive_rollouts"] / max(res.rollouts, 1), 2)
    return row


# ----- report ----------------------------------------------------------------------------------

def _summary_row(name: str, rs: list[dict[str, Any]]) -> str:
    m = lambda key: np.mean([r[key] for r in rs])  # noqa: E731
    return (f"| {name} | {len(rs)} | {m('precision'):.3f} | {m('recall'):.3f} | {m('recall_effective'):.3f} | "
            f"{sum(r['harmless_blamed'] for r in rs)} | {sum(r['within_budget'] for r in rs)}/{len(rs)} | "
            f"{sum(r['search_stopped'] for r in rs)} | {m('rollout_ratio'):.1f} | {m('magnitude_baseline_precision'):.2f} |")


def markdown(runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    L = ["# Counterfactual world-model debugging benchmark", "",
         f"Generated by `benchmarks/debugging.py` in {meta['seconds']:.0f} s ({meta['grid']}; torch threads "
         f"{meta['threads']}, seed {meta['seed']}). Precision and recall of the found causal steps against the "
         "injected faults; *recall (effective)* counts only injected faults whose single removal changes the "
         "outcome beyond the tolerance. Rollouts = all hybrid rollouts of the search (baseline, search, "
         "marginal effects, channel typing). Exhaustive = single-step ablation, T + 2 rollouts (its time `-` "
         "where it was not run). Budget = 2 k log2 T. log2 C(T,k) = the information bound, the fewest yes/no "
         "rollouts any search needs to single out k causal steps among T. *Fallback* = searches that switched "
         "to single-step ablation over the steps still in question rather than exceed T + 2 rollouts (by at most "
         "`rollout_slack`, 8, and only where the search's opening guess fails; their rollouts include both). Magnitude baseline = the k steps with the largest "
         "normalized residual.", ""]
    L += ["## Summary", "", "| env | runs | precision | recall | recall (effective) | harmless blamed | within budget | "
          "fallback | rollout ratio (exhaustive / search) | magnitude-baseline precision |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for env in dict.fromkeys(r["env"] for r in runs):
        L.append(_summary_row(env, [r for r in runs if r["env"] == env]))
    L.append(_summary_row("**all**", runs))
    t500 = [r for r in runs if r["T"] == 500]
    if t500:
        L += ["", "Rollout ratio (exhaustive / search) at T = 500, by k: " + ", ".join(
            f"k={k}: {np.mean([r['rollout_ratio'] for r in t500 if r['k'] == k]):.1f}x"
            for k in sorted({r['k'] for r in t500}))]
    L += ["", "## Runs", "", "| env | fault | T | k | precision | recall | recall (eff.) | rollouts | log2 C(T,k) | "
          "budget | exhaustive rollouts | ratio | seconds | exhaustive seconds | exhaustive P/R | harmless blamed |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        epr = (f"{r['exhaustive_precision']:.2f}/{r['exhaustive_recall']:.2f}" if "exhaustive_precision" in r else "-")
        es = "-" if r["exhaustive_seconds"] is None else f"{r['exhaustive_seconds']:.2f}"
        L.append(f"| {r['env']} | {r['fault']} | {r['T']} | {r['k']} | {r['precision']:.2f} | {r['recall']:.2f} | "
                 f"{r['recall_effective']:.2f} | {r['rollouts']}{' (fallback)' if r['search_stopped'] else ''} | "
                 f"{r['log2_binom_T_k']} | {r['budget_2klog2T']} | {r['exhaustive_rollouts']} | {r['rollout_ratio']} | "
                 f"{r['seconds']:.2f} | {es} | {epr} | {r['harmless_blamed']} |")
    L += ["", "![rollouts vs T](debugging_rollouts.png)", ""]
    return "\n".join(L)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    Ts = np.array(sorted({r["T"] for r in runs}))
    markers = {"maniskill/PushCube-v1": "s", "adroit/door": "o", "worldmodel/door": "^"}
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green", 8: "tab:red"}
    for r in runs:
        ax.plot(r["T"] * (1 + 0.03 * np.log2(r["k"])), r["rollouts"], markers.get(r["env"], "x"),
                color=colors.get(r["k"], "k"), alpha=0.8, ms=5)
    for k, c in colors.items():
        ax.plot(Ts, 2 * k * np.log2(Ts), "-", color=c, lw=1, label=f"2 k log2 T, k={k}")
    ax.plot(Ts, Ts + 2, "k--", lw=1, label="exhaustive (T + 2)")
    for env, m in markers.items():
        ax.plot([], [], m, color="gray", label=env)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("trajectory length T")
    ax.set_ylabel("hybrid rollouts")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Rollouts of the causal search (markers; color = k) vs budgets")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: Args) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    import tempfile
    workdir = Path(tempfile.mkdtemp(prefix="gf_debug_bench_"))
    t0 = time.time()
    runs: list[dict[str, Any]] = []
    builders = {"maniskill": lambda: maniskill_system(args.quick), "adroit": lambda: adroit_system(args.quick),
                "worldmodel": lambda: worldmodel_system(args.quick, workdir, args.seed)}
    for name in args.systems:
        s0 = time.time()
        sys_ = builders[name]()
        print(f"[{name}] ready in {time.time() - s0:.1f} s; {len(sys_.grid)} runs", flush=True)
        for fault, T, k, ex in sys_.grid:
            r = run_one(sys_, fault, T, k, ex, args.seed)
            if r is None:
                print(f"  skip {fault} T={T} k={k}: no room for {k} faults", flush=True)
                continue
            runs.append(r)
            print(f"  {fault:11s} T={T:5d} k={k} P={r['precision']:.2f} R={r['recall']:.2f} rollouts={r['rollouts']:4d} "
                  f"(budget {r['budget_2klog2T']}, exhaustive {r['exhaustive_rollouts']}) {r['seconds']:.1f}s"
                  + (f" vs {r['exhaustive_seconds']:.1f}s" if r["exhaustive_seconds"] is not None else ""), flush=True)
        print(f"[{name}] done in {time.time() - s0:.1f} s", flush=True)
    meta = {"seconds": time.time() - t0, "grid": "quick grid" if args.quick else "full grid, subsampled",
            "seed": args.seed, "threads": args.threads, "systems": list(args.systems)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "debugging.json").write_text(json.dumps({"runs": runs, "meta": meta}, indent=1))
    plot(runs, out / "debugging_rollouts.png")
    (out / "debugging.md").write_text(markdown(runs, meta))
    print(f"wrote {out / 'debugging.json'} and debugging.md in {meta['seconds']:.0f} s")
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)
    return {"runs": runs, "meta": meta}


if __name__ == "__main__":
    main(tyro.cli(Args))
