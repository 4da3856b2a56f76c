"""Peak memory of an operator start-up with many existing pods, for two versions side by side.

    python -m tests.benchmarks.bench_startup_memory [--pods 10000] [--baseline 3c66d5b] [--repeat 3]

Starts its own control plane (no KWOK: no node exists) and creates ``--pods`` worker pods in one
namespace, ``--in-flight`` POSTs at a time: the bodies phalanx's planner renders for 8-worker jobs
(``phalanx.reconcile.desired.worker_pod``: its labels, owner reference and 25 variables, plus a
template with 21 variables of its own (one from a Secret), command and arguments, two annotations),
so the API server records their managed fields as for any client. Every pod names a scheduler that
does not run (and a node pool no node has), so it stays Pending and nobody writes to it: every
start-up lists the same bodies. (The default scheduler marked 400 such pods Unschedulable within
40 s here, its writes rate-limited: many minutes for 10,000, while each body grows by a condition
and a managed-fields entry.)

The pods are owned (controller reference) by TrainingJobs that do not exist, so the operator keeps
a full record of each, as for the pods of live jobs, yet has no job to act on; the control plane
runs without its garbage collector, which would otherwise delete pods whose owner is gone.

Then, ``--repeat`` times and alternating which goes first, ``phalanx run --standalone
--namespace=NS`` of the baseline (``--baseline``: a commit checked out with ``git worktree add``
into a temporary directory, removed afterwards) and of this tree, each with an admin kubeconfig
and PYTHONPATH at its own ``operator/``: seconds from starting the process to every informer synced
(``phalanx_watch_synced`` of pods, Services and TrainingJobs at 1 on its metrics endpoint, polled
every 0.1 s), then the process's peak RSS (VmHWM) and RSS, and the pods its cache holds (its health
probe). Medians and the ratios current / baseline.

Progress goes to stderr; one JSON object with the commit goes to stdout. Everything it started is
stopped by PID, also on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import yaml

from phalanx.cluster import informer
from phalanx.reconcile import desired, environment
from tests.benchmarks.harness import ROOT, commit, create_all, process_usage, rss_mib, stop_on_signals, summary
from tests.cluster.crds import cluster_crds
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.unit.jobs import job as parsed_job
from tests.unit.jobs import manifest

NAMESPACE = "startup"
WORKERS_PER_JOB = 8
POOL = {"phalanx.dev/bench-pool": "nowhere"}  # no node has it
SCHEDULER = "phalanx-bench-nobody"  # no scheduler of that name runs: every pod stays Pending, untouched
# the resources whose informers must have synced (str(informer.Resource)); the optional ones
# (gang schedulers, Kueue, nodes) list nothing here
MUST_SYNC = ("pods.v1", "services.v1", "trainingjobs.phalanx.dev/v1alpha1")

USER_ENV = {
    "NCCL_DEBUG": "WARN",
    "NCCL_IB_DISABLE": "0",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_P2P_LEVEL": "NVL",
    "NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "HF_HOME": "/cache/huggingface",
    "HF_DATASETS_CACHE": "/cache/huggingface/datasets",
    "WANDB_PROJECT": "llm-pretraining",
    "WANDB_ENTITY": "research",
    "WANDB_RUN_GROUP": "llama-8b-ablation-lr",
    "WANDB_MODE": "online",
    "PYTHONUNBUFFERED": "1",
    "DATA_DIR": "/data/tokenized/en-web-2026-10",
    "CHECKPOINT_DIR": "/checkpoints/llama-8b-ablation-lr",
    "TRAIN_CONFIG": "/etc/train/llama-8b.yaml",
    "SEED": "1234",
    "LOG_LEVEL": "INFO",
}
ARGS = [
    "--nproc-per-node=8",
    "-m",
    "train",
    "--config=/etc/train/llama-8b.yaml",
    "--data=/data/tokenized/en-web-2026-10",
    "--global-batch-size=1024",
    "--micro-batch-size=4",
    "--lr=3e-4",
    "--warmup-steps=2000",
    "--max-steps=100000",
    "--save-every=1000",
]


def say(message: str) -> None:
    print(f"startup-memory {message}", file=sys.stderr, flush=True)


# -- the pods ----------------------------------------------------------------------------------------


def worker_pods(job_index: int) -> list[dict[str, Any]]:
    """The workers phalanx renders for one 8-worker job (owned by a TrainingJob that does not exist)."""
    name = f"job-{job_index:05d}"
    env: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in USER_ENV.items()]
    env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}})
    body = manifest(
        workers={"min": WORKERS_PER_JOB, "max": WORKERS_PER_JOB, "desired": WORKERS_PER_JOB},
        gpus={"count": 8},
        template={
            "metadata": {"annotations": {"example.com/team": "research-llm", "example.com/cost-center": "cc-4711"}},
            "spec": {
                "nodeSelector": POOL,
                "schedulerName": SCHEDULER,
                "containers": [
                    {
                        "name": "trainer",
                        "image": "registry.example.com/research/train:2026.11.3",
                        "command": ["torchrun"],
                        "args": ARGS,
                        "env": env,
                        "resources": {"requests": {"cpu": "32", "memory": "400Gi"}},
                    }
                ],
            },
        },
    )
    body["metadata"] = {**body["metadata"], "name": name, "namespace": NAMESPACE,
                        "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"phalanx-bench/{name}"))}  # fmt: skip
    job = parsed_job(body)
    launch = environment.resolve_launch(job.spec)
    return [desired.worker_pod(job, launch, index=i, attempt=0) for i in range(WORKERS_PER_JOB)]


# -- one start-up --------------------------------------------------------------------------------------


def synced(operator: OperatorProcess) -> bool:
    values: dict[str, float] = {}
    for line in operator.metrics().splitlines():
        if line.startswith("phalanx_watch_synced{"):
            labels, _, value = line.rpartition(" ")
            resource = labels.split('resource="', 1)[1].split('"', 1)[0]
            values[resource] = float(value)
    return all(values.get(resource) == 1.0 for resource in MUST_SYNC) and all(v == 1.0 for v in values.values())


def cached_pods(operator: OperatorProcess) -> int | None:
    """Pods in the operator's cache, from its health probe (kopf refreshes it every 10 s or so)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.health_port}/healthz", timeout=5) as response:
        probe = json.loads(response.read())
    count = (probe.get("reconcile-queue") or {}).get("pods")
    return int(count) if isinstance(count, int) else None


def start_up(cluster: LocalCluster, operator_dir: pathlib.Path, log: pathlib.Path, pods: int,
             timeout: float) -> dict[str, Any]:  # fmt: skip
    """One ``phalanx run`` from ``operator_dir``: start -> synced, then its memory."""
    operator = OperatorProcess(
        cluster.kubeconfig,
        log,
        namespace=NAMESPACE,
        # production's recheck of an absent API, not the tiers' 2 s
        extra_env={"PYTHONPATH": str(operator_dir), "PHALANX_ABSENT_API_RECHECK_SECONDS": "60"},
    )
    started = time.monotonic()
    try:
        operator.start()
        assert operator.process is not None
        pid = operator.process.pid
        Kubectl.wait_for(lambda: synced(operator), timeout=timeout, interval=0.1,
                         what=lambda: f"the operator's informers synced; log:\n{operator.log_tail(20)}")  # fmt: skip
        seconds = time.monotonic() - started
        peak, cpu = process_usage(pid)
        rss = rss_mib(pid)
        held = None
        deadline = time.monotonic() + 30  # the probe's answer may be a few seconds old
        while held != pods and time.monotonic() < deadline:
            time.sleep(1)
            with contextlib.suppress(OSError, ValueError):
                held = cached_pods(operator)
        operator.check_alive()
    finally:
        operator.stop()
    return {"seconds_to_synced": round(seconds, 2), "peak_rss_mib": round(peak, 1), "rss_at_sync_mib": round(rss, 1),
            "cpu_seconds_to_synced": round(cpu, 1), "pods_cached": held}  # fmt: skip


def check_imports_from(operator_dir: pathlib.Path) -> None:
    """``phalanx`` comes from ``operator_dir`` with PYTHONPATH at it (not the venv's editable install)."""
    env = {**os.environ, "PYTHONPATH": str(operator_dir)}
    command = [sys.executable, "-c", "import phalanx; print(phalanx.__file__)"]
    found = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    if not pathlib.Path(found.strip()).is_relative_to(operator_dir):
        raise RuntimeError(f"PYTHONPATH={operator_dir} imports phalanx from {found.strip()}")


@contextlib.contextmanager
def checked_out(ref: str, directory: pathlib.Path) -> Iterator[str]:
    """``ref`` checked out (detached) into ``directory``; its commit. The worktree is removed after."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    subprocess.run(["git", "worktree", "add", "--detach", str(directory), sha], cwd=ROOT, capture_output=True,
                   check=True)  # fmt: skip
    try:
        yield sha
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(directory)], cwd=ROOT, check=False)


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "peak_rss_mib": {"median": statistics.median(r["peak_rss_mib"] for r in runs),
                         "samples": [r["peak_rss_mib"] for r in runs]},
        "rss_at_sync_mib": {"median": statistics.median(r["rss_at_sync_mib"] for r in runs),
                            "samples": [r["rss_at_sync_mib"] for r in runs]},
        "seconds_to_synced": summary([r["seconds_to_synced"] for r in runs]),
        "cpu_seconds_to_synced": {"median": statistics.median(r["cpu_seconds_to_synced"] for r in runs),
                                  "samples": [r["cpu_seconds_to_synced"] for r in runs]},
        "pods_cached": [r["pods_cached"] for r in runs],
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    measured = commit()
    with tempfile.TemporaryDirectory(prefix="phalanx-startup-memory-") as scratch:
        workdir = pathlib.Path(scratch)
        current = ROOT / "operator"
        with checked_out(args.baseline, workdir / "baseline") as baseline_sha:
            contenders = {"baseline": workdir / "baseline" / "operator", "current": current}
            for operator_dir in contenders.values():
                check_imports_from(operator_dir)
            cluster = LocalCluster(
                workdir / "cluster",
                kwok=False,
                # pods whose owner does not exist stay (see the module's docstring)
                extra_controller_manager_args=["--controllers=*,-garbage-collector-controller"],
            )
            try:
                cluster.start()
                kubectl = Kubectl(cluster.kubeconfig)
                for path in cluster_crds():
                    kubectl.apply(yaml.safe_load(path.read_text()))
                kubectl.wait_established()
                kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
                kubectl.wait_for(lambda: kubectl.get("serviceaccount", "default", NAMESPACE) is not None, timeout=60,
                                 what=f"{NAMESPACE}/default ServiceAccount")  # fmt: skip
                pods = [pod for j in range(-(-args.pods // WORKERS_PER_JOB)) for pod in worker_pods(j)][: args.pods]
                say(f"creating {len(pods)} pods, {args.in_flight} at a time")
                began = time.monotonic()
                asyncio.run(create_all(cluster.server, pods, cluster.ssl_context(), args.in_flight))
                created = time.monotonic() - began
                status, body = cluster.api_get(f"/api/v1/namespaces/{NAMESPACE}/pods/{pods[0]['metadata']['name']}")
                assert status == 200, body[:200]
                pod_bytes = len(body)
                say(f"  created in {created:.1f}s; one pod is {pod_bytes} bytes of JSON")
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
                for round_ in range(args.repeat):
                    order = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))
                    for name in order:
                        log = workdir / f"{name}-{round_}.log"
                        result = start_up(cluster, contenders[name], log, args.pods, args.timeout)
                        say(f"  round {round_ + 1} {name}: {json.dumps(result)}")
                        runs[name].append(result)
                versions = cluster.versions
            finally:
                cluster.stop()
    figures = {name: medians(samples) for name, samples in runs.items()}
    current_figures, baseline_figures = figures["current"], figures["baseline"]
    return {
        "benchmark": "startup_memory",
        "commit": measured,
        "baseline": {"ref": args.baseline, "commit": baseline_sha, **baseline_figures},
        "current": current_figures,
        "ratios": {
            "peak_rss_current_over_baseline": round(
                current_figures["peak_rss_mib"]["median"] / baseline_figures["peak_rss_mib"]["median"], 3
            ),
            "seconds_to_synced_current_over_baseline": round(
                current_figures["seconds_to_synced"]["median_s"] / baseline_figures["seconds_to_synced"]["median_s"], 3
            ),
        },
        "config": {
            "pods": args.pods,
            "workers_per_job": WORKERS_PER_JOB,
            "repeat": args.repeat,
            "in_flight": args.in_flight,
            "list_page": int(informer.LIST_PAGE),
        },
        "pod_json_bytes": pod_bytes,
        "seconds_to_create_pods": round(created, 1),
        "cpus": os.cpu_count(),
        "kubernetes": versions.get("kubernetes"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_startup_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--pods", type=int, default=10_000, help="existing pods (default 10000)")
    parser.add_argument("--baseline", default="3c66d5b", help="the commit to compare with (default 3c66d5b)")
    parser.add_argument("--repeat", type=int, default=3, help="start-ups of each (default 3)")
    parser.add_argument("--in-flight", type=int, default=32, help="POSTs at once while creating the pods")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for one sync")
    args = parser.parse_args(argv)
    if args.pods < 1 or args.repeat < 1:
        parser.error("--pods and --repeat must be at least 1")
    with stop_on_signals():
        result = run(args)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
