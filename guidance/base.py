"""``Guidance``: the one interface every guidance method implements, and its shared helpers.

A method is one Euler step ``step(velocity, x_t, t, dt) -> x_{t+dt}``. The base class owns what
all methods share: the scale (``w >= 0``), the time window and weighting in which guidance acts,
shape checks of the cost, and the handling of bad gradients (zeroed and counted, optionally
norm-clipped and counted). Where the effective weight is 0 (scale 0, outside the window) every
method takes the plain Euler step, so scale 0 reproduces unguided sampling exactly.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from envs.errors import InvalidOptionError
from guidance.costs import COSTS, Cost, Projection, as_cost, make_cost
from guidance.accounting import SampleStats, VelocityCaller

SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda t: 1.0,
    "linear": lambda t: t,             # grows toward the data end, where x1_hat is sharp
    "linear_down": lambda t: 1.0 - t,  # strongest early, where the mode is chosen
}


def sanitize(g: Tensor, stats: SampleStats, max_norm: float | None = None) -> Tensor:
    """Zero per-sample gradients that hold NaN/inf and clip per-sample norms; count both."""
    flat = g.reshape(g.shape[0], -1)
    bad = ~torch.isfinite(flat).all(1)
    n_bad = int(bad.sum())
    if n_bad:
        stats.n_nonfinite_grad += n_bad
        flat = torch.where(bad[:, None], torch.zeros_like(flat), flat)
    if max_norm is not None:
        flat, n_clip = clip_norm(flat, max_norm)
        stats.n_clipped_grad += n_clip
    return flat.reshape(g.shape)


def clip_norm(flat: Tensor, max_norm: float) -> tuple[Tensor, int]:
    """Scale rows of ``flat`` (B, N) down to norm ``max_norm``; return them and how many were cut."""
    norm = flat.norm(dim=1, keepdim=True)
    over = norm > max_norm
    factor = torch.where(over, max_norm / torch.clamp(norm, min=1e-30), torch.ones_like(norm))
    return flat * factor, int(over.sum())


def noise_stream(x0: Tensor, base_seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded by ``base_seed`` and the caller's noise ``x0``. Noise a method draws
    (fresh DDIM-eta noise, particle candidates) is then fresh on every call and still reproducible
    for the same ``x0``: a policy samples one chunk per call, and a stream that restarts on every
    call gave every chunk the same fresh noise (one-sample calls with renoise 1 had 0.7% of the
    variance of one batched call)."""
    key = int(1e6 * float(x0.detach().reshape(-1)[:64].double().abs().sum())) % (2 ** 31)
    return torch.Generator(device=device).manual_seed(base_seed + key)


def importance_pick(logw: Tensor, gen: torch.Generator) -> Tensor:
    """Index (B,) of the candidate kept per sample, drawn with probability softmax over K of the
    log weights ``logw`` (K, B). NaN weighs 0, +inf dominates; where every weight is 0 the first
    candidate is kept."""
    logw = logw.double().nan_to_num(nan=-float("inf"), posinf=1e300, neginf=-float("inf"))
    dead = torch.isinf(logw).all(0) & (logw < 0).all(0)
    logw[0, dead] = 0.0
    return torch.multinomial(torch.softmax(logw, 0).T.cpu(), 1, generator=gen).squeeze(1).to(logw.device)


class Guidance:
    """Base class: unguided Euler steps where the weight is 0, ``guided_step`` elsewhere.

    Common options: ``scale`` (w >= 0), ``t_start``/``t_end`` (guidance acts for step times
    ``t_start <= t < t_end``), ``schedule`` (weight multiplier: a name from ``SCHEDULES`` or a
    function of t), ``max_grad_norm`` (per-sample gradient norm bound, clips are counted).
    """

    name: ClassVar[str] = "base"
    #: the cost is required (unless a projection replaces it) when the scale is > 0
    uses_cost: ClassVar[bool] = True
    #: whole sampling passes per requested sample; > 1 only for methods that pick among candidates
    n_candidates: int = 1

    def __init__(self, cost: Cost | Callable | str | None = None, scale: float = 1.0, *,
                 t_start: float = 0.0, t_end: float = 1.0, schedule: str | Callable = "constant",
                 max_grad_norm: float | None = None, cost_kwargs: dict | None = None) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise InvalidOptionError(f"scale must be a finite number >= 0; got {scale!r}")
        if scale < 0:
            raise InvalidOptionError(f"scale must be >= 0 (it multiplies the cost; use a negated cost "
                                     f"to reward instead); got {scale}")
        self.scale = float(scale)
        if not 0.0 <= t_start < t_end <= 1.0:
            raise InvalidOptionError(f"need 0 <= t_start < t_end <= 1; got t_start={t_start}, "
                                     f"t_end={t_end}")
        self.t_start, self.t_end = float(t_start), float(t_end)
        if isinstance(schedule, str):
            if schedule not in SCHEDULES:
                raise InvalidOptionError(f"unknown schedule {schedule!r}; valid schedules: "
                                         f"{', '.join(SCHEDULES)} or a function of t")
            schedule = SCHEDULES[schedule]
        elif not callable(schedule):
            raise InvalidOptionError(f"schedule must be a name ({', '.join(SCHEDULES)}) or a function "
                                     f"of t; got {type(schedule).__name__}")
        self.schedule = schedule
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InvalidOptionError(f"max_grad_norm must be > 0 or None; got {max_grad_norm}")
        self.max_grad_norm = max_grad_norm
        if isinstance(cost, str):
            cost = make_cost(cost, **(cost_kwargs or {}))
        elif cost_kwargs:
            raise InvalidOptionError("cost_kwargs only goes with a cost given by name "
                                     f"(valid names: {', '.join(COSTS)})")
        self.cost: Cost | None = None if cost is None else as_cost(cost)
        self._stats: SampleStats | None = None

    # ---- introspection ---------------------------------------------------------------------
    @property
    def needs_network_grad(self) -> bool:
        """True when a step backpropagates through the velocity network."""
        return False

    @classmethod
    def option_names(cls) -> list[str]:
        names: list[str] = []
        for klass in cls.__mro__:
            if "__init__" in vars(klass):
                for p in inspect.signature(klass.__init__).parameters.values():
                    if p.kind is p.KEYWORD_ONLY and p.name not in names:
                        names.append(p.name)
        return names

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale}, cost={getattr(self.cost, 'name', None)})"

    # ---- sampling hooks --------------------------------------------------------------------
    def weight(self, t: float) -> float:
        """Effective guidance weight at step time ``t``."""
        if self.scale == 0.0 or not self.t_start <= t < self.t_end:
            return 0.0
        return self.scale * float(self.schedule(t))

    def begin(self, x0: Tensor, velocity: VelocityCaller) -> None:
        """Check shapes before the first network call; reset per-call state."""
        self._stats = velocity.stats
        if self.uses_cost and self.scale > 0 and self.cost is None and not self._has_projection():
            raise InvalidOptionError(f"guidance {self.name!r} with scale > 0 needs a cost "
                                     f"(guidance.costs, e.g. make_cost(name, ...))")
        if self.cost is not None:
            self.cost.check(tuple(x0.shape[1:]))

    def _has_projection(self) -> bool:
        return False

    def step(self, velocity: VelocityCaller, x: Tensor, t: float, dt: float) -> Tensor:
        w = self.weight(t)
        if w == 0.0:
            return x + dt * velocity(x, t)
        return self.guided_step(velocity, x, t, dt, w)

    def guided_step(self, velocity: VelocityCaller, x: Tensor, t: float, dt: float, w: float) -> Tensor:
        raise NotImplementedError

    def finish(self, x: Tensor) -> Tensor:
        return x

    def candidate_noise(self, x0: Tensor, k: int) -> Tensor:
        """Start noise of candidate ``k >= 1`` (methods with ``n_candidates > 1``)."""
        raise NotImplementedError

    def select(self, candidates: Tensor) -> Tensor:
        """One sample per batch entry from ``candidates`` (n_candidates, B, ...)."""
        return candidates[0]

    # ---- helpers ---------------------------------------------------------------------------
    def cost_grad(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Cost values and sanitized gradient at ``z``, with no graph through the network."""
        assert self.cost is not None and self._stats is not None
        with torch.inference_mode(False), torch.enable_grad():
            zz = z.detach().clone().requires_grad_(True)
            c = self.cost(zz)
            g = torch.autograd.grad(c.sum(), zz)[0] if c.requires_grad else torch.zeros_like(zz)
        self._stats.n_cost_grads += 1
        return c.detach(), sanitize(g, self._stats, self.max_grad_norm)


def resolve_projection(project: Any, event_shape: tuple[int, ...]) -> Projection | None:
    """A ``Projection`` from a Projection, a ``(mask, values)`` pair, or a cost with ``projection``."""
    if project is None or isinstance(project, Projection):
        proj = project
    elif isinstance(project, tuple) and len(project) == 2:
        proj = Projection(*project)
    elif hasattr(project, "projection"):
        proj = project.projection(event_shape)
    else:
        raise InvalidOptionError("project must be a guidance.costs.Projection, a (mask, values) pair, "
                                 f"or a cost with .projection (PrefixCost); got {type(project).__name__}")
    if proj is not None:
        proj.check(event_shape)
    return proj
