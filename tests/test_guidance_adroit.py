"""Guidance under tighter joint limits on Adroit (train/constrained_eval.py), with a real
simulator and a briefly trained flow policy: guided chunks must keep the limit that unguided
chunks break, without rewriting the joints the limit does not name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import envs
import policies
from envs.errors import InvalidOptionError, UnknownEnvError
from train import constrained_eval as ce
from train.bc import TrainArgs, train
from train.collect import CollectArgs, collect

TASK = "hammer"  # its wrist limit is broken by about half of the demo frames


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    d = tmp_path_factory.mktemp("adroit_guid")
    data = d / "demos.h5"
    collect(CollectArgs(env=f"adroit/{TASK}", episodes=10, out=data, seed=0, progress=False))
    train(TrainArgs(data=(data,), policy="flow", steps=400, batch_size=64, horizon=16, n_exec=8, out=d / "run",
                    wandb="disabled", progress=False, seed=0, save_every=10_000))
    return policies.load(d / "run" / "ckpt")


@pytest.fixture(scope="module")
def observations():
    """States the task really visits: expert rollouts, every 8th step of the first 40."""
    env = envs.make(f"adroit/{TASK}")
    expert = env.make_expert()
    out = []
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        expert.reset(env, obs)
        for t in range(40):
            if t % 8 == 0:
                out.append(obs)
            obs, *_ = env.step(expert.act(obs))
    env.close()
    return out


def test_guided_chunks_keep_the_limit_and_leave_other_joints(policy, observations):
    c = ce.constraint_for(f"adroit/{TASK}")
    noise = torch.randn(len(observations), policy.config.horizon, policy.config.action_dim,
                        generator=torch.Generator().manual_seed(0))
    base, _, _ = ce.sample_chunks(policy, observations, None, noise)
    guide = ce.make_guide(policy, c, "coupled", 10.0)
    guided, stats, _ = ce.sample_chunks(policy, observations, guide, noise)
    tol = ce.TOL
    v_base = float((c.excess(base) > tol).mean())
    v_guided = float((c.excess(guided) > tol).mean())
    assert v_base > 0.1, f"the unguided policy should break the tighter limit here (got {v_base:.3f})"
    assert v_guided <= 0.1 * v_base, (v_base, v_guided)
    assert stats.n_backward == 0 and stats.nfe == policy.config.flow_steps  # no network gradient, same NFE
    other = [d for d in range(policy.config.action_dim) if d not in c.dims]
    moved_other = float(np.abs(guided - base)[..., other].mean())
    moved_constrained = float(np.abs(guided - base)[..., c.dims].mean())
    assert moved_other < 0.05, moved_other                      # action units, on [-1, 1]
    assert moved_other < 0.5 * moved_constrained, (moved_other, moved_constrained)


def test_evaluation_runs_seeded_and_clip_never_violates(policy):
    a = ce.evaluate_constrained(policy, f"adroit/{TASK}", "none", 0.0, episodes=2, seed=5, latency_calls=1)
    b = ce.evaluate_constrained(policy, f"adroit/{TASK}", "none", 0.0, episodes=2, seed=5, latency_calls=1)
    for k in ("success_rate", "violation_rate", "violation_mean", "state_violation_rate", "mean_steps"):
        assert a[k] == b[k], k
    clipped = ce.evaluate_constrained(policy, f"adroit/{TASK}", "clip", 0.0, episodes=2, seed=5, latency_calls=0)
    assert clipped["violation_rate"] == 0.0 and clipped["violation_max"] == 0.0
    assert clipped["nfe_per_chunk"] == policy.config.flow_steps and clipped["ms_per_chunk"] is None


def test_a_diverged_sampler_ends_the_episode_as_a_failed_violation(policy):
    # the plain state gradient overflows at a huge scale: no action may be executed from a NaN chunk
    with pytest.warns(RuntimeWarning):
        r = ce.evaluate_constrained(policy, f"adroit/{TASK}", "state_gradient", 1e6, episodes=1, seed=5, latency_calls=0)
    assert r["nonfinite_rate"] == 1.0 and r["violation_rate"] == 1.0
    assert r["success_rate"] == 0.0 and r["mean_steps"] == 0.0


def test_constraints_are_inside_the_demo_range():
    for task, c in ce.CONSTRAINTS.items():
        env = envs.make(f"adroit/{task}")
        c.check_env(env)
        env.close()
        for lim in c.limits:
            assert lim.demo_min < lim.low or lim.high < lim.demo_max  # one side tightened
            assert -1.0 <= lim.low < lim.high <= 1.0
    a = np.array([[0.0, 2.0, -2.0]], np.float32)
    c = ce.AdroitConstraint("x", (ce.JointLimit(1, "j", -1.0, 0.5, -1, 1), ce.JointLimit(2, "k", -0.3, 1.0, -1, 1)), "")
    np.testing.assert_allclose(c.clip(a), [[0.0, 0.5, -0.3]])
    np.testing.assert_allclose(c.excess(a), [[1.5, 1.7]], rtol=1e-6)
    assert ce.derive_limit(np.array([[-1.0], [1.0]]), 0, "high") == (-1.0, pytest.approx(0.3))


def test_bad_input_is_refused_with_the_valid_values(policy):
    with pytest.raises(UnknownEnvError, match="adroit/door"):
        ce.constraint_for("adroit/juggle")
    with pytest.raises(UnknownEnvError, match="valid"):
        ce.evaluate_constrained(policy, "maniskill/PushCube-v1", "none")
    with pytest.raises(InvalidOptionError, match="coupled"):
        ce.evaluate_constrained(policy, f"adroit/{TASK}", "teleport", 1.0)
    with pytest.raises(InvalidOptionError, match="scale"):
        ce.evaluate_constrained(policy, f"adroit/{TASK}", "coupled", -1.0)
    with pytest.raises(InvalidOptionError, match="episodes"):
        ce.evaluate_constrained(policy, f"adroit/{TASK}", "none", episodes=0)
    with pytest.raises(InvalidOptionError, match="action_dim"):
        ce.evaluate_constrained(policy, "adroit/door", "none", episodes=1)  # a hammer policy on door
    with pytest.raises(InvalidOptionError, match="side"):
        ce.derive_limit(np.zeros((2, 1)), 0, "left")


def test_the_recommended_keepout_row_keeps_out_everywhere_and_has_the_best_worst_case(monkeypatch):
    """``recommend``: only re-checked rows with at most 1% violations on every task and both seeds qualify; among
    them, the best worst-case clean success relative to the unguided success of the same task and seed."""
    from conftest import load_benchmark
    bench = load_benchmark("guidance_adroit", monkeypatch)

    def row(clean, viol, re_clean, re_viol):
        return {"clean_success_rate": clean, "violation_rate": viol, "recheck_clean_success_rate": re_clean,
                "recheck_violation_rate": re_viol}
    none = {"success_rate": 1.0, "recheck_success_rate": 0.8}
    best = {"door": {"none": none, "coupled+check": row(0.9, 0.0, 0.6, 0.0),
                     "coupled_prox+check": row(0.95, 0.02, 0.8, 0.0), "pnp_renoise+check": row(0.8, 0.0, 0.76, 0.0)},
            "relocate": {"none": none, "coupled+check": row(0.9, 0.0, 0.6, 0.0),
                         "coupled_prox+check": row(0.9, 0.0, 0.8, 0.0), "pnp_renoise+check": row(0.8, 0.0, 0.76, 0.0)}}
    # prox violates on door's first seed; coupled's worst ratio is 0.6/0.8, PnP's 0.8/1.0
    assert bench.recommend(best) == "pnp_renoise+check"
    del best["relocate"]["pnp_renoise+check"]  # a row missing on one task cannot be recommended
    assert bench.recommend(best) == "coupled+check"
    for rows in best.values():
        rows["coupled+check"]["recheck_violation_rate"] = 0.04
    assert bench.recommend(best) is None


def test_each_training_source_has_its_own_section_and_budget(monkeypatch):
    """A policy trained otherwise (``--large``, a second training seed) never overwrites the rows of another one,
    and ``--large`` really trains on the larger budget; combinations without a section are refused."""
    from conftest import load_benchmark
    bench = load_benchmark("guidance_adroit", monkeypatch)
    sources = {bench.Demos(): "adroit_keepout", bench.Demos(detours=True): "adroit_keepout_detours",
               bench.Demos(large=True): "adroit_keepout_large",
               bench.Demos(train_seed=1, large=True): "adroit_keepout_large_train1",
               bench.Demos(train_seed=2, large=True): "adroit_keepout_large_train2"}
    for source, section in sources.items():
        assert bench._section("keepout", source) == section
    assert len({s.suffix() for s in sources}) == len(sources)  # their policies' run directories differ too
    assert bench.Demos(large=True).budget("door") == bench.LARGE != bench.Demos().budget("door")
    assert bench.Demos(train_seed=1, large=True).first_training == bench.Demos(large=True)
    with pytest.raises(SystemExit, match="no keepout section"):
        bench._section("keepout", bench.Demos(detours=True, large=True))
    with pytest.raises(SystemExit, match="no keepout section"):
        bench._section("keepout", bench.Demos(train_seed=2))


def test_a_run_on_some_tasks_or_methods_keeps_the_other_stored_rows(monkeypatch, tmp_path):
    """``--tasks relocate`` (or ``--methods ...``) adds or replaces its own rows; door's rows, relocate's other
    methods and their meta stay, but rows measured on another episode count are not mixed in."""
    import json
    from conftest import load_benchmark
    bench = load_benchmark("guidance_adroit", monkeypatch)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    stored = {"adroit_keepout_large": {"door": {"none": {"success_rate": 1.0}},
                                       "relocate": {"none": {"success_rate": 0.9}, "coupled+check": {"success_rate": 0.5}}},
              "adroit_keepout_large_sweep": {"door": {"coupled": [{"scale": 1.0}]}, "relocate": {}},
              "adroit_keepout_large_meta": {"episodes": 50, "tasks": {"door": {"demos": 200}, "relocate": {"demos": 1}}}}
    (tmp_path / "guidance.json").write_text(json.dumps(stored))
    new = {"relocate": {"coupled+check": {"success_rate": 0.8}}}
    best, sweep, meta = bench.merged(new, {"relocate": {}}, {"relocate": {"demos": 200}}, "keepout", 50,
                                     bench.Demos(large=True))
    assert best == {"door": {"none": {"success_rate": 1.0}},
                    "relocate": {"none": {"success_rate": 0.9}, "coupled+check": {"success_rate": 0.8}}}
    assert sweep["door"] == {"coupled": [{"scale": 1.0}]}
    assert meta == {"door": {"demos": 200}, "relocate": {"demos": 200}}
    assert bench.merged(new, {}, {}, "keepout", 20, bench.Demos(large=True))[0] == new
