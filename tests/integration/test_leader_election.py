"""Two operator replicas on the real control plane: one leads by a Lease and reconciles, the other
stands by with synced caches and writes nothing; when the leader is SIGKILLed the standby takes
the Lease and carries on; a leader that stops cleanly hands the Lease over at once."""

from __future__ import annotations

import pathlib
import time
import uuid
from collections.abc import Iterator

import pytest

from phalanx.api import v1alpha1 as api
from phalanx.cluster.client import ApiClient, ApiError
from phalanx.cluster.login import Credentials
from phalanx.reconcile import naming
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
