"""A job as the SDK takes it (a ``TrainingJob`` model, a dict, a YAML file) made into the body sent
to the API server, and ``plan``: the offline verdict ``phalanx plan`` gives."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.cli.manifests import ManifestError, read_file
from phalanx.cli.plan import judge, summary
from phalanx.sdk.errors import PhalanxError, SpecRefused

JobSource = api.TrainingJob | Mapping[str, Any] | str | os.PathLike[str]
"""What ``submit`` and ``plan`` take: a model, a body, or the path of a YAML file of one document."""


def job_body(job: JobSource, namespace: str) -> dict[str, Any]:
    """The body to create, in ``namespace`` unless it names its own."""
    if isinstance(job, api.TrainingJob):
        body = job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status", "metadata"})
        given = job.metadata.model_fields_set & {"name", "namespace", "labels", "annotations"}  # not a default
        body["metadata"] = job.metadata.model_dump(mode="json", by_alias=True, exclude_none=True, include=given)
    elif isinstance(job, Mapping):
        body = copy.deepcopy(dict(job))
    elif isinstance(job, (str, os.PathLike)):
        body = _read_one(os.fspath(job))
    else:
        raise TypeError(f"a job is a TrainingJob, a dict or a YAML path, not {type(job).__name__}")
    body.pop("status", None)
    metadata = body.setdefault("metadata", {})
    if not isinstance(metadata, dict):
        raise SpecRefused("metadata must be an object")
    metadata.setdefault("namespace", namespace)
    return body


def _read_one(path: str) -> dict[str, Any]:
    try:
        documents = [document for document in read_file(path) if document.body is not None]
    except ManifestError as error:
        raise PhalanxError(str(error)) from None
    if len(documents) != 1 or not isinstance(documents[0].body, dict):
        raise PhalanxError(f"{path}: expected one TrainingJob document, found {len(documents)} documents")
    return dict(documents[0].body)


@dataclass(frozen=True)
class Plan:
    """The offline verdict on a job: accepted with what the operator would create, or refused in
    the words the API server (or the operator, InvalidSpec) would use."""

    accepted: bool
    message: str
    """'' when accepted; else the refusal, as ``phalanx plan`` prints it."""
    summary: str
    """The summary ``phalanx plan`` prints for an accepted job."""
    objects: tuple[dict[str, Any], ...]
    """Every object the operator would create (pods, Services, ...)."""

    def raise_if_refused(self) -> Plan:
        if not self.accepted:
            raise SpecRefused(self.message)
        return self


def plan(job: JobSource, namespace: str) -> Plan:
    body = job_body(job, namespace)
    result = judge(body, namespace=str(body["metadata"].get("namespace") or namespace))
    if isinstance(result, str):
        return Plan(accepted=False, message=result, summary="", objects=())
    return Plan(accepted=True, message="", summary=summary(result), objects=tuple(result.objects))
