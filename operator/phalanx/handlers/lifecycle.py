"""Operator start-up and shut-down: kopf settings, the API client, caches, the work queue."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf
from prometheus_client import start_http_server

from phalanx.cluster.client import ApiClient
from phalanx.cluster.progress import ProgressPoller
from phalanx.cluster.workqueue import WorkQueue
from phalanx.handlers import trainingjob
from phalanx.handlers.runtime import Runtime, credentials_from
from phalanx.reconcile import naming
from phalanx.reconcile.environment import WORKER_METRICS_PORT

logger = logging.getLogger(__name__)


def _setting(name: str, default: int) -> int:
    """Operator settings come from the environment (the chart sets them), read at start-up."""
    return int(os.environ.get(name, str(default)))


def _login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.PermanentError("no Kubernetes credentials: neither a service account nor a kubeconfig")
    return info


@kopf.on.startup(id="phalanx-startup")
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Configure kopf, then start the client and the reconcile workers."""
    settings.persistence.finalizer = naming.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=naming.PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=naming.PREFIX, key="last-handled-configuration"
    )
    settings.posting.reporting_component = "phalanx"
    settings.posting.enabled = False  # we post our own events, with our own reasons
    settings.scanning.disabled = True  # least privilege: no watch on CRDs or namespaces
    # Bound every request: kopf's default lets a LIST hang for 5 minutes, and one answered while a
    # just-installed CRD's storage initialises (429, then a stalled retry) left the operator deaf to
    # TrainingJobs that long. Watches end server-side and are resumed from their resourceVersion.
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    # Event handlers run for every watched pod change; their per-event success lines are noise.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # Only our children cross the wire: filter pods and services on the server.
    for resource in (
        ("", "v1", "pods"),
        ("", "v1", "services"),
        ("scheduling.x-k8s.io", "v1alpha1", "podgroups"),
        ("scheduling.volcano.sh", "v1beta1", "podgroups"),
    ):
        settings.watching.label_selectors[resource] = naming.JOB_NAME_LABEL

    client = ApiClient(credentials_from(_login(settings)), max_in_flight=_setting("PHALANX_MAX_IN_FLIGHT", 16))
    runtime: Runtime | None = None

    async def handle(key: tuple[str, str]) -> float | None:
        assert runtime is not None
        return await trainingjob.reconcile(runtime, key)

    runtime = Runtime(client=client, queue=WorkQueue(handle, workers=_setting("PHALANX_RECONCILE_WORKERS", 8)))
    runtime.queue.start()
    interval = _setting("PHALANX_PROGRESS_INTERVAL_SECONDS", 15)
    if interval > 0:
        runtime.progress = ProgressPoller(
            runtime.jobs, runtime.children, runtime.queue.enqueue, port=WORKER_METRICS_PORT, interval=interval
        )
        memo.progress_task = asyncio.create_task(runtime.progress.run(), name="phalanx-progress")
    memo.runtime = runtime
    metrics_port = _setting("PHALANX_METRICS_PORT", 8000)
    if metrics_port:
        start_http_server(metrics_port)
        logger.info("metrics on :%d/metrics", metrics_port)


@kopf.on.cleanup(id="phalanx-cleanup")
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop the workers and close connections."""
    task: asyncio.Task[None] | None = getattr(memo, "progress_task", None)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    runtime: Runtime | None = getattr(memo, "runtime", None)
    if runtime is not None:
        await runtime.queue.stop()
        await runtime.client.close()


@kopf.on.probe(id="reconcile-queue")
def probe(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    """Liveness detail: requests sent and pods tracked."""
    runtime: Runtime | None = getattr(memo, "runtime", None)
    if runtime is None:
        return {"ready": False}
    return {"requests": runtime.client.requests, "pods": runtime.children.pod_count()}
