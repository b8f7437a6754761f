"""Seeded fuzzing of the safety layer: bad actions in, and a checker for what reached the driver.

``fuzz_actions`` mixes good actions (small steps around the current target) with every kind of
bad one the safety layer must stop: NaN/inf, far out of limits, slightly out of limits, jumps
(velocity), reversals (acceleration), wrong shapes, wrong types. ``violations`` checks the
commands a driver received against the robot's limits, so a test or benchmark can count the
bad actions that got through (should be zero).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from deploy.robots.base import RobotSpec

KINDS = ("good", "nan", "inf", "far_out", "slightly_out", "jump", "reversal", "wrong_shape", "wrong_type", "none")
BAD_KINDS = KINDS[1:]


def fuzz_actions(spec: RobotSpec, start: np.ndarray, n: int, seed: int = 0,
                 bad_fraction: float = 0.5) -> Iterator[tuple[str, Any]]:
    """Yield ``(kind, action)`` pairs; ``start`` is the robot's current target (hold action)."""
    rng = np.random.default_rng(seed)
    lo, hi = spec.action_low.astype(np.float64), spec.action_high.astype(np.float64)
    span = hi - lo
    finite_span = np.where(np.isfinite(span), span, 2.0)
    cur = np.clip(np.asarray(start, np.float64), lo, hi)
    for _ in range(n):
        kind = "good" if rng.random() >= bad_fraction else str(rng.choice(BAD_KINDS))
        a = cur + rng.normal(0, 0.01, cur.shape) * finite_span
        if kind == "good":
            cur = np.clip(a, lo, hi)
            yield kind, cur.copy()
            continue
        if kind == "nan":
            a[rng.integers(len(a))] = np.nan
        elif kind == "inf":
            a[rng.integers(len(a))] = rng.choice([np.inf, -np.inf])
        elif kind == "far_out":
            i = rng.integers(len(a))
            a[i] = (hi[i] if rng.random() < 0.5 else lo[i]) + rng.choice([-1, 1]) * finite_span[i] * rng.uniform(0.2, 100)
        elif kind == "slightly_out":
            i = rng.integers(len(a))
            a[i] = hi[i] + 0.05 * finite_span[i] if rng.random() < 0.5 else lo[i] - 0.05 * finite_span[i]
        elif kind == "jump":
            a = np.clip(cur + rng.uniform(-0.5, 0.5, cur.shape) * finite_span, lo, hi)
        elif kind == "reversal":
            a = np.clip(cur - (a - cur) * 50, lo, hi)
        elif kind == "wrong_shape":
            a = rng.normal(size=rng.choice([len(a) - 1, len(a) + 1, 2 * len(a)]))
            a = a.reshape(2, -1) if a.size % 2 == 0 and rng.random() < 0.5 else a
        elif kind == "wrong_type":
            options = ["stop", b"\x00\x01", {"a": 1}, [1, "x"], object()]
            a = options[int(rng.integers(len(options)))]
        else:
            a = None
        yield kind, a


def violations(commands: np.ndarray, spec: RobotSpec, dt: float, start: np.ndarray,
               velocity_scale: float = 1.0, acceleration_scale: float = 1.0, tol: float = 1e-5) -> dict[str, int]:
    """Count commands that break a limit: non-finite, out of range, too fast, too abrupt."""
    c = np.asarray(commands, np.float64)
    out = {"nonfinite": 0, "out_of_limits": 0, "velocity": 0, "acceleration": 0, "shape": 0}
    if c.ndim != 2 or c.shape[1] != spec.action_dim:
        out["shape"] = len(c)
        return out
    out["nonfinite"] = int((~np.isfinite(c)).any(1).sum())
    lo, hi = spec.action_low, spec.action_high
    out["out_of_limits"] = int(((c < lo - tol) | (c > hi + tol)).any(1).sum())
    absd = spec.absolute
    p = np.vstack([start[None], start[None], c])[:, absd]
    v = np.diff(p, axis=0) / dt
    acc = np.diff(v, axis=0) / dt
    vmax = spec.velocity_limits[absd] * velocity_scale
    amax = spec.acceleration_limits[absd] * acceleration_scale
    # tol is a position tolerance (float32 rounding of the commands); it scales with 1/dt, 1/dt^2
    out["velocity"] = int((np.abs(v[1:]) > vmax + 2 * tol / dt).any(1).sum())
    out["acceleration"] = int((np.abs(acc) > amax + 4 * tol / dt ** 2).any(1).sum())
    return out
