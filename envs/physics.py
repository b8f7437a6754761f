"""The physics parameters a shifted twin scales (``envs.shifted``), per simulator.

Each backend's ``GroundflowEnv.make_physics(bodies)`` returns one of these handles (or None when it
has no physics parameters); ``apply(shift)`` sets the parameters to their nominal values times the
shift's scales, so applying the nominal :class:`PhysicsShift` restores the simulator exactly.
This module imports no simulator at load time, so every backend can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

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


class ManiSkillPhysics:
    """Mass/friction of free actors and drive stiffness/damping of the robot joints (SAPIEN)."""

    def __init__(self, env: Any, bodies: tuple[str, ...] | None):
        self.env, self.bodies = env, bodies
        self._nominal: dict[int, Any] = {}

    def _dynamic_bodies(self) -> list[tuple[str, Any]]:
        import sapien  # lazy: this module is imported by the MuJoCo backends too, which must not load SAPIEN
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
        import sapien  # lazy: see _dynamic_bodies
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


class MujocoPhysics:
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
