"""A job's Services (the store's, the static launcher's workers', the ranks'), the ranks'
EndpointSlices, and the job's own NetworkPolicy with the operator settings it takes.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming
from phalanx.reconcile.desired.objects import Object, child_metadata, with_spec_hash
from phalanx.reconcile.desired.pods import ranks_follow_placement, worker_metrics_port, worker_pod
from phalanx.reconcile.environment import WORKER_METRICS_PORT, Launch
from phalanx.reconcile.observed import JobIsolation

NETWORK_POLICY_API = "networking.k8s.io/v1"
ENDPOINT_SLICE_API = "discovery.k8s.io/v1"


def rendezvous_service(job: api.TrainingJob) -> Object:
    """A headless Service in front of the store pod; it publishes not-ready addresses so workers
    can dial the store before readiness propagates."""
    name = naming.rendezvous_name(job.metadata.name)
    port = job.spec.rendezvous.port
    return with_spec_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": child_metadata(job, name, {naming.ROLE_LABEL: naming.ROLE_RENDEZVOUS}),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {naming.JOB_NAME_LABEL: job.metadata.name, naming.ROLE_LABEL: naming.ROLE_RENDEZVOUS},
                "ports": [{"name": "rendezvous", "port": port, "targetPort": port, "protocol": "TCP"}],
            },
        }
    )


def ranks_service(job: api.TrainingJob, launch: Launch) -> Object | None:
    """The headless Service without a selector under which the rank addresses resolve: its
    EndpointSlices (``ranks_endpoint_slice``) name each worker (None unless ranks follow placement)."""
    if not ranks_follow_placement(job, launch):
        return None
    port = job.spec.rendezvous.port
    return with_spec_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": child_metadata(job, naming.ranks_service_name(job.metadata.name)),
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
    return with_spec_hash(
        {
            "apiVersion": ENDPOINT_SLICE_API,
            "kind": "EndpointSlice",
            "metadata": child_metadata(job, naming.ranks_slice_name(job.metadata.name, shard), labels),
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
    return with_spec_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": child_metadata(
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
        numbers = sorted({WORKER_METRICS_PORT, worker_metrics_port(trainer["env"], where)})
        ports: list[dict[str, Any]] = [{"port": number, "protocol": "TCP"} for number in numbers]
        ports.append({"port": naming.METRICS_PORT_NAME, "protocol": "TCP"})
        ingress.append({"from": [copy.deepcopy(dict(peer)) for peer in isolation.scrapers], "ports": ports})
    return with_spec_hash(
        {
            "apiVersion": NETWORK_POLICY_API,
            "kind": "NetworkPolicy",
            "metadata": child_metadata(job, job.metadata.name),
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
