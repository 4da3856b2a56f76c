"""A rank-address EndpointSlice the API server refuses never fails the job nor stops the pass:
rank addresses only order the ranks (each worker falls back to its pod IP), so the refusal is
recorded for status and the rest of the plan (failures, moves, deletions) still goes out. Seen in
the busy chaos run, where the API server refused a slice naming a loopback address."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from phalanx.cluster.apply import Execution, execute
from phalanx.cluster.cache import ChildCache, JobCache
from phalanx.cluster.client import ApiClient, ApiError
from phalanx.cluster.events import EventRecorder
from phalanx.cluster.login import Credentials
from phalanx.cluster.refusals import RANK_ADDRESSES_REFUSED, RefusalMemory, passing_refusal
from phalanx.reconcile.actions import Deletion
from phalanx.reconcile.plan import Plan
from tests.unit.local_server import serving
from tests.unit.simulation import START

SLICES = "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"
LOOPBACK = (
    'EndpointSlice.discovery.k8s.io "demo-ranks" is invalid: endpoints[0].addresses[0]: Invalid value: '
    '"127.77.0.82": may not be in the loopback range (127.0.0.0/8, ::1/128)'
)
JOB = {
    "apiVersion": "phalanx.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "demo", "namespace": "ml", "uid": "job-uid", "resourceVersion": "7"},
    "status": {"phase": "Running"},
}
OWNER = [
    {"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob", "name": "demo", "uid": "job-uid", "controller": True}
]


def ranks_slice(uid: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "demo-ranks", "namespace": "ml", "ownerReferences": OWNER}
    if uid is not None:
        metadata["uid"] = uid
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": metadata,
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["127.77.0.82"], "hostname": "a0-0", "conditions": {"ready": True}}],
    }


class Refusing:
    """Refuses every write of an EndpointSlice (422, as for a loopback address); records pod deletions."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        app = web.Application()
        app.router.add_post(SLICES, self.refuse)
        app.router.add_patch(SLICES + "/{name}", self.refuse)
        app.router.add_delete("/api/v1/namespaces/ml/pods/{name}", self.delete_pod)
        self.app = app

    async def refuse(self, request: web.Request) -> web.Response:
        self.requests.append(f"{request.method} endpointslice")
        body = {"kind": "Status", "reason": "Invalid", "message": LOOPBACK, "code": 422}
        return web.json_response(body, status=422)

    async def delete_pod(self, request: web.Request) -> web.Response:
        self.requests.append(f"DELETE pod {request.match_info['name']}")
        return web.json_response({"kind": "Status", "status": "Success"})


@pytest.fixture
async def refusing() -> AsyncIterator[tuple[Refusing, Execution]]:
    backend = Refusing()
    async with serving(backend.app) as url, ApiClient(Credentials(server=url), timeout=2) as client:
        yield backend, Execution(client, JobCache(), ChildCache(), RefusalMemory(), EventRecorder(client))


def worker_pod() -> dict[str, Any]:
    labels = {"phalanx.dev/job-name": "demo", "phalanx.dev/role": "worker", "phalanx.dev/worker-index": "1"}
    metadata = {
        "name": "demo-worker-1",
        "namespace": "ml",
        "uid": "pod-uid",
        "labels": labels,
        "ownerReferences": OWNER,
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {}, "status": {"phase": "Running"}}


@pytest.mark.parametrize("exists", [False, True], ids=["create", "update"])
async def test_a_refused_ranks_slice_is_said_in_status_and_the_rest_of_the_pass_goes_out(
    refusing: tuple[Refusing, Execution], exists: bool
) -> None:
    backend, run = refusing
    run.children.observe("ADDED", worker_pod())
    if exists:
        run.children.observe("ADDED", ranks_slice(uid="slice-uid"))
    plan = Plan(apply=(ranks_slice(),), delete=(Deletion("Pod", "demo-worker-1"),))
    await execute(plan, run, job=JOB, now=START)  # no AdmissionRefusedError, no ApiError
    method = "PATCH" if exists else "POST"
    assert backend.requests == [f"{method} endpointslice", "DELETE pod demo-worker-1"]
    (refusal,) = run.refusals.of("job-uid").values()
    assert refusal.reason == RANK_ADDRESSES_REFUSED and "loopback" in refusal.message


def test_only_the_ranks_slices_pass_whatever_refused_them() -> None:
    assert passing_refusal("EndpointSlice", ApiError(422, "Invalid", LOOPBACK)) == RANK_ADDRESSES_REFUSED
    assert passing_refusal("Service", ApiError(422, "Invalid", "Service is invalid")) is None
