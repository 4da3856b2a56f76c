"""``status.preemptionCost``: what an eviction of the job now would lose, and the Kueue priority
boost that follows from it (checkpoint-aware preemption).

Pure, like the rest of the planner: the value follows from the previous status, the phase this
pass decided, the workers still active and ``now``.

- ``lostSeconds``: training since the newest committed checkpoint (``status.lastCheckpoint``), or
  since the job last began training (the Running condition's transition) when that is later or
  there is no checkpoint: a restart resumes from the checkpoint, so everything after it is redone.
- ``restartSeconds``: measured, not configured: when the job enters training, the length of the
  state it leaves (``status.timeByState``: ``starting`` for a first start, the whole ``recovering``
  stretch of a restart, queue and backoff included), kept until the next entry. A first start's
  queue is left out (a job's first wait for quota says nothing about what a restart costs): a job
  that went from queued to training in one pass measures 0 until its first restart.
- cost = (lostSeconds + restartSeconds) x GPUs of the current world (``spec.gpus.count`` x active
  workers); a job without GPUs is weighed by its workers (``workerSeconds``).

Written at most once per ``WRITE_SECONDS`` and on ``status.progress``'s clock: a pass that writes
progress carries the cost with it, so a reporting job writes status no more often than its progress
alone would. A write for the cost alone is sent only where it acts: under Kueue (the boost follows
it) when neither field was written for ``WRITE_SECONDS``. Elsewhere a job that reports nothing has
its cost refreshed only by a status write made for another reason (``CostUpdate.rides``); its
``time`` says as of when. A newer checkpoint lowers the cost at once, in the pass that records it.
Only while the job trains (a job that does not train loses nothing to an
eviction, and the field is removed).

Under Kueue the cost sets the Workload's ``kueue.x-k8s.io/priority-boost`` annotation (Kueue
v0.17's alpha ``PriorityBoost`` gate): effective priority = priority + boost orders preemption
candidates, so a job that just saved (low cost, boost 0) is preempted before an equal job with an
hour of unsaved work. The boost is quantised to ``BOOST_LEVELS`` and changed at most once per
``BOOST_HOLD_SECONDS``, so the scheduler's ordering does not flap with every write.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile.observed import BOOST_ANNOTATION, QueuedWorkload
from phalanx.reconcile.pod_patches import PatchOperation, annotation, pointer
from phalanx.reconcile.status import TRAINING, format_time, parse_time
from phalanx.reconcile.training_progress import sample_time

WRITE_SECONDS = 10.0
"""At most one new cost per job per this many seconds."""
BOOST_HOLD_SECONDS = 60.0
"""A boost, once set, stands at least this long."""
BOOST_LEVELS: tuple[int, ...] = (60, 600, 3_600, 36_000)
"""Cost thresholds (GPU-seconds, or worker-seconds for a job without GPUs): a cost below the
first is boost 0, at least the first 1, ... at least the last ``len(BOOST_LEVELS)``. Roughly: a
minute, ten minutes, an hour, ten hours of one device's work. Boosts stay small so that a job of
a higher priority class (whose values are far apart, 100s or 1000s) still preempts any of them."""


def boost_for(cost: int) -> int:
    """The quantised boost of a cost: higher cost -> higher boost -> preempted later."""
    return sum(1 for threshold in BOOST_LEVELS if cost >= threshold)


def weight(cost: api.PreemptionCost) -> int:
    """What the boost is taken from: GPU-seconds, or worker-seconds for a job without GPUs."""
    return cost.gpu_seconds if cost.gpus > 0 else cost.worker_seconds


def _seconds(later: datetime, earlier: datetime | None) -> int:
    return max(0, int((later - earlier).total_seconds())) if earlier is not None else 0


def restart_seconds(previous: api.TrainingJobStatus, phase: api.Phase, now: datetime) -> int:
    """The measured restart time: on entering training, how long the state just left lasted."""
    kept = previous.preemption_cost.restart_seconds if previous.preemption_cost is not None else 0
    spent = previous.time_by_state
    entering = phase in TRAINING and previous.phase not in TRAINING
    if entering and spent is not None and spent.state in ("starting", "recovering"):
        return _seconds(now, parse_time(spent.since))
    return kept


def training_since(previous: api.TrainingJobStatus, now: datetime) -> datetime:
    """When the job last began training (now when it begins in this pass)."""
    if previous.phase not in TRAINING:
        return now
    running = next((c for c in previous.conditions or [] if c.type == "Running" and c.status == "True"), None)
    since = parse_time(running.last_transition_time) if running is not None else None
    return min(since, now) if since is not None else now


def current_cost(
    previous: api.TrainingJobStatus,
    phase: api.Phase,
    *,
    workers: int,
    gpus_per_worker: int,
    now: datetime,
    checkpoint: api.LastCheckpoint | None = None,
) -> api.PreemptionCost:
    """The cost as of ``now`` (boost fields carried over from the previous value); ``checkpoint``:
    a newer one than ``previous.last_checkpoint``, recorded by this pass."""
    began = training_since(previous, now)
    last = checkpoint or previous.last_checkpoint
    saved = parse_time(last.time) if last is not None else None
    lost = _seconds(now, max(began, saved) if saved is not None else began)
    restart = restart_seconds(previous, phase, now)
    gpus = gpus_per_worker * workers
    before = previous.preemption_cost
    return api.PreemptionCost(
        lost_seconds=lost,
        restart_seconds=restart,
        gpus=gpus,
        workers=workers,
        gpu_seconds=(lost + restart) * gpus,
        worker_seconds=(lost + restart) * workers,
        time=sample_time(now),  # to the millisecond: pacing is measured from it
        boost=before.boost if before is not None else None,
        boost_time=before.boost_time if before is not None else None,
    )


@dataclass(frozen=True)
class WorkloadBoost:
    """A guarded JSON patch of the job's Kueue Workload's priority-boost annotation. The Workload
    is Kueue's (the operator neither owns nor creates it): the patch tests its UID, and the old
    value when there is one, so a patch planned from a stale view changes nothing."""

    name: str
    uid: str
    boost: int
    old: str | None
    """The annotation's value the patch was planned from (None: absent)."""
    annotated: bool
    """Whether the Workload has annotations at all (JSON patch cannot add a key to a missing map)."""

    def body(self) -> list[dict[str, Any]]:
        """The request body: test the UID (and the old value), then write the new one."""
        path = annotation(BOOST_ANNOTATION)
        operations: list[dict[str, Any]] = [PatchOperation("test", pointer("metadata", "uid"), self.uid).as_json()]
        if self.old is not None:
            operations.append(PatchOperation("test", path, self.old).as_json())
            operations.append(PatchOperation("replace", path, str(self.boost)).as_json())
        elif self.annotated:
            operations.append(PatchOperation("add", path, str(self.boost)).as_json())
        else:
            operations.append(
                {"op": "add", "path": pointer("metadata", "annotations"), "value": {BOOST_ANNOTATION: str(self.boost)}}
            )
        return operations


def boost_patch(workload: QueuedWorkload, boost: int) -> WorkloadBoost:
    """The patch that sets ``workload``'s boost to ``boost``."""
    return WorkloadBoost(workload.name, workload.uid, boost, workload.boost_text, workload.annotated)


@dataclass(frozen=True)
class CostUpdate:
    """What a pass does with ``status.preemptionCost``."""

    write: bool
    """Whether the pass writes the field (``value``; None removes it)."""
    value: dict[str, Any] | None = None
    boost: WorkloadBoost | None = None
    """The Workload patch to send after the status write (None: none)."""
    due: float | None = None
    """Seconds until the field is due again (None: no wish to come back; only a job under Kueue
    asks, as its boost must follow the cost)."""
    rides: bool = False
    """A refresh that acts on nothing (no Kueue, no progress written): written only with a status
    write this pass makes anyway, never alone."""


def preemption_cost(
    previous: api.TrainingJobStatus,
    phase: api.Phase,
    *,
    workers: int,
    gpus_per_worker: int,
    workload: QueuedWorkload | None,
    progress_written: bool,
    progress_time: datetime | None,
    now: datetime,
    checkpoint: api.LastCheckpoint | None = None,
) -> CostUpdate:
    """What to do with ``status.preemptionCost`` in this pass.

    ``progress_written``: this pass writes ``status.progress`` (the cost rides along);
    ``progress_time``: when progress was last written (the shared clock), None if never;
    ``checkpoint``: a newer checkpoint this pass records: the cost falls now, not on the next
    tick of the clock (under Kueue the job that just saved must be the first candidate at once)."""
    before = previous.preemption_cost
    if phase not in TRAINING:
        return CostUpdate(write=before is not None)
    written = parse_time(before.time) if before is not None and before.time else None
    if progress_time is not None and (written is None or progress_time > written):
        written = progress_time
    refresh = before is not None and previous.phase in TRAINING and not progress_written and checkpoint is None
    if refresh and written is not None:
        due = written + timedelta(seconds=WRITE_SECONDS)
        if now < due:
            return CostUpdate(write=False, due=(due - now).total_seconds() if workload is not None else None)
    cost = current_cost(
        previous, phase, workers=workers, gpus_per_worker=gpus_per_worker, now=now, checkpoint=checkpoint
    )
    patch = None
    if workload is not None and workload.uid:
        wanted = boost_for(weight(cost))
        held = parse_time(cost.boost_time) if cost.boost_time else None
        free = held is None or now >= held + timedelta(seconds=BOOST_HOLD_SECONDS)
        if workload.boost != wanted and free:
            patch = boost_patch(workload, wanted)
            cost = cost.model_copy(update={"boost": wanted, "boost_time": format_time(now)})
        elif workload.boost == wanted and cost.boost != wanted:
            cost = cost.model_copy(update={"boost": wanted})  # set by an earlier pass whose status write was lost
    body = cost.model_dump(by_alias=True, exclude_none=True)
    if before is not None:  # a merge patch: fields the new value lacks are removed by null
        body = {**dict.fromkeys(before.model_dump(by_alias=True, exclude_none=True)), **body}
    return CostUpdate(
        write=True,
        value=body,
        boost=patch,
        due=WRITE_SECONDS if workload is not None else None,
        rides=refresh and workload is None,
    )
