"""The kinds of object a TrainingJob owns or reads, declared once (controller-runtime's ``.Owns()``).

Each row says which API serves the kind, whether that API may be missing from a cluster (the job
then waits, says why, and starts once the API is there), how the operator watches it, in which
stage ``apply`` writes it, and the RBAC verbs the operator needs on it. The table drives the
informers (``handlers.runtime``), the optional-API checks (``Runtime.missing_apis``), ``apply``'s
write order, and a test that holds the Helm chart's RBAC to it (tests/unit/test_child_kinds.py).
A new child kind is a row here, a builder in ``desired``, and its rule in the chart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from phalanx.reconcile.desired import (
    COSCHEDULING_API,
    ENDPOINT_SLICE_API,
    NETWORK_POLICY_API,
    RESOURCE_API,
    VOLCANO_API,
)

KUEUE_API = "kueue.x-k8s.io/v1beta2"

Informer = Literal["owned", "named", "isolating"]
"""How a kind is watched, in every watched namespace: ``owned``, only objects labelled with a job's
name (only our children cross the wire), into the children's cache; ``isolating``, the same, only
while the operator gives each job a NetworkPolicy; ``named``, every object, into a cache of its own
(Kueue's Workloads are named after our pod groups, not labelled)."""

READ = ("get", "list", "watch")
# delete also where the operator never deletes: with OwnerReferencesPermissionEnforcement only
# whoever may delete an object may set its blockOwnerDeletion owner reference (charts: phalanx.rules)
WRITE = (*READ, "create", "patch", "delete")


@dataclass(frozen=True)
class ChildKind:
    """One kind of object a job owns or reads."""

    api_version: str
    kind: str
    plural: str
    optional: bool  # its API may be missing: the informer waits for it instead of failing
    informer: Informer
    write_stage: int | None  # apply writes stage 0 before stage 1 (None: the operator never writes it)
    verbs: tuple[str, ...]  # what the operator's Role needs on it

    @property
    def group(self) -> str:
        """The API group, as RBAC names it ("" for the core API)."""
        group, _, _ = self.api_version.rpartition("/")
        return group


POD = ChildKind("v1", "Pod", "pods", optional=False, informer="owned", write_stage=1, verbs=WRITE)
SERVICE = ChildKind("v1", "Service", "services", optional=False, informer="owned", write_stage=1, verbs=WRITE)
# rank addresses (docs/placement.md)
ENDPOINT_SLICE = ChildKind(
    ENDPOINT_SLICE_API, "EndpointSlice", "endpointslices", optional=False, informer="owned", write_stage=1, verbs=WRITE
)
# the gang's PodGroup before any pod: a scheduler that sees a pod first may place it alone
COSCHEDULING_POD_GROUP = ChildKind(
    COSCHEDULING_API, "PodGroup", "podgroups", optional=True, informer="owned", write_stage=0, verbs=WRITE
)
VOLCANO_POD_GROUP = ChildKind(
    VOLCANO_API, "PodGroup", "podgroups", optional=True, informer="owned", write_stage=0, verbs=WRITE
)
# DRA: Kubernetes 1.34+
DEVICE_CLAIM_TEMPLATE = ChildKind(
    RESOURCE_API,
    "ResourceClaimTemplate",
    "resourceclaimtemplates",
    optional=True,
    informer="owned",
    write_stage=1,
    verbs=WRITE,
)
# Kueue's, never created: read to say in status why a gang is queued, patched only in its
# priority-boost annotation (reconcile.preemption_cost)
KUEUE_WORKLOAD = ChildKind(
    KUEUE_API, "Workload", "workloads", optional=True, informer="named", write_stage=None, verbs=(*READ, "patch")
)
# the chart grants no delete here (networkPolicy.jobs): see the report on the chart's RBAC
NETWORK_POLICY = ChildKind(
    NETWORK_POLICY_API,
    "NetworkPolicy",
    "networkpolicies",
    optional=False,
    informer="isolating",
    write_stage=1,
    verbs=(*READ, "create", "patch"),
)

CHILD_KINDS: tuple[ChildKind, ...] = (
    POD,
    SERVICE,
    ENDPOINT_SLICE,
    COSCHEDULING_POD_GROUP,
    VOLCANO_POD_GROUP,
    DEVICE_CLAIM_TEMPLATE,
    KUEUE_WORKLOAD,
    NETWORK_POLICY,
)
"""Every kind, in the order their informers start."""


def watched(*, isolating: bool) -> tuple[ChildKind, ...]:
    """The kinds the operator watches: the NetworkPolicies only while it gives jobs their own."""
    return tuple(kind for kind in CHILD_KINDS if kind.informer != "isolating" or isolating)


def optional_kinds() -> tuple[ChildKind, ...]:
    """The kinds whose API a cluster may lack."""
    return tuple(kind for kind in CHILD_KINDS if kind.optional)


def stalling_when_missing() -> tuple[ChildKind, ...]:
    """The optional kinds a job cannot start without when it needs them (its PodGroup, its
    ResourceClaimTemplate): a missing API stalls the job with the reason (``Runtime.missing_apis``).
    A missing Workload API only leaves status without Kueue's word."""
    return tuple(kind for kind in optional_kinds() if kind.write_stage is not None)


def in_write_stages() -> tuple[tuple[ChildKind, ...], ...]:
    """The written kinds, stage by stage: everything in one stage is written at once, after the
    stage before it."""
    stages = sorted({kind.write_stage for kind in CHILD_KINDS if kind.write_stage is not None})
    return tuple(tuple(kind for kind in CHILD_KINDS if kind.write_stage == stage) for stage in stages)


def write_stage(api_version: str, kind: str) -> int:
    """The stage in which ``apply`` writes an object of this kind; a kind the table does not know
    is written last, with everything else."""
    for row in CHILD_KINDS:
        if row.api_version == api_version and row.kind == kind and row.write_stage is not None:
            return row.write_stage
    return max(row.write_stage for row in CHILD_KINDS if row.write_stage is not None)
