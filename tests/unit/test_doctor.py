"""The judgements of ``phalanx doctor`` (pure: they take what was read from the cluster)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from phalanx.api import crd
from phalanx.cli import doctor

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def installed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "status": {"conditions": [{"type": "Established", "status": "True"}]}}


def test_the_crd_is_judged_by_the_fields_of_its_schema() -> None:
    expected = crd.custom_resource_definition()
    assert doctor.judge_crd(None, expected, "1.0").verdict == "problem"
    assert doctor.judge_crd(installed(expected), expected, "1.0").verdict == "ok"
    old = copy.deepcopy(expected)
    del old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["gang"]
    finding = doctor.judge_crd(installed(old), expected, "1.0")
    assert finding.verdict == "problem" and "lacks spec.gang," in finding.message, finding
    newer = doctor.judge_crd(installed(expected), old, "1.0")
    assert newer.verdict == "warning" and "newer" in newer.message
    pending = {**expected, "status": {"conditions": [{"type": "Established", "status": "False", "message": "x"}]}}
    assert doctor.judge_crd(pending, expected, "1.0").verdict == "problem"


def lease(renewed: datetime) -> dict[str, Any]:
    spec = {"holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": renewed.isoformat()}
    return {"metadata": {"name": "phalanx-operator", "namespace": "ops"}, "spec": spec}


def test_the_operator_is_found_by_its_lease_its_pods_or_its_jobs() -> None:
    assert doctor.judge_operator([lease(NOW - timedelta(seconds=5))], [], [], NOW).verdict == "ok"
    stale = doctor.judge_operator([lease(NOW - timedelta(minutes=2))], [], [], NOW)
    assert stale.verdict == "problem" and "no replica leads" in stale.message
    pod = {"metadata": {"name": "phalanx-0", "namespace": "ops"}, "status": {"phase": "Running"}}
    assert doctor.judge_operator([], [pod], [], NOW).verdict == "ok"
    crashing = {**pod, "status": {"phase": "Pending"}}
    assert doctor.judge_operator([], [crashing], [], NOW).verdict == "problem"
    created = (NOW - timedelta(minutes=5)).isoformat()
    waiting = {"metadata": {"name": "j", "creationTimestamp": created}}
    assert "no status" in doctor.judge_operator([], [], [waiting], NOW).message
    served = {**waiting, "status": {"phase": "Running"}}
    assert doctor.judge_operator([], [], [served], NOW).verdict == "ok"
    assert doctor.judge_operator(None, None, None, NOW).verdict == "warning"
    assert doctor.judge_operator([], [], [], NOW).verdict == "problem"


def test_devices_a_worker_needs_must_be_offered_by_some_node() -> None:
    gpu_node = {"cpu": Decimal(32), "nvidia.com/gpu": Decimal(8)}
    cpu_node = {"cpu": Decimal(32)}
    per_worker = {"cpu": Decimal(1), "nvidia.com/gpu": Decimal(4)}
    assert doctor.judge_devices("j", {"cpu": Decimal(1)}, 2, [cpu_node]).verdict == "ok"
    assert "no schedulable node offers" in doctor.judge_devices("j", per_worker, 2, [cpu_node]).message
    assert doctor.judge_devices("j", per_worker, 2, [gpu_node, cpu_node]).verdict == "ok"
    assert "at most 2 worker" in doctor.judge_devices("j", per_worker, 3, [gpu_node]).message
    summary = doctor.describe_devices([gpu_node, cpu_node], ["gpu.nvidia.com"])
    assert "8 nvidia.com/gpu" in summary.message and "gpu.nvidia.com" in summary.message


def test_access_and_pod_security_findings() -> None:
    allowed = {("trainingjobs", "", "create"): False, ("pods", "log", "get"): True}
    assert "may not create trainingjobs" in doctor.judge_access("ns", allowed).message
    assert doctor.judge_access("ns", dict.fromkeys(allowed, True)).verdict == "ok"
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    refused = doctor.judge_pod_security("ns", labels, {"w-0": 'pods "w-0" is forbidden: violates PodSecurity ...'})
    assert refused.verdict == "problem" and refused.check == "pod security"
    quota = doctor.judge_pod_security("ns", labels, {"w-0": "exceeded quota"})
    assert quota.check == "admission"
    assert doctor.judge_pod_security("ns", labels, {"w-0": None}).verdict == "ok"
    assert doctor.judge_pod_security("ns", labels, {"w-0": None}, "cannot create pods").verdict == "warning"
    assert doctor.judge_gang("volcano", "j", False, None, None).verdict == "problem"
    assert doctor.judge_gang("kueue", "j", True, "q", False).verdict == "problem"
    assert doctor.judge_gang("kueue", "j", True, "q", True).verdict == "ok"


def test_a_job_whose_dra_device_class_is_missing_is_told_so() -> None:
    assert doctor.judge_device_classes("j", [], ["gpu.nvidia.com"]) is None
    served = doctor.judge_device_classes("j", ["gpu.nvidia.com"], ["gpu.nvidia.com"])
    assert served is not None and served.verdict == "ok"
    missing = doctor.judge_device_classes("j", ["gpu.example.com"], ["gpu.nvidia.com"])
    assert missing is not None and missing.verdict == "problem" and "no DeviceClass is named" in missing.message
    old = doctor.judge_device_classes("j", ["gpu.nvidia.com"], None)
    assert old is not None and "does not serve resource.k8s.io/v1" in old.message
