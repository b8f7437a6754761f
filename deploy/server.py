"""``PolicyServer``: serve a policy over websockets + msgpack (the GPU workstation side).

One request is one observation, one reply is one action chunk in env units with the server's
timing. On connect the server sends its metadata (dims, cameras, chunk size, protocol version)
and refuses a client whose dims or cameras differ, with a message that names both sides. Bad
requests (malformed msgpack, wrong shapes, unknown types, failing inference) get an error reply
and the connection stays open; a message over ``max_message_bytes`` is closed by the websocket
layer with code 1009 and its reason. The server keeps serving other and later clients either
way. Inference is serialized by a lock (one policy, one device).

Clients cannot grow the server or stall each other: at most ``max_connections`` at a time (the
next one gets a ``busy`` error), a connection idle for ``idle_timeout_s`` is closed, instructions
are capped in length, a policy with a vocabulary serves only its checkpoint's instructions unless
``paraphrases`` > 0 (then at most that many others are kept, never written to disk), and new
instructions are encoded outside the inference lock. Images may come PNG- or JPEG-encoded (the
formats in ``image_encodings``, announced in the metadata); they are decoded, header checked first,
where observations are validated (``protocol.check_observation``), so a hostile image is a
``bad_request`` like any other. Every chunk sent is finite and inside the
policy's trained action range widened by ``action_margin``; anything else is ``inference_failed``.

Loopback (127.0.0.1) is the default: serving on another interface must be asked for.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from deploy import protocol
from deploy.errors import ProtocolError
from deploy.inference import action_bounds, infer_chunk, policy_metadata
from envs.errors import InvalidOptionError
from policies.model import NULL_INSTRUCTION
from policies.rtc import RTCConfig

log = logging.getLogger("groundflow.deploy.server")


def check_hello(meta: dict[str, Any], hello: dict[str, Any]) -> str | None:
    """Return why a client's hello does not fit the served policy (None when it fits)."""
    if hello.get("version") != protocol.VERSION:
        return (f"protocol version mismatch: server speaks {protocol.PROTOCOL} v{protocol.VERSION}, "
                f"client v{hello.get('version')!r}")
    problems = []
    for key in ("action_dim", "state_dim"):
        if key in hello and hello[key] is not None and hello[key] != meta[key]:
            problems.append(f"{key}: policy has {meta[key]}, client has {hello[key]}")
    if "cameras" in hello and hello["cameras"] is not None:
        need = set(meta["cameras"])
        have = set(hello["cameras"] or [])
        if not need <= have:
            problems.append(f"cameras: policy needs {sorted(need)}, client provides {sorted(have)}")
    if problems:
        return "client does not fit the served policy: " + "; ".join(problems)
    return None


class PolicyServer:
    """Serve ``policy`` (the interface ``deploy.inference`` describes)."""

    def __init__(self, policy: Any, host: str = "127.0.0.1", port: int = 8000, *,
                 max_message_bytes: int = protocol.MAX_MESSAGE_BYTES, rtc: RTCConfig | None = None,
                 hello_timeout_s: float = 10.0, idle_timeout_s: float | None = 60.0, max_connections: int = 16,
                 paraphrases: int = 0, action_margin: float = protocol.ACTION_MARGIN,
                 image_encodings: tuple[str, ...] = protocol.IMAGE_ENCODINGS):
        image_encodings = tuple(image_encodings)
        if "raw" not in image_encodings or not set(image_encodings) <= set(protocol.IMAGE_ENCODINGS):
            raise InvalidOptionError(f"image_encodings must include 'raw' and be among "
                                     f"{list(protocol.IMAGE_ENCODINGS)}, got {list(image_encodings)}")
        if max_connections < 1 or paraphrases < 0 or not action_margin >= 0:
            raise InvalidOptionError(f"need max_connections >= 1, paraphrases >= 0 and action_margin >= 0, got "
                                     f"{max_connections}, {paraphrases}, {action_margin}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise InvalidOptionError(f"idle_timeout_s must be > 0 (or None: never), got {idle_timeout_s}")
        self.policy = policy
        self.host, self._port = host, int(port)
        self.max_message_bytes = int(max_message_bytes)
        self.rtc_config = rtc or RTCConfig()
        self.metadata = policy_metadata(policy, self.max_message_bytes, action_margin)
        self.image_encodings = image_encodings
        self.metadata["image_encodings"] = list(image_encodings)  # a client asking for another is refused
        self.rtc = self.metadata["rtc"]
        self.bounds = action_bounds(policy, action_margin)
        self.hello_timeout_s = hello_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = int(max_connections)
        self.paraphrases = int(paraphrases)
        self.lang = getattr(policy, "lang", None)
        if self.lang is not None and hasattr(self.lang, "serve"):
            self.lang.serve(self.paraphrases)  # pin the checkpoint's instructions; bounded, no disk writes
        self._lock = threading.Lock()
        self._conn_lock = threading.Lock()
        self._active = 0
        self._server = None
        self._thread: threading.Thread | None = None
        self.stats = {"connections": 0, "refused": 0, "requests": 0, "errors": 0, "busy": 0, "idle_closed": 0}

    # ----- lifecycle ------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._server is not None:
            return int(self._server.socket.getsockname()[1])
        return self._port

    @property
    def open_connections(self) -> int:
        """Connections being served now (refused ones not counted)."""
        return self._active

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def bind(self) -> "PolicyServer":
        """Open the listening socket (idempotent); ``port`` is then the real one."""
        self._make()
        return self

    def _make(self) -> None:
        if self._server is not None:
            return
        from websockets.sync.server import serve
        self._server = serve(self._handle, self.host, self._port, compression=None,
                             max_size=self.max_message_bytes, ping_interval=None, open_timeout=10)

    def start(self) -> "PolicyServer":
        """Serve in a background thread (port 0 picks a free port; read ``.port``)."""
        self._make()
        self._thread = threading.Thread(target=self._server.serve_forever, name="PolicyServer", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._make()
        log.info("serving %s on ws://%s", type(self.policy).__name__, self.address)
        try:
            self._server.serve_forever()
        finally:
            self._server.shutdown()
            self._server = None

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> "PolicyServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ----- one connection -------------------------------------------------------------------
    def _handle(self, ws: Any) -> None:
        from websockets.exceptions import ConnectionClosed
        with self._conn_lock:
            full = self._active >= self.max_connections
            self._active += 0 if full else 1
        if full:  # answer and close at once: a refused client must not hold threads
            self.stats["busy"] += 1
            try:
                ws.send(protocol.pack({"type": "error", "code": "busy", "message":
                                       f"the policy server is serving its maximum of {self.max_connections} "
                                       "connections; try again later"}))
                ws.close(1013, "too many connections")
            except ConnectionClosed:
                pass
            return
        self.stats["connections"] += 1
        try:
            ws.send(protocol.pack(self.metadata))
            try:
                hello = protocol.unpack(ws.recv(timeout=self.hello_timeout_s), self.max_message_bytes)
            except TimeoutError:
                ws.close(1008, "no hello within the handshake timeout")
                return
            except ProtocolError as e:
                self._refuse(ws, "bad_hello", str(e))
                return
            if hello.get("type") != "hello":
                self._refuse(ws, "bad_hello", f"expected a 'hello' message, got {hello.get('type')!r}")
                return
            why = check_hello(self.metadata, hello)
            if why is not None:
                self._refuse(ws, "mismatch", why)
                return
            ws.send(protocol.pack({"type": "ready"}))
            while True:
                try:
                    raw = ws.recv(timeout=self.idle_timeout_s)
                except TimeoutError:  # an idle client must not hold a connection slot forever
                    self.stats["idle_closed"] += 1
                    ws.close(1000, f"idle for more than {self.idle_timeout_s:g} s")
                    return
                t0 = time.perf_counter()
                ws.send(protocol.pack(self._reply(raw, t0)))
        except ConnectionClosed:
            return
        finally:
            with self._conn_lock:
                self._active -= 1

    def _refuse(self, ws: Any, code: str, message: str) -> None:
        self.stats["refused"] += 1
        log.warning("refused client %s: %s", getattr(ws, "remote_address", "?"), message)
        ws.send(protocol.pack({"type": "error", "code": code, "message": message}))
        ws.close(1008, message[:120])

    def _reply(self, raw: bytes, t0: float) -> dict[str, Any]:
        req_id = None
        try:
            msg = protocol.unpack(raw, self.max_message_bytes)
            req_id = msg.get("id")
            kind = msg["type"]
            if kind == "reset":
                with self._lock:
                    if hasattr(self.policy, "reset"):
                        self.policy.reset()
                return {"type": "reset_ok", "id": req_id}
            if kind != "infer":
                raise ProtocolError(f"unknown message type {kind!r}; valid: 'infer', 'reset'")
            # encoded images are decoded here, each at most as many pixels as a raw one within the limit
            obs = protocol.check_observation(msg.get("obs"), self.metadata["state_dim"],
                                             tuple(self.metadata["cameras"]), image_encodings=self.image_encodings,
                                             max_image_pixels=self.max_message_bytes // 3)
            prefix = msg.get("prefix")
            frozen = msg.get("frozen", 0)
            seed = msg.get("seed")
            if prefix is not None:
                if not self.rtc:
                    raise ProtocolError(f"this server's policy ({self.metadata['policy_kind'] or 'unknown'}) "
                                        "cannot do real-time chunking; send requests without 'prefix'")
                if not isinstance(prefix, np.ndarray) or prefix.ndim != 2 or prefix.shape[1] != self.metadata["action_dim"]:
                    raise ProtocolError(f"prefix must be a (k, {self.metadata['action_dim']}) array")
                if not isinstance(frozen, int) or isinstance(frozen, bool) or frozen < 0:
                    raise ProtocolError(f"frozen must be an integer >= 0, got {frozen!r}")
                if prefix.dtype.kind != "f" or not np.all(np.isfinite(prefix)):
                    raise ProtocolError("prefix must be finite floats")
            if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
                raise ProtocolError(f"seed must be an integer, got {seed!r}")
        except ProtocolError as e:
            self.stats["errors"] += 1
            return {"type": "error", "id": req_id, "code": "bad_request", "message": str(e)}
        try:
            unknown = self._prepare_instruction(obs["instruction"])
        except Exception as e:  # the language encoder failed (e.g. MiniLM missing)
            self.stats["errors"] += 1
            log.exception("encoding an instruction failed")
            return {"type": "error", "id": req_id, "code": "inference_failed", "message": f"{type(e).__name__}: {e}"}
        if unknown is not None:
            self.stats["errors"] += 1
            return {"type": "error", "id": req_id, "code": "unknown_instruction", "message": unknown}
        t1 = time.perf_counter()
        try:
            with self._lock:
                t2 = time.perf_counter()
                actions = infer_chunk(self.policy, obs, prefix, frozen, seed, self.rtc_config)
                t3 = time.perf_counter()
            actions = np.asarray(actions, dtype=np.float32)
            if actions.ndim != 2 or actions.shape[1] != self.metadata["action_dim"]:
                raise ValueError(f"policy returned actions of shape {actions.shape}, expected (H, {self.metadata['action_dim']})")
            # absurd states or prefixes give NaN or 1e30 chunks: never send them as a plan
            actions = protocol.check_chunk(actions, self.metadata["action_dim"], self.bounds)
        except Exception as e:  # inference errors are the policy's, reported, not fatal
            self.stats["errors"] += 1
            if isinstance(e, ProtocolError):
                log.warning("refused the policy's chunk: %s", e)
            else:
                log.exception("inference failed")
            return {"type": "error", "id": req_id, "code": "inference_failed", "message": f"{type(e).__name__}: {e}"}
        self.stats["requests"] += 1
        return {"type": "chunk", "id": req_id, "actions": actions,
                "timing": {"decode_ms": (t1 - t0) * 1e3, "queue_ms": (t2 - t1) * 1e3,
                           "infer_ms": (t3 - t2) * 1e3, "server_ms": (time.perf_counter() - t0) * 1e3}}

    def _prepare_instruction(self, text: str) -> str | None:
        """Encode a new instruction outside the inference lock (paraphrase mode), or say why it is
        refused: by default only the checkpoint's instructions are served (clients pick strings)."""
        lang = self.lang
        if lang is None or not hasattr(lang, "knows") or lang.knows(text):
            return None
        if text == NULL_INSTRUCTION:
            return None  # the model's learned "no instruction" condition
        if self.paraphrases <= 0:
            known = sorted(lang.pinned)
            listed = ", ".join(repr(k) for k in known[:8]) + (f" and {len(known) - 8} more" if len(known) > 8 else "")
            return (f"the served policy was not trained on the instruction {text[:80]!r}; it knows "
                    f"{listed or 'no instructions'} (serve with --paraphrases N to encode others)")
        lang.warm([text])
        return None
