"""Login through the kubernetes package's loaders: contexts, exec credential plugins (run again
only when their credential expired or after a 401), proxies, certificates kept as data."""

from __future__ import annotations

import base64
import gc
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from phalanx.cluster import login as login_module
from phalanx.cluster.login import Login, LoginError

PLUGIN = textwrap.dedent(
    """
    import json, pathlib, sys
    state = pathlib.Path(sys.argv[1])
    runs = state / "runs"
    runs.write_text(str(int(runs.read_text() or 0) + 1) if runs.exists() else "1")
    status = {"token": (state / "token").read_text().strip()}
    expiry = (state / "expiry").read_text().strip()
    if expiry:
        status["expirationTimestamp"] = expiry
    print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}))
    """
)


def kubeconfig(path: pathlib.Path, users: dict[str, dict[str, Any]], **cluster: Any) -> pathlib.Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443", **cluster}}],
        "users": [{"name": name, "user": user} for name, user in users.items()],
        "contexts": [{"name": name, "context": {"cluster": "c", "user": name}} for name in users],
        "current-context": next(iter(users)),
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def plugin(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, Any]]:
    state = tmp_path / "plugin"
    state.mkdir()
    (state / "token").write_text("first")
    (state / "expiry").write_text("")
    script = tmp_path / "credential.py"
    script.write_text(PLUGIN)
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(script), str(state)],
            "interactiveMode": "Never",
        }
    }
    return state, user


def runs(state: pathlib.Path) -> int:
    return int((state / "runs").read_text())


def test_an_exec_plugin_runs_again_only_after_a_401_or_when_its_credential_expired(
    tmp_path: pathlib.Path, plugin: tuple[pathlib.Path, dict[str, Any]]
) -> None:
    state, user = plugin
    login = Login(kubeconfig=str(kubeconfig(tmp_path / "config", {"exec-user": user})))
    assert login.load().token == "first" and runs(state) == 1
    (state / "token").write_text("second")
    assert login.refresh().token == "first" and runs(state) == 1  # still valid: not asked again
    assert login.load().token == "second" and runs(state) == 2  # what the client does after a 401
    soon = datetime.now(UTC) + timedelta(minutes=1)  # within the package's 5-minute skew: expired
    (state / "expiry").write_text(soon.strftime("%Y-%m-%dT%H:%M:%SZ"))
    login.load()
    (state / "token").write_text("third")
    assert login.refresh().token == "third"
    login.close()


def test_a_named_context_certificates_as_data_and_a_proxy(
    tmp_path: pathlib.Path, plugin: tuple[pathlib.Path, dict[str, Any]]
) -> None:
    _, user = plugin
    pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    data = base64.b64encode(pem).decode()
    users = {"exec-user": user, "cert-user": {"client-certificate-data": data, "client-key-data": data}}
    path = kubeconfig(
        tmp_path / "config",
        users,
        **{"certificate-authority-data": data, "proxy-url": "http://proxy.example:3128", "tls-server-name": "api"},
    )
    login = Login(kubeconfig=str(path), context="cert-user")
    credentials = login.load()
    assert (credentials.token, credentials.certificate_data, credentials.private_key_data) == (None, pem, pem)
    assert (credentials.ca_data, credentials.proxy, credentials.tls_server_name) == (
        pem,
        "http://proxy.example:3128",
        "api",
    )
    assert credentials.source.endswith("context cert-user")
    assert login._scratch is not None and list(login._scratch.iterdir()) == []  # no key left on disk
    login.close()


def test_no_usable_credentials_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(LoginError, match="cannot load Kubernetes credentials"):
        Login(kubeconfig=str(tmp_path / "missing")).load()
    path = kubeconfig(tmp_path / "config", {"nobody": {}})
    with pytest.raises(LoginError, match="neither a token nor a client certificate"):
        Login(kubeconfig=str(path)).load()


def test_a_service_accounts_rotated_token_is_read_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod: the projected token file is re-read (the package's one-minute period), and at once
    after a 401."""
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("first")
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    monkeypatch.setattr(login_module, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(login_module, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.delenv("KUBECONFIG", raising=False)  # a kubeconfig would win, as with kubectl
    monkeypatch.setenv("HOME", str(tmp_path))
    login = Login()
    credentials = login.load()
    assert (credentials.server, credentials.token, credentials.source) == (
        "https://10.96.0.1:443",
        "first",
        "service account",
    )
    assert credentials.ca_data == ca.read_bytes()
    token.write_text("second")  # the kubelet rotated it
    assert login.refresh().token == "first"  # within the minute
    real_now = datetime.now()
    later = type("Later", (datetime,), {"now": classmethod(lambda cls, tz=None: real_now + timedelta(minutes=2))})
    # the datetime module as incluster_config imported it (not re-exported, so named by its path)
    monkeypatch.setattr("kubernetes.config.incluster_config.datetime.datetime", later)
    assert login.refresh().token == "second"
    token.write_text("third")
    assert login.load().token == "third"  # after a 401
    login.close()


def test_a_refresh_keeps_inline_certificates_and_still_rotates_an_exec_token(
    tmp_path: pathlib.Path, plugin: tuple[pathlib.Path, dict[str, Any]]
) -> None:
    """``certificate-authority-data`` (and client certificates as data) are written to files by the
    package once and removed by us at once: every refresh after the first load must still know
    them, and still run an expired exec plugin again (proactive rotation out of cluster)."""
    state, user = plugin
    ca = b"-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n"
    pem = b"-----BEGIN CERTIFICATE-----\nCLIENT\n-----END CERTIFICATE-----\n"
    users = {
        "exec-user": user,
        "cert-user": {
            "client-certificate-data": base64.b64encode(pem).decode(),
            "client-key-data": base64.b64encode(pem).decode(),
        },
    }
    path = kubeconfig(tmp_path / "config", users, **{"certificate-authority-data": base64.b64encode(ca).decode()})
    soon = datetime.now(UTC) + timedelta(minutes=1)  # within the package's 5-minute skew: expired
    (state / "expiry").write_text(soon.strftime("%Y-%m-%dT%H:%M:%SZ"))

    login = Login(kubeconfig=str(path))
    first = login.load()
    assert (first.token, first.ca_data) == ("first", ca)
    (state / "token").write_text("second")
    refreshed = login.refresh()
    assert (refreshed.token, refreshed.ca_data) == ("second", ca)  # rotated before any 401
    assert refreshed.same_tls(first)  # the connections stay
    assert login.refresh().ca_data == ca
    assert login._scratch is not None and list(login._scratch.iterdir()) == []  # nothing left on disk
    login.close()

    by_certificate = Login(kubeconfig=str(path), context="cert-user")
    loaded = by_certificate.load()
    again = by_certificate.refresh()
    assert (again.ca_data, again.certificate_data, again.private_key_data) == (ca, pem, pem)
    assert again == loaded
    by_certificate.close()


def test_the_scratch_directory_goes_with_the_login_even_when_nobody_closes_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CLI command or a test that never calls ``close`` leaves no directory in the temp dir."""
    path = kubeconfig(tmp_path / "config", {"token-user": {"token": "t"}})
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    dropped = Login(kubeconfig=str(path))
    assert dropped.load().token == "t" and len(list(temp.iterdir())) == 1
    del dropped
    gc.collect()
    assert list(temp.iterdir()) == []

    closed = Login(kubeconfig=str(path))
    closed.load()
    closed.close()
    closed.close()  # twice is harmless
    assert list(temp.iterdir()) == []

    exits = "from phalanx.cluster.login import Login; import sys; keep = Login(kubeconfig=sys.argv[1]); keep.load()"
    subprocess.run([sys.executable, "-c", exits, str(path)], check=True, env={**os.environ, "TMPDIR": str(temp)})
    assert list(temp.iterdir()) == []
