"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's rules.

Several operator replicas run; the one holding the Lease reconciles and writes, the others keep
their caches synced and wait (a warm standby takes over without listing everything first).
A holder renews every ``retry`` seconds and gives up (the process exits) when it could not renew
for ``renew_deadline``; a candidate takes the Lease once its record has not changed for
``lease_duration`` by its own clock (never by comparing timestamps: clocks differ between
nodes). Every write carries the resourceVersion it was read at, so two candidates never both
win. A holder that stops on purpose releases the Lease, and a standby takes it at once.

The elector talks through a client of its own (``ApiClient.dedicated``): a renewal never waits
behind the operator's other requests, however many creates are queued on a slow API server.
Every other write of the operator is fenced by ``holds_lease``: the Lease counts as ours only
until ``renew_deadline`` after the start of the last successful renewal, by this process's
monotonic clock, so a leader that was frozen (SIGSTOP, a stalled node) past that moment writes
nothing until it has renewed, even before it notices anything.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from phalanx.cluster.client import TRANSPORT_ERRORS, ApiClient, ApiError, resource_path

logger = logging.getLogger(__name__)

LEASES = ("coordination.k8s.io/v1", "Lease")
RELEASE_ERRORS: tuple[type[Exception], ...] = (ApiError, *TRANSPORT_ERRORS)


def micro_time(moment: datetime) -> str:
    """metav1.MicroTime as the API server writes it."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# client-go's leaderelection.JitterFactor: it requires renewDeadline > JitterFactor * retryPeriod.
JITTER_FACTOR = 1.2
# What leaseDuration must keep beyond renewDeadline + retryPeriod. The fence stops writes at
# renewDeadline after a renewal began, and a standby cannot take over before leaseDuration after
# it saw that renewal: a write let through just before the fence closed still has this long (plus
# a retry period) to reach the API server and be stored before another leader may write. 2 s is
# twice the Kubernetes API latency SLO for a single-object mutating call (p99 <= 1 s), and leaves
# room for the rate difference of two nodes' clocks over a lease (parts per million).
LEASE_MARGIN_SECONDS = 2.0


@dataclass(frozen=True)
class LeaseTiming:
    """client-go's three durations; the defaults are controller-runtime's (15/10/2 s)."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < JITTER_FACTOR * self.retry < self.renew_deadline:
            raise ValueError(
                f"leader election needs 0 < {JITTER_FACTOR} x retry period ({self.retry:g} s) "
                f"< renew deadline ({self.renew_deadline:g} s), as client-go does"
            )
        if self.renew_deadline + self.retry + LEASE_MARGIN_SECONDS > self.lease_duration:
            raise ValueError(
                f"leader election needs renew deadline ({self.renew_deadline:g} s) + retry period "
                f"({self.retry:g} s) + {LEASE_MARGIN_SECONDS:g} s <= lease duration ({self.lease_duration:g} s): "
                "a standby must not take over while a write of the old leader may still be on its way"
            )


class LeaderElector:
    """Acquire, hold and release one Lease as ``identity``. ``client`` is the elector's own
    (``ApiClient.dedicated()``): nothing else may queue requests on it."""

    def __init__(
        self, client: ApiClient, namespace: str, name: str, identity: str, timing: LeaseTiming | None = None
    ) -> None:
        self.client = client
        self.namespace, self.name, self.identity = namespace, name, identity
        self.timing = timing or LeaseTiming()
        self.leading = asyncio.Event()
        self._observed: tuple[Any, ...] | None = None  # the holder's record as last seen
        self._observed_at = 0.0  # when it last changed, by our monotonic clock
        self._lease: dict[str, Any] | None = None  # the Lease as we last read or wrote it
        self._valid_until = 0.0  # monotonic: the Lease counts as ours until then (holds_lease)

    @property
    def path(self) -> str:
        return resource_path(LEASES[0], LEASES[1], self.namespace, self.name, plural="leases")

    def _spec(self, *, transitions: int, acquired: str | None) -> dict[str, Any]:
        now = micro_time(datetime.now(UTC))
        return {
            "holderIdentity": self.identity,
            # whole seconds in the API: rounded up, a standby never waits less than we count on
            "leaseDurationSeconds": math.ceil(self.timing.lease_duration),
            "acquireTime": acquired or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    async def _read(self) -> dict[str, Any] | None:
        try:
            return await self.client.request("GET", self.path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def holds_lease(self) -> bool:
        """Whether this replica may write now: it leads, and its last successful renewal began
        less than ``renew_deadline`` ago by the monotonic clock (which runs on while the process
        is stopped). The ``leading`` flag alone is cleared only once a renewal has failed, which a
        frozen process notices late."""
        return self.leading.is_set() and time.monotonic() < self._valid_until

    async def try_acquire_or_renew(self) -> bool:
        """One round of client-go's tryAcquireOrRenew: True when we hold the Lease afterwards."""
        # From the round's start: the record we write may be seen by others from this moment on.
        started = time.monotonic()
        if await self._acquire_or_renew():
            self._valid_until = started + self.timing.renew_deadline
            return True
        return False

    async def _acquire_or_renew(self) -> bool:
        lease = await self._read()
        if lease is None:
            body = {
                "apiVersion": LEASES[0],
                "kind": LEASES[1],
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(transitions=0, acquired=None),
            }
            try:
                self._lease = await self.client.request("POST", self.path.rsplit("/", 1)[0], body=body)
            except ApiError as error:
                if error.status == 409:
                    return False  # another candidate created it first
                raise
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"), spec.get("leaseTransitions"))
        now = time.monotonic()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.timing.lease_duration)
        if holder and holder != self.identity and now - self._observed_at < duration:
            return False  # someone else holds it and has renewed within its duration
        transitions = int(spec.get("leaseTransitions") or 0)
        ours = holder == self.identity
        updated = {
            **lease,
            "spec": self._spec(
                transitions=transitions if ours else transitions + 1,
                acquired=spec.get("acquireTime") if ours else None,
            ),
        }
        try:  # the resourceVersion read above makes this a compare-and-swap
            self._lease = await self.client.request("PUT", self.path, body=updated)
        except ApiError as error:
            if error.status == 409:
                return False
            raise
        if not ours:
            logger.info("took the lease %s/%s from %r", self.namespace, self.name, holder or "nobody")
        return True

    async def acquire(self) -> None:
        """Wait until we hold the Lease."""
        while True:
            try:
                if await self.try_acquire_or_renew():
                    self.leading.set()
                    logger.info("leading as %s (lease %s/%s)", self.identity, self.namespace, self.name)
                    return
            except Exception as error:  # any failure is another round (aiohttp raises more than OSError)
                logger.warning("lease %s/%s: %s", self.namespace, self.name, error)
            await asyncio.sleep(self.timing.retry)

    async def hold(self) -> None:
        """Renew every ``retry`` seconds; return when the Lease could not be renewed for
        ``renew_deadline`` (or another holder took it): leadership is lost."""
        again_at_once = False  # the last round was cut short by a stop: this one follows without a pause
        while True:
            if not again_at_once:
                await asyncio.sleep(self.timing.retry)
            started = time.monotonic()
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a stop's cancellation
                async with asyncio.timeout(self.timing.renew_deadline):
                    renewed = await self.try_acquire_or_renew()
            except Exception as error:  # a failed renewal, whatever failed: never hold on without one
                renewed = False
                overran = time.monotonic() - started - self.timing.renew_deadline
                if overran > self.timing.retry and not again_at_once:
                    # The round's timer fired that late: the process was stopped mid-round (SIGSTOP,
                    # a stalled node), so the round was cut short, not refused. Try once more at once,
                    # as a leader frozen between rounds does; the fence keeps it from writing meanwhile.
                    logger.warning(
                        "renewing lease %s/%s: stalled %.1f s past the deadline; renewing again at once",
                        self.namespace,
                        self.name,
                        overran,
                    )
                    again_at_once = True
                    continue
                logger.warning("renewing lease %s/%s: %r", self.namespace, self.name, error)
            again_at_once = False
            if not renewed and (time.monotonic() >= self._valid_until or self._lost()):
                self.leading.clear()
                return

    def _lost(self) -> bool:
        """Another identity holds the Lease now."""
        return self._observed is not None and self._observed[0] not in ("", self.identity)

    async def release(self) -> None:
        """Hand the Lease back (a clean stop), so a standby need not wait out its duration."""
        if not self.leading.is_set() or self._lease is None:
            return
        self.leading.clear()  # closes the fence first: nothing else is written from now on
        spec = {**self._spec(transitions=int(self._lease["spec"].get("leaseTransitions") or 0), acquired=None)}
        spec.update(holderIdentity=None, leaseDurationSeconds=1)
        try:
            await self.client.request("PUT", self.path, body={**self._lease, "spec": spec})
            logger.info("released the lease %s/%s", self.namespace, self.name)
        except RELEASE_ERRORS as error:
            logger.warning("releasing lease %s/%s: %s", self.namespace, self.name, error)
