"""RoboCasa kitchen tasks, when RoboCasa and its kitchen assets are installed.

RoboCasa is not on PyPI and its kitchen assets (textures, fixtures, objaverse objects; ~10 GB)
are a separate download, so on an offline machine this adapter only says exactly what is missing
and how to install it: there is no silent fallback. The RoboCasa-style tasks that run anywhere
are ``envs.make("robosuite/KitchenSuite")`` (envs/robosuite/kitchen.py).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from envs.errors import InvalidOptionError, MissingAssetsError
from envs.robosuite.env import RobosuiteEnv, check_cameras, check_positive_int, import_robosuite

# Our task names (RoboCasa v0.x) -> names the task has had in RoboCasa releases (v0.x, v1.x).
TASK_ALIASES: dict[str, tuple[str, ...]] = {
    "PnPCounterToCab": ("PnPCounterToCab", "PickPlaceCounterToCabinet"),
    "OpenSingleDoor": ("OpenSingleDoor", "OpenCabinet"),
    "CloseDrawer": ("CloseDrawer",),
    "TurnOnSinkFaucet": ("TurnOnSinkFaucet",),
}
ASSET_DIRS = ("models/assets/textures", "models/assets/fixtures", "models/assets/objects/objaverse")
INSTALL = (
    "  pip install \"robocasa @ git+https://github.com/robocasa/robocasa.git@v0.2\"   "
    "# v0.2 is the release built on robosuite 1.5\n"
    "  python -m robocasa.scripts.download_kitchen_assets   # ~10 GB: textures, fixtures, objects\n"
    "  python -m robocasa.scripts.setup_macros"
)
_OPTIONS = ("task", "cameras", "image_size", "max_episode_steps", "robots", "layout_ids", "style_ids")


def missing_robocasa() -> list[str]:
    """What is missing for RoboCasa to run here (empty when nothing is)."""
    spec = importlib.util.find_spec("robocasa")
    if spec is None or not spec.submodule_search_locations:
        return ["the `robocasa` Python package (not installed; it is not on PyPI)"]
    root = Path(next(iter(spec.submodule_search_locations)))
    missing = []
    for rel in ASSET_DIRS:
        d = root / rel
        if not d.is_dir() or not any(d.iterdir()):
            missing.append(f"RoboCasa kitchen assets: {d} is missing or empty")
    return missing


def _missing_error(task: str, missing: list[str]) -> MissingAssetsError:
    return MissingAssetsError(
        f"RoboCasa task {task!r} cannot be created: missing " + "; ".join(missing) + ".\n"
        "RoboCasa and its kitchen assets are a separate download (several GB, needs network). "
        "Install them with:\n" + INSTALL + "\n"
        "RoboCasa-style tasks that run without them: envs.make('robosuite/KitchenSuite').")


class RoboCasaEnv(RobosuiteEnv):
    """A RoboCasa env; the instruction comes from RoboCasa's episode metadata ("lang")."""

    backend = "robocasa"

    def _reset(self, seed, options):
        out = super()._reset(seed, options)
        self.instruction = str(self.rs.get_ep_meta().get("lang", self.instruction))
        return out

    # Unsupported, as before these hooks existed (untested without RoboCasa's multi-GB assets): success
    # comes from info["success"] only, and a shifted twin may only delay actions and add sensor noise.
    def evaluate_success(self) -> None:
        return None

    def make_physics(self, bodies: tuple[str, ...] | None) -> None:
        return None


def make_robocasa(env_id: str = "", task: str = "PnPCounterToCab", cameras: Any = (),
                  image_size: int = 128, max_episode_steps: int = 500, **options: Any) -> RoboCasaEnv:
    """Make a RoboCasa task; raise MissingAssetsError (with install commands) when it cannot run."""
    bad = sorted(set(options) - set(_OPTIONS))
    if bad:
        raise InvalidOptionError(f"{env_id or 'robocasa'}: unknown option(s) {bad}; valid options: {list(_OPTIONS)}")
    if task not in TASK_ALIASES:
        raise InvalidOptionError(f"unknown RoboCasa task {task!r}; valid tasks: {list(TASK_ALIASES)}")
    missing = missing_robocasa()
    if missing:
        raise _missing_error(task, missing)
    rs = import_robosuite()
    try:
        importlib.import_module("robocasa")  # registers its envs with robosuite
    except Exception as e:  # installed but broken (e.g. a robosuite it does not support)
        raise MissingAssetsError(f"`robocasa` is installed but failed to import ({type(e).__name__}: {e}). "
                                 "Reinstall it for robosuite 1.5:\n" + INSTALL) from e
    from robosuite.environments.base import REGISTERED_ENVS
    name = next((n for n in TASK_ALIASES[task] if n in REGISTERED_ENVS), None)
    if name is None:
        raise MissingAssetsError(f"the installed robocasa registers none of {TASK_ALIASES[task]}; "
                                 "install the release this adapter targets:\n" + INSTALL)
    image_size = check_positive_int("image_size", image_size)
    steps = check_positive_int("max_episode_steps", max_episode_steps)
    cams = (cameras,) if isinstance(cameras, str) else tuple(cameras or ())
    kwargs = {k: options[k] for k in ("layout_ids", "style_ids") if k in options}
    rs_env = rs.make(name, robots=options.get("robots", "PandaOmron"), has_renderer=False,
                     has_offscreen_renderer=bool(cams), use_camera_obs=False, ignore_done=True, **kwargs)
    cams = check_cameras(cams, [rs_env.sim.model.camera_id2name(i) for i in range(rs_env.sim.model.ncam)])
    return RoboCasaEnv(rs_env, env_id or f"robocasa/{task}", "", cams, image_size, steps)
