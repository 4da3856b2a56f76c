"""The client's long responses (a followed pod log, a watch) against a loopback server that writes
them chunk by chunk: lines as they arrive, whatever the chunk boundaries, the end of a followed
log, long lines, and errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from phalanx.cluster.client import ApiClient, ApiError, body_lines
from phalanx.cluster.login import Credentials
from tests.unit.local_server import serving

LOG = "/api/v1/namespaces/ml/pods/demo-worker-0/log"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def api() -> AsyncIterator[Callable[[Handler], Awaitable[ApiClient]]]:
    """Serves one handler for every path; yields a factory of clients pointed at it."""
    handlers: list[Handler] = []

    async def route(request: web.Request) -> web.StreamResponse:
        return await handlers[0](request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", route)
    async with serving(app) as url:
        clients: list[ApiClient] = []

        async def client_for(handler: Handler) -> ApiClient:
            handlers[:] = [handler]
            clients.append(ApiClient(Credentials(server=url, token="t")))
            return clients[-1]

        yield client_for
        for client in clients:
            await client.close()


async def chunked(request: web.Request, chunks: list[bytes], pause: float = 0.01) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/plain"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    for chunk in chunks:
        await response.write(chunk)
        await asyncio.sleep(pause)
    await response.write_eof()
    return response


async def test_a_followed_log_comes_line_by_line_whatever_the_chunks_and_ends_with_the_body(
    api: Callable[[Handler], Awaitable[ApiClient]],
) -> None:
    seen: list[dict[str, str]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.query))
        assert request.path == LOG and request.headers["Authorization"] == "Bearer t"
        # a line split across chunks, two lines in one chunk, CRLF, a last line without its end
        return await chunked(request, [b"step=1 lo", b"ss=2.0\nstep=2\r\nstep=", b"3\n", "héllo\n".encode(), b"bye"])

    client = await api(handler)
    lines = [
        line
        async for line in client.pod_log(
            "ml", "demo-worker-0", container="trainer", follow=True, tail_lines=5, since_seconds=600, timestamps=True
        )
    ]
    assert lines == ["step=1 loss=2.0", "step=2", "step=3", "héllo", "bye"]
    assert seen == [
        {"container": "trainer", "follow": "true", "tailLines": "5", "sinceSeconds": "600", "timestamps": "true"}
    ]


async def test_lines_are_handed_over_as_they_arrive_not_when_the_body_ends(
    api: Callable[[Handler], Awaitable[ApiClient]],
) -> None:
    first_read = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"first\n")
        await asyncio.wait_for(first_read.wait(), 5)  # the body goes on only once the client has the line
        await response.write(b"second\n")
        await response.write_eof()
        return response

    client = await api(handler)
    lines = []
    async for line in client.pod_log("ml", "demo-worker-0", follow=True):
        lines.append(line)
        first_read.set()
    assert lines == ["first", "second"]


async def test_a_line_longer_than_the_limit_comes_in_pieces(api: Callable[[Handler], Awaitable[ApiClient]]) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await chunked(request, [b"x" * 700, b"x" * 700 + b"\nshort\n"], pause=0)

    client = await api(handler)
    lines = [line async for line in client.stream_text(LOG, {}, max_line_bytes=500)]
    assert lines == ["x" * 500, "x" * 500, "x" * 400, "short"]


@pytest.mark.parametrize(
    ("status", "body", "reason", "message"),
    [
        (
            400,
            {
                "kind": "Status",
                "status": "Failure",
                "reason": "BadRequest",
                "code": 400,
                "message": 'container "trainer" in pod "demo-worker-0" is waiting to start: ContainerCreating',
            },
            "BadRequest",
            'container "trainer" in pod "demo-worker-0" is waiting to start: ContainerCreating',
        ),
        (
            403,
            {
                "kind": "Status",
                "reason": "Forbidden",
                "code": 403,
                "message": 'pods "demo-worker-0" is forbidden: User "dev" cannot get resource "pods/log"',
            },
            "Forbidden",
            'pods "demo-worker-0" is forbidden: User "dev" cannot get resource "pods/log"',
        ),
        (502, "Bad Gateway", "Unknown", "Bad Gateway"),  # a proxy's plain text
    ],
)
async def test_an_error_response_is_an_api_error_with_the_servers_words(
    api: Callable[[Handler], Awaitable[ApiClient]], status: int, body: object, reason: str, message: str
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        if isinstance(body, dict):
            return web.json_response(body, status=status)
        return web.Response(text=str(body), status=status)

    client = await api(handler)
    with pytest.raises(ApiError) as raised:
        async for _ in client.pod_log("ml", "demo-worker-0", follow=True):
            pass
    assert (raised.value.status, raised.value.reason, raised.value.message) == (status, reason, message)


async def test_a_watch_event_larger_than_aiohttps_line_limit_arrives_whole(
    api: Callable[[Handler], Awaitable[ApiClient]],
) -> None:
    big = {"type": "ADDED", "object": {"metadata": {"name": "big"}, "data": {"blob": "y" * 300_000}}}
    small = {"type": "MODIFIED", "object": {"metadata": {"name": "small"}}}
    text = (json.dumps(big) + "\n" + json.dumps(small) + "\n").encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.query["watch"] == "1"
        return await chunked(request, [text[i : i + 65536] for i in range(0, len(text), 65536)], pause=0)

    client = await api(handler)
    events = [event async for event in client.watch("/api/v1/namespaces/ml/pods", {"watch": "1"}, silence_seconds=5)]
    assert [event["object"]["metadata"]["name"] for event in events] == ["big", "small"]
    assert events[0] == big


async def test_body_lines_keeps_line_ends_and_a_final_partial_line() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for chunk in (b"a\nb", b"c\n\n", b"d"):
            yield chunk

    assert [line async for line in body_lines(chunks())] == [b"a\n", b"bc\n", b"\n", b"d"]


async def test_body_lines_cuts_a_long_line_whether_or_not_its_end_came_in_the_same_chunk() -> None:
    async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    whole = [line async for line in body_lines(chunks(b"abcdefg\nhi\n"), max_line_bytes=3)]
    split = [line async for line in body_lines(chunks(b"abcd", b"efg\nhi\n"), max_line_bytes=3)]
    assert whole == split == [b"abc", b"def", b"g\n", b"hi\n"]


class OneNewToken:
    """A login whose next credentials carry the token the server now wants."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loads = 0

    def load(self) -> Credentials:
        self.loads += 1
        return Credentials(server=self.url, token="new")

    def refresh(self) -> Credentials:
        raise AssertionError("not due within a test")


async def test_a_stream_refused_for_an_expired_token_logs_in_again_and_is_sent_once_more() -> None:
    tokens: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        tokens.append(request.headers["Authorization"])
        if request.headers["Authorization"] != "Bearer new":
            return web.json_response({"reason": "Unauthorized", "message": "Unauthorized"}, status=401)
        return await chunked(request, [b"ok\n"])

    app = web.Application()
    app.router.add_route("GET", LOG, handler)
    async with serving(app) as url:
        login = OneNewToken(url)
        async with ApiClient(Credentials(server=url, token="old"), login=login) as client:  # type: ignore[arg-type]
            assert [line async for line in client.pod_log("ml", "demo-worker-0")] == ["ok"]
    assert tokens == ["Bearer old", "Bearer new"] and login.loads == 1
