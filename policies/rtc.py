"""Real-time chunking (RTC) as prefix inpainting with flow-matching guidance.

While chunk ``k`` executes, chunk ``k+1`` is sampled from an observation taken ``d`` control
steps before it can arrive. The steps of chunk ``k`` that will run meanwhile (``frozen = d``)
are fixed: the new chunk must start with exactly them (hard projection). The rest of the overlap
with chunk ``k`` is a soft target whose weight decays exponentially along the chunk (the soft
mask of Black et al., 2025), so the new chunk joins the old plan smoothly and is free to diverge
where the new observation says so. Both act on the normalized action chunk through
``guidance.make("coupled", ...)``; the policy's network is called exactly as unguided.

The policy owns this: ``policy.predict_action_chunk(obs, prefix=..., frozen=..., rtc=RTCConfig())``
(policies whose ``supports_prefix`` is True); the policy server and ``LocalPolicy`` only pass the
request's prefix through.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import guidance
from envs.errors import InvalidOptionError
from guidance.costs import FunctionCost, PrefixCost
from policies.rtc_config import RTCConfig  # torch-free, for the robot side; imported from here too


def soft_weights(n_overlap: int, frozen: int, decay: float) -> np.ndarray:
    """Per-step weights over the overlap: 1 on frozen steps, exp(-decay*i) after them."""
    w = np.ones(n_overlap, np.float32)
    tail = np.arange(max(n_overlap - frozen, 0), dtype=np.float32)
    w[frozen:] = np.exp(-decay * tail)
    return w


def prefix_guide(policy: Any, prefix: np.ndarray, frozen: int, config: RTCConfig | None = None) -> Any:
    """A ``guidance`` object that makes the policy's next chunk continue ``prefix``.

    ``prefix`` (k, A) in env units: the old plan for the steps the new chunk covers, starting
    at the observation's time. ``frozen`` leading steps are enforced exactly."""
    cfg = config or RTCConfig()
    H, A = policy.config.horizon, policy.config.action_dim
    prefix = np.array(prefix, np.float32)  # a writable copy (wire arrays are read-only views)
    if prefix.ndim != 2 or prefix.shape[1] != A or prefix.shape[0] < 1:
        raise InvalidOptionError(f"RTC prefix must be (k >= 1, {A}) actions, got {prefix.shape}")
    k = min(prefix.shape[0], H)
    frozen = int(min(max(frozen, 0), k))
    with torch.no_grad():
        y = policy.normalizer.action(torch.as_tensor(prefix[:k], device=policy.device)).float().cpu()
    w = torch.as_tensor(soft_weights(k, frozen, cfg.decay))
    inv = 1.0 / (2 * cfg.sigma ** 2)

    def overlap_cost(x: torch.Tensor) -> torch.Tensor:
        d = x[:, :k] - y.to(x.device, x.dtype)
        return inv * (w.to(x.device, x.dtype)[None, :, None] * d * d).flatten(1).sum(1)

    project = PrefixCost(y[:frozen]) if frozen > 0 else None
    extra = {"inner_steps": cfg.inner_steps} if cfg.step == "prox" else {}
    return guidance.make("coupled", cost=FunctionCost(overlap_cost, name="rtc_overlap"), scale=cfg.scale,
                         step=cfg.step, project=project, **extra)
