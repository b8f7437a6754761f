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
``complete`` is set and the whole file has read back intact (episode count, every array against its
checksum), so a killed run never leaves a file that looks complete, and the episodes it did write
stay readable in the ``.partial`` file (``Dataset(path, allow_incomplete=True)``).
One writer per path: it holds an exclusive lock on ``PATH.lock`` before touching ``PATH.partial``
(a second writer would otherwise truncate the first one's file), and for its whole life a lock on
``PATH.partial`` itself, taken before anything truncates it (so deleting a stale-looking
``PATH.lock`` does not let a second writer in, with or without HDF5's own file locking). Locks die
with their process: a killed run leaves none. It refuses to truncate a ``.partial`` left by a killed
run unless told to overwrite, never renames over a ``PATH`` that appeared while it was writing, and
never publishes a ``.partial`` that was removed or replaced under it.
Before each episode it checks that the episode fits the free space (and the file size limit): a
full disk ends in one :class:`~dataset.files.DiskFullError` naming the file and the space left,
with the episodes written before readable in the ``.partial`` (HDF5 itself crashes in its flush when
a write fails for lack of space).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np

from dataset.files import (disk_full_errno, disk_full_error, human, lock_exclusive, other_process, room_for,
                           same_file)
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
            who = other_process(fd)
            os.close(fd)
            raise DatasetError(f"{path.with_suffix('')} is being written by {who} (it holds {path.name}); "
                               "wait for it to finish or write to another path") from None
        if same_file(fd, path):
            return fd
        os.close(fd)


def _lock_partial(partial: Path, target: Path, lock: Path, create: bool) -> int | None:
    """``partial`` opened (created if ``create``) without truncating it, and locked for this writer's
    life; None if it does not exist and ``create`` is false. A live writer of it (ours, whose lock
    file was deleted, or any HDF5 program that has it open) is refused in one line naming it."""
    while True:
        try:
            fd = os.open(partial, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            return None
        try:
            try:
                lock_exclusive(fd)  # groundflow writers: held from before h5py truncates until after publishing
            except BlockingIOError:
                who = other_process(fd)
                raise DatasetError(f"{target} is being written by {who}: it holds {partial.name}, although "
                                   f"{lock.name} was removed; wait for it to finish or write to another path") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # HDF5's own lock (older writers, other tools) ...
            except BlockingIOError:
                who = other_process(fd)
                raise DatasetError(f"{partial} is open in {who}, whose HDF5 library holds a lock on it; close it "
                                   f"there (or wait for that run to finish) before writing {target.name}") from None
            fcntl.flock(fd, fcntl.LOCK_UN)  # ... which our h5py takes itself
        except BaseException:
            os.close(fd)
            raise
        if same_file(fd, partial):
            return fd
        os.close(fd)


def _create(partial: Path) -> h5py.File:
    """``partial`` truncated and opened for writing by h5py, whose own file lock is only an extra: this
    writer already holds its lock. Where the two locks meet (flock emulated with byte-range locks on
    NFS; no OFD locks off Linux) h5py opens without its own."""
    if not hasattr(fcntl, "F_OFD_SETLK"):
        return h5py.File(partial, "w", locking=False)
    try:
        return h5py.File(partial, "w")
    except OSError as e:
        if "lock" not in str(e):
            raise
        return h5py.File(partial, "w", locking=False)


_RESERVE = 256 * 1024
"""bytes kept free beyond each episode, for the metadata HDF5 writes when it flushes and closes"""


def _episode_bytes(ep: "Episode") -> int:
    """An upper bound of what writing ``ep`` adds to the file: its raw bytes (lzf may grow random
    images a little), and per array an object header, its chunk index and attributes."""
    arrays = [ep.state, ep.action, ep.reward, ep.success, ep.sim_state, ep.final_state, ep.final_sim_state,
              *(ep.images or {}).values()]
    arrays = [np.asarray(a) for a in arrays if a is not None]
    return int(1.1 * sum(a.nbytes for a in arrays)) + 8192 * len(arrays) + 16384


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
        self.f: h5py.File | None = None
        self.n = 0
        self._tmp_fd: int | None = None
        self._lock_fd: int | None = _lock(self.lock)  # before anything can truncate a .partial
        try:
            self._tmp_fd = self._claim_partial()
            self.f = _create(self.tmp)
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

    def _claim_partial(self) -> int:
        """The locked, open ``.partial`` this writer may truncate (see :func:`_lock_partial`)."""
        fd = _lock_partial(self.tmp, self.path, self.lock, create=False)  # a live writer of it is refused first
        try:
            if self.path.exists() and not self.overwrite:
                raise FileExistsError(f"{self.path} exists; pass overwrite=True (--overwrite) to replace it")
            if fd is not None and not self.overwrite:
                raise FileExistsError(f"{self.tmp} exists: an earlier run writing {self.path.name} did not finish (its "
                                      "episodes are readable with Dataset(path, allow_incomplete=True)); pass "
                                      "overwrite=True (--overwrite) to discard it")
            if fd is None:
                code = room_for(self.path.parent, _RESERVE)
                if code is not None:
                    raise disk_full_error(self.path, code, "; nothing written", _RESERVE)
                fd = _lock_partial(self.tmp, self.path, self.lock, create=True)
            return fd
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise

    def add(self, ep: Episode) -> None:
        """Append one episode and flush it (it survives a crash in the ``.partial``). An episode that
        does not fit the disk raises :class:`DiskFullError` and closes the writer, keeping the episodes
        written before in the ``.partial`` (or removing the ``.partial`` if there are none)."""
        if self.f is None:
            raise DatasetError(f"the writer of {self.path} is closed")
        T = len(ep)
        if ep.state.shape != (T, self.state_dim):
            raise DatasetError(f"episode state has shape {ep.state.shape}, expected ({T}, {self.state_dim})")
        if ep.action.shape != (T, self.action_dim):
            raise DatasetError(f"episode action has shape {ep.action.shape}, expected ({T}, {self.action_dim})")
        if not np.all(np.isfinite(ep.action)):
            raise DatasetError("episode contains non-finite actions")
        for cam in self.cameras:
            if not ep.images or cam not in ep.images:
                raise DatasetError(f"episode lacks images of camera {cam!r}")
        need = _episode_bytes(ep) + _RESERVE
        code = room_for(self.tmp, need, os.fstat(self._tmp_fd).st_size)
        if code is not None:  # checked before HDF5 writes anything: a write that fails inside it crashes its flush
            raise self._give_up(code, need=need)
        try:
            self._write(ep)
        except Exception as e:
            code = disk_full_errno(e)
            if code is None:
                raise
            raise self._give_up(code, failed=e) from e

    def _write(self, ep: Episode) -> None:
        T = len(ep)
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
            img = np.asarray(ep.images[cam])
            _put(g, f"images/{cam}", img, chunks=(1, *img.shape[1:]), compression="lzf")
        self.f.attrs["n_episodes"] = self.n + 1
        self.f.flush()  # episodes written so far survive a crash in the .partial file
        self.n += 1

    def close(self) -> Path:
        """Mark the file complete, check that it reads back intact and is still the file this writer
        locked, and publish it as ``path`` (nothing is published otherwise)."""
        if self.f is None:
            raise DatasetError(f"the writer of {self.path} is closed")
        try:
            try:
                self.f.attrs["complete"] = True
                self.f.close()
            except Exception as e:
                code = disk_full_errno(e)
                if code is None:
                    raise
                raise self._give_up(code, failed=e) from e
            self.f = None
            self._verify()
            if self.overwrite:
                os.replace(self.tmp, self.path)
            else:
                self._publish_new()
        finally:
            self._unlock()
        return self.path

    def _verify(self) -> None:
        """Refuse to publish a ``.partial`` that is not the file this writer locked and wrote, or that
        does not read back whole (episode count, every array against its checksum)."""
        nothing = f"not publishing {self.path}: {self.tmp}"
        if not self.tmp.exists():
            raise DatasetError(f"{nothing} was removed while this run was writing it (by another process?); the "
                               f"{self.n} episode(s) this run wrote are lost")
        if not same_file(self._tmp_fd, self.tmp):
            raise DatasetError(f"{nothing} was replaced while this run was writing it (by another process?); that file "
                               f"is left as it is, and the {self.n} episode(s) this run wrote are lost")
        try:
            with _OwnPartial(self.tmp) as ds:
                if len(ds) != self.n:
                    raise DatasetError(f"{self.tmp} holds {len(ds)} episodes, this run wrote {self.n}")
                for i in range(len(ds)):
                    ds.episode(i)  # every array against the crc32 written with it
        except DatasetError as e:
            raise DatasetError(f"not publishing {self.path}: it does not read back intact: {e} (kept for "
                               f"inspection in {self.tmp})") from e

    def _publish_new(self) -> None:
        """Rename ``.partial`` to ``path`` unless ``path`` appeared meanwhile (another tool, a copy):
        a hard link is an atomic no-clobber rename; filesystems without links check, then rename."""
        appeared = FileExistsError(f"{self.path} appeared while this run was writing it; not replacing it (the "
                                   f"complete new data is in {self.tmp})")
        try:
            os.link(self.tmp, self.path)
        except FileExistsError:
            raise appeared from None
        except FileNotFoundError:
            raise DatasetError(f"not publishing {self.path}: {self.tmp} was removed while this run was publishing "
                               "it (by another process?)") from None
        except OSError:
            if self.path.exists():
                raise appeared from None
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)

    def _give_up(self, code: int, failed: BaseException | None = None, need: int | None = None) -> Exception:
        """The writer closed after a write that found (or would find) no room; the error to raise.
        The episodes flushed before stay in the ``.partial``; one with none is removed."""
        kept = self.n
        damaged = failed is not None
        try:
            if self.f is not None:
                self.f.close()
        except Exception:  # noqa: BLE001 - HDF5 could not write its metadata: the file may be damaged
            damaged = True
        self.f = None
        if kept == 0 and same_file(self._tmp_fd, self.tmp):
            self.tmp.unlink()
        self._unlock()
        if kept == 0:  # (named by its final name: the .partial is gone)
            return disk_full_error(self.path, code, "; no episode was written, nothing kept", need)
        size = human(self.tmp.stat().st_size) if self.tmp.exists() else "?"
        state = ("it may be damaged: the failed write was HDF5's own" if damaged else
                 "readable with Dataset(path, allow_incomplete=True)")
        what = f"the {kept} episodes written before are" if kept > 1 else "the episode written before is"
        then = f"; {what} kept in {self.tmp} ({size}, {state}); make room, then delete it or rerun with --overwrite"
        return disk_full_error(self.tmp, code, then, need)

    def abort(self) -> None:
        """Close without publishing: what was written stays in ``.partial`` for inspection."""
        try:
            if self.f is not None:
                self.f.close()
        except Exception:
            pass
        self.f = None
        self._unlock()

    def _unlock(self) -> None:
        if self._tmp_fd is not None:
            os.close(self._tmp_fd)
            self._tmp_fd = None
        if self._lock_fd is not None:
            if same_file(self._lock_fd, self.lock):  # unlink while still holding it (see _lock); never
                with contextlib.suppress(FileNotFoundError):  # a lock file that replaced ours
                    os.unlink(self.lock)
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
            self.f = self._open()
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

    def _open(self) -> h5py.File:
        return h5py.File(self.path, "r")

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


class _OwnPartial(Dataset):
    """A writer reading back the ``.partial`` it holds locked before publishing it: without HDF5's own
    file lock, which can meet the writer's (see :func:`_create`)."""

    def _open(self) -> h5py.File:
        return h5py.File(self.path, "r", locking=False)
