"""LeRobotDataset interop: is decoding video the bottleneck, and what does the round trip cost?

    .venv/bin/python benchmarks/interop.py                       # synthetic frames, 128 and 224 px, ~1 min
    .venv/bin/python benchmarks/interop.py --data demos.h5       # the frames of a collected dataset
    .venv/bin/python benchmarks/interop.py --part roundtrip --work /tmp/interop --jobs 2   # train from both

For each image size: the same frames read from groundflow's HDF5 (lzf, crc32-checked) and decoded from
the LeRobotDataset ``groundflow export --format lerobot`` writes of it (AV1 via SVT-AV1, LeRobot's
default, and H.264; crf 30, keyframe every 2 frames), in frames/s on ONE decoder thread (best of 2
passes, each episode decoded once, sequentially, as ``LeRobotReader`` does), with the export's time,
the bytes on disk and the mean |decoded - original| pixel error. Synthetic frames: a moving square
on a gradient with sensor-like noise (sigma 2), one camera, seeded. Writes benchmarks/results/interop.json
and interop.md.

Round trip (``--part roundtrip``): the PushCube demos ``data/pixels/pushcube_clean_s0.h5`` (400 closed-loop
expert episodes, base_camera + hand_camera at 96 px, pd_ee_delta_pos, panda_wristcam) exported with
``groundflow export --format lerobot --fps 20`` (AV1, crf 30), and the same cheap pixel recipe (a state
policy whose cube and goal entries come from a perception head over the cameras; 4000 policy steps, 2500
head steps, seed 0) trained once from the HDF5 and once from ``lerobot:EXPORT``, each evaluated on the same
100 episodes (seeds 300000...) in the env the checkpoint rebuilds (its recorded controller and robot).
Reported: success with its 95% Wilson interval, whether the two agree within them, the training minutes
(the policy's and the head's training loops, data loading excluded) and the frames/s at which ChunkData
loads the training frames (both cameras) from each, on one thread (best of 3). They agree when the export's
success lies inside the HDF5 run's interval (the issue's test); the converse, the intervals' overlap and
Fisher's exact test are reported beside it. Every step is skipped when
its output is in ``--work`` (a killed run resumes); the results merge into interop.json beside the
frames part's. To do: load the export in lerobot's own trainer.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, load_results, md_table, save_results  # noqa: E402

sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import dataset.lerobot as lerobot_module  # noqa: E402
from dataset import Dataset, DatasetWriter, Episode, write_lerobot  # noqa: E402
from dataset.lerobot import LeRobotExport, LeRobotReader, decode_episode  # noqa: E402

CODECS = ("libsvtav1", "h264")
ROUNDTRIP_KEYS = ("hdf5", "lerobot_export", "frames_per_s", "roundtrip")
"""the round trip part's entries of interop.json (every other entry is the frames part's)"""
GROUNDFLOW = str(ROOT / ".venv" / "bin" / "groundflow")
CAMERAS = ("base_camera", "hand_camera")
IMAGE_SIZE = 96
POLICY_FLAGS = ("--recipe", "multitask", "--cameras", *CAMERAS, "--image-size", str(IMAGE_SIZE),
                "--ignore-state", "*vel", "extra/goal_pos", "extra/obj_pose",
                "--estimate-state", "extra/obj_pose[0:3]", "extra/goal_pos[0:2]", "--estimate-noise", "0",
                "--wandb", "disabled", "--no-progress")
"""the cheap pixel recipe: object entries of the state estimated by a head over the cameras"""


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
        if name == "machine" or name in ROUNDTRIP_KEYS:
            continue
        rows.append([f"{name} HDF5", r["image"], r["frames"], round(r["hdf5"]["frames_per_s"]), r["hdf5"]["MB"], "-",
                     "-"])
        for codec in CODECS:
            c = r[codec]
            rows.append([f"{name} {codec}", r["image"], r["frames"], round(c["frames_per_s"]), c["MB"], c["export_s"],
                         c["mean_abs_err"]])
    out = ("Reading the same frames: groundflow HDF5 vs the LeRobotDataset export's video, one decoder thread\n\n"
           + md_table(["source", "image", "frames", "frames/s", "MB", "export s", "mean abs err"], rows))
    return out + (roundtrip_table(res) if "roundtrip" in res else "")


# ----- round trip -------------------------------------------------------------------------------

def _gf(*args: str, log: Path) -> None:
    """A ``groundflow`` command on one torch thread, at low priority, its output in ``log``."""
    cmd = [GROUNDFLOW, *args]
    print(f"$ groundflow {' '.join(args)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=lambda: os.nice(15))


def _export(h5: Path, out: Path, fps: int) -> float | None:
    """``groundflow export --format lerobot`` of ``h5`` (once); its wall seconds where this run made it."""
    record = out.with_name(out.name + ".export.json")
    if not (out / "meta" / "info.json").is_file():
        t0 = time.perf_counter()
        _gf("export", "--format", "lerobot", "--data", str(h5), "--out", str(out), "--fps", str(fps), "--overwrite",
            log=out.with_name(out.name + ".export.log"))
        record.write_text(json.dumps({"seconds": time.perf_counter() - t0}))
    return json.loads(record.read_text())["seconds"] if record.is_file() else None


def _interface(h5: Path, export: Path) -> dict:
    """What training and evaluation take from the data's meta, from each; a difference is an export/reader bug."""
    from dataset import open_dataset
    got = {}
    for name, spec in (("hdf5", str(h5)), ("lerobot_export", f"lerobot:{export}")):
        with open_dataset(spec) as ds:
            got[name] = {"env_id": ds.env_id, "env_options": ds.meta.get("env_options"),
                         "state_layout": ds.meta.get("state_layout"), "cameras": list(ds.cameras), "episodes": len(ds)}
    if got["hdf5"] != got["lerobot_export"]:
        diff = {k: (got["hdf5"][k], got["lerobot_export"][k]) for k in got["hdf5"]
                if got["hdf5"][k] != got["lerobot_export"][k]}
        raise SystemExit(f"the export does not carry the data's meta through (dataset/lerobot.py): "
                         f"(hdf5, lerobot) differ in {diff}")
    return got["hdf5"]


def load_rate(h5: Path, export: Path, passes: int = 3) -> dict:
    """frames/s at which ``ChunkData`` loads the training frames (every camera) from the HDF5 and from
    the export, one thread (torch and the video decoder), best of ``passes`` taken in turn (the two see
    the same load of a shared machine, and the HDF5 the page cache); and the decoded frames' mean |error|
    against the HDF5's."""
    import torch
    from train.data import ChunkData
    torch.set_num_threads(1)
    one_thread = functools.partial(decode_episode, threads=1)  # (the reader's default: FFmpeg's choice)
    specs = {"hdf5": str(h5), "lerobot_video": f"lerobot:{export}"}
    best, loaded = dict.fromkeys(specs, float("inf")), {}
    for _ in range(passes):
        for name, spec in specs.items():
            lerobot_module.decode_episode, saved = one_thread, lerobot_module.decode_episode
            try:
                loaded.pop(name, None)
                t0 = time.perf_counter()
                loaded[name] = ChunkData(spec, 1, CAMERAS, IMAGE_SIZE)
                best[name] = min(best[name], time.perf_counter() - t0)
            finally:
                lerobot_module.decode_episode = saved
    a, b = loaded["hdf5"], loaded["lerobot_video"]
    if not (np.array_equal(a.state, b.state) and np.array_equal(a.action, b.action)):
        raise SystemExit("ChunkData from the export has other states or actions than from the HDF5")
    err = {c: float(np.abs(a.images[c].astype(np.float32) - b.images[c]).mean()) for c in CAMERAS}
    return {**{k: len(a) * len(CAMERAS) / t for k, t in best.items()}, "frames": len(a) * len(CAMERAS),
            "passes": passes, "mean_abs_err": err}


def run_policy(name: str, data: str, work: Path, a: argparse.Namespace) -> dict:
    """Policy, head, evaluation from ``data`` (each step skipped when done); success and minutes."""
    out = work / name
    pol, final, ev = out / "policy", out / "final", out / "eval.json"
    if not (pol / "summary.json").exists():
        resume = ["--resume"] if (pol / "train_state.pt").exists() else []
        _gf("train", *POLICY_FLAGS, "--data", data, "--out", str(pol), "--steps", str(a.steps), "--seed", str(a.seed),
            *resume, log=out / "policy.log")
    if not (final / "summary.json").exists():
        _gf("train", "estimator", "--from", str(pol / "ckpt"), "--data", data, "--steps", str(a.head_steps),
            "--out", str(final), "--seed", str(a.seed), "--no-progress", log=out / "final.log")
    if not ev.exists():
        _gf("eval", "--ckpt", str(final / "ckpt"), "--episodes", str(a.episodes), "--seed", str(a.eval_seed),
            "--out", str(ev), log=out / "eval.log")
    from policies import read_checkpoint_meta
    r = json.loads(ev.read_text())
    extra = read_checkpoint_meta(final / "ckpt").get("extra", {})
    summary = {d.name: json.loads((d / "summary.json").read_text()) for d in (pol, final)}
    return {"success": r["success_rate"], "ci95": r["ci95"], "episodes": r["episodes"], "successes": r["successes"],
            "train_minutes": sum(x["seconds"] for x in summary.values()) / 60,
            "policy_final_loss": summary["policy"]["final_loss"],
            "head_heldout_rmse_mean": summary["final"].get("heldout_rmse_mean"),
            "env_id": extra.get("env_id"), "env_options": extra.get("env_options"),
            "data": data, "ckpt": str(final / "ckpt")}


def fisher_exact(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p of Fisher's exact test that k1/n1 and k2/n2 successes have one rate."""
    from math import comb
    K, N = k1 + k2, n1 + n2
    p = [comb(n1, k) * comb(n2, K - k) / comb(N, K) for k in range(max(0, K - n2), min(K, n1) + 1)]
    here = comb(n1, k1) * comb(n2, k2) / comb(N, K)
    return min(1.0, sum(q for q in p if q <= here * (1 + 1e-9)))


def roundtrip(a: argparse.Namespace) -> None:
    h5 = (a.data or ROOT / "data" / "pixels" / "pushcube_clean_s0.h5").resolve()
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    export = work / f"{h5.stem.split('_')[0]}_lerobot"
    res = load_results("interop")
    export_s = _export(h5, export, a.fps or 20)
    meta = _interface(h5, export)
    rate = load_rate(h5, export)
    res["frames_per_s"] = {"hdf5": rate["hdf5"], "lerobot_video": rate["lerobot_video"]}
    cmd = " ".join(["benchmarks/interop.py", *sys.argv[1:]])
    res["roundtrip"] = {"command": cmd, "data": str(h5.relative_to(ROOT) if h5.is_relative_to(ROOT) else h5),
                        "jobs": a.jobs, "export": str(export), "export_s": export_s,
                        "export_MB": sum(p.stat().st_size for p in export.rglob("*") if p.is_file()) / 1e6,
                        "hdf5_MB": h5.stat().st_size / 1e6, "fps": a.fps or 20, "codec": "libsvtav1", "crf": 30,
                        "load_frames": rate["frames"], "load_passes": rate["passes"],
                        "load_mean_abs_err": rate["mean_abs_err"], "data_meta": meta,
                        "policy": {"flags": list(POLICY_FLAGS), "steps": a.steps, "head_steps": a.head_steps,
                                   "seed": a.seed, "eval_episodes": a.episodes, "eval_seed": a.eval_seed}}
    save_results("interop", res, table)
    runs = (("hdf5", str(h5)), ("lerobot_export", f"lerobot:{export}"))
    with ThreadPoolExecutor(a.jobs) as pool:  # (the commands are processes: --jobs 2 trains both at once)
        futures = {pool.submit(run_policy, name, data, work, a): name for name, data in runs}
        for f in as_completed(futures):
            res[futures[f]] = f.result()
            save_results("interop", res, table)
    h, x = res["hdf5"], res["lerobot_export"]
    rt = res["roundtrip"]
    # the issue's test: the export's success within the original's 95% Wilson interval; the converse, the
    # intervals' overlap and Fisher's exact test beside it (100/100 vs 99/100 fails the converse: Wilson's
    # upper bound of 99/100 is 0.998)
    rt["agree"] = bool(h["ci95"][0] <= x["success"] <= h["ci95"][1])
    rt["hdf5_in_export_ci"] = bool(x["ci95"][0] <= h["success"] <= x["ci95"][1])
    rt["intervals_overlap"] = bool(max(h["ci95"][0], x["ci95"][0]) <= min(h["ci95"][1], x["ci95"][1]))
    rt["fisher_p"] = fisher_exact(h["successes"], h["episodes"], x["successes"], x["episodes"])
    rt["same_env_options"] = h["env_options"] == x["env_options"] == {
        k: v for k, v in (meta["env_options"] or {}).items() if k in ("control_mode", "robot_uids")}
    save_results("interop", res, table)
    print(table(res))


def roundtrip_table(res: dict) -> str:
    rt, fr = res["roundtrip"], res.get("frames_per_s", {})
    rows = []
    for name, what in (("hdf5", "HDF5 (original)"), ("lerobot_export", "LeRobotDataset export (AV1 video)")):
        r = res.get(name)
        if r is None:
            rows.append([what, "(not run yet)", "-", "-", "-", "-", "-"])
            continue
        rate = fr.get("hdf5" if name == "hdf5" else "lerobot_video")
        rmse = r.get("head_heldout_rmse_mean")
        rows.append([what, f"{r['success']:.2f}", f"[{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]", r["episodes"],
                     round(r["train_minutes"], 1), f"{rmse:.5f}" if rmse is not None else "-",
                     round(rate) if rate else "-"])
    out = (f"\nRound trip: PushCube-v1 demos ({rt['data']}, {rt['data_meta']['episodes']} episodes, cameras "
           f"{', '.join(rt['data_meta']['cameras'])} at 96 px) exported as a LeRobotDataset v3.0 (AV1 crf "
           f"{rt['crf']}, {rt['fps']} fps: {rt['export_MB']:.1f} MB, HDF5 {rt['hdf5_MB']:.1f} MB"
           + (f", exported in {rt['export_s']:.0f} s" if rt.get("export_s") else "")
           + f"); the same pixel recipe ({rt['policy']['steps']} policy + {rt['policy']['head_steps']} head steps, "
           f"seed {rt['policy']['seed']}) trained from each, evaluated on {rt['policy']['eval_episodes']} episodes "
           f"(seeds {rt['policy']['eval_seed']}...). Loading: ChunkData, both cameras, one thread, "
           f"{rt['load_frames']} frames, best of {rt.get('load_passes', 2)}; decoded frames differ from the HDF5's by "
           + ", ".join(f"{v:.1f}" for v in rt["load_mean_abs_err"].values()) + " (mean |error|, 0-255)."
           f"\n\n`{rt['command']}`\n\n"
           + md_table(["trained from", "success", "95% Wilson CI", "episodes", "train min", "head held-out RMSE",
                       "load frames/s"], rows)
           + "\ntrain min: the policy's and the head's training loops (loading the data excluded, one torch thread, "
           + (f"{rt['jobs']} runs at once on the machine's {res['machine']['cpus']} shared cores).\n"
              if rt.get("jobs", 1) > 1 else "one run at a time).\n"))
    if "agree" in rt:
        h, x = res["hdf5"], res["lerobot_export"]
        verdict = ("agree: the export's success lies inside the HDF5 run's 95% Wilson interval" if rt["agree"] else
                   "do NOT agree: the export's success lies outside the HDF5 run's 95% Wilson interval")
        verdict += (f" (the converse: {'yes' if rt['hdf5_in_export_ci'] else 'no'}; the intervals "
                    f"{'overlap' if rt['intervals_overlap'] else 'are disjoint'}; Fisher's exact test p = "
                    f"{rt['fisher_p']:.2f})")
        out += (f"\nThe two successes ({h['success']:.2f} from HDF5, {x['success']:.2f} from the export) {verdict}. "
                f"Both checkpoints rebuild the env with {x['env_options']}"
                + ("" if rt["same_env_options"] else " -- NOT the same env options as the data's") + ".\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("frames", "roundtrip"), default="frames")
    p.add_argument("--data", type=Path, help="frames: a groundflow dataset with cameras (default: synthetic frames); "
                   "roundtrip: the demos (default: data/pixels/pushcube_clean_s0.h5)")
    p.add_argument("--fps", type=int, help="the export's fps where --data does not record it (roundtrip: 20)")
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 224])
    p.add_argument("--episodes", type=int, default=20, help="frames: synthetic episodes; roundtrip: eval episodes "
                   "(default 100 there)")
    p.add_argument("--frames", type=int, default=100)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "interop",
                   help="roundtrip: where the export, checkpoints and evaluations go (steps done there are skipped)")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--head-steps", type=int, default=2500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-seed", type=int, default=300_000)
    p.add_argument("--jobs", type=int, default=1, help="roundtrip: runs trained at once (1: one after the other)")
    args = p.parse_args()
    if args.part == "roundtrip":
        if "--episodes" not in sys.argv:
            args.episodes = 100
        roundtrip(args)
        return
    res = {k: v for k, v in load_results("interop").items() if k in ROUNDTRIP_KEYS}  # (the other part's)
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
