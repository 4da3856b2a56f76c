"""Kubernetes Events on TrainingJobs, posted in the background.

A pass decides its events and goes on: they are handed to the ``EventRecorder``, whose senders
post them with background priority (``RequestSlots``), so when many jobs land at once the API
server creates their pods first and records what happened right after. Events are records, not
state: one that cannot be posted is logged and dropped, and when the backlog is full the oldest
goes (client-go's broadcaster drops under pressure too). Each keeps the time it was decided.
Posts go through the client's leadership fence like every write: an event still waiting when this
replica's Lease lapses is dropped, not posted by a replica that may no longer lead.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import aiohttp

from phalanx.api import v1alpha1 as api
from phalanx.cluster.client import ApiClient, ApiError, NotLeadingError
from phalanx.reconcile.actions import Event
from phalanx.reconcile.status import format_time

logger = logging.getLogger(__name__)

REPORTING_COMPONENT = "phalanx"
MAX_EVENT_MESSAGE = 1024
EVENT_BACKLOG = 5000  # events waiting to be posted; past it the oldest are dropped
EVENT_SENDERS = 2


def event_body(job: Mapping[str, Any], event: Event, now: datetime) -> dict[str, Any]:
    """A core/v1 Event on the TrainingJob. Its name is new each time, so a POST that may have
    reached the server is never sent again."""
    metadata = job["metadata"]
    stamp = format_time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{metadata['name']}.{uuid.uuid4().hex[:16]}", "namespace": metadata["namespace"]},
        "involvedObject": {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "uid": metadata.get("uid", ""),
        },
        "reason": event.reason,
        "message": event.message[:MAX_EVENT_MESSAGE],
        "type": event.type,
        "source": {"component": REPORTING_COMPONENT},
        "reportingComponent": REPORTING_COMPONENT,
        "reportingInstance": REPORTING_COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class EventRecorder:
    """A bounded backlog of Events and the senders that post them (``run``)."""

    def __init__(self, client: ApiClient, *, backlog: int = EVENT_BACKLOG, senders: int = EVENT_SENDERS) -> None:
        self.client = client
        self.backlog = backlog
        self.senders = senders
        self.dropped = 0
        self.posted = 0
        self._pending: deque[dict[str, Any]] = deque()
        self._ready = asyncio.Event()
        self._sending = 0

    def record(self, job: Mapping[str, Any], event: Event, now: datetime) -> None:
        if event.type == "Warning":  # what went wrong stays in the log when Events have expired
            metadata = job.get("metadata") or {}
            logger.info("%s/%s: %s: %s", metadata.get("namespace"), metadata.get("name"), event.reason, event.message)
        if len(self._pending) >= self.backlog:
            lost = self._pending.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                logger.warning(
                    "event backlog full (%d): dropped %d so far, the latest %s on %s",
                    self.backlog,
                    self.dropped,
                    lost["reason"],
                    lost["involvedObject"]["name"],
                )
        self._pending.append(event_body(job, event, now))
        self._ready.set()

    def idle(self) -> bool:
        """Nothing waits to be posted and nothing is being posted."""
        return not self._pending and self._sending == 0

    async def run(self) -> None:
        """Post events until cancelled."""
        await asyncio.gather(*(self._send() for _ in range(self.senders)))

    async def flush(self, within: float) -> None:
        """Post what is pending (at shut-down), for at most ``within`` seconds."""
        try:
            async with asyncio.timeout(within):
                while self._pending:
                    await self._post(self._pending.popleft())
        except TimeoutError:
            logger.warning("%d events not posted at shut-down", len(self._pending))

    async def _send(self) -> None:
        while True:
            if not self._pending:
                self._ready.clear()
                await self._ready.wait()
                continue
            body = self._pending.popleft()
            self._sending += 1
            try:
                await self._post(body)
            finally:
                self._sending -= 1

    async def _post(self, body: dict[str, Any]) -> None:
        namespace = body["metadata"]["namespace"]
        try:
            await self.client.request("POST", f"/api/v1/namespaces/{namespace}/events", body=body, background=True)
        except NotLeadingError as error:
            self.dropped += 1
            logger.info("event %s on %s dropped: %s", body["reason"], body["involvedObject"]["name"], error)
            return
        except (ApiError, TimeoutError, aiohttp.ClientError, OSError) as error:
            logger.warning("could not record event %s on %s: %s", body["reason"], body["involvedObject"]["name"], error)
            return
        self.posted += 1
