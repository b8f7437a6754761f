"""The robot computer's side of ``groundflow deploy`` runs without torch or a simulator.

The robot-side modules are imported in a child process where importing torch, gymnasium or any
simulator fails (as on a robot computer with only the ``robot`` extra); there the deploy command
parses and builds a real-arm driver, a checkpoint or ``--robot sim`` asked for is one clear line, and
every package that was imported is one the ``robot`` extra installs. Also: the ``Robot`` protocol
declares every optional thing the layers above read from a driver, and the bring-up server needs no
instruction.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
ABSENT = ("torch", "gymnasium", "gymnasium_robotics", "mani_skill", "sapien", "robosuite", "mujoco", "libero")
"""what a robot computer does not have (gymnasium too: the robot extra does not list it)"""
ROBOT_SIDE = ("groundflow.cli", "deploy.commands", "deploy.serving.client", "deploy.serving.protocol", "deploy.control",
              "deploy.safety", "deploy.recording", "deploy.robots.base", "deploy.robots.franka", "deploy.robots.ur",
              "deploy.robots.xarm", "deploy.robots.cameras", "envs.errors", "policies.rtc_config")
OPTIONAL = {"threadpoolctl"}
"""imported where installed, never needed: ``envs.platform_setup`` limits BLAS threads with it"""

CHILD = r'''
import contextlib, importlib, importlib.abc, io, json, sys
ABSENT, ROBOT_SIDE = set(sys.argv[1].split(",")), sys.argv[2].split(",")


class Absent(importlib.abc.MetaPathFinder):
    """Importing any of ABSENT fails as for a package that is not installed."""

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent())
before = set(sys.modules)
out = {}
try:
    import torch  # noqa: F401  (the blocker works: else nothing below means anything)
    out["torch_blocked"] = False
except ModuleNotFoundError:
    out["torch_blocked"] = True
for name in ROBOT_SIDE:
    importlib.import_module(name)

from groundflow.cli import main
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text):
    try:
        out["help_rc"] = main(["deploy", "--help"])
    except SystemExit as e:  # tyro prints the help and exits
        out["help_rc"] = e.code
out["help"] = help_text.getvalue()

import tyro
from deploy.commands import DeployArgs, make_robot
args = tyro.cli(DeployArgs, args=["--robot", "franka", "--robot-host", "172.16.0.2", "--server", "10.0.0.5:8000",
                                  "--rate", "50", "--velocity-scale", "0.5", "--record", "runs/rec.h5"])
args.check()
robot = make_robot(args, [])  # the driver object; franky is imported only when it connects
out["parsed"] = [args.robot, args.robot_host, args.server, args.rate, type(robot).__name__, robot.host]

for argv in (["serve", "--ckpt", "runs/none/ckpt"], ["deploy", "--robot", "sim"], ["train", "--help"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    out[argv[0] + "_error"] = [rc, err.getvalue()]

# what the client imports when it talks to a server and encodes images, and a camera when it opens
from deploy.errors import PolicyUnavailableError
from deploy.serving import protocol
from deploy.serving.client import PolicyClient
from deploy.robots.cameras import CameraError, parse_camera
try:
    PolicyClient("127.0.0.1", 9, timeout=1.0)
except PolicyUnavailableError:
    pass
protocol.encode_image(__import__("numpy").zeros((4, 4, 3), "uint8"), "png", 90)
try:
    parse_camera("front=/nonexistent/video.mp4").connect()
except CameraError:
    pass
out["absent_loaded"] = sorted({m.partition(".")[0] for m in sys.modules} & ABSENT)
out["new_modules"] = sorted({m.partition(".")[0] for m in set(sys.modules) - before  # files, not runtime modules
                             if getattr(sys.modules[m], "__file__", None)})
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def child() -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, ",".join(ABSENT), ",".join(ROBOT_SIDE)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_robot_side_imports_and_parses_without_torch_or_a_simulator(child):
    assert child["torch_blocked"]
    assert child["absent_loaded"] == []
    assert child["help_rc"] == 0 and "--robot" in child["help"] and "--franky-sim" in child["help"]
    assert child["parsed"] == ["franka", "172.16.0.2", "10.0.0.5:8000", 50.0, "FrankaRobot", "172.16.0.2"]


def test_what_needs_torch_or_a_simulator_says_so_in_one_line(child):
    rc, err = child["serve_error"]
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith("groundflow serve: error: ") and "needs torch" in err and "robot` extra" in err
    rc, err = child["deploy_error"]
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith("groundflow deploy: error: --robot sim needs gymnasium"), err
    rc, err = child["train_error"]  # a workstation command on a robot computer
    assert rc == 1 and err.count("\n") == 1 and err.startswith("groundflow train: error: needs torch"), err


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install: their names and, from the installed metadata, their
    own requirements (extras aside), transitively."""
    seen: set[str] = set()
    todo = [r for r in requirements]
    while todo:
        req = todo.pop()
        name = _normal(re.match(r"[A-Za-z0-9._-]+", req).group(0))
        if name in seen:
            continue
        seen.add(name)
        try:
            more = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [r for r in more if "extra" not in r.partition(";")[2]]
    return seen


def test_the_robot_extra_installs_what_the_robot_side_imported(child):
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    extra = extras["robot"]
    drivers = {_normal(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in extras["robots"]}  # optional, as before
    names = {_normal(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in extra}
    assert not names & {_normal(n) for n in (*ABSENT, "mani-skill", "rpent-libero", "gymnasium-robotics")}
    installed = _requirement_closure(extra) | drivers
    dists = importlib.metadata.packages_distributions()
    project = {"groundflow", "envs", "dataset", "guidance", "policies", "train", "deploy"}
    third_party = [m for m in child["new_modules"] if m not in sys.stdlib_module_names and m not in project
                   and not m.startswith("_") and m not in OPTIONAL]
    missing = {m: dists.get(m) for m in third_party
               if not any(_normal(d) in installed for d in dists.get(m, [m]))}
    assert not missing, f"imported on the robot side but not installed by the robot extra: {missing}"
    assert {"numpy", "msgpack", "tyro", "websockets", "h5py", "pillow", "opencv-python"} <= installed
    assert "franky" in third_party  # the check saw a driver's package (the franka driver imports it when made)


def test_rtc_config_is_one_class_under_both_names():
    from policies.rtc import RTCConfig
    from policies.rtc_config import RTCConfig as TorchFree
    assert RTCConfig is TorchFree and RTCConfig().sigma == 0.05


# ----- what the layers above ask of a robot ---------------------------------------------------------
def _asked_of_robot(path: Path) -> set[str]:
    """Names read from a robot in ``path`` with getattr/hasattr/capability(robot or self.robot, "name")."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "capability") and len(node.args) >= 2
                and ast.unparse(node.args[0]) in ("robot", "self.robot")
                and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


def test_the_robot_protocol_declares_what_the_loop_and_the_command_ask_for():
    from deploy.robots.base import CAPABILITY_DEFAULTS, Robot, RobotCapabilities, capability

    def declared(proto: type) -> set[str]:
        return set(proto.__annotations__) | {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}

    asked = {name: _asked_of_robot(ROOT / "deploy" / name) for name in ("control.py", "safety.py", "commands.py")}
    assert {"done", "success", "last_info", "last_reward", "sim_state"} <= asked["control.py"]
    undeclared = {f: sorted(n - declared(Robot) - declared(RobotCapabilities)) for f, n in asked.items()}
    assert not any(undeclared.values()), f"read from a robot but not declared in deploy/robots/base.py: {undeclared}"
    assert set(CAPABILITY_DEFAULTS) <= set(RobotCapabilities.__annotations__)

    class Arm:  # a driver with none of the capabilities reads as the documented defaults
        pass

    assert [capability(Arm(), n) for n in ("done", "success", "last_reward", "last_info", "task_id")] == \
        [False, False, 0.0, {}, 0]


# ----- bring-up ------------------------------------------------------------------------------------
def test_the_bring_up_server_takes_observations_without_an_instruction():
    """``groundflow serve --scripted joint_target`` serves a robot run without ``--instruction`` (the
    scripted policy grounds none); a policy that needs one still gets the protocol's bad_request."""
    from deploy.commands import ServeArgs, load_policy
    from deploy.errors import ServerError
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.client import PolicyClient
    from deploy.serving.server import PolicyServer

    obs = {"state": np.zeros(22, np.float32), "instruction": ""}
    bring_up = load_policy(ServeArgs(scripted="joint_target", state_dim=22, action_dim=8, target=(0.1,) * 7))
    with PolicyServer(bring_up, port=0) as srv, PolicyClient(port=srv.port, expect={"state_dim": 22}) as c:
        chunk = c.infer(obs).actions
    assert chunk.shape == (16, 8) and np.all(chunk[:, :7] > 0)
    with PolicyServer(JointTargetPolicy(22, 8, np.zeros(7)), port=0) as srv, PolicyClient(port=srv.port) as c:
        with pytest.raises(ServerError, match="bad_request.*non-empty string"):
            c.infer(obs)
