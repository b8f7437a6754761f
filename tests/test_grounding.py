"""Infrastructure of the grounding protocols: shortcut data (layout_rho), mid-episode instruction
switch, unseen paraphrases, counterfactual relabeling, dual-branch sampling, and the protocols in
one call.

Real simulators (ManiSkill tabletop, robosuite kitchen) at tiny sizes; the suites' privileged
experts are the reference policies. About a minute and a half on 2 cores.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import envs
from envs.errors import InstructionError, InvalidOptionError
from envs.robosuite.kitchen import CORRELATED, TASKS as KITCHEN_TASKS
from envs.suite import Suite
from policies import PolicyConfig, make_policy
from policies.dual_branch import DualBranchFlow
from groundflow.cli import main as cli_main
from train.collect import CollectArgs, collect
from train.data import ChunkData
from dataset import Dataset, DatasetError, DatasetWriter, EpisodeBuffer
from train.grounding_eval import evaluate_protocols
from train.protocols import (ExpertPolicy, SwitchCase, paraphrase_eval, switch_cases, switch_eval,
                             switch_targets)
from train.relabel import RelabelArgs, relabel, restore

TABLETOP = "maniskill/TabletopSuite-v1"
KITCHEN = "robosuite/KitchenSuite"


@pytest.fixture(scope="module")
def tabletop():
    env = envs.make(TABLETOP, max_episode_steps=100)
    yield env
    env.close()


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """Six tabletop demos where the layout names the task half of the time (through collect)."""
    out = tmp_path_factory.mktemp("demos") / "tt.h5"
    summary = collect(CollectArgs(suite="tabletop", episodes=6, out=out, seed=0, layout="correlated",
                                  layout_rho=0.5, progress=False,
                                  instructions=("push the red cube to the left goal", "pick up the green cube",
                                                "push the blue cube to the right goal")))
    assert summary["episodes"] == 6
    return out


# ----- P2: the layout names the task with probability rho ----------------------------------------
def test_layout_rho_tabletop_same_seed_same_choice(tabletop):
    mixed = {"layout": "correlated", "layout_rho": 0.5}
    got = []
    for seed in range(10):
        task = {"task_id": seed % 6}
        tabletop.reset(seed=seed, options={**task, **mixed})
        layout, state = tabletop.raw.episode_layout, tabletop.get_sim_state()
        tabletop.reset(seed=seed, options={**task, **mixed})
        assert tabletop.raw.episode_layout == layout  # the seed decides
        np.testing.assert_array_equal(tabletop.get_sim_state(), state)
        # and the episode is exactly the random- or the correlated-layout episode of that seed
        tabletop.reset(seed=seed, options={**task, "layout": layout})
        np.testing.assert_array_equal(tabletop.get_sim_state(), state)
        got.append(layout)
    assert set(got) == {"random", "correlated"}
    tabletop.reset(seed=3, options={"task_id": 1, "layout": "correlated", "layout_rho": 0.0})
    assert tabletop.raw.episode_layout == "random"
    tabletop.reset(seed=3, options={"task_id": 1, "layout": "correlated"})  # rho 1: as before
    assert tabletop.raw.episode_layout == "correlated"
    with pytest.raises(InvalidOptionError, match="needs layout='correlated'"):
        envs.make(TABLETOP, layout_rho=0.9)
    with pytest.raises(InvalidOptionError, match=r"\[0, 1\]"):
        envs.make(TABLETOP, layout="correlated", layout_rho=1.5)
    with pytest.raises(InvalidOptionError, match=r"\[0, 1\]"):
        tabletop.reset(seed=0, options={"layout": "correlated", "layout_rho": "high"})


def test_layout_rho_kitchen():
    mixed = envs.make(KITCHEN, layout="correlated", layout_rho=0.5)
    rand = envs.make(KITCHEN)
    try:
        got = []
        for seed in range(6):
            tid = seed % 6
            mixed.reset(seed=seed, options={"task_id": tid})
            got.append(mixed.episode_layout)
            if mixed.episode_layout == "correlated":
                assert tuple(np.argsort(mixed.rs.slot_of_object)) == CORRELATED[tid]
            else:
                rand.reset(seed=seed, options={"task_id": tid})
                np.testing.assert_allclose(mixed.get_sim_state(), rand.get_sim_state())
            mixed.reset(seed=seed, options={"task_id": tid})
            assert mixed.episode_layout == got[-1]
        assert set(got) == {"random", "correlated"}
        assert rand.episode_layout == "random"
    finally:
        mixed.close()
        rand.close()
    with pytest.raises(InvalidOptionError, match="needs layout='correlated'"):
        envs.make(KITCHEN, layout_rho=0.5)
    with pytest.raises(InvalidOptionError, match=r"\[0, 1\]"):
        envs.make(KITCHEN, layout="correlated", layout_rho=-0.1)


def test_collect_records_rho_and_episode_layouts(demos):
    with Dataset(demos) as ds:
        assert ds.meta["layout_rho"] == 0.5 and len(ds.meta["episode_layouts"]) == 6
        assert set(ds.meta["episode_layouts"]) <= {"random", "correlated"}


# ----- P4: mid-episode switch ------------------------------------------------------------------
def test_switch_targets_touch_other_objects(tabletop):
    suite = tabletop.suite
    for t in suite.tasks:
        targets = switch_targets(suite, t.instruction)
        assert targets and t.instruction not in targets
        mine = {t.args["cube"], t.args.get("base")} - {None}
        for l in targets:
            a = suite.task(l).args
            assert not ({a["cube"], a.get("base")} & mine), (t.instruction, l)
    push = [t.instruction for t in suite.tasks if t.family == "push"]
    assert set(switch_targets(suite, push[0], push)) == set(push[2:])  # the other two cubes' pushes
    kitchen = Suite("kitchen", KITCHEN, KITCHEN_TASKS)
    for t in kitchen.tasks:
        assert all(kitchen.task(l).args["object"] != t.args["object"] for l in switch_targets(kitchen, t.instruction))


class Stubborn(ExpertPolicy):
    """Keeps doing what it was first told (the env's commanded task), whatever it is told later."""

    def task_for(self, obs):
        return int(self.env.unwrapped.task_id)


def test_switch_expert_follows_and_a_stubborn_policy_does_not(tabletop):
    cases = switch_cases(TABLETOP, episodes=4, seed=3000, env=tabletop)  # switch_after measured on the expert
    assert all(c.expert_success for c in cases) and all(c.old != c.new for c in cases)
    assert all(1 <= c.switch_after <= 12 for c in cases)
    res = switch_eval(ExpertPolicy(), TABLETOP, cases=cases, env=tabletop)
    assert res["switch_success_rate"] == 1.0 and res["old_task_completed_rate"] == 0.0
    assert res["expert_success_rate"] == 1.0 and res["episodes"] == 4
    # without replanning the expert still follows (it rebuilds itself when the instruction changes)
    assert switch_eval(ExpertPolicy(), TABLETOP, cases=cases, env=tabletop,
                       replan_at_switch=False)["switch_success_rate"] == 1.0
    stub = switch_eval(Stubborn(), TABLETOP, cases=cases, env=tabletop)
    assert stub["switch_success_rate"] == 0.0 and stub["old_task_completed_rate"] == 1.0
    lo, hi = stub["ci95"]
    assert lo == 0.0 < hi < 0.6


def test_switch_records_what_the_gripper_held_when_the_command_changed(tabletop):
    old = "stack the red cube on the blue cube"
    new = switch_targets(tabletop.suite, old)[0]
    early, late = (SwitchCase(3000, old, new, k, expert_success=True) for k in (3, 10))
    res = switch_eval(ExpertPolicy(), TABLETOP, cases=[early, late], env=tabletop)
    assert [p["held_at_switch"] for p in res["per_case"]] == [False, True]  # the red cube is in hand by step 10
    assert [p["old_family"] for p in res["per_case"]] == ["stack", "stack"]
    assert res["switch_success_rate"] == 1.0  # the expert lets go and does the new task either way
    assert all(new not in p["other_tasks"] and old not in p["other_tasks"] for p in res["per_case"])


def test_switch_skips_what_the_expert_cannot_do(tabletop):
    instrs = tabletop.suite.instructions
    cases = [SwitchCase(3000, instrs[0], instrs[2], 5, expert_success=True),
             SwitchCase(3001, instrs[1], instrs[3], 5, expert_success=False)]
    res = switch_eval(ExpertPolicy(), TABLETOP, cases=cases, env=tabletop)
    assert res["episodes"] == 1 and res["skipped_expert_failures"] == 1 and res["expert_success_rate"] == 0.5
    assert [p["counted"] for p in res["per_case"]] == [True, False]
    with pytest.raises(InvalidOptionError, match="check_expert"):
        switch_eval(ExpertPolicy(), TABLETOP, cases=[SwitchCase(0, instrs[0], instrs[2], 5)], env=tabletop)
    with pytest.raises(InstructionError):
        switch_cases(TABLETOP, episodes=2, instructions=[instrs[0], instrs[0]], env=tabletop, switch_after=3)


# ----- P5: unseen paraphrases --------------------------------------------------------------------
def test_paraphrase_eval_uses_heldout_paraphrases(tabletop):
    suite = tabletop.suite
    instrs = suite.instructions[:3]

    class Knows(ExpertPolicy):  # an expert that "was trained" on a paraphrase
        class lang:
            cache = {**{l: None for l in suite.instructions}, suite.tasks[0].paraphrases[0]: None}

    res = paraphrase_eval(Knows(), TABLETOP, episodes=3, seed=4000, instructions=instrs, env=tabletop)
    assert res["success_rate"] == 1.0 and res["clean"]["success_rate"] == 1.0 and res["delta_vs_clean"] == 0.0
    assert res["paraphrases_in_vocabulary"] == [suite.tasks[0].paraphrases[0]]
    assert set(res["per_instruction"]) == set(instrs)


# ----- counterfactual relabeling -----------------------------------------------------------------
def test_relabel_tabletop(demos, tmp_path, tabletop):
    out = tmp_path / "cf.h5"
    s = relabel(RelabelArgs(data=demos, out=out, k=2, frames_per_episode=2, horizon=4, seed=1, progress=False))
    assert s["original_episodes"] == 6 and s["relabeled_episodes"] == 6 * 2 * 2
    with Dataset(demos) as src, Dataset(out) as ds:
        assert len(ds) == 6 + 24 and ds.meta["source"] == "relabel"
        pool = set(src.instructions)
        for j, (i, t, tid) in enumerate(ds.meta["relabel"]["index"]):
            ep, orig = ds.episode(6 + j), src.episode(i)
            assert ep.instruction == tabletop.suite.tasks[tid].instruction != orig.instruction
            assert ep.instruction in pool and ep.task_id == tid and ep.seed == orig.seed
            assert 1 <= len(ep) <= 4 and ep.sim_state is not None
            np.testing.assert_allclose(ep.state[0], orig.state[t], atol=1e-6)  # the demo's state t
        np.testing.assert_array_equal(ds.episode(0).action, src.episode(0).action)  # originals copied
        # restored under the demo's own task, the expert gives back the demo's actions
        ep = src.episode(1)
        for t in range(0, len(ep), 3):
            obs = restore(tabletop, ep, t, ep.task_id)
            expert = tabletop.make_expert(task_id=ep.task_id)
            expert.reset(tabletop, obs)
            np.testing.assert_allclose(expert.act(obs), ep.action[t], atol=1e-5)
    data = ChunkData(out, horizon=8)  # the loader pads the short continuations
    assert data.n_episodes == 30 and data.batch(np.arange(4))["action"].shape == (4, 8, 4)
    # the CLI command; the expert reaches l' from demo states when given the time
    full = tmp_path / "full.h5"
    assert cli_main(["relabel", "--data", str(demos), "--out", str(full), "--k", "1", "--frames-per-episode", "1",
                     "--horizon", "100", "--no-include-original", "--no-progress"]) == 0
    with Dataset(full) as ds:
        assert len(ds) == 6 and np.mean([ds.episode(i).succeeded for i in range(6)]) >= 5 / 6


@pytest.fixture(scope="module")
def counterfactuals(demos, tmp_path_factory):
    """Continuations only, and the same continuations (same seed) after the original demos."""
    d = tmp_path_factory.mktemp("cf")
    for name, orig in (("cf.h5", False), ("both.h5", True)):
        relabel(RelabelArgs(data=demos, out=d / name, k=2, frames_per_episode=3, horizon=4, seed=1,
                            include_original=orig, progress=False))
    return d / "cf.h5", d / "both.h5"


def test_counterfactual_actions_read_the_relabeled_states(counterfactuals):
    from train.diagnose import counterfactual_actions, load_counterfactual
    cf, both = counterfactuals
    c = load_counterfactual(cf)
    assert len(c["episodes"]) == 6 * 3 * 2 and ((0 <= c["progress"]) & (c["progress"] < 1)).all()
    assert all(old != e.instruction for old, e in zip(c["old"], c["episodes"]))
    p = make_policy(PolicyConfig(kind="flow", state_dim=c["episodes"][0].state.shape[1], action_dim=4, horizon=4,
                                 n_exec=2))
    with Dataset(both) as ds:
        eps = [ds.episode(i, images=False) for i in range(len(ds))]
    p.fit_normalizer(np.concatenate([e.state for e in eps]), np.concatenate([e.action for e in eps]))
    for l in {e.instruction for e in eps}:  # fixed features: no language model needed here
        p.lang.cache[l] = torch.randn(1, 384, generator=torch.Generator().manual_seed(len(l)))
    r = counterfactual_actions(p, c, bins=3)
    assert sum(r["per_bin_samples"]) == r["samples"] == 36 and np.isfinite(r["error_new"])
    with pytest.raises(DatasetError, match="no-include-original"):
        load_counterfactual(both)


def test_counterfactual_finds_its_demos_from_any_directory(demos, tmp_path, monkeypatch):
    """relabel records the demos' path as typed (relative to where it ran); diagnose, run from elsewhere,
    still finds them, and says which paths it tried when they are gone."""
    from train.diagnose import load_counterfactual
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "cf").mkdir()
    shutil.copy(demos, work / "data" / "tt.h5")
    monkeypatch.chdir(work)
    relabel(RelabelArgs(data=Path("data/tt.h5"), out=Path("cf/cf.h5"), k=1, frames_per_episode=1, horizon=2,
                        include_original=False, progress=False))
    monkeypatch.chdir(tmp_path)
    assert len(load_counterfactual(work / "cf" / "cf.h5")["episodes"]) == 6
    (work / "data" / "tt.h5").unlink()
    with pytest.raises(DatasetError, match="relabeled from data/tt.h5, which is missing.*tried"):
        load_counterfactual(work / "cf" / "cf.h5")


@pytest.mark.slow
def test_counterfactual_action_error_rewards_the_policy_that_saw_those_actions(demos, counterfactuals, tmp_path):
    """The P4 diagnostic: at demo states of l*, the chunk under l' is compared with the expert's for
    l'. A policy trained on those continuations must land closer to them than one trained on the
    demos alone (measured 1.31 against 1.68 normalized units)."""
    from train.bc import TrainArgs, train
    from train.diagnose import counterfactual_actions, load_counterfactual
    import policies
    cf, both = counterfactuals
    err = {}
    for name, data in (("saw", both), ("demos", demos)):
        run = train(TrainArgs(data=(data,), policy="flow", steps=300, horizon=4, n_exec=2, out=tmp_path / name,
                              wandb="disabled", progress=False, seed=0, save_every=10_000))
        err[name] = counterfactual_actions(policies.load(run["ckpt"]), load_counterfactual(cf), bins=3)
    assert err["saw"]["error_new"] < 0.9 * err["demos"]["error_new"], err


def test_relabel_refuses_bad_input(tmp_path, demos):
    bare = tmp_path / "bare.h5"
    with DatasetWriter(bare, TABLETOP, 3, 4) as w:
        buf = EpisodeBuffer("push the red cube to the left goal", 0, 0)
        buf.add({"state": np.zeros(3)}, np.zeros(4), 0.0, False)
        w.add(buf.finish())
    with pytest.raises(DatasetError, match="no sim_state"):
        relabel(RelabelArgs(data=bare, out=tmp_path / "x.h5", progress=False))
    single = tmp_path / "single.h5"
    with DatasetWriter(single, "maniskill/PushCube-v1", 3, 4) as w:
        w.add(buf.finish())
    with pytest.raises(InvalidOptionError, match="multi-instruction suite"):
        relabel(RelabelArgs(data=single, out=tmp_path / "y.h5", progress=False))
    with pytest.raises(InvalidOptionError, match="--k"):
        relabel(RelabelArgs(data=demos, out=tmp_path / "z.h5", k=0, progress=False))
    with pytest.raises(InvalidOptionError, match="source dataset"):
        relabel(RelabelArgs(data=demos, out=demos, progress=False))


def test_relabel_kitchen(tmp_path):
    src = tmp_path / "k.h5"
    collect(CollectArgs(suite="kitchen", episodes=1, out=src, seed=0, progress=False,
                        instructions=("put the red cube on the plate",)))
    out = tmp_path / "kcf.h5"
    s = relabel(RelabelArgs(data=src, out=out, k=2, frames_per_episode=1, horizon=3, progress=False,
                            instructions=("put the red cube on the plate", "put the green can in the bin",
                                          "put the blue cube on the plate")))
    assert s["relabeled_episodes"] == 2
    with Dataset(out) as ds:
        eps = [ds.episode(i) for i in range(1, 3)]
        assert {e.instruction for e in eps} == {"put the green can in the bin", "put the blue cube on the plate"}
        assert all(len(e) == 3 and np.isfinite(e.action).all() for e in eps)


# ----- dual-branch (language-contrast) sampling ----------------------------------------------------
@pytest.fixture(scope="module")
def flow_policy(tabletop):
    torch.manual_seed(0)
    p = make_policy(PolicyConfig(kind="flow", state_dim=tabletop.state_dim, action_dim=4, horizon=4, n_exec=2))
    torch.nn.init.normal_(p.action_out.weight, std=0.5)  # an untrained head outputs zeros
    p.fit_normalizer(np.random.default_rng(0).normal(size=(50, tabletop.state_dim)),
                     np.random.default_rng(1).uniform(-1, 1, size=(50, 4)))
    p.lang.warm(tabletop.suite.instructions[:4])
    return p.eval()


def test_dual_branch_w0_is_the_plain_policy(flow_policy, tabletop):
    obs, _ = tabletop.reset(seed=0, options={"task_id": 1})
    noise = torch.randn(1, 4, 4, generator=torch.Generator().manual_seed(3))
    plain = flow_policy.predict_action_chunk(obs, noise=noise)
    dual = DualBranchFlow(flow_policy, weight=0.0, suite=tabletop.suite)
    np.testing.assert_allclose(dual.predict_action_chunk(obs, noise=noise), plain, atol=1e-6)
    strong = DualBranchFlow(flow_policy, weight=2.0, suite=tabletop.suite)
    chunk = strong.predict_action_chunk(obs, noise=noise)
    assert chunk.shape == (4, 4) and np.isfinite(chunk).all() and not np.allclose(chunk, plain, atol=1e-4)
    # the commanded task (also under a paraphrase) is left out of the language-free mean
    instr = tabletop.suite.tasks[1]
    assert instr.instruction not in strong.others(instr.instruction) and len(strong.others(instr.paraphrases[0])) == 3
    # the policy interface, by delegation
    assert strong.config is flow_policy.config and strong.lang is flow_policy.lang
    strong.reset()
    a = strong.select_action(obs)
    assert a.shape == (4,) and len(strong._queue) == 1
    with pytest.raises(InvalidOptionError, match="flow-matching"):
        DualBranchFlow(make_policy(PolicyConfig(kind="ar", state_dim=3, action_dim=2)))


# ----- the protocols in one call ---------------------------------------------------------------
def test_evaluate_protocols_expert_reference(tabletop):
    instrs = tabletop.suite.instructions[:3]  # pushes of red and green: switch targets exist
    res = evaluate_protocols(ExpertPolicy(), "tabletop", episodes=3, swap_seeds=1, instructions=instrs,
                             env=tabletop)
    s = res["summary"]
    for key in ("p1_success", "p3_swap", "p4_switch", "p5_paraphrase", "p5_clean"):
        assert s[key]["rate"] == 1.0 and s[key]["n"] == 3 and s[key]["ci95"][0] > 0.35, key
    assert s["p1_did_other_task"]["rate"] == 0.0 and s["p4_old_task_completed"]["rate"] == 0.0
    assert res["p3_swap"]["same_initial_state"] is True
    with pytest.raises(InvalidOptionError, match="random layout"):
        evaluate_protocols(ExpertPolicy(), "tabletop", env_options={"layout": "correlated"})
    with pytest.raises(InvalidOptionError, match="valid"):
        evaluate_protocols(ExpertPolicy(), "tabletop", protocols=["p2"], env=tabletop)


def test_switch_records_where_the_gripper_heads_on_the_kitchen():
    kitchen = envs.make(KITCHEN)
    try:
        suite = kitchen.suite
        old = suite.tasks[0].instruction  # red cube on the plate
        new = switch_targets(suite, old)[0]
        case = SwitchCase(5, old, new, 28, expert_success=True)
        follows = switch_eval(ExpertPolicy(), KITCHEN, cases=[case], env=kitchen)["per_case"][0]["reach"]
        stays = switch_eval(Stubborn(), KITCHEN, cases=[case], env=kitchen)["per_case"][0]["reach"]
    finally:
        kitchen.close()
    assert follows["toward_new"] and not follows["went_to_old"]
    assert stays["went_to_old"] and not stays["toward_new"]
    assert stays["after_20"][0] < follows["after_20"][0] and follows["after_20"][1] < stays["after_20"][1]


def test_grounding_benchmark_refuses_a_cig_weight_that_would_make_cig_bc():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "grounding.py"
    r = subprocess.run([sys.executable, str(script), "--cig-weight", "0", "--part", "switch"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--cig-weight must be > 0" in r.stderr and "Traceback" not in r.stderr
