"""``groundflow serve`` and ``groundflow deploy``: the two deployment commands.

    groundflow serve --ckpt runs/flow/ckpt --host 127.0.0.1 --port 8000
    groundflow deploy --robot sim --env maniskill/PushCube-v1 --server 127.0.0.1:8000 --rate 20
    groundflow deploy --robot franka --robot-host 172.16.0.2 --server 10.0.0.5:8000 --record runs/rec.h5
    groundflow deploy --robot sim --lockstep --episodes 20     (evaluation through the server)
    groundflow deploy --robot sim --env maniskill/TabletopSuite-v1 --instruction "nudge the red block left"
    groundflow deploy --robot ur --robot-host 10.0.0.2 --camera wrist=0@128x128@30 --camera front=realsense

``serve(argv)`` and ``deploy(argv)`` parse with tyro; the command table in groundflow/cli.py names them.
``deploy`` with a real arm runs on a robot computer without torch or a simulator (the ``robot`` extra):
what needs them (``serve``, ``--robot sim``, ``--obstacles``) imports them when asked, and says in one
line what is missing (tests/test_robot_side.py).

The served checkpoint resolves a user's wording to one of its trained instructions or refuses it
(``policies.instructions``). ``deploy --instruction`` asks the server first: a refused instruction
sends no motion (the robot holds still), prints one line with the reason and exits with status
``EXIT_INSTRUCTION_REFUSED`` (3; 1 is any other error, 2 a bad flag, 130 an interrupt).

``deploy --obstacles FILE|scene`` sends obstacles the policy never saw; the server guides each chunk
around them and checks its waypoints, and a chunk that fails is not sent (the robot holds and asks
again). A goal inside an obstacle sends no motion and exits with ``EXIT_CONSTRAINT_REFUSED`` (4).
"""

from __future__ import annotations

import importlib
import json
import logging
import signal
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import tyro

from deploy.robots.cameras import CameraRig, parse_cameras
from deploy.serving.client import parse_address, robot_client
from deploy.control import NORMAL_ENDS, ControlLoop, LoopConfig
from deploy.errors import (EXIT_CONSTRAINT_REFUSED, EXIT_INSTRUCTION_REFUSED, DeployError, HandshakeError, InstructionRefusedError,
                           MissingDependencyError, PolicyUnavailableError)
from deploy.robots.base import capability
from deploy.robots.franka import FrankaRobot
from deploy.robots.franka_sim import FrankySim
from deploy.recording import Recorder
from deploy.safety import SafetyConfig, SafetyLayer
from deploy.scripted import JointTargetPolicy
from deploy.robots.ur import URRobot
from deploy.robots.xarm import XArmRobot
from envs.errors import InvalidOptionError
from policies.rtc_config import RTCConfig

log = logging.getLogger(__name__)


def _require(module: str, what: str) -> ModuleType:
    """``module``, imported only where ``what`` needs it: the robot computer runs ``deploy`` with a real
    arm without torch or a simulator (the ``robot`` extra), and a missing package is one line naming it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise MissingDependencyError.of(e, what) from e


@dataclass
class ServeArgs:
    ckpt: str | None = None
    """checkpoint directory (policy.save); or use --scripted"""
    scripted: Literal["joint_target"] | None = None
    """serve a scripted bring-up policy instead of a checkpoint (needs --state-dim/--action-dim; it reads no
    instruction, so deploy needs no --instruction)"""
    state_dim: int = 0
    action_dim: int = 0
    target: tuple[float, ...] = ()
    """joint target of the scripted policy (rad)"""
    host: str = "127.0.0.1"
    """interface to listen on (loopback unless you mean to serve a robot computer)"""
    port: int = 8000
    device: str = "cpu"
    max_message_mb: float = 16.0
    """messages over this size are refused"""
    rtc_sigma: float = 0.05
    """real-time chunking: tolerance of the soft overlap target (normalized units)"""
    idle_timeout: float = 60.0
    """close a client connection that sent nothing for this long (s; 0: never)"""
    max_connections: int = 16
    """clients served at once; the next one is refused with a 'busy' error"""
    handshake_timeout: float = 5.0
    """close a connection that has not finished its handshake (upgrade and hello) this long after connecting (s)"""
    max_pending: int = 32
    """connections kept that have not finished their handshake; beyond it the oldest is closed"""
    paraphrases: int = 0
    """0: serve only the checkpoint's instructions; N > 0: also encode others (the language model loads at
    start-up, in a child process), keeping the N most recent (only with --allow-unknown: else a wording the
    checkpoint cannot ground is refused)"""
    allow_unknown: bool = False
    """serve a wording the checkpoint's instruction resolver refuses as is (encoded where --paraphrases
    allows) instead of the unknown_instruction error; a wording it resolves is served as its trained instruction"""
    seed: int = 0

    def check(self) -> None:
        """One clear line instead of a traceback from the socket or the server (after parsing, so the
        error is the command's one line, not the parser's box)."""
        _check_ranges(("--port", self.port, 0, 65535), ("--max-message-mb", self.max_message_mb, 1e-3, 1024),
                      ("--idle-timeout", self.idle_timeout, 0, float("inf")),
                      ("--max-connections", self.max_connections, 1, 4096), ("--paraphrases", self.paraphrases, 0, 1e6),
                      ("--handshake-timeout", self.handshake_timeout, 1e-3, 3600),
                      ("--max-pending", self.max_pending, 1, 4096))


def _check_ranges(*checks: tuple[str, float, float, float]) -> None:
    """Refuse a numeric flag outside [lo, hi] (or NaN), naming it."""
    for flag, value, lo, hi in checks:
        if not lo <= value <= hi:
            raise InvalidOptionError(f"{flag} must be in [{lo:g}, {hi:g}], got {value}")


@dataclass
class DeployArgs:
    robot: Literal["franka", "ur", "xarm", "sim"] = "sim"
    server: str = "127.0.0.1:8000"
    """policy server HOST:PORT"""
    rate: float = 20.0
    """control rate (Hz)"""
    robot_host: str = "127.0.0.1"
    """robot address (franka/ur/xarm)"""
    franky_sim: bool = False
    """--robot franka: start franky-sim on loopback and drive it"""
    env: str = "maniskill/PushCube-v1"
    """--robot sim: env id"""
    control_mode: str | None = None
    """--robot sim: ManiSkill control mode"""
    sim_robot: str | None = None
    """--robot sim: ManiSkill robot (robot_uids), e.g. panda_wristcam for a wrist camera on ManiSkill's tasks"""
    lockstep: bool = False
    """--robot sim: step the env once per command, no sleeping (evaluation)"""
    latency_ms: float = 0.0
    """--robot sim: added observation latency"""
    obs_noise: float = 0.0
    """--robot sim: Gaussian state noise"""
    action_delay: int = 0
    """--robot sim: command delay in control steps"""
    episodes: int = 1
    """episodes to run (sim robots reset between them)"""
    max_steps: int = 200
    """control steps per episode"""
    instruction: str | None = None
    """language instruction sent with every observation (default: the robot's / env's); the server resolves
    it to a trained instruction or refuses it, and then no motion is sent (exit 3)"""
    rtc: bool = False
    """real-time chunking (prefix inpainting on the server)"""
    ensemble: float | None = None
    """temporal ensembling coefficient (None: off)"""
    record: str | None = None
    """write every episode to this dataset (.h5)"""
    overwrite: bool = False
    """replace an existing --record file"""
    timeout: float = 2.0
    """policy request timeout (s)"""
    image_encoding: Literal["raw", "png", "jpeg"] = "raw"
    """camera images on the wire: raw (fastest on loopback), png (lossless, ~2x smaller) or jpeg (lossy, ~5-7x smaller at q90)"""
    jpeg_quality: int = 90
    """--image-encoding jpeg: quality 1-100 (higher: more bytes, closer to the camera frame)"""
    watchdog_s: float = 0.25
    """hold when no command was sent for this long (stalled loop)"""
    velocity_scale: float = 1.0
    """multiplies the robot's velocity limits (use < 1 for a first run)"""
    limit_mode: Literal["clip", "reject"] = "clip"
    """actions slightly past the joint limits: clip them, or reject them (hold)"""
    workspace: tuple[float, float, float, float, float, float] | None = None
    """xmin ymin zmin xmax ymax zmax of the TCP (franka)"""
    keep_out: tuple[float, ...] = ()
    """x y z radius [x y z radius ...]: spheres (m, robot base frame) the TCP must stay out of; a target
    landing inside one is rejected and the robot holds (needs forward kinematics: franka). Make the radius
    cover the hand around the TCP"""
    obstacles: str | None = None
    """obstacles the policy never saw, guided around and checked on the policy server: a JSON file listing
    {"type": "box", "center": [x, y, z], "half_size": [hx, hy, hz]} or {"type": "sphere", "center", "radius"}
    (m, robot base frame), or `scene` (--robot sim: the simulated scene's, read at each reset). A chunk that
    fails the check is not sent: the robot holds and asks again. A goal inside an obstacle: no motion, exit 4"""
    relative_dynamics: float = 0.2
    """franka: relative dynamics factor"""
    sim_cameras: tuple[str, ...] = ()
    """--robot sim: cameras the simulated robot renders into its observations (a pixel policy needs them)"""
    sim_obstacles: Literal["box", "sphere", "random"] | None = None
    """--robot sim on maniskill/CollisionAvoidance-v1: obstacles the scene places across the path each episode
    (with --obstacles scene the server is told where they are)"""
    sim_image_size: int = 128
    """--robot sim: side of the rendered --sim-cameras images in pixels"""
    camera: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """NAME=SOURCE[@WxH[@FPS]]: a camera added to observations (SOURCE: device index, URL, video, realsense[:SERIAL])"""
    status: bool = True
    """live status line on stderr"""
    seed: int = 0
    """env seed (sim) and base seed of the policy's sampling noise"""
    log_level: str = "WARNING"
    """logging level (safety interventions log at WARNING)"""
    force: bool = False
    """--robot sim: run a policy trained on another env, or reading state slices this env lacks"""

    def check(self) -> None:
        """A rate of 0 divides by zero deep in the loop: say so up front, in one line."""
        if self.episodes < 1:
            raise InvalidOptionError(f"--episodes must be >= 1, got {self.episodes}")
        inf = float("inf")
        _check_ranges(("--rate", self.rate, 1e-3, 10000), ("--timeout", self.timeout, 1e-3, 3600),
                      ("--max-steps", self.max_steps, 1, 10**7), ("--latency-ms", self.latency_ms, 0, 60000),
                      ("--action-delay", self.action_delay, 0, 10**4), ("--watchdog-s", self.watchdog_s, 1e-3, inf),
                      ("--velocity-scale", self.velocity_scale, 1e-6, inf),
                      ("--sim-image-size", self.sim_image_size, 16, 1024), ("--jpeg-quality", self.jpeg_quality, 1, 100))


def load_policy(args: ServeArgs):
    if (args.ckpt is None) == (args.scripted is None):
        raise InvalidOptionError("give exactly one of --ckpt DIR or --scripted joint_target")
    if args.ckpt is not None:
        _require("torch", "--ckpt (a checkpoint loaded in this process)")
        return _require("policies", "--ckpt").load(args.ckpt, device=args.device, to_act=True)
    if args.state_dim <= 0 or args.action_dim <= 0 or not args.target:
        raise InvalidOptionError("--scripted joint_target needs --state-dim, --action-dim and --target")
    # a bring-up policy grounds no instruction: a robot run without --instruction is served as one with it
    return JointTargetPolicy(args.state_dim, args.action_dim, args.target, needs_instruction=False)


def serve(argv: list[str]) -> None:
    args = tyro.cli(ServeArgs, args=argv, prog="groundflow serve")
    args.check()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    PolicyServer = _require("deploy.serving.server", "groundflow serve").PolicyServer
    policy = load_policy(args)
    server = PolicyServer(policy, args.host, args.port, max_message_bytes=int(args.max_message_mb * 2 ** 20),
                          rtc=RTCConfig(sigma=args.rtc_sigma), idle_timeout_s=args.idle_timeout or None,
                          max_connections=args.max_connections, paraphrases=args.paraphrases,
                          hello_timeout_s=args.handshake_timeout, max_pending=args.max_pending,
                          allow_unknown=args.allow_unknown)
    server.bind()  # a port in use is one line (ServerAddressError); --paraphrases loads the language model here
    _stop_on_sigterm()
    print(json.dumps({k: v for k, v in server.metadata.items() if k != "type"}), flush=True)
    print(f"serving on ws://{args.host}:{server.port} (Ctrl+C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


def _stop_on_sigterm() -> None:
    """SIGTERM (service managers, ``kill``) and SIGINT stop the server like Ctrl+C does. SIGINT is set
    explicitly: a process started in the background of a non-interactive shell inherits it ignored."""

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def make_robot(args: DeployArgs, stack: list):
    """The robot for ``args`` (and, with --franky-sim, the simulator it talks to), with its --camera sources."""
    cameras = parse_cameras(args.camera)  # a bad spec fails before any driver or simulator starts
    driver = _make_driver(args, stack)
    return CameraRig(driver, cameras) if cameras else driver


def _make_driver(args: DeployArgs, stack: list):
    if args.robot == "sim":
        SimRobot = _require("deploy.robots.sim", "--robot sim").SimRobot
        from envs.registry import spec
        _require(spec(args.env).entry.partition(":")[0], f"--robot sim --env {args.env}")  # its simulator
        opts = {k: v for k, v in (("control_mode", args.control_mode), ("robot_uids", args.sim_robot)) if v}
        if args.sim_cameras:
            opts.update(cameras=tuple(args.sim_cameras), image_size=args.sim_image_size)
        if args.sim_obstacles:
            opts["obstacles"] = args.sim_obstacles
        return SimRobot(args.env, env_options=opts, seed=args.seed, latency_s=args.latency_ms / 1e3,
                        obs_noise=args.obs_noise, action_delay=args.action_delay, realtime=not args.lockstep)
    if args.robot == "franka":
        host = args.robot_host
        if args.franky_sim:
            sim = FrankySim().start()
            stack.append(sim)
            host = sim.host
        return FrankaRobot(host, instruction=args.instruction or "", control_rate_hz=args.rate,
                           relative_dynamics_factor=args.relative_dynamics)
    if args.robot == "ur":
        return URRobot(args.robot_host, instruction=args.instruction or "", control_rate_hz=args.rate)
    return XArmRobot(args.robot_host, instruction=args.instruction or "", control_rate_hz=args.rate)


def check_policy_fits_env(meta: dict, robot, args: DeployArgs) -> None:
    """--robot sim: refuse a policy whose announced env id differs from --env, or which reads state
    slices the simulated env does not have (same dims are not the same task); --force runs it anyway.
    A server or checkpoint that announces neither (older ones) passes with a warning."""
    env = getattr(robot, "env", None)
    env = getattr(env, "unwrapped", env)
    names = {args.env, getattr(env, "env_id", None)} - {None}
    layout = getattr(env, "state_layout", None)
    env_id, inputs = meta.get("env_id"), meta.get("inputs")
    state = inputs.get("state") if isinstance(inputs, dict) else None
    problems = []
    if env_id is None:
        log.warning("the policy server does not announce the env its policy was trained on (an older checkpoint or "
                    "server): cannot check that it fits --env %s", args.env)
    elif env_id not in names:
        problems.append(f"the policy was trained on {env_id}, this robot simulates {args.env}")
    if state is None:
        log.warning("the policy server does not announce the state slices its policy reads: cannot check them "
                    "against --env %s", args.env)
    elif layout is None:
        log.warning("--env %s does not name its state slices: cannot check the policy's %s", args.env, state)
    else:
        missing = [n for n in state if n not in {name for name, _ in layout}]
        if missing:
            problems.append(f"the policy reads state slices {missing} that {args.env} does not have")
    if not problems:
        return
    if args.force:
        log.warning("--force: running a policy that does not fit --env %s: %s", args.env, "; ".join(problems))
        return
    raise HandshakeError(f"policy server {args.server} does not fit --env {args.env}: {'; '.join(problems)} "
                         f"(--force runs it anyway)")


def _check_instruction(client, args: DeployArgs, robot: Any = None) -> str | None:
    """Ask the server what ``--instruction`` resolves to before the first motion command: the trained
    instruction it means (None: no --instruction, or a server that cannot say). A refusal closes the
    client, prints one line with the server's reason and exits with ``EXIT_INSTRUCTION_REFUSED``; the
    robot was sent nothing. So does a policy that needs an instruction on an arm given none (a real arm's
    instruction comes only from --instruction; a simulated suite's from its env)."""
    if not args.instruction:
        if client.metadata.get("needs_instruction") and capability(robot, "instruction") == "":
            client.close()
            print("groundflow deploy: the served policy follows an instruction and none was given, no motion "
                  "sent: pass --instruction TEXT", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_INSTRUCTION_REFUSED)
        return None
    try:
        resolved = client.resolve_instruction(args.instruction)
    except InstructionRefusedError as e:
        client.close()
        print(f"groundflow deploy: instruction refused, no motion sent: {args.instruction[:80]!r}: "
              f"{e.reason or e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INSTRUCTION_REFUSED) from None
    if resolved is not None and resolved != args.instruction:
        print(f"instruction {args.instruction[:80]!r} -> trained instruction {resolved!r}", file=sys.stderr,
              flush=True)
    return resolved


def _read_obstacles(path: str | None) -> list[dict] | str | None:
    """``--obstacles``: None, "scene", or the file's list (a clear error for a missing or malformed one)."""
    if path is None or path == "scene":
        return path
    parse_obstacles = _require("policies.constraints", "--obstacles").parse_obstacles
    try:
        items = json.loads(open(path).read())
    except OSError as e:
        raise InvalidOptionError(f"--obstacles {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise InvalidOptionError(f"--obstacles {path}: not JSON ({e})") from None
    parse_obstacles(items)  # each item named where it is wrong
    return items


def _set_obstacles(client, robot, obstacles: list[dict] | str | None, args: DeployArgs) -> None:
    """Send ``--obstacles`` for the episode about to start. A goal no motion can reach without a
    collision sends nothing: one line, the robot holds still, exit ``EXIT_CONSTRAINT_REFUSED``."""
    if obstacles is None:
        return
    unsatisfiable = _require("policies.constraints", "--obstacles").unsatisfiable
    make = getattr(robot, "arm_constraints", None)
    if make is None:
        raise InvalidOptionError(f"--obstacles needs the arm's body and end-effector step, which robot {args.robot} "
                                 "does not describe yet (--robot sim on maniskill/CollisionAvoidance-v1 does)")
    c = make(None if obstacles == "scene" else obstacles)
    why = unsatisfiable(c, robot.get_observation()["state"])
    if why:
        client.close()
        print(f"groundflow deploy: obstacles refused, no motion sent: {why}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONSTRAINT_REFUSED)
    client.set_constraints(c)


def deploy(argv: list[str]) -> None:
    args = tyro.cli(DeployArgs, args=argv, prog="groundflow deploy")
    args.check()
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING))
    host, port = parse_address(args.server)
    stack: list = []
    robot = make_robot(args, stack)
    recorder, recorded = None, ""
    try:
        robot.connect()
        spec = robot.spec
        # a chunk beyond what the safety layer calls far out of limits is refused whole (deploy/serving/client.py)
        client = robot_client(host, port, spec, SafetyConfig.far_margin, timeout=args.timeout,
                              image_encoding=args.image_encoding, jpeg_quality=args.jpeg_quality)
        if args.robot == "sim":  # a real arm is no sim env: only the client's camera check applies to it
            try:
                check_policy_fits_env(client.metadata, robot, args)
            except HandshakeError:
                client.close()
                raise
        resolved = _check_instruction(client, args, robot)  # before anything moves
        obstacles = _read_obstacles(args.obstacles)
        ws = args.workspace
        if len(args.keep_out) % 4:
            raise InvalidOptionError(f"--keep-out takes x y z radius per sphere (a multiple of 4 numbers); got "
                                     f"{len(args.keep_out)}")
        fk = getattr(robot, "forward_kinematics", None) if ws or args.keep_out else None
        if (ws or args.keep_out) and fk is None:
            raise InvalidOptionError(f"--workspace and --keep-out need forward kinematics, which robot {args.robot} "
                                     "does not provide")
        safety_cfg = SafetyConfig(limit_mode=args.limit_mode, velocity_scale=args.velocity_scale,
                                  watchdog_s=args.watchdog_s, workspace_low=ws[:3] if ws else None,
                                  workspace_high=ws[3:] if ws else None,
                                  keep_out=tuple(tuple(args.keep_out[k:k + 4]) for k in range(0, len(args.keep_out), 4)))
        safety = SafetyLayer(robot, safety_cfg, dt=1.0 / args.rate, fk=fk)
        if args.record:
            recorder = Recorder(args.record, spec, overwrite=args.overwrite,
                                meta={"server": args.server, "rate_hz": args.rate})
        cfg = LoopConfig(rate_hz=args.rate, max_steps=args.max_steps, realtime=not args.lockstep, rtc=args.rtc,
                         ensemble=args.ensemble, status=args.status, seed=args.seed, instruction=args.instruction,
                         max_hold_s=max(2.0, args.timeout))
        loop = ControlLoop(robot, client, cfg, safety, recorder)
        # a simulated suite must be given the task too, or success is judged on its default task
        suite_env = getattr(getattr(robot, "env", None), "suite", None) is not None
        commanded = {"instruction": resolved or args.instruction} if args.instruction and suite_env else None
        results, lost = [], None
        with safety.signal_stop():
            if not args.lockstep:
                safety.start_watchdog()
            try:
                for i in range(args.episodes):
                    if hasattr(robot, "reset") and (i > 0 or commanded):
                        robot.reset(args.seed + i, options=commanded)
                    _set_obstacles(client, robot, obstacles, args)
                    try:
                        res = loop.run_episode(seed=args.seed + i, task_id=capability(robot, "task_id"))
                    except PolicyUnavailableError as e:  # no server to (re)connect to: keep what was recorded
                        rest = args.episodes - i - 1
                        lost = f"episode {i} could not start{f' ({rest} more not run)' if rest else ''}: {e}"
                        break
                    results.append(res.summary())
                    print(json.dumps(results[-1]), flush=True)
                    if res.reason in ("stop_signal", "driver_error"):
                        break
            finally:
                safety.stop_watchdog()
        if recorder is not None:
            path = recorder.close()
            recorded = f"; the {recorder.n_episodes} episode(s) recorded are in {path}"
            print(json.dumps({"recorded": str(path), "episodes": recorder.n_episodes}))
            recorder = None
        client.close()
    except BaseException as e:
        if recorder is not None:
            recorder.abort()
            partial = recorder.writer.tmp
            recorder = None
            if isinstance(e, DeployError) and partial.exists():  # the last line must say where the episodes are
                raise type(e)(f"{e}; the episodes recorded so far are in {partial}") from e
        raise
    finally:
        if recorder is not None:
            recorder.abort()
        if hasattr(robot, "close"):
            robot.close()
        else:
            robot.disconnect()
        for s in stack:
            s.stop()
    abnormal = [f"episode {i}: {r['reason']}" for i, r in enumerate(results) if r["reason"] not in NORMAL_ENDS]
    if lost is not None:
        abnormal.append(lost)
    if abnormal:  # a script or service manager must see that the run did not go as asked
        what = (f"the policy server {args.server} was lost; " if lost or any("policy_lost" in a for a in abnormal)
                else "")
        raise DeployError(f"{what}{len(abnormal)} of {args.episodes} episode(s) ended abnormally "
                          f"({'; '.join(abnormal)}){recorded}")
