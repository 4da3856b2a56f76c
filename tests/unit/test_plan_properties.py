"""Property tests of the planner's invariants over generated specs and event sequences."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from phalanx.reconcile import naming
from phalanx.reconcile.slots import DUPLICATE_WORKER
from tests.unit.crd_validation import validate
from tests.unit.jobs import job, manifest
from tests.unit.simulation import World

NCCL_PREFIXES = ("NCCL_", "TORCH_NCCL_")


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    """Spec overrides the schema accepts."""
    low = draw(st.integers(1, 6))
    high = draw(st.integers(low, 8))
    wanted = draw(st.integers(low, high))
    gpus = draw(st.sampled_from([0, 0, 1, 2, 8]))
    spec: dict[str, Any] = {"workers": {"min": low, "max": high, "desired": wanted}, "gpus": {"count": gpus}}
    if gpus:
        spec["backend"] = draw(st.sampled_from(["auto", "nccl"]))
        profile = draw(st.sampled_from(["auto", "tcp", "infiniband", "efa"]))
        network: dict[str, Any] = {"profile": profile}
        if profile in ("infiniband", "efa") or draw(st.booleans()):
            network["rdma"] = {"resource": "rdma/hca", "count": draw(st.integers(1, 2))}
            if draw(st.booleans()):
                network["hcas"] = ["mlx5_0", "mlx5_1"]
        spec["network"] = network
        if draw(st.booleans()):
            spec["procsPerWorker"] = draw(st.integers(1, gpus))
    else:
        spec["backend"] = draw(st.sampled_from(["auto", "gloo"]))
        if draw(st.booleans()):
            spec["procsPerWorker"] = draw(st.integers(1, 4))
    gang = draw(st.sampled_from(["none", "scheduler-plugins", "volcano", "kueue"]))
    spec["gang"] = {"scheduler": gang}
    if gang in ("volcano", "kueue"):
        spec["gang"]["queue"] = "research"
    if draw(st.booleans()):
        spec["checkpoint"] = {"claimName": "ckpt", "keep": draw(st.integers(1, 5))}
    return spec


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    return {var["name"]: var.get("value", "") for var in container["env"]}


def started(spec: dict[str, Any]) -> World:
    world = World(job(**spec))
    world.reconcile()
    world.reconcile()  # workers follow once the store (and the PodGroup, if any) exists
    return world


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(specs())
def test_generated_specs_are_valid(spec: dict[str, Any]) -> None:
    assert validate(manifest(**spec)) == []


@FAST
@given(specs())
def test_names_and_indices_are_unique_and_deterministic(spec: dict[str, Any]) -> None:
    first, second = started(spec), started(spec)
    assert first.pods.keys() == second.pods.keys()
    assert [p["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION] for p in first.pods.values()] == [
        p["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION] for p in second.pods.values()
    ]
    indices = [int(p["metadata"]["labels"][naming.WORKER_INDEX_LABEL]) for p in first.workers()]
    assert sorted(indices) == list(range(spec["workers"]["desired"]))
    assert [env_of(p)["PHALANX_WORKER_INDEX"] for p in first.workers()] == [str(i) for i in sorted(indices)]


@FAST
@given(specs())
def test_world_size_stays_within_min_and_max(spec: dict[str, Any]) -> None:
    world = started(spec)
    low, high = spec["workers"]["min"], spec["workers"]["max"]
    assert low <= len(world.workers()) <= high
    for pod in world.workers():
        assert env_of(pod)["PET_NNODES"] == f"{low}:{high}"


@FAST
@given(specs())
def test_every_worker_environment_matches_the_spec(spec: dict[str, Any]) -> None:
    world = started(spec)
    gpus = spec["gpus"]["count"]
    procs = spec.get("procsPerWorker") or (gpus or 1)
    for pod in world.workers():
        env = env_of(pod)
        backend = "nccl" if gpus else "gloo"
        assert env["PHALANX_BACKEND"] == backend
        assert env["PET_NPROC_PER_NODE"] == str(procs)
        assert env["PET_RDZV_ENDPOINT"] == "demo-rdzv.ml.svc:29400"
        assert env["PET_RDZV_ID"].endswith("-0")
        assert "is_host=false" in env["PET_RDZV_CONF"]
        assert "NCCL_IB_GID_INDEX" not in env
        has_nccl = any(name.startswith(NCCL_PREFIXES) for name in env)
        assert has_nccl == (backend == "nccl")
        if backend == "nccl":
            assert env.get("NCCL_NET") in ("IB", "Socket") or env.get("FI_PROVIDER") == "efa"
        trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
        limits = trainer["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu") == (str(gpus) if gpus else None)
        assert ("PHALANX_CHECKPOINT_DIR" in env) == ("checkpoint" in spec)
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "5f1c0d2e-aaaa-bbbb-cccc-000000000001"


@FAST
@given(specs())
def test_planning_against_its_own_result_changes_nothing(spec: dict[str, Any]) -> None:
    world = started(spec)
    assert not world.reconcile().changes_children
    world.run()
    world.reconcile()
    assert not world.reconcile().changes_children


@FAST
@given(specs(), st.integers(0, 20), st.integers(0, 3600), st.integers(1, 100000))
def test_spec_change_that_needs_no_pod_change_makes_none(
    spec: dict[str, Any], restarts: int, ttl: int, deadline: int
) -> None:
    world = started(spec)
    world.run()
    world.reconcile()
    world.body["spec"]["failurePolicy"]["maxRestarts"] = restarts
    world.body["spec"]["ttlSecondsAfterFinished"] = ttl
    world.body["spec"]["activeDeadlineSeconds"] = deadline
    world.body["metadata"]["generation"] = 2
    plan = world.reconcile()
    assert not plan.changes_children
    assert world.status["observedGeneration"] == 2


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["run", "fail", "oom", "evict", "delete", "succeed", "scale", "wait", "lose-node"]),
        st.integers(0, 7),
    ),
    max_size=25,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs(), ACTIONS)
def test_invariants_hold_through_any_sequence_of_events(spec: dict[str, Any], actions: list[tuple[str, int]]) -> None:
    world = started(spec)
    low, high = spec["workers"]["min"], spec["workers"]["max"]
    restarts = attempt = 0
    for action, number in actions:
        workers = [p for p in world.workers(world.status["attempt"]) if not p["metadata"].get("deletionTimestamp")]
        target = workers[number % len(workers)]["metadata"]["name"] if workers else None
        if action == "run":
            world.run()
        elif action in ("fail", "oom", "succeed") and target:
            world.run(target)
            world.terminate(
                target, {"fail": 1, "oom": 137, "succeed": 0}[action], "OOMKilled" if action == "oom" else "Error"
            )
        elif action == "evict" and target:
            world.run(target)
            world.disrupt(target)
        elif action == "delete" and target:
            world.delete_pod(target)
        elif action == "scale":
            world.body["spec"]["workers"]["desired"] = low + number % (high - low + 1)
        elif action == "wait":
            world.advance(60 * number)
            world.finish_terminating()
        elif action == "lose-node" and target:
            world.run(target, node=f"node-{number}")
            world.node_not_ready(world.pods[target]["spec"]["nodeName"])  # lost once "wait" passes its grace
        world.reconcile()
        status = world.status
        assert status["restarts"] >= restarts and status["attempt"] >= attempt
        restarts, attempt = status["restarts"], status["attempt"]
        live = [p for p in world.workers(attempt) if p["status"].get("phase") not in ("Succeeded", "Failed")]
        assert len(live) <= high
        indices = [p["metadata"]["labels"][naming.WORKER_INDEX_LABEL] for p in world.workers()]
        assert len(indices) == len(set(indices))
        assert status["phase"] in (
            "Pending",
            "Starting",
            "Running",
            "Rescaling",
            "Restarting",
            "Succeeded",
            "Failed",
            "Suspended",
        )
        if status["phase"] == "Failed":
            assert {c["type"]: c["status"] for c in status["conditions"]}["Stalled"] == "True"
        if status["phase"] in ("Succeeded", "Failed"):
            break


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_workers_failing_in_one_pass_are_one_counted_failure_whatever_survives(data: st.DataObject) -> None:
    """Below workers.min survivors the gang restarts, above it each failed worker is replaced: the
    count is one failure event either way, with every failed pod's UID recorded."""
    wanted = data.draw(st.integers(1, 8), label="desired")
    low = data.draw(st.integers(1, wanted), label="min")
    world = World(job(workers={"min": low, "max": 8, "desired": wanted}, failurePolicy={"maxRestarts": 1}))
    world.settle()
    world.run()
    world.reconcile()
    names = [pod["metadata"]["name"] for pod in world.workers()]
    failing = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True), label="failing")
    for name in failing:
        world.terminate(name, data.draw(st.sampled_from([1, 137]), label=f"exit code of {name}"), "Error")
    uids = {world.pods[name]["metadata"]["uid"] for name in failing}
    world.reconcile()
    status = world.status
    assert status["restarts"] == 1 and sum(status["restartsByReason"].values()) == 1
    assert status["phase"] != "Failed"  # one event of a budget of one
    assert uids <= set(status.get("countedFailures") or ())
    world.reconcile()  # the same failures seen again count nothing
    assert world.status["restarts"] == 1


SPARE_EVENTS = st.sampled_from(["run", "fail", "delete", "fail-spare", "scale", "wait", "lose-node", "spares"])
SPARE_ACTIONS = st.lists(st.tuples(SPARE_EVENTS, st.integers(0, 7)), max_size=25)


def spare_world(low: int, high: int, spares: int, *, desired: int | None = None) -> World:
    """A supervised job at ``desired`` (else ``high``) workers with ``spares`` spares, all running."""
    containers = [{"name": "trainer", "image": "example/train:1", "command": ["phalanx-supervise", "--", "torchrun"]}]
    workers = {"min": low, "max": high, "desired": desired or high, "spares": spares}
    world = World(job(workers=workers, template={"spec": {"containers": containers}}))
    for _ in range(2):  # the workers, then the spares behind them, running
        world.settle()
        world.run()
    return world


def spare_event(world: World, action: str, number: int, low: int, high: int) -> int:
    """Play one event of SPARE_EVENTS on ``world``; returns the worker failures it caused (0 or 1)."""
    live_workers = [p for p in world.workers(world.status["attempt"]) if not p["metadata"].get("deletionTimestamp")]
    target = live_workers[number % len(live_workers)]["metadata"]["name"] if live_workers else None
    live_spares = [p for p in world.spares() if not p["metadata"].get("deletionTimestamp")]
    if action == "run":
        world.run()
    elif action == "fail" and target:
        world.run(target)
        world.terminate(target, 1)
        return 1
    elif action == "delete" and target:
        world.pods[target]["metadata"]["deletionTimestamp"] = "2026-11-30T10:00:00Z"
    elif action == "fail-spare" and live_spares:
        world.terminate(live_spares[number % len(live_spares)]["metadata"]["name"], 137, "OOMKilled")
    elif action == "scale":
        world.body["spec"]["workers"]["desired"] = low + number % (high - low + 1)
    elif action == "spares":
        world.body["spec"]["workers"]["spares"] = number % 3
    elif action == "wait":
        world.advance(30 * number)
        world.finish_terminating()
    elif action == "lose-node" and target:
        world.run(target, node=f"node-{number}")
        world.node_not_ready(f"node-{number}")
    return 0


def live_slots(world: World, attempt: int | None = None) -> list[str]:
    """The slots of the worker pods that are neither going nor finished (of ``attempt``, or any)."""
    return [
        p["metadata"]["labels"][naming.WORKER_INDEX_LABEL]
        for p in world.workers(attempt)
        if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") not in ("Succeeded", "Failed")
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(0, 3), st.integers(1, 2), SPARE_ACTIONS)
def test_with_spares_every_slot_has_at_most_one_live_pod_and_spares_never_count_as_restarts(
    low: int, more: int, spares: int, actions: list[tuple[str, int]]
) -> None:
    high = low + more
    world = spare_world(low, high, spares)
    counted = 0
    for action, number in actions:
        counted += spare_event(world, action, number, low, high)
        world.reconcile()
        status = world.status
        if status["phase"] in ("Succeeded", "Failed"):
            break
        slots = live_slots(world)
        assert len(slots) == len(set(slots)), slots
        assert len(slots) <= high
        for spare in world.spares():
            assert naming.WORKER_INDEX_LABEL not in spare["metadata"]["labels"]
        waiting = [
            p
            for p in world.spares()
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") not in ("Succeeded", "Failed")
        ]
        assert len(waiting) <= world.body["spec"]["workers"]["spares"]
        assert status["restarts"] <= counted  # a spare's failure is never a restart


# A race: a second replica (or a cache that lags) keeps the view it would plan from; the world moves
# on by one event and the operator's pass with it; then the replica plans from its view, either all of
# it (its status write is refused once the job changed) or its pods under the job as it is now (a pod
# cache that lags the job cache), and its plan is carried out. "spare-node": the node of the spare a
# pass would promote first stops being Ready, or comes back.
STALE_EVENTS = ["spare-node", "scale", "fail", "fail-spare", "run", "wait"]
STALE_STEPS = st.sampled_from(["pass", "race", "race", *STALE_EVENTS])


def stale_event(world: World, action: str, number: int, low: int, high: int) -> None:
    """Play one of STALE_EVENTS."""
    live_spares = [p for p in world.spares() if not p["metadata"].get("deletionTimestamp")]
    if action == "spare-node" and live_spares:
        node = min(live_spares, key=lambda p: p["metadata"]["name"])["spec"].get("nodeName") or "node-a"
        if node in world.unready_nodes:
            world.node_ready(node)
        else:
            world.node_not_ready(node)
    else:
        spare_event(world, action, number, low, high)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# one more slot, the node of the first spare stops being Ready, and a replica whose pod cache lags
# plans: it would promote the spare the operator did not; with one spare, create a new worker pod
@example(1, 1, 1, 2, [("race", 2)])
@example(1, 1, 1, 1, [("spare-node", 0), ("race", 6)])
@given(
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(1, 3),
    st.lists(st.tuples(STALE_STEPS, st.integers(0, 15)), max_size=30),
)
def test_passes_from_stale_views_never_leave_two_pods_in_a_slot_once_a_pass_resolves(
    low: int, more: int, fewer: int, spares: int, actions: list[tuple[str, int]]
) -> None:
    """Spares promoted, failing and replaced, with passes planned from older views (a second
    replica, a lagging cache, a pass sent again) carried out in between: after every pass of the
    operator that sees the world as it is, no slot of the current attempt has two live pods, and
    the pass after one that resolved two pods in one slot counts nothing for it."""
    high = low + more
    world = spare_world(low, high, spares, desired=max(low, high - fewer))
    for spare in world.spares():  # each on a node of its own
        spare["spec"]["nodeName"] = f"node-{spare['metadata']['name']}"
    for action, number in [*actions, ("pass", 0)]:
        if action == "race":
            kept = world.view()
            stale_event(world, STALE_EVENTS[number % 3], number, low, high)
            world.reconcile()
            stale = kept if number // 8 else world.view(observed=kept.observed)
            world.carry_out(world.plan_from(stale), view=stale)
            continue
        if action != "pass":
            stale_event(world, action, number, low, high)
            continue
        events = world.reconcile().events
        status = world.status
        if status["phase"] in ("Succeeded", "Failed"):
            break
        slots = live_slots(world, status["attempt"])
        assert len(slots) == len(set(slots)), slots
        # the pods deleted as the newer of two in a slot: no failure and no restart in the next pass
        newer = {event.message.split()[0] for event in events if event.reason == DUPLICATE_WORKER}
        if newer:
            uids = {world.pods[name]["metadata"]["uid"] for name in newer if name in world.pods}
            tally = (status["attempt"], status["restarts"])
            after = world.reconcile()
            assert (world.status["attempt"], world.status["restarts"]) == tally
            assert not uids & set(world.status.get("countedFailures") or ())
            assert not [event for event in after.events if any(name in event.message for name in newer)]
