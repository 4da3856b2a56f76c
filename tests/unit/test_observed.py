"""Projection of API objects onto compact records, and failure classification."""

from __future__ import annotations

import json
import sys
from typing import Any

from phalanx.reconcile import naming
from phalanx.reconcile.failures import classify
from phalanx.reconcile.observed import PodRecord, pod_record


def pod(**status: Any) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": "demo-worker-1",
            "labels": {naming.ROLE_LABEL: "worker", naming.WORKER_INDEX_LABEL: "1", naming.ATTEMPT_LABEL: "2"},
            "annotations": {naming.CONTAINER_ANNOTATION: "trainer"},
            "managedFields": [{"x": "y" * 500}],
        },
        "spec": {"nodeName": "gpu-3", "containers": [{"name": "sidecar"}, {"name": "trainer"}]},
        "status": status,
    }


def test_record_reads_the_trainer_container_and_conditions() -> None:
    record = pod_record(
        pod(
            phase="Failed",
            podIP="10.1.2.3",
            conditions=[
                {"type": "Ready", "status": "False"},
                {"type": "PodScheduled", "status": "True"},
                {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"},
            ],
            containerStatuses=[
                {"name": "sidecar", "state": {"running": {}}},
                {
                    "name": "trainer",
                    "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "message": "oom"}},
                },
            ],
        )
    )
    assert record == PodRecord(
        name="demo-worker-1",
        role="worker",
        index=1,
        attempt=2,
        phase="Failed",
        scheduled=True,
        node_name="gpu-3",
        pod_ip="10.1.2.3",
        exit_code=137,
        terminated_reason="OOMKilled",
        termination_message="oom",
        disruption_reason="PreemptionByScheduler",
    )


def test_record_is_much_smaller_than_the_pod_dict() -> None:
    raw = pod(phase="Running")
    record = pod_record(raw)
    size = sys.getsizeof(record) + sum(sys.getsizeof(getattr(record, f)) for f in record.__slots__)
    assert size < 1500


def test_classification() -> None:
    cases = [
        (PodRecord("p", "worker", waiting_reason="ErrImagePull"), ("ImagePullFailed", False, "fail")),
        (
            PodRecord("p", "worker", waiting_reason="CreateContainerConfigError"),
            ("InvalidPodConfiguration", False, "fail"),
        ),
        (
            PodRecord("p", "worker", phase="Failed", disruption_reason="EvictionByEvictionAPI"),
            ("Evicted", False, "replace"),
        ),
        (
            PodRecord("p", "worker", phase="Failed", disruption_reason="DeletionByTaintManager"),
            ("NodeLost", False, "replace"),
        ),
        (PodRecord("p", "worker", phase="Failed", reason="Evicted"), ("Evicted", False, "replace")),
        (PodRecord("p", "worker", phase="Failed", reason="OutOfnvidia.com/gpu"), ("NodeRejected", False, "replace")),
        (
            PodRecord("p", "worker", phase="Failed", exit_code=137, terminated_reason="OOMKilled"),
            ("OOMKilled", True, "replace"),
        ),
        (
            PodRecord("p", "worker", phase="Failed", exit_code=1, terminated_reason="Error"),
            ("WorkerFailed", True, "replace"),
        ),
    ]
    for record, (reason, counted, action) in cases:
        failure = classify(record)
        assert failure is not None
        assert (failure.reason, failure.counted, failure.action) == (reason, counted, action), record
    lost = classify(PodRecord("p", "worker", phase="Running", node_name="n"), node_lost="was deleted")
    assert lost is not None
    assert (lost.reason, lost.message) == ("NodeLost", "worker p is on node n, which was deleted")
    assert classify(PodRecord("p", "worker", phase="Running")) is None
    assert classify(PodRecord("p", "worker", phase="Succeeded")) is None


def test_error_file_reaches_the_message() -> None:
    failure = classify(
        PodRecord(
            "demo-worker-0",
            "worker",
            phase="Failed",
            exit_code=1,
            termination_message='{"message": {"message": "RuntimeError: boom"}}',
        )
    )
    assert failure is not None and "RuntimeError: boom" in failure.message


def test_torchrun_error_file_is_reduced_to_its_error_line() -> None:
    error_file = json.dumps(
        {
            "message": {
                "message": "ValueError: The last_call timeout (0:00:00) must be positive.",
                "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"},
            }
        }
    )
    failure = classify(
        PodRecord(
            "demo-worker-0",
            "worker",
            phase="Failed",
            exit_code=1,
            terminated_reason="Error",
            termination_message=error_file,
        )
    )
    assert failure is not None
    assert failure.message == (
        "worker demo-worker-0 exited with code 1 (Error): ValueError: The last_call timeout (0:00:00) must be positive."
    )


def test_values_read_from_a_pod_are_bounded_and_checked_and_the_rest_ignored() -> None:
    """Labels and annotations on worker pods are the tenant's to edit: a value too long or of the
    wrong form is treated as absent, and the record names its key (for one Warning Event)."""
    raw = pod(phase="Running")
    raw["metadata"]["labels"][naming.ATTEMPT_LABEL] = "-1"
    raw["metadata"]["annotations"] = {
        naming.RANK_ADDRESS_ANNOTATION: "a" * (240 * 1024),
        naming.DOMAIN_ANNOTATION: "rack 7; drop table",
        naming.RENDEZVOUS_ID_ANNOTATION: "5f1c0d2e-3",
        naming.KUEUE_TOTAL_COUNT_ANNOTATION: "9" * 5000,
        naming.CONTAINER_ANNOTATION: "Trainer!",
        "example.com/notes": "x" * (240 * 1024),  # not read: never copied
    }
    record = pod_record(raw)
    assert (record.attempt, record.rank_address, record.domain, record.group_total) == (None, None, None, None)
    assert record.rendezvous_id == "5f1c0d2e-3"
    assert set(record.ignored) == {
        naming.ATTEMPT_LABEL,
        naming.RANK_ADDRESS_ANNOTATION,
        naming.DOMAIN_ANNOTATION,
        naming.KUEUE_TOTAL_COUNT_ANNOTATION,
        naming.CONTAINER_ANNOTATION,
    }
    size = sum(sys.getsizeof(getattr(record, f)) for f in record.__slots__)
    assert size < 2000
    assert pod_record(pod(phase="Running")).ignored == ()
