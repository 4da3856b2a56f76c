"""What a planning decision asks of the cluster besides objects to apply: deletions, pods moved to a
new attempt in place, Events, and when to look again. Values only; decisions return them and the
planner adds them up in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
class Move:
    """A worker pod kept through an in-place gang restart, moved to the new attempt: its attempt
    label and rendezvous id change (only while it is still the pod, at the attempt, planned from),
    and its supervisor restarts the training processes. With ``index``, a warm spare promoted into
    that slot (only while it is still a spare): its role and slot change too, and its supervisor
    starts the command."""

    name: str
    uid: str
    from_attempt: int
    to_attempt: int
    rendezvous_id: str
    index: int | None = None


@dataclass(frozen=True)
class Address:
    """The name a supervised worker's torchrun agent gives the rendezvous as its address
    (``phalanx.dev/rank-address``), set only while the pod is that pod (UID) at that attempt: the
    rendezvous numbers its agents in the sort order of these names (``topology.rank_addresses``)."""

    name: str
    uid: str
    attempt: int
    address: str


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to record on the TrainingJob."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Actions:
    """Deletions, moves, Events and requeue delays, in the order they were decided."""

    delete: tuple[Deletion, ...] = ()
    events: tuple[Event, ...] = ()
    requeue: tuple[float, ...] = ()
    move: tuple[Move, ...] = ()
    address: tuple[Address, ...] = ()

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
