"""Control loop through the policy server: rate, refill, watchdog on a dead or silent server,
recording round trip, evaluation in simulation, chunk-boundary smoothing, the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from deploy.client import LocalPolicy, PolicyClient
from deploy.control import ControlLoop, LoopConfig
from deploy.errors import HandshakeError
from deploy.procs import popen_tied
from deploy.scripted import JointTargetPolicy
from deploy.server import PolicyServer
from deploy.sim_robot import SimRobot

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def robot():
    r = SimRobot("maniskill/PushCube-v1", realtime=True)
    r.connect()
    yield r
    r.close()


def start_server_process(*extra: str) -> tuple[subprocess.Popen, int]:
    """``groundflow serve --scripted joint_target`` in a subprocess; returns it and its port."""
    code = "import sys; from deploy.commands import serve; serve(sys.argv[1:])"
    args = ["--scripted", "joint_target", "--state-dim", "35", "--action-dim", "8", "--port", "0",
            "--target", "0.3", "0.6", "0.2", "-1.6", "0.2", "2.5", "1.0", *extra]
    proc = popen_tied([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("serving on ws://"):
            return proc, int(line.split(":")[2].split()[0])
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("policy server did not start")


def test_realtime_loop_keeps_rate_and_refills_chunks_before_they_run_out(robot):
    robot.reset(0)
    q0 = robot.hold_action()[:7]
    target = q0 + np.array([0.3, -0.2, 0.2, 0.2, 0.0, 0.2, 0.3])
    # inference takes 60 ms (> one 50 ms tick): the next chunk must be requested early
    policy = JointTargetPolicy(35, 8, target, step=0.04, gripper=1.0, delay_s=0.06)
    with PolicyServer(policy, port=0) as srv, PolicyClient(port=srv.port, expect={"action_dim": 8}) as client:
        loop = ControlLoop(robot, client, LoopConfig(rate_hz=20, max_steps=50))
        res = loop.run_episode()
    assert res.reason == "max_steps" and res.steps == 50
    assert res.holds == [], f"the plan ran out at steps {res.holds}"
    t = res.timing
    assert abs(t["period_p50_ms"] - 50.0) < 2.0 and t["n_requests"] >= 6
    assert t["rtt_p50_ms"] >= 60.0
    time.sleep(0.15)
    np.testing.assert_allclose(robot.get_observation()["state"][:7], target, atol=0.02)


def test_watchdog_holds_within_a_period_when_the_server_is_killed(robot):
    robot.reset(0)
    proc, port = start_server_process()
    try:
        client = PolicyClient(port=port, timeout=2.0, expect={"action_dim": 8, "state_dim": 35})
        loop = ControlLoop(robot, client, LoopConfig(rate_hz=20, max_steps=200, max_hold_s=0.5))
        killed: list[float] = []

        def kill() -> None:
            killed.append(time.perf_counter())
            os.kill(proc.pid, signal.SIGKILL)

        import threading
        threading.Timer(0.8, kill).start()
        ticks: list[float] = []
        original = loop.safety.hold

        def timed_hold(*a, **kw):
            ticks.append(time.perf_counter())
            return original(*a, **kw)

        loop.safety.hold = timed_hold
        res = loop.run_episode()
    finally:
        proc.kill()
        proc.wait()
    assert killed and ticks, "the server was not killed or no hold was sent"
    first_hold = ticks[0] - killed[0]
    assert 0 <= first_hold <= 0.05 + 0.03, f"first hold {first_hold * 1e3:.1f} ms after the kill"
    assert res.reason == "policy_lost" and res.interventions["watchdog"] >= 1
    # from the first hold on every command is a hold, and the arm comes to rest
    k = res.holds[0]
    assert res.holds == list(range(k, res.steps))
    np.testing.assert_allclose(res.actions[-1], res.actions[-3], atol=1e-6)


def test_a_server_that_stops_answering_is_held(robot):
    robot.reset(0)

    class Hangs(JointTargetPolicy):
        def predict_action_chunk(self, obs, **kw):
            if self.calls >= 2:
                time.sleep(3.0)  # stuck inference
            return super().predict_action_chunk(obs)

    q0 = robot.hold_action()[:7]
    with PolicyServer(Hangs(35, 8, q0 + 0.2, gripper=1.0), port=0) as srv, \
            PolicyClient(port=srv.port, timeout=0.3) as client:
        res = ControlLoop(robot, client, LoopConfig(rate_hz=20, max_steps=100, max_hold_s=0.3)).run_episode()
    assert res.reason == "policy_lost"
    assert res.holds and res.interventions["watchdog"] >= 1
    assert any("did not answer" in e["detail"] or "plan used up" in e["detail"] for e in res.events)


def test_recording_round_trip_and_evaluation_match_local_rollouts(tmp_path):
    pytest.importorskip("gymnasium_robotics")
    import envs
    from deploy.evaluate import evaluate_via_server
    from envs.adroit import DapgExpert
    from train.dataset import Dataset

    class ExpertPolicy:
        """The Adroit DAPG expert behind the policy interface (it acts from the state alone)."""

        def __init__(self):
            from deploy.scripted import ScriptedConfig
            self.expert = DapgExpert.load("door")
            self.config = ScriptedConfig(39, 28, horizon=1, n_exec=1)

        def predict_action_chunk(self, obs, **_):
            return np.asarray(self.expert.act(obs), np.float32)[None]

        def reset(self):
            pass

    # local rollouts of the same expert, same seeds
    env = envs.make("adroit/door")
    expert = DapgExpert.load("door")
    local_success, local_actions = [], []
    for seed in (0, 1):
        obs, _ = env.reset(seed=seed)
        expert.reset(env, obs)
        ok, acts = False, []
        for _ in range(env.max_episode_steps):
            a = expert.act(obs)
            acts.append(a)
            obs, _, term, trunc, info = env.step(a)
            ok |= info["success"]
            if term or trunc:
                break
        local_success.append(ok)
        local_actions.append(np.asarray(acts, np.float32))
    env.close()
    path = tmp_path / "door_eval.h5"
    with PolicyServer(ExpertPolicy(), port=0) as srv:
        report = evaluate_via_server("adroit/door", f"127.0.0.1:{srv.port}", n_episodes=2, seed=0, record=str(path))
        with pytest.raises(HandshakeError, match="action_dim"):
            evaluate_via_server("maniskill/PushCube-v1", f"127.0.0.1:{srv.port}", n_episodes=1)
    assert [e["success"] for e in report["episodes"]] == local_success
    assert report["success_rate"] == np.mean(local_success) and report["success_rate"] >= 0.5
    lo, hi = report["ci95"]
    assert 0 <= lo <= report["success_rate"] <= hi <= 1
    with Dataset(path) as ds:
        assert len(ds) == 2 and ds.env_id == "adroit/door" and ds.action_dim == 28
        for i in range(2):
            ep = ds.episode(i)
            # the recorded commands are the expert's actions (the safety layer let them through)
            np.testing.assert_allclose(ep.action, np.clip(local_actions[i][: len(ep)], -1, 1), atol=1e-5)
            assert ep.sim_state is not None and ep.seed == i and ep.succeeded == local_success[i]
        assert json.loads(ds.f.attrs["meta"])["source"] == "deploy"
    lines = (tmp_path / "door_eval.h5.episodes.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["reason"] in ("done", "max_steps")


@pytest.fixture()
def one_torch_thread():
    """A tiny model on 2 shared cores: one intra-op thread is much faster than two fighting."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(n)


def test_rtc_makes_new_chunks_continue_the_old_plan(one_torch_thread):
    torch = one_torch_thread
    import policies
    cfg = policies.PolicyConfig(kind="flow", state_dim=35, action_dim=4, horizon=8, n_exec=4, size="tiny",
                                flow_steps=5)
    torch.manual_seed(0)
    model = policies.FlowMatchingVLA(cfg)  # untrained: every chunk is fresh noise -> worst-case switches
    model.fit_normalizer(np.zeros((2, 35)), np.array([[-0.5] * 4, [0.5] * 4]))
    robot = SimRobot("maniskill/PushCube-v1", env_options={"control_mode": "pd_ee_delta_pos"})
    robot.connect()
    model.lang.cache[robot.get_observation()["instruction"]] = torch.zeros(1, cfg.lang_dim)
    dev = {}
    try:
        for name, rtc in (("plain", False), ("rtc", True)):
            robot.reset(0)
            loop = ControlLoop(robot, LocalPolicy(model), LoopConfig(rate_hz=20, max_steps=20, realtime=False,
                                                                    seed=0, rtc=rtc))
            res = loop.run_episode()
            assert len(res.switches) == 5 and len(res.deviations) == 4
            dev[name] = float(np.mean(res.deviations))
    finally:
        robot.close()
    assert dev["rtc"] < 0.2 * dev["plain"], dev


def test_temporal_ensembling_averages_overlapping_chunks():
    from deploy.chunking import TemporalEnsembler
    ens = TemporalEnsembler(m=0.0)
    ens.add(np.zeros((4, 2)), start=0)
    ens.add(np.ones((4, 2)), start=1)
    np.testing.assert_allclose(ens.action_at(0), [0, 0])
    np.testing.assert_allclose(ens.action_at(1), [0.5, 0.5])
    ens.add(np.full((4, 2), 4.0), start=2)
    np.testing.assert_allclose(ens.action_at(3), [5 / 3, 5 / 3])
    assert ens.action_at(7) is None
    weighted = TemporalEnsembler(m=np.log(2))  # weights 1, 1/2 (the older one counts more)
    weighted.add(np.zeros((2, 1)), 0)
    weighted.add(np.full((2, 1), 3.0), 0)
    np.testing.assert_allclose(weighted.action_at(0), [1.0])


def test_deploy_command_runs_episodes_against_a_served_policy(tmp_path, capsys):
    from deploy.commands import deploy
    proc, port = start_server_process()
    try:
        out = tmp_path / "cli.h5"
        deploy(["--robot", "sim", "--lockstep", "--server", f"127.0.0.1:{port}", "--episodes", "2",
                "--max-steps", "12", "--record", str(out), "--no-status"])
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["steps"] for x in lines[:2]] == [12, 12]
    assert lines[-1]["episodes"] == 2 and Path(lines[-1]["recorded"]).exists()
    with pytest.raises(HandshakeError):
        proc2, port2 = start_server_process()
        try:
            deploy(["--robot", "sim", "--lockstep", "--server", f"127.0.0.1:{port2}",
                    "--control-mode", "pd_ee_delta_pos", "--no-status"])
        finally:
            proc2.kill()
            proc2.wait()


def test_nan_and_far_out_chunks_from_the_server_are_held_not_executed(robot):
    class Broken(JointTargetPolicy):
        """Every other chunk is garbage: NaN, then 10 rad past the joint limits."""

        def predict_action_chunk(self, obs, **kw):
            chunk = super().predict_action_chunk(obs)
            if self.calls % 3 == 2:
                chunk[:, 2] = np.nan
            elif self.calls % 3 == 0:
                chunk[:, 0] = 10.0
            return chunk

    lockstep = SimRobot(robot.env)  # the module's env, stepped once per command
    lockstep.connect()
    q0 = lockstep.hold_action()[:7]
    with PolicyServer(Broken(35, 8, q0 + 0.2, gripper=1.0, horizon=4, n_exec=4), port=0) as srv, \
            PolicyClient(port=srv.port) as client:
        res = ControlLoop(lockstep, client, LoopConfig(rate_hz=20, max_steps=24, realtime=False)).run_episode()
    assert res.reason == "max_steps" and res.steps == 24
    assert res.interventions["nonfinite"] == 8 and res.interventions["far_out_of_limits"] == 8
    assert np.all(np.isfinite(res.actions)) and np.all(res.actions[:, 0] <= lockstep.spec.action_high[0])


def test_temporal_ensembling_through_the_loop_requests_every_tick(robot):
    lockstep = SimRobot(robot.env)
    lockstep.connect()
    q0 = lockstep.hold_action()[:7]
    policy = JointTargetPolicy(35, 8, q0 + 0.2, step=0.02, gripper=1.0, horizon=8, n_exec=4)
    res = ControlLoop(lockstep, LocalPolicy(policy),
                      LoopConfig(rate_hz=20, max_steps=20, realtime=False, ensemble=0.1)).run_episode()
    assert res.steps == 20 and res.holds == [] and res.timing["n_requests"] == 21  # first chunk + one per tick
    # overlapping plans averaged: still a monotone approach that ends on the target
    assert np.all(np.diff(res.actions[:, 0]) >= 0)
    assert res.actions[-1, 0] == pytest.approx(q0[0] + 0.2, abs=1e-4)
