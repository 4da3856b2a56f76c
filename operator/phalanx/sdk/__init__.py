"""phalanx from Python: submit TrainingJobs (a model, a dict, YAML, a function, a script), watch
them, read their logs, change and delete them. ``Client`` is synchronous (and works inside
Jupyter's running event loop); ``AsyncClient`` is the same on asyncio. docs/sdk.md shows it all."""

from phalanx.sdk.async_client import AsyncClient, LogLine
from phalanx.sdk.errors import (
    CodeRefused,
    ConnectionFailed,
    JobExists,
    JobFailed,
    JobNotFound,
    LoginFailed,
    PhalanxError,
    SpecRefused,
    WaitTimeout,
)
from phalanx.sdk.specs import Plan
from phalanx.sdk.status import Job, JobStatus, Metric, Progress, WorkerCounts
from phalanx.sdk.sync_client import Client

__all__ = [
    "AsyncClient",
    "Client",
    "CodeRefused",
    "ConnectionFailed",
    "Job",
    "JobExists",
    "JobFailed",
    "JobNotFound",
    "JobStatus",
    "LogLine",
    "LoginFailed",
    "Metric",
    "PhalanxError",
    "Plan",
    "Progress",
    "SpecRefused",
    "WaitTimeout",
    "WorkerCounts",
]
