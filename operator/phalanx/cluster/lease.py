"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's rules.

Several operator replicas run; the one holding the Lease reconciles and writes, the others keep
their caches synced and wait (a warm standby takes over without listing everything first).
A holder renews every ``retry`` seconds and gives up (the process exits) when it could not renew
for ``renew_deadline``; a candidate takes the Lease once its record has not changed for
``lease_duration`` by its own clock (never by comparing timestamps: clocks differ between
nodes). Every write carries the resourceVersion it was read at, so two candidates never both
win. A holder that stops on purpose releases the Lease, and a standby takes it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from phalanx.cluster.client import ApiClient, ApiError, resource_path

logger = logging.getLogger(__name__)

LEASES = ("coordination.k8s.io/v1", "Lease")


def micro_time(moment: datetime) -> str:
    """metav1.MicroTime as the API server writes it."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseTiming:
    """client-go's three durations (controller-runtime's defaults are 15/10/2 s; ours take over
    sooner)."""

    lease_duration: float = 10.0
    renew_deadline: float = 7.0
    retry: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry < self.renew_deadline < self.lease_duration:
            raise ValueError("leader election needs 0 < retry < renew deadline < lease duration")


class LeaderElector:
    """Acquire, hold and release one Lease as ``identity``."""

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

    @property
    def path(self) -> str:
        return resource_path(LEASES[0], LEASES[1], self.namespace, self.name, plural="leases")

    def _spec(self, *, transitions: int, acquired: str | None) -> dict[str, Any]:
        now = micro_time(datetime.now(UTC))
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.timing.lease_duration),
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

    async def try_acquire_or_renew(self) -> bool:
        """One round of client-go's tryAcquireOrRenew: True when we hold the Lease afterwards."""
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
        last_renewal = time.monotonic()
        while True:
            await asyncio.sleep(self.timing.retry)
            try:
                renewed = await asyncio.wait_for(self.try_acquire_or_renew(), self.timing.renew_deadline)
            except Exception as error:  # a failed renewal, whatever failed: never hold on without one
                logger.warning("renewing lease %s/%s: %s", self.namespace, self.name, error)
                renewed = False
            if renewed:
                last_renewal = time.monotonic()
            elif time.monotonic() - last_renewal >= self.timing.renew_deadline or self._lost():
                self.leading.clear()
                return

    def _lost(self) -> bool:
        """Another identity holds the Lease now."""
        return self._observed is not None and self._observed[0] not in ("", self.identity)

    async def release(self) -> None:
        """Hand the Lease back (a clean stop), so a standby need not wait out its duration."""
        if not self.leading.is_set() or self._lease is None:
            return
        self.leading.clear()
        spec = {**self._spec(transitions=int(self._lease["spec"].get("leaseTransitions") or 0), acquired=None)}
        spec.update(holderIdentity=None, leaseDurationSeconds=1)
        try:
            await self.client.request("PUT", self.path, body={**self._lease, "spec": spec})
            logger.info("released the lease %s/%s", self.namespace, self.name)
        except (ApiError, OSError, TimeoutError) as error:
            logger.warning("releasing lease %s/%s: %s", self.namespace, self.name, error)
