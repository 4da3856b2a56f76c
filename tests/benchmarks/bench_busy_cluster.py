"""Placement and recovery on a busy cluster: other tenants' pods hold half of the GPUs.

    python -m tests.benchmarks.bench_busy_cluster [--rounds 5] [--time-limit 300]

Starts its own control plane with KWOK racks of uneven size (tests/cluster/busy.py: 13 nodes of 8
GPUs, 52 of them held by another tenant's pods bound by name) and one operator for every
namespace. Measured side by side, round after round in one cluster:

- ``required_to_running`` / ``unplaced_to_running``: submission -> Running of a gang of 2 workers of
  8 GPUs with ``placement.topology`` required on the rack label, and of the same gang without
  ``placement`` (the scheduler alone puts it where there is room); ``placed_in`` says which rack
  the required gang got (the tightest that fits is b);
- ``spare_recovery``: a job of 2 workers and 1 spare placed in rack b, which holds exactly 2, so the
  spare waits unschedulable; one worker fails (exit 1) and the time from the failure to both slots
  held by ready workers again is measured (the spare promoted, or a new worker bound).

A round that does not reach its state within ``--time-limit`` records null. Progress goes to stderr;
one JSON object with the commit goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from phalanx.reconcile import naming
from tests.benchmarks.harness import commit, stop_on_signals, summary
from tests.cluster.busy import GPUS_PER_NODE, RACK, BusyRacks, busy_racks, held_share
from tests.cluster.crds import cluster_crds
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.unit.jobs import manifest

GPU = "busy.phalanx.dev/gpu"
POOL_LABEL = "phalanx.dev/bench-pool"
POOL = "busy"
NAMESPACE = "busy-bench"
TRAINER = {
    "name": "trainer",
    "image": "example/train:1",
    "command": ["phalanx-supervise", "--", "torchrun"],  # spares need the supervisor
    "args": ["train.py"],
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
}


def say(message: str) -> None:
    print(f"busy-cluster {message}", file=sys.stderr, flush=True)


def job_body(name: str, *, placed: bool, workers: dict[str, int], spares: int = 0) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "workers": {**workers, "spares": spares} if spares else workers,
        "gpus": {"count": GPUS_PER_NODE, "resource": GPU},
        "failurePolicy": {"maxRestarts": 10, "backoffSeconds": 0, "maxBackoffSeconds": 0},
        "template": {"spec": {"containers": [TRAINER], "nodeSelector": {POOL_LABEL: POOL}}},
    }
    if placed:
        spec["placement"] = {"topology": {"key": RACK, "mode": "required"}}
    body = manifest(**spec)
    body["metadata"] = {"name": name}
    return body


def wait(check: Callable[[], Any], limit: float) -> float | None:
    """Seconds until ``check()`` is truthy (polled every 0.2 s), None past ``limit``."""
    began = time.monotonic()
    while time.monotonic() - began < limit:
        if check():
            return time.monotonic() - began
        time.sleep(0.2)
    return None


def phase(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return ((kubectl.get("tj", name, NAMESPACE) or {}).get("status")) or {}


def remove(kubectl: Kubectl, name: str) -> None:
    kubectl.delete("tj", name, NAMESPACE)
    kubectl.wait_for(
        lambda: not kubectl.list("pods", NAMESPACE, f"{naming.JOB_NAME_LABEL}={name}"), timeout=60, what="pods gone"
    )


def to_running(kubectl: Kubectl, racks: BusyRacks, name: str, placed: bool, limit: float) -> dict[str, Any]:
    submitted = time.monotonic()
    kubectl.create(job_body(name, placed=placed, workers={"min": 2, "max": 2, "desired": 2}), namespace=NAMESPACE)
    took = wait(lambda: phase(kubectl, name).get("phase") == "Running", limit)
    if took is not None:
        took = time.monotonic() - submitted
    pods = kubectl.list("pods", NAMESPACE, naming.worker_selector(name))
    used = sorted({racks.rack_of.get(pod["spec"].get("nodeName", ""), "unbound") for pod in pods})
    remove(kubectl, name)
    return {"seconds": took, "racks": used}


def spare_recovery(cluster: LocalCluster, kubectl: Kubectl, name: str, limit: float) -> float | None:
    workers = {"min": 1, "max": 2, "desired": 2}
    kubectl.create(job_body(name, placed=True, workers=workers, spares=1), namespace=NAMESPACE)
    try:
        if wait(lambda: phase(kubectl, name).get("phase") == "Running", limit) is None:
            return None
        victim = sorted(p["metadata"]["name"] for p in kubectl.list("pods", NAMESPACE, naming.worker_selector(name)))[0]
        failed_at = time.monotonic()
        cluster.finish_pod(NAMESPACE, victim, 1)

        def whole_again() -> bool:
            state = phase(kubectl, name)
            pods = kubectl.list("pods", NAMESPACE, naming.worker_selector(name))
            live = [
                pod
                for pod in pods
                if pod["metadata"]["name"] != victim
                and pod["status"].get("phase") == "Running"
                and pod["metadata"].get("labels", {}).get(naming.ATTEMPT_LABEL) == str(state.get("attempt"))
            ]
            return len(live) == 2 and (state.get("workers") or {}).get("ready") == 2

        took = wait(whole_again, limit)
        return None if took is None else time.monotonic() - failed_at
    finally:
        remove(kubectl, name)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as scratch:
        cluster = LocalCluster(kwok=True)
        operator: OperatorProcess | None = None
        try:
            cluster.start()
            kubectl = Kubectl(cluster.kubeconfig)
            for path in cluster_crds():
                kubectl.apply(yaml.safe_load(path.read_text()))
            kubectl.wait_established()
            kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
            kubectl.wait_for(lambda: kubectl.get("serviceaccount", "default", NAMESPACE), timeout=30)
            operator = OperatorProcess(Path(cluster.kubeconfig), Path(scratch) / "operator.log").start()

            def add(rack: str, count: int) -> list[str]:
                return cluster.add_gpu_nodes(
                    count, gpus_per_node=GPUS_PER_NODE, resource=GPU, labels={POOL_LABEL: POOL, RACK: rack},
                    name_prefix=f"{rack}-",
                )  # fmt: skip

            with busy_racks(kubectl, add, POOL, GPU) as racks:
                say(f"{len(racks.rack_of)} nodes, {held_share():.0%} of their GPUs held by another tenant")
                for index in range(args.rounds):
                    measured = {
                        "required": to_running(kubectl, racks, f"required-{index}", True, args.time_limit),
                        "unplaced": to_running(kubectl, racks, f"unplaced-{index}", False, args.time_limit),
                        "spare_recovery_s": spare_recovery(cluster, kubectl, f"spare-{index}", args.time_limit),
                    }
                    say(f"round {index}: {measured}")
                    rounds.append(measured)
        except BaseException:
            if operator is not None:
                print(f"--- operator log (tail) ---\n{operator.log_tail(40)}", file=sys.stderr)
            raise
        finally:
            if operator is not None:
                operator.stop()
            cluster.stop()

    def seconds(samples: list[float | None]) -> dict[str, Any]:
        done = [sample for sample in samples if sample is not None]
        return {**(summary(done) if done else {}), "timed_out": len(samples) - len(done)}

    required = seconds([r["required"]["seconds"] for r in rounds])
    unplaced = seconds([r["unplaced"]["seconds"] for r in rounds])
    ratio = (
        round(required["median_s"] / unplaced["median_s"], 2)
        if "median_s" in required and "median_s" in unplaced
        else None
    )
    return {
        "held_gpu_share": round(held_share(), 3),
        "required_to_running": required,
        "unplaced_to_running": unplaced,
        "required_over_unplaced_median": ratio,
        "placed_in": sorted({rack for r in rounds for rack in r["required"]["racks"]}),
        "spare_recovery": seconds([r["spare_recovery_s"] for r in rounds]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_busy_cluster", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=300.0, help="per measurement (seconds)")
    args = parser.parse_args(argv)
    measured = commit()
    with stop_on_signals():
        results = run(args)
    print(
        json.dumps(
            {
                "benchmark": "busy_cluster",
                "commit": measured,
                "cpus": os.cpu_count(),
                "config": {"rounds": args.rounds, "time_limit": args.time_limit},
                "results": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
