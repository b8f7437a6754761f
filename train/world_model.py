"""Train a learned world model (``groundflow train world-model --data A.h5 B.h5 --out DIR``).

Transitions ``(s_t, a_t) -> (s_{t+1} - s_t, r_t)`` and ``s_{t+1} -> success_t`` come from datasets
in the groundflow format. Every ensemble member sees its own minibatch order and initialization
(the disagreement between members is the model's uncertainty). Validation is on held-out
episodes. The checkpoint is written to ``DIR.partial`` and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import tyro
from tqdm import tqdm

from envs.errors import InvalidOptionError
from envs.world_model import WorldModel, WorldModelConfig
from dataset import Dataset, DatasetError


@dataclass
class WorldModelArgs:
    """Fit an ensemble MLP dynamics + reward model (and a success classifier) to datasets."""

    data: tuple[Path, ...]
    """one or more groundflow datasets (HDF5) with the same state/action layout"""
    out: Path = Path("checkpoints/world_model")
    """checkpoint directory (config.json + model.safetensors)"""
    ensemble: int = 5
    """number of ensemble members"""
    hidden: int = 256
    """hidden width of each member"""
    layers: int = 2
    """hidden layers of each member"""
    steps: int = 3000
    """optimizer steps"""
    batch_size: int = 256
    """transitions per member per step"""
    lr: float = 1e-3
    weight_decay: float = 1e-5
    val_fraction: float = 0.1
    """fraction of episodes held out for validation"""
    seed: int = 0
    device: str = "cpu"
    overwrite: bool = False
    """replace an existing checkpoint directory"""
    progress: bool = True


def load_transitions(paths: Sequence[str | Path]) -> dict[str, Any]:
    """Concatenate transitions of every episode; ``episode`` index per transition."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("s", "a", "r", "s2", "succ", "episode")}
    init, meta = [], {}
    ep_index = 0
    for p in paths:
        with Dataset(p) as ds:
            if meta and (ds.state_dim, ds.action_dim) != (meta["state_dim"], meta["action_dim"]):
                raise DatasetError(f"{p}: state/action dims ({ds.state_dim}, {ds.action_dim}) differ from "
                                   f"{meta['path']} ({meta['state_dim']}, {meta['action_dim']}); a world model "
                                   "needs one layout")
            if not meta:
                meta = {"state_dim": ds.state_dim, "action_dim": ds.action_dim, "env_id": ds.env_id,
                        "path": str(p), "instruction": ds.instructions[0] if ds.instructions else ""}
            for i in range(len(ds)):
                ep = ds.episode(i, images=False)
                s = np.asarray(ep.state, np.float64)
                nxt = np.concatenate([s[1:], ep.final_state[None]]) if ep.final_state is not None else s[1:]
                n = nxt.shape[0]
                if n == 0:
                    continue
                block = {"s": s[:n], "a": ep.action[:n], "r": ep.reward[:n], "s2": nxt, "succ": ep.success[:n]}
                for k, v in block.items():
                    if not np.all(np.isfinite(np.asarray(v, np.float64))):
                        raise DatasetError(f"{p}: episode {i} has NaN/inf in {k}")
                    cols[k].append(np.asarray(v, np.float64))
                cols["episode"].append(np.full(n, ep_index))
                init.append(s[0])
                ep_index += 1
    if ep_index == 0:
        raise DatasetError(f"no transitions in {[str(p) for p in paths]}")
    out = {k: np.concatenate(v) for k, v in cols.items()}
    out.update(init_states=np.stack(init), n_episodes=ep_index, **meta)
    return out


def _action_bounds(a: np.ndarray) -> tuple[list[float], list[float]]:
    """Normalized [-1, 1] actions keep their natural bounds; others get the data's range."""
    lo, hi = a.min(0), a.max(0)
    inside = (lo >= -1.0 - 1e-6) & (hi <= 1.0 + 1e-6)
    return np.where(inside, -1.0, lo).tolist(), np.where(inside, 1.0, hi).tolist()


def train_world_model(dataset_paths: Sequence[str | Path], out: str | Path, **kwargs: Any) -> dict[str, Any]:
    """Train and save; ``kwargs`` are :class:`WorldModelArgs` fields. Returns metrics."""
    args = WorldModelArgs(data=tuple(Path(p) for p in dataset_paths), out=Path(out), **kwargs)
    return _train(args)


def _train(args: WorldModelArgs) -> dict[str, Any]:
    if not args.data:
        raise InvalidOptionError("--data needs at least one dataset")
    for name in ("ensemble", "hidden", "layers", "steps", "batch_size"):
        if getattr(args, name) < 1:
            raise InvalidOptionError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.val_fraction < 1:
        raise InvalidOptionError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    d = load_transitions(args.data)
    n_ep = d["n_episodes"]
    val_eps = set(rng.permutation(n_ep)[: int(round(args.val_fraction * n_ep))].tolist()) if n_ep > 1 else set()
    is_val = np.isin(d["episode"], list(val_eps))
    tr = np.flatnonzero(~is_val)
    va = np.flatnonzero(is_val)
    delta = d["s2"] - d["s"]
    stats = {"s_mean": d["s"][tr].mean(0), "s_std": d["s"][tr].std(0) + 1e-6,
             "a_mean": d["a"][tr].mean(0), "a_std": d["a"][tr].std(0) + 1e-6,
             "d_mean": delta[tr].mean(0), "d_std": delta[tr].std(0) + 1e-6,
             "r_mean": d["r"][tr].mean(keepdims=True), "r_std": d["r"][tr].std(keepdims=True) + 1e-6}
    low, high = _action_bounds(d["a"])
    lengths = np.bincount(d["episode"])
    cfg = WorldModelConfig(state_dim=d["state_dim"], action_dim=d["action_dim"], hidden=args.hidden,
                           layers=args.layers, ensemble=args.ensemble, env_id=d["env_id"],
                           instruction=d["instruction"], action_low=low, action_high=high,
                           max_episode_steps=int(lengths.max()))
    model = WorldModel(cfg)
    model.set_stats(stats, d["init_states"])
    model.to(args.device).train()
    T = lambda x: torch.as_tensor(np.asarray(x, np.float32), device=args.device)  # noqa: E731
    S, A, R = T(d["s"]), T(d["a"]), T(d["r"])
    Dn = (T(delta) - model.d_mean) / model.d_std
    Rn = (R - model.r_mean) / model.r_std
    S2, SUCC = T(d["s2"]), T(d["succ"].astype(np.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    E, B = args.ensemble, min(args.batch_size, len(tr))
    tr_t = torch.as_tensor(tr, device=args.device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    t0 = time.time()
    bar = tqdm(range(args.steps), desc="world model", disable=not args.progress)
    for step in bar:
        idx = tr_t[torch.randint(len(tr), (E, B), generator=gen)]  # each member its own batch
        x = model._inputs(S[idx], A[idx])
        pred = model.dynamics(x)
        loss_dyn = ((pred[..., :-1] - Dn[idx]) ** 2).mean()
        loss_rew = ((pred[..., -1] - Rn[idx]) ** 2).mean()
        j = idx[0]
        logit = model.success_logit(S2[j])
        loss_succ = torch.nn.functional.binary_cross_entropy_with_logits(logit, SUCC[j])
        loss = loss_dyn + loss_rew + loss_succ
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            bar.set_postfix(dyn=f"{loss_dyn.item():.4f}", rew=f"{loss_rew.item():.4f}", succ=f"{loss_succ.item():.3f}")
    bar.close()
    model.eval()
    metrics = {"transitions": int(len(tr)), "val_transitions": int(len(va)), "episodes": int(n_ep),
               "seconds": time.time() - t0, **_evaluate(model, d, va if len(va) else tr)}
    metrics["train"] = _evaluate(model, d, tr[: min(len(tr), 20000)])
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.cpu().save(tmp)
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    metrics["out"] = str(out)
    return metrics


@torch.no_grad()
def _evaluate(model: WorldModel, d: dict[str, Any], idx: np.ndarray) -> dict[str, float]:
    """One-step errors on ``idx``: state error relative to the per-step change, reward MAE, success acc."""
    out = model.predict(d["s"][idx], d["a"][idx])
    err = np.abs(out["next_state"] - d["s2"][idx]).mean()
    change = np.abs(d["s2"][idx] - d["s"][idx]).mean()
    return {"val_state_mae": float(err), "val_state_change_mae": float(change),
            "val_relative_error": float(err / max(change, 1e-12)),
            "val_reward_mae": float(np.abs(out["reward"] - d["r"][idx]).mean()),
            "val_success_accuracy": float((out["success"] == d["succ"][idx].astype(bool)).mean())}


def world_model_command(argv: list[str]) -> None:
    """Entry point for ``groundflow train world-model``."""
    args = tyro.cli(WorldModelArgs, args=argv, prog="groundflow train world-model")
    print(json.dumps(_train(args), indent=2))
