"""The unit tests' JSON patch applier (RFC 6902) behaves as the API server's: all or nothing, tests
that guard, pointers unescaped."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit import json_patch
from tests.unit.json_patch import PatchFailedError


def pod() -> dict[str, Any]:
    return {
        "metadata": {
            "uid": "u1",
            "labels": {"phalanx.dev/attempt": "0", "a~b": "tilde"},
            "annotations": {},
            "finalizers": ["x", "y"],
        }
    }


def test_pointer_tokens_are_unescaped_tilde_one_before_tilde_zero() -> None:
    assert json_patch.tokens("/metadata/labels/phalanx.dev~1attempt") == ["metadata", "labels", "phalanx.dev/attempt"]
    assert json_patch.tokens("/a~01") == ["a~1"]  # "~01" is "~" then "1", never "/"
    assert json_patch.tokens("") == []


def test_add_replace_and_remove_on_objects_and_arrays() -> None:
    patched = json_patch.apply(
        pod(),
        [
            {"op": "test", "path": "/metadata/uid", "value": "u1"},
            {"op": "replace", "path": "/metadata/labels/phalanx.dev~1attempt", "value": "1"},
            {"op": "add", "path": "/metadata/annotations/phalanx.dev~1rank-address", "value": "a1-x"},
            {"op": "remove", "path": "/metadata/labels/a~0b"},
            {"op": "add", "path": "/metadata/finalizers/-", "value": "z"},
            {"op": "add", "path": "/metadata/finalizers/0", "value": "w"},
            {"op": "remove", "path": "/metadata/finalizers/1"},
            {"op": "replace", "path": "/metadata/finalizers/0", "value": "v"},
        ],
    )
    assert patched["metadata"] == {
        "uid": "u1",
        "labels": {"phalanx.dev/attempt": "1"},
        "annotations": {"phalanx.dev/rank-address": "a1-x"},
        "finalizers": ["v", "y", "z"],
    }


def test_add_replaces_an_existing_member() -> None:
    patched = json_patch.apply(pod(), [{"op": "add", "path": "/metadata/labels/a~0b", "value": "new"}])
    assert patched["metadata"]["labels"]["a~b"] == "new"


@pytest.mark.parametrize(
    "operation",
    [
        {"op": "test", "path": "/metadata/uid", "value": "u2"},  # another pod of the same name
        {"op": "test", "path": "/metadata/labels/phalanx.dev~1role", "value": "spare"},  # absent
        {"op": "test", "path": "/metadata/labels/phalanx.dev~1attempt", "value": 0},  # "0" is no number
        {"op": "replace", "path": "/metadata/labels/missing", "value": "x"},
        {"op": "remove", "path": "/metadata/labels/missing"},
        {"op": "add", "path": "/metadata/missing/key", "value": "x"},  # no parent
        {"op": "add", "path": "/metadata/finalizers/3", "value": "x"},  # past the end
        {"op": "remove", "path": "/metadata/finalizers/01"},  # leading zero
        {"op": "move", "path": "/metadata/uid", "from": "/metadata/name"},  # not supported here
    ],
)
def test_a_failing_operation_leaves_the_document_as_it_was(operation: dict[str, Any]) -> None:
    document = pod()
    first = {"op": "replace", "path": "/metadata/labels/phalanx.dev~1attempt", "value": "9"}
    with pytest.raises(PatchFailedError):
        json_patch.apply(document, [first, operation])
    assert document == pod()


def test_the_document_given_is_never_changed_and_values_are_copied() -> None:
    document = pod()
    value = {"nested": ["a"]}
    patched = json_patch.apply(document, [{"op": "add", "path": "/spec", "value": value}])
    value["nested"].append("b")
    assert patched["spec"] == {"nested": ["a"]} and "spec" not in document
