"""Failure scenarios on simulated GPU nodes: one test per failure class, plus rescaling.

Each scenario runs the operator (under the chart's RBAC) against the real control plane,
breaks something the way a cluster does (a KWOK exit code or waiting reason, the eviction
API, a not-ready or lost node, an API server refusal, ``kubectl scale``/``delete``/``patch``)
and checks the job's phase, conditions, Events, restart counters and the pods that remain.
Every wait polls with a timeout and says what it waited for; nothing sleeps to assert.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.chart_identity import chart_identity
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import (
    DELETE_DELAY_ANNOTATION,
    JOB,
    POOL_LABEL,
    STOP_EXIT_CODE_ANNOTATION,
    TRAINER,
    WAITING_MESSAGE_ANNOTATION,
    WAITING_REASON_LABEL,
    assert_failed,
    assert_healthy,
    attempts,
    conditions,
    create,
    env,
    event_summary,
    hold,
    node_of,
    replaced_and_running,
    running_and_ready,
    start,
    status,
    store_pod,
    uids,
    wait_event,
    wait_no_pods,
    wait_replaced_alone,
    wait_running,
    wait_status,
    wait_workers,
    workers,
)

pytestmark = pytest.mark.integration

POOL = "failures"

# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    """Four 8-GPU KWOK nodes of our own (reused when a kept cluster has them, all Ready)."""
    nodes = kubectl.list("nodes", selector=f"{POOL_LABEL}={POOL}")
    names = [n["metadata"]["name"] for n in nodes]
    if len(names) < 4:
        names += kwok_cluster.add_gpu_nodes(
            4 - len(names), gpus_per_node=8, labels={POOL_LABEL: POOL}, name_prefix="fail-gpu-"
        )
    for name in names:  # a previous run that was killed may have left one broken
        kwok_cluster.set_node_not_ready(name, not_ready=False, wait=False)
        kwok_cluster.set_node_lost(name, lost=False)
    kwok_cluster.wait_nodes_ready(names)
    return names


NODE_LOST_GRACE_SECONDS = 15
"""The operator's node-lost grace in this module (300 s by default), longer than a blip."""


@pytest.fixture
def running_operator(
    crds: list[str],
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    namespace: str,
    tmp_path: pathlib.Path,
    gpu_nodes: list[str],
) -> Iterator[OperatorProcess]:
    """The operator under the chart's identity, with a short node-lost grace."""
    environment = {"PHALANX_NODE_LOST_GRACE_SECONDS": str(NODE_LOST_GRACE_SECONDS)}
    with chart_identity(kubectl, kubeconfig, namespace, f"phx-{uuid.uuid4().hex[:6]}", tmp_path) as identity:
        process = OperatorProcess(identity, tmp_path / "operator.log", namespace=namespace, extra_env=environment)
        with process:
            yield process
            assert process.alive(), "the operator died"
        print(f"--- operator log (tail) ---\n{process.log_tail(80)}")


@pytest.fixture
def cluster_nodes(kwok_cluster: LocalCluster, gpu_nodes: list[str]) -> Iterator[LocalCluster]:
    """The KWOK cluster; every node of our pool that a test breaks is healed afterwards."""
    yield kwok_cluster
    for name in gpu_nodes:
        kwok_cluster.set_node_not_ready(name, not_ready=False, wait=False)
        kwok_cluster.set_node_lost(name, lost=False)
    kwok_cluster.wait_nodes_ready(gpu_nodes)


# -- counted failures ----------------------------------------------------------------------------


def test_application_error_with_enough_survivors_replaces_only_that_worker(
    kubectl: Kubectl, kwok_cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    before = start(kubectl, namespace)
    victim = naming.worker_pod_name(JOB, 1)
    message = "RuntimeError: CUDA error: an illegal memory access was encountered"
    kwok_cluster.finish_pod(namespace, victim, 1, message=message)

    state = wait_status(kubectl, namespace, lambda s: s.get("restarts") == 1, "restarts 1")
    assert state["restartsByReason"] == {"WorkerFailed": 1}
    assert state["attempt"] == 0
    # only the failed worker is replaced, in the same attempt and the same rendezvous
    _, after = wait_replaced_alone(kubectl, namespace, before, victim, 1, {"WorkerFailed": 1})
    assert env(after[victim])["PET_RDZV_ID"] == env(before[victim])["PET_RDZV_ID"]
    warning = wait_event(kubectl, namespace, "WorkerFailed")
    assert warning["type"] == "Warning"
    assert victim in warning["message"] and message in warning["message"], warning["message"]
    assert "exited with code 1" in warning["message"]
    reasons = [reason for _, reason, _ in event_summary(kubectl, namespace)]
    assert "GangRestart" not in reasons


def test_oom_kill_is_counted_and_the_worker_replaced(
    kubectl: Kubectl, kwok_cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    before = start(kubectl, namespace)
    victim = naming.worker_pod_name(JOB, 2)
    kwok_cluster.finish_pod(namespace, victim, 137, reason="OOMKilled")

    state = wait_status(kubectl, namespace, lambda s: s.get("restarts") == 1, "restarts 1")
    assert state["restartsByReason"] == {"OOMKilled": 1}
    wait_replaced_alone(kubectl, namespace, before, victim, 1, {"OOMKilled": 1})
    warning = wait_event(kubectl, namespace, "WorkerOOMKilled")
    assert warning["type"] == "Warning"
    assert victim in warning["message"] and "OOMKilled" in warning["message"], warning["message"]
    assert "exited with code 137" in warning["message"]


def test_too_few_survivors_restart_the_gang_after_the_backoff(
    kubectl: Kubectl, kwok_cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    before = start(kubectl, namespace, desired=2)  # min 2: losing one leaves too few
    store_uid = store_pod(kubectl, namespace)["metadata"]["uid"]
    victim = naming.worker_pod_name(JOB, 0)
    kwok_cluster.finish_pod(namespace, victim, 1, message="ValueError: bad batch")

    state = wait_status(kubectl, namespace, lambda s: s.get("attempt") == 1, "attempt 1")
    assert (state["restarts"], state["restartsByReason"]) == (1, {"WorkerFailed": 1})
    not_before = state["restartNotBefore"]
    assert not_before, state
    restart = wait_event(kubectl, namespace, "GangRestart", victim)
    assert restart["type"] == "Warning"
    assert victim in restart["message"] and "ValueError: bad batch" in restart["message"]
    assert "attempt 1" in restart["message"] and "after 2s" in restart["message"], restart["message"]

    after = wait_workers(
        kubectl,
        namespace,
        lambda p: running_and_ready(p, set(before)) and set(attempts(p).values()) == {"1"},
        "both workers recreated as attempt 1",
    )
    state = wait_running(kubectl, namespace, 2)
    assert (state["restarts"], state["restartsByReason"], state["attempt"]) == (1, {"WorkerFailed": 1}, 1)
    assert_healthy(state)
    for name, pod in after.items():
        assert pod["metadata"]["uid"] != before[name]["metadata"]["uid"]
        # the backoff was respected: no pod of the new attempt exists before restartNotBefore
        assert pod["metadata"]["creationTimestamp"] >= not_before, (pod["metadata"]["creationTimestamp"], not_before)
        old_id, new_id = env(before[name])["PET_RDZV_ID"], env(pod)["PET_RDZV_ID"]
        assert old_id and new_id and old_id != new_id and new_id.endswith("-1"), (old_id, new_id)
        assert env(pod)["PHALANX_ATTEMPT"] == "1"
    assert store_pod(kubectl, namespace)["metadata"]["uid"] == store_uid  # the store outlives worker failures
    # where the time went: the restart's cost is kept by its cause, from the failure to training again
    spent = state["timeByState"]
    assert (spent["state"], spent.get("cause")) == ("training", None), spent
    assert set(spent["recoveringByCause"]) == {"WorkerFailed"} and spent["recovering"] >= 2, spent  # the 2 s backoff


def test_restart_budget_exhausted_fails_the_job(
    kubectl: Kubectl, kwok_cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    start(kubectl, namespace, failurePolicy={"maxRestarts": 0, "backoffSeconds": 1})
    victim = naming.worker_pod_name(JOB, 1)
    kwok_cluster.finish_pod(namespace, victim, 1, message="AssertionError: loss is NaN")

    state = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Failed", "phase Failed")
    assert_failed(state, "RestartBudgetExhausted")
    assert (state["restarts"], state["restartsByReason"], state["attempt"]) == (1, {"WorkerFailed": 1}, 0)
    assert "maxRestarts (0)" in state["message"] and "loss is NaN" in state["message"], state["message"]
    failed = wait_event(kubectl, namespace, "RestartBudgetExhausted")
    assert failed["type"] == "Warning" and victim in failed["message"]
    wait_no_pods(kubectl, namespace)


# -- failures that are replaced without counting -------------------------------------------------


def test_kubelet_eviction_is_replaced_without_counting(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess
) -> None:
    """A node-pressure eviction: the kubelet fails the pod (reason Evicted, DisruptionTarget)."""
    before = start(kubectl, namespace)
    victim = naming.worker_pod_name(JOB, 1)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    evicted = {
        "status": {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory.",
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": "The node was low on resource: memory.",
                    "lastTransitionTime": now,
                },
                {"type": "Ready", "status": "False", "reason": "PodFailed", "lastTransitionTime": now},
            ],
        }
    }
    kubectl.run(
        "patch", "pod", victim, f"--namespace={namespace}", "--subresource=status", "--type=strategic",
        "-p", json.dumps(evicted),
    )  # fmt: skip

    wait_replaced_alone(kubectl, namespace, before, victim, 0, {"Evicted": 1})
    warning = wait_event(kubectl, namespace, "WorkerEvicted")
    assert (
        warning["type"] == "Warning" and victim in warning["message"] and "TerminationByKubelet" in warning["message"]
    )


def test_eviction_api_replaces_the_worker_without_counting(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess
) -> None:
    """The eviction subresource (what kubectl drain and the descheduler use).

    The API server writes the DisruptionTarget condition, then deletes the pod: two watch events
    milliseconds apart. A pass that runs between them reports the eviction (event WorkerEvicted,
    restartsByReason Evicted); one that only sees the Terminating pod refills the slot silently.
    Either way nothing is counted and only this worker is replaced; both outcomes are asserted.
    """
    before = start(kubectl, namespace)
    victim = naming.worker_pod_name(JOB, 2)
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": victim, "namespace": namespace}}
    kubectl.run(
        "create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{victim}/eviction", "-f", "-",
        input=json.dumps(eviction),
    )  # fmt: skip

    state, _ = wait_replaced_alone(kubectl, namespace, before, victim, 0)
    warnings = [(reason, message) for kind, reason, message in event_summary(kubectl, namespace) if kind == "Warning"]
    by_reason = state.get("restartsByReason") or {}
    if by_reason:
        assert by_reason == {"Evicted": 1}, by_reason
        assert len(warnings) == 1 and warnings[0][0] == "WorkerEvicted", warnings
        assert victim in warnings[0][1] and "EvictionByEvictionAPI" in warnings[0][1], warnings
    else:
        assert warnings == [], warnings


ANTI_AFFINITY = {
    "podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {
                "labelSelector": {"matchLabels": {naming.JOB_NAME_LABEL: JOB, naming.ROLE_LABEL: naming.ROLE_WORKER}},
                "topologyKey": "kubernetes.io/hostname",
            }
        ]
    }
}


# Pods that tolerate a not-ready or unreachable node for ever (as many GPU pods do): the taint
# manager never evicts them, so whatever happens to them is the operator's doing.
TOLERATE_LOST_NODES = [
    {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute"}
    for taint in ("not-ready", "unreachable")
]


def _one_worker_per_node(kubectl: Kubectl, namespace: str) -> tuple[dict[str, dict[str, Any]], str, str]:
    """Run a job with one worker per node of our pool of four (the store follows the nodeSelector);
    returns the workers, and a worker that shares its node with no other pod of the job, and that node."""
    template = {
        "spec": {
            "containers": [TRAINER],
            "nodeSelector": {POOL_LABEL: POOL},
            "affinity": ANTI_AFFINITY,
            "tolerations": TOLERATE_LOST_NODES,
        }
    }
    before = start(kubectl, namespace, template=template)
    store_node = node_of(store_pod(kubectl, namespace))
    victim = next(name for name, pod in sorted(before.items()) if node_of(pod) != store_node)
    return before, victim, node_of(before[victim])


def _wait_replaced_elsewhere(
    kubectl: Kubectl, namespace: str, before: dict[str, dict[str, Any]], victim: str, node: str
) -> dict[str, Any]:
    """Wait until the victim runs again on another node and the job is Running; returns the
    WorkerNodeLost event, after checking that nothing else changed and nothing was counted."""
    after = wait_workers(
        kubectl,
        namespace,
        lambda pods: replaced_and_running(pods, before, victim),
        f"{victim} replaced away from node {node}",
        timeout=60,
    )
    assert node_of(after[victim]) != node
    state = wait_running(kubectl, namespace, 3)
    assert (state["restarts"], state["restartsByReason"], state["attempt"]) == (0, {"NodeLost": 1}, 0), event_summary(
        kubectl, namespace
    )
    assert_healthy(state)
    assert set(attempts(after).values()) == {"0"}
    for name in set(before) - {victim}:
        assert uids(after)[name] == uids(before)[name]
    warning = wait_event(kubectl, namespace, "WorkerNodeLost")
    assert warning["type"] == "Warning" and victim in warning["message"], warning["message"]
    return warning


def test_a_node_ready_blip_changes_nothing(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess, cluster_nodes: LocalCluster
) -> None:
    """A node NotReady for a few seconds (a kubelet restart, a network blip) and Ready again: its
    containers ran on, so no pod is deleted and the gang does not restart."""
    before, _, node = _one_worker_per_node(kubectl, namespace)
    store = store_pod(kubectl, namespace)
    blipped = sorted({node, node_of(store)})  # a worker's node and the store's (which held the whole gang)
    for name in blipped:
        cluster_nodes.set_node_not_ready(name)  # waits until the node reports Ready=False
    time.sleep(NODE_LOST_GRACE_SECONDS / 2)  # the blip lasts, well within the grace
    for name in blipped:
        cluster_nodes.set_node_not_ready(name, not_ready=False)
    after = workers(kubectl, namespace)
    assert uids(after) == uids(before), "a worker was replaced"
    assert not [name for name, pod in after.items() if pod["metadata"].get("deletionTimestamp")]
    assert store_pod(kubectl, namespace)["metadata"]["uid"] == store["metadata"]["uid"]
    state = wait_running(kubectl, namespace, 3)
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 0), event_summary(
        kubectl, namespace
    )
    assert not [reason for _, reason, _ in event_summary(kubectl, namespace) if "NodeLost" in reason]


def test_a_node_not_ready_past_the_grace_has_its_workers_replaced(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess, cluster_nodes: LocalCluster
) -> None:
    before, victim, node = _one_worker_per_node(kubectl, namespace)
    cluster_nodes.set_node_not_ready(node)
    warning = _wait_replaced_elsewhere(kubectl, namespace, before, victim, node)
    found = re.search(rf"is on node {node}, which has not been ready for (\d+)s", warning["message"])
    assert found is not None, warning["message"]
    assert int(found.group(1)) >= NODE_LOST_GRACE_SECONDS  # acted on after the grace, not at the first report


def test_a_deleted_nodes_worker_is_force_deleted_and_replaced(
    kubectl: Kubectl,
    namespace: str,
    running_operator: OperatorProcess,
    cluster_nodes: LocalCluster,
    gpu_nodes: list[str],
) -> None:
    """The Node object is gone: no kubelet will ever stop or confirm its pods, and nothing runs
    there any more, so the operator force-deletes them at once (before the pod garbage collector's
    40 s quarantine) and replaces them."""
    before, victim, node = _one_worker_per_node(kubectl, namespace)
    kubectl.delete("node", node, wait=True)
    try:
        warning = _wait_replaced_elsewhere(kubectl, namespace, before, victim, node)
        assert f"is on node {node}, which was deleted" in warning["message"], warning["message"]
    finally:
        added = cluster_nodes.add_gpu_nodes(1, gpus_per_node=8, labels={POOL_LABEL: POOL}, name_prefix="fail-gpu-")
        assert added == [node], (added, node)  # the pool keeps its names for the tests after this one
        assert node in gpu_nodes


def test_a_gpu_error_keeps_the_jobs_later_pods_off_that_node(
    kubectl: Kubectl,
    namespace: str,
    running_operator: OperatorProcess,
    cluster_nodes: LocalCluster,
    gpu_nodes: list[str],
) -> None:
    """A worker dies of an uncorrectable ECC error: its node is avoided (not cordoned). The job may
    run on two nodes, one worker each: the replacement may not go back to the free node it failed
    on, so the scheduler leaves it Pending, and the job says which node it keeps off and why."""
    allowed = gpu_nodes[:2]
    only_two = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": allowed}]}
    affinity = {
        **ANTI_AFFINITY,
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [only_two]}},
    }
    template = {"spec": {"containers": [TRAINER], "nodeSelector": {POOL_LABEL: POOL}, "affinity": affinity}}
    before = start(kubectl, namespace, desired=2, workers={"min": 1}, template=template)
    victim = naming.worker_pod_name(JOB, 1)
    node = node_of(before[victim])
    message = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    cluster_nodes.finish_pod(namespace, victim, 1, message=message)

    state = wait_status(kubectl, namespace, lambda s: bool(s.get("avoidedNodes")), "a node avoided")
    [avoided] = state["avoidedNodes"]
    assert (avoided["node"], avoided["reason"]) == (node, "GPUError") and message in avoided["message"], avoided
    assert (state["restarts"], state["restartsByReason"]) == (1, {"WorkerFailed": 1})  # a GPU error still counts
    warning = wait_event(kubectl, namespace, "AvoidingNode")
    assert f"keep off node {node} until {avoided['until']} (GPUError)" in warning["message"], warning["message"]

    def replacement_unschedulable(pods: dict[str, dict[str, Any]]) -> bool:
        pod = pods.get(victim)
        return (
            pod is not None
            and pod["metadata"]["uid"] != before[victim]["metadata"]["uid"]
            and any(
                c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                for c in pod.get("status", {}).get("conditions", [])
            )
        )

    after = wait_workers(kubectl, namespace, replacement_unschedulable, f"{victim} replaced and left unscheduled")
    terms = after[victim]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {**only_two, "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": [node]}]}
    ]
    node_object = kubectl.get("node", node)
    assert node_object is not None and node_object["spec"].get("unschedulable") is not True  # never cordoned
    state = wait_status(
        kubectl, namespace, lambda s: "keeps off 1 node(s) after failures" in (s.get("message") or ""), "says so"
    )
    assert f"{node} (GPUError)" in state["message"], state["message"]
    assert (
        after[naming.worker_pod_name(JOB, 0)]["metadata"]["uid"]
        == before[naming.worker_pod_name(JOB, 0)]["metadata"]["uid"]
    )


# -- failures that end the job at once -----------------------------------------------------------


def test_image_pull_error_fails_the_job_fast(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess
) -> None:
    pull_message = 'Back-off pulling image "example/train:1"'
    template = {
        "metadata": {
            "labels": {WAITING_REASON_LABEL: "ImagePullBackOff"},
            "annotations": {WAITING_MESSAGE_ANNOTATION: pull_message},
        },
        "spec": {"containers": [TRAINER]},
    }
    create(kubectl, namespace, template=template)
    state = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Failed", "phase Failed")
    assert_failed(state, "ImagePullFailed")
    assert "ImagePullBackOff" in state["message"] and pull_message in state["message"], state["message"]
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 0)
    failed = wait_event(kubectl, namespace, "ImagePullFailed")
    assert failed["type"] == "Warning" and "ImagePullBackOff" in failed["message"]
    wait_no_pods(kubectl, namespace)
    assert not [r for _, r, _ in event_summary(kubectl, namespace) if r in ("GangRestart", "WorkerFailed")]


def test_pod_refused_by_the_api_server_fails_the_job_fast(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess
) -> None:
    """The CRD keeps the pod template open, so a template the pod API refuses (requests above
    limits) is only found out when the worker is created: fail with the API server's words."""
    trainer = copy.deepcopy(TRAINER)
    trainer["resources"] = {"requests": {"cpu": "8"}, "limits": {"cpu": "4"}}
    create(kubectl, namespace, template={"spec": {"containers": [trainer]}})
    state = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Failed", "phase Failed")
    assert_failed(state, "PodRefused")
    assert "demo-worker-" in state["message"] and "must be less than or equal to cpu limit" in state["message"], state[
        "message"
    ]
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 0)
    refused = wait_event(kubectl, namespace, "PodRefused")
    assert refused["type"] == "Warning" and "demo-worker-" in refused["message"]
    wait_no_pods(kubectl, namespace)


def test_active_deadline_fails_the_job(kubectl: Kubectl, namespace: str, running_operator: OperatorProcess) -> None:
    start(kubectl, namespace, activeDeadlineSeconds=4)
    state = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Failed", "phase Failed", timeout=20)
    assert_failed(state, "DeadlineExceeded")
    assert "activeDeadlineSeconds (4)" in state["message"]
    assert (state["restarts"], state["attempt"]) == (0, 0)
    assert state["completionTime"] >= state["startTime"]
    elapsed = _seconds(state["completionTime"]) - _seconds(state["startTime"])
    assert 4 <= elapsed <= 10, elapsed
    failed = wait_event(kubectl, namespace, "DeadlineExceeded")
    assert failed["type"] == "Warning"
    wait_no_pods(kubectl, namespace)


def test_a_resumed_job_gets_its_whole_active_deadline_again(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess
) -> None:
    """batch/v1 restarts the deadline's clock when a suspended Job resumes: a job suspended past its
    activeDeadlineSeconds trains again when resumed, and fails only a whole deadline after that."""
    deadline = 12
    start(kubectl, namespace, activeDeadlineSeconds=deadline)
    first_start = status(kubectl, namespace)["startTime"]
    kubectl.run("patch", "tj", JOB, f"--namespace={namespace}", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_status(kubectl, namespace, lambda s: s.get("phase") == "Suspended", "phase Suspended")
    wait_no_pods(kubectl, namespace)
    time.sleep(max(0.0, _seconds(first_start) + deadline + 1 - time.time()))  # suspended past the deadline
    kubectl.run("patch", "tj", JOB, f"--namespace={namespace}", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    state = wait_status(
        kubectl, namespace, lambda s: s.get("phase") in ("Running", "Failed"), "Running again (or Failed)", timeout=30
    )
    assert state["phase"] == "Running" and state["attempt"] == 1, state
    assert state["startTime"] > first_start, state
    state = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Failed", "phase Failed", timeout=30)
    assert_failed(state, "DeadlineExceeded")
    assert _seconds(state["completionTime"]) - _seconds(state["startTime"]) >= deadline


def test_a_worker_that_exits_0_while_it_is_evicted_is_no_success(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess
) -> None:
    """A drain of a static-launcher job whose script exits 0 on SIGTERM: the exit is the eviction's
    doing, not the end of training, so the job restarts its fixed world instead of ending Succeeded.
    The operator is busy (paused) while it happens, so its next pass sees the eviction and the exit
    together, as a loaded operator would."""
    template = {"metadata": {"annotations": {STOP_EXIT_CODE_ANNOTATION: "0"}}, "spec": {"containers": [TRAINER]}}
    start(kubectl, namespace, desired=2, workers={"min": 2, "max": 2}, launcher="static", template=template)
    victim = naming.worker_pod_name(JOB, 0)
    hold(kubectl, namespace, victim)  # it stays, Succeeded and Terminating, for every pass to see
    running_operator.pause()
    try:
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": victim, "namespace": namespace}}
        kubectl.run(
            "create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{victim}/eviction", "-f", "-",
            input=json.dumps(eviction),
        )  # fmt: skip
        kubectl.wait_for(
            lambda: (
                (pod := kubectl.get("pod", victim, namespace)) is not None
                and pod["status"].get("phase") == "Succeeded"
                and pod["metadata"].get("deletionTimestamp")
            ),
            timeout=20,
            what=f"{victim} exited 0 while evicted",
        )
        running_operator.resume()
        state = wait_status(
            kubectl,
            namespace,
            lambda s: s.get("attempt") == 1 or s.get("phase") == "Succeeded",
            "the job's answer to the drain",
        )
        assert state["phase"] != "Succeeded", state
        assert state["restarts"] == 0, state
    finally:
        running_operator.resume()
        hold(kubectl, namespace, victim, held=False)
    state = wait_running(kubectl, namespace, 2)
    assert (state["attempt"], state["restarts"]) == (1, 0), state


def _seconds(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))


# -- changes made by people ----------------------------------------------------------------------


def test_rescale_adds_and_removes_highest_workers_and_leaves_the_rest_running(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess
) -> None:
    before = start(kubectl, namespace)
    kubectl.run("scale", f"tj/{JOB}", f"--namespace={namespace}", "--replicas=4")
    four = {naming.worker_pod_name(JOB, i) for i in range(4)}
    up = wait_workers(kubectl, namespace, lambda p: running_and_ready(p, four), "4 running workers")
    state = wait_running(kubectl, namespace, 4)
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 0)
    assert state["replicas"] == 4 and state["workers"]["desired"] == 4
    assert_healthy(state)
    assert {name: uids(up)[name] for name in before} == uids(before)
    assert set(attempts(up).values()) == {"0"}
    assert wait_event(kubectl, namespace, "Rescaling", "from 3 to 4")["type"] == "Normal"

    kubectl.run("scale", f"tj/{JOB}", f"--namespace={namespace}", "--replicas=2")
    two = {naming.worker_pod_name(JOB, i) for i in range(2)}
    down = wait_workers(kubectl, namespace, lambda p: running_and_ready(p, two), "only workers 0 and 1")
    state = wait_running(kubectl, namespace, 2)
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 0)
    assert state["replicas"] == 2
    assert_healthy(state)
    assert uids(down) == {name: uids(before)[name] for name in two}
    assert wait_event(kubectl, namespace, "Rescaling", "from 4 to 2")["type"] == "Normal"
    assert not [r for t, r, _ in event_summary(kubectl, namespace) if t == "Warning"]


def test_deleting_pods_by_hand_never_resets_the_restart_count(
    kubectl: Kubectl, kwok_cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    # deleted workers stay Terminating for a moment, as real ones do while they shut down
    template = {"metadata": {"annotations": {DELETE_DELAY_ANNOTATION: "1s"}}, "spec": {"containers": [TRAINER]}}
    before = start(kubectl, namespace, template=template)
    first, last = naming.worker_pod_name(JOB, 0), naming.worker_pod_name(JOB, 2)
    kwok_cluster.finish_pod(namespace, first, 1)
    wait_status(kubectl, namespace, lambda s: s.get("restarts") == 1, "restarts 1")
    replaced = wait_workers(kubectl, namespace, lambda p: replaced_and_running(p, before, first), "worker 0 replaced")
    wait_running(kubectl, namespace, 3)

    # one worker deleted by hand, enough survivors: its slot is refilled in the same attempt, uncounted
    kubectl.delete("pod", last, namespace, wait=False)
    refilled = wait_workers(kubectl, namespace, lambda p: replaced_and_running(p, replaced, last), "worker 2 refilled")
    state = wait_running(kubectl, namespace, 3)
    assert (state["restarts"], state["restartsByReason"], state["attempt"]) == (1, {"WorkerFailed": 1}, 0)
    assert set(attempts(refilled).values()) == {"0"}

    # every worker deleted by hand: too few survivors, the gang restarts uncounted
    kubectl.run("delete", "pod", *sorted(refilled), f"--namespace={namespace}", "--wait=false")
    again = wait_workers(
        kubectl,
        namespace,
        lambda p: running_and_ready(p, set(before)) and set(attempts(p).values()) == {"1"},
        "all three workers recreated as attempt 1",
    )
    assert not set(uids(again).values()) & set(uids(refilled).values())
    state = wait_running(kubectl, namespace, 3)
    assert (state["restarts"], state["restartsByReason"], state["attempt"]) == (
        1,
        {"WorkerFailed": 1, "WorkersDeleted": 1},
        1,
    )
    restart = wait_event(kubectl, namespace, "GangRestart", "attempt 1")
    assert restart["type"] == "Warning" and "deleted" in restart["message"], restart["message"]

    # losing the rendezvous store restarts the gang, uncounted; the budget stays spent. KWOK removes
    # a stopped pod by name (v0.7.0 sets no UID precondition, a kubelet does): on a loaded host its
    # late delete of the old store can take the new one too, which is one more store loss
    kubectl.delete("pod", naming.rendezvous_name(JOB), namespace, wait=False)
    wait_workers(
        kubectl,
        namespace,
        lambda p: (
            running_and_ready(p, set(before))
            and len(set(attempts(p).values())) == 1
            and "1" not in attempts(p).values()
        ),
        "the gang restarted as attempt 2",
    )
    state = wait_running(kubectl, namespace, 3)
    lost = state["restartsByReason"].get("RendezvousStoreLost", 0)
    assert lost in (1, 2), event_summary(kubectl, namespace)
    assert (state["restarts"], state["restartsByReason"], state["attempt"]) == (
        1,
        {"RendezvousStoreLost": lost, "WorkerFailed": 1, "WorkersDeleted": 1},
        1 + lost,
    ), event_summary(kubectl, namespace)
    restarts = [m for _, r, m in event_summary(kubectl, namespace) if r == "GangRestart"]
    assert any("rendezvous store" in m and "attempt 2" in m for m in restarts), restarts


def test_suspend_stops_every_pod_and_resume_starts_a_new_attempt_without_counting(
    kubectl: Kubectl, namespace: str, running_operator: OperatorProcess
) -> None:
    before = start(kubectl, namespace)
    kubectl.run("patch", "tj", JOB, f"--namespace={namespace}", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    state = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Suspended", "phase Suspended")
    got = conditions(state)
    assert (
        got["Suspended"] == ("True", "Suspended")
        and got["Ready"] == ("True", "Suspended")
        and got["Stalled"][0] == "False"
    )
    wait_no_pods(kubectl, namespace)
    state = status(kubectl, namespace)
    assert state["phase"] == "Suspended" and state["replicas"] == 0
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 0)
    assert wait_event(kubectl, namespace, "Suspended")["type"] == "Normal"

    kubectl.run("patch", "tj", JOB, f"--namespace={namespace}", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    after = wait_workers(
        kubectl,
        namespace,
        lambda p: running_and_ready(p, set(before)) and set(attempts(p).values()) == {"1"},
        "three workers of attempt 1",
    )
    state = wait_running(kubectl, namespace, 3)
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 1)
    assert conditions(state)["Suspended"][0] == "False"
    assert_healthy(state)
    assert not set(uids(after).values()) & set(uids(before).values())
    assert all(env(pod)["PET_RDZV_ID"].endswith("-1") for pod in after.values())  # type: ignore[union-attr]
    resumed = wait_event(kubectl, namespace, "Resumed")
    assert resumed["type"] == "Normal" and "attempt 1" in resumed["message"]
