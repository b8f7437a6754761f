"""URRobot: the receive path against an RTDE protocol peer on loopback; the control path offline.

The peer below speaks the server side of Universal Robots' RTDE protocol (v2) as the UR
controller does on TCP 30004: protocol-version and controller-version requests, output-recipe
setup (answering each requested variable's type), start/pause, and data packages streamed at
the requested frequency. No URSim is available offline (it is a docker image).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest
from conftest import wait_for

pytest.importorskip("rtde_receive")

from deploy.errors import RobotCommandError, RobotConnectionError  # noqa: E402
from deploy.robots.ur import URRobot, check_status, servo_command, ur_spec  # noqa: E402
from envs.errors import InvalidOptionError  # noqa: E402

TYPES = {"timestamp": "DOUBLE", "actual_q": "VECTOR6D", "actual_qd": "VECTOR6D", "actual_TCP_pose": "VECTOR6D",
         "robot_mode": "INT32", "safety_mode": "INT32"}


class RTDEPeer:
    """A UR controller's RTDE server, reduced to what a receive client needs."""

    def __init__(self, host: str):
        self.q = np.array([0.0, -1.57, 1.57, -1.57, -1.57, 0.0])
        self.robot_mode, self.safety_mode = 7, 1
        self.host = host
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 30004))  # the port is fixed by the protocol
        self.sock.listen(4)
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.requests: list[str] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _send(conn: socket.socket, kind: str, payload: bytes) -> None:
        conn.sendall(struct.pack(">HB", 3 + len(payload), ord(kind)) + payload)

    @staticmethod
    def _recv(conn: socket.socket) -> tuple[str, bytes]:
        def exact(n: int) -> bytes:
            b = b""
            while len(b) < n:
                chunk = conn.recv(n - len(b))
                if not chunk:
                    raise ConnectionError("client closed")
                b += chunk
            return b
        size, kind = struct.unpack(">HB", exact(3))
        return chr(kind), exact(size - 3)

    def _package(self, names: list[str], t: float) -> bytes:
        out = b""
        for n in names:
            if n == "actual_q":
                out += struct.pack(">6d", *self.q)
            elif n in ("actual_qd",):
                out += struct.pack(">6d", *np.zeros(6))
            elif n == "actual_TCP_pose":
                out += struct.pack(">6d", 0.3, -0.1, 0.4, 0.0, 3.14, 0.0)
            elif n == "robot_mode":
                out += struct.pack(">i", self.robot_mode)
            elif n == "safety_mode":
                out += struct.pack(">i", self.safety_mode)
            elif n == "timestamp":
                out += struct.pack(">d", t)
        return out

    def _serve(self, conn: socket.socket) -> None:
        names: list[str] = []
        streaming = threading.Event()
        period = [0.008]

        def stream() -> None:
            t0 = time.monotonic()
            while streaming.is_set() and not self.stop.is_set():
                try:
                    self._send(conn, "U", bytes([1]) + self._package(names, time.monotonic() - t0))
                except OSError:
                    return
                time.sleep(period[0])

        try:
            while not self.stop.is_set():
                kind, body = self._recv(conn)
                self.requests.append(kind)
                if kind == "V":  # request protocol version -> accepted
                    self._send(conn, "V", bytes([1]))
                elif kind == "v":  # controller version 5.11.0.0
                    self._send(conn, "v", struct.pack(">IIII", 5, 11, 0, 0))
                elif kind == "O":  # output setup: double frequency, then variable names
                    (freq,) = struct.unpack(">d", body[:8])
                    period[0] = 1.0 / freq
                    names = [n for n in body[8:].decode().split(",") if n]
                    self._send(conn, "O", bytes([1]) + ",".join(TYPES.get(n, "NOT_FOUND") for n in names).encode())
                elif kind == "S":
                    self._send(conn, "S", bytes([1]))
                    streaming.set()
                    threading.Thread(target=stream, daemon=True).start()
                elif kind == "P":
                    streaming.clear()
                    self._send(conn, "P", bytes([1]))
        except (ConnectionError, OSError):
            pass
        finally:
            streaming.clear()
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        self.sock.close()


def run_peer() -> None:
    """Subprocess body: ur-rtde's C++ client blocks without releasing the GIL, so the peer
    cannot share a process with it. Commands on stdin: ``q v1..v6``, ``safety N``, ``requests``."""
    import sys
    for i in range(2, 255):
        try:
            peer = RTDEPeer(f"127.0.1.{i}")
            break
        except OSError:
            continue
    else:
        print("NOHOST", flush=True)
        return
    print(f"READY {peer.host}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "q":
            peer.q = np.array([float(x) for x in args])
        elif cmd == "safety":
            peer.safety_mode = int(args[0])
        elif cmd == "requests":
            print(" ".join(peer.requests), flush=True)
            continue
        print("OK", flush=True)
    peer.close()


class PeerProcess:
    def __init__(self):
        import subprocess
        import sys
        from pathlib import Path
        code = "import sys; sys.path.insert(0, sys.argv[1]); import test_deploy_ur as t; t.run_peer()"
        from deploy.procs import popen_tied
        self.proc = popen_tied([sys.executable, "-c", code, str(Path(__file__).parent)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).parent.parent))
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            self.close()
            pytest.skip("no free loopback address for the RTDE peer")
        self.host = line[1]

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()


@pytest.fixture()
def peer():
    p = PeerProcess()
    yield p
    p.close()


def _status_fails(robot: URRobot) -> bool:
    try:
        robot.check_status()
    except RobotCommandError:
        return True
    return False


def test_receive_path_reads_state_and_modes_from_rtde(peer):
    q0 = np.array([0.0, -1.57, 1.57, -1.57, -1.57, 0.0])
    robot = URRobot(peer.host, control=False, instruction="pick the part")
    robot.connect()
    try:
        assert robot.is_connected and peer.ask("requests").split()[:4] == ["V", "v", "O", "S"]
        # the peer streams from another process: wait for its packages with a generous bound, not a
        # fixed sleep that a loaded machine can outlast
        joints = lambda: robot.get_observation()["state"][:6]  # noqa: E731
        assert wait_for(lambda: np.allclose(joints(), q0, atol=1e-6), 10.0)
        obs = robot.get_observation()
        assert obs["state"].shape == (18,) and obs["instruction"] == "pick the part"
        np.testing.assert_allclose(obs["state"][:6], q0, atol=1e-6)
        np.testing.assert_allclose(robot.hold_action(), q0, atol=1e-6)
        robot.check_status()  # RUNNING + NORMAL
        moved = q0 + 0.25  # the arm moved: the stream carries it
        peer.ask("q " + " ".join(map(str, moved)))
        assert wait_for(lambda: np.allclose(joints(), moved, atol=1e-6), 10.0)
        np.testing.assert_allclose(robot.get_observation()["state"][:6], moved, atol=1e-6)
        peer.ask("safety 3")
        assert wait_for(lambda: _status_fails(robot), 10.0)
        with pytest.raises(RobotCommandError, match="PROTECTIVE_STOP"):
            robot.check_status()
        with pytest.raises(RobotCommandError, match="read-only"):
            robot.send_action(moved)
    finally:
        robot.disconnect()
    assert not robot.is_connected


def test_control_path_without_a_dashboard_fails_clearly(peer):
    robot = URRobot(peer.host, control=True)
    t0 = time.monotonic()
    with pytest.raises(RobotConnectionError, match="cannot start RTDE control.*dashboard"):
        robot.connect()
    assert time.monotonic() - t0 < 5 and not robot.is_connected


def test_unreachable_ur_is_a_connection_error():
    with pytest.raises(RobotConnectionError, match="cannot open RTDE"):
        URRobot("127.0.2.254", control=False).connect()


def test_servo_command_and_status_checks():
    q = [0.1, -1.2, 1.3, -1.5, -1.6, 0.2]
    args = servo_command(q, 0.05, lookahead_time=0.1, gain=300)
    assert args == (q, 0.0, 0.0, 0.05, 0.1, 300.0)
    for bad, match in [([0.0] * 5, "6 finite"), ([np.nan] * 6, "6 finite")]:
        with pytest.raises(InvalidOptionError, match=match):
            servo_command(bad, 0.05)
    with pytest.raises(InvalidOptionError, match="lookahead_time"):
        servo_command(q, 0.05, lookahead_time=0.5)
    with pytest.raises(InvalidOptionError, match="gain"):
        servo_command(q, 0.05, gain=50)
    check_status(7, 1)
    check_status(7, 2)
    with pytest.raises(RobotCommandError, match="POWER_OFF"):
        check_status(3, 1)
    with pytest.raises(RobotCommandError, match="ROBOT_EMERGENCY_STOP"):
        check_status(7, 7)
    spec = ur_spec("ur5e", control_rate_hz=50)
    assert spec.action_dim == 6 and spec.control_rate_hz == 50 and np.all(spec.velocity_limits <= np.pi)
    with pytest.raises(InvalidOptionError, match="unknown UR model"):
        ur_spec("ur99")
