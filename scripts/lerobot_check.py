"""`make lerobot-check`: groundflow's LeRobotDataset reader and writer checked against the lerobot package.

lerobot 0.4.4 pins torch<2.11, so it lives in its own venv (``.venv-lerobot``); this script runs with that
venv's python and calls itself with ``.venv/bin/python`` for groundflow's half (``gf-*`` roles), passing
arrays through .npz files. Steps (each prints one line; any difference fails the run):

1. ``fixture``: lerobot's own writer (``LeRobotDataset.create`` / ``add_frame`` / ``save_episode`` /
   ``finalize``) writes ``tests/data/lerobot_v30`` from :func:`fixture_episodes` (3 episodes of 10
   frames; two 32x32 video cameras and a 16x16 image one): the fixture ``tests/test_lerobot.py`` reads in the default suite. Only
   the key order of its stats.json is normalized, so that a rerun leaves the committed files unchanged.
2. groundflow reads the regenerated fixture: same frames, actions, tasks and episode boundaries.
3. for v3.0 and v2.1: groundflow writes the same episodes as an HDF5 dataset and runs
   ``groundflow export --format lerobot``; lerobot's reader loads the export (v2.1 through lerobot's
   own v2.1 -> v3.0 converter first) and every frame must equal what groundflow put in (state, action,
   reward, success, task, timestamps exactly; images within video-coding error of the originals, and
   equal to groundflow's own decode of the same file up to the YUV->RGB conversion).

Video decoding on lerobot's side uses torchcodec where it loads (it needs the system's FFmpeg
libraries), else PyAV; the step says which.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "lerobot_v30"
GF_PYTHON = ROOT / ".venv" / "bin" / "python"
FPS = 10
CAMERAS = ("front", "wrist", "top")
"""front and wrist are stored as video (mp4), top as an image feature (PNG in the parquet)"""
TASKS = ("push the red cube to the left", "stack the blue cube on the green one")
IMAGE_TOLERANCE = 12.0
"""mean |decoded - original| per image (0-255) that lossy video coding of the 32x32 frames may cost"""
MEASURED = {"vs originals": 0.0, "lerobot vs groundflow decode": 0}
"""the largest image differences seen (printed at the end)"""


def fixture_episodes() -> list[dict]:
    """The fixture's content, a pure function (tests/test_lerobot.py imports it): 3 episodes of 10
    frames; state (6,), action (4,), reward, success, a task per episode, two cameras of smooth 32x32
    images (a moving square on a coloured background; a shifting gradient) that video coding keeps close,
    and a 16x16 one stored losslessly (PNG)."""
    out = []
    yy, xx = np.mgrid[0:32, 0:32]
    for e in range(3):
        T = 10
        t = np.arange(T, dtype=np.float32)[:, None]
        state = (np.linspace(-1, 1, 6, dtype=np.float32)[None] * (e + 1) + 0.1 * t).astype(np.float32)
        action = np.concatenate([np.sin(t * 0.3 + e + np.arange(3)), np.full((T, 1), e - 1.0)], 1).astype(np.float32)
        front = np.empty((T, 32, 32, 3), np.uint8)
        wrist = np.empty((T, 32, 32, 3), np.uint8)
        top = np.empty((T, 16, 16, 3), np.uint8)
        for i in range(T):
            front[i] = (40 + 60 * e, 90, 160 - 40 * e)
            x0 = 2 + 2 * i
            front[i, 8:20, x0:x0 + 12] = (230, 220, 40)
            g = (xx * 6 + yy * 2 + 8 * i + 30 * e) % 256
            wrist[i] = np.stack([g, 255 - g, np.full_like(g, 128)], -1).astype(np.uint8)
            top[i] = np.stack([yy[:16, :16] * 16 + i, xx[:16, :16] * 16, np.full((16, 16), 60 * e)], -1) % 256
        out.append({"task": TASKS[e % 2], "state": state, "action": action,
                    "reward": (t[:, 0] / 10).astype(np.float32), "success": np.arange(T) == T - 1,
                    "images": {"front": front, "wrist": wrist, "top": top}})
    return out


# ----- lerobot's side (.venv-lerobot) -------------------------------------------------------------

def _lerobot_features() -> dict:
    video = {"dtype": "video", "shape": (32, 32, 3), "names": ["height", "width", "channels"]}
    return {"observation.state": {"dtype": "float32", "shape": (6,), "names": None},
            "action": {"dtype": "float32", "shape": (4,), "names": None},
            "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
            "next.success": {"dtype": "bool", "shape": (1,), "names": None},
            **{f"observation.images.{c}": dict(video) for c in ("front", "wrist")},
            "observation.images.top": {"dtype": "image", "shape": (16, 16, 3), "names": ["height", "width", "channels"]}}


def write_fixture(dest: Path) -> None:
    """The fixture, written by lerobot's own LeRobotDataset writer, replacing ``dest``."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        ds = LeRobotDataset.create("groundflow/lerobot-fixture", fps=FPS, features=_lerobot_features(), root=root,
                                   robot_type="groundflow-test", use_videos=True)
        for ep in fixture_episodes():
            for i in range(len(ep["state"])):
                ds.add_frame({"observation.state": ep["state"][i], "action": ep["action"][i],
                              "next.reward": ep["reward"][i:i + 1], "next.success": ep["success"][i:i + 1],
                              **{f"observation.images.{c}": ep["images"][c][i] for c in CAMERAS},
                              "task": ep["task"]})
            ds.save_episode()
        ds.finalize()
        shutil.rmtree(root / "images", ignore_errors=True)  # (lerobot's temporary PNGs, if any are left)
        stats = root / "meta" / "stats.json"  # the same content in a fixed key order (lerobot's varies by run)
        stats.write_text(json.dumps(json.loads(stats.read_text()), indent=4, sort_keys=True))
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(root, dest)


def _backends() -> list[str]:
    """lerobot's video decoders to check with: torchcodec (its default) where its library loads (it
    needs the system's FFmpeg libraries, e.g. Debian's libavcodec59), and PyAV (its fallback)."""
    try:
        import torchcodec.decoders  # noqa: F401
        return ["torchcodec", "pyav"]
    except Exception:  # noqa: BLE001 - OSError / RuntimeError: no FFmpeg libraries it can load
        return ["pyav"]


def lerobot_frames(root: Path, backend: str) -> dict[str, np.ndarray]:
    """Every frame of the dataset at ``root`` as lerobot's ``LeRobotDataset`` gives it."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    ds = LeRobotDataset("groundflow/check", root=root, video_backend=backend)
    cols: dict[str, list] = {}
    for i in range(len(ds)):
        item = ds[i]
        for k, v in item.items():
            if k.startswith("observation.images."):
                v = (v.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)  # CHW float [0,1] -> HWC uint8
            elif hasattr(v, "numpy"):
                v = v.numpy()
            cols.setdefault(k, []).append(v)
    return {k: np.stack(v) if k != "task" else np.array(v, dtype=object) for k, v in cols.items()}


def _expected() -> dict[str, np.ndarray]:
    eps = fixture_episodes()
    for i, e in enumerate(eps):
        e["index"] = i
    cat = lambda f: np.concatenate([f(e) for e in eps])  # noqa: E731
    return {"observation.state": cat(lambda e: e["state"]), "action": cat(lambda e: e["action"]),
            "next.reward": cat(lambda e: e["reward"]), "next.success": cat(lambda e: e["success"]),
            "episode_index": cat(lambda e: np.full(len(e["state"]), e["index"])),
            "frame_index": cat(lambda e: np.arange(len(e["state"]))),
            "task": cat(lambda e: np.array([e["task"]] * len(e["state"]), dtype=object)),
            **{f"observation.images.{c}": cat(lambda e, c=c: e["images"][c]) for c in CAMERAS}}


def _compare(what: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray],
             decoded_by_groundflow: dict[str, np.ndarray] | None = None) -> list[str]:
    """Differences between ``got`` (one row per frame) and ``want``, one line each."""
    bad = []
    for k, w in want.items():
        if k not in got:
            bad.append(f"{what}: {k} missing")
            continue
        g = got[k].reshape(w.shape) if got[k].size == w.size else got[k]
        if g.shape != w.shape:
            bad.append(f"{what}: {k} has shape {g.shape}, expected {w.shape}")
        elif k.startswith("observation.images."):
            err = np.abs(g.astype(float) - w.astype(float)).mean(axis=(1, 2, 3))
            MEASURED["vs originals"] = max(MEASURED["vs originals"], float(err.max()))
            if err.max() > IMAGE_TOLERANCE:
                bad.append(f"{what}: {k} frames differ from the originals by up to {err.max():.1f} (mean abs)")
            if decoded_by_groundflow is not None:
                d = np.abs(g.astype(int) - decoded_by_groundflow[k].astype(int))
                MEASURED["lerobot vs groundflow decode"] = max(MEASURED["lerobot vs groundflow decode"], int(d.max()))
                if d.max() > 2:
                    bad.append(f"{what}: {k}: lerobot's and groundflow's decodes differ by up to {d.max()}")
        elif not np.array_equal(g, w):
            bad.append(f"{what}: {k} differs (first row {int(np.flatnonzero((g != w).reshape(len(w), -1).any(1))[0])})")
    return bad


def _gf(*args: str) -> None:
    """This script's groundflow half, in groundflow's venv."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([str(GF_PYTHON), str(Path(__file__).resolve()), *args], env=env, cwd=ROOT, capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(f"[lerobot-check] FAIL groundflow {args[0]} {' '.join(args[1:])}:\n{r.stdout}{r.stderr}")


def _gf_read(spec: str, tmp: Path) -> dict[str, np.ndarray]:
    out = tmp / f"read_{abs(hash(spec))}.npz"
    _gf("gf-read", spec, str(out))
    with np.load(out, allow_pickle=True) as z:
        return {k: z[k] for k in z.files}


def check_export(version: str, tmp: Path, backends: list[str], split: bool = False) -> list[str]:
    """groundflow's export of the fixture's episodes, loaded by lerobot (v2.1: converted by lerobot first).
    ``split``: file size limits of 0, so that every episode starts new data and video files."""
    h5 = tmp / f"demos_{version}.h5"
    out = tmp / f"export_{version}{'_split' if split else ''}" / "check"
    _gf("gf-make-h5", str(h5))
    _gf("gf-export", str(h5), str(out), version, "split" if split else "")
    ours = _gf_read(f"lerobot:{out}", tmp)
    if version == "v2.1":
        from lerobot.datasets.v30.convert_dataset_v21_to_v30 import convert_dataset
        convert_dataset("check", root=str(out.parent), push_to_hub=False)  # (in place: ROOT/check)
    bad = []
    for backend in backends:
        bad += _compare(f"export {version} ({backend})", lerobot_frames(out, backend), _expected(), ours)
    return bad


def main_lerobot() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore", category=UserWarning)  # (torchvision's video deprecation notice)
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # (lerobot's stats casting bool features)
    os.environ.setdefault("SVT_LOG", "1")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["HF_HOME"] = str(tmp / "hf")  # lerobot's datasets cache: not under ~/.cache
        backends = _backends()
        write_fixture(FIXTURE)
        size = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
        print(f"[lerobot-check] 1 fixture: lerobot wrote {FIXTURE.relative_to(ROOT)} ({size / 1e3:.0f} kB)")
        bad = _compare("groundflow reading the fixture", _gf_read(f"lerobot:{FIXTURE}", tmp), _expected())
        bad += _compare("lerobot reading the fixture", lerobot_frames(FIXTURE, backends[0]), _expected())
        print(f"[lerobot-check] 2 groundflow reads lerobot's fixture: {'ok' if not bad else 'DIFFERS'}")
        for version, split in (("v3.0", False), ("v3.0", True), ("v2.1", False)):
            errs = check_export(version, tmp, backends, split)
            bad += errs
            what = f"{version} export{' (a data and video file per episode)' if split else ''}"
            print(f"[lerobot-check] 3 lerobot ({', '.join(backends)}) loads groundflow's {what}: "
                  f"{'frames equal' if not errs else 'DIFFERS'}")
    print(f"[lerobot-check] images: mean |decoded - original| per frame <= {MEASURED['vs originals']:.1f} / 255 "
          f"(lossy video; limit {IMAGE_TOLERANCE}), lerobot's and groundflow's decodes of one file differ by <= "
          f"{MEASURED['lerobot vs groundflow decode']} per pixel")
    for line in bad:
        print(f"[lerobot-check] FAIL {line}")
    print(f"[lerobot-check] {'passed' if not bad else 'FAILED'} in {time.time() - t0:.0f} s")
    return 1 if bad else 0


# ----- groundflow's side (.venv) ------------------------------------------------------------------

def gf_make_h5(path: str) -> None:
    """The fixture's episodes as a groundflow HDF5 dataset (what ``groundflow collect`` writes)."""
    from dataset import DatasetWriter, Episode
    with DatasetWriter(path, "test/lerobot-check", 6, 4, cameras=CAMERAS, meta={"fps": FPS}, overwrite=True) as w:
        for e, ep in enumerate(fixture_episodes()):
            w.add(Episode(state=ep["state"], action=ep["action"], reward=ep["reward"], success=ep["success"],
                          instruction=ep["task"], task_id=e % 2, images=ep["images"]))


def gf_export(h5: str, out: str, version: str, split: str = "") -> None:
    import dataset.lerobot
    from groundflow.cli import main
    if split:
        dataset.lerobot.DATA_FILE_MB = dataset.lerobot.VIDEO_FILE_MB = 0
    if main(["export", "--format", "lerobot", "--data", h5, "--out", out, "--lerobot-version", version,
             "--overwrite"]) != 0:
        raise SystemExit(1)


def gf_read(spec: str, out: str) -> None:
    """Every frame as groundflow's reader gives it, in the lerobot names, to ``out`` (.npz)."""
    from dataset.lerobot import open_dataset
    cols: dict[str, list] = {}
    with open_dataset(spec) as ds:
        for i in range(len(ds)):
            ep = ds.episode(i)
            T = len(ep)
            for k, v in (("observation.state", ep.state), ("action", ep.action), ("next.reward", ep.reward),
                         ("next.success", ep.success), ("episode_index", np.full(T, i)),
                         ("frame_index", np.arange(T)), ("task", np.array([ep.instruction] * T, dtype=object)),
                         *((f"observation.images.{c}", ep.images[c]) for c in ds.cameras)):
                cols.setdefault(k, []).append(v)
    np.savez(out, **{k: np.concatenate(v) for k, v in cols.items()})


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else "check"
    if role == "fixture":
        write_fixture(Path(sys.argv[2]) if len(sys.argv) > 2 else FIXTURE)
    elif role == "check":
        sys.exit(main_lerobot())
    else:
        fn = {"gf-make-h5": gf_make_h5, "gf-export": gf_export, "gf-read": gf_read}[role]
        fn(*sys.argv[2:])
