"""Policy server / client: wire format, handshake, bad input, a real tiny checkpoint, RTC."""

from __future__ import annotations

import numpy as np
import pytest

from deploy.serving import protocol
from deploy.serving.client import PolicyClient
from deploy.errors import HandshakeError, ProtocolError, ServerError
from deploy.scripted import JointTargetPolicy
from deploy.serving.faults import LyingServer
from deploy.serving.server import PolicyServer

STATE, ACTION = 35, 8


def _obs(seed: int = 0, cams: tuple[str, ...] = ()) -> dict:
    rng = np.random.default_rng(seed)
    obs = {"state": rng.normal(size=STATE).astype(np.float32), "instruction": "push the cube to the goal region"}
    if cams:
        obs["images"] = {c: rng.integers(0, 255, (224, 224, 3), dtype=np.uint8) for c in cams}
    return obs


@pytest.fixture()
def served():
    policy = JointTargetPolicy(STATE, ACTION, np.linspace(-0.5, 0.5, 7), gripper=1.0)
    with PolicyServer(policy, port=0, max_message_bytes=1 << 20) as srv:
        yield policy, srv


def _raw(srv: PolicyServer):
    """A bare websocket to the server (to send what PolicyClient never would)."""
    from websockets.sync.client import connect
    return connect(f"ws://127.0.0.1:{srv.port}", compression=None, proxy=None, max_size=None)


def test_pack_unpack_round_trip_keeps_arrays_exact():
    img = np.random.default_rng(0).integers(0, 255, (224, 224, 3), dtype=np.uint8)
    msg = {"type": "infer", "obs": {"state": np.arange(5, dtype=np.float32), "images": {"wrist": img},
                                    "instruction": "x"}, "id": 3}
    out = protocol.unpack(protocol.pack(msg))
    assert out["id"] == 3 and out["obs"]["instruction"] == "x"
    np.testing.assert_array_equal(out["obs"]["images"]["wrist"], img)
    assert out["obs"]["images"]["wrist"].dtype == np.uint8
    np.testing.assert_array_equal(out["obs"]["state"], np.arange(5, dtype=np.float32))
    # raw bytes, no per-element packing: the message is the image plus a small header
    assert len(protocol.pack(msg)) < img.nbytes + 200


@pytest.mark.parametrize("raw, match", [
    (b"\xc1\xc1garbage", "not valid msgpack"),
    ("text", "text frames"),
    (protocol.pack({"no_type": 1}), "string 'type'"),
    (b"\x93\x01\x02\x03", "map"),
])
def test_unpack_rejects_malformed_messages(raw, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.unpack(raw)


def test_unpack_rejects_lying_array_headers():
    import msgpack
    bad_len = msgpack.packb({"type": "x", "a": {"__nd__": True, "dtype": "<f4", "shape": [10], "data": b"\0" * 8}})
    with pytest.raises(ProtocolError, match="needs 40 bytes"):
        protocol.unpack(bad_len)
    bad_dtype = msgpack.packb({"type": "x", "a": {"__nd__": True, "dtype": "|O", "shape": [1], "data": b"\0" * 8}})
    with pytest.raises(ProtocolError, match="dtype"):
        protocol.unpack(bad_dtype)
    huge = msgpack.packb({"type": "x", "a": {"__nd__": True, "dtype": "<f4", "shape": [1 << 40, 1 << 40], "data": b""}})
    with pytest.raises(ProtocolError):
        protocol.unpack(huge)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        protocol.unpack(b"\0" * 100, max_bytes=50)


def test_round_trip_returns_the_policy_chunk_with_timing(served):
    policy, srv = served
    with PolicyClient(port=srv.port, expect={"action_dim": ACTION, "state_dim": STATE}) as client:
        assert client.metadata["horizon"] == 16 and client.metadata["n_exec"] == 8
        assert client.metadata["protocol"] == protocol.PROTOCOL and client.metadata["rtc"] is False
        obs = _obs(1)
        reply = client.infer(obs)
        np.testing.assert_array_equal(reply.actions, policy.predict_action_chunk(obs))
        t = reply.timing
        assert t["rtt_ms"] >= t["server_ms"] >= t["infer_ms"] >= 0
        client.reset()
        assert client.healthy


def test_mismatched_client_is_refused_with_both_dims_named(served):
    _, srv = served
    with pytest.raises(HandshakeError, match="action_dim: server's policy has 8, this client expects 7"):
        PolicyClient(port=srv.port, expect={"action_dim": 7, "state_dim": STATE})
    with pytest.raises(HandshakeError, match="cameras"):
        cams_policy = JointTargetPolicy(STATE, ACTION, np.zeros(7))
        cams_policy.config.cameras = ("wrist",)
        with PolicyServer(cams_policy, port=0) as cam_srv:
            PolicyClient(port=cam_srv.port, expect={"cameras": []})
    # the server checks too: a client that skips its own check is refused by the server
    ws = _raw(srv)
    meta = protocol.unpack(ws.recv(timeout=5))
    assert meta["action_dim"] == ACTION
    ws.send(protocol.pack({"type": "hello", "version": protocol.VERSION, "action_dim": 6, "state_dim": STATE}))
    answer = protocol.unpack(ws.recv(timeout=5))
    assert answer["type"] == "error" and answer["code"] == "mismatch"
    assert "action_dim: policy has 8, client has 6" in answer["message"]
    ws.close()
    ws = _raw(srv)
    ws.recv(timeout=5)
    ws.send(protocol.pack({"type": "hello", "version": 99}))
    assert "protocol version mismatch" in protocol.unpack(ws.recv(timeout=5))["message"]
    ws.close()
    assert srv.stats["refused"] >= 2


def test_bad_requests_get_error_replies_and_the_server_keeps_serving(served):
    policy, srv = served
    ws = _raw(srv)
    ws.recv(timeout=5)
    ws.send(protocol.pack({"type": "hello", "version": protocol.VERSION}))
    assert protocol.unpack(ws.recv(timeout=5))["type"] == "ready"
    bad = [b"\xc1not msgpack", protocol.pack({"type": "dance", "id": 1}),
           protocol.pack({"type": "infer", "id": 2, "obs": {"state": np.zeros(3, np.float32), "instruction": "x"}}),
           protocol.pack({"type": "infer", "id": 3, "obs": {"state": np.full(STATE, np.nan, np.float32), "instruction": "x"}}),
           protocol.pack({"type": "infer", "id": 4, "obs": {"state": np.zeros(STATE, np.float32), "instruction": ""}}),
           protocol.pack({"type": "infer", "id": 5, "obs": _obs(), "prefix": np.zeros((2, ACTION), np.float32)})]
    for raw in bad:
        ws.send(raw)
        reply = protocol.unpack(ws.recv(timeout=5))
        assert reply["type"] == "error" and reply["code"] == "bad_request", reply
    ws.send("a text frame")
    assert protocol.unpack(ws.recv(timeout=5))["type"] == "error"
    # the same connection still answers a good request
    ws.send(protocol.pack({"type": "infer", "id": 9, "obs": _obs()}))
    reply = protocol.unpack(ws.recv(timeout=5))
    assert reply["type"] == "chunk" and reply["id"] == 9 and reply["actions"].shape == (16, ACTION)
    ws.close()
    assert srv.stats["errors"] >= len(bad)


def test_oversized_message_is_refused_and_the_server_survives(served):
    _, srv = served  # limit 1 MiB
    client = PolicyClient(port=srv.port, max_message_bytes=8 << 20)
    big = _obs()
    big["images"] = {"huge": np.zeros((1024, 1024, 3), np.uint8)}  # 3 MiB
    with pytest.raises(ProtocolError, match="oversized"):
        client.infer(big)
    assert not client.healthy
    client.close()
    with PolicyClient(port=srv.port) as again:  # the server is still up for the next client
        assert again.infer(_obs()).actions.shape == (16, ACTION)


def test_inference_errors_are_reported_not_fatal():
    class Flaky(JointTargetPolicy):
        def predict_action_chunk(self, obs, **kw):
            if obs["instruction"] == "explode":
                raise RuntimeError("boom")
            return super().predict_action_chunk(obs)

    with PolicyServer(Flaky(STATE, ACTION, np.zeros(7)), port=0) as srv, PolicyClient(port=srv.port) as c:
        bad = _obs()
        bad["instruction"] = "explode"
        with pytest.raises(ServerError, match="inference_failed.*RuntimeError: boom"):
            c.infer(bad)
        assert c.infer(_obs()).actions.shape == (16, ACTION)


def test_unreachable_server_gives_a_clear_error():
    from deploy.errors import PolicyUnavailableError
    with pytest.raises(PolicyUnavailableError, match="cannot connect to the policy server at ws://127.0.0.1:9"):
        PolicyClient("127.0.0.1", 9, timeout=1.0)


# ---- a real tiny checkpoint ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    torch = pytest.importorskip("torch")
    import policies
    cfg = policies.PolicyConfig(kind="flow", state_dim=STATE, action_dim=ACTION, horizon=8, n_exec=4, size="tiny")
    torch.manual_seed(0)
    model = policies.FlowMatchingVLA(cfg)
    rng = np.random.default_rng(0)
    model.fit_normalizer(rng.normal(size=(256, STATE)), rng.uniform(-1, 1, size=(256, ACTION)) * np.linspace(0.5, 2, ACTION))
    # a fixed instruction feature instead of loading MiniLM (11 s): the checkpoint carries it
    model.lang.cache[_obs()["instruction"]] = torch.randn(1, cfg.lang_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # give the untrained velocity head some signal so chunks depend on the obs
        model.action_out.weight.normal_(0, 0.05)
    path = tmp_path_factory.mktemp("ckpt") / "tiny_flow"
    model.save(path)
    return path


def test_tiny_checkpoint_round_trip_matches_local_sampling(tiny_ckpt):
    import torch

    import policies
    served = policies.load(tiny_ckpt)
    local = policies.load(tiny_ckpt)
    with PolicyServer(served, port=0) as srv, \
            PolicyClient(port=srv.port, expect={"action_dim": ACTION, "state_dim": STATE, "cameras": []}) as c:
        assert c.metadata["policy_kind"] == "flow" and c.metadata["rtc"] is True and c.metadata["horizon"] == 8
        obs = _obs(3)
        remote = c.infer(obs, seed=123).actions
        torch.manual_seed(123)
        np.testing.assert_allclose(remote, local.predict_action_chunk(obs), atol=1e-5)
        assert not np.allclose(remote, c.infer(obs, seed=124).actions)


def test_rtc_prefix_is_inpainted_by_the_served_policy(tiny_ckpt):
    import policies
    policy = policies.load(tiny_ckpt)
    rng = np.random.default_rng(5)
    prefix = rng.uniform(-0.5, 0.5, size=(6, ACTION)).astype(np.float32)
    with PolicyServer(policy, port=0) as srv, PolicyClient(port=srv.port) as c:
        free, guided = [], []
        for seed in range(4):
            plain = c.infer(_obs(seed), seed=seed).actions
            rtc = c.infer(_obs(seed), prefix=prefix, frozen=3, seed=seed).actions
            # the frozen steps are exactly the committed ones
            np.testing.assert_allclose(rtc[:3], prefix[:3], atol=1e-4)
            free.append(np.abs(plain[3:6] - prefix[3:6]).mean())
            guided.append(np.abs(rtc[3:6] - prefix[3:6]).mean())
        # the soft overlap pulls the rest of the overlap toward the old plan
        assert np.mean(guided) < 0.5 * np.mean(free)


# ---- garbage chunks, instructions, idle clients ---------------------------------------------

@pytest.mark.parametrize("case", ["state_1e30", "state_3e38", "prefix_1e30", "prefix_3e38", "prefix_far"])
def test_absurd_states_and_prefixes_are_inference_failures_not_chunks(tiny_ckpt, case):
    import policies
    obs = _obs(2)
    kw: dict = {}
    if case.startswith("state"):
        obs["state"] = np.full(STATE, 1e30 if case == "state_1e30" else 3e38, np.float32)
    else:  # finite prefixes the policy must inpaint: NaN chunks, or chunks 1000x outside the trained range
        kw = {"prefix": np.full((6, ACTION), {"prefix_1e30": 1e30, "prefix_3e38": 3e38, "prefix_far": 1e3}[case],
                                np.float32), "frozen": 3}
    with PolicyServer(policies.load(tiny_ckpt), port=0) as srv, PolicyClient(port=srv.port) as c:
        with pytest.raises(ServerError, match=r"inference_failed.*(not finite|far outside)"):
            c.infer(obs, seed=0, **kw)
        lo, hi = np.asarray(c.metadata["action_low"]), np.asarray(c.metadata["action_high"])
        assert lo.shape == hi.shape == (ACTION,) and np.all(hi - lo > 0)
        good = c.infer(_obs(2), seed=0).actions  # the connection and the policy still serve
        assert np.all(np.isfinite(good)) and np.all((good >= lo) & (good <= hi))
    robot_bounds = (np.full(ACTION, -5.0), np.full(ACTION, 5.0))
    with PolicyServer(JointTargetPolicy(STATE, ACTION, np.zeros(7)), port=0) as srv, \
            PolicyClient(port=srv.port, action_bounds=robot_bounds) as c:
        assert c.metadata["action_low"] is None  # no trained range: the robot's action space bounds chunks
        if case.startswith("state"):
            with pytest.raises(ProtocolError, match="far outside"):
                c.infer(obs)  # the scripted policy plans to move to the absurd joint positions


def test_client_refuses_chunks_that_are_not_finite_or_outside_the_bounds(tiny_ckpt):
    import policies
    robot_bounds = (np.full(ACTION, -8.0), np.full(ACTION, 8.0))  # wider than the trained range (+-2.1)
    with LyingServer(policies.load(tiny_ckpt), port=0) as srv, \
            PolicyClient(port=srv.port, action_bounds=robot_bounds) as c:
        hi = np.asarray(c.metadata["action_high"])
        good = c.infer(_obs(), seed=0).actions
        assert hi[7] > 9.0 and np.all(np.abs(good) < 8.0)
        for garbage, match in [(np.full((8, ACTION), np.nan, np.float32), "not finite"),
                               (np.full((8, ACTION), 1e30, np.float32), "far outside"),
                               (np.tile(hi.astype(np.float32) * 1.01, (8, 1)), "far outside"),
                               # inside what the server announced, outside the robot's action space
                               (np.where(np.arange(ACTION) == 7, 9.0, good).astype(np.float32), "dim 7 reaches 9")]:
            srv.garbage = garbage
            with pytest.raises(ProtocolError, match=match):
                c.infer(_obs(), seed=0)
        srv.garbage = good
        np.testing.assert_array_equal(c.infer(_obs(), seed=0).actions, good)
        assert c.healthy
    with pytest.raises(HandshakeError, match="action_bounds"):
        with PolicyServer(policies.load(tiny_ckpt), port=0) as srv:
            PolicyClient(port=srv.port, action_bounds=(np.zeros(3), np.ones(3)))


def test_bare_client_checks_rows_dims_and_magnitude_without_any_bounds():
    """A server that announces no bounds (a scripted policy) and a client given none: before, a 1e30
    chunk and a 100,000-row chunk were accepted as plans."""
    f32 = np.float32
    with LyingServer(JointTargetPolicy(STATE, ACTION, np.zeros(7)), port=0) as srv, PolicyClient(port=srv.port) as c:
        assert c.metadata["action_low"] is None and c.metadata["horizon"] == 16 and c.action_bounds is None
        good = c.infer(_obs()).actions
        for garbage, match in [(np.full((16, ACTION), 1e30, f32), r"dim 0 reaches 1e\+30, bounds \[-1e\+06, 1e\+06\]"),
                               (np.where(np.arange(ACTION) == 5, -2e6, good).astype(f32), "dim 5 reaches -2e"),
                               (np.zeros((100_000, ACTION), f32), "100000 rows; the server announced a horizon of 16"),
                               (np.zeros((17, ACTION), f32), "17 rows"),
                               (np.zeros((0, ACTION), f32), r"\(H, 8\) array"),
                               (np.zeros((16, ACTION + 1), f32), r"\(H, 8\) array, got \(16, 9\)"),
                               (np.zeros((16, ACTION, 1), f32), r"\(H, 8\) array"),
                               (np.full((16, ACTION), np.inf, f32), "not finite")]:
            srv.garbage = garbage
            with pytest.raises(ProtocolError, match=match):
                c.infer(_obs())
        srv.garbage = np.full((4, ACTION), 1e5, f32)  # a short chunk of large but plausible values is a plan
        np.testing.assert_array_equal(c.infer(_obs()).actions, srv.garbage)
        assert c.healthy
    server = LyingServer(JointTargetPolicy(STATE, ACTION, np.zeros(7)), port=0)
    server.metadata["horizon"] = None  # no horizon announced: a cap on the rows still holds
    with server as srv, PolicyClient(port=srv.port) as c:
        srv.garbage = np.zeros((100_000, ACTION), f32)
        with pytest.raises(ProtocolError, match="100000 rows; the limit is 1024"):
            c.infer(_obs())
    server = PolicyServer(JointTargetPolicy(STATE, ACTION, np.zeros(7)), port=0)
    server.metadata["horizon"] = 100_000
    with server as srv, pytest.raises(HandshakeError, match="horizon must be an integer in"):
        PolicyClient(port=srv.port)


@pytest.fixture()
def fake_minilm(monkeypatch, tmp_path):
    """MiniLM stand-in (no 11 s load) that records each call; the disk cache in a temp folder."""
    import torch

    from policies.language import LanguageEncoder
    calls: list[list[str]] = []
    monkeypatch.setenv("GROUNDFLOW_LANG_CACHE", str(tmp_path / "lang_cache"))

    def encode(self, texts):
        calls.append(list(texts))
        return {t: torch.randn(1, 384, generator=torch.Generator().manual_seed(len(t))) for t in texts}

    monkeypatch.setattr(LanguageEncoder, "_encode_model", encode)
    monkeypatch.setattr(LanguageEncoder, "start_encoder_process", lambda self: None)  # encode() above, here
    return calls, tmp_path / "lang_cache"


def test_server_serves_only_the_checkpoint_instructions_and_caps_their_length(tiny_ckpt, fake_minilm):
    import policies
    calls, disk = fake_minilm
    policy = policies.load(tiny_ckpt)
    known = set(policy.lang.cache)
    with PolicyServer(policy, port=0) as srv, PolicyClient(port=srv.port) as c:
        for i in range(300):
            with pytest.raises(ServerError, match="unknown_instruction.*not trained on"):
                c.infer({**_obs(), "instruction": f"please do task number {i}"})
        with pytest.raises(ServerError, match="bad_request.*1000000 characters; the limit is 512"):
            c.infer({**_obs(), "instruction": "x" * 1_000_000})
        assert c.infer(_obs()).actions.shape == (8, ACTION)
    assert calls == [] and set(policy.lang.cache) == known  # nothing encoded, nothing kept
    assert not disk.exists() or not any(disk.iterdir())


def test_paraphrases_are_encoded_outside_the_lock_kept_bounded_and_never_written(tiny_ckpt, fake_minilm):
    import policies
    from policies.language import LanguageEncoder
    calls, disk = fake_minilm
    policy = policies.load(tiny_ckpt)
    known = set(policy.lang.cache)
    srv = PolicyServer(policy, port=0, paraphrases=3, allow_unknown=True)
    locked: list[bool] = []
    encode = LanguageEncoder._encode_model

    def watched(self, texts):
        locked.append(srv._lock.locked())
        return encode(self, texts)

    LanguageEncoder._encode_model = watched
    try:
        with srv, PolicyClient(port=srv.port) as c:
            for i in range(20):
                assert c.infer({**_obs(), "instruction": f"push the cube to goal {i}"}).actions.shape == (8, ACTION)
                assert len(policy.lang.cache) <= len(known) + 3
            assert c.infer(_obs()).actions.shape == (8, ACTION)  # the checkpoint's instructions stay pinned
    finally:
        LanguageEncoder._encode_model = encode
    assert len(calls) == 20 and locked == [False] * 20  # one encode each, never under the inference lock
    assert known <= set(policy.lang.cache) and not disk.exists()
    # training keeps its behaviour: every instruction kept and shared through the disk cache
    lang = LanguageEncoder()
    lang.warm([f"task {i}" for i in range(5)])
    assert len(lang.cache) == 5 and len(list(disk.iterdir())) == 5


def test_idle_clients_are_closed_and_connections_are_capped():
    import threading
    import time

    from deploy.errors import PolicyUnavailableError
    base = threading.active_count()
    policy = JointTargetPolicy(STATE, ACTION, np.zeros(7))
    deadline = time.monotonic() + 30  # generous bounded waits: only the order of events matters
    # the cap (no idle timeout here, so nothing but the test frees a slot)
    with PolicyServer(policy, port=0, max_connections=2, idle_timeout_s=None) as srv:
        a, b = PolicyClient(port=srv.port), PolicyClient(port=srv.port)
        for _ in range(5):  # a third client is refused at once, every time
            with pytest.raises(PolicyUnavailableError, match="busy.*maximum of 2 connections"):
                PolicyClient(port=srv.port)
        assert srv.stats["busy"] == 5 and srv.open_connections == 2 and a.healthy and b.healthy
        a.close()
        while srv.open_connections > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with PolicyClient(port=srv.port) as c:  # the freed slot is served
            assert c.infer(_obs()).actions.shape == (16, ACTION)
        b.close()
    # the idle timeout
    with PolicyServer(policy, port=0, idle_timeout_s=0.3) as srv:
        idle = [PolicyClient(port=srv.port) for _ in range(3)]
        while (any(c.healthy for c in idle) or srv.open_connections) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.stats["idle_closed"] == 3 and srv.open_connections == 0
        with pytest.raises(PolicyUnavailableError, match="idle for more than 0.3 s"):
            idle[0].infer(_obs())
        for c in idle:
            c.close()
    while threading.active_count() > base and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threading.active_count() <= base, "connection threads outlived their connections"
