"""Real gang schedulers as host processes beside a running cluster.

- ``Coscheduling``: scheduler-plugins' kube-scheduler with a second profile,
  ``scheduler-plugins-scheduler``, that runs the Coscheduling plugin (pods choose it by
  ``spec.schedulerName``), and its PodGroup status controller.
- ``Kueue``: Kueue's manager with the pod integration and its real mutating and validating
  webhooks, which the API server calls by URL (https://HOST:PORT, HOST the cluster's
  ``host_address``, a certificate signed by the cluster's ``ca_cert``). Kueue reads its metrics
  certificate from a fixed path, /etc/kueue/metrics/certs, even with metrics off: it runs in a
  private mount namespace whose /etc is an overlay of the host's, so the host's /etc is never
  written (not root: in a user namespace too, where the kernel allows unprivileged overlays).

Both are built from their Go modules (tests/cluster/build-binaries.sh) and their CRDs come from
the same module downloads. Their processes are spawned through the cluster (PID files in its
state directory) and stopped by PID. The cluster is a LocalCluster or, for a cluster named by
$KUBECONFIG, an AttachedCluster (tests/cluster/attached.py).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import ssl
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.cluster import binaries
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import ClusterError, LocalCluster
from tests.cluster.ports import free_port

COSCHEDULING_SCHEDULER_NAME = "scheduler-plugins-scheduler"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
KUEUE_NAMESPACE = "kueue-system"
KUEUE_NAMESPACE_LABEL = "phalanx.dev/kueue"  # namespaces whose pods Kueue manages (and its webhook sees)
KUEUE_WEBHOOK_PREFIX = "phalanx-test-kueue"
# Served by a manager whose only integration is pods; the others would answer 404.
KUEUE_WEBHOOKS = {
    "mpod.kb.io",
    "vpod.kb.io",
    "mworkload.kb.io",
    "vworkload.kb.io",
    "mclusterqueue.kb.io",
    "vclusterqueue.kb.io",
    "mresourceflavor.kb.io",
    "vresourceflavor.kb.io",
    "vcohort.kb.io",
}
NAMESPACED_WEBHOOK_RESOURCES = {"pods", "workloads"}


def _wait(what: str, ok: Any, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if ok():
                return
        time.sleep(0.2)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:]) if log.exists() else "(no log)"
    raise ClusterError(f"{what} not ready within {timeout:.0f}s; log tail:\n{tail}")


def _https_ok(url: str) -> bool:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, timeout=2, context=context) as response:
        return bool(response.status == 200)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return bool(response.status == 200)


def _apply_crds(kubectl: Kubectl, files: list[Path]) -> None:
    for path in files:
        # Server-side: Kueue's Workload CRD is larger than client-side apply's annotation allows.
        kubectl.run("apply", "--server-side", "--force-conflicts", f"--filename={path}")
    names = [yaml.safe_load(path.read_text())["metadata"]["name"] for path in files]
    kubectl.wait_established(*names)


class Coscheduling:
    """scheduler-plugins' scheduler (Coscheduling profile) and PodGroup controller."""

    def __init__(
        self, cluster: LocalCluster, *, permit_waiting_seconds: int = 60, pod_group_backoff_seconds: int = 0
    ) -> None:
        self.cluster = cluster
        self.permit_waiting_seconds = permit_waiting_seconds
        self.pod_group_backoff_seconds = pod_group_backoff_seconds
        self.directory = cluster.state_dir / "coscheduling"
        self.version = binaries.module_version("scheduler-plugins")
        self.started: list[str] = []

    def crd_files(self) -> list[Path]:
        source = binaries.module_source("scheduler-plugins")
        manifests = source / "manifests"
        return [manifests / "coscheduling" / "crd.yaml", manifests / "capacityscheduling" / "crd.yaml"]

    def start(self) -> Coscheduling:
        bins = binaries.ensure_binaries(["scheduler-plugins-scheduler", "scheduler-plugins-controller"])
        kubectl = Kubectl(self.cluster.kubeconfig)
        _apply_crds(kubectl, self.crd_files())
        self.directory.mkdir(parents=True, exist_ok=True)
        kubeconfig = self.cluster.kubeconfig  # it reads PodGroups and ElasticQuotas too
        config = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "leaderElection": {"leaderElect": False},
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "profiles": [
                {
                    "schedulerName": COSCHEDULING_SCHEDULER_NAME,
                    "plugins": {
                        "multiPoint": {
                            "enabled": [{"name": "Coscheduling"}],
                            "disabled": [{"name": "PrioritySort"}],  # one queue-sort plugin only
                        }
                    },
                    "pluginConfig": [
                        {
                            "name": "Coscheduling",
                            "args": {
                                "permitWaitingTimeSeconds": self.permit_waiting_seconds,
                                "podGroupBackoffSeconds": self.pod_group_backoff_seconds,
                            },
                        }
                    ],
                }
            ],
        }
        config_file = self.directory / "scheduler-config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        port = free_port()
        self.cluster.spawn(
            "scheduler-plugins-scheduler",
            [
                bins["scheduler-plugins-scheduler"],
                f"--config={config_file}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--v=2",
            ],
        )
        self.started.append("scheduler-plugins-scheduler")
        probe = free_port()
        self.cluster.spawn(
            "scheduler-plugins-controller",
            [
                bins["scheduler-plugins-controller"],
                "--metricsAddr=0",
                f"--probeAddr=127.0.0.1:{probe}",
                "--enableLeaderElection=false",
                "--qps=50",
                "--burst=100",
            ],
            env={"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin"},
        )
        self.started.append("scheduler-plugins-controller")
        logs = self.cluster.log_dir
        _wait("scheduler-plugins-scheduler", lambda: _https_ok(f"https://127.0.0.1:{port}/readyz"), 60,
              logs / "scheduler-plugins-scheduler.log")  # fmt: skip
        _wait("scheduler-plugins-controller", lambda: _http_ok(f"http://127.0.0.1:{probe}/readyz"), 60,
              logs / "scheduler-plugins-controller.log")  # fmt: skip
        return self

    def stop(self) -> None:
        for name in reversed(self.started):
            self.cluster.stop_process(name)
        self.started.clear()


class Kueue:
    """Kueue's manager (pod integration, webhooks called by URL) for namespaces labelled
    ``phalanx.dev/kueue=true``."""

    def __init__(self, cluster: LocalCluster, *, wait_for_pods_ready_seconds: int | None = None) -> None:
        self.cluster = cluster
        self.wait_for_pods_ready_seconds = wait_for_pods_ready_seconds
        self.directory = cluster.state_dir / "kueue"
        self.version = binaries.module_version("kueue")
        self.started = False
        self.webhook_configurations: list[tuple[str, str]] = []

    def crd_files(self) -> list[Path]:
        bases = binaries.module_source("kueue") / "config" / "components" / "crd" / "bases"
        return sorted(bases.glob("*.yaml"))

    def _certificates(self) -> tuple[Path, Path]:
        """The webhook's serving certificate (host_address), also served as the metrics one."""
        pki = self.directory / "pki"
        sans = sorted({f"IP:{self.cluster.host_address}", "IP:127.0.0.1", "DNS:localhost"})
        crt, key = self.cluster.issue_cert(
            "kueue-webhook", "/CN=kueue-webhook", sans=sans, client=False, server=True, directory=pki
        )
        certs = self.directory / "certs"
        metrics = self.directory / "etc-upper" / "kueue" / "metrics" / "certs"
        for target in (certs, metrics):
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(crt, target / "tls.crt")
            shutil.copy(key, target / "tls.key")
        return certs, self.directory / "etc-upper"

    def _webhooks(self, port: int) -> list[dict[str, Any]]:
        manifests = binaries.module_source("kueue") / "config" / "components" / "webhook" / "manifests.yaml"
        ca_bundle = base64.b64encode(self.cluster.ca_cert.read_bytes()).decode()
        configurations = []
        for document in yaml.safe_load_all(manifests.read_text()):
            kind = document["kind"]
            name = f"{KUEUE_WEBHOOK_PREFIX}-{'mutating' if kind.startswith('Mutating') else 'validating'}"
            webhooks = []
            for webhook in document["webhooks"]:
                if webhook["name"] not in KUEUE_WEBHOOKS:
                    continue
                path = webhook["clientConfig"]["service"]["path"]
                url = f"https://{self.cluster.host_address}:{port}{path}"
                webhook["clientConfig"] = {"url": url, "caBundle": ca_bundle}
                resources = {resource for rule in webhook["rules"] for resource in rule["resources"]}
                if resources & NAMESPACED_WEBHOOK_RESOURCES:  # fail-closed: keep it to the test namespaces
                    webhook["namespaceSelector"] = {"matchLabels": {KUEUE_NAMESPACE_LABEL: "true"}}
                webhook["timeoutSeconds"] = 10
                webhooks.append(webhook)
            configurations.append(
                {"apiVersion": document["apiVersion"], "kind": kind, "metadata": {"name": name}, "webhooks": webhooks}
            )
        return configurations

    def start(self) -> Kueue:
        bins = binaries.ensure_binaries(["kueue"])
        kubectl = Kubectl(self.cluster.kubeconfig)
        _apply_crds(kubectl, self.crd_files())
        kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}})
        self.directory.mkdir(parents=True, exist_ok=True)
        certs, etc_upper = self._certificates()
        webhook_port, health_port = free_port(), free_port()
        config: dict[str, Any] = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": KUEUE_NAMESPACE,
            "leaderElection": {"leaderElect": False},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": self.cluster.host_address, "port": webhook_port, "certDir": str(certs)},
            "internalCertManagement": {"enable": False},
            "clientConnection": {"qps": 50, "burst": 100},
            "managedJobsNamespaceSelector": {"matchLabels": {KUEUE_NAMESPACE_LABEL: "true"}},
            "integrations": {"frameworks": ["pod"]},
        }
        if self.wait_for_pods_ready_seconds is not None:
            config["waitForPodsReady"] = {
                "timeout": f"{self.wait_for_pods_ready_seconds}s",
                "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 5, "backoffMaxSeconds": 30},
            }
        config_file = self.directory / "config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        work = self.directory / "etc-work"
        work.mkdir(exist_ok=True)
        # A private mount namespace whose /etc shows the host's plus the metrics certificate.
        script = f'mount -t overlay overlay -o lowerdir=/etc,upperdir={etc_upper},workdir={work} /etc && exec "$0" "$@"'
        kubeconfig = self.cluster.kubeconfig
        self.cluster.spawn(
            "kueue",
            [
                "unshare", *([] if os.geteuid() == 0 else ["--user", "--map-root-user"]), "--mount",
                "--propagation=private", "sh", "-c", script,
                bins["kueue"], f"--config={config_file}", f"--kubeconfig={kubeconfig}",
                "--feature-gates=VisibilityOnDemand=false,PriorityBoost=true", "--zap-log-level=2",
            ],
        )  # fmt: skip
        self.started = True
        log = self.cluster.log_dir / "kueue.log"
        _wait("kueue", lambda: _http_ok(f"http://127.0.0.1:{health_port}/readyz"), 90, log)
        for configuration in self._webhooks(webhook_port):
            kubectl.apply(configuration)
            self.webhook_configurations.append((configuration["kind"], configuration["metadata"]["name"]))
        # The webhook is served once the manager's caches synced; a dry-run flavour goes through it.
        probe = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "probe"}}
        _wait("kueue's webhooks", lambda: kubectl.run("create", "--dry-run=server", "-f", "-", input=json.dumps(probe)),
              60, log)  # fmt: skip
        return self

    def release_managed(self, kubectl: Kubectl, timeout: float = 90) -> None:
        """Delete the pods and Workloads of the namespaces Kueue manages while it still runs: once
        it is gone nobody removes its finalizers, and they would hold those namespaces forever."""
        namespaces = [
            ns["metadata"]["name"] for ns in kubectl.list("namespaces", selector=f"{KUEUE_NAMESPACE_LABEL}=true")
        ]
        for namespace in namespaces:
            # at once: the tests' pods run on KWOK nodes that may be gone already, and the pod
            # garbage collector would wait 40 s before it deleted them
            kubectl.run("delete", "pods", "--all", f"--namespace={namespace}", "--wait=false", "--grace-period=0",
                        "--force")  # fmt: skip
            kubectl.run("delete", "workloads.kueue.x-k8s.io", "--all", f"--namespace={namespace}", "--wait=false")

        def released() -> bool:
            return not any(
                kubectl.list(kind, namespace)
                for namespace in namespaces
                for kind in ("pods", "workloads.kueue.x-k8s.io")
            )

        kubectl.wait_for(released, timeout=timeout, what="Kueue-managed pods and Workloads gone")

    def stop(self) -> None:
        kubectl = Kubectl(self.cluster.kubeconfig)
        if self.started:
            try:
                self.release_managed(kubectl)
            except Exception as error:  # keep stopping; the leftovers are named
                print(f"kueue: {error}", file=sys.stderr)
        for kind, name in self.webhook_configurations:  # fail-closed webhooks must not outlive their server
            with contextlib.suppress(Exception):
                kubectl.delete(kind.lower(), name)
        self.webhook_configurations.clear()
        if self.started:
            self.cluster.stop_process("kueue")
            self.started = False


def kueue_queue(
    namespace: str, name: str, cluster_queue: str, flavor: str, quota: Mapping[str, str]
) -> list[dict[str, Any]]:
    """A ResourceFlavor, a ClusterQueue with ``quota`` in it (every resource a pod requests must be
    covered; lower-priority workloads in it may be preempted) and a LocalQueue ``name`` on it."""
    return [
        {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": flavor}},
        {
            "apiVersion": KUEUE_API,
            "kind": "ClusterQueue",
            "metadata": {"name": cluster_queue},
            "spec": {
                "namespaceSelector": {},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": list(quota),
                        "flavors": [
                            {"name": flavor, "resources": [{"name": k, "nominalQuota": v} for k, v in quota.items()]}
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": KUEUE_API,
            "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue},
        },
    ]
