"""``phalanx describe`` text from API bodies shaped as the API server returns them: a job that lost
a worker (counted) and then restarted its gang, with pods of two attempts, its store, and Events
of the job and its pods (core/v1 and events.k8s.io writers)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from phalanx.cli import describe_text
from phalanx.reconcile.status import human_duration

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
UID = "0b6f3f9e-5a0c-4c1e-9d55-4a2b7c1d0e11"
OWNER = {
    "apiVersion": "phalanx.dev/v1alpha1",
    "kind": "TrainingJob",
    "name": "llama",
    "uid": UID,
    "controller": True,
    "blockOwnerDeletion": True,
}

JOB: dict[str, Any] = {
    "apiVersion": "phalanx.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {
        "name": "llama",
        "namespace": "research",
        "uid": UID,
        "generation": 1,
        "creationTimestamp": "2026-03-01T11:00:00Z",
    },
    "spec": {
        "workers": {"min": 2, "max": 4, "desired": 3},
        "failurePolicy": {"maxRestarts": 3, "backoffSeconds": 10},
        "template": {"spec": {"containers": [{"name": "trainer", "image": "example/train:1"}]}},
    },
    "status": {
        "observedGeneration": 1,
        "phase": "Running",
        "reason": "WorkersReady",
        "message": "3/3 workers ready",
        "attempt": 1,
        "restarts": 2,
        "restartsByReason": {"WorkerFailed": 1, "OOMKilled": 1, "NodeLost": 1},
        "restartMode": "InPlace",
        "workers": {"desired": 3, "active": 3, "ready": 2, "worldSize": 12},
        "lastCheckpoint": {"step": 1200, "time": "2026-03-01T11:57:30Z"},
        "startTime": "2026-03-01T11:00:05Z",
        "workerSummary": "2/3",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "WorkersReady",
                "message": "3/3 workers ready",
                "observedGeneration": 1,
                "lastTransitionTime": "2026-03-01T11:50:00Z",
            },
            {
                "type": "Reconciling",
                "status": "False",
                "reason": "WorkersReady",
                "message": "",
                "observedGeneration": 1,
                "lastTransitionTime": "2026-03-01T11:50:00Z",
            },
        ],
    },
}


def pod(
    name: str,
    *,
    role: str = "worker",
    index: int | None = None,
    attempt: int | None = None,
    state: dict[str, Any] | None = None,
    phase: str = "Running",
    ready: bool = True,
    node: str | None = "gpu-node-1",
    ip: str | None = "10.244.1.7",
    created: str = "2026-03-01T11:49:00Z",
    restarts: int = 0,
    deleting: bool = False,
    owner: dict[str, Any] = OWNER,
) -> dict[str, Any]:
    labels = {"phalanx.dev/job-name": "llama", "phalanx.dev/role": role, "app.kubernetes.io/managed-by": "phalanx"}
    if index is not None:
        labels["phalanx.dev/worker-index"] = str(index)
    if attempt is not None:
        labels["phalanx.dev/attempt"] = str(attempt)
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": "research",
        "uid": f"uid-{name}-{attempt}",
        "labels": labels,
        "annotations": {"phalanx.dev/trainer-container": "trainer"},
        "ownerReferences": [owner],
        "creationTimestamp": created,
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-03-01T11:59:50Z"
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "trainer", "image": "example/train:1"}]},
        "status": {
            "phase": phase,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": created},
                {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": created},
            ],
            "containerStatuses": [
                {
                    "name": "trainer",
                    "ready": ready,
                    "restartCount": restarts,
                    "image": "example/train:1",
                    "state": state or {"running": {"startedAt": created}},
                }
            ],
        },
    }
    if node:
        body["spec"]["nodeName"] = node
    if ip:
        body["status"]["podIP"] = ip
    return body


PODS = [
    pod("llama-worker-1", index=1, attempt=1, node="gpu-node-2", ip="10.244.2.9"),
    pod("llama-worker-0", index=0, attempt=1),
    pod(
        "llama-worker-2",
        index=2,
        attempt=1,
        phase="Pending",
        ready=False,
        ip=None,
        state={"waiting": {"reason": "ContainerCreating"}},
        created="2026-03-01T11:59:30Z",
    ),
    pod("llama-rdzv", role="rendezvous", node="gpu-node-1", ip="10.244.1.2", created="2026-03-01T11:00:01Z"),
    pod(
        "llama-worker-0",
        index=0,
        attempt=0,
        phase="Failed",
        ready=False,
        deleting=True,
        created="2026-03-01T11:00:02Z",
        state={"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": "2026-03-01T11:00:10Z"}},
    ),
]


def event(
    name: str,
    kind: str,
    reason: str,
    message: str,
    *,
    last: str,
    first: str | None = None,
    count: int = 1,
    type_: str = "Normal",
    component: str = "kubelet",
    uid: str = "",
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.{reason.lower()}", "namespace": "research", "creationTimestamp": last},
        "involvedObject": {"kind": kind, "name": name, "namespace": "research", "uid": uid},
        "reason": reason,
        "message": message,
        "type": type_,
        "source": {"component": component, "host": "gpu-node-1"},
        "firstTimestamp": first or last,
        "lastTimestamp": last,
        "count": count,
    }


SCHEDULED = {  # written through events.k8s.io/v1 by the scheduler: eventTime, no timestamps, no source
    "apiVersion": "v1",
    "kind": "Event",
    "metadata": {"name": "llama-worker-2.sched", "namespace": "research", "creationTimestamp": "2026-03-01T11:59:30Z"},
    "involvedObject": {"kind": "Pod", "name": "llama-worker-2", "namespace": "research", "uid": "uid-llama-worker-2-1"},
    "reason": "Scheduled",
    "message": "Successfully assigned research/llama-worker-2 to gpu-node-1",
    "type": "Normal",
    "source": {},
    "reportingComponent": "default-scheduler",
    "eventTime": "2026-03-01T11:59:30.412345Z",
    "firstTimestamp": None,
    "lastTimestamp": None,
}
JOB_EVENTS = [
    event(
        "llama",
        "TrainingJob",
        "WorkerFailed",
        "worker llama-worker-1 exited with code 1: RuntimeError: CUDA error\nTraceback (most recent call last):",
        last="2026-03-01T11:20:00Z",
        type_="Warning",
        component="phalanx",
        uid=UID,
    ),
    event(
        "llama",
        "TrainingJob",
        "GangRestart",
        "fewer than 2 workers left; restarting the gang as attempt 1",
        last="2026-03-01T11:48:00Z",
        type_="Warning",
        component="phalanx",
        uid=UID,
    ),
    # a deleted predecessor of the same name
    event("llama", "TrainingJob", "Succeeded", "old news", last="2026-03-01T10:00:00Z", component="phalanx", uid="old"),
]
POD_EVENTS = [
    SCHEDULED,
    event(
        "llama-worker-0",
        "Pod",
        "Pulled",
        'Container image "example/train:1" already present on machine',
        last="2026-03-01T11:49:05Z",
        first="2026-03-01T11:00:05Z",
        count=2,
    ),
    event("other-worker-0", "Pod", "Pulled", "not this job's", last="2026-03-01T11:49:05Z"),
    event("llama-worker-0", "Pod", "Pulled", "before this job existed", last="2026-03-01T10:30:00Z"),
]


def render(job: dict[str, Any] = JOB, pods: list[dict[str, Any]] = PODS) -> str:
    events = describe_text.job_events(job, JOB_EVENTS, POD_EVENTS)
    return describe_text.describe(job, pods, events, NOW)


def section(text: str, heading: str) -> list[list[str]]:
    """The rows (split on runs of 2+ spaces) of the table under a heading, header row first."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        rows.append([cell for cell in line.strip().split("  ") if cell.strip()])
    return [[cell.strip() for cell in row] for row in rows if not set(row[0]) <= {"-"}]


def fields(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        if not line.startswith(" ") and ":" in line:
            key, _, value = line.partition(":")
            found[key] = value.strip()
    return found


def test_the_status_fields() -> None:
    got = fields(render())
    assert got["Name"] == "llama" and got["Namespace"] == "research"
    assert got["Created"] == "2026-03-01T11:00:00Z (60m ago)"
    assert (got["Phase"], got["Reason"], got["Message"]) == ("Running", "WorkersReady", "3/3 workers ready")
    assert got["Attempt"] == "1"
    assert got["Restarts"] == "2 of 3 allowed (1 left)"
    assert got["Gang Restarts"] == "InPlace (healthy pods kept, processes restarted)"
    assert got["Workers"] == "desired 3 (min 2, max 4), active 3, ready 2, world size 12"
    assert got["Last Checkpoint"] == "step 1200 at 2026-03-01T11:57:30Z (2m30s ago)"
    assert got["Started"] == "2026-03-01T11:00:05Z (59m ago)"
    assert "Completed" not in got and "Next Attempt" not in got


def test_restarts_by_reason_are_listed_one_per_line_in_order() -> None:
    lines = render().splitlines()
    start = lines.index("Restarts By Reason:")
    assert [line.split() for line in lines[start + 1 : start + 4]] == [
        ["NodeLost:", "1"],
        ["OOMKilled:", "1"],
        ["WorkerFailed:", "1"],
    ]


def test_the_conditions_table() -> None:
    rows = section(render(), "Conditions:")
    assert rows == [
        ["Type", "Status", "Reason", "Age", "Message"],
        ["Ready", "True", "WorkersReady", "10m", "3/3 workers ready"],
        ["Reconciling", "False", "WorkersReady", "10m"],
    ]


def test_the_pods_table_puts_the_current_attempt_first_then_the_store_then_older_attempts() -> None:
    text = render()
    rows = section(text, "Pods (current attempt 1 first):")
    assert rows[0] == ["Name", "Worker", "Attempt", "Node", "State", "Ready", "Restarts", "Age", "IP"]
    assert rows[1:] == [
        ["llama-worker-0", "0", "1", "gpu-node-1", "Running", "True", "0", "11m", "10.244.1.7"],
        ["llama-worker-1", "1", "1", "gpu-node-2", "Running", "True", "0", "11m", "10.244.2.9"],
        ["llama-worker-2", "2", "1", "gpu-node-1", "Pending (ContainerCreating)", "False", "0", "30s", "<none>"],
        ["llama-rdzv", "store", "-", "gpu-node-1", "Running", "True", "0", "59m", "10.244.1.2"],
        [
            "llama-worker-0",
            "0",
            "0",
            "gpu-node-1",
            "Terminated (OOMKilled, exit 137), terminating",
            "False",
            "0",
            "59m",
            "10.244.1.7",
        ],
    ]


def test_events_of_the_job_and_its_pods_merged_oldest_first() -> None:
    rows = section(render(), "Events:")
    assert rows[0] == ["Type", "Reason", "Age", "From", "Object", "Message"]
    assert rows[1:] == [
        [
            "Warning",
            "WorkerFailed",
            "40m",
            "phalanx",
            "trainingjob/llama",
            "worker llama-worker-1 exited with code 1: RuntimeError: CUDA error | Traceback (most recent call last):",
        ],
        [
            "Warning",
            "GangRestart",
            "12m",
            "phalanx",
            "trainingjob/llama",
            "fewer than 2 workers left; restarting the gang as attempt 1",
        ],
        [
            "Normal",
            "Pulled",
            "10m (x2 over 59m)",
            "kubelet",
            "pod/llama-worker-0",
            'Container image "example/train:1" already present on machine',
        ],
        [
            "Normal",
            "Scheduled",
            "29s",
            "default-scheduler",
            "pod/llama-worker-2",
            "Successfully assigned research/llama-worker-2 to gpu-node-1",
        ],
    ]


def test_a_job_without_status_pods_or_events_yet() -> None:
    job = copy.deepcopy(JOB)
    job["status"] = {"observedGeneration": 0}
    text = describe_text.describe(job, [], [], NOW)
    got = fields(text)
    assert (got["Phase"], got["Reason"], got["Message"]) == ("<none>", "<none>", "<none>")
    assert got["Restarts"] == "0 of 3 allowed (3 left)"
    assert got["Restarts By Reason"] == "<none>"
    assert "Gang Restarts" not in got  # said once the operator planned the job
    assert got["Workers"] == "desired 3 (min 2, max 4), active 0, ready 0"
    assert (got["Last Checkpoint"], got["Started"], got["Conditions"], got["Pods"], got["Events"]) == ("<none>",) * 5


def test_a_failed_job_shows_its_spent_budget_completion_and_multi_line_message() -> None:
    job = copy.deepcopy(JOB)
    job["status"].update(
        phase="Failed",
        reason="RestartBudgetExhausted",
        message="4 counted failures exceed failurePolicy.maxRestarts 3\nlast: llama-worker-1 OOMKilled",
        restarts=4,
        completionTime="2026-03-01T11:59:00Z",
    )
    text = render(job, [])
    got = fields(text)
    assert got["Restarts"] == "4 of 3 allowed (exhausted)"
    assert got["Completed"] == "2026-03-01T11:59:00Z (60s ago)"
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Message:"))
    message, following = lines[at], lines[at + 1]
    assert message.endswith("4 counted failures exceed failurePolicy.maxRestarts 3")
    assert following == " " * describe_text.FIELD_WIDTH + "last: llama-worker-1 OOMKilled"


def test_a_job_in_backoff_says_when_its_next_attempt_may_start() -> None:
    job = copy.deepcopy(JOB)
    job["status"].update(phase="Restarting", reason="Backoff", restartNotBefore="2026-03-01T12:00:40Z")
    assert fields(render(job))["Next Attempt"] == "not before 2026-03-01T12:00:40Z (in 40s)"


def test_pod_states() -> None:
    failed = pod("a", index=0, attempt=0, phase="Failed", state={"terminated": {"exitCode": 1, "reason": "Error"}})
    evicted = pod("b", index=1, attempt=0, phase="Failed")
    evicted["status"].update(reason="Evicted", containerStatuses=[])
    unschedulable = pod("c", index=2, attempt=0, phase="Pending", node=None)
    unschedulable["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/4 nodes are available"}
        ],
    }
    done = pod("d", index=3, attempt=0, phase="Succeeded", state={"terminated": {"exitCode": 0, "reason": "Completed"}})
    assert [describe_text.pod_state(p) for p in (failed, evicted, unschedulable, done)] == [
        "Terminated (Error, exit 1)",
        "Failed (Evicted)",
        "Pending (Unschedulable)",
        "Terminated (Completed, exit 0)",
    ]


def test_only_pods_the_job_controls_count_as_its_own() -> None:
    stranger = pod("llama-worker-0", index=0, attempt=0, owner={**OWNER, "uid": "predecessor"})
    assert not describe_text.owned_by(stranger, UID)
    assert describe_text.owned_by(PODS[0], UID)


def test_event_names_of_a_jobs_pods() -> None:
    pattern = describe_text.job_pod_name_pattern("a.b")
    assert [bool(pattern.match(n)) for n in ("a.b-worker-0", "a.b-worker-12", "a.b-rdzv", "axb-worker-0")] == [
        True,
        True,
        True,
        False,
    ]
    assert not pattern.match("a.b-worker-worker-0") and not pattern.match("a.b-rdzv-x")


def test_events_of_the_same_second_keep_the_order_they_were_stored_in() -> None:
    stamp = "2026-03-01T11:50:00Z"
    stored = [
        event("llama", "TrainingJob", reason, "m", last=stamp, component="phalanx", uid=UID)
        for reason in ("Rescaling", "WorkerFailed", "WorkersReady")
    ]
    for version, body in zip(("998", "999", "1000"), stored, strict=True):
        body["metadata"]["resourceVersion"] = version
    ordered = describe_text.job_events(JOB, list(reversed(stored)), [])
    assert [e["reason"] for e in ordered] == ["Rescaling", "WorkerFailed", "WorkersReady"]


def test_only_the_newest_events_are_shown_and_the_rest_counted() -> None:
    many = [
        event("llama", "TrainingJob", f"R{i}", "m", last=f"2026-03-01T11:{i:02d}:00Z", component="phalanx", uid=UID)
        for i in range(describe_text.MAX_EVENTS + 5)
    ]
    text = describe_text.describe(JOB, [], describe_text.job_events(JOB, many, []), NOW)
    rows = section(text, "Events (5 older not shown):")
    assert len(rows) == 1 + describe_text.MAX_EVENTS
    assert rows[1][1] == "R5" and rows[-1][1] == f"R{describe_text.MAX_EVENTS + 4}"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (-5, "<invalid>"),
        (-1, "0s"),
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (150, "2m30s"),
        (599, "9m59s"),
        (600, "10m"),
        (3 * 3600 - 1, "179m"),
        (3 * 3600, "3h"),
        (3 * 3600 + 60 * 5, "3h5m"),
        (8 * 3600, "8h"),
        (47 * 3600, "47h"),
        (48 * 3600, "2d"),
        (50 * 3600, "2d2h"),
        (8 * 86400, "8d"),
        (729 * 86400, "729d"),
        (730 * 86400, "2y"),
        (731 * 86400, "2y1d"),
        (9 * 365 * 86400, "9y"),
    ],
)
def test_ages_read_as_kubectl_writes_them(seconds: int, shown: str) -> None:
    assert human_duration(seconds) == shown


def test_the_nodes_a_job_keeps_off_are_listed_with_their_failure() -> None:
    job = copy.deepcopy(JOB)
    job["status"]["avoidedNodes"] = [
        {
            "node": "gpu-7",
            "reason": "GPUError",
            "message": "worker llama-worker-2 exited\nXid 79",
            "until": "2026-03-01T13:00:00Z",
        }
    ]
    assert section(render(job), "Avoided Nodes:") == [
        ["NODE", "REASON", "UNTIL", "FAILURE"],
        ["gpu-7", "GPUError", "2026-03-01T13:00:00Z", "worker llama-worker-2 exited | Xid 79"],
    ]
    assert "Avoided Nodes:" not in render()


def test_where_the_time_went_includes_the_current_state() -> None:
    job = copy.deepcopy(JOB)
    job["status"]["timeByState"] = {
        "queued": 300,
        "starting": 45,
        "training": 2400,
        "recovering": 90,
        "recoveringByCause": {"WorkerFailed": 60, "NodeLost": 30},
        "state": "training",
        "since": "2026-03-01T11:50:00Z",  # 10 minutes before NOW
    }
    got = fields(render(job))
    assert got["Time By State"] == (
        "queued 5m, starting 45s, training 50m, recovering 90s (NodeLost 30s, WorkerFailed 60s), suspended 0s"
    )
    assert got["Effective Training"] == f"{3000 / 3435:.0%} of its time"
    assert "Steps Recomputed" not in got
    job["status"]["recomputedSteps"] = {"total": 12, "reached": 240, "failedAt": "2026-03-01T11:59:00Z"}
    assert fields(render(job))["Steps Recomputed"] == "12 (and the restart at step 240 waits for its new run)"
    assert "Time By State" not in fields(render())


def test_spares_are_counted_with_the_workers_and_listed_beside_the_store() -> None:
    job = copy.deepcopy(JOB)
    job["spec"]["workers"]["spares"] = 2
    job["status"]["workers"]["spares"] = 1
    spare = pod("llama-spare-3", role="spare", attempt=1, node="gpu-node-3", ip="10.244.3.4")
    text = render(job, [*PODS, spare])
    assert fields(text)["Workers"] == "desired 3 (min 2, max 4), active 3, ready 2, world size 12; spares 1 ready of 2"
    rows = section(text, "Pods (current attempt 1 first):")
    assert ["llama-spare-3", "spare", "-", "gpu-node-3", "Running", "True", "0", "11m", "10.244.3.4"] in rows


def test_ranks_in_the_rendezvous_order_with_each_nodes_domain() -> None:
    rack = "topology.phalanx.dev/rack"
    job = copy.deepcopy(JOB)
    job["spec"]["placement"] = {"topology": {"key": rack, "mode": "preferred"}}
    job["status"]["placement"] = {"key": rack, "domain": "rack-b"}
    pods = [
        pod("llama-worker-0", index=0, attempt=1, node="n1", ip="10.244.1.7"),
        pod("llama-worker-1", index=1, attempt=1, node="n2", ip="10.244.10.3"),
        pod("llama-worker-2", index=2, attempt=1, node="n3", ip="10.244.2.9"),
        pod("llama-worker-0", index=0, attempt=0, node="n9", ip="10.244.0.1", deleting=True, phase="Failed"),
    ]
    labels = {"n1": {rack: "rack-b"}, "n2": {rack: "rack-a"}, "n3": {rack: "rack-b"}}
    text = describe_text.describe(job, pods, [], NOW, labels)
    assert fields(text)["Placement"] == f"{rack} preferred: rack-b"
    # torch sorts the agents' addresses as strings: 10.244.1.7 < 10.244.10.3 < 10.244.2.9
    assert section(text, "Ranks (")[1:] == [
        ["0", "llama-worker-0", "n1", "rack-b"],
        ["1", "llama-worker-1", "n2", "rack-a"],
        ["2", "llama-worker-2", "n3", "rack-b"],
    ]
    static = copy.deepcopy(job)
    static["spec"]["launcher"] = "static"
    assert [row[:2] for row in section(describe_text.describe(static, pods, [], NOW, labels), "Ranks (")[1:]] == [
        ["0", "llama-worker-0"],
        ["1", "llama-worker-1"],
        ["2", "llama-worker-2"],
    ]


def test_the_preemption_cost_is_shown_while_the_job_has_one() -> None:
    assert "Preemption Cost" not in fields(render())
    cost = {"lostSeconds": 150, "restartSeconds": 40, "gpus": 8, "workers": 1, "gpuSeconds": 1520, "boost": 2}
    job = {**JOB, "status": {**JOB["status"], "preemptionCost": cost}}
    assert fields(render(job))["Preemption Cost"] == (
        "1520 GPU-seconds (150s since the checkpoint + 40s to restart), Kueue boost 2"
    )
    cpu = {**cost, "gpus": 0, "gpuSeconds": 0, "workerSeconds": 190}
    del cpu["boost"]
    job = {**JOB, "status": {**JOB["status"], "preemptionCost": cpu}}
    assert fields(render(job))["Preemption Cost"] == "190 worker-seconds (150s since the checkpoint + 40s to restart)"
    # outside Kueue a job that reports no progress is not written for its cost alone: say as of when
    dated = {**cpu, "time": "2026-03-01T11:57:00.250Z"}
    job = {**JOB, "status": {**JOB["status"], "preemptionCost": dated}}
    assert fields(render(job))["Preemption Cost"] == (
        "190 worker-seconds (150s since the checkpoint + 40s to restart), as of 2m59s ago"
    )


def grouped_worker(index: int, generation: int, *, ready: bool = True) -> dict[str, Any]:
    body = pod(f"llama-worker-{index}", index=index, attempt=1, ready=ready)
    body["metadata"]["labels"]["phalanx.dev/replica-group"] = str(index // 2)
    body["metadata"]["labels"]["phalanx.dev/group-generation"] = str(generation)
    return body


def test_replica_groups_are_listed_with_their_ready_workers_restarts_and_domain() -> None:
    job = copy.deepcopy(JOB)
    job["spec"]["workers"] = {"min": 2, "max": 6, "desired": 6}
    job["spec"]["replicaGroups"] = {"size": 2, "min": 2, "topology": "example.com/rack"}
    job["status"]["replicaGroups"] = [
        {"index": 0, "generation": 0, "ready": True, "restarts": 0, "domain": "rack-a"},
        {"index": 1, "generation": 2, "ready": False, "restarts": 2},  # coming back, not bound yet
        {"index": 2, "generation": 0, "ready": False, "restarts": 0, "domain": "rack-b"},
    ]
    pods = [
        grouped_worker(0, 0),
        grouped_worker(1, 0),
        grouped_worker(2, 1),  # the group's old generation, on its way out: not counted
        grouped_worker(3, 2),
        grouped_worker(4, 0),
        grouped_worker(5, 0, ready=False),
    ]
    text = render(job, pods)
    assert "Replica Groups (size 2, min 2, topology example.com/rack):" in text
    assert section(text, "Replica Groups") == [
        ["GROUP", "GENERATION", "READY", "RESTARTS", "DOMAIN"],
        ["0", "0", "2/2", "0", "rack-a"],
        ["1", "2", "1/2", "2", "<none>"],
        ["2", "0", "1/2", "0", "rack-b"],
    ]


def test_a_job_without_replica_groups_has_no_groups_block() -> None:
    assert "Replica Groups" not in render()
    job = copy.deepcopy(JOB)
    job["spec"]["replicaGroups"] = {"size": 1}
    job["status"].pop("replicaGroups", None)
    assert section(render(job), "Replica Groups") == [["<none>"]]


def test_a_save_now_request_and_what_saves_on_a_notice_kept_are_shown() -> None:
    assert "Save Now" not in fields(render()) and "Saved On Notice" not in fields(render())
    request = {"token": "t2", "requestedAt": "2026-12-01T10:00:00Z", "savedToken": "t1", "step": 40}
    savings = {"stops": 2, "gpuSeconds": 480, "workerSeconds": 120}
    job = {**JOB, "status": {**JOB["status"], "saveNow": request, "noticeSavings": savings}}
    shown = fields(render(job))
    assert shown["Save Now"] == "t2 asked at 2026-12-01T10:00:00Z, waiting for a checkpoint"
    assert shown["Saved On Notice"] == "2 stops, 480 GPU-seconds, 120 worker-seconds kept"
    answered = {**request, "savedToken": "t2", "step": 53}
    job = {**JOB, "status": {**JOB["status"], "saveNow": answered}}
    assert fields(render(job))["Save Now"] == "t2 asked at 2026-12-01T10:00:00Z, saved at step 53"
    refused = {"message": "metadata.annotations['phalanx.dev/save-now'] 'a b' is ignored"}
    job = {**JOB, "status": {**JOB["status"], "saveNow": refused}}
    assert fields(render(job))["Save Now"] == refused["message"]
