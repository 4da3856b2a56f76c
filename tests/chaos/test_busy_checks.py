"""The chaos tier's busy-cluster checks (tests/chaos/driver.py) on hand-written jobs and pods: a
required gang in two racks and a job short of a worker beside a ready spare are flagged, their
legitimate look-alikes are not; and the silent endpoints take connections and never answer."""

from __future__ import annotations

import pathlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from phalanx.reconcile import naming
from tests.chaos import driver, hostile
from tests.chaos.driver import ChaosConfig, ChaosRun


def job(uid: str, attempt: int = 1, desired: int = 2, *, required: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"workers": {"desired": desired}}
    if required:
        spec["placement"] = {"topology": {"key": "rack", "mode": "required"}}
    return {
        "metadata": {"name": f"job-{uid}", "uid": uid},
        "spec": spec,
        "status": {"phase": "Running", "attempt": attempt},
    }


def pod(
    owner: str,
    name: str,
    node: str,
    *,
    attempt: int = 1,
    index: int | None = None,
    role: str = naming.ROLE_WORKER,
    phase: str = "Running",
    ready: bool = True,
) -> dict[str, Any]:
    labels = {naming.ROLE_LABEL: role, naming.ATTEMPT_LABEL: str(attempt)}
    if index is not None:
        labels[naming.WORKER_INDEX_LABEL] = str(index)
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "labels": labels, "ownerReferences": [{"uid": owner}]},
        "spec": {"nodeName": node},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


@pytest.fixture
def run(tmp_path: pathlib.Path) -> Iterator[ChaosRun]:
    chaos = ChaosRun(ChaosConfig(racks=(2, 1), held_share=0.5), tmp_path)
    chaos.started = 0.0
    chaos.rack_of = {"a0": "rack-a", "a1": "rack-a", "b0": "rack-b"}
    yield chaos
    chaos.silent.close()


def test_a_required_gang_whose_attempt_spans_two_racks_is_flagged_once(run: ChaosRun) -> None:
    jobs = {"split": job("s"), "whole": job("w"), "free": job("f", required=False)}
    pods = [
        pod("s", "s-0", "a0", index=0),
        pod("s", "s-1", "b0", index=1),
        pod("w", "w-0", "a0", index=0),
        pod("w", "w-1", "a1", index=1),
        pod("w", "w-old", "b0", attempt=0, index=1, phase="Running"),  # an old attempt's, on its way out
        pod("f", "f-0", "a0", index=0),
        pod("f", "f-1", "b0", index=1),  # preferred or no placement: racks may mix
    ]
    run._check_racks(jobs, pods)
    run._check_racks(jobs, pods)
    assert len(run.report.violations) == 1 and "job-s must run in one rack" in run.report.violations[0]


def test_a_job_short_of_a_worker_beside_a_ready_spare_is_flagged_after_the_grace_of_a_leader_at_work(
    run: ChaosRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    leading = True
    monkeypatch.setattr(run, "_leader", lambda: object() if leading else None)
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    jobs = {"short": job("s"), "unready": job("u"), "full": job("f")}
    pods = [
        pod("s", "s-0", "a0", index=0),
        pod("s", "s-1", "a0", index=1, phase="Failed"),
        pod("s", "s-spare-0", "a1", role=naming.ROLE_SPARE),
        pod("u", "u-0", "a0", index=0),
        pod("u", "u-spare-0", "a1", role=naming.ROLE_SPARE, ready=False),  # no ready spare: nothing to promote
        pod("f", "f-0", "a0", index=0),
        pod("f", "f-1", "a0", index=1),
        pod("f", "f-spare-0", "a1", role=naming.ROLE_SPARE),
    ]
    for _ in range(int(driver.SPARE_GRACE) * 3):  # a leader away: no time counts
        leading = False
        now[0] += 1.0
        run._check_spares(jobs, pods)
    assert run.report.violations == [] and run.report.spares_ready_while_short == 1
    leading = True
    for _ in range(int(driver.SPARE_GRACE) + 2):
        now[0] += 1.0
        run._check_spares(jobs, pods)
    assert len(run.report.violations) == 1, run.report.violations
    assert "job-s (attempt 1) short of workers [1]" in run.report.violations[0]


def test_silent_endpoints_take_a_connection_and_never_answer_until_removed() -> None:
    silent = hostile.SilentEndpoints()
    try:
        silent.add("127.77.250.1", driver.METRICS_PORT)
        with socket.create_connection(("127.77.250.1", driver.METRICS_PORT), timeout=2) as client:
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            client.settimeout(0.3)
            with pytest.raises(TimeoutError):
                client.recv(1)
            silent.pump()
            assert silent.accepted == 1
        silent.remove("127.77.250.1", driver.METRICS_PORT)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.77.250.1", driver.METRICS_PORT), timeout=2)
    finally:
        silent.close()
