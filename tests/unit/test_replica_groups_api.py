"""spec.replicaGroups: what admission refuses (with a message naming the field) and accepts."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.unit.crd_validation import defaulted, validate
from tests.unit.jobs import manifest

GROUPS = {"workers": {"min": 3, "max": 9, "desired": 9}, "replicaGroups": {"size": 3, "min": 2}}


def test_groups_of_whole_workers_are_accepted_and_defaulted() -> None:
    body = manifest(workers={"min": 2, "max": 6, "desired": 6}, replicaGroups={"size": 2})
    assert validate(body) == []
    assert defaulted(body)["spec"]["replicaGroups"] == {"size": 2, "min": 1}


def test_a_topology_key_is_accepted() -> None:
    assert (
        validate(manifest(**{**GROUPS, "replicaGroups": {"size": 3, "topology": "topology.kubernetes.io/rack"}})) == []
    )


def test_spares_are_accepted_with_groups_placed_anywhere() -> None:
    assert validate(manifest(**{**GROUPS, "workers": {**GROUPS["workers"], "spares": 3}})) == []


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "desired not a multiple",
        {"workers": {"min": 3, "max": 9, "desired": 8}},
        ".spec.replicaGroups.size",
        "multiples of replicaGroups.size",
    ),
    (
        "min not a multiple",
        {"workers": {"min": 2, "max": 9, "desired": 9}},
        ".spec.replicaGroups.size",
        "multiples of replicaGroups.size",
    ),
    (
        "max not a multiple",
        {"workers": {"min": 3, "max": 10, "desired": 9}},
        ".spec.replicaGroups.size",
        "multiples of replicaGroups.size",
    ),
    (
        "more min groups than groups",
        {"replicaGroups": {"min": 4}},
        ".spec.replicaGroups.min",
        "must not exceed the groups",
    ),
    (
        "static launcher",
        {"launcher": "static", "workers": {"min": 9, "max": 9}},
        ".spec.replicaGroups",
        "launcher torchrun",
    ),
    (
        "kueue",
        {"gang": {"scheduler": "kueue", "queue": "q"}},
        ".spec.replicaGroups",
        "not available with gang.scheduler kueue",
    ),
    (
        "spares with a topology",
        {"workers": {"spares": 1}, "replicaGroups": {"topology": "topology.kubernetes.io/rack"}},
        ".spec.replicaGroups.topology",
        "does not take workers.spares",
    ),
]


@pytest.mark.parametrize(("case", "spec", "path", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_groups_are_refused_naming_the_field(case: str, spec: dict[str, Any], path: str, message: str) -> None:
    body = manifest(**GROUPS)
    body = manifest(
        **{**GROUPS, **{k: {**GROUPS.get(k, {}), **v} if isinstance(v, dict) else v for k, v in spec.items()}}
    )
    violations = validate(body)
    assert any(v.path == path and message in v.message for v in violations), violations


@pytest.mark.parametrize(
    ("bad", "path"), [({"size": 0}, "size"), ({"min": 0}, "min"), ({"topology": "a b"}, "topology")]
)
def test_schema_bounds(bad: dict[str, Any], path: str) -> None:
    violations = validate(manifest(**{**GROUPS, "replicaGroups": {**GROUPS["replicaGroups"], **bad}}))
    assert any(v.path.startswith(f".spec.replicaGroups.{path}") for v in violations), violations


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["replicaGroups"].update(size=1),
        lambda s: s["replicaGroups"].update(min=1),
        lambda s: s.pop("replicaGroups"),
    ],
)
def test_groups_are_immutable(change: Any) -> None:
    old = manifest(**GROUPS)
    new = copy.deepcopy(old)
    change(new["spec"])
    violations = validate(new, old)
    assert any(v.path == ".spec.replicaGroups" and "immutable" in v.message for v in violations), violations


def test_adding_groups_to_a_running_job_is_refused() -> None:
    old = manifest(workers={"min": 3, "max": 9, "desired": 9})
    new = manifest(**GROUPS)
    assert any(v.path == ".spec.replicaGroups" for v in validate(new, old))


def test_scaling_by_whole_groups_is_allowed() -> None:
    old = manifest(**GROUPS)
    new = copy.deepcopy(old)
    new["spec"]["workers"]["desired"] = 6
    assert validate(new, old) == []
