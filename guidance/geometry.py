"""Signed distances (metres) of points to obstacles, batched and differentiable.

Points are ``(B, H, 3)``; obstacle parameters are either shared ``(3,)`` or per sample
``(B, 3)`` (a policy sees a different scene per observation). Negative inside, positive outside.
Norms are "safe" (clamped before the square root) so a point at a sphere centre or inside a box
gets a finite gradient instead of NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from envs.errors import InvalidOptionError

_EPS2 = 1e-12


def safe_norm(v: Tensor, dim: int = -1) -> Tensor:
    """Euclidean norm whose gradient is finite (zero) at the origin."""
    return torch.sqrt(torch.clamp((v * v).sum(dim), min=_EPS2))


def _as_point(value, name: str) -> Tensor:
    t = torch.as_tensor(value, dtype=torch.float32)
    if t.shape[-1:] != (3,) or t.ndim not in (1, 2):
        raise InvalidOptionError(f"{name} must have shape (3,) or (B, 3); got {tuple(t.shape)}")
    return t


def _bcast(param: Tensor, points: Tensor, name: str) -> Tensor:
    """Shape a (3,) or (B, 3) parameter to broadcast against points (B, H, 3)."""
    param = param.to(points.device, points.dtype)
    if param.ndim == 1:
        return param.view(1, 1, -1)
    if param.shape[0] not in (1, points.shape[0]):
        raise InvalidOptionError(f"{name} has per-sample shape {tuple(param.shape)} but the batch "
                                 f"has {points.shape[0]} samples (points {tuple(points.shape)})")
    return param[:, None, :]


@dataclass
class Sphere:
    """Ball of ``radius`` metres around ``center``."""

    center: Tensor
    radius: float

    def __post_init__(self) -> None:
        self.center = _as_point(self.center, "Sphere.center")
        if not float(self.radius) > 0:
            raise InvalidOptionError(f"Sphere.radius must be > 0; got {self.radius}")

    def sdf(self, p: Tensor) -> Tensor:
        return safe_norm(p - _bcast(self.center, p, "Sphere.center")) - self.radius


@dataclass
class Box:
    """Axis-aligned box: ``center`` and ``half_extents`` (metres, all > 0)."""

    center: Tensor
    half_extents: Tensor

    def __post_init__(self) -> None:
        self.center = _as_point(self.center, "Box.center")
        self.half_extents = _as_point(self.half_extents, "Box.half_extents")
        if not bool((self.half_extents > 0).all()):
            raise InvalidOptionError(f"Box.half_extents must be > 0; got {self.half_extents.tolist()}")

    def sdf(self, p: Tensor) -> Tensor:
        q = (p - _bcast(self.center, p, "Box.center")).abs() - _bcast(self.half_extents, p,
                                                                       "Box.half_extents")
        outside = safe_norm(torch.clamp(q, min=0.0))
        inside = torch.clamp(q.max(dim=-1).values, max=0.0)
        # safe_norm is sqrt(1e-12) = 1e-6 when fully inside; negligible next to mm tolerances.
        return outside + inside


@dataclass
class Capsule:
    """Segment ``a``-``b`` swept by a ball of ``radius`` (a link, a pole, a bar)."""

    a: Tensor
    b: Tensor
    radius: float

    def __post_init__(self) -> None:
        self.a = _as_point(self.a, "Capsule.a")
        self.b = _as_point(self.b, "Capsule.b")
        if not float(self.radius) > 0:
            raise InvalidOptionError(f"Capsule.radius must be > 0; got {self.radius}")

    def sdf(self, p: Tensor) -> Tensor:
        a = _bcast(self.a, p, "Capsule.a")
        ab = _bcast(self.b, p, "Capsule.b") - a
        s = ((p - a) * ab).sum(-1, keepdim=True) / torch.clamp((ab * ab).sum(-1, keepdim=True),
                                                                 min=_EPS2)
        closest = a + torch.clamp(s, 0.0, 1.0) * ab
        return safe_norm(p - closest) - self.radius


Obstacle = Sphere | Box | Capsule
