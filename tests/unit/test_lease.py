"""Leader election's rules against a small Lease store that checks resourceVersions as the API
server does (the real control plane is in tests/integration/test_leader_election.py)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from phalanx.cluster.client import ApiClient
from phalanx.cluster.lease import LeaderElector, LeaseTiming
from phalanx.cluster.login import Credentials
from tests.unit.local_server import serving

PATH = "/apis/coordination.k8s.io/v1/namespaces/ops/leases"
FAST = LeaseTiming(lease_duration=0.6, renew_deadline=0.4, retry=0.1)


class LeaseStore:
    """One namespace's Leases; a write with an old resourceVersion is a 409, as on the server."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.unavailable = False
        app = web.Application()
        app.router.add_post(PATH, self.create)
        app.router.add_get(PATH + "/{name}", self.get)
        app.router.add_put(PATH + "/{name}", self.replace)
        self.app = app

    def _stored(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(self.version)
        self.leases[body["metadata"]["name"]] = body
        return body

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["metadata"]["name"] in self.leases:
            return web.json_response({"reason": "AlreadyExists", "message": "exists"}, status=409)
        return web.json_response(self._stored(body), status=201)

    async def get(self, request: web.Request) -> web.Response:
        if self.unavailable:
            return web.json_response({"reason": "ServiceUnavailable", "message": "down"}, status=503)
        lease = self.leases.get(request.match_info["name"])
        if lease is None:
            return web.json_response({"reason": "NotFound", "message": "no lease"}, status=404)
        return web.json_response(lease)

    async def replace(self, request: web.Request) -> web.Response:
        if self.unavailable:
            return web.json_response({"reason": "ServiceUnavailable", "message": "down"}, status=503)
        body = await request.json()
        current = self.leases.get(request.match_info["name"])
        if current is None or body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return web.json_response({"reason": "Conflict", "message": "the object has been modified"}, status=409)
        return web.json_response(self._stored(body))

    def holder(self) -> str | None:
        lease = self.leases.get("op")
        return None if lease is None else lease["spec"].get("holderIdentity")


@pytest.fixture
async def store() -> AsyncIterator[tuple[LeaseStore, ApiClient]]:
    backend = LeaseStore()
    async with serving(backend.app) as url, ApiClient(Credentials(server=url), timeout=2) as client:
        yield backend, client


def elector(client: ApiClient, identity: str) -> LeaderElector:
    return LeaderElector(client, "ops", "op", identity, FAST)


async def test_one_candidate_leads_and_the_other_takes_over_only_after_the_lease_lapses(
    store: tuple[LeaseStore, ApiClient],
) -> None:
    backend, client = store
    a, b = elector(client, "a"), elector(client, "b")
    await asyncio.wait_for(a.acquire(), 5)
    holding = asyncio.create_task(a.hold())
    waiting = asyncio.create_task(b.acquire())
    await asyncio.sleep(3 * FAST.lease_duration)  # a renews all along: b never gets it
    assert backend.holder() == "a" and not waiting.done()
    holding.cancel()  # a stops renewing (as if killed): b waits out the duration by its own clock
    stopped = asyncio.get_running_loop().time()
    await asyncio.wait_for(waiting, 5)
    assert backend.holder() == "b" and b.leading.is_set()
    assert asyncio.get_running_loop().time() - stopped >= FAST.lease_duration - FAST.retry
    assert backend.leases["op"]["spec"]["leaseTransitions"] == 1


async def test_a_released_lease_is_taken_at_once(store: tuple[LeaseStore, ApiClient]) -> None:
    backend, client = store
    a, b = elector(client, "a"), elector(client, "b")
    await a.acquire()
    await b.try_acquire_or_renew()  # b has seen a holding it
    await a.release()
    assert backend.holder() is None
    assert await b.try_acquire_or_renew()  # no waiting out the duration


async def test_a_leader_that_cannot_renew_gives_up_within_the_renew_deadline(
    store: tuple[LeaseStore, ApiClient],
) -> None:
    backend, client = store
    a = elector(client, "a")
    await a.acquire()
    backend.unavailable = True
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(a.hold(), 5)
    assert not a.leading.is_set()
    assert asyncio.get_running_loop().time() - started < FAST.lease_duration + FAST.retry  # before anyone takes over


async def test_two_candidates_racing_for_a_lapsed_lease_cannot_both_win(store: tuple[LeaseStore, ApiClient]) -> None:
    backend, client = store
    a, b = elector(client, "a"), elector(client, "b")
    await a.try_acquire_or_renew()
    await a.release()
    won = await asyncio.gather(a.try_acquire_or_renew(), b.try_acquire_or_renew())
    assert sorted(won) == [False, True], won  # one compare-and-swap succeeds, the other gets 409
    assert backend.holder() in ("a", "b")
