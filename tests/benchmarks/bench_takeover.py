"""How fast a standby operator takes over: leader SIGKILLed (or stopped cleanly) -> the standby
holds the Lease -> it has done work only a leader does.

    python -m tests.benchmarks.bench_takeover [--repetitions 5]

Starts its own LocalCluster (control plane + KWOK GPU nodes), runs two operators (``phalanx run``
with leader election, the chart's default durations: lease 15 s, renew deadline 10 s, retry 2 s)
against one namespace and a 3-worker job. Per repetition it SIGKILLs whichever replica leads,
deletes a worker at the same moment (only a leader replaces it), and records

- ``kill_to_lease``: SIGKILL -> the Lease names the standby;
- ``kill_to_replacement``: SIGKILL -> the deleted worker's replacement exists (the new leader
  planned from its already-synced caches and wrote);

then restarts the killed replica, which comes back as the standby. ``clean_stop_to_lease`` is the
same with SIGTERM: the leader releases the Lease on its way out. Times are polled every 0.1 s
through kubectl, so each sample may be late by about that much. Prints one JSON object with the
commit. Everything it started is stopped by PID, also on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import yaml

from phalanx.reconcile import naming
from tests.benchmarks.harness import commit, stop_on_signals, summary
from tests.cluster.crds import cluster_crds
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.unit.jobs import manifest

NAMESPACE = "bench"
JOB = "bench"
LEASE = "phalanx-operator"  # the operator's default name outside the chart


def holder(kubectl: Kubectl) -> str | None:
    lease = kubectl.get("lease", LEASE, NAMESPACE)
    return (lease or {}).get("spec", {}).get("holderIdentity") or None


def worker_uid(kubectl: Kubectl, name: str) -> str | None:
    pod = kubectl.get("pod", name, NAMESPACE)
    return None if pod is None or pod["metadata"].get("deletionTimestamp") else pod["metadata"]["uid"]


def wait_running(kubectl: Kubectl, workers: int) -> None:
    def running() -> bool:
        status = (kubectl.get("tj", JOB, NAMESPACE) or {}).get("status") or {}
        return status.get("phase") == "Running" and status.get("workerSummary") == f"{workers}/{workers}"

    kubectl.wait_for(running, timeout=120, interval=0.2, what=f"tj/{JOB} Running {workers}/{workers}")


def take_over(
    kubectl: Kubectl, replicas: dict[str, OperatorProcess], *, kill: bool, victim: str
) -> tuple[float, float | None]:
    """Stop the leader (SIGKILL or SIGTERM); (stop -> lease taken, stop -> victim replaced)."""
    leader = holder(kubectl)
    assert leader in replicas, leader
    standby = next(name for name in replicas if name != leader)
    before = worker_uid(kubectl, victim)
    stopped = time.monotonic()
    if kill:
        replicas[leader].kill()
        kubectl.delete("pod", victim, NAMESPACE, wait=False)
    else:
        replicas[leader].stop()
    kubectl.wait_for(lambda: holder(kubectl) == standby, timeout=60, interval=0.1, what=f"{standby} leads")
    took = time.monotonic() - stopped
    replaced = None
    if kill:
        kubectl.wait_for(
            lambda: worker_uid(kubectl, victim) not in (None, before), timeout=60, interval=0.1, what="replacement"
        )
        replaced = time.monotonic() - stopped
    replicas[leader].restart()  # back as the standby
    time.sleep(3)  # its caches sync before the next round
    assert holder(kubectl) == standby
    return took, replaced


def run(repetitions: int, nodes: int) -> dict[str, Any]:
    killed: list[float] = []
    replaced: list[float] = []
    released: list[float] = []
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as scratch:
        cluster = LocalCluster(kwok=True)
        replicas: dict[str, OperatorProcess] = {}
        try:
            cluster.start()
            cluster.add_gpu_nodes(nodes, gpus_per_node=8, name_prefix="bench-gpu-")
            kubectl = Kubectl(cluster.kubeconfig)
            for path in cluster_crds():
                kubectl.apply(yaml.safe_load(path.read_text()))
            kubectl.wait_established()
            kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
            for name in ("a", "b"):
                environment = {
                    "PHALANX_LEADER_ELECTION": "1",
                    "PHALANX_LEASE_NAMESPACE": NAMESPACE,
                    "PHALANX_LEADER_IDENTITY": name,
                }
                log = pathlib.Path(scratch) / f"operator-{name}.log"
                replicas[name] = OperatorProcess(
                    pathlib.Path(cluster.kubeconfig), log, namespace=NAMESPACE, extra_env=environment
                ).start()
                if name == "a":
                    kubectl.wait_for(lambda: holder(kubectl) == "a", timeout=60, what="a leads")
            body = manifest(gpus={"count": 4}, workers={"min": 2, "max": 3, "desired": 3})
            body["metadata"] = {"name": JOB, "namespace": NAMESPACE}
            kubectl.create(body)
            wait_running(kubectl, 3)
            for i in range(repetitions):
                victim = naming.worker_pod_name(JOB, i % 3)
                lease, replacement = take_over(kubectl, replicas, kill=True, victim=victim)
                killed.append(lease)
                assert replacement is not None
                replaced.append(replacement)
                wait_running(kubectl, 3)
                lease, _ = take_over(kubectl, replicas, kill=False, victim=victim)
                released.append(lease)
                print(
                    f"run {i + 1}: SIGKILL -> lease {killed[-1]:.1f} s, worker replaced {replacement:.1f} s; "
                    f"clean stop -> lease {released[-1]:.1f} s",
                    file=sys.stderr,
                )
            versions = cluster.versions
        except BaseException:
            for name, process in replicas.items():
                print(f"--- operator {name} log (tail) ---\n{process.log_tail(30)}", file=sys.stderr)
            raise
        finally:
            for process in replicas.values():
                process.stop()
            cluster.stop()
    return {
        "benchmark": "takeover",
        "commit": commit(),
        "repetitions": repetitions,
        "cpus": os.cpu_count(),
        "kubernetes": versions.get("kubernetes"),
        "lease": {"duration_s": 10, "renew_deadline_s": 7, "retry_s": 2},
        "kill_to_lease": summary(killed),
        "kill_to_replacement": summary(replaced),
        "clean_stop_to_lease": summary(released),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_takeover", description=__doc__)
    parser.add_argument("--repetitions", "-n", type=int, default=5, help="takeovers of each kind (default 5)")
    parser.add_argument("--nodes", type=int, default=2, help="KWOK GPU nodes (default 2)")
    args = parser.parse_args(argv)
    if args.repetitions < 1:
        parser.error("--repetitions must be at least 1")
    with stop_on_signals():
        result = run(args.repetitions, args.nodes)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
