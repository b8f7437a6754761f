"""One dataset format for simulated demos, recorded robot episodes and debugging traces.

HDF5 layout (``format = "groundflow-dataset"``, ``version = 1``)::

    /                       attrs: format, version, env_id, state_dim, action_dim, cameras (json),
                                   meta (json), complete (bool, set last), n_episodes
    /episodes/000000/       attrs: instruction, task_id, seed, length, success
        state      (T, S) float32     observation state at each step
        action     (T, A) float32     action taken at that step
        reward     (T,)   float32
        success    (T,)   bool        info["success"] after the action
        sim_state  (T, D) float32     simulator state before the action (when the backend has one)
        final_state (S,)  float32     observation after the last action
        final_sim_state (D,)
        images/<camera> (T, h, w, 3) uint8

Writes are atomic: the writer fills ``PATH.partial`` and renames it to ``PATH`` only after
``complete`` is set, so a killed run never leaves a file that looks complete, and the episodes it
did write stay readable in the ``.partial`` file (``Dataset(path, allow_incomplete=True)``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np

from envs.errors import GroundflowError

FORMAT = "groundflow-dataset"
VERSION = 1


class DatasetError(GroundflowError, ValueError):
    """A dataset that is missing, truncated, incomplete or inconsistent."""


@dataclass
class Episode:
    state: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    success: np.ndarray
    instruction: str
    task_id: int = 0
    seed: int | None = None
    images: dict[str, np.ndarray] | None = None
    sim_state: np.ndarray | None = None
    final_state: np.ndarray | None = None
    final_sim_state: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.action.shape[0])

    @property
    def succeeded(self) -> bool:
        return bool(np.any(self.success))


class EpisodeBuffer:
    """Accumulates one episode step by step (used by collection, deploy recording, debugging)."""

    def __init__(self, instruction: str, task_id: int = 0, seed: int | None = None):
        self.instruction, self.task_id, self.seed = instruction, task_id, seed
        self.states: list[np.ndarray] = []
        self.actions: list[np.ndarray] = []
        self.rewards: list[float] = []
        self.successes: list[bool] = []
        self.sim_states: list[np.ndarray] = []
        self.images: dict[str, list[np.ndarray]] = {}

    def add(self, obs: dict, action: np.ndarray, reward: float, success: bool,
            sim_state: np.ndarray | None = None) -> None:
        self.states.append(np.asarray(obs["state"], np.float32))
        self.actions.append(np.asarray(action, np.float32))
        self.rewards.append(float(reward))
        self.successes.append(bool(success))
        if sim_state is not None:  # native dtype: float64 MuJoCo states must round-trip exactly
            self.sim_states.append(np.array(sim_state, copy=True))
        for cam, img in (obs.get("images") or {}).items():
            self.images.setdefault(cam, []).append(np.asarray(img, np.uint8))

    def __len__(self) -> int:
        return len(self.actions)

    def finish(self, final_obs: dict | None = None, final_sim_state: np.ndarray | None = None) -> Episode:
        if not self.actions:
            raise DatasetError("cannot finish an episode with no steps")
        return Episode(
            state=np.stack(self.states), action=np.stack(self.actions),
            reward=np.asarray(self.rewards, np.float32), success=np.asarray(self.successes, bool),
            instruction=self.instruction, task_id=self.task_id, seed=self.seed,
            images={c: np.stack(v) for c, v in self.images.items()} or None,
            sim_state=np.stack(self.sim_states) if len(self.sim_states) == len(self.actions) else None,
            final_state=None if final_obs is None else np.asarray(final_obs["state"], np.float32),
            final_sim_state=None if final_sim_state is None else np.array(final_sim_state, copy=True))


class DatasetWriter:
    """Writes episodes to ``path`` atomically (``path.partial`` until :meth:`close`)."""

    def __init__(self, path: str | os.PathLike, env_id: str, state_dim: int, action_dim: int,
                 cameras: tuple[str, ...] = (), meta: dict[str, Any] | None = None, overwrite: bool = False):
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} exists; pass overwrite=True (--overwrite) to replace it")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.f = h5py.File(self.tmp, "w")
        a = self.f.attrs
        a["format"], a["version"], a["env_id"] = FORMAT, VERSION, env_id
        a["state_dim"], a["action_dim"] = int(state_dim), int(action_dim)
        a["cameras"] = json.dumps(list(cameras))
        a["meta"] = json.dumps(meta or {})
        a["complete"] = False
        a["n_episodes"] = 0
        self.group = self.f.create_group("episodes")
        self.state_dim, self.action_dim, self.cameras = int(state_dim), int(action_dim), tuple(cameras)
        self.n = 0

    def add(self, ep: Episode) -> None:
        T = len(ep)
        if ep.state.shape != (T, self.state_dim):
            raise DatasetError(f"episode state has shape {ep.state.shape}, expected ({T}, {self.state_dim})")
        if ep.action.shape != (T, self.action_dim):
            raise DatasetError(f"episode action has shape {ep.action.shape}, expected ({T}, {self.action_dim})")
        if not np.all(np.isfinite(ep.action)):
            raise DatasetError("episode contains non-finite actions")
        g = self.group.create_group(f"{self.n:06d}")
        g.attrs["instruction"], g.attrs["task_id"] = ep.instruction, int(ep.task_id)
        g.attrs["seed"] = -1 if ep.seed is None else int(ep.seed)
        g.attrs["length"], g.attrs["success"] = T, ep.succeeded
        g.create_dataset("state", data=ep.state.astype(np.float32))
        g.create_dataset("action", data=ep.action.astype(np.float32))
        g.create_dataset("reward", data=np.asarray(ep.reward, np.float32).reshape(T))
        g.create_dataset("success", data=np.asarray(ep.success, bool).reshape(T))
        if ep.final_state is not None:
            g.create_dataset("final_state", data=np.asarray(ep.final_state, np.float32))
        for name in ("sim_state", "final_sim_state"):  # simulator states keep their dtype (exact replay)
            v = getattr(ep, name)
            if v is not None:
                g.create_dataset(name, data=np.asarray(v))
        for cam in self.cameras:
            if not ep.images or cam not in ep.images:
                raise DatasetError(f"episode lacks images of camera {cam!r}")
            img = ep.images[cam]
            g.create_dataset(f"images/{cam}", data=img, chunks=(1, *img.shape[1:]), compression="lzf")
        self.n += 1
        self.f.attrs["n_episodes"] = self.n
        self.f.flush()  # episodes written so far survive a crash in the .partial file

    def close(self) -> Path:
        self.f.attrs["complete"] = True
        self.f.close()
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Close without publishing: what was written stays in ``.partial`` for inspection."""
        try:
            self.f.close()
        except Exception:
            pass

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Dataset:
    """Validating reader. Loads episodes lazily; ``frames()`` gives a LeRobot-style table."""

    def __init__(self, path: str | os.PathLike, allow_incomplete: bool = False):
        self.path = Path(path)
        if not self.path.exists():
            partial = self.path.with_name(self.path.name + ".partial")
            hint = f" (an unfinished {partial.name} exists: the run that wrote it did not finish)" if partial.exists() else ""
            raise DatasetError(f"dataset {self.path} does not exist{hint}")
        try:
            self.f = h5py.File(self.path, "r")
        except OSError as e:
            raise DatasetError(f"{self.path} is not a readable HDF5 dataset (truncated or corrupt?): {e}") from e
        a = self.f.attrs
        if a.get("format") != FORMAT:
            raise DatasetError(f"{self.path} is not a groundflow dataset (format={a.get('format')!r})")
        if int(a.get("version", -1)) != VERSION:
            raise DatasetError(f"{self.path}: unsupported dataset version {a.get('version')} (this reader: {VERSION})")
        if not bool(a.get("complete", False)) and not allow_incomplete:
            raise DatasetError(f"{self.path} is incomplete (the writing run did not finish)")
        self.env_id = str(a["env_id"])
        self.state_dim, self.action_dim = int(a["state_dim"]), int(a["action_dim"])
        self.cameras = tuple(json.loads(a["cameras"]))
        self.meta = json.loads(a["meta"])
        self.keys = sorted(self.f["episodes"].keys())
        if bool(a.get("complete", False)) and len(self.keys) != int(a["n_episodes"]):
            raise DatasetError(f"{self.path}: header says {int(a['n_episodes'])} episodes, found {len(self.keys)}")
        for k in self.keys:
            self._validate(k)

    def _validate(self, key: str) -> None:
        g = self.f["episodes"][key]
        try:
            T = int(g.attrs["length"])
            shapes = {n: g[n].shape for n in ("state", "action", "reward", "success")}
        except KeyError as e:
            raise DatasetError(f"{self.path}: episode {key} is missing {e}") from e
        expect = {"state": (T, self.state_dim), "action": (T, self.action_dim), "reward": (T,), "success": (T,)}
        for n, s in expect.items():
            if shapes[n] != s:
                raise DatasetError(f"{self.path}: episode {key} field {n} has shape {shapes[n]}, expected {s}")
        for cam in self.cameras:
            if f"images/{cam}" not in g or g[f"images/{cam}"].shape[0] != T:
                raise DatasetError(f"{self.path}: episode {key} lacks {T} images of camera {cam!r}")

    def __len__(self) -> int:
        return len(self.keys)

    def episode(self, i: int, images: bool = True) -> Episode:
        g = self.f["episodes"][self.keys[i]]
        opt = lambda n: g[n][()] if n in g else None  # noqa: E731
        try:
            return Episode(
                state=g["state"][()], action=g["action"][()], reward=g["reward"][()], success=g["success"][()],
                instruction=str(g.attrs["instruction"]), task_id=int(g.attrs["task_id"]),
                seed=None if int(g.attrs["seed"]) < 0 else int(g.attrs["seed"]),
                images={c: g[f"images/{c}"][()] for c in self.cameras} if images and self.cameras else None,
                sim_state=opt("sim_state"), final_state=opt("final_state"), final_sim_state=opt("final_sim_state"))
        except (OSError, KeyError) as e:
            raise DatasetError(f"{self.path}: episode {self.keys[i]} is unreadable (corrupt data): {e}") from e

    def __iter__(self) -> Iterator[Episode]:
        for i in range(len(self)):
            yield self.episode(i)

    @property
    def instructions(self) -> list[str]:
        return sorted({str(self.f["episodes"][k].attrs["instruction"]) for k in self.keys})

    def frames(self) -> dict[str, np.ndarray]:
        """LeRobot-style frame table: one row per step, columns as flat arrays."""
        cols: dict[str, list] = {k: [] for k in ("episode_index", "frame_index", "observation.state", "action",
                                                  "next.reward", "next.success", "task_index", "task")}
        for i in range(len(self)):
            ep = self.episode(i, images=False)
            T = len(ep)
            cols["episode_index"].append(np.full(T, i))
            cols["frame_index"].append(np.arange(T))
            cols["observation.state"].append(ep.state)
            cols["action"].append(ep.action)
            cols["next.reward"].append(ep.reward)
            cols["next.success"].append(ep.success)
            cols["task_index"].append(np.full(T, ep.task_id))
            cols["task"].append(np.array([ep.instruction] * T, dtype=object))
        return {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> "Dataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
