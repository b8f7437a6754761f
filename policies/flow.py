"""FlowMatchingVLA: a pi0-style action expert predicting the velocity of a whole action chunk.

Convention (DESIGN.md): x_t = (1 - t) x0 + t x1, x0 ~ N(0, I) noise, x1 the normalized chunk,
target u = x1 - x0, sampling integrates t = 0 -> 1 with Euler steps; guidance hooks in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from guidance.sampler import sample
from policies.config import PolicyConfig
from policies.model import VLAModel, sinusoidal


class FlowMatchingVLA(VLAModel):
    kind = "flow"
    supports_prefix = True
    score_tau = 0.1

    def __init__(self, config: PolicyConfig):
        super().__init__(config)
        c, d = config, config.d_model
        self.action_in = nn.Linear(c.action_dim, d)
        self.step_emb = nn.Parameter(torch.randn(1, c.horizon, d) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.action_out = nn.Linear(d, c.action_dim)
        nn.init.zeros_(self.action_out.weight)
        nn.init.zeros_(self.action_out.bias)

    # ----- network --------------------------------------------------------------------------
    def velocity(self, prefix: torch.Tensor, pad: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                 keep: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """v(x_t, t | o, l) for chunks x_t (B, H, A) given conditioning tokens."""
        B, H, _ = x_t.shape
        a = self.action_in(x_t) + self.step_emb[:, :H] + self.time_mlp(sinusoidal(t, self.config.d_model))[:, None]
        a = a + self.type_emb[3] + self.action_cond(prefix)
        x = torch.cat([prefix, a], 1)
        p = torch.cat([pad, torch.zeros(B, H, dtype=torch.bool, device=pad.device)], 1)
        out, hidden = self.run(x, p, keep=keep)
        v = self.action_out(out[:, -H:])
        return (v, [h[:, -H:].mean(1) for h in hidden]) if keep else v

    # ----- training -------------------------------------------------------------------------
    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Flow-matching MSE on the velocity. ``batch`` may carry ``flow_t``/``flow_noise`` so that
        data-parallel ranks draw exactly the randomness of one big batch."""
        x1 = self.normalizer.action(torch.as_tensor(batch["action"], dtype=torch.float32, device=self.device))
        B = x1.shape[0]
        t = batch.get("flow_t")
        t = torch.rand(B, device=self.device) if t is None else torch.as_tensor(t, device=self.device)
        x0 = batch.get("flow_noise")
        x0 = torch.randn_like(x1) if x0 is None else torch.as_tensor(x0, device=self.device)
        drop = batch.get("drop_lang")
        if drop is None and self.training and self.config.instruction_dropout > 0:
            drop = torch.rand(B, device=self.device) < self.config.instruction_dropout
        prefix, pad = self.prefix(batch, drop_lang=drop)
        x_t = (1 - t)[:, None, None] * x0 + t[:, None, None] * x1
        v = self.velocity(prefix, pad, x_t, t)
        err = ((v - (x1 - x0)) ** 2).mean(-1)  # (B, H)
        valid = ~torch.as_tensor(batch["action_pad"], device=self.device) if "action_pad" in batch else torch.ones_like(err, dtype=torch.bool)
        # per-sample mean over valid steps, then batch mean: equal slices on data-parallel ranks
        # average to exactly the one-process loss
        loss = ((err * valid).sum(1) / valid.sum(1).clamp_min(1)).mean()
        return loss, {"loss_bc": float(loss.detach())}

    # ----- sampling -------------------------------------------------------------------------
    def sample_chunks(self, batch: dict[str, Any], noise: torch.Tensor | None = None, guide: Any = None,
                      n_steps: int | None = None, cfg_scale: float | None = None,
                      return_stats: bool = False) -> torch.Tensor:
        """Normalized chunks (B, H, A) by Euler integration from noise; ``guide`` is a
        ``guidance.Guidance`` (None: unguided). Classifier-free guidance over the instruction when
        ``cfg_scale`` != 1 (needs a policy trained with instruction dropout)."""
        c = self.config
        prefix, pad = self.prefix(batch)
        B = prefix.shape[0]
        w = c.cfg_scale if cfg_scale is None else float(cfg_scale)
        if w != 1.0:
            uprefix, upad = self.prefix(batch, drop_lang=torch.ones(B, dtype=torch.bool))

            def velocity(x, t):
                vc = self.velocity(prefix, pad, x, t)
                vu = self.velocity(uprefix, upad, x, t)
                return vu + w * (vc - vu)
        else:
            def velocity(x, t):
                return self.velocity(prefix, pad, x, t)

        x0 = torch.randn(B, c.horizon, c.action_dim, device=self.device) if noise is None else noise.to(self.device)
        steps = n_steps or c.flow_steps
        var = self.normalizer.action_variance()
        return sample(velocity, x0, n_steps=steps, guide=guide, return_stats=return_stats,
                      data_variance=None if var is None else var.to(x0.device).expand(c.horizon, c.action_dim))

    # ----- instruction scores (CIG) ---------------------------------------------------------
    def energies(self, batch: dict[str, Any], candidates: list[list[str]], n_draws: int = 4,
                 generator: torch.Generator | None = None, detach_negatives: bool = False) -> torch.Tensor:
        """E(a | o, l) = mean_m ||v(x_tm, t_m | o, l) - (a - x0_m)||^2 for each candidate l.

        The M draws (t_m, x0_m) are shared by all candidates of a sample (common random
        numbers), so energy differences reflect the instruction, not the noise. Returns (B, K)."""
        x1 = self.normalizer.action(torch.as_tensor(batch["action"], dtype=torch.float32, device=self.device))
        B, H, A = x1.shape
        K = len(candidates[0])
        M = n_draws
        t = torch.rand(B, M, generator=generator).to(self.device)
        x0 = torch.randn(B, M, H, A, generator=generator).to(self.device)
        valid = None
        if "action_pad" in batch:  # padded steps carry no information about the instruction
            valid = (~torch.as_tensor(batch["action_pad"], device=self.device)).float()
        if not detach_negatives:
            return self._energy(batch, candidates, t, x0, x1, valid)
        # Counterfactual energies carry no gradient: a separate no-grad pass, so the backward
        # pass covers only the commanded branch (about 3x cheaper training step with K=3).
        pos = self._energy(batch, [c[:1] for c in candidates], t, x0, x1, valid)
        with torch.no_grad():
            neg = self._energy(batch, [c[1:] for c in candidates], t, x0, x1, valid)
        return torch.cat([pos, neg], 1)

    def _energy(self, batch: dict[str, Any], candidates: list[list[str]], t: torch.Tensor, x0: torch.Tensor,
                x1: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """(B, K) energies of the candidates under the shared draws t (B, M), x0 (B, M, H, A)."""
        B, M, H, A = x0.shape
        K = len(candidates[0])
        rep = {k: v for k, v in batch.items() if k in ("state", "images", "image_maps")}
        flat = _expand(rep, K * M)
        flat["instruction"] = [l for cands in candidates for l in cands for _ in range(M)]
        prefix, pad = self.prefix(flat)
        tt = t[:, None].expand(B, K, M).reshape(-1)
        xx0 = x0[:, None].expand(B, K, M, H, A).reshape(-1, H, A)
        xx1 = x1[:, None, None].expand(B, K, M, H, A).reshape(-1, H, A)
        x_t = (1 - tt)[:, None, None] * xx0 + tt[:, None, None] * xx1
        v = self.velocity(prefix, pad, x_t, tt)
        if valid is None:
            err = ((v - (xx1 - xx0)) ** 2).mean((-1, -2))  # (B*K*M,)
        else:
            vv = valid[:, None, None].expand(B, K, M, H).reshape(-1, H)
            err = (((v - (xx1 - xx0)) ** 2).mean(-1) * vv).sum(-1) / vv.sum(-1).clamp_min(1)
        return err.view(B, K, M).mean(-1)

    def instruction_scores(self, batch: dict[str, Any], candidates: list[list[str]], *, tau: float | None = None,
                           draws: int = 4, generator: torch.Generator | None = None,
                           detach_negatives: bool = False) -> torch.Tensor:
        """s(l) = -E(a | o, l) / tau, (B, K), from ``draws`` (t, x0) draws shared by all candidates."""
        tau = self.score_tau if tau is None else tau
        return -self.energies(batch, candidates, draws, generator, detach_negatives) / tau

    def conditioning_features(self, batch: dict[str, Any], t: float = 0.5, seed: int = 0) -> list[torch.Tensor]:
        """Per-layer mean action-token features at a fixed (t, noise): for the collapse curve."""
        prefix, pad = self.prefix(batch)
        B = prefix.shape[0]
        g = torch.Generator().manual_seed(seed)
        x0 = torch.randn(B, self.config.horizon, self.config.action_dim, generator=g).to(self.device)
        tt = torch.full((B,), t, device=self.device)
        _, hidden = self.velocity(prefix, pad, x0 * (1 - t), tt, keep=True)
        return hidden


def _expand(batch: dict[str, Any], n: int) -> dict[str, Any]:
    """Repeat each sample n times (sample-major); lists (instructions) too."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, dict):
            out[k] = _expand(v, n)
        elif isinstance(v, (list, tuple)):
            out[k] = [item for item in v for _ in range(n)]
        else:
            x = torch.as_tensor(v)
            out[k] = x.repeat_interleave(n, 0)
    return out
