"""Exact-answer testbed for guidance: Gaussian mixtures, their flows, and the exact tilted target.

A testbed is a data distribution ``p`` (a Gaussian mixture, so densities and posteriors are
closed-form), a cost ``c`` and the target ``p(x) exp(-c(x)) / Z``, sampled exactly (up to Monte
Carlo error) by importance resampling from ``p``. Guided samples of a flow model of ``p`` are
compared with it by sliced Wasserstein and MMD.

Flow models: ``GMMVelocity`` is the exact velocity of ``p`` (no model error: isolates the
guidance's own error, and needs no training); ``MLPVelocity`` is a small network trained here
by flow matching (seeded, ~10-60 s on CPU, cached under ``runs/guidance_testbed``).

Testbeds (``TESTBEDS``): ``gmm2d_linear``, ``gmm2d_obstacle``, ``gmm8d_linear``,
``gmm8d_obstacle`` and ``gmm2d_class`` (a conditional mixture whose cost is
``-lam log p(y|x)``, so classifier-free guidance is scored on the same footing as the costs);
and cases no method was tuned on (``HELD_OUT``): ``grid9_halfplane`` (a 3x3 mixture, a soft
half-plane barrier: mode reweighting), ``moons_quadratic`` (two moons, a curved non-Gaussian
density, with a quadratic tilt; no closed-form velocity, so no oracle), ``gmm16d_fullcov_box``
(16-D mixture with full covariances, a soft box on 3 coordinates: a diagonal Sigma_t cannot
represent the posterior) and ``ring_band`` (a stiff band: |x_1| <= 0.3 held by a weight-200
quadratic wall), ``gauss8d_linear`` (one anisotropic Gaussian, a linear cost: the tilted target
is the same Gaussian shifted, where a sampler that narrows its samples loses).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from envs.errors import InvalidOptionError
from guidance.costs import BallCost, Cost, FunctionCost, LinearCost

DEFAULT_CACHE = Path(__file__).resolve().parents[1] / "runs" / "guidance_testbed"


class GaussianMixture:
    """Diagonal Gaussian mixture: ``means``/``stds`` (K, D), ``weights`` (K,) summing to 1."""

    def __init__(self, means: Tensor, stds: Tensor, weights: Tensor) -> None:
        self.means, self.stds = means.double(), stds.double()
        self.weights = (weights / weights.sum()).double()
        self.dim = self.means.shape[1]

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``n`` samples (float32) and their component ids."""
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        eps = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
        return (self.means[k] + self.stds[k] * eps).float(), k

    def joint_log_prob(self, x: Tensor) -> Tensor:
        """``log pi_k + log N(x; mu_k, s_k^2)``, shape (n, K)."""
        x = x.to(self.means.dtype)
        z = (x[:, None, :] - self.means[None]) / self.stds[None]
        logn = -0.5 * (z * z).sum(-1) - torch.log(self.stds).sum(-1)[None] - 0.5 * self.dim * math.log(2 * math.pi)
        return logn + torch.log(self.weights)[None]

    def log_prob(self, x: Tensor) -> Tensor:
        return torch.logsumexp(self.joint_log_prob(x), dim=1)

    def posterior_mean(self, x_t: Tensor, t: Tensor) -> Tensor:
        """``E[x1 | x_t]`` under ``x_t = (1-t) x0 + t x1``, x0 ~ N(0, I): closed form."""
        dtype = x_t.dtype
        x, tt = x_t.double()[:, None, :], t.double()[:, None, None]
        mu, s2 = self.means[None], (self.stds ** 2)[None]
        var = tt * tt * s2 + (1 - tt) ** 2
        logr = (-0.5 * ((x - tt * mu) ** 2 / var + torch.log(var)).sum(-1)
                + torch.log(self.weights)[None])
        r = torch.softmax(logr, dim=1)
        comp_mean = mu + tt * s2 / var * (x - tt * mu)
        return (r[..., None] * comp_mean).sum(1).to(dtype)


class FullCovMixture:
    """Gaussian mixture with full covariances ``covs`` (K, D, D); same interface as
    ``GaussianMixture`` (posterior means in closed form through each covariance's eigenbasis)."""

    def __init__(self, means: Tensor, covs: Tensor, weights: Tensor) -> None:
        self.means, self.covs = means.double(), covs.double()
        self.weights = (weights / weights.sum()).double()
        self.dim = self.means.shape[1]
        self.evals, self.evecs = torch.linalg.eigh(self.covs)       # (K, D), (K, D, D)
        self._chol = torch.linalg.cholesky(self.covs)

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        eps = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
        return (self.means[k] + torch.einsum("nij,nj->ni", self._chol[k], eps)).float(), k

    def _log_normals(self, x: Tensor, var: Tensor, shift: Tensor) -> Tensor:
        """log N(x; shift_k, U_k diag(var_k) U_k^T) for each k: (n, K)."""
        z = torch.einsum("kji,nkj->nki", self.evecs, x[:, None, :] - shift)   # eigen-coordinates
        return (-0.5 * (z * z / var).sum(-1) - 0.5 * torch.log(var).sum(-1)
                - 0.5 * self.dim * math.log(2 * math.pi))

    def joint_log_prob(self, x: Tensor) -> Tensor:
        x = x.to(self.means.dtype)
        return self._log_normals(x, self.evals[None], self.means[None]) + torch.log(self.weights)[None]

    def log_prob(self, x: Tensor) -> Tensor:
        return torch.logsumexp(self.joint_log_prob(x), dim=1)

    def posterior_mean(self, x_t: Tensor, t: Tensor) -> Tensor:
        dtype = x_t.dtype
        x, tt = x_t.double(), t.double()[:, None, None]
        var = tt * tt * self.evals[None] + (1 - tt) ** 2                     # (n, K, D)
        shift = tt * self.means[None]
        logr = self._log_normals(x, var, shift) + torch.log(self.weights)[None]
        r = torch.softmax(logr, dim=1)
        z = torch.einsum("kji,nkj->nki", self.evecs, x[:, None, :] - shift)
        comp = self.means[None] + torch.einsum("kij,nkj->nki", self.evecs, tt * self.evals[None] / var * z)
        return (r[..., None] * comp).sum(1).to(dtype)


class TwoMoons:
    """Two interleaved half circles with Gaussian noise, centred and scaled to unit RMS: a curved,
    non-Gaussian density. Sampling only (no closed-form posterior: the MLP model is the flow)."""

    def __init__(self, noise: float = 0.08) -> None:
        self.noise, self.dim = noise, 2
        self.shift = torch.tensor([0.5, 0.25], dtype=torch.float64)
        self.scale = 1.0 / 0.75

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        k = torch.randint(0, 2, (n,), generator=generator)
        th = math.pi * torch.rand(n, generator=generator, dtype=torch.float64)
        upper = torch.stack([torch.cos(th), torch.sin(th)], 1)
        lower = torch.stack([1 - torch.cos(th), 0.5 - torch.sin(th)], 1)
        x = torch.where(k[:, None] == 0, upper, lower)
        x = x + self.noise * torch.randn(n, 2, generator=generator, dtype=torch.float64)
        return ((x - self.shift) * self.scale).float(), k

    def posterior_mean(self, x_t: Tensor, t: Tensor) -> Tensor:
        raise InvalidOptionError("two moons has no closed-form flow velocity; use the trained MLP "
                                 "model (benchmark --model mlp)")


def importance_resample(x: Tensor, logw: Tensor, n: int, gen: torch.Generator) -> tuple[Tensor, float]:
    """Resample ``n`` of ``x`` with probabilities ``softmax(logw)``; also the pool's ESS."""
    w = torch.softmax(logw.double(), 0)
    ess = float(1.0 / (w * w).sum())
    return x[torch.multinomial(w, n, replacement=True, generator=gen)], ess


class GMMVelocity(nn.Module):
    """The exact flow-matching velocity of a Gaussian mixture (an oracle flow model).

    With ``cond_mixture`` it is a conditional model: ``forward(x, t, drop_cond=True)`` gives the
    unconditional velocity (of ``mixture``), otherwise that of ``cond_mixture``.
    """

    def __init__(self, mixture: GaussianMixture, cond_mixture: GaussianMixture | None = None) -> None:
        super().__init__()
        self.mixture, self.cond_mixture = mixture, cond_mixture

    def forward(self, x: Tensor, t: Tensor, drop_cond: bool = False) -> Tensor:
        mix = self.mixture if drop_cond or self.cond_mixture is None else self.cond_mixture
        one_minus = torch.clamp(1 - t, min=1e-4)[:, None]
        return (mix.posterior_mean(x, t) - x) / one_minus


class MLPVelocity(nn.Module):
    """Small MLP velocity ``v(x, t[, label])`` with Fourier time features.

    ``n_classes > 0`` adds a label embedding with one extra "dropped" label (index
    ``n_classes``) for classifier-free guidance.
    """

    def __init__(self, dim: int, hidden: int = 128, depth: int = 3, n_freq: int = 6,
                 n_classes: int = 0) -> None:
        super().__init__()
        self.dim, self.n_classes = dim, n_classes
        self.register_buffer("freqs", math.pi * 2.0 ** torch.arange(n_freq, dtype=torch.float32) / 2)
        in_dim = dim + 1 + 2 * n_freq
        self.embed = nn.Embedding(n_classes + 1, hidden) if n_classes else None
        self.inp = nn.Linear(in_dim, hidden)
        self.body = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth - 1))
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: Tensor, t: Tensor, label: Tensor | None = None) -> Tensor:
        ft = t[:, None] * self.freqs[None]
        h = self.inp(torch.cat([x, t[:, None], torch.sin(ft), torch.cos(ft)], dim=1))
        if self.embed is not None:
            if label is None:
                label = torch.full((x.shape[0],), self.n_classes, dtype=torch.long, device=x.device)
            h = h + self.embed(label)
        h = torch.nn.functional.silu(h)
        for layer in self.body:
            h = torch.nn.functional.silu(layer(h))
        return self.out(h)


@dataclass
class TrainConfig:
    steps: int = 3000
    batch: int = 512
    lr: float = 3e-3
    hidden: int = 128
    depth: int = 3
    p_drop: float = 0.2  # label dropout for conditional models
    seed: int = 0


@dataclass
class Testbed:
    """A mixture ``p``, a cost, the training set (also the data ``mc`` guidance reads)."""

    name: str
    mixture: GaussianMixture
    cost: Cost
    data: Tensor
    labels: Tensor | None = None
    cond_mixture: GaussianMixture | None = None   # p(x | y = label) for the class testbed
    label: int | None = None
    n_classes: int = 0
    info: dict = field(default_factory=dict)
    cfg_lambda: float = 1.0  # cfg at scale w targets p exp(-(w / cfg_lambda) c)

    @property
    def dim(self) -> int:
        return self.mixture.dim

    @property
    def s2(self) -> Tensor:
        """Per-dimension data variance (Sigma_t's ``s2`` for the independent coupling)."""
        return self.data.var(0)

    def exact_target(self, n: int, seed: int = 0, pool: int = 400_000,
                     power: float = 1.0) -> tuple[Tensor, float]:
        """``n`` samples of ``p exp(-power c) / Z`` by importance resampling ``pool`` draws of
        ``p``; also the effective sample size of the pool (small ESS = untrustworthy)."""
        gen = torch.Generator().manual_seed(10_000 + seed)
        x, _ = self.mixture.sample(pool, gen)
        with torch.no_grad():
            c = self.cost(x).double()
        return importance_resample(x, -power * c, n, gen)

    def velocity(self, model: nn.Module) -> Callable[..., Tensor]:
        """The closure sampling calls: unconditional for costs, ``drop_cond`` aware for cfg."""
        if self.n_classes == 0:
            return lambda x, t: model(x, t)
        if isinstance(model, GMMVelocity):
            return lambda x, t, drop_cond=False: model(x, t, drop_cond=drop_cond)

        def conditional(x: Tensor, t: Tensor, drop_cond: bool = False) -> Tensor:
            label = None if drop_cond else torch.full((x.shape[0],), self.label, dtype=torch.long)
            return model(x, t, label)
        return conditional

    def unconditional_velocity(self, model: nn.Module) -> Callable[..., Tensor]:
        """Velocity of ``p`` itself (what cost guidance starts from)."""
        if self.n_classes == 0:
            return self.velocity(model)
        v = self.velocity(model)
        return lambda x, t: v(x, t, drop_cond=True)

    @property
    def has_oracle(self) -> bool:
        """Whether the data density has a closed-form flow velocity (mixtures do, moons do not)."""
        return not isinstance(self.mixture, TwoMoons)

    def oracle(self) -> GMMVelocity:
        return GMMVelocity(self.mixture, self.cond_mixture)


def _ring(k: int, radius: float, std: float, weights: Tensor | None = None) -> GaussianMixture:
    ang = torch.arange(k, dtype=torch.float64) * 2 * math.pi / k
    means = radius * torch.stack([torch.cos(ang), torch.sin(ang)], 1)
    return GaussianMixture(means, torch.full((k, 2), std, dtype=torch.float64),
                           torch.ones(k, dtype=torch.float64) if weights is None else weights)


def _random_mixture(dim: int, k: int, seed: int) -> GaussianMixture:
    g = torch.Generator().manual_seed(seed)
    means = 0.8 * torch.randn(k, dim, generator=g, dtype=torch.float64)
    stds = 0.2 + 0.3 * torch.rand(k, dim, generator=g, dtype=torch.float64)
    weights = 0.5 + torch.rand(k, generator=g, dtype=torch.float64)
    return GaussianMixture(means, stds, weights)


def _class_cost(uncond: GaussianMixture, cond: GaussianMixture, prior: float, lam: float) -> Cost:
    """``-lam log p(y | x) = -lam (log p(x | y) + log p(y) - log p(x))`` in nats."""

    def cost(x: Tensor) -> Tensor:
        logpy = cond.log_prob(x) + math.log(prior) - uncond.log_prob(x)
        return (-lam * logpy).to(x.dtype)
    return FunctionCost(cost, "classifier")


HELD_OUT = ("grid9_halfplane", "moons_quadratic", "gmm16d_fullcov_box", "ring_band", "gauss8d_linear")
TESTBEDS = ("gmm2d_linear", "gmm2d_obstacle", "gmm8d_linear", "gmm8d_obstacle", "gmm2d_class") + HELD_OUT


def _grid9() -> GaussianMixture:
    g = torch.tensor([-1.2, 0.0, 1.2], dtype=torch.float64)
    means = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(9, 2)
    return GaussianMixture(means, torch.full((9, 2), 0.22, dtype=torch.float64), torch.ones(9, dtype=torch.float64))


def _fullcov_mixture(dim: int, k: int, seed: int) -> FullCovMixture:
    g = torch.Generator().manual_seed(seed)
    means = 1.0 * torch.randn(k, dim, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(k, dim, dim, generator=g, dtype=torch.float64))
    evals = 0.02 + 0.4 * torch.rand(k, dim, generator=g, dtype=torch.float64) ** 2
    covs = q @ torch.diag_embed(evals) @ q.transpose(1, 2)
    return FullCovMixture(means, covs, 0.5 + torch.rand(k, generator=g, dtype=torch.float64))


def make_testbed(name: str, n_data: int = 20_000, seed: int = 0) -> Testbed:
    """Build a testbed by name (see ``TESTBEDS``); the training set is seeded."""
    if name not in TESTBEDS:
        raise InvalidOptionError(f"unknown testbed {name!r}; valid testbeds: {', '.join(TESTBEDS)}")
    gen = torch.Generator().manual_seed(seed)
    labels = cond = label = None
    n_classes = 0
    info: dict = {}
    if name in HELD_OUT:
        mix, cost, info["cost"] = _held_out(name)
    elif name.startswith("gmm2d_") and name != "gmm2d_class":
        mix = _ring(8, 1.6, 0.25)
        if name == "gmm2d_linear":
            cost: Cost = LinearCost(torch.tensor([1.5, 0.75]))
            info["cost"] = "c(x) = 1.5 x_0 + 0.75 x_1 (nats)"
        else:
            ang = math.pi / 8  # between the modes at 0 and 45 degrees
            cost = BallCost(torch.tensor([1.6 * math.cos(ang), 1.6 * math.sin(ang)]), radius=1.0, weight=50.0)
            info["cost"] = "c(x) = 50 relu(1 - |x - o|)^2, o between two modes: a stiff ball obstacle"
    elif name.startswith("gmm8d_"):
        mix = _random_mixture(8, 6, seed=1)
        if name == "gmm8d_linear":
            d = torch.randn(8, generator=torch.Generator().manual_seed(2))
            cost = LinearCost(1.5 * d / d.norm())
            info["cost"] = "c(x) = <a, x>, |a| = 1.5 (random direction, seed 2)"
        else:
            heavy = int(mix.weights.argmax())
            cost = BallCost(mix.means[heavy].float(), radius=1.8, weight=20.0)
            info["cost"] = "c(x) = 20 relu(1.8 - |x - mu_k|)^2: a ball over the heaviest mode"
    else:  # gmm2d_class
        k = 8
        ang = torch.arange(k, dtype=torch.float64) * 2 * math.pi / k
        w0, w1 = torch.exp(1.2 * torch.cos(ang)), torch.exp(-1.2 * torch.cos(ang))
        w0, w1 = w0 / w0.sum(), w1 / w1.sum()
        mix = _ring(k, 1.6, 0.25, 0.5 * (w0 + w1))
        cond, label, n_classes = _ring(k, 1.6, 0.25, w0), 0, 2
        lam = 2.0
        cost = _class_cost(mix, cond, 0.5, lam)
        info["cost"] = f"c(x) = -{lam} log p(y=0 | x): target p(x) p(y=0|x)^{lam} (cfg scale {lam})"
        # labels for training: a component's class is drawn from p(y | k)
        x, comp = mix.sample(n_data, gen)
        py0 = (0.5 * w0 / (0.5 * (w0 + w1)))[comp]
        labels = (torch.rand(n_data, generator=gen, dtype=torch.float64) > py0).long()
        return Testbed(name, mix, cost, x, labels, cond, label, n_classes, info, cfg_lambda=lam)
    x, _ = mix.sample(n_data, gen)
    return Testbed(name, mix, cost, x, labels, cond, label, n_classes, info)


def _held_out(name: str) -> tuple:
    if name == "grid9_halfplane":
        n = torch.tensor([0.8, 0.6])
        cost: Cost = FunctionCost(lambda x: 3.0 * torch.relu(x @ n.to(x.dtype) - 0.3), "halfplane")
        return _grid9(), cost, "c(x) = 3 relu(<(0.8, 0.6), x> - 0.3): a soft half-plane barrier over a 3x3 grid"
    if name == "moons_quadratic":
        center = torch.tensor([1.0, -0.4])
        cost = FunctionCost(lambda x: 1.5 * ((x - center.to(x.dtype)) ** 2).sum(1), "quadratic_tilt")
        return TwoMoons(), cost, "c(x) = 1.5 |x - (1, -0.4)|^2 on two moons: a quadratic tilt of a curved density"
    if name == "gmm16d_fullcov_box":
        mix = _fullcov_mixture(16, 6, seed=3)
        cost = FunctionCost(lambda x: 10.0 * (torch.relu(x[:, :3].abs() - 0.6) ** 2).sum(1), "soft_box")
        return mix, cost, "c(x) = 10 sum_{i<3} relu(|x_i| - 0.6)^2 on a 16-D full-covariance mixture"
    if name == "gauss8d_linear":
        g = torch.Generator().manual_seed(4)
        mix = GaussianMixture(0.5 * torch.randn(1, 8, generator=g, dtype=torch.float64),
                              (0.3 + 0.7 * torch.rand(1, 8, generator=g, dtype=torch.float64)),
                              torch.ones(1, dtype=torch.float64))
        d = torch.randn(8, generator=g)
        cost = LinearCost(2.0 * d / d.norm())
        return mix, cost, "c(x) = <a, x>, |a| = 2 on ONE anisotropic 8-D Gaussian: the tilt only shifts the mean"
    if name == "ring_band":
        cost = FunctionCost(lambda x: 200.0 * torch.relu(x[:, 1].abs() - 0.3) ** 2, "band")
        return _ring(8, 1.6, 0.25), cost, "c(x) = 200 relu(|x_1| - 0.3)^2: a stiff band across the ring"
    raise InvalidOptionError(f"unknown held-out testbed {name!r}")


def _cache_key(testbed: Testbed, cfg: TrainConfig) -> str:
    blob = json.dumps({"name": testbed.name.split("_")[0] + ("_class" if testbed.n_classes else ""),
                       "data": hashlib.sha1(testbed.data.numpy().tobytes()).hexdigest()[:12],
                       **asdict(cfg)}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def train_velocity(testbed: Testbed, cfg: TrainConfig | None = None, cache_dir: Path | str | None = DEFAULT_CACHE,
                   log: Callable[[str], None] | None = None) -> MLPVelocity:
    """Train (or load from the cache) an MLP flow model of the testbed's data. Seeded."""
    cfg = cfg or TrainConfig()
    model = MLPVelocity(testbed.dim, cfg.hidden, cfg.depth, n_classes=testbed.n_classes)
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{testbed.name.split('_')[0]}{'_class' if testbed.n_classes else ''}-{_cache_key(testbed, cfg)}.safetensors"
        if path.exists():
            from safetensors.torch import load_file
            model.load_state_dict(load_file(str(path)))
            return _freeze(model)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.05)
    data, n = testbed.data, testbed.data.shape[0]
    start = time.perf_counter()
    for step in range(cfg.steps):
        idx = torch.randint(0, n, (cfg.batch,), generator=gen)
        x1 = data[idx]
        x0 = torch.randn(x1.shape, generator=gen)
        t = torch.rand(cfg.batch, generator=gen)
        xt = (1 - t[:, None]) * x0 + t[:, None] * x1
        label = None
        if testbed.n_classes:
            label = testbed.labels[idx].clone()
            label[torch.rand(cfg.batch, generator=gen) < cfg.p_drop] = testbed.n_classes
        loss = ((model(xt, t, label) - (x1 - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if log and (step + 1) % 1000 == 0:
            log(f"  {testbed.name}: step {step + 1}/{cfg.steps} loss {loss.item():.4f} "
                f"({time.perf_counter() - start:.1f}s)")
    if path is not None:
        from safetensors.torch import save_file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(model.state_dict(), str(tmp))
        tmp.replace(path)
    return _freeze(model)


def _freeze(model: MLPVelocity) -> MLPVelocity:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
