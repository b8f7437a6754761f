"""Policies that follow the instruction: competent multi-instruction BC first, then the grounding
methods measured where only the instruction says what to do.

Competence: per suite x family (flow, ar, mlp) the ``multitask`` recipe (train/recipes.py) on
random-layout demos of every instruction; success on fresh random layouts with a 95% Wilson CI,
the commanded-vs-completed confusion matrix and the closed-loop learning curve. Ablation (tabletop
flow): how the instruction meets the scene (late vs early fusion, centred language) and the chunk
(H, n_exec), everything else the recipe's. Copycat: how often checkpoints act against the expert
on demo states at the first step (from rest), at turns and elsewhere (policies that read joint
velocities copy their previous motion).

Protocols (train/grounding_eval.py), on the recipe: P1 random layouts, P2 shortcut data (the
layout names the task with probability rho in training; random-layout test), P3 swap, P4
mid-episode switch, P5 unseen paraphrases, for BC, BC + CFG, CIG (continuation, variants),
counterfactual relabeling (extra expert labels: an upper bound) and a training-free dual-branch
contrast. Writes benchmarks/results/grounding.json / .md / _confusion.png after every model, so a
partial run keeps what it measured; trained runs are reused from --runs.

    .venv/bin/python benchmarks/grounding.py --part competence --suites tabletop kitchen
    .venv/bin/python benchmarks/grounding.py --part ablation
    .venv/bin/python benchmarks/grounding.py --part protocols --suites tabletop --families flow
    .venv/bin/python benchmarks/grounding.py --part copycat --suites kitchen --checkpoints NAME=RUN_DIR ...
    .venv/bin/python benchmarks/grounding.py --part recheck --runs runs/g3 --methods bc cig_bounded_joint \
        --seeds 0 1 2 --conditions shortcut --rho 0.9      # more episodes for existing checkpoints
    .venv/bin/python benchmarks/grounding.py --part switch --runs runs/g3 --methods bc relabel \
        --seeds 0 1 2 --conditions random                 # P4 broken down by the state at the switch
    .venv/bin/python benchmarks/grounding.py --part conflict --runs runs/g3 --families ar --methods bc \
        cig_bounded_joint --seeds 2 --conditions shortcut --rho 0.9   # P2 checkpoints: layout vs instruction
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, ROOT, md_table, name_manifest, piece_path, result_path, save_results  # noqa: E402

import torch  # noqa: E402
import tyro  # noqa: E402

import policies  # noqa: E402
from envs.metrics import wilson  # noqa: E402
from train.bc import TrainArgs, train  # noqa: E402
from train.cig import CIGOptions  # noqa: E402
from train.collect import CollectArgs, collect  # noqa: E402
from train.evaluate import evaluate  # noqa: E402
from train.protocols import REACH_NEAR, REACH_STEPS, REACH_TOWARD  # noqa: E402
from train.recipes import recipe_args  # noqa: E402

SUITES = {"tabletop": "maniskill/TabletopSuite-v1", "kitchen": "robosuite/KitchenSuite"}
DEMOS = {"tabletop": 1200, "kitchen": 600}
ABLATION = {  # name -> overrides of the multitask recipe (tabletop, flow)
    "with_velocities": {"ignore_state": ()},
    "late_fusion_H1": {"fusion": "late", "lang_norm": False},
    "early_fusion_H1": {"lang_norm": False},
    "early_fusion_langnorm_H1 (recipe)": {},
    "recipe_H4_exec2": {"horizon": 4, "n_exec": 2},
    "recipe_H16_exec8": {"horizon": 16, "n_exec": 8},
    "late_fusion_H16_exec8 (old default)": {"fusion": "late", "lang_norm": False, "horizon": 16, "n_exec": 8,
                                            "state_hidden": 0, "batch_size": 64, "lr": 3e-4},
}
CIG_RECIPE = recipe_args("multitask_cig").cig
"""every CIG method's options: the ``multitask_cig`` recipe's (``cig_bounded_joint``, the best row), with the
method's variant, mode and suffix and --cig-weight"""
METHODS = ("bc", "bc_continuation", "cig_bounded_continuation", "dual_branch", "relabel", "bc_cfg",
           "cig_detached_continuation", "cig_full_continuation", "cig_pmi_continuation", "bc_2x", "cig_bounded_joint",
           "cig_bounded_joint_early", "cig_bounded_joint_consistent", "cig_full_joint", "cig_detached_joint", "cig_pmi_joint")


@dataclass
class Args:
    part: Literal["competence", "ablation", "protocols", "copycat", "recheck", "switch", "conflict"] = "competence"
    suites: tuple[str, ...] = ("tabletop",)
    families: tuple[str, ...] = ("flow", "ar", "mlp")
    methods: tuple[str, ...] = METHODS
    seeds: tuple[int, ...] = (0,)
    """training seeds (the issue asks for 3; each costs a full training run)"""
    steps: int | None = None
    """training steps (default: the recipe's)"""
    episodes: int = 60
    """competence / ablation evaluation episodes (random layouts, instructions in turn)"""
    curve_every: int = 3000
    curve_episodes: int = 24
    protocol_episodes: int = 24
    swap_seeds: int = 2
    rho: float = 0.9
    """P2: probability that the training layout names the task (the issue asks for 0.5, 0.9, 1.0; one per run)"""
    conditions: tuple[Literal["random", "shortcut"], ...] = ("random", "shortcut")
    """what to train and test: random-layout training with P1/P3/P4/P5 tests, and/or the P2 shortcut data
    (only for --p2-methods); "shortcut" alone adds another rho to existing runs without redoing the rest"""
    ablations: tuple[str, ...] = ()
    """ablation configurations to run (default: all of ABLATION; names up to the first space)"""
    p2_methods: tuple[str, ...] = ("bc", "bc_continuation", "cig_bounded_continuation", "dual_branch")
    """methods also trained on the shortcut data (P2); each costs a training run"""
    cig_steps: int = 2000
    """continuation steps from the BC checkpoint (CIG continuation, and bc_continuation: the same
    extra steps without the CIG term, so every continuation row has equal compute)"""
    cig_weight: float = CIG_RECIPE.weight
    """lambda of every CIG method (L = L_BC + lambda L_CIG); give other values their own --runs and --label"""
    cig_early: float = 0.25
    """``..._early`` CIG methods: the term only on samples in the first this fraction of their demo
    (CIGOptions.max_progress; P4 switches at a third)"""
    cig_radius: float = 1.25
    """``..._consistent`` CIG methods: CIGOptions.demonstrated_radius (no negative the data demonstrates
    at the sample: tasks that share a prefix are not contrasted on it)"""
    relative_state: tuple[str, ...] = ()
    """TrainArgs.relative_state for every run trained from scratch, e.g. '*_cube_pose:extra/tcp_pose'
    '*_goal_pos:extra/tcp_pose' (tabletop positions relative to the gripper; give these runs their own --runs)"""
    label: str = ""
    """suffix of the method names in the results (e.g. '_relative' for runs with --relative-state), so
    they merge beside the plain runs instead of over them"""
    cont_lr: float = 3e-4
    """peak learning rate of continuations (the base run's cosine schedule ended near 0)"""
    recheck_episodes: int = 96
    """recheck part: fresh random-layout episodes per checkpoint (seed 70 000, apart from the protocols');
    switch part: switch cases (seed 80 000); conflict part: episodes per checkpoint (seed 90 000)"""
    relabel_k: int = 2
    dual_weight: float = 1.0
    cfg_scale: float = 2.0
    runs: Path = ROOT / "runs" / "grounding"
    results: str = "grounding"
    """results file stem: grounding is benchmarks/results/grounding.json, any other stem a per-run piece in
    benchmarks/results/runs/ (git-ignored; separate stems let parts run in parallel)"""
    checkpoints: tuple[str, ...] = ()
    """copycat part: NAME=RUN_DIR pairs (each the run of one suite in --suites)"""
    merge: tuple[str, ...] = ()
    """only merge these result stems into --results (and rewrite its table and plot); STEM:SECTION files
    the stem's competence rows under SECTION (e.g. runs at another budget)"""


def _demos(suite: str, n: int, layout: str = "random", rho: float = 1.0) -> Path:
    tag = layout if rho == 1.0 else f"{layout}-rho{rho}"
    path = DATA / f"{suite}_{tag}_{n}.h5"
    if not path.exists():
        collect(CollectArgs(suite=suite, episodes=n, layout=layout, out=path, seed=0, progress=False,
                            env_options={"layout_rho": rho} if rho != 1.0 else {}))
    return path


def _train_args(a: Args, out: Path, recipe: str = "multitask", **kw: Any) -> TrainArgs:
    """What ``_train`` trains: ``recipe`` (train/recipes.py) plus ``kw``, --steps and --relative-state."""
    if a.steps and "steps" not in kw:
        kw["steps"] = a.steps
    if a.relative_state and "init_from" not in kw:
        kw["relative_state"] = a.relative_state
    return recipe_args(recipe, out=out, wandb="disabled", progress=False, save_every=10**9, **kw)


def _train(a: Args, out: Path, recipe: str = "multitask", **kw: Any) -> dict[str, Any]:
    """Train (or reuse a finished run in ``out``) with ``recipe`` plus ``kw``."""
    summary = out / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text())
    if out.exists():  # an unfinished earlier run: start over
        shutil.rmtree(out)
    s = train(_train_args(a, out, recipe, **kw))
    s["train_minutes"] = s["seconds"] / 60
    summary.write_text(json.dumps({k: v for k, v in s.items() if k != "history"}, indent=2, default=str))
    return json.loads(summary.read_text())


def _rate(k: int, n: int) -> dict[str, Any]:
    return {"success": k / max(n, 1), "ci95": list(wilson(k, n)), "episodes": n}


def _p1(policy: Any, suite: str, episodes: int, seed: int = 50_000) -> dict[str, Any]:
    torch.manual_seed(seed)  # the flow sampler's noise: the same evaluation twice gives the same numbers
    res = evaluate(policy, SUITES[suite], episodes, seed=seed, env_options={"layout": "random"}, progress=False)
    d = res.to_dict()
    return {**_rate(res.successes, res.episodes), "did_other_task": d["did_other_task_rate"],
            "confusion": d["confusion"], "per_instruction": {k: v["success_rate"] for k, v in d["per_instruction"].items()}}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(a: Args, res: dict[str, Any]) -> None:
    save_results(a.results, res, _table)
    _plot(res, result_path(a.results, "_confusion.png"))


def competence(a: Args, res: dict[str, Any]) -> None:
    for suite in a.suites:
        data = _demos(suite, DEMOS[suite])
        for fam in a.families:
            for seed in a.seeds:
                out = a.runs / f"{suite}_{fam}_recipe_s{seed}"
                t0 = time.time()
                s = _train(a, out, policy=fam, data=(data,), seed=seed, eval_every=a.curve_every,
                           eval_episodes=a.curve_episodes)
                row = _p1(policies.load(out / "ckpt"), suite, a.episodes)
                row.update(train_minutes=s.get("train_minutes", (time.time() - t0) / 60), recipe="multitask",
                           demos=DEMOS[suite], steps=s["steps"], seed=seed, final_loss=s["final_loss"],
                           learning_curve=s.get("eval_curve", []))
                res.setdefault("competence", {}).setdefault(suite, {})[fam] = row
                print(f"[competence] {suite} {fam}: {row['success']:.2f} {row['ci95']}", flush=True)
                _save(a, res)


def ablation(a: Args, res: dict[str, Any]) -> None:
    data = _demos("tabletop", DEMOS["tabletop"])
    unknown = set(a.ablations) - {n.split(" ")[0] for n in ABLATION}
    if unknown:
        raise SystemExit(f"unknown ablations {sorted(unknown)}; known: {[n.split(' ')[0] for n in ABLATION]}")
    for name, kw in ABLATION.items():
        if a.ablations and name.split(" ")[0] not in a.ablations:
            continue
        out = a.runs / ("ablation_" + name.split(" ")[0])
        s = _train(a, out, policy="flow", data=(data,), **kw)
        row = _p1(policies.load(out / "ckpt"), "tabletop", a.episodes)
        row.update(train_minutes=s.get("train_minutes"), steps=s["steps"], final_loss=s["final_loss"], overrides=kw)
        res.setdefault("ablation", {})[name] = row
        print(f"[ablation] {name}: {row['success']:.2f}", flush=True)
        _save(a, res)


def copycat(a: Args, res: dict[str, Any]) -> None:
    """The copycat signature (a policy that copies its previous motion from the joint velocities
    instead of reading the scene): on demo states, how often the policy's action points against
    the expert's (a dimension where the expert commands |a| > 0.3 in normalized units) where the
    previous motion says nothing or the wrong thing (the first step, from rest; turns, where the
    expert's action changes by more than 0.5 in some dimension) against the other steps."""
    import numpy as np
    from dataset import Dataset
    if len(a.suites) != 1:
        raise SystemExit("--part copycat takes one suite")
    suite = a.suites[0]
    with Dataset(_demos(suite, DEMOS[suite])) as ds:
        eps = [ds.episode(i, images=False) for i in range(0, len(ds), max(1, len(ds) // 120))]
    for item in a.checkpoints:
        name, _, run = item.partition("=")
        pol = policies.load(Path(run) / "ckpt")
        torch.manual_seed(0)
        wrong: dict[str, list[np.ndarray]] = {"first": [], "turns": [], "steady": []}
        for ep in eps:
            with torch.no_grad():
                pred = pol.sample_chunks({"state": ep.state, "instruction": [ep.instruction] * len(ep)})[:, 0]
                want = pol.normalizer.action(torch.as_tensor(ep.action))
            against = ((torch.sign(pred) != torch.sign(want)) & (want.abs() > 0.3)).float().numpy()  # (T, A)
            turn = np.r_[False, (want[1:] - want[:-1]).abs().amax(-1).numpy() > 0.5]
            wrong["first"].append(against[:1])
            wrong["turns"].append(against[1:][turn[1:]])
            wrong["steady"].append(against[1:][~turn[1:]])
        row: dict[str, Any] = {}
        for k, v in wrong.items():
            m = np.concatenate(v)
            row[k] = float(m.any(-1).mean())  # any dimension against the expert
            row[f"{k}_per_dim"] = [round(float(x), 3) for x in m.mean(0)]
        row.update(episodes=len(eps), turn_steps=int(sum(len(v) for v in wrong["turns"])),
                   state_ignore=list(pol.config.state_ignore), run=run)
        res.setdefault("copycat", {}).setdefault(suite, {})[name] = row
        print(f"[copycat] {suite} {name}: against the expert at the first step {row['first']:.2f}, "
              f"at turns {row['turns']:.2f}, elsewhere {row['steady']:.2f}", flush=True)
        _save(a, res)


def protocols(a: Args, res: dict[str, Any]) -> None:
    from policies.dual_branch import DualBranchFlow
    from train.grounding_eval import evaluate_protocols
    from train.relabel import RelabelArgs, relabel
    for suite in a.suites:
        data = _demos(suite, DEMOS[suite])
        shortcut = _demos(suite, DEMOS[suite], layout="correlated", rho=a.rho) \
            if a.p2_methods and "shortcut" in a.conditions else None
        for fam in a.families:
            for method in a.methods:
                for seed in a.seeds:
                    rows = {}
                    conds = ([("random", data)] if "random" in a.conditions else []) + (
                        [(f"rho{a.rho}", shortcut)] if shortcut is not None and method in a.p2_methods else [])
                    if not conds:
                        continue
                    for cond, d in conds:
                        ckpt = _method_ckpt(a, suite, fam, method, seed, cond, d, relabel, RelabelArgs)
                        if ckpt is None:
                            continue
                        pol = policies.load(ckpt)
                        if method == "dual_branch":
                            pol = DualBranchFlow(pol, weight=a.dual_weight)
                        if cond == "random":
                            torch.manual_seed(seed)
                            ev = evaluate_protocols(pol, suite, episodes=a.protocol_episodes, swap_seeds=a.swap_seeds)
                            rows = {k: ev["summary"][k] for k in ev["summary"]}
                        else:
                            p2 = _p1(pol, suite, a.protocol_episodes, seed=60_000)
                            rows[f"p2_rho{a.rho}_success"] = {"rate": p2["success"], "ci95": p2["ci95"], "n": p2["episodes"]}
                            rows[f"p2_rho{a.rho}_did_other_task"] = p2["did_other_task"]
                    key = f"{method}{a.label}_s{seed}"
                    res.setdefault("protocols_raw", {}).setdefault(suite, {}).setdefault(fam, {})[key] = rows
                    _aggregate(res)
                    print(f"[protocols] {suite} {fam} {method} s{seed}: " + json.dumps(
                        {k: round(v["rate"], 2) for k, v in rows.items() if isinstance(v, dict) and "rate" in v}), flush=True)
                    _save(a, res)


def _run_dir(a: Args, suite: str, fam: str, method: str, seed: int, cond: str) -> Path:
    """Where ``method``'s run lives: the BC base run (``bc``, ``dual_branch``) or its own."""
    if method in ("bc", "dual_branch"):
        return a.runs / (f"{suite}_{fam}_recipe_s{seed}" if cond == "random" else f"{suite}_{fam}_{cond}_s{seed}")
    return a.runs / f"{suite}_{fam}_{cond}_{method}_s{seed}"


def _method_ckpt(a: Args, suite: str, fam: str, method: str, seed: int, cond: str, data: Path, relabel, RelabelArgs):
    """Train what ``method`` needs on ``data`` (reusing runs) and return its checkpoint."""
    base = _run_dir(a, suite, fam, "bc", seed, cond)
    if method == "dual_branch" and fam != "flow":
        return None
    if method in ("bc", "dual_branch") or method.endswith("continuation"):  # the others train from scratch
        _train(a, base, policy=fam, data=(data,), seed=seed)
    if method in ("bc", "dual_branch"):
        return base / "ckpt"
    out = _run_dir(a, suite, fam, method, seed, cond)
    cont = dict(init_from=base / "ckpt", steps=a.cig_steps, warmup_steps=0, lr=a.cont_lr)
    if method == "bc_cfg":
        _train(a, out, policy=fam, data=(data,), seed=seed, instruction_dropout=0.1, cfg_scale=a.cfg_scale)
    elif method == "bc_continuation":
        _train(a, out, policy=fam, data=(data,), seed=seed, **cont)
    elif method == "bc_2x":  # twice the recipe's steps: the compute of joint CIG (measured 2.0x BC's time per step)
        _train(a, out, policy=fam, data=(data,), seed=seed, steps=2 * (a.steps or recipe_args("multitask").steps))
    elif method.startswith("cig_"):
        mode, cig = _cig_method(a, method)
        # joint: from scratch with the CIG term all along (the recipe's steps); continuation: from the BC run
        _train(a, out, "multitask_cig", policy=fam, data=(data,), seed=seed, cig=cig,
               **(cont if mode == "continuation" else {}))
    elif method == "relabel":
        rel = DATA / f"{data.stem}_relabel_k{a.relabel_k}.h5"
        if not rel.exists():
            relabel(RelabelArgs(data=data, out=rel, k=a.relabel_k, frames_per_episode=4, horizon=1, progress=False))
        _train(a, out, policy=fam, data=(rel,), seed=seed)
    else:
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")
    return out / "ckpt"


def _cig_method(a: Args, method: str) -> tuple[str, CIGOptions]:
    """(mode, CIG options) of ``cig_<variant>_<joint|continuation>[_early|_consistent]``: ``CIG_RECIPE``
    with the method's variant, --cig-weight, and the suffix's --cig-early or --cig-radius."""
    _, variant, mode, *extra = method.split("_")
    if extra not in ([], ["early"], ["consistent"]):
        raise ValueError(f"unknown CIG method suffix in {method!r}: none, _early or _consistent")
    if mode not in ("continuation", "joint"):
        raise ValueError(f"unknown CIG mode in {method!r}: continuation or joint")
    suffix = {"early": {"max_progress": a.cig_early}, "consistent": {"demonstrated_radius": a.cig_radius}}
    return mode, replace(CIG_RECIPE, weight=a.cig_weight, variant=variant, **suffix.get(extra[0] if extra else "", {}))


def _checkpoints(a: Args, part: str):
    """(suite, family, condition, method, seed, run dir) of every existing protocol checkpoint among
    ``--suites`` x ``--families`` x ``--methods`` x ``--seeds``, trained on the first of
    ``--conditions``; missing ones are named and skipped."""
    cond = "random" if a.conditions[0] == "random" else f"rho{a.rho}"
    for suite in a.suites:
        for fam in a.families:
            for method in a.methods:
                for seed in a.seeds:
                    run = _run_dir(a, suite, fam, method, seed, cond)
                    if not (run / "ckpt").exists():
                        print(f"[{part}] {run} has no checkpoint: skipped", flush=True)
                        continue
                    yield suite, fam, cond, method, seed, run


def recheck(a: Args, res: dict[str, Any]) -> None:
    """Existing protocol checkpoints (``--methods`` x ``--seeds``, trained on the first of
    ``--conditions``) re-evaluated on ``--recheck-episodes`` fresh random layouts (seed 70 000): a
    protocol cell is 24 episodes per seed, too few to tell a 10-point gain from evaluation noise."""
    for suite, fam, cond, method, seed, run in _checkpoints(a, "recheck"):
        r = _p1(policies.load(run / "ckpt"), suite, a.recheck_episodes, seed=70_000)
        res.setdefault("recheck", {}).setdefault(suite, {}).setdefault(fam, {}).setdefault(cond, {})[
            f"{method}{a.label}_s{seed}"] = {k: r[k] for k in ("success", "ci95", "episodes", "did_other_task")} | {
            "run": str(run.relative_to(ROOT)) if run.is_relative_to(ROOT) else str(run)}
        print(f"[recheck] {suite} {fam} {cond} {method} s{seed}: {r['success']:.2f}", flush=True)
        _save(a, res)


def switch(a: Args, res: dict[str, Any]) -> None:
    """P4 on more cases (``--recheck-episodes``, seed 80 000), each switch filed by what the
    gripper held when the command changed and by the old task's family: where a method's switches
    fail says whether P4 asks for grounding (acting on the new command at all) or for coverage (acting
    well from states no demonstration of the new task passes through, e.g. another cube in hand)."""
    from train.protocols import switch_cases, switch_eval
    cases: dict[str, list] = {}
    for suite, fam, cond, method, seed, run in _checkpoints(a, "switch"):
        if suite not in cases:
            cases[suite] = switch_cases(SUITES[suite], episodes=a.recheck_episodes, seed=80_000, progress=True)
        torch.manual_seed(seed)
        ev = switch_eval(policies.load(run / "ckpt"), SUITES[suite], cases=cases[suite])
        groups = _switch_groups(ev["per_case"])
        res.setdefault("switch", {}).setdefault(suite, {}).setdefault(fam, {}).setdefault(cond, {})[
            f"{method}{a.label}_s{seed}"] = {
            "success": ev["switch_success_rate"], "ci95": ev["ci95"], "episodes": ev["episodes"],
            "old_task_completed": ev["old_task_completed_rate"], "did_other_task": ev["did_other_task_rate"],
            "groups": {g: {"successes": k, "episodes": n} for g, (k, n) in sorted(groups.items())},
            "per_case": ev["per_case"]}
        print(f"[switch] {suite} {fam} {cond} {method} s{seed}: {ev['switch_success_rate']:.2f} " +
              json.dumps({g: f"{k}/{n}" for g, (k, n) in sorted(groups.items())}), flush=True)
        _save(a, res)


def conflict(a: Args, res: dict[str, Any]) -> None:
    """P2 checkpoints (trained where the layout names the task) on the correlated layout of another
    task while one is commanded, next to their own layouts (train/protocols.py
    ``layout_conflict_eval``): says whether a P2 failure is the shortcut (the layout's task done
    instead) or the random test layouts themselves (nothing done)."""
    from train.protocols import layout_conflict_eval
    if a.conditions[0] != "shortcut":
        raise SystemExit("--part conflict tests checkpoints trained on the shortcut data: pass --conditions shortcut")
    for suite, fam, cond, method, seed, run in _checkpoints(a, "conflict"):
        ev = layout_conflict_eval(policies.load(run / "ckpt"), SUITES[suite], episodes=a.recheck_episodes, seed=90_000)
        res.setdefault("conflict", {}).setdefault(suite, {}).setdefault(fam, {}).setdefault(cond, {})[
            f"{method}{a.label}_s{seed}"] = {k: ev[k] for k in ("conflict", "in_distribution", "random", "episodes")}
        c, i, r = ev["conflict"], ev["in_distribution"], ev["random"]
        print(f"[conflict] {suite} {fam} {cond} {method} s{seed}: conflict {c['success_rate']:.2f} "
              f"(layout's task {c['did_layout_task_rate']:.2f}), own layouts {i['success_rate']:.2f}, random layouts "
              f"{r['success_rate']:.2f}; failures by what the gripper went for first: conflict "
              f"{c['failures_approached_first']}, random {r['failures_approached_first']}", flush=True)
        _save(a, res)


def _conflict_table(cf: dict[str, Any]) -> list[str]:
    if not cf:
        return []
    rows = []
    for su, fams in cf.items():
        for fa, conds in fams.items():
            for cond, keys in conds.items():
                for key, r in sorted(keys.items()):
                    c, i = r["conflict"], r["in_distribution"]
                    by = c.get("by_layout_object", {})
                    split = [f"{v['successes']}/{v['episodes']}" for v in (by.get("commanded object"), by.get("another object"))
                             if v] or ["-", "-"]
                    rows.append([su, fa, cond, key, f"{i['success_rate']:.2f} [{i['ci95'][0]:.2f}, {i['ci95'][1]:.2f}]",
                                 f"{c['success_rate']:.2f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]", *split,
                                 f"{c['did_layout_task_rate']:.2f}", f"{c['did_other_task_rate']:.2f}",
                                 f"{1 - c['success_rate'] - c['did_layout_task_rate'] - c['did_other_task_rate']:.2f}",
                                 r["episodes"]])
    return ["## Layout conflict: P2 checkpoints on the layout of another task (conflict part, seed 90 000)", "",
            "Own layouts: the commanded task's correlated layout (the training distribution). Conflict: the same seeds "
            "and instructions on the correlated layout of another task: a policy that follows the layout does the "
            "layout's task (at any step); one torn between the two does nothing. The conflict layouts cycle through "
            "the other tasks: some put the commanded object first (the layout names another task on it), the others "
            "another object.", "",
            md_table(["suite", "policy", "trained on", "method_seed", "own layouts [95% CI]", "conflict [95% CI]",
                      "conflict, layout on the commanded object", "conflict, layout on another object",
                      "did the layout's task", "did another task", "nothing done", "episodes"], rows), ""] + _approach_table(cf)


def _approach_table(cf: dict[str, Any]) -> list[str]:
    """Failures split by the object the gripper went for first (``approached_first``, runs of the
    conflict part since it records them)."""
    rows = []
    for su, fams in cf.items():
        for fa, conds in fams.items():
            for cond, keys in conds.items():
                for key, r in sorted(keys.items()):
                    for scene in ("random", "conflict"):
                        c = r.get(scene, {})
                        if "failures_approached_first" not in c:
                            continue
                        f, w = c["failures_approached_first"], c["approached_first"]
                        n = sum(f.values())
                        sl = c.get("by_commanded_slot", {})
                        rows.append([su, fa, cond, key, scene, f"{c['success_rate']:.2f}",
                                     f"{w['commanded']}/{sum(w.values())}", n,
                                     *(f"{f[k]}" if scene == "conflict" or k != "layout's" else "-"
                                       for k in ("commanded", "layout's", "another", "none")),
                                     " / ".join(f"{v['successes']}/{v['episodes']}" for _, v in sorted(sl.items()))
                                     if scene == "random" and sl else "-"])
    if not rows:
        return []
    return ["## What the gripper went for first (conflict part, seed 90 000)", "",
            "The first object whose centre the gripper's centre came within 5 cm of (a successful push comes within "
            "3-4.7 cm). A failure at the commanded object is one of execution; one at another object, of grounding "
            "(what CIG can act on). Random: the same seeds and instructions on random layouts, P2's test scenes; "
            "their successes split by the slot the commanded cube starts in (0 nearest the robot: where every "
            "correlated layout, 90% of the rho 0.9 training episodes, puts it).", "",
            md_table(["suite", "policy", "trained on", "method_seed", "scenes", "success", "went for the commanded "
                      "object first (all episodes)", "failures", "failures: commanded object first",
                      "failures: the layout's object first", "failures: another object first", "failures: no object",
                      "random: successes with the commanded cube in slot 0 / 1 / 2"],
                     rows), ""]


def _switch_groups(per_case: list[dict[str, Any]]) -> dict[str, list[int]]:
    """[successes, switches] of the counted cases per group: what the gripper held at the switch,
    and the old task's family."""
    groups: dict[str, list[int]] = {}
    for p in (p for p in per_case if p["counted"]):
        held = {True: "object in hand", False: "hand empty", None: "not reported"}[p["held_at_switch"]]
        for g in (f"at switch: {held}", f"old task: {p['old_family']}"):
            acc = groups.setdefault(g, [0, 0])
            acc[0] += bool(p["success"])
            acc[1] += 1
    return groups


def _method_seed(key: str) -> tuple[str, int]:
    """``bc_s2`` -> ("bc", 2); a key without a seed suffix (older single-seed runs) is seed 0."""
    head, _, tail = key.rpartition("_s")
    return (head, int(tail)) if head and tail.isdigit() else (key, 0)


def _aggregate(res: dict[str, Any]) -> None:
    """The issue's schema: protocols -> P -> suite -> family -> method -> {success, ci95, seeds,
    seed_sd, per_seed, episodes, in_distribution}. success is the mean over training seeds, ci95 the
    Wilson interval of the pooled episodes, seed_sd the spread between seeds; in_distribution is
    the P1 success (random-layout training and test) of the same method, seed mean."""
    import numpy as np
    out: dict[str, Any] = {}
    names = {"P1": "p1_success", "P3": "p3_swap", "P4": "p4_switch", "P5": "p5_paraphrase"}
    for suite, fams in res.get("protocols_raw", {}).items():
        for fam, methods in fams.items():
            by_method: dict[str, dict[int, dict[str, Any]]] = {}
            for key, rows in methods.items():
                m, seed = _method_seed(key)
                if "p2_success" in rows:  # results written before P2 rows were keyed by rho (all rho 0.9)
                    rows["p2_rho0.9_success"] = rows.pop("p2_success")
                    rows["p2_rho0.9_did_other_task"] = rows.pop("p2_did_other_task", None)
                by_method.setdefault(m, {})[seed] = rows
                names.update({f"P2_rho{k[6:-8]}": k for k in rows if k.startswith("p2_rho") and k.endswith("_success")})
            for m, seeds in by_method.items():
                p1 = [r["p1_success"]["rate"] for r in seeds.values() if "p1_success" in r]
                for p, k in names.items():
                    got = {sd: r[k] for sd, r in sorted(seeds.items()) if k in r}
                    if not got:
                        continue
                    rates = [v["rate"] for v in got.values()]
                    hits = sum(round(v["rate"] * v["n"]) for v in got.values())
                    n = sum(v["n"] for v in got.values())
                    out.setdefault(p, {}).setdefault(suite, {}).setdefault(fam, {})[m] = {
                        "success": float(np.mean(rates)), "ci95": list(wilson(hits, n)), "seeds": len(got),
                        "seed_sd": float(np.std(rates, ddof=1)) if len(rates) > 1 else None,
                        "per_seed": {str(sd): v["rate"] for sd, v in got.items()}, "episodes": n,
                        "in_distribution": float(np.mean(p1)) if p1 else None}
    res["protocols"] = out


def _deep_update(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict) and k not in ("confusion",):
            _deep_update(dst[k], v)
        else:
            dst[k] = v


def _table(res: dict[str, Any]) -> str:
    lines = ["# Grounding benchmark", ""]
    comp = res.get("competence", {})
    if comp:
        lines += ["## Competence: multitask recipe, random layouts, every instruction", ""]
        rows = []
        for suite, fams in comp.items():
            for fam, r in fams.items():
                curve = " ".join(f"{c['step'] // 1000}k:{c['success_rate']:.2f}" for c in r.get("learning_curve", []))
                rows.append([suite, fam, f"{r['success']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]", r["episodes"],
                             f"{r['did_other_task']:.2f}", r.get("demos"), r.get("steps"), f"{r['train_minutes']:.1f}", curve])
        lines += [md_table(["suite", "policy", "success [95% CI]", "episodes", "did another task", "demos", "steps",
                            "train min", "learning curve (step: success)"], rows), ""]
        for suite, fams in comp.items():
            for fam, r in fams.items():
                lines += [f"Per instruction, {suite} {fam}: " + ", ".join(
                    f"{k}: {v:.2f}" for k, v in sorted(r.get("per_instruction", {}).items())), ""]
    for sec in sorted(k for k in res if k.startswith("competence_")):
        lines += [f"## {sec}: the recipe at another budget or with one setting changed", ""]
        lines += [md_table(["suite", "policy", "success [95% CI]", "episodes", "steps", "train min", "learning curve"], [
            [suite, fam, f"{r['success']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]", r["episodes"], r.get("steps"),
             f"{r['train_minutes']:.1f}",
             " ".join(f"{c['step'] // 1000}k:{c['success_rate']:.2f}" for c in r.get("learning_curve", []))]
            for suite, fams in res[sec].items() for fam, r in fams.items()]), ""]
    abl = res.get("ablation", {})
    if abl:
        lines += ["## Ablation (tabletop, flow, 12 instructions, random layouts)", ""]
        lines += [md_table(["configuration", "success [95% CI]", "did another task", "final loss", "train min"], [
            [k, f"{r['success']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]", f"{r['did_other_task']:.2f}",
             f"{r['final_loss']:.4f}", f"{(r.get('train_minutes') or 0):.1f}"] for k, r in abl.items()]), ""]
    cc = res.get("copycat", {})
    if cc:
        lines += ["## Copycat signature: actions against the expert's on demo states", ""]
        lines += ["Share of demo steps where some action dimension points against the expert's (|expert| > 0.3, "
                  "normalized): the first step (from rest), turns (the expert's action changes by > 0.5 in a "
                  "dimension) and the other steps; then the first step per action dimension.", ""]
        lines += [md_table(["suite", "policy", "reads joint velocities", "first step", "turns", "other steps",
                            "first step per dimension", "episodes (turn steps)"], [
            [su, name, "no" if r["state_ignore"] else "yes", f"{r['first']:.2f}", f"{r['turns']:.2f}",
             f"{r['steady']:.2f}", " ".join(f"{x:.2f}" for x in r["first_per_dim"]),
             f"{r['episodes']} ({r['turn_steps']})"] for su, rows in cc.items() for name, r in rows.items()]), ""]
    agg = res.get("protocols", {})
    if agg:
        ps = ["P1"] + sorted((p for p in agg if p.startswith("P2_rho")), key=lambda p: float(p[6:])) + ["P3", "P4", "P5"]
        lines += ["## Protocols (random-layout tests; P2 trained where the layout names the task with probability rho)", "",
                  "Mean over training seeds, ± the seed standard deviation, [95% Wilson CI of the pooled episodes];",
                  "P1 is also the in-distribution figure (random-layout training and test).", ""]
        rows = []
        combos = {(su, fa, m) for p in ps for su, fams in agg.get(p, {}).items() for fa, ms in fams.items() for m in ms}
        order = {m: i for i, m in enumerate(METHODS)}
        for su, fa, m in sorted(combos, key=lambda c: (c[0], c[1], order.get(c[2], 99), c[2])):
            cells, seeds = [], set()
            for p in ps:
                r = agg.get(p, {}).get(su, {}).get(fa, {}).get(m)
                if r is None:
                    cells.append("-")
                    continue
                seeds.add(r["seeds"])
                sd = f" ±{r['seed_sd']:.2f}" if r.get("seed_sd") is not None else ""
                cells.append(f"{r['success']:.2f}{sd} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]")
            rows.append([su, fa, m, "/".join(str(x) for x in sorted(seeds))] + cells)
        lines += [md_table(["suite", "policy", "method", "seeds"] + [
            {"P3": "P3 swap", "P4": "P4 switch", "P5": "P5 paraphrase"}.get(p, p.replace("_rho", " (rho ") + (")" if "rho" in p else ""))
            for p in ps], rows), ""]
    rc = res.get("recheck", {})
    if rc:
        lines += ["## Recheck: protocol checkpoints on more fresh random layouts (seed 70 000)", ""]
        rows = [[su, fa, cond, key, f"{r['success']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]", r["episodes"],
                 f"{r['did_other_task']:.2f}"]
                for su, fams in rc.items() for fa, conds in fams.items() for cond, keys in conds.items()
                for key, r in sorted(keys.items())]
        lines += [md_table(["suite", "policy", "trained on", "method_seed", "success [95% CI]", "episodes",
                            "did another task"], rows), ""]
    lines += _switch_table(res.get("switch", {}))
    lines += _conflict_table(res.get("conflict", {}))
    lines += [f"Machine: {res.get('machine')}", ""]
    return "\n".join(lines)


def _switch_table(sw: dict[str, Any]) -> list[str]:
    """P4 per method pooled over seeds, split by the old task's family and by what the gripper
    held at the switch, with how the failures ended; one table per suite (its own families)."""
    if not sw:
        return []
    import numpy as np
    lines = ["## P4 broken down: where mid-episode switches fail (switch part, seed 80 000)", "",
             "Pooled over training seeds: successes / switches per group; failures split into those where no task "
             "was completed and those where some other task was.", ""]
    order = {m: i for i, m in enumerate(METHODS)}
    for su, fams in sw.items():
        rows = []
        every = [p for conds in fams.values() for keys in conds.values() for r in keys.values()
                 for p in r["per_case"] if p["counted"]]
        families = sorted({p["old_family"] for p in every})
        reach = any(p.get("reach") for p in every)
        for fa, conds in fams.items():
            for cond, keys in conds.items():
                by: dict[str, list[tuple[int, dict[str, Any]]]] = {}
                for key, r in keys.items():
                    m, seed = _method_seed(key)
                    by.setdefault(m, []).append((seed, r))
                for m in sorted(by, key=lambda m: (order.get(m, 99), m)):
                    runs = [r for _, r in sorted(by[m], key=lambda x: x[0])]
                    rates = [r["success"] for r in runs]
                    k, n = sum(r["success"] * r["episodes"] for r in runs), sum(r["episodes"] for r in runs)
                    lo, hi = wilson(int(round(k)), n)
                    cases = [p for r in runs for p in r["per_case"]]
                    groups = _switch_groups(cases)
                    failed = [p for p in cases if p["counted"] and not p["success"]]
                    other = sum(bool(p["other_task"] or p["old_completed"]) for p in failed)

                    def cell(g: str) -> str:
                        kk, nn = groups.get(g, (0, 0))
                        return f"{kk}/{nn} ({kk / nn:.2f})" if nn else "-"
                    rows.append([fa, cond, m, len(runs), f"{np.mean(rates):.2f} ±{np.std(rates, ddof=1) if len(rates) > 1 else 0:.2f} "
                                 f"[{lo:.2f}, {hi:.2f}]", " / ".join(f"{x:.2f}" for x in rates)]
                                + [cell(f"old task: {f}") for f in families]
                                + [cell("at switch: object in hand"), cell("at switch: hand empty"),
                                   f"{len(failed) - other} / {other}"] + (_reach_cells(cases) if reach else []))
        lines += [f"### {su}", "", md_table(
            ["policy", "trained on", "method", "seeds", "P4 [95% CI]", "per seed"]
            + [f"old task {f}" for f in families]
            + ["object in hand at switch", "hand empty at switch", "failures: nothing done / a task done"]
            + ([f"{REACH_STEPS} steps on: at the old object (< {REACH_NEAR * 100:.1f} cm)",
                f"{REACH_STEPS} steps on: {REACH_TOWARD * 100:.0f} cm closer to the new one"] if reach else []), rows), ""]
    return lines


def _reach_cells(cases: list[dict[str, Any]]) -> list[str]:
    """Where the gripper headed after the switch (envs that report it): counts over counted cases."""
    r = [p["reach"] for p in cases if p["counted"] and p.get("reach")]
    return [f"{sum(x[k] for x in r)}/{len(r)} ({sum(x[k] for x in r) / len(r):.2f})" if r else "-"
            for k in ("went_to_old", "toward_new")]


def _plot(res: dict[str, Any], path: Path) -> None:
    comp = [(s, f, r) for s, fams in res.get("competence", {}).items() for f, r in fams.items() if r.get("confusion")]
    if not comp:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, len(comp), figsize=(5.2 * len(comp), 5), squeeze=False)
    for ax, (suite, fam, r) in zip(axes[0], comp):
        rows = sorted(r["confusion"])
        cols = rows + ["none"]
        m = np.array([[r["confusion"][i].get(c, 0) for c in cols] for i in rows], float)
        m /= m.sum(1, keepdims=True).clip(min=1)
        ax.imshow(m, vmin=0, vmax=1, cmap="Blues")
        short = [c.replace("the ", "").replace(" cube", "").replace("push ", "").replace(" goal", "") for c in cols]
        ax.set_xticks(range(len(cols)), short, rotation=90, fontsize=6)
        ax.set_yticks(range(len(rows)), short[:-1], fontsize=6)
        ax.set_title(f"{suite} {fam}: {r['success']:.2f}", fontsize=9)
        ax.set_xlabel("what the episode ended with", fontsize=7)
        ax.set_ylabel("commanded", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    a = tyro.cli(Args)
    bad = [s for s in a.suites if s not in SUITES]
    if bad:
        raise SystemExit(f"unknown suites {bad}; known: {list(SUITES)}")
    if not a.cig_weight > 0:
        raise SystemExit(f"--cig-weight must be > 0 (got {a.cig_weight}); a CIG method without its term is bc")
    res = _load(piece_path(a.results))
    if a.merge or "--merge" in sys.argv:  # "--merge" alone: rewrite the table and plot from --results
        for item in a.merge:  # STEM, or STEM:SECTION to file a stem's competence under another section
            stem, _, section = item.partition(":")
            for key, part in _load(piece_path(stem)).items():
                if isinstance(part, dict) and key != "machine":
                    _deep_update(res.setdefault(section if (section and key == "competence") else key, {}), part)
        name_manifest(a.results, res)
        _aggregate(res)
        return _save(a, res)
    {"competence": competence, "ablation": ablation, "protocols": protocols, "copycat": copycat,
     "recheck": recheck, "switch": switch, "conflict": conflict}[a.part](a, res)


if __name__ == "__main__":
    main()
