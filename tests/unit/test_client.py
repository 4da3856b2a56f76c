"""The API client's retry policy, against a local HTTP server that misbehaves on purpose.

(The operator's behaviour is tested against a real API server; this tier only checks what the
client sends when a response is lost, throttled or slow.)
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import tempfile
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web

from phalanx.cluster import client as client_module
from phalanx.cluster.client import ApiClient, ApiError
from phalanx.cluster.events import EventRecorder
from phalanx.cluster.login import Credentials, Login
from phalanx.reconcile.actions import Event
from tests.unit.local_server import serving


class Server:
    """Counts requests by path; answers as each test tells it to."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.order: list[str] = []
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)
        self.behaviour: dict[str, str] = {}
        self.arrived = asyncio.Event()
        self.token = "new"  # what "token" paths accept

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        self.seen[path] = self.seen.get(path, 0) + 1
        self.order.append(path)
        self.arrived.set()
        what = self.behaviour.get(path, "ok")
        if what == "hang":
            await asyncio.sleep(2)
        if what == "slow":
            await asyncio.sleep(0.2)
        if what == "503":
            return web.json_response({"reason": "ServiceUnavailable", "message": "busy"}, status=503)
        if what == "token" and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"reason": "Unauthorized", "message": "Unauthorized"}, status=401)
        if what == "429-once" and self.seen[path] == 1:
            return web.json_response({"reason": "TooManyRequests", "message": "slow down"}, status=429)
        return web.json_response({"ok": True})


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, str]]:
    backend = Server()
    async with serving(backend.app) as url:
        yield backend, url


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "RETRY_DELAYS", (0.2, 0.2, 0.2))


async def test_a_post_whose_response_was_lost_is_not_sent_again(server: tuple[Server, str]) -> None:
    backend, url = server
    backend.behaviour["/api/v1/namespaces/ml/events"] = "hang"
    async with ApiClient(Credentials(server=url), timeout=0.3) as client:
        with pytest.raises(TimeoutError):
            await client.request("POST", "/api/v1/namespaces/ml/events", body={"reason": "x"})
    assert backend.seen["/api/v1/namespaces/ml/events"] == 1


async def test_reads_and_creates_with_fixed_names_are_sent_again_after_a_timeout(server: tuple[Server, str]) -> None:
    backend, url = server
    backend.behaviour["/slow"] = "hang"
    # Long enough that each try reaches the server even on a loaded machine (0.2 s once did not).
    async with ApiClient(Credentials(server=url), timeout=0.6) as client:
        with pytest.raises(TimeoutError):
            await client.request("GET", "/slow")
        with pytest.raises(TimeoutError):
            await client.request("POST", "/slow", body={}, idempotent=True)
    assert backend.seen["/slow"] == 2 * 4  # the first try and three retries, each time


async def test_throttling_is_retried_even_for_a_post(server: tuple[Server, str]) -> None:
    backend, url = server
    backend.behaviour["/api/v1/namespaces/ml/events"] = "429-once"
    async with ApiClient(Credentials(server=url)) as client:
        assert await client.request("POST", "/api/v1/namespaces/ml/events", body={}) == {"ok": True}
    assert backend.seen["/api/v1/namespaces/ml/events"] == 2


async def test_a_server_error_on_a_post_is_not_retried(server: tuple[Server, str]) -> None:
    backend, url = server
    backend.behaviour["/busy"] = "503"
    async with ApiClient(Credentials(server=url)) as client:
        with pytest.raises(ApiError) as raised:
            await client.request("POST", "/busy", body={})
    assert raised.value.status == 503 and backend.seen["/busy"] == 1


async def test_no_slot_is_held_while_waiting_to_retry(
    server: tuple[Server, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, url = server
    backend.behaviour["/busy"] = "503"
    monkeypatch.setattr(client_module, "RETRY_DELAYS", (30.0,))
    async with ApiClient(Credentials(server=url), max_in_flight=1) as client:
        failing = asyncio.create_task(client.request("GET", "/busy"))
        await asyncio.wait_for(backend.arrived.wait(), 10)
        # the only slot's owner now pauses 30 s before its retry; another request goes meanwhile
        assert await asyncio.wait_for(client.request("GET", "/fast"), 10) == {"ok": True}
        assert not failing.done()
        failing.cancel()
        await asyncio.gather(failing, return_exceptions=True)


def test_a_client_certificate_leaves_no_file_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key and certificate exist only while ssl reads them: a SIGKILLed operator leaves nothing."""
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj",
         "/CN=phalanx-test", "-days", "1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    credentials = Credentials(
        server="https://127.0.0.1:1", certificate_data=cert.read_bytes(), private_key_data=key.read_bytes()
    )
    context = client_module._ssl_context(credentials)
    assert isinstance(context, ssl.SSLContext)
    assert list(scratch.iterdir()) == []


async def test_a_freed_slot_goes_to_a_waiting_request_before_any_background_one() -> None:
    slots = client_module.RequestSlots(1)
    await slots.acquire()
    order: list[str] = []

    async def take(name: str, background: bool) -> None:
        await slots.acquire(background=background)
        order.append(name)
        slots.release()

    waiting = [
        asyncio.create_task(take("event", True)),
        asyncio.create_task(take("pod-1", False)),
        asyncio.create_task(take("pod-2", False)),
    ]
    await asyncio.sleep(0)
    assert slots.waiting() == 3
    slots.release()
    await asyncio.gather(*waiting)
    assert order == ["pod-1", "pod-2", "event"] and slots.in_flight == 0


async def test_a_request_cancelled_while_waiting_for_a_slot_loses_no_slot() -> None:
    slots = client_module.RequestSlots(1)
    await slots.acquire()
    cancelled = asyncio.create_task(slots.acquire())
    handed_over = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    cancelled.cancel()
    slots.release()  # the cancelled waiter is skipped: the slot goes to the next
    await handed_over
    assert cancelled.cancelled() and slots.in_flight == 1
    late = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    slots.release()  # handed to ``late``, which is cancelled before it runs: it passes the slot on
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    assert slots.in_flight == 0 and slots.waiting() == 0


async def test_events_wait_for_requests_that_came_after_them(server: tuple[Server, str]) -> None:
    backend, url = server
    backend.behaviour["/hold"] = "slow"
    job = {"metadata": {"name": "train", "namespace": "ml", "uid": "u1"}}
    async with ApiClient(Credentials(server=url), max_in_flight=1) as client:
        recorder = EventRecorder(client)
        senders = asyncio.create_task(recorder.run())
        holding = asyncio.create_task(client.request("GET", "/hold"))
        await backend.arrived.wait()  # the only slot is taken
        for reason in ("Pending", "Starting"):
            recorder.record(job, Event("Normal", reason, "..."), datetime.now(UTC))
        await asyncio.sleep(0.05)  # the senders wait for a slot now
        pods = [client.request("POST", f"/api/v1/namespaces/ml/pods/w{i}", body={}) for i in range(4)]
        await asyncio.gather(holding, *pods)
        while not recorder.idle():  # noqa: ASYNC110 - idle() is a poll by design
            await asyncio.sleep(0.01)
        senders.cancel()
    assert recorder.posted == 2
    assert backend.order == [
        "/hold",
        *(f"/api/v1/namespaces/ml/pods/w{i}" for i in range(4)),
        *2 * ["/api/v1/namespaces/ml/events"],
    ]


async def test_a_full_event_backlog_drops_the_oldest(server: tuple[Server, str]) -> None:
    backend, url = server
    job = {"metadata": {"name": "train", "namespace": "ml", "uid": "u1"}}
    async with ApiClient(Credentials(server=url)) as client:
        recorder = EventRecorder(client, backlog=2)
        for reason in ("First", "Second", "Third"):
            recorder.record(job, Event("Normal", reason, "..."), datetime.now(UTC))
        await recorder.flush(5)
    assert recorder.dropped == 1 and recorder.posted == 2 and backend.seen["/api/v1/namespaces/ml/events"] == 2


class RotatingLogin(Login):
    """A login whose every load hands out the token the server accepts at that moment."""

    def __init__(self, backend: Server, url: str) -> None:
        super().__init__()
        self.backend, self.url, self.loads = backend, url, 0

    def load(self) -> Credentials:
        self.loads += 1
        return Credentials(server=self.url, token=self.backend.token, source="test")

    def refresh(self) -> Credentials:
        raise AssertionError("not due within a test")


async def test_a_401_logs_in_again_once_and_the_request_goes_through(server: tuple[Server, str]) -> None:
    backend, url = server
    backend.behaviour["/api/v1/pods"] = "token"
    login = RotatingLogin(backend, url)
    async with ApiClient(Credentials(server=url, token="old"), login=login) as client:
        # many requests meet the expired token at once; one new login serves them all
        answers = await asyncio.gather(*(client.request("GET", "/api/v1/pods") for _ in range(5)))
        assert answers == [{"ok": True}] * 5
        assert (login.loads, client.logins, client.credentials.token) == (1, 1, "new")
        backend.token = "newer"  # rotated again
        assert await client.request("GET", "/api/v1/pods") == {"ok": True}
        assert login.loads == 2


async def test_a_401_that_new_credentials_do_not_cure_is_raised(server: tuple[Server, str]) -> None:
    backend, url = server
    backend.behaviour["/api/v1/pods"] = "token"
    backend.token = "only-the-server-knows"
    login = RotatingLogin(backend, url)
    login.load = lambda: Credentials(server=url, token="wrong")  # type: ignore[method-assign]
    async with ApiClient(Credentials(server=url, token="old"), login=login) as client:
        with pytest.raises(ApiError) as raised:
            await client.request("GET", "/api/v1/pods")
    assert raised.value.status == 401 and backend.seen["/api/v1/pods"] == 2  # tried once more, not forever
