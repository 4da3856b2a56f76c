"""Fixtures for the integration tier: a real control plane with KWOK fake GPU nodes.

- ``cluster`` (session): a LocalCluster started once per session, or the cluster named by
  $KUBECONFIG when that one answers: a LocalCluster started with ``localcluster up`` is reused with
  its KWOK helpers (and left running); any other cluster (the kind path) gets KWOK started on this
  host against it (an AttachedCluster, tests/cluster/attached.py).
  Whatever this session started is always stopped: fixture finalizer, atexit, SIGTERM/SIGHUP.
- ``kubectl`` (session): a small kubectl wrapper (tests/cluster/kube.py) with admin credentials.
- ``kubeconfig`` (session): path of the admin kubeconfig.
- ``kube_env`` (function): sets $KUBECONFIG for the test (for kopf / the operator in-process).
- ``api_config`` (session): server URL, CA, client cert/key paths for an aiohttp/ssl client.
- ``api_credentials`` (session): the same, as the operator's client takes them.
- ``namespace`` (function): a fresh namespace with its default ServiceAccount; deleted afterwards.
- ``kwok_cluster`` (session): ``cluster``, skipping the test when KWOK is not available.
- ``control_plane`` (session): ``kwok_cluster`` when this harness runs its control plane (API
  server restarts, etcd compaction); skips on an attached cluster.
- ``crds`` (session): the TrainingJob CRD (from crds/) and the coscheduling PodGroup CRD, installed
  once: one gang scheduler, as on most clusters (the operator watches both PodGroup APIs).
- ``volcano_api`` (function): Volcano's PodGroup CRD (the stand-in) for one test, removed after it.
- ``operator`` (function): ``phalanx run`` as a subprocess watching the test's namespace.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from phalanx.cluster.login import Credentials
from tests.cluster.attached import AttachedCluster
from tests.cluster.crds import VOLCANO_STAND_IN, cluster_crds
from tests.cluster.kube import Kubectl, find_kubectl
from tests.cluster.localcluster import STATE_FILE, LocalCluster
from tests.cluster.stop_on_exit import stopped_on_exit
from tests.integration.chart_identity import chart_identity
from tests.integration.operator_process import OperatorProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _external_kubeconfig() -> pathlib.Path | None:
    env = os.environ.get("KUBECONFIG")
    if not env:
        return None
    path = pathlib.Path(env.split(os.pathsep)[0])
    if not path.is_file():
        return None
    try:
        proc = subprocess.run(
            [str(find_kubectl()), f"--kubeconfig={path}", "--request-timeout=5s", "get", "--raw", "/readyz"],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if proc.returncode == 0 else None


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    external = _external_kubeconfig()
    if external is not None:
        if (external.parent / STATE_FILE).exists() and external.name == "admin.kubeconfig":
            # a LocalCluster started by `python -m tests.cluster.localcluster up`: reuse it with its
            # KWOK helpers, and leave it running
            yield LocalCluster.from_state_dir(external.parent)
            return
        attached = AttachedCluster(external)
        with stopped_on_exit(attached.stop):
            attached.start()
            yield attached
        return

    c = LocalCluster(kwok=True)
    with stopped_on_exit(c.stop):
        c.start()  # stops what it started itself if start-up fails
        yield c


@pytest.fixture(scope="session")
def kwok_cluster(cluster: LocalCluster) -> LocalCluster:
    if not cluster.kwok_enabled:
        pytest.skip("needs KWOK (this local cluster was started with --no-kwok)")
    return cluster


@pytest.fixture(scope="session")
def control_plane(kwok_cluster: LocalCluster) -> LocalCluster:
    if not kwok_cluster.runs_control_plane:
        pytest.skip(f"restarts the API server or compacts etcd: {kwok_cluster.server} is not this harness's")
    return kwok_cluster


@pytest.fixture(scope="session")
def kubeconfig(cluster: LocalCluster) -> pathlib.Path:
    return pathlib.Path(cluster.kubeconfig)


@pytest.fixture(scope="session")
def kubectl(kubeconfig: pathlib.Path) -> Kubectl:
    return Kubectl(kubeconfig)


@pytest.fixture
def kube_env(kubeconfig: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return kubeconfig


@pytest.fixture(scope="session")
def api_config(cluster: LocalCluster) -> dict[str, Any]:
    """Connection settings for a hand-made client (aiohttp + ssl); local cluster only."""
    if not cluster.runs_control_plane:
        pytest.skip("api_config is only available for the local cluster; use kubeconfig")
    return {
        "server": cluster.server,
        "ca_cert": str(cluster.ca_cert),
        "client_cert": str(cluster.admin_cert),
        "client_key": str(cluster.admin_key),
        "kubeconfig": str(cluster.kubeconfig),
        "ssl_context": cluster.ssl_context(),
    }


@pytest.fixture(scope="session")
def api_credentials(api_config: dict[str, Any]) -> Credentials:
    """The admin identity for the operator's own ApiClient (local cluster only)."""
    return Credentials(
        server=api_config["server"],
        ca_data=pathlib.Path(api_config["ca_cert"]).read_bytes(),
        certificate_data=pathlib.Path(api_config["client_cert"]).read_bytes(),
        private_key_data=pathlib.Path(api_config["client_key"]).read_bytes(),
    )


def _namespace_name(node_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", node_name.lower()).strip("-")[:40].strip("-") or "test"
    return f"t-{base}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def namespace(kubectl: Kubectl, request: pytest.FixtureRequest) -> Iterator[str]:
    name = _namespace_name(request.node.name)
    kubectl.create(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": {"phalanx.dev/test": "true"}},
        }
    )
    try:
        kubectl.wait_for(
            lambda: kubectl.get("serviceaccount", "default", name),
            timeout=30,
            what=f"serviceaccount {name}/default",
        )
        yield name
    finally:
        with contextlib.suppress(Exception):
            kubectl.delete("namespace", name, wait=False)


@pytest.fixture(scope="session")
def crds(kubectl: Kubectl) -> list[str]:
    """Install (server-side apply) our CRD and the coscheduling PodGroup API once per session."""
    names = []
    for path in cluster_crds():
        body = yaml.safe_load(path.read_text())
        kubectl.apply(body)
        names.append(body["metadata"]["name"])
    for name in names:
        kubectl.wait_established(name)
    return names


@pytest.fixture
def volcano_api(kubectl: Kubectl, crds: list[str]) -> Iterator[dict[str, Any]]:
    """Volcano's PodGroup API for one test; removed afterwards (with every Volcano PodGroup), so
    the other tests keep running with one gang scheduler's API."""
    definition: dict[str, Any] = yaml.safe_load(VOLCANO_STAND_IN.read_text())
    name = definition["metadata"]["name"]
    kubectl.apply(definition)
    kubectl.wait_established(name)
    try:
        yield definition
    finally:
        kubectl.delete("crd", name)
        kubectl.wait_for(lambda: kubectl.get("crd", name) is None, timeout=60, what=f"crd/{name} removed")


@pytest.fixture
def operator(
    crds: list[str], kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, tmp_path: pathlib.Path
) -> Iterator[OperatorProcess]:
    """The operator as a subprocess serving the test's namespace, under the Helm chart's
    ServiceAccount and RBAC (a verb missing from the chart fails the test); its log on failure."""
    release = f"phx-{uuid.uuid4().hex[:6]}"
    # as a cluster-wide install: other namespaces' pods are read for the room they leave on nodes
    values = ("podRequestsFromAllNamespaces=true",)
    with chart_identity(kubectl, kubeconfig, namespace, release, tmp_path, values) as identity:
        process = OperatorProcess(identity, tmp_path / "operator.log", namespace=namespace)
        with process:
            yield process
        print(f"--- operator log (tail) ---\n{process.log_tail(80)}")
