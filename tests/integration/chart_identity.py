"""Run the operator with the identity the Helm chart gives it: its ServiceAccount and RBAC rules.

The chart is rendered with ``helm template`` (helm built from its Go module like the cluster
binaries), its ServiceAccount and RBAC objects are applied, and the operator gets a kubeconfig
holding a token of that ServiceAccount. A verb missing from the chart then fails the test.
"""

from __future__ import annotations

import pathlib
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import yaml

from tests.cluster import binaries
from tests.cluster.kube import Kubectl

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "phalanx"
IDENTITY_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def helm() -> pathlib.Path:
    return binaries.ensure_binaries(["helm"])["helm"]


def render(release: str, namespace: str, *values: str) -> list[dict[str, Any]]:
    """``helm template`` with ``--set`` values; returns the rendered objects."""
    command = [str(helm()), "template", release, str(CHART), f"--namespace={namespace}"]
    for value in values:
        command += ["--set", value]
    rendered = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def lint(*values: str) -> subprocess.CompletedProcess[str]:
    """``helm lint --strict`` of the chart with ``--set`` values."""
    command = [str(helm()), "lint", "--strict", str(CHART)]
    for value in values:
        command += ["--set", value]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def token_kubeconfig(admin: pathlib.Path, token: str, path: pathlib.Path) -> pathlib.Path:
    config = yaml.safe_load(admin.read_text())
    context = next(c for c in config["contexts"] if c["name"] == config["current-context"])["context"]
    cluster = next(c for c in config["clusters"] if c["name"] == context["cluster"])
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": "phalanx-operator", "user": {"token": token}}],
                "contexts": [{"name": "operator", "context": {"cluster": cluster["name"], "user": "phalanx-operator"}}],
                "current-context": "operator",
            }
        )
    )
    path.chmod(0o600)
    return path


# Granted by every install; the authorizer sees new bindings only after its informers catch up.
PROBES = (
    ("watch", "trainingjobs.phalanx.dev"),
    ("patch", "trainingjobs.phalanx.dev", "--subresource=status"),
    ("create", "pods"),
    ("create", "events"),
)


def _wait_for_rbac(as_operator: Kubectl, namespace: str) -> None:
    def granted() -> bool:
        return all(
            as_operator.run("auth", "can-i", *probe, f"--namespace={namespace}", check=False).stdout.strip() == "yes"
            for probe in PROBES
        )

    def answers() -> str:
        return "; ".join(
            f"{' '.join(probe)}: {proc.stdout.strip()} {proc.stderr.strip()}"
            for probe in PROBES
            for proc in [as_operator.run("auth", "can-i", *probe, f"--namespace={namespace}", check=False)]
        )

    as_operator.wait_for(
        granted, timeout=30, interval=0.2, what=lambda: f"the chart's RBAC rules in effect in {namespace}: {answers()}"
    )


def identity_objects(
    release: str, namespace: str, values: Sequence[str] = (), *, without: str | None = None
) -> list[dict[str, Any]]:
    """The chart's ServiceAccount and RBAC objects for a namespaced install serving ``namespace``
    (with more ``--set`` values); ``without`` a resource (``trainingjobs/finalizers``) its rules
    leave out, as an older chart did."""
    objects = [
        obj
        for obj in render(
            release, namespace, f"watchNamespaces={{{namespace}}}", "rbac.aggregateToDefaultRoles=false", *values
        )
        if obj["kind"] in IDENTITY_KINDS
    ]
    for obj in objects:
        if without and "rules" in obj:
            rules = [{**rule, "resources": [r for r in rule["resources"] if r != without]} for rule in obj["rules"]]
            obj["rules"] = [rule for rule in rules if rule["resources"]]
    return objects


@contextmanager
def chart_identity(
    kubectl: Kubectl,
    admin: pathlib.Path,
    namespace: str,
    release: str,
    directory: pathlib.Path,
    values: Sequence[str] = (),
    *,
    without: str | None = None,
) -> Iterator[pathlib.Path]:
    """Apply the chart's identity for a namespaced install serving ``namespace`` (``values`` and
    ``without``: ``identity_objects``); yield its kubeconfig."""
    objects = identity_objects(release, namespace, values, without=without)
    kubectl.apply(objects, namespace=namespace)
    try:
        account = next(obj for obj in objects if obj["kind"] == "ServiceAccount")["metadata"]["name"]
        token = kubectl.run("create", "token", account, f"--namespace={namespace}", "--duration=2h").stdout.strip()
        identity = token_kubeconfig(admin, token, directory / "operator.kubeconfig")
        _wait_for_rbac(Kubectl(identity, kubectl.binary), namespace)
        yield identity
    finally:
        for obj in objects:
            if obj["kind"].startswith("Cluster"):
                kubectl.delete(obj["kind"].lower(), obj["metadata"]["name"], wait=False)
