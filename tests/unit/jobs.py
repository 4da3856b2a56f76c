"""TrainingJob manifests for tests, built from a small CPU job plus overrides."""

from __future__ import annotations

import copy
from typing import Any

from phalanx.api.v1alpha1 import TrainingJob
from tests.unit.crd_validation import defaulted

BASE: dict[str, Any] = {
    "apiVersion": "phalanx.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {
        "name": "demo",
        "namespace": "ml",
        "uid": "5f1c0d2e-aaaa-bbbb-cccc-000000000001",
        "generation": 1,
        "creationTimestamp": "2026-11-30T10:00:00Z",
    },
    "spec": {
        "workers": {"min": 2, "max": 4, "desired": 3},
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "image": "example/train:1",
                        "command": ["torchrun"],
                        "args": ["train.py"],
                        "resources": {"limits": {"cpu": "4", "memory": "8Gi"}},
                    }
                ]
            }
        },
    },
}


def _merge(target: dict[str, Any], changes: dict[str, Any]) -> None:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        elif value is None:
            target.pop(key, None)
        else:
            target[key] = copy.deepcopy(value)


def manifest(**spec: Any) -> dict[str, Any]:
    """The base manifest with ``spec`` keys deep-merged in (None deletes a key)."""
    body = copy.deepcopy(BASE)
    _merge(body["spec"], spec)
    return body


def job(body: dict[str, Any] | None = None, *, status: dict[str, Any] | None = None, **spec: Any) -> TrainingJob:
    """A parsed TrainingJob as the operator reads it from the API server (defaults applied)."""
    body = defaulted(body if body is not None else manifest(**spec))
    if status is not None:
        body["status"] = status
    return TrainingJob.from_body(body)
