"""Obstacles given at deploy time: a served flow policy is guided around them and every sent chunk is
checked, through the real server, client, control loop, safety layer and simulated arm."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deploy.serving.client import LocalPolicy, PolicyClient
from deploy.control import ControlLoop, LoopConfig
from deploy.errors import ConstraintRefusedError, EXIT_CONSTRAINT_REFUSED, ServerError
from deploy.evaluate import evaluate_via_server
from deploy.safety import SafetyLayer
from deploy.scripted import JointTargetPolicy
from deploy.serving.server import PolicyServer
from deploy.robots.sim import SimRobot
from envs.errors import InvalidOptionError
from policies.constraints import ArmConstraints, ArmGuidance
from policies.selection import ChunkCheck
from tests.conftest import tiny_flow_policy

ENV = "maniskill/CollisionAvoidance-v1"


@pytest.fixture(scope="module")
def reacher(tmp_path_factory):
    """A tiny flow policy trained on straight reaches with no obstacle (40 DART demos, 600 steps)."""
    import policies
    from train.bc import TrainArgs, train
    from train.collect import CollectArgs, collect
    d = tmp_path_factory.mktemp("reacher")
    collect(CollectArgs(env=ENV, episodes=40, out=d / "demos.h5", seed=0, progress=False, dart_noise=0.3))
    train(TrainArgs(data=(d / "demos.h5",), policy="flow", steps=600, horizon=8, n_exec=4, out=d / "run",
                    wandb="disabled", progress=False, seed=0))
    return policies.load(d / "run" / "ckpt", to_act=True)


@pytest.fixture(scope="module")
def untrained():
    return tiny_flow_policy(ENV)[0]


def _robot(seed: int = 0, realtime: bool = False) -> SimRobot:
    robot = SimRobot(ENV, env_options={"obstacles": "random"}, seed=seed, realtime=realtime)
    robot.connect()
    return robot


def test_a_served_reacher_goes_around_obstacles_it_never_saw_and_never_touches_them(reacher):
    with PolicyServer(reacher, port=0) as srv:
        address = f"127.0.0.1:{srv.port}"
        kw = dict(n_episodes=4, seed=5000, env_options={"obstacles": "random"}, max_steps=60)
        blind = evaluate_via_server(ENV, address, **kw)
        guided = evaluate_via_server(ENV, address, obstacles="scene", **kw)
    assert blind["collision_rate"] >= 0.75  # the obstacles stand across the straight path it learned
    assert guided["collision_rate"] == 0.0
    # plausible: the detour still reaches for the goal (0.25-0.35 m from the start; the blind arm ends 12-28 cm
    # away, stopped by the obstacle): most guided episodes end within 7 cm of it
    assert sum(e["dist_to_goal"] < 0.07 for e in guided["episodes"]) >= 2


def test_a_slide_replaces_holds_and_stays_clear(reacher):
    """fallback="slide": where no sample passes the check, a short checked move along the obstacle is sent
    instead of a hold, on the same episodes: fewer holds, still no collision. One sample per plan and no
    retry, so that the check does leave plans without a chunk."""
    one = ChunkCheck()
    with PolicyServer(reacher, port=0) as srv:
        address = f"127.0.0.1:{srv.port}"
        kw = dict(n_episodes=4, seed=5000, env_options={"obstacles": "random"}, max_steps=60, obstacles="scene")
        held = evaluate_via_server(ENV, address, guidance=ArmGuidance(check=one), **kw)
        slid = evaluate_via_server(ENV, address, guidance=ArmGuidance(check=one, fallback="slide"), **kw)
    holds = [sum(e["constraint_holds"] for e in r["episodes"]) for r in (held, slid)]
    assert holds[0] > 0 and holds[1] < holds[0], holds
    assert slid["collision_rate"] == 0.0


def test_a_constrained_reply_holds_only_the_checked_steps(reacher):
    """The check covers the ``n_exec`` steps that run before the next plan; the rest of the chunk is
    not sent, so no later step (after a hold or a failed request) can leave the checked path."""
    robot = _robot(5000)
    try:
        c, obs = robot.arm_constraints(), robot.get_observation()
    finally:
        robot.close()
    with PolicyServer(reacher, port=0) as srv, PolicyClient(port=srv.port) as client:
        plain = client.infer(obs, seed=0)
        client.set_constraints(c)
        replies = [client.infer(obs, seed=k) for k in range(4)]
    assert plain.actions.shape[0] == reacher.config.horizon == 8
    assert all(r.actions.shape[0] == (0 if r.hold else reacher.config.n_exec) for r in replies)
    assert all(np.abs(r.actions).max(initial=0) <= 1.0 for r in replies)  # what was checked: the clipped chunk


@pytest.mark.parametrize("realtime", [False, True])
def test_a_hold_keeps_the_arm_still_and_nothing_of_an_older_plan_runs(untrained, realtime):
    robot = _robot(realtime=realtime)  # realtime: the env steps at its rate on its own, chunks come in the background
    try:
        tcp0 = robot.env.raw.tcp_and_goal()[0]
        # a box around the gripper: every chunk's first waypoints are inside it, so none passes the check
        c = robot.arm_constraints([{"type": "box", "center": tcp0.tolist(), "half_size": [0.12, 0.12, 0.12]}])
        source = LocalPolicy(untrained)
        source.set_constraints(c)
        cfg = LoopConfig(rate_hz=robot.spec.control_rate_hz, max_steps=12, realtime=realtime, seed=0)
        res = ControlLoop(robot, source, cfg, SafetyLayer(robot, None, dt=1.0 / cfg.rate_hz)).run_episode(seed=0)
        moved = np.linalg.norm(robot.env.raw.tcp_and_goal()[0] - tcp0)
    finally:
        robot.close()
    assert len(res.holds) == 12 and res.reason == "max_steps"
    assert res.interventions["constraint"] == 12 and res.interventions["watchdog"] == 0  # asked for, not a failure
    assert moved < 0.005  # metres: it stood still (delta commands of zero)
    if realtime:
        assert robot.steps >= 6  # the simulator did run on its own clock meanwhile (about one step a tick)


def test_a_goal_inside_an_obstacle_is_refused_through_the_server_and_by_deploy(untrained, tmp_path, capsys):
    from deploy.commands import deploy
    robot = _robot()
    goal = robot.env.raw.tcp_and_goal()[1]
    c = robot.arm_constraints([{"type": "sphere", "center": goal.tolist(), "radius": 0.05}])
    obs = robot.get_observation()
    robot.close()
    with PolicyServer(untrained, port=0) as srv, PolicyClient(port=srv.port) as client:
        client.set_constraints(c)
        with pytest.raises(ConstraintRefusedError, match="inside obstacle 0"):
            client.infer(obs)
        port = srv.port
        path = tmp_path / "obstacles.json"
        path.write_text(json.dumps(c.to_message()["obstacles"]))
        with pytest.raises(SystemExit) as e:
            deploy(["--robot", "sim", "--env", ENV, "--server", f"127.0.0.1:{port}", "--lockstep", "--obstacles",
                    str(path), "--no-status", "--seed", "0"])
        assert srv.stats["requests"] == 0  # no chunk was asked for, so none was sent
    assert e.value.code == EXIT_CONSTRAINT_REFUSED
    assert "obstacles refused, no motion sent" in capsys.readouterr().err


def test_bad_constraints_get_a_clear_error_naming_the_problem(untrained):
    robot = _robot()
    try:
        good = robot.arm_constraints().to_message()
    finally:
        robot.close()
    with PolicyServer(untrained, port=0) as srv, PolicyClient(port=srv.port) as client:
        for bad, words in (({"obstacles": [{"type": "cone"}]}, "obstacle 0"),
                           ({"obstacles": [{"type": "sphere", "center": [0, 0, 0], "radius": -1}]}, "radius"),
                           ({"body": [[[0, 0, 0]]]}, "body"), ({"tcp_index": 400}, "tcp_index"),
                           ({"body": [[[-1, -1, -1], [1, 1, 1]]]}, "points at the check's spacing"),
                           ({"ee_delta_scale": float("nan")}, "ee_delta_scale"),
                           ({"settings": {"scale": -1}}, "settings.scale"),
                           ({"settings": {"fallback": "teleport"}}, "settings.fallback"),
                           ({"settings": {"candidates": 32, "retries": 1}}, "at most 32"),
                           ({"settings": {"method": "velocity_gradient", "options": {}}}, "gradients through")):
            with pytest.raises(ServerError, match=words):
                client._request({"type": "constraints", **{**good, **bad}})
        assert client.healthy  # the connection survives each refusal
    with PolicyServer(JointTargetPolicy(good["tcp_index"] + 20, 4, np.zeros(4)), port=0) as srv, \
            PolicyClient(port=srv.port) as client:
        with pytest.raises(ServerError, match="flow policy"):
            client.set_constraints(ArmConstraints.from_message(good))
    with pytest.raises(InvalidOptionError, match="half_size"):
        ArmConstraints.from_message({**good, "obstacles": [{"type": "box", "center": [0, 0, 0], "half_size": [1, 1]}]})


def test_settings_travel_with_the_constraints_and_change_what_the_server_does(reacher):
    """A client's settings reach the server: with no flow step the guidance is off and the check alone
    decides, which a direct in-process plan with the same settings reproduces."""
    robot = _robot(5000)
    try:
        obs = robot.get_observation()
        slow = robot.arm_constraints(settings=ArmGuidance(n_steps=1, scale=0.0))
    finally:
        robot.close()
    assert ArmConstraints.from_message(slow.to_message()) == slow
    local = LocalPolicy(reacher)
    local.set_constraints(slow)
    with PolicyServer(reacher, port=0) as srv, PolicyClient(port=srv.port) as client:
        client.set_constraints(slow)
        for k in range(3):
            a, b = client.infer(obs, seed=k), local.infer(obs, seed=k)
            assert a.hold == b.hold
            np.testing.assert_allclose(a.actions, b.actions, atol=1e-6)


def test_the_deploy_defaults_are_the_collision_benchmarks_recommended_row():
    """... plus the check's coast, which only the deploy benchmark measures (``collision_deploy``)."""
    from pathlib import Path
    res = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/guidance.json").read_text())
    row = res["collision"][res["collision"]["recommended"]]
    cfg, d = row["config"], ArmGuidance()
    assert (cfg["method"], cfg["options"], cfg["n_steps"], cfg["margin"], cfg["goal_weight"]) == \
        (d.method, d.options, d.n_steps, d.margin, d.goal_weight)
    assert cfg["body"] == "links" and row["scale"] == d.scale
    assert (cfg["check"]["candidates"], cfg["check"]["retries"], cfg["check"]["retry_candidates"]) == \
        (d.check.candidates, d.check.retries, d.check.retry_candidates)
    assert cfg["margin_to_goal"] == d.margin_to_goal
