"""``groundflow deploy`` refuses a policy trained on another env (same dims, other task) unless
--force, and says where the recording is when the policy server is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_flow_policy
from deploy.scripted import JointTargetPolicy
from deploy.serving.server import PolicyServer
from groundflow.cli import main

INSTRUCTION = "move the cube"


@pytest.fixture(scope="module")
def pushcube_ckpt(tmp_path_factory):
    """A tiny untrained flow checkpoint that says it was trained on PushCube, as train/bc.py records it."""
    torch = pytest.importorskip("torch")
    model, layout = tiny_flow_policy("maniskill/PushCube-v1")
    cfg = model.config
    # a fixed instruction feature instead of loading the language model: the checkpoint carries it
    model.lang.cache[INSTRUCTION] = torch.zeros(1, cfg.lang_dim)
    inputs = {"cameras": [], "state": [name for name, _ in layout], "estimated": [], "reads_object_state": True}
    path = tmp_path_factory.mktemp("ckpt") / "pushcube"
    model.save(path, extra={"env_id": "maniskill/PushCube-v1", "inputs": inputs})
    return path


def _deploy(address: str, env: str, *extra: str) -> int:
    return main(["deploy", "--robot", "sim", "--env", env, "--server", address, "--lockstep", "--episodes", "1",
                 "--max-steps", "3", "--instruction", INSTRUCTION, "--no-status", *extra])


def test_deploy_refuses_a_policy_trained_on_another_env_unless_forced(pushcube_ckpt, capsys):
    import policies
    policy = policies.load(pushcube_ckpt)
    assert policy.env_id == "maniskill/PushCube-v1"
    with PolicyServer(policy, port=0) as srv:
        assert srv.metadata["env_id"] == "maniskill/PushCube-v1"
        code = _deploy(srv.address, "maniskill/PullCube-v1")
        err = capsys.readouterr().err.strip().splitlines()
        assert code != 0
        assert "maniskill/PushCube-v1" in err[-1] and "maniskill/PullCube-v1" in err[-1] and "--force" in err[-1]
        code = _deploy(srv.address, "maniskill/PullCube-v1", "--force")
        out = capsys.readouterr().out
        assert code == 0 and json.loads([x for x in out.splitlines() if x.startswith('{"steps"')][0])["steps"] == 3
        assert _deploy(srv.address, "maniskill/PushCube-v1") == 0


def test_deploy_refuses_a_policy_reading_state_slices_the_env_lacks(pushcube_ckpt, capsys):
    import policies
    policy = policies.load(pushcube_ckpt)
    policy.inputs = dict(policy.inputs, state=[*policy.inputs["state"], "extra/drawer_pos"])
    with PolicyServer(policy, port=0) as srv:
        code = _deploy(srv.address, "maniskill/PushCube-v1")
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and "extra/drawer_pos" in err[-1]


def test_a_policy_announcing_nothing_runs_with_a_warning(caplog):
    policy = JointTargetPolicy(35, 8, [0.3, 0.6, 0.2, -1.6, 0.2, 2.5, 1.0], gripper=1.0)  # no env_id, no inputs
    with PolicyServer(policy, port=0) as srv:
        assert _deploy(srv.address, "maniskill/PullCube-v1", "--log-level", "WARNING") == 0
    assert "does not announce the env" in caplog.text


def test_a_lost_server_ends_with_a_line_naming_the_recording(tmp_path, capsys, monkeypatch):
    from deploy.robots.sim import SimRobot
    rec = tmp_path / "lost.h5"
    policy = JointTargetPolicy(35, 8, [0.3, 0.6, 0.2, -1.6, 0.2, 2.5, 1.0], gripper=1.0)
    srv = PolicyServer(policy, port=0).start()
    reset = SimRobot.reset

    def reset_and_lose_the_server(self, seed=None, *a, **kw):  # before episode 1 (seed 1): the server goes away
        if seed == 1:
            srv.stop()
        return reset(self, seed, *a, **kw)

    monkeypatch.setattr(SimRobot, "reset", reset_and_lose_the_server)
    try:
        code = main(["deploy", "--robot", "sim", "--server", srv.address, "--lockstep", "--episodes", "3",
                     "--max-steps", "3", "--record", str(rec), "--no-status", "--timeout", "0.5"])
    finally:
        srv.stop()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1
    assert "policy server" in last and "lost" in last and str(rec) in last, last
    assert rec.exists() or Path(str(rec) + ".partial").exists()
