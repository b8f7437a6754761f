"""Evaluation protocols (instruction swap, correlated split) and robustness perturbations.

Real simulators: the ManiSkill tabletop suite and the robosuite kitchen suite, with their
scripted experts as reference policies. The default part runs in about a minute on 2 cores;
the kitchen swap and the wider sweeps are marked slow.
"""

from __future__ import annotations

import numpy as np
import pytest

import envs
from envs.errors import InvalidOptionError
from envs.perturbations import (FAMILIES, LAYOUT_SPECS, PERTURBATIONS, NotApplicableError, not_applicable,
                                perturb)
from train.evaluate import rollout
from train.protocols import (ExpertPolicy, _Tracked, correlated_split_eval, layout_conflict_eval, perturbation_eval,
                             swap_eval)

TABLETOP = "maniskill/TabletopSuite-v1"
KITCHEN = "robosuite/KitchenSuite"


@pytest.fixture(scope="module")
def tabletop():
    env = envs.make(TABLETOP, max_episode_steps=80)  # expert episodes: 11-68 steps
    yield env
    env.close()


@pytest.fixture(scope="module")
def kitchen():
    env = envs.make(KITCHEN, max_episode_steps=150)  # expert episodes: ~85-100 steps
    yield env
    env.close()


@pytest.fixture(scope="module")
def kitchen_cams():
    env = envs.make(KITCHEN, cameras=("agentview",), image_size=64)
    yield env
    env.close()


@pytest.fixture(scope="module")
def tabletop_cams():
    env = envs.make(TABLETOP, cameras=("base_camera",), image_size=64)
    yield env
    env.close()


def expert_succeeds(env, seed: int, instruction: str) -> bool:
    policy = ExpertPolicy(env)
    return rollout(policy, env, seed, options={"instruction": instruction})["success"]


def zero_action(env) -> np.ndarray:
    a = np.zeros(env.action_space.shape, np.float32)
    a[-1] = -1.0 if env.backend == "maniskill" else 0.0
    return a


# ----- registry and applicability ----------------------------------------------------------------
def test_registry_and_bad_input(tabletop):
    assert set(PERTURBATIONS) == set(FAMILIES) == {"paraphrase", "camera", "lighting", "sensor_noise", "layout",
                                                   "robot_init"}
    with pytest.raises(InvalidOptionError) as e:
        perturb(tabletop, "fog")
    assert all(f in str(e.value) for f in FAMILIES)
    with pytest.raises(InvalidOptionError, match="valid options.*magnitude"):
        perturb(tabletop, "layout", strength=2)
    with pytest.raises(InvalidOptionError, match="magnitude"):
        perturb(tabletop, "sensor_noise", magnitude=-0.1)
    with pytest.raises(InvalidOptionError, match="valid families"):
        perturbation_eval(ExpertPolicy(), TABLETOP, families=["fog"], episodes=1, env=tabletop)


def test_image_families_skip_without_cameras(tabletop):
    for fam in ("camera", "lighting"):
        reason = not_applicable(tabletop, fam)
        assert reason and "no cameras" in reason
        with pytest.raises(NotApplicableError, match="no cameras"):
            perturb(tabletop, fam)
    res = perturbation_eval(ExpertPolicy(), TABLETOP, families=["camera", "lighting"], episodes=1, env=tabletop,
                            clean=False)
    for fam in ("camera", "lighting"):
        assert res["families"][fam]["skipped"] is True and "no cameras" in res["families"][fam]["reason"]


# ----- tabletop (ManiSkill): perturbations ---------------------------------------------------------
def test_sensor_noise_has_the_stated_std_and_is_seeded(tabletop):
    noisy = perturb(tabletop, "sensor_noise", magnitude=0.01, seed=3)
    opts = {"task_id": 2}
    clean = [tabletop.reset(seed=5, options=opts)[0]["state"]]
    clean += [tabletop.step(zero_action(tabletop))[0]["state"] for _ in range(8)]
    seen = [noisy.reset(seed=5, options=opts)[0]["state"]]
    seen += [noisy.step(zero_action(tabletop))[0]["state"] for _ in range(8)]
    diff = np.stack(seen) - np.stack(clean)
    assert diff.dtype == np.float32
    assert 0.009 < diff.std() < 0.011 and abs(diff.mean()) < 0.002
    again = noisy.reset(seed=5, options=opts)[0]["state"]
    np.testing.assert_array_equal(again, seen[0])  # same episode seed -> same noise
    other = noisy.reset(seed=6, options=opts)[0]["state"] - tabletop.reset(seed=6, options=opts)[0]["state"]
    assert not np.allclose(other, diff[0])  # another episode seed, other noise


def test_paraphrase_names_the_same_task(tabletop):
    para = perturb(tabletop, "paraphrase", seed=1)
    suite = tabletop.suite
    for t in suite.tasks[::3]:
        obs, info = para.reset(seed=2, options={"instruction": t.instruction})
        assert obs["instruction"] in t.paraphrases and obs["instruction"] != t.instruction
        assert tabletop.task_id == t.task_id == info["task_id"]
        assert info["perturbation"]["paraphrase"]["canonical"] == t.instruction
        obs = para.step(zero_action(tabletop))[0]
        assert obs["instruction"] in t.paraphrases  # the whole episode is commanded with it
    obs, _ = para.reset(seed=2, options={"task_id": 4})
    assert obs["instruction"] in suite.tasks[4].paraphrases and tabletop.task_id == 4
    never = perturb(tabletop, "paraphrase", magnitude=0.0)
    assert never.reset(seed=2, options={"task_id": 4})[0]["instruction"] == suite.tasks[4].instruction


def test_layout_moves_cubes_and_tasks_stay_solvable(tabletop):
    spec = LAYOUT_SPECS["GroundflowTabletopEnv"]
    layout = perturb(tabletop, "layout", magnitude=0.04, seed=0)
    raw = tabletop.raw
    for seed in (0, 1):
        tabletop.reset(seed=seed, options={"task_id": 0})
        before = raw.cube_positions()
        obs, info = layout.reset(seed=seed, options={"task_id": 0})
        after = raw.cube_positions()
        moved = after[:, :2] - before[:, :2]
        assert np.all(np.abs(moved) <= 0.04 + 1e-6) and np.linalg.norm(moved, axis=1).max() > 0.005
        np.testing.assert_allclose(after[:, 2], before[:, 2], atol=1e-5)
        assert np.all(after[:, :2] >= spec["lo"]) and np.all(after[:, :2] <= spec["hi"])
        assert info["success"] is False
        # the observation shows the moved cubes
        assert not np.allclose(obs["state"], tabletop.reset(seed=seed, options={"task_id": 0})[0]["state"])
    suite = tabletop.suite
    for seed in (0, 1):
        for task in (suite.tasks[1], suite.tasks[9]):  # a push and a stack
            assert expert_succeeds(layout, seed, task.instruction), (seed, task.instruction)


def test_robot_init_changes_arm_joints_only(tabletop):
    robot = perturb(tabletop, "robot_init", magnitude=0.1, seed=0)
    raw = tabletop.raw
    tabletop.reset(seed=4, options={"task_id": 6})
    q0, cubes0 = raw.agent.robot.get_qpos()[0].numpy().copy(), raw.cube_positions()
    obs, info = robot.reset(seed=4, options={"task_id": 6})
    q1 = raw.agent.robot.get_qpos()[0].numpy()
    d = q1[:7] - q0[:7]
    assert np.abs(d).max() > 0.02 and np.abs(d).max() <= 0.25 + 1e-5
    np.testing.assert_allclose(q1[7:], q0[7:], atol=1e-6)  # fingers untouched
    np.testing.assert_allclose(raw.cube_positions(), cubes0, atol=1e-6)
    np.testing.assert_allclose(info["perturbation"]["robot_init"]["joint_offsets_rad"], d, atol=1e-5)
    assert expert_succeeds(robot, 4, tabletop.suite.tasks[6].instruction)


# ----- tabletop: protocols -------------------------------------------------------------------------
def test_swap_expert_listens_and_instruction_ignoring_policy_does_not(tabletop):
    k = len(tabletop.suite.tasks)
    res = swap_eval(ExpertPolicy(), TABLETOP, seeds=[0, 1], env=tabletop)
    assert res["same_initial_state"] is True and res["n_instructions"] == k and res["episodes"] == 2 * k
    assert res["swap_success_rate"] >= 0.95 and res["did_other_task_rate"] <= 0.05
    assert set(res["per_instruction"]) == set(tabletop.suite.instructions)
    lo, hi = res["ci95"]
    assert lo <= res["swap_success_rate"] <= hi

    ignoring = swap_eval(ExpertPolicy(task=0), TABLETOP, seeds=[0], env=tabletop)
    assert abs(ignoring["swap_success_rate"] - 1 / k) <= 0.1
    assert ignoring["did_other_task_rate"] >= 0.8
    assert ignoring["all_instructions_success_rate"] == 0.0
    assert ignoring["per_instruction"][tabletop.suite.tasks[0].instruction]["success_rate"] == 1.0


class SceneReader(ExpertPolicy):
    """Cheats like a policy trained on the correlated layout can: reads the task off the scene
    (which cube sits in which slot, and the column shift) and ignores the instruction."""

    def task_for(self, obs):
        from envs.maniskill.tasks import correlated_layout
        pos = self.env.raw.cube_positions()
        perm = tuple(int(i) for i in np.argsort(pos[:, 0]))
        shift = int(pos[:, 0].mean() > 0)
        return next(t.task_id for t in self.env.suite.tasks if correlated_layout(t) == (perm, shift))


def test_correlated_split_exposes_a_scene_reading_policy(tabletop):
    res = correlated_split_eval(SceneReader(), TABLETOP, episodes=12, seed=50, env=tabletop)
    assert res["in_distribution"]["layout"] == "correlated" and res["split"]["layout"] == "random"
    assert res["in_distribution"]["success_rate"] >= 0.9
    assert res["split"]["success_rate"] <= 0.35 and res["split"]["did_other_task_rate"] >= 0.5
    assert res["gap"] >= 0.5


def test_layout_conflict_separates_following_the_scene_from_following_the_instruction(tabletop):
    reader = layout_conflict_eval(SceneReader(), TABLETOP, episodes=12, seed=50, env=tabletop)
    assert reader["in_distribution"]["success_rate"] >= 0.9
    assert reader["conflict"]["success_rate"] <= 0.1 and reader["conflict"]["did_layout_task_rate"] >= 0.8
    expert = layout_conflict_eval(ExpertPolicy(), TABLETOP, episodes=12, seed=50, env=tabletop)
    assert expert["conflict"]["success_rate"] >= 0.9 and expert["conflict"]["did_layout_task_rate"] == 0.0
    assert all(e["layout_task"] != e["instruction"] for e in expert["per_episode"])
    by = expert["conflict"]["by_layout_object"]
    assert sum(v["episodes"] for v in by.values()) == 12 and all(v["episodes"] for v in by.values())
    # which object the gripper went for first: the expert the commanded one under every layout; the
    # scene reader the layout's one wherever the layout puts another object first
    for k in ("conflict", "in_distribution", "random"):
        assert expert[k]["approached_first"]["commanded"] >= 11, (k, expert[k]["approached_first"])
    assert expert["random"]["success_rate"] >= 0.9
    # where the commanded cube starts: slot 0 on its own (correlated) layout, any slot on random ones
    assert set(expert["in_distribution"]["by_commanded_slot"]) == {"0"}
    slots = expert["random"]["by_commanded_slot"]
    assert sum(v["episodes"] for v in slots.values()) == 12 and len(slots) >= 2, slots
    assert sum(v["successes"] for v in slots.values()) == round(12 * expert["random"]["success_rate"])
    other_object = by["another object"]["episodes"]
    assert reader["conflict"]["approached_first"]["layout's"] >= other_object - 1, reader["conflict"]["approached_first"]
    assert sum(reader["conflict"]["failures_approached_first"].values()) == 12 - round(12 * reader["conflict"]["success_rate"])


def test_layout_conflict_bad_input(tabletop):
    with pytest.raises(InvalidOptionError, match="layout_task_id"):
        layout_conflict_eval(ExpertPolicy(), KITCHEN, episodes=2)
    with pytest.raises(InvalidOptionError, match="episodes"):
        layout_conflict_eval(ExpertPolicy(), TABLETOP, episodes=0, env=tabletop)
    with pytest.raises(InvalidOptionError, match="layout='correlated'"):
        tabletop.reset(seed=0, options={"task_id": 0, "layout": "random", "layout_task_id": 3})


# ----- kitchen (robosuite): perturbations ----------------------------------------------------------
def test_kitchen_noise_paraphrase_layout_robot(kitchen):
    suite = kitchen.suite
    # sensor noise
    noisy = perturb(kitchen, "sensor_noise", magnitude=0.02, seed=0)
    a = kitchen.reset(seed=3, options={"task_id": 1})[0]["state"]
    b = noisy.reset(seed=3, options={"task_id": 1})[0]["state"]
    assert 0.015 < (b - a).std() < 0.025
    # paraphrase
    para = perturb(kitchen, "paraphrase", seed=0)
    obs, info = para.reset(seed=3, options={"task_id": 5})
    assert obs["instruction"] in suite.tasks[5].paraphrases and info["task_id"] == 5
    # robot initial pose
    robot = perturb(kitchen, "robot_init", magnitude=0.1, seed=0)
    idx = kitchen.rs.robots[0]._ref_joint_pos_indexes
    kitchen.reset(seed=3, options={"task_id": 1})
    q0 = kitchen.rs.sim.data.qpos[idx].copy()
    robot.reset(seed=3, options={"task_id": 1})
    d = kitchen.rs.sim.data.qpos[idx] - q0
    assert np.abs(d).max() > 0.02 and np.abs(d).max() <= 0.25 + 1e-6
    # object layout
    layout = perturb(kitchen, "layout", magnitude=0.04, seed=0)
    spec = LAYOUT_SPECS["GroundflowKitchen"]
    body = kitchen.rs.object_body_ids
    kitchen.reset(seed=3, options={"task_id": 1})
    p0 = kitchen.rs.sim.data.body_xpos[body].copy()
    layout.reset(seed=3, options={"task_id": 1})
    p1 = kitchen.rs.sim.data.body_xpos[body].copy()
    moved = p1[:, :2] - p0[:, :2]
    assert np.all(np.abs(moved) <= 0.04 + 1e-6) and np.linalg.norm(moved, axis=1).max() > 0.005
    assert np.all(p1[:, :2] >= spec["lo"]) and np.all(p1[:, :2] <= spec["hi"])
    assert expert_succeeds(layout, 3, suite.tasks[1].instruction)


def test_kitchen_other_task_counted_with_task_id_lists(kitchen):
    # the kitchen reports completed tasks as ids; task 0 done under command 1 is "another task"
    out = rollout(ExpertPolicy(kitchen, task=0), _Tracked(kitchen), 2,
                  options={"instruction": kitchen.suite.tasks[1].instruction})
    assert out == {"success": False, "other_task": True, "completed_at_end": [0], "completed_ever": [0]}


# ----- images: camera and lighting -----------------------------------------------------------------
def _image(env, w, seed=0):
    return w.reset(seed=seed, options={"task_id": 0})[0]["images"][env.cameras[0]].astype(np.float64)


def test_kitchen_camera_lighting_image_noise(kitchen_cams):
    env, cam = kitchen_cams, kitchen_cams.cameras[0]
    m = env.rs.sim.model
    cid = m.camera_name2id(cam)
    p0, q0 = m.cam_pos[cid].copy(), m.cam_quat[cid].copy()
    clean = _image(env, env)
    shift = perturb(env, "camera", magnitude=0.05, seed=0)
    shifted = _image(env, shift)
    assert np.linalg.norm(m.cam_pos[cid] - p0) == pytest.approx(0.05, abs=1e-6)
    angle = np.degrees(2 * np.arccos(min(1.0, abs(float(np.dot(m.cam_quat[cid], q0))))))
    assert angle == pytest.approx(5.0, abs=0.01)
    assert np.abs(shifted - clean).mean() > 3
    np.testing.assert_array_equal(_image(env, shift), shifted)  # same seed, same shift
    np.testing.assert_array_equal(env.reset(seed=0, options={"task_id": 0})[0]["state"],
                                  shift.reset(seed=0, options={"task_id": 0})[0]["state"])  # images only
    shift.restore()
    np.testing.assert_array_equal(m.cam_pos[cid], p0)
    np.testing.assert_array_equal(_image(env, env), clean)

    light = perturb(env, "lighting", magnitude=0.5, seed=0)
    lit = [_image(env, light, seed) for seed in range(4)]
    factors = [light.reset(seed=s, options={"task_id": 0})[1]["perturbation"]["lighting"]["intensity"] for s in range(4)]
    for img, f in zip(lit, factors):
        assert (img.mean() - clean.mean()) * (f - 1) >= 0  # brighter lights, brighter image
        assert np.abs(img - clean).mean() > 2
    light.restore()
    np.testing.assert_array_equal(_image(env, env), clean)

    noisy = perturb(env, "sensor_noise", magnitude=0.0, image_std=6.0, seed=0)
    diff = _image(env, noisy) - clean
    inner = (clean > 20) & (clean < 235)  # away from clipping
    assert 5.0 < diff[inner].std() < 7.0


def test_maniskill_camera_and_lighting(tabletop_cams):
    env = tabletop_cams
    rc = env.raw._sensors["base_camera"].camera._render_cameras[0]
    p0 = np.array(rc.get_local_pose().p)
    clean = _image(env, env)
    shift = perturb(env, "camera", magnitude=0.05, seed=0)
    shifted = _image(env, shift)
    assert np.linalg.norm(np.array(rc.get_local_pose().p) - p0) == pytest.approx(0.05, abs=1e-5)
    assert np.abs(shifted - clean).mean() > 3
    shift.restore()
    np.testing.assert_allclose(rc.get_local_pose().p, p0, atol=1e-6)
    light = perturb(env, "lighting", magnitude=0.5, seed=0)
    img = _image(env, light, seed=0)
    f = light.reset(seed=0, options={"task_id": 0})[1]["perturbation"]["lighting"]["intensity"]
    assert (img.mean() - clean.mean()) * (f - 1) > 0 and np.abs(img - clean).mean() > 2
    light.restore()
    np.testing.assert_array_equal(_image(env, env), clean)


# ----- slow: wider measurements ------------------------------------------------------------------
@pytest.mark.slow
def test_kitchen_swap_expert_vs_instruction_ignoring(kitchen):
    k = len(kitchen.suite.tasks)
    res = swap_eval(ExpertPolicy(), KITCHEN, seeds=[0, 1], env=kitchen)
    assert res["same_initial_state"] is True and res["swap_success_rate"] >= 0.9
    ignoring = swap_eval(ExpertPolicy(task=0), KITCHEN, seeds=[0, 1], env=kitchen)
    assert abs(ignoring["swap_success_rate"] - 1 / k) <= 0.1 and ignoring["did_other_task_rate"] >= 0.7


@pytest.mark.slow
@pytest.mark.parametrize("env_id", [TABLETOP, KITCHEN])
def test_expert_under_every_state_perturbation(env_id):
    res = perturbation_eval(ExpertPolicy(), env_id, episodes=12, seed=200)
    assert res["clean"]["success_rate"] >= 0.9
    for fam, r in res["families"].items():
        if fam in ("camera", "lighting"):
            assert r["skipped"]
        else:
            assert r["success_rate"] >= 0.8, (fam, r["success_rate"])
