"""The values one planning pass works with: what it remembers (``Memory``), what it plans from
(``Context``), one decision (``Step``) and the whole pass's (``Decision``), and the end of a job,
which several decisions reach."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from phalanx.api import v1alpha1 as api
from phalanx.reconcile.actions import NOTHING, Actions, Deletion, event, requeue
from phalanx.reconcile.failures import Failure
from phalanx.reconcile.observed import Observed, PodRecord, WorkerProgress
from phalanx.reconcile.status import PhaseView, parse_time, stored_time

Object = dict[str, Any]
Stall = tuple[str, str]
"""The ``Stalled`` condition's reason and message."""
SUCCESS_GRACE_SECONDS = 60


@dataclass(frozen=True)
class Avoidance:
    """A node the job's new pods keep off until ``until`` (status.avoidedNodes)."""

    node: str
    reason: str
    message: str
    until: datetime


@dataclass(frozen=True)
class GroupState:
    """One replica group's restarts alone (status.replicaGroups; ``replica_groups``)."""

    index: int
    generation: int = 0
    restarts: int = 0


@dataclass(frozen=True)
class SlotClaim:
    """Slot ``index`` of ``attempt`` is the promoted spare ``pod``'s (UID ``uid``; status.slotClaims,
    ``slots``)."""

    index: int
    pod: str
    uid: str
    attempt: int


@dataclass(frozen=True)
class Memory:
    """The part of status that carries over between passes; its times are parsed once, here
    (``of``), and formatted only where status is rendered (``plan``)."""

    attempt: int
    restarts: int
    by_reason: tuple[tuple[str, int], ...]
    counted: frozenset[str]
    start_time: datetime | None
    completion_time: datetime | None
    restart_not_before: datetime | None
    avoided: tuple[Avoidance, ...] = ()
    recomputed: int = 0
    """Steps computed again after restarts (status.recomputedSteps.total)."""
    reached: int | None = None
    """The step the job had reached when a restart was decided, until its new run reports."""
    failed_at: datetime | None = None
    domain: str | None = None
    """The topology domain the workers are placed in (status.placement.domain; ``topology.place``)."""
    removed: frozenset[str] = frozenset()
    """UIDs of workers of the attempt the operator deleted itself (status.removedWorkers)."""
    claims: tuple[SlotClaim, ...] = ()
    """Slots promoted spares hold (status.slotClaims; ``slots``)."""
    groups: tuple[GroupState, ...] = ()
    """Replica groups restarted alone (status.replicaGroups; ``replica_groups``); absent: generation 0."""

    @classmethod
    def of(cls, status: api.TrainingJobStatus) -> Memory:
        return cls(
            attempt=status.attempt,
            restarts=status.restarts,
            by_reason=tuple(sorted((status.restarts_by_reason or {}).items())),
            counted=frozenset(status.counted_failures or ()),
            start_time=parse_time(status.start_time),
            completion_time=parse_time(status.completion_time),
            restart_not_before=parse_time(status.restart_not_before),
            avoided=tuple(
                Avoidance(entry.node, entry.reason, entry.message, until)
                for entry in status.avoided_nodes or ()
                if (until := parse_time(entry.until)) is not None
            ),
            recomputed=status.recomputed_steps.total if status.recomputed_steps else 0,
            reached=status.recomputed_steps.reached if status.recomputed_steps else None,
            failed_at=parse_time(status.recomputed_steps.failed_at) if status.recomputed_steps else None,
            domain=status.placement.domain if status.placement else None,
            removed=frozenset(status.removed_workers or ()),
            claims=tuple(
                SlotClaim(claim.index, claim.pod, claim.uid, claim.attempt) for claim in status.slot_claims or ()
            ),
            groups=tuple(
                GroupState(group.index, group.generation, group.restarts) for group in status.replica_groups or ()
            ),
        )

    def counting(self, failure: Failure, pods: Iterable[PodRecord]) -> Memory:
        """One failure event recorded (once: the UIDs of all its pods go into status in the same write)."""
        by_reason = dict(self.by_reason)
        by_reason[failure.reason] = by_reason.get(failure.reason, 0) + 1
        return replace(
            self,
            restarts=self.restarts + (1 if failure.counted else 0),
            by_reason=tuple(sorted(by_reason.items())),
            counted=self.counted | {pod.uid for pod in pods if pod.uid},
        )

    def already_counted(self, pod: PodRecord) -> bool:
        return bool(pod.uid) and pod.uid in self.counted

    def removing(self, pods: Iterable[PodRecord]) -> Memory:
        """Workers the operator deletes itself, recorded (in the status write that comes before
        the deletions): their going is no loss (``removed_itself``)."""
        return replace(self, removed=self.removed | {pod.uid for pod in pods if pod.uid})

    def removed_itself(self, pod: PodRecord) -> bool:
        """Whether the operator deleted this pod itself, not someone else."""
        return bool(pod.uid) and pod.uid in self.removed

    def restarting_from(self, progress: WorkerProgress | None, now: datetime) -> Memory:
        """A restart is decided: remember the step the job had reached (the reporter's, as last
        scraped) until the new run says where it resumed. A restart before the last one's run
        reported keeps the first's step: the new run resumes behind both."""
        if self.reached is not None or progress is None or progress.step is None:
            return self
        return replace(self, reached=progress.step, failed_at=stored_time(now))

    def resumed(self, progress: WorkerProgress | None) -> Memory:
        """The first run that began after the restart reports: its steps from where it resumed to
        the step reached are computed again, and counted once."""
        if self.reached is None or progress is None or progress.run_started is None or progress.resumed_step is None:
            return self
        if self.failed_at is not None and progress.run_started <= self.failed_at:
            return self  # the run that failed, or an older one
        lost = max(0, self.reached - progress.resumed_step)
        return replace(self, recomputed=self.recomputed + lost, reached=None, failed_at=None)

    @property
    def avoided_nodes(self) -> tuple[str, ...]:
        return tuple(entry.node for entry in self.avoided)

    def avoiding(self, entry: Avoidance) -> Memory:
        """``entry``'s node avoided until its time; a node already avoided keeps its entry (a pod
        deleted for its node is seen on every pass until it is gone, and must not push it back)."""
        held = {one.node: one for one in self.avoided}
        held.setdefault(entry.node, entry)
        return replace(self, avoided=tuple(held[node] for node in sorted(held)))

    def avoiding_until(self, now: datetime) -> Memory:
        """Without the nodes whose time has passed."""
        moment = stored_time(now)  # as the string comparison it replaces: whole seconds
        return replace(self, avoided=tuple(entry for entry in self.avoided if entry.until > moment))


@dataclass(frozen=True)
class Context:
    """What one pass plans from: the job, what is observed of its children, and the time."""

    job: api.TrainingJob
    observed: Observed
    now: datetime
    in_place: bool = False
    """The job's command runs phalanx-supervise: gang restarts keep healthy pods (``keeps``)."""

    @property
    def spec(self) -> api.TrainingJobSpec:
        return self.job.spec

    def keeps(self, pod: PodRecord, memory: Memory) -> bool:
        """Whether a gang restart keeps this worker pod and restarts its processes in place: the job
        restarts in place (``in_place``) and the pod is ``fit`` to go on."""
        return self.in_place and self.fit(pod, memory)

    def fit(self, pod: PodRecord, memory: Memory) -> bool:
        """Whether a pod may go on into a new world (kept through a gang restart, or a spare promoted
        into a slot): it runs the supervisor (it has the pod-info files) and runs (its trainer container
        has not exited, it is not being deleted or evicted, no failure of it was counted) on a node that
        is Ready and that the job does not avoid."""
        return self._runs(pod, memory) and pod.node_name not in self.observed.unready_nodes

    def still_keeps(self, pod: PodRecord, memory: Memory) -> bool:
        """Whether a pod a gang restart kept stays kept while it waits to be moved (the backoff, an
        old store stopping): as ``keeps``, but a node that is not Ready loses it only once it is
        taken for lost (``node_lost``), as for any pod of the attempt: a blip must not delete it."""
        return self.in_place and self._runs(pod, memory)

    def _runs(self, pod: PodRecord, memory: Memory) -> bool:
        node = pod.node_name
        return (
            pod.rendezvous_id is not None
            and pod.phase == "Running"
            and pod.active
            and pod.exit_code is None
            and pod.disruption_reason is None
            and not memory.already_counted(pod)
            and node is not None
            and self.node_lost(pod) is None
            and node not in memory.avoided_nodes
        )

    def avoided_nodes(self, memory: Memory) -> tuple[str, ...]:
        """The nodes new pods keep off: the job's own (failurePolicy.avoidNodeSeconds) and those the
        cluster-wide node ledger avoids (``node_ledger``)."""
        if not self.observed.ledger_avoided:
            return memory.avoided_nodes
        return tuple(sorted({*memory.avoided_nodes, *self.observed.ledger_avoided}))

    def node_lost(self, pod: PodRecord) -> str | None:
        """Why the pod's node is taken for lost, or None: it was deleted, or it has not been Ready
        for the whole grace. A shorter blip changes nothing (``watch_nodes``)."""
        node, loss = pod.node_name, self.observed.node_loss
        if node is None:
            return None
        if node in loss.deleted:
            return "was deleted"
        if node not in self.observed.unready_nodes:
            return None
        unready = (self.now - loss.unready_since.get(node, self.now)).total_seconds()
        if unready < loss.grace_seconds:
            return None
        return f"has not been ready for {int(unready)}s (node-lost grace {int(loss.grace_seconds)}s)"

    def may_force_delete(self, pod: PodRecord) -> bool:
        """Whether no container of the pod can run any more, or the operator may act as if: its node
        object is gone, or the node is lost and the operator was told to force (otherwise two agents
        could train in one slot and both write checkpoints)."""
        loss = self.observed.node_loss
        return pod.node_name in loss.deleted or (loss.force_delete and self.node_lost(pod) is not None)

    def removing(self, pods: Iterable[PodRecord]) -> Actions:
        """Delete pods; force those that finished or that no kubelet can confirm
        (``may_force_delete``); a pod already being deleted is left to finish unless forced."""
        deletions: list[Deletion] = []
        for pod in pods:
            force = self.may_force_delete(pod)
            if pod.deleting and not force:
                continue
            deletions.append(Deletion("Pod", pod.name, 0 if (pod.finished or force) else None))
        return Actions(delete=tuple(deletions))

    def removing_active(self, *, keep_finished: bool = True) -> Actions:
        """Stop every running pod of the job (workers and store)."""
        return self.removing(
            pod for pod in self.observed.pods if pod.active or (not keep_finished and not pod.deleting)
        )


@dataclass(frozen=True)
class Step:
    """One decision: the remembered state after it, what it asks for, and the phase when it ends
    the pass (``view``; None: the next decision goes on)."""

    memory: Memory
    actions: Actions = NOTHING
    view: PhaseView | None = None
    stall: Stall | None = None


@dataclass(frozen=True)
class Decision:
    """What one pass decided: the phase, the state to remember, the writes and what else to do."""

    view: PhaseView
    memory: Memory
    actions: Actions = NOTHING
    apply: tuple[Object, ...] = ()
    stall: Stall | None = None
    delete_job: bool = False
    rescaled: Literal["up", "down"] | None = None
    restart_mode: Literal["InPlace", "Recreate"] | None = None
    """How the job's gang restarts (status.restartMode); None: as it was (a finished job, a spec
    that cannot be planned)."""


def concluded(actions: Actions, step: Step) -> Decision:
    """The decision of a step that ends the pass, after the actions decided before it."""
    assert step.view is not None
    return Decision(step.view, step.memory, actions + step.actions, stall=step.stall)


def finish(context: Context, memory: Memory, phase: Literal["Succeeded", "Failed"], reason: str, message: str) -> Step:
    """The job ends: after success the other workers get a grace to finish; after failure every
    running pod is stopped."""
    # a restart whose run never comes recomputes nothing
    memory = replace(
        memory,
        completion_time=stored_time(context.now),
        restart_not_before=None,
        reached=None,
        failed_at=None,
        claims=(),
    )
    stop = wind_down(context, context.now) if phase == "Succeeded" else context.removing_active()
    kind: Literal["Normal", "Warning"] = "Normal" if phase == "Succeeded" else "Warning"
    return Step(memory, stop + event(kind, reason, message), PhaseView(phase, reason, message))


def wind_down(context: Context, completed: datetime) -> Actions:
    """After success the other workers are finishing too (and may still need the store for
    torchrun's shutdown): give them a grace period before stopping what still runs."""
    remaining = (completed + timedelta(seconds=SUCCESS_GRACE_SECONDS) - context.now).total_seconds()
    if remaining > 0 and any(pod.active for pod in context.observed.workers()):
        return requeue(remaining) + context.removing(pod for pod in context.observed.spares() if pod.active)
    return context.removing_active()
