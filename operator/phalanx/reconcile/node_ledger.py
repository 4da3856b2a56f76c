"""The grade of every node: a cluster-wide ledger of failures blamed on a node (or one of its GPUs
or NICs), with a score that decays, and which nodes every job's new pods keep off.

The ledger is kept in a ConfigMap the operator owns (``cluster.node_ledger`` reads and writes it);
this module is its pure part: what a pass's pods say against their nodes (``evidence_of``), the
merge that counts each piece of evidence once (by pod UID and source), the decay, the score, the
bounds, and the ConfigMap's data in both directions. Nothing here reads the clock: ``now`` is an
argument.

Each piece of evidence weighs 1 when it happens and half as much every ``half_life_seconds``; a
node whose score is at least ``threshold`` is avoided (node affinity NotIn on every job's new pods,
as failurePolicy.avoidNodeSeconds does for one job). The policy is written into the ConfigMap with
the evidence, so ``phalanx doctor`` and ``describe`` judge with the operator's numbers.

Slowness: a rank the progress poller finds persistently slower than the others
(``reconcile.stragglers``) is evidence of kind ``Slow`` against its pod's node, weighing
``SLOW_WEIGHT`` (half a failure: a slow node still trains, a failed one stopped the job), counted
once per pod and ``SLOW_WINDOW_SECONDS`` window, so that a pod slow for hours adds one piece an
hour, not one a poll (and at most ``max_evidence_per_node`` stay). The node is the one the
operator sees the pod on, never one the worker names: a rank can only speak against its own node.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from phalanx.reconcile import naming
from phalanx.reconcile.failures import classify
from phalanx.reconcile.observed import PodRecord
from phalanx.reconcile.pass_values import Context

DATA_KEY = "ledger.json"
"""The ConfigMap's one data key: the ledger as JSON."""
FORMAT = 1
MAX_MESSAGE = 160
"""Characters of the failure kept with each piece of evidence (the job's Event has it whole)."""
MAX_NAME = 253
MAX_DEVICE = 64
MAX_SEEN = 4096
"""Keys of evidence counted, kept after the evidence itself is dropped (bounds, decay) so that a
pod still there is not counted again; oldest first out."""
FORGOTTEN_BELOW = 1 / 128
"""Evidence whose weight has decayed below this (seven half-lives) is dropped."""
SOURCE_FAILURE = "failure"
SOURCE_SLOW = "slow"
KIND_SLOW = "Slow"
SLOW_WEIGHT = 0.5
"""What a straggler weighs against its node, fresh: half a failure (two windows of slowness, or a
failure and one window, make a failure's worth)."""
SLOW_WINDOW_SECONDS = 3600
"""A straggler counts once per pod per window of this many seconds (on the operator's clock)."""
# A GPU or NIC a termination message names (bounded: the message is scanned to MAX_SCANNED by the
# classifier's rules, and these match short tokens only).
DEVICE_PATTERNS = (
    re.compile(r"\bGPU[ #:]?(\d{1,3})\b"),
    re.compile(r"\b(?:PCI|pci|bus id|Bus Id)[ :=]*([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])"),
    re.compile(r"\b(mlx5_\d{1,3}|ib\d{1,3}|hfi1_\d{1,3}|efa_\d{1,3})\b"),
)
MAX_SCANNED = 8192


@dataclass(frozen=True)
class LedgerPolicy:
    """How evidence weighs and when a node is avoided (the operator's settings)."""

    half_life_seconds: float = 6 * 3600.0
    threshold: float = 1.5
    """Two failures within a few hours (fresh, they score 2; a lone one never reaches 1.5); 0.5: one
    failure avoids its node for one half-life. A score decays as soon as it is made, so a whole count
    of failures is reached only when they happen together: thresholds between counts say what is meant."""
    max_evidence_per_node: int = 8
    max_nodes: int = 128
    # 128 nodes x 8 failures of at most ~650 bytes, and the seen keys: under a ConfigMap's 1 MiB


@dataclass(frozen=True)
class Evidence:
    """One thing that went wrong on a node: a failure whose classification blames the node."""

    node: str
    kind: str
    """The node fault: NodeLost, NodePressure, NodeRejected, GPUError, NCCLError."""
    at: datetime
    job: str
    """namespace/name of the job that saw it."""
    pod_uid: str
    source: str = SOURCE_FAILURE
    device: str | None = None
    """The GPU (index or PCI address) or NIC the message names, when it names one."""
    message: str = ""
    base_weight: float = 1.0
    """What it weighs fresh: 1 for a failure, ``SLOW_WEIGHT`` for slowness."""
    window: int | None = None
    """Slowness: the ``SLOW_WINDOW_SECONDS`` window (since the epoch) it was seen in."""

    @property
    def key(self) -> str:
        """What counts it once: the pod and where the evidence came from (a pod that is taken for
        lost and later fails with a GPU error is one failure, not two), and the window of slowness."""
        return f"{self.pod_uid}/{self.source}" + (f"@{self.window}" if self.window is not None else "")

    def weight(self, now: datetime, policy: LedgerPolicy) -> float:
        age = max(0.0, (now - self.at).total_seconds())
        decay = float(0.5 ** (age / policy.half_life_seconds)) if policy.half_life_seconds > 0 else 1.0
        return self.base_weight * decay


@dataclass(frozen=True)
class NodeGrade:
    """A node's score now and the evidence behind it, newest first."""

    node: str
    score: float
    avoided: bool
    evidence: tuple[Evidence, ...]


@dataclass(frozen=True)
class Ledger:
    """Evidence by node (oldest first) and the keys of evidence counted."""

    nodes: Mapping[str, tuple[Evidence, ...]] = field(default_factory=dict)
    seen: tuple[str, ...] = ()
    policy: LedgerPolicy = field(default_factory=LedgerPolicy)

    def new_of(self, evidence: Iterable[Evidence]) -> tuple[Evidence, ...]:
        """The evidence not counted yet (each key once, the first given)."""
        seen = set(self.seen)
        fresh: list[Evidence] = []
        for one in evidence:
            if one.key not in seen:
                seen.add(one.key)
                fresh.append(one)
        return tuple(fresh)

    def merged(self, evidence: Iterable[Evidence], now: datetime) -> Ledger:
        """The ledger with ``evidence`` counted once, decayed evidence dropped and the bounds kept:
        a node keeps its newest ``max_evidence_per_node``; beyond ``max_nodes`` the nodes whose
        newest evidence is oldest go. Merging the same evidence again changes nothing."""
        fresh = self.new_of(evidence)
        policy = self.policy
        nodes: dict[str, list[Evidence]] = {node: list(items) for node, items in self.nodes.items()}
        for one in fresh:
            nodes.setdefault(one.node, []).append(one)
        kept: dict[str, tuple[Evidence, ...]] = {}
        for node, items in nodes.items():
            alive = sorted(
                (one for one in items if one.weight(now, policy) >= FORGOTTEN_BELOW), key=lambda one: (one.at, one.key)
            )
            if alive:
                kept[node] = tuple(alive[-policy.max_evidence_per_node :])
        if len(kept) > policy.max_nodes:
            newest = sorted(kept, key=lambda node: (kept[node][-1].at, node), reverse=True)
            kept = {node: kept[node] for node in newest[: policy.max_nodes]}
        seen = (*self.seen, *(one.key for one in fresh))[-MAX_SEEN:]
        return replace(self, nodes=dict(sorted(kept.items())), seen=seen)

    def union(self, other: Ledger, now: datetime) -> Ledger:
        """This ledger's evidence merged into ``other``, a newer copy a write met (409): evidence
        ``other`` counted already stays as ``other`` has it, and both sets of counted keys are kept."""
        merged = replace(other, policy=self.policy).merged((one for items in self.nodes.values() for one in items), now)
        return replace(merged, seen=tuple(dict.fromkeys((*merged.seen, *self.seen)))[-MAX_SEEN:])

    def score(self, node: str, now: datetime) -> float:
        return sum(one.weight(now, self.policy) for one in self.nodes.get(node, ()))

    def grades(self, now: datetime) -> list[NodeGrade]:
        """Every node with evidence, the highest score first."""
        threshold = self.policy.threshold
        grades = [
            NodeGrade(node, score, score >= threshold, tuple(reversed(items)))
            for node, items in self.nodes.items()
            if (score := self.score(node, now)) > 0
        ]
        return sorted(grades, key=lambda grade: (-grade.score, grade.node))

    def avoided(self, now: datetime) -> frozenset[str]:
        """The nodes past the threshold: every job's new pods keep off them."""
        return frozenset(grade.node for grade in self.grades(now) if grade.avoided)

    def to_data(self) -> dict[str, str]:
        """The ConfigMap's data."""
        document = {
            "format": FORMAT,
            "policy": {"halfLifeSeconds": self.policy.half_life_seconds, "threshold": self.policy.threshold},
            "nodes": {node: [_evidence_json(one) for one in items] for node, items in self.nodes.items()},
            "seen": list(self.seen),
        }
        return {DATA_KEY: json.dumps(document, separators=(",", ":"), sort_keys=True)}


def of_data(data: Mapping[str, Any] | None, policy: LedgerPolicy | None = None) -> Ledger:
    """The ledger a ConfigMap's data holds; anything malformed is left out, bounded as it is read
    (the ConfigMap is the operator's, but anyone with edit rights in its namespace may change it).
    ``policy``: the operator's own; None (a reader such as ``phalanx doctor``) takes the one
    written with the evidence."""
    text = (data or {}).get(DATA_KEY)
    try:
        document = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        document = {}
    if not isinstance(document, dict):
        document = {}
    if policy is None:
        policy = _policy_json(document.get("policy"))
    nodes: dict[str, tuple[Evidence, ...]] = {}
    listed = document.get("nodes")
    for node, items in listed.items() if isinstance(listed, dict) else ():
        if len(nodes) >= policy.max_nodes or not isinstance(node, str) or not 0 < len(node) <= MAX_NAME:
            continue
        parsed = [one for item in (items if isinstance(items, list) else ()) if (one := _evidence_of(node, item))]
        if parsed:
            nodes[node] = tuple(sorted(parsed, key=lambda one: (one.at, one.key))[-policy.max_evidence_per_node :])
    seen_listed = document.get("seen")
    seen = tuple(
        key for key in (seen_listed if isinstance(seen_listed, list) else ()) if isinstance(key, str) and len(key) <= 80
    )[-MAX_SEEN:]
    return Ledger(nodes=nodes, seen=seen, policy=policy)


def _evidence_json(one: Evidence) -> dict[str, Any]:
    item = {
        "at": one.at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "kind": one.kind,
        "job": one.job,
        "pod": one.pod_uid,
        "source": one.source,
        "message": one.message,
    }
    if one.device:
        item["device"] = one.device
    document: dict[str, Any] = dict(item)
    if one.base_weight != 1.0:
        document["weight"] = one.base_weight
    if one.window is not None:
        document["window"] = one.window
    return document


def _evidence_of(node: str, item: object) -> Evidence | None:
    if not isinstance(item, dict):
        return None
    values = {key: item.get(key) for key in ("at", "kind", "job", "pod", "source", "message", "device")}
    weight, window = item.get("weight", 1.0), item.get("window")
    if not all(isinstance(values[key], str) for key in ("at", "kind", "job", "pod")):
        return None
    try:
        at = datetime.strptime(str(values["at"]), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None
    device = values["device"]
    return Evidence(
        node=node,
        kind=str(values["kind"])[:64],
        at=at,
        job=str(values["job"])[: 2 * MAX_NAME + 1],
        pod_uid=str(values["pod"])[:64],
        source=str(values["source"])[:16] if isinstance(values["source"], str) else SOURCE_FAILURE,
        device=device[:MAX_DEVICE] if isinstance(device, str) and device else None,
        message=str(values["message"])[:MAX_MESSAGE] if isinstance(values["message"], str) else "",
        base_weight=float(weight) if _number(weight) and 0 < weight <= 1 else 1.0,
        window=window if isinstance(window, int) and not isinstance(window, bool) and 0 <= window < 2**40 else None,
    )


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _policy_json(value: object) -> LedgerPolicy:
    default = LedgerPolicy()
    if not isinstance(value, dict):
        return default
    half_life, threshold = value.get("halfLifeSeconds"), value.get("threshold")
    return LedgerPolicy(
        half_life_seconds=float(half_life)
        if isinstance(half_life, int | float) and math.isfinite(half_life) and half_life >= 0
        else default.half_life_seconds,
        threshold=float(threshold)
        if isinstance(threshold, int | float) and math.isfinite(threshold) and threshold > 0
        else default.threshold,
    )


def device_of(termination_message: str | None) -> str | None:
    """The GPU or NIC a termination message names (``GPU 3``, a PCI address, ``mlx5_1``), if any."""
    if not termination_message:
        return None
    text = termination_message[:MAX_SCANNED]
    for pattern in DEVICE_PATTERNS:
        found = pattern.search(text)
        if found is not None:
            token = found.group(1)
            return (f"GPU {token}" if token.isdigit() else token)[:MAX_DEVICE]
    return None


def evidence_of(context: Context) -> tuple[Evidence, ...]:
    """What this pass's pods say against their nodes: each pod whose failure the classification
    blames on its node (``failures.classify``'s node fault, with ``Context.node_lost``). Seen on
    every pass while the pod exists; the ledger counts it once."""
    metadata = context.job.metadata
    found: list[Evidence] = []
    for pod in context.observed.pods:
        if not pod.uid or not pod.node_name:
            continue
        failure = classify(pod, node_lost=context.node_lost(pod))
        if failure is None or failure.node_fault is None:
            continue
        hardware = failure.node_fault in ("GPUError", "NCCLError")
        found.append(
            Evidence(
                node=pod.node_name,
                kind=failure.node_fault,
                at=context.now,
                job=f"{metadata.namespace}/{metadata.name}",
                pod_uid=pod.uid,
                device=device_of(pod.termination_message) if hardware else None,
                message=failure.message[:MAX_MESSAGE],
            )
        )
    return (*found, *slow_evidence_of(context))


def slow_evidence_of(context: Context) -> tuple[Evidence, ...]:
    """The stragglers the poller found (``Observed.stragglers``) in the current attempt as evidence
    against the nodes of their pods: the current attempt's active worker whose name (or, for a pod that sets a hostname,
    the slot's name) is the host the rank reported; a host no such pod has is no evidence."""
    metadata = context.job.metadata
    attempt = context.job.status.attempt
    found: list[Evidence] = []
    for straggler in context.observed.stragglers:
        if straggler.attempt != attempt:
            continue  # measured in an attempt whose pods are gone: a pod of this one has the name
        pod = _pod_of_host(context, straggler.host, attempt)
        if pod is None or pod.node_name is None:
            continue
        found.append(
            Evidence(
                node=pod.node_name,
                kind=KIND_SLOW,
                at=context.now,
                job=f"{metadata.namespace}/{metadata.name}",
                pod_uid=pod.uid,
                source=SOURCE_SLOW,
                message=straggler.describe()[:MAX_MESSAGE],
                base_weight=SLOW_WEIGHT,
                window=int(context.now.timestamp() // SLOW_WINDOW_SECONDS),
            )
        )
    return tuple(found)


def _pod_of_host(context: Context, host: str, attempt: int) -> PodRecord | None:
    candidates = [
        pod for pod in context.observed.workers() if pod.attempt == attempt and pod.active and pod.uid and pod.node_name
    ]
    by_name = next((pod for pod in candidates if pod.name == host), None)
    if by_name is not None:
        return by_name
    name = context.job.metadata.name
    return next(
        (pod for pod in candidates if pod.index is not None and naming.worker_pod_name(name, pod.index) == host), None
    )


DEFAULT_NAME = "phalanx-node-ledger"
"""The chart's ConfigMap name (``nodeLedger.name``): where ``phalanx doctor`` and ``describe`` look."""


def evidence_text(one: Evidence, now: datetime) -> str:
    """One piece of evidence in a line: what, how long ago, which job, the device and the failure."""
    seconds = max(0, int((now - one.at).total_seconds()))
    ago = f"{seconds // 3600}h" if seconds >= 3600 else f"{seconds // 60}m" if seconds >= 60 else f"{seconds}s"
    device = f" on {one.device}" if one.device else ""
    message = f": {one.message}" if one.message else ""
    return f"{one.kind}{device} {ago} ago in {one.job}{message}"


def latest_text(grade: NodeGrade, now: datetime) -> str:
    """A node's newest evidence in a line, and its newest slowness too when that is older (the
    measured step times stay in view behind a later failure)."""
    text = evidence_text(grade.evidence[0], now)
    slow = next((one for one in grade.evidence if one.kind == KIND_SLOW), None)
    if slow is not None and slow is not grade.evidence[0]:
        text += f"; latest slowness: {evidence_text(slow, now)}"
    return text


def counts(grade: NodeGrade) -> tuple[int, int]:
    """(failures, windows of slowness) on record for a node."""
    slow = sum(1 for one in grade.evidence if one.kind == KIND_SLOW)
    return len(grade.evidence) - slow, slow


def ledgers_of(configmaps: Iterable[Mapping[str, Any]]) -> list[tuple[str, Ledger]]:
    """The ledgers in listed ConfigMaps (``namespace/name``, ledger), for readers: each judged with
    the policy written in it."""
    found = []
    for configmap in configmaps:
        metadata = configmap.get("metadata") or {}
        found.append((f"{metadata.get('namespace')}/{metadata.get('name')}", of_data(configmap.get("data"))))
    return found
