"""Recording deployed episodes in the project's dataset format (``dataset``).

Each finished episode is appended and flushed to ``PATH.partial``; ``close()`` publishes
``PATH`` atomically. A crash leaves the episodes written so far readable with
``Dataset(path, allow_incomplete=True)``. The recorded action is the command the driver
received (after the safety layer); per-episode deployment statistics (interventions, timing,
end reason) go to ``PATH.episodes.jsonl`` beside it, one line per episode.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from dataset import DatasetWriter, EpisodeBuffer
from deploy.robots.base import Obs, RobotSpec


class Recorder:
    def __init__(self, path: str | os.PathLike, spec: RobotSpec, env_id: str | None = None,
                 meta: dict[str, Any] | None = None, overwrite: bool = False):
        self.path = Path(path)
        self.spec = spec
        self.writer = DatasetWriter(self.path, env_id=env_id or spec.meta.get("env_id") or f"robot/{spec.name}",
                                    state_dim=spec.state_dim, action_dim=spec.action_dim, cameras=spec.cameras,
                                    meta={"source": "deploy", "robot": spec.describe(), **(meta or {})},
                                    overwrite=overwrite)
        self.log_path = self.path.with_name(self.path.name + ".episodes.jsonl")
        if overwrite and self.log_path.exists():
            self.log_path.unlink()
        self._buf = None
        self.n_episodes = 0

    def start_episode(self, instruction: str, task_id: int = 0, seed: int | None = None) -> None:
        self._buf = EpisodeBuffer(instruction or "", task_id=task_id, seed=seed)

    def add(self, obs: Obs, action: np.ndarray, reward: float = 0.0, success: bool = False,
            sim_state: np.ndarray | None = None) -> None:
        if self._buf is None:
            raise RuntimeError("Recorder.add before start_episode")
        self._buf.add(obs, np.asarray(action, np.float32), reward, success, sim_state)

    def end_episode(self, final_obs: Obs | None = None, final_sim_state: np.ndarray | None = None,
                    stats: dict[str, Any] | None = None) -> bool:
        """Write the episode (if it has any step); returns whether one was written."""
        buf, self._buf = self._buf, None
        if buf is None or len(buf) == 0:
            return False
        self.writer.add(buf.finish(final_obs, final_sim_state))
        self.n_episodes += 1
        line = {"episode": self.n_episodes - 1, **_jsonable(stats or {})}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return True

    def close(self) -> Path:
        """Publish the dataset (atomic rename)."""
        return self.writer.close()

    def abort(self) -> None:
        """Leave what was written in the ``.partial`` file (readable with allow_incomplete)."""
        self.writer.abort()


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x
