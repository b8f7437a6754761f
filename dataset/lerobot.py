"""LeRobotDataset, LeRobot's on-disk dataset format (v3.0 and v2.1), read as groundflow episodes and
written from them: datasets recorded with LeRobot train here as they are, and demos collected or
recorded here load in LeRobot.

Reading: ``open_dataset("lerobot:DIR")`` gives a :class:`LeRobotReader` with the interface of
:class:`dataset.Dataset` (``len``, ``episode(i)``, ``frames()``, ``cameras``, ``meta``, ...), so the one
place that loads training data (``train.data.ChunkData``) reads both formats and nothing is converted or
copied first. Layouts, by ``codebase_version`` in ``meta/info.json``::

    v3.0  data/chunk-CCC/file-FFF.parquet            rows of many episodes, in episode order
          videos/<key>/chunk-CCC/file-FFF.mp4        frames of many episodes, one after the other
          meta/episodes/chunk-CCC/file-FFF.parquet   per episode: length, tasks, data file and rows
                                                     (dataset_from/to_index), per camera its video file
                                                     and from/to_timestamp in it, stats/...
          meta/tasks.parquet                         task string (pandas index) -> task_index
    v2.1  data/chunk-CCC/episode_EEEEEE.parquet      one episode per file (CCC = EEEEEE // chunks_size)
          videos/chunk-CCC/<key>/episode_EEEEEE.mp4  one episode per file, from t = 0
          meta/episodes.jsonl, meta/tasks.jsonl, meta/episodes_stats.jsonl
    both  meta/info.json (fps, features: dtype, shape, names), meta/stats.json

Feature names map onto groundflow's episode by :class:`LeRobotFeatures`; other names than LeRobot's
defaults are given in the path, no code: ``lerobot:DIR?state=observation.joints,observation.gripper&
action=action.joints&camera.top=observation.images.cam_high`` (``cameras=none`` reads no images; quote
the path in a shell). Cameras stored as video (mp4) or as image features (PNG in the parquet) are read.
A video frame belongs to the row whose ``timestamp`` (plus the episode's ``from_timestamp`` in the file)
it carries, as in LeRobot's own reader; an episode's video is decoded once, sequentially from the
keyframe before its first frame: on one thread of the 2 shared cores, 2300 frames/s at 128 px and 1200
at 224 px from AV1, where the same frames read from HDF5 at 5800 and 2500 (benchmarks/interop.py), so
loading a dataset stays a small part of training. Every problem found is one :class:`DatasetError` line
naming the file.

Writing (``groundflow export --format lerobot``, :func:`write_lerobot`): every source is checked before
anything is written; the dataset is built in ``OUT.partial/`` and renamed to ``OUT`` once it reads back
whole. What LeRobot has no field for (env id, the collecting run's meta, per-episode task ids and
seeds) goes in ``meta/groundflow.json``, which LeRobot ignores and this reader uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from dataset.files import hold_directory
from dataset.hdf5 import Dataset, DatasetError, Episode
from envs.errors import InvalidOptionError

PREFIX = "lerobot:"
"""``--data lerobot:DIR`` reads the LeRobotDataset in DIR"""
VERSIONS = ("v2.1", "v3.0")
SIDECAR = "meta/groundflow.json"
IMAGE_PREFIX = "observation.images."
TOLERANCE_S = 1e-3
"""how far a video frame's time may be from its row's timestamp (LeRobot's reader allows 1e-4)"""
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
V30_DATA = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_VIDEO = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V30_EPISODES = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V21_DATA = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"


@dataclass(frozen=True)
class LeRobotFeatures:
    """Which LeRobot features become groundflow's state, action, cameras, reward and success."""

    state: tuple[str, ...] = ("observation.state",)
    """features concatenated (in this order) into the state vector"""
    action: str = "action"
    cameras: tuple[tuple[str, str], ...] | None = None
    """(groundflow camera, LeRobot feature) pairs; None: every image/video feature, named after its
    ``observation.images.`` suffix"""
    reward: str = "next.reward"
    """read where the dataset has it (zeros otherwise)"""
    success: str = "next.success"
    """read where the dataset has it (False otherwise)"""

    @classmethod
    def parse(cls, query: str, spec: str) -> "LeRobotFeatures":
        """``state=a,b&action=c&camera.NAME=d&cameras=none&reward=e&success=f`` (each optional)."""
        kw: dict[str, Any] = {}
        cams: list[tuple[str, str]] = []
        for item in filter(None, query.split("&")):
            key, eq, value = item.partition("=")
            if not eq or (not value and key != "cameras"):
                raise InvalidOptionError(f"{spec}: mapping item {item!r} is not KEY=FEATURE")
            if key == "state":
                kw["state"] = tuple(v for v in value.split(",") if v)
            elif key in ("action", "reward", "success"):
                kw[key] = value
            elif key.startswith("camera.") and len(key) > len("camera."):
                cams.append((key[len("camera."):], value))
            elif key == "cameras" and value in ("", "none"):
                kw["cameras"] = ()
            else:
                raise InvalidOptionError(f"{spec}: unknown mapping key {key!r}; valid: state, action, camera.NAME, "
                                         "cameras=none, reward, success")
        if cams:
            kw["cameras"] = tuple(cams)
        return cls(**kw)


def parse_spec(spec: str | os.PathLike) -> tuple[Path, LeRobotFeatures] | None:
    """(dataset folder, feature mapping) of a ``lerobot:DIR[?MAPPING]`` data path; None for others."""
    s = str(spec)
    if not s.startswith(PREFIX):
        return None
    path, _, query = s[len(PREFIX):].partition("?")
    if not path:
        raise InvalidOptionError(f"{s}: give the dataset folder after {PREFIX!r}")
    return Path(path).expanduser(), LeRobotFeatures.parse(query, s)


def open_dataset(path: str | os.PathLike, allow_incomplete: bool = False) -> "Dataset | LeRobotReader":
    """The reader for a ``--data`` path: :class:`LeRobotReader` for ``lerobot:DIR``, else the HDF5
    :class:`~dataset.Dataset` (``allow_incomplete`` is the HDF5 reader's)."""
    parsed = parse_spec(path)
    if parsed is None:
        return Dataset(path, allow_incomplete=allow_incomplete)
    return LeRobotReader(*parsed)


# ----- reading ----------------------------------------------------------------------------------

@dataclass
class _Ep:
    """Where one episode's rows and frames are."""

    index: int
    length: int
    data_file: Path
    start: int = 0
    """its first row in the reader's row arrays"""
    videos: dict[str, tuple[Path, float]] = field(default_factory=dict)
    """video feature -> (file, the episode's from_timestamp in it)"""


def _load_json(path: Path, root: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(f"{root}: not a LeRobotDataset: {path.relative_to(root)} is missing") from None
    except (OSError, UnicodeError, ValueError) as e:
        raise DatasetError(f"{path} is unreadable (truncated or corrupt?): {e}") from e


def _jsonl(path: Path, root: Path) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(ln) for ln in lines if ln.strip()]
    except FileNotFoundError:
        raise DatasetError(f"{root}: not a v2.1 LeRobotDataset: {path.relative_to(root)} is missing") from None
    except (OSError, UnicodeError, ValueError) as e:
        raise DatasetError(f"{path} is unreadable (truncated or corrupt?): {e}") from e


def _read_info(root: Path) -> dict:
    if not root.is_dir():
        raise DatasetError(f"LeRobotDataset {root} does not exist (or is not a folder)")
    info_path = root / "meta" / "info.json"
    info = _load_json(info_path, root)
    version = info.get("codebase_version") if isinstance(info, dict) else None
    if version not in VERSIONS:
        raise DatasetError(f"{info_path}: codebase_version {version!r} is not supported (this reader: "
                           f"{', '.join(VERSIONS)}; LeRobot's conversion scripts upgrade older datasets)")
    try:
        fps = float(info["fps"])
        features = {str(k): dict(v, shape=tuple(int(s) for s in v["shape"])) for k, v in info["features"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetError(f"{info_path}: fps or features missing or malformed ({type(e).__name__}: {e})") from e
    if not fps > 0:
        raise DatasetError(f"{info_path}: fps must be > 0, got {info['fps']!r}")
    return {**info, "fps": fps, "features": features}


def _table(path: Path, columns: Sequence[str] | None = None) -> Any:
    import pyarrow.parquet as pq
    if not path.is_file():
        raise DatasetError(f"{path} is missing (the dataset's metadata names it)")
    try:
        return pq.read_table(path, columns=list(columns) if columns is not None else None)
    except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError, KeyError (a column missing): one line
        raise DatasetError(f"{path} is unreadable (truncated or corrupt parquet?): {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from e


def _read_tasks(root: Path, version: str) -> dict[int, str]:
    if version == "v2.1":
        rows = _jsonl(root / "meta" / "tasks.jsonl", root)
        try:
            return {int(r["task_index"]): str(r["task"]) for r in rows}
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetError(f"{root / 'meta' / 'tasks.jsonl'}: a line lacks task_index or task ({e})") from e
    path = root / "meta" / "tasks.parquet"
    if not path.is_file():
        raise DatasetError(f"{root}: not a v3.0 LeRobotDataset: meta/tasks.parquet is missing")
    t = _table(path)
    pandas = json.loads((t.schema.metadata or {}).get(b"pandas", b"{}") or b"{}")
    names = [c for c in pandas.get("index_columns", []) if isinstance(c, str)] + ["task", "__index_level_0__"]
    name = next((n for n in names if n in t.column_names), None)
    if name is None or "task_index" not in t.column_names:
        raise DatasetError(f"{path}: no task strings and task_index columns (has {t.column_names})")
    return {int(i): str(s) for i, s in zip(t.column("task_index").to_pylist(), t.column(name).to_pylist())}


def _episodes_v30(root: Path, info: dict, video_keys: Sequence[str]) -> list[_Ep]:
    files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise DatasetError(f"{root}: not a v3.0 LeRobotDataset: no meta/episodes/chunk-*/file-*.parquet")
    video_cols = [f"videos/{k}/{c}" for k in video_keys for c in ("chunk_index", "file_index", "from_timestamp")]
    cols = ["episode_index", "length", "data/chunk_index", "data/file_index", "dataset_from_index", *video_cols]
    rows: dict[str, list] = {c: [] for c in cols}
    for f in files:
        t = _table(f)
        missing = [c for c in cols if c not in t.column_names]
        if missing:
            raise DatasetError(f"{f}: episode metadata lacks {missing[:3]}")
        for c in cols:
            rows[c] += t.column(c).to_pylist()
    data_path = str(info.get("data_path") or V30_DATA)
    video_path = str(info.get("video_path") or V30_VIDEO)
    out = []
    for j in np.argsort(rows["episode_index"], kind="stable"):
        r = {c: rows[c][j] for c in cols}
        ep = _Ep(int(r["episode_index"]), int(r["length"]), root / data_path.format(
            chunk_index=int(r["data/chunk_index"]), file_index=int(r["data/file_index"])),
            start=int(r["dataset_from_index"]))
        for k in video_keys:
            ep.videos[k] = (root / video_path.format(video_key=k, chunk_index=int(r[f"videos/{k}/chunk_index"]),
                                                     file_index=int(r[f"videos/{k}/file_index"])),
                            float(r[f"videos/{k}/from_timestamp"]))
        out.append(ep)
    return out


def _episodes_v21(root: Path, info: dict, video_keys: Sequence[str]) -> list[_Ep]:
    rows = _jsonl(root / "meta" / "episodes.jsonl", root)
    chunks = int(info.get("chunks_size") or 1000)
    data_path = str(info.get("data_path") or V21_DATA)
    video_path = str(info.get("video_path") or V21_VIDEO)
    out = []
    try:
        for r in sorted(rows, key=lambda r: int(r["episode_index"])):
            e = int(r["episode_index"])
            ep = _Ep(e, int(r["length"]), root / data_path.format(episode_chunk=e // chunks, episode_index=e))
            for k in video_keys:
                ep.videos[k] = (root / video_path.format(episode_chunk=e // chunks, video_key=k, episode_index=e), 0.0)
            out.append(ep)
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetError(f"{root / 'meta' / 'episodes.jsonl'}: a line lacks episode_index or length ({e})") from e
    return out


def _numbers(col: Any, key: str, dim: int, where: Path, episode_of: np.ndarray) -> np.ndarray:
    """A parquet column of vectors (list or fixed-size list) or scalars as an (N, dim) float32 array; a
    row of another dimension is an error naming its episode."""
    import pyarrow as pa
    import pyarrow.compute as pc
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    if arr.null_count:
        raise DatasetError(f"{where}: {key} has {arr.null_count} missing values (episode "
                           f"{int(episode_of[np.flatnonzero(np.asarray(arr.is_null()))[0]])})")
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        lens = np.asarray(pc.list_value_length(arr))
        bad = np.flatnonzero(lens != dim)
        if bad.size:
            good = np.flatnonzero(lens == dim)
            also = f" (and episode {int(episode_of[good[0]])})" if good.size else ""
            j = bad[0]
            raise DatasetError(f"{where}: episode {int(episode_of[j])} has {key} of dimension {int(lens[j])}, "
                               f"meta/info.json{also} says {dim}: episodes of different dimensions")
        values = arr.flatten()
        if pa.types.is_list(values.type) or not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)
                                                 or pa.types.is_boolean(values.type)):
            raise DatasetError(f"{where}: {key} holds {values.type}, not numbers")
        return np.asarray(values.to_numpy(zero_copy_only=False), np.float32).reshape(len(arr), dim)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        if dim != 1:
            raise DatasetError(f"{where}: {key} holds one number per row, meta/info.json says dimension {dim}")
        return np.asarray(arr.to_numpy(zero_copy_only=False), np.float32).reshape(-1, 1)
    raise DatasetError(f"{where}: {key} holds {t}, not numbers")


@dataclass(frozen=True)
class _Mapped:
    """The mapping resolved against ``meta/info.json``: keys with their dimensions / image sizes."""

    state: tuple[tuple[str, int], ...]
    action: tuple[str, int]
    cameras: dict[str, str]
    """groundflow camera -> LeRobot feature"""
    image_size: dict[str, tuple[int, int]]
    """LeRobot image/video feature -> (height, width)"""
    reward: str | None
    success: str | None


def _resolve(info: dict, fm: LeRobotFeatures, info_path: Path) -> _Mapped:
    feats = info["features"]
    own = sorted(k for k in feats if k not in ("timestamp", "frame_index", "episode_index", "index", "task_index"))

    def vector(key: str, role: str) -> tuple[str, int]:
        if key not in feats:
            raise DatasetError(f"{info_path}: feature {key!r} ({role} in the mapping) is not in the dataset; "
                               f"it has {own}")
        ft = feats[key]
        if ft.get("dtype") in ("video", "image", "string") or len(ft["shape"]) != 1:
            raise DatasetError(f"{info_path}: feature {key!r} ({role} in the mapping) is a {ft.get('dtype')} of shape "
                               f"{list(ft['shape'])}, not a vector")
        return key, int(ft["shape"][0])

    state = tuple(vector(k, "state") for k in fm.state)
    action = vector(fm.action, "action")
    if fm.cameras is None:
        cams = {k[len(IMAGE_PREFIX):] if k.startswith(IMAGE_PREFIX) else k: k
                for k, ft in feats.items() if ft.get("dtype") in ("video", "image")}
    else:
        cams = {}
        for name, key in fm.cameras:
            if feats.get(key, {}).get("dtype") not in ("video", "image"):
                what = "is not in the dataset" if key not in feats else f"is a {feats[key].get('dtype')}, not images"
                raise DatasetError(f"{info_path}: feature {key!r} (camera {name!r} in the mapping) {what}; "
                                   f"it has {own}")
            cams[name] = key
    sizes = {}
    for key in cams.values():
        shape, names = feats[key]["shape"], feats[key].get("names") or []
        if len(shape) != 3:
            raise DatasetError(f"{info_path}: image feature {key!r} has shape {list(shape)}, not (height, width, 3)")
        first = names[0] if isinstance(names, list) and names else ""
        sizes[key] = (int(shape[1]), int(shape[2])) if first in ("channels", "channel", "c") else (int(shape[0]),
                                                                                                   int(shape[1]))
    optional = {}
    for role, key in (("reward", fm.reward), ("success", fm.success)):
        default = getattr(LeRobotFeatures, role)
        if key in feats:
            optional[role] = vector(key, role)[0]
        elif key != default:
            vector(key, role)  # (named explicitly and absent: the same error as state's)
        else:
            optional[role] = None
    return _Mapped(state, action, cams, sizes, optional["reward"], optional["success"])


class LeRobotReader:
    """A LeRobotDataset (v3.0 or v2.1) read as groundflow episodes, with :class:`dataset.Dataset`'s
    interface. Opening reads the metadata and every row (state, action, tasks: small) and checks them;
    images are decoded when an episode is asked for with ``images=True``."""

    def __init__(self, root: str | os.PathLike, features: LeRobotFeatures = LeRobotFeatures()):
        self.path = Path(root)
        self.info = _read_info(self.path)
        self.version = str(self.info["codebase_version"])
        self.fps = float(self.info["fps"])
        self.map = _resolve(self.info, features, self.path / "meta" / "info.json")
        self.cameras = tuple(self.map.cameras)
        self.state_dim = sum(d for _, d in self.map.state)
        self.action_dim = self.map.action[1]
        tasks = _read_tasks(self.path, self.version)
        video_keys = [k for k in self.map.cameras.values() if self.info["features"][k]["dtype"] == "video"]
        read = _episodes_v30 if self.version == "v3.0" else _episodes_v21
        self._eps = read(self.path, self.info, video_keys)
        if not self._eps:
            raise DatasetError(f"{self.path}: the LeRobotDataset has no episodes")
        if [e.index for e in self._eps] != list(range(len(self._eps))):
            raise DatasetError(f"{self.path}: episode indices in the metadata are "
                               f"{[e.index for e in self._eps][:8]}..., not 0, 1, 2, ...")
        self._rows, self._images = self._read_rows()
        self._instructions, self._task_index = self._episode_tasks(tasks)
        sidecar = self._sidecar()
        self.env_id = str(sidecar.get("env_id") or f"lerobot/{self.info.get('robot_type') or 'unknown'}")
        self.meta = {**(sidecar.get("meta") or {}), "source_format": f"lerobot {self.version}", "fps": self.fps,
                     "robot_type": self.info.get("robot_type")}
        per_ep = sidecar.get("episodes")
        ok = isinstance(per_ep, list) and len(per_ep) == len(self._eps) and all(
            isinstance(p, dict) and p.get("instruction") == i for p, i in zip(per_ep, self._instructions))
        self._per_episode = per_ep if ok else None  # (episodes removed or edited by other tools: task_index then)
        for ep in self._eps:
            for key, (path, _) in ep.videos.items():
                if not path.is_file():
                    raise DatasetError(f"{path} is missing (episode {ep.index}'s {key} video)")

    def _read_rows(self) -> tuple[dict[str, np.ndarray], dict[str, list]]:
        """Every row's numbers (and image-feature bytes), in episode order, checked against the episode
        metadata: each episode's rows are where it says and carry its episode_index."""
        m = self.map
        keys = [k for k, _ in m.state] + [m.action[0]] + [k for k in (m.reward, m.success) if k]
        dims = {**dict(m.state), m.action[0]: m.action[1], **{k: 1 for k in (m.reward, m.success) if k}}
        image_cols = [k for k in m.cameras.values() if self.info["features"][k]["dtype"] == "image"]
        need = [*dict.fromkeys(keys), "episode_index", "timestamp", "task_index", *image_cols]
        files = list(dict.fromkeys(e.data_file for e in self._eps))
        cols: dict[str, list] = {k: [] for k in need}
        offsets, n = {}, 0
        for f in files:
            t = self._file_table(f, need)
            ep_of = np.asarray(t.column("episode_index").to_numpy(zero_copy_only=False)).astype(np.int64)
            for k in dict.fromkeys(keys):
                cols[k].append(_numbers(t.column(k), k, dims[k], f, ep_of))
            cols["episode_index"].append(ep_of)
            cols["timestamp"].append(_numbers(t.column("timestamp"), "timestamp", 1, f, ep_of)[:, 0].astype(np.float64))
            task = _numbers(t.column("task_index"), "task_index", 1, f, ep_of)
            cols["task_index"].append(task[:, 0].astype(np.int64))
            for k in image_cols:
                cols[k].append(t.column(k).to_pylist())
            offsets[f] = (n, n + t.num_rows)
            n += t.num_rows
        rows = {k: np.concatenate(v) for k, v in cols.items() if k not in image_cols}
        start = 0
        for e in self._eps:
            lo, hi = offsets[e.data_file]
            if self.version == "v2.1":
                e.start = start
                if hi - lo != e.length:
                    raise DatasetError(f"{e.data_file}: holds {hi - lo} rows, meta/episodes.jsonl says episode "
                                       f"{e.index} has {e.length}")
            elif not lo <= e.start <= e.start + e.length <= hi:
                raise DatasetError(f"{e.data_file}: meta/episodes puts episode {e.index} at rows {e.start}-"
                                   f"{e.start + e.length} of the dataset; this file holds rows {lo}-{hi}")
            got = rows["episode_index"][e.start:e.start + e.length]
            if (got != e.index).any():
                raise DatasetError(f"{e.data_file}: the rows of episode {e.index} (per the episode metadata) carry "
                                   f"episode_index {sorted(set(got.tolist()))[:4]}: metadata and parquet disagree")
            start += e.length
        return rows, {k: [x for part in cols[k] for x in part] for k in image_cols}

    def _file_table(self, f: Path, need: list[str]) -> Any:
        import pyarrow.parquet as pq
        if not f.is_file():
            raise DatasetError(f"{f} is missing (the episode metadata names it)")
        try:
            names = pq.read_schema(f).names
        except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError: not a parquet file any more
            raise DatasetError(f"{f} is unreadable (truncated or corrupt parquet?): {type(e).__name__}: {e}") from e
        missing = [k for k in need if k not in names]
        if missing:
            raise DatasetError(f"{f} lacks column(s) {missing} (meta/info.json and the mapping name them)")
        return _table(f, need)

    def _episode_tasks(self, tasks: dict[int, str]) -> tuple[list[str], list[int]]:
        instructions, index = [], []
        for e in self._eps:
            ti = np.unique(self._rows["task_index"][e.start:e.start + e.length])
            if len(ti) != 1:
                raise DatasetError(f"{e.data_file}: episode {e.index} has {len(ti)} tasks ({ti[:4].tolist()}); "
                                   "groundflow takes one instruction per episode")
            if int(ti[0]) not in tasks:
                raise DatasetError(f"{e.data_file}: episode {e.index} has task_index {int(ti[0])}, which the tasks "
                                   f"table lacks (it has {sorted(tasks)[:8]})")
            instructions.append(tasks[int(ti[0])])
            index.append(int(ti[0]))
        return instructions, index

    def _sidecar(self) -> dict:
        path = self.path / SIDECAR
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeError, ValueError) as e:
            raise DatasetError(f"{path} is unreadable (truncated or corrupt?): {e}") from e
        return data if isinstance(data, dict) else {}

    def __len__(self) -> int:
        return len(self._eps)

    def episode(self, i: int, images: bool = True) -> Episode:
        e = self._eps[i]
        sl = slice(e.start, e.start + e.length)
        m = self.map
        state = np.concatenate([self._rows[k][sl] for k, _ in m.state], axis=1)
        reward = self._rows[m.reward][sl, 0] if m.reward else np.zeros(e.length, np.float32)
        success = self._rows[m.success][sl, 0] > 0.5 if m.success else np.zeros(e.length, bool)
        extra = self._per_episode[i] if self._per_episode else {}
        imgs = {name: self._frames(e, key) for name, key in m.cameras.items()} if images and m.cameras else None
        seed = extra.get("seed")
        return Episode(state=state, action=self._rows[m.action[0]][sl].copy(), reward=reward.astype(np.float32),
                       success=success, instruction=self._instructions[i],
                       task_id=int(extra.get("task_id", self._task_index[i])),
                       seed=None if seed is None else int(seed), images=imgs)

    def _frames(self, e: _Ep, key: str) -> np.ndarray:
        h, w = self.map.image_size[key]
        stamps = self._rows["timestamp"][e.start:e.start + e.length]
        if key in e.videos:
            path, offset = e.videos[key]
            return decode_episode(path, offset, stamps, (h, w), f"episode {e.index}'s {key}")
        return _decode_images(self._images[key][e.start:e.start + e.length], (h, w), e, key)

    def __iter__(self) -> Iterator[Episode]:
        for i in range(len(self)):
            yield self.episode(i)

    @property
    def instructions(self) -> list[str]:
        return sorted(set(self._instructions))

    def frames(self) -> dict[str, np.ndarray]:
        """LeRobot-style frame table (as :meth:`dataset.Dataset.frames`): one row per step."""
        eps = [self.episode(i, images=False) for i in range(len(self))]
        T = [len(ep) for ep in eps]
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)  # noqa: E731
        return {"episode_index": cat([np.full(t, i) for i, t in enumerate(T)]),
                "frame_index": cat([np.arange(t) for t in T]),
                "observation.state": cat([ep.state for ep in eps]), "action": cat([ep.action for ep in eps]),
                "next.reward": cat([ep.reward for ep in eps]), "next.success": cat([ep.success for ep in eps]),
                "task_index": cat([np.full(t, ep.task_id) for t, ep in zip(T, eps)]),
                "task": cat([np.array([ep.instruction] * t, dtype=object) for t, ep in zip(T, eps)])}

    def close(self) -> None:
        pass

    def __enter__(self) -> "LeRobotReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----- decoding ---------------------------------------------------------------------------------

def decode_episode(path: Path, offset: float, stamps: np.ndarray, size: tuple[int, int], what: str,
                   threads: int = 0) -> np.ndarray:
    """The frames at ``offset + stamps`` (seconds) of the video ``path`` as (T, h, w, 3) uint8: one seek
    to the keyframe before the first, then one sequential decode. Frames are matched to stamps by time
    (within TOLERANCE_S); a stamp no frame matches is an error (a truncated or corrupt video).
    ``threads``: the decoder's threads (0: FFmpeg's choice, one per core)."""
    import av
    T = len(stamps)
    out = np.empty((T, *size, 3), np.uint8)
    filled = np.zeros(T, bool)
    last = offset + float(stamps[-1]) + TOLERANCE_S if T else offset
    ordered = T > 1 and bool(np.all(np.diff(stamps) > 0))

    def nearest(t: float) -> int:
        if not ordered:
            return int(np.argmin(np.abs(stamps - t)))
        j = int(np.clip(np.searchsorted(stamps, t), 1, T - 1))
        return j if abs(stamps[j] - t) < abs(stamps[j - 1] - t) else j - 1

    try:
        with av.open(str(path)) as c:
            if not c.streams.video:
                raise DatasetError(f"{path} holds no video stream ({what})")
            st = c.streams.video[0]
            st.codec_context.thread_count = threads
            if offset > 0:
                c.seek(int(offset / st.time_base), stream=st, backward=True, any_frame=False)
            for frame in c.decode(st):
                if frame.pts is None:
                    continue
                t = float(frame.pts * st.time_base)
                if t > last:
                    break
                j = nearest(t - offset) if T else 0
                if T and abs(float(stamps[j]) - (t - offset)) <= TOLERANCE_S and not filled[j]:
                    if (frame.height, frame.width) != size:
                        raise DatasetError(f"{path}: frames are {frame.height}x{frame.width}, meta/info.json says "
                                           f"{size[0]}x{size[1]} ({what})")
                    out[j] = frame.to_ndarray(format="rgb24")
                    filled[j] = True
    except DatasetError:
        raise
    except Exception as e:  # noqa: BLE001 - av.FFmpegError (InvalidDataError ...), OSError: one line naming it
        raise DatasetError(f"{path} is unreadable (corrupt or truncated video?): {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''} ({what})") from e
    if not filled.all():
        k = int(np.flatnonzero(~filled)[0])
        raise DatasetError(f"{path}: video is truncated or corrupt: {int((~filled).sum())} of the {T} frames of {what} "
                           f"are missing, the first at t={offset + float(stamps[k]):.3f} s")
    return out


def _decode_images(cells: list, size: tuple[int, int], e: _Ep, key: str) -> np.ndarray:
    """Image features stored in the parquet (PNG/JPEG bytes) as (T, h, w, 3) uint8."""
    import io

    from PIL import Image
    out = np.empty((len(cells), *size, 3), np.uint8)
    for j, cell in enumerate(cells):
        try:
            raw = cell.get("bytes") if isinstance(cell, dict) else cell
            img = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
        except Exception as ex:  # noqa: BLE001 - PIL's UnidentifiedImageError, OSError, TypeError (no bytes)
            raise DatasetError(f"{e.data_file}: episode {e.index} frame {j} of {key} is not a readable image: "
                               f"{type(ex).__name__}: {ex}") from ex
        if img.shape[:2] != size:
            raise DatasetError(f"{e.data_file}: episode {e.index} frame {j} of {key} is {img.shape[0]}x{img.shape[1]}, "
                               f"meta/info.json says {size[0]}x{size[1]}")
        out[j] = img
    return out


# ----- writing ----------------------------------------------------------------------------------

DATA_FILE_MB = 100
VIDEO_FILE_MB = 200
CHUNKS_SIZE = 1000
CODECS = ("libsvtav1", "h264", "hevc")
"""the encoders LeRobot writes with (libsvtav1, AV1, is its default)"""


@dataclass(frozen=True)
class LeRobotExport:
    """How groundflow episodes are written as a LeRobotDataset (``groundflow export --format lerobot``)."""

    version: str = "v3.0"
    """v3.0 (LeRobot >= 0.4) or v2.1 (earlier LeRobot, openpi)"""
    fps: int | None = None
    """frames per second; default: what the dataset recorded (a deployed robot's control rate)"""
    codec: str = "libsvtav1"
    """video encoder: libsvtav1 (LeRobot's default), h264 or hevc"""
    crf: int = 30
    """video quality (lower: closer to the images, larger files); LeRobot's default"""
    gop: int = 2
    """keyframe interval in frames (LeRobot's default 2: any frame decodes after at most one other)"""
    robot_type: str | None = None
    """info.json's robot_type; default: the recording robot's name, else the env id"""


def _recorded_fps(meta: dict) -> float | None:
    robot = meta.get("robot") if isinstance(meta.get("robot"), dict) else {}
    options = meta.get("env_options") if isinstance(meta.get("env_options"), dict) else {}
    for v in (meta.get("fps"), robot.get("control_rate_hz"), meta.get("rate_hz"), options.get("control_freq")):
        if isinstance(v, (int, float)) and v > 0:
            return float(v)
    return None


@dataclass
class _Source:
    path: Path
    n: int
    env_id: str
    state_dim: int
    action_dim: int
    cameras: tuple[str, ...]
    meta: dict


def _plan(sources: Sequence[Path], cfg: LeRobotExport) -> tuple[list[_Source], int]:
    """The sources, checked against each other, and the fps: every error before anything is written."""
    if not sources:
        raise InvalidOptionError("give at least one dataset to export with --data")
    if cfg.version not in VERSIONS:
        raise InvalidOptionError(f"--lerobot-version {cfg.version!r}: valid are {', '.join(VERSIONS)}")
    if cfg.codec not in CODECS:
        raise InvalidOptionError(f"--codec {cfg.codec!r}: valid are {', '.join(CODECS)}")
    if not (0 <= cfg.crf <= 63 and cfg.gop >= 1):
        raise InvalidOptionError(f"--crf must be in [0, 63] and --gop >= 1, got {cfg.crf} and {cfg.gop}")
    out: list[_Source] = []
    for p in sources:
        if parse_spec(p) is not None:
            raise InvalidOptionError(f"{p}: export reads groundflow HDF5 datasets, not LeRobot ones")
        with Dataset(p) as ds:
            for i in range(len(ds)):
                ds.episode(i, images=False)  # (every array against its checksum: a damaged source fails here)
            src = _Source(Path(p), len(ds), ds.env_id, ds.state_dim, ds.action_dim, tuple(ds.cameras), dict(ds.meta))
        first = out[0] if out else src
        if (src.state_dim, src.action_dim, src.cameras) != (first.state_dim, first.action_dim, first.cameras):
            mine = (src.state_dim, src.action_dim, list(src.cameras))
            theirs = (first.state_dim, first.action_dim, list(first.cameras))
            raise DatasetError(f"{p}: state/action dims and cameras {mine} differ from {theirs} of {first.path}")
        out.append(src)
    if not sum(s.n for s in out):
        raise DatasetError(f"no episodes in {[str(p) for p in sources]}")
    fps = cfg.fps
    if fps is None:
        rates = {s.path: _recorded_fps(s.meta) for s in out}
        if None in rates.values():
            bad = next(p for p, r in rates.items() if r is None)
            raise InvalidOptionError(f"{bad} does not record its control rate: give --fps")
        if len(set(rates.values())) > 1:
            raise InvalidOptionError(f"the datasets were recorded at different rates {sorted(set(rates.values()))}: "
                                     "export them separately (or give --fps)")
        fps = next(iter(rates.values()))
    if not (fps > 0 and float(fps).is_integer()):
        raise InvalidOptionError(f"LeRobot needs a whole number of frames per second, got {fps}; give --fps")
    return out, int(fps)


class _Video:
    """One mp4 being encoded; frames get consecutive timestamps n / fps from its first."""

    def __init__(self, path: Path, fps: int, cfg: LeRobotExport, size: tuple[int, int]):
        import av
        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner per file otherwise (1: errors only)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.n, self.bytes = path, 0, 0  # frames in, encoded bytes out (the encoder holds a few back)
        opts = {"g": str(cfg.gop), "crf": str(cfg.crf), **({"preset": "12"} if cfg.codec == "libsvtav1" else {})}
        self.c = av.open(str(path), "w")
        try:
            self.s = self.c.add_stream(cfg.codec, rate=fps, options=opts)
            self.s.height, self.s.width = size
            self.s.pix_fmt = "yuv420p"
        except Exception:
            self.c.close()
            raise

    def add(self, frames: np.ndarray) -> None:
        import av
        for img in frames:
            f = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            f.pts = self.n
            self.n += 1
            for p in self.s.encode(f):
                self.bytes += p.size
                self.c.mux(p)

    def close(self) -> None:
        try:
            for p in self.s.encode():
                self.c.mux(p)
        finally:
            self.c.close()


def _stats(x: np.ndarray, axes: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """LeRobot's per-feature statistics (min, max, mean, std, count, q01..q99) as JSON lists."""
    x = np.asarray(x, np.float64)
    out = {"min": x.min(axes), "max": x.max(axes), "mean": x.mean(axes), "std": x.std(axes),
           **{f"q{int(round(q * 100)):02d}": np.quantile(x, q, axis=axes) for q in QUANTILES}}
    res: dict[str, Any] = {k: np.asarray(v).tolist() for k, v in out.items()}
    res["count"] = [int(x.shape[0])]
    return res


def _image_stats(frames: np.ndarray) -> dict[str, Any]:
    """Per-channel statistics in [0, 1], shape (3, 1, 1), over at most 20 frames (as LeRobot samples)."""
    idx = np.unique(np.linspace(0, len(frames) - 1, min(len(frames), 20)).round().astype(int))
    step = max(1, max(frames.shape[1:3]) // 64)
    x = frames[idx, ::step, ::step].reshape(-1, 3).astype(np.float64) / 255.0
    s = _stats(x)
    res = {k: [[[c]] for c in v] for k, v in s.items() if k != "count"}
    res["count"] = [int(len(idx))]
    return res


def _hf_features(columns: dict[str, np.ndarray], version: str) -> bytes:
    """The ``huggingface`` schema metadata the datasets library reads a parquet file's features from."""
    kinds = {"f": "float32", "b": "bool", "i": "int64"}
    feats = {}
    for k, v in columns.items():
        value = {"dtype": kinds[v.dtype.kind], "_type": "Value"}
        feats[k] = value if v.ndim == 1 else {"feature": value, "length": int(v.shape[1]),
                                              "_type": "List" if version == "v3.0" else "Sequence"}
    return json.dumps({"info": {"features": feats}}).encode()


def _write_parquet(path: Path, columns: dict[str, np.ndarray], version: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    arrays = {}
    for k, v in columns.items():
        if v.ndim == 2:
            arrays[k] = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), int(v.shape[1]))
        else:
            arrays[k] = pa.array(v)
    table = pa.table(arrays)
    table = table.replace_schema_metadata({b"huggingface": _hf_features(columns, version)})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="snappy")


def _write_tasks_parquet(path: Path, tasks: list[str]) -> None:
    """``meta/tasks.parquet`` as pandas writes it: task strings as the index, task_index the column."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pandas = {"index_columns": ["__index_level_0__"],
              "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
                                  "metadata": {"encoding": "UTF-8"}}],
              "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                           "numpy_type": "int64", "metadata": None},
                          {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode",
                           "numpy_type": "object", "metadata": None}],
              "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.3"}
    table = pa.table({"task_index": pa.array(np.arange(len(tasks)), pa.int64()),
                      "__index_level_0__": pa.array(tasks, pa.string())})
    pq.write_table(table.replace_schema_metadata({b"pandas": json.dumps(pandas).encode()}), path)


class _Writer:
    """Fills ``root`` (an empty folder) episode by episode; :meth:`finish` writes the metadata."""

    def __init__(self, root: Path, cfg: LeRobotExport, fps: int, first: _Source):
        self.root, self.cfg, self.fps, self.v3 = root, cfg, fps, cfg.version == "v3.0"
        self.first = first
        self.cameras = first.cameras
        self.sizes: dict[str, tuple[int, int]] = {}
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict] = []
        self.sidecar: list[dict] = []
        self.rows: dict[str, list] = {}  # the current data file's (v3.0) or episode's (v2.1) columns
        self.all_rows: dict[str, list] = {}  # every row (for the dataset's stats)
        self.image_samples: dict[str, list] = {c: [] for c in self.cameras}
        self.n_frames = 0
        self.data_file = (0, 0)  # (chunk, file) of the v3.0 data file being filled
        self.videos: dict[str, tuple[_Video, int, int]] = {}  # camera -> (open v3.0 file, chunk, file)

    def add(self, src: _Source, i: int, ep: Episode) -> None:
        e, T = len(self.episodes), len(ep)
        task = self.tasks.setdefault(ep.instruction, len(self.tasks))
        cols = {"observation.state": ep.state.astype(np.float32), "action": ep.action.astype(np.float32),
                "next.reward": np.asarray(ep.reward, np.float32).reshape(T),
                "next.success": np.asarray(ep.success, bool).reshape(T), "next.done": np.arange(T) == T - 1,
                "timestamp": (np.arange(T) / self.fps).astype(np.float32), "frame_index": np.arange(T, dtype=np.int64),
                "episode_index": np.full(T, e, np.int64), "index": np.arange(self.n_frames, self.n_frames + T),
                "task_index": np.full(T, task, np.int64)}
        meta: dict[str, Any] = {"episode_index": e, "tasks": [ep.instruction], "length": T}
        stats = {k: _stats(v if v.ndim == 2 else v[:, None]) for k, v in cols.items()}
        if self.v3 and self.rows and self._rows_mb() + T * self._row_bytes() / 1e6 >= DATA_FILE_MB:
            self._flush_data()
            self.data_file = self._next(*self.data_file)
        for k, v in cols.items():
            self.rows.setdefault(k, []).append(v)
            self.all_rows.setdefault(k, []).append(v)
        if self.v3:
            meta.update({"data/chunk_index": self.data_file[0], "data/file_index": self.data_file[1],
                         "dataset_from_index": self.n_frames, "dataset_to_index": self.n_frames + T})
        else:
            self._flush_data(e)
        for cam in self.cameras:
            frames = np.asarray(ep.images[cam])
            if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] != T:
                raise DatasetError(f"{src.path}: episode {i} camera {cam!r} has images of shape {frames.shape}, "
                                   f"not ({T}, h, w, 3)")
            size = self.sizes.setdefault(cam, frames.shape[1:3])
            if frames.shape[1:3] != size:
                raise DatasetError(f"{src.path}: episode {i} camera {cam!r} has {frames.shape[1]}x{frames.shape[2]} "
                                   f"images, earlier episodes {size[0]}x{size[1]}")
            try:
                meta.update(self._video(cam, e, frames))
            except Exception as ex:  # noqa: BLE001 - the encoder refusing the frames (odd sizes for yuv420p ...)
                if isinstance(ex, DatasetError):
                    raise
                raise DatasetError(f"{src.path}: cannot encode episode {i} camera {cam!r} ({size[0]}x{size[1]} images) "
                                   f"with {self.cfg.codec}: {type(ex).__name__}: {ex}") from ex
            stats[IMAGE_PREFIX + cam] = _image_stats(frames)
            self.image_samples[cam].append(frames[:: max(1, T // 5)])
        self.episodes.append({"meta": meta, "stats": stats})
        self.sidecar.append({"source": str(src.path), "source_episode": i, "instruction": ep.instruction,
                             "task_id": int(ep.task_id), "seed": ep.seed})
        self.n_frames += T

    def _row_bytes(self) -> int:
        return 4 * (self.first.state_dim + self.first.action_dim) + 48

    def _rows_mb(self) -> float:
        return sum(len(v) for v in self.rows.get("index", [])) * self._row_bytes() / 1e6

    @staticmethod
    def _next(chunk: int, file: int) -> tuple[int, int]:
        return (chunk + 1, 0) if file == CHUNKS_SIZE - 1 else (chunk, file + 1)

    def _flush_data(self, episode: int | None = None) -> None:
        """Write the buffered rows: the v3.0 data file being filled, or v2.1 episode ``episode``'s file."""
        if not self.rows:
            return
        cols = {k: np.concatenate(v) for k, v in self.rows.items()}
        if episode is None:
            rel = V30_DATA.format(chunk_index=self.data_file[0], file_index=self.data_file[1])
        else:
            rel = V21_DATA.format(episode_chunk=episode // CHUNKS_SIZE, episode_index=episode)
        _write_parquet(self.root / rel, cols, self.cfg.version)
        self.rows = {}

    def _video(self, cam: str, e: int, frames: np.ndarray) -> dict[str, Any]:
        key = IMAGE_PREFIX + cam
        if not self.v3:
            v = _Video(self.root / V21_VIDEO.format(episode_chunk=e // CHUNKS_SIZE, video_key=key, episode_index=e),
                       self.fps, self.cfg, self.sizes[cam])
            v.add(frames)
            v.close()
            return {}
        video, chunk, file = self.videos.get(cam, (None, 0, 0))
        if video is not None and video.bytes >= VIDEO_FILE_MB * 1e6:
            video.close()
            video, (chunk, file) = None, self._next(chunk, file)
        if video is None:
            video = _Video(self.root / V30_VIDEO.format(video_key=key, chunk_index=chunk, file_index=file), self.fps,
                           self.cfg, self.sizes[cam])
            self.videos[cam] = (video, chunk, file)
        start = video.n / self.fps
        video.add(frames)
        return {f"videos/{key}/chunk_index": chunk, f"videos/{key}/file_index": file,
                f"videos/{key}/from_timestamp": start, f"videos/{key}/to_timestamp": video.n / self.fps}

    def close_videos(self, failed: bool = False) -> None:
        videos, self.videos = self.videos, {}
        for video, _, _ in videos.values():
            if failed:
                with contextlib.suppress(Exception):
                    video.close()
            else:
                video.close()

    def finish(self) -> None:
        """The metadata: info.json, stats.json, tasks, episodes (v3.0 parquet / v2.1 jsonl), the sidecar."""
        self.close_videos()
        if self.v3:
            self._flush_data()
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        rows = {k: np.concatenate(v) for k, v in self.all_rows.items()}
        stats = {k: _stats(v if v.ndim == 2 else v[:, None]) for k, v in rows.items()}
        for cam in self.cameras:
            stats[IMAGE_PREFIX + cam] = _image_stats(np.concatenate(self.image_samples[cam]))
        n, tasks = len(self.episodes), list(self.tasks)
        info: dict[str, Any] = {
            "codebase_version": self.cfg.version, "robot_type": self._robot_type(), "total_episodes": n,
            "total_frames": self.n_frames, "total_tasks": len(tasks), "chunks_size": CHUNKS_SIZE}
        if self.v3:
            info.update(data_files_size_in_mb=DATA_FILE_MB, video_files_size_in_mb=VIDEO_FILE_MB)
        else:
            info.update(total_videos=n * len(self.cameras), total_chunks=(n + CHUNKS_SIZE - 1) // CHUNKS_SIZE)
        info.update(fps=self.fps, splits={"train": f"0:{n}"}, data_path=V30_DATA if self.v3 else V21_DATA,
                    video_path=(V30_VIDEO if self.v3 else V21_VIDEO) if self.cameras else None,
                    features=self._features())
        if self.v3:
            _write_tasks_parquet(meta / "tasks.parquet", tasks)
            eps = [{**ep["meta"], **{f"stats/{k}/{s}": v for k, st in ep["stats"].items() for s, v in st.items()},
                    "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0} for ep in self.episodes]
            import pyarrow as pa
            import pyarrow.parquet as pq
            (meta / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(eps), self.root / V30_EPISODES.format(chunk_index=0, file_index=0))
        else:
            _write_text(meta / "tasks.jsonl", "".join(json.dumps({"task_index": i, "task": t}) + "\n"
                                                      for i, t in enumerate(tasks)))
            _write_text(meta / "episodes.jsonl", "".join(json.dumps(ep["meta"]) + "\n" for ep in self.episodes))
            _write_text(meta / "episodes_stats.jsonl", "".join(
                json.dumps({"episode_index": i, "stats": ep["stats"]}) + "\n" for i, ep in enumerate(self.episodes)))
        _write_text(meta / "info.json", json.dumps(info, indent=4))
        _write_text(meta / "stats.json", json.dumps(stats, indent=4))
        _write_text(self.root / SIDECAR, json.dumps({
            "written_by": "groundflow export --format lerobot", "env_id": self.first.env_id, "meta": self.first.meta,
            "cameras": {c: IMAGE_PREFIX + c for c in self.cameras}, "episodes": self.sidecar}, indent=1, default=str))

    def _robot_type(self) -> str:
        robot = self.first.meta.get("robot")
        name = robot.get("name") if isinstance(robot, dict) else None
        return self.cfg.robot_type or (str(name) if name else self.first.env_id)

    def _features(self) -> dict[str, Any]:
        S, A = self.first.state_dim, self.first.action_dim
        names: list[str] | None = None
        with contextlib.suppress(TypeError, ValueError):
            names = [n if int(k) == 1 else f"{n}.{j}" for n, k in self.first.meta.get("state_layout") or []
                     for j in range(int(k))] or None
        vec = lambda dt, d, nm=None: {"dtype": dt, "shape": [d], "names": nm}  # noqa: E731
        feats: dict[str, Any] = {
            "observation.state": vec("float32", S, names if names and len(names) == S else None),
            "action": vec("float32", A), "next.reward": vec("float32", 1), "next.success": vec("bool", 1),
            "next.done": vec("bool", 1)}
        codec = {"libsvtav1": "av1", "h264": "h264", "hevc": "hevc"}[self.cfg.codec]
        for cam in self.cameras:
            h, w = self.sizes[cam]
            feats[IMAGE_PREFIX + cam] = {
                "dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                "info": {"video.height": h, "video.width": w, "video.codec": codec, "video.pix_fmt": "yuv420p",
                         "video.is_depth_map": False, "video.fps": self.fps, "video.channels": 3, "has_audio": False}}
        feats.update({"timestamp": vec("float32", 1), "frame_index": vec("int64", 1), "episode_index": vec("int64", 1),
                      "index": vec("int64", 1), "task_index": vec("int64", 1)})
        return feats


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _clear(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def write_lerobot(sources: Sequence[str | os.PathLike], out: str | os.PathLike, cfg: LeRobotExport = LeRobotExport(),
                  overwrite: bool = False) -> Path:
    """Write the episodes of groundflow HDF5 datasets (collected demos, deployed recordings) as the
    LeRobotDataset ``out``: same frames, actions, instructions and fps. Every source is checked first;
    the dataset is built in ``out.partial/``, read back, and only then renamed to ``out``."""
    out = Path(out)
    srcs, fps = _plan([Path(s) for s in sources], cfg)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; a LeRobotDataset is a folder: give a folder path")
    if out.exists() and any(out.iterdir()):
        if not (out / "meta" / "info.json").is_file():
            raise FileExistsError(f"{out} exists and is not a LeRobotDataset; not replacing it: give another --out")
        if not overwrite:
            raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    partial = out.with_name(out.name + ".partial")
    with hold_directory(partial, "--out"):
        try:
            _clear(partial)  # (a killed export's leftovers)
            w = _Writer(partial, cfg, fps, srcs[0])
            try:
                for src in srcs:
                    with Dataset(src.path) as ds:
                        for i in range(src.n):
                            w.add(src, i, ds.episode(i))
            except BaseException:
                w.close_videos(failed=True)  # (their errors would hide the one that stopped the export)
                raise
            w.finish()
            _verify(partial, w)
            if out.exists():
                old = out.with_name(f"{out.name}.old-{os.getpid()}")
                os.replace(out, old)
                os.replace(partial, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(partial, out)
        except BaseException:
            with contextlib.suppress(OSError):
                _clear(partial)
            raise
    return out


def _verify(root: Path, w: _Writer) -> None:
    """Refuse to publish an export that does not read back: episode count, every state and action."""
    try:
        back = LeRobotReader(root)
        want = {k: np.concatenate(v) for k, v in w.all_rows.items()}
        same = all(np.array_equal(back._rows[k], want[k]) for k in ("observation.state", "action"))
        if len(back) != len(w.episodes) or not same:
            raise DatasetError("episodes, states or actions differ from what was written")
    except DatasetError as e:
        raise DatasetError(f"not publishing the export: {root} does not read back as written: {e}") from e
