"""Baseline guidance methods, behind the same interface as Coupled Guidance.

* ``none``: plain Euler sampling.
* ``velocity_gradient`` (DPS-like): ``v - w grad_{x_t} c(x1_hat(x_t))``, backprop through the net.
* ``state_gradient``: ``v - w grad c(x_t)``, the cost read at the noisy state itself.
* ``mc``: Monte-Carlo guidance of Feng et al. 2025 (``g^MC``): the exact guided velocity
  estimated by importance-weighting training data points; needs the data at sampling time.
* ``cfg``: classifier-free guidance, ``v = v_uncond + w (v_cond - v_uncond)``.
* ``particles``: importance-weighted particles at t = 1: ``n_particles`` unguided samples per
  requested one, one kept with probability ``softmax(-w c)`` among them (self-normalized
  importance resampling toward ``p exp(-w c)``): it reweights modes, which a step on one
  trajectory cannot, for n_particles x the network evaluations and no gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from envs.errors import InvalidOptionError
from guidance.base import Guidance, importance_pick, noise_stream, sanitize
from guidance.costs import Cost
from guidance.accounting import VelocityCaller


class NoGuidance(Guidance):
    """Unguided Euler sampling (a cost, if given, is ignored)."""

    name = "none"
    uses_cost = False

    def weight(self, t: float) -> float:
        return 0.0


class VelocityGradientGuidance(Guidance):
    """DPS-like: differentiate the cost of the predicted endpoint w.r.t. the state, through v."""

    name = "velocity_gradient"

    @property
    def needs_network_grad(self) -> bool:
        return self.scale > 0

    def guided_step(self, velocity: VelocityCaller, x: Tensor, t: float, dt: float, w: float) -> Tensor:
        xr = x.detach().requires_grad_(True)
        with torch.inference_mode(False), torch.enable_grad():
            v = velocity(xr, t, grad=True)
            c = self.cost(xr + (1.0 - t) * v)
            g = velocity.backward(c.sum(), xr)
        self._stats.n_cost_grads += 1
        g = sanitize(g, self._stats, self.max_grad_norm)
        return x + dt * (v.detach() - w * g)


class StateGradientGuidance(Guidance):
    """Add ``-w grad c(x_t)`` to the velocity: no network gradient, cost of the noisy state."""

    name = "state_gradient"

    def guided_step(self, velocity: VelocityCaller, x: Tensor, t: float, dt: float, w: float) -> Tensor:
        v = velocity(x, t)
        _, g = self.cost_grad(x)
        return x + dt * (v - w * g)


class MonteCarloGuidance(Guidance):
    """Monte-Carlo guidance (Feng et al. 2025, ``g^MC``), for small dimensions.

    The exact guided velocity is ``E'[x1 | x_t]`` under the tilted data ``p(x1) exp(-w c(x1))``.
    With training samples ``x1_j`` and path likelihood ``p_t(x_t | x1_j) = N(t x1_j, (1-t)^2 I)``,
    ``g = sum_j (beta_j - alpha_j) (x1_j - x_t) / (1 - t)`` with ``alpha ∝ p_t`` and
    ``beta ∝ p_t exp(-w c(x1_j))``; the step uses ``v + g``. Asymptotically exact in the number
    of data points, at the price of a pass over ``data`` (N, *event) per step.
    """

    name = "mc"

    def __init__(self, cost: Cost | Callable | str | None = None, scale: float = 1.0, *,
                 data: Tensor | None = None, chunk_size: int = 512, **common: Any) -> None:
        super().__init__(cost, scale, **common)
        if data is None or not isinstance(data, Tensor) or data.ndim < 2 or data.shape[0] < 1:
            raise InvalidOptionError("mc guidance needs data=Tensor (N, *event) of training samples "
                                     "at sampling time")
        if chunk_size < 1:
            raise InvalidOptionError(f"chunk_size must be >= 1; got {chunk_size}")
        self.data, self.chunk_size = data.detach(), int(chunk_size)
        self._flat: Tensor | None = None
        self._cost_data: Tensor | None = None

    def begin(self, x0: Tensor, velocity: VelocityCaller) -> None:
        super().begin(x0, velocity)
        if tuple(self.data.shape[1:]) != tuple(x0.shape[1:]):
            raise InvalidOptionError(f"mc data has per-sample shape {tuple(self.data.shape[1:])} but the "
                                     f"samples have per-sample shape {tuple(x0.shape[1:])}")
        data = self.data.to(x0.device, x0.dtype)
        self._flat = data.reshape(data.shape[0], -1)
        if self.cost is not None:
            with torch.no_grad():
                c = self.cost(data)
            self._stats.n_cost_evals += 1  # one batched evaluation over all N data points
            c = torch.where(torch.isnan(c), torch.full_like(c, float("inf")), c)
            self._cost_data = c
        else:
            self._cost_data = torch.zeros(data.shape[0], device=x0.device, dtype=x0.dtype)

    def correction(self, x: Tensor, t: float, w: float) -> Tensor:
        """``g^MC`` at x (B, *event)."""
        y, cy = self._flat, self._cost_data
        # log p_t(x | y_j) up to a per-row constant: -(|x|^2 - 2t x.y + t^2 |y|^2) / (2 (1-t)^2)
        scale = 1.0 / (2 * (1.0 - t) ** 2)
        bias = (-t * t * scale) * (y * y).sum(1)
        out = []
        for xc in x.reshape(x.shape[0], -1).split(self.chunk_size):
            logp = torch.addmm(bias[None], xc, y.T, alpha=2 * t * scale)
            alpha = torch.softmax(logp, dim=1)
            beta = torch.softmax(logp.sub_(w * cy[None]), dim=1)
            out.append((beta - alpha) @ y / (1.0 - t))
        g = torch.cat(out).reshape(x.shape)
        return sanitize(g, self._stats, self.max_grad_norm)

    def guided_step(self, velocity: VelocityCaller, x: Tensor, t: float, dt: float, w: float) -> Tensor:
        return x + dt * (velocity(x, t) + self.correction(x, t, w))


class ClassifierFreeGuidance(Guidance):
    """Classifier-free guidance for conditions: ``v = v_uncond + w (v_cond - v_uncond)``.

    ``w = 1`` is plain conditional sampling (one network call), ``w = 0`` unconditional, ``w > 1``
    sharpens toward ``p(x) p(cond | x)^w``. The unconditional branch calls
    ``velocity(x_t, t[, cond], drop_cond=True)``. Outside ``[t_start, t_end)`` the weight is 1;
    inside it is ``1 + (scale - 1) * schedule(t)``.
    """

    name = "cfg"
    uses_cost = False

    def __init__(self, cost: Any = None, scale: float = 1.0, **common: Any) -> None:
        if cost is not None:
            raise InvalidOptionError("cfg guides toward the model's condition and takes no cost; use "
                                     "coupled/velocity_gradient/... for costs")
        super().__init__(None, scale, **common)

    def weight(self, t: float) -> float:
        if not self.t_start <= t < self.t_end:
            return 1.0
        return 1.0 + (self.scale - 1.0) * float(self.schedule(t))

    def step(self, velocity: VelocityCaller, x: Tensor, t: float, dt: float) -> Tensor:
        w = self.weight(t)
        if w == 1.0:
            return x + dt * velocity(x, t)
        v_u = velocity(x, t, drop_cond=True)
        if w == 0.0:
            return x + dt * v_u
        v_c = velocity(x, t)
        return x + dt * (v_u + w * (v_c - v_u))


class ImportanceParticles(Guidance):
    """Importance-weighted particles at t = 1 (see the module docstring).

    The sampler integrates ``n_particles`` unguided candidates per sample (the first from the
    caller's noise, the rest from noise seeded by ``seed``) and calls :meth:`select`, which keeps
    candidate ``k`` with probability ``exp(-w c(x_k)) / sum_j exp(-w c(x_j))`` (non-finite costs:
    weight 0; all non-finite: the first). Consistent as ``n_particles`` grows when the model is;
    with few particles it tempers the tilt (the best scale exceeds 1)."""

    name = "particles"

    def __init__(self, cost: Cost | Callable | str | None = None, scale: float = 1.0, *,
                 n_particles: int = 4, seed: int = 0, **common: Any) -> None:
        super().__init__(cost, scale, **common)
        if isinstance(n_particles, bool) or not isinstance(n_particles, int) or n_particles < 1:
            raise InvalidOptionError(f"n_particles must be an integer >= 1; got {n_particles!r}")
        self.n_candidates, self.seed = n_particles, int(seed)
        self._gen: torch.Generator | None = None

    def weight(self, t: float) -> float:
        return 0.0  # every candidate is an unguided sample; the cost acts in select()

    def candidate_noise(self, x0: Tensor, k: int) -> Tensor:
        if k == 1:  # seeded by the guide's seed and the caller's noise: fresh noise, fresh candidates
            self._gen = noise_stream(x0, 0x5EED5 + 7_919 * self.seed)
        return torch.randn(x0.shape, generator=self._gen, dtype=x0.dtype).to(x0.device)

    def select(self, candidates: Tensor) -> Tensor:
        k, b = candidates.shape[:2]
        if self.cost is None or self.scale == 0.0 or k == 1:
            return candidates[0]
        with torch.no_grad():
            c = torch.stack([self.cost(x) for x in candidates]).double()     # (K, B)
        self._stats.n_cost_evals += k
        logw = torch.where(torch.isfinite(c), -self.scale * c, torch.full_like(c, -float("inf")))
        pick = importance_pick(logw, self._gen).to(candidates.device)
        return candidates[pick, torch.arange(b, device=candidates.device)]
