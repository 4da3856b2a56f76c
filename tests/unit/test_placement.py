"""Topology-aware placement: the domain the operator chooses and keeps, what each gang scheduler is
told, and a gang that no domain can hold."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from phalanx.cluster.cache import NodeCache
from phalanx.reconcile import desired, naming, pod_patches
from phalanx.reconcile.environment import resolve_launch
from phalanx.reconcile.observed import Observed
from tests.unit.jobs import job
from tests.unit.simulation import World

RANK_ADDRESS = pod_patches.annotation(naming.RANK_ADDRESS_ANNOTATION)

RACK = "topology.phalanx.dev/rack"
NODE_8_GPUS = {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"}


def racks(world: World, layout: dict[str, int]) -> None:
    """Nodes of 8 GPUs in racks: rack name -> how many nodes."""
    world.node_allocatable = {
        f"{rack}-{index}": dict(NODE_8_GPUS) for rack, count in layout.items() for index in range(count)
    }
    world.node_labels = {
        f"{rack}-{index}": {RACK: rack, "kubernetes.io/hostname": f"{rack}-{index}"}
        for rack, count in layout.items()
        for index in range(count)
    }


def topology_job(mode: str = "required", **spec: Any) -> World:
    spec.setdefault("workers", {"min": 3, "max": 4, "desired": 3})
    return World(job(gpus={"count": 8}, placement={"topology": {"key": RACK, "mode": mode}}, **spec))


def node_terms(pod: dict[str, Any]) -> list[dict[str, Any]]:
    affinity = pod["spec"].get("affinity", {}).get("nodeAffinity", {})
    return list(affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))


def test_required_puts_every_worker_in_the_domain_with_room_for_them_and_growth_stays_there() -> None:
    world = topology_job()
    racks(world, {"rack-a": 2, "rack-b": 3, "rack-c": 4})
    world.settle()
    assert world.status["placement"] == {"key": RACK, "domain": "rack-b"}  # the least room that holds them
    placed = [e for plan in world.plans for e in plan.events if e.reason == "Placed"]
    assert [e.message for e in placed] == [
        f"workers placed in {RACK}=rack-b: 3 schedulable node(s), room for 3 worker(s) by allocatable less what "
        "the pods there request"
    ]
    for pod in world.workers():
        assert {"key": RACK, "operator": "In", "values": ["rack-b"]} in node_terms(pod)[0]["matchExpressions"]
    for index, pod in enumerate(world.workers()):
        world.run(pod["metadata"]["name"], node=f"rack-b-{index}")
    world.reconcile()
    # rack-b is full and rack-c has more nodes now: the job stays
    racks(world, {"rack-a": 2, "rack-b": 3, "rack-c": 6})
    world.body["spec"]["workers"]["desired"] = 4
    grown = world.reconcile()
    (added,) = grown.apply
    assert {"key": RACK, "operator": "In", "values": ["rack-b"]} in node_terms(added)[0]["matchExpressions"]
    assert world.status["placement"]["domain"] == "rack-b"


def test_the_template_affinity_is_kept_and_each_of_its_terms_gets_the_domain() -> None:
    own = {"matchExpressions": [{"key": "gpu.example.com/model", "operator": "In", "values": ["h100"]}]}
    other = {"matchExpressions": [{"key": "gpu.example.com/model", "operator": "In", "values": ["h200"]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [own, other]}}}
    parsed = job(
        gpus={"count": 8},
        placement={"topology": {"key": RACK}},
        template={"spec": {"affinity": affinity}},
    )
    pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=0, attempt=0, domain="rack-b")
    terms = node_terms(pod)
    assert len(terms) == 2
    for term in terms:
        assert term["matchExpressions"][-1] == {"key": RACK, "operator": "In", "values": ["rack-b"]}
        assert term["matchExpressions"][0]["key"] == "gpu.example.com/model"


def test_a_gang_that_no_domain_can_hold_is_stalled_and_creates_no_worker() -> None:
    world = topology_job(workers={"min": 4, "max": 4, "desired": 4})
    racks(world, {"rack-a": 2, "rack-b": 3})
    world.settle()
    assert world.workers() == []
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "TopologyUnsatisfiable")
    assert "the largest, rack-b (3 node(s)), holds 3" in world.status["message"]
    stalled = {c["type"]: c for c in world.status["conditions"]}["Stalled"]
    assert stalled["status"] == "True"
    racks(world, {"rack-a": 2, "rack-b": 4})  # a fourth node in rack-b
    world.settle()
    assert world.status["placement"]["domain"] == "rack-b" and len(world.workers()) == 4


def test_no_node_with_the_label_is_said_in_those_words() -> None:
    world = topology_job()
    world.node_allocatable = {"node-0": dict(NODE_8_GPUS)}
    world.node_labels = {"node-0": {}}
    world.settle()
    assert world.status["reason"] == "TopologyUnsatisfiable"
    assert f"no schedulable node has the label {RACK}" in world.status["message"]


def test_a_gang_restart_chooses_again_when_its_domain_lost_nodes() -> None:
    world = topology_job(failurePolicy={"backoffSeconds": 0})
    racks(world, {"rack-a": 3, "rack-b": 3})
    world.settle()
    assert world.status["placement"]["domain"] == "rack-a"
    world.run()
    world.reconcile()
    racks(world, {"rack-a": 2, "rack-b": 3})  # a node of rack-a is gone
    world.terminate("demo-worker-0", exit_code=1)
    world.terminate("demo-worker-1", exit_code=1)
    world.settle()
    assert world.status["attempt"] == 1
    assert world.status["placement"]["domain"] == "rack-b"
    assert all("rack-b" in str(node_terms(pod)) for pod in world.workers(attempt=1))


def test_preferred_packs_towards_the_roomiest_domain_and_lets_the_rest_spill_over() -> None:
    world = topology_job("preferred", workers={"min": 4, "max": 4, "desired": 4})
    racks(world, {"rack-a": 2, "rack-b": 3})
    world.settle()
    assert world.status["reason"] != "TopologyUnsatisfiable"
    assert world.status["placement"]["domain"] == "rack-b"
    pod = world.workers()[0]
    affinity = pod["spec"]["affinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity.get("nodeAffinity", {})
    (preference,) = affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preference["preference"]["matchExpressions"] == [{"key": RACK, "operator": "In", "values": ["rack-b"]}]
    (peers,) = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert peers["podAffinityTerm"]["topologyKey"] == RACK


def test_without_watched_nodes_the_workers_follow_each_other_by_pod_affinity() -> None:
    parsed = job(gpus={"count": 8}, placement={"topology": {"key": RACK}})
    pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=0, attempt=0, domain=None)
    assert node_terms(pod)[0]["matchExpressions"] == [{"key": RACK, "operator": "Exists"}]
    (term,) = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {
        "labelSelector": {"matchLabels": {naming.JOB_NAME_LABEL: "demo", naming.ROLE_LABEL: naming.ROLE_WORKER}},
        "topologyKey": RACK,
    }


def test_kueue_gets_its_topology_annotations_and_chooses_itself() -> None:
    for mode, annotation in (
        ("required", "kueue.x-k8s.io/podset-required-topology"),
        ("preferred", "kueue.x-k8s.io/podset-preferred-topology"),
    ):
        world = topology_job(mode, gang={"scheduler": "kueue", "queue": "team"})
        racks(world, {"rack-a": 3})
        world.settle()
        pod = world.workers()[0]
        assert pod["metadata"]["annotations"][annotation] == RACK
        assert "affinity" not in pod["spec"]  # Kueue injects the domain's nodeSelector itself
        assert world.status["placement"] == {"key": RACK}  # no domain of the operator's


def test_kueue_gangs_no_domain_can_hold_are_stalled_too() -> None:
    world = topology_job(gang={"scheduler": "kueue", "queue": "team"}, workers={"min": 4, "max": 4, "desired": 4})
    racks(world, {"rack-a": 3})
    world.settle()
    assert world.status["reason"] == "TopologyUnsatisfiable" and world.workers() == []


def test_volcano_gets_a_network_topology_on_its_podgroup() -> None:
    for mode, volcano_mode in (("required", "hard"), ("preferred", "soft")):
        parsed = job(
            gpus={"count": 8}, gang={"scheduler": "volcano"}, placement={"topology": {"key": RACK, "mode": mode}}
        )
        group = desired.pod_group(parsed, resolve_launch(parsed.spec))
        assert group is not None
        assert group["spec"]["networkTopology"] == {"mode": volcano_mode, "highestTierAllowed": 1}
        pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=0, attempt=0)
        assert "affinity" not in pod["spec"]


def test_only_nodes_the_template_admits_count_for_the_choice() -> None:
    world = topology_job(template={"spec": {"nodeSelector": {"pool": "training"}}})
    racks(world, {"rack-a": 3, "rack-b": 4})
    for node, labels in world.node_labels.items():
        if node.startswith("rack-a"):
            labels["pool"] = "training"  # rack-b is larger, but not the job's pool
    world.settle()
    assert world.status["placement"]["domain"] == "rack-a"
    kueue = topology_job(gang={"scheduler": "kueue", "queue": "team"})
    racks(kueue, {"rack-a": 3})
    kueue.settle()
    annotations = kueue.workers()[0]["metadata"]["annotations"]
    assert annotations["kueue.x-k8s.io/pod-group-pod-index-label"] == naming.WORKER_INDEX_LABEL


def test_a_gang_that_found_no_room_in_its_domain_for_a_while_moves_to_the_next_that_could_hold_it() -> None:
    world = topology_job()
    racks(world, {"rack-a": 3, "rack-b": 4})
    world.settle()
    assert world.status["placement"]["domain"] == "rack-a"
    for pod in world.workers():  # no room in rack a for a reason the nodes' pods do not tell (a taint)
        world.unschedulable(pod["metadata"]["name"], "0/7 nodes are available: 3 node(s) had untolerated taint.")
    world.advance(60)
    assert world.reconcile().delete == ()  # patience
    world.advance(60)
    moved = world.reconcile()
    assert sorted(d.name for d in moved.delete) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert world.status["placement"]["domain"] == "rack-b"
    (event,) = [e for e in moved.events if e.reason == "Placed"]
    assert "moved from rack-a, where none of the gang found room for 120s" in event.message
    assert world.status["restarts"] == 0
    world.finish_terminating()
    world.settle()
    assert len(world.workers()) == 3
    assert all("rack-b" in str(node_terms(pod)) for pod in world.workers())


def test_a_gang_partly_placed_is_never_moved() -> None:
    world = topology_job()
    racks(world, {"rack-a": 3, "rack-b": 4})
    world.settle()
    world.schedule_only("demo-worker-0", node="rack-a-0")
    world.other_requests = {f"rack-a-{index}": {"nvidia.com/gpu": "8"} for index in (1, 2)}
    for name in ("demo-worker-1", "demo-worker-2"):
        world.unschedulable(name, "0/7 nodes are available: 4 Insufficient nvidia.com/gpu.")
    world.advance(600)
    assert world.reconcile().delete == ()
    assert world.status["placement"]["domain"] == "rack-a"


def supervised_preferred_job(**spec: Any) -> World:
    supervised = {"name": "trainer", "image": "example/train:1", "command": ["phalanx-supervise", "--", "torchrun"]}
    spec.setdefault("workers", {"min": 4, "max": 4, "desired": 4})
    return topology_job("preferred", template={"spec": {"containers": [supervised]}}, **spec)


def test_ranks_follow_placement_through_rank_addresses_that_sort_by_domain() -> None:
    world = supervised_preferred_job()
    racks(world, {"rack-a": 2, "rack-b": 3})
    world.settle()
    service = world.objects[("Service", "demo-ranks")]
    assert service["spec"]["clusterIP"] == "None" and "selector" not in service["spec"]
    worker = world.workers()[0]
    env = {var["name"]: var.get("value") for var in worker["spec"]["containers"][0]["env"]}
    assert env["PHALANX_RANK_ADDRESS"] == "1"
    items = worker["spec"]["volumes"][-1]["downwardAPI"]["items"]
    assert {
        "path": "rank-address",
        "fieldRef": {"fieldPath": f"metadata.annotations['{naming.RANK_ADDRESS_ANNOTATION}']"},
    } in items
    # the scheduler spread them: slots 0 and 2 in rack a, 1 and 3 in rack b
    for index, node in enumerate(("rack-a-0", "rack-b-0", "rack-a-1", "rack-b-1")):
        world.run(f"demo-worker-{index}", node=node)
        world.pods[f"demo-worker-{index}"]["status"]["podIP"] = f"10.0.0.{10 - index}"
    world.reconcile()
    slice_ = world.objects[("EndpointSlice.discovery.k8s.io", "demo-ranks")]
    assert slice_["metadata"]["labels"]["kubernetes.io/service-name"] == "demo-ranks"
    hosts = {e["addresses"][0]: e["hostname"] for e in slice_["endpoints"]}
    addresses = {
        name: pod["metadata"]["annotations"][naming.RANK_ADDRESS_ANNOTATION]
        for name, pod in world.pods.items()
        if name.startswith("demo-worker")
    }
    assert all(address.endswith(".demo-ranks.ml.svc") for address in addresses.values())
    assert sorted(hosts.values()) == sorted(address.split(".")[0] for address in addresses.values())
    # torchrun's order: the agents' addresses sorted; each rack's workers are neighbours
    order = [name for name, _ in sorted(addresses.items(), key=lambda item: item[1])]
    rack = {"demo-worker-0": "a", "demo-worker-1": "b", "demo-worker-2": "a", "demo-worker-3": "b"}
    assert [rack[name] for name in order] in (list("aabb"), list("bbaa")), order
    assert world.reconcile().address == ()  # given once


def test_ranks_follow_placement_only_for_supervised_torchrun_jobs() -> None:
    world = topology_job("preferred")  # the command is torchrun itself: no supervisor to wait
    racks(world, {"rack-a": 3})
    world.settle()
    world.run()
    plan = world.reconcile()
    assert ("Service", "demo-ranks") not in world.objects and plan.address == ()


def test_pods_kept_through_an_in_place_restart_get_the_new_attempts_addresses_with_the_move() -> None:
    world = supervised_preferred_job(failurePolicy={"backoffSeconds": 0})
    racks(world, {"rack-a": 4})
    world.settle()
    world.run(node="rack-a-0")
    world.reconcile()
    world.delete_pod("demo-rdzv")  # the store lost: the gang restarts in place
    plan = world.reconcile()
    for _ in range(3):
        if plan.move:
            break
        plan = world.reconcile()
    assert plan.move and {given.name for given in plan.address} == {move.name for move in plan.move}
    assert all(str(given.written(RANK_ADDRESS)).startswith("a1-") and given.attempt == 1 for given in plan.address)


def test_a_sigkill_after_the_move_was_recorded_still_moves_the_unplaced_pods() -> None:
    world = topology_job()
    racks(world, {"rack-a": 3, "rack-b": 4})
    world.settle()
    assert all(pod["metadata"]["annotations"][naming.DOMAIN_ANNOTATION] == "rack-a" for pod in world.workers())
    for pod in world.workers():
        world.unschedulable(pod["metadata"]["name"], "0/7 nodes are available: 3 Insufficient nvidia.com/gpu.")
    world.advance(120)
    world.carry_out(world.plan(), stop_after_status=True)  # the status says rack-b; no pod was deleted
    assert world.status["placement"]["domain"] == "rack-b" and len(world.workers()) == 3
    again = world.reconcile()
    assert sorted(d.name for d in again.delete) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert [e for e in again.events if e.reason == "Placed"] == []  # announced once, before the SIGKILL
    world.finish_terminating()
    world.settle()
    assert len(world.workers()) == 3 and all("rack-b" in str(node_terms(pod)) for pod in world.workers())
    assert world.status["restarts"] == 0


def placed_workers(world: World, count: int) -> None:
    """Every worker of a placed job runs, slot ``i`` on a node of rack a or b at an address of its own."""
    for index in range(count):
        name = naming.worker_pod_name("demo", index)
        world.run(name, node=f"rack-{'ab'[index % 2]}-{index % 1300}")
        world.pods[name]["status"]["podIP"] = f"10.{index // 65536}.{index // 256 % 256}.{index % 256}"


def rank_slices(world: World) -> dict[str, dict[str, Any]]:
    kind = "EndpointSlice.discovery.k8s.io"
    return {name: obj for (child, name), obj in world.objects.items() if child == kind}


def slot_of(endpoint: dict[str, Any]) -> int:
    return int(endpoint["hostname"].split("-")[2])  # rank_host: a<attempt>-<domain digest>-<slot>-<uid>


def test_rank_addresses_of_more_workers_than_one_endpoint_slice_holds_are_sharded_by_slot() -> None:
    world = supervised_preferred_job(workers={"min": 1, "max": 2500, "desired": 2500})
    racks(world, {"rack-a": 1300, "rack-b": 1300})
    world.settle()
    placed_workers(world, 2500)
    plan = world.reconcile()
    slices = rank_slices(world)
    # the API server refuses an EndpointSlice of more than 1,000 endpoints
    assert sorted(slices) == ["demo-ranks", "demo-ranks-1", "demo-ranks-2"]
    for shard, name in enumerate(("demo-ranks", "demo-ranks-1", "demo-ranks-2")):
        slice_ = slices[name]
        assert slice_["metadata"]["labels"]["kubernetes.io/service-name"] == "demo-ranks"  # one Service serves all
        assert slice_["metadata"]["ownerReferences"][0]["uid"] == world.body["metadata"]["uid"]
        assert {slot_of(e) for e in slice_["endpoints"]} == set(range(shard * 1000, min(2500, shard * 1000 + 1000)))
    hosts = [e["hostname"] for s in slices.values() for e in s["endpoints"]]
    given = sorted(str(a.written(RANK_ADDRESS)).split(".")[0] for a in plan.address)
    assert sorted(hosts) == given and len(set(hosts)) == 2500

    # a worker of the first thousand leaves: only its slice changes, every other pod keeps its slice
    world.delete_pod(naming.worker_pod_name("demo", 5))
    before = {name: [e["hostname"] for e in s["endpoints"]] for name, s in rank_slices(world).items()}
    changed = world.reconcile()
    assert [obj["metadata"]["name"] for obj in changed.apply if obj["kind"] == "EndpointSlice"] == ["demo-ranks"]
    after = {name: [e["hostname"] for e in s["endpoints"]] for name, s in rank_slices(world).items()}
    assert after["demo-ranks-1"] == before["demo-ranks-1"] and after["demo-ranks-2"] == before["demo-ranks-2"]
    assert len(after["demo-ranks"]) == 999


def test_rank_slices_no_worker_needs_any_more_are_deleted_and_the_first_is_kept_current() -> None:
    world = supervised_preferred_job(workers={"min": 1, "max": 2500, "desired": 2500})
    racks(world, {"rack-a": 1300, "rack-b": 1300})
    world.settle()
    placed_workers(world, 2500)
    world.reconcile()
    assert len(rank_slices(world)) == 3
    for index in range(900, 2500):  # the job shrank to 900 workers
        world.delete_pod(naming.worker_pod_name("demo", index))
    world.body["spec"]["workers"]["desired"] = 900
    plan = world.plan()
    surplus = sorted((d.kind, d.name) for d in plan.delete)
    assert surplus == [("EndpointSlice", "demo-ranks-1"), ("EndpointSlice", "demo-ranks-2")]
    assert all(d.api_version == desired.ENDPOINT_SLICE_API for d in plan.delete)
    world.carry_out(plan)
    assert sorted(rank_slices(world)) == ["demo-ranks"]
    assert len(rank_slices(world)["demo-ranks"]["endpoints"]) == 900
    assert world.reconcile().delete == ()  # once gone, nothing more to delete
    # the last workers go: the first slice stays, emptied, as it did before sharding
    for index in range(900):
        world.delete_pod(naming.worker_pod_name("demo", index))
    world.reconcile()
    assert rank_slices(world)["demo-ranks"]["endpoints"] == []


def test_a_surplus_rank_slice_found_after_a_sigkill_is_deleted_in_the_next_pass() -> None:
    world = supervised_preferred_job(workers={"min": 1, "max": 1500, "desired": 1500})
    racks(world, {"rack-a": 1300, "rack-b": 1300})
    world.settle()
    placed_workers(world, 1500)
    world.reconcile()
    for index in range(1000, 1500):
        world.delete_pod(naming.worker_pod_name("demo", index))
    world.body["spec"]["workers"]["desired"] = 1000
    world.carry_out(world.plan(), stop_after_status=True)  # SIGKILL before the deletion
    assert "demo-ranks-1" in rank_slices(world)
    again = world.reconcile()
    assert [(d.kind, d.name) for d in again.delete] == [("EndpointSlice", "demo-ranks-1")]
    assert sorted(rank_slices(world)) == ["demo-ranks"]


def test_the_pods_a_move_deletes_are_no_loss_while_they_stop_nor_once_they_are_gone() -> None:
    world = topology_job()
    racks(world, {"rack-a": 3, "rack-b": 4})
    world.settle()
    for pod in world.workers():
        world.unschedulable(pod["metadata"]["name"], "0/7 nodes are available: 4 Insufficient nvidia.com/gpu.")
    world.advance(120)
    moved = world.reconcile()
    assert len(moved.delete) == 3 and len(world.status["removedWorkers"]) == 3
    stopping = world.reconcile()  # the deleted pods still stop: recorded as the operator's own
    assert world.status["attempt"] == 0 and world.status["restartsByReason"] == {}
    assert not [e for e in stopping.events if e.reason == "GangRestart"]
    world.finish_terminating()
    world.settle()
    assert world.status["attempt"] == 0 and world.status["restartsByReason"] == {}
    assert len(world.workers(attempt=0)) == 3 and all("rack-b" in str(node_terms(pod)) for pod in world.workers())
    assert "removedWorkers" not in world.status


def busy(world: World, *nodes: str) -> None:
    """Other tenants' pods take every GPU of these nodes."""
    world.other_requests.update({node: {"nvidia.com/gpu": "8", "cpu": "4"} for node in nodes})


def test_a_required_gang_goes_to_the_domain_whose_gpus_are_free_not_the_first_by_name() -> None:
    world = topology_job()
    racks(world, {"rack-a": 3, "rack-b": 3})
    busy(world, "rack-a-0", "rack-a-1", "rack-a-2")  # another tenant fills rack a
    world.settle()
    assert world.status["placement"]["domain"] == "rack-b"
    assert all("rack-b" in str(node_terms(pod)) for pod in world.workers())
    (placed,) = [e for plan in world.plans for e in plan.events if e.reason == "Placed"]
    assert "rack-b: 3 schedulable node(s), room for 3 worker(s)" in placed.message


def test_the_tightest_domain_that_holds_the_gang_is_chosen_so_large_gangs_still_find_a_whole_one() -> None:
    world = topology_job()  # 3 workers
    racks(world, {"rack-a": 4, "rack-b": 3, "rack-c": 4})
    busy(world, "rack-c-0", "rack-c-1")  # room for 4, 3 and 2 now
    world.settle()
    assert world.status["placement"]["domain"] == "rack-b"
    # desired 4: the tightest that holds 4 (rack a); min 3 is the fallback where none holds 4
    grown = topology_job(workers={"min": 3, "max": 4, "desired": 4})
    racks(grown, {"rack-a": 4, "rack-b": 3, "rack-c": 4})
    busy(grown, "rack-c-0", "rack-c-1")
    grown.settle()
    assert grown.status["placement"]["domain"] == "rack-a"
    squeezed = topology_job(workers={"min": 3, "max": 4, "desired": 4})
    racks(squeezed, {"rack-a": 4, "rack-b": 3, "rack-c": 4})
    busy(squeezed, "rack-a-0", "rack-c-0", "rack-c-1")  # room for 3, 3 and 2: the first name of the tightest
    squeezed.settle()
    assert squeezed.status["placement"]["domain"] == "rack-a"


def test_a_gang_whose_domain_filled_up_before_it_was_placed_moves_at_once_to_one_with_room() -> None:
    world = topology_job()
    racks(world, {"rack-a": 3, "rack-b": 3})
    world.settle()
    assert world.status["placement"]["domain"] == "rack-a"
    busy(world, "rack-a-0", "rack-a-1", "rack-a-2")  # another tenant's pods were bound first
    for pod in world.workers():
        world.unschedulable(pod["metadata"]["name"], "0/6 nodes are available: 3 Insufficient nvidia.com/gpu.")
    moved = world.reconcile()  # no patience: the nodes' pods say why, and rack b has room
    assert sorted(d.name for d in moved.delete) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert world.status["placement"]["domain"] == "rack-b"
    (event,) = [e for e in moved.events if e.reason == "Placed"]
    assert "moved from rack-a, where none of the gang found room and the pods there leave room for 0 worker(s)" in (
        event.message
    )
    world.finish_terminating()
    world.settle()
    assert len(world.workers()) == 3 and all("rack-b" in str(node_terms(pod)) for pod in world.workers())
    assert world.status["restarts"] == 0


def test_a_gang_waits_its_patience_where_every_domain_looks_full() -> None:
    world = topology_job()
    racks(world, {"rack-a": 3, "rack-b": 3})
    world.settle()
    busy(world, "rack-a-0", "rack-a-1", "rack-a-2", "rack-b-0")  # rack b holds 2 of the 3 now
    for pod in world.workers():
        world.unschedulable(pod["metadata"]["name"], "0/6 nodes are available: 3 Insufficient nvidia.com/gpu.")
    assert world.reconcile().delete == ()
    assert world.status["placement"]["domain"] == "rack-a"


def test_a_nodes_free_room_is_its_allocatable_less_what_other_pods_request_never_below_zero() -> None:
    gpus = {"nvidia.com/gpu": Decimal(8), "cpu": Decimal(64)}
    observed = Observed(
        node_allocatable={"n1": gpus, "n2": gpus},
        node_requested={"n1": {"nvidia.com/gpu": Decimal(8), "cpu": Decimal(70)}, "gone": {"cpu": Decimal(1)}},
        own_requested={"n1": {"nvidia.com/gpu": Decimal(4), "cpu": Decimal(2)}},
    )
    # the job's own pods (a spare, a stopping worker) hold nothing against it: n1 has 4 GPUs for it
    assert observed.node_free("n1") == {"nvidia.com/gpu": Decimal(4), "cpu": Decimal(0)}
    assert observed.node_free("n2") == gpus
    assert observed.node_free("unschedulable") == {}


def node_body(name: str, rack: str, *, ready: bool = True, cordoned: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {RACK: rack, "kubernetes.io/hostname": name}},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {
            "allocatable": dict(NODE_8_GPUS),
            "conditions": [{"type": "Ready", "status": "True" if ready else "Unknown"}],
        },
    }


def watched_racks(world: World, layout: dict[str, int]) -> list[str]:
    """Racks of 8-GPU nodes, as the operator's node cache sees them: node names."""
    world.node_cache = NodeCache()
    names = []
    for rack, count in layout.items():
        for index in range(count):
            names.append(f"{rack}-{index}")
            world.node_cache.observe("ADDED", node_body(f"{rack}-{index}", rack))
    return names


def rank_addresses(world: World) -> dict[str, str]:
    return {
        name: pod["metadata"]["annotations"][naming.RANK_ADDRESS_ANNOTATION]
        for name, pod in world.pods.items()
        if name.startswith("demo-worker")
    }


@pytest.mark.parametrize("change", [{"ready": False}, {"cordoned": True}], ids=["notready-blip", "cordon"])
def test_a_running_gang_keeps_its_domain_and_rank_addresses_while_its_nodes_take_no_new_pods(
    change: dict[str, bool],
) -> None:
    """The rack's switch flaps (every node NotReady for a while), or the rack is cordoned for
    maintenance: the workers still run there, so the domain and their addresses stay."""
    supervised = {"name": "trainer", "image": "example/train:1", "command": ["phalanx-supervise", "--", "torchrun"]}
    world = topology_job(template={"spec": {"containers": [supervised]}})
    watched_racks(world, {"rack-a": 3, "rack-b": 3})
    assert world.node_cache is not None
    world.settle()
    assert world.status["placement"]["domain"] == "rack-a"
    for index in range(3):
        world.run(f"demo-worker-{index}", node=f"rack-a-{index}")
        world.pods[f"demo-worker-{index}"]["status"]["podIP"] = f"10.0.0.{index + 1}"
    world.settle()
    addresses = rank_addresses(world)
    assert len(addresses) == 3
    for index in range(3):
        world.node_cache.observe("MODIFIED", node_body(f"rack-a-{index}", "rack-a", **change))
        if not change.get("ready", True):
            world.node_not_ready(f"rack-a-{index}")
    assert world.node_cache.allocatable().keys() == {"rack-b-0", "rack-b-1", "rack-b-2"}  # no room there now
    plan = world.reconcile()
    assert world.status["placement"]["domain"] == "rack-a"
    assert [e for e in plan.events if e.reason == "Placed"] == []
    assert plan.address == () and rank_addresses(world) == addresses
    for index in range(3):
        world.node_cache.observe("MODIFIED", node_body(f"rack-a-{index}", "rack-a"))
        world.node_ready(f"rack-a-{index}")
    world.settle()
    assert world.status["placement"]["domain"] == "rack-a" and rank_addresses(world) == addresses


def test_a_worker_keeps_its_rank_address_while_its_own_node_blips() -> None:
    supervised = {"name": "trainer", "image": "example/train:1", "command": ["phalanx-supervise", "--", "torchrun"]}
    world = topology_job(template={"spec": {"containers": [supervised]}})
    watched_racks(world, {"rack-a": 3})
    assert world.node_cache is not None
    world.settle()
    for index in range(3):
        world.run(f"demo-worker-{index}", node=f"rack-a-{index}")
        world.pods[f"demo-worker-{index}"]["status"]["podIP"] = f"10.0.0.{index + 1}"
    world.settle()
    addresses = rank_addresses(world)
    slice_ = world.objects[("EndpointSlice.discovery.k8s.io", "demo-ranks")]
    world.node_cache.observe("MODIFIED", node_body("rack-a-1", "rack-a", ready=False))
    world.node_not_ready("rack-a-1")
    plan = world.reconcile()
    assert plan.address == () and rank_addresses(world) == addresses
    assert world.objects[("EndpointSlice.discovery.k8s.io", "demo-ranks")]["endpoints"] == slice_["endpoints"]
