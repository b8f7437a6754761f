"""``GroundflowTabletop-v1`` (groundflow id ``maniskill/TabletopSuite-v1``) and its scripted expert.

Three cubes (red, green, blue) in a column of slots in front of the robot and two goal discs
("left" at +y, "right" at -y, seen from the robot). Twelve instructions are feasible from every
initial state: push a cube to a goal (6), pick up a cube (3), stack one cube on another (3). The
commanded task comes from ``reset(options={"task_id": i})`` and is never part of the state vector.
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

from envs.errors import InstructionError, InvalidOptionError  # noqa: E402
from envs.maniskill.tasks.table_scene import (GAIN, _TableTask, _check_cpu_single, _disc_builder, _move,  # noqa: E402
                                              _p, _raw_pose, _rot, _yaw_quat, push_step)
from envs.suite import Suite, Task, check_layout_rho  # noqa: E402

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
    ``layout_rho`` (this episode only), ``layout_task_id`` (correlated layout only: lay the scene
    out as for that task while another is commanded; the shortcut test of P2).
    Constructor: ``layout="random"`` (placement independent of the task: the same seed gives the
    same initial state under every instruction) or ``"correlated"`` (which cube sits in which slot
    and the column shift are a one-to-one function of the task; only the small seeded jitter
    varies). The seeded random draws are identical under both layouts.

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

    def slot_of(self, cube: str) -> int:
        """The slot the named cube starts in this episode (0 nearest the robot: where a correlated
        layout puts the commanded cube)."""
        return self.slot_cubes.index(CUBES.index(cube))

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
        rho = (check_layout_rho(options["layout_rho"], self.episode_layout) if "layout_rho" in options
               else self.layout_rho)
        layout_task = self.commanded_task_id
        if options.get("layout_task_id") is not None:  # the layout of another task (P2's conflict test)
            if self.episode_layout != "correlated":
                raise InvalidOptionError("layout_task_id names whose correlated layout to use; it needs "
                                         f"layout='correlated', got layout={self.episode_layout!r}")
            layout_task = _check_task_id(options["layout_task_id"])
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
                perm, shift_i = correlated_layout(self.suite.tasks[layout_task])
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
HELD_WIDTH = 0.0415  # finger opening (m) below which a cube between the fingers counts as held
OPEN_WIDTH = 0.07


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
        return push_step(tcp, cube, goal, HOVER_Z)

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
