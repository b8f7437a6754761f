"""AutoregressiveVLA (RT-2/OpenVLA-style): each action dimension discretized into bins and
decoded token by token; the exact chunk log-likelihood is the sum of token log-probabilities."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from policies.config import PolicyConfig
from policies.flow import _expand
from policies.model import VLAModel


class AutoregressiveVLA(VLAModel):
    kind = "ar"

    def __init__(self, config: PolicyConfig):
        super().__init__(config)
        c, d = config, config.d_model
        self.n_tokens = c.horizon * c.action_dim
        self.bin_emb = nn.Embedding(c.n_bins + 1, d)  # last index = BOS
        self.pos_emb = nn.Parameter(torch.randn(1, self.n_tokens, d) * 0.02)
        self.head = nn.Linear(d, c.n_bins)

    # ----- tokenization ---------------------------------------------------------------------
    def tokenize(self, a_norm: torch.Tensor) -> torch.Tensor:
        """(B, H, A) in [-1, 1] -> (B, H*A) bin indices (time-major: step 0 dims, step 1 dims...)."""
        nb = self.config.n_bins
        idx = torch.floor((a_norm.clamp(-1, 1) + 1) / 2 * nb).long().clamp(0, nb - 1)
        return idx.flatten(1)

    def detokenize(self, tokens: torch.Tensor) -> torch.Tensor:
        nb = self.config.n_bins
        a = (tokens.float() + 0.5) / nb * 2 - 1
        return a.view(tokens.shape[0], self.config.horizon, self.config.action_dim)

    # ----- network --------------------------------------------------------------------------
    def logits(self, prefix: torch.Tensor, pad: torch.Tensor, tokens: torch.Tensor,
               keep: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Teacher-forced logits (B, n, n_bins) for the first n = tokens.shape[1] + 1 positions."""
        B, P, _ = prefix.shape
        bos = torch.full((B, 1), self.config.n_bins, dtype=torch.long, device=prefix.device)
        inp = torch.cat([bos, tokens], 1)
        n = inp.shape[1]
        a = self.bin_emb(inp) + self.pos_emb[:, :n] + self.type_emb[3]
        x = torch.cat([prefix, a], 1)
        L = P + n
        mask = torch.zeros(L, L, dtype=torch.bool, device=prefix.device)
        mask[:P, P:] = True  # prefix does not see actions
        mask[P:, P:] = torch.triu(torch.ones(n, n, dtype=torch.bool, device=prefix.device), 1)
        p = torch.cat([pad, torch.zeros(B, n, dtype=torch.bool, device=pad.device)], 1)
        out, hidden = self.run(x, p, attn_mask=mask, keep=keep)
        lg = self.head(out[:, P:])
        return (lg, [h[:, P:].mean(1) for h in hidden]) if keep else lg

    def token_logprobs(self, prefix: torch.Tensor, pad: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        lg = self.logits(prefix, pad, tokens[:, :-1])
        return torch.gather(F.log_softmax(lg.float(), -1), 2, tokens[:, :, None])[..., 0]  # (B, N)

    def _valid_tokens(self, batch: dict[str, Any], B: int) -> torch.Tensor:
        if "action_pad" not in batch:
            return torch.ones(B, self.n_tokens, dtype=torch.bool, device=self.device)
        valid = ~torch.as_tensor(batch["action_pad"], device=self.device)
        return valid[:, :, None].expand(B, self.config.horizon, self.config.action_dim).reshape(B, -1)

    # ----- training -------------------------------------------------------------------------
    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.normalizer.action(torch.as_tensor(batch["action"], dtype=torch.float32, device=self.device))
        B = a.shape[0]
        drop = batch.get("drop_lang")
        if drop is None and self.training and self.config.instruction_dropout > 0:
            drop = torch.rand(B, device=self.device) < self.config.instruction_dropout
        prefix, pad = self.prefix(batch, drop_lang=drop)
        tokens = self.tokenize(a)
        lp = self.token_logprobs(prefix, pad, tokens)
        valid = self._valid_tokens(batch, B)
        loss = (-(lp * valid).sum(1) / valid.sum(1).clamp_min(1)).mean()  # per-sample, then batch mean
        return loss, {"loss_bc": float(loss.detach())}

    def log_likelihood(self, batch: dict[str, Any], instructions: list[str] | None = None) -> torch.Tensor:
        """Exact log p(a | o, l) of each chunk (sum over its valid tokens), (B,)."""
        a = self.normalizer.action(torch.as_tensor(batch["action"], dtype=torch.float32, device=self.device))
        b = dict(batch)
        if instructions is not None:
            b["instruction"] = instructions
        prefix, pad = self.prefix(b)
        lp = self.token_logprobs(prefix, pad, self.tokenize(a))
        return (lp * self._valid_tokens(batch, a.shape[0])).sum(-1)

    # ----- sampling -------------------------------------------------------------------------
    @torch.no_grad()
    def sample_chunks(self, batch: dict[str, Any], temperature: float = 0.0, generator: torch.Generator | None = None,
                      cfg_scale: float | None = None, **_: Any) -> torch.Tensor:
        """Decode H*A tokens one by one (greedy at temperature 0). Returns normalized chunks."""
        prefix, pad = self.prefix(batch)
        B = prefix.shape[0]
        w = self.config.cfg_scale if cfg_scale is None else float(cfg_scale)
        if w != 1.0:
            uprefix, upad = self.prefix(batch, drop_lang=torch.ones(B, dtype=torch.bool))
        tokens = torch.zeros(B, 0, dtype=torch.long, device=self.device)
        for _ in range(self.n_tokens):
            lg = self.logits(prefix, pad, tokens)[:, -1].float()
            if w != 1.0:
                lu = self.logits(uprefix, upad, tokens)[:, -1].float()
                lg = lu + w * (lg - lu)
            if temperature > 0:
                probs = F.softmax(lg / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            else:
                nxt = lg.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
        return self.detokenize(tokens)

    # ----- instruction scores (CIG) ---------------------------------------------------------
    def instruction_scores(self, batch: dict[str, Any], candidates: list[list[str]], tau: float = 1.0,
                           **_: Any) -> torch.Tensor:
        """s(l) = log p(a | o, l) (exact), (B, K); tau rescales for the softmax."""
        B, K = len(candidates), len(candidates[0])
        flat = _expand({k: v for k, v in batch.items() if k in ("state", "images", "action", "action_pad")}, K)
        flat["instruction"] = [l for cands in candidates for l in cands]
        return self.log_likelihood(flat).view(B, K) / tau

    def conditioning_features(self, batch: dict[str, Any], seed: int = 0) -> list[torch.Tensor]:
        prefix, pad = self.prefix(batch)
        a = self.normalizer.action(torch.as_tensor(batch["action"], dtype=torch.float32, device=self.device))
        _, hidden = self.logits(prefix, pad, self.tokenize(a)[:, :-1], keep=True)
        return hidden
