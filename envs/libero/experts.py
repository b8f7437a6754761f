"""Scripted privileged-state experts for the 10 LIBERO-Goal tasks.

An expert is a list of skills run in order (``envs.libero.pick``: pick-and-place;
``envs.libero.fixtures``: drawers, the stove knob, pushing the plate). Skills read the true
simulator state through ``envs.libero.scene.Scene`` and command OSC_POSE deltas:

    expert = env.make_expert()          # the env's commanded task
    expert.reset(env, obs)
    action = expert.act(obs)

``reset`` works mid-episode (the P4 instruction switch, counterfactual relabeling): skills start
from whatever the state is, and an object held that the task does not need is let go first.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from envs.errors import InvalidOptionError
from envs.geometry import rotvec
from envs.libero.fixtures import FIXTURE_TASKS
from envs.libero.pick import PICK_TASKS
from envs.libero.scene import HOME, HOME_R, Release, Scene, Skill


def _task_skills() -> dict[int, Callable[[], list[Skill]]]:
    out = {**PICK_TASKS, **FIXTURE_TASKS}
    missing = sorted(set(range(10)) - set(out))
    if missing:
        raise NotImplementedError(f"no LIBERO-Goal expert for task(s) {missing}")
    return out


class LiberoGoalExpert:
    """Runs the commanded task's skills in order; ``task_id`` acts under another instruction."""

    def __init__(self, noise: float = 0.0, task_id: int | None = None, seed: int | None = None):
        if noise < 0:
            raise InvalidOptionError(f"expert noise must be >= 0, got {noise}")
        self.noise = float(noise)
        self.fixed_task = task_id
        self.rng = np.random.default_rng(seed)
        self.scene: Scene | None = None

    def reset(self, env: Any, obs: dict) -> None:
        env = env.unwrapped if hasattr(env, "unwrapped") else env
        self.scene = Scene(env)
        self.task_id = env.task_id if self.fixed_task is None else int(self.fixed_task)
        self.skills: list[Skill] = _task_skills()[self.task_id]()
        held = self.scene.held()
        kept = held is not None and getattr(self.skills[0], "keeps", lambda n: False)(held)
        eef, R = self.scene.eef()
        away = np.linalg.norm(eef - HOME) > 0.05 or np.linalg.norm(rotvec(HOME_R @ R.T)) > 0.3
        if not kept and away:
            self.skills.insert(0, Release())
        self.skills[0].start(self.scene)
        self.last_grip = -1.0

    def act(self, obs: dict) -> np.ndarray:
        if self.scene is None:
            raise RuntimeError("call expert.reset(env, obs) before act(obs)")
        a = None
        while self.skills:
            a = self.skills[0].act(self.scene)
            if a is not None:
                break
            self.skills.pop(0)
            if self.skills:
                self.skills[0].start(self.scene)
        if a is None:  # every skill done: hold still
            a = np.zeros(7, dtype=np.float32)
            a[6] = self.last_grip
        self.last_grip = float(a[6])
        if self.noise > 0:
            a[:3] = np.clip(a[:3] + self.rng.normal(0.0, self.noise, 3), -1, 1)
        return a
