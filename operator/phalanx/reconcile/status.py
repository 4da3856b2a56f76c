"""Conditions and phase, following the Kubernetes API conventions and kstatus.

kstatus (Flux, kpt, Argo CD via health checks) reads, in order: observedGeneration,
``Reconciling=True`` (in progress), ``Stalled=True`` (failed), then ``Ready``. So
``Reconciling`` is True only while the operator is converging (creating, rescaling,
restarting), not for the whole training run, and a finished or suspended job is ``Ready``.
The phase is a one-word summary of the same facts, for printer columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from phalanx.api import v1alpha1 as api

CONDITION_TYPES = ("Ready", "Reconciling", "Stalled", "Running", "Succeeded", "Failed", "Suspended")
CONVERGING = frozenset({"Pending", "Starting", "Rescaling", "Restarting"})
TERMINAL = ("Succeeded", "Failed")
TRAINING = ("Running", "Rescaling")


EARLIEST = datetime.min.replace(tzinfo=UTC)
"""Before every timestamp: where something without a time sorts."""


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with second precision, as metav1.Time serialises."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_optional_time(moment: datetime | None) -> str | None:
    """``format_time``, and None for no moment (a status field left empty)."""
    return format_time(moment) if moment is not None else None


def stored_time(moment: datetime) -> datetime:
    """The moment as status keeps it (``format_time``'s precision: UTC, whole seconds), so that
    what a pass remembers compares as it will when read back from status."""
    return moment.astimezone(UTC).replace(microsecond=0)


def parse_time(text: str | None) -> datetime | None:
    """Parse an RFC 3339 timestamp written by the API server or by us."""
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def human_duration(seconds: float) -> str:
    """A duration as kubectl prints ages (apimachinery's ``duration.HumanDuration``)."""
    whole = int(seconds)
    if whole < -1:
        return "<invalid>"
    if whole < 0:
        return "0s"
    if whole < 120:
        return f"{whole}s"
    minutes = whole // 60
    if minutes < 10:
        rest = whole % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        rest = hours % 24
        return f"{days}d{rest}h" if rest else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    years, rest = divmod(days, 365)
    if years < 8 and rest:
        return f"{years}y{rest}d"
    return f"{years}y"


@dataclass(frozen=True)
class PhaseView:
    """The phase with its reason and message."""

    phase: api.Phase
    reason: str
    message: str


def _truths(view: PhaseView) -> dict[str, tuple[bool, str, str]]:
    phase, reason, message = view.phase, view.reason, view.message
    running = phase in ("Running", "Rescaling")
    ready_reason = {"Running": "WorkersReady", "Succeeded": "Succeeded"}.get(phase, reason)
    return {
        # A suspended job is as its spec asks: Ready, so kstatus (Flux) reads it Current.
        "Ready": (phase in ("Running", "Succeeded", "Suspended"), ready_reason, message),
        "Reconciling": (
            phase in CONVERGING,
            reason if phase in CONVERGING else "Idle",
            message if phase in CONVERGING else "",
        ),
        "Stalled": (
            phase == "Failed",
            reason if phase == "Failed" else "Progressing",
            message if phase == "Failed" else "",
        ),
        "Running": (running, reason if running else ("NotRunning" if phase != "Failed" else reason), message),
        "Succeeded": (
            phase == "Succeeded",
            reason if phase == "Succeeded" else "NotSucceeded",
            message if phase == "Succeeded" else "",
        ),
        "Failed": (
            phase == "Failed",
            reason if phase == "Failed" else "NotFailed",
            message if phase == "Failed" else "",
        ),
        "Suspended": (
            phase == "Suspended",
            reason if phase == "Suspended" else "NotSuspended",
            message if phase == "Suspended" else "",
        ),
    }


def conditions(
    previous: list[api.Condition] | None,
    view: PhaseView,
    *,
    generation: int,
    now: datetime,
    stalled_override: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    """All seven conditions, with lastTransitionTime moved only when a status flips."""
    before = {condition.type: condition for condition in previous or []}
    truths = _truths(view)
    if stalled_override is not None:
        # Not converging while stalled: kstatus reads Reconciling first and would hide the reason.
        truths["Stalled"] = (True, *stalled_override)
        truths["Reconciling"] = (False, stalled_override[0], "")
    result = []
    for kind in CONDITION_TYPES:
        value, reason, message = truths[kind]
        status = "True" if value else "False"
        old = before.get(kind)
        transition = old.last_transition_time if old is not None and old.status == status else format_time(now)
        result.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": transition,
            }
        )
    return result
