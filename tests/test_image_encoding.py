"""PNG / JPEG images on the policy-server wire: round trips through a real server, the handshake,
and hostile images (garbage, truncated, absurd headers, bombs, wrong modes) refused as bad requests."""

from __future__ import annotations

import io
import re
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from deploy.serving import protocol
from deploy.serving.client import PolicyClient
from deploy.errors import HandshakeError, ProtocolError, ServerError
from deploy.scripted import JointTargetPolicy
from deploy.serving.server import PolicyServer
from envs.errors import InvalidOptionError

STATE, ACTION, CAM = 35, 8, "wrist"


class Seeing(JointTargetPolicy):
    """Keeps the images the server handed it."""

    seen: dict | None = None

    def predict_action_chunk(self, obs, **kw):
        self.seen = obs.get("images")
        return super().predict_action_chunk(obs)


def _policy() -> Seeing:
    policy = Seeing(STATE, ACTION, np.zeros(7))
    policy.config.cameras = (CAM,)
    return policy


def smooth_image(h: int = 96, w: int = 128) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([127 + 100 * np.sin(x / 17 + y / 29), 40 + 1.5 * y, 200 - 1.2 * x], axis=-1)
    return np.clip(img, 0, 255).astype(np.uint8)


def _obs(img: np.ndarray | dict | None = None) -> dict:
    return {"state": np.zeros(STATE, np.float32), "instruction": "push the cube",
            "images": {CAM: smooth_image() if img is None else img}}


def _file(img: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _png_claiming(w: int, h: int, pixels: bytes = b"\0" * 16) -> bytes:
    """A PNG whose header claims w x h RGB pixels, with ``pixels`` (zlib-compressed) as its data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(pixels)) + chunk(b"IEND", b""))


def _img(fmt, data) -> dict:
    return {"__img__": True, "format": fmt, "data": data}


def test_png_is_exact_and_jpeg_close_through_the_server():
    img = smooth_image()
    policy = _policy()
    errors = {}
    with PolicyServer(policy, port=0) as srv:
        assert srv.metadata["image_encodings"] == ["raw", "png", "jpeg"]
        for enc, quality in [("raw", 90), ("png", 90), ("jpeg", 90), ("jpeg", 10)]:
            with PolicyClient(port=srv.port, image_encoding=enc, jpeg_quality=quality,
                              expect={"cameras": [CAM]}) as c:
                reply = c.infer(_obs(img))
                assert reply.actions.shape == (16, ACTION) and reply.timing["encode_ms"] >= 0
            seen = policy.seen[CAM]
            assert seen.dtype == np.uint8 and seen.shape == img.shape and seen.flags.writeable
            errors[enc, quality] = np.abs(seen.astype(np.int16) - img).mean()
    assert errors["raw", 90] == 0 and errors["png", 90] == 0  # lossless: the same array
    assert 0 < errors["jpeg", 90] < 2.0  # smooth image: small error
    assert errors["jpeg", 10] > 2 * errors["jpeg", 90]  # the quality is the client's
    sizes = {enc: len(protocol.pack({"type": "x", "i": protocol.encode_image(img, enc)})) for enc in ("raw", "png", "jpeg")}
    assert sizes["jpeg"] < sizes["png"] < sizes["raw"] / 2, sizes


def test_a_client_asking_for_an_unannounced_encoding_is_refused_at_connect():
    with PolicyServer(_policy(), port=0, image_encodings=("raw", "png")) as srv:
        assert srv.metadata["image_encodings"] == ["raw", "png"]
        with pytest.raises(HandshakeError, match=r"image_encoding: the server accepts \['raw', 'png'\], "
                                                 r"this client asks for 'jpeg'"):
            PolicyClient(port=srv.port, image_encoding="jpeg")
        with PolicyClient(port=srv.port, image_encoding="png") as c:
            assert c.infer(_obs()).actions.shape == (16, ACTION)
            # a client that skips its check: the server decodes only what it announced
            c.image_encoding = "jpeg"
            with pytest.raises(ServerError, match=r"bad_request.*format 'jpeg'; this server accepts \['png'\]"):
                c.infer(_obs())
        del srv.metadata["image_encodings"]  # a server from before image encodings: raw only
        with pytest.raises(HandshakeError, match=r"accepts \['raw'\], this client asks for 'png'"):
            PolicyClient(port=srv.port, image_encoding="png")
        with PolicyClient(port=srv.port) as c:
            assert c.image_encoding == "raw" and c.infer(_obs()).actions.shape == (16, ACTION)
    for kw in ({"image_encoding": "webp"}, {"image_encoding": "jpeg", "jpeg_quality": 0},
               {"jpeg_quality": 101}, {"jpeg_quality": 90.0}):
        with pytest.raises(InvalidOptionError):
            PolicyClient(connect=False, **kw)
    with pytest.raises(InvalidOptionError, match="must include 'raw'"):
        PolicyServer(_policy(), port=0, image_encodings=("png",))
    with pytest.raises(InvalidOptionError, match="among"):
        PolicyServer(_policy(), port=0, image_encodings=("raw", "webp"))


def _hostile_cases() -> list:
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    png = _file(noise, "PNG")
    gray = smooth_image()[..., 0]
    return [
        (_img("png", b"\x00garbage" * 20), "not a valid png"),
        (_img("jpeg", b"\xff\xd8\xff" + b"\x00" * 50), "not a valid jpeg"),
        (_img("png", png[:len(png) * 3 // 5]), "truncated or corrupt"),
        (_img("jpeg", _file(noise, "JPEG")[:-2000]), "truncated or corrupt"),
        (_img("png", _png_claiming(100_000, 100_000)), "not a valid png.*(100000|10000000000)"),
        (_img("png", _png_claiming(5000, 10)), "claims 5000x10 pixels; the limit is sides <= 4096"),
        # a bomb: 30 kB of zlib that inflates to 12 MB of pixels, over this server's raw-image budget
        (_img("png", _png_claiming(2000, 2000, b"\0" * (1 + 3 * 2000) * 2000)), "claims 2000x2000 pixels.*349525"),
        (_img("webp", png), "image format 'webp'"),
        (_img("raw", png), "image format 'raw'"),
        (_img(None, png), "image format None"),
        (_img("png", "not bytes"), "non-empty bytes"),
        (_img("png", b""), "non-empty bytes"),
        (_img("png", _file(gray, "PNG")), "mode 'L'; only 8-bit RGB"),
        (_img("jpeg", _file(gray, "JPEG")), "mode 'L'"),
        (_img("png", _file(np.dstack([smooth_image(), smooth_image()[..., :1]]), "PNG")), "mode 'RGBA'"),
        (_img("png", _file(smooth_image(), "JPEG")), "not a valid png"),  # only the claimed format's decoder
        ({"__img__": "yes", "format": "png", "data": png}, "must be uint8"),
    ]


def test_hostile_images_get_bad_request_replies_and_the_server_keeps_serving():
    from websockets.sync.client import connect
    policy = _policy()
    good = protocol.encode_image(smooth_image(), "png")
    cases = _hostile_cases()
    with PolicyServer(policy, port=0, max_message_bytes=1 << 20) as srv:
        ws = connect(f"ws://127.0.0.1:{srv.port}", compression=None, proxy=None, max_size=None)
        assert protocol.unpack(ws.recv(timeout=5))["image_encodings"] == ["raw", "png", "jpeg"]
        ws.send(protocol.pack({"type": "hello", "version": protocol.VERSION}))
        assert protocol.unpack(ws.recv(timeout=5))["type"] == "ready"
        for i, (img, match) in enumerate(cases):
            ws.send(protocol.pack({"type": "infer", "id": 2 * i, "obs": _obs(img)}))
            reply = protocol.unpack(ws.recv(timeout=10))
            assert reply["type"] == "error" and reply["code"] == "bad_request" and reply["id"] == 2 * i, reply
            assert f"obs.images[{CAM!r}]" in reply["message"], reply["message"]

            assert re.search(match, reply["message"]), (match, reply["message"])
            policy.seen = None
            ws.send(protocol.pack({"type": "infer", "id": 2 * i + 1, "obs": _obs(good)}))
            reply = protocol.unpack(ws.recv(timeout=10))
            assert reply["type"] == "chunk" and reply["id"] == 2 * i + 1, reply
            np.testing.assert_array_equal(policy.seen[CAM], smooth_image())
        ws.close()
        assert srv.stats["errors"] == len(cases) and srv.stats["requests"] == len(cases)
        with PolicyClient(port=srv.port, image_encoding="jpeg") as c:  # and other clients after
            assert c.infer(_obs()).actions.shape == (16, ACTION)


def test_the_header_is_checked_before_any_pixel_is_decoded():
    # header only, no pixel data: a decoder that ran first would report truncation, not the size
    with pytest.raises(ProtocolError, match="claims 4097x1 pixels"):
        protocol.decode_image(_img("png", _png_claiming(4097, 1, b"")))
    with pytest.raises(ProtocolError, match="claims 64x64 pixels; the limit is sides <= 4096 and <= 1000 pixels"):
        protocol.decode_image(_img("png", _png_claiming(64, 64, b"")), max_image_pixels=1000)
    jpeg = protocol.encode_image(smooth_image(), "jpeg")
    with pytest.raises(ProtocolError, match=r"format 'jpeg'; this server accepts \['png'\]"):
        protocol.decode_image(jpeg, encodings=("raw", "png"))
    assert protocol.decode_image(jpeg).shape == smooth_image().shape


def test_the_client_encodes_only_rgb_uint8_frames():
    for bad in (np.zeros((8, 8), np.uint8), np.zeros((8, 8, 3), np.float32), np.zeros((8, 8, 4), np.uint8),
                np.zeros((0, 8, 3), np.uint8)):
        with pytest.raises(ProtocolError, match="only uint8 \\(h, w, 3\\) RGB images can be sent as png"):
            protocol.encode_image(bad, "png")
    with pytest.raises(ProtocolError, match="unknown image encoding"):
        protocol.encode_image(smooth_image(), "gif")
    raw = protocol.encode_image(smooth_image(), "raw")
    assert isinstance(raw, np.ndarray)


def test_deploy_passes_the_image_encoding_to_the_client(monkeypatch):
    from deploy import commands

    class Stop(Exception):
        pass

    class Robot:
        spec = object()

        def connect(self):
            pass

        def disconnect(self):
            pass

    got = {}

    def fake_client(host, port, spec, far_margin, timeout=10.0, **kw):
        got.update(kw)
        raise Stop

    monkeypatch.setattr(commands, "make_robot", lambda args, stack: Robot())
    monkeypatch.setattr(commands, "robot_client", fake_client)
    with pytest.raises(Stop):
        commands.deploy(["--image-encoding", "jpeg", "--jpeg-quality", "70"])
    assert got == {"image_encoding": "jpeg", "jpeg_quality": 70}
    with pytest.raises(Stop):
        commands.deploy([])
    assert got == {"image_encoding": "raw", "jpeg_quality": 90}
    with pytest.raises(InvalidOptionError, match="--jpeg-quality"):
        commands.deploy(["--image-encoding", "jpeg", "--jpeg-quality", "0"])
    with pytest.raises(SystemExit):
        commands.deploy(["--image-encoding", "webp"])
