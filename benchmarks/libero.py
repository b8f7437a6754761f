"""LIBERO-Goal in groundflow: scripted experts, then policies trained on their demos.

Parts (each adds its section to ``benchmarks/results/<results>.json`` and rewrites the table):

- ``experts``: every task's scripted expert from LIBERO's own 50 init states (layout "task").
- ``policies``: demos from fresh placements (layout "sampled", so no evaluation init state is
  trained on), flow BC with the multitask recipe, then the CIG continuation of the grounding
  benchmark (bounded, equal-compute BC continuation beside it); each evaluated per task on
  LIBERO's init states (LIBERO's protocol), success and "did another task".
- ``perturbations``: the policies under ``envs/perturbations.py`` families that apply to state
  observations (paraphrase, layout, robot initial pose, sensor noise).

    .venv/bin/python benchmarks/libero.py --part experts
    .venv/bin/python benchmarks/libero.py --part policies --episodes-per-task 20
    .venv/bin/python benchmarks/libero.py --part perturbations --episodes-per-task 10
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, ROOT, load_results, md_table, name_manifest, piece_path, save_results  # noqa: E402

# this file's name would shadow the libero package: take its folder (Python puts it first) off the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402
from tqdm import tqdm  # noqa: E402

import envs  # noqa: E402
from envs.metrics import wilson  # noqa: E402

SUITE = "libero/GoalSuite"
N_TASKS = 10


@dataclass
class Args:
    part: Literal["experts", "policies", "perturbations"] = "experts"
    tasks: tuple[int, ...] = tuple(range(N_TASKS))
    episodes_per_task: int = 50
    """evaluation episodes per task: init states 0..N-1 of the task (LIBERO has 50)"""
    demos_per_task: int = 50
    """expert demos per task (LIBERO ships 50 human demos per task; ours are scripted)"""
    methods: tuple[str, ...] = ("bc", "bc_continuation", "cig_bounded_continuation")
    seed: int = 0
    data: tuple[Path, ...] = ()
    """demo files to train on instead of collecting (e.g. from `groundflow collect --suite libero_goal
    --layout sampled`); default: collect demos_per_task per task, one file per task"""
    steps: int | None = None
    """training steps (default: the multitask recipe's)"""
    cig_steps: int = 2000
    cont_lr: float = 3e-4
    perturbations: tuple[str, ...] = ("paraphrase", "layout", "robot_init", "sensor_noise")
    tag: str = ""
    """suffix of run folders and method names (another data set or recipe beside the default rows)"""
    runs: Path = ROOT / "runs" / "libero"
    results: str = "libero"
    """results file stem: libero is benchmarks/results/libero.json, any other stem a per-run piece in
    benchmarks/results/runs/ (git-ignored; separate stems let parts run in parallel)"""
    merge: tuple[str, ...] | None = None
    """only merge the sections of these result stems into --results and rewrite its table (``--merge``
    alone: just rewrite the table; it used to fall through to the default part and re-run the experts)"""


def experts(a: Args, res: dict[str, Any]) -> None:
    """Each task's expert from the task's own init states 0..episodes_per_task-1."""
    for i in a.tasks:
        env = envs.make(f"libero/goal-{i}")
        ok, steps, t0 = 0, [], time.time()
        for ep in tqdm(range(a.episodes_per_task), desc=f"expert goal-{i}", unit="ep"):
            obs, info = env.reset(seed=ep)
            ex = env.make_expert()
            ex.reset(env, obs)
            for t in range(env.max_episode_steps):
                obs, _, _, _, info = env.step(ex.act(obs))
                if info["success"]:
                    break
            ok += info["success"]
            steps.append(t + 1)
        res.setdefault("experts", {})[f"goal-{i}"] = {
            "instruction": env.instructions[0], "success": ok / a.episodes_per_task,
            "ci95": list(wilson(ok, a.episodes_per_task)), "episodes": a.episodes_per_task,
            "mean_steps": float(np.mean(steps)), "seconds": time.time() - t0}
        env.close()
        print(f"[experts] goal-{i}: {ok}/{a.episodes_per_task}", flush=True)
        save_results(a.results, res, _table)


def _demos(a: Args) -> tuple[Path, ...]:
    """Expert demos from fresh placements, one file per task (a task's expert failing more often
    costs only that task's attempts)."""
    if a.data:
        missing = [str(p) for p in a.data if not Path(p).is_file()]
        if missing:
            raise SystemExit(f"--data files not found: {missing}")
        return tuple(Path(p) for p in a.data)
    from train.collect import CollectArgs, collect
    paths = []
    for i in range(N_TASKS):
        path = DATA / f"libero_goal_sampled_task{i}_{a.demos_per_task}_s{a.seed}.h5"
        if not path.exists():
            out = collect(CollectArgs(suite="libero_goal", episodes=a.demos_per_task, out=path, seed=a.seed + 1000 * i,
                                      layout="sampled", instructions=(_instruction(i),)))
            print(f"[demos] task {i}: {out}", flush=True)
        paths.append(path)
    return tuple(paths)


def _instruction(task: int) -> str:
    env = envs.make(f"libero/goal-{task}")
    try:
        return env.instructions[0]
    finally:
        env.close()


def _train_args(a: Args, out: Path, recipe: str = "multitask", **kw: Any) -> Any:
    """What ``_train`` trains (a ``TrainArgs``): ``recipe`` (train/recipes.py) plus ``kw`` and --steps. The
    DART rows are the multitask recipe on DART demos, which the ``libero_dart`` recipe names."""
    from train.recipes import recipe_args
    if a.steps and "steps" not in kw:
        kw["steps"] = a.steps
    return recipe_args(recipe, out=out, wandb="disabled", progress=False, save_every=10**9, **kw)


def _train(a: Args, out: Path, recipe: str = "multitask", **kw: Any) -> Path:
    from train.bc import train
    if (out / "summary.json").exists():
        return out / "ckpt"
    if out.exists():
        shutil.rmtree(out)
    s = train(_train_args(a, out, recipe, **kw))
    (out / "summary.json").write_text(json.dumps({k: v for k, v in s.items() if k != "history"}, default=str))
    return out / "ckpt"


def _cig(variant: str) -> Any:
    """A ``cig_<variant>_continuation`` method's CIG options: the ``multitask_cig`` recipe's (the grounding
    benchmark's best), the variant the method names."""
    from dataclasses import replace

    from train.recipes import recipe_args
    return replace(recipe_args("multitask_cig").cig, variant=variant)


def _checkpoint(a: Args, method: str, data: tuple[Path, ...]) -> Path:
    base = _train(a, a.runs / f"bc{a.tag}_s{a.seed}", data=data, seed=a.seed)
    if method == "bc":
        return base
    cont = dict(init_from=base, steps=a.cig_steps, warmup_steps=0, lr=a.cont_lr, data=data, seed=a.seed)
    if method == "bc_continuation":
        return _train(a, a.runs / f"{method}{a.tag}_s{a.seed}", **cont)
    if method.startswith("cig_"):
        _, variant, _ = method.split("_")
        return _train(a, a.runs / f"{method}{a.tag}_s{a.seed}", "multitask_cig", cig=_cig(variant), **cont)
    raise ValueError(f"unknown method {method!r}; known: bc, bc_continuation, cig_<variant>_continuation")


def _per_task(policy: Any, a: Args, env: Any) -> dict[str, Any]:
    """LIBERO's protocol: task i from its init states 0..N-1; success, did another task."""
    from train.evaluate import rollout
    out: dict[str, Any] = {}
    for i in a.tasks:
        ok = other = 0
        for ep in tqdm(range(a.episodes_per_task), desc=f"eval goal-{i}", unit="ep", leave=False):
            torch.manual_seed(ep)
            r = rollout(policy, env, seed=ep, options={"task_id": i})
            ok += r["success"]
            other += r["other_task"]
        n = a.episodes_per_task
        out[f"goal-{i}"] = {"success": ok / n, "ci95": list(wilson(ok, n)), "did_other_task": other / n}
    return out


def policies(a: Args, res: dict[str, Any]) -> None:
    import policies as pol_mod
    data = _demos(a)
    env = envs.make(SUITE, layout="task")
    for method in a.methods:
        t0 = time.time()
        policy = pol_mod.load(_checkpoint(a, method, data))
        rows = _per_task(policy, a, env)
        avg = float(np.mean([r["success"] for r in rows.values()]))
        res.setdefault("policies", {})[method + a.tag] = {**{k: v["success"] for k, v in rows.items()}, "average": avg,
                                                  "episodes_per_task": a.episodes_per_task, "seed": a.seed,
                                                  "data": " + ".join(p.name for p in data),
                                                  "detail": rows, "eval_seconds": time.time() - t0}
        print(f"[policies] {method}{a.tag}: average {avg:.2f}", flush=True)
        save_results(a.results, res, _table)
    env.close()


def perturbations(a: Args, res: dict[str, Any]) -> None:
    import policies as pol_mod
    from envs.perturbations import not_applicable, perturb
    data = _demos(a)
    for method in a.methods:
        policy = pol_mod.load(_checkpoint(a, method, data))
        for fam in a.perturbations:
            env = envs.make(SUITE, layout="task")
            why = not_applicable(env, fam)
            if why:
                res.setdefault("perturbations", {}).setdefault(method + a.tag, {})[fam] = {"not_applicable": why}
                env.close()
                print(f"[perturbations] {method}{a.tag} {fam}: not applicable ({why})", flush=True)
                save_results(a.results, res, _table)
                continue
            penv = perturb(env, fam)
            rows = _per_task(policy, a, penv)
            res.setdefault("perturbations", {}).setdefault(method + a.tag, {})[fam] = {
                "average": float(np.mean([r["success"] for r in rows.values()])),
                "episodes_per_task": a.episodes_per_task, "per_task": {k: v["success"] for k, v in rows.items()}}
            penv.close()
            print(f"[perturbations] {method}{a.tag} {fam}: {res['perturbations'][method + a.tag][fam]['average']:.2f}",
                  flush=True)
            save_results(a.results, res, _table)


def _table(res: dict[str, Any]) -> str:
    lines = ["# LIBERO-Goal", ""]
    ex = res.get("experts", {})
    if ex:
        lines += ["## Scripted experts (privileged state), LIBERO's init states", ""]
        lines += [md_table(["task", "instruction", "success [95% CI]", "episodes", "mean steps"], [
            [k, r["instruction"], f"{r['success']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]", r["episodes"],
             f"{r['mean_steps']:.0f}"] for k, r in sorted(ex.items(), key=lambda kv: int(kv[0].split("-")[1]))]), ""]
        lines += [f"Average: {np.mean([r['success'] for r in ex.values()]):.3f} over {len(ex)} tasks", ""]
    po = res.get("policies", {})
    if po:
        tasks = sorted({k for r in po.values() for k in r if k.startswith("goal-")}, key=lambda k: int(k.split("-")[1]))
        lines += ["## Policies from state (flow, multitask recipe), per task on LIBERO's init states", ""]
        lines += [md_table(["method", "data", "average", "did another task", "episodes/task"] + tasks, [
            [m, r.get("data", ""), f"{r['average']:.2f}",
             f"{np.mean([d['did_other_task'] for d in r['detail'].values()]):.2f}", r["episodes_per_task"]]
            + [f"{r[t]:.2f}" for t in tasks] for m, r in po.items()]), ""]
    pe = res.get("perturbations", {})
    if pe:
        fams = sorted({f for r in pe.values() for f in r})
        lines += ["## Perturbations (average over tasks)", ""]
        lines += [md_table(["method"] + fams, [
            [m] + [("n/a" if "not_applicable" in r.get(f, {}) else f"{r[f]['average']:.2f}") if f in r else "-"
                   for f in fams] for m, r in pe.items()]), ""]
    lines += [f"Machine: {res.get('machine')}", ""]
    return "\n".join(lines)


def main() -> None:
    a = tyro.cli(Args)
    bad = [t for t in a.tasks if not 0 <= t < N_TASKS]
    if bad:
        raise SystemExit(f"LIBERO-Goal has tasks 0..{N_TASKS - 1}; got {bad}")
    res = load_results(a.results)
    if a.merge is not None:
        for stem in a.merge:
            path = piece_path(stem)
            if not path.exists():
                raise SystemExit(f"no results file {path}")
            for key, part in json.loads(path.read_text()).items():
                if isinstance(part, dict) and key != "machine":
                    res.setdefault(key, {}).update(part)
        name_manifest(a.results, res)
        return save_results(a.results, res, _table)
    {"experts": experts, "policies": policies, "perturbations": perturbations}[a.part](a, res)


if __name__ == "__main__":
    main()
