"""The gang's PodGroup for scheduler-plugins (Coscheduling) or Volcano. (Kueue makes its own
Workload from the pods' labels: the operator only reads it.)
"""

from __future__ import annotations

from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming
from phalanx.reconcile.desired.objects import Object, child_metadata, template_spec, with_spec_hash
from phalanx.reconcile.desired.pods import worker_requests
from phalanx.reconcile.environment import Launch
from phalanx.reconcile.quantity import format_quantity

COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
VOLCANO_TOPOLOGY_TIER = 1
"""The HyperNode tier a Volcano gang may span: configure Volcano's discovery so that tier 1 is the
domains of placement.topology.key (docs/placement.md)."""


def pod_group(job: api.TrainingJob, launch: Launch, node_capacity: str | None = None) -> Object | None:
    """The gang's PodGroup for scheduler-plugins or Volcano; None for other schedulers.

    ``node_capacity`` is stamped on a coscheduling PodGroup (see ``naming.NODE_CAPACITY_ANNOTATION``).
    """
    gang = job.spec.gang
    if gang.scheduler not in ("scheduler-plugins", "volcano"):
        return None
    minimum = job.spec.workers.min
    per_pod = worker_requests(job, launch)
    min_resources = {name: format_quantity(value * minimum) for name, value in sorted(per_pod.items())}
    spec: dict[str, Any] = {"minMember": minimum}
    if min_resources:
        spec["minResources"] = min_resources
    if gang.scheduler == "scheduler-plugins":
        api_version = COSCHEDULING_API
        if gang.schedule_timeout_seconds is not None:
            spec["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
    else:
        api_version = VOLCANO_API
        if gang.queue:
            spec["queue"] = gang.queue
        priority = template_spec(job).get("priorityClassName")
        if priority:
            spec["priorityClassName"] = priority
        topology = job.spec.placement.topology if job.spec.placement is not None else None
        if topology is not None:  # Volcano's HyperNodes: tier 1 is the lowest above the nodes
            spec["networkTopology"] = {
                "mode": "hard" if topology.mode == "required" else "soft",
                "highestTierAllowed": VOLCANO_TOPOLOGY_TIER,
            }
    annotations = {naming.NODE_CAPACITY_ANNOTATION: node_capacity} if node_capacity else None
    return with_spec_hash(
        {
            "apiVersion": api_version,
            "kind": "PodGroup",
            "metadata": child_metadata(job, naming.pod_group_name(job.metadata.name), annotations=annotations),
            "spec": spec,
        }
    )
