"""Counterfactual relabeling (CAST-like upper bound): the expert's actions for other instructions
at the states of a suite's demos (``groundflow relabel``).

For a demo of ``l`` and a stored state ``s_t`` of it, the simulator is put back in ``s_t`` and the
privileged expert acts for another instruction ``l'`` from there: the relabeled sample is
``(o_t, l', a*(l'))``, recorded as a short expert continuation of up to ``horizon`` steps under
``l'`` (stopping early when ``l'`` is done), so chunked policies get whole chunks; with
``horizon=1`` they are single-step episodes (the loader pads the rest of a chunk). Relabeled
episodes carry the canonical instruction of ``l'`` and the source episode's seed.

How a state is restored: reset under ``l'`` (so the env scores ``l'``), restore the simulator
state stored before step ``t - 1``, replay the demo's action ``t - 1``, then restore the stored
state of step ``t`` exactly and observe it. The replayed step refreshes the contacts: the tabletop
expert reads the grasp from the simulator's contacts, which a bare ``set_sim_state`` leaves as
they were at the last simulated step (of another episode); a replay alone lands a few mm off the
stored state (PhysX keeps solver caches outside the state). For ``t = 0`` the stored initial
state is restored and observed (nothing is grasped yet).

Both suites' experts act from any mid-episode state for any task: the tabletop expert is a
stateless closed loop (``TabletopExpert``); the kitchen's state-machine expert infers its phase
from the state when it is reset (``PickPlaceExpert.reset``). Envs whose expert cannot take another
task (single-task envs) are refused.

    groundflow collect --suite tabletop --episodes 96 --layout correlated --out data/tt.h5
    groundflow relabel --data data/tt.h5 --k 2 --frames-per-episode 4 --horizon 8 --out data/tt_cf.h5
    groundflow train --policy flow --data data/tt_cf.h5 ...      # originals + relabeled episodes
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tyro
from tqdm import tqdm

import envs
from envs.errors import InvalidOptionError
from dataset import Dataset, DatasetError, DatasetWriter, Episode, EpisodeBuffer


@dataclass
class RelabelArgs:
    """Relabel a suite's demos with the expert's actions for other instructions (CAST-like)."""

    data: Path
    """source demos of a multi-instruction suite, with per-step sim_state (from `groundflow collect`)"""
    out: Path = Path("data/relabeled.h5")
    """output HDF5 file (written atomically)"""
    k: int = 2
    """counterfactual instructions per relabeled state (fewer if the pool is smaller)"""
    frames_per_episode: int = 4
    """demo states relabeled per episode, drawn uniformly without replacement (0: every state)"""
    horizon: int = 8
    """expert steps recorded under l' from each state (1: single-step samples); stops when l' is done"""
    instructions: tuple[str, ...] = ()
    """pool of counterfactual instructions (default: the instructions of the source data)"""
    include_original: bool = True
    """copy the source demos into --out first, so one file holds everything to train on"""
    seed: int = 0
    """seed of the frame and instruction draws"""
    overwrite: bool = False
    """replace an existing --out"""
    progress: bool = True


def _positive(name: str, v: Any, zero_ok: bool = False) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (0 if zero_ok else 1):
        raise InvalidOptionError(f"--{name.replace('_', '-')} must be an int >= {0 if zero_ok else 1}, got {v!r}")
    return int(v)


def _env_for(ds: Dataset) -> Any:
    """The env the demos came from (their env options, cameras at their size; layout left at its
    default: every relabeled state is restored from the data)."""
    opts = {k: v for k, v in dict(ds.meta.get("env_options") or {}).items() if k not in ("layout", "layout_rho")}
    if ds.cameras:
        opts["cameras"] = tuple(ds.cameras)
    return envs.make(ds.env_id, **opts)


def restore(env: Any, ep: Episode, t: int, task_id: int) -> dict:
    """Put ``env`` in the stored state of step ``t`` of ``ep`` with ``task_id`` commanded; returns
    the observation there. Steps ``t > 0`` are reached by replaying step ``t - 1`` first (fresh
    contacts), then restored exactly."""
    env.reset(seed=ep.seed, options={"task_id": int(task_id)})
    if t > 0:
        env.set_sim_state(ep.sim_state[t - 1])
        env.step(ep.action[t - 1])
    env.set_sim_state(ep.sim_state[t])
    return env.observe()


def continuation(env: Any, obs: dict, task_id: int, horizon: int, instruction: str, seed: int | None) -> Episode:
    """Up to ``horizon`` expert steps for ``task_id`` from the env's current state (stops when done)."""
    expert = env.make_expert(task_id=int(task_id))
    expert.reset(env, obs)
    buf = EpisodeBuffer(instruction, int(task_id), seed)
    for _ in range(horizon):
        obs = {**obs, "instruction": instruction}
        sim = env.get_sim_state()
        action = expert.act(obs)
        nobs, reward, _, trunc, info = env.step(action)
        buf.add(obs, action, reward, info["success"], sim)
        obs = nobs
        if info["success"] or trunc:
            break
    return buf.finish(obs, env.get_sim_state())


def relabel(args: RelabelArgs) -> dict[str, Any]:
    """Write ``args.out``: the source demos (``include_original``) and, for ``frames_per_episode``
    states of each demo and ``k`` other instructions each, the expert's continuation under that
    instruction. Returns a summary (counts, how many continuations reached their task)."""
    k = _positive("k", args.k)
    horizon = _positive("horizon", args.horizon)
    per_ep = _positive("frames_per_episode", args.frames_per_episode, zero_ok=True)
    if Path(args.out).resolve() == Path(args.data).resolve():
        raise InvalidOptionError(f"--out {args.out} is the source dataset; write to another path")
    t0 = time.time()
    with Dataset(args.data) as ds:
        episodes = list(ds)
        meta, env_id, cameras = dict(ds.meta), ds.env_id, ds.cameras
        if envs.spec(env_id).kind != "suite":
            raise InvalidOptionError(f"{args.data}: relabeling needs demos of a multi-instruction suite (its expert "
                                     f"acts for any instruction); {env_id} has one task. Suites: "
                                     f"{envs.list_envs(kind='suite')}")
        missing = [i for i, ep in enumerate(episodes) if ep.sim_state is None]
        if missing:
            raise DatasetError(f"{args.data}: episodes {missing[:5]} have no sim_state (relabeling restores the "
                               "simulator at demo states; collect with `groundflow collect`, which stores it)")
        env = _env_for(ds)
    try:
        suite = env.suite
        source = sorted({ep.instruction for ep in episodes})
        pool = [suite.task(l).instruction for l in (args.instructions or source)]
        pool = list(dict.fromkeys(pool))
        if len(pool) < 2:
            raise InvalidOptionError(f"need >= 2 instructions to relabel with, got {pool} (pass --instructions)")
        rng = np.random.default_rng(args.seed)
        plan: list[tuple[int, int, int]] = []  # (source episode, frame, counterfactual task id)
        for i, ep in enumerate(episodes):
            own = suite.task(ep.instruction).task_id
            cands = [suite.task(l).task_id for l in pool if suite.task(l).task_id != own]
            T = len(ep)
            frames = range(T) if per_ep == 0 else sorted(rng.choice(T, size=min(per_ep, T), replace=False).tolist())
            for t in frames:
                for tid in rng.choice(cands, size=min(k, len(cands)), replace=False).tolist():
                    plan.append((i, int(t), int(tid)))
        rel_to_out = os.path.relpath(Path(args.data).resolve(), Path(args.out).resolve().parent)
        out_meta = {**meta, "source": "relabel",
                    "instructions": sorted(set(pool) | set(source)),
                    "relabel": {"from": str(args.data),  # as given; from_relative: from the output's folder
                                "from_relative": rel_to_out,
                                "k": k, "frames_per_episode": per_ep, "horizon": horizon,
                                "instructions": pool, "include_original": args.include_original, "seed": args.seed,
                                "n_original": len(episodes) if args.include_original else 0,
                                "index": [list(p) for p in plan]}}
        reached = steps = 0
        per_target: Counter = Counter()
        bar = tqdm(total=len(plan), desc=f"relabel {env_id}", disable=not args.progress, unit="ep")
        with DatasetWriter(args.out, env_id, env.state_dim, env.action_space.shape[0], cameras,
                           meta=out_meta, overwrite=args.overwrite) as writer:
            if args.include_original:
                for ep in episodes:
                    writer.add(ep)
            for i, t, tid in plan:
                ep = episodes[i]
                obs = restore(env, ep, t, tid)
                cont = continuation(env, obs, tid, horizon, suite.tasks[tid].instruction, ep.seed)
                writer.add(cont)
                reached += cont.succeeded
                steps += len(cont)
                per_target[suite.tasks[tid].instruction] += 1
                bar.update(1)
        bar.close()
    finally:
        env.close()
    n = len(plan)
    return {"env_id": env_id, "out": str(args.out), "original_episodes": len(episodes) if args.include_original else 0,
            "relabeled_episodes": n, "relabeled_steps": steps, "horizon": horizon,
            "reached_within_horizon": reached / n if n else 0.0, "per_instruction": dict(per_target),
            "seconds": time.time() - t0}


def relabel_command(argv: list[str]) -> None:
    args = tyro.cli(RelabelArgs, args=argv, prog="groundflow relabel")
    print(json.dumps(relabel(args), indent=2))
