"""Multi-instruction task suites: several instructions feasible from the same initial state.

A suite lists its tasks (one task id per instruction), paraphrases for evaluation, and which
tasks share a scene. CIG draws hard negatives from ``same_scene``; evaluation swaps instructions
over one initial state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envs.errors import InstructionError, InvalidOptionError


def check_layout_rho(rho: Any, layout: str) -> float:
    """``layout_rho`` of a suite: the probability that an episode's layout names its task, only
    meaningful where the layout is correlated (random otherwise)."""
    import numpy as np
    if isinstance(rho, bool) or not isinstance(rho, (int, float, np.integer, np.floating)) \
            or not np.isfinite(rho) or not 0 <= rho <= 1:
        raise InvalidOptionError(f"layout_rho is the probability that an episode's layout names its task, "
                                 f"a number in [0, 1]; got {rho!r}")
    if layout != "correlated" and rho != 1:
        raise InvalidOptionError(f"layout_rho={rho} needs layout='correlated' (with layout={layout!r} the "
                                 "layout never names the task)")
    return float(rho)


@dataclass(frozen=True)
class Task:
    task_id: int
    instruction: str  # canonical training instruction
    family: str  # e.g. "pick", "push", "place"
    paraphrases: tuple[str, ...] = ()  # held out from training by default
    args: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Suite:
    name: str
    env_id: str
    tasks: tuple[Task, ...]

    def __post_init__(self) -> None:
        seen: dict[str, int] = {}
        for t in self.tasks:
            for s in (t.instruction, *t.paraphrases):
                key = normalize(s)
                if key in seen and seen[key] != t.task_id:
                    raise InstructionError(f"suite {self.name}: {s!r} is used by tasks {seen[key]} and {t.task_id}")
                seen[key] = t.task_id

    @property
    def instructions(self) -> list[str]:
        return [t.instruction for t in self.tasks]

    def task(self, key: int | str, allow_paraphrase: bool = True) -> Task:
        """Look a task up by id or by instruction (canonical or paraphrase)."""
        if isinstance(key, (int,)) and not isinstance(key, bool):
            if 0 <= key < len(self.tasks):
                return self.tasks[key]
            raise InstructionError(f"suite {self.name}: task id {key} out of range 0..{len(self.tasks) - 1}")
        if not isinstance(key, str) or not key.strip():
            raise InstructionError(f"suite {self.name}: instruction must be a non-empty string, got {key!r}")
        k = normalize(key)
        for t in self.tasks:
            if normalize(t.instruction) == k or (allow_paraphrase and k in map(normalize, t.paraphrases)):
                return t
        raise InstructionError(f"suite {self.name}: instruction {key!r} is not in the suite. "
                               f"Valid instructions: {self.instructions}")

    def same_scene(self, task_id: int) -> list[int]:
        """Other tasks feasible from the same initial state (all tasks share one scene here)."""
        return [t.task_id for t in self.tasks if t.task_id != task_id]


def normalize(s: str) -> str:
    return " ".join(s.lower().strip().rstrip(".").split())
