"""Scripted LIBERO-Goal skills on the scene's fixtures: cabinet drawers, the stove knob, sliding the plate.

Each skill is a small state machine over named phases that reads the true simulator state through
:class:`envs.libero.scene.Scene`. Fixture placement changes between resets, so every target is
read live from the simulator (drawer handle geom, knob joint anchor, plate body), never hard-coded
in world coordinates. A skill started in a state where its goal already holds ends at once.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from envs.geometry import rotvec
from envs.libero.scene import HOME_R, Scene, Skill, top_down

CABINET = "wooden_cabinet_1"
DRAWER_OPEN_Q = -0.155   # slide joint range [-0.16, 0.01]; LIBERO's Open needs qpos < -0.14
KNOB = "flat_stove_1_button"
KNOB_ON_Q = 0.9          # hinge range [-0.005, 2.1]; LIBERO's TurnOn needs qpos >= 0.5


def _rot_err(scene: Scene, R_target: np.ndarray) -> float:
    return float(np.linalg.norm(rotvec(R_target @ scene.eef()[1].T)))


def _nearest_yaw(scene: Scene, yaw: float) -> float:
    """``yaw`` or ``yaw + pi`` (the same finger line), whichever the gripper is closer to."""
    f = scene.eef()[1][:, 0]
    cur = float(np.arctan2(f[1], f[0]))
    return yaw + np.pi * np.round((cur - yaw) / np.pi)


class _Phases:
    """Named phases, each with its own step counter ``t``."""

    phase: str
    t: int

    def _go(self, phase: str) -> None:
        self.phase, self.t = phase, 0

    def _reached(self, scene: Scene, target: np.ndarray, tol: float, R: np.ndarray | None = None,
                 rot_tol: float = 0.1) -> bool:
        ok = np.linalg.norm(scene.eef()[0] - target) < tol
        return bool(ok and (R is None or _rot_err(scene, R) < rot_tol))


class OpenDrawer(_Phases):
    """Pull the top or middle drawer of the wooden cabinet open by its handle bar, then let go and back away.

    The gripper points horizontally into the drawer front with its fingers vertical and pinches the
    bar from above and below. The fingers approach only half open (``APERTURE``) so the upper one
    passes under the handle of the drawer above, and the end effector sits ``LIFT`` above the bar
    (the lower finger just clears it) so the 20 cm tall hand stays above the plate that lies in front
    of the cabinet. It ends open, backed off and pointing down again, above the open drawer's front.
    """

    APERTURE = -0.2  # gripper command level (-1 open, 1 closed): 2.4 cm per finger
    LIFT = 0.010     # eef above the bar centre while grasping
    NEAR = 0.025     # fingertips just in front of the bar (and of the bar above) on the way down
    HIGH = 0.15      # height above the grasp at which the gripper turns
    STANDOFF = 0.10  # backing off the open drawer
    LEAD = 0.03      # how far ahead of the moving bar the pull aims
    UP = np.array([-0.12, 0.0, 0.08])  # backing off ends here, from the standoff: straight up, the top
                                       # drawer's standoff is near the arm's reach and the elbow can lock straight

    def __init__(self, level: str):
        if level == "bottom":  # no LIBERO-Goal task opens it
            raise NotImplementedError("the bottom drawer's handle is too low for this grasp: the hand reaches 10 cm "
                                      "below it and would hit the table")
        if level not in ("top", "middle"):
            raise ValueError(f"drawer level must be 'top' or 'middle', got {level!r}")
        self.level = level
        self.joint = f"{CABINET}_{level}_level"

    def start(self, scene: Scene) -> None:
        m, d = scene.m, scene.d
        # the drawer slides along its joint axis; negative qpos opens it (pulls toward the robot)
        self.out = -np.array(d.xaxis[m.joint_name2id(self.joint)])
        body = m.body_name2id(f"{CABINET}_cabinet_{self.level}")
        boxes = [g for g in range(m.ngeom) if m.geom_bodyid[g] == body and m.geom_type[g] == 6 and m.geom_contype[g]]
        self.bar = max(boxes, key=lambda g: float(d.geom_xpos[g] @ self.out))  # the frontmost box is the handle
        x = np.array([0.0, 0.0, -1.0])   # finger axis vertical
        z = -self.out                    # pointing into the drawer front
        self.R_pull = np.stack([x, np.cross(z, x), z], axis=1)
        near = np.linalg.norm(scene.eef()[0] - self._grasp_point(scene)) < 0.06
        if self.is_open(scene):
            self._go("release" if near else "done")
        else:
            self._go("pre")

    def is_open(self, scene: Scene) -> bool:
        return scene.qpos(self.joint) <= DRAWER_OPEN_Q

    def _grasp_point(self, scene: Scene) -> np.ndarray:
        return np.array(scene.d.geom_xpos[self.bar]) + [0.0, 0.0, self.LIFT]

    def act(self, scene: Scene) -> np.ndarray | None:
        self.t += 1
        grasp = self._grasp_point(scene)
        front = grasp + self.STANDOFF * self.out
        if self.phase == "pre":  # turn to face the drawer high above the handle, clear of the objects
            high = grasp + self.NEAR * self.out + [0.0, 0.0, self.HIGH]
            if self._reached(scene, high, 0.02, self.R_pull) or self.t > 60:
                self._go("lower")
            return scene.command(high, self.R_pull, scene.grip_toward(self.APERTURE))
        if self.phase == "lower":  # straight down just in front of the bar: the hand never sweeps the plate
            near = grasp + self.NEAR * self.out
            if self._reached(scene, near, 0.01) or self.t > 40:
                self._go("reach")
            return scene.command(near, self.R_pull, scene.grip_toward(self.APERTURE))
        if self.phase == "reach":
            if self._reached(scene, grasp, 0.008) or self.t > 30:
                self._go("grip")
            return scene.command(grasp, self.R_pull, scene.grip_toward(self.APERTURE))
        if self.phase == "grip":
            if self.t > 10:
                self._go("pull")
            return scene.command(grasp, self.R_pull, 1.0)
        if self.phase == "pull":
            if self.is_open(scene) or self.t > 100:
                self._go("release")
            elif np.linalg.norm(scene.eef()[0] - grasp) > 0.025:  # slipped off the bar: grasp again
                self._go("pre")
            return scene.command(grasp + self.LEAD * self.out, self.R_pull, 1.0)
        if self.phase == "release":
            if self.t > 8:
                self._go("back")
            return scene.command(scene.eef()[0], None, -1.0)
        if self.phase == "back":  # straight out along the approach axis, clear of the handle
            if self._reached(scene, front, 0.02) or self.t > 30:
                self._go("up")
            return scene.command(front, None, -1.0)
        if self.phase == "up":
            above = front + self.UP  # up and back toward the robot: straight up stretches the arm to its reach
            if self._reached(scene, above, 0.03, HOME_R, 0.25) or self.t > 30:
                self._go("done" if self.is_open(scene) else "pre")  # a failed pull tries again
            return scene.command(above, HOME_R, -1.0)
        return None


class TurnOnStove(_Phases):
    """Grasp the stove knob's ridge and twist it counter-clockwise (positive hinge angle).

    The knob sits low and close to the robot base, where a top-down grasp folds the elbow onto its
    joint limit; the gripper therefore leans ``TILT`` toward the robot along the ridge, fingers
    closing across it. The ridge is grasped on the hinge axis, so the twist is a pure wrist rotation
    about world z that aims ``LEAD`` past the knob's current angle.
    """

    RIDGE = np.array([0.001, 0.0, 0.030])  # grasp point in the knob body frame (ridge top is z 0.05)
    TILT = 0.5   # radians off vertical
    LEAD = 0.35  # radians

    def start(self, scene: Scene) -> None:
        self._go("done" if self.is_on(scene) else "above")

    def is_on(self, scene: Scene) -> bool:
        return scene.qpos(KNOB) >= KNOB_ON_Q

    def _grasp_rotation(self, scene: Scene) -> np.ndarray:
        p, R = scene.body(KNOB)
        ridge = R[:, 1] if R[:, 1] @ (scene.body("robot0_base")[0] - p) > 0 else -R[:, 1]
        z = np.cos(self.TILT) * np.array([0.0, 0.0, -1.0]) + np.sin(self.TILT) * ridge
        x = R[:, 0] if R[:, 0] @ scene.eef()[1][:, 0] >= 0 else -R[:, 0]
        return np.stack([x, np.cross(z, x), z], axis=1)

    def act(self, scene: Scene) -> np.ndarray | None:
        self.t += 1
        p, R = scene.body(KNOB)
        grasp = p + R @ self.RIDGE
        if self.phase == "above":
            if self.t == 1:
                self.R0 = self._grasp_rotation(scene)
            target = grasp + [0.0, 0.0, 0.08]
            if self._reached(scene, target, 0.015, self.R0) or self.t > 60:
                self._go("down")
            return scene.command(target, self.R0, -1.0)
        if self.phase == "down":
            if self._reached(scene, grasp, 0.006) or self.t > 30:
                self._go("grip")
            return scene.command(grasp, self.R0, -1.0)
        if self.phase == "grip":
            if self.t > 10:
                self.q0 = scene.qpos(KNOB)
                self._go("turn")
            return scene.command(grasp, self.R0, 1.0)
        if self.phase == "turn":
            if self.is_on(scene) or self.t > 80:
                self._go("release")
            a = scene.qpos(KNOB) - self.q0 + self.LEAD
            Rz = np.array([[np.cos(a), -np.sin(a), 0.0], [np.sin(a), np.cos(a), 0.0], [0.0, 0.0, 1.0]])
            return scene.command(grasp, Rz @ self.R0, 1.0)
        if self.phase == "release":
            if self.t > 6:
                self._go("up")
            return scene.command(scene.eef()[0], None, -1.0)
        if self.phase == "up":
            target = grasp + [0.0, 0.0, 0.12]
            if self._reached(scene, target, 0.02) or self.t > 30:
                self._go("done" if self.is_on(scene) else "above")  # a failed twist tries again
            return scene.command(target, None, -1.0)
        return None


class SlidePlate(_Phases):
    """Slide the plate along the table in front of the stove, pinching its rim.

    A round plate escapes a point pusher from outside, and a fingertip inside rides up its shallow
    rim; pinched at the rim's edge it follows the gripper along the table, never lifted. The grip
    is on the plate's side facing the robot, the fingers closing along ``GRIP_DIR``: within the
    arm's reach all the way, and the hand, 20 cm long along the finger axis, passes between the bowl
    and the cabinet's handles. The cream cheese stands between the plate and the goal: the plate
    first goes right (+x) until it clears the cheese, then forward (+y), then left onto the goal,
    on the far side of the region from the cheese.
    """

    GRIP_DIR = np.array([-np.cos(np.pi / 6), -np.sin(np.pi / 6)])  # 30 deg off -x: between bowl and cabinet
    GRIP_R = 0.045    # eef from the plate centre along GRIP_DIR: the outer finger lands outside the rim
    GRIP_Z = 0.019    # eef above the plate body origin: fingertips just above the plate floor
    STEP = 0.03       # largest commanded displacement per step while sliding
    TOL = 0.008
    PLATE_R = 0.077   # plate radius (6.8 cm) plus clearance
    CHEESE_X = 0.042  # cream cheese half length along x
    CHEESE_CLEAR = 0.1  # plate centre this far from the cheese's along y passes it
    GOAL = np.array([0.025, 0.025])  # goal offset from the region centre (region half size 0.04)

    def __init__(self, obj: str = "plate_1", region: str = "main_table_stove_front_region",
                 obstacle: str = "cream_cheese_1"):
        self.obj, self.region, self.obstacle = obj, region, obstacle

    def start(self, scene: Scene) -> None:
        self.R = top_down(_nearest_yaw(scene, float(np.arctan2(self.GRIP_DIR[1], self.GRIP_DIR[0]))))
        self._plan(scene)
        self._go("done" if self.is_placed(scene) else "above")

    def _plan(self, scene: Scene) -> None:
        """Waypoints for the plate centre: right of the cheese, forward past it, left onto the goal."""
        plate = scene.obj(self.obj)[0][:2]
        goal = scene.site(self.region)[:2] + self.GOAL
        cheese = scene.obj(self.obstacle)[0][:2]
        x_clear = max(plate[0], cheese[0] + self.CHEESE_X + self.PLATE_R)
        if plate[1] > cheese[1] + self.CHEESE_CLEAR:  # already past the cheese: straight to the goal
            self.waypoints = [goal]
        else:
            self.waypoints = [np.array([x_clear, min(plate[1], cheese[1] - self.CHEESE_CLEAR)]),
                              np.array([x_clear, goal[1]]), goal]

    def is_placed(self, scene: Scene) -> bool:
        return scene.holds(("on", self.obj, self.region))

    def _grip_point(self, scene: Scene) -> np.ndarray:
        return scene.obj(self.obj)[0] + [*(self.GRIP_R * self.GRIP_DIR), self.GRIP_Z]

    def act(self, scene: Scene) -> np.ndarray | None:
        self.t += 1
        grip = self._grip_point(scene)
        if self.phase == "above":
            target = grip + [0.0, 0.0, 0.10]
            if self._reached(scene, target, 0.015, self.R) or self.t > 60:
                self._go("down")
            return scene.command(target, self.R, -1.0)
        if self.phase == "down":
            if self._reached(scene, grip, 0.006) or self.t > 30:
                self._go("pinch")
            return scene.command(grip, self.R, -1.0)
        if self.phase == "pinch":
            if self.t > 10:
                self.hold = scene.eef()[0] - scene.obj(self.obj)[0]
                self._go("slide")
            return scene.command(grip, self.R, 1.0)
        if self.phase == "slide":
            plate = scene.obj(self.obj)[0]
            if np.linalg.norm(scene.eef()[0] - plate - self.hold) > 0.02:  # lost the rim: grip again
                self._go("release")
                return scene.command(scene.eef()[0], self.R, -1.0)
            while self.waypoints and np.linalg.norm(self.waypoints[0] - plate[:2]) < self.TOL:
                self.waypoints.pop(0)
            if not self.waypoints:
                self._go("release")
                return scene.command(scene.eef()[0], self.R, 1.0)
            err = self.waypoints[0] - plate[:2]
            dist = float(np.linalg.norm(err))
            step = err / dist * min(self.STEP, 0.01 + dist)  # a firm push, a gentle arrival
            return scene.command(scene.eef()[0] + [*step, 0.0], self.R, 1.0)
        if self.phase == "release":
            if self.t > 6:
                self._go("up")
            return scene.command(scene.eef()[0], self.R, -1.0)
        if self.phase == "up":
            target = scene.eef()[0] + [0.0, 0.0, 0.05]
            if scene.eef()[0][2] > grip[2] + 0.08 or self.t > 30:
                if not self.waypoints and not self.is_placed(scene):
                    self._plan(scene)  # the plate moved on release: slide it again
                self._go("done" if self.is_placed(scene) else "above")
            return scene.command(target, self.R, -1.0)
        return None


FIXTURE_TASKS: dict[int, Callable[[], list[Skill]]] = {
    0: lambda: [OpenDrawer("middle")],
    5: lambda: [SlidePlate()],
    7: lambda: [TurnOnStove()],
}

__all__ = ["OpenDrawer", "TurnOnStove", "SlidePlate", "FIXTURE_TASKS"]
