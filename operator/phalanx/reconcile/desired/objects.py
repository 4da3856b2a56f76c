"""What every child object of a TrainingJob carries: its owner reference, its job's labels, and a
hash of its own content in ``phalanx.dev/spec-hash``, so the planner can tell "already as desired"
from "needs applying" without comparing whole objects, and re-planning against its own result
yields no change.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming

Object = dict[str, Any]


def spec_hash(obj: Object) -> str:
    """A short digest of an object's content, stable across runs."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def with_spec_hash(obj: Object) -> Object:
    obj["metadata"].setdefault("annotations", {})[naming.SPEC_HASH_ANNOTATION] = spec_hash(obj)
    return obj


def owner_reference(job: api.TrainingJob) -> dict[str, Any]:
    """The controller reference that lets the garbage collector delete children with the job."""
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(
    job: api.TrainingJob, name: str, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": {**(labels or {}), **naming.job_labels(job.metadata.name)},
        "ownerReferences": [owner_reference(job)],
    }
    if annotations:
        metadata["annotations"] = dict(annotations)
    return metadata


def template_spec(job: api.TrainingJob) -> dict[str, Any]:
    return job.spec.template.spec.model_dump(by_alias=True, exclude_none=True)
