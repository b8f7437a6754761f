"""Guidance methods by name: ``make("coupled", cost=..., scale=..., **options)``."""

from __future__ import annotations

from typing import Any

from envs.errors import InvalidOptionError
from guidance.base import Guidance
from guidance.baselines import (ClassifierFreeGuidance, ImportanceParticles, MonteCarloGuidance, NoGuidance,
                                StateGradientGuidance, VelocityGradientGuidance)
from guidance.coupled import CoupledGuidance, GuidedParticles, PnPRenoiseGuidance

METHODS: dict[str, type[Guidance]] = {
    "none": NoGuidance,
    "coupled": CoupledGuidance,
    "velocity_gradient": VelocityGradientGuidance,
    "state_gradient": StateGradientGuidance,
    "pnp_renoise": PnPRenoiseGuidance,
    "mc": MonteCarloGuidance,
    "cfg": ClassifierFreeGuidance,
    "particles": ImportanceParticles,
    "guided_particles": GuidedParticles,
}


def make(name: str, cost: Any = None, scale: float = 1.0, **options: Any) -> Guidance:
    """Build a guidance method by name; unknown names or options raise naming the valid ones."""
    if name not in METHODS:
        raise InvalidOptionError(f"unknown guidance method {name!r}; valid methods: {', '.join(METHODS)}")
    cls = METHODS[name]
    valid = cls.option_names()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise InvalidOptionError(f"unknown option(s) {', '.join(unknown)} for guidance {name!r}; valid "
                                 f"options: {', '.join(valid)}")
    return cls(cost=cost, scale=scale, **options)
