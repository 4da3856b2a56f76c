"""A real Kubernetes control plane plus KWOK fake nodes, as host processes.

    cluster = LocalCluster()     # temporary state dir (or LocalCluster(state_dir, kwok_nodes=N))
    cluster.start()              # etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok
    cluster.add_gpu_nodes(2)     # Ready KWOK nodes with nvidia.com/gpu: 8
    ...                          # KUBECONFIG=cluster.kubeconfig
    cluster.stop()               # every process it started, by PID (whole process group)

CLI (state lives in a directory, so `down`/`status` work from a fresh process):

    python -m tests.cluster.localcluster up [--kwok-nodes N] [--state-dir DIR]
    python -m tests.cluster.localcluster status|down|kubeconfig [--state-dir DIR]

Every process runs in its own process group; its PID (and /proc start time, so a recycled PID is
never signalled) is written to ``<state_dir>/pids/<name>.pid``. See tests/cluster/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import yaml

from tests.cluster import binaries as _binaries
from tests.cluster.ports import free_port

HERE = pathlib.Path(__file__).resolve().parent
KWOK_STAGE_FILES = (HERE / "kwok" / "node-stages.yaml", HERE / "kwok" / "pod-stages.yaml")

# Annotation and label that make kwok manage a node (kwok --manage-nodes-with-*-selector).
KWOK_NODE_ANNOTATION = "kwok.phalanx.dev/node"
KWOK_NODE_LABEL = "kwok.phalanx.dev/node"
KWOK_NODE_ANNOTATION_VALUE = "fake"
NODE_NOT_READY_LABEL = "kwok.phalanx.dev/node-not-ready"

STATE_FILE = "cluster.json"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
KWOK_POD_CIDR = "10.244.0.1/16"  # kwok hands out addresses from the one given
KWOK_NODE_IP = "10.250.0.1"


def default_state_dir() -> pathlib.Path:
    env = os.environ.get("PHALANX_CLUSTER_DIR")
    if env:
        return pathlib.Path(env)
    return _binaries.cache_dir() / "clusters" / "default"


class ClusterError(RuntimeError):
    pass


class ExtraComponent(Protocol):
    """Something started after the control plane and stopped before it (e.g. a real kubelet).

    ``start`` may call ``cluster.spawn(...)`` so its processes are recorded in the state dir and
    also stopped by ``down`` from a fresh process.
    """

    def start(self, cluster: LocalCluster) -> None: ...

    def stop(self) -> None: ...


# --------------------------------------------------------------------------------------------
# small helpers


def _proc_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks), None if gone or a zombie."""
    try:
        raw = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces; it is enclosed in parentheses
    rest = raw[raw.rindex(")") + 2 :].split()
    state, start = rest[0], rest[19]
    if state in ("Z", "X"):
        return None
    return start


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) succeeds while zombies of the group are not reaped; check real members
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            raw = (p / "stat").read_text()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2 :].split()
        if rest[0] not in ("Z", "X") and int(rest[2]) == pgid:
            return True
    return False


def _run(argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True, **kw)


class _Proc:
    """A recorded process: name, pid (== pgid), start time."""

    def __init__(self, name: str, pid: int, start: str | None, popen: subprocess.Popen[bytes] | None):
        self.name = name
        self.pid = pid
        self.start = start
        self.popen = popen

    def alive(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            return False
        cur = _proc_start_time(self.pid)
        return cur is not None and (self.start is None or cur == self.start)


# --------------------------------------------------------------------------------------------


class LocalCluster:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler (+ kwok) on this host.

    Attributes for other tiers: ``state_dir``, ``ca_cert``, ``ca_key``, ``kubeconfig`` (admin,
    system:masters), ``server`` (https URL), ``pki_dir``, ``binaries`` (name -> Path),
    ``sa_key``/``sa_pub`` (service-account signing pair), ``kubelet_client_cert``/``_key`` (the
    apiserver's client identity towards kubelets), ``service_cidr``, ``service_ip``,
    ``server_ca`` (verifies the API server: here the cluster CA), ``host_address`` (where the API
    server reaches processes on this host, such as webhooks). tests/cluster/attached.py has the
    same interface for a cluster someone else started.
    """

    runs_control_plane = True  # restarts, etcd and the cluster's own identities are ours

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        kwok: bool = True,
        kwok_nodes: int = 0,
        extra_components: Iterable[ExtraComponent] = (),
        bind_address: str = "127.0.0.1",
        advertise_address: str = "127.0.0.1",
        extra_sans: Sequence[str] = (),
        not_ready_toleration_seconds: int = 10,
        unreachable_toleration_seconds: int = 10,
        node_monitor_grace_period: str = "20s",
        node_lease_duration_seconds: int = 20,
        extra_apiserver_args: Sequence[str] = (),
        extra_controller_manager_args: Sequence[str] = (),
        verbosity: int = 1,
        start_timeout: float = 120.0,
    ) -> None:
        self._owns_tmp = state_dir is None
        self.state_dir = pathlib.Path(
            state_dir if state_dir is not None else tempfile.mkdtemp(prefix="phalanx-cluster-")
        ).resolve()
        self.kwok_enabled = kwok
        self.kwok_nodes = kwok_nodes
        self.extra_components: list[ExtraComponent] = list(extra_components)
        self.bind_address = bind_address
        self.advertise_address = advertise_address
        self.extra_sans = list(extra_sans)
        self.not_ready_toleration_seconds = not_ready_toleration_seconds
        self.unreachable_toleration_seconds = unreachable_toleration_seconds
        self.node_monitor_grace_period = node_monitor_grace_period
        self.node_lease_duration_seconds = node_lease_duration_seconds
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.extra_controller_manager_args = list(extra_controller_manager_args)
        self.verbosity = verbosity
        self.start_timeout = start_timeout

        self.pki_dir = self.state_dir / "pki"
        self.log_dir = self.state_dir / "logs"
        self.pid_dir = self.state_dir / "pids"
        self.ca_cert = self.pki_dir / "ca.crt"
        self.ca_key = self.pki_dir / "ca.key"
        self.server_ca = self.ca_cert
        self.sa_key = self.pki_dir / "sa.key"
        self.sa_pub = self.pki_dir / "sa.pub"
        self.admin_cert = self.pki_dir / "admin.crt"
        self.admin_key = self.pki_dir / "admin.key"
        self.kubelet_client_cert = self.pki_dir / "apiserver-kubelet-client.crt"
        self.kubelet_client_key = self.pki_dir / "apiserver-kubelet-client.key"
        self.kubeconfig = self.state_dir / "admin.kubeconfig"
        self.service_cidr = SERVICE_CIDR
        self.service_ip = SERVICE_IP
        self.ports: dict[str, int] = {}
        self.server = ""
        self.binaries: dict[str, pathlib.Path] = {}
        self.versions: dict[str, str] = {}
        self._procs: list[_Proc] = []
        self._launches: dict[str, tuple[list[str], dict[str, str] | None, str | None]] = {}
        self._started_components: list[ExtraComponent] = []
        self._ssl: ssl.SSLContext | None = None

    @property
    def host_address(self) -> str:
        return "127.0.0.1"  # the API server runs on this host

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        """Start everything; on any failure stop what was started and re-raise."""
        if (self.state_dir / STATE_FILE).exists() and self._load_procs_alive():
            raise ClusterError(f"a cluster is already running from {self.state_dir}; run `down` first")
        t0 = time.monotonic()
        for attempt in range(3):
            try:
                self._start()
                break
            except ClusterError:
                # free ports are picked before the processes bind them: retry on a lost race
                if attempt < 2 and self._port_race():
                    self._stop_processes()
                    continue
                self._dump_logs_on_failure()
                self.stop()
                raise
            except BaseException:
                self._dump_logs_on_failure()
                self.stop()
                raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _port_race(self) -> bool:
        for p in self._procs:
            with contextlib.suppress(OSError):
                if "address already in use" in (self.log_dir / f"{p.name}.log").read_text(errors="replace"):
                    return True
        return False

    def _start(self) -> None:
        self.binaries = _binaries.ensure_binaries(
            [b for b in _binaries.CONTROL_PLANE_BINARIES if self.kwok_enabled or b != "kwok"]
        )
        self.versions = {m: _binaries.module_version(m) for m in ("kubernetes", "etcd", "kwok")}
        for d in (self.pki_dir, self.log_dir, self.pid_dir):
            d.mkdir(parents=True, exist_ok=True)
        # stale data from a previous run of this state dir
        for stale in ("etcd-data",):
            shutil.rmtree(self.state_dir / stale, ignore_errors=True)
        for p in self.pid_dir.glob("*.pid"):
            p.unlink()
        for p in self.log_dir.glob("*.log"):
            p.unlink()

        self.ports = {
            n: free_port() for n in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
        }
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        self._write_pki()
        self._write_kubeconfigs()
        self._save_state()

        self._start_etcd()
        self._wait(
            "etcd",
            lambda: self._http_ok(f"http://127.0.0.1:{self.ports['etcd']}/health"),
        )
        self._start_apiserver()
        self._wait_apiserver_ready()
        self._start_controller_manager()
        self._start_scheduler()
        if self.kwok_enabled:
            self._start_kwok()
        self._wait(
            "kube-controller-manager /healthz",
            lambda: self._https_ok(self.ports["controller-manager"], "/healthz"),
        )
        self._wait(
            "kube-scheduler /healthz",
            lambda: self._https_ok(self.ports["scheduler"], "/healthz"),
        )
        if self.kwok_enabled:
            self._wait("kwok /healthz", lambda: self._http_ok(f"http://127.0.0.1:{self.ports['kwok']}/healthz"))
        # The default namespace gets its ServiceAccount from the controller-manager.
        self._wait(
            "serviceaccount default/default",
            lambda: self._api_ok("/api/v1/namespaces/default/serviceaccounts/default"),
        )
        for comp in self.extra_components:
            comp.start(self)
            self._started_components.append(comp)
        if self.kwok_nodes:
            self.add_gpu_nodes(self.kwok_nodes)
        self._save_state()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop extra components, then every recorded process (reverse start order)."""
        errors: list[BaseException] = []
        for comp in reversed(self._started_components):
            try:
                comp.stop()
            except Exception as e:  # keep going: the control plane must still be stopped
                errors.append(e)
        self._started_components.clear()
        self._stop_processes(timeout)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / STATE_FILE).unlink()
        if self._owns_tmp and not os.environ.get("PHALANX_KEEP_CLUSTER_DIR"):
            shutil.rmtree(self.state_dir, ignore_errors=True)
        if errors:
            raise ClusterError(f"errors stopping extra components: {errors!r}")

    def _stop_processes(self, timeout: float = 10.0) -> None:
        procs = self._procs or self._load_procs()
        survivors = []
        for proc in reversed(procs):
            self._terminate(proc, timeout)
            if proc.alive():  # keep its PID file, so that a second `down` can try again
                survivors.append(f"{proc.name} (pid {proc.pid})")
                continue
            with contextlib.suppress(FileNotFoundError):
                (self.pid_dir / f"{proc.name}.pid").unlink()
        self._procs = []
        if survivors:
            raise ClusterError(f"still running after SIGKILL: {', '.join(survivors)}")

    @staticmethod
    def _terminate(proc: _Proc, timeout: float) -> None:
        if not proc.alive():
            if proc.popen is not None:
                proc.popen.poll()
            # A child of the group may have outlived the leader. The kernel never reuses a number
            # still in use as a process-group id, so if no process has this PID the group's
            # members (if any) are ours; a live process with another start time is a recycled PID.
            recycled = pathlib.Path(f"/proc/{proc.pid}").exists() and _proc_start_time(proc.pid) not in (
                None,
                proc.start,
            )
            if not recycled and _group_alive(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.popen is not None:
                proc.popen.poll()
            if not proc.alive() and not _group_alive(proc.pid):
                return
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(5)

    # ---------------------------------------------------------------- processes

    def spawn(
        self,
        name: str,
        argv: Sequence[str | os.PathLike[str]],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a process in its own process group, log to logs/<name>.log, record its PID."""
        if any(p.name == name for p in self._procs):
            raise ClusterError(f"a process named {name!r} was already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            popen = subprocess.Popen(
                [str(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,  # own session and process group: pgid == pid
            )
        finally:
            log.close()
        proc = _Proc(name, popen.pid, _proc_start_time(popen.pid), popen)
        self._procs.append(proc)
        self._launches[name] = (
            [str(a) for a in argv],
            dict(env) if env is not None else None,
            str(cwd) if cwd else None,
        )
        (self.pid_dir / f"{name}.pid").write_text(f"{proc.pid} {proc.start or ''}\n")
        self._save_state()
        return popen

    def pid_of(self, name: str) -> int:
        """PID of a process this object started (the control plane's components by name)."""
        proc = next((p for p in self._procs if p.name == name), None)
        if proc is None:
            raise ClusterError(f"{name!r} was not started by this process")
        return proc.pid

    def stop_process(self, name: str, timeout: float = 10.0) -> None:
        """Stop one process this object started (SIGTERM to its group, SIGKILL after ``timeout``)."""
        proc = next((p for p in self._procs if p.name == name), None)
        if proc is None:
            raise ClusterError(f"{name!r} was not started by this process")
        self._terminate(proc, timeout)
        if proc.alive():
            raise ClusterError(f"{name} (pid {proc.pid}) still running after SIGKILL")
        self._procs.remove(proc)
        self._launches.pop(name, None)
        with contextlib.suppress(FileNotFoundError):
            (self.pid_dir / f"{name}.pid").unlink()
        self._save_state()

    def restart(self, name: str, *, graceful: bool = True, timeout: float = 10.0) -> subprocess.Popen[bytes]:
        """Stop one process this object started and start it again the same way: SIGTERM (then
        SIGKILL after ``timeout``), or at once with SIGKILL when not ``graceful`` (a crash)."""
        proc = next((p for p in self._procs if p.name == name), None)
        if proc is None or name not in self._launches:
            raise ClusterError(f"{name!r} was not started by this process")
        # A SIGTERM to us between stopping and recording the new process would leak the new one.
        held = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            if not graceful:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            self._terminate(proc, timeout)
            self._procs.remove(proc)
            argv, env, cwd = self._launches[name]
            return self.spawn(name, argv, env=env, cwd=cwd)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)

    def restart_apiserver(self, *, graceful: bool = False) -> float:
        """Restart kube-apiserver (same port and flags; by default as a crash, SIGKILL); returns the
        seconds until /readyz answered. Every client's connections break and watches must resume:
        its watch cache starts anew, so resuming from an older resourceVersion answers 410 Gone."""
        started = time.monotonic()
        self.restart("kube-apiserver", graceful=graceful)
        self._wait_apiserver_ready()
        return time.monotonic() - started

    def _wait_apiserver_ready(self) -> None:
        """Wait for /readyz; a kube-apiserver that exits while starting, or never turns ready, is
        started again (as a kubelet restarts a static pod failing its probes), twice at most. Each
        time the checks that failed are printed, and they end the error of the last."""
        for attempt in range(3):
            try:
                self._wait("kube-apiserver /readyz", lambda: self._api_ok("/readyz"))
                return
            except ClusterError as error:
                tail = (self.log_dir / "kube-apiserver.log").read_text(errors="replace").splitlines()[-8:]
                why = "\n".join([*tail, *self._readyz_failures()])
                if attempt == 2:
                    raise ClusterError(f"{error}:\n{why}") from error
                print(f"kube-apiserver did not turn ready ({error}); again:\n{why}", file=sys.stderr)
                self.restart("kube-apiserver", graceful=False)
        raise AssertionError("unreachable")

    def _readyz_failures(self) -> list[str]:
        """The checks /readyz?verbose reports failing, or why it could not be asked."""
        try:
            code, body = self.api_get("/readyz?verbose", timeout=5.0)
        except OSError as error:
            return [f"/readyz?verbose: {error}"]
        lines = body.decode(errors="replace").splitlines()
        return [f"/readyz?verbose answered {code}", *(line for line in lines if line.startswith("[-]"))]

    def _etcd(self, call: str, body: Mapping[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.ports['etcd']}/v3/{call}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision (what kube-apiserver does every five
        minutes), so no watch can resume from an older resourceVersion; returns the revision."""
        revision = int(self._etcd("kv/range", {"key": "AA==", "limit": 1})["header"]["revision"])
        self._etcd("kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    def _load_procs(self) -> list[_Proc]:
        order: list[str] = []
        with contextlib.suppress(OSError, ValueError):
            order = json.loads((self.state_dir / STATE_FILE).read_text()).get("processes", [])
        names = order + sorted(p.stem for p in self.pid_dir.glob("*.pid") if p.stem not in order)
        procs = []
        for name in names:
            try:
                pid_s, _, start = (self.pid_dir / f"{name}.pid").read_text().strip().partition(" ")
            except OSError:
                continue
            procs.append(_Proc(name, int(pid_s), start or None, None))
        return procs

    def _load_procs_alive(self) -> bool:
        return any(p.alive() for p in self._load_procs())

    def _check_alive(self) -> None:
        for p in self._procs:
            if not p.alive():
                rc = p.popen.poll() if p.popen else None
                raise ClusterError(f"{p.name} exited (rc={rc}); see {self.log_dir / (p.name + '.log')}")

    def _wait(self, what: str, ok: Any, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.start_timeout)
        while True:
            self._check_alive()
            try:
                if ok():
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}; logs in {self.log_dir}")
            time.sleep(0.2)

    def _dump_logs_on_failure(self) -> None:
        for p in self._procs:
            log = self.log_dir / f"{p.name}.log"
            with contextlib.suppress(OSError):
                tail = log.read_text(errors="replace").splitlines()[-15:]
                print(f"--- {log} (tail)\n" + "\n".join(tail), file=sys.stderr)

    # ---------------------------------------------------------------- components

    def _start_etcd(self) -> None:
        ep, pp = self.ports["etcd"], self.ports["etcd-peer"]
        self.spawn(
            "etcd",
            [
                self.binaries["etcd"],
                "--name=phalanx",
                f"--data-dir={self.state_dir / 'etcd-data'}",
                f"--listen-client-urls=http://127.0.0.1:{ep}",
                f"--advertise-client-urls=http://127.0.0.1:{ep}",
                f"--listen-peer-urls=http://127.0.0.1:{pp}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{pp}",
                f"--initial-cluster=phalanx=http://127.0.0.1:{pp}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self) -> None:
        p = self.pki_dir
        reconciler = "none" if self.advertise_address.startswith("127.") else "lease"
        self.spawn(
            "kube-apiserver",
            [
                self.binaries["kube-apiserver"],
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                f"--bind-address={self.bind_address}",
                f"--advertise-address={self.advertise_address}",
                f"--secure-port={self.ports['apiserver']}",
                f"--tls-cert-file={p / 'apiserver.crt'}",
                f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={self.ca_cert}",
                f"--kubelet-client-certificate={self.kubelet_client_cert}",
                f"--kubelet-client-key={self.kubelet_client_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.sa_pub}",
                f"--service-account-signing-key-file={self.sa_key}",
                f"--service-cluster-ip-range={self.service_cidr}",
                "--authorization-mode=Node,RBAC",
                # OwnerReferencesPermissionEnforcement as OpenShift runs it: setting an owner
                # reference needs delete on the child, blockOwnerDeletion update on the owner's finalizers
                "--enable-admission-plugins=NodeRestriction,OwnerReferencesPermissionEnforcement",
                "--allow-privileged=true",
                f"--endpoint-reconciler-type={reconciler}",
                f"--default-not-ready-toleration-seconds={self.not_ready_toleration_seconds}",
                f"--default-unreachable-toleration-seconds={self.unreachable_toleration_seconds}",
                "--profiling=false",
                f"--v={self.verbosity}",
                *self.extra_apiserver_args,
            ],
        )

    def _start_controller_manager(self) -> None:
        kc = self.state_dir / "controller-manager.kubeconfig"
        self.spawn(
            "kube-controller-manager",
            [
                self.binaries["kube-controller-manager"],
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['controller-manager']}",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.sa_key}",
                f"--root-ca-file={self.ca_cert}",
                f"--cluster-signing-cert-file={self.ca_cert}",
                f"--cluster-signing-key-file={self.ca_key}",
                "--node-monitor-period=2s",
                f"--node-monitor-grace-period={self.node_monitor_grace_period}",
                "--node-startup-grace-period=30s",
                "--kube-api-qps=100",
                "--kube-api-burst=200",
                "--concurrent-gc-syncs=20",
                "--profiling=false",
                f"--v={self.verbosity}",
                *self.extra_controller_manager_args,
            ],
        )

    def _start_scheduler(self) -> None:
        kc = self.state_dir / "scheduler.kubeconfig"
        self.spawn(
            "kube-scheduler",
            [
                self.binaries["kube-scheduler"],
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['scheduler']}",
                "--profiling=false",
                f"--v={self.verbosity}",
            ],
        )

    def _start_kwok(self) -> None:
        home = self.state_dir / "kwok-home"  # kwok also reads ~/.kwok/kwok.yaml: isolate it
        home.mkdir(exist_ok=True)
        argv: list[str | os.PathLike[str]] = [
            self.binaries["kwok"],
            f"--kubeconfig={self.kubeconfig}",
            "--manage-all-nodes=false",
            # both must match; the label is what the apiserver filters on, so removing it makes
            # kwok drop the node (no more lease renewals): a lost node
            f"--manage-nodes-with-label-selector={KWOK_NODE_LABEL}={KWOK_NODE_ANNOTATION_VALUE}",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={KWOK_NODE_ANNOTATION_VALUE}",
            f"--cidr={KWOK_POD_CIDR}",
            f"--node-ip={KWOK_NODE_IP}",
            f"--node-lease-duration-seconds={self.node_lease_duration_seconds}",
            f"--server-address=127.0.0.1:{self.ports['kwok']}",
        ]
        for f in KWOK_STAGE_FILES:
            argv.append(f"--config={f}")
        env = dict(os.environ, HOME=str(home))
        env.pop("KUBECONFIG", None)
        self.spawn("kwok", argv, env=env)

    # ---------------------------------------------------------------- PKI and kubeconfigs

    def _openssl(self, *args: str) -> None:
        openssl = shutil.which("openssl")
        if not openssl:
            raise ClusterError("openssl is required to generate the cluster PKI")
        _run([openssl, *args])

    def _new_key(self, path: pathlib.Path) -> None:
        self._openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
        path.chmod(0o600)

    def issue_cert(
        self,
        name: str,
        subject: str,
        *,
        sans: Sequence[str] = (),
        client: bool = True,
        server: bool = False,
        directory: pathlib.Path | None = None,
    ) -> tuple[pathlib.Path, pathlib.Path]:
        """Sign a new EC key pair with the cluster CA; return (cert, key) paths.

        ``subject`` is an openssl subject such as ``/O=system:nodes/CN=system:node:worker-0``;
        ``sans`` entries look like ``IP:10.0.0.5`` or ``DNS:worker-0``.
        """
        d = directory or self.pki_dir
        d.mkdir(parents=True, exist_ok=True)
        crt, key, csr, ext = (d / f"{name}.{s}" for s in ("crt", "key", "csr", "ext"))
        self._new_key(key)
        self._openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
        usages = [u for u, on in (("clientAuth", client), ("serverAuth", server)) if on]
        lines = [
            "basicConstraints=CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            f"extendedKeyUsage={','.join(usages)}",
        ]
        if sans:
            lines.append(f"subjectAltName={','.join(sans)}")
        ext.write_text("\n".join(lines) + "\n")
        serial = str(int.from_bytes(os.urandom(8), "big"))
        self._openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.ca_cert), "-CAkey", str(self.ca_key),
            "-set_serial", serial, "-days", "3650", "-sha256", "-extfile", str(ext), "-out", str(crt),
        )  # fmt: skip
        csr.unlink()
        ext.unlink()
        return crt, key

    def _write_pki(self) -> None:
        self._new_key(self.ca_key)
        self._openssl(
            "req", "-x509", "-new", "-key", str(self.ca_key), "-sha256", "-days", "3650",
            "-subj", "/CN=phalanx-local-ca", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", "-out", str(self.ca_cert),
        )  # fmt: skip
        sans = [
            "IP:127.0.0.1",
            f"IP:{self.service_ip}",
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
        for extra in [self.advertise_address, self.bind_address, *self.extra_sans]:
            if extra in ("0.0.0.0", "::", ""):
                continue
            if extra.startswith(("IP:", "DNS:")):
                entry = extra
            else:
                entry = f"IP:{extra}" if extra.replace(".", "").isdigit() or ":" in extra else f"DNS:{extra}"
            if entry not in sans:
                sans.append(entry)
        self.issue_cert("apiserver", "/CN=kube-apiserver", sans=sans, client=False, server=True)
        self.issue_cert("admin", "/O=system:masters/CN=phalanx-admin")
        self.issue_cert("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client")
        self.issue_cert("controller-manager", "/CN=system:kube-controller-manager")
        self.issue_cert("scheduler", "/CN=system:kube-scheduler")
        # service-account token signing pair
        self._new_key(self.sa_key)
        self._openssl("pkey", "-in", str(self.sa_key), "-pubout", "-out", str(self.sa_pub))

    def write_kubeconfig(
        self,
        path: pathlib.Path,
        user: str,
        cert: pathlib.Path | None = None,
        key: pathlib.Path | None = None,
        token: str | None = None,
    ) -> pathlib.Path:
        """Write a kubeconfig for this cluster (client cert or bearer token)."""
        creds: dict[str, str] = {}
        if cert is not None and key is not None:
            creds = {"client-certificate": str(cert), "client-key": str(key)}
        if token is not None:
            creds["token"] = token
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "phalanx",
                    "cluster": {"server": self.server, "certificate-authority": str(self.server_ca)},
                }
            ],
            "users": [{"name": user, "user": creds}],
            "contexts": [{"name": "phalanx", "context": {"cluster": "phalanx", "user": user}}],
            "current-context": "phalanx",
        }
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        path.chmod(0o600)
        return path

    def _write_kubeconfigs(self) -> None:
        p = self.pki_dir
        self.write_kubeconfig(self.kubeconfig, "phalanx-admin", self.admin_cert, self.admin_key)
        self.write_kubeconfig(
            self.state_dir / "controller-manager.kubeconfig", "kube-controller-manager",
            p / "controller-manager.crt", p / "controller-manager.key",
        )  # fmt: skip
        self.write_kubeconfig(
            self.state_dir / "scheduler.kubeconfig",
            "kube-scheduler",
            p / "scheduler.crt",
            p / "scheduler.key",
        )

    # ---------------------------------------------------------------- state

    def _save_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ca_cert": str(self.ca_cert),
            "ca_key": str(self.ca_key),
            "ports": self.ports,
            "versions": self.versions,
            "binaries": {k: str(v) for k, v in self.binaries.items()},
            "processes": [p.name for p in self._procs],
            "pid": os.getpid(),
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / STATE_FILE)

    @classmethod
    def from_state_dir(cls, state_dir: str | os.PathLike[str]) -> LocalCluster:
        """Attach to a cluster started by another process (for `down`/`status`)."""
        c = cls(state_dir)
        c._owns_tmp = False
        with contextlib.suppress(OSError, ValueError):
            st = json.loads((c.state_dir / STATE_FILE).read_text())
            c.server = st.get("server", "")
            c.ports = st.get("ports", {})
            c.versions = st.get("versions", {})
            c.binaries = {k: pathlib.Path(v) for k, v in st.get("binaries", {}).items()}
            c.kwok_enabled = "kwok" in st.get("processes", [])
        return c

    # ---------------------------------------------------------------- HTTP probes

    def ssl_context(self) -> ssl.SSLContext:
        """An SSL context trusting the cluster CA and presenting the admin client cert."""
        if self._ssl is None:
            ctx = ssl.create_default_context(cafile=str(self.ca_cert))
            ctx.load_cert_chain(str(self.admin_cert), str(self.admin_key))
            self._ssl = ctx
        return self._ssl

    def api_get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        req = urllib.request.Request(self.server + path)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context()) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def _api_ok(self, path: str) -> bool:
        return self.api_get(path, timeout=2.0)[0] == 200

    def _https_ok(self, port: int, path: str) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # self-signed serving certs of kcm/scheduler
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", timeout=2.0, context=ctx) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def healthy(self) -> bool:
        try:
            return self._api_ok("/readyz")
        except Exception:
            return False

    # ---------------------------------------------------------------- kubectl and nodes

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        kubectl = self.binaries.get("kubectl") or _binaries.ensure_binaries(["kubectl"])["kubectl"]
        proc = subprocess.run(
            [str(kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def add_gpu_nodes(
        self,
        count: int,
        gpus_per_node: int = 8,
        resource: str = "nvidia.com/gpu",
        cpu: str = "64",
        memory: str = "512Gi",
        labels: Mapping[str, str] | None = None,
        *,
        name_prefix: str = "kwok-gpu-",
        pods: str = "110",
        taints: Sequence[Mapping[str, str]] = (),
        internal_ip: str | None = None,
        pod_cidr: str | None = None,
        wait: bool = True,
        timeout: float = 60.0,
    ) -> list[str]:
        """Create ``count`` KWOK nodes with that capacity; return their names (Ready if ``wait``).

        ``internal_ip`` is the nodes' address, which KWOK also gives host-network pods on them
        (127.0.0.1 makes such a pod reachable at a port a test serves on this host); ``pod_cidr``
        (``spec.podCIDR``) is where KWOK takes their other pods' addresses from (one pool for every
        node given the same: a loopback range makes each pod reachable at its own address)."""
        if not self.kwok_enabled:
            raise ClusterError("this cluster runs without kwok")
        existing = set(self.kubectl("get", "nodes", "-o", "name").stdout.split())
        names: list[str] = []
        i = 0
        while len(names) < count:
            name = f"{name_prefix}{i}"
            i += 1
            if f"node/{name}" not in existing:
                names.append(name)
        capacity = {"cpu": cpu, "memory": memory, "pods": pods, "ephemeral-storage": "1Ti"}
        if gpus_per_node:
            capacity[resource] = str(gpus_per_node)
        kubelet_version = self.versions.get("kubernetes") or _binaries.module_version("kubernetes")
        docs = []
        for name in names:
            node_labels = {
                KWOK_NODE_LABEL: KWOK_NODE_ANNOTATION_VALUE,
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **({"nvidia.com/gpu.count": str(gpus_per_node)} if gpus_per_node else {}),
                **(labels or {}),
            }
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "labels": node_labels,
                        "annotations": {
                            KWOK_NODE_ANNOTATION: KWOK_NODE_ANNOTATION_VALUE,
                            "node.alpha.kubernetes.io/ttl": "0",
                        },
                    },
                    "spec": {
                        **({"taints": [dict(t) for t in taints]} if taints else {}),
                        **({"podCIDR": pod_cidr} if pod_cidr else {}),
                    },
                    "status": {
                        "capacity": capacity,
                        "allocatable": capacity,
                        "nodeInfo": {"kubeletVersion": kubelet_version, "kubeProxyVersion": kubelet_version},
                        **(
                            {
                                "addresses": [
                                    {"type": "InternalIP", "address": internal_ip},
                                    {"type": "Hostname", "address": name},
                                ]
                            }
                            if internal_ip
                            else {}
                        ),
                    },
                }
            )
        self.kubectl("create", "-f", "-", input=yaml.safe_dump_all(docs))
        # The API keeps status on create; make sure (older servers drop it), then wait.
        for name in names:
            node = json.loads(self.kubectl("get", "node", name, "-o", "json").stdout)
            if node.get("status", {}).get("allocatable", {}).get(resource) != capacity.get(resource):
                self.kubectl(
                    "patch", "node", name, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"capacity": capacity, "allocatable": capacity}}),
                )  # fmt: skip
        if wait:
            self.wait_nodes_ready(names, timeout=timeout)
        return names

    def set_node_not_ready(self, name: str, not_ready: bool = True, wait: bool = True) -> None:
        """KWOK node reports Ready=False (label kwok.phalanx.dev/node-not-ready) or recovers."""
        label = f"{NODE_NOT_READY_LABEL}=true" if not_ready else f"{NODE_NOT_READY_LABEL}-"
        self.kubectl("label", "node", name, "--overwrite", label)
        if wait:
            self.wait_nodes_ready([name], ready=not not_ready)

    def set_node_lost(self, name: str, lost: bool = True) -> None:
        """Stop (or resume) kwok's heartbeats and lease renewals for a node: after
        --node-monitor-grace-period the node turns Unknown and gets the unreachable taint."""
        value = f"{KWOK_NODE_LABEL}-" if lost else f"{KWOK_NODE_LABEL}={KWOK_NODE_ANNOTATION_VALUE}"
        self.kubectl("label", "node", name, "--overwrite", value)

    def finish_pod(
        self,
        namespace: str,
        name: str,
        exit_code: int = 0,
        *,
        reason: str | None = None,
        message: str | None = None,
        container: str | None = None,
    ) -> None:
        """Make a Running KWOK pod terminate with ``exit_code`` (0: Succeeded, else Failed)."""
        annotations = {"kwok.phalanx.dev/reason": reason, "kwok.phalanx.dev/message": message,
                       "kwok.phalanx.dev/container": container}  # fmt: skip
        pairs = [f"{k}={v}" for k, v in annotations.items() if v is not None]
        if pairs:
            self.kubectl("annotate", "pod", name, f"--namespace={namespace}", "--overwrite", *pairs)
        self.kubectl(
            "label", "pod", name, f"--namespace={namespace}", "--overwrite", f"kwok.phalanx.dev/exit-code={exit_code}"
        )

    def wait_nodes_ready(self, names: Iterable[str], timeout: float = 60.0, ready: bool = True) -> None:
        pending = set(names)
        deadline = time.monotonic() + timeout
        want = "True" if ready else "False"
        while pending:
            out = self.kubectl("get", "nodes", "-o", "json").stdout
            for n in json.loads(out)["items"]:
                conds = {c["type"]: c["status"] for c in n.get("status", {}).get("conditions", [])}
                if n["metadata"]["name"] in pending and conds.get("Ready") == want:
                    pending.discard(n["metadata"]["name"])
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"nodes not Ready={want} after {timeout}s: {sorted(pending)}")
            time.sleep(0.25)

    def status(self) -> dict[str, Any]:
        procs = self._procs or self._load_procs()
        info: dict[str, Any] = {
            "state_dir": str(self.state_dir),
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "processes": {p.name: {"pid": p.pid, "alive": p.alive()} for p in procs},
            "ready": self.healthy() if self.server else False,
        }
        if info["ready"]:
            with contextlib.suppress(Exception):
                nodes = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
                info["nodes"] = {
                    n["metadata"]["name"]: next(
                        (c["status"] for c in n["status"].get("conditions", []) if c["type"] == "Ready"), "?"
                    )
                    for n in nodes
                }
        return info


# --------------------------------------------------------------------------------------------
# CLI


def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cluster.localcluster", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("up", "down", "status", "kubeconfig"):
        sp = sub.add_parser(name)
        sp.add_argument(
            "--state-dir",
            type=pathlib.Path,
            default=None,
            help="default: $PHALANX_CLUSTER_DIR or <cache>/clusters/default",
        )
        if name == "up":
            sp.add_argument("--kwok-nodes", type=int, default=0, help="KWOK GPU nodes to create")
            sp.add_argument("--gpus-per-node", type=int, default=8)
            sp.add_argument("--no-kwok", action="store_true", help="control plane only")
    args = ap.parse_args(argv)
    state_dir = (args.state_dir or default_state_dir()).resolve()

    if args.cmd == "up":
        state_dir.mkdir(parents=True, exist_ok=True)
        c = LocalCluster(state_dir, kwok=not args.no_kwok)
        c.start()
        if args.kwok_nodes:
            c.add_gpu_nodes(args.kwok_nodes, gpus_per_node=args.gpus_per_node)
        print(f"cluster up in {c.startup_seconds:.1f}s: {c.server}", file=sys.stderr)
        print(f"export KUBECONFIG={c.kubeconfig}")
        return 0
    c = LocalCluster.from_state_dir(state_dir)
    if args.cmd == "down":
        c.stop()
        print(f"stopped cluster in {state_dir}", file=sys.stderr)
        return 0
    if args.cmd == "status":
        info = c.status()
        print(json.dumps(info, indent=2))
        return 0 if info["ready"] else 1
    if args.cmd == "kubeconfig":
        if not c.kubeconfig.exists():
            print(f"no cluster in {state_dir}", file=sys.stderr)
            return 1
        print(c.kubeconfig)
        return 0
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
