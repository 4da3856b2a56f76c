"""The ResourceClaimTemplate of a job's DRA devices (its GPUs and RDMA NICs, in one claim)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming
from phalanx.reconcile.desired.objects import Object, child_metadata, with_spec_hash

RESOURCE_API = "resource.k8s.io/v1"
GPU_REQUEST = "gpus"
NIC_REQUEST = "nics"


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
    return with_spec_hash(
        {
            "apiVersion": RESOURCE_API,
            "kind": "ResourceClaimTemplate",
            "metadata": child_metadata(job, name),
            # claims made from it carry the job's labels, so kubectl finds them by job
            "spec": {"metadata": {"labels": naming.job_labels(job.metadata.name)}, "spec": {"devices": devices}},
        }
    )
