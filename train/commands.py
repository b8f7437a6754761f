"""Registers the training, relabeling, evaluation, diagnostics, deploy and debugging subcommands."""

from __future__ import annotations

import json
from pathlib import Path

from train.cli import register_command


def _print_summary(s: dict) -> None:
    keep = {k: v for k, v in s.items() if k not in ("history",)}
    print(json.dumps(keep, indent=2, default=str))


def _train(argv: list[str]) -> None:
    import tyro
    from train.bc import TrainArgs, train
    if argv and argv[0] == "world-model":
        from train.world_model import world_model_command
        return world_model_command(argv[1:])
    cig_stage = bool(argv) and argv[0] == "cig"
    if cig_stage:
        argv = argv[1:]
    # friendly aliases: --cig-weight (joint CIG), --from (continuation)
    argv = ["--cig.weight" if a == "--cig-weight" else "--init-from" if a == "--from" else a for a in argv]
    from train.recipes import recipe_args, recipe_from_argv
    name = recipe_from_argv(argv)
    default = recipe_args(name) if name else TrainArgs()
    args = tyro.cli(TrainArgs, args=argv, default=default, prog="groundflow train" + (" cig" if cig_stage else ""))
    if cig_stage:
        if args.init_from is None:
            raise ValueError("groundflow train cig needs --from CKPT (the fine-tuned checkpoint to continue)")
        import policies
        meta = policies.read_checkpoint_meta(args.init_from)
        if args.cig.weight == 0:
            args.cig.weight = 1.0
        if not args.data:  # default: the data the checkpoint was trained on
            args.data = tuple(Path(p) for p in meta.get("extra", {}).get("train_args", {}).get("data", []))
        args.policy = meta["config"]["kind"]
    _print_summary(train(args))


def _eval(argv: list[str]) -> None:
    from train.evaluate import eval_command
    eval_command(argv)


def _diagnose(argv: list[str]) -> None:
    from train.diagnose import diagnose_command
    diagnose_command(argv)


def _relabel(argv: list[str]) -> None:
    from train.relabel import relabel_command
    relabel_command(argv)


def _serve(argv: list[str]) -> None:
    from deploy.commands import serve
    serve(argv)


def _deploy(argv: list[str]) -> None:
    from deploy.commands import deploy
    deploy(argv)


def _debug(argv: list[str]) -> None:
    from deploy.debugging import debug_command
    debug_command(argv)


for _name, _fn in {"train": _train, "eval": _eval, "diagnose": _diagnose, "relabel": _relabel, "serve": _serve,
                   "deploy": _deploy, "debug": _debug}.items():
    register_command(_name, _fn)
