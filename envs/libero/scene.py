"""What the scripted LIBERO-Goal skills share: privileged reads of the simulator (:class:`Scene`),
the OSC_POSE command toward a pose, the skill protocol, and :class:`Release` (back to the start pose).

The skills live in ``envs.libero.pick`` (pick-and-place) and ``envs.libero.fixtures`` (drawers,
the stove knob, sliding the plate); ``envs.libero.experts`` runs them in order per task.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from envs.geometry import rotvec

POS_SCALE, ROT_SCALE = 0.05, 0.5  # metres / radians per unit OSC_POSE action (robosuite defaults)
OBJECTS = ("akita_black_bowl_1", "cream_cheese_1", "wine_bottle_1", "plate_1")


def top_down(yaw: float) -> np.ndarray:
    """Gripper pointing down (eef z = world -z) with its finger axis (eef x) at ``yaw``."""
    x = np.array([np.cos(yaw), np.sin(yaw), 0.0])
    z = np.array([0.0, 0.0, -1.0])
    return np.stack([x, np.cross(z, x), z], axis=1)


class Scene:
    """Privileged reads of a LIBERO env's simulator and the OSC_POSE command that goes to a pose."""

    def __init__(self, env: Any):
        self.env = env
        self.rs = env.rs
        self.m, self.d = self.rs.sim.model, self.rs.sim.data
        self.eef_site = self.rs.robots[0].eef_site_id["right"]
        self.gripper = self.rs.robots[0].gripper["right"]

    def eef(self) -> tuple[np.ndarray, np.ndarray]:
        return (np.array(self.d.site_xpos[self.eef_site]),
                np.array(self.d.site_xmat[self.eef_site]).reshape(3, 3))

    def body(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """World position and rotation matrix of body ``name``."""
        i = self.m.body_name2id(name)
        return np.array(self.d.body_xpos[i]), np.array(self.d.body_xmat[i]).reshape(3, 3)

    def obj(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Pose of a LIBERO object or fixture by its bddl name (e.g. ``akita_black_bowl_1``)."""
        o = self.rs.objects_dict.get(name) or self.rs.fixtures_dict[name]
        return self.body(o.root_body)

    def site(self, name: str) -> np.ndarray:
        return np.array(self.d.site_xpos[self.m.site_name2id(name)])

    def qpos(self, joint: str) -> float:
        return float(self.d.qpos[self.m.jnt_qposadr[self.m.joint_name2id(joint)]])

    def grasped(self, name: str) -> bool:
        return bool(self.rs._check_grasp(self.gripper, self.rs.objects_dict[name]))

    def held(self) -> str | None:
        """The movable object in the gripper, if any."""
        return next((n for n in OBJECTS if n in self.rs.objects_dict and self.grasped(n)), None)

    def holds(self, predicate: tuple) -> bool:
        return bool(self.rs._eval_predicate(list(predicate)))

    def grip_toward(self, level: float) -> float:
        """Gripper action that moves the Panda's incremental finger command (0.2 per step) to
        ``level`` and then holds it (0): half-open approaches, a loosened grip."""
        cur = float(self.gripper.current_action[-1])
        return 0.0 if abs(level - cur) < 0.1 else float(np.sign(level - cur))

    def command(self, target: np.ndarray, R_target: np.ndarray | None, grip: float, gain: float = 1.5) -> np.ndarray:
        """OSC_POSE action toward position ``target`` and orientation ``R_target`` (None: keep)."""
        eef, R = self.eef()
        a = np.zeros(7, dtype=np.float32)
        a[:3] = np.clip(gain * (np.asarray(target) - eef) / POS_SCALE, -1, 1)
        if R_target is not None:
            a[3:6] = np.clip(rotvec(R_target @ R.T) / ROT_SCALE, -1, 1)
        a[6] = grip
        return a


class Skill(Protocol):
    """One stage of an expert. ``start`` may be called in any state (mid-episode resets);
    ``act`` returns the next action, or None once the skill is done."""

    def start(self, scene: Scene) -> None: ...

    def act(self, scene: Scene) -> np.ndarray | None: ...


HOME = np.array([-0.21, 0.0, 1.15])  # where the gripper starts every LIBERO-Goal episode (pointing down,
                                     # fingers along y), clear of the scene
HOME_R = top_down(np.pi / 2)  # its orientation: pointing down, fingers along world y


class Release:
    """Let go and return to the start pose: an expert taking over mid-episode (the P4 switch,
    relabeling) may find the gripper on a drawer handle or holding an object its task does not
    need; from the start pose every skill works. Opens, backs out along the hand's approach axis,
    rises, then moves across and turns."""

    BACK = 0.08  # backing out along the hand's approach axis first (out of a drawer handle, off an object)

    def start(self, scene: Scene) -> None:
        self.t = 0
        eef, R = scene.eef()
        self.back = eef - self.BACK * R[:, 2]

    def act(self, scene: Scene) -> np.ndarray | None:
        self.t += 1
        eef, _ = scene.eef()
        if self.t <= 6:
            return scene.command(eef, None, -1.0)
        if self.t <= 26 and np.linalg.norm(eef - self.back) > 0.015:
            return scene.command(self.back, None, -1.0)
        self.t = max(self.t, 27)
        turned = np.linalg.norm(rotvec(HOME_R @ scene.eef()[1].T)) < 0.1
        if (np.linalg.norm(eef - HOME) < 0.03 and turned) or self.t > 100:
            return None
        if eef[2] < HOME[2] - 0.04:  # rise first, keeping the orientation (the hand may be in a drawer)
            return scene.command(np.array([eef[0], eef[1], HOME[2]]), None, -1.0)
        return scene.command(HOME, HOME_R, -1.0)
