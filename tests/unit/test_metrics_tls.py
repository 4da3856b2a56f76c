"""The operator's metrics endpoint over HTTPS (``metrics.serve`` with a certificate and key, as the
chart's ``metrics.tls`` mounts them): real TLS with self-signed certificates made by ``openssl``."""

from __future__ import annotations

import http.client
import os
import pathlib
import socket
import ssl
import subprocess
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

import pytest

from phalanx import metrics_endpoint

Serve = Callable[..., WSGIServer]


def self_signed(directory: pathlib.Path, name: str, host: str = "localhost") -> tuple[pathlib.Path, pathlib.Path]:
    """A certificate for ``host`` and 127.0.0.1, and its key."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{host},IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def serve() -> Iterator[Serve]:
    servers: list[WSGIServer] = []

    def start(*args: str | None) -> WSGIServer:
        server = metrics_endpoint.serve(0, *args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def trusting(cert: pathlib.Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def scrape_https(port: int, context: ssl.SSLContext) -> tuple[int, str, bytes]:
    """Status, body and the server's certificate (DER) of GET /metrics."""
    conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=5)
    try:
        conn.request("GET", "/metrics")
        assert isinstance(conn.sock, ssl.SSLSocket)  # the server closes it after the answer
        peer = conn.sock.getpeercert(binary_form=True)
        assert peer is not None
        answer = conn.getresponse()
        return answer.status, answer.read().decode(), peer
    finally:
        conn.close()


def scrape_http(port: int) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        answer = conn.getresponse()
        return answer.status, answer.read().decode()
    finally:
        conn.close()


def der(cert: pathlib.Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def test_serves_metrics_over_https_and_refuses_plain_http(serve: Serve, tmp_path: pathlib.Path) -> None:
    cert, key = self_signed(tmp_path, "one")
    port = serve(str(cert), str(key)).server_port
    status, body, peer = scrape_https(port, trusting(cert))
    assert status == 200 and 'phalanx_jobs{phase="Running"}' in body
    assert peer == der(cert)
    with pytest.raises((http.client.HTTPException, OSError)):  # the TLS handshake fails, no HTTP answer
        scrape_http(port)
    other, _ = self_signed(tmp_path, "other")
    with pytest.raises(ssl.SSLCertVerificationError):  # a client trusting another CA refuses it
        scrape_https(port, trusting(other))
    assert scrape_https(port, trusting(cert))[0] == 200  # failed handshakes left the server serving


def test_without_a_certificate_it_serves_plain_http(serve: Serve) -> None:
    status, body = scrape_http(serve().server_port)
    assert status == 200 and "controller_runtime_reconcile_total" in body


def test_a_client_that_never_finishes_the_handshake_blocks_no_one_else(serve: Serve, tmp_path: pathlib.Path) -> None:
    cert, key = self_signed(tmp_path, "one")
    port = serve(str(cert), str(key)).server_port
    with socket.create_connection(("127.0.0.1", port)):  # connects, sends nothing
        assert scrape_https(port, trusting(cert))[0] == 200


def mount(pair: tuple[pathlib.Path, pathlib.Path], directory: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Put a certificate and key at ``directory``/tls.crt and tls.key, each file replaced in one
    step, as the kubelet swaps a Secret's files."""
    directory.mkdir(exist_ok=True)
    targets = (directory / "tls.crt", directory / "tls.key")
    for source, target in zip(pair, targets, strict=True):
        staged = target.with_suffix(".new")
        staged.write_bytes(source.read_bytes())
        os.replace(staged, target)
    return targets


def test_a_renewed_certificate_is_served_without_a_restart(serve: Serve, tmp_path: pathlib.Path) -> None:
    first = self_signed(tmp_path, "first")
    cert, key = mount(first, tmp_path / "mounted")
    port = serve(str(cert), str(key)).server_port
    assert scrape_https(port, trusting(first[0]))[2] == der(first[0])
    renewed = self_signed(tmp_path, "renewed")
    mount(renewed, tmp_path / "mounted")
    assert scrape_https(port, trusting(renewed[0]))[2] == der(renewed[0])
    with pytest.raises(ssl.SSLCertVerificationError):
        scrape_https(port, trusting(first[0]))


def test_a_broken_renewal_keeps_the_loaded_certificate(serve: Serve, tmp_path: pathlib.Path) -> None:
    first = self_signed(tmp_path, "first")
    cert, key = mount(first, tmp_path / "mounted")
    port = serve(str(cert), str(key)).server_port
    garbage = tmp_path / "garbage"
    garbage.write_text("not a certificate")
    mount((garbage, garbage), tmp_path / "mounted")
    status, _, peer = scrape_https(port, trusting(first[0]))
    assert status == 200 and peer == der(first[0])


def test_half_or_unusable_tls_settings_fail_at_start(tmp_path: pathlib.Path) -> None:
    cert, key = self_signed(tmp_path, "one")
    with pytest.raises(ValueError, match="both"):
        metrics_endpoint.serve(0, str(cert), None)
    with pytest.raises(ValueError, match="both"):
        metrics_endpoint.serve(0, None, str(key))
    other_cert, _ = self_signed(tmp_path, "other")
    with pytest.raises(ssl.SSLError):  # a key that does not belong to the certificate
        metrics_endpoint.serve(0, str(other_cert), str(key))
    with pytest.raises(FileNotFoundError):
        metrics_endpoint.serve(0, str(tmp_path / "missing.crt"), str(key))
