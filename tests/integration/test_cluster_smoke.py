"""Smoke tests for the local cluster tier: control plane + RBAC + KWOK GPU nodes and stages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.cluster.kube import Kubectl, KubectlError
from tests.cluster.localcluster import LocalCluster
from tests.integration.scenario import POOL_LABEL

pytestmark = pytest.mark.integration

GPU = "nvidia.com/gpu"
SMOKE_POOL = "smoke"


def gpu_pod(
    name: str, gpus: int, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    resources = {"cpu": "1", "memory": "1Gi"}
    if gpus:
        resources[GPU] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "spec": {
            "restartPolicy": "Never",
            # other modules' GPU pools share the session's cluster: stay on this module's nodes
            "nodeSelector": {POOL_LABEL: SMOKE_POOL},
            "containers": [
                {
                    "name": "trainer",
                    "image": "phalanx.invalid/trainer:test",
                    "resources": {"requests": resources, "limits": resources},
                }
            ],
        },
    }


def phase(kubectl: Kubectl, ns: str, name: str) -> str | None:
    pod = kubectl.get("pod", name, ns)
    return pod["status"].get("phase") if pod else None


@pytest.fixture(scope="session")
def gpu_nodes(kwok_cluster: LocalCluster) -> list[str]:
    return kwok_cluster.add_gpu_nodes(2, labels={POOL_LABEL: SMOKE_POOL})


def test_apiserver_answers(cluster: Any, kubectl: Kubectl) -> None:
    assert kubectl.run("get", "--raw", "/readyz").stdout.strip() == "ok"
    version = kubectl.json("version")["serverVersion"]
    if isinstance(cluster, LocalCluster):
        assert version["gitVersion"] == cluster.versions["kubernetes"]


def test_rbac_is_enforced(cluster: Any, kubectl: Kubectl, namespace: str, tmp_path: Any) -> None:
    sa = f"system:serviceaccount:{namespace}:default"
    can = kubectl.run("auth", "can-i", "list", "pods", "--all-namespaces", f"--as={sa}", check=False)
    assert can.stdout.strip() == "no", can
    with pytest.raises(KubectlError) as err:
        kubectl.run("get", "pods", "--all-namespaces", f"--as={sa}")
    assert err.value.forbidden
    if isinstance(cluster, LocalCluster):
        # a real ServiceAccount token, signed by the cluster's SA key, is authenticated but refused
        token = kubectl.run("create", "token", "default", f"--namespace={namespace}").stdout.strip()
        kc = cluster.write_kubeconfig(tmp_path / "sa.kubeconfig", "sa", token=token)
        sa_kubectl = Kubectl(kc, kubectl.binary)
        with pytest.raises(KubectlError) as err:
            sa_kubectl.run("get", "pods", "--all-namespaces")
        assert err.value.forbidden
        assert sa in err.value.stderr


def test_kwok_gpu_node_ready(kubectl: Kubectl, gpu_nodes: list[str]) -> None:
    for name in gpu_nodes:
        node = kubectl.get("node", name)
        assert node is not None
        assert node["status"]["allocatable"][GPU] == "8"
        assert node["status"]["capacity"][GPU] == "8"
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True"


def test_gpu_pod_binds_and_runs(kubectl: Kubectl, namespace: str, gpu_nodes: list[str]) -> None:
    kubectl.create(gpu_pod("four-gpus", 4), namespace)
    kubectl.wait_for(lambda: phase(kubectl, namespace, "four-gpus") == "Running", timeout=30, what="pod Running")
    pod = kubectl.get("pod", "four-gpus", namespace)
    assert pod is not None
    assert pod["spec"]["nodeName"] in gpu_nodes
    assert pod["status"]["podIP"]
    conds = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert conds["Ready"] == "True"
    assert pod["status"]["containerStatuses"][0]["state"]["running"]


def test_oversized_pod_stays_pending(kubectl: Kubectl, namespace: str, gpu_nodes: list[str]) -> None:
    kubectl.create(gpu_pod("too-many-gpus", 16), namespace)

    def unschedulable() -> bool:
        pod = kubectl.get("pod", "too-many-gpus", namespace)
        conds = {c["type"]: c for c in (pod or {}).get("status", {}).get("conditions", [])}
        sched = conds.get("PodScheduled")
        return bool(sched and sched["status"] == "False" and sched.get("reason") == "Unschedulable")

    kubectl.wait_for(unschedulable, timeout=30, what="PodScheduled=False/Unschedulable")
    pod = kubectl.get("pod", "too-many-gpus", namespace)
    assert pod is not None
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")
    assert "Insufficient nvidia.com/gpu" in json.dumps(pod["status"]["conditions"])


def test_exit_code_label_fails_pod(kubectl: Kubectl, namespace: str, gpu_nodes: list[str]) -> None:
    kubectl.create(
        gpu_pod(
            "oom",
            1,
            labels={"kwok.phalanx.dev/exit-code": "137"},
            annotations={
                "kwok.phalanx.dev/reason": "OOMKilled",
                "kwok.phalanx.dev/message": "rank 3 ran out of memory",
            },
        ),
        namespace,
    )
    kubectl.wait_for(lambda: phase(kubectl, namespace, "oom") == "Failed", timeout=30, what="pod Failed")
    pod = kubectl.get("pod", "oom", namespace)
    assert pod is not None
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 137
    assert term["reason"] == "OOMKilled"
    assert term["message"] == "rank 3 ran out of memory"


def test_exit_code_zero_succeeds_running_pod(kubectl: Kubectl, namespace: str, gpu_nodes: list[str]) -> None:
    kubectl.create(gpu_pod("done", 1), namespace)
    kubectl.wait_for(lambda: phase(kubectl, namespace, "done") == "Running", timeout=30, what="pod Running")
    kubectl.label("pod", "done", {"kwok.phalanx.dev/exit-code": "0"}, namespace)
    kubectl.wait_for(lambda: phase(kubectl, namespace, "done") == "Succeeded", timeout=30, what="pod Succeeded")
    pod = kubectl.get("pod", "done", namespace)
    assert pod is not None
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0


def test_waiting_reason_label(kubectl: Kubectl, namespace: str, gpu_nodes: list[str]) -> None:
    kubectl.create(gpu_pod("no-image", 1, labels={"kwok.phalanx.dev/waiting-reason": "ImagePullBackOff"}), namespace)

    def waiting() -> str | None:
        pod = kubectl.get("pod", "no-image", namespace)
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
        reason = statuses[0].get("state", {}).get("waiting", {}).get("reason")
        return str(reason) if reason else None

    assert kubectl.wait_for(waiting, timeout=30, what="waiting reason") == "ImagePullBackOff"
    assert phase(kubectl, namespace, "no-image") == "Pending"


def _has_taint(kubectl: Kubectl, node: str, key: str) -> bool:
    n = kubectl.get("node", node) or {}
    return any(t["key"] == key for t in n.get("spec", {}).get("taints", []))


def test_node_not_ready_label(kwok_cluster: LocalCluster, kubectl: Kubectl, gpu_nodes: list[str]) -> None:
    # a separate, tainted node so the shared GPU nodes stay usable for the other tests
    (node,) = kwok_cluster.add_gpu_nodes(
        1, name_prefix="kwok-flaky-", taints=[{"key": "phalanx.dev/flaky", "effect": "NoSchedule"}]
    )
    try:
        kwok_cluster.set_node_not_ready(node)  # waits for Ready=False
        kubectl.wait_for(
            lambda: _has_taint(kubectl, node, "node.kubernetes.io/not-ready"), timeout=30, what="not-ready taint"
        )
        kwok_cluster.set_node_not_ready(node, not_ready=False)  # waits for Ready=True
    finally:
        kubectl.delete("node", node)


def test_lost_node_turns_unknown(kwok_cluster: LocalCluster, kubectl: Kubectl, gpu_nodes: list[str]) -> None:
    (node,) = kwok_cluster.add_gpu_nodes(
        1, name_prefix="kwok-lost-", taints=[{"key": "phalanx.dev/flaky", "effect": "NoSchedule"}]
    )
    try:
        kwok_cluster.set_node_lost(node)

        def ready_status() -> str | None:
            n = kubectl.get("node", node) or {}
            conds = {c["type"]: c["status"] for c in n.get("status", {}).get("conditions", [])}
            return conds.get("Ready")

        # --node-monitor-grace-period is 20s
        kubectl.wait_for(lambda: ready_status() == "Unknown", timeout=45, what="Ready=Unknown")
        kubectl.wait_for(
            lambda: _has_taint(kubectl, node, "node.kubernetes.io/unreachable"), timeout=30, what="unreachable taint"
        )
        kwok_cluster.set_node_lost(node, lost=False)
        kwok_cluster.wait_nodes_ready([node], timeout=30)
    finally:
        kubectl.delete("node", node)


def test_namespace_deletion(kubectl: Kubectl, gpu_nodes: list[str]) -> None:
    ns = "smoke-ns-delete"
    kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    kubectl.wait_for(lambda: kubectl.get("serviceaccount", "default", ns), timeout=30, what="default SA")
    kubectl.create(gpu_pod("victim", 2), ns)
    kubectl.wait_for(lambda: phase(kubectl, ns, "victim") == "Running", timeout=30, what="pod Running")
    kubectl.delete("namespace", ns, wait=True, timeout=60)
    assert kubectl.get("namespace", ns) is None
