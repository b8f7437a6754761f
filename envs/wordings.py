"""The suites' held-out instruction wordings, by env id: what evaluation commands a suite with (P5,
``benchmarks/language.py``), so that training can keep them out of anything it generates. A module of its own:
it imports the suites' task modules, which import ``envs``."""

from __future__ import annotations

from envs import SUITES


def held_out_wordings(env_id: str) -> list[str]:
    """The held-out paraphrases of a suite env's instructions (what P5 and benchmarks/language.py
    command it with), so that training can keep them out of anything it generates; [] for other envs."""
    if env_id == SUITES["tabletop"]:
        from envs.maniskill.tasks.tabletop import TABLETOP_SUITE
        return [p for t in TABLETOP_SUITE.tasks for p in t.paraphrases]
    if env_id == SUITES["kitchen"]:
        from envs.robosuite.kitchen import TASKS
        return [p for t in TASKS for p in t.paraphrases]
    if env_id == SUITES["libero_goal"] or env_id.startswith("libero/goal-"):
        from envs.libero.env import PARAPHRASES
        return [p for ps in PARAPHRASES.values() for p in ps]
    return []
