"""What the integration scenarios share: the job they run, and polling helpers that say what
they waited for and what they saw when a wait times out."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.unit.jobs import manifest

JOB = "demo"
POOL_LABEL = "phalanx.dev/test-pool"
WAITING_REASON_LABEL = "kwok.phalanx.dev/waiting-reason"
WAITING_MESSAGE_ANNOTATION = "kwok.phalanx.dev/waiting-message"
DELETE_DELAY_ANNOTATION = "kwok.phalanx.dev/delete-delay"
STOP_EXIT_CODE_ANNOTATION = "kwok.phalanx.dev/stop-exit-code"  # a container's exit code when its pod is deleted
HOLD_FINALIZER = "phalanx.dev/test-hold"
TRAINER: dict[str, Any] = {
    "name": "trainer",
    "image": "example/train:1",
    "command": ["torchrun"],
    "args": ["train.py"],
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "4", "memory": "4Gi"}},
}
GPU_JOB: dict[str, Any] = {
    "workers": {"min": 2, "max": 4, "desired": 3},
    "gpus": {"count": 4},
    "failurePolicy": {"maxRestarts": 3, "backoffSeconds": 2, "maxBackoffSeconds": 8},
    "template": {"spec": {"containers": [TRAINER]}},
}


def gpu_pool(kwok_cluster: LocalCluster, kubectl: Kubectl, pool: str, count: int = 2) -> list[str]:
    """``count`` Ready 8-GPU KWOK nodes labelled with ``pool`` (reused when a kept cluster has them)."""
    names = [n["metadata"]["name"] for n in kubectl.list("nodes", selector=f"{POOL_LABEL}={pool}")]
    if len(names) < count:
        names += kwok_cluster.add_gpu_nodes(count - len(names), labels={POOL_LABEL: pool}, name_prefix=f"{pool}-gpu-")
    kwok_cluster.wait_nodes_ready(names)
    return names


def create(kubectl: Kubectl, namespace: str, *, name: str = JOB, **overrides: Any) -> dict[str, Any]:
    spec = copy.deepcopy(GPU_JOB)
    spec.update(copy.deepcopy(overrides))
    body = manifest(**spec)
    body["metadata"] = {"name": name}
    kubectl.create(body, namespace=namespace)
    return body


def status(kubectl: Kubectl, namespace: str, name: str = JOB) -> dict[str, Any]:
    return ((kubectl.get("tj", name, namespace) or {}).get("status")) or {}


def conditions(state: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in state.get("conditions", [])}


def workers(kubectl: Kubectl, namespace: str, job: str = JOB) -> dict[str, dict[str, Any]]:
    """Worker pods by name (Terminating ones included)."""
    pods = kubectl.list("pods", namespace, naming.worker_selector(job))
    return {pod["metadata"]["name"]: pod for pod in pods}


def job_pods(kubectl: Kubectl, namespace: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in kubectl.list("pods", namespace, f"{naming.JOB_NAME_LABEL}={JOB}"))


def uids(pods: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {name: pod["metadata"]["uid"] for name, pod in pods.items()}


def attempts(pods: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {name: pod["metadata"]["labels"][naming.ATTEMPT_LABEL] for name, pod in pods.items()}


def env(pod: dict[str, Any]) -> dict[str, str | None]:
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == TRAINER["name"])
    return {e["name"]: e.get("value") for e in trainer.get("env", [])}


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text, None when absent."""
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        found = series[len(name) :].strip("{}")
        if ",".join(sorted(found.split(","))) == wanted or (not wanted and not found):
            return float(value)
    return None


def events(kubectl: Kubectl, namespace: str) -> list[dict[str, Any]]:
    """Events recorded on the TrainingJob, oldest first."""
    items: list[dict[str, Any]] = kubectl.json(
        "get",
        "events",
        f"--namespace={namespace}",
        f"--field-selector=involvedObject.name={JOB},involvedObject.kind=TrainingJob",
    )["items"]
    return sorted(items, key=lambda e: (e.get("lastTimestamp") or "", e["metadata"]["creationTimestamp"]))


def event_summary(kubectl: Kubectl, namespace: str) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in events(kubectl, namespace)]


def wait_event(
    kubectl: Kubectl, namespace: str, reason: str, contains: str = "", timeout: float = 30
) -> dict[str, Any]:
    """The first Event on the job with this reason (and text in its message)."""

    def found() -> dict[str, Any]:  # {} (falsy) until the event exists
        matching = (e for e in events(kubectl, namespace) if e["reason"] == reason and contains in e["message"])
        return next(matching, {})

    try:
        return kubectl.wait_for(found, timeout=timeout, what=f"event {reason} {contains!r} on tj/{JOB}")
    except TimeoutError as error:
        raise AssertionError(f"{error}; events: {event_summary(kubectl, namespace)}") from None


def wait_status(
    kubectl: Kubectl,
    namespace: str,
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
    timeout: float = 30,
    *,
    name: str = JOB,
) -> dict[str, Any]:
    """Poll the job's status until predicate(status) holds; the failure names the last status."""
    last: dict[str, Any] = {}

    def check() -> dict[str, Any]:
        nonlocal last
        last = status(kubectl, namespace, name)
        return last if predicate(last) else {}

    try:
        return kubectl.wait_for(check, timeout=timeout, what=what)
    except TimeoutError as error:
        summary = {k: last.get(k) for k in ("phase", "reason", "message", "attempt", "restarts", "restartsByReason")}
        raise AssertionError(f"{error}; last status {summary}; events {event_summary(kubectl, namespace)}") from None


def wait_running(
    kubectl: Kubectl, namespace: str, ready: int, timeout: float = 30, *, name: str = JOB
) -> dict[str, Any]:
    return wait_status(
        kubectl,
        namespace,
        lambda s: s.get("phase") == "Running" and s.get("workerSummary") == f"{ready}/{ready}",
        f"phase Running with {ready}/{ready} workers",
        timeout,
        name=name,
    )


def wait_workers(
    kubectl: Kubectl,
    namespace: str,
    predicate: Callable[[dict[str, dict[str, Any]]], bool],
    what: str,
    timeout: float = 30,
) -> dict[str, dict[str, Any]]:
    last: dict[str, dict[str, Any]] = {}

    def check() -> dict[str, dict[str, Any]]:
        nonlocal last
        last = workers(kubectl, namespace)
        return last if predicate(last) else {}

    try:
        return kubectl.wait_for(check, timeout=timeout, what=what)
    except TimeoutError as error:
        seen = {
            name: (attempts(last)[name], pod["status"].get("phase"), bool(pod["metadata"].get("deletionTimestamp")))
            for name, pod in last.items()
        }
        raise AssertionError(
            f"{error}; worker pods (attempt, phase, deleting): {seen}; events: {event_summary(kubectl, namespace)}"
        ) from None


def running_and_ready(pods: dict[str, dict[str, Any]], names: set[str]) -> bool:
    if set(pods) != names:
        return False
    for pod in pods.values():
        ready = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}.get("Ready")
        if pod["metadata"].get("deletionTimestamp") or pod["status"].get("phase") != "Running" or ready != "True":
            return False
    return True


def replaced_and_running(pods: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]], victim: str) -> bool:
    """The same worker names, all running, and ``victim`` is a new pod."""
    return running_and_ready(pods, set(before)) and uids(pods)[victim] != uids(before)[victim]


def start(kubectl: Kubectl, namespace: str, desired: int = 3, **overrides: Any) -> dict[str, dict[str, Any]]:
    """Create the job and wait until it runs; returns its worker pods."""
    spec_workers = {**GPU_JOB["workers"], "desired": desired, **overrides.pop("workers", {})}
    create(kubectl, namespace, workers=spec_workers, **overrides)
    wait_running(kubectl, namespace, desired)
    pods = workers(kubectl, namespace)
    assert sorted(pods) == [naming.worker_pod_name(JOB, i) for i in range(desired)]
    assert set(attempts(pods).values()) == {"0"}
    return pods


def wait_replaced_alone(
    kubectl: Kubectl,
    namespace: str,
    before: dict[str, dict[str, Any]],
    victim: str,
    restarts: int,
    by_reason: dict[str, int] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Wait until ``victim`` has a running successor and the job runs healthy again; check that
    it was the only worker replaced, in the same attempt, after ``restarts`` counted restarts.
    Returns the job's status and the workers."""
    after = wait_workers(
        kubectl, namespace, lambda p: replaced_and_running(p, before, victim), f"a new, running {victim}"
    )
    state = wait_running(kubectl, namespace, len(before))
    assert (state["restarts"], state["attempt"]) == (restarts, 0)
    if by_reason is not None:
        assert state["restartsByReason"] == by_reason
    assert_healthy(state)
    assert set(attempts(after).values()) == {"0"}
    survivors = {name for name in before if name != victim}
    assert {n: uids(after)[n] for n in survivors} == {n: uids(before)[n] for n in survivors}
    return state, after


def assert_healthy(state: dict[str, Any]) -> None:
    got = conditions(state)
    assert got["Ready"][0] == "True", got
    assert got["Reconciling"][0] == "False", got
    assert got["Stalled"][0] == "False", got
    assert got["Failed"][0] == "False", got


def assert_failed(state: dict[str, Any], reason: str) -> None:
    assert state["phase"] == "Failed", state
    assert state["reason"] == reason, state
    assert state.get("completionTime"), state
    got = conditions(state)
    assert got["Stalled"] == ("True", reason), got
    assert got["Failed"] == ("True", reason), got
    assert got["Ready"][0] == "False", got
    assert got["Reconciling"][0] == "False", got


def wait_no_pods(kubectl: Kubectl, namespace: str, timeout: float = 30) -> None:
    kubectl.wait_for(lambda: not job_pods(kubectl, namespace), timeout=timeout, what="every pod of the job gone")


def node_of(pod: dict[str, Any]) -> str:
    return str(pod["spec"]["nodeName"])


def store_pod(kubectl: Kubectl, namespace: str) -> dict[str, Any]:
    pod = kubectl.get("pod", naming.rendezvous_name(JOB), namespace)
    assert pod is not None
    return pod


def hold(kubectl: Kubectl, namespace: str, pod: str, held: bool = True) -> None:
    """Keep a pod from going away (a finalizer nobody removes) until released."""
    finalizers = [HOLD_FINALIZER] if held else []
    kubectl.run(
        "patch", "pod", pod, f"--namespace={namespace}", "--type=merge",
        "-p", json.dumps({"metadata": {"finalizers": finalizers}}),
    )  # fmt: skip
