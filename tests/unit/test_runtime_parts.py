"""The operator's in-memory parts: work queue, caches, the worker's backend choice, the CLI."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import pytest

from phalanx import cli
from phalanx.api.v1alpha1 import TrainingJob
from phalanx.cli.run import node_options, watch_scope
from phalanx.cluster.cache import ChildCache, JobCache, NodeCache, NodeRequests, RecentlyDeleted, WorkloadCache
from phalanx.cluster.client import resource_path
from phalanx.cluster.observe import observe_job
from phalanx.cluster.workqueue import WorkQueue
from phalanx.handlers.runtime import Runtime
from phalanx.handlers.settings import Settings
from phalanx.reconcile import capacity, naming
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.observed import QueuedWorkload
from phalanx.worker import choose_backend
from tests.unit import jobs


async def test_queue_coalesces_and_never_runs_a_key_twice_at_once() -> None:
    running: set[str] = set()
    seen: list[str] = []
    gate = asyncio.Event()

    async def handle(key: str) -> float | None:
        assert key not in running
        running.add(key)
        seen.append(key)
        await gate.wait()
        running.discard(key)
        return None

    queue: WorkQueue[str] = WorkQueue(handle, workers=4)
    queue.start()
    for _ in range(5):
        queue.enqueue("a")
    queue.enqueue("b")
    await asyncio.sleep(0.01)
    queue.enqueue("a")  # while running: marks dirty, runs once more afterwards
    gate.set()
    await asyncio.wait_for(queue.idle.wait(), 2)
    await queue.stop()
    assert sorted(seen) == ["a", "a", "b"]


async def test_queue_requeues_after_the_delay_a_pass_asks_for_and_retries_errors() -> None:
    calls: list[str] = []

    async def handle(key: str) -> float | None:
        calls.append(key)
        if len(calls) == 1:
            return 0.05
        if len(calls) == 2:
            raise RuntimeError("transient")
        return None

    queue: WorkQueue[str] = WorkQueue(handle, workers=1)
    queue.start()
    queue.enqueue("job")
    for _ in range(60):
        await asyncio.sleep(0.05)
        if len(calls) >= 3:
            break
    await queue.stop()
    assert calls == ["job", "job", "job"]


JOB_UID = "uid-demo"


def demo_job() -> TrainingJob:
    """The job demo in ml, with the UID the children here name as their controller."""
    body = jobs.manifest()
    body["metadata"]["uid"] = JOB_UID
    return jobs.job(body)


def pod(
    name: str,
    version: str,
    phase: str = "Running",
    node: str = "n1",
    owner: str | None = JOB_UID,
    namespace: str = "ml",
) -> dict[str, object]:
    metadata: dict[str, object] = {
        "name": name,
        "namespace": namespace,
        "uid": f"pod-{name}",
        "resourceVersion": version,
        "labels": {naming.JOB_NAME_LABEL: "demo", naming.ROLE_LABEL: "worker"},
    }
    if owner is not None:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "phalanx.dev/v1alpha1",
                "kind": "TrainingJob",
                "name": "demo",
                "uid": owner,
                "controller": True,
            }
        ]
    return {"kind": "Pod", "metadata": metadata, "spec": {"nodeName": node}, "status": {"phase": phase}}


def pods_of(cache: ChildCache, uid: str = JOB_UID) -> dict[str, str]:
    return {record.name: record.phase for record in cache.pods_of("ml", uid)}


def test_child_cache_knows_which_jobs_wait_for_a_node_as_their_pods_change() -> None:
    cache = ChildCache()
    waiting = pod("demo-worker-0", "5", phase="Pending", node="")
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes"}
    waiting["status"] = {"phase": "Pending", "conditions": [unschedulable]}
    cache.observe("ADDED", waiting)
    cache.observe("ADDED", pod("demo-worker-1", "6"))
    assert cache.jobs_waiting_for_nodes() == {("ml", "demo")}
    cache.observe("MODIFIED", pod("demo-worker-0", "7"))  # bound now
    assert cache.jobs_waiting_for_nodes() == set()
    cache.observe("MODIFIED", {**waiting, "metadata": {**waiting["metadata"], "resourceVersion": "8"}})  # type: ignore[dict-item]
    cache.mark_deleting("ml", JOB_UID, "demo-worker-0")  # our deletion: it waits for nothing any more
    assert cache.jobs_waiting_for_nodes() == set()
    cache.observe("MODIFIED", {**waiting, "metadata": {**waiting["metadata"], "resourceVersion": "9"}})  # type: ignore[dict-item]
    assert cache.jobs_waiting_for_nodes() == {("ml", "demo")}
    cache.observe("DELETED", waiting)
    assert cache.jobs_waiting_for_nodes() == set()


def test_child_cache_warns_once_per_pod_and_key_of_a_value_it_ignored() -> None:
    """A 240 KiB annotation on a worker pod: the cache keeps a small record without it, and the
    job gets one Warning Event naming the pod, the key and the limit, however often it is seen."""
    cache = ChildCache()
    huge = pod("demo-worker-0", "5")
    huge["metadata"]["annotations"] = {  # type: ignore[index]
        naming.RANK_ADDRESS_ANNOTATION: "a" * (240 * 1024),
        "example.com/notes": "x" * (240 * 1024),
    }
    text = json.dumps(huge)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache.observe("ADDED", json.loads(text))
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 4096, f"{kept} bytes kept for one pod"
    (record,) = cache.pods_of("ml", JOB_UID)
    assert record.rank_address is None
    warnings = cache.take_ignored_values("ml", JOB_UID)
    assert [(event.type, event.reason) for event in warnings] == [("Warning", "PodValueIgnored")]
    assert "demo-worker-0" in warnings[0].message and naming.RANK_ADDRESS_ANNOTATION in warnings[0].message
    assert "253 characters" in warnings[0].message
    for version in ("6", "7"):  # seen again (the watch, a relist): no second warning
        again = json.loads(text)
        again["metadata"]["resourceVersion"] = version
        cache.observe("MODIFIED", again)
        assert cache.take_ignored_values("ml", JOB_UID) == ()
    cache.observe("DELETED", huge)
    cache.observe("ADDED", {**json.loads(text), "metadata": {**huge["metadata"], "uid": "pod-again"}})  # type: ignore[dict-item]
    assert len(cache.take_ignored_values("ml", JOB_UID)) == 1  # another pod (UID) under the name


def test_child_cache_keeps_newest_records_and_forgets_deleted() -> None:
    cache = ChildCache()
    assert cache.observe("ADDED", pod("demo-worker-0", "5")) == ("ml", "demo")
    cache.observe("MODIFIED", pod("demo-worker-0", "4", phase="Pending"))  # an older event arrives late
    assert pods_of(cache) == {"demo-worker-0": "Running"}
    assert cache.jobs_on_node("n1") == [("ml", "demo")]
    cache.observe("DELETED", pod("demo-worker-0", "6"))
    assert pods_of(cache) == {}
    assert cache.observe("ADDED", {"kind": "Pod", "metadata": {"name": "x", "namespace": "ml"}}) is None


def test_children_belong_to_the_job_uid_that_controls_them_not_to_its_name() -> None:
    cache = ChildCache()
    cache.observe("ADDED", pod("demo-worker-0", "5", owner="uid-old-demo"))  # the deleted predecessor's
    cache.observe("ADDED", pod("demo-worker-1", "6"))
    cache.observe("ADDED", pod("demo-worker-2", "7", owner=None))  # labelled, but nobody controls it
    assert pods_of(cache) == {"demo-worker-1": "Running"}
    assert pods_of(cache, "uid-old-demo") == {"demo-worker-0": "Running"}
    assert cache.foreign("ml", "demo", JOB_UID) == {("Pod", "demo-worker-0"), ("Pod", "demo-worker-2")}
    observed = observe_job(demo_job(), cache)
    assert [record.name for record in observed.pods] == ["demo-worker-1"]
    assert observed.foreign == {("Pod", "demo-worker-0"), ("Pod", "demo-worker-2")}


def test_a_list_replaces_the_cache_and_drops_what_a_watch_gap_deleted() -> None:
    gone: list[str] = []
    cache = ChildCache(on_pod_gone=gone.append)
    for index, version in enumerate(("5", "6", "7")):
        cache.observe("ADDED", pod(f"demo-worker-{index}", version))
    cache.observe("ADDED", pod("demo-worker-9", "20"))  # created by us after the list's snapshot
    cache.replace("Pod", "ml", [pod("demo-worker-0", "5"), pod("demo-worker-2", "12", phase="Failed")], "15")
    assert pods_of(cache) == {"demo-worker-0": "Running", "demo-worker-2": "Failed", "demo-worker-9": "Running"}
    assert gone == ["ml"]  # demo-worker-1 was deleted during the gap
    cache.replace("Pod", "other", [], "30")  # another namespace's list leaves ours alone
    assert len(pods_of(cache)) == 3
    cache.replace("Pod", None, [], "")  # "" : the resource is not served at all
    assert pods_of(cache) == {}


def pod_group(api_version: str, version: str) -> dict[str, object]:
    owner = {"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob", "name": "demo", "uid": JOB_UID}
    return {
        "apiVersion": api_version,
        "kind": "PodGroup",
        "metadata": {
            "name": "demo",
            "namespace": "ml",
            "uid": f"group-{api_version}",
            "resourceVersion": version,
            "labels": {naming.JOB_NAME_LABEL: "demo"},
            "ownerReferences": [{**owner, "controller": True}],
        },
    }


def test_the_two_gang_schedulers_podgroups_are_different_children() -> None:
    """Both are called PodGroup: an absent Volcano API (its informer hands over an empty list every
    recheck) must not take the coscheduling PodGroup out of the cache, nor one replace the other."""
    cache = ChildCache()
    cache.observe("ADDED", pod_group("scheduling.x-k8s.io/v1alpha1", "5"))
    coscheduling = ("PodGroup.scheduling.x-k8s.io", "demo")
    assert set(cache.objects_of("ml", JOB_UID)) == {coscheduling}
    cache.retain("PodGroup.scheduling.volcano.sh", "ml", set(), "")  # Volcano's CRD is not installed
    cache.retain("PodGroup.scheduling.volcano.sh", None, set(), "")
    assert set(cache.objects_of("ml", JOB_UID)) == {coscheduling}
    cache.observe("ADDED", pod_group("scheduling.volcano.sh/v1beta1", "6"))
    cache.observe("DELETED", pod_group("scheduling.volcano.sh/v1beta1", "7"))
    assert set(cache.objects_of("ml", JOB_UID)) == {coscheduling}
    cache.retain("PodGroup.scheduling.x-k8s.io", "ml", set(), "9")  # its own list: gone during a gap
    assert cache.objects_of("ml", JOB_UID) == {}


def test_a_pod_in_another_namespace_naming_a_jobs_uid_is_not_the_jobs() -> None:
    """An owner reference names no namespace: an impostor elsewhere with the job's name, labels and
    UID neither replaces the real worker's record nor takes it away when it goes."""
    cache = ChildCache()
    cache.observe("ADDED", pod("demo-worker-0", "5"))
    impostor = pod("demo-worker-0", "9", phase="Failed", node="n9", namespace="mallory")
    cache.observe("ADDED", impostor)
    assert pods_of(cache) == {"demo-worker-0": "Running"}
    assert [record.node_name for record in cache.pods_of("ml", JOB_UID)] == ["n1"]
    assert [record.name for record in observe_job(demo_job(), cache).pods] == ["demo-worker-0"]
    cache.observe("DELETED", impostor)
    assert pods_of(cache) == {"demo-worker-0": "Running"}
    cache.retain("Pod", "mallory", set(), "20")  # the impostor's namespace listed empty
    assert pods_of(cache) == {"demo-worker-0": "Running"}


def test_job_cache_replace_forgets_jobs_deleted_during_a_gap() -> None:
    changes: list[tuple[tuple[str, str], bool]] = []
    cache = JobCache(on_change=lambda key, gone: changes.append((key, gone)))
    body = {"metadata": {"name": "a", "namespace": "ml", "uid": "u1", "resourceVersion": "3"}}
    cache.observe("ADDED", body)
    cache.observe("ADDED", {"metadata": {"name": "b", "namespace": "ml", "uid": "u2", "resourceVersion": "4"}})
    cache.replace("TrainingJob", "ml", [body], "10")
    assert cache.keys() == [("ml", "a")]
    assert (("ml", "b"), True) in changes
    # a DELETED event for an older incarnation of the same name leaves the new one
    cache.observe("DELETED", {"metadata": {"name": "a", "namespace": "ml", "uid": "u0", "resourceVersion": "11"}})
    assert cache.keys() == [("ml", "a")]


def test_job_cache_prefers_newer_versions() -> None:
    cache = JobCache()
    body = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u", "resourceVersion": "10"}}
    key = cache.update(body)
    cache.update({"metadata": {**body["metadata"], "resourceVersion": "9"}, "stale": True})
    assert "stale" not in (cache.get(key) or {})


def test_job_cache_keeps_no_field_manager_bookkeeping_and_only_the_metadata_it_reads() -> None:
    cache = JobCache()
    annotations = {"kubectl.kubernetes.io/last-applied-configuration": "{...}", "team": "vision" * 60_000,
                   "argocd.argoproj.io/tracking-id": "app:phalanx.dev/TrainingJob:ml/demo"}  # fmt: skip
    metadata = {"name": "demo", "namespace": "ml", "uid": "u", "resourceVersion": "10", "annotations": annotations,
                "labels": {"team": "vision"},
                "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]}  # fmt: skip
    body = {"metadata": metadata, "spec": {"workers": {"desired": 2}}}
    kept = cache.get(cache.update(body)) or {}
    assert kept["metadata"]["annotations"] == {"argocd.argoproj.io/tracking-id": "app:phalanx.dev/TrainingJob:ml/demo"}
    assert "labels" not in kept["metadata"] and "managedFields" not in kept["metadata"]
    assert kept["spec"] == body["spec"] and "managedFields" in metadata  # the caller's body is left alone


def test_a_job_the_operator_deleted_is_gone_from_the_cache_at_once_but_a_successor_stays() -> None:
    changes: list[tuple[tuple[str, str], bool]] = []
    cache = JobCache(on_change=lambda key, gone: changes.append((key, gone)))
    key = cache.update({"metadata": {"name": "a", "namespace": "ml", "uid": "new", "resourceVersion": "5"}})
    cache.deleted(key, "old")  # a predecessor's UID: the job now in the cache stays
    assert cache.get(key) is not None and changes == []
    cache.deleted(key, "new")
    assert cache.get(key) is None and changes == [(key, True)]


def test_a_response_that_arrives_after_the_deleted_event_brings_nothing_back() -> None:
    jobs = JobCache()
    body = {"metadata": {"name": "a", "namespace": "ml", "uid": "u1", "resourceVersion": "5"}}
    key = jobs.update(body)
    jobs.observe("DELETED", {"metadata": {**body["metadata"], "resourceVersion": "7"}})
    jobs.answered({"metadata": {**body["metadata"], "resourceVersion": "6"}, "status": {"phase": "Running"}})
    assert jobs.get(key) is None  # the status write's answer came after the job went
    jobs.observe("ADDED", {"metadata": {**body["metadata"], "uid": "u2", "resourceVersion": "9"}})
    jobs.answered({"metadata": {**body["metadata"], "resourceVersion": "10"}, "status": {"phase": "Running"}})
    assert (jobs.get(key) or {}).get("status") is None  # an answer about its predecessor
    jobs.answered(
        {"metadata": {**body["metadata"], "uid": "u2", "resourceVersion": "10"}, "status": {"phase": "Running"}}
    )
    assert (jobs.get(key) or {}).get("status") == {"phase": "Running"}

    children = ChildCache()
    created = pod("demo-worker-0", "5")
    children.observe("DELETED", {**created, "metadata": {**created["metadata"], "resourceVersion": "6"}})  # type: ignore[dict-item]
    assert children.observe("ADDED", created) is None  # our create's response, folded in late
    assert pods_of(children) == {}
    successor = pod("demo-worker-0", "8")
    successor["metadata"] = {**successor["metadata"], "uid": "pod-demo-worker-0-b"}  # type: ignore[dict-item]
    children.observe("ADDED", successor)
    assert pods_of(children) == {"demo-worker-0": "Running"}


def test_recently_deleted_forgets_a_uid_after_its_window() -> None:
    now = [0.0]
    deleted = RecentlyDeleted(seconds=60, clock=lambda: now[0])
    deleted.add("a")
    now[0] = 30.0
    deleted.add("b")
    deleted.add("")
    assert ["a" in deleted, "b" in deleted, "" in deleted] == [True, True, False]
    now[0] = 61.0
    assert ["a" in deleted, "b" in deleted] == [False, True]
    now[0] = 91.0
    assert "b" not in deleted


def test_node_cache_reports_readiness_changes() -> None:
    nodes = NodeCache()
    ready = {"metadata": {"name": "n1"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    gone = {"metadata": {"name": "n1"}, "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}
    assert not nodes.observe("ADDED", ready)
    assert nodes.observe("MODIFIED", gone)
    assert nodes.unready() == frozenset({"n1"})
    assert nodes.observe("MODIFIED", ready)
    assert nodes.unready() == frozenset()


def test_node_cache_remembers_since_when_a_node_is_not_ready_and_which_were_deleted() -> None:
    clock = [datetime(2026, 12, 1, 12, 0, tzinfo=UTC)]
    nodes = NodeCache(clock=lambda: clock[0])

    def body(name: str, status: str, since: str | None = None) -> dict[str, Any]:
        condition = {"type": "Ready", "status": status, **({"lastTransitionTime": since} if since else {})}
        return {"metadata": {"name": name}, "status": {"conditions": [condition]}}

    nodes.replace("Node", None, [body("n1", "True"), body("n2", "False", "2026-12-01T11:58:00Z")], "1")
    # a node already not ready when the operator starts: the cluster's time, not the operator's start
    assert nodes.unready_since() == {"n2": datetime(2026, 12, 1, 11, 58, tzinfo=UTC)}
    clock[0] += timedelta(seconds=30)
    nodes.observe("MODIFIED", body("n1", "Unknown"))  # no transition time: when first seen so
    nodes.observe("MODIFIED", body("n2", "Unknown", "2026-12-01T12:00:20Z"))  # False -> Unknown keeps it
    nodes.observe("MODIFIED", body("n3", "False", "2026-12-01T13:00:00Z"))  # a clock ahead: never later
    assert nodes.unready_since() == {
        "n1": clock[0],
        "n2": datetime(2026, 12, 1, 11, 58, tzinfo=UTC),
        "n3": clock[0],
    }
    nodes.observe("MODIFIED", body("n1", "True"))
    nodes.observe("DELETED", body("n2", "Unknown"))
    assert set(nodes.unready_since()) == {"n3"} and nodes.deleted() == frozenset({"n2"})
    nodes.replace("Node", None, [body("n1", "True")], "2")  # without n3: deleted while the watch was down
    assert nodes.deleted() == frozenset({"n2", "n3"})
    nodes.observe("ADDED", body("n3", "True"))  # a node of that name is back
    clock[0] += NodeCache.DELETED_MEMORY
    assert nodes.deleted() == frozenset({"n2"})
    clock[0] += timedelta(seconds=31)
    assert nodes.deleted() == frozenset()


def test_run_takes_its_node_options_out_of_kopfs_arguments() -> None:
    arguments = ["--standalone", "--node-lost-grace-seconds", "30", "-n", "ml", "--force-delete-on-node-lost"]
    assert node_options(arguments) == (
        ["--standalone", "-n", "ml"],
        {"PHALANX_NODE_LOST_GRACE_SECONDS": "30", "PHALANX_FORCE_DELETE_ON_NODE_LOST": "1"},
    )
    assert node_options(["--node-lost-grace-seconds=0"]) == ([], {"PHALANX_NODE_LOST_GRACE_SECONDS": "0"})
    with pytest.raises(SystemExit, match="number of seconds"):
        node_options(["--node-lost-grace-seconds=soon"])


def test_node_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_NODE_LOST_GRACE_SECONDS", raising=False)
    monkeypatch.delenv("PHALANX_FORCE_DELETE_ON_NODE_LOST", raising=False)
    assert node_loss_settings(Settings.from_environment()) == (
        300.0,
        False,
    )  # Kubernetes' default toleration; never forced
    monkeypatch.setenv("PHALANX_NODE_LOST_GRACE_SECONDS", "45")
    monkeypatch.setenv("PHALANX_FORCE_DELETE_ON_NODE_LOST", "1")
    assert node_loss_settings(Settings.from_environment()) == (45.0, True)
    monkeypatch.setenv("PHALANX_NODE_LOST_GRACE_SECONDS", "-1")
    with pytest.raises(ValueError, match="PHALANX_NODE_LOST_GRACE_SECONDS"):
        node_loss_settings(Settings.from_environment())


def test_the_spare_priority_class_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_SPARE_PRIORITY_CLASS", raising=False)
    assert Settings.from_environment().spare_priority_class is None  # spares then take the workers' class
    monkeypatch.setenv("PHALANX_SPARE_PRIORITY_CLASS", "phalanx-spare")
    assert Settings.from_environment().spare_priority_class == "phalanx-spare"
    monkeypatch.setenv("PHALANX_SPARE_PRIORITY_CLASS", "Spare Class")  # every spare would be refused
    with pytest.raises(ValueError, match="PHALANX_SPARE_PRIORITY_CLASS"):
        Settings.from_environment()


def node_loss_settings(settings: Settings) -> tuple[float, bool]:
    return settings.node_lost_grace_seconds, settings.force_delete_on_node_lost


def node(name: str, gpus: int, *, ready: bool = True, **spec: Any) -> dict[str, Any]:
    status = "True" if ready else "Unknown"
    return {
        "metadata": {"name": name, "resourceVersion": "1"},
        "spec": spec,
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus), "pods": "110"},
            "conditions": [{"type": "Ready", "status": status, "lastHeartbeatTime": "2026-12-01T00:00:00Z"}],
        },
    }


def test_node_cache_fingerprints_what_schedulable_nodes_offer() -> None:
    woken: list[str] = []
    nodes = NodeCache(on_capacity=lambda: woken.append(nodes.capacity()))
    assert nodes.capacity() == ""
    nodes.observe("ADDED", node("n1", 8))
    first = nodes.capacity()
    assert first and woken == [first]
    heartbeat = node("n1", 8)
    heartbeat["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-12-01T00:00:40Z"
    nodes.observe("MODIFIED", heartbeat)  # nothing it offers changed
    assert woken == [first]
    nodes.observe("ADDED", node("n2", 8))
    both = nodes.capacity()
    assert both not in ("", first) and woken == [first, both]
    nodes.observe("MODIFIED", node("n2", 8, ready=False))
    assert nodes.capacity() == first  # an unready node offers nothing
    nodes.observe("MODIFIED", node("n2", 8))
    nodes.observe("MODIFIED", node("n2", 8, unschedulable=True))
    assert nodes.capacity() == first  # nor does a cordoned one
    nodes.observe("MODIFIED", node("n2", 8, taints=[{"key": "maintenance", "effect": "NoSchedule"}]))
    tainted = nodes.capacity()
    assert tainted not in (first, both)
    nodes.observe("MODIFIED", node("n2", 8, taints=[{"key": "hint", "effect": "PreferNoSchedule"}]))
    assert nodes.capacity() == both  # no bar to pods
    nodes.observe("MODIFIED", node("n2", 4))
    assert nodes.capacity() not in (first, both, tainted)
    assert len(woken) == 8
    nodes.pod_released()  # what a pod held is free again: a new fingerprint
    assert len(woken) == 9 and woken[-1] not in woken[:-1]
    nodes.observe("DELETED", node("n2", 4))
    assert nodes.capacity() != both
    nodes.replace("Node", None, [], "5")
    assert nodes.capacity() == ""


def test_workload_cache_follows_kueues_workloads_and_wakes_their_job() -> None:
    woken: list[tuple[str, str]] = []
    workloads = WorkloadCache(on_change=lambda namespace, name: woken.append((namespace, name)))
    pending = {
        "metadata": {"namespace": "ml", "name": "demo-a0"},
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "message": "insufficient quota"}]},
    }
    workloads.observe("ADDED", pending)
    assert workloads.get("ml", "demo-a0") == QueuedWorkload("demo-a0", admitted=False, message="insufficient quota")
    admitted = {**pending, "status": {"conditions": [{"type": "Admitted", "status": "True"}]}}
    workloads.observe("MODIFIED", admitted)
    workloads.observe("MODIFIED", admitted)  # no change, no wake-up
    evicted = {
        **pending,
        "status": {"conditions": [{"type": "Evicted", "status": "True", "reason": "Preempted", "message": "by x"}]},
    }
    workloads.observe("MODIFIED", evicted)
    assert workloads.get("ml", "demo-a0") == QueuedWorkload("demo-a0", admitted=False, evicted="Preempted")
    workloads.replace("Workload", "ml", [], "7")
    assert workloads.get("ml", "demo-a0") is None
    assert woken == [("ml", "demo-a0")] * 4
    assert naming.kueue_group_job("demo-a0") == "demo" and naming.kueue_group_job("other") is None


def test_resource_paths() -> None:
    assert resource_path("v1", "Pod", "ml", "p") == "/api/v1/namespaces/ml/pods/p"
    assert (
        resource_path("scheduling.volcano.sh/v1beta1", "PodGroup", "ml")
        == "/apis/scheduling.volcano.sh/v1beta1/namespaces/ml/podgroups"
    )
    assert (
        resource_path("phalanx.dev/v1alpha1", "TrainingJob", "ml", "j", plural="trainingjobs")
        == "/apis/phalanx.dev/v1alpha1/namespaces/ml/trainingjobs/j"
    )


def test_backend_choice() -> None:
    assert choose_backend({}, cuda_available=True) == "nccl"
    assert choose_backend({}, cuda_available=False) == "gloo"
    assert choose_backend({"PHALANX_BACKEND": "gloo"}, cuda_available=True) == "gloo"


def test_cli_writes_the_crd(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["crd", "--output-dir", str(tmp_path)]) == 0
    assert (tmp_path / "trainingjobs.phalanx.dev.yaml").read_text().startswith("# Generated by `phalanx crd`")
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out.strip().endswith("0.1.0")


def test_our_own_deletions_are_visible_before_the_watch_reports_them() -> None:
    cache = ChildCache()
    cache.observe("ADDED", pod("demo-worker-0", "5", phase="Failed"))
    cache.mark_deleting("ml", JOB_UID, "demo-worker-0")
    assert cache.pods_of("ml", JOB_UID)[0].deleting
    cache.mark_deleting("ml", JOB_UID, "not-there")  # unknown pods are ignored


def test_run_hands_kopfs_namespace_options_to_the_informers() -> None:
    assert watch_scope(["--standalone", "--namespace=ml", "-n", "research", "-nteam"]) == ["ml", "research", "team"]
    assert watch_scope(["--all-namespaces"]) is None
    assert watch_scope(["-A", "--namespace=ml"]) is None
    assert watch_scope(["--standalone"]) is None
    with pytest.raises(SystemExit, match="patterns are not supported"):
        watch_scope(["--namespace=team-*"])


def test_node_cache_parses_a_nodes_allocatable_once_and_drops_nodes_that_take_no_pods() -> None:
    nodes = NodeCache()
    nodes.observe("ADDED", node("n1", 8))
    nodes.observe("ADDED", node("n2", 4, unschedulable=True))
    view = nodes.allocatable()
    assert view == {"n1": {"nvidia.com/gpu": Decimal(8), "pods": Decimal(110)}}
    nodes.observe("MODIFIED", node("n1", 8))  # a heartbeat: nothing parsed or rebuilt again
    assert nodes.allocatable() is view
    nodes.observe("MODIFIED", node("n1", 16))
    assert nodes.allocatable() == {"n1": {"nvidia.com/gpu": Decimal(16), "pods": Decimal(110)}}
    nodes.observe("MODIFIED", node("n1", 16, ready=False))
    assert nodes.allocatable() == {}


def test_node_cache_keeps_every_nodes_labels_while_it_exists_and_room_only_for_schedulable_ones() -> None:
    nodes = NodeCache()
    labelled = node("n1", 8)
    labelled["metadata"]["labels"] = {"rack": "a"}
    nodes.observe("ADDED", labelled)
    for change in ({"ready": False}, {"unschedulable": True}):  # a NotReady blip, a cordon
        blipped = node("n1", 8, **change)
        blipped["metadata"]["labels"] = {"rack": "a"}
        nodes.observe("MODIFIED", blipped)
        assert nodes.labels() == {"n1": {"rack": "a"}}  # its pods still run in rack a
        assert nodes.allocatable() == {}  # but no new pod goes there
        nodes.observe("MODIFIED", labelled)
        assert set(nodes.allocatable()) == {"n1"}
    nodes.observe("DELETED", labelled)
    assert nodes.labels() == {} and nodes.allocatable() == {}
    nodes.observe("ADDED", labelled)
    nodes.replace("Node", None, [], "9")  # gone while the watch was down
    assert nodes.labels() == {}


def bound_pod(
    name: str, node: str | None, gpus: int, *, namespace: str = "other", phase: str = "Running", **spec: Any
) -> dict[str, Any]:
    containers = [{"name": "main", "resources": {"requests": {"nvidia.com/gpu": str(gpus), "cpu": "500m"}}}]
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": containers, **({"nodeName": node} if node else {}), **spec},
        "status": {"phase": phase},
    }


def test_node_requests_sum_what_every_tenants_bound_pods_request_per_event() -> None:
    released: list[int] = []
    requests = NodeRequests(on_release=lambda: released.append(1))
    requests.observe("ADDED", bound_pod("a", "n1", 4))
    requests.observe("ADDED", bound_pod("b", "n1", 2, namespace="team"))
    requests.observe("ADDED", bound_pod("pending", None, 8))  # no node yet: holds nothing
    assert requests.requested() == {"n1": {"nvidia.com/gpu": Decimal(6), "cpu": Decimal(1)}}
    view = requests.requested()
    requests.observe("MODIFIED", bound_pod("a", "n1", 4))  # a status update: nothing changes
    assert requests.requested() is view
    requests.observe("MODIFIED", bound_pod("pending", "n2", 8))  # bound now
    assert requests.requested()["n2"] == {"nvidia.com/gpu": Decimal(8), "cpu": Decimal("0.5")}
    assert view == {"n1": {"nvidia.com/gpu": Decimal(6), "cpu": Decimal(1)}}  # a view handed out stays as it was
    requests.observe("MODIFIED", bound_pod("b", "n1", 2, namespace="team", phase="Succeeded"))  # finished
    assert requests.requested()["n1"] == {"nvidia.com/gpu": Decimal(4), "cpu": Decimal("0.5")}
    assert requests.held_by([("other", "a"), ("other", "pending"), ("other", "unknown")]) == {
        "n1": {"nvidia.com/gpu": Decimal(4), "cpu": Decimal("0.5")},
        "n2": {"nvidia.com/gpu": Decimal(8), "cpu": Decimal("0.5")},
    }
    requests.observe("DELETED", bound_pod("a", "n1", 4))
    assert set(requests.requested()) == {"n2"} and len(released) == 2
    requests.replace("Pod", None, [bound_pod("c", "n3", 1)], "10")  # "pending" went while the watch was down
    assert requests.requested() == {"n3": {"nvidia.com/gpu": Decimal(1), "cpu": Decimal("0.5")}}
    assert len(released) == 3


def test_pods_of_one_template_share_one_record_of_their_requests() -> None:
    requests = NodeRequests()
    for index in range(3):
        requests.observe("ADDED", bound_pod(f"p{index}", f"n{index}", 8))
    held = [requests._pods[("other", f"p{index}")][1] for index in range(3)]  # the sharing itself
    assert held[0] is held[1] is held[2]
    for index in range(3):
        requests.observe("DELETED", bound_pod(f"p{index}", f"n{index}", 8))
    assert requests._shared == {} and requests.requested() == {}


def test_a_pods_requests_are_summed_as_the_scheduler_sums_them() -> None:
    def container(cpu: str, **more: Any) -> dict[str, Any]:
        return {"name": "c", "resources": {"requests": {"cpu": cpu}}, **more}

    spec = {
        "containers": [container("1"), {"name": "l", "resources": {"limits": {"memory": "1Gi"}}}],
        "initContainers": [container("4"), container("500m", restartPolicy="Always"), container("3")],
        "overhead": {"cpu": "100m"},
    }
    # init: 4, then 3 beside the 0.5 sidecar = 3.5; running: 1 + the sidecar's 0.5; the max, plus the overhead
    assert capacity.pod_requests(spec) == {"cpu": Decimal("4.1"), "memory": Decimal(2**30)}
    with pytest.raises(PlanningError, match=r"containers\[0\]\.resources"):
        capacity.pod_requests({"containers": [container("lots")]})


def test_a_pass_sees_each_nodes_free_room_with_its_own_pods_not_held_against_it() -> None:
    async def handle(key: tuple[str, str]) -> None:
        return None

    runtime = Runtime.start(
        cast(Any, object()), WorkQueue(handle), Settings(watch_namespaces=("ml",), watch_nodes=True)
    )
    (bound,) = [informer for informer in runtime.informers if informer.sink is runtime.requests]
    # every namespace's pods at once, only those bound and not finished; no scope of jobs of its own
    assert bound.namespace is None and bound.resource.path(None) == "/api/v1/pods"
    assert bound.field_selector == "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
    assert runtime.scopes() == ["ml"]
    parsed = jobs.job()
    runtime.nodes.observe("ADDED", node("n1", 8))
    ours = pod("demo-worker-0", "1", owner=parsed.metadata.uid)
    ours["spec"] = {"nodeName": "n1", "containers": [{"name": "w", "resources": {"requests": {"nvidia.com/gpu": "2"}}}]}
    for body in (ours, bound_pod("theirs", "n1", 4)):
        runtime.children.observe("ADDED", body)
        runtime.requests.observe("ADDED", body)
    observed = runtime.observe(parsed)
    assert observed.node_requested["n1"]["nvidia.com/gpu"] == Decimal(6)
    assert observed.node_free("n1")["nvidia.com/gpu"] == Decimal(4)  # 8 less the other tenant's 4
