"""Scale, side by side: a raw client (the lower bound), phalanx and Kubeflow's training operator.

    python -m tests.benchmarks.bench_scale [--sizes 100,250] [--workers 8]
        [--contenders raw,phalanx,kubeflow-default,kubeflow-tuned] [--gpus-per-node N]

One control plane with KWOK nodes (by default one node per job, as many GPUs as workers; with
``--gpus-per-node`` fewer, larger ones, which 10,000 pods need on 2 cores), one run. For each size (jobs x
workers, one GPU per worker) each contender in turn gets a namespace of its own and the same jobs:

- ``raw``: an asynchronous client (``--in-flight`` requests at once, as many as phalanx may send)
  creating exactly the objects phalanx's planner renders for those jobs (per job a Service, the
  rendezvous store pod and the worker pods, rendered by ``phalanx.reconcile.desired``, less their
  owner references, which would point at TrainingJobs that do not exist);
- ``phalanx``: ``phalanx run`` given TrainingJobs (min = max = desired, ``ttlSecondsAfterFinished: 0``);
- ``kubeflow-default`` / ``kubeflow-tuned``: Kubeflow's training operator (built from its Go module,
  tests/cluster/go/training-operator) given equivalent elastic PyTorchJobs, at its client defaults
  (QPS 20, burst 30, 1 thread) and tuned (QPS 500, burst 1000, 16 threads).

Measured for each: seconds from submission to every worker pod created and to every one Running
(from a watch). Jobs are submitted as the raw client sends its objects, ``--in-flight`` POSTs at a
time (kubectl creates a list one item after another: 250 jobs took it 30 s while the operator
created their pods, so kubectl, not the operator, set the pace). Then every worker exits 0
(KWOK), and the jobs finish and are deleted by their TTL. Each contender talks to the API
server under an identity of its own, and the API server's audit log gives its requests by verb
and resource over that whole lifecycle (per job). For the operators: peak RSS (VmHWM) and CPU
seconds of the process, RSS when idle before the jobs came, and status writes per job from its
creation until it first reported Running.

Progress goes to stderr; one JSON object with the commit goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import math
import os
import pathlib
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import yaml

from phalanx.cluster.client import DEFAULT_MAX_IN_FLIGHT
from phalanx.reconcile import desired, environment, naming
from tests.benchmarks.harness import commit, create_all, process_usage, rss_mib, stop_on_signals
from tests.cluster import binaries
from tests.cluster.crds import cluster_crds
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.cluster.ports import free_port
from tests.integration.operator_process import OperatorProcess
from tests.unit.jobs import job as parsed_job
from tests.unit.jobs import manifest

GPU = "nvidia.com/gpu"
POOL_LABEL = "phalanx.dev/bench-pool"
EXIT_CODE_LABEL = "kwok.phalanx.dev/exit-code"  # KWOK ends a labelled pod with that code (tests/cluster)
CONTENDERS = ("raw", "phalanx", "kubeflow-default", "kubeflow-tuned")
KUBEFLOW_TUNING = {
    "kubeflow-default": [],
    "kubeflow-tuned": ["--kube-api-qps=500", "--kube-api-burst=1000", "--controller-threads=16"],
}
CHURN_PAUSE_SECONDS = 2.0  # between one churned job's deletion + creation and the next
KUBEFLOW_WORKER_LABEL = ("training.kubeflow.org/replica-type", "worker")
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "userGroups": ["phalanx:bench"]}, {"level": "None"}],
}


def say(message: str) -> None:
    print(f"scale {message}", file=sys.stderr, flush=True)


# -- the jobs, three ways ---------------------------------------------------------------------------


def container(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "image": "example/train:1",
        "command": ["torchrun"],
        "args": ["train.py"],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {GPU: "1"}},
    }


def trainingjob(name: str, workers: int, pool: str) -> dict[str, Any]:
    body = manifest(
        workers={"min": workers, "max": workers, "desired": workers},
        gpus={"count": 1, "resource": GPU},
        ttlSecondsAfterFinished=0,
        template={"spec": {"containers": [container("trainer")], "nodeSelector": {POOL_LABEL: pool}}},
    )
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
    body["metadata"] = {"name": name}
    return body


def pytorchjob(name: str, workers: int, pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {
            "elasticPolicy": {"minReplicas": workers, "maxReplicas": workers, "rdzvBackend": "c10d", "maxRestarts": 3},
            "runPolicy": {"ttlSecondsAfterFinished": 0},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": workers,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": {"containers": [container("pytorch")], "nodeSelector": {POOL_LABEL: pool}}},
                }
            },
        },
    }


def rendered_objects(name: str, namespace: str, workers: int, pool: str) -> list[dict[str, Any]]:
    """What phalanx's planner creates for one job: Service, store pod, workers."""
    body = trainingjob(name, workers, pool)
    body["metadata"] = {**parsed_job().metadata.model_dump(by_alias=True, exclude_none=True), "name": name,
                        "namespace": namespace}  # fmt: skip
    tj = parsed_job(body)
    launch = environment.resolve_launch(tj.spec)
    objects = [desired.rendezvous_service(tj), desired.rendezvous_store_pod(tj, launch)]
    objects += [desired.worker_pod(tj, launch, index=i, attempt=0, kueue_total=None) for i in range(workers)]
    for obj in objects:
        obj["metadata"].pop("ownerReferences", None)
    return objects


# -- observing ---------------------------------------------------------------------------------------


class Watch:
    """Pods (and jobs) of one namespace, from a list + watch: when each worker pod was first seen
    and first Running, and when each job first reported Running."""

    def __init__(self, cluster: LocalCluster, namespace: str, is_worker: Callable[[dict[str, Any]], bool]) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.is_worker = is_worker
        self.created: dict[str, float] = {}
        self.running: dict[str, float] = {}
        self.first_seen: dict[str, tuple[str, float]] = {}  # uid -> (name, when its pod was first seen)
        self.failed: dict[str, tuple[str, float]] = {}  # uid -> (name, when first seen Failed)
        self.jobs_running: dict[str, float] = {}
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    def follow(self, path: str, on_object: Callable[[dict[str, Any], float], None]) -> None:
        def loop() -> None:
            version = ""
            while not self.stopping.is_set():
                with contextlib.suppress(OSError, ValueError):
                    if not version:
                        with urllib.request.urlopen(self.cluster.server + path, timeout=60,
                                                    context=self.cluster.ssl_context()) as response:  # fmt: skip
                            listing = json.loads(response.read())
                        now = time.monotonic()
                        for item in listing["items"]:
                            on_object(item, now)
                        version = listing["metadata"]["resourceVersion"]
                    url = f"{self.cluster.server}{path}?watch=1&resourceVersion={version}&timeoutSeconds=30"
                    with urllib.request.urlopen(url, timeout=60, context=self.cluster.ssl_context()) as response:
                        for line in response:
                            event = json.loads(line)
                            if event["type"] == "ERROR":
                                version = ""
                                break
                            version = event["object"]["metadata"]["resourceVersion"]
                            on_object(event["object"], time.monotonic())
                            if self.stopping.is_set():
                                return

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        self.threads.append(thread)

    def start(self, jobs_path: str, job_running: Callable[[dict[str, Any]], bool]) -> Watch:
        def on_pod(pod: dict[str, Any], now: float) -> None:
            if not self.is_worker(pod):
                return
            name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
            self.created.setdefault(name, now)
            self.first_seen.setdefault(uid, (name, now))
            phase = pod.get("status", {}).get("phase")
            if phase == "Running":
                self.running.setdefault(name, now)
            elif phase == "Failed":
                self.failed.setdefault(uid, (name, now))

        def on_job(job: dict[str, Any], now: float) -> None:
            if job_running(job):
                self.jobs_running.setdefault(job["metadata"]["name"], time.time())

        self.follow(f"/api/v1/namespaces/{self.namespace}/pods", on_pod)
        if jobs_path:
            self.follow(jobs_path.format(namespace=self.namespace), on_job)
        return self

    def stop(self) -> None:
        self.stopping.set()


def has_condition(obj: dict[str, Any] | None, kind: str) -> bool:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def wait(what: str, ok: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.2)


def audited_requests(audit_log: pathlib.Path, user: str) -> list[dict[str, Any]]:
    time.sleep(3)  # the audit backend writes in batches, at least every second
    events = []
    with audit_log.open() as lines:
        for line in lines:
            event = json.loads(line)
            if event.get("user", {}).get("username") == user and event.get("stage") == "ResponseComplete":
                events.append(event)
    return events


def requests_by_kind(events: list[dict[str, Any]], jobs: int) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    for event in events:
        ref = event.get("objectRef") or {}
        resource = ref.get("resource", event.get("requestURI", "?"))
        if ref.get("subresource"):
            resource += "/" + ref["subresource"]
        counts[f"{event['verb']} {resource}"] += 1
    return {key: round(count / jobs, 2) for key, count in sorted(counts.items())}


def status_writes_until_running(events: list[dict[str, Any]], resource: str, running: dict[str, float]) -> float:
    """Status writes per job received before that job first reported Running (wall clock)."""
    writes = 0
    for event in events:
        ref = event.get("objectRef") or {}
        if ref.get("resource") != resource or ref.get("subresource") != "status":
            continue
        if event["verb"] not in ("patch", "update", "apply"):
            continue
        when = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
        if ref.get("name") in running and when <= running[ref["name"]]:
            writes += 1
    return round(writes / max(1, len(running)), 2)


class ApiServerProfile:
    """The API server's CPU profile (Go pprof, 5-second captures back to back) from a contender's
    submission until ``done``; ``summary`` merges the captures into pprof's top functions."""

    CAPTURE_SECONDS = 5

    def __init__(self, cluster: LocalCluster, out: pathlib.Path, done: Callable[[], bool]) -> None:
        self.cluster, self.out, self.done = cluster, out, done
        self.captures: list[pathlib.Path] = []
        self.thread = threading.Thread(target=self.capture, daemon=True)

    def capture(self) -> None:
        while not self.done():
            status, body = self.cluster.api_get(f"/debug/pprof/profile?seconds={self.CAPTURE_SECONDS}",
                                                timeout=self.CAPTURE_SECONDS + 30)  # fmt: skip
            if status != 200:
                say(f"  API server profile: HTTP {status}: {body[:200]!r}")
                return
            path = self.out.with_name(f"{self.out.name}-{len(self.captures)}.pprof")
            path.write_bytes(body)
            self.captures.append(path)

    def __enter__(self) -> ApiServerProfile:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.thread.join(self.CAPTURE_SECONDS + 60)
        if not self.captures:
            return
        top = subprocess.run(["go", "tool", "pprof", "-top", "-nodecount=60", *map(str, self.captures)],
                             capture_output=True, text=True, check=False)  # fmt: skip
        summary = self.out.with_name(f"{self.out.name}-top.txt")
        summary.write_text(top.stdout + top.stderr)
        say(f"  API server profile: {len(self.captures)} captures, top functions in {summary}")


# -- the contenders ----------------------------------------------------------------------------------


class Bench:
    def __init__(
        self,
        cluster: LocalCluster,
        workdir: pathlib.Path,
        workers: int,
        *,
        in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        memory_profiles: pathlib.Path | None = None,
        cpu_profiles: pathlib.Path | None = None,
        apiserver_profiles: pathlib.Path | None = None,
    ) -> None:
        self.cluster = cluster
        self.in_flight = in_flight
        self.operator_env = {"PHALANX_MAX_IN_FLIGHT": str(in_flight)}
        self.memory_profiles = memory_profiles
        self.cpu_profiles = cpu_profiles
        self.apiserver_profiles = apiserver_profiles
        self.workdir = workdir
        self.workers = workers
        self.kubectl = Kubectl(cluster.kubeconfig)
        self.audit_log = workdir / "audit.log"
        self.kubeflow_crd_ready = False
        self.operator_pid: int | None = None  # the contender's operator, while it runs

    def identity(self, name: str) -> pathlib.Path:
        crt, key = self.cluster.issue_cert(name, f"/O=system:masters/O=phalanx:bench/CN={name}",
                                           directory=self.workdir / "pki")  # fmt: skip
        return self.cluster.write_kubeconfig(self.workdir / f"{name}.kubeconfig", name, crt, key)

    def namespace(self, name: str) -> str:
        self.kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        wait(f"{name}/default ServiceAccount", lambda: self.kubectl.get("serviceaccount", "default", name) is not None,
             60)  # fmt: skip
        return name

    def apiserver_cpu_seconds(self) -> float:
        """CPU time the API server has used so far: what serving each contender cost it."""
        return process_usage(self.cluster.pid_of("kube-apiserver"))[1]

    def measure_creation(
        self, watch: Watch, total: int, submitted: float, timeout: float, cpu_then: tuple[float, float]
    ) -> dict[str, float]:
        """``submitted``: when the jobs went in; ``cpu_then``: the API server's and the operator's CPU
        time then (``creation_started``)."""
        wait("every worker created", lambda: len(watch.created) >= total, timeout)
        created = max(watch.created.values()) - submitted
        # read late by at most a poll
        apiserver, operator = (now - then for now, then in zip(self.cpu_seconds(), cpu_then, strict=True))
        say(f"  all {total} workers created after {created:.2f}s (CPU-s: API server {apiserver:.1f}, "
            f"operator {operator:.1f})")  # fmt: skip
        wait("every worker Running", lambda: len(watch.running) >= total, timeout)
        running = max(watch.running.values()) - submitted
        say(f"  all {total} workers Running after {running:.2f}s")
        result = {"seconds_to_all_created": round(created, 2), "seconds_to_all_running": round(running, 2),
                  "apiserver_cpu_seconds_to_all_created": round(apiserver, 1)}  # fmt: skip
        if self.operator_pid is not None:
            result["operator_cpu_seconds_to_all_created"] = round(operator, 1)
        return result

    def apiserver_profile(self, name: str, watch: Watch, total: int) -> contextlib.AbstractContextManager[object]:
        """With --apiserver-profile: the API server profiled until all ``total`` workers exist."""
        if self.apiserver_profiles is None:
            return contextlib.nullcontext()
        return ApiServerProfile(self.cluster, self.apiserver_profiles / name, lambda: len(watch.created) >= total)

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU time the API server and the contender's operator (if any) have used so far."""
        return self.apiserver_cpu_seconds(), process_usage(self.operator_pid)[1] if self.operator_pid else 0.0

    def lifecycle(
        self, namespace: str, watch: Watch, items: list[dict[str, Any]], selector: str, resource: str, timeout: float
    ) -> dict[str, Any]:
        """Submit the jobs at once, time their workers' creation and start, then let them finish."""
        jobs = len(items)
        for item in items:
            item["metadata"]["namespace"] = namespace
        total = jobs * self.workers
        with self.apiserver_profile(f"{namespace}x{self.workers}", watch, total):
            cpu, submitted = self.cpu_seconds(), time.monotonic()
            asyncio.run(self.create_all(items, self.cluster.ssl_context()))
            submission = time.monotonic() - submitted
            say(f"  {jobs} jobs submitted in {submission:.2f}s")
            result = self.measure_creation(watch, total, submitted, timeout, cpu)
            result["seconds_to_all_submitted"] = round(submission, 2)
        wait("every job Running", lambda: len(watch.jobs_running) >= jobs, timeout)
        return {**result, "seconds_to_finish_and_delete": self.finish_and_drain(namespace, selector, resource, timeout)}

    def finish_and_drain(self, namespace: str, selector: str, resource: str, timeout: float) -> float:
        started = time.monotonic()

        def finished() -> bool:
            if not self.kubectl.list(resource, namespace):
                return True
            # Pods of jobs that finished go while the labels are being set: repeat for those left.
            asyncio.run(self.label_pods(namespace, selector, {EXIT_CODE_LABEL: "0"}))
            return False

        wait("every job finished and deleted by its TTL", finished, timeout)
        return round(time.monotonic() - started, 2)

    async def label_pods(self, namespace: str, selector: str, labels: dict[str, str]) -> None:
        """Label every pod the selector finds and lacks the labels, as many at once as the raw
        client sends (kubectl labels one pod after another: minutes at 10,000 pods)."""
        base = f"{self.cluster.server}/api/v1/namespaces/{namespace}/pods"
        gate = asyncio.Semaphore(self.in_flight)
        connector = aiohttp.TCPConnector(ssl=self.cluster.ssl_context(), limit=self.in_flight)
        # aiohttp's default total timeout (300 s) counts the wait for a connection: 10,000 labels
        # queue longer than that; each request is bounded by the socket read timeout instead
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            async with session.get(base, params={"labelSelector": selector}) as response:
                pods = (await response.json())["items"]
            patch = json.dumps({"metadata": {"labels": labels}})
            headers = {"Content-Type": "application/merge-patch+json"}

            async def label(name: str) -> None:
                async with gate, session.patch(f"{base}/{name}", data=patch, headers=headers) as answer:
                    if answer.status not in (200, 404):  # 404: its job finished meanwhile
                        raise RuntimeError(f"PATCH pod {name}: {answer.status} {await answer.text()}")

            unlabelled = [pod["metadata"]["name"] for pod in pods
                          if any(pod["metadata"].get("labels", {}).get(k) != v for k, v in labels.items())]  # fmt: skip
            await asyncio.gather(*(label(name) for name in unlabelled))

    # raw ------------------------------------------------------------------------------------------

    def raw(self, jobs: int, pool: str, timeout: float) -> dict[str, Any]:
        namespace = self.namespace(f"scale-raw-{jobs}")
        objects = [obj for i in range(jobs) for obj in rendered_objects(f"job-{i:04d}", namespace, self.workers, pool)]
        user = f"bench-raw-{jobs}"
        self.identity(user)
        watch = Watch(self.cluster, namespace, lambda pod: pod["metadata"].get("labels", {}).get(naming.ROLE_LABEL)
                      == naming.ROLE_WORKER).start("", lambda job: False)  # fmt: skip
        try:
            total = jobs * self.workers
            with self.apiserver_profile(f"{namespace}x{self.workers}", watch, total):
                cpu, submitted = self.cpu_seconds(), time.monotonic()
                asyncio.run(self.create_all(objects, self.client_context(user)))
                result: dict[str, Any] = self.measure_creation(watch, total, submitted, timeout, cpu)
        finally:
            watch.stop()
        events = audited_requests(self.audit_log, user)
        result["requests_per_job"] = requests_by_kind(events, jobs)
        result["bytes_per_job"] = round(sum(len(json.dumps(obj)) for obj in objects) / jobs)
        self.kubectl.delete("namespace", namespace, wait=False)
        return result

    def client_context(self, user: str) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.cluster.ca_cert))
        pki = self.workdir / "pki"
        context.load_cert_chain(str(pki / f"{user}.crt"), str(pki / f"{user}.key"))
        return context

    async def create_all(self, objects: list[dict[str, Any]], context: ssl.SSLContext) -> None:
        """POST every object, ``--in-flight`` at a time (the raw client's objects, and every
        contender's jobs: kubectl creates one after another, 30 s for 250 jobs here)."""
        await create_all(self.cluster.server, objects, context, self.in_flight)

    # phalanx --------------------------------------------------------------------------------------

    def phalanx(self, jobs: int, pool: str, timeout: float) -> dict[str, Any]:
        namespace = self.namespace(f"scale-phalanx-{jobs}")
        user = f"bench-phalanx-{jobs}"
        profile: list[str] = []
        if self.memory_profiles is not None:  # memray's peak-memory view: `memray flamegraph --temporal F`
            self.memory_profiles.mkdir(parents=True, exist_ok=True)
            out = self.memory_profiles / f"phalanx-{jobs}x{self.workers}.bin"
            out.unlink(missing_ok=True)
            profile = ["-m", "memray", "run", "--quiet", "--output", str(out)]
        # every namespace, as Kubeflow's operator watches
        operator = OperatorProcess(self.identity(user), self.workdir / f"phalanx-{jobs}.log",
                                   extra_env=self.operator_env, python_options=profile).start()  # fmt: skip
        assert operator.process is not None
        pid = self.operator_pid = operator.process.pid
        sampler: subprocess.Popen[bytes] | None = None
        try:
            time.sleep(3)
            idle = rss_mib(pid)
            if self.cpu_profiles is not None:
                sampler = self.sample_cpu(pid, self.cpu_profiles / f"phalanx-{jobs}x{self.workers}.speedscope.json")
            watch = Watch(self.cluster, namespace, lambda pod: pod["metadata"].get("labels", {}).get(naming.ROLE_LABEL)
                          == naming.ROLE_WORKER)  # fmt: skip
            watch.start("/apis/phalanx.dev/v1alpha1/namespaces/{namespace}/trainingjobs",
                        lambda job: (job.get("status") or {}).get("phase") == "Running")  # fmt: skip
            items = [trainingjob(f"job-{i:04d}", self.workers, pool) for i in range(jobs)]
            try:
                selector = f"{naming.ROLE_LABEL}={naming.ROLE_WORKER}"
                result = self.lifecycle(namespace, watch, items, selector, "tj", timeout)
            finally:
                watch.stop()
            peak, cpu = process_usage(pid)
        finally:
            if sampler is not None:
                sampler.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
                sampler.wait(60)
            operator.stop()
            self.operator_pid = None
        result |= self.operator_figures(user, jobs, "trainingjobs", watch, idle=idle, peak=peak, cpu=cpu)
        self.kubectl.delete("namespace", namespace, wait=False)
        return result

    def sample_cpu(self, pid: int, out: pathlib.Path) -> subprocess.Popen[bytes]:
        """py-spy sampling the operator (100 Hz, idle frames left out) until it is sent SIGINT."""
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        command = ["py-spy", "record", "--pid", str(pid), "--rate", "100", "--format", "speedscope",
                   "--output", str(out)]  # fmt: skip
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def operator_figures(
        self, user: str, jobs: int, resource: str, watch: Watch, *, idle: float, peak: float, cpu: float
    ) -> dict[str, Any]:
        """What an operator cost: memory, CPU, and its requests from the audit log."""
        events = audited_requests(self.audit_log, user)
        return {
            "idle_rss_mib": round(idle, 1),
            "peak_rss_mib": round(peak, 1),
            "cpu_seconds": round(cpu, 1),
            "status_writes_per_job_until_running": status_writes_until_running(events, resource, watch.jobs_running),
            "requests_per_job": requests_by_kind(events, jobs),
        }

    def failure_reaction(self, jobs: int, pool: str, samples: int, timeout: float) -> dict[str, Any]:
        """With jobs x workers pods Running and jobs being deleted and created beside them, fail one
        worker at a time and time failure (seen Failed) -> replacement (same name, new uid, seen).
        These jobs allow one worker fewer (min = workers - 1), so a failure replaces that worker
        alone (min = max would restart the whole gang)."""
        namespace = self.namespace(f"scale-failures-{jobs}")
        user = f"bench-phalanx-failures-{jobs}"
        operator = OperatorProcess(
            self.identity(user), self.workdir / f"phalanx-failures-{jobs}.log", extra_env=self.operator_env
        ).start()
        churn_stop = threading.Event()
        try:
            watch = Watch(self.cluster, namespace, lambda pod: pod["metadata"].get("labels", {}).get(naming.ROLE_LABEL)
                          == naming.ROLE_WORKER)  # fmt: skip
            watch.start("/apis/phalanx.dev/v1alpha1/namespaces/{namespace}/trainingjobs",
                        lambda job: (job.get("status") or {}).get("phase") == "Running")  # fmt: skip
            churned = max(1, jobs // 10)  # the last tenth is deleted and created again, one every 2 s
            bodies = [trainingjob(f"job-{i:04d}", self.workers, pool) for i in range(jobs)]
            for body in bodies:
                body["spec"]["workers"]["min"] = self.workers - 1
                body["spec"]["failurePolicy"] = {"maxRestarts": samples + 10}
            self.kubectl.run("create", f"--namespace={namespace}", "-f", "-", timeout=600,
                             input=json.dumps({"apiVersion": "v1", "kind": "List", "items": bodies}))  # fmt: skip
            wait("every job Running", lambda: len(watch.jobs_running) >= jobs, timeout)
            say(f"  {jobs * self.workers} workers Running; failing {samples} workers while {churned} jobs churn")

            def churn() -> None:
                rounds = 0
                while not churn_stop.is_set():
                    body = bodies[jobs - 1 - rounds % churned]
                    name = body["metadata"]["name"]
                    with contextlib.suppress(Exception):
                        self.kubectl.delete("tj", name, namespace=namespace)
                        self.kubectl.create(body, namespace=namespace)
                    rounds += 1
                    churn_stop.wait(CHURN_PAUSE_SECONDS)

            churner = threading.Thread(target=churn, daemon=True)
            churner.start()
            victims = [f"job-{i:04d}-worker-{i % self.workers}" for i in range(jobs - churned)][:samples]
            reactions = [self.fail_and_time(namespace, watch, victim) for victim in victims]
            churn_stop.set()
            churner.join(timeout=60)
            watch.stop()
            peak, cpu = process_usage(operator.process.pid) if operator.process else (0.0, 0.0)
        finally:
            churn_stop.set()
            operator.stop()
        self.kubectl.delete("namespace", namespace, wait=False)
        ordered = sorted(reactions)
        return {
            "samples": len(ordered),
            "failed_to_replacement_median_s": round(statistics.median(ordered), 3),
            "failed_to_replacement_p99_s": round(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)], 3),
            "failed_to_replacement_max_s": ordered[-1],
            "churned_jobs": churned,
            "peak_rss_mib": round(peak, 1),
            "cpu_seconds": round(cpu, 1),
        }

    def fail_and_time(self, namespace: str, watch: Watch, victim: str) -> float:
        """Fail one worker; seconds from the watch seeing it Failed to seeing its replacement."""
        uid = ((self.kubectl.get("pod", victim, namespace) or {}).get("metadata") or {}).get("uid", "")
        self.cluster.finish_pod(namespace, victim, 1)

        def replaced() -> float | None:
            if uid not in watch.failed:
                return None
            return next((seen for other, (name, seen) in list(watch.first_seen.items())
                         if name == victim and other != uid), None)  # fmt: skip

        wait(f"{victim} replaced", lambda: replaced() is not None, 60)
        return round((replaced() or 0.0) - watch.failed[uid][1], 4)

    # Kubeflow -------------------------------------------------------------------------------------

    def install_kubeflow(self) -> None:
        if self.kubeflow_crd_ready:
            return
        crd = (
            binaries.module_source("training-operator")
            / "manifests"
            / "base"
            / "crds"
            / "kubeflow.org_pytorchjobs.yaml"
        )
        self.kubectl.run("apply", "--server-side", f"--filename={crd}")
        established = lambda: has_condition(self.kubectl.get("crd", "pytorchjobs.kubeflow.org"), "Established")  # noqa: E731
        wait("the PyTorchJob CRD Established", established, 60)
        self.namespace("kubeflow")
        # Its certificate rotator fills this Secret (as the chart's manifests would create it) and
        # writes the webhook certificate from it into its private /tmp.
        secret = {"name": "training-operator-webhook-cert", "namespace": "kubeflow"}
        self.kubectl.apply({"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": secret})
        self.kubeflow_crd_ready = True

    def start_kubeflow(self, contender: str, kubeconfig: pathlib.Path) -> int:
        binary = binaries.ensure_binaries(["training-operator"])["training-operator"]
        certs = self.workdir / f"{contender}-certs"
        crt, key = self.cluster.issue_cert("serving", "/CN=training-operator", sans=["IP:127.0.0.1"], client=False,
                                           server=True, directory=certs)  # fmt: skip
        # Its certificate rotator reads a fixed /tmp path: give it a private /tmp holding our
        # certificate, so the host's /tmp is never written.
        script = (
            "mount -t tmpfs tmpfs /tmp && mkdir -p /tmp/k8s-webhook-server/serving-certs && "
            f"cp {crt} /tmp/k8s-webhook-server/serving-certs/tls.crt && "
            f'cp {key} /tmp/k8s-webhook-server/serving-certs/tls.key && exec "$0" "$@"'
        )
        health = free_port()
        popen = self.cluster.spawn(
            contender,
            [
                "unshare", "--mount", "--propagation=private", "sh", "-c", script, binary,
                f"--kubeconfig={kubeconfig}", "--enable-scheme=pytorchjob", "--metrics-bind-address=0",
                f"--health-probe-bind-address=127.0.0.1:{health}", f"--webhook-server-port={free_port()}",
                *KUBEFLOW_TUNING[contender],
            ],
            env={"MY_POD_NAMESPACE": "kubeflow", "PATH": "/usr/bin:/bin", "HOME": str(self.workdir)},
        )  # fmt: skip

        def ready() -> bool:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=2) as response,
            ):
                return bool(response.status == 200)
            return False

        try:
            wait(f"{contender} ready", ready, 90)
        except TimeoutError:
            log = self.cluster.log_dir / f"{contender}.log"
            say("\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else "(no log)")
            raise
        return popen.pid

    def kubeflow(self, contender: str, jobs: int, pool: str, timeout: float) -> dict[str, Any]:
        self.install_kubeflow()
        namespace = self.namespace(f"scale-{contender}-{jobs}")
        user = f"bench-{contender}-{jobs}"
        pid = self.operator_pid = self.start_kubeflow(contender, self.identity(user))
        try:
            time.sleep(3)
            idle = rss_mib(pid)
            label, value = KUBEFLOW_WORKER_LABEL
            watch = Watch(self.cluster, namespace, lambda pod: pod["metadata"].get("labels", {}).get(label) == value)
            watch.start("/apis/kubeflow.org/v1/namespaces/{namespace}/pytorchjobs",
                        lambda job: has_condition(job, "Running"))  # fmt: skip
            items = [pytorchjob(f"job-{i:04d}", self.workers, pool) for i in range(jobs)]
            try:
                result = self.lifecycle(
                    namespace, watch, items, f"{label}={value}", "pytorchjobs.kubeflow.org", timeout
                )
            finally:
                watch.stop()
            peak, cpu = process_usage(pid)
        finally:
            self.cluster.stop_process(contender)
            self.operator_pid = None
        result |= self.operator_figures(user, jobs, "pytorchjobs", watch, idle=idle, peak=peak, cpu=cpu)
        self.kubectl.delete("namespace", namespace, wait=False)
        return result


@contextlib.contextmanager
def bench_cluster(workdir: pathlib.Path, *, profiling: bool = False) -> Iterator[LocalCluster]:
    policy = workdir / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    cluster = LocalCluster(
        workdir / "cluster",
        kwok=True,
        extra_apiserver_args=[f"--audit-policy-file={policy}", f"--audit-log-path={workdir / 'audit.log'}",
                              "--audit-log-maxsize=0", "--audit-log-format=json", "--audit-log-mode=batch",
                              "--audit-log-batch-buffer-size=200000", "--audit-log-batch-max-wait=1s",
                              *(["--profiling=true"] if profiling else [])],
    )  # fmt: skip
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    # Outside /tmp: the training operator runs with a private, empty /tmp.
    scratch_root = binaries.cache_dir() / "bench"
    scratch_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="scale-", dir=scratch_root) as scratch:
        workdir = pathlib.Path(scratch)
        with bench_cluster(workdir, profiling=args.apiserver_profile is not None) as cluster:
            kubectl = Kubectl(cluster.kubeconfig)
            for path in cluster_crds():
                kubectl.apply(yaml.safe_load(path.read_text()))
            kubectl.wait_established()
            bench = Bench(cluster, workdir, args.workers, in_flight=args.in_flight, memory_profiles=args.memory_profile,
                          cpu_profiles=args.cpu_profile, apiserver_profiles=args.apiserver_profile)  # fmt: skip
            nodes = 0
            for jobs in args.sizes:
                pool = f"size-{jobs}"
                gpus = args.gpus_per_node or args.workers
                count = math.ceil(jobs * args.workers / gpus)
                # the GPUs bound the workers; the pod cap must not (the store pods, one per job, do
                # not spread evenly: a cap of GPUs + an even share left 20 of 157 nodes full)
                pods = gpus + jobs
                cluster.add_gpu_nodes(count, gpus_per_node=gpus, labels={POOL_LABEL: pool}, cpu=str(2 * pods),
                                      memory=f"{2 * pods}Gi", pods=str(pods), name_prefix=f"scale-{jobs}-",
                                      timeout=600)  # fmt: skip
                nodes += count
                size: dict[str, Any] = {"nodes": count, "gpus_per_node": gpus}
                for contender in args.contenders:
                    say(f"{jobs} x {args.workers} workers on {count} nodes: {contender}")
                    if contender == "raw":
                        size[contender] = bench.raw(jobs, pool, args.timeout)
                    elif contender == "phalanx":
                        size[contender] = bench.phalanx(jobs, pool, args.timeout)
                    else:
                        size[contender] = bench.kubeflow(contender, jobs, pool, args.timeout)
                    say(f"  {json.dumps(size[contender])}")
                    wait_pods_gone(kubectl, pool)
                if args.failures and "phalanx" in args.contenders and jobs * args.workers >= args.failures_at:
                    say(f"{jobs} x {args.workers}: worker failures under churn")
                    size["phalanx_failures"] = bench.failure_reaction(jobs, pool, args.failures, args.timeout)
                    say(f"  {json.dumps(size['phalanx_failures'])}")
                    wait_pods_gone(kubectl, pool)
                add_ratios(size)
                results[f"{jobs}x{args.workers}"] = size
    return results


def wait_pods_gone(kubectl: Kubectl, pool: str) -> None:
    """The next contender starts on empty nodes."""
    wait("the previous contender's pods gone", lambda: not [
        ns for ns in kubectl.list("namespaces") if ns["metadata"]["name"].startswith("scale-")
        and ns.get("status", {}).get("phase") == "Terminating"], 600)  # fmt: skip


def add_ratios(size: dict[str, Any]) -> None:
    raw = size.get("raw", {}).get("seconds_to_all_created")
    ours = size.get("phalanx", {}).get("seconds_to_all_created")
    ratios: dict[str, float] = {}
    if raw and ours:
        ratios["phalanx_created_over_raw"] = round(ours / raw, 2)
    for contender in ("kubeflow-default", "kubeflow-tuned"):
        theirs = size.get(contender, {}).get("seconds_to_all_created")
        if theirs and ours:
            ratios[f"{contender}_created_over_phalanx"] = round(theirs / ours, 2)
        rss = size.get(contender, {}).get("peak_rss_mib")
        if rss and size.get("phalanx", {}).get("peak_rss_mib"):
            ratios[f"phalanx_peak_rss_over_{contender}"] = round(size["phalanx"]["peak_rss_mib"] / rss, 2)
    size["ratios"] = ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--sizes", default="100,250", help="job counts, comma-separated (default 100,250)")
    parser.add_argument("--workers", type=int, default=8, help="workers per job (default 8)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs of each KWOK node (default: --workers, one node per job)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="per phase of one contender")
    parser.add_argument("--in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                        help="requests at once for the raw client and phalanx (PHALANX_MAX_IN_FLIGHT); "
                        f"default {DEFAULT_MAX_IN_FLIGHT}, phalanx's")  # fmt: skip
    parser.add_argument("--failures", type=int, default=30, help="worker failures to time (0: none)")
    parser.add_argument("--failures-at", type=int, default=2000, help="only at sizes with at least this many workers")
    parser.add_argument("--memory-profile", type=pathlib.Path, metavar="DIR",
                        help="run phalanx under memray (pip install memray) and keep its captures in DIR; "
                        "its RSS then includes the profiler's")  # fmt: skip
    parser.add_argument("--cpu-profile", type=pathlib.Path, metavar="DIR",
                        help="sample phalanx with py-spy (pip install py-spy) from submission to the end and keep "
                        "its speedscope profiles in DIR")  # fmt: skip
    parser.add_argument("--apiserver-profile", type=pathlib.Path, metavar="DIR",
                        help="profile the API server (Go pprof) from each contender's submission until all its "
                        "workers exist; captures and their merged top functions (needs go) go to DIR")  # fmt: skip
    args = parser.parse_args(argv)
    args.sizes = [int(size) for size in args.sizes.split(",")]
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; known: {', '.join(CONTENDERS)}")
    measured = commit()
    with stop_on_signals():
        results = run(args)
    config = {"sizes": args.sizes, "workers": args.workers, "contenders": args.contenders,
              "in_flight": args.in_flight, "gpus_per_node": args.gpus_per_node or args.workers}  # fmt: skip
    print(json.dumps({"benchmark": "scale", "commit": measured, "cpus": os.cpu_count(), "config": config,
                      "sizes": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
