"""MLPPolicy: the plain behaviour-cloning baseline the VLAs must beat on multi-instruction suites.

[normalized state, pooled instruction feature] -> the (H, A) action chunk, trained by MSE; no
attention, no tokens, no sampling noise. State observations only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from policies.config import PolicyConfig
from policies.model import PolicyMismatchError, VLAModel


class MLPPolicy(VLAModel):
    kind = "mlp"

    def __init__(self, config: PolicyConfig):
        super().__init__(config)
        c = config
        if c.cameras:
            raise PolicyMismatchError("the MLP baseline takes state observations only (cameras given: "
                                      f"{list(c.cameras)})")
        # the transformer trunk of VLAModel is not used here
        self.layers = nn.ModuleList()
        self.state_proj = self.lang_proj = self.final_norm = None
        width = c.state_hidden
        self.net = nn.Sequential(nn.Linear(self.state_in_dim + c.lang_dim, width), nn.GELU(),
                                 nn.Linear(width, width), nn.GELU(),
                                 nn.Linear(width, c.horizon * c.action_dim))

    def features(self, batch: dict[str, Any]) -> torch.Tensor:
        state = torch.as_tensor(batch["state"], dtype=torch.float32, device=self.device)
        if state.ndim != 2 or state.shape[1] != self.config.state_dim:
            raise PolicyMismatchError(f"state has shape {tuple(state.shape)}, policy expects (B, {self.config.state_dim})")
        instr = batch["instruction"]
        instr = [instr] * state.shape[0] if isinstance(instr, str) else list(instr)
        feats, mask = self.lang(instr)
        feats = self.normalizer.language(feats.to(self.device))
        return torch.cat([self.state_input(state), self._pooled(feats, mask.to(self.device), None)], -1)

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        x1 = self.normalizer.action(torch.as_tensor(batch["action"], dtype=torch.float32, device=self.device))
        pred = self.net(self.features(batch)).view_as(x1)
        err = ((pred - x1) ** 2).mean(-1)
        valid = (~torch.as_tensor(batch["action_pad"], device=self.device)).float() if "action_pad" in batch \
            else torch.ones_like(err)
        loss = ((err * valid).sum(1) / valid.sum(1).clamp_min(1)).mean()
        return loss, {"loss_bc": float(loss.detach())}

    def sample_chunks(self, batch: dict[str, Any], guide: Any = None, **_: Any) -> torch.Tensor:
        if guide is not None:
            raise ValueError("the MLP baseline is deterministic: guidance needs a flow policy")
        feats = self.features(batch)
        return self.net(feats).view(feats.shape[0], self.config.horizon, self.config.action_dim)

    def instruction_scores(self, batch: dict[str, Any], candidates: list[list[str]], **_: Any) -> torch.Tensor:
        """Not defined: the baseline is deterministic and has no likelihood."""
        raise NotImplementedError("the MLP baseline has no likelihood: CIG needs a flow or AR policy")
