"""Counterfactual Instruction Grounding: make the demonstrated chunk identify its instruction.

For a demo (o, a, l*) and counterfactual instructions C (other tasks feasible in the same scene;
never a paraphrase of l*), with scores s(l) (AR: exact log p(a | o, l); flow: -E(a | o, l) / tau
with the (t, x0) draws shared by all candidates):

    L_CIG = -log softmax_{l in {l*} u C} s(l) [l*],      L = L_BC + lambda * L_CIG

Options (``CIGOptions``), the loss (:func:`cig_loss`, pure on the scores) and the training-time
objective (``CIGObjective``) live here; the scores are the policy's ``instruction_scores``.

Variants (``CIGOptions.variant``): ``full`` (as above), ``detached`` (counterfactual scores carry
no gradient: the model cannot satisfy the loss by making actions under l' arbitrary),
``bounded`` (hinge on s(l*) - s(l') with a margin), ``pmi`` (hinge on s(l*) - s(null), the
language-free branch).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import torch
import tyro
from torch.nn import functional as F

from envs.suite import normalize
from policies.model import NULL_INSTRUCTION

VARIANTS = ("full", "detached", "bounded", "pmi")


@dataclass
class CIGOptions:
    """Counterfactual Instruction Grounding: ``--cig.*`` of ``groundflow train``.

    The defaults are not the recommended configuration: ``--cig.weight`` alone trains the ``detached``
    variant, as it always has (changing the default would change what existing commands train). The
    grounding benchmark's best (bounded, lambda 1, K=3, M=2, the term on 64 samples of each batch) is
    ``groundflow train --recipe multitask_cig`` (train/recipes.py), which the benchmarks and the demo use."""

    weight: Annotated[float, tyro.conf.arg(aliases=("--cig-weight",))] = 0.0
    """lambda: weight of L_CIG in L = L_BC + lambda * L_CIG (0: plain BC)"""
    negatives: int = 3
    """K counterfactual instructions per sample"""
    tau: float | None = None
    """score temperature: flow s(l) = -E/tau, AR s(l) = log p / tau (None: the policy family's
    ``score_tau``)"""
    draws: int = 4
    """M shared (t, x0) draws per flow energy"""
    variant: Literal["full", "detached", "bounded", "pmi"] = "detached"
    """full: gradient through every energy; detached: counterfactual energies detached (DESIGN.md's
    probe kept ~73% with it); bounded: hinge on the margin (the recommended one: ``--recipe multitask_cig``);
    pmi: log p(a|o,l*) - log p(a|o,null)"""
    margin: float = 1.0
    """bounded variant: hinge margin on s(l*) - s(l')"""
    batch: int = 0
    """samples of each batch that get the CIG term (0: all); the term costs ~5x a BC step on the
    whole batch, so a joint run can apply it to a sub-batch"""
    max_progress: float = 1.0
    """the term only on samples at most this far into their demo (episode progress in [0, 1]; 1: all).
    Tried as a fix for joint CIG's mid-episode switches (the contrast's push on the l' conditional at
    later states of l says "not a_l", nothing about what to do): measured no better there (tabletop,
    3 seeds, max_progress 0.25) and 4 points lower in distribution; README, grounding section"""
    demonstrated_radius: float = 0.0
    """> 0: an instruction l' is no counterfactual for a sample when the data demonstrates it there:
    some sample of l' lies within this multiple of the distance from the sample to the nearest
    sample of l* in another episode (standardized state + action chunk). Tasks that share a
    prefix (the same object picked for two receptacles) act alike until they part; contrasting
    them there asks the l' conditional to be wrong on its own demos. 0: off (every other task)"""
    paraphrases_as_negatives: bool = False
    """never True in practice: a paraphrase is not a counterfactual (kept for the ablation guard)"""


def cig_loss(scores: torch.Tensor, variant: str, margin: float = 1.0,
             valid: torch.Tensor | None = None) -> torch.Tensor:
    """L_CIG from (B, K) scores whose column 0 is the commanded instruction.

    full / detached: -log softmax(s)[0] (detached differs only in how the scores were computed);
    bounded: mean_k relu(margin - (s_0 - s_k)); pmi (K = 2, column 1 the null instruction):
    relu(margin - (s_0 - sg(s_1))). ``valid`` (B, K - 1) bool: which counterfactual columns count
    (every row needs one); None: all."""
    if variant == "pmi":
        return F.relu(margin - (scores[:, 0] - scores[:, 1].detach())).mean()
    if valid is not None:
        valid = valid.to(scores.device)
        if not bool(valid.any(1).all()):
            raise ValueError("cig_loss: every row needs at least one valid counterfactual")
    if variant == "bounded":
        hinge = F.relu(margin - (scores[:, :1] - scores[:, 1:]))
        return hinge.mean() if valid is None else (hinge * valid).sum() / valid.sum()
    if variant in ("full", "detached"):
        if valid is not None:
            scores = _mask_invalid(scores, valid)
        return F.cross_entropy(scores, torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device))
    raise ValueError(f"unknown CIG variant {variant!r}; valid: {', '.join(VARIANTS)}")


def _mask_invalid(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, K) scores with the counterfactual columns that do not count (``valid`` False) at -inf."""
    keep = torch.cat([torch.ones_like(valid[:, :1]), valid.to(scores.device)], 1)
    return scores.masked_fill(~keep, float("-inf"))


def whole_suite_scenes(instructions: list[str]) -> dict[str, list[str]]:
    """Hard negatives when every task of the suite is feasible from every initial state (true of
    the tabletop and kitchen suites): each instruction's same-scene alternatives are all others."""
    return {l: [c for c in instructions if c != l] for l in instructions}


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

    def draw(self, commanded: list[str], gen: torch.Generator,
             excluded: list[set[str]] | None = None) -> list[list[str]]:
        """``[l*] + K negatives`` per sample. ``excluded[i]``: instructions that are no
        counterfactual for sample ``i`` (the data demonstrates them there); they are drawn only
        after every other candidate, so a sample gets them only when fewer than K others exist."""
        out = []
        for i, l in enumerate(commanded):
            pool = self.pool[l]
            nh = self.n_hard[l]
            # hard negatives first (shuffled among themselves), then the rest of the suite
            hard = [pool[i] for i in torch.randperm(nh, generator=gen).tolist()] if nh else []
            rest = [pool[nh + i] for i in torch.randperm(len(pool) - nh, generator=gen).tolist()]
            order = hard + rest
            if excluded is not None and excluded[i]:
                order = [c for c in order if c not in excluded[i]] + [c for c in order if c in excluded[i]]
            neg = order[: self.k]
            self.used.update((l, n) for n in neg)
            out.append([l] + neg)
        return out

    def report(self) -> dict[str, int]:
        return {f"{a} -> {b}": n for (a, b), n in sorted(self.used.items())}


class CIGObjective:
    """L_CIG on training batches: draws the counterfactuals, scores them through the policy's
    ``instruction_scores`` and applies :func:`cig_loss`.

    ``same_scene`` maps each instruction to the others demonstrated from the same scenes (hard
    negatives, drawn first); default :func:`whole_suite_scenes`."""

    def __init__(self, policy: Any, data: Any, options: CIGOptions, seed: int = 0,
                 paraphrases: dict[str, list[str]] | None = None, same_scene: dict[str, list[str]] | None = None):
        self.policy, self.opt = policy, options
        if options.batch < 0:
            raise ValueError(f"CIG batch must be >= 0 (0: the whole batch), got {options.batch}")
        if not 0.0 < options.max_progress <= 1.0:
            raise ValueError(f"CIG max_progress must be in (0, 1] (episode progress), got {options.max_progress}")
        if options.paraphrases_as_negatives:
            raise ValueError("paraphrases are not counterfactual instructions; refusing paraphrases_as_negatives")
        if len(data.instructions) < 2:
            raise ValueError(f"CIG needs at least 2 instructions in the data, found {data.instructions}")
        if options.demonstrated_radius < 0:
            raise ValueError(f"CIG demonstrated_radius must be >= 0 (0: off), got {options.demonstrated_radius}")
        same = whole_suite_scenes(data.instructions) if same_scene is None else same_scene
        self.sampler = CounterfactualSampler(data.instructions, options.negatives, paraphrases, same)
        self.demonstrated: np.ndarray | None = None
        """(N, n_instructions) bool: the data demonstrates instruction j (``sampler.instructions[j]``,
        the data's instructions in order) at sample i: no counterfactual there"""
        if options.demonstrated_radius > 0:
            self.demonstrated = demonstrated_elsewhere(data, options.demonstrated_radius)
        policy.lang.warm(data.instructions)

    def scores(self, batch: dict[str, Any], candidates: list[list[str]], gen: torch.Generator) -> torch.Tensor:
        o = self.opt
        return self.policy.instruction_scores(batch, candidates, tau=o.tau, draws=o.draws, generator=gen,
                                              detach_negatives=o.variant == "detached")

    def loss(self, batch: dict[str, Any], gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        o = self.opt
        n = len(batch["instruction"])
        keep = np.arange(n)
        if o.max_progress < 1.0:
            if batch.get("progress") is None:
                raise ValueError("CIG max_progress < 1 needs the batch's episode progress (ChunkData batches carry it)")
            prog = batch["progress"]
            prog = prog.detach().cpu().numpy() if torch.is_tensor(prog) else np.asarray(prog)
            keep = np.flatnonzero(prog <= o.max_progress)
            if not len(keep):  # no early sample in this batch: no term, the BC step goes on
                return torch.zeros(()), {"loss_cig": 0.0, "cig_samples": 0.0}
        if 0 < o.batch < len(keep):  # the first o.batch of them (batches are already shuffled)
            keep = keep[: o.batch]
        if len(keep) < n:
            batch = {k: _take(v, keep, n) for k, v in batch.items()}
        valid = excluded = None
        if self.demonstrated is not None and o.variant != "pmi":
            if batch.get("index") is None:
                raise ValueError("CIG demonstrated_radius > 0 needs the batch's sample index (ChunkData batches carry it)")
            idx = np.asarray(batch["index"])
            names = self.sampler.instructions
            excluded = [{names[j] for j in np.flatnonzero(row)} for row in self.demonstrated[idx]]
        candidates = self.sampler.draw(list(batch["instruction"]), gen, excluded)
        if excluded is not None:
            valid = torch.tensor([[c not in ex for c in cand[1:]] for cand, ex in zip(candidates, excluded)])
            rows = np.flatnonzero(valid.any(1).numpy())
            if not len(rows):  # every sample here is where its tasks still act alike: no term
                return torch.zeros(()), {"loss_cig": 0.0, "cig_samples": 0.0}
            if len(rows) < len(candidates):
                batch = {k: _take(v, rows, len(candidates)) for k, v in batch.items()}
                candidates, valid = [candidates[r] for r in rows], valid[torch.as_tensor(rows)]
        if o.variant == "pmi":
            candidates = [[c[0], NULL_INSTRUCTION] for c in candidates]
        scores = self.scores(batch, candidates, gen)
        loss = cig_loss(scores, o.variant, o.margin, valid)
        with torch.no_grad():
            acc = ((scores if valid is None else _mask_invalid(scores, valid)).argmax(1) == 0).float().mean()
        return loss, {"loss_cig": float(loss.detach()), "cig_id_acc": float(acc), "cig_samples": float(len(candidates)),
                      "score_commanded": float(scores[:, 0].mean().detach()),
                      "score_counterfactual": float(scores[:, 1:].mean().detach())}


def demonstrated_elsewhere(data: Any, radius: float, chunk: int = 1024) -> np.ndarray:
    """(N, n_instructions) bool: instruction j is demonstrated at sample i, i.e. some sample of j
    lies within ``radius`` x the distance from i to the nearest sample of its own instruction in
    another episode. Points are the standardized state and action chunk (``data.horizon`` steps),
    each block scaled by 1/sqrt(its width) so neither dominates. A sample's own instruction is
    never marked; an instruction with one episode has no reference distance (nothing marked)."""
    H = data.horizon
    t = np.arange(len(data)) - data.start
    steps = np.minimum(t[:, None] + np.arange(H)[None], data.length[:, None] - 1)
    act = data.action[data.start[:, None] + steps].reshape(len(data), -1)

    def z(x: np.ndarray) -> np.ndarray:
        x = (x - x.mean(0)) / (x.std(0) + 1e-6)
        return x / np.sqrt(x.shape[1])
    pts = torch.as_tensor(np.concatenate([z(data.state), z(act)], 1), dtype=torch.float32)
    names = list(data.instructions)
    lab = np.array([names.index(l) for l in data.instruction])
    ep = torch.as_tensor(data.episode)
    groups = [torch.as_tensor(np.flatnonzero(lab == j)) for j in range(len(names))]
    out = np.zeros((len(data), len(names)), dtype=bool)
    for a in range(0, len(data), chunk):
        rows = slice(a, min(a + chunk, len(data)))
        near = torch.full((rows.stop - a, len(names)), float("inf"))
        for j, g in enumerate(groups):
            d = torch.cdist(pts[rows], pts[g])
            d[ep[rows][:, None] == ep[g][None]] = float("inf")  # another episode only
            near[:, j] = d.min(1).values
        own = near[torch.arange(len(near)), torch.as_tensor(lab[rows])]
        hit = (near <= radius * own[:, None]) & torch.isfinite(own)[:, None]
        hit[torch.arange(len(near)), torch.as_tensor(lab[rows])] = False
        out[rows] = hit.numpy()
    return out


def _take(v: Any, idx: np.ndarray, n: int) -> Any:
    """Rows ``idx`` of a per-sample batch entry (tensor, array or list of length ``n``); other
    entries as they are."""
    if isinstance(v, str) or not hasattr(v, "__len__") or len(v) != n:
        return v
    if torch.is_tensor(v):
        return v[torch.as_tensor(idx, device=v.device)]
    if isinstance(v, np.ndarray):
        return v[idx]
    return [v[i] for i in idx]


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
    s = policy.instruction_scores(batch, cands, generator=gen)
    hits = (s.argmax(1) == 0).numpy()
    return (idx, hits) if per_sample else float(hits.mean())
