"""A small image flow-matching model of scikit-learn's digits, for image inverse problems.

The digits (1797 grey 8x8 images, shipped inside scikit-learn: nothing is downloaded) are
upsampled bilinearly to ``size`` x ``size`` and mapped to [-1, 1]; a fixed seeded split keeps
``n_test`` images out of training so that guidance is judged on images the model never saw.
``ImageVelocity`` is a two-level UNet with a sinusoidal time embedding (FiLM in every residual
block) that predicts the flow-matching velocity ``u = x1 - x0`` of images ``(B, 1, H, W)``
under the project's convention ``x_t = (1 - t) x0 + t x1`` (data at ``t = 1``).

    train, test = load_digits_split(16)
    model = train_image_flow(ImageFlowConfig(size=16))      # ~minutes on 1 core, then cached
    x = guidance.sample(model, torch.randn(8, 1, 16, 16), 10)

Trained weights are cached as safetensors (+ the JSON config) under ``.assets/image_flow/``,
keyed by a hash of the config, so benchmarks and tests load instead of retraining.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from envs.errors import InvalidOptionError

DEFAULT_CACHE = Path(__file__).resolve().parents[1] / ".assets" / "image_flow"
N_DIGITS = 1797


# ---- data ------------------------------------------------------------------------------------

def load_digits_images(size: int = 16) -> tuple[Tensor, Tensor]:
    """All 1797 digits as float32 ``(N, 1, size, size)`` in [-1, 1], and their labels ``(N,)``.

    ``size`` is 8 (native) or a multiple of 8 (bilinear upsampling, which keeps the range).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 8 or size % 8:
        raise InvalidOptionError(f"size must be 8 or a multiple of 8 (8, 16, 32, ...); got {size!r}")
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float32)[:, None] / 16.0  # [0, 1]
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return (2.0 * x - 1.0).clamp(-1.0, 1.0), torch.as_tensor(d.target, dtype=torch.long)


def split_indices(n_test: int = 300, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Seeded train/test split of the digit indices (disjoint, covering all 1797)."""
    if not 0 < n_test < N_DIGITS:
        raise InvalidOptionError(f"n_test must be between 1 and {N_DIGITS - 1}; got {n_test}")
    perm = torch.randperm(N_DIGITS, generator=torch.Generator().manual_seed(seed))
    return perm[n_test:], perm[:n_test]


def load_digits_split(size: int = 16, n_test: int = 300, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(train, test)`` images of ``load_digits_images(size)`` under ``split_indices``."""
    x, _ = load_digits_images(size)
    tr, te = split_indices(n_test, seed)
    return x[tr], x[te]


# ---- network ---------------------------------------------------------------------------------

def time_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of ``t`` in [0, 1] (scaled by 1000 as in DDPM), shape ``(B, dim)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=t.dtype) / half)
    arg = 1000.0 * t[:, None] * freqs[None]
    return torch.cat([arg.sin(), arg.cos()], dim=1)


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice; the time embedding scales and shifts the middle (FiLM)."""

    def __init__(self, c_in: int, c_out: int, t_dim: int, groups: int = 8) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(min(groups, c_in), c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.film = nn.Linear(t_dim, 2 * c_out)
        self.norm2 = nn.GroupNorm(min(groups, c_out), c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()
        nn.init.zeros_(self.conv2.weight)  # each block starts as the identity
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.film(temb)[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        return self.skip(x) + self.conv2(F.silu(h))


class ImageVelocity(nn.Module):
    """Two-level UNet velocity ``v(x_t, t)`` for images ``(B, C, H, W)``.

    ``patch`` > 1 folds ``patch x patch`` pixel blocks into channels first (lossless
    pixel-unshuffle, like a ViT patch) and unfolds them at the end: the digits are 8x8 images
    upsampled, so the 16x16 model runs its convolutions on an 8x8 grid at a quarter of the cost.
    H and W must be divisible by ``4 * patch``.
    """

    def __init__(self, channels: int = 1, base: int = 32, t_dim: int = 64, patch: int = 1) -> None:
        super().__init__()
        if patch < 1 or base % 8:
            raise InvalidOptionError(f"need patch >= 1 and base a multiple of 8; got patch={patch}, base={base}")
        c1, c2 = base, 2 * base
        self.t_dim, self.patch, self.channels = t_dim, patch, channels
        self.unshuffle, self.shuffle = nn.PixelUnshuffle(patch), nn.PixelShuffle(patch)
        channels = channels * patch * patch
        self.t_mlp = nn.Sequential(nn.Linear(t_dim, 2 * t_dim), nn.SiLU(), nn.Linear(2 * t_dim, 2 * t_dim))
        td = 2 * t_dim
        self.inp = nn.Conv2d(channels, c1, 3, padding=1)
        self.enc1 = ResBlock(c1, c1, td)
        self.down1 = nn.Conv2d(c1, c2, 3, stride=2, padding=1)
        self.enc2 = ResBlock(c2, c2, td)
        self.down2 = nn.Conv2d(c2, c2, 3, stride=2, padding=1)
        self.mid1 = ResBlock(c2, c2, td)
        self.mid2 = ResBlock(c2, c2, td)
        self.up2 = nn.ConvTranspose2d(c2, c2, 4, stride=2, padding=1)
        self.dec2 = ResBlock(2 * c2, c2, td)
        self.up1 = nn.ConvTranspose2d(c2, c1, 4, stride=2, padding=1)
        self.dec1 = ResBlock(2 * c1, c1, td)
        self.out_norm = nn.GroupNorm(8, c1)
        self.out = nn.Conv2d(c1, channels, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        m = 4 * self.patch
        if x.ndim != 4 or x.shape[1] != self.channels or x.shape[-1] % m or x.shape[-2] % m:
            raise InvalidOptionError(f"ImageVelocity takes images (B, {self.channels}, H, W) with H, W "
                                     f"divisible by {m}; got {tuple(x.shape)}")
        temb = self.t_mlp(time_embedding(t.to(x.dtype), self.t_dim))
        h1 = self.enc1(self.inp(self.unshuffle(x)), temb)
        h2 = self.enc2(self.down1(h1), temb)
        h = self.mid2(self.mid1(self.down2(h2), temb), temb)
        h = self.dec2(torch.cat([self.up2(h), h2], 1), temb)
        h = self.dec1(torch.cat([self.up1(h), h1], 1), temb)
        return self.shuffle(self.out(F.silu(self.out_norm(h))))


# ---- training --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageFlowConfig:
    """Everything that determines the trained weights (and so the cache key)."""

    size: int = 16
    """image side (8 or a multiple of 8)"""
    base: int = 32
    """UNet width at the top level (2x at the lower levels)"""
    patch: int = 2
    """pixel blocks folded into channels before the UNet (size must be divisible by 4 * patch)"""
    steps: int = 2000
    """optimizer steps"""
    batch: int = 64
    """images per step"""
    lr: float = 2e-3
    """peak learning rate (one-cycle schedule)"""
    ema: float = 0.999
    """EMA decay of the weights that are returned (0 = last iterate)"""
    n_test: int = 300
    """digits held out of training (``split_indices``)"""
    seed: int = 0
    """seeds the split, the initialization, the batches, noise and times"""

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def _freeze(model: ImageVelocity) -> ImageVelocity:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def cache_path(cfg: ImageFlowConfig, cache_dir: Path | str = DEFAULT_CACHE) -> Path:
    return Path(cache_dir) / f"digits{cfg.size}-{cfg.key()}.safetensors"


def train_image_flow(cfg: ImageFlowConfig | None = None, cache_dir: Path | str | None = DEFAULT_CACHE,
                     progress: bool = True, log: Callable[[str], None] | None = None) -> ImageVelocity:
    """Train (or load from the cache) the digits flow model; returns it frozen in eval mode.

    The loss is plain conditional flow matching, ``|v(x_t, t) - (x1 - x0)|^2`` with independent
    noise and ``t ~ U[0, 1]``. ``cache_dir=None`` trains without reading or writing a cache.
    Training time and final loss are stored in the JSON next to the weights.
    """
    cfg = cfg or ImageFlowConfig()
    if cfg.steps < 1 or cfg.batch < 1 or not cfg.lr > 0 or not 0.0 <= cfg.ema < 1.0:
        raise InvalidOptionError(f"need steps >= 1, batch >= 1, lr > 0 and 0 <= ema < 1; got {cfg}")
    torch.manual_seed(cfg.seed)
    model = ImageVelocity(1, cfg.base, patch=cfg.patch)
    path = None
    if cache_dir is not None:
        path = cache_path(cfg, cache_dir)
        if path.exists():
            from safetensors.torch import load_file
            model.load_state_dict(load_file(str(path)))
            return _freeze(model)
    train, _ = load_digits_split(cfg.size, cfg.n_test, cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.05)
    start = time.perf_counter()
    steps = range(cfg.steps)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        steps = bar = tqdm(steps, desc=f"digits{cfg.size} flow", mininterval=2.0, leave=False)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in steps:
        x1 = train[torch.randint(0, train.shape[0], (cfg.batch,), generator=gen)]
        x0 = torch.randn(x1.shape, generator=gen)
        t = torch.rand(cfg.batch, generator=gen)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * x1
        loss = ((model(xt, t) - (x1 - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            decay = min(cfg.ema, (1 + step) / (10 + step))  # warm-up: early EMA follows the weights
            for k, v in model.state_dict().items():
                if v.dtype.is_floating_point:
                    ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
                else:
                    ema[k].copy_(v)
        if bar is not None and step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if log and (step + 1) % 1000 == 0:
            log(f"  digits{cfg.size}: step {step + 1}/{cfg.steps} loss {loss.item():.4f} "
                f"({time.perf_counter() - start:.0f}s)")
    if bar is not None:
        bar.close()
    if cfg.ema > 0:
        model.load_state_dict(ema)
    info = {"config": asdict(cfg), "train_time_s": time.perf_counter() - start,
            "final_loss": float(loss.detach()), "n_params": sum(p.numel() for p in model.parameters()),
            "n_train": int(train.shape[0]), "threads": torch.get_num_threads()}
    if path is not None:
        from safetensors.torch import save_file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
        meta = path.with_suffix(".json")
        tmp_meta = meta.with_suffix(f".json.tmp{os.getpid()}")
        tmp_meta.write_text(json.dumps(info, indent=1))
        tmp_meta.replace(meta)
        tmp.replace(path)
    return _freeze(model)


# ---- metrics ---------------------------------------------------------------------------------

def psnr(x: Tensor, ref: Tensor, data_range: float = 2.0) -> Tensor:
    """Peak signal-to-noise ratio per image, ``10 log10(L^2 / MSE)`` dB, shape ``(B,)``.

    ``data_range`` L is 2 for images in [-1, 1] (the same number as L = 1 on [0, 1]); identical
    images give ``inf``.
    """
    _check_pair(x, ref)
    mse = ((x.double() - ref.double()) ** 2).flatten(1).mean(1)
    return (10.0 * torch.log10(data_range ** 2 / mse)).float()


def gaussian_window(size: int = 11, sigma: float = 1.5) -> Tensor:
    """Normalized 2-D Gaussian window ``(size, size)`` (float64)."""
    ax = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-ax ** 2 / (2 * sigma ** 2))
    w = g[:, None] * g[None, :]
    return w / w.sum()


def ssim(x: Tensor, ref: Tensor, data_range: float = 2.0, win_size: int = 11, sigma: float = 1.5,
         k1: float = 0.01, k2: float = 0.03) -> Tensor:
    """Structural similarity (Wang et al. 2004) per image, shape ``(B,)``, averaged over channels.

    Local means, variances and covariance under a ``win_size`` Gaussian window (std ``sigma``;
    the paper's 11 / 1.5), ``SSIM = (2 mu_x mu_y + C1)(2 s_xy + C2) / ((mu_x^2 + mu_y^2 + C1)
    (s_x^2 + s_y^2 + C2))`` with ``C_i = (k_i L)^2``, averaged over the positions where the window
    fits inside the image (no padding, as in the paper's reference code).
    """
    _check_pair(x, ref)
    if x.ndim != 4:
        raise InvalidOptionError(f"ssim takes images (B, C, H, W); got {tuple(x.shape)}")
    if win_size % 2 == 0 or win_size > min(x.shape[-2:]):
        raise InvalidOptionError(f"win_size must be odd and fit the image {tuple(x.shape[-2:])}; got {win_size}")
    b, c, h, w = x.shape
    win = gaussian_window(win_size, sigma).to(x.device)[None, None]
    xx = x.double().reshape(b * c, 1, h, w)
    yy = ref.double().reshape(b * c, 1, h, w)
    filt = lambda z: F.conv2d(z, win)  # noqa: E731
    mx, my = filt(xx), filt(yy)
    sxx = filt(xx * xx) - mx * mx
    syy = filt(yy * yy) - my * my
    sxy = filt(xx * yy) - mx * my
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    smap = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return smap.reshape(b, c, -1).mean(-1).mean(1).float()


def _check_pair(x: Tensor, ref: Tensor) -> None:
    if x.shape != ref.shape or x.ndim < 2:
        raise InvalidOptionError(f"metrics compare batches of equal shape (B, ...); got {tuple(x.shape)} "
                                 f"and {tuple(ref.shape)}")


def training_info(cfg: ImageFlowConfig, cache_dir: Path | str = DEFAULT_CACHE) -> dict | None:
    """What the cached training run recorded (time, loss, parameters), or None if not cached."""
    meta = cache_path(cfg, cache_dir).with_suffix(".json")
    return json.loads(meta.read_text()) if meta.exists() else None


__all__ = ["ImageVelocity", "ImageFlowConfig", "train_image_flow", "training_info", "load_digits_images",
           "load_digits_split", "split_indices", "time_embedding", "psnr", "ssim", "gaussian_window",
           "DEFAULT_CACHE"]
