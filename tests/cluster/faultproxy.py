"""A reverse proxy in front of kube-apiserver for one client (the operator), to break what real
networks and API servers break, at chosen moments.

    proxy = FaultProxy(cluster.server, cluster.ca_cert).start()   # plain HTTP on 127.0.0.1
    kubeconfig = proxy.kubeconfig(identity, tmp_path / "via-proxy.kubeconfig")
    url = proxy.listen()                               # one more port: requests say which they came by
    proxy.cut_watches()                                # every open watch stream ends at once
    proxy.lose_response(lambda r: r.method == "POST" and r.resource == "events")
    proxy.after(lambda r: r.status_write, kill_operator) # after the server applied it, before the reply
    proxy.delay(lambda r: r.verb == "list", 2.0)       # hold matching requests back before forwarding
    proxy.set_latency(0.2, 1.5)                         # hold every request back 0.2-1.5 s (None: off)
    proxy.observe(lambda r, status, body: ...)          # every request with the server's answer (0: none)
    proxy.requests                                      # Counter of (verb, resource)
    proxy.stop()

It runs an aiohttp server in a thread of its own, forwards every request over TLS (trusting the
cluster CA; the client's bearer token passes through) and streams watch responses chunk by chunk.
Nothing on the host is touched beyond the loopback ports it listens on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

FORWARDED_HEADERS = ("Authorization", "Content-Type", "Accept", "User-Agent")


@dataclass(frozen=True)
class Request:
    """What the proxy knows about one request, for predicates and observers."""

    method: str
    path: str
    query: dict[str, str]
    body: bytes = b""
    received: float = 0.0  # time.monotonic() when the proxy got it
    port: int = 0  # the proxy's port it came by (``listen``): who sent it, however late it arrived

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("1", "true")

    @property
    def mutating(self) -> bool:
        return self.method in ("POST", "PUT", "PATCH", "DELETE")

    @property
    def name(self) -> str | None:
        return self._parts()[1]

    def json(self) -> Any:
        """The body as JSON; None when there is none or it is not JSON (an apply patch is YAML)."""
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None

    def _parts(self) -> tuple[str, str | None, str | None]:
        """(resource, name, subresource) of /api/v1/... or /apis/<group>/<version>/... paths."""
        parts = [part for part in self.path.split("/") if part]
        rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
        if len(rest) > 2 and rest[0] == "namespaces":
            rest = rest[2:]
        if not rest:
            return "", None, None
        return rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None

    @property
    def resource(self) -> str:
        """The plural resource (``pods``, ``trainingjobs``, ``events``), ``trainingjobs/status`` for status."""
        resource, _, sub = self._parts()
        return f"{resource}/{sub}" if sub else resource

    @property
    def verb(self) -> str:
        """Kubernetes' verb: list and watch are GETs of a collection."""
        if self.method == "GET":
            named = self._parts()[1] is not None
            return "get" if named else ("watch" if self.watch else "list")
        return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(self.method, self.method)

    @property
    def status_write(self) -> bool:
        return self.method == "PATCH" and self.path.endswith("/status")


Predicate = Callable[[Request], bool]
Observer = Callable[[Request, int, bytes], None]


class FaultProxy:
    """See the module docstring."""

    def __init__(self, upstream: str, ca_cert: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.ca_cert = ca_cert
        self.url = ""
        self.requests: Counter[tuple[str, str]] = Counter()
        self.lost: list[Request] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._streams: set[web.StreamResponse] = set()
        self._upstream_streams: set[aiohttp.ClientResponse] = set()
        self._lose: list[tuple[Predicate, list[int]]] = []
        self._after: list[tuple[Predicate, Callable[[Request], None], list[int]]] = []
        self._delay: list[tuple[Predicate, float, list[int]]] = []
        self._latency: tuple[float, float] | None = None
        self._observers: list[Observer] = []
        self._random = random.Random()
        self._lock = threading.Lock()
        self._ready = threading.Event()

    # -- control (from any thread) -------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def cut_watches(self) -> int:
        """End every open watch stream now (the client sees its connection break); returns how many."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(30)

    def lose_response(self, predicate: Predicate, count: int = 1) -> None:
        """For the next ``count`` matching requests: forward them, then drop the connection instead of
        answering (the server acted; the client never learns it)."""
        with self._lock:
            self._lose.append((predicate, [count]))

    def after(self, predicate: Predicate, callback: Callable[[Request], None], count: int = 1) -> None:
        """Call ``callback`` (in the proxy's thread) after the next ``count`` matching requests got a
        2xx from the server, before the answer is passed on."""
        with self._lock:
            self._after.append((predicate, callback, [count]))

    def delay(self, predicate: Predicate, seconds: float, count: int = 1) -> None:
        """Hold the next ``count`` matching requests back for ``seconds`` before forwarding them."""
        with self._lock:
            self._delay.append((predicate, seconds, [count]))

    def set_latency(self, low: float | None, high: float | None = None) -> None:
        """Hold every request back for a random time between ``low`` and ``high`` seconds (a slow
        network or API server) until called with None."""
        with self._lock:
            self._latency = None if low is None else (low, low if high is None else high)

    def observe(self, observer: Observer) -> None:
        """Call ``observer(request, status, body)`` (in the proxy's thread) for every request once the
        API server answered it (a watch: once its stream began, with no body), or with status 0 and
        no body when it could not be reached. The request's ``received`` says when the client sent it."""
        with self._lock:
            self._observers.append(observer)

    def cancel_after(self) -> None:
        """Forget the callbacks armed with ``after`` that have not fired."""
        with self._lock:
            self._after.clear()

    def clear(self) -> None:
        with self._lock:
            self._lose.clear()
            self._after.clear()
            self._delay.clear()
            self._latency = None

    def listen(self) -> str:
        """Listen on one more port, and return its URL: a client given a port of its own is known
        by it (``Request.port``), even for a request that reaches the proxy after the client died."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(30)

    def kubeconfig(self, via: Path, path: Path, url: str | None = None) -> Path:
        """A copy of kubeconfig ``via`` (a token user) that talks to the API server through this
        proxy (by ``url``, one of its ports; the first by default)."""
        config = yaml.safe_load(via.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"] = {"server": url or self.url}
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    # -- the server (in its own thread) ----------------------------------------------------------

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _start(self) -> None:
        context = ssl.create_default_context(cafile=str(self.ca_cert))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context, limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await self._runner.setup()
        self.url = await self._listen()

    async def _listen(self) -> str:
        assert self._runner is not None
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def _shutdown(self) -> None:
        await self._cut()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _cut(self) -> int:
        cut = len(self._upstream_streams)
        for upstream in list(self._upstream_streams):
            upstream.close()
        for stream in list(self._streams):
            transport = stream._req.transport if stream._req is not None else None
            if transport is not None:
                transport.close()
        return cut

    def _take(self, rules: list[Any], request: Request) -> list[Any]:
        taken = []
        with self._lock:
            for rule in rules:
                if rule[-1][0] > 0 and rule[0](request):
                    rule[-1][0] -= 1
                    taken.append(rule)
            rules[:] = [rule for rule in rules if rule[-1][0] > 0]
        return taken

    def _observed(self, request: Request, status: int, body: bytes = b"") -> None:
        with self._lock:
            observers = list(self._observers)
        for observer in observers:
            observer(request, status, body)

    async def _forward(self, incoming: web.Request) -> web.StreamResponse:
        assert self._session is not None
        received = time.monotonic()
        sockname = None if incoming.transport is None else incoming.transport.get_extra_info("sockname")
        port = sockname[1] if sockname else 0
        body = await incoming.read()
        request = Request(incoming.method, incoming.path, dict(incoming.query), body, received, port)
        with self._lock:
            self.requests[(request.verb, request.resource)] += 1
            latency = self._latency
        if latency is not None:
            await asyncio.sleep(self._random.uniform(*latency))
        for _, seconds, _ in self._take(self._delay, request):
            await asyncio.sleep(seconds)
        headers = {name: incoming.headers[name] for name in FORWARDED_HEADERS if name in incoming.headers}
        try:
            upstream = await self._session.request(
                incoming.method,
                self.upstream + incoming.path_qs,
                headers=headers,
                data=body or None,
            )
        except (aiohttp.ClientError, OSError) as error:
            self._observed(request, 0)
            return web.Response(status=503, text=f"fault proxy: API server unreachable: {error}")
        if request.watch:
            self._observed(request, upstream.status)
            return await self._stream(incoming, upstream)
        try:
            payload = await upstream.read()
        except (aiohttp.ClientError, OSError) as error:
            self._observed(request, 0)
            return web.Response(status=503, text=f"fault proxy: {error}")
        finally:
            upstream.release()
        self._observed(request, upstream.status, payload)
        if 200 <= upstream.status < 300:
            for _, callback, _ in self._take(self._after, request):
                callback(request)
        if self._take(self._lose, request):
            self.lost.append(request)
            if incoming.transport is not None:
                incoming.transport.close()  # the client sees its connection drop, with no answer
            return web.Response(status=502)
        response = web.Response(status=upstream.status, body=payload)
        if "Content-Type" in upstream.headers:
            response.headers["Content-Type"] = upstream.headers["Content-Type"]
        return response

    async def _stream(self, incoming: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status)
        if "Content-Type" in upstream.headers:
            response.headers["Content-Type"] = upstream.headers["Content-Type"]
        self._streams.add(response)
        self._upstream_streams.add(upstream)
        try:
            await response.prepare(incoming)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.write_eof()
        except (aiohttp.ClientError, ConnectionError, OSError, RuntimeError):
            pass  # cut on purpose, or the client went away
        finally:
            self._streams.discard(response)
            self._upstream_streams.discard(upstream)
            upstream.release()
        return response
