"""Pick-and-place skills for the LIBERO-Goal tasks that move an object (1, 2, 3, 4, 6, 8, 9).

One state machine, :class:`PickPlace`, parameterised by how to hold the object (:class:`Grasp`)
and where to put it (:class:`Place`): approach, descend, grasp, lift, carry, lower, release,
retreat; a missed or dropped grasp opens, rises and approaches again. The object's pose in the
gripper frame is measured when the grasp closes, so the carry can turn the wrist (the wine bottle
goes onto the rack lying down) and still put the object, not the gripper, where it belongs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from envs.geometry import rotvec
from envs.libero.scene import Scene, Skill, top_down
from envs.libero.fixtures import OpenDrawer

BOWL, CHEESE, BOTTLE, PLATE = "akita_black_bowl_1", "cream_cheese_1", "wine_bottle_1", "plate_1"
BOWL_RIM = 0.047  # bowl centre to the middle of its rim wall (outer radius 0.053)
BOWL_GRIP_Z = 0.03  # rim grasp height above the bowl's origin (its bottom; rim top at 0.053)
CHEESE_GRIP_Z = 0.003  # above the cream cheese's origin (its centre; the box is 1.8 cm tall)
BOTTLE_GRIP_Z = 0.13  # up the wine bottle's neck from its origin (its base; top at 0.158)
# Task 3: the bowl sits partly under the open top drawer.
LEAN, LEAN_SIDE, LEAN_GRIP_Z = np.radians(30), np.radians(150), 0.045  # leaning rim grasp
DRAWER_HALF_DEPTH = 0.077  # top drawer region centre to its front wall's inside (y)
DRAWER_HALF_WIDTH = 0.108  # top drawer region centre to its side walls' outside (x)
CABINET_FRONT = 0.122  # cabinet body to its front face (y)
# Task 9: the bottle lies along x in the rack's top cradle.
RACK_REST = np.array([0.01, -0.015, 0.028])  # bottle base lying in the cradle, from the rack's site
RACK_LEAN = np.radians(52)  # gripper tilt setting the bottle down (more folds the elbow to its limit)


def _yaw(R: np.ndarray) -> float:
    """Yaw of the finger axis (the gripper's x axis)."""
    return float(np.arctan2(R[1, 0], R[0, 0]))


def _rot(axis: int, a: float) -> np.ndarray:
    """Rotation by ``a`` about world axis ``axis`` (0: x, 1: y, 2: z)."""
    i, j = [k for k in range(3) if k != axis]
    R = np.eye(3)
    R[i, i] = R[j, j] = np.cos(a)
    R[j, i], R[i, j] = (np.sin(a), -np.sin(a)) if axis != 1 else (-np.sin(a), np.sin(a))
    return R


def _angle(R1: np.ndarray, R2: np.ndarray) -> float:
    return float(np.linalg.norm(rotvec(R1 @ R2.T)))


@dataclass
class Grasp:
    """Where and how the gripper closes on the object, from the object's current pose.

    ``point(scene, pos, R)``: the end-effector position and rotation at the grasp (the gripper
    comes in along its own pointing axis). ``withdraw(scene, pos)``: where the object's origin goes
    first after the grasp, before it rises (out from under the open drawer), or None.
    """

    point: Callable[[Scene, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
    withdraw: Callable[[Scene, np.ndarray], np.ndarray | None] = lambda scene, pos: None


@dataclass
class Place:
    """Where the object's origin goes and how the gripper is turned while carrying it there.

    ``target(scene)``: the object's origin at release; ``goal``: the bddl predicate it makes true;
    ``clear``: the height the object's origin is lifted to before it is carried across;
    ``turn(R, in_hand)``: the gripper rotation for carry and release, from the rotation at the
    grasp and the object's origin in the gripper frame (default: as grasped); ``above``: how far
    above the release point the carry arrives; ``reach``: the object's origin from the gripper
    (world frame) at release when it is not where the grasp held it (a bottle held by the neck
    pivots in the fingers and lies down on the rack); ``grip``: the finger command while lowering
    (below 1 the fingers loosen so that the object can pivot).
    """

    target: Callable[[Scene], np.ndarray]
    goal: tuple
    clear: float = 1.0
    turn: Callable[[np.ndarray, np.ndarray], np.ndarray] = lambda R, in_hand: R
    above: float = 0.06
    reach: np.ndarray | None = None
    grip: float = 1.0


# Footprint radius and top height above the origin of each movable object: what the hand must miss.
FOOTPRINT = {BOWL: (0.054, 0.053), CHEESE: (0.045, 0.009), BOTTLE: (0.022, 0.158), PLATE: (0.07, 0.017)}
# The open hand in the gripper frame: fingers span |x| in [0.039, 0.065] from the centre and end
# 1 cm below it; the palm spans |x| < 0.104, |y| < 0.032 and starts 3.1 cm above it.
FINGER_X, PALM_X, PALM_Y, PALM_Z = (0.039, 0.065), 0.104, 0.032, 0.031


def _nearest_line(yaw: float, ref: float) -> float:
    """A finger axis is a line: of ``yaw`` and ``yaw + pi`` the one nearest ``ref``."""
    return yaw + np.pi * np.round((ref - yaw) / np.pi)


def _rect_dist(p: np.ndarray, c: np.ndarray, u: np.ndarray, x: tuple[float, float], y: float) -> float:
    """Distance from ``p`` to the rectangle ``c + s u + t u_perp``, s in ``x``, |t| <= ``y``."""
    d = p - c
    s, t = d @ u, d @ np.array([-u[1], u[0]])
    return float(np.hypot(max(x[0] - s, 0.0, s - x[1]), max(abs(t) - y, 0.0)))


def clearance(scene: Scene, eef: np.ndarray, yaw: float, skip: str) -> float:
    """Gap between the open hand at ``eef`` (finger axis ``yaw``) and every other movable object."""
    u = np.array([np.cos(yaw), np.sin(yaw)])
    gaps = []
    for name, (r, top) in FOOTPRINT.items():
        if name == skip:
            continue
        pos = scene.obj(name)[0]
        if pos[2] + top > eef[2] + PALM_Z:
            gaps.append(_rect_dist(pos[:2], eef[:2], u, (-PALM_X, PALM_X), PALM_Y) - r)
        if pos[2] + top > eef[2] - 0.01:
            gaps += [_rect_dist(pos[:2], eef[:2], k * u, FINGER_X, 0.01) - r for k in (1, -1)]
    return min(gaps, default=np.inf)


def bowl_rim(scene: Scene, pos: np.ndarray, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A rim point, fingers radial (one inside the bowl, one outside): the side nearest the robot
    whose hand comes down at least 2 cm from every other object, else the clearest side."""
    best, best_score = None, -np.inf
    for th in np.pi + np.radians(np.arange(0, 360, 30)):
        g = pos + [BOWL_RIM * np.cos(th), BOWL_RIM * np.sin(th), BOWL_GRIP_Z]
        score = min(clearance(scene, g, th, BOWL), 0.02) - 0.001 * abs(np.angle(np.exp(1j * (th - np.pi))))
        if score > best_score:
            best, best_score = (g, th), score
    g, th = best
    return g, top_down(_nearest_line(th, _yaw(scene.eef()[1])))


def box_across(scene: Scene, pos: np.ndarray, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cream cheese box across its short side, fingertips just above the table: at its middle,
    or off-centre along its length when that keeps the palm 2 cm clearer of a neighbour."""
    yaw = _nearest_line(_yaw(R) + np.pi / 2, _yaw(scene.eef()[1]))
    along = R[:, 0] * [1.0, 1.0, 0.0]
    best, best_score = pos, -np.inf
    for s in (0.0, 0.012, -0.012, 0.024, -0.024):
        g = pos + s * along + [0.0, 0.0, CHEESE_GRIP_Z]
        score = min(clearance(scene, g, yaw, CHEESE), 0.02) - 0.1 * abs(s)
        if score > best_score:
            best, best_score = g, score
    return best, top_down(yaw)


def bottle_neck(scene: Scene, pos: np.ndarray, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The wine bottle's neck from above (the hand is above every other object), fingers along y:
    turned to lay the bottle along x, they stay level beside the neck."""
    return pos + R @ np.array([0.0, 0.0, BOTTLE_GRIP_Z]), top_down(_nearest_line(np.pi / 2, _yaw(scene.eef()[1])))


def bowl_rim_leaning(scene: Scene, pos: np.ndarray, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bowl's rim on its -x,+y side, the gripper leaning ``LEAN`` outward from the bowl.

    With the top drawer open the bowl sits partly under it; an upright hand and wrist above the rim
    would hit the drawer, a leaning one stays outside its footprint (and clear of the table).
    """
    u = np.array([np.cos(LEAN_SIDE), np.sin(LEAN_SIDE), 0.0])
    z = np.cos(LEAN) * np.array([0.0, 0.0, -1.0]) - np.sin(LEAN) * u  # pointing in and down
    x = -np.cos(LEAN) * u + [0.0, 0.0, np.sin(LEAN)]  # finger axis: radial, rising inward
    R = np.stack([x, np.cross(z, x), z], axis=1)
    flipped = R * [-1.0, -1.0, 1.0]  # the same grasp with the fingers swapped
    R = min((R, flipped), key=lambda Rg: _angle(Rg, scene.eef()[1]))
    return pos + BOWL_RIM * u + [0.0, 0.0, LEAN_GRIP_Z], R


def out_from_drawer(scene: Scene, pos: np.ndarray) -> np.ndarray:
    """Slide the bowl along the lean direction until its disc clears the open drawer's footprint,
    rising only as far as fits under the drawer floor."""
    region = scene.site("wooden_cabinet_1_top_region")
    x_min = region[0] - DRAWER_HALF_WIDTH - 0.005
    y_max = region[1] + DRAWER_HALF_DEPTH + 0.015
    u = np.array([np.cos(LEAN_SIDE), np.sin(LEAN_SIDE)])
    r = FOOTPRINT[BOWL][0]
    d = min((pos[0] + r - x_min) / -u[0], (y_max + r - pos[1]) / u[1])
    return pos + [*(max(d, 0.0) * u), 0.05]


class PickPlace:
    """Pick ``obj`` with ``grasp`` and put it at ``place``; works from any state."""

    HOVER = 0.10
    GAIN = 2.0

    def __init__(self, obj: str, grasp: Grasp, place: Place):
        self.obj, self.grasp, self.place = obj, grasp, place

    def keeps(self, name: str) -> bool:
        return name == self.obj

    def start(self, scene: Scene) -> None:
        self.retreat_z = scene.eef()[0][2] + 0.08
        if scene.holds(self.place.goal):
            self._set("retreat")
        elif scene.grasped(self.obj):
            self._hold(scene)
        else:
            self._aim(scene)

    def _set(self, phase: str) -> None:
        self.phase, self.t = phase, 0

    def _aim(self, scene: Scene) -> None:
        """Choose the grasp (kept relative to the object until it closes) and approach it."""
        pos, R = scene.obj(self.obj)
        g, self.Rg = self.grasp.point(scene, pos, R)
        self.grasp_off = g - pos
        self.start_z = scene.eef()[0][2]
        self._set("approach")

    def _hold(self, scene: Scene) -> None:
        """The grasp closed: record the object's origin in the gripper frame, then lift it."""
        eef, self.R_grasp = scene.eef()
        pos = scene.obj(self.obj)[0]
        self.in_hand = self.R_grasp.T @ (pos - eef)
        self.waypoint = self.grasp.withdraw(scene, pos)
        self._set("lift" if self.waypoint is None else "withdraw")

    def act(self, scene: Scene) -> np.ndarray | None:
        self.t += 1
        if self.phase in ("approach", "descend", "grasp", "regrasp"):
            return self._pick(scene)
        if self.phase in ("withdraw", "lift", "carry", "lower"):
            return self._carry(scene)
        eef = scene.eef()[0]
        if self.phase == "release":
            if self.t >= 8:
                self.retreat_z = eef[2] + 0.08
                self._set("retreat")
            return scene.command(eef, None, -1.0, self.GAIN)
        if eef[2] > self.retreat_z - 0.01 or self.t > 30:  # retreat: rise clear, then done
            return None
        return scene.command(np.array([eef[0], eef[1], self.retreat_z]), None, -1.0, self.GAIN)

    def _pick(self, scene: Scene) -> np.ndarray:
        eef, R = scene.eef()
        g = scene.obj(self.obj)[0] + self.grasp_off
        if self.phase == "approach":  # to HOVER back along the pointing axis, high until above it
            target = g - self.HOVER * self.Rg[:, 2]
            if np.linalg.norm(eef[:2] - target[:2]) > 0.03:
                target[2] = max(target[2], self.start_z)
            if (np.linalg.norm(target - eef) < 0.015 and _angle(self.Rg, R) < 0.1) or self.t > 80:
                self._set("descend")
            return scene.command(target, self.Rg, -1.0, self.GAIN)
        if self.phase == "descend":
            if np.all(np.abs(g - eef) < 0.008) or self.t > 40:
                self._set("grasp")
            return scene.command(g, self.Rg, -1.0, self.GAIN)
        if self.phase == "grasp":
            if self.t >= 10 and scene.grasped(self.obj):
                self._hold(scene)
            elif self.t > 20:
                self._set("regrasp")
            return scene.command(g, self.Rg, 1.0, self.GAIN)
        if self.t > 12:  # regrasp: open and back off along the pointing axis, then aim again
            self._aim(scene)
        return scene.command(g - self.HOVER * self.Rg[:, 2], None, -1.0, self.GAIN)

    def _carry(self, scene: Scene) -> np.ndarray:
        eef, R = scene.eef()
        pos = scene.obj(self.obj)[0]
        if self.phase != "lower" and np.linalg.norm(pos - eef - R @ self.in_hand) > 0.03:
            self._set("regrasp")  # dropped (judged by pose: the contact flags flicker)
            return scene.command(eef, None, -1.0, self.GAIN)
        if self.phase == "withdraw":
            if np.linalg.norm(pos - self.waypoint) < 0.015 or self.t > 40:
                self._set("lift")
            return scene.command(eef + self.waypoint - pos, None, 1.0, self.GAIN)
        if self.phase == "lift":
            if pos[2] > self.place.clear - 0.02:
                self._set("carry")
            return scene.command(eef + [0.0, 0.0, self.place.clear - pos[2]], None, 1.0, self.GAIN)
        Rt = self.place.turn(self.R_grasp, self.in_hand)
        place = self.place.target(scene)
        release = place - (Rt @ self.in_hand if self.place.reach is None else self.place.reach)
        if self.phase == "carry":
            high = release + [0.0, 0.0, max(self.place.above, self.place.clear - place[2])]
            if np.linalg.norm(eef - high) < 0.015:
                self.last = eef
                self._set("lower")
            return scene.command(high, Rt, 1.0, self.GAIN)
        stalled = self.t > 5 and np.linalg.norm(eef - self.last) < 0.001  # set down on something
        self.last = eef
        if np.linalg.norm(release - eef) < 0.01 or stalled or self.t > 40:
            self._set("release")
        return scene.command(release, Rt, scene.grip_toward(self.place.grip), self.GAIN)


def _site(name: str, dz: float = 0.0) -> Callable[[Scene], np.ndarray]:
    """A target ``dz`` above a bddl region's site (released that far above the surface)."""
    return lambda scene: scene.site(name) + [0.0, 0.0, dz]


def _on_object(name: str, dz: float) -> Callable[[Scene], np.ndarray]:
    """A target ``dz`` above another object's origin."""
    return lambda scene: scene.obj(name)[0] + [0.0, 0.0, dz]


def drawer_floor(scene: Scene) -> np.ndarray:
    """The bowl in the open top drawer: centred in the part that sticks out of the cabinet (y) and
    shifted +x so the bowl and the finger outside it on its -x side both fit between the walls."""
    region = scene.site("wooden_cabinet_1_top_region")
    front_wall = region[1] + DRAWER_HALF_DEPTH
    cabinet_front = scene.obj("wooden_cabinet_1")[0][1] + CABINET_FRONT
    return np.array([region[0] + 0.029, (front_wall + cabinet_front) / 2, region[2] - 0.015])


def bowl_ahead(R: np.ndarray, in_hand: np.ndarray) -> np.ndarray:
    """Turned about the vertical so the held bowl lies on the gripper's +x side, the hand away from
    the cabinet."""
    off = R @ in_hand
    return _rot(2, -np.arctan2(off[1], off[0])) @ R


def rack_cradle(scene: Scene) -> np.ndarray:
    """The bottle's base, lying along x in the rack's top cradle (the upper slat, 31 degrees up
    toward -y, with a lip on its low edge), its neck past the slat's -x end where the fingers fit."""
    return scene.site("wine_rack_1_top_region") + RACK_REST


def lean_forward(R: np.ndarray, in_hand: np.ndarray) -> np.ndarray:
    """Tipped ``RACK_LEAN`` about the finger axis (y) so the bottle's base leads toward +x: set
    down base first on the slat, the bottle pivots in the loosened fingers until it lies flat."""
    return _rot(1, -RACK_LEAN) @ top_down(_yaw(R))


BOWL_GRASP, CHEESE_GRASP, BOTTLE_GRASP = Grasp(bowl_rim), Grasp(box_across), Grasp(bottle_neck)
BOWL_BY_DRAWER = Grasp(bowl_rim_leaning, out_from_drawer)

PICK_TASKS: dict[int, Callable[[], list[Skill]]] = {
    1: lambda: [PickPlace(BOWL, BOWL_GRASP, Place(_site("flat_stove_1_cook_region", 0.03),
                                                  ("on", BOWL, "flat_stove_1_cook_region")))],
    2: lambda: [PickPlace(BOTTLE, BOTTLE_GRASP, Place(_site("wooden_cabinet_1_top_side", 0.01),
                                                      ("on", BOTTLE, "wooden_cabinet_1_top_side"), clear=1.2))],
    3: lambda: [OpenDrawer("top"),
                PickPlace(BOWL, BOWL_BY_DRAWER, Place(drawer_floor, ("in", BOWL, "wooden_cabinet_1_top_region"),
                                                      clear=1.17, turn=bowl_ahead))],
    4: lambda: [PickPlace(BOWL, BOWL_GRASP, Place(_site("wooden_cabinet_1_top_side", 0.015),
                                                  ("on", BOWL, "wooden_cabinet_1_top_side"), clear=1.2))],
    6: lambda: [PickPlace(CHEESE, CHEESE_GRASP, Place(_on_object(BOWL, 0.04), ("on", CHEESE, BOWL)))],
    8: lambda: [PickPlace(BOWL, BOWL_GRASP, Place(_on_object(PLATE, 0.02), ("on", BOWL, PLATE)))],
    9: lambda: [PickPlace(BOTTLE, BOTTLE_GRASP, Place(rack_cradle, ("on", BOTTLE, "wine_rack_1_top_region"),
                                                      clear=1.1, turn=lean_forward, above=0.11, grip=0.4,
                                                      reach=np.array([BOTTLE_GRIP_Z, 0.0, 0.0])))],
}

__all__ = ["PICK_TASKS", "PickPlace", "Grasp", "Place"]
