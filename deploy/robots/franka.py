"""``FrankaRobot``: a Franka Panda / FR3 through franky (franky-control, libfranka 0.21).

Action (8): seven joint-position targets (rad) and the gripper opening width (m, 0..0.08).
Each ``send_action`` issues an asynchronous ``JointMotion`` that preempts the previous one
(franky's motion generator joins them under the robot's dynamics limits scaled by
``relative_dynamics_factor``); the gripper moves only when its target changes by more than
``gripper_tolerance`` and the previous gripper move has finished.
State (22): q (7), dq (7), gripper width (1), TCP pose (position 3 + quaternion xyzw 4). The
arm state is one read of franky's robot state; the gripper width is a network round trip to the
gripper server, so it is refreshed at most every ``gripper_read_s`` (0.1 s) and not mid-move.

franky is imported only when a FrankaRobot is created: it ships x86_64 Linux wheels only.
Test it against franky-sim on loopback (``deploy.robots.franka_sim.FrankySim``).
"""

from __future__ import annotations

import platform
from typing import Any

import numpy as np

from deploy.errors import DriverMissingError, RobotCommandError, RobotConnectionError
from deploy.robots.kinematics import franka_tcp_position
from deploy.robots.base import Obs, RobotSpec, check_connected
from envs.errors import InvalidOptionError

# Joint limits from Franka's datasheets (rad, rad/s, rad/s^2).
LIMITS = {
    "fr3": {"q_min": (-2.7437, -1.7837, -2.9007, -3.0421, -2.8065, 0.5445, -3.0159),
            "q_max": (2.7437, 1.7837, 2.9007, -0.1518, 2.8065, 4.5169, 3.0159),
            "dq_max": (2.62, 2.62, 2.62, 2.62, 5.26, 4.18, 5.26),
            "ddq_max": (10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0)},
    "panda": {"q_min": (-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973),
              "q_max": (2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973),
              "dq_max": (2.175, 2.175, 2.175, 2.175, 2.61, 2.61, 2.61),
              "ddq_max": (15.0, 7.5, 10.0, 12.5, 15.0, 20.0, 20.0)},
}
GRIPPER_MAX_WIDTH = 0.08
_PARKED: list = []  # grippers whose move never finished: destroying them would hang (see disconnect)
JOINT_NAMES = tuple(f"joint{i}" for i in range(1, 8)) + ("gripper_width",)


def import_franky() -> Any:
    """Import franky, or explain why it cannot be used here."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise DriverMissingError(f"franky-control ships x86_64 Linux wheels only; this is "
                                 f"{platform.system()} {platform.machine()}")
    try:
        import franky
    except ImportError as e:
        raise DriverMissingError(f"the Franka driver needs franky-control ({e}); "
                                 "pip install franky-control (or 'groundflow[robots]')") from e
    return franky


def franka_spec(model: str = "fr3", control_rate_hz: float = 20.0, joint_margin: float = 0.05,
                velocity_scale: float = 0.5, instruction_cameras: tuple[str, ...] = ()) -> RobotSpec:
    """Spec with joint ranges shrunk by ``joint_margin`` (rad) and velocities scaled down."""
    if model not in LIMITS:
        raise InvalidOptionError(f"unknown Franka model {model!r}; valid: {list(LIMITS)}")
    L = LIMITS[model]
    low = np.r_[np.asarray(L["q_min"]) + joint_margin, 0.0]
    high = np.r_[np.asarray(L["q_max"]) - joint_margin, GRIPPER_MAX_WIDTH]
    vel = np.r_[np.asarray(L["dq_max"]) * velocity_scale, np.inf]
    acc = np.r_[np.asarray(L["ddq_max"]), np.inf]
    return RobotSpec(name=f"franka-{model}", state_dim=22, action_dim=8, action_low=low, action_high=high,
                     absolute=np.ones(8, bool), control_rate_hz=control_rate_hz, max_velocity=vel,
                     max_acceleration=acc, cameras=instruction_cameras, action_names=JOINT_NAMES,
                     meta={"model": model})


class FrankaRobot:
    def __init__(self, host: str = "127.0.0.1", *, model: str = "fr3", instruction: str = "",
                 relative_dynamics_factor: float = 0.2, gripper: bool = True, control_rate_hz: float = 20.0,
                 realtime: bool = False, gripper_speed: float = 0.05, gripper_tolerance: float = 0.005,
                 velocity_scale: float = 0.5):
        if not 0 < relative_dynamics_factor <= 1:
            raise InvalidOptionError(f"relative_dynamics_factor must be in (0, 1], got {relative_dynamics_factor}")
        self.host = host
        self.instruction = instruction
        self.spec = franka_spec(model, control_rate_hz, velocity_scale=velocity_scale)
        self.dynamics = float(relative_dynamics_factor)
        self.use_gripper = gripper
        self.realtime = realtime
        self.gripper_speed, self.gripper_tolerance = float(gripper_speed), float(gripper_tolerance)
        self._franky: Any = import_franky()
        self._robot: Any = None
        self._gripper: Any = None
        self._gripper_future: Any = None
        self._gripper_target: float | None = None
        self._width = 0.0
        self._width_t = -1e9
        self.gripper_read_s = 0.1

    # ----- connection -----------------------------------------------------------------------
    @property
    def is_connected(self) -> bool:
        return self._robot is not None

    def connect(self) -> None:
        if self._robot is not None:
            return
        fr = self._franky
        rc = fr.RealtimeConfig.Enforce if self.realtime else fr.RealtimeConfig.Ignore
        try:
            robot = fr.Robot(self.host, realtime_config=rc)
            robot.relative_dynamics_factor = self.dynamics
            if robot.has_errors:
                robot.recover_from_errors()
            gripper = fr.Gripper(self.host) if self.use_gripper else None
        except (fr.NetworkException, fr.IncompatibleVersionException, fr.RealtimeException) as e:
            raise RobotConnectionError(f"cannot connect to the Franka at {self.host}: {type(e).__name__}: {e} "
                                       "(robot on, FCI enabled, or franky-sim running?)") from e
        self._robot, self._gripper = robot, gripper
        self._width = float(gripper.width) if gripper is not None else 0.0
        self._gripper_target = self._width

    def disconnect(self) -> None:
        """Stop the arm, let a gripper move finish, then release the connections.

        franky's Gripper cannot be destroyed safely mid-move: a future destroyed after its
        gripper crashes the process, and a gripper whose move was preempted may never answer,
        so its destructor blocks forever. A move still running after ``5 s`` therefore keeps
        its gripper object alive (parked, logged) instead of hanging or crashing."""
        if self._robot is None:
            return
        try:
            self._robot.stop()
        except Exception:
            pass
        fut, self._gripper_future = self._gripper_future, None
        if fut is not None:
            done = False
            try:
                done = bool(fut.wait(5.0))
            except Exception:
                pass
            if not done:
                import logging
                logging.getLogger("groundflow.deploy.franka").warning(
                    "gripper move still running at disconnect; leaving its connection open")
                _PARKED.append((self._gripper, fut))
            del fut  # the future goes before the gripper it belongs to
        self._gripper = None
        self._robot = None

    # ----- state ----------------------------------------------------------------------------
    def joint_positions(self) -> np.ndarray:
        check_connected(self)
        return np.asarray(self._robot.current_joint_state.position, np.float64)

    def get_observation(self) -> Obs:
        check_connected(self)
        try:
            rs = self._robot.state  # one read (~1 ms when idle: it waits for the next 1 kHz packet)
            self._read_gripper()
        except self._franky.NetworkException as e:
            raise RobotConnectionError(f"lost the Franka at {self.host}: {e}") from e
        pose = rs.O_T_EE
        state = np.concatenate([np.asarray(rs.q).reshape(7), np.asarray(rs.dq).reshape(7), [self._width],
                                np.asarray(pose.translation).reshape(3), np.asarray(pose.quaternion).reshape(4)])
        return {"state": state.astype(np.float32), "instruction": self.instruction}

    def _read_gripper(self) -> None:
        """Gripper width, read at most every ``gripper_read_s`` (each read is a network round trip
        to the gripper server) and not while a move is in flight."""
        import time
        if self._gripper is None or time.monotonic() - self._width_t < self.gripper_read_s:
            return
        if self._gripper_future is None or self._gripper_future.wait(0):
            self._width = float(self._gripper.width)
            self._width_t = time.monotonic()

    def hold_action(self) -> np.ndarray:
        return np.r_[self.joint_positions(), self._width].astype(np.float32)

    @staticmethod
    def forward_kinematics(action: np.ndarray) -> np.ndarray:
        """TCP position of a joint-position action (for the safety layer's workspace box)."""
        return franka_tcp_position(action)

    # ----- commands -------------------------------------------------------------------------
    def send_action(self, action: np.ndarray) -> None:
        check_connected(self)
        a = np.asarray(action, np.float64).reshape(-1)
        if a.shape != (8,):
            raise InvalidOptionError(f"Franka action must have 8 entries (7 joints + gripper width), got {a.shape}")
        fr = self._franky
        motion = fr.JointMotion(fr.JointState(a[:7].tolist()), return_when_finished=False)
        try:
            self._robot.move(motion, asynchronous=True)
        except (fr.ControlException, fr.CommandException, fr.InvalidMotionTypeException) as e:
            raise RobotCommandError(f"Franka refused the joint target: {type(e).__name__}: {e}; "
                                    "call recover() after checking the robot") from e
        except fr.NetworkException as e:
            raise RobotConnectionError(f"lost the Franka at {self.host}: {e}") from e
        self._command_gripper(float(a[7]))

    def _command_gripper(self, width: float) -> None:
        if self._gripper is None:
            return
        width = float(np.clip(width, 0.0, GRIPPER_MAX_WIDTH))
        busy = self._gripper_future is not None and not self._gripper_future.wait(0)
        if busy or (self._gripper_target is not None and abs(width - self._gripper_target) < self.gripper_tolerance):
            return
        try:
            self._gripper_future = self._gripper.move_async(width, self.gripper_speed)
        except self._franky.GripperException as e:
            raise RobotCommandError(f"Franka gripper refused width {width:.3f} m: {e}") from e
        self._gripper_target = width

    def recover(self) -> bool:
        """Clear a reflex / error state (after a human checked the robot)."""
        check_connected(self)
        return bool(self._robot.recover_from_errors())

    def wait_until_still(self, timeout_s: float = 5.0, tol: float = 1e-3, window_s: float = 0.2) -> bool:
        """Block until no joint moved more than ``tol`` rad over ``window_s`` (True), or timeout.

        Positions, not the reported velocities: a stiff wrist joint can chatter in its velocity
        estimate while standing still."""
        import time
        check_connected(self)
        end = time.monotonic() + timeout_s
        last = self.joint_positions()
        while time.monotonic() < end:
            time.sleep(window_s)
            q = self.joint_positions()
            if np.all(np.abs(q - last) < tol):
                return True
            last = q
        return False
