"""The rendezvous store's pod: torch's TCPStore in a process of its own (``store_server.py``)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from importlib import resources
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming
from phalanx.reconcile.desired.objects import Object, child_metadata, template_spec, with_spec_hash
from phalanx.reconcile.desired.pods import JOB_UID_ENV, keep_off
from phalanx.reconcile.environment import WORKER_METRICS_PORT, Launch

STORE_CONTAINER = "store"


# The store is torch's own TCPStore in a process of its own: every worker dials it with
# is_host=false, so no worker is special and losing any of them never loses the rendezvous.
# It also serves, on the metrics port, whether a rank recorded that training completed
# (phalanx.worker sets naming.COMPLETION_KEY): the store outlives the workers, so the operator learns
# of a completed training even when a rank dies in teardown and the agents wait on each other.
# Anything that reaches the store can set that key: only a small JSON record naming this job's UID
# (PHALANX_JOB_UID, which the workers write too) is served, labelled with it, and the operator
# checks the UID and the attempt again. Rank 0's progress report (naming.PROGRESS_KEY) is served
# the same way, and only whole: every field of the expected type and range, at most
# PROGRESS_MAX_METRICS metrics with valid names and finite values, or none of it. Each rank's step
# time (naming.STEP_TIME_KEY + rank) is served per rank, for the ranks below the job's world cap
# (PHALANX_STEP_TIME_RANKS, at most STEP_TIME_MAX_RANKS), each only whole and bounded.
# Its source is store_server.py (package data, never imported), after one line of the limits it
# shares with the operator: the pod runs it as `python3 -c`, so the image needs no phalanx.
STORE_SERVER = "store_server.py"
STORE_SCRIPT = (
    f"NAME, MAX_BYTES, MAX_METRICS = {naming.PROGRESS_METRIC_NAME[1:-1]!r}, "
    f"{naming.PROGRESS_MAX_BYTES}, {naming.PROGRESS_MAX_METRICS}\n"
    f"HOST, STEP_MAX_BYTES, STEP_MAX_RANKS, MAX_STEP_SECONDS = {naming.STEP_TIME_HOST[1:-1]!r}, "
    f"{naming.STEP_TIME_MAX_BYTES}, {naming.STEP_TIME_MAX_RANKS}, {naming.STEP_TIME_MAX_SECONDS}\n"
) + resources.files("phalanx.reconcile.desired").joinpath(STORE_SERVER).read_text(encoding="utf-8")
# The store needs nothing privileged: it passes Pod Security "restricted" whenever the workers do.
STORE_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
# Identity settings of the trainer container that the store container inherits.
INHERITED_SECURITY_FIELDS = ("runAsUser", "runAsGroup", "runAsNonRoot", "seLinuxOptions", "seccompProfile")


def step_time_ranks(job: api.TrainingJob, launch: Launch) -> int:
    """The ranks whose step times the store serves: the job's world cap, bounded."""
    return min(job.spec.workers.max * launch.procs_per_worker, naming.STEP_TIME_MAX_RANKS)


def rendezvous_store_pod(job: api.TrainingJob, launch: Launch, *, avoid: Sequence[str] = ()) -> Object:
    """The small pod that hosts the c10d store, built from the trainer's image (it has torch);
    ``avoid``: nodes the job keeps off (failurePolicy.avoidNodeSeconds)."""
    template = template_spec(job)
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
                    {"name": "PHALANX_STEP_TIME_KEY", "value": naming.STEP_TIME_KEY},
                    {"name": "PHALANX_STEP_TIME_RANKS", "value": str(step_time_ranks(job, launch))},
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
    return with_spec_hash(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": child_metadata(job, name, {naming.ROLE_LABEL: naming.ROLE_RENDEZVOUS}),
            "spec": spec,
        }
    )
