"""Faults and ordinary cluster policy on the real control plane: quotas, containers that cannot
start, operator kills at exact moments, restarts, relists after ``410 Gone``, names held by other
owners, hostile metrics endpoints, a missing gang scheduler API, specs from a newer CRD, lost
responses. Each test breaks one thing the way a cluster does and checks that no job is lost,
failed wrongly or counted twice.

The operator runs under the chart's RBAC and reaches the API server through a fault proxy
(tests/cluster/faultproxy.py), which can kill it right after a chosen request, delay requests,
drop responses and cut watches.
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from phalanx.api import crd
from phalanx.reconcile import naming
from tests.cluster.faultproxy import FaultProxy, Request
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.chart_identity import chart_identity
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import (
    GPU_JOB,
    JOB,
    TRAINER,
    conditions,
    create,
    event_summary,
    events,
    hold,
    metric,
    replaced_and_running,
    running_and_ready,
    start,
    status,
    uids,
    wait_event,
    wait_running,
    wait_status,
    wait_workers,
    workers,
)
from tests.unit.jobs import manifest
from tests.unit.text_page import TextPage

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOOPBACK_TAINT = {"key": "phalanx.dev/loopback", "value": "true", "effect": "NoSchedule"}
LOOPBACK_POOL = "loopback"
LOOPBACK_POD_CIDR = "127.78.0.1/24"
POOL_LABEL = "phalanx.dev/test-pool"


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fault_nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    """Four 8-GPU KWOK nodes of this module's own (other modules break theirs on purpose)."""
    names = [n["metadata"]["name"] for n in kubectl.list("nodes", selector=f"{POOL_LABEL}=faults")]
    if len(names) < 4:
        names += kwok_cluster.add_gpu_nodes(4 - len(names), labels={POOL_LABEL: "faults"}, name_prefix="faults-gpu-")
    kwok_cluster.wait_nodes_ready(names)
    return names


@pytest.fixture
def proxy(kwok_cluster: LocalCluster) -> Iterator[FaultProxy]:
    with FaultProxy(kwok_cluster.server, kwok_cluster.server_ca) as running:
        yield running


OPERATOR_ENV = {"PHALANX_PROGRESS_INTERVAL_SECONDS": "1", "PHALANX_ABSENT_API_RECHECK_SECONDS": "1"}


@pytest.fixture
def operator(
    crds: list[str],
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    namespace: str,
    tmp_path: pathlib.Path,
    proxy: FaultProxy,
    fault_nodes: list[str],
) -> Iterator[OperatorProcess]:
    """The operator under the chart's identity, talking to the API server through ``proxy``."""
    with chart_identity(kubectl, kubeconfig, namespace, f"phx-{uuid.uuid4().hex[:6]}", tmp_path) as identity:
        via = proxy.kubeconfig(identity, tmp_path / "via-proxy.kubeconfig")
        process = OperatorProcess(via, tmp_path / "operator.log", namespace=namespace, extra_env=OPERATOR_ENV)
        with process:
            yield process
            process.check_alive()
        print(f"--- operator log (tail) ---\n{process.log_tail(80)}")
    assert process.exited_on_its_own == [], "the operator exited by itself"
    assert "Traceback" not in process.log(), "the operator logged a traceback"


def sigkill_from_proxy(operator: OperatorProcess, killed: threading.Event) -> Callable[[Request], None]:
    """A proxy callback that SIGKILLs the operator at once (the response it waits for never comes)."""

    def kill(request: Request) -> None:
        operator.kill(wait=False)
        killed.set()

    return kill


def job_status_write(request: Request) -> bool:
    return request.status_write and request.path.endswith(f"/trainingjobs/{JOB}/status")


# -- 2: quota refusals ---------------------------------------------------------------------------


def test_a_quota_refusal_is_explained_paced_and_retried_as_soon_as_quota_frees(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "pods-limit"},
            "spec": {"hard": {"pods": "4"}},
        },
        namespace=namespace,
    )
    # A small job holds two pods (store and one worker) of the quota's four.
    small = manifest(**{**copy.deepcopy(GPU_JOB), "workers": {"min": 1, "max": 1, "desired": 1}})
    small["metadata"] = {"name": "small"}
    kubectl.create(small, namespace=namespace)
    wait_status(kubectl, namespace, lambda s: s.get("phase") == "Running", "small Running", name="small")
    create(kubectl, namespace, workers={"min": 2, "max": 4, "desired": 2})
    state = wait_status(kubectl, namespace, lambda s: s.get("reason") == "QuotaExceeded", "reason QuotaExceeded")
    assert state["phase"] in ("Pending", "Starting"), state
    assert "exceeded quota: pods-limit" in state["message"], state["message"]
    # The store comes first (the quota's third pod), then the workers: one of them fits, and the
    # refused one leaves a partial gang.
    assert "1 of the 2 worker(s) it needs (workers.min)" in state["message"], state["message"]
    assert conditions(state)["Stalled"] == ("True", "QuotaExceeded")
    assert conditions(state)["Failed"][0] == "False"
    warning = wait_event(kubectl, namespace, "QuotaExceeded", "creating Pod")
    assert warning["type"] == "Warning" and "exceeded quota: pods-limit" in warning["message"]
    kubectl.wait_for(
        lambda: operator.log().count("refused (QuotaExceeded)") >= 3, timeout=40, what="three paced retries"
    )
    # Paced: 2 s, 5 s, 10 s apart, not a retry per watch event or per second.
    assert operator.log().count("refused (QuotaExceeded)") <= 5, operator.log()
    told = [m for _, r, m in event_summary(kubectl, namespace) if r == "QuotaExceeded" and " -> " not in m]
    assert len(told) == 1, told  # told once (a phase change may name the reason too), not at every retry

    # Suspending the small job stops its pods: quota frees, and the refused worker is created at
    # once (not after the 30 s pause now due).
    kubectl.run("patch", "tj", "small", f"--namespace={namespace}", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    state = wait_running(kubectl, namespace, 2, timeout=20)  # retried at once, not after 30 s
    assert conditions(state)["Stalled"][0] == "False"
    assert (state["restarts"], state.get("restartsByReason") or {}) == (0, {})


def refused_creations(operator: OperatorProcess) -> int:
    """Pod creations the API server refused for the quota: the operator logs each one."""
    return operator.log().count("refused (QuotaExceeded)")


def test_a_quota_blocked_job_retries_with_one_probe_and_ramps_up_when_it_passes(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    """A job of 24 workers in a namespace whose quota holds 3 pods: its first pass tries every
    worker, then each retry is one probe request (not every refused worker again), and once the
    quota is raised the creations double until all are in."""
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "pods-limit"}}
    kubectl.create({**quota, "spec": {"hard": {"pods": "3"}}}, namespace=namespace)
    create(kubectl, namespace, workers={"min": 2, "max": 24, "desired": 24})
    wait_status(kubectl, namespace, lambda s: s.get("reason") == "QuotaExceeded", "reason QuotaExceeded")
    kubectl.wait_for(lambda: refused_creations(operator) >= 22, timeout=20, what="the first pass's 22 refusals")
    first = refused_creations(operator)
    assert first == 22, operator.log()  # store and 2 workers fit; each other worker tried once
    # three retries (after 2, 5 and 10 s), one request each: before, each re-POSTed all 22
    kubectl.wait_for(lambda: refused_creations(operator) >= first + 3, timeout=40, what="three retries")
    assert refused_creations(operator) <= first + 4, refused_creations(operator) - first
    kubectl.run(
        "patch", "resourcequota", "pods-limit", f"--namespace={namespace}", "--type=merge",
        "-p", json.dumps({"spec": {"hard": {"pods": "100"}}}),
    )  # fmt: skip
    kubectl.wait_for(
        lambda: len(workers(kubectl, namespace)) == 24, timeout=90, what="every worker once the quota is raised"
    )
    assert refused_creations(operator) <= first + 6, refused_creations(operator) - first
    state = status(kubectl, namespace)
    assert (state["restarts"], state.get("restartsByReason") or {}) == (0, {})


# -- 3: containers that cannot start -------------------------------------------------------------


def test_a_container_that_cannot_start_fails_the_job_at_once_with_the_runtimes_message(
    kubectl: Kubectl, kwok_cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    start(kubectl, namespace)
    message = 'exec: "python": executable file not found in $PATH: unknown'
    kwok_cluster.finish_pod(namespace, naming.worker_pod_name(JOB, 0), 128, reason="StartError", message=message)
    state = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Failed", "phase Failed")
    assert state["reason"] == "InvalidPodConfiguration", state
    assert "StartError" in state["message"] and message in state["message"], state["message"]
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 0)
    assert not [r for _, r, _ in event_summary(kubectl, namespace) if r in ("GangRestart", "WorkerFailed")]


# -- 4: exactly-once counting --------------------------------------------------------------------


def test_failures_are_counted_once_when_the_operator_dies_right_after_recording_them(
    kubectl: Kubectl, kwok_cluster: LocalCluster, namespace: str, operator: OperatorProcess, proxy: FaultProxy
) -> None:
    before = start(kubectl, namespace, failurePolicy={"maxRestarts": 10, "backoffSeconds": 1})
    for failure in range(1, 6):
        victim = naming.worker_pod_name(JOB, failure % 3)
        killed = threading.Event()
        proxy.after(job_status_write, sigkill_from_proxy(operator, killed))
        kwok_cluster.finish_pod(namespace, victim, 1, message=f"RuntimeError: failure {failure}")
        assert killed.wait(30), "no status write after the failure"
        # The status that counts the failure is stored; the operator died before deleting the pod.
        stored = status(kubectl, namespace)
        assert stored["restarts"] == failure, stored
        assert (workers(kubectl, namespace)[victim]["status"]["phase"]) == "Failed"
        operator.restart()
        replaced = functools.partial(replaced_and_running, before=before, victim=victim)
        after = wait_workers(kubectl, namespace, replaced, f"{victim} replaced")
        state = wait_running(kubectl, namespace, 3)
        assert (state["restarts"], state["restartsByReason"]) == (failure, {"WorkerFailed": failure}), state
        assert "countedFailures" not in state or uids(before)[victim] not in state["countedFailures"]
        before = after
    assert (operator.kills, operator.starts) == (5, 6)


# -- 5: no plan before the caches are synced -----------------------------------------------------


def test_an_operator_restart_never_plans_from_caches_that_have_not_been_listed(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, proxy: FaultProxy
) -> None:
    before = start(kubectl, namespace)
    seen_events = len(events(kubectl, namespace))
    operator.kill()
    # After the restart the pod list arrives 3 s after the TrainingJob list.
    proxy.delay(lambda r: r.verb == "list" and r.resource == "pods", 3.0)
    operator.start()
    phases = set()

    def first_pass_after_sync() -> bool:
        phases.add(status(kubectl, namespace).get("phase"))
        text = operator.metrics()
        synced = metric(text, "phalanx_watch_synced", resource="pods.v1") == 1.0
        passes = metric(text, "controller_runtime_reconcile_total", controller="trainingjob", result="success")
        return synced and (passes or 0) >= 1

    kubectl.wait_for(first_pass_after_sync, timeout=30, what="a pass after the pod watch synced")
    phases.add(status(kubectl, namespace).get("phase"))
    assert phases == {"Running"}, phases
    assert uids(workers(kubectl, namespace)) == uids(before)  # nothing recreated, nothing refused
    later = event_summary(kubectl, namespace)[seen_events:]
    assert not later, later


def test_an_operator_restart_during_the_gang_restart_backoff_resumes_the_new_attempt(
    kubectl: Kubectl, kwok_cluster: LocalCluster, namespace: str, operator: OperatorProcess, proxy: FaultProxy
) -> None:
    start(kubectl, namespace, desired=2, failurePolicy={"maxRestarts": 3, "backoffSeconds": 4})
    kwok_cluster.finish_pod(namespace, naming.worker_pod_name(JOB, 0), 1)
    wait_status(kubectl, namespace, lambda s: s.get("attempt") == 1 and s.get("reason") == "Backoff", "backoff")
    operator.kill()
    proxy.delay(lambda r: r.verb == "list" and r.resource == "pods", 3.0)
    operator.start()
    wait_workers(
        kubectl,
        namespace,
        lambda p: (
            running_and_ready(p, {naming.worker_pod_name(JOB, i) for i in range(2)})
            and {pod["metadata"]["labels"][naming.ATTEMPT_LABEL] for pod in p.values()} == {"1"}
        ),
        "two workers of attempt 1",
    )
    state = wait_running(kubectl, namespace, 2)
    assert (state["attempt"], state["restarts"]) == (1, 1), state
    assert "PodRefused" not in [r for _, r, _ in event_summary(kubectl, namespace)]


# -- 6: children by owner UID --------------------------------------------------------------------


def test_a_job_created_again_under_the_same_name_never_takes_its_predecessors_pods(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    old = start(kubectl, namespace)
    for name in old:
        hold(kubectl, namespace, name)
    try:
        kubectl.delete("tj", JOB, namespace, wait=False)
        kubectl.wait_for(
            lambda: all(p["metadata"].get("deletionTimestamp") for p in workers(kubectl, namespace).values()),
            timeout=30,
            what="the old workers being deleted by the garbage collector",
        )
        create(kubectl, namespace)
        state = wait_status(kubectl, namespace, lambda s: s.get("reason") == "NameConflict", "reason NameConflict")
        assert conditions(state)["Stalled"] == ("True", "NameConflict")
        assert state["workers"]["active"] == 0, state  # the old pods are not counted as this job's
        assert set(uids(workers(kubectl, namespace)).values()) == set(uids(old).values())
    finally:
        for name in old:
            hold(kubectl, namespace, name, held=False)
    new = wait_workers(
        kubectl,
        namespace,
        lambda p: running_and_ready(p, set(old)) and not set(uids(p).values()) & set(uids(old).values()),
        "three new workers",
    )
    job = kubectl.get("tj", JOB, namespace)
    assert job is not None
    assert {pod["metadata"]["ownerReferences"][0]["uid"] for pod in new.values()} == {job["metadata"]["uid"]}
    state = wait_running(kubectl, namespace, 3)
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 0)


def test_a_job_created_again_while_its_predecessors_store_terminates_starts_without_a_restart(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    """The old store pod (held Terminating by a finalizer, as a slow kubelet would) keeps the store's
    name: the new job creates no worker until its own store exists, and does not take the store it
    never had for a lost one (before: attempt 1, RendezvousStoreLost)."""
    start(kubectl, namespace)
    store = naming.rendezvous_name(JOB)
    hold(kubectl, namespace, store)
    try:
        kubectl.delete("tj", JOB, namespace, wait=True)  # the TrainingJob is gone; its pods terminate
        kubectl.wait_for(lambda: not workers(kubectl, namespace), timeout=30, what="the old workers gone")
        create(kubectl, namespace)
        state = wait_status(kubectl, namespace, lambda s: s.get("reason") == "NameConflict", "reason NameConflict")
        assert f"Pod {store}" in state["message"], state["message"]
        assert workers(kubectl, namespace) == {}, "workers created before the job's own store exists"
    finally:
        hold(kubectl, namespace, store, held=False)
    state = wait_running(kubectl, namespace, 3)
    assert (state["restarts"], state.get("restartsByReason") or {}, state["attempt"]) == (0, {}, 0), event_summary(
        kubectl, namespace
    )
    job = kubectl.get("tj", JOB, namespace)
    assert job is not None
    owner = kubectl.get("pod", store, namespace)
    assert owner is not None and owner["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]


def test_a_foreign_pod_with_a_workers_name_is_left_alone_and_reported(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    squatter = naming.worker_pod_name(JOB, 1)
    kubectl.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": squatter, "labels": {"app": "someone-else"}},
            "spec": {"containers": [{"name": "main", "image": "example/other:1"}]},
        },
        namespace=namespace,
    )
    foreign = kubectl.get("pod", squatter, namespace)
    assert foreign is not None
    create(kubectl, namespace)
    state = wait_status(kubectl, namespace, lambda s: s.get("reason") == "NameConflict", "reason NameConflict")
    assert squatter in state["message"] and "controlled by no TrainingJob" in state["message"], state["message"]
    assert wait_event(kubectl, namespace, "NameConflict")["type"] == "Warning"
    untouched = kubectl.get("pod", squatter, namespace)
    assert untouched is not None
    assert untouched["metadata"]["uid"] == foreign["metadata"]["uid"]
    assert untouched["metadata"].get("ownerReferences") is None
    assert untouched["metadata"]["labels"] == {"app": "someone-else"}
    kubectl.delete("pod", squatter, namespace)
    wait_running(kubectl, namespace, 3, timeout=90)  # retried at its paced interval


# -- 7: hostile metrics endpoints ----------------------------------------------------------------


@pytest.fixture(scope="module")
def loopback_nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    """KWOK nodes that give pods loopback addresses (``LOOPBACK_POD_CIDR``): a pod on them is
    reachable at a port this test serves on every local address (the operator never scrapes a
    host-network pod, which would be its node's port)."""
    names = [n["metadata"]["name"] for n in kubectl.list("nodes", selector=f"{POOL_LABEL}={LOOPBACK_POOL}")]
    if len(names) < 2:
        names += kwok_cluster.add_gpu_nodes(
            2 - len(names),
            labels={POOL_LABEL: LOOPBACK_POOL},
            name_prefix="loopback-gpu-",
            taints=[LOOPBACK_TAINT],
            pod_cidr=LOOPBACK_POD_CIDR,
        )
    return names


def loopback_job(kubectl: Kubectl, namespace: str, name: str, port: int) -> None:
    trainer = {**copy.deepcopy(TRAINER), "env": [{"name": "PHALANX_WORKER_METRICS_PORT", "value": str(port)}]}
    body = manifest(
        **{
            **copy.deepcopy(GPU_JOB),
            "workers": {"min": 1, "max": 1, "desired": 1},
            "template": {
                "spec": {
                    "nodeSelector": {POOL_LABEL: LOOPBACK_POOL},
                    "tolerations": [{"key": LOOPBACK_TAINT["key"], "operator": "Exists"}],
                    "containers": [trainer],
                }
            },
        }
    )
    body["metadata"] = {"name": name}
    kubectl.create(body, namespace=namespace)


def reports_world_size(state: dict[str, Any], size: int) -> bool:
    return bool((state.get("workers") or {}).get("worldSize") == size)


def world_size_page(size: int) -> str:
    return f"phalanx_worker_world_size {size}\nphalanx_worker_last_checkpoint_timestamp_seconds 0\n"


def test_one_pod_serving_absurd_metrics_never_stops_progress_for_the_others(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, loopback_nodes: list[str]
) -> None:
    good, bad = (TextPage(world_size_page(size), host="0.0.0.0") for size in (2, 1))
    try:
        loopback_job(kubectl, namespace, "good", good.port)
        loopback_job(kubectl, namespace, "bad", bad.port)
        for name, size in (("good", 2), ("bad", 1)):
            wait_status(
                kubectl,
                namespace,
                functools.partial(reports_world_size, size=size),
                f"{name} reports world size {size}",
                name=name,
            )
        bad.text = "phalanx_worker_world_size +Inf\nphalanx_worker_last_checkpoint_timestamp_seconds 1e300\n"
        kubectl.wait_for(
            lambda: "worldSize" not in ((status(kubectl, namespace, "bad").get("workers")) or {}),
            timeout=20,
            what="the bad job's world size dropped",
        )
        good.text = world_size_page(3)  # later progress of another job still arrives
        wait_status(
            kubectl, namespace, lambda s: (s.get("workers") or {}).get("worldSize") == 3, "good at 3", name="good"
        )
        assert status(kubectl, namespace, "bad")["phase"] == "Running"
    finally:
        good.close()
        bad.close()


# -- 8: relists converge -------------------------------------------------------------------------


def test_pods_deleted_while_the_operator_was_not_watching_are_forgotten_after_the_relist(
    kubectl: Kubectl, control_plane: LocalCluster, namespace: str, proxy: FaultProxy, operator: OperatorProcess
) -> None:
    before = start(kubectl, namespace)
    victim = naming.worker_pod_name(JOB, 2)
    operator.pause()
    # A stopped process's sockets still take in events; ending its streams makes sure it never sees the deletion.
    proxy.cut_watches()
    try:
        kubectl.run("delete", "pod", victim, f"--namespace={namespace}", "--grace-period=0", "--force")
        kubectl.wait_for(lambda: victim not in workers(kubectl, namespace), timeout=30, what=f"{victim} gone")
        control_plane.compact_etcd()
        control_plane.restart_apiserver()  # its watch cache starts after the deletion: 410 Gone for old versions
    finally:
        operator.resume()
    wait_workers(
        kubectl, namespace, lambda p: replaced_and_running(p, before, victim), f"{victim} refilled", timeout=60
    )
    state = wait_running(kubectl, namespace, 3)
    assert (state["restarts"], state["attempt"]) == (0, 0), state
    relists = metric(operator.metrics(), "phalanx_watch_relists_total", resource="pods.v1")
    assert relists is not None and relists >= 1, operator.metrics()


# -- 9: a gang scheduler API that is not installed -----------------------------------------------


def test_a_gang_scheduler_whose_api_is_missing_stalls_the_job_until_it_is_installed(
    kubectl: Kubectl, namespace: str, proxy: FaultProxy, operator: OperatorProcess, request: pytest.FixtureRequest
) -> None:
    """The tiers install the coscheduling API only: Volcano's comes in the middle of this test."""
    create(kubectl, namespace, gang={"scheduler": "volcano"})
    state = wait_status(
        kubectl, namespace, lambda s: s.get("reason") == "GangSchedulerUnavailable", "reason GangSchedulerUnavailable"
    )
    assert state["phase"] == "Pending"
    assert "scheduling.volcano.sh/v1beta1" in state["message"] and "not served" in state["message"], state
    assert conditions(state)["Stalled"] == ("True", "GangSchedulerUnavailable")
    assert wait_event(kubectl, namespace, "GangSchedulerUnavailable")["type"] == "Warning"
    assert workers(kubectl, namespace) == {}
    written = {verb for (verb, resource) in proxy.requests if resource == "podgroups" and verb != "list"}
    assert written <= {"watch"}, proxy.requests  # only looked for, never written to

    request.getfixturevalue("volcano_api")  # installed now, removed after the test
    kubectl.wait_for(
        lambda: kubectl.get("podgroups.scheduling.volcano.sh", JOB, namespace), timeout=30, what="the PodGroup"
    )
    kubectl.wait_for(lambda: len(workers(kubectl, namespace)) == 3, timeout=30, what="three workers")
    state = wait_status(kubectl, namespace, lambda s: conditions(s)["Stalled"][0] == "False", "not Stalled")
    assert state["reason"] != "GangSchedulerUnavailable"


# -- 10: a body the operator cannot parse --------------------------------------------------------


@pytest.fixture
def newer_crd(kubectl: Kubectl, crds: list[str]) -> Iterator[None]:
    """The TrainingJob CRD of a later version, with a field this operator does not know."""
    definition = yaml.safe_load((ROOT / "crds" / crd.CRD_FILE).read_text())
    newer = copy.deepcopy(definition)
    schema = newer["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    schema["properties"]["priority"] = {"type": "string", "description": "added in a later version"}
    kubectl.apply(newer)
    try:
        yield
    finally:
        kubectl.apply(definition)


def test_a_job_from_a_newer_crd_is_stalled_and_its_pods_keep_running(
    kubectl: Kubectl, namespace: str, newer_crd: None, operator: OperatorProcess
) -> None:
    before = start(kubectl, namespace)
    kubectl.run("patch", "tj", JOB, f"--namespace={namespace}", "--type=merge", "-p", '{"spec":{"priority":"high"}}')
    state = wait_status(kubectl, namespace, lambda s: conditions(s)["Stalled"] == ("True", "InvalidSpec"), "Stalled")
    assert state["phase"] == "Running" and "completionTime" not in state, state
    stalled = next(c for c in state["conditions"] if c["type"] == "Stalled")
    assert "priority" in stalled["message"], stalled
    assert wait_event(kubectl, namespace, "InvalidSpec")["type"] == "Warning"
    assert uids(workers(kubectl, namespace)) == uids(before)
    # An operator that understands the job again carries on with the same pods.
    kubectl.run("patch", "tj", JOB, f"--namespace={namespace}", "--type=merge", "-p", '{"spec":{"priority":null}}')
    state = wait_status(kubectl, namespace, lambda s: conditions(s)["Stalled"][0] == "False", "not Stalled")
    assert state["phase"] == "Running"
    assert uids(workers(kubectl, namespace)) == uids(before)


# -- 11: lost responses --------------------------------------------------------------------------


def test_an_event_whose_response_was_lost_is_sent_once(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, proxy: FaultProxy
) -> None:
    proxy.lose_response(lambda r: r.method == "POST" and r.resource == "events")
    start(kubectl, namespace)
    assert len(proxy.lost) == 1
    recorded = event_summary(kubectl, namespace)
    reasons = [r for _, r, _ in recorded]
    assert len(reasons) == len(set(reasons)), reasons  # the lost one is there once
    # A POST may have been acted on (this one was): it is never sent a second time.
    assert proxy.requests[("create", "events")] == len(recorded), (proxy.requests, recorded)
