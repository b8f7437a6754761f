"""Named training recipes: ``groundflow train --recipe NAME`` starts from measured defaults for a
kind of task; every flag given beside it still overrides. Each recipe says what it was measured
on (``benchmarks/grounding.py`` for ``multitask`` and ``multitask_cig``, ``benchmarks/policies.py`` for
``chunked``, ``benchmarks/libero.py`` for ``libero_dart``, ``benchmarks/pixels.py`` for the ``pixels*`` ones),
and those benchmarks and ``make demo`` build their runs from the recipes, so a recipe is what was measured."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from train.bc import TrainArgs
from train.cig import CIGOptions

_MULTITASK: dict[str, Any] = {
    "ignore_state": ("*vel", "*_acc"), "fusion": "early", "lang_norm": True, "state_hidden": 256, "horizon": 1,
    "n_exec": 1, "batch_size": 256, "lr": 1e-3, "steps": 24000,
    "bin_sigma": 1.0}  # AR only: one-hot bins overfit (tabletop 0.75 at 6k -> 0.35 at 24k)

RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "chunked": (
        "single-task default: 16-step chunks, 8 executed, late fusion (PushCube 0.92, Adroit door 0.98)",
        {}),
    "multitask": (
        "multi-instruction suites: the policy does not read joint velocities (it would copy its previous "
        "motion instead of reading the scene), the state encoder reads the centred instruction feature "
        "(early fusion + lang_norm) and the policy acts every step (H=1); 24k steps of 256 samples "
        "(benchmarks/grounding.py: tabletop flow 0.97, AR 0.65; kitchen flow 1.00). A user's own wording is "
        "not a training matter: every multi-instruction checkpoint carries an instruction resolver that maps it to "
        "a trained instruction or refuses it at run time (benchmarks/language.py, this recipe on the tabletop, every "
        "episode commanded with a held-out paraphrase: 0.28 encoded as is, 0.95 resolved, as clean). For wordings the "
        "resolver refuses and --allow-unknown runs, add --paraphrase-augment 0.5 (half the samples on grammar-made "
        "rewrites of their instruction): 0.62 encoded as is, at 0.92 clean",
        _MULTITASK),
    "multitask_cig": (
        "the recommended configuration where the scene can stand in for the instruction (demos whose layout "
        "mostly names the task): the multitask recipe with joint Counterfactual Instruction Grounding from the "
        "first step, the bounded term (lambda 1, margin 1) over K=3 counterfactual instructions, M=2 shared noise "
        "draws, on 64 samples of each batch of 256 (about 2x BC's time per step). benchmarks/grounding.py, "
        "tabletop, 3 seeds: trained where the layout names the task in 0.9 of the demos, 0.69 on random layouts "
        "against BC's 0.56 and 0.61 for BC at equal compute (48k steps), 0.99 in distribution (BC 0.97); the AR "
        "family 0.21 against BC's 0.14. On the kitchen suite, whose tasks on one object act alike until they part, "
        "it costs in distribution (0.58 against BC's 0.99; --cig.demonstrated-radius 1.25: 0.89): use `multitask` "
        "there. `--cig.weight` alone keeps CIGOptions' `detached` default (what such commands always trained); "
        "this recipe is the measured best",
        {**_MULTITASK, "cig": CIGOptions(weight=1.0, variant="bounded", negatives=3, draws=2, batch=64)}),
    "libero_dart": (
        "LIBERO-Goal: the multitask recipe's training on demos collected with DART noise, a collection option: "
        "`groundflow collect --suite libero_goal --layout sampled --dart-noise 0.1 --episodes 500` (50 per task "
        "from fresh placements; the noise is executed, the expert's clean action recorded, so the demos show how "
        "to recover). benchmarks/libero.py, flow, one seed, 20 episodes per task from LIBERO's init states: 0.97 "
        "on the 500 DART demos alone, 0.96 with the 500 clean ones beside them, 0.35 on the 500 clean demos alone",
        _MULTITASK),
    "pixels": (
        "a policy for a real arm on the tabletop suite: the multitask recipe reading the cube and goal positions "
        "from a perception head over the workspace and wrist cameras (96 px) instead of the simulator; train the "
        "head next with `groundflow train estimator` on clean and --randomize'd demos (benchmarks/pixels.py: "
        "0.93, 0.93 under a camera shift, 0.88 under a lighting change). Other suites name their own --cameras, "
        "--ignore-state and --estimate-state",
        {**_MULTITASK, "cameras": ("workspace_camera", "hand_camera"), "image_size": 96,
         "ignore_state": ("*vel", "*_acc", "*_cube_pose", "*_goal_pos"),
         "estimate_state": ("*_cube_pose[0:3]", "*_goal_pos[0:2]"), "estimate_noise": 0.0}),
    "pixels_kitchen": (
        "the `pixels` recipe on the robosuite kitchen suite: robosuite's front camera (`agentview`) and the wrist "
        "camera (`robot0_eye_in_hand`), 96 px; the head estimates the three objects' positions and the cubes' "
        "heading (a cube's yaw sets the grasp); the plate and bin stand in fixed places and are not read "
        "(benchmarks/pixels.py --suite kitchen)",
        {**_MULTITASK, "cameras": ("agentview", "robot0_eye_in_hand"), "image_size": 96,
         "ignore_state": ("*vel", "*_acc", "*_cube_*", "green_can_*", "gripper_to_*", "plate_pos", "bin_pos"),
         "estimate_state": ("*_cube_pos", "green_can_pos", "*_cube_quat[2:4]"), "estimate_noise": 0.0}),
    "pixels_libero": (
        "the `pixels` recipe on LIBERO-Goal: LIBERO's front camera (`agentview`) and the wrist camera "
        "(`robot0_eye_in_hand`), 96 px; the head estimates where each object and fixture stands and how far the "
        "drawers and the stove knob are turned; the objects' orientations and their offsets from the gripper are "
        "not read (benchmarks/pixels.py --suite libero_goal)",
        {**_MULTITASK, "cameras": ("agentview", "robot0_eye_in_hand"), "image_size": 96,
         "ignore_state": ("*vel", "*_acc", "*_1_quat", "*_to_robot0_eef_*", "*_1_pos", "*_level_qpos",
                          "*_button_qpos"),
         "estimate_state": ("*_1_pos", "*_level_qpos", "*_button_qpos"), "estimate_noise": 0.0}),
    "pixels_large": (
        "the `pixels` recipe for a GPU workstation: 128 px images and a head twice as wide (32 channels, 64 "
        "keypoints per camera); train its head longer (`groundflow train estimator --steps 30000`). Not measured: "
        "no GPU was lent to the sessions that built it; on one CPU core a head step costs 4.6x the `pixels` one",
        {**_MULTITASK, "cameras": ("workspace_camera", "hand_camera"), "image_size": 128,
         "ignore_state": ("*vel", "*_acc", "*_cube_pose", "*_goal_pos"),
         "estimate_state": ("*_cube_pose[0:3]", "*_goal_pos[0:2]"), "estimate_noise": 0.0,
         "estimator_channels": 32, "estimator_keypoints": 64}),
}


def recipe_args(name: str, cls: type | None = None, **overrides: Any) -> Any:
    """``TrainArgs`` (or ``cls``) with the recipe's values, then ``overrides``, applied."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known recipes: "
                         + "; ".join(f"{k} ({v[0]})" for k, v in RECIPES.items()))
    values = copy.deepcopy(RECIPES[name][1])  # a nested option (the CIG options) is the caller's own to change
    return dataclasses.replace((cls or TrainArgs)(), recipe=name, **{**values, **overrides})


def recipe_from_argv(argv: list[str]) -> str | None:
    """The value of ``--recipe NAME`` / ``--recipe=NAME`` in ``argv`` (None when absent)."""
    for i, a in enumerate(argv):
        if a == "--recipe":
            if i + 1 >= len(argv):
                raise ValueError("--recipe needs a name: " + ", ".join(RECIPES))
            return argv[i + 1]
        if a.startswith("--recipe="):
            return a.split("=", 1)[1]
    return None
