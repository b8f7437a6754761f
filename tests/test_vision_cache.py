"""--vision-cache: the frozen pretrained trunk runs once per frame before training, the cached maps
give the tokens live images give, and the checkpoint is a normal frozen-backbone one that acts on
live camera observations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import policies
from envs.errors import InvalidOptionError
from policies import PolicyConfig, make_policy
from train.bc import TrainArgs, train
from train.collect import CollectArgs, collect
from train.data import ChunkData
from train.feature_cache import build_feature_cache

CAM, PX = ("base_camera",), 32
FROZEN = dict(cameras=CAM, image_size=PX, vision="efficientnet_lite0", vision_frozen=True, image_shift=0)


@pytest.fixture(scope="module")
def cam_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("vcache") / "cam.h5"
    collect(CollectArgs(env="maniskill/PushCube-v1", episodes=3, out=path, seed=0, cameras=CAM, image_size=PX,
                        control_mode="pd_ee_delta_pos", progress=False))
    return path


def _args(data, out, **kw) -> TrainArgs:
    base = dict(data=(data,), steps=40, batch_size=16, horizon=8, n_exec=4, out=out, wandb="disabled",
                progress=False, warmup_steps=5, lr=1e-3, save_every=1000, **FROZEN)
    return TrainArgs(**{**base, **kw})


def test_cached_maps_give_the_tokens_of_live_images(cam_data):
    torch.manual_seed(0)
    data = ChunkData(cam_data, 8, CAM, PX)
    cfg = PolicyConfig(state_dim=data.state_dim, action_dim=data.action_dim, horizon=8, n_exec=4,
                       **{k: v for k, v in FROZEN.items() if k != "cameras"}, cameras=CAM)
    policy = make_policy(cfg)
    policy.fit_normalizer(data.state, data.action, data.instructions)
    policy.lang.warm(data.instructions)
    cache = build_feature_cache(policy, data, "cpu", progress=False)
    maps = cache.maps["base_camera"]
    assert maps.dtype == torch.float16 and maps.shape == (len(data), 112, 2, 2)  # stride 16 at 32 px
    assert cache.stats()["megabytes"] == pytest.approx(maps.numel() * 2 / 2**20, abs=0.01)
    batch = data.batch(np.arange(len(data))[::-1].copy())  # any order: keyed by ChunkData's frame index
    cached = cache.attach(batch)
    assert "images" not in cached and set(cached["image_maps"]) == {"base_camera"}
    for mode in (True, False):  # training mode too: with no augmentation it is the same function of the pixels
        policy.train(mode)
        with torch.no_grad():
            live = policy.vision(policy._image_tensors(batch["images"]))
            from_maps = policy.vision.tokens_from_maps(cached["image_maps"])
            assert from_maps.shape == live.shape
            assert torch.allclose(from_maps, live, atol=1e-2), float((from_maps - live).abs().max())
            pre_live, _ = policy.prefix(batch)
            pre_cached, _ = policy.prefix(cached)
            assert torch.allclose(pre_cached, pre_live, atol=1e-2)
    # CIG's flow energies repeat a sample per candidate instruction: the maps are repeated like images
    torch.nn.init.normal_(policy.action_out.weight, std=0.1)  # zero at init: every energy would be equal
    cands = [[s, "push the cube to the left"] for s in batch["instruction"][:6]]
    first = {k: v[:6] for k, v in batch.items() if k != "images"}
    e_live = policy.energies({**first, "images": {c: v[:6] for c, v in batch["images"].items()}}, cands, 2,
                             torch.Generator().manual_seed(0))
    e_cached = policy.energies(cache.attach(first), cands, 2, torch.Generator().manual_seed(0))
    assert not torch.allclose(e_live[:, 0], e_live[:, 1])
    assert torch.allclose(e_cached, e_live, rtol=1e-2, atol=1e-4)


def test_training_on_cached_features_gives_a_normal_frozen_checkpoint(cam_data, tmp_path):
    import envs
    s = train(_args(cam_data, tmp_path / "cached", vision_cache=True))
    losses = [h["loss"] for h in s["history"]]
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    assert s["vision_cache"]["frames"] == len(ChunkData(cam_data, 8)) and s["vision_cache"]["dtype"] == "float16"
    live = train(_args(cam_data, tmp_path / "live", steps=10))
    # the same seed draws the same batches, times and noise: the first losses differ only by float16 rounding
    assert losses[0] == pytest.approx(live["history"][0]["loss"], rel=1e-3)
    print(f"\nfrozen lite0 {PX} px, batch 16, {torch.get_num_threads()} thread(s): "
          f"{s['steps'] / s['seconds']:.1f} steps/s with the cache (built in {s['vision_cache']['build_seconds']:.2f} s, "
          f"{s['vision_cache']['megabytes']:.3f} MB), {live['steps'] / live['seconds']:.1f} steps/s without")
    # the checkpoint is the one a run without the cache writes: same tensors (the trunk included), same config
    w_cached = load_file(tmp_path / "cached" / "ckpt" / "model.safetensors")
    w_live = load_file(tmp_path / "live" / "ckpt" / "model.safetensors")
    assert {k: v.shape for k, v in w_cached.items()} == {k: v.shape for k, v in w_live.items()}
    assert any(k.startswith("vision.trunk.") for k in w_cached)
    for k in w_cached:
        if k.startswith("vision.trunk."):  # frozen: the packaged ImageNet weights, untouched
            assert torch.equal(w_cached[k], w_live[k]), k
    p = policies.load(tmp_path / "cached" / "ckpt")
    assert p.config.vision == "efficientnet_lite0" and p.config.vision_frozen and p.vision is not None
    assert p.config == policies.load(tmp_path / "live" / "ckpt").config
    env = envs.make("maniskill/PushCube-v1", cameras=CAM, image_size=PX, control_mode="pd_ee_delta_pos")
    obs, _ = env.reset(seed=9)
    chunk = p.predict_action_chunk(obs)  # live pixels through the trunk
    assert chunk.shape == (8, 4) and np.all(np.isfinite(chunk))
    env.close()


@pytest.mark.parametrize("bad, match", [
    (dict(vision="cnn", vision_frozen=False), "frozen pretrained backbone"),
    (dict(vision_frozen=False), "frozen pretrained backbone"),
    (dict(image_shift=4), "--image-shift 0"),
    (dict(image_jitter=0.2), "--image-jitter 0"),
    (dict(cameras=()), "image policy"),
    (dict(policy="mlp"), "image policy"),
    (dict(estimate_state=("*_cube_pose[0:3]",)), "--estimate-state"),
])
def test_the_cache_is_refused_where_it_cannot_apply(tmp_path, bad, match):
    """Before any data is read (the data path does not even exist), in one line."""
    with pytest.raises(InvalidOptionError, match=match) as e:
        train(_args(tmp_path / "none.h5", tmp_path / "run", vision_cache=True, **bad))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_continued_checkpoint_is_checked_on_its_own_config(cam_data, tmp_path):
    """--from: the checkpoint's augmentation, not the flags', decides (here its default image shift)."""
    train(_args(cam_data, tmp_path / "first", steps=2, image_shift=4))
    with pytest.raises(InvalidOptionError, match="--image-shift 0"):
        train(_args(cam_data, tmp_path / "second", steps=2, vision_cache=True, init_from=tmp_path / "first" / "ckpt"))
