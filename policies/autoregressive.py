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

    def soft_targets(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, N) bin indices -> (B, N, n_bins) target distributions: the Gaussian of std
        ``bin_sigma`` (in bins) around each bin centre, integrated over the bins (HL-Gauss)."""
        nb, s = self.config.n_bins, self.config.bin_sigma
        edges = torch.arange(nb + 1, device=tokens.device, dtype=torch.float32)
        cdf = torch.special.ndtr((edges - (tokens[..., None].float() + 0.5)) / s)
        p = cdf[..., 1:] - cdf[..., :-1]
        return p / p.sum(-1, keepdim=True)

    # ----- network --------------------------------------------------------------------------
    def logits(self, prefix: torch.Tensor, pad: torch.Tensor, tokens: torch.Tensor,
               keep: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Teacher-forced logits (B, n, n_bins) for the first n = tokens.shape[1] + 1 positions."""
        B, P, _ = prefix.shape
        bos = torch.full((B, 1), self.config.n_bins, dtype=torch.long, device=prefix.device)
        inp = torch.cat([bos, tokens], 1)
        n = inp.shape[1]
        a = self.bin_emb(inp) + self.pos_emb[:, :n] + self.type_emb[3] + self.action_cond(prefix)
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
        if self.config.bin_sigma > 0:
            logp = F.log_softmax(self.logits(prefix, pad, tokens[:, :-1]).float(), -1)
            lp = (self.soft_targets(tokens) * logp).sum(-1)  # -cross-entropy against the smoothed bins
        else:
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
        """Decode H*A tokens one by one (greedy at temperature 0) with a key/value cache, so each
        token costs one position through the network instead of the whole sequence so far.
        With classifier-free guidance the conditional and unconditional branches share a batch.
        Returns normalized chunks."""
        prefix, pad = self.prefix(batch)
        B = prefix.shape[0]
        w = self.config.cfg_scale if cfg_scale is None else float(cfg_scale)
        if w != 1.0:
            uprefix, upad = self.prefix(batch, drop_lang=torch.ones(B, dtype=torch.bool))
            prefix, pad = torch.cat([prefix, uprefix]), torch.cat([pad, upad])
        cache = self._prefix_cache(prefix, pad)
        nb = self.config.n_bins
        nxt = torch.full((prefix.shape[0],), nb, dtype=torch.long, device=self.device)  # BOS
        cond = self.action_cond(prefix)
        tokens = []
        for j in range(self.n_tokens):
            x = (self.bin_emb(nxt) + self.pos_emb[0, j] + self.type_emb[3])[:, None] + cond
            lg = self.head(self.final_norm(self._cached_step(x, cache)))[:, 0].float()
            if w != 1.0:
                lc, lu = lg[:B], lg[B:]
                lg = lu + w * (lc - lu)
            if temperature > 0:
                tok = torch.multinomial(F.softmax(lg / temperature, -1), 1, generator=generator)[:, 0]
            else:
                tok = lg.argmax(-1)
            tokens.append(tok)
            nxt = tok.repeat(2) if w != 1.0 else tok
        return self.detokenize(torch.stack(tokens, 1))

    def _qkv(self, layer: nn.TransformerEncoderLayer, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sa = layer.self_attn
        B, n, d = x.shape
        h = sa.num_heads
        q, k, v = F.linear(layer.norm1(x), sa.in_proj_weight, sa.in_proj_bias).chunk(3, -1)
        return tuple(t.view(B, n, h, d // h).transpose(1, 2) for t in (q, k, v))

    def _finish(self, layer: nn.TransformerEncoderLayer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Residual, output projection and feed-forward of a pre-norm encoder layer (eval mode)."""
        B, _, n, _ = att.shape
        x = x + layer.self_attn.out_proj(att.transpose(1, 2).reshape(B, n, -1))
        return x + layer.linear2(layer.activation(layer.linear1(layer.norm2(x))))

    def _prefix_cache(self, prefix: torch.Tensor, pad: torch.Tensor) -> dict[str, Any]:
        """Keys/values of the conditioning tokens per layer (they never attend to actions)."""
        allow = ~pad[:, None, None, :]  # (B, 1, 1, P): True = attend
        ks, vs, x = [], [], prefix
        for layer in self.layers:
            q, k, v = self._qkv(layer, x)
            x = self._finish(layer, x, F.scaled_dot_product_attention(q, k, v, attn_mask=allow))
            ks.append(k)
            vs.append(v)
        return {"k": ks, "v": vs, "allow": allow}

    def _cached_step(self, x: torch.Tensor, cache: dict[str, Any]) -> torch.Tensor:
        """One new action token (B, 1, d) through every layer, appending its keys/values."""
        ones = torch.ones(x.shape[0], 1, 1, 1, dtype=torch.bool, device=x.device)
        cache["allow"] = allow = torch.cat([cache["allow"], ones], -1)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x)
            cache["k"][i] = K = torch.cat([cache["k"][i], k], 2)
            cache["v"][i] = V = torch.cat([cache["v"][i], v], 2)
            x = self._finish(layer, x, F.scaled_dot_product_attention(q, K, V, attn_mask=allow))
        return x

    # ----- instruction scores (CIG) ---------------------------------------------------------
    def instruction_scores(self, batch: dict[str, Any], candidates: list[list[str]], *, tau: float | None = None,
                           draws: int = 4, generator: torch.Generator | None = None,
                           detach_negatives: bool = False) -> torch.Tensor:
        """s(l) = log p(a | o, l) (exact: ``draws`` and ``generator`` are not needed), (B, K); tau
        rescales for the softmax."""
        tau = self.score_tau if tau is None else tau
        B, K = len(candidates), len(candidates[0])
        keys = ("state", "images", "image_maps", "action", "action_pad")
        flat = _expand({k: v for k, v in batch.items() if k in keys}, K)
        flat["instruction"] = [l for cands in candidates for l in cands]
        scores = self.log_likelihood(flat).view(B, K) / tau
        if detach_negatives:
            scores = torch.cat([scores[:, :1], scores[:, 1:].detach()], 1)
        return scores

    def conditioning_features(self, batch: dict[str, Any], seed: int = 0) -> list[torch.Tensor]:
        prefix, pad = self.prefix(batch)
        a = self.normalizer.action(torch.as_tensor(batch["action"], dtype=torch.float32, device=self.device))
        _, hidden = self.logits(prefix, pad, self.tokenize(a)[:, :-1], keep=True)
        return hidden
