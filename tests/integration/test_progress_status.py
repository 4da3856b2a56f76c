"""status.progress on the real control plane (KWOK nodes): a fake rendezvous store, a real HTTP
server at the store pod's own loopback address and metrics port, serves rank 0's report as the
store script does, changing every second; the operator writes it into the job's status at most
once per 10 s, with percent and ETA, and ``kubectl get tj`` shows the PROGRESS column."""

from __future__ import annotations

import copy
import itertools
import pathlib
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from phalanx.reconcile import naming
from phalanx.reconcile.environment import WORKER_METRICS_PORT
from phalanx.reconcile.status import parse_time
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.chart_identity import chart_identity
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import GPU_JOB, JOB, TRAINER, status, wait_running, wait_status
from tests.unit.jobs import manifest
from tests.unit.text_page import TextPage

pytestmark = pytest.mark.integration

POOL_LABEL = "phalanx.dev/test-pool"
POOL = "progress-loopback"
TAINT = {"key": "phalanx.dev/progress-loopback", "value": "true", "effect": "NoSchedule"}
POD_CIDR = "127.79.0.1/24"  # each pod reachable on this host at its own address
TOTAL_STEPS = 10_000
STEPS_PER_SECOND = 10
WATCH_SECONDS = 40


@pytest.fixture(scope="module")
def loopback_nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    names = [n["metadata"]["name"] for n in kubectl.list("nodes", selector=f"{POOL_LABEL}={POOL}")]
    if len(names) < 1:
        names += kwok_cluster.add_gpu_nodes(
            1, labels={POOL_LABEL: POOL}, name_prefix=f"{POOL}-", taints=[TAINT], pod_cidr=POD_CIDR
        )
    kwok_cluster.wait_nodes_ready(names)
    return names


@pytest.fixture
def operator(
    crds: list[str], kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, tmp_path: pathlib.Path
) -> Iterator[OperatorProcess]:
    """The operator under the chart's identity, scraping every second."""
    with chart_identity(kubectl, kubeconfig, namespace, f"phx-{uuid.uuid4().hex[:6]}", tmp_path) as identity:
        env = {"PHALANX_PROGRESS_INTERVAL_SECONDS": "1"}
        process = OperatorProcess(identity, tmp_path / "operator.log", namespace=namespace, extra_env=env)
        with process:
            yield process
            process.check_alive()
        print(f"--- operator log (tail) ---\n{process.log_tail(80)}")
    assert "Traceback" not in process.log(), "the operator logged a traceback"


class FakeStore:
    """The store pod's metrics page for one job: rank 0 at ``STEPS_PER_SECOND`` steps a second since
    it started, a report a second (the step and the loss change every second)."""

    def __init__(self, host: str, job_uid: str) -> None:
        self.started = time.time()
        self.job_uid = job_uid
        self.endpoint = TextPage(self.page, host=host, port=WORKER_METRICS_PORT)

    def page(self) -> str:
        seconds = int(time.time() - self.started)
        step, at = seconds * STEPS_PER_SECOND, self.started + seconds
        job = f'job="{self.job_uid}"'
        loss = f'{job},name="loss"'
        return "\n".join(
            [
                f"phalanx_training_progress_attempt{{{job}}} 0",
                f"phalanx_training_progress_step{{{job}}} {step}",
                f"phalanx_training_progress_total_steps{{{job}}} {TOTAL_STEPS}",
                f"phalanx_training_progress_timestamp_seconds{{{job}}} {at}",
                f"phalanx_training_progress_metric{{{loss}}} {1.0 / (1 + step)}",
                f"phalanx_training_progress_metric_step{{{loss}}} {step}",
                f"phalanx_training_progress_metric_timestamp_seconds{{{loss}}} {at}",
                "",
            ]
        )

    def close(self) -> None:
        self.endpoint.close()


def loopback_job(kubectl: Kubectl, namespace: str) -> dict[str, Any]:
    body = manifest(
        **{
            **copy.deepcopy(GPU_JOB),
            "workers": {"min": 1, "max": 1, "desired": 1},
            "template": {
                "spec": {
                    "nodeSelector": {POOL_LABEL: POOL},
                    "tolerations": [{"key": TAINT["key"], "operator": "Exists"}],
                    "containers": [copy.deepcopy(TRAINER)],
                }
            },
        }
    )
    body["metadata"] = {"name": JOB}
    kubectl.create(body, namespace=namespace)
    job = kubectl.get("tj", JOB, namespace)
    assert job is not None
    return job


def test_progress_is_written_at_most_every_ten_seconds_with_percent_eta_and_a_column(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, loopback_nodes: list[str]
) -> None:
    job = loopback_job(kubectl, namespace)
    wait_running(kubectl, namespace, 1, timeout=60)
    store = kubectl.get("pod", naming.rendezvous_name(JOB), namespace)
    assert store is not None and store["status"].get("podIP", "").startswith("127.79.")
    fake = FakeStore(store["status"]["podIP"], job["metadata"]["uid"])
    watch = subprocess.Popen(
        [str(kubectl.binary), f"--kubeconfig={kubectl.kubeconfig}", "-n", namespace, "get", "tj", JOB, "--watch",
         "-o", "jsonpath={.metadata.resourceVersion} {.status.progress.step}{\"\\n\"}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    arrivals: list[tuple[float, str]] = []

    def read() -> None:
        assert watch.stdout is not None
        for line in watch.stdout:
            arrivals.append((time.monotonic(), line.strip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        first = wait_status(kubectl, namespace, lambda s: "progress" in s, "the first progress report", timeout=30)
        began = time.monotonic()
        time.sleep(WATCH_SECONDS)
        ended = time.monotonic()
        final = status(kubectl, namespace)
    finally:
        watch.terminate()
        watch.wait(10)
        fake.close()
    progress = final["progress"]
    assert progress["totalSteps"] == TOTAL_STEPS and progress["step"] > first["progress"]["step"]
    assert progress["percent"] == progress["step"] * 100 // TOTAL_STEPS
    assert [m["name"] for m in progress["metrics"]] == ["loss"]
    # a steady 10 steps a second: the ETA is the steps left at that rate (the window spans > 10 s)
    expected = (TOTAL_STEPS - progress["step"]) / STEPS_PER_SECOND
    assert abs(progress["etaSeconds"] - expected) <= 0.2 * expected + 5, progress
    # every progress write adds a sample: they are 10 s apart or more, on the operator's clock
    times = [parse_time(sample["time"]) for sample in progress["samples"]]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times) if a and b]
    assert gaps and min(gaps) >= 10, gaps
    # and no more status writes than that came over 40 s of reports changing every second
    during = [line for at, line in arrivals if began <= at <= ended]
    assert 3 <= len(during) <= WATCH_SECONDS // 10 + 1, (during, arrivals)
    table = kubectl.run("get", "tj", JOB, "-n", namespace).stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    assert header[:5] == ["NAME", "PHASE", "WORKERS", "PROGRESS", "RESTARTS"], table
    assert row[3].endswith("%"), table  # the summary: "25% 6m30s left"
    assert "left" in table[1], table
