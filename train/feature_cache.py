"""Frozen pretrained image features computed once per frame, before training (``--vision-cache``).

With ``--vision efficientnet_lite0 --vision-frozen`` the trunk's weights never change, so its
output for a frame is the same at every step; running it on every sampled frame at every step made
a frozen encoder cost as much per step as a fine-tuned one. The cache runs the trunk once per frame
per camera (batched, without autograd), keeps the maps in float16 on the training device, keyed
by ChunkData's frame index, and training batches carry ``image_maps`` in place of ``images``: the
policy feeds them to the trainable part of the encoder (``ImageEncoder.tokens_from_maps``, the same
code live images go through). Nothing of it reaches the checkpoint: at inference the policy runs the
trunk on live images as usual.

Augmentation is refused, not silently dropped: random shift and colour jitter act on pixels before
the trunk, so one map per frame cannot carry them, and a checkpoint whose config records
``image_shift 4`` must have been trained with it (give ``--image-shift 0 --image-jitter 0``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from tqdm import tqdm

from envs.errors import InvalidOptionError
from policies.vision import camera_input

BUILD_BATCH = 256
"""frames per trunk forward while the cache is built"""


def check_cache_options(vision: str, frozen: bool, shift: int, jitter: float, cameras: Sequence[str],
                        estimated: bool, policy: str = "flow") -> None:
    """Refuse ``--vision-cache`` where there is no frozen pretrained trunk to cache, or where pixel
    augmentation would have to act before it (one line each)."""
    if policy == "mlp" or not cameras:
        raise InvalidOptionError("--vision-cache caches image features: it needs an image policy (--cameras, "
                                 "--policy flow or ar)")
    if estimated:
        raise InvalidOptionError("--vision-cache does not apply with --estimate-state: the perception head has "
                                 "its own trainable CNN, no frozen trunk")
    if vision != "efficientnet_lite0" or not frozen:
        raise InvalidOptionError("--vision-cache needs a frozen pretrained backbone: --vision efficientnet_lite0 "
                                 f"--vision-frozen (got --vision {vision}{' --vision-frozen' if frozen else ''})")
    if shift or jitter:
        raise InvalidOptionError(f"--vision-cache cannot augment: --image-shift {shift} and --image-jitter {jitter} "
                                 "act on pixels before the frozen trunk, whose maps are cached once per frame; "
                                 "give --image-shift 0 --image-jitter 0")


@dataclass
class FeatureCache:
    """The frozen trunk's map of every training frame, per camera."""

    maps: dict[str, torch.Tensor]
    """{camera: (N, C, h, w) float16}, row i = ChunkData frame i"""
    seconds: float
    """time the build took"""

    @property
    def megabytes(self) -> float:
        return sum(m.numel() * m.element_size() for m in self.maps.values()) / 2**20

    def stats(self) -> dict[str, Any]:
        """What the run summary records about the cache."""
        m = next(iter(self.maps.values()))
        return {"frames": int(m.shape[0]), "cameras": list(self.maps), "map_shape": list(m.shape[1:]),
                "dtype": str(m.dtype).removeprefix("torch."), "megabytes": round(self.megabytes, 2),
                "build_seconds": round(self.seconds, 2)}

    def attach(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with the cached maps of its frames (``batch['index']``) in place of its images."""
        idx = next(iter(self.maps.values())).new_tensor(np.asarray(batch["index"]), dtype=torch.long)
        out = {k: v for k, v in batch.items() if k != "images"}
        out["image_maps"] = {cam: m[idx] for cam, m in self.maps.items()}
        return out


def build_feature_cache(policy: Any, data: Any, device: torch.device | str, progress: bool = True,
                        batch_size: int = BUILD_BATCH) -> FeatureCache:
    """Run ``policy``'s frozen trunk once over every frame of ``data`` (a ChunkData) per camera."""
    c = policy.config
    check_cache_options(c.vision, c.vision_frozen, c.image_shift, c.image_jitter, c.cameras,
                        bool(c.estimated_state), c.kind)
    enc = getattr(policy, "vision", None)
    if enc is None:
        raise InvalidOptionError(f"--vision-cache: the {c.kind} policy has no image encoder")
    trunk, n = enc.trunk, len(data)
    was_training = trunk.training
    trunk.eval()  # ImageNet batch statistics, as in training (ImageEncoder.train keeps the trunk in eval)
    t0 = time.time()
    maps: dict[str, torch.Tensor] = {}
    bar = tqdm(total=n * len(enc.cameras), desc="cache vision features", unit="frame", disable=not progress)
    with torch.no_grad():  # not inference_mode: its tensors could not be indexed into training batches
        for cam in enc.cameras:
            frames = data.images[cam]
            parts = []
            for s in range(0, n, batch_size):
                x = camera_input(torch.as_tensor(frames[s:s + batch_size], device=device), False, 0, 0.0)
                parts.append(trunk(x).to(torch.float16))
                bar.update(len(x))
            maps[cam] = torch.cat(parts)
    bar.close()
    trunk.train(was_training)
    cache = FeatureCache(maps, time.time() - t0)
    st = cache.stats()
    if progress:
        tqdm.write(f"vision cache: {st['frames']} frames x {len(st['cameras'])} camera(s), maps {st['map_shape']} "
                   f"float16, {st['megabytes']:.1f} MB, built in {st['build_seconds']:.1f} s")
    return cache
