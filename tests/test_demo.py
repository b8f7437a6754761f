"""`make demo` end to end at a toy size: every stage runs, in two workers, and writes its results."""

import json
import re

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
