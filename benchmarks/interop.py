"""LeRobotDataset interop (#45): is decoding video the bottleneck, and what does the round trip cost?

    .venv/bin/python benchmarks/interop.py                       # synthetic frames, 128 and 224 px, ~1 min
    .venv/bin/python benchmarks/interop.py --data demos.h5       # the frames of a collected dataset

For each image size: the same frames read from groundflow's HDF5 (lzf, crc32-checked) and decoded from
the LeRobotDataset ``groundflow export --format lerobot`` writes of it (AV1 via SVT-AV1, LeRobot's
default, and H.264; crf 30, keyframe every 2 frames), in frames/s on ONE decoder thread (best of 2
passes, each episode decoded once, sequentially, as ``LeRobotReader`` does), with the export's time,
the bytes on disk and the mean |decoded - original| pixel error. Synthetic frames: a moving square
on a gradient with sensor-like noise (sigma 2), one camera, seeded. Writes benchmarks/results/interop.json
and interop.md.

Skeleton for the round trip benchmark (to do): train the same policy from the HDF5 and from the
``lerobot:`` export and compare losses and success; load the export in lerobot's own trainer.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, md_table, save_results  # noqa: E402

sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from dataset import Dataset, DatasetWriter, Episode, write_lerobot  # noqa: E402
from dataset.lerobot import LeRobotExport, LeRobotReader, decode_episode  # noqa: E402

CODECS = ("libsvtav1", "h264")


def synthetic(path: Path, size: int, episodes: int, frames: int, seed: int = 0) -> Path:
    """A groundflow dataset of ``episodes`` x ``frames`` synthetic images of ``size`` px, at 20 fps."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    r = max(2, size // 10)
    with DatasetWriter(path, "bench/synthetic", 8, 7, cameras=("front",), meta={"fps": 20}, overwrite=True) as w:
        for e in range(episodes):
            bg = np.stack([(xx + yy) * 128 // size + 40, np.full_like(xx, 90 + 10 * e), 200 - yy * 100 // size], -1)
            imgs = np.empty((frames, size, size, 3), np.uint8)
            for t in range(frames):
                im = bg.astype(np.float64)
                cx, cy = int(size * (0.2 + 0.6 * t / frames)), int(size * (0.3 + 0.2 * np.sin(t / 10 + e)))
                im[max(0, cy - r):cy + r, max(0, cx - r):cx + r] = (220, 40, 40)
                imgs[t] = np.clip(im + rng.normal(0, 2, im.shape), 0, 255)
            w.add(Episode(state=rng.normal(size=(frames, 8)).astype(np.float32),
                          action=rng.normal(size=(frames, 7)).astype(np.float32), reward=np.zeros(frames, np.float32),
                          success=np.zeros(frames, bool), instruction=f"task {e % 3}", images={"front": imgs}))
    return path


def measure(h5: Path, work: Path, fps: int | None = None) -> dict:
    """frames/s from HDF5 and from each codec's export of ``h5`` (first camera), one thread."""
    t0 = time.perf_counter()
    with Dataset(h5) as ds:
        cam = ds.cameras[0]
        orig = [ds.episode(i).images[cam] for i in range(len(ds))]
    n = sum(len(x) for x in orig)
    res = {"frames": n, "image": "x".join(map(str, orig[0].shape[1:3])),
           "hdf5": {"frames_per_s": n / (time.perf_counter() - t0), "MB": h5.stat().st_size / 1e6}}
    for codec in CODECS:
        out = work / f"{h5.stem}_{codec}"
        t0 = time.perf_counter()
        write_lerobot([h5], out, LeRobotExport(codec=codec, fps=fps), overwrite=True)
        export_s = time.perf_counter() - t0
        reader = LeRobotReader(out)
        key = reader.map.cameras[cam]
        best, err = float("inf"), 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            for i, e in enumerate(reader._eps):
                path, offset = e.videos[key]
                got = decode_episode(path, offset, reader._rows["timestamp"][e.start:e.start + e.length],
                                     reader.map.image_size[key], key, threads=1)
                err = max(err, float(np.abs(got.astype(np.float64) - orig[i]).mean()))
            best = min(best, time.perf_counter() - t0)
        res[codec] = {"frames_per_s": n / best, "export_s": export_s, "mean_abs_err": err,
                      "MB": sum(p.stat().st_size for p in (out / "videos").rglob("*.mp4")) / 1e6}
    return res


def table(res: dict) -> str:
    rows = []
    for name, r in res.items():
        if name == "machine":
            continue
        rows.append([f"{name} HDF5", r["image"], r["frames"], round(r["hdf5"]["frames_per_s"]), r["hdf5"]["MB"], "-",
                     "-"])
        for codec in CODECS:
            c = r[codec]
            rows.append([f"{name} {codec}", r["image"], r["frames"], round(c["frames_per_s"]), c["MB"], c["export_s"],
                         c["mean_abs_err"]])
    return ("Reading the same frames: groundflow HDF5 vs the LeRobotDataset export's video, one decoder thread\n\n"
            + md_table(["source", "image", "frames", "frames/s", "MB", "export s", "mean abs err"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="a groundflow dataset with cameras (default: synthetic frames)")
    p.add_argument("--fps", type=int, help="the export's fps where --data does not record it")
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 224])
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--frames", type=int, default=100)
    args = p.parse_args()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.data:
            res[args.data.name] = measure(args.data, work, args.fps)
        else:
            for size in args.sizes:
                h5 = synthetic(work / f"synthetic_{size}.h5", size, args.episodes, args.frames)
                res[f"synthetic {size}px"] = measure(h5, work)
                save_results("interop", res, table)
    save_results("interop", res, table)
    print(table(res))


if __name__ == "__main__":
    main()
