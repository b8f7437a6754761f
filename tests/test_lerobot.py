"""LeRobotDataset read and write (#45): the fixture in tests/data/lerobot_v30 was written by the lerobot
package's own writer (scripts/lerobot_check.py, `make lerobot-check`, which also loads our exports with
lerobot's reader); here groundflow reads it, round-trips its own exports (v3.0 and v2.1), refuses bad
input in one line without writing anything, and trains from a ``lerobot:`` path."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dataset import DatasetError, DatasetWriter, Episode, open_dataset, write_lerobot
from dataset.lerobot import LeRobotExport, LeRobotReader
from envs.errors import InvalidOptionError
from groundflow.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "lerobot_v30"
IMAGE_TOLERANCE = 12.0  # mean |decoded - original| per frame (0-255): lossy AV1 of 32x32 frames


@pytest.fixture(scope="module")
def check():
    """scripts/lerobot_check.py (numpy only at import): fixture_episodes() is what lerobot wrote."""
    spec = importlib.util.spec_from_file_location("lerobot_check", ROOT / "scripts" / "lerobot_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _close(decoded: np.ndarray, original: np.ndarray) -> bool:
    return decoded.shape == original.shape and \
        np.abs(decoded.astype(float) - original.astype(float)).mean(axis=(1, 2, 3)).max() <= IMAGE_TOLERANCE


def _h5(path: Path, episodes: list[dict], meta: dict | None = None) -> Path:
    """The fixture's episodes as a groundflow HDF5 dataset (what `groundflow collect` writes)."""
    with DatasetWriter(path, "test/lerobot", 6, 4, cameras=("front", "wrist", "top"),
                       meta=meta if meta is not None else {"fps": 10, "state_layout": [["qpos", 4], ["grip", 2]]}) as w:
        for e, ep in enumerate(episodes):
            w.add(Episode(state=ep["state"], action=ep["action"], reward=ep["reward"], success=ep["success"],
                          instruction=ep["task"], task_id=7 + e, seed=100 + e, images=ep["images"]))
    return path


def test_reads_the_dataset_lerobot_wrote(check):
    want = check.fixture_episodes()
    assert sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file()) < 300_000
    with open_dataset(f"lerobot:{FIXTURE}") as ds:
        assert isinstance(ds, LeRobotReader) and ds.version == "v3.0" and len(ds) == 3
        assert ds.cameras == ("front", "wrist", "top") and (ds.state_dim, ds.action_dim) == (6, 4)
        assert ds.meta["fps"] == 10 and ds.env_id == "lerobot/groundflow-test"
        assert ds.instructions == sorted(set(check.TASKS))
        for i, (ep, w) in enumerate(zip(ds, want)):
            assert len(ep) == 10 and ep.instruction == w["task"] and ep.task_id == i % 2  # (task_index)
            np.testing.assert_array_equal(ep.state, w["state"])
            np.testing.assert_array_equal(ep.action, w["action"])
            np.testing.assert_array_equal(ep.reward, w["reward"])
            np.testing.assert_array_equal(ep.success, w["success"])
            for cam in ("front", "wrist"):  # video (lossy)
                assert ep.images[cam].dtype == np.uint8 and _close(ep.images[cam], w["images"][cam]), cam
            np.testing.assert_array_equal(ep.images["top"], w["images"]["top"])  # an image feature: PNG, exact
        table = ds.frames()
        assert table["action"].shape == (30, 4)
        assert np.flatnonzero(np.diff(table["episode_index"])).tolist() == [9, 19]  # episode boundaries
        assert table["frame_index"][:12].tolist() == [*range(10), 0, 1]


def test_feature_mapping_in_the_path(check):
    spec = (f"lerobot:{FIXTURE}?state=observation.state,next.reward&camera.main=observation.images.front"
            "&success=next.success")
    with open_dataset(spec) as ds:
        assert ds.cameras == ("main",) and ds.state_dim == 7
        ep = ds.episode(1)
        np.testing.assert_array_equal(ep.state[:, 6], check.fixture_episodes()[1]["reward"])
        assert list(ep.images) == ["main"]
    with open_dataset(f"lerobot:{FIXTURE}?cameras=none") as ds:
        assert ds.cameras == () and ds.episode(0).images is None
    with pytest.raises(InvalidOptionError, match="unknown mapping key 'statee'"):
        open_dataset(f"lerobot:{FIXTURE}?statee=observation.state")


@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
def test_export_round_trip(tmp_path, check, version):
    eps = check.fixture_episodes()
    out = write_lerobot([_h5(tmp_path / "d.h5", eps)], tmp_path / "lr", LeRobotExport(version=version))
    assert not (tmp_path / "lr.partial").exists()
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["codebase_version"] == version and info["fps"] == 10 and info["total_frames"] == 30
    assert info["features"]["observation.state"]["names"] == [*(f"qpos.{j}" for j in range(4)), "grip.0", "grip.1"]
    with open_dataset(f"lerobot:{out}") as ds:
        assert ds.version == version and ds.env_id == "test/lerobot" and ds.meta["fps"] == 10
        assert ds.meta["state_layout"] == [["qpos", 4], ["grip", 2]] and ds.cameras == ("front", "wrist", "top")
        for e, (ep, w) in enumerate(zip(ds, eps)):
            assert (ep.instruction, ep.task_id, ep.seed) == (w["task"], 7 + e, 100 + e)
            for k in ("state", "action", "reward", "success"):
                np.testing.assert_array_equal(getattr(ep, k), w[k])
            assert all(_close(ep.images[c], w["images"][c]) for c in ("front", "wrist", "top"))


def test_export_of_a_deployed_recording_takes_its_control_rate(tmp_path):
    from deploy.recording import Recorder
    from deploy.robots.base import RobotSpec
    spec = RobotSpec(name="arm", state_dim=3, action_dim=2, action_low=-np.ones(2), action_high=np.ones(2),
                     absolute=np.zeros(2, bool), control_rate_hz=15.0)
    rec = Recorder(tmp_path / "rec.h5", spec)
    for e in range(2):
        rec.start_episode(f"wave {e}")
        for t in range(4):
            rec.add({"state": np.full(3, t + e, np.float32)}, np.full(2, 0.1 * t, np.float32))
        rec.end_episode()
    rec.close()
    out = write_lerobot([tmp_path / "rec.h5"], tmp_path / "lr", LeRobotExport(codec="h264"))
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["fps"] == 15 and info["robot_type"] == "arm" and info["video_path"] is None
    with open_dataset(f"lerobot:{out}") as ds:
        assert [ep.instruction for ep in ds] == ["wave 0", "wave 1"] and ds.episode(1).state[2, 0] == 3


def _damage(tmp_path: Path, how: str) -> tuple[str, str, list[str]]:
    """A copy of the fixture damaged ``how``: (data path, what the error must say, extra train flags)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    root = tmp_path / "bad"
    shutil.copytree(FIXTURE, root)
    data = root / "data" / "chunk-000" / "file-000.parquet"
    if how == "no_info":
        (root / "meta" / "info.json").unlink()
        return f"lerobot:{root}", "meta/info.json is missing", []
    if how == "version":
        info = json.loads((root / "meta" / "info.json").read_text())
        (root / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v1.6"}))
        return f"lerobot:{root}", "codebase_version 'v1.6' is not supported", []
    if how == "absent_feature":
        return f"lerobot:{root}?state=observation.joints", "feature 'observation.joints' (state in the mapping)", []
    t = pq.read_table(data)
    if how == "dims":  # episode 1's states lose a dimension
        rows = [r if i // 10 != 1 else r[:5] for i, r in enumerate(t.column("observation.state").to_pylist())]
        t = t.set_column(0, "observation.state", pa.array(rows, pa.list_(pa.float32())))
        pq.write_table(t, data)
        return f"lerobot:{root}", "episode 1 has observation.state of dimension 5", []
    if how == "episode_index":  # the parquet's episode 1 rows claim episode 2
        ep = t.column("episode_index").to_numpy().copy()
        ep[10:20] = 2
        pq.write_table(t.set_column(t.column_names.index("episode_index"), "episode_index", pa.array(ep)), data)
        return f"lerobot:{root}", "metadata and parquet disagree", []
    video = root / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    if how == "truncated_video":
        video.write_bytes(video.read_bytes()[: video.stat().st_size // 2])
    else:  # corrupt: its header overwritten
        b = bytearray(video.read_bytes())
        b[:64] = bytes(64)
        video.write_bytes(bytes(b))
    return f"lerobot:{root}", str(video), ["--cameras", "front", "--image-size", "32"]


BAD = ["no_info", "version", "absent_feature", "dims", "episode_index", "truncated_video", "corrupt_video"]


@pytest.mark.parametrize("how", BAD)
def test_bad_dataset_is_one_line_and_writes_nothing(tmp_path, capsys, how):
    spec, msg, flags = _damage(tmp_path, how)
    out = tmp_path / "run"
    argv = ["train", "--data", spec, "--out", str(out), "--steps", "1", "--wandb", "disabled", "--no-progress", *flags]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("groundflow train: error: ") and msg in err, err
    assert str(tmp_path / "bad") in err  # names the dataset or the file in it
    assert not out.exists()
    lr = tmp_path / "lr"  # export is refused too, before writing anything (the source here is not HDF5)
    assert main(["export", "--data", spec, "--out", str(lr), "--fps", "10"]) == 1
    assert not lr.exists() and not (tmp_path / "lr.partial").exists()


def test_bad_export_sources_write_nothing(tmp_path, check, capsys):
    eps = check.fixture_episodes()
    good = _h5(tmp_path / "a.h5", eps[:1])
    with DatasetWriter(tmp_path / "b.h5", "test/lerobot", 5, 4, cameras=("front", "wrist", "top"),
                       meta={"fps": 10}) as w:
        ep = eps[0]
        w.add(Episode(state=ep["state"][:, :5], action=ep["action"], reward=ep["reward"], success=ep["success"],
                      instruction="x", images=ep["images"]))
    no_rate = _h5(tmp_path / "c.h5", eps[:1], meta={})
    out = tmp_path / "lr"
    for argv, msg in ((["--data", str(good), str(tmp_path / "b.h5")], "differ from"),
                      (["--data", str(no_rate)], "give --fps"),
                      (["--data", str(tmp_path / "missing.h5")], "does not exist")):
        assert main(["export", "--format", "lerobot", *argv, "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and msg in err, err
        assert not out.exists() and not (tmp_path / "lr.partial").exists()
    with pytest.raises(DatasetError):  # and the reader refuses a folder that is not a dataset
        open_dataset(f"lerobot:{tmp_path}")


def test_train_from_an_exported_collection(tmp_path, check, capsys):
    """Collected demos -> `groundflow export --format lerobot` -> `groundflow train --data lerobot:DIR`."""
    h5 = _h5(tmp_path / "demos.h5", check.fixture_episodes())
    lr = tmp_path / "lerobot"
    assert main(["export", "--format", "lerobot", "--data", str(h5), "--out", str(lr)]) == 0
    out = tmp_path / "run"
    assert main(["train", "--data", f"lerobot:{lr}", "--out", str(out), "--steps", "3", "--batch-size", "8",
                 "--horizon", "4", "--n-exec", "2", "--size", "tiny", "--cameras", "front", "--image-size", "32",
                 "--warmup-steps", "1", "--wandb", "disabled", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[printed.index("{"):])  # (after export's one line: train's summary)
    assert summary["steps"] == 3 and Path(summary["ckpt"]).is_dir()


def test_v30_files_roll_over_and_read_back(tmp_path, check, monkeypatch):
    """Past LeRobot's file size limits (100 MB data, 200 MB video) an export starts new files; here the
    limits are 0, so every episode gets its own data and video files."""
    import dataset.lerobot as lr
    monkeypatch.setattr(lr, "DATA_FILE_MB", 0)
    monkeypatch.setattr(lr, "VIDEO_FILE_MB", 0)
    eps = check.fixture_episodes()
    out = write_lerobot([_h5(tmp_path / "d.h5", eps)], tmp_path / "lr")
    assert len(list((out / "data").rglob("*.parquet"))) == 3
    assert len(list((out / "videos" / "observation.images.front").rglob("*.mp4"))) == 3
    with open_dataset(f"lerobot:{out}") as ds:
        for ep, w in zip(ds, eps):
            np.testing.assert_array_equal(ep.action, w["action"])
            assert _close(ep.images["front"], w["images"]["front"])


def test_v21_layout_errors_name_the_file(tmp_path, check):
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = write_lerobot([_h5(tmp_path / "d.h5", check.fixture_episodes())], tmp_path / "lr",
                        LeRobotExport(version="v2.1"))
    f = out / "data" / "chunk-000" / "episode_000001.parquet"
    t = pq.read_table(f)
    pq.write_table(t.set_column(t.column_names.index("episode_index"), "episode_index", pa.array([0] * t.num_rows)), f)
    with pytest.raises(DatasetError, match=f"{f}: the rows of episode 1 .* carry episode_index \\[0\\]"):
        open_dataset(f"lerobot:{out}")
    (out / "meta" / "episodes.jsonl").unlink()
    with pytest.raises(DatasetError, match="not a v2.1 LeRobotDataset: meta/episodes.jsonl is missing"):
        open_dataset(f"lerobot:{out}")
