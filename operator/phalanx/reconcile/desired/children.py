"""The one builder of a job's desired children, shared by the planner (``decide``) and ``phalanx plan``
(``preview``): what the job should have besides its workers' slots, which the planner fills pass by pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.api import v1alpha1 as api
from phalanx.reconcile.desired.devices import device_claim_template
from phalanx.reconcile.desired.gang import pod_group
from phalanx.reconcile.desired.networking import job_network_policy, ranks_service, rendezvous_service, workers_service
from phalanx.reconcile.desired.objects import Object
from phalanx.reconcile.desired.pods import worker_pod
from phalanx.reconcile.desired.store import rendezvous_store_pod
from phalanx.reconcile.environment import Launch
from phalanx.reconcile.observed import JobIsolation


@dataclass(frozen=True)
class JobChildren:
    """The children of one job as they should be now (None: the job has none of that kind)."""

    job: api.TrainingJob
    launch: Launch
    isolation: JobIsolation | None
    store: Object
    pod_group: Object | None
    rendezvous_service: Object
    workers_service: Object | None
    device_claim_template: Object | None
    ranks_service: Object | None

    @property
    def services(self) -> tuple[Object | None, Object | None]:
        return (self.rendezvous_service, self.workers_service)

    @property
    def network_policy(self) -> Object | None:
        # rendered only where it is wanted: with scrapers it renders a worker, whose errors a
        # pass that ends earlier (suspension, a failure) must not raise
        return job_network_policy(self.job, self.launch, self.isolation)

    def workers(self, attempt: int) -> list[Object]:
        """A worker for every desired slot of ``attempt``."""
        return [
            worker_pod(self.job, self.launch, index=index, attempt=attempt)
            for index in range(self.job.spec.workers.desired)
        ]

    def in_creation_order(self, attempt: int) -> tuple[Object, ...]:
        """Everything the first passes create, in their order, with the workers of ``attempt``
        (the ranks' EndpointSlices name placed workers, so they come later)."""
        objects = (
            self.device_claim_template,
            self.pod_group,
            self.network_policy,
            self.rendezvous_service,
            self.workers_service,
            self.store,
            self.ranks_service,
        )
        return (*(obj for obj in objects if obj is not None), *self.workers(attempt))


def job_children(
    job: api.TrainingJob,
    launch: Launch,
    *,
    avoid: Sequence[str] = (),
    node_capacity: str | None = None,
    isolation: JobIsolation | None = None,
) -> JobChildren:
    """The job's children: ``avoid``, nodes its store keeps off (failurePolicy.avoidNodeSeconds);
    ``node_capacity``, the coscheduling PodGroup's stamp (``naming.NODE_CAPACITY_ANNOTATION``);
    ``isolation``, the operator's NetworkPolicy setting (None: no NetworkPolicy)."""
    return JobChildren(
        job=job,
        launch=launch,
        isolation=isolation,
        store=rendezvous_store_pod(job, launch, avoid=avoid),
        pod_group=pod_group(job, launch, node_capacity),
        rendezvous_service=rendezvous_service(job),
        workers_service=workers_service(job),
        device_claim_template=device_claim_template(job),
        ranks_service=ranks_service(job, launch),
    )
