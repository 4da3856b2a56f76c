"""Cluster policy and the end of training, on the real node with real containers.

- a namespace enforcing Pod Security "restricted": a job whose template complies trains there
  (the rendezvous store pod phalanx adds must comply too);
- a worker whose command does not exist: the runtime's StartError fails the job at once, with its
  message, and nothing is counted against the budget;
- a rank that dies in teardown after training completed, while its peer's agent waits in its exit
  barrier and its own agent re-forms a world that can never form: the job still ends Succeeded
  promptly, from the completion the rank recorded in the rendezvous store.
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import yaml

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.e2e.test_training import logs, status, wait_phase
from tests.integration.operator_process import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def cpu_example(name: str, steps: int) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "cpu-gloo.yaml").read_text())
    body["metadata"] = {"name": name}
    trainer = body["spec"]["template"]["spec"]["containers"][0]
    trainer["args"] = ["-m", "phalanx.worker.demo", "--steps", str(steps), "--step-seconds", "0.02"]
    return body


def test_a_restricted_namespace_runs_a_job_whose_template_complies(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.label(
        "namespace",
        namespace,
        {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"},
    )
    body = cpu_example("restricted", 60)
    spec = body["spec"]["template"]["spec"]
    spec["securityContext"] = copy.deepcopy(RESTRICTED_POD)
    spec["containers"][0]["securityContext"] = copy.deepcopy(RESTRICTED_CONTAINER)
    kubectl.create(body, namespace=namespace)
    final = wait_phase(kubectl, namespace, "restricted", "Succeeded", timeout=300)
    assert (final["restarts"], final.get("restartsByReason") or {}) == (0, {}), final
    text = logs(kubectl, namespace, "restricted-worker-0")
    assert "done rank=" in text and "world_size=2" in text, text
    store = kubectl.get("pod", naming.rendezvous_name("restricted"), namespace)
    assert store is None or store["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_a_worker_whose_command_does_not_exist_fails_the_job_at_once(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    body = cpu_example("no-deepspeed", 20)
    trainer = body["spec"]["template"]["spec"]["containers"][0]
    trainer["command"] = ["deepspeed"]  # a launcher the trainer image does not have
    trainer["args"] = ["phalanx/worker/demo.py"]
    kubectl.create(body, namespace=namespace)
    final = wait_phase(kubectl, namespace, "no-deepspeed", "Failed", timeout=120)
    assert final["reason"] == "InvalidPodConfiguration", final
    assert "StartError" in final["message"] and "executable file not found" in final["message"], final["message"]
    assert (final["restarts"], final.get("restartsByReason") or {}, final["attempt"]) == (0, {}, 0), final


def test_a_command_written_python_runs_in_the_trainer_image(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    """`python`, not only `python3`, as in every common PyTorch image: torchrun started as
    `python -m torch.distributed.run`."""
    body = cpu_example("python-command", 20)
    trainer = body["spec"]["template"]["spec"]["containers"][0]
    trainer["command"] = ["python", "-m", "torch.distributed.run"]
    kubectl.create(body, namespace=namespace)
    final = wait_phase(kubectl, namespace, "python-command", "Succeeded", timeout=180)
    assert (final["restarts"], final.get("restartsByReason") or {}) == (0, {}), final
    assert "done rank=" in logs(kubectl, namespace, "python-command-worker-0")


TEARDOWN_DEATH = """\
import os
from phalanx.worker.session import TrainingSession

with TrainingSession() as session:
    rank = session.rank
    for step in session.steps(40, {}):
        pass
print(f"trained rank={rank}", flush=True)
if rank == 0:
    os.abort()  # dies in teardown, after training completed
"""


def test_a_rank_dying_in_teardown_after_training_completed_still_ends_the_job_succeeded(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "script"}, "data": {"train.py": TEARDOWN_DEATH}},
        namespace=namespace,
    )
    body = cpu_example("teardown", 40)
    # torchrun restarts a failed worker group: rank 0's agent re-forms a world that cannot form
    # (its peer's agent waits in its 300 s exit barrier), as when the CPU example once hung.
    body["spec"]["failurePolicy"] = {"workerRestarts": 3}
    spec = body["spec"]["template"]["spec"]
    spec["volumes"] = [{"name": "script", "configMap": {"name": "script"}}]
    trainer = spec["containers"][0]
    trainer["args"] = ["/scripts/train.py"]
    trainer["volumeMounts"] = [{"name": "script", "mountPath": "/scripts"}]
    kubectl.create(body, namespace=namespace)
    final = wait_phase(kubectl, namespace, "teardown", "Succeeded", timeout=200)
    assert "recorded completion" in final["message"] and "rendezvous store" in final["message"], final
    assert (final["restarts"], final.get("restartsByReason") or {}) == (0, {}), final
    assert status(kubectl, namespace, "teardown")["phase"] == "Succeeded"
