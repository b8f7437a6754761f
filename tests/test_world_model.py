"""Learned world model (training, checkpoint, env) and shifted-physics twins."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import envs
from envs.errors import InvalidOptionError
from envs.shifted import PhysicsShift, ShiftedEnv, make_shifted, shift_env
from envs.world_model import WorldModel, WorldModelError, load_world_model_env, make_world_model_env
from dataset import DatasetError, DatasetWriter
from train.world_model import train_world_model, world_model_command

torch.set_num_threads(1)


class NoisyDapg:
    """DAPG mean action + Gaussian noise: diverse door transitions for training."""

    def __init__(self, std: float, seed: int):
        from deploy.debugging.faults import DapgMeanPolicy
        self.pi, self.std, self.rng = DapgMeanPolicy("door"), std, np.random.default_rng(seed)

    def select_action(self, obs):
        a = self.pi.select_action(obs) + self.rng.normal(0, self.std, 28)
        return np.clip(a, -1, 1).astype(np.float32)


@pytest.fixture(scope="module")
def door_data(tmp_path_factory):
    from deploy.debugging.faults import record_episode
    path = tmp_path_factory.mktemp("wm") / "door.h5"
    env = envs.make("adroit/door", max_episode_steps=60)
    with DatasetWriter(path, "adroit/door", env.state_dim, 28, meta={"source": "test"}) as w:
        for i in range(8):
            w.add(record_episode(env, NoisyDapg([0.0, 0.2][i % 2], i), seed=i, steps=60))
    env.close()
    return path


@pytest.fixture(scope="module")
def door_wm(door_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("wm") / "ckpt"
    metrics = train_world_model([door_data], out, steps=400, hidden=64, ensemble=3, batch_size=128, progress=False)
    return out, metrics


def test_training_writes_a_checkpoint_that_beats_no_change(door_wm):
    out, m = door_wm
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "metrics.json").read_text())["transitions"] == m["transitions"] > 300
    # predicting "no change" has relative error 1 by definition; the model must do better
    assert m["train"]["val_relative_error"] < 0.8
    assert m["val_success_accuracy"] > 0.8
    assert not (out.parent / "ckpt.partial").exists()


def test_world_model_env_state_is_settable_and_deterministic(door_wm):
    out, _ = door_wm
    env = load_world_model_env(out)
    obs, info = env.reset(seed=3)
    assert obs["state"].dtype == np.float32 and obs["state"].shape == (39,) and isinstance(obs["instruction"], str)
    assert isinstance(info["success"], bool)
    x = env.get_sim_state()
    np.testing.assert_array_equal(x, obs["state"].astype(np.float64))
    a = np.zeros(28, np.float32)
    s1 = env.step(a)[0]["state"]
    env.set_sim_state(x)
    s2 = env.step(a)[0]["state"]
    np.testing.assert_array_equal(s1, s2)
    again, _ = load_world_model_env(out).reset(seed=3)
    np.testing.assert_array_equal(again["state"], obs["state"])
    batch = env.predict_batch(np.stack([x, x]), np.stack([a, a]))
    np.testing.assert_allclose(batch["next_state"][1], s1, rtol=1e-6, atol=1e-6)
    env.set_sim_state(x)
    assert env.observe()["state"].shape == (39,) and env.evaluate_success() in (True, False)
    member = load_world_model_env(out, member=1)
    member.reset(seed=3)
    assert not np.allclose(member.step(a)[0]["state"], s1)  # ensemble members disagree


def test_world_model_bad_inputs(door_wm, tmp_path):
    out, _ = door_wm
    env = load_world_model_env(out)
    with pytest.raises(WorldModelError, match="39"):
        env.set_sim_state(np.zeros(5))
    with pytest.raises(WorldModelError, match="NaN"):
        env.set_sim_state(np.full(39, np.nan))
    with pytest.raises(InvalidOptionError, match="member"):
        load_world_model_env(out, member=7)
    with pytest.raises(WorldModelError, match="config.json"):
        WorldModel.load(tmp_path)
    with pytest.raises(InvalidOptionError, match="path="):
        make_world_model_env("worldmodel")
    with pytest.raises(NotImplementedError, match="expert"):
        env.make_expert()


def test_world_model_command_and_dataset_checks(door_data, tmp_path):
    out = tmp_path / "cli_wm"
    world_model_command(["--data", str(door_data), "--out", str(out), "--steps", "20", "--hidden", "16",
                         "--ensemble", "2", "--no-progress"])
    assert WorldModel.load(out).config.ensemble == 2
    with pytest.raises(FileExistsError):
        train_world_model([door_data], out, steps=5)
    other = tmp_path / "other.h5"
    with DatasetWriter(other, "x", 3, 2) as w:
        from dataset import Episode
        w.add(Episode(state=np.zeros((4, 3), np.float32), action=np.zeros((4, 2), np.float32),
                      reward=np.zeros(4, np.float32), success=np.zeros(4, bool), instruction="x",
                      final_state=np.zeros(3, np.float32)))
    with pytest.raises(DatasetError, match="dims"):
        train_world_model([door_data, other], tmp_path / "mixed", steps=5)


# ----- shifted twins ----------------------------------------------------------------------------

def test_shifted_mujoco_twin_changes_physics_not_layout():
    nominal = envs.make("adroit/door", max_episode_steps=30)
    twin = make_shifted("adroit/door", mass_scale=2.0, friction_scale=0.5, damping_scale=3.0, gain_scale=0.5,
                        seed=1, max_episode_steps=30)
    m0, m1 = nominal.unwrapped_mujoco.model, twin.unwrapped_mujoco.model
    np.testing.assert_allclose(m1.body_mass[1:], 2.0 * m0.body_mass[1:])
    np.testing.assert_allclose(m1.geom_friction[:, 0], 0.5 * m0.geom_friction[:, 0])
    np.testing.assert_allclose(m1.dof_damping, 3.0 * m0.dof_damping)
    np.testing.assert_allclose(m1.actuator_gainprm[:, 0], 0.5 * m0.actuator_gainprm[:, 0])
    o0, _ = nominal.reset(seed=0)
    o1, _ = twin.reset(seed=0)
    np.testing.assert_array_equal(o0["state"], o1["state"])
    assert twin.get_sim_state().shape == nominal.get_sim_state().shape
    a = np.full(28, 0.3, np.float32)
    for _ in range(10):
        s0, s1 = nominal.step(a)[0]["state"], twin.step(a)[0]["state"]
    assert np.abs(s0 - s1).max() > 1e-3


def test_shifted_noise_and_delay_are_seeded():
    def run(seed):
        env = make_shifted("adroit/door", obs_noise=0.01, action_delay=2, seed=seed, max_episode_steps=10)
        obs, _ = env.reset(seed=0)
        states, applied = [obs["state"]], []
        for i in range(4):
            obs, _, _, _, info = env.step(np.full(28, 0.1 * (i + 1), np.float32))
            states.append(obs["state"])
            applied.append(info["applied_action"][0])
        return np.stack(states), applied

    s1, a1 = run(5)
    s2, _ = run(5)
    s3, _ = run(6)
    np.testing.assert_array_equal(s1, s2)
    assert not np.array_equal(s1, s3)
    assert np.allclose(a1, [0.1, 0.1, 0.1, 0.2])  # first command held for the 2-step latency


def test_shifted_bad_inputs():
    with pytest.raises(InvalidOptionError, match="mass_scale"):
        make_shifted("adroit/door", mass_scale=0.0)
    with pytest.raises(InvalidOptionError, match="action_delay"):
        PhysicsShift(action_delay=-1).validate()
    with pytest.raises(InvalidOptionError, match="valid bodies"):
        make_shifted("adroit/door", mass_scale=1.5, bodies=("no_such_body",))
    env = envs.make("adroit/door")
    with pytest.raises(InvalidOptionError, match="unknown shift option"):
        shift_env(env, inertia_scale=2.0)
    twin = shift_env(env, friction_scale=0.5)
    with pytest.raises(InvalidOptionError, match="unknown field"):
        twin.set_shift(gravity=2.0)


def test_shifted_world_model_allows_only_noise_and_delay(door_wm):
    out, _ = door_wm
    with pytest.raises(InvalidOptionError, match="no physics parameters"):
        ShiftedEnv(load_world_model_env(out), PhysicsShift(mass_scale=2.0))
    twin = ShiftedEnv(load_world_model_env(out), PhysicsShift(obs_noise=0.01), seed=0)
    obs, _ = twin.reset(seed=0)
    assert not np.array_equal(obs["state"], twin.get_sim_state().astype(np.float32))


def test_shifted_maniskill_cube_mass_and_friction():
    twin = make_shifted("maniskill/PushCube-v1", mass_scale=3.0, friction_scale=0.25, gain_scale=0.5, seed=0,
                        control_mode="pd_ee_delta_pos")
    twin.reset(seed=0)
    import sapien
    body = twin.raw.obj._objs[0].find_component_by_type(sapien.physx.PhysxRigidDynamicComponent)
    assert body.mass == pytest.approx(3.0 * 0.064, rel=1e-4)
    assert body.collision_shapes[0].physical_material.static_friction == pytest.approx(0.075, rel=1e-4)
    joint = twin.raw.agent.controller.controllers["arm"].joints[0]._objs[0]
    assert joint.stiffness == pytest.approx(500.0)
    twin.set_shift(friction_scale=1.0)
    assert body.collision_shapes[0].physical_material.static_friction == pytest.approx(0.3, rel=1e-4)
    twin.restore_shift()
    twin.reset(seed=1)  # a reset keeps the shift
    assert body.mass == pytest.approx(3.0 * 0.064, rel=1e-4)
    twin.close()
