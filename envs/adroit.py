"""Adroit hand tasks (gymnasium-robotics ``AdroitHand*-v1`` on MuJoCo) behind the groundflow convention.

    env = envs.make("adroit/door", cameras=("vil_camera",))
    obs, info = env.reset(seed=0)
    expert = env.make_expert()           # DAPG Gaussian MLP from ../shared/data/adroit
    expert.reset(env, obs); obs, r, term, trunc, info = env.step(expert.act(obs))

Why a wrapper and not ``gym.make``: the upstream envs randomize the scene by editing the MuJoCo
*model* at reset (door position, nail height, pen target, ball/target position), so neither
``qpos/qvel`` nor upstream ``get_env_state`` (wrong for relocate) restores an episode exactly.
``get_sim_state`` here is MuJoCo's full integration state plus those model parameters.
Cameras render through one ``mujoco.Renderer`` with PLATFORM.md's CPU settings (no multisampling,
shadows or reflections): ~240 fps at 128 px on llvmpipe instead of ~8 with the defaults.
"""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from envs import platform_setup
from envs.base import GroundflowEnv, Obs
from envs.errors import InvalidOptionError, InvalidStateError, MissingAssetsError
from envs.physics import MujocoPhysics

platform_setup.setup()
import mujoco  # noqa: E402  (after platform_setup: MUJOCO_GL=egl)

FREE_CAMERA = "free"  # gymnasium's default viewpoint (distance 1.5, azimuth 90), not in the XML
DEFAULT_DATA_DIR = platform_setup.ROOT.parent / "shared" / "data" / "adroit"
RESET_OPTIONS = ("instruction", "sim_state", "initial_state_dict")
MAKE_OPTIONS = ("reward_type",)
REWARD_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class AdroitTask:
    name: str
    module: str  # gymnasium_robotics.envs.adroit_hand.<module>
    cls: str
    instruction: str
    state_dim: int
    action_dim: int
    # model parameters the upstream reset randomizes: (get, set) on the unwrapped env
    get_params: Callable[[Any], np.ndarray]
    set_params: Callable[[Any, np.ndarray], None]
    n_params: int
    # names of the observation's slices (GroundflowEnv.state_layout), where written down: an image
    # policy hides the object slices (``--ignore-state 'door/*'``) and reads the scene from pixels
    layout: tuple[tuple[str, int], ...] | None = None


def _set_door(u: Any, x: np.ndarray) -> None:
    u.model.body_pos[u.door_body_id] = x


def _set_hammer(u: Any, x: np.ndarray) -> None:
    u.model.body_pos[u.target_body_id] = x


def _set_pen(u: Any, x: np.ndarray) -> None:
    u.model.body_quat[u.target_obj_body_id] = x[:4]
    u.pen_length, u.tar_length = float(x[4]), float(x[5])


def _set_relocate(u: Any, x: np.ndarray) -> None:
    u.model.body_pos[u.obj_body_id] = x[:3]
    u.model.site_pos[u.target_obj_site_id] = x[3:6]


TASKS: dict[str, AdroitTask] = {
    "door": AdroitTask("door", "adroit_door", "AdroitHandDoorEnv", "open the door", 39, 28,
                       lambda u: u.model.body_pos[u.door_body_id].copy(), _set_door, 3,
                       (("hand/qpos", 27), ("door/latch", 1), ("door/hinge", 1), ("hand/palm_pos", 3),
                        ("door/handle_pos", 3), ("door/palm_to_handle", 3), ("door/open", 1))),
    "hammer": AdroitTask("hammer", "adroit_hammer", "AdroitHandHammerEnv",
                         "hammer the nail into the board", 46, 26,
                         lambda u: u.model.body_pos[u.target_body_id].copy(), _set_hammer, 3),
    "pen": AdroitTask("pen", "adroit_pen", "AdroitHandPenEnv",
                      "rotate the pen to match the target orientation", 45, 24,
                      lambda u: np.concatenate([u.model.body_quat[u.target_obj_body_id],
                                                [u.pen_length, u.tar_length]]), _set_pen, 6),
    "relocate": AdroitTask("relocate", "adroit_relocate", "AdroitHandRelocateEnv",
                           "move the ball to the target", 39, 30,
                           lambda u: np.concatenate([u.model.body_pos[u.obj_body_id],
                                                     u.model.site_pos[u.target_obj_site_id]]),
                           _set_relocate, 6),
}

_STATE_SPEC = mujoco.mjtState.mjSTATE_INTEGRATION
_LIVE_ENVS: "weakref.WeakSet[AdroitEnv]" = weakref.WeakSet()
_atexit_registered = False


def _close_renderers() -> None:
    """Free GL contexts before EGL is terminated at exit; otherwise every env still open prints
    an EGLError traceback. mujoco.egl registers its eglTerminate when it creates the first
    context, so this is registered right after that (atexit runs last-registered first)."""
    for env in list(_LIVE_ENVS):
        env._close_renderer()


def _upstream_env(task: AdroitTask, reward_type: str) -> Any:
    """Construct the gymnasium-robotics env class directly (no TimeLimit/checker wrappers)."""
    import contextlib
    import importlib
    import io
    # gymnasium-robotics prints a notice on import that Dense-v1 rewards changed in 1.2.1; our
    # tasks are judged by info["success"], which did not change, so keep the console clean.
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        mod = importlib.import_module(f"gymnasium_robotics.envs.adroit_hand.{task.module}")
    return getattr(mod, task.cls)(reward_type=reward_type)


class AdroitEnv(GroundflowEnv):
    """One Adroit task; ``state`` is the upstream observation vector as float32."""

    backend = "adroit"

    def __init__(self, env_id: str, task: AdroitTask, cameras: tuple[str, ...] = (),
                 image_size: int = 128, max_episode_steps: int = 200, reward_type: str = "dense"):
        self.task = task
        self.env_id = env_id
        self._u = _upstream_env(task, reward_type)
        model = self._u.model
        valid_cams = self.camera_names(model)
        for c in cameras:
            if c not in valid_cams:
                raise InvalidOptionError(f"{env_id}: unknown camera {c!r}; valid cameras: {valid_cams}")
        super().__init__(task.state_dim, self._u.action_space.low, self._u.action_space.high,
                         cameras=cameras, image_size=image_size, max_episode_steps=max_episode_steps,
                         instruction=task.instruction)
        if self._u.observation_space.shape != (task.state_dim,) or self._u.action_space.shape != (task.action_dim,):
            raise RuntimeError(f"{env_id}: gymnasium-robotics changed its spaces: obs "
                               f"{self._u.observation_space.shape}, action {self._u.action_space.shape}")
        self.state_layout = list(task.layout) if task.layout else None
        self._renderer: mujoco.Renderer | None = None
        self._free_cam: mujoco.MjvCamera | None = None
        self._state_size = mujoco.mj_stateSize(model, _STATE_SPEC)

    # ----- cameras ---------------------------------------------------------------------------
    @staticmethod
    def camera_names(model: mujoco.MjModel) -> list[str]:
        return [model.camera(i).name for i in range(model.ncam)] + [FREE_CAMERA]

    @property
    def valid_cameras(self) -> list[str]:
        return self.camera_names(self._u.model)

    def _render(self, camera: str) -> np.ndarray:
        global _atexit_registered
        if self._renderer is None:
            m = self._u.model
            # PLATFORM.md: on llvmpipe 128 px goes from ~8 to ~240 fps; offsamples before the context
            m.vis.quality.offsamples = 0
            m.vis.global_.offwidth = max(m.vis.global_.offwidth, self.image_size)
            m.vis.global_.offheight = max(m.vis.global_.offheight, self.image_size)
            try:
                self._renderer = mujoco.Renderer(m, self.image_size, self.image_size)
            except Exception as e:  # mujoco.FatalError / GL errors: say what to do
                gl = getattr(mujoco.gl_context.GLContext, "__module__", None)
                raise RuntimeError(
                    f"{self.env_id}: cannot create a MuJoCo renderer ({e}). MuJoCo picked its GL backend "
                    f"{gl!r} when it was first imported (MUJOCO_GL={os.environ.get('MUJOCO_GL')!r}). "
                    "Headless rendering needs MUJOCO_GL=egl set before `import mujoco`: call "
                    "envs.platform_setup.setup() before anything imports mujoco, or export MUJOCO_GL=egl."
                ) from e
            _LIVE_ENVS.add(self)
            if not _atexit_registered:
                atexit.register(_close_renderers)
                _atexit_registered = True
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
            cam = mujoco.MjvCamera()
            mujoco.mjv_defaultFreeCamera(m, cam)
            cam.distance, cam.azimuth = 1.5, 90.0  # gymnasium-robotics' DEFAULT_CAMERA_CONFIG
            self._free_cam = cam
        cam_arg: Any = self._free_cam if camera == FREE_CAMERA else camera
        self._renderer.update_scene(self._u.data, camera=cam_arg)
        return self._renderer.render()

    def _images(self) -> dict[str, np.ndarray]:
        return {c: self._render(c) for c in self.cameras}

    def render(self) -> np.ndarray:
        """RGB frame of the first configured camera (the free camera if none)."""
        return self._render(self.cameras[0] if self.cameras else FREE_CAMERA)

    # ----- hooks -----------------------------------------------------------------------------
    def _reset(self, seed: int | None, options: dict) -> tuple[np.ndarray, dict, dict]:
        unknown = sorted(set(options) - set(RESET_OPTIONS))
        if unknown:
            raise InvalidOptionError(f"{self.env_id}: unknown reset option(s) {unknown}; "
                                     f"valid reset options: {list(RESET_OPTIONS)}")
        # a one-task env can be commanded with a paraphrase (for evaluation); default otherwise
        self.instruction = options.get("instruction", self.task.instruction)
        obs, _ = self._u.reset(seed=seed)
        if "sim_state" in options:
            self.set_sim_state(options["sim_state"])
            obs = self._u._get_obs()
        elif "initial_state_dict" in options:
            self._set_initial_state_dict(options["initial_state_dict"])
            obs = self._u._get_obs()
        return obs, self._images(), {"success": False}

    def raw_step(self, action: np.ndarray):
        out = self._u.step(np.asarray(action, np.float64))
        return out, self._images()

    def _step(self, action: np.ndarray) -> tuple[np.ndarray, dict, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self._u.step(action.astype(np.float64))
        return obs, self._images(), float(reward), bool(terminated), bool(truncated), \
            {"success": bool(info["success"])}

    def _set_initial_state_dict(self, d: Any) -> None:
        """Upstream ``initial_state_dict`` (qpos, qvel, door_body_pos) — door only, for human demos."""
        if self.task.name != "door":
            raise InvalidOptionError(f"{self.env_id}: reset option 'initial_state_dict' is supported for "
                                     "adroit/door only (upstream relocate's is wrong); use 'sim_state'")
        keys = ("qpos", "qvel", "door_body_pos")
        if not isinstance(d, dict) or set(d) != set(keys):
            raise InvalidOptionError(f"{self.env_id}: initial_state_dict needs exactly the keys {list(keys)}, "
                                     f"got {sorted(d) if isinstance(d, dict) else type(d).__name__}")
        m = self._u.model
        shapes = {"qpos": (m.nq,), "qvel": (m.nv,), "door_body_pos": (3,)}
        arrs = {k: np.asarray(d[k], dtype=np.float64) for k in keys}
        for k, a in arrs.items():
            if a.shape != shapes[k] or not np.all(np.isfinite(a)):
                raise InvalidStateError(f"{self.env_id}: initial_state_dict[{k!r}] must be finite with "
                                        f"shape {shapes[k]}, got shape {a.shape}")
        self.task.set_params(self._u, arrs["door_body_pos"])
        self._u.set_state(arrs["qpos"], arrs["qvel"])

    # ----- simulator state -------------------------------------------------------------------
    @property
    def sim_state_size(self) -> int:
        """MuJoCo mjSTATE_INTEGRATION size + the task's randomized model parameters."""
        return self._state_size + self.task.n_params

    def get_sim_state(self) -> np.ndarray:
        """Flat float64: [mj_getState(mjSTATE_INTEGRATION) (time, qpos, qvel, act, warmstart,
        ctrl, mocap, ...), task params (door/board/ball body pos, pen target quat, goal site)]."""
        x = np.empty(self._state_size, dtype=np.float64)
        mujoco.mj_getState(self._u.model, self._u.data, x, _STATE_SPEC)
        return np.concatenate([x, np.asarray(self.task.get_params(self._u), dtype=np.float64)])

    def set_sim_state(self, state: np.ndarray) -> None:
        """Restore a state of ``get_sim_state``: the same actions then give the same future, bit for bit."""
        x = np.asarray(state, dtype=np.float64).reshape(-1)
        if x.shape != (self.sim_state_size,):
            raise InvalidStateError(f"{self.env_id}: sim state has {x.size} values, expected "
                                    f"{self.sim_state_size} ({self._state_size} MuJoCo + "
                                    f"{self.task.n_params} task parameters)")
        if not np.all(np.isfinite(x)):
            raise InvalidStateError(f"{self.env_id}: sim state contains NaN/inf")
        self.task.set_params(self._u, x[self._state_size:])
        mujoco.mj_setState(self._u.model, self._u.data, x[:self._state_size], _STATE_SPEC)
        mujoco.mj_forward(self._u.model, self._u.data)

    def observe(self) -> Obs:
        """Observation of the current simulator state (e.g. after ``set_sim_state``)."""
        return self._obs(self._u._get_obs(), self._images())

    def evaluate_success(self) -> bool | None:
        """Door: the hinge opened past 1.35 rad (the upstream success test); None for the other tasks."""
        if self.task.name != "door":
            return None
        u = self._u
        return bool(u.data.qpos[u.door_hinge_addrs] >= 1.35)

    def make_physics(self, bodies: tuple[str, ...] | None) -> MujocoPhysics:
        """The gymnasium-robotics MuJoCo model (default bodies: all but the world)."""
        return MujocoPhysics(self._u.model, bodies)

    # ----- experts ---------------------------------------------------------------------------
    def make_expert(self, noise: float = 0.0, seed: int | None = None) -> "DapgExpert":
        return DapgExpert.load(self.task.name, noise=noise, seed=seed)

    @property
    def unwrapped_mujoco(self) -> Any:
        """The gymnasium-robotics env (model, data) underneath, for privileged access."""
        return self._u

    def _close_renderer(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def close(self) -> None:
        self._close_renderer()
        self._u.close()


def make_adroit(env_id: str | None = None, task: str | None = None, cameras: tuple[str, ...] | str = (),
                image_size: int = 128, max_episode_steps: int = 200, **options: Any) -> AdroitEnv:
    """Factory behind ``envs.make("adroit/<task>")``; options: ``reward_type`` (dense | sparse)."""
    if task is None and env_id is not None and env_id.startswith("adroit/"):
        task = env_id.split("/", 1)[1]
    if task not in TASKS:
        raise InvalidOptionError(f"unknown Adroit task {task!r}; valid tasks: {list(TASKS)}")
    env_id = env_id or f"adroit/{task}"
    unknown = sorted(set(options) - set(MAKE_OPTIONS))
    if unknown:
        raise InvalidOptionError(f"{env_id}: unknown option(s) {unknown}; valid options: "
                                 f"{['task', 'cameras', 'image_size', 'max_episode_steps', *MAKE_OPTIONS]}")
    reward_type = options.get("reward_type", "dense")
    if reward_type not in REWARD_TYPES:
        raise InvalidOptionError(f"{env_id}: unknown reward_type {reward_type!r}; valid: {list(REWARD_TYPES)}")
    if isinstance(cameras, str):
        cameras = (cameras,)
    if not isinstance(image_size, (int, np.integer)) or isinstance(image_size, bool) or not 8 <= image_size <= 4096:
        raise InvalidOptionError(f"{env_id}: image_size must be an int in [8, 4096], got {image_size!r}")
    if not isinstance(max_episode_steps, (int, np.integer)) or max_episode_steps < 1:
        raise InvalidOptionError(f"{env_id}: max_episode_steps must be a positive int, got {max_episode_steps!r}")
    return AdroitEnv(env_id, TASKS[task], tuple(cameras), int(image_size), int(max_episode_steps), reward_type)


# ----- data: DAPG experts and human demos ----------------------------------------------------

def data_dir() -> Path:
    """``$GROUNDFLOW_ADROIT_DIR`` or ``<repo>/../shared/data/adroit``."""
    return Path(os.environ.get("GROUNDFLOW_ADROIT_DIR", DEFAULT_DATA_DIR))


def _data_file(name: str) -> Path:
    d = data_dir()
    p = d / name
    if not p.is_file():
        raise MissingAssetsError(f"Adroit data file {p} not found. The DAPG experts and human demos live in "
                                 f"{d} (adroit_<task>_dapg_expert.npz, adroit_door_human_demos.npz); set "
                                 "GROUNDFLOW_ADROIT_DIR to the folder that holds them.")
    return p


class DapgExpert:
    """DAPG Gaussian MLP policy (two tanh layers); acts with its mean, plus optional scaled noise."""

    KEYS = ("W0", "b0", "W1", "b1", "W2", "b2", "in_shift", "in_scale", "out_shift", "out_scale", "log_std")

    def __init__(self, task: str, params: dict[str, np.ndarray], noise: float = 0.0, seed: int | None = None):
        if not np.isfinite(noise) or noise < 0:
            raise InvalidOptionError(f"expert noise must be a finite number >= 0, got {noise!r}")
        self.task = task
        self.p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
        self.noise = float(noise)
        self.std = np.exp(self.p["log_std"])
        self.rng = np.random.default_rng(seed)
        self.obs_dim = self.p["W0"].shape[1]
        self.action_dim = self.p["W2"].shape[0]

    @classmethod
    def load(cls, task: str, noise: float = 0.0, seed: int | None = None) -> "DapgExpert":
        if task not in TASKS:
            raise InvalidOptionError(f"unknown Adroit task {task!r}; valid tasks: {list(TASKS)}")
        p = _data_file(f"adroit_{task}_dapg_expert.npz")
        with np.load(p) as z:
            missing = [k for k in cls.KEYS if k not in z.files]
            if missing:
                raise MissingAssetsError(f"{p} lacks the keys {missing}")
            return cls(task, {k: z[k] for k in cls.KEYS}, noise=noise, seed=seed)

    def reset(self, env: Any, obs: dict) -> None:
        t = getattr(getattr(env, "unwrapped", env), "task", None)
        if t is not None and getattr(t, "name", self.task) != self.task:
            raise InvalidOptionError(f"DAPG expert for {self.task!r} cannot drive task {t.name!r}")
        self._check(obs)

    def _check(self, obs: dict) -> np.ndarray:
        s = np.asarray(obs["state"], dtype=np.float64).reshape(-1)
        if s.shape != (self.obs_dim,):
            raise InvalidStateError(f"{self.task} expert expects state of shape ({self.obs_dim},), got {s.shape}")
        return s

    def mean_action(self, state: np.ndarray) -> np.ndarray:
        p = self.p
        x = (state - p["in_shift"]) / (p["in_scale"] + 1e-8)
        x = np.tanh(p["W0"] @ x + p["b0"])
        x = np.tanh(p["W1"] @ x + p["b1"])
        x = p["W2"] @ x + p["b2"]
        return x * p["out_scale"] + p["out_shift"]

    def act(self, obs: dict) -> np.ndarray:
        a = self.mean_action(self._check(obs))
        if self.noise > 0:
            a = a + self.noise * self.std * self.rng.standard_normal(a.shape)
        return np.clip(a, -1.0, 1.0).astype(np.float32)


def load_human_door_demos(clip_actions: bool = False) -> list[dict[str, Any]]:
    """The 25 DAPG human teleoperation demos of door, one dict per episode.

    Keys: ``state (T,39) float32, action (T,28) float32, reward (T,) float32`` and the initial
    simulator state ``init_qpos (30,), init_qvel (30,), init_door_body_pos (3,)`` (float64), plus
    ``instruction``. Recorded in the older ``door-v0``, so replay in ``-v1`` is not exact.
    Measured: the stored ``init_qpos/init_qvel`` are all zeros while the first recorded state
    already has the arm moved, so resetting ``adroit/door`` with ``options={"initial_state_dict":
    {...}}`` reproduces the door (handle position exact) but not the hand; replaying the actions
    from there opens the door in 8/25 demos. About 6% of the recorded action entries lie outside
    [-1, 1] (up to 1.37); the env clips them, ``clip_actions=True`` returns what was executed.
    """
    p = _data_file("adroit_door_human_demos.npz")
    with np.load(p) as z:
        ends = z["episode_ends"].astype(np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        obs, rew = z["observations"], z["rewards"]
        act = np.clip(z["actions"], -1.0, 1.0) if clip_actions else z["actions"]
        return [{"state": obs[s:e].astype(np.float32), "action": act[s:e].astype(np.float32),
                 "reward": rew[s:e].astype(np.float32), "init_qpos": z["init_qpos"][i].astype(np.float64),
                 "init_qvel": z["init_qvel"][i].astype(np.float64),
                 "init_door_body_pos": z["init_door_body_pos"][i].astype(np.float64),
                 "instruction": TASKS["door"].instruction}
                for i, (s, e) in enumerate(zip(starts, ends))]
