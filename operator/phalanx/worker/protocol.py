"""What the in-pod helper and the operator agree on, with no dependencies on either side."""

COMPLETION_KEY = "phalanx/training-completed"
"""Rendezvous-store key a rank sets when training completed: JSON with job (the UID in
``PHALANX_JOB_UID``), attempt, step and rank. The store pod serves it to the operator as
``phalanx_training_completed_*`` only when it names the store's own job."""
