"""``XArmRobot``: a UFACTORY xArm 5/6/7 (Lite 6 too) through xarm-python-sdk, in servo mode.

Action (axis + 1): joint-position targets (rad) sent with ``set_servo_angle_j`` (servo mode 1),
then the gripper opening width (m, 0..0.085), moved only when it changes by more than
``gripper_tolerance``. State (axis + 1): joint angles (rad) and gripper width (m).

The SDK reports failures as integer return codes instead of exceptions; ``check_code`` turns
every non-zero code into an exception that names it (the SDK's own ``APIState`` names and the
controller's error table), so no failed command goes unnoticed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deploy.errors import DriverMissingError, RobotCommandError, RobotConnectionError
from deploy.robots.base import Obs, RobotSpec, check_connected
from envs.errors import InvalidOptionError

GRIPPER_MAX_WIDTH = 0.085  # m; the SDK's gripper position runs 0..850
GRIPPER_UNITS_PER_M = 850 / GRIPPER_MAX_WIDTH
# joint ranges (rad) from the xArm datasheets; speed limit 180 deg/s, scaled down by default
JOINT_LIMITS = {
    7: ((-2 * np.pi, -2.059, -2 * np.pi, -0.19198, -2 * np.pi, -1.69297, -2 * np.pi),
        (2 * np.pi, 2.0944, 2 * np.pi, 3.927, 2 * np.pi, np.pi, 2 * np.pi)),
    6: ((-2 * np.pi, -2.059, -3.927, -2 * np.pi, -1.69297, -2 * np.pi),
        (2 * np.pi, 2.0944, 0.19198, 2 * np.pi, np.pi, 2 * np.pi)),
    5: ((-2 * np.pi, -2.059, -3.927, -1.69297, -2 * np.pi),
        (2 * np.pi, 2.0944, 0.19198, np.pi, 2 * np.pi)),
}
CONNECTION_CODES = {-1, 3, 4, 5, 6, 7, 8}  # not connected, reply timeout / length / number / protocol errors


def _import_xarm() -> Any:
    try:
        from xarm.wrapper import XArmAPI
    except ImportError as e:
        raise DriverMissingError(f"the xArm driver needs xarm-python-sdk ({e}); pip install xarm-python-sdk "
                                 "(or 'groundflow[robots]')") from e
    return XArmAPI


def code_name(code: int) -> str:
    """The SDK's name for a return code (``APIState``), e.g. -7 -> JOINT_LIMIT."""
    try:
        from xarm.x3.code import APIState
    except ImportError:
        return str(code)
    names = [k for k, v in vars(APIState).items() if not k.startswith("_") and v == code]
    return names[0] if names else f"code {code}"


def controller_error(err: int) -> str:
    """Title of a controller error code (``api.error_code``) from the SDK's table."""
    try:
        from xarm.core.config.x_code import ControllerError
        e = ControllerError(err)
        return f"C{err} {e.title.get('en', '')}: {e.description.get('en', '')}".strip()
    except Exception:
        return f"C{err}"


def check_code(code: Any, what: str, host: str = "?", api: Any = None) -> Any:
    """Return the payload of an SDK call, or raise naming the failure.

    SDK calls return ``code`` or ``(code, value)``. Connection-level codes raise
    ``RobotConnectionError``; everything else ``RobotCommandError`` (with the controller's
    error text when the code says the controller has an error)."""
    value = None
    if isinstance(code, (tuple, list)):
        code, value = code[0], (code[1] if len(code) == 2 else list(code[1:]))
    code = int(code)
    if code == 0:
        return value
    name = code_name(code)
    if code in CONNECTION_CODES:
        raise RobotConnectionError(f"xArm at {host}: {what} failed: {name} ({code}); is the controller on and "
                                   "reachable (TCP 502)?")
    detail = ""
    if code == 1 and api is not None:  # HAS_ERROR
        detail = f": controller error {controller_error(int(getattr(api, 'error_code', 0) or 0))}; clear it with clean_error()"
    elif code == -9:
        detail = ": the emergency stop is pressed"
    elif code in (-2, 9):
        detail = ": the arm is not ready (motion_enable(True), set_mode(1), set_state(0))"
    raise RobotCommandError(f"xArm at {host}: {what} failed: {name} ({code}){detail}")


def xarm_spec(axis: int = 7, control_rate_hz: float = 20.0, velocity_scale: float = 0.5) -> RobotSpec:
    if axis not in JOINT_LIMITS:
        raise InvalidOptionError(f"xArm axis must be one of {sorted(JOINT_LIMITS)}, got {axis}")
    lo, hi = JOINT_LIMITS[axis]
    vel = np.r_[np.full(axis, np.pi * velocity_scale), np.inf]
    return RobotSpec(name=f"xarm{axis}", state_dim=axis + 1, action_dim=axis + 1,
                     action_low=np.r_[lo, 0.0], action_high=np.r_[hi, GRIPPER_MAX_WIDTH],
                     absolute=np.ones(axis + 1, bool), control_rate_hz=control_rate_hz, max_velocity=vel,
                     max_acceleration=np.r_[np.full(axis, 10.0), np.inf],
                     action_names=tuple(f"joint{i}" for i in range(1, axis + 1)) + ("gripper_width",))


class XArmRobot:
    def __init__(self, ip: str, *, axis: int = 7, instruction: str = "", control_rate_hz: float = 20.0,
                 gripper: bool = True, gripper_speed: float = 2000.0, gripper_tolerance: float = 0.003,
                 velocity_scale: float = 0.5):
        self.host, self.instruction = ip, instruction
        self.spec = xarm_spec(axis, control_rate_hz, velocity_scale)
        self.axis = axis
        self.use_gripper, self.gripper_speed, self.gripper_tolerance = gripper, gripper_speed, gripper_tolerance
        XArmAPI = _import_xarm()
        # do_not_open: construct offline; the socket opens in connect()
        self.api = XArmAPI(ip, is_radian=True, do_not_open=True)
        self._connected = False
        self._gripper_target: float | None = None

    @property
    def is_connected(self) -> bool:
        return self._connected and bool(getattr(self.api, "connected", False))

    def connect(self) -> None:
        if self.is_connected:
            return
        try:
            self.api.connect()
        except Exception as e:  # the SDK raises a bare Exception("connect socket failed")
            raise RobotConnectionError(f"cannot connect to the xArm at {self.host}: {e}") from e
        if not self.api.connected:
            raise RobotConnectionError(f"cannot connect to the xArm at {self.host}")
        if getattr(self.api, "axis", self.axis) != self.axis:
            raise InvalidOptionError(f"the xArm at {self.host} has {self.api.axis} joints, configured for {self.axis}")
        self._connected = True
        self._call(self.api.clean_error(), "clean_error")
        self._call(self.api.motion_enable(enable=True), "motion_enable")
        self._call(self.api.set_mode(1), "set_mode(1: servo)")
        self._call(self.api.set_state(0), "set_state(0: ready)")
        if self.use_gripper:
            self._call(self.api.set_gripper_enable(True), "set_gripper_enable")

    def disconnect(self) -> None:
        if self._connected:
            try:
                self.api.set_state(4)  # stop
                self.api.disconnect()
            except Exception:
                pass
        self._connected = False

    def _call(self, code: Any, what: str) -> Any:
        return check_code(code, what, self.host, self.api)

    def _joints(self) -> np.ndarray:
        angles = self._call(self.api.get_servo_angle(is_radian=True), "get_servo_angle")
        return np.asarray(angles, np.float64).reshape(-1)[: self.axis]

    def _gripper_width(self) -> float:
        if not self.use_gripper:
            return 0.0
        pos = self._call(self.api.get_gripper_position(), "get_gripper_position")
        return float(pos) / GRIPPER_UNITS_PER_M

    def get_observation(self) -> Obs:
        check_connected(self)
        state = np.r_[self._joints(), self._gripper_width()].astype(np.float32)
        return {"state": state, "instruction": self.instruction}

    def hold_action(self) -> np.ndarray:
        check_connected(self)
        return np.r_[self._joints(), self._gripper_width()].astype(np.float32)

    def send_action(self, action: np.ndarray) -> None:
        a = np.asarray(action, np.float64).reshape(-1)
        if a.shape != (self.axis + 1,) or not np.all(np.isfinite(a)):
            raise InvalidOptionError(f"xArm{self.axis} action must be {self.axis + 1} finite values "
                                     f"({self.axis} joints + gripper width), got {a.tolist()}")
        check_connected(self)
        self._call(self.api.set_servo_angle_j(a[: self.axis].tolist(), is_radian=True), "set_servo_angle_j")
        if self.use_gripper:
            w = float(np.clip(a[-1], 0.0, GRIPPER_MAX_WIDTH))
            if self._gripper_target is None or abs(w - self._gripper_target) >= self.gripper_tolerance:
                self._call(self.api.set_gripper_position(w * GRIPPER_UNITS_PER_M, wait=False,
                                                         speed=self.gripper_speed), "set_gripper_position")
                self._gripper_target = w
