"""The CPU example both ways: on the real node through the operator, and on this machine with
`phalanx run-local`'s runner. Each local worker's environment is its pod's, variable for variable,
except the documented local changes (docs/local.md) and what the API server assigns (the job's UID)."""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

import pytest
import yaml

from phalanx import localrun
from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.e2e.test_training import wait_phase
from tests.integration.operator_process import OperatorProcess
from tests.unit.test_localrun import LOCAL_CHANGES

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the API server gives the job its UID; the local run keeps the placeholder `phalanx plan` shows
ASSIGNED_BY_THE_API_SERVER = {"PHALANX_JOB_UID", "PET_RDZV_ID"}
PRINT_ENVIRONMENT = "import json, os; print(json.dumps(dict(os.environ)))"


def running_trainer(kubectl: Kubectl, namespace: str, pod: str) -> dict[str, Any]:
    """The pod as the operator created it, once its trainer container runs."""

    def started() -> dict[str, Any] | None:
        found = kubectl.get("pod", pod, namespace)
        statuses = ((found or {}).get("status") or {}).get("containerStatuses") or []
        return found if any("running" in (s.get("state") or {}) for s in statuses) else None

    found = kubectl.wait_for(started, timeout=240, interval=0.5, what=f"{pod}'s trainer running")
    assert isinstance(found, dict)
    return found


def pod_environment(kubectl: Kubectl, namespace: str, pod: dict[str, Any]) -> dict[str, str]:
    """The trainer container's variables as the kubelet gave them (a process exec'd in the container sees them)."""
    name = pod["metadata"]["name"]
    trainer = pod["metadata"]["annotations"][naming.CONTAINER_ANNOTATION]
    result = kubectl.run(
        "exec", name, f"--namespace={namespace}", "-c", trainer, "--", "python3", "-c", PRINT_ENVIRONMENT
    )
    everything: dict[str, str] = json.loads(result.stdout)
    container = next(c for c in pod["spec"]["containers"] if c["name"] == trainer)
    return {var["name"]: everything[var["name"]] for var in container["env"]}


def test_the_cpu_example_runs_locally_with_its_pods_environment(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = yaml.safe_load((ROOT / "examples" / "cpu-gloo.yaml").read_text())
    kubectl.create(body, namespace=namespace)
    pods = [running_trainer(kubectl, namespace, f"cpu-gloo-worker-{index}") for index in range(2)]
    on_the_node = [pod_environment(kubectl, namespace, pod) for pod in pods]
    wait_phase(kubectl, namespace, "cpu-gloo", "Succeeded", timeout=300)

    # torchrun from this interpreter's environment; phalanx.worker from the source tree
    monkeypatch.setenv("PATH", f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "operator"))
    lines: list[str] = []
    local_body = {**body, "metadata": {**body["metadata"], "namespace": namespace}}
    run = localrun.start(local_body, on_line=lambda index, line: lines.append(f"[worker-{index}] {line}"), workdir=ROOT)
    assert run.wait(timeout=300) == 0, "\n".join(lines)
    for rank in (0, 1):
        assert f"phalanx-demo: done rank={rank} world_size=2 steps=200" in "\n".join(lines)

    for cluster, local, worker in zip(on_the_node, run.environments, run.plan.workers, strict=True):
        print(f"worker {worker.index} on the node: {cluster}")
        assert set(cluster) <= set(local), set(cluster) - set(local)
        differing = {name for name, value in cluster.items() if local[name] != value}
        assert differing == LOCAL_CHANGES | ASSIGNED_BY_THE_API_SERVER, {n: (cluster[n], local[n]) for n in differing}
        assert set(worker.changed) == LOCAL_CHANGES  # every difference but the UID's is one it reports
        assert local["POD_IP"] == "127.0.0.1" and cluster["PET_LOCAL_ADDR"] == cluster["POD_IP"]
