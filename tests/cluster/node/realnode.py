"""One real Kubernetes node on this host: private containerd + CNI bridge + CoreDNS + kube-proxy
+ kubelet, all as host processes (tier D of the offline-cluster notes).

Usage (the ``extra_components`` protocol of ``tests/cluster/localcluster.py``)::

    node = RealNode()                 # name "real-node"
    cluster.extra_components.append(node)
    cluster.start()                   # calls node.start(cluster) after the control plane
    ...
    cluster.stop()                    # calls node.stop() before the control plane

What the node looks like from the API:

* name ``real-node``, label ``phalanx.dev/real-node=true``, taint
  ``phalanx.dev/real-node=true:NoSchedule`` (so pods meant for KWOK nodes never land here;
  pods for this node need ``nodeSelector`` + toleration, see :meth:`RealNode.pod_placement`);
* images: ``registry.k8s.io/pause:3.10.1`` and ``phalanx.local/trainer:dev``
  (``imagePullPolicy: Never``/``IfNotPresent``; there is no registry);
* pod network ``10.85.0.0/24`` on bridge ``phx0`` (gateway ``10.85.0.1``);
* cluster DNS: CoreDNS on ``10.85.0.1:53`` (``cluster.local``);
* Service ClusterIPs via kube-proxy (iptables mode), so ``KUBERNETES_SERVICE_HOST`` works
  when the API server advertises an address reachable from pods (see README.md).

Requires root and the packages from ``install-packages.sh`` (run automatically when missing).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.cluster.ports import free_port

from . import dockerfile_images, images
from .containerd import Containerd, remove_empty_default_dirs
from .host import (
    NODE_DIR,
    HostProcess,
    host_ip,
    node_cache_dir,
    run,
    stop_pid,
    stop_pidfile,
    wait_for,
)

log = logging.getLogger(__name__)

NODE_LABEL = "phalanx.dev/real-node"
BRIDGE = "phx0"
# Not 10.244.0.0/16: LocalCluster hands that range to KWOK's fake pods.
POD_CIDR = "10.85.0.0/24"
GATEWAY = "10.85.0.1"
CLUSTER_DOMAIN = "cluster.local"
CNI_NETWORK = "phalanx-realnode"

# Sysctls that kubelet (protectKernelDefaults=false) rewrites host-wide; restored on stop().
_KUBELET_SYSCTLS = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
]


def _yaml(obj: Any) -> str:
    """JSON is YAML; every config file here is written as JSON."""
    return json.dumps(obj, indent=2) + "\n"


class RealNode:
    """A kubelet-backed node on this host. See the module docstring."""

    def __init__(
        self,
        name: str = "real-node",
        *,
        taint: bool = True,
        trainer_image: bool = True,
        persistent_images: bool = True,
        dns: bool | None = None,
        ready_timeout: float = 180.0,
    ) -> None:
        self.name = name
        self.taint = taint
        self.trainer_image = trainer_image
        self.persistent_images = persistent_images and not os.environ.get("PHALANX_REALNODE_EPHEMERAL")
        self.ready_timeout = ready_timeout
        self.dns = dns if dns is not None else not os.environ.get("PHALANX_REALNODE_NO_DNS")
        self.cluster: Any = None
        self.dir: Path | None = None  # <cluster.state_dir>/realnode (pids, logs, configs)
        self.run_dir: Path | None = None  # short path for sockets/kubelet root
        self.containerd: Containerd | None = None
        self.procs: dict[str, HostProcess] = {}
        self.timings: dict[str, float] = {}
        self.host_ip = ""
        self.kubectl_bin: Path | None = None
        self._saved_sysctls: dict[str, str] = {}
        self._host_lock_fd: int | None = None

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def pod_placement() -> dict[str, Any]:
        """Pod-spec fragment that pins a pod to the real node (merge into ``spec``)."""
        return {
            "nodeSelector": {NODE_LABEL: "true"},
            "tolerations": [{"key": NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
        }

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        assert self.cluster is not None and self.kubectl_bin is not None
        return run(
            [self.kubectl_bin, "--kubeconfig", self.cluster.kubeconfig, *args],
            check=check,
            input=input,
            timeout=timeout,
        )

    # ------------------------------------------------------------------- start
    def start(self, cluster: Any) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("RealNode needs root (containerd, kubelet, iptables, mounts)")
        # One real node per host: the bridge, kubepods cgroups and kubelet's iptables chains
        # are host-wide. Fail before touching anything if another run holds the host.
        self._host_lock_fd = _acquire_host_lock()
        t_start = time.monotonic()
        logs = None
        try:
            self.cluster = cluster
            run(["sh", NODE_DIR / "install-packages.sh"], capture=False)
            from tests.cluster.binaries import ensure_binaries

            bins = ensure_binaries(["kubelet", "kube-proxy", "kubectl"] + (["coredns"] if self.dns else []))
            self.kubectl_bin = bins["kubectl"]
            self.host_ip = host_ip()

            self.dir = Path(cluster.state_dir) / "realnode"
            self.dir.mkdir(parents=True, exist_ok=True)
            self._stop_leftovers()
            # unix socket paths must stay < 108 bytes: keep kubelet root/containerd state short
            self.run_dir = Path(f"/run/phx-{secrets.token_hex(4)}")
            self.run_dir.mkdir(parents=True)
            (self.dir / "run-dir").write_text(str(self.run_dir) + "\n")
            logs = self.dir / "logs"
            logs.mkdir(exist_ok=True)

            self._write_certs()
            self._setup_bridge()
            cni_dir = self.dir / "cni"
            self._write_cni(cni_dir)

            if self.persistent_images:
                ctd_root = node_cache_dir() / "containerd" / "root"
            else:
                ctd_root = self.run_dir / "containerd-root"
            self.containerd = Containerd(
                root=ctd_root,
                state=self.run_dir / "containerd",
                cni_conf_dir=cni_dir,
                sandbox_image=images.PAUSE_REF,
                log_dir=logs,
                inherit_fds=(self._host_lock_fd,),  # host lock lives as long as containerd
            )
            t0 = time.monotonic()
            self.containerd.start()
            (self.dir / "containerd.pid").write_text(f"{self.containerd.proc.pid}\n")
            self.timings["containerd_start"] = round(time.monotonic() - t0, 1)
            self._import_images()

            self._rbac()
            if self.dns:
                self._start_coredns(bins["coredns"], logs)
            self._start_kubelet(bins["kubelet"], logs)
            self._start_kube_proxy(bins["kube-proxy"], logs)
            t0 = time.monotonic()
            self.wait_ready(self.ready_timeout)
            self.timings["node_ready_after_kubelet"] = round(time.monotonic() - t0, 1)
        except BaseException:
            log.exception("RealNode start failed; logs in %s", logs)
            self._dump_tails()
            self.stop()
            raise
        self.timings["start_total"] = round(time.monotonic() - t_start, 1)
        log.info("real node %s ready: %s", self.name, self.timings)

    def _stop_leftovers(self) -> None:
        """Stop processes of a crashed earlier start on the same state dir."""
        assert self.dir is not None
        for pid_file in sorted(self.dir.glob("*.pid")):
            stop_pidfile(pid_file)
        Containerd.remove_recorded_dir(self.dir / "run-dir")

    def _dump_tails(self) -> None:
        for p in self.procs.values():
            log.error("---- %s (%s) ----\n%s", p.name, p.log_path, p.tail(40))
        if self.containerd is not None:
            log.error("---- containerd ----\n%s", self.containerd.proc.tail(40))

    # ------------------------------------------------------------------- certs
    def _sign(self, stem: str, subject: str, ext: str) -> tuple[Path, Path]:
        assert self.dir is not None
        pki = self.dir / "pki"
        pki.mkdir(exist_ok=True)
        key, csr, crt, extf = (pki / f"{stem}.key", pki / f"{stem}.csr", pki / f"{stem}.crt", pki / f"{stem}.ext")
        run(["openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-subj", subject, "-out", csr])
        extf.write_text(ext)
        run(
            [
                "openssl",
                "x509",
                "-req",
                "-in",
                csr,
                "-CA",
                self.cluster.ca_cert,
                "-CAkey",
                self.cluster.ca_key,
                "-set_serial",
                str(secrets.randbits(63)),
                "-days",
                "30",
                "-sha256",
                "-extfile",
                extf,
                "-out",
                crt,
            ]
        )
        csr.unlink()
        extf.unlink()
        key.chmod(0o600)
        return crt, key

    def _kubeconfig(self, stem: str, user: str, crt: Path, key: Path) -> Path:
        assert self.dir is not None
        path = self.dir / f"{stem}.kubeconfig"
        path.write_text(
            _yaml(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "local",
                            "cluster": {
                                "server": self.cluster.server,
                                "certificate-authority": str(self.cluster.ca_cert),
                            },
                        }
                    ],
                    "users": [{"name": user, "user": {"client-certificate": str(crt), "client-key": str(key)}}],
                    "contexts": [{"name": "default", "context": {"cluster": "local", "user": user}}],
                    "current-context": "default",
                }
            )
        )
        path.chmod(0o600)
        return path

    def _write_certs(self) -> None:
        client_ext = (
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=clientAuth\n"
        )
        crt, key = self._sign("kubelet-client", f"/O=system:nodes/CN=system:node:{self.name}", client_ext)
        self.kubelet_kubeconfig = self._kubeconfig("kubelet", f"system:node:{self.name}", crt, key)
        crt, key = self._sign("kube-proxy", "/CN=system:kube-proxy", client_ext)
        self.proxy_kubeconfig = self._kubeconfig("kube-proxy", "system:kube-proxy", crt, key)
        # kubelet serving cert signed by the cluster CA (IP SANs = host IP, loopback)
        serving_ext = (
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage=serverAuth\nsubjectAltName=DNS:{self.name},DNS:localhost,"
            f"IP:{self.host_ip},IP:127.0.0.1\n"
        )
        self.serving_crt, self.serving_key = self._sign(
            "kubelet-serving", f"/O=system:nodes/CN=system:node:{self.name}", serving_ext
        )

    def _rbac(self) -> None:
        """Bind system:node to our node user (needed when the API server runs without the Node
        authorizer; harmless with it) -- kube-proxy's system:node-proxier binding is built in."""
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=_yaml(
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": f"phalanx:real-node:{self.name}"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
                    "subjects": [
                        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": f"system:node:{self.name}"}
                    ],
                }
            ),
        )

    # ----------------------------------------------------------------- network
    def _setup_bridge(self) -> None:
        """Create the CNI bridge ourselves so CoreDNS can bind the gateway before the first pod."""
        if run(["ip", "link", "show", BRIDGE], check=False).returncode != 0:
            run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "replace", f"{GATEWAY}/{POD_CIDR.split('/')[1]}", "dev", BRIDGE])
        run(["ip", "link", "set", BRIDGE, "up"])
        for key, want in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
            p = Path("/proc/sys") / key
            if p.exists() and p.read_text().strip() != want:
                self._saved_sysctls.setdefault(key, p.read_text().strip())
                p.write_text(want)

    def _write_cni(self, conf_dir: Path) -> None:
        """bridge + host-local (+ portmap) conflist. Loopback: containerd's CRI plugin sets up
        ``lo`` itself with the ``loopback`` binary from the same bin_dir."""
        conf_dir.mkdir(parents=True, exist_ok=True)
        for old in conf_dir.iterdir():
            old.unlink()
        assert self.dir is not None
        conf = {
            "cniVersion": "0.4.0",
            "name": CNI_NETWORK,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "promiscMode": False,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(self.dir / "cni-ipam"),
                        "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (conf_dir / "10-phalanx.conflist").write_text(_yaml(conf))

    # ----------------------------------------------------------------- images
    def _import_images(self) -> None:
        assert self.containerd is not None
        pause = images.build_pause_image()
        took = self.containerd.ensure_image(pause.archive, pause.archive.stem)
        if took is not None:
            self.timings[f"import_{pause.ref}"] = round(took, 1)
        if self.trainer_image:
            build, took = dockerfile_images.import_into(self.containerd, "trainer")
            if build is not None and not build.cached:
                self.timings["trainer_build"] = build.timings.get("total", 0.0)
            if took is not None:
                self.timings[f"import_{dockerfile_images.REFS['trainer']}"] = took
        stale = self.containerd.remove_stale_image_ids()
        if stale:
            log.info("removed %d replaced image(s) from containerd", len(stale))

    # ---------------------------------------------------------------- coredns
    def _start_coredns(self, binary: Path, logs: Path) -> None:
        assert self.dir is not None
        ready_port, health_port = free_port(), free_port()
        corefile = self.dir / "Corefile"
        corefile.write_text(f""".:53 {{
    bind {GATEWAY}
    errors
    ready 127.0.0.1:{ready_port}
    health 127.0.0.1:{health_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {self.cluster.kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    forward . /etc/resolv.conf
}}
""")
        p = HostProcess("coredns", [binary, "-conf", corefile], log_dir=logs, pid_dir=self.dir)
        p.start()
        self.procs["coredns"] = p

        def ready() -> bool:
            p.check_alive()
            return _http_ok(ready_port)

        wait_for(ready, 60, what="CoreDNS /ready")

    # ---------------------------------------------------------------- kubelet
    def _start_kubelet(self, binary: Path, logs: Path) -> None:
        assert self.dir is not None and self.run_dir is not None and self.containerd is not None
        for key in _KUBELET_SYSCTLS:
            sysctl = Path("/proc/sys") / key
            if sysctl.exists():
                self._saved_sysctls.setdefault(key, sysctl.read_text().strip())
        root = self.run_dir / "kubelet"
        root.mkdir(parents=True, exist_ok=True)
        self.kubelet_port = free_port("0.0.0.0")
        self.kubelet_healthz = free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "0.0.0.0",
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.kubelet_healthz,
            "tlsCertFile": str(self.serving_crt),
            "tlsPrivateKeyFile": str(self.serving_key),
            "authentication": {
                "x509": {"clientCAFile": str(self.cluster.ca_cert)},
                "webhook": {"enabled": False},
                # LocalCluster's API server presents a client cert signed by the same CA
                "anonymous": {"enabled": False},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": True,
            "enforceNodeAllocatable": ["pods"],
            "failSwapOn": False,
            "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd.socket}",
            "runtimeRequestTimeout": "10m",
            "clusterDNS": [GATEWAY] if self.dns else [],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": "/etc/resolv.conf",
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "imageMinimumGCAge": "876000h",
            "evictionHard": {
                "memory.available": "50Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
                "imagefs.inodesFree": "1%",
            },
            "evictionPressureTransitionPeriod": "10s",
            "protectKernelDefaults": False,
            "serializeImagePulls": False,
            "registerNode": True,
            "registerWithTaints": (
                [{"key": NODE_LABEL, "value": "true", "effect": "NoSchedule"}] if self.taint else []
            ),
            "nodeStatusUpdateFrequency": "5s",
            "nodeStatusReportFrequency": "30s",
            "syncFrequency": "10s",
            "shutdownGracePeriod": "0s",
            "podPidsLimit": -1,
            "maxPods": 110,
            "containerLogMaxSize": "10Mi",
            "containerLogMaxFiles": 2,
            "staticPodPath": "",
            "podCIDR": POD_CIDR,
            "volumePluginDir": str(root / "volume-plugins"),
            "localStorageCapacityIsolation": True,
        }
        cfg_path = self.dir / "kubelet-config.yaml"
        cfg_path.write_text(_yaml(config))
        argv: list[str | Path] = [
            binary,
            f"--config={cfg_path}",
            f"--kubeconfig={self.kubelet_kubeconfig}",
            f"--root-dir={root}",
            f"--cert-dir={root / 'pki'}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.host_ip}",
            f"--node-labels={NODE_LABEL}=true",
            "--oom-score-adj=0",  # no CAP_SYS_RESOURCE: cannot lower it anyway
            "--v=2",
        ]
        p = HostProcess("kubelet", argv, log_dir=logs, pid_dir=self.dir)
        p.start()
        self.procs["kubelet"] = p

    # -------------------------------------------------------------- kube-proxy
    def _start_kube_proxy(self, binary: Path, logs: Path) -> None:
        assert self.dir is not None
        for key in ("net/ipv4/conf/all/route_localnet",):
            sysctl = Path("/proc/sys") / key
            if sysctl.exists():
                self._saved_sysctls.setdefault(key, sysctl.read_text().strip())
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.proxy_kubeconfig)},
            "mode": "iptables",
            "oomScoreAdj": 0,
            "clusterCIDR": POD_CIDR,
            "hostnameOverride": self.name,
            "bindAddress": "0.0.0.0",
            "healthzBindAddress": f"127.0.0.1:{free_port()}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            "iptables": {
                "masqueradeAll": False,
                "syncPeriod": "10s",
                "minSyncPeriod": "0s",
                "localhostNodePorts": False,
            },
        }
        self.proxy_config = self.dir / "kube-proxy.yaml"
        self.proxy_config.write_text(_yaml(config))
        self.kube_proxy_bin = binary
        p = HostProcess(
            "kube-proxy", [binary, f"--config={self.proxy_config}", "--v=2"], log_dir=logs, pid_dir=self.dir
        )
        p.start()
        self.procs["kube-proxy"] = p

    # ------------------------------------------------------------------ status
    def node_ready(self) -> bool:
        for p in self.procs.values():
            p.check_alive()
        out = self.kubectl(
            "get", "node", self.name, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False
        )
        return out.returncode == 0 and out.stdout.strip() == "True"

    def wait_ready(self, timeout: float = 180.0) -> None:
        wait_for(self.node_ready, timeout, interval=1.0, what=f"node {self.name} Ready")

    def api_endpoint_for_pods(self) -> str | None:
        """``ip:port`` behind the ``kubernetes`` Service, or None if it has no usable address."""
        out = self.kubectl("get", "endpoints", "kubernetes", "-n", "default", "-o", "json", check=False)
        if out.returncode != 0:
            return None
        for subset in json.loads(out.stdout).get("subsets") or []:
            for addr in subset.get("addresses") or []:
                ip = addr.get("ip", "")
                if ip and not ip.startswith("127."):
                    return f"{ip}:{subset['ports'][0]['port']}"
        return None

    # -------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Stop everything we started and remove what it left behind. Safe to call twice."""
        if self._host_lock_fd is None:
            return  # never started (or already stopped): nothing on this host is ours
        if self.cluster is not None and self.kubectl_bin is not None:
            # let the control plane forget the node (its pods get garbage-collected)
            with contextlib.suppress(Exception):
                self.kubectl("delete", "node", self.name, "--ignore-not-found", "--wait=false", check=False, timeout=15)
        kubelet = self.procs.pop("kubelet", None)
        if kubelet is not None:
            kubelet.stop()
        proxy = self.procs.pop("kube-proxy", None)
        if proxy is not None:
            proxy.stop()
            with contextlib.suppress(Exception):
                run([self.kube_proxy_bin, "--cleanup", f"--config={self.proxy_config}"], check=False, timeout=30)
        for p in list(self.procs.values()):
            p.stop()
        self.procs.clear()
        if self.containerd is not None:
            self.containerd.stop()
            self.containerd = None
        _cleanup_pod_cgroups()
        if self.dir is not None:
            for pid_file in self.dir.glob("*.pid"):  # anything a crash left
                stop_pidfile(pid_file)
        if self.run_dir is not None:
            Containerd.unmount_under(self.run_dir)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.dir is not None:
                (self.dir / "run-dir").unlink(missing_ok=True)
            self.run_dir = None
        if self.dir is not None:
            shutil.rmtree(self.dir / "cni-ipam", ignore_errors=True)
        _cleanup_netns_and_cni_cache()
        _cleanup_kubelet_iptables()
        run(["ip", "link", "delete", BRIDGE], check=False)
        for key, value in self._saved_sysctls.items():
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / key).write_text(value)
        self._saved_sysctls.clear()
        os.close(self._host_lock_fd)
        self._host_lock_fd = None


def cleanup(state_dir: str | os.PathLike[str]) -> None:
    """Tear down a real node left by another process (``localcluster down``, a crashed run):
    stop its recorded processes, shims, mounts, the bridge and kube-proxy's iptables rules."""
    d = Path(state_dir) / "realnode"
    if not d.is_dir():
        return
    order = ["kubelet", "kube-proxy", "coredns", "containerd"]
    for name in order + sorted(p.stem for p in d.glob("*.pid") if p.stem not in order):
        stop_pidfile(d / f"{name}.pid")
    run_dir_file = d / "run-dir"
    if run_dir_file.exists():
        run_dir = Path(run_dir_file.read_text().strip())
        sock = str(run_dir / "containerd" / "containerd.sock").encode()
        for proc_dir in Path("/proc").iterdir():
            try:
                argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and sock in argv:
                stop_pid(int(proc_dir.name), timeout=5, group=False)
        Containerd.unmount_under(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir_file.unlink()
    _cleanup_pod_cgroups()
    remove_empty_default_dirs()
    proxy_cfg = d / "kube-proxy.yaml"
    if proxy_cfg.exists():
        try:
            from tests.cluster.binaries import binary_path

            if binary_path("kube-proxy").exists():
                run([binary_path("kube-proxy"), "--cleanup", f"--config={proxy_cfg}"], check=False, timeout=30)
        except Exception:
            pass
    shutil.rmtree(d / "cni-ipam", ignore_errors=True)
    _cleanup_netns_and_cni_cache()
    _cleanup_kubelet_iptables()
    run(["ip", "link", "delete", BRIDGE], check=False)


CGROUP_ROOT = Path("/sys/fs/cgroup")
HOST_LOCK = Path("/run/phalanx-realnode.lock")


def _acquire_host_lock() -> int:
    import fcntl

    fd = os.open(HOST_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        holders = []
        for proc_dir in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                for link in (proc_dir / "fd").iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(link) == str(HOST_LOCK):
                            holders.append(int(proc_dir.name))
        raise RuntimeError(
            f"a real node already runs on this host (lock {HOST_LOCK} held by PIDs {holders or '?'});"
            " stop it first (`python -m tests.cluster.node.realnode down --state-dir <cluster dir>`)"
        ) from exc
    return fd


def _cleanup_pod_cgroups(kill: bool = True) -> None:
    """Kill every process left in kubelet's ``kubepods`` cgroups (containers whose shim died
    with a crashed run) and remove the cgroup directories, deepest first. Also removes empty
    ``k8s.io`` cgroups that ``ctr run`` leaves."""
    tops = [d for pattern in ("*/kubepods", "*/k8s.io") for d in CGROUP_ROOT.glob(pattern) if d.is_dir()]
    if kill:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids: set[int] = set()
            for top in tops:
                if top.name != "kubepods":
                    continue
                for procs in top.rglob("cgroup.procs"):
                    with contextlib.suppress(OSError, ValueError):
                        pids.update(int(x) for x in procs.read_text().split())
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
    for top in tops:
        dirs = sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True)
        for d in [*dirs, top]:
            with contextlib.suppress(OSError):
                d.rmdir()


# Chains kubelet creates on start (kube-proxy --cleanup removes kube-proxy's own).
_KUBELET_CHAINS = {
    "filter": ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY"],
    "nat": ["KUBE-KUBELET-CANARY"],
    "mangle": ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"],
}


def _cleanup_kubelet_iptables() -> None:
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        for table, chains in _KUBELET_CHAINS.items():
            for builtin in ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING"):
                for chain in chains:
                    # delete every jump to the chain (one rule per call)
                    for _ in range(10):
                        if run([tool, "-w", "-t", table, "-D", builtin, "-j", chain], check=False).returncode != 0:
                            break
            for chain in chains:
                run([tool, "-w", "-t", table, "-F", chain], check=False)
                run([tool, "-w", "-t", table, "-X", chain], check=False)


def _cleanup_netns_and_cni_cache() -> None:
    """Remove libcni's cached results for our network (in /var/lib/cni/results)."""
    results = Path("/var/lib/cni/results")
    if results.is_dir():
        for f in results.glob(f"{CNI_NETWORK}-*"):
            f.unlink(missing_ok=True)


def _http_ok(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
            status: int = resp.status
            return status == 200
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# CLI: a control plane + this node for manual work (processes outlive the command)


def cluster_with_real_node(
    state_dir: str | os.PathLike[str] | None = None, *, kwok: bool = False, node: RealNode | None = None, **kwargs: Any
) -> Any:
    """A (not yet started) LocalCluster set up so that pods on the real node reach the API
    server through the ``kubernetes`` Service, with ``node`` as extra component."""
    from tests.cluster.localcluster import LocalCluster

    node = node or RealNode()
    extra = list(kwargs.pop("extra_apiserver_args", []))
    if not any(a.startswith("--kubelet-preferred-address-types") for a in extra):
        extra.append("--kubelet-preferred-address-types=InternalIP,Hostname")
    return LocalCluster(
        state_dir,
        kwok=kwok,
        bind_address="0.0.0.0",
        advertise_address=host_ip(),
        extra_apiserver_args=extra,
        extra_components=[*kwargs.pop("extra_components", []), node],
        **kwargs,
    )


def node_pressure(node: dict[str, Any]) -> str | None:
    """The pressure conditions a node reports (its kubelet taints itself and admits no new pods),
    with the host's free disk (the kubelet's eviction threshold is 1 % here), or None."""
    conditions = (node.get("status") or {}).get("conditions") or []
    pressed = [
        f"{c['type']} ({c.get('message') or c.get('reason') or 'no message'})"
        for c in conditions
        if c.get("type", "").endswith("Pressure") and c.get("status") == "True"
    ]
    if not pressed:
        return None
    usage = shutil.disk_usage("/")
    return (
        f"node {node['metadata']['name']} reports {', '.join(pressed)}; the host has "
        f"{usage.free / 2**30:.1f} GiB of {usage.total / 2**30:.0f} GiB free"
    )


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(
        prog="python -m tests.cluster.node.realnode", description="control plane + one real kubelet node on this host"
    )
    ap.add_argument("cmd", choices=["up", "down"])
    ap.add_argument("--state-dir", type=Path, required=True)
    ap.add_argument("--kwok", action="store_true", help="also run KWOK (fake GPU nodes)")
    ap.add_argument("--no-taint", action="store_true", help="register the node without taint")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    state_dir = args.state_dir.resolve()
    if args.cmd == "up":
        state_dir.mkdir(parents=True, exist_ok=True)
        c = cluster_with_real_node(state_dir, kwok=args.kwok, node=RealNode(taint=not args.no_taint))
        c.start()
        print(f"export KUBECONFIG={c.kubeconfig}")
        print(f"# stop with: python -m tests.cluster.node.realnode down --state-dir {state_dir}", file=sys.stderr)
        return 0
    cleanup(state_dir)
    from tests.cluster.localcluster import LocalCluster

    LocalCluster.from_state_dir(state_dir).stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
