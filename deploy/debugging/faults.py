"""Fault injection and reference policies for evaluating counterfactual debugging.

A "real" system for evaluation is a simulator (usually a shifted-physics twin, ``envs.shifted``)
wrapped in :class:`FaultyEnv`, which injects known faults at chosen steps:

- ``observation``: the policy's observation at step t is corrupted (``dims`` += ``delta``);
- ``reward``: the reward of step t is off by ``delta``;
- ``teleport``: after step t the simulator state jumps (``dims`` of the sim state += ``delta``),
  a physics violation such as an object slipping out of place;
- ``mass_jump`` / ``friction_jump``: mass or friction is scaled by ``scale`` for ``duration``
  steps from t (needs a :class:`envs.shifted.ShiftedEnv`).

Faults flagged ``harmless=True`` are large errors that the task does not depend on; an
attribution method must not blame them. :func:`record_episode` runs a policy on the real system
and returns a trajectory in the dataset format (with simulator states), ready for debugging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from deploy.debugging.rollouts import PolicyRunner
from envs.base import GroundflowEnv
from envs.errors import InvalidOptionError
from envs.shifted import ShiftedEnv
from dataset import Episode, EpisodeBuffer

FAULT_KINDS = ("observation", "reward", "teleport", "mass_jump", "friction_jump")


@dataclass(frozen=True)
class Fault:
    step: int
    kind: str
    dims: tuple[int, ...] = ()
    delta: tuple[float, ...] | float = 0.0
    scale: float = 1.0
    duration: int = 1
    harmless: bool = False

    def validate(self) -> "Fault":
        if self.kind not in FAULT_KINDS:
            raise InvalidOptionError(f"unknown fault kind {self.kind!r}; valid kinds: {list(FAULT_KINDS)}")
        if self.step < 0 or self.duration < 1:
            raise InvalidOptionError(f"fault step must be >= 0 and duration >= 1, got {self.step}, {self.duration}")
        if self.kind in ("observation", "teleport") and not self.dims:
            raise InvalidOptionError(f"{self.kind} fault needs dims")
        if self.kind.endswith("_jump") and (not np.isfinite(self.scale) or self.scale <= 0):
            raise InvalidOptionError(f"{self.kind} needs scale > 0, got {self.scale}")
        return self

    @property
    def steps(self) -> tuple[int, ...]:
        """Steps whose transitions this fault changes (its ground truth)."""
        return tuple(range(self.step, self.step + (self.duration if self.kind.endswith("_jump") else 1)))

    def vector(self, n: int) -> np.ndarray:
        out = np.zeros(n)
        out[list(self.dims)] = self.delta
        return out


class FaultyEnv(GroundflowEnv):
    """Wraps an env (sim or shifted twin) and injects :class:`Fault` s at their steps."""

    def __init__(self, base: GroundflowEnv, faults: Sequence[Fault] = ()):
        self.base = base
        self.faults = [fault.validate() for fault in faults]
        if any(fault.kind.endswith("_jump") for fault in self.faults) and not isinstance(base, ShiftedEnv):
            raise InvalidOptionError("mass_jump/friction_jump faults need a ShiftedEnv base "
                                     "(envs.shifted.make_shifted)")
        super().__init__(base.state_dim, base.action_low, base.action_high, cameras=base.cameras,
                         image_size=base.image_size, max_episode_steps=base.max_episode_steps,
                         instruction=base.instruction)
        self.env_id, self.backend = base.env_id, base.backend
        self.t = 0

    def __getattr__(self, name: str) -> Any:
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def _at(self, t: int, *kinds: str) -> list[Fault]:
        return [fault for fault in self.faults if fault.kind in kinds and fault.step == t]

    def _corrupt(self, state: np.ndarray, t: int) -> np.ndarray:
        for fault in self._at(t, "observation"):
            state = (state + fault.vector(state.shape[0])).astype(np.float32)
        return state

    def _reset(self, seed, options):
        obs, info = self.base.reset(seed=seed, options=options)
        self.instruction, self.task_id = self.base.instruction, self.base.task_id
        self.t = 0
        return self._corrupt(obs["state"], 0), obs.get("images", {}), info

    def _step(self, action):
        t = self.t
        for fault in self._at(t, "mass_jump", "friction_jump"):
            scale_name = fault.kind.replace("_jump", "_scale")
            self.base.set_shift(**{scale_name: getattr(self.base.shift, scale_name) * fault.scale})
        obs, reward, term, trunc, info = self.base.step(action)
        if any(fault.kind.endswith("_jump") and fault.step + fault.duration - 1 == t for fault in self.faults):
            self.base.restore_shift()
        teleports = self._at(t, "teleport")
        if teleports:
            sim_state = np.asarray(self.base.get_sim_state(), np.float64)
            for fault in teleports:
                sim_state = sim_state + fault.vector(sim_state.shape[0])
            self.base.set_sim_state(sim_state)
            obs = self.base.observe()
            ok = self.base.evaluate_success()
            info = {**info, "success": info["success"] if ok is None else ok}
        for fault in self._at(t, "reward"):
            reward += float(np.sum(fault.delta))
        self.t += 1
        return self._corrupt(obs["state"], t + 1), obs.get("images", {}), reward, term, trunc, info

    def get_sim_state(self):
        return self.base.get_sim_state()

    def set_sim_state(self, state):
        self.base.set_sim_state(state)

    def observe(self) -> dict:
        return self.base.observe()

    def evaluate_success(self) -> bool | None:
        return self.base.evaluate_success()

    def make_physics(self, bodies: tuple[str, ...] | None) -> Any:
        return self.base.make_physics(bodies)

    def close(self) -> None:
        self.base.close()


def record_episode(env: GroundflowEnv, policy: Any, seed: int, steps: int | None = None,
                   options: dict | None = None) -> Episode:
    """Run ``policy`` for exactly ``steps`` steps (no early stop) and return the trajectory,
    with the simulator state before every action and after the last one."""
    runner = PolicyRunner(policy)
    obs, info = env.reset(seed=seed, options=options)
    runner.reset(env, obs)
    buf = EpisodeBuffer(obs["instruction"], getattr(env, "task_id", 0), seed)
    sims = []
    for _ in range(steps or env.max_episode_steps):
        sim = env.get_sim_state()
        sims.append(np.array(sim, copy=True))
        action = runner.act(obs)
        nobs, reward, term, trunc, info = env.step(action)
        buf.add(obs, action, reward, info["success"], sim)
        obs = nobs
    final_sim = env.get_sim_state()
    ep = buf.finish(obs, final_sim)
    # keep the simulator's own precision (MuJoCo: float64) for exact replay in memory
    ep.sim_state, ep.final_sim_state = np.stack(sims), np.array(final_sim, copy=True)
    return ep


# ----- reference policies (deterministic, stateless, batchable) -------------------------------

class PushCubeController:
    """Feedback controller for ManiSkill PushCube with ``pd_ee_delta_pos`` actions.

    Goes above the cube, comes down behind it (opposite the goal) and pushes it to the goal's
    centre; if the cube is knocked away it lifts and starts again. It reads only the tcp
    position, the goal xy and the cube position from the state (so corrupting e.g. the joint
    velocities is harmless by construction).
    """

    stateless = True
    TCP, GOAL, CUBE = slice(18, 21), slice(25, 27), slice(28, 31)
    READS = tuple(range(18, 21)) + (25, 26) + tuple(range(28, 31))

    def __init__(self, step: float = 0.1, push_speed: float = 0.025, hover: float = 0.07, low: float = 0.022):
        self.step, self.push_speed, self.hover, self.low = step, push_speed, hover, low

    def reset(self) -> None:
        pass

    def select_action(self, obs: dict) -> np.ndarray:
        return self.act_batch(np.asarray(obs["state"])[None])[0]

    def act_batch(self, states: np.ndarray) -> np.ndarray:
        s = np.asarray(states, np.float64)
        p, g, c = s[:, self.TCP], s[:, self.GOAL], s[:, self.CUBE]
        d = g - c[:, :2]
        dist = np.linalg.norm(d, axis=1, keepdims=True)
        u = d / np.maximum(dist, 1e-6)
        rel = p[:, :2] - c[:, :2]
        along = np.sum(rel * u, axis=1, keepdims=True)
        lateral = np.linalg.norm(rel - along * u, axis=1, keepdims=True)
        pre = c[:, :2] - 0.055 * u
        behind = (along < -0.022) & (lateral < 0.012)
        low = p[:, 2:3] < self.low + 0.015
        near = np.linalg.norm(rel, axis=1, keepdims=True) < 0.07
        at_pre = np.linalg.norm(p[:, :2] - pre, axis=1, keepdims=True) < 0.01
        # default: travel at hover height to the pre-push point
        target = np.concatenate([pre, np.full_like(dist, self.hover)], axis=1)
        # too close to the cube and not behind it: lift first
        lift = near & ~behind & (p[:, 2:3] < self.hover - 0.02) & ~at_pre
        target = np.where(lift, np.concatenate([p[:, :2], np.full_like(dist, self.hover)], 1), target)
        descend = at_pre & ~(behind & low)
        target = np.where(descend, np.concatenate([pre, np.full_like(dist, self.low)], 1), target)
        push_to = p[:, :2] + u * np.minimum(self.push_speed, np.maximum(dist - 0.002, 0.0)) \
            - (rel - along * u) * 0.5
        push = behind & low
        target = np.where(push, np.concatenate([push_to, np.full_like(dist, self.low)], 1), target)
        hold = push & (dist < 0.004)
        target = np.where(hold, p, target)
        delta = np.clip((target - p) / self.step, -1.0, 1.0)
        grip = -np.ones((s.shape[0], 1))
        return np.concatenate([delta, grip], axis=1).astype(np.float32)


class DapgMeanPolicy:
    """The Adroit DAPG expert acting with its mean (deterministic, batchable)."""

    stateless = True

    def __init__(self, task: str = "door"):
        from envs.adroit import DapgExpert  # imported here: the Adroit backend loads MuJoCo
        self.p = DapgExpert.load(task).p

    def reset(self) -> None:
        pass

    def select_action(self, obs: dict) -> np.ndarray:
        return self.act_batch(np.asarray(obs["state"])[None])[0]

    def act_batch(self, states: np.ndarray) -> np.ndarray:
        p = self.p
        x = (np.asarray(states, np.float64) - p["in_shift"]) / (p["in_scale"] + 1e-8)
        x = np.tanh(x @ p["W0"].T + p["b0"])
        x = np.tanh(x @ p["W1"].T + p["b1"])
        x = x @ p["W2"].T + p["b2"]
        return np.clip(x * p["out_scale"] + p["out_shift"], -1, 1).astype(np.float32)


class Integrator(GroundflowEnv):
    """A synthetic system whose attribution is known exactly: x <- x + a / 16 (exact in float32),
    reward 1 per step; the state is the observation. With :class:`ConstantPolicy` and reward faults
    (:func:`integrator_episode`) the causes are exactly the faulty steps."""

    env_id, backend = "toy/integrator", "toy"
    sim_state_is_observation = True

    def __init__(self):
        super().__init__(2, -np.ones(1), np.ones(1), max_episode_steps=10**6, instruction="drift")
        self.x = np.zeros(2)

    def _reset(self, seed, options):
        self.x = np.zeros(2)
        return self.x.copy(), {}, {"success": False}

    def _step(self, a):
        self.x = self.x + np.array([float(a[0]) / 16, 0.0])
        return self.x.copy(), {}, 1.0, False, False, {"success": False}

    def get_sim_state(self):
        return self.x.copy()

    def set_sim_state(self, x):
        self.x = np.asarray(x, np.float64).reshape(2).copy()

    def observe(self):
        return self._obs(self.x.copy(), {})


class ConstantPolicy:
    """Always the action 1 (stateless)."""

    stateless = True

    def select_action(self, obs):
        return np.ones(1, np.float32)


def integrator_episode(seed: int, T: int = 50, k: int = 8, fault: float = -1.0, noise: float = 1e-3,
                       rng_seed: Any = None) -> tuple[Episode, list[int]]:
    """(episode, causes): :class:`Integrator` under :class:`ConstantPolicy` for ``T`` steps, its
    recorded rewards off by N(0, ``noise``) at every step and by ``fault`` at ``k`` random steps (the
    causes). The draws come from ``rng_seed`` (default ``[0, seed]``)."""
    rng = np.random.default_rng([0, seed] if rng_seed is None else rng_seed)
    causes = sorted(rng.choice(T, k, replace=False).tolist())
    env, pi = Integrator(), ConstantPolicy()
    obs, _ = env.reset(seed=seed)
    S, A, R, X = [], [], [], []
    for t in range(T):
        X.append(env.get_sim_state())
        S.append(obs["state"])
        A.append(pi.select_action(obs))
        obs, r, *_ = env.step(A[-1])
        R.append(r + rng.normal(0, noise) + (fault if t in causes else 0.0))
    ep = Episode(state=np.array(S, np.float32), action=np.array(A, np.float32), reward=np.array(R, np.float32),
                 success=np.zeros(T, bool), instruction="drift", task_id=0, seed=seed, sim_state=np.array(X),
                 final_state=obs["state"], final_sim_state=env.get_sim_state())
    return ep, causes
