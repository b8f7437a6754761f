"""One dataset format for simulated demos, recorded robot episodes and debugging traces.

HDF5 layout (``format = "groundflow-dataset"``, ``version = 1``)::

    /                       attrs: format, version, env_id, state_dim, action_dim, cameras (json),
                                   meta (json), complete (bool, set last), n_episodes, layout_sha256
    /episodes/000000/       attrs: instruction, task_id, seed, length, success, layout_sha256
        state      (T, S) float32     observation state at each step
        action     (T, A) float32     action taken at that step
        reward     (T,)   float32
        success    (T,)   bool        info["success"] after the action
        sim_state  (T, D) float32     simulator state before the action (when the backend has one)
        final_state (S,)  float32     observation after the last action
        final_sim_state (D,)
        images/<camera> (T, h, w, 3) uint8

Every per-episode array carries a ``crc32`` attribute of its raw bytes, checked when it is read, so
flipped bytes are an error rather than silently different training data. The metadata has a checksum
too: each episode's ``layout_sha256`` covers its attributes (instruction, task_id, seed, ...) and the
names, dtypes, shapes, chunking and attributes of its arrays; the file's covers its own attributes and
the episode names with their digests. A changed datatype (float32 read as uint32), name or attribute
value is an error naming the file and the episode. Files written before either existed have none and
load unchecked; a file that has some of them must have all.
Every error the reader meets on a damaged file is a :class:`DatasetError` naming the file.

Writes are atomic: the writer fills ``PATH.partial`` and renames it to ``PATH`` only after
``complete`` is set and the whole file has read back intact (episode count, every array against its
checksum, every layout against its digest), so a killed run never leaves a file that looks complete.
HDF5 is not crash-safe (a kill during its metadata writes can leave the whole ``.partial`` unreadable),
so every episode is first written to a journal, ``PATH.episodes/``: one small HDF5 file per episode
(written as ``NNNNNN.h5.tmp``, fsynced, renamed; the same group as in the dataset, which is then
copied into the ``.partial`` chunk for chunk) beside ``header.json`` (the file's attributes and their
sha256). An episode :meth:`DatasetWriter.add` returned from is in the journal, so it survives any kill;
``Dataset(PATH.partial, allow_incomplete=True)`` (or ``Dataset(PATH, ...)`` while ``PATH`` does not
exist) reads a killed run's episodes from its journal, and a re-run names how many it recovers. The
journal is removed once the closed ``.partial`` has read back whole, just before it is published.
One writer per path: it holds an exclusive lock on ``PATH.lock`` before touching ``PATH.partial``
(a second writer would otherwise truncate the first one's file), and for its whole life a lock on
``PATH.partial`` itself, taken before anything truncates it or its journal (so deleting a
stale-looking ``PATH.lock`` does not let a second writer in, with or without HDF5's own file locking).
Locks die with their process: a killed run leaves none. It refuses to truncate a ``.partial`` (or a
journal) left by a killed run unless told to overwrite, never renames over a ``PATH`` that appeared
while it was writing, and never publishes a ``.partial`` that was removed or replaced under it.
Before each episode it checks that the episode fits the free space twice (journal and ``.partial``)
and the file size limit: a full disk ends in one :class:`~dataset.files.DiskFullError` naming the
file and the space left, with the episodes written before recoverable (HDF5 itself crashes in its
flush when a write fails for lack of space).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
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
DIGEST = "layout_sha256"
"""the attribute (of the file and of each episode group) holding the sha256 of its layout"""
JOURNAL = ".episodes"
"""``PATH.episodes/``: the journal of the run writing ``PATH`` (see the module docstring)"""
_HEADER = "header.json"
_JOURNAL_EPISODE = re.compile(r"^(\d{6})\.h5$")
_JOURNAL_TMP = re.compile(r"^(\d{6}\.h5|header\.json)\.tmp$")


class DatasetError(GroundflowError, ValueError):
    """A dataset that is missing, truncated, incomplete or inconsistent."""


def _crc32(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a))


# ----- layout digests ---------------------------------------------------------------------------

def _feed(h: Any, *parts: bytes) -> None:
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)


def _value_bytes(v: Any) -> bytes:
    """An attribute value as h5py reads it back, with its type: a value read with another datatype
    (int64 as uint64, a str as bytes) is a different value."""
    if isinstance(v, str):
        return b"s" + v.encode("utf-8", "surrogatepass")
    if isinstance(v, bytes):
        return b"b" + v
    a = np.asarray(v)
    head = a.dtype.str.encode() + repr(a.shape).encode()
    if a.dtype.kind == "O":
        h = hashlib.sha256()
        for x in a.ravel():
            _feed(h, _value_bytes(x))
        return b"o" + head + h.digest()
    return b"a" + head + a.tobytes()


def _feed_attrs(h: Any, attrs: Any) -> None:
    for k in sorted(k for k in attrs.keys() if k != DIGEST):
        _feed(h, k.encode("utf-8", "surrogatepass"), _value_bytes(attrs[k]))


def _episode_digest(g: h5py.Group) -> str:
    """sha256 of an episode group's layout as read back: its attributes, and the name, dtype, shape,
    chunking, compression and attributes (crc32) of everything in it."""
    h = hashlib.sha256(b"groundflow episode layout 1")
    _feed_attrs(h, g.attrs)
    items: list[tuple[str, Any]] = []
    g.visititems(lambda name, obj: items.append((name, obj)))
    for name, obj in sorted(items, key=lambda x: x[0]):
        if isinstance(obj, h5py.Dataset):
            _feed(h, b"D", name.encode("utf-8", "surrogatepass"), obj.dtype.str.encode(), repr(obj.shape).encode(),
                  repr(obj.chunks).encode(), repr(obj.compression).encode())
        else:
            _feed(h, b"G", name.encode("utf-8", "surrogatepass"))
        _feed_attrs(h, obj.attrs)
    return h.hexdigest()


def _file_digest(attrs: Any, digests: dict[str, str | None]) -> str:
    """sha256 of the file's attributes and its episode names with their layout digests."""
    h = hashlib.sha256(b"groundflow dataset layout 1")
    _feed_attrs(h, attrs)
    for k in sorted(digests):
        _feed(h, k.encode("utf-8", "surrogatepass"), str(digests[k] or "").encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _json_digest(header: dict) -> str:
    return hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ----- durable small files (the journal) ----------------------------------------------------------

def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _journal_of(path: Path) -> Path | None:
    """The journal ``Dataset(path, allow_incomplete=True)`` reads: that of ``X`` for ``X.partial``, and
    that of ``path`` itself while ``path`` does not exist (its run has not published it)."""
    if path.name.endswith(".partial") and len(path.name) > len(".partial"):
        return path.with_name(path.name[:-len(".partial")] + JOURNAL)
    if not path.exists():
        return path.with_name(path.name + JOURNAL)
    return None


def _journal_keys(journal: Path) -> list[str]:
    return sorted(m.group(1) for p in journal.iterdir() if (m := _JOURNAL_EPISODE.match(p.name)))


def _clear_journal(journal: Path) -> None:
    """Remove a journal: its header first (a journal without one holds nothing to recover), then its
    episode files; files it did not write are left, and named."""
    if journal.is_symlink() or (journal.exists() and not journal.is_dir()):
        raise DatasetError(f"{journal} is in the way of this writer's journal (not a folder it wrote); move it away")
    if not journal.exists():
        return
    (journal / _HEADER).unlink(missing_ok=True)
    foreign = []
    for p in journal.iterdir():
        if _JOURNAL_EPISODE.match(p.name) or _JOURNAL_TMP.match(p.name):
            p.unlink(missing_ok=True)
        else:
            foreign.append(p.name)
    if foreign:
        names = ", ".join(sorted(foreign)[:3])
        raise DatasetError(f"{journal} holds files the dataset writer did not write ({names}); move them away")
    journal.rmdir()


def _recoverable(partial: Path) -> str:
    """What the re-run's hint says about the episodes a killed run left in ``partial`` (or its journal):
    how many read back whole (every array against its crc32, every layout against its digest) and how."""
    try:
        with _OwnPartial(partial, allow_incomplete=True) as ds:
            n = len(ds)
            for i in range(n):
                ds.episode(i)
            journal = ds.journal
    except DatasetError as e:
        return f"no episode in it is recoverable ({e})"
    if n == 0:
        return "no episode it wrote is recoverable (it was killed before it finished its first)"
    src = f" from its journal {journal.name}/" if journal is not None else ""
    return (f"{n} episode{'s' if n > 1 else ''} it wrote {'are' if n > 1 else 'is'} recoverable: "
            f"Dataset({str(partial)!r}, allow_incomplete=True) reads {'them' if n > 1 else 'it'}{src}")


# ----- locks ------------------------------------------------------------------------------------

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


def check_output_path(path: str | os.PathLike) -> None:
    """Refuse, in one line naming it, a dataset path that cannot become a file: an existing directory
    (``overwrite`` replaces a file, never a folder; the final rename would fail only after every
    episode was collected) or one below a regular file."""
    path = Path(path)
    if path.is_dir():
        raise FileExistsError(f"{path} is a directory; a dataset is one HDF5 file: give a file path such as "
                              f"{path / 'demos.h5'} (--overwrite replaces a file, never a directory)")
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise FileExistsError(f"cannot write {path}: {parent} is a file, not a directory")
            return


class DatasetWriter:
    """Writes episodes to ``path`` atomically (``path.partial`` until :meth:`close`), each episode
    first to the journal ``path.episodes/`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, env_id: str, state_dim: int, action_dim: int,
                 cameras: tuple[str, ...] = (), meta: dict[str, Any] | None = None, overwrite: bool = False):
        self.path = Path(path)
        self.overwrite = overwrite
        check_output_path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.lock = self.path.with_name(self.path.name + ".lock")
        self.journal = self.path.with_name(self.path.name + JOURNAL)
        self.f: h5py.File | None = None
        self.n = 0  # episodes in the .partial
        self._journaled = 0  # episodes in the journal (one more than n while an add() copies its episode)
        self._digests: dict[str, str] = {}
        self._tmp_fd: int | None = None
        header = {"format": FORMAT, "version": VERSION, "env_id": str(env_id), "state_dim": int(state_dim),
                  "action_dim": int(action_dim), "cameras": list(cameras), "meta": meta or {}}
        json.dumps(header)  # (meta that is not JSON fails here, before anything is written)
        self._lock_fd: int | None = _lock(self.lock)  # before anything can truncate a .partial
        created = False
        try:
            self._tmp_fd, created = self._claim_partial()
            self._start_journal(header)
            self.f = _create(self.tmp)
        except BaseException:
            if created and self._tmp_fd is not None and same_file(self._tmp_fd, self.tmp):
                with contextlib.suppress(OSError):
                    self.tmp.unlink()  # (the empty file this writer created: nothing to keep)
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
        self._seal()
        self.state_dim, self.action_dim, self.cameras = int(state_dim), int(action_dim), tuple(cameras)

    def _claim_partial(self) -> tuple[int, bool]:
        """The locked, open ``.partial`` this writer may truncate (see :func:`_lock_partial`), and
        whether this call created it. A killed run's ``.partial`` or journal is refused (unless
        overwriting) with what of it is recoverable."""
        fd = _lock_partial(self.tmp, self.path, self.lock, create=False)  # a live writer of it is refused first
        try:
            if self.path.exists() and not self.overwrite:
                raise FileExistsError(f"{self.path} exists; pass overwrite=True (--overwrite) to replace it")
            if not self.overwrite:
                stale = self.tmp if fd is not None else self._stale_journal()
                if stale is not None:
                    raise FileExistsError(f"{stale} exists: an earlier run writing {self.path.name} did not finish; "
                                          f"{_recoverable(self.tmp)}; pass overwrite=True (--overwrite) to discard it")
            if fd is not None:
                return fd, False
            code = room_for(self.path.parent, _RESERVE)
            if code is not None:
                raise disk_full_error(self.path, code, "; nothing written", _RESERVE)
            return _lock_partial(self.tmp, self.path, self.lock, create=True), True
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise

    def _stale_journal(self) -> Path | None:
        """A journal without its ``.partial`` that still holds episodes (one with none is cleared)."""
        if (self.journal / _HEADER).is_file() and _journal_keys(self.journal):
            return self.journal
        return None

    def _start_journal(self, header: dict) -> None:
        _clear_journal(self.journal)  # a killed run's (this writer holds its .partial: nobody else writes it)
        self.journal.mkdir()
        _fsync_dir(self.journal.parent)
        self._durable(self.journal / _HEADER, json.dumps({**header, "digest": _json_digest(header)}).encode())

    def _durable(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(path.parent)

    def _seal(self) -> None:
        """(Re)write the file's layout digest: after its attributes or its episodes changed."""
        self.f.attrs[DIGEST] = _file_digest(self.f.attrs, self._digests)

    def add(self, ep: Episode) -> None:
        """Append one episode: once this returns it is in the journal (fsynced) and flushed to the
        ``.partial``, and survives any crash. An episode that does not fit the disk raises
        :class:`DiskFullError` and closes the writer, keeping the episodes written before
        (or removing the ``.partial`` and the journal if there are none)."""
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
        one = _episode_bytes(ep)
        need = one + _RESERVE
        code = room_for(self.tmp, need, os.fstat(self._tmp_fd).st_size, elsewhere=one)  # (and the journal's copy)
        if code is not None:  # checked before HDF5 writes anything: a write that fails inside it crashes its flush
            raise self._give_up(code, need=need + one)
        try:
            self._write(ep)
        except Exception as e:
            code = disk_full_errno(e)
            if code is None:
                self.abort()  # a half-added episode: no further add() into this .partial
                raise
            raise self._give_up(code, failed=e) from e

    def _write(self, ep: Episode) -> None:
        key = f"{self.n:06d}"
        final = self.journal / f"{key}.h5"
        tmp = final.with_name(final.name + ".tmp")
        try:  # the journal first: from its rename on, the episode survives any kill
            with h5py.File(tmp, "w", locking=False) as jf:
                digest = _fill(jf.create_group(key), ep, self.cameras)
            _fsync_file(tmp)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(self.journal)
        self._journaled += 1
        with h5py.File(final, "r", locking=False) as jf:  # the same group, its (compressed) chunks copied as they are
            self.group.copy(jf[key], self.group, name=key)
        self._digests[key] = digest
        self.f.attrs["n_episodes"] = self.n + 1
        self._seal()
        self.f.flush()  # (the .partial alone survives most crashes too)
        self.n += 1

    def close(self) -> Path:
        """Mark the file complete, check that it reads back intact and is still the file this writer
        locked, remove the journal and publish it as ``path`` (nothing is published otherwise)."""
        if self.f is None:
            raise DatasetError(f"the writer of {self.path} is closed")
        try:
            try:
                self.f.attrs["complete"] = True
                self._seal()
                self.f.close()
            except Exception as e:
                code = disk_full_errno(e)
                if code is None:
                    raise
                raise self._give_up(code, failed=e) from e
            self.f = None
            self._verify()
            with contextlib.suppress(OSError, DatasetError):  # the verified .partial holds every episode now
                _clear_journal(self.journal)
            if self.overwrite:
                os.replace(self.tmp, self.path)
            else:
                self._publish_new()
        finally:
            self._unlock()
        return self.path

    def _verify(self) -> None:
        """Refuse to publish a ``.partial`` that is not the file this writer locked and wrote, or that
        does not read back whole (episode count, every array against its checksum, every layout
        against its digest)."""
        nothing = f"not publishing {self.path}: {self.tmp}"
        gone = None
        if not self.tmp.exists():
            gone = "removed"
        elif not same_file(self._tmp_fd, self.tmp):
            gone = "replaced"
        if gone is not None:  # another process took the path over: this run's journal goes with its .partial
            with contextlib.suppress(OSError, DatasetError):
                _clear_journal(self.journal)
            left = "" if gone == "removed" else "; that file is left as it is"
            raise DatasetError(f"{nothing} was {gone} while this run was writing it (by another process?){left}, and "
                               f"the {self.n} episode(s) this run wrote are lost")
        try:
            with _OwnPartial(self.tmp) as ds:
                if len(ds) != self.n:
                    raise DatasetError(f"{self.tmp} holds {len(ds)} episodes, this run wrote {self.n}")
                for i in range(len(ds)):
                    ds.episode(i)  # every array against the crc32 written with it
        except DatasetError as e:
            raise DatasetError(f"not publishing {self.path}: it does not read back intact: {e} (kept for "
                               f"inspection in {self.tmp}; the {self._journaled} episode(s) this run wrote are intact "
                               f"in its journal {self.journal.name}/, which Dataset({str(self.tmp)!r}, "
                               "allow_incomplete=True) reads)") from e

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
        The episodes written before stay recoverable; with none, the ``.partial`` and journal are removed."""
        kept = self._journaled
        try:
            if self.f is not None:
                self.f.close()
        except Exception:  # noqa: BLE001 - HDF5 could not write its metadata: the .partial may be damaged
            pass
        self.f = None
        if kept == 0 and same_file(self._tmp_fd, self.tmp):
            self.tmp.unlink()
            with contextlib.suppress(OSError, DatasetError):
                _clear_journal(self.journal)
        self._unlock()
        if kept == 0:  # (named by its final name: the .partial is gone)
            return disk_full_error(self.path, code, "; no episode was written, nothing kept", need)
        size = human(self.tmp.stat().st_size) if self.tmp.exists() else "?"
        what = f"the {kept} episodes written before are" if kept > 1 else "the episode written before is"
        then = (f"; {what} kept in {self.tmp} ({size}) and its journal {self.journal.name}/ (recoverable with "
                f"Dataset({str(self.tmp)!r}, allow_incomplete=True)); make room, then delete both or rerun with "
                "--overwrite")
        return disk_full_error(self.tmp, code, then, need)

    def abort(self) -> None:
        """Close without publishing: what was written stays in ``.partial`` and the journal, for
        inspection and recovery."""
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


def _fill(g: h5py.Group, ep: Episode, cameras: tuple[str, ...]) -> str:
    """Write ``ep`` into the empty group ``g`` (attributes, arrays with their crc32) and its layout
    digest; returns the digest."""
    T = len(ep)
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
    for cam in cameras:
        img = np.asarray(ep.images[cam])
        _put(g, f"images/{cam}", img, chunks=(1, *img.shape[1:]), compression="lzf")
    digest = _episode_digest(g)  # of the layout as h5py reads it back
    g.attrs[DIGEST] = digest
    return digest


def _put(g: h5py.Group, name: str, data: np.ndarray, **kw: Any) -> None:
    g.create_dataset(name, data=data, **kw).attrs["crc32"] = _crc32(data)


class Dataset:
    """Validating reader. Loads episodes lazily; ``frames()`` gives a LeRobot-style table.

    With ``allow_incomplete``, a run's ``PATH.partial`` (or ``PATH`` while it does not exist) is read
    from the run's journal ``PATH.episodes/`` where it has one: every episode the run's writer
    acknowledged, even when a kill left the HDF5 ``.partial`` unreadable. Any damage found (in the
    arrays, their layout or the file's header) raises a :class:`DatasetError` naming the file."""

    def __init__(self, path: str | os.PathLike, allow_incomplete: bool = False):
        self.path = Path(path)
        self.f: h5py.File | None = None
        self.journal: Path | None = None  # where the episodes are read from when they come from a journal
        self._digested = False  # whether layouts have digests to check (files written before them have none)
        self._checked: set[str] = set()  # episodes whose layout matched its digest
        journal = _journal_of(self.path) if allow_incomplete else None
        if journal is not None and (journal / _HEADER).is_file():
            self.journal = journal
            try:
                self._read_journal_index()
            except DatasetError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever a damaged journal raises: one error naming it
                raise DatasetError(f"{journal}: the journal of the run writing {self.path.name} is damaged: "
                                   f"{type(e).__name__}: {e}") from e
            return
        if not self.path.exists():
            partial = self.path.with_name(self.path.name + ".partial")
            left = partial if partial.exists() else self.path.with_name(self.path.name + JOURNAL)
            hint = (f" (an unfinished {left.name} exists: the run that wrote it did not finish; what of it is "
                    f"recoverable reads with Dataset({str(partial)!r}, allow_incomplete=True))") if left.exists() else ""
            raise DatasetError(f"dataset {self.path} does not exist{hint}")
        try:
            self.f = self._open()
        except Exception as e:  # noqa: BLE001 - OSError mostly; any error opening a damaged file
            raise DatasetError(f"{self.path} is not a readable HDF5 dataset (truncated or corrupt?): {e}") from e
        try:
            self._read_index(allow_incomplete)
        except DatasetError:
            self.f.close()
            raise
        except Exception as e:  # noqa: BLE001 - missing header fields, corrupt metadata: KeyError, OSError,
            self.f.close()      # ValueError (bad JSON), TypeError, UnicodeError, RuntimeError from h5py
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise DatasetError(f"{self.path}: dataset header or episode index is missing or corrupt: "
                               f"{type(e).__name__}: {msg}") from e

    def _open(self) -> h5py.File:
        return h5py.File(self.path, "r")

    def _read_index(self, allow_incomplete: bool) -> None:
        """Header, layout digests and per-episode shapes (any exception here means a damaged file)."""
        a = self.f.attrs
        if a.get("format") != FORMAT:
            raise DatasetError(f"{self.path} is not a groundflow dataset (format={a.get('format')!r})")
        if int(a.get("version", -1)) != VERSION:
            raise DatasetError(f"{self.path}: unsupported dataset version {a.get('version')} (this reader: {VERSION})")
        if not bool(a.get("complete", False)) and not allow_incomplete:
            raise DatasetError(f"{self.path} is incomplete (the writing run did not finish)")
        env_id, state_dim, action_dim, cameras, meta = (a[k] for k in ("env_id", "state_dim", "action_dim", "cameras",
                                                                       "meta"))  # (a KeyError names the one missing)
        episodes = self.f["episodes"]
        self.keys = sorted(episodes.keys())
        digests = {k: episodes[k].attrs.get(DIGEST) for k in self.keys}
        want = a.get(DIGEST)
        self._digested = want is not None or any(d is not None for d in digests.values())
        if self._digested:  # (files written before digests have none at all)
            if want is None:
                raise DatasetError(f"{self.path}: its header lacks the layout digest its episodes carry (damaged "
                                   "header: corrupt file)")
            if _file_digest(a, digests) != _text(want):
                raise DatasetError(f"{self.path}: its header or episode index fails its layout digest (attributes or "
                                   "episode names changed after it was written: corrupt file)")
        self.env_id = str(env_id)
        self.state_dim, self.action_dim = int(state_dim), int(action_dim)
        self.cameras = tuple(json.loads(cameras))
        self.meta = json.loads(meta)
        if bool(a.get("complete", False)) and len(self.keys) != int(a["n_episodes"]):
            raise DatasetError(f"{self.path}: header says {int(a['n_episodes'])} episodes, found {len(self.keys)}")
        for k in self.keys:  # (their layout digests are checked when they are read)
            self._validate(k, episodes[k], self.path)

    def _read_journal_index(self) -> None:
        j = self.journal
        header = json.loads((j / _HEADER).read_text(encoding="utf-8"))
        if not isinstance(header, dict) or _json_digest({k: v for k, v in header.items() if k != "digest"}) != \
                header.get("digest"):
            raise DatasetError(f"{j / _HEADER} fails its digest (changed after it was written: corrupt file)")
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise DatasetError(f"{j / _HEADER}: not a groundflow dataset journal of version {VERSION}")
        self.env_id = str(header["env_id"])
        self.state_dim, self.action_dim = int(header["state_dim"]), int(header["action_dim"])
        self.cameras = tuple(header["cameras"])
        self.meta = dict(header["meta"])
        self._digested = True
        self.keys = _journal_keys(j)
        if self.keys != [f"{i:06d}" for i in range(len(self.keys))]:
            missing = sorted(set(f"{i:06d}" for i in range(int(self.keys[-1]) + 1)) - set(self.keys))
            raise DatasetError(f"{j}: the journal lacks episode file(s) {missing[:3]} (removed by hand?)")
        for k in self.keys:
            with self._group(k, check=False) as (g, where):
                self._validate(k, g, where)

    @contextlib.contextmanager
    def _group(self, key: str, check: bool = True) -> Iterator[tuple[h5py.Group, Path]]:
        """Episode ``key``'s group, checked against its layout digest (once: the first time it is
        read, like its arrays against their crc32s), and the file it is in (for messages)."""
        if self.f is not None:
            g, where = self.f["episodes"][key], self.path
            self._check_layout(key, g, where, check)
            yield g, where
            return
        where = self.journal / f"{key}.h5"
        with h5py.File(where, "r", locking=False) as jf:
            if set(jf.keys()) != {key}:
                raise DatasetError(f"{where}: holds {sorted(jf.keys())[:3]}, not episode {key} (corrupt file)")
            self._check_layout(key, jf[key], where, check)
            yield jf[key], where

    def _check_layout(self, key: str, g: h5py.Group, where: Path, check: bool) -> None:
        if not check or not self._digested or key in self._checked:
            return
        want = g.attrs.get(DIGEST)
        if want is None or _episode_digest(g) != _text(want):
            raise DatasetError(f"{where}: episode {key} fails its layout digest (names, dtypes, shapes or attributes "
                               "changed after it was written: corrupt file)")
        self._checked.add(key)

    def _where(self, key: str) -> Path:
        return self.path if self.journal is None else self.journal / f"{key}.h5"

    def _validate(self, key: str, g: h5py.Group, where: Path) -> None:
        try:
            T = int(g.attrs["length"])
            fields = {n: g[n] for n in ("state", "action", "reward", "success")}
        except KeyError as e:
            raise DatasetError(f"{where}: episode {key} is missing {e}") from e
        expect = {"state": (T, self.state_dim), "action": (T, self.action_dim), "reward": (T,), "success": (T,)}
        for n, s in expect.items():
            if fields[n].shape != s:
                raise DatasetError(f"{where}: episode {key} field {n} has shape {fields[n].shape}, expected {s}")
        for n in ("state", "action", "reward"):  # float32 in every file ever written: anything else is damage
            if fields[n].dtype.kind != "f":
                raise DatasetError(f"{where}: episode {key} field {n} has dtype {fields[n].dtype}, expected float32 "
                                   "(corrupt file)")
        for cam in self.cameras:
            if f"images/{cam}" not in g or g[f"images/{cam}"].shape[0] != T:
                raise DatasetError(f"{where}: episode {key} lacks {T} images of camera {cam!r}")

    def __len__(self) -> int:
        return len(self.keys)

    def episode(self, i: int, images: bool = True) -> Episode:
        key = self.keys[i]
        try:
            with self._group(key) as (g, _):
                read = lambda n: self._read(key, g, n)  # noqa: E731
                opt = lambda n: read(n) if n in g else None  # noqa: E731
                return Episode(
                    state=read("state"), action=read("action"), reward=read("reward"), success=read("success"),
                    instruction=_text(g.attrs["instruction"]), task_id=int(g.attrs["task_id"]),
                    seed=None if int(g.attrs["seed"]) < 0 else int(g.attrs["seed"]),
                    images={c: read(f"images/{c}") for c in self.cameras} if images and self.cameras else None,
                    sim_state=opt("sim_state"), final_state=opt("final_state"),
                    final_sim_state=opt("final_sim_state"))
        except DatasetError:
            raise
        except Exception as e:  # noqa: BLE001 - OSError, KeyError, ValueError ... from a damaged file
            raise DatasetError(f"{self._where(key)}: episode {key} is unreadable (corrupt data): "
                               f"{type(e).__name__}: {e}") from e

    def _read(self, key: str, g: h5py.Group, name: str) -> np.ndarray:
        """One array, checked against the crc32 its writer stored (older files have none)."""
        d = g[name]
        a = d[()]
        want = d.attrs.get("crc32")
        if want is not None and _crc32(a) != int(want):
            raise DatasetError(f"{self._where(key)}: episode {key} field {name} fails its checksum (its bytes changed "
                               "after it was written: corrupt file)")
        return a

    def __iter__(self) -> Iterator[Episode]:
        for i in range(len(self)):
            yield self.episode(i)

    @property
    def instructions(self) -> list[str]:
        out = set()
        for k in self.keys:
            try:
                with self._group(k) as (g, _):
                    out.add(_text(g.attrs["instruction"]))
            except DatasetError:
                raise
            except Exception as e:  # noqa: BLE001
                raise DatasetError(f"{self._where(k)}: episode {k} is unreadable (corrupt data): "
                                   f"{type(e).__name__}: {e}") from e
        return sorted(out)

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
        if self.f is not None:
            with contextlib.suppress(Exception):  # (closing a damaged file can fail: there is nothing to save)
                self.f.close()

    def __enter__(self) -> "Dataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _text(v: Any) -> str:
    """A string attribute as written (h5py gives str; a damaged datatype may give bytes)."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    return str(v)


class _OwnPartial(Dataset):
    """A writer reading back the ``.partial`` it holds locked before publishing it: without HDF5's own
    file lock, which can meet the writer's (see :func:`_create`)."""

    def _open(self) -> h5py.File:
        return h5py.File(self.path, "r", locking=False)
