"""What the in-pod helper and the operator agree on, with no dependencies on either side."""

import hashlib

COMPLETION_KEY = "phalanx/training-completed"
"""Rendezvous-store key a rank sets when training completed: JSON with job (the UID in
``PHALANX_JOB_UID``), attempt, step and rank. The store pod serves it to the operator as
``phalanx_training_completed_*`` only when it names the store's own job."""

POD_INFO_DIR_ENV = "PHALANX_POD_INFO_DIR"
"""Where phalanx-supervise finds the downward-API files the operator mounts for it."""
ATTEMPT_FILE = "attempt"
"""In that directory: the pod's gang attempt (its ``phalanx.dev/attempt`` label)."""
RENDEZVOUS_ID_FILE = "rendezvous-id"
"""In that directory: the attempt's rendezvous id (the ``phalanx.dev/rendezvous-id`` annotation)."""
ROLE_FILE = "role"
"""In that directory: the pod's role (its ``phalanx.dev/role`` label): ``spare`` while a warm spare
waits, ``worker`` once the operator has promoted it into a slot."""
SPARE_ROLE = "spare"
WORKER_INDEX_FILE = "worker-index"
"""In that directory: the pod's worker slot (its ``phalanx.dev/worker-index`` label; empty on a
spare), given to each run as ``PHALANX_WORKER_INDEX``."""
GROUP_ENV = "PHALANX_REPLICA_GROUP"
"""With replica groups: the worker's group (its slot // ``GROUP_SIZE_ENV``); the other three are its
place in the group, the group's size and its generation (docs/replica-groups.md)."""
GROUP_RANK_ENV = "PHALANX_REPLICA_GROUP_RANK"
GROUP_SIZE_ENV = "PHALANX_REPLICA_GROUP_SIZE"
GROUP_GENERATION_ENV = "PHALANX_REPLICA_GROUP_GENERATION"
GROUP_GENERATION_FILE = "group-generation"
"""In that directory, with replica groups: the pod's group generation (its
``phalanx.dev/group-generation`` label; empty on a spare until it is promoted into a group's slot),
given to each run as ``PHALANX_REPLICA_GROUP_GENERATION`` beside the group and rank its slot makes."""
RANK_ADDRESS_FILE = "rank-address"
"""In that directory: the name the run's torchrun agent gives the rendezvous as its address (the
``phalanx.dev/rank-address`` annotation, empty until the operator sets it; it starts with ``a<attempt>-``).
The rendezvous numbers agents in the sort order of their addresses, so these names decide ranks."""
RANK_ADDRESS_ENV = "PHALANX_RANK_ADDRESS"
"""Set to 1 when the operator gives the pod rank addresses: the supervisor then waits (a while) for
the attempt's address to resolve to the pod before it starts torchrun with it."""

PROGRESS_KEY = "phalanx/training-progress"
"""Rendezvous-store key under which rank 0 keeps its latest ``phalanx.worker.progress.report``:
JSON with job (``PHALANX_JOB_UID``), attempt, step, totalSteps, time and a few named metrics
(docs/worker.md). The store pod serves it to the operator as ``phalanx_training_progress_*`` only
when it names the store's own job and stays within the bounds of ``PROGRESS_LIMITS``."""
PROGRESS_MAX_BYTES = 4096
PROGRESS_MAX_METRICS = 8
PROGRESS_METRIC_NAME = r"^[A-Za-z_][A-Za-z0-9_./-]{0,62}$"
"""A metric's name in a progress record (the worker replaces other characters with ``_``)."""

SAVE_NOW_FILE_ENV = "PHALANX_SAVE_NOW_FILE"
"""Set on the workers of a job with spec.checkpoint: the downward-API file that holds the pod's
``phalanx.dev/save-now`` annotation (empty while it has none), which the kubelet rewrites when the
operator carries a new save-now token onto the pod. A rank that reads a token it has not handled
asks the world to save at the next step boundary (``TrainingSession``)."""
SAVE_NOW_MAX_BYTES = 64
"""A token is at most 63 characters (the operator carries only such tokens); a longer file is a
value a tenant wrote onto the pod and is ignored."""
CHECKPOINT_SAVE_NOW_METRIC = "phalanx_worker_last_checkpoint_save_now"
"""Gauge on a worker's /metrics: ``save_now_key`` of the token its last checkpoint answered (0:
none). The operator answers a save-now request by it, with no clock compared (a save can land in
the very second of the request, and the pod's clock is not the operator's)."""


def save_now_key(token: str) -> int:
    """A save-now token as a positive integer below 2**48 that every rank and the operator compute
    alike: the all-reduce that agrees on saving carries numbers, not text, and a float64 metric
    holds it exactly."""
    return int.from_bytes(hashlib.sha256(token.encode()).digest()[:6], "big") | 1


STEP_TIME_KEY = "phalanx/step-time/"
"""Rendezvous-store key prefix under which every rank keeps its recent step time (``<prefix><rank>``):
JSON with job, attempt, rank, host (``HOSTNAME``: the pod's), seconds (the median time of its last
steps) and step. The store pod serves the records of ranks below the job's world cap, each whole and
bounded, and the operator judges stragglers from them (docs/worker.md)."""
STEP_TIME_MAX_BYTES = 512
STEP_TIME_MAX_RANKS = 1024
STEP_TIME_HOST = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
