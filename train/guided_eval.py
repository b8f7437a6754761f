"""Guided evaluation on the collision-avoidance task: a flow policy trained on obstacle-free
straight reaches is steered around obstacles at test time by a guidance method.

The cost lives on the policy's normalized chunk x: unnormalize, map to the TCP path with the
task's linear end-effector model (tcp + cumsum(a[:, :3]) * ee_delta_scale), then penalize the
path points within ``margin`` of each obstacle (signed distance, metres).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

import envs
import guidance
from envs.errors import InvalidOptionError
from policies.constraints import ArmGuidance, goal_margin, parse_obstacles, path_check, path_cost, unreachable_goal
from policies.selection import ChunkCheck, choose_chunk


def obstacles_of(raw: Any) -> list:
    """The env's obstacles as guidance ``Box``/``Sphere`` objects."""
    return parse_obstacles(raw.obstacle_list())


# Key points of the Panda gripper relative to the TCP in this task (hand pointing down, turned 90
# degrees about z, orientation held by pd_ee_delta_pos), metres, read from the link poses at reset:
# finger pads at x +-0.04, the hand (0.2 m wide along x) at z +0.10, link 7 at z +0.21. In the
# demo run every collision happened with the TCP 4-8 cm from the obstacle: the hand and wrist hit it.
# Links 5-6 reach back (-x) from the wrist at z +0.21.
GRIPPER_POINTS = ((0.0, 0.0, 0.0), (0.04, 0.0, 0.0), (-0.04, 0.0, 0.0), (0.04, 0.0, 0.045), (-0.04, 0.0, 0.045),
                  (0.0, 0.0, 0.10), (0.05, 0.0, 0.10), (-0.05, 0.0, 0.10), (0.09, 0.0, 0.10), (-0.09, 0.0, 0.10),
                  (0.0, 0.0, 0.16), (0.0, 0.0, 0.21), (-0.045, 0.0, 0.21), (-0.09, 0.0, 0.21))
TCP_ONLY = ((0.0, 0.0, 0.0),)
LINKS = "links"
"""body: points on the hand's, fingers' and wrist's collision boxes (the env's ``body_points``)"""
# one home for these numbers: the deploy path's settings (policies.constraints.ArmGuidance)
LINK_SPACING = ArmGuidance.cost_spacing
"""metres between those points in the guidance cost (its time grows with their number)"""
CHECK_SPACING = ArmGuidance.check_spacing
"""... and in the hard check (once per candidate: dense enough that clearance >= 1.5 cm cannot pass a touch)"""
CHECK_CLEARANCE = ArmGuidance.clearance
"""metres every checked point must keep from every obstacle"""


def _body(raw: Any, body: Any, spacing: float = LINK_SPACING) -> Any:
    return raw.body_points(spacing) if isinstance(body, str) and body == LINKS else body


def obstacle_cost(policy: Any, raw: Any, margin: float, weight: float = 1e4, goal_weight: float = 0.0,
                  body: Any = GRIPPER_POINTS, obstacles: list | None = None, margin_floor: float | None = None):
    """Obstacle cost on the gripper's key points along the chunk's TCP path (``body``; TCP_ONLY
    for the TCP alone, LINKS for points on the hand's collision boxes), plus (``goal_weight`` > 0,
    nats/m^2) a pull of the chunk's end point toward the goal, so the detour keeps making progress.
    ``obstacles``: Sphere/Box list given by the user (None: the env's). A goal where a point of the
    gripper would stand inside an obstacle raises ``InvalidOptionError``. ``margin_floor`` (metres; None:
    off): the margin is capped by the room the goal leaves the hand's boxes, never under this floor
    (``policies.constraints.goal_margin``)."""
    obs = obstacles_of(raw) if obstacles is None else list(obstacles)
    if not obs:
        return None
    tcp, goal = raw.tcp_and_goal()
    points = _body(raw, body)
    # refused only where the gripper's own points (not the boxes that enclose its links, which overlap
    # an obstacle at the goal in 7% of the benchmark's episodes) would stand inside an obstacle
    why = unreachable_goal(goal, obs, GRIPPER_POINTS) if goal_weight > 0 else None
    if why:
        raise InvalidOptionError(why)
    if margin_floor is not None and goal_weight > 0:
        margin = goal_margin(margin, margin_floor, goal, obs, raw.body_points(CHECK_SPACING))
    return path_cost(policy, tcp, raw.ee_delta_scale, points, obs, margin, weight=weight, goal=goal,
                     goal_weight=goal_weight)


def hard_check(policy: Any, raw: Any, clearance: float, body: Any = GRIPPER_POINTS,
               obstacles: list | None = None, coast: float = 0.0) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``feasible(x) -> (N,) bool``: every body point (``body``; ``LINKS`` at ``CHECK_SPACING``)
    along the chunk's TCP path at least ``clearance`` metres outside every obstacle (None without
    obstacles; ``obstacles`` as in ``obstacle_cost``). The linear path model errs by up to 13 mm (p95,
    expert chunks), so 1-2 cm covers it. ``coast``: the path runs on by that fraction of its last step (the
    arm moves on during a hold that may follow; ``policies.constraints.path_check``)."""
    obs = obstacles_of(raw) if obstacles is None else list(obstacles)
    if not obs:
        return None
    tcp, _ = raw.tcp_and_goal()
    return path_check(policy, tcp, raw.ee_delta_scale, _body(raw, body, CHECK_SPACING), obs, clearance, coast)


def _plan(policy: Any, raw: Any, obs: Any, method: str, scale: float, margin: float, goal_weight: float,
          options: dict | None, body: tuple, check: ChunkCheck | None, clearance: float,
          n_steps: int | None, margin_to_goal: bool = False, coast: float = 0.0) -> tuple[Any, int, bool]:
    """(normalized chunk or None to hold, network evaluations, whether it was held). ``margin_to_goal``: the
    margin capped by the goal's room, never under ``clearance``; ``coast``: the check's (``hard_check``)."""
    guide, cost = None, None
    obstacles = obstacles_of(raw)  # read once for the cost and the check
    if (method != "none" and scale > 0) or check is not None:
        cost = obstacle_cost(policy, raw, margin, goal_weight=goal_weight, body=body, obstacles=obstacles,
                             margin_floor=clearance if margin_to_goal else None)
    if method != "none" and scale > 0 and cost is not None:
        guide = guidance.make(method, cost=cost, scale=scale, **(options or {}))
    batch = policy.obs_to_batch(obs)
    if check is not None:
        x, st = choose_chunk(policy, batch, check, guide=guide, cost=cost, n_exec=policy.config.n_exec,
                             feasible=hard_check(policy, raw, clearance, body, obstacles, coast), n_steps=n_steps)
        return x, st.nfe, st.held
    if guide is not None and guide.needs_network_grad:
        x, st = policy.sample_chunks(batch, guide=guide, return_stats=True, n_steps=n_steps)
    else:
        with torch.no_grad():
            x, st = policy.sample_chunks(batch, guide=guide, return_stats=True, n_steps=n_steps)
    return x, st.nfe, False


def evaluate_collision(policy: Any, method: str = "none", scale: float = 0.0, episodes: int = 20, seed: int = 2000,
                       obstacles: str = "random", margin: float = 0.05, goal_weight: float = 30.0, options: dict | None = None,
                       env: Any = None, body: tuple[tuple[float, float, float], ...] = GRIPPER_POINTS,
                       check: ChunkCheck | None = None, clearance: float = CHECK_CLEARANCE,
                       n_steps: int | None = None, margin_to_goal: bool = False, coast: float = 0.0) -> dict[str, Any]:
    """Success and collision rates of ``policy`` guided by ``method`` at ``scale``; with ``check``,
    the chunk sent is chosen by ``policies.selection.choose_chunk`` (candidates, the hard check at
    ``clearance`` metres, a hold when none passes: one step of zero motion, then a fresh plan).

    Defaults measured on 12 probe episodes (coupled, scale 10, a policy trained on DART demos):
    TCP-only cost -> collisions by the hand and wrist; gripper key points with a 3 cm margin ->
    25% collisions and stalls in front of walls; 5 cm margin plus a goal pull of 30 nats/m^2 ->
    92% success, 0% collisions."""
    own = env is None
    env = env or envs.make("maniskill/CollisionAvoidance-v1", obstacles=obstacles)
    raw = env.raw
    succ = coll = clean = 0
    nfe = chunks = holds = 0
    t_sample = 0.0
    for episode in range(episodes):
        obs, info = env.reset(seed=seed + episode)
        policy.reset()
        torch.manual_seed(seed + episode)  # the flow sampler's noise: a rerun gives the same rates
        queue: list[np.ndarray] = []
        last = np.zeros(policy.config.action_dim, np.float32)
        collided = False
        success = False
        for _ in range(env.max_episode_steps):
            if not queue:
                t_start = time.perf_counter()
                x, n, held = _plan(policy, raw, obs, method, scale, margin, goal_weight, options, body, check,
                                   clearance, n_steps, margin_to_goal, coast)
                t_sample += time.perf_counter() - t_start
                nfe += n
                chunks += 1
                holds += held
                if held:  # zero TCP deltas keep the arm where it is (the gripper as it was); plan again next step
                    queue = [np.concatenate([np.zeros(3, np.float32), last[3:]])]
                else:
                    chunk = policy.normalizer.unaction(x.detach())[0].numpy()
                    queue = list(chunk[: policy.config.n_exec])
            last = queue.pop(0)
            obs, reward, term, trunc, info = env.step(last)
            collided = collided or bool(info.get("collision", False))
            if info["success"]:
                success = True
                break
            if trunc:
                break
        succ += success
        coll += collided
        clean += success and not collided
    if own:
        env.close()
    return {"method": method, "scale": scale, "episodes": episodes, "success_rate": succ / episodes,
            "collision_rate": coll / episodes, "clean_success_rate": clean / episodes, "nfe_per_chunk": nfe / max(chunks, 1),
            "ms_per_chunk": 1000 * t_sample / max(chunks, 1),
            "hold_rate": holds / max(chunks, 1)}
