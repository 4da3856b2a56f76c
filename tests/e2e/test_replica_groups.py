"""Replica groups on the real node (gloo, CPU): three groups of three workers (nine trainer
containers under phalanx-supervise, each group a torchrun world of three) and three warm spares. One
worker of group 1 is deleted: the operator restarts group 1 alone as generation 1, the spares take
its three slots (their imports done, nothing to start), groups 0 and 2 keep stepping (no step lost
by them), and the returning group takes the weights from a peer group, so its loss goes on where the
peers' is, not from the untrained model's. (Without spares a restarted group's slots get new pods,
the planner tests' case; the goodput benchmark times both.)"""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Any

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.e2e.test_training import elastic_job, logs, status
from tests.integration.operator_process import OperatorProcess

STEP = re.compile(r"step=(\d+) loss=([0-9.]+) group=(\d+)")
HEALED = re.compile(r"^(\S+) phalanx-demo: group=\d+ healed at step=(\d+)", re.MULTILINE)
SIZE = 3
GROUPS = 3
WORKERS = [f"groups-worker-{index}" for index in range(SIZE * GROUPS)]
KILLED_GROUP = 1
GROUP_PODS = {group: WORKERS[group * SIZE : (group + 1) * SIZE] for group in range(GROUPS)}
HEALTHY_PODS = [pod for group, pods in GROUP_PODS.items() if group != KILLED_GROUP for pod in pods]
SPARES = [f"groups-spare-{serial}" for serial in range(SIZE)]


def grouped_job(namespace: str) -> dict[str, Any]:
    job = elastic_job("groups", namespace, 100000)
    spec = job["spec"]
    spec.pop("checkpoint")  # a returning group heals from a peer, not from storage
    spec["workers"] = {"min": SIZE * 2, "max": SIZE * GROUPS, "desired": SIZE * GROUPS, "spares": SIZE}
    spec["replicaGroups"] = {"size": SIZE, "min": 2}
    [trainer] = spec["template"]["spec"]["containers"]
    trainer["command"] = ["phalanx-supervise", "--", "torchrun"]
    trainer["args"] = ["-m", "phalanx.worker.demo", "--steps", "100000", "--step-seconds", "0.1", "--log-every", "1"]
    # nine torch processes on the node: a small request each, so the node's CPUs hold them all
    trainer["resources"] = {"requests": {"cpu": "50m", "memory": "384Mi"}, "limits": {"cpu": "1"}}
    return job


def steps(text: str) -> list[tuple[int, float]]:
    return [(int(step), float(loss)) for step, loss, _ in STEP.findall(text)]


def uid(kubectl: Kubectl, namespace: str, name: str) -> str | None:
    pod = kubectl.get("pod", name, namespace)
    return None if pod is None else str(pod["metadata"]["uid"])


def returned(kubectl: Kubectl, namespace: str) -> list[str]:
    """The pods that hold the killed group's slots at its next generation (the spares promoted)."""
    selector = (
        f"{naming.JOB_NAME_LABEL}=groups,{naming.ROLE_LABEL}={naming.ROLE_WORKER},"
        f"{naming.REPLICA_GROUP_LABEL}={KILLED_GROUP},{naming.GROUP_GENERATION_LABEL}=1"
    )
    pods = kubectl.list("pods", namespace, selector)
    return sorted(pod["metadata"]["name"] for pod in pods if not pod["metadata"].get("deletionTimestamp"))


def healed_line(kubectl: Kubectl, namespace: str) -> tuple[int, float] | None:
    """The killed group's healing, once a pod of its next generation logged one: (the step, the Unix
    time the container runtime stamped on that line)."""
    for pod in returned(kubectl, namespace):
        text = kubectl.run("logs", pod, f"--namespace={namespace}", "--timestamps", check=False).stdout
        found = HEALED.findall(text)
        if found:
            stamp, step = found[-1]
            return int(step), datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return None


def stamp_of(text: str, pattern: str) -> float | None:
    """The Unix time the container runtime stamped on the first line of ``text`` (``kubectl logs
    --timestamps``) that matches ``pattern``."""
    found = re.search(rf"^(\S+) .*{pattern}", text, re.MULTILINE)
    return None if found is None else datetime.fromisoformat(found.group(1).replace("Z", "+00:00")).timestamp()


def timeline(kubectl: Kubectl, namespace: str, killed_at: float) -> str:
    """Where the seconds from the kill to the healed step went, per pod of the returning group:
    promoted (the supervisor saw its slot), the training process started (after torchrun's agent
    and the group's rendezvous), joined its group's world (gloo, the store), healed."""
    lines = []
    for name in returned(kubectl, namespace):
        text = kubectl.run("logs", name, f"--namespace={namespace}", "--timestamps", check=False).stdout
        moments = {
            "promoted": stamp_of(text, r"promoted into slot"),
            "process started": stamp_of(text, r"process started"),
            "gloo": stamp_of(text, r"in its group's world"),
            "store": stamp_of(text, r"connected to the job's store"),
            "in its world": stamp_of(text, r"starting at step="),
            "healed": stamp_of(text, r"healed at step="),
        }
        told = ", ".join(f"{what} +{when - killed_at:.1f}s" for what, when in moments.items() if when is not None)
        lines.append(f"  {name}: {told}")
    return "\n".join(lines)


def test_a_killed_group_of_three_comes_back_from_spares_healed_while_the_others_lose_no_step(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(grouped_job(namespace), namespace=namespace)
    kubectl.wait_for(
        lambda: all(len(steps(logs(kubectl, namespace, pod))) >= 30 for pod in WORKERS),
        timeout=420,
        interval=2.0,
        what="every worker of the three groups at step 30",
    )
    kubectl.wait_for(
        lambda: sum("waiting to be promoted" in logs(kubectl, namespace, pod) for pod in SPARES) == SIZE,
        timeout=120,
        interval=1.0,
        what="three warm spares with their imports done",
    )
    before = {pod: uid(kubectl, namespace, pod) for pod in WORKERS}
    killed_pod = GROUP_PODS[KILLED_GROUP][1]
    killed_at_step = steps(logs(kubectl, namespace, killed_pod))[-1][0]
    killed_at = time.time()  # the node's clock: the same host stamps the containers' log lines
    kubectl.run("delete", "pod", killed_pod, f"--namespace={namespace}", "--wait=false")

    healed = kubectl.wait_for(
        lambda: healed_line(kubectl, namespace), timeout=180, interval=0.5, what="group 1 back and healed"
    )
    assert healed is not None
    healed_at, healed_stamp = healed
    back_after = healed_stamp - killed_at
    kubectl.wait_for(
        lambda: all(
            steps(logs(kubectl, namespace, pod))[-1][0] >= healed_at + 10
            for pod in [*HEALTHY_PODS, *returned(kubectl, namespace)]
        ),
        timeout=120,
        interval=1.0,
        what="every worker ten steps past the healing",
    )
    print(
        f"replica group {KILLED_GROUP} (3 workers) killed at step {killed_at_step}, "
        f"back from the spares and healed at step {healed_at}, {back_after:.1f}s after the kill "
        f"(seconds after the kill):\n{timeline(kubectl, namespace, killed_at)}"
    )

    for pod in HEALTHY_PODS:  # the same pods, every step taken, also while group 1 was down
        assert uid(kubectl, namespace, pod) == before[pod], pod
        taken = [step for step, _ in steps(logs(kubectl, namespace, pod))]
        # from step 1, or from where its group joined: a group whose world formed more than the
        # quorum's join timeout after the first one's healed from it at its start
        assert taken == list(range(taken[0], taken[0] + len(taken))), f"{pod} lost a step"
        assert taken[0] < killed_at_step
        assert taken[-1] >= healed_at + 10
    # the whole group was replaced, not only the killed worker, and by the spares, not by new pods
    back = returned(kubectl, namespace)
    assert sorted(back) == SPARES, back
    for pod in GROUP_PODS[KILLED_GROUP]:  # gone, or stopping (its grace period)
        old = kubectl.get("pod", pod, namespace)
        assert old is None or old["metadata"].get("deletionTimestamp"), pod

    # the loss curve goes on: the healed group's losses from the heal step on are the peers' at
    # those steps, not the untrained model's
    peers = dict(steps(logs(kubectl, namespace, GROUP_PODS[0][0])))
    # the untrained model's loss (near it for a group that healed at its start, a few steps in)
    initial = max(steps(logs(kubectl, namespace, pod))[0][1] for pod in HEALTHY_PODS)
    healed_losses = {
        step: loss
        for pod in back
        for step, loss in steps(logs(kubectl, namespace, pod))
        if healed_at <= step <= healed_at + 5
    }
    assert healed_losses, "the healed group took no step after healing"
    print(
        f"initial loss {initial}; after healing, group 1: {healed_losses}, group 0: "
        f"{ {step: peers[step] for step in healed_losses} }"
    )
    for step, loss in healed_losses.items():
        assert loss <= 2 * peers[step] + initial / 100, (step, loss, peers[step], initial)

    current = status(kubectl, namespace, "groups")
    groups = current["replicaGroups"]
    assert [group["generation"] for group in groups] == [0, 1, 0], groups
    assert [group["restarts"] for group in groups] == [0, 1, 0], groups
    assert current.get("restarts", 0) == 0 and current["attempt"] == 0, current  # deleted: not counted
    pods = kubectl.list("pods", namespace, f"{naming.JOB_NAME_LABEL}=groups,{naming.REPLICA_GROUP_LABEL}=1")
    live = [pod for pod in pods if not pod["metadata"].get("deletionTimestamp")]
    assert sorted(pod["metadata"]["labels"][naming.GROUP_GENERATION_LABEL] for pod in live) == ["1"] * SIZE
    assert back_after < 120  # measured and reported (issue target: 10 s); a generous bound only
