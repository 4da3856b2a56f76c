"""A job's worker pods and warm spares: the user's template plus what elastic training needs."""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import capacity, naming
from phalanx.reconcile.desired.devices import device_claim_template
from phalanx.reconcile.desired.objects import Object, child_metadata, template_spec, with_spec_hash
from phalanx.reconcile.environment import (
    CHECKPOINT_VOLUME,
    SHM_VOLUME,
    WORKER_METRICS_PORT,
    Launch,
    merge_env,
    transport_profile,
    worker_environment,
)
from phalanx.reconcile.errors import PlanningError

JOB_UID_ENV = "PHALANX_JOB_UID"
"""The job's UID in the workers' and the store's environment: a completion record names it."""


def ranks_follow_placement(job: api.TrainingJob, launch: Launch) -> bool:
    """Whether the workers' torchrun agents get rank addresses that sort by topology domain: a job
    placed by topology whose command runs phalanx-supervise (which gives torchrun the address)."""
    placement = job.spec.placement
    return (
        placement is not None
        and placement.topology is not None
        and launch.supervised
        and (launch.launcher == "torchrun")
    )


def pod_info_volume(*, groups: bool = False) -> dict[str, Any]:
    """What phalanx-supervise reads: the pod's attempt, rendezvous id, role and slot, which the
    kubelet rewrites when the operator changes them (a pod kept through a gang restart, a spare
    promoted into a slot), and with replica groups the group generation a spare is promoted into.
    File names: ``phalanx.worker.protocol``."""
    fields = {
        "attempt": f"metadata.labels['{naming.ATTEMPT_LABEL}']",
        "rendezvous-id": f"metadata.annotations['{naming.RENDEZVOUS_ID_ANNOTATION}']",
        "role": f"metadata.labels['{naming.ROLE_LABEL}']",
        "worker-index": f"metadata.labels['{naming.WORKER_INDEX_LABEL}']",
        "rank-address": f"metadata.annotations['{naming.RANK_ADDRESS_ANNOTATION}']",
    }
    if groups:
        fields["group-generation"] = f"metadata.labels['{naming.GROUP_GENERATION_LABEL}']"
    return {
        "name": naming.POD_INFO_VOLUME,
        "downwardAPI": {"items": [{"path": path, "fieldRef": {"fieldPath": ref}} for path, ref in fields.items()]},
    }


SAVE_NOW_FILE = "save-now"
"""In ``naming.NOTICES_DIR``: the pod's ``phalanx.dev/save-now`` annotation (``reconcile.save_now``)."""


def notices_volume() -> dict[str, Any]:
    """What the workers of a job with spec.checkpoint read without a restart: the save-now token
    the operator carries onto the pod, which the kubelet rewrites when the annotation changes (an
    empty file while there is none). Only such jobs get it: only they have somewhere to save, and
    every other job's pods stay as they were. ``phalanx.worker.protocol.SAVE_NOW_FILE_ENV`` names
    the file."""
    ref = f"metadata.annotations['{naming.SAVE_NOW_ANNOTATION}']"
    return {
        "name": naming.NOTICES_VOLUME,
        "downwardAPI": {"items": [{"path": SAVE_NOW_FILE, "fieldRef": {"fieldPath": ref}}]},
    }


def keep_off(pod_spec: dict[str, Any], nodes: Sequence[str]) -> None:
    """Require the pod to stay off ``nodes`` (by node name, ``matchFields`` on ``metadata.name``,
    which unlike the hostname label always names the node): one requirement per node (the API
    allows one value per field requirement; requirements of a term all hold), added to every
    required node selector term, since the terms are alternatives."""
    if not nodes:
        return
    affinity = pod_spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        fields = term.setdefault("matchFields", [])
        fields += [{"key": "metadata.name", "operator": "NotIn", "values": [node]} for node in sorted(nodes)]


KUEUE_TOPOLOGY_ANNOTATIONS = {
    "required": "kueue.x-k8s.io/podset-required-topology",
    "preferred": "kueue.x-k8s.io/podset-preferred-topology",
}
KUEUE_POD_INDEX_LABEL_ANNOTATION = "kueue.x-k8s.io/pod-group-pod-index-label"
TOPOLOGY_AFFINITY_WEIGHT = 100


def place_in_domain(pod_spec: dict[str, Any], job: api.TrainingJob, domain: str | None) -> None:
    """Keep a worker in its job's topology domain where the operator places workers itself
    (gang.scheduler none or scheduler-plugins; ``topology.place`` chooses ``domain``): required,
    a node affinity to the domain; preferred, a preferred one. Without a domain (nodes are not
    watched) the workers follow each other by pod affinity on the label: the first decides."""
    topology = job.spec.placement.topology if job.spec.placement is not None else None
    if topology is None or job.spec.gang.scheduler in ("kueue", "volcano"):
        return
    affinity = pod_spec.setdefault("affinity", {})
    peers = {
        "labelSelector": {
            "matchLabels": {naming.JOB_NAME_LABEL: job.metadata.name, naming.ROLE_LABEL: naming.ROLE_WORKER}
        },
        "topologyKey": topology.key,
    }
    if topology.mode == "required":
        values = {"key": topology.key, "operator": "In", "values": [domain]} if domain else None
        requirement = values or {"key": topology.key, "operator": "Exists"}
        required = affinity.setdefault("nodeAffinity", {}).setdefault(
            "requiredDuringSchedulingIgnoredDuringExecution", {}
        )
        terms = required.setdefault("nodeSelectorTerms", [])
        if not terms:
            terms.append({})
        for term in terms:
            term.setdefault("matchExpressions", []).append(dict(requirement))
        if domain is None:
            pod_affinity = affinity.setdefault("podAffinity", {})
            pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(peers)
        return
    if domain is not None:
        preferred = affinity.setdefault("nodeAffinity", {}).setdefault(
            "preferredDuringSchedulingIgnoredDuringExecution", []
        )
        preferred.append(
            {
                "weight": TOPOLOGY_AFFINITY_WEIGHT,
                "preference": {"matchExpressions": [{"key": topology.key, "operator": "In", "values": [domain]}]},
            }
        )
    pod_affinity = affinity.setdefault("podAffinity", {})
    pod_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
        {"weight": TOPOLOGY_AFFINITY_WEIGHT, "podAffinityTerm": peers}
    )


def place_replica_group(
    pod_spec: dict[str, Any],
    labels: dict[str, str],
    annotations: dict[str, str],
    job: api.TrainingJob,
    index: int,
    attempt: int,
    generation: int,
) -> None:
    """A worker of a replica group (spec.replicaGroups): labelled with its group and generation,
    given its group's rendezvous id (supervised pods read it from the pod-info files), and, with a
    topology key, required to share a domain with the rest of its group at this generation: the
    first pod of the group lands where it fits and the others follow it, so the group is placed
    as a unit while different groups may land in different domains."""
    groups = job.spec.replica_groups
    assert groups is not None
    group = index // groups.size
    labels[naming.REPLICA_GROUP_LABEL] = str(group)
    labels[naming.GROUP_GENERATION_LABEL] = str(generation)
    if naming.RENDEZVOUS_ID_ANNOTATION in annotations:
        annotations[naming.RENDEZVOUS_ID_ANNOTATION] = naming.group_rendezvous_id(
            job.metadata.uid, attempt, group, generation
        )
    if groups.topology is None:
        return
    peers = {
        "labelSelector": {
            "matchLabels": {
                naming.JOB_NAME_LABEL: job.metadata.name,
                naming.ROLE_LABEL: naming.ROLE_WORKER,
                naming.ATTEMPT_LABEL: str(attempt),
                naming.REPLICA_GROUP_LABEL: str(group),
                naming.GROUP_GENERATION_LABEL: str(generation),
            }
        },
        "topologyKey": groups.topology,
    }
    affinity = pod_spec.setdefault("affinity", {})
    pod_affinity = affinity.setdefault("podAffinity", {})
    pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(peers)


def _trainer_container(
    job: api.TrainingJob,
    launch: Launch,
    container: dict[str, Any],
    *,
    attempt: int,
    index: int | None,
    group_generation: int = 0,
) -> dict[str, Any]:
    spec = job.spec
    profile = transport_profile(spec, launch, job.metadata.namespace)
    ours = worker_environment(
        spec,
        launch,
        job_name=job.metadata.name,
        namespace=job.metadata.namespace,
        job_uid=job.metadata.uid,
        attempt=attempt,
        index=index,
        group_generation=group_generation,
    )
    ours.append({"name": JOB_UID_ENV, "value": job.metadata.uid})
    if ranks_follow_placement(job, launch):  # phalanx.worker.protocol.RANK_ADDRESS_ENV
        ours.append({"name": "PHALANX_RANK_ADDRESS", "value": "1"})
    if spec.checkpoint is not None:  # phalanx.worker.protocol.SAVE_NOW_FILE_ENV
        ours.append({"name": "PHALANX_SAVE_NOW_FILE", "value": f"{naming.NOTICES_DIR}/{SAVE_NOW_FILE}"})
    container["env"] = merge_env(ours, container.get("env"))
    resources = container.setdefault("resources", {})
    extra: dict[str, str] = dict(profile.extra_limits)
    gpu_resource = spec.gpus.extended_resource()
    if gpu_resource is not None:
        extra[gpu_resource] = str(spec.gpus.count)
    for kind in ("requests", "limits"):
        if extra:
            resources[kind] = {**(resources.get(kind) or {}), **extra}
    if device_claim_template(job) is not None:
        claims = resources.setdefault("claims", [])
        if {"name": naming.DEVICE_CLAIM} not in claims:
            claims.append({"name": naming.DEVICE_CLAIM})
    if profile.ipc_lock:
        security = container.setdefault("securityContext", {})
        capabilities = security.setdefault("capabilities", {})
        added = capabilities.setdefault("add", [])
        if "IPC_LOCK" not in added:
            added.append("IPC_LOCK")
    mounts = container.setdefault("volumeMounts", [])
    if profile.memory_shm:
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if spec.checkpoint is not None:
        volume = spec.checkpoint.volume_name or CHECKPOINT_VOLUME
        mounts.append({"name": volume, "mountPath": spec.checkpoint.mount_path})
    if launch.supervised:
        mounts.append({"name": naming.POD_INFO_VOLUME, "mountPath": naming.POD_INFO_DIR, "readOnly": True})
    if spec.checkpoint is not None:
        mounts.append({"name": naming.NOTICES_VOLUME, "mountPath": naming.NOTICES_DIR, "readOnly": True})
    if not mounts:
        container.pop("volumeMounts")
    container.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    ports = container.setdefault("ports", [])
    metrics_port = worker_metrics_port(container["env"], f"spec.template.spec.containers[{launch.trainer_index}].env")
    if not any(port.get("containerPort") == metrics_port for port in ports):
        ports.append({"name": naming.METRICS_PORT_NAME, "containerPort": metrics_port, "protocol": "TCP"})
    return container


def worker_metrics_port(env: list[dict[str, Any]], where: str) -> int:
    """The worker metrics port, which the container's own PHALANX_WORKER_METRICS_PORT may change."""
    value = next((var.get("value") for var in env if var.get("name") == "PHALANX_WORKER_METRICS_PORT"), None)
    try:
        port = int(value) if value is not None else WORKER_METRICS_PORT
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise PlanningError(where, f"PHALANX_WORKER_METRICS_PORT {value!r} is not a port number")
    return port


def worker_pod(
    job: api.TrainingJob,
    launch: Launch,
    *,
    index: int,
    attempt: int,
    kueue_total: int | None = None,
    avoid: Sequence[str] = (),
    spare: int | None = None,
    domain: str | None = None,
    spare_class: str | None = None,
    group_generation: int = 0,
) -> Object:
    """One worker pod: the user's template plus everything elastic training needs; ``avoid``:
    nodes the job keeps off (failurePolicy.avoidNodeSeconds); ``domain``: the topology domain the
    operator placed the job in (``place_in_domain``). ``spare``: instead, the warm spare of that
    serial, in the PriorityClass ``spare_class`` (``spare_pod``). ``group_generation``: with
    spec.replicaGroups, the generation of the slot's group (``place_replica_group``)."""
    spec = job.spec
    template = template_spec(job)
    template_metadata = spec.template.metadata
    containers = template["containers"]
    containers[launch.trainer_index] = _trainer_container(
        job,
        launch,
        containers[launch.trainer_index],
        attempt=attempt,
        index=index if spare is None else None,
        group_generation=group_generation,
    )
    profile = transport_profile(spec, launch, job.metadata.namespace)

    volumes = template.setdefault("volumes", [])
    volume_names = {volume.get("name") for volume in volumes}
    if profile.memory_shm:
        empty_dir: dict[str, Any] = {"medium": "Memory"}
        if spec.network.shm_size:
            empty_dir["sizeLimit"] = spec.network.shm_size
        volumes.append({"name": SHM_VOLUME, "emptyDir": empty_dir})
    if spec.checkpoint is not None:
        if spec.checkpoint.claim_name:
            volumes.append(
                {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": spec.checkpoint.claim_name}}
            )
        elif spec.checkpoint.volume_name not in volume_names:
            raise PlanningError(
                "spec.checkpoint.volumeName",
                f"no volume named {spec.checkpoint.volume_name!r} in spec.template.spec.volumes",
            )
    if launch.supervised:
        volumes.append(pod_info_volume(groups=spec.replica_groups is not None))
    if spec.checkpoint is not None:
        volumes.append(notices_volume())
    if not volumes:
        template.pop("volumes")
    if device_claim_template(job) is not None:
        claims = template.setdefault("resourceClaims", [])
        if any(claim.get("name") == naming.DEVICE_CLAIM for claim in claims):
            raise PlanningError(
                "spec.template.spec.resourceClaims",
                f"the claim name {naming.DEVICE_CLAIM!r} is the job's own (its DRA devices); name yours otherwise",
            )
        claims.append(
            {
                "name": naming.DEVICE_CLAIM,
                "resourceClaimTemplateName": naming.device_claim_template_name(job.metadata.name),
            }
        )

    gpu_resource = spec.gpus.extended_resource()
    if gpu_resource is not None:
        tolerations = template.setdefault("tolerations", [])
        toleration = {"key": gpu_resource, "operator": "Exists", "effect": "NoSchedule"}
        if toleration not in tolerations:
            tolerations.append(toleration)

    template["restartPolicy"] = "Never"
    template.setdefault("enableServiceLinks", False)
    if spare is not None and spare_class and not template.get("priorityClassName"):
        # the admission plugin derives both from the class, and refuses a pod whose own differ
        template.pop("priority", None)
        template.pop("preemptionPolicy", None)
        template["priorityClassName"] = spare_class
    keep_off(template, avoid)
    place_in_domain(template, job, domain)
    name = naming.worker_pod_name(job.metadata.name, index)
    if spare is not None:
        name = naming.spare_pod_name(job.metadata.name, spare)
    if launch.launcher == "static":  # <pod>.<job>-workers.<namespace>.svc resolves to the pod
        template["hostname"] = naming.worker_pod_name(job.metadata.name, index)
        template["subdomain"] = naming.workers_service_name(job.metadata.name)
    labels = dict((template_metadata.labels if template_metadata else None) or {})
    labels.update({naming.ROLE_LABEL: naming.ROLE_WORKER, naming.ATTEMPT_LABEL: str(attempt)})
    if spare is None:
        labels[naming.WORKER_INDEX_LABEL] = str(index)
    else:  # no slot until promoted
        labels[naming.ROLE_LABEL] = naming.ROLE_SPARE
    annotations = dict((template_metadata.annotations if template_metadata else None) or {})
    annotations[naming.CONTAINER_ANNOTATION] = containers[launch.trainer_index]["name"]
    if launch.supervised:
        annotations[naming.RENDEZVOUS_ID_ANNOTATION] = naming.rendezvous_id(job.metadata.uid, attempt)
    if spec.replica_groups is not None and spare is None:
        place_replica_group(template, labels, annotations, job, index, attempt, group_generation)
    annotations.update(profile.annotations)
    placement = spec.placement.topology if spec.placement is not None else None
    if domain is not None and placement is not None and spec.gang.scheduler in ("none", "scheduler-plugins"):
        annotations[naming.DOMAIN_ANNOTATION] = domain

    gang = spec.gang
    if gang.scheduler in ("scheduler-plugins", "volcano"):
        template["schedulerName"] = gang.scheduler_name or naming.DEFAULT_SCHEDULER_NAMES[gang.scheduler]
        if gang.scheduler == "scheduler-plugins":
            labels[naming.COSCHEDULING_POD_GROUP_LABEL] = naming.pod_group_name(job.metadata.name)
        else:
            annotations[naming.VOLCANO_GROUP_ANNOTATION] = naming.pod_group_name(job.metadata.name)
    elif gang.scheduler == "kueue":
        labels[naming.KUEUE_QUEUE_LABEL] = gang.queue or ""
        labels[naming.KUEUE_POD_GROUP_LABEL] = naming.kueue_group_name(job.metadata.name, attempt)
        annotations[naming.KUEUE_TOTAL_COUNT_ANNOTATION] = str(kueue_total or spec.workers.desired)
        annotations[naming.KUEUE_RETRIABLE_ANNOTATION] = "false"
        topology = spec.placement.topology if spec.placement is not None else None
        if topology is not None:  # Kueue's topology-aware scheduling chooses the domain
            annotations[KUEUE_TOPOLOGY_ANNOTATIONS[topology.mode]] = topology.key
            # ... and places the pods in slot order, so neighbouring slots share a domain
            annotations[KUEUE_POD_INDEX_LABEL_ANNOTATION] = naming.WORKER_INDEX_LABEL

    return with_spec_hash(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": child_metadata(job, name, labels, annotations),
            "spec": template,
        }
    )


def spare_pod(
    job: api.TrainingJob,
    launch: Launch,
    *,
    serial: int,
    attempt: int,
    avoid: Sequence[str] = (),
    domain: str | None = None,
    priority_class: str | None = None,
) -> Object:
    """A warm spare: a worker pod without a slot (``phalanx.dev/role: spare``, no worker index),
    whose supervisor imports what the command needs and waits to be promoted (``decide`` refuses a
    spec that cannot have spares, ``spares_refusal``, before any is rendered).

    It ranks below the workers, so that a waiting spare never takes a node a worker waits for:
    ``priority_class`` (the operator's spare class) when the template names none, its workers then
    being at the cluster's default priority; a template's own class stays, since the operator does
    not know its value, and none is known to be lower."""
    return worker_pod(
        job, launch, index=0, attempt=attempt, avoid=avoid, spare=serial, domain=domain, spare_class=priority_class
    )


def spares_refusal(spec: api.TrainingJobSpec, launch: Launch) -> str:
    """Why this spec cannot have spares (empty when it can)."""
    if spec.gang.scheduler == "kueue":
        return (
            "spares are not available with gang.scheduler kueue: Kueue admits each gang attempt as a "
            "pod group of fixed size, which a spare promoted into a slot cannot join"
        )
    if launch.launcher != "torchrun":
        return f"spares need launcher torchrun (a {launch.launcher} world has fixed ranks that a spare cannot take)"
    if spec.replica_groups is not None and spec.replica_groups.topology is not None:
        return (
            "spares are not available with replicaGroups.topology yet: a spare waits outside the domain "
            "of the group it joins"
        )
    if not launch.supervised:
        return (
            "spares need the trainer container's command to run phalanx-supervise "
            '(command: ["phalanx-supervise", "--", "torchrun", ...]), which waits in the spare until it is promoted'
        )
    return ""


def worker_requests(job: api.TrainingJob, launch: Launch) -> dict[str, Decimal]:
    """What one worker asks the scheduler for (limits stand in for missing requests)."""
    return capacity.pod_requests(worker_pod(job, launch, index=0, attempt=0)["spec"])


def worker_demand(job: api.TrainingJob, launch: Launch) -> dict[str, Decimal]:
    """What one worker needs of a node, for the capacity judgement: its requests, and its DRA
    devices counted per DeviceClass (``capacity.device_class_resource``)."""
    demand = worker_requests(job, launch)
    gpus, rdma = job.spec.gpus, job.spec.network.rdma
    claimed = [(gpus.device_class_name, gpus.count)]
    if rdma is not None:
        claimed.append((rdma.device_class_name, rdma.count))
    for class_name, count in claimed:
        if class_name is not None:
            key = capacity.device_class_resource(class_name)
            demand[key] = demand.get(key, Decimal(0)) + count
    return demand
