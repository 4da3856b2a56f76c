"""Which collective backend a worker uses."""

from __future__ import annotations

import os
from collections.abc import Mapping


def choose_backend(environ: Mapping[str, str] | None = None, *, cuda_available: bool | None = None) -> str:
    """nccl when CUDA is present, gloo otherwise; the operator's PHALANX_BACKEND hint wins."""
    environ = os.environ if environ is None else environ
    hint = environ.get("PHALANX_BACKEND")
    if hint in ("nccl", "gloo"):
        return hint
    if cuda_available is None:
        import torch

        cuda_available = bool(torch.cuda.is_available())
    return "nccl" if cuda_available else "gloo"
