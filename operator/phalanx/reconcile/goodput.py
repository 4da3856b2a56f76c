"""Where a job's wall time went: queued, starting, training, recovering (by cause), suspended.

The state follows the phase a pass decides. Time is added to a state's count when the job leaves it,
in the same status write that records the new state, computed from the previous status and ``now``:
so it is counted once whatever happens to the operator, and a pass planned from a stale status is
refused (the write is conditional) instead of counting again. Recovery begins with a gang restart
(phase Restarting, whose reason is the cause) and lasts until the job trains again, through the
backoff, the old pods stopping and the new ones queued and starting.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile.observed import WorkerProgress
from phalanx.reconcile.pass_values import Memory
from phalanx.reconcile.preemption_cost import current_cost
from phalanx.reconcile.status import TERMINAL, TRAINING, PhaseView, format_time, parse_time

STATES: tuple[api.JobState, ...] = ("queued", "starting", "training", "recovering", "suspended")


def state_of(view: PhaseView, previous: api.TimeByState | None) -> tuple[api.JobState | None, str | None]:
    """The job's state and, while recovering, the cause: None once it ended."""
    recovering = previous is not None and previous.state == "recovering"
    cause = previous.cause if previous is not None and recovering else None
    if view.phase in TERMINAL:
        return None, None
    if view.phase == "Suspended":
        return "suspended", None
    if view.phase in TRAINING:
        return "training", None
    if view.phase == "Restarting":
        return "recovering", cause or view.reason
    if recovering:
        return "recovering", cause  # the new attempt queued or starting: still the restart's cost
    return ("starting" if view.phase == "Starting" else "queued"), None


def time_by_state(
    previous: api.TimeByState | None, view: PhaseView, created: str | None, now: datetime
) -> dict[str, Any] | None:
    """``status.timeByState`` after a pass whose phase is ``view``. The first state begins at
    ``created`` (a new job was queued before the operator's first pass), else now."""
    state, cause = state_of(view, previous)
    if previous is None or previous.since is None:
        if state is None:
            return None
        since = parse_time(created) or now
        return _render(previous or api.TimeByState(), state, cause, format_time(min(since, now)))
    if (state, cause) == (previous.state, previous.cause):
        return None  # nothing changed: status keeps what it has
    began = parse_time(previous.since) or now
    spent = max(0, int((now - began).total_seconds()))
    counts = previous.model_dump(by_alias=False)
    by_cause = dict(previous.recovering_by_cause or {})
    if previous.state is not None:
        counts[previous.state] += spent
        if previous.state == "recovering" and previous.cause:
            by_cause[previous.cause] = by_cause.get(previous.cause, 0) + spent
    totals: dict[str, Any] = {key: counts[key] for key in STATES}
    ended = api.TimeByState(**totals, recovering_by_cause=by_cause or None)
    return _render(ended, state, cause, format_time(now) if state is not None else None)


def _render(
    counts: api.TimeByState, state: api.JobState | None, cause: str | None, since: str | None
) -> dict[str, Any]:
    body = counts.model_dump(by_alias=True, exclude_none=True)
    body.update(state=state, cause=cause, since=since)  # None removes a key (merge patch)
    return body


def seconds_by_state(counts: api.TimeByState, now: datetime) -> dict[tuple[str, str], float]:
    """(state, cause) -> seconds up to ``now``, the current state's running time included; cause is
    "" but for recovering."""
    seconds: dict[tuple[str, str], float] = {(state, ""): float(getattr(counts, state)) for state in STATES}
    del seconds[("recovering", "")]
    for cause, spent in (counts.recovering_by_cause or {}).items():
        seconds[("recovering", cause)] = float(spent)
    accounted = sum(counts.recovering_by_cause.values()) if counts.recovering_by_cause else 0
    if counts.recovering > accounted:  # time from before causes were recorded
        seconds[("recovering", "")] = float(counts.recovering - accounted)
    began = parse_time(counts.since)
    if counts.state is not None and began is not None:
        key = (counts.state, counts.cause or "" if counts.state == "recovering" else "")
        seconds[key] = seconds.get(key, 0.0) + max(0.0, (now - began).total_seconds())
    return seconds


def effective_training_ratio(counts: api.TimeByState, now: datetime) -> float:
    """Training time over the job's time so far, suspension left out (0..1)."""
    seconds = seconds_by_state(counts, now)
    total = sum(spent for (state, _), spent in seconds.items() if state != "suspended")
    return min(1.0, seconds.get(("training", ""), 0.0) / total) if total > 0 else 0.0


NOTICE_REASONS = frozenset({"Evicted", "Preempted"})
"""Restart reasons of stops that come with a notice: SIGTERM and the pod's termination grace, in
which every rank saves the step it reached (``worker.session``); never counted against the budget."""


def notice_savings(
    previous: api.TrainingJobStatus,
    memory: Memory,
    progress: WorkerProgress | None,
    *,
    gpus_per_worker: int,
    now: datetime,
) -> dict[str, Any] | None:
    """The next ``status.noticeSavings`` (None: the one there stands). A stop by a notice is seen
    where a restart is decided (``Memory.restarting_from`` sets ``reached``) with a notice's reason
    among the reasons it records; what its save would keep is set aside then, and credited when the
    new run reports (``Memory.resumed`` clears ``reached``) having resumed past the checkpoint there
    was at the notice. Both happen in the conditional status write of that pass, so a stop is
    credited once, however many passes see it."""
    before = previous.notice_savings
    savings = before or api.NoticeSavings()
    was_reached = previous.recomputed_steps.reached if previous.recomputed_steps is not None else None
    recorded = previous.restarts_by_reason or {}
    now_by_reason = dict(memory.by_reason)
    if was_reached is None and memory.reached is not None:
        if any(now_by_reason.get(reason, 0) > recorded.get(reason, 0) for reason in NOTICE_REASONS):
            workers = previous.workers.active if previous.workers is not None else 0
            cost = current_cost(
                previous, previous.phase or "Running", workers=workers, gpus_per_worker=gpus_per_worker, now=now
            )
            last = previous.last_checkpoint
            savings = savings.model_copy(
                update={
                    "pending_gpu_seconds": cost.lost_seconds * cost.gpus,
                    "pending_worker_seconds": cost.lost_seconds * cost.workers,
                    "pending_after_step": last.step if last is not None else 0,
                }
            )
    elif memory.reached is None and savings.pending_gpu_seconds is not None:
        resumed = progress.resumed_step if progress is not None else None
        after = savings.pending_after_step or 0
        if was_reached is not None and resumed is not None and resumed > after:
            savings = savings.model_copy(
                update={
                    "stops": savings.stops + 1,
                    "gpu_seconds": savings.gpu_seconds + savings.pending_gpu_seconds,
                    "worker_seconds": savings.worker_seconds + (savings.pending_worker_seconds or 0),
                }
            )
        savings = savings.model_copy(
            update={"pending_gpu_seconds": None, "pending_worker_seconds": None, "pending_after_step": None}
        )
    if savings == (before or api.NoticeSavings()):
        return None
    body = savings.model_dump(by_alias=True, exclude_none=True)
    if before is not None:  # a merge patch: fields the new value lacks are removed by null
        body = {**dict.fromkeys(before.model_dump(by_alias=True, exclude_none=True)), **body}
    return body
