"""What the policy server's image encodings cost: bytes per image, encode + decode time, JPEG error,
and the loopback round trip with each.

    .venv/bin/python benchmarks/image_encoding.py        # ~1 min on 2 cores (two env creations)

Frames are real renders: the first observation of ``maniskill/TabletopSuite-v1``'s workspace camera
at 96 and 224 px (seed 0). Per encoding and size: the bytes of the image on the wire (the array's, or
the PNG/JPEG file's), encode ms (``protocol.encode_image`` + msgpack) and decode ms (msgpack +
``protocol.decode_image`` with its header checks, + the server's copy), medians of 50, on one
thread; JPEG's mean and max absolute pixel error; ``wire@100Mb`` adds encode, decode and the bytes'
transfer time on a 100 Mbit/s link (what the encodings are for); ``rtt p50``: the loopback round
trip (``PolicyClient.infer`` wall time: encode, send, server decode, a scripted policy, reply)
with the server in a thread of this process, median of 100. ``png6`` and ``jpeg q90 420`` are
Pillow's default zlib level and chroma subsampling, measured to justify ``protocol.PNG_COMPRESS_LEVEL``
= 1 and ``protocol.JPEG_SUBSAMPLING`` = 4:4:4; clients cannot choose them.
Writes benchmarks/results/image_encoding.json and image_encoding.md.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, md_table, save_results  # noqa: E402

sys.path.insert(0, str(ROOT))  # `import deploy` must find the package, not a script

import numpy as np  # noqa: E402

from deploy.serving import protocol  # noqa: E402

ENV, CAMERA, SIZES = "maniskill/TabletopSuite-v1", "workspace_camera", (96, 224)
ROWS = [("raw", "raw", None), ("png", "png", None), ("png6", "png", None), ("jpeg q90", "jpeg", 90),
        ("jpeg q90 420", "jpeg", 90), ("jpeg q75", "jpeg", 75)]
COMPARE = {"png6": ("PNG", {"compress_level": 6}), "jpeg q90 420": ("JPEG", {"quality": 90, "subsampling": 2})}
"""Pillow's defaults, for comparison only (clients cannot choose them)"""
N_CODEC, N_RTT, LINK_BITS_PER_S = 50, 100, 100e6


def frame(size: int) -> np.ndarray:
    import envs
    env = envs.make(ENV, cameras=(CAMERA,), image_size=size)
    try:
        obs, _ = env.reset(seed=0)
        return np.ascontiguousarray(obs["images"][CAMERA])
    finally:
        env.close()


def encode(img: np.ndarray, name: str, fmt: str, quality: int | None) -> bytes:
    if name in COMPARE:
        from PIL import Image
        buf = io.BytesIO()
        pil_format, kw = COMPARE[name]
        Image.fromarray(img).save(buf, format=pil_format, **kw)
        enc = {"__img__": True, "format": fmt, "data": buf.getvalue()}
    else:
        enc = protocol.encode_image(img, fmt, quality or 90)
    return protocol.pack({"type": "infer", "img": enc})


def decode(raw: bytes) -> np.ndarray:
    img = protocol.unpack(raw)["img"]
    if isinstance(img, dict):
        img = protocol.decode_image(img)
    return np.array(img)  # the server's writable copy


def median_ms(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def codec(img: np.ndarray, name: str, fmt: str, quality: int | None) -> dict:
    raw = encode(img, name, fmt, quality)
    out = decode(raw)
    enc = protocol.unpack(raw)["img"]
    nbytes = img.nbytes if fmt == "raw" else len(enc["data"])
    err = np.abs(out.astype(np.int16) - img.astype(np.int16))
    enc_ms = median_ms(lambda: encode(img, name, fmt, quality), N_CODEC)
    dec_ms = median_ms(lambda: decode(raw), N_CODEC)
    return {"bytes": nbytes, "ratio": img.nbytes / nbytes, "encode_ms": enc_ms, "decode_ms": dec_ms,
            "mean_abs_err": float(err.mean()), "max_abs_err": int(err.max()),
            "wire_100mbit_ms": enc_ms + dec_ms + len(raw) * 8 / LINK_BITS_PER_S * 1e3}


def rtt(img: np.ndarray, fmt: str, quality: int | None) -> float:
    from deploy.serving.client import PolicyClient
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.server import PolicyServer
    policy = JointTargetPolicy(8, 8, np.zeros(7))
    policy.config.cameras = (CAMERA,)
    obs = {"state": np.zeros(8, np.float32), "instruction": "pick up the cube", "images": {CAMERA: img}}
    with PolicyServer(policy, port=0) as srv, \
            PolicyClient(port=srv.port, image_encoding=fmt, jpeg_quality=quality or 90) as c:
        for _ in range(10):
            c.infer(obs)
        return median_ms(lambda: c.infer(obs), N_RTT)


def table(res: dict) -> str:
    rows = []
    for size in SIZES:
        for name, *_ in ROWS:
            r = res["sizes"][str(size)][name]
            rows.append([f"{size}x{size}", name, r["bytes"], round(r["ratio"], 1), r["encode_ms"], r["decode_ms"],
                         r["mean_abs_err"], r["max_abs_err"], r["wire_100mbit_ms"], r.get("rtt_p50_ms", "-")])
    head = ["image", "encoding", "bytes", "x smaller", "encode ms", "decode ms", "mean abs err", "max abs err",
            "wire@100Mb ms", "loopback rtt p50 ms"]
    return ("# Image encodings on the policy-server wire\n\n"
            f"Real {ENV} `{CAMERA}` frames (seed 0); medians of {N_CODEC} (codec) and {N_RTT} (round trip) "
            "on one thread; encode/decode include msgpack, decode the header checks and the server's copy. "
            "`wire@100Mb`: encode + decode + transfer at 100 Mbit/s. `png6` and `jpeg q90 420` (Pillow's "
            "default zlib level and chroma subsampling) are for comparison; the protocol's PNG uses level 1 "
            "and its JPEG 4:4:4.\n\n" + md_table(head, rows))


def main() -> None:
    res: dict = {"env": ENV, "camera": CAMERA, "n_codec": N_CODEC, "n_rtt": N_RTT, "sizes": {}}
    for size in SIZES:
        img = frame(size)
        out: dict = {}
        for name, fmt, quality in ROWS:
            out[name] = codec(img, name, fmt, quality)
            if name not in COMPARE:
                out[name]["rtt_p50_ms"] = rtt(img, fmt, quality)
            print(size, name, {k: round(v, 3) if isinstance(v, float) else v for k, v in out[name].items()}, flush=True)
        res["sizes"][str(size)] = out
        save_results("image_encoding", res, lambda r: table(r) if len(r["sizes"]) == len(SIZES) else "")
    print(table(res))


if __name__ == "__main__":
    main()
