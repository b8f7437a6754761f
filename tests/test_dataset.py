"""Dataset format: round trip, atomic writes, corruption detection, chunked samples."""

import h5py
import numpy as np
import pytest

from train.data import ChunkData
from dataset import Dataset, DatasetError, DatasetWriter, Episode


def _episode(T=12, S=5, A=3, seed=0, instr="push the red cube", images=False):
    rng = np.random.default_rng(seed)
    return Episode(state=rng.normal(size=(T, S)).astype(np.float32), action=rng.normal(size=(T, A)).astype(np.float32),
                   reward=rng.normal(size=T).astype(np.float32), success=np.arange(T) == T - 1, instruction=instr,
                   task_id=seed % 2, seed=seed, sim_state=rng.normal(size=(T, 9)).astype(np.float32),
                   images={"cam": rng.integers(0, 255, (T, 16, 16, 3), dtype=np.uint8)} if images else None,
                   final_state=rng.normal(size=S).astype(np.float32))


def test_round_trip(tmp_path):
    path = tmp_path / "d.h5"
    eps = [_episode(seed=i, images=True) for i in range(3)]
    with DatasetWriter(path, "test/env", 5, 3, cameras=("cam",), meta={"k": 1}) as w:
        for e in eps:
            w.add(e)
    with Dataset(path) as ds:
        assert len(ds) == 3 and ds.meta == {"k": 1} and ds.cameras == ("cam",)
        for a, b in zip(eps, ds):
            np.testing.assert_array_equal(a.state, b.state)
            np.testing.assert_array_equal(a.action, b.action)
            np.testing.assert_array_equal(a.images["cam"], b.images["cam"])
            np.testing.assert_array_equal(a.sim_state, b.sim_state)
            assert a.instruction == b.instruction and a.task_id == b.task_id and a.seed == b.seed
        table = ds.frames()
        assert table["action"].shape == (36, 3) and table["episode_index"].max() == 2


def test_crash_leaves_no_complete_looking_file(tmp_path):
    path = tmp_path / "d.h5"
    with pytest.raises(RuntimeError):
        with DatasetWriter(path, "test/env", 5, 3) as w:
            w.add(_episode(seed=0))
            raise RuntimeError("killed")
    assert not path.exists()
    with pytest.raises(DatasetError, match="unfinished"):
        Dataset(path)
    partial = Dataset(path.with_name("d.h5.partial"), allow_incomplete=True)
    assert len(partial) == 1  # what was written before the crash is kept
    with pytest.raises(DatasetError, match="incomplete"):
        Dataset(path.with_name("d.h5.partial"))


def test_corruption_is_detected(tmp_path):
    path = tmp_path / "d.h5"
    with DatasetWriter(path, "test/env", 5, 3) as w:
        w.add(_episode())
    data = path.read_bytes()
    trunc = tmp_path / "t.h5"
    trunc.write_bytes(data[: len(data) // 3])
    with pytest.raises(DatasetError, match="truncated or corrupt"):
        Dataset(trunc)
    with h5py.File(path, "r+") as f:
        del f["episodes/000000/action"]
        f["episodes/000000/action"] = np.zeros((4, 3), np.float32)
    with pytest.raises(DatasetError, match="action has shape"):
        Dataset(path)
    other = tmp_path / "o.h5"
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(DatasetError, match="not a groundflow dataset"):
        Dataset(other)


def test_writer_rejects_bad_episodes(tmp_path):
    with DatasetWriter(tmp_path / "d.h5", "test/env", 5, 3) as w:
        e = _episode()
        e.action[3, 1] = np.nan
        with pytest.raises(DatasetError, match="non-finite"):
            w.add(e)
        with pytest.raises(DatasetError, match="action has shape"):
            w.add(_episode(A=4))
    with pytest.raises(FileExistsError):
        DatasetWriter(tmp_path / "d.h5", "test/env", 5, 3)


def test_chunked_samples_pad_with_last_action(tmp_path):
    path = tmp_path / "d.h5"
    with DatasetWriter(path, "test/env", 5, 3) as w:
        w.add(_episode(T=6, seed=0))
        w.add(_episode(T=4, seed=1, instr="pick up the blue cube"))
    data = ChunkData(path, horizon=5)
    assert len(data) == 10 and data.instructions == ["pick up the blue cube", "push the red cube"]
    b = data.batch(np.array([0, 4, 9]))
    ep0 = Dataset(path).episode(0)
    np.testing.assert_array_equal(b["action"][0], ep0.action[:5])
    np.testing.assert_array_equal(b["action"][1][:2], ep0.action[4:6])
    np.testing.assert_array_equal(b["action"][1][2:], np.repeat(ep0.action[5:6], 3, 0))
    assert b["action_pad"][1].tolist() == [False, False, True, True, True]
    assert b["action_pad"][2].tolist() == [False, True, True, True, True]
    with pytest.raises(DatasetError, match="cameras"):
        ChunkData(path, horizon=5, cameras=("wrist",))
