"""Two operator replicas on the real control plane: one leads by a Lease and reconciles, the other
stands by with synced caches and writes nothing; when the leader is SIGKILLed the standby takes
the Lease and carries on; a leader that stops cleanly hands the Lease over at once. Renewals never
wait behind the operator's other requests on a slow API server, and a leader frozen past its
renew deadline (SIGSTOP, then SIGCONT) writes nothing before it has renewed."""

from __future__ import annotations

import asyncio
import pathlib
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from aiohttp import web

from phalanx.api import v1alpha1 as api
from phalanx.cluster.client import ApiClient, ApiError
from phalanx.cluster.lease import LeaseTiming
from phalanx.cluster.login import Credentials, Login
from phalanx.handlers import lifecycle
from phalanx.handlers.settings import LEASE_DURATION_ENV, RENEW_DEADLINE_ENV, RETRY_ENV, Settings
from phalanx.reconcile import naming
from tests.cluster.faultproxy import FaultProxy, Request
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.chart_identity import chart_identity
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import (
    JOB,
    create,
    gpu_pool,
    metric,
    replaced_and_running,
    start,
    status,
    wait_workers,
    workers,
)

pytestmark = pytest.mark.integration


def holder(kubectl: Kubectl, namespace: str) -> str | None:
    """Who holds the Lease (named after the release, as the chart names it; one per test namespace)."""
    leases = kubectl.list("leases", namespace)
    return leases[0]["spec"].get("holderIdentity") if leases else None


@pytest.fixture(scope="module")
def gpu_nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    return gpu_pool(kwok_cluster, kubectl, "leader")


@pytest.fixture
def replicas(
    crds: list[str], kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, tmp_path: pathlib.Path
) -> Iterator[dict[str, OperatorProcess]]:
    """Operators "a" and "b" under the chart's identity, electing a leader in the test namespace."""
    release = f"phx-{uuid.uuid4().hex[:6]}"
    with chart_identity(kubectl, kubeconfig, namespace, release, tmp_path) as identity:
        processes = {
            name: OperatorProcess(
                identity,
                tmp_path / f"operator-{name}.log",
                namespace=namespace,
                extra_env={
                    "PHALANX_LEADER_ELECTION": "1",
                    "PHALANX_LEASE_NAMESPACE": namespace,
                    "PHALANX_LEADER_IDENTITY": name,
                    "PHALANX_LEASE_NAME": f"{release}-phalanx",  # what the chart's Role allows
                },
            )
            for name in ("a", "b")
        }
        with processes["a"]:
            kubectl.wait_for(lambda: holder(kubectl, namespace) == "a", timeout=30, what="a leads")
            with processes["b"]:
                yield processes
        for name, process in processes.items():
            print(f"--- operator {name} log (tail) ---\n{process.log_tail(40)}")


def test_a_standby_takes_over_within_seconds_of_the_leaders_sigkill_and_only_the_leader_writes(
    kubectl: Kubectl, namespace: str, gpu_nodes: list[str], replicas: dict[str, OperatorProcess]
) -> None:
    leader, standby = replicas["a"], replicas["b"]
    before = start(kubectl, namespace, desired=2)
    assert metric(leader.metrics(), "phalanx_leader") == 1.0
    # the standby reconciled nothing and wrote nothing (its caches are synced all the same)
    standby_metrics = standby.metrics()
    assert metric(standby_metrics, "phalanx_leader") == 0.0
    assert metric(
        standby_metrics, "controller_runtime_reconcile_total", controller="trainingjob", result="success"
    ) in (
        None,
        0.0,
    )

    victim = naming.worker_pod_name(JOB, 1)
    leader.kill()
    killed = time.monotonic()
    kubectl.delete("pod", victim, namespace, wait=False)  # work only a new leader can do
    kubectl.wait_for(lambda: holder(kubectl, namespace) == "b", timeout=60, what="b takes the lease")
    took_lease = time.monotonic() - killed
    after = wait_workers(
        kubectl, namespace, lambda p: replaced_and_running(p, before, victim), "the worker replaced", timeout=60
    )
    recovered = time.monotonic() - killed
    print(f"takeover after SIGKILL: lease {took_lease:.1f} s, worker replaced {recovered:.1f} s")
    assert metric(standby.metrics(), "phalanx_leader") == 1.0
    assert len(after) == 2 and after[victim]["metadata"]["uid"] != before[victim]["metadata"]["uid"]

    # the killed replica comes back as a standby and leaves the lease alone
    leader.restart()
    time.sleep(5)  # a few renewals: it must not take over
    assert holder(kubectl, namespace) == "b"
    assert metric(leader.metrics(), "phalanx_leader") == 0.0

    # a clean stop hands the lease over at once, without waiting out its duration
    standby.stop()
    stopped = time.monotonic()
    kubectl.wait_for(lambda: holder(kubectl, namespace) == "a", timeout=30, what="a takes the released lease")
    print(f"takeover after a clean stop: {time.monotonic() - stopped:.1f} s")
    pods = workers(kubectl, namespace)
    assert {pod["metadata"]["uid"] for pod in pods.values()} == {pod["metadata"]["uid"] for pod in after.values()}


async def test_a_status_write_planned_from_an_older_version_is_refused(
    crds: list[str], kubectl: Kubectl, namespace: str, api_credentials: Credentials
) -> None:
    """Two writers (a leader that has not noticed it lost the Lease, say) cannot overwrite each
    other's status: every status write carries the resourceVersion it was planned from."""
    create(kubectl, namespace)
    planned_from = kubectl.get("tj", JOB, namespace)["metadata"]["resourceVersion"]  # type: ignore[index]
    async with ApiClient(api_credentials) as client:
        first = {"phase": "Pending", "reason": "WorkersPending", "message": "the first writer"}
        await client.patch_status(api.API_VERSION, api.PLURAL, namespace, JOB, first, resource_version=planned_from)
        second = {"phase": "Failed", "reason": "RestartBudgetExhausted", "message": "a writer that saw an older job"}
        with pytest.raises(ApiError) as refused:
            await client.patch_status(
                api.API_VERSION, api.PLURAL, namespace, JOB, second, resource_version=planned_from
            )
    assert refused.value.status == 409
    assert status(kubectl, namespace)["message"] == "the first writer"


# Short durations that keep the operator's rules (renew deadline + retry + 2 s <= lease duration).
TIMING = LeaseTiming(lease_duration=8, renew_deadline=3, retry=1)
TIMING_ENV = {
    LEASE_DURATION_ENV: str(TIMING.lease_duration),
    RENEW_DEADLINE_ENV: str(TIMING.renew_deadline),
    RETRY_ENV: str(TIMING.retry),
}


class RecordingProxy(FaultProxy):
    """The fault proxy, also keeping every request in the order it came in, with the moment."""

    def __init__(self, upstream: str, ca_cert: pathlib.Path) -> None:
        super().__init__(upstream, ca_cert)
        self.log: list[tuple[float, Request]] = []
        self._log_lock = threading.Lock()

    async def _forward(self, incoming: web.Request) -> web.StreamResponse:
        with self._log_lock:
            self.log.append((time.monotonic(), Request(incoming.method, incoming.path, dict(incoming.query))))
        return await super()._forward(incoming)

    def since(self, moment: float) -> list[Request]:
        with self._log_lock:
            return [request for at, request in self.log if at >= moment]


def writes(requests: list[Request]) -> list[str]:
    return [f"{r.verb} {r.resource}" for r in requests if r.method != "GET"]


@pytest.fixture
def proxy(kwok_cluster: LocalCluster) -> Iterator[RecordingProxy]:
    running = RecordingProxy(kwok_cluster.server, kwok_cluster.server_ca)
    with running:
        yield running


async def test_renewals_keep_their_deadline_while_a_slow_api_server_holds_every_request_slot(
    crds: list[str],
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    namespace: str,
    tmp_path: pathlib.Path,
    proxy: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The elector as the operator wires it (``lifecycle.leader_elector``), on the real API server
    behind a proxy that holds the operator's other requests for seconds each: with every slot of
    the operator's client taken and more requests queued for far longer than the renew deadline,
    the Lease is renewed on time all along."""
    release = f"phx-{uuid.uuid4().hex[:6]}"
    with chart_identity(kubectl, kubeconfig, namespace, release, tmp_path) as identity:
        via = proxy.kubeconfig(identity, tmp_path / "via-proxy.kubeconfig")
        for name, value in {
            **TIMING_ENV,
            "PHALANX_LEADER_ELECTION": "1",
            "PHALANX_LEASE_NAMESPACE": namespace,
            "PHALANX_LEASE_NAME": f"{release}-phalanx",
            "PHALANX_LEADER_IDENTITY": "a",
        }.items():
            monkeypatch.setenv(name, value)
        login = Login(kubeconfig=str(via))
        async with ApiClient(login.load(), login=login, max_in_flight=4, timeout=60) as client:
            elector = lifecycle.leader_elector(client, Settings.from_environment())
            assert elector is not None
            await elector.acquire()
            holding = asyncio.create_task(elector.hold())
            pods = f"/api/v1/namespaces/{namespace}/pods"
            slow = 4 * TIMING.renew_deadline / 3  # each request held longer than the renew deadline / 3
            flood_size = 6 * client.max_in_flight  # six waves: 24 s, eight renew deadlines
            proxy.delay(lambda r: r.verb == "list" and r.resource == "pods", slow, count=flood_size)
            flood = [asyncio.create_task(client.request("GET", pods)) for _ in range(flood_size)]
            started = time.monotonic()
            lapsed = 0
            while not all(task.done() for task in flood):
                lapsed += not elector.holds_lease()
                await asyncio.sleep(TIMING.retry / 4)
            flooded = time.monotonic() - started
            await asyncio.gather(*flood)
            assert flooded > 4 * TIMING.renew_deadline, flooded  # the slots were taken that long
            renewals = [r for r in proxy.since(started) if r.resource == "leases" and r.verb == "update"]
            print(f"flood of {flood_size} slow requests: {flooded:.1f} s, {len(renewals)} renewals")
            assert lapsed == 0 and not holding.done() and elector.leading.is_set()
            assert len(renewals) >= flooded / TIMING.renew_deadline
            holding.cancel()
            await elector.release()
            await elector.client.close()
        login.close()


@pytest.fixture
def frozen_pair(
    crds: list[str],
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    namespace: str,
    tmp_path: pathlib.Path,
    proxy: RecordingProxy,
) -> Iterator[dict[str, OperatorProcess]]:
    """Operators "a" (leading, through the recording proxy) and "b" (its standby), short leases."""
    release = f"phx-{uuid.uuid4().hex[:6]}"
    with chart_identity(kubectl, kubeconfig, namespace, release, tmp_path) as identity:
        election = {
            **TIMING_ENV,
            "PHALANX_LEADER_ELECTION": "1",
            "PHALANX_LEASE_NAMESPACE": namespace,
            "PHALANX_LEASE_NAME": f"{release}-phalanx",
        }
        via = proxy.kubeconfig(identity, tmp_path / "via-proxy.kubeconfig")
        a = OperatorProcess(
            via,
            tmp_path / "operator-a.log",
            namespace=namespace,
            extra_env={**election, "PHALANX_LEADER_IDENTITY": "a"},
        )
        b = OperatorProcess(
            identity,
            tmp_path / "operator-b.log",
            namespace=namespace,
            extra_env={**election, "PHALANX_LEADER_IDENTITY": "b"},
        )
        with a:
            kubectl.wait_for(lambda: holder(kubectl, namespace) == "a", timeout=30, what="a leads")
            with b:
                yield {"a": a, "b": b}
        for name, process in (("a", a), ("b", b)):
            print(f"--- operator {name} log (tail) ---\n{process.log_tail(60)}")


def test_a_leader_frozen_past_its_renew_deadline_writes_nothing_before_it_has_renewed(
    kubectl: Kubectl,
    namespace: str,
    gpu_nodes: list[str],
    proxy: RecordingProxy,
    frozen_pair: dict[str, OperatorProcess],
) -> None:
    a, b = frozen_pair["a"], frozen_pair["b"]
    before = start(kubectl, namespace, desired=2)

    # 1. Frozen (between two renewals) past its renew deadline, not past the lease: nobody takes over. Work waits for it
    # (a deleted worker), and its first Lease request after SIGCONT is held back half a second, so that
    # anything it writes without renewing first would come in before the renewal.
    a.pause()
    victim = naming.worker_pod_name(JOB, 1)
    kubectl.delete("pod", victim, namespace, wait=False)
    time.sleep(TIMING.renew_deadline + TIMING.retry)
    proxy.delay(lambda r: r.resource == "leases", 0.5)
    resumed = time.monotonic()
    a.resume()
    after = wait_workers(
        kubectl, namespace, lambda p: replaced_and_running(p, before, victim), "the worker replaced", timeout=60
    )
    assert holder(kubectl, namespace) == "a"
    seen = writes(proxy.since(resumed))
    print(f"a's writes after SIGCONT: {seen}")
    assert "create pods" in seen  # a replaced the worker itself...
    assert seen.index("update leases") < seen.index("create pods")  # ...after it renewed
    assert seen[0] == "update leases", seen  # and nothing at all came before the renewal

    # 2. Frozen in the middle of a renewal (its request held at the proxy), as long again: the round's
    # timer fires late on SIGCONT. That round was cut short, not refused: a renews at once and leads on.
    mark = time.monotonic()
    proxy.delay(lambda r: r.resource == "leases", TIMING.renew_deadline / 2)
    kubectl.wait_for(
        lambda: any(r.resource == "leases" for r in proxy.since(mark)), timeout=10, what="a renewal on its way"
    )
    a.pause()
    time.sleep(TIMING.renew_deadline + TIMING.retry)
    resumed = time.monotonic()
    a.resume()
    kubectl.wait_for(lambda: "update leases" in writes(proxy.since(resumed)), timeout=10, what="a renews after SIGCONT")
    time.sleep(2 * TIMING.retry)
    assert a.alive() and holder(kubectl, namespace) == "a"
    assert "stalled" in a.log_tail(20) and "lost the lease" not in a.log_tail(200)

    # 3. Frozen past the lease: b takes over and does the work; a, resumed, writes nothing and stops.
    a.pause()
    paused = time.monotonic()
    kubectl.wait_for(lambda: holder(kubectl, namespace) == "b", timeout=60, what="b takes the lease")
    print(f"b took the lease {time.monotonic() - paused:.1f} s after a froze")
    victim = naming.worker_pod_name(JOB, 0)
    kubectl.delete("pod", victim, namespace, wait=False)
    wait_workers(kubectl, namespace, lambda p: replaced_and_running(p, after, victim), "b replaced the worker")
    resumed = time.monotonic()
    a.resume()
    kubectl.wait_for(lambda: not a.alive(), timeout=30, what="a stops once it finds the lease lost")
    assert writes(proxy.since(resumed)) == []
    assert "lost the lease" in a.log_tail(200)
    assert holder(kubectl, namespace) == "b" and b.alive()
