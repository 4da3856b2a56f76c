"""What the operator creates for a TrainingJob, rendered without a cluster (``phalanx plan``).

The objects come from the same builders the planner's first passes use, in the order it creates
them: the ResourceClaimTemplate of DRA devices, the gang's PodGroup, the Services, the rendezvous
store, the ranks Service (ranks that follow placement), then every worker of attempt 0. The ranks
Service's EndpointSlices are not shown: they name the workers once they are placed.
Only what the API server assigns is invented: the job's UID (a placeholder, so the rendezvous id
reads ``00000000-0``) and the namespace when the manifest names none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import desired, naming
from phalanx.reconcile.environment import Launch, resolve_launch

Object = dict[str, Any]
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"


@dataclass(frozen=True)
class Preview:
    """A job as the API server would store it, and the children the operator would create for it."""

    job: api.TrainingJob
    launch: Launch
    objects: tuple[Object, ...]

    def of_kind(self, kind: str) -> list[Object]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def workers(self) -> list[Object]:
        return [pod for pod in self.of_kind("Pod") if _role(pod) == naming.ROLE_WORKER]

    def store(self) -> Object:
        return next(pod for pod in self.of_kind("Pod") if _role(pod) == naming.ROLE_RENDEZVOUS)


def _role(obj: Object) -> str:
    return str(obj["metadata"]["labels"].get(naming.ROLE_LABEL, ""))


def preview(stored: dict[str, Any], namespace: str = "default") -> Preview:
    """Render the children of a job as the API server stores it (defaults applied); raises
    PlanningError for a spec the operator would fail with InvalidSpec."""
    metadata = {**stored.get("metadata", {}), "uid": PLACEHOLDER_UID, "generation": 1}
    metadata.setdefault("namespace", namespace)
    job = api.TrainingJob.from_body({**stored, "metadata": metadata})
    launch = resolve_launch(job.spec)
    children = desired.job_children(job, launch)
    return Preview(job=job, launch=launch, objects=children.in_creation_order(attempt=0))
