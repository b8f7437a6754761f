"""Linear measurement operators ``A`` for image inverse problems, images ``(B, C, H, W)``.

Each maps a clean image to what a sensor would measure; ``MeasurementCost`` in ``costs`` turns
``||A(x) - y||^2 / (2 sigma^2)`` into a guidance cost. ``output_shape`` lets a cost check a
measurement ``y`` against the image shape before sampling starts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from envs.errors import InvalidOptionError


def _check_image(shape: tuple[int, ...], who: str) -> None:
    if len(shape) != 3:
        raise InvalidOptionError(f"{who} works on images of per-sample shape (C, H, W); "
                                 f"got per-sample shape {shape}")


class InpaintMask:
    """Observe the pixels where ``mask`` is 1 (mask ``(H, W)`` or ``(C, H, W)``), zero elsewhere."""

    name = "inpainting"

    def __init__(self, mask: Tensor) -> None:
        mask = torch.as_tensor(mask).float()
        if mask.ndim not in (2, 3):
            raise InvalidOptionError(f"InpaintMask.mask must be (H, W) or (C, H, W); got {tuple(mask.shape)}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise InvalidOptionError("InpaintMask.mask must hold only 0 (missing) and 1 (observed)")
        self.mask = mask if mask.ndim == 3 else mask[None]

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        _check_image(shape, "InpaintMask")
        c, h, w = shape
        mc, mh, mw = self.mask.shape
        if (mh, mw) != (h, w) or mc not in (1, c):
            raise InvalidOptionError(f"inpainting mask shape {tuple(self.mask.shape)} does not match "
                                     f"image shape {shape}")
        return shape

    def __call__(self, x: Tensor) -> Tensor:
        return x * self.mask.to(x.device, x.dtype)


class Downsample:
    """Average-pool by an integer ``factor`` (super-resolution's forward model)."""

    name = "super_resolution"

    def __init__(self, factor: int) -> None:
        if int(factor) != factor or factor < 1:
            raise InvalidOptionError(f"Downsample.factor must be a positive integer; got {factor}")
        self.factor = int(factor)

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        _check_image(shape, "Downsample")
        c, h, w = shape
        if h % self.factor or w % self.factor:
            raise InvalidOptionError(f"image shape {shape} is not divisible by the downsampling "
                                     f"factor {self.factor}")
        return (c, h // self.factor, w // self.factor)

    def __call__(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, self.factor)


class Blur:
    """Convolve every channel with a normalized kernel (deblurring's forward model).

    Give ``kernel`` (kh, kw) directly, or a Gaussian ``sigma`` in pixels (size 2*ceil(3 sigma)+1).
    Borders are reflect-padded so the output keeps the image size.
    """

    name = "deblurring"

    def __init__(self, kernel: Tensor | None = None, sigma: float | None = None) -> None:
        if (kernel is None) == (sigma is None):
            raise InvalidOptionError("Blur needs exactly one of kernel=(kh, kw) tensor or sigma=float")
        if kernel is None:
            if not sigma > 0:
                raise InvalidOptionError(f"Blur.sigma must be > 0; got {sigma}")
            r = int(math.ceil(3 * sigma))
            ax = torch.arange(-r, r + 1, dtype=torch.float32)
            g = torch.exp(-ax ** 2 / (2 * sigma ** 2))
            kernel = g[:, None] * g[None, :]
        kernel = torch.as_tensor(kernel, dtype=torch.float32)
        if kernel.ndim != 2 or kernel.shape[0] % 2 == 0 or kernel.shape[1] % 2 == 0:
            raise InvalidOptionError(f"Blur.kernel must be 2-D with odd sides; got {tuple(kernel.shape)}")
        self.kernel = kernel / kernel.sum()

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        _check_image(shape, "Blur")
        kh, kw = self.kernel.shape
        if shape[1] <= kh // 2 or shape[2] <= kw // 2:
            raise InvalidOptionError(f"image shape {shape} is too small for a {kh}x{kw} blur kernel")
        return shape

    def __call__(self, x: Tensor) -> Tensor:
        c = x.shape[1]
        kh, kw = self.kernel.shape
        k = self.kernel.to(x.device, x.dtype).expand(c, 1, kh, kw)
        xp = F.pad(x, (kw // 2, kw // 2, kh // 2, kh // 2), mode="reflect")
        return F.conv2d(xp, k, groups=c)


OPERATORS = {"inpainting": InpaintMask, "super_resolution": Downsample, "deblurring": Blur}
