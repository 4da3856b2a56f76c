"""The ``phalanx`` command (also ``kubectl phalanx``, as the ``kubectl-phalanx`` plugin).

Each subcommand lives in a module of its own that registers its parser; heavy imports (kopf, the
Kubernetes client) happen inside the commands that need them, so ``phalanx plan`` and
``phalanx convert`` start fast and need no cluster.
"""

from __future__ import annotations

import argparse
import os
import sys

from phalanx import __version__
from phalanx.cli import convert, describe, doctor, generate, logs, plan, run, run_local

# in the order `phalanx --help` lists them: before applying, while it runs, the cluster, then the operator's own
COMMANDS = (plan, run_local, convert, describe, logs, doctor, generate, run)


def _program_name() -> str:
    """``kubectl phalanx`` when kubectl runs us as its plugin (the executable kubectl-phalanx)."""
    return "kubectl phalanx" if os.path.basename(sys.argv[0]).startswith("kubectl-") else "phalanx"


def parser() -> argparse.ArgumentParser:
    """The whole command line."""
    top = argparse.ArgumentParser(prog=_program_name(), description="phalanx: elastic distributed training jobs.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands)
    version = commands.add_parser("version", help="print the version")
    version.set_defaults(func=lambda _: print(__version__) or 0)
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console scripts."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # everything after `run` belongs to kopf, options included
        return run.run(argv[1:])
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
