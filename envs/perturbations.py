"""Robustness perturbations in the spirit of LIBERO-Plus, as gymnasium wrappers around a groundflow env.

    env = perturb(envs.make("maniskill/TabletopSuite-v1"), "layout", magnitude=0.04, seed=0)
    obs, info = env.reset(seed=3, options={"instruction": "pick up the red cube"})
    info["perturbation"]   # what this episode got (JSON-ready)

Each wrapper keeps the observation convention (``state``, ``images`` only with cameras,
``instruction``; ``info["success"]``) and takes a ``magnitude`` in the family's own unit and a
``seed``. What an episode gets is drawn from ``(seed, episode seed)``: the same episode seed gives
the same perturbation, whatever ran before.

====================  =========================================  ==============================
family                per episode                                magnitude (default)
====================  =========================================  ==============================
``paraphrase``        the commanded task, named by one of the    probability of paraphrasing
                      suite's held-out paraphrases               an episode (1.0)
``camera``            every configured camera moved by exactly   translation in metres (0.05);
                      ``magnitude`` in a random direction and    ``rotation_deg`` defaults to
                      turned by ``rotation_deg`` about a random  100 x magnitude (5 degrees)
                      axis through its centre
``lighting``          every light and the ambient term scaled    relative intensity change
                      by one factor in [1/(1+m), 1+m] (at least  (0.5)
                      half that change, brighter or dimmer),
                      times a per-channel tint of up to +-m/2
``sensor_noise``      Gaussian noise on ``state`` (std m) and    state std in state units
                      on images (std ``image_std`` levels)       (0.01); ``image_std`` defaults
                                                                 to 800 x m (8 of 255 levels)
``layout``            objects moved by up to +-m in x and y      metres (0.04)
                      after reset, inside a region of the table
                      that keeps every task feasible, apart
                      from each other
``robot_init``        arm joints (not the fingers) offset by     std in radians (0.1)
                      N(0, m^2) after reset (clipped to +-2.5 m
                      and the joint limits; TCP kept >= 5 cm
                      above the table)
====================  =========================================  ==============================

Where each applies: ``paraphrase`` needs a suite; ``camera`` and ``lighting`` change images only,
so they need cameras (ManiSkill: SAPIEN camera poses and scene lights; robosuite and Adroit: MuJoCo
``cam_pos``/``cam_quat`` and ``light_*``/headlight colours); ``layout`` knows the tabletop and
kitchen suites' scenes; ``robot_init`` works on ManiSkill and robosuite arms. Where a family does
not apply, its wrapper raises :class:`NotApplicableError` with the reason (``not_applicable(env)``
returns it without raising). Camera and light changes live in the simulator's model: ``restore()``
(also called by ``close()``) puts the nominal values back.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, ClassVar

import gymnasium as gym
import numpy as np

from envs.errors import InvalidOptionError


class NotApplicableError(InvalidOptionError):
    """A perturbation family that cannot act on this env (e.g. a camera shift without cameras)."""


# ===================================================================================== #
# Base wrappers
# ===================================================================================== #
class EnvWrapper(gym.Wrapper):
    """A gymnasium wrapper that forwards unknown attributes (``suite``, ``raw``, ``rs``,
    ``env_id``, ``state_dim``, ``max_episode_steps``, ``make_expert`` ...) to the wrapped
    groundflow env, so evaluation code and experts work on it unchanged."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    def observe(self) -> dict:
        """Observation of the current simulator state, through every wrapper below."""
        return self.env.observe()

    def restore(self) -> None:
        """Undo changes made to the simulator's model (wrappers below included)."""
        if isinstance(self.env, EnvWrapper):
            self.env.restore()


def base_env(env: Any) -> Any:
    """The groundflow env under any stack of gymnasium wrappers."""
    while isinstance(env, gym.Wrapper):
        env = env.env
    return env


def _episode_rng(seed: int, episode_seed: int | None, stream: np.random.Generator) -> np.random.Generator:
    if episode_seed is None:
        return np.random.default_rng(stream.integers(2**63))
    return np.random.default_rng([int(seed), int(episode_seed)])


def _check_number(name: str, value: Any, lo: float = 0.0, hi: float = np.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not np.isfinite(value) or not lo <= value <= hi:
        raise InvalidOptionError(f"{name} must be a finite number in [{lo}, {hi}], got {value!r}")
    return float(value)


class Perturbation(EnvWrapper):
    """One perturbation family. Subclasses set ``family``, ``default_magnitude``, ``unit`` and
    override some of ``_before_reset`` (change options or the model before the env resets),
    ``_after_reset`` (change the simulator state after it; return True if the observation must
    be read again) and ``_obs`` (change every observation)."""

    family: ClassVar[str] = ""
    default_magnitude: ClassVar[float] = 0.0
    max_magnitude: ClassVar[float] = np.inf
    unit: ClassVar[str] = ""

    def __init__(self, env: Any, magnitude: float | None = None, seed: int = 0):
        reason = self.not_applicable(env)
        if reason:
            raise NotApplicableError(f"perturbation {self.family!r} does not apply to "
                                     f"{getattr(env, 'env_id', env)!r}: {reason}")
        super().__init__(env)
        m = self.default_magnitude if magnitude is None else magnitude
        self.magnitude = _check_number(f"{self.family} magnitude ({self.unit})", m, 0.0, self.max_magnitude)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise InvalidOptionError(f"perturbation seed must be an int, got {seed!r}")
        self.seed = int(seed)
        self._stream = np.random.default_rng(self.seed)
        self.last: dict[str, Any] = {}

    @classmethod
    def not_applicable(cls, env: Any) -> str | None:
        """Why this family cannot act on ``env`` (None when it can)."""
        return None

    def describe(self) -> dict[str, Any]:
        """The wrapper's parameters (JSON-ready)."""
        return {"family": self.family, "magnitude": self.magnitude, "unit": self.unit, "seed": self.seed}

    # ----- hooks ----------------------------------------------------------------------------
    def _before_reset(self, rng: np.random.Generator, options: dict) -> dict:
        return options

    def _after_reset(self, rng: np.random.Generator) -> bool:
        return False

    def _obs(self, obs: dict) -> dict:
        return obs

    # ----- gymnasium API --------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        rng = _episode_rng(self.seed, seed, self._stream)
        self.last = {}
        options = self._before_reset(rng, dict(options or {}))
        obs, info = self.env.reset(seed=seed, options=options)
        if self._after_reset(rng):
            obs = self.env.observe()
            ok = base_env(self.env).evaluate_success()
            if ok is not None:
                info["success"] = bool(ok)
        info = dict(info)
        info["perturbation"] = {**info.get("perturbation", {}), self.family: dict(self.last)}
        return self._obs(obs), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._obs(obs), reward, terminated, truncated, info

    def observe(self) -> dict:
        return self._obs(self.env.observe())

    def close(self):
        self.restore()
        return self.env.close()


# ===================================================================================== #
# Language: held-out paraphrases
# ===================================================================================== #
class ParaphraseInstruction(Perturbation):
    """Commands the episode's task with one of the suite's held-out paraphrases (never seen in
    training). The task itself does not change: success is still the commanded task."""

    family = "paraphrase"
    default_magnitude = 1.0
    max_magnitude = 1.0
    unit = "probability"

    @classmethod
    def not_applicable(cls, env: Any) -> str | None:
        suite = getattr(env, "suite", None)
        if suite is None:
            return "the env has one instruction and no paraphrases (paraphrases come with multi-instruction suites)"
        if not any(t.paraphrases for t in suite.tasks):
            return f"suite {suite.name!r} lists no paraphrases"
        return None

    def _before_reset(self, rng, options):
        suite = self.env.suite
        if "instruction" in options:
            task = suite.task(options["instruction"])
        elif "task_id" in options:
            task = suite.task(options["task_id"])
        else:  # the env's own default commanded task: let it resolve it, then command it again
            self.env.reset(seed=None, options={k: v for k, v in options.items()})
            task = suite.task(int(base_env(self.env).task_id))
        use = rng.random() < self.magnitude and bool(task.paraphrases)
        text = task.paraphrases[int(rng.integers(len(task.paraphrases)))] if use else task.instruction
        self.last = {"task_id": task.task_id, "instruction": text, "canonical": task.instruction,
                     "paraphrased": bool(use)}
        out = {k: v for k, v in options.items() if k not in ("instruction", "task_id")}
        out["instruction"] = text
        return out


# ===================================================================================== #
# Images: camera pose and lighting (model-level changes, undone by restore())
# ===================================================================================== #
def _quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamilton product of wxyz quaternions."""
    w1, x1, y1, z1 = a
    w2, x2, y2, z2 = b
    return np.array([w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2, w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
                     w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2, w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2])


def _unit(rng: np.random.Generator) -> np.ndarray:
    v = rng.normal(size=3)
    return v / np.linalg.norm(v)


def _images_reason(env: Any, what: str) -> str | None:
    if not getattr(env, "cameras", ()):
        return (f"the env has no cameras configured, and a {what} changes images only "
                "(make the env with cameras=..., e.g. cameras=('base_camera',) on ManiSkill or "
                "('agentview',) on robosuite)")
    backend = getattr(env, "backend", "")
    if backend not in IMAGE_BACKENDS:
        return f"no {what} is implemented for backend {backend!r} (valid backends: {', '.join(IMAGE_BACKENDS)})"
    return None


IMAGE_BACKENDS = ("maniskill", "robosuite", "adroit")


def _mujoco_model(b: Any) -> Any:
    """The MuJoCo model whose cameras and lights render ``b``'s images: robosuite's binding, or
    the raw ``mujoco.MjModel`` of Adroit (the renderer reads it at every frame)."""
    return b.rs.sim.model if b.backend == "robosuite" else b.unwrapped_mujoco.model


def _camera_id(m: Any, cam: str) -> int:
    if hasattr(m, "camera_name2id"):  # robosuite's binding
        return m.camera_name2id(cam)
    import mujoco
    i = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_CAMERA, cam)
    if i < 0:
        raise NotApplicableError(f"camera {cam!r} is not a camera of the MuJoCo model (a free viewpoint "
                                 "cannot be shifted)")
    return i


class CameraShift(Perturbation):
    """Moves every configured camera (relative to its mount) by ``magnitude`` metres in a random
    direction and turns it by ``rotation_deg`` about a random axis through its centre."""

    family = "camera"
    default_magnitude = 0.05
    max_magnitude = 0.5
    unit = "m"

    def __init__(self, env: Any, magnitude: float | None = None, seed: int = 0, rotation_deg: float | None = None,
                 up_to: bool = False, cameras: tuple[str, ...] | None = None):
        super().__init__(env, magnitude, seed)
        rot = 100.0 * self.magnitude if rotation_deg is None else rotation_deg
        self.rotation_deg = _check_number("camera rotation_deg", rot, 0.0, 90.0)
        self.up_to = bool(up_to)
        self._base = base_env(env)
        # ``cameras``: only these (e.g. the fixed ones: a wrist camera is rigid on the hand); None: all
        chosen = tuple(self._base.cameras) if cameras is None else tuple(cameras)
        unknown = [c for c in chosen if c not in self._base.cameras]
        if unknown or not chosen:
            raise InvalidOptionError(f"camera shift: cameras {list(chosen)} must be some of the env's "
                                     f"{list(self._base.cameras)}")
        self._nominal = {c: self._get(c) for c in chosen}

    @classmethod
    def not_applicable(cls, env):
        return _images_reason(env, "camera shift")

    def describe(self):
        return {**super().describe(), "rotation_deg": self.rotation_deg, "up_to": self.up_to,
                "cameras": list(self._nominal)}

    def _get(self, cam: str) -> tuple[np.ndarray, np.ndarray]:
        b = self._base
        if b.backend == "maniskill":
            pose = b.raw._sensors[cam].camera._render_cameras[0].get_local_pose()
            return np.array(pose.p, dtype=np.float64), np.array(pose.q, dtype=np.float64)
        m = _mujoco_model(b)
        i = _camera_id(m, cam)
        return np.array(m.cam_pos[i]), np.array(m.cam_quat[i])

    def _set(self, cam: str, p: np.ndarray, q: np.ndarray) -> None:
        b = self._base
        if b.backend == "maniskill":
            import sapien
            b.raw._sensors[cam].camera.set_local_pose(sapien.Pose(p.astype(np.float32), q.astype(np.float32)))
        else:
            m = _mujoco_model(b)
            i = _camera_id(m, cam)
            m.cam_pos[i], m.cam_quat[i] = p, q

    def _before_reset(self, rng, options):
        # Applied before the reset: camera poses survive it, so the first image is already shifted.
        # up_to (domain randomization): this episode's share of the magnitude, uniform in [0, 1]
        share = rng.uniform() if self.up_to else 1.0
        half = np.deg2rad(self.rotation_deg * share) / 2
        for cam, (p, q) in self._nominal.items():
            offset, axis = self.magnitude * share * _unit(rng), _unit(rng)
            turn = np.r_[np.cos(half), np.sin(half) * axis]
            self._set(cam, p + offset, _quat_mul(turn, q))
            self.last[cam] = {"offset_m": offset.round(6).tolist(), "axis": axis.round(6).tolist(),
                              "rotation_deg": round(self.rotation_deg * share, 6)}
        return options

    def restore(self) -> None:
        for cam, (p, q) in self._nominal.items():
            self._set(cam, p, q)
        super().restore()


class Lighting(Perturbation):
    """Scales every light (and the ambient term) by one intensity factor and a colour tint."""

    family = "lighting"
    default_magnitude = 0.5
    max_magnitude = 4.0
    unit = "relative intensity"

    def __init__(self, env: Any, magnitude: float | None = None, seed: int = 0, up_to: bool = False):
        super().__init__(env, magnitude, seed)
        self.up_to = bool(up_to)
        self._base = base_env(env)
        self._nominal = self._get()

    def describe(self):
        return {**super().describe(), "up_to": self.up_to}

    @classmethod
    def not_applicable(cls, env):
        return _images_reason(env, "lighting change")

    # nominal colours: {key: array}; keys are light components (ManiSkill) or model fields (MuJoCo)
    def _get(self) -> dict[Any, np.ndarray]:
        b = self._base
        if b.backend == "maniskill":
            import sapien
            out: dict[Any, np.ndarray] = {"ambient": np.array(b.raw.scene.ambient_light, dtype=np.float64)}
            for sub in b.raw.scene.sub_scenes:
                for ent in sub.entities:
                    for comp in ent.components:
                        if isinstance(comp, sapien.render.RenderLightComponent):
                            out[comp] = np.array(comp.color, dtype=np.float64)
            return out
        m = _mujoco_model(b)
        return {"light_diffuse": np.array(m.light_diffuse), "light_ambient": np.array(m.light_ambient),
                "light_specular": np.array(m.light_specular), "head_diffuse": np.array(m.vis.headlight.diffuse),
                "head_ambient": np.array(m.vis.headlight.ambient),
                "head_specular": np.array(m.vis.headlight.specular)}

    def _set(self, colours: dict[Any, np.ndarray]) -> None:
        b = self._base
        if b.backend == "maniskill":
            for key, c in colours.items():
                if key == "ambient":
                    b.raw.scene.ambient_light = c.tolist()
                else:
                    key.color = c.tolist()
            return
        m = _mujoco_model(b)
        fields = {"light_diffuse": m.light_diffuse, "light_ambient": m.light_ambient,
                  "light_specular": m.light_specular, "head_diffuse": m.vis.headlight.diffuse,
                  "head_ambient": m.vis.headlight.ambient, "head_specular": m.vis.headlight.specular}
        for key, c in colours.items():
            fields[key][...] = c

    def _before_reset(self, rng, options):
        m = self.magnitude * (rng.uniform() if self.up_to else 1.0)  # up_to: domain randomization
        sign = 1.0 if rng.random() < 0.5 else -1.0
        factor = float((1 + m) ** (sign * rng.uniform(0.5, 1.0)))
        tint = 1 + rng.uniform(-m / 2, m / 2, size=3)
        gain = np.clip(factor * tint, 0.0, None)
        self._set({k: np.clip(v * gain, 0.0, None) for k, v in self._nominal.items()})
        self.last = {"intensity": round(factor, 6), "tint_rgb": tint.round(6).tolist()}
        return options

    def restore(self) -> None:
        self._set(self._nominal)
        super().restore()


# ===================================================================================== #
# Sensors
# ===================================================================================== #
class SensorNoise(Perturbation):
    """Gaussian noise on ``obs["state"]`` (std ``magnitude``) and on every image (std
    ``image_std`` intensity levels, rounded and clipped to uint8); the simulator stays exact."""

    family = "sensor_noise"
    default_magnitude = 0.01
    unit = "state std"

    def __init__(self, env: Any, magnitude: float | None = None, seed: int = 0, image_std: float | None = None):
        super().__init__(env, magnitude, seed)
        std = 800.0 * self.magnitude if image_std is None else image_std
        self.image_std = _check_number("sensor_noise image_std (intensity levels)", std, 0.0, 255.0)
        self._noise = np.random.default_rng(self.seed)

    def describe(self):
        return {**super().describe(), "image_std": self.image_std}

    def _before_reset(self, rng, options):
        self._noise = np.random.default_rng(rng.integers(2**63))
        self.last = {"state_std": self.magnitude, "image_std": self.image_std if self.env.cameras else None}
        return options

    def _obs(self, obs):
        obs = dict(obs)
        if self.magnitude > 0:
            s = obs["state"]
            obs["state"] = (s + self._noise.normal(0.0, self.magnitude, s.shape)).astype(np.float32)
        if self.image_std > 0 and obs.get("images"):
            obs["images"] = {c: np.clip(np.rint(img + self._noise.normal(0.0, self.image_std, img.shape)),
                                        0, 255).astype(np.uint8) for c, img in obs["images"].items()}
        return obs


# ===================================================================================== #
# Scene: object layout and robot initial pose (simulator state changed after reset)
# ===================================================================================== #
# Per scene: the xy box objects may occupy (every task stays feasible: clear of the goal discs,
# plate and bin, within reach) and the clearance two objects keep: they conflict when closer than
# ``sep`` in x AND in y. The kitchen expert closes its fingers along x, so objects there keep
# 14 cm apart in x unless they are 6.5 cm apart in y (the scene's row structure).
LAYOUT_SPECS: dict[str, dict[str, Any]] = {
    "GroundflowTabletopEnv": {"lo": (-0.16, -0.09), "hi": (0.16, 0.09), "sep": (0.07, 0.07)},
    "GroundflowKitchen": {"lo": (-0.12, -0.11), "hi": (0.12, 0.11), "sep": (0.14, 0.065)},
}


def _scene(env: Any) -> tuple[str, Any]:
    b = base_env(env)
    sim = getattr(b, "raw", None) if getattr(b, "backend", "") == "maniskill" else getattr(b, "rs", None)
    return type(sim).__name__, sim


class ObjectLayout(Perturbation):
    """Moves the scene's objects by up to ``magnitude`` metres in x and y after reset
    (rejection-sampled inside the scene's feasible region and apart from each other; if no
    draw fits, the offsets are halved and drawn again). Height and orientation are kept."""

    family = "layout"
    default_magnitude = 0.04
    max_magnitude = 0.3
    unit = "m"
    tries = 64

    def __init__(self, env: Any, magnitude: float | None = None, seed: int = 0):
        super().__init__(env, magnitude, seed)
        name, self._sim = _scene(env)
        self._spec = LAYOUT_SPECS[name]

    @classmethod
    def not_applicable(cls, env):
        name, sim = _scene(env)
        if sim is None or name not in LAYOUT_SPECS:
            return (f"no layout region is defined for scene {name!r} (objects, feasible region); "
                    f"scenes with one: {sorted(LAYOUT_SPECS)}")
        return None

    def _positions(self) -> np.ndarray:
        if base_env(self.env).backend == "maniskill":
            return self._sim.cube_positions()
        d = self._sim.sim.data
        return np.stack([np.array(d.body_xpos[b]) for b in self._sim.object_body_ids])

    def _place(self, xy: np.ndarray) -> None:
        if base_env(self.env).backend == "maniskill":
            from mani_skill.utils.structs import Pose
            for actor, p in zip(self._sim.cubes, xy):
                pose = actor._objs[0].pose
                actor.set_pose(Pose.create_from_pq(p=[float(p[0]), float(p[1]), float(pose.p[2])], q=list(pose.q)))
            return
        rs = self._sim
        for obj, p in zip(rs.objects, xy):
            q = np.array(rs.sim.data.get_joint_qpos(obj.joints[0]))
            q[:2] = p
            rs.sim.data.set_joint_qpos(obj.joints[0], q)
            rs.sim.data.set_joint_qvel(obj.joints[0], np.zeros(6))
        rs.sim.forward()

    def _fits(self, xy: np.ndarray) -> bool:
        lo, hi, sep = (np.asarray(self._spec[k]) for k in ("lo", "hi", "sep"))
        if np.any(xy < lo) or np.any(xy > hi):
            return False
        d = np.abs(xy[:, None] - xy[None])
        clash = np.all(d < sep, axis=-1)
        np.fill_diagonal(clash, False)
        return not clash.any()

    def _after_reset(self, rng):
        start = self._positions()[:, :2]
        m = self.magnitude
        while m > 1e-3:
            for _ in range(self.tries):
                xy = start + rng.uniform(-m, m, size=start.shape)
                if self._fits(xy):
                    self._place(xy)
                    self.last = {"offsets_m": (xy - start).round(6).tolist(), "magnitude_used": m}
                    return True
            m /= 2
        self.last = {"offsets_m": np.zeros_like(start).tolist(), "magnitude_used": 0.0}
        return False


class RobotInitPose(Perturbation):
    """Offsets the arm joints by N(0, magnitude^2) radians after reset (clipped to 2.5 std and to
    the joint limits; a draw that puts the TCP within 5 cm of the table is drawn again)."""

    family = "robot_init"
    default_magnitude = 0.1
    max_magnitude = 1.0
    unit = "rad"
    tries = 20
    min_height = 0.05

    @classmethod
    def not_applicable(cls, env):
        b = base_env(env)
        backend = getattr(b, "backend", "")
        if backend == "maniskill" and hasattr(getattr(getattr(b, "raw", None), "agent", None), "tcp"):
            return None
        if backend == "robosuite" and getattr(b, "rs", None) is not None:
            return None
        return (f"joint offsets are implemented for ManiSkill and robosuite arms; got backend {backend!r} "
                "(valid backends: maniskill, robosuite)")

    # ----- backend access: (arm qpos, limits), set, TCP height above the table --------------
    def _get(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = base_env(self.env)
        if b.backend == "maniskill":
            robot = b.raw.agent.robot
            q = robot.get_qpos()[0].cpu().numpy().astype(np.float64)
            lim = robot.get_qlimits()[0].cpu().numpy()
            return q, lim[:, 0], lim[:, 1]
        rs = b.rs
        robot = rs.robots[0]
        ids = robot._ref_joint_pos_indexes
        m = rs.sim.model
        jids = [m.joint_name2id(j) for j in robot.robot_joints]
        lim = np.array(m.jnt_range)[jids]
        limited = np.array(m.jnt_limited)[jids].astype(bool)
        lo = np.where(limited, lim[:, 0], -np.inf)
        hi = np.where(limited, lim[:, 1], np.inf)
        return np.array(rs.sim.data.qpos[ids]), lo, hi

    def _n_arm(self) -> int:
        b = base_env(self.env)
        if b.backend == "maniskill":
            return len(b.raw.agent.arm_joint_names) if hasattr(b.raw.agent, "arm_joint_names") else 7
        return len(b.rs.robots[0]._ref_joint_pos_indexes)

    def _set(self, q: np.ndarray) -> None:
        b = base_env(self.env)
        if b.backend == "maniskill":
            import torch
            agent = b.raw.agent
            agent.reset(torch.as_tensor(q, dtype=torch.float32)[None])
            agent.controller.reset()
            return
        rs = b.rs
        robot = rs.robots[0]
        rs.sim.data.qpos[robot._ref_joint_pos_indexes] = q
        rs.sim.data.qvel[robot._ref_joint_vel_indexes] = 0.0
        rs.sim.forward()
        robot.composite_controller.update_state()
        robot.composite_controller.reset()

    def _tcp_height(self) -> float:
        b = base_env(self.env)
        if b.backend == "maniskill":
            return float(b.raw.agent.tcp._objs[0].pose.p[2])  # table surface at z = 0
        rs = b.rs
        site = rs.robots[0].eef_site_id["right"]
        table = float(getattr(rs, "table_offset", np.zeros(3))[2])
        return float(rs.sim.data.site_xpos[site][2]) - table

    def _after_reset(self, rng):
        q0, lo, hi = self._get()
        n = self._n_arm()
        for _ in range(self.tries):
            noise = np.clip(rng.normal(0.0, self.magnitude, n), -2.5 * self.magnitude, 2.5 * self.magnitude)
            q = q0.copy()
            q[:n] = np.clip(q0[:n] + noise, lo[:n], hi[:n])
            self._set(q)
            if self._tcp_height() >= self.min_height:
                self.last = {"joint_offsets_rad": (q[:n] - q0[:n]).round(6).tolist()}
                return True
        self._set(q0)
        self.last = {"joint_offsets_rad": [0.0] * n}
        return True


# ===================================================================================== #
# Registry
# ===================================================================================== #
PERTURBATIONS: dict[str, Callable[..., Perturbation]] = {
    cls.family: cls for cls in (ParaphraseInstruction, CameraShift, Lighting, SensorNoise, ObjectLayout,
                                RobotInitPose)}
FAMILIES: tuple[str, ...] = tuple(PERTURBATIONS)


def check_family(family: str) -> type[Perturbation]:
    if family not in PERTURBATIONS:
        raise InvalidOptionError(f"unknown perturbation family {family!r}; valid families: {list(PERTURBATIONS)}")
    return PERTURBATIONS[family]


def not_applicable(env: Any, family: str) -> str | None:
    """Why ``family`` cannot act on ``env`` (None when it can)."""
    return check_family(family).not_applicable(env)


def perturb(env: Any, family: str, **kw: Any) -> Perturbation:
    """Wrap ``env`` in the ``family`` perturbation (``magnitude``, ``seed`` and family options)."""
    cls = check_family(family)
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "env")]
    bad = sorted(set(kw) - set(params))
    if bad:
        raise InvalidOptionError(f"perturbation {family!r}: unknown option(s) {bad}; valid options: {params}")
    return cls(env, **kw)
