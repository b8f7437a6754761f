"""Obstacles a user adds at run time, which the policy never saw in training.

Guidance steers each chunk away from the obstacles. A hard check of the executed waypoints then
decides: a chunk that passes is sent, otherwise the robot holds (``policies.selection``).

The cost and the check work on the policy's normalized chunk:
1. unnormalize it;
2. map it to the TCP path with the robot's linear end-effector model
   (``tcp + cumsum(a[:, :3]) * ee_delta_scale``);
3. carry the robot's body along that path (points on boxes around the hand, relative to the TCP);
4. take the signed distance of every point to every obstacle.

The collision benchmark and the deploy path (``PolicyServer``, ``LocalPolicy``) both build them here.
``ArmGuidance``'s defaults are the benchmark's recommended row (``benchmarks/results/guidance.json``,
``collision.recommended``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

import guidance
from envs.errors import InvalidOptionError
from envs.geometry import box_surface
from guidance.costs import EEPath, GoalCost, ObstacleCost
from guidance.geometry import Box, Sphere
from policies.selection import ChunkCheck, choose_chunk

class UnsatisfiableError(InvalidOptionError):
    """No motion can meet the constraints: the goal lies inside an obstacle."""


ACTION_LIMIT = 1.0
"""the end-effector controller's action range, [-1, 1] (ManiSkill's ``pd_ee_delta_pos`` clips to it): the
check runs on the clipped chunk, and the chunk sent is that clipped one"""
MAX_OBSTACLES = 64
MAX_BODY_POINTS = 4000
"""points the body may have at the check's spacing (the Panda hand: 468 at 2 cm)"""
MAX_FLOW_STEPS = 50
MAX_DRAWS = 32
"""a client's settings bound what one plan may cost the server"""
MAX_BODY_BOXES = 32


class BodyPath:
    """The body's points along a chunk's TCP path: (B, H, 3) -> (B, H * P, 3)."""

    def __init__(self, path: EEPath, offsets: Any) -> None:
        self.path, self.offsets = path, torch.as_tensor(np.asarray(offsets), dtype=torch.float32)

    def check(self, event_shape: tuple[int, ...]) -> None:
        self.path.check(event_shape)

    def __call__(self, chunk: torch.Tensor) -> torch.Tensor:
        tcp_path = self.path(chunk)
        return (tcp_path[:, :, None, :] + self.offsets.to(tcp_path)).flatten(1, 2)


def goal_room(goal: Any, obstacles: list, body: Any) -> list[float]:
    """Per obstacle, the signed distance (metres; < 0: inside) of the body (``body`` points around the
    TCP) nearest it when the TCP stands at ``goal``."""
    points = torch.as_tensor(np.asarray(goal) + np.asarray(body), dtype=torch.float32)[None]
    return [float(o.sdf(points).min()) for o in obstacles]


def goal_margin(margin: float, clearance: float, goal: Any, obstacles: list, body: Any) -> float:
    """The cost's margin, capped by the room the goal leaves the body (``goal_room``) but never under the
    check's ``clearance``: a margin wider than that room puts the cost's minimum short of the goal, where
    the goal's pull and the margin balance and the arm hovers until the episode ends."""
    if goal is None or not obstacles:
        return margin
    return min(margin, max(clearance, min(goal_room(goal, obstacles, body))))


def unreachable_goal(goal: Any, obstacles: list, body: Any) -> str | None:
    """Why no path can end at ``goal`` with the body (``body`` points around the TCP) outside every
    obstacle, or None. A constraint the robot cannot satisfy is refused, not chased."""
    for k, (o, depth) in enumerate(zip(obstacles, goal_room(goal, obstacles, body))):
        if depth < 0:
            return (f"the goal {np.round(np.asarray(goal, float), 3).tolist()} puts the gripper {-depth * 100:.1f} cm "
                    f"inside obstacle {k} ({type(o).__name__}): no motion can reach it without a collision")
    return None


def path_cost(policy: Any, tcp: Any, ee_delta_scale: float, points: Any, obstacles: list, margin: float,
              weight: float = 1e4, goal: Any = None, goal_weight: float = 0.0) -> ObstacleCost:
    """The obstacle cost of a normalized chunk: ``points`` (P, 3) around the TCP carried along its path,
    penalized within ``margin`` metres of each obstacle. With ``goal_weight`` > 0 (nats/m^2), the
    chunk's end point is also pulled toward ``goal``, so that the detour keeps making progress."""
    path = EEPath(torch.as_tensor(np.asarray(tcp), dtype=torch.float32), ee_delta_scale)
    unnorm = policy.normalizer.unaction
    body_path = BodyPath(path, points)
    cost = ObstacleCost(lambda x: body_path(unnorm(x)), obstacles, margin=margin, weight=weight)
    if goal_weight > 0:
        cost = cost + GoalCost(lambda x: path(unnorm(x)), torch.as_tensor(np.asarray(goal), dtype=torch.float32),
                               weight=goal_weight)
    return cost


def path_check(policy: Any, tcp: Any, ee_delta_scale: float, points: Any, obstacles: list,
               clearance: float, coast: float = 0.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """``feasible(x) -> (N,) bool``: every point of ``points`` along the chunk's TCP path stays at least
    ``clearance`` metres outside every obstacle. The linear path model errs by up to 13 mm (p95, expert
    chunks), so a clearance of 1-2 cm covers it. ``coast``: the path runs on by that fraction of the chunk's
    last step, for an arm that does not stop at once when the next plan is a hold."""
    body_path = BodyPath(EEPath(torch.as_tensor(np.asarray(tcp), dtype=torch.float32), ee_delta_scale), points)
    unnorm = policy.normalizer.unaction

    def executed(x: torch.Tensor) -> torch.Tensor:
        # the env clips each action to [-1, 1] before the controller sees it: check the path it will take
        a = unnorm(x).clamp(-ACTION_LIMIT, ACTION_LIMIT)
        return body_path(torch.cat([a, coast * a[:, -1:]], 1) if coast > 0 else a)
    geometry = ObstacleCost(executed, obstacles)
    return lambda x: geometry.clearance(x) >= clearance


def _vector(v: Any, what: str, n: int = 3, positive: bool = False) -> np.ndarray:
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        a = np.full(n + 1, np.nan)
    if a.shape != (n,) or not np.all(np.isfinite(a)) or (positive and not np.all(a > 0)):
        raise InvalidOptionError(f"{what} must be {n} finite{' positive' if positive else ''} numbers (metres); "
                                 f"got {v!r}")
    return a


def parse_obstacles(items: Any) -> list:
    """``[{"type": "box", "center": [x, y, z], "half_size": [hx, hy, hz]} | {"type": "sphere", "center",
    "radius"}, ...]`` (metres, the robot's base frame) -> guidance ``Box``/``Sphere`` objects. Anything
    else gets an ``InvalidOptionError`` that names the item."""
    if not isinstance(items, (list, tuple)) or len(items) > MAX_OBSTACLES:
        raise InvalidOptionError(f"obstacles must be a list of at most {MAX_OBSTACLES} boxes or spheres; "
                                 f"got {type(items).__name__}")
    out = []
    for k, o in enumerate(items):
        kind = o.get("type") if isinstance(o, dict) else None
        if kind == "box":
            out.append(Box(torch.as_tensor(_vector(o.get("center"), f"obstacle {k}: center"), dtype=torch.float32),
                           torch.as_tensor(_vector(o.get("half_size"), f"obstacle {k}: half_size", positive=True),
                                           dtype=torch.float32)))
        elif kind == "sphere":
            radius = _vector([o.get("radius")], f"obstacle {k}: radius", n=1, positive=True)[0]
            out.append(Sphere(torch.as_tensor(_vector(o.get("center"), f"obstacle {k}: center"), dtype=torch.float32),
                              float(radius)))
        else:
            raise InvalidOptionError(f"obstacle {k} must be {{'type': 'box', 'center', 'half_size'}} or "
                                     f"{{'type': 'sphere', 'center', 'radius'}}; got {o!r}")
    return out


@dataclass(frozen=True)
class ArmGuidance:
    """How a chunk is steered and checked. The defaults are the collision benchmark's recommended row
    (benchmarks/results/guidance.json ``collision``; docs/guidance.md quotes its success, collisions and time)."""

    method: str = "coupled"
    options: dict = field(default_factory=lambda: {"step": "trust", "radius": 3.0})
    scale: float = 10.0
    n_steps: int | None = 5
    """flow steps (None: the policy's)"""
    margin: float = 0.03
    """metres of clearance the cost asks for"""
    margin_to_goal: bool = True
    """cap ``margin`` by the room the goal leaves the body, never under ``clearance`` (``goal_margin``)"""
    goal_weight: float = 100.0
    """nats/m^2 pulling the chunk's end toward the goal (used where the state holds one)"""
    clearance: float = 0.015
    """metres every checked point must keep from every obstacle"""
    cost_spacing: float = 0.04
    """metres between the body's points in the cost (its time grows with their number)"""
    check_spacing: float = 0.02
    """... and in the hard check (dense enough that a clearance of 1.5 cm cannot pass a touch)"""
    coast: float = 0.5
    """the fraction of the chunk's last step the check runs the path on: a Panda under pd_ee_delta_pos moves
    on after a hold (1.2 cm, about half its last step, in the one collision of 100 deploy episodes without it)"""
    fallback: str = "hold"
    """when no sample passes the check: ``hold`` (the robot waits and the next plan tries again) or ``slide``
    (a short move along the nearest obstacle toward the goal, sent only if it passes the same check)"""
    slide_step: float = 0.01
    """metres per step of a slide"""
    check: ChunkCheck = ChunkCheck(retries=1, retry_candidates=8)

    def __post_init__(self) -> None:
        if self.method not in guidance.METHODS or self.method == "none":
            raise InvalidOptionError(f"settings.method must be a guidance method ({', '.join(guidance.METHODS)}); "
                                     f"got {self.method!r}")
        if not isinstance(self.options, dict) or not all(isinstance(k, str) for k in self.options):
            raise InvalidOptionError(f"settings.options must be a dict of the method's options; got {self.options!r}")
        try:  # names an unknown option or a bad value
            g = guidance.make(self.method, cost=None, scale=1.0, **self.options)
        except (TypeError, ValueError) as e:
            raise InvalidOptionError(f"settings.options {self.options!r} for {self.method!r}: {e}") from None
        if g.needs_network_grad:
            raise InvalidOptionError(f"settings.method {self.method!r} needs gradients through the network; the "
                                     "checked chunk is drawn without them (use coupled or particles)")
        for name, lo, hi in (("scale", 0.0, 1e4), ("margin", 0.0, 0.5), ("goal_weight", 0.0, 1e5),
                             ("clearance", 0.0, 0.5), ("cost_spacing", 0.005, 0.5), ("check_spacing", 0.005, 0.5),
                             ("coast", 0.0, 4.0), ("slide_step", 0.001, 0.05)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise InvalidOptionError(f"settings.{name} must be a number in [{lo:g}, {hi:g}]; got {v!r}")
        if self.n_steps is not None and (isinstance(self.n_steps, bool) or not isinstance(self.n_steps, int)
                                         or not 1 <= self.n_steps <= MAX_FLOW_STEPS):
            raise InvalidOptionError(f"settings.n_steps must be an integer in [1, {MAX_FLOW_STEPS}] (or None); "
                                     f"got {self.n_steps!r}")
        if self.fallback not in ("hold", "slide"):
            raise InvalidOptionError(f"settings.fallback must be 'hold' or 'slide'; got {self.fallback!r}")
        if not isinstance(self.margin_to_goal, bool):
            raise InvalidOptionError(f"settings.margin_to_goal must be true or false; got {self.margin_to_goal!r}")
        if self.check.draws > MAX_DRAWS:
            raise InvalidOptionError(f"settings.check draws at most {MAX_DRAWS} candidates per plan (candidates + "
                                     f"retries x retry_candidates); got {self.check}")

    def to_message(self) -> dict:
        return {**{k: getattr(self, k) for k in ("method", "options", "scale", "n_steps", "margin", "margin_to_goal",
                                                  "goal_weight",
                                                  "clearance", "cost_spacing", "check_spacing", "coast",
                                                  "fallback", "slide_step")},
                "candidates": self.check.candidates, "retries": self.check.retries,
                "retry_candidates": self.check.retry_candidates}

    @classmethod
    def from_message(cls, msg: Any) -> "ArmGuidance":
        """Settings a client sent (``to_message``; missing keys take the defaults)."""
        if not isinstance(msg, dict):
            raise InvalidOptionError(f"settings must be a map of ArmGuidance fields; got {msg!r}")
        known = set(cls().to_message())
        if set(msg) - known:
            raise InvalidOptionError(f"unknown settings {sorted(set(msg) - known)}; known: {sorted(known)}")
        kw = {k: v for k, v in msg.items() if k not in ("candidates", "retries", "retry_candidates")}
        check = ChunkCheck(candidates=msg.get("candidates", 1), retries=msg.get("retries", 0),
                           retry_candidates=msg.get("retry_candidates"))
        return cls(**kw, check=check)


@dataclass(frozen=True)
class ArmConstraints:
    """Obstacles plus what the guidance needs to know about the robot: its body (boxes around the hand,
    relative to the TCP), its end-effector step per unit action, and where the state holds the TCP (and
    the goal, where there is one)."""

    obstacles: tuple[dict, ...]
    body: tuple[tuple[tuple[float, float, float], tuple[float, float, float]], ...]
    ee_delta_scale: float
    tcp_index: int
    goal_index: int | None = None
    settings: ArmGuidance = ArmGuidance()

    def __post_init__(self) -> None:
        parse_obstacles(list(self.obstacles))
        # plain numbers from here on (numpy arrays from a scene compare and pack badly)
        object.__setattr__(self, "obstacles", tuple(
            {"type": o["type"], **{k: np.asarray(o[k], np.float64).tolist() for k in ("center", "half_size", "radius")
                                   if k in o}} for o in self.obstacles))
        if not isinstance(self.body, (list, tuple)) or not 1 <= len(self.body) <= MAX_BODY_BOXES:
            raise InvalidOptionError(f"body must be 1 to {MAX_BODY_BOXES} boxes [[lo x, y, z], [hi x, y, z]] "
                                     f"relative to the TCP; got {self.body!r}")
        for k, box in enumerate(self.body):
            lo, hi = (_vector(v, f"body box {k}") for v in (box if isinstance(box, (list, tuple)) and len(box) == 2
                                                             else (None, None)))
            if not np.all(hi >= lo) or np.abs(np.concatenate([lo, hi])).max() > 2.0:
                raise InvalidOptionError(f"body box {k} needs lo <= hi, within 2 m of the TCP; got {box!r}")
        if not (isinstance(self.ee_delta_scale, (int, float)) and math.isfinite(self.ee_delta_scale)
                and 0 < self.ee_delta_scale <= 1):
            raise InvalidOptionError(f"ee_delta_scale is metres per unit action, in (0, 1]; got {self.ee_delta_scale!r}")
        for name in ("tcp_index", "goal_index"):
            v = getattr(self, name)
            if (v is not None or name == "tcp_index") and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise InvalidOptionError(f"{name} must be the index of x in the state (an integer >= 0); got {v!r}")
        n = sum(_surface_count(lo, hi, self.settings.check_spacing) for lo, hi in self.body)
        if n > MAX_BODY_POINTS:
            raise InvalidOptionError(f"the body has {n} points at the check's spacing of {self.settings.check_spacing} "
                                     f"m; at most {MAX_BODY_POINTS} (fewer or smaller boxes, or a wider spacing)")

    @classmethod
    def from_message(cls, msg: dict) -> "ArmConstraints":
        """The constraints a client sent (``to_message``); ``InvalidOptionError`` names what is wrong."""
        try:
            body = tuple((tuple(map(float, b[0])), tuple(map(float, b[1]))) for b in msg.get("body"))
        except (TypeError, ValueError, IndexError):
            raise InvalidOptionError(f"body must be boxes [[lo x, y, z], [hi x, y, z]] relative to the TCP; "
                                     f"got {msg.get('body')!r}") from None
        obstacles = msg.get("obstacles")
        if not isinstance(obstacles, (list, tuple)):
            raise InvalidOptionError(f"obstacles must be a list of boxes or spheres; got {obstacles!r}")
        settings = ArmGuidance.from_message(msg["settings"]) if msg.get("settings") is not None else ArmGuidance()
        return cls(tuple(obstacles), body, msg.get("ee_delta_scale"), msg.get("tcp_index"), msg.get("goal_index"),
                   settings)

    def to_message(self) -> dict:
        return {"obstacles": [dict(o) for o in self.obstacles],
                "body": [[list(lo), list(hi)] for lo, hi in self.body], "ee_delta_scale": float(self.ee_delta_scale),
                "tcp_index": self.tcp_index, "goal_index": self.goal_index, "settings": self.settings.to_message()}

    def check_state(self, state_dim: int) -> None:
        """The TCP and goal indices fit a state of ``state_dim`` entries."""
        for name in ("tcp_index", "goal_index"):
            v = getattr(self, name)
            if v is not None and v + 3 > state_dim:
                raise InvalidOptionError(f"{name} {v}: the state has {state_dim} entries, so x, y, z at {v}..{v + 2} "
                                         "do not fit")

    @functools.cached_property
    def shapes(self) -> list:
        """The obstacles as guidance ``Box``/``Sphere`` objects (built once: every request reads them)."""
        return parse_obstacles(list(self.obstacles))

    def points(self, spacing: float) -> np.ndarray:
        """The body's surface points at ``spacing`` (built once per spacing)."""
        cache = self.__dict__.setdefault("_points", {})
        if spacing not in cache:
            cache[spacing] = np.concatenate([box_surface(np.asarray(lo), np.asarray(hi), spacing)
                                             for lo, hi in self.body])
        return cache[spacing]


def _surface_count(lo: Any, hi: Any, spacing: float) -> int:
    """How many points ``box_surface`` puts on [lo, hi] (without building them)."""
    n = [max(2, int(np.ceil((b - a) / spacing)) + 1) for a, b in zip(lo, hi)]
    return int(np.prod(n) - np.prod([max(k - 2, 0) for k in n]))


def unsatisfiable(c: ArmConstraints, state: np.ndarray) -> str | None:
    """Why the goal in ``state`` cannot be reached (the TCP would stand inside an obstacle), or None."""
    if c.goal_index is None:
        return None
    return unreachable_goal(state[c.goal_index:c.goal_index + 3], c.shapes, [(0.0, 0.0, 0.0)])


@dataclass
class ConstrainedChunk:
    actions: np.ndarray | None
    """(n_exec, A) in env units, the steps the check passed (not the rest of the chunk), or None: hold"""
    why: str = ""
    nfe: int = 0
    rejected: int = 0


def constrained_chunk(policy: Any, obs: dict, c: ArmConstraints) -> ConstrainedChunk:
    """The chunk to send under ``c`` for one observation, or a hold (``actions`` None, ``why``).

    Raises ``UnsatisfiableError`` when the goal in the state lies inside an obstacle. The caller seeds
    torch for a reproducible sample."""
    s = c.settings
    state = np.asarray(obs["state"], dtype=np.float64).reshape(-1)
    c.check_state(state.size)
    why = unsatisfiable(c, state)
    if why:
        raise UnsatisfiableError(why)
    obstacles = c.shapes
    if not obstacles:  # nothing to avoid (a scene without obstacles): the plain sample's checked-length head
        policy.eval()
        with torch.no_grad():
            x = policy.sample_chunks(policy.obs_to_batch(obs), n_steps=s.n_steps)
        return ConstrainedChunk(_sent(policy, x), "", s.n_steps or policy.config.flow_steps, 0)
    tcp = state[c.tcp_index:c.tcp_index + 3]
    goal = None if c.goal_index is None else state[c.goal_index:c.goal_index + 3]
    goal_weight = s.goal_weight if goal is not None else 0.0
    margin = goal_margin(s.margin, s.clearance, goal, obstacles, c.points(s.check_spacing)) if s.margin_to_goal \
        else s.margin
    cost = path_cost(policy, tcp, c.ee_delta_scale, c.points(s.cost_spacing), obstacles, margin,
                     goal=goal, goal_weight=goal_weight)
    guide = guidance.make(s.method, cost=cost, scale=s.scale, **s.options) if s.scale > 0 else None
    feasible = path_check(policy, tcp, c.ee_delta_scale, c.points(s.check_spacing), obstacles, s.clearance,
                          s.coast)
    batch = policy.obs_to_batch(obs)
    x, st = choose_chunk(policy, batch, s.check, guide=guide, cost=cost, n_exec=policy.config.n_exec,
                         feasible=feasible, n_steps=s.n_steps)
    if x is None and s.fallback == "slide" and goal is not None:
        x = _slide(policy, batch, tcp, goal, c, feasible)
    if x is None:
        return ConstrainedChunk(None, f"no chunk kept {100 * s.clearance:.1f} cm from the obstacles "
                                      f"({st.rejected} rejected): hold and plan again", st.nfe, st.rejected)
    return ConstrainedChunk(_sent(policy, x), "", st.nfe, st.rejected)


def _slide(policy: Any, batch: Any, tcp: np.ndarray, goal: np.ndarray, c: ArmConstraints,
           feasible: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """A chunk that slides the hand past the obstacle nearest its body, for a plan no sample passed: every
    step ``slide_step`` metres toward the goal with the part into that obstacle removed, pushed away from it
    by 0, 0.5 or 1 times the step, or straight away from it; the first that passes ``feasible`` (the same
    check), or None. The other action dimensions (a gripper) are the policy's own sample's."""
    s = c.settings
    pts = torch.as_tensor(tcp + c.points(s.check_spacing), dtype=torch.float32)
    depth = torch.stack([o.sdf(pts[None])[0] for o in c.shapes])  # (obstacles, points)
    k, p = divmod(int(depth.argmin()), depth.shape[1])
    eps = 1e-3
    normal = np.array([float(c.shapes[k].sdf((pts[p] + eps * e)[None, None])[0, 0]
                             - c.shapes[k].sdf((pts[p] - eps * e)[None, None])[0, 0]) for e in torch.eye(3)])
    if not np.all(np.isfinite(normal)) or np.linalg.norm(normal) < 1e-9:
        return None
    normal /= np.linalg.norm(normal)
    to_goal = np.asarray(goal, np.float64) - np.asarray(tcp, np.float64)
    along = to_goal - min(0.0, float(to_goal @ normal)) * normal
    along = along / np.linalg.norm(along) if np.linalg.norm(along) > 1e-9 else np.zeros(3)
    with torch.no_grad():
        template = policy.normalizer.unaction(policy.sample_chunks(batch, n_steps=s.n_steps))[0]
    for push in (0.0, 0.5, 1.0, None):
        d = normal if push is None else along + push * normal
        if np.linalg.norm(d) < 1e-9:
            continue
        a = template.clone()
        a[:, :3] = torch.as_tensor(d / np.linalg.norm(d) * s.slide_step / c.ee_delta_scale, dtype=a.dtype)
        x = policy.normalizer.action(a.clamp(-ACTION_LIMIT, ACTION_LIMIT))[None]
        if bool(feasible(x)[0]):
            return x
    return None


def _sent(policy: Any, x: torch.Tensor) -> np.ndarray:
    """What is sent of a normalized chunk: the ``n_exec`` steps the check covered (a robot that ran on into
    the rest would leave the checked path), in env units, clipped as the check assumed."""
    return policy.normalizer.unaction(x.detach())[0].clamp(-ACTION_LIMIT, ACTION_LIMIT).numpy()[: policy.config.n_exec]
