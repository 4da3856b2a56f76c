"""KWOK (and the gang schedulers' host processes) against a cluster this harness did not start.

When ``$KUBECONFIG`` names another cluster (kind, for example), ``AttachedCluster`` starts KWOK on
this host against that cluster's API server, so the KWOK-based tiers run there too:

    cluster = AttachedCluster(pathlib.Path("~/.kube/config").expanduser())
    cluster.start()              # kwok only, logged and PID-recorded in a temporary state dir
    cluster.add_gpu_nodes(2)     # KWOK GPU nodes on that cluster, deleted again by stop()
    cluster.stop()               # the nodes it made, then kwok by PID; nothing else is touched

The control plane is not ours, so what needs it (restarting the API server, compacting etcd, the
cluster's own certificates) raises ``ClusterError``; tests that need it take the ``control_plane``
fixture and skip. ``ca_cert``/``ca_key`` are a CA made for this session: they sign the serving
certificates of webhooks run on this host, and their certificate goes into the webhooks'
``caBundle``. ``server_ca`` is the CA that verifies the API server (from the kubeconfig).

``host_address`` is where that cluster's API server reaches processes on this host (Kueue's
webhooks): ``$PHALANX_TEST_HOST_ADDRESS``; else, for a kind cluster, the gateway of docker's
``kind`` network; else 127.0.0.1 (an API server on this host).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import urllib.parse
from typing import Any

from tests.cluster import binaries as _binaries
from tests.cluster.localcluster import ClusterError, LocalCluster
from tests.cluster.ports import free_port

HOST_ADDRESS_ENV = "PHALANX_TEST_HOST_ADDRESS"


def _docker_kind_gateway() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError):
        out = subprocess.run(
            [docker, "network", "inspect", "kind"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        for config in json.loads(out)[0]["IPAM"]["Config"]:
            gateway = config.get("Gateway", "")
            if gateway and ":" not in gateway:  # the IPv4 one
                return str(gateway)
    return None


class AttachedCluster(LocalCluster):
    runs_control_plane = False

    def __init__(self, kubeconfig: pathlib.Path, *, host_address: str | None = None) -> None:
        super().__init__(kwok=True)
        self.kubeconfig = kubeconfig
        self._created_nodes: list[str] = []
        self._host_address = host_address

    # ---------------------------------------------------------------- lifecycle

    def _start(self) -> None:
        self.binaries = _binaries.ensure_binaries(["kwok", "kubectl"])
        for directory in (self.pki_dir, self.log_dir, self.pid_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self._read_kubeconfig()
        version = json.loads(self.kubectl("version", "--output=json").stdout)["serverVersion"]["gitVersion"]
        self.versions = {"kubernetes": version, "kwok": _binaries.module_version("kwok")}
        self._write_session_ca()
        self.ports = {"kwok": free_port()}
        self._save_state()
        self._start_kwok()
        self._wait("kwok /healthz", lambda: self._http_ok(f"http://127.0.0.1:{self.ports['kwok']}/healthz"))
        self._save_state()

    def stop(self, timeout: float = 10.0) -> None:
        """Delete the KWOK nodes this object made (their pods go with them), then stop kwok."""
        if self._created_nodes and self.binaries:
            with contextlib.suppress(ClusterError, subprocess.SubprocessError):
                self.kubectl("delete", "node", "--ignore-not-found", "--wait=false", *self._created_nodes)
            self._created_nodes.clear()
        super().stop(timeout)

    def _read_kubeconfig(self) -> None:
        view = json.loads(self.kubectl("config", "view", "--minify", "--raw", "--output=json").stdout)
        cluster: dict[str, Any] = view["clusters"][0]["cluster"]
        self.server = str(cluster["server"])
        self.server_ca = self.pki_dir / "server-ca.crt"
        if "certificate-authority-data" in cluster:
            self.server_ca.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
        elif "certificate-authority" in cluster:
            authority = pathlib.Path(cluster["certificate-authority"])
            if not authority.is_absolute():
                authority = self.kubeconfig.parent / authority
            shutil.copy(authority, self.server_ca)
        else:
            raise ClusterError(f"{self.kubeconfig}: the cluster has no certificate authority to verify it by")

    def _write_session_ca(self) -> None:
        self._new_key(self.ca_key)
        self._openssl(
            "req", "-x509", "-new", "-key", str(self.ca_key), "-sha256", "-days", "30",
            "-subj", "/CN=phalanx-test-webhooks", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", "-out", str(self.ca_cert),
        )  # fmt: skip

    @property
    def host_address(self) -> str:
        if self._host_address is None:
            host = urllib.parse.urlsplit(self.server).hostname or ""
            self._host_address = (
                os.environ.get(HOST_ADDRESS_ENV)
                or (_docker_kind_gateway() if host in ("127.0.0.1", "localhost", "::1") else None)
                or "127.0.0.1"
            )
        return self._host_address

    # ---------------------------------------------------------------- nodes

    def add_gpu_nodes(self, count: int, *args: Any, **kwargs: Any) -> list[str]:
        names = super().add_gpu_nodes(count, *args, **kwargs)
        self._created_nodes += names
        return names

    # ---------------------------------------------------------------- not ours to do

    def _not_ours(self, what: str) -> ClusterError:
        return ClusterError(f"{what} needs the local control plane; {self.server} was not started by this harness")

    def restart(self, name: str, *, graceful: bool = True, timeout: float = 10.0) -> subprocess.Popen[bytes]:
        if name != "kwok":
            raise self._not_ours(f"restarting {name}")
        return super().restart(name, graceful=graceful, timeout=timeout)

    def restart_apiserver(self, *, graceful: bool = False) -> float:
        raise self._not_ours("restarting kube-apiserver")

    def compact_etcd(self) -> int:
        raise self._not_ours("compacting etcd")

    def ssl_context(self) -> Any:
        raise self._not_ours("the admin client certificate")

    def write_kubeconfig(
        self,
        path: pathlib.Path,
        user: str,
        cert: pathlib.Path | None = None,
        key: pathlib.Path | None = None,
        token: str | None = None,
    ) -> pathlib.Path:
        if cert is not None:  # signed by the session CA, which that API server does not trust
            raise self._not_ours("a client certificate")
        return super().write_kubeconfig(path, user, token=token)
