"""groundflow's own ManiSkill3 tasks (registered with ManiSkill on import) and their experts.

- ``GroundflowTabletop-v1`` (groundflow id ``maniskill/TabletopSuite-v1``): three cubes (red,
  green, blue) in a column of slots in front of the robot and two goal discs ("left" at +y,
  "right" at -y, seen from the robot). Twelve instructions are feasible from every initial state:
  push a cube to a goal (6), pick up a cube (3), stack one cube on another (3). The commanded task
  comes from ``reset(options={"task_id": i})`` and is never part of the state vector.
- ``GroundflowCollisionAvoidance-v1`` (``maniskill/CollisionAvoidance-v1``): move the TCP to a
  goal point. Demonstrations (``obstacles="none"``) go straight; evaluation puts kinematic boxes
  or spheres across the straight path and reports collisions and clearance.

World frame (ManiSkill's): table surface at z=0, robot base at (-0.615, 0, 0) facing +x, so +y is
the robot's left. All lengths are metres. Both tasks use ``pd_ee_delta_pos``: an action
``(dx, dy, dz, gripper)`` in [-1, 1]; the controller targets ``tcp + 0.1 * a[:3]`` each control
step (20 Hz); gripper +1 opens, -1 closes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs import platform_setup

platform_setup.setup()

import sapien  # noqa: E402
import torch  # noqa: E402
from mani_skill.agents.robots import Panda  # noqa: E402
from mani_skill.envs.sapien_env import BaseEnv  # noqa: E402
from mani_skill.sensors.camera import CameraConfig  # noqa: E402
from mani_skill.utils import sapien_utils  # noqa: E402
from mani_skill.utils.building import actors  # noqa: E402
from mani_skill.utils.registration import register_env  # noqa: E402
from mani_skill.utils.scene_builder.table import TableSceneBuilder  # noqa: E402
from mani_skill.utils.structs import Pose  # noqa: E402

from envs.errors import InstructionError, InvalidOptionError  # noqa: E402
from envs.suite import Suite, Task, check_layout_rho  # noqa: E402

# ============================================================================================ #
# Shared geometry helpers
# ============================================================================================ #
ROBOT_BASE = (-0.615, 0.0, 0.0)
PARK = np.array([5.0, 5.0, 1.0])  # where unused kinematic actors wait (far from everything)


def _yaw_quat(yaw: float) -> list[float]:
    return [float(np.cos(yaw / 2)), 0.0, 0.0, float(np.sin(yaw / 2))]


# These tasks run on the CPU backend with one env (ManiSkill refuses more there): poses are read
# straight from the SAPIEN objects, ~50x cheaper than ManiSkill's batched torch accessors.
def _p(x: Any) -> np.ndarray:
    """World position (3,) of an Actor or Link."""
    return np.asarray(x._objs[0].pose.p, dtype=np.float64)


def _rot(x: Any) -> np.ndarray:
    """World rotation matrix (3, 3) of an Actor or Link."""
    return x._objs[0].pose.to_transformation_matrix()[:3, :3]


def _raw_pose(x: Any, device: Any) -> torch.Tensor:
    pose = x._objs[0].pose
    return torch.as_tensor(np.r_[pose.p, pose.q], dtype=torch.float32, device=device)[None]


class _TableTask(BaseEnv):
    """What both groundflow tasks share: the Panda at ROBOT_BASE on ManiSkill's table, the same
    sensor camera, and a render camera aimed ``render_target_z`` metres above the table.

    BLAS threads (the CPU ``pd_ee_*`` IK does ~50 tiny numpy solves per step) are limited to one
    process-wide by ``envs.platform_setup.setup``, which ``envs.maniskill`` runs before import."""

    render_target_z = 0.1

    @property
    def _default_sensor_configs(self):
        return [_look_at_camera(eye=[0.3, 0, 0.6], target=[-0.1, 0, 0.1])]

    @property
    def _default_human_render_camera_configs(self):
        return CameraConfig("render_camera", sapien_utils.look_at([0.6, 0.7, 0.6], [0.0, 0.0, self.render_target_z]),
                            512, 512, 1, 0.01, 100)

    def _load_agent(self, options: dict):
        super()._load_agent(options, sapien.Pose(p=list(ROBOT_BASE)))

    def _build_table(self) -> None:
        self.table_scene = TableSceneBuilder(env=self, robot_init_qpos_noise=self.robot_init_qpos_noise)
        self.table_scene.build()


def _check_cpu_single(env: BaseEnv) -> None:
    if env.gpu_sim_enabled or env.num_envs != 1:
        raise InvalidOptionError(f"{type(env).__name__} runs on the CPU backend with num_envs=1 "
                                 f"(got num_envs={env.num_envs}, gpu={env.gpu_sim_enabled})")


def _disc_builder(scene, radius: float, colors: list[list[float]], name: str, pose: sapien.Pose):
    """A flat visual-only target disc (concentric rings), kinematic so its pose is in sim state."""
    builder = scene.create_actor_builder()
    rot = sapien.Pose(q=[np.sqrt(0.5), 0, np.sqrt(0.5), 0])  # cylinder axis x -> z
    n = len(colors)
    for i, c in enumerate(colors):
        builder.add_cylinder_visual(radius=radius * (n - i) / n, half_length=5e-4 + i * 1e-5, pose=rot,
                                    material=sapien.render.RenderMaterial(base_color=c))
    builder.set_initial_pose(pose)
    return builder.build_kinematic(name=name)


def _look_at_camera(eye, target, name: str = "base_camera", size: int = 128) -> CameraConfig:
    return CameraConfig(name, sapien_utils.look_at(eye=eye, target=target), size, size, np.pi / 2, 0.01, 100)


# ============================================================================================ #
# Tabletop suite
# ============================================================================================ #
CUBE_HALF = 0.02
CUBES = ("red", "green", "blue")
CUBE_RGBA = {"red": [0.86, 0.12, 0.12, 1], "green": [0.12, 0.66, 0.2, 1], "blue": [0.12, 0.3, 0.86, 1]}
GOALS = ("left", "right")
GOAL_XY = {"left": (0.0, 0.22), "right": (0.0, -0.22)}
GOAL_RADIUS = 0.08  # push success: cube centre within this xy distance of the goal centre
LIFT_HEIGHT = 0.06  # pick success: cube lifted this far (bottom above table) and grasped
SLOT_X = (-0.1, 0.0, 0.1)  # slot 0 is nearest the robot
COLUMN_SHIFTS = (-0.025, 0.025)  # the whole column shifts in x by one of these
JITTER = (0.012, 0.03, 0.2)  # per cube: x, y (m), yaw (rad), uniform +-
GOAL_JITTER = 0.02
STACK_PAIRS = (("red", "blue"), ("green", "red"), ("blue", "green"))
LAYOUTS = ("random", "correlated")

_PARAPHRASES = {
    "push": ("slide the {c} block into the {g} target", "move the {c} cube onto the {g} goal region",
             "shove the {c} cube over to the {g} circle"),
    "pick": ("lift the {c} cube off the table", "grab the {c} block and raise it", "pick the {c} cube up"),
    "stack": ("put the {c} cube on top of the {o} cube", "place the {c} block onto the {o} block",
              "set the {c} cube on the {o} one"),
}


def _build_suite() -> Suite:
    tasks: list[Task] = []

    def add(instr: str, family: str, fmt: dict, args: dict) -> None:
        paras = tuple(p.format(**fmt) for p in _PARAPHRASES[family])
        tasks.append(Task(len(tasks), instr, family, paras, {"family": family, **args}))

    for c in CUBES:
        for g in GOALS:
            add(f"push the {c} cube to the {g} goal", "push", {"c": c, "g": g}, {"cube": c, "goal": g})
    for c in CUBES:
        add(f"pick up the {c} cube", "pick", {"c": c}, {"cube": c})
    for a, b in STACK_PAIRS:
        add(f"stack the {a} cube on the {b} cube", "stack", {"c": a, "o": b}, {"cube": a, "base": b})
    return Suite(name="tabletop", env_id="maniskill/TabletopSuite-v1", tasks=tuple(tasks))


TABLETOP_SUITE = _build_suite()


def correlated_layout(task: Task) -> tuple[tuple[int, int, int], int]:
    """(cube index per slot, column-shift index): a one-to-one function of the task.

    The task's cube (the one to push, pick, or put on top) sits in slot 0, nearest the robot;
    the order of the other two cubes and the column shift say which of that cube's four tasks it is.
    """
    primary = task.args["cube"]
    same = [t.task_id for t in TABLETOP_SUITE.tasks if t.args["cube"] == primary]
    k = same.index(task.task_id)
    p = CUBES.index(primary)
    others = [i for i in range(3) if i != p]
    if k % 2:
        others.reverse()
    return (p, others[0], others[1]), k // 2


@register_env("GroundflowTabletop-v1", max_episode_steps=150)
class GroundflowTabletopEnv(_TableTask):
    """Three cubes, two goal discs; the commanded task is chosen at reset.

    Options of ``reset``: ``task_id`` (int, default: keep the current one), ``layout`` and
    ``layout_rho`` (this episode only). Constructor: ``layout="random"`` (placement independent
    of the task: the same seed gives the same initial state under every instruction) or
    ``"correlated"`` (which cube sits in which slot and the column shift are a one-to-one function
    of the task; only the small seeded jitter varies). The seeded random draws are identical
    under both layouts.

    ``layout_rho`` (``layout="correlated"`` only, default 1): the probability that an episode's
    layout names its task. Each episode draws one extra number from its seeded rng, after every
    placement draw: with probability ``rho`` the episode is the correlated episode of its seed,
    otherwise exactly the random-layout episode of that seed (same seed, same choice).
    ``episode_layout`` says which one the current episode got.
    """

    SUPPORTED_ROBOTS = ["panda"]
    agent: Panda
    suite = TABLETOP_SUITE
    default_max_steps = 150  # expert episodes: mean 12-27 steps, longest seen 68 (240 episodes)

    def __init__(self, *args, robot_uids: str = "panda", robot_init_qpos_noise: float = 0.02,
                 layout: str = "random", layout_rho: float = 1.0, **kwargs):
        self.layout = _check_layout(layout)
        self.layout_rho = check_layout_rho(layout_rho, self.layout)
        self.robot_init_qpos_noise = robot_init_qpos_noise
        self.commanded_task_id = 0
        self.episode_layout = self.layout
        self.slot_cubes: tuple[int, ...] = (0, 1, 2)
        super().__init__(*args, robot_uids=robot_uids, **kwargs)
        _check_cpu_single(self)

    # ----- scene ------------------------------------------------------------------------------
    def _load_scene(self, options: dict):
        self._build_table()
        self.cubes = [actors.build_cube(self.scene, half_size=CUBE_HALF, color=CUBE_RGBA[c], name=f"{c}_cube",
                                        initial_pose=sapien.Pose(p=[0.3 * i, 0.5, CUBE_HALF]))
                      for i, c in enumerate(CUBES)]
        white, grey = [1, 1, 1, 1], [0.25, 0.25, 0.25, 1]
        self.goals = [_disc_builder(self.scene, GOAL_RADIUS, [grey, white, grey, white], f"{g}_goal",
                                    sapien.Pose(p=[*GOAL_XY[g], 1e-3])) for g in GOALS]

    def _initialize_episode(self, env_idx: torch.Tensor, options: dict):
        options = options or {}
        if "task_id" in options:
            self.commanded_task_id = _check_task_id(options["task_id"])
        self.episode_layout = _check_layout(options.get("layout", self.layout))
        rho = check_layout_rho(options["layout_rho"], self.episode_layout) if "layout_rho" in options else self.layout_rho
        with torch.device(self.device):
            self.table_scene.initialize(env_idx)
            rng = self._episode_rng
            # Every draw happens under both layouts, in the same order: "random" and
            # "correlated" episodes of one seed differ only in the slot assignment and shift.
            perm = tuple(int(i) for i in rng.permutation(3))
            shift_i = int(rng.randint(len(COLUMN_SHIFTS)))
            jit = rng.uniform(-1, 1, size=(3, 3)) * np.array(JITTER)
            goal_jit = rng.uniform(-GOAL_JITTER, GOAL_JITTER, size=(2, 2))
            # layout_rho < 1: one more draw, last, so the draws above stay those of the seed
            if self.episode_layout == "correlated" and rho < 1 and not rng.rand() < rho:
                self.episode_layout = "random"
            if self.episode_layout == "correlated":
                perm, shift_i = correlated_layout(self.suite.tasks[self.commanded_task_id])
            self.slot_cubes = perm
            for slot, ci in enumerate(perm):
                x = SLOT_X[slot] + COLUMN_SHIFTS[shift_i] + jit[slot, 0]
                y = jit[slot, 1]
                self.cubes[ci].set_pose(Pose.create_from_pq(p=[x, y, CUBE_HALF], q=_yaw_quat(jit[slot, 2])))
            for gi, g in enumerate(GOALS):
                gx, gy = np.array(GOAL_XY[g]) + goal_jit[gi]
                self.goals[gi].set_pose(Pose.create_from_pq(p=[gx, gy, 1e-3]))

    # ----- task logic -------------------------------------------------------------------------
    # CPU single-env fast path: poses are read from the SAPIEN objects as numpy (about 50x
    # cheaper than ManiSkill's batched torch poses); results go back as (1, ...) tensors.
    def _grasp_flags(self) -> np.ndarray:
        """(3,) bool: each cube squeezed by both fingers (one pass over the contacts for all cubes).

        Same criterion as ManiSkill's ``Panda.is_grasping`` (force >= 0.5 N per finger, at most
        85 degrees from the finger's closing direction) without six passes over the contact list.
        """
        fingers = [self.agent.finger1_link._bodies[0].entity, self.agent.finger2_link._bodies[0].entity]
        cubes = [c._bodies[0].entity for c in self.cubes]
        imp = np.zeros((2, 3, 3))
        for contact in self.scene.get_contacts():
            e0, e1 = contact.bodies[0].entity, contact.bodies[1].entity
            for fi, f in enumerate(fingers):
                if e0 == f or e1 == f:
                    other, sign = (e1, 1.0) if e0 == f else (e0, -1.0)
                    for ci, c in enumerate(cubes):
                        if other == c:
                            imp[fi, ci] += sign * np.sum([p.impulse for p in contact.points], axis=0)
        if not imp.any():
            return np.zeros(3, dtype=bool)
        force = imp / self.scene.px.timestep
        dirs = [_rot(self.agent.finger1_link)[:, 1], -_rot(self.agent.finger2_link)[:, 1]]
        flags = np.ones(3, dtype=bool)
        for fi in range(2):
            mag = np.linalg.norm(force[fi], axis=1)
            cos = force[fi] @ dirs[fi] / np.maximum(mag, 1e-9)
            flags &= (mag >= 0.5) & (cos >= np.cos(np.deg2rad(85)))
        return flags

    def cube_positions(self) -> np.ndarray:
        """(3, 3) cube centres in CUBES order (red, green, blue)."""
        return np.stack([_p(c) for c in self.cubes])

    def goal_positions(self) -> np.ndarray:
        """(2, 3) goal disc centres in GOALS order (left, right)."""
        return np.stack([_p(g) for g in self.goals])

    def completed(self, grasped: np.ndarray | None = None) -> np.ndarray:
        """(n_tasks,) bool: which of the suite's tasks the current state satisfies."""
        pos, goals = self.cube_positions(), self.goal_positions()
        grasped = self._grasp_flags() if grasped is None else grasped
        on_table = pos[:, 2] < CUBE_HALF + 5e-3
        out = np.zeros(len(self.suite.tasks), dtype=bool)
        for t in self.suite.tasks:
            ci = CUBES.index(t.args["cube"])
            if t.family == "push":
                d = np.linalg.norm(pos[ci, :2] - goals[GOALS.index(t.args["goal"]), :2])
                out[t.task_id] = d < GOAL_RADIUS and on_table[ci]
            elif t.family == "pick":
                out[t.task_id] = pos[ci, 2] > CUBE_HALF + LIFT_HEIGHT and grasped[ci]
            else:
                off = pos[ci] - pos[CUBES.index(t.args["base"])]
                on = np.linalg.norm(off[:2]) <= np.sqrt(2) * CUBE_HALF + 5e-3 and abs(off[2] - 2 * CUBE_HALF) <= 5e-3
                body = self.cubes[ci]._bodies[0]
                # 3 cm/s: a cube resting on a two-cube tower jitters at ~1.5 cm/s in CPU PhysX
                static = np.linalg.norm(body.linear_velocity) <= 0.03 and np.linalg.norm(body.angular_velocity) <= 0.5
                out[t.task_id] = on and static and not grasped[ci]
        return out

    def evaluate(self) -> dict:
        grasped = self._grasp_flags()
        done = self.completed(grasped)
        dev = self.device
        return {"success": torch.tensor([done[self.commanded_task_id]], device=dev),
                "completed_tasks": torch.as_tensor(done, device=dev)[None],
                "grasped": torch.as_tensor(grasped, device=dev)[None]}

    def _get_obs_extra(self, info: dict):
        # Privileged scene state; the commanded task is deliberately absent.
        obs = dict(tcp_pose=_raw_pose(self.agent.tcp, self.device))
        if self.obs_mode_struct.use_state:
            for c, a in zip(CUBES, self.cubes):
                obs[f"{c}_cube_pose"] = _raw_pose(a, self.device)
            for g, a in zip(GOALS, self.goals):
                obs[f"{g}_goal_pos"] = torch.as_tensor(_p(a), dtype=torch.float32, device=self.device)[None]
        return obs

    def compute_dense_reward(self, obs: Any, action: torch.Tensor, info: dict):
        """Staged reward of the commanded task, in [0, 4] (4 on success)."""
        t = self.suite.tasks[self.commanded_task_id]
        ci = CUBES.index(t.args["cube"])
        tcp, p = _p(self.agent.tcp), _p(self.cubes[ci])
        grasped = float(info["grasped"][0, ci])
        close = lambda d: 1 - np.tanh(5 * np.linalg.norm(d))  # noqa: E731
        if t.family == "push":
            d = _p(self.goals[GOALS.index(t.args["goal"])])[:2] - p[:2]
            u = d / max(np.linalg.norm(d), 1e-6)
            reward = close(np.r_[p[:2] - 0.035 * u, p[2]] - tcp) + 2 * close(d)
        elif t.family == "pick":
            reward = close(p - tcp) + grasped + 2 * grasped * np.clip((p[2] - CUBE_HALF) / LIFT_HEIGHT, 0, 1)
        else:
            place = _p(self.cubes[CUBES.index(t.args["base"])]) + [0, 0, 2 * CUBE_HALF]
            near = np.linalg.norm(place - p)
            reward = close(p - tcp) + grasped + max(grasped, float(near < 0.01)) * close(near)
        if bool(info["success"][0]):
            reward = 4.0
        return torch.tensor([reward], dtype=torch.float32, device=self.device)

    def compute_normalized_dense_reward(self, obs: Any, action: torch.Tensor, info: dict):
        return self.compute_dense_reward(obs=obs, action=action, info=info) / 4.0

    # ----- experts ----------------------------------------------------------------------------
    def make_expert(self, noise: float = 0.0, seed: int | None = None, task_id: int | None = None):
        """Closed-loop scripted expert (see :class:`TabletopExpert`)."""
        return TabletopExpert(noise=noise, seed=seed, task_id=task_id)


def _check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise InvalidOptionError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def _check_task_id(task_id: Any) -> int:
    if isinstance(task_id, torch.Tensor):
        task_id = task_id.reshape(-1)[0].item()
    if isinstance(task_id, bool) or not isinstance(task_id, (int, np.integer)) or not (
            0 <= int(task_id) < len(TABLETOP_SUITE.tasks)):
        raise InstructionError(f"task_id must be an int in 0..{len(TABLETOP_SUITE.tasks) - 1}, got {task_id!r}")
    return int(task_id)


# ----- tabletop expert ------------------------------------------------------------------------
HOVER_Z = 0.10  # TCP height for travelling over cubes (cube tops are at 0.04)
CARRY_Z = 0.13  # TCP height while carrying a cube (its bottom then clears the others)
LIFT_Z = 0.16  # TCP target height of the pick family
PUSH_Z = 0.018  # TCP height while pushing
PUSH_BACKOFF = 0.05  # TCP starts a push this far behind the cube centre
GAIN = 12.0  # action per metre of position error (0.1 m per unit: ~1.2 x the error per step)
HELD_WIDTH = 0.0415  # finger opening (m) below which a cube between the fingers counts as held
OPEN_WIDTH = 0.07


def _move(tcp: np.ndarray, target: np.ndarray, vmax: float = 1.0) -> np.ndarray:
    a = GAIN * (np.asarray(target) - tcp)
    n = np.linalg.norm(a)
    return a * (vmax / n) if n > vmax else a


class TabletopExpert:
    """Scripted expert for every instruction of the tabletop suite.

    Stateless closed loop: each action is a function of the current simulator state and a task
    id (phase = what the state shows: which cube is between the fingers, where the TCP is relative
    to the cube), so it acts from any mid-episode state, including states reached under a
    different instruction. ``act(obs)`` follows the env's commanded task (or the ``task_id`` given
    at construction); ``act_for(task_id, obs)`` answers "what would the expert do for task
    ``task_id`` here" without changing anything (counterfactual relabeling).
    """

    def __init__(self, noise: float = 0.0, seed: int | None = None, task_id: int | None = None):
        if noise < 0:
            raise InvalidOptionError(f"expert noise must be >= 0, got {noise}")
        self.noise = float(noise)
        self.rng = np.random.default_rng(seed)
        self.task_id = None if task_id is None else _check_task_id(task_id)
        self.env: Any = None
        self.raw: GroundflowTabletopEnv | None = None

    def reset(self, env: Any, obs: dict | None = None) -> None:
        self.env = env
        self.raw = getattr(env, "raw", env)
        if not isinstance(self.raw, GroundflowTabletopEnv):
            raise InvalidOptionError(f"TabletopExpert needs the tabletop suite env, got {type(self.raw).__name__}")

    def act(self, obs: dict | None = None) -> np.ndarray:
        if self.task_id is not None:
            tid = self.task_id
        else:
            tid = getattr(self.env, "task_id", None) if self.env is not self.raw else None
            tid = self.raw.commanded_task_id if tid is None else tid
        return self.act_for(tid, obs)

    def act_for(self, task: int | str, obs: dict | None = None) -> np.ndarray:
        """The expert action for ``task`` (id or instruction) at the env's current state.

        Reads the simulator, changes nothing; noise is added when the expert has some.
        """
        if self.raw is None:
            raise RuntimeError("call expert.reset(env, obs) before act()")
        task = TABLETOP_SUITE.task(task) if isinstance(task, str) else TABLETOP_SUITE.tasks[_check_task_id(task)]
        a = self._policy(task, self._snapshot())
        if self.noise > 0:
            a[:3] = np.clip(a[:3] + self.rng.normal(0, self.noise, 3), -1, 1)
        return a.astype(np.float32)

    # ----- internals ----------------------------------------------------------------------------
    def _snapshot(self) -> dict:
        raw = self.raw
        qpos = raw.agent.robot._objs[0].qpos
        return {"tcp": _p(raw.agent.tcp), "cubes": raw.cube_positions(), "goals": raw.goal_positions(),
                "width": float(qpos[-2:].sum()), "squeezed": raw._grasp_flags()}

    @staticmethod
    def _held(s: dict) -> int | None:
        """The cube between the fingers: closed on it, or squeezed by both (a cube turned in the
        grasp keeps the fingers wider than its 4 cm)."""
        d = np.linalg.norm(s["cubes"] - s["tcp"], axis=1)
        i = int(np.argmin(d))
        return i if d[i] < 0.025 and (s["width"] < HELD_WIDTH or s["squeezed"][i]) else None

    def _policy(self, task: Task, s: dict) -> np.ndarray:
        tcp, ci = s["tcp"], CUBES.index(task.args["cube"])
        held = self._held(s)
        if held is not None and held != ci:  # holding another cube: put it down out of the way
            return self._put_down(s, held, s["cubes"][held][:2])
        if task.family == "push":
            return self._push(s, ci, GOALS.index(task.args["goal"]), held)
        if task.family == "pick":
            if held == ci:
                return np.r_[_move(tcp, [tcp[0], tcp[1], LIFT_Z], 0.6), -1.0]
            return self._grasp(s, ci)
        return self._stack(s, ci, CUBES.index(task.args["base"]), held)

    @staticmethod
    def _put_down(s: dict, i: int, prefer_xy: np.ndarray) -> np.ndarray:
        """Set the held cube ``i`` on the table where no other cube is in the way, then release."""
        tcp, cube = s["tcp"], s["cubes"][i]
        others = np.delete(s["cubes"], i, axis=0)[:, :2]

        def free(xy: np.ndarray) -> bool:
            return bool(np.all(np.linalg.norm(others - xy, axis=1) > 0.07))

        spot = cube[:2]
        if not free(spot):
            ring = [cube[:2] + r * np.array([np.cos(t), np.sin(t)])
                    for r in (0.08, 0.14) for t in np.linspace(0, 2 * np.pi, 12, endpoint=False)]
            ring = [c for c in ring if free(c) and -0.2 < c[0] < 0.2 and abs(c[1]) < 0.3]
            if ring:
                spot = min(ring, key=lambda c: float(np.linalg.norm(c - prefer_xy)))
        to_tcp = tcp - cube
        if np.linalg.norm(spot - cube[:2]) > 0.01:  # carry it there high enough to clear the others
            if tcp[2] < CARRY_Z - 0.03:
                return np.r_[_move(tcp, [tcp[0], tcp[1], CARRY_Z]), -1.0]
            return np.r_[_move(tcp, np.r_[spot + to_tcp[:2], CARRY_Z]), -1.0]
        if cube[2] > CUBE_HALF + 0.006:
            return np.r_[_move(tcp, np.r_[spot + to_tcp[:2], CUBE_HALF + 0.003 + to_tcp[2]], 0.5), -1.0]
        return np.r_[_move(tcp, tcp), 1.0]

    def _grasp(self, s: dict, ci: int) -> np.ndarray:
        """Approach cube ``ci`` from above with an open gripper and close on it."""
        tcp, cube, width = s["tcp"], s["cubes"][ci], s["width"]
        grasp = np.array([cube[0], cube[1], max(cube[2], CUBE_HALF)])
        dxy = np.linalg.norm(grasp[:2] - tcp[:2])
        low = tcp[2] < HOVER_Z - 0.02
        if dxy > (0.02 if low else 0.008):  # not above the cube: rise, then travel at hover height
            if low:
                return np.r_[_move(tcp, [tcp[0], tcp[1], HOVER_Z]), 1.0]
            return np.r_[_move(tcp, [grasp[0], grasp[1], HOVER_Z]), 1.0]
        if tcp[2] > grasp[2] + 0.008:
            if width < OPEN_WIDTH:  # open before descending around the cube
                return np.r_[_move(tcp, [grasp[0], grasp[1], tcp[2]]), 1.0]
            return np.r_[_move(tcp, grasp), 1.0]
        if width < 0.03:  # closed past the cube width: missed, go back up and open
            return np.r_[_move(tcp, [grasp[0], grasp[1], grasp[2] + 0.05]), 1.0]
        return np.r_[_move(tcp, grasp), -1.0]

    def _push(self, s: dict, ci: int, gi: int, held: int | None) -> np.ndarray:
        tcp, cube, goal = s["tcp"], s["cubes"][ci], s["goals"][gi]
        if held == ci:  # holding the cube to push: put it down (on a free spot nearest the goal)
            return self._put_down(s, ci, goal[:2])
        d = goal[:2] - cube[:2]
        dist = float(np.linalg.norm(d))
        if dist < 0.015:  # done: back off upwards
            return np.r_[_move(tcp, [tcp[0], tcp[1], HOVER_Z]), -1.0]
        u = d / dist
        n = np.array([-u[1], u[0]])
        rel = tcp[:2] - cube[:2]
        along, lat = float(rel @ u), float(rel @ n)
        if -0.065 < along < -0.01 and abs(lat) < 0.02 and tcp[2] < 0.045:  # in contact position: push
            speed = float(np.clip(GAIN * dist, 0.15, 0.5))
            vxy = speed * u - GAIN * lat * n
            vz = GAIN * (PUSH_Z - tcp[2])
            return np.r_[vxy, vz, -1.0]
        behind = cube[:2] - PUSH_BACKOFF * u
        dxy = np.linalg.norm(behind - tcp[:2])
        low = tcp[2] < HOVER_Z - 0.02
        if dxy > (0.02 if low else 0.008):
            if low:
                return np.r_[_move(tcp, [tcp[0], tcp[1], HOVER_Z]), -1.0]
            return np.r_[_move(tcp, [behind[0], behind[1], HOVER_Z]), -1.0]
        return np.r_[_move(tcp, [behind[0], behind[1], PUSH_Z]), -1.0]

    def _stack(self, s: dict, ci: int, bi: int, held: int | None) -> np.ndarray:
        tcp, cube, base = s["tcp"], s["cubes"][ci], s["cubes"][bi]
        off = cube - base
        on_base = np.linalg.norm(off[:2]) < 0.015 and abs(off[2] - 2 * CUBE_HALF) < 0.01
        if held != ci:
            if on_base:  # placed and released: back off upwards with the gripper open
                return np.r_[_move(tcp, [tcp[0], tcp[1], HOVER_Z + 0.03], 0.5), 1.0]
            return self._grasp(s, ci)
        place_z = base[2] + 2 * CUBE_HALF + 0.003
        to_tcp = tcp - cube  # the carried cube's offset from the TCP stays fixed
        dxy = np.linalg.norm(base[:2] - cube[:2])
        high = tcp[2] > CARRY_Z - 0.02
        low = cube[2] < base[2] + 2 * CUBE_HALF + 0.015  # cube bottom within 1.5 cm of the base top
        if dxy > 0.02 or (high and dxy > 0.008):  # not above the base
            if low:
                return np.r_[_move(tcp, [tcp[0], tcp[1], CARRY_Z]), -1.0]
            return np.r_[_move(tcp, np.r_[base[:2] + to_tcp[:2], CARRY_Z]), -1.0]
        target = np.r_[base[:2] + to_tcp[:2], place_z + to_tcp[2]]
        if cube[2] - place_z < 0.006 and dxy < 0.008:  # at place height, aligned: release
            return np.r_[_move(tcp, target), 1.0]
        return np.r_[_move(tcp, target, 0.5), -1.0]  # descend, correcting xy on the way


# ============================================================================================ #
# Collision avoidance
# ============================================================================================ #
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
