"""Image encoders: the augmentation, the packaged pretrained backbone, and that a policy reads the
answer from pixels when the state does not hold it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import policies
from dataset import Dataset, DatasetWriter, Episode
from policies.vision import ImageEncoder, color_jitter, random_shift
from train.bc import TrainArgs, train


def test_random_shift_translates_with_border_replicated():
    torch.manual_seed(0)
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    assert torch.equal(random_shift(x, 0), x)
    seen = set()
    for _ in range(30):
        y = random_shift(x, 2)
        assert y.shape == x.shape
        for b in range(2):
            # every output pixel is an input pixel of the same channel, at one common offset
            pad = torch.nn.functional.pad(x[b:b + 1], (2,) * 4, mode="replicate")[0]
            hits = [(r, c) for r in range(5) for c in range(5) if torch.equal(pad[:, r:r + 8, c:c + 8], y[b])]
            assert len(hits) == 1
            seen.add(hits[0])
    assert len(seen) > 5  # the offsets vary


def test_color_jitter_scales_brightness_and_tint_within_bounds():
    torch.manual_seed(0)
    x = torch.full((64, 3, 4, 4), 0.0)  # mid grey in [-1, 1]
    assert torch.equal(color_jitter(x, 0.0), x)
    y = (color_jitter(x, 0.5) + 1) / 2  # back to [0, 1]: 0.5 * gain * tint
    ratio = y / 0.5
    assert ratio.min() >= 0.5 * 0.75 - 1e-6 and ratio.max() <= 1.5 * 1.25 + 1e-6
    assert ratio.std() > 0.1  # samples differ
    assert not torch.allclose(ratio[:, 0], ratio[:, 1])  # and channels (tint)


def test_shift_only_in_training_mode():
    enc = ImageEncoder(32, ("cam",), shift=4)
    img = {"cam": torch.randint(0, 255, (4, 32, 32, 3), dtype=torch.uint8)}
    enc.eval()
    assert torch.equal(enc(img), enc(img))
    enc.train()
    torch.manual_seed(1)
    assert not torch.equal(enc(img), enc(img))


def test_pretrained_backbone_loads_packaged_imagenet_weights():
    enc = ImageEncoder(32, ("cam",), backbone="efficientnet_lite0", frozen=True)
    bn = enc.trunk.stem[1]
    # trained batch-norm statistics, not the initial zeros/ones of an untrained network
    assert bn.running_var.std() > 1.0 and bn.running_mean.abs().max() > 0.1
    assert not any(p.requires_grad for p in enc.trunk.parameters())
    enc.train()
    assert not enc.trunk.training  # ImageNet statistics are kept while the head trains
    out = enc({"cam": torch.randint(0, 255, (2, 64, 64, 3), dtype=torch.uint8)})
    assert out.shape == (2, 16, 32)
    tuned = ImageEncoder(32, ("cam",), backbone="efficientnet_lite0")
    tuned({"cam": torch.randint(0, 255, (2, 64, 64, 3), dtype=torch.uint8)}).sum().backward()
    assert tuned.trunk.stem[0].weight.grad is not None


def test_vision_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="vision_frozen needs a pretrained"):
        policies.PolicyConfig(state_dim=3, action_dim=2, cameras=("c",), vision_frozen=True)
    with pytest.raises(ValueError, match="vision must be"):
        policies.PolicyConfig(state_dim=3, action_dim=2, cameras=("c",), vision="resnet")
    with pytest.raises(ValueError, match="aux_state_weight needs cameras and hidden"):
        policies.PolicyConfig(state_dim=3, action_dim=2, cameras=("c",), aux_state_weight=1.0)
    with pytest.raises(ValueError, match="image_jitter"):
        policies.PolicyConfig(state_dim=3, action_dim=2, cameras=("c",), image_jitter=1.5)
    with pytest.raises(ValueError, match="image_pool"):
        policies.PolicyConfig(state_dim=3, action_dim=2, cameras=("c",), image_pool="max")
    with pytest.raises(ValueError, match="image_shift"):
        policies.PolicyConfig(state_dim=3, action_dim=2, cameras=("c",), image_size=16, image_shift=8)


def _square_data(path, n_eps: int = 24, T: int = 8, size: int = 32, seed: int = 0):
    """Each episode shows a bright square left or right; the action is -1 or +1 accordingly. The
    state is [0, side]: its second entry ("object/side") is what an image policy hides."""
    rng = np.random.default_rng(seed)
    with DatasetWriter(path, "synthetic/square", 2, 1, cameras=("cam",),
                       meta={"state_layout": [["robot/zero", 1], ["object/side", 1]]}) as ds:
        for i in range(n_eps):
            side = i % 2
            imgs = np.zeros((T, size, size, 3), np.uint8)
            for t in range(T):
                r = rng.integers(4, size - 12)
                c = rng.integers(2, size // 2 - 10) + side * size // 2
                imgs[t, r:r + 8, c:c + 8] = 255
            state = np.zeros((T, 2), np.float32)
            state[:, 1] = side
            ds.add(Episode(state=state, action=np.full((T, 1), 2.0 * side - 1, np.float32),
                           reward=np.zeros(T), success=np.zeros(T, bool), instruction="go to the square",
                           images={"cam": imgs}))
    return path


@pytest.mark.parametrize("vision,pool,aux", [("cnn", "grid", 0.0), ("cnn", "keypoints", 0.0), ("cnn", "grid", 1.0),
                                             ("efficientnet_lite0", "grid", 0.0)])
def test_policy_reads_the_answer_from_pixels(tmp_path, vision, pool, aux):
    """The state's "object/side" entry is hidden, so only the image can tell the side."""
    path = _square_data(tmp_path / "sq.h5")
    s = train(TrainArgs(data=(path,), steps=150, batch_size=32, horizon=1, n_exec=1, cameras=("cam",), image_size=32,
                        image_shift=2, vision=vision, vision_frozen=vision != "cnn", image_pool=pool,
                        ignore_state=("object/*",), aux_state_weight=aux, out=tmp_path / "run",
                        wandb="disabled", progress=False, lr=1e-3, warmup_steps=10, ema=0.0))
    assert ("loss_aux_state" in s["history"][-1]) == (aux > 0)
    p = policies.load(tmp_path / "run" / "ckpt")
    assert (p.config.vision, p.config.image_pool, p.config.state_ignore) == (vision, pool, (1,))
    test = Dataset(_square_data(tmp_path / "held.h5", n_eps=20, seed=7))
    right = 0
    for i in range(len(test)):
        ep = test.episode(i)
        obs = {"state": ep.state[0], "instruction": ep.instruction, "images": {"cam": ep.images["cam"][0]}}
        p.reset()
        a = p.predict_action_chunk(obs)
        right += np.sign(a[0, 0]) == np.sign(ep.action[0, 0])
        if i < 2:  # the hidden entry is never read at run time, whatever the training loss
            chunks = []
            for side in (ep.state[0, 1], 1.0 - ep.state[0, 1]):
                p.reset()
                torch.manual_seed(0)
                chunks.append(p.predict_action_chunk({**obs, "state": np.array([0.0, side], np.float32)}))
            np.testing.assert_allclose(chunks[0], chunks[1], atol=1e-6)
    assert right >= 17, f"{right}/20 sides right"  # chance: 10


def test_adroit_camera_and_lighting_perturbations_change_images_and_restore():
    import envs
    from envs.perturbations import perturb
    env = envs.make("adroit/door", cameras=("vil_camera",), image_size=32)
    base = env.reset(seed=3)[0]["images"]["vil_camera"].astype(float)
    for fam in ("camera", "lighting"):
        p = perturb(env, fam)
        shifted = p.reset(seed=3)[0]["images"]["vil_camera"].astype(float)
        assert np.abs(shifted - base).mean() > 5, fam  # a visible change, same scene
        p.restore()
        assert np.array_equal(env.reset(seed=3)[0]["images"]["vil_camera"].astype(float), base), fam
    env.close()


def test_checkpoints_from_before_the_trunk_split_still_load():
    enc = ImageEncoder(32, ("cam",)).eval()
    old = {}  # the layout image checkpoints had until Dec 2026: one Sequential "net"
    rename = {"trunk.0": "net.0", "trunk.2": "net.2", "trunk.4": "net.4", "net.1": "net.7"}
    for k, v in enc.state_dict().items():
        mod, _, kind = k.rpartition(".")
        old[f"{rename[mod]}.{kind}" if mod in rename else k] = v.clone()
    fresh = ImageEncoder(32, ("cam",)).eval()
    fresh.load_state_dict(old)
    img = {"cam": torch.randint(0, 255, (2, 32, 32, 3), dtype=torch.uint8)}
    assert torch.equal(fresh(img), enc(img))


def test_evaluation_does_not_depend_on_what_the_process_drew_before():
    """rollout seeds the policy's sampling noise from the episode seed (flow sampling is random)."""
    import envs
    from train.evaluate import rollout
    env = envs.make("adroit/door", max_episode_steps=6)
    p = policies.make_policy(policies.PolicyConfig(state_dim=39, action_dim=28, horizon=2, n_exec=1))
    rng = np.random.default_rng(0)
    p.fit_normalizer(rng.normal(size=(50, 39)).astype(np.float32), rng.normal(size=(50, 28)).astype(np.float32),
                     ["open the door"])
    runs = []
    for draws in (1, 13):
        torch.rand(draws)  # the process's generator is somewhere else each time
        acts: list = []
        rollout(p, env, seed=3, act=lambda o: acts.append(p.select_action(o)) or acts[-1])
        runs.append(np.array(acts))
    env.close()
    assert len(runs[0]) == 6
    np.testing.assert_array_equal(runs[0], runs[1])
