"""``groundflow train`` and ``groundflow train cig``: argument parsing around ``train.bc.train``.

Both parse ``TrainArgs`` (flags and their aliases, e.g. ``--from`` for ``--init-from``, are
declared on its fields). ``--recipe NAME`` picks the defaults the other flags override.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import tyro

import policies
from train.bc import TrainArgs, train
from train.recipes import recipe_args, recipe_from_argv


def _print_summary(summary: dict[str, Any]) -> None:
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2, default=str))


def _defaults(argv: list[str]) -> TrainArgs:
    name = recipe_from_argv(argv)
    return recipe_args(name) if name else TrainArgs()


def train_command(argv: list[str]) -> None:
    """``groundflow train``: behaviour cloning, with joint CIG when ``--cig.weight`` > 0."""
    args = tyro.cli(TrainArgs, args=argv, default=_defaults(argv), prog="groundflow train")
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
