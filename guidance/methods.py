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


BUDGETS: dict[str, tuple[str, dict[str, Any]]] = {
    "one_pass": ("coupled", {}),
    "with_backward": ("coupled", {"sigma": "jacobian"}),
    "n_passes": ("guided_particles", {"n_particles": 4}),
}
"""What a user picks by latency budget (``make(budget=...)``); figures from benchmarks/results/guidance.md:

- ``one_pass``: the network once per flow step and cost evaluations only (coupled, the default). Exact
  testbeds: 1.62x the best method's distance on average; never diverged. On the arm it is the method of
  the collision rows (about 2x the unguided chunk time with 5 flow steps and the trust step, 5-6x with
  10 steps and the line search).
- ``with_backward``: one backward pass through the network per step as well (the Jacobian Sigma_t):
  1.26x the best on the exact testbeds, about 3x the unguided time there; weaker on policies, whose
  sharp posterior makes the tilt small (Adroit limits left violated).
- ``n_passes``: 4 coupled-guided candidates, one kept by importance weights (4x the network): the most
  accurate on average on the exact testbeds (1.26x with 4 candidates), 4x the time and more.
"""


def make(name: str | None = None, cost: Any = None, scale: float = 1.0, *, budget: str | None = None,
         **options: Any) -> Guidance:
    """Build a guidance method by name, or by latency ``budget`` (``BUDGETS``: one_pass,
    with_backward, n_passes; options given here override the budget's); unknown names, budgets or
    options raise naming the valid ones."""
    if budget is not None:
        if name is not None:
            raise InvalidOptionError(f"give a method name or a budget, not both (got {name!r} and budget {budget!r})")
        if budget not in BUDGETS:
            raise InvalidOptionError(f"unknown guidance budget {budget!r}; valid budgets: {', '.join(BUDGETS)}")
        name, defaults = BUDGETS[budget]
        options = {**defaults, **options}
    if name is None:
        raise InvalidOptionError(f"name a guidance method ({', '.join(METHODS)}) or a budget ({', '.join(BUDGETS)})")
    if name not in METHODS:
        raise InvalidOptionError(f"unknown guidance method {name!r}; valid methods: {', '.join(METHODS)}")
    cls = METHODS[name]
    valid = cls.option_names()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise InvalidOptionError(f"unknown option(s) {', '.join(unknown)} for guidance {name!r}; valid "
                                 f"options: {', '.join(valid)}")
    return cls(cost=cost, scale=scale, **options)
