"""One pod per worker slot: the claims promoted spares hold (``status.slotClaims``), and duplicates.

Worker pods are named by slot (``<job>-worker-<index>``), so the API server never lets two of them
take one slot. A promoted spare keeps its own name, so no name stops two promotions, or a promotion
and a new worker pod, from taking one slot when they were planned from different views: two
operator replicas around a leader handover, a cache that lags, an answer lost and the next pass
promoting again. Two guards:

- **Claims.** Every promotion a plan holds is recorded in ``status.slotClaims`` (slot, spare, UID,
  attempt; ``recorded``) by the plan's status write, which ``cluster.apply`` sends before any patch,
  conditional on the job's resourceVersion the plan was made from, even when nothing else in status
  changed. Two passes that promote into one slot were either planned from one version of the job,
  and the second write is refused (409) before its patch goes out, or the later was planned from a
  version that holds the first claim, which it honours: a claimed slot is not empty, and its spare
  takes no other. A claim stands (``standing``) while its pod is the spare still to be patched
  into the slot (after a SIGKILL between the status write and the patch, the next pass sends the
  same patch: its tests make it apply once) or the worker in that slot of the attempt; it lapses
  when the pod goes or fails, when the spare could no longer be promoted or its slot is held by
  another worker or beyond desired, and with the attempt.

  Why status and not a Lease per slot: the status write already comes first in every pass that
  promotes (it records the failure or the new attempt that emptied the slot) and already carries
  the job's resourceVersion, so a claim costs no request of its own (one status write when a
  claimed promotion is sent again after a SIGKILL), and no object per slot to create, watch, clean
  up and grant RBAC for. The operator writes only the job's status, never its metadata or spec.

- **Duplicates.** What the claims cannot see, a worker pod created from one view for a slot a spare
  was promoted into from another, is resolved by the next pass (``one_pod_per_slot``): of two
  active pods of the current attempt in one slot one bound to a node stays before one waiting for
  a node, then the older (creationTimestamp, then name), and the other is deleted. That is no
  failure and no restart: the slot never emptied.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from phalanx.reconcile import naming
from phalanx.reconcile.actions import NOTHING, Actions, event
from phalanx.reconcile.observed import PodRecord
from phalanx.reconcile.pass_values import Context, Memory, SlotClaim
from phalanx.reconcile.pod_patches import PodPatch
from phalanx.reconcile.status import EARLIEST

DUPLICATE_WORKER = "DuplicateWorker"


def standing(context: Context, memory: Memory, current: Sequence[PodRecord]) -> tuple[SlotClaim, ...]:
    """The claims of the current attempt that still hold their slot: the claimed pod (that UID) is
    the attempt's active worker in that slot, or a spare that could be promoted now (``Context.fit``) into
    a slot below desired that no active worker of the attempt holds."""
    pods = {pod.uid: pod for pod in context.observed.pods if pod.uid}
    # a worker waiting for a node does not hold its slot against a claimed spare (``spares.promotions``)
    held = {pod.index for pod in current if pod.active and pod.node_name is not None}
    claims: list[SlotClaim] = []
    for claim in memory.claims:
        pod = pods.get(claim.uid)
        if claim.attempt != memory.attempt or pod is None or pod.name != claim.pod:
            continue
        if pod.role == naming.ROLE_WORKER:
            holds = pod.active and pod.attempt == claim.attempt and pod.index == claim.index
            stands = holds and not memory.already_counted(pod)
        else:
            free = claim.index < context.spec.workers.desired and claim.index not in held
            stands = pod.role == naming.ROLE_SPARE and free and context.fit(pod, memory)
        if stands:
            claims.append(claim)
    return tuple(claims)


def pending(context: Context, memory: Memory) -> dict[int, PodRecord]:
    """Claimed slots whose spare is still a spare (its patch not sent, or not seen yet), by slot:
    the slot is that spare's, and the same patch is sent again."""
    spares = {pod.uid: pod for pod in context.observed.spares() if pod.uid}
    return {
        claim.index: spares[claim.uid]
        for claim in memory.claims
        if claim.attempt == memory.attempt and claim.uid in spares
    }


def recorded(memory: Memory, moves: Iterable[PodPatch]) -> list[dict[str, Any]] | None:
    """``status.slotClaims``: the claims of the attempt, and one for each spare promoted by ``moves``."""
    claims = {claim.index: claim for claim in memory.claims if claim.attempt == memory.attempt}
    for move in moves:
        if move.promotes_slot is not None and move.attempt == memory.attempt:
            claims[move.promotes_slot] = SlotClaim(move.promotes_slot, move.name, move.uid, move.attempt)
    return [
        {"index": claim.index, "pod": claim.pod, "uid": claim.uid, "attempt": claim.attempt}
        for _, claim in sorted(claims.items())
    ] or None


def one_pod_per_slot(context: Context, current: Sequence[PodRecord]) -> tuple[list[PodRecord], Actions]:
    """Two or more active pods of the attempt in one slot: one bound to a node before one waiting
    for a node (a spare promoted into a waiting worker's slot takes it), then the oldest
    (creationTimestamp, then name) stays, the others are deleted, with an Event. Returns the
    attempt's pods the pass goes on with:
    without those deleted, and without pods that are going while another active pod holds their
    slot (deleted as duplicates earlier, or from outside): the slot never emptied, so they are no
    failure and no restart."""
    holders: dict[int, list[PodRecord]] = {}
    for pod in current:
        if pod.active and pod.index is not None:
            holders.setdefault(pod.index, []).append(pod)
    actions = NOTHING
    extra: set[str] = set()
    for index, pods in sorted(holders.items()):
        kept, *others = sorted(pods, key=lambda pod: (pod.node_name is None, pod.created or EARLIEST, pod.name))
        for other in others:
            extra.add(other.name)
            why = "waiting for a node" if other.node_name is None and kept.node_name is not None else "the newer"
            actions += context.removing([other]) + event(
                "Warning",
                DUPLICATE_WORKER,
                f"{other.name} and {kept.name} both hold worker slot {index}: {other.name}, {why}, is deleted",
            )
    going = {pod.name for pod in current if pod.deleting and pod.index in holders}
    return [pod for pod in current if pod.name not in extra | going], actions
