"""The cluster-wide node ledger on the real control plane (KWOK nodes): a worker of job A dies of
a GPU error; the operator (under the chart's RBAC with ``nodeLedger.enabled``) records it in its
ConfigMap, and a new job B's pods keep off that node although B never saw it fail; ``phalanx
doctor`` and ``phalanx describe`` list the node with the evidence, and the node is not cordoned."""

from __future__ import annotations

import contextlib
import json
import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from phalanx.reconcile import naming, node_ledger
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.chart_identity import chart_identity
from tests.integration.operator_process import OperatorProcess
from tests.integration.phalanx_cli import environment, phalanx
from tests.integration.scenario import (
    POOL_LABEL,
    TRAINER,
    create,
    gpu_pool,
    node_of,
    start,
    wait_running,
    wait_status,
)

pytestmark = pytest.mark.integration

POOL = "ledger"
LEDGER = node_ledger.DEFAULT_NAME


@pytest.fixture(scope="module")
def pool(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    return gpu_pool(kwok_cluster, kubectl, POOL, count=3)


@contextlib.contextmanager
def operator_with_ledger(
    kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, tmp_path: pathlib.Path, environ: dict[str, str]
) -> Iterator[OperatorProcess]:
    """The operator under the chart's identity with the node ledger on (its Role on the ConfigMap), the
    ledger in ``namespace``, running this checkout's code with ``environ`` added; the ledger goes with it."""
    environ = {
        "PYTHONPATH": environment()["PYTHONPATH"],  # this checkout, whatever the venv's editable install points at
        "PHALANX_NODE_LEDGER_NAME": LEDGER,
        "PHALANX_NODE_LEDGER_NAMESPACE": namespace,
        **environ,
    }
    values = ["nodeLedger.enabled=true"]
    with chart_identity(kubectl, kubeconfig, namespace, f"phx-{uuid.uuid4().hex[:6]}", tmp_path, values) as identity:
        process = OperatorProcess(identity, tmp_path / "operator.log", namespace=namespace, extra_env=environ)
        with process:
            yield process
            assert process.alive(), "the operator died"
        print(f"--- operator log (tail) ---\n{process.log_tail(80)}")
    # doctor reads every namespace's ledger: this one must not outlive the test (its namespace is
    # deleted without waiting)
    kubectl.delete("configmap", LEDGER, namespace)
    assert "Traceback" not in process.log(), "the operator logged a traceback"


@pytest.fixture
def ledger_operator(
    crds: list[str], kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, tmp_path: pathlib.Path
) -> Iterator[OperatorProcess]:
    """A threshold of 0.5: each failure avoids its node for one half-life."""
    with operator_with_ledger(
        kubectl, kubeconfig, namespace, tmp_path, {"PHALANX_NODE_LEDGER_THRESHOLD": "0.5"}
    ) as process:
        yield process


def doctor_warns_of(kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, node: str) -> str:
    """``phalanx doctor``'s node-ledger line, a warning, once ``node`` is past the threshold; the node
    itself never cordoned."""
    node_object = kubectl.get("node", node)
    assert node_object is not None and node_object["spec"].get("unschedulable") is not True  # never cordoned
    run = phalanx("doctor", f"--kubeconfig={kubeconfig}", f"--namespace={namespace}")
    print(run.stdout)
    [line] = [line for line in run.stdout.splitlines() if "node ledger" in line]
    assert line.startswith("WARNING"), line
    # other tests' ledgers may be listed too (doctor reads every namespace's): the caller checks its node's
    return line


def template(nodes: list[str]) -> dict[str, Any]:
    only_pool = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [only_pool]}}}
    return {"spec": {"containers": [TRAINER], "nodeSelector": {POOL_LABEL: POOL}, "affinity": affinity}}


def kept_off(pod: dict[str, Any]) -> list[str]:
    affinity = (pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}
    terms = (affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    return sorted(
        name
        for term in terms
        for field in term.get("matchFields", [])
        if field["operator"] == "NotIn"
        for name in field["values"]
    )


def test_a_gpu_error_in_job_a_keeps_job_b_off_the_node_and_doctor_lists_it(
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    kwok_cluster: LocalCluster,
    namespace: str,
    ledger_operator: OperatorProcess,
    pool: list[str],
) -> None:
    # job A: its own avoidance off, so that only the ledger can keep anyone off the node
    before = start(kubectl, namespace, desired=2, template=template(pool), failurePolicy={"avoidNodeSeconds": 0})
    victim = naming.worker_pod_name("demo", 1)
    node = node_of(before[victim])
    message = "Xid 79: GPU 3 has fallen off the bus"
    kwok_cluster.finish_pod(namespace, victim, 1, message=message)

    def recorded() -> node_ledger.Ledger | None:
        configmap = kubectl.get("configmap", LEDGER, namespace)
        ledger = node_ledger.of_data((configmap or {}).get("data"))
        return ledger if node in ledger.nodes else None

    ledger = kubectl.wait_for(recorded, timeout=30, what=f"{node} in ConfigMap {LEDGER}")
    assert ledger is not None
    [evidence] = ledger.nodes[node]
    assert (evidence.kind, evidence.device, evidence.job) == ("GPUError", "GPU 3", f"{namespace}/demo"), evidence
    assert evidence.pod_uid == before[victim]["metadata"]["uid"]
    assert list(ledger.nodes) == [node]
    status_a = wait_status(kubectl, namespace, lambda s: s.get("restarts") == 1, "job A's failure counted")
    assert "avoidedNodes" not in status_a, status_a  # A avoids nothing of its own

    # job B never saw the failure; its new pods keep off the node all the same
    create(kubectl, namespace, name="beta", workers={"min": 1, "max": 2, "desired": 2}, template=template(pool))
    wait_running(kubectl, namespace, 2, name="beta")
    pods_b = kubectl.list("pods", namespace, naming.worker_selector("beta"))
    assert len(pods_b) == 2
    for pod in pods_b:
        assert kept_off(pod) == [node], pod["spec"].get("affinity")
        assert pod["spec"]["nodeName"] != node
    # counted once, however many passes saw the failed pod
    configmap = kubectl.get("configmap", LEDGER, namespace)
    assert configmap is not None
    assert len(node_ledger.of_data(configmap["data"]).nodes[node]) == 1
    document = json.loads(configmap["data"][node_ledger.DATA_KEY])
    assert document["policy"]["threshold"] == 0.5
    line = doctor_warns_of(kubectl, kubeconfig, namespace, node)
    assert f"{node} (score 1.00 of 0.5, 1 failure(s) in {namespace}/{LEDGER}" in line, line
    assert "GPUError on GPU 3" in line and f"{namespace}/demo" in line and "Xid 79" in line, line

    described = phalanx("describe", "beta", f"--kubeconfig={kubeconfig}", f"--namespace={namespace}")
    assert described.returncode == 0, described.stderr
    lines = described.stdout.splitlines()
    start_at = lines.index("Node Ledger:")
    [row] = [line.split() for line in lines[start_at + 3 :] if line.split()[:1] == [node]]
    assert row[:4] == [node, "1.00/0.5", "yes", "1"], lines[start_at:]
