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

Every per-episode array carries a ``crc32`` attribute of its raw bytes, checked when it is read, so
flipped bytes are an error rather than silently different training data (files written before
checksums existed have none and load unchecked).

Writes are atomic: the writer fills ``PATH.partial`` and renames it to ``PATH`` only after
``complete`` is set, so a killed run never leaves a file that looks complete, and the episodes it
did write stay readable in the ``.partial`` file (``Dataset(path, allow_incomplete=True)``).
One writer per path: it holds an exclusive lock on ``PATH.lock`` before touching ``PATH.partial``
(a second writer would otherwise truncate the first one's file), refuses to truncate a
``.partial`` left by a killed run unless told to overwrite, and never renames over a ``PATH`` that
appeared while it was writing.
"""

from __future__ import annotations

import fcntl
import json
import os
import zlib
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


def _crc32(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a))


def _lock(path: Path) -> int:
    """Exclusive lock on ``path`` (created if needed); the fd holds it until closed. The inode is
    re-checked after locking because a finishing writer unlinks the lock file it held."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DatasetError(f"{path.with_suffix('')} is being written by another process (it holds {path.name}); "
                               "wait for it to finish or write to another path") from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


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
        self.overwrite = overwrite
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.lock = self.path.with_name(self.path.name + ".lock")
        self._lock_fd: int | None = _lock(self.lock)  # before anything can truncate a .partial
        try:
            if self.path.exists() and not overwrite:
                raise FileExistsError(f"{self.path} exists; pass overwrite=True (--overwrite) to replace it")
            if self.tmp.exists() and not overwrite:
                raise FileExistsError(f"{self.tmp} exists: an earlier run writing {self.path.name} did not finish (its "
                                      "episodes are readable with Dataset(path, allow_incomplete=True)); pass "
                                      "overwrite=True (--overwrite) to discard it")
            self.f = h5py.File(self.tmp, "w")
        except BaseException:
            self._unlock()
            raise
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
        _put(g, "state", ep.state.astype(np.float32))
        _put(g, "action", ep.action.astype(np.float32))
        _put(g, "reward", np.asarray(ep.reward, np.float32).reshape(T))
        _put(g, "success", np.asarray(ep.success, bool).reshape(T))
        if ep.final_state is not None:
            _put(g, "final_state", np.asarray(ep.final_state, np.float32))
        for name in ("sim_state", "final_sim_state"):  # simulator states keep their dtype (exact replay)
            v = getattr(ep, name)
            if v is not None:
                _put(g, name, np.asarray(v))
        for cam in self.cameras:
            if not ep.images or cam not in ep.images:
                raise DatasetError(f"episode lacks images of camera {cam!r}")
            img = np.asarray(ep.images[cam])
            _put(g, f"images/{cam}", img, chunks=(1, *img.shape[1:]), compression="lzf")
        self.n += 1
        self.f.attrs["n_episodes"] = self.n
        self.f.flush()  # episodes written so far survive a crash in the .partial file

    def close(self) -> Path:
        try:
            self.f.attrs["complete"] = True
            self.f.close()
            if self.overwrite:
                os.replace(self.tmp, self.path)
            else:
                self._publish_new()
        finally:
            self._unlock()
        return self.path

    def _publish_new(self) -> None:
        """Rename ``.partial`` to ``path`` unless ``path`` appeared meanwhile (another tool, a copy):
        a hard link is an atomic no-clobber rename; filesystems without links check, then rename."""
        appeared = FileExistsError(f"{self.path} appeared while this run was writing it; not replacing it (the "
                                   f"complete new data is in {self.tmp})")
        try:
            os.link(self.tmp, self.path)
        except FileExistsError:
            raise appeared from None
        except OSError:
            if self.path.exists():
                raise appeared from None
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)

    def abort(self) -> None:
        """Close without publishing: what was written stays in ``.partial`` for inspection."""
        try:
            self.f.close()
        except Exception:
            pass
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            try:  # unlink while still holding it (see _lock)
                os.unlink(self.lock)
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _put(g: h5py.Group, name: str, data: np.ndarray, **kw: Any) -> None:
    g.create_dataset(name, data=data, **kw).attrs["crc32"] = _crc32(data)


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
        try:
            self._read_index(allow_incomplete)
        except DatasetError:
            self.f.close()
            raise
        except (KeyError, OSError, ValueError, TypeError) as e:  # missing header fields, corrupt metadata
            self.f.close()
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise DatasetError(f"{self.path}: dataset header or episode index is missing or corrupt: {msg}") from e

    def _read_index(self, allow_incomplete: bool) -> None:
        """Header and per-episode shapes (a KeyError or OSError here means a damaged file)."""
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
        key = self.keys[i]
        try:
            g = self.f["episodes"][key]
            read = lambda n: self._read(key, g, n)  # noqa: E731
            opt = lambda n: read(n) if n in g else None  # noqa: E731
            return Episode(
                state=read("state"), action=read("action"), reward=read("reward"), success=read("success"),
                instruction=str(g.attrs["instruction"]), task_id=int(g.attrs["task_id"]),
                seed=None if int(g.attrs["seed"]) < 0 else int(g.attrs["seed"]),
                images={c: read(f"images/{c}") for c in self.cameras} if images and self.cameras else None,
                sim_state=opt("sim_state"), final_state=opt("final_state"), final_sim_state=opt("final_sim_state"))
        except (OSError, KeyError) as e:
            raise DatasetError(f"{self.path}: episode {key} is unreadable (corrupt data): {e}") from e

    def _read(self, key: str, g: h5py.Group, name: str) -> np.ndarray:
        """One array, checked against the crc32 its writer stored (older files have none)."""
        d = g[name]
        a = d[()]
        want = d.attrs.get("crc32")
        if want is not None and _crc32(a) != int(want):
            raise DatasetError(f"{self.path}: episode {key} field {name} fails its checksum (its bytes changed "
                               "after it was written: corrupt file)")
        return a

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
