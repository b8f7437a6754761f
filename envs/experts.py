"""Experts that generate demonstrations: ``reset(env, obs)`` then ``act(obs)`` each step.

Experts are privileged: they may read the simulator through ``env`` (object poses, goals).
Each env knows its expert through ``env.make_expert(**options)``.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Expert(Protocol):
    def reset(self, env: Any, obs: dict) -> None: ...

    def act(self, obs: dict) -> np.ndarray: ...


def make_expert(env: Any, **options: Any) -> Expert:
    maker = getattr(env.unwrapped if hasattr(env, "unwrapped") else env, "make_expert", None)
    if maker is None:
        raise NotImplementedError(f"env {getattr(env, 'env_id', env)!r} has no expert")
    return maker(**options)
