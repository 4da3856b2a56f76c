"""``phalanx convert``: Kubeflow PyTorchJob manifests in, TrainingJob manifests out (offline)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from phalanx.cli.manifests import ManifestError, read_file

PROGRAM = "phalanx convert"


@dataclass
class _Outcome:
    """What one run converted, skipped and refused."""

    converted: list[tuple[str, dict[str, Any], list[str]]] = field(default_factory=list)  # (origin, job, notes)
    messages: list[str] = field(default_factory=list)
    failed: bool = False


def _convert_all(args: argparse.Namespace, stdin: TextIO) -> _Outcome:
    from phalanx.conversion import kubeflow

    outcome = _Outcome()
    for path in args.files:
        try:
            documents = list(read_file(path, stdin))
        except ManifestError as error:
            outcome.messages.append(str(error))
            outcome.failed = True
            continue
        for document in documents:
            where, body = document.where, document.body
            if not isinstance(body, dict) or not kubeflow.is_pytorchjob(body):
                kind = document.kind or ("without a kind" if isinstance(body, dict) else "not an object")
                outcome.messages.append(f"{where}: skipped: {kind} is not a PyTorchJob")
                continue
            name = document.name or "(unnamed)"
            try:
                result = kubeflow.convert(body, gang_scheduler=args.gang_scheduler, namespace=args.namespace)
            except kubeflow.ConversionError as error:
                outcome.messages.append(f"{where}: PyTorchJob {name}: cannot convert: {error}")
                outcome.failed = True
                continue
            notes = [str(note) for note in result.notes]
            outcome.converted.append((f"{where}: PyTorchJob {name}", result.job, notes))
    return outcome


def render(job: dict[str, Any], origin: str, notes: list[str]) -> str:
    """One TrainingJob as YAML, preceded by its notes as comments."""
    import yaml

    header = [f"# phalanx convert: {origin}"] + [f"# {line}" for note in notes for line in note.splitlines()]
    return "\n".join(header) + "\n" + yaml.safe_dump(job, sort_keys=False, default_flow_style=False)


def _write(outcome: _Outcome, output_dir: str | None, stdout: TextIO) -> None:
    if output_dir is None:
        documents = [render(job, origin, notes) for origin, job, notes in outcome.converted]
        stdout.write("---\n".join(documents))
        return
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    written: dict[Path, str] = {}
    for origin, job, notes in outcome.converted:
        metadata = job["metadata"]
        target = directory / f"{metadata.get('name') or metadata['generateName']}.yaml"
        if target in written:
            outcome.messages.append(f"{origin}: not written: {target} already holds {written[target]}")
            outcome.failed = True
            continue
        target.write_text(render(job, origin, notes), encoding="utf-8")
        written[target] = origin
        outcome.messages.append(f"{origin}: wrote {target}")


def convert_command(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Convert every PyTorchJob in the files; 1 when any could not be converted or written."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    outcome = _convert_all(args, stdin)
    try:
        _write(outcome, args.output_dir, stdout)
    except OSError as error:
        outcome.messages.append(f"cannot write: {error}")
        outcome.failed = True
    summary = []
    for origin, job, notes in outcome.converted:
        summary.append(f"{origin} -> TrainingJob (launcher {job['spec']['launcher']}, {len(notes)} notes)")
        summary += [f"  {note}" for note in notes]
    summary += outcome.messages
    if not outcome.converted and not outcome.failed:
        summary.append("no PyTorchJob found")
    for line in summary:
        print(f"{PROGRAM}: {line}", file=sys.stderr)
    return 1 if outcome.failed else 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from phalanx.conversion.kubeflow import GANG_SCHEDULERS

    parser = commands.add_parser(
        "convert",
        help="convert Kubeflow PyTorchJob manifests into TrainingJobs (offline)",
        description="Convert Kubeflow PyTorchJobs (kubeflow.org/v1) into TrainingJobs. Each TrainingJob is "
        "preceded by comments listing what was mapped differently, removed or not mapped, and why; the "
        "same notes go to stderr. Other documents are skipped. Exit status 1 when any PyTorchJob could "
        "not be converted.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML files (multi-document, kind: List); - for stdin")
    parser.add_argument(
        "-o", "--output-dir", help="write one file per TrainingJob (<name>.yaml) here instead of to stdout"
    )
    parser.add_argument(
        "--gang-scheduler",
        choices=GANG_SCHEDULERS,
        help="the gang scheduler Kubeflow's operator ran with (its --gang-scheduler-name); by default it is "
        "read from the pods' schedulerName or the Kueue queue label",
    )
    parser.add_argument("-n", "--namespace", help="the namespace of every TrainingJob (replaces the job's own)")
    parser.set_defaults(func=convert_command)
