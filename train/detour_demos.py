"""Demonstrations that detour around obstacles the evaluation never uses (``groundflow collect --detours``).

Guided at test time around a keep-out ball, a policy leaves its demonstrated path, and a policy cloned from
clean demos often cannot finish from where the detour left it: on relocate the palm, pushed under the ball,
reaches the object low and knocks it away (runs/bench_guidance_adroit, seeds 3000+). DART's isotropic action
noise did not teach the way back (docs/guidance.md). These demos show it: each episode the Adroit expert runs
through the keep-out safety filter (``KeepOut.filter``) around a random ball placed on its own path, and the
expert's own, unfiltered action is recorded, as in DART. The ball is not an input of the policy, and no
training ball overlaps the task's evaluation ball (``train.constrained_eval.KEEPOUTS``), so the constraint a
benchmark tests stays unseen.

Units: metres (world frame), steps of the env.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.errors import InvalidOptionError
from train.constrained_eval import KEEPOUTS, KeepOut

RADIUS = (0.04, 0.07)
"""metres: each training ball's radius is drawn uniformly in this range (the evaluation balls: 5 and 6 cm)"""
WINDOW = (6, 40)
"""steps: the ball is centred near where the expert's palm is at a step drawn in this range (the reach)"""
JITTER = 0.02
"""metres: std of the centre's offset from the expert's palm, per axis"""
TRIES = 50
"""draws per episode before an episode with no ball clear of the evaluation ball is skipped"""


class DetourBalls:
    """Per episode, a keep-out ball on the expert's own path, clear of the evaluation ball."""

    def __init__(self, env: Any, expert: Any, seed: int) -> None:
        task = getattr(getattr(env.unwrapped, "task", None), "name", None)
        if not str(getattr(env, "env_id", "")).startswith("adroit/") or task is None:
            raise InvalidOptionError(f"--detours needs an Adroit env (its keep-out filter and palm kinematics); "
                                     f"got {getattr(env, 'env_id', env)!r}")
        self.env, self.expert = env, expert
        self.avoid = KEEPOUTS.get(task)
        self.template = KeepOut(task, (0.0, 0.0, 0.0), RADIUS[0], "a random ball on the expert's path (detour demos)")
        self.template.bind(env)
        self.rng = np.random.default_rng(seed + 2_147_483)

    def _palm_path(self, seed: int) -> list[np.ndarray]:
        """Where the expert's palm goes over the reach of episode ``seed`` when nothing is in the way."""
        obs, _ = self.env.reset(seed=seed)
        self.expert.reset(self.env, obs)
        path = []
        for _ in range(WINDOW[1]):
            obs, _, _, trunc, info = self.env.step(self.expert.act(obs))
            path.append(np.array(self.env.unwrapped_mujoco.data.site(self.template.site).xpos))
            if info["success"] or trunc:
                break
        return path

    def ball(self, seed: int) -> KeepOut | None:
        """The ball of episode ``seed`` (the env is reset and stepped: reset it again before the episode), or
        None when every draw overlapped the evaluation ball."""
        path = self._palm_path(seed)
        for _ in range(TRIES):
            t = int(self.rng.integers(min(WINDOW[0], len(path) - 1), len(path)))
            radius = float(self.rng.uniform(*RADIUS))
            center = path[t] + self.rng.normal(0.0, JITTER, 3)
            avoid = self.avoid
            if avoid is None or np.linalg.norm(center - np.asarray(avoid.center)) >= radius + avoid.radius:
                return self.template.moved(center, radius)
        return None


__all__ = ["DetourBalls", "JITTER", "RADIUS", "TRIES", "WINDOW"]
