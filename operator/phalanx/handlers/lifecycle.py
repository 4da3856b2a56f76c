"""Operator start-up and shut-down: kopf settings, the API client, informers, the work queue.

kopf runs the process (login, liveness probe, signals, start-up and clean-up handlers); the
operator's own informers do the watching (see ``cluster.informer`` for why), so kopf watches
nothing itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import kopf

from phalanx import metrics, metrics_endpoint
from phalanx.cluster.client import ApiClient, NotLeadingError
from phalanx.cluster.lease import LeaderElector
from phalanx.cluster.login import Credentials, Login, LoginError
from phalanx.cluster.node_ledger import NodeLedgerStore
from phalanx.cluster.progress import ProgressPoller
from phalanx.cluster.workqueue import WorkQueue
from phalanx.handlers import trainingjob
from phalanx.handlers.runtime import Runtime
from phalanx.handlers.settings import Settings
from phalanx.reconcile import naming

logger = logging.getLogger(__name__)
RESTART_DELAY_SECONDS = 5.0
EVENT_FLUSH_SECONDS = 5.0  # at shut-down, within the pod's grace period


def settings_of(memo: kopf.Memo) -> Settings:
    """The operator's settings, read from the environment (the chart and `phalanx run` set it)
    once, by whichever of the login and start-up handlers runs first; a setting that cannot be
    used keeps the operator from starting."""
    settings: Settings | None = memo.get("settings")
    if settings is None:
        try:
            settings = Settings.from_environment()
        except ValueError as error:
            raise kopf.PermanentError(str(error)) from error
        memo.settings = settings
    return settings


@kopf.on.login(id="phalanx-login")
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """One source of credentials for kopf and for our client (see ``cluster.login``); kopf calls
    this again when its own requests get a 401."""
    source: Login = memo.setdefault("login", Login(context=settings_of(memo).kube_context))
    try:
        credentials = source.load()
    except LoginError as error:
        raise kopf.PermanentError(str(error)) from error
    memo.credentials = credentials
    logger.info("logged in to %s with the %s", credentials.server, credentials.source)
    return kopf.ConnectionInfo(
        server=credentials.server,
        ca_data=credentials.ca_data.decode() if credentials.ca_data else None,
        insecure=credentials.insecure,
        token=credentials.token,
        certificate_data=credentials.certificate_data.decode() if credentials.certificate_data else None,
        private_key_data=credentials.private_key_data.decode() if credentials.private_key_data else None,
        proxy_url=credentials.proxy,
        trust_env=credentials.proxy is None,
    )


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

    config = settings_of(memo)
    # kopf authenticates in a task of its own, which may not have run yet
    source: Login = memo.setdefault("login", Login(context=config.kube_context))
    try:
        credentials: Credentials | None = memo.get("credentials")
        if credentials is None:
            credentials = await asyncio.to_thread(source.load)
    except LoginError as error:
        raise kopf.PermanentError(str(error)) from error
    client = ApiClient(
        credentials,
        login=source,
        max_in_flight=config.max_in_flight,
        timeout=config.request_timeout_seconds,
    )
    runtime: Runtime | None = None
    elector = leader_elector(client, config)
    if elector is not None:
        client.fence = elector.holds_lease  # every write of this replica, not only status

    async def handle(key: tuple[str, str]) -> float | None:
        assert runtime is not None
        try:
            return await trainingjob.reconcile(runtime, key)
        except NotLeadingError as error:
            # The Lease lapsed by our clock (a stall, a slow renewal): this pass stops here; it
            # runs again once the Lease is renewed, or the process stops when it is lost.
            assert elector is not None
            logger.warning("pass over %s/%s stopped: %s", key[0], key[1], error)
            return elector.timing.retry

    runtime = Runtime.start(client, WorkQueue(handle, workers=config.reconcile_workers), config)
    runtime.pacer.interval = config.status_progress_seconds
    runtime.pacer.busy = lambda: runtime is not None and runtime.queue.backlog() > 0
    interval = config.progress_interval_seconds
    if interval > 0:
        stragglers = config.node_ledger.stragglers if config.node_ledger is not None else None
        runtime.progress = ProgressPoller(
            runtime.jobs, runtime.children, runtime.queue.enqueue, interval=interval, stragglers=stragglers
        )
    if (ledger := config.node_ledger) is not None:
        namespace = ledger.namespace or _own_namespace()
        runtime.ledger = NodeLedgerStore(client, namespace, ledger.name, ledger.policy, cordon=ledger.cordon)
    tasks = [supervised(name, work) for name, work in runtime.background()]
    if elector is None:
        runtime.queue.start()
        tasks += [supervised(name, work) for name, work in runtime.leader_work()]
        metrics.LEADER.set(1)
    else:
        tasks.append(asyncio.create_task(lead(runtime, elector, tasks), name="leader election"))
    memo.tasks = tasks
    memo.runtime = runtime
    memo.elector = elector
    metrics_port = config.metrics_port
    if metrics_port:
        # The chart sets both to a mounted TLS Secret's files when metrics.tls is enabled.
        certfile = config.metrics_tls_cert
        metrics_endpoint.serve(metrics_port, certfile, config.metrics_tls_key)
        logger.info("metrics on :%d/metrics over %s", metrics_port, "HTTPS" if certfile else "HTTP")


def leader_elector(client: ApiClient, settings: Settings) -> LeaderElector | None:
    """The Lease to lead by when PHALANX_LEADER_ELECTION is 1 (the chart's two replicas), on a
    client of its own: renewals never queue behind the creates of ``client``."""
    election = settings.leader_election
    if election is None:
        return None
    namespace = election.lease_namespace or _own_namespace()
    identity = election.identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    return LeaderElector(client.dedicated(), namespace, election.lease_name, identity, election.timing)


def _own_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.is_file() else "default"


async def lead(runtime: Runtime, elector: LeaderElector, tasks: list[asyncio.Task[None]]) -> None:
    """Stand by with synced caches until the Lease is ours, then reconcile; when it is lost, stop
    the process (as controller-runtime does) so it comes back as a clean standby."""
    await elector.acquire()
    metrics.LEADER.set(1)
    runtime.queue.start()  # every job was enqueued as the caches synced: all get a pass now
    tasks += [supervised(name, work) for name, work in runtime.leader_work()]
    try:
        await elector.hold()
    except asyncio.CancelledError:
        raise
    except Exception:  # never reconcile on without renewing
        logger.exception("holding the lease %s/%s failed", elector.namespace, elector.name)
    metrics.LEADER.set(0)
    logger.error(
        "lost the lease %s/%s: stopping so that this replica restarts as a standby", elector.namespace, elector.name
    )
    await runtime.queue.stop()
    os.kill(os.getpid(), signal.SIGTERM)


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
        elector: LeaderElector | None = getattr(memo, "elector", None)
        if elector is not None:
            await elector.release()  # after the last write: a standby may take over at once
            await elector.client.close()
        await runtime.client.close()
    source: Login | None = getattr(memo, "login", None)
    if source is not None:
        source.close()


@kopf.on.probe(id="reconcile-queue")
def probe(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    """Liveness detail: requests sent, pods tracked, whether every watch is synced."""
    runtime: Runtime | None = getattr(memo, "runtime", None)
    if runtime is None:
        return {"ready": False}
    elector: LeaderElector | None = getattr(memo, "elector", None)
    leading = elector is None or elector.holds_lease()
    return {
        "requests": runtime.client.requests,
        "pods": runtime.children.pod_count(),
        "synced": runtime.synced(),
        "unsynced": runtime.unsynced_scopes(),
        "leading": leading,
    }
