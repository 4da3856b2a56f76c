"""TrainingJob ``phalanx.dev/v1alpha1``: the contract between users and the operator.

These models are the single source of the CustomResourceDefinition (``phalanx crd``):
field docstrings become the schema's descriptions (``kubectl explain``), ``Field``
bounds become schema bounds, and the ``x-kubernetes-validations`` attached here are
the CEL rules the API server enforces. Defaults live in the schema, so the operator
never writes ``spec``. Where a default depends on another field (processes per worker),
the docstring says how the operator derives it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "phalanx.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj",)
CATEGORIES = ("phalanx",)

MAX_JOB_NAME_LENGTH = 50
"""Leaves room for the ``-rdzv`` and ``-worker-NNNN`` suffixes within a 63-character DNS label."""

MAX_WORKERS = 4096
MAX_SPARES = 64

Backend = Literal["auto", "nccl", "gloo"]
NetworkProfile = Literal["auto", "tcp", "infiniband", "efa"]
GangScheduler = Literal["none", "scheduler-plugins", "volcano", "kueue"]
Launcher = Literal["torchrun", "static"]
Phase = Literal["Pending", "Starting", "Running", "Rescaling", "Restarting", "Succeeded", "Failed", "Suspended"]

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
EXTENDED_RESOURCE_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-a-zA-Z0-9_.]+$"
ENV_NAME_RULE = "self.all(k, k.matches('^[A-Za-z_][A-Za-z0-9_]*$'))"


def cel(
    rule: str,
    message: str | None = None,
    *,
    field_path: str | None = None,
    message_expression: str | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """One ``x-kubernetes-validations`` entry."""
    entry: dict[str, Any] = {"rule": rule}
    if message is not None:
        entry["message"] = message
    if message_expression is not None:
        entry["messageExpression"] = message_expression
    if field_path is not None:
        entry["fieldPath"] = field_path
    if reason is not None:
        entry["reason"] = reason
    return entry


def immutable(what: str) -> dict[str, Any]:
    """A transition rule that refuses any change once the object exists."""
    return cel(
        "self == oldSelf",
        f"is immutable: changing {what} mid-run would split the gang; delete and recreate the TrainingJob instead",
    )


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, docstrings as descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
        extra="forbid",
        frozen=True,
    )


class Workers(ApiModel):
    """How many workers the job runs. One worker is one pod is one torchrun agent."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.min <= self.max", "min must not exceed max", field_path=".min"),
                cel(
                    "self.desired >= self.min && self.desired <= self.max",
                    "desired must lie within [min, max]",
                    field_path=".desired",
                ),
            ]
        }
    )

    min: int = Field(
        default=1,
        ge=1,
        le=MAX_WORKERS,
        json_schema_extra={"x-kubernetes-validations": [immutable("workers.min (torchrun --nnodes)")]},
    )
    """Fewest workers the job trains with. Below this the gang restarts from the latest checkpoint.
    This is also the gang scheduler's minMember."""

    max: int = Field(
        ge=1,
        le=MAX_WORKERS,
        json_schema_extra={"x-kubernetes-validations": [immutable("workers.max (torchrun --nnodes)")]},
    )
    """Most workers the job trains with (torchrun --nnodes=min:max)."""

    desired: int = Field(ge=1, le=MAX_WORKERS)
    """Workers the operator tries to run, within [min, max]. This is the scale subresource:
    `kubectl scale tj/NAME --replicas=N` and a HorizontalPodAutoscaler change it."""

    spares: int = Field(default=0, ge=0, le=MAX_SPARES)
    """Warm spare worker pods run beyond desired: scheduled, started and, with phalanx-supervise,
    Python and torch imported, but not in the world. A lost worker's slot is taken by a ready
    spare at once (the operator relabels the pod; its supervisor starts the command) and a new
    spare is created behind it. Each spare holds a worker's resources (its GPUs included) while it
    waits. Needs the trainer command to run phalanx-supervise and the torchrun launcher; not with
    gang.scheduler kueue. Spares belong to the PodGroup but not to its minMember."""


DEVICE_CLASS_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUALIFIED_ATTRIBUTE_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9_]+$"
MAX_DEVICE_SELECTORS = 8
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"


def device_selectors(what: str, example: str) -> Any:
    """CEL selectors of a DRA device request (resource.k8s.io/v1 ``selectors[].cel.expression``)."""
    return Field(
        default=None,
        max_length=MAX_DEVICE_SELECTORS,
        json_schema_extra={"items": {"type": "string", "minLength": 1, "maxLength": 1024}},
        description=f"CEL expressions every {what} must satisfy (a DRA request's selectors, all must "
        f"hold), for example {example}; with deviceClassName only.",
    )


class Gpus(ApiModel):
    """Accelerators requested by each worker: a device plugin's extended resource (resource), or
    devices allocated through Dynamic Resource Allocation (deviceClassName, Kubernetes 1.34+)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!(has(self.resource) && has(self.deviceClassName))",
                    field_path=".deviceClassName",
                    message="set resource (a device plugin's extended resource) or deviceClassName "
                    "(DRA devices), not both",
                ),
                cel(
                    "!has(self.deviceClassName) || self.count > 0",
                    field_path=".count",
                    message="deviceClassName needs count > 0 (the devices each worker claims)",
                ),
                cel(
                    "!has(self.selectors) || has(self.deviceClassName)",
                    field_path=".selectors",
                    message="selectors choose DRA devices: set deviceClassName",
                ),
            ]
        }
    )

    count: int = Field(default=0, ge=0, le=64)
    """GPUs per worker; 0 means a CPU job."""

    resource: str | None = Field(default=None, max_length=253, pattern=EXTENDED_RESOURCE_PATTERN)
    """Extended resource name, for example nvidia.com/gpu, amd.com/gpu or a MIG name
    such as nvidia.com/mig-1g.10gb. When neither resource nor deviceClassName is set:
    nvidia.com/gpu."""

    device_class_name: str | None = Field(default=None, max_length=253, pattern=DEVICE_CLASS_PATTERN)
    """A DRA DeviceClass (for example gpu.nvidia.com): each worker then gets a ResourceClaim for
    count devices of this class, made from a ResourceClaimTemplate the job owns (named
    <job>-devices) and referenced by the trainer container. The claim goes with its pod."""

    selectors: list[str] | None = device_selectors(
        "GPU", 'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")'
    )

    def extended_resource(self) -> str | None:
        """The device plugin's resource the workers request (None: none, or DRA devices)."""
        if self.count == 0 or self.device_class_name is not None:
            return None
        return self.resource or DEFAULT_GPU_RESOURCE


class RdmaDevices(ApiModel):
    """The RDMA device a worker needs for InfiniBand, RoCE or EFA: a device plugin's extended
    resource (resource), or a DRA device class (deviceClassName)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.resource) != has(self.deviceClassName)",
                    field_path=".resource",
                    message="set exactly one of resource (a device plugin's extended resource) and "
                    "deviceClassName (a DRA device class)",
                ),
                cel(
                    "!has(self.selectors) || has(self.deviceClassName)",
                    field_path=".selectors",
                    message="selectors choose DRA devices: set deviceClassName",
                ),
                cel(
                    "!has(self.matchAttribute) || has(self.deviceClassName)",
                    field_path=".matchAttribute",
                    message="matchAttribute aligns DRA devices: set deviceClassName",
                ),
            ]
        }
    )

    resource: str | None = Field(default=None, max_length=253, pattern=EXTENDED_RESOURCE_PATTERN)
    """Extended resource published by the cluster's RDMA device plugin, for example
    rdma/rdma_shared_device_a, nvidia.com/mlnxnics or vpc.amazonaws.com/efa."""

    device_class_name: str | None = Field(default=None, max_length=253, pattern=DEVICE_CLASS_PATTERN)
    """A DRA DeviceClass of RDMA NICs: the NICs join the GPUs' requests in the worker's claim."""

    count: int = Field(default=1, ge=1, le=64)
    """Devices per worker."""

    selectors: list[str] | None = device_selectors("NIC", 'device.attributes["dra.net"].rdma == true')

    match_attribute: str | None = Field(default=None, max_length=128, pattern=QUALIFIED_ATTRIBUTE_PATTERN)
    """A device attribute the GPUs and NICs of a worker must share (a DRA constraint), for example
    resource.kubernetes.io/pcieRoot so that each NIC sits on its GPU's PCIe root. With as many
    NICs as GPUs, GPU i and NIC i are paired (one constraint each); otherwise all of the worker's
    GPUs and NICs share the value. Needs gpus.deviceClassName."""


class Network(ApiModel):
    """The communication profile: which transport NCCL must use and what the pod needs for it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.profile != 'infiniband' || has(self.rdma)",
                    field_path=".rdma",
                    message="profile infiniband needs rdma (the RDMA device resource): without it the pod "
                    "has no /dev/infiniband and NCCL_NET=IB fails at start-up",
                ),
                cel(
                    "self.profile != 'efa' || has(self.rdma)",
                    field_path=".rdma",
                    message="profile efa needs rdma (the EFA device resource, usually vpc.amazonaws.com/efa)",
                ),
                cel(
                    "!has(self.hcas) || has(self.rdma)",
                    field_path=".hcas",
                    message="hcas only apply with an RDMA device resource (set rdma)",
                ),
            ]
        }
    )

    profile: NetworkProfile = "auto"
    """auto: InfiniBand/RoCE when rdma is set and GPUs are requested, TCP sockets for other GPU jobs,
    and no NCCL at all on CPU. tcp forces NCCL over sockets. infiniband forces NCCL over IB verbs and
    fails loudly instead of falling back to TCP. efa uses AWS EFA through libfabric."""

    socket_interface: str = Field(default="eth0", min_length=1, max_length=15, pattern=r"^[a-zA-Z0-9_.:-]+$")
    """Interface for bootstrap and socket traffic (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), matched
    exactly, never as a prefix."""

    hcas: list[str] | None = Field(default=None, max_length=32)
    """RDMA adapters NCCL may use (NCCL_IB_HCA), written as exact names such as mlx5_0;
    the operator adds the '=' prefix so mlx5_1 never also matches mlx5_10."""

    rdma: RdmaDevices | None = None
    """The RDMA device resource each worker requests."""

    multus_networks: list[str] | None = Field(default=None, max_length=16)
    """Multus NetworkAttachmentDefinitions (namespace/name) attached to each worker as secondary networks."""

    shm_size: str | None = Field(default=None, pattern=QUANTITY_PATTERN)
    """Size of the memory-backed /dev/shm. GPU jobs always get a memory-backed /dev/shm (the
    container default of 64Mi breaks NCCL); this caps it."""

    env: dict[str, str] | None = Field(
        default=None,
        max_length=64,
        json_schema_extra={"x-kubernetes-validations": [cel(ENV_NAME_RULE, "keys must be environment variable names")]},
    )
    """Extra variables for the communication stack (NCCL_DEBUG=INFO, NCCL_IB_TC, ...). They are
    added last: the user always wins over the profile."""


class Rendezvous(ApiModel):
    """torchrun's c10d rendezvous. The store is hosted by a small dedicated pod, so losing any worker
    never loses the rendezvous."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.lastCallTimeoutSeconds <= self.joinTimeoutSeconds",
                    field_path=".lastCallTimeoutSeconds",
                    message="lastCallTimeoutSeconds must not exceed joinTimeoutSeconds",
                ),
            ]
        }
    )

    port: int = Field(default=29400, ge=1024, le=65535)
    """TCP port of the rendezvous store."""

    join_timeout_seconds: int = Field(default=1800, ge=10, le=86400)
    """How long agents wait for min workers to join (torchrun's default of 600 s is too short for
    autoscaled GPU nodes and large images)."""

    last_call_timeout_seconds: int = Field(default=30, ge=1, le=3600)
    """After min workers joined, how long the round waits for more before it starts
    (torchrun refuses 0)."""

    keep_alive_seconds: int = Field(default=5, ge=1, le=60)
    """How often each agent tells the rendezvous it is alive (torchrun's keep_alive_interval). A
    worker that left without a word (its pod deleted, its node lost) holds up the survivors' next
    round until it missed three: 15 s at the default. Lower re-forms the world sooner after a loss;
    each keep-alive rewrites the rendezvous state in the store, so keep it higher for hundreds of
    workers."""


class Checkpoint(ApiModel):
    """Where workers save and resume checkpoints. The volume is mounted at the same path in every worker."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.claimName) != has(self.volumeName)", message="set exactly one of claimName and volumeName"
                ),
            ]
        }
    )

    claim_name: str | None = Field(default=None, max_length=253)
    """A PersistentVolumeClaim (ReadWriteMany for multi-node jobs) to mount."""

    volume_name: str | None = Field(default=None, max_length=63)
    """The name of a volume of template.spec.volumes to mount instead of a claim."""

    mount_path: str = Field(default="/checkpoints", pattern=r"^/.*")
    """Where the checkpoint volume is mounted; workers get it as PHALANX_CHECKPOINT_DIR."""

    keep: int = Field(default=3, ge=1, le=1000)
    """How many complete checkpoints workers keep (PHALANX_CHECKPOINT_KEEP)."""


class FailurePolicy(ApiModel):
    """How failures are retried. The restart count lives in status, so it survives operator restarts
    and the deletion of pods."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.backoffSeconds <= self.maxBackoffSeconds",
                    field_path=".backoffSeconds",
                    message="backoffSeconds must not exceed maxBackoffSeconds",
                ),
            ]
        }
    )

    max_restarts: int = Field(default=3, ge=0, le=1000)
    """Counted failures allowed before the job fails. One failure event is what one reconcile pass
    finds failed: however many workers failed together (an OOM at the same step, an NCCL error
    cascading through the ranks), and whether the survivors train on or the gang restarts, it
    counts once. Application errors, OOM kills and hangs (progressDeadlineSeconds) count;
    evictions, preemptions, lost nodes and a lost rendezvous store do not."""

    backoff_seconds: int = Field(default=10, ge=0, le=3600)
    """Wait before the first gang restart; it doubles with every counted restart."""

    max_backoff_seconds: int = Field(default=600, ge=0, le=86400)
    """Upper bound of the growing backoff."""

    worker_restarts: int = Field(default=3, ge=0, le=100)
    """torchrun's own in-place budget (--max-restarts): how often an agent restarts its local
    processes, for example when the world re-forms after a peer was lost. Launcher torchrun only:
    a static world never re-forms, so its workers get 0."""

    avoid_node_seconds: int = Field(default=3600, ge=0, le=604800)
    """How long the job's later pods keep off a node that failed one of its workers for a cause
    of the node's own: lost or not Ready past the operator's grace, an eviction for node pressure,
    a pod the node refused (a device plugin that lost its GPUs), or a GPU or NCCL transport error
    in the worker's termination message (the patterns are in docs/lifecycle.md). 0: never avoid.
    phalanx never cordons or taints a node: only this job's pods keep off it."""

    progress_deadline_seconds: int | None = Field(default=None, ge=30, le=604800)
    """Hang detection, off when absent: when a Running job's workers report no new training step
    for this long, the gang restarts from its latest checkpoint with reason NoProgress, counted
    against maxRestarts. Steps come from the phalanx.worker metrics the operator scrapes (every
    15 s), so a job whose workers do not serve them is never judged. Set it above the time from
    the workers' start to their first step and above the longest step and checkpoint save."""


class Gang(ApiModel):
    """Gang scheduling: all min workers are placed together or not at all."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.queue) || self.scheduler in ['volcano', 'kueue']",
                    field_path=".queue",
                    message="queue needs scheduler volcano or kueue",
                ),
                cel(
                    "self.scheduler != 'kueue' || has(self.queue)",
                    field_path=".queue",
                    message="scheduler kueue needs queue (the LocalQueue name)",
                ),
                cel(
                    "!has(self.schedulerName) || self.scheduler in ['scheduler-plugins', 'volcano']",
                    field_path=".schedulerName",
                    message="schedulerName applies to scheduler-plugins and volcano only",
                ),
                cel(
                    "!has(self.scheduleTimeoutSeconds) || self.scheduler == 'scheduler-plugins'",
                    field_path=".scheduleTimeoutSeconds",
                    message="scheduleTimeoutSeconds applies to scheduler-plugins only",
                ),
            ]
        }
    )

    scheduler: GangScheduler = Field(
        default="none", json_schema_extra={"x-kubernetes-validations": [immutable("gang.scheduler")]}
    )
    """none, scheduler-plugins (coscheduling PodGroup), volcano (Volcano PodGroup) or kueue (plain pod group)."""

    scheduler_name: str | None = Field(default=None, max_length=253)
    """The pods' schedulerName; defaults to scheduler-plugins-scheduler or volcano."""

    queue: str | None = Field(
        default=None, max_length=253, json_schema_extra={"x-kubernetes-validations": [immutable("gang.queue")]}
    )
    """Volcano queue or Kueue LocalQueue."""

    schedule_timeout_seconds: int | None = Field(default=None, ge=1, le=86400)
    """How long scheduler-plugins holds a partially placed gang before releasing it."""


LABEL_KEY_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
TopologyMode = Literal["required", "preferred"]


class Topology(ApiModel):
    """Which interconnect domain the workers share: a node label whose value names the domain (a
    rack, a block, an NVLink domain such as nvidia.com/gpu.clique)."""

    key: str = Field(max_length=316, pattern=LABEL_KEY_PATTERN)
    """The node label that names each node's domain, for example topology.kubernetes.io/rack or
    nvidia.com/gpu.clique. Nodes without it are in no domain."""

    mode: TopologyMode = "required"
    """required: every worker of an attempt runs in one domain, and elastic growth stays there; a
    gang that no domain can hold is Stalled. preferred: workers pack into as few domains as fit.
    How each gang scheduler does it is in docs/placement.md."""


class Placement(ApiModel):
    """Where the workers run, beyond the pod template's own nodeSelector and affinity."""

    topology: Topology | None = None
    """Keep the workers in one interconnect domain (required) or as few as fit (preferred)."""


# --- replica groups (issue 34) ---------------------------------------------------------------


class ReplicaGroups(ApiModel):
    """Data-parallel replica groups that fail alone: the world is split into groups of size
    workers; each group is one torchrun world of its own, placed as a unit, and a failure restarts
    only its group while the others train on (docs/replica-groups.md)."""

    size: int = Field(ge=1, le=MAX_WORKERS)
    """Workers per group. workers.desired, workers.min and workers.max must be multiples of it."""

    min: int = Field(default=1, ge=1, le=MAX_WORKERS)
    """Fewest groups the job trains with: when a failure would leave fewer groups training, the
    whole gang restarts from the latest checkpoint (counted as one failure against
    failurePolicy.maxRestarts) instead of the failed groups alone."""

    topology: str | None = Field(default=None, max_length=316, pattern=LABEL_KEY_PATTERN)
    """A node label (as spec.placement.topology.key) whose value names a domain: each group's
    workers all run in one domain; different groups may share one or not."""


class TemplateMetadata(BaseModel):
    """Labels and annotations copied onto every worker pod (never the TrainingJob's own labels)."""

    model_config = ConfigDict(extra="allow", frozen=True, use_attribute_docstrings=True)

    labels: dict[str, str] | None = None
    """Labels for the worker pods."""

    annotations: dict[str, str] | None = None
    """Annotations for the worker pods."""


class Container(BaseModel):
    """A container of the worker pod; fields not listed are passed through to the pod unchanged."""

    model_config = ConfigDict(extra="allow", frozen=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1, max_length=63)
    """Container name; the one named trainer (else the first) runs torchrun."""

    image: str = Field(min_length=1)
    """Container image."""

    # Declared with their types (the API server refuses a command that is no list of strings at
    # admission): the command decides whether the job is supervised (in-place restarts, spares).
    command: list[str] | None = None
    """The container's entrypoint; the trainer's runs torchrun, or phalanx-supervise before it."""

    args: list[str] | None = None
    """Arguments to the entrypoint."""


class PodSpecTemplate(BaseModel):
    """An ordinary pod spec. The operator adds what distributed training needs and keeps the rest."""

    model_config = ConfigDict(extra="allow", frozen=True, use_attribute_docstrings=True)

    containers: list[Container] = Field(min_length=1, max_length=32)
    """Containers of each worker pod."""


class PodTemplate(BaseModel):
    """The worker pod template: an ordinary PodTemplateSpec."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    metadata: TemplateMetadata | None = None
    """Labels and annotations for the worker pods."""

    spec: PodSpecTemplate
    """The worker pod spec (image, command, args, env, resources, volumes, nodeSelector, tolerations,
    affinity, serviceAccountName, priorityClassName, ...)."""


class TrainingJobSpec(ApiModel):
    """The desired state of a distributed training job."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!(self.backend == 'gloo' && self.gpus.count > 0)",
                    field_path=".backend",
                    message="backend gloo cannot be used with GPUs (gpus.count > 0): use nccl or auto",
                ),
                cel(
                    "!(self.backend == 'nccl' && self.gpus.count == 0)",
                    field_path=".backend",
                    message="backend nccl needs GPUs: set gpus.count > 0, or use gloo or auto",
                ),
                cel(
                    "!(self.network.profile in ['tcp', 'infiniband', 'efa'] && self.gpus.count == 0)",
                    field_path=".network.profile",
                    message="network profiles tcp, infiniband and efa configure NCCL, which needs GPUs: "
                    "use auto for CPU jobs",
                ),
                cel(
                    "!has(self.network.rdma) || self.gpus.count > 0",
                    field_path=".network.rdma",
                    message="network.rdma needs GPUs (gpus.count > 0)",
                ),
                cel(
                    "!has(self.network.rdma) || !has(self.network.rdma.matchAttribute) || "
                    "has(self.gpus.deviceClassName)",
                    field_path=".network.rdma.matchAttribute",
                    message="network.rdma.matchAttribute aligns the NICs with the GPUs in one claim: "
                    "it needs gpus.deviceClassName (DRA GPUs)",
                ),
                cel(
                    "!has(self.procsPerWorker) || self.gpus.count == 0 || self.procsPerWorker <= self.gpus.count",
                    field_path=".procsPerWorker",
                    message="procsPerWorker must not exceed gpus.count: NCCL needs one GPU per process",
                ),
                cel(
                    "has(self.procsPerWorker) == has(oldSelf.procsPerWorker) && "
                    "(!has(self.procsPerWorker) || self.procsPerWorker == oldSelf.procsPerWorker)",
                    field_path=".procsPerWorker",
                    message="is immutable: changing procsPerWorker mid-run would split the gang",
                ),
                cel(
                    "self.launcher != 'static' || self.workers.min == self.workers.max",
                    field_path=".workers",
                    message="launcher static runs a fixed world: workers.min must equal workers.max "
                    "(use launcher torchrun for an elastic range)",
                ),
                cel(
                    "has(self.placement) == has(oldSelf.placement) && "
                    "(!has(self.placement) || self.placement == oldSelf.placement)",
                    field_path=".placement",
                    message="is immutable: the gang's workers are placed as one; delete and recreate the TrainingJob "
                    "to place it otherwise",
                ),
                # replica groups (issue 34)
                cel(
                    "!has(self.replicaGroups) || self.replicaGroups.size < 1 || "
                    "(self.workers.desired % self.replicaGroups.size == 0 && "
                    "self.workers.min % self.replicaGroups.size == 0 && "
                    "self.workers.max % self.replicaGroups.size == 0)",
                    field_path=".replicaGroups.size",
                    message="workers.desired, workers.min and workers.max must be multiples of replicaGroups.size",
                ),
                cel(
                    "!has(self.replicaGroups) || "
                    "self.replicaGroups.min * self.replicaGroups.size <= self.workers.desired",
                    field_path=".replicaGroups.min",
                    message="replicaGroups.min must not exceed the groups (workers.desired / replicaGroups.size)",
                ),
                cel(
                    "!has(self.replicaGroups) || self.launcher == 'torchrun'",
                    field_path=".replicaGroups",
                    message="replicaGroups needs launcher torchrun: each group is a torchrun world of its own",
                ),
                cel(
                    "!has(self.replicaGroups) || self.gang.scheduler != 'kueue'",
                    field_path=".replicaGroups",
                    message="replicaGroups is not available with gang.scheduler kueue: a Kueue pod group "
                    "restarts whole on any loss",
                ),
                cel(
                    "!has(self.replicaGroups) || !has(self.replicaGroups.topology) || self.workers.spares == 0",
                    field_path=".replicaGroups.topology",
                    message="does not take workers.spares yet: a spare waits outside the domain of the group it joins",
                ),
                cel(
                    "has(self.replicaGroups) == has(oldSelf.replicaGroups) && "
                    "(!has(self.replicaGroups) || self.replicaGroups == oldSelf.replicaGroups)",
                    field_path=".replicaGroups",
                    message="is immutable: the groups' worlds are formed from it; delete and recreate the TrainingJob",
                ),
                cel(
                    "has(self.checkpoint) == has(oldSelf.checkpoint) && "
                    "(!has(self.checkpoint) || self.checkpoint == oldSelf.checkpoint)",
                    field_path=".checkpoint",
                    message="is immutable: workers resume from this location",
                ),
            ]
        }
    )

    workers: Workers
    """Worker counts: min, max and desired."""

    launcher: Launcher = Field(
        default="torchrun", json_schema_extra={"x-kubernetes-validations": [immutable("launcher")]}
    )
    """How the container starts training. torchrun: the command runs torchrun's elastic agent
    (torchrun or python -m torch.distributed.run), configured through PET_* for the c10d
    rendezvous on the job's store; the world may change size within [min, max]. static:
    Kubeflow's PyTorchJob contract for a fixed world, for `python train.py` with
    init_process_group (env://) and for non-elastic torchrun: every worker gets MASTER_ADDR
    (worker 0's stable DNS name), MASTER_PORT (rendezvous.port), WORLD_SIZE (workers x
    procsPerWorker) and RANK (its index), plus the PET_* of a static torchrun; it needs
    workers.min == workers.max, and losing any worker restarts the gang."""

    procs_per_worker: int | None = Field(default=None, ge=1, le=256)
    """Processes per worker (torchrun --nproc-per-node). When absent: the GPUs per worker, or 1 on CPU."""

    gpus: Gpus = Field(default_factory=Gpus, json_schema_extra={"x-kubernetes-validations": [immutable("gpus")]})
    """GPUs per worker and their resource name."""

    backend: Backend = Field(default="auto", json_schema_extra={"x-kubernetes-validations": [immutable("backend")]})
    """Collective backend: auto chooses nccl when GPUs are requested and gloo otherwise."""

    network: Network = Field(
        default_factory=Network, json_schema_extra={"x-kubernetes-validations": [immutable("network")]}
    )
    """Communication profile and overrides."""

    rendezvous: Rendezvous = Field(
        default_factory=Rendezvous, json_schema_extra={"x-kubernetes-validations": [immutable("rendezvous")]}
    )
    """torchrun c10d rendezvous settings."""

    checkpoint: Checkpoint | None = None
    """Checkpoint storage shared by all workers."""

    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)
    """Restart budget and backoff."""

    gang: Gang = Field(default_factory=Gang)
    """Gang scheduling."""

    placement: Placement | None = None
    """Topology-aware placement of the workers (immutable: a gang is placed as one)."""

    replica_groups: ReplicaGroups | None = None
    """Split the workers into data-parallel replica groups that fail and restart alone
    (immutable; needs launcher torchrun)."""

    suspend: bool = False
    """Suspended jobs keep their status and restart budget but run no pods."""

    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the finished job (and its pods) this long after it succeeded or failed."""

    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the job when it has been training longer than this, counted from status.startTime: when
    it first trained, and again when it trains after a suspension (spec.suspend) or after Kueue
    evicted its gang (Kueue took the quota back and queued it again), as batch/v1 restarts the clock
    when a suspended Job resumes. Time suspended or queued never counts; gang restarts for failures
    do not restart the clock."""

    template: PodTemplate = Field(json_schema_extra={"x-kubernetes-validations": [immutable("the pod template")]})
    """The worker pod template. Immutable, the fields the schema passes through included (whether
    the trainer runs phalanx-supervise decides in-place restarts and spares)."""


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """A metav1.Condition."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(max_length=316)
    """Condition type: Ready, Reconciling, Stalled, Running, Succeeded, Failed or Suspended."""

    status: ConditionStatus
    """True, False or Unknown."""

    reason: str = Field(max_length=1024)
    """CamelCase reason for the last transition."""

    message: str = Field(default="", max_length=32768)
    """Human-readable details."""

    observed_generation: int | None = None
    """The metadata.generation this condition was computed from."""

    last_transition_time: str
    """When status last changed."""


class WorkerCounts(ApiModel):
    """Worker counts as observed."""

    model_config = ConfigDict(extra="ignore")

    desired: int = 0
    """Workers the operator aims for (spec.workers.desired)."""

    active: int = 0
    """Worker pods of the current attempt that exist and have not finished."""

    ready: int = 0
    """Active worker pods that are ready."""

    spares: int | None = None
    """Spare pods ready to take a lost worker's slot (spec.workers.spares); absent without spares."""

    world_size: int | None = None
    """Ranks (processes) in the world the workers train in now, as a worker reports it on its
    metrics endpoint; absent while the job does not train or when no worker could be scraped."""


class LastCheckpoint(ApiModel):
    """The newest checkpoint the workers committed, as a worker reports it."""

    model_config = ConfigDict(extra="ignore")

    step: int
    """Training step the checkpoint holds; a gang restart resumes from it."""

    time: str
    """When it was committed."""


class ProgressMetric(ApiModel):
    """A named training metric rank 0 reported (``phalanx.worker.report(metrics=...)``)."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=63)
    """The metric's name as the training gave it (letters, digits, ``_./-``)."""

    value: float
    """Its latest value."""

    step: int
    """The training step it was taken at."""
    time: str
    """When it was taken (rank 0's clock)."""


class ProgressSample(ApiModel):
    """A step count as the operator saw it, for the rate behind ``etaSeconds``."""

    model_config = ConfigDict(extra="ignore")

    step: int
    """The step rank 0 had reported."""

    time: str
    """When the operator wrote it (its clock)."""


class TrainingProgress(ApiModel):
    """Training progress as rank 0 reports it (``phalanx.worker.report``), kept after the job ends."""

    model_config = ConfigDict(extra="ignore")

    attempt: int = 0
    """The gang attempt that reported it (an earlier one's report stands until the new one reports)."""

    step: int
    """The training step rank 0 last reported."""

    total_steps: int | None = None
    """The steps the training will take, when rank 0 says."""

    percent: int | None = Field(default=None, ge=0, le=100)
    """step / totalSteps in whole percent (100 once the job succeeded); absent without totalSteps."""

    eta_seconds: int | None = None
    """Seconds left at the rate of steps over the last few reports the operator saw; absent when
    unknown: without totalSteps or two reports, right after a restart from a checkpoint (the step
    went back), when the step has not moved for a while, and once the job does not train."""

    time: str
    """When rank 0 made the report (its clock)."""

    summary: str | None = None
    """The percent and ETA (or the step), for kubectl get."""

    metrics: list[ProgressMetric] | None = Field(
        default=None,
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """At most 8 named metrics (loss, ...) with the step and time each was taken at."""

    samples: list[ProgressSample] | None = Field(default=None, max_length=8)
    """The operator's window of (step, time) behind etaSeconds, one per write of this field (at
    most one per 10 s), kept here so an operator restart keeps the rate."""


JobState = Literal["queued", "starting", "training", "recovering", "suspended"]


class TimeByState(ApiModel):
    """Where the job's wall time went, in seconds, up to ``since`` (the current state's time is
    not in the counts until it ends; ``phalanx describe`` and the metrics add it)."""

    model_config = ConfigDict(extra="ignore")

    queued: int = 0
    """Waiting for admission (Kueue) or for nodes (Pending), outside a recovery."""

    starting: int = 0
    """Pods scheduled, containers and the world starting (Starting), outside a recovery."""

    training: int = 0
    """Running or Rescaling."""

    recovering: int = 0
    """From a gang restart until it trains again: backoff, old pods stopping, new pods queued and
    starting (a worker replaced while the others train on is training, not recovering)."""

    recovering_by_cause: dict[str, int] | None = None
    """``recovering`` by the reason of the gang restart that began it (WorkerFailed, NodeLost, ...)."""

    suspended: int = 0
    """spec.suspend was true."""

    state: JobState | None = None
    """The current state (none once the job ended)."""

    cause: str | None = None
    """While recovering: the reason of the gang restart that began it."""

    since: str | None = None
    """When the current state began."""


class RecomputedSteps(ApiModel):
    """Training steps computed twice: at each worker replacement or gang restart, the steps from
    the one its processes resumed at to the one the job had reached."""

    model_config = ConfigDict(extra="ignore")

    total: int = 0
    """Steps computed again after restarts, in all."""

    reached: int | None = None
    """While a restart's processes have not resumed yet: the step the job had reached (the reporting
    worker's, as of the operator's last scrape)."""

    failed_at: str | None = None
    """While ``reached`` is set: when the restart was decided (a run that began later is the new one)."""


class AvoidedNode(ApiModel):
    """A node the job's new pods keep off (failurePolicy.avoidNodeSeconds)."""

    model_config = ConfigDict(extra="ignore")

    node: str
    """The node's name."""

    reason: str
    """Why: NodeLost, NodePressure, NodeRejected, GPUError or NCCLError."""

    message: str = ""
    """The failure that put it here."""

    until: str
    """When new pods may go there again."""


class SlotClaim(ApiModel):
    """A worker slot of the current attempt that a promoted spare holds: recorded in the status
    write that must pass its resourceVersion precondition before the patch that promotes the spare."""

    model_config = ConfigDict(extra="ignore")

    index: int = Field(ge=0, le=MAX_WORKERS - 1)
    """The slot (``phalanx.dev/worker-index``)."""

    pod: str = Field(max_length=253)
    """The spare's name."""

    uid: str = Field(max_length=64)
    """The spare's UID: the claim is that pod's, not its name's."""

    attempt: int = Field(ge=0)
    """The gang attempt the slot is of; a claim of another attempt holds nothing."""


class ReplicaGroupStatus(ApiModel):
    """One replica group (spec.replicaGroups): its generation, readiness and restarts."""

    model_config = ConfigDict(extra="ignore")

    index: int = Field(ge=0, le=MAX_WORKERS - 1)
    """The group (PHALANX_REPLICA_GROUP): workers index*size .. index*size+size-1."""

    generation: int = Field(default=0, ge=0)
    """How often the group was restarted alone in this attempt; its pods carry it, and its torchrun
    world (rendezvous id) is the group's at this generation."""

    ready: bool = False
    """Whether all the group's workers of this generation run."""

    restarts: int = Field(default=0, ge=0)
    """Restarts of this group alone, whatever their cause; those whose failure counts are counted
    once each in status.restarts, against failurePolicy.maxRestarts."""

    domain: str | None = Field(default=None, max_length=63)
    """The topology domain (spec.replicaGroups.topology) the group's workers of this generation run
    in; absent until one of them is bound to a node."""


class PlacementStatus(ApiModel):
    """The domain the operator placed the workers in (spec.placement.topology, where the operator
    chooses it: gang.scheduler none or scheduler-plugins)."""

    model_config = ConfigDict(extra="ignore")

    key: str
    """The node label of the domains (spec.placement.topology.key)."""

    domain: str | None = None
    """The label's value the workers are kept in (mode required) or packed towards (preferred)."""


class PreemptionCost(ApiModel):
    """What an eviction of the job now would lose (issue 34: checkpoint-aware preemption).

    ``gpuSeconds`` = (``lostSeconds`` + ``restartSeconds``) x ``gpus``; a job without GPUs is
    weighed by its workers instead (``workerSeconds``), so CPU jobs still order among themselves."""

    model_config = ConfigDict(extra="ignore")

    lost_seconds: int = 0
    """Training since the newest checkpoint (or since the job last began training, when that is
    later or there is none): the work an eviction now would throw away."""

    restart_seconds: int = 0
    """How long the job last took to train again: from the start of the stretch that led into its
    current training (the first start, or the whole recovery of a restart) to Running."""

    gpus: int = 0
    """GPUs of the current world (spec.gpus.count x active workers)."""

    workers: int = 0
    """Active workers of the current attempt."""

    gpu_seconds: int = 0
    """(lostSeconds + restartSeconds) x gpus."""

    worker_seconds: int = 0
    """(lostSeconds + restartSeconds) x workers: the weight of a job without GPUs."""

    time: str | None = None
    """When the operator computed it (written at most once per 10 s)."""

    boost: int | None = None
    """The priority boost the operator last set on the job's Kueue Workload
    (annotation kueue.x-k8s.io/priority-boost): 0..4, higher for a costlier eviction."""

    boost_time: str | None = None
    """When the boost last changed: it changes at most once per 60 s."""


class SaveNow(ApiModel):
    """The newest save-now request (the job's ``phalanx.dev/save-now`` annotation) and the
    checkpoint that answered it. Wait for one with
    ``kubectl wait --for=jsonpath='{.status.saveNow.savedToken}'=<token>``."""

    model_config = ConfigDict(extra="ignore")

    token: str | None = None
    """The token the operator took from the annotation and carries to the running workers."""

    requested_at: str | None = None
    """When the operator took the token."""

    after_step: int | None = None
    """The step of the newest checkpoint when the token was taken: the answer is a later one."""

    saved_token: str | None = None
    """The newest token answered: a checkpoint committed after its request (``savedAt``, ``step``)."""

    saved_at: str | None = None
    """When that checkpoint was committed, as the worker reports it (status.lastCheckpoint)."""

    step: int | None = None
    """That checkpoint's step."""

    message: str | None = None
    """Why the annotation's current value was ignored (it is not a token); absent otherwise."""


class NoticeSavings(ApiModel):
    """Work that saving on a notice kept: at each stop by a notice (a drain's or the Eviction
    API's eviction, a preemption, Kueue's eviction) whose ranks saved before they stopped (the new
    run resumed past the checkpoint there was at the notice), what an eviction without that save
    would have lost: the training since the last checkpoint (``preemptionCost.lostSeconds`` at the
    notice), times the world's GPUs. Counted once per stop."""

    model_config = ConfigDict(extra="ignore")

    stops: int = 0
    """Stops by a notice whose ranks saved first."""

    gpu_seconds: int = 0
    """GPU-seconds those saves kept, in all."""

    worker_seconds: int = 0
    """Worker-seconds those saves kept, in all (the measure of a job without GPUs)."""

    pending_gpu_seconds: int | None = None
    """While a stop by a notice waits for its new run: what its save would keep (GPU-seconds)."""

    pending_worker_seconds: int | None = None
    """The same in worker-seconds."""

    pending_after_step: int | None = None
    """The step of the newest checkpoint at that notice (0: none): a new run that resumes past it
    shows the ranks saved."""


class TrainingJobStatus(ApiModel):
    """The observed state of a TrainingJob, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    """The metadata.generation the operator last acted on."""

    phase: Phase | None = None
    """Pending, Starting, Running, Rescaling, Restarting, Succeeded, Failed or Suspended (a summary of conditions)."""

    reason: str | None = None
    """CamelCase reason for the current phase."""

    message: str | None = None
    """Human-readable detail for the current phase."""

    attempt: int = 0
    """Gang attempts so far; part of the rendezvous id, so a new attempt never joins an old rendezvous."""

    restart_mode: Literal["InPlace", "Recreate"] | None = None
    """How a gang restart happens: InPlace when the trainer's command runs phalanx-supervise (healthy
    worker pods are kept and their processes restarted with the new attempt; only lost or failed
    pods are replaced; not under Kueue, whose pod groups are per attempt), else Recreate (every
    worker pod is replaced)."""

    restarts: int = 0
    """Counted gang restarts, compared with failurePolicy.maxRestarts."""

    restarts_by_reason: dict[str, int] | None = None
    """All gang restarts (counted or not) by reason."""

    counted_failures: list[str] | None = Field(default=None, json_schema_extra={"x-kubernetes-list-type": "set"})
    """UIDs of failed pods already recorded in restarts and restartsByReason, kept while those pods
    exist: written in the same update as the counters, so each failure is counted exactly once even
    when the operator stops between recording a failure and deleting the pod."""

    removed_workers: list[str] | None = Field(default=None, json_schema_extra={"x-kubernetes-list-type": "set"})
    """UIDs of worker pods of the current attempt the operator deleted itself (a scale-down's
    surplus, a moved gang's unplaced pods), kept while those pods exist: written before the
    deletions, so a pod stopping for them is never taken for one deleted from outside, whatever
    happens to the operator (a restart, a new leader) in between."""

    workers: WorkerCounts | None = None
    """Worker counts."""

    last_checkpoint: LastCheckpoint | None = None
    """The newest committed checkpoint (kept across gang restarts and after the job ends)."""

    progress: TrainingProgress | None = None
    """Training progress as rank 0 reports it: step, percent, ETA and a few metrics (written at
    most once per 10 s; kept after the job ends)."""

    replicas: int = 0
    """Active workers, for the scale subresource."""

    selector: str | None = None
    """Label selector of the worker pods, for the scale subresource and autoscalers."""

    worker_summary: str | None = None
    """ready/desired, for kubectl get."""

    start_time: str | None = None
    """When the first worker of the job started."""

    completion_time: str | None = None
    """When the job succeeded or failed."""

    training_seconds: int = 0
    """Seconds the job spent training (Running or Rescaling) before its current phase began;
    with the Running condition's lastTransitionTime it gives goodput."""

    restart_not_before: str | None = None
    """The next gang attempt is not started before this time (backoff)."""

    recomputed_steps: RecomputedSteps | None = None
    """Steps computed again after restarts (workers using phalanx.worker report their steps)."""

    time_by_state: TimeByState | None = None
    """Where the job's time went: queued, starting, training, recovering (by cause), suspended."""

    preemption_cost: PreemptionCost | None = None
    """What an eviction now would lose, in GPU-seconds (training since the last checkpoint plus
    the measured restart time, times GPUs); present while the job trains, written at most every
    10 s. Under Kueue it sets the Workload's priority boost, so the cheapest job is preempted first."""

    save_now: SaveNow | None = None
    """The job's newest save-now request (annotation phalanx.dev/save-now) and the checkpoint that
    answered it; a token already taken is never taken again."""

    notice_savings: NoticeSavings | None = None
    """Work kept by saving on a notice (an eviction, a drain, a preemption) before the workers
    stopped, in GPU-seconds; part of the goodput figures (phalanx_job_notice_saved_gpu_seconds_total)."""

    placement: PlacementStatus | None = None
    """Where the workers are placed (spec.placement.topology)."""

    avoided_nodes: list[AvoidedNode] | None = Field(
        default=None, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["node"]}
    )
    """Nodes the job's new pods keep off after a failure of the node's own, until the time given."""

    replica_groups: list[ReplicaGroupStatus] | None = Field(
        default=None,
        max_length=MAX_WORKERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["index"]},
    )
    """Each replica group's generation, readiness and restarts (spec.replicaGroups)."""

    slot_claims: list[SlotClaim] | None = Field(
        default=None,
        max_length=MAX_WORKERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["index"]},
    )
    """Worker slots of the current attempt that promoted spares hold, one claim per slot, kept while
    the spare is there: a promotion is written here, conditional on the job's resourceVersion,
    before the spare is patched, so two passes (two operator replicas, a stale view) never promote
    two spares into one slot."""

    conditions: list[Condition] | None = Field(
        default=None, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
    )
    """Ready, Reconciling and Stalled (kstatus), plus Running, Succeeded, Failed and Suspended."""


GITOPS_ANNOTATIONS = ("argocd.argoproj.io/tracking-id",)
GITOPS_LABELS = ("argocd.argoproj.io/instance", "kustomize.toolkit.fluxcd.io/name", "helm.toolkit.fluxcd.io/name")
"""The metadata keys by which ``ObjectMeta.gitops_tool`` knows a job that Argo CD or Flux applies."""


class ObjectMeta(BaseModel):
    """The part of metadata the operator reads."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, alias_generator=to_camel)

    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None

    def gitops_tool(self) -> str | None:
        """Argo CD or Flux when the object carries that tool's tracking metadata."""
        labels, annotations = self.labels or {}, self.annotations or {}
        if GITOPS_ANNOTATIONS[0] in annotations or GITOPS_LABELS[0] in labels:
            return "Argo CD"
        if any(key in labels for key in GITOPS_LABELS[1:]):
            return "Flux"
        return None


class TrainingJob(BaseModel):
    """A TrainingJob as read from the API server (defaults already applied by the schema)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, alias_generator=to_camel)

    api_version: str = API_VERSION
    kind: str = KIND
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: TrainingJobStatus = Field(default_factory=TrainingJobStatus)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> TrainingJob:
        """Parse a TrainingJob as the API server returns it."""
        return cls.model_validate(body)
