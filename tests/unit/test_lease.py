"""Leader election's rules against a small Lease store that checks resourceVersions as the API
server does (the real control plane is in tests/integration/test_leader_election.py)."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from phalanx.cli.run import check_settings
from phalanx.cluster.client import ApiClient, NotLeadingError
from phalanx.cluster.lease import LeaderElector, LeaseTiming
from phalanx.cluster.login import Credentials
from phalanx.handlers import lifecycle
from phalanx.handlers.settings import LEADER_ELECTION_ENV, LEASE_DURATION_ENV, RENEW_DEADLINE_ENV, RETRY_ENV, Settings
from tests.unit.local_server import serving

PATH = "/apis/coordination.k8s.io/v1/namespaces/ops/leases"
FAST = LeaseTiming(lease_duration=3, renew_deadline=0.5, retry=0.1)  # about the shortest the margin allows


class LeaseStore:
    """One namespace's Leases; a write with an old resourceVersion is a 409, as on the server."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.unavailable = False
        self.renewals = 0  # successful writes of a Lease
        self.writes: list[str] = []  # other requests than the Lease's, as "METHOD path"
        self.slow = asyncio.Event()  # other requests wait for it (a slow API server)
        self.slow.set()
        self.stall_next_read = 0.0  # seconds the next read of a Lease stalls the whole process
        app = web.Application()
        app.router.add_post(PATH, self.create)
        app.router.add_get(PATH + "/{name}", self.get)
        app.router.add_put(PATH + "/{name}", self.replace)
        app.router.add_route("*", "/api/v1/{tail:.*}", self.other)
        self.app = app

    async def other(self, request: web.Request) -> web.Response:
        self.writes.append(f"{request.method} {request.path}")
        await self.slow.wait()
        return web.json_response({"kind": "Status", "status": "Success"}, status=201)

    def _stored(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        body = copy.deepcopy(body)
        self.renewals += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.leases[body["metadata"]["name"]] = body
        return body

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["metadata"]["name"] in self.leases:
            return web.json_response({"reason": "AlreadyExists", "message": "exists"}, status=409)
        return web.json_response(self._stored(body), status=201)

    async def get(self, request: web.Request) -> web.Response:
        stall, self.stall_next_read = self.stall_next_read, 0.0
        time.sleep(stall)  # noqa: ASYNC251 - the server shares the process: all of it stalls (as under SIGSTOP)
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
    await asyncio.sleep(FAST.lease_duration + 3 * FAST.retry)  # a renews all along: b never gets it
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


def test_lease_timing_keeps_a_margin_between_renew_deadline_plus_retry_and_the_lease_duration() -> None:
    assert LeaseTiming() == LeaseTiming(15, 10, 2)  # controller-runtime's defaults
    LeaseTiming(137, 107, 26)  # kube-controller-manager's ratio on OpenShift
    with pytest.raises(ValueError, match=r"renew deadline \(7 s\) \+ retry period \(2 s\) \+ 2 s <= lease duration"):
        LeaseTiming(10, 7, 2)  # the former defaults: 1 s between them
    with pytest.raises(ValueError, match=r"1.2 x retry period"):
        LeaseTiming(30, 2.4, 2)  # client-go: renewDeadline > JitterFactor * retryPeriod
    with pytest.raises(ValueError, match=r"0 < "):
        LeaseTiming(15, 10, 0)
    electing = {LEADER_ELECTION_ENV: "1"}
    environ = {**electing, LEASE_DURATION_ENV: "8", RENEW_DEADLINE_ENV: "4", RETRY_ENV: "1"}
    assert timing_of(environ) == LeaseTiming(8, 4, 1)
    assert timing_of(electing) == LeaseTiming()
    with pytest.raises(ValueError, match="PHALANX_LEASE_RETRY_SECONDS='soon' is not a number"):
        timing_of({**electing, RETRY_ENV: "soon"})
    # `phalanx run` refuses to start on them, with election on only
    check_settings({LEASE_DURATION_ENV: "10", RENEW_DEADLINE_ENV: "7"})
    with pytest.raises(SystemExit, match="phalanx run: leader election needs renew deadline"):
        check_settings({"PHALANX_LEADER_ELECTION": "1", LEASE_DURATION_ENV: "10", RENEW_DEADLINE_ENV: "7"})


def timing_of(environ: dict[str, str]) -> LeaseTiming:
    election = Settings.from_environment(environ).leader_election
    assert election is not None
    return election.timing


async def test_renewals_never_wait_behind_the_operators_other_requests(
    store: tuple[LeaseStore, ApiClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The elector as the operator wires it (``lifecycle.leader_elector``) keeps renewing while the
    operator's client has every request slot taken by writes a slow API server does not answer."""
    backend, client = store
    for name, value in {
        "PHALANX_LEADER_ELECTION": "1",
        "PHALANX_LEASE_NAMESPACE": "ops",
        "PHALANX_LEASE_NAME": "op",
        "PHALANX_LEADER_IDENTITY": "a",
        LEASE_DURATION_ENV: str(FAST.lease_duration),
        RENEW_DEADLINE_ENV: str(FAST.renew_deadline),
        RETRY_ENV: str(FAST.retry),
    }.items():
        monkeypatch.setenv(name, value)
    a = lifecycle.leader_elector(client, Settings.from_environment())
    assert a is not None
    await a.acquire()
    holding = asyncio.create_task(a.hold())
    backend.slow.clear()
    flood = [
        asyncio.create_task(client.request("POST", "/api/v1/namespaces/ops/pods", body={}))
        for _ in range(4 * client.max_in_flight)
    ]
    await asyncio.sleep(0.1)
    assert client.slots.waiting() > 0  # every slot taken, more waiting
    renewed_before = backend.renewals
    await asyncio.sleep(3 * FAST.renew_deadline)  # within the client's timeout
    assert not holding.done() and a.holds_lease()
    assert backend.renewals - renewed_before >= 3 * FAST.renew_deadline / FAST.retry / 2
    backend.slow.set()
    await asyncio.gather(*flood)
    holding.cancel()
    await a.client.close()


async def test_a_leader_stalled_past_its_renew_deadline_writes_nothing_until_it_has_renewed(
    store: tuple[LeaseStore, ApiClient],
) -> None:
    backend, client = store
    a = LeaderElector(client.dedicated(), "ops", "op", "a", FAST)
    client.fence = a.holds_lease

    async def write() -> None:
        await client.request("POST", "/api/v1/namespaces/ops/events", body={})

    with pytest.raises(NotLeadingError):
        await write()  # a standby writes nothing
    await a.acquire()
    await write()
    time.sleep(FAST.renew_deadline)  # noqa: ASYNC251 - the whole process stalls (as under SIGSTOP)
    assert a.leading.is_set()  # nothing has noticed anything yet...
    assert not a.holds_lease()  # ...but by its clock the Lease may be lapsing
    sent = list(backend.writes)
    with pytest.raises(NotLeadingError):
        await write()
    assert backend.writes == sent  # refused before it was sent
    assert await a.try_acquire_or_renew()  # renewed (nobody took the Lease meanwhile)
    assert a.holds_lease()
    await write()
    assert len(backend.writes) == len(sent) + 1
    await a.client.close()


async def test_a_leader_stalled_in_the_middle_of_a_renewal_renews_again_at_once(
    store: tuple[LeaseStore, ApiClient], caplog: pytest.LogCaptureFixture
) -> None:
    """The round's timer fires late when the process wakes: a round cut short, not one refused. The
    leader renews at once, as one stalled between two rounds does, and leads on."""
    backend, client = store
    a = elector(client, "a")
    await a.acquire()
    holding = asyncio.create_task(a.hold())
    backend.stall_next_read = FAST.renew_deadline + 3 * FAST.retry
    await asyncio.sleep(backend.stall_next_read + 5 * FAST.retry)
    assert backend.stall_next_read == 0.0 and "stalled" in caplog.text
    assert not holding.done() and a.holds_lease() and backend.holder() == "a"
    holding.cancel()


@pytest.mark.parametrize(
    ("method", "body", "checks_before_it_closes"),
    [
        ("POST", {}, 1),  # closes while a connection is taken
        ("POST", {}, 2),  # closes in the event loop's turn before the body goes out
        ("DELETE", None, 1),  # no body: the connection's check is the last
    ],
)
async def test_a_fence_that_closes_on_the_way_out_stops_the_write_before_any_byte_is_sent(
    store: tuple[LeaseStore, ApiClient], method: str, body: dict[str, Any] | None, checks_before_it_closes: int
) -> None:
    """The Lease lapses (the process stalls or is frozen) after the write passed the first checks."""
    backend, client = store
    asked = 0

    def fence() -> bool:
        nonlocal asked
        asked += 1
        return asked <= checks_before_it_closes

    client.fence = fence
    with pytest.raises(NotLeadingError):
        await client.request(method, "/api/v1/namespaces/ops/events/e", body=body)
    assert backend.writes == []  # the server saw no request at all
    assert asked == checks_before_it_closes + 1
    client.fence = lambda: True  # the client is still good: its connection was released or closed
    await client.request(method, "/api/v1/namespaces/ops/events/e", body=body)
    assert backend.writes == [f"{method} /api/v1/namespaces/ops/events/e"]
