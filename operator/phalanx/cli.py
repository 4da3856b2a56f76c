"""The ``phalanx`` command: generate the CRD, run the operator, print the version."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from phalanx import __version__


def _crd(args: argparse.Namespace) -> int:
    from phalanx.api import crd

    if args.stdout:
        sys.stdout.write(crd.render())
        return 0
    path = crd.write(Path(args.output_dir))
    print(f"wrote {path}")
    templates = Path(args.chart_dir) / "templates"
    if templates.is_dir():
        print(f"wrote {crd.write_chart_template(templates)}")
    return 0


def _docs(args: argparse.Namespace) -> int:
    from phalanx.api import reference

    print(f"wrote {reference.write(Path(args.output_dir))}")
    return 0


def watch_scope(kopf_args: list[str]) -> list[str] | None:
    """The namespaces named by kopf's ``--namespace``/``-n`` options; None for all namespaces."""
    names: list[str] = []
    everywhere = False
    arguments = iter(kopf_args)
    for argument in arguments:
        if argument in ("-A", "--all-namespaces"):
            everywhere = True
        elif argument in ("-n", "--namespace"):
            names.append(next(arguments, ""))
        elif argument.startswith("--namespace="):
            names.append(argument.removeprefix("--namespace="))
        elif argument.startswith("-n") and len(argument) > 2:
            names.append(argument[2:].removeprefix("="))
    if everywhere or not names:
        return None
    globbed = [name for name in names if any(char in name for char in "*?[!")]
    if globbed:
        raise SystemExit(f"phalanx run: namespace patterns are not supported ({', '.join(globbed)}); name them")
    return names


def _run(kopf_args: list[str]) -> int:
    import os

    from kopf.cli import main as kopf_main

    from phalanx.handlers.runtime import WATCH_NAMESPACES

    os.environ[WATCH_NAMESPACES] = ",".join(watch_scope(kopf_args) or [])
    kopf_main(["run", "-m", "phalanx.handlers", *kopf_args], standalone_mode=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = argparse.ArgumentParser(prog="phalanx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    crd = commands.add_parser("crd", help="write the TrainingJob CRD generated from the API models")
    crd.add_argument("--output-dir", default="crds", help="directory to write into (default: crds)")
    crd.add_argument("--stdout", action="store_true", help="print the CRD instead of writing a file")
    crd.add_argument("--chart-dir", default="charts/phalanx", help="also write the chart's CRD template here")
    crd.set_defaults(func=_crd)
    docs = commands.add_parser("docs", help="write the API reference generated from the API models")
    docs.add_argument("--output-dir", default="docs", help="directory to write into (default: docs)")
    docs.set_defaults(func=_docs)
    run = commands.add_parser("run", help="run the operator (arguments after it go to `kopf run`)")
    run.add_argument(
        "kopf_args",
        nargs=argparse.REMAINDER,
        help="e.g. --all-namespaces --standalone --liveness=http://0.0.0.0:8080/healthz",
    )
    run.set_defaults(func=_run)
    version = commands.add_parser("version", help="print the version")
    version.set_defaults(func=lambda _: print(__version__) or 0)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        return _run(argv[1:])
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
