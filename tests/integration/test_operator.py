"""The operator against the real control plane with simulated GPU nodes (KWOK)."""

from __future__ import annotations

import contextlib
import copy
import json
import pathlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.integration.chart_identity import IDENTITY_KINDS, render, token_kubeconfig
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import HOLD_FINALIZER
from tests.unit.jobs import manifest

pytestmark = pytest.mark.integration

POOL = {"phalanx.dev/pool": "operator"}  # this module's nodes: other modules break theirs on purpose
GPU_JOB: dict[str, Any] = {
    "workers": {"min": 2, "max": 4, "desired": 3},
    "gpus": {"count": 4},
    "template": {
        "spec": {
            "nodeSelector": POOL,
            "containers": [
                {
                    "name": "trainer",
                    "image": "example/train:1",
                    "command": ["torchrun"],
                    "args": ["train.py"],
                    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "4", "memory": "4Gi"}},
                }
            ],
        }
    },
}


def create(kubectl: Kubectl, namespace: str, name: str = "demo", **spec: Any) -> dict[str, Any]:
    body = manifest(**copy.deepcopy(spec))
    body["metadata"] = {"name": name}
    kubectl.create(body, namespace=namespace)
    return body


def job_status(kubectl: Kubectl, namespace: str, name: str = "demo") -> dict[str, Any]:
    got = kubectl.get("tj", name, namespace)
    return (got or {}).get("status") or {}


def describe(kubectl: Kubectl, namespace: str, name: str = "demo") -> str:
    """The job's status and its pods (node, phase, conditions): what a timeout message needs."""
    status = job_status(kubectl, namespace, name)
    lines = [f"status {json.dumps({k: v for k, v in status.items() if k != 'conditions'})}"]
    for pod in kubectl.list("pods", namespace, f"{naming.JOB_NAME_LABEL}={name}"):
        conditions = {c["type"]: f"{c['status']}/{c.get('reason', '')}" for c in pod["status"].get("conditions", [])}
        lines.append(
            f"pod {pod['metadata']['name']} node={pod['spec'].get('nodeName')} phase={pod['status'].get('phase')}"
            f" deleting={bool(pod['metadata'].get('deletionTimestamp'))} {conditions}"
        )
    nodes = kubectl.run("describe", "nodes", "-l", "phalanx.dev/pool=operator").stdout
    allocated = [line.strip() for line in nodes.splitlines() if line.strip().startswith(("Name:", "nvidia.com/gpu"))]
    return "\n".join(lines + allocated)


def wait_phase(kubectl: Kubectl, namespace: str, phase: str, name: str = "demo", timeout: float = 60) -> dict[str, Any]:
    status = kubectl.wait_for(
        lambda: (s := job_status(kubectl, namespace, name)).get("phase") == phase and s,
        timeout=timeout,
        what=lambda: f"phase {phase}; now:\n{describe(kubectl, namespace, name)}",
    )
    assert isinstance(status, dict)
    return status


def workers(kubectl: Kubectl, namespace: str, name: str = "demo") -> list[dict[str, Any]]:
    return kubectl.list("pods", namespace, f"{naming.JOB_NAME_LABEL}={name},{naming.ROLE_LABEL}=worker")


@pytest.fixture(scope="module")
def gpu_nodes(kwok_cluster: Any) -> list[str]:
    """Four 8-GPU nodes: room for one job at its max (16 GPUs) while the previous test's
    workers (12 GPUs) are still being deleted with their namespace."""
    return list(kwok_cluster.add_gpu_nodes(4, gpus_per_node=8, labels=POOL, name_prefix="op-gpu-"))


def test_status_is_written_on_the_first_visit_and_children_appear(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, gpu_nodes: list[str]
) -> None:
    create(kubectl, namespace, **GPU_JOB)
    status = kubectl.wait_for(
        lambda: job_status(kubectl, namespace).get("observedGeneration") == 1, timeout=30, what="first status"
    )
    assert status
    pods = kubectl.wait_for(
        lambda: len(workers(kubectl, namespace)) == 3 and workers(kubectl, namespace), timeout=30, what="3 worker pods"
    )
    assert isinstance(pods, list)
    job = kubectl.get("tj", "demo", namespace)
    assert job is not None
    for pod in pods:
        labels = pod["metadata"]["labels"]
        assert labels[naming.JOB_NAME_LABEL] == "demo" and labels[naming.ATTEMPT_LABEL] == "0"
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("TrainingJob", job["metadata"]["uid"], True)
        trainer = pod["spec"]["containers"][0]
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "4"
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        assert env["PET_NNODES"] == "2:4" and env["PET_NPROC_PER_NODE"] == "4"
        assert env["PET_RDZV_ENDPOINT"] == f"demo-rdzv.{namespace}.svc:29400"
        full = kubectl.json("get", "pod", pod["metadata"]["name"], f"--namespace={namespace}", "--show-managed-fields")
        assert {entry["manager"] for entry in full["metadata"]["managedFields"]} >= {"phalanx"}
        assert full["metadata"]["managedFields"][0]["operation"] == "Update"  # POSTed: pods are never applied again
    service = kubectl.json("get", "service", "demo-rdzv", f"--namespace={namespace}", "--show-managed-fields")
    # created by POST too (its drift is corrected by forced applies of the same field manager)
    assert [(e["manager"], e["operation"]) for e in service["metadata"]["managedFields"]] == [("phalanx", "Update")]
    assert service is not None and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert kubectl.get("pod", "demo-rdzv", namespace) is not None


def test_workers_bind_to_gpu_nodes_by_capacity_and_the_job_runs(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, gpu_nodes: list[str]
) -> None:
    create(kubectl, namespace, **GPU_JOB)
    status = wait_phase(kubectl, namespace, "Running", timeout=60)
    assert status["workerSummary"] == "3/3"
    nodes = [pod["spec"]["nodeName"] for pod in workers(kubectl, namespace)]
    assert set(nodes) <= set(gpu_nodes)
    for node in set(nodes):  # the scheduler packed workers by GPU capacity: 4 GPUs each
        capacity = int(kubectl.get("node", node)["status"]["allocatable"]["nvidia.com/gpu"])  # type: ignore[index]
        assert 4 * nodes.count(node) <= capacity
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Reconciling"]["status"] == "False"
    assert all(c["observedGeneration"] == 1 for c in conditions.values())
    table = kubectl.run("get", "tj", "demo", f"--namespace={namespace}").stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "PHASE", "WORKERS", "PROGRESS", "RESTARTS"]
    assert table[1].split()[:4] == ["demo", "Running", "3/3", "0"]


def test_more_gpus_than_the_cluster_has_leave_workers_pending_with_the_reason(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, gpu_nodes: list[str]
) -> None:
    # one GPU more than the largest node of this session's cluster offers
    largest = max(int(n["status"].get("allocatable", {}).get("nvidia.com/gpu", 0)) for n in kubectl.list("nodes"))
    count = largest + 1
    assert count <= 64, "the schema's gpus.count bound"
    spec = copy.deepcopy(GPU_JOB)
    spec["gpus"] = {"count": count}
    create(kubectl, namespace, **spec)
    # no node has that many: not merely waiting for one, but stalled, in the scheduler's words and ours
    status = kubectl.wait_for(
        lambda: (s := job_status(kubectl, namespace)).get("reason") == "InsufficientCapacity" and s,
        timeout=60,
        what="InsufficientCapacity",
    )
    assert isinstance(status, dict)
    assert status["phase"] == "Pending"
    assert "Insufficient nvidia.com/gpu" in status["message"], status["message"]
    assert "no schedulable node can hold a worker" in status["message"]
    assert f"nvidia.com/gpu {count}" in status["message"], status["message"]


def test_deleting_the_job_garbage_collects_every_child(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, gpu_nodes: list[str]
) -> None:
    create(kubectl, namespace, gang={"scheduler": "scheduler-plugins"}, **GPU_JOB)
    kubectl.wait_for(lambda: len(workers(kubectl, namespace)) == 3, timeout=30, what="workers")
    assert kubectl.get("podgroups.scheduling.x-k8s.io", "demo", namespace) is not None
    kubectl.delete("tj", "demo", namespace, wait=True)
    selector = f"{naming.JOB_NAME_LABEL}=demo"

    def gone() -> bool:
        return (
            not kubectl.list("pods", namespace, selector)
            and not kubectl.list("services", namespace, selector)
            and not kubectl.list("podgroups.scheduling.x-k8s.io", namespace, selector)
        )

    kubectl.wait_for(gone, timeout=60, what="children garbage-collected")


@contextlib.contextmanager
def operator_of_two_namespaces(
    kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, directory: pathlib.Path, *, bind_other: bool = True
) -> Iterator[tuple[OperatorProcess, str, list[dict[str, Any]]]]:
    """The operator watching ``namespace`` and a second namespace made here, under the chart's
    identity for both (without its RoleBinding in the second unless ``bind_other``); yields the
    operator, the second namespace and the RoleBinding left out."""
    other = f"{namespace}-b"
    kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    rendered = render(
        f"phx-{uuid.uuid4().hex[:6]}", namespace, f"watchNamespaces={{{namespace},{other}}}",
        "rbac.aggregateToDefaultRoles=false",
    )  # fmt: skip
    identity = [obj for obj in rendered if obj["kind"] in IDENTITY_KINDS]
    for obj in identity:
        if not obj["kind"].startswith("Cluster"):
            obj["metadata"].setdefault("namespace", namespace)
    left_out = [
        obj
        for obj in identity
        if not bind_other and obj["kind"] == "RoleBinding" and obj["metadata"]["namespace"] == other
    ]
    try:
        kubectl.apply([obj for obj in identity if obj not in left_out])
        account = next(obj for obj in identity if obj["kind"] == "ServiceAccount")["metadata"]["name"]
        token = kubectl.run("create", "token", account, f"--namespace={namespace}", "--duration=1h").stdout.strip()
        as_operator = token_kubeconfig(kubeconfig, token, directory / "operator.kubeconfig")
        with OperatorProcess(as_operator, directory / "operator.log", namespace=[namespace, other]) as operator:
            yield operator, other, left_out
            assert "Traceback" not in operator.log()
    finally:
        kubectl.delete("namespace", other, wait=False)
        for obj in identity:
            if obj["kind"].startswith("Cluster"):
                kubectl.delete(obj["kind"].lower(), obj["metadata"]["name"], wait=False)


def test_a_namespace_the_operator_cannot_list_holds_only_its_own_jobs(
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    crds: list[str],
    namespace: str,
    gpu_nodes: list[str],
    tmp_path: pathlib.Path,
) -> None:
    """Two watched namespaces, the chart's RoleBinding missing in one (removed by hand, or not
    made yet): that namespace's informers get 403 and retry, and its jobs wait; the other's jobs
    run. Once the RoleBinding is back, the waiting namespace syncs and its job runs too."""
    with operator_of_two_namespaces(kubectl, kubeconfig, namespace, tmp_path, bind_other=False) as running:
        operator, locked, missing = running
        create(kubectl, namespace, **GPU_JOB)
        create(kubectl, locked, "waits", **GPU_JOB)
        wait_phase(kubectl, namespace, "Running", timeout=60)
        text = operator.metrics()
        assert metric(text, "phalanx_watch_scope_synced", namespace=namespace) == 1.0, text
        assert metric(text, "phalanx_watch_scope_synced", namespace=locked) == 0.0, text
        assert "phase" not in job_status(kubectl, locked, "waits")  # never visited (status holds schema defaults)
        assert f"in {locked} failed" in operator.log() and "forbidden" in operator.log()

        kubectl.apply(missing)
        wait_phase(kubectl, locked, "Running", name="waits", timeout=90)
        assert metric(operator.metrics(), "phalanx_watch_scope_synced", namespace=locked) == 1.0


def test_a_pod_in_another_namespace_posing_as_a_worker_changes_nothing(
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    crds: list[str],
    namespace: str,
    gpu_nodes: list[str],
    tmp_path: pathlib.Path,
) -> None:
    """A tenant of another watched namespace copies a running worker: its name, labels and owner
    reference (the job's UID). An owner reference names no namespace, so the operator must not
    take it for the job's worker, whatever becomes of it: the garbage collector deletes it (its
    owner is not in its namespace; a finalizer keeps it deleting), or it fails. Nothing is
    counted, replaced or restarted (a job at workers.min restarts its gang when a worker is
    deleted from outside)."""
    with operator_of_two_namespaces(kubectl, kubeconfig, namespace, tmp_path) as (operator, elsewhere, _):
        create(kubectl, namespace, **{**GPU_JOB, "workers": {"min": 2, "max": 4, "desired": 2}})
        before = wait_phase(kubectl, namespace, "Running", timeout=60)
        real = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in workers(kubectl, namespace)}
        victim = kubectl.get("pod", naming.worker_pod_name("demo", 0), namespace)
        assert victim is not None
        name = victim["metadata"]["name"]
        impostor = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": elsewhere,
                "labels": {**victim["metadata"]["labels"], "kwok.phalanx.dev/exit-code": "1"},
                "annotations": victim["metadata"].get("annotations", {}),
                "ownerReferences": victim["metadata"]["ownerReferences"],
                "finalizers": [HOLD_FINALIZER],
            },
            "spec": {
                "nodeName": victim["spec"]["nodeName"],
                "tolerations": victim["spec"].get("tolerations", []),
                "containers": [{"name": "trainer", "image": "example/train:1"}],
            },
        }
        kubectl.create(impostor)
        try:
            kubectl.wait_for(
                lambda: (
                    (pod := kubectl.get("pod", name, elsewhere)) is not None
                    and (pod["metadata"].get("deletionTimestamp") or pod["status"].get("phase") == "Failed")
                ),
                timeout=30,
                what="the impostor deleted by the garbage collector, or failed",
            )
            # a pass over the victim (any change to it wakes one) that would read the impostor's record
            kubectl.run("annotate", "tj", "demo", f"--namespace={namespace}", "phalanx.dev/test-poke=1")
            time.sleep(3)
            after = job_status(kubectl, namespace)
            assert (after["phase"], after["attempt"], after["restarts"]) == ("Running", 0, 0), after
            assert after.get("restartsByReason", {}) == before.get("restartsByReason", {}), after
            assert {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in workers(kubectl, namespace)} == real
            reasons = [event["reason"] for event in kubectl.list("events", namespace)]
            assert "WorkerFailed" not in reasons and "GangRestart" not in reasons, reasons
            operator.check_alive()
        finally:
            kubectl.run("patch", "pod", name, f"--namespace={elsewhere}", "--type=merge",
                        "--patch", '{"metadata": {"finalizers": null}}', check=False)  # fmt: skip


def test_podgroups_for_each_gang_scheduler(
    kubectl: Kubectl, namespace: str, volcano_api: dict[str, Any], operator: OperatorProcess
) -> None:
    create(
        kubectl,
        namespace,
        "coscheduled",
        gang={"scheduler": "scheduler-plugins", "scheduleTimeoutSeconds": 60},
        **GPU_JOB,
    )
    create(kubectl, namespace, "volcanic", gang={"scheduler": "volcano", "queue": "research"}, **GPU_JOB)
    group = kubectl.wait_for(
        lambda: kubectl.get("podgroups.scheduling.x-k8s.io", "coscheduled", namespace),
        timeout=30,
        what="coscheduling PodGroup",
    )
    assert group is not None
    assert group["spec"]["minMember"] == 2 and group["spec"]["scheduleTimeoutSeconds"] == 60
    group = kubectl.wait_for(
        lambda: kubectl.get("podgroups.scheduling.volcano.sh", "volcanic", namespace),
        timeout=30,
        what="volcano PodGroup",
    )
    assert group is not None
    assert group["spec"]["queue"] == "research"
    pods = kubectl.wait_for(lambda: workers(kubectl, namespace, "volcanic"), timeout=30, what="volcano pods")
    assert pods[0]["metadata"]["annotations"][naming.VOLCANO_GROUP_ANNOTATION] == "volcanic"
    assert pods[0]["spec"]["schedulerName"] == "volcano"


def test_unplannable_spec_fails_the_job_with_a_condition_and_no_retry_loop(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    create(kubectl, namespace, checkpoint={"volumeName": "nope"})
    status = wait_phase(kubectl, namespace, "Failed", timeout=30)
    assert status["reason"] == "InvalidSpec"
    assert "spec.checkpoint.volumeName" in status["message"]
    failed = {c["type"]: c for c in status["conditions"]}["Stalled"]
    assert failed["status"] == "True" and failed["reason"] == "InvalidSpec"
    version = kubectl.get("tj", "demo", namespace)["metadata"]["resourceVersion"]  # type: ignore[index]
    time.sleep(3)
    assert kubectl.get("tj", "demo", namespace)["metadata"]["resourceVersion"] == version  # type: ignore[index]
    assert not workers(kubectl, namespace)


def test_operator_never_writes_spec_or_kopf_annotations(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, gpu_nodes: list[str]
) -> None:
    body = create(kubectl, namespace, **GPU_JOB)
    wait_phase(kubectl, namespace, "Running", timeout=60)
    job = kubectl.json("get", "tj", "demo", f"--namespace={namespace}", "--show-managed-fields")
    managers = {(f["manager"], f.get("subresource", "")) for f in job["metadata"]["managedFields"]}
    assert ("phalanx", "") not in managers  # only the status subresource is ours
    assert ("phalanx", "status") in managers
    assert not job["metadata"].get("finalizers")
    assert not [key for key in job["metadata"].get("annotations", {}) if "kopf" in key or "phalanx.dev" in key]
    assert job["spec"]["workers"] == body["spec"]["workers"] | {"min": 2, "spares": 0}  # schema defaults


def metric(text: str, series: str, **labels: str) -> float | None:
    """The value of one series in a /metrics scrape, or None when it is absent."""
    for line in text.splitlines():
        if not line.startswith(series + "{") and not line.startswith(series + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_operator_metrics_follow_the_job(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, gpu_nodes: list[str]
) -> None:
    before = operator.metrics()
    assert metric(before, "phalanx_job_workers_desired", namespace=namespace, name="demo") is None
    create(kubectl, namespace, **GPU_JOB)
    wait_phase(kubectl, namespace, "Running", timeout=60)
    job = {"namespace": namespace, "name": "demo"}
    text = kubectl.wait_for(
        lambda: (t := operator.metrics()) and metric(t, "phalanx_job_phase", phase="Running", **job) == 1.0 and t,
        timeout=20,
        what="Running in /metrics",
    )
    assert isinstance(text, str)
    assert metric(text, "phalanx_job_workers_ready", **job) == 3
    assert metric(text, "phalanx_job_world_size", **job) == 3
    assert metric(text, "phalanx_job_gpus_requested", **job) == 12
    assert metric(text, "phalanx_job_gpus_bound", **job) == 12
    assert metric(text, "phalanx_jobs", phase="Running") >= 1  # type: ignore[operator]
    assert metric(text, "phalanx_job_startup_duration_seconds_count", namespace=namespace) == 1
    passes = metric(text, "controller_runtime_reconcile_total", controller="trainingjob", result="success") or 0
    assert passes > 0
    kubectl.run("scale", "tj/demo", "--replicas=4", f"--namespace={namespace}")
    kubectl.label("pod", "demo-worker-1", {"kwok.phalanx.dev/exit-code": "1"}, namespace)
    text = kubectl.wait_for(
        lambda: (
            (t := operator.metrics())
            and metric(t, "phalanx_job_restarts_total", reason="WorkerFailed", **job) == 1.0
            and t
        ),
        timeout=30,
        what="a counted restart in /metrics",
    )
    assert isinstance(text, str)
    assert metric(text, "phalanx_job_rescales_total", direction="up", **job) == 1
    assert metric(text, "phalanx_job_restart_budget_used", **job) == 1
    assert (
        metric(text, "controller_runtime_reconcile_total", controller="trainingjob", result="success") or 0
    ) > passes
    kubectl.delete("tj", "demo", namespace)
    kubectl.wait_for(
        lambda: metric(operator.metrics(), "phalanx_job_workers_desired", **job) is None,
        timeout=20,
        what="the deleted job's series to go",
    )


def test_a_horizontal_pod_autoscaler_can_drive_the_scale_subresource(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, gpu_nodes: list[str]
) -> None:
    create(kubectl, namespace, **GPU_JOB)
    wait_phase(kubectl, namespace, "Running", timeout=60)
    scale = json.loads(
        kubectl.run("get", "--raw", f"/apis/phalanx.dev/v1alpha1/namespaces/{namespace}/trainingjobs/demo/scale").stdout
    )
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "phalanx.dev/job-name=demo,phalanx.dev/role=worker"
    kubectl.create(
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "demo"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob", "name": "demo"},
                "minReplicas": 2,
                "maxReplicas": 4,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}},
                    }
                ],
            },
        },
        namespace=namespace,
    )

    def able_to_scale() -> bool:
        hpa = kubectl.get("hpa", "demo", namespace) or {}
        conditions = {c["type"]: c for c in (hpa.get("status") or {}).get("conditions", [])}
        able: dict[str, str] = conditions.get("AbleToScale", {})
        return able.get("status") == "True" and able.get("reason") == "SucceededGetScale"

    # No metrics server runs here, so the HPA cannot compute a target; what matters is that the
    # HPA controller reads the job through the scale subresource, as it would to change it.
    kubectl.wait_for(able_to_scale, timeout=60, interval=1.0, what="HPA AbleToScale/SucceededGetScale")
