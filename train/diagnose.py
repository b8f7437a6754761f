"""Instruction-grounding diagnostics (``groundflow diagnose``): does the policy listen?

- identification accuracy: does the demonstrated chunk score its own instruction highest? (also
  per episode-progress bin: late steps are where the instruction is weakly constrained);
- action sensitivity: E || pi(o, l*) - pi(o, l') || with the sampling noise shared;
- collapse curve: cosine similarity of the conditioning features under l* and l', per network
  layer and per episode-progress bin (1 = the instruction no longer changes anything).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tyro

import policies
from train.cig import identification_accuracy
from train.data import ChunkData


def _counterfactual(instrs: list[str], commanded: list[str], rng: np.random.Generator) -> list[str]:
    out = []
    for l in commanded:
        others = [c for c in instrs if c != l]
        out.append(others[rng.integers(len(others))])
    return out


@torch.no_grad()
def diagnose(policy: Any, data: ChunkData, n: int = 256, bins: int = 5, seed: int = 0) -> dict[str, Any]:
    if len(data.instructions) < 2:
        raise ValueError(f"diagnostics need >= 2 instructions in the data, found {data.instructions}")
    unknown = [l for l in data.instructions if l not in policy.lang.cache]
    policy.eval()
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(data), size=min(n, len(data)), replace=False)
    batch = data.batch(idx)
    cf = _counterfactual(data.instructions, batch["instruction"], rng)
    # action sensitivity with shared noise
    g = torch.Generator().manual_seed(seed)
    kw = {}
    if policy.config.kind == "flow":
        kw["noise"] = torch.randn(len(idx), policy.config.horizon, policy.config.action_dim, generator=g)
    a_star = policy.sample_chunks(batch, **kw)
    a_cf = policy.sample_chunks({**batch, "instruction": cf}, **kw)
    sens = (a_star - a_cf).norm(dim=(-1, -2)).numpy()  # normalized action units
    # collapse curve
    f_star = policy.conditioning_features(batch, seed=seed)
    f_cf = policy.conditioning_features({**batch, "instruction": cf}, seed=seed)
    prog = batch["progress"]
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(prog, edges[1:-1]), 0, bins - 1)
    curve = []
    for fs, fc in zip(f_star, f_cf):
        cos = torch.nn.functional.cosine_similarity(fs, fc, dim=-1).numpy()
        curve.append([float(cos[which == b].mean()) if np.any(which == b) else None for b in range(bins)])
    sens_bins = [float(sens[which == b].mean()) if np.any(which == b) else None for b in range(bins)]
    id_idx, hits = identification_accuracy(policy, data, n=n, seed=seed, per_sample=True)
    id_which = np.clip(np.digitize(data.batch(id_idx)["progress"], edges[1:-1]), 0, bins - 1)
    id_bins = [float(hits[id_which == b].mean()) if np.any(id_which == b) else None for b in range(bins)]
    return {"identification_accuracy": float(hits.mean()), "identification_by_progress": id_bins,
            "action_sensitivity": float(sens.mean()), "action_sensitivity_by_progress": sens_bins,
            "collapse_curve": {"progress_bins": edges.tolist(), "cosine_by_layer": curve},
            "samples": int(len(idx)), "instructions": data.instructions, "uncached_instructions": unknown}


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """One panel per checkpoint: feature similarity under l* vs l' along the episode, per layer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        edges = np.array(r["collapse_curve"]["progress_bins"])
        mids = (edges[:-1] + edges[1:]) / 2
        for i, row in enumerate(r["collapse_curve"]["cosine_by_layer"]):
            ax.plot(mids, [np.nan if v is None else v for v in row], marker="o", label=f"layer {i + 1}")
        if r.get("identification_by_progress"):
            ax.plot(mids, [np.nan if v is None else v for v in r["identification_by_progress"]], "k--", marker="s",
                    label="identification acc.")
        ax.set_title(f"{name}\nid acc {r['identification_accuracy']:.2f}, sens {r['action_sensitivity']:.2f}")
        ax.set_xlabel("episode progress")
        ax.set_ylabel("cos(features | l*, l')  /  identification")
        ax.set_ylim(min(0.0, ax.get_ylim()[0]), 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class DiagnoseArgs:
    """Instruction-grounding diagnostics of checkpoints on held-out demos."""

    ckpt: tuple[Path, ...]
    """one or more checkpoint directories (compared side by side)"""
    data: Path
    """held-out demos (HDF5)"""
    n: int = 256
    bins: int = 5
    seed: int = 0
    out: Path = Path("runs/diagnose")


def diagnose_command(argv: list[str]) -> None:
    args = tyro.cli(DiagnoseArgs, args=argv, prog="groundflow diagnose")
    results = {}
    for ck in args.ckpt:
        pol = policies.load(ck)
        data = ChunkData(args.data, pol.config.horizon, pol.config.cameras, pol.config.image_size)
        results[Path(ck).parent.name if Path(ck).name == "ckpt" else Path(ck).name] = diagnose(pol, data, args.n, args.bins, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnostics.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "collapse.png")
    for name, r in results.items():
        print(f"{name}: identification {r['identification_accuracy']:.3f}  sensitivity {r['action_sensitivity']:.3f}")
    print(f"wrote {args.out / 'diagnostics.json'} and {args.out / 'collapse.png'}")
