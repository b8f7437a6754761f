"""Policies from pixels: one camera + proprioception (no object state), beside state policies.

Parts (each adds its section to ``benchmarks/results/<results>.json`` and rewrites the table):

- ``throughput``: env steps/s without a camera and with one at 64 and 128 px (no expert, so the
  figure is the simulator and renderer alone); bytes per stored frame (raw vs the HDF5 format's
  per-frame chunks, lzf); the loader's batch time; training samples/s of a state policy and of
  each image encoder at 64 px.
- ``tasks``: per env, expert demos recorded with the camera (cached under data/bench), then each
  method trained on them and evaluated on fresh seeds. The image methods hide the object slices of
  the state (``--ignore-state``): they see the robot's own joints and end effector and must find
  the cube, goal or door handle in the image. ``state`` is the privileged-state reference and
  ``blind`` the control (the same hidden slices, no camera): what proprioception alone achieves.
- ``perturbations``: the trained policies under a camera shift and a lighting change
  (``envs/perturbations.py``).

    .venv/bin/python benchmarks/vision.py --part throughput
    .venv/bin/python benchmarks/vision.py --part tasks --envs adroit/door --methods state cnn
    .venv/bin/python benchmarks/vision.py --part perturbations --envs adroit/door --methods cnn
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, demos, load_results, md_table, save_results  # noqa: E402

import numpy as np  # noqa: E402
import tyro  # noqa: E402

import envs  # noqa: E402


@dataclass(frozen=True)
class Task:
    camera: str
    demos: int
    steps: int
    hide: tuple[str, ...]
    """state slices an image policy does not read: everything about the objects"""
    recipe: str = "chunked"
    batch_size: int = 64


TASKS: dict[str, Task] = {
    "maniskill/PushCube-v1": Task("base_camera", 200, 6000, ("extra/goal_pos", "extra/obj_pose")),
    "adroit/door": Task("vil_camera", 100, 6000, ("door/*",)),
    "maniskill/TabletopSuite-v1": Task("base_camera", 600, 8000, ("extra/*_cube_pose", "extra/*_goal_pos"),
                                       recipe="multitask", batch_size=128),
}

METHODS: dict[str, dict[str, Any]] = {  # name -> TrainArgs overrides ("cameras": False = state policy)
    "state": {"cameras": False},
    # the control: what the robot's own state alone achieves (no camera, object slices hidden); an
    # image policy is only shown to see if it beats this
    "blind": {"cameras": False, "blind": True},
    "cnn": {"vision": "cnn"},
    "cnn_noaug": {"vision": "cnn", "image_shift": 0},
    "cnn_kp": {"vision": "cnn", "image_pool": "keypoints"},
    "cnn_aux": {"vision": "cnn", "aux_state_weight": 1.0},
    "cnn_jitter": {"vision": "cnn", "image_jitter": 0.5},
    "lite0_frozen_jitter": {"vision": "efficientnet_lite0", "vision_frozen": True, "image_jitter": 0.5},
    "lite0_frozen": {"vision": "efficientnet_lite0", "vision_frozen": True},
    "lite0_finetuned": {"vision": "efficientnet_lite0"},
    "ar_cnn": {"policy": "ar", "vision": "cnn"},
}
EVAL_SEED = 100_000  # demos use seeds from 0: evaluation scenes are never trained on


@dataclass
class Args:
    part: Literal["throughput", "tasks", "perturbations"] = "tasks"
    envs: tuple[str, ...] = ("maniskill/PushCube-v1", "adroit/door")
    methods: tuple[str, ...] = ("state", "cnn")
    image_size: int = 64
    episodes: int = 50
    steps: int | None = None
    """training steps (default: the task's)"""
    perturbations: tuple[str, ...] = ("camera", "lighting")
    seed: int = 0
    resume: bool = False
    """continue an interrupted training run (or end it early: a --steps at or below its step count
    just writes its summary and evaluates it); train minutes then count the resumed part only"""
    tag: str = ""
    """suffix of the result names (another budget beside the default rows, e.g. --steps 3000 --tag _3k)"""
    runs: Path = ROOT / "runs" / "vision"
    results: str = "vision"
    """results file stem: vision is benchmarks/results/vision.json, any other stem a per-run piece in
    benchmarks/results/runs/ (git-ignored; separate stems let parts run in parallel)"""
    merge: tuple[str, ...] | None = None
    """only merge the task/perturbation entries of these result stems into --results, rewrite the table
    (``--merge`` alone: just rewrite the table)"""
    progress: bool = True


def _sees_image(method: str) -> bool:
    return METHODS[method].get("cameras", True)


def _demos(env_id: str, a: Args) -> Path:
    t = TASKS[env_id]
    kw: dict[str, Any] = {"cameras": (t.camera,), "image_size": a.image_size}
    if t.recipe == "multitask":
        kw["layout"] = "random"
    return demos(env_id, t.demos, seed=a.seed, **kw)


def _train_args(env_id: str, method: str, a: Args, data: Path, out: Path):
    from train.recipes import recipe_args
    t, image = TASKS[env_id], _sees_image(method)
    m = {k: v for k, v in METHODS[method].items() if k not in ("cameras", "blind")}
    hide = t.hide if (image or METHODS[method].get("blind")) else ()
    if t.recipe == "multitask":  # the recipe's own hidden slices (joint velocities) stay hidden
        from train.recipes import RECIPES
        hide = tuple(RECIPES["multitask"][1]["ignore_state"]) + hide
    return recipe_args(t.recipe, data=(data,), out=out, steps=a.steps or t.steps, batch_size=t.batch_size,
                       seed=a.seed, cameras=(t.camera,) if image else (), image_size=a.image_size,
                       ignore_state=hide, wandb="disabled", progress=a.progress, **m)


def _checkpoint(env_id: str, method: str, a: Args) -> tuple[Path, float]:
    """Train (or reuse) the method's policy; its checkpoint and training minutes."""
    from train.bc import train
    out = a.runs / f"{env_id.replace('/', '_')}_{method}{a.tag}_s{a.seed}"
    summary = out / "summary.json"
    if summary.exists():
        return out / "ckpt", json.loads(summary.read_text())["seconds"] / 60
    data = _demos(env_id, a)
    resume = a.resume and (out / "train_state.pt").exists()
    if out.exists() and not resume:
        shutil.rmtree(out)
    t0 = time.time()
    train(dataclasses.replace(_train_args(env_id, method, a, data, out), resume=resume))
    return out / "ckpt", (time.time() - t0) / 60


def _env_options(env_id: str, method: str, a: Args) -> dict[str, Any]:
    opts: dict[str, Any] = ({"cameras": (TASKS[env_id].camera,), "image_size": a.image_size}
                            if _sees_image(method) else {})
    if TASKS[env_id].recipe == "multitask":
        opts["layout"] = "random"
    return opts


def tasks(a: Args, res: dict[str, Any]) -> None:
    import policies
    from train.evaluate import evaluate
    for env_id in a.envs:
        for method in a.methods:
            ckpt, minutes = _checkpoint(env_id, method, a)
            policy = policies.load(ckpt)
            r = evaluate(policy, env_id, a.episodes, seed=EVAL_SEED, env_options=_env_options(env_id, method, a),
                         progress=a.progress).to_dict()
            t = TASKS[env_id]
            res.setdefault("tasks", {}).setdefault(env_id, {})[method + a.tag] = {
                "success": r["success_rate"], "ci95": r["ci95"], "episodes": r["episodes"],
                "image_size": a.image_size if _sees_image(method) else 0,
                "train_minutes": minutes, "demos": t.demos, "train_steps": a.steps or t.steps,
                "camera": t.camera if _sees_image(method) else None,
                "policy": METHODS[method].get("policy", "flow"), "did_other_task": r["did_other_task_rate"]}
            print(f"[tasks] {env_id} {method}: {r['success_rate']:.2f} {r['ci95']} ({minutes:.1f} min training)",
                  flush=True)
            save_results(a.results, res, _table)


def perturbations(a: Args, res: dict[str, Any]) -> None:
    import policies
    from envs.perturbations import not_applicable, perturb
    from train.evaluate import evaluate
    for env_id in a.envs:
        for method in a.methods:
            ckpt, _ = _checkpoint(env_id, method, a)
            policy = policies.load(ckpt)
            for fam in a.perturbations:
                env = envs.make(env_id, **_env_options(env_id, method, a))
                why = not_applicable(env, fam)
                entry: dict[str, Any]
                if why:
                    entry = {"not_applicable": why}
                else:
                    r = evaluate(policy, env_id, a.episodes, seed=EVAL_SEED, env=perturb(env, fam),
                                 progress=a.progress).to_dict()
                    entry = {"success": r["success_rate"], "ci95": r["ci95"], "episodes": r["episodes"]}
                env.close()
                res.setdefault("perturbations", {}).setdefault(env_id, {}).setdefault(method + a.tag, {})[fam] = entry
                print(f"[perturbations] {env_id} {method} {fam}: {entry}", flush=True)
                save_results(a.results, res, _table)


def _render_rate(env_id: str, camera: str | None, size: int, steps: int = 100) -> float:
    env = envs.make(env_id, **({"cameras": (camera,), "image_size": size} if camera else {}))
    env.reset(seed=0)
    mid = ((env.action_space.low + env.action_space.high) / 2).astype(np.float32)
    t0 = time.perf_counter()
    for i in range(steps):
        _, _, term, trunc, _ = env.step(mid)
        if term or trunc:
            env.reset(seed=i)
    rate = steps / (time.perf_counter() - t0)
    env.close()
    return rate


def throughput(a: Args, res: dict[str, Any]) -> None:
    from train.bc import train
    from train.data import ChunkData
    out: dict[str, Any] = {"render_steps_per_s": {}, "storage": {}, "loader": {}, "train_samples_per_s": {}}
    for env_id in a.envs:
        cam = TASKS[env_id].camera
        out["render_steps_per_s"][env_id] = {
            "state_only": _render_rate(env_id, None, a.image_size),
            **{f"{s}px": _render_rate(env_id, cam, s) for s in (64, 128)}}
        print(f"[throughput] {env_id} steps/s: {out['render_steps_per_s'][env_id]}", flush=True)
        data = _demos(env_id, a)
        t0 = time.perf_counter()
        cd = ChunkData(data, 16, (cam,), a.image_size)
        load_s = time.perf_counter() - t0
        size = data.stat().st_size
        out["storage"][env_id] = {"frames": len(cd), "file_bytes": size, "bytes_per_frame": size / len(cd),
                                  "raw_image_bytes_per_frame": 3 * a.image_size ** 2,
                                  "chunks": "one frame per chunk, lzf"}
        idx = np.random.default_rng(0).integers(0, len(cd), (50, 64))
        t0 = time.perf_counter()
        for b in idx:
            cd.batch(b)
        out["loader"][env_id] = {"load_seconds": load_s, "batch64_ms": (time.perf_counter() - t0) / 50 * 1000,
                                 "memory_mb": sum(v.nbytes for v in cd.images.values()) / 2 ** 20}
        rates = {}
        for method in ("state", "cnn", "lite0_frozen", "lite0_finetuned"):
            with tempfile.TemporaryDirectory() as tmp:
                ta = dataclasses.replace(_train_args(env_id, method, a, data, Path(tmp) / "run"), steps=60,
                                         save_every=10_000, progress=False)
                rates[method] = train(ta)["samples_per_s"]
        rates["cnn_vs_state"] = rates["state"] / rates["cnn"]
        out["train_samples_per_s"][env_id] = rates
        print(f"[throughput] {env_id} train samples/s: {rates}", flush=True)
    res["throughput"] = out
    save_results(a.results, res, _table)


def _table(res: dict[str, Any]) -> str:
    lines = ["# Policies from pixels", ""]
    if res.get("tasks"):
        lines += ["One camera + proprioception (object state hidden) vs the privileged-state policy; "
                  f"evaluation seeds from {EVAL_SEED} (never in the demos).", ""]
        rows = []
        for env_id, ms in res["tasks"].items():
            for m, r in ms.items():
                seen = (f"{r['camera']} + proprioception" if r["camera"] else
                        "proprioception only" if "blind" in m else "privileged state")
                rows.append([env_id, m, r["policy"], seen, r["image_size"] or "-",
                             f"{r['success']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]", r["episodes"],
                             r["demos"], r["train_steps"], f"{r['train_minutes']:.1f}"])
        lines += [md_table(["env", "method", "family", "observation", "px", "success [95% CI]", "episodes", "demos",
                            "steps", "train min"], rows), ""]
    if res.get("perturbations"):
        lines += ["## Perturbations", ""]
        rows = []
        for env_id, ms in res["perturbations"].items():
            for m, fams in ms.items():
                clean = res.get("tasks", {}).get(env_id, {}).get(m, {}).get("success")
                rows.append([env_id, m, "-" if clean is None else f"{clean:.2f}"] + [
                    "n/a" if "not_applicable" in fams.get(f, {"not_applicable": 1}) else
                    f"{fams[f]['success']:.2f} [{fams[f]['ci95'][0]:.2f}, {fams[f]['ci95'][1]:.2f}]"
                    for f in ("camera", "lighting")])
        lines += [md_table(["env", "method", "clean", "camera shift", "lighting"], rows), ""]
    th = res.get("throughput")
    if th:
        lines += ["## Throughput (2-core CPU)", ""]
        rows = [[e, f"{r['state_only']:.0f}", f"{r['64px']:.0f}", f"{r['128px']:.0f}"]
                for e, r in th["render_steps_per_s"].items()]
        lines += [md_table(["env", "steps/s state only", "steps/s 64 px", "steps/s 128 px"], rows), ""]
        rows = [[e, f"{s['bytes_per_frame']:.0f}", s["raw_image_bytes_per_frame"], s["chunks"],
                 f"{th['loader'][e]['batch64_ms']:.2f}", f"{th['loader'][e]['load_seconds']:.1f}"]
                for e, s in th["storage"].items()]
        lines += [md_table(["env", "stored bytes/frame", "raw image bytes", "layout", "batch of 64 (ms)",
                            "load (s)"], rows), ""]
        rows = [[e] + [f"{r[m]:.0f}" for m in ("state", "cnn", "lite0_frozen", "lite0_finetuned")]
                + [f"{r['cnn_vs_state']:.2f}x"] for e, r in th["train_samples_per_s"].items()]
        lines += [md_table(["env", "state", "cnn 64 px", "lite0 frozen", "lite0 fine-tuned", "state / cnn"], rows), ""]
    lines += [f"Machine: {res.get('machine')}", ""]
    return "\n".join(lines)


def main() -> None:
    a = tyro.cli(Args)
    res = load_results(a.results)
    if a.merge is not None:
        for stem in a.merge:
            other = load_results(stem)
            for sec in ("tasks", "perturbations"):
                for env_id, ms in other.get(sec, {}).items():
                    res.setdefault(sec, {}).setdefault(env_id, {}).update(ms)
            if "throughput" in other:
                res["throughput"] = other["throughput"]
        save_results(a.results, res, _table)
        print(_table(res))
        return
    unknown = [e for e in a.envs if e not in TASKS] + [m for m in a.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown env(s)/method(s) {unknown}; envs: {list(TASKS)}, methods: {list(METHODS)}")
    {"throughput": throughput, "tasks": tasks, "perturbations": perturbations}[a.part](a, res)
    print(_table(res))


if __name__ == "__main__":
    main()
