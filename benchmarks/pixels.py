"""Multi-instruction policies from cameras and proprioception, with no object state at run time.

``--suite tabletop`` (12 instructions, random layouts) is seen by a fixed camera that frames the
workspace (``workspace_camera``) and a wrist camera (``hand_camera``), 96 px; ``--suite kitchen``
(robosuite, 6 instructions, random layouts) by robosuite's front camera (``agentview``) and the wrist
camera (``robot0_eye_in_hand``), 96 px, 600 + 600 demos; ``--suite libero_goal`` (10 instructions) by
LIBERO's ``agentview`` and wrist camera, 96 px, 500 + 300 demos from fresh placements with DART noise,
evaluated from LIBERO's own init states of each task; ``--suite pushcube`` by ManiSkill's own ``base_camera``
and a wrist camera, 400 + 400 demos per seed pair from a closed-loop scripted expert (``SUITES``). Methods share the demos
and the evaluation seeds; each is a policy plus, where it sees, a perception head
(``--estimate-state``: object positions estimated from the images and the proprioception; the
simulator's value supervises training only). Control rows read the object state and say so.

Parts (each writes its pieces under benchmarks/results/pixels_parts/, ``merge`` joins them):

- ``collect``: the tabletop's demos (two processes, seeds 0 and 20000, 600 episodes each), and for ``_dr``
  methods 1200 more with the fixed camera moved (up to 8 cm and 8 degrees) and the lights changed
  (up to x1.6 with a tint) per episode, seeds 40000 and 60000; for DAgger methods, episodes where
  the student checkpoint acts and the expert labels (seeds 80000 and 90000);
- ``train``: per method, the policy (the suite's pixel recipe, train/recipes.py; controls and end-to-end rows
  the multitask recipe) then its perception head;
- ``eval``: per method and condition (clean, camera: the fixed camera moved 5 cm and turned 5
  degrees, a fresh direction per episode; lighting: x0.67-1.5 with a tint), episodes from seed
  200000 (never in the demos), 95% Wilson intervals;
- ``protocols``: the grounding protocols on a tabletop checkpoint (P3 swap, P4 mid-episode switch);
- ``latency``: chunk latency on one CPU thread (observation in, chunk out: the head and the policy);
- ``merge``: ``pixels.json`` and ``pixels.md``.

    B=".venv/bin/python benchmarks/pixels.py"
    $B --part collect && $B --part train --methods head && $B --part eval --methods head
    $B --part merge
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, machine, md_table, served  # noqa: E402

# benchmarks/libero.py would shadow the LIBERO package (--suite libero_goal): take this folder (Python
# puts it first for a script) off the path now that `common` is imported
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import tyro  # noqa: E402

EVAL_SEED = 200_000
DAGGER_SEEDS = (80_000, 90_000)
"""DAgger episodes' first seeds, one collecting process each (the demos use 0-62000, evaluation 200000 on)"""
PROTOCOL_SEED = 250_000
"""the grounding protocols' first seed (P3 states from +1000, P4 cases from +2000)"""


@dataclass(frozen=True)
class Suite:
    """Where a suite's pixel policies look and what their heads estimate: the cameras, image size, hidden and
    estimated state of the pixel recipe it names (train/recipes.py), with ``own`` values where its runs differ."""

    env: str
    collect: tuple[str, ...]
    """groundflow collect flags naming the task"""
    fixed: tuple[str, ...]
    """the cameras a bump can move (a wrist camera is rigid on the hand)"""
    recipe: str
    """the `groundflow train --recipe` its policies with a perception head start from"""
    clean_seeds: tuple[int, ...]
    dr_seeds: tuple[int, ...]
    demos_per_seed: int
    own: tuple[tuple[str, Any], ...] = ()
    """TrainArgs values of those policies other than the recipe's (a suite without a pixel recipe names its
    cameras, image size, hidden and estimated state here)"""
    steps: int | None = None
    """policy steps (None: the recipe's)"""
    env_options: tuple[tuple[str, Any], ...] = ()
    """options of the evaluation env (e.g. LIBERO's own init states per task)"""
    dr_demos_per_seed: int | None = None
    """demos per randomized seed (None: demos_per_seed)"""

    @property
    def pixel_args(self) -> Any:
        """The ``TrainArgs`` a policy with a perception head starts from (each method adds its own flags)."""
        from train.recipes import recipe_args
        return recipe_args(self.recipe, **dict(self.own))

    @property
    def cameras(self) -> tuple[str, ...]:
        return self.pixel_args.cameras

    @property
    def image_size(self) -> int:
        return self.pixel_args.image_size

    @property
    def hide(self) -> tuple[str, ...]:
        """the state the policies do not read from the simulator (end-to-end ones too)"""
        return self.pixel_args.ignore_state

    @property
    def estimate(self) -> tuple[str, ...]:
        return self.pixel_args.estimate_state

    @property
    def opts(self) -> dict[str, Any]:
        """The env options every part evaluates with: the cameras, their size and the suite's own."""
        return {"cameras": self.cameras, "image_size": self.image_size, **dict(self.env_options)}

    @property
    def randomize(self) -> tuple[str, ...]:
        return (f"camera=0.08:{','.join(self.fixed)}", "lighting=0.6")


SUITES: dict[str, Suite] = {
    # own: the hidden state as measured; the recipe also names '*_acc', which matches no slice of this suite's
    # state (the same policy inputs)
    "tabletop": Suite("maniskill/TabletopSuite-v1", ("--suite", "tabletop", "--layout", "random"),
                      ("workspace_camera",), "pixels", (0, 20000), (40000, 60000), 600,
                      own=(("ignore_state", ("*vel", "*_cube_pose", "*_goal_pos")),)),
    # ManiSkill's own task and front camera (the cube 2-3 px wide at 96 px), plus a wrist camera (ManiSkill's
    # panda_wristcam), as a real cell would add. Demos from the closed-loop scripted expert with DART noise.
    "pushcube": Suite("maniskill/PushCube-v1", ("--env", "maniskill/PushCube-v1", "--control-mode", "pd_ee_delta_pos",
                                                "--robot", "panda_wristcam", "--dart-noise", "0.1"),
                      ("base_camera",), "multitask", (0, 20000), (40000, 60000), 400,
                      own=(("cameras", ("base_camera", "hand_camera")), ("image_size", 96),
                           ("ignore_state", ("*vel", "extra/goal_pos", "extra/obj_pose")),
                           ("estimate_state", ("extra/obj_pose[0:3]", "extra/goal_pos[0:2]"))), steps=12000,
                      env_options=(("control_mode", "pd_ee_delta_pos"), ("robot_uids", "panda_wristcam"))),
    # robosuite's own front camera frames the table; the wrist camera sees the row of objects from above.
    # A cube's yaw (+-30 deg) sets the grasp, so its heading (quaternion z, w) is estimated too; the can
    # is round, and the plate and bin stand in fixed places, so the policy does not read them.
    "kitchen": Suite("robosuite/KitchenSuite", ("--suite", "kitchen", "--layout", "random"), ("agentview",),
                     "pixels_kitchen", (0, 20000), (40000, 60000), 300),
    # LIBERO's own front view and wrist camera. Demos come from fresh placements with DART noise (no
    # evaluation init state is trained on); evaluation uses LIBERO's init states of each task. The head
    # estimates where each object and fixture stands and how far the drawers and the stove knob are
    # turned; the objects' orientations and their offsets from the gripper are not read.
    # own: the hidden state as measured; the recipe also names the estimated slices, which --estimate-state
    # hides anyway (the same inputs for a policy with a head; an end-to-end row, none run here, would read them)
    "libero_goal": Suite("libero/GoalSuite", ("--suite", "libero_goal", "--layout", "sampled", "--dart-noise", "0.1"),
                         ("agentview",), "pixels_libero", (0, 20000), (40000, 60000), 250,
                         own=(("ignore_state", ("*vel", "*_acc", "*_1_quat", "*_to_robot0_eef_*")),),
                         env_options=(("layout", "task"),), dr_demos_per_seed=150),
}
CONFLICT_CELLS = {"P2_conflict_conflict": ("conflict", "success_rate"),
                  "P2_conflict_layout_task": ("conflict", "did_layout_task_rate"),
                  "P2_conflict_in_distribution": ("in_distribution", "success_rate"),
                  "P2_conflict_random": ("random", "success_rate")}
"""the layout-conflict test's figures in pixels.json's ``cig``: (condition, field of layout_conflict_eval)"""
PARTS = RESULTS / "pixels_parts"
GROUNDFLOW = str(ROOT / ".venv" / "bin" / "groundflow")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the results were measured


@dataclass(frozen=True)
class Method:
    """A row: how its policy trains and where its perception head comes from."""

    note: str
    estimate_noise: float | None = 0.01
    """None: a control that reads the object state (no head)"""
    head_data: str = "clean"
    """clean | clean+dr: the demos the head is trained on"""
    head_steps: int = 4000
    head_from: str | None = None
    """reuse that method's trained head (an ablation of the policy alone)"""
    policy_from: str | None = None
    """reuse that method's policy (an ablation of the head alone)"""
    noise_from: str | None = None
    """train the policy with noise per coordinate equal to that method's head's held-out error"""
    dagger_from: str | None = None
    """DAgger: the policy also trains on demos where that method's checkpoint acted and the expert labelled
    the states it reached (collected by the collect part once that checkpoint exists)"""
    policy_flags: tuple[str, ...] = ()
    """more `groundflow train` flags of the policy (its steps)"""
    cig: bool = False
    """joint CIG: the policy also takes the CIG options of the ``multitask_cig`` recipe (the grounding
    benchmark's best: bounded, lambda 1, 3 negatives, 2 draws, 64 samples of each batch)"""
    end_to_end: tuple[str, ...] | None = None
    """no head: the policy reads the images itself, trained on the head's demos (head_data) with these
    extra flags (the encoder, its augmentation, batch and steps)"""
    shortcut_rho: float | None = None
    """P2: the policy's demos come from the correlated layout, where the layout names the task with this
    probability (the head's demos stay random-layout); its test is the clean evaluation on random layouts"""
    p2_of: str | None = None
    """the grounding row whose P2 cell this method is"""

    @property
    def has_head(self) -> bool:
        return self.estimate_noise is not None and self.end_to_end is None


METHODS: dict[str, Method] = {
    "head": Method("perception head (CoordConv + spatial softmax, both cameras) feeding a policy trained on the "
                   "true object positions + 1 cm noise"),
    "head_dr": Method("the same policy; its head also trained on demos with the fixed camera moved and the light "
                      "changed per episode, 8000 steps", head_data="clean+dr", head_steps=8000, policy_from="head"),
    "head_dr_matched": Method("the head of `head_dr`; the policy trained with noise per coordinate equal to the "
                              "held-out error of `head`'s head (depth 2-3 cm, the rest 1-12 mm)", estimate_noise=0.0,
                              noise_from="head", head_from="head_dr"),
    "head_nonoise": Method("ablation: the policy trained on exact object positions, the head of `head`",
                           estimate_noise=0.0, head_from="head"),
    "head_dr_nonoise": Method("the policy of `head_nonoise` (exact object positions in training) with the head of "
                              "`head_dr` (domain-randomized demos)", estimate_noise=0.0, policy_from="head_nonoise",
                              head_from="head_dr"),
    "recipe": Method("the recommended configuration in one row (as head_dr_nonoise): a policy on exact object "
                     "positions, its head trained on clean + randomized demos", estimate_noise=0.0,
                     head_data="clean+dr", head_steps=8000),
    "recipe_clean_head": Method("ablation of `recipe`: its policy, its head trained on the clean demos only (same "
                                "8000 steps)", estimate_noise=0.0, head_steps=8000, policy_from="recipe"),
    "state": Method("control: the multitask recipe reading the simulator's object state (not deployable)",
                    estimate_noise=None),
    # grounding on the pixel policy (tabletop): the recipe's policy trained otherwise, the recipe's head in front
    "bc_2x": Method("BC at the compute of joint CIG: the recipe's policy trained twice the steps (48k), the head of "
                    "`head_dr`", estimate_noise=0.0, head_from="head_dr", policy_flags=("--steps", "48000")),
    "cig_joint": Method("joint CIG (bounded, lambda 1, 3 negatives, 2 draws, on 64 samples of each batch) from "
                        "scratch, the recipe's steps, the head of `head_dr`", estimate_noise=0.0, head_from="head_dr",
                        cig=True),
    "dagger": Method("DAgger: the recipe's policy retrained on its demos plus episodes where the recipe (head and "
                     "policy) acted and the expert labelled the states it reached; the recipe's head (units converted)",
                     estimate_noise=0.0, head_from="recipe", dagger_from="recipe"),
    "head_dr_nonoise_dagger": Method("DAgger on the tabletop's recommended row: its policy retrained on the demos plus "
                                     "240 episodes where `head_dr_nonoise` acted and the expert labelled the states it "
                                     "reached; the head of `head_dr` (units converted)", estimate_noise=0.0,
                                     head_from="head_dr", dagger_from="head_dr_nonoise"),
    # P2 from pixels: the rows above trained where the layout names the task with probability 0.9
    "p2_bc": Method("P2 of `head_dr_nonoise`: its policy trained on demos where the layout names the task with "
                    "probability 0.9, the head of `head_dr`", estimate_noise=0.0, head_from="head_dr",
                    shortcut_rho=0.9, p2_of="head_dr_nonoise"),
    "p2_bc_2x": Method("P2 of `bc_2x`: BC at joint CIG's compute (48k steps) on demos where the layout names the "
                       "task with probability 0.9, the head of `head_dr`", estimate_noise=0.0, head_from="head_dr",
                       policy_flags=("--steps", "48000"), shortcut_rho=0.9, p2_of="bc_2x"),
    "p2_cig_joint": Method("P2 of `cig_joint`: joint CIG trained on demos where the layout names the task with "
                           "probability 0.9, the head of `head_dr`", estimate_noise=0.0, head_from="head_dr",
                           cig=True, shortcut_rho=0.9, p2_of="cig_joint"),
    "p2_bc_dagger": Method("P2 of `head_dr_nonoise_dagger`: `p2_bc`'s policy retrained on its demos plus 240 episodes "
                           "where `p2_bc` acted on the same correlated layouts and the expert labelled the states it "
                           "reached; the head of `head_dr`", estimate_noise=0.0, head_from="head_dr",
                           dagger_from="p2_bc", shortcut_rho=0.9, p2_of="head_dr_nonoise_dagger"),
    "cnn_e2e": Method("end to end: the policy reads both cameras through a CNN trained from scratch (spatial-softmax "
                      "keypoints, 4 px random shift, colour jitter 0.3), on clean + randomized demos; 8000 steps of 64",
                      head_data="clean+dr", end_to_end=("--vision", "cnn", "--image-pool", "keypoints",
                                                        "--image-shift", "4", "--image-jitter", "0.3",
                                                        "--batch-size", "64", "--steps", "8000")),
    "lite0_cached": Method("end to end on frozen pretrained features: EfficientNet-Lite0 (ImageNet) on both cameras, "
                           "its maps cached once per frame (--vision-cache; no pixel augmentation), the recipe's "
                           "policy and steps, on clean + randomized demos", head_data="clean+dr",
                           end_to_end=("--vision", "efficientnet_lite0", "--vision-frozen", "--vision-cache",
                                       "--image-shift", "0", "--image-jitter", "0")),
}


@dataclass
class Args:
    part: Literal["collect", "train", "eval", "protocols", "latency", "deploy", "merge"] = "merge"
    suite: Literal["tabletop", "pushcube", "kitchen", "libero_goal"] = "tabletop"
    methods: tuple[str, ...] = ("head",)
    conditions: tuple[str, ...] = ("clean", "camera", "lighting")
    episodes: int = 120
    protocol_episodes: int = 48
    """protocols part: P4 switch cases, and P3 initial states x 12 instructions"""
    dagger_episodes: int = 400
    """collect part: DAgger episodes of a method with dagger_from (split over two processes)"""
    server_episodes: int = 24
    """deploy part: episodes through groundflow serve (the suite's instructions in turn)"""
    encodings: tuple[str, ...] = ("raw", "jpeg")
    """deploy part: how camera images cross the wire"""
    data: Path = ROOT / "data" / "pixels"
    runs: Path = ROOT / "runs" / "pixels"
    seed: int = 0
    eval_seed: int = EVAL_SEED
    """first evaluation episode's seed (and the perturbations' seed); another one re-checks a result on
    episodes and camera moves no choice was made on, written as <method>_recheck<seed>_<condition>"""


def _gf(*args: str, log: Path | None = None) -> None:
    """Run a ``groundflow`` command (one torch thread, as the results were measured)."""
    cmd = [GROUNDFLOW, *args]
    print("$", " ".join(cmd[1:]), flush=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with open(log or "/dev/null", "w") as out:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                       env=ONE_THREAD)


def _data(a: Args, which: str) -> list[Path]:
    """The demo files of ``which``: clean, dr (randomized camera and light) or p2rho<rho> (the clean seeds on
    the correlated layout)."""
    su = SUITES[a.suite]
    return [a.data / f"{a.suite}_{which}_s{s}.h5" for s in (su.dr_seeds if which == "dr" else su.clean_seeds)]


def _collect_flags(su: Suite, rho: float | None) -> list[str]:
    """The suite's collect flags; with ``rho`` (P2), its random layout replaced by the correlated one at ``rho``."""
    flags = list(su.collect)
    if rho is None:
        return flags
    if "--layout" not in flags or flags[flags.index("--layout") + 1] != "random":
        raise SystemExit(f"P2 needs a suite collected on random layouts that has a correlated one (tabletop, "
                         f"kitchen); its collect flags are {' '.join(su.collect)}")
    flags[flags.index("--layout") + 1] = "correlated"
    return flags + ["--layout-rho", str(rho)]


def _policy_data(a: Args, m: Method) -> list[Path]:
    """The demos a method's policy trains on."""
    data = _data(a, "clean") if m.shortcut_rho is None else _data(a, f"p2rho{m.shortcut_rho}")
    data += _data(a, "dr") if m.end_to_end and m.head_data == "clean+dr" else []
    return data + (_dagger_paths(a, m.dagger_from) if m.dagger_from else [])


def collect(a: Args) -> None:
    a.data.mkdir(parents=True, exist_ok=True)
    su = SUITES[a.suite]
    need_dr = any(METHODS[m].head_data == "clean+dr" for m in a.methods)
    rhos = sorted({METHODS[m].shortcut_rho for m in a.methods} - {None})
    procs = []
    sets = [("clean", None)] + ([("dr", None)] if need_dr else []) + [(f"p2rho{r}", r) for r in rhos]
    for which, rho in sets:
        for seed, path in zip(su.dr_seeds if which == "dr" else su.clean_seeds, _data(a, which)):
            if path.exists():
                continue
            extra = ["--randomize", *su.randomize] if which == "dr" else []
            cmd = [GROUNDFLOW, "collect", *_collect_flags(su, rho), "--episodes",
                   str(su.demos_per_seed if which == "clean" else su.dr_demos_per_seed or su.demos_per_seed),
                   "--cameras", *su.cameras, "--image-size", str(su.image_size),
                   "--seed", str(seed), "--out", str(path), "--no-progress", *extra]
            print("$", " ".join(cmd[1:]), flush=True)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                          env=ONE_THREAD))
    for name in {METHODS[m].dagger_from for m in a.methods} - {None}:
        student = _final_dir(a, name)
        if not student.exists():
            raise SystemExit(f"DAgger needs the student {name} trained first ({student})")
        task = _collect_flags(su, METHODS[name].shortcut_rho)  # a P2 student acts on the layouts it trained on
        for seed, path in zip(DAGGER_SEEDS, _dagger_paths(a, name)):
            if path.exists():
                continue
            cmd = [GROUNDFLOW, "collect", *task, "--episodes", str(a.dagger_episodes // len(DAGGER_SEEDS)),
                   "--cameras", *su.cameras, "--image-size", str(su.image_size), "--seed", str(seed), "--out", str(path),
                   "--no-progress", "--student", str(student)]
            print("$", " ".join(cmd[1:]), flush=True)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, env=ONE_THREAD))
    if any(p.wait() for p in procs):
        raise SystemExit("a collection failed")


def _dagger_paths(a: Args, student: str) -> list[Path]:
    return [a.data / f"{a.suite}_dagger_{student}_s{seed}.h5" for seed in DAGGER_SEEDS]


def _seed_dir(a: Args, name: str) -> Path:
    """A method's runs: seed 0 directly under its name, another training seed under ``seed<k>``."""
    return a.runs / a.suite / name / (f"seed{a.seed}" if a.seed else "")


def _policy_dir(a: Args, name: str) -> Path:
    m = METHODS[name]
    return _seed_dir(a, m.policy_from or name) / "policy"


def _final_dir(a: Args, name: str) -> Path:
    """The checkpoint the method is evaluated with."""
    return _seed_dir(a, name) / ("final" if METHODS[name].has_head else "policy") / "ckpt"


def _head_dir(a: Args, name: str) -> Path:
    """The checkpoint whose perception head ``name`` reuses. Heads are trained once (training seed 0):
    the training seeds of the grounding rows vary the policy, the part grounding is about."""
    return _final_dir(replace(a, seed=0), METHODS[name].head_from)


def _flags(values: dict[str, Any], prefix: str = "--") -> list[str]:
    """`groundflow train` flags that set ``values`` (TrainArgs fields, or with ``prefix`` --cig. CIGOptions')."""
    out: list[str] = []
    for k, v in values.items():
        out += [prefix + k.replace("_", "-"), *(map(str, v) if isinstance(v, tuple) else [str(v)])]
    return out


def _policy_flags(a: Args, name: str) -> list[str]:
    """`groundflow train` flags of a method's policy: with a perception head, the suite's pixel recipe and its
    own values; a control reading the object state, the multitask recipe; end to end, the multitask recipe
    seeing the suite's cameras with its state hidden. Then the method's flags (joint CIG: the ``multitask_cig``
    recipe's CIG options)."""
    from train.cig import CIGOptions
    from train.recipes import recipe_args
    su, m = SUITES[a.suite], METHODS[name]
    recipe = su.recipe if m.has_head else "multitask"
    flags = ["--recipe", recipe, "--data", *map(str, _policy_data(a, m)), "--out", str(_policy_dir(a, name)),
             "--seed", str(a.seed), "--no-progress", "--wandb", "disabled"]
    flags += ["--steps", str(su.steps)] if su.steps and "--steps" not in (m.end_to_end or ()) else []
    if m.end_to_end is not None:
        flags += _flags(dict(cameras=su.cameras, image_size=su.image_size, ignore_state=su.hide)) + list(m.end_to_end)
    elif m.has_head:
        flags += _flags(dict(su.own)) + ["--estimate-noise", str(m.estimate_noise)]
        if m.noise_from:
            flags += ["--estimate-noise-from", str(_final_dir(a, m.noise_from))]
    if m.cig:
        cig, default = recipe_args("multitask_cig").cig, CIGOptions()
        flags += _flags({k: v for k, v in vars(cig).items() if v != getattr(default, k)}, prefix="--cig.")
    return flags + list(m.policy_flags)


def train(a: Args) -> None:
    su = SUITES[a.suite]
    for name in a.methods:
        m = METHODS[name]
        pol = _policy_dir(a, name)
        if not (pol / "summary.json").exists():  # written when a run ends; a killed one resumes
            flags = ["train", *_policy_flags(a, name)] + (["--resume"] if (pol / "train_state.pt").exists() else [])
            _gf(*flags, log=pol.with_suffix(".log"))
        if not m.has_head:
            continue
        final = _final_dir(a, name).parent
        if (final / "summary.json").exists():
            continue
        head = ["train", "estimator", "--from", str(pol / "ckpt"), "--out", str(final), "--seed", str(a.seed),
                "--no-progress"]
        if m.head_from:
            head += ["--estimator-from", str(_head_dir(a, name)), "--steps", "0"]
        else:
            data = _data(a, "clean") + (_data(a, "dr") if m.head_data == "clean+dr" else [])
            head += ["--data", *map(str, data), "--steps", str(m.head_steps)]
        _gf(*head, log=final.with_suffix(".log"))


def _piece(a: Args, name: str, what: str) -> Path:
    return PARTS / f"{a.suite}_{name}{f'_seed{a.seed}' if a.seed else ''}_{what}.json"


def evaluate_part(a: Args) -> None:
    import envs
    import policies
    from envs.perturbations import perturb
    from train.evaluate import evaluate
    PARTS.mkdir(parents=True, exist_ok=True)
    su = SUITES[a.suite]
    for name in a.methods:
        policy = policies.load(_final_dir(a, name), to_act=True)
        opts = su.opts
        for cond in a.conditions:
            env = envs.make(su.env, **opts)
            pseed = 1 if a.eval_seed == EVAL_SEED else a.eval_seed
            if cond == "camera":
                env = perturb(env, "camera", magnitude=0.05, rotation_deg=5.0, cameras=su.fixed, seed=pseed)
            elif cond == "lighting":
                env = perturb(env, "lighting", magnitude=0.5, seed=pseed)
            t0 = time.time()
            r = evaluate(policy, su.env, a.episodes, seed=a.eval_seed, env=env, progress=True).to_dict()
            env.close()
            r.update(condition=cond, method=name, minutes=(time.time() - t0) / 60, eval_seed=a.eval_seed)
            tag = "" if a.eval_seed == EVAL_SEED else f"_recheck{a.eval_seed}"
            _piece(a, name + tag, cond).write_text(json.dumps(r, indent=2))
            print(f"{name} {cond}: {r['success_rate']:.3f} {r['ci95']}", flush=True)


def protocols_part(a: Args) -> None:
    """The grounding protocols on pixel checkpoints (train/grounding_eval.py, random layouts): P3 swap (each
    initial state under every instruction) and P4 mid-episode switch; P1 is the clean evaluation above. A
    P2 checkpoint (``shortcut_rho``) gets the layout-conflict test instead (``_conflict``)."""
    from train.grounding_eval import evaluate_protocols
    import policies
    PARTS.mkdir(parents=True, exist_ok=True)
    su = SUITES[a.suite]
    for name in a.methods:
        policy = policies.load(_final_dir(a, name), to_act=True)
        if METHODS[name].shortcut_rho is not None:
            _conflict(a, name, policy)
            continue
        r = evaluate_protocols(policy, a.suite, episodes=a.protocol_episodes, swap_seeds=a.protocol_episodes // 12,
                               seed=PROTOCOL_SEED + 10_000 * a.seed, protocols=("p3", "p4"),
                               env_options={"image_size": su.image_size}, progress=True)
        _piece(a, name, "protocols").write_text(json.dumps(r, indent=2, default=str))
        print(name, {k: round(v["rate"], 3) for k, v in r["summary"].items()}, flush=True)


def _conflict(a: Args, name: str, policy: Any) -> None:
    """A P2 checkpoint on the correlated layout of another task while one is commanded, and on its own
    and random layouts, the same seeds (train/protocols.py ``layout_conflict_eval``): a P2 failure that
    does the layout's task is the shortcut; one that does nothing is the random test layouts."""
    import envs
    from train.protocols import layout_conflict_eval
    su = SUITES[a.suite]
    env = envs.make(su.env, **su.opts)
    try:
        r = layout_conflict_eval(policy, su.env, episodes=a.protocol_episodes, progress=True, env=env,
                                 seed=PROTOCOL_SEED + 3000 + 10_000 * a.seed)
    finally:
        env.close()
    _piece(a, name, "conflict").write_text(json.dumps(r, indent=2, default=str))
    print(name, {k: (round(r[k]["success_rate"], 3), round(r[k]["did_layout_task_rate"], 3))
                 for k in ("conflict", "in_distribution", "random")}, flush=True)


def latency(a: Args) -> None:
    import torch
    import envs
    import policies
    torch.set_num_threads(1)
    PARTS.mkdir(parents=True, exist_ok=True)
    su = SUITES[a.suite]
    env = envs.make(su.env, **su.opts)
    obs, _ = env.reset(seed=EVAL_SEED)
    for name in a.methods:
        policy = policies.load(_final_dir(a, name), to_act=True)
        for _ in range(5):
            policy.predict_action_chunk(obs)
        ts = []
        for _ in range(100):
            t0 = time.perf_counter()
            policy.predict_action_chunk(obs)
            ts.append((time.perf_counter() - t0) * 1e3)
        _piece(a, name, "latency").write_text(json.dumps({"p50_ms": float(np.median(ts)),
                                                        "p90_ms": float(np.percentile(ts, 90))}))
        print(f"{name}: chunk p50 {np.median(ts):.1f} ms", flush=True)
    env.close()


def deploy_part(a: Args) -> None:
    """The checkpoint behind ``groundflow serve``, driven by the deploy path (client, control loop,
    safety layer) on the simulated suite rendering the cameras: success and round trip per image
    encoding, the same episodes for each."""
    from deploy.serving.client import robot_client
    from deploy.evaluate import evaluate_via_server
    from deploy.safety import SafetyConfig
    from deploy.robots.sim import SimRobot
    import envs
    PARTS.mkdir(parents=True, exist_ok=True)
    su = SUITES[a.suite]
    probe_env = envs.make(su.env)
    instructions = probe_env.suite.instructions if probe_env.suite else None
    probe_env.close()
    for name in a.methods:
        with served(_final_dir(a, name)) as port:
            opts = su.opts
            probe = SimRobot(su.env, env_options=opts)
            probe.connect()
            spec = probe.spec
            probe.close()
            out = {}
            for enc in a.encodings:
                client = robot_client("127.0.0.1", port, spec, SafetyConfig.far_margin, timeout=10.0,
                                      image_encoding=enc)
                r = evaluate_via_server(su.env, client, a.server_episodes, seed=EVAL_SEED, env_options=opts,
                                        instructions=instructions)
                client.close()
                out[enc] = {k: r[k] for k in ("n_episodes", "success_rate", "ci95", "rtt_p50_ms")}
                print(f"{name} via server ({enc}): {r['success_rate']:.2f} {r['ci95']}, rtt p50 {r['rtt_p50_ms']} ms",
                      flush=True)
            _piece(a, name, "deploy").write_text(json.dumps(out, indent=2))


def _minutes(a: Args, name: str) -> float | None:
    m, total = METHODS[name], 0.0
    pol = _policy_dir(a, name) / "summary.json"
    if not pol.exists():
        return None
    total += json.loads(pol.read_text())["seconds"]
    head = _final_dir(a, name).parent / "summary.json"
    if m.has_head and head.exists():
        total += json.loads(head.read_text())["seconds"]
    if m.head_from:  # the reused head's training counts too
        total += json.loads((_head_dir(a, name).parent / "summary.json").read_text())["seconds"]
    return total / 60


def _suite_rows(a: Args) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(rows, perception heads, re-checks) of ``a.suite`` from the pieces its parts wrote."""
    rows: dict[str, Any] = {}
    heads: dict[str, Any] = {}
    for name in METHODS:
        cond = {c: json.loads(_piece(a, name, c).read_text()) for c in ("clean", "camera", "lighting")
                if _piece(a, name, c).exists()}
        if not cond:
            continue
        r = cond.get("clean") or {"success_rate": None, "ci95": None, "did_other_task_rate": None,
                                  "per_instruction": {}, "episodes": next(iter(cond.values()))["episodes"]}
        lat, dep = _piece(a, name, "latency"), _piece(a, name, "deploy")
        ckpt = json.loads((_final_dir(a, name) / "config.json").read_text())
        inputs = ckpt["extra"].get("inputs", {})
        rows[name] = {
            "success": r["success_rate"], "ci95": r["ci95"], "episodes": r["episodes"],
            "train_minutes": _minutes(a, name),
            "image_size": SUITES[a.suite].image_size if inputs.get("cameras") else None,
            "cameras": inputs.get("cameras", []), "reads_object_state": bool(inputs.get("reads_object_state")),
            "camera_shift": cond["camera"]["success_rate"] if "camera" in cond else None,
            "camera_shift_ci95": cond["camera"]["ci95"] if "camera" in cond else None,
            "lighting": cond["lighting"]["success_rate"] if "lighting" in cond else None,
            "lighting_ci95": cond["lighting"]["ci95"] if "lighting" in cond else None,
            "latency_ms_p50": json.loads(lat.read_text())["p50_ms"] if lat.exists() else None,
            "via_server": json.loads(dep.read_text()) if dep.exists() else None,
            "did_other_task": r["did_other_task_rate"], "per_instruction": {
                k: v["success_rate"] for k, v in r["per_instruction"].items()},
            "note": METHODS[name].note}
        if "estimator" in ckpt["extra"] and not METHODS[name].head_from:  # a copied head's split is not held out
            heads[name] = ckpt["extra"]["estimator"]
    rechecks: dict[str, Any] = {}
    for path in sorted(PARTS.glob(f"{a.suite}_*_recheck*_*.json")):
        r = json.loads(path.read_text())
        rechecks.setdefault(r["method"], {})[f"{r['condition']}@{r['eval_seed']}"] = {
            "success": r["success_rate"], "ci95": r["ci95"], "episodes": r["episodes"]}
    return rows, heads, rechecks


def _seeds(a: Args, name: str, what: str) -> dict[int, Path]:
    """{training seed: piece} of a method's ``what`` piece, over every training seed that wrote one."""
    found = {0: _piece(a, name, what)} if _piece(a, name, what).exists() else {}
    for path in PARTS.glob(f"{a.suite}_{name}_seed*_{what}.json"):
        tag = path.name[len(f"{a.suite}_{name}_seed"):-len(f"_{what}.json")]
        if tag.isdigit():
            found[int(tag)] = path
    return dict(sorted(found.items()))


def _grounding(a: Args) -> dict[str, Any]:
    """P1 (the clean evaluation), P3 and P4 per tabletop method that ran the protocols part, and P2 (the clean
    evaluation of the method's shortcut-trained twin, ``p2_of``), over the training seeds that ran it: the
    mean of the seeds' rates, a Wilson interval on the pooled episodes
    (it ignores the spread between seeds; ``per_seed`` shows it)."""
    from envs.metrics import wilson
    per: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for name in METHODS:
        prots, cleans = _seeds(a, name, "protocols"), _seeds(a, name, "clean")
        for seed, prot in prots.items():
            summary = json.loads(prot.read_text())["summary"]
            rows = {"P3": summary["p3_swap"], "P4": summary["p4_switch"],
                    "P3_did_other_task": summary["p3_did_other_task"],
                    "P4_old_task_completed": summary["p4_old_task_completed"]}
            if seed in cleans:
                c = json.loads(cleans[seed].read_text())
                rows["P1"] = {"rate": c["success_rate"], "ci95": c["ci95"], "n": c["episodes"]}
            for proto, r in rows.items():
                per.setdefault(proto, {}).setdefault(name, {})[seed] = r
        m = METHODS[name]
        if m.p2_of:  # P2's test: the clean evaluation (random layouts) of the shortcut-trained policy
            for seed, clean in cleans.items():
                c = json.loads(clean.read_text())
                per.setdefault(f"P2_rho{m.shortcut_rho}", {}).setdefault(m.p2_of, {})[seed] = {
                    "rate": c["success_rate"], "ci95": c["ci95"], "n": c["episodes"]}
            for seed, piece in _seeds(a, name, "conflict").items():  # what a P2 failure is
                r = json.loads(piece.read_text())
                for proto, (cond, key) in CONFLICT_CELLS.items():
                    per.setdefault(proto, {}).setdefault(m.p2_of, {})[seed] = {"rate": r[cond][key], "n": r["episodes"]}
    cig: dict[str, Any] = {}
    for proto, methods in per.items():
        for name, seeds in methods.items():
            k = sum(round(r["rate"] * r["n"]) for r in seeds.values())
            n = sum(r["n"] for r in seeds.values())
            mean = float(np.mean([r["rate"] for r in seeds.values()]))
            key = "rate" if proto.endswith(("did_other_task", "completed", "layout_task")) else "success"
            cig.setdefault(proto, {})[name] = {key: mean, "ci95": list(wilson(k, n)), "episodes": n,
                                               "seeds": len(seeds),
                                               "per_seed": {str(s): r["rate"] for s, r in seeds.items()}}
    return cig


def merge(a: Args) -> None:
    out: dict[str, Any] = {"suites": {}, "recommended": {}, "perception_heads": {}, "rechecks": {}, "cig": {},
                           "eval_seed": EVAL_SEED, "machine": machine(), "setup": {}}
    for suite, su in SUITES.items():
        rows, heads, rechecks = _suite_rows(Args(**{**a.__dict__, "suite": suite}))
        if not rows:
            continue
        # recommended: the best clean success among deployable rows keeping >= 0.8 x it under both perturbations
        robust = {k: v for k, v in rows.items() if not v["reads_object_state"] and v["success"] is not None
                  and v["camera_shift"] is not None
                  and v["lighting"] is not None and min(v["camera_shift"], v["lighting"]) >= 0.8 * v["success"]}
        deployable = {k: v for k, v in rows.items() if not v["reads_object_state"] and v["success"] is not None}
        if robust or deployable:  # where no row is that robust, the best deployable one, said so
            pool = robust or deployable
            out["recommended"][suite] = max(pool, key=lambda k: pool[k]["success"])
            out.setdefault("recommended_rule", {})[suite] = (
                "the best clean success keeping >= 0.8x it under the camera shift and the lighting change" if robust
                else "the best clean success; no row keeps 0.8x it under both perturbations")
        out["suites"][suite], out["perception_heads"][suite], out["rechecks"][suite] = rows, heads, rechecks
        out["setup"][suite] = {"env": su.env, "cameras": list(su.cameras), "image_size": su.image_size,
                               "demos": len(su.clean_seeds) * su.demos_per_seed,
                               "camera_shift": f"{', '.join(su.fixed)} moved 5 cm, turned 5 deg",
                               "lighting": "lights x0.67-1.5 with a tint (magnitude 0.5)"}
    out["cig"] = _grounding(Args(**{**a.__dict__, "suite": "tabletop"}))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pixels.json").write_text(json.dumps(out, indent=2))
    (RESULTS / "pixels.md").write_text(_table(out))
    print(_table(out))


def _fmt(x: float | None, ci: list | None = None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _table(out: dict[str, Any]) -> str:
    text = []
    for suite, rows in out["suites"].items():
        su = out["setup"][suite]
        table = [[name, "yes" if r["reads_object_state"] else "no", _fmt(r["success"], r["ci95"]),
                  _fmt(r["camera_shift"], r.get("camera_shift_ci95")), _fmt(r["lighting"], r.get("lighting_ci95")),
                  str(r["episodes"]), _fmt(r["train_minutes"]), _fmt(r["latency_ms_p50"])] for name, r in rows.items()]
        text.append(f"## {suite} from cameras ({su['env']}, {', '.join(su['cameras'])}, {su['image_size']} px)\n\n"
                    + md_table(["method", "reads object state", "success [95% CI]", "camera shift", "lighting",
                                "episodes", "train min", "chunk p50 ms"], table))
        heads = [[k, f"{1000 * v['heldout_rmse_mean']:.1f}", f"{1000 * v['train_rmse_mean']:.1f}",
                  str(v["heldout_frames"]), str(v["steps"])] for k, v in out["perception_heads"][suite].items()]
        text.append(f"### {suite}: perception heads, error on held-out demo frames (RMS over the estimated "
                    "entries x 1000: mm where they are positions)\n\n" + md_table(["method", "held-out", "training frames", "held-out frames",
                                                   "steps"], heads))
        re_rows = [[m, cond, _fmt(v["success"], v["ci95"]), str(v["episodes"])]
                   for m, conds in out["rechecks"][suite].items() for cond, v in conds.items()]
        if re_rows:
            text.append(f"### {suite}: re-checks on other episodes (condition@first seed; camera moves and lights "
                        "drawn anew)\n\n" + md_table(["method", "condition", "success [95% CI]", "episodes"], re_rows))
    if out.get("cig"):
        protos = [p for p in ("P1", *sorted(k for k in out["cig"] if k.startswith("P2_rho")), "P3", "P4")
                  if p in out["cig"]]
        methods = sorted({m for p in protos for m in out["cig"][p]})
        def cell(p: str, m: str) -> str:
            if m not in out["cig"][p]:
                return "-"
            c = out["cig"][p][m]
            return _fmt(c["success"], c["ci95"]) + (f" ({c['seeds']} seed{'s' * (c['seeds'] > 1)})"
                                                    if c["seeds"] != out["cig"]["P1"][m]["seeds"] else "")
        rows = [[m, *[cell(p, m) for p in protos],
                 _fmt(out["cig"]["P3_did_other_task"][m]["rate"]), _fmt(out["cig"]["P4_old_task_completed"][m]["rate"])]
                for m in methods]
        rows = [[*r, str(max(out["cig"][p][r[0]]["seeds"] for p in protos if r[0] in out["cig"][p]))] for r in rows]
        conflict = {k: v for k, v in out["cig"].items() if k in CONFLICT_CELLS}
        if conflict:
            methods_c = sorted({m for v in conflict.values() for m in v})
            cols = tuple(CONFLICT_CELLS)
            crow = [[m, *[_fmt(conflict[c][m].get("success", conflict[c][m].get("rate")), conflict[c][m]["ci95"])
                          if m in conflict.get(c, {}) else "-" for c in cols],
                     *([str(conflict[cols[0]][m][k]) for k in ("episodes", "seeds")] if m in conflict.get(cols[0], {})
                       else ["-", "-"])] for m in methods_c]
            text.append("## P2 checkpoints on the correlated layout of another task while one is commanded (only "
                        "the instruction names the task), on their own layouts and on random ones; episodes per "
                        "condition over the seeds\n\n" + md_table(
                            ["P2 of", "conflict: success", "conflict: did the layout's task", "own layouts",
                             "random layouts", "episodes", "seeds"], crow))
        text.append("## Grounding protocols on the tabletop pixel policy (mean over training seeds, 95% Wilson "
                    "interval on the pooled episodes; P1 the clean evaluation, P2 trained where the layout names the "
                    "task with probability rho and tested on random layouts, P3 swap, P4 mid-episode switch)\n\n"
                    + md_table(["method", *protos, "P3: did another task", "P4: old task completed", "seeds"], rows))
    return "\n".join(text)


def main(a: Args) -> None:
    unknown = [m for m in a.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    {"collect": collect, "train": train, "eval": evaluate_part, "protocols": protocols_part, "latency": latency,
     "deploy": deploy_part, "merge": merge}[a.part](a)


if __name__ == "__main__":
    main(tyro.cli(Args))
