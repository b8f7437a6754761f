"""Safety layer: fuzzed bad actions never reach the driver; workspace, signals, driver faults."""

from __future__ import annotations

import math
import os
import signal
import time

import numpy as np
import pytest
from conftest import TickLog, recording, wait_for

from deploy.serving.client import LocalPolicy
from deploy.control import ControlLoop, LoopConfig
from deploy.fuzz import BAD_KINDS, fuzz_actions, violations
from deploy.robots.kinematics import franka_tcp_position
from deploy.safety import REJECTING, SafetyConfig, SafetyLayer
from deploy.scripted import JointTargetPolicy
from deploy.robots.sim import PANDA_MAX_ACCELERATION, SimRobot
from envs.errors import InvalidOptionError


RecordingSimRobot = recording(SimRobot)


@pytest.fixture(scope="module")
def robot():
    r = RecordingSimRobot("maniskill/PushCube-v1", max_acceleration=list(PANDA_MAX_ACCELERATION) + [np.inf])
    r.connect()
    yield r
    r.close()


def test_fuzzed_bad_actions_never_reach_the_driver(robot):
    robot.reset(0)
    robot.received.clear()
    safety = SafetyLayer(robot, SafetyConfig(), dt=1 / 20)
    safety.reset()
    start = safety.last_command.astype(np.float64)  # what the limits are measured from, not a second read
    kinds = []
    for kind, action in fuzz_actions(robot.spec, start, n=2000, seed=7):
        kinds.append(kind)
        safety.command(action)
    n_bad = sum(k != "good" for k in kinds)
    assert n_bad > 900 and set(kinds) >= set(BAD_KINDS)
    sent = np.asarray(robot.received)
    assert len(sent) == 2000 and sent.dtype == np.float32
    assert violations(sent, robot.spec, 1 / 20, start) == {
        "nonfinite": 0, "out_of_limits": 0, "velocity": 0, "acceleration": 0, "shape": 0}
    counts = safety.summary()["counts"]
    rejected_kinds = {"nan", "inf", "far_out", "wrong_shape", "wrong_type", "none"}
    assert sum(counts[k] for k in REJECTING) >= sum(k in rejected_kinds for k in kinds)
    assert counts["limit_clip"] > 0 and counts["velocity"] > 0 and counts["acceleration"] > 0
    # the simulator followed: its joints stayed inside the limits
    q = robot.get_observation()["state"][:7]
    assert np.all(q >= robot.spec.action_low[:7] - 1e-3) and np.all(q <= robot.spec.action_high[:7] + 1e-3)


class DriftingSimRobot(RecordingSimRobot):
    """Reads its joints back 8e-5 rad further each time, as franky-sim does while its PD settles."""

    reads = 0

    def hold_action(self):
        self.reads += 1
        a = super().hold_action()
        a[:7] += 8e-5 * self.reads
        return a


def test_limits_are_checked_from_the_safety_layers_command_not_from_a_second_read(robot):
    drifting = DriftingSimRobot(robot.env, max_acceleration=list(PANDA_MAX_ACCELERATION) + [np.inf])
    drifting.connect()
    safety = SafetyLayer(drifting, SafetyConfig(), dt=1 / 20)
    safety.reset()
    start = safety.last_command.astype(np.float64)
    second_read = drifting.hold_action().astype(np.float64)  # 8e-5 rad away from what the layer holds
    jump = start.copy()
    jump[:7] -= 1.0  # braked to the acceleration limit from rest
    safety.command(jump)
    sent = np.asarray(drifting.received)
    assert violations(sent, drifting.spec, 1 / 20, start) == {
        "nonfinite": 0, "out_of_limits": 0, "velocity": 0, "acceleration": 0, "shape": 0}
    # the same command measured from a second read shows an acceleration that was never commanded
    assert violations(sent, drifting.spec, 1 / 20, second_read)["acceleration"] == 1


def test_each_kind_of_bad_action_is_handled_as_documented(robot):
    robot.reset(0)
    safety = SafetyLayer(robot, SafetyConfig(), dt=1 / 20)
    safety.reset()
    hold = safety.last_command  # the target the layer holds, not a second read of the joints
    lo, hi = robot.spec.action_low, robot.spec.action_high
    for bad, kind in [(None, "shape"), ("go", "shape"), (np.zeros(3), "shape"), (np.full(8, np.nan), "nonfinite"),
                      (np.r_[hold[:7], np.inf], "nonfinite"), (hi + 5 * (hi - lo), "far_out_of_limits")]:
        cmd, events = safety.filter(bad)
        assert events and events[0].startswith(kind)
        np.testing.assert_allclose(cmd, hold, atol=1e-6)  # a rejected action holds (robot at rest)
    near = hold.copy()
    near[7] = 1.05  # gripper just past its limit: clipped, not rejected
    cmd, events = safety.filter(near)
    assert events[0].startswith("limit_clip") and cmd[7] == pytest.approx(1.0)
    strict = SafetyLayer(robot, SafetyConfig(limit_mode="reject"), dt=1 / 20)
    strict.reset()
    cmd, events = strict.filter(near)
    assert events[0].startswith("limit_reject") and cmd[7] == pytest.approx(strict.last_command[7])
    jump = hold.copy()
    jump[0] += 1.0  # 1 rad in one 50 ms tick
    cmd, events = safety.filter(jump)
    assert any(e.startswith(("velocity", "acceleration")) for e in events)
    assert abs(cmd[0] - hold[0]) <= 2.175 / 20 + 1e-6


def test_workspace_box_rejects_targets_that_leave_it(robot):
    robot.reset(0)
    hold = robot.hold_action()
    # franka_fk (Franka's DH table) agrees with ManiSkill's Panda TCP (base at x = -0.615 m)
    tcp_world = robot.get_observation()["state"][18:21]
    np.testing.assert_allclose(franka_tcp_position(hold) + [-0.615, 0, 0], tcp_world, atol=2e-3)
    tcp = franka_tcp_position(hold)
    cfg = SafetyConfig(workspace_low=tuple(tcp - 0.05), workspace_high=tuple(tcp + 0.05))
    safety = SafetyLayer(robot, cfg, dt=1 / 20, fk=franka_tcp_position)
    safety.reset()
    inside = hold.copy()
    inside[0] += 0.02
    assert safety.filter(inside)[1] == []
    outside = hold.copy()
    outside[1] += 0.5  # shoulder forward: the TCP leaves the 10 cm box
    cmd, events = safety.filter(outside)
    assert events == ["workspace:target outside the workspace box"]
    np.testing.assert_allclose(cmd, safety.last_command, atol=1e-6)  # held where the layer's reset put it
    with pytest.raises(InvalidOptionError, match="forward-kinematics"):
        SafetyLayer(robot, cfg)


def test_keep_out_sphere_rejects_targets_whose_tcp_lands_inside(robot):
    """The last line under a guided policy: a joint target that puts the TCP inside a keep-out sphere
    is rejected (the robot holds); one that stays outside passes; a bad sphere is refused."""
    robot.reset(0)
    hold = robot.hold_action()
    tcp = franka_tcp_position(hold)
    into = hold.copy()
    into[1] += 0.3  # shoulder forward: the TCP moves ~10 cm
    target_tcp = franka_tcp_position(into)
    assert np.linalg.norm(target_tcp - tcp) > 0.08
    cfg = SafetyConfig(keep_out=((*target_tcp, 0.04), (*(tcp + [0, 0, 1.0]), 0.1)))
    safety = SafetyLayer(robot, cfg, dt=1 / 20, fk=franka_tcp_position)
    safety.reset()
    cmd, events = safety.filter(into)
    assert events == ["keep_out:target inside keep-out sphere 0"]
    np.testing.assert_allclose(cmd, safety.last_command, atol=1e-6)
    away = hold.copy()
    away[0] += 0.02
    assert safety.filter(away)[1] == []
    with pytest.raises(InvalidOptionError, match="forward-kinematics"):
        SafetyLayer(robot, cfg)
    with pytest.raises(InvalidOptionError, match=r"keep_out\[0\] must be \(x, y, z, radius\)"):
        SafetyConfig(keep_out=((0.0, 0.0, 0.5, -0.1),))


def test_stop_signal_brakes_and_ends_the_episode(robot, monkeypatch):
    robot.reset(0)
    q0 = robot.hold_action()[:7]
    policy = JointTargetPolicy(35, 8, q0 + 0.5, step=0.05, gripper=1.0)
    safety = SafetyLayer(robot, SafetyConfig(), dt=1 / 20)
    loop = ControlLoop(robot, LocalPolicy(policy), LoopConfig(rate_hz=20, max_steps=200, stop_brake_s=0.3), safety)
    ticks = TickLog(monkeypatch, robot)
    held: list[float] = []
    hold = safety.hold
    monkeypatch.setattr(safety, "hold", lambda *a, **kw: held.append(time.perf_counter()) or hold(*a, **kw))
    previous = signal.getsignal(signal.SIGINT)
    import threading
    threading.Timer(0.4, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with safety.signal_stop():
        t0 = time.monotonic()
        res = loop.run_episode()
    assert signal.getsignal(signal.SIGINT) is previous
    assert res.reason == "stop_signal" and res.interventions["stop_signal"] == 1
    assert time.monotonic() - t0 < 20.0  # generous: 10x what it takes on an idle machine
    # measured in the loop's ticks: the tick running when the signal handler ran, or the next one,
    # holds; every later command is a hold (braking to rest) ...
    handled = next(e["t"] for e in res.events if e["type"] == "stop_signal") - time.time() + time.perf_counter()
    after = next(k for k in range(1, len(ticks.starts)) if ticks.starts[k] > handled)
    k0 = res.holds[0]
    assert k0 in (after - 1, after), (k0, after)
    assert res.holds == list(range(k0, res.steps))
    np.testing.assert_allclose(res.actions[-1], res.actions[-2], atol=1e-6)
    # ... for stop_brake_s of the loop's clock, then the episode ends at the first tick past it
    assert held[-1] - held[0] >= 0.3 - 1e-3, f"braked for {(held[-1] - held[0]) * 1e3:.0f} ms"
    assert res.steps - k0 <= math.ceil(0.3 * 20) + 2, f"{res.steps - k0} ticks of braking"


class ConstantPolicy:
    """Plans the same action for every step."""

    def __init__(self, state_dim: int, action):
        from deploy.scripted import ScriptedConfig
        self.action = np.asarray(action, np.float32)
        self.config = ScriptedConfig(state_dim, len(self.action), horizon=8, n_exec=4)

    def predict_action_chunk(self, obs, **_):
        return np.tile(self.action, (self.config.horizon, 1))

    def reset(self):
        pass


class FaultyRobot(RecordingSimRobot):
    """Its driver raises after ``fail_after`` commands, like a controller dropping out."""

    fail_after = 10**9

    def send_action(self, action):
        if len(self.received) >= self.fail_after:
            raise ConnectionResetError("controller went away")
        super().send_action(action)


def test_driver_that_raises_is_held_logged_and_recording_stays_readable(tmp_path):
    from deploy.recording import Recorder
    from dataset import Dataset
    robot = FaultyRobot("maniskill/PushCube-v1", env_options={"control_mode": "pd_ee_delta_pos"})
    robot.connect()
    try:
        policy = ConstantPolicy(35, [0.3, 0.0, 0.0, 1.0])  # end-effector deltas: move +x, gripper open
        rec = Recorder(tmp_path / "rec.h5", robot.spec, env_id="maniskill/PushCube-v1")
        loop = ControlLoop(robot, LocalPolicy(policy), LoopConfig(rate_hz=20, max_steps=15, realtime=False), recorder=rec)
        first = loop.run_episode(seed=0)
        assert first.reason == "max_steps" and first.steps == 15
        robot.reset(1)
        robot.fail_after = len(robot.received) + 6
        res = loop.run_episode(seed=1)
        assert res.reason == "driver_error" and res.interventions["driver_error"] == 1
        # the process "crashes" here: the recorder is never closed
        ds = Dataset(tmp_path / "rec.h5.partial", allow_incomplete=True)
        assert len(ds) == 2
        ep0 = ds.episode(0)
        assert len(ep0) == 15 and ep0.sim_state is not None
        np.testing.assert_allclose(ep0.action, first.actions)
        assert len(ds.episode(1)) == 6
        assert (tmp_path / "rec.h5.episodes.jsonl").read_text().count("driver_error") >= 1
    finally:
        robot.close()


def test_watchdog_thread_holds_a_stalled_loop(robot, monkeypatch):
    robot.reset(0)
    robot.received.clear()
    safety = SafetyLayer(robot, SafetyConfig(watchdog_s=0.1), dt=1 / 20)
    safety.reset()
    safety.command(robot.hold_action())
    quiet: list[float] = []  # at each watchdog hold: how long nothing had been sent
    hold = safety.hold
    monkeypatch.setattr(safety, "hold",
                        lambda *a, **kw: quiet.append(time.monotonic() - safety._last_sent) or hold(*a, **kw))
    safety.start_watchdog()
    try:  # the "loop" sends nothing: the watchdog holds one deadline after each command, again and again
        assert wait_for(lambda: safety.counts["watchdog"] >= 2, 10.0)  # ~0.2 s on an idle machine
    finally:
        safety.stop_watchdog()
    assert len(quiet) >= 2 and min(quiet) > 0.1, f"held after {min(quiet) * 1e3:.0f} ms of silence (deadline 100 ms)"
    assert len(robot.received) >= 3
