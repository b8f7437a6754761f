"""``make demo``: the product end to end on an embedded default, on the CPU.

1. collect expert demos on the ManiSkill tabletop suite where the layout names the task 90% of the
   time (shortcut data: the scene mostly predicts the task, the setting where policies stop
   listening), held-out demos for the diagnostics, and obstacle-free reaches;
2. train a tiny flow VLA by behaviour cloning with the ``multitask`` recipe (early fusion, centred
   language, acting every step: train/recipes.py), the same for twice the steps (joint CIG's
   compute), and the same with Counterfactual Instruction Grounding from the first step (joint CIG,
   the ``multitask_cig`` recipe: the configuration the grounding benchmark found best; ``--cig-mode
   continuation`` fine-tunes the BC checkpoint instead); and a flow policy on the reaches;
3. evaluate BC, BC 2x and CIG where the layout no longer predicts the task, plus their diagnostics;
4. collision avoidance: the reach policy among obstacles without guidance and with Coupled Guidance;
5. drive a simulated robot through the policy server (websocket, safety layer, recording);
then print the results table (also written to OUT/results.json).

Independent collections, trainings and evaluations run side by side in ``--workers`` processes (one
torch thread each; train/parallel.py), with the same results as one after another.

A second run reuses a collected dataset or a trained run in OUT only when its stamp
(``OUT/<name>.stamp.json``, written once it is complete) says it was made by exactly what this run would
do: the same arguments, from the same inputs (a run's datasets, a continuation's BC checkpoint), by the
same source of the packages the stage runs and the same versions of the dependencies. Anything else (other
flags, an upgraded groundflow or torch, an artifact without a stamp from an older demo or a killed run) is
deleted and made again, in one line saying why, so a long-lived OUT prints what a fresh one prints.

Bigger settings are flags (``make demo ARGS="--bc-steps 20000 --size base"`` on a GPU workstation).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Literal

os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny policies beside CPU simulators (see groundflow/cli.py)

import torch  # noqa: E402
import tyro  # noqa: E402

import policies  # noqa: E402
from deploy.evaluate import evaluate_via_server
from deploy.serving.server import PolicyServer
from envs.errors import InvalidOptionError
from groundflow.cli import run_command
from train.bc import TrainArgs, train
from train.collect import CollectArgs, collect
from train.data import ChunkData
from train.diagnose import diagnose, plot
from train.evaluate import evaluate
from train.guided_eval import evaluate_collision
from train.parallel import Job, Report, run_jobs
from train.recipes import recipe_args

_CIG = recipe_args("multitask_cig").cig
"""the recommended CIG term (train/recipes.py): the BC+CIG row's, with the flags below"""


@dataclass
class DemoArgs:
    out: Path = Path("runs/demo")
    seed: int = 0
    size: str = "tiny"
    demos: int = 480
    """tabletop demos (cycled over --instructions)"""
    layout_rho: float = 0.9
    """probability that a demo's layout names its task (random otherwise); 1.0: always"""
    instructions: tuple[str, ...] = tuple(f"push the {c} cube to the {g} goal" for c in ("red", "green", "blue")
                                          for g in ("left", "right"))
    """suite instructions used (default: the six push tasks, all feasible from every initial state)"""
    bc_steps: int = 4000
    """BC steps of the multitask recipe (batch 256); the grounding benchmark's runs use 24000 (tabletop
    flow reached 1.00 on 24 episodes at 12000)"""
    cig_mode: Literal["joint", "continuation"] = "joint"
    """joint: BC + the CIG term from the first step, for --bc-steps (about twice BC's time per step; the
    grounding benchmark's P2 rho 0.9 gain); continuation: --cig-steps from the BC checkpoint"""
    cig_steps: int = 500
    """continuation steps (--cig-mode continuation)"""
    cig_max_progress: float = 1.0
    """the CIG term only on samples this far into their demo (CIGOptions.max_progress)"""
    cig_weight: float = _CIG.weight
    cig_variant: str = _CIG.variant
    """full | detached | bounded | pmi (benchmarks/grounding.py compares them); the CIG flags' defaults are the
    ``multitask_cig`` recipe's"""
    eval_episodes: int = 24
    collision_demos: int = 120
    """straight reaches without obstacles, collected with DART noise (so the policy can recover after a detour)"""
    collision_steps: int = 2000
    collision_episodes: int = 12
    guidance_scale: float = 10.0
    server_episodes: int = 6
    """episodes through the policy server; episode i commands instruction i (cycled)"""
    workers: int = 2
    """processes for the independent collections, trainings and evaluations (1: one after another); each
    uses one torch thread, so 2 fill a 2-core machine"""
    fresh: bool = False
    """delete OUT first (default: reuse the collected data and trained runs whose stamps say this run would
    make the same; redo the others)"""


def _stage(name: str) -> float:
    print(f"\n=== {name} ===", flush=True)
    return time.time()


# --- stamps: what made each artifact in OUT (reused only when this run would make the same) ---------------

_ROOT = Path(__file__).resolve().parent.parent
# the source each stage runs (envs and dataset import none of the others; train, policies and guidance
# import neither deploy nor groundflow, whose effect on an artifact is all in the arguments stamped)
_COLLECT_CODE = ("envs", "dataset", "train/collect.py")
_TRAIN_CODE = ("envs", "dataset", "guidance", "policies", "train")
_UNSTAMPED = ("progress", "overwrite")  # how a stage reports or where it may write, not what it makes


def _stamp_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".stamp.json")


def _code_digests(parts: tuple[str, ...]) -> dict[str, str]:
    """sha256 of each package's (or file's) Python source, by path relative to the repository."""
    out = {}
    for part in parts:
        p = _ROOT / part
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        h = hashlib.sha256()
        for f in files:
            h.update(f.relative_to(_ROOT).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
        out[part] = h.hexdigest()[:16]
    return out


def _versions() -> dict[str, str]:
    """Python and the installed versions of groundflow's dependencies (and ManiSkill's simulator)."""
    try:
        reqs = [r for r in importlib.metadata.requires("groundflow") or [] if "extra ==" not in r]
    except importlib.metadata.PackageNotFoundError:
        reqs = []
    names = sorted({m.group(0).lower() for r in reqs if (m := re.match(r"[A-Za-z0-9_.\-]+", r))} | {"sapien"})
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def _settings(args: CollectArgs | TrainArgs, out: Path) -> dict:
    """A stage's arguments as JSON, with paths inside OUT written relative to it (moving OUT keeps them)."""
    def norm(x):
        if isinstance(x, Path):
            try:
                return "OUT/" + x.relative_to(out).as_posix()
            except ValueError:
                return str(x)
        if isinstance(x, (list, tuple)):
            return [norm(v) for v in x]
        if isinstance(x, dict):
            return {str(k): norm(v) for k, v in x.items()}
        return x
    return {k: norm(v) for k, v in asdict(args).items() if k not in _UNSTAMPED}


def _stamp(args: CollectArgs | TrainArgs, out: Path, inputs: dict[str, dict], code: dict[str, str],
           versions: dict[str, str]) -> dict:
    """What makes an artifact: the stage's arguments, its inputs' stamps (by digest), the code, the versions."""
    body = {"settings": _settings(args, out), "inputs": {k: v["digest"] for k, v in inputs.items()},
            "code": code, "versions": versions}
    body = json.loads(json.dumps(body, default=str))  # as it reads back from the file
    return {**body, "digest": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def _write_stamp(artifact: Path, stamp: dict) -> None:
    """Written only once the artifact is complete, atomically: a killed run leaves no stamp."""
    path = _stamp_path(artifact)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _why_stale(old: dict, new: dict) -> str:
    """What differs between the stamp an artifact has and the one this run would give it, in a few words."""
    def changes(a: dict, b: dict, sep: str) -> list[str]:
        a, b = _flat(a), _flat(b)
        return [f"{k}{sep}{json.dumps(a.get(k, 'unset'))} -> {json.dumps(b.get(k, 'unset'))}"
                for k in sorted(set(a) | set(b)) if a.get(k, "unset") != b.get(k, "unset")]
    why = []
    if ch := changes(old.get("settings", {}), new["settings"], " "):
        why.append("made with other settings (" + ", ".join(ch[:4]) + (f", and {len(ch) - 4} more" if len(ch) > 4
                                                                      else "") + ")")
    if ins := [k for k in sorted(set(old.get("inputs", {})) | set(new["inputs"]))
               if old.get("inputs", {}).get(k) != new["inputs"].get(k)]:
        why.append("made from another " + ", ".join(ins))
    if code := [k for k in new["code"] if old.get("code", {}).get(k) != new["code"][k]]:
        why.append("made by other groundflow source (" + ", ".join(code) + ")")
    if ch := changes(old.get("versions", {}), new["versions"], " "):
        why.append("made with other versions (" + ", ".join(ch[:4]) + (f", and {len(ch) - 4} more" if len(ch) > 4
                                                                      else "") + ")")
    return "; ".join(why) or "made otherwise"


def _reusable(artifact: Path, ckpt: Path, stamp: dict, verb: str, shown: Path) -> bool:
    """Whether ``artifact`` (complete when ``ckpt`` exists) was made by what this run would do; if not, it
    and its stamp are deleted, saying why when there was something to delete."""
    stamp_file = _stamp_path(artifact)
    old = None
    if stamp_file.exists():
        try:
            old = json.loads(stamp_file.read_text())
        except (OSError, ValueError):
            old = {}
    if ckpt.exists() and old is not None and old.get("digest") == stamp["digest"]:
        return True
    if ckpt.exists():
        why = ("no stamp (made by an older demo, or not finished)" if old is None else
               "unreadable stamp" if not old else _why_stale(old, stamp))
        print(f"{shown}: {why}; {verb} again", flush=True)
    stamp_file.unlink(missing_ok=True)  # the stamp first: a run killed in between leaves no stamp
    if artifact.is_dir():
        shutil.rmtree(artifact, ignore_errors=True)
    else:
        artifact.unlink(missing_ok=True)
    return False


def _collect_job(runs: list[tuple[CollectArgs, dict]], report: Report) -> list[dict]:
    """Collect into each ``runs[i][0].out`` in turn, reporting episodes over all of them, and stamp each."""
    done, out = 0, []
    for c, stamp in runs:
        out.append(collect(replace(c, progress=False), on_episode=lambda n, d=done: report(d + n)))
        _write_stamp(c.out, stamp)
        done += c.episodes
    return out


def _train_job(targs: TrainArgs, stamp: dict, report: Report) -> dict:
    summary = train(replace(targs, progress=False), on_step=report)
    _write_stamp(targs.out, stamp)
    summary.pop("history", None)
    return summary


def _say_reused(paths: list[Path]) -> None:
    if paths:
        print("reusing " + ", ".join(str(p) for p in paths) + " (their stamps say this run would make the same)",
              flush=True)


def _eval_job(run_dir: Path, held: Path, args: DemoArgs, report: Report) -> tuple[dict, dict]:
    """Success on random and correlated layouts, and the grounding diagnostics on held-out demos."""
    pol = policies.load(run_dir / "ckpt")
    torch.manual_seed(args.seed)  # the flow sampler's noise: the same checkpoints give the same table
    n = args.eval_episodes
    ev = evaluate(pol, "maniskill/TabletopSuite-v1", n, seed=args.seed + 90_000, env_options={"layout": "random"},
                  instructions=list(args.instructions), progress=False, on_episode=report).to_dict()
    ev_in = evaluate(pol, "maniskill/TabletopSuite-v1", n, seed=args.seed + 95_000,
                     env_options={"layout": "correlated"}, instructions=list(args.instructions), progress=False,
                     on_episode=lambda k: report(n + k)).to_dict()
    diag = diagnose(pol, ChunkData(held, pol.config.horizon), n=128, seed=args.seed)
    row = {"success_rate": ev["success_rate"], "ci95": ev["ci95"], "in_distribution_success": ev_in["success_rate"],
           "did_other_task_rate": ev["did_other_task_rate"],
           "identification_accuracy": diag["identification_accuracy"],
           "action_sensitivity": diag["action_sensitivity"]}
    return row, diag


def _train_plan(args: DemoArgs, data: Path, cdata: Path) -> tuple[dict[str, Path], list[tuple[str, TrainArgs]]]:
    """The table's rows (name -> run folder) and the runs to train, the longest first (so two workers finish
    together): BC with the ``multitask`` recipe, and for joint CIG BC for twice the steps and the
    ``multitask_cig`` recipe with the demo's CIG flags (a continuation: ``multitask_cig`` from the BC
    checkpoint, after it); and the reach policy."""
    joint = args.cig_mode == "joint"
    bc_dir, cig_dir, cdir = args.out / "bc", args.out / ("cig_joint" if joint else "cig"), args.out / "reach"
    rows = {"BC": bc_dir, **({"BC 2x": args.out / "bc_2x"} if joint else {}), "BC+CIG": cig_dir}
    common = dict(data=(data,), policy="flow", size=args.size, seed=args.seed, wandb="disabled", save_every=10**9)
    # the recipe's counterfactual instructions per sample, or as many as there are with fewer instructions
    cig = replace(_CIG, weight=args.cig_weight, variant=args.cig_variant,
                  negatives=min(_CIG.negatives, len(args.instructions) - 1), max_progress=args.cig_max_progress)
    plan = ([("BC 2x", recipe_args("multitask", steps=2 * args.bc_steps, out=rows["BC 2x"], **common)),
             ("BC+CIG", recipe_args("multitask_cig", steps=args.bc_steps, out=cig_dir, cig=cig, **common))]
            if joint else [])
    plan += [("BC", recipe_args("multitask", steps=args.bc_steps, out=bc_dir, **common)),
             ("reach", TrainArgs(data=(cdata,), policy="flow", size=args.size, steps=args.collision_steps, horizon=8,
                                 n_exec=4, out=cdir, seed=args.seed, wandb="disabled"))]
    if not joint:  # continuation: from the BC checkpoint, so after it
        plan.append(("CIG continuation", recipe_args("multitask_cig", init_from=bc_dir / "ckpt", steps=args.cig_steps,
                                                     lr=1e-4, warmup_steps=20, out=cig_dir, cig=cig,
                                                     **{k: v for k, v in common.items() if k != "size"})))
    return rows, plan


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(DemoArgs, args=argv)
    if args.workers < 1:
        raise InvalidOptionError(f"--workers must be >= 1, got {args.workers}")
    if len(set(args.instructions)) < 2:
        raise InvalidOptionError(f"--instructions needs at least two distinct instructions (CIG contrasts them), got "
                                 f"{list(args.instructions)}")

    if args.fresh:
        shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": {k: str(v) for k, v in asdict(args).items()}, "stages": {}}
    t_all = time.time()

    started = _stage(f"1/5 collect demos: tabletop, where the layout names the task with probability {args.layout_rho}, "
                     "held-out tabletop, and obstacle-free reaches")
    data, held, cdata = args.out / f"tabletop_rho{args.layout_rho}.h5", args.out / "tabletop_heldout.h5", args.out / "reach.h5"
    tabletop = CollectArgs(suite="tabletop", episodes=args.demos, out=data, seed=args.seed, layout="correlated",
                           instructions=args.instructions, env_options={"layout_rho": args.layout_rho})
    others = [CollectArgs(suite="tabletop", episodes=24, out=held, seed=args.seed + 50_000, layout="random",
                          instructions=args.instructions),
              # straight reaches without obstacles, with DART noise (so the policy can recover after a detour)
              CollectArgs(env="maniskill/CollisionAvoidance-v1", episodes=args.collision_demos, out=cdata,
                          seed=args.seed, dart_noise=0.3)]
    versions = _versions()
    code = {"collect": _code_digests(_COLLECT_CODE), "train": _code_digests(_TRAIN_CODE)}
    stamps = {c.out: _stamp(c, args.out, {}, code["collect"], versions) for c in [tabletop, *others]}
    redo = {c.out for c in [tabletop, *others] if not _reusable(c.out, c.out, stamps[c.out], "collecting", c.out)}
    _say_reused([c.out for c in [tabletop, *others] if c.out not in redo])
    groups = [[(c, stamps[c.out]) for c in g if c.out in redo] for g in ([tabletop], others)]
    jobs = [Job(f"collect {', '.join(c.out.name for c, _ in g)}", partial(_collect_job, g),
                sum(c.episodes for c, _ in g)) for g in groups if g]
    if jobs:
        run_jobs(jobs, args.workers, desc="collect (episodes)")
    res["stages"]["collect_s"] = time.time() - started

    joint = args.cig_mode == "joint"
    started = _stage("2/5 train the tiny flow VLA (multitask recipe): BC" +
                     (", BC for twice the steps (joint CIG's compute), BC + the CIG term from the first step (joint CIG)"
                      if joint else ", then CIG fine-tuning the BC checkpoint (continuation)") +
                     "; and a flow policy on the reaches")
    rows, plan = _train_plan(args, data, cdata)
    bc_dir, cig_dir, cdir = rows["BC"], rows["BC+CIG"], dict(plan)["reach"].out
    jobs, after, reused = [], [], []
    for name, targs in plan:
        # its inputs' stamps: the datasets, and a continuation's BC run (stamped before it is trained)
        inputs = [*targs.data, *([bc_dir] if targs.init_from else [])]
        stamps[targs.out] = _stamp(targs, args.out, {"OUT/" + d.relative_to(args.out).as_posix(): stamps[d]
                                                     for d in inputs}, code["train"], versions)
        if _reusable(targs.out, targs.out / "ckpt", stamps[targs.out], "training", targs.out):
            reused.append(targs.out)
        else:
            (after if targs.init_from else jobs).append(
                Job(f"{name if targs.init_from else 'train ' + name} ({targs.steps} steps)",
                    partial(_train_job, targs, stamps[targs.out]), targs.steps))
    _say_reused(reused)
    if jobs:
        run_jobs(jobs, args.workers, desc="train (steps)")
    if after:  # continuation needs the BC checkpoint first
        run_jobs(after, 1, desc="CIG (steps)")
    res["stages"]["train_s"] = time.time() - started

    started = _stage("3/5 evaluate where the layout no longer predicts the task (and where it does)")
    out = dict(zip(rows, run_jobs([Job(f"evaluate {name}", partial(_eval_job, run_dir, held, args), 2 * args.eval_episodes)
                                   for name, run_dir in rows.items()], args.workers, desc="evaluate (episodes)")))
    res["tabletop"] = {name: row for name, (row, _) in out.items()}
    plot({name: diag for name, (_, diag) in out.items()}, args.out / "collapse.png")
    res["stages"]["eval_s"] = time.time() - started

    started = _stage("4/5 collision avoidance: unguided vs Coupled Guidance")
    pol = policies.load(cdir / "ckpt")
    res["collision"] = {
        "no obstacle": evaluate_collision(pol, "none", 0.0, args.collision_episodes, obstacles="none"),
        "obstacle, unguided": evaluate_collision(pol, "none", 0.0, args.collision_episodes),
        "obstacle, coupled": evaluate_collision(pol, "coupled", args.guidance_scale, args.collision_episodes),
    }
    res["stages"]["collision_s"] = time.time() - started

    started = _stage("5/5 drive a simulated robot through the policy server")
    pol = policies.load(cig_dir / "ckpt")
    with PolicyServer(pol, host="127.0.0.1", port=0) as server:
        res["server"] = evaluate_via_server("maniskill/TabletopSuite-v1", server.address, args.server_episodes,
                                            seed=args.seed + 70_000, env_options={"layout": "random"},
                                            record=str(args.out / "deployed.h5"), overwrite=True,
                                            instructions=list(args.instructions))
    res["server"].pop("episodes", None)
    res["stages"]["server_s"] = time.time() - started
    res["total_s"] = time.time() - t_all
    (args.out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    print_table(res)
    return res


def print_table(res: dict) -> None:
    print("\n================ groundflow demo results ================")
    rho = res["args"].get("layout_rho", "1.0")
    print(f"Tabletop suite (6 push tasks), trained where the layout names the task with probability {rho}; success on")
    print("random layouts (only the instruction says which task) and on correlated ones (the shortcut holds);")
    if "BC 2x" in res["tabletop"]:
        print("BC 2x is BC for twice the steps (the compute of joint CIG; BC+CIG has the CIG term from the start):")
    print(f"  {'policy':8s} {'random layout [95% CI]':24s} {'correlated':>10s} {'other task':>10s} {'id acc':>7s} "
          f"{'sensitivity':>11s}")
    for name, r in res["tabletop"].items():
        ci = f"{r['success_rate']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"
        print(f"  {name:8s} {ci:24s} {r['in_distribution_success']:10.2f} {r['did_other_task_rate']:10.2f} "
              f"{r['identification_accuracy']:7.2f} {r['action_sensitivity']:11.2f}")
    print("Collision avoidance (flow policy trained without obstacles):")
    print(f"  {'setting':20s} {'success':>8s} {'collision':>9s} {'clean':>6s} {'ms/chunk':>9s} {'NFE':>5s}")
    for name, r in res["collision"].items():
        print(f"  {name:20s} {r['success_rate']:8.2f} {r['collision_rate']:9.2f} {r['clean_success_rate']:6.2f} "
              f"{r['ms_per_chunk']:9.1f} {r['nfe_per_chunk']:5.0f}")
    s = res["server"]
    print(f"Through the policy server: success {s['success_rate']:.2f} over {s['n_episodes']} episodes, "
          f"round trip p50 {s['rtt_p50_ms']:.1f} ms; recording {s['record']}")
    print(f"Total {res['total_s'] / 60:.1f} min; stages (s): " + ", ".join(f"{k} {v:.0f}" for k, v in res["stages"].items()))


def cli(argv: list[str] | None = None) -> int:
    """``python -m groundflow.demo``: bad input and failed jobs end in one line naming the problem."""
    return run_command("demo", main, sys.argv[1:] if argv is None else argv,
                       interrupted_hint=" (finished stages are kept; run again to resume)")


if __name__ == "__main__":
    sys.exit(cli())
