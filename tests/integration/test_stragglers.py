"""Stragglers on the real control plane (KWOK nodes; issue 34 point 3): job A's three ranks report
their step times to the store (here a fake store, a real HTTP server at the store pod's own
loopback address, serving the lines the store script serves, as test_progress_status does for
rank 0's progress), one rank three times slower than the others. The operator (under the chart's
RBAC with ``nodeLedger.enabled``, this checkout's code) judges that rank a straggler after a few
polls, records ``Slow`` evidence with the measured times against the node of that rank's pod, once
(however long the slowness lasts within the hour), and, past the threshold, job B's new pods keep
off that node. ``phalanx doctor`` and ``describe`` show the measured times; no node is cordoned."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from phalanx.reconcile import naming, node_ledger
from phalanx.reconcile.environment import WORKER_METRICS_PORT
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.integration.phalanx_cli import phalanx
from tests.integration.scenario import POOL_LABEL, TRAINER, create, node_of, start, wait_running
from tests.integration.test_node_ledger import doctor_warns_of, kept_off, operator_with_ledger
from tests.unit.text_page import TextPage

pytestmark = pytest.mark.integration

POOL = "stragglers"
TAINT = {"key": "phalanx.dev/stragglers-loopback", "value": "true", "effect": "NoSchedule"}
POD_CIDR = "127.82.0.1/24"  # each pod reachable on this host at its own address
LEDGER = node_ledger.DEFAULT_NAME
SLOW_RANK = 1
STEP_SECONDS = (0.25, 0.75, 0.25)  # rank 1: three times the others


@pytest.fixture(scope="module")
def pool(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    """Four 8-GPU nodes: job A's three 8-GPU workers take one each; job B's three must use the other
    three (the straggler's node avoided), which only the ledger can make them do."""
    names = [n["metadata"]["name"] for n in kubectl.list("nodes", selector=f"{POOL_LABEL}={POOL}")]
    if len(names) < 4:
        names += kwok_cluster.add_gpu_nodes(
            4 - len(names), labels={POOL_LABEL: POOL}, name_prefix=f"{POOL}-", taints=[TAINT], pod_cidr=POD_CIDR
        )
    kwok_cluster.wait_nodes_ready(names)
    return names


@pytest.fixture
def ledger_operator(
    crds: list[str], kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, tmp_path: pathlib.Path
) -> Iterator[OperatorProcess]:
    """A threshold of 0.4 (one window of slowness, weighing 0.5 and halving every 6 h, avoids the node
    for about two hours), scraping every second."""
    environ = {"PHALANX_NODE_LEDGER_THRESHOLD": "0.4", "PHALANX_PROGRESS_INTERVAL_SECONDS": "1"}
    with operator_with_ledger(kubectl, kubeconfig, namespace, tmp_path, environ) as process:
        yield process


class FakeStore:
    """The store pod's page for one job: each rank's step time as the store script serves it, the
    step moving on every second (a new measure at every poll)."""

    def __init__(self, host: str, job_uid: str, hosts: list[str]) -> None:
        self.started = time.time()
        self.job_uid, self.hosts = job_uid, hosts
        self.endpoint = TextPage(self.page, host=host, port=WORKER_METRICS_PORT)

    def page(self) -> str:
        step = 10 + int(time.time() - self.started)
        lines = []
        for rank, (host, seconds) in enumerate(zip(self.hosts, STEP_SECONDS, strict=True)):
            label = f'job="{self.job_uid}",attempt="0",rank="{rank}",host="{host}"'
            lines += [
                f"phalanx_training_rank_step_seconds{{{label}}} {seconds}",
                f"phalanx_training_rank_step{{{label}}} {step}",
            ]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.endpoint.close()


def template(nodes: list[str]) -> dict[str, Any]:
    only_pool = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [only_pool]}}}
    return {
        "spec": {
            "containers": [TRAINER],
            "nodeSelector": {POOL_LABEL: POOL},
            "tolerations": [{"key": TAINT["key"], "operator": "Exists"}],
            "affinity": affinity,
        }
    }


def test_a_rank_three_times_slower_grades_its_node_and_new_pods_keep_off_it(
    kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, ledger_operator: OperatorProcess, pool: list[str]
) -> None:
    # job A: 3 workers of 8 GPUs, one per node; its own avoidance off
    pods_a = start(
        kubectl, namespace, desired=3, gpus={"count": 8}, template=template(pool), failurePolicy={"avoidNodeSeconds": 0}
    )
    hosts = [naming.worker_pod_name("demo", rank) for rank in range(3)]  # a pod's hostname is its name
    slow_pod = pods_a[hosts[SLOW_RANK]]
    node = node_of(slow_pod)
    assert len({node_of(pod) for pod in pods_a.values()}) == 3
    job_a = kubectl.get("tj", "demo", namespace)
    store = kubectl.get("pod", naming.rendezvous_name("demo"), namespace)
    assert job_a is not None and store is not None and store["status"].get("podIP", "").startswith("127.82.")
    fake = FakeStore(store["status"]["podIP"], job_a["metadata"]["uid"], hosts)
    try:

        def recorded() -> node_ledger.Ledger | None:
            configmap = kubectl.get("configmap", LEDGER, namespace)
            ledger = node_ledger.of_data((configmap or {}).get("data"))
            return ledger if node in ledger.nodes else None

        ledger = kubectl.wait_for(recorded, timeout=60, what=f"slowness of {node} in ConfigMap {LEDGER}")
        assert ledger is not None
        [evidence] = ledger.nodes[node]
        assert (evidence.kind, evidence.source, evidence.base_weight, evidence.job) == (
            "Slow",
            "slow",
            0.5,
            f"{namespace}/demo",
        )
        assert evidence.pod_uid == slow_pod["metadata"]["uid"]
        assert evidence.message.startswith("rank 1 at 0.75 s/step, 3.0x the median 0.25 s/step"), evidence.message
        assert list(ledger.nodes) == [node]  # the healthy ranks' nodes have nothing against them
        time.sleep(5)  # a few more polls find the same straggler: it is counted once in its window
        configmap = kubectl.get("configmap", LEDGER, namespace)
        assert configmap is not None
        again = node_ledger.of_data(configmap["data"])
        assert [one.key for one in again.nodes[node]] == [evidence.key] and list(again.nodes) == [node]
    finally:
        fake.close()
    kubectl.delete("tj", "demo", namespace)
    kubectl.wait_for(
        lambda: not kubectl.list("pods", namespace, naming.worker_selector("demo")),
        timeout=60,
        what="job A's pods gone",
    )

    # job B never ran on the node; its three new pods keep off it and take the other three
    create(
        kubectl,
        namespace,
        name="beta",
        workers={"min": 3, "max": 3, "desired": 3},
        gpus={"count": 8},
        template=template(pool),
    )
    wait_running(kubectl, namespace, 3, name="beta", timeout=60)
    pods_b = kubectl.list("pods", namespace, naming.worker_selector("beta"))
    assert len(pods_b) == 3
    for pod in pods_b:
        assert kept_off(pod) == [node], pod["spec"].get("affinity")
    assert sorted(node_of(pod) for pod in pods_b) == sorted(set(pool) - {node})
    line = doctor_warns_of(kubectl, kubeconfig, namespace, node)
    assert f"{node} (score 0.50 of 0.4, 0 failure(s), 1 window(s) of slowness in {namespace}/{LEDGER}" in line, line
    assert "Slow " in line and "rank 1 at 0.75 s/step, 3.0x the median 0.25 s/step" in line, line

    described = phalanx("describe", "beta", f"--kubeconfig={kubeconfig}", f"--namespace={namespace}")
    assert described.returncode == 0, described.stderr
    lines = described.stdout.splitlines()
    start_at = lines.index("Node Ledger:")
    [row] = [line for line in lines[start_at + 3 :] if line.split()[:1] == [node]]
    assert row.split()[:5] == [node, "0.50/0.4", "yes", "0", "1"], lines[start_at:]
    assert "3.0x the median 0.25 s/step" in row
