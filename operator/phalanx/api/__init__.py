"""The TrainingJob API: pydantic models that are the single source of the CRD."""

from phalanx.api.v1alpha1 import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    TrainingJob,
    TrainingJobSpec,
    TrainingJobStatus,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "TrainingJob",
    "TrainingJobSpec",
    "TrainingJobStatus",
]
