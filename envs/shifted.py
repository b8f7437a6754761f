"""Shifted-physics twins of the simulators: a stand-in "real robot" for tests and benchmarks.

    real = make_shifted("maniskill/PushCube-v1", mass_scale=1.3, friction_scale=0.7,
                        action_delay=1, obs_noise=0.002, seed=0, control_mode="pd_ee_delta_pos")

The twin keeps the nominal simulator's observation and simulator-state layout (so a trajectory
recorded on it can be replayed and patched in the nominal simulator), and changes:

- ``mass_scale``: mass and inertia of the free objects (ManiSkill: every non-kinematic actor
  outside the robot; MuJoCo: the bodies named in ``bodies``, default every body but the world).
- ``friction_scale``: sliding friction (ManiSkill: the objects' collision materials, copied so
  the scene's shared material is untouched; MuJoCo: ``geom_friction[:, 0]`` of all geoms).
- ``damping_scale``: joint damping (ManiSkill: the robot's joint drive damping; MuJoCo:
  ``dof_damping``).
- ``gain_scale``: actuator gain (ManiSkill: joint drive stiffness; MuJoCo: ``actuator_gainprm[:, 0]``
  and, for servos, ``actuator_biasprm[:, 1:3]``, so a position servo keeps its set point and
  only its stiffness changes).
- ``action_delay``: the command issued at step t takes effect at step t + d (before the first
  command arrives, the first command is held).
- ``obs_noise``: Gaussian noise (std, in state units) on ``obs["state"]``; the simulator state
  stays exact.

``set_shift(...)`` changes the physics parameters mid-episode (used for injected mass or
friction jumps). Same seed -> same episode, noise included.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

import numpy as np

from envs.base import GroundflowEnv, Obs
from envs.errors import InvalidOptionError
from envs.physics import PHYSICS_FIELDS, PhysicsShift
from envs.registry import make as make_env

__all__ = ["PHYSICS_FIELDS", "PhysicsShift", "ShiftedEnv", "shift_env", "make_shifted"]


class ShiftedEnv(GroundflowEnv):
    """Wraps a groundflow env; same observation and sim-state layout, shifted physics."""

    def __init__(self, base: GroundflowEnv, shift: PhysicsShift = PhysicsShift(), seed: int | None = None,
                 bodies: tuple[str, ...] | None = None):
        self.base = base
        self.shift = shift.validate()
        self.physics = base.make_physics(tuple(bodies) if bodies is not None else None)
        if self.physics is None and shift.changes_physics:
            raise InvalidOptionError(f"{base.env_id}: backend {base.backend!r} has no physics parameters to shift; "
                                     "only action_delay and obs_noise apply (valid physics backends: "
                                     "maniskill, adroit, robosuite)")
        super().__init__(base.state_dim, base.action_low, base.action_high, cameras=base.cameras,
                         image_size=base.image_size, max_episode_steps=base.max_episode_steps,
                         instruction=base.instruction)
        self.env_id, self.backend = base.env_id, base.backend
        self.seed = 0 if seed is None else int(seed)
        self._queue: deque[np.ndarray] = deque()
        self._rng = np.random.default_rng(self.seed)
        self._current = self.shift
        if self.physics is not None:
            self.physics.apply(self.shift)

    def __getattr__(self, name: str) -> Any:  # raw, rs, unwrapped_mujoco, suite, make_expert ...
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def instructions(self) -> list[str]:
        return self.base.instructions

    def set_shift(self, **changes: Any) -> None:
        """Change physics parameters now (mid-episode); ``restore_shift()`` returns to the twin's own."""
        bad = sorted(set(changes) - set(PHYSICS_FIELDS))
        if bad:
            raise InvalidOptionError(f"set_shift: unknown field(s) {bad}; valid: {list(PHYSICS_FIELDS)}")
        if self.physics is None:
            raise InvalidOptionError(f"{self.env_id}: backend {self.backend!r} has no physics parameters")
        self._current = replace(self._current, **changes).validate()
        self.physics.apply(self._current)

    def restore_shift(self) -> None:
        self._current = self.shift
        if self.physics is not None:
            self.physics.apply(self.shift)

    def _noisy(self, state: np.ndarray) -> np.ndarray:
        if self.shift.obs_noise <= 0:
            return state
        return (state + self._rng.normal(0.0, self.shift.obs_noise, size=state.shape)).astype(np.float32)

    def _reset(self, seed, options):
        obs, info = self.base.reset(seed=seed, options=options)
        self.instruction, self.task_id = self.base.instruction, self.base.task_id
        self._rng = np.random.default_rng([self.seed, 0 if seed is None else int(seed)])
        self._queue.clear()
        self._current = self.shift
        if self.physics is not None:
            self.physics.apply(self.shift)  # a reset may rebuild actors or controllers
        return self._noisy(obs["state"]), obs.get("images", {}), info

    def _step(self, action):
        a = np.asarray(action, np.float32)
        if self.shift.action_delay > 0:
            if not self._queue:
                self._queue.extend([a] * self.shift.action_delay)
            self._queue.append(a)
            a = self._queue.popleft()
        obs, reward, term, trunc, info = self.base.step(a)
        info = dict(info)
        info["applied_action"] = a
        return self._noisy(obs["state"]), obs.get("images", {}), reward, term, trunc, info

    def get_sim_state(self) -> np.ndarray | None:
        return self.base.get_sim_state()

    def set_sim_state(self, state: np.ndarray) -> None:
        self.base.set_sim_state(state)

    def pending_actions(self) -> list[np.ndarray]:
        """Commands issued but not yet applied (the latency buffer; not part of the sim state)."""
        return [a.copy() for a in self._queue]

    def observe(self) -> Obs:
        """Observation of the current simulator state, with sensor noise."""
        obs = self.base.observe()
        obs["state"] = self._noisy(obs["state"])
        return obs

    def evaluate_success(self) -> bool | None:
        return self.base.evaluate_success()

    def make_physics(self, bodies: tuple[str, ...] | None) -> Any:
        """The base env's physics (a twin of a twin scales the same parameters)."""
        return self.base.make_physics(bodies)

    def make_expert(self, **options: Any):
        return self.base.make_expert(**options)

    def close(self) -> None:
        self.base.close()


def shift_env(env: GroundflowEnv, seed: int | None = None, bodies: tuple[str, ...] | None = None,
              **shift: Any) -> ShiftedEnv:
    """Shifted twin of an env you already made."""
    bad = sorted(set(shift) - set(PhysicsShift.__dataclass_fields__))
    if bad:
        raise InvalidOptionError(f"unknown shift option(s) {bad}; valid: {list(PhysicsShift.__dataclass_fields__)}")
    return ShiftedEnv(env, PhysicsShift(**shift), seed=seed, bodies=bodies)


def make_shifted(env_id: str, mass_scale: float = 1.0, friction_scale: float = 1.0, damping_scale: float = 1.0,
                 gain_scale: float = 1.0, action_delay: int = 0, obs_noise: float = 0.0, seed: int | None = None,
                 bodies: tuple[str, ...] | None = None, **env_options: Any) -> ShiftedEnv:
    """``envs.make(env_id, **env_options)`` with shifted physics (see the module docstring)."""
    base = make_env(env_id, **env_options)
    try:
        return ShiftedEnv(base, PhysicsShift(mass_scale, friction_scale, damping_scale, gain_scale, action_delay,
                                             obs_noise), seed=seed, bodies=bodies)
    except Exception:
        base.close()
        raise
