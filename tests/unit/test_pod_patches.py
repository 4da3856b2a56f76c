"""The pod patches the planner builds (``reconcile.pod_patches``): the JSON patches the API server
receives, what they do to a pod, what their tests refuse, and ``ApiClient.patch_if`` sending them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from phalanx.cluster.client import ApiClient, ApiError
from phalanx.cluster.login import Credentials
from phalanx.reconcile import naming, pod_patches
from tests.unit import json_patch
from tests.unit.json_patch import PatchFailedError
from tests.unit.local_server import serving

ATTEMPT = "/metadata/labels/phalanx.dev~1attempt"
ROLE = "/metadata/labels/phalanx.dev~1role"


def worker(attempt: int = 0, *, role: str = naming.ROLE_WORKER, uid: str = "uid-1") -> dict[str, Any]:
    labels = {naming.ATTEMPT_LABEL: str(attempt), naming.ROLE_LABEL: role}
    if role == naming.ROLE_WORKER:
        labels[naming.WORKER_INDEX_LABEL] = "0"
    return {"metadata": {"name": "demo-worker-0", "uid": uid, "labels": labels, "annotations": {}}}


def test_pointers_escape_tilde_then_slash() -> None:
    assert pod_patches.label(naming.ATTEMPT_LABEL) == ATTEMPT
    assert pod_patches.pointer("metadata", "annotations", "a~b/c") == "/metadata/annotations/a~0b~1c"
    assert json_patch.tokens(pod_patches.pointer("a~1", "/")) == ["a~1", "/"]


def test_a_move_is_the_json_patch_an_in_place_restart_sent_before() -> None:
    move = pod_patches.move("demo-worker-0", "uid-1", 0, 1, "job-1")
    assert (move.name, move.uid, move.attempt, move.promotes_slot) == ("demo-worker-0", "uid-1", 1, None)
    assert move.body() == [
        {"op": "test", "path": "/metadata/uid", "value": "uid-1"},
        {"op": "test", "path": ATTEMPT, "value": "0"},
        {"op": "replace", "path": ATTEMPT, "value": "1"},
        {"op": "add", "path": "/metadata/annotations/phalanx.dev~1rendezvous-id", "value": "job-1"},
    ]
    assert move.tested(ATTEMPT) == "0" and move.written(ATTEMPT) == "1"


def test_a_promotion_tests_the_spare_role_and_writes_the_slot() -> None:
    promotion = pod_patches.promotion("demo-spare-0", "uid-2", 0, 1, "job-1", 3)
    assert (promotion.attempt, promotion.promotes_slot) == (1, 3)
    assert promotion.body() == [
        {"op": "test", "path": "/metadata/uid", "value": "uid-2"},
        {"op": "test", "path": ATTEMPT, "value": "0"},
        {"op": "test", "path": ROLE, "value": "spare"},
        {"op": "replace", "path": ROLE, "value": "worker"},
        {"op": "add", "path": "/metadata/labels/phalanx.dev~1worker-index", "value": "3"},
        {"op": "replace", "path": ATTEMPT, "value": "1"},
        {"op": "add", "path": "/metadata/annotations/phalanx.dev~1rendezvous-id", "value": "job-1"},
    ]


def test_a_rank_address_is_given_only_at_its_attempt() -> None:
    given = pod_patches.rank_address("demo-worker-0", "uid-1", 2, "a2-x.demo-ranks.ml.svc")
    assert given.body() == [
        {"op": "test", "path": "/metadata/uid", "value": "uid-1"},
        {"op": "test", "path": ATTEMPT, "value": "2"},
        {"op": "add", "path": "/metadata/annotations/phalanx.dev~1rank-address", "value": "a2-x.demo-ranks.ml.svc"},
    ]
    patched = json_patch.apply(worker(2), given.body())
    assert patched["metadata"]["annotations"][naming.RANK_ADDRESS_ANNOTATION] == "a2-x.demo-ranks.ml.svc"
    with pytest.raises(PatchFailedError):
        json_patch.apply(worker(1), given.body())


def test_a_move_applies_once_and_never_to_another_pod_of_the_name() -> None:
    move = pod_patches.move("demo-worker-0", "uid-1", 0, 1, "job-1")
    moved = json_patch.apply(worker(0), move.body())
    assert moved["metadata"]["labels"][naming.ATTEMPT_LABEL] == "1"
    assert moved["metadata"]["annotations"][naming.RENDEZVOUS_ID_ANNOTATION] == "job-1"
    with pytest.raises(PatchFailedError):
        json_patch.apply(moved, move.body())  # sent again: the pod has left attempt 0
    with pytest.raises(PatchFailedError):
        json_patch.apply(worker(0, uid="uid-9"), move.body())  # replaced by a pod of the same name


def test_a_promotion_applies_only_to_a_spare() -> None:
    promotion = pod_patches.promotion("demo-worker-0", "uid-1", 0, 1, "job-1", 2)
    promoted = json_patch.apply(worker(0, role=naming.ROLE_SPARE), promotion.body())
    labels = promoted["metadata"]["labels"]
    assert (labels[naming.ROLE_LABEL], labels[naming.WORKER_INDEX_LABEL], labels[naming.ATTEMPT_LABEL]) == (
        naming.ROLE_WORKER,
        "2",
        "1",
    )
    with pytest.raises(PatchFailedError):
        json_patch.apply(worker(0), promotion.body())


class PodServer:
    """Answers a pod's JSON patch by applying it, as the API server does (422 when a test fails)."""

    def __init__(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.app = web.Application()
        self.app.router.add_patch("/api/v1/namespaces/ml/pods/{name}", self.patch)

    async def patch(self, request: web.Request) -> web.Response:
        body = json.loads(await request.text())
        self.requests.append((request.path, request.content_type, dict(request.query), body))
        if request.match_info["name"] != self.pod["metadata"]["name"]:
            return web.json_response({"reason": "NotFound", "message": "not found"}, status=404)
        if request.match_info["name"] == "forbidden":
            return web.json_response({"reason": "Forbidden", "message": "forbidden"}, status=403)
        try:
            self.pod = json_patch.apply(self.pod, body)
        except PatchFailedError as error:
            return web.json_response({"reason": "Invalid", "message": str(error)}, status=422)
        return web.json_response(self.pod)


@pytest.fixture
async def pods() -> AsyncIterator[tuple[PodServer, ApiClient]]:
    backend = PodServer(worker(0))
    async with serving(backend.app) as url, ApiClient(Credentials(server=url), timeout=2) as client:
        yield backend, client


async def test_patch_if_sends_the_operations_as_a_json_patch(pods: tuple[PodServer, ApiClient]) -> None:
    backend, client = pods
    move = pod_patches.move("demo-worker-0", "uid-1", 0, 1, "job-1")
    answer = await client.patch_if("v1", "Pod", "ml", move.name, move.body())
    assert answer is not None and answer["metadata"]["labels"][naming.ATTEMPT_LABEL] == "1"
    path, content_type, query, body = backend.requests[0]
    assert (path, content_type, body) == (
        "/api/v1/namespaces/ml/pods/demo-worker-0",
        "application/json-patch+json",
        move.body(),
    )
    assert query == {"fieldManager": naming.FIELD_MANAGER}


async def test_patch_if_answers_none_when_its_tests_fail_or_the_pod_is_gone(pods: tuple[PodServer, ApiClient]) -> None:
    backend, client = pods
    move = pod_patches.move("demo-worker-0", "uid-1", 0, 1, "job-1")
    assert await client.patch_if("v1", "Pod", "ml", move.name, move.body()) is not None
    assert await client.patch_if("v1", "Pod", "ml", move.name, move.body()) is None  # 422: moved already
    assert await client.patch_if("v1", "Pod", "ml", "demo-worker-9", move.body()) is None  # 404
    assert backend.pod["metadata"]["labels"][naming.ATTEMPT_LABEL] == "1"


async def test_patch_if_raises_any_other_refusal() -> None:
    backend = PodServer({"metadata": {"name": "forbidden", "uid": "u"}})
    async with serving(backend.app) as url, ApiClient(Credentials(server=url), timeout=2) as client:
        with pytest.raises(ApiError) as refused:
            await client.patch_if(
                "v1", "Pod", "ml", "forbidden", [{"op": "test", "path": "/metadata/uid", "value": "u"}]
            )
    assert refused.value.status == 403
