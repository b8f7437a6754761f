"""Reliability: what happens on bad input, damaged files, crashes and kills.

    .venv/bin/python benchmarks/reliability.py                        # every case (~3-5 min on 2 cores)
    .venv/bin/python benchmarks/reliability.py --cases bad_prefix_nan idle_clients

Each case runs in its own process with its own timeout: a case that does not finish is killed
(its whole process group) and recorded as ``hang``, one whose process dies (a segfault in h5py
included) as ``crash``. Servers listen on 127.0.0.1 only; every file lives in a temp folder.

Outcomes, judged from what actually happened:

    ok             handled as designed without an error (e.g. loading the complete previous checkpoint)
    clear_error    refused with one line of a groundflow error type (or the CLI's one-line error) naming
                   the file or the problem
    unclear_error  a raw exception / traceback, a multi-line message, or one that names neither
    crash          the process (or the server) died
    hang           no answer within the case's timeout
    data_loss      a corrupt or wrong file was published, written data was destroyed, or damaged
                   data loaded silently
    security       a crafted file ran code

Writes benchmarks/results/reliability.json (``{"cases": {name: {"outcome", "detail"}}, "machine"}``)
and reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, machine, md_table, write  # noqa: E402

sys.path.insert(0, str(ROOT))  # `import deploy` must find the package, not a script

import numpy as np  # noqa: E402

OUTCOMES = ("ok", "clear_error", "unclear_error", "crash", "hang", "data_loss", "security")
SEVERITY = {"ok": 0, "clear_error": 1, "unclear_error": 2, "hang": 3, "crash": 4, "data_loss": 5, "security": 6}
Result = tuple[str, str]
SEED = 0  # set by --seed (each case runs in its own process)


def worst(*results: Result) -> Result:
    out = max(results, key=lambda r: SEVERITY[r[0]])
    return out[0], "; ".join(r[1] for r in results)


def api_and_cli(api: Result, cli_res: Result, cmd: str) -> Result:
    """The library's exception and the CLI's line; said once when the CLI prints the same message."""
    msg = api[1].split(": ", 1)[-1]
    if api[0] == cli_res[0] == "clear_error" and msg in cli_res[1]:
        return "clear_error", f"{api[1]} (`groundflow {cmd}`: the same, one line, exit 1)"
    return worst(api, cli_res)


def judge_exception(e: BaseException, *needles: str) -> Result:
    """clear_error: a groundflow error (or a FileExistsError, which the CLI prints as one line)
    whose message is one line and contains every needle (the file, the problem)."""
    from envs.errors import GroundflowError
    msg = str(e).strip()
    problems = []
    if not isinstance(e, (GroundflowError, FileExistsError)):
        problems.append(f"raw {type(e).__module__}.{type(e).__name__}")
    if "\n" in msg:
        problems.append(f"{len(msg.splitlines())}-line message")
    missing = [n for n in needles if n not in msg]
    if missing:
        problems.append(f"does not name {missing}")
    first = msg.splitlines()[0][:400] if msg else ""
    if problems:
        return "unclear_error", f"{type(e).__name__}: {first} ({', '.join(problems)})"
    return "clear_error", f"{type(e).__name__}: {first}"


def cli(argv: list[str]) -> tuple[Any, str, str]:
    """``groundflow ARGV`` in this process: (exit code, stdout, stderr); an exception escaping
    main() is printed as the traceback a user would see."""
    from groundflow.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException:  # noqa: BLE001  (what escapes main is what the user sees)
            traceback.print_exc()
            code = "traceback"
    return code, out.getvalue(), err.getvalue()


def judge_cli(code: Any, err: str, cmd: str, *needles: str) -> Result:
    """clear_error: exit 1 and one ``groundflow CMD: error: ...`` line naming every needle, no traceback."""
    lines = [ln for ln in err.splitlines() if ln.startswith(f"groundflow {cmd}: error:")]
    problems = []
    if "Traceback" in err:
        problems.append("traceback")
    if code != 1:
        problems.append(f"exit code {code}")
    if len(lines) != 1:
        problems.append(f"{len(lines)} error lines")
    missing = [n for n in needles if lines and n not in lines[0]]
    if missing:
        problems.append(f"does not name {missing}")
    shown = (lines[0] if lines else err.strip().splitlines()[-1] if err.strip() else "")[:400]
    if problems:
        return "unclear_error", f"CLI: {shown} ({', '.join(problems)})"
    return "clear_error", f"CLI: {shown}"


def run_py(args: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


def one_error_line(err: str, cmd: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(f"groundflow {cmd}: error:")]
    return lines[-1] if lines else (err.strip().splitlines() or [""])[-1]


# ----- small fixtures (as in tests/test_reliability_data.py) ------------------------------------

def _episode(T: int = 10, S: int = 5, A: int = 3, seed: int = 0):
    from dataset import Episode
    rng = np.random.default_rng([SEED, seed])
    return Episode(state=rng.normal(size=(T, S)).astype(np.float32), action=rng.normal(size=(T, A)).astype(np.float32),
                   reward=rng.normal(size=T).astype(np.float32), success=np.arange(T) == T - 1,
                   instruction=f"push the cube {seed % 2}", task_id=seed % 2, seed=seed,
                   sim_state=rng.normal(size=(T, 9)), final_state=rng.normal(size=S).astype(np.float32))


def _write(path: Path, n: int = 3, **kw: Any) -> Path:
    from dataset import DatasetWriter
    with DatasetWriter(path, "test/env", 5, 3, **kw) as w:
        for i in range(n):
            w.add(_episode(seed=i))
    return path


def _same_episodes(path: Path, seeds: list[int], allow_incomplete: bool = False) -> str | None:
    """None if ``path`` holds exactly the episodes ``_episode(seed=s)``; else what differs."""
    from dataset import Dataset
    with Dataset(path, allow_incomplete=allow_incomplete) as ds:
        if len(ds) != len(seeds):
            return f"{len(ds)} episodes, expected {len(seeds)}"
        for i, s in enumerate(seeds):
            got, want = ds.episode(i), _episode(seed=s)
            for f in ("state", "action", "reward", "success"):
                if not np.array_equal(getattr(got, f), getattr(want, f)):
                    return f"episode {i} field {f} differs"
            if got.instruction != want.instruction or got.task_id != want.task_id:
                return f"episode {i} instruction/task differs"
    return None


def _flip_byte(path: Path, dataset: str, index: int = 5) -> None:
    import h5py
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + index)
        b = fh.read(1)
        fh.seek(offset + index)
        fh.write(bytes([b[0] ^ 0x10]))


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _tiny_policy(seed: int = 0):
    import torch

    import policies
    from policies import PolicyConfig
    torch.manual_seed(seed)
    p = policies.make_policy(PolicyConfig(kind="flow", state_dim=6, action_dim=3, horizon=4, n_exec=2))
    rng = np.random.default_rng(seed)
    p.fit_normalizer(rng.normal(size=(50, 6)), rng.uniform(-2, 2, size=(50, 3)))
    return p


def _same_weights(a, b) -> bool:
    import torch
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class _Payload:
    """Unpickling it runs code: writes a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


# ----- datasets ---------------------------------------------------------------------------------

def case_dataset_concurrent_writer(tmp: Path) -> Result:
    """A writer (what `groundflow collect` holds) is mid-run when a real `groundflow collect
    --overwrite` process targets the same path."""
    from dataset import DatasetWriter
    path = tmp / "d.h5"
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode(seed=0))
    r = run_py(["-m", "groundflow.cli", "collect", "--env", "adroit/door", "--episodes", "2", "--out", str(path),
                "--overwrite", "--no-progress", "--seed", str(SEED)], timeout=120)
    w.add(_episode(seed=1))
    try:
        w.close()
    except Exception as e:  # noqa: BLE001
        return "data_loss", f"the first writer could not publish: {type(e).__name__}: {e}"
    try:
        diff = _same_episodes(path, [0, 1])
    except Exception as e:  # noqa: BLE001
        return "data_loss", f"published file unreadable after the second writer ran: {type(e).__name__}: {e}"
    if diff:
        return "data_loss", f"published file is not the first writer's data: {diff}"
    if r.returncode == 0:
        return "data_loss", "the second collect ran to completion on the same path"
    second = judge_cli(r.returncode, r.stderr, "collect", str(path), "being written by another process")
    return second[0], (f"second writer (subprocess, --overwrite) refused: {second[1]}; first writer's 2 episodes "
                       "published intact")


def case_dataset_stale_partial(tmp: Path) -> Result:
    """`groundflow collect` SIGKILLed mid-write (100 times, at random sizes of its .partial), then re-run
    without --overwrite; what the killed run had flushed must stay readable."""
    from deploy.procs import popen_tied
    from dataset import Dataset
    rng = np.random.default_rng(SEED)
    kills = 100
    results, kept, lost = [], [], []
    for i in range(kills):
        kill_at = float(rng.uniform(0.05e6, 1.2e6))  # bytes in the .partial when the kill comes (~0.17 MB/episode)
        path = tmp / f"d{i}.h5"
        partial = path.with_name(path.name + ".partial")
        proc = popen_tied([sys.executable, "-m", "groundflow.cli", "collect", "--env", "adroit/door", "--episodes",
                           "5000", "--out", str(path), "--seed", str(SEED + i)], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "0", "TQDM_MINITERS": "1"})
        progress: list[str] = []  # its progress bar advances after each episode is written and flushed
        reader = threading.Thread(target=lambda p=proc: progress.extend(iter(lambda: p.stderr.read(256), "")))
        reader.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if partial.exists() and partial.stat().st_size >= kill_at:
                break
            time.sleep(0.001)
        proc.kill()
        rc = proc.wait()
        reader.join(10)
        flushed = max((int(m) for m in re.findall(r"\| *(\d+)/5000", "".join(progress))), default=0)
        if rc != -signal.SIGKILL:
            return "unclear_error", f"kill {i}: the writer was not killed mid-write (exit {rc})"
        code, _, err = cli(["collect", "--env", "adroit/door", "--episodes", "2", "--out", str(path), "--no-progress"])
        results.append(judge_cli(code, err, "collect", f"{path.name}.partial exists", "--overwrite"))
        if path.exists():
            return "data_loss", f"kill {i}: a file was published at {path.name} after the kill"
        size = partial.stat().st_size / 1e6
        try:  # what the killed run flushed must stay readable (checksums verified on read)
            with Dataset(partial, allow_incomplete=True) as ds:
                n = len(ds)
                for j in range(n):
                    ds.episode(j)
            kept.append(n)
        except Exception as e:  # noqa: BLE001
            why = (str(e).split("(")[-1] if "(" in str(e) else str(e)[-60:]).rstrip(")'\"")[:60]
            lost.append((flushed, f"kill {i} at {size:.2f} MB after >= {flushed} flushed episode(s): {why}"))
        for f in (partial, path.with_name(path.name + ".lock")):
            f.unlink(missing_ok=True)
    outcome = max((r[0] for r in results), key=SEVERITY.get)
    odd = [f"kill {i}: {r[1]}" for i, r in enumerate(results) if r[0] != results[0][0]]
    rerun = ("refused in one line naming the .partial and --overwrite" if results[0][0] == "clear_error"
             else results[0][1])
    detail = (f"{kills} SIGKILLs mid-write, nothing published; every re-run without --overwrite {rerun}"
              + (f" ({'; '.join(odd)})" if odd else "") + f"; the killed run's .partial readable in "
              f"{len(kept)}/{kills} ({min(kept, default=0)}-{max(kept, default=0)} episodes)")
    lost.sort(key=lambda x: -x[0])
    if any(n > 0 for n, _ in lost):
        return "data_loss", (f"{len(lost)}/{kills} killed runs' .partial files are unreadable, flushed episodes "
                             f"lost ({'; '.join(d for _, d in lost[:2])}); " + detail)
    if lost:  # unreadable, but nothing complete had been written yet: nothing lost, the re-run's hint is wrong
        return "unclear_error", (f"{len(lost)}/{kills} .partial files unreadable (no flushed episode shown by "
                                 f"the progress bar, yet the re-run says its episodes are readable: {lost[0][1]}); "
                                 + detail)
    return outcome, detail


def case_dataset_target_appeared(tmp: Path) -> Result:
    from dataset import DatasetWriter
    path = tmp / "d.h5"
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode(seed=0))
    path.write_bytes(b"someone else's file")
    try:
        w.close()
        res: Result = ("data_loss", "close() replaced a file that appeared meanwhile")
    except Exception as e:  # noqa: BLE001
        res = judge_exception(e, str(path), "appeared while this run was writing")
    if path.read_bytes() != b"someone else's file":
        return "data_loss", "the file that appeared was replaced"
    diff = _same_episodes(path.with_name("d.h5.partial"), [0])
    if diff:
        return "data_loss", f"the new data beside it is not complete: {diff}"
    return res[0], res[1] + "; the other file untouched, the new data complete in d.h5.partial"


def case_dataset_flipped_action_bytes(tmp: Path) -> Result:
    from train.data import ChunkData
    path = _write(tmp / "d.h5")
    _flip_byte(path, "episodes/000001/action")
    try:
        ChunkData(path, horizon=4)
        return "data_loss", "a flipped byte in episode 1's actions loaded silently"
    except Exception as e:  # noqa: BLE001
        api = judge_exception(e, str(path), "episode 000001", "checksum")
    code, _, err = cli(["train", "--data", str(path), "--steps", "1", "--out", str(tmp / "r")])
    return api_and_cli(api, judge_cli(code, err, "train", str(path), "episode 000001", "checksum"), "train")


def _damaged_header(tmp: Path, damage: Callable[[Any], None], needle: str) -> Result:
    import h5py

    from dataset import Dataset
    path = _write(tmp / "d.h5")
    with h5py.File(path, "r+") as f:
        damage(f)
    try:
        Dataset(path).close()
        return "data_loss", "the damaged dataset opened without an error"
    except Exception as e:  # noqa: BLE001
        api = judge_exception(e, str(path), needle)
    code, _, err = cli(["train", "--data", str(path), "--steps", "1", "--out", str(tmp / "r")])
    return api_and_cli(api, judge_cli(code, err, "train", str(path), needle), "train")


def case_dataset_missing_env_id(tmp: Path) -> Result:
    return _damaged_header(tmp, lambda f: f.attrs.__delitem__("env_id"), "env_id")


def case_dataset_missing_episodes(tmp: Path) -> Result:
    return _damaged_header(tmp, lambda f: f.__delitem__("episodes"), "episodes")


def case_dataset_heavily_corrupted(tmp: Path) -> Result:
    """2 KB of random bytes at 10 offsets (header, B-trees, heaps, data); read everything back."""
    from dataset import Dataset
    path = _write(tmp / "d.h5")
    clean = path.read_bytes()
    rng = np.random.default_rng(SEED)
    offsets = [0, 512, 1024, 2048, 3072, 4096, 6144, len(clean) // 2, len(clean) - 4096, len(clean) - 2048]
    tally: dict[str, list[int]] = {}
    results: list[Result] = []
    for start in offsets:
        bad = bytearray(clean)
        bad[start:start + 2048] = rng.integers(0, 256, 2048, dtype=np.uint8).tobytes()
        path.write_bytes(bytes(bad))
        try:
            with Dataset(path) as ds:
                ds.frames()
            diff = _same_episodes(path, [0, 1, 2])
            kind = "intact" if diff is None else "silently_different"
            results.append(("ok", "") if diff is None else ("data_loss", f"offset {start}: loaded, but {diff}"))
        except Exception as e:  # noqa: BLE001
            r = judge_exception(e, str(path))
            kind = r[0]
            results.append(r if r[0] == "clear_error" else (r[0], f"offset {start}: {r[1]}"))
        tally.setdefault(kind, []).append(start)
    out = max(results, key=lambda r: SEVERITY[r[0]])
    summary = ", ".join(f"{k} at {v}" for k, v in tally.items())
    example = next((r[1] for r in results if r[0] == out[0] and r[1]), "")
    return out[0], f"{len(offsets)} offsets: {summary}" + (f"; e.g. {example}" if example else "")


def case_dataset_nan_state(tmp: Path) -> Result:
    from train.data import ChunkData
    from dataset import Dataset, DatasetWriter
    src = _write(tmp / "ok.h5")
    bad = tmp / "nan.h5"
    with Dataset(src) as ds, DatasetWriter(bad, "test/env", 5, 3) as w:
        for i in range(len(ds)):
            ep = ds.episode(i)
            if i == 1:
                ep.state[3, 0] = np.nan
            w.add(ep)
    try:
        ChunkData(bad, horizon=4)
        return "data_loss", "a NaN state loaded into training data without an error"
    except Exception as e:  # noqa: BLE001
        api = judge_exception(e, str(bad), "episode 1", "NaN/inf in state")
    code, _, err = cli(["train", "--data", str(bad), "--steps", "1", "--out", str(tmp / "r")])
    return api_and_cli(api, judge_cli(code, err, "train", str(bad), "episode 1", "NaN"), "train")


# ----- checkpoints ------------------------------------------------------------------------------

def _damaged_ckpt(tmp: Path, damage: Callable[[Path], None], *needles: str) -> Result:
    import policies
    ckpt = tmp / "ckpt"
    _tiny_policy(SEED).save(ckpt, extra={"env_id": "maniskill/PushCube-v1"})
    damage(ckpt)
    try:
        policies.load(ckpt)
        return "data_loss", "the damaged checkpoint loaded without an error"
    except Exception as e:  # noqa: BLE001
        api = judge_exception(e, str(ckpt), *needles)
    code, _, err = cli(["eval", "--ckpt", str(ckpt), "--episodes", "1"])
    return api_and_cli(api, judge_cli(code, err, "eval", str(ckpt), *needles), "eval")


def case_ckpt_truncated_config(tmp: Path) -> Result:
    return _damaged_ckpt(tmp, lambda c: _truncate(c / "config.json"), "config.json", "not valid JSON")


def case_ckpt_changed_dim(tmp: Path) -> Result:
    def change(c: Path) -> None:
        meta = json.loads((c / "config.json").read_text())
        meta["config"]["state_dim"] = 7
        (c / "config.json").write_text(json.dumps(meta))
    return _damaged_ckpt(tmp, change, "model.safetensors", "does not fit")


def case_ckpt_truncated_weights(tmp: Path) -> Result:
    return _damaged_ckpt(tmp, lambda c: _truncate(c / "model.safetensors"), "model.safetensors", "unreadable")


def case_ckpt_crash_between_renames(tmp: Path) -> Result:
    """A process saving a new checkpoint over an old one is SIGKILLed between its two renames."""
    import warnings

    import policies
    ckpt = tmp / "ckpt"
    v1 = _tiny_policy(SEED)
    v1.save(ckpt, extra={"step": 1})
    code = ("import os, signal, sys\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import reliability\n"
            f"p = reliability._tiny_policy({SEED + 1})\n"
            "real, n = os.replace, []\n"
            "def dies_on_second(src, dst):\n"
            "    n.append(dst)\n"
            "    if len(n) == 2:\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    real(src, dst)\n"
            "os.replace = dies_on_second\n"
            f"p.save({str(ckpt)!r}, extra={{'step': 2}})\n")
    r = run_py(["-c", code], timeout=120)
    if r.returncode != -signal.SIGKILL:
        return "unclear_error", (f"the saving process was not killed between the renames (exit {r.returncode}): "
                                 f"{r.stderr[-200:]}")
    state = f"after the kill: {ckpt.name} {'exists' if ckpt.exists() else 'missing'}, " \
            f"{ckpt.name}.old {'exists' if ckpt.with_name('ckpt.old').exists() else 'missing'}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = policies.load(ckpt)
            step = policies.read_checkpoint_meta(ckpt)["extra"]["step"]
        except Exception as e:  # noqa: BLE001
            res = judge_exception(e, str(ckpt))
            return ("data_loss" if res[0] == "clear_error" else res[0]), f"{state}; loading fails: {res[1]}"
    if not _same_weights(loaded, v1) or step != 1:
        return "data_loss", f"{state}; loaded weights are not the complete previous version (step {step})"
    warned = [str(w.message) for w in caught if "interrupted" in str(w.message)]
    v2 = _tiny_policy(SEED + 2)
    v2.save(ckpt, extra={"step": 3})
    cleaned = _same_weights(policies.load(ckpt), v2) and not ckpt.with_name("ckpt.old").exists()
    return "ok", (f"{state}; load falls back to the complete previous version (step 1)"
                  f"{' with a warning' if warned else ' (no warning)'}; the next save publishes"
                  f"{' and drops the fallback' if cleaned else ' but leaves ckpt.old'}")


# ----- training state ---------------------------------------------------------------------------

def _tiny_run(tmp: Path) -> tuple[Path, Path, list[str]]:
    from train.bc import TrainArgs, train
    data = _write(tmp / "tiny.h5", n=4)
    train(TrainArgs(data=(data,), steps=2, out=tmp / "run", batch_size=8, wandb="disabled", progress=False,
                    save_every=2, horizon=4, n_exec=2, seed=SEED))
    argv = ["train", "--data", str(data), "--out", str(tmp / "run"), "--resume", "--steps", "4", "--horizon", "4",
            "--n-exec", "2", "--batch-size", "8", "--wandb", "disabled", "--no-progress", "--seed", str(SEED)]
    return data, tmp / "run", argv


def case_train_state_truncated(tmp: Path) -> Result:
    _, run, argv = _tiny_run(tmp)
    _truncate(run / "train_state.pt", 0.6)
    code, _, err = cli(argv)
    return judge_cli(code, err, "train", "train_state.pt", "truncated or corrupt")


def case_train_state_crafted_pickle(tmp: Path) -> Result:
    import torch
    _, run, argv = _tiny_run(tmp)
    st = torch.load(run / "train_state.pt", weights_only=True)
    marker = tmp / "pwned"
    st["history"].append(_Payload(marker))
    torch.save(st, run / "train_state.pt")
    code, _, err = cli(argv)
    if marker.exists():
        return "security", f"resuming from the crafted train_state.pt ran its payload (exit {code})"
    return judge_cli(code, err, "train", "train_state.pt", "refusing to unpickle")


def case_train_diverged_no_ckpt(tmp: Path) -> Result:
    import policies
    data = _write(tmp / "tiny.h5", n=4)
    out = tmp / "div"
    code, _, err = cli(["train", "--data", str(data), "--out", str(out), "--steps", "3", "--lr", "1e30",
                        "--warmup-steps", "1", "--horizon", "4", "--n-exec", "2", "--batch-size", "8",
                        "--save-every", "2", "--wandb", "disabled", "--no-progress", "--seed", str(SEED)])
    if (out / "ckpt").exists():
        p = policies.load(out / "ckpt")
        if not all(bool(v.isfinite().all()) for v in p.state_dict().values() if v.is_floating_point()):
            return "data_loss", "a checkpoint with NaN weights was written"
    res = judge_cli(code, err, "train", "non-finite loss", "no checkpoint was written")
    return res[0], res[1] + ("; no checkpoint on disk" if not (out / "ckpt").exists() else "; a finite checkpoint kept")


# ----- policy server ----------------------------------------------------------------------------

STATE, ACTION, INSTR = 35, 8, "push the cube to the goal region"


def _served_ckpt(tmp: Path) -> Path:
    import torch

    import policies
    cfg = policies.PolicyConfig(kind="flow", state_dim=STATE, action_dim=ACTION, horizon=8, n_exec=4, size="tiny")
    torch.manual_seed(SEED)
    m = policies.FlowMatchingVLA(cfg)
    rng = np.random.default_rng(SEED)
    m.fit_normalizer(rng.normal(size=(256, STATE)), rng.uniform(-1, 1, size=(256, ACTION)))
    m.lang.cache[INSTR] = torch.randn(1, cfg.lang_dim)  # the checkpoint's instruction (no MiniLM needed)
    m.save(tmp / "ckpt")
    return tmp / "ckpt"


def _obs(**kw: Any) -> dict[str, Any]:
    return {"state": np.zeros(STATE, np.float32), "instruction": INSTR, **kw}


SYMPTOM = "names the chunk the policy made, not the input; code inference_failed, not bad_request"


def _bad_request(tmp: Path, needles: tuple[str, ...], note: str = "", **infer: Any) -> Result:
    """One bad request against a real server: a clear refusal, and the server still serves."""
    import policies
    from deploy.client import PolicyClient
    from deploy.server import PolicyServer
    policy = policies.load(_served_ckpt(tmp))
    obs = infer.pop("obs", _obs())
    with PolicyServer(policy, port=0) as srv, PolicyClient(port=srv.port, timeout=30) as c:
        t0 = time.perf_counter()
        try:
            r = c.infer(obs, **infer)
            a = r.actions
            res: Result = ("unclear_error", f"no error: a chunk came back (max |a| {np.abs(a).max():.3g}, "
                           f"finite {bool(np.isfinite(a).all())})")
        except Exception as e:  # noqa: BLE001
            res = judge_exception(e, *needles)
        ms = (time.perf_counter() - t0) * 1e3
        try:
            after = c.infer(_obs(), seed=0).actions
            alive = after.shape == (8, ACTION) and bool(np.isfinite(after).all())
        except Exception as e:  # noqa: BLE001
            return "crash", f"{res[1]}; then the server stopped serving: {type(e).__name__}: {e}"
    if not alive:
        return "crash", f"{res[1]}; the next good request got a bad chunk"
    extra = f" ({note})" if note and res[0] == "clear_error" else ""
    return res[0], f"{res[1]} [{ms:.0f} ms; the next request is served]{extra}"


def case_server_absurd_state_1e30(tmp: Path) -> Result:
    return _bad_request(tmp, ("inference_failed", "not finite"), SYMPTOM,
                        obs=_obs(state=np.full(STATE, 1e30, np.float32)),
                        seed=0)


def case_server_absurd_state_3e38(tmp: Path) -> Result:
    return _bad_request(tmp, ("inference_failed", "not finite"), SYMPTOM,
                        obs=_obs(state=np.full(STATE, 3e38, np.float32)),
                        seed=0)


def _prefix(v: float) -> np.ndarray:
    return np.full((6, ACTION), v, np.float32)


def case_bad_prefix_1e30(tmp: Path) -> Result:
    return _bad_request(tmp, ("inference_failed",), SYMPTOM, prefix=_prefix(1e30), frozen=3, seed=0)


def case_bad_prefix_3e38(tmp: Path) -> Result:
    return _bad_request(tmp, ("inference_failed",), SYMPTOM, prefix=_prefix(3e38), frozen=3, seed=0)


def case_bad_prefix_far(tmp: Path) -> Result:
    return _bad_request(tmp, ("far outside the action bounds",), SYMPTOM, prefix=_prefix(1e3), frozen=3, seed=0)


def case_bad_prefix_nan(tmp: Path) -> Result:
    return _bad_request(tmp, ("bad_request", "prefix must be finite"), prefix=_prefix(np.nan), frozen=3, seed=0)


def case_huge_instruction(tmp: Path) -> Result:
    return _bad_request(tmp, ("bad_request", "1000000 characters", "limit"), obs=_obs(instruction="x" * 1_000_000))


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def case_many_instructions(tmp: Path) -> Result:
    """300 unique instructions: served policy's default (checkpoint instructions only) and
    ``--paraphrases 16`` (MiniLM encodes them; at most 16 kept); nothing written to disk."""
    import policies
    from deploy.client import PolicyClient
    from deploy.errors import ServerError
    from deploy.server import PolicyServer
    cache_dir = tmp / "lang_cache"
    os.environ["GROUNDFLOW_LANG_CACHE"] = str(cache_dir)
    ckpt = _served_ckpt(tmp)
    parts = []
    for paraphrases in (0, 16):
        policy = policies.load(ckpt)
        with PolicyServer(policy, port=0, paraphrases=paraphrases) as srv, \
                PolicyClient(port=srv.port, timeout=120) as c:
            n0 = len(policy.lang.cache)
            codes: dict[str, int] = {}

            def ask(i: int) -> None:
                try:
                    c.infer(_obs(instruction=f"do task number {i}"), seed=0)
                    codes["served"] = codes.get("served", 0) + 1
                except ServerError as e:
                    key = str(e).split("(")[1].split(")")[0] if "(" in str(e) else "error"
                    codes[key] = codes.get(key, 0) + 1

            for i in range(20):  # warm-up (MiniLM loads on the first unknown string)
                ask(i)
            rss = [_rss_mb()]
            for i in range(20, 300):
                ask(i)
                if i in (159, 299):
                    rss.append(_rss_mb())
            size = len(policy.lang.cache)
            files = len(list(cache_dir.glob("*"))) if cache_dir.exists() else 0
            alive = c.infer(_obs(), seed=0).actions.shape == (8, ACTION)
        bound = n0 + paraphrases
        parts.append({"paraphrases": paraphrases, "codes": codes, "cache": (n0, size), "bound": bound,
                      "files": files, "rss": np.diff(rss), "alive": alive})
    bad = [p for p in parts if p["cache"][1] > p["bound"] or p["files"] or not p["alive"]]
    detail = "; ".join(f"--paraphrases {p['paraphrases']}: {p['codes']}, instruction cache {p['cache'][0]} -> "
                       f"{p['cache'][1]} (bound {p['bound']}), disk files {p['files']}, RSS "
                       f"{p['rss'][0]:+.1f} MB over requests 20-159, {p['rss'][1]:+.1f} MB over 160-299" for p in parts)
    if bad:
        return "crash", "grows without bound or stops serving: " + detail
    if parts[0]["codes"].get("unknown_instruction", 0) != 300:
        return "unclear_error", "default server did not refuse unknown instructions clearly: " + detail
    return "ok", detail + "; still serving"


def case_idle_clients(tmp: Path) -> Result:
    """300 clients connect and stay idle against --max-connections 16 --idle-timeout 1."""
    from deploy.client import PolicyClient
    from deploy.errors import PolicyUnavailableError
    from deploy.scripted import JointTargetPolicy
    from deploy.server import PolicyServer
    policy = JointTargetPolicy(STATE, ACTION, np.zeros(7))
    with PolicyServer(policy, port=0, max_connections=16, idle_timeout_s=1.0) as srv:
        time.sleep(0.2)
        base = threading.active_count()
        ok, busy, other = [], 0, []
        for _ in range(300):
            try:
                ok.append(PolicyClient(port=srv.port, timeout=10))
            except PolicyUnavailableError as e:
                busy += 1 if "busy" in str(e) else 0
                if "busy" not in str(e):
                    other.append(str(e))
        peak = threading.active_count() - base
        peak_open = srv.open_connections
        deadline = time.monotonic() + 30
        while srv.open_connections and time.monotonic() < deadline:
            time.sleep(0.05)
        open_after = srv.open_connections
        for cl in ok:
            cl.close()
        deadline = time.monotonic() + 30
        while threading.active_count() > base and time.monotonic() < deadline:
            time.sleep(0.05)
        extra = threading.active_count() - base
        try:
            with PolicyClient(port=srv.port, timeout=10) as c:
                alive = c.infer(_obs(), seed=0).actions.shape[1] == ACTION
        except Exception as e:  # noqa: BLE001
            alive, other = False, other + [f"{type(e).__name__}: {e}"]
        stats = dict(srv.stats)
    freed = f" ({len(ok) - 16} slots freed by the idle timeout meanwhile)" if len(ok) > 16 else ""
    detail = (f"accepted {len(ok)}{freed}, refused busy {busy}, other errors "
              f"{len(other)}; at the end of the burst {peak_open} open, {peak} extra threads; after the idle timeout "
              f"{open_after} open (idle_closed {stats['idle_closed']}), {extra} extra threads; a new client is "
              f"{'served' if alive else 'NOT served'}")
    if not alive or other:
        return "crash", detail + (f"; {other[:2]}" if other else "")
    if open_after or extra > 0 or peak_open > 16:
        return "crash", "connections or threads not released: " + detail
    return "ok", detail


def _deploy_proc(address: str, *extra: str):
    from deploy.procs import popen_tied
    return popen_tied([sys.executable, "-m", "groundflow.cli", "deploy", "--robot", "sim", "--server", address,
                       "--episodes", "1", "--no-status", "--seed", str(SEED), *extra], cwd=ROOT,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env={**os.environ, "OMP_NUM_THREADS": "1"})


def _reasons(rec: Path) -> list[str]:
    log = Path(str(rec) + ".episodes.jsonl")
    return [json.loads(x)["reason"] for x in log.read_text().splitlines()] if log.exists() else []


HOME = [0.3, 0.6, 0.2, -1.6, 0.2, 2.5, 1.0]


def case_deploy_policy_lost_exit_code(tmp: Path) -> Result:
    """`groundflow deploy` (a real process) against a server that answers once, then stalls."""
    from deploy.scripted import JointTargetPolicy
    from deploy.server import PolicyServer
    release = threading.Event()

    class Stalls(JointTargetPolicy):
        def predict_action_chunk(self, obs, **kw):
            if self.calls >= 1:
                release.wait(120)
            return super().predict_action_chunk(obs)

    rec = tmp / "lost.h5"
    with PolicyServer(Stalls(STATE, ACTION, HOME, gripper=1.0), port=0) as srv:
        proc = _deploy_proc(srv.address, "--lockstep", "--max-steps", "90", "--timeout", "0.3", "--record", str(rec))
        try:
            out, err = proc.communicate(timeout=150)
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
    reasons = _reasons(rec)
    line = one_error_line(err, "deploy")
    detail = f"exit {proc.returncode}; {line[:160]}; recorded reasons {reasons}"
    if proc.returncode == 0:
        return "unclear_error", "exit 0 although the policy was lost: " + detail
    if "Traceback" in err:
        return "unclear_error", detail + " (traceback)"
    if reasons != ["policy_lost"]:
        return "unclear_error", detail + " (recorded reason is not policy_lost)"
    return judge_cli(proc.returncode, err, "deploy", "ended abnormally", "policy_lost")[0], detail


def case_deploy_interrupted_reason(tmp: Path) -> Result:
    """Ctrl+C twice on a running `groundflow deploy --record` (a real process)."""
    from deploy.scripted import JointTargetPolicy
    from deploy.server import PolicyServer
    from dataset import Dataset
    rec = tmp / "rec.h5"
    with PolicyServer(JointTargetPolicy(STATE, ACTION, HOME, gripper=1.0), port=0) as srv:
        proc = _deploy_proc(srv.address, "--max-steps", "400", "--record", str(rec))
        try:
            deadline = time.monotonic() + 120
            while srv.stats["requests"] < 2 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.02)  # the loop is running once it asked for its second chunk
            if proc.poll() is not None or srv.stats["requests"] < 2:
                return "unclear_error", f"deploy did not start its loop: {proc.communicate()[1][-300:]}"
            proc.send_signal(signal.SIGINT)  # first: brake and stop
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)  # second, while braking: interrupt
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    reasons = _reasons(rec)
    partial = rec.with_name(rec.name + ".partial")
    try:
        with Dataset(partial if partial.exists() else rec, allow_incomplete=True) as ds:
            kept = f"{len(ds)} episode(s) readable in {'rec.h5.partial' if partial.exists() else 'rec.h5'}"
    except Exception as e:  # noqa: BLE001
        return "data_loss", f"recorded reasons {reasons}; the recording is unreadable: {type(e).__name__}: {e}"
    detail = f"exit {proc.returncode}; recorded reasons {reasons}; {kept}; stderr: {err.strip().splitlines()[-1][:100]}"
    if reasons != ["interrupted"]:
        return "unclear_error", "the recorded reason is not the real one: " + detail
    if proc.returncode == 0:
        return "unclear_error", "exit 0 after an interrupt: " + detail
    return "ok", detail


# ----- counterfactual debugging -----------------------------------------------------------------

def case_debugging_rollout_bound(tmp: Path) -> Result:
    """The search on a synthetic case (T = 50, k = 8 reward faults, small residuals everywhere): its
    rollouts against single-step ablation's T + 2; it must find the faults and stay within the budget
    it announces (``rollout_budget``: T + 2 plus its slack)."""
    from deploy.debugging import DebugConfig, Outcome, debug
    from envs.base import GroundflowEnv
    from dataset import Episode

    class Integrator(GroundflowEnv):
        """x <- x + a / 16 (exact in float32), reward 1 per step; the state is the observation."""
        env_id, backend = "toy/integrator", "toy"
        sim_state_is_observation = True

        def __init__(self):
            super().__init__(2, -np.ones(1), np.ones(1), max_episode_steps=10**6, instruction="drift")
            self.x = np.zeros(2)

        def _reset(self, seed, options):
            self.x = np.zeros(2)
            return self.x.copy(), {}, {"success": False}

        def _step(self, a):
            self.x = self.x + np.array([float(a[0]) / 16, 0.0])
            return self.x.copy(), {}, 1.0, False, False, {"success": False}

        def get_sim_state(self):
            return self.x.copy()

        def set_sim_state(self, x):
            self.x = np.asarray(x, np.float64).reshape(2).copy()

        def observe(self):
            return self._obs(self.x.copy(), {})

    class Constant:
        stateless = True

        def select_action(self, obs):
            return np.ones(1, np.float32)

    T, k = 50, 8
    rows = []
    for s in range(5):
        rng = np.random.default_rng([SEED, s])
        causes = sorted(rng.choice(T, k, replace=False).tolist())
        env, pi = Integrator(), Constant()
        obs, _ = env.reset(seed=s)
        S, A, R, X = [], [], [], []
        for t in range(T):
            X.append(env.get_sim_state())
            S.append(obs["state"])
            A.append(pi.select_action(obs))
            obs, r, *_ = env.step(A[-1])
            R.append(r + rng.normal(0, 1e-3) - (1.0 if t in causes else 0.0))  # small errors everywhere, 8 faults
        ep = Episode(state=np.array(S, np.float32), action=np.array(A, np.float32), reward=np.array(R, np.float32),
                     success=np.zeros(T, bool), instruction="drift", task_id=0, seed=s, sim_state=np.array(X),
                     final_state=obs["state"], final_sim_state=env.get_sim_state())
        free = debug(Integrator(), pi, ep, DebugConfig(outcome=Outcome("return"), rel_tol=0.1))
        capped = debug(Integrator(), pi, ep, DebugConfig(outcome=Outcome("return"), rel_tol=0.1, max_rollouts=T + 2))
        rows.append({"free": free.rollouts, "free_ok": free.steps == causes, "capped": capped.rollouts,
                     "capped_ok": capped.steps == causes, "fell_back": capped.fell_back,
                     # the worst case the attribution itself announces (T + 2 where it announces none)
                     "budget": max(getattr(free, "rollout_budget", 0) or T + 2, T + 2),
                     "capped_budget": max(getattr(capped, "rollout_budget", 0) or T + 2, T + 2)})
    col = lambda k: [r[k] for r in rows]  # noqa: E731
    found = sum(col("free_ok")), sum(col("capped_ok"))
    detail = (f"T = {T}, k = {k}, 5 seeds, vs T + 2 = {T + 2} for single-step ablation: default config "
              f"(`groundflow debug`) {col('free')} rollouts ({sum(r > T + 2 for r in col('free'))}/5 over T + 2, "
              f"announced budget {max(col('budget'))}), causes exact {found[0]}/5; with max_rollouts = T + 2 "
              f"{col('capped')} ({sum(col('fell_back'))} fell back to ablation, announced budget "
              f"{max(col('capped_budget'))}), causes exact {found[1]}/5")
    if min(found) < 5:
        return "unclear_error", "wrong steps blamed: " + detail
    if any(r["free"] > r["budget"] or r["capped"] > r["capped_budget"] for r in rows):
        # no error category fits a cost overrun; it is flagged, not ok: nothing tells the user
        return "unclear_error", "over the budget the attribution announces, without saying so: " + detail
    return "ok", detail


# ----- driver -----------------------------------------------------------------------------------

CASES: dict[str, tuple[Callable[[Path], Result], float]] = {  # name -> (case, timeout in seconds)
    "dataset_concurrent_writer": (case_dataset_concurrent_writer, 120),
    "dataset_stale_partial": (case_dataset_stale_partial, 360),
    "dataset_target_appeared": (case_dataset_target_appeared, 60),
    "dataset_flipped_action_bytes": (case_dataset_flipped_action_bytes, 90),
    "dataset_missing_env_id": (case_dataset_missing_env_id, 90),
    "dataset_missing_episodes": (case_dataset_missing_episodes, 90),
    "dataset_heavily_corrupted": (case_dataset_heavily_corrupted, 90),
    "dataset_nan_state": (case_dataset_nan_state, 90),
    "ckpt_truncated_config": (case_ckpt_truncated_config, 90),
    "ckpt_changed_dim": (case_ckpt_changed_dim, 90),
    "ckpt_truncated_weights": (case_ckpt_truncated_weights, 90),
    "ckpt_crash_between_renames": (case_ckpt_crash_between_renames, 120),
    "train_state_truncated": (case_train_state_truncated, 150),
    "train_state_crafted_pickle": (case_train_state_crafted_pickle, 150),
    "train_diverged_no_ckpt": (case_train_diverged_no_ckpt, 120),
    "server_absurd_state_1e30": (case_server_absurd_state_1e30, 90),
    "server_absurd_state_3e38": (case_server_absurd_state_3e38, 90),
    "bad_prefix_1e30": (case_bad_prefix_1e30, 90),
    "bad_prefix_3e38": (case_bad_prefix_3e38, 90),
    "bad_prefix_far": (case_bad_prefix_far, 90),
    "bad_prefix_nan": (case_bad_prefix_nan, 90),
    "many_instructions": (case_many_instructions, 180),
    "huge_instruction": (case_huge_instruction, 90),
    "idle_clients": (case_idle_clients, 150),
    "deploy_policy_lost_exit_code": (case_deploy_policy_lost_exit_code, 180),
    "deploy_interrupted_reason": (case_deploy_interrupted_reason, 180),
    "debugging_rollout_bound": (case_debugging_rollout_bound, 120),
}


def run_case_here(name: str, tmp: Path) -> None:
    """Child process: run one case and print its result as the last stdout line."""
    try:
        outcome, detail = CASES[name][0](tmp)
    except Exception as e:  # noqa: BLE001  (an exception the case did not expect from the code under test)
        tb = traceback.extract_tb(e.__traceback__)[-1]
        outcome, detail = "unclear_error", (f"uncaught {type(e).__name__}: {str(e)[:200]} "
                                            f"(at {Path(tb.filename).name}:{tb.lineno})")
    assert outcome in OUTCOMES, outcome
    sys.stdout.flush()
    detail = " ".join(detail.replace(str(tmp), "$TMP").split())  # the temp folder is different every run
    print("RESULT " + json.dumps({"outcome": outcome, "detail": detail}), flush=True)


def run_case(name: str, seed: int) -> tuple[str, str, float]:
    """Parent: the case in its own process group, killed whole at its timeout."""
    from deploy.procs import popen_tied
    timeout = CASES[name][1]
    tmp = Path(tempfile.mkdtemp(prefix=f"gf_reliability_{name}_"))
    t0 = time.perf_counter()
    proc = popen_tied([sys.executable, __file__, "--run-case", name, "--tmp", str(tmp), "--seed", str(seed)],
                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                      env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        last = (err.strip().splitlines() or [""])[-1][:160]
        return "hang", f"no result within {timeout:g} s (process group killed); last stderr: {last}", timeout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the case left running (servers, writers)
        shutil.rmtree(tmp, ignore_errors=True)
    dt = time.perf_counter() - t0
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        how = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
        last = (err.strip().splitlines() or [""])[-1][:200]
        return "crash", f"the case process died ({how}) without a result; last stderr: {last}", dt
    r = json.loads(lines[-1][len("RESULT "):])
    return r["outcome"], r["detail"], dt


def main() -> None:
    global SEED
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), metavar="CASE",
                    help="cases to run (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-case", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    a = ap.parse_args()
    SEED = a.seed
    if a.run_case:
        run_case_here(a.run_case, Path(a.tmp))
        return
    results: dict[str, dict[str, str]] = {}
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    load = os.getloadavg()
    for name in a.cases:
        outcome, detail, dt = run_case(name, a.seed)
        results[name], seconds[name] = {"outcome": outcome, "detail": detail}, dt
        print(f"{name:32s} {outcome:14s} {dt:5.1f} s  {detail[:150]}", flush=True)
    info = {**machine(), "load_avg_start": [round(x, 2) for x in load], "wall_s": round(time.perf_counter() - t0, 1),
            "seed": a.seed}
    path = RESULTS / "reliability.json"
    if set(a.cases) != set(CASES) and path.exists():  # a subset: update those cases, keep the others
        old = json.loads(path.read_text())
        results = {**old.get("cases", {}), **results}
        info = {**old.get("machine", {}), "partial_rerun": {"cases": a.cases, **info}}
    counts = {o: sum(r["outcome"] == o for r in results.values()) for o in OUTCOMES}
    rows = [[name, f"**{r['outcome']}**" if SEVERITY[r["outcome"]] > 1 else r["outcome"], r["detail"],
             f"{seconds[name]:.1f}" if name in seconds else "-"] for name, r in results.items()]
    table = (f"# Reliability benchmark\n\n{len(results)} cases, {time.perf_counter() - t0:.0f} s; "
             + ", ".join(f"{k} {v}" for k, v in counts.items() if v)
             + f".\n\nMachine: {info}\n\n" + md_table(["case", "outcome", "what happened", "s"], rows))
    write("reliability", {"cases": results, "machine": info}, table, merge=False)


if __name__ == "__main__":
    main()
