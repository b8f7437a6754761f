"""A checkpoint trained here, served over websocket, driving a simulated robot."""

import numpy as np
import pytest
import torch

import policies
from deploy.serving.client import PolicyClient
from deploy.evaluate import evaluate_via_server
from deploy.serving.server import PolicyServer
from train.bc import TrainArgs, train
from train.collect import CollectArgs, collect
from dataset import Dataset


def test_trained_checkpoint_served_to_a_sim_robot(tmp_path):
    data = tmp_path / "push.h5"
    collect(CollectArgs(env="maniskill/PushCube-v1", episodes=3, out=data, seed=0, progress=False))
    train(TrainArgs(data=(data,), steps=60, batch_size=16, out=tmp_path / "run", wandb="disabled", progress=False,
                    warmup_steps=5))
    served, local = policies.load(tmp_path / "run" / "ckpt"), policies.load(tmp_path / "run" / "ckpt")
    obs = {"state": Dataset(data).episode(0).state[5], "instruction": "push the cube to the goal region"}
    with PolicyServer(served, port=0) as srv:
        with PolicyClient(port=srv.port, expect={"action_dim": 8, "state_dim": 35, "cameras": []}) as client:
            remote = client.infer(obs, seed=7).actions
        torch.manual_seed(7)
        np.testing.assert_allclose(remote, local.predict_action_chunk(obs), atol=1e-5)
        res = evaluate_via_server("maniskill/PushCube-v1", srv.address, n_episodes=1, seed=3, max_steps=20,
                                  record=str(tmp_path / "deployed.h5"))
    assert res["n_episodes"] == 1 and res["rtt_p50_ms"] is not None
    ep = Dataset(tmp_path / "deployed.h5").episode(0)
    assert len(ep) == 20 and ep.action.shape == (20, 8)
    # the robot moved: joint positions changed over the episode
    assert np.abs(ep.state[-1, :7] - ep.state[0, :7]).max() > 1e-3


INSTRS = ["push the red cube to the left goal", "push the blue cube to the right goal"]


@pytest.fixture(scope="module")
def tabletop_policy(tmp_path_factory):
    """An AR policy (its action bins span the demos, so chunks stay inside the bounds the deploy client
    enforces) briefly trained on two tabletop instructions; what it does is not tested."""
    tmp = tmp_path_factory.mktemp("tabletop")
    collect(CollectArgs(suite="tabletop", episodes=2, out=tmp / "tt.h5", seed=0, layout="random",
                        instructions=tuple(INSTRS), progress=False))
    train(TrainArgs(data=(tmp / "tt.h5",), policy="ar", steps=20, batch_size=16, out=tmp / "run", wandb="disabled",
                    progress=False, warmup_steps=1))
    return tmp / "run" / "ckpt"


def test_server_evaluation_commands_each_instruction_in_turn(tabletop_policy, tmp_path):
    """Without ``instructions`` every suite episode got the default task: 3 of 3 'red cube left' in the
    demo, a test of one instruction. The robot must now be told the commanded one, and a typo named."""
    with PolicyServer(policies.load(tabletop_policy), port=0) as srv:
        res = evaluate_via_server("maniskill/TabletopSuite-v1", srv.address, n_episodes=3, seed=5, max_steps=3,
                                  env_options={"layout": "random"}, instructions=INSTRS,
                                  record=str(tmp_path / "deployed.h5"))
        assert [e["instruction"] for e in res["episodes"]] == [INSTRS[0], INSTRS[1], INSTRS[0]]
        rec = Dataset(tmp_path / "deployed.h5")
        assert [rec.episode(i).instruction for i in range(3)] == [INSTRS[0], INSTRS[1], INSTRS[0]]
        with pytest.raises(Exception, match="push the red cube to the moon"):
            evaluate_via_server("maniskill/TabletopSuite-v1", srv.address, n_episodes=1, max_steps=3,
                                instructions=["push the red cube to the moon"])
        with pytest.raises(ValueError, match="non-empty list"):
            evaluate_via_server("maniskill/TabletopSuite-v1", srv.address, n_episodes=1, instructions=INSTRS[0])


def test_deploy_to_a_simulated_suite_gives_the_env_the_instruction(tabletop_policy, tmp_path, capsys):
    """``groundflow deploy --instruction`` used to send the words to the server while the simulated suite
    kept its default task (red cube, left goal), so success was judged on a task nobody commanded."""
    from deploy.commands import deploy
    with PolicyServer(policies.load(tabletop_policy), port=0) as srv:
        deploy(["--robot", "sim", "--env", "maniskill/TabletopSuite-v1", "--lockstep", "--server", srv.address,
                "--episodes", "2", "--max-steps", "3", "--instruction", INSTRS[1], "--record",
                str(tmp_path / "cli.h5"), "--no-status"])
    rec = Dataset(tmp_path / "cli.h5")
    blue_right = 5  # the suite's task id of INSTRS[1]
    assert [rec.episode(i).task_id for i in range(2)] == [blue_right, blue_right]
    assert [rec.episode(i).instruction for i in range(2)] == [INSTRS[1], INSTRS[1]]
