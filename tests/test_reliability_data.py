"""Datasets, checkpoints and training state under concurrent writers, crashes, flipped bytes and
crafted or damaged files: each is refused with one clear line naming the file, nothing is corrupted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import policies
from envs.errors import CheckpointError
from policies import PolicyConfig
from train.bc import TrainArgs, TrainingDivergedError, train
from groundflow.cli import main
from train.data import ChunkData
from dataset import Dataset, DatasetError, DatasetWriter, Episode

ROOT = Path(__file__).resolve().parents[1]


def _episode(T=10, S=5, A=3, seed=0) -> Episode:
    rng = np.random.default_rng(seed)
    return Episode(state=rng.normal(size=(T, S)).astype(np.float32), action=rng.normal(size=(T, A)).astype(np.float32),
                   reward=rng.normal(size=T).astype(np.float32), success=np.arange(T) == T - 1,
                   instruction=f"push the cube {seed % 2}", task_id=seed % 2, seed=seed,
                   sim_state=rng.normal(size=(T, 9)), final_state=rng.normal(size=S).astype(np.float32))


def _write(path: Path, n: int = 3, **kw) -> Path:
    with DatasetWriter(path, "test/env", 5, 3, **kw) as w:
        for i in range(n):
            w.add(_episode(seed=i))
    return path


def _run_py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _one_line_error(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


# ----- 1. one writer per dataset path -------------------------------------------------------------

def test_second_writer_is_refused_and_the_first_publishes_an_intact_file(tmp_path):
    path = tmp_path / "d.h5"
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode(seed=0))
    # another process (what two `groundflow collect --out d.h5` runs are) ...
    r = _run_py(f"from dataset import DatasetWriter\nDatasetWriter({str(path)!r}, 'test/env', 5, 3)")
    assert r.returncode != 0 and "being written by another process" in r.stderr, r.stderr
    # ... and a second writer in this process, even with overwrite, are refused before touching the .partial
    with pytest.raises(DatasetError, match="being written by another process"):
        DatasetWriter(path, "test/env", 5, 3, overwrite=True)
    w.add(_episode(seed=1))
    w.close()
    with Dataset(path) as ds:  # before the fix: "bad local heap signature"
        assert len(ds) == 2 and ds.frames()["action"].shape == (20, 3)
    assert not path.with_name("d.h5.lock").exists() and not path.with_name("d.h5.partial").exists()
    _write(path, overwrite=True)  # the lock is free again once the writer finished


def test_rerun_after_a_kill_keeps_the_partial_unless_overwrite(tmp_path):
    path = tmp_path / "d.h5"
    r = _run_py("import os, signal, sys\nsys.path.insert(0, 'tests')\n"
                "from test_reliability_data import _episode\nfrom dataset import DatasetWriter\n"
                f"w = DatasetWriter({str(path)!r}, 'test/env', 5, 3)\nw.add(_episode())\n"
                "os.kill(os.getpid(), signal.SIGKILL)")
    assert r.returncode == -9, r.stderr
    partial = path.with_name("d.h5.partial")
    with pytest.raises(FileExistsError, match=r"d\.h5\.partial exists.*--overwrite"):
        DatasetWriter(path, "test/env", 5, 3)
    assert len(Dataset(partial, allow_incomplete=True)) == 1  # the killed run's episode was not truncated
    _write(path, n=2, overwrite=True)
    assert len(Dataset(path)) == 2 and not partial.exists()


def test_publish_never_replaces_a_file_that_appeared_meanwhile(tmp_path):
    path = tmp_path / "d.h5"
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode())
    path.write_bytes(b"someone else's file")
    with pytest.raises(FileExistsError, match="appeared while this run was writing"):
        w.close()
    assert path.read_bytes() == b"someone else's file"
    assert len(Dataset(path.with_name("d.h5.partial"))) == 1  # the new data is complete beside it


# ----- 4. per-episode checksums -------------------------------------------------------------------

def _flip_byte(path: Path, dataset: str, index: int = 5) -> None:
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + index)
        b = fh.read(1)
        fh.seek(offset + index)
        fh.write(bytes([b[0] ^ 0x10]))


def test_flipped_action_bytes_are_detected(tmp_path):
    path = _write(tmp_path / "d.h5")
    _flip_byte(path, "episodes/000001/action")
    with pytest.raises(DatasetError, match=r"d\.h5: episode 000001 field action fails its checksum"):
        ChunkData(path, horizon=4)
    with Dataset(path) as ds:
        ds.episode(0)  # the other episodes still load


def test_files_without_checksums_still_load(tmp_path):
    path = _write(tmp_path / "d.h5")
    with h5py.File(path, "r+") as f:  # what files written before checksums look like
        f["episodes"].visititems(lambda n, o: o.attrs.__delitem__("crc32") if "crc32" in o.attrs else None)
    with Dataset(path) as ds:
        np.testing.assert_array_equal(ds.episode(2).action, _episode(seed=2).action)
    assert len(ChunkData(path, horizon=4)) == 30


# ----- 5. damaged datasets: one clear error naming the file ---------------------------------------

@pytest.mark.parametrize("damage,msg", [
    (lambda f: f.attrs.__delitem__("env_id"), "env_id"),
    (lambda f: f.__delitem__("episodes"), "episodes"),
])
def test_dataset_missing_header_parts(tmp_path, damage, msg):
    path = _write(tmp_path / "d.h5")
    with h5py.File(path, "r+") as f:
        damage(f)
    with pytest.raises(DatasetError, match=msg) as e:
        Dataset(path)
    assert str(path) in str(e.value)


def test_heavily_corrupted_dataset(tmp_path):
    path = _write(tmp_path / "d.h5")
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(0)
    for start in (0, 512, 1024, 2048, 3072, 4096):
        bad = bytearray(data)
        bad[start:start + 2048] = rng.integers(0, 256, 2048, dtype=np.uint8).tobytes()
        path.write_bytes(bytes(bad))
        try:  # before the fix, offset 2048 raised a raw OSError ("bad global heap collection signature")
            with Dataset(path) as ds:
                ds.frames()
        except DatasetError as e:
            assert str(path) in str(e)


def test_non_finite_data_is_rejected_when_loading(tmp_path):
    src = _write(tmp_path / "ok.h5")
    bad = tmp_path / "nan.h5"
    with Dataset(src) as ds, DatasetWriter(bad, "test/env", 5, 3) as w:
        for i in range(len(ds)):
            ep = ds.episode(i)
            if i == 1:
                ep.state[3, 0] = np.nan
            w.add(ep)
    with pytest.raises(DatasetError, match=r"nan\.h5: episode 1 has NaN/inf in state at steps \[3\]"):
        ChunkData(bad, horizon=4)


# ----- 2. checkpoint replacement interrupted between its two renames ------------------------------

def _tiny_policy(seed: int = 0, **kw):
    torch.manual_seed(seed)
    p = policies.make_policy(PolicyConfig(kind="flow", state_dim=6, action_dim=3, horizon=4, n_exec=2, **kw))
    rng = np.random.default_rng(seed)
    p.fit_normalizer(rng.normal(size=(50, 6)), rng.uniform(-2, 2, size=(50, 3)))
    return p


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_checkpoint_survives_a_crash_between_the_renames(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    v1, v2 = _tiny_policy(0), _tiny_policy(1)
    v1.save(ckpt, extra={"step": 1})
    real_replace, calls = os.replace, []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("simulated crash between the two renames")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(OSError, match="simulated crash"):
        v2.save(ckpt, extra={"step": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    assert not ckpt.exists()
    with pytest.warns(UserWarning, match="interrupted"):
        assert policies.read_checkpoint_meta(ckpt)["extra"]["step"] == 1
    with pytest.warns(UserWarning, match="interrupted"):
        assert _same_weights(policies.load(ckpt), v1)  # before the fix: "not a groundflow checkpoint"
    v2.save(ckpt, extra={"step": 3})  # the next save publishes and drops the fallback
    assert _same_weights(policies.load(ckpt), v2) and not ckpt.with_name("ckpt.old").exists()


# ----- 5. damaged checkpoints ----------------------------------------------------------------------

def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _change_state_dim(ckpt: Path) -> None:
    meta = json.loads((ckpt / "config.json").read_text())
    meta["config"]["state_dim"] = 7
    (ckpt / "config.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage,needles", [
    (lambda c: _truncate(c / "config.json"), ["config.json", "not valid JSON"]),
    (_change_state_dim, ["model.safetensors", "does not fit", "size mismatch"]),
    (lambda c: _truncate(c / "model.safetensors"), ["model.safetensors", "unreadable"]),
    (lambda c: _truncate(c / "model.safetensors", 0.0005), ["model.safetensors", "unreadable"]),
])
def test_damaged_checkpoint_is_one_clear_error(tmp_path, capsys, damage, needles):
    ckpt = tmp_path / "ckpt"
    _tiny_policy().save(ckpt, extra={"env_id": "maniskill/PushCube-v1"})
    damage(ckpt)
    with pytest.raises(CheckpointError) as e:
        policies.load(ckpt)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)
    _one_line_error(capsys, ["eval", "--ckpt", str(ckpt), "--episodes", "1"], str(ckpt), *needles)


# ----- 3 and 5. training state: no code execution, damaged files, divergence ----------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    data = _write(d / "tiny.h5", n=4)
    kw = dict(data=(data,), batch_size=8, wandb="disabled", progress=False, save_every=2, horizon=4, n_exec=2)
    train(TrainArgs(steps=2, out=d / "run", **kw))
    return d, kw


def test_same_seed_same_weights_and_the_thread_count_is_recorded(tiny_run, tmp_path):
    from safetensors.torch import load_file
    d, kw = tiny_run
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        s = train(TrainArgs(steps=2, seed=seed, out=tmp_path / name, **kw))
        assert s["torch_threads"] == torch.get_num_threads()
        runs[name] = load_file(tmp_path / name / "ckpt" / "model.safetensors")
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert not all(torch.equal(runs["a"][k], runs["c"][k]) for k in runs["a"])  # the seed matters
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["torch_threads"] == torch.get_num_threads()


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


def test_resume_loads_without_running_code(tiny_run, tmp_path):
    d, kw = tiny_run
    out = tmp_path / "run"
    import shutil
    shutil.copytree(d / "run", out)
    assert train(TrainArgs(steps=3, out=out, resume=True, **kw))["steps"] == 3  # a real state still resumes
    st = torch.load(out / "train_state.pt", weights_only=True)
    marker = tmp_path / "pwned"
    st["history"].append(_Payload(marker))
    torch.save(st, out / "train_state.pt")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        train(TrainArgs(steps=4, out=out, resume=True, **kw))
    assert not marker.exists()  # before the fix the payload ran


def test_truncated_train_state_is_one_clear_error(tiny_run, tmp_path, capsys):
    d, kw = tiny_run
    out = tmp_path / "run"
    import shutil
    shutil.copytree(d / "run", out)
    _truncate(out / "train_state.pt", 0.6)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        train(TrainArgs(steps=4, out=out, resume=True, **kw))
    _one_line_error(capsys, ["train", "--data", str(kw["data"][0]), "--out", str(out), "--resume", "--steps", "4",
                             "--horizon", "4", "--n-exec", "2", "--batch-size", "8", "--wandb", "disabled",
                             "--no-progress"], "train_state.pt", "truncated or corrupt")


def test_divergence_says_whether_a_checkpoint_exists(tiny_run, tmp_path, capsys):
    d, kw = tiny_run
    with pytest.raises(TrainingDivergedError, match="no checkpoint was written") as e:
        train(TrainArgs(steps=3, lr=1e30, warmup_steps=1, out=tmp_path / "div", **kw))
    assert isinstance(e.value, FloatingPointError) and "kept" not in str(e.value)
    assert not (tmp_path / "div" / "ckpt").exists()
    _one_line_error(capsys, ["train", "--data", str(kw["data"][0]), "--out", str(tmp_path / "div2"), "--steps", "3",
                             "--lr", "1e30", "--warmup-steps", "1", "--horizon", "4", "--n-exec", "2",
                             "--batch-size", "8", "--wandb", "disabled", "--no-progress"], "non-finite loss")


def test_cli_names_damaged_datasets(tmp_path, capsys):
    path = _write(tmp_path / "d.h5")
    with h5py.File(path, "r+") as f:
        del f.attrs["env_id"]
    _one_line_error(capsys, ["train", "--data", str(path), "--steps", "1", "--out", str(tmp_path / "r")],
                    str(path), "env_id")
    path = _write(tmp_path / "f.h5")
    _flip_byte(path, "episodes/000002/action")
    _one_line_error(capsys, ["train", "--data", str(path), "--steps", "1", "--out", str(tmp_path / "r")],
                    str(path), "episode 000002", "checksum")
