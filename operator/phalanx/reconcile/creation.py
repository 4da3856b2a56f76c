"""Which of the children a job should have are written in this pass.

An object that exists is applied again only when its spec hash differs from what was last applied.
A missing one is created unless its name is held by an object this job does not own, or the API
server refused it lately and its pause has not passed: then it is left out, the pass says why
(``blocked``, which becomes the ``Stalled`` condition) and comes back when the pause ends. Pods are
retried with a slow start, as the Job controller does: one probe when the job's last refusal's pause
has passed, then twice as many each time creations pass (``Observed.retry_batch``), so a blocked job
of hundreds of workers costs one request per pause, not hundreds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from phalanx.reconcile import naming
from phalanx.reconcile.actions import Actions
from phalanx.reconcile.observed import Observed, Refusal, child_kind

Object = dict[str, Any]
REFUSAL_RETRY_SECONDS = (2.0, 5.0, 10.0, 30.0, 60.0)
"""Pause before creating a refused child again, by how many times in a row it was refused."""


def refusal_retry_at(refusal: Refusal) -> datetime:
    """When a refused creation is tried again."""
    pause = REFUSAL_RETRY_SECONDS[min(refusal.attempts, len(REFUSAL_RETRY_SECONDS)) - 1]
    return refusal.last + timedelta(seconds=pause)


@dataclass(frozen=True)
class Wanted:
    """A child the job should have. ``create_only``: written only when missing (pods are never
    changed in place); otherwise applied again whenever its spec hash differs."""

    obj: Object
    create_only: bool = False


@dataclass(frozen=True)
class Writes:
    """What to write, what could not be created and why (reason, message), and when to look again."""

    apply: tuple[Object, ...] = ()
    blocked: tuple[tuple[str, str], ...] = ()
    requeue: tuple[float, ...] = ()

    @property
    def waits(self) -> Actions:
        """The requeues, as actions."""
        return Actions(requeue=self.requeue)


def writes(wanted: Iterable[Wanted], observed: Observed, job_uid: str, now: datetime) -> Writes:
    """The writes for ``wanted``, in its order (pods created first take the slow start's budget)."""
    apply: list[Object] = []
    blocked: list[tuple[str, str]] = []
    requeue: list[float] = []
    pod_budget: int | None = None  # pods this pass may still create (None: no limit)
    budget_known = False
    for item in wanted:
        obj = item.obj
        kind, name = child_kind(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"]
        record = None if item.create_only else observed.objects.get((kind, name))
        if record is not None:
            updating = observed.refusals.get((kind, name))
            if updating is not None:  # an update refused that never fails the job (the ranks' slices)
                blocked.append((updating.reason, f"updating {kind} {name}: {updating.message}"))
            if record.spec_hash != obj["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION]:
                apply.append(obj)
            continue
        if (kind, name) in observed.foreign:
            blocked.append(
                (
                    "NameConflict",
                    f"{kind} {name} exists but is not controlled by this TrainingJob (uid "
                    f"{job_uid}); it is left alone and the job waits until it is gone",
                )
            )
            continue
        refusal = observed.refusals.get((kind, name))
        if refusal is not None:
            # The refusal stands until a creation succeeds, so status does not flap at each retry.
            blocked.append((refusal.reason, f"creating {kind} {name}: {refusal.message}"))
        if kind == "Pod":
            if not budget_known:
                pod_budget, wait = first_pod_budget(observed, now)
                budget_known = True
                requeue.extend([wait] if wait is not None else [])
            if pod_budget is not None:
                if pod_budget <= 0:
                    continue
                pod_budget -= 1
            apply.append(obj)
            continue
        if refusal is not None:
            retry_at = refusal_retry_at(refusal)
            if retry_at > now and not refusal.retry_now:
                requeue.append((retry_at - now).total_seconds())
                continue
        apply.append(obj)
    return Writes(tuple(apply), tuple(blocked), tuple(requeue))


def first_pod_budget(observed: Observed, now: datetime) -> tuple[int | None, float | None]:
    """How many pods this pass may create, and when to come back if none. No limit while no pod of
    the job is refused. Else none until the pause after the job's latest refusal has passed (a pod
    leaving the namespace shortens it to the first pause), then ``retry_batch`` pods; a creation
    that passed since the latest refusal opens it at once."""
    refused = [refusal for (kind, _), refusal in observed.refusals.items() if kind == "Pod"]
    if not refused:
        return None, None
    batch = max(1, observed.retry_batch)
    if batch > 1:
        return batch, None
    latest = max(refused, key=lambda refusal: (refusal.last, refusal.attempts))
    retry_at = refusal_retry_at(latest)
    if latest.retry_now:
        retry_at = min(retry_at, latest.last + timedelta(seconds=REFUSAL_RETRY_SECONDS[0]))
    if retry_at > now:
        return 0, (retry_at - now).total_seconds()
    return batch, None
