"""A palm keep-out region on Adroit (train/constrained_eval.py ``KEEPOUTS``): exact site
kinematics, a servo model that predicts where the palm goes, a safety filter that keeps the
scripted expert out of the ball it otherwise enters, and guidance that plans chunks around it."""

from __future__ import annotations

import mujoco
import numpy as np
import pytest
import torch

import envs
import policies
from envs.errors import InvalidOptionError, UnknownEnvError
from envs.kinematics import SiteKinematics
from train import constrained_eval as ce
from train.bc import TrainArgs, train
from train.collect import CollectArgs, collect


@pytest.mark.parametrize("task", ["door", "relocate"])
def test_site_kinematics_match_mujoco(task):
    env = envs.make(f"adroit/{task}")
    model = env.unwrapped_mujoco.model
    data = mujoco.MjData(model)
    fk = SiteKinematics(model, "S_grasp")
    rng = np.random.default_rng(0)
    qs, want = [], []
    for _ in range(10):
        q = model.qpos0.copy()
        for j in range(model.njnt):
            if model.jnt_limited[j]:
                q[model.jnt_qposadr[j]] = rng.uniform(*model.jnt_range[j])
        data.qpos[:] = q
        mujoco.mj_kinematics(model, data)
        qs.append(q)
        want.append(data.site("S_grasp").xpos.copy())
    np.testing.assert_allclose(fk(torch.as_tensor(np.array(qs))).numpy(), np.array(want), atol=1e-9)
    with pytest.raises(InvalidOptionError, match="S_grasp"):
        SiteKinematics(model, "S_elbow")
    env.close()


def _expert_depth(task: str, seed: int, filtered: bool) -> tuple[float, bool]:
    ko = ce.KEEPOUTS[task]
    env = envs.make(f"adroit/{task}")
    ko.bind(env)
    expert = env.make_expert()
    obs, _ = env.reset(seed=seed)
    expert.reset(env, obs)
    depth, success = 0.0, False
    for _ in range(120):
        action = expert.act(obs)
        if filtered:
            action = ko.filter(action, env)
        obs, _, _, _, info = env.step(action)
        depth = max(depth, ko.state_excess(env))
        success = success or bool(info["success"])
        if success:
            break
    env.close()
    return depth, success


def test_the_filter_keeps_the_expert_palm_out_of_the_ball():
    # the door expert's palm passes 1-5 cm inside the ball; filtered, it stays out and still opens the door
    for seed in (1, 2):
        raw, _ = _expert_depth("door", seed, filtered=False)
        kept, ok = _expert_depth("door", seed, filtered=True)
        assert raw > 0.02, f"seed {seed}: the expert should enter the keep-out ball (depth {raw:.3f} m)"
        assert kept <= ce.KEEPOUTS["door"].tol and ok, (seed, kept, ok)


def test_servo_model_predicts_where_the_palm_goes():
    ko = ce.KEEPOUTS["relocate"]
    env = envs.make("adroit/relocate")
    ko.bind(env)
    assert min(ko.servo.r2) > 0.6, ko.servo.r2
    rng = np.random.default_rng(5)
    errors, moved = [], []
    for seed in range(3):
        env.reset(seed=50 + seed)
        qpos, qvel = ko.joint_state([env])
        start = env.unwrapped_mujoco.data.site("S_grasp").xpos.copy()
        action = np.zeros(env.action_space.shape[0], np.float32)
        action[ko.dims.numpy()] = rng.uniform(-0.6, 0.6, len(ko.dims))
        pred = ko.predict_palm(torch.as_tensor(action).expand(1, 4, -1), qpos, qvel)[0, -1].numpy()
        for _ in range(4):
            env.step(action)
        palm = env.unwrapped_mujoco.data.site("S_grasp").xpos
        errors.append(np.linalg.norm(palm - pred))
        moved.append(np.linalg.norm(palm - start))
    env.close()
    assert max(errors) < 0.3 * np.mean(moved), (errors, moved)  # far better than "the palm stays put"


@pytest.fixture(scope="module")
def door_policy(tmp_path_factory):
    d = tmp_path_factory.mktemp("keepout")
    data = d / "demos.h5"
    collect(CollectArgs(env="adroit/door", episodes=10, out=data, seed=0, progress=False))
    train(TrainArgs(data=(data,), policy="flow", steps=400, batch_size=64, horizon=16, n_exec=8, out=d / "run",
                    wandb="disabled", progress=False, seed=0, save_every=10_000))
    return policies.load(d / "run" / "ckpt")


def _on_the_way_up(seeds) -> tuple:
    """The expert's door episodes (an env) and, a quarter of the way up to the handle (steps 10 and 12), where
    plans cross the ball: the observations and an env standing in each of those states."""
    env = envs.make("adroit/door")
    expert = env.make_expert()
    obs_list, pool = [], []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        expert.reset(env, obs)
        for t in range(13):
            if t in (10, 12):
                snap = envs.make("adroit/door")
                snap.reset(seed=seed)
                snap.unwrapped_mujoco.data.qpos[:] = env.unwrapped_mujoco.data.qpos
                snap.unwrapped_mujoco.data.qvel[:] = env.unwrapped_mujoco.data.qvel
                obs_list.append(obs)
                pool.append(snap)
            obs, *_ = env.step(expert.act(obs))
    return env, obs_list, pool


def test_guided_chunks_plan_around_the_ball(door_policy):
    """At states the expert visits on its way up, unguided chunks plan the palm through the ball;
    coupled guidance (no network gradient) plans around it and leaves the fingers alone."""
    ko = ce.KEEPOUTS["door"]
    env, obs_list, pool = _on_the_way_up(range(4))
    ko.bind(env)
    noise = torch.randn(len(obs_list), door_policy.config.horizon, door_policy.config.action_dim,
                        generator=torch.Generator().manual_seed(0))
    guide = ce.make_guide(door_policy, ko, "coupled", 10.0, weight=1e4)
    ko.before_sample(guide.cost, pool)
    base, _, _ = ce.sample_chunks(door_policy, obs_list, None, noise)
    guided, stats, _ = ce.sample_chunks(door_policy, obs_list, guide, noise)
    qpos, qvel = ko.joint_state(pool)

    def depth(chunks):
        p = ko.predict_palm(torch.as_tensor(chunks), qpos, qvel)
        return torch.relu(ko.radius - torch.linalg.norm(p - ko.center_t, dim=-1)).amax(1).numpy()

    d_base, d_guided = depth(base), depth(guided)
    assert d_base.max() > 0.02, f"unguided plans should cross the ball here (deepest {d_base.max():.3f} m)"
    assert d_guided.mean() < 0.25 * d_base.mean(), (d_base, d_guided)   # measured: 0.033 m -> 0.005 m
    assert d_guided.max() < 0.5 * d_base.max(), (d_base, d_guided)
    assert stats.n_backward == 0 and stats.nfe == door_policy.config.flow_steps
    fingers = [d for d in range(door_policy.config.action_dim) if d not in ko.dims.tolist()]
    assert float(np.abs(guided - base)[..., fingers].mean()) < 0.5 * float(np.abs(guided - base)[..., ko.dims].mean())
    for e in pool + [env]:
        e.close()


def test_keepout_evaluation_is_seeded_and_bad_input_is_named(door_policy):
    a = ce.evaluate_constrained(door_policy, "adroit/door", "clip", 0.0, episodes=2, seed=5, latency_calls=0,
                                kind="keepout")
    b = ce.evaluate_constrained(door_policy, "adroit/door", "clip", 0.0, episodes=2, seed=5, latency_calls=0,
                                kind="keepout")
    assert a["kind"] == "keepout"
    for k in ("success_rate", "violation_rate", "state_violation_max", "mean_steps"):
        assert a[k] == b[k], k
    with pytest.raises(UnknownEnvError, match="adroit/door"):
        ce.constraint_for("adroit/pen", "keepout")
    with pytest.raises(InvalidOptionError, match="keepout"):
        ce.evaluate_constrained(door_policy, "adroit/door", "none", kind="forcefield")


def _unguided_plans_on_the_way_up(policy) -> tuple:
    """The door keep-out bound to the expert's env, observations and envs on the way up (2 episodes) and the
    policy's unguided chunks there (noise seed 0)."""
    ko = ce.KEEPOUTS["door"]
    env, obs_list, pool = _on_the_way_up(range(2))
    ko.bind(env)
    noise = torch.randn(len(obs_list), policy.config.horizon, policy.config.action_dim,
                        generator=torch.Generator().manual_seed(0))
    chunks, _, _ = ce.sample_chunks(policy, obs_list, None, noise)
    return ko, env, obs_list, pool, chunks


def test_the_hard_check_passes_only_plans_clear_of_the_ball(door_policy):
    """``KeepOut.passes`` accepts a chunk exactly when its predicted palm path stays out of the ball; the unguided
    plans that cross the ball fail it. ``+check`` runs and reports its retries; it needs the keep-out model."""
    ko, env, obs_list, pool, chunks = _unguided_plans_on_the_way_up(door_policy)
    qpos, qvel = ko.joint_state(pool)
    p = ko.predict_palm(torch.as_tensor(np.clip(chunks, -1, 1)), qpos, qvel)
    clear = (torch.linalg.norm(p - ko.center_t, dim=-1).amin(1) >= ko.radius + ko.check_clearance).numpy()
    ok = ko.passes(chunks, pool)
    assert (ok == clear).all() and not ok.all()  # some plans cross the ball, and those fail
    assert not ko.passes(np.full_like(chunks[:1], np.nan), pool[:1])[0]  # a NaN chunk never passes
    r = ce.evaluate_constrained(door_policy, "adroit/door", "coupled+check", 10.0, episodes=2, seed=5,
                                weight=1e4, latency_calls=0, kind="keepout")
    assert 0 <= r["filtered_per_chunk"] <= r["retried_per_chunk"] <= 1
    with pytest.raises(InvalidOptionError, match="keep-out"):
        ce.evaluate_constrained(door_policy, "adroit/door", "coupled+check", 1.0, episodes=1)
    for e in pool + [env]:
        e.close()


def test_the_monitor_replans_a_queue_that_no_longer_clears(door_policy):
    """Before each command of a checked rollout the next commands are re-checked from the measured state: a
    queue whose path crosses the ball is replaced by guided commands that clear it (or handed to the filter),
    and a queue that clears is left alone."""
    ko, env, obs_list, pool, chunks = _unguided_plans_on_the_way_up(door_policy)
    crossing = np.flatnonzero(~ko.passes(chunks[:, :ko.lookahead], pool))
    assert crossing.size, "some unguided plans should cross the ball on the way up"
    guide = ce.make_guide(door_policy, ko, "coupled", 10.0, weight=1e4)
    gen = torch.Generator().manual_seed(1)
    for row in crossing:
        queue = list(chunks[row, :6])
        fresh, replanned, filtered = ce._monitor(door_policy, ko, pool[row], obs_list[row], guide, queue, gen)
        assert replanned
        if not filtered:
            assert len(fresh) == len(queue) and ko.passes(np.asarray(fresh)[None], [pool[row]])[0]
    clear = np.flatnonzero(ko.passes(chunks[:, :ko.lookahead], pool))
    for row in clear:
        queue = list(chunks[row, :6])
        assert ce._monitor(door_policy, ko, pool[row], obs_list[row], guide, queue, gen) == (queue, False, False)
    for e in pool + [env]:
        e.close()


def test_detour_demos_detour_and_record_the_experts_own_action(tmp_path):
    """``collect --detours``: per episode a ball on the expert's path, clear of the evaluation ball; the palm
    stays out of it (the filter executed), and every recorded action is the expert's own at that state."""
    import h5py
    import json
    out = tmp_path / "detours.h5"
    collect(CollectArgs(env="adroit/door", episodes=2, out=out, seed=0, progress=False, detours=True))
    test_ball = ce.KEEPOUTS["door"]
    env = envs.make("adroit/door")
    expert = env.make_expert()
    with h5py.File(out) as f:
        meta = json.loads(f.attrs["meta"])
        balls = meta["detour_balls"]
        assert meta["detours"] and len(balls) == 2
        for ball, key in zip(balls, sorted(f["episodes"])):
            c = np.asarray(ball["center"])
            assert np.linalg.norm(c - np.asarray(test_ball.center)) >= ball["radius"] + test_ball.radius
            ep = f["episodes"][key]
            assert ep["success"][-1]
            env.reset(seed=ball["seed"])
            for t in range(len(ep["action"])):
                env.set_sim_state(ep["sim_state"][t])
                palm = env.unwrapped_mujoco.data.site("S_grasp").xpos
                assert np.linalg.norm(palm - c) > ball["radius"] - test_ball.tol, (key, t)
                np.testing.assert_allclose(ep["action"][t], expert.act({"state": ep["state"][t]}), atol=1e-5)
    env.close()
    with pytest.raises(InvalidOptionError, match="--dart-noise"):
        collect(CollectArgs(env="adroit/door", episodes=1, out=tmp_path / "x.h5", progress=False, detours=True,
                            dart_noise=0.1))
    with pytest.raises(InvalidOptionError, match="Adroit"):
        collect(CollectArgs(env="maniskill/PushCube-v1", episodes=1, out=tmp_path / "y.h5", progress=False,
                            detours=True))
