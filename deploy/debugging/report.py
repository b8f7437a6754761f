"""``groundflow debug``: attribute a real-vs-model gap to time steps and write a report.

    groundflow debug --real real.h5 --episode 0 --model adroit/door --ckpt controller:dapg-door --out debug/

``--model`` is an env id (a simulator; the trajectory must carry sim states) or a learned
world-model checkpoint directory. ``--ckpt`` is a policy checkpoint directory (``policies.load``),
``expert`` (the model env's expert, noise 0), or a reference controller
(``controller:pushcube``, ``controller:dapg-<task>``). Writes ``attribution.json``,
``report.md``, ``report.html`` (self-contained) and the plots as PNGs.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tyro
from tqdm import tqdm

import envs
from deploy.debugging.search import Ablation, Attribution, DebugConfig, attribute, exhaustive_ablation, prepare
from deploy.debugging.faults import DapgMeanPolicy, PushCubeController
from deploy.debugging.rollouts import CHANNELS, DebuggingError, Outcome, TrajectoryError
from dataset import Dataset, DatasetError

PLOTS = {"search": "outcome_along_search.png", "errors": "step_errors.png", "traces": "outcome_traces.png"}


# ----- plots -----------------------------------------------------------------------------------

def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend."""
    # imported here: matplotlib is slow to import and only needed when a report has plots
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plot_search(res: Attribution, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    phases = sorted({query["phase"] for query in res.history}, key=[query["phase"] for query in res.history].index)
    for phase in phases:
        pts = [(query["index"], query["value"]) for query in res.history if query["phase"] == phase]
        ax.plot(*zip(*pts), "o", ms=4, label=phase)
    ax.axhline(res.model_outcome, color="tab:gray", ls="--", lw=1, label="model f({})")
    ax.axhline(res.hybrid_real_outcome, color="k", ls="-", lw=1, label="real f(all)")
    ax.axhspan(res.hybrid_real_outcome - res.tol, res.hybrid_real_outcome + res.tol, color="k", alpha=0.08)
    ax.set_xlabel("query (hybrid rollout) in search order")
    ax.set_ylabel(res.outcome)
    ax.set_title("Outcome of each hybrid rollout along the search (band: reproduces the real outcome)")
    ax.legend(fontsize=7, ncol=4, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_errors(res: Attribution, path: Path, ablation: Ablation | None) -> None:
    plt = _pyplot()
    nm = res.normalized_magnitudes
    rows = 2 + (ablation is not None)
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.3 * rows), sharex=True)
    steps = np.arange(res.T)
    for k, c in enumerate(CHANNELS):
        if np.any(nm[:, k] > 0):
            axes[0].plot(steps, nm[:, k], lw=1, label=f"{c} residual")
    for cause in res.causal:
        axes[0].axvline(cause.step, color="tab:red", alpha=0.35, lw=2)
    axes[0].set_yscale("symlog", linthresh=1e-2)
    axes[0].set_ylim(bottom=0)
    axes[0].set_ylabel("error size\n(normalized)")
    axes[0].set_title("Per-step model errors (red: steps found causal); large errors elsewhere did not matter")
    axes[0].legend(fontsize=7, loc="upper right")
    eff = np.zeros(res.T)
    for cause in res.causal:
        eff[cause.step] = cause.effect
    axes[1].bar(steps, eff, color="tab:red", width=max(1.0, res.T / 300))
    axes[1].set_ylabel("marginal effect\nf(S*) - f(S*\\t)")
    if ablation is not None:
        axes[2].bar(steps, ablation.effects, color="tab:blue", width=max(1.0, res.T / 300))
        axes[2].axhline(ablation.tol, color="k", lw=0.5)
        axes[2].axhline(-ablation.tol, color="k", lw=0.5)
        axes[2].set_ylabel("exhaustive\nf(all) - f(all\\t)")
    axes[-1].set_xlabel("time step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_traces(res: Attribution, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3))
    for name, tr in res.traces.items():
        ax.plot(tr, lw=1.3, label=name)
    for cause in res.causal:
        ax.axvline(cause.step, color="tab:red", alpha=0.3)
    ax.set_xlabel("time step")
    ax.set_ylabel({"return": "cumulative return", "success": "success so far"}.get(res.outcome, res.outcome))
    ax.set_title("Hybrid rollouts: model promise, real outcome, causal steps only")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----- report ----------------------------------------------------------------------------------

def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _markdown(res: Attribution, ablation: Ablation | None, meta: dict[str, Any], images: bool = True) -> str:
    lines = [f"# Counterfactual debugging report: {res.env_id}", ""]
    lines += [f"**{res.message}**", ""]
    lines += ["| quantity | value |", "|---|---|"]
    rows = [("outcome", res.outcome), ("steps T", res.T), ("steps with a nonzero residual", res.candidates),
            ("model promise f({})", res.model_outcome), ("hybrid f(all)", res.hybrid_real_outcome),
            ("recorded real outcome", res.real_outcome), ("abs(f(all) - real)", res.reproduction_error),
            ("policy action reproduction error", res.action_error), ("gap", res.gap), ("tolerance", res.tol),
            ("f(S*)", res.causal_outcome),
            ("hybrid rollouts (search / total)", f"{res.search_rollouts} / {res.rollouts}"),
            ("simulated steps", res.steps_simulated), ("seconds", round(res.seconds, 2))]
    if ablation is not None:
        rows += [("exhaustive ablation rollouts", ablation.rollouts),
                 ("exhaustive seconds", round(ablation.seconds, 2)), ("exhaustive causal steps", ablation.causal)]
    rows += [(name, value) for name, value in meta.items()]
    lines += [f"| {name} | {_fmt(value)} |" for name, value in rows]
    lines += [""]
    if res.no_gap:
        return "\n".join(lines)
    lines += ["## Causal steps (ranked by marginal effect)", "",
              "| rank | step | set | effect f(S*) - f(S*\\t) | error type | state err | reward err | obs err | "
              "channel effects |",
              "|---|---|---|---|---|---|---|---|---|"]
    for rank, cause in enumerate(res.causal):
        ch = ", ".join(f"{channel}: {effect:+.3g}" for channel, effect in cause.channel_effects.items())
        cause_set = "S*" if cause.cause_set == 0 else f"alt {cause.cause_set}"
        size = cause.normalized_size
        lines.append(f"| {rank + 1} | {cause.step} | {cause_set} | {cause.effect:+.4g} | {cause.error_type} | "
                     f"{size['state']:.3g} | {size['reward']:.3g} | {size['observation']:.3g} | {ch} |")
    lines += ["", "Error sizes are normalized: the largest |residual| over dims, each dim divided by the trajectory's "
              "own scale (per-step change for the state, spread for observations and rewards).", ""]
    nm = res.normalized_magnitudes
    causal = set(res.steps)
    score = nm.max(axis=1)
    top = [int(t) for t in np.argsort(-score) if int(t) not in causal][:5]
    lines += ["## Largest errors that did not matter", "",
              "| step | largest channel | size |", "|---|---|---|"]
    for t in top:
        channel = int(np.argmax(nm[t]))
        lines.append(f"| {t} | {CHANNELS[channel]} | {nm[t, channel]:.3g} |")
    if images:
        lines += ["", "## Plots", "", f"![outcome along the search]({PLOTS['search']})", "",
                  f"![per-step errors]({PLOTS['errors']})", "", f"![outcome traces]({PLOTS['traces']})", ""]
    return "\n".join(lines)


def _html(md_text: str, image_paths: dict[str, Path]) -> str:
    """Tiny markdown-to-HTML for our own report (headings, tables, bold, images inlined)."""
    out, in_table = ["<!doctype html><html><head><meta charset='utf-8'><title>groundflow debug report</title>",
                     "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}table{border-collapse:collapse}"
                     "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}img{max-width:100%}</style>"
                     "</head><body>"], False
    for line in md_text.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if all(set(cell) <= {"-"} for cell in cells):
                continue
            if not in_table:
                out.append("<table>")
                in_table = True
                out.append("<tr>" + "".join(f"<th>{cell}</th>" for cell in cells) + "</tr>")
            else:
                out.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
            continue
        if in_table:
            out.append("</table>")
            in_table = False
        if line.startswith("!["):
            name = line[line.index("(") + 1:line.rindex(")")]
            image_path = image_paths.get(name)
            if image_path is not None and image_path.exists():
                b64 = base64.b64encode(image_path.read_bytes()).decode()
                out.append(f"<p><img src='data:image/png;base64,{b64}'></p>")
        elif line.startswith("## "):
            out.append(f"<h2>{line[3:]}</h2>")
        elif line.startswith("# "):
            out.append(f"<h1>{line[2:]}</h1>")
        elif line.startswith("**") and line.endswith("**"):
            out.append(f"<p><b>{line[2:-2]}</b></p>")
        elif line.strip():
            out.append(f"<p>{line}</p>")
    if in_table:
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(res: Attribution, out_dir: str | Path, ablation: Ablation | None = None,
                 meta: dict[str, Any] | None = None, overwrite: bool = False) -> Path:
    """Write attribution.json, report.md, report.html and PNG plots into ``out_dir`` (atomically)."""
    out = Path(out_dir)
    if out.exists() and not overwrite and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    data = {"attribution": res.to_dict(), "meta": meta or {}}
    if ablation is not None:
        data["exhaustive"] = {"effects": ablation.effects.tolist(), "causal": ablation.causal,
                              "rollouts": ablation.rollouts, "seconds": ablation.seconds, "tol": ablation.tol}
    (tmp / "attribution.json").write_text(json.dumps(data, indent=1, default=float))
    images = {}
    if not res.no_gap:
        _plot_search(res, tmp / PLOTS["search"])
        _plot_errors(res, tmp / PLOTS["errors"], ablation)
        _plot_traces(res, tmp / PLOTS["traces"])
        images = {name: tmp / name for name in PLOTS.values()}
    md = _markdown(res, ablation, meta or {}, images=bool(images))
    (tmp / "report.md").write_text(md)
    (tmp / "report.html").write_text(_html(md, images))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


# ----- CLI -------------------------------------------------------------------------------------

@dataclass
class DebugArgs:
    """Find the time steps whose world-model errors caused a real trajectory's worse outcome."""

    real: Path
    """real trajectory: a groundflow dataset (HDF5), e.g. recorded by deploy or on a shifted twin"""
    model: str
    """world model: an env id (simulator) or a learned world-model checkpoint directory"""
    ckpt: str
    """policy: checkpoint dir (policies.load), 'expert', or controller:pushcube / controller:dapg-<task>"""
    out: Path = Path("debug_report")
    episode: int = 0
    """which episode of --real"""
    outcome: str = "return"
    """return | success | final_distance"""
    distance_dims: tuple[int, ...] = ()
    """final_distance: state dims of the object ..."""
    target_dims: tuple[int, ...] = ()
    """... and of its target"""
    rel_tol: float = 0.1
    """a patch reproduces the real outcome within rel_tol * |gap|"""
    abs_tol: float = 1e-6
    min_gap: float = 0.0
    """gaps at or below this (outcome units) are reported as no gap"""
    min_gap_rel: float = 1e-6
    """... as are gaps below this fraction of the outcome's magnitude"""
    explain_channels: bool = True
    find_alternatives: bool = True
    max_rollouts: int | None = None
    """rollout budget (default: what exhaustive ablation costs, T + 2; less is an error): the search switches
    to single-step ablation rather than exceed it. A value given here is a hard cap; the default budget is
    exceeded only when the opening guess fails, by at most rollout_slack"""
    rollout_slack: int | None = None
    """rollouts the search may risk beyond the budget before it has dropped any step (default: 8 under the
    default budget, 0 with --max-rollouts; 0: a hard cap)"""
    exhaustive: bool = False
    """also run exhaustive single-step ablation (T rollouts) for comparison"""
    env_options: dict[str, str] = field(default_factory=dict)
    """options for envs.make of a simulator model (default: the dataset's recorded options)"""
    seed: int = 0
    overwrite: bool = False
    progress: bool = True


def load_policy(spec: str, model_env: Any) -> Any:
    """Policy from a ``--ckpt`` spec (see :class:`DebugArgs`)."""
    if spec == "expert":
        expert = model_env.make_expert(noise=0.0, seed=0)
        return expert
    if spec.startswith("controller:"):
        name = spec.split(":", 1)[1]
        if name == "pushcube":
            return PushCubeController()
        if name.startswith("dapg-"):
            return DapgMeanPolicy(name[5:])
        raise DebuggingError(f"unknown controller {name!r}; valid: pushcube, dapg-door, dapg-hammer, dapg-pen, "
                             "dapg-relocate")
    path = Path(spec)
    if not path.exists():
        raise DebuggingError(f"policy checkpoint {spec!r} does not exist (or use 'expert' / 'controller:NAME')")
    try:
        import policies  # imported here: it pulls in torch, needed only for a checkpoint (and may be missing)
    except ImportError as e:
        raise DebuggingError(f"cannot load policy checkpoint {spec}: the policies package is unavailable ({e})") from e
    return policies.load(path)


def load_model(spec: str, dataset_meta: dict[str, Any], env_options: dict[str, Any]) -> Any:
    """A world model from ``--model``: a learned checkpoint dir (float64) or an env id."""
    from envs.world_model import CONFIG_FILE, load_world_model_env  # imported here: it pulls in torch
    path = Path(spec)
    if path.is_dir():
        if not (path / CONFIG_FILE).exists():
            raise DebuggingError(f"--model {spec} is a directory but not a world-model checkpoint (no {CONFIG_FILE})")
        return load_world_model_env(path, precision="float64")
    opts: dict[str, Any] = dict(dataset_meta.get("env_options") or {})
    if dataset_meta.get("control_mode"):
        opts.setdefault("control_mode", dataset_meta["control_mode"])
    opts.update({k: _parse_scalar(v) for k, v in env_options.items()})
    return envs.make(spec, **opts)


def _parse_scalar(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def run_debug(args: DebugArgs) -> dict[str, Any]:
    try:
        with Dataset(args.real) as ds:
            if not 0 <= args.episode < len(ds):
                raise DebuggingError(f"--episode {args.episode} out of range: {args.real} has {len(ds)} episodes")
            ep = ds.episode(args.episode)
            meta = dict(ds.meta)
            real_env_id = ds.env_id
    except DatasetError as e:
        raise TrajectoryError(f"cannot read the real trajectory: {e}") from e
    model_env = load_model(args.model, meta, args.env_options)
    policy = load_policy(args.ckpt, model_env)
    cfg = DebugConfig(outcome=Outcome(args.outcome, tuple(args.distance_dims), tuple(args.target_dims)),
                      rel_tol=args.rel_tol, abs_tol=args.abs_tol, min_gap=args.min_gap,
                      min_gap_rel=args.min_gap_rel,
                      explain_channels=args.explain_channels, find_alternatives=args.find_alternatives,
                      max_rollouts=args.max_rollouts, rollout_slack=args.rollout_slack, seed=args.seed)
    bar = tqdm(desc="hybrid rollouts", unit="rollout", disable=not args.progress, mininterval=0.5, delay=1.0)

    def tick(eng: Any) -> None:
        bar.set_postfix(phase=eng.phase, steps=eng.steps, refresh=False)
        bar.update(eng.rollouts - bar.n)

    t0 = time.time()
    try:
        prep = prepare(model_env, policy, ep, cfg, on_rollout=tick)
        res = attribute(prep, cfg)
        ablation = None
        if args.exhaustive and not res.no_gap:
            prep.engine = prep.fresh_engine()
            prep.engine.on_rollout = tick
            bar.reset()
            bar.set_description("exhaustive ablation")
            ablation = exhaustive_ablation(prep, cfg)
    finally:
        bar.close()
    out = write_report(res, args.out, ablation, meta={"real": str(args.real), "episode": args.episode,
                                                       "real env": real_env_id, "model": args.model,
                                                       "policy": args.ckpt}, overwrite=args.overwrite)
    summary = {"message": res.message, "causal_steps": res.steps, "no_gap": res.no_gap,
               "ranked": [(cause.step, round(cause.effect, 6), cause.error_type) for cause in res.causal],
               "rollouts": res.rollouts, "seconds": round(time.time() - t0, 2), "out": str(out)}
    if ablation is not None:
        summary.update(exhaustive_causal=ablation.causal, exhaustive_rollouts=ablation.rollouts)
    return summary


def debug_command(argv: list[str]) -> None:
    """Entry point for ``groundflow debug``."""
    args = tyro.cli(DebugArgs, args=argv, prog="groundflow debug")
    print(json.dumps(run_debug(args), indent=2))
