"""Image inverse problems on a digits flow model: every guidance method over a scale sweep.

A small UNet flow model (``guidance.image_model``) is trained on scikit-learn's digits at
16x16 (cached under ``.assets/image_flow``), then each held-out test image is measured
(inpainting of a half or a centre box, 4x super-resolution, Gaussian deblurring, each with
Gaussian noise ``sigma``) and reconstructed by guided sampling from the SAME noise for every
method and scale. Per task and method: the best mean PSNR over the sweep and the scale that gave
it, SSIM (Wang et al. 2004) there, the best SSIM, the measurement residual, how wide the range
of scales within 1 dB of the best is (stability), and wall time / network evaluations relative
to unguided sampling. ``none`` (unconditional samples) is the floor; ``naive`` is no model at
all (mean fill, bilinear upsampling, the blurred image). The scale is picked on the same test
images it is reported on (as for every method alike).

Writes the ``images`` and ``images_meta`` sections of ``benchmarks/results/guidance.json``
(other sections are kept), ``guidance_images.md`` and ``guidance_images.png``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/guidance_images.py          # ~5-8 min, 1 core
    .venv/bin/python benchmarks/guidance_images.py --tasks sr4 --methods none coupled --no-mc
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import tyro  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import guidance  # noqa: E402
from guidance import costs  # noqa: E402
from guidance.image_model import (ImageFlowConfig, load_digits_split, psnr, ssim,  # noqa: E402
                                  train_image_flow, training_info)
from guidance.operators import Blur  # noqa: E402

TASKS = ("inpaint_half", "inpaint_center", "sr4", "deblur")
# name -> (library method, options). "s2" (per-pixel data variance) is filled in for the
# Sigma_t estimate of coupled/pnp_renoise; "project" only exists for inpainting.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "coupled": ("coupled", {}),                                # library default: per-pixel Sigma_t, linesearch
    "coupled_jacobian_ls": ("coupled", {"sigma": "jacobian"}),  # Jacobian Sigma_t, linesearch (1 backward)
    "coupled_project": ("coupled", {"sigma": "independent", "project": True}),  # + exact projection on observed pixels
    "coupled_linear": ("coupled", {"step": "linear"}),         # DESIGN.md's plain linear step
    "coupled_prox5": ("coupled", {"step": "prox", "inner_steps": 5}),  # ~converged prox: exact Gaussian tilt
    "coupled_jacobian": ("coupled", {"step": "linear", "sigma": "jacobian"}),  # Tweedie Sigma_t, 1 backward
    "velocity_gradient": ("velocity_gradient", {}),            # DPS-like, backprop through the net
    "state_gradient": ("state_gradient", {}),
    "pnp_renoise": ("pnp_renoise", {}),                        # linear endpoint step, fresh noise
    "mc": ("mc", {}),                                          # reference: reads the training set
}


@dataclass
class Args:
    tasks: tuple[str, ...] = TASKS
    """inverse problems to run (of TASKS)"""
    methods: tuple[str, ...] = tuple(CONFIGS)
    """method configs to run (names of CONFIGS; 'none' is always run)"""
    scales: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
    """guidance scales swept (six decades: gradient steps peak near 0.01-1, the safeguarded
    linesearch/prox steps only saturate at large scales)"""
    mc_scales: tuple[float, ...] = (1e-3, 1e-2, 0.1, 1.0, 10.0)
    """scales for the mc reference (it runs image by image, ~10x the cost; its tilt is already
    degenerate, ESS ~1, from about 0.01 up)"""
    n_images: int = 64
    """held-out test digits per task"""
    noise: float = 0.05
    """measurement noise std in [-1, 1] pixel units (the cost uses the same sigma)"""
    blur_sigma: float = 1.5
    """Gaussian blur std in pixels (of the 16x16 image) for the deblurring task"""
    n_steps: int = 10
    """Euler steps (the project default)"""
    timing_repeats: int = 3
    """wall-time repeats at each method's best scale, round-robin with unguided (min kept)"""
    n_show: int = 3
    """test images per task in the PNG grid"""
    size: int = 16
    """image side"""
    train_steps: int = ImageFlowConfig.steps
    """flow-model training steps (the trained weights are cached by config)"""
    seed: int = 0
    """seeds training, the split, the measurement noise and the sampling noise"""
    threads: int = 1
    """torch CPU threads"""
    out_dir: Path = ROOT / "benchmarks" / "results"
    """where guidance.json, guidance_images.md and guidance_images.png go"""


# ---- tasks -----------------------------------------------------------------------------------

@dataclass
class Task:
    name: str
    description: str
    cost: costs.MeasurementCost
    y: torch.Tensor            # the measurement (B, ...)
    shown: torch.Tensor        # the measurement drawn as an image (B, 1, H, W)
    naive: torch.Tensor        # a reconstruction without any model (B, 1, H, W)


def make_task(name: str, truth: torch.Tensor, train_mean: torch.Tensor, args: Args) -> Task:
    """Measure ``truth`` (B, 1, H, W) with the task's operator plus seeded Gaussian noise."""
    gen = torch.Generator().manual_seed(args.seed + 100 + TASKS.index(name))
    s, h = args.noise, truth.shape[-1]
    if name.startswith("inpaint"):
        mask = torch.ones(h, h)
        if name == "inpaint_half":
            mask[h // 2:] = 0                                   # bottom half missing
            desc = f"inpainting: bottom half missing ({h // 2}x{h} of {h}x{h} pixels)"
        else:
            q = h // 4
            mask[q:h - q, q:h - q] = 0                          # centre box missing
            desc = f"inpainting: centre {h // 2}x{h // 2} box missing"
        y = mask * (truth + s * torch.randn(truth.shape, generator=gen))
        cost = costs.inpainting(mask, y, sigma=s)
        shown = torch.where(mask.bool(), y, torch.full_like(y, 0.0))
        naive = torch.where(mask.bool(), y, train_mean.expand_as(y))
        return Task(name, desc + f", noise {s}; naive = training-mean fill", cost, y, shown, naive)
    if name == "sr4":
        y = F.avg_pool2d(truth, 4)
        y = y + s * torch.randn(y.shape, generator=gen)
        shown = F.interpolate(y, size=(h, h), mode="nearest")
        naive = F.interpolate(y, size=(h, h), mode="bilinear", align_corners=False)
        return Task(name, f"4x super-resolution ({h // 4}x{h // 4} -> {h}x{h}, average pooling), noise {s}; "
                          "naive = bilinear upsampling", costs.super_resolution(y, 4, sigma=s), y, shown, naive)
    if name == "deblur":
        y = Blur(sigma=args.blur_sigma)(truth)
        y = y + s * torch.randn(y.shape, generator=gen)
        return Task(name, f"Gaussian deblurring (blur std {args.blur_sigma} px), noise {s}; naive = the "
                          "blurred image", costs.deblurring(y, sigma=s, blur_sigma=args.blur_sigma), y, y, y)
    raise SystemExit(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")


def applicable(config: str, task: Task) -> bool:
    return "project" not in CONFIGS[config][1] or task.name.startswith("inpaint")


def build(config: str, task: Task, scale: float, s2: torch.Tensor, data: torch.Tensor,
          cost: costs.Cost | None = None) -> guidance.Guidance:
    method, options = CONFIGS[config]
    options = dict(options)
    cost = task.cost if cost is None else cost
    if method in ("coupled", "pnp_renoise"):
        options.setdefault("s2", s2)
    if options.pop("project", False):
        options["project"] = cost
    if method == "mc":
        options["data"] = data
    return guidance.make(method, cost=cost, scale=scale, **options)


# ---- evaluation ------------------------------------------------------------------------------

def residual_rms(task: Task, x: torch.Tensor) -> float:
    """RMS of ``A(x) - y`` over the measured entries (observed pixels for inpainting)."""
    op = task.cost.operator
    r = op(x) - task.y
    n = float(op.mask.sum()) * x.shape[0] if hasattr(op, "mask") else r.numel()
    return math.sqrt(float((r * r).sum()) / n)


def score(task: Task, truth: torch.Tensor, x: torch.Tensor) -> dict[str, Any]:
    """Mean PSNR/SSIM (outputs clamped to [-1, 1]) and the residual; None where non-finite."""
    bad = int((~torch.isfinite(x.flatten(1)).all(1)).sum())
    if bad:
        return {"psnr": None, "ssim": None, "residual_rms": None, "n_nonfinite": bad}
    xc = x.clamp(-1.0, 1.0)
    p, q = psnr(xc, truth), ssim(xc, truth)
    return {"psnr": float(p.mean()), "psnr_sem": float(p.std() / math.sqrt(len(p))), "ssim": float(q.mean()),
            "residual_rms": residual_rms(task, x), "n_nonfinite": 0}


def run_config(model, config: str, task: Task, x0: torch.Tensor, scale: float, s2: torch.Tensor,
               data: torch.Tensor, n_steps: int) -> tuple[torch.Tensor, guidance.SampleStats]:
    """Guided samples of the whole batch. mc runs one image at a time: it scores the training set
    with the cost once per call, so the cost must hold a single measurement."""
    if CONFIGS[config][0] != "mc":
        with torch.no_grad():
            return guidance.sample(model, x0, n_steps, guide=build(config, task, scale, s2, data),
                                   return_stats=True)
    outs, total = [], None
    for b in range(x0.shape[0]):
        one = costs.MeasurementCost(task.cost.operator, task.y[b:b + 1], task.cost.sigma)
        with torch.no_grad():
            x, st = guidance.sample(model, x0[b:b + 1], n_steps, guide=build(config, task, scale, s2, data, one),
                                    return_stats=True)
        outs.append(x)
        if total is None:
            total = st
        else:
            total.wall_time_s += st.wall_time_s
            total.n_nonfinite_output += st.n_nonfinite_output
    return torch.cat(outs), total


def mc_ess(task: Task, data: torch.Tensor, scale: float) -> float:
    """Median over test images of the effective sample size of mc's tilt ``exp(-w c(x1_j))``
    over the training images: how many training images its guided endpoint really averages."""
    ad = task.cost.operator(data).flatten(1)                        # (N, M)
    y = task.y.flatten(1)                                           # (B, M)
    c = torch.cdist(y.double(), ad.double()) ** 2 / (2 * task.cost.sigma ** 2)
    wts = torch.softmax(-scale * c, dim=1)
    return float((1.0 / (wts * wts).sum(1)).median())


def width_decades(curve: dict[str, dict], best: float, tol_db: float = 1.0) -> float:
    """Decades of the contiguous scale range around the best whose PSNR is within ``tol_db``."""
    scales = sorted(curve, key=float)
    vals = [curve[s]["psnr"] for s in scales]
    ok = [v is not None and v >= best - tol_db for v in vals]
    ib = max(range(len(vals)), key=lambda i: -math.inf if vals[i] is None else vals[i])
    lo = hi = ib
    while lo > 0 and ok[lo - 1]:
        lo -= 1
    while hi < len(vals) - 1 and ok[hi + 1]:
        hi += 1
    return math.log10(float(scales[hi]) / float(scales[lo]))


def summarize(curve: dict[str, dict], time_ratio: float, nfe_ratio: float, stats: guidance.SampleStats) -> dict:
    finite = {s: v for s, v in curve.items() if v["psnr"] is not None}
    if not finite:
        return {"psnr": None, "ssim": None, "scale": None, "diverged_scales": [float(s) for s in curve],
                "curve": curve}
    sb = max(finite, key=lambda s: finite[s]["psnr"])
    ss = max(finite, key=lambda s: finite[s]["ssim"])
    worst = min(finite, key=lambda s: finite[s]["psnr"])
    return {"psnr": finite[sb]["psnr"], "psnr_sem": finite[sb]["psnr_sem"], "ssim": finite[sb]["ssim"],
            "scale": float(sb), "best_ssim": finite[ss]["ssim"], "best_ssim_scale": float(ss),
            "residual_rms": finite[sb]["residual_rms"], "worst_psnr": finite[worst]["psnr"],
            "worst_scale": float(worst), "width_decades_1db": width_decades(curve, finite[sb]["psnr"]),
            "diverged_scales": [float(s) for s, v in curve.items() if v["psnr"] is None],
            "time_ratio": time_ratio, "nfe_ratio": nfe_ratio, "n_backward": stats.n_backward,
            "n_cost_grads": stats.n_cost_grads, "n_cost_evals": stats.n_cost_evals, "curve": curve}


def run_task(model, task: Task, truth: torch.Tensor, x0: torch.Tensor, s2: torch.Tensor, data: torch.Tensor,
             args: Args, log) -> tuple[dict, dict[str, torch.Tensor]]:
    """Sweep every config; returns the summary per config and the best-scale samples."""
    out: dict[str, dict] = {"naive": {**score(task, truth, task.naive), "scale": None}}
    unguided, base = run_config(model, "none", task, x0, 0.0, s2, data, args.n_steps)
    out["none"] = {**score(task, truth, unguided), "scale": None, "time_ratio": 1.0, "nfe_ratio": 1.0,
                   "n_backward": 0}
    samples = {"none": unguided}
    best_at: dict[str, float] = {}
    for config in args.methods:
        if config == "none" or not applicable(config, task):
            continue
        start = time.perf_counter()
        curve, best_x, best_p, best_stats = {}, None, -math.inf, None
        for scale in (args.mc_scales if CONFIGS[config][0] == "mc" else args.scales):
            x, st = run_config(model, config, task, x0, scale, s2, data, args.n_steps)
            curve[f"{scale:g}"] = sc = score(task, truth, x)
            if sc["psnr"] is not None and sc["psnr"] > best_p:
                best_x, best_p, best_stats, best_at[config] = x, sc["psnr"], st, scale
        if best_x is None:
            out[config] = summarize(curve, math.nan, math.nan, guidance.SampleStats())
            log(f"  {task.name:15s} {config:18s} diverged at every scale")
            continue
        samples[config] = best_x
        out[config] = summarize(curve, math.nan, best_stats.nfe / base.nfe, best_stats)
        if CONFIGS[config][0] == "mc":
            out[config]["tilt_ess"] = mc_ess(task, data, best_at[config])
        log(f"  {task.name:15s} {config:18s} best PSNR {best_p:6.2f} dB at scale {best_at[config]:g} "
            f"SSIM {out[config]['ssim']:.3f} ({time.perf_counter() - start:.1f}s)")
    # wall time at the best scale, round-robin with unguided so load spikes hit all alike
    times: dict[str, list[float]] = {c: [] for c in ["none", *best_at]}
    for _ in range(args.timing_repeats):
        for config in times:
            scale = best_at.get(config, 0.0)
            n = x0.shape[0] if CONFIGS[config][0] != "mc" else 8  # mc: per image; time 8, scale up
            _, st = run_config(model, config, task, x0[:n], scale, s2, data, args.n_steps)
            times[config].append(st.wall_time_s * x0.shape[0] / n)
    for config in best_at:
        out[config]["time_ratio"] = min(times[config]) / min(times["none"])
    out["none"]["time_s"] = min(times["none"])
    return out, samples


# ---- outputs ---------------------------------------------------------------------------------

def fmt(v: float | None, nd: int = 2) -> str:
    return "diverged" if v is None else f"{v:.{nd}f}"


def _fmt_opt(v: float | None, nd: int = 2) -> str:
    return "" if v is None else f"{v:.{nd}f}"


NOTES = {
    "none": "unguided samples from the same noise: the floor",
    "naive": "no model",
    "coupled": "library default: linesearch endpoint step, Sigma_t from the per-pixel data variance",
    "coupled_jacobian_ls": "linesearch endpoint step with the Jacobian (Tweedie) Sigma_t, one backward pass per step",
    "coupled_project": "coupled + exact projection of the observed pixels onto the (noisy) measurement "
                       "at every step; its scale changes nothing here: with a diagonal Sigma_t the endpoint "
                       "step only moves observed pixels, which the projection then overwrites",
    "coupled_linear": "coupled with DESIGN.md's plain linear endpoint step",
    "coupled_prox5": "coupled, prox endpoint step with 5 inner steps (the exact tilt of a Gaussian "
                     "posterior by a quadratic cost at scale 1)",
    "coupled_jacobian": "coupled, linear step with the Tweedie Sigma_t = (1-t)^2/t dx1_hat/dx_t (one "
                        "backward pass per step): the one variant that moves unmeasured pixels within a step",
    "velocity_gradient": "DPS-like: backprop through the network every step",
    "state_gradient": "cost gradient at the noisy state",
    "pnp_renoise": "linear endpoint step, then fresh noise (PnP-Flow)",
    "mc": "reference only, not a competitor: reweights the 1497 training images at every step "
          "(needs them at sampling time); in 256-D its tilt over them is degenerate (ESS column), "
          "so it retrieves training digits rather than sampling a posterior",
}


def write_markdown(path: Path, images: dict, meta: dict) -> None:
    tr = meta.get("training", {})
    lines = ["# Guidance on image inverse problems (digits flow model)", "",
             f"Model: {meta['model']}; trained {tr.get('config', {}).get('steps')} steps in "
             f"{tr.get('train_time_s', float('nan')):.0f} s on {tr.get('threads')} thread(s), final loss "
             f"{tr.get('final_loss', float('nan')):.4f}. Evaluated on {meta['n_images']} held-out test digits "
             f"({meta['size']}x{meta['size']}, pixels in [-1, 1]); {meta['n_steps']} Euler steps; the same "
             f"noise x0 for every method and scale; scales swept {meta['scales']}. Run took "
             f"{meta['wall_s']:.0f} s.", "",
             "PSNR (dB, data range 2 on [-1, 1]) and SSIM (Wang et al. 2004, 11x11 Gaussian window, std "
             "1.5, valid positions) are means over the test images of the output clamped to [-1, 1]; "
             "`+-` is the standard error of the mean PSNR. Each method is shown at the scale with its "
             "best mean PSNR (chosen on these same images); `best SSIM` may come from another scale. "
             "`residual` = RMS of A(x) - y over measured entries (the noise std is "
             f"{meta['noise']}: a residual far below it over-fits the noise). `1 dB width` = decades of "
             "scale around the best within 1 dB of it (stability); `worst PSNR` is over the scales "
             "that stayed finite, `diverged` counts scales with non-finite samples. Time and NFE are relative to unguided "
             "sampling of the same batch at the best scale (min over repeats).", ""]
    for task, rows in images.items():
        lines += [f"## {task}", "", meta["task_descriptions"].get(task, ""), "",
                  "| method | PSNR (scale) | SSIM | best SSIM (scale) | worst PSNR (scale) | 1 dB width "
                  "| residual | time ratio | NFE ratio | backward |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        order = sorted(rows, key=lambda k: -(rows[k]["psnr"] if rows[k]["psnr"] is not None else -math.inf))
        for name in order:
            r = rows[name]
            if r.get("scale") is None:
                sem = "" if r.get("psnr_sem") is None else f" +-{r['psnr_sem']:.2f}"
                lines.append(f"| {name} | {fmt(r['psnr'])}{sem} | {fmt(r['ssim'], 3)} | | | "
                             f"| {_fmt_opt(r.get('residual_rms'), 3)} | {_fmt_opt(r.get('time_ratio'))} | "
                             f"{_fmt_opt(r.get('nfe_ratio'))} | {r.get('n_backward', '')} |")
                continue
            ess = f" (tilt ESS {r['tilt_ess']:.1f})" if "tilt_ess" in r else ""
            nd = len(r["diverged_scales"])
            div = f"; diverged at {nd} scale{'s' if nd > 1 else ''}" if nd else ""
            edge = ", edge of sweep" if r["scale"] in (min(meta["scales"]), max(meta["scales"])) else ""
            lines.append(f"| {name}{ess} | {fmt(r['psnr'])} +-{r['psnr_sem']:.2f} ({r['scale']:g}{edge}) | "
                         f"{fmt(r['ssim'], 3)} | {fmt(r['best_ssim'], 3)} ({r['best_ssim_scale']:g}) | "
                         f"{fmt(r['worst_psnr'])} ({r['worst_scale']:g}){div} | {r['width_decades_1db']:.1f} | "
                         f"{fmt(r['residual_rms'], 3)} | {r['time_ratio']:.2f} | {r['nfe_ratio']:.2f} | "
                         f"{r['n_backward']} |")
        lines.append("")
    lines += ["## Methods", ""] + [f"- `{k}`: {v}" for k, v in NOTES.items()] + [""]
    lines += ["## Who wins (computed from the tables)", ""] + verdicts(images) + [""]
    path.write_text("\n".join(lines) + "\n")


def verdicts(images: dict) -> list[str]:
    out = []
    for task, rows in images.items():
        comp = {k: v for k, v in rows.items() if k not in ("mc", "none", "naive") and v["psnr"] is not None}
        if not comp:
            continue
        best = max(comp, key=lambda k: comp[k]["psnr"])
        best_ssim = max(comp, key=lambda k: comp[k]["best_ssim"])
        c = rows.get("coupled", {}).get("psnr")
        beat = [k for k, v in comp.items() if not k.startswith("coupled") and c is not None and v["psnr"] > c]
        variants = [k for k in comp if k.startswith("coupled")]
        bv = max(variants, key=lambda k: comp[k]["psnr"]) if variants else None
        out.append(f"- {task}: best PSNR `{best}` {comp[best]['psnr']:.2f} dB, best SSIM `{best_ssim}` "
                   f"{comp[best_ssim]['best_ssim']:.3f}; coupled (default) {fmt(c)} dB"
                   + (f", best coupled variant `{bv}` {comp[bv]['psnr']:.2f} dB" if bv else "")
                   + (f"; baselines above coupled in PSNR: {', '.join(f'`{k}`' for k in beat)}" if beat else
                      "; no baseline beats coupled in PSNR")
                   + f"; unguided {fmt(rows['none']['psnr'])} dB, naive {fmt(rows['naive']['psnr'])} dB.")
    return out


def plot(path: Path, shown: dict[str, dict[str, torch.Tensor]], tasks: dict[str, Task], truth: torch.Tensor,
         n_show: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ["truth", "measurement", "naive"] + [c for c in CONFIGS if any(c in s for s in shown.values())]
    rows = [(t, i) for t in shown for i in range(n_show)]
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(1.1 * len(cols), 1.15 * len(rows)), squeeze=False)
    for r, (tname, i) in enumerate(rows):
        task = tasks[tname]
        imgs = {"truth": truth[i], "measurement": task.shown[i], "naive": task.naive[i],
                **{c: x[i] for c, x in shown[tname].items()}}
        for c, col in enumerate(cols):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            if col in imgs:
                ax.imshow(imgs[col][0].clamp(-1, 1).numpy(), cmap="gray", vmin=-1, vmax=1)
            else:
                ax.axis("off")
            if r == 0:
                ax.set_title(col.replace("_", "\n"), fontsize=7)
            if c == 0:
                ax.set_ylabel(tname, fontsize=7)
    fig.tight_layout(pad=0.2)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_json(path: Path, images: dict, meta: dict) -> None:
    """Replace the ``images``/``images_meta`` sections of the results file, keeping the rest; atomic."""
    from benchmarks.common import merge_json
    merge_json(path, {"images": images, "images_meta": meta}, indent=1)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def main(args: Args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    bad = [t for t in args.tasks if t not in TASKS] + [m for m in args.methods if m not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown task/method {bad}; tasks: {', '.join(TASKS)}; methods: {', '.join(CONFIGS)}")
    log = lambda s: print(s, flush=True)  # noqa: E731
    # diverging scales are expected in a sweep; they are counted in the JSON (n_nonfinite)
    warnings.filterwarnings("ignore", message="guided sampling", category=RuntimeWarning)
    start = time.perf_counter()
    cfg = ImageFlowConfig(size=args.size, steps=args.train_steps, seed=args.seed)
    model = train_image_flow(cfg, log=log)
    train, test = load_digits_split(args.size, cfg.n_test, cfg.seed)
    truth = test[: args.n_images]
    s2 = train.var(0, keepdim=False).clamp_min(1e-4)            # per-pixel data variance (1, H, W)
    x0 = torch.randn(truth.shape, generator=torch.Generator().manual_seed(args.seed + 1))
    images, shown, tasks = {}, {}, {}
    for name in args.tasks:
        task = tasks[name] = make_task(name, truth, train.mean(0, keepdim=True), args)
        log(f"[{name}] {task.description}")
        images[name], samples = run_task(model, task, truth, x0, s2, train, args, log)
        shown[name] = {k: v[: args.n_show] for k, v in samples.items()}
    meta = {"model": f"ImageVelocity UNet (base {cfg.base}, patch {cfg.patch}, "
                     f"{sum(p.numel() for p in model.parameters())} parameters)",
            "training": training_info(cfg) or {}, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                         for k, v in asdict(args).items()},
            "n_images": args.n_images, "size": args.size, "n_steps": args.n_steps, "noise": args.noise,
            "scales": list(args.scales), "mc_scales": list(args.mc_scales), "task_descriptions": {k: t.description for k, t in tasks.items()},
            "configs": {k: [CONFIGS[k][0], CONFIGS[k][1]] for k in args.methods}, "notes": NOTES,
            "wall_s": time.perf_counter() - start}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    images, meta = _json_safe(images), _json_safe(meta)
    write_json(args.out_dir / "guidance.json", images, meta)
    write_markdown(args.out_dir / "guidance_images.md", images, meta)
    plot(args.out_dir / "guidance_images.png", shown, tasks, truth, args.n_show)
    log((args.out_dir / "guidance_images.md").read_text())
    log(f"done in {meta['wall_s']:.0f}s")


if __name__ == "__main__":
    main(tyro.cli(Args))
