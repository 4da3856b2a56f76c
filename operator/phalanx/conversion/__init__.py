"""Converting other tools' jobs into TrainingJobs: Kubeflow's PyTorchJob (``kubeflow``) and the
torchrun command lines inside them (``torchrun``). Conversion reads the API; the API never reads it."""
