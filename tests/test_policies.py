"""Flow and AR policies: learning beats an untrained model, persistence, likelihoods, sampling."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import policies
from envs.errors import InstructionError
from policies import AutoregressiveVLA, FlowMatchingVLA, PolicyConfig, PolicyMismatchError
from train.bc import TrainArgs, train
from train.collect import CollectArgs, collect
from train.data import ChunkData

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def push_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "push.h5"
    collect(CollectArgs(env="maniskill/PushCube-v1", episodes=10, out=path, seed=0, progress=False))
    return path


@pytest.fixture(scope="module")
def push_heldout(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "push_heldout.h5"
    collect(CollectArgs(env="maniskill/PushCube-v1", episodes=3, out=path, seed=500, progress=False))
    return path


def _heldout_error(policy, data):
    """Mean squared chunk error in normalized action units ([-1, 1] per dimension)."""
    batch = data.batch(np.arange(0, len(data), 2))
    torch.manual_seed(0)
    with torch.no_grad():
        pred = policy.sample_chunks(batch)
        target = policy.normalizer.action(torch.as_tensor(batch["action"]))
    err = ((pred - target) ** 2).mean(-1).numpy()
    return float(err[~batch["action_pad"]].mean())


# The AR policy decodes H*A tokens greedily; with 10 demos it learns a short chunk (H=4) in a few
# hundred steps (measured 0.29 vs 0.59 untrained), while H=16 needs far more data and steps.
@pytest.mark.parametrize("kind,steps,horizon,ratio", [("flow", 300, 16, 0.3), ("ar", 400, 4, 0.65)])
def test_training_beats_untrained(push_data, push_heldout, tmp_path, kind, steps, horizon, ratio):
    s = train(TrainArgs(data=(push_data,), policy=kind, steps=steps, batch_size=32, out=tmp_path / kind,
                        horizon=horizon, n_exec=min(4, horizon),
                        wandb="disabled", progress=False, warmup_steps=20, lr=1e-3, ema=0.0))
    trained = policies.load(tmp_path / kind / "ckpt")
    held = ChunkData(push_heldout, trained.config.horizon)  # episodes never seen in training
    untrained = policies.make_policy(PolicyConfig(**{**trained.config.to_dict(), "extra": {}}))
    untrained.normalizer.load_state_dict(trained.normalizer.state_dict())
    e_trained, e_untrained = _heldout_error(trained, held), _heldout_error(untrained, held)
    assert s["history"][-1]["loss"] < s["history"][0]["loss"]
    assert e_trained < ratio * e_untrained, (e_trained, e_untrained)


def _tiny(kind="flow", **kw):
    cfg = PolicyConfig(kind=kind, state_dim=6, action_dim=3, horizon=4, n_exec=2, **kw)
    p = policies.make_policy(cfg)
    rng = np.random.default_rng(0)
    p.fit_normalizer(rng.normal(size=(50, 6)), rng.uniform(-2, 2, size=(50, 3)),
                     [OBS["instruction"], "pick up the red cube"])
    return p


OBS = {"state": np.linspace(-1, 1, 6).astype(np.float32), "instruction": "push the red cube to the left goal"}


@pytest.mark.parametrize("kind,kw", [("flow", {}), ("ar", {}), ("mlp", {"lang_norm": True}),
                                     ("flow", {"fusion": "early", "lang_norm": True, "state_hidden": 32}),
                                     ("ar", {"fusion": "early", "lang_norm": True})])
def test_save_load_gives_identical_actions(tmp_path, kind, kw):
    p = _tiny(kind, **kw)
    for prm in p.parameters():
        torch.nn.init.normal_(prm, std=0.1)
    p.save(tmp_path / "ckpt")
    q = policies.load(tmp_path / "ckpt")
    torch.manual_seed(1)
    a = p.predict_action_chunk(OBS)
    torch.manual_seed(1)
    b = q.predict_action_chunk(OBS)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (4, 3)
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["config"]["kind"] == kind and (tmp_path / "ckpt" / "model.safetensors").is_file()
    if kw.get("lang_norm"):  # the instruction statistics travel with the checkpoint
        assert torch.equal(p.normalizer.lang_mean, q.normalizer.lang_mean) and float(q.normalizer.lang_scale) != 1.0


def test_language_is_centred_on_the_training_instructions():
    p = _tiny("flow", fusion="early", lang_norm=True)
    feats, mask = p.lang([OBS["instruction"], "pick up the red cube"])
    centred = p.normalizer.language(feats)[:, 0]
    assert torch.allclose(centred.mean(0), torch.zeros(centred.shape[1]), atol=1e-5)  # two instructions: +-d
    assert float((centred ** 2).sum(-1).mean()) == pytest.approx(1.0, rel=1e-4)
    raw = torch.nn.functional.cosine_similarity(feats[0, 0], feats[1, 0], dim=0)
    assert float(torch.nn.functional.cosine_similarity(centred[0], centred[1], dim=0)) < float(raw)
    with pytest.raises(ValueError, match="lang_norm needs the training instructions"):
        policies.make_policy(PolicyConfig(kind="flow", state_dim=6, action_dim=3, lang_norm=True)).fit_normalizer(
            np.zeros((2, 6)), np.zeros((2, 3)))


def test_guidance_reads_the_policys_action_variance(tmp_path):
    """Min-max normalized actions do not have unit variance: coupled guidance's Sigma_t takes the
    variance the normalizer measured (uniform actions: ~1/3 per dimension), and a checkpoint
    written before that buffer existed still loads, falling back to s2 = 1."""
    import guidance
    from safetensors.torch import load_file, save_file
    p = _tiny("flow")
    var = p.normalizer.action_variance()
    assert var is not None and torch.all((var > 0.2) & (var < 0.45))
    batch = p.obs_to_batch(OBS)
    guide = guidance.make("coupled", cost=guidance.costs.LimitCost(-0.1, 0.1), scale=1.0, sigma="independent")
    with torch.no_grad():
        _, st = p.sample_chunks(batch, guide=guide, return_stats=True)
    assert st.s2_source == "model" and st.s2 == pytest.approx(float(var.mean()))
    p.save(tmp_path / "ckpt")
    w = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    save_file({k: v for k, v in w.items() if k != "normalizer.action_var"}, str(tmp_path / "ckpt" / "model.safetensors"))
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del meta["sha256"], meta["config_sha256"]  # such checkpoints also predate the weights' and config's digests
    meta["version"] = 1
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(meta))
    q = policies.load(tmp_path / "ckpt")
    assert q.normalizer.action_variance() is None
    with torch.no_grad():
        _, st = q.sample_chunks(batch, guide=guide, return_stats=True)
    assert st.s2_source == "default" and st.s2 == 1.0


def test_flow_sampling_deterministic_given_noise():
    p = _tiny("flow")
    for prm in p.parameters():
        torch.nn.init.normal_(prm, std=0.1)
    batch = p.obs_to_batch(OBS)
    noise = torch.randn(1, 4, 3)
    with torch.no_grad():
        a = p.sample_chunks(batch, noise=noise.clone())
        b = p.sample_chunks(batch, noise=noise.clone())
        c = p.sample_chunks(batch, noise=torch.randn(1, 4, 3))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_ar_chunk_loglik_is_sum_of_token_logprobs():
    p = _tiny("ar")
    for prm in p.parameters():
        torch.nn.init.normal_(prm, std=0.1)
    p.eval()
    batch = p.obs_to_batch(OBS)
    batch["action"] = np.random.default_rng(1).uniform(-1.5, 1.5, (1, 4, 3)).astype(np.float32)
    with torch.no_grad():
        ll = p.log_likelihood(batch)
        tokens = p.tokenize(p.normalizer.action(torch.as_tensor(batch["action"])))
        prefix, pad = p.prefix(batch)
        total = 0.0
        for i in range(tokens.shape[1]):  # one token at a time, from its own prefix
            lg = p.logits(prefix, pad, tokens[:, :i])[:, -1]
            total += torch.log_softmax(lg, -1)[0, tokens[0, i]].item()
    assert ll.item() == pytest.approx(total, abs=1e-3)


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
def test_ar_cached_decoding_matches_teacher_forced_logits(cfg_scale):
    """The KV-cached greedy decoder picks, at every position, the argmax of the full
    (uncached) network's logits given the tokens it decoded before (with CFG mixing)."""
    p = _tiny("ar")
    for prm in p.parameters():
        torch.nn.init.normal_(prm, std=0.1)
    p.eval()
    batch = p.obs_to_batch(OBS)
    batch = {"state": np.repeat(batch["state"], 2, 0), "instruction": ["push the cube", "pick the cube"]}
    with torch.no_grad():
        tokens = p.tokenize(p.sample_chunks(batch, cfg_scale=cfg_scale))
        lg = p.logits(*p.prefix(batch), tokens[:, :-1])
        if cfg_scale != 1.0:
            lu = p.logits(*p.prefix(batch, drop_lang=torch.ones(2, dtype=torch.bool)), tokens[:, :-1])
            lg = lu + cfg_scale * (lg - lu)
    assert torch.equal(lg.argmax(-1), tokens)


def test_select_action_serves_chunk_then_replans():
    p = _tiny("flow", )
    torch.manual_seed(0)
    a0 = p.select_action(OBS)
    assert len(p._queue) == p.config.n_exec - 1
    p.select_action(OBS)
    assert not p._queue
    p.reset()
    assert a0.shape == (3,)


def test_bad_inputs_are_named(tmp_path, push_data):
    p = _tiny("flow")
    with pytest.raises(InstructionError):
        p.predict_action_chunk({**OBS, "instruction": "  "})
    with pytest.raises(PolicyMismatchError, match="state has shape"):
        p.predict_action_chunk({**OBS, "state": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match="n_exec"):
        PolicyConfig(state_dim=3, action_dim=2, horizon=4, n_exec=5)
    import envs
    from train.evaluate import check_compatible
    env = envs.make("maniskill/PushCube-v1")
    with pytest.raises(PolicyMismatchError, match="state/action dims"):
        check_compatible(p, env)
    env.close()
    # resume with a changed config is refused; NaN loss names the batch
    out = tmp_path / "run"
    train(TrainArgs(data=(push_data,), steps=4, batch_size=8, out=out, wandb="disabled", progress=False, save_every=2))
    with pytest.raises(ValueError, match="changed config"):
        train(TrainArgs(data=(push_data,), steps=6, batch_size=8, out=out, wandb="disabled", progress=False,
                        horizon=12, resume=True))
    s = train(TrainArgs(data=(push_data,), steps=6, batch_size=8, out=out, wandb="disabled", progress=False,
                        resume=True))
    assert s["steps"] == 6 and len(s["history"]) == 6
    # a corrupt sensor reading (NaN state) is refused when the data loads, naming the file and the episode
    from dataset import Dataset, DatasetError, DatasetWriter
    src = Dataset(push_data)
    bad = tmp_path / "nan.h5"
    with DatasetWriter(bad, src.env_id, src.state_dim, src.action_dim) as w:
        for i in range(len(src)):
            ep = src.episode(i)
            if i == 1:
                ep.state[3, 0] = np.nan
            w.add(ep)
    with pytest.raises(DatasetError, match=r"nan\.h5: episode 1 has NaN/inf in state"):
        train(TrainArgs(data=(bad,), steps=3, batch_size=8, out=tmp_path / "nan", wandb="disabled", progress=False))


DDP_SCRIPT = """
import json, sys, torch
from pathlib import Path
from train.bc import TrainArgs, train
s = train(TrainArgs(data=(Path(sys.argv[1]),), steps=8, batch_size=16, out=Path(sys.argv[2]), wandb="disabled",
                    progress=False, ema=0.0, warmup_steps=2, save_every=100))
if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
    Path(sys.argv[3]).write_text(json.dumps([h["loss"] for h in s["history"]]))
"""


def test_ddp_two_processes_match_one(push_data, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(script), str(push_data), str(tmp_path / "one"), str(tmp_path / "one.json")],
                   check=True, env=env, cwd=ROOT, timeout=300)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
                    str(script), str(push_data), str(tmp_path / "two"), str(tmp_path / "two.json")],
                   check=True, env=env, cwd=ROOT, timeout=300)
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert len(one) == len(two) == 8
    np.testing.assert_allclose(one, two, rtol=1e-3, atol=1e-4)  # the same loss curve
    a = policies.load(tmp_path / "one" / "ckpt")
    b = policies.load(tmp_path / "two" / "ckpt")
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, atol=2e-4, rtol=1e-3, msg=n)


def test_image_conditioned_training_end_to_end(tmp_path):
    """Camera observations from the simulator -> dataset -> flow policy with a CNN -> actions."""
    import envs
    path = tmp_path / "cam.h5"
    collect(CollectArgs(env="maniskill/PushCube-v1", episodes=2, out=path, seed=0, cameras=("base_camera",),
                        image_size=64, progress=False))
    s = train(TrainArgs(data=(path,), steps=60, batch_size=16, cameras=("base_camera",), image_size=64,
                        out=tmp_path / "run", wandb="disabled", progress=False, warmup_steps=5, lr=1e-3))
    losses = [h["loss"] for h in s["history"]]
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    p = policies.load(tmp_path / "run" / "ckpt")
    assert p.config.cameras == ("base_camera",) and p.vision is not None
    env = envs.make("maniskill/PushCube-v1", cameras=("base_camera",), image_size=64)
    obs, _ = env.reset(seed=9)
    chunk = p.predict_action_chunk(obs)
    assert chunk.shape == (p.config.horizon, 8) and np.all(np.isfinite(chunk))
    with pytest.raises(PolicyMismatchError, match="cameras"):
        p.predict_action_chunk({"state": obs["state"], "instruction": obs["instruction"]})
    env.close()
    with pytest.raises(Exception, match="cameras"):
        train(TrainArgs(data=(path,), steps=2, cameras=("hand_camera",), out=tmp_path / "bad", wandb="disabled",
                        progress=False))


def test_the_collecting_controller_travels_with_the_checkpoint(tmp_path, capsys):
    """Demos collected in another controller (PushCube's scripted expert acts in pd_ee_delta_pos: 4-d actions,
    not the default 8-d joint targets) train a checkpoint that `groundflow eval` runs in that controller;
    a second dataset in another controller is refused, not mixed."""
    from dataset import DatasetError
    from groundflow.cli import main
    ee, joint = tmp_path / "ee.h5", tmp_path / "joint.h5"
    collect(CollectArgs(env="maniskill/PushCube-v1", episodes=2, out=ee, control_mode="pd_ee_delta_pos", progress=False))
    collect(CollectArgs(env="maniskill/PushCube-v1", episodes=1, out=joint, progress=False))
    assert ChunkData(ee, 4).env_options == {"control_mode": "pd_ee_delta_pos"} and ChunkData(ee, 4).action_dim == 4
    with pytest.raises(DatasetError, match="pd_ee_delta_pos"):
        ChunkData([ee, joint], 4)
    train(TrainArgs(data=(ee,), steps=5, batch_size=8, horizon=8, out=tmp_path / "run", wandb="disabled",
                    progress=False))
    assert policies.read_checkpoint_meta(tmp_path / "run" / "ckpt")["extra"]["env_options"] == {
        "control_mode": "pd_ee_delta_pos"}
    assert main(["eval", "--ckpt", str(tmp_path / "run" / "ckpt"), "--episodes", "1",
                 "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["episodes"] == 1


def test_ignored_state_slices_are_not_read(tmp_path, push_data):
    """--ignore-state names slices of the env's state layout (recorded by collect); the policy then
    gives the same chunk whatever those entries hold, and still reads the rest."""
    from dataset import Dataset
    from envs.errors import InvalidOptionError
    layout = Dataset(push_data).meta["state_layout"]
    assert [n for n, _ in layout][:2] == ["agent/qpos", "agent/qvel"]
    out = tmp_path / "novel"
    train(TrainArgs(data=(push_data,), steps=30, batch_size=16, out=out, wandb="disabled", progress=False,
                    ignore_state=("*qvel",)))
    p = policies.load(out / "ckpt")
    nq = layout[0][1]
    assert p.config.state_ignore == tuple(range(nq, nq + layout[1][1]))
    state = Dataset(push_data).episode(0).state[5]
    changed_vel, changed_pos = state.copy(), state.copy()
    changed_vel[nq] += 5.0
    changed_pos[0] += 0.5
    noise = torch.randn(1, p.config.horizon, p.config.action_dim)

    def chunk(s):
        with torch.no_grad():
            return p.sample_chunks({"state": s[None], "instruction": "push the cube to the goal"}, noise=noise)
    assert torch.equal(chunk(state), chunk(changed_vel))
    assert not torch.allclose(chunk(state), chunk(changed_pos))
    with pytest.raises(InvalidOptionError, match="match no slice.*agent/qvel"):
        train(TrainArgs(data=(push_data,), steps=2, out=tmp_path / "typo", wandb="disabled", progress=False,
                        ignore_state=("*velocity",)))


def test_relative_state_reads_positions_relative_to_the_reference(tmp_path, push_data):
    """--relative-state 'SLICES:REF' adds each matching slice's position minus REF's: moving the
    gripper changes them, moving the gripper AND the cube together does not; the statistics travel
    in the checkpoint; a spec naming no slice is refused with the slice names."""
    from dataset import Dataset
    from envs.errors import InvalidOptionError
    names = [n for n, _ in Dataset(push_data).meta["state_layout"]]
    assert names == ["agent/qpos", "agent/qvel", "extra/tcp_pose", "extra/goal_pos", "extra/obj_pose"]
    out = tmp_path / "rel"
    train(TrainArgs(data=(push_data,), steps=30, batch_size=16, out=out, wandb="disabled", progress=False,
                    relative_state=("*_pos*:extra/tcp_pose",)))
    p = policies.load(out / "ckpt")
    assert p.config.state_relative == ((25, 18), (28, 18))  # goal and cube relative to the tcp
    state = torch.as_tensor(Dataset(push_data).episode(0).state[5], dtype=torch.float32)[None]
    x = p.state_input(state)
    assert x.shape == (1, 35 + 6) and torch.isfinite(x).all()
    raw = x[0, -6:] * p.normalizer.relative_std + p.normalizer.relative_mean
    assert torch.allclose(raw[:3], state[0, 25:28] - state[0, 18:21], atol=1e-5)
    moved = state.clone()
    moved[0, 18:21] += 0.1  # the tcp
    assert not torch.allclose(p.state_input(moved)[0, -6:], x[0, -6:])
    moved[0, 25:28] += 0.1  # ... and the goal with it
    assert torch.allclose(p.state_input(moved)[0, -6:-3], x[0, -6:-3], atol=1e-5)
    with pytest.raises(InvalidOptionError, match="no slice 'tcp_pose'.*extra/tcp_pose"):
        train(TrainArgs(data=(push_data,), steps=2, out=tmp_path / "typo", wandb="disabled", progress=False,
                        relative_state=("*obj_pose:tcp_pose",)))
    with pytest.raises(InvalidOptionError, match="SLICES:REF"):
        train(TrainArgs(data=(push_data,), steps=2, out=tmp_path / "typo2", wandb="disabled", progress=False,
                        relative_state=("*obj_pose",)))


def test_ar_smoothed_bin_targets_are_gaussians_on_the_bins():
    p = _tiny("ar", n_bins=16, bin_sigma=0.75)
    q = p.soft_targets(torch.tensor([[0, 7, 15]]))
    assert torch.allclose(q.sum(-1), torch.ones(1, 3))
    assert q[0, 1].argmax() == 7 and torch.allclose(q[0, 1, 6], q[0, 1, 8])  # symmetric around its bin
    assert q[0, 0, 0] > 0.5 and q[0, 2, 15] > 0.5  # the mass beyond the range is spread back over the bins
    with pytest.raises(ValueError, match="bin_sigma"):
        PolicyConfig(kind="ar", state_dim=3, action_dim=2, bin_sigma=-1)
