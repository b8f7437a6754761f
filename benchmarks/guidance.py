"""Guidance benchmark on the exact testbed: every method side by side over a scale sweep.

For each testbed (a Gaussian mixture ``p`` and a cost ``c``, target ``p exp(-c) / Z`` sampled
exactly by importance resampling) and each method/config, sample with a scale sweep from the
same noise and measure sliced Wasserstein (SWD) and MMD to the target. Per method: accuracy
(the best distance over the sweep), stability (the worst, and the width in decades of the scale
range within 10% of the best), and overhead (wall time and network evaluations relative to
unguided sampling). Writes ``benchmarks/results/guidance.json`` (sections ``exact``,
``overhead`` and friends; other sections of an existing file are kept), ``guidance.md`` and one
PNG per testbed.

    .venv/bin/python benchmarks/guidance.py                  # ~5-10 min on 2 CPU cores
    .venv/bin/python benchmarks/guidance.py --testbeds gmm2d_linear --model oracle
    .venv/bin/python benchmarks/guidance.py --configs none particles4   # adds (replaces) these configs' rows
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import guidance  # noqa: E402
from guidance import distances  # noqa: E402
from guidance.testbed import (TESTBEDS, MLPVelocity, Testbed, importance_resample,  # noqa: E402
                              make_testbed, train_velocity)

# name -> (method, options). "s2" is filled with the testbed's data variance where the Sigma_t
# estimate needs it. "coupled" is the library default (diagonal Sigma_t, linesearch step);
# coupled_jacobian_ls the Tweedie Sigma_t with the same step; the schedule/window/noise variants change ONE thing
# of DESIGN.md's linear step (coupled_linear).
_LIN = {"step": "linear"}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "coupled": ("coupled", {}),                                           # default: diagonal Sigma_t, linesearch
    "coupled_jacobian_ls": ("coupled", {"sigma": "jacobian"}),            # Jacobian Sigma_t, linesearch (1 backward/step)
    "coupled_renoise1": ("coupled", {"sigma": "jacobian", "renoise": 1.0}),  # + DDIM-eta fresh noise (eta 1)
    "coupled_linear": ("coupled", {**_LIN, "sigma": "independent"}),      # DESIGN.md's step
    "coupled_identity": ("coupled", {**_LIN, "sigma": "identity"}),       # Sigma_t = 1
    "coupled_const0.25": ("coupled", {**_LIN, "sigma": 0.25}),            # Sigma_t = 0.25
    "coupled_jacobian": ("coupled", {**_LIN, "sigma": "jacobian"}),       # Tweedie Sigma_t, plain linear step
    "coupled_jacobian_trust": ("coupled", {"sigma": "jacobian", "step": "trust", "radius": 0.5}),
    "coupled_prox5": ("coupled", {"step": "prox", "inner_steps": 5}),     # converged prox
    "coupled_trust": ("coupled", {"step": "trust", "radius": 0.5, "sigma": "independent"}),  # |step| <= 0.5
    "coupled_sampled": ("coupled", {"step": "sampled", "n_particles": 32}),  # tilted-posterior IS
    "coupled_tilted_is": ("coupled", {"step": "tilted_is", "n_particles": 32}),  # IS around the line-search endpoint
    "coupled_renoise0.6": ("coupled", {"sigma": "jacobian", "renoise": 0.6}),  # Jacobian ls + DDIM-eta 0.6
    "coupled_diag_renoise1": ("coupled", {"renoise": 1.0}),              # the default step + DDIM-eta 1 (no backward)
    "coupled_diag_renoise0.6": ("coupled", {"renoise": 0.6}),            # the default step + DDIM-eta 0.6
    # coupled-guided DDIM-eta paths, one kept by importance weights that undo the guidance (GuidedParticles)
    "guided_particles4": ("guided_particles", {"n_particles": 4}),                         # eta 1
    "guided_particles4_eta0.5": ("guided_particles", {"n_particles": 4, "renoise": 0.5}),
    "guided_particles4_eta0.3": ("guided_particles", {"n_particles": 4, "renoise": 0.3}),
    "guided_particles16_eta0.5": ("guided_particles", {"n_particles": 16, "renoise": 0.5}),
    "guided_particles16_eta0.3": ("guided_particles", {"n_particles": 16, "renoise": 0.3}),
    "coupled_sampled_renoise0.6": ("coupled", {"step": "sampled", "n_particles": 32, "renoise": 0.6}),
    "coupled_late": ("coupled", {**_LIN, "sigma": "independent", "t_start": 0.3}),  # guidance only for t >= 0.3
    "coupled_early": ("coupled", {**_LIN, "sigma": "independent", "t_end": 0.7}),   # guidance only for t < 0.7
    "coupled_ramp": ("coupled", {**_LIN, "sigma": "independent", "schedule": "linear"}),  # weight grows with t
    "coupled_fixed_noise": ("coupled", {**_LIN, "sigma": "independent", "noise_endpoint": "fixed"}),
    "velocity_gradient": ("velocity_gradient", {}),
    "state_gradient": ("state_gradient", {}),
    "pnp_renoise": ("pnp_renoise", {"sigma": "independent"}),              # linear endpoint step, fresh noise
    "particles4": ("particles", {"n_particles": 4}),                       # 4 unguided samples, one kept by exp(-w c)
    "particles16": ("particles", {"n_particles": 16}),
    "mc": ("mc", {}),
    "cfg": ("cfg", {}),
}
SECTIONS = {"mlp": "exact", "oracle": "exact_oracle"}  # JSON section per flow model


@dataclass
class Args:
    testbeds: tuple[str, ...] = TESTBEDS
    """testbeds to run (guidance.testbed.TESTBEDS)"""
    configs: tuple[str, ...] = tuple(CONFIGS)
    """method configs to run (names of CONFIGS)"""
    scales: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 100.0)
    """guidance scales swept (log-spaced, three decades)"""
    model: str = "mlp"
    """flow model: "mlp" (trained here, cached under runs/), "oracle" (exact GMM velocity), "both\""""
    n_samples: int = 4000
    """guided samples per (method, scale); also the exact target sample size"""
    n_mmd: int = 2000
    """samples used by MMD (quadratic cost)"""
    mc_data: int = 4096
    """training points the mc reference reads per step (its cost is O(samples x mc_data))"""
    big_batch: int = 256
    """batch for the large-network overhead timing"""
    n_steps: int = 10
    """Euler steps (the project default)"""
    overhead_repeats: int = 5
    """timing repeats for the overhead table, round-robin over configs (minimum is reported)"""
    seed: int = 0
    """seeds the data, the noise x0, the target resampling and the projections"""
    threads: int = 1
    """torch CPU threads (1 is fastest on a shared 2-core machine)"""
    out_dir: Path = ROOT / "benchmarks" / "results"
    """where guidance.json, guidance.md and the PNGs go"""
    plots: bool = True
    """write PNG plots"""
    overhead: bool = True
    """measure wall time / NFE overhead (8-D testbed MLP and a large network)"""


def build(config: str, tb: Testbed, scale: float, mc_data: int = 4096) -> guidance.Guidance:
    method, options = CONFIGS[config]
    options = dict(options)
    if method in ("coupled", "pnp_renoise", "guided_particles"):
        options.setdefault("s2", tb.s2)
    if method == "mc":
        options["data"] = tb.data[:mc_data]
    if method == "cfg":
        return guidance.make("cfg", scale=scale, **options)
    return guidance.make(method, cost=tb.cost, scale=scale, **options)


def applicable(config: str, tb: Testbed) -> bool:
    return CONFIGS[config][0] != "cfg" or tb.n_classes > 0


def load_model(tb: Testbed, kind: str, log) -> torch.nn.Module:
    """The exact mixture velocity ("oracle") or the trained (cached) MLP ("mlp")."""
    return tb.oracle() if kind == "oracle" else train_velocity(tb, log=log)


def run_testbed(tb: Testbed, model: torch.nn.Module, args: Args, log) -> tuple[dict, dict]:
    """Distances per config per scale, and reference numbers (floor, unguided, ESS).

    ``swd``/``mmd`` compare with the testbed's target ``p exp(-c)``; ``swd_matched`` with
    ``p exp(-w c)`` at the run's own scale w (for cfg: ``p exp(-(w / lambda) c)``), which says
    whether a method is faithful at every scale rather than tuned at one."""
    target, ess = tb.exact_target(args.n_samples, seed=args.seed)
    target2, _ = tb.exact_target(args.n_samples, seed=args.seed + 1)
    p_samples, _ = tb.mixture.sample(args.n_samples, torch.Generator().manual_seed(args.seed + 7))
    bw = distances.median_bandwidth(target)
    m = args.n_mmd
    pool, _ = tb.mixture.sample(400_000, torch.Generator().manual_seed(args.seed + 11))
    with torch.no_grad():
        pool_cost = tb.cost(pool).double()
    matched: dict[float, tuple[torch.Tensor, float]] = {}

    def matched_target(power: float) -> tuple[torch.Tensor, float]:
        if power not in matched:
            gen = torch.Generator().manual_seed(args.seed + 13)
            matched[power] = importance_resample(pool, -power * pool_cost, args.n_samples, gen)
        return matched[power]

    def dist(x: torch.Tensor, power: float | None = None) -> dict[str, float | None]:
        if not bool(torch.isfinite(x).all()):
            return {"swd": None, "mmd": None, "swd_matched": None}
        out = {"swd": distances.sliced_wasserstein(x, target, seed=args.seed),
               "mmd": distances.mmd(x[:m], target[:m], bw)}
        if power is not None:
            tgt, ess_w = matched_target(power)
            out["swd_matched"] = distances.sliced_wasserstein(x, tgt, seed=args.seed)
            out["ess_matched"] = ess_w
        return out

    x0 = torch.randn(args.n_samples, tb.dim, generator=torch.Generator().manual_seed(args.seed + 3))
    uncond = tb.unconditional_velocity(model)
    unguided = guidance.sample(uncond, x0, args.n_steps)
    ref = {"ess": ess, "floor": dist(target2), "p_vs_target": dist(p_samples),
           "unguided": dist(unguided), "mmd_bandwidth": bw, "cost": tb.info.get("cost", "")}
    out: dict[str, dict] = {}
    for config in args.configs:
        if not applicable(config, tb):
            continue
        out[config] = {}
        start = time.perf_counter()
        is_cfg = CONFIGS[config][0] == "cfg"
        velocity = tb.velocity(model) if is_cfg else uncond
        for scale in args.scales:
            power = scale / tb.cfg_lambda if is_cfg else scale
            if config == "none":  # the same samples at every scale: only the matched target moves
                tgt, ess_w = matched_target(power)
                out[config][f"{scale:g}"] = {**ref["unguided"], "ess_matched": ess_w,
                                             "swd_matched": distances.sliced_wasserstein(unguided, tgt, seed=args.seed),
                                             "n_nonfinite_grad": 0, "n_nonfinite_output": 0}
                continue
            with torch.no_grad():  # as a policy calls it; methods that need grad enable it
                x, st = guidance.sample(velocity, x0, args.n_steps,
                                        guide=build(config, tb, scale, args.mc_data), return_stats=True)
            d = dist(x, power) if not st.n_exploded else {"swd": None, "mmd": None, "swd_matched": None}
            d["n_exploded"] = st.n_exploded
            d["n_nonfinite_grad"] = st.n_nonfinite_grad
            d["n_nonfinite_output"] = st.n_nonfinite_output
            out[config][f"{scale:g}"] = d
        best = min((v["swd"] for v in out[config].values() if v["swd"] is not None), default=float("nan"))
        log(f"  {tb.name:15s} {config:20s} best SWD {best:.3f}  ({time.perf_counter() - start:.1f}s)")
    return out, ref


def summarize(curve: dict[str, dict], key: str) -> dict[str, Any]:
    """Accuracy (best), stability (worst; width in decades of the contiguous scale range around
    the best whose distance is within 10% of it)."""
    scales = sorted(curve, key=float)
    vals = [curve[s][key] for s in scales]
    finite = [v for v in vals if v is not None]
    if not finite:
        return {"best": None, "best_scale": None, "worst": None, "worst_scale": None,
                "width_decades": 0.0, "diverged_scales": [float(s) for s in scales]}
    ib = min(range(len(vals)), key=lambda i: math.inf if vals[i] is None else vals[i])
    lo = hi = ib
    ok = [v is not None and v <= 1.1 * vals[ib] for v in vals]
    while lo > 0 and ok[lo - 1]:
        lo -= 1
    while hi < len(vals) - 1 and ok[hi + 1]:
        hi += 1
    diverged = [float(s) for s, v in zip(scales, vals) if v is None]
    iw = max(range(len(vals)), key=lambda i: math.inf if vals[i] is None else vals[i])
    return {"best": vals[ib], "best_scale": float(scales[ib]),
            "worst": vals[iw] if not diverged else None, "worst_scale": float(scales[iw]),
            "width_decades": math.log10(float(scales[hi]) / float(scales[lo])),
            "diverged_scales": diverged}


def matched_summary(curve: dict[str, dict], min_ess: float = 1000.0) -> dict[str, Any]:
    """Faithfulness across scales: median and worst SWD to p exp(-w c) over the scales whose
    matched target is trustworthy (importance-pool ESS >= min_ess)."""
    vals = [v.get("swd_matched") for v in curve.values() if v.get("ess_matched", 0) >= min_ess]
    used = [s for s, v in curve.items() if v.get("ess_matched", 0) >= min_ess]
    if any(v is None for v in vals):
        return {"median": None, "worst": None, "scales": [float(s) for s in used]}
    vals = sorted(vals)
    return {"median": vals[len(vals) // 2] if vals else None, "worst": vals[-1] if vals else None,
            "scales": [float(s) for s in used]}


def measure_overhead(tb: Testbed, model: torch.nn.Module, args: Args, configs: tuple[str, ...],
                     batch: int) -> dict:
    """Wall time and NFE of each config at scale 2, relative to unguided. Repeats go round-robin
    over the configs (load spikes on a shared machine hit all of them) and the minimum is kept."""
    x0 = torch.randn(batch, tb.dim, generator=torch.Generator().manual_seed(args.seed + 3))
    configs = tuple(c for c in configs if applicable(c, tb))
    times: dict[str, list[float]] = {c: [] for c in configs}
    stats: dict[str, Any] = {}
    for _ in range(args.overhead_repeats):
        for config in configs:
            velocity = tb.velocity(model) if CONFIGS[config][0] == "cfg" else tb.unconditional_velocity(model)
            with torch.no_grad():
                _, st = guidance.sample(velocity, x0, args.n_steps, guide=build(config, tb, 2.0, args.mc_data),
                                        return_stats=True)
            times[config].append(st.wall_time_s)
            stats[config] = st
    rows = {c: {"time_s": min(times[c]), "nfe": stats[c].nfe, "n_backward": stats[c].n_backward,
                "n_cost_grads": stats[c].n_cost_grads, "n_cost_evals": stats[c].n_cost_evals}
            for c in configs}
    base = rows["none"]
    for r in rows.values():
        r["time_ratio"] = r["time_s"] / base["time_s"]
        r["nfe_ratio"] = r["nfe"] / base["nfe"]
    return rows


def fmt(v: float | None, nd: int = 3) -> str:
    return "diverged" if v is None else f"{v:.{nd}f}"


def write_markdown(path: Path, data: dict) -> None:
    """The markdown report, from the merged JSON (every section any run has written)."""
    lines = ["# Guidance on the exact testbed", "",
             "Target `p exp(-c)/Z` by importance resampling; distances are sliced Wasserstein-2 (SWD) "
             "and RBF MMD (median-heuristic bandwidth of the target) to it. Best = accuracy, worst and "
             "width (decades of scale within 10% of the best) = stability; `diverged` = non-finite "
             "samples. `mc` needs the training data at sampling time: it is the accuracy reference, not "
             "a competitor. The last column compares each run with the exact target at its own scale, "
             "`p exp(-w c)` (for cfg `p exp(-(w/lambda) c)`), over the scales whose importance pool keeps "
             "ESS >= 1000: low means faithful at every scale, not only tuned at one. Section `exact`: "
             "the trained MLP flow model; `exact_oracle`: the exact mixture velocity (no model error).", ""]
    summary, refs = data.get("exact_summary", {}), data.get("exact_reference", {})
    for section, per_tb in summary.items():
        meta = data.get("exact_meta", {}).get(section, {})
        lines += [f"# Section `{section}`", "",
                  f"Scales {meta.get('scales')}, {meta.get('n_samples')} samples, {meta.get('n_steps')} "
                  f"Euler steps, seed {meta.get('seed')}, mc reads {meta.get('mc_data')} training points, "
                  f"run took {meta.get('wall_s', 0):.0f} s.", ""]
        for tbname, rows in per_tb.items():
            ref = refs[section][tbname]
            lines += [f"## {tbname} ({section})", "",
                      f"{ref['cost']}. ESS of the importance pool {ref['ess']:.0f}. Noise floor (two exact "
                      f"target draws): SWD {fmt(ref['floor']['swd'])}, MMD {fmt(ref['floor']['mmd'], 4)}; "
                      f"unguided: SWD {fmt(ref['unguided']['swd'])}, MMD {fmt(ref['unguided']['mmd'], 4)}.", "",
                      "| method | best SWD (scale) | worst SWD (scale) | width | best MMD (scale) | worst MMD | width "
                      "| SWD to p exp(-w c): median / worst |",
                      "|---|---|---|---|---|---|---|---|"]
            order = sorted(rows, key=lambda k: (math.inf if rows[k]["swd"]["best"] is None else rows[k]["swd"]["best"]))
            for name in order:
                s, m = rows[name]["swd"], rows[name]["mmd"]
                sc = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731  (None: diverged at every scale)
                lines.append(f"| {name} | {fmt(s['best'])} ({sc(s['best_scale'])}) | {fmt(s['worst'])} "
                             f"({sc(s['worst_scale'])}) | {s['width_decades']:.2f} | {fmt(m['best'], 4)} "
                             f"({sc(m['best_scale'])}) | {fmt(m['worst'], 4)} | {m['width_decades']:.2f} | "
                             f"{fmt(rows[name]['swd_matched']['median'])} / {fmt(rows[name]['swd_matched']['worst'])} |")
            lines.append("")
        lines += ["## Rankings (computed from the numbers above)", ""] + rankings({section: per_tb}) + [""]
        check = default_check({section: per_tb}).get(section, {})
        if check:
            lines += ["## The default (`coupled`) against the best of its class (all but mc and none)", "",
                      "| testbed | default best SWD | best of class | ratio | diverged scales | within 10%, stable |",
                      "|---|---|---|---|---|---|"]
            for tbname, r in check.items():
                ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
                lines.append(f"| {tbname} | {fmt(r['default_best_swd'])} | `{r['class_best']}` {fmt(r['class_best_swd'])} "
                             f"| {ratio} | {r['diverged_scales'] or 'none'} | {'yes' if r['pass'] else 'NO'} |")
            lines.append("")
    if "overhead" in data:
        om = data.get("overhead_meta", {})
        big = data.get("overhead_large_net", {})
        lines += [f"# Overhead relative to unguided sampling (scale {om.get('scale')}, min of "
                  f"{om.get('repeats')} repeats, {om.get('testbed')})", "",
                  f"Network: {om.get('net')}. Large network: {om.get('large_net')}.", "",
                  "| method | time ratio | NFE ratio | backward passes | cost gradients | cost evaluations "
                  "| time ratio, large net |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in data["overhead"].items():
            b = big.get(name, {}).get("time_ratio")
            lines.append(f"| {name} | {r['time_ratio']:.2f} | {r['nfe_ratio']:.2f} | {r['n_backward']} | "
                         f"{r['n_cost_grads']} | {r.get('n_cost_evals', 0)} | {'' if b is None else f'{b:.2f}'} |")
    path.write_text("\n".join(lines) + "\n")


def default_check(summary: dict, default: str = "coupled") -> dict:
    """The issue's bar for the library default, per section and testbed: its best SWD within 10%
    of the best method of its cost class (every method but mc and none) and no diverged scale."""
    out: dict = {}
    for section, per_tb in summary.items():
        for tbname, rows in per_tb.items():
            if default not in rows:
                continue
            comp = {n: r["swd"]["best"] for n, r in rows.items() if n not in ("mc", "none") and r["swd"]["best"] is not None}
            best = min(comp, key=comp.get) if comp else None  # None: every method diverged at every scale
            mine = rows[default]["swd"]["best"]
            ratio = None if mine is None or best is None else mine / comp[best]
            diverged = rows[default]["swd"]["diverged_scales"]
            out.setdefault(section, {})[tbname] = {
                "default_best_swd": mine, "class_best": best, "class_best_swd": comp.get(best), "ratio": ratio,
                "diverged_scales": diverged, "methods_compared": len(comp),
                "pass": ratio is not None and ratio <= 1.1 and not diverged}
    return out


def rankings(summary: dict) -> list[str]:
    """Which coupled variant and which method the numbers support, per testbed and on average."""
    out = []
    for section, per_tb in summary.items():
        ranks: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        for tbname, rows in per_tb.items():
            def key(n, kind):
                v = rows[n]["swd"][kind]
                return math.inf if v is None else v
            competitors = [n for n in rows if n not in ("mc", "none")]
            best = min(competitors, key=lambda n: key(n, "best"))
            stable = min(competitors, key=lambda n: key(n, "worst"))
            variants = [n for n in competitors if n.startswith("coupled")]
            bv = min(variants, key=lambda n: key(n, "best"))
            out.append(f"- {section}/{tbname}: most accurate (best SWD, mc excluded) `{best}` "
                       f"{fmt(rows[best]['swd']['best'])}; most stable (lowest worst SWD) `{stable}` "
                       f"{fmt(rows[stable]['swd']['worst'])}; best coupled variant `{bv}`; mc reference "
                       f"{fmt(rows['mc']['swd']['best']) if 'mc' in rows else 'n/a'}.")
            for kind in ("best", "worst"):
                ordered = sorted(competitors, key=lambda n: key(n, kind))
                for i, n in enumerate(ordered):
                    ranks.setdefault(f"{kind}:{n}", []).append(i + 1)
                    ranks.setdefault(f"both:{n}", []).append((i + 1) / 2)
            ordered = sorted(competitors, key=lambda n: math.inf if rows[n]["swd_matched"]["median"] is None
                             else rows[n]["swd_matched"]["median"])
            for i, n in enumerate(ordered):
                ranks.setdefault(f"matched:{n}", []).append(i + 1)
            if math.isinf(key(best, "best")):  # every method diverged here: no ratio to take
                continue
            for n in competitors:  # a rank hides how far behind: the ratio to the best says it
                ratios.setdefault(n, []).append(key(n, "best") / key(best, "best"))
        n_tb = max((len(r) for r in ratios.values()), default=0)
        full = {n: r for n, r in ratios.items() if len(r) == n_tb}
        top = sorted(full, key=lambda n: sum(full[n]))[:8]
        top += [n for n in ("coupled",) if n in full and n not in top]  # the default, wherever it lands
        skipped = f" ({len(per_tb) - n_tb} where every method diverged left out)" if n_tb < len(per_tb) else ""
        out.append(f"- {section}: mean ratio of best SWD to the best method of the testbed, mc excluded, over "
                   f"the {n_tb} testbeds{skipped} (within 10% of the best on how many): "
                   + ", ".join(f"`{n}` {sum(full[n]) / n_tb:.2f}x ({sum(r <= 1.1 for r in full[n])})" for n in top))
        for kind, label, n_per in (("best", "accuracy (best SWD)", 1), ("worst", "stability (worst SWD)", 1),
                                   ("both", "accuracy and stability (mean of the two ranks)", 2),
                                   ("matched", "faithfulness (median SWD to p exp(-w c))", 1)):
            mean = {k.split(":", 1)[1]: sum(v) / (len(v) / n_per) for k, v in ranks.items()
                    if k.startswith(kind + ":") and len(v) == n_tb * n_per}  # run on every testbed
            top = sorted(mean, key=mean.get)[:6]
            out.append(f"- {section}: mean rank by {label}, mc excluded, over the {n_tb} testbeds: "
                       + ", ".join(f"`{n}` {mean[n]:.1f}" for n in top))
    return out


def plot(path: Path, tbname: str, curves: dict, ref: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex=True)
    groups = [[n for n in curves if not n.startswith("coupled_")],
              [n for n in curves if n.startswith("coupled")]]
    for row, names in enumerate(groups):
        for col, key in enumerate(("swd", "mmd")):
            ax = axes[row, col]
            cmap = plt.get_cmap("tab20")
            for i, n in enumerate(names):
                sc = sorted(curves[n], key=float)
                xs = [float(s) for s in sc if curves[n][s][key] is not None]
                ys = [curves[n][s][key] for s in sc if curves[n][s][key] is not None]
                style = "--" if n in ("none", "mc") else "-"
                ax.plot(xs, ys, style, marker="o", ms=3, color="k" if n == "coupled" else cmap(i % 20),
                        label=n, lw=2.2 if n == "coupled" else 1.2)
            ax.axhline(ref["floor"][key], color="k", lw=0.8, ls=":", label="noise floor")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{tbname}: {key.upper()} to exact target "
                         f"({'methods' if row == 0 else 'coupled variants'})", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            if col == 1:
                ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    for ax in axes[1]:
        ax.set_xlabel("guidance scale w")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, updates: dict[tuple[str, ...], Any]) -> dict:
    """Merge ``{key path: value}`` into an existing results file, keeping every other section
    (collision, adroit, images, other testbeds); atomic. Returns the merged data."""
    data = json.loads(path.read_text()) if path.exists() else {}
    for keys, value in updates.items():
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False))
    tmp.replace(path)
    return data


def main(args: Args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or "none" not in args.configs:
        raise SystemExit(f"configs must include 'none' and come from: {', '.join(CONFIGS)} (got {unknown})")
    if args.model not in ("mlp", "oracle", "both"):
        raise SystemExit(f"--model must be mlp, oracle or both; got {args.model}")
    log = lambda s: print(s, flush=True)  # noqa: E731
    start = time.perf_counter()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    kinds = ["mlp", "oracle"] if args.model == "both" else [args.model]
    updates: dict[tuple[str, ...], Any] = {}
    plots: list[tuple[Path, str, str, dict]] = []
    for kind in kinds:
        section = SECTIONS[kind]
        for name in args.testbeds:
            tb = make_testbed(name, seed=args.seed)
            if kind == "oracle" and not tb.has_oracle:
                log(f"[{section}] {name}: skipped (no closed-form velocity)")
                continue
            log(f"[{section}] {name}: {tb.info.get('cost', '')}")
            curves, ref = run_testbed(tb, load_model(tb, kind, log), args, log)
            # per config: a run with some --configs adds them to (or replaces them in) the file
            for n, c in curves.items():
                updates[(section, name, n)] = c
                updates[("exact_summary", section, name, n)] = {
                    "swd": summarize(c, "swd"), "mmd": summarize(c, "mmd"), "swd_matched": matched_summary(c)}
            updates[("exact_reference", section, name)] = ref
            if args.plots:
                plots.append((args.out_dir / f"guidance_{name}{'' if kind == 'mlp' else '_' + kind}.png", name,
                              section, ref))
    meta = {"scales": list(args.scales), "n_samples": args.n_samples, "n_mmd": args.n_mmd,
            "n_steps": args.n_steps, "seed": args.seed, "threads": args.threads, "mc_data": args.mc_data,
            "testbeds": list(args.testbeds),
            "configs": {k: [CONFIGS[k][0], CONFIGS[k][1]] for k in args.configs}}
    if args.overhead:
        # the 8-D testbed's trained MLP, and a large random-init MLP where the network dominates
        otb = make_testbed("gmm8d_linear", seed=args.seed)
        ocfg = tuple(c for c in args.configs if applicable(c, otb))
        log("[overhead] gmm8d_linear")
        for c, row in measure_overhead(otb, train_velocity(otb, log=log), args, ocfg, args.n_samples).items():
            updates[("overhead", c)] = row  # ratios against this run's unguided time
        torch.manual_seed(args.seed)
        big = MLPVelocity(otb.dim, hidden=1024, depth=6).eval().requires_grad_(False)
        for c, row in measure_overhead(otb, big, args, ocfg, args.big_batch).items():
            updates[("overhead_large_net", c)] = row
        updates[("overhead_meta",)] = {
            "testbed": "gmm8d_linear", "scale": 2.0, "repeats": args.overhead_repeats,
            "net": f"testbed MLP 128x3, batch {args.n_samples}, 8-D",
            "large_net": f"random-init MLP 1024x6 ({sum(p.numel() for p in big.parameters())} params), "
                         f"batch {args.big_batch}"}
    meta["wall_s"] = time.perf_counter() - start
    for kind in kinds:
        for k, v in meta.items():  # the configs merge like the curves
            if k == "configs":
                for c, spec in v.items():
                    updates[("exact_meta", SECTIONS[kind], "configs", c)] = spec
            else:
                updates[("exact_meta", SECTIONS[kind], k)] = v
    data = write_json(args.out_dir / "guidance.json", updates)
    data = write_json(args.out_dir / "guidance.json", {("default_check",): default_check(data.get("exact_summary", {}))})
    write_markdown(args.out_dir / "guidance.md", data)
    for path, name, section, ref in plots:  # every config the file holds, not only this run's
        plot(path, name, data[section][name], ref)
    log(f"done in {meta['wall_s']:.0f}s -> {args.out_dir / 'guidance.json'}")


if __name__ == "__main__":
    main(tyro.cli(Args))
