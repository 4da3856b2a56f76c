"""A worker's metrics endpoint runs a tenant's code: whatever it serves must cost the operator a
bounded read and nothing else (issue 21, defect 4). Every page here comes from a real HTTP server
on the loopback interface, scraped by the real poller."""

from __future__ import annotations

import asyncio
import socket
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from phalanx.cluster.cache import ChildCache, JobCache
from phalanx.cluster.progress import MAX_PAGE_BYTES, ProgressPoller, metrics_url, parse_completion
from phalanx.reconcile.observed import PodRecord, pod_record
from tests.unit.local_server import serving
from tests.unit.test_progress import running_job_and_worker
from tests.unit.text_page import TextPage

KEY = ("ml", "demo")
PAGE_LINE = b"phalanx_worker_world_size 4\n"
BOUNDED_PEAK = 8 << 20  # the poller's allocations while it scrapes one hostile page


def failures(target: str = "worker") -> float:
    value = REGISTRY.get_sample_value(
        "phalanx_job_progress_scrape_failures_total", {"namespace": "ml", "name": "demo", "target": target}
    )
    return value or 0.0


def gzip_bomb(expanded: int) -> bytes:
    """A gzip body of a few hundred KiB that inflates to ``expanded`` bytes of metric lines."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = PAGE_LINE * ((1 << 20) // len(PAGE_LINE))
    parts = [packer.compress(block) for _ in range(expanded // len(block))]
    parts.append(packer.flush())
    return b"".join(parts)


@asynccontextmanager
async def worker_serving(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    async with serving(app) as base:
        port = urlsplit(base).port
        assert port is not None
        yield port


async def scrape_once(port: int, *, measure: bool = False) -> tuple[ProgressPoller, int]:
    """One poll of a job whose reporting worker serves on ``port``; returns the poller and the peak
    of what Python allocated meanwhile (when ``measure``)."""
    jobs, children = JobCache(), ChildCache()
    running_job_and_worker(jobs, children, ip="127.0.0.1", port=port)
    poller = ProgressPoller(jobs, children, lambda key: None, interval=60)
    async with poller:
        if measure:
            tracemalloc.start()
        try:
            await poller.poll_once()
            peak = tracemalloc.get_traced_memory()[1] if measure else 0
        finally:
            if measure:
                tracemalloc.stop()
    return poller, peak


def test_a_gzip_bomb_is_refused_unread_and_memory_stays_bounded() -> None:
    bomb = gzip_bomb(64 << 20)  # 64 MiB of metric lines in ~100 KiB
    assert len(bomb) < 1 << 20
    asked: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        asked.append(request.headers.get("Accept-Encoding", ""))
        return web.Response(body=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})

    async def scenario() -> tuple[ProgressPoller, int]:
        async with worker_serving(handler) as port:
            return await scrape_once(port, measure=True)

    before = failures()
    poller, peak = asyncio.run(scenario())
    assert asked == ["identity"]  # the poller asks for the page as it is
    assert poller.get(KEY) is None  # a page in an encoding it did not ask for is refused
    assert failures() == before + 1
    assert peak < BOUNDED_PEAK, f"scraping the bomb allocated {peak} bytes at its peak"


def test_a_100_mb_page_is_read_only_up_to_the_cap() -> None:
    chunk = PAGE_LINE * ((1 << 20) // len(PAGE_LINE))
    sent: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})  # chunked: no length to judge by
        await response.prepare(request)
        with_error = 0
        try:
            for _ in range(100):
                await response.write(chunk)
                with_error += len(chunk)
        except (ConnectionResetError, RuntimeError):
            pass  # the reader stopped reading
        sent.append(with_error)
        return response

    async def scenario() -> tuple[ProgressPoller, int]:
        async with worker_serving(handler) as port:
            return await scrape_once(port, measure=True)

    before = failures()
    poller, peak = asyncio.run(scenario())
    assert poller.get(KEY) is None and failures() == before + 1
    assert peak < BOUNDED_PEAK, f"scraping a 100 MB page allocated {peak} bytes at its peak"
    assert sent and sent[0] < 100 * len(chunk)  # the connection was dropped, not drained


def test_a_page_announced_over_the_cap_is_refused_before_its_body() -> None:
    page = TextPage("phalanx_worker_world_size 4\n" + "#" * MAX_PAGE_BYTES)
    with page:
        poller, _ = asyncio.run(scrape_once(page.port))
    assert poller.get(KEY) is None


def test_a_long_page_of_a_tenants_own_series_is_read_for_the_few_this_operator_needs() -> None:
    noise = "".join(f'tenant_series{{shard="{i}"}} {i}\n' for i in range(15000))
    text = noise + "phalanx_worker_world_size 6\nphalanx_worker_steps_total 12\n" + noise
    assert len(text.encode()) < MAX_PAGE_BYTES
    page = TextPage(text)
    with page:
        poller, _ = asyncio.run(scrape_once(page.port))
    progress = poller.get(KEY)
    assert progress is not None and (progress.world_size, progress.steps) == (6, 12)


def test_a_page_of_tiny_lines_up_to_the_cap_is_parsed_in_bounded_memory() -> None:
    page = TextPage("x 1\n" * ((MAX_PAGE_BYTES - 64) // 4) + "phalanx_worker_world_size 8\n")

    async def scenario() -> tuple[ProgressPoller, int]:
        return await scrape_once(page.port, measure=True)

    with page:
        poller, peak = asyncio.run(scenario())
    progress = poller.get(KEY)
    assert progress is not None and progress.world_size == 8
    assert peak < BOUNDED_PEAK, f"parsing a page of {MAX_PAGE_BYTES} bytes of tiny lines allocated {peak} at its peak"


def test_a_trickling_worker_costs_one_timeout_and_others_are_read_meanwhile() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        try:
            for _ in range(600):
                await response.write(b"#")
                await asyncio.sleep(0.05)
        except (ConnectionResetError, RuntimeError):
            pass
        return response

    good = TextPage("phalanx_worker_world_size 2\n")

    async def scenario() -> ProgressPoller:
        async with worker_serving(handler) as port:
            jobs, children = JobCache(), ChildCache()
            running_job_and_worker(jobs, children, ip="127.0.0.1", port=port)
            other = {
                "metadata": {"namespace": "ml", "name": "other", "uid": "uid-other", "resourceVersion": "5"},
                "status": {"phase": "Running", "attempt": 1},
            }
            jobs.update(other)
            children.observe("ADDED", worker_pod("other", "uid-other", good.port))
            poller = ProgressPoller(jobs, children, lambda key: None, interval=60, timeout=0.5)
            async with poller:
                await poller.poll_once()
            return poller

    before = failures()
    with good:
        poller = asyncio.run(scenario())
    assert poller.get(KEY) is None and failures() == before + 1
    other = poller.get(("ml", "other"))
    assert other is not None and other.world_size == 2


def test_redirects_are_not_followed() -> None:
    target = TextPage("phalanx_worker_world_size 3\n")
    hits: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        raise web.HTTPFound(f"http://127.0.0.1:{target.port}/metrics")

    async def scenario() -> tuple[ProgressPoller, int]:
        async with worker_serving(handler) as port:
            return await scrape_once(port)

    with target:
        poller, _ = asyncio.run(scenario())
    assert hits == ["/metrics"] and poller.get(KEY) is None  # the page it points to was never asked for


def worker_pod(name: str, job_uid: str, port: int, namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "namespace": namespace,
            "name": f"{name}-worker-0",
            "uid": f"{job_uid}-worker-0",
            "resourceVersion": "6",
            "labels": {
                "phalanx.dev/job-name": name,
                "phalanx.dev/role": "worker",
                "phalanx.dev/worker-index": "0",
                "phalanx.dev/attempt": "1",
            },
            "ownerReferences": [
                {"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob", "name": name, "uid": job_uid,
                 "controller": True}
            ],
        },
        "spec": {
            "containers": [{"name": "trainer", "ports": [{"name": "phalanx-metrics", "containerPort": port}]}],
            **spec,
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


def test_a_worker_on_its_nodes_network_is_never_scraped() -> None:
    """Its IP is the node's: the port answers for whatever runs there, not for the job."""
    node_port = TextPage("phalanx_worker_world_size 5\n")
    asked: list[int] = []
    node_port.text = "phalanx_worker_world_size 5\n"
    jobs, children = JobCache(), ChildCache()
    jobs.update(
        {"metadata": {"namespace": "ml", "name": "demo", "uid": "uid-demo", "resourceVersion": "1"},
         "status": {"phase": "Running", "attempt": 1}}
    )  # fmt: skip
    body = worker_pod("demo", "uid-demo", node_port.port, hostNetwork=True)
    assert pod_record(body).host_network
    children.observe("ADDED", body)
    poller = ProgressPoller(jobs, children, lambda key: asked.append(1), interval=60, timeout=0.5)

    async def once() -> None:
        async with poller:
            await poller.poll_once()

    with node_port:
        asyncio.run(once())
    assert poller.get(KEY) is None and asked == []
    assert metrics_url(pod_record(body), node_port.port) is None


def test_ipv6_pod_addresses_are_bracketed() -> None:
    pod = PodRecord("w", "worker", pod_ip="fd00:10:244::5")
    assert metrics_url(pod, 9400) == "http://[fd00:10:244::5]:9400/metrics"
    assert metrics_url(PodRecord("w", "worker", pod_ip="10.244.0.5"), 9400) == "http://10.244.0.5:9400/metrics"
    assert metrics_url(PodRecord("w", "worker", pod_ip="10.0.0.1:80/x?"), 9400) is None  # not an address


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_worker_on_an_ipv6_address_is_scraped() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(text="phalanx_worker_world_size 7\n")

    async def scenario() -> ProgressPoller:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "::1", 0)
        try:
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            jobs, children = JobCache(), ChildCache()
            running_job_and_worker(jobs, children, ip="::1", port=port)
            poller = ProgressPoller(jobs, children, lambda key: None, interval=60)
            async with poller:
                await poller.poll_once()
            return poller
        finally:
            await runner.cleanup()

    progress = asyncio.run(scenario()).get(KEY)
    assert progress is not None and progress.world_size == 7


def test_a_completion_record_names_its_job() -> None:
    text = (
        'phalanx_training_completed_attempt{job="uid-demo"} 2\n'
        'phalanx_training_completed_step{job="uid-demo"} 200\n'
        'phalanx_training_completed_rank{job="uid-demo"} 0\n'
    )
    done = parse_completion(text)
    assert done is not None and (done.job_uid, done.attempt, done.step, done.rank) == ("uid-demo", 2, 200, 0)
    unnamed = parse_completion("phalanx_training_completed_attempt 2\n")
    assert unnamed is not None and unnamed.job_uid == ""


def test_a_namespace_of_silent_endpoints_takes_turns_with_the_others() -> None:
    """Slots go round the namespaces with a job due: four silent jobs of one tenant hold up
    another namespace's job for one timeout, not four."""
    asked: list[str] = []

    async def silent(request: web.Request) -> web.StreamResponse:
        asked.append("silent")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def answering(request: web.Request) -> web.StreamResponse:
        asked.append("demo")
        return web.Response(text="phalanx_worker_world_size 2\n")

    async def scenario() -> ProgressPoller:
        async with worker_serving(silent) as silent_port, worker_serving(answering) as port:
            jobs, children = JobCache(), ChildCache()
            running_job_and_worker(jobs, children, ip="127.0.0.1", port=port)
            for index in range(4):  # "a-tenant" sorts first: served first, and in a plain queue all four would be
                name, uid = f"silent-{index}", f"uid-silent-{index}"
                jobs.update(
                    {"metadata": {"namespace": "a-tenant", "name": name, "uid": uid, "resourceVersion": "1"},
                     "status": {"phase": "Running", "attempt": 1}}
                )  # fmt: skip
                children.observe("ADDED", worker_pod(name, uid, silent_port, namespace="a-tenant"))
            poller = ProgressPoller(jobs, children, lambda key: None, interval=60, timeout=0.3, concurrency=1)
            async with poller:
                await poller.poll_once()
            return poller

    poller = asyncio.run(scenario())
    assert asked == ["silent", "demo", "silent", "silent", "silent"]
    progress = poller.get(KEY)
    assert progress is not None and progress.world_size == 2
