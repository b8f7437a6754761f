"""The groundflow command: subcommands exist, bad input gets one clear line and exit code 1."""

import pytest

from groundflow.cli import main


def test_lists_envs_and_commands(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "maniskill/TabletopSuite-v1" in out and "robosuite/KitchenSuite" in out and "tabletop" in out
    assert main([]) == 0
    out = capsys.readouterr().out
    for cmd in ("collect", "train", "eval", "diagnose", "serve", "deploy", "debug"):
        assert cmd in out


@pytest.mark.parametrize("argv,msg", [
    (["collect", "--env", "maniskill/PushCub-v1", "--episodes", "1", "--out", "/tmp/x.h5"], "unknown env id"),
    (["collect", "--suite", "kitchenette", "--episodes", "1", "--out", "/tmp/x.h5"], "unknown suite"),
    (["collect", "--env", "maniskill/PushCube-v1", "--episodes", "0", "--out", "/tmp/x.h5"], "--episodes"),
    (["train", "--data", "/nonexistent/demos.h5", "--steps", "1"], "does not exist"),
    (["eval", "--ckpt", "/nonexistent/ckpt"], "not a groundflow checkpoint"),
    (["train", "cig", "--data", "/nonexistent/demos.h5"], "--from"),
    (["train", "--data", "/nonexistent/demos.h5", "--steps", "1", "--cig-weight", "-1"], "--cig-weight must be >= 0"),
])
def test_bad_input_is_one_clear_error(argv, msg, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_unknown_command(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("where", ["dir", "below_file", "below_file_deeper"])
def test_collect_out_that_cannot_be_a_file_is_one_line(tmp_path, capsys, where, overwrite):
    """#46: `collect --out DIR --overwrite` collected every episode, then failed its final rename with an
    IsADirectoryError traceback (leaving DIR.partial); --out below a regular file gave '[Errno 17] File
    exists' or a NotADirectoryError traceback."""
    (tmp_path / "somedir").mkdir()
    (tmp_path / "afile").write_text("not a folder")
    out = {"dir": tmp_path / "somedir", "below_file": tmp_path / "afile" / "d.h5",
           "below_file_deeper": tmp_path / "afile" / "sub" / "d.h5"}[where]
    argv = ["collect", "--env", "maniskill/PushCube-v1", "--episodes", "1", "--out", str(out), "--no-progress"]
    assert main(argv + (["--overwrite"] if overwrite else [])) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("groundflow collect: error: ") and str(out) in err, err
    assert ("is a directory" if where == "dir" else f"{tmp_path / 'afile'} is a file") in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "somedir"]  # nothing left behind
    assert not any((tmp_path / "somedir").iterdir()) and (tmp_path / "afile").read_text() == "not a folder"
