"""Chunked training samples from datasets: (observation at t, action chunk a[t:t+H]).

Small datasets (what CPU training uses) are held in memory as flat arrays; a batch is a dict
in the policy's batch format: state (B, S), action (B, H, A), action_pad (B, H), instruction
(list of B str), task_id (B,), progress (B,) in [0, 1], images {cam: (B, h, w, 3) uint8}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dataset import DatasetError, open_dataset

ABSURD = 1e6
"""|state| or |action| above this in training data is refused: real ones stay below ~1e3 (a flipped
exponent bit or a float read as an integer gives ~1e9 and more)"""
ENV_INTERFACE = ("control_mode", "robot_uids")
"""collect options that change what the env's actions and observations are"""


class ChunkData:
    def __init__(self, paths: str | Path | Sequence[str | Path], horizon: int, cameras: Sequence[str] = (),
                 image_size: int | None = None, episodes: Sequence[int] | None = None):
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        self.horizon = int(horizon)
        self.cameras = tuple(cameras)
        states, actions, instr, task, prog, ep_of, start_of, length_of, sims = [], [], [], [], [], [], [], [], []
        images: dict[str, list[np.ndarray]] = {c: [] for c in self.cameras}
        self.env_id = None
        self.env_options: dict[str, Any] = {}
        """the collecting env's options that set its interface (controller, robot): evaluation rebuilds it so"""
        self.state_dim = self.action_dim = None
        self.state_layout: list | None = None  # (name, size) slices, where the collecting env named them
        offset, e = 0, 0
        for path in paths:
            with open_dataset(path) as ds:  # HDF5, or lerobot:DIR (a LeRobotDataset)
                missing = [c for c in self.cameras if c not in ds.cameras]
                if missing:
                    raise DatasetError(f"{path} has cameras {list(ds.cameras)}, the policy needs {missing}")
                interface = {k: v for k, v in (ds.meta.get("env_options") or {}).items() if k in ENV_INTERFACE}
                if self.state_dim is None:
                    self.env_id, self.state_dim, self.action_dim = ds.env_id, ds.state_dim, ds.action_dim
                    self.state_layout = ds.meta.get("state_layout")
                    self.env_options = interface
                elif interface != self.env_options:
                    raise DatasetError(f"{path} was collected with {interface or 'the env defaults'}, the first "
                                       f"dataset with {self.env_options or 'the env defaults'}: not one action space")
                elif (ds.state_dim, ds.action_dim) != (self.state_dim, self.action_dim):
                    raise DatasetError(f"{path}: state/action dims {(ds.state_dim, ds.action_dim)} differ from "
                                       f"{(self.state_dim, self.action_dim)} of the first dataset")
                idx = range(len(ds)) if episodes is None else episodes
                for i in idx:
                    ep = ds.episode(i, images=bool(self.cameras))
                    for name in ("state", "action"):  # a NaN sensor reading would only surface as a NaN loss
                        x = getattr(ep, name)
                        if x.dtype.kind != "f":  # (float32 in every dataset written: a damaged datatype)
                            raise DatasetError(f"{path}: episode {i} has {name} of dtype {x.dtype}, not float "
                                               "(corrupt file?)")
                        bad = ~np.isfinite(x).all(axis=1)
                        if bad.any():
                            raise DatasetError(f"{path}: episode {i} has NaN/inf in {name} at steps "
                                               f"{np.flatnonzero(bad)[:5].tolist()}; drop or repair it")
                        big = (np.abs(x) > ABSURD).any(axis=1)
                        if big.any():  # a flipped exponent bit, or data in the wrong units: never a state or action
                            raise DatasetError(f"{path}: episode {i} has absurd values in {name} (|x| up to "
                                               f"{float(np.abs(x).max()):.3g} > {ABSURD:.0e}) at steps "
                                               f"{np.flatnonzero(big)[:5].tolist()}; corrupt file? drop or repair it")
                    T = len(ep)
                    states.append(ep.state)
                    actions.append(ep.action)
                    instr += [ep.instruction] * T
                    task.append(np.full(T, ep.task_id))
                    prog.append(np.arange(T) / max(T - 1, 1))
                    ep_of.append(np.full(T, e))
                    start_of.append(np.full(T, offset))
                    length_of.append(np.full(T, T))
                    for c in self.cameras:
                        images[c].append(_resize(ep.images[c], image_size))
                    offset += T
                    e += 1
        if not states:
            raise DatasetError(f"no episodes in {paths}")
        self.state = np.concatenate(states).astype(np.float32)
        self.action = np.concatenate(actions).astype(np.float32)
        self.instruction = np.array(instr, dtype=object)
        self.task_id = np.concatenate(task)
        self.progress = np.concatenate(prog).astype(np.float32)
        self.episode = np.concatenate(ep_of)
        self.start = np.concatenate(start_of)
        self.length = np.concatenate(length_of)
        self.images = {c: np.concatenate(v) for c, v in images.items()}
        self.n_episodes = e
        self.instructions = sorted(set(instr))

    def __len__(self) -> int:
        return len(self.state)

    def batch(self, idx: np.ndarray, images: bool = True) -> dict[str, Any]:
        """Samples ``idx``; ``images=False`` leaves the frames out (training on cached image features)."""
        idx = np.asarray(idx)
        H = self.horizon
        t = idx - self.start[idx]  # step within episode
        steps = t[:, None] + np.arange(H)[None]
        pad = steps >= self.length[idx][:, None]
        src = self.start[idx][:, None] + np.minimum(steps, self.length[idx][:, None] - 1)
        out: dict[str, Any] = {
            "state": self.state[idx], "action": self.action[src], "action_pad": pad,
            "instruction": list(self.instruction[idx]), "task_id": self.task_id[idx],
            "progress": self.progress[idx], "index": idx}
        if self.cameras and images:
            out["images"] = {c: self.images[c][idx] for c in self.cameras}
        return out


def _resize(imgs: np.ndarray, size: int | None) -> np.ndarray:
    if size is None or imgs.shape[1] == size:
        return imgs
    import torch
    from torch.nn import functional as F
    x = torch.as_tensor(imgs).permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=(size, size), mode="area")
    return x.round().clamp(0, 255).byte().permute(0, 2, 3, 1).numpy()
