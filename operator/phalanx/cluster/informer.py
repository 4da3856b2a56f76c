"""List-then-watch of one resource in one scope, feeding a cache that always converges to the API.

Why not kopf's watches: a reconcile pass must never plan from a cache that has not finished its
first list (after an operator restart it would see a Running job without pods), and after a
``410 Gone`` the relist must drop what was deleted during the gap (a watch never reports those
deletions). kopf offers neither, so the operator lists and watches itself:

- ``synced`` is set once a complete list has been handed to the sink, and cleared while a relist
  is under way, so nothing plans from a half-replaced view;
- every list *replaces* the sink's objects of this scope (objects missing from it are gone); its
  items are folded into the sink page by page as they arrive, so a relist of thousands of pods
  never holds more than one page of full bodies;
- a watch resumes from the last resourceVersion it saw (bookmarks keep that fresh); ``410 Gone``
  or an expired list continuation leads to a new list;
- a resource the API server does not serve (404: a gang scheduler's CRD is not installed), or an
  optional one the operator may not list (403), marks the informer ``absent`` and synced, and is
  looked for again every ``absent_recheck_seconds``; once a resource has been listed, the same
  answer must last ``ABSENT_CONFIRM_SECONDS`` first: a restarted API server answers 403 and 404
  for a few seconds while its RBAC and CRD handlers sync, and taking that for "nothing exists"
  would, for nodes, make every node look deleted;
- errors back off (0.5 s up to 15 s) and are logged in one line, never as tracebacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from phalanx.cluster.client import ApiClient, ApiError
from phalanx.reconcile.observed import child_kind

logger = logging.getLogger(__name__)

ERROR_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)
ABSENT_RECHECK_SECONDS = 60.0  # the default; the operator passes its own (PHALANX_ABSENT_API_RECHECK_SECONDS)
ABSENT_CONFIRM_SECONDS = 30.0
LIST_PAGE = "500"


@dataclass(frozen=True)
class Resource:
    """A listable, watchable kind."""

    api_version: str
    plural: str
    kind: str
    namespaced: bool = True

    def path(self, namespace: str | None) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{prefix}/namespaces/{namespace}/{self.plural}" if namespace else f"{prefix}/{self.plural}"

    def __str__(self) -> str:
        return f"{self.plural}.{self.api_version}"

    @property
    def child_kind(self) -> str:
        """The kind qualified by its API group, as the sinks tell kinds apart."""
        return child_kind(self.api_version, self.kind)


class Sink(Protocol):
    """What an informer feeds: a list's items and then single events (``observe``), and after
    each complete list what it named (``retain``)."""

    def observe(self, event_type: str, obj: Mapping[str, Any], /) -> object:
        """One watch event, or one listed item (as ADDED)."""

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str, /) -> None:
        """``listed`` ((namespace, name)) are all the ``kind`` (a child kind: qualified by its
        API group) there is in ``namespace`` (None: everywhere) as of ``version``; an empty
        ``version`` means the resource is not there at all."""


class ExpiredError(Exception):
    """The resourceVersion or continue token is too old: only a new list helps."""


class Informer:
    """Keeps ``sink`` equal to the API server's objects of ``resource`` in ``namespace`` (None: all)."""

    def __init__(
        self,
        client: ApiClient,
        resource: Resource,
        sink: Sink,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        watch_seconds: int = 300,
        on_change: Callable[[Informer], None] | None = None,
        optional: bool = False,
        absent_recheck_seconds: float = ABSENT_RECHECK_SECONDS,
    ) -> None:
        self.client = client
        self.resource = resource
        self.sink = sink
        self.namespace = namespace if resource.namespaced else None
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.watch_seconds = watch_seconds
        self.on_change = on_change
        self.optional = optional
        self.absent_recheck_seconds = absent_recheck_seconds
        self.synced = asyncio.Event()
        self.absent = False
        self.absent_reason = ""
        self.lists = 0
        self.relists = 0
        self.resource_version: str | None = None
        self._errors = 0
        self._refused_since: float | None = None  # monotonic time of the first 403/404 in a row

    def __str__(self) -> str:
        scope = f" in {self.namespace}" if self.namespace else ""
        return f"{self.resource}{scope}"

    def _params(self) -> dict[str, str]:
        selectors = {"labelSelector": self.label_selector, "fieldSelector": self.field_selector}
        return {key: value for key, value in selectors.items() if value}

    async def list_once(self) -> None:
        """List every page, folding each page's items into the sink as it arrives (the sink keeps
        what it needs of each, and the page is let go), then tell the sink what the list named."""
        listed: set[tuple[str, str]] = set()
        params = {**self._params(), "limit": LIST_PAGE}
        version = ""
        while True:
            try:
                page = await self.client.request("GET", self.resource.path(self.namespace), params=params)
            except ApiError as error:
                if error.status == 410:
                    raise ExpiredError(error.message) from error
                raise
            items = page.pop("items", None) or []
            metadata = page.get("metadata", {})
            for item in items:
                item.setdefault("kind", self.resource.kind)
                item.setdefault("apiVersion", self.resource.api_version)
                item_metadata = item.get("metadata") or {}
                listed.add((item_metadata.get("namespace", ""), item_metadata.get("name", "")))
                self.sink.observe("ADDED", item)
            del items, page  # only the sink's records of this page stay
            version = metadata.get("resourceVersion", version)
            token = metadata.get("continue")
            if not token:
                break
            params["continue"] = token
        self.sink.retain(self.resource.child_kind, self.namespace, listed, version)
        self.resource_version = version
        if self.lists:
            self.relists += 1
        self.lists += 1
        self._refused_since = None
        self.absent = False
        self.synced.set()
        self._changed()

    async def watch_once(self) -> None:
        """Follow one watch request from the last resourceVersion until the server ends it."""
        params = {
            **self._params(),
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_seconds),
            "resourceVersion": self.resource_version or "",
        }
        try:
            async for event in self.client.watch(
                self.resource.path(self.namespace), params, silence_seconds=self.watch_seconds + 30
            ):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise ExpiredError(str(obj.get("message", "")))
                    raise ApiError(int(obj.get("code") or 500), str(obj.get("reason", "")), str(obj.get("message")))
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if kind != "BOOKMARK" and isinstance(kind, str):
                    obj.setdefault("kind", self.resource.kind)
                    self.sink.observe(kind, obj)
                if version:
                    self.resource_version = version
                self._errors = 0
        except ApiError as error:
            if error.status == 410:
                raise ExpiredError(error.message) from error
            raise

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    async def _pause_after_error(self, what: str, error: BaseException) -> None:
        delay = ERROR_DELAYS[min(self._errors, len(ERROR_DELAYS) - 1)]
        self._errors += 1
        logger.warning("%s of %s failed (%s); retrying in %.1fs", what, self, _describe(error), delay)
        await asyncio.sleep(delay)

    async def run(self) -> None:
        """List and watch until cancelled."""
        while True:
            if self.resource_version is None:
                try:
                    await self.list_once()
                except ApiError as error:
                    if self._absent(error):
                        await self._mark_absent(error)
                        continue
                    await self._pause_after_error("list", error)
                    continue
                except ExpiredError as error:
                    logger.info("list of %s expired (%s); listing again", self, error)
                    continue
                except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
                    await self._pause_after_error("list", error)
                    continue
            try:
                await self.watch_once()
            except ExpiredError as error:
                logger.info("watch of %s expired (%s); listing again", self, error)
                self._start_relist()
            except ApiError as error:
                if error.status == 404:
                    self._start_relist()
                    continue
                await self._pause_after_error("watch", error)
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
                await self._pause_after_error("watch", error)

    def _start_relist(self) -> None:
        """Until the new list is in, the cache may hold objects that no longer exist."""
        self.resource_version = None
        self.synced.clear()
        self._changed()

    def _absent(self, error: ApiError) -> bool:
        """Whether a list's error means the resource is not there for this operator: 404, or 403
        for an optional resource; at once if it was never listed, else only after the same answer
        lasted ``ABSENT_CONFIRM_SECONDS`` (see the module's notes)."""
        if not (error.status == 404 or (error.status == 403 and self.optional)):
            self._refused_since = None
            return False
        if not self.lists:
            return True
        now = time.monotonic()
        if self._refused_since is None:
            self._refused_since = now
        return now - self._refused_since >= ABSENT_CONFIRM_SECONDS

    async def _mark_absent(self, error: ApiError) -> None:
        """An optional resource we cannot list counts as synced and empty; look again later."""
        reason = "not served by the API server" if error.status == 404 else f"not permitted: {error.message}"
        if not self.absent or reason != self.absent_reason:
            logger.warning("%s is %s; looking again every %.0fs", self, reason, self.absent_recheck_seconds)
        self.absent = True
        self.absent_reason = reason
        self.sink.retain(self.resource.child_kind, self.namespace, set(), "")
        self.synced.set()
        self._changed()
        await asyncio.sleep(self.absent_recheck_seconds)


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) < 300 else text[:300] + "..."
