"""Who wrote when: the single-writer invariant of leader election, checked on what each operator
replica sent through its own fault proxy.

Each replica's process talks to the API server through a proxy of its own, so every request is
known by sender. ``Sent`` is one mutating request as its proxy received it; ``single_writer``
replays them in the order the proxies received them:

- a successful Lease write by a process other than the current holder's (or naming another
  holder) is a takeover: from then on only the process that wrote it may write. A replica keeps its
  identity across restarts (the chart names it after its pod), so its restarted process takes over
  at once from the killed one, by the same name;
- any other mutating request (its own Lease renewals and acquisitions excepted, answered or not)
  by a process that is not the last to have taken the Lease is a violation: two replicas wrote,
  or one wrote without ever holding the Lease.

Receive times are the proxy's (one monotonic clock for both proxies, in the driver's process), so a
write the API server received late (latency added in the proxy) counts when it was sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

LEASES = "leases"


@dataclass(frozen=True)
class Sent:
    """One mutating request of one operator process."""

    process: str  # the replica and which of its runs: "a#3"
    at: float  # when its proxy received it (time.monotonic())
    method: str
    resource: str  # "pods", "trainingjobs/status", "leases"
    name: str | None
    status: int  # the API server's answer; 0 when none came
    holder: str | None = None  # a Lease write: the holderIdentity it writes ("" to release)

    @property
    def takes_lease(self) -> bool:
        return self.resource == LEASES and 200 <= self.status < 300 and bool(self.holder)

    @property
    def lease(self) -> bool:
        return self.resource == LEASES


@dataclass(frozen=True)
class Takeover:
    at: float
    process: str
    identity: str
    previous: str | None  # the process that held the Lease before (None: nobody had)


def single_writer(sent: Iterable[Sent], origin: float = 0.0) -> tuple[list[Takeover], list[str]]:
    """The takeovers and the violations of the single-writer rule in ``sent`` (see the module
    docstring): one violation for each process that wrote during another's tenure, with its first
    writes; times in messages are seconds after ``origin``."""
    takeovers: list[Takeover] = []
    holder: str | None = None  # the process that last took the Lease
    identity: str | None = None  # the holderIdentity it wrote
    since = 0.0
    stray: dict[tuple[str, str | None, float], list[Sent]] = {}
    for request in sorted(sent, key=lambda r: r.at):
        if request.takes_lease:
            if request.process != holder or request.holder != identity:
                assert request.holder is not None
                takeovers.append(Takeover(request.at, request.process, request.holder, holder))
                holder, identity, since = request.process, request.holder, request.at
            continue
        if not request.lease and request.process != holder:
            stray.setdefault((request.process, holder, since), []).append(request)
    violations = []
    for (process, owner, taken), writes in stray.items():
        tenure = (
            f"while {owner} held the Lease (taken at {taken - origin:.2f}s)"
            if owner
            else "before any replica held the Lease"
        )
        first = ", ".join(
            f"{w.method} {w.resource}/{w.name or ''} at {w.at - origin:.2f}s (answer {w.status or 'none'})"
            for w in writes[:3]
        )
        violations.append(
            f"{process} sent {len(writes)} write(s) {tenure}: {first}{', ...' if len(writes) > 3 else ''}"
        )
    return takeovers, violations
