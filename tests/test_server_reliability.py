"""Policy server reliability (#46): silent connections before the handshake, a port already in use,
malformed hello fields, and paraphrase serving (the language model loads at start-up; encoding one
client's new instructions neither stalls nor re-runs under another client's request). Real sockets
against a real ``PolicyServer`` on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from deploy.serving import protocol
from deploy.serving.client import PolicyClient
from deploy.scripted import JointTargetPolicy
from deploy.serving.server import PolicyServer

STATE, ACTION, INSTR = 35, 8, "push the cube to the goal region"


def _obs(instruction: str = INSTR) -> dict:
    return {"state": np.zeros(STATE, np.float32), "instruction": instruction}


def _scripted() -> JointTargetPolicy:
    return JointTargetPolicy(STATE, ACTION, np.zeros(7))


def _raw(port: int):
    """A bare websocket (to send what PolicyClient never would, or nothing at all)."""
    from websockets.sync.client import connect
    return connect(f"ws://127.0.0.1:{port}", compression=None, proxy=None, max_size=None, open_timeout=5)


def _wait(cond, timeout: float, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the server closed this (silent) TCP connection."""
    s.setblocking(False)
    try:
        return s.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# ---- 1. connections that never finish the handshake -----------------------------------------

def _silent_flood(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections that never send a byte, opened back to back. Each connect gets a
    timeout of its own: under CPU load the server's accept loop falls behind, the kernel's accept
    queue (128) overflows and drops SYNs that the client re-sends 1, 3, 7 s later, while a
    ``socket.setdefaulttimeout()`` some library leaves in the full run had failed the connect."""
    return [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(n)]


def test_silent_tcp_connections_are_capped_timed_out_and_do_not_lock_out_a_good_client():
    """Before: 300 silent TCP connections held 600 server threads for the 10 s websocket open
    timeout, with no cap."""
    base = threading.active_count()
    with PolicyServer(_scripted(), port=0, max_connections=4, max_pending=16, hello_timeout_s=1.5) as srv:
        socks = _silent_flood(srv.port, 300)
        try:
            # the oldest made room for the newest (the last ones may still wait in the kernel's accept queue)
            assert _wait(lambda: srv.stats["evicted"] >= 300 - 16, 10), srv.stats
            # the server holds a bounded number of threads for them (2 per connection it waits on)
            extra = threading.active_count() - base
            assert extra <= 2 * 16 + 6, f"{extra} server threads for 300 silent connections"
            t0 = time.monotonic()  # a good client is served at once, the silent ones still open
            with PolicyClient(port=srv.port, timeout=5) as c:
                assert c.infer(_obs()).actions.shape == (16, ACTION)
            assert time.monotonic() - t0 < 3
            # the silent ones still held are dropped at the handshake timeout, threads return
            assert _wait(lambda: all(_closed_by_peer(s) for s in socks), 5)
            assert _wait(lambda: threading.active_count() <= base + 1, 5), threading.active_count() - base
        finally:
            for s in socks:
                s.close()


def test_websocket_clients_that_never_say_hello_do_not_hold_connection_slots():
    """Before: a client that opened the websocket but sent no hello took a --max-connections slot
    for 10 s, so 4 of them refused every good client as 'busy'."""
    with PolicyServer(_scripted(), port=0, max_connections=4, max_pending=16, hello_timeout_s=1.5) as srv:
        silent = [_raw(srv.port) for _ in range(20)]
        for ws in silent:
            assert protocol.unpack(ws.recv(timeout=5))["type"] == "metadata"
        t0 = time.monotonic()
        with PolicyClient(port=srv.port, timeout=5) as c:
            assert c.infer(_obs()).actions.shape == (16, ACTION)
        assert time.monotonic() - t0 < 3 and srv.stats["busy"] == 0
        from websockets.exceptions import ConnectionClosed

        def closed(ws) -> bool:
            try:
                ws.recv(timeout=0.01)
            except TimeoutError:
                return False
            except ConnectionClosed:
                return True
            return False

        assert _wait(lambda: all(closed(ws) for ws in silent), 5)  # the handshake timeout closes them
        for ws in silent:
            ws.close()


# ---- 2. a port already in use -----------------------------------------------------------------

def _serve_argv(port: int) -> list[str]:
    return ["serve", "--scripted", "joint_target", "--state-dim", str(STATE), "--action-dim", str(ACTION),
            "--target", *["0"] * 7, "--port", str(port)]


def test_port_in_use_is_one_clear_line_and_a_second_server_cannot_bind(capsys):
    from deploy.errors import DeployError
    from groundflow.cli import main
    with PolicyServer(_scripted(), port=0) as first:
        port = first.port
        # no SO_REUSEPORT: on Linux it would let a second server share the port silently
        assert first._server.socket.getsockopt(socket.SOL_SOCKET, getattr(socket, "SO_REUSEPORT", 15)) == 0
        with pytest.raises(DeployError, match=f"127.0.0.1:{port}.*port {port} is already in use"):
            PolicyServer(_scripted(), port=port).bind()
        assert main(_serve_argv(port)) == 1
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("groundflow serve: error:"), err
        assert f"port {port} is already in use" in lines[0] and "Traceback" not in err
        with PolicyClient(port=port) as c:  # the first server still serves
            assert c.infer(_obs()).actions.shape == (16, ACTION)
    # another program (a plain listening socket) holding the port: the same line
    other = socket.create_server(("127.0.0.1", 0))
    try:
        assert main(_serve_argv(other.getsockname()[1])) == 1
        assert f"port {other.getsockname()[1]} is already in use" in capsys.readouterr().err
    finally:
        other.close()


# ---- 3. malformed hello fields ------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("cameras", 5), ("cameras", "wrist"), ("cameras", [["wrist"]]), ("cameras", [{"a": 1}]), ("cameras", {"wrist": 1}),
    ("image_size", "x"), ("image_size", -3), ("state_dim", "35"), ("state_dim", [35]), ("action_dim", 8.0),
    ("action_dim", True), ("action_dim", {"nested": [1, {"junk": b"\x00"}]}), ("version", "1"), ("version", [1]),
])
def test_malformed_hello_fields_get_a_bad_hello_reply_naming_the_field(field, value):
    """Before: cameras=5 raised an uncaught TypeError in the server (the client saw a bare close),
    and action_dim='8' was refused as 'policy has 8, client has 8'."""
    with PolicyServer(_scripted(), port=0) as srv:
        ws = _raw(srv.port)
        ws.recv(timeout=5)
        hello = {"type": "hello", "version": protocol.VERSION, "action_dim": ACTION, "state_dim": STATE,
                 "cameras": [], field: value}
        ws.send(protocol.pack(hello))
        answer = protocol.unpack(ws.recv(timeout=5))
        assert answer["type"] == "error" and answer["code"] == "bad_hello", answer
        assert f"hello.{field}" in answer["message"], answer["message"]
        ws.close()
        # null fields are what a client without expectations sends: still accepted
        with PolicyClient(port=srv.port) as c:
            assert c.infer(_obs()).actions.shape == (16, ACTION)
        assert srv.stats["refused"] == 1


# ---- 4. paraphrases: the language model loads at start-up, encoding stalls no one --------------

GIL_HOLD_N = 5 * 10 ** 7  # sum(range(N)): ~1 s of work that never releases the GIL
LOAD_S = 2.5


class _FakeMiniLM:
    """MiniLM stand-in: ``encode`` as sentence-transformers' (pooled, normalized), after ``hold``
    items of pure-Python work (what tokenizing and the model's Python glue cost, exaggerated)."""

    def __init__(self, hold: int = 0):
        self.hold = hold

    def encode(self, texts, convert_to_tensor=True, normalize_embeddings=True, **kw):
        import torch
        sum(range(self.hold))
        return torch.stack([torch.randn(384, generator=torch.Generator().manual_seed(len(t))) for t in texts])


def _slow_loading_minilm() -> _FakeMiniLM:
    time.sleep(LOAD_S)  # the real one takes 4-5 s to load
    return _FakeMiniLM()


def _gil_holding_minilm() -> _FakeMiniLM:
    return _FakeMiniLM(GIL_HOLD_N)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    torch = pytest.importorskip("torch")
    import policies
    cfg = policies.PolicyConfig(kind="flow", state_dim=STATE, action_dim=ACTION, horizon=8, n_exec=4, size="tiny")
    torch.manual_seed(0)
    model = policies.FlowMatchingVLA(cfg)
    rng = np.random.default_rng(0)
    model.fit_normalizer(rng.normal(size=(256, STATE)), rng.uniform(-1, 1, size=(256, ACTION)))
    model.lang.cache[INSTR] = torch.randn(1, cfg.lang_dim, generator=torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp("ckpt") / "tiny_flow"
    model.save(path)
    return path


def _use_minilm(monkeypatch, tmp_path, loader) -> None:
    """``loader`` instead of MiniLM, in this process and in the server's encoder process."""
    from policies import language
    monkeypatch.setenv("GROUNDFLOW_LANG_CACHE", str(tmp_path / "lang_cache"))
    monkeypatch.setattr(language, "_model", loader)
    monkeypatch.setattr(language, "MODEL_LOADER", loader, raising=False)


def test_paraphrase_server_loads_the_language_model_before_it_listens(tiny_ckpt, monkeypatch, tmp_path):
    """Before: the first unseen instruction loaded the model (4-5 s), and a default `groundflow
    deploy` client (2 s timeout) lost the server."""
    import policies
    _use_minilm(monkeypatch, tmp_path, _slow_loading_minilm)
    t0 = time.monotonic()
    with PolicyServer(policies.load(tiny_ckpt), port=0, paraphrases=4, allow_unknown=True) as srv:
        started = time.monotonic() - t0
        with PolicyClient(port=srv.port, timeout=2.0) as c:  # groundflow deploy's default timeout
            t1 = time.monotonic()
            assert c.infer(_obs("shove the cube onto the goal")).actions.shape == (8, ACTION)
            assert time.monotonic() - t1 < 1.5
            assert c.infer(_obs()).actions.shape == (8, ACTION)
    assert started >= LOAD_S  # the load happened before the server took clients


def test_one_client_encoding_new_instructions_does_not_stall_another(tiny_ckpt, monkeypatch, tmp_path):
    """Before: encoding ran in the server's process, so its Python work held the GIL the other
    clients' requests need (real MiniLM on 2 loaded cores: a good client's p50 / p99 went from
    ~9 / 23 ms to ~15 / 49 ms while another client flooded new instructions)."""
    import policies
    t = time.perf_counter()
    sum(range(GIL_HOLD_N))
    hold_s = time.perf_counter() - t
    _use_minilm(monkeypatch, tmp_path, _gil_holding_minilm)
    with PolicyServer(policies.load(tiny_ckpt), port=0, paraphrases=64, allow_unknown=True) as srv, \
            PolicyClient(port=srv.port, timeout=30) as good:
        good.infer(_obs())
        stop, flooded = threading.Event(), []

        def flood() -> None:
            with PolicyClient(port=srv.port, timeout=60) as c:
                while not stop.is_set():
                    c.infer(_obs(f"new instruction number {len(flooded)}"))
                    flooded.append(time.monotonic())

        th = threading.Thread(target=flood, daemon=True)
        th.start()
        lat, end = [], time.monotonic() + 30
        while len(flooded) < 3 and time.monotonic() < end:  # a robot's loop asks every ~20 ms
            t = time.perf_counter()
            good.infer(_obs())
            lat.append(time.perf_counter() - t)
            time.sleep(0.02)
        stop.set()
        th.join(timeout=30)
    assert len(flooded) >= 2, "the flood did not run"
    assert max(lat) < 0.5 * hold_s, (f"a good request took {max(lat) * 1e3:.0f} ms while another client's "
                                      f"instructions were encoded ({hold_s * 1e3:.0f} ms of GIL-holding work each)")


def test_a_new_instruction_is_not_evicted_and_re_encoded_under_the_inference_lock(tiny_ckpt, monkeypatch):
    """With --paraphrases 1, client B's new instruction evicted client A's between A's encoding and
    A's inference: A's instruction was then encoded again inside the inference lock, which stalled
    every client for an encode."""
    import torch

    import policies
    from policies.language import LanguageEncoder
    calls: list[list[str]] = []

    def encode(self, texts):
        calls.append(list(texts))
        return {t: torch.randn(1, 384, generator=torch.Generator().manual_seed(len(t))) for t in texts}

    monkeypatch.setattr(LanguageEncoder, "_encode_model", encode)
    monkeypatch.setattr(LanguageEncoder, "start_encoder_process", lambda self, *a, **k: None, raising=False)
    policy = policies.load(tiny_ckpt)
    pinned = len(policy.lang.cache)
    with PolicyServer(policy, port=0, paraphrases=1, allow_unknown=True) as srv, \
            PolicyClient(port=srv.port, timeout=10) as a, PolicyClient(port=srv.port, timeout=10) as b:
        results: dict[str, object] = {}

        def ask(name: str, c: PolicyClient, instr: str) -> None:
            try:
                results[name] = c.infer(_obs(instr)).actions.shape
            except Exception as e:  # noqa: BLE001
                results[name] = e

        with srv._lock:  # inference waits: A encodes, then B encodes, then both infer
            ta = threading.Thread(target=ask, args=("a", a, "instruction a"))
            ta.start()
            assert _wait(lambda: len(calls) == 1, 5)
            tb = threading.Thread(target=ask, args=("b", b, "instruction b"))
            tb.start()
            assert _wait(lambda: len(calls) == 2, 5)
            time.sleep(0.1)
        ta.join(10)
        tb.join(10)
        assert results == {"a": (8, ACTION), "b": (8, ACTION)}, results
    assert calls == [["instruction a"], ["instruction b"]], calls  # each encoded once, outside the lock
    assert len(policy.lang.cache) <= pinned + 1  # bounded again once no request holds them
