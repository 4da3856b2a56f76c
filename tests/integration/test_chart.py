"""The Helm chart: lint, render, and least-privilege RBAC checked against the real API server."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from phalanx import metrics_endpoint
from phalanx.cluster.lease import LeaseTiming
from phalanx.handlers.settings import LEASE_DURATION_ENV, RENEW_DEADLINE_ENV, RETRY_ENV
from phalanx.reconcile import naming
from phalanx.reconcile.environment import WORKER_METRICS_PORT
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.chart_identity import CHART, chart_identity, helm, identity_objects, lint, render
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import GPU_JOB, conditions, create, gpu_pool, wait_running, wait_status
from tests.unit.test_metrics_tls import self_signed

pytestmark = pytest.mark.integration
ROOT = pathlib.Path(__file__).resolve().parents[2]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def test_lint_strict_passes_and_the_values_schema_refuses_bad_values() -> None:
    ok = lint()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = lint("operator.logFormat=xml")
    assert bad.returncode != 0 and "logFormat" in bad.stdout + bad.stderr


def test_default_install_is_cluster_wide_with_two_restricted_replicas_electing_a_leader() -> None:
    objects = render("phalanx", "phalanx-system")
    (deployment,) = by_kind(objects, "Deployment")
    spec = deployment["spec"]
    # two replicas electing a leader, rolled one at a time, kept apart, one kept through drains
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    (budget,) = by_kind(objects, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["PHALANX_LEADER_ELECTION"] == "1" and env["PHALANX_LEASE_NAME"] == "phalanx"
    assert env["PHALANX_LEADER_IDENTITY"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "--all-namespaces" in container["args"] and "--standalone" in container["args"]
    # warm spares rank below workers, in the class the chart installs (issue 31 point 4)
    (spare_class,) = by_kind(objects, "PriorityClass")
    assert spare_class["metadata"]["name"] == env["PHALANX_SPARE_PRIORITY_CLASS"] == "phalanx-spare"
    assert spare_class["value"] < 0 and spare_class["preemptionPolicy"] == "Never"
    assert not spare_class["globalDefault"]
    assert container["resources"]["requests"]
    assert [role["metadata"]["name"] for role in by_kind(objects, "ClusterRole")] == [
        "phalanx",
        "phalanx-nodes",
        "phalanx-edit",
        "phalanx-view",
    ]
    (lease_role,) = by_kind(objects, "Role")  # its own Lease, nothing else
    assert lease_role["metadata"]["name"] == "phalanx-leader-election"
    assert {tuple(rule["verbs"]) for rule in lease_role["rules"]} == {("create",), ("get", "update")}
    (crd,) = by_kind(objects, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    expected = yaml.safe_load((ROOT / "crds" / "trainingjobs.phalanx.dev.yaml").read_text())
    assert crd["spec"] == expected["spec"]


def template_errors(*values: str) -> str:
    """``helm template``'s error output ("" when it renders)."""
    command = [str(helm()), "template", "phalanx", str(CHART), "--namespace=phalanx-system"]
    for value in values:
        command += ["--set", value]
    rendered = subprocess.run(command, capture_output=True, text=True, check=False)
    return "" if rendered.returncode == 0 else rendered.stderr


def test_lease_timings_that_break_the_operators_rules_are_refused_by_the_chart() -> None:
    """The schema cannot compare fields: the template refuses what ``LeaseTiming`` would refuse,
    and its defaults satisfy it."""
    assert template_errors() == ""
    env = env_of(operator_container(render("phalanx", "phalanx-system")))
    defaults = [float(env[name]) for name in (LEASE_DURATION_ENV, RENEW_DEADLINE_ENV, RETRY_ENV)]
    assert LeaseTiming(*defaults) == LeaseTiming()  # the chart's defaults are the operator's
    old_defaults = template_errors("leaderElection.leaseDurationSeconds=10", "leaderElection.renewDeadlineSeconds=7")
    assert "renewDeadlineSeconds (7) + retryPeriodSeconds (2) + 2 <= leaseDurationSeconds (10)" in old_defaults
    jitter = template_errors("leaderElection.renewDeadlineSeconds=2", "leaderElection.retryPeriodSeconds=2")
    assert "renewDeadlineSeconds (2) > 1.2 x retryPeriodSeconds (2)" in jitter
    assert template_errors("leaderElection.leaseDurationSeconds=137", "leaderElection.renewDeadlineSeconds=107",
                           "leaderElection.retryPeriodSeconds=26") == ""  # fmt: skip
    # a single operator without election does not read them
    assert (
        template_errors("replicaCount=1", "leaderElection.enabled=false", "leaderElection.renewDeadlineSeconds=14")
        == ""
    )
    # what the chart accepts the operator accepts too, and the other way round, around the edge
    for lease in (12, 13):
        values = [f"leaderElection.leaseDurationSeconds={lease}"]
        chart_ok = template_errors(*values) == ""
        try:
            LeaseTiming(lease, 10, 2)
            operator_ok = True
        except ValueError:
            operator_ok = False
        assert chart_ok == operator_ok, lease


def test_namespaced_mode_uses_roles_in_the_listed_namespaces_only() -> None:
    objects = render("phalanx", "phalanx-system", "watchNamespaces={team-a,team-b}", "crds.install=false")
    roles = [r["metadata"]["namespace"] for r in by_kind(objects, "Role") if "leader" not in r["metadata"]["name"]]
    assert sorted(roles) == ["team-a", "team-b"]
    assert [role["metadata"]["name"] for role in by_kind(objects, "ClusterRole")] == [
        "phalanx-nodes",
        "phalanx-edit",
        "phalanx-view",
    ]
    # other namespaces' pods only when asked for (the room their requests leave a node, docs/placement.md)
    nodes_role = by_kind(objects, "ClusterRole")[0]
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]} in nodes_role["rules"]
    wider = render("phalanx", "ops", "watchNamespaces={team-a}", "podRequestsFromAllNamespaces=true")
    rules = by_kind(wider, "ClusterRole")[0]["rules"]
    assert {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["list", "watch"]} in rules
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
        # OwnerReferencesPermissionEnforcement: owner references need delete on the child and
        # blockOwnerDeletion update on the owner's finalizers
        ("delete", "services", True),
        ("delete", "podgroups.scheduling.x-k8s.io", True),
        ("update", "trainingjobs.phalanx.dev --subresource=finalizers", True),
        ("update", "services", False),
        ("create", "resourceclaimtemplates.resource.k8s.io", True),
        ("patch", "endpointslices.discovery.k8s.io", True),
        ("create", "resourceclaims.resource.k8s.io", False),  # the claim controller makes them
        ("watch", "workloads.kueue.x-k8s.io", True),
        # the priority boost (status.preemptionCost): a JSON patch of one annotation, never a
        # whole-object write
        ("patch", "workloads.kueue.x-k8s.io", True),
        ("update", "workloads.kueue.x-k8s.io", False),
        ("delete", "workloads.kueue.x-k8s.io", False),
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


@pytest.fixture(scope="module")
def gpu_nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    return gpu_pool(kwok_cluster, kubectl, "chart")


def test_without_the_finalizers_rule_a_job_stalls_on_the_missing_permission_and_runs_once_granted(
    crds: list[str],
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    namespace: str,
    gpu_nodes: list[str],
    tmp_path: pathlib.Path,
) -> None:
    """OwnerReferencesPermissionEnforcement (on in this control plane, as in OpenShift) refuses the
    workers' owner references with blockOwnerDeletion to an operator that may not update
    ``trainingjobs/finalizers``: a missing permission (Stalled, OperatorForbidden, naming it), not a
    job that fails; once the chart's rule is granted the job runs."""
    release = f"phx-{uuid.uuid4().hex[:6]}"
    with (
        chart_identity(
            kubectl, kubeconfig, namespace, release, tmp_path, without="trainingjobs/finalizers"
        ) as identity,
        OperatorProcess(identity, tmp_path / "operator.log", namespace=namespace) as operator,
    ):
        create(kubectl, namespace, workers={**GPU_JOB["workers"], "desired": 2})
        stalled = wait_status(
            kubectl,
            namespace,
            lambda s: conditions(s).get("Stalled") == ("True", "OperatorForbidden"),
            "Stalled for OperatorForbidden",
            timeout=60,
        )
        message = next(c["message"] for c in stalled["conditions"] if c["type"] == "Stalled")
        assert "blockOwnerDeletion" in message and "update on trainingjobs/finalizers" in message, message
        assert stalled.get("phase") != "Failed" and stalled.get("reason") != "PodRefused", stalled
        kubectl.apply(identity_objects(release, namespace), namespace=namespace)  # the chart's rules
        wait_running(kubectl, namespace, 2, timeout=120)
        print(f"--- operator log (tail) ---\n{operator.log_tail(40)}")
        assert "Traceback" not in operator.log()


def test_namespace_users_with_edit_run_jobs_and_with_view_only_read_them(
    crds: list[str], kubectl: Kubectl, namespace: str, tmp_path: pathlib.Path
) -> None:
    """The chart's ClusterRoles aggregate into the built-in edit/admin and view roles, so a plain
    RoleBinding to ``edit`` (or ``view``) is all a namespace user needs."""
    release = f"phx-{uuid.uuid4().hex[:6]}"
    roles = [
        obj for obj in render(release, "phalanx-system") if obj["kind"] == "ClusterRole" and "aggregate" in str(obj)
    ]
    assert sorted(obj["metadata"]["name"] for obj in roles) == [f"{release}-phalanx-edit", f"{release}-phalanx-view"]
    kubectl.apply(roles)
    try:
        for user, role in (("alice", "edit"), ("bob", "view")):
            kubectl.run(
                "create",
                "rolebinding",
                f"{user}-{role}",
                f"--clusterrole={role}",
                f"--user={user}",
                f"--namespace={namespace}",
            )
        alice, bob = (Kubectl(kubectl.kubeconfig, kubectl.binary, impersonate=user) for user in ("alice", "bob"))

        def can(who: Kubectl, *what: str) -> bool:
            answer = who.run("auth", "can-i", *what, f"--namespace={namespace}", check=False).stdout.strip()
            return answer == "yes"

        # the controller-manager folds the new rules into edit and view
        kubectl.wait_for(
            lambda: can(alice, "create", "trainingjobs.phalanx.dev") and can(bob, "list", "trainingjobs.phalanx.dev"),
            timeout=30,
            what="aggregated rules in effect",
        )
        assert can(alice, "patch", "trainingjobs.phalanx.dev", "--subresource=scale")
        assert can(alice, "delete", "trainingjobs.phalanx.dev")
        assert not can(alice, "patch", "trainingjobs.phalanx.dev", "--subresource=status")  # the operator's alone
        assert can(bob, "get", "trainingjobs.phalanx.dev") and can(bob, "watch", "trainingjobs.phalanx.dev")
        for verb in ("create", "update", "patch", "delete"):
            assert not can(bob, verb, "trainingjobs.phalanx.dev"), verb
        assert not can(bob, "patch", "trainingjobs.phalanx.dev", "--subresource=scale")

        # real requests as those users
        job = yaml.safe_load((ROOT / "examples" / "cpu-gloo.yaml").read_text())
        job["metadata"] = {"name": "alices"}
        alice.create(job, namespace=namespace)
        alice.run("scale", "tj", "alices", "--replicas=3", f"--namespace={namespace}")
        assert kubectl.get("tj", "alices", namespace)["spec"]["workers"]["desired"] == 3  # type: ignore[index]
        assert bob.get("tj", "alices", namespace) is not None
        job["metadata"] = {"name": "bobs"}
        refused = bob.run("create", f"--namespace={namespace}", "-f", "-", input=yaml.safe_dump(job), check=False)
        assert refused.returncode != 0 and "forbidden" in refused.stderr, refused.stderr
        refused = bob.run("delete", "tj", "alices", f"--namespace={namespace}", check=False)
        assert refused.returncode != 0 and "forbidden" in refused.stderr, refused.stderr
        alice.delete("tj", "alices", namespace)
        assert kubectl.get("tj", "alices", namespace) is None
    finally:
        for obj in roles:
            kubectl.delete("clusterrole", obj["metadata"]["name"], wait=False)


# ------------------------------------------------------------------ names, labels, image, extras

TLS_SECRET = "phalanx-metrics-tls"


def every_option_on() -> list[str]:
    """``--set`` values that turn on every optional object (each ``enabled: false`` in values.yaml)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def switches(tree: dict[str, Any], path: tuple[str, ...]) -> Iterator[str]:
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from switches(value, (*path, key))
            elif key == "enabled" and value is False:
                yield ".".join((*path, key))

    return [f"{switch}=true" for switch in switches(values, ())] + [f"metrics.tls.secretName={TLS_SECRET}"]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = by_kind(objects, kind)
    return obj


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {var["name"]: var.get("value", "") for var in container.get("env", [])}


def test_name_overrides_and_names_cut_to_63_characters() -> None:
    renamed = render("rel", "phalanx-system", "nameOverride=trainer")
    deployment = one(renamed, "Deployment")
    assert deployment["metadata"]["name"] == "rel-trainer"
    selector = {"app.kubernetes.io/name": "trainer", "app.kubernetes.io/instance": "rel"}
    assert deployment["spec"]["selector"]["matchLabels"] == selector
    assert one(renamed, "Service")["metadata"]["name"] == "rel-trainer-metrics"
    assert one(renamed, "Service")["spec"]["selector"] == selector
    # a release name holding the (overridden) chart name is the full name
    assert one(render("my-trainer", "ns", "nameOverride=trainer"), "Deployment")["metadata"]["name"] == "my-trainer"

    objects = render("rel", "phalanx-system", "fullnameOverride=ops", *every_option_on())
    for obj in objects:
        if obj["kind"] != "CustomResourceDefinition":  # its name is the API's
            assert obj["metadata"]["name"].startswith("ops"), (obj["kind"], obj["metadata"]["name"])
    account = one(objects, "ServiceAccount")["metadata"]["name"]
    for binding in by_kind(objects, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "phalanx-system"}]
        assert binding["roleRef"]["name"] in {role["metadata"]["name"] for role in by_kind(objects, "ClusterRole")}
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account

    long = "a" * 62 + "-tail"
    objects = render("rel", "phalanx-system", f"fullnameOverride={long}", *every_option_on())
    assert one(objects, "Deployment")["metadata"]["name"] == "a" * 62  # cut, without a trailing "-"
    assert one(objects, "Service")["metadata"]["name"] == "a" * 55 + "-metrics"  # still a DNS label
    for obj in objects:
        assert len(obj["metadata"]["name"]) <= 253, obj["kind"]  # a DNS subdomain


def test_common_labels_are_on_every_object_and_in_no_selector() -> None:
    common = {"team": "ml", "cost-center": "c42"}
    sets = [f"commonLabels.{key}={value}" for key, value in common.items()]
    clash = r"commonLabels.app\.kubernetes\.io/name=other"  # the chart's own label wins
    default_selector = one(render("rel", "phalanx-system"), "Deployment")["spec"]["selector"]
    for mode in ([], ["watchNamespaces={team-a}"]):
        objects = render("rel", "phalanx-system", *every_option_on(), *sets, clash, *mode)
        kinds = {obj["kind"] for obj in objects}
        expected = {"Deployment", "Service", "ServiceAccount", "NetworkPolicy", "ServiceMonitor", "PodMonitor", "Pod"}
        assert expected <= kinds, kinds
        assert ({"Role", "RoleBinding"} if mode else {"ClusterRole", "ClusterRoleBinding"}) <= kinds
        for obj in objects:
            if obj["kind"] == "CustomResourceDefinition":
                continue  # generated by `phalanx crd` (operator/phalanx/api/crd.py) with fixed labels
            labels = obj["metadata"]["labels"]
            assert common.items() <= labels.items(), (obj["kind"], obj["metadata"]["name"], labels)
            assert labels.get("app.kubernetes.io/name") in (None, "phalanx"), (obj["kind"], labels)
        deployment = one(objects, "Deployment")
        assert common.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        # upgrading a release to new commonLabels must not touch the immutable selector
        assert deployment["spec"]["selector"] == default_selector
        selectors = [
            deployment["spec"]["selector"]["matchLabels"],
            one(objects, "Service")["spec"]["selector"],
            one(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"],
            one(objects, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"],
        ]
        for selector in selectors:
            assert not common.keys() & selector.keys(), selector


def test_image_digest_replaces_the_tag() -> None:
    digest = "sha256:" + "0123456789abcdef" * 4
    image = ["image.repository=phalanx.local/operator", "image.tag=dev"]

    def images(*values: str) -> list[str]:
        objects = render("rel", "phalanx-system", *image, *values)
        pods = [one(objects, "Deployment")["spec"]["template"]["spec"], one(objects, "Pod")["spec"]]
        return [container["image"] for pod in pods for container in pod["containers"]]

    assert images() == ["phalanx.local/operator:dev"] * 2  # the operator and its `helm test` pod
    assert images(f"image.digest={digest}") == [f"phalanx.local/operator@{digest}"] * 2
    bad = lint("image.digest=latest")
    assert bad.returncode != 0 and "digest" in bad.stdout + bad.stderr


def test_env_env_from_and_extra_volumes_reach_the_operator() -> None:
    objects = render(
        "rel",
        "phalanx-system",
        "env[0].name=HTTPS_PROXY",
        "env[0].value=http://proxy.example:3128",
        "envFrom[0].secretRef.name=operator-env",
        "extraVolumes[0].name=proxy-ca",
        "extraVolumes[0].configMap.name=proxy-ca",
        "extraVolumeMounts[0].name=proxy-ca",
        "extraVolumeMounts[0].mountPath=/etc/proxy-ca",
        "extraVolumeMounts[0].readOnly=true",
    )
    container = operator_container(objects)
    env = env_of(container)
    assert env["HTTPS_PROXY"] == "http://proxy.example:3128"
    assert env["PHALANX_RECONCILE_WORKERS"] == "8"  # the chart's own are still there
    assert container["envFrom"] == [{"secretRef": {"name": "operator-env"}}]
    assert {"name": "proxy-ca", "mountPath": "/etc/proxy-ca", "readOnly": True} in container["volumeMounts"]
    volumes = one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "proxy-ca", "configMap": {"name": "proxy-ca"}} in volumes
    assert {"name": "tmp", "emptyDir": {}} in volumes
    plain = operator_container(render("rel", "phalanx-system"))
    assert "envFrom" not in plain and [m["name"] for m in plain["volumeMounts"]] == ["tmp"]


# ------------------------------------------------------------------ metrics over TLS


def test_metrics_tls_options_render_consistently() -> None:
    on = ["metrics.tls.enabled=true", f"metrics.tls.secretName={TLS_SECRET}", "metrics.serviceMonitor.enabled=true"]
    objects = render("rel", "phalanx-system", *on)
    deployment = one(objects, "Deployment")
    container = operator_container(objects)
    env = env_of(container)
    cert, key = env["PHALANX_METRICS_TLS_CERT"], env["PHALANX_METRICS_TLS_KEY"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == os.path.dirname(cert))
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == TLS_SECRET
    files = {item["key"]: item["path"] for item in volume["secret"]["items"]}
    assert files == {"tls.crt": os.path.basename(cert), "tls.key": os.path.basename(key)}
    service = one(objects, "Service")
    assert next(p for p in service["spec"]["ports"] if p["name"] == "metrics")["appProtocol"] == "https"
    server_name = f"{service['metadata']['name']}.phalanx-system.svc"
    (endpoint,) = one(objects, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["port"] == "metrics"
    assert endpoint["tlsConfig"] == {"serverName": server_name, "ca": {"secret": {"name": TLS_SECRET, "key": "ca.crt"}}}
    # `helm test` verifies the same way
    test_pod = one(objects, "Pod")
    test_env = env_of(test_pod["spec"]["containers"][0])
    assert test_env["METRICS_TLS"] == "1" and test_env["SERVER_NAME"] == server_name
    (ca_volume,) = test_pod["spec"]["volumes"]
    assert ca_volume["secret"] == {"secretName": TLS_SECRET, "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    (ca_mount,) = test_pod["spec"]["containers"][0]["volumeMounts"]
    assert test_env["METRICS_CA"] == f"{ca_mount['mountPath']}/ca.crt"

    custom = render(
        "rel", "phalanx-system", *on,
        "metrics.tls.ca.secretName=metrics-ca", "metrics.tls.ca.key=root.pem", "metrics.tls.serverName=metrics.example",
    )  # fmt: skip
    (endpoint,) = one(custom, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["tlsConfig"] == {
        "serverName": "metrics.example",
        "ca": {"secret": {"name": "metrics-ca", "key": "root.pem"}},
    }
    test_pod = one(custom, "Pod")
    assert env_of(test_pod["spec"]["containers"][0])["SERVER_NAME"] == "metrics.example"
    assert test_pod["spec"]["volumes"][0]["secret"]["secretName"] == "metrics-ca"
    assert test_pod["spec"]["volumes"][0]["secret"]["items"] == [{"key": "root.pem", "path": "ca.crt"}]

    insecure = render("rel", "phalanx-system", *on, "metrics.tls.insecureSkipVerify=true")
    (endpoint,) = one(insecure, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == {"insecureSkipVerify": True}
    test_pod = one(insecure, "Pod")
    assert env_of(test_pod["spec"]["containers"][0])["METRICS_INSECURE"] == "1" and "volumes" not in test_pod["spec"]

    off = render("rel", "phalanx-system", "metrics.serviceMonitor.enabled=true")
    (endpoint,) = one(off, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "http" and "tlsConfig" not in endpoint
    assert not {"PHALANX_METRICS_TLS_CERT", "PHALANX_METRICS_TLS_KEY"} & env_of(operator_container(off)).keys()
    assert next(p for p in one(off, "Service")["spec"]["ports"] if p["name"] == "metrics")["appProtocol"] == "http"

    missing = subprocess.run(
        [str(helm()), "template", "rel", str(CHART), "--set", "metrics.tls.enabled=true"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode != 0 and "metrics.tls.secretName is required" in missing.stderr


# ------------------------------------------------------------------ helm test


class _Healthz(http.server.BaseHTTPRequestHandler):
    """Stands in for kopf's liveness endpoint: 200 on /healthz."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def operator_endpoints(certfile: str | None, keyfile: str | None) -> Iterator[tuple[int, int]]:
    """(health port, metrics port) on 127.0.0.1: a health stand-in and the operator's real metrics server."""
    health = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    served = metrics_endpoint.serve(0, certfile, keyfile)
    try:
        yield health.server_port, served.server_port
    finally:
        for server in (health, served):
            server.shutdown()
            server.server_close()


def run_test_pod(pod: dict[str, Any], **env: str) -> subprocess.CompletedProcess[str]:
    """The `helm test` pod's check, run here with its rendered environment and ``env`` on top."""
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python3", "-c"]
    return subprocess.run(
        [sys.executable, "-c", container["args"][0]],
        env={"PATH": os.environ["PATH"], **env_of(container), "SERVICE": "127.0.0.1", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_helm_test_pod_is_restricted_and_checks_health_and_metrics(tmp_path: pathlib.Path) -> None:
    objects = render("rel", "phalanx-system", "metrics.tls.enabled=true", f"metrics.tls.secretName={TLS_SECRET}")
    pod = one(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = spec["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["image"] == operator_container(objects)["image"]  # no other image to pull
    service = one(objects, "Service")
    assert env_of(container)["SERVICE"] == f"{service['metadata']['name']}.phalanx-system.svc"
    ports = {port["name"]: port["port"] for port in service["spec"]["ports"]}
    assert (env_of(container)["HEALTH_PORT"], env_of(container)["METRICS_PORT"]) == (
        str(ports["health"]),
        str(ports["metrics"]),
    )
    # the Service, NetworkPolicy and ServiceMonitor select the operator pod: never the test pod
    assert not service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()

    server_name = env_of(container)["SERVER_NAME"]
    cert, key = self_signed(tmp_path, "metrics", host=server_name)
    other, _ = self_signed(tmp_path, "other", host=server_name)
    with operator_endpoints(str(cert), str(key)) as (health, port):
        ports_env = {"HEALTH_PORT": str(health), "METRICS_PORT": str(port), "WAIT_SECONDS": "3"}
        passed = run_test_pod(pod, **ports_env, METRICS_CA=str(cert))
        assert passed.returncode == 0, passed.stdout + passed.stderr
        assert "ok: plain HTTP to the metrics port is refused" in passed.stdout
        untrusted = run_test_pod(pod, **ports_env, METRICS_CA=str(other))
        assert untrusted.returncode != 0 and "FAILED: metrics endpoint" in untrusted.stderr
        as_plain = run_test_pod(one(render("rel", "phalanx-system"), "Pod"), **ports_env)
        assert as_plain.returncode != 0 and "FAILED: metrics endpoint" in as_plain.stderr
        no_health = run_test_pod(pod, **{**ports_env, "HEALTH_PORT": str(port)}, METRICS_CA=str(cert))
        assert no_health.returncode != 0 and "FAILED: health endpoint" in no_health.stderr
    with operator_endpoints(None, None) as (health, port):
        plain = run_test_pod(
            one(render("rel", "phalanx-system"), "Pod"), HEALTH_PORT=str(health), METRICS_PORT=str(port)
        )
        assert plain.returncode == 0, plain.stdout + plain.stderr


# ------------------------------------------------------------------ NetworkPolicy, against the API server


def readme_yaml(marker: str) -> dict[str, Any]:
    """The YAML block of charts/phalanx/README.md that holds ``marker``."""
    blocks = re.findall(r"```yaml\n(.*?)```", (CHART / "README.md").read_text(), flags=re.DOTALL)
    (block,) = [block for block in blocks if marker in block]
    return yaml.safe_load(block)  # type: ignore[no-any-return]


def dry_run(kubectl: Kubectl, objects: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    return kubectl.run(
        "apply", "--server-side", "--dry-run=server", "--field-manager=phalanx-tests", "-f", "-",
        input=yaml.safe_dump_all(objects), check=False,
    )  # fmt: skip


def test_network_policy_matches_the_pods_and_the_api_server_accepts_the_chart(kubectl: Kubectl, namespace: str) -> None:
    peer = "networkPolicy.ingressFrom[0].namespaceSelector.matchLabels.purpose=monitoring"
    objects = render("phx-np", namespace, *every_option_on(), f"watchNamespaces={{{namespace}}}", peer)
    policy, deployment, test_pod = one(objects, "NetworkPolicy"), one(objects, "Deployment"), one(objects, "Pod")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert not selector.items() <= test_pod["metadata"]["labels"].items()  # its egress is not cut
    (ingress,) = policy["spec"]["ingress"]
    container_ports = {port["name"] for port in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {port["port"] for port in ingress["ports"]} == container_ports == {"metrics", "health"}
    assert {"namespaceSelector": {"matchLabels": {"purpose": "monitoring"}}} in ingress["from"]
    assert any(  # the `helm test` pod, from the release namespace
        "namespaceSelector" not in p
        and p["podSelector"]["matchLabels"].items() <= test_pod["metadata"]["labels"].items()
        for p in ingress["from"]
        if "podSelector" in p
    )
    api, dns, scrape = policy["spec"]["egress"]
    assert {port["port"] for port in api["ports"]} == {443, 6443}
    assert {(port["port"], port["protocol"]) for port in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    (target,) = scrape["to"]
    assert target["podSelector"]["matchExpressions"] == [
        {"key": naming.ROLE_LABEL, "operator": "In", "values": [naming.ROLE_WORKER, naming.ROLE_RENDEZVOUS]}
    ]
    assert target["namespaceSelector"]["matchExpressions"][0]["values"] == [namespace]
    assert {port["port"] for port in scrape["ports"]} == {WORKER_METRICS_PORT, naming.METRICS_PORT_NAME}

    # what the API server says: every object (but the Prometheus Operator's, not installed here),
    # with the namespace enforcing Pod Security "restricted"
    kubectl.label("namespace", namespace, {"pod-security.kubernetes.io/enforce": "restricted"})
    served = [obj for obj in objects if not obj["apiVersion"].startswith("monitoring.coreos.com/")]
    accepted = dry_run(kubectl, served)
    assert accepted.returncode == 0, accepted.stderr
    assert "PodSecurity" not in accepted.stderr, accepted.stderr
    privileged = json.loads(json.dumps(test_pod))  # the control: admission does enforce here
    privileged["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    refused = dry_run(kubectl, [privileged])
    assert refused.returncode != 0 and "PodSecurity" in refused.stderr, refused.stderr

    # the README's ingress rule for job namespaces that deny by default
    rule = readme_yaml("allow-phalanx-operator-scrape")
    default_install = render("phalanx", "phalanx-system")
    operator_labels = one(default_install, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert rule["spec"]["podSelector"] == target["podSelector"]
    (allowed,) = rule["spec"]["ingress"]
    (source,) = allowed["from"]
    assert source["podSelector"]["matchLabels"].items() <= operator_labels.items()
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "phalanx-system"}
    assert allowed["ports"] == [{"port": naming.METRICS_PORT_NAME, "protocol": "TCP"}]
    rule["metadata"]["namespace"] = namespace
    applied = dry_run(kubectl, [rule])
    assert applied.returncode == 0, applied.stderr


def test_readme_metrics_reader_role_allows_the_service_proxy_paths(kubectl: Kubectl, namespace: str) -> None:
    """The README's Role for scraping through the API server's service proxy, as a real user."""
    role = readme_yaml("phalanx-metrics-reader")
    service = one(render("phalanx", "phalanx-system"), "Service")["metadata"]["name"]
    assert {f"https:{service}:metrics", f"{service}:metrics"} == set(role["rules"][0]["resourceNames"])
    role["metadata"]["namespace"] = namespace
    kubectl.apply(role)
    kubectl.run(
        "create", "rolebinding", "carol-metrics", f"--role={role['metadata']['name']}", "--user=carol",
        f"--namespace={namespace}",
    )  # fmt: skip
    carol = Kubectl(kubectl.kubeconfig, kubectl.binary, impersonate="carol")

    def answer(name: str) -> str:
        path = f"/api/v1/namespaces/{namespace}/services/{name}/proxy/metrics"
        return carol.run("get", "--raw", path, check=False).stderr

    # allowed: the request reaches the (missing) Service instead of being forbidden
    kubectl.wait_for(lambda: "NotFound" in answer(f"https:{service}:metrics"), timeout=30, what="the Role in effect")
    assert "NotFound" in answer(f"{service}:metrics")
    assert "Forbidden" in answer("another-service:metrics")
