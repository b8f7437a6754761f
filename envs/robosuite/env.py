"""robosuite 1.5 (MuJoCo) behind the groundflow observation convention.

    env = envs.make("robosuite/Lift")                                  # state only
    env = envs.make("robosuite/Lift", cameras=("agentview",), image_size=128)

Robot: Panda. Default controller ``OSC_POSE`` (robosuite's delta end-effector controller), so a
scripted expert only has to say where the gripper should go. Action layout (float32, in [-1, 1]):

    OSC_POSE     (7,): [dx, dy, dz, dax, day, daz, grip]
    OSC_POSITION (4,): [dx, dy, dz, grip]

``dx..dz`` move the end-effector target relative to its current position in the robot base
frame (1.0 = 5 cm per control step at 20 Hz); ``dax..daz`` rotate it by an axis-angle in the base
frame (1.0 = 0.5 rad per step); ``grip`` -1 opens, +1 closes the gripper.

State: robosuite's ``robot0_proprio-state`` (50: joint pos/cos/sin/vel/acc, eef pos/quat, gripper
qpos/qvel) followed by its ``object-state`` (task specific, fixed per task); ``env.state_layout``
names every slice. Images: rendered with MuJoCo's cheap settings (no multisampling, shadows or
reflections; see PLATFORM.md) and flipped to row 0 = top.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np

from envs import platform_setup
from envs.base import GroundflowEnv, Obs
from envs.errors import InstructionError, InvalidOptionError
from envs.physics import MujocoPhysics
from envs.suite import normalize

TASKS: dict[str, dict[str, Any]] = {
    # task -> robosuite env name, canonical instruction, default episode length (steps at 20 Hz)
    "Lift": {"rs_env": "Lift", "instruction": "lift the red cube", "max_episode_steps": 200},
    "Stack": {"rs_env": "Stack", "instruction": "stack the red cube on the green cube",
              "max_episode_steps": 300},
    "PickPlaceCan": {"rs_env": "PickPlaceCan", "instruction": "put the can in its bin",
                     "max_episode_steps": 300},
    "Door": {"rs_env": "Door", "instruction": "open the door", "max_episode_steps": 300},
    "NutAssemblySquare": {"rs_env": "NutAssemblySquare",
                          "instruction": "put the square nut on the square peg", "max_episode_steps": 400},
}
CONTROLLERS = ("OSC_POSE", "OSC_POSITION")
STATE_KEYS = ("robot0_proprio-state", "object-state")
_OPTIONS = ("task", "cameras", "image_size", "max_episode_steps", "controller", "control_freq",
            "reward_shaping", "initialization_noise")


def import_robosuite() -> types.ModuleType:
    """Import robosuite quietly, with EGL rendering set up first.

    robosuite logs several warnings on import (no private macro file, no robosuite_models, no
    mink IK); none concern a Panda. An in-memory ``robosuite.macros_private`` (the hook robosuite
    offers for local settings) lowers its console log level to errors.
    """
    platform_setup.setup()
    if "robosuite" not in sys.modules and "robosuite.macros_private" not in sys.modules:
        private = types.ModuleType("robosuite.macros_private")
        private.CONSOLE_LOGGING_LEVEL = "ERROR"
        sys.modules["robosuite.macros_private"] = private
    import robosuite
    return robosuite


def controller_config(controller: str) -> dict:
    """robosuite 1.5 composite controller config for a Panda arm with ``controller`` on the arm."""
    if controller not in CONTROLLERS:
        raise InvalidOptionError(f"unknown controller {controller!r}; valid controllers: {list(CONTROLLERS)}")
    rs = import_robosuite()
    from robosuite.controllers import load_part_controller_config
    cfg = rs.load_composite_controller_config(controller="BASIC", robot="Panda")
    if controller != cfg["body_parts"]["right"]["type"]:
        part = load_part_controller_config(default_controller=controller)
        part["gripper"] = cfg["body_parts"]["right"].get("gripper", {"type": "GRIP"})
        cfg["body_parts"]["right"] = part
    return cfg


def enable_fast_rendering(sim: Any) -> None:
    """Turn off multisampling, shadows and reflections in robosuite's offscreen context.

    ``offsamples`` is read when the MuJoCo render context is created, so the context made by
    robosuite at construction is rebuilt once here (~10x faster on CPU renderers).
    """
    import mujoco
    ctx = sim._render_context_offscreen
    if ctx is None:
        return
    sim.model.vis.quality.offsamples = 0
    ctx.gl_ctx.make_current()
    ctx.con.free()
    ctx._set_mujoco_context_and_buffers()
    ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
    ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0


def check_cameras(cameras: Any, valid: list[str]) -> tuple[str, ...]:
    if isinstance(cameras, str):
        cameras = (cameras,)
    cameras = tuple(cameras or ())
    bad = [c for c in cameras if c not in valid]
    if bad:
        raise InvalidOptionError(f"unknown camera(s) {bad}; valid cameras: {valid}")
    return cameras


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise InvalidOptionError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class RobosuiteEnv(GroundflowEnv):
    """A constructed robosuite env (``rs_env``) seen through the observation convention.

    Subclasses (the kitchen suite, RoboCasa) override ``_success`` / ``_extra_info`` and
    ``_before_reset`` to add instructions; the stepping, seeding, rendering and simulator
    state logic lives here once.
    """

    backend = "robosuite"

    def __init__(self, rs_env: Any, env_id: str, instruction: str, cameras: tuple[str, ...] = (),
                 image_size: int = 128, max_episode_steps: int = 200):
        self.rs = rs_env
        self.env_id = env_id
        low, high = (np.asarray(x, dtype=np.float32) for x in rs_env.action_spec)
        obs = rs_env._get_observations(force_update=True)
        self.state_layout = self._layout(obs)
        state_dim = sum(n for _, n in self.state_layout)
        super().__init__(state_dim, low, high, cameras=cameras, image_size=image_size,
                         max_episode_steps=max_episode_steps, instruction=instruction)
        if self.cameras:
            enable_fast_rendering(rs_env.sim)
        self._gripper = rs_env.robots[0].gripper["right"]

    # ----- observation pieces ------------------------------------------------------------------
    def _layout(self, obs: dict) -> list[tuple[str, int]]:
        """(name, size) of every slice of the flat state, in order (robosuite's modality order)."""
        layout = []
        for key in STATE_KEYS:
            modality = key.removesuffix("-state")
            names = [n for n, o in self.rs._observables.items()
                     if o.modality == modality and o.is_enabled() and o.is_active()]
            if modality == "robot0_proprio":
                names = [n for n in names if n.startswith("robot0_")]
            layout += [(n, int(np.size(obs[n]))) for n in names]
        return layout

    def _state(self, obs: dict) -> np.ndarray:
        return np.concatenate([np.asarray(obs[k], dtype=np.float32).reshape(-1) for k in STATE_KEYS
                               if k in obs])

    def render_cameras(self) -> dict[str, np.ndarray]:
        """Render every configured camera; rows flipped so row 0 is the top of the image."""
        images = {}
        if not self.cameras:
            return images
        sim = self.rs.sim
        sim._render_context_offscreen.gl_ctx.make_current()  # several envs may share the process
        for cam in self.cameras:
            img = sim.render(width=self.image_size, height=self.image_size, camera_name=cam)
            images[cam] = np.ascontiguousarray(img[::-1])
        return images

    # ----- hooks for subclasses ----------------------------------------------------------------
    def _before_reset(self, options: dict) -> None:
        """Single tasks take no reset options but accept their own instruction (uniform eval code)."""
        instr = options.pop("instruction", None)
        if instr is not None and normalize(instr) != normalize(self.instruction):
            raise InstructionError(f"{self.env_id}: instruction {instr!r} is not this task's; "
                                   f"valid instructions: {[self.instruction]}")
        if options:
            raise InvalidOptionError(f"{self.env_id}: unknown reset option(s) {sorted(options)}; "
                                     "valid: ['instruction']")

    def _success(self) -> bool:
        return bool(self.rs._check_success())

    def _extra_info(self) -> dict:
        return {}

    # ----- GroundflowEnv hooks -----------------------------------------------------------------
    def _reseed(self, seed: int | None) -> None:
        """Reseed robosuite's generator in place: its samplers hold references to that object."""
        if seed is not None:
            self.rs.rng.bit_generator.state = np.random.default_rng(seed).bit_generator.state

    def _reset(self, seed, options):
        self._reseed(seed)
        self._before_reset(dict(options))
        obs = self.rs.reset()
        return self._state(obs), self.render_cameras(), {"success": self._success(), **self._extra_info()}

    def raw_step(self, action: np.ndarray):
        out = self.rs.step(np.asarray(action, dtype=np.float64))
        return out, self.render_cameras()

    forward_after_step = False
    """recompute kinematics after each step: MuJoCo's positions then match the integrated state, so
    an observation equals ``observe()`` after ``set_sim_state`` (newer envs; older datasets of the
    kitchen suite were recorded without it)"""

    def _step(self, action):
        _, reward, _, _ = self.rs.step(np.asarray(action, dtype=np.float64))
        if self.forward_after_step:
            self.rs.sim.forward()
        # Sample every observable now: robosuite samples them on a clock that is not part of the
        # simulator state, so after set_sim_state its samples would shift by a substep.
        obs = self.rs._get_observations(force_update=True)
        success = self._success()
        info = {"success": success, **self._extra_info()}
        return self._state(obs), self.render_cameras(), float(reward), False, False, info

    def observe(self) -> Obs:
        """The current observation (e.g. after ``set_sim_state``)."""
        obs = self.rs._get_observations(force_update=True)
        return self._obs(self._state(obs), self.render_cameras())

    def get_obs(self) -> Obs:
        """Same as ``observe`` (the older name)."""
        return self.observe()

    def evaluate_success(self) -> bool | None:
        """robosuite's own success test of the constructed env (the kitchen suite's: the commanded task)."""
        return bool(self.rs._check_success())

    def make_physics(self, bodies: tuple[str, ...] | None) -> MujocoPhysics | None:
        """robosuite's MuJoCo model (default bodies: all but the world)."""
        return MujocoPhysics(self.rs.sim.model._model, bodies)

    # ----- simulator state ---------------------------------------------------------------------
    def get_sim_state(self) -> np.ndarray:
        """MuJoCo integration state (time, qpos, qvel, act, warm start, ctrl, ...) + gripper command.

        The Panda gripper integrates its command across steps (``current_action``), so it is
        part of the state for an exact restore.
        """
        import mujoco
        m, d = self.rs.sim.model._model, self.rs.sim.data._data
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        x = np.empty(mujoco.mj_stateSize(m, spec), dtype=np.float64)
        mujoco.mj_getState(m, d, x, spec)
        return np.concatenate([x, self._gripper_command()])

    def _gripper_command(self) -> np.ndarray:
        # robosuite's Panda gripper starts with a (1,) command that broadcasts to (2,) on the first
        # action; store it at the broadcast size so every step's state has the same length.
        ca = np.asarray(self._gripper.current_action, dtype=np.float64).reshape(-1)
        return np.repeat(ca, 2) if ca.size == 1 else ca

    def set_sim_state(self, state: np.ndarray) -> None:
        import mujoco
        m, d = self.rs.sim.model._model, self.rs.sim.data._data
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        n = mujoco.mj_stateSize(m, spec)
        x = np.asarray(state, dtype=np.float64).reshape(-1)
        ng = int(self._gripper_command().size)
        if x.shape != (n + ng,):
            raise InvalidOptionError(f"{self.env_id}: sim state has shape {x.shape}, expected ({n + ng},) "
                                     "(from get_sim_state of the same env)")
        mujoco.mj_setState(m, d, x[:n], spec)
        self._gripper.current_action = x[n:].copy()
        self.rs.sim.forward()
        self.rs._get_observations(force_update=True)

    def close(self) -> None:
        rs = getattr(self, "rs", None)
        if rs is not None:
            rs.close()
            self.rs = None


def make_robosuite_env(rs_name: str | type, controller: str = "OSC_POSE", cameras: tuple[str, ...] = (),
                       **kwargs: Any) -> Any:
    """``robosuite.make`` with the settings every groundflow robosuite env shares.

    Our own render call draws the cameras (so the flip and fast settings are ours), the
    episode length is enforced by GroundflowEnv, and ``hard_reset=False`` keeps one MuJoCo model
    for the env's life (resets are then cheap and restore exactly).
    """
    rs = import_robosuite()
    factory = rs_name if isinstance(rs_name, type) else (lambda **kw: rs.make(rs_name, **kw))
    # seed=0: what robosuite draws once at construction (e.g. Lift's cube size) is the same in
    # every process, so a reset seed alone fixes an episode; unseeded resets then draw fresh.
    env = factory(robots="Panda", controller_configs=controller_config(controller),
                  has_renderer=False, has_offscreen_renderer=bool(cameras), use_camera_obs=False,
                  use_object_obs=True, ignore_done=True, hard_reset=False, horizon=10**9, seed=0, **kwargs)
    env.rng.bit_generator.state = np.random.default_rng().bit_generator.state
    return env


def _camera_names(rs_env: Any) -> list[str]:
    m = rs_env.sim.model
    return [m.camera_id2name(i) for i in range(m.ncam)]


def make_robosuite(env_id: str = "", task: str = "Lift", cameras: Any = (), image_size: int = 128,
                   max_episode_steps: int | None = None, controller: str = "OSC_POSE",
                   **options: Any) -> RobosuiteEnv:
    """Make a robosuite 1.5 task (Panda) speaking the groundflow observation convention.

    Extra options: ``control_freq`` (Hz, default 20), ``reward_shaping`` (dense reward, default
    False), ``initialization_noise`` (robosuite's robot joint noise dict, or None).
    """
    bad = sorted(set(options) - set(_OPTIONS))
    if bad:
        raise InvalidOptionError(f"{env_id or 'robosuite'}: unknown option(s) {bad}; valid options: {list(_OPTIONS)}")
    if task not in TASKS:
        raise InvalidOptionError(f"unknown robosuite task {task!r}; valid tasks: {list(TASKS)}")
    if controller not in CONTROLLERS:
        raise InvalidOptionError(f"unknown controller {controller!r}; valid controllers: {list(CONTROLLERS)}")
    image_size = check_positive_int("image_size", image_size)
    spec = TASKS[task]
    steps = check_positive_int("max_episode_steps",
                               spec["max_episode_steps"] if max_episode_steps is None else max_episode_steps)
    cams = (cameras,) if isinstance(cameras, str) else tuple(cameras or ())
    kwargs = {k: options[k] for k in ("control_freq", "reward_shaping", "initialization_noise") if k in options}
    rs_env = make_robosuite_env(spec["rs_env"], controller=controller, cameras=cams, **kwargs)
    try:
        cams = check_cameras(cams, _camera_names(rs_env))
    except InvalidOptionError:
        rs_env.close()
        raise
    env = RobosuiteEnv(rs_env, env_id or f"robosuite/{task}", spec["instruction"], cams, image_size, steps)
    env.task = task
    env.controller = controller
    return env
