"""One writer per output, held with OS-level locks the other writer cannot remove from under it
(#46 item 6): a deleted ``.lock`` file, ``HDF5_USE_FILE_LOCKING=FALSE`` and two ``groundflow
train`` runs on one ``--out``; and nothing is published unless it reads back intact."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dataset import Dataset, DatasetError, DatasetWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_reliability_data import _episode, _write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# A real collect process that writes one episode, says so, and waits for the go file before the rest
# (so the test decides when the second writer runs, while the first is mid-write).
GATED_COLLECT = """
import sys, time
from pathlib import Path
from train.collect import CollectArgs, collect
out, ready, go = map(Path, sys.argv[1:4])
def on_episode(n):
    if n == 1:
        ready.touch()
        while not go.exists():
            time.sleep(0.02)
collect(CollectArgs(env="adroit/door", episodes=3, out=out, progress=False), on_episode=on_episode)
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the first writer exited early: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def _cli(*argv: str, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "groundflow.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)


def _one_line(err: str, cmd: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"groundflow {cmd}: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("hdf5_locking", ["default", "FALSE"])
def test_a_deleted_lock_file_does_not_let_a_second_collect_in(tmp_path, hdf5_locking):
    """Before the fix, with HDF5's own locking the second collect died with a traceback after
    truncating the first one's .partial, and the first published a corrupt 'complete' file; with
    HDF5_USE_FILE_LOCKING=FALSE the second published its own file, the first wrote into it, and its
    error named a .partial that did not exist."""
    env = dict(ENV)
    if hdf5_locking != "default":
        env["HDF5_USE_FILE_LOCKING"] = hdf5_locking
    path, ready, go = tmp_path / "d.h5", tmp_path / "ready", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", GATED_COLLECT, str(path), str(ready), str(go)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(ready, first)
        path.with_name("d.h5.lock").unlink()  # "a stale-looking lock file"
        second = _cli("collect", "--env", "adroit/door", "--episodes", "2", "--out", str(path), "--overwrite",
                      "--no-progress", env=env)
        go.touch()
        _, err1 = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    line = _one_line(second.stderr, "collect")
    assert second.returncode == 1
    assert str(path) in line and "being written by another process" in line and f"pid {first.pid}" in line, line
    # the first run published its three episodes intact (every array checked against its crc32)
    assert first.returncode == 0, err1[-3000:]
    with Dataset(path) as ds:
        assert len(ds) == 3
        for ep in ds:
            assert len(ep) > 0
    assert not path.with_name("d.h5.partial").exists() and not path.with_name("d.h5.lock").exists()


def test_a_partial_that_does_not_read_back_is_not_published(tmp_path):
    path = tmp_path / "d.h5"
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode(seed=0))
    w.add(_episode(seed=1))
    partial = path.with_name("d.h5.partial")
    offset = w.f["episodes/000001/action"].id.get_offset()  # bytes that change after they were written
    with open(partial, "r+b") as fh:
        fh.seek(offset + 5)
        b = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(DatasetError, match=r"not publishing .*d\.h5.*episode 000001.*checksum") as e:
        w.close()
    assert "\n" not in str(e.value) and str(partial) in str(e.value)
    assert not path.exists() and partial.exists()  # kept for inspection, as the message says
    assert not path.with_name("d.h5.lock").exists()


def test_a_partial_removed_from_under_the_writer_is_not_published_and_not_named(tmp_path):
    """The error names only files that exist (before the fix: 'the complete new data is in d.h5.partial'
    after d.h5.partial was gone)."""
    path = tmp_path / "d.h5"
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode(seed=0))
    partial = path.with_name("d.h5.partial")
    partial.unlink()
    with pytest.raises(DatasetError, match=r"not publishing .*d\.h5\.partial was removed") as e:
        w.close()
    assert "is in" not in str(e.value) and not path.exists() and not partial.exists()
    # and one replaced by another file: that file is left as it is, not published as ours
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode(seed=0))
    partial.unlink()
    _write(partial, n=1)  # (a published d.h5 renamed by hand to the .partial name)
    with pytest.raises(DatasetError, match=r"not publishing .*d\.h5\.partial was replaced"):
        w.close()
    assert not path.exists() and len(Dataset(partial)) == 1


def test_the_lock_file_of_another_writer_is_not_unlinked(tmp_path):
    """A finishing writer removes its own lock file, never one that replaced it."""
    path = tmp_path / "d.h5"
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode())
    lock = path.with_name("d.h5.lock")
    lock.unlink()
    lock.write_text("someone else's")
    w.close()
    assert lock.read_text() == "someone else's" and len(Dataset(path)) == 1


TRAIN = ["--horizon", "4", "--n-exec", "2", "--batch-size", "8", "--wandb", "disabled", "--no-progress"]


def test_two_trains_on_the_same_out(tmp_path):
    """Before the fix both ran (one in 7 crashed on the other's .tmp files); now the second is refused in
    one line naming --out and the process that holds it, and the first is unharmed."""
    data = _write(tmp_path / "d.h5", n=4)
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "groundflow.cli", "train", "--data", str(data), "--out", str(out),
                              "--steps", "1000000", "--save-every", "1000000", *TRAIN], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        _wait_for(out, first)
        time.sleep(1.0)
        second = _cli("train", "--data", str(data), "--out", str(out), "--steps", "2", "--save-every", "1", *TRAIN)
        assert first.poll() is None, first.communicate()[1][-2000:]
        line = _one_line(second.stderr, "train")
        assert second.returncode == 1 and str(out) in line and f"pid {first.pid}" in line, line
        assert not (out / "train_state.pt").exists() and not (out / "ckpt").exists()  # the second wrote nothing
    finally:
        first.send_signal(signal.SIGINT)
        try:
            first.wait(120)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()  # the lock goes only when the process has gone
    # the lock goes with the process: the next run on that --out starts
    from train.bc import TrainArgs, train
    assert train(TrainArgs(data=(data,), out=out, steps=2, save_every=1, horizon=4, n_exec=2, batch_size=8,
                           wandb="disabled", progress=False))["steps"] == 2


def test_an_out_the_run_created_is_removed_when_it_fails_before_writing(tmp_path):
    from train.bc import TrainArgs, train
    data = _write(tmp_path / "d.h5", n=2)
    with pytest.raises(ValueError, match="--horizon 12"):
        train(TrainArgs(data=(data,), out=tmp_path / "new", steps=2, horizon=12, n_exec=2, wandb="disabled",
                        progress=False))
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()  # one that existed before stays
    with pytest.raises(ValueError, match="--horizon 12"):
        train(TrainArgs(data=(data,), out=tmp_path / "old", steps=2, horizon=12, n_exec=2, wandb="disabled",
                        progress=False))
    assert (tmp_path / "old").is_dir()
    np.testing.assert_equal(sorted(os.listdir(tmp_path)), ["d.h5", "old"])
