"""``phalanx describe JOB``: a TrainingJob's status, its pods and the Events of both, as
``kubectl describe`` shows an object (the text is made in ``describe_text``)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from phalanx.cli import connection

if TYPE_CHECKING:
    from phalanx.cluster.client import ApiClient


async def describe(args: argparse.Namespace) -> int:
    from phalanx.api import v1alpha1 as api
    from phalanx.cli import describe_text
    from phalanx.cli.doctor import read_node_ledgers
    from phalanx.reconcile import naming

    async with connection.connect(args) as cluster:
        job = await connection.get_job(cluster, args.job)
        client, namespace = cluster.client, cluster.namespace
        about_job = f"involvedObject.kind={api.KIND},involvedObject.name={args.job}"
        pods, events_of_job, events_of_pods = await asyncio.gather(
            client.list("v1", "Pod", namespace, label_selector=f"{naming.JOB_NAME_LABEL}={args.job}"),
            client.list("v1", "Event", namespace, field_selector=about_job),
            # one request for the Events of every pod, chosen by name afterwards: a field selector
            # matches one name exactly, and deleted workers' Events (a failure) belong here too
            client.list("v1", "Event", namespace, field_selector="involvedObject.kind=Pod"),
        )
        uid = str(job["metadata"].get("uid", ""))
        ours = [pod for pod in pods if describe_text.owned_by(pod, uid)]
        node_labels = await _node_labels(client, job, ours)
        ledgers = await read_node_ledgers(client) or []
    events = describe_text.job_events(job, events_of_job, events_of_pods)
    sys.stdout.write(describe_text.describe(job, ours, events, datetime.now(UTC), node_labels, ledgers))
    return 0


async def _node_labels(client: ApiClient, job: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The labels of the pods' nodes when the job is placed by topology (a user who may not read
    nodes sees no domains, and the rest as before)."""
    from phalanx.cluster.client import ApiError

    if not ((job.get("spec") or {}).get("placement") or {}).get("topology"):
        return {}
    names = sorted({str(pod["spec"]["nodeName"]) for pod in pods if (pod.get("spec") or {}).get("nodeName")})
    labels: dict[str, dict[str, str]] = {}
    for name in names:
        try:
            node = await client.get("v1", "Node", None, name)
        except ApiError:
            continue
        labels[name] = dict((node.get("metadata") or {}).get("labels") or {})
    return labels


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "describe",
        help="show a TrainingJob's status, pods and events",
        description="Show a TrainingJob's status (phase, restarts and their budget, workers, last checkpoint,"
        " conditions), the pods of its attempts and the recent Events of the job and its pods.",
    )
    parser.add_argument("job", metavar="JOB", help="name of the TrainingJob")
    connection.add_options(parser)
    parser.set_defaults(func=lambda args: connection.execute(args, lambda: describe(args)))
