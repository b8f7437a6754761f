"""Run franky-sim (a simulated Franka FR3 speaking libfranka's network protocol) on loopback.

    with FrankySim() as sim:                   # a subprocess, stopped with SIGINT
        robot = FrankaRobot(sim.host); robot.connect()

The simulator is a separate process, as the real robot is: the driver talks to it only through
libfranka's TCP/UDP protocol (robot on TCP 1337, gripper on TCP 1338, state over UDP at 1 kHz).
``host="auto"`` takes the first free loopback address from 127.0.0.2 on, so several
simulators (and test runs) can coexist.

Compatibility: franky-sim 1.0.4 is written against pinocchio >= 3 (``Frame.parentJoint``).
pinocchio >= 3 wheels (``pin``) need numpy >= 2, which this project cannot take (numpy < 2 is
required by ManiSkill's planner and robosuite), so pip resolves ``pin`` 2.7, where the same
attribute is ``Frame.parent``. The launcher aliases it when (and only when) it is missing; no
other API difference was hit by the simulator.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from deploy.errors import DriverMissingError, RobotConnectionError
from deploy.procs import popen_tied

ROOT = Path(__file__).resolve().parents[2]


def _pinocchio_compat() -> None:
    import pinocchio as pin
    if not hasattr(pin.Frame, "parentJoint") and hasattr(pin.Frame, "parent"):
        pin.Frame.parentJoint = property(lambda f: f.parent)


def available() -> str | None:
    """None when franky-sim can run here, else the reason (for skips and error messages)."""
    import importlib.util
    missing = [m for m in ("franky_sim", "mujoco", "pinocchio", "franky") if importlib.util.find_spec(m) is None]
    if missing:  # looked up, not imported: the simulator runs in its own process
        return f"franky-sim cannot run here (missing {', '.join(missing)}); pip install 'groundflow[robots]'"
    return None


def _candidates(host: str) -> list[str]:
    if host != "auto":
        return [host]
    return [f"127.0.0.{i}" for i in range(2, 255)]


def serve(host: str = "auto", realtime: float = 1.0) -> None:
    """Run the simulator in this process until SIGINT (the ``python -m deploy.robots.franka_sim`` body)."""
    from envs import platform_setup  # the simulator child process only: sets up rendering before franky_sim
    platform_setup.setup()
    _pinocchio_compat()
    from franky_sim import SimulationServer
    from franky_sim.mujoco_simulator import MujocoSimulator
    with MujocoSimulator() as sim:
        robot = sim.add_robot()
        with SimulationServer(sim, hostname_candidates=_candidates(host)) as server:
            print(f"READY {robot.hostname}", flush=True)
            try:
                server.run_forever(realtime=realtime)
            except KeyboardInterrupt:
                pass


class FrankySim:
    """franky-sim in a subprocess on loopback; ``host`` is known once ``start()`` returns."""

    def __init__(self, host: str = "auto", startup_timeout_s: float = 60.0, python: str | None = None):
        self.requested_host = host
        self.host: str | None = None
        self.startup_timeout_s = startup_timeout_s
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None

    def start(self) -> "FrankySim":
        why = available()
        if why is not None:
            raise DriverMissingError(why)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = popen_tied([self.python, "-m", "deploy.robots.franka_sim", "--host", self.requested_host],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(ROOT))
        deadline = time.monotonic() + self.startup_timeout_s
        lines: list[str] = []
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if not sel.select(timeout=0.2):
                continue
            line = self.proc.stdout.readline()
            if not line:
                continue
            lines.append(line.rstrip())
            if line.startswith("READY "):
                self.host = line.split()[1]
                return self
        out = "\n".join(lines[-20:])
        self.stop()
        raise RobotConnectionError(f"franky-sim did not start within {self.startup_timeout_s} s; its output:\n{out}")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGINT, then SIGKILL if it does not exit within ``timeout_s``; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout:
            self.proc.stdout.close()
        code, self.proc = self.proc.returncode, None
        return code

    def __enter__(self) -> "FrankySim":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="franky-sim (MuJoCo FR3) on a loopback address")
    p.add_argument("--host", default="auto", help="loopback address, or 'auto' for the first free one")
    p.add_argument("--realtime", type=float, default=1.0, help="speed factor of the 1 kHz loop (0: as fast as possible)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # inherited as ignored when the parent runs in the background of a non-interactive shell
    signal.signal(signal.SIGINT, signal.default_int_handler)
    serve(a.host, a.realtime)


if __name__ == "__main__":
    main()
