"""The ``Robot`` protocol every driver implements, and the ``RobotSpec`` the layers above read.

Drivers are thin: they translate one action vector into the vendor's command and the vendor's
state into the observation convention (``{"state", "images"?, "instruction"}``). Everything
that should be the same for every robot (limits, watchdog, rate, chunking, recording) lives
above them in ``deploy.safety`` and ``deploy.control``.

Action semantics are described per dimension by ``RobotSpec.absolute``: ``True`` where the
action is an absolute target (joint position, gripper width), ``False`` where it is a delta or a
velocity (end-effector deltas). The safety layer limits the rate of change of absolute
dimensions and only bounds delta dimensions; holding means "repeat the current target" for
absolute dimensions and "zero" for delta dimensions (``Robot.hold_action``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from deploy.errors import RobotConnectionError
from envs.errors import InvalidOptionError

Obs = dict[str, Any]


@dataclass(frozen=True)
class RobotSpec:
    """Static description of a robot's action and observation interface.

    ``action_low/high``: hard command limits (joint limits for joint-position robots).
    ``max_velocity``/``max_acceleration``: per-dimension limits on the commanded target's rate of
    change (action units / s, / s^2) for absolute dimensions; ``inf`` disables a dimension.
    ``control_rate_hz``: the rate the robot (or simulated env) expects new targets at.
    """

    name: str
    state_dim: int
    action_dim: int
    action_low: np.ndarray
    action_high: np.ndarray
    absolute: np.ndarray
    control_rate_hz: float
    max_velocity: np.ndarray | None = None
    max_acceleration: np.ndarray | None = None
    cameras: tuple[str, ...] = ()
    action_names: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        a = self.action_dim
        for name in ("action_low", "action_high", "absolute", "max_velocity", "max_acceleration"):
            v = getattr(self, name)
            if v is None:
                continue
            arr = np.asarray(v, dtype=bool if name == "absolute" else np.float64).reshape(-1)
            if arr.shape != (a,):
                raise InvalidOptionError(f"RobotSpec({self.name}).{name} has {arr.shape[0]} entries, "
                                         f"expected action_dim={a}")
            object.__setattr__(self, name, arr)
        if np.any(~(self.action_low < self.action_high)):
            bad = np.flatnonzero(~(self.action_low < self.action_high)).tolist()
            raise InvalidOptionError(f"RobotSpec({self.name}): action_low must be < action_high (dims {bad})")
        if not self.control_rate_hz > 0:
            raise InvalidOptionError(f"RobotSpec({self.name}).control_rate_hz must be > 0, got {self.control_rate_hz}")
        object.__setattr__(self, "cameras", tuple(self.cameras))

    @property
    def velocity_limits(self) -> np.ndarray:
        return np.full(self.action_dim, np.inf) if self.max_velocity is None else self.max_velocity

    @property
    def acceleration_limits(self) -> np.ndarray:
        return np.full(self.action_dim, np.inf) if self.max_acceleration is None else self.max_acceleration

    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary (recorded with every deployed episode)."""
        return {"name": self.name, "state_dim": self.state_dim, "action_dim": self.action_dim,
                "action_low": self.action_low.tolist(), "action_high": self.action_high.tolist(),
                "absolute": self.absolute.tolist(), "control_rate_hz": self.control_rate_hz,
                "max_velocity": self.velocity_limits.tolist(),
                "max_acceleration": self.acceleration_limits.tolist(), "cameras": list(self.cameras),
                "action_names": list(self.action_names)}


@runtime_checkable
class Robot(Protocol):
    """What the control loop needs from a robot. ``spec`` describes its action space. What it reads
    only where a driver has it (episode ends, rewards, simulator state) is ``RobotCapabilities``."""

    spec: RobotSpec

    @property
    def is_connected(self) -> bool: ...

    def connect(self) -> None: ...

    def disconnect(self) -> None: ...

    def get_observation(self) -> Obs: ...

    def send_action(self, action: np.ndarray) -> None: ...

    def hold_action(self) -> np.ndarray:
        """The command that keeps the robot where it is now (see module docstring)."""
        ...


class RobotCapabilities(Protocol):
    """What the layers above ``Robot`` read from a driver only where it has it (``getattr``/``hasattr``):
    a real arm implements none of these, a simulated robot (``SimRobot``) all of them. A driver without
    an attribute reads as its entry in ``CAPABILITY_DEFAULTS`` (``capability``); a method it lacks is
    skipped as described on it. ``CameraRig`` passes each through from the driver it wraps."""

    # ----- read by the control loop (deploy.control) every tick and at the end of an episode ----
    done: bool
    """the episode is over (a simulated env terminated or was truncated): the loop ends it as ``done``"""
    success: bool
    """the task succeeded in this episode (``EpisodeResult.success``)"""
    last_reward: float
    """the reward of the last step (recorded with each step)"""
    last_info: dict[str, Any]
    """the info of the last step; its ``success`` is recorded with each step"""

    def sim_state(self) -> np.ndarray | None:
        """The simulator's state (recorded with each step and at the end, for replay). Absent: the loop
        asks for none, and recordings hold none."""
        ...

    # ----- read by ``groundflow deploy`` (deploy.commands) ----------------------------------------
    task_id: int
    """the task of this episode in a multi-task suite (recordings are filed under it)"""
    env: Any
    """the simulated env (``--robot sim``): its env id and state layout are checked against the policy's"""
    instruction: str
    """the instruction a real arm's observations carry (its ``--instruction``; empty: none was given, and a
    policy that follows instructions is refused before any motion). Absent: each observation carries its
    own (a simulated suite's task)"""

    def reset(self, seed: int | None = None, options: dict | None = None) -> Obs:
        """Start a new episode (a simulated env; ``options`` may name its task). Absent: episodes
        follow each other from wherever the arm is."""
        ...

    def close(self) -> None:
        """Release everything (a simulated env too). Absent: ``disconnect`` is called instead."""
        ...

    def forward_kinematics(self, action: np.ndarray) -> np.ndarray:
        """A ``ForwardKinematics``: the TCP position (3,) an action reaches. Absent: ``--workspace`` and
        ``--keep-out`` are refused for this robot."""
        ...

    def arm_constraints(self, obstacles: list[dict] | None = None, settings: Any = None) -> Any:
        """``policies.constraints.ArmConstraints`` for ``obstacles`` (None: the simulated scene's). Absent:
        ``--obstacles`` is refused for this robot."""
        ...


CAPABILITY_DEFAULTS: dict[str, Any] = {"done": False, "success": False, "last_reward": 0.0, "last_info": {},
                                       "task_id": 0, "instruction": None}
"""what a driver without one of ``RobotCapabilities``' attributes reads as (an arm: never done, no
success or reward to report, one task)"""


def capability(robot: Any, name: str) -> Any:
    """``robot.<name>`` (an attribute of ``RobotCapabilities``), or its default where the driver has none."""
    return getattr(robot, name, CAPABILITY_DEFAULTS[name])


def check_connected(robot: Any) -> None:
    """Raise a clear error when a driver is used before ``connect()``."""
    if not robot.is_connected:
        raise RobotConnectionError(f"{type(robot).__name__} is not connected; call connect() first")


ForwardKinematics = Callable[[np.ndarray], np.ndarray]
"""Maps an action (absolute joint targets) to the end-effector position (3,) in metres."""
