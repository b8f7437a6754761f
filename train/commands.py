"""``groundflow train`` and ``groundflow train cig``: argument parsing around ``train.bc.train``;
``groundflow export``: groundflow datasets in another format (LeRobotDataset).

Both train commands parse ``TrainArgs`` (flags and their aliases, e.g. ``--from`` for ``--init-from``, are
declared on its fields). ``--recipe NAME`` picks the defaults the other flags override. Training reads a
LeRobotDataset directly (``--data lerobot:DIR``, see dataset/lerobot.py): no import step.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tyro

import policies
from dataset.lerobot import LeRobotExport, write_lerobot
from train.bc import TrainArgs, train
from train.recipes import recipe_args, recipe_from_argv


def _print_summary(summary: dict[str, Any]) -> None:
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2, default=str))


def _defaults(argv: list[str]) -> TrainArgs:
    name = recipe_from_argv(argv)
    return recipe_args(name) if name else TrainArgs()


def parse_train_args(argv: list[str]) -> TrainArgs:
    """What ``groundflow train ARGV`` trains: the ``--recipe``'s values (``TrainArgs``' defaults without
    one), then every other flag given."""
    return tyro.cli(TrainArgs, args=argv, default=_defaults(argv), prog="groundflow train")


def train_command(argv: list[str]) -> None:
    """``groundflow train``: behaviour cloning, with joint CIG when ``--cig.weight`` > 0 (the recommended
    configuration: ``--recipe multitask_cig``)."""
    args = parse_train_args(argv)
    summary = train(args)
    _print_summary(summary)
    if args.estimate_state:  # the policy cannot act before its perception head is trained
        print(f"next: groundflow train estimator --from {summary['ckpt']} --out {Path(args.out)}_head")


def train_cig_command(argv: list[str]) -> None:
    """``groundflow train cig --from CKPT``: the CIG continuation stage. It differs from ``train`` in
    three declared defaults: the CIG weight is 1 (not 0), ``--data`` defaults to the data the
    checkpoint was trained on, and the policy family is the checkpoint's."""
    default = _defaults(argv)
    default = dataclasses.replace(default, cig=dataclasses.replace(default.cig, weight=1.0))
    args = tyro.cli(TrainArgs, args=argv, default=default, prog="groundflow train cig")
    if args.init_from is None:
        raise ValueError("groundflow train cig needs --from CKPT (the fine-tuned checkpoint to continue)")
    meta = policies.read_checkpoint_meta(args.init_from)
    if not args.data:
        args.data = tuple(Path(p) for p in meta.get("extra", {}).get("train_args", {}).get("data", []))
    args.policy = meta["config"]["kind"]
    _print_summary(train(args))


@dataclass
class ExportArgs:
    """Write groundflow datasets (collected demos, deployed recordings) in another format."""

    data: tuple[Path, ...] = ()
    """groundflow HDF5 datasets (`groundflow collect`, `groundflow deploy --record`); their episodes in order"""
    out: Path = Path("data/lerobot")
    """output folder (built in OUT.partial, renamed when it reads back whole)"""
    format: Literal["lerobot"] = "lerobot"
    """lerobot: a LeRobotDataset (LeRobot's parquet + mp4 format), which `groundflow train --data lerobot:OUT`
    reads back"""
    lerobot_version: Literal["v3.0", "v2.1"] = "v3.0"
    """v3.0 (LeRobot >= 0.4) or v2.1 (earlier LeRobot, openpi)"""
    fps: int | None = None
    """frames per second; default: the rate the dataset recorded (deployed robots record theirs)"""
    codec: Literal["libsvtav1", "h264", "hevc"] = "libsvtav1"
    """video encoder (libsvtav1, AV1: LeRobot's default)"""
    crf: int = 30
    """video quality: lower keeps the images closer and makes larger files (LeRobot's default 30)"""
    gop: int = 2
    """keyframe interval in frames (LeRobot's default 2)"""
    robot_type: str | None = None
    """info.json robot_type (default: the recording robot's name, else the env id)"""
    overwrite: bool = False


def export_command(argv: list[str]) -> None:
    """``groundflow export --format lerobot --data A.h5 [B.h5 ...] --out DIR``."""
    args = tyro.cli(ExportArgs, args=argv, prog="groundflow export")
    cfg = LeRobotExport(version=args.lerobot_version, fps=args.fps, codec=args.codec, crf=args.crf, gop=args.gop,
                        robot_type=args.robot_type)
    out = write_lerobot(args.data, args.out, cfg, overwrite=args.overwrite)
    print(f"wrote {out} (LeRobotDataset {args.lerobot_version}); train on it with --data lerobot:{out}")
