"""Classify a worker's failure from Kubernetes state, not from its exit code alone.

torchrun exits 1 whatever went wrong, so the exit code says little. The pod's
conditions (DisruptionTarget), the container's terminated and waiting reasons and whether
its node is lost (not Ready past the operator's grace, or deleted) tell evictions and lost
nodes (replace, do not count) from OOM kills and application errors (count against the
budget) from configuration errors that no retry can fix (fail fast).
"""

from __future__ import annotations

import json
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


@dataclass(frozen=True)
class Failure:
    """Why a worker stopped and what to do about it."""

    reason: str
    counted: bool
    action: Action
    message: str


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
        )
    if node_lost is not None and pod.node_name and not pod.finished:
        return Failure(
            "NodeLost",
            counted=False,
            action="replace",
            message=f"worker {pod.name} is on node {pod.node_name}, which {node_lost}",
        )
    if pod.phase != "Failed":
        return None
    if pod.reason in ("Evicted", "Preempting", "Terminated", "Shutdown", "NodeShutdown"):
        return Failure(
            "Evicted",
            counted=False,
            action="replace",
            message=f"worker {pod.name} was stopped by its node ({pod.reason})",
        )
    if pod.reason == "NodeLost":
        return Failure("NodeLost", counted=False, action="replace", message=f"worker {pod.name} was lost with its node")
    if pod.reason and (pod.reason.startswith("OutOf") or pod.reason == "UnexpectedAdmissionError"):
        return Failure(
            "NodeRejected",
            counted=False,
            action="replace",
            message=f"worker {pod.name} was refused by its node ({pod.reason})",
        )
    if pod.terminated_reason == "OOMKilled":
        return Failure("OOMKilled", counted=True, action="replace", message=_describe(pod))
    return Failure("WorkerFailed", counted=True, action="replace", message=_describe(pod))
