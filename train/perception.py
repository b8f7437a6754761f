"""``groundflow train estimator --from CKPT``: train a policy's perception head on its demos.

A checkpoint trained with ``--estimate-state`` reads those state entries (object positions) from a
perception head over its cameras, never from the observation (policies/perception.py). This
stage fits that head: images and proprioception in, the simulator's recorded value as the target
(supervision only). The policy's own weights are not touched, so the two stages can be redone
independently. Episodes are split into training and held-out ones; the held-out error, per entry
in state units, is stored in the checkpoint (``extra.estimator``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable

import numpy as np
import torch
import tyro
from tqdm import tqdm

import policies
from envs.errors import InvalidOptionError
from train.bc import warmup_cosine
from train.data import ChunkData


@dataclass
class EstimatorArgs:
    """Train the perception head of a checkpoint trained with --estimate-state."""

    init_from: Annotated[Path, tyro.conf.arg(aliases=("--from",))] = Path("runs/policy/ckpt")
    """the policy checkpoint whose perception head to train (its weights are kept)"""
    data: tuple[Path, ...] = ()
    """datasets with the checkpoint's cameras (default: the data the policy was trained on)"""
    steps: int = 4000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-4
    heldout: float = 0.1
    """fraction of episodes held out to measure the head's error"""
    seed: int = 0
    out: Path = Path("runs/policy_estimator")
    """where the checkpoint with the trained head goes (a directory, as `train` writes: OUT/ckpt)"""
    estimator_from: Path | None = None
    """start from the perception head of this checkpoint (same cameras, estimated entries and
    proprioception), e.g. to keep a trained head for a policy retrained on other demos (its units are
    converted; --steps 0: copy it and measure its error)"""
    progress: bool = True

    def check(self) -> None:
        """Refuse flags that train nothing (one line, after parsing)."""
        if self.steps < (0 if self.estimator_from else 1) or self.batch_size < 1:
            raise InvalidOptionError(f"--steps must be >= 1 (>= 0 with --estimator-from) and --batch-size >= 1, "
                                     f"got {self.steps}, {self.batch_size}")
        if not 0 < self.heldout < 1:
            raise InvalidOptionError(f"--heldout must be in (0, 1), got {self.heldout}")


def _lr(step: int, args: EstimatorArgs) -> float:
    return warmup_cosine(step, args.lr, min(200, args.steps // 10), args.steps, 0.02)


def heldout_error(policy: Any, data: ChunkData, idx: np.ndarray, batch: int = 256) -> np.ndarray:
    """(n_entries,) root-mean-square error of the head on frames ``idx``, in state units."""
    policy.eval()
    sq = np.zeros(len(policy.config.estimated_state))
    est_idx = list(policy.config.estimated_state)
    for i in range(0, len(idx), batch):
        b = data.batch(idx[i:i + batch])
        sq += ((policy.estimate(b) - b["state"][:, est_idx]) ** 2).sum(0)
    return np.sqrt(sq / max(len(idx), 1))


def _copy_head(policy: Any, source: Any, where: Path) -> None:
    """``source``'s perception head into ``policy``; both must estimate the same entries from the same
    cameras and proprioception. The head works in standardized units (proprioception in, estimate out);
    where the two policies were trained on data with other statistics, the change of units is folded
    into the head's first layer (its proprioception columns) and its last, so the copied head gives
    the same estimate in state units (a head stays usable for a policy retrained on other demos)."""
    a, b = policy.config, source.config
    if source.estimator is None or (a.cameras, a.image_size, a.estimated_state, a.estimator_channels,
                                    a.estimator_keypoints) != (b.cameras, b.image_size, b.estimated_state,
                                                               b.estimator_channels, b.estimator_keypoints) \
            or not torch.equal(policy.state_keep, source.state_keep):
        raise InvalidOptionError(f"--estimator-from {where}: its perception head does not fit this policy (cameras, "
                                 "image size, estimated entries, proprioception read or head size differ)")
    policy.estimator.load_state_dict(source.estimator.state_dict())
    m_s, s_s = source.normalizer.state_mean.double(), source.normalizer.state_std.double()
    m_t, s_t = policy.normalizer.state_mean.double(), policy.normalizer.state_std.double()
    if torch.equal(m_s, m_t) and torch.equal(s_s, s_t):
        return
    keep, est = policy.state_keep, policy.estimated_idx
    first, last = policy.estimator.head[0], policy.estimator.head[-1]
    with torch.no_grad():  # proprio: z_src = z_t * s_t / s_s + (m_t - m_s) / s_s, per read entry
        w = first.weight.double()
        cols = w[:, -len(keep):]
        first.bias.copy_((first.bias.double() + cols @ ((m_t - m_s) / s_s)[keep]).to(first.bias.dtype))
        w[:, -len(keep):] = cols * (s_t / s_s)[keep][None, :]
        first.weight.copy_(w.to(first.weight.dtype))
        ratio = (s_s / s_t)[est]  # estimate: z_t = z_src * s_s / s_t + (m_s - m_t) / s_t, per estimated entry
        last.weight.copy_((last.weight.double() * ratio[:, None]).to(last.weight.dtype))
        last.bias.copy_((last.bias.double() * ratio + ((m_s - m_t) / s_t)[est]).to(last.bias.dtype))


def train_estimator(args: EstimatorArgs, on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    args.check()
    meta = policies.read_checkpoint_meta(args.init_from)
    policy = policies.load(args.init_from)
    c = policy.config
    if policy.estimator is None:
        raise InvalidOptionError(f"{args.init_from} has no perception head: train the policy with --cameras and "
                                 "--estimate-state (e.g. '*_cube_pose[0:3]' '*_goal_pos') first")
    data_paths = args.data or tuple(Path(p) for p in meta.get("extra", {}).get("train_args", {}).get("data", []))
    if not data_paths:
        raise InvalidOptionError("give --data (the checkpoint does not name its training data)")
    if args.estimator_from is not None:
        _copy_head(policy, policies.load(args.estimator_from), args.estimator_from)
    torch.manual_seed(args.seed)
    data = ChunkData(data_paths, 1, c.cameras, c.image_size)
    rng = np.random.default_rng(args.seed)
    eps = rng.permutation(data.n_episodes)
    n_held = max(1, int(round(args.heldout * data.n_episodes)))
    held_eps = set(eps[:n_held].tolist())
    is_held = np.array([e in held_eps for e in data.episode])
    train_idx, held_idx = np.flatnonzero(~is_held), np.flatnonzero(is_held)
    if len(train_idx) == 0:
        raise InvalidOptionError(f"{data.n_episodes} episodes leave nothing to train on with --heldout {args.heldout}")
    params = list(policy.estimator.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(total=args.steps, desc="train estimator", disable=not args.progress)
    history, t0 = [], time.time()
    policy.train()
    for step in range(args.steps):
        pick = torch.randint(len(train_idx), (args.batch_size,), generator=gen).numpy()
        for g in opt.param_groups:
            g["lr"] = _lr(step, args)
        loss, m = policy.estimator_loss(data.batch(train_idx[pick]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append(m["loss"])
        if (step + 1) % 50 == 0:
            bar.set_postfix(loss=f"{np.mean(history[-50:]):.4f}")
        bar.update(1)
        if on_step is not None:
            on_step(step + 1)
    bar.close()
    seconds = time.time() - t0
    rmse = heldout_error(policy, data, held_idx)
    fit = heldout_error(policy, data, train_idx[rng.choice(len(train_idx), min(len(train_idx), 2000), replace=False)])
    report = {"steps": args.steps, "seconds": seconds, "train_frames": int(len(train_idx)),
              "heldout_frames": int(len(held_idx)), "heldout_episodes": n_held,
              "heldout_rmse": rmse.round(5).tolist(), "heldout_rmse_mean": float(rmse.mean()),
              "train_rmse_mean": float(fit.mean()), "final_loss": float(np.mean(history[-50:])) if history else None,
              "data": [str(p) for p in data_paths]}
    extra = {**meta.get("extra", {}), "estimator": report}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = policy.save(out / "ckpt", extra=extra)
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    return {**report, "ckpt": str(ckpt)}


def estimator_command(argv: list[str]) -> None:
    """``groundflow train estimator --from CKPT``."""
    args = tyro.cli(EstimatorArgs, args=argv, prog="groundflow train estimator")
    print(json.dumps(train_estimator(args), indent=2))
