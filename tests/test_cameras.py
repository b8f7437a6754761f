"""Camera sources (deploy/robots/cameras.py), with a recorded video standing in for a device."""

from __future__ import annotations

import json
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from deploy.robots.cameras import CameraError, CameraRig, Frame, OpenCVCamera, RealSenseCamera, parse_camera, parse_cameras
from deploy.commands import DeployArgs, make_robot
from deploy.robots.base import Robot
from deploy.robots.sim import SimRobot
from envs.errors import InvalidOptionError

N_FRAMES, W, H = 30, 64, 48


def colour(i: int) -> np.ndarray:
    """A distinct RGB colour per frame (blue steps by 53), so MJPG loss cannot make one frame look like another."""
    return np.array([(i * 8) % 256, 255 - (i * 8) % 256, (i * 53) % 256], np.uint8)


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    """30 solid-colour 64x48 frames at 30 fps, MJPG in .avi (decodes everywhere OpenCV does)."""
    path = tmp_path_factory.mktemp("cams") / "clip.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 30, (W, H))
    assert writer.isOpened()
    for i in range(N_FRAMES):
        writer.write(cv2.cvtColor(np.broadcast_to(colour(i), (H, W, 3)).copy(), cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def read_all(cam: OpenCVCamera) -> tuple[list[Frame], CameraError]:
    frames = []
    while True:
        try:
            frames.append(cam.read())
        except CameraError as e:
            return frames, e


def test_video_reads_rgb_of_requested_size_in_order_then_reports_its_end(video):
    cam = OpenCVCamera("front", video, width=32, height=24, fps=60, timeout_s=2.0)
    cam.connect()
    try:
        t0 = time.monotonic()
        frames, err = read_all(cam)
        took = time.monotonic() - t0
    finally:
        cam.disconnect()
    index = [f.index for f in frames]  # a reader as fast as the source drops none; a stalled one skips, never repeats
    assert len(frames) >= N_FRAMES // 2 and index[-1] == N_FRAMES - 1 and np.all(np.diff(index) > 0), index
    assert all(f.image.shape == (24, 32, 3) and f.image.dtype == np.uint8 for f in frames)
    assert np.all(np.diff([f.timestamp for f in frames]) > 0)
    for f in frames:  # RGB, not BGR: channel 0 is the red ramp
        assert np.abs(f.image.reshape(-1, 3).mean(0) - colour(f.index)).max() < 8, (f.index, f.image[0, 0])
    assert str(err).startswith("camera 'front': frame missing: the video ended (pass loop=True to replay it)")
    assert str(video) in str(err)
    assert took < 2.0  # the end is reported at once, not after the timeout


def test_video_is_played_at_the_requested_rate_and_loops(video):
    cam = OpenCVCamera("front", video, fps=50, loop=True)
    cam.connect()
    try:
        frames = [cam.read() for _ in range(N_FRAMES + 5)]
    finally:
        cam.disconnect()
    assert (cam.width, cam.height) == (W, H)  # no size given: the source's own
    assert frames[-1].index >= N_FRAMES + 4
    period = np.median(np.diff([f.timestamp for f in frames]))
    assert 0.015 < period < 0.03, period  # paced like a 50 fps device, not decoded as fast as possible
    for f in frames:  # replayed from the start: frame N_FRAMES + k shows frame k
        assert np.abs(f.image.reshape(-1, 3).mean(0) - colour(f.index % N_FRAMES)).max() < 8, f.index


def test_missing_file_names_the_source(tmp_path):
    cam = OpenCVCamera("wrist", tmp_path / "nope.avi")
    with pytest.raises(CameraError, match=r"camera 'wrist'.*no video file .*nope\.avi"):
        cam.connect()
    assert not cam.is_connected
    with pytest.raises(CameraError, match="not connected"):
        cam.read()


def test_a_file_that_is_not_a_video_is_refused(tmp_path):
    bad = tmp_path / "notes.avi"
    bad.write_text("not a video")
    with pytest.raises(CameraError, match=r"camera 'wrist'.*notes\.avi"):
        OpenCVCamera("wrist", bad).connect()


def test_late_frame_is_refused_not_returned(video):
    # a 1 fps source: frame 1 arrives ~1 s after frame 0 and is ~0.5 s old when read at 1.5 s, before frame 2
    cam = OpenCVCamera("front", video, fps=1, timeout_s=2.0, max_age_s=0.25)
    cam.connect()
    try:
        first = cam.read()
        time.sleep(max(0.0, first.timestamp + 1.5 - time.monotonic()))
        with pytest.raises(CameraError, match=r"camera 'front': frame 1 is late: \d+ ms old, the limit is 250 ms"):
            cam.read()
    finally:
        cam.disconnect()


def test_no_new_frame_within_timeout_is_missing(video):
    cam = OpenCVCamera("front", video, fps=2, timeout_s=0.1, max_age_s=5.0)
    cam.connect()
    try:
        cam.read()
        t0 = time.monotonic()
        with pytest.raises(CameraError, match=r"frame missing: none within 0\.1 s \(last frame 0 is"):
            cam.read()  # the next frame is due ~0.5 s later
        assert time.monotonic() - t0 < 0.4
    finally:
        cam.disconnect()


@pytest.fixture
def sim() -> SimRobot:
    """The cheapest simulated robot (Adroit door, ~0.1 s to build)."""
    return SimRobot("adroit/door")


def test_rig_adds_images_and_lists_the_camera(sim, video):
    rig = CameraRig(sim, [OpenCVCamera("wrist", video, width=32, height=24, fps=60, loop=True)])
    assert isinstance(rig, Robot)
    rig.connect()
    try:
        assert rig.is_connected
        assert rig.spec.cameras == ("wrist",) and rig.spec.action_dim == sim.spec.action_dim
        assert rig.spec.describe()["cameras"] == ["wrist"]
        obs, frames = [], []
        for _ in range(3):
            obs.append(rig.get_observation())
            frames.append(rig.last_frames["wrist"])
        assert set(obs[0]) == {"state", "instruction", "images"} and obs[0]["state"].shape == (sim.spec.state_dim,)
        assert all(o["images"]["wrist"] is f.image for o, f in zip(obs, frames))
        assert obs[0]["images"]["wrist"].shape == (24, 32, 3)
        assert np.all(np.diff([f.index for f in frames]) > 0)  # a new frame each observation
        assert rig.task_id == 0 and rig.env is sim.env  # the driver's attributes pass through
        rig.send_action(rig.hold_action())
        assert sim.steps == 1
    finally:
        rig.close()
    assert not rig.is_connected and not rig.cameras["wrist"].is_connected


def test_rig_disconnects_the_driver_when_a_camera_fails(sim, video, tmp_path):
    good = OpenCVCamera("front", video, fps=60, loop=True)
    rig = CameraRig(sim, {"front": good, "wrist": OpenCVCamera("wrist", tmp_path / "missing.avi")})
    with pytest.raises(CameraError, match="missing.avi"):
        rig.connect()
    assert not sim.is_connected and not good.is_connected


def test_deploy_args_wrap_the_robot_in_a_rig(video):
    args = DeployArgs(robot="sim", env="adroit/door", camera=(f"front={video}@32x24@30",))
    rig = make_robot(args, [])
    assert isinstance(rig, CameraRig) and isinstance(rig.robot, SimRobot)
    cam = rig.cameras["front"]
    assert (cam.source, cam.width, cam.height, cam.fps) == (str(video), 32, 24, 30.0)
    assert isinstance(make_robot(DeployArgs(robot="sim", env="adroit/door"), []), SimRobot)


@pytest.mark.parametrize("text, kind, source, size, fps", [
    ("wrist=0@128x128@30", OpenCVCamera, 0, (128, 128), 30.0),
    ("front=video.mp4", OpenCVCamera, "video.mp4", (None, None), None),
    ("front=rtsp://user:pw@10.0.0.5:554/s@640x480", OpenCVCamera, "rtsp://user:pw@10.0.0.5:554/s", (640, 480), None),
    ("top=realsense:123456789@848x480@15", RealSenseCamera, "123456789", (848, 480), 15.0),
    ("top=realsense", RealSenseCamera, None, (640, 480), 30.0),
])
def test_parse_good_specs(text, kind, source, size, fps):
    cam = parse_camera(text)
    assert type(cam) is kind and cam.name == text.partition("=")[0]
    assert getattr(cam, "source", getattr(cam, "serial", None)) == source
    assert (cam.width, cam.height, cam.fps) == (*size, fps)


@pytest.mark.parametrize("text, problem", [
    ("wrist", "expected NAME=SOURCE"),
    ("wrist=", "expected NAME=SOURCE"),
    ("=0", "camera name ''"),
    ("my cam=0", "camera name 'my cam'"),
    ("wrist=@640x480", "no SOURCE"),
    ("wrist=0@640", "bad size/rate '@640'"),
    ("wrist=0@640x480@fast", "bad size/rate '@640x480@fast'"),
    ("wrist=0@0x480", "must be > 0"),
])
def test_parse_bad_specs(text, problem):
    with pytest.raises(InvalidOptionError, match=problem.replace("(", r"\(")) as e:
        parse_camera(text)
    assert "\n" not in str(e.value) and text in str(e.value)


def test_parse_refuses_a_name_twice():
    with pytest.raises(InvalidOptionError, match="'wrist' is given twice"):
        parse_cameras(["wrist=0", "wrist=1"])


def test_realsense_without_its_package_says_how_to_install():
    try:
        import pyrealsense2  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pyrealsense2"):
            RealSenseCamera("top").connect()
    else:
        pytest.skip("pyrealsense2 is installed here; its no-package message cannot be checked")


def test_deploy_sends_and_records_camera_images_for_a_policy_that_needs_them(video, tmp_path, capsys, caplog):
    from deploy.scripted import JointTargetPolicy
    from deploy.serving.server import PolicyServer
    from groundflow.cli import main

    class NeedsFront(JointTargetPolicy):
        """A bring-up policy that asks for a 'front' camera and keeps the image sizes it was sent."""

        def __init__(self):
            super().__init__(39, 28, [0.0] * 4)  # adroit/door: 39 state, 28 action dims
            self.config.cameras = ("front",)
            self.seen: list[tuple[int, ...]] = []

        def predict_action_chunk(self, obs, **kw):
            self.seen.append(obs["images"]["front"].shape)
            return super().predict_action_chunk(obs)

    policy = NeedsFront()
    rec = tmp_path / "rec.h5"
    with PolicyServer(policy, port=0) as srv:
        base = ["deploy", "--robot", "sim", "--env", "adroit/door", "--lockstep", "--no-status", "--server", srv.address]
        refused = main(base + ["--max-steps", "8"])
        _, err = capsys.readouterr()
        # 10 fps: the 30-frame video lasts 3 s, the 8 steps (one new frame each) take ~0.9 s
        code = main(base + ["--max-steps", "8", "--camera", f"front={video}@32x24@10", "--record", str(rec)])
        out, _ = capsys.readouterr()
        seen = list(policy.seen)
        # 30 fps: the video ends after 1 s (<= 30 steps, one new frame each): the episode ends, the exit code says so
        ended = main(base + ["--max-steps", "100", "--camera", f"front={video}@64x48@30"])
        out_ended, err_ended = capsys.readouterr()
    assert refused != 0 and "cameras: server's policy needs ['front'], this client provides []" in err
    ends = [json.loads(x) for x in out_ended.splitlines() if x.startswith('{"steps"')]
    assert ended == 1 and [(e["reason"], e["steps"] <= 30) for e in ends] in ([("driver_error", True)], [])
    told = caplog.text + err_ended  # mid-episode the safety layer logs it; at the first observation the command says it
    assert "camera 'front'" in told and "ended (pass loop=True to replay it)" in told, told
    episode = json.loads([x for x in out.splitlines() if x.startswith('{"steps"')][0])
    assert code == 0 and episode["steps"] == 8, (code, out)
    assert seen and set(seen) == {(24, 32, 3)}
    import h5py
    with h5py.File(rec) as f:  # the recording keeps what the policy saw
        assert f["episodes/000000/images/front"].shape == (8, 24, 32, 3)
