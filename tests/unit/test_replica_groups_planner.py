"""The planner with spec.replicaGroups: a failure restarts its group alone (counted once per group),
the other groups' pods are left running, each group is its own torchrun world, and the gang restarts
whole (from the checkpoint, counted once) when fewer than replicaGroups.min groups would train on."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.reconcile import naming
from phalanx.reconcile.plan import Plan
from tests.unit.jobs import job
from tests.unit.simulation import World, running

GROUPS: dict[str, Any] = {
    "workers": {"min": 3, "max": 9, "desired": 9},
    "replicaGroups": {"size": 3, "min": 2},
    "failurePolicy": {"maxRestarts": 3},
}


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {var["name"]: var.get("value", "") for var in pod["spec"]["containers"][0]["env"]}


def uids(world: World) -> dict[str, str]:
    return {name: pod["metadata"]["uid"] for name, pod in world.pods.items() if "worker" in name}


def worker(index: int) -> str:
    return naming.worker_pod_name("demo", index)


def test_each_group_is_a_torchrun_world_of_its_own() -> None:
    world = running(World(job(**GROUPS)))
    envs = [env_of(world.pods[worker(index)]) for index in range(9)]
    assert {env["PET_NNODES"] for env in envs} == {"3"}
    assert [env["PHALANX_REPLICA_GROUP"] for env in envs] == [str(i // 3) for i in range(9)]
    assert [env["PHALANX_REPLICA_GROUP_RANK"] for env in envs] == [str(i % 3) for i in range(9)]
    assert len({env["PET_RDZV_ID"] for env in envs}) == 3
    assert world.pods[worker(4)]["metadata"]["labels"][naming.REPLICA_GROUP_LABEL] == "1"
    assert [group["ready"] for group in world.status["replicaGroups"]] == [True, True, True]


def test_a_failure_restarts_its_group_alone_and_counts_once() -> None:
    world = running(World(job(**GROUPS)))
    before = uids(world)
    old_id = env_of(world.pods[worker(4)])["PET_RDZV_ID"]
    world.terminate(worker(4), 1, message="RuntimeError: boom")
    world.terminate(worker(5), 1, message="RuntimeError: boom too")
    world.reconcile()
    assert world.status["restarts"] == 1
    assert world.status["phase"] in ("Running", "Rescaling")  # training with the groups left
    # group 1's survivor goes with the failed ones; groups 0 and 2 are untouched
    assert world.pods[worker(3)]["metadata"].get("deletionTimestamp")
    for index in (0, 1, 2, 6, 7, 8):
        assert world.pods[worker(index)]["metadata"]["uid"] == before[worker(index)]
        assert not world.pods[worker(index)]["metadata"].get("deletionTimestamp")
    world.settle()
    world.run()
    world.settle()
    after = uids(world)
    assert all(after[worker(index)] != before[worker(index)] for index in (3, 4, 5))
    assert all(after[worker(index)] == before[worker(index)] for index in (0, 1, 2, 6, 7, 8))
    new_env = env_of(world.pods[worker(4)])
    assert new_env["PET_RDZV_ID"] != old_id
    assert new_env["PHALANX_REPLICA_GROUP_GENERATION"] == "1"
    assert world.status["replicaGroups"][1] == {"index": 1, "generation": 1, "ready": True, "restarts": 1}
    assert world.status["replicaGroups"][0]["generation"] == 0
    assert world.status["restarts"] == 1
    assert world.status["attempt"] == 0  # no gang restart


def test_two_groups_failing_in_one_pass_count_twice() -> None:
    world = running(World(job(**{**GROUPS, "replicaGroups": {"size": 3, "min": 1}})))
    world.terminate(worker(0), 1, message="RuntimeError: a")
    world.terminate(worker(8), 1, message="RuntimeError: b")
    world.reconcile()
    assert world.status["restarts"] == 2
    assert [group["generation"] for group in world.status["replicaGroups"]] == [1, 0, 1]
    assert not world.pods[worker(4)]["metadata"].get("deletionTimestamp")


def test_a_restart_cut_after_its_status_write_is_neither_counted_nor_done_twice() -> None:
    world = running(World(job(**GROUPS)))
    world.terminate(worker(4), 1, message="RuntimeError: boom")
    for _ in range(3):
        world.carry_out(world.plan(), stop_after_status=True)
    assert world.status["restarts"] == 1
    assert world.status["replicaGroups"][1]["generation"] == 1
    world.reconcile()  # the old generation's pods go, not counted
    assert all(world.pods[worker(index)]["metadata"].get("deletionTimestamp") for index in (3, 5))
    world.settle()
    world.run()
    world.settle()
    assert world.status["restarts"] == 1
    assert world.status["replicaGroups"][1]["generation"] == 1
    assert {world.pods[worker(index)]["metadata"]["labels"][naming.GROUP_GENERATION_LABEL] for index in (3, 4, 5)} == {
        "1"
    }


def test_a_peer_that_exits_after_its_group_restart_was_recorded_is_no_new_failure() -> None:
    world = running(World(job(**GROUPS)))
    world.terminate(worker(4), 1, message="RuntimeError: boom")
    world.carry_out(world.plan(), stop_after_status=True)
    world.terminate(worker(3), 1, message="RendezvousClosedError")  # its world broke up
    world.reconcile()
    world.settle()
    world.run()
    world.settle()
    assert world.status["restarts"] == 1
    assert world.status["replicaGroups"][1] == {"index": 1, "generation": 1, "ready": True, "restarts": 1}


def test_a_deleted_worker_restarts_its_group_uncounted() -> None:
    world = running(World(job(**GROUPS)))
    world.pods[worker(7)]["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"  # kubectl delete pod
    world.reconcile()
    assert world.status.get("restarts", 0) == 0
    assert world.status["replicaGroups"][2]["generation"] == 1
    assert world.pods[worker(6)]["metadata"].get("deletionTimestamp")


def events(plan: Plan, reason: str) -> list[str]:
    return [one.message for one in plan.events if one.reason == reason]


def test_groups_below_min_restart_the_gang_from_the_checkpoint_counted_once() -> None:
    world = running(World(job(**GROUPS)))  # min 2 of 3 groups
    world.terminate(worker(0), 1, message="RuntimeError: a")
    world.terminate(worker(4), 1, message="RuntimeError: b")
    plan = world.reconcile()
    assert world.status["attempt"] == 1
    assert world.status["restarts"] == 1  # one gang restart, whatever the groups
    assert world.status["phase"] == "Restarting"
    assert [group["generation"] for group in world.status["replicaGroups"]] == [0, 0, 0]
    [message] = events(plan, "GangRestart")
    assert "1 of 3 replica group(s) would train on, fewer than replicaGroups.min (2)" in message
    assert not events(plan, "ReplicaGroupRestart")


def test_groups_down_to_min_restart_alone() -> None:
    world = running(World(job(**{**GROUPS, "replicaGroups": {"size": 3, "min": 1}})))
    world.terminate(worker(0), 1, message="RuntimeError: a")
    world.terminate(worker(4), 1, message="RuntimeError: b")
    plan = world.reconcile()
    assert world.status["attempt"] == 0
    assert [group["generation"] for group in world.status["replicaGroups"]] == [1, 1, 0]
    assert not world.pods[worker(7)]["metadata"].get("deletionTimestamp")
    assert len(events(plan, "ReplicaGroupRestart")) == 2


def coming_back(world: World, index: int) -> None:
    """The group of worker ``index`` restarted alone; its new pods are made but not running yet."""
    world.terminate(worker(index), 1, message="RuntimeError: first")
    world.reconcile()
    world.finish_terminating()
    world.settle()
    group = index // 3
    assert world.status["replicaGroups"][group]["generation"] == 1
    assert world.status["replicaGroups"][group]["ready"] is False


def test_a_group_still_coming_back_does_not_count_towards_min() -> None:
    world = running(World(job(**GROUPS)))
    coming_back(world, 4)
    world.terminate(worker(0), 1, message="RuntimeError: second")
    plan = world.reconcile()
    # group 2 alone trains on: below min 2, though group 1 is on its way back
    assert world.status["attempt"] == 1
    assert world.status["restarts"] == 2
    [message] = events(plan, "GangRestart")
    assert "1 of 3 replica group(s) would train on" in message


def test_a_group_back_and_ready_counts_towards_min_again() -> None:
    world = running(World(job(**GROUPS)))
    coming_back(world, 4)
    world.run()
    world.reconcile()
    assert world.status["replicaGroups"][1]["ready"] is True
    world.terminate(worker(0), 1, message="RuntimeError: second")
    world.reconcile()
    assert world.status["attempt"] == 0
    assert [group["generation"] for group in world.status["replicaGroups"]] == [1, 1, 0]


def test_with_min_one_the_gang_restarts_when_no_group_holds_the_weights() -> None:
    # group 1 is coming back and heals from a peer: with groups 0 and 2 lost there is none left
    world = running(World(job(**{**GROUPS, "replicaGroups": {"size": 3, "min": 1}})))
    coming_back(world, 4)
    world.terminate(worker(0), 1, message="RuntimeError: a")
    world.terminate(worker(8), 1, message="RuntimeError: b")
    plan = world.reconcile()
    assert world.status["attempt"] == 1
    assert "0 of 3 replica group(s) would train on, fewer than replicaGroups.min (1)" in events(plan, "GangRestart")[0]


def test_groups_below_min_with_the_budget_spent_fail_the_job() -> None:
    world = running(World(job(**{**GROUPS, "failurePolicy": {"maxRestarts": 0}})))
    world.terminate(worker(0), 1, message="RuntimeError: a")
    world.terminate(worker(4), 1, message="RuntimeError: b")
    world.reconcile()
    assert world.status["phase"] == "Failed"
    assert world.status["reason"] == "RestartBudgetExhausted"


def test_groups_starting_together_count_towards_min() -> None:
    # at the attempt's start no group holds weights the others lack: pending groups count
    world = World(job(**GROUPS))
    world.settle()
    world.schedule_only(worker(3))
    world.terminate(worker(3), 1, message="RuntimeError: at start")
    world.reconcile()
    assert world.status["attempt"] == 0
    assert world.status["replicaGroups"][1]["generation"] == 1


def test_a_group_added_by_a_scale_up_counts_once_ready() -> None:
    world = running(World(job(**{**GROUPS, "workers": {"min": 3, "max": 12, "desired": 9}})))
    world.body["spec"]["workers"]["desired"] = 12  # a fourth group, which heals from a peer
    world.settle()
    assert world.status["replicaGroups"][3] == {"index": 3, "generation": 0, "ready": False, "restarts": 0}
    world.terminate(worker(0), 1, message="RuntimeError: a")
    world.terminate(worker(4), 1, message="RuntimeError: b")
    world.reconcile()
    assert world.status["attempt"] == 1  # group 2 alone holds the weights: below min 2


def test_group_restarts_spend_the_budget() -> None:
    world = running(World(job(**{**GROUPS, "failurePolicy": {"maxRestarts": 1}})))
    world.terminate(worker(4), 1, message="RuntimeError: a")
    world.settle()
    world.run()
    world.settle()
    world.terminate(worker(1), 1, message="RuntimeError: b")
    world.reconcile()
    assert world.status["phase"] == "Failed"
    assert world.status["reason"] == "RestartBudgetExhausted"


def test_group_topology_keeps_each_group_in_one_domain() -> None:
    world = running(World(job(**{**GROUPS, "replicaGroups": {"size": 3, "topology": "example.com/rack"}})))
    terms = world.pods[worker(4)]["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["topologyKey"] == "example.com/rack"
    assert terms[0]["labelSelector"]["matchLabels"][naming.REPLICA_GROUP_LABEL] == "1"
    assert terms[0]["labelSelector"]["matchLabels"][naming.GROUP_GENERATION_LABEL] == "0"


def test_each_groups_domain_is_where_its_workers_run() -> None:
    world = World(job(**{**GROUPS, "replicaGroups": {"size": 3, "topology": "example.com/rack"}}))
    world.node_labels = {"node-a": {"example.com/rack": "r1"}, "node-b": {"example.com/rack": "r2"}}
    world.settle()
    for index in range(9):
        world.run(worker(index), node="node-b" if index // 3 == 1 else "node-a")
    world.run()
    world.reconcile()
    assert [group.get("domain") for group in world.status["replicaGroups"]] == ["r1", "r2", "r1"]
    assert not world.plan().changes_children
    world.terminate(worker(4), 1, message="RuntimeError: boom")
    world.reconcile()
    world.finish_terminating()
    world.settle()  # group 1's new pods are not bound yet: its domain is not known
    assert [group.get("domain") for group in world.status["replicaGroups"]] == ["r1", None, "r1"]
    assert "domain" not in world.status["replicaGroups"][1]  # absent, not null


def test_without_topology_groups_have_no_domain() -> None:
    world = running(World(job(**GROUPS)))
    world.node_labels = {"node-a": {"example.com/rack": "r1"}}
    world.reconcile()
    assert all("domain" not in group for group in world.status["replicaGroups"])


def test_jobs_without_groups_have_no_group_fields() -> None:
    world = running(World(job()))
    assert "replicaGroups" not in world.status
    pod = world.pods[worker(0)]
    assert naming.REPLICA_GROUP_LABEL not in pod["metadata"]["labels"]
    assert "PHALANX_REPLICA_GROUP" not in env_of(pod)


def test_supervised_groups_read_their_group_world_from_the_pod_and_restart_by_recreation() -> None:
    supervised = {
        "template": {
            "spec": {
                "containers": [{"name": "trainer", "image": "t:1", "command": ["phalanx-supervise", "--", "torchrun"]}]
            }
        }
    }
    world = running(World(job(**GROUPS, **supervised)))
    pod = world.pods[worker(4)]
    rendezvous = pod["metadata"]["annotations"][naming.RENDEZVOUS_ID_ANNOTATION]
    assert rendezvous.endswith("-g1-0")
    assert "PET_RDZV_ID" not in env_of(pod)  # the supervisor reads it from the pod-info files
    before = uids(world)
    world.terminate(worker(4), 1, message="RuntimeError: boom")
    world.reconcile()
    world.settle()
    world.run()
    world.settle()
    after = uids(world)
    assert after[worker(3)] != before[worker(3)]  # recreated, not moved in place
    assert after[worker(0)] == before[worker(0)]
    assert world.pods[worker(4)]["metadata"]["annotations"][naming.RENDEZVOUS_ID_ANNOTATION].endswith("-g1-1")


EVENTS = st.lists(
    st.tuples(st.sampled_from(["run", "fail", "oom", "evict", "delete", "wait", "cut"]), st.integers(0, 8)), max_size=20
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EVENTS)
def test_any_sequence_of_failures_keeps_groups_whole_and_counts_monotonic(events: list[tuple[str, int]]) -> None:
    world = running(World(job(**{**GROUPS, "failurePolicy": {"maxRestarts": 100}})))
    restarts = 0
    generations = [0, 0, 0]
    for action, number in events:
        target = worker(number)
        live = target in world.pods and not world.pods[target]["metadata"].get("deletionTimestamp")
        if action == "run":
            world.run()
        elif action in ("fail", "oom") and live:
            world.run(target)
            world.terminate(target, 1 if action == "fail" else 137, "OOMKilled" if action == "oom" else "Error")
        elif action == "evict" and live:
            world.run(target)
            world.disrupt(target)
        elif action == "delete" and live:
            world.pods[target]["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"
        elif action == "wait":
            world.finish_terminating()
        if action == "cut":  # a pass stopped right after its status write
            world.carry_out(world.plan(), stop_after_status=True)
        else:
            world.reconcile()
        status = world.status
        assert status.get("restarts", 0) >= restarts
        restarts = status.get("restarts", 0)
        now = [group["generation"] for group in status["replicaGroups"]]
        assert all(new >= old for new, old in zip(now, generations, strict=True))
        generations = now
        if status["phase"] == "Failed":
            return
    world.advance(600)  # past the backoff of a gang restart (too few groups left)
    for _ in range(3):  # new pods come in a slow start
        world.settle()
        world.run()
    world.settle()
    assert not world.plan().changes_children  # planning against its own result changes nothing
    status = world.status
    for name, pod in world.pods.items():
        labels = pod["metadata"]["labels"]
        if labels[naming.ROLE_LABEL] != naming.ROLE_WORKER or pod["metadata"].get("deletionTimestamp"):
            continue
        group = int(labels[naming.WORKER_INDEX_LABEL]) // 3
        assert labels[naming.REPLICA_GROUP_LABEL] == str(group), name
        if labels[naming.ATTEMPT_LABEL] == str(status["attempt"]):
            assert labels[naming.GROUP_GENERATION_LABEL] == str(status["replicaGroups"][group]["generation"]), name
    assert all(group["ready"] for group in status["replicaGroups"]), status["replicaGroups"]


def supervised_with_three_spares() -> World:
    """Three groups of three under phalanx-supervise, training, with three warm spares ready."""
    containers = [{"name": "trainer", "image": "example/train:1", "command": ["phalanx-supervise", "--", "torchrun"]}]
    spec = {**GROUPS, "workers": {**GROUPS["workers"], "spares": 3}, "template": {"spec": {"containers": containers}}}
    world = running(World(job(**spec)))
    world.settle()
    world.run()
    world.reconcile()
    return world


def test_a_restarted_group_is_filled_from_warm_spares_which_join_it_at_its_new_generation() -> None:
    world = supervised_with_three_spares()
    spares = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in world.spares()}
    assert len(spares) == 3
    assert {env_of(pod)["PET_NNODES"] for pod in world.spares()} == {"3"}  # every group's world size
    assert all("PHALANX_REPLICA_GROUP" not in env_of(pod) for pod in world.spares())  # no group until promoted
    [info] = [volume for volume in world.spares()[0]["spec"]["volumes"] if volume["name"] == naming.POD_INFO_VOLUME]
    assert {
        "path": "group-generation",
        "fieldRef": {"fieldPath": f"metadata.labels['{naming.GROUP_GENERATION_LABEL}']"},
    } in (info["downwardAPI"]["items"])  # the supervisor reads the generation it is promoted into
    before = uids(world)

    world.terminate(worker(4), 1, message="RuntimeError: boom")
    # group 1 restarts alone as generation 1: its pods go, and a spare takes the failed worker's slot
    # in the same pass; the next pass finds the survivors' slots empty (their pods stopping) and
    # gives them the other two
    first = world.reconcile()
    assert world.status["replicaGroups"][1]["generation"] == 1 and world.status["restarts"] == 1
    assert [move.promotes_slot for move in first.move] == [4]
    promoted = {
        move.promotes_slot: move.name
        for plan in (first, world.reconcile())
        for move in plan.move
        if move.promotes_slot is not None
    }
    assert sorted(promoted) == [3, 4, 5] and set(promoted.values()) == set(spares)
    group_id = naming.group_rendezvous_id(world.body["metadata"]["uid"], 0, 1, 1)
    for slot, name in promoted.items():
        pod = world.pods[name]
        labels = pod["metadata"]["labels"]
        assert labels[naming.ROLE_LABEL] == naming.ROLE_WORKER and labels[naming.WORKER_INDEX_LABEL] == str(slot)
        assert labels[naming.REPLICA_GROUP_LABEL] == "1" and labels[naming.GROUP_GENERATION_LABEL] == "1"
        assert pod["metadata"]["annotations"][naming.RENDEZVOUS_ID_ANNOTATION] == group_id
        assert pod["metadata"]["uid"] == spares[name]  # the same running pod: no start, no imports
    world.settle()
    world.run()
    world.settle()
    assert world.status["replicaGroups"][1] == {"index": 1, "generation": 1, "ready": True, "restarts": 1}
    assert world.status["attempt"] == 0  # no gang restart
    after = uids(world)
    assert all(after[worker(index)] == before[worker(index)] for index in (0, 1, 2, 6, 7, 8))
    assert not any(worker(index) in world.pods for index in (3, 4, 5))  # no new pod: the spares hold the slots
    assert len(world.spares()) == 3 and not set(spares) & {pod["metadata"]["name"] for pod in world.spares()}


def test_a_group_restart_cut_short_after_its_status_write_promotes_the_same_spares_once() -> None:
    world = supervised_with_three_spares()
    world.terminate(worker(4), 1, message="RuntimeError: boom")
    world.carry_out(world.plan(), stop_after_status=True)  # SIGKILL right after the status write
    assert world.status["replicaGroups"][1]["generation"] == 1 and world.status["restarts"] == 1
    world.reconcile()
    world.reconcile()
    world.settle()
    world.run()
    world.settle()
    assert world.status["restarts"] == 1 and world.status["replicaGroups"][1]["generation"] == 1  # counted once
    held = [pod for pod in world.workers() if pod["metadata"]["labels"].get(naming.REPLICA_GROUP_LABEL) == "1"]
    assert sorted(pod["metadata"]["labels"][naming.WORKER_INDEX_LABEL] for pod in held) == ["3", "4", "5"]
    assert all(pod["metadata"]["labels"][naming.GROUP_GENERATION_LABEL] == "1" for pod in held)
    assert {pod["metadata"]["name"] for pod in held} == {f"demo-spare-{n}" for n in range(3)}
