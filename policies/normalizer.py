"""Per-dimension normalization with statistics stored in the checkpoint.

Actions map to [-1, 1] by min/max (DESIGN.md convention); states are standardized.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Normalizer(nn.Module):
    def __init__(self, state_dim: int, action_dim: int, lang_dim: int = 0, relative_dim: int = 0):
        super().__init__()
        if relative_dim:  # only policies configured with state_relative carry (and save) these
            self.register_buffer("relative_mean", torch.zeros(relative_dim))
            self.register_buffer("relative_std", torch.ones(relative_dim))
        if lang_dim:  # only policies configured with lang_norm carry (and save) these
            self.register_buffer("lang_mean", torch.zeros(lang_dim))
            self.register_buffer("lang_scale", torch.ones(()))
        self.register_buffer("state_mean", torch.zeros(state_dim))
        self.register_buffer("state_std", torch.ones(state_dim))
        self.register_buffer("action_min", -torch.ones(action_dim))
        self.register_buffer("action_max", torch.ones(action_dim))
        # variance of the normalized actions per dimension (guidance's Sigma_t needs the data
        # scale; min-max normalization does not give unit variance); 0 = unknown (older checkpoints)
        self.register_buffer("action_var", torch.zeros(action_dim))

    def fit(self, states: np.ndarray, actions: np.ndarray) -> None:
        s = torch.as_tensor(np.asarray(states), dtype=torch.float32)
        a = torch.as_tensor(np.asarray(actions), dtype=torch.float32)
        self.state_mean.copy_(s.mean(0))
        self.state_std.copy_(s.std(0).clamp_min(1e-3))
        lo, hi = a.min(0).values, a.max(0).values
        pad = ((hi - lo) * 0.02).clamp_min(1e-3)  # keep constant dims (e.g. a held gripper) finite
        self.action_min.copy_(lo - pad)
        self.action_max.copy_(hi + pad)
        self.action_var.copy_(self.action(a).var(0).clamp_min(1e-6))

    def fit_relative(self, rel: torch.Tensor) -> None:
        """Statistics of the (N, 3k) relative positions (``PolicyConfig.state_relative``)."""
        self.relative_mean.copy_(rel.mean(0))
        self.relative_std.copy_(rel.std(0).clamp_min(1e-3))

    def fit_language(self, feats: torch.Tensor, mask: torch.Tensor) -> None:
        """Instruction-feature statistics from (N, L, D) features of the training instructions
        (padding ``mask`` True): per-dimension mean, one scale (RMS of the centred features), so
        the geometry among instructions, paraphrases included, is kept."""
        valid = feats[~mask]
        mean = valid.mean(0)
        self.lang_mean.copy_(mean)
        self.lang_scale.copy_(((valid - mean) ** 2).sum(-1).mean().sqrt().clamp_min(1e-6))

    def language(self, f: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "lang_mean"):
            return f
        return (f - self.lang_mean.to(f.device)) / self.lang_scale.to(f.device)

    def action_variance(self) -> torch.Tensor | None:
        """Per-dimension variance of normalized actions, None where the checkpoint predates it."""
        return self.action_var if bool((self.action_var > 0).all()) else None

    def state(self, s: torch.Tensor) -> torch.Tensor:
        return (s - self.state_mean) / self.state_std

    def relative(self, rel: torch.Tensor) -> torch.Tensor:
        return (rel - self.relative_mean) / self.relative_std

    def action(self, a: torch.Tensor) -> torch.Tensor:
        return 2 * (a - self.action_min) / (self.action_max - self.action_min) - 1

    def unaction(self, a: torch.Tensor) -> torch.Tensor:
        return (a + 1) / 2 * (self.action_max - self.action_min) + self.action_min
