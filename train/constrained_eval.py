"""Guided evaluation under constraints the Adroit demos never show.

Two kinds of constraint, both with the same evaluation, methods and counters:

* **Joint limits** (``CONSTRAINTS``): a flow policy trained on DAPG expert demos is asked to run
  with *tighter* limits on two joints the experts use widely (a worn joint, a cable that must not
  be stretched). Each limit removes 35% of the joint's demonstrated action range on one side, so
  16-52% of the demo frames break it. A clamp of the executed action satisfies these by
  construction, so they cannot show what guidance adds; they stay as the easy case.
* **Keep-out regions** (``KEEPOUTS``): the palm (site ``S_grasp``) must stay out of a ball placed
  on the policy's own approach path (a fixture, a camera, a person's hand). The palm position is
  a nonlinear function of several arm and wrist joints (``envs.kinematics.SiteKinematics``), the
  feasible set is not convex, and a servo drives the joints along a path *between* commands, so
  no per-action clamp can keep the palm out: the ``clip`` baseline here is the minimal-change
  safety filter that moves each executed command until the palm, predicted by the servo model
  (``ServoModel``) while holding it for ``lookahead`` steps, stays clear (Newton steps on the
  distance), and the violation is measured on the *actual* palm position.

Units: joint limits are in the env's action units ([-1, 1] per actuator; the env maps ``a`` to the
position-servo target ``act_mean + a * act_rng`` of the actuator's joint). Their guidance cost is
``LimitCost`` on the constrained dims of the *unnormalized* chunk (all H steps, not only the
executed ones, so the plan stays coherent): ``weight * sum relu(a - high)^2 + relu(low - a)^2``
nats, weight in nats per action-unit^2. Keep-out balls are in metres (world frame); their cost is
``ObstacleCost`` on the palm path the fitted servo model predicts for the chunk's commands from
the current joint positions and velocities, with ``margin`` metres of clearance for the model's
error; weight in nats per m^2.

What counts as a violation (documented choice): joint limits -- an episode violates when any
*executed* action leaves ``[low - tol, high + tol]`` on a constrained dim (``tol`` = 0.02 action
units, 1% of the actuator's range); the joint position, mapped through its servo
(``_servo_map``), is reported too (``state_violation_rate``, tolerance ``state_tol``). Keep-out --
an episode violates when the actual palm comes more than ``tol`` (1 cm) inside the ball at any
step (``state_violation_rate`` is then the primary figure; ``command_violation_rate`` tests the
commanded equilibria, where the palm would settle if a command were held). Either way a non-finite chunk ends the episode as a failure that violates
(``nonfinite_rate``). A servo lags, is pushed by gravity and contacts, and some Adroit servos are
weak (hammer's and pen's wrist: kp = 10), so a command inside the constraint need not keep the
joint or the palm inside it, and the other way round.

Methods: ``none`` (unguided), ``clip`` (unguided, then the executed action is clamped / filtered
-- what a user tries first), any cost-guidance method of ``guidance.METHODS`` (``coupled``,
``velocity_gradient``, ``state_gradient``, ``pnp_renoise``), and ``<method>+clip`` (guided, then
clamped / filtered). Keep-out only: ``<method>+check`` (guided, each chunk's predicted palm path checked
before it runs and, before each command, the next ``lookahead`` commands re-checked from the measured joint
state; a failing plan is replaced by guided candidates drawn from where the robot is, the filter is the last
line).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

import envs
import guidance
from envs.errors import InvalidOptionError, UnknownEnvError
from envs.kinematics import SiteKinematics
from guidance.costs import LimitCost, ObstacleCost
from guidance.geometry import Sphere

TOL = 0.02
"""action-unit tolerance of the violation test (1% of an actuator's [-1, 1] range)"""
QPOS_TOL = 0.05
"""joint-position tolerance, in action units (of the joint position mapped through its servo)"""
GUIDED_METHODS = ("coupled", "velocity_gradient", "state_gradient", "pnp_renoise", "particles", "guided_particles")
BASE_METHODS = ("none", "clip")
METHODS = BASE_METHODS + GUIDED_METHODS + tuple(f"{m}+clip" for m in GUIDED_METHODS) \
    + tuple(f"{m}+check" for m in GUIDED_METHODS)
CHECK_RETRY = 8
"""``+check``: guided candidates drawn at once for an episode whose chunk fails the check"""
SHRINK = 0.35
"""fraction of a joint's demonstrated action range removed from one side"""


@dataclass(frozen=True)
class JointLimit:
    """A tighter limit on one action dimension, in action units."""

    dim: int
    actuator: str
    low: float
    high: float
    demo_min: float
    demo_max: float


@dataclass(frozen=True)
class AdroitConstraint:
    task: str
    limits: tuple[JointLimit, ...]
    why: str

    @property
    def dims(self) -> list[int]:
        return [lim.dim for lim in self.limits]

    @property
    def low(self) -> np.ndarray:
        return np.array([lim.low for lim in self.limits], np.float32)

    @property
    def high(self) -> np.ndarray:
        return np.array([lim.high for lim in self.limits], np.float32)

    def clip(self, action: np.ndarray) -> np.ndarray:
        """The action with the constrained dims clamped into the limits (the naive baseline)."""
        a = np.array(action, dtype=np.float32, copy=True)
        a[..., self.dims] = np.clip(a[..., self.dims], self.low, self.high)
        return a

    def excess(self, actions: np.ndarray) -> np.ndarray:
        """How far each constrained dim lies outside its limit, ``(..., k)`` action units (0 inside)."""
        v = np.asarray(actions, dtype=np.float64)[..., self.dims]
        return np.maximum(0.0, np.maximum(v - self.high, self.low - v))

    def check_env(self, env: Any) -> None:
        """Fail loudly if the env's actuators are not the ones these limits were derived for."""
        model = env.unwrapped_mujoco.model
        for lim in self.limits:
            name = model.actuator(lim.dim).name
            if name != lim.actuator:
                raise RuntimeError(f"adroit/{self.task}: action dim {lim.dim} drives {name!r}, the "
                                   f"constraint was derived for {lim.actuator!r} (gymnasium-robotics changed?)")

    # ---- the interface the rollouts use (shared with KeepOut) ----------------------------------
    kind = "joint_limits"
    primary = "command"   # the violation that counts: the executed command
    tol, state_tol = TOL, QPOS_TOL

    def bind(self, env: Any) -> None:
        self.check_env(env)
        object.__setattr__(self, "_servo", _servo_map(env, self.dims))

    def cost(self, policy: Any, weight: float) -> LimitCost:
        return limit_cost(policy, self, weight)

    def before_sample(self, cost: Any, pool: Sequence[Any]) -> None:
        """Nothing per call: the limits do not depend on where the robot is."""

    def filter(self, action: np.ndarray, env: Any) -> np.ndarray:
        return self.clip(action)

    def command_excess(self, actions: np.ndarray) -> np.ndarray:
        """Excess per constrained dim, ``(..., k)`` action units (0 inside)."""
        return self.excess(actions)

    def state_excess(self, env: Any) -> float:
        adr, (k_servo, act_mean, act_rng) = self._servo
        v = (env.unwrapped_mujoco.data.qpos[adr] / k_servo - act_mean) / act_rng
        return float(np.maximum(0.0, np.maximum(v - self.high, self.low - v)).max())


def derive_limit(actions: np.ndarray, dim: int, side: str, shrink: float = SHRINK) -> tuple[float, float]:
    """``(low, high)`` removing ``shrink`` of the demo range ``[min, max]`` of ``actions[:, dim]``
    from ``side`` ("low" raises the lower limit, "high" lowers the upper one). The other side
    stays at the actuator limit (+-1): how the constants in ``CONSTRAINTS`` were made."""
    if side not in ("low", "high"):
        raise InvalidOptionError(f"side must be 'low' or 'high'; got {side!r}")
    a = np.asarray(actions)[:, dim]
    mn, mx = float(a.min()), float(a.max())
    return (mn + shrink * (mx - mn), 1.0) if side == "low" else (-1.0, mx - shrink * (mx - mn))


def _lim(dim: int, actuator: str, side: str, demo_min: float, demo_max: float) -> JointLimit:
    w = demo_max - demo_min
    low, high = (round(demo_min + SHRINK * w, 3), 1.0) if side == "low" else (-1.0, round(demo_max - SHRINK * w, 3))
    return JointLimit(dim, actuator, low, high, demo_min, demo_max)


# Derived with derive_limit from data/bench/adroit_<task>_50_s0.h5 (50 successful DAPG expert
# demos, seed 0; benchmarks.common.demos). Chosen among the joints with demo action std > 0.15:
# an arm/wrist joint plus a second widely used joint whose limit the expert, clamped to it in
# closed loop, still solves (20 episodes, seeds 1000-1019): door 20/20 (68 vs 53 steps), hammer
# 20/20 (43 vs 39), pen 14/20 (the unclamped expert: 14/20), relocate 20/20 (54 vs 50). So each
# constraint is feasible, binds often, and changes how the task is done. The arm actuators of
# door and relocate are stiff servos whose rest position is 2.5x the command (``_servo_map``):
# relocate's ARTz limit (0.099) lies inside the joint's reachable command range [-0.55, 0.25],
# so it limits the arm's height; door's ARTz limit (0.184) barely does (reach 0.25) and door's
# ARRy limit (-0.518) lies beyond the reach [-0.40, 0.40], so on door the limits mostly cap the
# force the arm may push with near its stops -- still an actuator command limit, but not a
# joint-position one (door's state_violation_rate is 0 for every method).
CONSTRAINTS: dict[str, AdroitConstraint] = {
    "door": AdroitConstraint("door", (
        _lim(0, "A_ARTz", "high", -0.725, 0.674),    # arm slide: 36% of demo frames above the new limit
        _lim(2, "A_ARRy", "low", -0.923, 0.233),     # arm rotation: 27% of frames below it
    ), "arm travel and arm rotation restricted (e.g. a fixture next to the robot)"),
    "hammer": AdroitConstraint("hammer", (
        _lim(2, "A_WRJ1", "high", -0.394, 1.000),    # wrist flexion: 52% of frames above
        _lim(3, "A_WRJ0", "low", -0.944, 0.895),     # wrist deviation: 22% of frames below
    ), "a stiff wrist: less flexion for the hammer swing, less ulnar deviation"),
    "pen": AdroitConstraint("pen", (
        _lim(0, "A_WRJ1", "high", -1.000, 1.000),    # wrist flexion: 40% of frames above
        _lim(1, "A_WRJ0", "high", -1.000, 0.437),    # wrist deviation: 17% of frames above
    ), "a stiff wrist: in-hand rotation must come from the fingers"),
    "relocate": AdroitConstraint("relocate", (
        _lim(2, "A_ARTz", "high", -0.451, 0.395),    # arm slide: 24% of frames above
        _lim(25, "A_THJ4", "low", -1.000, 1.000),    # thumb rotation: 46% of frames below
    ), "limited arm travel and a thumb that cannot fully oppose"),
}


@dataclass(frozen=True)
class ServoModel:
    """Linear model of Adroit's position servos over one control step (``dt`` s), joints coupled.

    Features ``f = [v, q_eq(u) - q, 1]`` (``v = qvel * dt``, ``q_eq`` the commanded equilibrium):
    ``q' = q + f Wq`` and ``v' = f Wv``. Adroit's policies command targets far ahead of the arm
    (the commanded equilibrium palm is 0.1-0.7 m from the actual palm along an episode), so where
    the palm *goes* over a chunk needs this lag, not the equilibria. Fitted by least squares on
    random held commands (``fit_servo``), not on any policy's or expert's data; ``r2`` per joint
    says how much of the one-step motion it explains. Measured on unguided policy rollouts (4
    episodes, seeds 7000+): palm error after 4 / 8 commands, median 1.7 / 5.1 cm (door),
    1.1 / 3.1 cm (relocate); a per-joint (diagonal) model did as well on door and worse on relocate."""

    wq: Tensor        # (2k + 1, k)
    wv: Tensor        # (2k + 1, k)
    dt: float
    r2: tuple[float, ...]

    def rollout(self, q: Tensor, v: Tensor, q_eq: Tensor) -> Tensor:
        """Joint positions (B, H, k) after each of H commands ``q_eq`` (B, H, k) from ``q``, ``v`` (B, k)."""
        wq, wv = self.wq.to(q.dtype), self.wv.to(q.dtype)
        one = torch.ones((*q.shape[:-1], 1), dtype=q.dtype)
        out = []
        for h in range(q_eq.shape[1]):
            f = torch.cat([v, q_eq[:, h] - q, one], -1)
            q, v = q + f @ wq, f @ wv
            out.append(q)
        return torch.stack(out, 1)


def fit_servo(env: Any, keepout: "KeepOut", episodes: int = 40, steps: int = 60, seed: int = 100) -> ServoModel:
    """Fit ``ServoModel`` for the joints that move the palm: each episode holds random commands
    (uniform in [-1, 1] on those actuators, others at 0) for 1-8 steps at a time."""
    rng = np.random.default_rng(seed)
    u = env.unwrapped_mujoco
    dt = float(u.model.opt.timestep) * int(getattr(u, "frame_skip", 1))
    adr, vadr, dims = keepout.adr.numpy(), keepout.vadr.numpy(), keepout.dims.numpy()
    feats, dq, vn = [], [], []
    adim = env.action_space.shape[0]
    for ep in range(episodes):
        env.reset(seed=seed + ep)
        hold, action = 0, np.zeros(adim, np.float32)
        for _ in range(steps):
            if hold == 0:
                action = np.zeros(adim, np.float32)
                action[dims] = rng.uniform(-1, 1, len(dims))
                hold = int(rng.integers(1, 9))
            hold -= 1
            q, v = u.data.qpos[adr].copy(), u.data.qvel[vadr] * dt
            q_eq = keepout.equilibrium_qpos(torch.as_tensor(action))[adr].numpy()
            env.step(action)
            feats.append(np.concatenate([v, q_eq - q, [1.0]]))
            dq.append(u.data.qpos[adr] - q)
            vn.append(u.data.qvel[vadr] * dt)
    X, Yq, Yv = (np.asarray(x, dtype=np.float64) for x in (feats, dq, vn))
    wq, *_ = np.linalg.lstsq(X, Yq, rcond=None)
    wv, *_ = np.linalg.lstsq(X, Yv, rcond=None)
    resid = ((X @ wq - Yq) ** 2).sum(0) / np.maximum(((Yq - Yq.mean(0)) ** 2).sum(0), 1e-12)
    return ServoModel(torch.as_tensor(wq, dtype=torch.float32), torch.as_tensor(wv, dtype=torch.float32),
                      dt, tuple(float(1 - r) for r in resid))


class _PalmPath:
    """Normalized chunk (B, H, A) -> palm positions (B, H, 3) after each command, predicted by the
    servo model from where each robot is now (``start``: qpos and qvel, set before each call)."""

    def __init__(self, keepout: "KeepOut", policy: Any) -> None:
        self.keepout, self.unaction = keepout, policy.normalizer.unaction
        self.action_dim = int(policy.config.action_dim)
        self.start: tuple[Tensor, Tensor] | None = None

    def check(self, event_shape: tuple[int, ...]) -> None:
        if len(event_shape) != 2 or event_shape[1] != self.action_dim:
            raise InvalidOptionError(f"keep-out cost expects chunks (H, {self.action_dim}); got "
                                     f"per-sample shape {tuple(event_shape)}")
        if self.start is None:
            raise InvalidOptionError("keep-out cost: the robot's current joint state is not set "
                                     "(KeepOut.before_sample(cost, envs) before sampling)")

    def __call__(self, x: Tensor) -> Tensor:
        return self.keepout.predict_palm(self.unaction(x), *self.start)


@dataclass
class KeepOut:
    """Keep the palm (site ``site``) out of a ball of ``radius`` metres around ``center`` (world).

    ``margin`` metres of extra clearance go into the cost and the safety filter (the servo model is
    approximate); the violation is tested at ``radius - tol`` on the actual palm. Built lazily from
    the env (``bind``): the site's kinematics, the servos of the joints that move it and a servo
    model fitted on random commands."""

    task: str
    center: tuple[float, float, float]
    radius: float
    why: str
    site: str = "S_grasp"
    margin: float = 0.02
    lookahead: int = 4
    """steps the safety filter looks ahead while holding the command"""
    check_clearance: float = 0.0
    """metres the predicted palm path must keep outside the ball in the hard check (``passes``). The cost asks
    for ``margin``; a check at the margin (the filter's standard) rejected so many plans that the filter's
    fallback cost a third of the door successes"""

    kind = "keepout"
    primary = "state"     # the violation that counts: where the palm actually went
    tol = state_tol = 0.01

    def bind(self, env: Any) -> None:
        if getattr(self, "servo", None) is not None:
            return
        model = env.unwrapped_mujoco.model
        self.fk = SiteKinematics(model, self.site)
        moving = set(self.fk.qpos_adr)
        dims = [d for d in range(model.nu) if int(model.jnt_qposadr[model.actuator_trnid[d, 0]]) in moving]
        adr, servo = _servo_map(env, dims)
        jnt = [int(model.actuator_trnid[d, 0]) for d in dims]
        self.dims = torch.as_tensor(dims, dtype=torch.long)
        self.adr = torch.as_tensor(adr, dtype=torch.long)
        self.vadr = torch.as_tensor([int(model.jnt_dofadr[j]) for j in jnt], dtype=torch.long)
        self.servo_map = torch.as_tensor(servo, dtype=torch.float32)     # (3, k): gain ratio, act_mean, act_rng
        self.qpos0 = torch.as_tensor(model.qpos0, dtype=torch.float32)
        self.center_t = torch.as_tensor(self.center, dtype=torch.float32)
        fit_env = envs.make(f"adroit/{self.task}")  # its own env: fitting must not move the caller's
        try:
            self.servo = fit_servo(fit_env, self)
        finally:
            fit_env.close()

    def moved(self, center: Sequence[float], radius: float, why: str = "") -> "KeepOut":
        """A ball elsewhere on the same task, sharing this one's fitted servo model and kinematics (bind first):
        what detour demos (``train.detour_demos``) draw per episode without refitting the model."""
        if getattr(self, "servo", None) is None:
            raise InvalidOptionError(f"KeepOut({self.task}).moved: bind it to an env first")
        other = copy.copy(self)
        other.center, other.radius, other.why = tuple(float(c) for c in center), float(radius), why or self.why
        other.center_t = torch.as_tensor(other.center, dtype=torch.float32)
        return other

    def equilibrium_qpos(self, actions: Tensor) -> Tensor:
        """Joint positions (..., nq) the servos pull toward for ``actions`` (..., A) (action units);
        joints that do not move the palm stay at ``qpos0``. Not clamped to the joint range: past it
        the servo still pulls harder (the clamped version predicted door's palm 2x worse)."""
        k, mean, rng = self.servo_map.to(actions.dtype)
        a = actions[..., self.dims].clamp(-1.0, 1.0)
        q_arm = k * (mean + a * rng)
        q = self.qpos0.to(actions.dtype).expand(*actions.shape[:-1], -1).clone()
        q[..., self.adr] = q_arm
        return q

    def predict_palm(self, actions: Tensor, qpos: Tensor, qvel: Tensor) -> Tensor:
        """Palm positions (B, H, 3) after each of the commands ``actions`` (B, H, A), from joint
        state ``qpos``/``qvel`` (B, nq) (or (1, nq)), by the fitted servo model."""
        b = actions.shape[0]
        q_eq = self.equilibrium_qpos(actions)[..., self.adr]
        q0 = qpos[:, self.adr].to(actions.dtype).expand(b, -1)
        v0 = (qvel[:, self.vadr] * self.servo.dt).to(actions.dtype).expand(b, -1)
        q_arm = self.servo.rollout(q0, v0, q_eq)
        full = self.qpos0.to(actions.dtype).expand(*q_arm.shape[:-1], -1).clone()
        full[..., self.adr] = q_arm
        return self.fk(full)

    def cost(self, policy: Any, weight: float) -> ObstacleCost:
        """``weight`` nats per m^2 of predicted penetration into the ball grown by ``margin``."""
        return ObstacleCost(_PalmPath(self, policy), [Sphere(torch.as_tensor(self.center), self.radius)],
                            margin=self.margin, weight=weight)

    @staticmethod
    def joint_state(pool: Sequence[Any]) -> tuple[Tensor, Tensor]:
        """``qpos``, ``qvel`` (B, nq), (B, nv) of each env: where ``predict_palm`` starts."""
        return (torch.as_tensor(np.stack([e.unwrapped_mujoco.data.qpos for e in pool]), dtype=torch.float32),
                torch.as_tensor(np.stack([e.unwrapped_mujoco.data.qvel for e in pool]), dtype=torch.float32))

    def before_sample(self, cost: Any, pool: Sequence[Any]) -> None:
        """The predicted path starts where each robot is now."""
        if cost is not None:
            cost.path_fn.start = self.joint_state(pool)

    def filter(self, action: np.ndarray, env: Any, iters: int = 10) -> np.ndarray:
        """The minimal-change safety filter: Newton steps on the worst predicted clearance move the
        command until the palm, holding it for ``lookahead`` steps from the current joint state,
        stays ``margin`` outside the ball."""
        qpos, qvel = self.joint_state([env])
        a = torch.as_tensor(np.clip(action, -1.0, 1.0), dtype=torch.float32)
        want = self.radius + self.margin
        for _ in range(iters):
            a = a.detach().requires_grad_(True)
            path = self.predict_palm(a.expand(1, self.lookahead, -1), qpos, qvel)
            gap = want - torch.linalg.norm(path - self.center_t, dim=-1).min()
            if gap.item() <= 0:
                break
            (g,) = torch.autograd.grad(gap, a)
            n2 = float((g * g).sum())
            if n2 < 1e-12:
                break
            a = (a - (gap.item() + 1e-3) * g / n2).clamp(-1.0, 1.0)
        return a.detach().numpy().astype(np.float32)

    def passes(self, actions: np.ndarray, pool: Sequence[Any]) -> np.ndarray:
        """(B,) bool: the palm path the servo model predicts for each chunk ``actions`` (B, n, A) (action
        units) from its robot's joint state (``pool``: one env per chunk) stays ``check_clearance`` outside
        the ball."""
        with torch.no_grad():
            a = torch.as_tensor(np.clip(np.nan_to_num(actions, nan=2.0), -1.0, 1.0), dtype=torch.float32)
            path = self.predict_palm(a, *self.joint_state(pool))
            gap = torch.linalg.norm(path - self.center_t, dim=-1).amin(1) - (self.radius + self.check_clearance)
        return (gap >= 0).numpy() & np.isfinite(actions).reshape(len(actions), -1).all(1)

    def command_excess(self, actions: np.ndarray) -> np.ndarray:
        """Depth (m) of each command's equilibrium palm inside the ball, ``(..., 1)`` (0 outside):
        where the palm would settle if the command were held."""
        with torch.no_grad():
            p = self.fk(self.equilibrium_qpos(torch.as_tensor(np.asarray(actions), dtype=torch.float32)))
        return torch.relu(self.radius - torch.linalg.norm(p - self.center_t, dim=-1))[..., None].numpy()

    def state_excess(self, env: Any) -> float:
        p = env.unwrapped_mujoco.data.site(self.site).xpos
        return max(0.0, self.radius - float(np.linalg.norm(p - np.asarray(self.center))))


# Placed on the unguided policy's own path (runs/bench_guidance_adroit/<task>, 10 episodes on
# seeds 7000-7009, apart from the evaluation seeds 3000+): the centre is the median palm position
# a quarter of the way through the episode, where the arm lifts toward the handle (door) or
# swings toward the ball (relocate). Door: all 10 placement paths pass within 5 cm of the centre;
# the straight line from the start to the handle passes 12 cm from it, so the task stays feasible.
# Relocate: 8 of 10 pass within 5 cm. Hammer and pen have no arm translation (the palm barely
# moves before the grasp), so a keep-out region there would block the task instead of re-routing it.
KEEPOUTS: dict[str, KeepOut] = {
    "door": KeepOut("door", (-0.021, -0.005, 0.325), 0.06,
                    "a fixture above the door handle: reach the handle from below"),
    "relocate": KeepOut("relocate", (-0.014, -0.096, 0.199), 0.05,
                        "an obstacle between the start pose and the ball"),
}
KINDS = {"joint_limits": CONSTRAINTS, "keepout": KEEPOUTS}


def constraint_for(env_id: str, kind: str = "joint_limits") -> AdroitConstraint | KeepOut:
    """The constraint of kind ``kind`` ("joint_limits" or "keepout") of ``adroit/<task>`` (or ``<task>``)."""
    if kind not in KINDS:
        raise InvalidOptionError(f"unknown constraint kind {kind!r}; valid: {', '.join(KINDS)}")
    table = KINDS[kind]
    task = env_id.split("/", 1)[1] if isinstance(env_id, str) and env_id.startswith("adroit/") else env_id
    if not isinstance(task, str) or task not in table:
        raise UnknownEnvError(f"no {kind} constraint for env {env_id!r}; valid: "
                              f"{', '.join('adroit/' + t for t in table)}")
    return table[task]


class _ConstrainedDims:
    """Normalized chunk (B, H, A) -> constrained dims in action units (B, H, k)."""

    def __init__(self, policy: Any, dims: Sequence[int]) -> None:
        self.unaction = policy.normalizer.unaction
        self.action_dim = int(policy.config.action_dim)
        self.dims = torch.as_tensor(list(dims), dtype=torch.long)

    def check(self, event_shape: tuple[int, ...]) -> None:
        if len(event_shape) != 2 or event_shape[1] != self.action_dim:
            raise InvalidOptionError(f"joint-limit cost expects chunks (H, {self.action_dim}); got "
                                     f"per-sample shape {tuple(event_shape)}")

    def __call__(self, x: Tensor) -> Tensor:
        return self.unaction(x)[..., self.dims]


def limit_cost(policy: Any, constraint: AdroitConstraint, weight: float = 100.0) -> LimitCost:
    """The constraint as a guidance cost on the policy's normalized chunk (nats)."""
    if int(policy.config.action_dim) <= max(constraint.dims):
        raise InvalidOptionError(f"policy action_dim {policy.config.action_dim} does not hold the "
                                 f"constrained dims {constraint.dims} of adroit/{constraint.task}")
    return LimitCost(constraint.low, constraint.high, weight=weight, fn=_ConstrainedDims(policy, constraint.dims))


def _parse_method(method: str) -> tuple[str, bool]:
    if method not in METHODS:
        raise InvalidOptionError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
    if method == "clip":
        return "none", True
    if method.endswith("+check"):
        return method[: -len("+check")], False
    if method.endswith("+clip"):
        return method[: -len("+clip")], True
    return method, False


def make_guide(policy: Any, constraint: AdroitConstraint | KeepOut, method: str, scale: float,
               weight: float = 100.0, options: dict | None = None) -> guidance.Guidance | None:
    """The guidance object for ``method`` at ``scale`` (None: unguided); its cost is ``guide.cost``."""
    base, _ = _parse_method(method)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not np.isfinite(scale) or scale < 0:
        raise InvalidOptionError(f"scale must be a finite number >= 0; got {scale!r}")
    if base == "none" or scale == 0:
        return None
    return guidance.make(base, cost=constraint.cost(policy, weight), scale=float(scale), **(options or {}))


def _batch(policy: Any, observations: Sequence[dict]) -> dict[str, Any]:
    parts = [policy.obs_to_batch(o) for o in observations]  # validates each observation
    batch: dict[str, Any] = {"state": np.concatenate([p["state"] for p in parts]),
                             "instruction": [s for p in parts for s in p["instruction"]]}
    if "images" in parts[0]:
        batch["images"] = {c: np.concatenate([p["images"][c] for p in parts]) for c in parts[0]["images"]}
    return batch


def sample_chunks(policy: Any, observations: Sequence[dict], guide: guidance.Guidance | None,
                  noise: Tensor) -> tuple[np.ndarray, Any, float]:
    """Chunks in action units (B, H, A) for a batch of observations, the sampler stats and the
    wall time (s). Same ``noise`` -> same chunks for the unguided policy (common random numbers)."""
    batch = _batch(policy, observations)
    t_start = time.perf_counter()
    if guide is not None and guide.needs_network_grad:
        x, st = policy.sample_chunks(batch, noise=noise, guide=guide, return_stats=True)
    else:
        with torch.no_grad():
            x, st = policy.sample_chunks(batch, noise=noise, guide=guide, return_stats=True)
    dt = time.perf_counter() - t_start
    return policy.normalizer.unaction(x.detach()).numpy(), st, dt


def _servo_map(env: Any, dims: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """qpos addresses of the constrained actuators' joints, and the factor that maps a joint
    position to the action whose servo equilibrium it is.

    Adroit's actuators are affine position servos, force = gain * ctrl + bias1 * qpos, at rest
    where qpos = (gain / -bias1) * ctrl; gain != -bias1 for some (door's arm: 500 vs -200, so
    the arm settles at 2.5x the commanded value), hence the map is read from the model, not assumed.
    Returns ``adr`` and ``(k, act_mean, act_rng)`` with ``a_eq(q) = (q / k - act_mean) / act_rng``."""
    mujoco_env = env.unwrapped_mujoco
    model = mujoco_env.model
    dims = list(dims)
    adr = np.array([model.jnt_qposadr[model.actuator_trnid[d, 0]] for d in dims])
    k = np.array([model.actuator_gainprm[d, 0] / -model.actuator_biasprm[d, 1] for d in dims])
    return adr, np.stack([k, np.asarray(mujoco_env.act_mean)[dims], np.asarray(mujoco_env.act_rng)[dims]])


def _rollouts(policy: Any, constraint: AdroitConstraint | KeepOut, pool: list, guide: guidance.Guidance | None,
              clip: bool, episodes: int, seed: int, latency_calls: int, checked: bool = False) -> dict[str, Any]:
    """Lockstep rollouts of ``episodes`` envs of ``pool``; raw per-episode arrays and counters. ``checked``
    (keep-out): each chunk's executed steps must pass ``KeepOut.passes``; an episode whose chunk fails draws
    ``CHECK_RETRY`` guided candidates at once and runs the first that passes, or, when none does, runs
    its chunk through the safety filter (the last line); before each command ``_monitor`` re-checks the
    queue from the measured state and re-plans from there when it no longer clears."""
    constraint.bind(pool[0])
    adim = pool[0].action_space.shape[0]
    if int(policy.config.action_dim) != adim:
        raise InvalidOptionError(f"policy action_dim {policy.config.action_dim} != adroit/{constraint.task} "
                                 f"action dim {adim}")
    H, n_exec = int(policy.config.horizon), int(policy.config.n_exec)
    gen = torch.Generator().manual_seed(int(seed))
    cost = None if guide is None else guide.cost

    obs = [e.reset(seed=seed + i)[0] for i, e in enumerate(pool)]
    first_obs = list(obs)
    active = np.ones(episodes, bool)
    success = np.zeros(episodes, bool)
    steps = np.zeros(episodes, int)
    nonfinite = np.zeros(episodes, bool)  # a chunk with NaN/inf: the episode fails there
    a_max = np.zeros(episodes)        # largest executed excess (constraint units)
    a_sum = np.zeros(episodes)        # summed executed excess over steps and dims
    q_max = np.zeros(episodes)        # largest excess of the robot's state (joint position or palm)
    chunk_viol = chunk_entries = 0    # sampled chunk entries outside the constraint (before any clip)
    width = 1                         # excess entries per executed step (joint limits: one per limited dim)
    nfe = n_backward = calls = n_chunks = 0
    t_batched = 0.0
    queues: list[list[np.ndarray]] = [[] for _ in range(episodes)]
    filtered = np.zeros(episodes, bool)  # this chunk runs through the safety filter (no candidate passed)
    retry_gen = torch.Generator().manual_seed(int(seed) + 1)  # retries leave the shared noise stream alone
    retried = fell_back = monitor_replans = monitor_filtered = 0
    max_steps = max(e.max_episode_steps for e in pool)
    for step in range(max_steps):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        if step % n_exec == 0:
            noise = torch.randn(episodes, H, adim, generator=gen)[idx]
            constraint.before_sample(cost, [pool[i] for i in idx])
            chunks, st, dt = sample_chunks(policy, [obs[i] for i in idx], guide, noise)
            ex = constraint.command_excess(np.nan_to_num(chunks))
            chunk_viol += int((ex > constraint.tol).sum())
            chunk_entries += ex.size
            nfe += st.nfe
            n_backward += st.n_backward
            calls += 1
            n_chunks += idx.size
            t_batched += dt
            for row, episode in enumerate(idx):
                if not np.isfinite(chunks[row]).all():  # the sampler diverged: no valid command
                    nonfinite[episode] = True
                    active[episode] = False
                queues[episode] = list(chunks[row, :n_exec])
            if checked:
                r, f, t = _check_chunks(policy, constraint, pool, obs, idx, chunks[:, :n_exec], guide, queues,
                                        filtered, n_exec, retry_gen)
                retried, fell_back, t_batched = retried + r, fell_back + f, t_batched + t
        for episode in np.flatnonzero(active):
            if checked and not filtered[episode]:
                t_mon = time.perf_counter()
                queues[episode], replanned, filtered[episode] = _monitor(
                    policy, constraint, pool[episode], obs[episode], guide, queues[episode], retry_gen)
                monitor_replans += replanned
                monitor_filtered += filtered[episode]
                t_batched += time.perf_counter() - t_mon  # the robot waits for it: counted in the chunk time
            action = queues[episode].pop(0)
            if clip or (checked and filtered[episode]):
                action = constraint.filter(action, pool[episode])
            action = np.clip(action, -1.0, 1.0)  # what the env executes anyway
            ex = constraint.command_excess(action)
            width = ex.shape[-1]
            a_max[episode] = max(a_max[episode], float(ex.max()))
            a_sum[episode] += float(ex.sum())
            obs[episode], _, _, trunc, info = pool[episode].step(action)
            q_max[episode] = max(q_max[episode], constraint.state_excess(pool[episode]))
            steps[episode] += 1
            if info["success"]:
                success[episode] = True
                active[episode] = False
            elif trunc:
                active[episode] = False
    latency = []
    for observation in first_obs[:max(0, latency_calls)]:
        constraint.before_sample(cost, pool[:1])  # timing only: the path starts where env 0 ended
        _, _, dt = sample_chunks(policy, [observation], guide, torch.randn(1, H, adim, generator=gen))
        latency.append(dt)
    return {"success": success, "steps": steps, "nonfinite": nonfinite, "a_max": a_max, "a_sum": a_sum, "q_max": q_max,
            "chunk_viol": chunk_viol, "chunk_entries": chunk_entries, "nfe": nfe, "n_backward": n_backward,
            "calls": calls, "n_chunks": n_chunks, "t_batched": t_batched, "latency": latency, "width": width,
            "retried": retried, "fell_back": fell_back, "monitor_replans": monitor_replans,
            "monitor_filtered": monitor_filtered}


def _step_clear(constraint: KeepOut, action_queue: list, env: Any) -> bool:
    """The palm path the servo model predicts for the next ``lookahead`` queued commands from the robot's
    current joint state clears the ball (``KeepOut.passes``)."""
    ahead = np.asarray(action_queue[:constraint.lookahead])[None]
    return bool(constraint.passes(ahead, [env])[0])


def _passing_candidate(policy: Any, constraint: KeepOut, env: Any, observation: dict,
                       guide: guidance.Guidance | None, n: int, gen: torch.Generator) -> list | None:
    """``CHECK_RETRY`` guided candidates for one robot from where it is now: the first ``n`` commands of the
    first whose path passes the check, or None (then the filter)."""
    many = [env] * CHECK_RETRY
    constraint.before_sample(None if guide is None else guide.cost, many)
    noise = torch.randn(CHECK_RETRY, int(policy.config.horizon), int(policy.config.action_dim), generator=gen)
    cand, _, _ = sample_chunks(policy, [observation] * CHECK_RETRY, guide, noise)
    good = np.flatnonzero(constraint.passes(cand[:, :n], many))
    return list(cand[good[0], :n]) if good.size else None


def _check_chunks(policy: Any, constraint: KeepOut, pool: list, obs: list, idx: np.ndarray, executed: np.ndarray,
                  guide: guidance.Guidance | None, queues: list, filtered: np.ndarray, n_exec: int,
                  gen: torch.Generator) -> tuple[int, int, float]:
    """The hard check of ``_rollouts(checked=True)`` on the chunks just drawn for episodes ``idx``: a failing
    episode gets ``CHECK_RETRY`` guided candidates (the first that passes replaces its queue) or the
    filter. Returns (episodes retried, episodes filtered, seconds spent)."""
    t0 = time.perf_counter()
    ok = constraint.passes(executed, [pool[i] for i in idx])
    filtered[idx] = False
    fell_back = 0
    for row in np.flatnonzero(~ok):
        episode = int(idx[row])
        queue = _passing_candidate(policy, constraint, pool[episode], obs[episode], guide, n_exec, gen)
        if queue is not None:
            queues[episode] = queue
        else:
            filtered[episode] = True
            fell_back += 1
    return int((~ok).sum()), fell_back, time.perf_counter() - t0


def _monitor(policy: Any, constraint: KeepOut, env: Any, observation: dict, guide: guidance.Guidance | None,
             queue: list, gen: torch.Generator) -> tuple[list, bool, bool]:
    """The per-step monitor of a checked rollout. A chunk is checked once, from where it starts, and the servo
    model's error grows along it (median 3 cm after 8 relocate commands), so before each command the path of
    the next ``lookahead`` queued commands is re-checked from the robot's measured joint state. When it no
    longer clears, the robot re-plans from here (guided candidates for the rest of the chunk); the filter
    only when none passes. Returns (queue, re-planned, filter from now)."""
    if _step_clear(constraint, queue, env):
        return queue, False, False
    fresh = _passing_candidate(policy, constraint, env, observation, guide, len(queue), gen)
    return (queue, True, True) if fresh is None else (fresh, True, False)


def evaluate_constrained(policy: Any, env_id: str, method: str = "none", scale: float = 0.0, episodes: int = 20,
                         seed: int = 3000, weight: float = 100.0, options: dict | None = None,
                         tol: float | None = None, state_tol: float | None = None, latency_calls: int = 5,
                         env_pool: list | None = None, kind: str = "joint_limits") -> dict[str, Any]:
    """Success and constraint violations of ``policy`` on ``env_id`` under the constraint of
    ``kind`` ("joint_limits": tighter joint limits, "keepout": a palm keep-out ball).

    Episodes run in lockstep (episode ``i`` on seed ``seed + i``), one batched sampler call per
    chunk boundary for all running episodes; the initial noise of every call comes from a
    generator seeded with ``seed``, so methods are compared on the same noise. ``ms_per_chunk``
    is the median of ``latency_calls`` single-observation calls (what a robot waits), and
    ``ms_per_chunk_batched`` the amortized time in the batched rollouts. ``env_pool``: reuse
    already made envs (at least ``episodes`` of ``env_id``). ``tol`` / ``state_tol``: the
    constraint's own tolerances unless given (its units). ``violation_rate`` counts the
    constraint's primary measure (joint limits: the executed command; keep-out: the actual palm).
    """
    constraint = constraint_for(env_id, kind)
    env_id = f"adroit/{constraint.task}"
    _parse_method(method)
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise InvalidOptionError(f"episodes must be an integer >= 1; got {episodes!r}")
    tol = constraint.tol if tol is None else float(tol)
    state_tol = constraint.state_tol if state_tol is None else float(state_tol)
    guide = make_guide(policy, constraint, method, scale, weight, options)
    clip = _parse_method(method)[1]
    checked = method.endswith("+check")
    if checked and constraint.kind != "keepout":
        raise InvalidOptionError(f"{method!r}: the hard check reads the keep-out's palm path model; for joint "
                                 "limits clip the command (method 'clip' or '<method>+clip')")
    own = env_pool is None
    pool = [envs.make(env_id) for _ in range(episodes)] if own else list(env_pool)[:episodes]
    if len(pool) < episodes:
        raise InvalidOptionError(f"env_pool holds {len(pool)} envs, need {episodes}")
    try:
        raw = _rollouts(policy, constraint, pool, guide, clip, episodes, seed, latency_calls, checked)
    finally:
        if own:
            for env in pool:
                env.close()
    success, steps, a_max, a_sum, q_max = (raw[k] for k in ("success", "steps", "a_max", "a_sum", "q_max"))
    command_violated = (a_max > tol) | raw["nonfinite"]  # a NaN command is inside no constraint
    state_violated = (q_max > state_tol) | raw["nonfinite"]
    violated = command_violated if constraint.primary == "command" else state_violated
    chunk_viol, chunk_entries, nfe, n_backward, calls, n_chunks, t_batched, latency = (
        raw[k] for k in ("chunk_viol", "chunk_entries", "nfe", "n_backward", "calls", "n_chunks", "t_batched", "latency"))
    total_steps = int(steps.sum())
    return {"env_id": env_id, "kind": constraint.kind, "method": method, "scale": float(scale),
            "episodes": episodes, "seed": seed, "weight": weight,
            "options": {k: (v.tolist() if isinstance(v, (Tensor, np.ndarray)) else v) for k, v in (options or {}).items()},
            "success_rate": float(success.mean()),
            "violation_rate": float(violated.mean()),
            "command_violation_rate": float(command_violated.mean()),
            "state_violation_rate": float(state_violated.mean()),
            "nonfinite_rate": float(raw["nonfinite"].mean()),
            "violation_mean": float(a_sum.sum() / max(total_steps * raw["width"], 1)),
            "violation_max": float(a_max.max()),
            "state_violation_max": float(q_max.max()),
            "chunk_violation_frac": chunk_viol / max(chunk_entries, 1),
            "clean_success_rate": float((success & ~violated).mean()),
            "mean_steps": float(steps.mean()),
            "nfe_per_chunk": nfe / max(calls, 1), "backward_per_chunk": n_backward / max(calls, 1),
            "ms_per_chunk": 1000 * float(np.median(latency)) if latency else None,
            "ms_per_chunk_batched": 1000 * t_batched / max(n_chunks, 1),
            **({"retried_per_chunk": raw["retried"] / max(n_chunks, 1),
                "filtered_per_chunk": raw["fell_back"] / max(n_chunks, 1),
                "monitor_replans_per_chunk": raw["monitor_replans"] / max(n_chunks, 1),
                "monitor_filtered_per_chunk": raw["monitor_filtered"] / max(n_chunks, 1)} if checked else {})}


__all__ = ["CONSTRAINTS", "KEEPOUTS", "KINDS", "METHODS", "GUIDED_METHODS", "AdroitConstraint", "JointLimit",
           "KeepOut", "constraint_for",
           "derive_limit", "evaluate_constrained", "limit_cost", "make_guide", "sample_chunks", "TOL", "QPOS_TOL"]
