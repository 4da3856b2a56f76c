"""The job's rendezvous store as a worker reaches it: where it is, and a client connection to it."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any


def store_address(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """Host and port of the operator's store; None in a plain local run that has none."""
    # PET_RDZV_ENDPOINT too: launcher torchrun under older operators set only that
    endpoint = environ.get("PHALANX_STORE_ENDPOINT") or environ.get("PET_RDZV_ENDPOINT", "")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host, int(port)


def connect(host: str, port: int, timeout: timedelta) -> Any:
    """A TCPStore client (never the master) that gives up after ``timeout``."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
