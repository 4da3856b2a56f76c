"""A TrainingJob's status as typed values, read tolerantly from the object's body (a field an
older operator does not write is absent, never an error)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class Job:
    """A submitted job: enough to find it again."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class Metric:
    value: float
    step: int | None = None
    time: float | str | None = None


@dataclass(frozen=True)
class Progress:
    """What the training reported (``status.progress``, pushed by ``phalanx.worker.progress``)."""

    step: int | None = None
    total_steps: int | None = None
    percent: float | None = None
    eta_seconds: float | None = None
    metrics: Mapping[str, Metric] = field(default_factory=dict)

    @classmethod
    def from_status(cls, progress: Any) -> Progress | None:
        if not isinstance(progress, Mapping):
            return None
        metrics: dict[str, Metric] = {}
        # status.progress.metrics is a list of {name, value, step, time} (api.ProgressMetric)
        listed = progress.get("metrics")
        for metric in listed if isinstance(listed, list) else ():
            if not isinstance(metric, Mapping) or not isinstance(metric.get("name"), str):
                continue
            value = _number(metric.get("value"))
            if value is not None:
                when = metric.get("time")
                metrics[metric["name"]] = Metric(
                    value, _integer(metric.get("step")), when if isinstance(when, (int, float, str)) else None
                )
        step, total = _integer(progress.get("step")), _integer(progress.get("totalSteps"))
        percent = _number(progress.get("percent"))
        if percent is None and step is not None and total:
            percent = min(100.0, 100.0 * step / total)
        return cls(step, total, percent, _number(progress.get("etaSeconds")), metrics)


@dataclass(frozen=True)
class WorkerCounts:
    desired: int = 0
    active: int = 0
    ready: int = 0


@dataclass(frozen=True)
class JobStatus:
    """A TrainingJob as last read: its phase, why, its workers and the training's progress."""

    name: str
    namespace: str
    uid: str
    phase: str
    reason: str
    message: str
    attempt: int
    restarts: int
    workers: WorkerCounts
    progress: Progress | None
    conditions: tuple[Mapping[str, Any], ...]
    suspended: bool
    raw: Mapping[str, Any]
    """The whole object as the API server returned it."""

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobStatus:
        metadata = body.get("metadata") or {}
        status = body.get("status") or {}
        counts = status.get("workers")
        workers: Mapping[str, Any] = counts if isinstance(counts, Mapping) else {}
        return cls(
            name=str(metadata.get("name", "")),
            namespace=str(metadata.get("namespace", "")),
            uid=str(metadata.get("uid", "")),
            phase=str(status.get("phase") or "Pending"),
            reason=str(status.get("reason") or ""),
            message=str(status.get("message") or ""),
            attempt=_integer(status.get("attempt")) or 0,
            restarts=_integer(status.get("restarts")) or 0,
            workers=WorkerCounts(
                desired=_integer(workers.get("desired")) or 0,
                active=_integer(workers.get("active")) or 0,
                ready=_integer(workers.get("ready")) or 0,
            ),
            progress=Progress.from_status(status.get("progress")),
            conditions=tuple(c for c in status.get("conditions") or () if isinstance(c, Mapping)),
            suspended=bool((body.get("spec") or {}).get("suspend")),
            raw=body,
        )

    def changed_from(self, other: JobStatus | None) -> bool:
        """Whether a watcher should hear of this status: the phase, reason or progress changed."""
        return other is None or (self.phase, self.reason, self.progress, self.attempt) != (
            other.phase,
            other.reason,
            other.progress,
            other.attempt,
        )


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
