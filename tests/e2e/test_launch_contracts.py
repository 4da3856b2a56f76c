"""On the real node: Kubeflow's static launch contract (a PyTorchJob whose plain `python` script
reads only MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK, converted by `phalanx convert` and run
unchanged; and a non-elastic torchrun), and hang detection (a gang whose workers stop stepping is
restarted from its checkpoint, reason NoProgress)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import yaml

from tests.cluster.kube import Kubectl
from tests.e2e.test_training import logs, status, wait_phase
from tests.integration.operator_process import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

# Only the variables Kubeflow's PyTorchJob sets: no phalanx import, no torchrun.
SENDRECV = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://")  # MASTER_ADDR and MASTER_PORT
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
    if rank == 0:
        for peer in range(1, world):
            got = torch.zeros(1)
            dist.recv(got, src=peer)
            print(f"rank 0 received {int(got.item())} from rank {peer}", flush=True)
    else:
        dist.send(torch.tensor([float(rank * 10)]), dst=0)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    master = os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"]
    print(f"rank {rank} of {world}: sum of ranks {int(total.item())} via {master}", flush=True)
    dist.destroy_process_group()
    """
)

# Steps through phalanx.worker's session (which serves the step counter the operator watches);
# in attempt 0, rank 1 stops at step 12 as a deadlocked data loader would, and rank 0 waits for it
# in the next collective forever.
HANGS_ONCE = textwrap.dedent(
    """
    import os, time
    import torch
    import torch.distributed as dist
    from phalanx.worker.session import TrainingSession

    attempt = int(os.environ["PHALANX_ATTEMPT"])
    with TrainingSession(checkpoint_every=5) as session:
        state = {"model": torch.nn.Linear(4, 1)}
        print(f"attempt={attempt} rank={session.rank} resumed_from={session.resumed_from}", flush=True)
        for step in session.steps(30, state):
            if attempt == 0 and step == 12:
                print(f"rank={session.rank} stuck at step={step}", flush=True)
                if session.rank == 1:
                    time.sleep(86400)
            dist.all_reduce(torch.ones(1))
            time.sleep(0.2)
            print(f"attempt={attempt} step={step} resumed_from={session.resumed_from}", flush=True)
    print(f"done rank={session.rank}", flush=True)
    """
)


def scripts_configmap(name: str, **scripts: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": scripts}


def job(
    name: str, spec: dict[str, Any], command: list[str], *, volumes: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            **spec,
            "template": {
                "spec": {
                    "terminationGracePeriodSeconds": 3,
                    "volumes": [{"name": "scripts", "configMap": {"name": "scripts"}}, *(volumes or [])],
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "phalanx.local/trainer:dev",
                            "imagePullPolicy": "Never",
                            "command": command,
                            "volumeMounts": [{"name": "scripts", "mountPath": "/scripts"}],
                            "resources": {"requests": {"cpu": "100m", "memory": "384Mi"}, "limits": {"cpu": "1"}},
                        }
                    ],
                }
            },
        },
    }


def pytorchjob(name: str, workers: int, command: list[str]) -> dict[str, Any]:
    """A Kubeflow PyTorchJob of one Master and ``workers`` Workers, as Kubeflow's examples write one."""

    def replica(replicas: int) -> dict[str, Any]:
        container = {
            "name": "pytorch",
            "image": "phalanx.local/trainer:dev",
            "imagePullPolicy": "Never",
            "command": command,
            "volumeMounts": [{"name": "scripts", "mountPath": "/scripts"}],
            "resources": {"requests": {"cpu": "100m", "memory": "384Mi"}, "limits": {"cpu": "1"}},
        }
        volumes = [{"name": "scripts", "configMap": {"name": "scripts"}}]
        return {
            "replicas": replicas,
            "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [container], "volumes": volumes}},
        }

    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {
            "pytorchReplicaSpecs": {"Master": replica(1), "Worker": replica(workers)},
            "runPolicy": {"backoffLimit": 0},
        },
    }


def converted(body: dict[str, Any]) -> dict[str, Any]:
    """`phalanx convert -`, as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "convert", "-"],
        input=yaml.safe_dump(body),
        capture_output=True,
        text=True,
        check=True,
    )
    job: dict[str, Any] = yaml.safe_load(done.stdout)
    return job


def test_a_converted_pytorchjob_with_a_plain_python_script_and_a_static_torchrun_train(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(scripts_configmap("scripts", **{"sendrecv.py": SENDRECV}), namespace=namespace)
    plain = converted(pytorchjob("plain", 2, ["python", "/scripts/sendrecv.py"]))
    assert plain["spec"]["launcher"] == "static" and plain["spec"]["workers"]["max"] == 3
    kubectl.create(plain, namespace=namespace)
    fixed = {"launcher": "static", "failurePolicy": {"maxRestarts": 0}}
    kubectl.create(
        job(
            "static-torchrun",
            {**fixed, "workers": {"min": 2, "max": 2, "desired": 2}, "procsPerWorker": 2},
            ["torchrun", "/scripts/sendrecv.py"],
        ),
        namespace=namespace,
    )
    final = wait_phase(kubectl, namespace, "plain", "Succeeded", timeout=300)
    assert final["restarts"] == 0 and final["attempt"] == 0
    master = f"plain-worker-0.plain-workers.{namespace}.svc:23456"  # Kubeflow's default port, kept
    rank0 = logs(kubectl, namespace, "plain-worker-0")
    assert "rank 0 received 10 from rank 1" in rank0 and "rank 0 received 20 from rank 2" in rank0, rank0
    for rank in range(3):
        text = logs(kubectl, namespace, f"plain-worker-{rank}")
        assert f"rank {rank} of 3: sum of ranks 3 via {master}" in text, text

    static = wait_phase(kubectl, namespace, "static-torchrun", "Succeeded", timeout=300)
    assert static["restarts"] == 0
    texts = [logs(kubectl, namespace, f"static-torchrun-worker-{index}") for index in range(2)]
    ranks = sorted(int(rank) for text in texts for rank in re.findall(r"rank (\d) of 4: sum of ranks 6", text))
    assert ranks == [0, 1, 2, 3], texts  # two workers x two processes, node ranks from the pod index


def test_a_gang_that_stops_stepping_is_restarted_from_its_checkpoint(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(scripts_configmap("scripts", **{"hangs_once.py": HANGS_ONCE}), namespace=namespace)
    checkpoints = {
        "name": "checkpoints",
        "hostPath": {"path": f"/var/tmp/phalanx-e2e/{namespace}/hang", "type": "DirectoryOrCreate"},
    }
    spec = {
        "workers": {"min": 2, "max": 2, "desired": 2},
        "rendezvous": {"lastCallTimeoutSeconds": 1},
        "checkpoint": {"volumeName": "checkpoints"},
        "failurePolicy": {"backoffSeconds": 1, "progressDeadlineSeconds": 30},
    }
    kubectl.create(
        job("hang", spec, ["torchrun", "/scripts/hangs_once.py"], volumes=[checkpoints]), namespace=namespace
    )
    kubectl.wait_for(
        lambda: "stuck at step=12" in logs(kubectl, namespace, "hang-worker-0"),
        timeout=240,
        interval=1.0,
        what="the hang",
    )
    assert status(kubectl, namespace, "hang")["phase"] == "Running"
    restarted = kubectl.wait_for(
        lambda: (s := status(kubectl, namespace, "hang")).get("attempt") == 1 and s,
        timeout=120,
        interval=0.5,
        what=lambda: f"a NoProgress restart; status {status(kubectl, namespace, 'hang')}",
    )
    assert isinstance(restarted, dict)
    assert restarted["restartsByReason"] == {"NoProgress": 1} and restarted["restarts"] == 1
    events = kubectl.json("get", "events", f"--namespace={namespace}", "--field-selector=involvedObject.name=hang")
    [hang] = [e for e in events["items"] if e["reason"] == "NoProgress"]
    assert hang["type"] == "Warning" and "no training step for" in hang["message"], hang
    assert "step count stayed at 11" in hang["message"] and "attempt 1" in hang["message"], hang
    final = wait_phase(kubectl, namespace, "hang", "Succeeded", timeout=300)
    assert final["restarts"] == 1 and final["attempt"] == 1
    text = logs(kubectl, namespace, "hang-worker-0")
    assert "attempt=1 rank=" in text and "resumed_from=10" in text, text  # from the step-10 checkpoint
    # the last step ran; "done" may never be printed: the operator stops the pods once rank 0 has
    # recorded completion, which can be before its last print
    assert "attempt=1 step=30 " in text
