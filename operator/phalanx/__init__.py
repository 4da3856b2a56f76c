"""phalanx: a Kubernetes operator that runs elastic distributed training jobs."""

__version__ = "0.1.0"
