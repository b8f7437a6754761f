"""Scripted policies that speak the policy interface: bring-up checks for a new robot setup.

``JointTargetPolicy`` plans a chunk that moves the first ``n_joints`` state entries (joint
positions) toward a target at a bounded speed, with the gripper command held. Serving it
(``groundflow serve --scripted joint_target``) exercises server, client, loop, safety and
driver end to end without any learned model, which is what one wants before the first real
checkpoint touches a robot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.errors import InvalidOptionError


@dataclass
class ScriptedConfig:
    state_dim: int
    action_dim: int
    horizon: int = 16
    n_exec: int = 8
    cameras: tuple[str, ...] = ()
    image_size: int = 0
    kind: str = "scripted"
    extra: dict = field(default_factory=dict)


class JointTargetPolicy:
    """Chunk ``a[i] = q + clip(target - q, +-step*(i+1))`` on the joint dims, ``gripper`` after them.

    ``state_index``: where the joint positions sit in the state (default the first n_joints).
    ``wave``: optional amplitude (rad) of a sinusoid added to the target (period ``wave_period``
    steps of the robot's clock), to keep the arm moving for timing and smoothness measurements.
    ``needs_instruction``: False lets observations come without an instruction (it reads none; the
    bring-up server ``groundflow serve --scripted`` serves it so, for a robot run without
    ``--instruction``); True, the default, keeps the protocol's rule, as for a checkpoint.
    """

    def __init__(self, state_dim: int, action_dim: int, target: Any, *, n_joints: int | None = None,
                 step: float = 0.02, gripper: float | None = None, horizon: int = 16, n_exec: int = 8,
                 state_index: int = 0, wave: float = 0.0, wave_period: float = 40.0, delay_s: float = 0.0,
                 needs_instruction: bool = True):
        self.target = np.asarray(target, np.float64).reshape(-1)
        self.n_joints = int(n_joints or len(self.target))
        if len(self.target) != self.n_joints or self.n_joints > action_dim:
            raise InvalidOptionError(f"target has {len(self.target)} entries; need n_joints <= action_dim={action_dim}")
        if not step > 0:
            raise InvalidOptionError(f"step must be > 0 (rad per control step), got {step}")
        self.config = ScriptedConfig(state_dim, action_dim, horizon, n_exec)
        self.step, self.gripper, self.state_index = float(step), gripper, int(state_index)
        self.wave, self.wave_period, self.delay_s = float(wave), float(wave_period), float(delay_s)
        self.needs_instruction = bool(needs_instruction)
        self.calls = 0

    def predict_action_chunk(self, obs: dict[str, Any], **_: Any) -> np.ndarray:
        if self.delay_s > 0:  # stands in for inference time
            import time
            time.sleep(self.delay_s)
        s = np.asarray(obs["state"], np.float64)
        q = s[self.state_index:self.state_index + self.n_joints]
        H, A = self.config.horizon, self.config.action_dim
        i = np.arange(1, H + 1)[:, None]
        target = self.target[None].repeat(H, 0)
        if self.wave:
            phase = 2 * np.pi * (self.calls * self.config.n_exec + i) / self.wave_period
            target = target + self.wave * np.sin(phase)
        delta = np.clip(target - q[None], -self.step * i, self.step * i)
        chunk = np.zeros((H, A), np.float32)
        chunk[:, : self.n_joints] = q[None] + delta
        if A > self.n_joints:
            g = self.gripper if self.gripper is not None else 0.0
            chunk[:, self.n_joints:] = g
        self.calls += 1
        return chunk

    def reset(self) -> None:
        self.calls = 0
