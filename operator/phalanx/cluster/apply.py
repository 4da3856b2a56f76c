"""Carry out a Plan against the API server, feeding every response back into the caches.

Order matters for crash safety: status first (it records a new attempt before the
old pods go), then the gang's PodGroup, the Service and the store, then workers in
parallel (bounded by the client's cap), then deletions, then events.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.cluster.cache import ChildCache, JobCache
from phalanx.cluster.client import ApiClient, ApiError
from phalanx.reconcile import naming
from phalanx.reconcile.plan import Event, Plan, status_changed
from phalanx.reconcile.status import format_time

logger = logging.getLogger(__name__)

REPORTING_COMPONENT = "phalanx"
MAX_EVENT_MESSAGE = 1024


class AdmissionRefusedError(Exception):
    """The API server refused to create a child (validation, Pod Security, a webhook)."""

    def __init__(self, name: str, error: ApiError) -> None:
        super().__init__(f"creating {name} was refused: {error.message}")
        self.name = name
        self.error = error


def refusal(error: ApiError) -> bool:
    """Whether an apply error is permanent for this spec (retrying cannot help)."""
    if error.status == 422:
        return True
    return error.status == 403 and "exceeded quota" not in error.message


async def _apply_one(client: ApiClient, children: ChildCache, obj: Mapping[str, Any]) -> None:
    try:
        response = await client.apply(obj)
    except ApiError as error:
        if refusal(error):
            raise AdmissionRefusedError(f"{obj['kind']} {obj['metadata']['name']}", error) from error
        raise
    children.observe("MODIFIED", response)


async def post_event(client: ApiClient, job: Mapping[str, Any], event: Event, now: datetime) -> None:
    """Record a core/v1 Event on the TrainingJob (best effort: events are not state)."""
    metadata = job["metadata"]
    stamp = format_time(now)
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{metadata['name']}.{uuid.uuid4().hex[:16]}", "namespace": metadata["namespace"]},
        "involvedObject": {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "uid": metadata.get("uid", ""),
        },
        "reason": event.reason,
        "message": event.message[:MAX_EVENT_MESSAGE],
        "type": event.type,
        "source": {"component": REPORTING_COMPONENT},
        "reportingComponent": REPORTING_COMPONENT,
        "reportingInstance": REPORTING_COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    try:
        await client.request("POST", f"/api/v1/namespaces/{metadata['namespace']}/events", body=body)
    except ApiError as error:
        logger.warning("could not record event %s on %s: %s", event.reason, metadata["name"], error)


async def execute(
    plan: Plan, *, client: ApiClient, job: Mapping[str, Any], jobs: JobCache, children: ChildCache, now: datetime
) -> None:
    """Apply the plan. Raises AdmissionRefusedError when the API server refuses a child."""
    metadata = job["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    if plan.status and status_changed(job.get("status"), plan.status):
        try:
            updated = await client.patch_status(api.API_VERSION, api.PLURAL, namespace, name, plan.status)
        except ApiError as error:
            if error.status == 404:
                return
            raise
        jobs.update(updated)

    ordered = [
        obj
        for obj in plan.apply
        if obj["kind"] != "Pod" or obj["metadata"]["labels"].get(naming.ROLE_LABEL) != naming.ROLE_WORKER
    ]
    workers = [obj for obj in plan.apply if obj not in ordered]
    for obj in ordered:
        await _apply_one(client, children, obj)
    await asyncio.gather(*(_apply_one(client, children, obj) for obj in workers))

    async def remove(kind: str, child: str, grace: int | None) -> None:
        await client.delete("v1", kind, namespace, child, grace_seconds=grace)
        children.mark_deleting((namespace, name), child)

    await asyncio.gather(*(remove(d.kind, d.name, d.grace_seconds) for d in plan.delete))
    for event in plan.events:
        await post_event(client, job, event, now)
    if plan.delete_job:
        await client.delete(api.API_VERSION, api.KIND, namespace, name, plural=api.PLURAL)
