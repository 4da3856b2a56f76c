"""The node ledger's ConfigMap I/O (``cluster.node_ledger``) against a small ConfigMap store that
checks resourceVersions as the API server does: two replicas' writes merge, each piece of evidence
once, nothing is written when nothing is new, and a replica that does not lead writes nothing."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from aiohttp import web

from phalanx.cluster.client import ApiClient, NotLeadingError
from phalanx.cluster.login import Credentials
from phalanx.cluster.node_ledger import NodeLedgerStore
from phalanx.handlers import trainingjob
from phalanx.reconcile import node_ledger
from phalanx.reconcile.node_ledger import Evidence, LedgerPolicy
from tests.unit.jobs import job
from tests.unit.local_server import serving
from tests.unit.simulation import START, World
from tests.unit.test_plan import running_with_worker_2_on_node_b

PATH = "/api/v1/namespaces/ops/configmaps"
POLICY = LedgerPolicy(half_life_seconds=3600.0, threshold=2.0)


class ConfigMapStore:
    """One namespace's ConfigMaps; a PUT with an old resourceVersion is a 409, as on the server."""

    def __init__(self) -> None:
        self.maps: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.requests: list[str] = []
        self.nodes: list[tuple[str, Any]] = []
        app = web.Application()
        app.router.add_post(PATH, self.create)
        app.router.add_get(PATH + "/{name}", self.get)
        app.router.add_put(PATH + "/{name}", self.replace)
        app.router.add_patch("/api/v1/nodes/{name}", self.patch_node)
        self.app = app

    def _stored(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(self.version)
        self.maps[body["metadata"]["name"]] = body
        return body

    async def create(self, request: web.Request) -> web.Response:
        self.requests.append("POST")
        body = await request.json()
        if body["metadata"]["name"] in self.maps:
            return web.json_response({"reason": "AlreadyExists", "message": "exists"}, status=409)
        return web.json_response(self._stored(body), status=201)

    async def get(self, request: web.Request) -> web.Response:
        self.requests.append("GET")
        found = self.maps.get(request.match_info["name"])
        if found is None:
            return web.json_response({"reason": "NotFound", "message": "no configmap"}, status=404)
        return web.json_response(found)

    async def replace(self, request: web.Request) -> web.Response:
        self.requests.append("PUT")
        body = await request.json()
        current = self.maps.get(request.match_info["name"])
        if current is None or body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return web.json_response({"reason": "Conflict", "message": "the object has been modified"}, status=409)
        return web.json_response(self._stored(body))

    async def patch_node(self, request: web.Request) -> web.Response:
        self.nodes.append((request.match_info["name"], await request.json()))
        return web.json_response({"metadata": {"name": request.match_info["name"]}})

    def ledger(self) -> node_ledger.Ledger:
        return node_ledger.of_data(self.maps["ledger"]["data"], POLICY)


@pytest.fixture
async def backend() -> AsyncIterator[tuple[ConfigMapStore, ApiClient]]:
    store = ConfigMapStore()
    async with serving(store.app) as url, ApiClient(Credentials(server=url), timeout=2) as client:
        yield store, client


def evidence(node: str, uid: str) -> Evidence:
    return Evidence(node=node, kind="NodeLost", at=START, job="ml/demo", pod_uid=uid)


async def test_two_replicas_writes_merge_and_count_each_pod_once(backend: tuple[ConfigMapStore, ApiClient]) -> None:
    store, client = backend
    a = NodeLedgerStore(client, "ops", "ledger", POLICY)
    b = NodeLedgerStore(client, "ops", "ledger", POLICY)
    await a.ready()
    await b.ready()  # both read it absent
    await a.record([evidence("node-a", "u1")], START)
    await b.record([evidence("node-a", "u1"), evidence("node-a", "u2")], START)  # 409 on create: read, merge
    await a.record([evidence("node-b", "u3")], START)  # a's resourceVersion is old: 409, read, merge
    assert store.requests.count("POST") == 2 and store.requests.count("PUT") == 3  # two conflicts, merged
    ledger = store.ledger()
    assert sorted(one.pod_uid for items in ledger.nodes.values() for one in items) == ["u1", "u2", "u3"]
    assert ledger.avoided(START) == {"node-a"}
    assert a.avoided(START) == {"node-a"}
    assert store.maps["ledger"]["metadata"]["labels"]["app.kubernetes.io/component"] == "node-ledger"


async def test_evidence_already_counted_writes_nothing(backend: tuple[ConfigMapStore, ApiClient]) -> None:
    store, client = backend
    ledger = NodeLedgerStore(client, "ops", "ledger", POLICY)
    await ledger.record([evidence("node-a", "u1")], START)
    before = list(store.requests)
    for _ in range(3):
        await ledger.record([evidence("node-a", "u1")], START + timedelta(seconds=1))
    assert store.requests == before


async def test_a_replica_that_does_not_lead_sends_no_write(backend: tuple[ConfigMapStore, ApiClient]) -> None:
    store, client = backend
    client.fence = lambda: False
    ledger = NodeLedgerStore(client, "ops", "ledger", POLICY)
    with pytest.raises(NotLeadingError):
        await ledger.record([evidence("node-a", "u1")], START)
    assert "POST" not in store.requests and "PUT" not in store.requests
    assert ledger.pending  # kept, for when it leads


async def test_cordoning_happens_only_when_asked_and_once_per_node(backend: tuple[ConfigMapStore, ApiClient]) -> None:
    store, client = backend
    quiet = NodeLedgerStore(client, "ops", "ledger", POLICY)
    await quiet.record([evidence("node-a", "u1"), evidence("node-a", "u2")], START)
    assert store.nodes == []  # past the threshold, but nobody asked for a cordon
    cordoning = NodeLedgerStore(client, "ops", "ledger", POLICY, cordon=True)
    await cordoning.record([evidence("node-a", "u3")], START)
    await cordoning.record([evidence("node-a", "u4")], START)
    assert store.nodes == [("node-a", {"spec": {"unschedulable": True}})]


async def test_a_pass_counts_its_pods_failures_and_plans_with_the_nodes_the_ledger_avoids(
    backend: tuple[ConfigMapStore, ApiClient],
) -> None:
    store, client = backend
    ledger = NodeLedgerStore(client, "ops", "ledger", LedgerPolicy(threshold=1.0))
    world = running_with_worker_2_on_node_b(World(job()))
    observed = await trainingjob._with_node_ledger(ledger, world.job, world.observed(), world.now)
    assert observed.ledger_avoided == frozenset() and "ledger" not in store.maps  # nothing failed, nothing written
    world.terminate("demo-worker-2", 1, message="RuntimeError: CUDA error: uncorrectable ECC error encountered")
    for _ in range(2):  # every pass sees the failed pod until it is gone
        observed = await trainingjob._with_node_ledger(ledger, world.job, world.observed(), world.now)
        assert observed.ledger_avoided == {"node-b"}
    [evidence] = store.ledger().nodes["node-b"]
    assert (evidence.kind, evidence.job) == ("GPUError", f"{world.job.metadata.namespace}/demo")
    assert store.requests.count("POST") == 1 and "PUT" not in store.requests  # written once
