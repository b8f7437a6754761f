"""The observation convention every groundflow env speaks, and the checks at its edge.

Observation: ``{"state": float32 (S,), "images": {camera: uint8 (h, w, 3)}, "instruction": str}``.
``info["success"]`` is a bool on every step. Backends subclass :class:`GroundflowEnv` and
implement the ``_reset``/``_step`` hooks on raw numpy; the base class validates actions, builds
the observation dict and exposes the simulator state (for datasets, replay and debugging).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import gymnasium as gym
import numpy as np

from envs.errors import InstructionError, InvalidActionError, InvalidOptionError

Obs = dict[str, Any]


def check_action(action: Any, shape: tuple[int, ...], low: np.ndarray | None = None,
                 high: np.ndarray | None = None, clip: bool = True) -> np.ndarray:
    """Return ``action`` as float32 of ``shape``; raise on wrong shape or non-finite values."""
    a = np.asarray(action, dtype=np.float32)
    if a.shape != shape:
        raise InvalidActionError(f"action has shape {a.shape}, expected {shape}")
    if not np.all(np.isfinite(a)):
        bad = np.flatnonzero(~np.isfinite(a)).tolist()
        raise InvalidActionError(f"action contains NaN/inf at indices {bad}: {a.tolist()}")
    if clip and low is not None and high is not None:
        a = np.clip(a, low, high)
    return a


def state_slices(layout: list[tuple[str, int]] | None) -> dict[str, tuple[int, int]]:
    """Each named slice of the flat state as (start, size), in layout order."""
    slices, start = {}, 0
    for name, size in layout or []:
        slices[name] = (start, size)
        start += size
    return slices


def state_indices(layout: list[tuple[str, int]] | None, patterns: tuple[str, ...], env_id: str = "") -> list[int]:
    """Indices of the flat state covered by the slices whose names match any of ``patterns``
    (shell-style, e.g. ``*vel``). The patterns must match at least one slice between them (one
    recipe serves envs that name their slices differently; a typo that hides nothing is an error)."""
    if not patterns:
        return []
    if not layout:
        raise InvalidOptionError(f"{env_id or 'this env'} does not name the slices of its state, so state "
                                 f"patterns {list(patterns)} cannot be resolved (`--ignore-state` with no "
                                 "pattern reads the whole state)")
    names = [n for n, _ in layout]
    parsed = [_part_of(p) for p in patterns]
    if not any(fnmatch.filter(names, p) for p, _ in parsed):
        raise InvalidOptionError(f"state pattern(s) {list(patterns)} match no slice of {env_id or 'the'} state; "
                                 f"its slices: {names}")
    out: set[int] = set()
    for name, (start, size) in state_slices(layout).items():
        for p, part in parsed:
            if fnmatch.fnmatchcase(name, p):
                out.update(start + k for k in range(size)[part])
    return sorted(out)


PROPRIO_PATTERNS = ("agent/*", "extra/tcp_pose", "robot0_*")
"""State slices a physical arm measures itself (joints, gripper, the TCP pose by forward kinematics):
ManiSkill's ``agent/*`` and ``extra/tcp_pose``, robosuite's ``robot0_*``. Every other named slice is
the simulator's knowledge of the scene (object poses, goals)."""


def is_proprio(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in PROPRIO_PATTERNS)


def _part_of(pattern: str) -> tuple[str, slice]:
    """'NAME[a:b]' -> ('NAME', slice(a, b)): entries a..b-1 of each matching slice (e.g.
    '*_cube_pose[0:3]', the positions of poses); a plain 'NAME' is the whole slice."""
    m = re.fullmatch(r"(.+)\[(-?\d*):(-?\d*)\]", pattern)
    if not m:
        return pattern, slice(None)
    return m.group(1), slice(int(m.group(2)) if m.group(2) else None, int(m.group(3)) if m.group(3) else None)


class GroundflowEnv(gym.Env):
    """Base env: subclasses fill ``state_dim``, ``action_low/high``, ``cameras``, ``image_size``.

    Hooks to implement:
      - ``_reset(seed, options) -> (state, images, info)``
      - ``_step(action) -> (state, images, reward, terminated, truncated, info)``; info needs "success"
      - ``get_sim_state() -> np.ndarray`` / ``set_sim_state(x)`` where the backend allows it.
      - ``observe()``, ``evaluate_success()``, ``make_physics(bodies)``: the current simulator
        state's observation and task success, and the physics parameters a shifted twin scales
        (``envs.shifted``), where the backend can tell.
    """

    metadata = {"render_modes": ["rgb_array"]}
    env_id: str = ""
    backend: str = ""
    state_layout: list[tuple[str, int]] | None = None
    """(name, size) of each slice of the flat state, in order, where the backend can name them"""

    def __init__(self, state_dim: int, action_low: np.ndarray, action_high: np.ndarray,
                 cameras: tuple[str, ...] = (), image_size: int = 128, max_episode_steps: int = 200,
                 instruction: str = ""):
        self.state_dim = int(state_dim)
        self.action_low = np.asarray(action_low, dtype=np.float32)
        self.action_high = np.asarray(action_high, dtype=np.float32)
        self.cameras = tuple(cameras)
        self.image_size = int(image_size)
        self.max_episode_steps = int(max_episode_steps)
        self.instruction = instruction
        self.task_id = 0
        self._elapsed = 0
        self.action_space = gym.spaces.Box(self.action_low, self.action_high, dtype=np.float32)
        spaces: dict[str, gym.Space] = {
            "state": gym.spaces.Box(-np.inf, np.inf, (self.state_dim,), dtype=np.float32),
            "instruction": gym.spaces.Text(max_length=512, min_length=0),
        }
        if self.cameras:
            spaces["images"] = gym.spaces.Dict({
                c: gym.spaces.Box(0, 255, (self.image_size, self.image_size, 3), dtype=np.uint8)
                for c in self.cameras})
        self.observation_space = gym.spaces.Dict(spaces)

    # ----- hooks ---------------------------------------------------------------------------
    def _reset(self, seed: int | None, options: dict) -> tuple[np.ndarray, dict, dict]:
        raise NotImplementedError

    def _step(self, action: np.ndarray) -> tuple[np.ndarray, dict, float, bool, bool, dict]:
        raise NotImplementedError

    def get_sim_state(self) -> np.ndarray | None:
        """Flat simulator state that ``set_sim_state`` restores exactly; None if unsupported."""
        return None

    def set_sim_state(self, state: np.ndarray) -> None:
        raise NotImplementedError(f"{self.env_id}: this backend cannot set its simulator state")

    def observe(self) -> Obs:
        """Observation of the *current* simulator state (e.g. right after ``set_sim_state``)."""
        raise InvalidOptionError(f"{self.env_id}: backend {self.backend!r} cannot observe its current state "
                                 "(it needs an observe() method)")

    def evaluate_success(self) -> bool | None:
        """Task success in the current simulator state; None where the backend cannot tell."""
        return None

    def make_physics(self, bodies: tuple[str, ...] | None) -> Any:
        """Handle on the physics parameters a shifted twin scales (``envs.physics``: ``apply(shift)``),
        restricted to ``bodies`` (None: the backend's default set); None where there are none."""
        return None

    def raw_step(self, action: np.ndarray) -> Any:
        """Step the backend env directly, without conversion or checks, rendering the same cameras
        with the same renderer: the baseline ``benchmarks/envs.py`` measures wrapper overhead against."""
        raise NotImplementedError

    @property
    def instructions(self) -> list[str]:
        """Instructions this env can be commanded with (one for single tasks)."""
        return [self.instruction]

    # ----- gymnasium API --------------------------------------------------------------------
    def _obs(self, state: np.ndarray, images: dict) -> Obs:
        state = np.asarray(state, dtype=np.float32).reshape(-1)
        if state.shape != (self.state_dim,):
            raise RuntimeError(f"{self.env_id}: backend returned state of shape {state.shape}, "
                               f"expected ({self.state_dim},)")
        obs: Obs = {"state": state, "instruction": self.instruction}
        if self.cameras:
            obs["images"] = {c: np.ascontiguousarray(images[c], dtype=np.uint8) for c in self.cameras}
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = dict(options or {})
        if "instruction" in options:
            instr = options["instruction"]
            if not isinstance(instr, str) or not instr.strip():
                raise InstructionError(f"{self.env_id}: instruction must be a non-empty string, got {instr!r}")
        self._elapsed = 0
        state, images, info = self._reset(seed, options)
        info = dict(info)
        info.setdefault("success", False)
        info["success"] = bool(info["success"])
        info.setdefault("task_id", self.task_id)
        return self._obs(state, images), info

    def step(self, action):
        a = check_action(action, self.action_space.shape, self.action_low, self.action_high)
        state, images, reward, terminated, truncated, info = self._step(a)
        self._elapsed += 1
        info = dict(info)
        info["success"] = bool(info.get("success", False))
        info.setdefault("task_id", self.task_id)
        if self._elapsed >= self.max_episode_steps:
            truncated = True
        return self._obs(state, images), float(reward), bool(terminated), bool(truncated), info
