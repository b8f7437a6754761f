"""``GroundflowCollisionAvoidance-v1`` (groundflow id ``maniskill/CollisionAvoidance-v1``) and its expert.

Move the TCP to a goal point. Demonstrations (``obstacles="none"``) go straight; evaluation puts
kinematic boxes or spheres across the straight path and reports collisions and clearance.
World frame and action space: see ``envs.maniskill.tasks.table_scene``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs import platform_setup

platform_setup.setup()

import sapien  # noqa: E402
import torch  # noqa: E402
from mani_skill.agents.robots import Panda  # noqa: E402
from mani_skill.utils.building import actors  # noqa: E402
from mani_skill.utils.registration import register_env  # noqa: E402
from mani_skill.utils.structs import Pose  # noqa: E402

from envs.errors import InvalidOptionError  # noqa: E402
from envs.geometry import box_surface  # noqa: E402
from envs.maniskill.tasks.table_scene import PARK, _TableTask, _check_cpu_single, _move, _p, _raw_pose  # noqa: E402

OBSTACLE_MODES = ("none", "box", "sphere", "random")
GOAL_TOLERANCE = 0.025  # success: TCP within this distance of the goal point
# Obstacle pool, built once (sizes fixed per actor so the sim state alone fixes the geometry);
# unused ones are parked far away. Boxes are axis-aligned.
BOX_HALF_SIZES = ((0.06, 0.025, 0.06), (0.05, 0.035, 0.05))  # thin in y: walls across the sideways path
SPHERE_RADII = (0.055, 0.045)
OBSTACLE_TYPES = {"none": 0, "box": 1, "sphere": 2}
# ee_delta_scale: metres the TCP moves per unit action per control step in pd_ee_delta_pos. The
# controller targets 0.1 m per unit from the *current* pose each step and the joint PD gets ~40%
# of the way before the next target replaces it: a one-step action moves the TCP 0.038-0.041 m in
# total (x within one step; y and z over two: 0.018 + 0.017 + 0.004). Linear model
# tcp + cumsum(a[:, :3]) * 0.0396 against the real path (20 episodes): 8-step chunks of the
# expert, max error per chunk 6 mm mean / 13 mm p95; with action noise 0.3, 21 / 32 mm.
EE_DELTA_SCALE = 0.0396
EE_DELTA_TARGET_SCALE = 0.1


@register_env("GroundflowCollisionAvoidance-v1", max_episode_steps=60)
class GroundflowCollisionAvoidanceEnv(_TableTask):
    """Reach a goal point with the TCP; evaluation places obstacles across the straight path.

    ``obstacles`` (constructor, or ``reset(options={"obstacles": ...})`` for one episode): "none"
    (demonstrations), "box", "sphere" (one obstacle) or "random" (one or two, each a box or a
    sphere). One seed gives the same start and goal under every mode. Obstacle centres lie on the
    straight start->goal segment (fraction 0.5, or 0.35 and 0.72 for two) with a lateral offset
    below 40% of their smallest half size, so the straight path always passes through them.
    Obstacles are kinematic (they never move).

    info: ``success`` (TCP within ``GOAL_TOLERANCE`` of the goal), ``dist_to_goal``,
    ``collision`` (this step), ``collided`` (any step of the episode so far), ``clearance``
    (signed distance from the gripper key points - TCP, both finger pads, hand - to the nearest
    obstacle surface; +inf without obstacles), ``min_clearance`` (episode minimum),
    ``obstacles`` ((2, 7) rows ``[type, cx, cy, cz, hx, hy, hz]``, type 0 absent / 1 box with half
    extents h / 2 sphere with radius hx = hy = hz; metres, world frame).

    Collision = (a) a PhysX contact between any robot link and an obstacle with penetration
    (separation <= 1 mm) or a non-zero impulse, from the last physics sub-step of the control
    step, or (b) a gripper key point inside an obstacle (geometric check, catches tunnelling).
    ``collided`` and ``min_clearance`` are episode bookkeeping, not simulator state: restoring a
    state with ``set_state`` does not restore them (obstacles and goal are restored: they are
    kinematic actors whose poses are in the state). The hand starts turned 90 degrees about z so
    its narrow side faces the mostly sideways path.
    """

    SUPPORTED_ROBOTS = ["panda"]
    agent: Panda
    default_max_steps = 60  # the straight expert needs 12-21 steps
    ee_delta_scale = EE_DELTA_SCALE
    ee_delta_target_scale = EE_DELTA_TARGET_SCALE
    goal_tolerance = GOAL_TOLERANCE

    def __init__(self, *args, robot_uids: str = "panda", robot_init_qpos_noise: float = 0.02,
                 obstacles: str = "none", **kwargs):
        if obstacles not in OBSTACLE_MODES:
            raise InvalidOptionError(f"obstacles must be one of {list(OBSTACLE_MODES)}, got {obstacles!r}")
        self.obstacle_mode = obstacles
        self.robot_init_qpos_noise = robot_init_qpos_noise
        self.start_tcp = np.zeros(3)
        self._collided = False
        self._min_clearance = float("inf")
        self._body_points: tuple[float, np.ndarray] | None = None  # per episode: the hand turns at reset
        super().__init__(*args, robot_uids=robot_uids, **kwargs)
        _check_cpu_single(self)

    render_target_z = 0.2

    def _load_scene(self, options: dict):
        self._build_table()
        self.goal_marker = actors.build_sphere(self.scene, radius=0.015, color=[0.1, 0.8, 0.2, 1], name="goal",
                                               body_type="kinematic", add_collision=False,
                                               initial_pose=sapien.Pose(p=[0, 0, 0.3]))
        color = [0.9, 0.45, 0.1, 1]
        self.obstacle_specs: list[tuple[int, np.ndarray]] = []
        self.obstacle_actors = []
        for i, h in enumerate(BOX_HALF_SIZES):
            self.obstacle_actors.append(actors.build_box(self.scene, half_sizes=list(h), color=color, name=f"box{i}",
                                                         body_type="kinematic",
                                                         initial_pose=sapien.Pose(p=list(PARK + [i, 0, 0]))))
            self.obstacle_specs.append((OBSTACLE_TYPES["box"], np.array(h)))
        for i, r in enumerate(SPHERE_RADII):
            self.obstacle_actors.append(actors.build_sphere(self.scene, radius=r, color=color, name=f"sphere{i}",
                                                            body_type="kinematic",
                                                            initial_pose=sapien.Pose(p=list(PARK + [0, i + 1, 0]))))
            self.obstacle_specs.append((OBSTACLE_TYPES["sphere"], np.array([r, r, r])))
        self._robot_entities = [link._bodies[0].entity for link in self.agent.robot.get_links()]
        self._obstacle_entities = [a._bodies[0].entity for a in self.obstacle_actors]
        keys = ("panda_hand_tcp", "panda_leftfinger_pad", "panda_rightfinger_pad", "panda_hand")
        self._key_links = [l for l in self.agent.robot.get_links() if l.name in keys]

    def _initialize_episode(self, env_idx: torch.Tensor, options: dict):
        options = options or {}
        mode = options.get("obstacles", self.obstacle_mode)
        if mode not in OBSTACLE_MODES:
            raise InvalidOptionError(f"obstacles must be one of {list(OBSTACLE_MODES)}, got {mode!r}")
        with torch.device(self.device):
            self.table_scene.initialize(env_idx)
            # Turn the hand 90 degrees about z so its narrow side (not its 0.2 m width) faces
            # the mostly sideways (y) path: obstacles near the start then do not touch it.
            qpos = self.agent.robot.get_qpos().clone()
            qpos[:, 6] += np.pi / 2
            self.agent.reset(qpos)
            rng = self._episode_rng
            start = self._forward_tcp()
            side = 1.0 if rng.rand() < 0.5 else -1.0
            goal = np.array([rng.uniform(-0.1, 0.1), side * rng.uniform(0.25, 0.32), rng.uniform(0.08, 0.26)])
            self.goal_marker.set_pose(Pose.create_from_pq(p=goal.tolist()))
            # Draw every obstacle variable whatever the mode, so one seed gives the same start
            # and goal with and without obstacles.
            n_random = 1 + int(rng.rand() < 0.5)
            kinds = rng.randint(2, size=2)
            which = rng.randint(2, size=2)
            lateral = rng.uniform(-1, 1, size=(2, 3))
            if mode == "none":
                chosen: list[int] = []
            elif mode in ("box", "sphere"):
                chosen = [(0 if mode == "box" else 2) + int(which[0])]
            else:
                chosen = [2 * int(kinds[0]) + int(which[0])]
                if n_random == 2:
                    second = 2 * int(kinds[1]) + int(which[1])
                    chosen.append(second if second != chosen[0] else (second ^ 1))
            fracs = [0.5] if len(chosen) == 1 else [0.35, 0.72]
            path = goal - start
            u = path / np.linalg.norm(path)
            for k, a in enumerate(self.obstacle_actors):
                a.set_pose(Pose.create_from_pq(p=(PARK + [k, 0, 0]).tolist()))
            for j, k in enumerate(chosen):
                h = self.obstacle_specs[k][1]
                off = lateral[j] - (lateral[j] @ u) * u  # perpendicular to the path
                size = np.linalg.norm(off)
                center = start + fracs[j] * path + 0.4 * float(h.min()) * min(1.0, size) * off / max(size, 1e-9)
                self.obstacle_actors[k].set_pose(Pose.create_from_pq(p=center.tolist()))
            self.start_tcp = start
        self._collided = False
        self._min_clearance = float("inf")
        self._body_points = None

    def _forward_tcp(self) -> np.ndarray:
        """TCP position of the freshly reset robot (the robot's qpos is set, poses follow)."""
        return _p(self.agent.tcp)

    # ----- geometry ---------------------------------------------------------------------------
    @property
    def active_obstacles(self) -> list[int]:
        """Pool indices of the obstacles in the scene, read from their poses (so a restored
        simulator state brings its obstacles with it); parked ones are far away."""
        return [k for k, a in enumerate(self.obstacle_actors) if np.linalg.norm(_p(a)[:2]) < 2.0]

    def obstacle_array(self) -> np.ndarray:
        """(2, 7) float32 rows ``[type, cx, cy, cz, hx, hy, hz]`` of the active obstacles (type 0 = none)."""
        out = np.zeros((2, 7), dtype=np.float32)
        for j, k in enumerate(self.active_obstacles):
            kind, h = self.obstacle_specs[k]
            out[j] = [kind, *_p(self.obstacle_actors[k]), *h]
        return out

    def obstacle_list(self) -> list[dict]:
        """Active obstacles as dicts: ``{"type": "box", "center", "half_size"}`` or
        ``{"type": "sphere", "center", "radius"}`` (metres, world frame)."""
        out = []
        for row in self.obstacle_array():
            if row[0] == 1:
                out.append({"type": "box", "center": row[1:4].copy(), "half_size": row[4:7].copy()})
            elif row[0] == 2:
                out.append({"type": "sphere", "center": row[1:4].copy(), "radius": float(row[4])})
        return out

    def tcp_and_goal(self) -> tuple[np.ndarray, np.ndarray]:
        """Current TCP position and goal point (world frame, metres)."""
        return _p(self.agent.tcp), _p(self.goal_marker)

    BODY_LINKS = ("panda_hand", "panda_leftfinger", "panda_rightfinger", "panda_link7")
    """the links rigid with the TCP while pd_ee_delta_pos holds the hand's orientation"""

    def body_boxes(self) -> np.ndarray:
        """(L, 2, 3) boxes [lo, hi] that enclose the hand, fingers and wrist link, relative to the TCP
        (world frame, metres), read from the links' collision shapes at the current pose: the robot's
        body as a guided policy's cost and check see it (``body_points``), and as a client sends it to
        a policy server with deploy-time obstacles."""
        tcp = _p(self.agent.tcp)
        out = []
        for link in self.agent.robot.get_links():
            if link.name not in self.BODY_LINKS:
                continue
            corners = []
            for body in link._bodies:
                for shape in body.get_collision_shapes():
                    T = (body.entity.pose * shape.local_pose).to_transformation_matrix()
                    if hasattr(shape, "get_vertices"):
                        v = shape.get_vertices() * shape.get_scale()
                    else:  # a box
                        v = np.array(np.meshgrid(*[[-h, h] for h in shape.half_size], indexing="ij")).reshape(3, -1).T
                    corners.append(v @ T[:3, :3].T + T[:3, 3] - tcp)
            if corners:
                pts = np.concatenate(corners)
                out.append((pts.min(0), pts.max(0)))
        return np.asarray(out, dtype=np.float64).reshape(-1, 2, 3)

    def body_points(self, spacing: float = 0.02) -> np.ndarray:
        """(P, 3) points on the surfaces of ``body_boxes``, relative to the TCP (world frame, metres), at
        most ``spacing`` apart. The hand keeps its orientation in this task, so a check of these points
        at clearance >= spacing / 2 cannot miss a touch: the gripper key points (link origins) read 2-6
        cm of clearance when the hand's edge touched an obstacle."""
        if self._body_points is not None and self._body_points[0] == spacing:
            return self._body_points[1]
        pts = np.concatenate([box_surface(lo, hi, spacing) for lo, hi in self.body_boxes()])
        self._body_points = (spacing, pts.astype(np.float32))
        return self._body_points[1]

    def predict_tcp_path(self, actions: np.ndarray, tcp: np.ndarray | None = None) -> np.ndarray:
        """Linear model of the TCP path under an action chunk: ``tcp + cumsum(a[:, :3]) * ee_delta_scale``."""
        tcp = self.tcp_and_goal()[0] if tcp is None else np.asarray(tcp)
        return tcp + np.cumsum(np.asarray(actions)[:, :3], axis=0) * self.ee_delta_scale

    def _clearance(self) -> float:
        pts = np.stack([_p(l) for l in self._key_links])
        best = float("inf")
        for row in self.obstacle_array():
            if row[0] == 1:
                q = np.abs(pts - row[1:4]) - row[4:7]
                sd = np.linalg.norm(np.maximum(q, 0), axis=1) + np.minimum(q.max(axis=1), 0)
            elif row[0] == 2:
                sd = np.linalg.norm(pts - row[1:4], axis=1) - row[4]
            else:
                continue
            best = min(best, float(sd.min()))
        return best

    def colliding_links(self) -> list[str]:
        """Names of robot links in contact with an active obstacle (diagnostics)."""
        obst = [self._obstacle_entities[k] for k in self.active_obstacles]
        names = set()
        for contact in self.scene.get_contacts():
            e0, e1 = contact.bodies[0].entity, contact.bodies[1].entity
            for x, y in ((e0, e1), (e1, e0)):
                if any(x == o for o in obst) and any(y == r for r in self._robot_entities):
                    if any(p.separation <= 1e-3 for p in contact.points):
                        names.add(y.name)
        return sorted(names)

    def _contact_collision(self) -> bool:
        active = self.active_obstacles
        if not active:
            return False
        obst = [self._obstacle_entities[k] for k in active]
        for contact in self.scene.get_contacts():
            e0, e1 = contact.bodies[0].entity, contact.bodies[1].entity
            hit = (any(e0 == o for o in obst) and any(e1 == r for r in self._robot_entities)) or (
                any(e1 == o for o in obst) and any(e0 == r for r in self._robot_entities))
            if hit and any(p.separation <= 1e-3 or np.linalg.norm(p.impulse) > 0 for p in contact.points):
                return True
        return False

    def evaluate(self) -> dict:
        tcp, goal = self.tcp_and_goal()
        dist = float(np.linalg.norm(goal - tcp))
        clearance = self._clearance()
        collision = self._contact_collision() or clearance < 0
        self._collided = self._collided or collision
        self._min_clearance = min(self._min_clearance, clearance)
        one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt, device=self.device)  # noqa: E731
        return {"success": one(dist < GOAL_TOLERANCE, torch.bool), "dist_to_goal": one(dist),
                "collision": one(collision, torch.bool), "collided": one(self._collided, torch.bool),
                "clearance": one(clearance), "min_clearance": one(self._min_clearance),
                "obstacles": torch.as_tensor(self.obstacle_array(), device=self.device)[None]}

    def _get_obs_extra(self, info: dict):
        # No obstacle information: policies are trained without obstacles; guidance adds them.
        obs = dict(tcp_pose=_raw_pose(self.agent.tcp, self.device))
        if self.obs_mode_struct.use_state:
            tcp, goal = self.tcp_and_goal()
            obs.update(goal_pos=torch.as_tensor(goal, dtype=torch.float32, device=self.device)[None],
                       tcp_to_goal=torch.as_tensor(goal - tcp, dtype=torch.float32, device=self.device)[None])
        return obs

    def compute_dense_reward(self, obs: Any, action: torch.Tensor, info: dict):
        reward = 1 - torch.tanh(5 * info["dist_to_goal"])
        reward = reward - 0.5 * info["collision"].float()
        reward[info["success"]] = 1.0
        return reward

    def compute_normalized_dense_reward(self, obs: Any, action: torch.Tensor, info: dict):
        return self.compute_dense_reward(obs=obs, action=action, info=info)

    def make_expert(self, noise: float = 0.0, seed: int | None = None, vmax: float = 0.5):
        """Straight-line reach expert (never looks at obstacles)."""
        return StraightReachExpert(noise=noise, seed=seed, vmax=vmax)


class StraightReachExpert:
    """Moves the TCP straight at the goal: ``a = clip(gain * (goal - tcp))``, gripper closed."""

    def __init__(self, noise: float = 0.0, seed: int | None = None, vmax: float = 0.5):
        if noise < 0 or not 0 < vmax <= 1:
            raise InvalidOptionError(f"need noise >= 0 and 0 < vmax <= 1, got noise={noise}, vmax={vmax}")
        self.noise, self.vmax = float(noise), float(vmax)
        self.rng = np.random.default_rng(seed)
        self.raw: GroundflowCollisionAvoidanceEnv | None = None

    def reset(self, env: Any, obs: dict | None = None) -> None:
        self.raw = getattr(env, "raw", env)
        if not isinstance(self.raw, GroundflowCollisionAvoidanceEnv):
            raise InvalidOptionError("StraightReachExpert needs the collision-avoidance env, "
                                     f"got {type(self.raw).__name__}")

    def act(self, obs: dict | None = None) -> np.ndarray:
        if self.raw is None:
            raise RuntimeError("call expert.reset(env, obs) before act()")
        tcp, goal = self.raw.tcp_and_goal()
        a = _move(tcp, goal, self.vmax)
        if self.noise > 0:
            a = np.clip(a + self.rng.normal(0, self.noise, 3), -1, 1)
        return np.r_[a, -1.0].astype(np.float32)
