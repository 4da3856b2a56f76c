"""Classify a worker's failure from Kubernetes state, not from its exit code alone.

torchrun exits 1 whatever went wrong, so the exit code says little. The pod's
conditions (DisruptionTarget), the container's terminated and waiting reasons and whether
its node is lost (not Ready past the operator's grace, or deleted) tell evictions and lost
nodes (replace, do not count) from OOM kills and application errors (count against the
budget) from configuration errors that no retry can fix (fail fast).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from phalanx.reconcile.observed import PodRecord

Action = Literal["replace", "fail"]

# Waiting reasons that mean the container will never start as configured.
FATAL_WAITING_REASONS = {
    "ErrImagePull": "ImagePullFailed",
    "ImagePullBackOff": "ImagePullFailed",
    "InvalidImageName": "ImagePullFailed",
    "ErrImageNeverPull": "ImagePullFailed",
    "CreateContainerConfigError": "InvalidPodConfiguration",
    "CreateContainerError": "InvalidPodConfiguration",
    "RunContainerError": "InvalidPodConfiguration",
}
# Terminated reasons of a container the runtime could not start (containerd: StartError with
# exit code 128 and the runtime's error, such as an executable missing from $PATH; Docker:
# ContainerCannotRun). The same spec fails the same way on every retry.
FATAL_TERMINATED_REASONS = {
    "StartError": "InvalidPodConfiguration",
    "ContainerCannotRun": "InvalidPodConfiguration",
}
DISRUPTION_REASONS = {
    "PreemptionByScheduler": "Preempted",
    "PreemptionByKubeScheduler": "Preempted",
    "DeletionByTaintManager": "NodeLost",
    "EvictionByEvictionAPI": "Evicted",
    "DeletionByPodGC": "NodeLost",
    "TerminationByKubelet": "Evicted",
}
MAX_MESSAGE = 1024
MAX_SCANNED = 8192  # the kubelet keeps at most 4096 bytes of a termination message; a bound all the same
# Disruptions that are the node's doing (the taint manager after NotReady/unreachable, the pod
# garbage collector after the node went, the kubelet evicting for pressure).
DISRUPTION_NODE_FAULTS = {
    "DeletionByTaintManager": "NodeLost",
    "DeletionByPodGC": "NodeLost",
    "TerminationByKubelet": "NodePressure",
}
# Errors in a worker's termination message that belong to its node's hardware or fabric, not to the
# training code: the job's later pods keep off that node (failurePolicy.avoidNodeSeconds). Matched
# case-insensitively. A collective timeout or a peer's error names no node, so it is not here.
NODE_ERROR_PATTERNS = (
    ("GPUError", re.compile(r"uncorrectable ECC|cudaErrorECCUncorrectable|CUDA_ERROR_ECC_UNCORRECTABLE", re.I)),
    ("GPUError", re.compile(r"GPU is lost|GPU has fallen off the bus|NVML_ERROR_GPU_IS_LOST|\bXid\b", re.I)),
    ("GPUError", re.compile(r"uncorrectable NVLink|cudaErrorNvlinkUncorrectable|cudaErrorDevicesUnavailable", re.I)),
    ("GPUError", re.compile(r"no CUDA-capable device is detected|cudaErrorNoDevice", re.I)),
    ("NCCLError", re.compile(r"ncclSystemError|NCCL error.*unhandled system error", re.I)),
    ("NCCLError", re.compile(r"NET/IB ?: .*(error|failed)|ibv_\w+ failed|IBV_WC_\w+_ERR", re.I)),
)


@dataclass(frozen=True)
class Failure:
    """Why a worker stopped and what to do about it."""

    reason: str
    counted: bool
    action: Action
    message: str
    node_fault: str | None = None
    """Why the pod's node is to blame (NodeLost, NodePressure, NodeRejected, GPUError, NCCLError),
    when it is: the job's later pods keep off it."""


def _describe(pod: PodRecord) -> str:
    parts = [f"worker {pod.name}"]
    if pod.exit_code is not None:
        parts.append(f"exited with code {pod.exit_code}")
    if pod.terminated_reason:
        parts.append(f"({pod.terminated_reason})")
    text = " ".join(parts)
    if pod.termination_message:
        text += f": {root_cause(pod.termination_message)}"
    return text[:MAX_MESSAGE]


def root_cause(termination_message: str) -> str:
    """The error line of torchrun's error file (TORCHELASTIC_ERROR_FILE), else the message as is.

    torchrun writes JSON such as ``{"message": {"message": "ValueError: ...", "extraInfo":
    {"py_callstack": ...}}}``; the traceback belongs in the logs, the error in the condition.
    """
    try:
        document = json.loads(termination_message)
    except ValueError:
        return termination_message.strip()
    message = document.get("message") if isinstance(document, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return str(message).strip() if message else termination_message.strip()


def classify(pod: PodRecord, *, node_lost: str | None = None) -> Failure | None:
    """The failure of one worker pod, or None while it is healthy, pending or finished well.

    ``node_lost`` says why the pod's node is taken for lost (not Ready past the grace, deleted);
    None while it is Ready or within the grace."""
    if pod.waiting_reason in FATAL_WAITING_REASONS:
        detail = f": {pod.waiting_message}" if pod.waiting_message else ""
        return Failure(
            FATAL_WAITING_REASONS[pod.waiting_reason],
            counted=False,
            action="fail",
            message=f"worker {pod.name} cannot start ({pod.waiting_reason}){detail}"[:MAX_MESSAGE],
        )
    if pod.terminated_reason in FATAL_TERMINATED_REASONS and pod.phase == "Failed":
        detail = f": {pod.termination_message.strip()}" if pod.termination_message else ""
        return Failure(
            FATAL_TERMINATED_REASONS[pod.terminated_reason],
            counted=False,
            action="fail",
            message=f"worker {pod.name} cannot start ({pod.terminated_reason}, exit code {pod.exit_code}){detail}"[
                :MAX_MESSAGE
            ],
        )
    if pod.disruption_reason is not None:
        reason = DISRUPTION_REASONS.get(pod.disruption_reason, "Disrupted")
        return Failure(
            reason,
            counted=False,
            action="replace",
            message=f"worker {pod.name} was disrupted ({pod.disruption_reason})",
            node_fault=_disruption_node_fault(pod),
        )
    if node_lost is not None and pod.node_name and not pod.finished:
        return Failure(
            "NodeLost",
            counted=False,
            action="replace",
            message=f"worker {pod.name} is on node {pod.node_name}, which {node_lost}",
            node_fault="NodeLost",
        )
    if pod.phase != "Failed":
        return None
    if pod.reason in ("Evicted", "Preempting", "Terminated", "Shutdown", "NodeShutdown"):
        return Failure(
            "Evicted",
            counted=False,
            action="replace",
            message=f"worker {pod.name} was stopped by its node ({pod.reason})",
            node_fault="NodePressure" if pod.reason == "Evicted" else None,  # a shutdown is no fault of the node
        )
    if pod.reason == "NodeLost":
        return Failure(
            "NodeLost",
            counted=False,
            action="replace",
            message=f"worker {pod.name} was lost with its node",
            node_fault="NodeLost",
        )
    if pod.reason and (pod.reason.startswith("OutOf") or pod.reason == "UnexpectedAdmissionError"):
        return Failure(
            "NodeRejected",
            counted=False,
            action="replace",
            message=f"worker {pod.name} was refused by its node ({pod.reason})",
            node_fault="NodeRejected",
        )
    fault = node_error(pod.termination_message)
    if pod.terminated_reason == "OOMKilled":
        return Failure("OOMKilled", counted=True, action="replace", message=_describe(pod), node_fault=fault)
    return Failure("WorkerFailed", counted=True, action="replace", message=_describe(pod), node_fault=fault)


def _disruption_node_fault(pod: PodRecord) -> str | None:
    fault = DISRUPTION_NODE_FAULTS.get(pod.disruption_reason or "")
    if fault == "NodePressure" and pod.reason != "Evicted":
        return None  # the kubelet also terminates pods for a graceful node shutdown: no fault of the node
    return fault


def node_error(termination_message: str | None) -> str | None:
    """GPUError or NCCLError when the termination message shows the node's hardware or fabric
    failing (``NODE_ERROR_PATTERNS``), else None."""
    if not termination_message:
        return None
    text = termination_message[:MAX_SCANNED]
    return next((fault for fault, pattern in NODE_ERROR_PATTERNS if pattern.search(text)), None)
