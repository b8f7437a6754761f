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
are capped in length, a policy with a vocabulary serves only its checkpoint's instructions: a
user's wording is resolved to the trained instruction it means (``policies.instructions``; the
policy sees that instruction's features) or refused with an ``unknown_instruction`` error carrying
the resolver's ``reason``; only with ``allow_unknown`` (``--allow-unknown``) is a refused wording
served as is, where ``paraphrases`` > 0 (then at most that many others are kept, never written to
disk). A ``resolve`` message asks what an instruction resolves to, with no inference. New
instructions are encoded outside the inference lock, in a child process that loads the language
model at start-up (``policies.language.EncoderProcess``), and stay cached until their request's
inference. A connection that has not finished its handshake (the websocket upgrade and the hello)
holds no ``max_connections`` slot: at most ``max_pending`` of them are kept, the oldest closed
to make room for a new one (a flood of silent sockets costs a bounded number of threads and
cannot lock a real client out, which finishes in milliseconds), and each must finish within
``hello_timeout_s`` of connecting. Hello fields of the wrong type are a ``bad_hello`` reply
naming the field (``protocol.check_hello``), and a port already in use is a
``ServerAddressError`` naming it. Images may come PNG- or JPEG-encoded (the
formats in ``image_encodings``, announced in the metadata); they are decoded, header checked first,
where observations are validated (``protocol.check_observation``), so a hostile image is a
``bad_request`` like any other. Every chunk sent is finite and inside the
policy's trained action range widened by ``action_margin``; anything else is ``inference_failed``.

Loopback (127.0.0.1) is the default: serving on another interface must be asked for.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import socket
import threading
import time
from typing import Any

import numpy as np

from deploy.serving import protocol
from deploy.errors import ConstraintRefusedError, ProtocolError, ServerAddressError
from deploy.serving.inference import (action_bounds, can_constrain, infer_chunk, infer_constrained, needs_instruction,
                                      policy_metadata)
from envs.errors import InvalidOptionError
from deploy.serving.inference import resolve_obs_instruction
from policies.constraints import ArmConstraints
from policies.instructions import UnknownInstructionError
from policies.model import NULL_INSTRUCTION, instruction_resolver
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


def _bind_failure(host: str, port: int, e: OSError) -> str:
    """Why the server cannot listen on ``host:port``, in one line naming both."""
    where = f"cannot listen on {host}:{port}"
    why = str(e.strerror or e).split(" (while attempting to bind")[0]  # socket.create_server's addition
    if isinstance(e, socket.gaierror) or e.errno in {getattr(socket, n, None) for n in
                                                      ("EAI_NONAME", "EAI_AGAIN", "EAI_FAIL", "EAI_NODATA")} - {None}:
        return f"{where}: cannot resolve host {host!r} ({why})"
    if e.errno == errno.EADDRINUSE:
        return (f"{where}: port {port} is already in use (another `groundflow serve`, or another program, "
                f"listens on it); stop it or pick another --port")
    if e.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this machine"
    if e.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need privileges); pick another --port"
    return f"{where}: {why}"


def _close_listener(server: Any) -> None:
    """Close a websockets server that never ran its serve loop (its ``shutdown()`` would wait for one)."""
    for name in ("socket", "shutdown_watcher", "shutdown_notifier"):
        sock = getattr(server, name, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


@functools.lru_cache(maxsize=None)
def _gated_connection() -> type:
    """websockets' server connection, told to its ``PolicyServer`` from its creation (before the
    websocket handshake) until its socket's reader ends: what caps and times out connections that
    have not finished their handshake (``PolicyServer._admit``)."""
    from websockets.sync.server import ServerConnection

    class GatedConnection(ServerConnection):
        def __init__(self, *args: Any, gate: "PolicyServer", **kwargs: Any):
            self.gate, self.opened_at, self.forgotten = gate, time.monotonic(), False
            super().__init__(*args, **kwargs)  # starts the reader thread
            gate._admit(self)

        def recv_events(self) -> None:
            try:
                super().recv_events()
            finally:
                self.gate._forget(self)

    return GatedConnection


class PolicyServer:
    """Serve ``policy`` (the interface ``deploy.serving.inference`` describes)."""

    def __init__(self, policy: Any, host: str = "127.0.0.1", port: int = 8000, *,
                 max_message_bytes: int = protocol.MAX_MESSAGE_BYTES, rtc: RTCConfig | None = None,
                 hello_timeout_s: float = 5.0, idle_timeout_s: float | None = 60.0, max_connections: int = 16,
                 max_pending: int = 32, paraphrases: int = 0, action_margin: float = protocol.ACTION_MARGIN,
                 image_encodings: tuple[str, ...] = protocol.IMAGE_ENCODINGS, allow_unknown: bool = False):
        image_encodings = tuple(image_encodings)
        if "raw" not in image_encodings or not set(image_encodings) <= set(protocol.IMAGE_ENCODINGS):
            raise InvalidOptionError(f"image_encodings must include 'raw' and be among "
                                     f"{list(protocol.IMAGE_ENCODINGS)}, got {list(image_encodings)}")
        if max_connections < 1 or max_pending < 1 or paraphrases < 0 or not action_margin >= 0:
            raise InvalidOptionError(f"need max_connections >= 1, max_pending >= 1, paraphrases >= 0 and "
                                     f"action_margin >= 0, got {max_connections}, {max_pending}, {paraphrases}, "
                                     f"{action_margin}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise InvalidOptionError(f"idle_timeout_s must be > 0 (or None: never), got {idle_timeout_s}")
        if not hello_timeout_s > 0:
            raise InvalidOptionError(f"hello_timeout_s must be > 0, got {hello_timeout_s}")
        self.policy = policy
        self.host, self._port = host, int(port)
        self.max_message_bytes = int(max_message_bytes)
        self.rtc_config = rtc or RTCConfig()
        self.metadata = policy_metadata(policy, self.max_message_bytes, action_margin)
        self.image_encodings = image_encodings
        self.metadata["image_encodings"] = list(image_encodings)  # a client asking for another is refused
        self.metadata["constraints"] = can_constrain(policy) is None  # obstacles a client may send
        self.rtc = self.metadata["rtc"]
        self.bounds = action_bounds(policy, action_margin)
        self.hello_timeout_s = float(hello_timeout_s)
        """a connection must finish its handshake (websocket upgrade and hello) this long after connecting"""
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = int(max_connections)
        self.max_pending = int(max_pending)
        """connections not through their handshake kept at once (the oldest is closed for a new one)"""
        self.paraphrases = int(paraphrases)
        self.allow_unknown = bool(allow_unknown)
        """an instruction the checkpoint's resolver refuses is served as is (then ``paraphrases`` decides)"""
        self.lang = getattr(policy, "lang", None)
        if self.lang is not None:
            instruction_resolver(policy)  # built (or fitted, ~1 s) now, not in a client's first request
        if self.lang is not None and hasattr(self.lang, "serve"):
            self.lang.serve(self.paraphrases)  # pin the checkpoint's instructions; bounded, no disk writes
        self._lock = threading.Lock()
        self._conn_lock = threading.Lock()
        self._active = 0
        self._pending: dict[Any, None] = {}  # connections not through their handshake, oldest first
        self._server = None
        self._serving = False
        self._thread: threading.Thread | None = None
        self.stats = {"connections": 0, "refused": 0, "requests": 0, "errors": 0, "busy": 0, "idle_closed": 0,
                      "evicted": 0, "hello_timeouts": 0}

    # ----- lifecycle ------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._server is not None:
            return int(self._server.socket.getsockname()[1])
        return self._port

    @property
    def open_connections(self) -> int:
        """Connections being served now (through their handshake; refused ones not counted)."""
        return self._active

    @property
    def pending_connections(self) -> int:
        """Connections accepted that have not finished their handshake yet."""
        return len(self._pending)

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
        try:  # no SO_REUSEPORT: on Linux it would let a second server share the port without a word
            server = serve(self._handle, self.host, self._port, compression=None, max_size=self.max_message_bytes,
                           ping_interval=None, open_timeout=self.hello_timeout_s, reuse_port=False,
                           create_connection=functools.partial(_gated_connection(), gate=self))
        except OSError as e:
            raise ServerAddressError(_bind_failure(self.host, self._port, e)) from e
        if self.paraphrases > 0 and self.lang is not None and hasattr(self.lang, "start_encoder_process"):
            # now, not on the first new instruction (4-5 s: a client's request would time out meanwhile)
            log.info("loading the language model (--paraphrases %d)", self.paraphrases)
            try:
                self.lang.start_encoder_process()
            except BaseException:
                _close_listener(server)
                raise
        self._server = server

    def start(self) -> "PolicyServer":
        """Serve in a background thread (port 0 picks a free port; read ``.port``)."""
        self._make()
        self._serving = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="PolicyServer", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._make()
        log.info("serving %s on ws://%s", type(self.policy).__name__, self.address)
        self._serving = True
        try:
            self._server.serve_forever()
        finally:
            self._server.shutdown()
            self._server = None
            self._serving = False
            self._stop_encoder()

    def stop(self) -> None:
        if self._server is not None:
            if self._serving:
                self._server.shutdown()
            else:  # bound, never served: websockets' shutdown() would wait for a serve loop forever
                _close_listener(self._server)
        self._serving = False
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None
        self._stop_encoder()

    def _stop_encoder(self) -> None:
        if self.lang is not None and hasattr(self.lang, "stop_encoder_process"):
            self.lang.stop_encoder_process()

    def __enter__(self) -> "PolicyServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ----- connections before their handshake ------------------------------------------------
    def _admit(self, conn: Any) -> None:
        """A new connection (its websocket handshake not yet done): keep at most ``max_pending``
        such, closing the oldest. A real client is through in milliseconds, so the oldest is a
        silent or stalled one; closing it (not refusing the new one) keeps a flood from locking
        real clients out."""
        with self._conn_lock:
            if conn.forgotten:
                return  # its socket already ended
            self._pending[conn] = None
            victims = []
            while len(self._pending) > self.max_pending:
                victim = next(iter(self._pending))
                del self._pending[victim]
                victims.append(victim)
            self.stats["evicted"] += len(victims)
        for victim in victims:
            try:  # its reader sees the end of the stream; its handshake or hello wait ends
                victim.socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _forget(self, conn: Any) -> None:
        """``conn`` finished its handshake, or its socket ended."""
        with self._conn_lock:
            conn.forgotten = True
            self._pending.pop(conn, None)

    def _busy(self, ws: Any) -> None:
        """Answer ``busy`` and close at once: a refused client must not hold threads."""
        from websockets.exceptions import ConnectionClosed
        self.stats["busy"] += 1
        try:
            ws.send(protocol.pack({"type": "error", "code": "busy", "message":
                                   f"the policy server is serving its maximum of {self.max_connections} "
                                   "connections; try again later"}))
            ws.close(1013, "too many connections")
        except ConnectionClosed:
            pass

    # ----- one connection -------------------------------------------------------------------
    def _handle(self, ws: Any) -> None:
        from websockets.exceptions import ConnectionClosed
        with self._conn_lock:
            full = self._active >= self.max_connections
        if full:
            self._busy(ws)
            return
        # the slot is taken once the hello fits: a client that never says hello holds none
        deadline = getattr(ws, "opened_at", time.monotonic()) + self.hello_timeout_s
        try:
            ws.send(protocol.pack(self.metadata))
            try:
                raw = ws.recv(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self.stats["hello_timeouts"] += 1
                ws.close(1008, "no hello within the handshake timeout")
                return
            try:
                hello = protocol.unpack(raw, self.max_message_bytes)
                if hello.get("type") != "hello":
                    raise ProtocolError(f"expected a 'hello' message, got {hello.get('type')!r}")
                protocol.check_hello(hello)
                why = check_hello(self.metadata, hello)
            except ProtocolError as e:
                self._refuse(ws, "bad_hello", str(e))
                return
            except Exception as e:  # noqa: BLE001  (a hello no check foresaw must not kill the handler)
                log.exception("checking a hello failed")
                self._refuse(ws, "bad_hello", f"invalid hello: {type(e).__name__}: {e}")
                return
            if why is not None:
                self._refuse(ws, "mismatch", why)
                return
            with self._conn_lock:
                full = self._active >= self.max_connections
                self._active += 0 if full else 1
            if full:  # others finished their hello meanwhile
                self._busy(ws)
                return
        except ConnectionClosed:
            return
        try:  # served now: counts against max_connections, no longer against max_pending
            self._forget(ws)
            self.stats["connections"] += 1
            ws.send(protocol.pack({"type": "ready"}))
            session: dict[str, Any] = {"constraints": None}  # what this client set (obstacles)
            while True:
                try:
                    raw = ws.recv(timeout=self.idle_timeout_s)
                except TimeoutError:  # an idle client must not hold a connection slot forever
                    self.stats["idle_closed"] += 1
                    ws.close(1000, f"idle for more than {self.idle_timeout_s:g} s")
                    return
                t0 = time.perf_counter()
                ws.send(protocol.pack(self._reply(raw, t0, session)))
        except ConnectionClosed:
            return
        finally:
            with self._conn_lock:
                self._active -= 1

    def _refuse(self, ws: Any, code: str, message: str) -> None:
        from websockets.exceptions import ConnectionClosed
        self.stats["refused"] += 1
        log.warning("refused client %s: %s", getattr(ws, "remote_address", "?"), message)
        try:
            ws.send(protocol.pack({"type": "error", "code": code, "message": message}))
            # a close reason is at most 123 bytes of UTF-8 (a client's names may be anything)
            ws.close(1008, message.encode()[:120].decode(errors="ignore"))
        except ConnectionClosed:
            pass

    def _reply(self, raw: bytes, t0: float, session: dict[str, Any] | None = None) -> dict[str, Any]:
        """The reply to one message; ``session`` holds what the connection set (its constraints)."""
        session = {"constraints": None} if session is None else session
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
            if kind == "resolve":
                return self._resolve_only(msg.get("instruction"), req_id)
            if kind == "constraints":
                return self._set_constraints(msg, req_id, session)
            if kind != "infer":
                raise ProtocolError(f"unknown message type {kind!r}; valid: 'infer', 'reset', 'resolve', "
                                    "'constraints'")
            # encoded images are decoded here, each at most as many pixels as a raw one within the limit
            obs = protocol.check_observation(msg.get("obs"), self.metadata["state_dim"],
                                             tuple(self.metadata["cameras"]), image_encodings=self.image_encodings,
                                             max_image_pixels=self.max_message_bytes // 3,
                                             require_instruction=needs_instruction(self.policy))
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
            if prefix is not None and session["constraints"] is not None:
                raise ProtocolError("a request under obstacles cannot continue a prefix (real-time chunking): "
                                    "each constrained chunk is planned and checked afresh")
        except ProtocolError as e:
            self.stats["errors"] += 1
            return {"type": "error", "id": req_id, "code": "bad_request", "message": str(e)}
        try:  # a user's wording -> the trained instruction it means, outside the inference lock
            obs = resolve_obs_instruction(self.policy, obs, self.allow_unknown)
        except UnknownInstructionError as e:
            self.stats["errors"] += 1
            return _refused(req_id, e)
        hold = getattr(self.lang, "hold", None)
        with hold(obs["instruction"]) if hold is not None else contextlib.nullcontext():
            return self._infer(obs, prefix, frozen, seed, req_id, t0, session["constraints"])

    def _set_constraints(self, msg: dict[str, Any], req_id: Any, session: dict[str, Any]) -> dict[str, Any]:
        """Reply to ``constraints``: obstacles (``policies.constraints.ArmConstraints``) every later
        request of this connection is guided around and checked against; an empty list clears them."""
        if msg.get("obstacles") == []:
            session["constraints"] = None
            return {"type": "constraints_ok", "id": req_id, "obstacles": 0}
        why = can_constrain(self.policy)
        try:
            if why is not None:
                raise InvalidOptionError(why)
            c = ArmConstraints.from_message(msg)
            c.check_state(self.metadata["state_dim"])
        except InvalidOptionError as e:
            self.stats["errors"] += 1
            return {"type": "error", "id": req_id, "code": "bad_request", "message": f"constraints: {e}"}
        session["constraints"] = c
        return {"type": "constraints_ok", "id": req_id, "obstacles": len(c.obstacles)}

    def _infer(self, obs: dict[str, Any], prefix: Any, frozen: int, seed: int | None, req_id: Any,
               t0: float, constraints: Any = None) -> dict[str, Any]:
        """A valid request's reply; its instruction stays cached from its encoding (outside the
        inference lock) to its inference (``_reply`` holds it)."""
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
                if constraints is None:
                    actions = infer_chunk(self.policy, obs, prefix, frozen, seed, self.rtc_config, self.allow_unknown)
                else:
                    planned = infer_constrained(self.policy, obs, constraints, seed, self.allow_unknown)
                    actions = planned.actions
                t3 = time.perf_counter()
            timing = {"decode_ms": (t1 - t0) * 1e3, "queue_ms": (t2 - t1) * 1e3, "infer_ms": (t3 - t2) * 1e3}
            if actions is None:  # no chunk passed the check: the robot holds and asks again
                self.stats["requests"] += 1
                return {"type": "hold", "id": req_id, "reason": planned.why,
                        "timing": {**timing, "server_ms": (time.perf_counter() - t0) * 1e3}}
            actions = np.asarray(actions, dtype=np.float32)
            if actions.ndim != 2 or actions.shape[1] != self.metadata["action_dim"]:
                raise ValueError(f"policy returned actions of shape {actions.shape}, expected (H, {self.metadata['action_dim']})")
            # absurd states or prefixes give NaN or 1e30 chunks: never send them as a plan
            actions = protocol.check_chunk(actions, self.metadata["action_dim"], self.bounds)
        except ConstraintRefusedError as e:  # the constraints cannot be met (a goal inside an obstacle)
            self.stats["errors"] += 1
            return {"type": "error", "id": req_id, "code": "unsatisfiable", "message": str(e)}
        except Exception as e:  # inference errors are the policy's, reported, not fatal
            self.stats["errors"] += 1
            if isinstance(e, ProtocolError):
                log.warning("refused the policy's chunk: %s", e)
            else:
                log.exception("inference failed")
            return {"type": "error", "id": req_id, "code": "inference_failed", "message": f"{type(e).__name__}: {e}"}
        self.stats["requests"] += 1
        return {"type": "chunk", "id": req_id, "actions": actions,
                "timing": {**timing, "server_ms": (time.perf_counter() - t0) * 1e3}}

    def _resolve_only(self, text: Any, req_id: Any) -> dict[str, Any]:
        """Reply to ``resolve``: the instruction an ``infer`` with ``text`` would condition the policy
        on, or the ``unknown_instruction`` error it would get; no inference, no encoding (what
        ``groundflow deploy`` asks before its first motion)."""
        if not isinstance(text, str) or not text.strip() or len(text) > protocol.MAX_INSTRUCTION_CHARS:
            self.stats["errors"] += 1
            return {"type": "error", "id": req_id, "code": "bad_request", "message":
                    f"'resolve' needs an 'instruction' string of 1 to {protocol.MAX_INSTRUCTION_CHARS} characters"}
        try:
            resolved = resolve_obs_instruction(self.policy, {"instruction": text}, self.allow_unknown)["instruction"]
        except UnknownInstructionError as e:
            self.stats["errors"] += 1
            return _refused(req_id, e)
        unknown = self._unknown(resolved)
        if unknown is not None:
            self.stats["errors"] += 1
            return {"type": "error", "id": req_id, "code": "unknown_instruction", "message": unknown,
                    "reason": unknown}
        return {"type": "instruction", "id": req_id, "instruction": resolved, "resolved": resolved != text}

    def _unknown(self, text: str) -> str | None:
        """Why ``text`` would not be served as is (None: it would): by default only the checkpoint's
        instructions are (clients pick strings); with --paraphrases N others are encoded."""
        lang = self.lang
        if self._has_features(text):
            return None
        if self.paraphrases <= 0:
            known = sorted(lang.pinned)
            listed = ", ".join(repr(k) for k in known[:8]) + (f" and {len(known) - 8} more" if len(known) > 8 else "")
            return (f"the served policy was not trained on the instruction {text[:80]!r}; it knows "
                    f"{listed or 'no instructions'} (serve with --paraphrases N to encode others)")
        return None

    def _has_features(self, text: str) -> bool:
        """Whether the policy conditions on ``text`` without encoding it (no vocabulary, a known
        instruction, or the learned "no instruction")."""
        lang = self.lang
        return lang is None or not hasattr(lang, "knows") or lang.knows(text) or text == NULL_INSTRUCTION

    def _prepare_instruction(self, text: str) -> str | None:
        """Encode a new instruction outside the inference lock (paraphrase mode), or say why it is
        refused (``_unknown``)."""
        unknown = self._unknown(text)
        if unknown is None and not self._has_features(text):
            self.lang.warm([text])
        return unknown


def _refused(req_id: Any, e: UnknownInstructionError) -> dict[str, Any]:
    """The typed reply to an instruction the checkpoint cannot ground: ``reason`` is the resolver's
    one line, ``trained`` the instructions it can ground."""
    return {"type": "error", "id": req_id, "code": "unknown_instruction", "message": str(e), "reason": e.reason,
            "trained": list(e.trained)}
