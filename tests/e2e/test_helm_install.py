"""The Helm chart on the real node: install with the locally built operator image (the
Dockerfile's ``operator`` target, see tests/cluster/node/dockerfile_images.py), run ``helm test``,
run the CPU example, scrape /metrics of the operator (through its metrics Service) and of a worker
pod, upgrade the release, uninstall it, and check that the CRD and the TrainingJob survive
(resource-policy keep).

The release namespace enforces Pod Security "restricted", so the operator pod passing admission
is part of the test. The module starts its own cluster (its ``real_cluster`` is module-scoped,
unlike the tier's shared one) and does not use the ``kubectl`` fixture: that one applies the CRD
outside Helm, and ``helm install`` would then refuse to adopt it.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from phalanx.api import crd
from phalanx.reconcile import naming
from tests.cluster import binaries
from tests.cluster.kube import Kubectl
from tests.cluster.node import dockerfile_images
from tests.e2e.conftest import start_real_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "phalanx"
RELEASE = "phalanx"  # contains the chart's name, so the full name is "phalanx"
RELEASE_NS = "phalanx-system"
DEPLOYMENT = RELEASE
METRICS_SERVICE = f"{RELEASE}-metrics"
OPERATOR_REPOSITORY, OPERATOR_TAG = dockerfile_images.REFS["operator"].rsplit(":", 1)
IMAGE_VALUES = [
    f"image.repository={OPERATOR_REPOSITORY}",
    f"image.tag={OPERATOR_TAG}",
    "image.pullPolicy=Never",
]
WORKER_METRICS_PORT = 9400
OPERATOR_METRICS_PORT = 8000
LEASE = RELEASE  # the chart names the Lease after the release's full name

Metrics = dict[str, list[tuple[dict[str, str], float]]]


def metric(e2e: str, value: float) -> None:
    print(f"E2E-METRIC {e2e} {value:.1f}s")


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """This module's own cluster: Helm must install the CRD, which the shared one already has."""
    yield from start_real_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def kube(real_cluster: Any) -> Kubectl:
    """A client for the module's cluster, with the operator image (built from the Dockerfile
    once per change of its inputs) imported into the real node."""
    from tests.cluster.node.realnode import RealNode

    if os.geteuid() != 0:
        pytest.fail("the end-to-end tier runs dockerd and a kubelet and needs root")
    node = next(c for c in real_cluster.extra_components if isinstance(c, RealNode))
    assert node.containerd is not None
    build, took = dockerfile_images.import_into(node.containerd, "operator")
    if build is not None:
        state = "cached" if build.cached else f"built {build.timings}"
        print(f"operator image {build.key}: {state}, sizes {build.sizes}")
        if not build.cached:
            metric("operator image build", build.timings.get("total", 0.0))
    if took is not None:
        metric("operator image import into containerd", took)
    return Kubectl(real_cluster.kubeconfig)


@pytest.fixture(scope="module")
def helm(kube: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    binary = binaries.ensure_binaries(["helm"])["helm"]
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    def run(*args: str, timeout: float = 240) -> str:
        import subprocess

        proc = subprocess.run(
            [str(binary), f"--kubeconfig={kube.kubeconfig}", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc.stdout

    return run


@pytest.fixture
def operator_logs(kube: Kubectl, request: pytest.FixtureRequest) -> Iterator[None]:
    """Prints the operator pod's log when the test fails."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:  # the call's report is logged before teardown
        proc = kube.run("logs", f"deployment/{DEPLOYMENT}", f"--namespace={RELEASE_NS}", "--tail=80", check=False)
        print(f"--- operator log (tail) ---\n{proc.stdout}{proc.stderr}")


@pytest.fixture
def job_namespace(kube: Kubectl) -> Iterator[str]:
    with kube.temporary_namespace("e2e-helm") as name:
        yield name


# ------------------------------------------------------------------------------------ helpers


def parse(text: str) -> Metrics:
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def value(metrics: Metrics, sample: str, /, **labels: str) -> float | None:
    """Sum of the samples ``sample`` whose labels include ``labels``; None when there are none."""
    found = [v for sample_labels, v in metrics.get(sample, []) if labels.items() <= sample_labels.items()]
    return sum(found) if found else None


def leader(kube: Kubectl) -> str | None:
    """The operator pod holding the Lease (its identity is its pod name)."""
    lease = kube.get("lease", LEASE, RELEASE_NS)
    return (lease or {}).get("spec", {}).get("holderIdentity") or None


def scrape_operator(kube: Kubectl) -> Metrics:
    """The leader's metrics (a standby's per-job series are empty: it reconciles nothing)."""
    name = leader(kube)
    assert name, "no operator holds the lease"
    path = f"/api/v1/namespaces/{RELEASE_NS}/pods/{name}:{OPERATOR_METRICS_PORT}/proxy/metrics"
    return parse(kube.run("get", "--raw", path, timeout=15).stdout)


def scrape_pod(kube: Kubectl, namespace: str, pod: str) -> Metrics:
    path = f"/api/v1/namespaces/{namespace}/pods/{pod}:{WORKER_METRICS_PORT}/proxy/metrics"
    return parse(kube.run("get", "--raw", path, timeout=15).stdout)


def try_scrape(scrape: Callable[[], Metrics]) -> Metrics | None:
    try:
        return scrape()
    except Exception:  # not serving (yet, or any more)
        return None


def operator_pods(kube: Kubectl) -> list[dict[str, Any]]:
    return kube.list("pods", RELEASE_NS, f"app.kubernetes.io/name=phalanx,app.kubernetes.io/instance={RELEASE}")


def ready_operator_pods(kube: Kubectl, count: int = 2, not_uids: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The operator pods once exactly ``count`` exist and all are Ready (none of them ``not_uids``);
    [] until then."""
    pods = [p for p in operator_pods(kube) if not p["metadata"].get("deletionTimestamp")]

    def ready(pod: dict[str, Any]) -> bool:
        conditions = (pod.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    fresh = [p for p in pods if ready(p) and p["metadata"]["uid"] not in not_uids]
    return fresh if len(fresh) == count == len(pods) else []


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def logs(kube: Kubectl, namespace: str, pod: str) -> str:
    return kube.run("logs", pod, f"--namespace={namespace}", check=False).stdout


def tj_status(kube: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    return ((kube.get("tj", name, namespace) or {}).get("status")) or {}


def job_body(name: str, desired: int = 2, steps: int = 200) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "cpu-gloo.yaml").read_text())
    body["metadata"]["name"] = name
    body["spec"]["workers"].update(min=min(desired, body["spec"]["workers"]["min"]), desired=desired)
    args = body["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--steps") + 1] = str(steps)
    return body


# ------------------------------------------------------------------------------------ the test


@pytest.mark.usefixtures("operator_logs")
def test_chart_install_metrics_upgrade_uninstall(kube: Kubectl, helm: Callable[..., str], job_namespace: str) -> None:
    ns = job_namespace
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": RELEASE_NS,
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/enforce-version": "latest",
                },
            },
        }
    )

    # --- install: the operator runs as a pod on the real node, from the local image
    t0 = time.monotonic()
    sets = [arg for value in IMAGE_VALUES for arg in ("--set", value)]
    helm("install", RELEASE, str(CHART), f"--namespace={RELEASE_NS}", *sets, "--wait", "--timeout=180s")
    pods = kube.wait_for(lambda: ready_operator_pods(kube), timeout=120, interval=0.5, what="both operators Ready")
    metric("helm install to both operator replicas Ready", time.monotonic() - t0)
    kube.wait_for(lambda: leader(kube), timeout=60, interval=0.5, what="a leader")
    assert {pod["spec"]["nodeName"] for pod in pods} == {"real-node"}
    pod = next(p for p in pods if p["metadata"]["name"] == leader(kube))
    container = pod["spec"]["containers"][0]
    assert container["image"] == dockerfile_images.REFS["operator"] and container["imagePullPolicy"] == "Never"
    assert env_of(container)["PHALANX_RECONCILE_WORKERS"] == "8"
    assert kube.get("crd", crd.CRD_NAME) is not None
    kube.wait_established(crd.CRD_NAME)
    baseline = kube.wait_for(lambda: scrape_operator(kube), timeout=60, interval=0.5, what="operator /metrics")
    metric("helm install to operator /metrics answering", time.monotonic() - t0)
    reconciles_before = value(baseline, "controller_runtime_reconcile_total") or 0.0

    # --- helm test: the chart's check pod (the operator image, admitted as "restricted") reaches the
    # health and metrics endpoints through the Service; a passed one's pod is deleted
    t_test = time.monotonic()
    tested = helm("test", RELEASE, f"--namespace={RELEASE_NS}", "--timeout=120s")
    metric("helm test", time.monotonic() - t_test)
    assert re.search(r"Phase:\s+Succeeded", tested), tested
    kube.wait_for(
        lambda: kube.get("pod", f"{RELEASE}-test", RELEASE_NS) is None, timeout=60, what="the helm test pod deleted"
    )

    # --- the CPU example succeeds; both /metrics endpoints move while it runs
    t_job = time.monotonic()
    kube.create(job_body("cpu-gloo"), namespace=ns)
    worker = "cpu-gloo-worker-0"
    samples: list[tuple[float, float]] = []  # (phalanx_worker_steps_total, phalanx_worker_world_size)
    phases_seen: set[str] = set()

    def progressed() -> dict[str, Any] | None:
        status = tj_status(kube, ns, "cpu-gloo")
        operator = try_scrape(lambda: scrape_operator(kube))
        for phase in ("Starting", "Running", "Succeeded"):
            if operator and value(operator, "phalanx_job_phase", namespace=ns, name="cpu-gloo", phase=phase) == 1:
                phases_seen.add(phase)
        if status.get("phase") in ("Running", "Rescaling"):
            scraped = try_scrape(lambda: scrape_pod(kube, ns, worker))
            if scraped and (steps := value(scraped, "phalanx_worker_steps_total")) is not None:
                sample = (steps, value(scraped, "phalanx_worker_world_size") or 0.0)
                if not samples or sample != samples[-1]:
                    samples.append(sample)
        return status if status.get("phase") in ("Succeeded", "Failed") else None

    final = kube.wait_for(progressed, timeout=300, interval=1.0, what="cpu-gloo to finish")
    assert final is not None
    metric("cpu-gloo created to Succeeded", time.monotonic() - t_job)
    assert final["phase"] == "Succeeded", final
    print(f"worker-0 (steps, world size) seen: {samples}; operator phases seen: {sorted(phases_seen)}")
    if any(later[0] < earlier[0] for earlier, later in itertools.pairwise(samples)):  # the world was re-formed
        joined = [line for line in logs(kube, ns, worker).splitlines() if "joined" in line or "attempt" in line]
        print(f"worker-0 restarted its training (status restarts {final.get('restarts')}): {joined}")
    # the counter went up within one world of both workers
    assert any(
        later[0] > earlier[0] and earlier[1] == later[1] == 2 for earlier, later in itertools.pairwise(samples)
    ), samples
    assert "Running" in phases_seen, phases_seen

    def operator_shows_success() -> Metrics | None:
        now = scrape_operator(kube)
        done = value(now, "phalanx_job_phase", namespace=ns, name="cpu-gloo", phase="Succeeded") == 1
        return now if done else None

    after = kube.wait_for(operator_shows_success, timeout=60, interval=0.5, what="phalanx_job_phase Succeeded")
    assert after is not None
    assert value(after, "phalanx_job_phase", namespace=ns, name="cpu-gloo", phase="Running") == 0
    assert (value(after, "controller_runtime_reconcile_total", controller="trainingjob") or 0) > reconciles_before
    assert value(after, "phalanx_jobs", phase="Succeeded") == 1
    startup = value(after, "phalanx_job_startup_duration_seconds_count", namespace=ns)
    assert startup == 1, startup

    # --- the leader's pod is deleted at once (--force): another replica (the standby, or the pod
    # replacing the deleted one, whichever tries first) takes the Lease and reconciles
    deleted = leader(kube)
    assert deleted is not None
    t_kill = time.monotonic()
    kube.run("delete", "pod", deleted, f"--namespace={RELEASE_NS}", "--grace-period=0", "--force", check=False)
    successor = kube.wait_for(
        lambda: (name := leader(kube)) not in (None, deleted) and name, timeout=90, interval=0.2, what="a new leader"
    )
    metric("leader pod force-deleted to another replica holding the Lease", time.monotonic() - t_kill)
    kube.wait_for(operator_shows_success, timeout=60, interval=0.5, what="the new leader reconciled cpu-gloo")
    metric("leader pod force-deleted to the new leader's metrics showing cpu-gloo", time.monotonic() - t_kill)
    pods = kube.wait_for(lambda: ready_operator_pods(kube), timeout=120, interval=0.5, what="two replicas again")
    assert successor in {p["metadata"]["name"] for p in pods} and leader(kube) == successor

    # --- upgrade: a changed value rolls the Deployment; the new operators reconcile the jobs
    old_uids = frozenset(p["metadata"]["uid"] for p in pods)
    t_up = time.monotonic()
    helm(
        "upgrade", RELEASE, str(CHART), f"--namespace={RELEASE_NS}", "--reuse-values",
        "--set", "operator.reconcileWorkers=3", "--wait", "--timeout=180s",
    )  # fmt: skip
    kube.run(
        "rollout", "status", f"deployment/{DEPLOYMENT}", f"--namespace={RELEASE_NS}", "--timeout=120s", timeout=130
    )
    deployment = kube.get("deployment", DEPLOYMENT, RELEASE_NS)
    assert deployment is not None
    assert env_of(deployment["spec"]["template"]["spec"]["containers"][0])["PHALANX_RECONCILE_WORKERS"] == "3"
    assert deployment["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "2"
    new_pods = kube.wait_for(
        lambda: ready_operator_pods(kube, not_uids=old_uids),
        timeout=120,
        interval=0.5,
        what="both upgraded operator pods Ready",
    )
    metric("helm upgrade to both new operators Ready", time.monotonic() - t_up)
    assert all(env_of(p["spec"]["containers"][0])["PHALANX_RECONCILE_WORKERS"] == "3" for p in new_pods)
    kube.wait_for(lambda: leader(kube) in {p["metadata"]["name"] for p in new_pods}, timeout=60, what="a new pod leads")
    assert "2" in helm("history", RELEASE, f"--namespace={RELEASE_NS}", "--output=yaml")
    # a fresh process: its metrics only know cpu-gloo because it reconciled it after starting
    kube.wait_for(operator_shows_success, timeout=60, interval=0.5, what="the new operator reconciled cpu-gloo")
    t_second = time.monotonic()
    kube.create(job_body("after-upgrade", desired=1, steps=30), namespace=ns)
    second = kube.wait_for(
        lambda: (s := tj_status(kube, ns, "after-upgrade")).get("phase") in ("Succeeded", "Failed") and s,
        timeout=180,
        interval=0.5,
        what="after-upgrade to finish",
    )
    assert isinstance(second, dict)
    metric("after-upgrade job created to Succeeded", time.monotonic() - t_second)
    assert second["phase"] == "Succeeded", second

    # --- uninstall: the operator goes, the CRD and the TrainingJobs stay
    helm("uninstall", RELEASE, f"--namespace={RELEASE_NS}", "--wait", "--timeout=120s")
    kube.wait_for(
        lambda: not kube.list("pods", RELEASE_NS), timeout=120, interval=0.5, what="the operator pods to go away"
    )
    assert kube.get("deployment", DEPLOYMENT, RELEASE_NS) is None
    assert kube.get("service", METRICS_SERVICE, RELEASE_NS) is None
    assert kube.get("clusterrole", RELEASE) is None
    assert kube.get("serviceaccount", RELEASE, RELEASE_NS) is None
    kept = kube.get("crd", crd.CRD_NAME)
    assert kept is not None and kept["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert tj_status(kube, ns, "cpu-gloo")["phase"] == "Succeeded"
    assert tj_status(kube, ns, "after-upgrade")["phase"] == "Succeeded"
    assert kube.list("pods", ns, f"{naming.JOB_NAME_LABEL}=cpu-gloo")  # nothing deleted the workers
    assert RELEASE not in helm("list", f"--namespace={RELEASE_NS}", "--short")
