"""``PolicyClient``: the robot-computer side of the policy server protocol (``deploy.serving.protocol``).

    client = PolicyClient("127.0.0.1", 8000, timeout=2.0, expect={"action_dim": 8, "state_dim": 35})
    reply = client.infer(obs)          # reply.actions (H, A), reply.timing {"rtt_ms", "infer_ms", ...}

Images go as raw uint8 arrays by default (the fastest on loopback); ``image_encoding="png"``
(lossless) or ``"jpeg"`` (lossy, ``jpeg_quality``) sends them as compressed files, for slow links.
A server that does not announce the encoding (older servers announce none: raw only) is refused at
connect. ``reply.timing["encode_ms"]`` is the client's encoding time, outside ``rtt_ms``.

The handshake checks both ways: the client compares the server's metadata with ``expect`` and
the server compares the client's hello with its policy; either refuses with a message naming
both sides. ``healthy`` turns False as soon as the connection drops (the websocket's reader
thread sees the close), which the control loop's watchdog reads every tick.

Every chunk received must be finite and inside the action bounds the server announced, and
inside ``action_bounds`` (the robot's action space, widened as the caller sees fit) when given;
whatever the bounds, it must have the announced action dimension, at most the announced horizon
of rows (``MAX_CHUNK_ROWS`` where none is announced) and no entry beyond ``MAX_ACTION_MAGNITUDE``.
Anything else raises ``ProtocolError`` and never becomes a plan.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deploy.serving import protocol
from deploy.errors import (ConstraintRefusedError, HandshakeError, InstructionRefusedError, PolicyUnavailableError,
                           ProtocolError, ServerError)
from deploy.serving.inference import can_constrain, infer_chunk, infer_constrained, policy_metadata, resolve_obs_instruction
from envs.errors import InvalidOptionError
from policies.rtc_config import RTCConfig


MAX_CHUNK_ROWS = 1024
"""the most rows a reply chunk may have where the server announces no horizon, and the largest
horizon a server may announce (a 100,000-row chunk is garbage, not a plan)"""
MAX_ACTION_MAGNITUDE = 1e6
"""no action entry (joint position, velocity, gripper command in env units) is this large: beyond
it a chunk is refused even when neither the server nor the caller gives bounds"""


@dataclass
class ChunkReply:
    actions: np.ndarray
    timing: dict[str, float] = field(default_factory=dict)
    hold: str | None = None
    """why the robot must hold instead (no chunk passed the constraints' check; ``actions`` is empty)"""


def _hold_reply(meta: dict[str, Any], timing: dict[str, float], why: str | None) -> ChunkReply:
    """The reply that asks the robot to hold: no actions, and why."""
    return ChunkReply(np.zeros((0, meta["action_dim"]), np.float32), timing, hold=why)


def _effective(constraints: Any) -> Any:
    """``constraints``, or None where they name no obstacle: nothing to avoid is no constraint (the server
    reads an empty list so), in process as through the server."""
    return None if constraints is None or not constraints.obstacles else constraints


def parse_address(address: str, default_port: int = 8000) -> tuple[str, int]:
    """``HOST:PORT`` (or ``HOST``) -> (host, port), with a clear error for anything else."""
    host, _, port = address.rpartition(":") if ":" in address else (address, "", str(default_port))
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"server address must be HOST:PORT, got {address!r}") from None
    if not host or not 0 < p < 65536:
        raise ValueError(f"server address must be HOST:PORT with 0 < PORT < 65536, got {address!r}")
    return host, p


def robot_client(host: str, port: int, spec: Any, far_margin: float, timeout: float = 10.0, *,
                 image_encoding: str = "raw", jpeg_quality: int = 90) -> "PolicyClient":
    """The client every robot-facing path uses (``groundflow deploy``, ``evaluate_via_server``): the
    handshake expects the robot's dims and cameras, and a chunk beyond the robot's limits widened by the
    safety layer's ``far_margin`` is refused whole (the loop holds and asks again), so what a simulated
    evaluation measures is what the deploy command does. ``image_encoding``/``jpeg_quality``: how camera
    images cross the wire (``PolicyClient``)."""
    return PolicyClient(host, port, timeout=timeout, image_encoding=image_encoding, jpeg_quality=jpeg_quality,
                        expect={"action_dim": spec.action_dim, "state_dim": spec.state_dim,
                                "cameras": list(spec.cameras)},
                        action_bounds=protocol.widen_bounds(spec.action_low, spec.action_high, far_margin))


class PolicyClient:
    def __init__(self, host: str = "127.0.0.1", port: int = 8000, timeout: float = 5.0, *,
                 expect: dict[str, Any] | None = None, max_message_bytes: int = protocol.MAX_MESSAGE_BYTES,
                 connect: bool = True, action_bounds: tuple[Any, Any] | None = None,
                 image_encoding: str = "raw", jpeg_quality: int = 90):
        if image_encoding not in protocol.IMAGE_ENCODINGS:
            raise InvalidOptionError(f"image_encoding must be one of {list(protocol.IMAGE_ENCODINGS)}, "
                                     f"got {image_encoding!r}")
        if isinstance(jpeg_quality, bool) or not isinstance(jpeg_quality, int) or not 1 <= jpeg_quality <= 100:
            raise InvalidOptionError(f"jpeg_quality must be an integer in [1, 100], got {jpeg_quality!r}")
        self.image_encoding, self.jpeg_quality = image_encoding, jpeg_quality
        self.host, self.port, self.timeout = host, int(port), float(timeout)
        self.expect = dict(expect or {})
        self.max_message_bytes = int(max_message_bytes)
        self.action_bounds = None if action_bounds is None else tuple(
            np.asarray(b, np.float64).reshape(-1) for b in action_bounds)
        self.server_bounds: tuple[np.ndarray, np.ndarray] | None = None
        self.metadata: dict[str, Any] = {}
        self._ws = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._failed: str | None = None
        self.constraints: Any = None
        """the obstacles this client set (``set_constraints``), sent again after a reconnect"""
        if connect:
            self.connect()

    @property
    def uri(self) -> str:
        return f"ws://{self.host}:{self.port}"

    # ----- connection -----------------------------------------------------------------------
    def connect(self) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed, InvalidHandshake
        from websockets.sync.client import connect
        try:
            self._ws = connect(self.uri, compression=None, max_size=self.max_message_bytes,
                               open_timeout=self.timeout, ping_interval=None, proxy=None)
        except (OSError, InvalidHandshake, TimeoutError) as e:
            raise PolicyUnavailableError(f"cannot connect to the policy server at {self.uri}: {e}") from e
        try:
            meta = protocol.unpack(self._ws.recv(timeout=self.timeout), self.max_message_bytes)
            if meta.get("type") == "error" and meta.get("code") == "busy":
                self.close()
                raise PolicyUnavailableError(f"policy server {self.uri} is busy: {meta.get('message')}")
            if meta.get("type") != "metadata" or meta.get("protocol") != protocol.PROTOCOL:
                raise HandshakeError(f"{self.uri} is not a groundflow policy server (first message {meta.get('type')!r})")
            if meta.get("version") != protocol.VERSION:
                raise HandshakeError(f"protocol version mismatch: server {self.uri} speaks v{meta.get('version')}, "
                                     f"this client v{protocol.VERSION}")
            self._check_expectations(meta)
            hello = {"type": "hello", "version": protocol.VERSION}
            hello.update({k: self.expect.get(k) for k in ("action_dim", "state_dim", "cameras")})
            if hello["cameras"] is not None:
                hello["cameras"] = list(hello["cameras"])
            self._ws.send(protocol.pack(hello))
            answer = protocol.unpack(self._ws.recv(timeout=self.timeout), self.max_message_bytes)
            if answer.get("type") == "error":
                raise HandshakeError(f"policy server {self.uri} refused this client: {answer.get('message')}")
            if answer.get("type") != "ready":
                raise HandshakeError(f"unexpected handshake answer {answer.get('type')!r} from {self.uri}")
        except (HandshakeError, ProtocolError):
            self.close()
            raise
        except TimeoutError as e:
            self.close()
            raise PolicyUnavailableError(f"policy server {self.uri} did not finish the handshake in {self.timeout} s") from e
        except ConnectionClosed as e:
            self.close()
            raise HandshakeError(f"policy server {self.uri} closed the connection during the handshake: "
                                 f"{_close_reason(e)}") from e
        self.metadata = meta
        self.server_bounds = _announced_bounds(meta)
        self._failed = None
        if self.constraints is not None:  # a new connection starts without them
            self.set_constraints(self.constraints)
        return meta

    def _check_expectations(self, meta: dict[str, Any]) -> None:
        problems = []
        for key in ("action_dim", "state_dim"):
            want = self.expect.get(key)
            if want is not None and meta.get(key) != want:
                problems.append(f"{key}: server's policy has {meta.get(key)}, this client expects {want}")
        cams = self.expect.get("cameras")
        if cams is not None and not set(meta.get("cameras", [])) <= set(cams):
            problems.append(f"cameras: server's policy needs {sorted(meta.get('cameras', []))}, "
                            f"this client provides {sorted(cams)}")
        accepted = meta.get("image_encodings") or ["raw"]  # servers before image encodings take raw arrays only
        if not isinstance(accepted, list) or self.image_encoding not in accepted:
            problems.append(f"image_encoding: the server accepts {str(accepted)[:80]}, this client asks for "
                            f"{self.image_encoding!r}")
        n = meta.get("action_dim")
        for key, top in (("action_dim", None), ("horizon", MAX_CHUNK_ROWS)):
            v = meta.get(key)
            if key == "horizon" and v is None:
                continue  # not announced: replies are capped at MAX_CHUNK_ROWS
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (top is not None and v > top):
                problems.append(f"{key} must be an integer in [1, {top or 'inf'}], got {str(v)[:40]}")
        for key in ("action_low", "action_high"):
            b = meta.get(key)
            if b is not None and (not isinstance(b, list) or len(b) != n
                                  or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in b)):
                problems.append(f"{key} must be a list of {n} numbers, got {str(b)[:80]}")
        if self.action_bounds is not None and any(len(b) != n for b in self.action_bounds):
            problems.append(f"action_bounds: this client's have {len(self.action_bounds[0])} dims, "
                            f"the server's policy {n}")
        if problems:
            raise HandshakeError(f"policy server {self.uri} does not fit this client: " + "; ".join(problems))

    @property
    def healthy(self) -> bool:
        """False once the connection dropped or a request failed for transport reasons."""
        if self._ws is None or self._failed is not None:
            return False
        from websockets.protocol import State
        return self._ws.protocol.state is State.OPEN

    @property
    def failure(self) -> str | None:
        return self._failed

    def close(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:
                pass
        self._ws = None

    def __enter__(self) -> "PolicyClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- requests -------------------------------------------------------------------------
    def infer(self, obs: dict[str, Any], *, prefix: np.ndarray | None = None, frozen: int = 0,
              seed: int | None = None) -> ChunkReply:
        """Send one observation, return the chunk. ``prefix``/``frozen`` ask for RTC inpainting."""
        t0 = time.perf_counter()
        msg: dict[str, Any] = {"type": "infer", "obs": _wire_obs(obs, self.image_encoding, self.jpeg_quality)}
        encode_ms = (time.perf_counter() - t0) * 1e3
        if prefix is not None:
            msg["prefix"] = np.asarray(prefix, np.float32)
            msg["frozen"] = int(frozen)
        if seed is not None:
            msg["seed"] = int(seed)
        reply, rtt = self._request(msg)
        timing = {k: float(v) for k, v in (reply.get("timing") or {}).items() if isinstance(v, (int, float))}
        timing["rtt_ms"] = rtt * 1e3
        timing["encode_ms"] = encode_ms
        timing["overhead_ms"] = timing["rtt_ms"] - timing.get("infer_ms", 0.0)
        if reply.get("type") == "hold" and self.constraints is not None:
            reason = reply.get("reason")
            return _hold_reply(self.metadata, timing, reason if isinstance(reason, str) and reason
                               else "the server asked for a hold")
        actions = check_reply_chunk(reply.get("actions"), self.metadata, self.server_bounds, self.action_bounds)
        return ChunkReply(actions, timing)

    def set_constraints(self, constraints: Any) -> None:
        """Obstacles every later request is guided around and checked against
        (``policies.constraints.ArmConstraints``; None clears them). A reply may then be a hold
        (``ChunkReply.hold``). Raises ``ServerError`` when the server refuses them (bad geometry, a
        policy it cannot guide)."""
        constraints = _effective(constraints)
        if constraints is not None and not self.metadata.get("constraints"):
            raise ServerError(f"the policy server at {self.uri} takes no obstacles (its policy is "
                              f"{self.metadata.get('policy_kind') or 'unknown'}; guidance needs a flow policy)",
                              "bad_request")
        msg = {"type": "constraints", **(constraints.to_message() if constraints is not None else {"obstacles": []})}
        self._request(msg)
        self.constraints = constraints

    def reset(self) -> None:
        """Tell the server a new episode starts (clears the policy's cached chunk)."""
        self._request({"type": "reset"})

    def resolve_instruction(self, text: str) -> str | None:
        """The trained instruction the server would condition its policy on for ``text`` (no
        inference, no motion): what ``groundflow deploy`` checks before its first command. Raises
        ``InstructionRefusedError`` when the server refuses it; None from a server that predates the
        ``resolve`` message (it is then refused, if at all, at the first request)."""
        try:
            reply, _ = self._request({"type": "resolve", "instruction": text})
        except InstructionRefusedError:
            raise
        except ServerError as e:
            if e.code == "bad_request" and "'resolve'" in str(e):
                return None
            raise
        got = reply.get("instruction")
        return got if isinstance(got, str) else None

    def _request(self, msg: dict[str, Any]) -> tuple[dict[str, Any], float]:
        from websockets.exceptions import ConnectionClosed
        with self._lock:
            if self._ws is None:
                raise PolicyUnavailableError(f"not connected to the policy server at {self.uri}")
            req_id = next(self._ids)
            msg["id"] = req_id
            raw = protocol.pack(msg)
            if len(raw) > self.max_message_bytes:
                raise ProtocolError(f"request of {len(raw)} bytes exceeds the limit of {self.max_message_bytes} bytes")
            t0 = time.perf_counter()
            deadline = t0 + self.timeout
            try:
                self._ws.send(raw)
                while True:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise TimeoutError
                    reply = protocol.unpack(self._ws.recv(timeout=left), self.max_message_bytes)
                    if reply.get("id") in (req_id, None):
                        break  # replies to earlier, timed-out requests are dropped
            except TimeoutError as e:
                self._failed = f"no reply within {self.timeout} s"
                raise PolicyUnavailableError(f"policy server {self.uri} did not answer within {self.timeout} s") from e
            except ConnectionClosed as e:
                self._failed = f"connection closed: {_close_reason(e)}"
                if e.rcvd is not None and e.rcvd.code == 1009:
                    raise ProtocolError(f"policy server {self.uri} refused an oversized message: {e.rcvd.reason}") from e
                raise PolicyUnavailableError(f"policy server {self.uri} closed the connection: {_close_reason(e)}") from e
            rtt = time.perf_counter() - t0
        if reply.get("type") == "error":
            code, reason = reply.get("code"), reply.get("reason")
            cls = {"unknown_instruction": InstructionRefusedError,
                   "unsatisfiable": ConstraintRefusedError}.get(code, ServerError)
            raise cls(f"policy server error ({code}): {reply.get('message')}", code,
                      reason if isinstance(reason, str) else None)
        return reply, rtt


def check_reply_chunk(actions: Any, meta: dict[str, Any], *bounds: tuple[Any, Any] | None) -> np.ndarray:
    """What ``PolicyClient.infer`` accepts from the wire, whatever the server checked: a finite
    (rows, action_dim) array with 1 <= rows <= the announced horizon (``MAX_CHUNK_ROWS`` where none
    is announced), inside each of ``bounds`` given, and no entry beyond ``MAX_ACTION_MAGNITUDE`` even
    where no bounds are known (a server announcing none, a bare client)."""
    action_dim = meta["action_dim"]
    a = protocol.check_chunk(actions, action_dim)
    horizon = meta.get("horizon") or MAX_CHUNK_ROWS
    if a.shape[0] > horizon:
        said = (f"the server announced a horizon of {horizon}" if meta.get("horizon")
                else f"the limit is {MAX_CHUNK_ROWS} (the server announced no horizon)")
        raise ProtocolError(f"reply action chunk has {a.shape[0]} rows; {said}")
    plausible = (np.full(action_dim, -MAX_ACTION_MAGNITUDE), np.full(action_dim, MAX_ACTION_MAGNITUDE))
    for b in (*bounds, plausible):
        if b is not None:
            a = protocol.check_chunk(a, action_dim, b)
    return a


def _announced_bounds(meta: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """The chunk bounds in a server's metadata (None for policies without a trained range)."""
    lo, hi = meta.get("action_low"), meta.get("action_high")
    if lo is None or hi is None:
        return None
    return np.asarray(lo, np.float64), np.asarray(hi, np.float64)


def _wire_obs(obs: dict[str, Any], image_encoding: str = "raw", jpeg_quality: int = 90) -> dict[str, Any]:
    out: dict[str, Any] = {"state": np.asarray(obs["state"], np.float32), "instruction": obs.get("instruction", "")}
    if obs.get("images"):
        out["images"] = {k: protocol.encode_image(v, image_encoding, jpeg_quality) for k, v in obs["images"].items()}
    return out


def _close_reason(e: Any) -> str:
    frame = getattr(e, "rcvd", None)
    if frame is None:
        return "no close frame (connection lost)"
    return f"code {frame.code}: {frame.reason or 'no reason given'}"


class LocalPolicy:
    """A policy in this process behind the ``PolicyClient`` interface (no network): for
    simulation runs and to measure what the transport costs."""

    def __init__(self, policy: Any, rtc: RTCConfig | None = None, allow_unknown: bool = False):
        self.policy = policy
        self.allow_unknown = allow_unknown
        """run an instruction the checkpoint cannot ground as is (``infer_chunk``)"""
        self.metadata = policy_metadata(policy, protocol.MAX_MESSAGE_BYTES)
        self.bounds = _announced_bounds(self.metadata)
        self.rtc_config = rtc or RTCConfig()
        self.healthy = True
        self.constraints: Any = None

    def infer(self, obs: dict[str, Any], *, prefix: np.ndarray | None = None, frozen: int = 0,
              seed: int | None = None) -> ChunkReply:
        t0 = time.perf_counter()
        hold = None
        if self.constraints is None:
            actions = infer_chunk(self.policy, obs, prefix, frozen, seed, self.rtc_config, self.allow_unknown)
        else:
            if prefix is not None:
                raise InvalidOptionError("a request under obstacles cannot continue a prefix (real-time chunking)")
            planned = infer_constrained(self.policy, obs, self.constraints, seed, self.allow_unknown)
            actions, hold = planned.actions, planned.why or None
        ms = (time.perf_counter() - t0) * 1e3
        timing = {"infer_ms": ms, "rtt_ms": ms, "overhead_ms": 0.0}
        if actions is None:
            return _hold_reply(self.metadata, timing, hold)
        return ChunkReply(protocol.check_chunk(actions, self.metadata["action_dim"], self.bounds), timing)

    def set_constraints(self, constraints: Any) -> None:
        """As ``PolicyClient.set_constraints``, in process."""
        constraints = _effective(constraints)
        if constraints is not None:
            why = can_constrain(self.policy)
            if why is not None:
                raise InvalidOptionError(why)
            constraints.check_state(self.metadata["state_dim"])
        self.constraints = constraints

    def resolve_instruction(self, text: str) -> str | None:
        """As ``PolicyClient.resolve_instruction``, in process (``UnknownInstructionError`` on refusal)."""
        return resolve_obs_instruction(self.policy, {"instruction": text}, self.allow_unknown)["instruction"]

    def reset(self) -> None:
        if hasattr(self.policy, "reset"):
            self.policy.reset()

    def close(self) -> None:
        pass

