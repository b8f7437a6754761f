"""The ``groundflow`` command: one entry point, one subcommand per job.

    groundflow envs                       list env ids and suites
    groundflow collect --env ID ...       expert demonstrations -> dataset
    groundflow train --policy flow ...    behaviour cloning (``train cig --from CKPT`` for CIG)
    groundflow eval --ckpt DIR ...        rollouts, success rate with 95% CI
"""

from __future__ import annotations

import json
import os
import sys

# Tiny policies next to CPU simulators: intra-op threads beyond one mostly spin (measured: a
# chunk took 35 ms with 1 thread and 1.3 s with 2 on a loaded 2-core machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")
from typing import Callable

import tyro

from envs.errors import GroundflowError

USAGE = __doc__


def _envs(argv: list[str]) -> None:
    import envs
    from envs.registry import spec
    for env_id in envs.list_envs():
        s = spec(env_id)
        print(f"{env_id:40s} {s.kind:6s} {s.description}")
    print("\nsuites:", ", ".join(f"{k} ({v})" for k, v in envs.SUITES.items()))


def _collect(argv: list[str]) -> None:
    from train.collect import CollectArgs, collect
    args = tyro.cli(CollectArgs, args=argv, prog="groundflow collect")
    print(json.dumps(collect(args), indent=2))


COMMANDS: dict[str, Callable[[list[str]], None]] = {"envs": _envs, "collect": _collect}


def register_command(name: str, fn: Callable[[list[str]], None]) -> None:
    COMMANDS[name] = fn


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _load_optional_commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print("commands:", ", ".join(sorted(COMMANDS)))
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"groundflow: unknown command {cmd!r}; valid commands: {', '.join(sorted(COMMANDS))}", file=sys.stderr)
        return 2
    try:
        COMMANDS[cmd](rest)
    except (GroundflowError, ValueError, FileExistsError, FileNotFoundError) as e:
        msg = " ".join(str(e).splitlines())  # one line, even for errors that wrap a multi-line message
        print(f"groundflow {cmd}: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"groundflow {cmd}: interrupted", file=sys.stderr)
        return 130
    return 0


def _load_optional_commands() -> None:
    """Commands whose modules register themselves (training, evaluation, deploy, ...)."""
    import importlib
    for mod in ("train.commands",):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


if __name__ == "__main__":
    # `python -m train.cli`: run the imported module's main so that commands registered by
    # train.commands (which imports train.cli, not __main__) are visible.
    from train.cli import main as _main
    sys.exit(_main())
