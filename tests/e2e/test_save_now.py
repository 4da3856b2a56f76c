"""Save now on the real node: annotating a running CPU job with ``phalanx.dev/save-now`` makes
its workers save a checkpoint at a later step, answered in ``status.saveNow`` with the token, while
the same pods train on (no restart, no new attempt).

The demo saves only on request here (``--checkpoint-every`` far beyond the run), so the checkpoint
that answers the token is the save-now one, and its worker logs the step it saved."""

from __future__ import annotations

import re
from typing import Any

import pytest

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.e2e.test_training import STEP, elastic_job, logs, status, wait_for_step, worker_names
from tests.integration.operator_process import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

SAVED = re.compile(r"phalanx: saved step (\d+) at a save-now request")
WORKERS = ["savenow-worker-0", "savenow-worker-1", "savenow-worker-2"]


def job(namespace: str) -> dict[str, Any]:
    body = elastic_job("savenow", namespace, 100000)
    args: list[str] = body["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--log-every") + 1] = "1"
    args[args.index("--checkpoint-every") + 1] = "1000000"  # only the saves asked for
    return body


def uids(kubectl: Kubectl, namespace: str) -> dict[str, str]:
    pods = kubectl.list("pods", namespace, f"{naming.JOB_NAME_LABEL}=savenow,{naming.ROLE_LABEL}=worker")
    return {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in pods}


def save_now(kubectl: Kubectl, namespace: str, token: str) -> dict[str, Any]:
    """Annotate the job with ``token`` and wait until status says a checkpoint answered it."""
    annotation = f"{naming.SAVE_NOW_ANNOTATION}={token}"
    kubectl.run("annotate", "tj", "savenow", annotation, "--overwrite", f"--namespace={namespace}")
    answered = kubectl.wait_for(
        lambda: (s := status(kubectl, namespace, "savenow")).get("saveNow", {}).get("savedToken") == token and s,
        timeout=240,  # the kubelet rewrites a downward-API file within its sync period (a minute)
        interval=1.0,
        what=lambda: f"status.saveNow answering {token}, last {status(kubectl, namespace, 'savenow').get('saveNow')}",
    )
    assert isinstance(answered, dict)
    return answered


def last_step(kubectl: Kubectl, namespace: str, pod: str) -> int:
    return max(int(step) for step, _, _ in STEP.findall(logs(kubectl, namespace, pod)))


def test_a_save_now_annotation_saves_a_later_step_without_restarting_the_workers(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(job(namespace), namespace=namespace)
    wait_for_step(kubectl, namespace, WORKERS, world=3, step=20)
    pods = uids(kubectl, namespace)
    assert sorted(pods) == WORKERS and worker_names(kubectl, namespace, "savenow") == WORKERS
    before = last_step(kubectl, namespace, "savenow-worker-0")

    first = save_now(kubectl, namespace, "t-1")
    request = first["saveNow"]
    assert request["token"] == "t-1" and request["step"] > before, first
    assert first["lastCheckpoint"]["step"] >= request["step"], first
    # rank 0 logs the save, on whichever pod the rendezvous made it
    text = "".join(logs(kubectl, namespace, pod) for pod in WORKERS)
    assert request["step"] in [int(step) for step in SAVED.findall(text)], text[-3000:]

    # the same pods trained on past the save: no restart, no new attempt, nothing counted
    wait_for_step(kubectl, namespace, WORKERS, world=3, step=request["step"] + 10)
    assert uids(kubectl, namespace) == pods
    assert (first["attempt"], first["restarts"]) == (0, 0), first
    assert "resumed_from=None" in text and text.count("starting at step=") == len(WORKERS), text[-3000:]

    second = save_now(kubectl, namespace, "t-2")  # a new token: a new save, later still
    assert second["saveNow"]["step"] > request["step"], second
    assert uids(kubectl, namespace) == pods and second["restarts"] == 0, second
    for pod in pods:  # the operator carried the token onto every worker
        annotations = (kubectl.get("pod", pod, namespace) or {})["metadata"]["annotations"]
        assert annotations[naming.SAVE_NOW_ANNOTATION] == "t-2", annotations
