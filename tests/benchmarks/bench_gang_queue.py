"""A queue of gang jobs on a cluster that fits a few at a time: none vs Coscheduling vs Kueue.

    python -m tests.benchmarks.bench_gang_queue [--jobs 8] [--nodes 6] [--workers 3] [--train-seconds 15]

Starts its own control plane with KWOK nodes, scheduler-plugins' Coscheduling scheduler and Kueue
(tests/cluster/gang.py) and one operator for every namespace. For each ``gang.scheduler`` in turn
(one cluster, one run, side by side) it makes a fresh pool of ``--nodes`` 8-GPU nodes, submits
``--jobs`` jobs at once (each ``--workers`` workers of 8 GPUs, min = max = desired) and plays the
training: once a job is Running (all its workers ready), its workers finish after
``--train-seconds``. Kueue gets a ClusterQueue whose GPU quota is the pool's. Measured per mode:

- ``seconds_to_drain``: submission -> every job Succeeded (null when the queue did not drain within
  ``--time-limit``: a deadlock);
- ``idle_gpu_hours``: GPU-hours held by bound workers of jobs that were not training (a worker
  bound while its job waits for the rest of its gang holds its GPUs for nothing).

Progress goes to stderr; one JSON object with the commit goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from phalanx.reconcile import naming
from tests.benchmarks.harness import commit, stop_on_signals
from tests.cluster.crds import cluster_crds
from tests.cluster.gang import KUEUE_NAMESPACE_LABEL, Coscheduling, Kueue, kueue_queue
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.unit.jobs import manifest

GPU = "gang.phalanx.dev/gpu"
POOL_LABEL = "phalanx.dev/bench-pool"
GPUS_PER_WORKER = 8
MODES = ("none", "scheduler-plugins", "kueue")


def say(message: str) -> None:
    print(f"gang-queue {message}", file=sys.stderr, flush=True)


def job_body(name: str, mode: str, workers: int) -> dict[str, Any]:
    gang: dict[str, Any] = {"scheduler": mode}
    if mode == "kueue":
        gang["queue"] = "queue"
    body = manifest(
        workers={"min": workers, "max": workers, "desired": workers},
        gpus={"count": GPUS_PER_WORKER, "resource": GPU},
        gang=gang,
        template={
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "image": "example/train:1",
                        "command": ["torchrun"],
                        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                    }
                ],
                "nodeSelector": {POOL_LABEL: mode},
            }
        },
    )
    body["metadata"] = {"name": name}
    return body


def drain(
    cluster: LocalCluster, kubectl: Kubectl, namespace: str, mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    names = [f"job-{i:02d}" for i in range(args.jobs)]
    listing = {"apiVersion": "v1", "kind": "List", "items": [job_body(n, mode, args.workers) for n in names]}
    submitted = time.monotonic()
    kubectl.run("create", f"--namespace={namespace}", "-f", "-", input=json.dumps(listing))
    training_since: dict[str, float] = {}
    finished: set[str] = set()
    idle_gpu_seconds = 0.0
    last = time.monotonic()
    drained: float | None = None
    most_bound_while_waiting = 0
    while time.monotonic() - submitted < args.time_limit:
        jobs = {j["metadata"]["name"]: j.get("status") or {} for j in kubectl.list("tj", namespace)}
        pods = kubectl.list("pods", namespace, f"{naming.ROLE_LABEL}={naming.ROLE_WORKER}")
        now = time.monotonic()
        waiting_bound = 0
        for pod in pods:
            job = pod["metadata"]["labels"][naming.JOB_NAME_LABEL]
            live = pod["status"].get("phase") not in ("Succeeded", "Failed")
            if pod["spec"].get("nodeName") and live and jobs.get(job, {}).get("phase") != "Running":
                waiting_bound += 1
        idle_gpu_seconds += waiting_bound * GPUS_PER_WORKER * (now - last)
        most_bound_while_waiting = max(most_bound_while_waiting, waiting_bound)
        last = now
        for name, state in jobs.items():
            if state.get("phase") == "Running":
                training_since.setdefault(name, now)
            if name in training_since and name not in finished and now - training_since[name] >= args.train_seconds:
                for pod in pods:
                    if pod["metadata"]["labels"][naming.JOB_NAME_LABEL] == name:
                        cluster.finish_pod(namespace, pod["metadata"]["name"], 0)
                finished.add(name)
        done = sum(1 for state in jobs.values() if state.get("phase") == "Succeeded")
        if done == len(names):
            drained = now - submitted
            break
        time.sleep(0.5)
    succeeded = sum(1 for j in kubectl.list("tj", namespace) if (j.get("status") or {}).get("phase") == "Succeeded")
    result = {
        "seconds_to_drain": round(drained, 1) if drained is not None else None,
        "jobs_succeeded": succeeded,
        "idle_gpu_hours": round(idle_gpu_seconds / 3600, 4),
        "most_workers_bound_while_their_job_waited": most_bound_while_waiting,
    }
    say(f"{mode}: {result}")
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as scratch:
        cluster = LocalCluster(kwok=True)
        operator: OperatorProcess | None = None
        components: list[Coscheduling | Kueue] = []
        try:
            cluster.start()
            kubectl = Kubectl(cluster.kubeconfig)
            for path in cluster_crds():
                kubectl.apply(yaml.safe_load(path.read_text()))
            kubectl.wait_established()
            components.append(Coscheduling(cluster).start())
            components.append(Kueue(cluster).start())
            operator = OperatorProcess(Path(cluster.kubeconfig), Path(scratch) / "operator.log").start()
            for mode in MODES:
                namespace = f"queue-{mode}"
                labels = {KUEUE_NAMESPACE_LABEL: "true"} if mode == "kueue" else {}
                kubectl.create(
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace, "labels": labels}}
                )
                if mode == "kueue":
                    quota = {"cpu": "10000", "memory": "100Ti", GPU: str(args.nodes * GPUS_PER_WORKER)}
                    for obj in kueue_queue(namespace, "queue", "bench", "gpu", quota):
                        kubectl.apply(obj)
                nodes = cluster.add_gpu_nodes(
                    args.nodes, gpus_per_node=GPUS_PER_WORKER, resource=GPU, labels={POOL_LABEL: mode},
                    name_prefix=f"{mode}-gpu-",
                )  # fmt: skip
                say(f"{mode}: {args.jobs} jobs of {args.workers} x {GPUS_PER_WORKER} GPUs on {args.nodes} nodes")
                results[mode] = drain(cluster, kubectl, namespace, mode, args)
                kubectl.delete("namespace", namespace, wait=False)
                for node in nodes:  # the next mode starts on a pool of its own
                    kubectl.delete("node", node, wait=False)
        except BaseException:
            if operator is not None:
                print(f"--- operator log (tail) ---\n{operator.log_tail(40)}", file=sys.stderr)
            raise
        finally:
            if operator is not None:
                operator.stop()
            for component in reversed(components):
                component.stop()
            cluster.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_gang_queue", description=__doc__)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=6, help="8-GPU nodes per mode (default 6)")
    parser.add_argument("--workers", type=int, default=3, help="8-GPU workers per job (default 3)")
    parser.add_argument("--train-seconds", type=float, default=15.0)
    parser.add_argument("--time-limit", type=float, default=180.0, help="per mode; beyond it the queue is stuck")
    args = parser.parse_args(argv)
    measured = commit()
    with stop_on_signals():
        results = run(args)
    config = {k: getattr(args, k) for k in ("jobs", "nodes", "workers", "train_seconds", "time_limit")}
    print(json.dumps({"benchmark": "gang_queue", "commit": measured, "cpus": os.cpu_count(), "config": config,
                      "modes": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
