"""What ``phalanx describe`` prints, as pure functions of API bodies and the current time.

The layout follows ``kubectl describe``: aligned ``Field:  value`` lines, then tables whose
headers are underlined, ages as kubectl writes them (``45s``, ``3m12s``, ``5h``), ``<none>`` for
what is empty, and Events sorted oldest first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pydantic

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming, node_ledger
from phalanx.reconcile.goodput import STATES, effective_training_ratio, seconds_by_state
from phalanx.reconcile.observed import pod_record
from phalanx.reconcile.status import EARLIEST, human_duration, parse_time

NONE = "<none>"
MAX_EVENTS = 40  # the newest are shown; older ones are counted
FIELD_WIDTH = 20  # "Restarts By Reason:" and the values after it line up


def age(timestamp: str | None, now: datetime) -> str:
    """How long ago an RFC 3339 time was; ``<unknown>`` without one."""
    moment = parse_time(timestamp)
    return human_duration((now - moment).total_seconds()) if moment else "<unknown>"


def one_line(text: str | None) -> str:
    """A multi-line message (a traceback in a termination message) as one table cell."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return " | ".join(lines)


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns under underlined headers; the last column is never padded."""
    body = [[str(cell) for cell in row] for row in rows]
    underline = ["-" * len(header) for header in headers]
    everything = [list(headers), underline, *body]
    widths = [max(len(row[column]) for row in everything) for column in range(len(headers) - 1)]
    lines = []
    for row in everything:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)] + [row[-1]]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def field(name: str, value: object) -> str:
    label = f"{name}:"
    return f"{label.ljust(FIELD_WIDTH)}{value}".rstrip()


def _time_and_age(timestamp: str | None, now: datetime) -> str:
    return f"{timestamp} ({age(timestamp, now)} ago)" if timestamp else NONE


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether the job with ``uid`` controls ``obj`` (not a deleted predecessor of the same name)."""
    references = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(reference.get("controller") and reference.get("uid") == uid for reference in references)


def restart_budget(restarts: int, max_restarts: int) -> str:
    """Counted restarts against failurePolicy.maxRestarts: a job fails once it exceeds them."""
    left = max_restarts - restarts
    verdict = f"{left} left" if left >= 0 else "exhausted"
    return f"{restarts} of {max_restarts} allowed ({verdict})"


def preemption_cost(status: Mapping[str, Any], now: datetime) -> list[str]:
    """What an eviction would lose, as of when it was written (outside Kueue a job that reports no
    progress is not written for its cost alone); only while the job trains and the field is there."""
    cost = status.get("preemptionCost")
    if not isinstance(cost, Mapping):
        return []
    weight = (
        f"{cost.get('gpuSeconds')} GPU-seconds" if cost.get("gpus") else f"{cost.get('workerSeconds')} worker-seconds"
    )
    parts = f"{cost.get('lostSeconds')}s since the checkpoint + {cost.get('restartSeconds')}s to restart"
    boost = f", Kueue boost {cost['boost']}" if cost.get("boost") is not None else ""
    written = f", as of {age(cost['time'], now)} ago" if cost.get("time") else ""
    return [field("Preemption Cost", f"{weight} ({parts}){boost}{written}")]


def save_now(status: Mapping[str, Any]) -> list[str]:
    """The newest save-now request and its answer, and what saves on a notice kept (when there are)."""
    lines: list[str] = []
    request = status.get("saveNow")
    if isinstance(request, Mapping):
        parts = []
        if request.get("token") is not None:
            answered = request.get("savedToken") == request.get("token")
            state = f"saved at step {request.get('step')}" if answered else "waiting for a checkpoint"
            parts.append(f"{request['token']} asked at {request.get('requestedAt')}, {state}")
        if request.get("message"):
            parts.append(str(request["message"]))
        if parts:
            lines.append(field("Save Now", "; ".join(parts)))
    savings = status.get("noticeSavings")
    if isinstance(savings, Mapping) and savings.get("stops"):
        kept = f"{savings.get('gpuSeconds', 0)} GPU-seconds, {savings.get('workerSeconds', 0)} worker-seconds"
        lines.append(field("Saved On Notice", f"{savings['stops']} stops, {kept} kept"))
    return lines


def worker_counts(spec: Mapping[str, Any], status: Mapping[str, Any]) -> str:
    bounds = spec.get("workers") or {}
    counts = status.get("workers") or {}
    desired = counts.get("desired", bounds.get("desired", "?"))
    text = f"desired {desired} (min {bounds.get('min', '?')}, max {bounds.get('max', '?')})"
    text += f", active {counts.get('active', 0)}, ready {counts.get('ready', 0)}"
    if counts.get("worldSize") is not None:
        text += f", world size {counts['worldSize']}"
    if bounds.get("spares"):
        text += f"; spares {counts.get('spares', 0)} ready of {bounds['spares']}"
    return text


def pod_state(pod: Mapping[str, Any]) -> str:
    """The trainer container's state as a word and why: ``Running``, ``Pending (ContainerCreating)``,
    ``Terminated (Error, exit 1)``; a pod being deleted says so."""
    record = pod_record(pod)
    if record.exit_code is not None or record.terminated_reason:
        code = None if record.exit_code is None else f"exit {record.exit_code}"
        state = f"Terminated ({', '.join(part for part in (record.terminated_reason, code) if part)})"
    elif record.reason:  # the kubelet's verdict on the pod as a whole (Evicted, NodeLost)
        state = f"{record.phase} ({record.reason})"
    elif record.waiting_reason:
        state = f"{record.phase} ({record.waiting_reason})"
    elif record.unschedulable_message is not None:
        state = f"{record.phase} (Unschedulable)"
    else:
        state = record.phase
    return f"{state}, terminating" if record.deleting else state


def container_restarts(pod: Mapping[str, Any]) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(status.get("restartCount") or 0) for status in statuses)


@dataclass(frozen=True)
class PodRow:
    """One pod of the job in the table, with where it sorts."""

    order: tuple[int, int, int, str]
    cells: tuple[str, ...]


def pod_row(pod: Mapping[str, Any], current_attempt: int, now: datetime) -> PodRow:
    record = pod_record(pod)
    metadata = pod.get("metadata") or {}
    ready = "True" if record.ready else "False"
    if record.role == naming.ROLE_RENDEZVOUS:
        worker, attempt, group = "store", "-", 1
    elif record.role == naming.ROLE_SPARE:
        worker, attempt, group = "spare", "-", 1
    else:
        worker = str(record.index) if record.index is not None else "?"
        attempt = str(record.attempt) if record.attempt is not None else "?"
        group = 0 if record.attempt == current_attempt else 2
    order = (group, -(record.attempt or 0), record.index if record.index is not None else -1, record.name)
    cells = (
        record.name,
        worker,
        attempt,
        record.node_name or NONE,
        pod_state(pod),
        ready,
        str(container_restarts(pod)),
        age(metadata.get("creationTimestamp"), now),
        record.pod_ip or NONE,
    )
    return PodRow(order, cells)


def event_time(event: Mapping[str, Any]) -> str:
    """When an Event last happened: Events written through events.k8s.io carry eventTime and a
    series, older writers firstTimestamp/lastTimestamp."""
    series = event.get("series") or {}
    return str(
        series.get("lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def event_age(event: Mapping[str, Any], now: datetime) -> str:
    """As kubectl: ``3m``, or ``10s (x4 over 2m)`` for an Event seen repeatedly."""
    series = event.get("series")
    if series:
        return f"{age(event_time(event), now)} (x{series.get('count', 1)} over {age(event.get('eventTime'), now)})"
    if int(event.get("count") or 1) > 1:
        first = event.get("firstTimestamp") or event.get("eventTime")
        return f"{age(event_time(event), now)} (x{event['count']} over {age(first, now)})"
    return age(event.get("firstTimestamp") or event_time(event), now)


def event_source(event: Mapping[str, Any]) -> str:
    return str((event.get("source") or {}).get("component") or event.get("reportingComponent") or "")


def job_pod_name_pattern(job_name: str) -> re.Pattern[str]:
    """The names of the pods a job makes: its workers and its rendezvous store."""
    worker = re.escape(naming.worker_pod_name(job_name, 0)).removesuffix("0")
    return re.compile(f"^(?:{worker}[0-9]+|{re.escape(naming.rendezvous_name(job_name))})$")


def job_events(
    job: Mapping[str, Any], job_events: Iterable[Mapping[str, Any]], pod_events: Iterable[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The Events of the job itself and of the pods it made (by name, so deleted workers' Events
    count too), since the job was created (not a predecessor's of the same name), oldest first
    (as kubectl orders them, and stored order within a second)."""
    metadata = job.get("metadata") or {}
    uid, created = metadata.get("uid"), parse_time(metadata.get("creationTimestamp"))
    names = job_pod_name_pattern(str(metadata.get("name", "")))
    chosen = [event for event in job_events if (event.get("involvedObject") or {}).get("uid") in (uid, None, "")]
    for event in pod_events:
        if not names.match(str((event.get("involvedObject") or {}).get("name", ""))):
            continue
        happened = parse_time(event_time(event) or None)
        if created is None or happened is None or happened >= created:
            chosen.append(event)
    return sorted(chosen, key=_event_order)


def _event_order(event: Mapping[str, Any]) -> tuple[datetime, int]:
    """By time; Events of the same second (core/v1 times have no fraction) in the order the API
    server stored them: resourceVersions are etcd revisions here, though clients may not rely on
    that for anything but this tie."""
    version = str((event.get("metadata") or {}).get("resourceVersion", ""))
    return parse_time(event_time(event) or None) or EARLIEST, int(version) if version.isdigit() else 0


def _conditions(status: Mapping[str, Any], now: datetime) -> list[str]:
    conditions = status.get("conditions") or []
    if not conditions:
        return [field("Conditions", NONE)]
    rows = [
        (
            str(c.get("type", "")),
            str(c.get("status", "")),
            str(c.get("reason", "")),
            age(c.get("lastTransitionTime"), now),
            one_line(c.get("message")),
        )
        for c in conditions
    ]
    return ["Conditions:", *table(("Type", "Status", "Reason", "Age", "Message"), rows)]


def _pods(pods: Iterable[Mapping[str, Any]], current_attempt: int, now: datetime) -> list[str]:
    rows = sorted((pod_row(pod, current_attempt, now) for pod in pods), key=lambda row: row.order)
    if not rows:
        return [field("Pods", NONE)]
    headers = ("Name", "Worker", "Attempt", "Node", "State", "Ready", "Restarts", "Age", "IP")
    return [f"Pods (current attempt {current_attempt} first):", *table(headers, (row.cells for row in rows))]


def rank_map(
    spec: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    current_attempt: int,
    node_labels: Mapping[str, Mapping[str, str]] | None = None,
) -> list[str]:
    """The current attempt's running workers in rank order, with their nodes and domains. The static
    launcher's rank is the slot index; torchrun's c10d rendezvous numbers its agents in the sort
    order of their addresses (PET_LOCAL_ADDR: the pod's rank address when its job's ranks follow
    placement, else the pod IP), which this reproduces."""
    records = [pod_record(pod) for pod in pods]
    running = [
        record
        for record in records
        if record.role == naming.ROLE_WORKER and record.attempt == current_attempt and record.active
        and record.node_name and record.pod_ip
    ]  # fmt: skip
    if not running:
        return []
    static = spec.get("launcher") == "static"
    if static:
        ordered = sorted(running, key=lambda record: record.index if record.index is not None else -1)
    else:
        ordered = sorted(running, key=lambda record: record.rank_address or record.pod_ip or "")
    key = ((spec.get("placement") or {}).get("topology") or {}).get("key")
    headers = ["Rank", "Pod", "Node", *([key] if key else [])]
    rows = []
    for rank, record in enumerate(ordered):
        row = [str(record.index if static else rank), record.name, record.node_name or NONE]
        if key:
            row.append((node_labels or {}).get(record.node_name or "", {}).get(key) or NONE)
        rows.append(row)
    how = (
        "the slot indices"
        if static
        else "torchrun's node ranks: the agents' addresses in sort order (rank addresses, else pod IPs), as "
        "the rendezvous assigns"
    )
    return [f"Ranks ({how}):", *table(headers, rows)]


def _events(events: Sequence[Mapping[str, Any]], now: datetime) -> list[str]:
    if not events:
        return [field("Events", NONE)]
    shown = events[-MAX_EVENTS:]
    rows = [
        (
            str(event.get("type", "")),
            str(event.get("reason", "")),
            event_age(event, now),
            event_source(event),
            f"{str((event.get('involvedObject') or {}).get('kind', '')).lower()}/"
            f"{(event.get('involvedObject') or {}).get('name', '')}",
            one_line(event.get("message")),
        )
        for event in shown
    ]
    heading = "Events:" if len(shown) == len(events) else f"Events ({len(events) - len(shown)} older not shown):"
    return [heading, *table(("Type", "Reason", "Age", "From", "Object", "Message"), rows)]


def time_by_state(status: Mapping[str, Any], now: datetime) -> list[str]:
    """Where the job's time went, the current state's time included, and its effective training."""
    try:
        counts = api.TimeByState.model_validate(status.get("timeByState") or {})
    except pydantic.ValidationError:
        return []
    if counts.since is None and not any(getattr(counts, state) for state in STATES):
        return []
    seconds = seconds_by_state(counts, now)
    parts = []
    for state in STATES:
        spent = sum(value for (name, _), value in seconds.items() if name == state)
        part = f"{state} {human_duration(spent)}"
        causes = [(cause, value) for (name, cause), value in sorted(seconds.items()) if name == state and cause]
        if causes:
            part += " (" + ", ".join(f"{cause} {human_duration(value)}" for cause, value in causes) + ")"
        parts.append(part)
    ratio = effective_training_ratio(counts, now)
    lines = [field("Time By State", ", ".join(parts)), field("Effective Training", f"{ratio:.0%} of its time")]
    recomputed = status.get("recomputedSteps") or {}
    if recomputed:
        waiting = recomputed.get("reached")
        note = f" (and the restart at step {waiting} waits for its new run)" if waiting is not None else ""
        lines.append(field("Steps Recomputed", f"{recomputed.get('total', 0)}{note}"))
    return lines


def progress(status: Mapping[str, Any], now: datetime) -> list[str]:
    """Rank 0's reported progress (``status.progress``): step of total, percent, time left, and
    each metric with the step it was taken at and its age."""
    try:
        shown = api.TrainingProgress.model_validate(status["progress"]) if status.get("progress") else None
    except pydantic.ValidationError:
        shown = None
    if shown is None:
        return [field("Progress", NONE)]
    text = f"step {shown.step}" + (f" of {shown.total_steps}" if shown.total_steps else "")
    if shown.percent is not None:
        text += f" ({shown.percent}%)"
    if shown.eta_seconds is not None:
        text += f", {human_duration(shown.eta_seconds)} left"
    elif status.get("phase") in ("Running", "Rescaling") and shown.total_steps:
        text += ", time left unknown"
    lines = [
        field("Progress", text),
        field("  Reported", f"{_time_and_age(shown.time, now)} by attempt {shown.attempt}"),
    ]
    if shown.metrics:
        rows = [[m.name, f"{m.value:.6g}", str(m.step), age(m.time, now)] for m in shown.metrics]
        lines += ["  Metrics:", *table(("NAME", "VALUE", "STEP", "AGE"), rows, indent="    ")]
    return lines


def node_ledger_lines(
    ledgers: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]], now: datetime
) -> list[str]:
    """The nodes the cluster-wide node ledger has every job keep off, and the scores of the nodes
    this job's pods run on, with the latest evidence of each (none: no lines)."""
    used = {str((pod.get("spec") or {}).get("nodeName")) for pod in pods if (pod.get("spec") or {}).get("nodeName")}
    rows = [
        [
            grade.node,
            f"{grade.score:.2f}/{ledger.policy.threshold:g}",
            "yes" if grade.avoided else "no",
            *map(str, node_ledger.counts(grade)),
            one_line(node_ledger.latest_text(grade, now)),
        ]
        for _, ledger in node_ledger.ledgers_of(ledgers)
        for grade in ledger.grades(now)
        if grade.avoided or grade.node in used
    ]
    if not rows:
        return []
    return ["Node Ledger:", *table(["NODE", "SCORE", "AVOIDED", "FAILURES", "SLOW", "LATEST"], rows)]


def replica_groups(spec: Mapping[str, Any], status: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """spec.replicaGroups' groups: each one's generation, its ready workers of that generation out
    of the group's size, its restarts alone, and its domain when the operator knows it."""
    groups = spec.get("replicaGroups")
    if not isinstance(groups, Mapping):
        return []
    size = int(groups.get("size") or 1)
    attempt = int(status.get("attempt") or 0)
    entries = [entry for entry in status.get("replicaGroups") or [] if isinstance(entry, Mapping)]
    ready: dict[int, int] = {}
    for record in (pod_record(pod) for pod in pods):
        if record.role != naming.ROLE_WORKER or record.index is None or not (record.active and record.ready):
            continue
        group = record.index // size
        entry = next((one for one in entries if one.get("index") == group), {})
        if record.attempt == attempt and (record.group_generation or 0) == int(entry.get("generation") or 0):
            ready[group] = ready.get(group, 0) + 1
    rows = [
        [
            str(entry.get("index")),
            str(entry.get("generation", 0)),
            f"{ready.get(int(entry.get('index') or 0), 0)}/{size}",
            str(entry.get("restarts", 0)),
            str(entry.get("domain") or NONE),
        ]
        for entry in entries
    ]
    heading = f"Replica Groups (size {size}, min {groups.get('min', 1)}"
    heading += f", topology {groups['topology']}):" if groups.get("topology") else "):"
    if not rows:
        return [heading, f"  {NONE}"]
    return [heading, *table(["GROUP", "GENERATION", "READY", "RESTARTS", "DOMAIN"], rows)]


def describe(
    job: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    now: datetime,
    node_labels: Mapping[str, Mapping[str, str]] | None = None,
    ledgers: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The whole ``phalanx describe`` text for a TrainingJob, its pods and the Events of both
    (``job_events`` chooses and orders them); ``node_labels``: the labels of the pods' nodes, for
    the topology domain of each rank; ``ledgers``: the node ledger's ConfigMaps (``node_ledger_lines``)."""
    pods = list(pods)
    metadata = job.get("metadata") or {}
    spec = job.get("spec") or {}
    status = job.get("status") or {}
    attempt = int(status.get("attempt") or 0)
    max_restarts = int((spec.get("failurePolicy") or {}).get("maxRestarts", 3))
    lines = [
        field("Name", metadata.get("name", "")),
        field("Namespace", metadata.get("namespace", "")),
        field("Created", _time_and_age(metadata.get("creationTimestamp"), now)),
        field("Phase", status.get("phase") or NONE),
        field("Reason", status.get("reason") or NONE),
    ]
    message = (status.get("message") or "").strip().splitlines() or [NONE]
    lines.append(field("Message", message[0]))
    lines += [" " * FIELD_WIDTH + line.rstrip() for line in message[1:]]
    lines += [
        field("Attempt", attempt),
        field("Restarts", restart_budget(int(status.get("restarts") or 0), max_restarts)),
    ]
    by_reason = status.get("restartsByReason") or {}
    if by_reason:
        lines.append("Restarts By Reason:")
        lines += [field(f"  {reason}", count) for reason, count in sorted(by_reason.items())]
    else:
        lines.append(field("Restarts By Reason", NONE))
    mode = status.get("restartMode")
    if mode:
        how = "healthy pods kept, processes restarted" if mode == "InPlace" else "every worker pod replaced"
        lines.append(field("Gang Restarts", f"{mode} ({how})"))
    lines.append(field("Workers", worker_counts(spec, status)))
    checkpoint = status.get("lastCheckpoint")
    if checkpoint:
        stamp = checkpoint.get("time")
        lines.append(field("Last Checkpoint", f"step {checkpoint.get('step')} at {_time_and_age(stamp, now)}"))
    else:
        lines.append(field("Last Checkpoint", NONE))
    lines += preemption_cost(status, now)
    lines += save_now(status)
    lines += progress(status, now)
    lines.append(field("Started", _time_and_age(status.get("startTime"), now)))
    if status.get("completionTime"):
        lines.append(field("Completed", _time_and_age(status.get("completionTime"), now)))
    lines += time_by_state(status, now)
    not_before = parse_time(status.get("restartNotBefore"))
    if not_before is not None and not_before > now and status.get("phase") == "Restarting":
        wait = human_duration((not_before - now).total_seconds())
        lines.append(field("Next Attempt", f"not before {status['restartNotBefore']} (in {wait})"))
    avoided = status.get("avoidedNodes") or []
    if avoided:
        lines.append("Avoided Nodes:")
        lines += table(
            ["NODE", "REASON", "UNTIL", "FAILURE"],
            [
                [entry.get("node", ""), entry.get("reason", ""), entry.get("until", ""), one_line(entry.get("message"))]
                for entry in avoided
            ],
        )
    lines += node_ledger_lines(ledgers, pods, now)
    placement = status.get("placement") or {}
    topology = (spec.get("placement") or {}).get("topology") or {}
    if topology:
        where = placement.get("domain") or "chosen by the gang scheduler"
        lines.append(field("Placement", f"{topology.get('key')} {topology.get('mode', 'required')}: {where}"))
    lines += replica_groups(spec, status, pods)
    lines += _conditions(status, now)
    lines += _pods(pods, attempt, now)
    lines += rank_map(spec, pods, attempt, node_labels)
    lines += _events(events, now)
    return "\n".join(lines) + "\n"
