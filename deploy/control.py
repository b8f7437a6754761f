"""The control loop: fixed rate, chunks refilled in the background, safety on every command.

Each tick (period ``1 / rate_hz``): read the observation; adopt a chunk that arrived; request
the next chunk early enough that it arrives before the current plan runs out (the lead is the
measured round trip in ticks plus ``margin_steps``); send the planned action through the
safety layer — or a hold when there is none (watchdog), when the policy connection is lost, or
after a stop signal; record. Deadlines are accounted: every tick's start time is kept and the
period jitter and overruns are reported; a late loop re-anchors instead of bursting to catch up.

Options: real-time chunking (``rtc``: the request carries the plan for the steps it will take
to arrive, which the server inpaints), temporal ensembling (``ensemble = m``: a chunk is
requested every tick and overlapping predictions are averaged), and ``realtime=False`` for
lockstep simulation (no sleeping, synchronous requests: same seed, same episode).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from deploy.chunking import ChunkPlan, TemporalEnsembler
from deploy.serving.client import ChunkReply
from deploy.errors import DeployError, HandshakeError, PolicyUnavailableError
from deploy.recording import Recorder
from deploy.robots.base import Obs, Robot, capability
from deploy.safety import SafetyConfig, SafetyLayer
from envs.errors import InvalidOptionError

NORMAL_ENDS = ("max_steps", "done")
"""Episode ends of a run that went as asked; every other reason is abnormal (``groundflow deploy``
exits non-zero)."""


class ChunkSource(Protocol):
    """Where chunks come from (``PolicyClient``, ``LocalPolicy``). Optional: ``connect()``, called at the
    start of an episode when ``healthy`` is False (a server lost in an earlier one)."""

    metadata: dict[str, Any]

    def infer(self, obs: Obs, *, prefix: np.ndarray | None = None, frozen: int = 0,
              seed: int | None = None) -> ChunkReply: ...

    def reset(self) -> None: ...

    @property
    def healthy(self) -> bool: ...


@dataclass
class LoopConfig:
    rate_hz: float = 20.0
    """control rate (Hz)"""
    max_steps: int = 200
    """episode length limit in control steps"""
    n_exec: int | None = None
    """steps of each chunk executed before the next takes over (default: the policy's)"""
    realtime: bool = True
    """False: lockstep simulation (no sleeping, synchronous requests)"""
    rtc: bool = False
    """real-time chunking via prefix inpainting (the server's policy must support it)"""
    ensemble: float | None = None
    """temporal ensembling coefficient m (None: off)"""
    margin_steps: int = 1
    """request the next chunk this many ticks earlier than the measured latency needs"""
    max_hold_s: float = 2.0
    """end the episode after holding this long because the policy was unavailable or failing"""
    stop_brake_s: float = 1.0
    """after a stop signal, keep commanding holds this long (braking to rest), then end"""
    status: bool = False
    """print a live status line to stderr"""
    seed: int | None = None
    """base seed for the policy's sampling noise (per request: seed + step)"""
    instruction: str | None = None
    """overrides the robot's instruction"""

    def __post_init__(self) -> None:
        if not self.rate_hz > 0:
            raise InvalidOptionError(f"rate_hz must be > 0, got {self.rate_hz}")
        if self.max_steps < 1:
            raise InvalidOptionError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.rtc and self.ensemble is not None:
            raise InvalidOptionError("choose real-time chunking (rtc) or temporal ensembling, not both")


@dataclass
class EpisodeResult:
    steps: int
    success: bool
    reason: str
    """max_steps | done (normal ends) | stop_signal | driver_error | policy_lost (no connection) |
    policy_failed (the server answered only errors) | interrupted (KeyboardInterrupt) | error (an exception)"""
    interventions: dict[str, int]
    timing: dict[str, Any]
    actions: np.ndarray = field(repr=False)
    """commands the driver received, (T, A)"""
    holds: list[int] = field(default_factory=list)
    """steps at which a hold was sent"""
    switches: list[int] = field(default_factory=list)
    """steps at which a new chunk took over"""
    deviations: list[float] = field(default_factory=list)
    """at each switch, ||new chunk - old plan|| at the takeover step"""
    events: list[dict] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("actions", "events"):
            out.pop(name)
        out["n_holds"] = len(self.holds)
        out["n_chunks"] = len(self.switches)
        out["plan_deviation_mean"] = float(np.mean(self.deviations)) if self.deviations else None
        for name in ("holds", "switches", "deviations"):
            out.pop(name)
        return out


class _Fetcher:
    """One background request at a time: ``submit`` returns at once, ``poll`` takes the reply."""

    def __init__(self, source: ChunkSource):
        self.source = source
        self._cv = threading.Condition()
        self._job: tuple | None = None
        self._done: tuple | None = None
        self.error: BaseException | None = None
        self.busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="chunk-fetcher", daemon=True)
        self._thread.start()

    def submit(self, obs: Obs, step: int, prefix: np.ndarray | None, frozen: int, seed: int | None) -> bool:
        with self._cv:
            if self.busy or self._closed:
                return False
            self.busy = True
            self._job = (obs, step, prefix, frozen, seed, time.perf_counter())
            self._cv.notify()
            return True

    def poll(self) -> tuple[ChunkReply, int, float] | None:
        with self._cv:
            out, self._done = self._done, None
            return out

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                obs, step, prefix, frozen, seed, t0 = self._job
                self._job = None
            try:
                reply = self.source.infer(obs, prefix=prefix, frozen=frozen, seed=seed)
                result, err = (reply, step, time.perf_counter() - t0), None
            except BaseException as e:  # reported to the loop, which holds and decides
                result, err = None, e
            with self._cv:
                self._done = result if result is not None else self._done
                if err is not None:
                    self.error = err
                self.busy = False

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=0.1)


@dataclass
class _Episode:
    """What one episode accumulates while the loop runs it (plan, schedule, logs, end state)."""
    counts0: dict[str, int]
    """the safety layer's intervention counts at the start (the result reports this episode's only)"""
    t_start: float
    """wall-clock start (time.time()): the safety events since then are this episode's"""
    plan: ChunkPlan
    ens: TemporalEnsembler | None
    fetcher: _Fetcher | None
    """background requests (realtime); None: synchronous requests (lockstep)"""
    obs: Obs = field(default_factory=dict)
    """the latest observation"""
    lat_steps: int = 0
    """measured request latency in ticks"""
    t_next: float = 0.0
    """deadline of the next tick (time.perf_counter())"""
    last_status: float = 0.0
    rtts: list[float] = field(default_factory=list)
    infers: list[float] = field(default_factory=list)
    sent: list[np.ndarray] = field(default_factory=list)
    holds: list[int] = field(default_factory=list)
    ticks: list[float] = field(default_factory=list)
    sends: list[float] = field(default_factory=list)
    work: list[float] = field(default_factory=list)
    reason: str = "max_steps"
    hold_since: float | None = None
    """tick time at which the current run of watchdog holds began (None: not holding)"""
    stop_at: float | None = None
    """tick time at which a stop signal was first seen (braking since)"""
    lost: str | None = None
    """why the policy connection was lost (None: connected)"""
    failing: str | None = None
    """the last request error since the last chunk was adopted"""
    constraint_hold: str | None = None
    """why the server's last reply was a hold (no chunk passed the constraints' check); None after a chunk"""
    error: str | None = None
    """the exception that ended the episode"""


class ControlLoop:
    """Runs episodes of ``source``'s policy on ``robot`` through ``safety`` (made if omitted)."""

    def __init__(self, robot: Robot, source: ChunkSource, config: LoopConfig | None = None,
                 safety: SafetyLayer | None = None, recorder: Recorder | None = None):
        self.robot, self.source = robot, source
        self.config = cfg = config or LoopConfig()
        self.period = 1.0 / cfg.rate_hz
        meta = getattr(source, "metadata", {}) or {}
        spec = robot.spec
        if meta.get("action_dim") not in (None, spec.action_dim):
            raise HandshakeError(f"policy outputs {meta.get('action_dim')}-D actions, robot {spec.name} takes "
                                 f"{spec.action_dim}-D actions")
        if meta.get("state_dim") not in (None, spec.state_dim):
            raise HandshakeError(f"policy expects {meta.get('state_dim')}-D states, robot {spec.name} gives "
                                 f"{spec.state_dim}-D states")
        if cfg.rtc and not meta.get("rtc", False):
            raise InvalidOptionError(f"real-time chunking needs a policy that supports prefix inpainting; the "
                                     f"server's policy ({meta.get('policy_kind') or 'unknown'}) does not")
        self.horizon = int(meta.get("horizon", 1))
        self.n_exec = int(cfg.n_exec or meta.get("n_exec") or self.horizon)
        if not 1 <= self.n_exec <= self.horizon:
            raise InvalidOptionError(f"n_exec must be in [1, horizon={self.horizon}], got {self.n_exec}")
        self.safety = safety or SafetyLayer(robot, SafetyConfig(), dt=self.period)
        self.recorder = recorder

    # ----- one episode ----------------------------------------------------------------------
    def run_episode(self, seed: int | None = None, task_id: int = 0) -> EpisodeResult:
        """Run one episode tick by tick until an end condition; the reason is recorded (and the
        recording closed) even when an exception ends it."""
        episode = self._start_episode(seed, task_id)
        try:
            for step in range(self.config.max_steps):
                end = self._tick(episode, step)
                if end is not None:
                    episode.reason = end
                    break
        except BaseException as e:  # record why the episode really ended, not "max_steps"
            episode.reason = "interrupted" if isinstance(e, KeyboardInterrupt) else "error"
            episode.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            if episode.fetcher is not None:
                episode.fetcher.close()
            if self.config.status:
                sys.stderr.write("\n")
            if self.recorder is not None:
                self._end_recording(episode.reason, episode.error)
        return self._result(episode)

    def _start_episode(self, seed: int | None, task_id: int) -> _Episode:
        """Reconnect and reset the source and the safety layer, and fetch the first chunk before
        the clock starts (the robot is at rest)."""
        cfg, safety = self.config, self.safety
        if not getattr(self.source, "healthy", True) and hasattr(self.source, "connect"):
            self.source.connect()  # the server was lost in an earlier episode: reconnect (or raise)
        if hasattr(self.source, "reset"):
            self.source.reset()
        safety.reset()
        episode = _Episode(counts0=dict(safety.counts), t_start=time.time(),  # this episode's interventions only
                           plan=ChunkPlan(self.n_exec),
                           ens=TemporalEnsembler(cfg.ensemble) if cfg.ensemble is not None else None,
                           fetcher=_Fetcher(self.source) if cfg.realtime else None)
        episode.obs = self._observe()
        try:
            reply = self.source.infer(episode.obs, seed=self._seed(0))
        except PolicyUnavailableError:
            raise
        except DeployError as e:  # refused (a chunk far outside the bounds, a server-side error): the robot
            # is at rest, so hold and ask again each tick, as mid-episode, instead of ending the whole run
            self._request_failed(episode, e)
            reply = None
        if self.recorder is not None:
            self.recorder.start_episode(episode.obs["instruction"], task_id=task_id, seed=seed)
        if reply is not None:
            episode.rtts.append(reply.timing.get("rtt_ms", 0.0))
            episode.infers.append(reply.timing.get("infer_ms", 0.0))
            episode.lat_steps = self._lat_steps(episode.rtts[-1] / 1e3)
            self._take(episode, reply, 0, 0)
        episode.t_next = time.perf_counter()
        return episode

    def _tick(self, episode: _Episode, step: int) -> str | None:
        """One control period: wait for its deadline, observe, refresh the plan, command, record.
        Returns why the episode ends here (None: it goes on)."""
        cfg = self.config
        if cfg.realtime:
            delay = episode.t_next - time.perf_counter()
            if delay > 0:
                _sleep_until(episode.t_next)
        t_tick = time.perf_counter()
        episode.ticks.append(t_tick)
        if step > 0:
            try:
                episode.obs = self._observe()
            except Exception as e:  # the driver failed: hold, log, end the episode
                self.safety.report_driver_error(e, during="get_observation")
                return "driver_error"
        self._refresh_plan(episode, step)
        action = episode.ens.action_at(step) if episode.ens is not None else episode.plan.action_at(step)
        self._take_request_error(episode)
        healthy = episode.lost is None and bool(getattr(self.source, "healthy", True))
        sim_state = self._sim_state()
        cmd = self._command(episode, step, t_tick, action, healthy)
        if self.safety.faulted:  # the driver did not take this command: not executed, not recorded
            return "driver_error"
        episode.sends.append(time.perf_counter())
        episode.sent.append(cmd)
        self._record(episode.obs, cmd, sim_state)
        episode.work.append(time.perf_counter() - t_tick)
        if cfg.status and t_tick - episode.last_status > 0.5:
            episode.last_status = t_tick
            self._status(step, episode.ticks, episode.rtts, len(episode.holds))
        end = self._end_reason(episode, t_tick, healthy)
        if end is not None:
            return end
        episode.t_next += self.period
        if cfg.realtime and time.perf_counter() > episode.t_next + self.period:
            episode.t_next = time.perf_counter()  # fell behind by more than a tick: re-anchor
        return None

    def _refresh_plan(self, episode: _Episode, step: int) -> None:
        """Adopt a chunk that arrived and request the next one early enough (realtime: in the
        background, lead = measured latency + margin; lockstep: synchronously, when it runs out)."""
        cfg, fetcher, plan, ens = self.config, episode.fetcher, episode.plan, episode.ens
        if fetcher is not None:
            got = fetcher.poll()
            if got is not None:
                reply, start_step, request_s = got
                episode.rtts.append(reply.timing.get("rtt_ms", request_s * 1e3))
                episode.infers.append(reply.timing.get("infer_ms", 0.0))
                episode.lat_steps = self._lat_steps(float(np.median(episode.rtts[-10:])) / 1e3)
                self._take(episode, reply, start_step, step)
            if self._need_chunk(plan, ens, step, episode.lat_steps + cfg.margin_steps):
                prefix = plan.future(step) if cfg.rtc else None
                fetcher.submit(episode.obs, step, prefix, episode.lat_steps, self._seed(step))
        elif self._need_chunk(plan, ens, step, 0):
            prefix = plan.future(step) if cfg.rtc else None
            try:
                reply = self.source.infer(episode.obs, prefix=prefix, frozen=0, seed=self._seed(step))
                episode.rtts.append(reply.timing.get("rtt_ms", 0.0))
                episode.infers.append(reply.timing.get("infer_ms", 0.0))
                self._take(episode, reply, step, step)
            except DeployError as e:
                self._request_failed(episode, e)

    def _take(self, episode: _Episode, reply: ChunkReply, start: int, now: int) -> None:
        """Adopt a reply's chunk, or note the hold it asks for (the plan runs out, the robot holds, and
        the next tick asks again)."""
        episode.failing = None
        episode.constraint_hold = getattr(reply, "hold", None)
        if episode.constraint_hold is None:
            self._adopt(episode.plan, episode.ens, reply.actions, start, now)
        else:  # nothing of an earlier plan runs on past a hold: it was checked from another state
            episode.plan.chunk = None
            if episode.ens is not None:
                episode.ens.chunks.clear()

    def _request_failed(self, episode: _Episode, err: DeployError) -> None:
        """A synchronous chunk request failed: count it, keep the plan, and ask again next tick."""
        self.safety.report_policy_failure(f"{err}")
        episode.failing = f"{type(err).__name__}: {err}"

    def _take_request_error(self, episode: _Episode) -> None:
        """Take the background request's error, if any: a lost connection marks the policy lost;
        any other error (the server answered with one) is logged and asked again next tick."""
        fetcher = episode.fetcher
        if fetcher is None or fetcher.error is None:
            return
        err, fetcher.error = fetcher.error, None
        if isinstance(err, PolicyUnavailableError):
            episode.lost = f"{type(err).__name__}: {err}"
        else:
            self.safety.report_policy_failure(f"{type(err).__name__}: {err}")
            episode.failing = f"{type(err).__name__}: {err}"

    def _command(self, episode: _Episode, step: int, t_tick: float, action: np.ndarray | None,
                 healthy: bool) -> np.ndarray:
        """Send the planned action through the safety layer, or a hold after a stop signal, when the
        plan is used up or when the policy is unavailable; returns what was sent."""
        safety = self.safety
        if safety.stop_requested:
            episode.stop_at = episode.stop_at or t_tick
            cmd = safety.hold("")
            episode.holds.append(step)
        elif action is None and healthy and episode.constraint_hold is not None:  # asked for, not a failure
            cmd = safety.hold("constraint", episode.constraint_hold)
            episode.holds.append(step)
        elif action is None or not healthy:
            why = ("no fresh action (plan used up)" if healthy else
                   f"policy unavailable: {episode.lost or 'connection lost'}")
            cmd = safety.hold("watchdog", why)
            episode.holds.append(step)
            episode.hold_since = episode.hold_since or t_tick
        else:
            cmd = safety.command(action)
            episode.hold_since = None
        return cmd

    def _end_reason(self, episode: _Episode, t_tick: float, healthy: bool) -> str | None:
        """Why the episode ends after this tick's command (None: it goes on)."""
        cfg = self.config
        if episode.stop_at is not None and t_tick - episode.stop_at >= cfg.stop_brake_s:
            return "stop_signal"
        if capability(self.robot, "done"):
            return "done"
        hold_since = episode.hold_since
        if hold_since is not None and not healthy and t_tick - hold_since >= cfg.max_hold_s:
            return "policy_lost"
        if hold_since is not None and episode.failing is not None and t_tick - hold_since >= cfg.max_hold_s:
            return "policy_failed"  # connected, but every request since the plan ran out failed
        return None

    def _result(self, episode: _Episode) -> EpisodeResult:
        """The episode's result: its own interventions and events only (the layer's counts span episodes)."""
        safety, plan, sent = self.safety, episode.plan, episode.sent
        counts = safety.summary()["counts"]
        return EpisodeResult(
            steps=len(sent), success=bool(capability(self.robot, "success")), reason=episode.reason,
            interventions={kind: n - episode.counts0.get(kind, 0) for kind, n in counts.items()},
            timing=_timing(episode.ticks, episode.sends, episode.work, self.period, episode.rtts, episode.infers),
            actions=np.asarray(sent, np.float32).reshape(len(sent), -1), holds=episode.holds,
            switches=list(plan.switches) if episode.ens is None else [], deviations=list(plan.deviations),
            events=[event for event in safety.events if event["t"] >= episode.t_start])

    # ----- helpers --------------------------------------------------------------------------
    def _observe(self) -> Obs:
        obs = self.robot.get_observation()
        if self.config.instruction:
            obs["instruction"] = self.config.instruction
        return obs

    def _seed(self, step: int) -> int | None:
        return None if self.config.seed is None else int(self.config.seed) * 100_003 + step

    def _lat_steps(self, latency_s: float) -> int:
        return int(math.ceil(max(latency_s, 0.0) / self.period))

    def _need_chunk(self, plan: ChunkPlan, ens: TemporalEnsembler | None, step: int, lat_steps: int) -> bool:
        if ens is not None:
            return True  # ensembling wants a fresh prediction every tick
        return plan.steps_left(step) <= lat_steps

    def _adopt(self, plan: ChunkPlan, ens: TemporalEnsembler | None, actions: np.ndarray, start: int, now: int) -> None:
        if ens is not None:
            ens.add(actions, start)
        elif now - start < len(actions):
            plan.set(actions, start, now)

    def _sim_state(self) -> np.ndarray | None:
        if self.recorder is None or not hasattr(self.robot, "sim_state"):
            return None
        return self.robot.sim_state()

    def _record(self, obs: Obs, cmd: np.ndarray, sim_state: np.ndarray | None) -> None:
        if self.recorder is None:
            return
        info = capability(self.robot, "last_info") or {}
        self.recorder.add(obs, cmd, float(capability(self.robot, "last_reward")),
                          bool(info.get("success", False)), sim_state)

    def _end_recording(self, reason: str, error: str | None = None) -> None:
        try:
            final = self.robot.get_observation()
        except Exception:
            final = None
        final_sim = self.robot.sim_state() if hasattr(self.robot, "sim_state") else None
        extra = {"error": error} if error else {}
        self.recorder.end_episode(final, final_sim, {"reason": reason, **extra, **self.safety.summary()})

    def _status(self, step: int, ticks: list[float], rtts: list[float], n_holds: int) -> None:
        periods_ms = np.diff(ticks[-50:]) * 1e3 if len(ticks) > 2 else np.zeros(1)
        n_int = sum(n for kind, n in self.safety.counts.items())
        sys.stderr.write(f"\rstep {step + 1}/{self.config.max_steps} | {1e3 / max(periods_ms.mean(), 1e-9):5.1f} Hz | "
                         f"jitter p99 {np.percentile(np.abs(periods_ms - self.period * 1e3), 99):5.2f} ms | "
                         f"rtt {rtts[-1]:6.1f} ms | holds {n_holds} | interventions {n_int}   ")
        sys.stderr.flush()


def _sleep_until(t: float) -> None:
    """Sleep most of the wait, then spin the last ~1 ms (time.sleep overshoots by ~0.1-1 ms)."""
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        if left > 0.0015:
            time.sleep(left - 0.001)


def _timing(ticks: list[float], sends: list[float], work: list[float], period: float, rtts: list[float],
            infers: list[float]) -> dict[str, Any]:
    """Tick-start jitter (the loop's clock) and command jitter (when the driver got each command:
    what the robot sees), |actual period - nominal|; work per tick; request round trips."""
    out: dict[str, Any] = {"period_ms": period * 1e3}
    if len(ticks) > 1:
        periods_ms = np.diff(ticks) * 1e3
        jitter_ms = np.abs(periods_ms - period * 1e3)
        out.update(period_p50_ms=float(np.percentile(periods_ms, 50)),
                   jitter_p50_ms=float(np.percentile(jitter_ms, 50)),
                   jitter_p99_ms=float(np.percentile(jitter_ms, 99)), jitter_max_ms=float(jitter_ms.max()))
    if len(sends) > 1:
        jitter_ms = np.abs(np.diff(sends) * 1e3 - period * 1e3)
        out.update(command_jitter_p50_ms=float(np.percentile(jitter_ms, 50)),
                   command_jitter_p99_ms=float(np.percentile(jitter_ms, 99)),
                   command_jitter_max_ms=float(jitter_ms.max()))
    if work:
        work_ms = np.asarray(work) * 1e3
        out.update(work_p50_ms=float(np.percentile(work_ms, 50)), work_p99_ms=float(np.percentile(work_ms, 99)),
                   overruns=int((work_ms > period * 1e3).sum()))
    if rtts:
        out.update(rtt_p50_ms=float(np.percentile(rtts, 50)), rtt_p99_ms=float(np.percentile(rtts, 99)),
                   infer_p50_ms=float(np.percentile(infers, 50)), n_requests=len(rtts))
    return out
