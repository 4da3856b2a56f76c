"""Names, labels and annotation keys of everything the operator creates, in one place.

Children carry only our own ``phalanx.dev/*`` labels (plus the conventional
``app.kubernetes.io/managed-by``), never the TrainingJob's labels: GitOps tools track
objects by label and would adopt or prune our pods.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from phalanx.api import v1alpha1 as api

PREFIX = api.GROUP
FIELD_MANAGER = "phalanx"
FINALIZER = f"{PREFIX}/finalizer"

JOB_NAME_LABEL = f"{PREFIX}/job-name"
ROLE_LABEL = f"{PREFIX}/role"
WORKER_INDEX_LABEL = f"{PREFIX}/worker-index"
ATTEMPT_LABEL = f"{PREFIX}/attempt"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "phalanx"

SPEC_HASH_ANNOTATION = f"{PREFIX}/spec-hash"
METRICS_PORT_NAME = "phalanx-metrics"  # the container port the operator scrapes (workers and store)
CONTAINER_ANNOTATION = f"{PREFIX}/trainer-container"
# On a worker pod whose command runs phalanx-supervise: its attempt's rendezvous id, which the
# supervisor reads (with the attempt label) from a downward-API volume; both change when the
# gang restarts in place.
RENDEZVOUS_ID_ANNOTATION = f"{PREFIX}/rendezvous-id"
# On a supervised worker pod of a job placed by topology: the name its torchrun agent gives the
# rendezvous as its address (PET_LOCAL_ADDR), which resolves to the pod through the job's ranks
# Service; the rendezvous numbers agents in the sort order of these names (topology.rank_addresses).
RANK_ADDRESS_ANNOTATION = f"{PREFIX}/rank-address"
# On a worker pod the operator placed by topology: the domain its node affinity names.
DOMAIN_ANNOTATION = f"{PREFIX}/domain"
POD_INFO_VOLUME = "phalanx-pod-info"
POD_INFO_DIR = "/etc/phalanx/pod"
# On a TrainingJob, set by a user or a script to any token (a timestamp, say): the workers save a
# checkpoint at their next step boundary (reconcile.save_now). The operator copies the token onto
# the job's running worker pods, whose workers read it from a downward-API file (NOTICES_DIR).
SAVE_NOW_ANNOTATION = f"{PREFIX}/save-now"
NOTICES_VOLUME = "phalanx-notices"
NOTICES_DIR = "/etc/phalanx/notices"

ROLE_WORKER = "worker"
ROLE_RENDEZVOUS = "rendezvous"
ROLE_SPARE = "spare"  # a warm spare worker pod, promoted to ROLE_WORKER by a relabel

# Gang scheduling integration keys (scheduler-plugins, Volcano, Kueue).
COSCHEDULING_POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
# Kueue waits for replacements of a retriable group's failed pods (holding its quota); phalanx
# never replaces a pod within a Kueue group (each gang attempt is a new group), so its groups are
# not retriable: once no pod of a group is active, Kueue finishes its Workload and frees the quota.
KUEUE_RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
# On a coscheduling PodGroup: a fingerprint of the nodes' capacity when its gang last waited for
# nodes. Coscheduling retries a gang it rejected only on pod or PodGroup events, so a change here
# (an update of the PodGroup) is what makes it try again as soon as capacity appears.
NODE_CAPACITY_ANNOTATION = f"{PREFIX}/node-capacity"

DEFAULT_SCHEDULER_NAMES: Mapping[str, str] = {
    "scheduler-plugins": "scheduler-plugins-scheduler",
    "volcano": "volcano",
}


def worker_pod_name(job_name: str, index: int) -> str:
    """Worker pods are named by slot; a slot is reused only after its old pod is gone."""
    return f"{job_name}-worker-{index}"


def spare_pod_name(job_name: str, serial: int) -> str:
    """Spare pods are numbered apart from slots: a promoted spare keeps its name in its slot."""
    return f"{job_name}-spare-{serial}"


def rendezvous_name(job_name: str) -> str:
    """Name of the rendezvous store pod and of the Service in front of it."""
    return f"{job_name}-rdzv"


def workers_service_name(job_name: str) -> str:
    """The headless Service that gives static-launcher workers stable DNS names
    (``<job>-worker-<index>.<job>-workers``)."""
    return f"{job_name}-workers"


def master_address(job_name: str, namespace: str) -> str:
    """Worker 0's stable DNS name: MASTER_ADDR of the static launcher."""
    return f"{worker_pod_name(job_name, 0)}.{workers_service_name(job_name)}.{namespace}.svc"


def ranks_service_name(job_name: str) -> str:
    """The headless Service (and its first EndpointSlice) under which workers' rank addresses resolve."""
    return f"{job_name}-ranks"


def ranks_slice_name(job_name: str, shard: int) -> str:
    """The ranks Service's EndpointSlice number ``shard`` (``desired.ranks_shard``): the first is
    named like the Service, as the one slice was before there were more, so an existing one is
    kept; the others ``<job>-ranks-<shard>``."""
    service = ranks_service_name(job_name)
    return f"{service}-{shard}" if shard else service


def ranks_slice_shard(job_name: str, slice_name: str) -> int | None:
    """The shard an EndpointSlice of the job's is by its name (``ranks_slice_name``), or None."""
    service = ranks_service_name(job_name)
    if slice_name == service:
        return 0
    prefix, _, shard = slice_name.rpartition("-")
    if prefix != service or not shard.isdigit() or ranks_slice_name(job_name, int(shard)) != slice_name:
        return None
    return int(shard)


SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ENDPOINT_SLICE_MANAGER_LABEL = "endpointslice.kubernetes.io/managed-by"
ENDPOINT_SLICE_MANAGER = "phalanx.dev"


DEVICE_CLAIM = "devices"
"""The name of the pod's resource claim (and of the trainer container's reference to it)."""


def device_claim_template_name(job_name: str) -> str:
    """The job's ResourceClaimTemplate (DRA devices), from which each worker's claim is made."""
    return f"{job_name}-devices"


def pod_group_name(job_name: str) -> str:
    """The gang's PodGroup (scheduler-plugins or Volcano) lives as long as the job."""
    return job_name


def kueue_group_name(job_name: str, attempt: int) -> str:
    """Kueue pod groups are fixed-size, so every gang attempt is a new group."""
    return f"{job_name}-a{attempt}"


def kueue_group_job(group_name: str) -> str | None:
    """The job a Kueue pod group (and its Workload, named alike) belongs to, if it is one of ours."""
    job, _, attempt = group_name.rpartition("-a")
    return job if job and attempt.isdigit() else None


COMPLETION_KEY = "phalanx/training-completed"
"""Rendezvous-store key a rank sets when training completed: JSON with attempt, step and rank. The
store pod serves it as ``phalanx_training_completed_*``. A wire contract with phalanx.worker (its
``protocol.COMPLETION_KEY``), which ships in a distribution of its own."""


CHECKPOINT_SAVE_NOW_METRIC = "phalanx_worker_last_checkpoint_save_now"
"""Gauge on a worker's /metrics: ``save_now_key`` of the save-now token its last checkpoint
answered (0: none); ``reconcile.save_now`` answers a request by it. A wire contract with
phalanx.worker (``protocol.CHECKPOINT_SAVE_NOW_METRIC`` and ``protocol.save_now_key``)."""


def save_now_key(token: str) -> int:
    """A save-now token as the positive integer below 2**48 the workers compute for it."""
    return int.from_bytes(hashlib.sha256(token.encode()).digest()[:6], "big") | 1


PROGRESS_KEY = "phalanx/training-progress"
"""Rendezvous-store key under which rank 0 keeps its latest progress report (steps, a few named
metrics); the store pod serves it as ``phalanx_training_progress_*``. The same wire contract as
``protocol.PROGRESS_KEY`` and its bounds below."""
PROGRESS_MAX_BYTES = 4096
PROGRESS_MAX_METRICS = 8
PROGRESS_METRIC_NAME = r"^[A-Za-z_][A-Za-z0-9_./-]{0,62}$"

STEP_TIME_KEY = "phalanx/step-time/"
"""Rendezvous-store key prefix under which each rank keeps its recent step time (``<prefix><rank>``):
JSON with job, attempt, rank, host (its pod's hostname), seconds (the median of its last steps) and
step. The store pod serves it as ``phalanx_training_rank_step_*``, for ranks below its world cap
only; the same wire contract as ``protocol.STEP_TIME_KEY`` and its bounds below."""
STEP_TIME_MAX_BYTES = 512
STEP_TIME_MAX_RANKS = 1024
STEP_TIME_MAX_SECONDS = 86400
"""A step time longer than a day is no measure (a rank that is that slow has hung)."""
"""The most ranks a store serves step times of (the job's world cap, workers.max x processes, below it)."""
STEP_TIME_HOST = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
"""A rank's host as a step-time record may name it (a pod's hostname: a DNS subdomain)."""


def rendezvous_endpoint(job_name: str, namespace: str, port: int) -> str:
    """The store's address as workers dial it (resolved through the cluster's DNS search path)."""
    return f"{rendezvous_name(job_name)}.{namespace}.svc:{port}"


def rendezvous_id(job_uid: str, attempt: int) -> str:
    """A rendezvous that closed cannot be reused, so every gang attempt gets a new id."""
    return f"{job_uid[:8] or 'job'}-{attempt}"


def job_labels(job_name: str) -> dict[str, str]:
    """Labels every child carries."""
    return {JOB_NAME_LABEL: job_name, MANAGED_BY_LABEL: MANAGED_BY}


def worker_selector(job_name: str) -> str:
    """The scale subresource's selector: the job's worker pods."""
    return f"{JOB_NAME_LABEL}={job_name},{ROLE_LABEL}={ROLE_WORKER}"


# --- replica groups (spec.replicaGroups) ------------------------------------------------------
REPLICA_GROUP_LABEL = f"{PREFIX}/replica-group"
"""The replica group a worker belongs to (its index // replicaGroups.size)."""
GROUP_GENERATION_LABEL = f"{PREFIX}/group-generation"
"""How often the worker's group was restarted alone when the pod was made (status.replicaGroups)."""


def group_rendezvous_id(job_uid: str, attempt: int, group: int, generation: int) -> str:
    """Each replica group is a torchrun world of its own, and each restart of the group alone a new
    one (a closed rendezvous cannot be reused)."""
    return f"{rendezvous_id(job_uid, attempt)}-g{group}-{generation}"
