"""Guidance costs: ``c(x) -> (B,)`` in nats, batched and differentiable.

Guidance tilts the model's distribution by ``exp(-scale * c(x))``, so a cost is a negative
log-likelihood: one nat more cost means ``e`` times less probability at scale 1. Each cost
documents the units of its parameters and checks the per-sample shape of ``x`` (an action chunk
``(H, A)``, a state ``(D,)``, an image ``(C, H, W)``) before it is used; a mismatch raises
``InvalidOptionError`` (a ``ValueError``) naming both shapes.

Costs compose: ``cost_a + cost_b``, ``2.0 * cost``. Hard equality constraints (a committed chunk
prefix, observed pixels) are ``Projection``s, exposed by ``PrefixCost.projection`` and
``MeasurementCost.projection``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from envs.errors import InvalidOptionError
from guidance.geometry import Box, Capsule, Obstacle, Sphere, safe_norm
from guidance.operators import Blur, Downsample, InpaintMask

Shape = tuple[int, ...]


def _param(value, name: str) -> Tensor:
    try:
        return torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise InvalidOptionError(f"{name} must be a number or tensor; got {type(value).__name__}") from e


def _positive(value: float, name: str) -> float:
    value = float(value)
    if not value > 0:
        raise InvalidOptionError(f"{name} must be > 0; got {value}")
    return value


def _per_sample(param: Tensor, x: Tensor, event_ndim: int, name: str) -> Tensor:
    """Broadcast a shared ``event`` or per-sample ``(B, *event)`` parameter against ``x``."""
    param = param.to(x.device, x.dtype)
    if param.ndim == event_ndim:
        return param.unsqueeze(0)
    if param.shape[0] not in (1, x.shape[0]):
        raise InvalidOptionError(f"{name} holds {param.shape[0]} per-sample values but the batch "
                                 f"has {x.shape[0]} samples (x {tuple(x.shape)})")
    return param


class Cost:
    """Base class. Subclasses implement ``evaluate`` and may narrow ``check``."""

    name = "cost"
    #: expected per-sample shape; ``None`` entries match any size; ``None`` itself matches anything
    event_shape: tuple[int | None, ...] | None = None

    def check(self, event_shape: Shape) -> None:
        """Raise if this cost cannot score samples of per-sample shape ``event_shape``."""
        want = self.event_shape
        if want is None:
            return
        if len(want) != len(event_shape) or any(w is not None and w != g
                                                for w, g in zip(want, event_shape)):
            shown = tuple("*" if w is None else w for w in want)
            raise InvalidOptionError(f"cost {self.name!r} expects per-sample shape {shown} but the "
                                     f"samples have per-sample shape {tuple(event_shape)}")

    def evaluate(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, x: Tensor) -> Tensor:
        if x.ndim < 2:
            raise InvalidOptionError(f"cost {self.name!r} takes a batch (B, ...); got shape {tuple(x.shape)}")
        self.check(tuple(x.shape[1:]))
        c = self.evaluate(x)
        if c.shape != (x.shape[0],):
            raise InvalidOptionError(f"cost {self.name!r} returned shape {tuple(c.shape)}; a cost must "
                                     f"return one value per sample, shape ({x.shape[0]},)")
        return c

    def __add__(self, other: "Cost") -> "Cost":
        return SumCost([self, as_cost(other)])

    def __mul__(self, factor: float) -> "Cost":
        return ScaledCost(self, float(factor))

    __rmul__ = __mul__


class FunctionCost(Cost):
    """Wrap a plain function ``f(x) -> (B,)`` (nats) as a cost."""

    def __init__(self, fn: Callable[[Tensor], Tensor], name: str = "function") -> None:
        self.fn, self.name = fn, name

    def evaluate(self, x: Tensor) -> Tensor:
        return self.fn(x)


class SumCost(Cost):
    name = "sum"

    def __init__(self, costs: Sequence[Cost]) -> None:
        self.costs = list(costs)

    def check(self, event_shape: Shape) -> None:
        for c in self.costs:
            c.check(event_shape)

    def evaluate(self, x: Tensor) -> Tensor:
        return sum(c.evaluate(x) for c in self.costs)


class ScaledCost(Cost):
    name = "scaled"

    def __init__(self, cost: Cost, factor: float) -> None:
        self.cost, self.factor = cost, factor

    def check(self, event_shape: Shape) -> None:
        self.cost.check(event_shape)

    def evaluate(self, x: Tensor) -> Tensor:
        return self.factor * self.cost.evaluate(x)


def as_cost(cost) -> Cost:
    """A ``Cost`` from a ``Cost`` or a callable ``f(x) -> (B,)``."""
    if isinstance(cost, Cost):
        return cost
    if callable(cost):
        return FunctionCost(cost, getattr(cost, "__name__", "function"))
    raise InvalidOptionError(f"a cost must be a guidance.costs.Cost or a callable x -> (B,); "
                             f"got {type(cost).__name__} (build named costs with make_cost; "
                             f"valid names: {', '.join(COSTS)})")


# ---- generic costs on x itself ---------------------------------------------------------------

class LinearCost(Cost):
    """``c = <direction, x> + offset`` (nats; direction in nats per unit of x).

    Tilting by ``exp(-c)`` shifts a Gaussian's mean by ``-Sigma direction``: the case where
    Coupled Guidance's linear step is exact.
    """

    name = "linear"

    def __init__(self, direction: Tensor, offset: float = 0.0) -> None:
        self.direction = _param(direction, "LinearCost.direction")
        self.offset = float(offset)
        self.event_shape = tuple(self.direction.shape)

    def evaluate(self, x: Tensor) -> Tensor:
        a = self.direction.to(x.device, x.dtype)
        return (x * a).flatten(1).sum(1) + self.offset


class QuadraticCost(Cost):
    """``c = 0.5 * sum precision * (x - center)^2`` (precision in nats per unit^2)."""

    name = "quadratic"

    def __init__(self, center: Tensor, precision: float | Tensor = 1.0) -> None:
        self.center = _param(center, "QuadraticCost.center")
        self.precision = _param(precision, "QuadraticCost.precision")
        if not bool((self.precision >= 0).all()):
            raise InvalidOptionError("QuadraticCost.precision must be >= 0")
        self.event_shape = tuple(self.center.shape)

    def evaluate(self, x: Tensor) -> Tensor:
        d = x - self.center.to(x.device, x.dtype)
        return 0.5 * (self.precision.to(x.device, x.dtype) * d * d).flatten(1).sum(1)


class BallCost(Cost):
    """Keep ``x`` (a state, shape ``(D,)``) out of a ball: ``weight * relu(margin - sd)^2``.

    ``sd = |x - center| - radius`` (units of x), weight in nats per unit^2 of penetration.
    The state-space twin of ``ObstacleCost``, used by the exact testbed.
    """

    name = "ball"

    def __init__(self, center: Tensor, radius: float, weight: float = 10.0, margin: float = 0.0) -> None:
        self.center = _param(center, "BallCost.center")
        if self.center.ndim != 1:
            raise InvalidOptionError(f"BallCost.center must be (D,); got {tuple(self.center.shape)}")
        self.radius = _positive(radius, "BallCost.radius")
        self.weight = _positive(weight, "BallCost.weight")
        self.margin = float(margin)
        self.event_shape = tuple(self.center.shape)

    def evaluate(self, x: Tensor) -> Tensor:
        sd = safe_norm(x - self.center.to(x.device, x.dtype)) - self.radius
        return self.weight * torch.relu(self.margin - sd) ** 2


# ---- action-chunk costs ----------------------------------------------------------------------

class EEPath:
    """End-effector points implied by a chunk of Cartesian delta actions.

    ``points[h] = start + step_size * sum_{i<=h} chunk[i, dims]``: ``start`` (3,) or (B, 3) in
    metres, ``step_size`` metres per unit of normalized action (the controller's delta scale).
    Maps ``(B, H, A) -> (B, H, 3)``.
    """

    def __init__(self, start: Tensor, step_size: float, dims: Sequence[int] = (0, 1, 2)) -> None:
        self.start = _param(start, "EEPath.start")
        if self.start.shape[-1:] != (3,) or self.start.ndim not in (1, 2):
            raise InvalidOptionError(f"EEPath.start must be (3,) or (B, 3); got {tuple(self.start.shape)}")
        self.step_size = _positive(step_size, "EEPath.step_size")
        self.dims = [int(d) for d in dims]
        if len(self.dims) != 3:
            raise InvalidOptionError(f"EEPath.dims must name 3 action dims (x, y, z); got {dims}")

    def check(self, event_shape: Shape) -> None:
        if len(event_shape) != 2 or max(self.dims) >= event_shape[1]:
            raise InvalidOptionError(f"EEPath reads action dims {self.dims} of a chunk (H, A) but the "
                                     f"samples have per-sample shape {tuple(event_shape)}")

    def __call__(self, chunk: Tensor) -> Tensor:
        deltas = chunk[..., self.dims] * self.step_size
        return _per_sample(self.start, chunk, 1, "EEPath.start")[:, None, :] + deltas.cumsum(1)


class _PathCost(Cost):
    def __init__(self, path_fn: Callable[[Tensor], Tensor]) -> None:
        self.path_fn = path_fn

    def check(self, event_shape: Shape) -> None:
        if hasattr(self.path_fn, "check"):
            self.path_fn.check(event_shape)
        elif len(event_shape) != 2:
            raise InvalidOptionError(f"cost {self.name!r} expects an action chunk (H, A); got "
                                     f"per-sample shape {tuple(event_shape)}")

    def points(self, x: Tensor) -> Tensor:
        p = self.path_fn(x)
        if p.ndim != 3 or p.shape[0] != x.shape[0] or p.shape[-1] != 3:
            raise InvalidOptionError(f"path_fn must map chunks {tuple(x.shape)} to points (B, H, 3); "
                                     f"got {tuple(p.shape)}")
        return p


class ObstacleCost(_PathCost):
    """Obstacle avoidance on the end-effector path: ``weight * sum_{h,o} relu(margin - sd)^2``.

    ``sd`` is the signed distance (metres) of path point ``h`` to obstacle ``o`` (Sphere, Box,
    Capsule from ``guidance.geometry``); ``margin`` metres of clearance; ``weight`` in nats per
    m^2 of penetration (1e4: 5 cm inside the margin costs 25 nats).
    """

    name = "obstacle"

    def __init__(self, path_fn: Callable[[Tensor], Tensor], obstacles: Sequence[Obstacle],
                 margin: float = 0.02, weight: float = 1e4) -> None:
        super().__init__(path_fn)
        self.obstacles = list(obstacles)
        if not self.obstacles or not all(isinstance(o, (Sphere, Box, Capsule)) for o in self.obstacles):
            raise InvalidOptionError("ObstacleCost.obstacles must be a non-empty list of Sphere, Box "
                                     "or Capsule")
        self.margin = float(margin)
        self.weight = _positive(weight, "ObstacleCost.weight")

    def evaluate(self, x: Tensor) -> Tensor:
        p = self.points(x)
        c = sum((torch.relu(self.margin - o.sdf(p)) ** 2).sum(1) for o in self.obstacles)
        return self.weight * c

    def clearance(self, x: Tensor) -> Tensor:
        """(B,) metres: the smallest signed distance of any path point to any obstacle (< 0: inside
        one). The hard check a chunk must pass before it is sent, independent of the margin."""
        p = self.points(x)
        return torch.stack([o.sdf(p).amin(1) for o in self.obstacles]).amin(0)


class GoalCost(_PathCost):
    """Goal reaching: ``weight * |p_H - goal|^2``, goal (3,) or (B, 3) metres, weight nats/m^2."""

    name = "goal"

    def __init__(self, path_fn: Callable[[Tensor], Tensor], goal: Tensor, weight: float = 100.0) -> None:
        super().__init__(path_fn)
        self.goal = _param(goal, "GoalCost.goal")
        self.weight = _positive(weight, "GoalCost.weight")

    def evaluate(self, x: Tensor) -> Tensor:
        end = self.points(x)[:, -1]
        d = end - _per_sample(self.goal, end, 1, "GoalCost.goal")
        return self.weight * (d * d).sum(-1)


class LimitCost(Cost):
    """Box limits: ``weight * sum relu(v - high)^2 + relu(low - v)^2`` with ``v = fn(x)`` or ``x``.

    Joint limits on a chunk (low/high of shape (A,) in action units) or workspace limits on the
    end-effector path (``fn=EEPath(...)``, low/high (3,) metres). Weight in nats per unit^2.
    """

    name = "limits"

    def __init__(self, low, high, weight: float = 100.0,
                 fn: Callable[[Tensor], Tensor] | None = None) -> None:
        self.low, self.high = _param(low, "LimitCost.low"), _param(high, "LimitCost.high")
        try:
            ok = bool((self.low < self.high).all())
        except RuntimeError as e:
            raise InvalidOptionError(f"LimitCost low {tuple(self.low.shape)} and high "
                                     f"{tuple(self.high.shape)} do not broadcast") from e
        if not ok:
            raise InvalidOptionError("LimitCost needs low < high in every dimension")
        self.weight = _positive(weight, "LimitCost.weight")
        self.fn = fn

    def check(self, event_shape: Shape) -> None:
        if self.fn is not None and hasattr(self.fn, "check"):
            self.fn.check(event_shape)
            return
        if self.fn is None:
            bshape = torch.broadcast_shapes(self.low.shape, self.high.shape)
            try:
                out = torch.broadcast_shapes(bshape, tuple(event_shape))
            except RuntimeError:
                out = None
            if out != tuple(event_shape):
                raise InvalidOptionError(f"limits of shape {tuple(bshape)} do not fit samples of "
                                         f"per-sample shape {tuple(event_shape)}")

    def evaluate(self, x: Tensor) -> Tensor:
        v = self.fn(x) if self.fn is not None else x
        lo, hi = self.low.to(v.device, v.dtype), self.high.to(v.device, v.dtype)
        pen = torch.relu(v - hi) ** 2 + torch.relu(lo - v) ** 2
        return self.weight * pen.flatten(1).sum(1)


class Projection:
    """Hard equality constraint ``x[mask] = values``, applied exactly.

    ``mask`` has the per-sample shape; ``values`` the per-sample shape or ``(B, *shape)``.
    """

    def __init__(self, mask: Tensor, values: Tensor) -> None:
        self.mask = torch.as_tensor(mask).bool()
        self.values = _param(values, "Projection.values")
        if tuple(self.values.shape[-self.mask.ndim:]) != tuple(self.mask.shape) or \
                self.values.ndim not in (self.mask.ndim, self.mask.ndim + 1):
            raise InvalidOptionError(f"Projection values shape {tuple(self.values.shape)} does not "
                                     f"match mask shape {tuple(self.mask.shape)}")

    def check(self, event_shape: Shape) -> None:
        if tuple(self.mask.shape) != tuple(event_shape):
            raise InvalidOptionError(f"projection mask shape {tuple(self.mask.shape)} does not match "
                                     f"per-sample shape {tuple(event_shape)}")

    def __call__(self, x: Tensor) -> Tensor:
        values = _per_sample(self.values, x, self.mask.ndim, "Projection.values")
        return torch.where(self.mask.to(x.device), values, x)


class PrefixCost(Cost):
    """Chunk-prefix inpainting (real-time chunking): the first ``k`` steps must equal ``values``.

    ``values`` (k, A) or (B, k, A) in normalized action units; soft form
    ``sum (x[:k] - values)^2 / (2 sigma^2)`` (sigma in action units), hard form ``projection``.
    """

    name = "prefix"

    def __init__(self, values: Tensor, sigma: float = 0.05) -> None:
        self.values = _param(values, "PrefixCost.values")
        if self.values.ndim not in (2, 3):
            raise InvalidOptionError(f"PrefixCost.values must be (k, A) or (B, k, A); got "
                                     f"{tuple(self.values.shape)}")
        self.sigma = _positive(sigma, "PrefixCost.sigma")
        self.k, self.action_dim = self.values.shape[-2:]

    def check(self, event_shape: Shape) -> None:
        if len(event_shape) != 2 or event_shape[1] != self.action_dim or event_shape[0] < self.k:
            raise InvalidOptionError(f"prefix of shape {(self.k, self.action_dim)} does not fit chunks "
                                     f"of per-sample shape {tuple(event_shape)} (need (H >= {self.k}, "
                                     f"{self.action_dim}))")

    def evaluate(self, x: Tensor) -> Tensor:
        y = _per_sample(self.values, x, 2, "PrefixCost.values")
        d = x[:, : self.k] - y
        return (d * d).flatten(1).sum(1) / (2 * self.sigma ** 2)

    def projection(self, event_shape: Shape) -> Projection:
        """The hard constraint for chunks of shape ``(H, A)``."""
        self.check(event_shape)
        h, a = event_shape
        mask = torch.zeros(h, a, dtype=torch.bool)
        mask[: self.k] = True
        pad = torch.zeros(*self.values.shape[:-2], h - self.k, a)
        return Projection(mask, torch.cat([self.values, pad], dim=-2))


class MeasurementCost(Cost):
    """Image inverse problem with Gaussian noise: ``||A(x) - y||^2 / (2 sigma^2)`` nats.

    ``operator`` from ``guidance.operators`` (InpaintMask, Downsample, Blur); ``y`` the
    measurement, per-sample shape ``A``'s output or ``(B, ...)``; ``sigma`` the noise std in
    pixel units of the model's normalized images.
    """

    name = "measurement"

    def __init__(self, operator, y: Tensor, sigma: float = 0.05) -> None:
        self.operator = operator
        self.y = _param(y, "MeasurementCost.y")
        self.sigma = _positive(sigma, "MeasurementCost.sigma")
        self.name = getattr(operator, "name", "measurement")

    def check(self, event_shape: Shape) -> None:
        out = self.operator.output_shape(tuple(event_shape))
        if tuple(self.y.shape[-len(out):]) != out or self.y.ndim not in (len(out), len(out) + 1):
            raise InvalidOptionError(f"measurement y of shape {tuple(self.y.shape)} does not match "
                                     f"the operator output {out} for images of per-sample shape "
                                     f"{tuple(event_shape)}")

    def evaluate(self, x: Tensor) -> Tensor:
        r = self.operator(x) - _per_sample(self.y, x, 3, "MeasurementCost.y")
        return (r * r).flatten(1).sum(1) / (2 * self.sigma ** 2)

    def projection(self, event_shape: Shape) -> Projection:
        """Noise-free inpainting: observed pixels set exactly to ``y``."""
        if not isinstance(self.operator, InpaintMask):
            raise InvalidOptionError(f"only inpainting has an exact projection; operator is "
                                     f"{type(self.operator).__name__}")
        self.check(event_shape)
        mask = self.operator.mask.expand(*event_shape).bool()
        values = self.y * self.operator.mask
        return Projection(mask, values.expand(*self.y.shape[:-3], *event_shape))


def inpainting(mask: Tensor, y: Tensor, sigma: float = 0.05) -> MeasurementCost:
    return MeasurementCost(InpaintMask(mask), y, sigma)


def super_resolution(y: Tensor, factor: int, sigma: float = 0.05) -> MeasurementCost:
    return MeasurementCost(Downsample(factor), y, sigma)


def deblurring(y: Tensor, sigma: float = 0.05, kernel: Tensor | None = None,
               blur_sigma: float | None = None) -> MeasurementCost:
    return MeasurementCost(Blur(kernel=kernel, sigma=blur_sigma), y, sigma)


COSTS: dict[str, Callable[..., Cost]] = {
    "linear": LinearCost, "quadratic": QuadraticCost, "ball": BallCost, "obstacle": ObstacleCost,
    "goal": GoalCost, "limits": LimitCost, "prefix": PrefixCost, "measurement": MeasurementCost,
    "inpainting": inpainting, "super_resolution": super_resolution, "deblurring": deblurring,
}


def make_cost(name: str, **params) -> Cost:
    """Build a cost by name, e.g. ``make_cost("prefix", values=committed, sigma=0.05)``."""
    if name not in COSTS:
        raise InvalidOptionError(f"unknown cost {name!r}; valid costs: {', '.join(COSTS)}")
    return COSTS[name](**params)
