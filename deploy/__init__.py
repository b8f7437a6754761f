"""groundflow deploy: robots, the policy server/client, the control loop, safety and recording.

    from deploy import SimRobot, PolicyServer, PolicyClient, ControlLoop, LoopConfig
    robot = SimRobot("maniskill/PushCube-v1"); robot.connect()
    with PolicyServer(policy, port=8000):
        client = PolicyClient("127.0.0.1", 8000, expect={"action_dim": 8, "state_dim": 35})
        result = ControlLoop(robot, client, LoopConfig(rate_hz=20)).run_episode()

Names are imported lazily so that ``import deploy`` pulls in neither a simulator nor a driver.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Robot": "deploy.robots.base", "RobotSpec": "deploy.robots.base",
    "SimRobot": "deploy.robots.sim", "FrankaRobot": "deploy.robots.franka", "URRobot": "deploy.robots.ur",
    "XArmRobot": "deploy.robots.xarm", "FrankySim": "deploy.robots.franka_sim",
    "PolicyServer": "deploy.serving.server", "PolicyClient": "deploy.serving.client", "LocalPolicy": "deploy.serving.client",
    "SafetyLayer": "deploy.safety", "SafetyConfig": "deploy.safety",
    "ControlLoop": "deploy.control", "LoopConfig": "deploy.control", "EpisodeResult": "deploy.control",
    "Recorder": "deploy.recording", "RTCConfig": "policies.rtc_config", "JointTargetPolicy": "deploy.scripted",
    "evaluate_via_server": "deploy.evaluate",
    "debug": "deploy.debugging.search", "prepare": "deploy.debugging.search", "attribute": "deploy.debugging.search",
    "exhaustive_ablation": "deploy.debugging.search", "DebugConfig": "deploy.debugging.search", "Outcome": "deploy.debugging.search",
    "Attribution": "deploy.debugging.search", "debug_command": "deploy.debugging.report",
    "Fault": "deploy.debugging.faults", "FaultyEnv": "deploy.debugging.faults",
    "record_episode": "deploy.debugging.faults",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'deploy' has no attribute {name!r}")
