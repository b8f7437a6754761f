"""Does the policy listen? BC vs BC+CFG vs BC+CIG (continuation) vs CIG joint, flow and AR, on
the multi-instruction suites, trained where the layout predicts the task (layout="correlated").

Per suite x policy x method: instruction-swap success (same initial state, every instruction,
random layout), correlated-split success (trained correlated, tested random), in-distribution
success (correlated), perturbation success per family (train/protocols.py), identification
accuracy on held-out random-layout demos, action sensitivity, and training cost relative to BC.
Writes benchmarks/results/cig.json, cig.md and cig_collapse.png (the collapse curve of each
method), after every finished model, so a partial run keeps what it measured.

    .venv/bin/python benchmarks/cig.py                              # both suites, both families
    .venv/bin/python benchmarks/cig.py --suites tabletop --policies flow --quick
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, ROOT, machine, md_table, piece_path, result_path  # noqa: E402

import tyro  # noqa: E402

import policies  # noqa: E402
from train.bc import TrainArgs, train  # noqa: E402
from train.cig import CIGOptions  # noqa: E402
from train.collect import CollectArgs, collect  # noqa: E402
from train.data import ChunkData  # noqa: E402
from train.diagnose import diagnose, plot  # noqa: E402
from train.protocols import correlated_split_eval, perturbation_eval, swap_eval  # noqa: E402

PUSH6 = tuple(f"push the {c} cube to the {g} goal" for c in ("red", "green", "blue") for g in ("left", "right"))
SUITES: dict[str, dict[str, Any]] = {
    # the six push tasks: all feasible from every initial state, one skill, the layout says which
    # BC steps per policy family: the same for every method of a family (AR steps cost ~4x flow's)
    "tabletop": {"env": "maniskill/TabletopSuite-v1", "instructions": PUSH6, "demos": 240,
                 "bc_steps": {"flow": 6000, "ar": 3000}},
    "kitchen": {"env": "robosuite/KitchenSuite", "instructions": (), "demos": 60,
                "bc_steps": {"flow": 3000, "ar": 2000}},
}
METHODS = ("bc", "bc_cfg", "cig_continuation", "cig_joint")
STATE_FAMILIES = ("paraphrase", "sensor_noise", "layout", "robot_init", "camera", "lighting")


@dataclass
class Args:
    suites: tuple[str, ...] = tuple(SUITES)
    policies: tuple[str, ...] = ("flow", "ar")
    methods: tuple[str, ...] = METHODS
    cig: CIGOptions = field(default_factory=lambda: CIGOptions(weight=1.0, negatives=3, draws=2, variant="full"))
    """CIG options of both CIG methods (the joint run also sets --cig.batch)"""
    cig_steps: int = 1000
    """continuation stage length (steps on top of the BC checkpoint)"""
    extra_variants: tuple[str, ...] = ()
    """also run the continuation with these CIG variants (as METHOD cig_continuation_<variant>)"""
    joint_cig_batch: int = 16
    """joint run: samples per batch that get the CIG term"""
    cfg_dropout: float = 0.1
    cfg_scale: float = 2.0
    swap_seeds: int = 4
    split_episodes: int = 24
    perturbation_episodes: int = 12
    heldout_demos: int = 24
    seed: int = 0
    quick: bool = False
    """tiny budgets, for a smoke run (numbers meaningless)"""
    results: str = "cig"
    """results file stem: cig is benchmarks/results/cig.json, any other stem a per-run piece in
    benchmarks/results/runs/ (git-ignored; separate stems let runs go in parallel)"""
    merge: tuple[str, ...] = ()
    """only merge the suites of these result stems into --results and rewrite its table and plot"""


def _collect(suite: str, n: int, layout: str, seed: int, instructions: tuple[str, ...]) -> Path:
    key = hashlib.sha1(json.dumps([suite, n, layout, seed, instructions]).encode()).hexdigest()[:10]
    path = DATA / f"cig_{suite}_{layout}_{n}_s{seed}_{key}.h5"
    if not path.exists():
        collect(CollectArgs(env=SUITES[suite]["env"], episodes=n, out=path, seed=seed, layout=layout,
                            instructions=instructions, progress=False))
    return path


def _train(a: Args, kind: str, method: str, data: Path, steps: int, out: Path, bc_ckpt: Path | None) -> dict:
    if (out / "ckpt").exists() and (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    common = dict(data=(data,), policy=kind, out=out, wandb="disabled", progress=False, seed=a.seed)
    if method == "bc":
        args = TrainArgs(steps=steps, **common)
    elif method == "bc_cfg":
        args = TrainArgs(steps=steps, instruction_dropout=a.cfg_dropout, cfg_scale=a.cfg_scale, **common)
    elif method.startswith("cig_continuation"):
        variant = method.removeprefix("cig_continuation").lstrip("_") or a.cig.variant
        args = TrainArgs(steps=a.cig_steps, init_from=bc_ckpt, lr=1e-4, warmup_steps=50,
                         cig=CIGOptions(**{**a.cig.__dict__, "variant": variant}), **common)
    else:
        args = TrainArgs(steps=steps, cig=CIGOptions(**{**a.cig.__dict__, "batch": a.joint_cig_batch}), **common)
    return train(args)


def _evaluate(a: Args, pol: Any, suite: str, held: Path) -> dict[str, Any]:
    env_id, instrs = SUITES[suite]["env"], list(SUITES[suite]["instructions"]) or None
    base = 50_000 + a.seed * 1000
    swap = swap_eval(pol, env_id, list(range(base, base + a.swap_seeds)), instructions=instrs,
                     env_options={"layout": "random"})
    split = correlated_split_eval(pol, env_id, a.split_episodes, seed=base + 100, instructions=instrs)
    pert = perturbation_eval(pol, env_id, STATE_FAMILIES, a.perturbation_episodes, seed=base + 200,
                             env_options={"layout": "random"}, instructions=instrs, clean=False)
    d = diagnose(pol, ChunkData([held], horizon=pol.config.horizon), n=256, seed=a.seed)
    return {
        "swap_success": swap["swap_success_rate"], "swap_ci95": swap["ci95"],
        "swap_did_other_task": swap["did_other_task_rate"],
        "correlated_success": split["split"]["success_rate"], "correlated_ci95": split["split"]["ci95"],
        "in_distribution_success": split["in_distribution"]["success_rate"],
        "in_distribution_ci95": split["in_distribution"]["ci95"],
        "identification_accuracy": d["identification_accuracy"], "action_sensitivity": d["action_sensitivity"],
        "perturbation_success": {f: (None if r.get("skipped") else r["success_rate"])
                                 for f, r in pert["families"].items()},
        "perturbation_skipped": {f: r["reason"] for f, r in pert["families"].items() if r.get("skipped")},
        "collapse_curve": d["collapse_curve"], "episodes": {"swap": swap["episodes"],
                                                            "split": a.split_episodes,
                                                            "perturbation": a.perturbation_episodes},
    }


def main() -> None:
    a = tyro.cli(Args)
    if a.quick:
        a.cig_steps, a.swap_seeds, a.split_episodes, a.perturbation_episodes, a.heldout_demos = 20, 1, 2, 1, 4
    for s in a.suites:
        if s not in SUITES:
            raise SystemExit(f"unknown suite {s!r}; valid: {list(SUITES)}")
    path = result_path("cig_quick" if a.quick else a.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    src = piece_path(path.stem)  # a piece written before benchmarks/results/runs/ resumes from where it was
    res = json.loads(src.read_text()) if src.exists() else {}
    res.setdefault("suites", {})
    if a.merge:
        for stem in a.merge:
            other = json.loads(piece_path(stem).read_text())
            for suite, by_kind in other["suites"].items():
                for kind, by_m in by_kind.items():
                    res["suites"].setdefault(suite, {}).setdefault(kind, {}).update(by_m)
            res.setdefault("meta", other.get("meta", {}))
        _write(res, path)
        return
    res["meta"] = {"machine": machine(), "cig": a.cig.__dict__, "cig_steps": a.cig_steps,
                   "joint_cig_batch": a.joint_cig_batch, "cfg": [a.cfg_dropout, a.cfg_scale],
                   "swap_seeds": a.swap_seeds, "split_episodes": a.split_episodes,
                   "perturbation_episodes": a.perturbation_episodes, "suites": {k: {kk: v for kk, v in c.items()}
                                                                                 for k, c in SUITES.items()}}
    for suite in a.suites:
        cfg = SUITES[suite]
        n = 24 if a.quick else cfg["demos"]
        data = _collect(suite, n, "correlated", a.seed, cfg["instructions"])
        held = _collect(suite, a.heldout_demos, "random", a.seed + 90_000, cfg["instructions"])
        for kind in a.policies:
            root = ROOT / "runs" / "bench_cig" / f"{suite}_{kind}{'_quick' if a.quick else ''}"
            out_k = res["suites"].setdefault(suite, {}).setdefault(kind, {})
            bc_secs = None
            steps = 60 if a.quick else cfg["bc_steps"][kind]
            methods = list(a.methods) + [f"cig_continuation_{v}" for v in a.extra_variants]
            for method in methods:
                out = root / method
                t = time.time()
                s = _train(a, kind, method, data, steps, out, root / "bc" / "ckpt")
                secs = s.get("seconds", time.time() - t)
                if method == "bc":
                    bc_secs = secs
                pol = policies.load(out / "ckpt")
                r = _evaluate(a, pol, suite, held)
                total = secs + (bc_secs if method.startswith("cig_continuation") and bc_secs else 0)
                r.update(train_seconds=secs, train_steps=s["steps"],
                         training_cost_ratio=(total / bc_secs) if bc_secs else None)
                out_k[method] = r
                print(f"{suite} {kind} {method}: swap {r['swap_success']:.2f} split {r['correlated_success']:.2f} "
                      f"in-dist {r['in_distribution_success']:.2f} id-acc {r['identification_accuracy']:.2f}", flush=True)
                _write(res, path)


def _write(res: dict, path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=2))
    os.replace(tmp, path)
    rows, fams = [], list(STATE_FAMILIES)
    for suite, by_kind in res["suites"].items():
        for kind, by_m in by_kind.items():
            for m, r in by_m.items():
                ps = r["perturbation_success"]
                rows.append([suite, kind, m, f"{r['swap_success']:.2f} [{r['swap_ci95'][0]:.2f}, {r['swap_ci95'][1]:.2f}]",
                             f"{r['swap_did_other_task']:.2f}", f"{r['correlated_success']:.2f}",
                             f"{r['in_distribution_success']:.2f}", f"{r['identification_accuracy']:.2f}",
                             f"{r['action_sensitivity']:.2f}",
                             *[("-" if ps.get(f) is None else f"{ps[f]:.2f}") for f in fams],
                             "-" if r["training_cost_ratio"] is None else f"{r['training_cost_ratio']:.1f}"])
    table = md_table(["suite", "policy", "method", "swap success [95% CI]", "swap: other task", "correlated split",
                      "in distribution", "id acc", "sensitivity", *fams, "train cost vs BC"], rows)
    table += f"\nSettings: {json.dumps({k: v for k, v in res['meta'].items() if k not in ('machine', 'suites')})}\n"
    (path.with_suffix(".md")).write_text(table)
    curves = {f"{s}/{k}/{m}": {"collapse_curve": r["collapse_curve"], "identification_accuracy": r["identification_accuracy"],
                               "action_sensitivity": r["action_sensitivity"]}
              for s, bk in res["suites"].items() for k, bm in bk.items() for m, r in bm.items()}
    if curves:
        plot(dict(list(curves.items())[:8]), path.with_name(path.stem + "_collapse.png"))


if __name__ == "__main__":
    main()
