"""The chaos scenario driver: many TrainingJobs through whole lifecycles while the operator, the API
server, the nodes, the network and the tenants fail or misbehave at random moments, with invariants
checked against the API server.

    run = ChaosRun(ChaosConfig(jobs=8, concurrent=6, kills=20, seed=1), workdir)
    report = run.run()          # starts its own control plane + KWOK nodes, stops everything after
    report.violations           # [] when every invariant held

Each job follows a story drawn from the seed: it starts, then takes steps (counted failures: exit 1
and OOM; uncounted ones: eviction, deletion by hand; rescales; a gang restart; suspend and resume)
and ends (success, or a restart budget that the story exhausts on purpose), after which its TTL
deletes it. A step is taken only when the job is stable (Running with every desired worker ready,
as the API server shows it), so the driver knows what each job must count.

The operator runs as two replicas (``ChaosConfig.replicas``) electing a leader by a Lease, as the
chart deploys it, cluster-wide under the chart's RBAC; each replica talks to the API server
through a fault proxy of its own, which records what it sent (``tests/chaos/audit.py``). Pods get
loopback addresses (``hostile.POD_CIDR``), so the operator's progress scrapes reach whatever this
process serves at a pod's address.

Faults, spread over the run: SIGKILL of the leader (a share of the kills hit the standby) at
random moments and, through the fault proxy, right after one of its status writes (before it
deletes or creates anything); the leader frozen (SIGSTOP) past its Lease's duration, then resumed
(SIGCONT); latency on the leader's API connection; cut watch streams; kube-apiserver crashes
(SIGKILL and start again); etcd compaction followed by such a crash, which leaves every watch too
old (410 Gone) and forces relists; a KWOK node NotReady for longer than the operator's node-lost
grace (``NODE_LOST_GRACE``); node Ready flaps (NotReady for a few seconds, far shorter than that
grace); a control-plane brownout (half the nodes stop heartbeating and turn Unknown for a few
seconds at once); hostile tenants (``HOSTILE_KINDS``): a worker serving a gzip bomb, one serving a
100 MiB page, a store serving a completion record that names another job, an impostor pod in
another namespace with a victim's worker's name, labels and owner. A killed replica is started
again at once, as a Deployment would; so is one that stopped because it lost the Lease.

A busy cluster (``ChaosConfig.racks``): the nodes are racks of uneven size (``busy.RACK``) whose
GPUs other tenants' pods, bound by name in ``TENANT_NAMESPACE``, mostly hold (``held_share``, the
first racks nearly full); the jobs that recreate their gang must run it in one rack (placement
required, placed by the operator); nodes are cordoned for seconds (``cordons``), and
``silent_tenants`` jobs of another tenant, one worker each with hang detection, on nodes of their
own, serve metrics endpoints that take the connection and never answer
(``hostile.SilentEndpoints``), loading the scraper.

Invariants, after every round and at the end:
- never two live pods for one worker slot of one job;
- no pod outlives its owning job by more than the garbage collector's grace (``ORPHAN_GRACE``);
- a job's ``status.restarts`` equals the counted failures injected into it (never more, at any
  time; exactly, whenever the job is stable and at its end);
- no job ends Failed unless its story exhausted its budget; every job reaches its story's end;
- a replica never exits by itself, except when it lost the Lease;
- at no moment do two replicas write: every mutating request a replica sends (its Lease
  renewals aside) comes from the last replica that took the Lease (``audit.single_writer``);
- a job held still while a flap, a brownout, a cordon or a hostile act lasts (stable jobs on the
  nodes concerned, the victim of a hostile act) keeps its attempt, its restarts and its pods, and
  does not end;
- on a busy cluster: a gang that must run in one rack never has bound workers of its current
  attempt in two; a Running job is never short of a worker for longer than ``SPARE_GRACE`` (of a
  leader at work) while a spare of its attempt is ready; a silent tenant's job is never restarted
  (never judged, its endpoints never answer) nor ended. How long each job placed in one rack took
  from creation to Running is reported, not judged;
- no pod whose container may run (not terminal, on a node that exists: nodes are never deleted
  here) is deleted with ``gracePeriodSeconds: 0``; every pod that ran on a node NotReady for
  longer than the node-lost grace was replaced by the time the node recovers;
- each replica's resident memory (VmRSS each round, VmHWM) stays under the chart's limit
  (``RSS_LIMIT_MIB``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import random
import re
import ssl
import statistics
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
from datetime import UTC, datetime, timedelta
from typing import Any

import yaml

from phalanx.reconcile import naming
from tests.chaos import hostile
from tests.chaos.audit import Sent, single_writer
from tests.chaos.replicas import Replica
from tests.cluster.busy import RACK, tenant_pod
from tests.cluster.crds import cluster_crds
from tests.cluster.faultproxy import FaultProxy, Request
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.chart_identity import chart_identity, render
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import metric
from tests.unit.jobs import manifest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMESPACE = "chaos"
TENANT_NAMESPACE = "chaos-tenant"  # where the impostor pod lives, and the pods that hold GPUs on a busy cluster
SILENT_NAMESPACE = "chaos-silent"  # the silent tenants' jobs (a busy cluster)
RELEASE = "chaos"  # the chart's release: its Role allows the Lease "<release>-phalanx"
POOL_LABEL = "phalanx.dev/test-pool"
POOL = "chaos"
SILENT_POOL = "chaos-silent"  # the silent tenants' nodes: no GPUs, no faults
GPUS_PER_NODE = 8
ORPHAN_GRACE = 60.0
STEP_TIMEOUT = 90.0
TTL_SECONDS = 45  # longer than any pause of the driver, which must see each job end
READINESS_SYNC_SECONDS = 5.0
COUNTED = ("fail", "oom")
MIDDLE_STEPS = ("fail", "oom", "evict", "delete", "scale", "suspend", "gang")
LEASE_SECONDS = (8, 4, 1)  # duration, renew deadline, retry: a standby takes over within ~10 s
FREEZE_SECONDS = LEASE_SECONDS[0] + 4.0  # past the Lease: the standby has taken it when the leader wakes
LATENCY = (0.2, 1.5)  # seconds each request of the slowed replica is held back
LATENCY_SECONDS = 20.0
NODE_LOST_GRACE = 30  # PHALANX_NODE_LOST_GRACE_SECONDS: how long a node may be not Ready before its pods count as lost
LONG_NOT_READY = NODE_LOST_GRACE + 20.0  # the node fault: acted on, by the time the node recovers
FLAP_SECONDS = (2.0, 5.0)  # a node Ready flap: far shorter than the grace
BROWNOUT_SECONDS = 6.0
HOLD_SETTLE = 10.0  # a held job stays watched this long after its fault ended
PROGRESS_INTERVAL = 5  # PHALANX_PROGRESS_INTERVAL_SECONDS: the operator scrapes workers and stores
HOSTILE_SECONDS = 4.0 * PROGRESS_INTERVAL  # a hostile page is served this long (a few scrapes)
HOSTILE_KINDS = ("bomb", "big-page", "foreign-completion", "impostor")
METRICS_PORT = 9400  # the workers' and the store's (phalanx.reconcile.environment.WORKER_METRICS_PORT)
RSS_LIMIT_MIB = 512  # the chart's memory limit (charts/phalanx/values.yaml resources.limits.memory)
FAULT_PATIENCE = 30.0  # a fault that needs a moment (a leader, a stable job) waits this long for one
CORDON_SECONDS = (3.0, 8.0)  # a node cordoned, then uncordoned
SPARE_GRACE = 10.0  # seconds of a leader at work a job may stay short of a worker while a spare is ready
SILENT_DEADLINE = 30  # the silent tenants' progressDeadlineSeconds (the least allowed)
TRAINER: dict[str, Any] = {
    "name": "trainer",
    "image": "example/train:1",
    "command": ["torchrun"],
    "args": ["train.py"],
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
}
# half the jobs restart their gang in place: the operator keeps their healthy pods and moves them
SUPERVISED_TRAINER: dict[str, Any] = {**TRAINER, "command": ["phalanx-supervise", "--", "torchrun"]}


@dataclass(frozen=True)
class ChaosConfig:
    jobs: int = 8
    concurrent: int = 6
    kills: int = 20
    precise_kill_share: float = 0.5
    standby_kill_share: float = 0.25  # of the kills at random moments, those of the standby
    apiserver_restarts: int = 1
    forced_relists: int = 1
    watch_cuts: int = 4
    node_faults: int = 1
    replicas: int = 2
    freezes: int = 1
    latency_faults: int = 1
    flaps: int = 2
    brownouts: int = 1
    hostile_acts: int = 4  # taken in turn from HOSTILE_KINDS
    steps_per_job: tuple[int, int] = (3, 6)
    nodes: int = 8
    seed: int = 1
    time_limit: float = 1500.0
    # A busy cluster (``racks`` not empty): the nodes are racks of these sizes (``nodes`` unused),
    # other tenants' pods hold ``held_share`` of their GPUs (the first racks nearly full), the jobs
    # that recreate their gang need it in one rack, nodes are cordoned for seconds, and ``silent_tenants``
    # jobs of other tenants, on nodes of their own, serve metrics endpoints that never answer.
    racks: tuple[int, ...] = ()
    held_share: float = 0.0
    cordons: int = 0
    silent_tenants: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.racks)


@dataclass
class Story:
    """What happens to one job: its steps and how it ends (``succeed`` or ``exhaust``)."""

    steps: list[str]
    end: str
    minimum: int
    maximum: int
    desired: int
    in_place: bool = False
    spares: int = 0
    """Warm spares (in-place jobs only: they need the supervisor)."""
    required: bool = False
    """Its gang must run in one rack (``spec.placement.topology`` required, placed by the operator)."""

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
    kept: frozenset[str] = frozenset()
    """UIDs of the pods a gang restart in place should keep: counted when the new attempt runs."""


@dataclass
class Hold:
    """A job kept from its next step while a fault that must not touch it lasts; ``judged``: what
    it had when the hold began must not change (else it is only kept still, as an attacker is)."""

    why: str
    until: float
    attempt: int
    restarts: int
    pods: dict[str, str]  # uid -> node of its live pods when the hold began
    judged: bool = True


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
    settled: bool = False  # last round: stable, every count in, ready for its next step
    hold: Hold | None = None
    created: float = 0.0
    ran: bool = False  # seen Running once


@dataclass
class Act:
    """A hostile tenant's act: pages served at pods' addresses, an impostor pod, until ``until``."""

    kind: str
    until: float
    pages: dict[str, hostile.HostilePage] = field(default_factory=dict)  # pod uid -> page at its address
    impostor: str | None = None


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
    leader_kills: int = 0
    standby_kills: int = 0
    precise_kills: int = 0
    operator_starts: int = 0
    leader_changes: int = 0
    lease_losses: int = 0
    freezes: int = 0
    latency_faults: int = 0
    apiserver_restarts: int = 0
    forced_relists: int = 0
    relists_seen: int = 0
    watch_cuts: int = 0
    node_faults: int = 0
    flaps: int = 0
    overrun_short_faults: int = 0  # flaps and brownouts the driver could end only past the node-lost grace
    brownouts: int = 0
    brownout_nodes: int = 0
    jobs_held: int = 0
    hostile_acts: Counter[str] = field(default_factory=Counter)
    hostile_pages_served: int = 0
    writes_audited: int = 0
    force_deletes: int = 0
    avoidances: set[tuple[str, str, str]] = field(default_factory=set)  # (job uid, node, until) seen in status
    pods_placed_while_avoiding: set[str] = field(default_factory=set)  # UIDs
    peak_rss_mib: float = 0.0
    counted_failures: int = 0
    gang_restarts_in_place: int = 0
    pods_kept_in_place: int = 0
    spares_promoted: set[str] = field(default_factory=set)
    """UIDs of spare pods seen promoted into a worker slot."""
    gpus: int = 0  # a busy cluster's: its racks' GPUs, those other tenants' pods hold
    gpus_held_by_tenants: int = 0
    cordons: int = 0
    silent_tenants: int = 0
    silent_connections: int = 0  # scrapes of the silent tenants' endpoints, never answered
    required_jobs: int = 0
    required_running_seconds: list[float] = field(default_factory=list)
    """From creation to Running, for each job whose gang must run in one rack."""
    spares_ready_while_short: int = 0  # (job, attempt) seen short of a worker with a ready spare
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
            "gang_restarts_in_place": self.gang_restarts_in_place,
            "pods_kept_through_them": self.pods_kept_in_place,
            "spares_promoted": len(self.spares_promoted),
            "operator_kills": self.operator_kills,
            "operator_kills_of_the_leader": self.leader_kills,
            "operator_kills_of_the_standby": self.standby_kills,
            "operator_kills_right_after_a_status_write": self.precise_kills,
            "operator_starts": self.operator_starts,
            "leader_changes": self.leader_changes,
            "replicas_stopped_after_losing_the_lease": self.lease_losses,
            "leader_freezes": self.freezes,
            "leader_latency_faults": self.latency_faults,
            "writes_audited": self.writes_audited,
            "apiserver_restarts": self.apiserver_restarts,
            "forced_relists": self.forced_relists,
            "relists_seen_by_the_operator": self.relists_seen,
            "watch_cuts": self.watch_cuts,
            "node_faults": self.node_faults,
            "node_flaps": self.flaps,
            "brownouts": self.brownouts,
            "brownout_nodes": self.brownout_nodes,
            "jobs_held_through_a_fault": self.jobs_held,
            "holds_unjudged_as_a_short_fault_overran": self.overrun_short_faults,
            "hostile_acts": dict(sorted(self.hostile_acts.items())),
            "hostile_pages_served": self.hostile_pages_served,
            "pods_force_deleted": self.force_deletes,
            "nodes_avoided_by_jobs": len(self.avoidances),
            "pods_created_while_their_job_avoided_nodes": len(self.pods_placed_while_avoiding),
            "peak_rss_mib": round(self.peak_rss_mib, 1),
            "rss_limit_mib": RSS_LIMIT_MIB,
            **(self._busy() if self.gpus else {}),
            "violations": self.violations,
        }

    def _busy(self) -> dict[str, Any]:
        ran = sorted(self.required_running_seconds)
        return {
            "gpus": self.gpus,
            "gpus_held_by_other_tenants": self.gpus_held_by_tenants,
            "held_share": round(self.gpus_held_by_tenants / self.gpus, 3),
            "node_cordons": self.cordons,
            "silent_tenant_jobs": self.silent_tenants,
            "silent_connections_never_answered": self.silent_connections,
            "jobs_placed_in_one_rack": self.required_jobs,
            "their_seconds_to_running": {
                "median": round(statistics.median(ran), 1) if ran else None,
                "max": round(ran[-1], 1) if ran else None,
            },
            "jobs_short_of_a_worker_with_a_spare_ready": self.spares_ready_while_short,
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
        in_place = index % 2 == 1
        spares = 1 if index % 4 == 3 else 0
        # Not with the supervisor: a gang placed by topology that restarts in place gets rank
        # addresses, an EndpointSlice of its pods' IPs, and the API server refuses loopback ones.
        required = config.busy and not in_place
        yield Story(
            steps,
            end,
            minimum,
            maximum,
            rng.randint(minimum, maximum),
            in_place=in_place,
            spares=spares,
            required=required,
        )


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
        self.lock = threading.Lock()
        self.statuses: dict[str, dict[str, Any]] = {}  # job name -> its status as last seen
        self.cluster: LocalCluster | None = None
        self.api: Api | None = None
        self.replicas: list[Replica] = []
        self.holder: tuple[str, str] | None = None  # the process that last took the Lease, and as whom
        self.sent: list[Sent] = []  # every mutating request of every replica (appended by the proxies' threads)
        # pods deleted with grace 0: who, how, the pod as deleted, the fault on its node then
        self.force_deleted: list[tuple[str, Request, dict[str, Any], str]] = []
        self.frozen: dict[str, tuple[float, str]] = {}  # replica -> when it may resume, its frozen process
        self.slowed: dict[str, float] = {}  # replica -> when its latency ends
        self.broken_nodes: dict[str, float] = {}  # nodes NotReady past the grace, and when each heals
        self.broken_pods: dict[str, set[str]] = {}  # node -> uids of the pods that ran there when it broke
        self.flapping: dict[str, float] = {}  # nodes in a short NotReady flap, and when each heals
        self.browned: tuple[list[str], float] | None = None  # nodes Unknown in a brownout, when they return
        self.unready_since: dict[str, float] = {}  # nodes of a flap or brownout, and when it began
        self.acts: list[Act] = []
        self.memory_reported: set[str] = set()
        self.pods_seen: dict[str, dict[str, Any]] = {}  # pod name -> the pod as last seen
        self.nodes: list[str] = []
        self.waiting_since: float | None = None  # the head of the plan waits for its moment since
        self.rack_of: dict[str, str] = {}  # a busy cluster's nodes -> their rack
        self.cordoned: dict[str, float] = {}  # nodes cordoned, and when each is uncordoned
        self.silent = hostile.SilentEndpoints()
        self.silenced: dict[str, str] = {}  # silent tenants' pod uid -> its address, served silent
        self.silent_checked = 0.0
        self.short: dict[tuple[str, str], float] = {}  # (job uid, attempt) -> leader seconds short with a spare ready
        self.short_checked: float | None = None
        self.reported: set[tuple[str, str, str]] = set()  # (check, job, attempt) of a violation reported once

    # -- the run ---------------------------------------------------------------------------------

    def say(self, message: str) -> None:
        print(f"chaos {time.monotonic() - self.started:7.1f}s {message}", file=self.log, flush=True)

    def run(self) -> Report:
        self.started = time.monotonic()
        # Kubernetes' own eviction delays (300 s), so that what happens to pods on a node that is
        # not Ready is the operator's doing.
        cluster = LocalCluster(
            self.workdir / "cluster", kwok=True, not_ready_toleration_seconds=300, unreachable_toleration_seconds=300
        )
        self.cluster = cluster
        cluster.start()
        try:
            kubectl = Kubectl(cluster.kubeconfig)
            self.api = Api(cluster)
            self._install(kubectl, cluster)
            with (
                chart_identity(kubectl, cluster.kubeconfig, NAMESPACE, RELEASE, self.workdir) as identity,
                contextlib.ExitStack() as stack,
            ):
                self._grant_cluster_scope(kubectl, identity)
                for name in "abcdefgh"[: self.config.replicas]:
                    proxy = stack.enter_context(FaultProxy(cluster.server, cluster.server_ca))
                    via = self.workdir / f"via-proxy-{name}.kubeconfig"  # written by each run's start
                    process = OperatorProcess(via, self.workdir / f"operator-{name}.log", extra_env=self._env(name))
                    replica = Replica(name, proxy, identity, process)
                    proxy.observe(functools.partial(self._sent, replica))
                    self.replicas.append(replica)
                for replica in self.replicas:
                    stack.enter_context(replica)
                self._drive()
                self._final_checks()
                self._sample_memory()
                self.report.relists_seen = self.relists()
            for replica in self.replicas:
                self.report.operator_starts += replica.process.starts
                self.report.operator_kills += replica.process.kills
            self._check_writers()
        finally:
            for act in list(self.acts):
                self._end_act(act)
            self.report.silent_connections = self.silent.accepted
            self.silent.close()
            cluster.stop()
        self.report.seconds = time.monotonic() - self.started
        self.report.pods_seen = len(self.pod_uids)
        return self.report

    def _env(self, replica: str) -> dict[str, str]:
        env = {
            "PHALANX_PROGRESS_INTERVAL_SECONDS": str(PROGRESS_INTERVAL),
            "PHALANX_NODE_LOST_GRACE_SECONDS": str(NODE_LOST_GRACE),
        }
        if self.config.replicas > 1:
            duration, deadline, retry = LEASE_SECONDS
            env |= {
                "PHALANX_LEADER_ELECTION": "1",
                "PHALANX_LEASE_NAMESPACE": NAMESPACE,
                "PHALANX_LEASE_NAME": f"{RELEASE}-phalanx",
                "PHALANX_LEADER_IDENTITY": replica,  # the chart's: its pod's name, kept across restarts
                "PHALANX_LEASE_DURATION_SECONDS": str(duration),
                "PHALANX_LEASE_RENEW_DEADLINE_SECONDS": str(deadline),
                "PHALANX_LEASE_RETRY_SECONDS": str(retry),
            }
        return env

    def _install(self, kubectl: Kubectl, cluster: LocalCluster) -> None:
        for path in cluster_crds():
            body = yaml.safe_load(path.read_text())
            kubectl.apply(body)
            kubectl.wait_established(body["metadata"]["name"])
        for namespace in (NAMESPACE, TENANT_NAMESPACE):
            kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        kubectl.wait_for(lambda: kubectl.get("serviceaccount", "default", NAMESPACE), timeout=30)
        if self.config.busy:
            self._busy_racks(kubectl, cluster)
        else:
            self.nodes = cluster.add_gpu_nodes(
                self.config.nodes, labels={POOL_LABEL: POOL}, name_prefix="chaos-gpu-", pod_cidr=hostile.POD_CIDR
            )
        if self.config.silent_tenants:
            kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SILENT_NAMESPACE}})
            # nodes of their own, which no fault touches: KWOK hands a gone pod's address to the
            # next, and a silent endpoint must never stand in for a chaos job's worker
            cluster.add_gpu_nodes(
                2, gpus_per_node=0, labels={POOL_LABEL: SILENT_POOL}, name_prefix="chaos-silent-",
                pod_cidr=hostile.POD_CIDR,
            )  # fmt: skip
        if self.config.hostile_acts:
            hostile.gzip_bomb()  # built once (seconds of CPU), before the clock of any fault runs

    def _busy_racks(self, kubectl: Kubectl, cluster: LocalCluster) -> None:
        """The racks' nodes, and other tenants' pods (bound by name) holding ``held_share`` of their
        GPUs: the racks fill in turn, each node full but a rack's first, which keeps one GPU free,
        so the first racks are nearly full and the last ones empty."""
        left = round(self.config.held_share * GPUS_PER_NODE * sum(self.config.racks))
        pods = []
        for letter, count in zip("abcdefghijklmnop", self.config.racks, strict=False):
            rack = f"rack-{letter}"
            nodes = cluster.add_gpu_nodes(
                count, GPUS_PER_NODE, labels={POOL_LABEL: POOL, RACK: rack}, name_prefix=f"chaos-gpu-{letter}",
                pod_cidr=hostile.POD_CIDR,
            )  # fmt: skip
            for i, node in enumerate(nodes):
                self.rack_of[node] = rack
                held = min(left, GPUS_PER_NODE - 1 if i == 0 else GPUS_PER_NODE)
                left -= held
                self.report.gpus += GPUS_PER_NODE
                self.report.gpus_held_by_tenants += held
                if held:
                    pods.append(tenant_pod(node, held, "nvidia.com/gpu"))
            self.nodes += nodes
        kubectl.create(pods, namespace=TENANT_NAMESPACE)
        kubectl.wait_for(
            lambda: all(p.get("status", {}).get("phase") == "Running" for p in kubectl.list("pods", TENANT_NAMESPACE)),
            timeout=60,
            what="the other tenants' pods running",
        )
        self.say(
            f"busy: {self.report.gpus_held_by_tenants} of {self.report.gpus} GPUs held by other tenants, "
            f"racks of {', '.join(map(str, self.config.racks))} nodes"
        )

    def _grant_cluster_scope(self, kubectl: Kubectl, identity: pathlib.Path) -> None:
        """The chart's cluster-wide install (its default): the operator watches every namespace,
        the tenant's too. ``chart_identity`` made the account and its Lease Role."""
        scoped = [
            obj
            for obj in render(RELEASE, NAMESPACE, "rbac.aggregateToDefaultRoles=false")
            if obj["kind"] in ("ClusterRole", "ClusterRoleBinding")
        ]
        kubectl.apply(scoped)
        operator = Kubectl(identity, kubectl.binary)
        kubectl.wait_for(
            lambda: (
                operator.run("auth", "can-i", "watch", "pods", "--all-namespaces", check=False).stdout.strip() == "yes"
            ),
            timeout=30,
            what="the chart's cluster-wide RBAC in effect",
        )

    def violate(self, message: str) -> None:
        self.report.violations.append(message)
        self.say(f"VIOLATION {message}")

    # -- what each replica sent --------------------------------------------------------------------

    def _sent(self, replica: Replica, request: Request, status: int, answer: bytes) -> None:
        """A proxy's observer (in its thread): file each mutating request, follow the Lease."""
        if not request.mutating:
            return
        process = replica.run_of(request)  # a dead run's last requests may arrive after the next began
        holder = None
        if request.resource == "leases":
            body = request.json() or {}
            holder = str((body.get("spec") or {}).get("holderIdentity") or "")
            if 200 <= status < 300:
                if holder and (process, holder) != self.holder:  # a takeover (audit.single_writer)
                    self.say(f"{process} took the Lease (as {holder})")
                self.holder = (process, holder) if holder else None
        self.sent.append(
            Sent(process, request.received, request.method, request.resource, request.name, status, holder)
        )
        if request.method == "DELETE" and request.resource == "pods" and 200 <= status < 300:
            options = request.json() or {}
            grace = options.get("gracePeriodSeconds", request.query.get("gracePeriodSeconds"))
            if grace is not None and int(grace) == 0:
                with contextlib.suppress(ValueError):  # the answer is the pod as it was deleted
                    pod = json.loads(answer)
                    fault = self._node_fault((pod.get("spec") or {}).get("nodeName"))  # at that moment
                    self.force_deleted.append((process, request, pod, fault))

    def _check_writers(self) -> None:
        takeovers, violations = single_writer(self.sent, self.started)
        self.report.leader_changes = len(takeovers)
        self.report.writes_audited = sum(1 for sent in self.sent if not sent.lease)
        for violation in violations:
            self.violate(f"two writers: {violation}")

    def _check_force_deletes(self) -> None:
        """A pod deleted with grace 0 whose container may still run: placed on a node that exists
        (nodes are never deleted here), not terminal as the API server answered the delete."""
        while self.force_deleted:
            process, request, pod, fault = self.force_deleted.pop(0)
            self.report.force_deletes += 1
            phase = (pod.get("status") or {}).get("phase")
            node = (pod.get("spec") or {}).get("nodeName")
            if phase in ("Succeeded", "Failed") or not node:
                continue
            self.violate(
                f"{process} force-deleted pod {request.name} (phase {phase}) on node {node}, which exists "
                f"({fault}) at {request.received - self.started:.1f}s"
            )

    def _node_fault(self, node: str | None) -> str:
        if node in self.broken_nodes:
            return f"NotReady for {LONG_NOT_READY:.0f}s, past the {NODE_LOST_GRACE}s grace"
        if node in self.flapping:
            return "in a Ready flap of seconds"
        browned = self.browned  # read once: the proxies' threads ask too
        if browned is not None and node in browned[0]:
            return "Unknown in a brownout of seconds"
        return "no fault on it"

    def _sample_memory(self) -> None:
        for replica in self.replicas:
            memory = replica.memory()
            if memory is None:
                continue
            rss, peak = memory
            self.report.peak_rss_mib = max(self.report.peak_rss_mib, peak)
            if peak > RSS_LIMIT_MIB and replica.current not in self.memory_reported:
                self.memory_reported.add(replica.current)
                self.violate(
                    f"replica {replica.current} resident memory {peak:.0f} MiB at its peak (now {rss:.0f}), "
                    f"over the chart's {RSS_LIMIT_MIB} MiB limit"
                )

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
        if config.replicas > 1:
            plan += [(self.rng.uniform(0.1, 0.85), "freeze") for _ in range(config.freezes)]
            plan += [(self.rng.uniform(0.05, 0.85), "latency") for _ in range(config.latency_faults)]
        plan += [(self.rng.uniform(0.05, 0.85), "flap") for _ in range(config.flaps)]
        plan += [(self.rng.uniform(0.1, 0.8), "brownout") for _ in range(config.brownouts)]
        plan += [
            (self.rng.uniform(0.1, 0.8), f"hostile:{HOSTILE_KINDS[i % len(HOSTILE_KINDS)]}")
            for i in range(config.hostile_acts)
        ]
        plan += [(self.rng.uniform(0.05, 0.85), "cordon") for _ in range(config.cordons)]
        return sorted(plan)

    def _inject(self, fault: str) -> bool:
        """Inject ``fault``; False when its moment has not come yet (no leader to freeze, no stable
        job to watch): it is tried again next round, for ``FAULT_PATIENCE`` at most."""
        assert self.cluster is not None
        if fault == "kill":
            return self._kill()
        if fault == "cut":
            self.report.watch_cuts += 1
            self.say(f"cut {sum(replica.proxy.cut_watches() for replica in self.replicas)} watch streams")
        elif fault in ("apiserver", "relist") and (self.flapping or self.browned is not None):
            # either can hold the driver for many seconds, and a flap or brownout must end on time
            return False
        elif fault == "apiserver":
            took = self.cluster.restart_apiserver()
            self.report.apiserver_restarts += 1
            self.say(f"kube-apiserver crashed and restarted ({took:.1f}s)")
        elif fault == "relist":
            self._force_relist()
        elif fault == "node":
            self._break_node()
        elif fault == "freeze":
            return self._freeze()
        elif fault == "latency":
            return self._slow_leader()
        elif fault == "flap":
            return self._flap()
        elif fault == "brownout":
            return self._brownout()
        elif fault == "cordon":
            return self._cordon()
        elif fault.startswith("hostile:"):
            return self._hostile(fault.removeprefix("hostile:"))
        return True

    def _alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.process.alive() and r.name not in self.frozen]

    def _leader(self) -> Replica | None:
        """The replica whose running process holds the Lease, unless it is frozen."""
        holder = self.holder
        return next((r for r in self._alive() if holder is not None and r.current == holder[0]), None)

    def _kill(self) -> bool:
        """SIGKILL a replica; False (tried again next round) while a frozen leader still holds the
        Lease: killing its successor-to-be again and again would leave nobody leading at all."""
        if self._leader() is None and any(
            self.holder and process == self.holder[0] for _, process in self.frozen.values()
        ):
            return False
        # One armed kill at a time: a second would fire on the same write and kill once.
        if not self.kill_armed and self.rng.random() < self.config.precise_kill_share:
            self.kill_armed = True
            for replica in self.replicas:
                replica.proxy.after(lambda r: r.status_write, functools.partial(self._kill_from_proxy, replica))
            self.say("armed: SIGKILL right after the leader's next status write")
            return True
        alive = self._alive()
        leader = self._leader()
        standbys = [replica for replica in alive if replica is not leader]
        if standbys and (leader is None or self.rng.random() < self.config.standby_kill_share):
            target, role = self.rng.choice(standbys), "standby"
        elif leader is not None:
            target, role = leader, "leader"
        else:
            return True
        self._sample_memory()
        if target.process.kill():
            if role == "leader":
                self.report.leader_kills += 1
            else:
                self.report.standby_kills += 1
            self.say(f"SIGKILL of the {role} {target.current}")
        return True

    def _kill_from_proxy(self, replica: Replica, request: Request) -> None:
        with self.lock:
            if not self.kill_armed:
                return
            self.kill_armed = False
        for other in self.replicas:
            other.proxy.cancel_after()
        if replica.process.kill(wait=False):
            self.report.precise_kills += 1
            self.report.leader_kills += 1
            self.say(f"SIGKILL of {replica.current} right after its status write")

    def _force_relist(self) -> None:
        # Only live replicas with watches open can be forced to relist: no kill in flight, none frozen.
        assert self.cluster is not None
        for replica in self.replicas:
            replica.proxy.clear()
        self.kill_armed = False
        for name in list(self.frozen):
            self._thaw(name)
        self.slowed.clear()
        self._keep_operator_running()
        self._wait_synced()
        revision = self.cluster.compact_etcd()
        took = self.cluster.restart_apiserver()
        self.report.apiserver_restarts += 1
        self.report.forced_relists += 1
        self.say(f"etcd compacted at {revision}, kube-apiserver restarted ({took:.1f}s): old watches get 410")
        self._wait_relisted()

    def _freeze(self) -> bool:
        """SIGSTOP the leader past its Lease while a standby runs: the standby takes over, and the
        leader, resumed, must not write (``_check_writers``)."""
        leader = self._leader()
        if leader is None or len(self._alive()) < 2:
            return False
        if self.broken_nodes:  # a node's pods are due for replacement: a leader must be there to do it
            return False
        leader.process.pause()
        self.frozen[leader.name] = (time.monotonic() + FREEZE_SECONDS, leader.current)
        self.report.freezes += 1
        self.say(f"SIGSTOP of the leader {leader.current}, for {FREEZE_SECONDS:.0f}s and until another takes the Lease")
        return True

    def _thaw(self, name: str) -> None:
        replica = next(r for r in self.replicas if r.name == name)
        self.frozen.pop(name, None)
        if replica.process.alive():
            replica.process.resume()
            self.say(f"SIGCONT of {replica.current}")

    def _slow_leader(self) -> bool:
        leader = self._leader()
        if leader is None:
            return False
        leader.proxy.set_latency(*LATENCY)
        self.slowed[leader.name] = time.monotonic() + LATENCY_SECONDS
        self.report.latency_faults += 1
        self.say(f"latency {LATENCY[0]}-{LATENCY[1]}s on every request of the leader {leader.current}")
        return True

    def relists(self) -> int:
        return sum(len(re.findall(r"expired \(.*\); listing again", r.process.log())) for r in self.replicas)

    def _wait_relisted(self) -> None:
        """Before the next fault, let the operator relist (a kill now would hide it)."""
        before = self.relists()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.relists() == before:
            time.sleep(0.2)
        self._wait_synced()

    def _wait_synced(self) -> None:
        for replica in self.replicas:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if not replica.process.alive():
                    break  # stopped meanwhile (it lost the Lease): started again, and waited for, later
                with contextlib.suppress(OSError):
                    if metric(replica.process.metrics(), "phalanx_watch_synced", resource="pods.v1") == 1.0:
                        break
                time.sleep(0.2)
            else:
                self.violate(f"the watches of {replica.current} did not sync within 30s of its start")

    def _keep_operator_running(self) -> None:
        """Start again every replica that ended, as a Deployment would: killed, or stopped by
        itself after it lost the Lease (anything else it does by itself is a violation)."""
        for replica in self.replicas:
            process = replica.process
            if process.alive():
                continue
            exits = len(process.exited_on_its_own)
            process.check_alive(expect=False)
            if len(process.exited_on_its_own) > exits:
                last_run = process.log().rsplit("--- phalanx run #", 1)[-1]
                if self.config.replicas > 1 and "lost the lease" in last_run:
                    self.report.lease_losses += 1
                    self.say(f"{replica.current} lost the Lease and stopped")
                else:
                    self.violate(
                        f"{replica.current} exited by itself ({process.exited_on_its_own[-1]}): {process.log_tail(5)}"
                    )
            self.frozen.pop(replica.name, None)
            self.slowed.pop(replica.name, None)
            replica.proxy.set_latency(None)
            replica.restart()

    # -- nodes -----------------------------------------------------------------------------------

    def _healthy_nodes(self) -> list[str]:
        browned = self.browned[0] if self.browned is not None else []
        return [n for n in self.nodes if n not in self.broken_nodes and n not in self.flapping and n not in browned]

    def _live_pods_on(self, nodes: set[str]) -> list[dict[str, Any]]:
        return [
            pod
            for pod in self.pods_seen.values()
            if pod["spec"].get("nodeName") in nodes
            and pod["status"].get("phase") == "Running"
            and not pod["metadata"].get("deletionTimestamp")
        ]

    def _break_node(self) -> None:
        """NotReady for longer than the operator's node-lost grace: its pods must be replaced, and
        their jobs keep off it (a node that runs pods, when one does)."""
        assert self.cluster is not None
        healthy = self._healthy_nodes()
        busy = sorted({pod["spec"]["nodeName"] for pod in self._live_pods_on(set(healthy))})
        node = self.rng.choice(busy or healthy)
        self.cluster.set_node_not_ready(node, wait=False)
        self.report.node_faults += 1
        self.broken_nodes[node] = time.monotonic() + LONG_NOT_READY
        self.broken_pods[node] = {pod["metadata"]["uid"] for pod in self._live_pods_on({node})}
        self.say(f"node {node} NotReady for {LONG_NOT_READY:.0f}s ({len(self.broken_pods[node])} pods on it)")

    def _busiest(self, nodes: list[str]) -> list[str]:
        """``nodes`` by how many pods of settled jobs run there, most first."""
        settled = {job.uid for job in self.jobs if job.settled and job.hold is None and not job.done}
        count: Counter[str] = Counter()
        for pod in self._live_pods_on(set(nodes)):
            if any(r.get("uid") in settled for r in pod["metadata"].get("ownerReferences") or []):
                count[pod["spec"]["nodeName"]] += 1
        return sorted(nodes, key=lambda n: -count[n])

    def _patient(self) -> bool:
        """Whether a fault that found no stable job to watch may wait another round."""
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        return now - self.waiting_since < FAULT_PATIENCE

    def _flap(self) -> bool:
        """Ready False for seconds on the node where most stable jobs run: nothing may happen to them."""
        assert self.cluster is not None
        nodes = self._busiest(self._healthy_nodes())
        if not nodes:
            return not self._patient()
        if not self._hold_jobs_on(set(nodes[:1]), "", dry_run=True) and self._patient():
            return False
        node = nodes[0]
        seconds = self.rng.uniform(*FLAP_SECONDS)
        self.cluster.set_node_not_ready(node, wait=False)
        self.flapping[node] = time.monotonic() + seconds
        self.unready_since[node] = time.monotonic()
        self.report.flaps += 1
        held = self._hold_jobs_on(
            {node}, f"node {node} NotReady for {seconds:.1f}s (grace {NODE_LOST_GRACE}s)", seconds
        )
        self.say(f"node {node} NotReady for {seconds:.1f}s, a flap; holding {held}")
        return True

    def _cordon(self) -> bool:
        """Cordon the node where most stable jobs run, for seconds: nothing may happen to them."""
        nodes = [node for node in self._busiest(self._healthy_nodes()) if node not in self.cordoned]
        if not nodes:
            return not self._patient()
        if not self._hold_jobs_on(set(nodes[:1]), "", dry_run=True) and self._patient():
            return False
        node = nodes[0]
        seconds = self.rng.uniform(*CORDON_SECONDS)
        self._set_unschedulable(node, True)
        self.cordoned[node] = time.monotonic() + seconds
        self.report.cordons += 1
        held = self._hold_jobs_on({node}, f"node {node} cordoned for {seconds:.1f}s", seconds)
        self.say(f"node {node} cordoned for {seconds:.1f}s; holding {held}")
        return True

    def _set_unschedulable(self, node: str, unschedulable: bool) -> None:
        assert self.api is not None
        self.api.call(
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"spec": {"unschedulable": unschedulable}},
            content_type="application/merge-patch+json",
        )

    def _brownout(self) -> bool:
        """Half the nodes stop heartbeating and turn Unknown at once, for seconds (the node
        lifecycle controller's verdict is written at once, as it would be after its grace)."""
        assert self.cluster is not None and self.api is not None
        nodes = self._busiest(self._healthy_nodes())[: max(3, len(self.nodes) // 2)]
        if not nodes:
            return not self._patient()
        if not self._hold_jobs_on(set(nodes), "", dry_run=True) and self._patient():
            return False
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        unknown = {
            "type": "Ready",
            "status": "Unknown",
            "reason": "NodeStatusUnknown",
            "message": "Kubelet stopped posting node status.",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        self.browned = (nodes, time.monotonic() + BROWNOUT_SECONDS)
        self.unready_since.update(dict.fromkeys(nodes, time.monotonic()))
        for node in nodes:
            self.cluster.set_node_lost(node)  # KWOK stops its heartbeats and Lease
        for node in nodes:
            with contextlib.suppress(urllib.error.HTTPError):
                self.api.call(
                    "PATCH",
                    f"/api/v1/nodes/{node}/status",
                    {"status": {"conditions": [unknown]}},
                    content_type="application/strategic-merge-patch+json",
                )
        self.report.brownouts += 1
        self.report.brownout_nodes += len(nodes)
        held = self._hold_jobs_on(
            set(nodes), f"a brownout: {len(nodes)} nodes Unknown for {BROWNOUT_SECONDS:.0f}s", BROWNOUT_SECONDS
        )
        self.say(f"brownout: {len(nodes)} nodes Unknown ({', '.join(nodes)}); holding {held}")
        return True

    def _end_brownout(self) -> None:
        assert self.cluster is not None and self.browned is not None
        nodes, _ = self.browned
        for node in nodes:
            self.cluster.set_node_lost(node, lost=False)
        self.cluster.wait_nodes_ready(nodes)
        self.browned = None
        for node in nodes:
            self.unready_since.pop(node, None)
        self.say(f"brownout over: {len(nodes)} nodes Ready again")

    def _heal(self, node: str) -> None:
        """The node is Ready again (its pods' readiness follows, see ``_sync_readiness``)."""
        assert self.cluster is not None
        self.cluster.set_node_not_ready(node, not_ready=False, wait=True)
        self.flapping.pop(node, None)
        self.unready_since.pop(node, None)
        if self.broken_nodes.pop(node, None) is not None:
            # a job that ended meanwhile replaces nothing: its pods get their grace, then stop
            ended = {job.uid for job in self.jobs if job.done or job.last_phase in ("Succeeded", "Failed")}
            stayed = [
                pod["metadata"]["name"]
                for pod in self._live_pods_on({node})
                if pod["metadata"]["uid"] in self.broken_pods.get(node, set())
                and not any(r.get("uid") in ended for r in pod["metadata"].get("ownerReferences") or [])
            ]
            if stayed:
                self.violate(
                    f"node {node} was NotReady for {LONG_NOT_READY:.0f}s, past the {NODE_LOST_GRACE}s grace, "
                    f"and its pods {stayed} were not replaced"
                )
            self.broken_pods.pop(node, None)
        self.say(f"node {node} Ready again")

    # -- jobs held still through a fault ---------------------------------------------------------

    def _hold_jobs_on(self, nodes: set[str], why: str, seconds: float = 0.0, *, dry_run: bool = False) -> int:
        """Hold every settled job with a pod on ``nodes`` (and none on a node past the grace); a job
        held already is held longer, and its verdict names this fault too."""
        held = 0
        for job in self.jobs:
            if job.hold is not None and not dry_run and set(job.hold.pods.values()) & nodes:
                job.hold.why += f", and then {why}"
                job.hold.until = max(job.hold.until, time.monotonic() + seconds + HOLD_SETTLE)
            if job.done or not job.settled or job.hold is not None:
                continue
            pods = self._live_pods_of(job)
            if not set(pods.values()) & nodes or set(pods.values()) & set(self.broken_nodes):
                continue
            held += 1
            if not dry_run:
                self._hold(job, why, seconds, pods)
        return held

    def _live_pods_of(self, job: Job) -> dict[str, str]:
        return {
            pod["metadata"]["uid"]: pod["spec"].get("nodeName", "")
            for pod in self.pods_seen.values()
            if any(r.get("uid") == job.uid for r in pod["metadata"].get("ownerReferences") or [])
            and pod["status"].get("phase") not in ("Succeeded", "Failed")
            and not pod["metadata"].get("deletionTimestamp")
        }

    def _hold(
        self, job: Job, why: str, seconds: float, pods: dict[str, str] | None = None, *, judged: bool = True
    ) -> None:
        """Keep ``job`` from its next step for the ``seconds`` a fault lasts and ``HOLD_SETTLE`` more."""
        status = self.statuses.get(job.name, {})
        job.hold = Hold(
            why,
            time.monotonic() + seconds + HOLD_SETTLE,
            int(status.get("attempt", 0)),
            int(status.get("restarts", 0)),
            self._live_pods_of(job) if pods is None else pods,
            judged,
        )
        self.report.jobs_held += 1

    def _check_holds(self, jobs: dict[str, dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        # A flap or brownout the driver could not end before the node-lost grace (held up by a slow
        # request) is a node loss by then: the operator is right to act on it.
        overran = {node for node, since in self.unready_since.items() if now - since > NODE_LOST_GRACE - 1}
        for job in self.jobs:
            hold = job.hold
            if hold is None:
                continue
            if job.done or set(hold.pods.values()) & set(self.broken_nodes):
                job.hold = None  # ended by its story, or a fault that may touch it came: no verdict
                continue
            late = set(hold.pods.values()) & overran
            if late:
                job.hold = None
                self.report.overrun_short_faults += 1
                self.say(f"{job.name}: no verdict, {', '.join(sorted(late))} stayed unready past the grace")
                continue
            body = jobs.get(job.name)
            status = (body or {}).get("status") or {}
            live = {
                p["metadata"]["uid"]
                for p in self._pods_of(job, pods)
                if not p["metadata"].get("deletionTimestamp")
                and p["status"].get("phase") not in ("Succeeded", "Failed")
            }
            changed = []
            if body is None:
                changed.append("the job is gone")
            else:
                if int(status.get("attempt", 0)) != hold.attempt:
                    changed.append(f"attempt {hold.attempt} -> {status.get('attempt')}")
                if int(status.get("restarts", 0)) != hold.restarts:
                    changed.append(
                        f"restarts {hold.restarts} -> {status.get('restarts')} {status.get('restartsByReason')}"
                    )
                if status.get("phase") in ("Succeeded", "Failed"):
                    changed.append(f"{status.get('phase')} ({status.get('reason')}: {status.get('message')})")
            gone = sorted(uid for uid in hold.pods if uid not in live)
            if gone:
                changed.append(f"{len(gone)} of its {len(hold.pods)} pods deleted or ended")
            if changed and hold.judged:
                self.violate(f"{job.name} during {hold.why}: {'; '.join(changed)}")
                job.hold = None
            elif now > hold.until:
                job.hold = None

    # -- hostile tenants -------------------------------------------------------------------------

    def _settled(self) -> list[Job]:
        return [job for job in self.jobs if job.settled and job.hold is None and not job.done]

    def _hostile(self, kind: str) -> bool:
        """One hostile act (``HOSTILE_KINDS``): an attacker job's pods serve what no worker should, or
        an impostor claims a victim's worker; a witness (the victim) is held and judged."""
        assert self.api is not None
        settled = self._settled()
        if len(settled) < 2:
            return not self._patient()  # too few stable jobs for too long: the act is dropped
        attacker, victim = self.rng.sample(settled, 2)
        act = Act(kind, time.monotonic() + HOSTILE_SECONDS)
        pods = [p for p in self.pods_seen.values() if p["metadata"]["uid"] in self._live_pods_of(attacker)]
        if kind in ("bomb", "big-page"):
            page = hostile.gzip_bomb() if kind == "bomb" else hostile.big_page()
            for pod in pods:
                if pod["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_WORKER:
                    self._serve(act, pod, page)
            what = f"{attacker.name}'s workers serve {page.what}"
        elif kind == "foreign-completion":
            victim_pods = [p for p in self.pods_seen.values() if p["metadata"]["uid"] in self._live_pods_of(victim)]
            store = next(
                (p for p in victim_pods if p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_RENDEZVOUS),
                None,
            )
            if store is None:
                return not self._patient()
            attempt = int(self.statuses.get(victim.name, {}).get("attempt", 0))
            page = hostile.completion_record(attacker.uid, attempt)
            self._serve(act, store, page)
            what = f"{victim.name}'s store serves a completion record of {attacker.name} (attempt {attempt})"
        else:
            victim_workers = [
                p
                for p in self.pods_seen.values()
                if p["metadata"]["uid"] in self._live_pods_of(victim)
                and p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_WORKER
            ]
            if not victim_workers:
                return not self._patient()
            act.impostor = self._impostor(self.rng.choice(victim_workers))
            what = f"a pod in {TENANT_NAMESPACE} claims {victim.name}'s worker {act.impostor}"
        self._hold(attacker, f"its own hostile act ({kind})", HOSTILE_SECONDS, judged=False)
        self._hold(victim, f"a hostile act of another tenant: {what}", HOSTILE_SECONDS)
        self.acts.append(act)
        self.report.hostile_acts[kind] += 1
        self.say(f"hostile: {what}")
        return True

    def _serve(self, act: Act, pod: dict[str, Any], page: hostile.Page) -> None:
        address = pod["status"].get("podIP")
        if not address:
            return
        try:
            act.pages[pod["metadata"]["uid"]] = hostile.HostilePage(address, METRICS_PORT, page)
        except OSError as error:
            self.say(f"cannot serve at {address}:{METRICS_PORT}: {error}")

    def _impostor(self, worker: dict[str, Any]) -> str:
        """A pod in another namespace with ``worker``'s name, labels and owner."""
        assert self.api is not None
        metadata = worker["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": metadata["name"],
                "namespace": TENANT_NAMESPACE,
                "labels": metadata.get("labels") or {},
                "ownerReferences": metadata.get("ownerReferences") or [],
            },
            "spec": {
                "containers": [{"name": "trainer", "image": TRAINER["image"]}],
                "nodeSelector": {POOL_LABEL: POOL},
            },
        }
        with contextlib.suppress(urllib.error.HTTPError):
            self.api.call("POST", f"/api/v1/namespaces/{TENANT_NAMESPACE}/pods", body)
        return str(metadata["name"])

    def _end_acts(self, pods: list[dict[str, Any]]) -> None:
        """End acts whose time is up; stop serving at the address of a pod that is gone (KWOK gives
        its address to the next pod, maybe another job's)."""
        live = {p["metadata"]["uid"] for p in pods if not p["metadata"].get("deletionTimestamp")}
        now = time.monotonic()
        for act in list(self.acts):
            for uid in [uid for uid in act.pages if uid not in live]:
                self.report.hostile_pages_served += act.pages[uid].served
                act.pages.pop(uid).close()
            if now > act.until:
                self._end_act(act)

    def _end_act(self, act: Act) -> None:
        served = 0
        for page in act.pages.values():
            served += page.served
            page.close()
        act.pages.clear()
        self.report.hostile_pages_served += served
        if act.impostor is not None and self.api is not None:
            with contextlib.suppress(urllib.error.HTTPError, urllib.error.URLError, OSError):
                self.api.call(
                    "DELETE", f"/api/v1/namespaces/{TENANT_NAMESPACE}/pods/{act.impostor}", {"gracePeriodSeconds": 0}
                )
        if act in self.acts:
            self.acts.remove(act)
            self.say(f"hostile act {act.kind} over ({served} pages served)")

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
        assert self.api is not None and self.cluster is not None
        plan = self._fault_plan()
        self._create_silent_tenants()
        while self.pending or any(not job.done for job in self.jobs):
            if time.monotonic() - self.started > self.config.time_limit:
                self.violate(f"the run did not finish within {self.config.time_limit:.0f}s")
                return
            if plan and plan[0][0] <= self._progress():  # one a round: a killed operator restarts between
                fault = plan[0][1]
                if self._inject(fault):
                    plan.pop(0)
                    self.waiting_since = None
            self.faults_due = bool(plan) and plan[0][0] <= self._progress()
            self._end_faults()
            self._keep_operator_running()
            self._sample_memory()
            ending = sum(1 for job in self.jobs if not job.done and job.wait is not None and job.wait.gone)
            while self.pending and sum(1 for job in self.jobs if not job.done) - ending < self.config.concurrent:
                self._create(self.pending.pop(0))
            self._check_force_deletes()
            jobs, pods = self._observe()
            self._check_holds(jobs, pods)
            self._end_acts(pods)
            self._check_silent_tenants()
            for job in self.jobs:
                if not job.done:
                    self._advance(job, jobs.get(job.name), pods)
            time.sleep(0.2)
        for replica in self.replicas:
            replica.proxy.clear()  # a kill armed but not fired did not happen; no latency left
        self.kill_armed = False
        for act in list(self.acts):
            self._end_act(act)
        self._end_faults(everything=True)
        self._keep_operator_running()

    def _end_faults(self, *, everything: bool = False) -> None:
        """Heal the nodes, resume the frozen, speed up the slowed whose time is up (all of them at
        the end)."""
        now = float("inf") if everything else time.monotonic()
        for node, heal_at in [*self.broken_nodes.items(), *self.flapping.items()]:
            if now > heal_at:
                self._heal(node)
        if self.browned is not None and now > self.browned[1]:
            self._end_brownout()
        for node, uncordon_at in list(self.cordoned.items()):
            if now > uncordon_at:
                self._set_unschedulable(node, False)
                del self.cordoned[node]
                self.say(f"node {node} uncordoned")
        for name, (thaw_at, process) in list(self.frozen.items()):
            # resumed once another took the Lease (the point of the freeze), or after waiting long for it
            taken = self.holder is None or self.holder[0] != process
            if now > thaw_at and (taken or now > thaw_at + 3 * LEASE_SECONDS[0]):
                self._thaw(name)
        for name, until in list(self.slowed.items()):
            if now > until:
                self.slowed.pop(name)
                next(r for r in self.replicas if r.name == name).proxy.set_latency(None)
                self.say(f"latency on replica {name} over")

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
        self.statuses = {name: body.get("status") or {} for name, body in jobs.items()}
        self.pods_seen.update((p["metadata"]["name"], p) for p in pods)
        for name in set(self.pods_seen) - {p["metadata"]["name"] for p in pods}:
            del self.pods_seen[name]
        self._check_pods(jobs, pods)
        if self.config.busy:
            self._check_racks(jobs, pods)
            self._check_spares(jobs, pods)
        self._sync_readiness(pods)
        return jobs, pods

    # -- a busy cluster ----------------------------------------------------------------------------

    def _live(self, pod: dict[str, Any], attempt: str) -> bool:
        """Of the current attempt, not deleted, not ended."""
        return (
            pod["metadata"]["labels"].get(naming.ATTEMPT_LABEL) == attempt
            and not pod["metadata"].get("deletionTimestamp")
            and pod["status"].get("phase") not in ("Succeeded", "Failed")
        )

    def _check_racks(self, jobs: dict[str, dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        """A gang that must run in one rack never has bound workers of its current attempt in two."""
        for body in jobs.values():
            topology = ((body.get("spec") or {}).get("placement") or {}).get("topology") or {}
            if topology.get("mode") != "required":
                continue
            uid = body["metadata"]["uid"]
            attempt = str((body.get("status") or {}).get("attempt", 0))
            bound = {
                p["metadata"]["name"]: self.rack_of.get(p["spec"]["nodeName"], "no rack")
                for p in pods
                if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])
                and p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_WORKER
                and p["spec"].get("nodeName")
                and self._live(p, attempt)
            }
            if len(set(bound.values())) > 1 and ("racks", uid, attempt) not in self.reported:
                self.reported.add(("racks", uid, attempt))
                self.violate(
                    f"{body['metadata']['name']} must run in one rack and its attempt {attempt} runs in "
                    f"{sorted(set(bound.values()))}: {bound} (status.placement {body['status'].get('placement')})"
                )

    def _check_spares(self, jobs: dict[str, dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        """A Running job is never short of a worker for longer than ``SPARE_GRACE`` while a spare of
        its attempt is ready. Only time while a leader is at work counts (not killed, not frozen,
        not slowed, the API server up): a job's wait on a takeover is no fault of the promotion."""
        now = time.monotonic()
        elapsed = 0.0 if self.short_checked is None else min(now - self.short_checked, 1.0)
        self.short_checked = now
        if self._leader() is None or self.slowed:
            elapsed = 0.0
        short: set[tuple[str, str]] = set()
        for body in jobs.values():
            status = body.get("status") or {}
            if status.get("phase") != "Running":
                continue
            uid = body["metadata"]["uid"]
            attempt = str(status.get("attempt", 0))
            own = [
                p
                for p in pods
                if self._live(p, attempt)
                and any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])
            ]
            ready_spares = [
                p["metadata"]["name"]
                for p in own
                if p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_SPARE
                and p["status"].get("phase") == "Running"
                and {c["type"]: c["status"] for c in p["status"].get("conditions") or []}.get("Ready") == "True"
            ]
            running = {
                p["metadata"]["labels"].get(naming.WORKER_INDEX_LABEL)
                for p in own
                if p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_WORKER
                and p["status"].get("phase") == "Running"
            }
            missing = [i for i in range(int(body["spec"]["workers"]["desired"])) if str(i) not in running]
            if not ready_spares or not missing:
                continue
            key = (uid, attempt)
            short.add(key)
            if key not in self.short:
                self.report.spares_ready_while_short += 1
            self.short[key] = self.short.get(key, 0.0) + elapsed
            if self.short[key] > SPARE_GRACE and ("short", *key) not in self.reported:
                self.reported.add(("short", *key))
                self.violate(
                    f"{body['metadata']['name']} (attempt {attempt}) short of workers {missing} for "
                    f"{self.short[key]:.0f}s of a leader at work while its spares {ready_spares} were ready"
                )
        for key in set(self.short) - short:
            del self.short[key]

    def _create_silent_tenants(self) -> None:
        """Other tenants' jobs of one worker with hang detection whose endpoints never answer: they
        load the scraper, and, never judged, must never be restarted."""
        assert self.api is not None
        quiet = {**TRAINER, "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}
        for index in range(self.config.silent_tenants):
            body = manifest(
                workers={"min": 1, "max": 1, "desired": 1},
                failurePolicy={"progressDeadlineSeconds": SILENT_DEADLINE},
                template={"spec": {"containers": [quiet], "nodeSelector": {POOL_LABEL: SILENT_POOL}}},
            )
            body["metadata"] = {"name": f"silent-{index:03d}", "namespace": SILENT_NAMESPACE}
            self.api.call("POST", f"/apis/phalanx.dev/v1alpha1/namespaces/{SILENT_NAMESPACE}/trainingjobs", body)
            self.report.silent_tenants += 1
        if self.config.silent_tenants:
            self.say(f"{self.config.silent_tenants} silent tenants' jobs created in {SILENT_NAMESPACE}")

    def _check_silent_tenants(self) -> None:
        """Serve silence at each silent tenant's pod's address (every other second), and check that
        none of their jobs was restarted or ended."""
        self.silent.pump()
        if not self.config.silent_tenants or time.monotonic() - self.silent_checked < 2.0:
            return
        assert self.api is not None
        self.silent_checked = time.monotonic()
        pods = self.api.items(f"/api/v1/namespaces/{SILENT_NAMESPACE}/pods")
        live = {
            p["metadata"]["uid"]: p["status"]["podIP"]
            for p in pods
            if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
        }
        for uid in [uid for uid in self.silenced if uid not in live]:
            self.silent.remove(self.silenced.pop(uid), METRICS_PORT)
        for uid, address in live.items():
            if uid not in self.silenced:
                try:
                    self.silent.add(address, METRICS_PORT)
                    self.silenced[uid] = address
                except OSError as error:
                    self.say(f"cannot serve silence at {address}:{METRICS_PORT}: {error}")
        for body in self.api.items(f"/apis/phalanx.dev/v1alpha1/namespaces/{SILENT_NAMESPACE}/trainingjobs"):
            status = body.get("status") or {}
            name = body["metadata"]["name"]
            changed = [f"{key} {status.get(key)}" for key in ("restarts", "attempt") if int(status.get(key, 0)) != 0]
            if status.get("phase") in ("Failed", "Succeeded"):
                changed.append(f"{status.get('phase')} ({status.get('reason')}: {status.get('message')})")
            if changed and ("silent", name, "") not in self.reported:
                self.reported.add(("silent", name, ""))
                self.violate(
                    f"silent tenant {name}, whose endpoints never answer, was judged: {'; '.join(changed)} "
                    f"{status.get('restartsByReason')}"
                )

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
            if index is not None and "-spare-" in metadata["name"]:
                self.report.spares_promoted.add(metadata["uid"])
        for (owner, index), count in slots.items():
            if count > 1:
                self.violate(f"{count} live pods for worker slot {index} of job uid {owner}")
        self._check_avoidance(jobs, pods)

    def _check_avoidance(self, jobs: dict[str, dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        """A pod created after its job began to avoid a node (status.avoidedNodes) is never placed
        there. The avoidance began ``avoidNodeSeconds`` before its ``until``; a pod of that very
        second is not judged (it may have been created just before the status write)."""
        began: dict[str, dict[str, datetime]] = {}
        for job in jobs.values():
            uid = job["metadata"]["uid"]
            seconds = int(((job.get("spec") or {}).get("failurePolicy") or {}).get("avoidNodeSeconds", 3600))
            for entry in (job.get("status") or {}).get("avoidedNodes") or []:
                self.report.avoidances.add((uid, entry["node"], entry["until"]))
                until = datetime.fromisoformat(entry["until"].replace("Z", "+00:00"))
                began.setdefault(uid, {})[entry["node"]] = until - timedelta(seconds=seconds)
        for pod in pods:
            metadata = pod["metadata"]
            owner = next((r["uid"] for r in metadata.get("ownerReferences") or [] if r.get("controller")), None)
            node = pod["spec"].get("nodeName")
            avoided = began.get(owner or "", {})
            created = metadata.get("creationTimestamp")
            if not avoided or not created:
                continue
            created_at = datetime.fromisoformat(created.replace("Z", "+00:00"))
            if node and any(created_at > since for since in avoided.values()):
                self.report.pods_placed_while_avoiding.add(metadata["uid"])
            if node in avoided and created_at > avoided[node]:
                self.violate(f"pod {metadata['name']} created after its job began to avoid node {node} runs there")

    # -- one job ---------------------------------------------------------------------------------

    def _create(self, story: Story) -> None:
        assert self.api is not None
        name = f"job-{len(self.jobs):03d}-{uuid.uuid4().hex[:4]}"
        body = manifest(
            workers={"min": story.minimum, "max": story.maximum, "desired": story.desired, "spares": story.spares},
            gpus={"count": 1},
            failurePolicy={"maxRestarts": story.max_restarts, "backoffSeconds": 1, "maxBackoffSeconds": 2},
            ttlSecondsAfterFinished=TTL_SECONDS,
            template={
                "spec": {
                    "containers": [SUPERVISED_TRAINER if story.in_place else TRAINER],
                    "nodeSelector": {POOL_LABEL: POOL},
                }
            },
        )
        if story.required:
            body["spec"]["placement"] = {"topology": {"key": RACK, "mode": "required"}}
            self.report.required_jobs += 1
        body["metadata"] = {"name": name, "namespace": NAMESPACE}
        created = self.api.call("POST", f"/apis/phalanx.dev/v1alpha1/namespaces/{NAMESPACE}/trainingjobs", body)
        job = Job(name, story, uid=created["metadata"]["uid"], created=time.monotonic())
        job.wait = Wait("running", time.monotonic(), desired=story.desired)
        self.jobs.append(job)
        self.report.jobs += 1
        self.say(
            f"{name}: created ({story.minimum}..{story.maximum}, {story.desired}), story {story.steps} -> {story.end}"
            + (", gang restarts in place" if story.in_place else "")
            + (f", {story.spares} spare(s)" if story.spares else "")
            + (", in one rack" if story.required else "")
        )

    def _workers(self, job: Job, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            p
            for p in pods
            if p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_WORKER
            and any(r.get("uid") == job.uid for r in p["metadata"].get("ownerReferences") or [])
        ]

    def _warnings_of(self, job: Job) -> list[str]:
        """The job's Warning Events, oldest first (what a violation of its count needs to be read)."""
        assert self.api is not None
        try:
            events = self.api.call(
                "GET",
                f"/api/v1/namespaces/{NAMESPACE}/events?fieldSelector=involvedObject.name%3D{job.name},type%3DWarning",
            )
        except (urllib.error.URLError, OSError) as error:
            return [f"(Events not read: {error})"]
        items = sorted(events.get("items") or [], key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        return [f"{e.get('reason')}: {(e.get('message') or '')[:160]}" for e in items]

    def _stable(self, body: dict[str, Any], workers: list[dict[str, Any]], desired: int) -> bool:
        status = body.get("status") or {}
        # "3/3", or "3/3 +1 spare" for a job with spares
        summary = str(status.get("workerSummary") or "").split(" ")[0]
        if status.get("phase") != "Running" or summary != f"{desired}/{desired}":
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
        job.settled = False
        status = (body or {}).get("status") or {}
        if body is not None:
            job.last_phase, job.last_reason = status.get("phase"), status.get("reason")
            if status.get("phase") == "Running" and not job.ran:
                job.ran = True
                if job.story.required:
                    self.report.required_running_seconds.append(time.monotonic() - job.created)
            if int(status.get("restarts", 0)) > job.expected_restarts:
                self.violate(
                    f"{job.name}: restarts {status.get('restarts')} > {job.expected_restarts} injected; "
                    f"restartsByReason {status.get('restartsByReason')}, attempt {status.get('attempt')}; "
                    f"counted by the job's Warning Events {self._warnings_of(job)}"
                )
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
                if self._outrunning_the_faults() or job.hold is not None:
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
        if wait.kept:  # the gang restarted in place: which of its healthy pods it kept
            self.report.gang_restarts_in_place += 1
            self.report.pods_kept_in_place += len(wait.kept & {p["metadata"]["uid"] for p in workers})
            wait.kept = frozenset()
        job.settled = True
        if self._outrunning_the_faults() or job.hold is not None:
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
        job.settled = False  # moving: no fault may take it for a job at rest this round
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
                job.wait = Wait(f"{step}: a gang restart", now, desired=desired, attempt_above=attempt,
                                kept=self._keepable(job, workers, victim))  # fmt: skip
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
            job.wait = Wait("gang: a new attempt running", now, desired=desired, attempt_above=attempt,
                            kept=self._keepable(job, workers, victim))  # fmt: skip
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

    @staticmethod
    def _keepable(job: Job, workers: list[dict[str, Any]], victim: dict[str, Any]) -> frozenset[str]:
        """The survivors a gang restart in place should keep (faults may still take some)."""
        if not job.story.in_place:
            return frozenset()
        return frozenset(p["metadata"]["uid"] for p in workers if p["metadata"]["uid"] != victim["metadata"]["uid"])

    def _patch(self, path: str, body: dict[str, Any]) -> None:
        assert self.api is not None
        self.api.call("PATCH", path, body, content_type="application/merge-patch+json")

    # -- the end ---------------------------------------------------------------------------------

    def _final_checks(self) -> None:
        assert self.api is not None
        deadline = time.monotonic() + ORPHAN_GRACE
        while time.monotonic() < deadline:
            self._check_force_deletes()
            self._sample_memory()
            jobs, pods = self._observe()
            if not jobs and not pods:
                return
            time.sleep(1)
        self._check_force_deletes()
        jobs, pods = self._observe()
        if self.report.gang_restarts_in_place and not self.report.pods_kept_in_place:
            self.violate(f"{self.report.gang_restarts_in_place} gang restarts in place kept no pod")
        if jobs:
            self.violate(f"jobs left at the end: {sorted(jobs)}")
        if pods:
            self.violate(f"pods left at the end: {sorted(p['metadata']['name'] for p in pods)}")


def summary_line(report: Report) -> str:
    figures = report.as_dict()
    return (
        f"{figures['jobs']} jobs ({figures['jobs_succeeded']} succeeded, {figures['jobs_failed_as_scripted']} "
        f"failed as scripted), {figures['pods_seen']} pods, {figures['counted_failures_injected']} counted failures, "
        f"{figures['operator_kills']} operator kills ({figures['operator_kills_of_the_leader']} of the leader, "
        f"{figures['operator_kills_of_the_standby']} of the standby, "
        f"{figures['operator_kills_right_after_a_status_write']} right after a status write), "
        f"{figures['leader_changes']} leader changes, {figures['leader_freezes']} freezes, "
        f"{figures['leader_latency_faults']} latency faults, {figures['apiserver_restarts']} API server restarts, "
        f"{figures['forced_relists']} forced relists ({figures['relists_seen_by_the_operator']} relists seen), "
        f"{figures['watch_cuts']} watch cuts, {figures['node_faults']} nodes NotReady past the grace, "
        f"{figures['node_flaps']} flaps, {figures['brownouts']} brownouts ({figures['brownout_nodes']} nodes), "
        f"{sum(figures['hostile_acts'].values())} hostile acts ({figures['hostile_pages_served']} pages served), "
        f"{figures['gang_restarts_in_place']} gang restarts in place ({figures['pods_kept_through_them']} pods kept), "
        f"{figures['spares_promoted']} spares promoted, "
        f"{figures['writes_audited']} writes audited, {figures['nodes_avoided_by_jobs']} nodes avoided by jobs "
        f"({figures['pods_created_while_their_job_avoided_nodes']} pods placed while they were), "
        f"peak RSS {figures['peak_rss_mib']} MiB, "
        f"{len(figures['violations'])} violations in {figures['seconds']}s"
    )
