"""``status.progress``: rank 0's progress report, its percent and the time left.

Pure, like the rest of the planner: the next value follows from the report the store served
(``Observed.reported``), the previous status and ``now``. What the ETA needs across passes (and
operator restarts) lives in the status itself: ``samples``, the step as the operator wrote it at
each of its last few writes of the field, on the operator's clock (rank 0's clock says when it
reported, never how fast: a pod's clock may be off).

Pacing: a new report is written at most once per ``WRITE_SECONDS`` per job (the newest one, when
the time comes, with a requeue so a held report is never lost); a pass that writes the status for
a decision (a phase change) carries the newest at once. A report that names another job never
counts. A report of an earlier attempt does: after a gang restart it is the job's last known
progress until the new attempt reports; a step that goes back (a restart from a checkpoint) or a
new attempt begins a new rate window.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile.observed import ReportedProgress
from phalanx.reconcile.status import TRAINING, format_time, human_duration, parse_time

WRITE_SECONDS = 10.0
"""At most one status write per job per this many seconds for a new report."""
WINDOW = 8
"""Samples the rate is taken over (at least ``WRITE_SECONDS`` apart)."""
STALLED_SECONDS = 120.0
"""No ETA once the step has not moved for this long, or for three times the window's mean gap
between samples, whichever is longer."""
REPORT_FIELDS = ("attempt", "step", "totalSteps", "time", "metrics")


def reported_fields(report: ReportedProgress) -> dict[str, Any]:
    """The report as ``status.progress`` holds it."""
    fields: dict[str, Any] = {"attempt": report.attempt, "step": report.step, "time": format_time(report.time)}
    if report.total_steps is not None:
        fields["totalSteps"] = report.total_steps
    if report.metrics:
        fields["metrics"] = [
            {"name": m.name, "value": m.value, "step": m.step, "time": format_time(m.time)} for m in report.metrics
        ]
    return fields


def sample_time(moment: datetime) -> str:
    """RFC 3339 in UTC to the millisecond: the pacing is measured from it, and a time cut to the
    second would let two writes come less than ``WRITE_SECONDS`` apart."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def sample_moment(text: object) -> datetime | None:
    """A sample's time as written, or None for one that cannot be read (a new window begins)."""
    try:
        moment = parse_time(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return moment if moment is not None and moment.tzinfo is not None else None


def next_samples(
    samples: list[dict[str, Any]], fields: dict[str, Any], previous_attempt: int | None, now: datetime
) -> list[dict[str, Any]]:
    """The window with this write's sample: a new one after a step that went back or a new attempt."""
    if samples and (
        fields["step"] < samples[-1]["step"]
        or fields["attempt"] != previous_attempt
        or any(sample_moment(sample["time"]) is None for sample in samples)
    ):
        samples = []
    return [*samples, {"step": fields["step"], "time": sample_time(now)}][-WINDOW:]


def eta_seconds(samples: list[dict[str, Any]], total: int | None, now: datetime) -> tuple[int | None, datetime | None]:
    """Seconds left at the window's rate (None: unknown), and when the step will count as stalled
    (when to look again; None: no ETA to take back)."""
    if total is None or len(samples) < 2:
        return None, None
    times = [sample_moment(sample["time"]) for sample in samples]
    first, last = times[0], times[-1]
    if first is None or last is None or last <= first:
        return None, None
    steps = samples[-1]["step"] - samples[0]["step"]
    if steps <= 0:
        return None, None
    span = (last - first).total_seconds()
    # since when the step stands where it is: the first sample of the window at the last value
    moved = next((t for s, t in zip(samples, times, strict=True) if s["step"] == samples[-1]["step"]), None)
    if moved is None:
        return None, None
    stalled = moved + timedelta(seconds=max(STALLED_SECONDS, 3 * span / (len(samples) - 1)))
    if now >= stalled:
        return None, None
    left = max(0, total - samples[-1]["step"])
    return round(left * span / steps), stalled


def summary(progress: dict[str, Any]) -> str:
    """What kubectl get shows: ``42% 1h3m left``, ``42%`` or ``step 1200``."""
    percent, eta = progress.get("percent"), progress.get("etaSeconds")
    if percent is None:
        return f"step {progress['step']}"
    return f"{percent}% {human_duration(eta)} left" if eta is not None else f"{percent}%"


def derived(
    fields: dict[str, Any], samples: list[dict[str, Any]], phase: api.Phase, now: datetime
) -> tuple[dict[str, Any], datetime | None]:
    """The whole ``status.progress`` for a report and its window, and when to look again."""
    progress = {**fields, "samples": samples}
    total = fields.get("totalSteps")
    recheck = None
    if total:
        progress["percent"] = 100 if phase == "Succeeded" else min(100, fields["step"] * 100 // total)
        if phase in TRAINING:
            eta, recheck = eta_seconds(samples, total, now)
            if eta is not None:
                progress["etaSeconds"] = eta
    progress["summary"] = summary(progress)
    return progress, recheck


def last_written(previous: api.TrainingJobStatus) -> datetime | None:
    """When ``status.progress`` was last written (its newest sample): the clock its pacing, and
    ``status.preemptionCost``'s, run on. None: never written."""
    samples = previous.progress.samples if previous.progress is not None else None
    return sample_moment(samples[-1].time) if samples else None


def training_progress(
    previous: api.TrainingJobStatus,
    reported: ReportedProgress | None,
    *,
    job_uid: str,
    phase: api.Phase,
    now: datetime,
) -> tuple[dict[str, Any] | None, float | None]:
    """The ``status.progress`` to write (None: keep the one there) and the seconds until this
    field wants another pass (a held report, an ETA to take back when the step stalls)."""
    before = previous.progress.model_dump(by_alias=True, exclude_none=True) if previous.progress else None
    fresh = reported_fields(reported) if reported is not None and reported.job_uid == job_uid else None
    if fresh is not None and before is not None and all(fresh.get(k) == before.get(k) for k in REPORT_FIELDS):
        fresh = None  # nothing new
    samples: list[dict[str, Any]] = list(before.get("samples") or []) if before else []
    wait = None
    written = sample_moment(samples[-1]["time"]) if samples else None
    if fresh is not None and written is not None and phase == previous.phase:
        due = written + timedelta(seconds=WRITE_SECONDS)
        if now < due:  # paced: the newest report goes out when due
            fresh, wait = None, (due - now).total_seconds()
    if fresh is not None:
        samples = next_samples(samples, fresh, before.get("attempt") if before else None, now)
        fields = fresh
    elif before is not None:
        fields = {k: before[k] for k in REPORT_FIELDS if k in before}
    else:
        return None, wait
    progress, recheck = derived(fields, samples, phase, now)
    if recheck is not None:
        again = max(0.0, (recheck - now).total_seconds())
        wait = again if wait is None else min(wait, again)
    if progress == before:
        return None, wait
    # a merge patch: a field the new value lacks (an ETA taken back) is removed by null
    return {**dict.fromkeys(before or {}), **progress}, wait
