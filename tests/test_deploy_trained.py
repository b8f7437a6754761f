"""A checkpoint trained here, served over websocket, driving a simulated robot."""

import numpy as np
import torch

import policies
from deploy.client import PolicyClient
from deploy.evaluate import evaluate_via_server
from deploy.server import PolicyServer
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
