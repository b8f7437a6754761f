"""What a guided policy sends: candidates drawn in one batch, a hard check, or a hold.

Guidance makes a constraint likely, not certain: a guided chunk can still pass through an obstacle
(the cost is soft, the tilt finite, and the network may have no detour in its distribution). On an
arm that is a collision. So before a chunk is sent, ``choose_chunk`` checks the waypoints that will
execute against the hard constraint (``feasible``: e.g. every gripper key point outside every
obstacle) and sends the lowest-cost candidate that passes; when none passes after ``retries`` more
draws it returns ``None`` and the caller holds. Candidates are one batch through the network
(``candidates`` x the batch size, one pass per flow step), so on a tiny network N candidates cost
far less than N sequential passes; the cost is evaluated once per candidate, and both are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from envs.errors import InvalidOptionError
from policies.flow import _expand


@dataclass(frozen=True)
class ChunkCheck:
    """How the chunk to send is chosen (``candidates=1, retries=0``: the guided sample, checked)."""

    candidates: int = 1
    """samples drawn in one batch; the lowest-cost one that passes the check is sent"""
    retries: int = 0
    """fresh batches drawn when no candidate passes; then the robot holds"""
    retry_candidates: int | None = None
    """samples in each retry batch (None: ``candidates``). Where the first guided sample fails the check, the
    guided distribution at that state is mostly infeasible, and a hold leaves the state (and so the
    distribution) as it was: a wider second draw finds the feasible part without losing a step"""

    def __post_init__(self) -> None:
        for name in ("candidates", "retries", "retry_candidates"):
            v = getattr(self, name)
            if name == "retry_candidates" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "retries" else 1):
                raise InvalidOptionError(f"ChunkCheck.{name} must be an integer >= {0 if name == 'retries' else 1}; "
                                         f"got {v!r}")

    @property
    def draws(self) -> int:
        """The most candidates one plan can draw."""
        return self.candidates + self.retries * (self.retry_candidates or self.candidates)


@dataclass
class ChoiceStats:
    """What choosing one chunk cost and found (summed over draws)."""

    draws: int = 0
    nfe: int = 0
    """network evaluations, each of ``candidates`` x batch samples"""
    cost_evals: int = 0
    rejected: int = 0
    """candidates that failed the check"""
    held: bool = False
    nonfinite: int = 0


def choose_chunk(policy: Any, batch: dict[str, Any], check: ChunkCheck, *, guide: Any = None,
                 cost: Callable[[Tensor], Tensor] | None = None,
                 feasible: Callable[[Tensor], Tensor] | None = None,
                 n_exec: int | None = None, **sampling: Any) -> tuple[Tensor | None, ChoiceStats]:
    """A normalized chunk (1, H, A) for a one-observation ``batch``, or ``None``: hold.

    ``cost(x) -> (N,)`` ranks candidates (lower first; None: the first passing one); ``feasible(x)
    -> (N,) bool`` is the hard check, given the first ``n_exec`` steps (the ones that will execute
    before the next plan; None: the whole chunk). A non-finite candidate or cost never passes.
    ``sampling`` goes to ``policy.sample_chunks`` (e.g. ``n_steps``)."""
    if guide is not None and guide.needs_network_grad:
        raise InvalidOptionError(f"choose_chunk draws candidates without gradients through the network; guidance "
                                 f"{guide.name!r} needs them (use coupled or particles)")
    first = next(iter(v for v in batch.values() if not isinstance(v, dict)))
    if len(first) != 1:
        raise InvalidOptionError(f"choose_chunk takes one observation; the batch has {len(first)}")
    stats = ChoiceStats()
    for draw in range(1 + check.retries):
        n = check.candidates if draw == 0 else check.retry_candidates or check.candidates
        many = _expand(batch, n) if n > 1 else batch
        with torch.no_grad():
            x, st = policy.sample_chunks(many, guide=guide, return_stats=True, **sampling)
            stats.draws += 1
            stats.nfe += st.nfe
            ok = torch.isfinite(x.flatten(1)).all(1)
            stats.nonfinite += int((~ok).sum())
            if feasible is not None:
                ok &= feasible(x[:, :n_exec] if n_exec else x).to(torch.bool)
            score = torch.zeros(x.shape[0])
            if cost is not None:
                score = cost(x).detach().double().cpu()
                stats.cost_evals += x.shape[0]
                ok &= torch.isfinite(score)
        stats.rejected += int((~ok).sum())
        if bool(ok.any()):
            k = int(torch.where(ok, score, torch.full_like(score, float("inf"))).argmin())
            return x[k:k + 1], stats
    stats.held = True
    return None, stats
