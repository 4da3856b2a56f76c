"""The node ledger's ConfigMap (``reconcile.node_ledger`` is what it holds): read it, add evidence
to it, and cordon a node past the threshold when the chart asks for that.

Only the replica that leads writes (its writes are fenced by the Lease, ``cluster.client``). Each
write is a PUT with the resourceVersion it read (or a POST that creates the ConfigMap); a conflict
(409: the other replica wrote before it lost the Lease, or someone edited it) reads it again and
merges, so no evidence is lost and none is counted twice (the merge is by pod UID). The leader
reads it again every ``REFRESH_SECONDS`` besides, so an edit (``kubectl edit`` to forgive a node)
reaches the avoidance without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from phalanx import metrics
from phalanx.cluster.client import ApiClient, ApiError, NotLeadingError, resource_path
from phalanx.reconcile import naming
from phalanx.reconcile import node_ledger as ledgers
from phalanx.reconcile.node_ledger import Evidence, Ledger, LedgerPolicy

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 30.0
WRITE_TRIES = 5
AVOIDED_FRESH_SECONDS = 5.0


class NodeLedgerStore:
    """The leader's copy of the ledger, the evidence not yet written, and the ConfigMap it lives in."""

    def __init__(
        self, client: ApiClient, namespace: str, name: str, policy: LedgerPolicy, *, cordon: bool = False
    ) -> None:
        self.client, self.namespace, self.name, self.cordon = client, namespace, name, cordon
        self.ledger = Ledger(policy=policy)
        self.resource_version: str | None = None
        self.loaded = False
        self.pending: tuple[Evidence, ...] = ()
        self.cordoned: set[str] = set()
        self._avoided: tuple[tuple[int, int], datetime, frozenset[str]] | None = None
        self._lock = asyncio.Lock()  # passes run concurrently; one read-merge-write at a time

    @property
    def path(self) -> str:
        return resource_path("v1", "ConfigMap", self.namespace, self.name)

    def avoided(self, now: datetime) -> frozenset[str]:
        """The nodes past the threshold, by the evidence written and pending; every pass asks, so
        the answer is kept until the ledger changes or ``AVOIDED_FRESH_SECONDS`` pass (decay is slow)."""
        key = (id(self.ledger), len(self.pending))
        cached = self._avoided
        if cached is not None and cached[0] == key and abs((now - cached[1]).total_seconds()) < AVOIDED_FRESH_SECONDS:
            return cached[2]
        nodes = self.ledger.merged(self.pending, now).avoided(now) if self.ledger.nodes or self.pending else frozenset()
        self._avoided = (key, now, nodes)
        return nodes

    async def load(self) -> None:
        """Read the ConfigMap (absent: an empty ledger, to be created by the first write)."""
        try:
            body = await self.client.get("v1", "ConfigMap", self.namespace, self.name)
        except ApiError as error:
            if error.status != 404:
                raise
            self.ledger, self.resource_version = Ledger(policy=self.ledger.policy), None
        else:
            self.ledger = ledgers.of_data(body.get("data"), self.ledger.policy)
            self.resource_version = str(body["metadata"].get("resourceVersion") or "") or None
        self.loaded = True
        self._observe(datetime.now(UTC))

    async def ready(self) -> None:
        """Read once before the first pass plans from it (a failed read is retried next pass)."""
        if self.loaded:
            return
        try:
            async with self._lock:  # not under a write that is reading it again
                if not self.loaded:
                    await self.load()
        except ApiError as error:
            logger.warning("cannot read the node ledger %s/%s: %s", self.namespace, self.name, error)

    async def record(self, evidence: Sequence[Evidence], now: datetime) -> None:
        """Count new evidence (kept pending until written; a write refused now is tried again with
        the next evidence or refresh). A write never fails the pass that found the evidence."""
        if not evidence:
            return
        fresh = self.ledger.merged(self.pending, now).new_of(evidence)
        if not fresh:
            return
        self.pending = (*self.pending, *fresh)
        for one in fresh:
            logger.info("node ledger: %s on node %s (%s, pod %s)", one.kind, one.node, one.job, one.pod_uid)
        await self.flush(now)

    async def flush(self, now: datetime) -> None:
        async with self._lock:
            if not self.pending:
                return
            try:
                await self._write(now)
            except NotLeadingError:
                raise
            except ApiError as error:
                logger.warning("cannot write the node ledger %s/%s: %s", self.namespace, self.name, error)
                return
        if self.cordon:
            await self._cordon(now)

    async def _write(self, now: datetime) -> None:
        for _ in range(WRITE_TRIES):
            if not self.loaded:
                await self.load()
            written = self.ledger
            merged = written.merged(self.pending, now)
            try:
                answer = await self._put(merged)
            except ApiError as error:
                if error.status not in (404, 409):
                    raise
                self.loaded = False  # changed (or deleted) since it was read: read, merge, again
                continue
            self.ledger, self.pending = merged, ()
            self.resource_version = str(answer["metadata"].get("resourceVersion") or "") or None
            self._observe(now)
            return
        raise ApiError(409, "Conflict", f"the node ledger changed under {WRITE_TRIES} writes in a row")

    async def _put(self, ledger: Ledger) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "labels": {
                "app.kubernetes.io/managed-by": naming.FIELD_MANAGER,
                "app.kubernetes.io/component": "node-ledger",
            },
        }
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": ledger.to_data()}
        if self.resource_version is None:
            return await self.client.create(body)  # 409 when another wrote it first: read and merge
        metadata["resourceVersion"] = self.resource_version
        return await self.client.request("PUT", self.path, params={"fieldManager": naming.FIELD_MANAGER}, body=body)

    async def refresh_forever(self, interval: float = REFRESH_SECONDS) -> None:
        """The leader's loop: read the ConfigMap again, and write what is pending."""
        while True:
            try:
                async with self._lock:
                    await self.load()
                await self.flush(datetime.now(UTC))
            except ApiError as error:
                logger.warning("cannot read the node ledger %s/%s: %s", self.namespace, self.name, error)
            await asyncio.sleep(interval)

    async def _cordon(self, now: datetime) -> None:
        """Mark the nodes past the threshold unschedulable (``nodeLedger.cordon``), once each; the
        ledger never uncordons: a person who forgives a node uncordons it."""
        for node in sorted(self.ledger.avoided(now) - self.cordoned):
            try:
                await self.client.request(
                    "PATCH",
                    resource_path("v1", "Node", None, node),
                    body={"spec": {"unschedulable": True}},
                    content_type="application/merge-patch+json",
                )
            except ApiError as error:
                logger.warning("cannot cordon node %s past the node ledger's threshold: %s", node, error)
                continue
            logger.warning("cordoned node %s: the node ledger scores it past its threshold", node)
            self.cordoned.add(node)

    def _observe(self, now: datetime) -> None:
        grades = self.ledger.grades(now)
        metrics.NODE_LEDGER_NODES.labels(state="scored").set(len(grades))
        metrics.NODE_LEDGER_NODES.labels(state="avoided").set(sum(1 for grade in grades if grade.avoided))
