"""Shifted-physics twins of the simulators: a stand-in "real robot" for tests and benchmarks.

    real = make_shifted("maniskill/PushCube-v1", mass_scale=1.3, friction_scale=0.7,
                        action_delay=1, obs_noise=0.002, seed=0, control_mode="pd_ee_delta_pos")

The twin keeps the nominal simulator's observation and simulator-state layout (so a trajectory
recorded on it can be replayed and patched in the nominal simulator), and changes:

- ``mass_scale``: mass and inertia of the free objects (ManiSkill: every non-kinematic actor
  outside the robot; MuJoCo: the bodies named in ``bodies``, default every body but the world).
- ``friction_scale``: sliding friction (ManiSkill: the objects' collision materials, copied so
  the scene's shared material is untouched; MuJoCo: ``geom_friction[:, 0]`` of all geoms).
- ``damping_scale``: joint damping (ManiSkill: the robot's joint drive damping; MuJoCo:
  ``dof_damping``).
- ``gain_scale``: actuator gain (ManiSkill: joint drive stiffness; MuJoCo: ``actuator_gainprm[:, 0]``
  and, for servos, ``actuator_biasprm[:, 1:3]``, so a position servo keeps its set point and
  only its stiffness changes).
- ``action_delay``: the command issued at step t takes effect at step t + d (before the first
  command arrives, the first command is held).
- ``obs_noise``: Gaussian noise (std, in state units) on ``obs["state"]``; the simulator state
  stays exact.

``set_shift(...)`` changes the physics parameters mid-episode (used for injected mass or
friction jumps). Same seed -> same episode, noise included.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from envs.base import GroundflowEnv
from envs.errors import InvalidOptionError

PHYSICS_FIELDS = ("mass_scale", "friction_scale", "damping_scale", "gain_scale")


@dataclass(frozen=True)
class PhysicsShift:
    mass_scale: float = 1.0
    friction_scale: float = 1.0
    damping_scale: float = 1.0
    gain_scale: float = 1.0
    action_delay: int = 0
    obs_noise: float = 0.0

    def validate(self) -> "PhysicsShift":
        for name in PHYSICS_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not np.isfinite(v) or v <= 0:
                raise InvalidOptionError(f"{name} must be a finite number > 0, got {v!r}")
        if isinstance(self.action_delay, bool) or not isinstance(self.action_delay, (int, np.integer)) \
                or self.action_delay < 0:
            raise InvalidOptionError(f"action_delay must be an int >= 0 (steps), got {self.action_delay!r}")
        if not isinstance(self.obs_noise, (int, float)) or not np.isfinite(self.obs_noise) or self.obs_noise < 0:
            raise InvalidOptionError(f"obs_noise must be a finite number >= 0, got {self.obs_noise!r}")
        return self

    @property
    def changes_physics(self) -> bool:
        return any(getattr(self, n) != 1.0 for n in PHYSICS_FIELDS)


class _ManiSkillPhysics:
    """Mass/friction of free actors and drive stiffness/damping of the robot joints (SAPIEN)."""

    def __init__(self, env: Any, bodies: tuple[str, ...] | None):
        self.env, self.bodies = env, bodies
        self._nominal: dict[int, Any] = {}

    def _dynamic_bodies(self) -> list[tuple[str, Any]]:
        import sapien
        out = []
        for name, actor in self.env.raw.scene.actors.items():
            if self.bodies is not None and name not in self.bodies:
                continue
            for ent in actor._objs:
                body = ent.find_component_by_type(sapien.physx.PhysxRigidDynamicComponent)
                if body is not None and not body.kinematic:
                    out.append((name, body))
        return out

    def _joints(self) -> list[Any]:
        joints = []
        for ctrl in self.env.raw.agent.controller.controllers.values():
            for j in ctrl.joints:
                joints.extend(j._objs)
        return joints

    def apply(self, s: PhysicsShift) -> None:
        import sapien
        for _, body in self._dynamic_bodies():
            nom = self._nominal.setdefault(id(body), {
                "mass": body.mass, "inertia": np.array(body.inertia),
                "materials": [(sh.physical_material.static_friction, sh.physical_material.dynamic_friction,
                               sh.physical_material.restitution) for sh in body.collision_shapes]})
            body.mass = nom["mass"] * s.mass_scale
            body.inertia = nom["inertia"] * s.mass_scale
            for sh, (st, dy, re) in zip(body.collision_shapes, nom["materials"]):
                sh.physical_material = sapien.physx.PhysxMaterial(st * s.friction_scale, dy * s.friction_scale, re)
        for j in self._joints():
            nom = self._nominal.setdefault(id(j), (j.stiffness, j.damping, j.force_limit, j.drive_mode))
            j.set_drive_properties(nom[0] * s.gain_scale, nom[1] * s.damping_scale, nom[2], nom[3])


class _MujocoPhysics:
    """body_mass/inertia, geom_friction, dof_damping and actuator gains of a MuJoCo model."""

    def __init__(self, model: Any, bodies: tuple[str, ...] | None):
        self.m = model
        names = [model.body(i).name for i in range(model.nbody)]
        if bodies is None:
            self.body_ids = np.arange(1, model.nbody)
        else:
            bad = [b for b in bodies if b not in names]
            if bad:
                raise InvalidOptionError(f"unknown bodies {bad}; valid bodies: {names}")
            self.body_ids = np.array([names.index(b) for b in bodies])
        self.nom = {"body_mass": model.body_mass.copy(), "body_inertia": model.body_inertia.copy(),
                    "geom_friction": model.geom_friction.copy(), "dof_damping": model.dof_damping.copy(),
                    "actuator_gainprm": model.actuator_gainprm.copy(),
                    "actuator_biasprm": model.actuator_biasprm.copy()}

    def apply(self, s: PhysicsShift) -> None:
        m, n, b = self.m, self.nom, self.body_ids
        m.body_mass[:] = n["body_mass"]
        m.body_inertia[:] = n["body_inertia"]
        m.body_mass[b] = n["body_mass"][b] * s.mass_scale
        m.body_inertia[b] = n["body_inertia"][b] * s.mass_scale
        m.geom_friction[:, 0] = n["geom_friction"][:, 0] * s.friction_scale
        m.dof_damping[:] = n["dof_damping"] * s.damping_scale
        m.actuator_gainprm[:, 0] = n["actuator_gainprm"][:, 0] * s.gain_scale
        m.actuator_biasprm[:] = n["actuator_biasprm"]
        servo = m.actuator_biastype != 0
        m.actuator_biasprm[servo, 1:3] = n["actuator_biasprm"][servo, 1:3] * s.gain_scale


def _physics_of(env: GroundflowEnv, bodies: tuple[str, ...] | None) -> Any:
    if env.backend == "maniskill":
        return _ManiSkillPhysics(env, bodies)
    if env.backend == "adroit":
        return _MujocoPhysics(env.unwrapped_mujoco.model, bodies)
    if env.backend == "robosuite":
        return _MujocoPhysics(env.rs.sim.model._model, bodies)
    return None


class ShiftedEnv(GroundflowEnv):
    """Wraps a groundflow env; same observation and sim-state layout, shifted physics."""

    def __init__(self, base: GroundflowEnv, shift: PhysicsShift = PhysicsShift(), seed: int | None = None,
                 bodies: tuple[str, ...] | None = None):
        self.base = base
        self.shift = shift.validate()
        self.physics = _physics_of(base, tuple(bodies) if bodies is not None else None)
        if self.physics is None and shift.changes_physics:
            raise InvalidOptionError(f"{base.env_id}: backend {base.backend!r} has no physics parameters to shift; "
                                     "only action_delay and obs_noise apply (valid physics backends: "
                                     "maniskill, adroit, robosuite)")
        super().__init__(base.state_dim, base.action_low, base.action_high, cameras=base.cameras,
                         image_size=base.image_size, max_episode_steps=base.max_episode_steps,
                         instruction=base.instruction)
        self.env_id, self.backend = base.env_id, base.backend
        self.seed = 0 if seed is None else int(seed)
        self._queue: deque[np.ndarray] = deque()
        self._rng = np.random.default_rng(self.seed)
        self._current = self.shift
        if self.physics is not None:
            self.physics.apply(self.shift)

    def __getattr__(self, name: str) -> Any:  # raw, rs, unwrapped_mujoco, suite, make_expert ...
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def instructions(self) -> list[str]:
        return self.base.instructions

    def set_shift(self, **changes: Any) -> None:
        """Change physics parameters now (mid-episode); ``restore_shift()`` returns to the twin's own."""
        bad = sorted(set(changes) - set(PHYSICS_FIELDS))
        if bad:
            raise InvalidOptionError(f"set_shift: unknown field(s) {bad}; valid: {list(PHYSICS_FIELDS)}")
        if self.physics is None:
            raise InvalidOptionError(f"{self.env_id}: backend {self.backend!r} has no physics parameters")
        self._current = replace(self._current, **changes).validate()
        self.physics.apply(self._current)

    def restore_shift(self) -> None:
        self._current = self.shift
        if self.physics is not None:
            self.physics.apply(self.shift)

    def _noisy(self, state: np.ndarray) -> np.ndarray:
        if self.shift.obs_noise <= 0:
            return state
        return (state + self._rng.normal(0.0, self.shift.obs_noise, size=state.shape)).astype(np.float32)

    def _reset(self, seed, options):
        obs, info = self.base.reset(seed=seed, options=options)
        self.instruction, self.task_id = self.base.instruction, self.base.task_id
        self._rng = np.random.default_rng([self.seed, 0 if seed is None else int(seed)])
        self._queue.clear()
        self._current = self.shift
        if self.physics is not None:
            self.physics.apply(self.shift)  # a reset may rebuild actors or controllers
        return self._noisy(obs["state"]), obs.get("images", {}), info

    def _step(self, action):
        a = np.asarray(action, np.float32)
        if self.shift.action_delay > 0:
            if not self._queue:
                self._queue.extend([a] * self.shift.action_delay)
            self._queue.append(a)
            a = self._queue.popleft()
        obs, reward, term, trunc, info = self.base.step(a)
        info = dict(info)
        info["applied_action"] = a
        return self._noisy(obs["state"]), obs.get("images", {}), reward, term, trunc, info

    def get_sim_state(self) -> np.ndarray | None:
        return self.base.get_sim_state()

    def set_sim_state(self, state: np.ndarray) -> None:
        self.base.set_sim_state(state)

    def pending_actions(self) -> list[np.ndarray]:
        """Commands issued but not yet applied (the latency buffer; not part of the sim state)."""
        return [a.copy() for a in self._queue]

    def observe(self) -> dict:
        """Observation of the current simulator state, with sensor noise."""
        obs = observe(self.base)
        obs["state"] = self._noisy(obs["state"])
        return obs

    def make_expert(self, **options: Any):
        return self.base.make_expert(**options)

    def close(self) -> None:
        self.base.close()


def observe(env: GroundflowEnv) -> dict:
    """Observation of an env's *current* simulator state (e.g. right after ``set_sim_state``).

    Uses the backend's own method where it has one (Adroit ``observe``, robosuite ``get_obs``);
    ManiSkill's wrapper has none, so its raw env is asked.
    """
    for name in ("observe", "get_obs"):
        fn = getattr(type(env), name, None)
        if fn is not None:
            return fn(env)
    if env.backend == "maniskill":
        o = env.raw.get_obs()
        return env._obs(env._state_of(o), env._images_of(o))
    raise InvalidOptionError(f"{env.env_id}: backend {env.backend!r} cannot observe its current state "
                             "(it needs an observe() method)")


def evaluate_success(env: GroundflowEnv) -> bool | None:
    """Task success in the env's current simulator state; None where the backend cannot tell."""
    inner = env.base if isinstance(env, ShiftedEnv) else env
    fn = getattr(type(inner), "evaluate_success", None)
    if fn is not None:
        return bool(fn(inner))
    if inner.backend == "maniskill":
        return bool(np.asarray(inner.raw.evaluate()["success"]).reshape(-1)[0])
    if inner.backend == "robosuite":
        return bool(inner.rs._check_success())
    if inner.backend == "adroit" and inner.task.name == "door":
        u = inner.unwrapped_mujoco
        return bool(u.data.qpos[u.door_hinge_addrs] >= 1.35)
    return None


def shift_env(env: GroundflowEnv, seed: int | None = None, bodies: tuple[str, ...] | None = None,
              **shift: Any) -> ShiftedEnv:
    """Shifted twin of an env you already made."""
    bad = sorted(set(shift) - set(PhysicsShift.__dataclass_fields__))
    if bad:
        raise InvalidOptionError(f"unknown shift option(s) {bad}; valid: {list(PhysicsShift.__dataclass_fields__)}")
    return ShiftedEnv(env, PhysicsShift(**shift), seed=seed, bodies=bodies)


def make_shifted(env_id: str, mass_scale: float = 1.0, friction_scale: float = 1.0, damping_scale: float = 1.0,
                 gain_scale: float = 1.0, action_delay: int = 0, obs_noise: float = 0.0, seed: int | None = None,
                 bodies: tuple[str, ...] | None = None, **env_options: Any) -> ShiftedEnv:
    """``envs.make(env_id, **env_options)`` with shifted physics (see the module docstring)."""
    import envs
    base = envs.make(env_id, **env_options)
    try:
        return ShiftedEnv(base, PhysicsShift(mass_scale, friction_scale, damping_scale, gain_scale, action_delay,
                                             obs_noise), seed=seed, bodies=bodies)
    except Exception:
        base.close()
        raise
