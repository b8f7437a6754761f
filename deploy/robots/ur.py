"""``URRobot``: a Universal Robots e-series arm through ur-rtde (RTDE receive + control).

Action (6): joint-position targets (rad), executed with ``servoJ`` for one control period
(``lookahead_time`` and ``gain`` smooth the servo). State (18): actual q (6), qd (6), TCP pose
(position 3 + axis-angle 3). No gripper (Robotiq grippers talk through a separate URCap).

Every command first checks the controller's robot and safety modes from the RTDE stream and
refuses, naming the mode, unless the arm is RUNNING in NORMAL or REDUCED safety mode.
The control interface uploads a script to the controller and needs the dashboard server
(remote control enabled); the receive interface needs only RTDE (TCP 30004).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deploy.errors import DriverMissingError, RobotCommandError, RobotConnectionError
from deploy.robots.base import Obs, RobotSpec, check_connected
from envs.errors import InvalidOptionError

ROBOT_MODES = {-1: "NO_CONTROLLER", 0: "DISCONNECTED", 1: "CONFIRM_SAFETY", 2: "BOOTING", 3: "POWER_OFF",
               4: "POWER_ON", 5: "IDLE", 6: "BACKDRIVE", 7: "RUNNING", 8: "UPDATING_FIRMWARE"}
SAFETY_MODES = {1: "NORMAL", 2: "REDUCED", 3: "PROTECTIVE_STOP", 4: "RECOVERY", 5: "SAFEGUARD_STOP",
                6: "SYSTEM_EMERGENCY_STOP", 7: "ROBOT_EMERGENCY_STOP", 8: "VIOLATION", 9: "FAULT",
                10: "VALIDATE_JOINT_ID", 11: "UNDEFINED_SAFETY_MODE", 12: "AUTOMATIC_MODE_SAFEGUARD_STOP",
                13: "SYSTEM_THREE_POSITION_ENABLING_STOP"}
RECEIVE_VARIABLES = ["timestamp", "actual_q", "actual_qd", "actual_TCP_pose", "robot_mode", "safety_mode"]
# e-series datasheets: +-360 deg on every joint, 180 deg/s (UR3e wrist: 360); acceleration is
# not specified per joint: 10 rad/s^2 is a conservative servo limit.
MODELS = {"ur3e": (np.pi, 2 * np.pi), "ur5e": (np.pi, np.pi), "ur10e": (2 * np.pi / 3, np.pi),
          "ur16e": (2 * np.pi / 3, np.pi)}


def ur_spec(model: str = "ur5e", control_rate_hz: float = 20.0, velocity_scale: float = 0.5) -> RobotSpec:
    if model not in MODELS:
        raise InvalidOptionError(f"unknown UR model {model!r}; valid: {list(MODELS)}")
    base_vel, wrist_vel = MODELS[model]
    vel = np.array([base_vel] * 3 + [wrist_vel] * 3) * velocity_scale
    return RobotSpec(name=f"ur-{model}", state_dim=18, action_dim=6, action_low=np.full(6, -2 * np.pi),
                     action_high=np.full(6, 2 * np.pi), absolute=np.ones(6, bool), control_rate_hz=control_rate_hz,
                     max_velocity=vel, max_acceleration=np.full(6, 10.0),
                     action_names=("base", "shoulder", "elbow", "wrist1", "wrist2", "wrist3"), meta={"model": model})


def check_status(robot_mode: int, safety_mode: int) -> None:
    """Raise ``RobotCommandError`` unless the arm can take motion commands."""
    if robot_mode != 7:
        raise RobotCommandError(f"UR robot mode is {ROBOT_MODES.get(robot_mode, robot_mode)}, needs RUNNING "
                                "(power on and release the brakes on the teach pendant)")
    if safety_mode not in (1, 2):
        raise RobotCommandError(f"UR safety mode is {SAFETY_MODES.get(safety_mode, safety_mode)}; clear it on the "
                                "teach pendant (or unlock the protective stop) before commanding motion")


def servo_command(action: Any, dt: float, lookahead_time: float = 0.1, gain: float = 300.0) -> tuple:
    """Arguments of ``servoJ(q, speed, acceleration, time, lookahead_time, gain)`` for one target."""
    q = np.asarray(action, np.float64).reshape(-1)
    if q.shape != (6,) or not np.all(np.isfinite(q)):
        raise InvalidOptionError(f"UR action must be 6 finite joint positions (rad), got {q.tolist()}")
    if not 0.002 <= dt <= 1.0:
        raise InvalidOptionError(f"servo time must be in [0.002, 1] s (one control period), got {dt}")
    if not 0.03 <= lookahead_time <= 0.2:
        raise InvalidOptionError(f"lookahead_time must be in [0.03, 0.2] s, got {lookahead_time}")
    if not 100 <= gain <= 2000:
        raise InvalidOptionError(f"gain must be in [100, 2000], got {gain}")
    return (q.tolist(), 0.0, 0.0, float(dt), float(lookahead_time), float(gain))


def _import_rtde() -> tuple[Any, Any]:
    try:
        import rtde_control
        import rtde_receive
    except ImportError as e:
        raise DriverMissingError(f"the UR driver needs ur-rtde ({e}); pip install ur-rtde "
                                 "(or 'groundflow[robots]')") from e
    return rtde_receive, rtde_control


class URRobot:
    def __init__(self, host: str, *, model: str = "ur5e", instruction: str = "", frequency: float = 125.0,
                 control_rate_hz: float = 20.0, lookahead_time: float = 0.1, gain: float = 300.0,
                 control: bool = True, velocity_scale: float = 0.5):
        self.host, self.instruction = host, instruction
        self.spec = ur_spec(model, control_rate_hz, velocity_scale)
        self.frequency = float(frequency)
        self.lookahead_time, self.gain = float(lookahead_time), float(gain)
        servo_command(np.zeros(6), 1.0 / control_rate_hz, lookahead_time, gain)  # validate options now
        self.use_control = control
        self._rtde_receive, self._rtde_control = _import_rtde()
        self._recv: Any = None
        self._ctrl: Any = None

    @property
    def is_connected(self) -> bool:
        return self._recv is not None and bool(self._recv.isConnected())

    def connect(self) -> None:
        if self._recv is not None:
            return
        try:
            self._recv = self._rtde_receive.RTDEReceiveInterface(self.host, self.frequency, RECEIVE_VARIABLES)
        except RuntimeError as e:
            raise RobotConnectionError(f"cannot open RTDE (TCP 30004) on the UR at {self.host}: {e}") from e
        if self.use_control:
            try:
                self._ctrl = self._rtde_control.RTDEControlInterface(self.host, self.frequency)
            except RuntimeError as e:
                self._recv.disconnect()
                self._recv = None
                raise RobotConnectionError(f"cannot start RTDE control on the UR at {self.host} (remote control "
                                           f"enabled? dashboard server on 29999 reachable?): {e}") from e

    def disconnect(self) -> None:
        if self._ctrl is not None:
            for fn in ("servoStop", "stopScript", "disconnect"):
                try:
                    getattr(self._ctrl, fn)()
                except Exception:
                    pass
            self._ctrl = None
        if self._recv is not None:
            try:
                self._recv.disconnect()
            except Exception:
                pass
            self._recv = None

    def status(self) -> tuple[int, int]:
        check_connected(self)
        return int(self._recv.getRobotMode()), int(self._recv.getSafetyMode())

    def check_status(self) -> None:
        check_status(*self.status())

    def get_observation(self) -> Obs:
        check_connected(self)
        r = self._recv
        state = np.concatenate([r.getActualQ(), r.getActualQd(), r.getActualTCPPose()]).astype(np.float32)
        if state.shape != (18,):
            raise RobotConnectionError(f"UR at {self.host} sent an incomplete state ({state.shape[0]} values)")
        return {"state": state, "instruction": self.instruction}

    def hold_action(self) -> np.ndarray:
        check_connected(self)
        return np.asarray(self._recv.getActualQ(), np.float32)

    def send_action(self, action: np.ndarray) -> None:
        check_connected(self)
        if self._ctrl is None:
            raise RobotCommandError(f"URRobot({self.host}) was connected read-only (control=False)")
        args = servo_command(action, 1.0 / self.spec.control_rate_hz, self.lookahead_time, self.gain)
        self.check_status()
        if not self._ctrl.servoJ(*args):
            raise RobotCommandError(f"UR at {self.host} rejected servoJ to {np.round(args[0], 4).tolist()}")
