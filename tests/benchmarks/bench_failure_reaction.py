"""How fast the operator replaces a failed worker: failure -> replacement pod created.

    python -m tests.benchmarks.bench_failure_reaction [--repetitions 7] [--warmup 1]

Starts its own LocalCluster (control plane + KWOK GPU nodes in a temporary directory), installs
the CRDs, runs the operator (``phalanx run``) against one namespace, creates a 3-worker GPU job
(min 2, so one failure replaces only that worker) and, per repetition, fails one worker with
the KWOK exit-code label. A watch on the job's pods (one HTTP stream to the API server, read in
a thread, each event stamped with the local monotonic clock on arrival) records

- ``failed_to_replacement``: the watch delivers the worker as Failed -> the watch delivers its
  replacement (same name, new uid) as ADDED. Both ends are seen through the same stream, so this
  is the operator's reaction: watch event -> queue -> plan -> status -> delete -> create;
- ``label_to_replacement``: the exit-code label request is sent -> replacement ADDED (adds
  kubectl's start-up and KWOK's reaction).

Pod timestamps (creationTimestamp, finishedAt) have one-second precision, hence the watch.
Prints one JSON object: median/p90/min/max per metric, the samples, the commit.
Everything it started (the operator's process group, every cluster process) is stopped by PID,
also on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import pathlib
import queue
import sys
import tempfile
import threading
import time
import urllib.parse
from typing import Any

import yaml

from phalanx.reconcile import naming
from tests.benchmarks.harness import commit, stop_on_signals, summary
from tests.cluster.crds import cluster_crds
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.unit.jobs import manifest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMESPACE = "bench"
JOB = "bench"


def job_manifest(repetitions: int) -> dict[str, Any]:
    """The tests' small job, on 4-GPU workers, with room for every repetition's restart."""
    body = manifest(
        gpus={"count": 4},
        failurePolicy={"maxRestarts": min(1000, repetitions + 10), "backoffSeconds": 1},
    )
    body["metadata"] = {"name": JOB, "namespace": NAMESPACE}
    return body


class PodWatch:
    """A watch on the job's pods; events land in a queue as (arrival monotonic time, type, pod)."""

    def __init__(self, cluster: LocalCluster, namespace: str, selector: str) -> None:
        url = urllib.parse.urlsplit(cluster.server)
        self._connection = http.client.HTTPSConnection(
            url.hostname or "127.0.0.1", url.port, context=cluster.ssl_context(), timeout=None
        )
        query = urllib.parse.urlencode({"watch": "1", "labelSelector": selector, "timeoutSeconds": "3600"})
        self._connection.request("GET", f"/api/v1/namespaces/{namespace}/pods?{query}")
        self._response = self._connection.getresponse()
        if self._response.status != 200:
            raise RuntimeError(f"watch failed: {self._response.status} {self._response.read()[:300]!r}")
        self.events: queue.Queue[tuple[float, str, dict[str, Any]]] = queue.Queue()
        self._thread = threading.Thread(target=self._read, name="pod-watch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):
            for line in self._response:
                arrived = time.monotonic()
                event = json.loads(line)
                self.events.put((arrived, event["type"], event["object"]))

    def next_matching(self, predicate: Any, timeout: float, what: str) -> tuple[float, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no watch event for {what} within {timeout}s")
            try:
                arrived, kind, pod = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if predicate(kind, pod):
                return arrived, pod

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._connection.sock is not None:
                self._connection.sock.shutdown(2)
        with contextlib.suppress(Exception):
            self._connection.close()
        self._thread.join(timeout=5)


def is_running(pod: dict[str, Any]) -> bool:
    ready = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}.get("Ready")
    return pod.get("status", {}).get("phase") == "Running" and ready == "True"


def wait_job_running(kubectl: Kubectl, workers: int, timeout: float = 60) -> dict[str, Any]:
    def ready() -> dict[str, Any]:
        status = (kubectl.get("tj", JOB, NAMESPACE) or {}).get("status") or {}
        running = status.get("phase") == "Running" and status.get("workerSummary") == f"{workers}/{workers}"
        return status if running else {}

    return kubectl.wait_for(ready, timeout=timeout, interval=0.1, what=f"tj/{JOB} Running {workers}/{workers}")


def fail_once(
    cluster: LocalCluster, kubectl: Kubectl, watch: PodWatch, victim: str, timeout: float = 60
) -> tuple[float, float]:
    """Fail ``victim``; returns (failed seen -> replacement seen, label sent -> replacement seen)."""
    pod = kubectl.get("pod", victim, NAMESPACE)
    assert pod is not None and is_running(pod), f"{victim} is not running"
    uid = pod["metadata"]["uid"]
    labelled = time.monotonic()
    cluster.finish_pod(NAMESPACE, victim, 1, message="benchmark failure")
    failed, _ = watch.next_matching(
        lambda kind, p: p["metadata"]["uid"] == uid and p.get("status", {}).get("phase") == "Failed",
        timeout,
        f"{victim} Failed",
    )
    created, _ = watch.next_matching(
        lambda kind, p: kind == "ADDED" and p["metadata"]["name"] == victim and p["metadata"]["uid"] != uid,
        timeout,
        f"replacement of {victim}",
    )
    return created - failed, created - labelled


def run(repetitions: int, warmup: int, nodes: int) -> dict[str, Any]:
    reaction: list[float] = []
    from_label: list[float] = []
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as scratch:
        cluster = LocalCluster(kwok=True)
        operator: OperatorProcess | None = None
        watch: PodWatch | None = None
        try:
            cluster.start()
            cluster.add_gpu_nodes(nodes, gpus_per_node=8, name_prefix="bench-gpu-")
            kubectl = Kubectl(cluster.kubeconfig)
            for path in cluster_crds():
                kubectl.apply(yaml.safe_load(path.read_text()))
            kubectl.wait_established()
            kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
            operator = OperatorProcess(
                pathlib.Path(cluster.kubeconfig), pathlib.Path(scratch) / "operator.log", namespace=NAMESPACE
            ).start()
            watch = PodWatch(cluster, NAMESPACE, naming.worker_selector(JOB))
            kubectl.create(job_manifest(repetitions + warmup))
            wait_job_running(kubectl, 3)
            for i in range(warmup + repetitions):
                victim = naming.worker_pod_name(JOB, i % 3)
                seen, labelled = fail_once(cluster, kubectl, watch, victim)
                if i >= warmup:
                    reaction.append(seen)
                    from_label.append(labelled)
                print(
                    f"{'warm-up' if i < warmup else f'run {i - warmup + 1}'}: {victim} failed -> replaced "
                    f"{seen * 1000:.0f} ms (from the label {labelled * 1000:.0f} ms)",
                    file=sys.stderr,
                )
                wait_job_running(kubectl, 3)
            status = (kubectl.get("tj", JOB, NAMESPACE) or {}).get("status") or {}
            assert status.get("restarts") == warmup + repetitions, status
            assert status.get("attempt") == 0, status  # every failure replaced one worker, never the gang
            versions = cluster.versions
        except BaseException:
            if operator is not None:
                print(f"--- operator log (tail) ---\n{operator.log_tail(40)}", file=sys.stderr)
            raise
        finally:
            if watch is not None:
                watch.close()
            if operator is not None:
                operator.stop()
            cluster.stop()
    return {
        "benchmark": "failure_reaction",
        "commit": commit(),
        "repetitions": repetitions,
        "warmup": warmup,
        "cpus": os.cpu_count(),
        "kubernetes": versions.get("kubernetes"),
        "failed_to_replacement": summary(reaction),
        "label_to_replacement": summary(from_label),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_failure_reaction", description=__doc__)
    parser.add_argument("--repetitions", "-n", type=int, default=7, help="measured failures (default 7)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured failures first (default 1)")
    parser.add_argument("--nodes", type=int, default=4, help="KWOK GPU nodes (default 4)")
    args = parser.parse_args(argv)
    if args.repetitions < 1:
        parser.error("--repetitions must be at least 1")
    with stop_on_signals():
        result = run(args.repetitions, args.warmup, args.nodes)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
