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


def _raw_partial_readable(partial: Path) -> bool:
    """Whether the HDF5 ``.partial`` itself (not a journal beside it) opens and every array in it reads."""
    import h5py
    try:
        with h5py.File(partial, "r", locking=False) as f:
            f.visititems(lambda _, o: o[()] if isinstance(o, h5py.Dataset) else None)
        return True
    except Exception:  # noqa: BLE001
        return False


def _hint_wrong(hint: str, recovered: int | None) -> bool:
    """Whether the re-run's hint misstates what is recoverable: a count that differs from what reads
    back, or (a hint with no count) 'its episodes are readable' when nothing reads back."""
    m = re.search(r"\b(\d+|no) episodes?\b[^;]*?(?:recoverable|readable)", hint)
    if m is None:
        return "readable" in hint and recovered is None
    return (0 if m.group(1) == "no" else int(m.group(1))) != (recovered or 0)


def case_dataset_stale_partial(tmp: Path) -> Result:
    """#46 item 3: `groundflow collect` SIGKILLed mid-write (200 times, at random sizes of its .partial),
    then re-run without --overwrite: the re-run's one-line hint must say truthfully what is recoverable,
    and every episode the killed run had flushed (its progress bar counted it) must read back with
    Dataset(.partial, allow_incomplete=True). Counts the kills whose HDF5 .partial itself is unreadable too."""
    from deploy.procs import popen_tied
    from dataset import Dataset
    rng = np.random.default_rng(SEED)
    kills = 200
    results, kept, lost, wrong_hints = [], [], [], []
    raw_bad = flushed_total = lost_total = 0
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
        flushed_total += flushed
        if rc != -signal.SIGKILL:
            return "unclear_error", f"kill {i}: the writer was not killed mid-write (exit {rc})"
        code, _, err = cli(["collect", "--env", "adroit/door", "--episodes", "2", "--out", str(path), "--no-progress"])
        results.append(judge_cli(code, err, "collect", f"{path.name}.partial exists", "--overwrite"))
        if path.exists():
            return "data_loss", f"kill {i}: a file was published at {path.name} after the kill"
        size = partial.stat().st_size / 1e6
        raw_bad += not _raw_partial_readable(partial)
        recovered: int | None = None
        try:  # what the killed run flushed must stay readable (checksums verified on read)
            with Dataset(partial, allow_incomplete=True) as ds:
                n = len(ds)
                for j in range(n):
                    ds.episode(j)
            kept.append(recovered := n)
        except Exception as e:  # noqa: BLE001
            why = (str(e).split("(")[-1] if "(" in str(e) else str(e)[-60:]).rstrip(")'\"")[:60]
            lost.append((flushed, f"kill {i} at {size:.2f} MB after >= {flushed} flushed episode(s): {why}"))
        lost_total += max(0, flushed - (recovered or 0))
        if recovered is not None and recovered < flushed:
            lost.append((flushed - recovered, f"kill {i}: {recovered} of {flushed} flushed episodes read back"))
        hint = one_error_line(err, "collect")
        if _hint_wrong(hint, recovered):
            wrong_hints.append(f"kill {i} ({recovered} recoverable): {hint[-160:]}")
        for f in (partial, path.with_name(path.name + ".lock")):
            f.unlink(missing_ok=True)
        shutil.rmtree(path.with_name(path.name + ".episodes"), ignore_errors=True)
    outcome = max((r[0] for r in results), key=SEVERITY.get)
    odd = [f"kill {i}: {r[1]}" for i, r in enumerate(results) if r[0] != results[0][0]]
    rerun = ("refused in one line naming the .partial and --overwrite" if results[0][0] == "clear_error"
             else results[0][1])
    unreadable = kills - len(kept)
    counts = (f"{kills} SIGKILLs mid-write: Dataset(.partial, allow_incomplete=True) unreadable after {unreadable}; "
              f"flushed episodes lost {lost_total}/{flushed_total} (in {sum(1 for n, _ in lost if n > 0)} kills); "
              f"the HDF5 .partial itself unreadable after {raw_bad}; re-run hint wrong {len(wrong_hints)}/{kills}")
    detail = (f"{counts}; nothing published; every re-run without --overwrite {rerun}"
              + (f" ({'; '.join(odd[:3])})" if odd else "") + f"; episodes read back {min(kept, default=0)}-"
              f"{max(kept, default=0)} per kill")
    lost.sort(key=lambda x: -x[0])
    if lost_total:
        return "data_loss", f"flushed episodes lost ({'; '.join(d for _, d in lost[:2])}); " + detail
    if wrong_hints or unreadable:  # nothing flushed was lost, but the hint or the reader misstates it
        return "unclear_error", (f"hint misstates what is recoverable ({'; '.join(wrong_hints[:2])}); " if wrong_hints
                                 else "unreadable .partial without a flushed episode; ") + detail
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


def case_collect_out_is_dir(tmp: Path) -> Result:
    """#46: `groundflow collect --out DIR --overwrite` collected every episode, then its final rename
    failed with an IsADirectoryError traceback; --out below a regular file too."""
    (tmp / "somedir").mkdir()
    (tmp / "afile").write_text("x")
    results = []
    for out, needle in ((tmp / "somedir", "is a directory"), (tmp / "afile" / "d.h5", f"{tmp / 'afile'} is a file"),
                        (tmp / "afile" / "sub" / "d.h5", f"{tmp / 'afile'} is a file")):
        code, _, err = cli(["collect", "--env", "maniskill/PushCube-v1", "--episodes", "2", "--out", str(out),
                            "--overwrite", "--no-progress"])
        results.append(judge_cli(code, err, "collect", str(out), needle))
    left = sorted(q.name for q in tmp.iterdir())
    if left != ["afile", "somedir"] or any((tmp / "somedir").iterdir()):
        inside = sorted(q.name for q in (tmp / "somedir").iterdir())
        results.append(("unclear_error", f"left behind: {left}, somedir holds {inside}"))
    return worst(*results)


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


_FLOAT32 = bytes.fromhex("11201f00040000000000200017080017")  # HDF5 datatype message: IEEE float32 LE
_NEEDLES = [b"instruction", b"task_id", b"seed", b"length", b"success", b"state", b"action", b"reward", b"sim_state",
            b"final_state", b"crc32", b"episodes", b"images", b"cam", b"000000", b"000001", b"000002", b"env_id",
            b"state_dim", b"action_dim", b"cameras", b"meta", b"complete", b"n_episodes", b"format", b"version",
            b"layout_sha256", b"push the cube", b"test/env", b"groundflow-dataset", b'{"k": 1}', _FLOAT32,
            bytes.fromhex("11203f00080000000000400034"), bytes.fromhex("1008000008000000"),  # float64, int64
            bytes.fromhex("1000000001000000")]  # uint8


def _metadata_offsets(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(every byte offset outside the array data, those inside attribute/link names and values and
    datatype messages)."""
    import h5py
    data = path.read_bytes()
    meta = np.ones(len(data), bool)

    def visit(_, o):
        if isinstance(o, h5py.Dataset):
            spans = ([(o.id.get_offset(), o.id.get_storage_size())] if o.chunks is None else
                     [(c.byte_offset, c.size) for c in map(o.id.get_chunk_info, range(o.id.get_num_chunks()))])
            for a, n in spans:
                if a is not None:
                    meta[a:a + n] = False
    with h5py.File(path, "r") as f:
        f.visititems(visit)
    aimed = np.zeros(len(data), bool)
    for needle in _NEEDLES:
        at = data.find(needle)
        while at >= 0:
            aimed[at:at + len(needle)] = True
            at = data.find(needle, at + 1)
    return np.flatnonzero(meta), np.flatnonzero(aimed & meta)


def _load_everything(path: Path) -> tuple:
    from dataset import Dataset
    with Dataset(path) as ds:
        head = (ds.env_id, ds.state_dim, ds.action_dim, ds.cameras, ds.meta, ds.instructions)
        eps = [ds.episode(i) for i in range(len(ds))]
    rows = [(e.instruction, e.task_id, e.seed, *((f, None if getattr(e, f) is None else
                                                   (getattr(e, f).dtype.str, getattr(e, f).tobytes()))
                                                  for f in ("state", "action", "reward", "success", "sim_state",
                                                            "final_state", "final_sim_state")),
             {c: (v.dtype.str, v.tobytes()) for c, v in (e.images or {}).items()}) for e in eps]
    return head, rows


def case_dataset_metadata_flips(tmp: Path) -> Result:
    """#46 item 4: 1,500 single-bit flips in the metadata of a small dataset (3 episodes, one camera):
    60% aimed at attribute and link names and values and datatype messages, 40% anywhere outside the
    array data (which the crc32s cover). Each load must be identical or one DatasetError naming the
    file; then episode 0's state flipped from float32 to uint32 (one bit, its crc32 unchanged) must stop
    `groundflow train`."""
    from dataset import DatasetError, DatasetWriter
    rng = np.random.default_rng(SEED)
    clean = tmp / "clean.h5"
    with DatasetWriter(clean, "test/env", 5, 3, cameras=("cam",), meta={"k": 1}) as w:
        for i in range(3):
            ep = _episode(seed=i)
            ep.images = {"cam": rng.integers(0, 255, (len(ep), 8, 8, 3), dtype=np.uint8)}
            w.add(ep)
    want = _load_everything(clean)
    data = clean.read_bytes()
    meta, aimed = _metadata_offsets(clean)
    path = tmp / "d.h5"
    flips = 1500
    tally: dict[str, int] = {"identical": 0, "clear_error": 0, "silent": 0, "raw": 0, "unclear": 0}
    examples: dict[str, list[str]] = {k: [] for k in tally}
    raw_types: dict[str, int] = {}
    for _ in range(flips):
        offset, bit = int(rng.choice(aimed) if rng.random() < 0.6 else rng.choice(meta)), int(rng.integers(8))
        bad = bytearray(data)
        bad[offset] ^= 1 << bit
        path.write_bytes(bytes(bad))
        try:
            kind = "identical" if _load_everything(path) == want else "silent"
            what = "loaded with changed data or metadata"
        except DatasetError as e:
            kind = "clear_error" if str(path) in str(e) and "\n" not in str(e) else "unclear"
            what = str(e).replace(str(path), "d.h5")[:140]
        except Exception as e:  # noqa: BLE001
            kind, what = "raw", f"{type(e).__name__}: {str(e)[:100]}"
            raw_types[type(e).__name__] = raw_types.get(type(e).__name__, 0) + 1
        tally[kind] += 1
        examples[kind].append(f"byte {offset} bit {bit}: {what}")
    # the issue's example: one bit turns episode 0's state into uint32 (~3e9); train must not exit 0
    import h5py
    flipped = tmp / "uint32.h5"
    at = data.find(_FLOAT32)
    while at >= 0:
        bad = bytearray(data)
        bad[at] ^= 1
        flipped.write_bytes(bytes(bad))
        with h5py.File(flipped, "r") as f:
            if f["episodes/000000/state"].dtype == np.uint32:
                break
        at = data.find(_FLOAT32, at + 1)
    code, _, err = cli(["train", "--data", str(flipped), "--steps", "2", "--out", str(tmp / "r"), "--horizon", "4",
                        "--n-exec", "2", "--batch-size", "8", "--wandb", "disabled", "--no-progress"])
    train = judge_cli(code, err, "train", str(flipped), "episode 000000") if at >= 0 else \
        ("unclear_error", "no float32 datatype message of episode 0's state found")
    if code == 0:
        train = ("data_loss", "`groundflow train` trained on episode 0's state read as uint32 and exited 0")
    detail = (f"{flips} flips: {tally['identical']} loaded identical, {tally['clear_error']} one DatasetError naming "
              f"the file, {tally['silent']} silent changes, {tally['raw']} raw exceptions"
              + (f" ({', '.join(f'{k} {v}' for k, v in sorted(raw_types.items()))})" if raw_types else "")
              + (f", {tally['unclear']} unclear DatasetErrors" if tally["unclear"] else "")
              + f"; state float32->uint32 in episode 0: {train[1]}")
    if tally["silent"] or train[0] == "data_loss":
        return "data_loss", detail + f"; e.g. {'; '.join(examples['silent'][:2])}"
    if tally["raw"] or tally["unclear"]:
        return "unclear_error", detail + f"; e.g. {'; '.join((examples['raw'] + examples['unclear'])[:2])}"
    return max(("clear_error", train[0]), key=SEVERITY.get), detail + f"; e.g. {examples['clear_error'][0]}"


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
    # config.json's digest refuses the edit before the weights are read ("does not fit" before it)
    return _damaged_ckpt(tmp, change, "config.json", "fails its digest")


def case_ckpt_config_flip(tmp: Path) -> Result:
    """#46: a bit flip turned a checkpoint's instruction into 'open"the door' and it loaded. Single-bit
    flips over config.json (every byte of the instruction, and evenly spaced bytes elsewhere): each
    must load identical (the flip left the content unchanged), or be refused in one CheckpointError
    naming config.json; then the instruction flip through `groundflow eval`."""
    import shutil

    import torch

    import policies
    pristine, ckpt = tmp / "pristine", tmp / "ckpt"
    p = _tiny_policy(SEED)
    p.lang.cache["open the door"] = torch.randn(1, 384, generator=torch.Generator().manual_seed(SEED))
    p.save(pristine, extra={"env_id": "maniskill/PushCube-v1"})
    raw = (pristine / "config.json").read_bytes()
    original = json.loads(raw)
    at = raw.index(b'"open the door"') + 1
    flips = [(i, m) for i in range(at, at + len("open the door")) for m in (0x01, 0x02, 0x20)]
    flips += [(int(i), m) for i in np.linspace(0, len(raw) - 1, 200).astype(int) for m in (0x01, 0x10)]
    tally = {"identical": 0, "clear_error": 0, "silent": 0, "unclear": 0}
    examples: dict[str, list[str]] = {k: [] for k in tally}
    for i, m in flips:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(pristine, ckpt)
        bad = bytearray(raw)
        bad[i] ^= m
        (ckpt / "config.json").write_bytes(bytes(bad))
        try:
            q = policies.load(ckpt)
            same = json.loads(bytes(bad)) == original and _same_weights(q, p) and set(q.lang.cache) == set(p.lang.cache)
            around = bytes(bad[max(0, i - 12):i + 12])
            kind, what = ("identical", "") if same else ("silent", f"byte {i} ^ {m:#x}: {around!r} loaded")
        except Exception as e:  # noqa: BLE001
            r = judge_exception(e, "config.json")
            kind, what = ("clear_error" if r[0] == "clear_error" else "unclear"), r[1]
        tally[kind] += 1
        examples[kind].append(what)
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.copytree(pristine, ckpt)
    (ckpt / "config.json").write_bytes(raw.replace(b'"open the door"', b'"open\\"the door"'))
    try:
        policies.load(ckpt)
        api: Result = ("data_loss", "the instruction 'open\"the door' loaded")
    except Exception as e:  # noqa: BLE001
        api = judge_exception(e, str(ckpt / "config.json"), "digest")
    code, _, err = cli(["eval", "--ckpt", str(ckpt), "--episodes", "1"])
    flip = api_and_cli(api, judge_cli(code, err, "eval", str(ckpt / "config.json"), "digest"), "eval")
    detail = (f"{len(flips)} one-bit flips of config.json: {tally['identical']} loaded identical, "
              f"{tally['clear_error']} one CheckpointError naming config.json, {tally['silent']} silent changes, "
              f"{tally['unclear']} unclear; "
              f"'open\"the door': {flip[1]}")
    if tally["silent"]:
        return "data_loss", detail + f"; e.g. {'; '.join(examples['silent'][:2])}"
    if tally["unclear"]:
        return max(("unclear_error", flip[0]), key=SEVERITY.get), detail + f"; e.g. {examples['unclear'][0]}"
    return max(("clear_error", flip[0]), key=SEVERITY.get), detail


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


def _ctrl_c_as_in_a_terminal() -> None:
    """Child, between fork and exec: SIGINT raises KeyboardInterrupt, as after Ctrl+C in a terminal (a
    process started in the background of a shell inherits SIGINT ignored); dies with its parent."""
    from deploy.procs import _die_with_parent
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def case_train_interrupted_resume(tmp: Path) -> Result:
    """#46 item 2: Ctrl+C (SIGINT) three times on a real `groundflow train` (400 steps, a save every 25),
    each run continued with `--resume`: twice at a random step between two saves (the steps since the
    last save are lost and redone), once just as it reaches a save step; then resumed to the end. The
    loss history and the final weights (model, EMA, optimizer, OUT/ckpt) must equal an uninterrupted
    run's bit for bit (else data_loss)."""
    import torch

    import policies
    from deploy.procs import popen_tied
    data = _write(tmp / "tiny.h5", n=4)
    steps, every = 400, 25
    base = ["-m", "groundflow.cli", "train", "--data", str(data), "--horizon", "4", "--n-exec", "2", "--batch-size",
            "8", "--steps", str(steps), "--save-every", str(every), "--wandb", "disabled", "--seed", str(SEED)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "0", "TQDM_MINITERS": "1"}
    full = run_py([*base, "--no-progress", "--out", str(tmp / "full")], timeout=240)
    if full.returncode != 0:
        return "unclear_error", f"the uninterrupted run failed: {one_error_line(full.stderr, 'train')[:200]}"
    rng = np.random.default_rng(SEED)
    out = tmp / "cut"
    state = out / "train_state.pt"
    cuts, redrawn, strays, kept = [], 0, [], 0
    for i, between in enumerate((True, False, True)):
        target = (kept // every + int(rng.integers(1, 3))) * every + (int(rng.integers(5, every - 5)) if between else 0)
        proc = popen_tied([sys.executable, *base, "--out", str(out), *(["--resume"] if i else [])], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                          preexec_fn=_ctrl_c_as_in_a_terminal)
        err: list[str] = []  # its progress bar (redrawn at every step) says how far it got
        reader = threading.Thread(target=lambda p=proc: err.extend(iter(lambda: p.stderr.read(64), "")))
        reader.start()
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            at = re.findall(rf"\| *(\d+)/{steps}", "".join(err[-8:]))
            if at and int(at[-1]) >= target:
                break
            time.sleep(0.001)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
        reader.join(10)
        text = "".join(err)
        reached = max((int(m) for m in re.findall(rf"\| *(\d+)/{steps}", text)), default=-1)
        kept = torch.load(state, weights_only=True)["step"]
        lines = text.replace("\r", "\n").strip().splitlines() or [""]
        said = [ln for ln in lines if "groundflow train:" in ln]
        if rc == 0:
            return "unclear_error", f"Ctrl+C {i + 1} came after the run finished (step {reached}): not interrupted"
        if rc != 130 or not said or not said[-1].endswith("groundflow train: interrupted") or "Traceback" in text:
            return "unclear_error", (f"Ctrl+C {i + 1} at step {reached}: exit {rc}, {(said or lines)[-1][-160:]!r}"
                                     f"{' (traceback)' if 'Traceback' in text else ''}")
        redrawn += not lines[-1].endswith("groundflow train: interrupted")
        strays += [f"{q.name} after Ctrl+C {i + 1}" for q in out.iterdir() if q.name.endswith((".tmp", ".old"))]
        cuts.append(f"at step {reached} (state kept: step {kept})")
    resumed = run_py([*base, "--no-progress", "--out", str(out), "--resume"], timeout=240)
    if resumed.returncode != 0:
        return "unclear_error", f"the last --resume failed: {one_error_line(resumed.stderr, 'train')[:200]}"
    a = torch.load(tmp / "full" / "train_state.pt", weights_only=True)
    b = torch.load(state, weights_only=True)
    la, lb = [h["loss"] for h in a["history"]], [h["loss"] for h in b["history"]]
    differ = []
    if [h["step"] for h in b["history"]] != list(range(1, steps + 1)):
        differ.append(f"the resumed history's steps are not 1..{steps} ({len(b['history'])} entries)")
    if la != lb:
        first = next((k for k, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
        differ.append(f"loss differs from step {first + 1}")
    elif not _same_tree(a["history"], b["history"]):
        differ.append("the history's other metrics (grad norm, lr) differ")
    for part in ("model", "ema", "opt"):
        if not _same_tree(a.get(part), b.get(part)):
            differ.append(f"train_state.pt {part} differs")
    if not _same_weights(policies.load(tmp / "full" / "ckpt"), policies.load(out / "ckpt")):
        differ.append("OUT/ckpt weights differ")
    detail = (f"Ctrl+C {', '.join(cuts)}: each exit 130 with 'groundflow train: interrupted'"
              + (f" (the progress bar redrawn below it {redrawn}/{len(cuts)} times)" if redrawn else "")
              + (f", left behind {strays}" if strays else "") + f"; resumed with --resume to step {b['step']}")
    if differ:
        return "data_loss", f"{detail}; against an uninterrupted run: {'; '.join(differ)}"
    return "ok", (f"{detail}; loss history ({steps} steps), model, EMA and optimizer state and OUT/ckpt identical "
                  "to an uninterrupted run's")


def _same_tree(a: Any, b: Any) -> bool:
    """Whether two training states (tensors in plain containers) hold exactly the same values."""
    import torch
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _flip_bits(raw: bytes, path: Path, offsets: list[tuple[int, int]], load: Callable[[], bool]) -> tuple:
    """Each (offset, bit) flipped alone in ``raw`` written to ``path``, then ``load()`` (True: loaded what
    was saved): ({kind: count}, {kind: examples}) with kind identical, clear_error (one groundflow error
    naming ``path``), silent (loaded something else) or unclear."""
    tally = {"identical": 0, "clear_error": 0, "silent": 0, "unclear": 0}
    examples: dict[str, list[str]] = {k: [] for k in tally}
    for offset, bit in offsets:
        bad = bytearray(raw)
        bad[offset] ^= 1 << bit
        path.write_bytes(bytes(bad))
        try:
            kind, what = ("identical", "") if load() else ("silent", f"byte {offset} bit {bit}: loaded changed")
        except Exception as e:  # noqa: BLE001
            r = judge_exception(e, str(path))
            kind, what = ("clear_error" if r[0] == "clear_error" else "unclear"), f"byte {offset} bit {bit}: {r[1]}"
        tally[kind] += 1
        examples[kind].append(what)
    path.write_bytes(raw)
    return tally, examples


def case_ckpt_weight_flips(tmp: Path) -> Result:
    """#46 item 5: single-bit flips in a checkpoint's model.safetensors (40 at random offsets, 20 more
    in its header: tensor names, dtypes, shapes, offsets) and in a run's train_state.pt (40 at random
    offsets). Each must load exactly what was saved or be refused in one CheckpointError naming the
    file; a flip that loads changed weights is data_loss. Then one flip inside the weights of each,
    through `groundflow eval` and `groundflow train --resume`."""
    import torch

    import policies
    from train.bc import _load_train_state
    rng = np.random.default_rng(SEED)
    ckpt = tmp / "ckpt"
    p = _tiny_policy(SEED)
    p.save(ckpt, extra={"env_id": "maniskill/PushCube-v1"})
    weights = ckpt / "model.safetensors"
    raw = weights.read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    offsets = [(int(o), int(b)) for o, b in zip(rng.integers(0, len(raw), 40), rng.integers(0, 8, 40))]
    offsets += [(int(o), int(b)) for o, b in zip(rng.integers(0, header, 20), rng.integers(0, 8, 20))]
    w_tally, w_ex = _flip_bits(raw, weights, offsets, lambda: _same_weights(policies.load(ckpt), p))
    _, run, argv = _tiny_run(tmp)
    state = run / "train_state.pt"
    saved = torch.load(state, weights_only=True)
    saved.pop("sha256", None)
    st_raw = state.read_bytes()
    st_offsets = [(int(o), int(b)) for o, b in zip(rng.integers(0, len(st_raw), 40), rng.integers(0, 8, 40))]
    s_tally, s_ex = _flip_bits(st_raw, state, st_offsets,
                               lambda: _same_tree(_load_train_state(state, torch.device("cpu")), saved))
    # through the commands a user runs: a flip in the middle of the largest tensor's bytes
    bad = bytearray(raw)
    bad[(header + len(raw)) // 2] ^= 0x10
    weights.write_bytes(bytes(bad))
    code, _, err = cli(["eval", "--ckpt", str(ckpt), "--episodes", "1"])
    eval_res = judge_cli(code, err, "eval", str(weights), "checksum")
    biggest = max(saved["model"].values(), key=lambda t: t.numel()).contiguous().numpy().tobytes()
    bad = bytearray(st_raw)
    bad[st_raw.index(biggest) + len(biggest) // 2] ^= 0x10
    state.write_bytes(bytes(bad))
    code, _, err = cli(argv)
    resume_res = judge_cli(code, err, "train", str(state), "checksum")

    def said(n: int, what: str, t: dict[str, int]) -> str:
        return (f"{n} flips in {what}: {t['identical']} loaded identical, {t['clear_error']} one CheckpointError "
                f"naming the file, {t['silent']} loaded changed weights, {t['unclear']} unclear")
    detail = (f"{said(len(offsets), 'model.safetensors (20 in its header)', w_tally)}; "
              f"{said(len(st_offsets), 'train_state.pt', s_tally)}; `groundflow eval` on a flipped weight: "
              f"{eval_res[1]}; `groundflow train --resume` on a flipped weight: {resume_res[1]}")
    silent = w_ex["silent"] + s_ex["silent"]
    if silent:
        return "data_loss", detail + f"; e.g. {'; '.join(silent[:2])}"
    if w_tally["unclear"] or s_tally["unclear"]:
        return "unclear_error", detail + f"; e.g. {'; '.join((w_ex['unclear'] + s_ex['unclear'])[:2])}"
    return worst(("clear_error", ""), eval_res, resume_res)[0], detail


# ----- one writer per output, a full disk (#46 items 6 and 7) -------------------------------------

GATED_COLLECT = """
import sys, time
from pathlib import Path
from train.collect import CollectArgs, collect
out, ready, go, seed = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
def on_episode(n):
    if n == 1:
        ready.touch()
        while not go.exists():
            time.sleep(0.02)
collect(CollectArgs(env="adroit/door", episodes=3, out=out, seed=seed, progress=False), on_episode=on_episode)
"""


def _lock_deleted_once(tmp: Path, env: dict[str, str]) -> Result:
    """A real collect has flushed one of its 3 episodes; its d.h5.lock is deleted; a real `groundflow
    collect --overwrite` runs on the same path; then the first finishes."""
    from dataset import Dataset
    from deploy.procs import popen_tied
    tmp.mkdir(parents=True)
    path, ready, go = tmp / "d.h5", tmp / "ready", tmp / "go"
    first = popen_tied([sys.executable, "-c", GATED_COLLECT, str(path), str(ready), str(go), str(SEED)], cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            if first.poll() is not None or time.monotonic() > deadline:
                first.kill()
                return "unclear_error", ("the first collect did not reach its first episode: "
                                         f"{first.communicate()[1][-200:]}")
            time.sleep(0.02)
        path.with_name("d.h5.lock").unlink()
        r = subprocess.run([sys.executable, "-m", "groundflow.cli", "collect", "--env", "adroit/door", "--episodes",
                            "2", "--out", str(path), "--overwrite", "--no-progress", "--seed", str(SEED)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, env=env)
        go.touch()
        _, err1 = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    if first.returncode != 0:
        first_res: Result = ("crash" if first.returncode < 0 else "unclear_error",
                             f"the first collect failed (exit {first.returncode}): "
                             f"{one_error_line(err1, 'collect')[:200]}")
        if path.exists():
            first_res = ("data_loss", first_res[1] + f", yet {path.name} was published")
    else:
        try:
            with Dataset(path) as ds:
                n = len(ds)
                for i in range(n):
                    ds.episode(i)  # every array against its crc32
            first_res = ("ok", f"the first published its {n}/3 episodes intact") if n == 3 else \
                ("data_loss", f"the first published {n} episodes, not 3")
        except Exception as e:  # noqa: BLE001
            first_res = ("data_loss", f"the first published a file that does not read back: {str(e)[:160]}")
    if r.returncode == 0:
        return worst(first_res, ("data_loss", "the second collect (--overwrite) ran on the path the first was writing"))
    second = judge_cli(r.returncode, r.stderr, "collect", str(path), "being written by another process",
                       f"pid {first.pid}")
    return worst(first_res, (second[0], f"second refused: {second[1]}"))


def case_dataset_lock_deleted(tmp: Path) -> Result:
    """#46 item 6: a stale-looking d.h5.lock deleted while a collect runs, then a second collect with
    --overwrite; with HDF5's own file locking and with HDF5_USE_FILE_LOCKING=FALSE, 3 times each."""
    results = []
    for locking in ("default", "FALSE"):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if locking == "FALSE":
            env["HDF5_USE_FILE_LOCKING"] = "FALSE"
        for i in range(3):
            out, detail = _lock_deleted_once(tmp / f"{locking}{i}", env)
            results.append((out, f"HDF5 locking {locking} #{i}: {detail}"))
    outcome = max((r[0] for r in results), key=SEVERITY.get)
    if all(r[0] == results[0][0] for r in results):
        return outcome, f"6/6 runs alike; {results[0][1]}"
    return outcome, "; ".join(r[1] for r in results if r[0] == outcome)


def case_train_same_out(tmp: Path) -> Result:
    """#46 item 6: two real `groundflow train` runs on one --out: one already training when the second
    starts, then 3 pairs started together. One may run; the other must be refused in one line naming
    --out and the process that holds it (or, started after the first finished, that --out holds a run)."""
    from deploy.procs import popen_tied
    data = _write(tmp / "tiny.h5", n=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = ["-m", "groundflow.cli", "train", "--data", str(data), "--horizon", "4", "--n-exec", "2",
            "--batch-size", "8", "--wandb", "disabled", "--no-progress", "--seed", str(SEED)]
    out = tmp / "busy"
    first = popen_tied([sys.executable, *base, "--out", str(out), "--steps", "1000000", "--save-every", "1000000"],
                       cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while not out.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        if first.poll() is not None:
            return "unclear_error", f"the first train ended early: {first.communicate()[1][-200:]}"
        r = run_py([*base, "--out", str(out), "--steps", "2", "--save-every", "1"], timeout=120)
        alive = first.poll() is None
    finally:
        first.kill()
        first.wait()
    if r.returncode == 0:
        return "data_loss", "a second train ran on the --out of a live one"
    held = judge_cli(r.returncode, r.stderr, "train", str(out), f"pid {first.pid}", "in use")
    if not alive:
        held = worst(held, ("crash", "the first train died while the second ran"))
    pairs = []
    for i in range(3):
        o = tmp / f"pair{i}"
        procs = [popen_tied([sys.executable, *base, "--out", str(o), "--steps", "20", "--save-every", "5"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
        errs = [p.communicate(timeout=180)[1] for p in procs]
        codes = sorted(p.returncode for p in procs)
        if codes != [0, 1]:
            pairs.append(("data_loss" if codes == [0, 0] else "crash", f"pair {i}: exit codes {codes}"))
            continue
        loser = errs[[p.returncode for p in procs].index(1)]
        refused = judge_cli(1, loser, "train", str(o))
        if "in use by" not in loser and "already holds a run" not in loser:
            refused = ("unclear_error", f"pair {i}: {refused[1]}")
        try:
            import torch

            import policies
            policies.load(o / "ckpt")
            step = torch.load(o / "train_state.pt", weights_only=True)["step"]
            pairs.append(refused if step == 20 else ("data_loss", f"pair {i}: train_state at step {step}, not 20"))
        except Exception as e:  # noqa: BLE001
            pairs.append(("data_loss", f"pair {i}: the run's files do not load: {str(e)[:120]}"))
    together = worst(*pairs)
    detail = (f"second run on a live --out: {held[1]}; 3 pairs started together: one ran, the other refused "
              f"({'in one line' if together[0] == 'clear_error' else together[1]})")
    return worst(held, together)[0], detail


def _small_disk(tmp: Path, size: str) -> tuple[Path, Callable[[], None], Callable[[], None] | None]:
    """(folder, cleanup, preexec): a real tmpfs of ``size`` where this process may mount one (root),
    else a plain folder and a preexec that sets a file size limit (writes then fail with EFBIG)."""
    mnt = tmp / f"disk{size}"
    mnt.mkdir()
    if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                                            capture_output=True).returncode == 0:
        return mnt, lambda: subprocess.run(["umount", "-l", str(mnt)], capture_output=True), None
    limit = int(float(size.rstrip("m")) * 1e6)

    def pre():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return mnt, lambda: None, pre


def _strays(d: Path) -> list[str]:
    return sorted(p.name for p in d.rglob("*") if p.name.endswith((".tmp", ".lock", ".old")))


def case_disk_full(tmp: Path) -> Result:
    """#46 item 7: `groundflow collect` (200 episodes, ~34 MB) onto a 3 MB tmpfs holding a dataset
    published before, and `groundflow train` whose second checkpoint save does not fit a 4 MB one
    (a file size limit instead where no tmpfs can be mounted)."""
    from dataset import Dataset
    results = []
    disk, cleanup, pre = _small_disk(tmp, "3m")
    how = "a 3 MB tmpfs" if pre is None else "a 3 MB file size limit (no tmpfs here)"
    try:
        kept = _write(disk / "kept.h5", n=3)
        before = kept.read_bytes()
        path = disk / "d.h5"
        r = subprocess.run([sys.executable, "-m", "groundflow.cli", "collect", "--env", "adroit/door", "--episodes",
                            "200", "--out", str(path), "--no-progress", "--seed", str(SEED)], cwd=ROOT,
                           capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           preexec_fn=pre)
        res = judge_cli(r.returncode, r.stderr, "collect", str(disk), "free")
        if r.returncode < 0:
            res = ("crash", f"collect killed by {signal.Signals(-r.returncode).name}")
        if kept.read_bytes() != before or path.exists():
            res = ("data_loss", res[1] + "; a file published before changed, or an incomplete one was published")
        partial = path.with_name("d.h5.partial")
        if partial.exists():
            try:
                with Dataset(partial, allow_incomplete=True) as ds:
                    n = len(ds)
                    for i in range(n):
                        ds.episode(i)
                res = (res[0], res[1] + f"; its {n} flushed episodes readable in d.h5.partial")
            except Exception as e:  # noqa: BLE001
                res = worst(res, ("data_loss", f"the kept d.h5.partial does not read back: {str(e)[:120]}"))
        if _strays(disk):
            res = worst(res, ("unclear_error", f"left behind: {_strays(disk)}"))
        results.append((res[0], f"collect onto {how}: {res[1]}"))
    finally:
        cleanup()
    mounted = pre is None  # else a 1 MB limit: the checkpoint (0.6 MB) fits, the training state (2.3 MB) does not
    disk, cleanup, pre = _small_disk(tmp, "4m" if mounted else "1m")
    how = "a 4 MB tmpfs" if pre is None else "a 1 MB file size limit (no tmpfs here)"
    try:
        import torch

        import policies
        data = _write(tmp / "t.h5", n=4)
        out = disk / "run"
        r = subprocess.run([sys.executable, "-m", "groundflow.cli", "train", "--data", str(data), "--out", str(out),
                            "--horizon", "4", "--n-exec", "2", "--batch-size", "8", "--steps", "4", "--save-every",
                            "2", "--wandb", "disabled", "--no-progress", "--seed", str(SEED)], cwd=ROOT,
                           capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           preexec_fn=pre)
        res = judge_cli(r.returncode, r.stderr, "train", str(out), "free")
        if r.returncode < 0:
            res = ("crash", f"train killed by {signal.Signals(-r.returncode).name}")
        try:
            if (out / "ckpt").exists():
                policies.load(out / "ckpt")
            if (out / "train_state.pt").exists():
                torch.load(out / "train_state.pt", weights_only=True)
        except Exception as e:  # noqa: BLE001
            res = worst(res, ("data_loss", f"a published checkpoint does not load: {str(e)[:120]}"))
        if _strays(disk):
            res = worst(res, ("unclear_error", f"left behind: {_strays(disk)}"))
        results.append((res[0], f"train onto {how}: {res[1]}"))
    finally:
        cleanup()
    return worst(*results)


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
    from deploy.serving.client import PolicyClient
    from deploy.serving.server import PolicyServer
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


def case_client_garbage_chunks(tmp: Path) -> Result:
    """#46 item 11: a bare PolicyClient (no expect, no action_bounds) against a server that announces no
    action bounds (a scripted policy) and replies with garbage instead of its chunk: 16 rows of 1e30, a
    100,000-row chunk, then a 100,000-row chunk from a server announcing no horizon either. Each must be
    refused with one clear error and never come back as a plan; the next good chunk still comes back."""
    from deploy.serving.client import PolicyClient
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.faults import LyingServer

    f32 = np.float32
    results: list[Result] = []
    announced = []
    for horizon in ("announced", None):
        server = LyingServer(JointTargetPolicy(STATE, ACTION, np.zeros(7)), port=0)
        if horizon is None:
            server.metadata["horizon"] = None
        garbage = [("16 rows of 1e30", np.full((16, ACTION), 1e30, f32), ("1e+30",)),
                   ("100,000 rows", np.zeros((100_000, ACTION), f32), ("100000 rows",))]
        with server as srv, PolicyClient(port=srv.port, timeout=30) as c:
            announced.append(f"bounds {c.metadata.get('action_low')}, horizon {c.metadata.get('horizon')}")
            if c.metadata.get("action_low") is not None or c.action_bounds is not None:
                return "unclear_error", f"not a bare client against a server without bounds: {announced[-1]}"
            for what, chunk, needles in garbage if horizon else garbage[1:]:
                what += "" if horizon else " (no horizon announced)"
                srv.garbage = chunk
                try:
                    a = c.infer(_obs()).actions
                    results.append(("data_loss", f"{what}: returned as a plan (shape {a.shape}, max |a| "
                                                 f"{np.abs(a).max():.3g})"))
                except Exception as e:  # noqa: BLE001
                    r = judge_exception(e, *needles)
                    results.append((r[0], f"{what}: {r[1]}"))
            srv.garbage = None
            try:
                after = c.infer(_obs()).actions
                alive = after.shape[1] == ACTION and bool(np.isfinite(after).all()) and c.healthy
            except Exception as e:  # noqa: BLE001
                return worst(*results, ("crash", f"then a good chunk did not come back: {type(e).__name__}: {e}"))
        if not alive:
            return worst(*results, ("crash", "then the next good chunk was not accepted"))
    out = worst(*results)
    return out[0], f"server announces {announced[0]} (then {announced[1]}): {out[1]}; the next good chunk is accepted"


def case_huge_instruction(tmp: Path) -> Result:
    return _bad_request(tmp, ("bad_request", "1000000 characters", "limit"), obs=_obs(instruction="x" * 1_000_000))


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def case_many_instructions(tmp: Path) -> Result:
    """300 unique instructions: served policy's default (checkpoint instructions only: the resolver
    refuses them) and ``--paraphrases 16 --allow-unknown`` (MiniLM encodes them; at most 16 kept);
    nothing written to disk."""
    import policies
    from deploy.serving.client import PolicyClient
    from deploy.errors import ServerError
    from deploy.serving.server import PolicyServer
    cache_dir = tmp / "lang_cache"
    os.environ["GROUNDFLOW_LANG_CACHE"] = str(cache_dir)
    ckpt = _served_ckpt(tmp)
    parts = []
    for paraphrases in (0, 16):
        policy = policies.load(ckpt)
        with PolicyServer(policy, port=0, paraphrases=paraphrases, allow_unknown=paraphrases > 0) as srv, \
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
    from deploy.serving.client import PolicyClient
    from deploy.errors import PolicyUnavailableError
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.server import PolicyServer
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


def case_silent_connections(tmp: Path) -> Result:
    """300 TCP connections that never start the websocket handshake, then 20 websocket clients that
    never say hello, against the serve defaults (--max-connections 16 --max-pending 32
    --handshake-timeout 5): threads held, whether a good client is served meanwhile, when they close."""
    import selectors
    import socket

    from deploy.serving.client import PolicyClient
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.server import PolicyServer
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect
    policy = JointTargetPolicy(STATE, ACTION, np.zeros(7))
    problems: list[str] = []

    def good_client(port: int) -> str:
        t0 = time.monotonic()
        try:
            with PolicyClient(port=port, timeout=10) as c:
                c.infer(_obs(), seed=0)
        except Exception as e:  # noqa: BLE001
            problems.append(f"a good client was not served: {type(e).__name__}: {str(e)[:120]}")
            return f"NOT served ({type(e).__name__})"
        dt = time.monotonic() - t0
        if dt > 3:
            problems.append(f"a good client waited {dt:.1f} s")
        return f"served in {dt * 1e3:.0f} ms"

    with PolicyServer(policy, port=0, max_connections=16) as srv:
        time.sleep(0.2)
        base = threading.active_count()
        t0 = time.monotonic()
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(300)]
        sel = selectors.DefaultSelector()
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        closed: dict[Any, float] = {}

        def drain(until: float) -> None:
            while time.monotonic() < until and len(closed) < len(socks):
                for key, _ in sel.select(timeout=max(0.0, min(0.1, until - time.monotonic()))):
                    try:
                        data = key.fileobj.recv(4096)
                    except OSError:
                        data = b""
                    if data == b"":
                        closed[key.fileobj] = time.monotonic() - t0
                        sel.unregister(key.fileobj)

        drain(time.monotonic() + 1.0)
        held = threading.active_count() - base
        served_tcp = good_client(srv.port)
        drain(t0 + 40)
        last = max(closed.values()) if closed else float("nan")
        for s in socks:
            s.close()
        # websocket open, metadata received, no hello: must not take the 16 --max-connections slots
        silent = []
        for _ in range(20):
            ws = connect(f"ws://127.0.0.1:{srv.port}", compression=None, proxy=None, max_size=None, open_timeout=10)
            ws.recv(timeout=10)
            silent.append(ws)
        served_ws = good_client(srv.port)
        t1 = time.monotonic()
        open_ws = list(silent)
        while open_ws and time.monotonic() - t1 < 30:
            for ws in list(open_ws):
                try:
                    ws.recv(timeout=0.01)
                except TimeoutError:
                    continue
                except ConnectionClosed:
                    open_ws.remove(ws)
        ws_closed = time.monotonic() - t1
        for ws in silent:
            ws.close()
        deadline = time.monotonic() + 30
        while threading.active_count() > base and time.monotonic() < deadline:
            time.sleep(0.05)
        extra = threading.active_count() - base
        stats = dict(srv.stats)
    cap = 2 * getattr(srv, "max_pending", 32) + 8  # two threads per connection waiting on its handshake
    detail = (f"300 silent TCP connections: {held} server threads 1 s after the burst (cap {cap}), "
              f"{stats.get('evicted', 0)} evicted for newer ones, the last closed {last:.1f} s after the burst began "
              f"({len(closed)}/300 closed); a good client meanwhile {served_tcp}; 20 websocket clients without a hello: "
              f"a good client meanwhile {served_ws}, {20 - len(open_ws)}/20 closed within {ws_closed:.1f} s; "
              f"{extra} extra threads after")
    if problems:
        return "crash", "; ".join(problems) + ": " + detail
    if held > cap or len(closed) < 300 or open_ws or extra > 0:
        return "crash", "connections or threads not capped or not released: " + detail
    return "ok", detail


def case_server_port_in_use(tmp: Path) -> Result:
    """A second server on the port a first one listens on: the API, and `groundflow serve` (a real
    process); then a plain socket (another program) holding the port."""
    import socket

    from deploy.serving.client import PolicyClient
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.server import PolicyServer
    policy = JointTargetPolicy(STATE, ACTION, np.zeros(7))

    def serve_cli(port: int) -> Result:
        argv = ["-m", "groundflow.cli", "serve", "--scripted", "joint_target", "--state-dim", str(STATE),
                "--action-dim", str(ACTION), "--target", *["0"] * 7, "--port", str(port)]
        try:
            r = run_py(argv, timeout=60)
        except subprocess.TimeoutExpired:
            return "unclear_error", f"CLI: a second `groundflow serve --port {port}` started and ran (no error)"
        return judge_cli(r.returncode, r.stderr, "serve", f"port {port}", "in use")

    with PolicyServer(policy, port=0) as first:
        port = first.port
        reuse_port = first._server.socket.getsockopt(socket.SOL_SOCKET, getattr(socket, "SO_REUSEPORT", 15))
        try:
            PolicyServer(policy, port=port).bind().stop()
            api: Result = ("unclear_error", f"a second PolicyServer bound port {port} (SO_REUSEPORT {reuse_port})")
        except Exception as e:  # noqa: BLE001
            api = judge_exception(e, f"port {port}", "in use")
        res = api_and_cli(api, serve_cli(port), "serve")
        try:
            with PolicyClient(port=port, timeout=10) as c:
                alive = c.infer(_obs(), seed=0).actions.shape == (16, ACTION)
        except Exception as e:  # noqa: BLE001
            return "crash", f"{res[1]}; then the first server stopped serving: {type(e).__name__}: {e}"
    other = socket.create_server(("127.0.0.1", 0))
    try:
        res = worst(res, serve_cli(other.getsockname()[1]))
    finally:
        other.close()
    if not alive:
        return "crash", f"{res[1]}; the first server's next reply was wrong"
    return res[0], f"{res[1]} [the first server still serves]"


def case_handshake_bad_types(tmp: Path) -> Result:
    """Hellos whose fields have the wrong type (cameras=5, image_size="x", nested junk, ...) sent
    straight over a websocket: each must be a bad_hello reply naming the field; the server keeps serving."""
    from deploy.serving import protocol
    from deploy.serving.client import PolicyClient
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.server import PolicyServer
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect
    bad = [("cameras", 5), ("cameras", "wrist"), ("cameras", [["wrist"]]), ("cameras", {"wrist": 1}),
           ("image_size", "x"), ("state_dim", "35"), ("state_dim", [35]), ("action_dim", 8.0), ("action_dim", True),
           ("action_dim", {"nested": [1, {"junk": b"\x00"}]}), ("version", "1")]
    results: list[Result] = []
    first_msg = ""
    with PolicyServer(JointTargetPolicy(STATE, ACTION, np.zeros(7)), port=0) as srv:
        for field, value in bad:
            what = f"{field}={value!r}"
            ws = connect(f"ws://127.0.0.1:{srv.port}", compression=None, proxy=None, max_size=None, open_timeout=10)
            try:
                ws.recv(timeout=10)
                ws.send(protocol.pack({"type": "hello", "version": protocol.VERSION, "action_dim": ACTION,
                                       "state_dim": STATE, "cameras": [], field: value}))
                answer = protocol.unpack(ws.recv(timeout=10))
                msg = str(answer.get("message", ""))
                if answer.get("type") == "ready":
                    results.append(("unclear_error", f"{what}: accepted"))
                elif answer.get("code") != "bad_hello" or f"hello.{field}" not in msg:
                    results.append(("unclear_error", f"{what}: {answer.get('code')}: {msg[:100]} (does not name "
                                                     f"hello.{field} as a bad_hello)"))
                else:
                    results.append(("clear_error", f"{what}: bad_hello"))
                if not results[1:]:
                    first_msg = msg[:160]
            except ConnectionClosed as e:
                results.append(("unclear_error", f"{what}: connection closed without a reply ({e})"))
            except TimeoutError:
                results.append(("hang", f"{what}: no reply within 10 s"))
            finally:
                ws.close()
        try:
            with PolicyClient(port=srv.port, timeout=10) as c:
                alive = c.infer(_obs(), seed=0).actions.shape == (16, ACTION)
        except Exception as e:  # noqa: BLE001
            return "crash", f"then the server stopped serving: {type(e).__name__}: {e}"
    outcome = worst(*results)[0]
    shown = [r[1] for r in results if r[0] == outcome][:3]
    detail = (f"{sum(r[0] == 'clear_error' for r in results)}/{len(results)} malformed hellos refused as bad_hello "
              f"naming the field; e.g. {'; '.join(shown)}")
    if not alive:
        return "crash", detail + "; the next good client got a bad chunk"
    return outcome, detail + f"; the server still serves (cameras=5: {first_msg!r})"


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
    from deploy.serving.server import PolicyServer
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


def case_deploy_server_lost_recording(tmp: Path) -> Result:
    """#46 item 12: `groundflow deploy --episodes 3 --record` (a real process) whose policy server goes away
    as episode 1 starts (it stops while the episode's first request waits): exit non-zero, and the last
    line of its output says the server was lost and names the file holding the recorded episode, which
    must read back."""
    from dataset import Dataset
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.server import PolicyServer
    going, release = threading.Event(), threading.Event()

    class GoesAway(JointTargetPolicy):
        def reset(self):  # each episode starts with a reset; the second one (episode 1) finds the server going
            if self.calls:
                going.set()
                release.wait(60)
            super().reset()

    rec = tmp / "rec.h5"
    srv = PolicyServer(GoesAway(STATE, ACTION, HOME, gripper=1.0), port=0).start()
    address = srv.address
    stopper = threading.Thread(target=srv.stop)  # closes the connections, then waits for the handler
    try:
        proc = _deploy_proc(address, "--lockstep", "--episodes", "3", "--max-steps", "20", "--timeout", "2",
                            "--record", str(rec))
        try:
            if going.wait(150):
                stopper.start()
            out, err = proc.communicate(timeout=150)
        finally:
            release.set()  # the handler waiting in reset() may end now
            if proc.poll() is None:
                proc.kill()
    finally:
        if stopper.is_alive():
            stopper.join(30)
        srv.stop()
    if not going.is_set():
        return "unclear_error", f"deploy never started episode 1 (exit {proc.returncode}): {err.strip()[-200:]}"
    last = (err.strip().splitlines() or [""])[-1]
    reasons = _reasons(rec)
    named = [q for q in (rec.with_name(rec.name + ".partial"), rec) if str(q) in last]
    detail = f"exit {proc.returncode}; last line: {last[:400]}; recorded reasons {reasons}".replace(address, "$ADDR")
    if proc.returncode == 0:
        return "unclear_error", "exit 0 although the server was lost: " + detail
    if "Traceback" in err:
        return "unclear_error", detail + " (traceback)"
    res = judge_cli(proc.returncode, err, "deploy", "policy server", "lost")
    if not last.startswith("groundflow deploy: error:"):
        res = ("unclear_error", f"{res[1]} (not the last line)")
    if not named:
        return worst(res, ("unclear_error", "the last line names no recording")), detail
    try:
        with Dataset(named[0], allow_incomplete=True) as ds:
            n = len(ds)
            for i in range(n):
                ds.episode(i)
    except Exception as e:  # noqa: BLE001
        return "data_loss", detail + f"; {named[0].name} does not read back: {type(e).__name__}: {str(e)[:120]}"
    if n != 1 or reasons[:1] != ["max_steps"]:
        return "data_loss", detail + f"; {named[0].name} holds {n} episode(s), episode 0 recorded as {reasons[:1]}"
    return res[0], detail + f"; {named[0].name} reads back its 1 episode"


def case_deploy_interrupted_reason(tmp: Path) -> Result:
    """Ctrl+C twice on a running `groundflow deploy --record` (a real process)."""
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.server import PolicyServer
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


def _serve_proc(log: Path, *argv: str) -> tuple[subprocess.Popen, str]:
    """A real `groundflow serve ARGV --port 0` process (its log in ``log``) and the address it printed;
    SIGINT stops it."""
    from deploy.procs import popen_tied
    with open(log, "w") as f:
        proc = popen_tied([sys.executable, "-m", "groundflow.cli", "serve", *argv, "--port", "0"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=f, text=True, preexec_fn=_ctrl_c_as_in_a_terminal,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:
        m = re.match(r"serving on ws://(\S+) ", line)
        if m:
            return proc, m.group(1)
    proc.wait(30)
    raise RuntimeError(f"`groundflow serve` did not start (exit {proc.returncode}): {log.read_text()[-300:]}")


def case_deploy_other_env(tmp: Path) -> Result:
    """#46 item 8: a checkpoint trained on PushCube (as train/bc.py records it: env id and state layout)
    served by a real `groundflow serve`, and a real `groundflow deploy --robot sim --env PullCube` (same
    state and action dims, same state slice names, another task): refused in one line naming both
    envs and --force; `--force` runs it; deployed on PushCube it runs."""
    import torch

    import envs
    import policies
    dims = {}
    for env_id in ("maniskill/PushCube-v1", "maniskill/PullCube-v1"):
        env = envs.make(env_id)
        try:
            dims[env_id] = (env.observation_space["state"].shape[0], env.action_space.shape[0],
                            [name for name, _ in env.state_layout])
        finally:
            env.close()
    push, pull = dims.values()
    if push != pull:
        return "unclear_error", f"PushCube and PullCube differ in dims or state slices: {push} vs {pull}"
    state_dim, action_dim, layout = push
    cfg = policies.PolicyConfig(kind="flow", state_dim=state_dim, action_dim=action_dim, horizon=4, n_exec=4,
                                size="tiny")
    torch.manual_seed(SEED)
    m = policies.make_policy(cfg)
    rng = np.random.default_rng(SEED)
    m.fit_normalizer(rng.normal(size=(64, state_dim)), rng.uniform(-0.1, 0.1, size=(64, action_dim)))
    m.lang.cache["move the cube"] = torch.zeros(1, cfg.lang_dim)  # the checkpoint's instruction (no MiniLM)
    inputs = {"cameras": [], "state": layout, "estimated": [], "reads_object_state": True}
    ckpt = m.save(tmp / "pushcube", extra={"env_id": "maniskill/PushCube-v1", "inputs": inputs})
    srv, address = _serve_proc(tmp / "serve.log", "--ckpt", str(ckpt))
    try:
        def deploy(env_id: str, *extra: str) -> subprocess.CompletedProcess:
            return run_py(["-m", "groundflow.cli", "deploy", "--robot", "sim", "--env", env_id, "--server", address,
                           "--lockstep", "--episodes", "1", "--max-steps", "3", "--instruction", "move the cube",
                           "--no-status", "--seed", str(SEED), *extra], timeout=180)

        def ran(r: subprocess.CompletedProcess) -> bool:
            return r.returncode == 0 and any(json.loads(x).get("steps") == 3 for x in r.stdout.splitlines()
                                             if x.startswith('{"steps"'))
        other = deploy("maniskill/PullCube-v1")
        forced = deploy("maniskill/PullCube-v1", "--force")
        same = deploy("maniskill/PushCube-v1")
    finally:
        srv.send_signal(signal.SIGINT)
        try:
            srv.wait(30)
        finally:
            if srv.poll() is None:
                srv.kill()
    if ran(other) or other.returncode == 0:
        res: Result = ("unclear_error", f"deployed on PullCube without an error (exit {other.returncode})")
    else:
        res = judge_cli(other.returncode, other.stderr, "deploy", "maniskill/PushCube-v1", "maniskill/PullCube-v1",
                        "--force")
        last = (other.stderr.strip().splitlines() or [""])[-1]
        if not last.startswith("groundflow deploy: error:"):
            res = ("unclear_error", res[1] + f" (the last line is {last[:120]!r})")
    results = [(res[0], f"PullCube: {res[1]}")]
    warned = "--force" in forced.stderr
    results.append(("ok", "--force: ran 3 steps" + (" with a warning" if warned else " (no warning)")) if ran(forced)
                   else ("unclear_error", f"--force did not run it: exit {forced.returncode}, "
                                          f"{one_error_line(forced.stderr, 'deploy')[:160]}"))
    results.append(("ok", "on PushCube: ran 3 steps") if ran(same) else
                   ("unclear_error", f"on PushCube it did not run: exit {same.returncode}, "
                                     f"{one_error_line(same.stderr, 'deploy')[:160]}"))
    stopped = f"`groundflow serve` stopped by Ctrl+C (exit {srv.returncode})"
    if srv.returncode != 0:
        results.append(("unclear_error", stopped))
    out = worst(*results)
    detail = f"same dims {state_dim}/{action_dim} and state slices; {out[1]}; {stopped}"
    return max(out[0], "clear_error", key=SEVERITY.get), detail.replace(address, "127.0.0.1:$PORT")


# ----- bad flags --------------------------------------------------------------------------------

def case_bad_flags(tmp: Path) -> Result:
    """#46 bad-input sweep, through the command line: `train --out` under a regular file, `train --steps
    -5`, `train --horizon 100000` (must not hang), `serve --port 99999`, `serve --max-message-mb -1`,
    `deploy --rate 0`, `eval --episodes 0` and `-3`. Each must be one `groundflow CMD: error:` line naming
    the flag (or the file), exit 1, and write nothing. (A directory --out for collect, a port in use and a
    hello with cameras=5 are the cases collect_out_is_dir, server_port_in_use and handshake_bad_types.)"""
    data = _write(tmp / "tiny.h5", n=4)
    afile = tmp / "afile"
    afile.write_text("x")
    ckpt = tmp / "ckpt"
    _tiny_policy(SEED).save(ckpt, extra={"env_id": "maniskill/PushCube-v1"})
    train = ["train", "--data", str(data), "--horizon", "4", "--n-exec", "2", "--batch-size", "8", "--steps", "2",
             "--wandb", "disabled", "--no-progress"]
    serve = ["serve", "--scripted", "joint_target", "--state-dim", str(STATE), "--action-dim", str(ACTION),
             "--target", *["0"] * 7]
    sweep = [("train --out under a file", [*train, "--out", str(afile / "run")], (str(afile), "is a file")),
             ("train --steps -5", [*train, "--out", str(tmp / "r1"), "--steps", "-5"], ("--steps", "-5")),
             ("train --horizon 100000", [*train, "--out", str(tmp / "r2"), "--horizon", "100000"],
              ("--horizon", "100000")),
             ("serve --port 99999", [*serve, "--port", "99999"], ("--port", "99999")),
             ("serve --max-message-mb -1", [*serve, "--max-message-mb", "-1"], ("--max-message-mb", "-1")),
             ("deploy --rate 0", ["deploy", "--robot", "sim", "--server", "127.0.0.1:9", "--no-status", "--rate", "0"],
              ("--rate", "0")),
             ("eval --episodes 0", ["eval", "--ckpt", str(ckpt), "--episodes", "0"], ("--episodes", "0")),
             ("eval --episodes -3", ["eval", "--ckpt", str(ckpt), "--episodes", "-3"], ("--episodes", "-3"))]
    before = sorted(str(q.relative_to(tmp)) for q in tmp.rglob("*"))
    results = []
    for what, argv, needles in sweep:
        t0 = time.perf_counter()
        code, _, err = cli(argv)
        r = judge_cli(code, err, argv[0], *needles)
        ms = (time.perf_counter() - t0) * 1e3
        msg = r[1].split(": error: ", 1)[-1]
        results.append((r[0], f"{what}: {msg if r[0] == 'clear_error' else r[1]} [{ms:.0f} ms]"))
    after = sorted(str(q.relative_to(tmp)) for q in tmp.rglob("*"))
    if after != before or afile.read_text() != "x":
        results.append(("data_loss" if afile.read_text() != "x" else "unclear_error",
                        f"written meanwhile: {sorted(set(after) - set(before))}"))
    out = worst(*results)
    n = sum(r[0] == "clear_error" for r in results)
    return out[0], f"{n}/{len(sweep)} one line, exit 1, nothing written: {out[1]}"


# ----- counterfactual debugging -----------------------------------------------------------------

def case_debugging_rollout_bound(tmp: Path) -> Result:
    """The search on a synthetic case (T = 50, k = 8 reward faults, small residuals everywhere): its
    rollouts against single-step ablation's T + 2; it must find the faults and never cost more than
    that ablation (nor than the budget it announces, ``rollout_budget``), with or without max_rollouts."""
    from deploy.debugging.search import DebugConfig, Outcome, debug
    from deploy.debugging.faults import ConstantPolicy, Integrator, integrator_episode

    T, k, n = 50, 8, 20
    pi = ConstantPolicy()
    rows = []
    for s in range(n):  # small errors everywhere, 8 faults
        ep, causes = integrator_episode(s, T, k, fault=-1.0, noise=1e-3, rng_seed=[SEED, s])
        free = debug(Integrator(), pi, ep, DebugConfig(outcome=Outcome("return"), rel_tol=0.1))
        capped = debug(Integrator(), pi, ep, DebugConfig(outcome=Outcome("return"), rel_tol=0.1, max_rollouts=T + 2))
        rows.append({"free": free.rollouts, "free_ok": free.steps == causes, "capped": capped.rollouts,
                     "capped_ok": capped.steps == causes, "fell_back": capped.fell_back,
                     "announced": getattr(free, "rollout_budget", 0),
                     "capped_announced": getattr(capped, "rollout_budget", 0),
                     # what exhaustive single-step ablation costs, or less where the attribution announces less
                     "budget": min(getattr(free, "rollout_budget", 0) or T + 2, T + 2),
                     "capped_budget": min(getattr(capped, "rollout_budget", 0) or T + 2, T + 2)})
    col = lambda k: [r[k] for r in rows]  # noqa: E731
    found = sum(col("free_ok")), sum(col("capped_ok"))
    over = sum(r > T + 2 for r in col("free")), sum(r > T + 2 for r in col("capped"))
    detail = (f"T = {T}, k = {k}, {n} seeds, vs T + 2 = {T + 2} for single-step ablation: default config "
              f"(`groundflow debug`) {min(col('free'))}-{max(col('free'))} rollouts (mean {np.mean(col('free')):.1f}; "
              f"{over[0]}/{n} over T + 2, announced budget {max(col('announced'))}), causes exact {found[0]}/{n}; "
              f"with max_rollouts = T + 2 {min(col('capped'))}-{max(col('capped'))} ({over[1]}/{n} over T + 2, "
              f"{sum(col('fell_back'))} fell back to ablation, announced budget {max(col('capped_announced'))}), "
              f"causes exact {found[1]}/{n}")
    if min(found) < n:
        return "unclear_error", "wrong steps blamed: " + detail
    if any(r["free"] > r["budget"] or r["capped"] > r["capped_budget"] for r in rows):
        # no error category fits a cost overrun; it is flagged, not ok: exhaustive ablation would have been cheaper
        return "unclear_error", "more rollouts than single-step ablation (T + 2) or the announced budget: " + detail
    return "ok", detail


# ----- driver -----------------------------------------------------------------------------------

CASES: dict[str, tuple[Callable[[Path], Result], float]] = {  # name -> (case, timeout in seconds)
    "dataset_concurrent_writer": (case_dataset_concurrent_writer, 120),
    "dataset_stale_partial": (case_dataset_stale_partial, 900),
    "dataset_target_appeared": (case_dataset_target_appeared, 60),
    "collect_out_is_dir": (case_collect_out_is_dir, 120),
    "dataset_flipped_action_bytes": (case_dataset_flipped_action_bytes, 90),
    "dataset_missing_env_id": (case_dataset_missing_env_id, 90),
    "dataset_missing_episodes": (case_dataset_missing_episodes, 90),
    "dataset_heavily_corrupted": (case_dataset_heavily_corrupted, 90),
    "dataset_nan_state": (case_dataset_nan_state, 90),
    "dataset_metadata_flips": (case_dataset_metadata_flips, 240),
    "ckpt_truncated_config": (case_ckpt_truncated_config, 90),
    "ckpt_changed_dim": (case_ckpt_changed_dim, 90),
    "ckpt_config_flip": (case_ckpt_config_flip, 180),
    "ckpt_truncated_weights": (case_ckpt_truncated_weights, 90),
    "ckpt_crash_between_renames": (case_ckpt_crash_between_renames, 120),
    "train_state_truncated": (case_train_state_truncated, 150),
    "train_state_crafted_pickle": (case_train_state_crafted_pickle, 150),
    "train_diverged_no_ckpt": (case_train_diverged_no_ckpt, 120),
    "train_interrupted_resume": (case_train_interrupted_resume, 300),
    "ckpt_weight_flips": (case_ckpt_weight_flips, 180),
    "dataset_lock_deleted": (case_dataset_lock_deleted, 300),
    "train_same_out": (case_train_same_out, 300),
    "disk_full": (case_disk_full, 300),
    "server_absurd_state_1e30": (case_server_absurd_state_1e30, 90),
    "server_absurd_state_3e38": (case_server_absurd_state_3e38, 90),
    "bad_prefix_1e30": (case_bad_prefix_1e30, 90),
    "bad_prefix_3e38": (case_bad_prefix_3e38, 90),
    "bad_prefix_far": (case_bad_prefix_far, 90),
    "bad_prefix_nan": (case_bad_prefix_nan, 90),
    "client_garbage_chunks": (case_client_garbage_chunks, 90),
    "many_instructions": (case_many_instructions, 180),
    "huge_instruction": (case_huge_instruction, 90),
    "idle_clients": (case_idle_clients, 150),
    "silent_connections": (case_silent_connections, 150),
    "server_port_in_use": (case_server_port_in_use, 120),
    "handshake_bad_types": (case_handshake_bad_types, 90),
    "deploy_policy_lost_exit_code": (case_deploy_policy_lost_exit_code, 180),
    "deploy_server_lost_recording": (case_deploy_server_lost_recording, 240),
    "deploy_interrupted_reason": (case_deploy_interrupted_reason, 180),
    "deploy_other_env": (case_deploy_other_env, 300),
    "bad_flags": (case_bad_flags, 120),
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
