"""A small asynchronous Kubernetes API client: the only code that talks to the API server.

Plain JSON over aiohttp, no model classes: the official client's deserialisation into
typed models costs milliseconds per object, which a reconcile loop pays on every pass.
Writes use server-side apply with one field manager, so applying an object we already
own is idempotent and never conflicts. A semaphore caps requests in flight: kopf and
aiohttp have no client-side rate limit, and an unbounded fan-out of pod creations on a
small API server would raise latency for every other client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from phalanx.reconcile import naming

logger = logging.getLogger(__name__)

RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_DELAYS = (0.2, 0.5, 1.0, 2.0, 4.0)
TOKEN_REREAD_SECONDS = 60.0

# kind -> (API prefix, plural); PodGroups are resolved by apiVersion below.
CORE_RESOURCES: Mapping[str, str] = {"Pod": "pods", "Service": "services", "Event": "events"}


class ApiError(Exception):
    """A response from the API server that is not a success."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Credentials:
    """How to reach and authenticate to the API server."""

    server: str
    ca_path: str | None = None
    ca_data: bytes | None = None
    certificate_path: str | None = None
    certificate_data: bytes | None = None
    private_key_path: str | None = None
    private_key_data: bytes | None = None
    token: str | None = None
    token_path: str | None = None
    insecure: bool = False


def resource_path(
    api_version: str, kind: str, namespace: str | None, name: str | None = None, *, plural: str | None = None
) -> str:
    """The REST path of a kind (of one object when ``name`` is given)."""
    if plural is None:
        plural = CORE_RESOURCES.get(kind) or f"{kind.lower()}s"
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


def _ssl_context(credentials: Credentials, scratch: Path) -> ssl.SSLContext | bool:
    if credentials.insecure:
        return False
    context = ssl.create_default_context(cafile=credentials.ca_path)
    if credentials.ca_data:
        context.load_verify_locations(cadata=credentials.ca_data.decode())
    certificate, key = credentials.certificate_path, credentials.private_key_path
    if credentials.certificate_data:
        certificate = str(scratch / "client.crt")
        Path(certificate).write_bytes(credentials.certificate_data)
    if credentials.private_key_data:
        key = str(scratch / "client.key")
        Path(key).write_bytes(credentials.private_key_data)
        Path(key).chmod(0o600)
    if certificate:
        context.load_cert_chain(certificate, key)
    return context


class ApiClient:
    """JSON requests with a cap on concurrency and retries on throttling and server errors."""

    def __init__(self, credentials: Credentials, *, max_in_flight: int = 16, timeout: float = 30.0) -> None:
        self.credentials = credentials
        self.max_in_flight = max_in_flight
        self._slots = asyncio.Semaphore(max_in_flight)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._scratch = tempfile.TemporaryDirectory(prefix="phalanx-client-")
        self._token_cache: tuple[float, str] | None = None
        self.requests = 0

    async def __aenter__(self) -> ApiClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            context = _ssl_context(self.credentials, Path(self._scratch.name))
            headers = {"Accept": "application/json", "User-Agent": "phalanx"}
            connector = aiohttp.TCPConnector(ssl=context, limit=self.max_in_flight)
            self._session = aiohttp.ClientSession(
                base_url=self.credentials.server.rstrip("/"),
                headers=headers,
                connector=connector,
                timeout=self._timeout,
            )
        return self._session

    def _token(self) -> str | None:
        """The bearer token; projected service-account tokens rotate, so re-read the file each minute."""
        path = self.credentials.token_path
        if path is None:
            return self.credentials.token
        now = time.monotonic()
        if self._token_cache is None or now - self._token_cache[0] > TOKEN_REREAD_SECONDS:
            self._token_cache = (now, Path(path).read_text().strip())
        return self._token_cache[1]

    async def close(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._scratch.cleanup()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """Send one request; retry throttling and server errors; raise ApiError otherwise."""
        session = self._open()
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        headers = {"Content-Type": content_type} if data is not None else {}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        for attempt, delay in enumerate((*RETRY_DELAYS, None)):
            async with self._slots:
                self.requests += 1
                try:
                    async with session.request(method, path, params=params, data=data, headers=headers) as response:
                        text = await response.text()
                        if response.status < 300:
                            return json.loads(text) if text else {}
                        status = response.status
                        retry_after = response.headers.get("Retry-After")
                except (TimeoutError, aiohttp.ClientConnectionError) as error:
                    if delay is None:
                        raise
                    logger.debug("%s %s failed (%s), retry %d", method, path, error, attempt + 1)
                    await asyncio.sleep(delay)
                    continue
            if status in RETRYABLE_STATUSES and delay is not None:
                await asyncio.sleep(float(retry_after) if retry_after and retry_after.isdigit() else delay)
                continue
            try:
                payload = json.loads(text)
            except json.JSONDecodeError:
                payload = {"reason": "Unknown", "message": text}
            raise ApiError(status, str(payload.get("reason", "")), str(payload.get("message", text)))
        raise AssertionError("unreachable")  # pragma: no cover

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as the phalanx field manager, taking ownership of our fields."""
        metadata = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], metadata.get("namespace"), metadata["name"])
        return await self.request(
            "PATCH",
            path,
            params={"fieldManager": naming.FIELD_MANAGER, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    async def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        *,
        grace_seconds: int | None = None,
        plural: str | None = None,
    ) -> bool:
        """Delete an object; False when it was already gone."""
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            await self.request("DELETE", resource_path(api_version, kind, namespace, name, plural=plural), body=body)
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def patch_status(
        self, api_version: str, plural: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch the status subresource; returns the updated object."""
        path = resource_path(api_version, "", namespace, name, plural=plural) + "/status"
        return await self.request("PATCH", path, body={"status": status}, content_type="application/merge-patch+json")

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        plural: str | None = None,
    ) -> list[dict[str, Any]]:
        """List objects (all pages)."""
        items: list[dict[str, Any]] = []
        params: dict[str, str] = {"limit": "500"}
        if label_selector:
            params["labelSelector"] = label_selector
        while True:
            page = await self.request("GET", resource_path(api_version, kind, namespace, plural=plural), params=params)
            items.extend(page.get("items", []))
            token = page.get("metadata", {}).get("continue")
            if not token:
                return items
            params["continue"] = token
