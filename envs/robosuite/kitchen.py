"""RoboCasa-style atomic "put X in/on Y" kitchen tasks on robosuite 1.5: one scene, six instructions.

A Panda at a table with three objects (red cube, green can, blue cube) in a row of three slots and
two receptacles: a white plate (robot's right, -y) and a wooden bin (robot's left, +y). Every
instruction "put the <object> <on the plate | in the bin>" is feasible from the same initial
state, so following the instruction is necessary and measurable:

    env = envs.make("robosuite/KitchenSuite", layout="random")
    obs, info = env.reset(seed=0, options={"instruction": "put the green can in the bin"})
    expert = env.make_expert(); expert.reset(env, obs)

``info["success"]`` is true only when the commanded task holds; ``info["completed_tasks"]`` is a
bool mask over the suite's tasks, True where the task's condition holds (to report "did a
different task"; the same convention as the ManiSkill tabletop suite); ``info["grasped"]`` one
flag per object, True while the gripper holds it (what a mid-episode switch interrupted), and
``info["eef_distance"]`` the gripper's distance to each object in metres (where it is heading).

Layouts: ``"random"`` draws the slot of every object from the seed alone (all instructions see
the same initial state for a seed); ``"correlated"`` makes the slot assignment a function of the
commanded task (the commanded object starts in the slot next to its target receptacle, the other
two in a task-specific order), so the scene alone predicts the task. In both, the seed adds
small position/yaw jitter and robot joint noise. ``layout="correlated", layout_rho=0.9``: the
layout names the task in 90% of the episodes and is the seed's random layout otherwise (one extra
seeded draw per episode, after the placement draws; ``env.episode_layout`` says which).

Action: the robosuite backend's OSC_POSE layout ``[dx, dy, dz, dax, day, daz, grip]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.errors import InstructionError, InvalidOptionError
from envs.geometry import rotvec
from envs.robosuite.env import (CONTROLLERS, RobosuiteEnv, check_cameras, check_positive_int,
                                    import_robosuite, make_robosuite_env)
from envs.suite import Suite, Task, check_layout_rho

import_robosuite()

from robosuite.environments.manipulation.manipulation_env import ManipulationEnv  # noqa: E402
from robosuite.models.arenas import TableArena  # noqa: E402
from robosuite.models.objects import BoxObject, CylinderObject  # noqa: E402
from robosuite.models.objects.composite import Bin  # noqa: E402
from robosuite.models.tasks import ManipulationTask  # noqa: E402
from robosuite.utils.observables import Observable, sensor  # noqa: E402

TABLE_TOP = 0.8
LAYOUTS = ("random", "correlated")

# Objects: name, shape, rgba, half-extents (box: half sizes; cylinder: radius, half height).
OBJECTS = (
    {"name": "red cube", "key": "red_cube", "shape": "box", "size": (0.02, 0.02, 0.02),
     "rgba": (0.85, 0.1, 0.1, 1.0), "words": ("red cube", "red block")},
    {"name": "green can", "key": "green_can", "shape": "cylinder", "size": (0.022, 0.045),
     "rgba": (0.1, 0.65, 0.2, 1.0), "words": ("green can", "green cylinder")},
    {"name": "blue cube", "key": "blue_cube", "shape": "box", "size": (0.02, 0.02, 0.02),
     "rgba": (0.15, 0.3, 0.9, 1.0), "words": ("blue cube", "blue block")},
)
# Receptacles (fixed places, free bodies so they rest on the table): plate disc and open bin.
PLATE = {"name": "plate", "xy": (0.0, -0.22), "radius": 0.075, "half_height": 0.006}
BIN = {"name": "bin", "xy": (0.0, 0.22), "size": (0.16, 0.16, 0.06), "wall": 0.01}
RECEPTACLES = ("plate", "bin")
SLOTS = np.array([(0.0, -0.09), (0.0, 0.0), (0.0, 0.09)])  # slot 0 next to the plate, 2 next to the bin
# correlated layout: task id -> object index in each slot (a bijection: the layout names the task)
CORRELATED = {0: (0, 1, 2), 1: (2, 1, 0), 2: (1, 2, 0), 3: (0, 2, 1), 4: (2, 0, 1), 5: (1, 0, 2)}


def _tasks() -> tuple[Task, ...]:
    tasks = []
    for o, obj in enumerate(OBJECTS):
        a, b = obj["words"]
        for r, rec in enumerate(RECEPTACLES):
            prep, verb = ("on", "set it on") if rec == "plate" else ("in", "drop it into")
            instruction = f"put the {a} {prep} the {rec}"
            paraphrases = (f"place the {a} {prep} the {rec}",
                           f"move the {b} {'onto' if rec == 'plate' else 'into'} the {rec}",
                           f"pick up the {a} and {verb} the {rec}",
                           f"the {b} goes {prep} the {rec}")
            tasks.append(Task(task_id=len(tasks), instruction=instruction, family="pick_place",
                              paraphrases=paraphrases,
                              args={"object": obj["name"], "object_index": o, "receptacle": rec,
                                    "receptacle_index": r}))
    return tuple(tasks)


TASKS = _tasks()


def _yaw(quat_wxyz: np.ndarray) -> float:
    w, x, y, z = quat_wxyz
    return float(np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z)))


class GroundflowKitchen(ManipulationEnv):
    """The robosuite scene: table, Panda, three objects, plate and bin.

    ``commanded_task`` (set before ``reset``) is read only by the correlated layout.
    """

    def __init__(self, layout: str = "random", jitter: float = 0.015, yaw_range: float = np.pi / 6,
                 initialization_noise: Any = "default", use_object_obs: bool = True,
                 layout_rho: float = 1.0, **kwargs: Any):
        self.layout = layout
        self.layout_rho = float(layout_rho)
        self.episode_layout = layout
        self.jitter = float(jitter)
        self.yaw_range = float(yaw_range)
        self.commanded_task = 0
        self.table_full_size = (0.8, 0.8, 0.05)
        self.table_offset = np.array((0.0, 0.0, TABLE_TOP))
        self.use_object_obs = use_object_obs  # always on: the state needs object poses
        super().__init__(initialization_noise=initialization_noise, **kwargs)

    # ----- model -----------------------------------------------------------------------------
    def _load_model(self) -> None:
        super()._load_model()
        robot = self.robots[0].robot_model
        robot.set_base_xpos(robot.base_xpos_offset["table"](self.table_full_size[0]))
        arena = TableArena(table_full_size=self.table_full_size, table_friction=(1.0, 5e-3, 1e-4),
                           table_offset=self.table_offset)
        arena.set_origin([0, 0, 0])
        self.objects = []
        for spec in OBJECTS:
            cls = BoxObject if spec["shape"] == "box" else CylinderObject
            self.objects.append(cls(name=spec["key"], size=spec["size"], rgba=spec["rgba"],
                                    friction=(1.5, 5e-3, 1e-4), density=300.0, rng=self.rng))
        self.plate = CylinderObject(name="plate", size=(PLATE["radius"], PLATE["half_height"]),
                                    rgba=(0.93, 0.93, 0.9, 1.0), density=5000.0, rng=self.rng)
        self.bin = Bin(name="bin", bin_size=BIN["size"], wall_thickness=BIN["wall"],
                       transparent_walls=False, density=3000.0)
        self.receptacles = [self.plate, self.bin]
        self.model = ManipulationTask(mujoco_arena=arena,
                                      mujoco_robots=[r.robot_model for r in self.robots],
                                      mujoco_objects=self.objects + self.receptacles)

    def _setup_references(self) -> None:
        super()._setup_references()
        self.object_body_ids = [self.sim.model.body_name2id(o.root_body) for o in self.objects]
        self.receptacle_body_ids = [self.sim.model.body_name2id(r.root_body) for r in self.receptacles]
        self.eef_site_id = self.robots[0].eef_site_id["right"]

    def _setup_observables(self):
        observables = super()._setup_observables()
        data = self.sim.data

        def make(name: str, fn):
            fn.__name__ = name
            return sensor(modality="object")(fn)

        sensors = []
        for spec, bid in zip(OBJECTS, self.object_body_ids):
            k = spec["key"]
            sensors += [
                make(f"{k}_pos", lambda c, b=bid: np.array(data.body_xpos[b])),
                make(f"{k}_quat", lambda c, b=bid: np.array(data.body_xquat[b])[[1, 2, 3, 0]]),
                make(f"gripper_to_{k}_pos",
                     lambda c, b=bid: np.array(data.body_xpos[b] - data.site_xpos[self.eef_site_id])),
            ]
        for rec, bid in zip(RECEPTACLES, self.receptacle_body_ids):
            sensors.append(make(f"{rec}_pos", lambda c, b=bid: np.array(data.body_xpos[b])))
        for s in sensors:
            observables[s.__name__] = Observable(name=s.__name__, sensor=s, sampling_rate=self.control_freq)
        return observables

    # ----- reset: placement ------------------------------------------------------------------
    def _reset_internal(self) -> None:
        super()._reset_internal()  # robot joints (+ seeded noise)
        perm = self.rng.permutation(len(OBJECTS))  # drawn in both layouts: same stream either way
        jit = self.rng.uniform(-self.jitter, self.jitter, size=(len(SLOTS), 2))
        yaws = self.rng.uniform(-self.yaw_range, self.yaw_range, size=len(SLOTS))
        self.episode_layout = self.layout
        # layout_rho < 1: one more draw, last, so the draws above stay those of the seed
        if self.layout == "correlated" and self.layout_rho < 1 and not self.rng.uniform() < self.layout_rho:
            self.episode_layout = "random"
        if self.episode_layout == "correlated":
            perm = np.array(CORRELATED[int(self.commanded_task)])
        self.slot_of_object = np.empty(len(OBJECTS), dtype=int)
        for slot, o in enumerate(perm):
            self.slot_of_object[o] = slot
            obj, spec = self.objects[o], OBJECTS[o]
            xy = SLOTS[slot] + jit[slot]
            z = TABLE_TOP + spec["size"][-1] + 1e-3
            quat = np.array([np.cos(yaws[slot] / 2), 0, 0, np.sin(yaws[slot] / 2)])
            self.sim.data.set_joint_qpos(obj.joints[0], np.concatenate([xy, [z], quat]))
        self.sim.data.set_joint_qpos(self.plate.joints[0], np.array(
            [*PLATE["xy"], TABLE_TOP + PLATE["half_height"] + 1e-3, 1, 0, 0, 0]))
        self.sim.data.set_joint_qpos(self.bin.joints[0], np.array(
            [*BIN["xy"], TABLE_TOP + BIN["size"][2] / 2 + 1e-3, 1, 0, 0, 0]))

    # ----- task conditions -------------------------------------------------------------------
    def object_half_extent(self, o: int) -> float:
        return float(max(OBJECTS[o]["size"]))

    def placed(self, o: int, r: int) -> bool:
        """Object ``o`` rests in/on receptacle ``r`` (inside its rim, at its floor, not falling)
        and the gripper has let go of it."""
        p = self.sim.data.body_xpos[self.object_body_ids[o]]
        c = self.sim.data.body_xpos[self.receptacle_body_ids[r]]
        h = self.object_half_extent(o)
        if RECEPTACLES[r] == "plate":
            top = c[2] + PLATE["half_height"]
            inside = np.hypot(*(p[:2] - c[:2])) < PLATE["radius"] - 0.01
        else:
            top = c[2] - BIN["size"][2] / 2 + BIN["wall"]  # bin floor
            inner = BIN["size"][0] / 2 - BIN["wall"]
            inside = bool(np.all(np.abs(p[:2] - c[:2]) < inner - 0.005))
        resting = top < p[2] < top + h + 0.02
        still = np.linalg.norm(self.sim.data.get_joint_qvel(self.objects[o].joints[0])[:3]) < 0.2  # not mid-fall
        return bool(inside and resting and still
                    and not self._check_grasp(self.robots[0].gripper, self.objects[o]))

    def completed_tasks(self) -> list[int]:
        return [t.task_id for t in TASKS if self.placed(t.args["object_index"], t.args["receptacle_index"])]

    def _check_success(self) -> bool:
        t = TASKS[int(self.commanded_task)]
        return self.placed(t.args["object_index"], t.args["receptacle_index"])

    def reward(self, action=None) -> float:
        return float(self._check_success())


class KitchenSuiteEnv(RobosuiteEnv):
    """Groundflow env over :class:`GroundflowKitchen` with instructions, tasks and an expert."""

    def __init__(self, rs_env: GroundflowKitchen, env_id: str, suite: Suite, default_task: int,
                 cameras: tuple[str, ...], image_size: int, max_episode_steps: int):
        self.suite = suite
        super().__init__(rs_env, env_id, suite.tasks[default_task].instruction, cameras, image_size,
                         max_episode_steps)
        self.task_id = default_task
        self.layout = rs_env.layout

    @property
    def instructions(self) -> list[str]:
        return self.suite.instructions

    def _before_reset(self, options: dict) -> None:
        """Pick the commanded task: ``instruction`` (canonical or paraphrase) or ``task_id``.

        Without either, the current commanded task is kept (initially the ``instruction``
        given to the factory, else task 0).
        """
        bad = sorted(set(options) - {"instruction", "task_id"})
        if bad:
            raise InvalidOptionError(f"{self.env_id}: unknown reset option(s) {bad}; valid: ['instruction', 'task_id']")
        if "instruction" in options and "task_id" in options:
            raise InvalidOptionError(f"{self.env_id}: give either 'instruction' or 'task_id', not both")
        if "instruction" in options:
            text = options["instruction"]
            self.task_id = self.suite.task(text).task_id
            self.instruction = text.strip()
        elif "task_id" in options:
            tid = options["task_id"]
            if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)):
                raise InstructionError(f"{self.env_id}: task_id must be an int in 0..{len(self.suite.tasks) - 1}, got {tid!r}")
            self.task_id = self.suite.task(int(tid)).task_id
            self.instruction = self.suite.tasks[self.task_id].instruction
        self.rs.commanded_task = self.task_id

    def _success(self) -> bool:
        return bool(self.rs._check_success())

    def _extra_info(self) -> dict:
        mask = np.zeros(len(TASKS), dtype=bool)
        mask[self.rs.completed_tasks()] = True
        grasped = np.array([self.rs._check_grasp(self.rs.robots[0].gripper, obj) for obj in self.rs.objects])
        d = self.rs.sim.data
        eef = np.array(d.site_xpos[self.rs.eef_site_id])
        dist = np.array([np.linalg.norm(eef - d.body_xpos[b]) for b in self.rs.object_body_ids])
        return {"completed_tasks": mask, "task_id": self.task_id, "grasped": grasped, "eef_distance": dist}

    @property
    def task(self) -> Task:
        return self.suite.tasks[self.task_id]

    @property
    def episode_layout(self) -> str:
        """The layout the current episode got ("random" or "correlated"; see ``layout_rho``)."""
        return self.rs.episode_layout

    def make_expert(self, noise: float = 0.0, task_id: int | None = None, seed: int | None = None):
        return PickPlaceExpert(noise=noise, task_id=task_id, seed=seed)


_OPTIONS = ("controller", "jitter", "initialization_noise", "control_freq")


def make_kitchen_suite(env_id: str = "robosuite/KitchenSuite", layout: str = "random",
                       instruction: str | None = None, cameras: Any = (), image_size: int = 128,
                       max_episode_steps: int = 250, layout_rho: float = 1.0, **options: Any) -> KitchenSuiteEnv:
    """Make the kitchen suite env; ``instruction`` sets the task commanded when reset has none.

    ``layout_rho`` (with ``layout="correlated"``): probability that an episode's layout names its
    task; the other episodes get the seed's random layout.

    Extra options: ``jitter`` (+- metres of seeded position noise per slot, default 0.015),
    ``initialization_noise`` (robosuite's robot joint noise; default gaussian 0.02 rad),
    ``control_freq`` (Hz, default 20).
    """
    bad = sorted(set(options) - set(_OPTIONS))
    if bad:
        valid = ["layout", "layout_rho", "instruction", "cameras", "image_size", "max_episode_steps", *_OPTIONS]
        raise InvalidOptionError(f"{env_id}: unknown option(s) {bad}; valid options: {valid}")
    if layout not in LAYOUTS:
        raise InvalidOptionError(f"unknown layout {layout!r}; valid layouts: {list(LAYOUTS)}")
    layout_rho = check_layout_rho(layout_rho, layout)
    controller = options.get("controller", "OSC_POSE")
    if controller != "OSC_POSE":
        raise InvalidOptionError(f"the kitchen suite uses controller 'OSC_POSE' (its expert rotates the "
                                 f"gripper to the object's yaw); got {controller!r}. Valid: ['OSC_POSE']"
                                 if controller in CONTROLLERS else
                                 f"unknown controller {controller!r}; valid controllers: ['OSC_POSE']")
    jitter = options.get("jitter", 0.015)
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter <= 0.03:
        raise InvalidOptionError(f"jitter is the +- position noise per slot in metres, in [0, 0.03]; got {jitter!r}")
    image_size = check_positive_int("image_size", image_size)
    max_episode_steps = check_positive_int("max_episode_steps", max_episode_steps)
    suite = Suite(name="kitchen", env_id=env_id, tasks=TASKS)
    default_task = 0 if instruction is None else suite.task(instruction).task_id
    cams = (cameras,) if isinstance(cameras, str) else tuple(cameras or ())
    kwargs = {k: options[k] for k in ("jitter", "initialization_noise", "control_freq") if k in options}
    rs_env = make_robosuite_env(GroundflowKitchen, controller="OSC_POSE", cameras=cams, layout=layout,
                                layout_rho=float(layout_rho), **kwargs)
    try:
        cams = check_cameras(cams, [rs_env.sim.model.camera_id2name(i) for i in range(rs_env.sim.model.ncam)])
    except InvalidOptionError:
        rs_env.close()
        raise
    env = KitchenSuiteEnv(rs_env, env_id, suite, default_task, cams, image_size, max_episode_steps)
    if instruction is not None:
        env.instruction = instruction.strip()
    return env


# ----- privileged scripted expert ------------------------------------------------------------------


class PickPlaceExpert:
    """State machine on true poses: approach, descend, grasp, lift, carry, lower, release, retreat.

    Commands OSC_POSE deltas: a P-controller on the end-effector position, and a rotation that
    keeps the gripper pointing down with its fingers square to the object's faces. A missed or
    dropped grasp sends it back to ``approach``. ``task_id`` (default: the env's commanded task at
    ``reset``) lets it act under another instruction (counterfactual relabeling); ``reset`` also
    works mid-episode, inferring the phase from the state.
    """

    HOVER, CARRY_Z = 0.10, TABLE_TOP + 0.17
    POS_SCALE, ROT_SCALE = 0.05, 0.5  # metres / radians per unit action (OSC_POSE defaults)

    def __init__(self, noise: float = 0.0, task_id: int | None = None, seed: int | None = None,
                 gain: float = 1.5):
        if noise < 0:
            raise InvalidOptionError(f"expert noise must be >= 0, got {noise}")
        self.noise = float(noise)
        self.fixed_task = task_id
        self.gain = gain
        self.rng = np.random.default_rng(seed)
        self.env: KitchenSuiteEnv | None = None

    # ----- privileged reads --------------------------------------------------------------------
    def _eef(self) -> tuple[np.ndarray, np.ndarray]:
        d = self.rs.sim.data
        return np.array(d.site_xpos[self.rs.eef_site_id]), np.array(d.site_xmat[self.rs.eef_site_id]).reshape(3, 3)

    def _obj(self) -> tuple[np.ndarray, float]:
        d, b = self.rs.sim.data, self.rs.object_body_ids[self.o]
        return np.array(d.body_xpos[b]), _yaw(np.array(d.body_xquat[b]))

    def _grasped(self) -> bool:
        return bool(self.rs._check_grasp(self.rs.robots[0].gripper, self.rs.objects[self.o]))

    # ----- protocol ----------------------------------------------------------------------------
    def reset(self, env: Any, obs: dict) -> None:
        self.env = env.unwrapped if hasattr(env, "unwrapped") else env
        self.rs = self.env.rs
        tid = self.env.task_id if self.fixed_task is None else int(self.fixed_task)
        task = self.env.suite.task(tid)
        self.task_id, self.o, self.r = tid, task.args["object_index"], task.args["receptacle_index"]
        self.h = self.rs.object_half_extent(self.o)
        self.box = OBJECTS[self.o]["shape"] == "box"
        self.locked_phi: float | None = None
        self.grasp_offset = np.zeros(3)
        self._set("approach")
        if self.rs.placed(self.o, self.r):
            self._set("retreat")
        elif self._grasped():
            self.grasp_offset = self._eef()[0] - self._obj()[0]
            self._set("lift")

    def _set(self, phase: str) -> None:
        self.phase, self.t = phase, 0

    def _target_rotation(self, R: np.ndarray, obj_yaw: float) -> np.ndarray:
        """Gripper pointing down, fingers closing along the table's depth (x, across the row of
        objects, so open fingers never touch a neighbour or a receptacle), square to a cube's faces."""
        f = R[:, 0]  # the Panda's finger axis is the eef x axis
        phi = float(np.arctan2(f[1], f[0]))
        if self.locked_phi is not None:
            target = self.locked_phi
        else:
            line = 0.0
            if self.box:  # face direction of the cube closest to the x axis
                line = obj_yaw - (np.pi / 2) * np.round(obj_yaw / (np.pi / 2))
            # the finger axis is a line: take the direction (line or line + pi) nearest the current one
            target = line + np.pi * np.round((phi - line) / np.pi)
        x = np.array([np.cos(target), np.sin(target), 0.0])
        z = np.array([0.0, 0.0, -1.0])
        return np.stack([x, np.cross(z, x), z], axis=1)

    def _receptacle_floor(self) -> float:
        c = self.rs.sim.data.body_xpos[self.rs.receptacle_body_ids[self.r]]
        if RECEPTACLES[self.r] == "plate":
            return float(c[2] + PLATE["half_height"])
        return float(c[2] - BIN["size"][2] / 2 + BIN["wall"])

    def act(self, obs: dict) -> np.ndarray:
        if self.env is None:
            raise RuntimeError("call expert.reset(env, obs) before act(obs)")
        eef, R = self._eef()
        obj, obj_yaw = self._obj()
        rec = np.array(self.rs.sim.data.body_xpos[self.rs.receptacle_body_ids[self.r]])
        grip = -1.0
        target = eef.copy()
        self.t += 1
        p = self.phase
        if p == "approach":
            target = obj + [0, 0, self.HOVER]
            target[2] = max(target[2], eef[2] - 0.05) if np.linalg.norm(eef[:2] - obj[:2]) > 0.05 else target[2]
            rot_err = np.linalg.norm(rotvec(self._target_rotation(R, obj_yaw) @ R.T))
            if (np.linalg.norm(target[:2] - eef[:2]) < 0.01 and abs(target[2] - eef[2]) < 0.03
                    and rot_err < 0.08) or self.t > 80:
                self._set("descend")
        elif p == "descend":
            target = obj + [0, 0, 0.005 if self.box else 0.0]
            if np.all(np.abs(target - eef) < [0.008, 0.008, 0.01]) or self.t > 50:
                self.locked_phi = float(np.arctan2(R[1, 0], R[0, 0]))
                self._set("grasp")
        elif p == "grasp":
            target, grip = obj + [0, 0, 0.005 if self.box else 0.0], 1.0
            target[:2] = eef[:2]
            if self.t >= 10:
                if self._grasped():
                    self.grasp_offset = eef - obj
                    self._set("lift")
                elif self.t > 20:
                    self._set("regrasp")
        elif p == "regrasp":  # open and rise, then approach again
            target = obj + [0, 0, self.HOVER]
            target[:2] = eef[:2]
            if self.t > 12:
                self.locked_phi = None
                self._set("approach")
        elif p in ("lift", "carry", "lower"):
            grip = 1.0
            if not self._grasped() and self.t > 3:
                self.locked_phi = None
                self._set("regrasp")
            elif p == "lift":
                target = np.array([eef[0], eef[1], self.CARRY_Z])
                if eef[2] > self.CARRY_Z - 0.02:
                    self._set("carry")
            elif p == "carry":
                target = np.array([*(rec[:2] + self.grasp_offset[:2]), self.CARRY_Z])
                if np.linalg.norm(obj[:2] - rec[:2]) < 0.01:
                    self._set("lower")
            else:
                z = self._receptacle_floor() + self.h + 0.015 + self.grasp_offset[2]
                target = np.array([*(rec[:2] + self.grasp_offset[:2]), z])
                if abs(eef[2] - z) < 0.01 or self.t > 40:
                    self._set("release")
        elif p == "release":
            target = eef.copy()
            if self.t >= 8:
                self._set("retreat")
        elif p == "retreat":
            target = np.array([eef[0], eef[1], self.CARRY_Z + 0.05])
        a = np.zeros(7, dtype=np.float32)
        a[:3] = np.clip(self.gain * (target - eef) / self.POS_SCALE, -1, 1)
        a[3:6] = np.clip(rotvec(self._target_rotation(R, obj_yaw) @ R.T) / self.ROT_SCALE, -1, 1)
        a[6] = grip
        if self.noise > 0:
            a[:3] = np.clip(a[:3] + self.rng.normal(0.0, self.noise, 3), -1, 1)
        return a
