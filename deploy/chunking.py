"""Pure bookkeeping of action chunks over control steps: the plan queue and temporal ensembling.

Steps are absolute control-step indices of the episode. A chunk predicted from the observation
of step ``s`` plans steps ``s .. s+H-1``; when it arrives at a later step ``k`` (inference took
``k - s`` steps) its first ``k - s`` actions are already in the past and are skipped.
"""

from __future__ import annotations

import numpy as np


class ChunkPlan:
    """The chunk currently executing. ``n_exec`` steps are planned to run before the next chunk;
    the rest of the chunk stays usable if the next one is late (up to ``H``)."""

    def __init__(self, n_exec: int):
        if n_exec < 1:
            raise ValueError(f"n_exec must be >= 1, got {n_exec}")
        self.n_exec = int(n_exec)
        self.chunk: np.ndarray | None = None
        self.start = 0
        self.switches: list[int] = []
        self.deviations: list[float] = []
        """at each switch: ||new chunk - old plan|| at the takeover step (what RTC minimizes)"""

    def set(self, chunk: np.ndarray, start: int, now: int) -> None:
        """Adopt ``chunk`` planned from step ``start``, taking over at step ``now``."""
        chunk = np.asarray(chunk, np.float32)
        old = self.action_at(now)
        i = now - start
        if old is not None and 0 <= i < len(chunk):
            self.deviations.append(float(np.linalg.norm(chunk[i] - old)))
        self.chunk = chunk
        self.start = int(start)
        self.switches.append(int(now))

    def action_at(self, step: int) -> np.ndarray | None:
        if self.chunk is None:
            return None
        i = step - self.start
        return self.chunk[i] if 0 <= i < len(self.chunk) else None

    def steps_left(self, step: int) -> int:
        """Planned (``n_exec``) steps left from ``step`` on; <= 0 means the plan is used up."""
        if self.chunk is None:
            return 0
        return self.start + self.n_exec - step

    def future(self, step: int) -> np.ndarray | None:
        """The plan from ``step`` to the end of the chunk (the RTC prefix), or None."""
        if self.chunk is None:
            return None
        i = step - self.start
        if i < 0 or i >= len(self.chunk):
            return None
        return self.chunk[i:]


class TemporalEnsembler:
    """ACT-style temporal ensembling: the action for step ``k`` averages every chunk that covers
    ``k`` with weights ``exp(-m * i)``, ``i = 0`` for the oldest (ACT's convention: older
    predictions weigh more, which smooths; ``m`` > 0 sets how fast newer ones are taken in)."""

    def __init__(self, m: float = 0.01, max_chunks: int = 64):
        if m < 0:
            raise ValueError(f"temporal ensembling coefficient must be >= 0, got {m}")
        self.m = float(m)
        self.max_chunks = max_chunks
        self.chunks: list[tuple[int, np.ndarray]] = []

    def add(self, chunk: np.ndarray, start: int) -> None:
        self.chunks.append((int(start), np.asarray(chunk, np.float32)))
        self.chunks = self.chunks[-self.max_chunks:]

    def action_at(self, step: int) -> np.ndarray | None:
        self.chunks = [(s, c) for s, c in self.chunks if step < s + len(c)]
        covering = [c[step - s] for s, c in self.chunks if 0 <= step - s < len(c)]
        if not covering:
            return None
        w = np.exp(-self.m * np.arange(len(covering), dtype=np.float64))
        return (np.tensordot(w / w.sum(), np.stack(covering).astype(np.float64), axes=1)).astype(np.float32)

    def steps_left(self, step: int) -> int:
        return max((s + len(c) - step for s, c in self.chunks), default=0)


def boundary_jumps(actions: np.ndarray, switches: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Step-to-step change ``||a_k - a_{k-1}||`` at chunk switches and at all other steps."""
    a = np.asarray(actions, np.float64)
    if len(a) < 2:
        return np.zeros(0), np.zeros(0)
    d = np.linalg.norm(np.diff(a, axis=0), axis=1)  # d[k-1] = change into step k
    at = sorted({k for k in switches if 1 <= k < len(a)})
    mask = np.zeros(len(d), bool)
    mask[[k - 1 for k in at]] = True
    return d[mask], d[~mask]
