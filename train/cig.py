"""Counterfactual Instruction Grounding: make the demonstrated chunk identify its instruction.

For a demo (o, a, l*) and counterfactual instructions C (other tasks feasible in the same scene;
never a paraphrase of l*), with scores s(l) (AR: exact log p(a | o, l); flow: -E(a | o, l) / tau
with the (t, x0) draws shared by all candidates):

    L_CIG = -log softmax_{l in {l*} u C} s(l) [l*],      L = L_BC + lambda * L_CIG

Variants (``CIGOptions.variant``): ``full`` (as above), ``detached`` (counterfactual scores carry
no gradient: the model cannot satisfy the loss by making actions under l' arbitrary),
``bounded`` (hinge on s(l*) - s(l') with a margin), ``pmi`` (hinge on s(l*) - s(null), the
language-free branch).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from envs.suite import normalize
from policies.model import NULL_INSTRUCTION


class CounterfactualSampler:
    """Draws K counterfactual instructions per sample.

    Hard negatives first: instructions of other tasks demonstrated from the same scene (same
    episode seed in the data, or any task of the suite when all share one scene); then the other
    tasks of the suite. Paraphrases of the commanded instruction are never drawn."""

    def __init__(self, instructions: list[str], k: int, paraphrases: dict[str, list[str]] | None = None,
                 same_scene: dict[str, list[str]] | None = None):
        uniq = list(dict.fromkeys(instructions))
        if len({normalize(s) for s in uniq}) != len(uniq):
            dup = [s for s, n in Counter(normalize(s) for s in uniq).items() if n > 1]
            raise ValueError(f"instruction set has duplicates (after normalization): {dup}")
        self.instructions = uniq
        self.k = int(k)
        para = {normalize(p) for ps in (paraphrases or {}).values() for p in ps}
        self.same_scene = same_scene or {}
        self.pool: dict[str, list[str]] = {}
        self.n_hard: dict[str, int] = {}
        for l in uniq:
            own = {normalize(l)} | {normalize(p) for p in (paraphrases or {}).get(l, [])}
            hard = [c for c in self.same_scene.get(l, []) if normalize(c) not in own]
            rest = [c for c in uniq if normalize(c) not in own and c not in hard and normalize(c) not in para]
            self.pool[l] = hard + rest
            self.n_hard[l] = len(hard)
        short = {l: len(p) for l, p in self.pool.items() if len(p) < self.k}
        if short:
            raise ValueError(f"K={self.k} counterfactuals requested but only {min(short.values())} available for "
                             f"{next(iter(short))!r} (instruction set: {uniq})")
        self.used: Counter = Counter()

    def draw(self, commanded: list[str], gen: torch.Generator) -> list[list[str]]:
        out = []
        for l in commanded:
            pool = self.pool[l]
            nh = self.n_hard[l]
            # hard negatives first (shuffled among themselves), then the rest of the suite
            hard = [pool[i] for i in torch.randperm(nh, generator=gen).tolist()] if nh else []
            rest = [pool[nh + i] for i in torch.randperm(len(pool) - nh, generator=gen).tolist()]
            neg = (hard + rest)[: self.k]
            self.used.update((l, n) for n in neg)
            out.append([l] + neg)
        return out

    def report(self) -> dict[str, int]:
        return {f"{a} -> {b}": n for (a, b), n in sorted(self.used.items())}


class CIGObjective:
    def __init__(self, policy: Any, data: Any, options: Any, seed: int = 0,
                 paraphrases: dict[str, list[str]] | None = None):
        self.policy, self.opt = policy, options
        if options.batch < 0:
            raise ValueError(f"CIG batch must be >= 0 (0: the whole batch), got {options.batch}")
        if options.paraphrases_as_negatives:
            raise ValueError("paraphrases are not counterfactual instructions; refusing paraphrases_as_negatives")
        # every task of our suites is feasible from every initial state: same scene = whole suite
        same = {l: [c for c in data.instructions if c != l] for l in data.instructions}
        if len(data.instructions) < 2:
            raise ValueError(f"CIG needs at least 2 instructions in the data, found {data.instructions}")
        self.sampler = CounterfactualSampler(data.instructions, options.negatives, paraphrases, same)
        policy.lang.warm(data.instructions)

    def scores(self, batch: dict[str, Any], cands: list[list[str]], gen: torch.Generator) -> torch.Tensor:
        p, o = self.policy, self.opt
        if p.config.kind == "flow":
            E = p.energies(batch, cands, n_draws=o.draws, generator=gen,
                           detach_negatives=o.variant == "detached")
            return -E / (o.tau or 0.1)
        s = p.instruction_scores(batch, cands, tau=o.tau or 1.0)
        if o.variant == "detached":
            s = torch.cat([s[:, :1], s[:, 1:].detach()], 1)
        return s

    def loss(self, batch: dict[str, Any], gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        o = self.opt
        n = len(batch["instruction"])
        if 0 < o.batch < n:  # the first o.batch samples (batches are already shuffled)
            batch = {k: (v[: o.batch] if hasattr(v, "__len__") and not isinstance(v, str) and len(v) == n else v)
                     for k, v in batch.items()}
        cands = self.sampler.draw(list(batch["instruction"]), gen)
        if o.variant == "pmi":
            cands = [[c[0], NULL_INSTRUCTION] for c in cands]
            s = self.scores(batch, cands, gen)
            loss = F.relu(o.margin - (s[:, 0] - s[:, 1].detach())).mean()
        else:
            s = self.scores(batch, cands, gen)
            if o.variant == "bounded":
                loss = F.relu(o.margin - (s[:, :1] - s[:, 1:])).mean()
            else:
                loss = F.cross_entropy(s, torch.zeros(s.shape[0], dtype=torch.long, device=s.device))
        with torch.no_grad():
            acc = (s.argmax(1) == 0).float().mean()
        return loss, {"loss_cig": float(loss.detach()), "cig_id_acc": float(acc),
                      "score_commanded": float(s[:, 0].mean().detach()),
                      "score_counterfactual": float(s[:, 1:].mean().detach())}


@torch.no_grad()
def identification_accuracy(policy: Any, data: Any, n: int = 256, seed: int = 0, k: int | None = None,
                            per_sample: bool = False) -> Any:
    """Fraction of held-out samples whose demonstrated chunk scores its own instruction highest
    among all suite instructions (``per_sample``: the (indices, hits) behind it instead)."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(data), size=min(n, len(data)), replace=False)
    batch = data.batch(idx)
    instrs = data.instructions
    cands = [[l] + [c for c in instrs if c != l][: (k or len(instrs) - 1)] for l in batch["instruction"]]
    gen = torch.Generator().manual_seed(seed)
    policy.eval()
    s = policy.instruction_scores(batch, cands, generator=gen) if policy.config.kind == "flow" else \
        policy.instruction_scores(batch, cands)
    hits = (s.argmax(1) == 0).numpy()
    return (idx, hits) if per_sample else float(hits.mean())
