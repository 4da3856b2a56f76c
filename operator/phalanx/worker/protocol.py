"""What the in-pod helper and the operator agree on, with no dependencies on either side."""

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
