"""``phalanx run-local JOB.yaml``: run a TrainingJob's trainer on this machine before the cluster.

Every worker of ``workers.desired`` (or ``--workers``) runs the trainer container's command and
args as a process group of its own, with the environment the operator would give its pod (the
same builders as ``phalanx plan``), next to the rendezvous store the operator would run. Only what
one machine needs changes (docs/local.md); ``--dry-run`` prints each worker's command and
environment with every change and why. Output lines are prefixed as ``phalanx logs`` prefixes
them. Ctrl-C stops every worker (SIGTERM, then SIGKILL after the pod's grace; a second Ctrl-C at
once). The exit status is 0 only when every worker succeeded.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from phalanx.api import v1alpha1 as api
from phalanx.cli.manifests import ManifestError, read_file

if TYPE_CHECKING:
    from phalanx.localrun import LocalPlan


def _env_pair(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"not NAME=VALUE: {text!r}")
    return name, value


def _config_map_data(body: dict[str, Any], where: str) -> tuple[str, dict[str, str]]:
    name = str((body.get("metadata") or {}).get("name") or "")
    data = body.get("data") or {}
    if not name or not isinstance(data, dict):
        raise ManifestError(f"{where}: a ConfigMap needs metadata.name and data")
    if body.get("binaryData"):
        raise ManifestError(f"{where}: ConfigMap {name}: binaryData is not supported locally")
    return name, {str(key): str(value) for key, value in data.items()}


def read_job(path: str, config_map_files: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """The one TrainingJob of ``path`` and the ConfigMaps of that file and of ``config_map_files``."""
    jobs: list[dict[str, Any]] = []
    config_maps: dict[str, dict[str, str]] = {}
    for file in [path, *config_map_files]:
        for document in read_file(file):
            if document.kind == "ConfigMap":
                name, data = _config_map_data(document.body, document.where)
                config_maps[name] = data
            elif document.kind == api.KIND and file == path:
                jobs.append(document.body)
            elif file != path:
                raise ManifestError(f"{document.where}: not a ConfigMap")
    if len(jobs) != 1:
        raise ManifestError(f"{path}: {len(jobs)} {api.KIND}s; run-local runs exactly one")
    return jobs[0], config_maps


def describe(plan: LocalPlan) -> str:
    """Each worker's directory, command and environment, every local change with why."""
    lines = [f"# {note}" for note in plan.notes]
    lines.append(f"# the rendezvous store: {shlex.join(plan.store_argv[:2])}... on 127.0.0.1:{plan.store_port}")
    for worker in plan.workers:
        lines.append(f"[worker-{worker.index}] ({worker.pod_name}) cd {shlex.quote(str(plan.cwd))}")
        for name, value in worker.env.items():
            why = worker.changed.get(name)
            lines.append(f"  {name}={shlex.quote(value)}" + (f"  # {why}" if why else ""))
        lines.append(f"  {shlex.join(worker.argv)}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from phalanx import localrun

    try:
        job, config_maps = read_job(args.file, args.configmap)
        extra = dict(args.env)
        if args.dry_run:
            print(describe(localrun.plan(job, config_maps=config_maps, workers=args.workers, env=extra)))
            return 0
        run = localrun.start(job, config_maps=config_maps, workers=args.workers, env=extra)
    except (ManifestError, localrun.LocalRunError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for note in run.plan.notes:
        print(f"phalanx run-local: {note}", file=sys.stderr)
    print(f"phalanx run-local: {run.workers} worker(s) of {run.plan.job.metadata.name}", file=sys.stderr, flush=True)

    signals: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        if signals:
            run.grace = 0  # a second Ctrl-C: no more grace
        signals.append(signum)
        print(f"phalanx run-local: stopping the workers (signal {signum})", file=sys.stderr, flush=True)
        run.stop()

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = run.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for index, message in sorted(run.termination_messages.items()):
        print(f"phalanx run-local: worker-{index}'s termination message: {message}", file=sys.stderr)
    print(f"phalanx run-local: {run.phase} (exit status {code})", file=sys.stderr)
    return code


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "run-local",
        help="run a TrainingJob's workers on this machine, with the environment the operator would set",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("file", metavar="JOB.yaml", help="the manifest of one TrainingJob (and its ConfigMaps)")
    parser.add_argument("--workers", type=int, help="how many workers (within workers.min..max; workers.desired)")
    parser.add_argument(
        "--configmap",
        action="append",
        default=[],
        metavar="FILE",
        help="a ConfigMap manifest whose volumes the job mounts (repeatable)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        type=_env_pair,
        metavar="NAME=VALUE",
        help="set a variable in every worker (a secret's, say; repeatable)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print each worker's command and environment")
    parser.set_defaults(func=_run)
