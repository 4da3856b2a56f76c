"""What a planning decision asks of the cluster besides objects to apply: deletions, patches of
pods it keeps (``pod_patches``: moved to a new attempt in place, promoted, given a rank address),
Events, and when to look again. Values only; decisions return them and the planner adds them up in
order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from phalanx.reconcile.pod_patches import PodPatch


@dataclass(frozen=True)
class Deletion:
    """A child to delete; ``grace_seconds=0`` force-deletes a pod that has finished or that no
    kubelet can stop any more (``decide.Context.removal``). Only the object observed goes: the
    request carries its UID as a precondition."""

    kind: str
    name: str
    grace_seconds: int | None = None
    api_version: str = "v1"


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to record on the TrainingJob."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Actions:
    """Deletions, Events, requeue delays and pod patches, in the order they were decided: ``move``
    moves kept pods to a new attempt and promotes spares, ``address`` gives workers their rank
    addresses (sent after the objects, so the names resolve first)."""

    delete: tuple[Deletion, ...] = ()
    events: tuple[Event, ...] = ()
    requeue: tuple[float, ...] = ()
    move: tuple[PodPatch, ...] = ()
    address: tuple[PodPatch, ...] = ()

    def __add__(self, other: Actions) -> Actions:
        return Actions(
            self.delete + other.delete,
            self.events + other.events,
            self.requeue + other.requeue,
            self.move + other.move,
            self.address + other.address,
        )


NOTHING = Actions()


def event(kind: Literal["Normal", "Warning"], reason: str, message: str) -> Actions:
    return Actions(events=(Event(kind, reason, message),))


def requeue(seconds: float) -> Actions:
    return Actions(requeue=(seconds,))
