"""The cluster-wide node ledger (``reconcile.node_ledger``): evidence counted once per pod, a score
that halves every half-life, a threshold past which every job's new pods keep off a node, bounds,
the ConfigMap's data read defensively, and the avoidance rendered on new pods only."""

from __future__ import annotations

import json
from datetime import timedelta

from phalanx.reconcile import node_ledger
from phalanx.reconcile.node_ledger import DATA_KEY, Evidence, Ledger, LedgerPolicy
from phalanx.reconcile.pass_values import Context
from tests.unit.jobs import job
from tests.unit.simulation import START, World
from tests.unit.test_node_avoidance import kept_off
from tests.unit.test_plan import running_with_worker_2_on_node_b

HOUR = 3600.0
POLICY = LedgerPolicy(half_life_seconds=HOUR, threshold=2.0, max_evidence_per_node=3, max_nodes=2)


def evidence(node: str, uid: str, hours_ago: float = 0.0, kind: str = "NodeLost") -> Evidence:
    return Evidence(node=node, kind=kind, at=START - timedelta(hours=hours_ago), job="ml/demo", pod_uid=uid)


def test_a_score_is_one_per_failure_and_halves_every_half_life() -> None:
    ledger = Ledger(policy=POLICY).merged([evidence("node-a", "u1"), evidence("node-a", "u2", hours_ago=1)], START)
    assert ledger.score("node-a", START) == 1.5
    assert ledger.score("node-a", START + timedelta(hours=1)) == 0.75
    assert ledger.score("node-b", START) == 0


def test_a_node_is_avoided_from_the_threshold_on_and_forgiven_as_its_score_decays() -> None:
    ledger = Ledger(policy=POLICY).merged([evidence("node-a", "u1")], START)
    assert ledger.avoided(START) == frozenset()
    ledger = ledger.merged([evidence("node-a", "u2")], START)
    assert ledger.avoided(START) == {"node-a"}
    [grade] = ledger.grades(START)
    assert (grade.node, grade.score, grade.avoided, len(grade.evidence)) == ("node-a", 2.0, True, 2)
    assert ledger.avoided(START + timedelta(minutes=1)) == frozenset()  # 2 x 0.99: under 2


def test_each_pod_counts_once_whatever_it_is_classified_as_next() -> None:
    ledger = Ledger(policy=POLICY)
    for _ in range(3):  # every pass sees the failed pod while it exists
        ledger = ledger.merged([evidence("node-a", "u1")], START)
    ledger = ledger.merged([evidence("node-a", "u1", kind="GPUError")], START)  # the same failure, later
    assert ledger.score("node-a", START) == 1.0
    assert ledger.new_of([evidence("node-a", "u1"), evidence("node-a", "u9"), evidence("node-b", "u9")]) == (
        evidence("node-a", "u9"),
    )


def test_bounds_keep_the_newest_evidence_per_node_and_the_nodes_with_the_newest_evidence() -> None:
    ledger = Ledger(policy=POLICY).merged([evidence("node-a", f"u{n}", hours_ago=n) for n in range(5)], START)
    assert [one.pod_uid for one in ledger.nodes["node-a"]] == ["u2", "u1", "u0"]  # oldest first
    ledger = ledger.merged([evidence("node-b", "b1", hours_ago=5), evidence("node-c", "c1", hours_ago=1)], START)
    assert sorted(ledger.nodes) == ["node-a", "node-c"]  # node-b's newest is the oldest
    # dropped evidence stays counted: a pod still there is not counted again
    assert ledger.merged([evidence("node-a", "u4")], START) == ledger
    assert ledger.merged([evidence("node-b", "b1")], START) == ledger


def test_decayed_evidence_is_dropped_and_seen_keys_are_bounded() -> None:
    ledger = Ledger(policy=POLICY).merged([evidence("node-a", "old", hours_ago=8)], START)
    assert ledger.nodes == {} and ledger.seen == ("old/failure",)
    many = Ledger(policy=POLICY, seen=tuple(f"k{n}" for n in range(node_ledger.MAX_SEEN)))
    assert len(many.merged([evidence("node-a", "new")], START).seen) == node_ledger.MAX_SEEN


def test_the_configmap_data_round_trips_and_carries_the_policy_for_readers() -> None:
    device = Evidence("node-a", "GPUError", START, "ml/demo", "u1", device="GPU 3", message="Xid 79")
    ledger = Ledger(policy=POLICY).merged([device, evidence("node-b", "u2")], START)
    data = ledger.to_data()
    assert node_ledger.of_data(data, POLICY) == ledger
    read = node_ledger.of_data(data)  # a reader without the operator's settings
    assert (read.policy.half_life_seconds, read.policy.threshold) == (HOUR, 2.0)
    assert node_ledger.evidence_text(device, START) == "GPUError on GPU 3 0s ago in ml/demo: Xid 79"


def test_malformed_data_is_left_out_not_fatal() -> None:
    assert node_ledger.of_data(None) == Ledger()
    assert node_ledger.of_data({DATA_KEY: "not json"}) == Ledger()
    assert node_ledger.of_data({DATA_KEY: "[1, 2]"}) == Ledger()
    good = {"at": "2026-01-01T00:00:00Z", "kind": "NodeLost", "job": "ml/a", "pod": "u1", "message": "m" * 5000}
    document = {
        "policy": {"halfLifeSeconds": -1, "threshold": "high"},
        "nodes": {
            "node-a": [good, {"at": "yesterday", "kind": "NodeLost", "job": "ml/a", "pod": "u2"}, "junk", {"at": 5}],
            "": [good],
            "node-b": "junk",
        },
        "seen": ["u1/failure", 7, "x" * 500],
    }
    read = node_ledger.of_data({DATA_KEY: json.dumps(document)})
    assert read.policy == LedgerPolicy()
    assert list(read.nodes) == ["node-a"] and len(read.nodes["node-a"]) == 1
    assert len(read.nodes["node-a"][0].message) == node_ledger.MAX_MESSAGE
    assert read.seen == ("u1/failure",)


def test_a_copy_written_meanwhile_is_merged_without_losing_or_doubling_evidence() -> None:
    policy = LedgerPolicy(half_life_seconds=HOUR)
    ours = Ledger(policy=policy).merged([evidence("node-a", "u1"), evidence("node-b", "u2")], START)
    theirs = Ledger(policy=policy).merged([evidence("node-a", "u1"), evidence("node-c", "u3")], START)
    union = ours.union(theirs, START)
    assert {node: len(items) for node, items in union.nodes.items()} == {"node-a": 1, "node-b": 1, "node-c": 1}
    assert union.score("node-a", START) == 1.0  # u1 once
    assert set(union.seen) == {"u1/failure", "u2/failure", "u3/failure"}
    assert union.union(theirs, START) == union  # merging again changes nothing


def test_the_device_a_message_names_is_kept_bounded() -> None:
    assert node_ledger.device_of("Xid 79 on GPU 3: fallen off the bus") == "GPU 3"
    assert node_ledger.device_of("NVRM: GPU at PCI:0000:3b:00.0: GPU has fallen off the bus") == "0000:3b:00.0"
    assert node_ledger.device_of("NET/IB : mlx5_1:1 completion error") == "mlx5_1"
    assert node_ledger.device_of("ValueError") is None and node_ledger.device_of(None) is None


def test_the_evidence_of_a_pass_is_its_pods_failures_that_blame_their_node() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.terminate("demo-worker-2", 1, message="Xid 79: GPU 5 has fallen off the bus")
    world.terminate("demo-worker-1", 1, message="ValueError: shapes do not match")  # the code's fault
    context = Context(world.job, world.observed(), world.now)
    [found] = node_ledger.evidence_of(context)
    pod = world.pods["demo-worker-2"]
    assert (found.node, found.kind, found.device, found.pod_uid, found.job) == (
        "node-b",
        "GPUError",
        "GPU 5",
        pod["metadata"]["uid"],
        f"{world.job.metadata.namespace}/demo",
    )


def test_new_pods_of_every_job_keep_off_the_ledgers_nodes_and_running_pods_stay() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.ledger_avoided = frozenset({"node-z", "node-b"})
    plan = world.reconcile()
    assert not plan.changes_children  # pods are never changed in place: running workers stay
    world.delete_pod("demo-worker-1")
    world.settle()
    assert kept_off(world.pods["demo-worker-1"]) == [["node-b", "node-z"]]
    assert "avoidedNodes" not in world.status  # the ledger's, not the job's own avoidance


def test_without_ledger_nodes_new_pods_are_as_before() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.delete_pod("demo-worker-1")
    world.settle()
    assert kept_off(world.pods["demo-worker-1"]) == []
