"""The table scene both groundflow ManiSkill tasks share: the Panda on ManiSkill's table, the
cameras, pose readers, a target disc, and the TCP steering both scripted experts use.

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
from mani_skill.envs.sapien_env import BaseEnv  # noqa: E402
from mani_skill.sensors.camera import CameraConfig  # noqa: E402
from mani_skill.utils import sapien_utils  # noqa: E402
from mani_skill.utils.scene_builder.table import TableSceneBuilder  # noqa: E402

from envs.errors import InvalidOptionError  # noqa: E402

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
    process-wide by ``envs.platform_setup.setup``, which ``envs.maniskill.env`` runs before import."""

    render_target_z = 0.1

    def __init__(self, *args, sensor_uids: tuple[str, ...] | None = None, **kwargs):
        # only the cameras asked for are built: SAPIEN renders every sensor on every step
        self.sensor_uids = None if sensor_uids is None else tuple(sensor_uids)
        super().__init__(*args, **kwargs)

    @property
    def _default_sensor_configs(self):
        configs = [
            # the original wide view from above the table's far edge (the arm fills its middle)
            _look_at_camera(eye=[0.3, 0, 0.6], target=[-0.1, 0, 0.1]),
            # a real cell's fixed camera: opposite the robot, the workspace and both goals fill the frame
            _look_at_camera(eye=[0.4, 0, 0.46], target=[-0.04, 0, 0.0], name="workspace_camera", fov=np.deg2rad(56)),
            # a wrist camera on the back of the hand, looking past the fingertips (hand frame: z along the fingers)
            CameraConfig("hand_camera", sapien_utils.look_at(eye=[-0.07, 0, 0.02], target=[0, 0, 0.2]),
                         128, 128, np.deg2rad(75), 0.01, 100, mount=self.agent.robot.links_map["panda_hand"]),
        ]
        if self.sensor_uids is not None:
            configs = [c for c in configs if c.uid in self.sensor_uids]
        return configs

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


def _look_at_camera(eye, target, name: str = "base_camera", size: int = 128, fov: float = np.pi / 2) -> CameraConfig:
    return CameraConfig(name, sapien_utils.look_at(eye=eye, target=target), size, size, fov, 0.01, 100)


# ============================================================================================ #
# TCP steering (both scripted experts)
# ============================================================================================ #
GAIN = 12.0  # action per metre of position error (0.1 m per unit: ~1.2 x the error per step)


def _move(tcp: np.ndarray, target: np.ndarray, vmax: float = 1.0) -> np.ndarray:
    a = GAIN * (np.asarray(target) - tcp)
    n = np.linalg.norm(a)
    return a * (vmax / n) if n > vmax else a


PUSH_Z = 0.018  # TCP height while pushing (the closed fingertips meet a 4 cm cube's lower half)
PUSH_BACKOFF = 0.05  # TCP starts a push this far behind the cube centre


def push_step(tcp: np.ndarray, cube: np.ndarray, goal: np.ndarray, hover_z: float) -> np.ndarray:
    """One closed-loop action pushing ``cube`` towards ``goal`` (xy) with a closed gripper.

    Stateless: a function of where the TCP is relative to the cube, so it recovers from any state. Out
    of contact position it rises to ``hover_z``, travels behind the cube (seen from the goal), descends
    and pushes, steering out the TCP's lateral offset; at the goal it backs off upwards.
    """
    d = goal[:2] - cube[:2]
    dist = float(np.linalg.norm(d))
    if dist < 0.015:  # done: back off upwards
        return np.r_[_move(tcp, [tcp[0], tcp[1], hover_z]), -1.0]
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
    low = tcp[2] < hover_z - 0.02
    if dxy > (0.02 if low else 0.008):
        if low:
            return np.r_[_move(tcp, [tcp[0], tcp[1], hover_z]), -1.0]
        return np.r_[_move(tcp, [behind[0], behind[1], hover_z]), -1.0]
    return np.r_[_move(tcp, [behind[0], behind[1], PUSH_Z]), -1.0]
