"""The operator's shared state, created at start-up and reached from handlers through kopf's memo."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import kopf

from phalanx.cluster.cache import ChildCache, JobCache, JobKey, NodeCache
from phalanx.cluster.client import ApiClient, Credentials
from phalanx.cluster.progress import ProgressPoller
from phalanx.cluster.workqueue import WorkQueue

SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def _decoded(data: str | bytes | None) -> bytes | None:
    if data is None:
        return None
    return base64.b64decode(data) if isinstance(data, str) else data


def credentials_from(info: kopf.ConnectionInfo) -> Credentials:
    """Turn kopf's login result into our client's credentials (one source of truth for login)."""
    in_cluster = (
        info.token is not None
        and info.ca_path is not None
        and str(info.ca_path).startswith("/var/run/secrets/kubernetes.io/")
    )
    return Credentials(
        server=info.server,
        ca_path=str(info.ca_path) if info.ca_path else None,
        ca_data=_decoded(info.ca_data),
        certificate_path=str(info.certificate_path) if info.certificate_path else None,
        certificate_data=_decoded(info.certificate_data),
        private_key_path=str(info.private_key_path) if info.private_key_path else None,
        private_key_data=_decoded(info.private_key_data),
        token=info.token,
        token_path=SERVICE_ACCOUNT_TOKEN if in_cluster else None,
        insecure=bool(info.insecure),
    )


@dataclass
class Runtime:
    """Client, caches and the work queue of one operator process."""

    client: ApiClient
    queue: WorkQueue[JobKey]
    jobs: JobCache = field(default_factory=JobCache)
    children: ChildCache = field(default_factory=ChildCache)
    nodes: NodeCache = field(default_factory=NodeCache)
    progress: ProgressPoller | None = None  # None when PHALANX_PROGRESS_INTERVAL_SECONDS is 0
