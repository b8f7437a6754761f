"""ManiSkill's motion-planning solutions (mplib) as step-by-step experts.

ManiSkill's solutions drive the env themselves. At ``reset`` we let the solution plan and run
on the env (recording its actions), then restore the initial simulator state; ``act`` replays
the recorded joint targets. The CPU simulator is deterministic, so the replay retraces the
planned episode (checked by the expert-success tests).
"""

from __future__ import annotations

import importlib
from typing import Any

import gymnasium as gym
import numpy as np

SOLUTIONS = {
    "PushCube-v1": "push_cube", "PullCube-v1": "pull_cube", "PickCube-v1": "pick_cube",
    "StackCube-v1": "stack_cube", "PegInsertionSide-v1": "peg_insertion_side",
    "PlugCharger-v1": "plug_charger", "LiftPegUpright-v1": "lift_peg_upright",
}


class _Recorder(gym.Wrapper):
    def __init__(self, env):
        super().__init__(env)
        self.actions: list[np.ndarray] = []

    def step(self, action):
        self.actions.append(np.asarray(action, dtype=np.float32).reshape(-1).copy())
        return self.env.step(action)


class MotionPlanningExpert:
    """Replays ManiSkill's mplib solution for the current episode; needs ``pd_joint_pos``."""

    def __init__(self, ms_id: str, noise: float = 0.0, seed: int | None = None):
        if ms_id not in SOLUTIONS:
            raise NotImplementedError(f"no motion-planning expert for {ms_id}; have {sorted(SOLUTIONS)}")
        self.ms_id = ms_id
        self.noise = float(noise)
        self.rng = np.random.default_rng(seed)
        self._actions: list[np.ndarray] = []
        self._i = 0
        self.planned_success = False

    def reset(self, env: Any, obs: dict) -> None:
        genv = env.unwrapped if hasattr(env, "unwrapped") else env  # through perturbation wrappers too
        if genv.control_mode != "pd_joint_pos":
            raise ValueError(f"the motion-planning expert acts in pd_joint_pos, env uses {genv.control_mode}")
        raw = genv.raw
        seed = genv._last_seed
        init = raw.get_state()
        mod = importlib.import_module(f"mani_skill.examples.motionplanning.panda.solutions.{SOLUTIONS[self.ms_id]}")
        rec = _Recorder(raw)
        # The solution resets with the seed itself: same seed -> same initial state as ours.
        try:
            res = mod.solve(rec, seed=seed, debug=False, vis=False)
        except Exception:  # planning failures (mplib) end the attempt like a failed plan
            res = -1
        self.planned_success = not (isinstance(res, int) and res == -1)
        self._actions = rec.actions
        self._i = 0
        raw.reset(seed=seed)
        raw.set_state(init)
        # The controller keeps its own target; re-derive it from the restored joint positions.
        raw.agent.controller.reset()

    def act(self, obs: dict) -> np.ndarray:
        if not self._actions:
            raise RuntimeError("motion planning found no plan for this episode")
        a = self._actions[min(self._i, len(self._actions) - 1)].copy()
        self._i += 1
        if self.noise > 0:
            a[:-1] += self.rng.normal(0, self.noise, size=a.shape[0] - 1).astype(np.float32)
        return a

    @property
    def done(self) -> bool:
        return self._i >= len(self._actions)


class ScriptedPushCubeExpert:
    """Closed-loop scripted expert for ManiSkill's ``PushCube-v1`` in ``pd_ee_delta_pos``.

    The motion planner plans a joint path per episode (about 4 episodes a minute per process) and
    replays it open loop. This reads the TCP, the cube and the goal every step and pushes with the
    tabletop suite's steering (``push_step``), so it is fast, recovers from its own noise, and labels
    any state (DART, DAgger).
    """

    def __init__(self, noise: float = 0.0, seed: int | None = None):
        self.noise = float(noise)
        self.rng = np.random.default_rng(seed)
        self.raw: Any = None

    def reset(self, env: Any, obs: dict | None = None) -> None:
        genv = env.unwrapped if hasattr(env, "unwrapped") else env
        if genv.control_mode != "pd_ee_delta_pos":
            raise ValueError(f"the scripted PushCube expert acts in pd_ee_delta_pos, env uses {genv.control_mode}")
        self.raw = genv.raw

    def act(self, obs: dict | None = None) -> np.ndarray:
        from envs.maniskill.tasks.table_scene import push_step
        if self.raw is None:
            raise RuntimeError("call expert.reset(env, obs) before act()")
        p = [x.pose.p[0].detach().cpu().numpy().astype(np.float64)
             for x in (self.raw.agent.tcp, self.raw.obj, self.raw.goal_region)]
        a = push_step(p[0], p[1], p[2], hover_z=0.10)
        if self.noise > 0:
            a[:3] = np.clip(a[:3] + self.rng.normal(0, self.noise, 3), -1, 1)
        return a.astype(np.float32)
