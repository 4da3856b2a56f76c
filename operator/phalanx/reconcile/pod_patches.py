"""The patches the planner sends to pods it keeps, as data: JSON patches (RFC 6902) whose ``test``
operations make each apply only to the pod it was planned for (its UID, at its attempt, a spare
while it is one), so a repeated patch, or one planned from a view the pod has left, changes nothing.

Four patches exist: moving a pod an in-place gang restart keeps to the new attempt, promoting a
warm spare into a slot, giving a supervised worker its rank address, and carrying a save-now token
onto a running worker (``reconcile.save_now``). The API server receives
``PodPatch.body()`` as it is; the client knows nothing of phalanx's labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from phalanx.reconcile import naming

JsonValue = str | int | bool | None


@dataclass(frozen=True)
class PatchOperation:
    """One operation of a JSON patch; ``test`` fails the whole patch unless ``path`` holds ``value``."""

    op: Literal["add", "remove", "replace", "test"]
    path: str
    value: JsonValue = None

    def as_json(self) -> dict[str, Any]:
        if self.op == "remove":
            return {"op": self.op, "path": self.path}
        return {"op": self.op, "path": self.path, "value": self.value}


def pointer(*tokens: str) -> str:
    """The JSON pointer (RFC 6901) to ``tokens``: "~" and "/" in a token (a label key's prefix) are
    escaped as "~0" and "~1"."""
    return "".join("/" + token.replace("~", "~0").replace("/", "~1") for token in tokens)


def label(key: str) -> str:
    return pointer("metadata", "labels", key)


def annotation(key: str) -> str:
    return pointer("metadata", "annotations", key)


UID = pointer("metadata", "uid")


@dataclass(frozen=True)
class PodPatch:
    """A guarded JSON patch of pod ``name``: its first operation tests the pod's UID. ``attempt`` is
    the attempt the pod belongs to once patched; ``promotes_slot`` the slot a promoted spare takes
    (None for any other patch)."""

    name: str
    uid: str
    attempt: int
    operations: tuple[PatchOperation, ...]
    promotes_slot: int | None = None

    def body(self) -> list[dict[str, Any]]:
        """The request body: the operations in order, as the API server takes them."""
        return [operation.as_json() for operation in self.operations]

    def tested(self, path: str) -> JsonValue:
        """The value the patch requires at ``path`` (None when it tests nothing there)."""
        return next((op.value for op in self.operations if op.op == "test" and op.path == path), None)

    def written(self, path: str) -> JsonValue:
        """The value the patch writes at ``path`` (None when it writes nothing there)."""
        return next((op.value for op in self.operations if op.op in ("add", "replace") and op.path == path), None)


def _at_attempt(uid: str, attempt: int) -> tuple[PatchOperation, ...]:
    return (PatchOperation("test", UID, uid), PatchOperation("test", label(naming.ATTEMPT_LABEL), str(attempt)))


def _to_attempt(attempt: int, rendezvous_id: str) -> tuple[PatchOperation, ...]:
    return (
        PatchOperation("replace", label(naming.ATTEMPT_LABEL), str(attempt)),
        PatchOperation("add", annotation(naming.RENDEZVOUS_ID_ANNOTATION), rendezvous_id),
    )


def move(name: str, uid: str, from_attempt: int, to_attempt: int, rendezvous_id: str) -> PodPatch:
    """Move a worker pod an in-place gang restart keeps from ``from_attempt`` to ``to_attempt``: its
    attempt label and rendezvous id change, and its supervisor restarts the training processes."""
    operations = _at_attempt(uid, from_attempt) + _to_attempt(to_attempt, rendezvous_id)
    return PodPatch(name, uid, to_attempt, operations)


def promotion(
    name: str,
    uid: str,
    from_attempt: int,
    to_attempt: int,
    rendezvous_id: str,
    slot: int,
    group: tuple[int, int] | None = None,
) -> PodPatch:
    """Promote a warm spare into ``slot`` of ``to_attempt``, only while it is still a spare: its role,
    slot, attempt and rendezvous id change, and its supervisor starts the command. ``group``: the
    replica group and generation the slot belongs to, labelled as on the group's own pods."""
    role = label(naming.ROLE_LABEL)
    grouped: tuple[PatchOperation, ...] = ()
    if group is not None:
        grouped = (
            PatchOperation("add", label(naming.REPLICA_GROUP_LABEL), str(group[0])),
            PatchOperation("add", label(naming.GROUP_GENERATION_LABEL), str(group[1])),
        )
    operations = (
        *_at_attempt(uid, from_attempt),
        PatchOperation("test", role, naming.ROLE_SPARE),
        PatchOperation("replace", role, naming.ROLE_WORKER),
        PatchOperation("add", label(naming.WORKER_INDEX_LABEL), str(slot)),
        *grouped,
        *_to_attempt(to_attempt, rendezvous_id),
    )
    return PodPatch(name, uid, to_attempt, operations, promotes_slot=slot)


def rank_address(name: str, uid: str, attempt: int, address: str) -> PodPatch:
    """Give a supervised worker at ``attempt`` the name its torchrun agent gives the rendezvous as
    its address (``naming.RANK_ADDRESS_ANNOTATION``): the rendezvous numbers its agents in the sort
    order of these names (``topology.rank_addresses``)."""
    given = PatchOperation("add", annotation(naming.RANK_ADDRESS_ANNOTATION), address)
    return PodPatch(name, uid, attempt, (*_at_attempt(uid, attempt), given))


def save_now(name: str, uid: str, attempt: int, token: str) -> PodPatch:
    """Carry the job's save-now ``token`` (``reconcile.save_now``) onto a running worker at
    ``attempt``: one annotation, which its workers read from a downward-API file. "add" replaces a
    value that is there, so the patch is the same however often it is sent."""
    given = PatchOperation("add", annotation(naming.SAVE_NOW_ANNOTATION), token)
    return PodPatch(name, uid, attempt, (*_at_attempt(uid, attempt), given))
