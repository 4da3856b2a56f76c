"""Each job's own NetworkPolicy (issue 21, defect 5), on the real control plane: the API server
accepts what the planner renders with the chart's peers, the operator creates it under the chart's
RBAC owned by the job, and the garbage collector removes it with the job."""

from __future__ import annotations

import json
import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from phalanx.reconcile import desired, naming
from tests.cluster.kube import Kubectl
from tests.integration.chart_identity import chart_identity, render
from tests.integration.operator_process import OperatorProcess
from tests.unit.jobs import manifest

pytestmark = pytest.mark.integration

ISOLATED = "networkPolicy.jobs.enabled=true"
OBSERVERS = "networkPolicy.jobs.scrapersFrom[0].namespaceSelector.matchLabels.team=obs"
POLICIES = "networkpolicies.networking.k8s.io"


def operator_env(release: str, namespace: str, *values: str) -> dict[str, str]:
    """The PHALANX_* variables the chart's Deployment gives the operator."""
    deployment = next(obj for obj in render(release, namespace, *values) if obj["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {var["name"]: var["value"] for var in container["env"] if var["name"].startswith("PHALANX_JOB_")}


def operator_peer(namespace: str, release: str) -> dict[str, Any]:
    """The chart's operator pods as a NetworkPolicyPeer."""
    pods = {"app.kubernetes.io/name": "phalanx", "app.kubernetes.io/instance": release}
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": pods},
    }


@pytest.fixture
def isolating_operator(
    crds: list[str], kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, tmp_path: pathlib.Path
) -> Iterator[tuple[OperatorProcess, str]]:
    """The operator under the chart's identity and settings with networkPolicy.jobs enabled."""
    release = f"phx-{uuid.uuid4().hex[:6]}"
    with chart_identity(kubectl, kubeconfig, namespace, release, tmp_path, values=(ISOLATED,)) as identity:
        env = operator_env(release, namespace, ISOLATED)
        process = OperatorProcess(identity, tmp_path / "operator.log", namespace=namespace, extra_env=env)
        with process:
            yield process, release
        print(f"--- operator log (tail) ---\n{process.log_tail(80)}")


def test_the_chart_sets_the_operator_up_to_isolate_jobs_only_when_asked() -> None:
    namespace, release = "phalanx-system", "phalanx"
    off = render(release, namespace)
    on = render(release, namespace, ISOLATED, OBSERVERS)

    def rules(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        role = next(obj for obj in objects if obj["kind"] == "ClusterRole" and obj["metadata"]["name"] == release)
        return [rule for rule in role["rules"] if "networkpolicies" in rule["resources"]]

    assert rules(off) == [] and operator_env(release, namespace) == {}
    assert rules(on) == [
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
         "verbs": ["get", "list", "watch", "create", "patch"]}
    ]  # fmt: skip
    env = operator_env(release, namespace, ISOLATED, OBSERVERS)
    assert env["PHALANX_JOB_NETWORK_POLICY"] == "1"
    peers = desired.network_policy_peers(json.loads(env["PHALANX_JOB_NETWORK_POLICY_SCRAPERS"]))
    assert peers == (operator_peer(namespace, release), {"namespaceSelector": {"matchLabels": {"team": "obs"}}})


def test_the_operator_gives_each_job_a_network_policy_it_owns(
    kubectl: Kubectl, namespace: str, isolating_operator: tuple[OperatorProcess, str]
) -> None:
    _, release = isolating_operator
    body = manifest()
    body["metadata"] = {"name": "demo"}
    kubectl.create(body, namespace=namespace)
    job = kubectl.get("tj", "demo", namespace)
    assert job is not None
    policy = kubectl.wait_for(
        lambda: kubectl.get(POLICIES, "demo", namespace), timeout=60, what="the job's NetworkPolicy"
    )
    assert isinstance(policy, dict)
    [owner] = policy["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "TrainingJob",
        "demo",
        job["metadata"]["uid"],
        True,
    )
    assert policy["metadata"]["labels"] == naming.job_labels("demo")
    managed = kubectl.json("get", POLICIES, "demo", f"--namespace={namespace}", "--show-managed-fields")
    assert {entry["manager"] for entry in managed["metadata"]["managedFields"]} == {naming.FIELD_MANAGER}
    members = {"matchLabels": naming.job_labels("demo")}
    assert policy["spec"]["podSelector"] == members and policy["spec"]["policyTypes"] == ["Ingress"]
    own, scrapes = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": members}]}
    assert scrapes["from"] == [operator_peer(namespace, release)]
    # The pods it fences are the job's: the selector picks exactly the workers and the store.
    selector = ",".join(f"{key}={value}" for key, value in naming.job_labels("demo").items())
    fenced = kubectl.wait_for(
        lambda: len(pods := kubectl.list("pods", namespace, selector)) == 4 and pods,
        timeout=60,
        what="three workers and the store",
    )
    assert isinstance(fenced, list)
    assert sorted(pod["metadata"]["labels"][naming.ROLE_LABEL] for pod in fenced) == [
        naming.ROLE_RENDEZVOUS,
        *[naming.ROLE_WORKER] * 3,
    ]

    kubectl.delete("tj", "demo", namespace, wait=True)
    kubectl.wait_for(
        lambda: kubectl.get(POLICIES, "demo", namespace) is None, timeout=60, what="the policy garbage-collected"
    )
