"""The busy cluster: other tenants' pods already hold half of the GPUs, on racks of uneven size.

Each test gets a pool of KWOK racks (``LAYOUT``) whose GPUs other tenants' pods, bound by name in
a namespace of their own, partly hold (``HELD``: 52 of 104 GPUs). The operator is not told of
them: it sees them as any cluster shows them, pods on nodes. Invariants checked here:

- a required-topology gang is placed at once in a rack that really has room (never in a full one
  waiting for the move), the tightest that fits, so a larger gang still finds a whole rack;
- a node of the gang's rack that blips NotReady or is cordoned moves nothing: no restart, no new
  domain, the same pods;
- a spare that waited unschedulable never leaves the job short of a worker once it is ready.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from phalanx.reconcile import naming
from tests.cluster.busy import RACK, BusyRacks, busy_racks
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import POOL_LABEL, TRAINER, status, wait_status
from tests.integration.test_gang import (  # noqa: F401  (coscheduling: a fixture, asked for by name)
    GANG_GPU,
    NodePool,
    bound,
    coscheduling,
    job_workers,
    placed_job,
)
from tests.unit.jobs import manifest

pytestmark = [pytest.mark.integration, pytest.mark.gang, pytest.mark.late_binaries("scheduler-plugins")]

SUPERVISED = {**TRAINER, "command": ["phalanx-supervise", "--", "torchrun"]}  # spares need the supervisor


@pytest.fixture
def busy(kwok_cluster: LocalCluster, kubectl: Kubectl) -> Iterator[tuple[NodePool, BusyRacks]]:
    """The pool's racks, half of their GPUs held by other tenants (tests/cluster/busy.py)."""
    with NodePool(kwok_cluster, kubectl) as pool:

        def add(rack: str, count: int) -> list[str]:
            return pool.add(count, labels={RACK: rack})

        with busy_racks(kubectl, add, pool.name, GANG_GPU) as racks:
            yield pool, racks


def racks_of(kubectl: Kubectl, namespace: str, name: str, rack_of: dict[str, str]) -> set[str]:
    return {
        rack_of[pod["spec"]["nodeName"]] for pod in job_workers(kubectl, namespace, name) if pod["spec"].get("nodeName")
    }


@pytest.fixture(params=["none", "scheduler-plugins"])
def operator_placed(request: pytest.FixtureRequest) -> str:
    """A gang scheduler under which the operator chooses the rack itself."""
    if request.param == "scheduler-plugins":
        request.getfixturevalue("coscheduling")
    return str(request.param)


def test_a_required_gang_runs_at_once_in_the_tightest_rack_other_tenants_left_room_in(
    kubectl: Kubectl,
    namespace: str,
    busy: tuple[NodePool, BusyRacks],
    operator: OperatorProcess,
    operator_placed: str,
) -> None:
    pool, racks = busy
    rack_of = racks.rack_of
    submitted = time.monotonic()
    placed_job(kubectl, namespace, pool, operator_placed, workers={"min": 2, "max": 2, "desired": 2})
    state = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Running", "Running", 60, name="placed")
    took = time.monotonic() - submitted
    print(f"{operator_placed}: the gang of 2 ran in {state['placement']['domain']} {took:.1f} s after submission")
    # b is the tightest rack that fits 2; a (full) and d (roomier) are not chosen, and nothing moved
    assert state["placement"] == {"key": RACK, "domain": racks.rack("b")}, state
    assert racks_of(kubectl, namespace, "placed", rack_of) == {racks.rack("b")}
    moves = [e for e in kubectl.list("events", namespace) if "moved from" in e.get("message", "")]
    assert moves == [], moves
    assert took < 60, took  # far below the 120 s a gang waited in a full rack before it was moved

    # a gang of 3 still finds a whole rack: d, which best fit left free
    placed_job(kubectl, namespace, pool, operator_placed, name="larger", workers={"min": 3, "max": 3, "desired": 3})
    larger = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Running", "Running", 60, name="larger")
    assert larger["placement"] == {"key": RACK, "domain": racks.rack("d")}, larger
    assert racks_of(kubectl, namespace, "larger", rack_of) == {racks.rack("d")}


def test_a_blip_and_a_cordon_in_the_gangs_rack_move_nothing(
    kwok_cluster: LocalCluster,
    kubectl: Kubectl,
    namespace: str,
    busy: tuple[NodePool, BusyRacks],
    operator: OperatorProcess,
) -> None:
    pool, racks = busy
    rack_of = racks.rack_of
    placed_job(kubectl, namespace, pool, "none", workers={"min": 2, "max": 2, "desired": 2})
    before = wait_status(kubectl, namespace, lambda s: s.get("phase") == "Running", "Running", 60, name="placed")
    pods = {p["metadata"]["name"]: p for p in job_workers(kubectl, namespace, "placed")}
    uids = {name: pod["metadata"]["uid"] for name, pod in pods.items()}
    first, second = sorted(pod["spec"]["nodeName"] for pod in pods.values())

    kwok_cluster.set_node_not_ready(first)  # a blip, far shorter than the node-lost grace
    time.sleep(3)
    kwok_cluster.set_node_not_ready(first, False)
    kubectl.run("cordon", second)
    try:
        deadline = time.monotonic() + 15  # a few passes and node events later
        while time.monotonic() < deadline:
            state = status(kubectl, namespace, "placed")
            assert state.get("placement") == before["placement"], state
            assert state.get("restarts", 0) == 0 and state.get("attempt", 0) == 0, state
            now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job_workers(kubectl, namespace, "placed")}
            assert now == uids, (now, uids)
            time.sleep(1)
        assert bound(job_workers(kubectl, namespace, "placed")) == 2
        assert racks_of(kubectl, namespace, "placed", rack_of) == {before["placement"]["domain"]}
    finally:
        kubectl.run("uncordon", second)


def test_a_spare_that_waited_unschedulable_leaves_the_job_short_of_no_worker_once_it_is_ready(
    kwok_cluster: LocalCluster,
    kubectl: Kubectl,
    namespace: str,
    busy: tuple[NodePool, BusyRacks],
    operator: OperatorProcess,
) -> None:
    """Rack b holds the gang of 2 and no more, so its spare waits unschedulable. A worker fails:
    whichever pod the scheduler binds in the room it freed (the replacement or the spare), the job
    is whole again, and never short of a worker while a spare is ready beside it."""
    pool, racks = busy
    body = manifest(
        workers={"min": 1, "max": 2, "desired": 2, "spares": 1},
        gpus={"count": 8, "resource": GANG_GPU},
        failurePolicy={"maxRestarts": 3, "backoffSeconds": 1, "maxBackoffSeconds": 2},
        placement={"topology": {"key": RACK, "mode": "required"}},
        template={"spec": {"containers": [SUPERVISED], "nodeSelector": {POOL_LABEL: pool.name}}},
    )
    body["metadata"] = {"name": "spared"}
    kubectl.create(body, namespace=namespace)
    wait_status(
        kubectl, namespace, lambda s: s.get("workerSummary") == "2/2 +0 spare", "2/2, no spare ready", 60, name="spared"
    )
    state = status(kubectl, namespace, "spared")
    assert state["placement"]["domain"] == racks.rack("b"), state
    kubectl.wait_for(
        lambda: [
            p
            for p in kubectl.list("pods", namespace, f"{naming.ROLE_LABEL}={naming.ROLE_SPARE}")
            if not p["spec"].get("nodeName")
        ],
        timeout=30,
        what="the spare waiting unschedulable",
    )
    victim = sorted(p["metadata"]["name"] for p in job_workers(kubectl, namespace, "spared"))[0]
    kwok_cluster.finish_pod(namespace, victim, 1)

    short_since: float | None = None
    deadline = time.monotonic() + 60
    while True:
        state = status(kubectl, namespace, "spared")
        pods = kubectl.list("pods", namespace, f"{naming.JOB_NAME_LABEL}=spared")
        attempt = str(state.get("attempt", 0))
        live = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
        workers = [
            p
            for p in live
            if p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_WORKER
            and p["metadata"]["labels"].get(naming.ATTEMPT_LABEL) == attempt
        ]
        spares = [p for p in live if p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_SPARE]
        if len(workers) == 2 and state.get("workers", {}).get("ready") == 2:
            break
        if spares and len(workers) < 2:  # a ready spare beside an empty slot: a pass or two at most
            short_since = short_since or time.monotonic()
            assert time.monotonic() - short_since < 10, (state, [p["metadata"]["name"] for p in pods])
        else:
            short_since = None
        assert time.monotonic() < deadline, (state, [(p["metadata"]["name"], p["spec"].get("nodeName")) for p in pods])
        time.sleep(0.5)
    assert {racks.rack_of[p["spec"]["nodeName"]] for p in workers} == {racks.rack("b")}
    assert state.get("restartsByReason") == {"WorkerFailed": 1}, state
