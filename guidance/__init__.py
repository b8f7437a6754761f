"""Guidance for flow-matching samplers: Coupled Guidance, baselines, costs, and the one sampler.

    import guidance
    from guidance import costs
    cost = costs.ObstacleCost(costs.EEPath(start=ee_pos, step_size=0.02),
                              [guidance.geometry.Sphere(center, 0.05)])
    guide = guidance.make("coupled", cost=cost, scale=1.0)
    chunk, stats = guidance.sample(velocity, x0, n_steps=10, guide=guide, return_stats=True)

Methods (``guidance.METHODS``): none, coupled, velocity_gradient, state_gradient, pnp_renoise,
mc, cfg, particles (P unguided candidates per sample, one kept by exp(-w c): P x the network),
guided_particles (P coupled-guided stochastic candidates, one kept by importance weights that undo
the guidance: P x the network);
``guidance.make`` names the valid options of each; ``guidance.make(budget="one_pass" | "with_backward" |
"n_passes", cost=..., scale=...)`` picks by latency budget (``guidance.BUDGETS`` gives each one's
measured accuracy and time). ``velocity(x_t, t)`` (or
``velocity(x_t, t, cond)`` when ``cond`` is given; ``drop_cond=True`` for cfg's unconditional
branch) returns a tensor shaped like ``x_t``. ``stats`` counts network evaluations, backward
passes, cost gradients/evaluations, repaired (non-finite or clipped) gradients and wall time.
Costs are in nats (``guidance.costs``). The exact-answer testbed lives in ``guidance.testbed``
and ``guidance.distances`` (imported on demand); results in benchmarks/results/guidance.md.
"""

from guidance import costs, geometry, operators
from guidance.accounting import SampleStats
from guidance.base import SCHEDULES, Guidance
from guidance.baselines import (ClassifierFreeGuidance, ImportanceParticles, MonteCarloGuidance, NoGuidance,
                                StateGradientGuidance, VelocityGradientGuidance)
from guidance.costs import Cost, Projection, make_cost
from guidance.coupled import CoupledGuidance, GuidedParticles, PnPRenoiseGuidance
from guidance.methods import BUDGETS, METHODS, make
from guidance.sampler import sample

__all__ = ["sample", "make", "METHODS", "BUDGETS", "SCHEDULES", "Guidance", "SampleStats", "CoupledGuidance",
           "PnPRenoiseGuidance", "NoGuidance", "VelocityGradientGuidance", "StateGradientGuidance",
           "MonteCarloGuidance", "ClassifierFreeGuidance", "ImportanceParticles", "GuidedParticles", "Cost", "Projection", "make_cost", "costs",
           "geometry", "operators"]
