"""Collect expert demonstrations into the dataset format (``groundflow collect``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import tyro
from tqdm import tqdm

import envs
from envs.errors import InvalidOptionError
from dataset import DatasetWriter, EpisodeBuffer
from dataset.hdf5 import check_output_path


@dataclass
class CollectArgs:
    """Run an env's privileged expert and write its episodes to a dataset."""

    env: str | None = None
    """env id (see `groundflow envs`); or use --suite"""
    suite: str | None = None
    """multi-instruction suite name (tabletop, kitchen); instructions are cycled per episode"""
    episodes: int = 10
    """number of episodes to write"""
    out: Path = Path("data/demos.h5")
    """output HDF5 file (written atomically)"""
    seed: int = 0
    """seed of the first attempt; attempt i uses seed + i"""
    cameras: tuple[str, ...] = ()
    """cameras to record (empty: state only)"""
    image_size: int = 128
    layout: str | None = None
    """suites: random (instruction independent of layout) or correlated (layout predicts the task);
    LIBERO: task (LIBERO's init states: its evaluation set), random, or sampled (fresh placements, for demos)"""
    layout_rho: float | None = None
    """suites with --layout correlated: probability that an episode's layout names its task (the
    other episodes get the seed's random layout); default 1"""
    instructions: tuple[str, ...] = ()
    """suites: restrict to these instructions (default: all)"""
    noise: float = 0.0
    """expert action noise (std, in the expert's units): the noisy action is executed AND recorded"""
    dart_noise: float = 0.0
    """DART (Laskey et al. 2017): execute the expert action plus N(0, dart_noise^2) (clipped to the
    action space) but record the clean expert action, so demos visit states off the expert's path
    and show how to get back; for policies that must recover from a detour (guided collision runs)"""
    detours: bool = False
    """Adroit: each episode the expert runs through the keep-out safety filter around a random ball on its
    own path (never overlapping the task's evaluation ball) and its own action is recorded, so demos show
    how to finish after a detour (train/detour_demos.py); the balls are in the dataset's meta"""
    randomize: tuple[str, ...] = ()
    """domain randomization of what the cameras see, 'FAMILY=MAGNITUDE' (envs/perturbations.py), each
    episode drawing up to that magnitude: e.g. camera=0.08 (metres, and 100x that in degrees of turn;
    'camera=0.08:CAM1,CAM2' moves only those cameras, e.g. the fixed one and not the wrist's)
    lighting=0.6; the images change, the expert and the recorded state do not"""
    student: Path | None = None
    """DAgger (Ross et al. 2011): a checkpoint that acts while the expert labels. Each step executes the
    student's action (the expert's with probability --student-beta) and records the expert's, so the
    data covers the states the student reaches; every episode is written (its failures are the point).
    Needs a closed-loop expert and the student's cameras (--cameras)"""
    student_beta: float = 0.0
    """DAgger: probability per step of executing the expert's action instead of the student's"""
    keep_failures: bool = False
    """also write episodes where the expert failed"""
    max_attempts: int | None = None
    """give up after this many attempts (default 3x episodes)"""
    overwrite: bool = False
    """replace an existing --out, or the .partial file (and .episodes/ journal) a killed run left (refused
    otherwise, in one line saying how many of its episodes are recoverable and how)"""
    control_mode: str | None = None
    """ManiSkill: the controller the demos act in (default: the env's; ManiSkill's PushCube-v1 has a fast
    closed-loop scripted expert in pd_ee_delta_pos, its motion planner acts in pd_joint_pos)"""
    robot: str | None = None
    """ManiSkill: the robot (robot_uids), e.g. panda_wristcam for a wrist camera (hand_camera) on
    ManiSkill's own tasks"""
    env_options: dict[str, Any] = field(default_factory=dict)
    """extra options passed to envs.make"""
    progress: bool = True


RANDOMIZABLE = ("camera", "lighting")


def _randomized(env: Any, specs: tuple[str, ...], seed: int) -> Any:
    """``env`` wrapped in an up-to-magnitude perturbation per 'FAMILY=MAGNITUDE' spec."""
    from envs.perturbations import perturb
    for i, spec in enumerate(specs):
        family, sep, mag = spec.partition("=")
        if family not in RANDOMIZABLE or not sep:
            raise InvalidOptionError(f"--randomize {spec!r}: expected FAMILY=MAGNITUDE with FAMILY one of "
                                     f"{list(RANDOMIZABLE)}, e.g. camera=0.08")
        mag, _, cams = mag.partition(":")
        try:
            magnitude = float(mag)
        except ValueError:
            raise InvalidOptionError(f"--randomize {spec!r}: {mag!r} is not a number") from None
        kw = {"cameras": tuple(c for c in cams.split(",") if c)} if cams and family == "camera" else {}
        env = perturb(env, family, magnitude=magnitude, seed=seed + 104729 * (i + 1), up_to=True, **kw)
    return env


def collect(args: CollectArgs, on_episode: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write ``args.episodes`` expert episodes; ``on_episode(n)`` is called after the n-th is written."""
    if (args.env is None) == (args.suite is None):
        raise InvalidOptionError("give exactly one of --env or --suite")
    if args.episodes < 1:
        raise InvalidOptionError(f"--episodes must be >= 1, got {args.episodes}")
    check_output_path(args.out)  # before the env starts: a directory used to fail only after every episode
    env_id = envs.suite_env_id(args.suite) if args.suite else args.env
    options = dict(args.env_options)
    options.update({k: v for k, v in (("control_mode", args.control_mode), ("robot_uids", args.robot)) if v})
    if args.cameras:
        options.update(cameras=tuple(args.cameras), image_size=args.image_size)
    if args.layout is not None:
        options["layout"] = args.layout
    if args.layout_rho is not None:
        options["layout_rho"] = args.layout_rho
    env = _randomized(envs.make(env_id, **options), args.randomize, args.seed)
    suite = getattr(env, "suite", None)
    tasks = [suite.task(i) for i in args.instructions] if (suite and args.instructions) else (
        list(suite.tasks) if suite else [None])
    expert = env.make_expert(noise=args.noise, seed=args.seed)
    student = _student(args, env, expert)
    student_rng = np.random.default_rng(args.seed + 104_729)
    meta = {"source": "expert", "seed": args.seed, "noise": args.noise, "layout": args.layout,
            "layout_rho": options.get("layout_rho"),
            "env_options": {k: v for k, v in options.items() if isinstance(v, (int, float, str, bool))},
            "suite": suite.name if suite else None,
            "instructions": [t.instruction for t in tasks] if suite else [env.instruction],
            "control_mode": getattr(env, "control_mode", None), "randomize": list(args.randomize),
            "student": str(args.student) if args.student else None, "student_beta": args.student_beta}
    if args.dart_noise < 0:
        raise InvalidOptionError(f"--dart-noise must be >= 0, got {args.dart_noise}")
    meta["dart_noise"] = args.dart_noise
    detours = _detours(args, env, expert, student)
    meta["detours"] = args.detours
    balls: list[dict] = []
    meta["state_layout"] = env.unwrapped.state_layout
    dart_rng = np.random.default_rng(args.seed + 7919)
    low, high = env.action_space.low, env.action_space.high
    attempts_max = args.max_attempts or 3 * args.episodes
    written = attempts = successes = steps = 0
    episode_layouts: list[str] = []  # per written episode, where the suite says (layout_rho < 1 mixes them)
    t0 = time.time()
    bar = tqdm(total=args.episodes, desc=f"collect {env_id}", disable=not args.progress, unit="ep")
    with DatasetWriter(args.out, env_id, env.state_dim, env.action_space.shape[0], tuple(args.cameras),
                       meta=meta, overwrite=args.overwrite) as writer:
        while written < args.episodes and attempts < attempts_max:
            task = tasks[written % len(tasks)]
            seed = args.seed + attempts
            attempts += 1
            ball = detours.ball(seed) if detours is not None else None
            if detours is not None and ball is None:
                continue
            obs, info = env.reset(seed=seed, options={"task_id": task.task_id} if task else None)
            expert.reset(env, obs)
            if student is not None:
                student.reset()
                torch.manual_seed(seed)  # the student's sampling noise: the same episode on any machine state
            buf = EpisodeBuffer(obs["instruction"], env.task_id, seed)
            for _ in range(env.max_episode_steps):
                sim = env.get_sim_state()
                action = expert.act(obs)
                if student is not None and student_rng.random() >= args.student_beta:
                    executed = np.asarray(student.select_action(obs), dtype=action.dtype)
                else:
                    executed = action if args.dart_noise == 0 else np.clip(
                        action + dart_rng.normal(0, args.dart_noise, action.shape), low, high).astype(action.dtype)
                if ball is not None:
                    executed = ball.filter(executed, env)
                nobs, reward, term, trunc, info = env.step(executed)
                buf.add(obs, action, reward, info["success"], sim)
                obs = nobs
                if info["success"] or trunc:
                    break
            steps += len(buf)
            ep = buf.finish(obs, env.get_sim_state())
            successes += ep.succeeded
            if ep.succeeded or args.keep_failures or student is not None:
                writer.add(ep)
                written += 1
                if ball is not None:
                    balls.append({"seed": seed, "center": list(ball.center), "radius": ball.radius})
                layout = _episode_layout(env)
                if layout is not None:
                    episode_layouts.append(layout)
                bar.update(1)
                if on_episode is not None:
                    on_episode(written)
            bar.set_postfix(success=f"{successes}/{attempts}")
        if episode_layouts:
            meta["episode_layouts"] = episode_layouts
        if balls:
            meta["detour_balls"] = balls
        writer.f.attrs["meta"] = __import__("json").dumps({**meta, "attempts": attempts, "expert_successes": successes})
    bar.close()
    env.close()
    dt = time.time() - t0
    if written < args.episodes:
        print(f"warning: wrote {written}/{args.episodes} episodes after {attempts} attempts (expert success "
              f"{successes}/{attempts})")
    return {"env_id": env_id, "episodes": written, "attempts": attempts, "expert_success_rate": successes / max(attempts, 1),
            "steps": steps, "seconds": dt, "steps_per_s": steps / max(dt, 1e-9), "out": str(args.out)}


def _student(args: CollectArgs, env: Any, expert: Any) -> Any:
    """The DAgger student of ``--student`` (None without one), checked against the env and the expert."""
    if args.student is None:
        return None
    if not 0 <= args.student_beta < 1:
        raise InvalidOptionError(f"--student-beta must be in [0, 1), got {args.student_beta}")
    from envs.maniskill.experts import MotionPlanningExpert
    if isinstance(expert, MotionPlanningExpert):
        raise InvalidOptionError(f"--student: {env.env_id}'s expert replays a motion plan made at reset, so it cannot "
                                 "label the states a student reaches; use a closed-loop expert (e.g. PushCube-v1 "
                                 "with --control-mode pd_ee_delta_pos, the suites)")
    import policies
    from train.evaluate import check_compatible
    student = policies.load(args.student, to_act=True)
    check_compatible(student, env)
    return student


def _detours(args: CollectArgs, env: Any, expert: Any, student: Any) -> Any:
    """The per-episode balls of ``--detours`` (None without it)."""
    if not args.detours:
        return None
    if args.dart_noise or student is not None:
        raise InvalidOptionError("--detours records the expert detouring on its own; it does not combine with "
                                 "--dart-noise or --student")
    from train.detour_demos import DetourBalls
    return DetourBalls(env, expert, args.seed)


def _episode_layout(env: Any) -> str | None:
    """The layout the env's current episode got ("random" / "correlated"), where the suite says."""
    layout = getattr(env, "episode_layout", None)
    if layout is None:
        layout = getattr(getattr(env, "raw", None), "episode_layout", None)
    return None if layout is None else str(layout)


def collect_command(argv: list[str]) -> None:
    """``groundflow collect``: parse ``CollectArgs``, collect, print the summary as JSON."""
    args = tyro.cli(CollectArgs, args=argv, prog="groundflow collect")
    print(json.dumps(collect(args), indent=2))
