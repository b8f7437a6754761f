"""XArmRobot offline: construction without a controller, error codes -> clear exceptions."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("xarm")

from deploy.errors import RobotCommandError, RobotConnectionError  # noqa: E402
from deploy.robots.xarm import XArmRobot, check_code, code_name, xarm_spec  # noqa: E402
from envs.errors import InvalidOptionError  # noqa: E402


def test_constructs_offline_and_refuses_commands_before_connect():
    robot = XArmRobot("127.0.3.1", axis=6)
    assert robot.spec.action_dim == 7 and robot.spec.state_dim == 7 and not robot.is_connected
    with pytest.raises(RobotConnectionError, match="not connected"):
        robot.get_observation()
    with pytest.raises(InvalidOptionError, match="7 finite values"):
        robot.send_action(np.zeros(3))
    with pytest.raises(RobotConnectionError, match="not connected"):
        robot.send_action(np.zeros(7))


def test_connect_to_nothing_is_a_connection_error():
    robot = XArmRobot("127.0.3.2")
    with pytest.raises(RobotConnectionError, match="cannot connect to the xArm at 127.0.3.2"):
        robot.connect()


def test_offline_sdk_calls_map_to_named_exceptions():
    robot = XArmRobot("127.0.3.3")
    # the real SDK object, never opened: every call returns NOT_CONNECTED (-1)
    with pytest.raises(RobotConnectionError, match="get_servo_angle failed: NOT_CONNECTED"):
        check_code(robot.api.get_servo_angle(is_radian=True), "get_servo_angle", robot.host, robot.api)
    with pytest.raises(RobotConnectionError, match="set_servo_angle_j failed: NOT_CONNECTED"):
        check_code(robot.api.set_servo_angle_j([0.0] * 7, is_radian=True), "set_servo_angle_j", robot.host)


@pytest.mark.parametrize("code, exc, match", [
    (-2, RobotCommandError, "NOT_READY.*set_state"),
    (-7, RobotCommandError, "JOINT_LIMIT"),
    (-6, RobotCommandError, "TCP_LIMIT"),
    (-9, RobotCommandError, "EMERGENCY_STOP.*emergency stop is pressed"),
    (3, RobotConnectionError, "RES_TIMEOUT"),
    (9, RobotCommandError, "STATE_NOT_READY"),
    (12, RobotCommandError, "PARAM_ERROR"),
])
def test_error_codes(code, exc, match):
    with pytest.raises(exc, match=match):
        check_code(code, "cmd", "xarm")
    with pytest.raises(exc, match=match):
        check_code((code, None), "cmd", "xarm")


def test_controller_error_text_is_included():
    class Api:  # what the SDK exposes after a controller fault: error_code
        error_code = 22
    with pytest.raises(RobotCommandError, match="HAS_ERROR.*C22 Self-Collision Error"):
        check_code(1, "set_servo_angle_j", "xarm", Api())


def test_success_returns_the_payload_and_spec():
    assert check_code(0, "x") is None
    assert check_code((0, [1.0, 2.0]), "x") == [1.0, 2.0]
    assert code_name(-1) == "NOT_CONNECTED"
    spec = xarm_spec(7)
    assert spec.action_dim == 8 and spec.action_high[-1] == pytest.approx(0.085)
    with pytest.raises(InvalidOptionError, match="axis"):
        xarm_spec(4)
