"""Policies that estimate object positions from cameras: the real-arm contract, the head learns to
localize, the checkpoint states its inputs, and the tabletop scene's cameras."""

import json

import numpy as np
import pytest
import torch

import policies
from envs.base import state_indices
from policies import PolicyConfig
from train.bc import policy_inputs

LAYOUT = [("agent/qpos", 9), ("agent/qvel", 9), ("extra/tcp_pose", 7), ("extra/red_cube_pose", 7),
          ("extra/green_cube_pose", 7), ("extra/blue_cube_pose", 7), ("extra/left_goal_pos", 3),
          ("extra/right_goal_pos", 3)]
EST = state_indices(LAYOUT, ("*_cube_pose[0:3]", "*_goal_pos[0:2]"))
HIDE = state_indices(LAYOUT, ("*vel", "*_cube_pose", "*_goal_pos"))
OBJECT = state_indices(LAYOUT, ("*_cube_pose", "*_goal_pos"))


def _pixel_policy(size: int = 32) -> policies.VLAModel:
    cfg = PolicyConfig(kind="flow", state_dim=52, action_dim=4, horizon=1, n_exec=1, cameras=("cam", "wrist"),
                       image_size=size, state_ignore=tuple(HIDE), estimated_state=tuple(EST), estimate_noise=0.01,
                       fusion="early", lang_norm=True)
    p = policies.make_policy(cfg)
    rng = np.random.default_rng(0)
    p.fit_normalizer(rng.normal(size=(64, 52)), rng.uniform(-1, 1, size=(64, 4)), ["push the red cube", "lift it"])
    torch.manual_seed(0)
    with torch.no_grad():  # untrained, the head answers alike for every image and the output layer is zero
        for prm in p.parameters():
            prm.add_(torch.randn_like(prm) * 0.2)
    return p.eval()


def _obs(rng, size=32):
    return {"state": rng.normal(size=52).astype(np.float32), "instruction": "push the red cube",
            "images": {c: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for c in ("cam", "wrist")}}


def _chunk(policy, obs):
    torch.manual_seed(0)  # the same sampling noise for both calls
    return policy.predict_action_chunk(obs)


def test_object_state_never_reaches_the_action():
    """The real-arm contract: changing the simulator's object state while the images and the
    proprioception stay identical leaves the action unchanged; changing an image changes it."""
    policy, rng = _pixel_policy(), np.random.default_rng(1)
    obs = _obs(rng)
    base = _chunk(policy, obs)
    moved = dict(obs, state=obs["state"].copy())
    moved["state"][OBJECT] += rng.normal(size=len(OBJECT)).astype(np.float32) * 5
    np.testing.assert_array_equal(_chunk(policy, moved), base)
    seen = dict(obs, images=dict(obs["images"], cam=255 - obs["images"]["cam"]))
    assert np.abs(_chunk(policy, seen) - base).max() > 1e-4
    proprio = dict(obs, state=obs["state"].copy())
    proprio["state"][:9] += 1.0  # the joints are an input
    assert np.abs(_chunk(policy, proprio) - base).max() > 1e-4


def test_estimated_entries_must_be_hidden_and_need_cameras():
    with pytest.raises(ValueError, match="not in state_ignore"):
        PolicyConfig(state_dim=52, action_dim=4, cameras=("cam",), state_ignore=(9,), estimated_state=(25,))
    with pytest.raises(ValueError, match="needs cameras"):
        PolicyConfig(state_dim=52, action_dim=4, state_ignore=(25,), estimated_state=(25,))
    with pytest.raises(ValueError, match="estimate noise"):
        PolicyConfig(state_dim=52, action_dim=4, cameras=("cam",), state_ignore=(25,), estimated_state=(25,),
                     estimate_noise=-1)


def test_inputs_name_what_the_checkpoint_reads():
    pixel = _pixel_policy().config
    inputs = policy_inputs(pixel, LAYOUT)
    assert inputs["reads_object_state"] is False
    assert inputs["state"] == ["agent/qpos", "extra/tcp_pose"] and inputs["cameras"] == ["cam", "wrist"]
    assert "extra/red_cube_pose" in inputs["estimated"]
    state = PolicyConfig(state_dim=52, action_dim=4, state_ignore=tuple(state_indices(LAYOUT, ("*vel",))))
    assert policy_inputs(state, LAYOUT)["reads_object_state"] is True


def test_part_of_a_slice():
    assert state_indices(LAYOUT, ("extra/red_cube_pose[0:3]",)) == [25, 26, 27]
    assert state_indices(LAYOUT, ("*_goal_pos[0:2]",)) == [46, 47, 49, 50]
    assert state_indices(LAYOUT, ("extra/tcp_pose[3:]",)) == [21, 22, 23, 24]


def _squares(rng, n, size=32):
    """Images with a red and a blue 4 px square at random places; targets: their centres in [-1, 1]."""
    imgs = np.full((n, size, size, 3), 90, np.uint8)
    xy = rng.integers(2, size - 6, (n, 2, 2))
    for i in range(n):
        for k, colour in enumerate(([220, 30, 30], [30, 60, 220])):
            r, c = xy[i, k]
            imgs[i, r:r + 4, c:c + 4] = colour
    return imgs, (xy + 2) / size * 2 - 1


def test_head_learns_to_localize():
    """Behaviour: trained on 300 steps of supervision, the head places two coloured squares far
    better than the best constant guess (which errs by their spread, ~0.5 here)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    from policies.perception import StateEstimator
    head = StateEstimator(("cam",), proprio_dim=1, n_out=4, channels=8, keypoints=8, hidden=64, shift=0, jitter=0)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(300):
        imgs, target = _squares(rng, 32)
        pred = head({"cam": torch.as_tensor(imgs)}, torch.zeros(32, 1))
        loss = ((pred - torch.as_tensor(target.reshape(32, 4), dtype=torch.float32)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    imgs, target = _squares(np.random.default_rng(99), 200)
    with torch.no_grad():
        pred = head({"cam": torch.as_tensor(imgs)}, torch.zeros(200, 1)).numpy()
    rmse = float(np.sqrt(((pred - target.reshape(200, 4)) ** 2).mean()))
    spread = float(target.std())
    assert rmse < 0.3 * spread, (rmse, spread)


def test_save_load_keeps_the_head(tmp_path):
    policy, rng = _pixel_policy(), np.random.default_rng(2)
    obs = _obs(rng)
    policy.save(tmp_path / "ckpt")
    loaded = policies.load(tmp_path / "ckpt")
    np.testing.assert_allclose(_chunk(loaded, obs), _chunk(policy, obs), atol=1e-6)
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["config"]["estimated_state"] == EST


def test_a_head_copied_to_a_policy_trained_on_other_data_estimates_the_same(tmp_path):
    """`train estimator --estimator-from`: a policy retrained on other demos (other state statistics) gets
    the head with its units converted, so its estimate in state units is the one of the source."""
    from train.perception import _copy_head
    source, rng = _pixel_policy(), np.random.default_rng(3)
    target = _pixel_policy()
    target.fit_normalizer(rng.normal(0.5, 2.0, size=(64, 52)), rng.uniform(-1, 1, size=(64, 4)), ["push the red cube"])
    batch = {"state": torch.as_tensor(rng.normal(size=(5, 52)), dtype=torch.float32),
             "images": {c: rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8) for c in ("cam", "wrist")}}
    assert not np.allclose(target.estimate(batch), source.estimate(batch), atol=1e-2)
    _copy_head(target, source, tmp_path)
    np.testing.assert_allclose(target.estimate(batch), source.estimate(batch), rtol=1e-4, atol=1e-4)


def test_train_estimator_refuses_a_checkpoint_without_head(tmp_path):
    from envs.errors import InvalidOptionError
    from train.perception import EstimatorArgs, train_estimator
    cfg = PolicyConfig(kind="flow", state_dim=6, action_dim=2)
    p = policies.make_policy(cfg)
    p.fit_normalizer(np.zeros((4, 6)), np.zeros((4, 2)))
    p.save(tmp_path / "ckpt")
    with pytest.raises(InvalidOptionError, match="no perception head"):
        train_estimator(EstimatorArgs(init_from=tmp_path / "ckpt", out=tmp_path / "out", progress=False))


def test_noise_per_entry_must_match_the_estimated_entries():
    base = dict(state_dim=52, action_dim=4, cameras=("cam",), state_ignore=(25, 26), estimated_state=(25, 26))
    assert PolicyConfig(**base, estimate_noise_per_entry=(0.02, 0.01)).estimate_noise_per_entry == (0.02, 0.01)
    with pytest.raises(ValueError, match="2 estimated entries"):
        PolicyConfig(**base, estimate_noise_per_entry=(0.02,))


def test_a_checkpoint_with_an_untrained_head_does_not_act(tmp_path):
    from envs.errors import CheckpointError
    policy = _pixel_policy()
    policy.save(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="perception head is untrained.*train estimator"):
        policies.load(tmp_path / "ckpt", to_act=True)
    policies.load(tmp_path / "ckpt")  # what `train estimator` itself loads
    policy.save(tmp_path / "trained", extra={"estimator": {"heldout_rmse_mean": 0.01}})
    policies.load(tmp_path / "trained", to_act=True)


def test_simulated_robot_renders_the_cameras_a_pixel_policy_reads():
    """deploy --robot sim --sim-cameras: the tabletop's fixed workspace camera and wrist camera, only
    those built, at the asked size; the wrist camera moves with the hand."""
    from deploy.commands import DeployArgs, make_robot
    args = DeployArgs(robot="sim", env="maniskill/TabletopSuite-v1", sim_cameras=("workspace_camera", "hand_camera"),
                      sim_image_size=48, lockstep=True)
    robot = make_robot(args, [])
    robot.connect()
    try:
        assert robot.spec.cameras == ("workspace_camera", "hand_camera")
        assert set(robot.env.raw._sensors) == {"workspace_camera", "hand_camera"}
        first = robot.get_observation()["images"]
        assert {k: v.shape for k, v in first.items()} == {"workspace_camera": (48, 48, 3), "hand_camera": (48, 48, 3)}
        for _ in range(5):
            robot.send_action(np.array([0.0, 0.0, 1.0, 1.0], np.float32))  # the hand rises
        later = robot.get_observation()["images"]
        moved = np.abs(later["hand_camera"].astype(int) - first["hand_camera"]).mean()
        still = np.abs(later["workspace_camera"].astype(int) - first["workspace_camera"]).mean()
        assert moved > 3 * still and moved > 2, (moved, still)
    finally:
        robot.close()


@pytest.mark.parametrize("env", ["maniskill/TabletopSuite-v1",
                                 pytest.param("maniskill/PushCube-v1", marks=pytest.mark.slow)])
def test_randomized_collection_changes_the_images_not_the_demos(tmp_path, env):
    """collect --randomize: the fixed camera moves and the light changes per episode, while the expert
    (scripted, or ManiSkill's motion planner through the wrapper) does and records the same thing."""
    from dataset import Dataset
    from train.collect import CollectArgs, collect
    cam = "workspace_camera" if "Tabletop" in env else "base_camera"
    kw = dict(env=env, episodes=1, cameras=(cam,), image_size=32, seed=3, progress=False)
    collect(CollectArgs(**kw, out=tmp_path / "plain.h5"))
    collect(CollectArgs(**kw, out=tmp_path / "dr.h5", randomize=(f"camera=0.08:{cam}", "lighting=0.6")))
    with Dataset(tmp_path / "plain.h5") as a, Dataset(tmp_path / "dr.h5") as b:
        ea, eb = a.episode(0, images=True), b.episode(0, images=True)
        assert b.meta["randomize"] == [f"camera=0.08:{cam}", "lighting=0.6"]
        np.testing.assert_allclose(eb.state, ea.state, atol=1e-5)
        np.testing.assert_allclose(eb.action, ea.action, atol=1e-5)
        assert np.abs(eb.images[cam].astype(int) - ea.images[cam]).mean() > 5
    with pytest.raises(Exception, match="FAMILY=MAGNITUDE"):
        collect(CollectArgs(**kw, out=tmp_path / "bad.h5", randomize=("sensor_noise=0.1",)))


@pytest.mark.parametrize("recipe, env_id", [("pixels", "maniskill/TabletopSuite-v1"),
                                            ("pixels_large", "maniskill/TabletopSuite-v1"),
                                            ("pixels_kitchen", "robosuite/KitchenSuite"),
                                            ("pixels_libero", "libero/GoalSuite")])
def test_pixel_recipes_leave_only_proprioception_as_state_input(recipe, env_id):
    """The real-arm contract at the recipe level: on its suite, every state slice a pixel recipe does not
    hide is one a physical arm measures itself, and each estimated entry is hidden from the input."""
    import envs
    from envs import is_proprio, state_indices
    from train.recipes import recipe_args
    a = recipe_args(recipe)
    env = envs.make(env_id)
    try:
        layout = env.state_layout
    finally:
        env.close()
    hidden = set(state_indices(layout, a.ignore_state, env_id))
    start = 0
    for name, size in layout:
        read = [i for i in range(start, start + size) if i not in hidden]
        assert not read or is_proprio(name), f"{recipe} reads {name} ({len(read)} entries) on {env_id}"
        start += size
    estimated = set(state_indices(layout, a.estimate_state, env_id))
    assert estimated and estimated <= hidden
