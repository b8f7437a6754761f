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

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]: ...

    def predict_action_chunk(self, obs: dict[str, Any], **sampling: Any) -> np.ndarray: ...

    def select_action(self, obs: dict[str, Any]) -> np.ndarray: ...

    def reset(self) -> None: ...

    def instruction_scores(self, batch: dict[str, Any], candidates: list[list[str]]) -> torch.Tensor: ...

    def save(self, directory: str) -> None: ...
