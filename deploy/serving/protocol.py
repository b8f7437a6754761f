"""Policy-server wire format: msgpack maps over binary websocket messages; arrays as raw bytes.

Messages (``type`` field):

    server -> client on connect  {"type": "metadata", "protocol": PROTOCOL, "version": VERSION,
                                  "action_dim", "state_dim", "cameras", "image_size", "horizon",
                                  "n_exec", "policy_kind", "rtc", "max_message_bytes",
                                  "action_low", "action_high", "max_instruction_chars",
                                  "image_encodings"}
                                 or, when the server is full, {"type": "error", "code": "busy", ...}
    client -> server             {"type": "hello", "version", "action_dim", "state_dim", "cameras"}
                                 (``check_hello``: each an int / list of names, or null: not checked;
                                 an optional "image_size" likewise; other fields are ignored)
    server -> client             {"type": "ready"} or {"type": "error", "code": "mismatch" |
                                 "bad_hello" | "busy", ...}
    client -> server             {"type": "infer", "id", "obs": {...}, "prefix"?, "frozen"?, "seed"?}
    server -> client             {"type": "chunk", "id", "actions": (H, A) float32,
                                  "timing": {"decode_ms", "infer_ms", "server_ms"}}
    client -> server             {"type": "reset"}  -> {"type": "reset_ok"}
    client -> server             {"type": "constraints", "obstacles": [...], "body", "ee_delta_scale",
                                  "tcp_index", "goal_index"} -> {"type": "constraints_ok", "obstacles": n}
                                 (``policies.constraints.ArmConstraints``; "obstacles": [] clears them).
                                 Then each infer is guided around the obstacles and checked, and may get
                                 {"type": "hold", "id", "reason", "timing"}: no chunk passed the check,
                                 the robot holds and asks again
    server -> client on failure  {"type": "error", "id"?, "code", "message"}; ``code`` is one of
                                 ERROR_CODES, so a client can tell its own mistakes from the server's

``action_low``/``action_high`` (lists, or None when the policy has no trained range) bound every
chunk the server sends: a chunk outside them, or not finite, is an ``inference_failed`` reply,
and the client checks the same bounds on what it receives.

An array is ``{"__nd__": True, "dtype": "<f4", "shape": [...], "data": <bytes>}``: no
per-element packing and no compression (images go as their raw uint8 bytes), so a 224x224x3
image costs a memcpy. Decoding validates dtype, shape and byte count before touching the data.

An image in ``obs.images`` may instead be a compressed file, ``{"__img__": True, "format": "png" |
"jpeg", "data": <bytes>}`` (``encode_image``), when the client asks for it (``PolicyClient(
image_encoding=)``) and the server lists the format in its metadata's ``image_encodings`` (a server
that lists none takes raw arrays only). PNG is lossless and ~2x smaller (~4 ms of encode + decode
for a 224 px frame), JPEG lossy and ~5-7x smaller at q90 (~0.5 ms); raw stays the default (the
fastest on loopback, ~0.2 ms a round trip); the others pay off on slow links
(benchmarks/results/image_encoding.md). ``check_observation`` decodes them where it validates raw
images, so the rest of the server sees the same uint8 (h, w, 3) arrays. Decoding reads the header
first and refuses, before any pixel is decoded: a format the server does not accept, bytes that are
not an image of the claimed format (only that format's decoder is tried), sides over
``max_image_side`` or more pixels than a raw image within the message limit could carry, and any
mode but 8-bit RGB (grayscale, RGBA, palette and CMYK images are refused, not converted: the client
encodes the camera's (h, w, 3) frames, so another mode is a client bug the policy must not see as
a silently different picture). Truncated or corrupt data is a ``ProtocolError`` like any bad request.
"""

from __future__ import annotations

import io
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
    "unsatisfiable": "the constraints cannot be met (e.g. the goal lies inside an obstacle)",
}
IMAGE_ENCODINGS = ("raw", "png", "jpeg")
"""how a client may send images: raw uint8 arrays, or PNG / JPEG files (``encode_image``)"""
PNG_COMPRESS_LEVEL = 1
"""zlib level of PNG encoding: on rendered frames level 1 encodes 2x (96 px) to 4x (224 px) faster
than Pillow's default 6 for ~10% more bytes (benchmarks/image_encoding.py measures both)"""
JPEG_SUBSAMPLING = 0
"""JPEG chroma subsampling: 0 is 4:4:4 (full-resolution colour). On rendered tabletop frames at q90 it
halves the worst pixel error of Pillow's default 4:2:0 (colour edges of small objects, which name
the task) and cuts the mean error by ~30%, for ~35% more bytes (benchmarks/image_encoding.py)"""
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG"}
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


MAX_HELLO_CAMERAS = 64


def _shown(v: Any) -> str:
    return f"{type(v).__name__} {repr(v)[:60]}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_hello(hello: dict[str, Any]) -> None:
    """Raise ``ProtocolError`` naming the field when a hello's known fields have the wrong type (a
    client's junk must be a clear refusal, not a ``TypeError`` in the server). Null dims or cameras
    mean "not checked" (what a client without expectations sends); unknown fields are ignored."""
    v = hello.get("version")
    if not _is_int(v):
        raise ProtocolError(f"hello.version must be an integer (this server speaks {PROTOCOL} v{VERSION}), "
                            f"got {_shown(v)}")
    for key, low in (("action_dim", 1), ("state_dim", 0), ("image_size", 0)):
        v = hello.get(key)
        if v is not None and not (_is_int(v) and v >= low):
            raise ProtocolError(f"hello.{key} must be an integer >= {low} or null, got {_shown(v)}")
    cams = hello.get("cameras")
    if cams is not None and (not isinstance(cams, list) or len(cams) > MAX_HELLO_CAMERAS
                             or not all(isinstance(c, str) and 0 < len(c) <= 128 for c in cams)):
        raise ProtocolError(f"hello.cameras must be a list of at most {MAX_HELLO_CAMERAS} camera names "
                            f"(non-empty strings) or null, got {_shown(cams)}")


def encode_image(img: Any, encoding: str, quality: int = 90) -> Any:
    """A uint8 (h, w, 3) RGB frame as it goes on the wire: the array itself for ``raw``, else an
    ``__img__`` map holding the PNG or JPEG file (``quality`` 1-100 for JPEG)."""
    if encoding == "raw":
        return np.ascontiguousarray(img)
    if encoding not in _PIL_FORMATS:
        raise ProtocolError(f"unknown image encoding {encoding!r}; valid: {list(IMAGE_ENCODINGS)}")
    a = np.asarray(img)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3 or 0 in a.shape:
        raise ProtocolError(f"only uint8 (h, w, 3) RGB images can be sent as {encoding}, got {a.dtype} {a.shape}")
    from PIL import Image
    buf = io.BytesIO()
    if encoding == "png":
        Image.fromarray(np.ascontiguousarray(a)).save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    else:
        Image.fromarray(np.ascontiguousarray(a)).save(buf, format="JPEG", quality=int(quality),
                                                      subsampling=JPEG_SUBSAMPLING)
    return {"__img__": True, "format": encoding, "data": buf.getvalue()}


def decode_image(enc: dict, name: str = "image", encodings: tuple[str, ...] = IMAGE_ENCODINGS,
                 max_image_side: int = 4096, max_image_pixels: int = MAX_MESSAGE_BYTES // 3) -> np.ndarray:
    """An ``__img__`` map from the wire -> uint8 (h, w, 3) RGB, or ``ProtocolError``. The header is read
    and checked (format among ``encodings``, sides, pixel count, mode) before any pixel is decoded."""
    fmt, data = enc.get("format"), enc.get("data")
    if fmt not in _PIL_FORMATS or fmt not in encodings:
        accepted = [e for e in encodings if e in _PIL_FORMATS]
        raise ProtocolError(f"{name} has image format {repr(fmt)[:40]}; this server accepts "
                            f"{accepted or 'no encoded formats'} or raw uint8 (h, w, 3) arrays")
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ProtocolError(f"{name}: encoded image data must be non-empty bytes")
    from PIL import Image
    try:  # reads the header only; only the claimed format's decoder is tried
        im = Image.open(io.BytesIO(data), formats=[_PIL_FORMATS[fmt]])
    except Exception as e:  # UnidentifiedImageError, DecompressionBombError (absurd sizes), struct errors, ...
        raise ProtocolError(f"{name} is not a valid {fmt} image: {type(e).__name__}: {str(e)[:200]}") from e
    with im:
        w, h = im.size
        if not (0 < w <= max_image_side and 0 < h <= max_image_side) or w * h > max_image_pixels:
            raise ProtocolError(f"{name}: the {fmt} header claims {w}x{h} pixels; the limit is sides <= "
                                f"{max_image_side} and <= {max_image_pixels} pixels")
        if im.mode != "RGB":
            raise ProtocolError(f"{name}: {fmt} image of mode {im.mode!r}; only 8-bit RGB is accepted "
                                "(encode the camera's uint8 (h, w, 3) frame)")
        try:
            im.load()
            a = np.asarray(im)
        except Exception as e:  # truncated or corrupt pixel data
            raise ProtocolError(f"{name}: {fmt} data is truncated or corrupt: "
                                f"{type(e).__name__}: {str(e)[:200]}") from e
    if a.dtype != np.uint8 or a.shape != (h, w, 3):
        raise ProtocolError(f"{name}: {fmt} image decoded to {a.dtype} {a.shape}, not uint8 ({h}, {w}, 3)")
    return a


def check_observation(obs: Any, state_dim: int, cameras: tuple[str, ...], max_image_side: int = 4096,
                      max_instruction_chars: int = MAX_INSTRUCTION_CHARS,
                      image_encodings: tuple[str, ...] = IMAGE_ENCODINGS,
                      max_image_pixels: int = MAX_MESSAGE_BYTES // 3, require_instruction: bool = True) -> dict:
    """Validate an observation received from the wire against the policy's metadata; encoded images
    (``image_encodings``) are decoded here (``decode_image``) into the arrays raw images give.
    ``require_instruction=False`` (a policy with nothing to ground) takes an empty or missing one as ""."""
    if not isinstance(obs, dict):
        raise ProtocolError("'obs' must be a map with 'state', 'instruction' and optional 'images'")
    state = obs.get("state")
    if not isinstance(state, np.ndarray) or state.shape != (state_dim,):
        got = state.shape if isinstance(state, np.ndarray) else type(state).__name__
        raise ProtocolError(f"obs.state must be an array of shape ({state_dim},), got {got}")
    if state.dtype.kind != "f" or not np.all(np.isfinite(state)):
        raise ProtocolError("obs.state must be finite floats")
    instr = obs.get("instruction", None if require_instruction else "")
    if not isinstance(instr, str) or (require_instruction and not instr.strip()):
        raise ProtocolError(f"obs.instruction must be a {'non-empty ' if require_instruction else ''}string, "
                            f"got {instr!r}")
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
            if isinstance(img, dict) and img.get("__img__") is True:
                img = decode_image(img, f"obs.images[{c!r}]", image_encodings, max_image_side, max_image_pixels)
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
