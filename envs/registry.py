"""One factory over every backend: ``envs.make(env_id, **options)``.

Backends register lazily (a string ``module:callable``), so importing ``envs`` does not import
SAPIEN, MuJoCo or robosuite until an env of that backend is made.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from envs.errors import UnknownEnvError


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    backend: str  # maniskill | adroit | robosuite | robocasa | worldmodel
    entry: str  # "module:callable" taking (env_id=..., **options)
    kind: str = "task"  # task | suite
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    colours: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """colours of the scene's objects that its instructions do not name (LIBERO: the black bowl): the
    instruction resolver accepts these from a user and refuses any other colour on that object"""


_REGISTRY: dict[str, EnvSpec] = {}


def register(env_id: str, backend: str, entry: str, kind: str = "task", description: str = "",
             colours: dict[str, tuple[str, ...]] | None = None, **defaults: Any) -> None:
    _REGISTRY[env_id] = EnvSpec(env_id, backend, entry, kind, description, dict(defaults), dict(colours or {}))


def spec(env_id: str) -> EnvSpec:
    if env_id not in _REGISTRY:
        import difflib
        close = difflib.get_close_matches(env_id, _REGISTRY, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UnknownEnvError(f"unknown env id {env_id!r}.{hint} Valid ids: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[env_id]


def list_envs(backend: str | None = None, kind: str | None = None) -> list[str]:
    return sorted(k for k, s in _REGISTRY.items()
                  if (backend is None or s.backend == backend) and (kind is None or s.kind == kind))


def make(env_id: str, **options: Any):
    """Make a registered env. ``options`` override the spec's defaults (validated by the backend)."""
    s = spec(env_id)
    module, fn = s.entry.split(":")
    factory = getattr(importlib.import_module(module), fn)
    return factory(env_id=env_id, **{**s.defaults, **options})
