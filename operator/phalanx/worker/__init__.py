"""The in-pod helper any training script can use: backend choice, environment, checkpoints, progress.

It imports torch lazily so the operator (which never trains) does not need it.
"""

from phalanx.worker.backend import choose_backend
from phalanx.worker.progress import report

__all__ = ["choose_backend", "report"]
