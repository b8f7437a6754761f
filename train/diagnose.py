"""Instruction-grounding diagnostics (``groundflow diagnose``): does the policy listen?

- identification accuracy: does the demonstrated chunk score its own instruction highest? (also
  per episode-progress bin: late steps are where the instruction is weakly constrained);
- action sensitivity: E || pi(o, l*) - pi(o, l') || with the sampling noise shared;
- collapse curve: cosine similarity of the conditioning features under l* and l', per network
  layer and per episode-progress bin (1 = the instruction no longer changes anything);
- counterfactual action error (``--counterfactual``, a ``groundflow relabel`` file of held-out demos):
  at a state of l*'s demo, how far the policy's chunk under l' is from the expert's for l', against
  its chunk under l* (what carrying on costs). Sensitivity says the action changes; this says
  whether it changes to the right one, which is what a mid-episode switch (P4) needs.
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
from dataset import Dataset, DatasetError
from train.cig import identification_accuracy
from train.data import ChunkData


def _counterfactual(instrs: list[str], commanded: list[str], rng: np.random.Generator) -> list[str]:
    out = []
    for l in commanded:
        others = [c for c in instrs if c != l]
        out.append(others[rng.integers(len(others))])
    return out


def _bin_of(progress: np.ndarray, bins: int) -> np.ndarray:
    """The episode-progress bin (``bins`` equal fifths, quarters, ...) of each sample."""
    return np.clip(np.digitize(progress, np.linspace(0, 1, bins + 1)[1:-1]), 0, bins - 1)


def _by_bin(values: np.ndarray, which: np.ndarray, bins: int) -> list[float | None]:
    """Mean of ``values`` per bin (None for an empty bin)."""
    return [float(values[which == b].mean()) if np.any(which == b) else None for b in range(bins)]


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
    which = _bin_of(prog, bins)
    curve = []
    for fs, fc in zip(f_star, f_cf):
        cos = torch.nn.functional.cosine_similarity(fs, fc, dim=-1).numpy()
        curve.append(_by_bin(cos, which, bins))
    sens_bins = _by_bin(sens, which, bins)
    id_idx, hits = identification_accuracy(policy, data, n=n, seed=seed, per_sample=True)
    id_bins = _by_bin(hits, _bin_of(data.batch(id_idx)["progress"], bins), bins)
    return {"identification_accuracy": float(hits.mean()), "identification_by_progress": id_bins,
            "action_sensitivity": float(sens.mean()), "action_sensitivity_by_progress": sens_bins,
            "collapse_curve": {"progress_bins": edges.tolist(), "cosine_by_layer": curve},
            "samples": int(len(idx)), "instructions": data.instructions, "uncached_instructions": unknown}


def _relabel_source(path: Path, rel: dict[str, Any]) -> Path:
    """The demos a relabeled file was made from. ``from`` is relative to where relabel ran, so also try it
    relative to the relabeled file and beside it: diagnose then works from any directory."""
    tried = [Path(rel["from"])]
    if "from_relative" in rel:
        tried.append(path.parent / rel["from_relative"])
    tried.append(path.parent / Path(rel["from"]).name)
    for src in tried:
        if src.exists():
            return src
    raise DatasetError(f"{path} was relabeled from {rel['from']}, which is missing (its lengths give the progress); "
                       f"tried {', '.join(str(t) for t in dict.fromkeys(tried))}")


def load_counterfactual(path: Path) -> dict[str, Any]:
    """The relabeled continuations of ``path`` with their source state's progress and old instruction."""
    with Dataset(path) as ds:
        rel = ds.meta.get("relabel")
        if not rel or rel.get("include_original", True):
            raise DatasetError(f"{path}: --counterfactual needs `groundflow relabel --no-include-original` output "
                               "(continuations only, from held-out demos)")
        eps = [ds.episode(i, images=False) for i in range(len(ds))]
    src = _relabel_source(path, rel)
    with Dataset(src) as ds:
        source = {i: ds.episode(i, images=False) for i in sorted({int(e) for e, _, _ in rel["index"]})}
    lengths = {i: len(ep) for i, ep in source.items()}
    old = {i: ep.instruction for i, ep in source.items()}
    if len(eps) != len(rel["index"]):
        raise DatasetError(f"{path}: {len(eps)} continuations but {len(rel['index'])} index entries")
    return {"episodes": eps, "progress": np.array([t / lengths[int(e)] for e, t, _ in rel["index"]]),
            "old": [old[int(e)] for e, _, _ in rel["index"]]}


@torch.no_grad()
def counterfactual_actions(policy: Any, cf: dict[str, Any], bins: int = 5, seed: int = 0,
                           steps: int = 4) -> dict[str, Any]:
    """Mean per-step L2 (normalized action units) over the first ``steps`` steps between the policy's
    chunk and the expert's continuation under l', for the policy told l' (``new``) and told l*
    (``old``), per progress bin of the source state; ``closer`` is how often new beats old."""
    keep = [i for i, e in enumerate(cf["episodes"]) if len(e) > 0]
    eps = [cf["episodes"][i] for i in keep]
    k = min(steps, policy.config.horizon)
    state = torch.as_tensor(np.stack([e.state[0] for e in eps]), dtype=torch.float32)
    if state.shape[1] != policy.config.state_dim:
        raise ValueError(f"the counterfactual states have {state.shape[1]} numbers, the policy reads "
                         f"{policy.config.state_dim}: relabel demos of the suite the policy was trained on")
    kw = {}
    if policy.config.kind == "flow":
        g = torch.Generator().manual_seed(seed)
        kw["noise"] = torch.randn(len(eps), policy.config.horizon, policy.config.action_dim, generator=g)
    policy.eval()
    a_new = policy.sample_chunks({"state": state, "instruction": [e.instruction for e in eps]}, **kw)[:, :k]
    a_old = policy.sample_chunks({"state": state, "instruction": [cf["old"][i] for i in keep]}, **kw)[:, :k]
    err_new, err_old = np.zeros(len(eps)), np.zeros(len(eps))
    for j, e in enumerate(eps):
        n = min(k, len(e))
        want = policy.normalizer.action(torch.as_tensor(e.action[:n], dtype=torch.float32))
        err_new[j] = float((a_new[j, :n] - want).norm(dim=-1).mean())
        err_old[j] = float((a_old[j, :n] - want).norm(dim=-1).mean())
    which = _bin_of(cf["progress"][keep], bins)
    closer = (err_new < err_old).astype(float)
    return {"error_new": float(err_new.mean()), "error_old": float(err_old.mean()), "closer": float(closer.mean()),
            "error_new_by_progress": _by_bin(err_new, which, bins),
            "error_old_by_progress": _by_bin(err_old, which, bins), "closer_by_progress": _by_bin(closer, which, bins), "samples": len(eps), "steps": k,
            "per_bin_samples": [int((which == b).sum()) for b in range(bins)]}


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


def plot_counterfactual(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Error of the chunk under l' against l''s expert along the source demo, one line per checkpoint
    (solid: told l'; dotted: told l*, i.e. carrying on)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for i, (name, r) in enumerate(results.items()):
        c = r["counterfactual_actions"]
        edges = np.array(r["collapse_curve"]["progress_bins"])
        mids = (edges[:-1] + edges[1:]) / 2
        color = f"C{i}"
        ax.plot(mids, [np.nan if v is None else v for v in c["error_new_by_progress"]], marker="o", color=color,
                label=f"{name} (sens {r['action_sensitivity']:.2f})")
        ax.plot(mids, [np.nan if v is None else v for v in c["error_old_by_progress"]], ":", color=color)
    ax.set_xlabel("progress of l*'s demo at the state")
    ax.set_ylabel("|action - expert's for l'| (normalized)")
    ax.set_title("told l' (solid) / told l* (dotted), at states of l*'s demos", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
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
    counterfactual: Path | None = None
    """`groundflow relabel --no-include-original` output from held-out demos: adds the counterfactual
    action error (is the action under another instruction that instruction's expert action?)"""


def diagnose_command(argv: list[str]) -> None:
    args = tyro.cli(DiagnoseArgs, args=argv, prog="groundflow diagnose")
    results = {}
    cf = load_counterfactual(args.counterfactual) if args.counterfactual is not None else None
    for ck in args.ckpt:
        pol = policies.load(ck)
        data = ChunkData(args.data, pol.config.horizon, pol.config.cameras, pol.config.image_size)
        name = Path(ck).parent.name if Path(ck).name == "ckpt" else Path(ck).name
        results[name] = diagnose(pol, data, args.n, args.bins, args.seed)
        if cf is not None:
            results[name]["counterfactual_actions"] = counterfactual_actions(pol, cf, args.bins, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnostics.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "collapse.png")
    if cf is not None:
        plot_counterfactual(results, args.out / "counterfactual.png")
    for name, r in results.items():
        c = r.get("counterfactual_actions")
        print(f"{name}: identification {r['identification_accuracy']:.3f}  sensitivity {r['action_sensitivity']:.3f}"
              + ("" if c is None else f"  error under l' {c['error_new']:.3f} (told l*: {c['error_old']:.3f}, "
                 f"closer {c['closer']:.2f})"))
    print(f"wrote {args.out / 'diagnostics.json'} and {args.out / 'collapse.png'}"
          + (f" and {args.out / 'counterfactual.png'}" if cf is not None else ""))
