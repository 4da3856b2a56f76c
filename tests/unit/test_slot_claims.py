"""One pod per worker slot once spares exist: a promotion is recorded as a slot claim in the status
write that must pass the job's resourceVersion before the spare is patched, a claimed slot is
honoured by passes planned from lagging views, and two pods found in one slot are resolved (the
older stays) without counting a failure or a restart."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from phalanx.cluster.apply import Execution, StaleStatusError, execute
from phalanx.cluster.cache import ChildCache, JobCache
from phalanx.cluster.client import ApiClient
from phalanx.cluster.events import EventRecorder
from phalanx.cluster.login import Credentials
from phalanx.cluster.refusals import RefusalMemory
from phalanx.cluster.status_pacing import StatusPacer
from phalanx.reconcile import naming, pod_patches
from phalanx.reconcile.actions import Deletion
from phalanx.reconcile.plan import Plan
from phalanx.reconcile.slots import DUPLICATE_WORKER
from phalanx.reconcile.status import format_time
from tests.unit.local_server import serving
from tests.unit.simulation import START, World
from tests.unit.test_spares import slot_of, two_spares_on_two_nodes


def promoted(plan: Plan) -> list[tuple[str, int]]:
    return [(move.name, move.promotes_slot) for move in plan.move if move.promotes_slot is not None]


def holders(world: World) -> dict[str, list[str]]:
    """Live worker pods of the current attempt by slot."""
    slots: dict[str, list[str]] = {}
    for pod in world.workers(world.status["attempt"]):
        if not pod["metadata"].get("deletionTimestamp") and pod["status"].get("phase") not in ("Succeeded", "Failed"):
            slots.setdefault(slot_of(pod) or "", []).append(pod["metadata"]["name"])
    return slots


def test_a_promotion_is_claimed_in_status_and_the_claim_lasts_as_long_as_its_pod_holds_the_slot() -> None:
    world = two_spares_on_two_nodes()
    spare = world.pods["demo-spare-0"]["metadata"]["uid"]
    world.terminate("demo-worker-1", 1)
    replaced = world.reconcile()
    assert promoted(replaced) == [("demo-spare-0", 1)]
    claim = {"index": 1, "pod": "demo-spare-0", "uid": spare, "attempt": 1}
    assert world.status["slotClaims"] == [claim]
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["slotClaims"] == [claim]  # held while the pod is the slot's
    world.terminate("demo-spare-0", 1)
    world.reconcile()  # its pod failed: the claim goes with it, and the next spare claims the slot
    second = world.pods["demo-spare-1"]["metadata"]["uid"]
    assert world.status["slotClaims"] == [{"index": 1, "pod": "demo-spare-1", "uid": second, "attempt": 2}]


def test_a_pass_from_a_lagging_view_of_the_pods_honours_the_claim_and_promotes_no_second_spare() -> None:
    world = two_spares_on_two_nodes()
    world.body["spec"]["workers"]["desired"] = 4
    lagging = world.observed()  # a replica whose pod cache stops here: both spares ready, slot 3 empty
    world.node_not_ready("node-b")  # demo-spare-0 may not be promoted now
    taken = world.reconcile()
    assert promoted(taken) == [("demo-spare-1", 3)]
    late = world.view(observed=lagging)
    again = world.plan_from(late)
    # the slot is demo-spare-1's: the same patch again (a no-op), and no other spare for it
    assert promoted(again) == [("demo-spare-1", 3)]
    assert world.carry_out(again, view=late)
    assert holders(world)["3"] == ["demo-spare-1"]
    assert world.pods["demo-spare-0"]["metadata"]["labels"][naming.ROLE_LABEL] == naming.ROLE_SPARE


def test_a_sigkill_between_the_claim_and_the_patch_promotes_the_claimed_spare_and_no_other() -> None:
    world = two_spares_on_two_nodes()
    world.body["spec"]["workers"]["desired"] = 4
    world.node_not_ready("node-b")
    world.carry_out(world.plan(), stop_after_status=True)  # the claim is written, the operator dies
    assert [claim["pod"] for claim in world.status["slotClaims"]] == ["demo-spare-1"]
    world.node_ready("node-b")  # demo-spare-0, the lower serial, could be promoted again
    resumed = world.reconcile()
    assert promoted(resumed) == [("demo-spare-1", 3)]
    assert not [obj for obj in resumed.apply if obj["metadata"]["name"] == "demo-worker-3"]
    assert holders(world)["3"] == ["demo-spare-1"]


@pytest.mark.parametrize("older", ["demo-worker-1", "demo-spare-0"])
def test_two_pods_in_one_slot_the_older_stays_and_nothing_is_counted(older: str) -> None:
    world = two_spares_on_two_nodes()
    attempt = world.status["attempt"]
    newer = "demo-spare-0" if older == "demo-worker-1" else "demo-worker-1"
    # a promotion from another view of the pods (the other replica's): two pods in slot 1
    spare = world.pods["demo-spare-0"]["metadata"]
    spare["labels"].update({naming.ROLE_LABEL: naming.ROLE_WORKER, naming.WORKER_INDEX_LABEL: "1"})
    world.pods[older]["metadata"]["creationTimestamp"] = format_time(START)
    world.pods[newer]["metadata"]["creationTimestamp"] = format_time(world.now.replace(second=30))
    resolved = world.reconcile()
    assert [deletion.name for deletion in resolved.delete] == [newer]
    assert [e.message for e in resolved.events if e.reason == DUPLICATE_WORKER] == [
        f"{newer} and {older} both hold worker slot 1: {newer}, the newer, is deleted"
    ]
    assert holders(world) == {"0": ["demo-worker-0"], "1": [older], "2": ["demo-worker-2"]}
    before = copy.deepcopy(world.status)
    world.reconcile()  # the newer one is still going: the slot never emptied, so nothing was lost
    world.finish_terminating()
    world.settle()
    world.run()
    world.reconcile()
    status = world.status
    assert status["phase"] == "Running" and status["attempt"] == attempt
    assert status["restarts"] == 0 and status.get("restartsByReason", {}) == before.get("restartsByReason", {})
    assert "countedFailures" not in status
    assert holders(world) == {"0": ["demo-worker-0"], "1": [older], "2": ["demo-worker-2"]}


# -- the apply path: the claim's status write goes first and carries the job's resourceVersion -----

JOB_PATH = "/apis/phalanx.dev/v1alpha1/namespaces/ml/trainingjobs/demo/status"
POD_PATH = "/api/v1/namespaces/ml/pods/{name}"


class JobStore:
    """The job's status and the pods it patches; a status patch whose resourceVersion is not the
    job's is a 409, as on the API server. ``requests`` lists what came, in order."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.version = 7
        self.status = status
        self.requests: list[str] = []
        app = web.Application()
        app.router.add_patch(JOB_PATH, self.patch_status)
        app.router.add_patch("/api/v1/namespaces/ml/pods/{name}", self.patch_pod)
        app.router.add_delete("/api/v1/namespaces/ml/pods/{name}", self.delete_pod)
        self.app = app

    def job(self, version: int) -> dict[str, Any]:
        metadata = {"name": "demo", "namespace": "ml", "uid": "job-uid", "resourceVersion": str(version)}
        kind = {"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob"}
        return {**kind, "metadata": metadata, "status": self.status}

    async def patch_status(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(f"status at {body.get('metadata', {}).get('resourceVersion')}")
        if body.get("metadata", {}).get("resourceVersion") != str(self.version):
            return web.json_response({"reason": "Conflict", "message": "the object has been modified"}, status=409)
        self.status = {**self.status, **body["status"]}
        self.version += 1
        return web.json_response(self.job(self.version))

    async def patch_pod(self, request: web.Request) -> web.Response:
        self.requests.append(f"patch {request.match_info['name']}")
        metadata = {"name": request.match_info["name"], "namespace": "ml", "uid": "spare-uid", "resourceVersion": "9"}
        return web.json_response({"apiVersion": "v1", "kind": "Pod", "metadata": metadata})

    async def delete_pod(self, request: web.Request) -> web.Response:
        self.requests.append(f"delete {request.match_info['name']}")
        return web.json_response({"kind": "Status", "status": "Success"})


CLAIMED = {"index": 3, "pod": "demo-spare-1", "uid": "spare-uid", "attempt": 2}
STATUS = {"phase": "Running", "reason": "WorkersReady", "message": "3 worker(s) training", "attempt": 2}
PROMOTION = pod_patches.promotion("demo-spare-1", "spare-uid", 0, 2, "job-uid-2", 3)


@pytest.fixture
async def store() -> AsyncIterator[tuple[JobStore, Execution]]:
    backend = JobStore({**STATUS, "slotClaims": [CLAIMED]})
    async with serving(backend.app) as url, ApiClient(Credentials(server=url), timeout=2) as client:
        pacer = StatusPacer(interval=60.0)
        pacer.wrote(("ml", "demo"))  # a progress write went out a moment ago: the next would wait
        yield backend, Execution(client, JobCache(), ChildCache(), RefusalMemory(), EventRecorder(client), pacer)


async def test_a_claimed_promotion_sent_again_from_a_stale_job_is_refused_before_its_patch(
    store: tuple[JobStore, Execution],
) -> None:
    backend, run = store
    # status as the plan was made from it (nothing to change), but the job was written since
    plan = Plan(move=(PROMOTION,), status={**STATUS, "slotClaims": [CLAIMED]})
    with pytest.raises(StaleStatusError):
        await execute(plan, run, job=backend.job(backend.version - 1), now=START)
    assert backend.requests == ["status at 6"]  # no patch


async def test_a_promotion_whose_status_only_reports_progress_is_not_held_back_by_the_pacer(
    store: tuple[JobStore, Execution],
) -> None:
    backend, run = store
    plan = Plan(move=(PROMOTION,), status={**STATUS, "message": "4 worker(s) training", "slotClaims": [CLAIMED]})
    await execute(plan, run, job=backend.job(backend.version), now=START)
    assert backend.requests == ["status at 7", "patch demo-spare-1"]


async def test_the_pod_leaving_a_slot_is_deleted_before_a_spare_is_moved_into_it(
    store: tuple[JobStore, Execution],
) -> None:
    """A spare takes the slot of a worker still waiting for a node: that worker's deletion goes
    first, so the two never hold the slot together (under a slow API server, or a SIGKILL between)."""
    backend, run = store
    waiting = Deletion("Pod", "demo-worker-3")
    plan = Plan(move=(PROMOTION,), delete=(waiting,), status={**STATUS, "slotClaims": [CLAIMED]})
    await execute(plan, run, job=backend.job(backend.version), now=START)
    assert backend.requests == ["status at 7", "delete demo-worker-3", "patch demo-spare-1"]


def test_of_two_pods_in_one_slot_the_one_bound_to_a_node_stays_though_the_other_is_older() -> None:
    """A spare promoted into the slot of a worker still waiting for a node, and the pass cut short
    before it deleted that worker: the running spare keeps the slot, the older waiting pod goes."""
    world = two_spares_on_two_nodes()
    attempt = world.status["attempt"]
    spare = world.pods["demo-spare-0"]["metadata"]
    spare["labels"].update({naming.ROLE_LABEL: naming.ROLE_WORKER, naming.WORKER_INDEX_LABEL: "1"})
    waiting = world.pods["demo-worker-1"]
    waiting["spec"].pop("nodeName")
    waiting["metadata"]["creationTimestamp"] = format_time(START)
    spare["creationTimestamp"] = format_time(world.now.replace(second=30))
    resolved = world.reconcile()
    assert [deletion.name for deletion in resolved.delete] == ["demo-worker-1"]
    assert [e.message for e in resolved.events if e.reason == DUPLICATE_WORKER] == [
        "demo-worker-1 and demo-spare-0 both hold worker slot 1: demo-worker-1, waiting for a node, is deleted"
    ]
    world.finish_terminating()
    world.settle()
    assert world.status["attempt"] == attempt and world.status["restarts"] == 0
    assert holders(world)["1"] == ["demo-spare-0"]
