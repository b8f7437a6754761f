"""Policy-server wire format: msgpack maps over binary websocket messages; arrays as raw bytes.

Messages (``type`` field):

    server -> client on connect  {"type": "metadata", "protocol": PROTOCOL, "version": VERSION,
                                  "action_dim", "state_dim", "cameras", "image_size", "horizon",
                                  "n_exec", "policy_kind", "rtc", "max_message_bytes",
                                  "action_low", "action_high", "max_instruction_chars"}
                                 or, when the server is full, {"type": "error", "code": "busy", ...}
    client -> server             {"type": "hello", "version", "action_dim", "state_dim", "cameras"}
    server -> client             {"type": "ready"} or {"type": "error", "code": "mismatch", ...}
    client -> server             {"type": "infer", "id", "obs": {...}, "prefix"?, "frozen"?, "seed"?}
    server -> client             {"type": "chunk", "id", "actions": (H, A) float32,
                                  "timing": {"decode_ms", "infer_ms", "server_ms"}}
    client -> server             {"type": "reset"}  -> {"type": "reset_ok"}
    server -> client on failure  {"type": "error", "id"?, "code", "message"}; ``code`` is one of
                                 ERROR_CODES, so a client can tell its own mistakes from the server's

``action_low``/``action_high`` (lists, or None when the policy has no trained range) bound every
chunk the server sends: a chunk outside them, or not finite, is an ``inference_failed`` reply,
and the client checks the same bounds on what it receives.

An array is ``{"__nd__": True, "dtype": "<f4", "shape": [...], "data": <bytes>}``: no
per-element packing and no compression (images go as their raw uint8 bytes), so a 224x224x3
image costs a memcpy. Decoding validates dtype, shape and byte count before touching the data.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from deploy.errors import ProtocolError

PROTOCOL = "groundflow-policy"
VERSION = 1
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
ALLOWED_DTYPES = ("|u1", "<f4", "<f8", "<i4", "<i8", "|b1", "<f2", "<u2", "<i2")
MAX_DIMS = 8
MAX_INSTRUCTION_CHARS = 512
ERROR_CODES = {
    "bad_hello": "the first message was not a valid hello",
    "mismatch": "the client's dims, cameras or protocol version do not fit the served policy",
    "busy": "the server already holds its maximum number of connections",
    "bad_request": "a malformed request (wrong shapes, types, an over-long instruction, ...)",
    "unknown_instruction": "the policy was not trained on this instruction and serves no paraphrases",
    "inference_failed": "the policy raised, or produced a chunk that is not finite or far out of its range",
}
ACTION_MARGIN = 2.0
"""A chunk may leave the policy's trained action range by this fraction of the range on each side
(normalized units [-1 - 2m, 1 + 2m], i.e. +-5): even an untrained flow policy's noise stays inside,
while absurd states or prefixes give NaN or 1e30 (garbage, not a policy extrapolating a little)."""


def _encode_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        if a.dtype.str not in ALLOWED_DTYPES:
            a = a.astype(np.float32) if a.dtype.kind == "f" else a
        if a.dtype.str not in ALLOWED_DTYPES:
            raise ProtocolError(f"cannot send arrays of dtype {a.dtype}; valid dtypes: {ALLOWED_DTYPES}")
        return {"__nd__": True, "dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} in a policy message")


def _decode_hook(d: dict) -> Any:
    if d.get("__nd__") is not True:
        return d
    dtype, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if dtype not in ALLOWED_DTYPES:
        raise ProtocolError(f"array dtype {dtype!r} not allowed; valid dtypes: {ALLOWED_DTYPES}")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise ProtocolError(f"array shape {shape!r} is not a list of <= {MAX_DIMS} non-negative ints")
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("array data must be raw bytes")
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if n * dt.itemsize != len(data):
        raise ProtocolError(f"array of shape {shape} and dtype {dtype} needs {n * dt.itemsize} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def pack(msg: dict[str, Any]) -> bytes:
    """Encode one message (a dict that may hold numpy arrays)."""
    return msgpack.packb(msg, default=_encode_default, use_bin_type=True)


def unpack(raw: bytes | bytearray | str, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Decode one message; raise ``ProtocolError`` for anything that is not a valid message map."""
    if isinstance(raw, str):
        raise ProtocolError("text frames are not part of the protocol; send binary msgpack")
    if len(raw) > max_bytes:
        raise ProtocolError(f"message of {len(raw)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        msg = msgpack.unpackb(raw, object_hook=_decode_hook, raw=False, strict_map_key=True,
                              max_bin_len=max_bytes, max_str_len=1 << 20, max_array_len=1 << 16,
                              max_map_len=1 << 12, max_ext_len=0)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several types for garbage
        raise ProtocolError(f"message is not valid msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("message must be a map with a string 'type' field")
    return msg


def check_observation(obs: Any, state_dim: int, cameras: tuple[str, ...], max_image_side: int = 4096,
                      max_instruction_chars: int = MAX_INSTRUCTION_CHARS) -> dict:
    """Validate an observation received from the wire against the policy's metadata."""
    if not isinstance(obs, dict):
        raise ProtocolError("'obs' must be a map with 'state', 'instruction' and optional 'images'")
    state = obs.get("state")
    if not isinstance(state, np.ndarray) or state.shape != (state_dim,):
        got = state.shape if isinstance(state, np.ndarray) else type(state).__name__
        raise ProtocolError(f"obs.state must be an array of shape ({state_dim},), got {got}")
    if state.dtype.kind != "f" or not np.all(np.isfinite(state)):
        raise ProtocolError("obs.state must be finite floats")
    instr = obs.get("instruction")
    if not isinstance(instr, str) or not instr.strip():
        raise ProtocolError(f"obs.instruction must be a non-empty string, got {instr!r}")
    if len(instr) > max_instruction_chars:  # encoding cost grows with length; no task needs more
        raise ProtocolError(f"obs.instruction has {len(instr)} characters; the limit is {max_instruction_chars}")
    out: dict[str, Any] = {"state": state.astype(np.float32), "instruction": instr}
    images = obs.get("images") or {}
    if not isinstance(images, dict):
        raise ProtocolError("obs.images must be a map camera -> uint8 (h, w, 3) array")
    missing = [c for c in cameras if c not in images]
    if missing:
        raise ProtocolError(f"obs.images lacks camera(s) {missing}; the policy needs {list(cameras)}")
    if cameras:
        checked = {}
        for c in cameras:
            img = images[c]
            if (not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3
                    or not 0 < img.shape[0] <= max_image_side or not 0 < img.shape[1] <= max_image_side):
                got = (img.dtype, img.shape) if isinstance(img, np.ndarray) else type(img).__name__
                raise ProtocolError(f"obs.images[{c!r}] must be uint8 (h, w, 3) with sides <= {max_image_side}, got {got}")
            checked[c] = np.array(img)  # writable copy: wire arrays are read-only views
        out["images"] = checked
    return out


def widen_bounds(low: Any, high: Any, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """``[low, high]`` widened by ``margin`` x (high - low) on each side; infinite ends stay infinite."""
    lo, hi = np.asarray(low, np.float64).reshape(-1), np.asarray(high, np.float64).reshape(-1)
    with np.errstate(invalid="ignore"):
        pad = np.where(np.isfinite(hi - lo), margin * (hi - lo), np.inf)
    return lo - pad, hi + pad


def check_chunk(actions: Any, action_dim: int, bounds: tuple[Any, Any] | None = None) -> np.ndarray:
    """Validate an action chunk: (H, action_dim) finite floats, inside ``bounds`` (low, high) if given.

    Garbage from absurd inputs (NaN, 1e30) must never become a plan the robot follows."""
    if not isinstance(actions, np.ndarray) or actions.ndim != 2 or actions.shape[1] != action_dim or actions.shape[0] < 1:
        got = actions.shape if isinstance(actions, np.ndarray) else type(actions).__name__
        raise ProtocolError(f"reply actions must be an (H, {action_dim}) array, got {got}")
    if actions.dtype.kind not in "fiu":
        raise ProtocolError(f"reply actions must be numbers, got dtype {actions.dtype}")
    a = actions.astype(np.float32)
    bad = ~np.isfinite(a)
    if bad.any():
        raise ProtocolError(f"action chunk is not finite: {int(bad.sum())} NaN/inf value(s) in dims "
                            f"{np.flatnonzero(bad.any(0)).tolist()}")
    if bounds is not None:
        lo, hi = (np.asarray(b, np.float64).reshape(-1) for b in bounds)
        out = (a < lo) | (a > hi)
        if out.any():
            d = int(np.flatnonzero(out.any(0))[0])
            raise ProtocolError(f"action chunk is far outside the action bounds: dim {d} reaches "
                                f"{float(a[:, d][out[:, d]][0]):.4g}, bounds [{lo[d]:.4g}, {hi[d]:.4g}] "
                                f"(dims {np.flatnonzero(out.any(0)).tolist()} out)")
    return a
