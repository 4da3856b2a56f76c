"""``phalanx doctor`` on a real control plane of its own (no KWOK, no operator), each problem it
names first present, then absent: the CRD missing and outdated, no operator and a Lease gone stale,
a user without access to TrainingJobs, a job's gang scheduler API not served, GPUs no node offers,
and a namespace whose Pod Security level refuses the job's pods."""

from __future__ import annotations

import base64
import copy
import json
import pathlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from phalanx.api import crd
from tests.cluster.crds import coscheduling_crd
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.cluster.stop_on_exit import stopped_on_exit
from tests.integration.phalanx_cli import phalanx

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMESPACE = "team-a"
RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kubectl]:
    """A control plane with nothing of phalanx's on it; its admin kubectl."""
    cluster = LocalCluster(tmp_path_factory.mktemp("doctor-cluster"), kwok=False)
    with stopped_on_exit(cluster.stop):
        cluster.start()
        kubectl = Kubectl(cluster.kubeconfig)
        kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        yield kubectl


def doctor(kubeconfig: pathlib.Path, *files: pathlib.Path) -> tuple[int, dict[str, list[tuple[str, str]]]]:
    """Exit status and the findings by check: (verdict, message)."""
    run = phalanx("doctor", f"--kubeconfig={kubeconfig}", f"--namespace={NAMESPACE}", *map(str, files))
    assert not run.stderr, run.stderr
    found: dict[str, list[tuple[str, str]]] = {}
    for line in run.stdout.splitlines():
        verdict, check, message = line[:8].strip(), line[9:].split("  ")[0].strip(), line.split("  ", 1)[-1].strip()
        found.setdefault(check, []).append((verdict, message))
    print(run.stdout)
    return run.returncode, found


def verdicts(found: dict[str, list[tuple[str, str]]], check: str) -> list[str]:
    return [verdict for verdict, _ in found.get(check, [])]


def job_file(tmp_path: pathlib.Path, *, gang: str = "none", gpus: int = 0, restricted: bool = False) -> pathlib.Path:
    container: dict[str, Any] = {"name": "trainer", "image": "trainer:dev", "command": ["torchrun"], "args": ["t.py"]}
    pod: dict[str, Any] = {"containers": [container]}
    if restricted:
        container["securityContext"] = RESTRICTED_CONTAINER
        pod["securityContext"] = RESTRICTED_POD
    spec: dict[str, Any] = {"workers": {"min": 2, "max": 2, "desired": 2}, "template": {"spec": pod}}
    if gang != "none":
        spec["gang"] = {"scheduler": gang}
    if gpus:
        spec["gpus"] = {"count": gpus}
    path = tmp_path / f"job-{gang}-{gpus}-{restricted}.yaml"
    body = {"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "demo"}, "spec": spec}
    path.write_text(yaml.safe_dump(body))
    return path


def apply_crd(kubectl: Kubectl, body: dict[str, Any]) -> None:
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(body))
    kubectl.wait_established(body["metadata"]["name"])


def lease(kubectl: Kubectl, renewed: datetime) -> None:
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "phalanx-operator", "namespace": "phalanx-system"},
        "spec": {
            "holderIdentity": "replica-a",
            "leaseDurationSeconds": 15,
            "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        },
    }
    kubectl.apply(body)


def test_doctor_names_each_missing_piece_and_is_content_once_it_is_there(bare: Kubectl, tmp_path: pathlib.Path) -> None:
    admin = bare.kubeconfig
    cpu_job = job_file(tmp_path)

    # Nothing installed: the CRD and the operator are missing.
    status, found = doctor(admin, cpu_job)
    assert status == 1
    assert verdicts(found, "CRD") == ["PROBLEM"] and "is not installed" in found["CRD"][0][1]
    assert verdicts(found, "operator") == ["PROBLEM"] and "no phalanx operator found" in found["operator"][0][1]

    # An outdated CRD: a field of the status missing from its schema (as before trainingSeconds came).
    old = crd.custom_resource_definition()
    old_schema = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    del old_schema["properties"]["status"]["properties"]["trainingSeconds"]
    apply_crd(bare, old)
    _, found = doctor(admin, cpu_job)
    assert verdicts(found, "CRD") == ["PROBLEM"] and "lacks status.trainingSeconds" in found["CRD"][0][1], found["CRD"]
    apply_crd(bare, crd.custom_resource_definition())
    _, found = doctor(admin, cpu_job)
    assert verdicts(found, "CRD") == ["OK"], found["CRD"]

    # The operator: a Lease renewed just now, then one nobody renewed for minutes.
    bare.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "phalanx-system"}})
    lease(bare, datetime.now(UTC))
    _, found = doctor(admin, cpu_job)
    assert verdicts(found, "operator") == ["OK"] and "replica-a" in found["operator"][0][1], found["operator"]
    lease(bare, datetime.now(UTC) - timedelta(minutes=5))
    _, found = doctor(admin, cpu_job)
    assert verdicts(found, "operator") == ["PROBLEM"] and "no replica leads" in found["operator"][0][1]
    lease(bare, datetime.now(UTC))

    # The admin may do everything; the CPU job needs no gang API and no devices.
    status, found = doctor(admin, cpu_job)
    assert verdicts(found, "access") == ["OK"], found
    assert verdicts(found, "devices") == ["OK", "OK"], found["devices"]
    assert "gang" not in found
    assert status == 0, found


def test_doctor_judges_a_user_without_access(bare: Kubectl, tmp_path: pathlib.Path) -> None:
    apply_crd(bare, crd.custom_resource_definition())
    bare.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "newcomer", "namespace": NAMESPACE}}
    )
    token = bare.run("create", "token", "newcomer", f"--namespace={NAMESPACE}").stdout.strip()
    config = yaml.safe_load(bare.kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    if "certificate-authority" in cluster:  # self-contained: the CA inline
        cluster["certificate-authority-data"] = base64.b64encode(
            pathlib.Path(cluster.pop("certificate-authority")).read_bytes()
        ).decode()
    user_config = copy.deepcopy(config)
    user_config["users"] = [{"name": "newcomer", "user": {"token": token}}]
    for context in user_config["contexts"]:
        context["context"]["user"] = "newcomer"
    kubeconfig = tmp_path / "newcomer.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(user_config))

    status, found = doctor(kubeconfig, job_file(tmp_path))
    assert status == 1
    assert verdicts(found, "access") == ["PROBLEM"], found
    assert "you may not create trainingjobs" in found["access"][0][1], found["access"]

    rules = [
        {"apiGroups": ["phalanx.dev"], "resources": ["trainingjobs"], "verbs": ["*"]},
        {"apiGroups": ["phalanx.dev"], "resources": ["trainingjobs/scale"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["pods", "pods/log", "events"], "verbs": ["get", "list", "create"]},
    ]
    bare.apply(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "jobs"},
                "rules": rules,
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "newcomer-jobs"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "jobs"},
                "subjects": [{"kind": "ServiceAccount", "name": "newcomer", "namespace": NAMESPACE}],
            },
        ],
        namespace=NAMESPACE,
    )

    def granted() -> dict[str, list[tuple[str, str]]]:
        _, found = doctor(kubeconfig, job_file(tmp_path))
        return found if verdicts(found, "access") == ["OK"] else {}

    found = bare.wait_for(granted, timeout=30, interval=1, what="the RoleBinding to take effect")
    assert verdicts(found, "access") == ["OK"], found


def test_doctor_judges_a_jobs_gang_scheduler_devices_and_pod_security(bare: Kubectl, tmp_path: pathlib.Path) -> None:
    admin = bare.kubeconfig
    apply_crd(bare, crd.custom_resource_definition())

    # A gang of GPU workers: scheduler-plugins is not installed, and no node has a GPU.
    gang_job = job_file(tmp_path, gang="scheduler-plugins", gpus=2, restricted=True)
    status, found = doctor(admin, gang_job)
    assert status == 1
    assert verdicts(found, "gang") == ["PROBLEM"] and "scheduling.x-k8s.io/v1alpha1" in found["gang"][0][1]
    assert "PROBLEM" in verdicts(found, "devices")
    assert any("no schedulable node offers it" in message for _, message in found["devices"]), found["devices"]

    apply_crd(bare, yaml.safe_load(coscheduling_crd().read_text()))
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}}
    bare.create(node)
    capacity = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"}
    bare.run(
        "patch", "node", "gpu-node-1", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"capacity": capacity, "allocatable": capacity}}),
    )  # fmt: skip
    _, found = doctor(admin, gang_job)
    assert verdicts(found, "gang") == ["OK"], found["gang"]
    assert verdicts(found, "devices") == ["OK", "OK"], found["devices"]
    assert "8 nvidia.com/gpu" in found["devices"][0][1]

    # Pod Security: a restricted namespace refuses a template without a securityContext.
    bare.label("namespace", NAMESPACE, {"pod-security.kubernetes.io/enforce": "restricted"})
    status, found = doctor(admin, job_file(tmp_path))
    assert status == 1
    assert verdicts(found, "pod security") == ["PROBLEM"], found
    assert "violates PodSecurity" in found["pod security"][0][1]
    status, found = doctor(admin, gang_job)  # the same job, its template meeting "restricted"
    assert verdicts(found, "pod security") == ["OK"], found
    assert "restricted" in found["pod security"][0][1] and "a dry run" in found["pod security"][0][1]
    assert bare.list("pods", NAMESPACE) == []  # dry runs create nothing
