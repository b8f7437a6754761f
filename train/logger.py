"""wandb logging that works with no network: offline by default without an API key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Logger:
    def __init__(self, mode: str, out: Path, config: dict[str, Any], name: str, enabled: bool = True):
        if mode not in ("disabled", "offline", "online"):
            raise ValueError(f"--wandb must be disabled, offline or online, got {mode!r}")
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            print("wandb: no WANDB_API_KEY; logging offline (sync later with `wandb sync`)")
            mode = "offline"
        self.run = None
        if enabled and mode != "disabled":
            import wandb
            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project="groundflow", name=name, dir=str(out), mode=mode, config=config,
                                  reinit=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
