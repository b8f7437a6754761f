"""What one guided ``sample`` call costs and repairs: ``SampleStats``, and the ``VelocityCaller``
that every guidance method calls the network through, so that each evaluation and backward pass
is counted. Kept apart from the sampling loop (``guidance.sampler``) because the methods
(``guidance.base`` and below) need these and the loop needs the methods.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from envs.errors import InvalidOptionError

Velocity = Callable[..., Tensor]


@dataclass
class SampleStats:
    """What one ``sample`` call cost and what it had to repair."""

    method: str = "none"
    n_steps: int = 0
    nfe: int = 0                  # velocity (network) evaluations of the batch
    n_backward: int = 0           # backward passes through the network
    n_cost_grads: int = 0         # batched cost gradient evaluations (no network involved)
    n_cost_evals: int = 0         # batched cost evaluations without gradient (line search, particles)
    n_nonfinite_grad: int = 0     # per-sample gradients with NaN/inf: zeroed, never used
    n_clipped_grad: int = 0       # per-sample steps shortened by max_grad_norm or a trust region
    n_nonfinite_output: int = 0   # samples whose final value is not finite (also warned)
    n_exploded: int = 0           # samples whose norm grew past EXPLODE_FACTOR x their start (warned)
    max_norm_ratio: float = 0.0   # largest |x_t| / reference norm seen along the path (1-10: normal)
    s2: float | None = None       # mean data variance Sigma_t used (coupled), None if not used
    s2_source: str = ""           # "model" (the flow model's data variance), "option", or "default" (1.0)
    wall_time_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: a sample whose norm exceeds this many times its reference norm (max of |x0| and the data's
#: RMS norm) has exploded: far past anything a flow path from that noise to that data visits
EXPLODE_FACTOR = 100.0


class VelocityCaller:
    """Calls the user's velocity with the right arguments, checks it, and counts every use.

    ``data_variance`` is the flow model's per-dimension variance of the data endpoint (what
    Sigma_t estimates need), or None when the model does not say."""

    def __init__(self, velocity: Velocity, cond: Any, stats: SampleStats,
                 data_variance: Tensor | None = None) -> None:
        self.velocity, self.cond, self.stats = velocity, cond, stats
        self.data_variance = data_variance

    def __call__(self, x: Tensor, t: float, *, grad: bool = False, drop_cond: bool = False) -> Tensor:
        tt = torch.full((x.shape[0],), float(t), device=x.device, dtype=x.dtype)
        args = (x, tt) if self.cond is None else (x, tt, self.cond)
        kwargs = {"drop_cond": True} if drop_cond else {}
        with torch.set_grad_enabled(grad):
            try:
                v = self.velocity(*args, **kwargs)
            except TypeError as e:
                if drop_cond and "drop_cond" in str(e):
                    raise InvalidOptionError(
                        "classifier-free guidance calls velocity(x_t, t[, cond], drop_cond=True) for "
                        "the unconditional branch; this velocity does not accept drop_cond") from e
                raise
        self.stats.nfe += 1
        if not isinstance(v, Tensor) or v.shape != x.shape:
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise InvalidOptionError(f"velocity returned {got}; it must return a tensor shaped like "
                                     f"x_t {tuple(x.shape)}")
        return v

    def backward(self, output: Tensor, inputs: Tensor, grad_output: Tensor | None = None) -> Tensor:
        """One backward pass through the network (counted): d<output, grad_output>/d inputs."""
        (g,) = torch.autograd.grad(output, inputs, grad_outputs=grad_output)
        self.stats.n_backward += 1
        return g
