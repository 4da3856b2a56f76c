"""Every CEL rule and schema bound refuses what it should, with a message naming the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.crd_validation import validate
from tests.unit.jobs import manifest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))

REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("min above max", {"workers": {"min": 3, "max": 2, "desired": 2}}, ".spec.workers.min", "must not exceed max"),
    ("desired above max", {"workers": {"desired": 5}}, ".spec.workers.desired", "must lie within [min, max]"),
    ("desired below min", {"workers": {"desired": 1}}, ".spec.workers.desired", "must lie within [min, max]"),
    ("gloo with gpus", {"backend": "gloo", "gpus": {"count": 2}}, ".spec.backend", "gloo cannot be used"),
    ("nccl without gpus", {"backend": "nccl"}, ".spec.backend", "nccl needs GPUs"),
    ("nccl profile on cpu", {"network": {"profile": "tcp"}}, ".spec.network.profile", "needs GPUs"),
    ("rdma on cpu", {"network": {"rdma": {"resource": "rdma/hca"}}}, ".spec.network.rdma", "needs GPUs"),
    (
        "gpus by device plugin and by DRA",
        {"gpus": {"count": 2, "resource": "nvidia.com/gpu", "deviceClassName": "gpu.nvidia.com"}},
        ".spec.gpus.deviceClassName",
        "not both",
    ),
    ("a DRA class without gpus", {"gpus": {"deviceClassName": "gpu.nvidia.com"}}, ".spec.gpus.count", "count > 0"),
    ("gpu selectors without DRA", {"gpus": {"count": 1, "selectors": ["true"]}}, ".spec.gpus.selectors", "DRA"),
    (
        "rdma by device plugin and by DRA",
        {"gpus": {"count": 1}, "network": {"rdma": {"resource": "rdma/a", "deviceClassName": "rdma.example.com"}}},
        ".spec.network.rdma.resource",
        "exactly one of resource",
    ),
    (
        "rdma with neither form",
        {"gpus": {"count": 1}, "network": {"rdma": {}}},
        ".spec.network.rdma.resource",
        "exactly one",
    ),
    (
        "a NIC aligned with device-plugin GPUs",
        {
            "gpus": {"count": 1},
            "network": {"rdma": {"deviceClassName": "rdma.example.com", "matchAttribute": "a.io/root"}},
        },
        ".spec.network.rdma.matchAttribute",
        "needs gpus.deviceClassName",
    ),
    (
        "matchAttribute on a device-plugin NIC",
        {
            "gpus": {"count": 1, "deviceClassName": "g.io"},
            "network": {"rdma": {"resource": "rdma/a", "matchAttribute": "a.io/root"}},
        },
        ".spec.network.rdma.matchAttribute",
        "set deviceClassName",
    ),
    (
        "infiniband without rdma",
        {"gpus": {"count": 8}, "network": {"profile": "infiniband"}},
        ".spec.network.rdma",
        "needs rdma",
    ),
    ("efa without rdma", {"gpus": {"count": 8}, "network": {"profile": "efa"}}, ".spec.network.rdma", "needs rdma"),
    (
        "hcas without rdma",
        {"gpus": {"count": 8}, "network": {"hcas": ["mlx5_0"]}},
        ".spec.network.hcas",
        "only apply with an RDMA",
    ),
    (
        "too many procs per gpu",
        {"gpus": {"count": 2}, "procsPerWorker": 4},
        ".spec.procsPerWorker",
        "must not exceed gpus.count",
    ),
    (
        "queue without gang scheduler",
        {"gang": {"queue": "research"}},
        ".spec.gang.queue",
        "queue needs scheduler volcano or kueue",
    ),
    (
        "queue with scheduler-plugins",
        {"gang": {"scheduler": "scheduler-plugins", "queue": "q"}},
        ".spec.gang.queue",
        "queue needs scheduler volcano or kueue",
    ),
    ("kueue without queue", {"gang": {"scheduler": "kueue"}}, ".spec.gang.queue", "kueue needs queue"),
    (
        "schedulerName with kueue",
        {"gang": {"scheduler": "kueue", "queue": "q", "schedulerName": "x"}},
        ".spec.gang.schedulerName",
        "applies to scheduler-plugins and volcano",
    ),
    (
        "timeout with volcano",
        {"gang": {"scheduler": "volcano", "scheduleTimeoutSeconds": 5}},
        ".spec.gang.scheduleTimeoutSeconds",
        "applies to scheduler-plugins only",
    ),
    (
        "checkpoint with both sources",
        {"checkpoint": {"claimName": "a", "volumeName": "b"}},
        ".spec.checkpoint",
        "exactly one of claimName and volumeName",
    ),
    (
        "checkpoint with no source",
        {"checkpoint": {"keep": 2}},
        ".spec.checkpoint",
        "exactly one of claimName and volumeName",
    ),
    (
        "last call above join",
        {"rendezvous": {"joinTimeoutSeconds": 60, "lastCallTimeoutSeconds": 120}},
        ".spec.rendezvous.lastCallTimeoutSeconds",
        "must not exceed joinTimeoutSeconds",
    ),
    (
        "backoff above its cap",
        {"failurePolicy": {"backoffSeconds": 100, "maxBackoffSeconds": 50}},
        ".spec.failurePolicy.backoffSeconds",
        "must not exceed maxBackoffSeconds",
    ),
    ("bad env name", {"network": {"env": {"NOT VALID": "1"}}}, ".spec.network.env", "environment variable names"),
]

SCHEMA_BOUNDS: list[tuple[str, dict[str, Any], str]] = [
    ("zero workers", {"workers": {"min": 0}}, "spec.workers.min"),
    ("too many workers", {"workers": {"max": 5000}}, "spec.workers.max"),
    ("negative gpus", {"gpus": {"count": -1}}, "spec.gpus.count"),
    ("gpu resource without domain", {"gpus": {"resource": "gpu"}}, "spec.gpus.resource"),
    ("topology key not a label", {"placement": {"topology": {"key": "rack name"}}}, "spec.placement.topology.key"),
    (
        "unknown topology mode",
        {"placement": {"topology": {"key": "rack", "mode": "strict"}}},
        "spec.placement.topology.mode",
    ),
    ("unknown backend", {"backend": "mpi"}, "spec.backend"),
    ("unknown profile", {"network": {"profile": "roce"}}, "spec.network.profile"),
    ("unknown gang scheduler", {"gang": {"scheduler": "yunikorn"}}, "spec.gang.scheduler"),
    ("privileged port", {"rendezvous": {"port": 80}}, "spec.rendezvous.port"),
    ("bad shm size", {"network": {"shmSize": "lots"}}, "spec.network.shmSize"),
    (
        "zero last call (torchrun refuses it)",
        {"rendezvous": {"lastCallTimeoutSeconds": 0}},
        "spec.rendezvous.lastCallTimeoutSeconds",
    ),
    ("relative mount path", {"checkpoint": {"claimName": "c", "mountPath": "ckpt"}}, "spec.checkpoint.mountPath"),
    ("unknown spec field", {"replicas": 3}, "spec"),
    ("no containers", {"template": {"spec": {"containers": []}}}, "spec.template.spec.containers"),
]


# More refusals whose exact wording (kubectl's) the integration tier compares with the real API
# server's: types, required fields, unknown fields, counts, and several errors at once.
WORDING: list[tuple[str, dict[str, Any]]] = [
    ("missing max", {"workers": {"max": None}}),
    ("missing template", {"template": None}),
    ("string for an integer", {"workers": {"max": "four"}}),
    ("float for an integer", {"workers": {"max": 2.5}}),
    ("boolean for an integer", {"gpus": {"count": True}}),
    ("object for a string", {"backend": {"name": "nccl"}}),
    ("list for an object", {"network": ["eth0"]}),
    (
        "too many hcas",
        {"gpus": {"count": 8}, "network": {"rdma": {"resource": "rdma/a"}, "hcas": [f"mlx5_{i}" for i in range(33)]}},
    ),
    ("interface name too long", {"network": {"socketInterface": "x" * 16}}),
    ("empty interface name", {"network": {"socketInterface": ""}}),
    ("unknown nested field", {"workers": {"minimum": 1}}),
    ("two unknown fields", {"foo": 1, "gang": {"bar": 2}}),
    ("two rules broken", {"backend": "nccl", "workers": {"min": 5, "max": 4, "desired": 4}}),
    ("a bound and a rule broken", {"backend": "nccl", "workers": {"max": 5000}}),
    ("static launcher with a range", {"launcher": "static"}),
    ("container without a name", {"template": {"spec": {"containers": [{"image": "x"}]}}}),
    ("too many env vars", {"network": {"env": {f"V{i}": "1" for i in range(65)}}}),
    ("integer for an enum", {"backend": 3}),
    ("progress deadline too short", {"failurePolicy": {"progressDeadlineSeconds": 5}}),
    ("unknown launcher", {"launcher": "mpirun"}),
]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted(example: Path) -> None:
    assert validate(yaml.safe_load(example.read_text())) == []


@pytest.mark.parametrize(("case", "spec", "path", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_cel_rules_refuse_impossible_combinations(case: str, spec: dict[str, Any], path: str, message: str) -> None:
    violations = validate(manifest(**spec))
    assert any(v.path == path and message in v.message for v in violations), violations


@pytest.mark.parametrize(("case", "spec", "path"), SCHEMA_BOUNDS, ids=[c[0] for c in SCHEMA_BOUNDS])
def test_schema_bounds_refuse_bad_values(case: str, spec: dict[str, Any], path: str) -> None:
    violations = validate(manifest(**spec))
    assert any(v.path.lstrip(".").startswith(path) for v in violations), violations


IMMUTABLE = [
    ("workers.min", lambda s: s["workers"].update(min=1)),
    ("workers.max", lambda s: s["workers"].update(max=3)),
    ("template", lambda s: s["template"]["spec"]["containers"][0].update(image="other:2")),
    # spares need a supervised command: an edit mid-run would leave the job unplannable
    ("template", lambda s: s["template"]["spec"]["containers"][0].update(command=["python", "-u", "train.py"])),
    ("template", lambda s: s["template"]["spec"]["containers"][0].update(args=["other.py"])),
    ("gpus", lambda s: s.update(gpus={"count": 0, "resource": "amd.com/gpu"})),
    ("backend", lambda s: s.update(backend="gloo")),
    ("network", lambda s: s.update(network={"socketInterface": "net1"})),
    ("rendezvous", lambda s: s.update(rendezvous={"port": 29500})),
    ("procsPerWorker", lambda s: s.update(procsPerWorker=2)),
    ("checkpoint", lambda s: s.update(checkpoint={"claimName": "other"})),
    ("gang.scheduler", lambda s: s.update(gang={"scheduler": "volcano"})),
    ("placement", lambda s: s.update(placement={"topology": {"key": "topology.kubernetes.io/zone"}})),
]


@pytest.mark.parametrize(("field", "change"), IMMUTABLE, ids=[c[0] for c in IMMUTABLE])
def test_fields_that_would_split_the_gang_are_immutable(field: str, change: Any) -> None:
    old = manifest()
    new = copy.deepcopy(old)
    change(new["spec"])
    violations = validate(new, old)
    assert any(
        "immutable" in v.message and v.path.startswith(".spec." + field.split(".", maxsplit=1)[0]) for v in violations
    ), violations


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["workers"].update(desired=4),
        lambda s: s.update(suspend=True),
        lambda s: s.update(failurePolicy={"maxRestarts": 10}),
        lambda s: s.update(ttlSecondsAfterFinished=60, activeDeadlineSeconds=3600),
    ],
)
def test_fields_that_make_sense_mid_run_are_mutable(change: Any) -> None:
    old = manifest()
    new = copy.deepcopy(old)
    change(new["spec"])
    assert validate(new, old) == []


@pytest.mark.parametrize(
    ("name", "ok"),
    [("demo", True), ("a" * 50, True), ("a" * 51, False), ("Demo", False), ("1job", False), ("job.v2", False)],
)
def test_job_names_fit_the_children(name: str, ok: bool) -> None:
    body = manifest()
    body["metadata"]["name"] = name
    assert (validate(body) == []) is ok
