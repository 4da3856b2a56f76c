"""The chaos scenario driver: many TrainingJobs through whole lifecycles while the operator, the API
server and the network fail at random moments, with invariants checked against the API server.

    run = ChaosRun(ChaosConfig(jobs=8, concurrent=6, kills=20, seed=1), workdir)
    report = run.run()          # starts its own control plane + KWOK nodes, stops everything after
    report.violations           # [] when every invariant held

Each job follows a story drawn from the seed: it starts, then takes steps (counted failures: exit 1
and OOM; uncounted ones: eviction, deletion by hand; rescales; a gang restart; suspend and resume)
and ends (success, or a restart budget that the story exhausts on purpose), after which its TTL
deletes it. A step is taken only when the job is stable (Running with every desired worker ready,
as the API server shows it), so the driver knows what each job must count.

Faults, spread over the run: SIGKILL of the operator at random moments and, through the fault
proxy, right after one of its status writes (before it deletes or creates anything); cut watch
streams; kube-apiserver crashes (SIGKILL and start again); etcd compaction followed by such a
crash, which leaves every watch of the operator too old (410 Gone) and forces relists; a KWOK node
turning NotReady for a while. A killed operator is started again at once, as a Deployment would.

Invariants, after every round and at the end:
- never two live pods for one worker slot of one job;
- no pod outlives its owning job by more than the garbage collector's grace (``ORPHAN_GRACE``);
- a job's ``status.restarts`` equals the counted failures injected into it (never more, at any
  time; exactly, whenever the job is stable and at its end);
- no job ends Failed unless its story exhausted its budget; every job reaches its story's end;
- the operator never exits by itself.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import random
import re
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from phalanx.reconcile import naming
from tests.cluster.crds import cluster_crds
from tests.cluster.faultproxy import FaultProxy, Request
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.chart_identity import chart_identity
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import metric
from tests.unit.jobs import manifest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMESPACE = "chaos"
POOL_LABEL = "phalanx.dev/test-pool"
POOL = "chaos"
ORPHAN_GRACE = 60.0
STEP_TIMEOUT = 90.0
TTL_SECONDS = 45  # longer than any pause of the driver, which must see each job end
READINESS_SYNC_SECONDS = 5.0
COUNTED = ("fail", "oom")
MIDDLE_STEPS = ("fail", "oom", "evict", "delete", "scale", "suspend", "gang")
TRAINER: dict[str, Any] = {
    "name": "trainer",
    "image": "example/train:1",
    "command": ["torchrun"],
    "args": ["train.py"],
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
}


@dataclass(frozen=True)
class ChaosConfig:
    jobs: int = 8
    concurrent: int = 6
    kills: int = 20
    precise_kill_share: float = 0.5
    apiserver_restarts: int = 1
    forced_relists: int = 1
    watch_cuts: int = 4
    node_faults: int = 1
    steps_per_job: tuple[int, int] = (3, 6)
    nodes: int = 8
    seed: int = 1
    time_limit: float = 1500.0


@dataclass
class Story:
    """What happens to one job: its steps and how it ends (``succeed`` or ``exhaust``)."""

    steps: list[str]
    end: str
    minimum: int
    maximum: int
    desired: int

    @property
    def max_restarts(self) -> int:
        counted = sum(1 for step in self.steps if step in COUNTED or step == "gang")
        return counted if self.end == "exhaust" else counted + 5


@dataclass
class Wait:
    """What the job must reach before its next step."""

    what: str
    since: float
    desired: int | None = None
    victim_uid: str | None = None
    attempt_above: int | None = None
    suspended: bool = False
    gone: bool = False


@dataclass
class Job:
    name: str
    story: Story
    step: int = 0
    expected_restarts: int = 0
    uid: str = ""
    wait: Wait | None = None
    done: bool = False
    last_phase: str | None = None
    last_reason: str | None = None
    ended: str | None = None


@dataclass
class Report:
    """The run's figures (printed as JSON by the benchmark)."""

    config: dict[str, Any]
    seconds: float = 0.0
    jobs: int = 0
    jobs_succeeded: int = 0
    jobs_failed_as_scripted: int = 0
    pods_seen: int = 0
    steps: Counter[str] = field(default_factory=Counter)
    operator_kills: int = 0
    precise_kills: int = 0
    operator_starts: int = 0
    apiserver_restarts: int = 0
    forced_relists: int = 0
    relists_seen: int = 0
    watch_cuts: int = 0
    node_faults: int = 0
    counted_failures: int = 0
    violations: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "seconds": round(self.seconds, 1),
            "jobs": self.jobs,
            "jobs_succeeded": self.jobs_succeeded,
            "jobs_failed_as_scripted": self.jobs_failed_as_scripted,
            "pods_seen": self.pods_seen,
            "steps": dict(sorted(self.steps.items())),
            "counted_failures_injected": self.counted_failures,
            "operator_kills": self.operator_kills,
            "operator_kills_right_after_a_status_write": self.precise_kills,
            "operator_starts": self.operator_starts,
            "apiserver_restarts": self.apiserver_restarts,
            "forced_relists": self.forced_relists,
            "relists_seen_by_the_operator": self.relists_seen,
            "watch_cuts": self.watch_cuts,
            "node_faults": self.node_faults,
            "violations": self.violations,
        }


class Api:
    """A small synchronous client with the cluster's admin identity; retries while the API server
    is away (the driver restarts it on purpose)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.server = cluster.server
        self.context: ssl.SSLContext = cluster.ssl_context()

    def call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json", patience: float = 60
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        deadline = time.monotonic() + patience
        while True:
            request = urllib.request.Request(self.server + path, data=data, method=method)
            if data is not None:
                request.add_header("Content-Type", content_type)
            try:
                with urllib.request.urlopen(request, timeout=15, context=self.context) as response:
                    text = response.read()
                    return json.loads(text) if text else {}
            except urllib.error.HTTPError as error:
                if error.code in (404, 409, 422, 429) or time.monotonic() > deadline:
                    if error.code == 429 and time.monotonic() < deadline:
                        time.sleep(0.5)
                        continue
                    raise
                time.sleep(0.5)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def items(self, path: str) -> list[dict[str, Any]]:
        return list(self.call("GET", path).get("items", []))


def stories(config: ChaosConfig, rng: random.Random) -> Iterator[Story]:
    for index in range(config.jobs):
        minimum = rng.choice((1, 2, 2))
        maximum = minimum + rng.choice((1, 2))
        steps = [rng.choice(MIDDLE_STEPS) for _ in range(rng.randint(*config.steps_per_job))]
        end = "exhaust" if index % 5 == 4 else "succeed"
        yield Story(steps, end, minimum, maximum, rng.randint(minimum, maximum))


class ChaosRun:
    """See the module docstring."""

    def __init__(self, config: ChaosConfig, workdir: pathlib.Path, *, log: Any = sys.stderr) -> None:
        self.config = config
        self.workdir = workdir
        self.rng = random.Random(config.seed)
        self.report = Report(config=dict(config.__dict__))
        self.log = log
        self.jobs: list[Job] = []
        self.pending = list(stories(config, self.rng))
        self.orphans: dict[str, float] = {}
        self.not_ready: dict[str, float] = {}  # pod uid -> when it was first seen running but not ready
        self.faults_due = False  # a planned fault's moment has come and it was not injected yet
        self.kill_armed = False
        self.pod_uids: set[str] = set()
        self.killed = threading.Event()
        self.cluster: LocalCluster | None = None
        self.api: Api | None = None
        self.operator: OperatorProcess | None = None
        self.proxy: FaultProxy | None = None
        self.broken_nodes: dict[str, float] = {}  # nodes made NotReady, and when each heals
        self.nodes: list[str] = []

    # -- the run ---------------------------------------------------------------------------------

    def say(self, message: str) -> None:
        print(f"chaos {time.monotonic() - self.started:7.1f}s {message}", file=self.log, flush=True)

    def run(self) -> Report:
        self.started = time.monotonic()
        cluster = LocalCluster(self.workdir / "cluster", kwok=True)
        self.cluster = cluster
        cluster.start()
        try:
            kubectl = Kubectl(cluster.kubeconfig)
            self.api = Api(cluster)
            self._install(kubectl, cluster)
            with (
                FaultProxy(cluster.server, cluster.server_ca) as proxy,
                chart_identity(kubectl, cluster.kubeconfig, NAMESPACE, "chaos", self.workdir) as identity,
            ):
                self.proxy = proxy
                via = proxy.kubeconfig(identity, self.workdir / "via-proxy.kubeconfig")
                operator = OperatorProcess(
                    via,
                    self.workdir / "operator.log",
                    namespace=NAMESPACE,
                    extra_env={"PHALANX_PROGRESS_INTERVAL_SECONDS": "0"},
                )
                self.operator = operator
                with operator:
                    self._drive()
                    self._final_checks()
                self.report.operator_starts = operator.starts
                self.report.operator_kills = operator.kills
                self.report.relists_seen = self.relists()
                if operator.exited_on_its_own:
                    self.violate(f"the operator exited by itself: {operator.exited_on_its_own}")
        finally:
            cluster.stop()
        self.report.seconds = time.monotonic() - self.started
        self.report.pods_seen = len(self.pod_uids)
        return self.report

    def _install(self, kubectl: Kubectl, cluster: LocalCluster) -> None:
        for path in cluster_crds():
            body = yaml.safe_load(path.read_text())
            kubectl.apply(body)
            kubectl.run("wait", "--for=condition=Established", f"crd/{body['metadata']['name']}", "--timeout=60s")
        kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        kubectl.wait_for(lambda: kubectl.get("serviceaccount", "default", NAMESPACE), timeout=30)
        self.nodes = cluster.add_gpu_nodes(self.config.nodes, labels={POOL_LABEL: POOL}, name_prefix="chaos-gpu-")

    def violate(self, message: str) -> None:
        self.report.violations.append(message)
        self.say(f"VIOLATION {message}")

    # -- faults ----------------------------------------------------------------------------------

    def _fault_plan(self) -> list[tuple[float, str]]:
        """When (as a share of the expected run) each cluster-level fault happens."""
        config = self.config
        plan = [(self.rng.uniform(0.0, 0.92), "kill") for _ in range(config.kills)]
        plan += [
            ((i + 1) / (config.apiserver_restarts + 1) * 0.8, "apiserver") for i in range(config.apiserver_restarts)
        ]
        plan += [((i + 0.5) / config.forced_relists * 0.8, "relist") for i in range(config.forced_relists)]
        plan += [(self.rng.uniform(0.05, 0.9), "cut") for _ in range(config.watch_cuts)]
        plan += [(self.rng.uniform(0.1, 0.8), "node") for _ in range(config.node_faults)]
        return sorted(plan)

    def _inject(self, fault: str) -> None:
        assert self.operator is not None and self.proxy is not None and self.cluster is not None
        if fault == "kill":
            # One armed kill at a time: a second would fire on the same write and kill once.
            if not self.kill_armed and self.rng.random() < self.config.precise_kill_share:
                self.kill_armed = True
                self.killed.clear()
                self.proxy.after(lambda r: r.status_write, self._kill_from_proxy)
                self.say("armed: SIGKILL right after the operator's next status write")
            elif self.operator.kill():
                self.say("SIGKILL of the operator")
        elif fault == "cut":
            self.report.watch_cuts += 1
            self.say(f"cut {self.proxy.cut_watches()} watch streams")
        elif fault == "apiserver":
            took = self.cluster.restart_apiserver()
            self.report.apiserver_restarts += 1
            self.say(f"kube-apiserver crashed and restarted ({took:.1f}s)")
        elif fault == "relist":
            # Only a live operator with watches open can be forced to relist: no kill in flight.
            self.proxy.clear()
            self.kill_armed = False
            self._keep_operator_running()
            self._wait_synced()
            revision = self.cluster.compact_etcd()
            took = self.cluster.restart_apiserver()
            self.report.apiserver_restarts += 1
            self.report.forced_relists += 1
            self.say(f"etcd compacted at {revision}, kube-apiserver restarted ({took:.1f}s): old watches get 410")
            self._wait_relisted()
        elif fault == "node":
            node = self.rng.choice([name for name in self.nodes if name not in self.broken_nodes])
            self.cluster.set_node_not_ready(node, wait=False)
            self.report.node_faults += 1
            self.say(f"node {node} NotReady")
            self.broken_nodes[node] = time.monotonic() + 10

    def relists(self) -> int:
        assert self.operator is not None
        return len(re.findall(r"expired \(.*\); listing again", self.operator.log()))

    def _wait_relisted(self) -> None:
        """Before the next fault, let the operator relist (a kill now would hide it)."""
        before = self.relists()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.relists() == before:
            time.sleep(0.2)
        self._wait_synced()

    def _wait_synced(self) -> None:
        assert self.operator is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if metric(self.operator.metrics(), "phalanx_watch_synced", resource="pods.v1") == 1.0:
                    return
            time.sleep(0.2)
        self.violate("the operator's watches did not sync within 30s of its start")

    def _kill_from_proxy(self, request: Request) -> None:
        assert self.operator is not None
        self.kill_armed = False
        if self.operator.kill(wait=False):
            self.report.precise_kills += 1
            self.killed.set()

    def _keep_operator_running(self) -> None:
        assert self.operator is not None
        if self.operator.alive():
            return
        self.operator.check_alive(expect=False)
        if self.killed.is_set():
            self.say("SIGKILL of the operator right after its status write")
            self.killed.clear()
        self.operator.restart()

    # -- the loop --------------------------------------------------------------------------------

    def _outrunning_the_faults(self) -> bool:
        """Stories wait while faults are due (one is injected a round), so that the faults stay
        spread over the jobs' lives instead of piling up at the end."""
        return self.faults_due

    def _progress(self) -> float:
        """Share of all the stories' steps taken so far (faults are spread over it)."""
        planned = sum(len(job.story.steps) + 1 for job in self.jobs) + sum(len(s.steps) + 1 for s in self.pending)
        taken = sum(job.step for job in self.jobs)
        return taken / max(1, planned)

    def _drive(self) -> None:
        assert self.api is not None and self.cluster is not None and self.proxy is not None
        plan = self._fault_plan()
        while self.pending or any(not job.done for job in self.jobs):
            if time.monotonic() - self.started > self.config.time_limit:
                self.violate(f"the run did not finish within {self.config.time_limit:.0f}s")
                return
            if plan and plan[0][0] <= self._progress():  # one a round: a killed operator restarts between
                self._inject(plan.pop(0)[1])
            self.faults_due = bool(plan) and plan[0][0] <= self._progress()
            for node, heal_at in list(self.broken_nodes.items()):
                if time.monotonic() > heal_at:
                    self._heal(node)
            self._keep_operator_running()
            ending = sum(1 for job in self.jobs if not job.done and job.wait is not None and job.wait.gone)
            while self.pending and sum(1 for job in self.jobs if not job.done) - ending < self.config.concurrent:
                self._create(self.pending.pop(0))
            jobs, pods = self._observe()
            for job in self.jobs:
                if not job.done:
                    self._advance(job, jobs.get(job.name), pods)
            time.sleep(0.2)
        self.proxy.clear()  # a kill armed but not fired did not happen
        self.kill_armed = False
        for node in list(self.broken_nodes):
            self._heal(node)
        self._keep_operator_running()

    def _heal(self, node: str) -> None:
        """The node is Ready again (its pods' readiness follows, see ``_sync_readiness``)."""
        assert self.cluster is not None
        self.cluster.set_node_not_ready(node, not_ready=False, wait=True)
        self.broken_nodes.pop(node, None)
        self.say(f"node {node} Ready again")

    def _sync_readiness(self, pods: list[dict[str, Any]]) -> None:
        """Play the kubelet's status sync: a running container on a Ready node is reported ready
        again after the node controller marked it not ready (the node's heartbeat was late while
        the API server was down). KWOK's stages never undo that mark."""
        assert self.api is not None
        now = time.monotonic()
        stale = []
        for pod in pods:
            ready = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}.get("Ready")
            live = pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")
            uid = pod["metadata"]["uid"]
            if live and ready == "False":
                if now - self.not_ready.setdefault(uid, now) > READINESS_SYNC_SECONDS:
                    stale.append(pod)
            else:
                self.not_ready.pop(uid, None)
        if not stale:
            return
        nodes = self.api.items("/api/v1/nodes")
        ready_nodes = {
            n["metadata"]["name"]
            for n in nodes
            if {c["type"]: c["status"] for c in n["status"].get("conditions") or []}.get("Ready") == "True"
        }
        patch = {
            "status": {
                "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]
            }
        }
        for pod in stale:
            if pod["spec"].get("nodeName") in ready_nodes:
                with contextlib.suppress(urllib.error.HTTPError):
                    self.api.call(
                        "PATCH",
                        f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}/status",
                        patch,
                        content_type="application/strategic-merge-patch+json",
                    )
                self.not_ready.pop(pod["metadata"]["uid"], None)

    def _observe(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        assert self.api is not None
        jobs = {
            j["metadata"]["name"]: j
            for j in self.api.items(f"/apis/phalanx.dev/v1alpha1/namespaces/{NAMESPACE}/trainingjobs")
        }
        pods = self.api.items(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={naming.JOB_NAME_LABEL}")
        self._check_pods(jobs, pods)
        self._sync_readiness(pods)
        return jobs, pods

    def _check_pods(self, jobs: dict[str, dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        live_jobs = {j["metadata"]["uid"] for j in jobs.values()}
        slots: Counter[tuple[str, str]] = Counter()
        now = time.monotonic()
        for pod in pods:
            metadata = pod["metadata"]
            self.pod_uids.add(metadata["uid"])
            owner = next((r["uid"] for r in metadata.get("ownerReferences") or [] if r.get("controller")), None)
            if owner is None or owner not in live_jobs:
                first = self.orphans.setdefault(metadata["uid"], now)
                if now - first > ORPHAN_GRACE:
                    self.violate(f"pod {metadata['name']} outlived its job by more than {ORPHAN_GRACE:.0f}s")
                    self.orphans[metadata["uid"]] = float("inf")
            live = not metadata.get("deletionTimestamp") and pod["status"].get("phase") not in ("Succeeded", "Failed")
            index = metadata["labels"].get(naming.WORKER_INDEX_LABEL)
            if live and index is not None and owner is not None:
                slots[(owner, index)] += 1
        for (owner, index), count in slots.items():
            if count > 1:
                self.violate(f"{count} live pods for worker slot {index} of job uid {owner}")

    # -- one job ---------------------------------------------------------------------------------

    def _create(self, story: Story) -> None:
        assert self.api is not None
        name = f"job-{len(self.jobs):03d}-{uuid.uuid4().hex[:4]}"
        body = manifest(
            workers={"min": story.minimum, "max": story.maximum, "desired": story.desired},
            gpus={"count": 1},
            failurePolicy={"maxRestarts": story.max_restarts, "backoffSeconds": 1, "maxBackoffSeconds": 2},
            ttlSecondsAfterFinished=TTL_SECONDS,
            template={"spec": {"containers": [TRAINER], "nodeSelector": {POOL_LABEL: POOL}}},
        )
        body["metadata"] = {"name": name, "namespace": NAMESPACE}
        created = self.api.call("POST", f"/apis/phalanx.dev/v1alpha1/namespaces/{NAMESPACE}/trainingjobs", body)
        job = Job(name, story, uid=created["metadata"]["uid"])
        job.wait = Wait("running", time.monotonic(), desired=story.desired)
        self.jobs.append(job)
        self.report.jobs += 1
        self.say(
            f"{name}: created ({story.minimum}..{story.maximum}, {story.desired}), story {story.steps} -> {story.end}"
        )

    def _workers(self, job: Job, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            p
            for p in pods
            if p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_WORKER
            and any(r.get("uid") == job.uid for r in p["metadata"].get("ownerReferences") or [])
        ]

    def _stable(self, body: dict[str, Any], workers: list[dict[str, Any]], desired: int) -> bool:
        status = body.get("status") or {}
        if status.get("phase") != "Running" or status.get("workerSummary") != f"{desired}/{desired}":
            return False
        if status.get("observedGeneration") != body["metadata"].get("generation"):
            return False
        if body["spec"]["workers"]["desired"] != desired:
            return False
        attempt = str(status.get("attempt", 0))
        ready = [
            p
            for p in workers
            if not p["metadata"].get("deletionTimestamp")
            and p["status"].get("phase") == "Running"
            and p["metadata"]["labels"].get(naming.ATTEMPT_LABEL) == attempt
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in p["status"].get("conditions") or [])
        ]
        return len(ready) == desired == len(workers)

    def _advance(self, job: Job, body: dict[str, Any] | None, pods: list[dict[str, Any]]) -> None:
        status = (body or {}).get("status") or {}
        if body is not None:
            job.last_phase, job.last_reason = status.get("phase"), status.get("reason")
            if int(status.get("restarts", 0)) > job.expected_restarts:
                self.violate(f"{job.name}: restarts {status.get('restarts')} > {job.expected_restarts} injected")
                job.expected_restarts = int(status["restarts"])  # report each excess once
            exhausting = job.story.end == "exhaust" and job.wait is not None and job.wait.gone
            if status.get("phase") == "Failed" and not exhausting:
                self.violate(f"{job.name}: Failed ({status.get('reason')}: {status.get('message')})")
                job.done = True
                return
        wait = job.wait
        assert wait is not None
        if time.monotonic() - wait.since > STEP_TIMEOUT:
            seen = [
                (
                    p["metadata"]["name"],
                    p["spec"].get("nodeName"),
                    p["status"].get("phase"),
                    {c["type"]: c["status"] for c in p["status"].get("conditions") or []}.get("Ready"),
                    bool(p["metadata"].get("deletionTimestamp")),
                )
                for p in self._pods_of(job, pods)
            ]
            brief = {
                k: status.get(k) for k in ("phase", "reason", "message", "attempt", "restarts", "restartsByReason")
            }
            self.violate(
                f"{job.name}: stuck waiting for {wait.what}; status {brief}; "
                f"pods (name, node, phase, ready, deleting) {seen}"
            )
            job.done = True
            return
        workers = self._workers(job, pods)
        if wait.gone:
            if body is None:
                self._ended(job)
            return
        if body is None:
            self.violate(f"{job.name}: deleted before it ended (last phase {job.last_phase})")
            job.done = True
            return
        if wait.suspended:
            if status.get("phase") == "Suspended" and not self._pods_of(job, pods):
                if self._outrunning_the_faults():
                    wait.since = time.monotonic()  # waiting on the driver, not on the operator
                else:
                    self._take_step(job, body, workers)
            return
        desired = wait.desired if wait.desired is not None else body["spec"]["workers"]["desired"]
        if not self._stable(body, workers, desired):
            return
        if wait.victim_uid is not None and any(p["metadata"]["uid"] == wait.victim_uid for p in workers):
            return
        if wait.attempt_above is not None and int(status.get("attempt", 0)) <= wait.attempt_above:
            return
        if int(status.get("restarts", 0)) != job.expected_restarts:
            return  # not counted yet (an excess is reported above)
        if self._outrunning_the_faults():
            wait.since = time.monotonic()  # waiting on the driver, not on the operator
            return
        self._take_step(job, body, workers)

    def _pods_of(self, job: Job, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [p for p in pods if any(r.get("uid") == job.uid for r in p["metadata"].get("ownerReferences") or [])]

    def _ended(self, job: Job) -> None:
        job.done = True
        if job.last_phase not in ("Succeeded", "Failed"):
            # Gone before the driver saw it end (a fault kept the driver busy past the TTL): its
            # Events outlive it and say how it ended.
            assert self.api is not None
            selector = urllib.parse.quote(f"involvedObject.uid={job.uid}")
            reasons = {
                e.get("reason")
                for e in self.api.items(f"/api/v1/namespaces/{NAMESPACE}/events?fieldSelector={selector}")
            }
            if "Succeeded" in reasons:
                job.last_phase, job.last_reason = "Succeeded", "Succeeded"
            elif "RestartBudgetExhausted" in reasons:
                job.last_phase, job.last_reason = "Failed", "RestartBudgetExhausted"
        if job.story.end == "succeed" and job.last_phase == "Succeeded":
            self.report.jobs_succeeded += 1
        elif job.story.end == "exhaust" and (job.last_phase, job.last_reason) == ("Failed", "RestartBudgetExhausted"):
            self.report.jobs_failed_as_scripted += 1
        else:
            self.violate(
                f"{job.name}: ended as {job.last_phase}/{job.last_reason}, its story ends with {job.story.end}"
            )
        self.say(f"{job.name}: ended ({job.last_phase}) and deleted by its TTL")

    def _take_step(self, job: Job, body: dict[str, Any], workers: list[dict[str, Any]]) -> None:
        assert self.api is not None and self.cluster is not None
        now = time.monotonic()
        status = body.get("status") or {}
        desired = body["spec"]["workers"]["desired"]
        attempt = int(status.get("attempt", 0))
        step = job.story.end if job.step >= len(job.story.steps) else job.story.steps[job.step]
        job.step += 1
        self.report.steps[step] += 1
        path = f"/apis/phalanx.dev/v1alpha1/namespaces/{NAMESPACE}/trainingjobs/{job.name}"
        ordered = sorted(workers, key=lambda p: int(p["metadata"]["labels"][naming.WORKER_INDEX_LABEL]))
        victim = self.rng.choice(ordered) if ordered else None
        if step in COUNTED or step in ("succeed", "exhaust"):
            assert victim is not None
            code, reason = {"fail": (1, None), "oom": (137, "OOMKilled"), "exhaust": (1, None), "succeed": (0, None)}[
                step
            ]
            if code:
                job.expected_restarts += 1
                self.report.counted_failures += 1
            self.cluster.finish_pod(NAMESPACE, victim["metadata"]["name"], code, reason=reason)
            if step in ("succeed", "exhaust"):
                job.wait = Wait(f"{step}: the job ends and its TTL deletes it", now, gone=True)
            elif len(workers) - 1 < job.story.minimum:
                job.wait = Wait(f"{step}: a gang restart", now, desired=desired, attempt_above=attempt)
            else:
                job.wait = Wait(f"{step}: {victim['metadata']['name']} replaced", now, desired=desired,
                                victim_uid=victim["metadata"]["uid"])  # fmt: skip
        elif step == "gang":
            if desired != job.story.minimum:  # first down to min, so one failure leaves too few
                self._patch(path, {"spec": {"workers": {"desired": job.story.minimum}}})
                job.step -= 1
                self.report.steps[step] -= 1
                self.report.steps["scale"] += 1
                job.wait = Wait("scale down to min before the gang restart", now, desired=job.story.minimum)
                return
            assert victim is not None
            job.expected_restarts += 1
            self.report.counted_failures += 1
            self.cluster.finish_pod(NAMESPACE, victim["metadata"]["name"], 1)
            job.wait = Wait("gang: a new attempt running", now, desired=desired, attempt_above=attempt)
        elif step == "evict":
            assert victim is not None
            name = victim["metadata"]["name"]
            eviction = {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": name, "namespace": NAMESPACE},
            }
            with contextlib.suppress(urllib.error.HTTPError):
                self.api.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/eviction", eviction)
            job.wait = Wait(f"evict: {name} replaced", now, desired=desired, victim_uid=victim["metadata"]["uid"])
        elif step == "delete":
            assert victim is not None
            name = victim["metadata"]["name"]
            with contextlib.suppress(urllib.error.HTTPError):
                self.api.call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
            job.wait = Wait(f"delete: {name} replaced", now, desired=desired, victim_uid=victim["metadata"]["uid"])
        elif step == "scale":
            choices = [n for n in range(job.story.minimum, job.story.maximum + 1) if n != desired] or [desired]
            wanted = self.rng.choice(choices)
            self._patch(path, {"spec": {"workers": {"desired": wanted}}})
            job.wait = Wait(f"scale {desired} -> {wanted}", now, desired=wanted)
        elif step == "suspend":
            self._patch(path, {"spec": {"suspend": True}})
            job.story.steps.insert(job.step, "resume")
            job.wait = Wait("suspended, no pods", now, suspended=True)
        elif step == "resume":
            self._patch(path, {"spec": {"suspend": False}})
            job.wait = Wait("resumed as a new attempt", now, desired=desired, attempt_above=attempt)
        self.say(
            f"{job.name}: {step}"
            + (
                f" {victim['metadata']['name']}"
                if victim is not None and step not in ("scale", "suspend", "resume")
                else ""
            )
        )

    def _patch(self, path: str, body: dict[str, Any]) -> None:
        assert self.api is not None
        self.api.call("PATCH", path, body, content_type="application/merge-patch+json")

    # -- the end ---------------------------------------------------------------------------------

    def _final_checks(self) -> None:
        assert self.api is not None
        deadline = time.monotonic() + ORPHAN_GRACE
        while time.monotonic() < deadline:
            jobs, pods = self._observe()
            if not jobs and not pods:
                return
            time.sleep(1)
        jobs, pods = self._observe()
        if jobs:
            self.violate(f"jobs left at the end: {sorted(jobs)}")
        if pods:
            self.violate(f"pods left at the end: {sorted(p['metadata']['name'] for p in pods)}")


def summary_line(report: Report) -> str:
    figures = report.as_dict()
    return (
        f"{figures['jobs']} jobs ({figures['jobs_succeeded']} succeeded, {figures['jobs_failed_as_scripted']} "
        f"failed as scripted), {figures['pods_seen']} pods, {figures['counted_failures_injected']} counted failures, "
        f"{figures['operator_kills']} operator kills ({figures['operator_kills_right_after_a_status_write']} right "
        f"after a status write), {figures['apiserver_restarts']} API server restarts, {figures['forced_relists']} "
        f"forced relists ({figures['relists_seen_by_the_operator']} relists seen), {figures['watch_cuts']} watch cuts, "
        f"{len(figures['violations'])} violations in {figures['seconds']}s"
    )
