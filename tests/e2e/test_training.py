"""Real training on the real node: torchrun workers in real containers, gloo over pod networking."""

from __future__ import annotations

import itertools
import pathlib
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import yaml

from phalanx.cli import describe_text
from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.integration.operator_process import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEP = re.compile(r"step=(\d+) loss=([0-9.]+) world_size=(\d+)")


def status(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    return ((kubectl.get("tj", name, namespace) or {}).get("status")) or {}


def wait_phase(kubectl: Kubectl, namespace: str, name: str, phase: str, timeout: float) -> dict[str, Any]:
    reached = kubectl.wait_for(
        lambda: (s := status(kubectl, namespace, name)).get("phase") == phase and s,
        timeout=timeout,
        interval=1.0,
        what=lambda: f"{name} {phase}, last status {status(kubectl, namespace, name)}",  # the state it ended in
    )
    assert isinstance(reached, dict)
    return reached


def logs(kubectl: Kubectl, namespace: str, pod: str) -> str:
    return kubectl.run("logs", pod, f"--namespace={namespace}", check=False).stdout


def worker_names(kubectl: Kubectl, namespace: str, name: str) -> list[str]:
    pods = kubectl.list("pods", namespace, f"{naming.JOB_NAME_LABEL}={name},{naming.ROLE_LABEL}=worker")
    return sorted(pod["metadata"]["name"] for pod in pods)


# How far along its life a phase is: a job's phases may only move up this order (a gang restart
# or a failure aside, which the example has none of).
PHASE_ORDER = {"": 0, "Pending": 1, "Starting": 2, "Running": 3, "Rescaling": 3, "Succeeded": 4}


@contextmanager
def watched_phases(kubectl: Kubectl, namespace: str, name: str) -> Iterator[list[tuple[str, str]]]:
    """Every (phase, reason) a watch on the job delivers, as `kubectl get tj -w` shows them."""
    seen: list[tuple[str, str]] = []
    argv = [str(kubectl.binary), f"--kubeconfig={kubectl.kubeconfig}", "get", "tj", name]
    argv += [f"--namespace={namespace}", "--watch", r'--output=jsonpath={.status.phase} {.status.reason}{"\n"}']
    watch = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def read() -> None:
        assert watch.stdout is not None
        for line in watch.stdout:
            phase, _, reason = line.strip().partition(" ")
            seen.append((phase, reason))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield seen
    finally:
        watch.terminate()
        watch.wait(timeout=10)
        reader.join(timeout=10)


def test_cpu_example_trains_two_workers_in_one_world(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    body = yaml.safe_load((ROOT / "examples" / "cpu-gloo.yaml").read_text())
    kubectl.create(body, namespace=namespace)
    with watched_phases(kubectl, namespace, "cpu-gloo") as phases:
        # the rank of each pod as phalanx describe tells it, while the world trains
        running = wait_phase(kubectl, namespace, "cpu-gloo", "Running", timeout=240)
        job = kubectl.get("tj", "cpu-gloo", namespace)
        assert job is not None
        pods = kubectl.list("pods", namespace, naming.worker_selector("cpu-gloo"))
        told = describe_text.rank_map(job["spec"], pods, int(running.get("attempt") or 0))
        final = wait_phase(kubectl, namespace, "cpu-gloo", "Succeeded", timeout=300)
        kubectl.wait_for(lambda: ("Succeeded", "Succeeded") in phases, timeout=10, what="the watch sees Succeeded")
    print(f"phases watched: {phases}")
    # A finishing job never looks like one starting again (workers exit 0 one after another).
    assert ("Running", "WorkersReady") in phases, phases
    backwards = [(a, b) for a, b in itertools.pairwise(phases) if PHASE_ORDER[b[0]] < PHASE_ORDER[a[0]]]
    assert not backwards, phases
    events = kubectl.list("events", namespace, None)
    relapses = [
        e["message"]
        for e in events
        if (e.get("involvedObject") or {}).get("name") == "cpu-gloo"
        and re.match(r"(Running|Rescaling) -> (Starting|Pending)", e.get("message") or "")
    ]
    assert not relapses, relapses
    assert {c["type"]: c["status"] for c in final["conditions"]}["Succeeded"] == "True"
    texts = [logs(kubectl, namespace, pod) for pod in ("cpu-gloo-worker-0", "cpu-gloo-worker-1")]
    for text in texts:
        assert re.search(r"joined rank=\d world_size=2", text), text
        steps = [(int(s), float(loss)) for s, loss, world in STEP.findall(text) if world == "2"]
        assert steps, text
        first, last = steps[0], steps[-1]
        assert last[0] == 200 and last[1] < first[1] / 10, steps  # the loss went down
    ranks = {re.findall(r"joined rank=(\d) world_size=2", text)[-1] for text in texts}
    assert ranks == {"0", "1"}  # the two workers were two ranks of one world
    # describe's rank map is the rendezvous's: the pods' IPs in sort order (one process per worker)
    joined = {
        pod: re.findall(r"joined rank=(\d) world_size=2", text)[-1]
        for pod, text in zip(("cpu-gloo-worker-0", "cpu-gloo-worker-1"), texts, strict=True)
    }
    predicted = {line.split()[1]: line.split()[0] for line in told[3:]}  # below the heading and the header
    print(f"ranks told by describe: {predicted}; joined: {joined}")
    assert predicted == joined, told


def elastic_job(name: str, namespace: str, steps: int) -> dict[str, Any]:
    """3 workers (min 2), checkpoints on a hostPath shared by all pods of the single real node."""
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "workers": {"min": 2, "max": 3, "desired": 3},
            "rendezvous": {"lastCallTimeoutSeconds": 1},
            "checkpoint": {"volumeName": "checkpoints", "keep": 3},
            "failurePolicy": {"backoffSeconds": 1},
            "template": {
                "spec": {
                    "volumes": [
                        {
                            "name": "checkpoints",
                            "hostPath": {
                                "path": f"/var/tmp/phalanx-e2e/{namespace}/{name}",
                                "type": "DirectoryOrCreate",
                            },
                        }
                    ],
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "phalanx.local/trainer:dev",
                            "imagePullPolicy": "Never",
                            "command": ["torchrun"],
                            "args": [
                                "-m",
                                "phalanx.worker.demo",
                                "--steps",
                                str(steps),
                                "--step-seconds",
                                "0.1",
                                "--checkpoint-every",
                                "10",
                                "--log-every",
                                "5",
                            ],
                            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"cpu": "1"}},
                        }
                    ],
                }
            },
        },
    }


def wait_for_step(kubectl: Kubectl, namespace: str, pods: list[str], world: int, step: int) -> None:
    def reached() -> bool:
        for pod in pods:
            seen = [int(s) for s, _, w in STEP.findall(logs(kubectl, namespace, pod)) if int(w) == world]
            if not seen or max(seen) < step:
                return False
        return True

    kubectl.wait_for(reached, timeout=240, interval=1.0, what=f"{pods} at step {step} in a world of {world}")


def wait_world_size(kubectl: Kubectl, namespace: str, name: str, world: int) -> None:
    kubectl.wait_for(
        lambda: (status(kubectl, namespace, name).get("workers") or {}).get("worldSize") == world,
        timeout=60,
        interval=0.5,
        what=lambda: f"status.workers.worldSize {world}; status {status(kubectl, namespace, name)}",
    )


def steps_in_world(text: str, world: int) -> list[int]:
    return [int(step) for step, _, size in STEP.findall(text) if int(size) == world]


def test_losing_one_worker_keeps_training_at_world_size_two(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(elastic_job("elastic", namespace, 500), namespace=namespace)
    pods = ["elastic-worker-0", "elastic-worker-1", "elastic-worker-2"]
    wait_for_step(kubectl, namespace, pods, world=3, step=30)
    wait_world_size(kubectl, namespace, "elastic", 3)  # what a worker reports, in the job's status
    # No capacity for a replacement while the worker is gone: the node is cordoned.
    kubectl.run("cordon", "real-node")
    try:
        lost_at = time.monotonic()
        kubectl.run("delete", "pod", "elastic-worker-2", f"--namespace={namespace}", "--wait=false")
        wait_for_step(kubectl, namespace, pods[:2], world=2, step=1)
        print(f"E2E-METRIC training resumed at world size 2 {time.monotonic() - lost_at:.1f}s after the loss")
        resumed_at = max(steps_in_world(logs(kubectl, namespace, pods[0]), 2))
        wait_for_step(kubectl, namespace, pods[:2], world=2, step=resumed_at + 20)  # it goes on at 2
        pending = kubectl.get("pod", "elastic-worker-2", namespace)
        assert pending is not None and pending["status"]["phase"] == "Pending"  # the replacement waits
        assert status(kubectl, namespace, "elastic")["phase"] == "Rescaling"
        wait_world_size(kubectl, namespace, "elastic", 2)
    finally:
        kubectl.run("uncordon", "real-node")
    final = wait_phase(kubectl, namespace, "elastic", "Succeeded", timeout=400)
    assert final["attempt"] == 0 and final["restarts"] == 0
    survivor = logs(kubectl, namespace, "elastic-worker-0")
    resumed = [int(step) for step in re.findall(r"resumed_from=(\d+)", survivor)]
    assert resumed == sorted(resumed), survivor  # no re-formed world went back
    # A late pod may re-form the first world early; every world after the loss starts past step 30.
    trained = next(m.start() for m in STEP.finditer(survivor) if int(m.group(1)) >= 30)
    after_loss = [int(step) for step in re.findall(r"resumed_from=(\d+)", survivor[trained:])]
    assert len(after_loss) >= 2 and min(after_loss) >= 30, survivor  # down to 2, back up to 3
    assert steps_in_world(survivor, 3)[-1] > resumed_at  # capacity came back: the world grew to 3 again
    assert "done rank=" in survivor
    assert final["lastCheckpoint"]["step"] > resumed_at, final  # reported by a worker, kept after the end
    assert "worldSize" not in final["workers"], final  # only while the job trains


def test_losing_two_workers_restarts_the_gang_from_the_checkpoint(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(elastic_job("gang", namespace, 300), namespace=namespace)
    pods = ["gang-worker-0", "gang-worker-1", "gang-worker-2"]
    wait_for_step(kubectl, namespace, pods, world=3, step=30)
    # The operator's view of the step comes from its scrapes: wait until one of them saw step 30
    # (a checkpoint at 30 is reported beside a step at least as high), so the step reached is known.
    kubectl.wait_for(
        lambda: ((status(kubectl, namespace, "gang").get("lastCheckpoint") or {}).get("step") or 0) >= 30,
        timeout=60,
        interval=0.5,
        what="the operator to see a checkpoint at step 30",
    )
    kubectl.run("delete", "pod", "gang-worker-1", "gang-worker-2", f"--namespace={namespace}", "--wait=false")
    restarted = kubectl.wait_for(
        lambda: (s := status(kubectl, namespace, "gang")).get("attempt") == 1 and s,
        timeout=120,
        interval=0.5,
        what="a gang restart",
    )
    assert isinstance(restarted, dict)
    assert restarted["restartsByReason"] == {"WorkersDeleted": 1}
    assert restarted["restarts"] == 0
    final = wait_phase(kubectl, namespace, "gang", "Succeeded", timeout=300)
    assert final["attempt"] == 1
    pods_now = worker_names(kubectl, namespace, "gang")
    attempts = {
        kubectl.get("pod", pod, namespace)["metadata"]["labels"][naming.ATTEMPT_LABEL]  # type: ignore[index]
        for pod in pods_now
    }
    assert attempts == {"1"}
    text = logs(kubectl, namespace, "gang-worker-0")
    resumed = [int(step) for step in re.findall(r"resumed_from=(\d+)", text)]
    assert resumed and resumed[0] >= 30, text  # the new gang started from the checkpoint, not from zero
    assert "attempt=1" in text
    assert final["lastCheckpoint"]["step"] > resumed[0], final
    # steps computed twice: from where a run of the new attempt resumed to the step reached before
    reached = restarted["recomputedSteps"]["reached"]
    assert reached >= 30, restarted["recomputedSteps"]
    assert final["recomputedSteps"]["total"] in {max(0, reached - step) for step in resumed}, (final, resumed)
    assert "reached" not in final["recomputedSteps"], final
