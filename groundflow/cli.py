"""The ``groundflow`` command: one entry point, one row of :data:`COMMANDS` per job.

    groundflow envs                          list env ids and suites
    groundflow collect --env ID ...          expert demonstrations -> dataset
    groundflow export --format lerobot ...   datasets -> LeRobotDataset (train reads --data lerobot:DIR)
    groundflow train --recipe multitask ...  behaviour cloning (``--recipe multitask_cig``: with joint CIG)
    groundflow train cig --from CKPT         CIG continuation stage
    groundflow eval --ckpt DIR ...           rollouts, success rate with 95% CI
    groundflow serve / deploy / debug        policy server, robot control loop, sim-to-real debugging

Each row names the function that parses its own arguments (``fn(argv)``, tyro dataclasses where
the flags and their aliases are declared); modules are imported only when their command runs, so
``groundflow envs`` starts without torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable

# Tiny policies next to CPU simulators: intra-op threads beyond one mostly spin (measured: a
# chunk took 35 ms with 1 thread and 1.3 s with 2 on a loaded 2-core machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from deploy.errors import MissingDependencyError  # noqa: E402
from envs.errors import BAD_INPUT_ERRORS  # noqa: E402

USAGE = __doc__


@dataclass(frozen=True)
class Command:
    target: str
    """``module:function``; the function takes the remaining argv"""
    summary: str

    def load(self) -> Callable[[list[str]], None]:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


COMMANDS: dict[str, Command] = {
    "envs": Command("groundflow.cli:list_envs", "list env ids and suites"),
    "collect": Command("train.collect:collect_command", "expert demonstrations -> dataset (HDF5)"),
    "export": Command("train.commands:export_command", "datasets -> LeRobotDataset (--format lerobot)"),
    "train": Command("train.commands:train_command", "behaviour cloning (flow, ar or mlp)"),
    "train cig": Command("train.commands:train_cig_command", "CIG continuation stage (--from CKPT)"),
    "train estimator": Command("train.perception:estimator_command",
                               "perception head of an --estimate-state checkpoint (--from CKPT)"),
    "train world-model": Command("train.world_model:world_model_command", "learned dynamics from datasets"),
    "relabel": Command("train.relabel:relabel_command", "hindsight relabeling of demos with other instructions"),
    "eval": Command("train.evaluate:eval_command", "rollouts of a checkpoint, success rate with 95% CI"),
    "diagnose": Command("train.diagnose:diagnose_command", "does the policy listen to its instruction?"),
    "serve": Command("deploy.commands:serve", "serve a policy over websockets (the GPU workstation side)"),
    "deploy": Command("deploy.commands:deploy", "run a robot (sim or real) from a policy server"),
    "debug": Command("deploy.debugging.report:debug_command", "find the time steps behind a sim-to-real gap"),
}


def list_envs(argv: list[str]) -> None:
    """``groundflow envs``: every env id with its backend and description, then the suites."""
    import envs  # here, not at the top: the other commands do not pay for gymnasium at start-up
    from envs.registry import spec
    for env_id in envs.list_envs():
        s = spec(env_id)
        print(f"{env_id:40s} {s.kind:6s} {s.description}")
    print("\nsuites:", ", ".join(f"{k} ({v})" for k, v in envs.SUITES.items()))


def resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    """(command name, its arguments) for ``argv``: the longest row name its first words spell."""
    for n in (2, 1):
        name = " ".join(argv[:n])
        if len(argv) >= n and name in COMMANDS:
            return name, argv[n:]
    return None


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:{width}s}  {c.summary}" for name, c in COMMANDS.items())
    return f"{USAGE}\ncommands:\n{rows}\n\n`groundflow COMMAND --help` lists a command's flags."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    found = resolve(argv)
    if found is None:
        print(f"groundflow: unknown command {argv[0]!r}; valid commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    name, rest = found
    try:
        fn = COMMANDS[name].load()
    except ModuleNotFoundError as e:  # a robot computer installs only the `robot` extra
        print(f"groundflow {name}: error: {MissingDependencyError.of(e)}", file=sys.stderr)
        return 1
    return run_command(name, fn, rest)


def run_command(name: str, fn: Callable[[list[str]], object], argv: list[str], interrupted_hint: str = "") -> int:
    """``fn(argv)`` as ``groundflow NAME``: bad input ends in one line naming it (exit 1), Ctrl+C in 130."""
    try:
        fn(argv)
    except BAD_INPUT_ERRORS as e:
        msg = " ".join(str(e).splitlines())  # one line, even for errors that wrap a multi-line message
        print(f"groundflow {name}: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"groundflow {name}: interrupted{interrupted_hint}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
