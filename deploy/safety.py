"""The safety layer: always between the policy and the driver; every intervention counted.

What it does to each fresh action (in this order):

1. **shape / type** — anything that is not a finite float vector of ``action_dim`` entries is
   *rejected* (type ``shape``); **NaN/inf** is *rejected* (``nonfinite``).
2. **far out of limits** — a value more than ``far_margin`` x (range) outside ``[low, high]`` is
   *rejected* (``far_out_of_limits``): such an action is a bug, not a slightly eager policy.
3. **joint / command limits** — a value outside ``[low, high]`` but within the margin is
   *clipped* (``limit_clip``) with ``limit_mode="clip"`` (default) or *rejected*
   (``limit_reject``) with ``limit_mode="reject"``.
4. **workspace** — with a forward-kinematics function and a Cartesian box, a target whose
   end effector leaves the box is *rejected* (``workspace``). Clipping would need IK. Likewise a
   target whose end effector lands inside a keep-out sphere (``keep_out``).
5. **velocity / acceleration** (absolute dimensions only) — the target is projected, per
   dimension, onto the interval the limits allow from the last two commands:
   ``|a - p1| <= V dt`` (``velocity``), ``|(a - p1) - (p1 - p0)| <= A dt^2`` (``acceleration``),
   and a braking bound so the target can always stop before the joint limit within ``A``
   (``braking``). Per-dimension projection can bend the direction of motion: that is the price
   of an exact guarantee per joint.

*Rejected* means the robot holds: absolute dimensions brake to rest within the acceleration
limit and then repeat their target; delta dimensions command zero. ``dt`` is the nominal
control period (a late tick therefore moves less, never more). Holds also come from the
**watchdog** (no fresh action within ``watchdog_s``; the control loop and an optional thread
check it), a **stop signal** (SIGINT/SIGTERM, see ``signal_stop``), and **driver errors**
(``driver_error``: the layer tries one hold, then reports the fault).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from deploy.robots.base import ForwardKinematics, Robot
from envs.errors import InvalidOptionError

log = logging.getLogger("groundflow.deploy.safety")

INTERVENTIONS = ("shape", "nonfinite", "far_out_of_limits", "limit_clip", "limit_reject", "workspace", "keep_out",
                 "velocity", "acceleration", "braking", "watchdog", "stop_signal", "driver_error", "constraint")
"""``constraint``: a hold the policy server asked for (no chunk passed the deploy-time obstacles' check)"""
REJECTING = {"shape", "nonfinite", "far_out_of_limits", "limit_reject", "workspace", "keep_out"}


@dataclass
class SafetyConfig:
    limit_mode: str = "clip"
    """'clip' (default) or 'reject' actions slightly outside the command limits"""
    far_margin: float = 0.1
    """values beyond limits by more than this fraction of the range are always rejected"""
    velocity_scale: float = 1.0
    """multiplies the robot's velocity limits (e.g. 0.5 for a first run)"""
    acceleration_scale: float = 1.0
    """multiplies the robot's acceleration limits"""
    workspace_low: tuple[float, float, float] | None = None
    """end-effector box (m, robot base frame); needs a forward-kinematics function"""
    workspace_high: tuple[float, float, float] | None = None
    keep_out: tuple[tuple[float, float, float, float], ...] = ()
    """spheres ``(x, y, z, radius)`` (m, robot base frame) the end effector must stay out of: a target
    whose end effector lands inside one is rejected (needs a forward-kinematics function). The last
    line under a guided policy; the radius must cover the hand around the TCP (about 0.1 m for a Panda)"""
    watchdog_s: float = 0.25
    """hold when no fresh action arrived for this long"""
    log_every: int = 1000
    """log the first 3 interventions of each type, then every Nth"""

    def __post_init__(self) -> None:
        if self.limit_mode not in ("clip", "reject"):
            raise InvalidOptionError(f"limit_mode must be 'clip' or 'reject', got {self.limit_mode!r}")
        if not self.far_margin >= 0:
            raise InvalidOptionError(f"far_margin must be >= 0, got {self.far_margin}")
        if not (self.velocity_scale > 0 and self.acceleration_scale > 0):
            raise InvalidOptionError("velocity_scale and acceleration_scale must be > 0")
        if (self.workspace_low is None) != (self.workspace_high is None):
            raise InvalidOptionError("give both workspace_low and workspace_high, or neither")
        for k, sphere in enumerate(self.keep_out):
            if len(sphere) != 4 or not all(np.isfinite(v) for v in sphere) or not sphere[3] > 0:
                raise InvalidOptionError(f"keep_out[{k}] must be (x, y, z, radius) with a finite centre and radius > 0; "
                                         f"got {tuple(sphere)}")
        if not self.watchdog_s > 0:
            raise InvalidOptionError(f"watchdog_s must be > 0, got {self.watchdog_s}")


class SafetyLayer:
    """Filters every action to ``robot``; ``dt`` is the control period in seconds."""

    def __init__(self, robot: Robot, config: SafetyConfig | None = None, dt: float | None = None,
                 fk: ForwardKinematics | None = None):
        self.robot = robot
        self.config = cfg = config or SafetyConfig()
        spec = robot.spec
        self.dt = float(dt if dt is not None else 1.0 / spec.control_rate_hz)
        if not self.dt > 0:
            raise InvalidOptionError(f"control period dt must be > 0, got {dt}")
        self.low, self.high = spec.action_low.astype(np.float64), spec.action_high.astype(np.float64)
        self.absolute = spec.absolute.copy()
        self.vmax = spec.velocity_limits * cfg.velocity_scale
        self.amax = spec.acceleration_limits * cfg.acceleration_scale
        self.fk = fk
        if (cfg.workspace_low is not None or cfg.keep_out) and fk is None:
            raise InvalidOptionError("a workspace box or keep-out spheres need a forward-kinematics function (fk=...)")
        self.keep_out = np.asarray(cfg.keep_out, np.float64).reshape(-1, 4)
        self.ws_low = None if cfg.workspace_low is None else np.asarray(cfg.workspace_low, np.float64)
        self.ws_high = None if cfg.workspace_high is None else np.asarray(cfg.workspace_high, np.float64)
        self.counts: Counter[str] = Counter()
        self.events: deque[dict[str, Any]] = deque(maxlen=1000)
        self.n_commands = 0
        self.n_fresh = 0
        self.stop_requested = False
        self.faulted: str | None = None
        self._p1: np.ndarray | None = None
        self._p0: np.ndarray | None = None
        self._last_fresh = time.monotonic()
        self._last_sent = time.monotonic()
        self._send_lock = threading.Lock()
        self._wd_thread: threading.Thread | None = None
        self._wd_stop = threading.Event()

    # ----- state ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Start from the robot's current targets, at rest (call at every episode start)."""
        hold = np.asarray(self.robot.hold_action(), np.float64).reshape(-1)
        self._p1, self._p0 = hold.copy(), hold.copy()
        self._last_fresh = self._last_sent = time.monotonic()
        self.faulted = None

    @property
    def last_command(self) -> np.ndarray | None:
        return None if self._p1 is None else self._p1.astype(np.float32)

    def summary(self) -> dict[str, Any]:
        return {"counts": {k: int(self.counts.get(k, 0)) for k in INTERVENTIONS}, "commands": self.n_commands,
                "fresh": self.n_fresh, "faulted": self.faulted}

    def _event(self, kind: str, detail: str = "") -> None:
        self.counts[kind] += 1
        n = self.counts[kind]
        self.events.append({"t": time.time(), "type": kind, "detail": detail[:200]})
        if n <= 3 or n % max(self.config.log_every, 1) == 0:
            log.warning("safety: %s (#%d) %s", kind, n, detail[:200])

    # ----- the filter -----------------------------------------------------------------------
    def filter(self, action: Any) -> tuple[np.ndarray, list[str]]:
        """The command that will be sent for ``action`` and the interventions it took (no I/O)."""
        if self._p1 is None:
            self.reset()
        events: list[str] = []
        try:
            a = np.asarray(action, dtype=np.float64).reshape(-1) if action is not None else None
        except (TypeError, ValueError):
            a = None
        if a is None or a.shape != self.low.shape:
            return self._hold_target(), [f"shape:{_describe(action)}"]
        if not np.all(np.isfinite(a)):
            return self._hold_target(), [f"nonfinite:{np.flatnonzero(~np.isfinite(a)).tolist()}"]
        rng = self.high - self.low
        far = (a < self.low - self.config.far_margin * rng) | (a > self.high + self.config.far_margin * rng)
        if far.any():
            return self._hold_target(), [f"far_out_of_limits:dims {np.flatnonzero(far).tolist()}"]
        out = (a < self.low) | (a > self.high)
        if out.any():
            if self.config.limit_mode == "reject":
                return self._hold_target(), [f"limit_reject:dims {np.flatnonzero(out).tolist()}"]
            a = np.clip(a, self.low, self.high)
            events.append(f"limit_clip:dims {np.flatnonzero(out).tolist()}")
        if self.fk is not None and (self.ws_low is not None or len(self.keep_out)):
            ee_pos = np.asarray(self.fk(a.astype(np.float64)), np.float64).reshape(-1)[:3]  # once per target
            if self.ws_low is not None and not self._in_workspace(ee_pos):
                return self._hold_target(), events + ["workspace:target outside the workspace box"]
            inside = self._keep_out_hit(ee_pos)
            if inside is not None:
                return self._hold_target(), events + [f"keep_out:target inside keep-out sphere {inside}"]
        cmd, rate_events = self._rate_limit(a)
        return cmd, events + rate_events

    def _in_workspace(self, ee_pos: np.ndarray) -> bool:
        return bool(np.all(np.isfinite(ee_pos)) and np.all(ee_pos >= self.ws_low) and np.all(ee_pos <= self.ws_high))

    def _keep_out_hit(self, ee_pos: np.ndarray) -> int | None:
        """Index of the keep-out sphere the end effector lands in (a non-finite one: 0), or None."""
        if not len(self.keep_out):
            return None
        if not np.all(np.isfinite(ee_pos)):
            return 0
        dist = np.linalg.norm(self.keep_out[:, :3] - ee_pos, axis=1) - self.keep_out[:, 3]
        return int(np.argmin(dist)) if float(dist.min()) < 0 else None

    def _intervals(self) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """Per-dimension interval allowed for the next absolute target, and its parts."""
        p1, p0, dt = self._p1, self._p0, self.dt
        v_prev = (p1 - p0) / dt
        V, A = self.vmax, self.amax
        with np.errstate(invalid="ignore", over="ignore"):
            vel = (p1 - V * dt, p1 + V * dt)
            acc = (p1 + v_prev * dt - A * dt * dt, p1 + v_prev * dt + A * dt * dt)
            # braking: after moving with v we must stop (decel A) before the limit:
            # v <= -A dt + sqrt(A^2 dt^2 + 2 A d), d = distance to the limit
            up = -A * dt + np.sqrt(A * A * dt * dt + 2 * A * np.maximum(self.high - p1, 0))
            dn = -A * dt + np.sqrt(A * A * dt * dt + 2 * A * np.maximum(p1 - self.low, 0))
            brake = (np.where(np.isfinite(A), p1 - dn * dt, -np.inf), np.where(np.isfinite(A), p1 + up * dt, np.inf))
        parts = {"velocity": vel, "acceleration": acc, "braking": brake}
        lo = np.maximum.reduce([self.low, vel[0], acc[0], brake[0]])
        hi = np.minimum.reduce([self.high, vel[1], acc[1], brake[1]])
        return lo, hi, parts

    def _rate_limit(self, a: np.ndarray) -> tuple[np.ndarray, list[str]]:
        lo, hi, parts = self._intervals()
        absd = self.absolute
        cmd = a.copy()
        feasible = lo <= hi
        # infeasible only after an external jump (e.g. limits changed): position limits win
        p_lo = np.maximum(self.low, parts["velocity"][0])
        p_hi = np.minimum(self.high, parts["velocity"][1])
        fallback = np.clip(np.clip(self._p1 + (self._p1 - self._p0), *parts["acceleration"]), p_lo, p_hi)
        limited = np.where(feasible, np.clip(a, lo, hi), fallback)
        cmd[absd] = limited[absd]
        events = []
        changed = absd & (np.abs(cmd - a) > 1e-12)
        if changed.any():
            for kind in ("velocity", "acceleration", "braking"):
                plo, phi = parts[kind]
                hit = changed & ((a < plo - 1e-12) | (a > phi + 1e-12))
                if hit.any():
                    events.append(f"{kind}:dims {np.flatnonzero(hit).tolist()}")
                    changed = changed & ~hit
        return cmd, events

    def _hold_target(self) -> np.ndarray:
        """Brake absolute dims to rest within the limits; zero delta dims."""
        if self._p1 is None:
            self.reset()
        lo, hi, parts = self._intervals()
        feasible = lo <= hi
        stop_at = self._p1.copy()  # the target that makes the velocity zero ...
        target = np.where(feasible, np.clip(stop_at, lo, hi), stop_at)  # ... as close as A allows
        return np.where(self.absolute, target, 0.0)

    # ----- sending --------------------------------------------------------------------------
    def command(self, action: Any) -> np.ndarray:
        """Filter a fresh action and send the result; returns what was sent."""
        cmd, events = self.filter(action)
        for event in events:
            kind, _, detail = event.partition(":")
            self._event(kind, detail)
        self._last_fresh = time.monotonic()
        self.n_fresh += 1
        self._send(cmd)
        return cmd.astype(np.float32)

    def hold(self, reason: str = "watchdog", detail: str = "") -> np.ndarray:
        """Send a hold (braking stop, then stand still); counts ``reason``."""
        if reason:
            self._event(reason, detail)
        cmd = self._hold_target()
        self._send(cmd)
        return cmd.astype(np.float32)

    def watchdog_expired(self, now: float | None = None) -> bool:
        return ((time.monotonic() if now is None else now) - self._last_fresh) > self.config.watchdog_s

    def report_driver_error(self, error: BaseException, during: str = "") -> None:
        """The driver failed (``during``: the call outside this layer that failed, e.g.
        ``get_observation``): count a ``driver_error``, mark the layer faulted (an earlier fault
        is kept; later sends are dropped) and try one hold, so the robot is not left tracking
        its last target while the caller ends the episode."""
        fault = f"{type(error).__name__}: {error}"
        self._event("driver_error", f"{during}: {fault}" if during else fault)
        self.faulted = self.faulted or fault
        self._try_hold_once()

    def report_policy_failure(self, detail: str) -> None:
        """Count a failed policy request as a ``watchdog`` intervention without sending anything:
        the caller keeps executing the plan it has and holds only once that runs out, so the
        count shows how often the robot ran on an old plan."""
        self._event("watchdog", f"policy request failed: {detail}")

    def _send(self, cmd: np.ndarray) -> None:
        with self._send_lock:
            if self.faulted:
                return
            try:
                self.robot.send_action(cmd.astype(np.float32))
            except Exception as e:  # the driver failed: log, try to hold once, then report the fault
                self._event("driver_error", f"{type(e).__name__}: {e}")
                self.faulted = f"{type(e).__name__}: {e}"
                self._try_hold_once()
                return
            self._p0, self._p1 = self._p1, np.asarray(cmd, np.float64).copy()
            self._last_sent = time.monotonic()
            self.n_commands += 1

    def _try_hold_once(self) -> None:
        """One hold straight to the driver after it failed, bypassing the fault check and the
        command history (best effort: a broken driver may raise again, which is ignored)."""
        try:
            self.robot.send_action(self._hold_target().astype(np.float32))
        except Exception:
            pass

    # ----- watchdog thread (covers a stalled control loop) ----------------------------------
    def start_watchdog(self, deadline_s: float | None = None) -> None:
        """Hold from a background thread whenever nothing was sent for ``deadline_s``."""
        deadline = deadline_s or self.config.watchdog_s
        self._wd_stop.clear()

        def run() -> None:
            while not self._wd_stop.wait(min(deadline / 4, self.dt)):
                if time.monotonic() - self._last_sent > deadline and not self.faulted:
                    self.hold("watchdog", "control loop stalled: nothing sent in time")

        self._wd_thread = threading.Thread(target=run, name="safety-watchdog", daemon=True)
        self._wd_thread.start()

    def stop_watchdog(self) -> None:
        if self._wd_thread is not None:
            self._wd_stop.set()
            self._wd_thread.join(timeout=2)
            self._wd_thread = None

    # ----- signals --------------------------------------------------------------------------
    @contextmanager
    def signal_stop(self) -> Iterator["SafetyLayer"]:
        """SIGINT/SIGTERM request a stop (the loop brakes and ends the episode); a second SIGINT
        raises KeyboardInterrupt. Handlers are restored on exit. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handler(signum: int, frame: Any) -> None:
            if self.stop_requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_requested = True
            self._event("stop_signal", signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, old_handler in previous.items():
                signal.signal(sig, old_handler)


def _describe(action: Any) -> str:
    """Short description of a bad action for the log."""
    if action is None:
        return "None"
    shape = getattr(action, "shape", None)
    kind = type(action).__name__
    return f"{kind} of shape {shape}" if shape is not None else f"{kind} {str(action)[:40]!r}"
