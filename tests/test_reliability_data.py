"""Datasets, checkpoints and training state under concurrent writers, crashes, flipped bytes and
crafted or damaged files: each is refused with one clear line naming the file, nothing is corrupted."""

import json
import os
import shutil
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


def _strip(path: Path, *names: str) -> None:
    """Remove attributes ``names`` everywhere in the file: what files written before they existed look like."""
    def strip(obj) -> None:
        for n in names:
            if n in obj.attrs:
                del obj.attrs[n]
    with h5py.File(path, "r+") as f:
        strip(f)
        f.visititems(lambda _, o: strip(o))


def test_files_without_checksums_still_load(tmp_path):
    path = _write(tmp_path / "d.h5")
    _strip(path, "crc32", "layout_sha256")  # written before checksums and layout digests
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
    (_change_state_dim, ["config.json", "fails its digest"]),
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


def _flip_at(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("name", ["model.safetensors", "language.safetensors"])
def test_flipped_checkpoint_bytes_are_refused_naming_the_file(tmp_path, capsys, name):
    """Before the fix 40/40 flips in model.safetensors loaded, with changed weights."""
    ckpt, pristine = tmp_path / "ckpt", tmp_path / "pristine"
    p = _tiny_policy()
    p.lang.cache["push the cube"] = torch.randn(1, 384, generator=torch.Generator().manual_seed(0))
    p.save(pristine, extra={"env_id": "maniskill/PushCube-v1"})
    q = policies.load(pristine)  # an untouched checkpoint loads, unchanged
    assert _same_weights(q, p) and torch.equal(q.lang.cache["push the cube"], p.lang.cache["push the cube"])
    import shutil
    size = (pristine / name).stat().st_size
    for offset in np.linspace(0, size - 1, 40).astype(int):
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(pristine, ckpt)
        _flip_at(ckpt / name, int(offset))
        with pytest.raises(CheckpointError) as e:
            policies.load(ckpt)
        assert str(ckpt / name) in str(e.value) and "\n" not in str(e.value), (offset, str(e.value))
    # a flip inside the tensor data (the header still parses): the checksum names the file, in one CLI line
    _flip_at(ckpt / name, size - 3)
    _one_line_error(capsys, ["eval", "--ckpt", str(ckpt), "--episodes", "1"], str(ckpt / name), "checksum")


def test_checkpoints_saved_without_a_digest_still_load(tmp_path):
    ckpt = tmp_path / "ckpt"
    p = _tiny_policy()
    p.save(ckpt)
    meta = json.loads((ckpt / "config.json").read_text())
    assert set(meta.pop("sha256")) == {"model.safetensors"}
    del meta["config_sha256"]
    meta["version"] = 1
    (ckpt / "config.json").write_text(json.dumps(meta))  # what checkpoints written before digests look like
    assert _same_weights(policies.load(ckpt), p)


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


# ----- 6. bad numeric flags and output paths: one clear line, exit 1 -------------------------------

def test_bad_train_flags_are_one_clear_error_each(tmp_path, capsys):
    data = _write(tmp_path / "d.h5")  # 3 episodes of 10 steps
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    base = ["train", "--data", str(data), "--horizon", "4", "--n-exec", "2", "--batch-size", "8", "--wandb",
            "disabled", "--no-progress"]
    for extra, needles in [
        (["--steps", "-5", "--out", str(tmp_path / "r1")], ["--steps", "-5"]),  # before: trained 0 steps, exit 0
        (["--steps", "0", "--out", str(tmp_path / "r2")], ["--steps", "0"]),
        (["--steps", "2", "--out", str(afile / "run")], ["--out", str(afile), "file"]),  # before: NotADirectoryError
        (["--steps", "2", "--out", str(afile)], ["--out", str(afile), "file"]),
        (["--steps", "2", "--save-every", "0", "--out", str(tmp_path / "r3")], ["--save-every"]),
    ]:
        _one_line_error(capsys, base + extra, *needles)
    assert not (tmp_path / "r1").exists() and afile.read_text() == "not a directory"
    # a chunk longer than every episode (before: trained on padding only; 1e5 hung building the model)
    _one_line_error(capsys, base + ["--steps", "2", "--out", str(tmp_path / "r4"), "--horizon", "100000"],
                    "--horizon", "100000")
    _one_line_error(capsys, base + ["--steps", "2", "--out", str(tmp_path / "r4"), "--horizon", "12"],
                    "--horizon 12", "longest episode", "10 steps", str(data))
    assert not (tmp_path / "r4").exists()


def test_eval_refuses_a_non_positive_episode_count(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"  # fits maniskill/PushCube-v1 (35, 8): before the fix, exit 0 with success 0.0
    p = policies.make_policy(PolicyConfig(kind="flow", state_dim=35, action_dim=8, horizon=4, n_exec=2))
    rng = np.random.default_rng(0)
    p.fit_normalizer(rng.normal(size=(8, 35)), rng.uniform(-1, 1, size=(8, 8)))
    p.save(ckpt, extra={"env_id": "maniskill/PushCube-v1"})
    for n in ("0", "-3"):
        _one_line_error(capsys, ["eval", "--ckpt", str(ckpt), "--episodes", n, "--out", str(tmp_path / "r.json")],
                        "--episodes", n)
    assert not (tmp_path / "r.json").exists()


# ----- 7. Ctrl+C then --resume continues the same run -----------------------------------------------

def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    """Every random state the loop draws from comes back on --resume: the batch generator (indices,
    flow times and noise, instruction drops), torch's global generator (dropout, image shift and
    jitter) and numpy's and Python's global generators (here an augmentation drawing from both)."""
    import random
    data = tmp_path / "img.h5"
    with DatasetWriter(data, "test/env", 5, 3, cameras=("cam",)) as w:
        for i in range(3):
            ep = _episode(seed=i)
            ep.images = {"cam": np.random.default_rng(i).integers(0, 255, (10, 32, 32, 3), dtype=np.uint8)}
            w.add(ep)
    init = tmp_path / "init"  # a checkpoint with dropout, continued with --from (the CIG stage's path)
    p = policies.make_policy(PolicyConfig(kind="flow", state_dim=5, action_dim=3, horizon=4, n_exec=2, dropout=0.2,
                                          cameras=("cam",), image_size=32, image_shift=2, image_jitter=0.3))
    eps = [_episode(seed=i) for i in range(3)]
    p.fit_normalizer(np.concatenate([e.state for e in eps]), np.concatenate([e.action for e in eps]))
    p.save(init)
    batch = ChunkData.batch

    def augmented(self, idx):  # draws from numpy's and Python's global generators
        out = batch(self, idx)
        noise = np.random.standard_normal(out["state"].shape) + 10 * random.random()
        out["state"] = out["state"] + noise.astype(np.float32)
        return out

    monkeypatch.setattr(ChunkData, "batch", augmented)
    kw = dict(data=(data,), batch_size=8, wandb="disabled", progress=False, save_every=3, horizon=4, n_exec=2,
              cameras=("cam",), image_size=32, instruction_dropout=0.3, init_from=init, steps=8)
    full = train(TrainArgs(out=tmp_path / "full", **kw))

    def ctrl_c_at(n):
        def on_step(step):
            if step == n:
                raise KeyboardInterrupt
        return on_step

    with pytest.raises(KeyboardInterrupt):  # after step 5: the state on disk is step 3's
        train(TrainArgs(out=tmp_path / "cut", **kw), on_step=ctrl_c_at(5))
    assert torch.load(tmp_path / "cut" / "train_state.pt", weights_only=True)["step"] == 3
    resumed = train(TrainArgs(out=tmp_path / "cut", resume=True, **kw))
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in full["history"]]  # before: differed at 4
    a = torch.load(tmp_path / "full" / "train_state.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "train_state.pt", weights_only=True)
    for part in ("model", "ema"):
        assert a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert _same_weights(policies.load(tmp_path / "full" / "ckpt"), policies.load(tmp_path / "cut" / "ckpt"))


def _same_tree(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_flipped_train_state_bytes_never_load_changed(tiny_run, tmp_path, capsys):
    """Before the fix 29/40 flips in train_state.pt loaded, with a changed state. Now each is
    refused naming the file, or (a byte the state does not depend on) loads exactly what was saved."""
    import shutil

    from train.bc import _load_train_state
    d, kw = tiny_run
    src = d / "run" / "train_state.pt"
    saved = torch.load(src, weights_only=True)
    saved.pop("sha256", None)
    raw = src.read_bytes()
    path = tmp_path / "train_state.pt"
    changed = []
    for offset in np.linspace(0, len(raw) - 1, 40).astype(int):
        path.write_bytes(raw)
        _flip_at(path, int(offset))
        try:
            st = _load_train_state(path, torch.device("cpu"))
        except CheckpointError as e:
            assert str(path) in str(e) and "\n" not in str(e), str(e)
            continue
        if not _same_tree(st, saved):
            changed.append(int(offset))
    assert not changed, f"flips at {changed} loaded a changed training state"
    # through `groundflow train --resume`: a flip inside a weight tensor's bytes is one line naming the file
    out = tmp_path / "run"
    shutil.copytree(d / "run", out)
    weight = max(saved["model"].values(), key=lambda t: t.numel()).contiguous().numpy().tobytes()
    _flip_at(out / "train_state.pt", raw.index(weight) + len(weight) // 2)
    _one_line_error(capsys, ["train", "--data", str(kw["data"][0]), "--out", str(out), "--resume", "--steps", "4",
                             "--horizon", "4", "--n-exec", "2", "--batch-size", "8", "--save-every", "2",
                             "--wandb", "disabled", "--no-progress"], str(out / "train_state.pt"), "checksum")


def test_train_states_saved_before_digests_and_random_states_still_resume(tiny_run, tmp_path):
    import shutil
    d, kw = tiny_run
    out = tmp_path / "run"
    shutil.copytree(d / "run", out)
    st = torch.load(out / "train_state.pt", weights_only=True)
    del st["sha256"], st["rng"]  # what train_state.pt looked like before
    torch.save(st, out / "train_state.pt")
    with pytest.warns(UserWarning, match="random states"):
        assert train(TrainArgs(steps=3, out=out, resume=True, **kw))["steps"] == 3


def test_bad_serve_and_deploy_flags_are_one_clear_error_each(capsys):
    """Before: `serve --port 99999` ended in an OverflowError traceback from bind(), `--max-message-mb -1`
    served with a negative limit, and `deploy --rate 0` went on to connect (and would divide by zero)."""
    scripted = ["serve", "--scripted", "joint_target", "--state-dim", "3", "--action-dim", "2", "--target", "0", "0"]
    for argv, needles in [
        (scripted + ["--port", "99999"], ["--port", "99999"]),
        (scripted + ["--max-message-mb", "-1"], ["--max-message-mb", "-1"]),
        (scripted + ["--max-connections", "0"], ["--max-connections"]),
        (["deploy", "--robot", "sim", "--rate", "0"], ["--rate", "0"]),
        (["deploy", "--robot", "sim", "--timeout", "-1"], ["--timeout"]),
        (["deploy", "--robot", "sim", "--max-steps", "0"], ["--max-steps"]),
    ]:
        _one_line_error(capsys, argv, *needles)


# ----- 8. disk full (#46 item 7): one clear line naming the file and the space left, no stray .tmp --------

def _file_size_limit(limit: int):
    """preexec_fn: writes past ``limit`` bytes fail with EFBIG (SIGXFSZ ignored), as a full disk fails them."""
    def pre():
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def _gf(argv: list[str], limit: int | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "groundflow.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          preexec_fn=None if limit is None else _file_size_limit(limit))


def _one_cli_line(r: subprocess.CompletedProcess, cmd: str, *needles: str) -> str:
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"groundflow {cmd}: error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _stray(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.name.endswith((".tmp", ".lock", ".old")))


def _check_partial(partial: Path, line: str) -> None:
    """A .partial left behind is named by the error and holds readable, checksummed episodes."""
    if partial.exists():
        assert str(partial) in line, line
        with Dataset(partial, allow_incomplete=True) as ds:
            assert len(ds) >= 1
            for ep in ds:
                assert len(ep) > 0
    else:
        assert ".partial" not in line, line


def test_collect_past_the_file_size_limit(tmp_path):
    """Before the fix: a traceback from h5py (or a segfault in its flush) and a .lock left behind."""
    path = _write(tmp_path / "d.h5", n=3)  # published before: --overwrite must not lose it when the new run fails
    before = path.read_bytes()
    r = _gf(["collect", "--env", "adroit/door", "--episodes", "40", "--out", str(path), "--overwrite",
             "--no-progress"], limit=800_000)
    line = _one_cli_line(r, "collect", "d.h5", "file size limit")
    assert path.read_bytes() == before and not _stray(tmp_path), _stray(tmp_path)
    _check_partial(path.with_name("d.h5.partial"), line)


def test_train_checkpoint_past_the_file_size_limit(tmp_path):
    """Before the fix: a RuntimeError traceback from torch ("unexpected pos ...") and train_state.pt.tmp left."""
    data = _write(tmp_path / "d.h5", n=4)
    out = tmp_path / "run"
    base = ["train", "--data", str(data), "--out", str(out), "--horizon", "4", "--n-exec", "2", "--batch-size", "8",
            "--save-every", "2", "--wandb", "disabled", "--no-progress"]
    train(TrainArgs(data=(data,), out=out, steps=2, save_every=2, horizon=4, n_exec=2, batch_size=8,
                    wandb="disabled", progress=False))
    state = (out / "train_state.pt").read_bytes()
    assert len(state) > 1_000_000 > (out / "ckpt" / "model.safetensors").stat().st_size
    r = _gf(base + ["--steps", "4", "--resume"], limit=1_000_000)  # the checkpoint fits, the training state does not
    _one_cli_line(r, "train", str(out / "train_state.pt"), "file size limit", "--resume")
    assert (out / "train_state.pt").read_bytes() == state and not _stray(out), _stray(out)
    assert policies.read_checkpoint_meta(out / "ckpt")["extra"]["step"] == 4
    policies.load(out / "ckpt")


def test_checkpoint_save_failure_removes_its_tmp_folder(tmp_path, monkeypatch):
    import safetensors.torch
    ckpt = tmp_path / "ckpt"
    v1 = _tiny_policy(0)
    v1.save(ckpt, extra={"step": 1})

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match="No space left"):
        _tiny_policy(1).save(ckpt, extra={"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert _same_weights(policies.load(ckpt), v1)


def test_dataset_writer_stops_before_the_disk_is_full(tmp_path, monkeypatch):
    """What collect and deploy recording share: an episode that does not fit is refused before HDF5
    writes any of it (HDF5 crashed in its flush on a full disk), naming the file and the space left;
    the episodes written before stay readable in the .partial the message names."""
    import shutil
    from collections import namedtuple

    from dataset import DiskFullError
    path = tmp_path / "d.h5"
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode(seed=0))
    w.add(_episode(seed=1))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10_000_000, 9_990_000, 10_000))
    with pytest.raises(DiskFullError) as e:
        w.add(_episode(seed=2))
    msg = str(e.value)
    assert "\n" not in msg and str(path.with_name("d.h5.partial")) in msg and "10.0 kB free" in msg, msg
    assert "2 episodes" in msg, msg
    w.abort()
    monkeypatch.undo()
    assert len(Dataset(path.with_name("d.h5.partial"), allow_incomplete=True)) == 2
    assert not path.exists() and not path.with_name("d.h5.lock").exists()


def test_deploy_recording_on_a_full_disk_keeps_the_recorded_episodes(tmp_path, monkeypatch):
    """Deploy recording writes through the same DatasetWriter: the robot episodes recorded before the disk
    filled stay readable in the .partial the one-line error names."""
    import shutil
    from collections import namedtuple

    from dataset import DiskFullError
    from deploy.recording import Recorder
    from deploy.robots.base import RobotSpec
    spec = RobotSpec(name="arm", state_dim=5, action_dim=3, action_low=-np.ones(3), action_high=np.ones(3),
                     absolute=np.zeros(3, bool), control_rate_hz=10.0)
    rec = Recorder(tmp_path / "rec.h5", spec, env_id="test/env")

    def episode(seed):
        ep = _episode(seed=seed)
        rec.start_episode(ep.instruction, seed=seed)
        for t in range(len(ep)):
            rec.add({"state": ep.state[t]}, ep.action[t])
        return rec.end_episode({"state": ep.final_state})

    assert episode(0) and episode(1)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10_000_000, 9_950_000, 50_000))
    with pytest.raises(DiskFullError) as e:
        episode(2)
    rec.abort()  # what `groundflow deploy` does on any error
    monkeypatch.undo()
    partial = tmp_path / "rec.h5.partial"
    assert str(partial) in str(e.value) and "2 episodes" in str(e.value) and "\n" not in str(e.value)
    assert len(Dataset(partial, allow_incomplete=True)) == 2 and not (tmp_path / "rec.h5").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MB tmpfs (needs root and a kernel that lets this container mount; skipped otherwise)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_on_a_real_tmpfs(tmp_path, small_disk):
    """ENOSPC from the kernel: collect and train checkpoint saving each end in one line naming the file
    and the space left, with no .tmp left and every file published before intact."""
    kept = _write(small_disk / "kept.h5", n=3)
    kept_bytes = kept.read_bytes()
    path = small_disk / "d.h5"
    r = _gf(["collect", "--env", "adroit/door", "--episodes", "200", "--out", str(path), "--no-progress"])
    line = _one_cli_line(r, "collect", str(small_disk), "free")
    assert kept.read_bytes() == kept_bytes and not path.exists() and not _stray(small_disk), _stray(small_disk)
    _check_partial(path.with_name("d.h5.partial"), line)
    for p in small_disk.iterdir():
        if p.is_dir():
            shutil.rmtree(p)  # (d.h5.episodes/, the journal of the kept episodes)
        elif p != kept:
            p.unlink()
    data = _write(tmp_path / "t.h5", n=4)
    out = small_disk / "run"  # the first save (2.9 MB) fits, the second cannot be written beside it
    r = _gf(["train", "--data", str(data), "--out", str(out), "--horizon", "4", "--n-exec", "2", "--batch-size", "8",
             "--steps", "4", "--save-every", "2", "--wandb", "disabled", "--no-progress"])
    _one_cli_line(r, "train", str(out), "free")
    assert not _stray(small_disk) and kept.read_bytes() == kept_bytes, _stray(small_disk)
    assert torch.load(out / "train_state.pt", weights_only=True)["step"] in (2, 4)
    policies.load(out / "ckpt")


# ----- 9. a killed collect (#46 item 3): no flushed episode lost, a re-run hint that tells the truth ----

KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, "tests")
from test_reliability_data import _episode
from dataset import DatasetWriter
w = DatasetWriter(sys.argv[1], "test/env", 5, 3)
for i in range(int(sys.argv[2])):
    w.add(_episode(seed=i))  # acknowledged: add() returned
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_writer(path: Path, n: int) -> None:
    r = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path), str(n)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == -9, r.stderr[-2000:]


def _same_as_written(ds: Dataset, n: int) -> None:
    assert len(ds) == n and ds.env_id == "test/env" and (ds.state_dim, ds.action_dim) == (5, 3)
    for i in range(n):
        got, want = ds.episode(i), _episode(seed=i)
        for f in ("state", "action", "reward", "success", "sim_state", "final_state"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
        assert (got.instruction, got.task_id, got.seed) == (want.instruction, want.task_id, want.seed)


def test_a_kill_that_leaves_the_partial_unreadable_loses_no_flushed_episode(tmp_path, capsys):
    """HDF5 is not crash-safe: a SIGKILL during its metadata writes left the whole .partial unreadable
    (5 of 100 killed `collect` runs, flushed episodes lost in 1 of them) while the re-run said 'its
    episodes are readable'. Before the fix, a .partial damaged like that lost all 3 acknowledged episodes."""
    path = tmp_path / "d.h5"
    partial = path.with_name("d.h5.partial")
    _killed_writer(path, 3)
    _truncate(partial, 0.4)  # what a kill in the middle of HDF5's metadata writes leaves: an unreadable file
    with pytest.raises(DatasetError):
        Dataset(partial)  # (not complete, and damaged anyway)
    for name in (partial, path):  # the documented recovery, by either name while d.h5 does not exist
        with Dataset(name, allow_incomplete=True) as ds:
            _same_as_written(ds, 3)
    with pytest.raises(FileExistsError, match=r"d\.h5\.partial exists: .* 3 episodes it wrote are recoverable: "
                                              r"Dataset\(.*d\.h5\.partial', allow_incomplete=True\) reads them"):
        DatasetWriter(path, "test/env", 5, 3)
    _one_line_error(capsys, ["collect", "--env", "adroit/door", "--episodes", "1", "--out", str(path), "--no-progress"],
                    "d.h5.partial exists", "3 episodes it wrote are recoverable", "--overwrite")
    _write(path, n=2, overwrite=True)  # discards the killed run's .partial and journal
    assert len(Dataset(path)) == 2 and not partial.exists() and not path.with_name("d.h5.episodes").exists()


def test_an_episode_journaled_before_the_kill_is_recovered(tmp_path):
    """Killed after an episode reached the journal but before it was copied into the .partial: the
    recovery holds it too (and the .partial's own episodes stay consistent)."""
    path = tmp_path / "d.h5"
    code = KILLED_WRITER.replace("for i in range(int(sys.argv[2])):", "import h5py\nfor i in range(3):\n"
                                 "    if i == 2:  # killed while copying it from the journal into the .partial\n"
                                 "        h5py.Group.copy = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == -9, r.stderr[-2000:]
    with Dataset(path.with_name("d.h5.partial"), allow_incomplete=True) as ds:
        _same_as_written(ds, 3)
    with h5py.File(path.with_name("d.h5.partial"), "r") as f:
        assert sorted(f["episodes"]) == ["000000", "000001"]


def test_the_rerun_hint_says_what_is_recoverable(tmp_path):
    """Before the fix the hint said 'its episodes are readable' whatever the .partial held."""
    path = tmp_path / "a.h5"  # killed before its first episode
    _killed_writer(path, 0)
    with pytest.raises(FileExistsError, match="no episode it wrote is recoverable"):
        DatasetWriter(path, "test/env", 5, 3)
    path = tmp_path / "b.h5"  # a .partial without a journal (an older writer's), damaged by the kill
    _killed_writer(path, 2)
    shutil.rmtree(path.with_name("b.h5.episodes"), ignore_errors=True)
    intact = path.with_name("b.h5.partial").read_bytes()
    with pytest.raises(FileExistsError, match="2 episodes it wrote are recoverable"):
        DatasetWriter(path, "test/env", 5, 3)
    _truncate(path.with_name("b.h5.partial"), 0.4)
    with pytest.raises(FileExistsError, match=r"no episode in it is recoverable \(.*b\.h5\.partial"):
        DatasetWriter(path, "test/env", 5, 3)
    path.with_name("b.h5.partial").write_bytes(intact)
    with Dataset(path.with_name("b.h5.partial"), allow_incomplete=True) as ds:
        _same_as_written(ds, 2)


def test_a_published_dataset_leaves_no_journal(tmp_path):
    path = tmp_path / "d.h5"
    w = DatasetWriter(path, "test/env", 5, 3)
    w.add(_episode(seed=0))
    journal = path.with_name("d.h5.episodes")
    assert sorted(p.name for p in journal.iterdir()) == ["000000.h5", "header.json"]  # no .tmp: renamed when whole
    w.close()
    assert not journal.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["d.h5"]
    with Dataset(path) as ds:
        _same_as_written(ds, 1)


@pytest.mark.slow
def test_killed_collect_runs_lose_no_flushed_episode(tmp_path):
    """20 real `groundflow collect` runs SIGKILLed at random moments (benchmarks/reliability.py
    dataset_stale_partial does 200): every episode its progress bar counted reads back, and the re-run's
    hint names exactly how many."""
    import re
    import signal
    import time
    rng = np.random.default_rng(0)
    for i in range(20):
        path = tmp_path / f"d{i}.h5"
        partial = path.with_name(path.name + ".partial")
        proc = subprocess.Popen([sys.executable, "-m", "groundflow.cli", "collect", "--env", "adroit/door",
                                 "--episodes", "5000", "--out", str(path), "--seed", str(i)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "0",
                                     "TQDM_MINITERS": "1"})
        kill_at, deadline = rng.uniform(0.05e6, 1.2e6), time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if partial.exists() and partial.stat().st_size >= kill_at:
                break
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        flushed = max((int(m) for m in re.findall(r"\| *(\d+)/5000", err)), default=0)
        with Dataset(partial, allow_incomplete=True) as ds:
            n = len(ds)
            for j in range(n):
                ds.episode(j)
        assert n >= flushed, (i, n, flushed)
        with pytest.raises(FileExistsError) as e:
            DatasetWriter(path, "x", 1, 1)
        said = re.search(r"(\d+|no) episodes? (?:it wrote|in it) (?:is|are) recoverable", str(e.value))
        assert said and int(said.group(1).replace("no", "0")) == n, str(e.value)


# ----- 10. metadata flips (#46 item 4): a layout digest, one error type, absurd values refused ------

FLOAT32_MESSAGE = bytes.fromhex("11201f00040000000000200017080017")  # HDF5 datatype message: IEEE float32 LE


def _flip_bit(path: Path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def _flip_state_to_uint32(path: Path) -> None:
    """One bit (float -> fixed-point class) turning episode 0's state from float32 to uint32: its bytes,
    and so its crc32, unchanged."""
    clean = path.read_bytes()
    at = clean.find(FLOAT32_MESSAGE)
    while at >= 0:
        _flip_bit(path, at, 0)
        with h5py.File(path, "r") as f:
            if f["episodes/000000/state"].dtype == np.uint32:
                return
        path.write_bytes(clean)
        at = clean.find(FLOAT32_MESSAGE, at + 1)
    raise AssertionError("no float32 datatype message of episode 0's state found")


@pytest.mark.parametrize("digests", [True, False], ids=["digested", "written-before-digests"])
def test_a_dtype_flip_is_refused_not_trained_on(tmp_path, capsys, digests):
    """Before the fix episode 0's state loaded as uint32 (values up to ~3e9) and `train` exited 0."""
    path = _write(tmp_path / "d.h5")
    if not digests:
        _strip(path, "layout_sha256")
    _flip_state_to_uint32(path)
    with pytest.raises(DatasetError, match=r"d\.h5: episode 000000") as e:
        with Dataset(path) as ds:
            ds.episode(0)
    assert "\n" not in str(e.value)
    with pytest.raises(DatasetError, match=r"d\.h5: episode 000000"):
        ChunkData(path, horizon=4)
    _one_line_error(capsys, ["train", "--data", str(path), "--steps", "2", "--out", str(tmp_path / "r"), "--horizon",
                             "4", "--n-exec", "2", "--batch-size", "8", "--wandb", "disabled", "--no-progress"],
                    str(path), "episode 000000")


def test_a_flipped_instruction_is_refused(tmp_path):
    """Before the fix a flipped bit in episode 1's instruction loaded as 'push the bube 1'."""
    path = _write(tmp_path / "d.h5")
    at = path.read_bytes().find(b"push the cube 1")
    _flip_bit(path, at + len("push the "), 0)  # c (0x63) -> b (0x62)
    with h5py.File(path, "r") as f:
        assert f["episodes/000001"].attrs["instruction"] == "push the bube 1"  # HDF5 itself sees nothing wrong
    with Dataset(path) as ds:  # (checked when an episode is read, like its crc32s)
        ds.episode(0)
        for read in (lambda: ds.episode(1), lambda: ds.instructions, ds.frames):
            with pytest.raises(DatasetError, match=r"d\.h5: episode 000001 fails its layout digest"):
                read()
    with pytest.raises(DatasetError, match=r"d\.h5: episode 000001 fails its layout digest"):
        ChunkData(path, horizon=4)


def test_absurd_values_are_refused_by_training(tmp_path):
    """A float32 state of 1e9 has a valid checksum (it was written so); training refuses it anyway."""
    src = _write(tmp_path / "ok.h5")
    bad = tmp_path / "big.h5"
    with Dataset(src) as ds, DatasetWriter(bad, "test/env", 5, 3) as w:
        for i in range(len(ds)):
            ep = ds.episode(i)
            if i == 1:
                ep.state[4, 2] = 3.2e9
            w.add(ep)
    with pytest.raises(DatasetError, match=r"big\.h5: episode 1 has absurd values in state \(\|x\| up to 3\.2e\+09 "
                                           r"> 1e\+06\) at steps \[4\]"):
        ChunkData(bad, horizon=4)


def test_files_without_layout_digests_still_load_and_partial_digests_do_not(tmp_path):
    path = _write(tmp_path / "d.h5")
    _strip(path, "layout_sha256")  # a file written before digests (it has crc32s)
    with Dataset(path) as ds:
        np.testing.assert_array_equal(ds.episode(2).action, _episode(seed=2).action)
    path = _write(tmp_path / "e.h5")
    with h5py.File(path, "r+") as f:  # the digest of one episode gone (a flipped attribute name): not "an old file"
        del f["episodes/000001"].attrs["layout_sha256"]
    with pytest.raises(DatasetError, match=r"e\.h5: its header or episode index fails its layout digest"):
        Dataset(path)


def _raw_data_mask(path: Path) -> np.ndarray:
    """True at the bytes of the file that are array data (covered by the crc32s), False at metadata."""
    mask = np.zeros(path.stat().st_size, bool)

    def visit(_, o):
        if isinstance(o, h5py.Dataset):
            if o.chunks is None:
                if o.id.get_offset() is not None:
                    mask[o.id.get_offset():o.id.get_offset() + o.id.get_storage_size()] = True
            else:
                for i in range(o.id.get_num_chunks()):
                    c = o.id.get_chunk_info(i)
                    mask[c.byte_offset:c.byte_offset + c.size] = True
    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return mask


METADATA_NEEDLES = [b"instruction", b"task_id", b"seed", b"length", b"success", b"state", b"action", b"reward",
                    b"sim_state", b"final_state", b"crc32", b"episodes", b"images", b"cam", b"000000", b"000001",
                    b"000002", b"env_id", b"state_dim", b"action_dim", b"cameras", b"meta", b"complete", b"n_episodes",
                    b"format", b"version", b"layout_sha256", b"push the cube", b"test/env", b"groundflow-dataset",
                    b'{"k": 1}', FLOAT32_MESSAGE, bytes.fromhex("11203f00080000000000400034"),  # float64
                    bytes.fromhex("1008000008000000"), bytes.fromhex("1000000001000000")]  # int64, uint8


def _loaded(path: Path):
    with Dataset(path) as ds:
        return ((ds.env_id, ds.state_dim, ds.action_dim, ds.cameras, ds.meta, ds.instructions),
                [ds.episode(i) for i in range(len(ds))])


def _difference(a, b) -> str | None:
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return f"header {b[0]}"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        if (x.instruction, x.task_id, x.seed) != (y.instruction, y.task_id, y.seed):
            return f"episode {i}: {y.instruction!r} {y.task_id!r} {y.seed!r}"
        for f in ("state", "action", "reward", "success", "sim_state", "final_state", "final_sim_state", "images"):
            u, v = getattr(x, f), getattr(y, f)
            u, v = (u, v) if f != "images" else (u and u["cam"], v and v["cam"])
            if (u is None) != (v is None) or (u is not None and (u.dtype != v.dtype or u.shape != v.shape
                                                                   or not np.array_equal(u, v))):
                return f"episode {i} {f}: {None if v is None else (v.dtype, v.shape)}"
    return None


def test_metadata_bit_flips_load_identical_or_raise_a_dataset_error(tmp_path):
    """300 single-bit flips in the metadata of a small dataset (attribute names and values, datatype
    messages, link names: 60% aimed at those, 40% anywhere outside the array data). Before the fix 1,500
    such flips gave 88 silent changes (a float32 read as big-endian, sim_state gone, an instruction
    changed) and 15 raw RuntimeError/ValueError/TypeError; now every load is identical or one DatasetError
    naming the file."""
    clean = tmp_path / "clean.h5"
    rng = np.random.default_rng(0)
    with DatasetWriter(clean, "test/env", 5, 3, cameras=("cam",), meta={"k": 1}) as w:
        for i in range(3):
            ep = _episode(seed=i)
            ep.images = {"cam": rng.integers(0, 255, (len(ep), 8, 8, 3), dtype=np.uint8)}
            w.add(ep)
    want = _loaded(clean)
    data = clean.read_bytes()
    meta = ~_raw_data_mask(clean)
    aimed = np.zeros(len(data), bool)
    for needle in METADATA_NEEDLES:
        at = data.find(needle)
        while at >= 0:
            aimed[at:at + len(needle)] = True
            at = data.find(needle, at + 1)
    meta, aimed = np.flatnonzero(meta), np.flatnonzero(aimed & meta)
    path = tmp_path / "d.h5"
    wrong = []
    for _ in range(300):
        offset, bit = int(rng.choice(aimed) if rng.random() < 0.6 else rng.choice(meta)), int(rng.integers(8))
        bad = bytearray(data)
        bad[offset] ^= 1 << bit
        path.write_bytes(bytes(bad))
        try:
            diff = _difference(want, _loaded(path))
            if diff is not None:
                wrong.append(f"byte {offset} bit {bit}: loaded changed ({diff})")
        except DatasetError as e:
            if str(path) not in str(e) or "\n" in str(e):
                wrong.append(f"byte {offset} bit {bit}: {e}")
        except Exception as e:  # noqa: BLE001
            wrong.append(f"byte {offset} bit {bit}: raw {type(e).__name__}: {e}")
    assert not wrong, f"{len(wrong)}/300: " + "; ".join(wrong[:5])
