"""Time from losing a worker to training resumed, with real torchrun workers on the real node.

    python -m tests.benchmarks.bench_recovery_real_node [--repetitions 3]

Starts the control plane with one real kubelet node (tests/cluster/node), the operator and, per
repetition, a 3-worker gloo job (min 2) that checkpoints every 10 steps. Once all three train
in one world, the node is cordoned (no capacity for a replacement) and one worker is deleted;
the clock stops at the first training step the two survivors log in their re-formed world of
two. That interval is the whole elastic recovery: SIGTERM to the lost worker, the agreed final
checkpoint, the survivors' failed collective, torchrun's re-rendezvous (lastCallTimeoutSeconds
1), process restart with torch import, and the checkpoint load. Prints median/min/max as JSON
with the commit. Stops everything it started, by PID.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from phalanx.api import crd
from tests.benchmarks.harness import commit
from tests.cluster.kube import Kubectl
from tests.e2e.test_training import elastic_job, logs, wait_for_step
from tests.integration.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]


def one_recovery(kubectl: Kubectl, namespace: str) -> float:
    name = f"bench-{uuid.uuid4().hex[:4]}"
    kubectl.create(elastic_job(name, namespace, 2000), namespace=namespace)
    pods = [f"{name}-worker-{index}" for index in range(3)]
    wait_for_step(kubectl, namespace, pods, world=3, step=15)
    kubectl.run("cordon", "real-node")
    try:
        lost = time.monotonic()
        kubectl.run("delete", "pod", pods[2], f"--namespace={namespace}", "--wait=false")
        while "world_size=2 rank" not in logs(kubectl, namespace, pods[0]) + logs(kubectl, namespace, pods[1]):
            if time.monotonic() - lost > 300:
                raise TimeoutError("no training step in a world of 2 within 300 s")
            time.sleep(0.2)
        return time.monotonic() - lost
    finally:
        kubectl.run("uncordon", "real-node")
        kubectl.delete("tj", name, namespace, wait=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    from tests.cluster.node.realnode import RealNode, cluster_with_real_node

    directory = Path(tempfile.mkdtemp(prefix="phalanx-bench-recovery-"))
    cluster = cluster_with_real_node(directory / "cluster", node=RealNode(taint=False))
    cluster.start()
    try:
        kubectl = Kubectl(cluster.kubeconfig)
        kubectl.apply(yaml.safe_load((ROOT / "crds" / crd.CRD_FILE).read_text()))
        kubectl.wait_established(crd.CRD_NAME)
        namespace = "bench"
        kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        kubectl.wait_for(lambda: kubectl.get("serviceaccount", "default", namespace), timeout=30)
        with OperatorProcess(Path(cluster.kubeconfig), directory / "operator.log", namespace=namespace):
            samples = [one_recovery(kubectl, namespace) for _ in range(args.repetitions)]
    finally:
        cluster.stop()
    print(
        json.dumps(
            {
                "benchmark": "worker lost -> training resumed at world size 2 (real node, gloo, 3 workers, min 2)",
                "commit": commit(),
                "repetitions": len(samples),
                "median_seconds": round(statistics.median(samples), 2),
                "min_seconds": round(min(samples), 2),
                "max_seconds": round(max(samples), 2),
                "samples_seconds": [round(s, 2) for s in samples],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
