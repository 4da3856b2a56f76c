"""An informer across an API server restart: the restarted server answers 403 (its RBAC
authorizer has not synced) and 404 (its CRD handlers have not) for a few seconds. Nodes listed
before must not be taken for deleted, which would let the operator force-delete every pod bound
to them."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from aiohttp import web

from phalanx.cluster import informer as informer_module
from phalanx.cluster.cache import NodeCache
from phalanx.cluster.client import ApiClient
from phalanx.cluster.informer import Informer, Resource
from phalanx.cluster.login import Credentials
from tests.unit.local_server import serving

NODES = Resource("v1", "nodes", "Node", namespaced=False)


def _node(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": "5"},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "allocatable": {"cpu": "4"}},
    }


class RestartingServer:
    """Lists two nodes, ends the first watch with 410 Gone, then refuses ``refusals`` lists with
    ``refusal_status`` before it lists the nodes again."""

    def __init__(self, refusals: int, refusal_status: int) -> None:
        self.refusals = refusals
        self.refusal_status = refusal_status
        self.lists = 0
        self.relisted = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/api/v1/nodes", self.nodes)

    async def nodes(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch"):
            if self.lists == 1:
                gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
                return web.json_response(gone)
            await asyncio.sleep(30)
            return web.json_response({})
        self.lists += 1
        if 1 < self.lists <= 1 + self.refusals:
            status = {"kind": "Status", "code": self.refusal_status, "reason": "Forbidden", "message": "RBAC: not yet"}
            return web.json_response(status, status=self.refusal_status)
        if self.lists > 1:
            self.relisted.set()
        return web.json_response({"metadata": {"resourceVersion": "5"}, "items": [_node("n1"), _node("n2")]})


@pytest.mark.parametrize("refusal_status", [403, 404])
async def test_a_listed_resource_refused_for_a_while_after_a_restart_is_not_taken_for_gone(
    refusal_status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(informer_module, "ERROR_DELAYS", (0.05,))
    server = RestartingServer(refusals=3, refusal_status=refusal_status)
    changed: list[str] = []
    nodes = NodeCache(on_change=changed.append)
    async with serving(server.app) as url, ApiClient(Credentials(server=url), timeout=5) as client:
        informer = Informer(client, NODES, nodes, watch_seconds=30, optional=True)
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(server.relisted.wait(), 10)
            await asyncio.wait_for(informer.synced.wait(), 5)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert server.lists == 5  # one list, three refused, one more
    assert not informer.absent
    assert nodes.deleted() == frozenset() and changed == []
    assert set(nodes.allocatable()) == {"n1", "n2"}


async def test_a_resource_refused_from_the_start_is_absent_at_once() -> None:
    server = RestartingServer(refusals=0, refusal_status=403)
    server.lists = 1  # every list from now on is refused
    server.refusals = 100
    nodes = NodeCache()
    async with serving(server.app) as url, ApiClient(Credentials(server=url), timeout=5) as client:
        informer = Informer(client, NODES, nodes, watch_seconds=30, optional=True)
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 5)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert informer.absent and "not permitted" in informer.absent_reason
    assert server.lists == 2


def test_nodes_that_may_no_longer_be_listed_are_unknown_not_deleted() -> None:
    changed: list[str] = []
    nodes = NodeCache(on_change=changed.append)
    unready = {"metadata": {"name": "n2"}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    nodes.replace("Node", None, [_node("n1"), unready], "7")
    assert nodes.unready() == frozenset({"n2"}) and set(nodes.allocatable()) == {"n1"}
    changed.clear()
    nodes.retain("Node", None, set(), "")  # the informer marked nodes absent (403 past the confirmation)
    assert nodes.deleted() == frozenset()
    assert nodes.unready() == frozenset() and nodes.allocatable() == {} and nodes.capacity() == ""
    assert changed == ["n2"]
    nodes.replace("Node", None, [_node("n1")], "8")  # listed again: n2 is gone now, but was never seen go
    assert nodes.deleted() == frozenset()
