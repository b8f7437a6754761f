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
    .venv/bin/python benchmarks/guidance_collision.py --quick      # smoke run (writes nothing)
    .venv/bin/python benchmarks/guidance_collision.py --deploy-episodes 100   # through serve + deploy
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, demos, machine, md_table, merge_json, served  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402
from tqdm import tqdm  # noqa: E402

import policies  # noqa: E402
from envs.metrics import wilson  # noqa: E402
from train.bc import TrainArgs, train  # noqa: E402
from policies.constraints import ArmGuidance  # noqa: E402
from policies.selection import ChunkCheck  # noqa: E402
from train.guided_eval import CHECK_CLEARANCE, GRIPPER_POINTS, LINKS, _plan, evaluate_collision  # noqa: E402

ENV = "maniskill/CollisionAvoidance-v1"
@dataclass(frozen=True)
class Row:
    """One method of the table: a guidance method with its options, the body its cost sees, and
    how the chunk to send is chosen (``check``: candidates, the hard check, a hold)."""

    method: str
    options: dict = field(default_factory=dict)
    body: Any = GRIPPER_POINTS
    """GRIPPER_POINTS (link origins) or LINKS (points on the hand's, fingers' and wrist's collision boxes)"""
    margin: float | None = None
    """metres of clearance the cost asks for (None: --margin)"""
    goal_weight: float | None = None
    """nats/m^2 (None: --goal-weight)"""
    check: ChunkCheck | None = None
    n_steps: int | None = None
    """flow steps (None: the policy's 10)"""
    scales: tuple[float, ...] | None = None
    """swept scales (None: --scales)"""
    margin_to_goal: bool = False
    """cap the margin by the room the goal leaves the hand's boxes, never under the check's clearance"""
    coast: float = 0.0
    """the check runs each chunk's path on by this fraction of its last step (the arm moves on in a hold)"""


# mc is left out: it needs samples of the *conditional* chunk distribution for each observation
# (it is defined for unconditional models with a data set); cfg takes no cost.
# coupled is the library default (diagonal Sigma_t, line-search step); coupled_jacobian_ls the Tweedie
# Sigma_t with the same step (one backward pass); coupled_linear is DESIGN.md's plain posterior-covariance
# step (no extra cost evaluations).
# The arm rows: the cost sees the hand's collision boxes (LINKS; the key points read 2-6 cm of clearance
# when the hand's edge touched), asks for 3 cm and pulls harder toward the goal; the executed waypoints
# are checked (1.5 cm from every obstacle, the boxes' points 2 cm apart) before a chunk is sent, and the
# robot holds for a step when they fail; `_fast` rows take 5 flow steps instead of 10 to fit 2x the
# unguided chunk time.
ARM = {"body": LINKS, "margin": 0.03, "goal_weight": 100.0, "scales": (10.0, 30.0, 100.0)}


def _trust_fast(check: ChunkCheck, **kw: Any) -> Row:
    """An arm row with the trust-region step over 5 flow steps, the chunk sent chosen by ``check``."""
    return Row("coupled", {"step": "trust", "radius": 3.0}, check=check, n_steps=5, **ARM, **kw)


CONFIGS: dict[str, Row] = {
    "coupled": Row("coupled"), "coupled_jacobian_ls": Row("coupled", {"sigma": "jacobian"}),
    "coupled_linear": Row("coupled", {"step": "linear"}),
    "velocity_gradient": Row("velocity_gradient"), "state_gradient": Row("state_gradient"),
    "pnp_renoise": Row("pnp_renoise"),
    "coupled_body": Row("coupled", **ARM),
    "coupled_body_checked": Row("coupled", check=ChunkCheck(), **ARM),
    "coupled_fast_checked": Row("coupled", check=ChunkCheck(), n_steps=5, **ARM),
    "coupled_trust_fast_checked": _trust_fast(ChunkCheck()),
    "coupled_trust_fast_retry": _trust_fast(ChunkCheck(retries=1)),
    # the recommended row's two failure modes, one fix each and both: a goal with less room than the margin
    # (the arm hovers where the goal's pull and the margin balance), and a state where the one guided sample
    # fails the check at every plan (a hold leaves the state, so the next sample fails alike)
    "coupled_trust_fast_goal_margin": _trust_fast(ChunkCheck(), margin_to_goal=True),
    "coupled_trust_fast_retry8": _trust_fast(ChunkCheck(retries=1, retry_candidates=8)),
    "coupled_trust_fast_goal_margin_retry8": _trust_fast(ChunkCheck(retries=1, retry_candidates=8), margin_to_goal=True),
    # ... and the check's coast, as the deploy defaults have it: a hold after a chunk that ends heading into an
    # obstacle lets the arm drift on into it (the one collision of the row above in 200 episodes)
    "coupled_trust_fast_goal_margin_retry8_coast": _trust_fast(ChunkCheck(retries=1, retry_candidates=8),
                                                               margin_to_goal=True, coast=ArmGuidance.coast),
    "state_gradient_fast_checked": Row("state_gradient", check=ChunkCheck(), n_steps=5, **ARM),
    "best_of_8_checked": Row("none", check=ChunkCheck(candidates=8), **{**ARM, "scales": (0.0,)}),
}
METHODS = tuple(CONFIGS)
FINAL_SEED = 5000


@dataclass
class Args:
    methods: tuple[str, ...] = METHODS
    scales: tuple[float, ...] = (1.0, 3.0, 10.0, 30.0, 100.0)
    """guidance scales swept (two decades)"""
    sweep_episodes: int = 20
    final_episodes: int = 100
    final_seed: int = FINAL_SEED
    """first seed of the reported episodes (the sweep uses 3000-3019). Another one re-checks the
    table's rows at their chosen scales on those episodes (no sweep), written to ``collision_rechecks``"""
    demos: int = 120
    dart_noise: float = 0.3
    train_steps: int = 2000
    margin: float = 0.05
    goal_weight: float = 30.0
    seed: int = 0
    quick: bool = False
    table_only: bool = False
    """rewrite the table, the recommendation and the plot from guidance.json (no rollouts)"""
    keep_other_rows: bool = False
    """keep the results of methods not run now (a partial rerun, e.g. after a default changed)"""
    goal_clearance: bool = False
    """only how much room each episode's goal leaves the hand (its collision boxes with the TCP at the goal,
    against the check's clearance and the arm rows' cost margin), and the recommended row's success by that
    room, on --final-episodes from --final-seed: writes ``collision_goal_clearance``"""
    deploy_episodes: int = 0
    """> 0: only the deploy stack. `groundflow serve` serves the trained policy, and `evaluate_via_server`
    drives the simulated arm through the client, control loop and safety layer. After each reset the
    client sends the scene's obstacles as deploy-time constraints (the server's defaults:
    ``policies.constraints.ArmGuidance``). Unguided through the same stack is the reference. Writes
    ``collision_deploy``."""


def main() -> None:
    a = tyro.cli(Args)
    unknown = [m for m in a.methods if m not in CONFIGS]
    if unknown:  # "none" (unguided) is always run as the reference row
        raise SystemExit(f"unknown --methods {unknown}; valid: {', '.join(CONFIGS)} (unguided 'none' always runs)")
    if a.quick:
        a.scales, a.sweep_episodes, a.final_episodes, a.train_steps = (3.0, 30.0), 4, 6, 300
    if a.table_only:  # no rollouts: neither demos nor a policy
        res = json.loads((RESULTS / "guidance.json").read_text())
        final = res["collision"]
        final["recommended"] = _recommend(final)
        merge_json(RESULTS / "guidance.json", {"collision": final})
        free = {"success_rate": res["collision_meta"]["no_obstacle_success"], "collision_rate": 0.0}
        return _write(final, res["collision_sweep"], res["collision_meta"], free, res["collision_meta"]["sweep_episodes"])
    data = demos(ENV, a.demos, seed=a.seed, dart_noise=a.dart_noise)
    out = ROOT / "runs" / "bench_guidance_collision" / f"s{a.seed}_n{a.demos}_st{a.train_steps}"
    if not (out / "ckpt").exists():
        train(TrainArgs(data=(data,), policy="flow", steps=a.train_steps, horizon=8, n_exec=4, out=out,
                        wandb="disabled", progress=False, seed=a.seed))
    pol = policies.load(out / "ckpt")
    if a.deploy_episodes > 0:
        return _deploy(a, out / "ckpt")
    if a.goal_clearance:
        return _goal_clearance(a, pol)
    if a.final_seed != FINAL_SEED:
        return _recheck(a, pol)
    t0 = time.time()
    sweep_seed, final_seed = 3000, a.final_seed
    ref = {"no_obstacle": evaluate_collision(pol, "none", 0.0, a.final_episodes, seed=final_seed, obstacles="none"),
           "none": evaluate_collision(pol, "none", 0.0, a.final_episodes, seed=final_seed)}
    sweep: dict[str, dict[str, dict]] = {}
    for m in a.methods:
        row = CONFIGS[m]
        scales = row.scales or a.scales
        sweep[m] = {f"{s:g}": _run(a, pol, row, s, a.sweep_episodes, sweep_seed)
                    for s in tqdm(scales, desc=f"sweep {m}")} if len(scales) > 1 else {}
    final: dict[str, dict] = {"none": {**ref["none"], "scale": 0.0}}
    for m in a.methods:
        row = CONFIGS[m]
        best = max(sweep[m].items(), key=lambda kv: (kv[1]["clean_success_rate"], -kv[1]["collision_rate"]))[0] \
            if sweep[m] else f"{(row.scales or a.scales)[0]:g}"
        final[m] = _run(a, pol, row, float(best), a.final_episodes, final_seed)
    interleaved = _time_interleaved(a, pol, {m: float(final[m]["scale"]) for m in a.methods})
    base_ms, base_nfe = final["none"]["ms_per_chunk"], final["none"]["nfe_per_chunk"]
    for r in final.values():
        _add_cis(r)
        r["time_ratio"] = r["ms_per_chunk"] / base_ms
        r["nfe_ratio"] = r["nfe_per_chunk"] / base_nfe
    for m, ratio in interleaved.items():
        final[m]["time_ratio_interleaved"] = ratio
    meta = {"env": ENV, "policy": "flow tiny, H=8, n_exec=4", "demos": a.demos, "dart_noise": a.dart_noise,
            "train_steps": a.train_steps, "margin_m": a.margin, "goal_weight": a.goal_weight,
            "sweep_episodes": a.sweep_episodes, "final_episodes": a.final_episodes, "final_seed": a.final_seed,
            "arm_rows": {"body": "links (cost: points 4 cm apart; check: 2 cm)", "margin_m": ARM["margin"],
                         "goal_weight": ARM["goal_weight"], "check_clearance_m": CHECK_CLEARANCE},
            "no_obstacle_success": ref["no_obstacle"]["success_rate"], "seconds": time.time() - t0,
            "machine": machine(), "skipped": {"mc": "needs conditional chunk samples per observation",
                                              "cfg": "takes no cost"}}
    if a.keep_other_rows:  # a rerun of some methods: rows of the others stay (each row has its own episodes)
        old = json.loads((RESULTS / "guidance.json").read_text()) if (RESULTS / "guidance.json").exists() else {}
        final = {**{k: v for k, v in old.get("collision", {}).items() if k not in final and k != "recommended"},
                 **final}
        sweep = {**{k: v for k, v in old.get("collision_sweep", {}).items() if k not in sweep}, **sweep}
        meta = {**old.get("collision_meta", {}), "rerun": {**meta, "methods": list(a.methods)}}
    final["recommended"] = _recommend(final)
    if a.quick:  # a smoke run: the table on the terminal, the results left as they were
        print(json.dumps({m: {k: r[k] for k in ("success_rate", "collision_rate", "time_ratio")}
                          for m, r in final.items() if isinstance(r, dict)}, indent=1))
        return
    merge_json(RESULTS / "guidance.json", {"collision": final, "collision_sweep": sweep, "collision_meta": meta})
    _write(final, sweep, meta, ref["no_obstacle"], a.sweep_episodes)


def _write(final: dict, sweep: dict, meta: dict, free: dict, sweep_episodes: int) -> None:
    """guidance_collision.md (the table, the sweep) and guidance_collision.png."""
    rows = [["no obstacles, unguided", "-", f"{free['success_rate']:.2f}", f"{free['collision_rate']:.2f}", "-", "-",
             "-", "-", "-", "-"]]
    for m, r in final.items():
        if not isinstance(r, dict):
            continue
        inter = r.get("time_ratio_interleaved")
        rows.append([f"**{m}**" if m == final.get("recommended") else m, f"{r['scale']:g}",
                     f"{r['success_rate']:.2f} [{r['success_ci95'][0]:.2f}, {r['success_ci95'][1]:.2f}]",
                     f"{r['collision_rate']:.2f} [{r['collision_ci95'][0]:.2f}, {r['collision_ci95'][1]:.2f}]",
                     f"{r['clean_success_rate']:.2f}", f"{r.get('hold_rate', 0.0):.2f}", f"{r['time_ratio']:.2f}",
                     "-" if inter is None else f"{inter:.2f}", f"{r['nfe_ratio']:.2f}", r["episodes"]])
    table = (f"## Collision avoidance (fresh episodes per row, best scale of a {sweep_episodes}-episode sweep; "
             f"recommended in bold: the highest success with <= 1% collisions within 2x the unguided chunk time "
             f"over the episodes)\n\n"
             + md_table(["method", "scale", "success [95% CI]", "collision [95% CI]", "clean success",
                         "holds / plan", "time/chunk vs none (episodes)", "time/chunk vs none (interleaved)",
                         "NFE vs none", "episodes"], rows))
    srows = [[m, s, f"{r['success_rate']:.2f}", f"{r['collision_rate']:.2f}", f"{r['clean_success_rate']:.2f}",
              f"{r['ms_per_chunk']:.1f}"] for m, d in sweep.items() for s, r in d.items()]
    table += "\n## Scale sweep\n\n" + md_table(["method", "scale", "success", "collision", "clean", "ms/chunk"], srows)
    table += f"\n{json.dumps({k: v for k, v in meta.items() if k != 'machine'})}\n"
    (RESULTS / "guidance_collision.md").write_text(table)
    print(table)
    _plot(sweep, free["success_rate"], RESULTS / "guidance_collision.png")


def _recheck(a: Args, pol: Any) -> None:
    """The table's rows (``--methods``) at the scales the table chose, on other episodes."""
    old = json.loads((RESULTS / "guidance.json").read_text())
    checks = old.get("collision_rechecks", {})
    for m in ("none", *a.methods):
        row = CONFIGS.get(m, Row("none"))
        r = _add_cis(_run(a, pol, row, float(old["collision"][m]["scale"]), a.final_episodes, a.final_seed))
        checks[f"{m}@{a.final_seed}"] = r
        print(f"{m}@{a.final_seed}: success {r['success_rate']:.2f} {r['success_ci95']}, collisions "
              f"{r['collision_rate']:.2f} {r['collision_ci95']}, holds {r.get('hold_rate', 0):.2f}", flush=True)
    merge_json(RESULTS / "guidance.json", {"collision_rechecks": checks})


def _goal_clearance(a: Args, pol: Any) -> None:
    """Where the recommended row fails: success by the clearance the goal leaves the hand's collision boxes
    (the check's spacing), each episode run alone (the same episode as in the table: reset and sampler
    seeded per episode)."""
    import envs
    from policies.constraints import goal_room
    from train.guided_eval import CHECK_SPACING, obstacles_of
    old = json.loads((RESULTS / "guidance.json").read_text())
    name = old["collision"]["recommended"]
    row, scale = CONFIGS[name], float(old["collision"][name]["scale"])
    env = envs.make(ENV, obstacles="random")
    margin, goal_weight = _weights(a, row)
    eps = []
    for seed in tqdm(range(a.final_seed, a.final_seed + a.final_episodes), desc="goal clearance"):
        env.reset(seed=seed)
        room = min(goal_room(env.raw.tcp_and_goal()[1], obstacles_of(env.raw), env.raw.body_points(CHECK_SPACING)))
        r = evaluate_collision(pol, row.method, scale, 1, seed=seed, options=row.options, body=row.body, margin=margin,
                               goal_weight=goal_weight, check=row.check, n_steps=row.n_steps, env=env,
                               margin_to_goal=row.margin_to_goal, coast=row.coast)
        eps.append({"seed": seed, "room_m": room, "success": bool(r["success_rate"]),
                    "collided": bool(r["collision_rate"])})
    env.close()
    bins = {"inside": (-1.0, 0.0), "under_check_clearance": (0.0, CHECK_CLEARANCE),
            "under_cost_margin": (CHECK_CLEARANCE, ARM["margin"]), "clear": (ARM["margin"], 1.0)}
    out = {"row": name, "scale": scale, "episodes": len(eps), "check_clearance_m": CHECK_CLEARANCE,
           "cost_margin_m": ARM["margin"], "success_rate": float(np.mean([e["success"] for e in eps])), "by_room": {}}
    for b, (lo, hi) in bins.items():
        sel = [e for e in eps if lo <= e["room_m"] < hi]
        out["by_room"][b] = {"episodes": len(sel), "successes": sum(e["success"] for e in sel),
                             "success_rate": float(np.mean([e["success"] for e in sel])) if sel else None}
        print(f"{b}: {len(sel)} episodes, {sum(e['success'] for e in sel)} succeed", flush=True)
    out["per_episode"] = eps
    old_rooms = old.get("collision_goal_clearance", {})
    merge_json(RESULTS / "guidance.json", {"collision_goal_clearance": {**old_rooms, str(a.final_seed): out}})


def _deploy(a: Args, ckpt: Path) -> None:
    """The policy behind `groundflow serve` on the simulated arm, on the same episodes (``a.final_seed``
    on): with the scene's obstacles sent as constraints (``ArmGuidance``'s defaults, and without the check's
    coast), and unguided."""
    import dataclasses
    from deploy.evaluate import evaluate_via_server
    rows: dict[str, Any] = {}
    for name, obstacles, settings in (("constrained", "scene", None),
                                      ("constrained_slide", "scene", ArmGuidance(fallback="slide")),
                                      ("constrained_no_coast", "scene", ArmGuidance(coast=0.0)),
                                      ("unguided", None, None)):
        t0 = time.time()
        with served(ckpt) as port:
            r = evaluate_via_server(ENV, f"127.0.0.1:{port}", a.deploy_episodes, seed=a.final_seed,
                                    env_options={"obstacles": "random"}, obstacles=obstacles, guidance=settings,
                                    max_steps=60)
        eps = r.pop("episodes")
        r.pop("record", None)
        r.update(minutes=(time.time() - t0) / 60, holds_per_episode=float(np.mean([e["constraint_holds"] for e in eps])),
                 timeouts=sum(not e["success"] and not e["collided"] for e in eps))
        rows[name] = r
        print(f"through the deploy stack, {name}: success {r['success_rate']:.2f} {r['ci95']}, collisions "
              f"{r['collision_rate']:.2f} {r['collision_ci95']}, round trip p50 {r['rtt_p50_ms']:.1f} ms", flush=True)
    old = json.loads((RESULTS / "guidance.json").read_text()).get("collision_deploy", {})
    old.update({str(a.final_seed): rows, "defaults": dataclasses.asdict(ArmGuidance()), "machine": machine()})
    merge_json(RESULTS / "guidance.json", {"collision_deploy": old})


def _add_cis(r: dict[str, Any]) -> dict[str, Any]:
    """``r`` with Wilson 95% intervals of its success and collision rates."""
    n = r["episodes"]
    r["success_ci95"] = list(wilson(round(r["success_rate"] * n), n))
    r["collision_ci95"] = list(wilson(round(r["collision_rate"] * n), n))
    return r


def _weights(a: Args, row: Row) -> tuple[float, float]:
    """The row's (margin, goal weight); the command line's where the row names none."""
    return (a.margin if row.margin is None else row.margin,
            a.goal_weight if row.goal_weight is None else row.goal_weight)


def _run(a: Args, pol: Any, row: Row, scale: float, episodes: int, seed: int) -> dict[str, Any]:
    margin, goal_weight = _weights(a, row)
    r = evaluate_collision(pol, row.method, scale, episodes, seed=seed, options=row.options, body=row.body,
                           margin=margin, goal_weight=goal_weight, check=row.check, n_steps=row.n_steps,
                           margin_to_goal=row.margin_to_goal, coast=row.coast)
    return {**r, "config": _describe(row)}


def _describe(row: Row) -> dict[str, Any]:
    return {"method": row.method, "options": row.options, "body": "links" if row.body == LINKS else "key_points",
            "margin": row.margin, "goal_weight": row.goal_weight, "n_steps": row.n_steps,
            "margin_to_goal": row.margin_to_goal, "coast": row.coast,
            "check": None if row.check is None else {"candidates": row.check.candidates, "retries": row.check.retries,
                                                     "retry_candidates": row.check.retry_candidates}}


def _time_interleaved(a: Args, pol: Any, scales: dict[str, float], states: int = 12, rounds: int = 3) -> dict[str, float]:
    """Chunk time of each method over unguided on the same states (the first ``states`` episodes'
    start, obstacles ahead), the methods taken in turn so that load on the machine falls on all of
    them alike: the median over states and rounds of each plan's time, cost build, check and
    retries included, over the unguided plan's median."""
    import envs
    env = envs.make(ENV, obstacles="random")
    obs = [env.reset(seed=a.final_seed + k)[0] for k in range(states)]
    times: dict[str, list[float]] = {m: [] for m in ("none", *scales)}
    for _ in range(rounds):
        for k, o in enumerate(obs):
            env.reset(seed=a.final_seed + k)
            for m in times:
                row = CONFIGS.get(m, Row("none"))
                torch.manual_seed(k)
                t = time.perf_counter()
                _plan(pol, env.raw, o, row.method, scales.get(m, 0.0), *_weights(a, row), row.options, row.body,
                      row.check, CHECK_CLEARANCE, row.n_steps, row.margin_to_goal, row.coast)
                times[m].append(time.perf_counter() - t)
    env.close()
    base = float(np.median(times.pop("none")))
    return {m: float(np.median(v)) / base for m, v in times.items()}


def _recommend(final: dict[str, dict]) -> str | None:
    """The method the README recommends: the highest clean success among rows with at most 1%
    collisions whose chunk time over the episodes is within 2x unguided; where no row is that fast,
    the highest clean success with at most 1% collisions (then: all rows)."""
    rows = {m: r for m, r in final.items() if m != "none" and isinstance(r, dict)}
    safe = {m: r for m, r in rows.items() if r["collision_rate"] <= 0.01}
    fast = {m: r for m, r in safe.items() if r["time_ratio"] <= 2.0}
    pool = fast or safe or rows
    return max(pool, key=lambda m: pool[m]["clean_success_rate"]) if pool else None


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
    axes[1].axhline(0.01, color="r", ls=":", lw=1, label="1% target")
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
