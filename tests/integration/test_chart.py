"""The Helm chart: lint, render, and least-privilege RBAC checked against the real API server."""

from __future__ import annotations

import json
import pathlib
import subprocess
import uuid
from typing import Any

import pytest
import yaml

from tests.cluster.kube import Kubectl
from tests.integration.chart_identity import CHART, chart_identity, helm, render

pytestmark = pytest.mark.integration
ROOT = pathlib.Path(__file__).resolve().parents[2]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def test_lint_strict_passes_and_the_values_schema_refuses_bad_values() -> None:
    ok = subprocess.run([str(helm()), "lint", "--strict", str(CHART)], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run(
        [str(helm()), "lint", "--strict", str(CHART), "--set", "operator.logFormat=xml"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode != 0 and "logFormat" in bad.stdout + bad.stderr


def test_default_install_is_cluster_wide_with_one_restricted_replica() -> None:
    objects = render("phalanx", "phalanx-system")
    (deployment,) = by_kind(objects, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--all-namespaces" in container["args"] and "--standalone" in container["args"]
    assert container["resources"]["requests"]
    assert [role["metadata"]["name"] for role in by_kind(objects, "ClusterRole")] == ["phalanx", "phalanx-nodes"]
    assert not by_kind(objects, "Role")
    (crd,) = by_kind(objects, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    expected = yaml.safe_load((ROOT / "crds" / "trainingjobs.phalanx.dev.yaml").read_text())
    assert crd["spec"] == expected["spec"]


def test_namespaced_mode_uses_roles_in_the_listed_namespaces_only() -> None:
    objects = render("phalanx", "phalanx-system", "watchNamespaces={team-a,team-b}", "crds.install=false")
    assert sorted(role["metadata"]["namespace"] for role in by_kind(objects, "Role")) == ["team-a", "team-b"]
    assert [role["metadata"]["name"] for role in by_kind(objects, "ClusterRole")] == ["phalanx-nodes"]
    args = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    assert not by_kind(objects, "CustomResourceDefinition")


def test_monitors_carry_additional_labels() -> None:
    objects = render(
        "phalanx",
        "phalanx-system",
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.additionalLabels.release=prom",
        "metrics.podMonitor.enabled=true",
        "metrics.podMonitor.additionalLabels.release=prom",
    )
    (service_monitor,) = by_kind(objects, "ServiceMonitor")
    (pod_monitor,) = by_kind(objects, "PodMonitor")
    assert service_monitor["metadata"]["labels"]["release"] == "prom"
    assert pod_monitor["metadata"]["labels"]["release"] == "prom"
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {"phalanx.dev/role": "worker"}


def may(identity: Kubectl, verb: str, resource: str, namespace: str) -> bool:
    """A SelfSubjectAccessReview: unlike `kubectl auth can-i` it needs no discovery, so it also
    answers for an API that is not installed (Kueue's Workloads) as RBAC would once it is."""
    name, *flags = resource.split()
    plural, _, group = name.partition(".")
    attributes = {"verb": verb, "group": group, "resource": plural, "namespace": namespace}
    for flag in flags:
        attributes["subresource"] = flag.removeprefix("--subresource=")
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attributes},
    }
    answer = identity.run("create", "--validate=false", "-f", "-", "-o", "json", input=json.dumps(review))
    return bool(json.loads(answer.stdout)["status"]["allowed"])


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("watch", "trainingjobs.phalanx.dev", True),
        ("patch", "trainingjobs.phalanx.dev --subresource=status", True),
        ("patch", "trainingjobs.phalanx.dev", False),  # the operator never writes spec
        ("update", "trainingjobs.phalanx.dev", False),
        ("create", "pods", True),
        ("delete", "pods", True),
        ("update", "pods", False),
        ("get", "secrets", False),
        ("create", "events", True),
        ("create", "podgroups.scheduling.volcano.sh", True),
        ("delete", "services", False),
        ("watch", "workloads.kueue.x-k8s.io", True),
        ("patch", "workloads.kueue.x-k8s.io", False),
    ],
)
def test_chart_rbac_is_least_privilege(
    crds: list[str],
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    namespace: str,
    tmp_path: pathlib.Path,
    verb: str,
    resource: str,
    allowed: bool,
) -> None:
    with chart_identity(kubectl, kubeconfig, namespace, f"phx-{uuid.uuid4().hex[:6]}", tmp_path) as identity:
        as_operator = Kubectl(identity, kubectl.binary)
        assert may(as_operator, verb, resource, namespace) == allowed
        elsewhere = as_operator.run("auth", "can-i", "list", "pods", "--namespace=kube-system", check=False)
        assert elsewhere.stdout.strip() == "no"  # a namespaced install sees only its namespaces
