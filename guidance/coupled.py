"""Coupled Guidance: guide the data endpoint of the training coupling, not the velocity.

At ``x_t`` the network's velocity gives the posterior mean of the data endpoint,
``x1_hat = x_t + (1 - t) v``, with posterior covariance ``Sigma_t``. Tilting that posterior by
``exp(-w c)`` moves the endpoint to ``x1_tilde``; the state then moves along the segment from
the re-derived noise endpoint ``(x_t - t x1_tilde) / (1 - t)`` to ``x1_tilde``:

    x_{t+dt} = x_t + dt (x1_tilde - x_t) / (1 - t)

The default is ``sigma="independent", step="linesearch"``: stable at every scale and it enforces
constraints on real policies. ``sigma="jacobian"`` (with the line search) is more accurate on the
exact testbeds (mean over four seeds, ten cases, five added after the default was chosen: with
``renoise=1`` 1.17x the best one-pass method's distance on average, the line search alone 1.26x,
the default 1.62x; ``benchmarks/results/guidance_seeds.md``) and on image inpainting (+2 to
+4 dB), but it is not the default:
a policy's posterior given its observation is sharp, so the Tweedie Sigma_t is small and the
tilt barely moves the chunk. On Adroit joint limits it left 85-100% of episodes violating on
three of four tasks at every scale up to 1000, where the diagonal default kept the limits at
scale 10 (``benchmarks/results/guidance.md``). It also pays one backward pass per step.

Endpoint steps (``step``):
  * ``"linear"``: ``x1_tilde = x1_hat - w Sigma_t grad c(x1_hat)`` (exact for Gaussian
    posteriors and linear costs);
  * ``"prox"``: ``argmin_z |z - x1_hat|^2 / (2 w Sigma_t) + c(z)`` by ``inner_steps``
    Sigma-preconditioned gradient steps with a backtracking (Armijo) line search (monotone, so
    it cannot blow up on stiff costs); exact for Gaussian posteriors and quadratic costs;
  * ``"linesearch"``: the first of those steps only: the linear step where it lowers the prox
    objective, halved until it does (so ``sum_i delta_i^2 / Sigma_i <= 2 w (c(x1_hat) -
    c(x1_tilde))``: a bounded cost bounds the step; a linear cost gets the full linear step);
  * ``"trust"``: the linear step with its per-sample norm capped at ``radius`` (units of x);
  * ``"tilted_is"``: the same tilted mean, with the particles drawn around the line-search
    endpoint and importance-corrected: exact (zero variance) for Gaussian posteriors and linear
    costs, reaches as far as the gradient step, reweights where the gradient is blind;
  * ``"sampled"``: the mean of ``N(x1_hat, Sigma_t)`` tilted by ``exp(-w c)``, estimated with
    ``n_particles`` antithetic draws (seeded): cost evaluations only, no gradient; it sees mass
    that a flat-then-steep cost removes where a point gradient sees nothing, and it is bounded
    (an average of particles) -- which also means it cannot move the endpoint further than a few
    posterior stds, so it under-guides stiff costs whose tilted mean lies far out.
A ``project`` (Projection, ``(mask, values)``, or a PrefixCost) is then applied to
``x1_tilde`` exactly; at the last step ``x_1 = x1_tilde``, so hard constraints hold at the end.

``Sigma_t`` (``sigma``): ``"independent"`` = ``s2 (1-t)^2 / ((1-t)^2 + t^2 s2)`` (Gaussian data of
per-dimension variance ``s2`` under the independent coupling; ``s2`` defaults to the model's data
variance, ``sample(data_variance=...)``, which a policy passes from its action normalizer, else
1; ``SampleStats.s2``/``s2_source`` record which); ``"identity"`` = 1; a float
constant; or ``"jacobian"`` = ``(1-t)^2 / t * d x1_hat / d x_t`` (Tweedie), applied to the
gradient by one vector-Jacobian product: this one costs a backward pass through the network.
All other variants use the network exactly as unguided sampling does: same NFE, no backward.

``noise_endpoint="fixed"`` keeps the unguided noise endpoint and moves only the data endpoint
(the tempting variant DESIGN.md reports as worse); ``PnPRenoiseGuidance`` re-noises with fresh
noise instead (PnP-Flow style). ``renoise=eta`` sits between the two, DDIM-eta style: the next
state is ``t' x1_tilde + (1-t') (sqrt(1-r^2) eps_hat + r xi)`` with ``eps_hat`` the re-derived
noise endpoint, ``xi`` fresh (seeded) noise and ``r = eta s / (1-t)``, ``s^2 = (1-t)^2 -
(t/t')^2 (1-t')^2`` (eta = 1: the Markov posterior of the path), so the fresh share shrinks with
dt and more steps converge to the same distribution (a constant share does not: measured, it
shrinks the variance whatever the step count). ``renoise_schedule`` scales eta over t.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from envs.errors import InvalidOptionError
from guidance.base import Guidance, clip_norm, importance_pick, noise_stream, resolve_projection, sanitize
from guidance.costs import Cost
from guidance.accounting import VelocityCaller

SIGMAS = ("independent", "identity", "jacobian")
STEPS = ("linear", "linesearch", "prox", "trust", "sampled", "tilted_is")
NOISE_ENDPOINTS = ("rederived", "fixed")
RENOISE_SCHEDULES = {"constant": lambda t: 1.0, "linear_down": lambda t: 1.0 - t}
_ARMIJO = 1e-4
_MAX_HALVINGS = 30


class CoupledGuidance(Guidance):
    """Coupled Guidance (see module docstring). Options: step, sigma, s2, inner_steps (prox),
    radius (trust), n_particles and seed (sampled), project, noise_endpoint, plus the common
    ones of ``Guidance`` (t_start, t_end, schedule, max_grad_norm)."""

    name = "coupled"

    def __init__(self, cost: Cost | Callable | str | None = None, scale: float = 1.0, *,
                 step: str = "linesearch", sigma: str | float = "independent", s2: float | Tensor | None = None,
                 inner_steps: int = 5, radius: float = 1.0, n_particles: int = 32, seed: int = 0,
                 project: Any = None, noise_endpoint: str = "rederived", renoise: float = 0.0,
                 renoise_schedule: str = "constant", **common: Any) -> None:
        super().__init__(cost, scale, **common)
        # The default: diagonal (independent) Sigma_t with the line-search step; see the docstring
        # for why the Jacobian Sigma_t, more accurate on the exact testbeds, is not the default.
        if step not in STEPS:
            raise InvalidOptionError(f"unknown coupled step {step!r}; valid steps: {', '.join(STEPS)}")
        if isinstance(sigma, str):
            if sigma not in SIGMAS:
                raise InvalidOptionError(f"unknown sigma {sigma!r}; valid: {', '.join(SIGMAS)} or a "
                                         f"positive float")
        elif isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
            raise InvalidOptionError(f"sigma must be one of {', '.join(SIGMAS)} or a float > 0; got {sigma!r}")
        if sigma == "jacobian" and step in ("prox", "sampled", "tilted_is"):
            raise InvalidOptionError(f"step={step!r} needs an explicit diagonal Sigma_t; use sigma="
                                     "'independent', 'identity' or a float with it, or step='linear'/"
                                     "'linesearch'/'trust' with sigma='jacobian'")
        if isinstance(n_particles, bool) or not isinstance(n_particles, int) or n_particles < 2 \
                or n_particles % 2:
            raise InvalidOptionError(f"n_particles must be an even integer >= 2 (antithetic pairs); "
                                     f"got {n_particles!r}")
        s2t = None if s2 is None else torch.as_tensor(s2, dtype=torch.float32)
        if s2t is not None and not bool((s2t > 0).all()):
            raise InvalidOptionError(f"s2 (data variance per dimension) must be > 0; got {s2}")
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise InvalidOptionError(f"inner_steps must be an integer >= 1; got {inner_steps!r}")
        if not radius > 0:
            raise InvalidOptionError(f"radius must be > 0; got {radius}")
        if noise_endpoint not in self._noise_endpoints():
            raise InvalidOptionError(f"unknown noise_endpoint {noise_endpoint!r}; valid: "
                                     f"{', '.join(self._noise_endpoints())}")
        self.step_kind, self.sigma, self.s2_option = step, sigma, s2t
        self.s2 = s2t if s2t is not None else torch.ones(())
        self.inner_steps, self.radius = inner_steps, float(radius)
        self.n_particles, self.seed = n_particles, int(seed)
        if isinstance(renoise, bool) or not isinstance(renoise, (int, float)) or not 0.0 <= renoise <= 1.0:
            raise InvalidOptionError(f"renoise must be a number in [0, 1]; got {renoise!r}")
        if renoise and noise_endpoint != "rederived":
            raise InvalidOptionError("renoise mixes fresh noise into the re-derived noise endpoint; it needs "
                                     "noise_endpoint='rederived'")
        if renoise_schedule not in RENOISE_SCHEDULES:
            raise InvalidOptionError(f"unknown renoise_schedule {renoise_schedule!r}; valid: "
                                     f"{', '.join(RENOISE_SCHEDULES)}")
        self.project, self.noise_endpoint, self.renoise = project, noise_endpoint, float(renoise)
        self.renoise_schedule = RENOISE_SCHEDULES[renoise_schedule]
        self._proj = None
        self._projected_last = False
        self._gen: torch.Generator | None = None

    @staticmethod
    def _noise_endpoints() -> tuple[str, ...]:
        return NOISE_ENDPOINTS

    @property
    def needs_network_grad(self) -> bool:
        return self.sigma == "jacobian" and self.scale > 0 and self.cost is not None

    def _has_projection(self) -> bool:
        return self.project is not None

    def begin(self, x0: Tensor, velocity: VelocityCaller) -> None:
        super().begin(x0, velocity)
        event = tuple(x0.shape[1:])
        # s2: the option if given, else the model's data variance, else 1 (unit-variance data)
        if self.s2_option is not None:
            self.s2, source = self.s2_option, "option"
        elif velocity.data_variance is not None:
            self.s2, source = velocity.data_variance.detach().float().cpu(), "model"
        else:
            self.s2, source = torch.ones(()), "default"
        if self.sigma == "independent":
            velocity.stats.s2, velocity.stats.s2_source = float(self.s2.float().mean()), source
        if self.s2.ndim:
            try:
                ok = torch.broadcast_shapes(self.s2.shape, event) == event
            except RuntimeError:
                ok = False
            if not ok:
                raise InvalidOptionError(f"s2 of shape {tuple(self.s2.shape)} does not broadcast to "
                                         f"per-sample shape {event}")
        self._proj = resolve_projection(self.project, event)
        self._projected_last = False
        # a stream apart from small user seeds (noise x0 drawn with seed s must not reappear as the
        # particles or the fresh noise of a guide seeded s; measured: it biases the variance), keyed
        # on x0 so that one-chunk calls do not all get the same fresh noise
        self._gen = noise_stream(x0, 0x9E3779B97F4A + 1_000_003 * self.seed, x0.device)

    # ---- the three pieces: Sigma_t, the endpoint step, the move along the segment ----------
    def sigma_t(self, t: float, like: Tensor) -> Tensor:
        """Diagonal posterior covariance of the data endpoint at time t, shaped (1, *event)."""
        event_ones = torch.ones((1, *like.shape[1:]), device=like.device, dtype=like.dtype)
        if self.sigma == "identity":
            return event_ones
        if isinstance(self.sigma, (int, float)):
            return event_ones * float(self.sigma)
        s2 = self.s2.to(like.device, like.dtype) * event_ones
        a = (1.0 - t) ** 2
        return s2 * a / (a + t * t * s2)

    def guided_step(self, velocity: VelocityCaller, x: Tensor, t: float, dt: float, w: float) -> Tensor:
        if self.sigma == "jacobian" and t > 0 and self.cost is not None:
            xr = x.detach().requires_grad_(True)
            with torch.inference_mode(False), torch.enable_grad():
                x1_hat_graph = xr + (1.0 - t) * velocity(xr, t, grad=True)
            x1_hat = x1_hat_graph.detach()
            factor = (1.0 - t) ** 2 / t

            def precondition(g: Tensor) -> Tensor:
                jg = velocity.backward(x1_hat_graph, xr, g)
                return factor * sanitize(jg, self._stats)
        else:
            x1_hat = x + (1.0 - t) * velocity(x, t)
            sig = self.sigma_t(t, x)

            def precondition(g: Tensor) -> Tensor:
                return sig * g
        x1_tilde = self.endpoint(x1_hat, t, w, precondition)
        if self._proj is not None:
            x1_tilde = self._proj(x1_tilde)
        self._projected_last = t + dt >= 1.0 - 1e-9
        return self.move(x, x1_hat, x1_tilde, t, dt)

    def endpoint(self, x1_hat: Tensor, t: float, w: float, precondition: Callable[[Tensor], Tensor]) -> Tensor:
        """The tilted posterior mean ``x1_tilde`` (before any projection)."""
        if self.cost is None:
            return x1_hat
        if self.step_kind == "linesearch" and self.sigma == "jacobian":
            return self._linesearch_precond(x1_hat, w, precondition)
        if self.step_kind in ("prox", "linesearch"):
            n_inner = 1 if self.step_kind == "linesearch" else self.inner_steps
            return self._prox(x1_hat, w * self.sigma_t(t, x1_hat), n_inner)
        if self.step_kind == "sampled":
            return self._sampled(x1_hat, self.sigma_t(t, x1_hat), w)
        if self.step_kind == "tilted_is":
            sig = self.sigma_t(t, x1_hat)
            return self._sampled(x1_hat, sig, w, proposal=self._prox(x1_hat, w * sig, 1))
        _, g = self.cost_grad(x1_hat)
        delta = w * precondition(g)
        if self.step_kind == "trust":
            flat, n = clip_norm(delta.reshape(delta.shape[0], -1), self.radius)
            self._stats.n_clipped_grad += n
            delta = flat.reshape(delta.shape)
        return x1_hat - delta

    def _linesearch_precond(self, center: Tensor, w: float, precondition: Callable[[Tensor], Tensor]) -> Tensor:
        """The linesearch step for a Sigma_t known only through products (``sigma="jacobian"``).

        With d = w Sigma g the prox objective along z = center - eta d is
        ``c(z) + eta^2 <g, d> / 2`` (no inverse of Sigma needed), so Armijo backtracking from the
        full linear step works as in the diagonal case. Where <g, d> <= 0 (the Jacobian estimate
        is not positive along g) the endpoint is left where the network put it (counted as clipped)."""
        b = center.shape[0]
        view = (b,) + (1,) * (center.ndim - 1)
        c0, g = self.cost_grad(center)
        d = w * precondition(g)
        slope = (g * d).flatten(1).sum(1)
        usable = torch.isfinite(slope) & (slope > 0)
        self._stats.n_clipped_grad += int((~usable).sum())
        d = torch.where(usable.view(view), d, torch.zeros_like(d))
        slope = torch.where(usable, slope, torch.zeros_like(slope))
        eta = torch.ones(b, device=center.device, dtype=center.dtype)
        accepted = ~usable
        z = center
        for _ in range(_MAX_HALVINGS):
            cand = center - eta.view(view) * d
            with torch.no_grad():
                fc = self.cost(cand) + 0.5 * eta * eta * slope
            self._stats.n_cost_evals += 1
            ok = ~accepted & torch.isfinite(fc) & (fc <= c0 - _ARMIJO * eta * slope)
            z = torch.where(ok.view(view), cand, z)
            accepted |= ok
            if bool(accepted.all()):
                break
            eta = torch.where(accepted, eta, eta * 0.5)
        return z

    def _prox(self, center: Tensor, a: Tensor, n_inner: int) -> Tensor:
        """argmin_z |z - center|^2 / (2a) + c(z), a = w Sigma_t > 0 diagonal (1, *event)."""
        b = center.shape[0]
        view = (b,) + (1,) * (center.ndim - 1)

        def objective(z: Tensor) -> Tensor:
            self._stats.n_cost_evals += 1
            with torch.no_grad():
                q = ((z - center) ** 2 / (2 * a)).flatten(1).sum(1)
                return q + self.cost(z)

        z = center
        c, g = self.cost_grad(z)
        f = c  # the quadratic term is 0 at the centre
        for k in range(n_inner):
            d = (z - center) + a * g              # Sigma-preconditioned gradient of the objective
            slope = (d * d / a).flatten(1).sum(1)
            eta = torch.ones(b, device=z.device, dtype=z.dtype)
            accepted = torch.zeros(b, dtype=torch.bool, device=z.device)
            z_new, f_new = z, f
            for _ in range(_MAX_HALVINGS):
                cand = z - eta.view(view) * d
                fc = objective(cand)
                ok = ~accepted & torch.isfinite(fc) & (fc <= f - _ARMIJO * eta * slope)
                z_new = torch.where(ok.view(view), cand, z_new)
                f_new = torch.where(ok, fc, f_new)
                accepted |= ok
                if bool(accepted.all()):
                    break
                eta = torch.where(accepted, eta, eta * 0.5)
            z, f = z_new, f_new
            if k + 1 < n_inner:
                _, g = self.cost_grad(z)
        return z

    def _sampled(self, center: Tensor, sig: Tensor, w: float, proposal: Tensor | None = None) -> Tensor:
        """Mean of N(center, Sigma_t) tilted by exp(-w c), by self-normalized importance sampling
        with antithetic draws (exact zero mean, so w -> 0 gives back ``center``).

        ``proposal``: draw the particles from N(proposal, Sigma_t) instead (``tilted_is``: the
        line-search endpoint) and correct the weights by the density ratio. For a Gaussian
        posterior and a linear cost the linear step IS the tilted mean and every weight is equal:
        exact with zero variance; for other costs the gradient step carries the particles where
        the tilted mass is and the weights fix what a point gradient gets wrong."""
        k, b = self.n_particles, center.shape[0]
        eps = torch.randn((k // 2, *center.shape), generator=self._gen, device=center.device,
                          dtype=center.dtype)
        dev = torch.cat([eps, -eps]) * sig.sqrt()             # (K, B, ...)
        base = center if proposal is None else proposal
        with torch.no_grad():  # one batch per particle: costs may hold per-sample parameters (B, ...)
            c = torch.stack([self.cost(base + d) for d in dev])
        log_ratio = 0.0
        if proposal is not None:  # log N(z; center, S) - log N(z; proposal, S) at z = proposal + d
            shift = proposal - center
            log_ratio = (-((shift[None] + dev) ** 2 - dev ** 2) / (2 * sig)).flatten(2).sum(-1)
        self._stats.n_cost_evals += k
        bad = ~torch.isfinite(c)
        if bool(bad.any()):
            self._stats.n_nonfinite_grad += int(bad.any(0).sum())
        logw = -w * torch.where(torch.isnan(c), torch.full_like(c, float("inf")), c) + log_ratio
        dead = torch.isinf(logw).all(0)                       # every particle infinitely costly
        wts = torch.softmax(torch.where(dead[None], torch.zeros_like(logw), logw), dim=0)
        return base + (wts.view(k, b, *([1] * (center.ndim - 1))) * dev).sum(0)

    def move(self, x: Tensor, x1_hat: Tensor, x1_tilde: Tensor, t: float, dt: float) -> Tensor:
        """Next state on the segment toward ``x1_tilde``."""
        if self.noise_endpoint == "fixed":
            x0_hat = (x - t * x1_hat) / (1.0 - t)
            return (1.0 - t - dt) * x0_hat + (t + dt) * x1_tilde
        if self.renoise and 0.0 < t and t + dt < 1.0 - 1e-9:  # x_0 is pure noise already
            # re-derived noise endpoint, partly refreshed: sqrt(1 - r^2) eps_hat + r xi (r = renoise)
            eps_hat = (x - t * x1_tilde) / (1.0 - t)
            xi = torch.randn(x.shape, generator=self._gen, device=x.device, dtype=x.dtype)
            r = self._renoise_share(t, dt)
            eps = (1.0 - r * r) ** 0.5 * eps_hat + r * xi
            return (1.0 - t - dt) * eps + (t + dt) * x1_tilde
        return x + dt * (x1_tilde - x) / (1.0 - t)

    def _renoise_share(self, t: float, dt: float) -> float:
        """DDIM-eta: the share ``r`` of fresh noise in the next noise endpoint that keeps the forward
        marginals (eta = 1: the Markov posterior q(x_t' | x_t, x1)); it shrinks with dt, so more
        steps stay consistent."""
        t2 = t + dt
        s_sq = max((1.0 - t) ** 2 - (t / t2) ** 2 * (1.0 - t2) ** 2, 0.0)
        return min(1.0, self.renoise * self.renoise_schedule(t) * s_sq ** 0.5 / (1.0 - t))

    def finish(self, x: Tensor) -> Tensor:
        # The last step lands on x1_tilde up to float rounding; make the hard constraint exact.
        if self._proj is not None and self._projected_last:
            return self._proj(x)
        return x


class PnPRenoiseGuidance(CoupledGuidance):
    """PnP-Flow-style baseline: a guided endpoint (default: the linear step), then FRESH noise.

    ``x_{t+dt} = (1 - t') eps + t' x1_tilde`` with ``eps ~ N(0, I)`` drawn anew each step
    (seeded by ``seed``), instead of the noise endpoint re-derived from ``x_t``. Isolates what
    keeping the coupling is worth.
    """

    name = "pnp_renoise"

    def __init__(self, cost: Cost | Callable | str | None = None, scale: float = 1.0,
                 **options: Any) -> None:
        options.setdefault("noise_endpoint", "fresh")
        options.setdefault("step", "linear")  # PnP-Flow's plain gradient step on the endpoint
        options.setdefault("sigma", "independent")
        super().__init__(cost, scale, **options)

    @staticmethod
    def _noise_endpoints() -> tuple[str, ...]:
        return ("fresh",)

    def move(self, x: Tensor, x1_hat: Tensor, x1_tilde: Tensor, t: float, dt: float) -> Tensor:
        t_next = t + dt
        if t_next >= 1.0 - 1e-9:
            return x1_tilde
        eps = torch.randn(x.shape, generator=self._gen, device=x.device, dtype=x.dtype)
        return (1.0 - t_next) * eps + t_next * x1_tilde


class GuidedParticles(CoupledGuidance):
    """Coupled-guided candidates with importance weights that undo the guidance.

    Each of ``n_particles`` candidates follows the stochastic DDIM-eta sampler (eta = ``renoise``,
    default 1: the Markov posterior of the path; ``x_t' ~ N(m(x1), ((1-t') r)^2)`` with the mean
    ``m`` built from the data endpoint, see :meth:`CoupledGuidance.move`), with the coupled endpoint
    ``x1_tilde`` in place of the network's ``x1_hat`` as the proposal. Both transitions are
    Gaussians of one variance, so the density ratio of the unguided path to the guided one is
    known in closed form; a candidate's log weight is ``-w c(x_1) + sum log p/q`` and one is kept
    with probability softmax(log weights) (self-normalized importance sampling of ``p exp(-w c)``
    where ``p`` is that stochastic sampler's distribution, a little narrower than the deterministic
    one at few steps). The guidance carries candidates toward
    the low-cost region (where unguided particles rarely land); the weights reweight the modes
    (what one guided pass cannot). The first and last steps are deterministic (no density ratio
    exists there), so they stay unguided. Costs ``n_particles`` passes of the network, no
    backward pass with the default diagonal Sigma_t. The first candidate starts from the caller's
    noise; the others, and the fresh noise of every step, from streams seeded by ``seed`` and that
    noise (fresh on every call, as for ``renoise``)."""

    name = "guided_particles"

    def __init__(self, cost: Cost | Callable | str | None = None, scale: float = 1.0, *,
                 n_particles: int = 4, proposal: float = 1.0, **options: Any) -> None:
        if not 0.0 <= proposal <= 1.0 or isinstance(proposal, bool):
            raise InvalidOptionError(f"proposal (the share of the scale the guided proposal uses) must be in "
                                     f"[0, 1]; got {proposal!r}")
        self.proposal = float(proposal)
        if not options.get("renoise", 1.0) > 0 or options.get("noise_endpoint", "rederived") != "rederived":
            raise InvalidOptionError("guided_particles needs stochastic DDIM-eta steps (renoise > 0, "
                                     "noise_endpoint='rederived'): only there is the path density known")
        options.setdefault("renoise", 1.0)
        if options.get("project") is not None:
            raise InvalidOptionError("guided_particles does not take a projection (a projected endpoint has "
                                     "no path density); use coupled with project=...")
        if options.get("sigma") == "jacobian":
            raise InvalidOptionError("guided_particles uses a diagonal Sigma_t (sigma='independent', "
                                     "'identity' or a float)")
        if isinstance(n_particles, bool) or not isinstance(n_particles, int) or n_particles < 1:
            raise InvalidOptionError(f"n_particles must be an integer >= 1; got {n_particles!r}")
        super().__init__(cost, scale, **options)
        self.n_candidates = n_particles
        self._logw: list[Tensor] = []
        self._path: Tensor | None = None
        self._cand_gen: torch.Generator | None = None

    def begin(self, x0: Tensor, velocity: VelocityCaller) -> None:
        super().begin(x0, velocity)
        self._logw = []
        self._path = torch.zeros(x0.shape[0], dtype=torch.float64, device=x0.device)

    def candidate_noise(self, x0: Tensor, k: int) -> Tensor:
        if k == 1:  # keyed on the caller's noise too: fresh candidates on every call
            self._cand_gen = noise_stream(x0, 0x5EED5 + 7_919 * self.seed + 1)
        self._path = torch.zeros(x0.shape[0], dtype=torch.float64, device=x0.device)
        return torch.randn(x0.shape, generator=self._cand_gen, dtype=x0.dtype).to(x0.device)

    def step(self, velocity: VelocityCaller, x: Tensor, t: float, dt: float) -> Tensor:
        t2 = t + dt
        x1_hat = x + (1.0 - t) * velocity(x, t)
        if t == 0.0 or t2 >= 1.0 - 1e-9:  # deterministic: no density ratio, so no guidance
            return x + dt * (x1_hat - x) / (1.0 - t)
        w = self.weight(t) * self.proposal
        x1_tilde = x1_hat
        if w > 0.0 and self.cost is not None:
            sig = self.sigma_t(t, x)
            x1_tilde = self.endpoint(x1_hat, t, w, lambda g: sig * g)
        r = self._renoise_share(t, dt)
        keep, std = (1.0 - r * r) ** 0.5, (1.0 - t2) * r

        def mean(z: Tensor) -> Tensor:
            return (1.0 - t2) * keep * (x - t * z) / (1.0 - t) + t2 * z
        xi = torch.randn(x.shape, generator=self._gen, device=x.device, dtype=x.dtype)
        m_q = mean(x1_tilde)
        nxt = m_q + std * xi
        if std > 0:  # log p(x'|x) - log q(x'|x), both N(., std^2)
            d = (mean(x1_hat) - m_q) / std          # (m_p - m_q) / std
            self._path += (-(xi - d) ** 2 + xi ** 2).flatten(1).sum(1).double() / 2
        return nxt

    def finish(self, x: Tensor) -> Tensor:
        c = torch.zeros_like(self._path)
        if self.cost is not None and self.scale > 0:
            with torch.no_grad():
                c = self.cost(x).double()
            self._stats.n_cost_evals += 1
        lw = -self.scale * torch.where(torch.isnan(c), torch.full_like(c, float("inf")), c) + self._path
        self._logw.append(torch.nan_to_num(lw, nan=-float("inf")))
        return x

    def select(self, candidates: Tensor) -> Tensor:
        k, b = candidates.shape[:2]
        gen = self._cand_gen or torch.Generator().manual_seed(0x5EED5 + 7_919 * self.seed)
        pick = importance_pick(torch.stack(self._logw), gen).to(candidates.device)  # (K, B) log weights
        return candidates[pick, torch.arange(b, device=candidates.device)]


__all__ = ["CoupledGuidance", "GuidedParticles", "PnPRenoiseGuidance", "SIGMAS", "STEPS"]
