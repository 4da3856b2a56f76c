"""The operator process's settings: one typed value, read from the environment once at start-up.

The chart (and ``phalanx run``'s flags) set environment variables; ``Settings.from_environment``
parses and checks every one of them, naming the variable in its error, and the start-up handler
hands the value to the client, the runtime, the informers and the leader election: no other
module of the operator reads a setting of its own. docs/settings.md lists every variable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from phalanx.api.admission import DNS_1123_SUBDOMAIN, DNS_1123_SUBDOMAIN_MESSAGE
from phalanx.cluster.client import DEFAULT_MAX_IN_FLIGHT
from phalanx.cluster.informer import ABSENT_RECHECK_SECONDS
from phalanx.cluster.lease import LeaseTiming
from phalanx.reconcile import desired
from phalanx.reconcile.node_ledger import LedgerPolicy
from phalanx.reconcile.observed import NODE_LOST_GRACE_SECONDS, JobIsolation
from phalanx.reconcile.stragglers import StragglerPolicy

KUBE_CONTEXT = "PHALANX_KUBE_CONTEXT"
MAX_IN_FLIGHT = "PHALANX_MAX_IN_FLIGHT"
REQUEST_TIMEOUT = "PHALANX_REQUEST_TIMEOUT_SECONDS"
RECONCILE_WORKERS = "PHALANX_RECONCILE_WORKERS"
WATCH_NAMESPACES = "PHALANX_WATCH_NAMESPACES"
WATCH_NODES = "PHALANX_WATCH_NODES"
WATCH_SECONDS = "PHALANX_WATCH_SECONDS"
ABSENT_API_RECHECK = "PHALANX_ABSENT_API_RECHECK_SECONDS"
STATUS_PROGRESS = "PHALANX_STATUS_PROGRESS_SECONDS"
PROGRESS_INTERVAL = "PHALANX_PROGRESS_INTERVAL_SECONDS"
METRICS_PORT = "PHALANX_METRICS_PORT"
METRICS_TLS_CERT = "PHALANX_METRICS_TLS_CERT"
METRICS_TLS_KEY = "PHALANX_METRICS_TLS_KEY"
JOB_NETWORK_POLICY = "PHALANX_JOB_NETWORK_POLICY"
JOB_NETWORK_POLICY_SCRAPERS = "PHALANX_JOB_NETWORK_POLICY_SCRAPERS"
NODE_LOST_GRACE = "PHALANX_NODE_LOST_GRACE_SECONDS"
FORCE_DELETE_ON_NODE_LOST = "PHALANX_FORCE_DELETE_ON_NODE_LOST"
SPARE_PRIORITY_CLASS = "PHALANX_SPARE_PRIORITY_CLASS"
NODE_LEDGER_NAME = "PHALANX_NODE_LEDGER_NAME"
NODE_LEDGER_NAMESPACE = "PHALANX_NODE_LEDGER_NAMESPACE"
NODE_LEDGER_HALF_LIFE = "PHALANX_NODE_LEDGER_HALF_LIFE_SECONDS"
NODE_LEDGER_THRESHOLD = "PHALANX_NODE_LEDGER_THRESHOLD"
NODE_LEDGER_CORDON = "PHALANX_NODE_LEDGER_CORDON"
NODE_LEDGER_STRAGGLER_FACTOR = "PHALANX_NODE_LEDGER_STRAGGLER_FACTOR"
LEADER_ELECTION_ENV = "PHALANX_LEADER_ELECTION"  # "1": elect a leader
LEASE_NAME = "PHALANX_LEASE_NAME"
LEASE_NAMESPACE = "PHALANX_LEASE_NAMESPACE"
LEADER_IDENTITY = "PHALANX_LEADER_IDENTITY"
LEASE_DURATION_ENV = "PHALANX_LEASE_DURATION_SECONDS"
RENEW_DEADLINE_ENV = "PHALANX_LEASE_RENEW_DEADLINE_SECONDS"
RETRY_ENV = "PHALANX_LEASE_RETRY_SECONDS"

VARIABLES = (
    KUBE_CONTEXT,
    MAX_IN_FLIGHT,
    REQUEST_TIMEOUT,
    RECONCILE_WORKERS,
    WATCH_NAMESPACES,
    WATCH_NODES,
    WATCH_SECONDS,
    ABSENT_API_RECHECK,
    STATUS_PROGRESS,
    PROGRESS_INTERVAL,
    METRICS_PORT,
    METRICS_TLS_CERT,
    METRICS_TLS_KEY,
    JOB_NETWORK_POLICY,
    JOB_NETWORK_POLICY_SCRAPERS,
    NODE_LOST_GRACE,
    FORCE_DELETE_ON_NODE_LOST,
    SPARE_PRIORITY_CLASS,
    NODE_LEDGER_NAME,
    NODE_LEDGER_NAMESPACE,
    NODE_LEDGER_HALF_LIFE,
    NODE_LEDGER_THRESHOLD,
    NODE_LEDGER_CORDON,
    NODE_LEDGER_STRAGGLER_FACTOR,
    LEADER_ELECTION_ENV,
    LEASE_NAME,
    LEASE_NAMESPACE,
    LEADER_IDENTITY,
    LEASE_DURATION_ENV,
    RENEW_DEADLINE_ENV,
    RETRY_ENV,
)
"""Every variable the operator process reads."""

DEFAULT_LEASE_NAME = "phalanx-operator"

T = TypeVar("T")


@dataclass(frozen=True)
class LeaderElection:
    """The Lease to lead by (the chart's two replicas); None fields: derived at start-up (the pod's
    namespace, the host name with a random suffix)."""

    lease_name: str = DEFAULT_LEASE_NAME
    lease_namespace: str | None = None
    identity: str | None = None
    timing: LeaseTiming = field(default_factory=LeaseTiming)


@dataclass(frozen=True)
class NodeLedgerSettings:
    """The cluster-wide node ledger (``reconcile.node_ledger``): its ConfigMap, when a node is avoided,
    and whether the operator cordons it. ``namespace`` None: the operator pod's own."""

    name: str
    namespace: str | None = None
    policy: LedgerPolicy = field(default_factory=LedgerPolicy)
    cordon: bool = False
    stragglers: StragglerPolicy = field(default_factory=StragglerPolicy)
    """When a rank is a straggler (slowness evidence against its node)."""


@dataclass(frozen=True)
class Settings:
    """Every setting of the operator process, with its default."""

    kube_context: str | None = None  # None: the kubeconfig's current context, or the pod's account
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    request_timeout_seconds: float = 30.0
    reconcile_workers: int = 8
    watch_namespaces: tuple[str, ...] | None = None  # None: every namespace
    watch_nodes: bool = True
    watch_seconds: int = 300
    absent_api_recheck_seconds: float = ABSENT_RECHECK_SECONDS
    status_progress_seconds: float = 5.0
    progress_interval_seconds: int = 15  # 0: workers are not scraped
    metrics_port: int = 8000  # 0: no metrics endpoint
    metrics_tls_cert: str | None = None
    metrics_tls_key: str | None = None
    job_isolation: JobIsolation | None = None  # each job's NetworkPolicy, when the operator renders them
    node_lost_grace_seconds: float = NODE_LOST_GRACE_SECONDS
    force_delete_on_node_lost: bool = False
    spare_priority_class: str | None = None  # None: spares take the workers' class
    leader_election: LeaderElection | None = None  # None: this replica reconciles alone
    node_ledger: NodeLedgerSettings | None = None  # None: no cluster-wide node ledger

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings ``environ`` (default: this process's environment) gives, the defaults for
        those unset; ValueError names the variable that cannot be used."""
        environ = os.environ if environ is None else environ
        default = cls()
        return cls(
            kube_context=environ.get(KUBE_CONTEXT) or None,
            max_in_flight=_parsed(environ, MAX_IN_FLIGHT, int, default.max_in_flight),
            request_timeout_seconds=float(_parsed(environ, REQUEST_TIMEOUT, int, 30)),
            reconcile_workers=_parsed(environ, RECONCILE_WORKERS, int, default.reconcile_workers),
            watch_namespaces=tuple(name for name in environ.get(WATCH_NAMESPACES, "").split(",") if name) or None,
            watch_nodes=environ.get(WATCH_NODES, "1") != "0",
            watch_seconds=_parsed(environ, WATCH_SECONDS, int, default.watch_seconds),
            absent_api_recheck_seconds=_parsed(environ, ABSENT_API_RECHECK, float, default.absent_api_recheck_seconds),
            status_progress_seconds=float(_parsed(environ, STATUS_PROGRESS, int, 5)),
            progress_interval_seconds=_parsed(environ, PROGRESS_INTERVAL, int, default.progress_interval_seconds),
            metrics_port=_parsed(environ, METRICS_PORT, int, default.metrics_port),
            metrics_tls_cert=environ.get(METRICS_TLS_CERT),
            metrics_tls_key=environ.get(METRICS_TLS_KEY),
            job_isolation=_job_isolation(environ),
            node_lost_grace_seconds=_node_lost_grace(environ),
            force_delete_on_node_lost=environ.get(FORCE_DELETE_ON_NODE_LOST, "0") == "1",
            spare_priority_class=_spare_priority_class(environ),
            leader_election=_leader_election(environ),
            node_ledger=_node_ledger(environ),
        )


def _parsed(environ: Mapping[str, str], name: str, parse: Callable[[str], T], default: T) -> T:
    """A set variable must parse (even when empty); an unset one takes the default."""
    if name not in environ:
        return default
    text = environ[name]
    try:
        return parse(text)
    except ValueError:
        kind = "a whole number" if parse is int else "a number"
        raise ValueError(f"{name}={text!r} is not {kind}") from None


def _job_isolation(environ: Mapping[str, str]) -> JobIsolation | None:
    """Whether each job gets a NetworkPolicy of its own, and who besides its pods may scrape them
    (a JSON list of NetworkPolicyPeers)."""
    if environ.get(JOB_NETWORK_POLICY, "").strip().lower() not in ("1", "true", "yes"):
        return None
    try:
        peers = desired.network_policy_peers(json.loads(environ.get(JOB_NETWORK_POLICY_SCRAPERS) or "[]"))
    except ValueError as error:
        raise ValueError(f"{JOB_NETWORK_POLICY_SCRAPERS}: {error}") from error
    return JobIsolation(scrapers=peers)


def _node_lost_grace(environ: Mapping[str, str]) -> float:
    """How long a node may be not Ready before its pods are taken for lost (Kubernetes'
    taint-based eviction's default; empty: the default too)."""
    text = environ.get(NODE_LOST_GRACE, "") or str(NODE_LOST_GRACE_SECONDS)
    try:
        grace = float(text)
    except ValueError:
        grace = -1.0
    if not grace >= 0:  # also refuses NaN
        raise ValueError(f"{NODE_LOST_GRACE} must be a number of seconds >= 0, not {text!r}")
    return grace


def _spare_priority_class(environ: Mapping[str, str]) -> str | None:
    """The PriorityClass warm spares get so that they rank below workers (``desired.spare_pod``).
    A name the API server would refuse keeps the operator from starting (every spare would be
    refused)."""
    name = environ.get(SPARE_PRIORITY_CLASS, "").strip()
    if name and (len(name) > 253 or not DNS_1123_SUBDOMAIN.match(name)):
        why = DNS_1123_SUBDOMAIN_MESSAGE
        raise ValueError(f"{SPARE_PRIORITY_CLASS} {name[:253]!r} is no PriorityClass name: {why}")
    return name or None


def _leader_election(environ: Mapping[str, str]) -> LeaderElection | None:
    """The Lease when PHALANX_LEADER_ELECTION is 1; its durations are checked only then."""
    if environ.get(LEADER_ELECTION_ENV, "0") != "1":
        return None
    default = LeaseTiming()
    durations: list[float] = []
    for name, fallback in (
        (LEASE_DURATION_ENV, default.lease_duration),
        (RENEW_DEADLINE_ENV, default.renew_deadline),
        (RETRY_ENV, default.retry),
    ):
        text = environ.get(name) or str(fallback)
        try:
            durations.append(float(text))
        except ValueError:
            raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    return LeaderElection(
        lease_name=environ.get(LEASE_NAME, DEFAULT_LEASE_NAME),
        lease_namespace=environ.get(LEASE_NAMESPACE) or None,
        identity=environ.get(LEADER_IDENTITY) or None,
        timing=LeaseTiming(*durations),
    )


def _node_ledger(environ: Mapping[str, str]) -> NodeLedgerSettings | None:
    """The node ledger when PHALANX_NODE_LEDGER_NAME names its ConfigMap; its numbers are checked only then."""
    name = environ.get(NODE_LEDGER_NAME, "").strip()
    if not name:
        return None
    if len(name) > 253 or not DNS_1123_SUBDOMAIN.match(name):
        raise ValueError(f"{NODE_LEDGER_NAME} {name[:253]!r} is no ConfigMap name: {DNS_1123_SUBDOMAIN_MESSAGE}")
    default = LedgerPolicy()
    half_life = _parsed(environ, NODE_LEDGER_HALF_LIFE, float, default.half_life_seconds)
    if not half_life > 0:  # also refuses NaN
        raise ValueError(f"{NODE_LEDGER_HALF_LIFE} must be a number of seconds > 0, not {half_life!r}")
    threshold = _parsed(environ, NODE_LEDGER_THRESHOLD, float, default.threshold)
    if not 0 < threshold < float("inf"):
        raise ValueError(
            f"{NODE_LEDGER_THRESHOLD} must be a number > 0 (a score: 1 per failure, halving), not {threshold!r}"
        )
    factor = _parsed(environ, NODE_LEDGER_STRAGGLER_FACTOR, float, StragglerPolicy().factor)
    if not 1 < factor < float("inf"):
        raise ValueError(
            f"{NODE_LEDGER_STRAGGLER_FACTOR} must be a number > 1 (a straggler's step time over the "
            f"median of the other ranks'), not {factor!r}"
        )
    cordon = environ.get(NODE_LEDGER_CORDON, "").strip().lower()
    if cordon not in ("", "0", "1", "true", "false"):
        raise ValueError(f"{NODE_LEDGER_CORDON} must be true or false, not {cordon!r}")
    return NodeLedgerSettings(
        name=name,
        namespace=environ.get(NODE_LEDGER_NAMESPACE, "").strip() or None,
        policy=LedgerPolicy(half_life_seconds=half_life, threshold=threshold),
        cordon=cordon in ("1", "true"),
        stragglers=StragglerPolicy(factor=factor),
    )
