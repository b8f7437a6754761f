"""The one Euler sampler every flow model in groundflow uses, with guidance hooks and accounting.

Conventions (DESIGN.md): ``x_t = (1 - t) x0 + t x1``, ``x0 ~ N(0, I)``, data at ``t = 1``,
velocity ``u = x1 - x0``; ``n_steps`` Euler steps at ``t_i = i / n_steps``.

Velocity interface::

    velocity(x_t, t)                      # cond=None: a closure over the conditioning
    velocity(x_t, t, cond)                # cond given: passed through unchanged
    velocity(x_t, t[, cond], drop_cond=True)   # only for "cfg": the unconditional branch

``x_t`` is ``(B, ...)`` (an action chunk ``(B, H, A)``, a state ``(B, D)``, an image
``(B, C, H, W)``), ``t`` is ``(B,)``. The network runs under ``torch.no_grad`` unless the
guidance method backpropagates through it (``velocity_gradient``, ``coupled`` with
``sigma="jacobian"``); ``SampleStats`` counts both, so "no overhead" is a measured claim.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch import Tensor

from envs.errors import InvalidOptionError
from guidance.accounting import EXPLODE_FACTOR, SampleStats, Velocity, VelocityCaller
from guidance.base import Guidance
from guidance.methods import make

__all__ = ["sample"]


def sample(velocity: Velocity, x0: Tensor, n_steps: int = 10, guide: Guidance | str | None = None,
           cond: Any = None, return_stats: bool = False,
           data_variance: Tensor | float | None = None) -> Tensor | tuple[Tensor, SampleStats]:
    """Integrate the flow from noise ``x0`` (t=0) to data (t=1), guided by ``guide``.

    ``guide`` is a ``Guidance`` from ``guidance.make``, a method name with default options, or
    ``None`` (unguided). ``data_variance`` is the model's per-dimension data variance (broadcast
    to one sample's shape; a policy passes its normalized action variance); coupled guidance
    takes its ``s2`` from it unless given one. Returns the samples, and ``SampleStats`` when
    ``return_stats``. Samples whose norm grows past ``EXPLODE_FACTOR`` x their reference norm are
    counted (``n_exploded``) and warned about, like non-finite ones.
    """
    if not isinstance(x0, Tensor) or x0.ndim < 2:
        raise InvalidOptionError(f"x0 must be a tensor (B, ...) with a batch dimension; got "
                                 f"{tuple(x0.shape) if isinstance(x0, Tensor) else type(x0).__name__}")
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise InvalidOptionError(f"n_steps must be an integer >= 1; got {n_steps!r}")
    if guide is None or isinstance(guide, str):
        guide = make(guide or "none")
    if not isinstance(guide, Guidance):
        raise InvalidOptionError(f"guide must be a Guidance (guidance.make(...)), a method name or "
                                 f"None; got {type(guide).__name__}")
    if guide.needs_network_grad and torch.is_inference_mode_enabled():
        raise InvalidOptionError(f"guidance {guide.name!r} backpropagates through the network; call "
                                 f"sample() under torch.no_grad(), not torch.inference_mode()")

    if data_variance is not None:
        data_variance = torch.as_tensor(data_variance, dtype=x0.dtype, device=x0.device)
        if not bool((data_variance > 0).all()) or not bool(torch.isfinite(data_variance).all()):
            raise InvalidOptionError("data_variance must be finite and > 0 in every dimension")
        try:
            data_variance = data_variance.expand(x0.shape[1:])
        except RuntimeError:
            raise InvalidOptionError(f"data_variance of shape {tuple(data_variance.shape)} does not "
                                     f"broadcast to per-sample shape {tuple(x0.shape[1:])}") from None

    stats = SampleStats(method=guide.name, n_steps=n_steps)
    caller = VelocityCaller(velocity, cond, stats, data_variance)
    start = time.perf_counter()
    # explosion watch: per-sample norm against max(|x0|, RMS norm of the data)
    data_norm = float(data_variance.sum().sqrt()) if data_variance is not None else float(x0[0].numel()) ** 0.5
    peak = torch.zeros(x0.shape[0], dtype=x0.dtype, device=x0.device)
    dt = 1.0 / n_steps
    candidates = []
    for k in range(guide.n_candidates):  # one pass, or one per candidate of a method that picks among them
        x = x0.detach() if k == 0 else guide.candidate_noise(x0, k)
        if k == 0:
            guide.begin(x, caller)
        ref = torch.clamp(x.reshape(x.shape[0], -1).norm(dim=1), min=data_norm)
        for i in range(n_steps):
            x = guide.step(caller, x, i / n_steps, dt).detach()
            peak = torch.maximum(peak, torch.nan_to_num(x.reshape(x.shape[0], -1).norm(dim=1) / ref, nan=0.0,
                                                        posinf=0.0))
        candidates.append(guide.finish(x))
    x = candidates[0] if len(candidates) == 1 else guide.select(torch.stack(candidates))
    stats.wall_time_s = time.perf_counter() - start
    bad = ~torch.isfinite(x.reshape(x.shape[0], -1)).all(1)
    stats.n_nonfinite_output = int(bad.sum())
    stats.n_exploded = int((peak > EXPLODE_FACTOR).sum())
    stats.max_norm_ratio = float(peak.max()) if peak.numel() else 0.0
    if stats.n_nonfinite_output:
        warnings.warn(f"guided sampling ({guide.name}) produced {stats.n_nonfinite_output} non-finite "
                      f"samples of {x.shape[0]}", RuntimeWarning, stacklevel=2)
    if stats.n_exploded:
        warnings.warn(f"guided sampling ({guide.name}) exploded on {stats.n_exploded} of {x.shape[0]} samples "
                      f"(norm up to {stats.max_norm_ratio:.3g}x the noise/data norm; lower the scale or use "
                      f"a bounded step)", RuntimeWarning, stacklevel=2)
    return (x, stats) if return_stats else x
