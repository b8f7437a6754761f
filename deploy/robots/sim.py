"""``SimRobot``: any ``envs.make`` env behind the ``Robot`` protocol, optionally hardware-like.

Two ways to run:
  * lockstep (default): each ``send_action`` steps the env once. Deterministic for a seed, so
    evaluation through the policy server gives the same episodes as a local rollout;
  * ``realtime=True``: a background thread steps the env at its control rate with the latest
    target, like a real controller that keeps going whether or not a command arrived.

Hardware effects (all seeded): ``latency_s`` (sensor-to-host delay added to every observation
read), ``obs_noise`` (Gaussian noise on the state, in state units), ``action_delay`` (a command
takes effect that many control steps later).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np

import envs
from envs.base import state_slices
from deploy.robots.base import Obs, RobotSpec, check_connected
from envs.errors import InvalidOptionError

# Franka Panda/FR3 joint limits from the datasheet (rad/s, rad/s^2); used for ManiSkill's Panda.
PANDA_MAX_VELOCITY = (2.175, 2.175, 2.175, 2.175, 2.61, 2.61, 2.61)
PANDA_MAX_ACCELERATION = (15.0, 7.5, 10.0, 12.5, 15.0, 20.0, 20.0)


class SimRobot:
    """A simulated robot over an ``envs.make`` env (or an env id plus ``env_options``)."""

    def __init__(self, env: Any, *, env_options: dict | None = None, seed: int | None = 0,
                 latency_s: float = 0.0, obs_noise: float = 0.0, action_delay: int = 0,
                 realtime: bool = False, hold_fn: Callable[["SimRobot"], np.ndarray] | None = None,
                 max_velocity: Any = "auto", max_acceleration: Any = None, record_sim_state: bool = True):
        if latency_s < 0 or obs_noise < 0:
            raise InvalidOptionError(f"latency_s and obs_noise must be >= 0, got {latency_s}, {obs_noise}")
        if not isinstance(action_delay, int) or action_delay < 0:
            raise InvalidOptionError(f"action_delay must be an integer >= 0 (control steps), got {action_delay!r}")
        self._env_id = env if isinstance(env, str) else getattr(env, "env_id", type(env).__name__)
        self._env_options = dict(env_options or {})
        self.env = None if isinstance(env, str) else env
        self.seed = seed
        self.latency_s, self.obs_noise, self.action_delay = float(latency_s), float(obs_noise), action_delay
        self.realtime = bool(realtime)
        self.record_sim_state = record_sim_state
        self._hold_fn = hold_fn
        self._max_velocity, self._max_acceleration = max_velocity, max_acceleration
        self._rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self._connected = False
        self._obs: Obs | None = None
        self._last_cmd: np.ndarray | None = None
        self._delay_q: deque[np.ndarray] = deque()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.spec: RobotSpec | None = None  # set on connect (needs the env)
        self.reset_info: dict = {}
        self.last_info: dict = {}
        self.last_reward = 0.0
        self.done = False
        self.success = False
        self.steps = 0
        self.episode_seed: int | None = None

    # ----- connection -----------------------------------------------------------------------
    @property
    def is_connected(self) -> bool:
        return self._connected

    def connect(self) -> None:
        if self._connected:
            return
        if self.env is None:
            self.env = envs.make(self._env_id, **self._env_options)
        self.spec = self._make_spec()
        self._connected = True
        self.reset(self.seed)

    def disconnect(self) -> None:
        self._stop_thread()
        self._connected = False

    def close(self) -> None:
        """Disconnect and close the env (when this robot made it)."""
        self.disconnect()
        if self.env is not None and hasattr(self.env, "close"):
            self.env.close()

    # ----- episodes (sim only) --------------------------------------------------------------
    @property
    def task_id(self) -> int:
        """The suite task the last reset set up (0 for a single-task env): what recordings file the episode under."""
        return int(self.reset_info.get("task_id", 0))

    def reset(self, seed: int | None = None, options: dict | None = None) -> Obs:
        """Start a new episode; returns the first (noisy, delayed) observation."""
        check_connected(self)
        self._stop_thread()
        with self._lock:
            obs, info = self.env.reset(seed=seed, options=options)
            self.episode_seed = seed
            self._obs, self.reset_info, self.last_info = obs, dict(info), dict(info)
            self.last_reward, self.done, self.success, self.steps = 0.0, False, bool(info.get("success", False)), 0
            self._last_cmd = None
            self._delay_q.clear()
        if self.realtime:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="SimRobot-realtime", daemon=True)
            self._thread.start()
        return self.get_observation()

    def arm_constraints(self, obstacles: list[dict] | None = None, settings: Any = None) -> Any:
        """``policies.constraints.ArmConstraints`` for ``obstacles`` (None: the ones in the simulated scene,
        as a user who measured the cell would list them): the robot's body (boxes around the hand,
        relative to the TCP, read from its collision shapes now), its end-effector step per unit action,
        and where the state holds the TCP and the goal; ``settings`` an ``ArmGuidance`` (None: its
        defaults). Envs without that geometry (only the collision-avoidance task has it) get an
        ``InvalidOptionError``."""
        from policies.constraints import ArmConstraints, ArmGuidance
        check_connected(self)
        raw = getattr(self.env, "raw", None)
        layout = state_slices(getattr(self.env, "state_layout", None))
        if not (hasattr(raw, "body_boxes") and hasattr(raw, "ee_delta_scale") and "extra/tcp_pose" in layout):
            raise InvalidOptionError(f"{self._env_id} does not describe its arm's body and end-effector step, so "
                                     "deploy-time obstacles cannot be guided around there (the collision-avoidance "
                                     "task does)")
        with self._lock:
            found = raw.obstacle_list() if obstacles is None else obstacles
            body = tuple((tuple(map(float, lo)), tuple(map(float, hi))) for lo, hi in raw.body_boxes())
        goal = layout.get("extra/goal_pos")
        return ArmConstraints(tuple(found), body, float(raw.ee_delta_scale), layout["extra/tcp_pose"][0],
                              None if goal is None else goal[0], settings or ArmGuidance())

    def sim_state(self) -> np.ndarray | None:
        with self._lock:
            return self.env.get_sim_state() if self.record_sim_state else None

    # ----- Robot protocol -------------------------------------------------------------------
    def get_observation(self) -> Obs:
        check_connected(self)
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        with self._lock:
            obs = self._obs
            state = np.array(obs["state"], dtype=np.float32, copy=True)
            out: Obs = {"state": state, "instruction": obs["instruction"]}
            if "images" in obs:
                out["images"] = {k: np.array(v, copy=True) for k, v in obs["images"].items()}
        if self.obs_noise > 0:
            out["state"] = (state + self._rng.normal(0.0, self.obs_noise, state.shape)).astype(np.float32)
        return out

    def send_action(self, action: np.ndarray) -> None:
        check_connected(self)
        a = np.asarray(action, dtype=np.float32).reshape(-1)
        if a.shape != (self.spec.action_dim,):
            raise InvalidOptionError(f"{self.spec.name}: action has shape {a.shape}, expected ({self.spec.action_dim},)")
        with self._lock:
            self._last_cmd = a.copy()
            if not self.realtime:
                self._step(a)

    def hold_action(self) -> np.ndarray:
        """Current joint targets for absolute dims (from the simulator), zero for delta dims."""
        with self._lock:
            if self._hold_fn is not None:
                return np.asarray(self._hold_fn(self), dtype=np.float32)
            measured = self._measured_action()
            if measured is not None:
                return measured
            if self._last_cmd is not None:
                return np.where(self.spec.absolute, self._last_cmd, 0.0).astype(np.float32)
            # Absolute dims of an env whose targets cannot be read back, before any command:
            # the centre of the range (documented sim-only fallback).
            mid = (self.spec.action_low + self.spec.action_high) / 2
            return np.where(self.spec.absolute, mid, 0.0).astype(np.float32)

    # ----- internals ------------------------------------------------------------------------
    def _step(self, a: np.ndarray) -> None:
        if self.done:
            return  # a finished episode ignores further commands until reset()
        if self.action_delay:
            self._delay_q.append(a)
            a = self._delay_q.popleft() if len(self._delay_q) > self.action_delay else self.hold_action()
        obs, reward, terminated, truncated, info = self.env.step(a)
        self._obs, self.last_reward, self.last_info = obs, float(reward), dict(info)
        self.success = self.success or bool(info.get("success", False))
        self.steps += 1
        self.done = bool(terminated or truncated)

    def _run(self) -> None:
        period = 1.0 / self.spec.control_rate_hz
        nxt = time.perf_counter()
        while not self._stop.is_set():
            with self._lock:
                if self._last_cmd is not None and not self.done:
                    self._step(self._last_cmd)
            nxt += period
            delay = nxt - time.perf_counter()
            if delay > 0:
                self._stop.wait(delay)
            else:
                nxt = time.perf_counter()

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None

    def _make_spec(self) -> RobotSpec:
        env = self.env
        low = np.asarray(env.action_space.low, np.float64).reshape(-1)
        high = np.asarray(env.action_space.high, np.float64).reshape(-1)
        absolute = self._absolute_dims(len(low))
        rate = self._control_rate()
        vel = self._max_velocity
        if isinstance(vel, str) and vel == "auto":
            vel = self._default_velocity(absolute)
        return RobotSpec(name=f"sim:{self._env_id}", state_dim=int(env.state_dim), action_dim=len(low),
                         action_low=low, action_high=high, absolute=absolute, control_rate_hz=rate,
                         max_velocity=None if vel is None else np.broadcast_to(np.asarray(vel, float), low.shape),
                         max_acceleration=None if self._max_acceleration is None else
                         np.broadcast_to(np.asarray(self._max_acceleration, float), low.shape),
                         cameras=tuple(getattr(env, "cameras", ())),
                         meta={"env_id": self._env_id, "backend": getattr(env, "backend", "")})

    def _control_rate(self) -> float:
        raw = getattr(self.env, "raw", None)
        for obj, attr in ((raw, "control_freq"), (self.env, "control_freq"), (self.env, "control_rate_hz")):
            v = getattr(obj, attr, None) if obj is not None else None
            if isinstance(v, (int, float)) and v > 0:
                return float(v)
        return 20.0

    def _maniskill_controllers(self) -> list | None:
        raw = getattr(self.env, "raw", None)
        agent = getattr(raw, "agent", None)
        ctrl = getattr(agent, "controller", None)
        subs = getattr(ctrl, "controllers", None)
        if not subs:
            return None
        for name, c in subs.items():
            c._gf_name = name  # remember "arm"/"gripper" for the per-dimension defaults
        return list(subs.values())

    def _absolute_dims(self, n: int) -> np.ndarray:
        subs = self._maniskill_controllers()
        if subs is not None:
            flags: list[bool] = []
            for c in subs:
                k = int(np.prod(c.action_space.shape))
                flags += [_is_absolute_joint_controller(c)] * k
            if len(flags) == n:
                return np.asarray(flags)
        mode = str(getattr(self.env, "control_mode", getattr(self.env, "controller", "")))
        if "delta" in mode.lower() or "osc" in mode.lower():
            # end-effector delta controllers (ManiSkill *_delta_*, robosuite OSC): last dim is the gripper
            return np.asarray([False] * (n - 1) + [True])
        return np.ones(n, dtype=bool)

    def _default_velocity(self, absolute: np.ndarray) -> np.ndarray | None:
        subs = self._maniskill_controllers()
        robot_uid = getattr(getattr(getattr(self.env, "raw", None), "agent", None), "uid", "")
        if subs is None or "panda" not in str(robot_uid):
            return None
        vel = np.full(len(absolute), np.inf)
        arm = [i for i, c in _dims_of(subs) if "arm" in _ctrl_name(c) and _is_absolute_joint_controller(c)]
        if len(arm) == 7:
            vel[arm] = PANDA_MAX_VELOCITY
        return vel

    def _measured_action(self) -> np.ndarray | None:
        """Read the current targets back from a ManiSkill articulation, in action units."""
        subs = self._maniskill_controllers()
        if subs is None:
            return None
        out: list[float] = []
        for c in subs:
            k = int(np.prod(c.action_space.shape))
            if not _is_absolute_joint_controller(c):
                out += [0.0] * k
                continue
            q = c.qpos.detach().cpu().numpy().reshape(-1)[:k]
            cfg = c.config
            if getattr(cfg, "normalize_action", False):
                lo, hi = float(np.min(cfg.lower)), float(np.max(cfg.upper))
                q = 2 * (q - lo) / (hi - lo) - 1
            out += list(q[:k]) if len(q) >= k else list(q) + [q[-1]] * (k - len(q))
        if len(out) != self.spec.action_dim:
            return None
        return np.clip(np.asarray(out, np.float32), self.spec.action_low, self.spec.action_high).astype(np.float32)


def _is_absolute_joint_controller(c: Any) -> bool:
    cfg = getattr(c, "config", None)
    return ("JointPos" in type(c).__name__ and not getattr(cfg, "use_delta", False)
            and not getattr(cfg, "use_target", False))


def _ctrl_name(c: Any) -> str:
    return str(getattr(c, "_gf_name", ""))


def _dims_of(subs: list) -> list[tuple[int, Any]]:
    out, i = [], 0
    for c in subs:
        for _ in range(int(np.prod(c.action_space.shape))):
            out.append((i, c))
            i += 1
    return out
