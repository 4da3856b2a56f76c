"""The value one planning pass threads through its stages (``decide.STAGES``): each stage takes the
draft and returns a changed one for the next, or the pass's ``Decision``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from phalanx.api import v1alpha1 as api
from phalanx.reconcile.actions import NOTHING, Actions
from phalanx.reconcile.creation import Wanted
from phalanx.reconcile.desired import JobChildren
from phalanx.reconcile.environment import Launch
from phalanx.reconcile.observed import Observed, PodRecord
from phalanx.reconcile.pass_values import Context, Decision, Memory, Stall
from phalanx.reconcile.phase import Scaling


@dataclass(frozen=True)
class Draft:
    """What the stages decided so far: the remembered state, the actions, and what the later stages
    plan with (each field set by the stage named beside it)."""

    context: Context
    memory: Memory
    actions: Actions = NOTHING
    resolved: Launch | None = None
    """How the workers are launched (``unplannable_spec``); None before."""
    refusal: str = ""
    """Why the spec can no longer have spares, which the job trains on without (``unplannable_spec``)."""
    built: JobChildren | None = None
    """The job's children besides its workers, as they should be now (``job_objects``)."""
    current: tuple[PodRecord, ...] = ()
    """The workers of the current attempt, one per slot (``nodes_and_stale_pods``)."""
    stale: tuple[PodRecord, ...] = ()
    """The workers of other attempts (``nodes_and_stale_pods``)."""
    moving: tuple[PodRecord, ...] = ()
    """Stale workers an in-place gang restart keeps, to move to the attempt (``nodes_and_stale_pods``)."""
    stall: Stall | None = None
    """Why the job is stalled, as the failures said (``failures_and_hangs``)."""
    wanted: tuple[Wanted, ...] = ()
    """The objects to write (``desired_objects`` on)."""
    devices_missing: bool = False
    """The claim template is wanted but not there (``desired_objects``)."""
    scaled: Scaling | None = None
    """The slots filled and emptied, once the store exists (``desired_shape``)."""

    @classmethod
    def of(cls, job: api.TrainingJob, observed: Observed, now: datetime) -> Draft:
        """The draft a pass starts from: the job's remembered state, nothing decided."""
        return cls(Context(job, observed, now), Memory.of(job.status))

    @property
    def launch(self) -> Launch:
        """How the workers are launched, for the stages after ``unplannable_spec``."""
        assert self.resolved is not None, "unplannable_spec resolves the launch"
        return self.resolved

    @property
    def children(self) -> JobChildren:
        """The job's children besides its workers, for the stages after ``job_objects``."""
        assert self.built is not None, "job_objects builds the children"
        return self.built


Stage = Callable[[Draft], "Draft | Decision"]
"""One stage: a changed draft for the next stage, or the decision that ends the pass."""
