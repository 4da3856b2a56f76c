"""The objects a TrainingJob should have: worker pods, the rendezvous store and Service, a PodGroup.

Every builder is a pure function of the job and returns a dict ready for server-side
apply. Each object carries a hash of its own content in ``phalanx.dev/spec-hash``, so the
planner can tell "already as desired" from "needs applying" without comparing whole
objects, and re-planning against its own result yields no change.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import capacity, naming
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
from phalanx.reconcile.observed import JobIsolation
from phalanx.reconcile.quantity import format_quantity

Object = dict[str, Any]

COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
RESOURCE_API = "resource.k8s.io/v1"
GPU_REQUEST = "gpus"
NIC_REQUEST = "nics"
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
NETWORK_POLICY_API = "networking.k8s.io/v1"
ENDPOINT_SLICE_API = "discovery.k8s.io/v1"
VOLCANO_TOPOLOGY_TIER = 1
"""The HyperNode tier a Volcano gang may span: configure Volcano's discovery so that tier 1 is the
domains of placement.topology.key (docs/placement.md)."""
STORE_CONTAINER = "store"
JOB_UID_ENV = "PHALANX_JOB_UID"
"""The job's UID in the workers' and the store's environment: a completion record names it."""

# The store is torch's own TCPStore in a process of its own: every worker dials it with
# is_host=false, so no worker is special and losing any of them never loses the rendezvous.
# It also serves, on the metrics port, whether a rank recorded that training completed
# (phalanx.worker sets naming.COMPLETION_KEY): the store outlives the workers, so the operator learns
# of a completed training even when a rank dies in teardown and the agents wait on each other.
# Anything that reaches the store can set that key: only a small JSON record naming this job's UID
# (PHALANX_JOB_UID, which the workers write too) is served, labelled with it, and the operator
# checks the UID and the attempt again. Rank 0's progress report (naming.PROGRESS_KEY) is served
# the same way, and only whole: every field of the expected type and range, at most
# PROGRESS_MAX_METRICS metrics with valid names and finite values, or none of it.
STORE_SCRIPT = (
    f"NAME, MAX_BYTES, MAX_METRICS = {naming.PROGRESS_METRIC_NAME[1:-1]!r}, "
    f"{naming.PROGRESS_MAX_BYTES}, {naming.PROGRESS_MAX_METRICS}\n"
    """\
import json, os, re, signal, sys, threading, time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from torch.distributed import TCPStore
port = int(os.environ["PHALANX_RENDEZVOUS_PORT"])
key = os.environ["PHALANX_COMPLETION_KEY"]
progress_key = os.environ.get("PHALANX_PROGRESS_KEY")
job = os.environ["PHALANX_JOB_UID"]
NAME = re.compile(NAME)
store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                 multi_tenant=True, timeout=timedelta(hours=1))
lock = threading.Lock()
def record(name):
    if not name or not store.check([name]):
        return {}
    raw = store.get(name)
    try:
        done = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except Exception:  # malformed or nested past the recursion limit
        done = None
    return done if isinstance(done, dict) and done.get("job") == job else {}
def count(value):
    return value if type(value) is int and 0 <= value < 2**53 else None
def moment(value):
    ok = type(value) in (int, float) and 946684800 <= value <= 7258118400
    return float(value) if ok else None
def number(value):
    return float(value) if type(value) in (int, float) and -1e300 <= value <= 1e300 else None
def progress_lines(report):
    attempt, step, at = count(report.get("attempt")), count(report.get("step")), moment(report.get("time"))
    total, metrics = report.get("totalSteps"), report.get("metrics", {})
    if None in (attempt, step, at) or (total is not None and count(total) is None):
        return []
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        return []
    label = f'job="{job}"'
    lines = [f"phalanx_training_progress_attempt{{{label}}} {attempt}",
             f"phalanx_training_progress_step{{{label}}} {step}",
             f"phalanx_training_progress_timestamp_seconds{{{label}}} {at!r}"]
    if total is not None:
        lines.append(f"phalanx_training_progress_total_steps{{{label}}} {total}")
    for name, metric in sorted(metrics.items()):
        if not NAME.fullmatch(name) or not isinstance(metric, dict):
            return []
        value, when, seen = number(metric.get("value")), count(metric.get("step")), moment(metric.get("time"))
        if None in (value, when, seen):
            return []
        named = f'{label},name="{name}"'
        lines += [f"phalanx_training_progress_metric{{{named}}} {value!r}",
                  f"phalanx_training_progress_metric_step{{{named}}} {when}",
                  f"phalanx_training_progress_metric_timestamp_seconds{{{named}}} {seen!r}"]
    return lines
class Status(BaseHTTPRequestHandler):
    def do_GET(self):
        lines = []
        with lock:
            done, report = record(key), record(progress_key)
        for field in ("attempt", "step", "rank"):
            value = done.get(field)
            if isinstance(value, int) and not isinstance(value, bool):
                lines.append(f'phalanx_training_completed_{field}{{job="{job}"}} {value}')
        lines += progress_lines(report)
        body = ("\\n".join(lines) + "\\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = ThreadingHTTPServer(("", int(os.environ["PHALANX_STORE_METRICS_PORT"])), Status)
threading.Thread(target=server.serve_forever, daemon=True).start()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print(f"phalanx rendezvous store listening on port {port}", flush=True)
while True:
    time.sleep(3600)
"""
)
# The store needs nothing privileged: it passes Pod Security "restricted" whenever the workers do.
STORE_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
# Identity settings of the trainer container that the store container inherits.
INHERITED_SECURITY_FIELDS = ("runAsUser", "runAsGroup", "runAsNonRoot", "seLinuxOptions", "seccompProfile")


def spec_hash(obj: Object) -> str:
    """A short digest of an object's content, stable across runs."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _finish(obj: Object) -> Object:
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


def _metadata(
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


def rendezvous_service(job: api.TrainingJob) -> Object:
    """A headless Service in front of the store pod; it publishes not-ready addresses so workers
    can dial the store before readiness propagates."""
    name = naming.rendezvous_name(job.metadata.name)
    port = job.spec.rendezvous.port
    return _finish(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(job, name, {naming.ROLE_LABEL: naming.ROLE_RENDEZVOUS}),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {naming.JOB_NAME_LABEL: job.metadata.name, naming.ROLE_LABEL: naming.ROLE_RENDEZVOUS},
                "ports": [{"name": "rendezvous", "port": port, "targetPort": port, "protocol": "TCP"}],
            },
        }
    )


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


def ranks_service(job: api.TrainingJob, launch: Launch) -> Object | None:
    """The headless Service without a selector under which the rank addresses resolve: its
    EndpointSlices (``ranks_endpoint_slice``) name each worker (None unless ranks follow placement)."""
    if not ranks_follow_placement(job, launch):
        return None
    port = job.spec.rendezvous.port
    return _finish(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(job, naming.ranks_service_name(job.metadata.name)),
            "spec": {
                "clusterIP": "None",
                "ports": [{"name": "rendezvous", "port": port, "targetPort": port, "protocol": "TCP"}],
            },
        }
    )


ENDPOINTS_PER_SLICE = 1000
"""The most endpoints the API server takes in one EndpointSlice (its validation's maximum)."""


def ranks_shard(index: int) -> int:
    """The ranks EndpointSlice that names the worker of slot ``index``. By slot, not by position in
    the list: a pod stays in its slice while others come and go, so a change rewrites one slice and
    no live worker's name moves between two slices, which are two writes (between them the name
    would resolve twice, or not at all)."""
    return index // ENDPOINTS_PER_SLICE


def address_family(ip: str) -> str:
    """An EndpointSlice's addressType for an address."""
    return "IPv6" if ":" in ip else "IPv4"


def ranks_endpoint_slice(
    job: api.TrainingJob, shard: int, entries: Sequence[tuple[str, str, str]], family: str
) -> Object:
    """One of the ranks Service's EndpointSlices (``ranks_shard``): (host name, pod IP, node) of
    each worker of its slots that has a rank address; DNS then resolves
    ``<host>.<job>-ranks.<namespace>.svc`` to the pod. One address family for every slice (a pod
    has one primary IP): the others' entries are left out."""
    endpoints = [
        {"addresses": [ip], "hostname": host, "nodeName": node, "conditions": {"ready": True}}
        for host, ip, node in entries
        if address_family(ip) == family
    ]
    service = naming.ranks_service_name(job.metadata.name)
    labels = {naming.SERVICE_NAME_LABEL: service, naming.ENDPOINT_SLICE_MANAGER_LABEL: naming.ENDPOINT_SLICE_MANAGER}
    return _finish(
        {
            "apiVersion": ENDPOINT_SLICE_API,
            "kind": "EndpointSlice",
            "metadata": _metadata(job, naming.ranks_slice_name(job.metadata.name, shard), labels),
            "addressType": family,
            "endpoints": endpoints,
            "ports": [{"name": "rendezvous", "port": job.spec.rendezvous.port, "protocol": "TCP"}],
        }
    )


def workers_service(job: api.TrainingJob) -> Object | None:
    """For the static launcher: a headless Service over the workers, so that worker 0 has the
    stable DNS name every worker dials as MASTER_ADDR (None for launcher torchrun)."""
    if job.spec.launcher != "static":
        return None
    port = job.spec.rendezvous.port
    return _finish(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(
                job, naming.workers_service_name(job.metadata.name), {naming.ROLE_LABEL: naming.ROLE_WORKER}
            ),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,  # ranks dial the master before it is ready
                "selector": {naming.JOB_NAME_LABEL: job.metadata.name, naming.ROLE_LABEL: naming.ROLE_WORKER},
                "ports": [{"name": "master", "port": port, "targetPort": port, "protocol": "TCP"}],
            },
        }
    )


def _template_spec(job: api.TrainingJob) -> dict[str, Any]:
    return job.spec.template.spec.model_dump(by_alias=True, exclude_none=True)


def _device_request(name: str, class_name: str, count: int, selectors: Sequence[str] | None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": class_name, "allocationMode": "ExactCount", "count": count}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": expression}} for expression in selectors]
    return {"name": name, "exactly": exactly}


def device_claim_template(job: api.TrainingJob) -> Object | None:
    """The ResourceClaimTemplate of the job's DRA devices (None when it asks for none): the GPUs
    of gpus.deviceClassName and the NICs of network.rdma.deviceClassName, in one claim so that a
    matchAttribute constraint can align them. With as many NICs as GPUs each GPU gets its own
    request and NIC, paired by a constraint of their own (GPU i shares the attribute with NIC i);
    otherwise one constraint holds for all of them."""
    gpus, rdma = job.spec.gpus, job.spec.network.rdma
    gpu_class = gpus.device_class_name
    nic_class = rdma.device_class_name if rdma is not None else None
    if gpu_class is None and nic_class is None:
        return None
    requests: list[dict[str, Any]] = []
    constraints: list[dict[str, Any]] = []
    aligned = rdma.match_attribute if rdma is not None and gpu_class is not None else None
    if (
        rdma is not None
        and gpu_class is not None
        and nic_class is not None
        and aligned is not None
        and (rdma.count == gpus.count > 1)
    ):
        for index in range(gpus.count):
            gpu, nic = f"{GPU_REQUEST}-{index}", f"{NIC_REQUEST}-{index}"
            requests.append(_device_request(gpu, gpu_class, 1, gpus.selectors))
            requests.append(_device_request(nic, nic_class, 1, rdma.selectors))
            constraints.append({"requests": [gpu, nic], "matchAttribute": aligned})
    else:
        if gpu_class is not None:
            requests.append(_device_request(GPU_REQUEST, gpu_class, gpus.count, gpus.selectors))
        if rdma is not None and nic_class is not None:
            requests.append(_device_request(NIC_REQUEST, nic_class, rdma.count, rdma.selectors))
            if aligned is not None:
                constraints.append({"requests": [GPU_REQUEST, NIC_REQUEST], "matchAttribute": aligned})
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    name = naming.device_claim_template_name(job.metadata.name)
    return _finish(
        {
            "apiVersion": RESOURCE_API,
            "kind": "ResourceClaimTemplate",
            "metadata": _metadata(job, name),
            # claims made from it carry the job's labels, so kubectl finds them by job
            "spec": {"metadata": {"labels": naming.job_labels(job.metadata.name)}, "spec": {"devices": devices}},
        }
    )


def pod_info_volume() -> dict[str, Any]:
    """What phalanx-supervise reads: the pod's attempt, rendezvous id, role and slot, which the
    kubelet rewrites when the operator changes them (a pod kept through a gang restart, a spare
    promoted into a slot). File names: ``phalanx.worker.protocol``."""
    fields = {
        "attempt": f"metadata.labels['{naming.ATTEMPT_LABEL}']",
        "rendezvous-id": f"metadata.annotations['{naming.RENDEZVOUS_ID_ANNOTATION}']",
        "role": f"metadata.labels['{naming.ROLE_LABEL}']",
        "worker-index": f"metadata.labels['{naming.WORKER_INDEX_LABEL}']",
        "rank-address": f"metadata.annotations['{naming.RANK_ADDRESS_ANNOTATION}']",
    }
    return {
        "name": naming.POD_INFO_VOLUME,
        "downwardAPI": {"items": [{"path": path, "fieldRef": {"fieldPath": ref}} for path, ref in fields.items()]},
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


def rendezvous_store_pod(job: api.TrainingJob, launch: Launch, *, avoid: Sequence[str] = ()) -> Object:
    """The small pod that hosts the c10d store, built from the trainer's image (it has torch);
    ``avoid``: nodes the job keeps off (failurePolicy.avoidNodeSeconds)."""
    template = _template_spec(job)
    trainer = template["containers"][launch.trainer_index]
    port = job.spec.rendezvous.port
    security = copy.deepcopy(STORE_SECURITY_CONTEXT)
    trainer_security = trainer.get("securityContext") or {}
    security.update(
        {key: copy.deepcopy(trainer_security[key]) for key in INHERITED_SECURITY_FIELDS if key in trainer_security}
    )
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 5,
        "containers": [
            {
                "name": STORE_CONTAINER,
                "image": trainer["image"],
                "command": ["python3", "-c", STORE_SCRIPT],
                "env": [
                    {"name": "PHALANX_RENDEZVOUS_PORT", "value": str(port)},
                    {"name": "PHALANX_STORE_METRICS_PORT", "value": str(WORKER_METRICS_PORT)},
                    {"name": "PHALANX_COMPLETION_KEY", "value": naming.COMPLETION_KEY},
                    {"name": "PHALANX_PROGRESS_KEY", "value": naming.PROGRESS_KEY},
                    {"name": JOB_UID_ENV, "value": job.metadata.uid},
                ],
                "ports": [
                    {"name": "rendezvous", "containerPort": port, "protocol": "TCP"},
                    {"name": naming.METRICS_PORT_NAME, "containerPort": WORKER_METRICS_PORT, "protocol": "TCP"},
                ],
                "securityContext": security,
                "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2},
                "resources": {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            }
        ],
    }
    # Placement and pull settings follow the workers' so the store runs wherever their image does.
    for key in ("imagePullSecrets", "nodeSelector", "tolerations", "priorityClassName", "securityContext"):
        if key in template:
            spec[key] = copy.deepcopy(template[key])
    if "imagePullPolicy" in trainer:
        spec["containers"][0]["imagePullPolicy"] = trainer["imagePullPolicy"]
    keep_off(spec, avoid)
    name = naming.rendezvous_name(job.metadata.name)
    return _finish(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": _metadata(job, name, {naming.ROLE_LABEL: naming.ROLE_RENDEZVOUS}),
            "spec": spec,
        }
    )


def _trainer_container(
    job: api.TrainingJob, launch: Launch, container: dict[str, Any], *, attempt: int, index: int | None
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
    )
    ours.append({"name": JOB_UID_ENV, "value": job.metadata.uid})
    if ranks_follow_placement(job, launch):  # phalanx.worker.protocol.RANK_ADDRESS_ENV
        ours.append({"name": "PHALANX_RANK_ADDRESS", "value": "1"})
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
    if not mounts:
        container.pop("volumeMounts")
    container.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    ports = container.setdefault("ports", [])
    metrics_port = _metrics_port(container["env"], f"spec.template.spec.containers[{launch.trainer_index}].env")
    if not any(port.get("containerPort") == metrics_port for port in ports):
        ports.append({"name": naming.METRICS_PORT_NAME, "containerPort": metrics_port, "protocol": "TCP"})
    return container


def _metrics_port(env: list[dict[str, Any]], where: str) -> int:
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
) -> Object:
    """One worker pod: the user's template plus everything elastic training needs; ``avoid``:
    nodes the job keeps off (failurePolicy.avoidNodeSeconds); ``domain``: the topology domain the
    operator placed the job in (``place_in_domain``). ``spare``: instead, the warm spare of that
    serial, in the PriorityClass ``spare_class`` (``spare_pod``)."""
    spec = job.spec
    template = _template_spec(job)
    template_metadata = spec.template.metadata
    containers = template["containers"]
    containers[launch.trainer_index] = _trainer_container(
        job, launch, containers[launch.trainer_index], attempt=attempt, index=index if spare is None else None
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
        volumes.append(pod_info_volume())
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

    return _finish(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": _metadata(job, name, labels, annotations),
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


def pod_group(job: api.TrainingJob, launch: Launch, node_capacity: str | None = None) -> Object | None:
    """The gang's PodGroup for scheduler-plugins or Volcano; None for other schedulers.

    ``node_capacity`` is stamped on a coscheduling PodGroup (see ``naming.NODE_CAPACITY_ANNOTATION``).
    """
    gang = job.spec.gang
    if gang.scheduler not in ("scheduler-plugins", "volcano"):
        return None
    minimum = job.spec.workers.min
    per_pod = worker_requests(job, launch)
    min_resources = {name: format_quantity(value * minimum) for name, value in sorted(per_pod.items())}
    spec: dict[str, Any] = {"minMember": minimum}
    if min_resources:
        spec["minResources"] = min_resources
    if gang.scheduler == "scheduler-plugins":
        api_version = COSCHEDULING_API
        if gang.schedule_timeout_seconds is not None:
            spec["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
    else:
        api_version = VOLCANO_API
        if gang.queue:
            spec["queue"] = gang.queue
        priority = _template_spec(job).get("priorityClassName")
        if priority:
            spec["priorityClassName"] = priority
        topology = job.spec.placement.topology if job.spec.placement is not None else None
        if topology is not None:  # Volcano's HyperNodes: tier 1 is the lowest above the nodes
            spec["networkTopology"] = {
                "mode": "hard" if topology.mode == "required" else "soft",
                "highestTierAllowed": VOLCANO_TOPOLOGY_TIER,
            }
    annotations = {naming.NODE_CAPACITY_ANNOTATION: node_capacity} if node_capacity else None
    return _finish(
        {
            "apiVersion": api_version,
            "kind": "PodGroup",
            "metadata": _metadata(job, naming.pod_group_name(job.metadata.name), annotations=annotations),
            "spec": spec,
        }
    )


def job_network_policy(job: api.TrainingJob, launch: Launch, isolation: JobIsolation | None) -> Object | None:
    """The job's own NetworkPolicy (when the operator is set to isolate jobs): its pods admit
    traffic on any port only from the job's own pods, and on the metrics port from the peers the
    operator was given (itself, a Prometheus). Nothing else reaches the rendezvous store, the
    workers' rendezvous and collective ports, or the completion record. Named like the job: one
    per job, owned by it, gone with it."""
    if isolation is None:
        return None
    members = {"matchLabels": naming.job_labels(job.metadata.name)}
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": copy.deepcopy(members)}]}]
    if isolation.scrapers:
        trainer = worker_pod(job, launch, index=0, attempt=0)["spec"]["containers"][launch.trainer_index]
        where = f"spec.template.spec.containers[{launch.trainer_index}].env"
        numbers = sorted({WORKER_METRICS_PORT, _metrics_port(trainer["env"], where)})
        ports: list[dict[str, Any]] = [{"port": number, "protocol": "TCP"} for number in numbers]
        ports.append({"port": naming.METRICS_PORT_NAME, "protocol": "TCP"})
        ingress.append({"from": [copy.deepcopy(dict(peer)) for peer in isolation.scrapers], "ports": ports})
    return _finish(
        {
            "apiVersion": NETWORK_POLICY_API,
            "kind": "NetworkPolicy",
            "metadata": _metadata(job, job.metadata.name),
            "spec": {"podSelector": members, "policyTypes": ["Ingress"], "ingress": ingress},
        }
    )


LABEL_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")  # fmt: skip
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def _label_selector(value: Any, where: str) -> None:
    if not isinstance(value, Mapping) or set(value) - {"matchLabels", "matchExpressions"}:
        raise ValueError(f"{where}: a label selector has only matchLabels and matchExpressions")
    for key, label in (value.get("matchLabels") or {}).items():
        if not (isinstance(key, str) and LABEL_NAME.match(key) and isinstance(label, str) and LABEL_VALUE.match(label)):
            raise ValueError(f"{where}.matchLabels: {key!r}: {label!r} is not a label")
    for expression in value.get("matchExpressions") or []:
        values = expression.get("values") if isinstance(expression, Mapping) else None
        if (
            not isinstance(expression, Mapping)
            or not LABEL_NAME.match(str(expression.get("key", "")))
            or expression.get("operator") not in SELECTOR_OPERATORS
            or not all(isinstance(item, str) and LABEL_VALUE.match(item) for item in values or [])
        ):
            raise ValueError(f"{where}.matchExpressions: {expression!r} is not a selector requirement")


def network_policy_peers(value: Any) -> tuple[Mapping[str, Any], ...]:
    """NetworkPolicyPeers from an operator setting, checked as the API server would: a peer the
    API server refused would refuse every job's NetworkPolicy (and fail the job), so a bad setting
    keeps the operator from starting instead."""
    if not isinstance(value, list):
        raise ValueError("a list of NetworkPolicyPeers (podSelector, namespaceSelector, ipBlock)")
    for index, peer in enumerate(value):
        where = f"[{index}]"
        if not isinstance(peer, Mapping) or not peer or set(peer) - {"podSelector", "namespaceSelector", "ipBlock"}:
            raise ValueError(f"{where}: a NetworkPolicyPeer has podSelector, namespaceSelector or ipBlock")
        if "ipBlock" in peer and len(peer) > 1:
            raise ValueError(f"{where}: ipBlock stands alone")
        for selector in ("podSelector", "namespaceSelector"):
            if selector in peer:
                _label_selector(peer[selector], f"{where}.{selector}")
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            if not isinstance(block, Mapping) or set(block) - {"cidr", "except"}:
                raise ValueError(f"{where}.ipBlock: cidr and except only")
            try:
                for cidr in [block.get("cidr"), *(block.get("except") or [])]:
                    ipaddress.ip_network(str(cidr), strict=False)
            except ValueError as error:
                raise ValueError(f"{where}.ipBlock: {error}") from error
    return tuple(value)
