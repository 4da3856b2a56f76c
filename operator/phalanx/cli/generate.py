"""``phalanx crd`` and ``phalanx docs``: files generated from the API models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    crd = commands.add_parser("crd", help="write the TrainingJob CRD generated from the API models")
    crd.add_argument("--output-dir", default="crds", help="directory to write into (default: crds)")
    crd.add_argument("--stdout", action="store_true", help="print the CRD instead of writing a file")
    crd.add_argument("--chart-dir", default="charts/phalanx", help="also write the chart's CRD template here")
    crd.set_defaults(func=_crd)
    docs = commands.add_parser("docs", help="write the API reference generated from the API models")
    docs.add_argument("--output-dir", default="docs", help="directory to write into (default: docs)")
    docs.set_defaults(func=_docs)
