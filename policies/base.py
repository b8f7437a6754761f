"""The interface every groundflow policy implements (flow-matching and autoregressive VLAs).

Observations follow envs.base: ``{"state": (S,), "images": {cam: (h, w, 3) uint8}, "instruction": str}``.
Action chunks are ``(H, A)`` float32 in env units (normalization is internal to the policy).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch


class Policy(Protocol):
    config: Any  # PolicyConfig: kind, state_dim, action_dim, horizon, n_exec, cameras, image_size
    supports_prefix: bool  # predict_action_chunk can continue a committed plan (real-time chunking)
    score_tau: float  # default temperature of instruction_scores

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]: ...

    def predict_action_chunk(self, obs: dict[str, Any], *, prefix: np.ndarray | None = None, frozen: int = 0,
                             rtc: Any = None, **sampling: Any) -> np.ndarray: ...

    def select_action(self, obs: dict[str, Any]) -> np.ndarray: ...

    def reset(self) -> None: ...

    def action_range(self) -> tuple[np.ndarray, np.ndarray]: ...

    def instruction_scores(self, batch: dict[str, Any], candidates: list[list[str]], *, tau: float | None = None,
                           draws: int = 4, generator: torch.Generator | None = None,
                           detach_negatives: bool = False) -> torch.Tensor: ...

    def save(self, directory: str) -> None: ...
