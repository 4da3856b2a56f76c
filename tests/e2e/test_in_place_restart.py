"""Gang restarts in place on the real node: with phalanx-supervise in the trainer's command, a gang
restart keeps every healthy worker pod (the same UID), moves it to the new attempt, and its
supervisor restarts torchrun with the new rendezvous id; only lost pods are replaced."""

from __future__ import annotations

import re
from typing import Any

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.e2e.test_training import elastic_job, logs, status, wait_for_step, wait_phase, worker_names
from tests.integration.operator_process import OperatorProcess

WORKERS = ["inplace-worker-0", "inplace-worker-1", "inplace-worker-2"]


def supervised_job(namespace: str, steps: int) -> dict[str, Any]:
    job = elastic_job("inplace", namespace, steps)
    [trainer] = job["spec"]["template"]["spec"]["containers"]
    trainer["command"] = ["phalanx-supervise", "--", "torchrun"]
    return job


def pods_by_name(kubectl: Kubectl, namespace: str) -> dict[str, dict[str, Any]]:
    pods = kubectl.list("pods", namespace, f"{naming.JOB_NAME_LABEL}=inplace,{naming.ROLE_LABEL}=worker")
    return {pod["metadata"]["name"]: pod for pod in pods}


def uids(kubectl: Kubectl, namespace: str) -> dict[str, str]:
    return {name: pod["metadata"]["uid"] for name, pod in pods_by_name(kubectl, namespace).items()}


def training(kubectl: Kubectl, namespace: str) -> dict[str, str]:
    """The job created and its three workers at step 30 of one world: their UIDs."""
    kubectl.create(supervised_job(namespace, 300), namespace=namespace)
    wait_for_step(kubectl, namespace, WORKERS, world=3, step=30)
    return uids(kubectl, namespace)


def test_a_lost_store_restarts_every_worker_in_place_from_the_agreed_checkpoint(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    before = training(kubectl, namespace)
    assert status(kubectl, namespace, "inplace")["restartMode"] == "InPlace"
    kubectl.run("delete", "pod", "inplace-rdzv", f"--namespace={namespace}", "--wait=false")
    final = wait_phase(kubectl, namespace, "inplace", "Succeeded", timeout=300)
    assert final["attempt"] == 1 and final["restarts"] == 0
    assert final["restartsByReason"] == {"RendezvousStoreLost": 1}
    assert uids(kubectl, namespace) == before  # the same three pods trained on
    for name, pod in pods_by_name(kubectl, namespace).items():
        assert pod["metadata"]["labels"][naming.ATTEMPT_LABEL] == "1", name
        text = logs(kubectl, namespace, name)
        assert "phalanx-supervise: attempt 1: restarting in place" in text, text
        assert re.search(r"joined rank=\d world_size=3 attempt=1", text), text
    text = logs(kubectl, namespace, "inplace-worker-0")
    resumed = [int(step) for step in re.findall(r"resumed_from=(\d+)", text)]
    assert resumed and resumed[-1] >= 30, text  # from a checkpoint, not from zero
    assert final["recomputedSteps"]["total"] <= 10, final  # at most the checkpoint interval


def test_too_few_survivors_keep_the_survivor_and_replace_only_the_lost_pods(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    before = training(kubectl, namespace)
    kubectl.run("delete", "pod", WORKERS[1], WORKERS[2], f"--namespace={namespace}", "--wait=false")
    final = wait_phase(kubectl, namespace, "inplace", "Succeeded", timeout=300)
    # one gang restart; or two when the operator saw the first deletion alone (the world of two
    # re-formed in place at once, then lost the other pod): each is recorded, neither counted
    attempt = final["attempt"]
    assert attempt in (1, 2) and final["restartsByReason"] == {"WorkersDeleted": attempt}, final
    assert final["restarts"] == 0
    now = uids(kubectl, namespace)
    assert now[WORKERS[0]] == before[WORKERS[0]]  # the survivor was kept
    assert now[WORKERS[1]] != before[WORKERS[1]] and now[WORKERS[2]] != before[WORKERS[2]]
    assert sorted(now) == worker_names(kubectl, namespace, "inplace")
    survivor = logs(kubectl, namespace, WORKERS[0])
    assert f"phalanx-supervise: attempt {attempt}: restarting in place" in survivor, survivor
    assert re.search(rf"joined rank=\d world_size=3 attempt={attempt}", survivor), survivor
