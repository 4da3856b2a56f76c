"""Checkpoint-aware preemption with the real Kueue (v0.17, its PriorityBoost gate on; KWOK nodes):
``status.preemptionCost`` sets each Workload's ``kueue.x-k8s.io/priority-boost``, so of two jobs of
one priority the one that just saved is preempted, though Kueue alone would take the other (it
preempts the most recently admitted first)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial

import pytest

from phalanx.reconcile import naming
from phalanx.reconcile.observed import BOOST_ANNOTATION
from tests.cluster.gang import KUEUE_NAMESPACE_LABEL, kueue_queue
from tests.cluster.kube import Kubectl
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import wait_status
from tests.integration.test_gang import GANG_GPU, NodePool, gang_job, job_workers, kueue, pool, priorities

pytestmark = [pytest.mark.integration, pytest.mark.gang, pytest.mark.late_binaries("kueue")]

__all__ = ["kueue", "pool", "priorities"]  # fixtures this module uses from test_gang

GPUS = 4
"""Per job of one worker: 4 GPU-seconds a second, past the first boost level (60) within 15 s."""


@pytest.fixture
def twelve_gpus(kubectl: Kubectl, namespace: str, kueue: object) -> Iterator[str]:
    """A LocalQueue on a ClusterQueue of 12 GPUs: two 4-GPU jobs fit, and an 8-GPU job then needs
    one of them preempted."""
    kubectl.label("namespace", namespace, {KUEUE_NAMESPACE_LABEL: "true"})
    suffix = namespace[-6:]
    flavor, cluster_queue = f"boost-{suffix}", f"boost-{suffix}"
    for obj in kueue_queue(namespace, "team", cluster_queue, flavor, {"cpu": "1000", "memory": "10Ti", GANG_GPU: "12"}):
        kubectl.apply(obj)
    try:
        yield "team"
    finally:
        kubectl.delete("localqueue.kueue.x-k8s.io", "team", namespace=namespace, wait=False)
        kubectl.delete("clusterqueue.kueue.x-k8s.io", cluster_queue, wait=False)
        kubectl.delete("resourceflavor.kueue.x-k8s.io", flavor, wait=False)


def boost_of(kubectl: Kubectl, namespace: str, job: str) -> str | None:
    workload = kubectl.get("workloads.kueue.x-k8s.io", naming.kueue_group_name(job, 0), namespace)
    return ((workload or {}).get("metadata", {}).get("annotations") or {}).get(BOOST_ANNOTATION)


class Saver:
    """Writes ``status.lastCheckpoint`` of a job every second, as the operator does when a worker
    reports a committed checkpoint (a KWOK pod runs no trainer): the job keeps having just saved."""

    def __init__(self, kubectl: Kubectl, namespace: str, job: str) -> None:
        self.kubectl, self.namespace, self.job = kubectl, namespace, job
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.step = 0

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.step += 100
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            patch = {"status": {"lastCheckpoint": {"step": self.step, "time": stamp}}}
            self.kubectl.run(
                "patch", "trainingjobs.phalanx.dev", self.job, f"--namespace={self.namespace}",
                "--subresource=status", "--type=merge", f"--patch={json.dumps(patch)}", check=False,
            )  # fmt: skip

    def __enter__(self) -> Saver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def test_of_two_equal_jobs_kueue_preempts_the_one_that_just_saved(
    kubectl: Kubectl,
    namespace: str,
    pool: NodePool,
    twelve_gpus: str,
    priorities: tuple[str, str],
    operator: OperatorProcess,
) -> None:
    low, high = priorities
    pool.add(3, gpus=4)
    job = partial(gang_job, kubectl, namespace, pool=pool, workers=1, gpus=GPUS, scheduler="kueue", queue=twelve_gpus,
                  priority_class=low)  # fmt: skip
    # "saved" is admitted first: without boosts Kueue preempts the most recently admitted ("unsaved");
    # it saves every second from its start, so its cost never reaches the first boost level
    with Saver(kubectl, namespace, "saved"):
        job("saved")
        wait_status(kubectl, namespace, lambda s: s.get("phase") == "Running", "saved Running", 60, name="saved")
        job("unsaved")
        state = wait_status(
            kubectl,
            namespace,
            lambda s: (s.get("preemptionCost") or {}).get("boost") == 1,
            "unsaved Running, its cost past the first boost level",
            90,
            name="unsaved",
        )
        print(f"unsaved: preemptionCost {state['preemptionCost']}")
        kubectl.wait_for(lambda: boost_of(kubectl, namespace, "unsaved") == "1", timeout=30, what="unsaved boosted")
        saved = wait_status(kubectl, namespace, lambda s: "preemptionCost" in s, "saved has a cost", 30, name="saved")[
            "preemptionCost"
        ]
        print(f"saved: preemptionCost {saved}")
        assert saved["workerSeconds"] < 60 and boost_of(kubectl, namespace, "saved") in (None, "0"), saved

        started = time.monotonic()
        gang_job(kubectl, namespace, "urgent", pool, workers=2, gpus=GPUS, scheduler="kueue", queue=twelve_gpus,
                 priority_class=high)  # fmt: skip
        wait_status(kubectl, namespace, lambda s: s.get("phase") == "Running", "urgent Running", 90, name="urgent")
        print(f"urgent Running {time.monotonic() - started:.1f}s after it was created")
        state = wait_status(
            kubectl,
            namespace,
            lambda s: s.get("attempt") == 1 and s.get("reason") == "Queued",
            "saved preempted and queued again",
            60,
            name="saved",
        )
        assert state["restarts"] == 0, state  # a preemption costs no budget
    unsaved = kubectl.get("tj", "unsaved", namespace)
    assert unsaved is not None
    assert unsaved["status"]["phase"] == "Running" and unsaved["status"]["attempt"] == 0, unsaved["status"]
    assert len(job_workers(kubectl, namespace, "unsaved")) == 1
    print("preempted: saved (just checkpointed, boost 0); kept: unsaved (boost 1)")
