"""Operator start-up and shut-down: kopf settings, the API client, informers, the work queue.

kopf runs the process (login, liveness probe, signals, start-up and clean-up handlers); the
operator's own informers do the watching (see ``cluster.informer`` for why), so kopf watches
nothing itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
from prometheus_client import start_http_server

from phalanx.cluster.client import DEFAULT_MAX_IN_FLIGHT, ApiClient
from phalanx.cluster.progress import ProgressPoller
from phalanx.cluster.workqueue import WorkQueue
from phalanx.handlers import trainingjob
from phalanx.handlers.runtime import Runtime, credentials_from, watched_namespaces
from phalanx.reconcile import naming

logger = logging.getLogger(__name__)
RESTART_DELAY_SECONDS = 5.0
EVENT_FLUSH_SECONDS = 5.0  # at shut-down, within the pod's grace period


def _setting(name: str, default: int) -> int:
    """Operator settings come from the environment (the chart sets them), read at start-up."""
    return int(os.environ.get(name, str(default)))


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The same credentials kopf finds: a service account in a pod, else the kubeconfig."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.PermanentError("no Kubernetes credentials: neither a service account nor a kubeconfig")
    return info


def supervised(name: str, work: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
    """Run ``work`` until cancelled; if it ever raises, log it and start it again."""

    async def keep_running() -> None:
        while True:
            try:
                await work()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("%s stopped; starting it again in %.0fs", name, RESTART_DELAY_SECONDS)
            await asyncio.sleep(RESTART_DELAY_SECONDS)

    return asyncio.create_task(keep_running(), name=name)


@kopf.on.startup(id="phalanx-startup")
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Configure kopf, then start the client, the informers and the reconcile workers."""
    settings.persistence.finalizer = naming.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=naming.PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=naming.PREFIX, key="last-handled-configuration"
    )
    settings.posting.reporting_component = "phalanx"
    settings.posting.enabled = False  # we post our own events, with our own reasons
    settings.scanning.disabled = True  # least privilege: no watch on CRDs or namespaces
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10

    info = login(settings=settings)
    client = ApiClient(
        credentials_from(info),
        max_in_flight=_setting("PHALANX_MAX_IN_FLIGHT", DEFAULT_MAX_IN_FLIGHT),
        timeout=float(_setting("PHALANX_REQUEST_TIMEOUT_SECONDS", 30)),
    )
    runtime: Runtime | None = None

    async def handle(key: tuple[str, str]) -> float | None:
        assert runtime is not None
        return await trainingjob.reconcile(runtime, key)

    runtime = Runtime.start(
        client,
        WorkQueue(handle, workers=_setting("PHALANX_RECONCILE_WORKERS", 8)),
        namespaces=watched_namespaces(),
        watch_nodes=os.environ.get("PHALANX_WATCH_NODES", "1") != "0",
        watch_seconds=_setting("PHALANX_WATCH_SECONDS", 300),
    )
    runtime.pacer.interval = float(_setting("PHALANX_STATUS_PROGRESS_SECONDS", 5))
    runtime.pacer.busy = lambda: runtime is not None and runtime.queue.backlog() > 0
    runtime.queue.start()
    interval = _setting("PHALANX_PROGRESS_INTERVAL_SECONDS", 15)
    if interval > 0:
        runtime.progress = ProgressPoller(runtime.jobs, runtime.children, runtime.queue.enqueue, interval=interval)
    tasks = [supervised(name, work) for name, work in runtime.background()]
    memo.tasks = tasks
    memo.runtime = runtime
    metrics_port = _setting("PHALANX_METRICS_PORT", 8000)
    if metrics_port:
        start_http_server(metrics_port)
        logger.info("metrics on :%d/metrics", metrics_port)


@kopf.on.cleanup(id="phalanx-cleanup")
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop the informers and workers, and close connections."""
    tasks: list[asyncio.Task[None]] = getattr(memo, "tasks", [])
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    runtime: Runtime | None = getattr(memo, "runtime", None)
    if runtime is not None:
        await runtime.queue.stop()
        await runtime.events.flush(EVENT_FLUSH_SECONDS)
        await runtime.client.close()


@kopf.on.probe(id="reconcile-queue")
def probe(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    """Liveness detail: requests sent, pods tracked, whether every watch is synced."""
    runtime: Runtime | None = getattr(memo, "runtime", None)
    if runtime is None:
        return {"ready": False}
    return {"requests": runtime.client.requests, "pods": runtime.children.pod_count(), "synced": runtime.synced()}
