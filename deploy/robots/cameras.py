"""Camera sources that attach to any robot driver, so a real arm's policy sees real images.

A driver (``FrankaRobot``, ``URRobot``, ``XArmRobot``, ...) reports joint state only; a
``CameraRig`` wraps it and adds ``images={name: uint8 (h, w, 3) RGB}`` to every observation,
read from ``CameraSource``s:

  * ``OpenCVCamera``: a device index (``0``), a stream URL (``rtsp://...``) or a video file
    (a recorded video stands in for a device in tests and dry runs);
  * ``RealSenseCamera``: the colour stream of an Intel RealSense (needs ``pyrealsense2``).

Every source reads in a background thread and keeps only the newest frame, so a slow consumer
never drains a queue of old frames. ``read()`` returns a frame the caller has not seen yet, and
refuses, with a ``CameraError`` naming the camera, rather than hand over an old image: no new
frame within ``timeout_s`` (device stalled, stream dropped, video ended) or a frame older than
``max_age_s`` when read (the source delivers slower than the policy may tolerate).

On the command line a camera is ``NAME=SOURCE[@WxH[@FPS]]`` (``parse_camera``):
``wrist=0@128x128@30``, ``front=rtsp://host/stream``, ``front=video.mp4``,
``front=realsense:123456789@640x480@30``.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

import numpy as np

from deploy.errors import DriverMissingError, RobotConnectionError
from deploy.robots.base import Obs, Robot, RobotSpec
from envs.errors import InvalidOptionError


class CameraError(RobotConnectionError):
    """A camera could not be opened, or a frame was missing or late: the robot's eyes did not answer."""


@dataclass(frozen=True)
class Frame:
    """One captured image: ``image`` uint8 (h, w, 3) RGB; ``timestamp`` ``time.monotonic()`` at capture;
    ``index`` counts frames since ``connect()`` (a gap means frames were dropped in favour of newer ones)."""

    image: np.ndarray
    timestamp: float
    index: int


@runtime_checkable
class CameraSource(Protocol):
    """What a ``CameraRig`` needs from a camera."""

    name: str
    width: int | None
    height: int | None
    fps: float | None

    @property
    def is_connected(self) -> bool: ...

    def connect(self) -> None: ...

    def read(self) -> Frame: ...

    def disconnect(self) -> None: ...


class _ThreadedCamera:
    """The newest-frame reader every source shares; subclasses open, grab and close their device."""

    CONNECT_TIMEOUT_S = 5.0
    """at least this long for the first frame: a USB camera may take seconds to start streaming"""

    def __init__(self, name: str, width: int | None, height: int | None, fps: float | None,
                 timeout_s: float, max_age_s: float | None):
        _check_positive(name, width=width, height=height, fps=fps, timeout_s=timeout_s, max_age_s=max_age_s)
        if (width is None) != (height is None):
            raise InvalidOptionError(f"camera {name!r}: give both width and height, or neither")
        self.name, self.width, self.height, self.fps = name, width, height, fps
        self.timeout_s = float(timeout_s)
        self._max_age_s = max_age_s
        self._cond = threading.Condition()
        self._frame: Frame | None = None
        self._returned = -1  # index of the last frame read() handed out
        self._ended: str | None = None  # why the source stopped for good (a video's end)
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._orphaned = False  # a reader disconnect() could not join: it releases the device itself

    @property
    def max_age_s(self) -> float:
        """Oldest frame ``read()`` returns: given, or two frame periods (a frame may wait one period)."""
        if self._max_age_s is not None:
            return float(self._max_age_s)
        return 2.0 / self.fps if self.fps else 0.2

    @property
    def is_connected(self) -> bool:
        return self._thread is not None

    def connect(self) -> None:
        """Open the source and start reading; fails unless a first frame arrives (``CONNECT_TIMEOUT_S``)."""
        if self.is_connected:
            return
        if self._orphaned:
            raise CameraError(f"camera {self.name!r}: the last reader is still blocked in a read of "
                              f"{self.describe_source()}; try again when it returns")
        self._open()
        self._frame, self._returned, self._ended, self._failure = None, -1, None, None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"camera-{self.name}", daemon=True)
        self._thread.start()
        wait_s = max(self.timeout_s, self.CONNECT_TIMEOUT_S)
        with self._cond:
            self._cond.wait_for(lambda: self._frame is not None or self._stopped(), wait_s)
            ok = self._frame is not None
        if not ok:
            why = self._why_stopped() or f"no frame within {wait_s:g} s"
            self.disconnect()
            raise CameraError(f"camera {self.name!r} ({self.describe_source()}) opened but gave no frame: {why}")

    def read(self) -> Frame:
        """The newest frame not returned before; ``CameraError`` when it is missing or late (module docstring)."""
        if not self.is_connected:
            raise CameraError(f"camera {self.name!r} is not connected; call connect() first")
        with self._cond:
            fresh = self._cond.wait_for(lambda: self._has_new() or self._stopped(), self.timeout_s)
            frame = self._frame
            if not fresh or not self._has_new():
                raise CameraError(self._missing_message())
            self._returned = frame.index
        age = time.monotonic() - frame.timestamp
        if age > self.max_age_s:
            raise CameraError(f"camera {self.name!r}: frame {frame.index} is late: {age * 1e3:.0f} ms old, the limit "
                              f"is {self.max_age_s * 1e3:.0f} ms (the source delivers too slowly for this reader)")
        return frame

    def disconnect(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=max(1.0, self.timeout_s))
            self._orphaned = self._thread.is_alive()  # blocked in the device's read (a hung stream)
            self._thread = None
        if not self._orphaned:  # releasing under a blocked read can crash the capture library
            self._close()

    def describe_source(self) -> str:
        raise NotImplementedError

    # ----- subclass hooks -------------------------------------------------------------------
    def _open(self) -> None:
        raise NotImplementedError

    def _grab(self) -> np.ndarray | None:
        """The next RGB image, blocking until the device has one; None: nothing this time (retry)."""
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    # ----- internals ------------------------------------------------------------------------
    def _run(self) -> None:
        index = 0
        try:
            while not self._stop.is_set():
                image = self._grab()
                if image is None:
                    if self._ended is not None:
                        break
                    self._stop.wait(0.005)  # a transient dropout: try again without spinning
                    continue
                t = time.monotonic()  # capture time: before the resize
                frame = Frame(self._fit(image), t, index)
                index += 1
                with self._cond:
                    self._frame = frame
                    self._cond.notify_all()
        except BaseException as e:  # reported by read(): the reader must not die silently
            self._failure = e
        finally:
            with self._cond:
                self._cond.notify_all()
            if self._orphaned:
                self._close()
                self._orphaned = False

    def _fit(self, image: np.ndarray) -> np.ndarray:
        """Resize to (width, height) when the device delivered another size (INTER_AREA: no aliasing)."""
        if self.width is None or image.shape[:2] == (self.height, self.width):
            return np.ascontiguousarray(image)
        import cv2
        return cv2.resize(image, (self.width, self.height), interpolation=cv2.INTER_AREA)

    def _has_new(self) -> bool:
        return self._frame is not None and self._frame.index > self._returned

    def _stopped(self) -> bool:
        return self._ended is not None or self._failure is not None

    def _why_stopped(self) -> str | None:
        if self._failure is not None:
            return f"the reader failed: {type(self._failure).__name__}: {self._failure}"
        return self._ended

    def _missing_message(self) -> str:
        last = ("no frame yet" if self._frame is None else
                f"last frame {self._frame.index} is {time.monotonic() - self._frame.timestamp:.2f} s old")
        why = self._why_stopped() or f"none within {self.timeout_s:g} s"
        return f"camera {self.name!r}: frame missing: {why} ({last}; source {self.describe_source()})"


class OpenCVCamera(_ThreadedCamera):
    """A ``cv2.VideoCapture`` source: device index, stream URL or video file.

    ``width``/``height``: the size ``read()`` returns (requested from a device, resized otherwise;
    None: the source's own). ``fps``: requested from a device; a video file is played at this rate
    (None: the file's own), so it behaves like a device. ``loop``: replay a video file from the start
    when it ends instead of reporting missing frames.
    """

    def __init__(self, name: str, source: int | str | Path, width: int | None = None, height: int | None = None,
                 fps: float | None = None, timeout_s: float = 1.0, max_age_s: float | None = None,
                 loop: bool = False):
        super().__init__(name, width, height, fps, timeout_s, max_age_s)
        self.source = source if isinstance(source, int) else str(source)
        self.loop = loop
        self._cap: Any = None
        self._next_due = 0.0

    @property
    def is_file(self) -> bool:
        return isinstance(self.source, str) and "://" not in self.source

    def describe_source(self) -> str:
        return f"device {self.source}" if isinstance(self.source, int) else repr(self.source)

    def _open(self) -> None:
        import cv2
        if self.is_file and not Path(self.source).is_file():
            raise CameraError(f"camera {self.name!r}: no video file {self.source!r} "
                              "(give a device index, a stream URL with ://, or an existing video file)")
        cap = cv2.VideoCapture(self.source)
        if not cap.isOpened():
            cap.release()
            raise CameraError(f"camera {self.name!r}: OpenCV cannot open {self.describe_source()} "
                              "(is the device present and not in use, the URL reachable, the file a video?)")
        if isinstance(self.source, int):  # ask the device for the size and rate; _fit covers a refusal
            for prop, v in ((cv2.CAP_PROP_FRAME_WIDTH, self.width), (cv2.CAP_PROP_FRAME_HEIGHT, self.height),
                            (cv2.CAP_PROP_FPS, self.fps)):
                if v is not None:
                    cap.set(prop, v)
        if self.width is None:
            w, h = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
            self.width, self.height = (w, h) if w > 0 and h > 0 else (None, None)
        if self.fps is None:
            self.fps = float(cap.get(cv2.CAP_PROP_FPS)) or None
        self._cap, self._next_due = cap, time.monotonic()

    def _grab(self) -> np.ndarray | None:
        import cv2
        if self.is_file:
            self._pace()
        ok, bgr = self._cap.read()
        if not ok and self.is_file and self.loop:
            self._cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
            ok, bgr = self._cap.read()
        if not ok:
            if self.is_file:
                self._ended = "the video ended (pass loop=True to replay it)"
            return None
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

    def _pace(self) -> None:
        """Deliver a file's frames at ``fps``, as a device would, instead of as fast as they decode."""
        if not self.fps:
            return
        delay = self._next_due - time.monotonic()
        if delay > 0:
            self._stop.wait(delay)
        self._next_due = max(self._next_due + 1.0 / self.fps, time.monotonic())  # behind: no burst to catch up

    def _close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None


class RealSenseCamera(_ThreadedCamera):
    """The colour stream of an Intel RealSense (``serial``: which one; None: the first found).

    Thin on purpose: ``pyrealsense2`` opens the device and delivers RGB frames; the newest-frame,
    timeout and age logic is the shared one. Untested without hardware.
    """

    def __init__(self, name: str, serial: str | None = None, width: int = 640, height: int = 480, fps: float = 30,
                 timeout_s: float = 1.0, max_age_s: float | None = None):
        super().__init__(name, width, height, fps, timeout_s, max_age_s)
        self.serial = serial
        self._pipeline: Any = None

    def describe_source(self) -> str:
        return f"RealSense {self.serial}" if self.serial else "the first RealSense"

    def _open(self) -> None:
        rs = _import_pyrealsense2()
        config = rs.config()
        if self.serial:
            config.enable_device(self.serial)
        config.enable_stream(rs.stream.color, self.width, self.height, rs.format.rgb8, int(self.fps))
        pipeline = rs.pipeline()
        try:
            pipeline.start(config)
        except RuntimeError as e:  # no device, wrong serial, unsupported size/rate
            raise CameraError(f"camera {self.name!r}: cannot start {self.describe_source()} at "
                              f"{self.width}x{self.height}@{self.fps:g}: {e}") from e
        self._pipeline = pipeline

    def _grab(self) -> np.ndarray | None:
        try:
            frames = self._pipeline.wait_for_frames(int(self.timeout_s * 1e3))
        except RuntimeError:  # no frame within the timeout: read() reports it
            return None
        color = frames.get_color_frame()
        return np.asanyarray(color.get_data()).copy() if color else None

    def _close(self) -> None:
        if self._pipeline is not None:
            try:
                self._pipeline.stop()
            finally:
                self._pipeline = None


def _import_pyrealsense2() -> Any:
    try:
        import pyrealsense2 as rs
    except ImportError as e:
        raise DriverMissingError("RealSense cameras need pyrealsense2 (pip install pyrealsense2; not part of the "
                                 f"project's setup) and the system's libusb-1.0; importing it failed: {e}") from e
    return rs


class CameraRig:
    """A ``Robot`` that is ``robot`` plus cameras: observations gain ``images``, the spec lists the cameras.

    Anything else (``reset``, ``env``, ``task_id``, ``forward_kinematics``, ...) is the driver's, so the
    layers above treat a rigged robot as the driver it wraps. ``last_frames`` keeps the frames of the
    last observation (timestamps, indices) without widening the observation convention.
    """

    def __init__(self, robot: Robot, cameras: Mapping[str, CameraSource] | Iterable[CameraSource]):
        self.robot = robot
        self.cameras: dict[str, CameraSource] = (dict(cameras) if isinstance(cameras, Mapping)
                                                 else {c.name: c for c in cameras})
        if not self.cameras:
            raise InvalidOptionError("CameraRig needs at least one camera")
        self.last_frames: dict[str, Frame] = {}

    @property
    def spec(self) -> RobotSpec | None:
        spec = self.robot.spec
        if spec is None:  # drivers that learn their spec on connect (SimRobot)
            return None
        return replace(spec, cameras=spec.cameras + tuple(c for c in self.cameras if c not in spec.cameras))

    @property
    def is_connected(self) -> bool:
        return self.robot.is_connected and all(c.is_connected for c in self.cameras.values())

    def connect(self) -> None:
        """Connect the driver, then every camera; when one fails, disconnect what was connected and raise."""
        self.robot.connect()
        done: list[CameraSource] = []
        try:
            clash = sorted(set(self.robot.spec.cameras) & set(self.cameras))
            if clash:
                raise InvalidOptionError(f"camera name(s) {clash} are already {self.robot.spec.name}'s own "
                                         "cameras; pick other names")
            for cam in self.cameras.values():
                cam.connect()
                done.append(cam)
        except BaseException:
            for cam in done:
                cam.disconnect()
            self.robot.disconnect()
            raise

    def disconnect(self) -> None:
        self._disconnect_cameras()
        self.robot.disconnect()

    def close(self) -> None:
        """Disconnect the cameras, then close the driver the way it closes (``close`` or ``disconnect``)."""
        self._disconnect_cameras()
        getattr(self.robot, "close", self.robot.disconnect)()

    def get_observation(self) -> Obs:
        obs = self.robot.get_observation()
        frames = {name: cam.read() for name, cam in self.cameras.items()}
        obs["images"] = {**obs.get("images", {}), **{name: f.image for name, f in frames.items()}}
        self.last_frames = frames
        return obs

    def send_action(self, action: np.ndarray) -> None:
        self.robot.send_action(action)

    def hold_action(self) -> np.ndarray:
        return self.robot.hold_action()

    def __getattr__(self, name: str) -> Any:
        # only what the driver has: never dunders (copy, pickle) nor our own attributes before __init__ set them
        if name.startswith("__") or name in ("robot", "cameras", "last_frames"):
            raise AttributeError(name)
        return getattr(self.robot, name)

    def _disconnect_cameras(self) -> None:
        for cam in self.cameras.values():
            cam.disconnect()


# ----- command line -------------------------------------------------------------------------
CAMERA_SYNTAX = "NAME=SOURCE[@WxH[@FPS]] (SOURCE: device index, stream URL, video file, or realsense[:SERIAL])"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_SPEC = re.compile(r"(?P<src>.+?)(?:@(?P<w>\d+)x(?P<h>\d+)(?:@(?P<fps>\d+(?:\.\d+)?))?)?")


def parse_camera(text: str) -> CameraSource:
    """One ``--camera`` value as a camera source; ``InvalidOptionError`` naming the problem otherwise."""
    name, eq, rest = text.partition("=")
    if not eq or not rest:
        raise InvalidOptionError(f"--camera {text!r}: expected {CAMERA_SYNTAX}")
    if not _NAME.fullmatch(name):
        raise InvalidOptionError(f"--camera {text!r}: camera name {name!r} must be letters, digits, _ or -, "
                                 "starting with a letter or _")
    if rest.startswith("@"):
        raise InvalidOptionError(f"--camera {text!r}: no SOURCE before '@'; expected {CAMERA_SYNTAX}")
    m = _SPEC.fullmatch(rest)
    src = m["src"]
    if "@" in src and "://" not in src:  # in a URL '@' may end user:password; elsewhere it starts the size
        raise InvalidOptionError(f"--camera {text!r}: bad size/rate '@{src.partition('@')[2]}': expected "
                                 "@WxH or @WxH@FPS, e.g. @640x480@30")
    w, h = (int(m["w"]), int(m["h"])) if m["w"] else (None, None)
    fps = float(m["fps"]) if m["fps"] else None
    if w == 0 or h == 0 or fps == 0:
        raise InvalidOptionError(f"--camera {text!r}: width, height and fps must be > 0")
    if src == "realsense" or src.startswith("realsense:"):
        given = {k: v for k, v in (("width", w), ("height", h), ("fps", fps)) if v is not None}
        return RealSenseCamera(name, serial=src.partition(":")[2] or None, **given)
    return OpenCVCamera(name, int(src) if src.isdigit() else src, w, h, fps)


def parse_cameras(texts: Iterable[str]) -> dict[str, CameraSource]:
    """Every ``--camera`` value, keyed by name; a name given twice is refused."""
    out: dict[str, CameraSource] = {}
    for text in texts:
        cam = parse_camera(text)
        if cam.name in out:
            raise InvalidOptionError(f"--camera: name {cam.name!r} is given twice")
        out[cam.name] = cam
    return out


def _check_positive(name: str, **values: float | None) -> None:
    bad = [f"{k}={v}" for k, v in values.items() if v is not None and not v > 0]
    if bad:
        raise InvalidOptionError(f"camera {name!r}: {', '.join(bad)} must be > 0")
