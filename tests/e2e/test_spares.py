"""Warm spares on the real node: a spare pod's supervisor waits with torch imported; when a worker is
deleted, the operator relabels the spare into the lost slot and moves the survivors to a new
attempt (a new rendezvous id: torchrun need not wait out the lost agent's keep-alives), the
supervisors start torchrun, the world re-forms at full size with the spare, and a new spare is
created behind it."""

from __future__ import annotations

import re
from typing import Any

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.e2e.test_training import elastic_job, logs, status, wait_for_step, wait_phase
from tests.integration.operator_process import OperatorProcess

WORKERS = ["spares-worker-0", "spares-worker-1", "spares-worker-2"]
SPARE = "spares-spare-0"


def job_with_a_spare(namespace: str, steps: int) -> dict[str, Any]:
    job = elastic_job("spares", namespace, steps)
    job["spec"]["workers"]["spares"] = 1
    [trainer] = job["spec"]["template"]["spec"]["containers"]
    trainer["command"] = ["phalanx-supervise", "--", "torchrun"]
    return job


def pods(kubectl: Kubectl, namespace: str) -> dict[str, dict[str, Any]]:
    return {pod["metadata"]["name"]: pod for pod in kubectl.list("pods", namespace, f"{naming.JOB_NAME_LABEL}=spares")}


def test_a_deleted_worker_is_replaced_by_the_warm_spare_and_a_new_spare_follows(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(job_with_a_spare(namespace, 300), namespace=namespace)
    wait_for_step(kubectl, namespace, WORKERS, world=3, step=30)
    kubectl.wait_for(
        lambda: "waiting to be promoted" in logs(kubectl, namespace, SPARE), timeout=120, what="the spare waiting"
    )
    spare = pods(kubectl, namespace)[SPARE]
    assert spare["metadata"]["labels"][naming.ROLE_LABEL] == naming.ROLE_SPARE
    kubectl.wait_for(
        lambda: (status(kubectl, namespace, "spares").get("workers") or {}).get("spares") == 1,
        timeout=60,
        what="status.workers.spares 1",
    )
    assert status(kubectl, namespace, "spares")["workerSummary"] == "3/3 +1 spare"

    kubectl.run("delete", "pod", WORKERS[1], f"--namespace={namespace}", "--wait=false")
    kubectl.wait_for(
        lambda: re.search(r"joined rank=\d world_size=3 attempt=1", logs(kubectl, namespace, SPARE)) is not None,
        timeout=120,
        what="the promoted spare training in a world of 3",
    )
    promoted = pods(kubectl, namespace)[SPARE]
    assert promoted["metadata"]["uid"] == spare["metadata"]["uid"]  # the same pod, relabelled
    labels = promoted["metadata"]["labels"]
    assert labels[naming.ROLE_LABEL] == naming.ROLE_WORKER and labels[naming.WORKER_INDEX_LABEL] == "1"
    text = logs(kubectl, namespace, SPARE)
    assert "phalanx-supervise: promoted into slot 1 as attempt 1" in text, text
    survivor = logs(kubectl, namespace, WORKERS[0])
    assert "phalanx-supervise: attempt 1: restarting in place" in survivor, survivor
    kubectl.wait_for(
        lambda: "resumed_from=" in logs(kubectl, namespace, SPARE), timeout=60, what="the spare's first step"
    )
    text = logs(kubectl, namespace, SPARE)
    resumed = [int(step) for step in re.findall(r"resumed_from=(\d+)", text)]
    assert resumed and resumed[-1] >= 30, text  # it joined from the agreed checkpoint
    kubectl.wait_for(lambda: "spares-spare-1" in pods(kubectl, namespace), timeout=60, what="a new spare")

    final = wait_phase(kubectl, namespace, "spares", "Succeeded", timeout=300)
    assert final["attempt"] == 1 and final["restarts"] == 0  # deleted from outside: not counted
    assert final["restartsByReason"] == {"WorkersDeleted": 1}
    assert "SparePromoted" in {event["reason"] for event in kubectl.list("events", namespace)}
    left = pods(kubectl, namespace)
    assert WORKERS[1] not in left  # its slot is the spare's: no new pod of that name

    def spares_stopping() -> bool:
        spares = [
            pod
            for pod in pods(kubectl, namespace).values()
            if pod["metadata"]["labels"][naming.ROLE_LABEL] == naming.ROLE_SPARE
        ]
        return all(pod["metadata"].get("deletionTimestamp") for pod in spares)

    kubectl.wait_for(spares_stopping, timeout=30, what="the spares stopped once the job succeeded")
