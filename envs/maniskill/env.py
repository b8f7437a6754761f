"""ManiSkill3 backend (SAPIEN, CPU simulation): standard tasks, groundflow's own tasks, experts.

The raw ManiSkill env is batched (leading dim 1, torch tensors); this wrapper speaks numpy and
the groundflow observation convention. Standard tasks default to ``pd_joint_pos`` control
(the space ManiSkill's motion-planning experts act in); groundflow's own tasks default to
``pd_ee_delta_pos`` (their scripted experts act in end-effector deltas).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs import platform_setup
from envs.base import GroundflowEnv, Obs
from envs.errors import InvalidOptionError, MissingAssetsError
from envs.maniskill.experts import MotionPlanningExpert, ScriptedPushCubeExpert
from envs.physics import ManiSkillPhysics

# Episode limits sized to the motion-planning experts (ManiSkill's own 50-step limits are
# tuned for RL with ee control; the planner's joint paths take longer).
DEFAULT_STEPS = {"PushCube-v1": 100, "PullCube-v1": 100, "PickCube-v1": 150, "StackCube-v1": 250,
                 "PegInsertionSide-v1": 400, "PlugCharger-v1": 400, "LiftPegUpright-v1": 250}
INSTRUCTIONS = {
    "PushCube-v1": "push the cube to the goal region",
    "PullCube-v1": "pull the cube back to the goal region",
    "PickCube-v1": "pick up the cube and move it to the goal",
    "StackCube-v1": "stack the red cube on the green cube",
    "PegInsertionSide-v1": "insert the peg into the hole",
    "PlugCharger-v1": "plug the charger into the receptacle",
    "LiftPegUpright-v1": "lift the peg upright",
}
CONTROL_MODES = ("pd_joint_pos", "pd_joint_delta_pos", "pd_ee_delta_pos", "pd_ee_delta_pose")


def _import_maniskill():
    platform_setup.setup()
    try:
        import mani_skill.envs  # noqa: F401  (registers the standard tasks)
    except ImportError as e:  # pragma: no cover - install problem
        raise MissingAssetsError(f"mani_skill is not importable ({e}); run `make setup`") from e
    # Lazy like mani_skill above: the task modules load mani_skill and SAPIEN (slow) and register our tasks.
    import envs.maniskill.tasks  # noqa: F401


def make_maniskill(env_id: str, ms_id: str, **options: Any) -> "ManiSkillEnv":
    return ManiSkillEnv(env_id, ms_id, **options)


class ManiSkillEnv(GroundflowEnv):
    backend = "maniskill"

    def __init__(self, env_id: str, ms_id: str, cameras: tuple[str, ...] | list[str] = (),
                 image_size: int = 128, control_mode: str | None = None,
                 max_episode_steps: int | None = None, instruction: str | None = None,
                 reward_mode: str | None = None, **task_options: Any):
        _import_maniskill()
        import gymnasium as gym
        from mani_skill.utils.registration import REGISTERED_ENVS

        if ms_id not in REGISTERED_ENVS:
            raise InvalidOptionError(f"{env_id}: ManiSkill env {ms_id!r} is not registered")
        ms_spec = REGISTERED_ENVS[ms_id]
        own_task = ms_id.startswith("Groundflow")
        control_mode = control_mode or ("pd_ee_delta_pos" if own_task else "pd_joint_pos")
        if control_mode not in CONTROL_MODES:
            raise InvalidOptionError(f"{env_id}: control_mode {control_mode!r} not supported; valid: {CONTROL_MODES}")
        if not 16 <= int(image_size) <= 1024:
            raise InvalidOptionError(f"{env_id}: image_size must be in [16, 1024], got {image_size}")
        cameras = tuple(cameras)
        obs_mode = "state+rgb" if cameras else "state"
        if own_task:  # build only the cameras asked for; state-only envs keep the one they always had
            task_options.setdefault("sensor_uids", cameras or ("base_camera",))
        try:
            raw = gym.make(ms_id, obs_mode=obs_mode, sim_backend="cpu", render_backend="cpu",
                           control_mode=control_mode, reward_mode=reward_mode,
                           sensor_configs=dict(width=int(image_size), height=int(image_size)),
                           **task_options).unwrapped
        except TypeError as e:
            raise InvalidOptionError(f"{env_id}: bad option for {ms_id}: {e}") from e
        self.raw = raw
        self.ms_id = ms_id
        self.control_mode = control_mode
        if cameras:
            valid = tuple(raw._sensors.keys()) if hasattr(raw, "_sensors") else ()
            bad = [c for c in cameras if c not in valid]
            if bad:
                raise InvalidOptionError(f"{env_id}: unknown camera(s) {bad}; valid cameras: {list(valid)}")
        self.suite = getattr(raw, "suite", None)
        steps = max_episode_steps or getattr(raw, "default_max_steps", None) or DEFAULT_STEPS.get(
            ms_id, ms_spec.max_episode_steps or 100)
        obs, _ = raw.reset(seed=0)
        state = self._state_of(obs)
        space = raw.single_action_space if hasattr(raw, "single_action_space") else raw.action_space
        default_instr = self.suite.tasks[0].instruction if self.suite else INSTRUCTIONS.get(ms_id, ms_id)
        super().__init__(state_dim=state.shape[0], action_low=space.low.reshape(-1),
                         action_high=space.high.reshape(-1), cameras=cameras, image_size=image_size,
                         max_episode_steps=steps, instruction=instruction or default_instr)
        self.env_id = env_id
        self.state_layout = self._layout_of(raw, state.shape[0])
        self._fixed_instruction = instruction
        self._last_seed: int | None = None

    # ----- conversions ----------------------------------------------------------------------
    @staticmethod
    def _layout_of(raw: Any, state_dim: int) -> list[tuple[str, int]] | None:
        """Names of the flat "state" observation's slices: ManiSkill flattens its state dict
        (agent/qpos, agent/qvel, extra/...) in order; None if that no longer adds up."""
        try:
            tree = raw._get_obs_state_dict(raw.get_info())
        except Exception:  # a private API: a ManiSkill version without it just has no layout
            return None
        layout: list[tuple[str, int]] = []

        def walk(d: dict, prefix: str) -> None:
            for k, v in d.items():
                if isinstance(v, dict):
                    walk(v, f"{prefix}{k}/")
                else:
                    layout.append((prefix + k, int(np.prod(v.shape[1:]))))
        walk(tree, "")
        return layout if sum(n for _, n in layout) == state_dim else None

    @staticmethod
    def _state_of(obs: Any) -> np.ndarray:
        x = obs["state"] if isinstance(obs, dict) else obs
        return x.detach().cpu().numpy().reshape(-1).astype(np.float32)

    def _images_of(self, obs: Any) -> dict:
        if not self.cameras:
            return {}
        return {c: obs["sensor_data"][c]["rgb"][0].detach().cpu().numpy() for c in self.cameras}

    @staticmethod
    def _info_of(info: dict) -> dict:
        out: dict[str, Any] = {}
        for k, v in info.items():
            if hasattr(v, "detach"):
                v = v.detach().cpu().numpy()
                v = v.reshape(v.shape[1:]) if v.ndim >= 1 and v.shape[0] == 1 else v
                v = v.item() if v.ndim == 0 else v
            out[k] = v
        return out

    # ----- hooks ----------------------------------------------------------------------------
    @property
    def instructions(self) -> list[str]:
        return self.suite.instructions if self.suite else [self.instruction]

    def _reset(self, seed, options):
        raw_opts: dict[str, Any] = {}
        if self.suite is not None:
            key = options.get("task_id", options.get("instruction", self._fixed_instruction))
            task = self.suite.task(key if key is not None else 0)
            self.task_id = task.task_id
            self.instruction = options.get("instruction") or self._fixed_instruction or task.instruction
            raw_opts["task_id"] = task.task_id
            for k in ("layout",):
                if k in options:
                    raw_opts[k] = options[k]
        elif "instruction" in options:
            self.instruction = options["instruction"]
        for k, v in options.items():
            if k not in ("task_id", "instruction", "layout"):
                raw_opts[k] = v
        self._last_seed = seed
        obs, info = self.raw.reset(seed=seed, options=raw_opts)
        return self._state_of(obs), self._images_of(obs), self._info_of(info)

    def _step(self, action):
        import torch
        obs, reward, terminated, truncated, info = self.raw.step(torch.from_numpy(action)[None])
        info = self._info_of(info)
        return (self._state_of(obs), self._images_of(obs), float(np.asarray(reward).reshape(-1)[0]),
                bool(np.asarray(terminated).reshape(-1)[0]), bool(np.asarray(truncated).reshape(-1)[0]), info)

    def raw_step(self, action: np.ndarray):
        import torch
        return self.raw.step(torch.from_numpy(np.asarray(action, np.float32))[None])

    def get_sim_state(self) -> np.ndarray:
        return self.raw.get_state().detach().cpu().numpy().reshape(-1).astype(np.float32)

    def set_sim_state(self, state: np.ndarray) -> None:
        import torch
        x = torch.as_tensor(np.asarray(state, dtype=np.float32)).reshape(1, -1)
        self.raw.set_state(x)

    def observe(self) -> Obs:
        """ManiSkill has no observe of its own: ask the raw env for its observation now."""
        o = self.raw.get_obs()
        return self._obs(self._state_of(o), self._images_of(o))

    def evaluate_success(self) -> bool:
        return bool(np.asarray(self.raw.evaluate()["success"]).reshape(-1)[0])

    def make_physics(self, bodies: tuple[str, ...] | None) -> ManiSkillPhysics:
        """Every non-kinematic actor outside the robot (or those named in ``bodies``) and the robot's drives."""
        return ManiSkillPhysics(self, bodies)

    def render_frame(self) -> np.ndarray:
        """An RGB frame of the scene from ManiSkill's human render camera (for videos)."""
        img = self.raw.render_rgb_array() if hasattr(self.raw, "render_rgb_array") else self.raw.render()
        return img[0].detach().cpu().numpy() if hasattr(img, "detach") else np.asarray(img)

    def make_expert(self, **options: Any):
        if hasattr(self.raw, "make_expert"):
            return self.raw.make_expert(**options)
        if self.ms_id == "PushCube-v1" and self.control_mode == "pd_ee_delta_pos":  # closed loop, no planner
            return ScriptedPushCubeExpert(**options)
        return MotionPlanningExpert(self.ms_id, **options)

    def close(self):
        self.raw.close()
