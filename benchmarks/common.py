"""Helpers shared by the benchmark scripts: cached demo collection and result files."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RUNS = RESULTS / "runs"
"""per-run pieces (``--results g3_prot_s0``): git-ignored, read from here by the benchmark's ``--merge``"""
MANIFEST = "manifest.json"
"""in RESULTS: the provenance (command, commit, seeds, content) of the pieces that left the tree; a
results file merged from such pieces names it in its top-level ``manifest`` key"""
DATA = ROOT / "data" / "bench"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def demos(env_id: str, episodes: int, seed: int = 0, **kw: Any) -> Path:
    """Collect expert demos once and reuse them (keyed by env, count, seed and options)."""
    from train.collect import CollectArgs, collect
    tag = "_".join(f"{k}-{'+'.join(map(str, v)) if isinstance(v, (tuple, list)) else v}"
                   for k, v in sorted(kw.items()) if not isinstance(v, dict))
    path = DATA / f"{env_id.replace('/', '_')}_{episodes}_s{seed}{'_' + tag if tag else ''}.h5"
    if not path.exists():
        collect(CollectArgs(env=env_id, episodes=episodes, out=path, seed=seed, progress=False, **kw))
    return path


@contextlib.contextmanager
def served(ckpt: Path, timeout_s: float = 120.0) -> Iterator[int]:
    """``groundflow serve --ckpt`` on a free loopback port (one torch thread), yielding the port once a
    client's handshake succeeds (the server loads its checkpoint and language model first); stopped after."""
    from deploy.serving.client import PolicyClient
    from deploy.errors import PolicyUnavailableError
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([str(ROOT / ".venv" / "bin" / "groundflow"), "serve", "--ckpt", str(ckpt),
                               "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                PolicyClient(port=port, timeout=10.0).close()
                break
            except (OSError, PolicyUnavailableError):  # not listening yet
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"groundflow serve --ckpt {ckpt} did not answer on port {port}") from None
                time.sleep(0.5)
        yield port
    finally:
        server.terminate()
        server.wait(30)


def machine() -> dict[str, Any]:
    import torch
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d")}


def result_path(stem: str, suffix: str = ".json") -> Path:
    """Where ``<stem><suffix>`` is written: RESULTS when the stem names a benchmark script (``grounding``:
    one tracked results file per benchmark), RUNS for any other stem (a per-run piece, git-ignored
    until the benchmark's ``--merge`` joins it into that file)."""
    own = (Path(__file__).resolve().parent / f"{stem}.py").is_file()
    return (RESULTS if own else RUNS) / f"{stem}{suffix}"


def piece_path(stem: str) -> Path:
    """``<stem>.json`` as a merge step reads it: where ``result_path`` writes it, or in RESULTS where
    pieces were written before RUNS existed (so a piece left there by an older checkout still merges)."""
    path, before = result_path(stem), RESULTS / f"{stem}.json"
    return before if not path.exists() and before.exists() else path


def name_manifest(stem: str, res: dict[str, Any]) -> None:
    """A merge step's mark on the benchmark's own results file: where its pieces' provenance went
    (not on a piece merged into another piece in RUNS, where the relative name would not resolve)."""
    if result_path(stem).parent == RESULTS:
        res["manifest"] = MANIFEST


def write(name: str, data: dict[str, Any], table: str, merge: bool = False) -> None:
    path = result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    if merge and (src := piece_path(name)).exists():
        old = json.loads(src.read_text())
        old.update(data)
        data = old
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
    result_path(name, ".md").write_text(table)
    print(table)


def load_results(stem: str) -> dict[str, Any]:
    """``<stem>.json`` from ``piece_path`` ({} before the first run)."""
    path = piece_path(stem)
    return json.loads(path.read_text()) if path.exists() else {}


def save_results(stem: str, res: dict[str, Any], table: Callable[[dict[str, Any]], str]) -> None:
    """Write ``<stem>.json`` atomically (a per-process temp file, then rename) with the machine
    stamped in, and the markdown ``table(res)`` beside it; parts of a benchmark run one after another save
    after every entry, so a killed run keeps what it measured."""
    path = result_path(stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    res["machine"] = machine()
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(res, indent=2))
    os.replace(tmp, path)
    result_path(stem, ".md").write_text(table(res))


def merge_json(path: Path, sections: dict[str, Any], indent: int = 2) -> dict[str, Any]:
    """Replace ``sections`` of a results file shared by several benchmarks (guidance.json), keeping
    every other section; written atomically (a per-process temp file, then rename). Returns the data."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(sections)
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=indent, allow_nan=False))
    os.replace(tmp, path)
    return data


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"
