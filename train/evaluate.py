"""Rollouts of a policy in an env: success rate with a 95% Wilson interval, per instruction."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Sequence

import numpy as np
import torch
import tyro
from tqdm import tqdm

import envs
import policies
from envs.errors import InvalidOptionError
from envs.metrics import wilson  # noqa: F401  (re-exported for callers)
from policies.model import PolicyMismatchError, check_vocabulary, resolve_instruction


def check_compatible(policy: Any, env: Any) -> None:
    config = policy.config
    if config.action_dim != env.action_space.shape[0] or config.state_dim != env.state_dim:
        raise PolicyMismatchError(
            f"checkpoint has state/action dims ({config.state_dim}, {config.action_dim}) but env {env.env_id} has "
            f"({env.state_dim}, {env.action_space.shape[0]})")
    missing = [cam for cam in config.cameras if cam not in env.cameras]
    if missing:
        raise PolicyMismatchError(f"checkpoint needs cameras {missing}; env {env.env_id} provides {list(env.cameras)}")


@dataclass
class EvalResult:
    env_id: str
    episodes: int
    successes: int
    per_instruction: dict[str, dict[str, Any]] = field(default_factory=dict)
    other_task: int = 0
    seconds: float = 0.0
    confusion: dict[str, dict[str, int]] = field(default_factory=dict)
    """suites: commanded instruction -> what the episode ended with (the commanded task on success,
    else the first task the final scene satisfies, else "none") -> count"""

    @property
    def success_rate(self) -> float:
        return self.successes / max(self.episodes, 1)

    def to_dict(self) -> dict[str, Any]:
        lo, hi = wilson(self.successes, self.episodes)
        return {"env_id": self.env_id, "episodes": self.episodes, "successes": self.successes,
                "success_rate": self.success_rate, "ci95": [lo, hi],
                "did_other_task_rate": self.other_task / max(self.episodes, 1),
                "per_instruction": self.per_instruction, "confusion": self.confusion, "seconds": self.seconds}


def rollout(policy: Any, env: Any, seed: int, options: dict | None = None,
            act: Callable[[dict], np.ndarray] | None = None, frames: list | None = None,
            instruction: str | None = None) -> dict[str, Any]:
    """One episode; success if info["success"] at any step. ``instruction`` overrides obs text.

    The policy's sampling noise is drawn from torch's generator seeded with ``seed`` (the caller's
    generator state is put back afterwards): the same checkpoint and seed give the same episode in
    any process, given the same env history. Before, the noise depended on what the process had
    drawn earlier (training first or not), and one PushCube checkpoint scored 0.92 in one process
    and 1.00 in another. A reused ManiSkill env is not history-free: PhysX keeps state across
    resets that ``get_sim_state`` does not hold, so an episode can diverge by which episodes ran
    before it (``envs.make(..., reconfiguration_freq=1)`` rebuilds the scene at every reset and
    removes that, at about 0.13 s per reset on the tabletop suite)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _rollout(policy, env, seed, options, act, frames, instruction)


def _rollout(policy: Any, env: Any, seed: int, options: dict | None, act: Callable[[dict], np.ndarray] | None,
             frames: list | None, instruction: str | None) -> dict[str, Any]:
    obs, info = env.reset(seed=seed, options=options)
    if instruction is not None:
        obs["instruction"] = instruction
    policy.reset()
    success, done = False, None
    ever: set[int] = set()  # tasks completed at some step (a task can be undone later)
    for _ in range(env.max_episode_steps):
        action = (act or policy.select_action)(obs)
        obs, reward, term, trunc, info = env.step(action)
        if instruction is not None:
            obs["instruction"] = instruction
        if frames is not None:
            frames.append(_frame(env, obs))
        if info["success"]:
            success = True
            break
        done = info.get("completed_tasks")
        if done is not None:
            ever.update(int(i) for i in np.flatnonzero(np.asarray(done)))
        if trunc or term:
            break
    final = [] if done is None else [int(i) for i in np.flatnonzero(np.asarray(done))]
    return {"success": success, "other_task": bool(ever) and not success, "completed_at_end": final,
            "completed_ever": sorted(ever)}


def _frame(env: Any, obs: dict) -> np.ndarray:
    if obs.get("images"):
        return next(iter(obs["images"].values()))
    return env.render_frame() if hasattr(env, "render_frame") else np.zeros((64, 64, 3), np.uint8)


def evaluate(policy: Any, env_id: str, episodes: int = 20, seed: int = 1000, env_options: dict | None = None,
             instructions: list[str] | None = None, video_dir: Path | None = None, n_videos: int = 2,
             progress: bool = True, env: Any = None, on_episode: Callable[[int], None] | None = None,
             allow_unknown: bool = False) -> EvalResult:
    """Evaluate on ``episodes`` seeded episodes; suites cycle their instructions.

    ``allow_unknown``: run suite tasks the checkpoint was never trained on (their instruction encoded
    as is, as ``--allow-unknown`` asks) instead of refusing them up front.

    ``on_episode(n)`` is called after the n-th episode (train/parallel.py's shared progress bar)."""
    own = env is None
    env = env or envs.make(env_id, **(env_options or {}))
    check_compatible(policy, env)
    suite = getattr(env, "suite", None)
    instrs = instructions or (suite.instructions if suite else [env.instruction])
    if suite is not None and hasattr(policy, "lang") and not allow_unknown:
        check_vocabulary(policy, instrs, suite, what=f"the {suite.name} suite")
    res = EvalResult(env_id, 0, 0)
    t0 = time.time()
    for episode in tqdm(range(episodes), desc=f"eval {env_id}", disable=not progress, unit="ep"):
        instr = instrs[episode % len(instrs)]
        frames = [] if (video_dir and episode < n_videos) else None
        out = rollout(policy, env, seed + episode, options={"instruction": instr} if suite else None, frames=frames)
        res.episodes += 1
        res.successes += out["success"]
        res.other_task += out["other_task"]
        stats = res.per_instruction.setdefault(instr, {"episodes": 0, "successes": 0})
        stats["episodes"] += 1
        stats["successes"] += int(out["success"])
        if suite is not None:
            end = instr if out["success"] else (
                suite.tasks[out["completed_at_end"][0]].instruction if out["completed_at_end"] else "none")
            row = res.confusion.setdefault(instr, {})
            row[end] = row.get(end, 0) + 1
        if frames:
            _write_video(video_dir / f"episode_{episode:03d}.mp4", frames)
        if on_episode is not None:
            on_episode(episode + 1)
    for stats in res.per_instruction.values():
        stats["success_rate"] = stats["successes"] / stats["episodes"]
        stats["ci95"] = list(wilson(stats["successes"], stats["episodes"]))
    res.seconds = time.time() - t0
    if own:
        env.close()
    return res


def _write_video(path: Path, frames: list[np.ndarray]) -> None:
    import imageio.v2 as imageio
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        imageio.mimsave(path, frames, fps=20)
    except Exception as err:  # no ffmpeg: fall back to a GIF rather than failing the evaluation
        imageio.mimsave(path.with_suffix(".gif"), frames)
        print(f"video: mp4 writer unavailable ({err}); wrote {path.with_suffix('.gif')}")


@dataclass
class EvalArgs:
    """Roll a checkpoint out in an env and report success with a 95% CI."""

    ckpt: Path
    """checkpoint directory"""
    env: str | None = None
    """env id (default: the env the checkpoint was trained on)"""
    suite: str | None = None
    episodes: int = 20
    seed: int = 1000
    layout: str | None = None
    instructions: Annotated[tuple[str, ...], tyro.conf.arg(aliases=("--instruction",))] = ()
    """suites: evaluate on these instructions only (default: all of the suite's); a user's wording is
    resolved to the trained instruction it means, and one the checkpoint cannot ground is refused before
    any episode runs"""
    allow_unknown: bool = False
    """run an --instruction the checkpoint cannot ground as is (encoded on demand) instead of refusing it"""
    videos: int = 0
    """record this many episodes as mp4 under --out"""
    out: Path | None = None
    """where to write results.json (default: CKPT/eval_<env>.json)"""


def resolve_instructions(policy: Any, texts: Sequence[str], allow_unknown: bool = False) -> list[str]:
    """The trained instructions ``texts`` mean for ``policy`` (``policies.model.resolve_instruction``),
    each mapping printed; the first one the checkpoint cannot ground raises ``UnknownInstructionError``
    (one line: the resolver's reason and the trained instructions) unless ``allow_unknown``."""
    out = []
    for text in texts:
        resolved = resolve_instruction(policy, text, allow_unknown)
        if resolved != text:
            print(f"instruction {text!r} -> trained instruction {resolved!r}")
        out.append(resolved)
    return out


def eval_command(argv: list[str]) -> None:
    args = tyro.cli(EvalArgs, args=argv, prog="groundflow eval")
    if args.episodes < 1:  # 0 episodes used to report a success rate of 0.0 and exit 0
        raise InvalidOptionError(f"--episodes must be >= 1, got {args.episodes}")
    policy = policies.load(args.ckpt, to_act=True)
    instructions = resolve_instructions(policy, args.instructions, args.allow_unknown)  # before any env or episode
    meta = policies.read_checkpoint_meta(args.ckpt)
    env_id = envs.suite_env_id(args.suite) if args.suite else (args.env or meta.get("extra", {}).get("env_id"))
    if env_id is None:
        raise ValueError("give --env or --suite (the checkpoint does not name its env)")
    opts = dict(meta.get("extra", {}).get("env_options") or {}) if not args.suite else {}  # its controller, robot
    if args.layout:
        opts["layout"] = args.layout
    cams = policy.config.cameras
    if cams:
        opts.update(cameras=cams, image_size=meta.get("extra", {}).get("env_image_size", policy.config.image_size))
    out = args.out or (Path(args.ckpt) / f"eval_{env_id.replace('/', '_')}.json")
    res = evaluate(policy, env_id, args.episodes, args.seed, opts, instructions=instructions or None,
                   video_dir=out.parent / "videos" if args.videos else None, n_videos=args.videos,
                   allow_unknown=args.allow_unknown)
    results = res.to_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: results[k] for k in ("env_id", "episodes", "success_rate", "ci95", "did_other_task_rate")},
                     indent=2))
    for instr, stats in results["per_instruction"].items():
        print(f"  {stats['success_rate']:.2f} [{stats['ci95'][0]:.2f}, {stats['ci95'][1]:.2f}]  {instr}")
