"""Evaluate a served policy in simulation through the deployment path (client, loop, safety).

The same code that drives a real arm drives a ``SimRobot``: what is measured here is what the
policy does behind the transport, the chunk scheduling and the safety layer. Lockstep by
default (``realtime=False``): episode ``i`` uses env seed ``seed + i`` and sampling seed
``seed + i``, so two evaluations of the same checkpoint give the same episodes.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from envs.metrics import wilson as wilson_ci
from deploy.serving.client import parse_address, robot_client
from deploy.control import ControlLoop, LoopConfig
from deploy.recording import Recorder
from deploy.safety import SafetyConfig, SafetyLayer
from deploy.robots.sim import SimRobot


def evaluate_via_server(env_id: str, server: str | Any = "127.0.0.1:8000", n_episodes: int = 10, seed: int = 0,
                        env_options: dict | None = None, max_steps: int | None = None, realtime: bool = False,
                        rate_hz: float | None = None, rtc: bool = False, ensemble: float | None = None,
                        timeout: float = 10.0, record: str | None = None, overwrite: bool = False,
                        safety: SafetyConfig | None = None, robot_options: dict | None = None,
                        instructions: Sequence[str] | None = None, obstacles: str | None = None,
                        guidance: Any = None) -> dict[str, Any]:
    """Run ``n_episodes`` of ``env_id`` with the policy served at ``server`` (``HOST:PORT`` or a
    connected client); returns the success rate with its 95% CI and per-episode results.

    ``instructions`` (suites): episode i commands ``instructions[i % len]``, as ``train.evaluate`` cycles
    them; without it every episode gets the suite's default task, which tests one instruction only.
    ``obstacles="scene"``: after each reset the client sends the scene's obstacles as deploy-time
    constraints (``SimRobot.arm_constraints``), as a user who measured the cell would; the result then
    counts collisions and the holds the server asked for; ``guidance``: their ``ArmGuidance`` settings
    (None: the defaults)."""
    if obstacles not in (None, "scene"):
        raise ValueError(f"obstacles must be None or 'scene', got {obstacles!r}")
    if n_episodes < 1:
        raise ValueError(f"n_episodes must be >= 1, got {n_episodes}")
    if instructions is not None and (isinstance(instructions, str) or not instructions):
        raise ValueError(f"instructions must be a non-empty list of strings, got {instructions!r}")
    robot = SimRobot(env_id, env_options=env_options, seed=seed, realtime=realtime, **(robot_options or {}))
    robot.connect()
    own_client = isinstance(server, str)
    client = server
    if own_client:
        host, port = parse_address(server)
        client = robot_client(host, port, robot.spec, (safety or SafetyConfig()).far_margin, timeout=timeout)
    recorder = Recorder(record, robot.spec, env_id=env_id, overwrite=overwrite,
                        meta={"server": getattr(client, "uri", "local")}) if record else None
    episodes: list[dict[str, Any]] = []
    rtts: list[float] = []
    try:
        for i in range(n_episodes):
            commanded = {"instruction": instructions[i % len(instructions)]} if instructions else None
            first = robot.reset(seed + i, options=commanded)
            if obstacles == "scene":
                client.set_constraints(robot.arm_constraints(settings=guidance))
            cfg = LoopConfig(rate_hz=rate_hz or robot.spec.control_rate_hz,
                             max_steps=max_steps or int(getattr(robot.env, "max_episode_steps", 200)),
                             realtime=realtime, rtc=rtc, ensemble=ensemble, seed=seed + i)
            loop = ControlLoop(robot, client, cfg, SafetyLayer(robot, safety, dt=1.0 / cfg.rate_hz), recorder)
            res = loop.run_episode(seed=seed + i, task_id=robot.task_id)
            episodes.append({"seed": seed + i, "instruction": first.get("instruction"), "success": res.success,
                             "steps": res.steps, "reason": res.reason,
                             "interventions": sum(v for k, v in res.interventions.items() if k != "constraint"),
                             "holds": len(res.holds), "constraint_holds": res.interventions.get("constraint", 0)})
            if "collided" in robot.last_info:  # the env's own contact test, sticky over the episode
                episodes[-1]["collided"] = bool(np.asarray(robot.last_info["collided"]).any())
            if "dist_to_goal" in robot.last_info:  # reaching tasks: how far from the goal it ended
                episodes[-1]["dist_to_goal"] = float(np.asarray(robot.last_info["dist_to_goal"]).reshape(-1)[0])
            if "rtt_p50_ms" in res.timing:
                rtts.append(res.timing["rtt_p50_ms"])
        if recorder is not None:
            recorder.close()
    except BaseException:
        if recorder is not None:
            recorder.abort()
        raise
    finally:
        if own_client:
            client.close()
        robot.close()
    k = sum(e["success"] for e in episodes)
    lo, hi = wilson_ci(k, len(episodes))
    out = {"env_id": env_id, "n_episodes": len(episodes), "success_rate": k / len(episodes), "ci95": [lo, hi],
           "rtt_p50_ms": float(np.median(rtts)) if rtts else None, "episodes": episodes, "record": record}
    if episodes and "collided" in episodes[0]:
        c = sum(e["collided"] for e in episodes)
        out.update(collision_rate=c / len(episodes), collision_ci95=list(wilson_ci(c, len(episodes))),
                   clean_success_rate=sum(e["success"] and not e["collided"] for e in episodes) / len(episodes))
    return out
