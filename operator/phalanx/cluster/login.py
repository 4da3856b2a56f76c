"""Where the operator's credentials come from, and how it gets new ones.

The official ``kubernetes`` package reads the configuration, so the operator logs in wherever
kubectl can: a pod's service account (whose projected token rotates), a kubeconfig (``$KUBECONFIG``
with several files, a named context), client certificates, exec credential plugins (as EKS, GKE
and AKS kubeconfigs use), ``proxy-url``, ``tls-server-name``. The package is asked only for
credentials: at start, every ``REFRESH_SECONDS`` (it re-reads a rotated token file, and runs an
exec plugin again once its credential expires) and after a 401. Requests stay raw JSON over
aiohttp (``client.ApiClient``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client import Configuration
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import SERVICE_CERT_FILENAME, SERVICE_TOKEN_FILENAME, InClusterConfigLoader
from kubernetes.config.kube_config import list_kube_config_contexts, load_kube_config

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 30.0  # how often the package is asked whether credentials changed
TOKEN_KEY = "BearerToken"  # where the package's loaders put the token
SERVICE_NAMESPACE_FILENAME = os.path.join(os.path.dirname(SERVICE_TOKEN_FILENAME), "namespace")
DEFAULT_NAMESPACE = "default"


class LoginError(RuntimeError):
    """No usable credentials."""


@dataclass(frozen=True)
class Credentials:
    """How to reach and authenticate to the API server. TLS material is held as data: files the
    package writes for it are read and removed at once (``Login`` keeps their bytes for later
    refreshes), so a killed operator leaves none behind."""

    server: str
    ca_data: bytes | None = None
    certificate_data: bytes | None = None
    private_key_data: bytes | None = None
    token: str | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    proxy: str | None = None
    source: str = ""
    """Where they came from, for logs: "service account" or "kubeconfig context NAME"."""

    def same_tls(self, other: Credentials) -> bool:
        """Whether a connection made with ``other`` authenticates as these would."""
        return (self.ca_data, self.certificate_data, self.private_key_data, self.insecure, self.tls_server_name) == (
            other.ca_data,
            other.certificate_data,
            other.private_key_data,
            other.insecure,
            other.tls_server_name,
        )


def _read_and_remove(paths: list[str | None], scratch: Path, kept: dict[str, bytes]) -> list[bytes | None]:
    """The files' bytes. A file the package wrote into ``scratch`` is read once, removed, and its
    bytes kept in ``kept`` under its path: the package hands the same path out again on every
    refresh (it wrote the file once for that content), so a removed file is answered from memory.
    A file outside ``scratch`` (the user's own, or the service account's) is read afresh: it may
    rotate."""
    contents: list[bytes | None] = []
    for path in paths:
        if not path:
            contents.append(None)
        elif Path(path).parent == scratch and path in kept and not Path(path).exists():
            contents.append(kept[path])
        else:
            data = Path(path).read_bytes()
            if Path(path).parent == scratch:
                kept[path] = data
                Path(path).unlink(missing_ok=True)
            contents.append(data)
    for path in [path for path in kept if path not in paths]:
        del kept[path]  # material no longer in use (an exec plugin's rotated certificate)
    return contents


def _kubeconfig_documents(files: str) -> Iterator[dict[str, Any]]:
    """Each readable kubeconfig of ``files`` (joined by ``os.pathsep``), in order; one that cannot
    be read is skipped (the package's loader says what is wrong with it)."""
    for path in files.split(os.pathsep):
        try:
            config = yaml.safe_load(Path(path).expanduser().read_text()) if path else None
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(config, dict):
            yield config


@dataclass
class Login:
    """The operator's source of credentials.

    ``kubeconfig`` (paths joined by ``os.pathsep``, as ``$KUBECONFIG``) and ``context`` choose a
    kubeconfig; without them ``$KUBECONFIG`` or ``~/.kube/config``, unless that names no cluster
    and the process runs in a pod: then the pod's service account, as kubectl chooses (so the CLI
    in a pod follows a kubeconfig given to it). Thread-safe: the client calls it from worker threads
    (an exec plugin may take seconds) while requests go on.
    """

    kubeconfig: str | None = None
    context: str | None = None
    in_cluster: bool | None = None
    """True/False forces the service account or the kubeconfig; None chooses as kubectl would."""
    _configuration: Configuration | None = field(default=None, init=False, repr=False)
    _scratch: Path | None = field(default=None, init=False, repr=False)
    _scratch_removal: weakref.finalize[[Path], Login] | None = field(default=None, init=False, repr=False)
    """Removes the scratch directory when the Login is closed, collected, or the interpreter exits
    (a CLI command or a unit test that never calls ``close``); only a SIGKILL leaves it behind."""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _source: str = field(default="", init=False, repr=False)
    _kept: dict[str, bytes] = field(default_factory=dict, init=False, repr=False)
    """TLS material the package wrote into the scratch directory, by path, once removed from disk."""

    def _use_service_account(self) -> bool:
        if self.in_cluster is not None:
            return self.in_cluster
        if self.kubeconfig or self.context:
            return False
        in_a_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.isfile(SERVICE_TOKEN_FILENAME)
        return in_a_pod and not self._kubeconfig_names_a_cluster()

    def _kubeconfig_names_a_cluster(self) -> bool:
        """Whether ``$KUBECONFIG`` or ``~/.kube/config`` names a cluster: client-go falls back to
        the service account only when the kubeconfig gives it nothing to talk to."""
        return any(config.get("clusters") for config in _kubeconfig_documents(self._kubeconfig_files()))

    def _kubeconfig_files(self) -> str:
        return self.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"

    def _context_name(self, files: str) -> str | None:
        """The context named, else kubectl's current context: that of the first file that sets
        one (the package, left to itself, would take the last)."""
        if self.context:
            return self.context
        for config in _kubeconfig_documents(files):
            if config.get("current-context"):
                return str(config["current-context"])
        return None

    def namespace(self) -> str:
        """The namespace a command works in when it names none, chosen as kubectl chooses: in a pod
        (service account) ``$POD_NAMESPACE`` or the account's own namespace, else the namespace of
        the kubeconfig's context (``context`` or the current one); ``default`` when neither says."""
        if self._use_service_account():
            if os.environ.get("POD_NAMESPACE"):
                return os.environ["POD_NAMESPACE"]
            try:
                return Path(SERVICE_NAMESPACE_FILENAME).read_text().strip() or DEFAULT_NAMESPACE
            except OSError:
                return DEFAULT_NAMESPACE
        files = self._kubeconfig_files()
        try:
            contexts, current = list_kube_config_contexts(files)  # type: ignore[no-untyped-call]
        except (ConfigException, OSError) as error:
            raise LoginError(f"cannot read the kubeconfig {files}: {error}") from error
        name = self._context_name(files) or (current or {}).get("name")
        for context in contexts or []:
            if context.get("name") == name:
                return str((context.get("context") or {}).get("namespace") or DEFAULT_NAMESPACE)
        raise LoginError(f"context {name!r} is not in the kubeconfig {files}")

    def _scratch_dir(self) -> Path:
        if self._scratch is None or not self._scratch.is_dir():
            if self._scratch_removal is not None:
                self._scratch_removal()
            self._scratch = Path(tempfile.mkdtemp(prefix="phalanx-login-"))
            self._scratch_removal = weakref.finalize(self, _remove_scratch, self._scratch)
        return self._scratch

    def load(self) -> Credentials:
        """Read the configuration afresh (an exec plugin runs again): at start and after a 401."""
        with self._lock:
            configuration = Configuration()
            try:
                if self._use_service_account():
                    loader = InClusterConfigLoader(SERVICE_TOKEN_FILENAME, SERVICE_CERT_FILENAME)  # type: ignore[no-untyped-call]
                    loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
                    self._source = "service account"
                else:
                    files = self._kubeconfig_files()
                    context = self._context_name(files)
                    load_kube_config(  # type: ignore[no-untyped-call]
                        config_file=files,
                        context=context,
                        client_configuration=configuration,
                        persist_config=False,
                        temp_file_path=str(self._scratch_dir()),
                    )
                    self._source = f"kubeconfig {files}" + (f" context {context}" if context else "")
            except (ConfigException, OSError) as error:
                raise LoginError(f"cannot load Kubernetes credentials: {error}") from error
            self._configuration = configuration
            return self._credentials(configuration)

    def refresh(self) -> Credentials:
        """The current credentials: the package re-reads what rotates and re-runs an exec plugin
        whose credential expired; nothing else is repeated."""
        with self._lock:
            configuration = self._configuration
            if configuration is None:
                raise LoginError("refresh() before load()")
            return self._credentials(configuration)

    def _credentials(self, configuration: Configuration) -> Credentials:
        scratch = self._scratch_dir()
        token = configuration.get_api_key_with_prefix(TOKEN_KEY)  # runs the package's refresh hook
        if token:
            scheme, _, value = token.partition(" ")
            token = value if scheme.lower() == "bearer" and value else token
        try:
            ca, certificate, key = _read_and_remove(
                [configuration.ssl_ca_cert, configuration.cert_file, configuration.key_file], scratch, self._kept
            )
        except OSError as error:  # a file of the user's removed or unreadable
            raise LoginError(f"cannot read the TLS files of {self._source or 'the configuration'}: {error}") from error
        if not token and not certificate:
            raise LoginError(f"{self._source or 'the configuration'} gave neither a token nor a client certificate")
        return Credentials(
            server=str(configuration.host),
            ca_data=ca,
            certificate_data=certificate,
            private_key_data=key,
            token=token or None,
            insecure=not configuration.verify_ssl,
            tls_server_name=getattr(configuration, "tls_server_name", None) or None,
            proxy=configuration.proxy or None,
            source=self._source,
        )

    def close(self) -> None:
        """Remove the scratch directory and forget the TLS material."""
        self._kept.clear()
        if self._scratch_removal is not None:
            self._scratch_removal()
        self._scratch = self._scratch_removal = None


def _remove_scratch(scratch: Path) -> None:
    with contextlib.suppress(OSError):
        for child in scratch.iterdir():
            child.unlink()
        scratch.rmdir()
