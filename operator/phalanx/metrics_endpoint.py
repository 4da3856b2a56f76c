"""The operator's /metrics endpoint: plain HTTP, or HTTPS with a certificate that is loaded again
when its mounted Secret is renewed (the metric definitions are in ``phalanx.metrics``)."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

import phalanx.metrics  # noqa: F401 - defines (registers) what is served

logger = logging.getLogger(__name__)
TLS_HANDSHAKE_SECONDS = 10.0


class _Certificate:
    """The serving certificate and key files (a mounted Secret), loaded again once they change:
    the kubelet swaps in a renewed Secret's files, so renewal needs no restart."""

    def __init__(self, certfile: str, keyfile: str) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # TLS 1.2 at least
        self._files = (certfile, keyfile)
        self._stamp = self._stat()
        self.context.load_cert_chain(certfile, keyfile)  # unusable files fail start-up

    def _stat(self) -> tuple[tuple[int, int], ...]:
        return tuple((stat.st_ino, stat.st_mtime_ns) for stat in map(os.stat, self._files))

    def refresh(self) -> None:
        try:
            stamp = self._stat()
            if stamp != self._stamp:
                self.context.load_cert_chain(*self._files)
                self._stamp = stamp
                logger.info("metrics certificate %s loaded again", self._files[0])
        except (OSError, ValueError) as error:  # mid-swap or broken: keep serving the loaded one
            logger.warning("metrics certificate %s not reloaded: %s", self._files[0], error)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    certificate: _Certificate | None = None

    def get_request(self) -> tuple[socket.socket, Any]:
        if self.certificate is not None:  # before accepting, so this connection gets a renewed one
            self.certificate.refresh()
        return super().get_request()

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The handshake runs here, in the connection's own thread (accepting would do it in the one
        # serving thread, where a client that never finishes it would block every scrape).
        if isinstance(request, ssl.SSLSocket):
            request.settimeout(TLS_HANDSHAKE_SECONDS)
            try:
                request.do_handshake()
            except OSError as error:  # plain HTTP, an untrusting client, a port scan
                logger.debug("metrics TLS handshake with %s failed: %s", client_address, error)
                return
        super().finish_request(request, client_address)


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


def serve(port: int, certfile: str | None = None, keyfile: str | None = None) -> WSGIServer:
    """Serve /metrics on ``port`` from a daemon thread: over HTTPS with a certificate and key file,
    else plain HTTP. Port 0 picks a free port (the returned server's ``server_port``)."""
    if bool(certfile) != bool(keyfile):
        raise ValueError("metrics over TLS needs both a certificate and a key file")
    certificate = _Certificate(certfile, keyfile) if certfile and keyfile else None
    server = make_server("0.0.0.0", port, make_wsgi_app(), _Server, handler_class=_Handler)
    if certificate is not None:
        server.certificate = certificate
        server.socket = certificate.context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
