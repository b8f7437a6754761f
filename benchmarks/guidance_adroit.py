"""Guidance under Adroit constraints (train/constrained_eval.py): tighter joint limits on the four
tasks (``--kind joint_limits``, the default) or a palm keep-out ball on door and relocate
(``--kind keepout``: a constraint no clamp of the action can satisfy).

Per task: a tiny flow policy trained on 50 DAPG expert demos (cached under
runs/bench_guidance_adroit/), then none / clip / coupled (default linesearch step) /
coupled_prox (converged prox step) / velocity_gradient / state_gradient / pnp_renoise over a
scale sweep of two decades, plus coupled+clip and coupled_prox+clip (guided, then clamped) at
their method's chosen scale; every run on the same episodes (seeds) and the same sampler noise. Keep-out
adds ``<method>+check`` rows (coupled, coupled_prox, pnp_renoise, guided_particles4): each chunk's predicted
palm path is checked before it runs, 8 guided candidates replace a failing one, before each command the next
4 are re-checked from the measured state (a re-plan when they no longer clear), the safety filter is the
last line; at the base method's chosen scale (this run's, else the one in guidance.json). The unguided and
``+check`` rows run again on episodes 5000.. (``recheck_*`` fields), and the section names the recommended
row. ``--dart-noise X`` trains the policies on DART demos instead and writes the ``_dart`` sections
(adroit_keepout_dart, ...) and guidance_adroit_keepout_dart.md (guidance_adroit_dart.md for joint limits);
``--detours`` trains them on the expert's demos plus as many detour demos (train/detour_demos.py) and writes
adroit_keepout_detours and guidance_adroit_keepout_detours.md; ``--train-seed 1`` retrains either (sections
adroit_keepout_train1, adroit_keepout_detours_train1), the checked rows at the seed-0 policies' scales;
``--large`` trains on 200 expert demos for 10000 steps instead (adroit_keepout_large, ..._large_train1,
..._large_train2: door's margin is thin, so it has a third training).
Per method the reported scale is the one with the lowest violation rate, ties broken by
success. Writes the "adroit", "adroit_sweep" and "adroit_meta" sections of
benchmarks/results/guidance.json (other sections kept) and benchmarks/results/guidance_adroit.md;
``--kind keepout`` writes "adroit_keepout", "adroit_keepout_sweep", "adroit_keepout_meta" and
guidance_adroit_keepout.md, and reports per method the scale with the best *clean* success
(success without the palm entering the ball), ties broken by fewer violations: there every
method can keep out by freezing, so the lowest-violation rule would pick useless scales.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/guidance_adroit.py
    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/guidance_adroit.py --kind keepout --episodes 50  # ~25 min
        # ~4 min with cached policies, ~15 min with training (1 core, shared machine)
    .venv/bin/python benchmarks/guidance_adroit.py --tasks door --episodes 5 --no-write
    .venv/bin/python benchmarks/guidance_adroit.py --kind keepout --episodes 50 --methods particles4   # adds rows
    .venv/bin/python benchmarks/guidance_adroit.py --kind keepout --episodes 50 --methods coupled+check \
        coupled_prox+check pnp_renoise+check guided_particles4+check                                 # ~15 min
    .venv/bin/python benchmarks/guidance_adroit.py --kind keepout --episodes 50 --detours --methods none coupled \
        coupled_prox coupled+check coupled_prox+check                                                # ~25 min
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, demos, machine, md_table, merge_json  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import envs  # noqa: E402
import policies  # noqa: E402
from train.bc import TrainArgs, train  # noqa: E402
from train.constrained_eval import CONSTRAINTS, KEEPOUTS, TOL, KeepOut, evaluate_constrained  # noqa: E402

TASKS = {  # task -> (demos, train steps); door's budget reached 0.98 success in policies.md
    "door": (50, 3000), "hammer": (50, 3000), "pen": (50, 3000), "relocate": (50, 3000),
}
LARGE = (200, 10000)
"""--large (keep-out): demos and train steps of the larger budget, for a policy that recovers from the approach a
constraint changes (door's grasp from below the ball)"""
RUNS = ROOT / "runs" / "bench_guidance_adroit"
# name -> (method of train.constrained_eval, guidance options, scales). Scales are per method
# because the methods' usable ranges differ by decades (probe on door/hammer: state_gradient and
# pnp_renoise diverge at 1, coupled's converged prox needs >= 10 to reach the limit).
CONFIGS: dict[str, tuple[str, dict, tuple[float, ...]]] = {
    "none": ("none", {}, (0.0,)),
    "clip": ("clip", {}, (0.0,)),
    "coupled": ("coupled", {}, (0.1, 1.0, 10.0)),                       # library default: linesearch step
    # Jacobian Sigma_t: a policy's posterior given its observation is sharp, the Tweedie Sigma_t
    # small, and the same scale guides less: its sweep reaches 1000
    "coupled_jacobian_ls": ("coupled", {"sigma": "jacobian"}, (1.0, 10.0, 100.0, 1000.0)),
    "coupled_prox": ("coupled", {"step": "prox"}, (1.0, 10.0, 100.0)),  # converged prox (5 inner steps)
    "velocity_gradient": ("velocity_gradient", {}, (0.1, 1.0, 10.0)),
    "state_gradient": ("state_gradient", {}, (0.1, 1.0, 10.0)),
    "pnp_renoise": ("pnp_renoise", {}, (0.1, 1.0, 10.0)),
}
# Keep-out: the cost is in metres (ObstacleCost on the predicted palm path, 1e4 nats per m^2: 2 cm
# inside the margin costs 4 nats at scale 1); the same methods over the scales where they move.
_KO_SCALES = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
KEEPOUT_CONFIGS: dict[str, tuple[str, dict, tuple[float, ...]]] = {
    "none": ("none", {}, (0.0,)),
    "clip": ("clip", {}, (0.0,)),          # here: the model-based safety filter on each executed command
    "coupled": ("coupled", {}, _KO_SCALES),
    "coupled_jacobian_ls": ("coupled", {"sigma": "jacobian"}, (1.0, 10.0, 100.0, 1000.0)),
    "coupled_prox": ("coupled", {"step": "prox"}, _KO_SCALES),
    "velocity_gradient": ("velocity_gradient", {}, _KO_SCALES),
    "state_gradient": ("state_gradient", {}, _KO_SCALES),
    "pnp_renoise": ("pnp_renoise", {}, _KO_SCALES),
    # P candidate chunks per chunk (P x the network): unguided, one kept by exp(-w c); and
    # coupled-guided stochastic ones, kept by importance weights (guidance.GuidedParticles)
    "particles4": ("particles", {"n_particles": 4}, _KO_SCALES),
    "guided_particles4": ("guided_particles", {"n_particles": 4, "renoise": 0.5}, _KO_SCALES),
}
# guided, then clamped: the safety net a deployment keeps; evaluated at the base method's chosen scale
CLIPPED = {"coupled+clip": "coupled", "coupled_prox+clip": "coupled_prox"}
# keep-out only: guided, then the hard check of each chunk's predicted palm path (8 guided candidates at once
# when it fails, the safety filter when none passes); at the base method's chosen scale (this run's, else the
# one stored in guidance.json)
CHECKED = {f"{m}+check": m for m in ("coupled", "coupled_prox", "pnp_renoise", "guided_particles4")}
WEIGHT = 100.0  # LimitCost weight, nats per action-unit^2 (0.1 outside the limit: 1 nat at scale 1)
WEIGHTS = {"joint_limits": WEIGHT, "keepout": 1e4}
KIND_TASKS = {"joint_limits": list(TASKS), "keepout": list(KEEPOUTS)}
SEED = 3000
RECHECK_SEED = 5000
"""keep-out: the unguided and the ``+check`` rows run again on episodes 5000.. (their ``recheck_*`` fields), as a
re-check of the chosen scales on episodes the choice never saw"""
RECHECKED = ("none", *CHECKED)


@dataclass(frozen=True)
class Demos:
    """What the policies are cloned from: the expert's demos, DART demos (``dart_noise`` > 0) or, added to the
    expert's, as many detour demos (``detours``: train/detour_demos.py); ``large``: the expert's demos at the
    ``LARGE`` budget; ``train_seed`` > 0 retrains them with that seed (checked rows then run at the scales the
    seed-0 policies chose)."""

    dart_noise: float = 0.0
    detours: bool = False
    train_seed: int = 0
    large: bool = False

    def suffix(self, noise: bool = True) -> str:
        """Of the policy's run directory ("", "_dart0.1", "_detours", "_large_train1") or, ``noise=False``, of
        the results section (the DART sections hold one noise level: "_dart")."""
        dart = f"_dart{self.dart_noise:g}" if noise else "_dart"
        data = dart if self.dart_noise else "_detours" if self.detours else ""
        return data + ("_large" if self.large else "") + (f"_train{self.train_seed}" if self.train_seed else "")

    def budget(self, task: str) -> tuple[int, int]:
        """(demos, train steps) of ``task``'s policy."""
        return LARGE if self.large else TASKS[task]

    @property
    def first_training(self) -> "Demos":
        """The same demos, trained with seed 0: where a retrained policy's checked rows take their scales."""
        return replace(self, train_seed=0)


def policy_for(task: str, log=print, source: Demos = Demos()) -> tuple[Any, dict]:
    """Train (or reuse) the tiny flow policy of ``task`` on the demos ``source`` names, with its training seed."""
    n_demos, steps = source.budget(task)
    data = demos(f"adroit/{task}", n_demos, **({"dart_noise": source.dart_noise} if source.dart_noise else {}))
    files = (data, demos(f"adroit/{task}", n_demos, detours=True)) if source.detours else (data,)
    out = RUNS / f"{task}{source.suffix()}"
    info_path = out / "bench_train.json"
    if (out / "ckpt").exists() and info_path.exists():
        return policies.load(out / "ckpt"), json.loads(info_path.read_text())
    t = time.time()
    s = train(TrainArgs(data=files, policy="flow", steps=steps, batch_size=64, horizon=16, n_exec=8, out=out,
                        wandb="disabled", progress=False, seed=source.train_seed))
    info = {"demos": n_demos, "dart_noise": source.dart_noise, "detour_demos": n_demos if source.detours else 0,
            "train_seed": source.train_seed,
            "train_steps": steps, "train_seconds": time.time() - t, "train_samples_per_s": s.get("samples_per_s"),
            "data": " + ".join(str(f.relative_to(ROOT)) for f in files)}
    info_path.write_text(json.dumps(info))
    log(f"trained {task}: {info}")
    return policies.load(out / "ckpt"), info


def choose(runs: list[dict], kind: str = "joint_limits") -> dict:
    """Joint limits: the run with the lowest violation rate, ties broken by success, then by the
    smaller scale. Keep-out: the best clean success, then fewer violations, then the smaller scale."""
    if kind == "keepout":
        return min(runs, key=lambda r: (-r["clean_success_rate"], r["violation_rate"], r["scale"]))
    return min(runs, key=lambda r: (r["violation_rate"], -r["success_rate"], r["scale"]))


def run_task(task: str, episodes: int, log=print, kind: str = "joint_limits",
             methods: tuple[str, ...] = (), source: Demos = Demos()) -> tuple[dict, dict, dict]:
    pol, info = policy_for(task, log, source)
    env_id = f"adroit/{task}"
    pool = [envs.make(env_id) for _ in range(episodes)]
    sweep: dict[str, list[dict]] = {}
    best: dict[str, dict] = {}

    def one(name: str, method: str, options: dict, scale: float, seed: int = SEED) -> dict:
        t = time.time()
        r = evaluate_constrained(pol, env_id, method, scale, episodes, seed=seed, weight=WEIGHTS[kind], options=options,
                                 env_pool=pool, kind=kind)
        r["config"], r["wall_s"] = name, time.time() - t
        log(f"{task:8s} {name:18s} seed={seed} scale={scale:<6g} success={r['success_rate']:.2f} violation={r['violation_rate']:.2f} "
            f"clean={r['clean_success_rate']:.2f} state_violation={r['state_violation_rate']:.2f} "
            f"max_state_excess={r['state_violation_max']:.4f} mean_excess={r['violation_mean']:.4f} "
            f"ms/chunk={r['ms_per_chunk']:.1f} ({r['wall_s']:.0f}s)")
        return r

    configs = KEEPOUT_CONFIGS if kind == "keepout" else CONFIGS
    for name, (method, options, scales) in configs.items():
        if methods and name not in methods:
            continue
        sweep[name] = [one(name, method, options, s) for s in scales]
        best[name] = choose(sweep[name], kind)
    for name, base in CLIPPED.items():
        if methods and (name not in methods or base not in best):
            continue
        method, options, _ = configs[base]
        r = one(name, f"{method}+clip", options, best[base]["scale"])
        sweep[name] = [r]
        best[name] = r
    for name, base in CHECKED.items():
        if kind != "keepout" or (methods and name not in methods):
            continue
        method, options, _ = configs[base]
        r = one(name, f"{method}+check", options,
                best[base]["scale"] if base in best else _stored_scale(task, base, _section(kind, source.first_training)))
        sweep[name] = [r]
        best[name] = r
    for name in RECHECKED if kind == "keepout" else ():
        if name in best:
            method = best[name]["method"]
            again = one(name, method, best[name]["options"], best[name]["scale"], RECHECK_SEED)
            best[name].update({f"recheck_{k}": again[k] for k in RECHECK_KEYS})
    for e in pool:
        e.close()
    if kind == "keepout":
        ko = KEEPOUTS[task]
        return best, sweep, {**info, "constraint": {"why": ko.why, "site": ko.site, "center": list(ko.center),
                                                    "radius": ko.radius, "margin": ko.margin,
                                                    "servo_r2": list(ko.servo.r2)}}
    c = CONSTRAINTS[task]
    meta = {**info, "constraint": {"why": c.why, "limits": [
        {"dim": lim.dim, "actuator": lim.actuator, "low": lim.low, "high": lim.high,
         "demo_min": lim.demo_min, "demo_max": lim.demo_max} for lim in c.limits]}}
    return best, sweep, meta


SECTIONS = {("joint_limits", ""): "adroit", ("joint_limits", "_dart"): "adroit_dart",
            ("keepout", ""): "adroit_keepout", ("keepout", "_dart"): "adroit_keepout_dart",
            ("keepout", "_detours"): "adroit_keepout_detours", ("keepout", "_train1"): "adroit_keepout_train1",
            ("keepout", "_detours_train1"): "adroit_keepout_detours_train1",
            ("keepout", "_large"): "adroit_keepout_large", ("keepout", "_large_train1"): "adroit_keepout_large_train1",
            ("keepout", "_large_train2"): "adroit_keepout_large_train2"}
"""(kind, demos) -> the guidance.json section and results file stem (guidance_<section>.md) of a run"""


def _section(kind: str, source: Demos = Demos()) -> str:
    """The guidance.json section (and results file stem) of a run: adroit, adroit_keepout, ..._dart, ..._detours."""
    key = (kind, source.suffix(noise=False))
    if key not in SECTIONS:
        raise SystemExit(f"no {kind} section for {source}: detour demos and retraining are for the keep-out "
                         f"(--kind keepout; --train-seed 1, or 2 with --large)")
    return SECTIONS[key]


def _stored_scale(task: str, base: str, section: str = "adroit_keepout") -> float:
    """The keep-out scale guidance.json chose for ``base`` on ``task``."""
    stored = json.loads((RESULTS / "guidance.json").read_text()).get(section, {}).get(task, {})
    if base not in stored:
        raise SystemExit(f"no stored {section} row {base!r} for {task}: run --methods {base} too")
    return float(stored[base]["scale"])


KEYS = ("success_rate", "violation_rate", "nonfinite_rate", "state_violation_rate", "state_violation_max",
        "violation_mean", "violation_max",
        "clean_success_rate", "chunk_violation_frac", "scale", "mean_steps", "ms_per_chunk", "ms_per_chunk_batched",
        "nfe_per_chunk", "backward_per_chunk", "episodes", "options", "retried_per_chunk", "filtered_per_chunk",
        "monitor_replans_per_chunk", "monitor_filtered_per_chunk")
RECHECK_KEYS = ("success_rate", "violation_rate", "clean_success_rate", "mean_steps")


def table(best: dict[str, dict], meta: dict[str, dict], sweep: dict[str, dict], episodes: int) -> str:
    out = ["# Guidance under tighter joint limits (Adroit)", "",
           f"Tiny flow policies (50 DAPG demos, 3000 steps, H=16, 8 executed), {episodes} episodes per row "
           f"(seeds {SEED}..{SEED + episodes - 1}, same sampler noise for every method). Limits remove 35% of "
           "each joint's demo action range on one side (train/constrained_eval.py). *violation*: share of "
           f"episodes with an executed action more than {TOL} action units outside a limit; *qpos viol.*: the "
           "joint position, mapped through its servo, more than 0.05 outside; *clean*: success without violation; "
           "*diverged*: share of episodes ended by a NaN/inf chunk (counted as failed and violating). "
           "Per method the scale with the lowest violation rate (then best success) is shown; the full sweep "
           "is below and in guidance.json (`adroit_sweep`). ms/chunk: one observation, 1 CPU thread.", ""]
    for task, rows in best.items():
        lims = ", ".join(f"{d['actuator']} in [{d['low']:g}, {d['high']:g}] (demos [{d['demo_min']:g}, {d['demo_max']:g}])"
                         for d in meta[task]["constraint"]["limits"])
        out += [f"## adroit/{task}: {lims}", ""]
        out.append(md_table(["method", "scale", "success", "violation", "clean success", "qpos viol.",
                             "mean excess", "chunk entries outside", "diverged", "ms/chunk", "NFE"],
                            [[m, r["scale"], r["success_rate"], r["violation_rate"], r["clean_success_rate"],
                              r["state_violation_rate"], r["violation_mean"], r["chunk_violation_frac"], r["nonfinite_rate"], r["ms_per_chunk"],
                              r["nfe_per_chunk"]] for m, r in rows.items()]))
    out += ["## Full sweep (success / violation per scale)", ""]
    rows = []
    for task, methods in sweep.items():
        for m, runs in methods.items():
            rows.append([task, m] + ["; ".join(f"{r['scale']:g}: {r['success_rate']:.2f} / {r['violation_rate']:.2f}"
                                               for r in runs)])
    out.append(md_table(["task", "method", "scale: success / violation"], rows))
    return "\n".join(out)


def _recheck_cell(r: dict) -> str:
    if "recheck_success_rate" not in r:
        return ""
    return " / ".join(f"{r[f'recheck_{k}']:.2f}" for k in ("success_rate", "violation_rate", "clean_success_rate"))


def keepout_table(best: dict[str, dict], meta: dict[str, dict], sweep: dict[str, dict], episodes: int) -> str:
    info = next(iter(meta.values()))  # every task's policy has the same training source
    n = info["demos"]
    data = (f"{n} DAPG demos + {n} detour demos: the expert filtered around random balls clear of the evaluation "
            "ball, train/detour_demos.py" if info.get("detour_demos") else
            f"{n} DART demos, noise {info['dart_noise']:g}" if info.get("dart_noise") else f"{n} DAPG demos")
    if info.get("train_seed"):
        data += f"; trained with seed {info['train_seed']}, checked rows at the seed-0 policies' scales"
    out = ["# Guidance under a palm keep-out region (Adroit)", "",
           f"Tiny flow policies ({data}; {info['train_steps']} steps, H=16, 8 executed), "
           f"{episodes} episodes per row "
           f"(seeds {SEED}..{SEED + episodes - 1}, same sampler noise for every method). The palm (site S_grasp) "
           "must stay out of a ball placed on the unguided policy's own approach path (train/constrained_eval.py "
           "`KEEPOUTS`). The cost (1e4 nats per m^2 inside radius + 2 cm) is on the palm path that a servo model "
           "(linear, fitted on random commands) predicts for the chunk from the current joint state, through "
           "exact forward kinematics of the MuJoCo model. *violation*: the actual palm came more than 1 cm "
           "inside the ball at some step; *clean*: success without violation; *clip* is the minimal-change "
           "safety filter on each executed command (Newton steps until the palm, holding the command for 4 "
           "steps, is predicted 2 cm clear): a clamp of the action cannot express this constraint. *+check*: each "
           "chunk's predicted palm path is checked before it runs (8 guided candidates replace a failing one), and "
           "before each command the next 4 are re-checked from the measured joint state (a re-plan from there "
           "when they no longer clear); the filter only where no candidate passes. Per method "
           "the scale with the best clean success (then fewer violations) is shown; the full sweep is below and "
           "in guidance.json (`adroit_keepout_sweep`). ms/chunk: one observation, 1 CPU thread.", ""]
    for task, rows in best.items():
        c = meta[task]["constraint"]
        out += [f"## adroit/{task}: ball of {c['radius'] * 100:g} cm around {c['center']} ({c['why']}); "
                f"servo model one-step R^2 {min(c['servo_r2']):.2f}-{max(c['servo_r2']):.2f}", ""]
        out.append(md_table(["method", "scale", "success", "violation", "clean success", "deepest (cm)",
                             "mean steps", "diverged", "ms/chunk", "backward/chunk",
                             f"re-check (seeds {RECHECK_SEED}+): success / violation / clean"],
                            [[m, r["scale"], r["success_rate"], r["violation_rate"], r["clean_success_rate"],
                              100 * r["state_violation_max"], r["mean_steps"], r["nonfinite_rate"], r["ms_per_chunk"],
                              r["backward_per_chunk"], _recheck_cell(r)] for m, r in rows.items()]))
    rec = recommend(best)
    out += [f"Recommended (at most 1% violations on every task and both seeds, best worst-case clean success "
            f"relative to unguided): **{rec}**." if rec else "No re-checked row keeps violations at or under 1% "
            "on every task and both seeds.", ""]
    out += ["## Full sweep (success / violation / clean per scale)", ""]
    rows = []
    for task, methods in sweep.items():
        for m, runs in methods.items():
            rows.append([task, m] + ["; ".join(f"{r['scale']:g}: {r['success_rate']:.2f} / {r['violation_rate']:.2f}"
                                               f" / {r['clean_success_rate']:.2f}" for r in runs)])
    out.append(md_table(["task", "method", "scale: success / violation / clean"], rows))
    return "\n".join(out)


def recommend(best: dict[str, dict]) -> str | None:
    """The keep-out row the docs recommend: among the re-checked rows with at most 1% violations on every task and
    both seeds, the one whose worst clean success relative to the unguided success (same task and seed) is best."""
    def worst(name: str) -> float:
        ratios = []
        for rows in best.values():
            r, base = rows.get(name), rows.get("none")
            if r is None or base is None or "recheck_violation_rate" not in r or "recheck_success_rate" not in base:
                return -1.0
            if max(r["violation_rate"], r["recheck_violation_rate"]) > 0.01:
                return -1.0
            ratios += [r["clean_success_rate"] / max(base["success_rate"], 1e-9),
                       r["recheck_clean_success_rate"] / max(base["recheck_success_rate"], 1e-9)]
        return min(ratios) if ratios else -1.0
    scored = {name: worst(name) for name in CHECKED}
    name = max(scored, key=lambda n: scored[n])
    return name if scored[name] >= 0 else None


def merged(best: dict, sweep: dict, meta: dict, kind: str, episodes: int,
           source: Demos = Demos()) -> tuple[dict, dict, dict]:
    """This run's rows over those already in guidance.json with the same episodes (a ``--methods`` run adds or
    replaces its methods' rows, a ``--tasks`` run its tasks' rows; the other tasks' rows are kept)."""
    sec = _section(kind, source)
    path = RESULTS / "guidance.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    if old.get(f"{sec}_meta", {}).get("episodes") != episodes:
        return best, sweep, meta
    def renamed(rows: dict) -> dict:  # rows stored before qpos_violation_rate became state_violation_rate
        return {m: r if "state_violation_rate" in r or "qpos_violation_rate" not in r
                else {**r, "state_violation_rate": r["qpos_violation_rate"]} for m, r in rows.items()}
    old_meta = old[f"{sec}_meta"].get("tasks", {})
    tasks = [t for t in KIND_TASKS[kind] if t in best or t in old_meta]
    out_b = {t: {**renamed(old.get(sec, {}).get(t, {})), **best.get(t, {})} for t in tasks}
    out_s = {t: {**old.get(f"{sec}_sweep", {}).get(t, {}), **sweep.get(t, {})} for t in tasks}
    return out_b, out_s, {t: meta.get(t, old_meta.get(t)) for t in tasks}


def save(best: dict, sweep: dict, meta: dict, episodes: int, text: str, kind: str = "joint_limits",
         source: Demos = Demos()) -> None:
    """Merge the "adroit" (or "adroit_keepout", ..."_dart") sections into guidance.json (other sections kept),
    atomically."""
    sec = _section(kind, source)
    merge_json(RESULTS / "guidance.json", {
        sec: {**{t: {m: {k: r.get(k) for k in KEYS + tuple(k for k in r if k.startswith("recheck_"))}
                     for m, r in ms.items()} for t, ms in best.items()},
              **({"recommended": recommend(best)} if kind == "keepout" else {})},
        f"{sec}_sweep": {t: {m: [{k: r.get(k) for k in KEYS} for r in runs] for m, runs in ms.items()}
                         for t, ms in sweep.items()},
        f"{sec}_meta": {"tasks": meta, "episodes": episodes, "seed": SEED, "weight": WEIGHTS[kind],
                        "tol": TOL if kind == "joint_limits" else KeepOut.tol,
                        "dart_noise": source.dart_noise, "detour_demos": source.detours, "train_seed": source.train_seed,
                        "large": source.large,
                        "recheck_seed": RECHECK_SEED,
                        "machine": machine(), "threads": torch.get_num_threads()}})
    md = RESULTS / f"guidance_{sec}.md"
    tmp_md = md.with_suffix(".md.tmp")
    tmp_md.write_text(text)
    os.replace(tmp_md, md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="joint_limits", choices=list(KIND_TASKS))
    ap.add_argument("--tasks", nargs="*", default=None, choices=list(TASKS),
                    help="default: every task of --kind (keepout: door, relocate); the other tasks' stored rows are "
                         "kept")
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--no-write", action="store_true", help="print only; keep the result files")
    ap.add_argument("--dart-noise", type=float, default=0.0,
                    help="> 0: policies trained on DART demos (expert labels, noisy execution), written to the "
                         "'<section>_dart' sections and guidance_<section>_dart.md")
    ap.add_argument("--detours", action="store_true",
                    help="keep-out: policies trained on the expert's demos plus as many detour demos (the expert "
                         "filtered around random balls clear of the evaluation ball, train/detour_demos.py), written "
                         "to the 'adroit_keepout_detours' sections and guidance_adroit_keepout_detours.md")
    ap.add_argument("--train-seed", type=int, default=0,
                    help="keep-out: retrain the policies with this seed (1: the '<section>_train1' sections and "
                         "guidance_adroit_keepout_train1.md / guidance_adroit_keepout_detours_train1.md); checked rows "
                         "run at the scales the seed-0 policies chose")
    ap.add_argument("--large", action="store_true",
                    help=f"keep-out: policies trained on {LARGE[0]} expert demos for {LARGE[1]} steps, written to the "
                         "'adroit_keepout_large' sections and guidance_adroit_keepout_large.md (with --train-seed 1 or 2: "
                         "guidance_adroit_keepout_large_train1.md, guidance_adroit_keepout_large_train2.md)")
    ap.add_argument("--methods", nargs="*", default=(),
                    help="only these configs (default: all); their rows are added to (or replace) those in "
                         "guidance.json when the episode count matches")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    t0 = time.time()
    best, sweep, meta = {}, {}, {}
    tasks = a.tasks or KIND_TASKS[a.kind]
    if a.detours and (a.dart_noise or a.kind != "keepout"):
        ap.error("--detours is for --kind keepout, without --dart-noise")
    if a.large and (a.dart_noise or a.detours or a.kind != "keepout"):
        ap.error("--large is for --kind keepout, without --dart-noise or --detours")
    source = Demos(a.dart_noise, a.detours, a.train_seed, a.large)
    _section(a.kind, source)  # an unknown combination stops here, before any training
    bad = [t for t in tasks if t not in KIND_TASKS[a.kind]]
    if bad:
        ap.error(f"no {a.kind} constraint for {bad}; valid: {KIND_TASKS[a.kind]}")
    known = set(KEEPOUT_CONFIGS if a.kind == "keepout" else CONFIGS) | set(CLIPPED) \
        | (set(CHECKED) if a.kind == "keepout" else set())
    if set(a.methods) - known:
        ap.error(f"unknown --methods {sorted(set(a.methods) - known)}; valid: {sorted(known)}")
    orphans = [m for m in a.methods if m in CLIPPED and CLIPPED[m] not in a.methods]
    if orphans:  # a clipped row runs at its base method's chosen scale, so the base must run too
        ap.error(f"--methods {orphans} need their base method in the same run: add "
                 f"{sorted({CLIPPED[m] for m in orphans})}")
    for task in tasks:
        best[task], sweep[task], meta[task] = run_task(task, a.episodes, kind=a.kind, methods=tuple(a.methods),
                                                       source=source)
    if a.methods or a.tasks:
        best, sweep, meta = merged(best, sweep, meta, a.kind, a.episodes, source)
    tab = keepout_table if a.kind == "keepout" else table
    text = tab(best, meta, sweep, a.episodes) + f"\nTotal wall time {time.time() - t0:.0f} s.\n"
    print(text)
    if not a.no_write:
        save(best, sweep, meta, a.episodes, text, a.kind, source)


if __name__ == "__main__":
    main()
