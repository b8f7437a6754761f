import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny models: extra threads only contend

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import envs  # noqa: E402,F401  (platform set-up before any simulator import)

import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, monkeypatch):
    """Import ``benchmarks/<name>.py`` (a script, not a package) for a test; registered in
    sys.modules for the test's duration because dataclasses look their module up there. The
    script puts benchmarks/ first on sys.path; that is undone after the test too, else a worker
    spawned by a later test (multiprocessing copies sys.path) imports benchmarks/envs.py as ``envs``."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def json_file(path: Path):
    """A results file, parsed once per test session (grounding.json is 4 MB, and many figures quote it)."""
    return json.loads(path.read_text())


def json_pointer(doc, pointer: str):
    """RFC 6901: '/a/b~1c' -> doc['a']['b/c'] (list indices as integers): where a quoted figure lives in a
    results file (the reports' links, the recipes' descriptions)."""
    if pointer in ("", "/"):
        return doc
    if not pointer.startswith("/"):
        raise KeyError(f"a JSON pointer starts with '/': {pointer!r}")
    for raw in pointer[1:].split("/"):
        key = raw.replace("~1", "/").replace("~0", "~")
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    return doc


def recording(robot_cls: type) -> type:
    """A subclass of a robot driver that also keeps every command its driver interface received
    (what the safety and driver tests compare against what the policy asked for)."""

    class Recording(robot_cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.received: list = []

        def send_action(self, action):
            import numpy as np
            self.received.append(np.array(action, copy=True))
            super().send_action(action)

    Recording.__name__ = f"Recording{robot_cls.__name__}"
    return Recording


def wait_for(condition, timeout_s: float = 30.0, poll_s: float = 0.02) -> bool:
    """Poll ``condition()`` until it holds (True) or ``timeout_s`` passes (False). For tests that wait
    on another process or thread (a simulator settling, a stream update): a generous bound instead of
    a fixed sleep that a loaded machine can outlast."""
    import time
    end = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(poll_s)


class TickLog:
    """A ControlLoop's deadline accounting seen from outside, so that timing tests can assert what
    the loop controls (its schedule) instead of what a loaded machine does to it (wake-up latency).

    Records the start of every tick (the loop's ``robot.get_observation``; entry 0 is the
    observation taken before the clock starts) and, for every tick that waited, the deadline it
    waited for (``deploy.control._sleep_until``) and when it woke."""

    def __init__(self, monkeypatch, robot):
        import time

        import deploy.control as control
        self.starts: list[float] = []
        self.sleeps: list[tuple[int, float, float]] = []  # (tick, deadline, woke)
        sleep_until, observe = control._sleep_until, robot.get_observation

        def logged_sleep(t: float) -> None:
            sleep_until(t)
            self.sleeps.append((len(self.starts), t, time.perf_counter()))

        def logged_observe(*a, **kw):
            self.starts.append(time.perf_counter())
            return observe(*a, **kw)

        monkeypatch.setattr(control, "_sleep_until", logged_sleep)
        monkeypatch.setattr(robot, "get_observation", logged_observe)

    def check(self, period: float, steps: int, overruns: int, median_tol_s: float) -> dict:
        """Assert the loop's deadline accounting over the first episode (``steps`` ticks) recorded:

        - no tick starts before its deadline;
        - deadlines follow one fixed schedule (``t_next += period``: no drift from sleep overshoot or
          work), re-anchored only where the loop fell more than a period behind;
        - every tick whose work overran the period made the next tick start late (no sleep);
        - the median tick-to-tick period is within ``median_tol_s`` of the nominal one.
        Returns counts for messages."""
        import numpy as np
        starts = np.asarray(self.starts[1:steps])  # ticks 1 .. steps-1 (tick 0 starts the clock)
        assert len(starts) == steps - 1, (len(self.starts), steps)
        sleeps = [x for x in self.sleeps if x[0] < steps]  # the first episode's (later calls may follow)
        assert sleeps, "the loop never waited for a deadline"
        for k, deadline, woke in sleeps:
            assert woke >= deadline, f"tick {k} woke {(deadline - woke) * 1e3:.3f} ms before its deadline"
        reanchors = 0
        for (k1, d1, _), (k2, d2, _) in zip(sleeps, sleeps[1:]):
            # the loop re-anchors (t_next = now) at the end of a tick that finished more than a period
            # past the next deadline; the tick after it then starts that late
            behind = any(self.starts[m] > d1 + (m - k1 + 1) * period for m in range(k1 + 1, k2 + 1))
            if behind:
                reanchors += 1
                assert d2 >= d1 + (k2 - k1) * period - 1e-6, f"tick {k2}: re-anchored to an earlier deadline"
            else:
                assert abs((d2 - d1) - (k2 - k1) * period) < 1e-6, (
                    f"ticks {k1}->{k2}: deadlines {(d2 - d1) * 1e3:.3f} ms apart, "
                    f"expected {(k2 - k1) * period * 1e3:.1f}")
        slept = {k for k, _, _ in sleeps}
        late = [k for k in range(1, steps) if k not in slept]
        assert len(late) >= overruns - 1, f"{overruns} overruns but only {len(late)} ticks started late"
        median = float(np.median(np.diff(starts)))
        assert abs(median - period) < median_tol_s, f"median period {median * 1e3:.2f} ms"
        return {"late_ticks": len(late), "reanchors": reanchors, "median_period_ms": median * 1e3}


def tiny_flow_policy(env_id: str):
    """An untrained tiny flow policy for ``env_id`` (seeded weights, a normalizer fitted to random data)
    and the env's state layout: a checkpoint to save, serve or deploy without training one."""
    import numpy as np
    import torch

    import policies
    env = envs.make(env_id)
    try:
        layout = list(env.state_layout)
        state_dim, action_dim = env.observation_space["state"].shape[0], env.action_space.shape[0]
    finally:
        env.close()
    cfg = policies.PolicyConfig(kind="flow", state_dim=state_dim, action_dim=action_dim, horizon=4, n_exec=4,
                                size="tiny")
    torch.manual_seed(0)
    model = policies.make_policy(cfg)
    rng = np.random.default_rng(0)
    model.fit_normalizer(rng.normal(size=(64, state_dim)), rng.uniform(-0.1, 0.1, size=(64, action_dim)))
    return model, layout


def tabletop_demos(directory: Path, instructions: tuple[str, ...], episodes: int) -> Path:
    """Expert demos of ``instructions`` on random tabletop layouts (seed 0), written to ``directory``."""
    from train.collect import CollectArgs, collect
    out = Path(directory) / "demos.h5"
    collect(CollectArgs(suite="tabletop", episodes=episodes, layout="random", instructions=instructions, out=out,
                        seed=0, progress=False))
    return out
