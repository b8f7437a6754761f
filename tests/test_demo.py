"""`make demo` end to end at a toy size: every stage runs, in two workers, and writes its results."""

import json
import re
import shutil

import pytest

from groundflow.demo import main


def test_demo_runs_every_stage_and_the_server_commands_each_instruction(tmp_path):
    out = tmp_path / "demo"
    instrs = ["push the red cube to the left goal", "push the blue cube to the right goal"]
    res = main(["--out", str(out), "--demos", "8", "--bc-steps", "20", "--collision-demos", "4",
                "--collision-steps", "20", "--eval-episodes", "1", "--collision-episodes", "1",
                "--server-episodes", "2", "--workers", "2", "--instructions", *instrs])
    assert list(res["tabletop"]) == ["BC", "BC 2x", "BC+CIG"]
    assert set(res["collision"]) == {"no obstacle", "obstacle, unguided", "obstacle, coupled"}
    for run in ("bc", "bc_2x", "cig_joint", "reach"):
        assert (out / run / "ckpt").exists(), run
    steps = {run: json.loads((out / run / "summary.json").read_text())["steps"] for run in ("bc", "bc_2x", "cig_joint")}
    assert steps == {"bc": 20, "bc_2x": 40, "cig_joint": 20}
    assert res["server"]["n_episodes"] == 2 and (out / "collapse.png").exists()
    episodes = [json.loads(line) for line in (out / "deployed.h5.episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 2
    from dataset import Dataset
    rec = Dataset(out / "deployed.h5")
    assert [rec.episode(i).instruction for i in range(2)] == instrs
    assert json.loads((out / "results.json").read_text())["tabletop"] == json.loads(json.dumps(res["tabletop"]))


def test_demo_bad_input_ends_in_one_line_naming_it(tmp_path, capsys):
    from groundflow.demo import cli
    code = cli(["--out", str(tmp_path / "bad"), "--instructions", "push the red cube to the moon",
                "push the blue cube to the right goal"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert re.search(r"groundflow demo: error: collect \S+\.h5.* failed: InstructionError", err)  # either collect job
    assert "'push the red cube to the moon' is not in the suite" in err
    assert cli(["--out", str(tmp_path / "bad"), "--workers", "0"]) == 1
    assert capsys.readouterr().err.strip() == "groundflow demo: error: --workers must be >= 1, got 0"


# --- reuse (#46 item 1): a second run reuses an artifact in OUT only when its stamp says this run would make it ---

TOY = ["--demos", "6", "--bc-steps", "2", "--eval-episodes", "1", "--collision-demos", "2", "--collision-steps", "2",
       "--collision-episodes", "1", "--server-episodes", "1", "--workers", "1"]
DATASETS = ("tabletop_rho0.9.h5", "tabletop_heldout.h5", "reach.h5")
RUNS = ("bc", "bc_2x", "cig_joint", "reach")


def _flags(**changed) -> list[str]:
    flags = list(TOY)
    for k, v in changed.items():
        flags[flags.index("--" + k.replace("_", "-")) + 1] = str(v)
    return flags


def _mtimes(out) -> dict[str, int]:
    """Each dataset's and each run's files, by modification time."""
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for name in DATASETS + RUNS
            for p in ([out / name] if name.endswith(".h5") else sorted((out / name).rglob("*")))}


def _table(res: dict) -> tuple:
    """What the printed table shows but timings: the tabletop rows, collision and server success."""
    return (res["tabletop"], {k: (v["success_rate"], v["collision_rate"], v["clean_success_rate"])
                              for k, v in res["collision"].items()}, res["server"]["success_rate"])


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One toy demo; each test works on its own copy of its OUT."""
    out = tmp_path_factory.mktemp("first") / "demo"
    return out, main(TOY + ["--out", str(out)])


def _copy(first_run, tmp_path):
    out = tmp_path / "demo"  # another path: stamps name paths inside OUT relative to it
    shutil.copytree(first_run[0], out)
    return out


def test_a_second_run_with_the_same_settings_reuses_everything(first_run, tmp_path, capsys):
    out = _copy(first_run, tmp_path)
    before = _mtimes(out)
    capsys.readouterr()
    res = main(TOY + ["--out", str(out)])
    printed = capsys.readouterr().out
    assert _mtimes(out) == before  # no collection or training ran
    assert " again" not in printed
    reused = [p for line in printed.splitlines() if line.startswith("reusing ")
              for p in line.removeprefix("reusing ").partition(" (")[0].split(", ")]
    assert sorted(reused) == sorted(str(out / name) for name in DATASETS + RUNS)
    assert _table(res) == _table(first_run[1])


@pytest.mark.parametrize("changed, redone", [
    ({"bc_steps": 3}, {"bc": "steps 2 -> 3", "bc_2x": "steps 4 -> 6", "cig_joint": "steps 2 -> 3"}),
    # the tabletop runs' own settings are unchanged: they are trained again because their data is
    pytest.param({"demos": 7}, {"tabletop_rho0.9.h5": "episodes 6 -> 7", "bc": "", "bc_2x": "", "cig_joint": ""},
                 marks=pytest.mark.slow),  # the same path as bc_steps, through a dataset (make test-slow)
], ids=["bc_steps", "demos"])
def test_a_changed_setting_redoes_exactly_the_affected_artifacts_and_says_why(first_run, tmp_path, capsys, changed,
                                                                              redone):
    out = _copy(first_run, tmp_path)
    before = _mtimes(out)
    capsys.readouterr()
    res = main(_flags(**changed) + ["--out", str(out)])
    printed = capsys.readouterr().out
    after = _mtimes(out)
    remade = {name for name in DATASETS + RUNS
              if any(after.get(k) != v for k, v in before.items() if k == name or k.startswith(name + "/"))}
    assert remade == set(redone), printed
    for name, change in redone.items():
        verb = "collecting" if name.endswith(".h5") else "training"
        if change:
            line = f"{out / name}: made with other settings ({change}); {verb} again"
        else:  # a run whose settings are the same, but its data was collected again
            line = f"{out / name}: made from another OUT/tabletop_rho0.9.h5; {verb} again"
        assert line in printed.splitlines(), printed
    assert sum(" again" in line for line in printed.splitlines()) == len(redone)
    fresh = main(_flags(**changed) + ["--out", str(tmp_path / "fresh")])
    assert _table(res) == _table(fresh)
    for run in ("bc", "bc_2x", "cig_joint", "reach"):
        assert (out / run / "ckpt" / "model.safetensors").read_bytes() == \
            (tmp_path / "fresh" / run / "ckpt" / "model.safetensors").read_bytes(), run


def test_an_artifact_without_a_stamp_is_redone(first_run, tmp_path, capsys):
    """An older demo left OUT/bc trained for other steps and no stamps: it is trained again, as a fresh run would."""
    out = _copy(first_run, tmp_path)
    shutil.rmtree(out / "bc")
    shutil.copytree(out / "bc_2x", out / "bc")  # 4 steps where this run trains 2
    (out / "bc.stamp.json").unlink(missing_ok=True)
    (out / "tabletop_heldout.h5.stamp.json").unlink(missing_ok=True)
    before = _mtimes(out)
    capsys.readouterr()
    res = main(TOY + ["--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    for name, verb in (("bc", "training"), ("tabletop_heldout.h5", "collecting")):
        assert f"{out / name}: no stamp (made by an older demo, or not finished); {verb} again" in printed
        assert _mtimes(out)[name if name.endswith(".h5") else name + "/ckpt/model.safetensors"] != \
            before[name if name.endswith(".h5") else name + "/ckpt/model.safetensors"]
    assert json.loads((out / "bc" / "summary.json").read_text())["steps"] == 2
    assert (out / "bc.stamp.json").exists() and (out / "tabletop_heldout.h5.stamp.json").exists()
    assert _table(res) == _table(first_run[1])
