"""Counterfactual world-model debugging: which steps' model errors caused the real-vs-model gap?

    from deploy.debugging.search import DebugConfig, Outcome, debug
    result = debug(model_env, policy, real_episode, DebugConfig(outcome=Outcome("return")))
    result.causal            # ranked steps: marginal effect, error type, error size
    result.to_dict()         # raw numbers (JSON)

``f(S)`` is the outcome of a hybrid rollout: the policy runs in the world model from the real
initial state, and the model's residuals along the real trajectory are added at the steps in
``S`` (see :mod:`deploy.debugging.rollouts`). ``f({})`` is the model's promise, ``f(all)`` the real
outcome. A patch *reproduces* the real outcome when ``|f(S) - f(all)| <= tol`` with
``tol = max(abs_tol, rel_tol * |f(all) - f({})|)``.

Search (``attribute``): QuickXplain-style divide and conquer over time. The candidate steps are
split into an earlier and a later half; if patching the earlier half (together with what is
already known to be needed) reproduces the outcome, the later half changes nothing and is
dropped whole; otherwise the later half is searched with the earlier half kept patched, then
the earlier half with only the later half's culprits kept -- which is how interacting causes
(needed together) are found. With ``k`` causes among ``T`` steps this takes about
``2 k log2(T / k) + k`` rollouts. The result ``S*`` is 1-minimal. If the outcome is still
reproduced with ``S*`` removed, redundant causes exist (either alone suffices); they are
searched again in what remains (``alternatives``). Each causal step is ranked by its marginal
effect ``f(S*) - f(S* \\ {t})`` and typed by which channel (state, reward, observation) of its
residual carries the effect.

``exhaustive_ablation`` is the reference: one rollout per step, ``f(all) - f(all \\ {t})``, ``C + 2`` in all
for the ``C`` steps with a nonzero residual (``T + 2`` when every step has one).

Rollout budget. The budget ``B`` is ``max_rollouts``, by default what exhaustive ablation costs (``C + 2``);
a ``max_rollouts`` below that raises :class:`DebuggingError` (no search can promise a complete answer within
it: with many causes, single-step ablation is the cheapest search there is). The search tracks the smallest
patch ``X`` known to reproduce the outcome and queries a new patch only while single-step ablation of ``X``
(``|X|`` rollouts, plus one to check the result) would still fit afterwards; otherwise (many causes,
k ~ T / log T, or strongly interacting errors) it switches to that ablation, relative to ``X``, reusing
cached rollouts. Near the budget it drops the earlier half first (the cheapest way to shrink ``X`` when
the later half holds a cause). No search can open within ``B`` alone: at first ``X`` is every candidate,
ablating it costs all of ``B``, and a query that does not reproduce drops nothing (were every step a
cause, every query of more than one step would be wasted). So the search opens with one guess -- patching
only the larger half of the residuals (normalized size, ``C >= 4``) reproduces the outcome -- and may risk
``rollout_slack`` rollouts beyond ``B`` while ``X`` is still every candidate, never once it has dropped a
step. The risk is taken only under the default budget: a ``max_rollouts`` the user sets is a hard cap
(``rollout_slack`` defaults to 0 there), and the search opens only where its guess fits in it, else it
is single-step ablation. Under the default budget the attribution spends at most ``B + rollout_slack``
rollouts, and at most ``B`` whenever the guess holds (the causes are among the larger errors; big
harmless errors in that half cost a query or two). The default slack, 8, lets a search whose guess
failed still try a few halvings before it commits to ablation: with a slack of 2 (the guess and the
check only) a failed guess went straight to single-step ablation, and on Adroit door (T = 500, k = 2
teleports) that cost 503 rollouts and an unverified answer of 11 steps, where the search with 8 finds
the 2 exact steps in 33. Under a hard cap a search over an episode with a residual at every step cannot
open, and ablation's check of ``S*`` is skipped where it does not fit (the answer says it is unverified).
Marginal effects, alternatives and channel typing only spend what is left of ``B``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from deploy.debugging.rollouts import (CHANNELS, NC, DebuggingError, EnvModel, HybridRollouts, ModelStateError,
                                       Outcome, Residuals, RolloutBudgetExceeded, StateLayoutError, TrajectoryError,
                                       action_reproduction_error, compute_residuals, real_trajectory)
from envs.base import GroundflowEnv
from dataset import Episode

__all__ = ["DebugConfig", "Outcome", "Attribution", "StepAttribution", "Ablation", "Prepared", "debug", "prepare",
           "attribute", "exhaustive_ablation", "DebuggingError", "TrajectoryError", "StateLayoutError",
           "ModelStateError", "RolloutBudgetExceeded"]


@dataclass
class DebugConfig:
    outcome: Outcome = field(default_factory=Outcome)
    rel_tol: float = 0.1
    """a patch reproduces the real outcome within rel_tol * |gap| ..."""
    abs_tol: float = 1e-6
    """... and never tighter than abs_tol (outcome units)"""
    min_gap: float = 0.0
    """a gap |f(all) - f({})| at or below this is "no gap": nothing is attributed ..."""
    min_gap_rel: float = 1e-6
    """... nor at or below this fraction of the outcome's magnitude (float round-off)"""
    find_alternatives: bool = True
    """search again for redundant causes when the outcome survives removing S*"""
    max_alternatives: int = 3
    explain_channels: bool = True
    """type each causal step by removing one residual channel at a time (extra rollouts)"""
    dense_fraction: float = 0.25
    """|S*| above this fraction of the candidate steps: report the gap as dense"""
    max_rollouts: int | None = None
    """rollout budget B (None: what exhaustive ablation costs, candidates + 2; below that raises
    DebuggingError): the search switches to single-step ablation rather than exceed it. A value set here
    is a hard cap; the default budget is exceeded only when the opening guess fails, by at most
    rollout_slack (see the module docstring)"""
    rollout_slack: int | None = None
    """rollouts the search may risk beyond the budget before it has dropped any step (its opening guess
    and the check of the result). None: 8 under the default budget, 0 (a hard cap) when max_rollouts is
    set; with 0 a search over an episode with a residual at every step cannot open"""

    @property
    def slack(self) -> int:
        """The rollout_slack in force (see rollout_slack)."""
        if self.rollout_slack is not None:
            return self.rollout_slack
        return 8 if self.max_rollouts is None else 0
    checkpoint_stride: int | None = None
    check_actions: bool = True
    """check that the policy reproduces the recorded actions (deterministic, same checkpoint)"""
    seed: int = 0

    def validate(self) -> "DebugConfig":
        for name in ("rel_tol", "abs_tol", "min_gap", "min_gap_rel"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise DebuggingError(f"{name} must be a finite number >= 0, got {v}")
        if self.rel_tol >= 1:
            raise DebuggingError(f"rel_tol must be < 1 (a fraction of the gap), got {self.rel_tol}")
        if (self.rollout_slack is not None and self.rollout_slack < 0) or (self.max_rollouts is not None and self.max_rollouts < 0):
            raise DebuggingError(f"max_rollouts and rollout_slack must be >= 0, got {self.max_rollouts}, "
                                 f"{self.rollout_slack}")
        return self


@dataclass
class StepAttribution:
    step: int
    effect: float
    """f(S*) - f(S* without this step): how much of the outcome this step's error carries"""
    error_type: str
    """state | reward | observation | combined (the channel whose removal changes the outcome most) |
    untyped (no rollouts left in the budget to remove channels)"""
    channel_effects: dict[str, float]
    size: dict[str, float]
    """L2 norm of the residual per channel"""
    normalized_size: dict[str, float]
    """size relative to the trajectory's own scale (comparable across channels)"""
    cause_set: int = 0
    """0: the primary causal set S*; i > 0: the i-th alternative (redundant) set"""


@dataclass
class Attribution:
    env_id: str
    T: int
    outcome: str
    model_outcome: float
    hybrid_real_outcome: float
    real_outcome: float | None
    gap: float
    tol: float
    no_gap: bool
    message: str
    causal: list[StepAttribution] = field(default_factory=list)
    causal_sets: list[list[int]] = field(default_factory=list)
    causal_outcome: float | None = None
    verified: bool = True
    """f(S*) reproduces f(all) within tol (False too where a hard cap left no rollout to check it:
    causal_outcome None)"""
    dense: bool = False
    fell_back: bool = False
    """divide and conquer would have exceeded the rollout budget: it finished with single-step ablation"""
    rollout_budget: int = 0
    """B (max_rollouts, default exhaustive ablation's candidates + 2): spent at most, unless the
    budget is the default one and the search's opening guess failed (then at most B + rollout_slack)"""
    reproduction_error: float | None = None
    action_error: float | None = None
    candidates: int = 0
    rollouts: int = 0
    search_rollouts: int = 0
    explain_rollouts: int = 0
    steps_simulated: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)
    magnitudes: np.ndarray | None = None
    normalized_magnitudes: np.ndarray | None = None
    traces: dict[str, list[float]] = field(default_factory=dict)

    @property
    def steps(self) -> list[int]:
        """Every causal step (primary and alternative sets), sorted."""
        return sorted({s for S in self.causal_sets for s in S})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("magnitudes", "normalized_magnitudes"):
            per_step = getattr(self, name)
            out[name] = None if per_step is None else {c: per_step[:, k].tolist() for k, c in enumerate(CHANNELS)}
        return out


# ----- setup -----------------------------------------------------------------------------------

@dataclass
class Prepared:
    model: EnvModel
    engine: HybridRollouts
    residuals: Residuals
    candidates: list[int]
    action_error: float | None
    config: DebugConfig | None = None

    def fresh_engine(self) -> HybridRollouts:
        """A new engine on the same residuals with an empty cache (for fair rollout counts)."""
        eng = self.engine
        return HybridRollouts(eng.model, eng.policy.policy, eng.traj, eng.res, eng.outcome, eng.stride,
                              self.config.seed if self.config else 0)


def prepare(model_env: GroundflowEnv, policy: Any, episode: Episode, config: DebugConfig,
            on_rollout: Callable[[HybridRollouts], None] | None = None) -> Prepared:
    """Validate inputs, compute residuals, and build the hybrid-rollout engine."""
    config.validate()
    model = EnvModel(model_env)
    traj = real_trajectory(episode, model)
    config.outcome.validate(model.obs_dim)
    residuals = compute_residuals(model, traj)
    for channel in range(NC):
        bad = ~np.all(np.isfinite(residuals.channel(channel)), axis=1)
        if bad.any():
            raise TrajectoryError(f"{CHANNELS[channel]} residuals are NaN/inf at steps "
                                  f"{np.flatnonzero(bad)[:10].tolist()} (the world model {model.env_id} diverged on "
                                  "the real states)")
    act_err = action_reproduction_error(model, policy, traj) if config.check_actions else None
    engine = HybridRollouts(model, policy, traj, residuals, config.outcome, config.checkpoint_stride, config.seed,
                            on_rollout)
    nonzero = residuals.magnitudes().max(axis=1) > 0
    return Prepared(model, engine, residuals, np.flatnonzero(nonzero).tolist(), act_err, config)


# ----- search ----------------------------------------------------------------------------------

class _OverBudget(Exception):
    """A search query could leave too few rollouts to finish by single-step ablation."""


@dataclass
class _Budget:
    """Rollout accounting that keeps search + fallback within ``cap`` -- within ``cap + risk`` while
    nothing is dropped yet (``X`` is every candidate; see the module docstring)."""
    cap: int
    eng: HybridRollouts
    X: frozenset = frozenset()
    """smallest patch (steps) known to reproduce: the fallback ablates it, one rollout per step"""
    risk: int = 0
    """rollout_slack: what a search that has not dropped anything may risk beyond cap"""
    candidates: int = 0

    def ceiling(self) -> int:
        return self.cap + (self.risk if len(self.X) >= self.candidates else 0)

    def slack(self) -> int:
        """Rollouts to spare after ablating X and checking the result."""
        return self.ceiling() - self.eng.rollouts - len(self.X) - 1

    def affords(self, patches: list[frozenset]) -> bool:
        """Whether these patches (cached ones are free) and one more rollout fit in the ceiling."""
        return self.eng.rollouts + len({p for p in patches if p not in self.eng.memo}) + 1 <= self.ceiling()


def _quickxplain(reproduces: Callable[[frozenset], bool], candidates: list[int],
                 budget: _Budget | None = None) -> list[int]:
    """1-minimal subset D of candidates with reproduces(D); assumes reproduces(candidates) and
    not reproduces({}). With ``budget``, keeps ``budget.X`` at the smallest reproducing patch."""

    def track(X: frozenset) -> None:
        if budget is not None:
            budget.X = X

    def qx(B: frozenset, check: bool, C: list[int]) -> list[int]:
        # precondition: reproduces(B | C)
        track(B | frozenset(C))
        if check and reproduces(B):
            track(B)
            return []
        if len(C) == 1:
            return C
        mid = len(C) // 2
        C1, C2 = C[:mid], C[mid:]
        if reproduces(B | frozenset(C1)):  # the later half changes nothing: dropped whole
            return qx(B, False, C1)
        if budget is not None and budget.slack() <= 1 and reproduces(B | frozenset(C2)):
            # nearly out of budget: the earlier half, dropped whole, frees the most rollouts
            return qx(B, False, C2)
        D2 = qx(B | frozenset(C1), False, C2)
        D1 = qx(B | frozenset(D2), True, C1)
        return D1 + D2

    return sorted(qx(frozenset(), False, list(candidates)))


def attribute(prep: Prepared, config: DebugConfig) -> Attribution:
    """Run the search on a prepared engine (see the module docstring)."""
    t_start = time.perf_counter()
    search = _Search(prep, config)
    eng = search.eng
    out = search.baseline()
    min_gap = max(config.min_gap, config.min_gap_rel * max(abs(search.F0), abs(search.FU)))
    if abs(out.gap) <= min_gap or not search.candidates:
        out.no_gap = True
        out.message = search.no_gap_message(min_gap)
        _finish(out, eng, t_start, 0)
        out.traces = search.traces()
        return out
    out.rollout_budget = search.budget.cap
    eng.max_rollouts = None  # the budget below is tighter; the engine's hard cap would lose the fallback
    sets = search.primary_set(out)
    if out.fell_back and not sets[0]:  # single-step ablation found no step that matters on its own
        out.dense, out.verified = True, False
        out.message = search.dense_message()
        _finish(out, eng, t_start, eng.rollouts)
        out.traces = search.traces()
        return out
    search.add_alternatives(sets, out.fell_back)
    causal = search.marginal_effects(out, sets)
    search_rollouts = eng.rollouts
    search.type_errors(causal)
    causal.sort(key=lambda cause: (cause.cause_set, -abs(cause.effect)))
    out.causal, out.causal_sets = causal, sets
    out.dense = len(sets[0]) > config.dense_fraction * max(len(search.candidates), 1)
    out.message = search.result_message(out)
    _finish(out, eng, t_start, search_rollouts)
    out.traces = search.traces(frozenset(sets[0]))
    return out


class _Search:
    """One attribution in progress: the engine, the reference outcomes ``F0 = f({})`` and
    ``FU = f(all)``, the tolerance, the rollout budget, the effects measured so far and the notes
    that end up in the message. The steps run in :func:`attribute`'s order, which fixes the
    order of the (cached) rollouts and therefore the rollout counts and the query history."""

    def __init__(self, prep: Prepared, config: DebugConfig):
        self.prep, self.config = prep, config
        self.eng, self.candidates = prep.engine, prep.candidates
        self.candidate_set = frozenset(self.candidates)
        self.all_items: frozenset = frozenset()
        self.F0 = self.FU = self.tol = 0.0
        self.mags, self.nmags = prep.residuals.magnitudes(), prep.residuals.normalized_magnitudes(self.eng.traj)
        exhaustive = len(self.candidates) + 2  # what exhaustive_ablation costs
        if config.max_rollouts is not None and config.max_rollouts < exhaustive:
            raise DebuggingError(f"max_rollouts = {config.max_rollouts} is below what single-step ablation costs on "
                                 f"this episode ({exhaustive}: {len(self.candidates)} steps with a nonzero residual "
                                 "+ 2): no search can promise to finish within it; raise it or leave it unset "
                                 "(that cost)")
        cap = exhaustive if config.max_rollouts is None else config.max_rollouts
        self.budget = _Budget(cap, self.eng, frozenset(self.candidates), config.slack, len(self.candidates))
        self.notes: list[str] = []
        self.effects: dict[int, float] = {}  # fallback: single-step ablation effects relative to X
        self.context: list[frozenset] = []  # the patch each causal set's effects are measured against

    # ----- reference outcomes ------------------------------------------------------------------
    def baseline(self) -> Attribution:
        """f({}) and f(all), the gap and its tolerance; notes where f(all) may not be the real outcome."""
        eng, config, prep = self.eng, self.config, self.prep
        eng.phase = "baseline"
        self.all_items = eng.items(range(eng.T))
        F0 = self.F0 = eng.f(frozenset())
        FU = self.FU = eng.f(self.all_items)
        real = config.outcome.real_value(eng.traj)
        gap = FU - F0
        tol = self.tol = max(config.abs_tol, config.rel_tol * abs(gap))
        out = Attribution(env_id=prep.model.env_id, T=eng.T, outcome=config.outcome.kind, model_outcome=F0,
                          hybrid_real_outcome=FU, real_outcome=real, gap=gap, tol=tol, no_gap=False, message="",
                          reproduction_error=None if real is None else abs(FU - real),
                          action_error=prep.action_error, candidates=len(self.candidates), magnitudes=self.mags,
                          normalized_magnitudes=self.nmags)
        if prep.action_error is not None and prep.action_error > 1e-4:
            self.notes.append(f"the policy does not reproduce the recorded actions (max |a - a_real| = "
                              f"{prep.action_error:.3g}): a stochastic policy or another checkpoint; f(all) may "
                              "differ from the real outcome")
        if real is not None and abs(FU - real) > max(tol, 1e-6 * max(1.0, abs(real))):
            self.notes.append(f"f(all) = {FU:.6g} does not reproduce the real outcome {real:.6g} (non-additive "
                              "errors, a stochastic policy, or state the model does not carry); attributing the gap "
                              "to f(all)")
        return out

    # ----- queries -----------------------------------------------------------------------------
    def patch(self, steps: Any) -> frozenset:
        """Items of a set of steps; any superset of the candidates is the full patch (cached)."""
        step_set = frozenset(steps)
        return self.all_items if step_set >= self.candidate_set else self.eng.items(step_set)

    def reproduces(self, steps: frozenset) -> bool:
        items = self.patch(steps)
        if items not in self.eng.memo and self.budget.slack() < 1:
            raise _OverBudget
        return abs(self.eng.f(items) - self.FU) <= self.tol

    def minimize(self, S: list[int]) -> list[int]:
        """1-minimality: drop steps whose removal still reproduces (QuickXplain guarantees it only
        for monotone outcomes; patched/unpatched boundaries can make it non-monotone). Its rollouts
        are the marginal effects; a pass the budget cannot afford keeps the last measured set."""
        eng, prev = self.eng, None
        while len(S) > 1:
            patches = [self.patch(set(S) - {t}) for t in S]
            if not self.budget.affords(patches):
                if prev is None:
                    raise _OverBudget
                self.notes.append(f"{len(S) + 1} causal steps are not 1-minimal (rollout budget)")
                return prev
            vals = eng.f_many(patches)
            spare = [(abs(v - self.FU), t) for t, v in zip(S, vals) if abs(v - self.FU) <= self.tol]
            if not spare:
                break
            prev, S = S, [t for t in S if t != min(spare)[1]]
        eng.f(self.patch(S))  # f(S*), needed for the marginal effects: the rollout each pass leaves room for
        return S

    # ----- causal sets -------------------------------------------------------------------------
    def primary_set(self, out: Attribution) -> list[list[int]]:
        """``[S*]`` by divide and conquer, or by single-step ablation when that would exceed the budget."""
        self.eng.phase = "search"
        try:
            return [self.minimize(_quickxplain(self.reproduces, self.opening(), self.budget))]
        except _OverBudget:
            return [self.ablate_fallback(out)]

    def opening(self) -> list[int]:
        """The steps divide and conquer starts from: the larger half of the residuals (normalized size,
        in time order) when patching them alone reproduces the outcome, else every candidate. The one
        query a search risks before it has dropped anything (see the module docstring): when it holds,
        it drops half the steps at once and the search stays within the budget from then on."""
        C = self.candidates
        if len(C) < 4:
            return list(C)
        size = self.nmags[C].max(axis=1)
        larger = sorted(C[i] for i in np.argsort(-size, kind="stable")[:len(C) // 2])
        if not self.reproduces(frozenset(larger)):
            self.notes.append(f"patching only the larger half of the errors ({len(larger)} of {len(C)} steps) does "
                              "not reproduce the outcome: a cause is among the smaller errors, or the gap is dense")
            return list(C)
        self.budget.X = frozenset(larger)
        return larger

    def ablate_fallback(self, out: Attribution) -> list[int]:
        """More causes than a divide-and-conquer search pays off for (k ~ T / log T): finish with the
        reference, single-step ablation, over the steps still in question (X reproduces; the rest
        is known not to matter), reusing cached rollouts."""
        eng = self.eng
        X, spent = sorted(self.budget.X), eng.rollouts
        out.fell_back = True
        eng.phase = "ablation"
        fX = eng.f(self.patch(X))
        vals = eng.f_many([self.patch(set(X) - {t}) for t in X])
        self.effects = {t: fX - v for t, v in zip(X, vals)}
        self.context = [self.patch(X)]
        self.notes.append(f"divide and conquer could not finish within the rollout budget ({self.budget.cap}) and "
                          f"switched to single-step ablation over the {len(X)} of {len(self.candidates)} steps still "
                          f"in question after {spent} rollouts: the errors are too many, interact too much, or a "
                          "cause hides among the small ones")
        return [t for t, v in zip(X, vals) if abs(self.FU - v) > self.tol]

    def add_alternatives(self, sets: list[list[int]], fell_back: bool) -> None:
        """Append redundant causal sets: while the outcome survives removing every set found so far."""
        remaining = [t for t in self.candidates if t not in set(sets[0])]
        self.eng.phase = "alternatives"
        self.budget.X = frozenset()  # abandoning an alternative costs nothing: reserve only its check
        config = self.config
        try:
            while (config.find_alternatives and not fell_back and remaining and len(sets) <= config.max_alternatives
                   and self.reproduces(frozenset(remaining))):
                S = self.minimize(_quickxplain(self.reproduces, remaining))
                sets.append(S)
                remaining = [t for t in remaining if t not in set(S)]
        except _OverBudget:
            self.notes.append("the search for alternative causal sets stopped at the rollout budget")

    # ----- ranking and typing ------------------------------------------------------------------
    def marginal_effects(self, out: Attribution, sets: list[list[int]]) -> list[StepAttribution]:
        """f(S*) (is the outcome reproduced?) and each causal step's marginal effect within its set."""
        eng = self.eng
        self.context += [self.patch(S) for S in sets[len(self.context):]]
        eng.phase = "marginal"
        star = self.patch(frozenset(sets[0]))
        if star in eng.memo or eng.rollouts + 1 <= self.budget.ceiling():
            f_star = eng.f(star)
            out.causal_outcome, out.verified = f_star, abs(f_star - self.FU) <= self.tol
        else:  # a hard cap (rollout_slack = 0) spent on single-step ablation: S* alone is not checked
            out.verified = False
            self.notes.append("f(S*) was not checked (the rollout budget was spent on single-step ablation)")
        causal: list[StepAttribution] = []
        for set_index, S in enumerate(sets):
            fS = eng.f(self.context[set_index])
            without = ([fS - self.effects[t] for t in S] if out.fell_back else
                       eng.f_many([self.patch(set(S) - {t}) for t in S]))
            for t, fw in zip(S, without):
                causal.append(StepAttribution(
                    step=int(t), effect=float(fS - fw), error_type="", channel_effects={},
                    size={name: float(self.mags[t, k]) for k, name in enumerate(CHANNELS)},
                    normalized_size={name: float(self.nmags[t, k]) for k, name in enumerate(CHANNELS)},
                    cause_set=set_index))
        return causal

    def type_errors(self, causal: list[StepAttribution]) -> None:
        """Type each causal step by the residual channel that carries its effect (budget permitting)."""
        eng, mags, nmags, cap = self.eng, self.mags, self.nmags, self.budget.cap
        eng.phase = "explain"
        untyped = 0
        for cause in causal:
            full = self.context[cause.cause_set]
            fS = eng.f(full)
            active = [k for k in range(NC) if mags[cause.step, k] > 0]
            if self.config.explain_channels and len(active) > 1:
                # remove one channel at a time, largest (normalized) error first; stop once one
                # channel carries most of the step's effect (usually after one rollout)
                for k in sorted(active, key=lambda k: -nmags[cause.step, k]):
                    if full - {cause.step * NC + k} not in eng.memo and eng.rollouts + 1 > cap:
                        break
                    cause.channel_effects[CHANNELS[k]] = float(fS - eng.f(full - {cause.step * NC + k}))
                    if abs(cause.channel_effects[CHANNELS[k]]) > 0.5 * abs(cause.effect):
                        break
                if not cause.channel_effects:  # out of budget (residual sizes are no guide: big errors can be harmless)
                    untyped += 1
                    cause.error_type = "untyped"
                    continue
            else:
                cause.channel_effects = {CHANNELS[k]: cause.effect for k in active}
            best = max(cause.channel_effects.items(), key=lambda kv: abs(kv[1]), default=("state", 0.0))
            cause.error_type = best[0] if abs(best[1]) > 0.5 * abs(cause.effect) or len(active) == 1 else "combined"
        if untyped:
            self.notes.append(f"{untyped} causal step(s) left untyped: the rollout budget was spent")

    # ----- messages and traces -----------------------------------------------------------------
    def no_gap_message(self, min_gap: float) -> str:
        F0, FU = self.F0, self.FU
        message = (f"no gap: the world model's outcome f({{}}) = {F0:.6g} and the real outcome f(all) = {FU:.6g} "
                   f"differ by {abs(FU - F0):.3g} <= {min_gap:.3g} (min_gap)" if self.candidates else
                   "no gap: every residual is exactly zero (the model reproduces the real trajectory)")
        return message + "; nothing to attribute." + ("" if not self.notes else " Note: " + "; ".join(self.notes))

    def dense_message(self) -> str:
        return (f"gap {self.FU - self.F0:+.4g} ({self.config.outcome.kind}: model {self.F0:.4g}, real "
                f"{self.FU:.4g}); no single step matters on its own: the gap is dense; nothing is blamed. "
                + "; ".join(self.notes))

    def result_message(self, out: Attribution) -> str:
        sets, n_candidates, eng = out.causal_sets, len(self.candidates), self.eng
        parts = [f"gap {out.gap:+.4g} ({self.config.outcome.kind}: model {self.F0:.4g}, real {self.FU:.4g}); "
                 f"{len(sets[0])} causal step(s) of {n_candidates} reproduce it within {self.tol:.3g}"]
        if len(sets) > 1:
            parts.append(f"{len(sets) - 1} alternative causal set(s): each alone also produces the gap")
        if not out.verified and out.causal_outcome is not None:
            parts.append(f"warning: f(S*) = {out.causal_outcome:.4g} does not reproduce f(all) within tol "
                         "(interacting, non-monotone errors); treat the ranking with care")
        if out.dense:
            parts.append("the gap is dense: many small errors add up, no sparse set of steps explains it")
        if eng.rollouts > n_candidates + 2:
            self.notes.append(f"{eng.rollouts} hybrid rollouts, {eng.rollouts - n_candidates - 2} more than "
                              f"single-step ablation would have cost (budget {self.budget.cap})")
        return "; ".join(parts + self.notes)

    def traces(self, primary: frozenset | None = None) -> dict[str, list[float]]:
        """Per-step outcome of the model, of f(all) and (with ``primary``) of f(S*), all cached rollouts."""
        eng = self.eng
        traces = {"model": eng.result(frozenset()).trace.tolist(),
                  "real (f(all))": eng.result(self.all_items).trace.tolist()}
        if primary is not None:
            traces["causal (f(S*))"] = eng.result(self.patch(primary)).trace.tolist()
        return traces


def _finish(out: Attribution, eng: HybridRollouts, t_start: float, search_rollouts: int) -> None:
    out.rollouts = eng.rollouts
    out.search_rollouts = search_rollouts or eng.rollouts
    out.explain_rollouts = eng.rollouts - out.search_rollouts
    out.steps_simulated = eng.steps
    out.seconds = time.perf_counter() - t_start
    out.history = [asdict(q) for q in eng.history]


def debug(model_env: GroundflowEnv, policy: Any, episode: Episode, config: DebugConfig | None = None,
          on_rollout: Callable[[HybridRollouts], None] | None = None) -> Attribution:
    """Attribute the gap between the world model's outcome and the real one to time steps."""
    config = config or DebugConfig()
    return attribute(prepare(model_env, policy, episode, config, on_rollout), config)


@dataclass
class Ablation:
    effects: np.ndarray  # (T,) f(all) - f(all \ {t}) (0 for steps with no residual)
    causal: list[int]
    rollouts: int
    seconds: float
    tol: float


def exhaustive_ablation(prep: Prepared, config: DebugConfig) -> Ablation:
    """Reference method: remove each step's residual from the full patch, one rollout per step."""
    eng, candidates = prep.engine, prep.candidates
    r0, t0 = eng.rollouts, time.perf_counter()
    eng.phase = "exhaustive"
    F0 = eng.f(frozenset())
    all_items = eng.items(range(eng.T))
    FU = eng.f(all_items)
    tol = max(config.abs_tol, config.rel_tol * abs(FU - F0))
    vals = eng.f_many([all_items - eng.items([t]) for t in candidates])
    effects = np.zeros(eng.T)
    effects[candidates] = FU - np.asarray(vals)
    min_gap = max(config.min_gap, config.min_gap_rel * max(abs(F0), abs(FU)))
    causal = [int(t) for t in candidates if abs(effects[t]) > tol] if abs(FU - F0) > min_gap else []
    return Ablation(effects, causal, eng.rollouts - r0, time.perf_counter() - t0, tol)

