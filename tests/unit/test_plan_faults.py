"""The planner under faults and cluster policy: exactly-once counting across interrupted passes,
refusals that may pass (quota, name conflicts, a missing gang scheduler API), container start
errors, completion recorded in the rendezvous store, specs the operator cannot parse, and the
store pod under Pod Security "restricted"."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.cluster.refusals import RefusalMemory
from phalanx.reconcile import desired, naming
from phalanx.reconcile.creation import REFUSAL_RETRY_SECONDS, refusal_retry_at
from phalanx.reconcile.environment import resolve_launch
from phalanx.reconcile.observed import Completion, Refusal
from phalanx.reconcile.plan import Plan, unparsable
from phalanx.reconcile.status import format_time
from tests.unit.jobs import job, manifest
from tests.unit.simulation import START, World, running

QUOTA = 'pods "demo-worker-1" is forbidden: exceeded quota: pods, requested: pods=1, used: pods=2, limited: pods=2'


def conditions(world: World) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in world.status["conditions"]}


def uid_of(world: World, name: str) -> str:
    return str(world.pods[name]["metadata"]["uid"])


# -- exactly-once counting -----------------------------------------------------------------------


def test_a_failure_is_counted_once_however_often_the_pass_is_cut_after_its_status_write() -> None:
    world = running(World(job()))
    victim = naming.worker_pod_name("demo", 1)
    world.terminate(victim, 1, message="RuntimeError: boom")
    for _ in range(5):  # SIGKILL right after each status write: the failed pod is never deleted
        world.carry_out(world.plan(), stop_after_status=True)
        assert world.status["restarts"] == 1
        assert world.status["countedFailures"] == [uid_of(world, victim)]
    world.settle()
    world.run()
    world.settle()
    assert (world.status["restarts"], world.status["restartsByReason"]) == (1, {"WorkerFailed": 1})
    assert "countedFailures" not in world.status  # the pod is gone: its UID is pruned
    assert world.status["phase"] == "Running"


def test_a_gang_restart_is_counted_once_when_the_pass_is_cut_after_its_status_write() -> None:
    world = running(World(job(workers={"desired": 2})))
    world.terminate(naming.worker_pod_name("demo", 0), 1)
    world.carry_out(world.plan(), stop_after_status=True)
    assert (world.status["attempt"], world.status["restarts"]) == (1, 1)
    for _ in range(3):
        world.carry_out(world.plan(), stop_after_status=True)
    assert (world.status["attempt"], world.status["restarts"]) == (1, 1)
    world.advance(60)
    world.settle()
    world.run()
    world.settle()
    assert (world.status["attempt"], world.status["restarts"], world.status["phase"]) == (1, 1, "Running")


def test_a_lost_store_restarts_the_gang_once_even_if_its_pod_outlives_the_pass() -> None:
    world = running(World(job()))
    store = naming.rendezvous_name("demo")
    world.terminate(store, 1)
    world.carry_out(world.plan(), stop_after_status=True)
    assert world.status["restartsByReason"] == {"RendezvousStoreLost": 1}
    world.carry_out(world.plan())  # the old store is deleted now, without a second restart
    assert world.status["restartsByReason"] == {"RendezvousStoreLost": 1}
    world.settle()
    world.run()
    world.settle()
    assert (world.status["attempt"], world.status["phase"]) == (1, "Running")
    assert world.status["restartsByReason"] == {"RendezvousStoreLost": 1}


def test_a_store_lost_with_its_node_goes_even_when_the_node_comes_back() -> None:
    world = running(World(job()))
    store = naming.rendezvous_name("demo")
    world.lose_node("node-a")  # every pod runs there; not ready past the grace
    store_uid = uid_of(world, store)
    world.carry_out(world.plan(), stop_after_status=True)  # the gang restart is recorded, nothing deleted
    assert (world.status["attempt"], world.status["restartsByReason"]) == (1, {"NodeLost": 1})
    assert store_uid in world.status["countedFailures"]
    world.node_ready("node-a")  # the node is back before the operator is
    plan = world.reconcile()
    assert store in {d.name for d in plan.delete}  # declared lost: it goes all the same
    assert not [obj for obj in plan.apply if obj["kind"] == "Pod"]  # no worker dials the old store
    world.finish_terminating()
    world.settle()
    world.run()
    world.settle()
    assert (world.status["attempt"], world.status["phase"]) == (1, "Running")
    assert world.status["restartsByReason"] == {"NodeLost": 1}
    assert world.pods[store]["metadata"]["uid"] != store_uid


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 3)), min_size=1, max_size=8))
def test_restarts_equal_the_counted_failures_whatever_the_interruptions(
    failures: list[tuple[int, bool, int]],
) -> None:
    """Each failure hits one running worker; after it, 0..3 passes are cut after their status
    write (a SIGKILL) before the operator runs to completion again."""
    world = running(World(job(failurePolicy={"maxRestarts": 100, "backoffSeconds": 1, "maxBackoffSeconds": 1})))
    for index, oom, cuts in failures:
        victim = world.workers(world.status["attempt"])[index]["metadata"]["name"]
        if oom:
            world.terminate(victim, 137, reason="OOMKilled")
        else:
            world.terminate(victim, 1)
        for _ in range(cuts):
            world.carry_out(world.plan(), stop_after_status=True)
        for _ in range(4):
            world.advance(2)
            world.settle()
            world.run()
        world.settle()
        assert world.status["phase"] == "Running", world.status
    assert world.status["restarts"] == len(failures)
    by_reason = world.status["restartsByReason"]
    assert by_reason.get("OOMKilled", 0) == sum(1 for _, oom, _ in failures if oom)
    assert by_reason.get("WorkerFailed", 0) == sum(1 for _, oom, _ in failures if not oom)


def test_a_correlated_failure_counts_once_below_and_above_the_gang_threshold() -> None:
    """desired 8, min 4, maxRestarts 3: four workers failing together (four survive: each is
    replaced) counted 4 and failed the job, five (a gang restart) counted 1. One event, counted once."""
    for failing in (4, 5):
        world = World(job(workers={"min": 4, "max": 8, "desired": 8}, failurePolicy={"maxRestarts": 3}))
        world.settle()
        world.run()
        world.reconcile()
        names = [naming.worker_pod_name("demo", index) for index in range(failing)]
        for name in names:
            world.terminate(name, 137, reason="OOMKilled")  # an OOM at the same step on every rank
        uids = {uid_of(world, name) for name in names}
        plan = world.reconcile()
        assert (world.status["restarts"], world.status["restartsByReason"]) == (1, {"OOMKilled": 1}), failing
        assert world.status["phase"] == ("Rescaling" if failing == 4 else "Restarting")
        assert uids <= set(world.status["countedFailures"])
        assert {d.name for d in plan.delete} >= set(names)


# -- container start errors ----------------------------------------------------------------------


def test_a_container_that_cannot_start_fails_the_job_at_once_with_the_runtimes_message() -> None:
    world = running(World(job()))
    message = (
        "failed to create containerd task: failed to create shim task: OCI runtime create failed: "
        'exec: "python": executable file not found in $PATH'
    )
    world.terminate(naming.worker_pod_name("demo", 0), 128, reason="StartError", message=message)
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Failed", "InvalidPodConfiguration")
    assert "StartError" in world.status["message"] and "executable file not found" in world.status["message"]
    assert (world.status["restarts"], world.status.get("restartsByReason") or {}) == (0, {})


# -- refusals that may pass ------------------------------------------------------------------------


def refused(world: World, name: str, reason: str, message: str, attempts: int = 1, kind: str = "Pod") -> None:
    world.refusals[(kind, name)] = Refusal(reason, message, world.now, world.now, attempts)


def test_a_quota_refusal_is_explained_and_retried_at_a_paced_interval_without_failing() -> None:
    world = World(job(workers={"desired": 2}))
    world.settle()
    refused_name = naming.worker_pod_name("demo", 1)
    world.pods.pop(refused_name)  # the API server refused to create it
    refused(world, refused_name, "QuotaExceeded", QUOTA)
    world.run()
    plan = world.reconcile()
    assert refused_name not in {obj["metadata"]["name"] for obj in plan.apply}  # paced, not hammered
    assert plan.requeue_after is not None and 0 < plan.requeue_after <= REFUSAL_RETRY_SECONDS[0]
    assert world.status["phase"] in ("Pending", "Starting")
    assert world.status["reason"] == "QuotaExceeded"
    assert "exceeded quota: pods" in world.status["message"]
    assert "1 of the 2 worker(s) it needs (workers.min)" in world.status["message"]
    got = conditions(world)
    assert got["Stalled"] == ("True", "QuotaExceeded") and got["Reconciling"][0] == "False"
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "QuotaExceeded")]
    again = world.reconcile()
    assert not again.events  # told once, not every pass
    world.advance(REFUSAL_RETRY_SECONDS[0])
    retry = world.reconcile()
    assert refused_name in {obj["metadata"]["name"] for obj in retry.apply}
    world.refusals.clear()  # created this time
    world.run()
    world.settle()
    assert world.status["phase"] == "Running" and conditions(world)["Stalled"][0] == "False"


def test_a_store_refused_by_quota_is_created_later_and_nothing_restarts() -> None:
    """An older operator created store and workers together; the quota may have let the workers in
    and refused the store. The store never ran, so it was not lost: no gang restart when it comes."""
    world = World(job(workers={"desired": 2}))
    world.settle()
    store = naming.rendezvous_name("demo")
    world.pods.pop(store)
    refused(world, store, "QuotaExceeded", QUOTA)
    world.run()
    plan = world.reconcile()
    assert not plan.delete and world.status.get("restartsByReason") in (None, {})
    assert world.status["reason"] == "QuotaExceeded"
    world.advance(REFUSAL_RETRY_SECONDS[0])
    assert store in {obj["metadata"]["name"] for obj in world.reconcile().apply}
    world.refusals.clear()  # created this time
    world.run()
    world.settle()
    assert world.status["phase"] == "Running"
    assert (world.status["restarts"], world.status.get("restartsByReason") or {}) == (0, {})


def test_refusal_pauses_grow_and_are_capped() -> None:
    pauses = [
        (refusal_retry_at(Refusal("QuotaExceeded", "", START, START, attempts)) - START).total_seconds()
        for attempts in range(1, 9)
    ]
    assert pauses == sorted(pauses) and pauses[0] == REFUSAL_RETRY_SECONDS[0] and pauses[-1] == 60


def test_a_freed_quota_is_retried_without_the_long_pause() -> None:
    world = World(job(workers={"desired": 2}))
    world.settle()
    name = naming.worker_pod_name("demo", 1)
    world.pods.pop(name)
    refused_at = world.now - timedelta(seconds=REFUSAL_RETRY_SECONDS[0])  # its third pause would be 10 s
    world.refusals[("Pod", name)] = Refusal("QuotaExceeded", QUOTA, refused_at, refused_at, 3, retry_now=True)
    assert name in {obj["metadata"]["name"] for obj in world.plan().apply}


def test_a_name_held_by_another_owner_is_never_taken_over() -> None:
    world = World(job())
    taken = naming.worker_pod_name("demo", 0)
    world.foreign.add(("Pod", taken))
    world.reconcile()  # the store first
    plan = world.reconcile()
    assert taken not in {obj["metadata"]["name"] for obj in plan.apply}
    assert taken not in {deletion.name for deletion in plan.delete}
    assert world.status["reason"] == "NameConflict" and taken in world.status["message"]
    assert conditions(world)["Stalled"] == ("True", "NameConflict")
    world.foreign.clear()  # the garbage collector removed the old job's pod
    assert taken in {obj["metadata"]["name"] for obj in world.reconcile().apply}


def test_a_gang_scheduler_api_that_is_not_installed_stalls_the_job_without_creating_anything() -> None:
    world = World(job(gpus={"count": 2}, gang={"scheduler": "scheduler-plugins"}))
    world.missing_apis[desired.COSCHEDULING_API] = "not served by the API server"
    plan = world.reconcile()
    assert plan.apply == () and plan.requeue_after is None
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "GangSchedulerUnavailable")
    assert "not served by the API server" in world.status["message"] and "scheduler-plugins" in world.status["message"]
    assert conditions(world)["Stalled"] == ("True", "GangSchedulerUnavailable")
    world.missing_apis.clear()
    assert next(obj["kind"] for obj in world.reconcile().apply) == "PodGroup"


# -- completion recorded in the rendezvous store -------------------------------------------------


def test_completion_recorded_in_the_store_ends_the_job_while_its_pods_still_run() -> None:
    world = running(World(job()))
    world.completion = Completion(attempt=0, step=200, rank=0, job_uid=world.job.metadata.uid)
    plan = world.reconcile()
    assert world.status["phase"] == "Succeeded", world.status
    assert "rank 0 recorded completion at step 200" in world.status["message"]
    assert plan.delete == () and plan.requeue_after is not None  # the other workers get their grace
    world.advance(plan.requeue_after)
    stopped = world.reconcile()
    assert {d.name for d in stopped.delete} >= {naming.worker_pod_name("demo", i) for i in range(3)}


def test_a_completion_record_of_another_job_or_attempt_ends_nothing() -> None:
    """Any pod that reaches the store can set its completion key: only a record naming this job's
    UID and its current attempt counts."""
    world = running(World(job()))
    uid = world.job.metadata.uid
    for forged in (
        Completion(attempt=0, step=1, rank=0),  # no job named: a foreign pod, or a worker of an older operator
        Completion(attempt=0, step=1, rank=0, job_uid="4d6c61a0-0000-0000-0000-00000000dead"),  # another job's
        Completion(attempt=3, step=1, rank=0, job_uid=uid),  # an attempt this job is not at
    ):
        world.completion = forged
        plan = world.reconcile()
        assert world.status["phase"] == "Running", (forged, world.status)
        assert plan.delete == (), forged
    world.completion = Completion(attempt=0, step=200, rank=0, job_uid=uid)
    world.reconcile()
    assert world.status["phase"] == "Succeeded"


def test_a_record_of_an_earlier_attempt_does_not_end_the_next_one() -> None:
    world = running(World(job()))
    uid = world.job.metadata.uid
    for index in range(3):  # too few survivors: a gang restart, attempt 1
        world.terminate(naming.worker_pod_name("demo", index), 1)
    world.settle()
    assert world.status["attempt"] >= 1 and world.status["phase"] not in ("Succeeded", "Failed"), world.status
    world.completion = Completion(attempt=0, step=200, rank=0, job_uid=uid)
    world.reconcile()
    assert world.status["phase"] != "Succeeded", world.status


# -- specs the operator cannot parse ------------------------------------------------------------


def test_a_body_the_operator_cannot_parse_is_stalled_and_its_pods_are_left_alone() -> None:
    world = running(World(job()))
    body: dict[str, Any] = dict(world.body)
    body["spec"] = {**body["spec"], "fromTheFuture": True}
    plan = unparsable(body, "spec.fromTheFuture: Extra inputs are not permitted", world.now + timedelta(seconds=1))
    assert plan.apply == () and plan.delete == () and not plan.delete_job
    assert plan.status["phase"] == "Running"  # not Failed: a newer operator carries on
    stalled = {c["type"]: c for c in plan.status["conditions"]}["Stalled"]
    assert (stalled["status"], stalled["reason"]) == ("True", "InvalidSpec")
    assert "fromTheFuture" in stalled["message"]
    assert [e.reason for e in plan.events] == ["InvalidSpec"]


# -- Pod Security "restricted" -------------------------------------------------------------------


RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "runAsUser": 1000,
}


def test_the_store_pod_is_restricted_and_inherits_the_trainers_identity() -> None:
    spec: dict[str, Any] = manifest()["spec"]
    trainer = dict(spec["template"]["spec"]["containers"][0], securityContext=RESTRICTED_CONTAINER)
    training = job(
        template={"spec": {"containers": [trainer], "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}}
    )
    store = desired.rendezvous_store_pod(training, resolve_launch(training.spec))
    security = store["spec"]["containers"][0]["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert (security["runAsNonRoot"], security["runAsUser"]) == (True, 1000)
    assert store["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    ports = {port["name"]: port["containerPort"] for port in store["spec"]["containers"][0]["ports"]}
    assert naming.METRICS_PORT_NAME in ports  # the operator reads completion from there


def test_creating_the_stores_service_never_clears_the_store_pods_refusal() -> None:
    """The Service and the store pod share a name and are created in one pass: the Service's success
    must not erase the pod's quota refusal, or the next pass takes the never-created store for lost
    and restarts the gang (seen in CI: RendezvousStoreLost after a quota refusal)."""
    memory = RefusalMemory()
    store = naming.rendezvous_name("demo")
    memory.record("uid-demo", ("ml", "demo"), ("Pod", store), "QuotaExceeded", QUOTA, START)
    memory.clear("uid-demo", ("Service", store))  # its Service was created in the same pass
    assert list(memory.of("uid-demo")) == [("Pod", store)]
    world = World(job(workers={"desired": 2}))
    world.reconcile()
    world.pods.pop(store)
    world.refusals.update(memory.of("uid-demo"))
    world.run()
    plan = world.reconcile()
    assert not plan.delete and world.status.get("restartsByReason") in (None, {})


# -- exits during a deletion or an eviction ------------------------------------------------------


def test_a_worker_that_exits_0_while_being_deleted_or_evicted_is_no_success() -> None:
    """A static launcher's script may exit 0 on SIGTERM: a drain must not end the job Succeeded."""
    for stop in ("delete", "evict"):
        world = running(World(job()))
        name = naming.worker_pod_name("demo", 0)
        if stop == "delete":
            world.pods[name]["metadata"]["deletionTimestamp"] = format_time(world.now)  # kubectl drain
            world.terminate(name, 0, reason="Completed")
        else:
            world.terminate(name, 0, reason="Completed")
            world.disrupt(name, "EvictionByEvictionAPI")
            world.pods[name]["status"]["phase"] = "Succeeded"
        world.reconcile()
        assert world.status["phase"] != "Succeeded", (stop, world.status)
        world.finish_terminating()
        world.settle()
        world.run()
        world.settle()
        assert (world.status["phase"], world.status["restarts"]) == ("Running", 0), stop
    world.terminate(naming.worker_pod_name("demo", 1), 0, reason="Completed")  # a real exit 0 still is
    world.reconcile()
    assert world.status["phase"] == "Succeeded"


# -- a job created again under its predecessor's name ---------------------------------------------


def test_a_job_created_again_while_its_predecessors_store_terminates_waits_and_restarts_nothing() -> None:
    """The old store pod (another owner's, terminating) holds the store's name: the new job creates
    no worker until its own store exists, and a store it never had is not lost."""
    world = World(job())
    store = naming.rendezvous_name("demo")
    world.foreign.add(("Pod", store))
    for _ in range(3):
        plan = world.reconcile()
        assert not [obj for obj in plan.apply if obj["kind"] == "Pod"], plan.apply
        assert plan.delete == ()
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "NameConflict")
    assert store in world.status["message"]
    world.foreign.clear()  # the old store is gone
    assert [obj["metadata"]["name"] for obj in world.reconcile().apply if obj["kind"] == "Pod"] == [store]
    world.settle()
    world.run()
    world.settle()
    assert (world.status["phase"], world.status["attempt"]) == ("Running", 0)
    assert world.status.get("restartsByReason") in (None, {})


def test_workers_an_older_operator_created_beside_a_predecessors_store_are_not_restarted() -> None:
    world = World(job())
    world.settle()
    store = naming.rendezvous_name("demo")
    world.pods.pop(store)  # as an older operator left it: its store never created, the name taken
    world.foreign.add(("Pod", store))
    plan = world.reconcile()
    assert plan.delete == () and world.status["attempt"] == 0
    assert world.status.get("restartsByReason") in (None, {})


# -- retries of refused pods ----------------------------------------------------------------------


def refuse_all_workers(world: World, attempts: int = 1) -> None:
    for index in range(world.job.spec.workers.desired):
        name = naming.worker_pod_name("demo", index)
        world.pods.pop(name, None)
        refused(world, name, "QuotaExceeded", QUOTA, attempts)


def created_pods(plan: Any) -> list[str]:
    return [obj["metadata"]["name"] for obj in plan.apply if obj["kind"] == "Pod"]


def test_a_quota_blocked_job_retries_with_one_probe_not_every_worker() -> None:
    world = World(job(workers={"min": 2, "max": 256, "desired": 256}))
    world.settle()
    refuse_all_workers(world)
    assert created_pods(world.reconcile()) == []  # within the pause
    world.advance(REFUSAL_RETRY_SECONDS[0])
    assert created_pods(world.reconcile()) == [naming.worker_pod_name("demo", 0)]
    world.retry_batch = 2  # the probe passed (RefusalMemory.batch)
    world.refusals.pop(("Pod", naming.worker_pod_name("demo", 0)))
    assert created_pods(world.reconcile()) == [naming.worker_pod_name("demo", i) for i in (1, 2)]


def test_retries_of_a_blocked_job_cost_one_request_per_pause_and_double_as_they_pass() -> None:
    """The operator's side of a quota (RefusalMemory records what the API server refused) over seven
    minutes: a job of 64 workers in a namespace where 8 pods fit until the quota is raised."""
    world = World(job(workers={"min": 2, "max": 64, "desired": 64}))
    memory = RefusalMemory()
    uid, key = world.job.metadata.uid, ("ml", "demo")
    room, requests, first = 8, 0, 0
    for second in range(420):
        if second == 200:
            room = 1000  # the quota is raised
        world.refusals = memory.of(uid)
        world.retry_batch = memory.batch(uid)
        plan = world.plan()
        world.carry_out(dataclasses.replace(plan, apply=tuple(o for o in plan.apply if o["kind"] != "Pod")))
        for obj in plan.apply:
            if obj["kind"] != "Pod":
                continue
            requests += 1
            child = ("Pod", obj["metadata"]["name"])
            if len(world.pods) < room:
                world.carry_out(Plan(apply=(obj,)))
                memory.clear(uid, child)
            else:
                memory.record(uid, key, child, "QuotaExceeded", QUOTA, world.now)
        if second == 1:  # the store came first; this pass tried every worker: nothing was refused yet
            first = requests
            assert first == 65 and len(world.pods) == room
        if second == 199:
            # one probe per pause (2, 5, 10, 30, then 60 s), not 57 pods re-POSTed at every retry
            assert requests - first <= 8, requests - first
        world.advance(1)
    assert len(world.workers()) == 64  # all created once the quota allows, in doubling batches
    assert requests - first <= 8 + (65 - 8), requests - first  # each refused pod created once more


def test_a_pod_leaving_the_namespace_wakes_a_blocked_job_once_for_one_probe() -> None:
    memory = RefusalMemory()
    for index in range(64):
        memory.record("uid-demo", ("ml", "demo"), ("Pod", f"demo-worker-{index}"), "QuotaExceeded", QUOTA, START)
    assert memory.quota_freed("ml") == [("ml", "demo")]  # once, not once per refused pod
    assert memory.quota_freed("ml") == []  # already woken
    assert memory.quota_freed("other") == []
    assert memory.batch("uid-demo") == 1
    memory.clear("uid-demo", ("Pod", "demo-worker-0"))
    assert memory.batch("uid-demo") == 2
    memory.clear("uid-demo", ("Pod", "demo-worker-1"))
    memory.clear("uid-demo", ("Pod", "demo-worker-2"))
    assert memory.batch("uid-demo") == 4
    memory.record("uid-demo", ("ml", "demo"), ("Pod", "demo-worker-3"), "QuotaExceeded", QUOTA, START)
    assert memory.batch("uid-demo") == 1


def test_pod_churn_in_the_namespace_cannot_make_a_blocked_job_probe_more_than_every_first_pause() -> None:
    world = World(job(workers={"desired": 4}))
    world.settle()
    refuse_all_workers(world, attempts=5)
    for key, refusal in list(world.refusals.items()):
        world.refusals[key] = dataclasses.replace(refusal, retry_now=True)  # pods keep leaving
    assert created_pods(world.reconcile()) == []  # refused just now
    world.advance(REFUSAL_RETRY_SECONDS[0])
    assert len(created_pods(world.reconcile())) == 1  # not the 60 s pause: a pod left; one probe


# -- a job that is finishing ---------------------------------------------------------------------


def test_a_job_whose_workers_are_finishing_stays_running_until_it_succeeded() -> None:
    """Workers exit 0 one after another, and the kubelet marks a pod Succeeded a moment after its
    container ended: in between the job is finishing, never a job starting again."""
    world = running(World(job()))
    first, second, _third = (naming.worker_pod_name("demo", i) for i in range(3))
    world.terminate(first, 0, reason="Completed", terminal=False)
    world.pods[second]["status"]["conditions"] = [  # shutting down: not ready, still running
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "False"},
    ]
    plan = world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Running", "Completing"), world.status
    assert f"{first} finished training" in world.status["message"]
    assert plan.apply == () and plan.delete == () and plan.events == ()
    assert conditions(world)["Ready"][0] == "True"
    world.terminate(first, 0, reason="Completed")
    world.reconcile()
    assert world.status["phase"] == "Succeeded"


def test_a_rescaling_job_whose_worker_finished_stays_rescaling() -> None:
    world = running(World(job()))
    world.body["status"]["phase"] = "Rescaling"
    world.terminate(naming.worker_pod_name("demo", 2), 0, reason="Completed", terminal=False)
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Rescaling", "Completing"), world.status


def test_a_worker_that_exits_0_while_evicted_is_not_finishing() -> None:
    world = running(World(job()))
    victim = naming.worker_pod_name("demo", 0)
    world.terminate(victim, 0, reason="Completed", terminal=False)
    world.disrupt(victim)
    world.reconcile()
    assert world.status["reason"] != "Completing", world.status
