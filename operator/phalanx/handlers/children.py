"""Watch events on what the operator owns, and on nodes: they update caches and wake jobs.

Pods, Services and PodGroups are watched with a server-side label selector (our
``phalanx.dev/job-name`` label), so the operator never receives other workloads' pods.
No change handlers: event handlers cost no PATCH on the pod.
"""

from __future__ import annotations

import os
from typing import Any

import kopf

from phalanx.handlers.runtime import Runtime
from phalanx.reconcile import naming

OWNED = {naming.JOB_NAME_LABEL: kopf.PRESENT}


def _child_event(memo: kopf.Memo, event: kopf.RawEvent) -> None:
    runtime: Runtime = memo.runtime
    key = runtime.children.observe(event["type"], event["object"])
    if key is not None and runtime.jobs.get(key) is not None:
        runtime.queue.enqueue(key)


@kopf.on.event("", "v1", "pods", labels=OWNED, id="worker-pod-events")
async def pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """A worker or store pod changed."""
    _child_event(memo, event)


@kopf.on.event("", "v1", "services", labels=OWNED, id="service-events")
async def service_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """A rendezvous Service changed."""
    _child_event(memo, event)


@kopf.on.event("scheduling.x-k8s.io", "v1alpha1", "podgroups", labels=OWNED, id="coscheduling-podgroup-events")
async def coscheduling_pod_group_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """A scheduler-plugins PodGroup changed."""
    _child_event(memo, event)


@kopf.on.event("scheduling.volcano.sh", "v1beta1", "podgroups", labels=OWNED, id="volcano-podgroup-events")
async def volcano_pod_group_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """A Volcano PodGroup changed."""
    _child_event(memo, event)


async def node_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """A node's readiness changed: wake the jobs with pods on it (instead of waiting for eviction)."""
    runtime: Runtime = memo.runtime
    body = event["object"]
    if runtime.nodes.observe(event["type"], body):
        for key in runtime.children.jobs_on_node(body["metadata"]["name"]):
            runtime.queue.enqueue(key)


# Watching nodes is cluster-scoped; a namespaced install may leave it off (PHALANX_WATCH_NODES=0)
# and then learns of lost nodes only through pod conditions and evictions.
if os.environ.get("PHALANX_WATCH_NODES", "1") != "0":
    kopf.on.event("", "v1", "nodes", id="node-events")(node_event)
