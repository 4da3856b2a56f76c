"""``phalanx describe`` on the real control plane with the real operator: a job on KWOK GPU nodes
that lost a worker to a counted failure, described as ``phalanx`` and as the kubectl plugin
(``kubectl phalanx``, found by the real kubectl on PATH). KWOK pods write no logs, so ``phalanx
logs`` is tested on the real node (tests/e2e/test_inspect.py)."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.integration.phalanx_cli import kubectl_plugin, phalanx, plugin_path
from tests.integration.scenario import (
    JOB,
    POOL_LABEL,
    TRAINER,
    gpu_pool,
    start,
    wait_event,
    wait_replaced_alone,
)

pytestmark = pytest.mark.integration

POOL = "inspect"
FAILURE = "RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def gpu_nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    return gpu_pool(kwok_cluster, kubectl, POOL, count=2)


@pytest.fixture
def plugin(tmp_path: pathlib.Path) -> str:
    return plugin_path(tmp_path / "plugins")


def fields(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith(" ") and ":" in line:
            key, _, value = line.partition(":")
            found.setdefault(key, value.strip())
    return found


def table(text: str, heading: str) -> list[dict[str, str]]:
    """The rows under a heading as dicts by column name (cells are separated by 2+ spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    header, rows = re.split(r"\s{2,}", lines[start + 1].strip()), []
    for line in lines[start + 3 :]:
        if not line.startswith("  "):
            break
        rows.append(dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=False)))
    return rows


def check_description(text: str, namespace: str, nodes: list[str], victim: str) -> None:
    got = fields(text)
    assert (got["Name"], got["Namespace"]) == (JOB, namespace), text
    assert (got["Phase"], got["Reason"], got["Attempt"]) == ("Running", "WorkersReady", "0"), text
    assert got["Restarts"] == "1 of 3 allowed (2 left)", text  # the scenario's failurePolicy.maxRestarts
    lines = text.splitlines()
    reasons = lines[lines.index("Restarts By Reason:") + 1]
    assert reasons.split() == ["WorkerFailed:", "1"], text
    assert got["Workers"].startswith("desired 3 (min 2, max 4), active 3, ready 3"), text

    conditions = {row["Type"]: row for row in table(text, "Conditions:")}
    assert (conditions["Ready"]["Status"], conditions["Ready"]["Reason"]) == ("True", "WorkersReady"), text

    pods = table(text, "Pods (current attempt 0 first):")
    workers = [row for row in pods if row["Worker"] != "store"]
    assert [row["Name"] for row in workers] == [naming.worker_pod_name(JOB, i) for i in range(3)], text
    for row in pods:
        assert row["Node"] in nodes, text  # the KWOK GPU nodes the scheduler chose
        assert (row["State"], row["Ready"], row["Restarts"]) == ("Running", "True", "0"), text
        assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", row["IP"]), text
    assert {row["Attempt"] for row in workers} == {"0"}
    store = [row for row in pods if row["Worker"] == "store"]
    assert [(row["Name"], row["Attempt"]) for row in store] == [(naming.rendezvous_name(JOB), "-")], text

    events = table(text, "Events")
    failed = [row for row in events if row["Reason"] == "WorkerFailed"]
    assert failed, text
    assert (failed[0]["Type"], failed[0]["From"], failed[0]["Object"]) == ("Warning", "phalanx", f"trainingjob/{JOB}")
    assert victim in failed[0]["Message"] and FAILURE in failed[0]["Message"], text
    scheduled = {row["Object"] for row in events if row["Reason"] == "Scheduled"}
    assert f"pod/{victim}" in scheduled, text  # the scheduler's Events on the pods are merged in
    assert all(row["From"] == "default-scheduler" for row in events if row["Reason"] == "Scheduled"), text


def test_describe_shows_the_job_after_a_counted_worker_failure_also_as_a_kubectl_plugin(
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    kwok_cluster: LocalCluster,
    namespace: str,
    operator: OperatorProcess,
    gpu_nodes: list[str],
    plugin: str,
) -> None:
    template: dict[str, Any] = {"spec": {"nodeSelector": {POOL_LABEL: POOL}, "containers": [TRAINER]}}
    before = start(kubectl, namespace, template=template)
    victim = naming.worker_pod_name(JOB, 1)
    kwok_cluster.finish_pod(namespace, victim, 1, message=FAILURE)
    wait_replaced_alone(kubectl, namespace, before, victim, 1, {"WorkerFailed": 1})
    wait_event(kubectl, namespace, "WorkerFailed")

    described = phalanx("describe", JOB, "-n", namespace, "--kubeconfig", str(kubeconfig))
    print(described.stdout)  # shown with -s, and with a failure
    assert described.returncode == 0, described.stderr
    assert described.stderr == ""
    check_description(described.stdout, namespace, gpu_nodes, victim)

    through_kubectl = kubectl_plugin(plugin, "describe", JOB, "-n", namespace, "--kubeconfig", str(kubeconfig))
    assert through_kubectl.returncode == 0, through_kubectl.stderr
    check_description(through_kubectl.stdout, namespace, gpu_nodes, victim)

    missing = kubectl_plugin(plugin, "describe", "nope", "-n", namespace, "--kubeconfig", str(kubeconfig))
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == f'kubectl phalanx describe: trainingjob "nope" not found in namespace "{namespace}"\n'
