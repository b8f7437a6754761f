"""The recipes are what the benchmarks and the demo measured: each builds its runs from a recipe
(``recipe_args``), and the values below are the ones those runs used before they named the recipes,
written out (so a recipe that drifts from what was measured fails here). The one difference is the
``recipe`` label a CIG run carries: ``multitask_cig`` (before: ``multitask`` with the CIG options
spelled out). The figures a recipe's description quotes are checked against the results files."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from conftest import json_file, json_pointer, load_benchmark
from train.bc import TrainArgs
from train.cig import CIGOptions
from train.commands import parse_train_args
from train.recipes import RECIPES, recipe_args

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

MULTITASK = dict(ignore_state=("*vel", "*_acc"), fusion="early", lang_norm=True, state_hidden=256, horizon=1, n_exec=1,
                 batch_size=256, lr=1e-3, steps=24000, bin_sigma=1.0)
"""the multitask recipe's values"""
JOINT_CIG = CIGOptions(weight=1.0, variant="bounded", negatives=3, draws=2, batch=64, margin=1.0, tau=None,
                       max_progress=1.0, demonstrated_radius=0.0)
"""the grounding benchmark's cig_bounded_joint (benchmarks/grounding.py before: CIGOptions(weight=a.cig_weight
(default 1.0), variant, negatives=3, draws=2, batch=64, max_progress=1.0, demonstrated_radius=0.0))"""
BENCH = dict(wandb="disabled", progress=False, save_every=10**9)
"""what the grounding and LIBERO benchmarks add to every run"""


def _expected(recipe: str, **values) -> TrainArgs:
    return dataclasses.replace(TrainArgs(), recipe=recipe, **{**MULTITASK, **values})


def test_multitask_cig_is_the_multitask_recipe_with_the_grounding_benchmarks_best_cig():
    assert recipe_args("multitask_cig") == _expected("multitask_cig", cig=JOINT_CIG)
    assert recipe_args("libero_dart") == _expected("libero_dart")  # DART is a collect flag: the training is multitask's
    assert CIGOptions().variant == "detached" and CIGOptions().weight == 0.0  # what `--cig.weight` alone trains
    a, b = recipe_args("multitask_cig"), recipe_args("multitask_cig")
    a.cig.weight = 5.0  # each call's options are its own
    assert b.cig.weight == 1.0 and RECIPES["multitask_cig"][1]["cig"].weight == 1.0


def test_groundflow_train_recipe_multitask_cig_parses_and_shows_those_values(capsys, monkeypatch):
    assert parse_train_args(["--recipe", "multitask_cig"]) == _expected("multitask_cig", cig=JOINT_CIG)
    flags = parse_train_args(["--recipe", "multitask_cig", "--cig.variant", "full", "--steps", "10"])
    assert (flags.cig.variant, flags.cig.batch, flags.steps, flags.horizon) == ("full", 64, 10, 1)
    assert parse_train_args(["--cig.weight", "1"]).cig == CIGOptions(weight=1.0)  # no recipe: detached, all samples
    from groundflow.cli import main
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as e:
        main(["train", "--recipe", "multitask_cig", "--help"])
    assert e.value.code == 0
    text = " ".join(re.sub(r"[│─╭╮╰╯]", " ", capsys.readouterr().out).split())
    for flag, default in [("--cig.weight FLOAT", "1.0"), ("--cig.negatives INT", "3"), ("--cig.draws INT", "2"),
                          ("--cig.variant {full,detached,bounded,pmi}", "bounded"), ("--cig.batch INT", "64"),
                          ("--steps INT", "24000"), ("--horizon INT", "1")]:
        shown = text.split(flag, 1)[1].split(" --", 1)[0]
        assert f"(default: {default})" in shown, (flag, shown)


def test_the_grounding_benchmark_builds_its_runs_from_the_recipes(monkeypatch, tmp_path):
    bench = load_benchmark("grounding", monkeypatch)
    a, data, out = bench.Args(), tmp_path / "demos.h5", tmp_path / "run"
    run = dict(policy="flow", data=(data,), seed=0)
    assert bench._train_args(a, out, **run) == _expected("multitask", out=out, **BENCH, **run)
    mode, cig = bench._cig_method(a, "cig_bounded_joint")
    assert (mode, cig) == ("joint", JOINT_CIG)
    assert bench._train_args(a, out, "multitask_cig", cig=cig, **run) == \
        _expected("multitask_cig", out=out, cig=JOINT_CIG, **BENCH, **run)
    cont = dict(init_from=tmp_path / "bc" / "ckpt", steps=2000, warmup_steps=0, lr=3e-4)  # --cig-steps, --cont-lr
    mode, cig = bench._cig_method(a, "cig_pmi_continuation")
    assert bench._train_args(a, out, "multitask_cig", cig=cig, **cont, **run) == \
        _expected("multitask_cig", out=out, cig=dataclasses.replace(JOINT_CIG, variant="pmi"), **cont, **BENCH, **run)
    expected = {  # every CIG method as the benchmark built it before (--cig-early 0.25, --cig-radius 1.25)
        "cig_bounded_continuation": ("continuation", {}), "cig_detached_continuation": ("continuation", {}),
        "cig_full_continuation": ("continuation", {}), "cig_pmi_continuation": ("continuation", {}),
        "cig_bounded_joint": ("joint", {}), "cig_bounded_joint_early": ("joint", {"max_progress": 0.25}),
        "cig_bounded_joint_consistent": ("joint", {"demonstrated_radius": 1.25}), "cig_full_joint": ("joint", {}),
        "cig_detached_joint": ("joint", {}), "cig_pmi_joint": ("joint", {})}
    assert {m for m in bench.METHODS if m.startswith("cig_")} == set(expected)
    for method, (mode, extra) in expected.items():
        variant = method.split("_")[1]
        assert bench._cig_method(a, method) == (mode, dataclasses.replace(JOINT_CIG, variant=variant, **extra)), method
    assert bench._cig_method(bench.Args(cig_weight=0.5), "cig_bounded_joint")[1].weight == 0.5
    with pytest.raises(ValueError, match="unknown CIG mode"):
        bench._cig_method(a, "cig_bounded_later")


def test_the_libero_benchmark_builds_its_runs_from_the_recipes(monkeypatch, tmp_path):
    bench = load_benchmark("libero", monkeypatch)
    a, data, out = bench.Args(), (tmp_path / "t0-8.h5", tmp_path / "dart.h5"), tmp_path / "run"
    assert bench._train_args(a, out, data=data, seed=0) == _expected("multitask", out=out, data=data, seed=0, **BENCH)
    assert bench._cig("bounded") == JOINT_CIG  # before: CIGOptions(weight=1.0, variant, negatives=3, draws=2, batch=64)
    cont = dict(init_from=tmp_path / "bc" / "ckpt", steps=2000, warmup_steps=0, lr=3e-4, data=data, seed=0)
    assert bench._train_args(a, out, "multitask_cig", cig=bench._cig("bounded"), **cont) == \
        _expected("multitask_cig", out=out, cig=JOINT_CIG, **cont, **BENCH)


# benchmarks/pixels.py before: each suite's cameras, hidden and estimated state, 96 px, behind `--recipe multitask`
PIXEL_SUITES = {
    "tabletop": (("workspace_camera", "hand_camera"), ("*vel", "*_cube_pose", "*_goal_pos"),
                 ("*_cube_pose[0:3]", "*_goal_pos[0:2]")),
    "pushcube": (("base_camera", "hand_camera"), ("*vel", "extra/goal_pos", "extra/obj_pose"),
                 ("extra/obj_pose[0:3]", "extra/goal_pos[0:2]")),
    "kitchen": (("agentview", "robot0_eye_in_hand"),
                ("*vel", "*_acc", "*_cube_*", "green_can_*", "gripper_to_*", "plate_pos", "bin_pos"),
                ("*_cube_pos", "green_can_pos", "*_cube_quat[2:4]")),
    "libero_goal": (("agentview", "robot0_eye_in_hand"), ("*vel", "*_acc", "*_1_quat", "*_to_robot0_eef_*"),
                    ("*_1_pos", "*_level_qpos", "*_button_qpos")),
}
PIXEL_RECIPES = {"tabletop": "pixels", "pushcube": "multitask", "kitchen": "pixels_kitchen",
                 "libero_goal": "pixels_libero"}
OLD_JOINT_CIG = ["--cig.weight", "1", "--cig.variant", "bounded", "--cig.negatives", "3", "--cig.draws", "2",
                 "--cig.batch", "64"]


def _old_pixel_flags(bench, a, name: str) -> list[str]:
    """The policy flags benchmarks/pixels.py gave ``groundflow train`` before it named the pixel recipes."""
    cameras, hide, estimate = PIXEL_SUITES[a.suite]
    su, m = bench.SUITES[a.suite], bench.METHODS[name]
    flags = ["--recipe", "multitask", "--data", *map(str, bench._policy_data(a, m)), "--out",
             str(bench._policy_dir(a, name)), "--seed", str(a.seed), "--no-progress", "--wandb", "disabled"]
    flags += ["--steps", str(su.steps)] if su.steps and "--steps" not in (m.end_to_end or ()) else []
    if m.end_to_end is not None:
        flags += ["--cameras", *cameras, "--image-size", "96", "--ignore-state", *hide, *m.end_to_end]
    elif m.estimate_noise is not None:
        flags += ["--cameras", *cameras, "--image-size", "96", "--ignore-state", *hide, "--estimate-state", *estimate,
                  "--estimate-noise", str(m.estimate_noise)]
        if m.noise_from:
            flags += ["--estimate-noise-from", str(bench._final_dir(a, m.noise_from))]
    return flags + (OLD_JOINT_CIG if name in ("cig_joint", "p2_cig_joint") else []) + list(m.policy_flags)


@pytest.mark.parametrize("suite", list(PIXEL_SUITES))
def test_the_pixel_benchmark_builds_its_policies_from_the_pixel_recipes(monkeypatch, tmp_path, suite):
    bench = load_benchmark("pixels", monkeypatch)
    su = bench.SUITES[suite]
    cameras, hide, estimate = PIXEL_SUITES[suite]
    assert (su.recipe, su.cameras, su.image_size, su.hide, su.estimate) == \
        (PIXEL_RECIPES[suite], cameras, 96, hide, estimate)  # what collect, eval and merge read too
    for seed in (0, 1):
        a = bench.Args(suite=suite, seed=seed, data=tmp_path / "data", runs=tmp_path / "runs")
        for name, m in bench.METHODS.items():
            new, old = parse_train_args(bench._policy_flags(a, name)), parse_train_args(_old_pixel_flags(bench, a, name))
            assert dataclasses.replace(new, recipe="multitask") == old, (suite, name)
            assert new.recipe == (su.recipe if m.has_head else "multitask"), (suite, name)
    if suite == "tabletop":
        cig = parse_train_args(bench._policy_flags(bench.Args(suite=suite), "cig_joint")).cig
        assert cig == JOINT_CIG


# figure shown in a recipe's description -> (results file, JSON pointer) it quotes; settings are not figures
FIGURES = {
    "multitask": [("0.97", "grounding.json", "/competence/tabletop/flow/success"),
                  ("0.65", "grounding.json", "/competence/tabletop/ar/success"),
                  ("1.00", "grounding.json", "/competence/kitchen/flow/success"),
                  ("0.28", "language.json", "/paraphrase/tabletop/encoder/paraphrase"),
                  ("0.95", "language.json", "/paraphrase/tabletop/resolver/paraphrase"),
                  ("0.62", "language.json", "/paraphrase/tabletop/augment/paraphrase"),
                  ("0.92", "language.json", "/paraphrase/tabletop/augment/clean")],
    "multitask_cig": [("0.69", "grounding.json", "/protocols/P2_rho0.9/tabletop/flow/cig_bounded_joint/success"),
                      ("0.56", "grounding.json", "/protocols/P2_rho0.9/tabletop/flow/bc/success"),
                      ("0.61", "grounding.json", "/protocols/P2_rho0.9/tabletop/flow/bc_2x/success"),
                      ("0.99", "grounding.json", "/protocols/P1/tabletop/flow/cig_bounded_joint/success"),
                      ("0.97", "grounding.json", "/protocols/P1/tabletop/flow/bc/success"),
                      ("0.21", "grounding.json", "/protocols/P2_rho0.9/tabletop/ar/cig_bounded_joint/success"),
                      ("0.14", "grounding.json", "/protocols/P2_rho0.9/tabletop/ar/bc/success"),
                      ("0.58", "grounding.json", "/protocols/P1/kitchen/flow/cig_bounded_joint/success"),
                      ("0.99", "grounding.json", "/protocols/P1/kitchen/flow/bc/success"),
                      ("0.89", "grounding.json", "/protocols/P1/kitchen/flow/cig_bounded_joint_consistent/success")],
    "libero_dart": [("0.97", "libero.json", "/policies/bc_dart_only/average"),
                    ("0.96", "libero.json", "/policies/bc_dart/average"),
                    ("0.35", "libero.json", "/policies/bc/average")],
}
SETTINGS = {"multitask": {"0.5"}, "multitask_cig": {"0.9", "1.25"}, "libero_dart": {"0.1"}}
"""decimals in a description that are settings (--paraphrase-augment 0.5, rho 0.9, --cig.demonstrated-radius 1.25,
--dart-noise 0.1)"""


@pytest.mark.parametrize("name", list(FIGURES))
def test_a_recipes_figures_are_the_results_it_names(name):
    description = RECIPES[name][0]
    for shown, file, pointer in FIGURES[name]:
        value = json_pointer(json_file(RESULTS / file), pointer)
        assert f"{value:.2f}" == shown, (name, file, pointer, value)
        assert shown in description, (name, shown)
    figures = set(re.findall(r"(?<![\w.])\d+\.\d+(?!\w|\.\d)", description))  # a sentence's full stop ends one
    assert figures - SETTINGS[name] == {shown for shown, _, _ in FIGURES[name]}, name


def test_the_demo_trains_what_it_trained_before(tmp_path):
    from groundflow.demo import DemoArgs, _train_plan
    out, data, cdata = tmp_path / "demo", tmp_path / "demo" / "t.h5", tmp_path / "demo" / "reach.h5"
    common = dict(data=(data,), policy="flow", size="tiny", seed=0, wandb="disabled", save_every=10**9)
    reach = TrainArgs(data=(cdata,), policy="flow", size="tiny", steps=2000, horizon=8, n_exec=4, out=out / "reach",
                      seed=0, wandb="disabled")
    rows, plan = _train_plan(DemoArgs(out=out), data, cdata)
    assert rows == {"BC": out / "bc", "BC 2x": out / "bc_2x", "BC+CIG": out / "cig_joint"}
    assert plan == [("BC 2x", _expected("multitask", steps=8000, out=out / "bc_2x", **common)),
                    ("BC+CIG", _expected("multitask_cig", steps=4000, out=out / "cig_joint", cig=JOINT_CIG, **common)),
                    ("BC", _expected("multitask", steps=4000, out=out / "bc", **common)),
                    ("reach", reach)]
    # two instructions: one counterfactual each; the CIG flags and a continuation from the BC checkpoint
    two = DemoArgs(out=out, instructions=("push the red cube to the left goal", "push the red cube to the right goal"),
                   cig_mode="continuation", cig_variant="full", cig_weight=0.5, cig_max_progress=0.25)
    cig = dataclasses.replace(JOINT_CIG, negatives=1, variant="full", weight=0.5, max_progress=0.25)
    rows, plan = _train_plan(two, data, cdata)
    assert rows == {"BC": out / "bc", "BC+CIG": out / "cig"}
    assert plan[-1] == ("CIG continuation", _expected(
        "multitask_cig", init_from=out / "bc" / "ckpt", steps=500, lr=1e-4, warmup_steps=20, out=out / "cig", cig=cig,
        **{k: v for k, v in common.items() if k != "size"}))
