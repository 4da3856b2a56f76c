"""What a hostile tenant's pods serve the operator, on KWOK: pages at a pod's own address.

The chaos tier's KWOK nodes give pods loopback addresses (``POD_CIDR``, a node's
``spec.podCIDR``), so a page this process serves at ``(pod IP, port)`` is what the operator reads
when it scrapes that pod, exactly as from a real container:

    page = HostilePage("127.77.0.9", 9400, gzip_bomb())      # or big_page(), completion_record(...)
    page.served                                               # how many times it was asked
    page.close()

Each page is served until closed; the driver closes it when the act ends (or the pod is gone, as
KWOK hands its address to the next pod). ``SilentEndpoints`` is the quiet tenant of a busy
cluster: at each address it takes the connection and never answers.
"""

from __future__ import annotations

import contextlib
import http.server
import selectors
import socket
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

POD_CIDR = "127.77.0.1/16"
MIB = 1 << 20
TEXT = (("Content-Type", "text/plain; version=0.0.4"),)


@dataclass(frozen=True)
class Page:
    """A response: its headers and its body in chunks (sent as they come, without a length)."""

    what: str
    headers: tuple[tuple[str, str], ...]
    chunk: bytes
    repeat: int
    tail: bytes = b""

    def body(self) -> Iterator[bytes]:
        for _ in range(self.repeat):
            yield self.chunk
        if self.tail:
            yield self.tail


@cache
def _deflated_zeros(mib: int) -> bytes:
    squeeze = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip format
    zeros = bytes(MIB)
    return b"".join(squeeze.compress(zeros) for _ in range(mib)) + squeeze.flush()


def gzip_bomb(mib: int = 1024) -> Page:
    """About a thousandth of ``mib`` on the wire, ``mib`` MiB once inflated, sent whatever
    encoding was asked for."""
    body = _deflated_zeros(mib)
    headers = (*TEXT, ("Content-Encoding", "gzip"))
    return Page(f"a gzip bomb ({len(body)} bytes inflating to {mib} MiB)", headers, body, 1)


def big_page(mib: int = 100) -> Page:
    """``mib`` MiB of well-formed Prometheus samples (a tenant's own series), no length announced."""
    line = b'tenant_requests_total{path="/%08d"} 1\n'
    lines = b"".join(line % i for i in range(MIB // len(line % 0)))
    chunk = lines + b"#" * (MIB - len(lines) - 1) + b"\n"  # a comment fills the MiB
    return Page(f"a {mib} MiB page", TEXT, chunk, mib)


def completion_record(job_uid: str, attempt: int, step: int = 1, rank: int = 0) -> Page:
    """The rendezvous store's page with a completion record naming job ``job_uid`` (the store
    labels each series with the UID of the job that wrote it)."""
    text = "".join(
        f'phalanx_training_completed_{field}{{job="{job_uid}"}} {value}\n'
        for field, value in (("attempt", attempt), ("step", step), ("rank", rank))
    )
    return Page(f"a completion record of job {job_uid}", TEXT, b"", 0, tail=text.encode())


class HostilePage:
    """Serve ``page`` on ``host:port`` in a thread of its own until ``close()``."""

    def __init__(self, host: str, port: int, page: Page) -> None:
        self.page = page
        self.served = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection does

            def do_GET(self) -> None:
                owner.served += 1
                self.send_response(200)
                for name, value in owner.page.headers:
                    self.send_header(name, value)
                self.end_headers()
                try:
                    for chunk in owner.page.body():
                        self.wfile.write(chunk)
                except OSError:
                    pass  # the reader gave up: what a bounded reader does

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name=f"hostile {host}:{port}", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


class SilentEndpoints:
    """Endpoints that take every connection and never answer, at any number of addresses, until
    removed (a worker whose metrics server hangs). No thread: the kernel completes each handshake
    and holds the request in the listener's backlog; ``pump()`` (the driver's round) takes what
    waits there, counts it and lets go of the connections whose reader gave up."""

    def __init__(self) -> None:
        self.accepted = 0
        self.selector = selectors.DefaultSelector()
        self.listeners: dict[tuple[str, int], socket.socket] = {}

    def add(self, host: str, port: int) -> None:
        listener = socket.create_server((host, port), backlog=64)
        listener.setblocking(False)
        self.listeners[(host, port)] = listener
        self.selector.register(listener, selectors.EVENT_READ, None)

    def remove(self, host: str, port: int) -> None:
        listener = self.listeners.pop((host, port), None)
        if listener is not None:
            self.selector.unregister(listener)
            listener.close()

    def pump(self) -> None:
        for key, _ in self.selector.select(0):
            connection = key.fileobj
            assert isinstance(connection, socket.socket)
            if key.data is None:  # a listener: take what waits, keep it unanswered
                with contextlib.suppress(BlockingIOError):
                    while True:
                        accepted, _ = connection.accept()
                        accepted.setblocking(False)
                        self.accepted += 1
                        self.selector.register(accepted, selectors.EVENT_READ, "connection")
                continue
            try:
                gone = connection.recv(65536) == b""  # the request is read and ignored
            except BlockingIOError:
                continue
            except OSError:
                gone = True
            if gone:
                self.selector.unregister(connection)
                connection.close()

    def close(self) -> None:
        for host, port in list(self.listeners):
            self.remove(host, port)
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
            assert isinstance(key.fileobj, socket.socket)
            key.fileobj.close()
        self.selector.close()
