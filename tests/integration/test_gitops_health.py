"""What GitOps tools report for a TrainingJob in each phase, judged by their own code.

Real jobs are driven through every phase on the real control plane and captured from the API
server as they are; ``gitops-checks`` (tests/cluster/go/gitops-checks, built from cli-utils and
gopher-lua) judges each capture with kstatus (Flux ``wait``/``healthChecks``, kpt) and with our
Argo CD ``health.lua`` set up as argocd-cm customizations are. The Argo CD resource actions
(suspend, resume) are run the same way and their result applied to the live job.

``PHALANX_CAPTURE_DIR=DIR`` writes each capture there (the committed Argo CD test data under
deploy/argocd/ was captured so).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from phalanx.reconcile import naming
from tests.cluster import binaries
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import (
    JOB,
    POOL_LABEL,
    TRAINER,
    WAITING_REASON_LABEL,
    conditions,
    create,
    wait_running,
    wait_status,
    workers,
)

pytestmark = [pytest.mark.integration, pytest.mark.late_binaries("gitops-checks")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUSTOMIZATION = ROOT / "deploy" / "argocd" / "resource_customizations" / "phalanx.dev" / "TrainingJob"
POOL = "gitops"
# A resource only this module's nodes offer, so what the cluster can hold is known exactly.
GPU = "example.com/gitops-gpu"
GPUS_PER_NODE = 8
JOB_SPEC: dict[str, Any] = {
    "workers": {"min": 2, "max": 5, "desired": 2},
    "gpus": {"count": 4, "resource": GPU},
    "failurePolicy": {"maxRestarts": 3, "backoffSeconds": 60, "maxBackoffSeconds": 60},
}


class Judge:
    """Captures a live TrainingJob and asks kstatus and Argo CD about it."""

    def __init__(self, program: pathlib.Path, kubectl: Kubectl, scratch: pathlib.Path) -> None:
        self.program = program
        self.kubectl = kubectl
        self.scratch = scratch
        self.keep = pathlib.Path(os.environ["PHALANX_CAPTURE_DIR"]) if os.environ.get("PHALANX_CAPTURE_DIR") else None

    def capture(self, namespace: str, label: str, name: str = JOB) -> pathlib.Path:
        body = self.kubectl.get("tj", name, namespace)
        assert body is not None, f"tj/{name} is gone"
        body["metadata"].pop("managedFields", None)
        text = yaml.safe_dump(body, sort_keys=False)
        path = self.scratch / f"{label}.yaml"
        path.write_text(text)
        if self.keep is not None:
            self.keep.mkdir(parents=True, exist_ok=True)
            (self.keep / f"{label}.yaml").write_text(text)
        return path

    def run(self, *args: str | pathlib.Path) -> Any:
        proc = subprocess.run([str(self.program), *map(str, args)], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"gitops-checks {args}: {proc.stderr}"
        return json.loads(proc.stdout)

    def verdicts(self, namespace: str, label: str, name: str = JOB) -> tuple[dict[str, str], dict[str, str]]:
        """(kstatus, Argo CD health) of the job as it is now."""
        path = self.capture(namespace, label, name)
        return self.run("kstatus", path), self.run("argocd-health", CUSTOMIZATION / "health.lua", path)

    def expect(self, namespace: str, label: str, kstatus: str, argocd: str, name: str = JOB) -> dict[str, str]:
        flux, argo = self.verdicts(namespace, label, name)
        assert (flux["status"], argo["status"]) == (kstatus, argocd), (label, flux, argo)
        return argo


@pytest.fixture(scope="module")
def judge(kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Judge:
    program = binaries.ensure_binaries(["gitops-checks"])["gitops-checks"]
    return Judge(program, kubectl, tmp_path_factory.mktemp("captures"))


@pytest.fixture(scope="module")
def gitops_nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    """Two KWOK nodes offering 8 of our resource each: room for 4 workers of 4 in all."""
    nodes = kubectl.list("nodes", selector=f"{POOL_LABEL}={POOL}")
    names = [n["metadata"]["name"] for n in nodes]
    if len(names) < 2:
        names += kwok_cluster.add_gpu_nodes(
            2 - len(names), gpus_per_node=GPUS_PER_NODE, resource=GPU, labels={POOL_LABEL: POOL}, name_prefix="gitops-"
        )
    kwok_cluster.wait_nodes_ready(names)
    return names


@pytest.fixture
def running_operator(operator: OperatorProcess, gitops_nodes: list[str]) -> Iterator[OperatorProcess]:
    yield operator
    assert operator.process is not None and operator.process.poll() is None, "the operator died"


def _blocker(kubectl: Kubectl, namespace: str, node: str, name: str) -> None:
    """A pod holding all of one node's resource, as another team's job would."""
    kubectl.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "nodeName": node,
                "tolerations": [{"operator": "Exists"}],
                "containers": [
                    {
                        "name": "hold",
                        "image": "example/hold:1",
                        "resources": {"requests": {GPU: str(GPUS_PER_NODE)}, "limits": {GPU: str(GPUS_PER_NODE)}},
                    }
                ],
            },
        },
        namespace=namespace,
    )


def _scale(kubectl: Kubectl, namespace: str, desired: int) -> None:
    kubectl.run("scale", "tj", JOB, f"--namespace={namespace}", f"--replicas={desired}")


def test_before_the_operator_writes_status_a_job_is_not_yet_observed(
    crds: list[str], kubectl: Kubectl, namespace: str, judge: Judge
) -> None:
    create(kubectl, namespace, **JOB_SPEC)
    body = kubectl.get("tj", JOB, namespace)
    assert body is not None, body
    # the schema's defaults: observedGeneration 0 (and the counters), no phase, no conditions
    assert body["status"]["observedGeneration"] == 0 and "phase" not in body["status"], body["status"]
    flux, argo = judge.verdicts(namespace, "new")
    assert flux["status"] == "InProgress", flux
    assert argo == {"status": "Progressing", "message": "Waiting for the phalanx operator to observe generation 1"}


def test_pending_starting_running_and_rescaling_progress_and_an_impossible_size_says_so(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess, gitops_nodes: list[str], judge: Judge
) -> None:
    # Starting: scheduled, containers still being created
    template = {"metadata": {"labels": {WAITING_REASON_LABEL: "ContainerCreating"}}, "spec": {"containers": [TRAINER]}}
    create(kubectl, namespace, **JOB_SPEC, template=template, name="starting")
    wait_status(kubectl, namespace, lambda s: s.get("phase") == "Starting", "Starting", name="starting")
    judge.expect(namespace, "starting", "InProgress", "Progressing", name="starting")
    kubectl.delete("tj", "starting", namespace)
    # pods still creating containers are not ended by KWOK's stages: remove them as a kubelet would
    selector = naming.worker_selector("starting")
    kubectl.run("delete", "pods", f"--namespace={namespace}", f"--selector={selector}", "--force", "--grace-period=0")
    kubectl.wait_for(lambda: not workers(kubectl, namespace, "starting"), timeout=30, what="starting's workers gone")

    # Pending: other pods hold both nodes, which could hold the job once they go
    _blocker(kubectl, namespace, gitops_nodes[0], "blocker")
    _blocker(kubectl, namespace, gitops_nodes[1], "blocker-2")
    create(kubectl, namespace, **JOB_SPEC)
    wait_status(kubectl, namespace, lambda s: s.get("reason") == "Unschedulable", "Pending (Unschedulable)")
    judge.expect(namespace, "pending", "InProgress", "Progressing")
    kubectl.delete("pod", "blocker-2", namespace)
    wait_running(kubectl, namespace, 2)
    judge.expect(namespace, "running", "Current", "Healthy")

    # Rescaling towards 3: the nodes could hold it once the other pod goes
    _scale(kubectl, namespace, 3)
    state = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Rescaling", "Rescaling")
    assert conditions(state)["Stalled"][0] == "False", state
    judge.expect(namespace, "rescaling", "InProgress", "Progressing")

    # 5 workers of 4 can never fit on 2 nodes of 8: not in progress forever, but stalled with why
    _scale(kubectl, namespace, 5)
    state = wait_status(kubectl, namespace, lambda s: s.get("reason") == "InsufficientCapacity", "InsufficientCapacity")
    assert "can hold at most 4 worker(s)" in state["message"], state["message"]
    argo = judge.expect(namespace, "rescaling-beyond-capacity", "Failed", "Degraded")
    assert "can hold at most 4 worker(s)" in argo["message"], argo

    # back within what the nodes hold, and the other pod gone: Running again
    _scale(kubectl, namespace, 4)
    kubectl.delete("pod", "blocker", namespace)
    wait_running(kubectl, namespace, 4, timeout=60)
    judge.expect(namespace, "running-4", "Current", "Healthy")


def test_a_worker_larger_than_every_node_is_stalled_not_pending_forever(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess, judge: Judge
) -> None:
    create(kubectl, namespace, **{**JOB_SPEC, "gpus": {"count": 2 * GPUS_PER_NODE, "resource": GPU}})
    state = wait_status(kubectl, namespace, lambda s: s.get("reason") == "InsufficientCapacity", "InsufficientCapacity")
    assert state["phase"] == "Pending" and "no schedulable node can hold a worker" in state["message"], state
    flux, argo = judge.verdicts(namespace, "pending-beyond-capacity")
    assert (flux["status"], argo["status"]) == ("Failed", "Degraded"), (flux, argo)
    assert "no schedulable node can hold a worker" in flux["message"], flux


def test_restarting_succeeded_and_failed(
    kubectl: Kubectl, kwok_cluster: LocalCluster, namespace: str, running_operator: OperatorProcess, judge: Judge
) -> None:
    create(kubectl, namespace, **JOB_SPEC)
    wait_running(kubectl, namespace, 2)
    pods = sorted(workers(kubectl, namespace))
    kwok_cluster.finish_pod(namespace, pods[0], 1, message="ValueError: bad batch")
    wait_status(kubectl, namespace, lambda s: s.get("reason") == "Backoff", "Restarting (Backoff)")
    judge.expect(namespace, "restarting", "InProgress", "Progressing")

    kubectl.delete("tj", JOB, namespace)
    kubectl.wait_for(lambda: kubectl.get("tj", JOB, namespace) is None, timeout=30, what="tj gone")
    create(kubectl, namespace, **JOB_SPEC)
    wait_running(kubectl, namespace, 2)
    for pod in sorted(workers(kubectl, namespace)):
        kwok_cluster.finish_pod(namespace, pod, 0)
    wait_status(kubectl, namespace, lambda s: s.get("phase") == "Succeeded", "Succeeded")
    judge.expect(namespace, "succeeded", "Current", "Healthy")

    create(kubectl, namespace, **{**JOB_SPEC, "failurePolicy": {"maxRestarts": 0}}, name="failing")
    wait_running(kubectl, namespace, 2, name="failing")
    victim = sorted(workers(kubectl, namespace, "failing"))[0]
    kwok_cluster.finish_pod(namespace, victim, 1, message="RuntimeError: NCCL error")
    wait_status(kubectl, namespace, lambda s: s.get("phase") == "Failed", "Failed", name="failing")
    argo = judge.expect(namespace, "failed", "Failed", "Degraded", name="failing")
    assert argo["message"].startswith("RestartBudgetExhausted"), argo


def test_invalid_spec_is_failed_and_degraded(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess, judge: Judge
) -> None:
    create(kubectl, namespace, **JOB_SPEC, checkpoint={"volumeName": "nope"})
    wait_status(kubectl, namespace, lambda s: s.get("phase") == "Failed", "Failed")
    argo = judge.expect(namespace, "invalid-spec", "Failed", "Degraded")
    assert argo["message"].startswith("InvalidSpec: spec.checkpoint.volumeName"), argo


def test_argocd_suspend_and_resume_actions_suspend_and_resume_the_live_job(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess, judge: Judge
) -> None:
    actions = CUSTOMIZATION / "actions"
    create(kubectl, namespace, **JOB_SPEC)
    wait_running(kubectl, namespace, 2)
    running = judge.capture(namespace, "action-running")
    assert judge.run("argocd-action", actions / "discovery.lua", running) == {
        "suspend": {"disabled": False, "iconClass": "fa fa-fw fa-pause-circle"},
        "resume": {"disabled": True, "iconClass": "fa fa-fw fa-play-circle"},
    }
    _apply_action(kubectl, namespace, judge.run("argocd-action", actions / "suspend" / "action.lua", running))
    wait_status(kubectl, namespace, lambda s: s.get("phase") == "Suspended", "Suspended")
    kubectl.wait_for(lambda: not workers(kubectl, namespace), timeout=30, what="workers stopped")
    argo = judge.expect(namespace, "suspended", "Current", "Suspended")
    assert argo["message"] == "Suspended: spec.suspend is true", argo

    suspended = judge.capture(namespace, "action-suspended")
    assert judge.run("argocd-action", actions / "discovery.lua", suspended)["resume"]["disabled"] is False
    _apply_action(kubectl, namespace, judge.run("argocd-action", actions / "resume" / "action.lua", suspended))
    state = wait_running(kubectl, namespace, 2)
    assert (state["attempt"], state["restarts"]) == (1, 0), state


def _apply_action(kubectl: Kubectl, namespace: str, result: dict[str, Any]) -> None:
    """What Argo CD does with an action's result: patch the live object with the change."""
    kubectl.run(
        "patch", "tj", JOB, f"--namespace={namespace}", "--type=merge", "-p", json.dumps({"spec": result["spec"]})
    )


def test_the_committed_argocd_tests_pass(judge: Judge) -> None:
    """health_test.yaml and action_test.yaml, as Argo CD's own test runs them, on data captured
    from this cluster."""
    cases = yaml.safe_load((CUSTOMIZATION / "health_test.yaml").read_text())["tests"]
    assert len(cases) >= 9
    for case in cases:
        got = judge.run("argocd-health", CUSTOMIZATION / "health.lua", CUSTOMIZATION / case["inputPath"])
        assert got == case["healthStatus"], case["inputPath"]
    actions = CUSTOMIZATION / "actions"
    spec = yaml.safe_load((actions / "action_test.yaml").read_text())
    for case in spec["discoveryTests"]:
        got = judge.run("argocd-action", actions / "discovery.lua", actions / case["inputPath"])
        assert sorted(({"name": name, **value} for name, value in got.items()), key=lambda a: a["name"]) == sorted(
            case["result"], key=lambda a: a["name"]
        ), case["inputPath"]
    for case in spec["actionTests"]:
        got = judge.run("argocd-action", actions / case["action"] / "action.lua", actions / case["inputPath"])
        assert got == yaml.safe_load((actions / case["expectedOutputPath"]).read_text()), case
