"""Fixtures for the end-to-end tier: the control plane plus one real kubelet node running real
containers (containerd, runc, CNI, CoreDNS) with the locally built trainer image.

- ``real_cluster`` (package): the cluster with the real node (untainted: every pod lands there),
  shared by the tier's modules (starting one costs about two minutes, the image import included);
  test_helm_install.py starts its own (Helm must own the CRD there).
- ``kubectl``, ``namespace`` (per test), ``operator`` (per test, under the chart's RBAC).
All processes are stopped by PID when the session ends, also on failure.
"""

from __future__ import annotations

import os
import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from phalanx.api import crd
from tests.cluster.kube import Kubectl
from tests.cluster.stop_on_exit import stopped_on_exit
from tests.integration.chart_identity import chart_identity
from tests.integration.operator_process import OperatorProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def start_real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A control plane with the real node; stopped (by PID) when the generator is closed."""
    if os.geteuid() != 0:
        pytest.fail("the end-to-end tier runs a kubelet and needs root")
    from tests.cluster.node.realnode import RealNode, cluster_with_real_node

    cluster = cluster_with_real_node(tmp_path_factory.mktemp("e2e-cluster"), node=RealNode(taint=False))
    with stopped_on_exit(cluster.stop):
        cluster.start()
        yield cluster


# One real node per host: a package-scoped cluster is stopped when the tier's last test ends, before
# tests/integration starts its own; the helm module's (module scope) ends before the next module.
@pytest.fixture(scope="package")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from start_real_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def kubectl(real_cluster: Any) -> Kubectl:
    client = Kubectl(real_cluster.kubeconfig)
    client.apply(yaml.safe_load((ROOT / "crds" / crd.CRD_FILE).read_text()))
    client.wait_established(crd.CRD_NAME)
    return client


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    from tests.cluster.node.realnode import node_pressure

    node = kubectl.get("node", "real-node")
    why = node_pressure(node) if node is not None else None
    if why is not None:  # its pods would never start: every test would wait out its timeouts
        pytest.fail(f"the real node cannot take pods: {why}")
    with kubectl.temporary_namespace("e2e") as name:
        yield name


@pytest.fixture
def operator(kubectl: Kubectl, real_cluster: Any, namespace: str, tmp_path: pathlib.Path) -> Iterator[OperatorProcess]:
    with chart_identity(
        kubectl, pathlib.Path(real_cluster.kubeconfig), namespace, f"phx-{uuid.uuid4().hex[:6]}", tmp_path
    ) as identity:
        # scrape workers' progress often, so status.workers.worldSize follows the world quickly
        process = OperatorProcess(
            identity,
            tmp_path / "operator.log",
            namespace=namespace,
            extra_env={"PHALANX_PROGRESS_INTERVAL_SECONDS": "1"},
        )
        with process:
            yield process
        print(f"--- operator log (tail) ---\n{process.log_tail(80)}")
