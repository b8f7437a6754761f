"""Hybrid rollouts for counterfactual world-model debugging: residuals, patching, caching.

Notation: the real trajectory has model states ``x_t`` (t = 0..T), observations ``o_t``, actions
``a_t``, rewards ``r_t``. ``M`` is the world model (a simulator env or a learned model) whose
state can be set. Residuals along the real trajectory, per channel:

- ``state``:       e_t = x_{t+1} - M(x_t, a_t)                  (model-state space)
- ``reward``:      e_t = r_t - r_M(x_t, a_t)
- ``observation``: e_t = o_t - obs_M(x_t)                        (what the policy saw vs. the model)

What "state" means (the choice documented in DESIGN.md's debugging section): for a simulator
model it is the *simulator* state (``get_sim_state``), so a real trajectory must carry
``sim_state`` (a shifted twin, or a simulator run, records it); patching is ``set_sim_state``.
For a learned world model the state is the observation state vector itself, so any recorded
trajectory (robot included) works and the observation channel is zero. Residuals are kept in
float64, so ``x + (x_real - x)`` gives ``x_real`` back bit for bit and ``f(all)`` reproduces the
real outcome exactly when the policy is deterministic. ``M`` always sets the state before it
steps (a simulator's contact caches would otherwise make ``M`` depend on history).

A patch is a set of items ``t * 3 + channel``. A hybrid rollout runs the policy in ``M`` from
``x_0`` and adds the residuals of the patched items. Rollouts are memoized per patch and share
prefixes: a rollout resumes from a checkpoint of any earlier rollout whose patch agrees on all
steps before the checkpoint (Zobrist hashes of the patch prefix key the checkpoints).
"""

from __future__ import annotations

import copy
import inspect
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from envs.base import GroundflowEnv
from envs.errors import GroundflowError
from dataset import Episode

CHANNELS = ("state", "reward", "observation")
NC = len(CHANNELS)
STATE, REWARD, OBSERVATION = range(NC)
OUTCOME_KINDS = ("return", "success", "final_distance")


class DebuggingError(GroundflowError, ValueError):
    """Bad input to counterfactual debugging."""


class RolloutBudgetExceeded(GroundflowError, RuntimeError):
    """The search used more hybrid rollouts than allowed (``DebugConfig.max_rollouts``)."""


class TrajectoryError(DebuggingError):
    """The real trajectory is empty, has NaN/inf, or lacks what the model needs."""


class StateLayoutError(DebuggingError):
    """The trajectory's state/action layout does not match the world model's."""


class ModelStateError(DebuggingError):
    """The world model cannot get/set its state, so it cannot be patched."""


# ----- policies --------------------------------------------------------------------------------

class PolicyRunner:
    """One interface over policies (``reset()`` + ``select_action``), experts (``reset(env, obs)``
    + ``act``) and plain callables; snapshots a stateful policy so rollouts can resume."""

    def __init__(self, policy: Any):
        if hasattr(policy, "select_action"):
            self._act = policy.select_action
        elif hasattr(policy, "act"):
            self._act = policy.act
        elif callable(policy):
            self._act = policy
        else:
            raise DebuggingError(f"policy {type(policy).__name__} has neither select_action(obs), act(obs) nor __call__")
        self.policy = policy
        self.stateless = bool(getattr(policy, "stateless", False))
        self.batchable = self.stateless and hasattr(policy, "act_batch")

    def reset(self, env: Any = None, obs: dict | None = None) -> None:
        fn = getattr(self.policy, "reset", None)
        if fn is None:
            return
        try:
            n_params = len(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            n_params = 0
        fn(env, obs) if n_params >= 2 else fn()

    def act(self, obs: dict) -> np.ndarray:
        action = self._act(obs)
        if hasattr(action, "detach"):
            action = action.detach().cpu().numpy()
        return np.asarray(action, np.float32).reshape(-1)

    def act_batch(self, states: np.ndarray) -> np.ndarray:
        return np.asarray(self.policy.act_batch(states), np.float32)

    def snapshot(self) -> Any:
        """Copy of the policy's internal state (None if stateless). Network weights are shared."""
        if self.stateless:
            return None
        if hasattr(self.policy, "get_state") and hasattr(self.policy, "set_state"):
            return self.policy.get_state()
        memo: dict[int, Any] = {}
        for obj in _tensors_to_share(self.policy):
            memo[id(obj)] = obj
        return copy.deepcopy(self.policy, memo)

    def restore(self, snap: Any) -> None:
        if self.stateless:
            return
        if hasattr(self.policy, "get_state") and hasattr(self.policy, "set_state"):
            self.policy.set_state(snap)
            return
        memo = {id(o): o for o in _tensors_to_share(snap)}
        self.policy = copy.deepcopy(snap, memo)
        self._act = self.policy.select_action if hasattr(self.policy, "select_action") else (
            self.policy.act if hasattr(self.policy, "act") else self.policy)


def _tensors_to_share(obj: Any) -> list[Any]:
    """Parameters and buffers of any torch modules reachable as attributes (not copied)."""
    try:
        import torch  # imported here: heavy, and only policies with torch modules have tensors to share
    except ImportError:  # pragma: no cover
        return []
    out = []
    for attr in list(vars(obj).values()) if hasattr(obj, "__dict__") else []:
        if isinstance(attr, torch.nn.Module):
            out.extend(attr.parameters())
            out.extend(attr.buffers())
    return out


# ----- the world model -------------------------------------------------------------------------

class EnvModel:
    """A groundflow env used as world model; its state is ``get_sim_state()``."""

    def __init__(self, env: GroundflowEnv):
        self.env = env
        self.env_id = getattr(env, "env_id", type(env).__name__)
        self.observation_state = bool(getattr(env, "sim_state_is_observation", False))
        try:
            x = env.get_sim_state()
        except NotImplementedError as e:
            raise ModelStateError(f"world model {self.env_id}: cannot read its state ({e}); debugging needs a model "
                                  "whose state can be set (a simulator with get/set_sim_state, or a learned world model)") from e
        if x is None:
            raise ModelStateError(f"world model {self.env_id} (backend {getattr(env, 'backend', '?')!r}) does not expose "
                                  "its simulator state (get_sim_state() is None); it cannot be patched")
        try:
            env.set_sim_state(x)
        except NotImplementedError as e:
            raise ModelStateError(f"world model {self.env_id}: cannot set its state ({e})") from e
        self.state_dim = int(np.asarray(x).size)
        self.obs_dim = int(env.state_dim)
        self.action_dim = int(env.action_space.shape[0])
        self.batched = hasattr(env, "predict_batch")

    def step(self, x: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, float, bool, dict]:
        """Pure step: set x, step a. The observation is re-read from the new state, so
        ``obs_M`` is one function of the state (MuJoCo envs otherwise return site positions
        computed before the integration step)."""
        self.env.set_sim_state(x)
        obs, r, _, _, info = self.env.step(a)
        if not self.observation_state:
            obs = self.env.observe()
        return np.asarray(self.env.get_sim_state(), np.float64), float(r), bool(info["success"]), obs

    def observe(self, x: np.ndarray) -> dict:
        self.env.set_sim_state(x)
        return self.env.observe()

    def success_now(self) -> bool | None:
        return self.env.evaluate_success()

    def step_batch(self, X: np.ndarray, A: np.ndarray, success: bool = True
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        A = np.asarray(A, np.float32)
        if not np.all(np.isfinite(A)):
            raise DebuggingError(f"the policy returned NaN/inf actions in a hybrid rollout of {self.env_id}")
        out = self.env.predict_batch(X, np.clip(A, self.env.action_low, self.env.action_high), success=success,
                                     uncertainty=False)
        succ = np.asarray(out["success"], bool) if success else np.zeros(len(X), bool)
        return np.asarray(out["next_state"], np.float64), np.asarray(out["reward"], np.float64), succ

    def success_batch(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(self.env.success_batch(X), bool)


# ----- the real trajectory ---------------------------------------------------------------------

@dataclass
class RealTrajectory:
    x: np.ndarray  # (T + 1, D) model states
    obs: np.ndarray  # (T, S) observation states the policy saw
    action: np.ndarray  # (T, A)
    reward: np.ndarray  # (T,)
    success: np.ndarray  # (T,)
    final_obs: np.ndarray | None  # (S,)
    instruction: str

    @property
    def T(self) -> int:
        return int(self.action.shape[0])


def _nonfinite_steps(a: np.ndarray) -> list[int]:
    a = np.asarray(a, np.float64)
    bad = ~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
    return np.flatnonzero(bad).tolist()


def real_trajectory(ep: Episode, model: EnvModel) -> RealTrajectory:
    """Validate an episode against the model and collect the model states along it."""
    T = len(ep)
    if T == 0:
        raise TrajectoryError("the real trajectory is empty (0 steps): nothing to debug")
    for name in ("state", "action", "reward", "sim_state", "final_state", "final_sim_state"):
        values = getattr(ep, name)
        if values is None:
            continue
        values = np.asarray(values, np.float64)
        bad = _nonfinite_steps(values[None] if values.ndim == 1 and name.startswith("final")
                               else values.reshape(values.shape[0], -1))
        if bad:
            raise TrajectoryError(f"the real trajectory has NaN/inf in {name!r} at step(s) {bad[:10]}")
    if ep.state.shape[1] != model.obs_dim:
        raise StateLayoutError(f"trajectory observation state has {ep.state.shape[1]} dims, world model "
                               f"{model.env_id} observes {model.obs_dim}: a different env or state layout")
    if ep.action.shape[1] != model.action_dim:
        raise StateLayoutError(f"trajectory actions have {ep.action.shape[1]} dims, world model {model.env_id} "
                               f"takes {model.action_dim} (a different controller/control mode?)")
    if model.observation_state:
        if ep.final_state is None:
            raise TrajectoryError("the trajectory has no final_state: the last transition's residual is unknown")
        x = np.concatenate([ep.state, ep.final_state[None]]).astype(np.float64)
    else:
        if ep.sim_state is None or ep.final_sim_state is None:
            raise TrajectoryError(f"the trajectory has no simulator states (sim_state/final_sim_state), which a "
                                  f"simulator world model ({model.env_id}) needs to patch transitions; record it on "
                                  "a simulator or shifted twin, or debug against a learned world model "
                                  "(`groundflow train world-model`), whose state is the observation")
        x = np.concatenate([ep.sim_state, ep.final_sim_state[None]]).astype(np.float64)
        if x.shape[1] != model.state_dim:
            raise StateLayoutError(f"trajectory simulator state has {x.shape[1]} values, world model {model.env_id} "
                                   f"has {model.state_dim}: recorded on a different env or task")
    return RealTrajectory(x=x, obs=np.asarray(ep.state, np.float64), action=np.asarray(ep.action, np.float32),
                          reward=np.asarray(ep.reward, np.float64), success=np.asarray(ep.success, bool),
                          final_obs=None if ep.final_state is None else np.asarray(ep.final_state, np.float64),
                          instruction=ep.instruction)


@dataclass
class Residuals:
    state: np.ndarray  # (T, D)
    reward: np.ndarray  # (T,)
    observation: np.ndarray  # (T, S)

    def channel(self, c: int) -> np.ndarray:
        return (self.state, self.reward[:, None], self.observation)[c]

    def magnitudes(self) -> np.ndarray:
        """(T, 3) L2 norm of each channel's residual per step."""
        return np.stack([np.linalg.norm(self.channel(c), axis=1) for c in range(NC)], axis=1)

    def normalized_magnitudes(self, traj: RealTrajectory) -> np.ndarray:
        """(T, 3) largest residual over dims, each dim relative to the trajectory's own scale
        (per-step change for the state, spread for observations and rewards), so a jump in
        one dimension stands out and channels are comparable."""
        def scale(v: np.ndarray) -> np.ndarray:
            s = np.std(v, axis=0) + np.mean(np.abs(v), axis=0)
            pos = s[s > 0]
            return np.maximum(s, max(1e-6, 0.01 * float(np.median(pos)) if pos.size else 1e-6))

        scales = (scale(np.diff(traj.x, axis=0)), scale(traj.reward[:, None]),
                  scale(traj.obs - np.mean(traj.obs, axis=0)))
        return np.stack([np.max(np.abs(self.channel(c)) / scales[c], axis=1) for c in range(NC)], axis=1)


def compute_residuals(model: EnvModel, traj: RealTrajectory) -> Residuals:
    T = traj.T
    if model.batched and model.observation_state:
        nxt, r, _ = model.step_batch(traj.x[:-1], traj.action, success=False)
        return Residuals(traj.x[1:] - nxt, traj.reward - r, np.zeros_like(traj.obs))
    state = np.empty((T, model.state_dim))
    reward = np.empty(T)
    obs = np.zeros_like(traj.obs)
    for t in range(T):
        if not model.observation_state:
            obs[t] = traj.obs[t] - np.asarray(model.observe(traj.x[t])["state"], np.float64)
        nxt, r, _, _ = model.step(traj.x[t], traj.action[t])
        state[t] = traj.x[t + 1] - nxt
        reward[t] = traj.reward[t] - r
    return Residuals(state, reward, obs)


# ----- outcomes --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What ``f(S)`` measures: ``return`` (sum of rewards), ``success`` (1 if success at any
    step) or ``final_distance`` (||final_state[dims] - final_state[target_dims]||)."""

    kind: str = "return"
    dims: tuple[int, ...] = ()
    target_dims: tuple[int, ...] = ()

    def validate(self, obs_dim: int) -> "Outcome":
        if self.kind not in OUTCOME_KINDS:
            raise DebuggingError(f"unknown outcome {self.kind!r}; valid outcomes: {list(OUTCOME_KINDS)}")
        if self.kind == "final_distance":
            if not self.dims or len(self.dims) != len(self.target_dims):
                raise DebuggingError("final_distance needs dims and target_dims of the same length, e.g. "
                                     "dims=(28, 29) target_dims=(25, 26)")
            bad = [d for d in (*self.dims, *self.target_dims) if not 0 <= d < obs_dim]
            if bad:
                raise DebuggingError(f"final_distance dims {bad} are outside the {obs_dim}-dim observation state")
        return self

    def step_value(self, ret: float, success_any: bool, obs_state: np.ndarray) -> float:
        if self.kind == "return":
            return float(ret)
        if self.kind == "success":
            return float(success_any)
        o = np.asarray(obs_state, np.float64)
        return float(np.linalg.norm(o[list(self.dims)] - o[list(self.target_dims)]))

    def step_values(self, rets: np.ndarray, success_any: np.ndarray, states: np.ndarray) -> np.ndarray:
        """Vectorized :meth:`step_value` over a batch (observation states)."""
        if self.kind == "return":
            return np.asarray(rets, np.float64)
        if self.kind == "success":
            return np.asarray(success_any, np.float64)
        st = np.asarray(states, np.float64)
        return np.linalg.norm(st[:, list(self.dims)] - st[:, list(self.target_dims)], axis=1)

    def real_value(self, traj: RealTrajectory) -> float | None:
        if self.kind == "return":
            return float(np.sum(traj.reward))
        if self.kind == "success":
            return float(np.any(traj.success))
        return None if traj.final_obs is None else self.step_value(0.0, False, traj.final_obs)


# ----- hybrid rollouts -------------------------------------------------------------------------

@dataclass
class RolloutResult:
    value: float
    trace: np.ndarray  # (T,) outcome-relevant value after each step (cumulative return, success, distance)
    actions: np.ndarray | None = None


@dataclass
class _Snap:
    x: np.ndarray
    obs: dict
    policy: Any
    ret: float
    success_any: bool
    trace: np.ndarray


@dataclass
class Query:
    index: int
    size: int  # number of patched steps
    value: float
    phase: str
    cached: bool


class HybridRollouts:
    """``f(S)`` for patches ``S`` (sets of items ``t * 3 + channel``), memoized, prefix-shared."""

    def __init__(self, model: EnvModel, policy: Any, traj: RealTrajectory, residuals: Residuals,
                 outcome: Outcome, checkpoint_stride: int | None = None, seed: int = 0,
                 on_rollout: Callable[["HybridRollouts"], None] | None = None):
        self.model, self.traj, self.res, self.outcome = model, traj, residuals, outcome
        self.policy = PolicyRunner(policy)
        self.T = traj.T
        self.stride = checkpoint_stride or max(1, self.T // (200 if model.batched else 100))
        rng = np.random.default_rng(seed)
        self.zobrist = rng.integers(1, 2 ** 63 - 1, size=self.T * NC, dtype=np.int64)
        self.memo: dict[frozenset, RolloutResult] = {}
        self.ckpt: dict[tuple[int, int], _Snap] = {}
        self.ckpt_times: list[int] = []
        self.rollouts = 0
        self.steps = 0
        self.seconds = 0.0
        self.history: list[Query] = []
        self.phase = "search"
        self.on_rollout = on_rollout
        self._fresh: set[frozenset] = set()
        self.max_rollouts: int | None = None
        self._obs0 = self.model.observe(traj.x[0])

    # ----- patches -------------------------------------------------------------------------
    def items(self, steps: Sequence[int] | set[int] | frozenset, channels: Sequence[int] = range(NC)) -> frozenset:
        return frozenset(int(t) * NC + c for t in steps for c in channels)

    @staticmethod
    def steps_of(items: frozenset) -> list[int]:
        return sorted({i // NC for i in items})

    # ----- evaluation ----------------------------------------------------------------------
    def f(self, items: frozenset) -> float:
        return self.result(items).value

    def result(self, items: frozenset) -> RolloutResult:
        items = frozenset(items)
        hit = self.memo.get(items)
        cached = hit is not None and items not in self._fresh
        self._fresh.discard(items)
        if hit is None:
            if self.max_rollouts is not None and self.rollouts >= self.max_rollouts:
                raise RolloutBudgetExceeded(f"stopped after {self.rollouts} hybrid rollouts (max_rollouts)")
            t0 = time.perf_counter()
            hit = self._run(items)
            self.seconds += time.perf_counter() - t0
            self.memo[items] = hit
            self.rollouts += 1
            if self.on_rollout:
                self.on_rollout(self)
        self.history.append(Query(len(self.history), len(self.steps_of(items)), hit.value, self.phase, cached))
        return hit

    def f_many(self, patches: Sequence[frozenset]) -> list[float]:
        """Evaluate many patches; batched in one vectorized rollout where model and policy allow."""
        patches = [frozenset(patch) for patch in patches]
        todo = list(dict.fromkeys(patch for patch in patches if patch not in self.memo))
        if todo and self.vectorized and len(todo) > 1:
            if self.max_rollouts is not None and self.rollouts + len(todo) > self.max_rollouts:
                raise RolloutBudgetExceeded(f"stopped after {self.rollouts} hybrid rollouts (max_rollouts)")
            t0 = time.perf_counter()
            for patch, result in zip(todo, self._run_batch(todo)):
                self.memo[patch] = result
                self._fresh.add(patch)
            self.seconds += time.perf_counter() - t0
            self.rollouts += len(todo)
            if self.on_rollout:
                self.on_rollout(self)
        return [self.result(patch).value for patch in patches]

    # ----- single rollout with checkpoints ---------------------------------------------------
    def _prefix_hashes(self, items: frozenset) -> tuple[list[int], np.ndarray]:
        srt = sorted(items)
        h = np.zeros(len(srt) + 1, dtype=np.int64)
        if srt:
            h[1:] = np.bitwise_xor.accumulate(self.zobrist[srt])
        return srt, h

    def _find_checkpoint(self, srt: list[int], h: np.ndarray) -> tuple[int, _Snap | None]:
        for t in reversed(self.ckpt_times):
            j = bisect_left(srt, t * NC)
            snap = self.ckpt.get((t, int(h[j])))
            if snap is not None:
                return t, snap
        return 0, None

    def _store(self, t: int, key: int, snap: _Snap) -> None:
        if (t, key) in self.ckpt:
            return
        if not self.ckpt_times or self.ckpt_times[-1] < t:
            self.ckpt_times.append(t)
        elif t not in self.ckpt_times:
            self.ckpt_times.insert(bisect_left(self.ckpt_times, t), t)
        self.ckpt[(t, key)] = snap

    @property
    def vectorized(self) -> bool:
        """Learned model + stateless batchable policy: rollouts run as (batched) array code."""
        return self.model.batched and self.model.observation_state and self.policy.batchable

    def _run(self, items: frozenset) -> RolloutResult:
        if self.vectorized:
            return self._run_batch([items], store=True)[0]
        T, res, model = self.T, self.res, self.model
        srt, h = self._prefix_hashes(items)
        t0, snap = self._find_checkpoint(srt, h)
        trace = np.empty(T)
        if snap is None:
            x, obs, ret, succ_any = self.traj.x[0].copy(), self._obs0, 0.0, False
            self.policy.reset(model.env, obs)
        else:
            x, obs, ret, succ_any = snap.x, snap.obs, snap.ret, snap.success_any
            trace[:t0] = snap.trace[:t0]
            self.policy.restore(snap.policy)
        key = int(h[bisect_left(srt, t0 * NC)])
        instr = self.traj.instruction
        for t in range(t0, T):
            if t % self.stride == 0 and t > 0:
                self._store(t, key, _Snap(x, obs, self.policy.snapshot(), ret, succ_any, trace))
            base = t * NC
            policy_obs = dict(obs)
            policy_obs["instruction"] = instr
            if base + OBSERVATION in items:
                policy_obs["state"] = (np.asarray(obs["state"], np.float64) + res.observation[t]).astype(np.float32)
            a = self.policy.act(policy_obs)
            x, r, succ, obs = model.step(x, a)
            if base + STATE in items:
                x = x + res.state[t]
                if model.observation_state:
                    obs = {"state": x.astype(np.float32)}
                    succ = bool(model.success_batch(x[None])[0]) if model.batched else succ
                else:
                    obs = model.observe(x)
                    success_now = model.success_now()
                    succ = succ if success_now is None else success_now
            if base + REWARD in items:
                r += res.reward[t]
            ret += r
            succ_any = succ_any or succ
            trace[t] = self.outcome.step_value(ret, succ_any, obs["state"])
            for c in range(NC):
                if base + c in items:
                    key ^= int(self.zobrist[base + c])
        self.steps += T - t0
        return RolloutResult(self.outcome.step_value(ret, succ_any, obs["state"]), trace)

    # ----- batched rollouts (learned models, stateless batchable policies) --------------------
    def _run_batch(self, patches: list[frozenset], store: bool = False) -> list[RolloutResult]:
        """Rollouts of many patches as array code; each row starts from its best checkpoint.
        ``store`` (single row): leave checkpoints for later rollouts."""
        T, res, B = self.T, self.res, len(patches)
        need_success = self.outcome.kind == "success"
        starts, xs, rets, succs, traces = np.zeros(B, int), [], np.zeros(B), np.zeros(B, bool), np.empty((B, T))
        keys = []
        for b, patch in enumerate(patches):
            srt, h = self._prefix_hashes(patch)
            t0, snap = self._find_checkpoint(srt, h)
            starts[b] = t0
            keys.append(int(h[bisect_left(srt, t0 * NC)]))
            if snap is None:
                xs.append(self.traj.x[0].copy())
            else:
                xs.append(snap.x)
                rets[b], succs[b] = snap.ret, snap.success_any
                traces[b, :t0] = snap.trace[:t0]
        X = np.stack(xs)
        mask = np.zeros((NC, B, T), bool)
        for b, patch in enumerate(patches):
            for item in patch:
                mask[item % NC, b, item // NC] = True
        store = store and B == 1
        key = keys[0]
        for t in range(int(starts.min()), T):
            if store and t % self.stride == 0 and t > starts[0]:
                self._store(t, key, _Snap(X[0].copy(), {}, None, float(rets[0]), bool(succs[0]), traces[0]))
            act = np.flatnonzero(starts <= t) if starts.max() > t else slice(None)
            Xa = X[act]
            po = mask[OBSERVATION, act, t]
            obs = Xa + res.observation[t] if po.all() else (Xa if not po.any() else
                                                             Xa + np.where(po[:, None], res.observation[t], 0.0))
            A = self.policy.act_batch(obs.astype(np.float32))
            nxt, r, succ = self.model.step_batch(Xa, A, success=need_success)
            ps = mask[STATE, act, t]
            if ps.any():
                nxt[ps] = nxt[ps] + res.state[t]
                if need_success:
                    succ[ps] = self.model.success_batch(nxt[ps])
            r = r + np.where(mask[REWARD, act, t], res.reward[t], 0.0)
            X[act] = nxt
            rets[act] += r
            succs[act] |= succ
            traces[act, t] = self.outcome.step_values(rets[act], succs[act], nxt)
            self.steps += len(nxt)
            if store:
                for c in range(NC):
                    if mask[c, 0, t]:
                        key ^= int(self.zobrist[t * NC + c])
        vals = self.outcome.step_values(rets, succs, X)
        return [RolloutResult(float(vals[b]), traces[b].copy() if B > 1 else traces[b]) for b in range(B)]


def action_reproduction_error(model: EnvModel, policy: Any, traj: RealTrajectory) -> float:
    """Max |pi(o_t) - a_t| along the real trajectory: 0 when the policy is the one that acted."""
    runner = PolicyRunner(policy)
    runner.reset(model.env, {"state": traj.obs[0].astype(np.float32), "instruction": traj.instruction})
    err = 0.0
    cameras = bool(getattr(model.env, "cameras", ()))
    for t in range(traj.T):
        obs = model.observe(traj.x[t]) if cameras and not model.observation_state else {}
        obs = {**obs, "state": traj.obs[t].astype(np.float32), "instruction": traj.instruction}
        err = max(err, float(np.max(np.abs(runner.act(obs) - traj.action[t]))))
    return err
